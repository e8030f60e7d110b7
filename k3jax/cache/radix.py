"""Radix prefix tree for hybrid (KDA + MLA) state: KV pages on the edges, sparse recurrent
checkpoints on the nodes (host side, no jax).

- Edges hold token ids and their KV page ids; every edge is a whole number of pages, so matching
  and splitting happen at page boundaries.
- A node may hold one recurrent checkpoint (a state slot) of the sequence that ends at it, and only
  at chunk-aligned depths (`align = lcm(64, page_size)`).
- Locks (`lock`/`unlock`, counted along the path to the root) keep a running request's KV alive;
  pins (`pin_ckpt`) keep a checkpoint alive until the step that restores from it is issued.
- Checkpoints are kept sparse: a new checkpoint supersedes the ones above it on non-branching
  nodes, a per-path cap bounds the rest on every root-to-leaf path (LRU), and slot pressure evicts
  LRU checkpoints. Evicting only a checkpoint leaves a tombstone (the KV stays, a later match replays
  from a shallower checkpoint). Evicting KV removes unlocked leaves, least recently used first, with
  their checkpoints.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass


_SERIAL = itertools.count()  # creation order: the LRU tie-break (never id(), which differs per process)


class Node:
    __slots__ = ("parent", "children", "key", "pages", "depth", "ckpt", "branch", "lock", "pins", "last_access",
                 "serial")

    def __init__(self, parent, key: tuple, pages: list, depth: int):
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.key = key  # token ids of the edge into this node
        self.pages = pages  # KV page ids of the edge (len(key) // page_size)
        self.depth = depth  # tokens from the root to the end of this node's edge
        self.ckpt: int | None = None  # state slot of the recurrent checkpoint at `depth`
        self.branch = False  # the checkpoint was planted at a branch point (kept when superseded)
        self.lock = 0  # running requests that read this node's KV (own or descendants)
        self.pins = 0  # pending restores from this node's checkpoint
        self.last_access = 0
        self.serial = next(_SERIAL)

    def __repr__(self):
        return f"Node(depth={self.depth}, edge={len(self.key)}, ckpt={self.ckpt}, lock={self.lock})"


@dataclass
class Match:
    kv_len: int  # tokens whose KV the tree holds (page aligned)
    node: Node  # deepest node matched in full
    ckpt_node: Node | None  # deepest checkpoint node on the matched path (None: none)

    @property
    def ckpt_depth(self) -> int:
        return self.ckpt_node.depth if self.ckpt_node is not None else 0


class RadixTree:
    def __init__(self, page_size: int, max_ckpt_per_path: int = 4, chunk: int = 64, supersede: bool = True,
                 max_checkpoints: int | None = None):
        self.page_size = page_size
        self.supersede = supersede
        self.max_checkpoints = max_checkpoints  # total budget (LRU beyond it); None: the slot pool bounds it
        self.align = math.lcm(chunk, page_size)
        self.max_ckpt_per_path = max_ckpt_per_path
        self.root = Node(None, (), [], 0)
        self.root.lock = 1  # never evicted
        self._clock = itertools.count(1)
        self.ckpt_nodes: set[Node] = set()
        self.num_pages = 0

    # ---- lookup -----------------------------------------------------------------------------
    def _first(self, tokens, pos: int) -> tuple:
        return tuple(tokens[pos: pos + self.page_size])

    def _common_pages(self, key: tuple, tokens, pos: int) -> int:
        """Whole pages of `key` equal to tokens[pos:]."""
        ps, n = self.page_size, 0
        limit = min(len(key), len(tokens) - pos) // ps
        while n < limit and tuple(tokens[pos + n * ps: pos + (n + 1) * ps]) == key[n * ps:(n + 1) * ps]:
            n += 1
        return n

    def match(self, tokens) -> Match:
        node, pos, ckpt = self.root, 0, None
        ps = self.page_size
        while pos + ps <= len(tokens):
            child = node.children.get(self._first(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n * ps < len(child.key):
                pos += n * ps
                break
            node, pos = child, pos + len(child.key)
            if node.ckpt is not None:
                ckpt = node
        return Match(kv_len=pos, node=node, ckpt_node=ckpt)

    @staticmethod
    def path_pages(node: Node) -> list[int]:
        out: list[list[int]] = []
        while node is not None:
            out.append(node.pages)
            node = node.parent
        return [p for pages in reversed(out) for p in pages]

    def touch(self, node: Node) -> None:
        t = next(self._clock)
        while node is not None:
            node.last_access = t
            node = node.parent

    # ---- locks --------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not None:
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock -= 1
            if node.lock < 0:
                raise RuntimeError("radix tree lock count went negative")
            node = node.parent

    def pin_ckpt(self, node: Node) -> None:
        node.pins += 1

    def unpin_ckpt(self, node: Node) -> None:
        node.pins -= 1
        if node.pins < 0:
            raise RuntimeError("checkpoint pin count went negative")

    # ---- insert -------------------------------------------------------------------------------
    def _split(self, child: Node, k: int) -> Node:
        """Cut child's edge after k tokens; returns the new node ending at the cut."""
        ps = self.page_size
        parent = child.parent
        mid = Node(parent, child.key[:k], child.pages[: k // ps], parent.depth + k)
        mid.lock, mid.last_access = child.lock, child.last_access
        child.key, child.pages, child.parent = child.key[k:], child.pages[k // ps:], mid
        mid.children[child.key[:ps]] = child
        parent.children[mid.key[:ps]] = mid
        return mid

    def insert(self, tokens, pages) -> tuple[Node, list[int]]:
        """Add tokens (a whole number of pages) with their KV pages. Returns the node that ends at
        len(tokens) and the pages the tree took over (those it did not already hold)."""
        ps = self.page_size
        if len(tokens) % ps or len(pages) != len(tokens) // ps:
            raise ValueError("insert takes whole pages of tokens and one page id per page")
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(self._first(tokens, pos))
            if child is None:
                new = Node(node, tuple(tokens[pos:]), list(pages[pos // ps:]), len(tokens))
                new.last_access = node.last_access
                node.children[new.key[:ps]] = new
                self.num_pages += len(new.pages)
                return new, list(new.pages)
            n = self._common_pages(child.key, tokens, pos)
            if n * ps < len(child.key):
                child = self._split(child, n * ps)
            node, pos = child, pos + n * ps
        return node, []

    # ---- checkpoints --------------------------------------------------------------------------
    def set_checkpoint(self, node: Node, slot: int, branch: bool = False) -> list[int]:
        """Give `slot` (a snapshot of the state at node.depth) to `node`; `branch` marks a
        checkpoint planted for a branch point. Returns the slots the caller must free: `slot`
        itself if the node already has one, superseded checkpoints, or LRU ones over the cap."""
        if node is self.root or node.depth % self.align:
            raise ValueError(f"checkpoints only at chunk-aligned depths (multiples of {self.align}), got {node.depth}")
        if node.ckpt is not None:
            node.branch |= branch
            return [slot]
        node.ckpt, node.branch = slot, branch
        self.ckpt_nodes.add(node)
        on_path = []
        n = node.parent
        while n is not None:
            if n.ckpt is not None:
                on_path.append(n)
            n = n.parent
        # a checkpoint that is not a branch point (a leaf's or a chunk end's, on a node with one
        # child) is superseded by this deeper one for every request that reaches it; branch-point
        # checkpoints serve several paths and stay
        freed = [self._drop_ckpt(n) for n in on_path
                 if self.supersede and not n.branch and len(n.children) <= 1 and n.pins == 0]
        # the cap holds on every root-to-leaf path through the node: a checkpoint planted above deeper
        # ones (a shorter prompt after a longer one) counts on their paths too. The least recently used
        # unpinned ones of the fullest path go, never the new one; pinned ones may keep a path over the cap
        while True:
            path = [n for n in on_path if n.ckpt is not None] + self._fullest_path_below(node)
            excess = len(path) + 1 - self.max_ckpt_per_path
            victims = sorted((n for n in path if n.pins == 0), key=lambda n: (n.last_access, n.serial))[:max(excess, 0)]
            if not victims:
                break
            freed += [self._drop_ckpt(v) for v in victims]
        if self.max_checkpoints is not None and len(self.ckpt_nodes) > self.max_checkpoints:
            self.touch(node)  # the newest checkpoint is not the victim
            freed += self.evict_checkpoints(len(self.ckpt_nodes) - self.max_checkpoints)
        return freed

    def _fullest_path_below(self, node: Node) -> list[Node]:
        """The checkpoint nodes of the downward path from `node` (itself excluded) that holds the most (ties:
        the one ending at the oldest node, never an order that differs between processes). It walks up from
        each checkpoint (as many as slots), not down the subtree (a shared prefix's can be the whole tree)."""
        if not node.children:
            return []
        best, best_serial = [], -1
        for c in self.ckpt_nodes:
            chain, x = [], c
            while x is not None and x.depth > node.depth:
                if x.ckpt is not None:
                    chain.append(x)
                x = x.parent
            if x is node and chain and (len(chain), -c.serial) > (len(best), -best_serial):
                best, best_serial = chain, c.serial
        return best

    def _drop_ckpt(self, node: Node) -> int:
        slot, node.ckpt, node.branch = node.ckpt, None, False
        self.ckpt_nodes.discard(node)
        return slot

    def evict_checkpoints(self, n: int) -> list[int]:
        """Tombstone up to n unpinned checkpoints, least recently used first; returns their slots."""
        victims = heapq.nsmallest(n, (x for x in self.ckpt_nodes if x.pins == 0), key=lambda x: (x.last_access, x.serial))
        return [self._drop_ckpt(v) for v in victims]

    def evict_kv(self, n_pages: int) -> tuple[list[int], list[int]]:
        """Remove unlocked leaves (LRU first) until n_pages pages are freed or none is left.
        Returns (freed pages, freed checkpoint slots)."""
        heap = [(x.last_access, x.serial, x) for x in self._leaves() if x.lock == 0]
        heapq.heapify(heap)
        pages: list[int] = []
        slots: list[int] = []
        while heap and len(pages) < n_pages:
            _, _, leaf = heapq.heappop(heap)
            pages.extend(leaf.pages)
            self.num_pages -= len(leaf.pages)
            if leaf.ckpt is not None:
                slots.append(self._drop_ckpt(leaf))
            parent = leaf.parent
            del parent.children[leaf.key[: self.page_size]]
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        return pages, slots

    # ---- inspection ---------------------------------------------------------------------------
    def nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _leaves(self):
        return (n for n in self.nodes() if not n.children and n is not self.root)

    def all_pages(self) -> list[int]:
        return [p for n in self.nodes() for p in n.pages]

    def all_ckpt_slots(self) -> list[int]:
        return [n.ckpt for n in self.ckpt_nodes]

    def check(self) -> None:
        """Structural invariants; raises AssertionError naming the first violation."""
        ps = self.page_size
        seen_ckpt = set()
        for n in self.nodes():
            if n is self.root:
                continue
            assert len(n.key) > 0 and len(n.key) % ps == 0, f"{n}: edge is not whole pages"
            assert len(n.pages) == len(n.key) // ps, f"{n}: pages do not match the edge"
            assert n.depth == n.parent.depth + len(n.key), f"{n}: depth mismatch"
            assert n.parent.children.get(n.key[:ps]) is n, f"{n}: parent does not index it"
            assert n.lock >= sum(c.lock for c in n.children.values()), f"{n}: lock below its children's"
            assert n.lock >= 0 and n.pins >= 0
            if n.ckpt is not None:
                assert n.depth % self.align == 0, f"{n}: checkpoint at an unaligned depth"
                seen_ckpt.add(n)
            if n.pins:
                assert n.ckpt is not None and n.lock > 0, f"{n}: pinned without a locked checkpoint"
        assert seen_ckpt == self.ckpt_nodes, "checkpoint index out of sync"
        assert self.num_pages == len(self.all_pages()), "page count out of sync"
