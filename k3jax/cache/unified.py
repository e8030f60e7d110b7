"""Unified memory (host side): one byte budget for KDA state blocks and MLA KV pages.

State blocks fill the budget from the low end, KV pages from the high end; the free space is always
one hole in the middle. Freeing a block in the middle moves the last block of that end into the gap
(a device copy, queued here and applied at the start of the next step, before anything reads it),
so both ends stay dense. Holders keep stable *virtual* ids (slot ids, page ids); only the
virtual -> physical maps change, and the host translates ids when it packs a step. Every operation
is O(1) plus O(1) moves; nothing scans the pool.

Physical ids: state block b lives at bytes [b * block_bytes, (b + 1) * block_bytes); KV page q at
[total - (q + 1) * page_bytes, total - q * page_bytes). Virtual slot 0 / page 0 are the sinks and
stay at physical 0 of their end.
"""

from __future__ import annotations


class _End:
    """One end of the buffer: dense physical ids 0..n-1, virtual ids mapped onto them."""

    def __init__(self, kind: str):
        self.kind = kind
        self.v2p: dict[int, int] = {0: 0}  # the sink
        self.p2v: list[int] = [0]
        self.free_virtual: list[int] = []
        self.next_virtual = 1

    @property
    def n(self) -> int:
        return len(self.p2v)

    def add(self) -> int:
        v = self.free_virtual.pop() if self.free_virtual else self.next_virtual
        if v == self.next_virtual:
            self.next_virtual += 1
        self.v2p[v] = len(self.p2v)
        self.p2v.append(v)
        return v

    def remove(self, v: int) -> tuple[int, int] | None:
        """Drop virtual id v; returns the move (src_phys, dst_phys) that keeps the end dense."""
        if v <= 0 or v not in self.v2p:
            raise RuntimeError(f"double free or invalid {self.kind} id {v}")
        p = self.v2p.pop(v)
        last = len(self.p2v) - 1
        moved_v = self.p2v.pop()
        self.free_virtual.append(v)
        if p == last:
            return None
        self.p2v[p] = moved_v
        self.v2p[moved_v] = p
        return last, p


class UnifiedMemory:
    """The shared budget. `slots` and `pages` are allocator facades with the interface of
    `SlotPool` / `PagePool`, so the scheduler runs unchanged on top of them."""

    def __init__(self, total_bytes: int, block_bytes: int, page_bytes: int, page_size: int, min_slots: int = 4):
        if total_bytes < (min_slots * block_bytes + 2 * page_bytes):
            raise ValueError(f"unified budget {total_bytes} B holds fewer than {min_slots} state blocks of "
                             f"{block_bytes} B plus two pages of {page_bytes} B")
        self.total = total_bytes
        self.block_bytes, self.page_bytes = block_bytes, page_bytes
        self.blocks, self.kv = _End("slot"), _End("page")
        self.moves: list[tuple[str, int, int]] = []  # pending device copies ("slot"|"page", src, dst)
        self.bytes_moved = 0  # device bytes copied by compaction (net, as applied)
        self.bytes_freed = 0
        self.slots = _Facade(self, self.blocks, block_bytes)
        self.pages = _Facade(self, self.kv, page_bytes, page_size=page_size)

    @property
    def used_bytes(self) -> int:
        return self.blocks.n * self.block_bytes + self.kv.n * self.page_bytes

    @property
    def hole_bytes(self) -> int:
        return self.total - self.used_bytes

    def take_moves(self) -> dict[str, list[tuple[int, int]]]:
        """The queued compaction as net copies per kind: {"slot": [(src, dst)], "page": [...]}, to be
        applied as one gather (all sources, from the buffer as the last step left it) then one
        scatter. Chains of moves (a block moved twice) collapse into one copy."""
        out = {}
        for kind, unit in (("slot", self.block_bytes), ("page", self.page_bytes)):
            origin: dict[int, int] = {}  # physical position -> where its content was at the last step
            for k, src, dst in self.moves:
                if k == kind:
                    origin[dst] = origin.pop(src, src)
            out[kind] = [(o, d) for d, o in origin.items() if o != d]
            self.bytes_moved += len(out[kind]) * unit
        self.moves = []
        return out

    def _alloc(self, end: _End, unit: int, n: int) -> list[int] | None:
        if n * unit > self.hole_bytes:
            return None
        return [end.add() for _ in range(n)]

    def _free(self, end: _End, unit: int, ids) -> None:
        # the physically last ones first: those at the end of the dense run leave without a move
        for v in sorted(ids, key=lambda v: -end.v2p.get(v, -1)):
            mv = end.remove(v)
            self.bytes_freed += unit
            if mv is not None:
                self.moves.append((end.kind, *mv))

    def check(self) -> None:
        """Layout invariants: dense ends, consistent maps, exact accounting, ends not crossing."""
        for end in (self.blocks, self.kv):
            assert len(end.v2p) == end.n and all(end.v2p[v] == p for p, v in enumerate(end.p2v)), end.kind
            assert end.p2v[0] == 0 and not set(end.free_virtual) & set(end.v2p)
        assert self.used_bytes + self.hole_bytes == self.total and self.hole_bytes >= 0


class _Facade:
    """`IdPool`-like view of one end (virtual ids in, virtual ids out)."""

    def __init__(self, mem: UnifiedMemory, end: _End, unit: int, page_size: int | None = None):
        self.mem, self.end, self.unit = mem, end, unit
        self.page_size = page_size
        self.what = end.kind

    @property
    def capacity(self) -> int:
        """Ids that would fit if the other end were empty (an upper bound, not a reservation)."""
        other = self.mem.kv if self.end is self.mem.blocks else self.mem.blocks
        other_unit = self.mem.page_bytes if other is self.mem.kv else self.mem.block_bytes
        return (self.mem.total - other_unit) // self.unit - 1

    @property
    def free_count(self) -> int:
        return self.mem.hole_bytes // self.unit

    @property
    def size(self) -> int:
        return self.end.next_virtual

    def alloc(self, n: int = 1) -> list[int] | None:
        return self.mem._alloc(self.end, self.unit, n)

    def alloc_one(self) -> int | None:
        got = self.alloc(1)
        return got[0] if got else None

    def free(self, ids) -> None:
        self.mem._free(self.end, self.unit, ids)

    def free_ids(self) -> list[int]:
        return list(self.end.free_virtual)

    def all_ids(self) -> list[int]:
        return list(range(1, self.end.next_virtual))

    def physical(self, ids):
        v2p = self.end.v2p
        return [v2p[i] for i in ids]

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)
