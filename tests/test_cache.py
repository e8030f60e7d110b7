"""Property tests for the host cache: id pools and the radix tree under random insert / match /
lock / checkpoint / evict sequences, against a reference model of which page holds which prefix."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from k3jax.cache.pool import IdPool, PagePool, SlotPool
from k3jax.cache.radix import RadixTree


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=60))
def test_id_pool_never_double_allocates(ops):
    pool = IdPool(12, "page")
    held: list[int] = []
    for alloc, n in ops:
        if alloc:
            got = pool.alloc(n)
            if got is None:
                assert pool.free_count < n
                continue
            assert 0 not in got and not set(got) & set(held)
            held += got
        elif held:
            give, held = held[:n], held[n:]
            pool.free(give)
        assert pool.free_count + len(held) == pool.capacity
    with pytest.raises(RuntimeError):
        pool.free([0])


def test_pool_sizes_are_checked():
    with pytest.raises(ValueError, match="state_slots"):
        SlotPool(3)
    with pytest.raises(ValueError, match="page_size"):
        PagePool(8, 0)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 5), st.integers(1, 6)),  # family, length in pages
        st.tuples(st.just("lock"), st.integers(0, 5), st.integers(1, 6)),
        st.tuples(st.just("unlock"), st.integers(0, 9), st.just(0)),
        st.tuples(st.just("ckpt"), st.integers(0, 5), st.integers(1, 6)),
        st.tuples(st.just("pin"), st.integers(0, 9), st.just(0)),
        st.tuples(st.just("evict_kv"), st.integers(1, 12), st.just(0)),
        st.tuples(st.just("evict_ckpt"), st.integers(1, 3), st.just(0)),
    ),
    max_size=50,
)


def sequence(family: int, n_pages: int, ps: int) -> list[int]:
    """Families share prefixes of different lengths, so inserts split edges at many depths."""
    base = [7] * (ps * 2) + [family % 3] * ps + [family] * (ps * 4)
    return (base + [family * 10 + i for i in range(ps * 8)])[: n_pages * ps]


def page_at(tree, prefix):
    """The page the tree serves for the last page of `prefix` (which must be cached whole)."""
    ps = tree.page_size
    m = tree.match(list(prefix))
    assert m.kv_len == len(prefix), "a cached prefix is not matched in full"
    if m.node.depth == len(prefix):
        return tree.path_pages(m.node)[-1]
    child = m.node.children[tuple(prefix[m.node.depth: m.node.depth + ps])]
    return child.pages[(len(prefix) - m.node.depth) // ps - 1]


@settings(max_examples=150, deadline=None)
@given(OPS, st.sampled_from([1, 4, 64]))
# found by hypothesis: a checkpoint planted above two deeper ones put three on their path (cap 2)
@example(ops=[("insert", 0, 1), ("insert", 0, 2), ("insert", 0, 3), ("ckpt", 0, 3), ("ckpt", 0, 2), ("ckpt", 0, 1)],
         ps=4)
def test_radix_tree_random_operations(ops, ps):
    tree = RadixTree(ps, max_ckpt_per_path=2, chunk=4 if ps < 4 else ps)
    pages = PagePool(200, ps)
    slots = SlotPool(40)
    owner: dict[int, tuple] = {}  # page -> the prefix (tokens up to and including the page) it holds
    locks: list = []
    pins: list = []
    for op, a, b in ops:
        if op == "insert":
            seq = sequence(a, b, ps)
            got = pages.alloc(b)
            if got is None:
                continue
            node, taken = tree.insert(seq, got)
            assert node.depth == len(seq)
            pages.free([p for p in got if p not in taken])
            for i, p in enumerate(got):
                if p in taken:
                    owner[p] = tuple(seq[: (i + 1) * ps])
            tree.touch(node)
        elif op in ("lock", "ckpt"):
            seq = sequence(a, b, ps)
            m = tree.match(seq)
            assert m.kv_len % ps == 0 and m.kv_len <= len(seq)
            assert m.node.depth == m.kv_len or m.node.depth < m.kv_len
            if op == "lock" and m.node is not tree.root:
                tree.lock(m.node)
                locks.append((m.node, tuple(seq[: m.node.depth])))
            if op == "ckpt" and m.node is not tree.root and m.node.depth % tree.align == 0:
                s = slots.alloc_one()
                if s is not None:
                    slots.free(tree.set_checkpoint(m.node, s))
        elif op == "unlock" and locks:
            node, _ = locks.pop(a % len(locks))
            tree.unlock(node)
        elif op == "pin" and tree.ckpt_nodes:
            # as the scheduler's admission does: a pin comes with its own lock, released after the unpin
            node = sorted(tree.ckpt_nodes, key=lambda n: n.depth)[a % len(tree.ckpt_nodes)]
            tree.lock(node)
            tree.pin_ckpt(node)
            pins.append(node)
        elif op == "evict_kv":
            freed, freed_slots = tree.evict_kv(a)
            for p in freed:
                owner.pop(p)
            pages.free(freed)
            slots.free(freed_slots)
        elif op == "evict_ckpt":
            pinned = {n.ckpt for n in pins if n.ckpt is not None}
            freed = tree.evict_checkpoints(a)
            assert not set(freed) & pinned
            slots.free(freed)
        # invariants after every operation
        tree.check()
        tree_pages = tree.all_pages()
        assert len(tree_pages) == len(set(tree_pages)) == len(owner)
        assert sorted(tree_pages + pages.free_ids()) == list(range(1, pages.size))
        assert sorted(tree.all_ckpt_slots() + slots.free_ids()) == list(range(1, slots.size))
        for node, prefix in locks:  # locked paths keep their KV
            assert tree.match(list(prefix)).kv_len == len(prefix)
        for p in tree_pages:  # every cached page holds the prefix it was given for
            assert page_at(tree, owner[p]) == p
        for n in tree.ckpt_nodes:
            on_path, x = 0, n
            while x is not None:
                on_path += x.ckpt is not None
                x = x.parent
            assert on_path <= tree.max_ckpt_per_path or any(x.pins for x in pins)
    # everything unlocked and unpinned: the whole tree can be evicted
    for node in pins:
        tree.unpin_ckpt(node)
        tree.unlock(node)
    for node, _ in locks:
        tree.unlock(node)
    freed, freed_slots = tree.evict_kv(10**9)
    pages.free(freed)
    slots.free(freed_slots)
    assert tree.num_pages == 0 and not tree.ckpt_nodes and pages.free_count == pages.capacity
    assert slots.free_count == slots.capacity


def test_match_finds_deepest_checkpoint_and_split_keeps_it():
    tree = RadixTree(16, max_ckpt_per_path=4)
    seq = list(range(256))
    node, taken = tree.insert(seq, list(range(1, 17)))
    assert taken == list(range(1, 17))
    assert tree.set_checkpoint(node, 5) == []
    mid, _ = tree.insert(seq[:128], list(range(100, 108)))  # splits the edge; takes nothing
    assert mid.depth == 128 and node.depth == 256 and node.ckpt == 5
    assert tree.set_checkpoint(mid, 6) == []
    m = tree.match(seq + [1, 2, 3])
    assert m.kv_len == 256 and m.ckpt_node is node
    m = tree.match(seq[:200] + [999] * 40)
    assert m.kv_len == 192 and m.ckpt_node is mid  # diverges inside a page: page-aligned match
    with pytest.raises(ValueError, match="aligned"):
        tree.set_checkpoint(tree.insert(seq[:16], [1])[0], 7)
    tree.check()
