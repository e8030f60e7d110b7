"""The engine on a mesh: greedy outputs token-identical sharded vs unsharded (tp=2, tp=4 x ep=2,
dp=2 x tp=2) on the tests/test_engine.py workload, prefix-cache restores and snapshots on a sharded
pool with grouped conv channels, `load_model(mesh=)` / `Model.logits`, `k3jax generate --mesh`, and the
lockstep protocol of sharding/lockstep.py with a leader and a follower in one process.
Needs 8 host devices (tests/conftest.py)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import LLM, SamplingParams
from k3jax.api import load_model
from k3jax.config import preset
from k3jax.model.kda import group_channels, ungroup_channels
from k3jax.state import StateOps, init_state, restore_checkpoints, snapshot_slots
from sharding.mesh import parse_mesh_spec
from sharding.step import make_sharded_step
from tests.test_engine import ENGINE_KW, PENALTIES, run_workload, workload

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
CFG = preset("k3-tiny")


@pytest.fixture(scope="module")
def model():
    return load_model("k3-tiny", seed=0)


@pytest.fixture(scope="module")
def unsharded(model):
    """Greedy tokens of the unsharded engine (tests/test_engine.py checks them against the reference loop)."""
    return run_workload(LLM(model, **ENGINE_KW))


@pytest.mark.parametrize("mesh", ["tp=2", "tp=4,ep=2", "dp=2,tp=2"])
def test_engine_on_a_mesh_is_token_identical(model, unsharded, mesh):
    llm = LLM(model, mesh=mesh, **ENGINE_KW)
    assert llm.core.runner.params.moe[0].w1.sharding.mesh.devices.size == np.prod(list(parse_mesh_spec(mesh).values()))
    got = run_workload(llm)  # also checks the invariants
    assert got == unsharded
    assert llm.stats["restored_tokens"] > 0 and llm.stats["donated_checkpoints"] > 0  # restore + snapshot ran
    state = llm.core.runner.state
    assert state.recurrent.conv.sharding.spec[3] == "tp" and state.recurrent.ssm.sharding.spec[2] == "tp"
    if mesh == "tp=2":  # penalties: their counts replicated on the mesh, written at admission, counted in the step
        phase1 = workload()[0]
        want = [o.token_ids for o in LLM(model, **ENGINE_KW).generate(phase1, PENALTIES)]
        assert [o.token_ids for o in llm.generate(phase1, PENALTIES)] == want
        # an image prompt: the tower's rows replicated into the sharded step (tests/test_media.py's reference)
        from tests.test_media import image, teacher_forced

        p, imgs = phase1[2][:40] + [259] + phase1[2][40:60], [image(1, 56, 84)]
        out = llm.generate(p, SamplingParams(max_new_tokens=6), images=imgs)[0].token_ids
        want, margin = teacher_forced(model, p, imgs, out)
        assert out == want and margin > 1e-4
        llm.check_invariants()


def test_slot_copies_on_a_sharded_pool_with_grouped_conv_channels():
    """restore / snapshot copy whole slots: the same result on a tp-sharded pool (conv channels grouped
    per shard) as on one device."""
    st = make_sharded_step(CFG, "tp=4")
    G, H, K = 4, CFG.kda_num_heads, CFG.kda_head_dim
    plain = init_state(CFG, 8, 4, 16)
    rng = np.random.default_rng(0)
    ssm = rng.standard_normal(plain.recurrent.ssm.shape).astype(np.float32)
    conv = rng.standard_normal(plain.recurrent.conv.shape).astype(np.float32)
    plain.recurrent.ssm, plain.recurrent.conv = jnp.asarray(ssm), jnp.asarray(conv, plain.recurrent.conv.dtype)
    seq_slot = np.array([3, 5, 0], np.int32)
    ops = StateOps(restore_src=np.array([6, 0, 0], np.int32), snap_dst=np.array([0, 7, 0], np.int32))

    def copies(state, ops, seq_slot):
        return snapshot_slots(restore_checkpoints(state, ops, seq_slot), ops, seq_slot)

    want = jax.jit(copies)(plain, ops, seq_slot)
    sharded = st.init_state(8, 4, 16)
    sharded.recurrent.ssm = jax.device_put(ssm, st.state_shardings.recurrent.ssm)
    sharded.recurrent.conv = jax.device_put(group_channels(plain.recurrent.conv, G, H, K),
                                            st.state_shardings.recurrent.conv)
    got = jax.jit(copies, in_shardings=(st.state_shardings, st.replicated, st.replicated),
                  out_shardings=st.state_shardings)(sharded, ops, seq_slot)
    np.testing.assert_array_equal(np.asarray(got.recurrent.ssm), np.asarray(want.recurrent.ssm))
    np.testing.assert_array_equal(np.asarray(ungroup_channels(got.recurrent.conv, G, H, K)),
                                  np.asarray(want.recurrent.conv))
    assert got.recurrent.conv.sharding.spec[3] == "tp"


def test_load_model_on_a_mesh_places_shards_and_logits_match(model):
    sharded = load_model("k3-tiny", seed=0, mesh="tp=4,ep=2")
    # per-layer arrays (`split_layers`): each MoE layer's [E, in, out] experts over ep, their ffn over tp
    assert all(m.w1.sharding.spec == jax.sharding.PartitionSpec("ep", None, "tp") for m in sharded.params.moe)
    for a, b in zip(jax.tree_util.tree_leaves(sharded.params), jax.tree_util.tree_leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # sharded init: the same weights
    ids = workload()[0][0][:70]
    want = model.logits(ids)
    np.testing.assert_allclose(sharded.logits(ids), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_cli_generate_with_a_mesh(model, unsharded, capsys):
    from k3jax.cli import main

    assert main(["generate", "--prompt", "Hello there", "--max-new-tokens", "6", "-q", "--mesh", "tp=2"]) == 0
    want = LLM(model, **ENGINE_KW).generate(["Hello there"], SamplingParams(max_new_tokens=6))[0].text  # compiled
    assert capsys.readouterr().out == want + "\n" and want.strip()
    assert main(["generate", "--prompt", "x", "--mesh", "tp=3"]) == 2  # k3-tiny's 4 heads: a one-line error
    assert "does not divide" in capsys.readouterr().err


# ---- the lockstep protocol, in one process --------------------------------------------------------

def test_lockstep_leader_and_follower_agree_under_memory_pressure(model, unsharded):
    """A leader (LockstepCore) and a follower (Follower) over a LocalChannel, each with its own engine,
    on a workload that evicts and preempts, then an abort and a stop (SIGTERM): the follower replays
    every step with the same device inputs (checked per step) and the same tokens."""
    from sharding.lockstep import Follower, LocalChannel, LockstepCore

    kw = dict(ENGINE_KW, page_size=16, kv_pages=26, state_slots=12)
    channel = LocalChannel()
    lead, follow = LLM(model, **kw), LLM(model, **kw)
    lead.core = LockstepCore(lead.core, channel)
    seen = {}
    follower = Follower(follow.core, channel, lambda r: seen.setdefault(r.id, (list(r.output), r.finish_reason)))
    errors = []
    t = threading.Thread(target=lambda: errors.append(_catch(follower.run)), daemon=True)
    t.start()
    got = run_workload(lead)
    core = lead.core
    reqs = [core.make_request(list(range(i, i + 50)), SamplingParams(max_new_tokens=30)) for i in range(2)]
    for r in reqs:
        core.add(r)
    for _ in range(4):
        core.step()
    assert lead.abort(reqs[1].id)
    while core.has_work():
        core.step()
    late = [core.make_request([7] * 30, SamplingParams(max_new_tokens=30)) for _ in range(2)]
    for r in late:
        core.add(r)
    core.step()
    core.stop.set()  # SIGTERM: everything still queued or running is aborted at the next step
    while core.has_work():
        core.step()
    core.close()
    t.join(60)
    assert errors == [None], errors
    assert lead.stats["preemptions"] > 0 and lead.stats["evicted_pages"] > 0
    assert got == unsharded  # greedy tokens do not depend on memory pressure (tests/test_engine.py)
    follow.check_invariants()
    assert [seen[r.id] for r in reqs] == [(r.output, r.finish_reason) for r in reqs]
    assert reqs[1].finish_reason == "abort" and len(reqs[0].output) == 30
    assert [r.finish_reason for r in late] == ["abort", "abort"]
    assert [seen[r.id] for r in late] == [(r.output, "abort") for r in late]
    assert len(seen) == 12 and follower.n == core.n


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def test_host_eviction_order_is_the_same_in_every_process():
    """Lockstep needs host decisions that do not depend on the process: LRU ties between radix nodes
    break by creation order (not by object address)."""
    from k3jax.cache.radix import RadixTree

    tree = RadixTree(page_size=4)
    junk = [object() for _ in range(64)]
    for i in range(16):  # siblings without a touch: all tie on last_access
        del junk[(7 * i) % len(junk)]  # perturb the allocator between nodes
        tree.insert([i + 1] * 4, [i + 1])
    pages, _ = tree.evict_kv(16)
    assert pages == list(range(1, 17))
