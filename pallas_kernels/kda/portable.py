"""Portable Pallas KDA kernels (`pl.pallas_call`, no backend-specific primitives): the
`impl="pallas_interpret"` path, run with `interpret=True` so CI checks the kernel algorithm on CPU.

They follow the structure of the Mosaic GPU kernels in `mgpu.py`:
- decode: grid (sequence, value head); the pool is one whole (aliased) ref, read and written at
  row `(slot * L + layer) * HV + h` in place;
- chunked prefill: grid (value head, chunk) with the chunk axis innermost and sequential; the
  running state of each sequence lives in the final-state output (aliased to the initial
  state, so empty sequences keep it), and each chunk does the intra-chunk solve (forward
  substitution) and the state update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.varlen import chunk_table


def decode(q, k, v, g, beta, pool, slots, reset, *, layer, scale, interpret=True):
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    S_, L = pool.shape[:2]
    G = HV // H
    f32 = jnp.float32
    q = q.astype(f32) * scale
    pool3 = pool.reshape(S_ * L * HV, K, V)

    def kernel(q_ref, k_ref, v_ref, g_ref, b_ref, slot_ref, reset_ref, _pool_in, o_ref, pool_ref):
        n, h = pl.program_id(0), pl.program_id(1)
        row = (slot_ref[n] * L + layer) * HV + h
        S = pool_ref[row]
        S = jnp.where(reset_ref[n] != 0, 0.0, S)
        qv = q_ref[...].astype(f32)
        kv = k_ref[...].astype(f32)
        S = S * jnp.exp(g_ref[...].astype(f32))[:, None]
        pred = jnp.sum(S * kv[:, None], axis=0)
        u = b_ref[0].astype(f32) * (v_ref[...].astype(f32) - pred)
        S = S + kv[:, None] * u[None, :]
        o_ref[...] = jnp.sum(S * qv[:, None], axis=0)
        pool_ref[row] = S

    qk_spec = pl.BlockSpec((None, None, K), lambda n, h: (n, h // G, 0))
    full = lambda x: pl.BlockSpec(x.shape, lambda n, h: (0,) * x.ndim)
    slots = slots.astype(jnp.int32)
    reset = reset.astype(jnp.int32)
    o, pool3 = pl.pallas_call(
        kernel,
        grid=(N, HV),
        in_specs=[
            qk_spec, qk_spec,
            pl.BlockSpec((None, None, V), lambda n, h: (n, h, 0)),
            pl.BlockSpec((None, None, K), lambda n, h: (n, h, 0)),
            pl.BlockSpec((None, None, 1), lambda n, h: (n, h, 0)),
            full(slots), full(reset),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[pl.BlockSpec((None, None, V), lambda n, h: (n, h, 0)), pl.BlockSpec(memory_space=pl.ANY)],
        out_shape=[jax.ShapeDtypeStruct((N, HV, V), f32), jax.ShapeDtypeStruct(pool3.shape, f32)],
        input_output_aliases={7: 1},
        interpret=interpret,
    )(q, k, v, g, beta[..., None], slots, reset, pool3)
    return o, pool3.reshape(pool.shape)


def _chunk_kernel(C, K, V):
    f32 = jnp.float32

    def kernel(seq_ref, live_ref, q_ref, k_ref, v_ref, g_ref, b_ref, _h0, o_ref, ht_ref):
        c = pl.program_id(1)
        h = pl.program_id(0)
        s = seq_ref[c]
        q, k, v, g = q_ref[...], k_ref[...], v_ref[...], g_ref[...]  # [C, K] / [C, V]
        beta = b_ref[...][:, 0]
        G = jnp.cumsum(g, axis=0)
        t = jnp.arange(C)
        causal = t[:, None] >= t[None, :]
        dec = jnp.exp(jnp.where(causal[:, :, None], G[:, None, :] - G[None, :, :], -jnp.inf))  # [C, C, K]
        A = jnp.sum(k[:, None, :] * dec * k[None, :, :], axis=-1)
        A = jnp.where(t[:, None] > t[None, :], beta[:, None] * A, 0.0)
        Aqk = jnp.sum(q[:, None, :] * dec * k[None, :, :], axis=-1)
        rhs = jnp.concatenate([beta[:, None] * jnp.exp(G) * k, beta[:, None] * v], axis=-1)

        def fwd(i, x):  # forward substitution: x_i = rhs_i - sum_{j<i} A_ij x_j
            row = rhs[i] - jnp.sum(A[i][:, None] * x, axis=0)
            return x.at[i].set(row)

        sol = jax.lax.fori_loop(0, C, fwd, jnp.zeros_like(rhs))
        w, u0 = sol[:, :K], sol[:, K:]

        @pl.when(live_ref[c] != 0)
        def _():
            S = ht_ref[s, h]
            u = u0 - jnp.dot(w, S, preferred_element_type=f32)
            o_ref[...] = jnp.dot(q * jnp.exp(G), S, preferred_element_type=f32) + jnp.dot(Aqk, u, preferred_element_type=f32)
            kd = k * jnp.exp(G[-1:] - G)
            ht_ref[s, h] = jnp.exp(G[-1])[:, None] * S + jnp.dot(kd.T, u, preferred_element_type=f32)

    return kernel


def chunk(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, chunk_size, interpret=True):
    """Varlen chunked KDA over packed `[1, T]` inputs; same contract as `ref.kda_chunk_varlen_ref`."""
    _, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    N = cu_seqlens.shape[0] - 1
    C = chunk_size
    f32 = jnp.float32
    tab = chunk_table(cu_seqlens.astype(jnp.int32), T, C)
    idx, valid = jnp.clip(tab.token_idx, 0, T - 1), tab.token_valid
    G = HV // H

    def gather(x, rep=1):  # [T, h, X] -> [NC, HV, C, X] f32, zero outside valid tokens
        x = x[0][idx].astype(f32)
        if rep > 1:
            x = jnp.repeat(x, rep, axis=2)
        return jnp.swapaxes(jnp.where(valid[:, :, None, None], x, 0.0), 1, 2)

    qc = gather(q, G) * scale
    kc, vc, gc = gather(k, G), gather(v), gather(g)
    bc = gather(beta[..., None])
    NC = qc.shape[0]
    h0 = jnp.zeros((N, HV, K, V), f32) if initial_state is None else initial_state.astype(f32)
    live = valid[:, 0].astype(jnp.int32)
    blk = lambda X: pl.BlockSpec((None, None, C, X), lambda h, c: (c, h, 0, 0))
    full = lambda x: pl.BlockSpec(x.shape, lambda h, c: (0,) * x.ndim)
    o, ht = pl.pallas_call(
        _chunk_kernel(C, K, V),
        grid=(HV, NC),
        in_specs=[full(tab.chunk_seq), full(live), blk(K), blk(K), blk(V), blk(K), blk(1), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[blk(V), pl.BlockSpec(memory_space=pl.ANY)],
        out_shape=[jax.ShapeDtypeStruct((NC, HV, C, V), f32), jax.ShapeDtypeStruct(h0.shape, f32)],
        input_output_aliases={7: 1},
        interpret=interpret,
    )(tab.chunk_seq, live, qc, kc, vc, gc, bc, h0)
    o = jnp.swapaxes(o, 1, 2).reshape(-1, HV, V)
    dest = jnp.where(valid, tab.token_idx, T).reshape(-1)
    out = jnp.zeros((T, HV, V), f32).at[dest].set(o, mode="drop")
    return out[None], ht
