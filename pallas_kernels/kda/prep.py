"""State-independent (intra-chunk) part of chunked KDA in matmul form, for the GPU path.

Same outputs as `ref._chunk_intra` (w, u0, Aqk, qg, kd, gl), written so that XLA runs it as
batched matmuls and fused elementwise/reduction kernels, never materialising the [C, C, K]
decay cube of the reference:

- pairwise decays: the chunk is split into sub-chunks of B tokens. For a row t in sub-chunk I
  and a column i in an earlier sub-chunk J, the decay factors through e_J, the cumulative log
  decay at the end of J:

      exp(G_t - G_i) = exp(G_t - e_J) * exp(e_J - G_i),

  both factors <= 1 (G is non-increasing), so the block is a plain matmul of `k_t exp(G_t - e_J)`
  (or q) with `k_i exp(e_J - G_i)` and nothing overflows, whatever the gate. The B x B diagonal
  blocks are one fused multiply-exp-reduce over K.
- the unit lower-triangular solve (I + A) X = R is blocked: the inverses of the B x B diagonal
  blocks by Neumann doubling (A is nilpotent), then forward substitution over the C / B block
  rows with matmuls.
- the cumulative sum over the chunk is a matmul with a lower-triangular ones matrix.
The solve and the cumsum run at HIGHEST matmul precision (f32); the rest at the default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SUB = 16  # sub-chunk length
HI = jax.lax.Precision.HIGHEST


def chunk_cumsum(g):
    """Inclusive cumsum over axis -2 of [..., C, K] as a matmul (f32)."""
    C = g.shape[-2]
    tri = jnp.tril(jnp.ones((C, C), g.dtype))
    return jnp.einsum("ti,...ik->...tk", tri, g, precision=HI)


def _pair_scores(q, k, G, sub):
    """(sum_k k_t e(t,i) k_i for i < t, sum_k q_t e(t,i) k_i for i <= t) with e(t,i) =
    exp(G_t - G_i): [..., C, K] -> two [..., C, C]."""
    C, K = G.shape[-2], G.shape[-1]
    nb = C // sub
    bshape = G.shape[:-2]
    blocks = lambda x: x.reshape(bshape + (nb, sub, K))
    Gb, qb, kb = blocks(G), blocks(q), blocks(k)
    e = Gb[..., -1, :]  # [..., nb, K] G at the end of each sub-chunk
    kr = kb * jnp.exp(e[..., :, None, :] - Gb)  # [..., J, i, K]  k_i exp(e_J - G_i)
    # left factors for the block pairs (I, J), J < I only
    Is = [i for i in range(nb) for j in range(i)]
    Js = [j for i in range(nb) for j in range(i)]
    lo = jnp.exp(Gb[..., Is, :, :] - e[..., Js, None, :])  # [..., P, t, K], <= 1
    krp = kr[..., Js, :, :]

    def off(lhs_b):
        blk = jnp.einsum("...ptk,...pik->...pti", lhs_b[..., Is, :, :] * lo, krp)  # [..., P, sub, sub]
        full = jnp.zeros(bshape + (nb, nb, sub, sub), blk.dtype).at[..., Is, Js, :, :].set(blk)
        return jnp.swapaxes(full, -3, -2).reshape(bshape + (C, C))

    off_k, off_q = off(kb), off(qb)
    # diagonal blocks: explicit decays in one fused multiply-exp-reduce over K
    incl = jnp.tril(jnp.ones((sub, sub), bool))
    dec = jnp.exp(jnp.where(incl[:, :, None], Gb[..., :, None, :] - Gb[..., None, :, :], -jnp.inf))  # [..., n, t, i, K]
    kk = kb[..., None, :, :]
    dk = jnp.sum(kb[..., :, None, :] * dec * kk, axis=-1)
    dq = jnp.sum(qb[..., :, None, :] * dec * kk, axis=-1)
    eye_b = jnp.eye(nb, dtype=G.dtype)
    bdiag = lambda x: (x[..., :, :, None, :] * eye_b[:, None, :, None]).reshape(bshape + (C, C))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    return jnp.where(strict, off_k + bdiag(dk), 0.0), off_q + bdiag(dq)


def _unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower A [..., n, n] (nilpotent): prod_j (I + (-A)^(2^j))."""
    n = A.shape[-1]
    eye = jnp.eye(n, dtype=A.dtype)
    N = -A
    T = eye + N
    p = 1
    while 2 * p < n:
        N = jnp.matmul(N, N, precision=HI)
        T = jnp.matmul(T, eye + N, precision=HI)
        p *= 2
    return T


def unit_lower_solve(A, R, sub=SUB):
    """X with (I + A) X = R; A [..., C, C] strictly lower, R [..., C, M]. Blocked by `sub` rows."""
    C = A.shape[-1]
    nb = C // sub
    blk = lambda i, j: A[..., i * sub:(i + 1) * sub, j * sub:(j + 1) * sub]
    Dinv = _unit_lower_inverse(jnp.stack([blk(i, i) for i in range(nb)], axis=-3))  # [..., nb, sub, sub]
    xs = []
    for i in range(nb):
        r = R[..., i * sub:(i + 1) * sub, :]
        if i:
            r = r - jnp.matmul(A[..., i * sub:(i + 1) * sub, : i * sub], jnp.concatenate(xs, axis=-2), precision=HI)
        xs.append(jnp.matmul(Dinv[..., i, :, :], r, precision=HI))
    return jnp.concatenate(xs, axis=-2)


def chunk_prep(q, k, v, g, beta, sub=SUB):
    """q (pre-scaled), k, g [..., C, K], v [..., C, V], beta [..., C], f32 ->
    (w [..., C, K], u0 [..., C, V], Aqk [..., C, C], qg [..., C, K], kd [..., C, K], gl [..., K])."""
    C = q.shape[-2]
    if C % sub:
        raise ValueError(f"chunk {C} must be a multiple of the sub-chunk {sub}")
    G = chunk_cumsum(g)
    Akk, Aqk = _pair_scores(q, k, G, sub)
    A = beta[..., :, None] * Akk
    K = k.shape[-1]
    eG = jnp.exp(G)
    rhs = jnp.concatenate([beta[..., None] * eG * k, beta[..., None] * v], axis=-1)
    sol = unit_lower_solve(A, rhs, sub)
    w, u0 = sol[..., :K], sol[..., K:]
    qg = q * eG
    kd = k * jnp.exp(G[..., -1:, :] - G)
    gl = jnp.exp(G[..., -1, :])
    return w, u0, Aqk, qg, kd, gl
