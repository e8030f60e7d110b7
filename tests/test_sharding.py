"""Sharding: mesh specs and the process layout, the logical-axis rules, the sharded step (logits and
state equal the single-device step for k3-tiny under tp=2, tp=4 x ep=2, dp=2 x tp=2 and DP-attention),
sharded weight loading, and the planner's figures. Needs 8 host devices (tests/conftest.py)."""

import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax.config import preset
from k3jax.engine.runner import SeqWork, pack_step
from k3jax.model.forward import step
from k3jax.model.init import init_params
from k3jax.model.kda import ungroup_channels
from k3jax.state import init_state
from sharding.mesh import dcn_split, device_grid, make_mesh, parse_mesh_spec
from sharding.rules import Rules, param_shardings, param_specs, state_shardings
from sharding.step import make_sharded_step

CFG = preset("k3-tiny")  # 4 KDA heads, 4 MLA heads, 8 experts
PS, PPS, SLOTS, PAGES = 16, 4, 4, 16
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets XLA_FLAGS)")


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


# ---- mesh --------------------------------------------------------------------------------------

def test_mesh_specs():
    assert parse_mesh_spec("tp=8,ep=8") == {"dp": 1, "tp": 8, "ep": 8}
    m = make_mesh("dp=2,tp=2")
    assert m.axis_names == ("dp", "tp", "ep") and dict(m.shape) == {"dp": 2, "tp": 2, "ep": 1}
    assert m.devices.size == 4 and make_mesh(m) is m
    for bad, msg in (("tp=3,ep=4", "needs 12 devices"), ("xp=2", "unknown axis"), ("tp=0", "positive"),
                     ("tp", "axis=size"), ("tp=2,tp=2", "twice")):
        with pytest.raises(ValueError, match=msg):
            make_mesh(bad)


def test_multi_process_layout():
    """tp stays within a process; processes go along dp first, then ep."""
    assert dcn_split({"dp": 2, "tp": 4, "ep": 1}, 2, 4) == ((1, 4, 1), (2, 1, 1))
    assert dcn_split({"dp": 1, "tp": 4, "ep": 2}, 2, 4) == ((1, 4, 1), (1, 1, 2))
    assert dcn_split({"dp": 2, "tp": 8, "ep": 8}, 16, 8) == ((1, 8, 1), (2, 1, 8))
    with pytest.raises(ValueError, match="within a process"):
        dcn_split({"dp": 1, "tp": 8, "ep": 1}, 2, 4)
    with pytest.raises(ValueError, match="every device"):
        dcn_split({"dp": 1, "tp": 2, "ep": 1}, 2, 4)
    fake = [types.SimpleNamespace(id=i, process_index=i // 4, platform="cpu", device_kind="cpu") for i in range(8)]
    proc = np.vectorize(lambda d: d.process_index)
    grid = device_grid(parse_mesh_spec("tp=4,ep=2"), fake)  # [dp, tp, ep]
    assert (proc(grid)[0, :, 0] == 0).all() and (proc(grid)[0, :, 1] == 1).all()  # a tp group is one process
    assert (proc(device_grid(parse_mesh_spec("dp=2,tp=4"), fake))[:, :, 0] == [[0] * 4, [1] * 4]).all()


# ---- rules -------------------------------------------------------------------------------------

def test_rules_cover_every_leaf_and_say_what_they_should():
    for name in ("k3", "kimi-linear-48b", "k3-tiny"):
        specs = param_specs(preset(name))  # raises on a leaf without logical axes
    assert specs.embed == P("tp", None) and specs.lm_head == P(None, "tp")
    assert specs.kda.q_proj == P(None, None, "tp") and specs.kda.o_proj == P(None, "tp", None)
    assert specs.kda.a_log == P(None, "tp") and specs.kda.conv == P(None, None, None)
    assert specs.mla.kv_a == P(None, None, None) and specs.mla.q_b == P(None, None, "tp")
    assert specs.moe.w1 == P(None, "ep", None, "tp") and specs.moe.w2 == P(None, "ep", "tp", None)
    assert specs.moe.router == P(None, None, None) and specs.attn_res.out.proj == P(None)
    assert specs.dense.down == P(None, "tp", None) and specs.moe.shared.gate == P(None, None, "tp")
    mesh = make_mesh("dp=2,tp=2")
    st = state_shardings(CFG, mesh, SLOTS, PAGES, PS)
    assert st.recurrent.ssm.spec == P(None, None, "tp", None, None)
    assert st.recurrent.conv.spec == P(None, None, None, "tp") and st.kv.pages.spec == P(None, None, None, None)
    assert state_shardings(CFG, mesh, rules=Rules.dp_attention()).kv.pages.spec == P("dp", None, None, None)
    with pytest.raises(ValueError, match="tp=8 does not divide the 4 KDA heads"):
        param_shardings(CFG, make_mesh("tp=8"))
    with pytest.raises(ValueError, match="pages"):
        state_shardings(CFG, mesh, SLOTS, 15, PS, Rules.dp_attention())


def test_sizing_matches_the_placed_arrays(params):
    """memory_plan's per-device weight bytes equal what shard_params puts on one device."""
    from k3jax.sizing import memory_plan

    mesh = make_mesh("tp=2,ep=4")
    placed = jax.device_put(params, param_shardings(CFG, mesh))
    dev = mesh.devices.flat[0]
    on_dev = sum(s.data.nbytes for a in jax.tree_util.tree_leaves(placed) for s in a.addressable_shards
                 if s.device == dev)
    assert memory_plan(CFG, 2, ep=4).weight_bytes_per_device == on_dev


# ---- the sharded step --------------------------------------------------------------------------

def _schedule():
    """Three steps of one shape (2 decode rows + 64 prefill tokens): prefill A and B; decode A, B with
    a fresh prefill of C; decode A, B with C's next chunk. B and C's pages lie in the upper half."""
    rng = np.random.default_rng(3)
    toks = {s: rng.integers(0, CFG.vocab_size, n).tolist() for s, n in ((1, 40), (2, 23), (3, 50))}
    first = {1: 1, 2: 8, 3: 12}
    work = lambda s, a, b: SeqWork(toks[s][a:b], a, s, list(range(first[s], first[s] + -(-b // PS))))
    nxt = {1: [7, 9], 2: [11, 13]}
    dec = lambda s, i, n: SeqWork([nxt[s][i]], n, s, list(range(first[s], first[s] + -(-(n + 1) // PS))))
    return [([], [work(1, 0, 40), work(2, 0, 23)]),
            ([dec(1, 0, 40), dec(2, 0, 23)], [work(3, 0, 30)]),
            ([dec(1, 1, 41), dec(2, 1, 24)], [work(3, 30, 50)])]


def _run(stepper, params, state):
    outs = []
    for decode, prefill in _schedule():
        pk = pack_step(decode, prefill, D=2, P=64, NP=2, pages_per_seq=PPS)
        logits, state = stepper(params, state, pk.batch)
        logits = np.asarray(logits)
        outs.append([logits[r] for r in pk.rows])
    return outs, state


@pytest.fixture(scope="module")
def reference(params):
    return _run(lambda p, s, b: step(p, s, b, CFG), params, init_state(CFG, SLOTS, PAGES, PS))


@pytest.mark.parametrize("spec,dp_attention,fused", [("tp=2", False, False), ("tp=4,ep=2", False, False),
                                                     ("dp=2,tp=2", False, False), ("dp=2,tp=2", True, False),
                                                     ("tp=2", False, True)])
def test_sharded_step_equals_single_device(params, reference, spec, dp_attention, fused, monkeypatch):
    """fused: the KDA prefill's L2 norm and gate left to the chunk entry point per head shard
    (`model.kda.PREFILL_FUSED_INPUTS`, the gate's parameters sharded by head), against the reference
    without it."""
    from k3jax.model import kda as kda_model

    monkeypatch.setattr(kda_model, "PREFILL_FUSED_INPUTS", fused)
    chunk, gated = kda_model.kda_kernels.kda_chunk, []

    def spy(*a, **kw):  # the real entry point, recording whether it got the fused inputs
        gated.append(kw.get("gate") is not None)
        return chunk(*a, **kw)

    monkeypatch.setattr(kda_model.kda_kernels, "kda_chunk", spy)
    jax.clear_caches()  # the switch is read at trace time
    rules = Rules.dp_attention() if dp_attention else Rules()
    st = make_sharded_step(CFG, spec, rules)
    sharded = st.shard_params(params)
    assert sharded.moe.w1.sharding.spec == P(None, "ep", None, "tp")
    outs, state = _run(st, sharded, st.init_state(SLOTS, PAGES, PS))
    assert gated and set(gated) == {fused}
    ref_outs, ref_state = reference
    for got_step, want_step in zip(outs, ref_outs):
        for got, want in zip(got_step, want_step):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    # the state lives where the rules say, and holds what the single-device step holds
    sh = state_shardings(CFG, st.mesh, rules=rules)
    for a, want in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(sh)):
        assert a.sharding.is_equivalent_to(want, a.ndim)
    # (slot 0 and page 0 are the padding sinks: what lands there is unspecified)
    np.testing.assert_allclose(np.asarray(state.recurrent.ssm)[1:], np.asarray(ref_state.recurrent.ssm)[1:], atol=1e-4)
    conv = ungroup_channels(np.asarray(state.recurrent.conv), st.context.groups("kda_heads"),
                            CFG.kda_num_heads, CFG.kda_head_dim)
    np.testing.assert_allclose(np.asarray(conv)[1:], np.asarray(ref_state.recurrent.conv)[1:], atol=1e-4)
    np.testing.assert_allclose(np.asarray(state.kv.pages)[1:], np.asarray(ref_state.kv.pages)[1:], atol=1e-4)
