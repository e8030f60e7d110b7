"""MLA attention over the paged latent cache, absorbed form (MQA over `[c ; k_pe]`).

`mla_paged_attention(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim, impl)`:
q `[G, C, H, Dk]` absorbed queries (`Dk = kv_lora + rope`), grouped so every group reads one
sequence's pages; `q_pos [G, C]` absolute positions (causal: a query sees keys at positions <= its
own); `page_rows [G, P]` page ids of the group's sequence; `pages [pages, L, page_size, Dk]` the
whole pool (read at `layer`); `kv_len [G]` keys in context. Returns `[G, C, H, v_dim]` f32: the
softmax-weighted latent `c` (the first `v_dim` key channels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import resolve_impl

IMPLS = ("xla",)  # implemented; "pallas", "pallas_interpret" and "auto" run "xla" for now


def mla_paged_attention_ref(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim):
    G, P = page_rows.shape
    ps, Dk = pages.shape[2], pages.shape[3]
    keys = pages[page_rows, layer].reshape(G, P * ps, Dk).astype(jnp.float32)  # [G, S, Dk]
    s = jnp.einsum("gchd,gsd->gchs", q.astype(jnp.float32), keys) * scale
    kpos = jnp.arange(P * ps, dtype=jnp.int32)
    mask = (kpos[None, None, :] <= q_pos[:, :, None]) & (kpos[None, None, :] < kv_len[:, None, None])
    s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.isnan(p), 0.0, p)  # queries with no visible key (padding only)
    return jnp.einsum("gchs,gsr->gchr", p, keys[..., :v_dim])


def mla_paged_attention(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim, impl="xla"):
    # validates the name; MLA has no Pallas kernel yet, so every impl runs the XLA path (a model
    # run with impl="pallas" uses the KDA kernels and this)
    resolve_impl(impl, "mla_paged_attention")
    return mla_paged_attention_ref(q, q_pos, page_rows, pages, kv_len, layer=layer, scale=scale, v_dim=v_dim)
