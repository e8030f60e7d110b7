"""MLA layer (NoPE): optional q-LoRA, kv latent `c` (RMSNorm) + shared `k_pe`, absorbed attention
over the paged cache, optional sigmoid output gate, o_proj.

Every step writes the new tokens' `[c ; k_pe]` into their pages first and then attends over the
pages, so prefill, chunked prefill and decode run the same arithmetic.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.model.common import proj, rms_norm, rowwise
from k3jax.model.context import StepContext
from k3jax.state import KVPool
from pallas_kernels import mla as mla_kernels
from pallas_kernels.dispatch import CONTEXT_CHUNKS, CONTEXT_ROWS, batch_invariant_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLAParams:  # stacked over MLA layers (leading dim L)
    kv_a: jax.Array  # [L, D, R + N_rope]
    kv_a_norm: jax.Array  # [L, R]
    kv_b: jax.Array  # [L, R, H*(N_nope + V)]
    o_proj: jax.Array  # [L, H*V, D]
    q_a: jax.Array | None = None  # [L, D, Q] q-LoRA
    q_a_norm: jax.Array | None = None  # [L, Q]
    q_b: jax.Array | None = None  # [L, Q, H*(N_nope + N_rope)]
    q_proj: jax.Array | None = None  # [L, D, H*(N_nope + N_rope)] without q-LoRA
    g_proj: jax.Array | None = None  # [L, D, H*V] sigmoid output gate


def write_kv(pool: KVPool, kv: jax.Array, ctx: StepContext, layer: int) -> KVPool:
    """Scatter kv [T, Dk] into each valid token's page slot; padded tokens go to the sink page."""
    ps = pool.page_size
    pos = jnp.maximum(ctx.positions, 0)
    page = jnp.take_along_axis(ctx.page_table[ctx.token_seq], (pos // ps)[:, None], axis=1, mode="clip")[:, 0]
    page = jnp.where(ctx.token_valid, page, 0)
    return pool.write_tokens(page, layer, pos % ps, kv)


def mla_layer(p: MLAParams, x: jax.Array, ctx: StepContext, pool: KVPool, layer: int, cfg: ModelConfig,
              impl: str = "xla", shard=None):
    """x [T, D] (after input norm) -> (y [T, D], pool). `p` holds this layer's slice."""
    T = x.shape[0]
    H, Nn, Nr, Vd, R = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    with jax.named_scope("mla_proj"):
        if p.q_a is not None:
            q = proj(rms_norm(proj(x, p.q_a), p.q_a_norm, cfg.mla_norm_eps), p.q_b)
        else:
            q = proj(x, p.q_proj)
        q = q.reshape(T, H, Nn + Nr)
        ckv = proj(x, p.kv_a)
        c = rms_norm(ckv[:, :R], p.kv_a_norm, cfg.mla_norm_eps)
        pool = write_kv(pool, jnp.concatenate([c, ckv[:, R:]], axis=-1), ctx, layer)
        kv_b = p.kv_b.reshape(R, H, Nn + Vd)
        w_uk, w_uv = kv_b[..., :Nn], kv_b[..., Nn:]
        absorb = lambda q: jnp.einsum("thn,rhn->thr", q[..., :Nn].astype(jnp.float32), w_uk.astype(jnp.float32))
        qf = jnp.concatenate([rowwise(absorb, q), q[..., Nn:].astype(jnp.float32)], axis=-1)  # [T, H, R + N_rope]

    scale = (Nn + Nr) ** -0.5
    nd, B = ctx.num_decode, ctx.block
    ndt = nd * B  # decode-segment tokens
    outs = []
    # `pool.attention_pages` gives (rows, pages): the pool itself, read at `layer` in place, or (unified
    # memory) the step's pages gathered out of the shared buffer as a one-layer pool
    lay = layer if pool.in_place else 0
    attend = lambda q, q_pos, rows, pages, kv_len: mla_kernels.mla_paged_attention(
        q, q_pos, rows, pages, kv_len, layer=lay, scale=scale, v_dim=R, impl=impl)
    if shard is not None:  # per head shard (and per dp shard of the pages with DP-attention)
        attend = shard.paged_attention(attend)
    with jax.named_scope("mla_attn"):
        per_token = batch_invariant_rows() > 0
        if per_token:  # decode and verify tokens: every token its own query over its sequence's pages
            rows, pages = pool.attention_pages(ctx.page_table, layer)
            seq = ctx.token_seq[:ndt]  # already clipped to the step's sequences (`make_context`)
            one = lambda q, pos, r, n: attend(q[:, None], pos[:, None], r, pages, n)[:, 0]
            if ndt:
                outs.append(rowwise(one, qf[:ndt], jnp.where(ctx.token_valid[:ndt], ctx.positions[:ndt], -1),
                                    rows[seq], ctx.seq_end[seq], max_rows=CONTEXT_ROWS))
        elif nd:
            o = attend(qf[:ndt].reshape(nd, B, *qf.shape[1:]), ctx.positions[:ndt].reshape(nd, B),
                       *pool.attention_pages(ctx.page_table[:nd], layer), ctx.seq_end[:nd])
            outs.append(o.reshape(ndt, *o.shape[2:]))
        if T > ndt:  # prefill: one chunk of one sequence per query group
            tab = ctx.prefill_chunks
            Tp = T - ndt
            idx = jnp.clip(tab.token_idx, 0, Tp - 1) + ndt  # [NC, C]
            seq = tab.chunk_seq + nd
            if per_token:  # a chunk's tokens at fixed depths of its fixed-size group, groups in fixed blocks
                chunk = lambda q, pos, r, n: attend(q, pos, r, pages, n)
                o = rowwise(chunk, qf[idx], jnp.where(tab.token_valid, ctx.positions[idx], -1), rows[seq],
                            ctx.seq_end[seq], max_rows=CONTEXT_CHUNKS)
            else:
                o = attend(qf[idx], ctx.positions[idx], *pool.attention_pages(ctx.page_table[seq], layer),
                           ctx.seq_end[seq])
            dest = jnp.where(tab.token_valid, tab.token_idx, Tp).reshape(-1)
            outs.append(jnp.zeros((Tp, H, R), jnp.float32).at[dest].set(o.reshape(-1, H, R), mode="drop"))
        o_lat = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]

    with jax.named_scope("mla_out"):
        o = rowwise(lambda o: jnp.einsum("thr,rhv->thv", o, w_uv.astype(jnp.float32)), o_lat).reshape(T, H * Vd)
        if p.g_proj is not None:
            o = o * jax.nn.sigmoid(proj(x, p.g_proj).astype(jnp.float32))
        y = proj(o.astype(x.dtype), p.o_proj)
    return y, pool
