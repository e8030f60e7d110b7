"""Block Attention Residuals (arXiv 2603.15031, K3 form; see shared/K3-SPEC.md section 2).

A mix site has a pseudo-query `proj [D]` and an RMSNorm weight `norm [D]`. Its sources are the
banked blocks plus the current partial sum p; per token:
    k_s = RMSNorm_noweight(V_s);  logit_s = <k_s, norm * proj>;  a = softmax_s;  mix = sum_s a_s V_s
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from k3jax.model.common import rms_norm, rowwise


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ResSite:
    proj: jax.Array  # [..., D] pseudo-query (res_proj.weight)
    norm: jax.Array  # [..., D] RMSNorm weight folded into the query (res_norm.weight)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttnResParams:
    attn: ResSite  # [L, D] before each attention sublayer
    mlp: ResSite  # [L, D] before each MLP sublayer
    out: ResSite  # [D] before the final norm


def mix(bank: list[jax.Array], p: jax.Array, site: ResSite, eps: float) -> jax.Array:
    """Depth-softmax mix of the bank rows and the partial sum p ([T, D] each); p when bank is empty."""
    if not bank:
        return p
    q = site.norm.astype(jnp.float32) * site.proj.astype(jnp.float32)

    def one(*rows):  # the bank's and p's rows of the same tokens
        V = jnp.stack([r.astype(jnp.float32) for r in rows])  # [S, T, D]
        logits = jnp.einsum("std,d->st", rms_norm(V, None, eps), q)
        a = jax.nn.softmax(logits, axis=0)
        return jnp.einsum("st,std->td", a, V).astype(p.dtype)

    return rowwise(one, *bank, p)
