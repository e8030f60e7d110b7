"""MLA attention over the paged latent cache, absorbed form (MQA over `[c ; k_pe]`).

`mla_paged_attention(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim, impl)`:
q `[G, C, H, Dk]` absorbed queries (`Dk = kv_lora + rope`), grouped so every group reads one
sequence's pages; `q_pos [G, C]` absolute positions (causal: a query sees keys at positions <= its
own); `page_rows [G, P]` page ids of the group's sequence; `pages [pages, L, page_size, Dk]` the
whole pool (read at `layer`); `kv_len [G]` keys in context. Returns `[G, C, H, v_dim]` f32: the
softmax-weighted latent `c` (the first `v_dim` key channels).

The XLA path (`mla_paged_attention_xla`) reads the keys in blocks of whole pages with a running
(online) softmax, so its memory is one block's keys and scores (`KEY_BLOCK_BYTES`), whatever the
context; `mla_paged_attention_ref` is the one-pass form (every key gathered in f32, every score held:
quadratic in a prefill chunk's context), kept as the spec and as `XLA_FORM = "dense"`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import resolve_impl

IMPLS = ("xla",)  # implemented; "pallas", "pallas_interpret" and "auto" run "xla" for now

# The XLA path's form: "blocked" (the default: keys in blocks, online softmax) or "dense" (the reference's
# one pass; its temporaries grow with groups x context: a 16k prefill chunk needs ~28 GB on k3-mini).
XLA_FORM = "blocked"
# Bytes of temporaries one key block may take (its keys, bf16 and f32, and its f32 scores and weights):
# the block holds as many whole pages as fit, at least one. 512 MiB: with 16-token pages, k3-mini's 16k
# prefill chunk (256 query groups of 64 tokens) reads 208 keys a block, decode at batch 256 576 keys.
# Device call 4 (session 24, H100, 64-token pages): a 16k prefill in 6.8 GB of temporaries (the dense form
# asked for 28 GB and ran out of memory); 3.6% slower than the dense form at 4k, 2.7% in decode at 64 x 16k.
KEY_BLOCK_BYTES = 512 << 20
# Which key blocks the blocked form's loop visits: "static" every block of the page table (a loop of known
# trip count), "needed" only up to the last block any query of the call can see (a trip count computed on
# the device: attention then costs what the contexts hold, not what the page table could, which the
# engine sizes for max_seq_len). The skipped blocks would add exact zeros (their weights are 0 and the
# running max does not move), so both give the same bits. "auto": "needed", except on a GPU, where XLA
# reads a device-bounded loop's condition back to the host every trip: "static" there until a device call
# measures that against the blocks it saves.
KEY_BLOCKS = "auto"


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


def key_block_pages(G, C, H, P, page_size, Dk, budget=None) -> int:
    """Pages per key block of the blocked form: as many as keep one block's temporaries within `budget`
    bytes (default `KEY_BLOCK_BYTES`), at least 1, at most P, spread evenly over the blocks (the last
    block pads with the sink page, masked)."""
    budget = KEY_BLOCK_BYTES if budget is None else budget
    per_key = G * (C * H * 8 + Dk * 6)  # f32 scores and weights; keys in the pool's bf16 and in f32
    most = max(1, min(P, budget // (per_key * page_size)))
    nb = -(-P // most)
    return -(-P // nb)


def key_blocks() -> str:
    """`KEY_BLOCKS` resolved: "static" or "needed"."""
    if KEY_BLOCKS not in ("auto", "static", "needed"):
        raise ValueError(f"mla.KEY_BLOCKS must be 'auto', 'static' or 'needed', got {KEY_BLOCKS!r}")
    if KEY_BLOCKS == "auto":
        return "static" if jax.default_backend() == "gpu" else "needed"
    return KEY_BLOCKS


def mla_paged_attention_xla(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim, block_pages=None,
                            blocks=None):
    """The blocked form: for each block of `block_pages` pages (default `key_block_pages`), its keys
    gathered, scored and folded into a running max, sum and weighted sum (f32), as in flash attention;
    a query with no visible key gets zeros, as in the reference. `blocks`: "static" or "needed" (default
    `key_blocks()`): whether the loop stops after the last block a query of the call can see."""
    G, C, H, Dk = q.shape
    P = page_rows.shape[1]
    ps = pages.shape[2]
    bp = block_pages or key_block_pages(G, C, H, P, ps, Dk)
    nb = -(-P // bp)
    rows = jnp.pad(page_rows, ((0, 0), (0, nb * bp - P)))  # page 0, the sink: masked by kv_len
    rows = rows.reshape(G, nb, bp).transpose(1, 0, 2)  # [nb, G, bp]
    qf = q.astype(jnp.float32)
    Sb = bp * ps
    f32 = jnp.float32

    def block(b, carry):
        m, l, acc = carry  # [G, C, H], [G, C, H], [G, C, H, v_dim]
        keys = pages[jax.lax.dynamic_index_in_dim(rows, b, 0, keepdims=False), layer].reshape(G, Sb, Dk)
        keys = keys.astype(f32)
        s = jnp.einsum("gchd,gsd->gchs", qf, keys) * scale
        kpos = b * Sb + jnp.arange(Sb, dtype=jnp.int32)
        mask = (kpos[None, None, :] <= q_pos[:, :, None]) & (kpos[None, None, :] < kv_len[:, None, None])
        s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing visible yet: every term is exp(-inf) = 0
        p = jnp.exp(s - shift[..., None])
        alpha = jnp.exp(m - shift)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("gchs,gsr->gchr", p, keys[..., :v_dim])
        return m_new, l, acc

    init = (jnp.full((G, C, H), -jnp.inf, f32), jnp.zeros((G, C, H), f32), jnp.zeros((G, C, H, v_dim), f32))
    if nb == 1:
        _, l, acc = block(0, init)
    else:
        trips = nb
        if (blocks or key_blocks()) == "needed":  # keys at positions < need are all any query here sees
            need = jnp.max(jnp.minimum(kv_len, q_pos.max(-1) + 1))
            trips = jnp.clip(-(-need // Sb), 0, nb)
        _, l, acc = jax.lax.fori_loop(0, trips, block, init)
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def mla_paged_attention(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim, impl="xla"):
    # validates the name; MLA has no Pallas kernel yet, so every impl runs the XLA path (a model
    # run with impl="pallas" uses the KDA kernels and this)
    resolve_impl(impl, "mla_paged_attention")
    if XLA_FORM not in ("blocked", "dense"):
        raise ValueError(f"mla.XLA_FORM must be 'blocked' or 'dense', got {XLA_FORM!r}")
    form = mla_paged_attention_xla if XLA_FORM == "blocked" else mla_paged_attention_ref
    return form(q, q_pos, page_rows, pages, kv_len, layer=layer, scale=scale, v_dim=v_dim)
