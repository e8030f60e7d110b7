"""Unified memory: the host allocator under random alloc / free / evict sequences (with a byte
pattern checked after every compaction), the device views, and the engine on one buffer."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3jax.cache.unified import UnifiedMemory

BLOCK, PAGE, TOTAL = 48, 8, 48 * 6 + 8 * 20  # bytes: a state block is 6 pages


class Sim:
    """A byte buffer driven like the device: moves applied as one gather then one scatter."""

    def __init__(self):
        self.mem = UnifiedMemory(TOTAL, BLOCK, PAGE, page_size=4)
        self.buf = np.zeros(TOTAL, np.int64)
        self.live = {"slot": {}, "page": {}}  # virtual id -> pattern value
        self.stamp = 1

    def where(self, kind, phys):
        if kind == "slot":
            return phys * BLOCK, (phys + 1) * BLOCK
        return TOTAL - (phys + 1) * PAGE, TOTAL - phys * PAGE

    def write(self, kind, v):
        facade = self.mem.slots if kind == "slot" else self.mem.pages
        a, b = self.where(kind, facade.physical([v])[0])
        self.buf[a:b] = self.stamp
        self.live[kind][v] = self.stamp
        self.stamp += 1

    def apply_moves(self):
        for kind, pairs in self.mem.take_moves().items():
            if not pairs:
                continue
            src = [self.buf[slice(*self.where(kind, s))].copy() for s, _ in pairs]
            for (_, d), data in zip(pairs, src):
                self.buf[slice(*self.where(kind, d))] = data

    def check(self):
        self.mem.check()
        m = self.mem
        assert m.blocks.n * BLOCK + m.kv.n * PAGE + m.hole_bytes == TOTAL  # exact accounting
        assert m.blocks.n * BLOCK <= TOTAL - m.kv.n * PAGE  # the ends never overlap; the hole is between
        for kind, facade in (("slot", m.slots), ("page", m.pages)):
            ranges = sorted(self.where(kind, p) for p in facade.physical(self.live[kind]))
            assert all(r1[1] <= r2[0] for r1, r2 in zip(ranges, ranges[1:])), "two live blocks overlap"
            for v, stamp in self.live[kind].items():
                a, b = self.where(kind, facade.physical([v])[0])
                assert (self.buf[a:b] == stamp).all(), f"{kind} {v} lost its bytes in compaction"


OPS = st.lists(st.tuples(st.sampled_from(["slot", "page", "free_slot", "free_page", "sync"]), st.integers(0, 99)),
               max_size=80)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_random_alloc_free_keeps_layout_and_bytes(ops):
    sim = Sim()
    for op, r in ops:
        if op in ("slot", "page"):
            facade = sim.mem.slots if op == "slot" else sim.mem.pages
            got = facade.alloc(1 + r % 3)
            if got is None:
                assert facade.free_count < 1 + r % 3  # the hole really is too small
                continue
            sim.apply_moves()  # moves queued before this allocation run first (as the next step)
            for v in got:
                sim.write(op, v)
        elif op.startswith("free") and sim.live[op[5:]]:
            kind = op[5:]
            victims = sorted(sim.live[kind])[r % len(sim.live[kind]):][:1 + r % 2]
            (sim.mem.slots if kind == "slot" else sim.mem.pages).free(victims)
            for v in victims:
                del sim.live[kind][v]
        else:
            sim.apply_moves()
        if op != "sync":
            sim.apply_moves()
        sim.check()


def test_capacity_follows_the_workload():
    """The same budget holds all state blocks or all pages, whichever the traffic wants."""
    mem = UnifiedMemory(TOTAL, BLOCK, PAGE, page_size=4)
    slots = []
    while (s := mem.slots.alloc_one()) is not None:
        slots.append(s)
    assert len(slots) == (TOTAL - PAGE) // BLOCK - 1  # everything but the two sinks
    assert mem.pages.alloc(mem.pages.free_count + 1) is None
    mem.slots.free(slots)
    mem.take_moves()
    assert len(mem.pages.alloc(mem.pages.free_count)) == (TOTAL - BLOCK - PAGE) // PAGE
    assert mem.slots.alloc_one() is None
    with pytest.raises(RuntimeError, match="double free"):
        mem.slots.free([slots[0]])


def test_moves_compose_into_net_copies():
    mem = UnifiedMemory(TOTAL, BLOCK, PAGE, page_size=4)
    a, b, c, d = mem.slots.alloc(4)  # physical 1..4
    mem.slots.free([b])  # 4 -> 2
    mem.slots.free([d])  # d now at 2: 3 -> 2
    moves = mem.take_moves()["slot"]
    assert moves == [(3, 2)] and mem.slots.physical([a, c]) == [1, 2]
    assert mem.bytes_moved == BLOCK


def test_device_views_read_back_through_moves():
    import jax.numpy as jnp

    from k3jax.config import preset
    from k3jax.state import UnifiedGeometry, init_unified_state

    cfg = preset("k3-tiny")
    geom = UnifiedGeometry.build(cfg, 0, 16)
    st_ = init_unified_state(cfg, 6 * geom.block_bytes + 10 * geom.page_bytes, 16)
    rng = np.random.default_rng(0)
    ssm = rng.normal(size=(2,) + geom.ssm_shape).astype(np.float32)
    conv = rng.normal(size=(2,) + geom.conv_shape).astype(np.float32)
    kv = rng.normal(size=(3, cfg.mla_cache_dim)).astype(np.float32)
    rec = st_.recurrent.write_ssm(jnp.array([1, 3]), 2, ssm).write_conv(jnp.array([1, 3]), 1, conv)
    st_ = st_.with_recurrent(rec)
    st_ = st_.with_kv(st_.kv.write_tokens(jnp.array([2, 2, 5]), 1, jnp.array([0, 7, 15]), kv))
    np.testing.assert_array_equal(st_.recurrent.read_ssm(jnp.array([3, 1]), 2), ssm[::-1])
    np.testing.assert_array_equal(st_.recurrent.read_conv(jnp.array([1, 3]), 1), conv)
    st_ = st_.copy_blocks(jnp.array([3, 1]), jnp.array([4, 2]))  # a swap-free pair of moves
    np.testing.assert_array_equal(st_.recurrent.read_ssm(jnp.array([4, 2]), 2), ssm[::-1])
    st_ = st_.move_pages(jnp.array([5]), jnp.array([7]))
    rows, pages = st_.kv.attention_pages(jnp.array([[2, 7]]), 1)
    pages = np.asarray(pages).reshape(2, 16, -1)
    np.testing.assert_array_equal(pages[0, [0, 7]], kv[:2])
    np.testing.assert_array_equal(pages[1, 15], kv[2])
    assert not np.asarray(st_.recurrent.read_ssm(jnp.array([5]), 2)).any()  # untouched block


# ---- the engine on one buffer ------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_setup():
    """The model, and the workload's greedy tokens from the engine with separate pools (page_size 16)."""
    from k3jax import LLM
    from k3jax.api import load_model
    from tests.test_engine import ENGINE_KW, run_workload

    model = load_model("k3-tiny", seed=0)
    return model, run_workload, run_workload(LLM(model, page_size=16, **ENGINE_KW), together=True)


def test_engine_unified_equals_separate_pools(engine_setup):
    from k3jax import LLM
    from tests.test_engine import ENGINE_KW

    model, run_workload, want = engine_setup
    for ps in (16, 1):
        llm = LLM(model, page_size=ps, enable_unified_memory=True, **ENGINE_KW)
        assert run_workload(llm, together=True) == want, f"page_size={ps}"
        mem = llm.core.scheduler.memory
        assert mem is not None and mem.bytes_freed > 0
        llm.check_invariants()


def test_engine_fused_prefill_inputs_same_tokens(engine_setup, monkeypatch):
    """`model.kda.PREFILL_FUSED_INPUTS` (the prefill's L2 norm and gate left to the chunk entry point,
    here `kda_chunk` on the states gathered from the unified buffer; test_forward.py covers the
    separate pools' `kda_chunk_pool`) gives the engine's greedy tokens without it."""
    import jax

    from k3jax import LLM
    from k3jax.model import kda as kda_model
    from tests.test_engine import ENGINE_KW

    model, run_workload, want = engine_setup
    monkeypatch.setattr(kda_model, "PREFILL_FUSED_INPUTS", True)
    real, fused = kda_model.kda_kernels.kda_chunk, []

    def spy(*a, **kw):  # the real entry point, recording whether the layer handed it the fused inputs
        fused.append(kw.get("gate") is not None and kw.get("qk_l2norm", False))
        return real(*a, **kw)

    monkeypatch.setattr(kda_model.kda_kernels, "kda_chunk", spy)
    jax.clear_caches()  # the switch is read at trace time
    llm = LLM(model, page_size=16, enable_unified_memory=True, **ENGINE_KW)
    assert run_workload(llm, together=True) == want
    assert fused and set(fused) == {True}
    llm.check_invariants()
    jax.clear_caches()


def test_engine_unified_under_pressure(engine_setup):
    """A budget of 8 slots + 26 pages (as bytes): the hole runs out, the engine evicts and preempts."""
    from k3jax import LLM
    from tests.test_engine import ENGINE_KW

    model, run_workload, want = engine_setup
    llm = LLM(model, page_size=16, enable_unified_memory=True, state_slots=8, kv_pages=26, **ENGINE_KW)
    assert run_workload(llm, together=True) == want
    stats = llm.stats
    assert stats.get("evicted_pages", 0) + stats.get("preemptions", 0) > 0
    assert llm.core.scheduler.memory.bytes_moved > 0  # compaction really moved live blocks
    llm.check_invariants()
