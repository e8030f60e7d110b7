"""Small shared pieces: RMSNorm, activations, projections (all `rowwise`: batch-invariant when the mode is on)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from pallas_kernels.dispatch import rowwise


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
    """x [..., D] @ w [D, X] in the weight's dtype with f32 accumulation (`rowwise` over x's leading axis)."""
    return rowwise(lambda x: jnp.einsum("...d,dx->...x", x.astype(w.dtype), w,
                                        preferred_element_type=jnp.float32).astype(w.dtype), x)


def layer_slice(tree, i: int):
    """The parameters of one layer out of a stacked (leading layer dim) pytree, or out of a tuple of
    per-layer pytrees (`forward.split_layers`)."""
    if isinstance(tree, tuple):
        return tree[i]
    return jax.tree_util.tree_map(lambda a: a[i], tree)
