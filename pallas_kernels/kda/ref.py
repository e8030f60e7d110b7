"""KDA references (the spec) in jnp: token recurrence, chunked form, varlen chunked, decode step.

Conventions (flash-linear-attention's naive reference): q, k `[B, T, H, K]` already
L2-normalised, v `[B, T, HV, V]`, g `[B, T, HV, K]` natural-log decay (<= 0), beta `[B, T, HV]`,
state `[B, HV, K, V]` f32; HV is a multiple of H (value head `h` reads q/k head `h // (HV // H)`).
Per value head and token, with `scale` applied to q (default K**-0.5):

    S <- diag(exp g_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale q_t)                      (read after the write)

All math is f32; outputs are f32. These functions are also the `impl="xla"` path of the entry
points in `pallas_kernels.kda`.

The inputs' own producers, which the chunk kernel can fuse (flash-linear-attention's
`use_gate_in_kernel` and `use_qk_l2norm_in_kernel`): `kda_gate_ref` (the log decay from the
forget-gate logits, `Gate`) and `l2norm`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import CONTEXT_ROWS, rowwise
from pallas_kernels.varlen import CHUNK_TOKENS as CHUNK
from pallas_kernels.varlen import chunk_table


@dataclasses.dataclass(frozen=True)
class Gate:
    """KDA's forget gate, for the entry points that compute it themselves (`kda_chunk(...,
    gate=)`): g then holds the gate logits f `[.., HV, K]` (any float dtype) and the log decay is

        -exp(a_log) * softplus(f + dt_bias)                       (lower_bound None: Kimi-Linear)
        lower_bound * sigmoid(exp(a_log) * (f + dt_bias))         (K3's "safe" gate, in [lb, 0))

    a_log `[HV]` and dt_bias `[HV * K]` (or `[HV, K]`), f32. A pytree (lower_bound static)."""

    a_log: jax.Array
    dt_bias: jax.Array
    lower_bound: float | None = None


jax.tree_util.register_dataclass(Gate, data_fields=["a_log", "dt_bias"], meta_fields=["lower_bound"])


def kda_gate_ref(f: jax.Array, gate: Gate) -> jax.Array:
    """The log decay g `[.., HV, K]` f32 (<= 0) from the gate logits f `[.., HV, K]`."""
    HV, K = f.shape[-2:]
    x = f.astype(jnp.float32) + gate.dt_bias.astype(jnp.float32).reshape(HV, K)
    a = jnp.exp(gate.a_log.astype(jnp.float32))[:, None]  # [HV, 1]
    if gate.lower_bound is not None:
        return gate.lower_bound * jax.nn.sigmoid(a * x)
    return -a * jax.nn.softplus(x)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / ||x|| over the last axis, in f32."""
    xf = x.astype(jnp.float32)
    return xf / jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def fused_inputs_ref(q, k, g, gate: Gate | None, qk_l2norm: bool):
    """What a chunk kernel that fuses the gate and the L2 norm computes before the recurrence: g the
    log decay where gate is given; where qk_l2norm, q and k L2-normalised, q in f32 and k rounded to
    its own dtype (as the model's KDA layer feeds every kernel: a verify capture stores k so; the GPU
    kernels round both to bf16 operands anyway)."""
    if gate is not None:
        g = kda_gate_ref(g, gate)
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k).astype(k.dtype)
    return q, k, g


def _expand_qk(x: jax.Array, hv: int) -> jax.Array:
    """Repeat q/k heads (axis -2) to the value-head count: value head h reads head h // G."""
    h = x.shape[-2]
    if hv % h:
        raise ValueError(f"value heads ({hv}) must be a multiple of q/k heads ({h})")
    return x if hv == h else jnp.repeat(x, hv // h, axis=-2)


def _prep(q, k, v, g, beta, scale):
    """f32 inputs, q/k expanded to the value heads, scale folded into q (default K**-0.5)."""
    K, HV = q.shape[-1], v.shape[-2]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    return _expand_qk(q, HV) * scale, _expand_qk(k, HV), v, g, beta


def _state0(initial_state, shape):
    return jnp.zeros(shape, jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)


def _step(S, q, k, v, g, beta):
    """One recurrence step. S [..., K, V]; q,k,g [..., K]; v [..., V]; beta [...]; q pre-scaled.

    The K contractions are products and sums over the K axis, not einsums: the CPU runs an einsum of
    these shapes as an Eigen contraction whose split (and so its bits) changed with the program around
    it (a decode step's rows moved by ~1e-8 next to a prefill or inside a scan), where a reduction is
    the same loop in any program."""
    S = S * jnp.exp(g)[..., :, None]
    pred = jnp.sum(k[..., :, None] * S, axis=-2)
    S = S + k[..., :, None] * (beta[..., None] * (v - pred))[..., None, :]
    o = jnp.sum(q[..., :, None] * S, axis=-2)
    return o, S


def step_rows(S, q, k, v, g, beta):
    """`_step` for a batch of sequences (leading axis): the decode, verify and fold paths' step, through
    `dispatch.rowwise` so that in the batch-invariant mode a sequence's step is one compiled block
    whatever the batch (the CPU compiles a bare `_step` differently inside a scan, or next to a prefill),
    in blocks of `dispatch.CONTEXT_ROWS` sequences: each reads and writes its own state."""
    return rowwise(_step, S, q, k, v, g, beta, max_rows=CONTEXT_ROWS)


def kda_recurrent_ref(q, k, v, g, beta, *, scale=None, initial_state=None):
    """Token-by-token recurrence: the spec. Returns (o [B,T,HV,V] f32, final_state [B,HV,K,V] f32)."""
    B, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale)
    S0 = _state0(initial_state, (B, HV, K, V))

    def body(S, xs):
        o, S = _step(S, *xs)
        return S, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    S, o = jax.lax.scan(body, S0, xs)
    return jnp.moveaxis(o, 0, 1), S


# ---- chunked form ------------------------------------------------------------------------
# Within a chunk of C tokens with cumulative log decay G_t (per key channel), relative to the
# chunk's initial state S0:
#   u = (I + A)^-1 (beta v) - (I + A)^-1 (beta exp(G) k) S0 =: u0 - w S0
#   A_ti = beta_t sum_k k_t exp(G_t - G_i) k_i            (i < t)
#   o_t = scale (q_t exp(G_t)) S0 + sum_{i<=t} scale q_t exp(G_t - G_i) k_i u_i
#   S_C = exp(G_C) S0 + sum_i (k_i exp(G_C - G_i)) u_i^T
# Pairwise decays are formed as exp(G_t - G_i) with i <= t, so nothing overflows.


def _chunk_intra(q, k, v, g, beta):
    """State-independent part of a chunk. Shapes [..., C, K] / [..., C, V] / [..., C] (q pre-scaled)."""
    C = q.shape[-2]
    G = jnp.cumsum(g, axis=-2)
    causal = jnp.tril(jnp.ones((C, C), bool))
    diff = G[..., :, None, :] - G[..., None, :, :]  # [..., t, i, K]
    decay = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))
    A = jnp.einsum("...tk,...tik,...ik->...ti", k, decay, k)
    A = beta[..., :, None] * jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), A, 0.0)
    Aqk = jnp.einsum("...tk,...tik,...ik->...ti", q, decay, k)
    L = A + jnp.eye(C, dtype=A.dtype)
    rhs = jnp.concatenate([beta[..., None] * jnp.exp(G) * k, beta[..., None] * v], axis=-1)
    sol = jax.scipy.linalg.solve_triangular(L, rhs, lower=True, unit_diagonal=True)
    K = k.shape[-1]
    w, u0 = sol[..., :K], sol[..., K:]
    qg = q * jnp.exp(G)
    kd = k * jnp.exp(G[..., -1:, :] - G)
    gl = jnp.exp(G[..., -1, :])
    return w, u0, Aqk, qg, kd, gl


def _chunk_inter(S, w, u0, Aqk, qg, kd, gl):
    """State-dependent part: S [..., K, V] -> (o [..., C, V], S_next)."""
    u = u0 - jnp.einsum("...ck,...kv->...cv", w, S)
    o = jnp.einsum("...ck,...kv->...cv", qg, S) + jnp.einsum("...ci,...iv->...cv", Aqk, u)
    S = gl[..., :, None] * S + jnp.einsum("...ck,...cv->...kv", kd, u)
    return o, S


def kda_chunk_ref(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=CHUNK):
    """Chunked form over dense `[B, T]` batches, any T. Same contract as `kda_recurrent_ref`."""
    B, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale)
    C = chunk_size
    pad = (-T) % C
    if pad:  # zero k, g and beta leave the state untouched
        pw = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(pw, (q, k, v, g, beta))
    n = (T + pad) // C
    # [B, T, HV, X] -> [n, B, HV, C, X]
    to_chunks = lambda x: jnp.moveaxis(x.reshape(B, n, C, HV, -1), (1, 3), (0, 2))
    qc, kc, vc, gc = map(to_chunks, (q, k, v, g))
    bc = to_chunks(beta[..., None])[..., 0]
    intra = _chunk_intra(qc, kc, vc, gc, bc)
    S0 = _state0(initial_state, (B, HV, K, V))

    def body(S, xs):
        o, S = _chunk_inter(S, *xs)
        return S, o

    S, o = jax.lax.scan(body, S0, intra)  # o [n, B, HV, C, V]
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(B, n * C, HV, V)
    return o[:, :T], S


def kda_chunk_varlen_ref(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, align=1):
    """Packed varlen chunked KDA over `[1, T]` with `cu_seqlens [N+1]` (a traced array). align: the
    chunk table's box alignment (`chunk_table`; the Mosaic GPU path's 8: a sequence's first chunk
    then starts with up to 7 zero rows, which leave the state as it is)."""
    _, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    N = cu_seqlens.shape[0] - 1
    q, k, v, g, beta = _prep(q[0], k[0], v[0], g[0], beta[0], scale)
    tab = chunk_table(cu_seqlens, T, chunk_size, align)
    idx, valid = tab.token_idx, tab.token_valid  # [NC, C]
    gather = lambda x: jnp.where(
        valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x[jnp.clip(idx, 0, T - 1)], 0.0
    )
    # [NC, C, HV, X] -> [NC, HV, C, X]
    qc, kc, vc, gc = (jnp.swapaxes(gather(x), 1, 2) for x in (q, k, v, g))
    bc = jnp.swapaxes(gather(beta), 1, 2)
    intra = _chunk_intra(qc, kc, vc, gc, bc)
    S_init = _state0(initial_state, (N, HV, K, V))

    def body(carry, xs):
        S, final = carry
        seq, first, last, parts = xs
        S = jnp.where(first, S_init[seq], S)
        o, S = _chunk_inter(S, *parts)
        final = final.at[seq].set(jnp.where(last, S, final[seq]))
        return (S, final), o

    xs = (tab.chunk_seq, tab.chunk_first, tab.chunk_last, intra)
    (_, final), o = jax.lax.scan(body, (S_init[0] * 0, S_init), xs)  # o [NC, HV, C, V]
    o = jnp.swapaxes(o, 1, 2).reshape(-1, HV, V)
    dest = jnp.where(valid, idx, T).reshape(-1)
    out = jnp.zeros((T, HV, V), jnp.float32).at[dest].set(o, mode="drop")
    return out[None], final


def kda_decode_ref(q, k, v, g, beta, pool, slots, *, layer, reset=None, scale=None):
    """One recurrence step per sequence on the pool rows `pool[slots, layer]` (the XLA path)."""
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale)
    S = pool[slots, layer]
    if reset is not None:
        S = jnp.where(reset[:, None, None, None], 0.0, S)
    o, S = step_rows(S, q, k, v, g, beta)
    return o, pool.at[slots, layer].set(S)
