"""Small shared pieces: RMSNorm, activations, projections (all `rowwise`: batch-invariant when the mode is on)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from pallas_kernels import moe as gmm
from pallas_kernels.dispatch import batch_invariant_rows, resolve_impl, rowwise

# The batch-invariant mode's projections (`proj`), read while tracing: "auto" (the default since session 23)
# runs them on the grouped-matmul kernel (`pallas_kernels/moe.py`, one group, the N tile fixed by the
# weight's width, K cut into `gmm.fixed_k_splits(D, X)` ranges from the shape alone, up to one CTA an SM,
# the partials added in a fixed order) where it runs (a Hopper GPU, bf16 weights whose shape it tiles), with
# no row-block loop: each output row is its own row's products over K in a fixed order, whatever the other
# rows or the grid (as the mode's routed experts, session 20); elsewhere the blocks. "blocks": `rowwise`
# row-block loops. "pallas_interpret": the kernel in interpret mode (CPU tests). Device calls 25-27 (session
# 23, H100): the mode's k3-mini step 8.5 / 9.4 ms against the blocks' 13.2 / 13.2 at batch 1 / 64, and
# the GPU mode tests pass on both paths (bench/NOTES.md, session 23).
INVARIANT_PROJ_FORMS = ("auto", "blocks", "pallas_interpret")
INVARIANT_PROJ = "auto"


def dtype_of(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype)


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in f32 over the last axis; returns x's dtype. `w=None` normalises without a weight."""

    def norm(x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        if w is not None:
            y = y * w.astype(jnp.float32)
        return y.astype(x.dtype)

    return rowwise(norm, x)


def glu(gate: jax.Array, up: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gated activation of the FFNs: SwiGLU (`silu`) or SiTU (`situ`), computed in f32."""
    gf, uf = gate.astype(jnp.float32), up.astype(jnp.float32)
    if cfg.hidden_act == "silu":
        out = jax.nn.silu(gf) * uf
    else:
        b, bl = cfg.situ_beta, cfg.situ_linear_beta
        out = b * jnp.tanh(gf / b) * jax.nn.sigmoid(gf) * (bl * jnp.tanh(uf / bl))
    return out.astype(gate.dtype)


def proj(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., D] @ w [D, X] in the weight's dtype with f32 accumulation (`rowwise` over x's leading axis; in
    the batch-invariant mode on the grouped-matmul kernel where `INVARIANT_PROJ` gives it)."""
    impl = _proj_kernel(w) if batch_invariant_rows() else None
    if impl is not None:
        D, X = w.shape
        rows = x.reshape(-1, D).astype(w.dtype)
        M = rows.shape[0]
        NB = max(1, -(-M // gmm.BLOCK_ROWS))
        rows = jnp.pad(rows, ((0, NB * gmm.BLOCK_ROWS - M), (0, 0)))
        y = gmm.grouped_matmul(rows, w[None], jnp.zeros((NB,), jnp.int32), jnp.full((1,), NB, jnp.int32), impl=impl,
                               bn=gmm.fixed_tile_cols(X), k_splits=gmm.fixed_k_splits(D, X))
        return y[:M].reshape(*x.shape[:-1], X).astype(w.dtype)
    return rowwise(lambda x: jnp.einsum("...d,dx->...x", x.astype(w.dtype), w,
                                        preferred_element_type=jnp.float32).astype(w.dtype), x)


def _proj_kernel(w: jax.Array) -> str | None:
    """The grouped-matmul kernel's impl for the mode's product with w [D, X] (`INVARIANT_PROJ`), or None."""
    if INVARIANT_PROJ not in INVARIANT_PROJ_FORMS:
        raise ValueError(f"common.INVARIANT_PROJ must be one of {INVARIANT_PROJ_FORMS}, got {INVARIANT_PROJ!r}")
    if INVARIANT_PROJ == "blocks" or w.ndim != 2 or w.dtype != jnp.bfloat16 or not gmm.tiles(*w.shape):
        return None
    if INVARIANT_PROJ == "pallas_interpret":
        return "pallas_interpret"
    return "pallas" if resolve_impl("auto", "moe_grouped_matmul") == "pallas" else None


def layer_slice(tree, i: int):
    """The parameters of one layer out of a stacked (leading layer dim) pytree, or out of a tuple of
    per-layer pytrees (`forward.split_layers`)."""
    if isinstance(tree, tuple):
        return tree[i]
    return jax.tree_util.tree_map(lambda a: a[i], tree)
