"""The routed experts' grouped-matmul kernel (pallas_kernels/moe.py) on the CPU: the Mosaic GPU kernel in
interpret mode against its jnp reference and an f64 product, the model's routed experts on it
(`moe.GROUPED_MATMUL = "pallas_interpret"`) against `ragged_dot`, and its lowering for CUDA."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import preset
from k3jax.model import moe
from k3jax.model.common import proj
from k3jax.model.init import init_params
from pallas_kernels.moe import BLOCK_ROWS, grouped_matmul


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("K,N,bn,stages,splits", [(128, 128, 64, 2, 1), (192, 256, 128, 3, 1), (128, 128, 64, 4, 1),
                                                 (512, 128, 64, 2, 4)])
def test_grouped_matmul_kernel_in_interpret_mode(K, N, bn, stages, splits):
    """Blocks of three experts in any order (one expert over two blocks, one expert unused), the last two
    blocks past `used_blocks`: every used block's rows equal x_block @ w[expert] (f64) to bf16-input
    accuracy and the reference's bits to f32 summation order; the unused blocks are not computed. With 2,
    3 and 4 TMA stages (4: more stages than K steps), and K cut into 4 splits of 2 steps."""
    E, NB = 5, 6
    ks = jax.random.split(jax.random.PRNGKey(K + N), 2)
    x = jax.random.normal(ks[0], (NB * BLOCK_ROWS, K)).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (E, K, N)).astype(jnp.bfloat16)
    be = jnp.array([3, 3, 0, 4, 4, 4], jnp.int32)
    used = jnp.array([4], jnp.int32)
    got = np.asarray(grouped_matmul(x, w, be, used, impl="pallas_interpret", bn=bn, stages=stages, k_splits=splits))
    ref = np.asarray(grouped_matmul(x, w, be, used, impl="xla"))
    live = 4 * BLOCK_ROWS
    xb = np.asarray(x, np.float64).reshape(NB, BLOCK_ROWS, K)
    want = np.einsum("brk,bkn->brn", xb, np.asarray(w, np.float64)[np.asarray(be)]).reshape(-1, N)
    assert got.shape == (NB * BLOCK_ROWS, N) and got.dtype == np.float32
    assert _rel(got[:live], want[:live]) < 1e-6
    np.testing.assert_allclose(got[:live], ref[:live], rtol=1e-5, atol=1e-4)
    assert not np.allclose(got[live:], want[live:])  # blocks past used_blocks: not computed


def test_grouped_matmul_checks_its_arguments():
    x = jnp.zeros((2 * BLOCK_ROWS, 128), jnp.bfloat16)
    w = jnp.zeros((3, 128, 128), jnp.bfloat16)
    be, used = jnp.zeros((2,), jnp.int32), jnp.array([1], jnp.int32)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_matmul(x[:100], w, be, used)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_matmul(x, w[:, :64], be, used)
    with pytest.raises(ValueError, match="multiple of"):
        grouped_matmul(x, jnp.zeros((3, 128, 96), jnp.bfloat16), be, used, impl="pallas_interpret")
    with pytest.raises(ValueError, match="impl"):
        grouped_matmul(x, w, be, used, impl="triton")
    with pytest.raises(ValueError, match="stages"):
        grouped_matmul(x, w, be, used, impl="pallas_interpret", stages=1)
    with pytest.raises(ValueError, match="k_splits = 3 must divide the 2 K steps"):
        grouped_matmul(x, w, be, used, impl="pallas_interpret", k_splits=3)


def test_fixed_k_splits_depend_on_the_shape_alone():
    """The batch-invariant mode's K splits (`fixed_k_splits`): divisors of the K steps, each split at least
    `MIN_SPLIT_STEPS` steps, up to one CTA an SM over the N tiles; one where K is short or N wide."""
    from pallas_kernels.moe import MIN_SPLIT_STEPS, fixed_k_splits

    # k3-mini: a 7168 -> 1536 KDA projection (112 steps, 12 N tiles), 1536 -> 7168, 7168 -> 576 (64-wide tiles)
    assert [fixed_k_splits(K, N) for K, N in ((7168, 1536), (1536, 7168), (7168, 576))] == [8, 3, 14]
    # one N tile: splits of MIN_SPLIT_STEPS steps; too few steps, or N tiles for every SM: no split
    assert fixed_k_splits(MIN_SPLIT_STEPS * 3 * 64, 128) == 3
    assert fixed_k_splits((2 * MIN_SPLIT_STEPS - 1) * 64, 128) == 1 and fixed_k_splits(512, 32768) == 1


def test_routed_experts_on_the_kernel(monkeypatch):
    """k3-tiny in bf16, 37 tokens: the routed experts on the kernel (interpret mode) against `ragged_dot`,
    alone and over two expert-parallel shards (copies routed to the other shard's experts add nothing)."""
    cfg = preset("k3-tiny").replace(dtype="bfloat16")
    p = jax.tree.map(lambda a: a[0], init_params(cfg, 0).moe)
    x = jax.random.normal(jax.random.PRNGKey(5), (37, cfg.hidden_size)).astype(jnp.bfloat16)
    z = proj(x, p.latent_down) if p.latent_down is not None else x
    idx, w = moe.route(p, x, cfg)
    want = moe.routed_experts(p, z, idx, w, cfg)
    monkeypatch.setattr(moe, "GROUPED_MATMUL", "pallas_interpret")
    half = cfg.num_experts // 2
    shard = lambda lo, hi: dataclasses.replace(p, w1=p.w1[lo:hi], w3=p.w3[lo:hi], w2=p.w2[lo:hi])
    got = moe.routed_experts(p, z, idx, w, cfg)
    parts = (moe.routed_experts(shard(0, half), z, idx, w, cfg, first_expert=jnp.int32(0))
             + moe.routed_experts(shard(half, None), z, idx, w, cfg, first_expert=jnp.int32(half)))
    assert np.isfinite(np.asarray(got)).all()
    assert _rel(got, want) < 1e-2 and _rel(parts, want) < 1e-2
    monkeypatch.setattr(moe, "GROUPED_MATMUL", "cudnn")
    with pytest.raises(ValueError, match="GROUPED_MATMUL"):
        moe.routed_experts(p, z, idx, w, cfg)


def test_grouped_matmul_kernel_lowers_for_cuda():
    """Lowering only (no GPU): the kernel traces and lowers to the Mosaic GPU custom call at both N tiles
    (and with two K splits), and so does the model's MoE layer with `GROUPED_MATMUL = "pallas"` at k3-mini's
    expert widths."""
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def export(f, *args):
        try:
            return jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
        except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Mosaic GPU dialect
            pytest.skip(f"Mosaic GPU lowering unavailable: {e}")

    for bn, stages, splits in ((64, 2, 1), (128, 4, 2)):
        text = export(functools.partial(grouped_matmul, impl="pallas", bn=bn, stages=stages, k_splits=splits),
                      sd((6 * BLOCK_ROWS, 256), bf), sd((5, 256, 384), bf), sd((6,), jnp.int32), sd((1,), jnp.int32))
        assert "mosaic_gpu" in text
    cfg = preset("k3-mini")
    E, Din, inter = cfg.num_experts, cfg.moe_expert_dim, cfg.moe_intermediate_size
    ws = {"w1": sd((E, Din, inter), bf), "w3": sd((E, Din, inter), bf), "w2": sd((E, inter, Din), bf)}

    def layer(ws, z, idx, w):
        old, moe.GROUPED_MATMUL = moe.GROUPED_MATMUL, "pallas"
        try:
            return moe.routed_experts(type("P", (), ws)(), z, idx, w, cfg)
        finally:
            moe.GROUPED_MATMUL = old

    k = cfg.num_experts_per_token
    text = export(layer, ws, sd((64, Din), bf), sd((64, k), jnp.int32), sd((64, k), jnp.float32))
    assert text.count("mosaic_gpu") >= 3


def test_auto_takes_the_kernel_only_where_it_applies(monkeypatch):
    """`GROUPED_MATMUL = "auto"` (the default): `ragged_dot` on the CPU; with the kernel available (a Hopper
    GPU, faked here) the kernel for bf16 weights it tiles on one device, `ragged_dot` for f32 weights, for
    widths it does not tile and for expert-parallel shards."""
    cfg = preset("k3-tiny").replace(dtype="bfloat16")
    p = jax.tree.map(lambda a: a[0], init_params(cfg, 0).moe)
    assert moe.GROUPED_MATMUL == "auto" and moe.grouped_matmul_form(p) == "ragged"
    monkeypatch.setattr(moe, "resolve_impl", lambda impl, op: "pallas" if op == "moe_grouped_matmul" else "xla")
    assert moe.grouped_matmul_form(p) == "pallas"
    assert moe.grouped_matmul_form(p, first_expert=jnp.int32(0)) == "ragged"
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), p)
    assert moe.grouped_matmul_form(f32) == "ragged"
    odd = dataclasses.replace(p, w1=p.w1[:, :, :96], w3=p.w3[:, :, :96], w2=p.w2[:, :96])
    assert moe.grouped_matmul_form(odd) == "ragged"
    monkeypatch.setattr(moe, "GROUPED_MATMUL", "slabs")
    assert moe.grouped_matmul_form(p) == "slabs"
