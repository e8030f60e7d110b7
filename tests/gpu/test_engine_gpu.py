"""The model and the engine on the H200's kernels, with a k3-tiny whose KDA heads have K3's 128 x 128
state (the kernels' shapes): the chunk kernel on the inputs the model feeds it, the model's logits on
the Pallas path against the XLA path, and greedy speculative decoding (the verify kernel, then
`fold_pool` replaying the accepted prefix in place on the pool) against plain decoding.

Run through the device tool: `JAX_PLATFORMS=cuda,cpu python3 -m pytest -m gpu tests/gpu` (the first
test reads per-layer errors through `jax.debug.callback`, which needs the CPU backend too)."""

import dataclasses
import json

import numpy as np
import pytest

from tests.gpu import require_gpu

require_gpu()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import k3jax.model.kda as model_kda  # noqa: E402
from k3jax import LLM  # noqa: E402
from k3jax.api import load_model  # noqa: E402
from k3jax.model.forward import split_layers  # noqa: E402
from k3jax.model.init import init_params  # noqa: E402
from k3jax.spec.drafter import OracleDrafter  # noqa: E402
from tests.test_engine import ENGINE_KW, run_workload, workload  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    base = load_model("k3-tiny", seed=0)  # f32
    cfg = base.config.replace(name="k3-tiny-k128", kda_head_dim=128)
    # the per-layer layout, as load_model gives it
    return dataclasses.replace(base, config=cfg, params=split_layers(init_params(cfg, 0)), impl="pallas")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_chunk_kernel_on_model_inputs_and_logits(model, monkeypatch):
    """200 tokens (four chunks, the last one partial), prefill through the chunk kernels, whose
    states the model keeps in the recurrent pool (`kda_chunk_pool`: read and written by slot).

    Per KDA layer, on the inputs the model feeds the kernel (K3's gate: g down to -5 per token), the
    kernel's output and the states it writes into the pool against the f32 jnp reference on the
    same inputs: < 1e-2.

    The logits are only compared against a floor measured here: this random-weight model amplifies
    tiny changes (MoE routing flips), so rounding the KDA inputs to bf16 on the XLA path alone moves
    its logits by ~12% on the H200 (6% on the CPU), while each layer's kernel error is ~0.4%. A
    kernel bug (a wrong chunk boundary, state or gate) moves them by O(1)."""
    try:
        jax.devices("cpu")
    except RuntimeError as e:
        raise RuntimeError("run tests/gpu with JAX_PLATFORMS=cuda,cpu (jax.debug.callback needs the CPU backend)") from e
    ids = np.random.default_rng(0).integers(0, 256, 200).tolist()
    want = dataclasses.replace(model, impl="xla").logits(ids)
    chunk_pool = model_kda.kda_kernels.kda_chunk_pool
    errs = []

    def checked(q, k, v, g, beta, pool, slots, *, layer, cu_seqlens, reset=None, impl="xla", gate=None,
                qk_l2norm=False):
        assert gate is None and not qk_l2norm  # (PREFILL_FUSED_INPUTS off: the inputs as the kernel takes them)
        f32 = lambda x: x.astype(jnp.float32)
        with jax.default_matmul_precision("highest"):
            o_r, pool_r = chunk_pool(*map(f32, (q, k, v, g, beta)), pool, slots, layer=layer, cu_seqlens=cu_seqlens,
                                     reset=reset, impl="xla")
        o, new = chunk_pool(q, k, v, g, beta, pool, slots, layer=layer, cu_seqlens=cu_seqlens, reset=reset, impl=impl)
        live = (jnp.arange(o.shape[1]) < cu_seqlens[-1])[None, :, None, None]  # rows past the last sequence: padding
        rel = lambda a, b: jnp.linalg.norm(a - b) / jnp.linalg.norm(b)
        jax.debug.callback(lambda *x: errs.append([float(y) for y in x]),
                           rel(jnp.where(live, o, 0.0), jnp.where(live, o_r, 0.0)),
                           rel(new[slots, layer], pool_r[slots, layer]), jnp.min(g))
        return o, new

    monkeypatch.setattr(model_kda.kda_kernels, "kda_chunk_pool", checked)
    got = model.logits(ids)
    assert np.isfinite(got).all()
    assert len(errs) == model.config.num_kda_layers, errs
    for o_err, s_err, gmin in errs:
        assert o_err < 1e-2 and s_err < 1e-2, errs
        assert gmin < -4.0  # the strong gates K3 runs, not the unit tests' weak ones

    # the floor: the XLA path with the KDA inputs rounded to bf16 (a new config name: a new trace)
    bf = lambda x: x.astype(jnp.bfloat16).astype(x.dtype)
    rounded = lambda q, k, v, g, beta, *a, **kw: chunk_pool(bf(q), bf(k), bf(v), g, beta, *a, **kw)
    monkeypatch.setattr(model_kda.kda_kernels, "kda_chunk_pool", rounded)
    floor_model = dataclasses.replace(model, impl="xla", config=model.config.replace(name="k3-tiny-k128-bf16-kda-inputs"))
    floor = _rel(floor_model.logits(ids), want)
    assert 0 < floor < 0.5
    # since f32 models multiply in full f32 (session 12) the floor is small (H200, 2026-12-05: 0.016) while
    # the kernels' own bf16 operands (w, u0, the level scores) move the logits by 0.137: the bound is the
    # larger of twice the floor and 0.25, still far below the O(1) of a kernel bug
    assert _rel(got, want) < max(2 * floor, 0.25), (_rel(got, want), floor)


def test_model_prefill_with_fused_inputs(model, monkeypatch):
    """The model's prefill with `PREFILL_FUSED_INPUTS` (the KDA prefill's L2 norm and K3's lower-bound
    gate inside the prep kernel) on the kernels: the fused path was taken,
    and its logits are as close to the XLA path's as the unfused kernels' are (within 2x; this
    random-weight model amplifies rounding, a kernel bug moves them by O(1))."""
    ids = np.random.default_rng(1).integers(0, 256, 200).tolist()
    want = dataclasses.replace(model, impl="xla").logits(ids)
    plain = model.logits(ids)
    chunk_pool, fused = model_kda.kda_kernels.kda_chunk_pool, []

    def spy(*a, **kw):  # the real entry point, recording whether the layer handed it the fused inputs
        fused.append(kw.get("gate") is not None and kw.get("qk_l2norm", False))
        return chunk_pool(*a, **kw)

    monkeypatch.setattr(model_kda.kda_kernels, "kda_chunk_pool", spy)
    monkeypatch.setattr(model_kda, "PREFILL_FUSED_INPUTS", True)
    jax.clear_caches()  # the switch is read at trace time
    got = model.logits(ids)
    jax.clear_caches()
    assert fused and set(fused) == {True}
    assert np.isfinite(got).all()
    assert _rel(got, want) < 2 * max(_rel(plain, want), 0.05), (_rel(got, want), _rel(plain, want))


@pytest.fixture(scope="module")
def plain(model):
    """Greedy tokens of tests/test_engine.py's workload, plain decoding on the kernels."""
    return run_workload(LLM(model, prefix_cache=True, overlap=True, **ENGINE_KW))  # checks the invariants too


def test_engine_on_kernels_is_reproducible(model, plain):
    """The same workload again in the same process gives the same tokens: no run-to-run nondeterminism
    in the step (no atomics in its sums: the MoE combine was a scatter-add until session 14)."""
    assert run_workload(LLM(model, prefix_cache=True, overlap=True, **ENGINE_KW)) == plain


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_speculative_on_kernels_equals_plain(model, plain, impl):
    """Greedy speculative decoding (verify, accept, fold: on the kernels `fold_pool` replays each accepted
    prefix in place; on the XLA path `kda_fold`) gives plain decoding's tokens, with partial acceptance.

    History: this failed on the H200 in sessions 10-14 (an xfail). Session 15 found that the XLA fold ran
    outside the step's matmul precision scope, so its state products took TF32 inputs on a GPU while
    plain decoding's were f32 (on the CPU, the fold's products with TF32-rounded inputs part request 5 of
    this workload, one of the two the H200's XLA path parted); fixed, and tests/test_forward.py checks
    every product of both engine steps. The Pallas path's fold is a kernel (bitwise equal to decode,
    test_kda_gpu.py), so that does not explain its parting in one session-14 run. Session 16 (CPU
    emulation, `bench/batch_invariance.py --gemm-noise 1e-6 --bf16-chunk`): the chunk kernels' bf16
    operands turn the prefill rows' ~1e-6 row-count GEMM noise (a mixed step holds one decode row per
    request in plain decoding, gamma + 1 in a verify block) into ~4e-3 changes of single elements, which
    flip MoE router near-ties: 3 of 4 noise patterns part this workload. So on the Pallas path this test
    asserts an invariant that holds only with batch-invariant matmuls (the engine's batch-invariant mode
    since session 17, `test_batch_invariant_mode_on_kernels`; this test runs without it), and whether it
    passes depends on the GEMM algorithms XLA picks; in session 18 (an H100) it parted requests 5 and 7
    on both paths, so the XLA path needs the mode too. Session 19 (H100): again, with the f32 referee's
    margins 4.05 and -1.80 at the first differing tokens (not logit near-ties; no XLA flag makes the GEMM
    rows invariant, bench/NOTES.md). Kept strict: this is the default engine's gap on a GPU, which only
    the mode closes. On a mismatch the message lists
    each parted request's first differing token with the f32 XLA path's logit margin there (DESIGN.md
    section 4: a mismatch is a bug unless it traces to a near-tie)."""
    from bench.batch_invariance import parted_requests

    m = model if impl == "pallas" else dataclasses.replace(model, impl="xla")
    want = plain if impl == "pallas" else run_workload(LLM(m, prefix_cache=True, overlap=True, **ENGINE_KW))
    phase1, phase2 = workload()
    prompts = phase1 + phase2(want[: len(phase1)])
    oracle = OracleDrafter({tuple(p): o for p, o in zip(prompts, want)}, m.config.vocab_size)
    spec = LLM(m, prefix_cache=True, overlap=True, speculative=oracle, num_draft_tokens=4, **ENGINE_KW)
    got = run_workload(spec)
    st = spec.stats
    assert 0 < st["spec_accepted"] < st["spec_drafted"]  # partial acceptance: the fold replays a prefix
    # a string message: pytest shortens a list of dicts, and the margins are what the failure is for
    assert got == want, json.dumps(parted_requests(dataclasses.replace(model, impl="xla"), prompts, got, want))


@pytest.mark.parametrize("experts", ["blocks", "rounds", "kernel", "kernel_proj"])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_batch_invariant_mode_on_kernels(model, impl, experts, monkeypatch):
    """The engine's batch-invariant mode (`LLM(batch_invariant=True)`: `ModelConfig.batch_invariant_rows`
    128) on the GPU (passes on an H100 on both paths since session 18's `dispatch.block_loop`; before it,
    the mixed step's rows moved by ~1.7e-5): a sequence's next-token logit row is bit for bit the same in a decode step, a decode
    step of a 4x larger bucket, a mixed step and a verify block, and each verify row equals the decode
    step of its token (bench/batch_invariance.py's `step_rows`, as tests/test_batch_invariant.py checks on
    the CPU); then the engine workload's speculative tokens equal plain decoding's in the mode. With both
    forms of the mode's routed experts (`moe.INVARIANT_EXPERTS`; "rounds" since session 19; "kernel", the
    grouped-matmul kernel with no loop, since session 20, on a bf16 copy of the model: the kernel takes bf16
    weights only; "kernel_proj": the projections on that kernel too, `common.INVARIANT_PROJ = "auto"`,
    session 21)."""
    from bench.batch_invariance import parted_requests, step_rows
    from k3jax.config import BATCH_INVARIANT_ROWS
    from k3jax.model import moe

    from k3jax.model import common

    # read while tracing: a fresh model name below
    monkeypatch.setattr(moe, "INVARIANT_EXPERTS", experts.removesuffix("_proj"))
    monkeypatch.setattr(common, "INVARIANT_PROJ", "auto" if experts == "kernel_proj" else "blocks")
    cfg = model.config.replace(name=f"{model.config.name}-{experts}")
    m = dataclasses.replace(model, impl=impl, config=cfg)
    if experts.startswith("kernel"):
        cfg = cfg.replace(dtype="bfloat16")
        full = init_params(cfg, 0)
        assert moe.grouped_matmul_form(jax.tree.map(lambda a: a[0], full.moe)) == "pallas"  # a Hopper GPU
        m = dataclasses.replace(m, config=cfg, params=split_layers(full))
    inv = dataclasses.replace(m, config=m.config.replace(batch_invariant_rows=BATCH_INVARIANT_ROWS))
    r = step_rows(inv, prompt_len=100, gamma=4, seed=0)
    assert r["mixed_bitwise_equal"] and r["wide_bitwise_equal"] and r["verify_bitwise_equal"], r
    assert r["verify_vs_decode_chain_bitwise_equal"], r
    want = run_workload(LLM(m, batch_invariant=True, **ENGINE_KW))
    phase1, phase2 = workload()
    prompts = phase1 + phase2(want[: len(phase1)])
    oracle = OracleDrafter({tuple(p): o for p, o in zip(prompts, want)}, m.config.vocab_size)
    spec = LLM(m, batch_invariant=True, speculative=oracle, num_draft_tokens=4, **ENGINE_KW)
    got = run_workload(spec)
    assert 0 < spec.stats["spec_accepted"] < spec.stats["spec_drafted"]
    # a string message: pytest shortens a list of dicts, and the margins are what the failure is for
    assert got == want, json.dumps(parted_requests(dataclasses.replace(model, impl="xla"), prompts, got, want))
