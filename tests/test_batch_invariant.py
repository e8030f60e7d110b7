"""The batch-invariant mode (`ModelConfig.batch_invariant_rows`, `LLM(batch_invariant=True)`): a token's
logits come out bit for bit the same whatever the step it runs in (decode batches of any size, mixed
decode + prefill steps, speculative verify blocks), because every row-wise piece of the step runs in
fixed blocks of rows (`pallas_kernels.dispatch.rowwise`), the routed experts in expert-aligned blocks
and the MLA attention one query per row. On this CPU the step's rows differ by ~1e-5 without it
(bench/batch_invariance.py); on the H200 such differences part speculative from plain decoding
(bench/NOTES.md, sessions 14-16)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import LLM, SamplingParams
from k3jax.api import load_model
from k3jax.config import BATCH_INVARIANT_ROWS, ModelConfig, preset
from k3jax.engine.engine import EngineConfig
from k3jax.engine.runner import SeqWork, pack_step
from k3jax.model import moe
from k3jax.model.common import proj
from k3jax.model.init import init_params
from k3jax.model.moe import route, routed_experts
from k3jax.state import init_state
from pallas_kernels.dispatch import batch_invariant, batch_invariant_rows, rowwise


@pytest.fixture(scope="module")
def model():
    return load_model("k3-tiny", seed=0)


@pytest.fixture(scope="module")
def k128():
    """k3-tiny with K3's 128 x 128 KDA heads (the kernels' shapes), in the mode."""
    from bench.batch_invariance import build_model

    return invariant(build_model("k3-tiny", 128, "xla"))


def invariant(model, rows=64):
    return dataclasses.replace(model, config=model.config.replace(batch_invariant_rows=rows))


def test_rowwise_runs_fixed_blocks_and_gives_a_row_the_same_bits_at_every_row_count():
    """Off, `rowwise` is the function itself; on, the same values (a pytree output, a ragged last block,
    nested `rowwise` inside the block running as is, a block capped by `max_rows`) and row 0 bit for bit
    equal at every row count."""
    x = jax.random.normal(jax.random.PRNGKey(0), (150, 3, 96))
    w = jax.random.normal(jax.random.PRNGKey(1), (96, 40))

    def fn(x):  # a product and a reduction over the last axis, a pytree out, and a nested rowwise
        y = rowwise(lambda x: jnp.einsum("thd,dx->thx", x, w), x)
        return y, jnp.sqrt(jnp.sum(x * x, -1))

    plain = fn(x)
    with batch_invariant(16):
        assert batch_invariant_rows() == 16
        got = jax.jit(lambda x: rowwise(fn, x))(x)
        capped = jax.jit(lambda x: rowwise(fn, x, max_rows=4))(x)
        row0 = {T: np.asarray(jax.jit(lambda x: rowwise(fn, x)[0])(x[:T])[0]) for T in (1, 4, 16, 20, 150)}
        row0_capped = {T: np.asarray(jax.jit(lambda x: rowwise(fn, x, max_rows=4)[0])(x[:T])[0])
                       for T in (1, 3, 5, 150)}
    assert batch_invariant_rows() == 0
    for out in (got, capped):
        for a, b in zip(out, plain):
            assert a.shape == b.shape
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)
    for rows in (row0, row0_capped):
        for T, r in rows.items():
            np.testing.assert_array_equal(r, rows[1], err_msg=f"T={T}")
    with pytest.raises(ValueError, match="row block"):
        with batch_invariant(-1):
            pass


def test_weight_products_give_a_row_the_same_bits_at_every_row_count(model):
    """`common.proj` as the step runs it in the mode: for every weight shape of k3-tiny, row 0 of x[:M] @ W
    bit for bit the same at M = 1, 4, 20, 132 and 148 (bench/batch_invariance.py's GEMM table)."""
    from bench.batch_invariance import gemm_rows

    rows = gemm_rows(model.params, invariant(model).config)
    assert len(rows) >= 5 and all(r["bitwise_equal"] for r in rows), rows


def test_mode_projections_on_the_kernel_ignore_the_other_rows(monkeypatch):
    """`common.proj` in the mode on the grouped-matmul kernel (`INVARIANT_PROJ`; here in interpret mode): no
    row-block loop, and a row's output is bit for bit the same alone, among other rows and in another grid,
    with the N tile fixed by the width (128, or 64 for a 192-wide weight) and K cut by the shape alone (two
    splits of 512); it computes the product (bf16 tolerance against f32). Off the mode, and with "blocks",
    the kernel does not run."""
    from k3jax.model import common

    monkeypatch.setattr(common, "INVARIANT_PROJ", "pallas_interpret")
    calls = []
    orig = common.gmm.grouped_matmul
    monkeypatch.setattr(common.gmm, "grouped_matmul",
                        lambda *a, **kw: calls.append((kw["bn"], kw["k_splits"])) or orig(*a, **kw))
    ks = jax.random.split(jax.random.PRNGKey(5), 3)
    for (D, X), lead in (((128, 192), (70,)), ((512, 256), (23, 3))):
        w = (jax.random.normal(ks[0], (D, X)) / np.sqrt(D)).astype(jnp.bfloat16)
        x = jax.random.normal(ks[1], (*lead, D)).astype(jnp.bfloat16)
        run = jax.jit(lambda x: proj(x, w))
        with batch_invariant(4):
            got, few, mid = run(x), run(x[:3]), run(x[20:23])
        assert got.shape == (*lead, X) and got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(few), np.asarray(got[:3]))
        np.testing.assert_array_equal(np.asarray(mid), np.asarray(got[20:23]))
        ref = jnp.einsum("...d,dx->...x", x.astype(jnp.float32), w.astype(jnp.float32))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)
    assert calls == [(64, 1)] * 2 + [(128, 2)] * 2, calls  # traced twice a weight: all rows, then 3 rows
    proj(x, w)  # off the mode
    monkeypatch.setattr(common, "INVARIANT_PROJ", "blocks")
    with batch_invariant(4):
        proj(x, w)
    assert len(calls) == 4
    monkeypatch.setattr(common, "INVARIANT_PROJ", "kernel")
    with batch_invariant(4), pytest.raises(ValueError, match="INVARIANT_PROJ"):
        proj(x, w)


@pytest.mark.parametrize("form,group", [("blocks", 1), ("blocks", 3), ("rounds", 1), ("kernel", 1)])
def test_expert_blocks_equal_the_grouped_matmul_and_ignore_the_other_tokens(form, group, monkeypatch):
    """The mode's routed experts compute what `ragged_dot` does, with groups spanning several blocks and
    experts left unused, and a token's output row does not change when the step routes more or other
    tokens (bit for bit): `moe._expert_blocks` (each expert's copies in blocks of R rows, one block or
    `moe.EXPERT_GROUP` = 3 blocks a loop step), `moe._expert_rounds` (`INVARIANT_EXPERTS = "rounds"`:
    every expert's next block a loop step) and the grouped-matmul kernel (`INVARIANT_EXPERTS = "kernel"`,
    bf16 weights, the kernel in interpret mode: no loop, its N tile fixed)."""
    monkeypatch.setattr(moe, "EXPERT_GROUP", group)
    monkeypatch.setattr(moe, "INVARIANT_EXPERTS", form)
    kernel = form == "kernel"
    if kernel:
        monkeypatch.setattr(moe, "GROUPED_MATMUL", "pallas_interpret")
    cfg = preset("k3-tiny").replace(dtype="bfloat16" if kernel else "float32")
    p = jax.tree.map(lambda a: a[0].astype(cfg.dtype), init_params(cfg, 0).moe)
    x = jax.random.normal(jax.random.PRNGKey(2), (37, cfg.hidden_size))
    z = proj(x, p.latent_down) if p.latent_down is not None else x
    idx, w = route(p, x, cfg)
    with monkeypatch.context() as m:
        m.setattr(moe, "GROUPED_MATMUL", "ragged")
        ref = routed_experts(p, z, idx, w, cfg)
    tol = 2e-2 if kernel else 1e-5  # bf16 gate and up products: the kernel's K order is not ragged_dot's
    calls = []
    if kernel:  # the kernel runs, with the width's N tile whatever the block count
        orig = moe.gmm.grouped_matmul
        monkeypatch.setattr(moe.gmm, "grouped_matmul", lambda *a, **kw: calls.append(kw) or orig(*a, **kw))
    run = jax.jit(lambda z, idx, w: routed_experts(p, z, idx, w, cfg))
    with batch_invariant(4):  # 37 x k copies over the experts: several blocks per group
        got = run(z, idx, w)
        few = run(z[:3], idx[:3], w[:3])
        mid = run(z[20:23], idx[20:23], w[20:23])  # other rows of the blocks, other rounds
    sizes = np.bincount(np.asarray(idx).reshape(-1), minlength=cfg.num_experts)
    assert sizes.max() > 4
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(few), np.asarray(got)[:3])
    np.testing.assert_array_equal(np.asarray(mid), np.asarray(got)[20:23])
    assert (len(calls) >= 6 and all(c.get("bn") == 128 for c in calls)) if kernel else not calls, calls
    with batch_invariant(64):  # one block per used expert
        np.testing.assert_allclose(np.asarray(run(z, idx, w)), np.asarray(ref), rtol=tol, atol=tol)
    monkeypatch.setattr(moe, "EXPERT_GROUP", 0)
    if form == "blocks":
        with batch_invariant(4), pytest.raises(ValueError, match="EXPERT_GROUP"):
            routed_experts(p, z, idx, w, cfg)
    monkeypatch.setattr(moe, "INVARIANT_EXPERTS", "slices")
    with batch_invariant(4), pytest.raises(ValueError, match="INVARIANT_EXPERTS"):
        routed_experts(p, z, idx, w, cfg)


def test_step_rows_bit_for_bit_in_every_step_shape(model, k128):
    """The property itself: the next token's logit row of a sequence, computed from the same state in a
    decode step (4 rows), a decode step of the next bucket (16 rows), a mixed step (4 + 128 rows: a
    prefill of another sequence rides along) and a verify block (4 x 5 rows), is bit for bit the same in
    the mode, and every row of the verify block equals the decode step that plain decoding runs for that
    token; the mode computes the model's function (logits within f32 rounding of the mode off).

    KDA heads of 128 x 128 (K3's, the kernels' shapes): with k3-tiny's own small heads a decode step's
    rows stayed equal across batch buckets even before `rowwise` kept its loop body to itself, with these
    they moved by ~1e-9 (the CPU fused the padding into the recurrence step's reductions), and with
    one-trip loops (XLA inlined them) by ~3e-5."""
    from bench.batch_invariance import step_rows
    r = step_rows(k128, prompt_len=100, gamma=4, seed=0)
    assert r["mixed_bitwise_equal"] and r["wide_bitwise_equal"] and r["verify_bitwise_equal"], r
    assert r["verify_vs_decode_chain_bitwise_equal"], r
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, 90).tolist()
    np.testing.assert_allclose(invariant(model).logits(prompt), model.logits(prompt), rtol=1e-4, atol=1e-4)


def test_prefill_rows_do_not_depend_on_the_sequences_packed_with_them(k128):
    """A prompt prefilled alone and prefilled after another prompt in the same step (so at another offset
    of the pack, with other chunks beside it): the same last-token logits and final recurrent state, bit for
    bit (without the mode the logits differ by ~1e-5 on this CPU)."""
    from k3jax.model.forward import forward

    cfg, ps = k128.config, 64
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 100).tolist(), rng.integers(0, 256, 37).tolist()
    fwd = jax.jit(forward, static_argnames=("cfg", "impl"))

    def run(works, P):
        p = pack_step([], works, D=0, P=P, NP=len(works), pages_per_seq=2)
        logits, st = fwd(k128.params, init_state(cfg, slots=4, pages=8, page_size=ps), p.batch, cfg=cfg, impl="xla")
        return np.asarray(logits)[p.rows[-1]].reshape(-1, cfg.vocab_size)[-1], np.asarray(st.recurrent.ssm[1])

    wa = SeqWork(a, 0, 1, [1, 2])
    alone, packed = run([wa], 128), run([SeqWork(b, 0, 2, [3, 4]), wa], 192)
    np.testing.assert_array_equal(alone[0], packed[0])
    np.testing.assert_array_equal(alone[1], packed[1])


def test_engine_speculative_equals_plain_in_the_mode(model):
    """`LLM(batch_invariant=True)`: the engine workload (prefix cache, overlap, mixed steps) gives the same
    greedy tokens with speculative decoding as without, and its steps run in the mode."""
    from k3jax.spec.drafter import OracleDrafter
    from tests.test_engine import ENGINE_KW, SP, workload

    plain = LLM(model, batch_invariant=True, **ENGINE_KW)
    assert plain.core.runner.cfg.batch_invariant_rows == BATCH_INVARIANT_ROWS
    assert model.config.batch_invariant_rows == 0  # the caller's model is left as it is
    # phase 1 of the workload (a shared prompt whose questions fork mid-chunk and mid-page; overlap, mixed steps),
    # then again from the prefix cache; phase 2's multi-turn restores run in tests/test_spec.py outside the mode
    phase1, _ = workload()
    want = [o.token_ids for o in plain.generate(phase1, SP)]
    oracle = OracleDrafter({tuple(p): o for p, o in zip(phase1, want)}, model.config.vocab_size)
    spec = LLM(model, batch_invariant=True, speculative=oracle, num_draft_tokens=4, **ENGINE_KW)
    assert [o.token_ids for o in spec.generate(phase1, SP)] == want
    assert [o.token_ids for o in spec.generate(phase1, SP)] == want  # again, restored from the prefix cache
    assert spec.stats["restored_tokens"] > 0
    assert 0 < spec.stats["spec_accepted"] < spec.stats["spec_drafted"]
    assert plain.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].token_ids  # still serving


def test_mode_settings_are_checked():
    with pytest.raises(ValueError, match="batch_invariant_rows"):
        ModelConfig(batch_invariant_rows=-1)
    with pytest.raises(NotImplementedError, match="batch_invariant with a mesh"):
        EngineConfig(batch_invariant=True, mesh="tp=2").validate()
    from sharding.step import make_sharded_step

    with pytest.raises(NotImplementedError, match="batch-invariant mode"):
        make_sharded_step(preset("k3-tiny").replace(batch_invariant_rows=64), "tp=1")


def test_chunk_kernels_lay_segments_out_on_their_own_in_the_mode():
    """In the mode the Mosaic GPU chunk path runs each varlen segment from a row that is a multiple of 8
    (`mgpu.ALIGN_SEGMENTS`'s layout), so a prompt's chunk grid (and bf16 roundings) cannot depend on the
    sequences packed before it."""
    from pallas_kernels.kda import mgpu

    cu = jnp.array([0, 5, 40], jnp.int32)
    assert mgpu._layout_for(cu, 48).src is None
    with batch_invariant(64):
        lay = mgpu._layout_for(cu, 48)
    assert lay.src is not None and int(lay.cu[1]) % 8 == 0 and int(lay.cu[1]) >= 5


def test_hlo_copies_counts_entry_and_loop_body_copies_apart():
    """`bench._common.hlo_copies` (what bench/k3_mini_h200.py records of the mode's loops): copies in the ENTRY
    computation and in the others (loop bodies) counted apart, sized by dtype, the while loops counted."""
    from bench._common import hlo_copies

    text = """HloModule m

%body (p: (s32[], f32[1000,1000])) -> (s32[], f32[1000,1000]) {
  %c.1 = f32[1000,1000]{1,0} copy(%x), metadata={op_name="jit(f)/while/body"}
  %c.2 = bf16[500,1000]{1,0} copy(%y), control-predecessors={%c.1}
  %s = f32[1000,1000]{1,0} copy-start(%x)
}

ENTRY %main (a: f32[500000]) -> f32[500000] {
  %c.3 = f32[500000]{0} copy(%a)
  %w = (s32[], f32[1000,1000]) while(%t), condition=%cond, body=%body
}
"""
    c = hlo_copies(text)
    assert (c["entry_count"], c["entry_mb"]) == (1, 2.0)
    assert (c["other_count"], c["other_mb"]) == (2, 5.0)
    assert c["whiles"] == 1
    assert list(c["top_mb"]) == ["f32[1000,1000]", "f32[500000]", "bf16[500,1000]"]
