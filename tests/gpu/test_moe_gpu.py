"""The routed experts' grouped matmul on the GPU (`moe.routed_experts`) in every form of
`moe.GROUPED_MATMUL`: "ragged" (`jax.lax.ragged_dot`, which XLA's GPU backend lowers as a zero-padded dense
product unless a flag hands it to cuDNN, e.g. `XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true`),
"slabs" (batched products over all experts) and "pallas" (the Mosaic GPU grouped matmul of
pallas_kernels/moe.py; bf16 only: f32 goes through its jnp reference), against a float64 numpy reference that
runs every copy through its own expert. The same assignment (ids and weights) goes to all, so no router
choice is involved. Run under each flag set that a benchmark times (`bench/device_calls.sh 16`)."""

import functools
import types

import numpy as np
import pytest

from tests.gpu import require_gpu

require_gpu()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from k3jax.config import preset  # noqa: E402
from k3jax.model import moe  # noqa: E402
from tests.reference_model import act  # noqa: E402

pytestmark = pytest.mark.gpu


def _reference(cfg, p, z, idx, w):
    z, w1, w3, w2, w = (np.asarray(a, np.float64) for a in (z, p.w1, p.w3, p.w2, w))
    idx = np.asarray(idx)
    y = np.zeros_like(z)
    for e in np.unique(idx):  # every copy routed to expert e, as one f64 product
        t, j = np.nonzero(idx == e)
        y_e = act(cfg, z[t] @ w1[e], z[t] @ w3[e]) @ w2[e]
        np.add.at(y, t, w[t, j][:, None] * y_e)
    return y


@functools.lru_cache(maxsize=1)  # the cases run grouped by (tokens, dtype): one case's arrays at a time
def _case(tokens, dtype):
    """k3-mini's expert shapes, random weights and inputs, T tokens routed at random (k distinct experts a
    token, two experts unused), and the float64 result."""
    cfg = preset("k3-mini")
    E, k, Din, inter = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_expert_dim, cfg.moe_intermediate_size
    dt = jnp.dtype(dtype)
    ks = jax.random.split(jax.random.PRNGKey(tokens), 5)
    p = types.SimpleNamespace(w1=(jax.random.normal(ks[0], (E, Din, inter)) / Din**0.5).astype(dt),
                              w3=(jax.random.normal(ks[1], (E, Din, inter)) / Din**0.5).astype(dt),
                              w2=(jax.random.normal(ks[2], (E, inter, Din)) / inter**0.5).astype(dt))
    z = jax.random.normal(ks[3], (tokens, Din)).astype(dt)
    rng = np.random.default_rng(tokens)
    idx = jnp.asarray(np.stack([rng.choice(E - 2, k, replace=False) for _ in range(tokens)]), jnp.int32)
    w = jax.random.uniform(ks[4], (tokens, k), jnp.float32)
    return cfg, p, z, idx, w, _reference(cfg, p, z, idx, w)


@pytest.mark.parametrize("tokens,dtype,grouped", [(t, d, g) for t in (1, 7, 64, 257) for d in ("bfloat16", "float32")
                                                  for g in moe.GROUPED_MATMULS if g != "pallas_interpret"])
def test_routed_experts_against_float64(tokens, dtype, grouped, monkeypatch):
    """k3-mini's expert shapes (16 experts, 4 a token) and T tokens: relative error < 1e-2 in bf16 (the
    weights and inputs rounded to bf16 first, so the reference sees the same values) and < 1e-5 in f32 at
    "highest" precision (the engine's f32 scope), in every form of `moe.GROUPED_MATMUL`."""
    cfg, p, z, idx, w, want = _case(tokens, dtype)
    monkeypatch.setattr(moe, "GROUPED_MATMUL", grouped)  # read while tracing (a fresh jit below)
    with jax.default_matmul_precision("highest"):
        run = jax.jit(lambda ws, z, idx, w: moe.routed_experts(types.SimpleNamespace(**ws), z, idx, w, cfg))
        got = np.asarray(run(vars(p), z, idx, w), np.float64)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < (1e-2 if dtype == "bfloat16" else 1e-5), rel


def test_kernel_rows_do_not_depend_on_stages_or_other_rows():
    """The grouped-matmul kernel (`pallas_kernels.moe.grouped_matmul`, impl "pallas") at k3-mini's gate
    width: its output is bit for bit the same with 2, 3, 4 and 6 TMA stages (`gmm.STAGES`: the K order never
    changes) and within 1e-2 of float64; and a row's output does not change, bit for bit, when the other
    rows of its block, its block's position or the block count change (what the batch-invariant mode's
    "kernel" form relies on), at the mode's fixed N tile, with K in one range and in four splits."""
    import pallas_kernels.moe as gmm

    cfg = preset("k3-mini")
    E, K, N = cfg.num_experts, cfg.moe_expert_dim, cfg.moe_intermediate_size
    R = gmm.BLOCK_ROWS
    ks = jax.random.split(jax.random.PRNGKey(3), 2)
    w = (jax.random.normal(ks[0], (E, K, N)) / K**0.5).astype(jnp.bfloat16)
    x = jax.random.normal(ks[1], (5 * R, K)).astype(jnp.bfloat16)
    be, used = jnp.array([2, 2, 7, 9, 0], jnp.int32), jnp.array([4], jnp.int32)
    run = jax.jit(gmm.grouped_matmul, static_argnames=("impl", "bn", "stages", "k_splits"))
    bn = gmm.fixed_tile_cols(N)
    outs = {s: np.asarray(run(x, w, be, used, impl="pallas", bn=bn, stages=s))[: 4 * R] for s in (2, 3, 4, 6)}
    xb = np.asarray(x, np.float64).reshape(5, R, K)[:4]
    want = np.einsum("brk,bkn->brn", xb, np.asarray(w, np.float64)[np.asarray(be)[:4]]).reshape(-1, N)
    assert np.linalg.norm(outs[2] - want) / np.linalg.norm(want) < 1e-2
    for s, o in outs.items():
        np.testing.assert_array_equal(o, outs[2], err_msg=f"stages={s}")
    # row 70 (block 1, expert 2) alone in a block, at another row of it, and in a one-block grid
    row = x[70]
    alone = jnp.zeros((2 * R, K), x.dtype).at[R + 5].set(row)
    first = jnp.zeros((R, K), x.dtype).at[0].set(row)
    got = [np.asarray(run(alone, w, be[:2], jnp.array([2], jnp.int32), impl="pallas", bn=bn))[R + 5],
           np.asarray(run(first, w, be[1:2], jnp.array([1], jnp.int32), impl="pallas", bn=bn))[0]]
    for g in got:
        np.testing.assert_array_equal(g, outs[2][70])
    # the same with K cut into splits (`k_splits`, the mode's projections: `gmm.fixed_k_splits`)
    S = 4
    split = np.asarray(run(x, w, be, used, impl="pallas", bn=bn, k_splits=S))[: 4 * R]
    assert np.linalg.norm(split - want) / np.linalg.norm(want) < 1e-2
    for xs, bes, n, r in ((alone, be[:2], 2, R + 5), (first, be[1:2], 1, 0)):
        g = np.asarray(run(xs, w, bes, jnp.array([n], jnp.int32), impl="pallas", bn=bn, k_splits=S))[r]
        np.testing.assert_array_equal(g, split[70])
