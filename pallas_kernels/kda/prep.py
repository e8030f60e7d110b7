"""State-independent (intra-chunk) part of chunked KDA in matmul form: the algorithm of the Mosaic
GPU prep kernel (`mgpu._chunk_prep_call`), and in jnp its XLA version and CPU-checkable mirror.

Same outputs as `ref._chunk_intra` (w, u0, Aqk, qg, kd, gl), without the [C, C, K] decay cube of
the reference and without overflow for any gate, every step a C x C matrix product:

- cumulative decays: G = Lc g with Lc lower-triangular ones. Differences of cumulative sums are
  themselves products with {-1, 0, 1} matrices, D = S g, so they are exact to the rounding of
  one short sum, never the difference of two large G.
- pairwise decays, by levels (the bits of t XOR i): at level l (half-block b = 2^l) the pairs are
  t in the second half and i in the first half of the same 2b-block. With r the last row of that
  first half and D_t = G_t - G_r (a level matrix S_l times g),

      exp(G_t - G_i) = exp(min(D_t, 0)) * exp(min(-D_i, 0))        (both factors <= 1),

  so each level is one [C, K] x [K, C] product of scaled k (or q) with scaled k, masked to its
  pairs; the log2(C) levels cover every i < t exactly once. The diagonal of Aqk is q_t . k_t.
- (I + A)^-1 with A strictly lower: the 16 x 16 diagonal blocks D by Neumann doubling
  (prod_j (I + N^(2^j)), N = -A_diag, nilpotent), then with M = D^-1 L (L: the blocks below,
  M^4 = 0): (I + A)^-1 = (I - M)(I + M^2) D^-1. Ten C x C products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SUB = 16  # diagonal block of the solve
HI = jax.lax.Precision.HIGHEST


def level_tables(C: int):
    """(Lc [C, C] lower ones incl. diagonal, S_last [C, C] = 1[i > t], S [nl, C, C], M [nl, C, C])
    with nl = log2(C): S[l] @ g = G_t - G_ref_l(t), M[l] the pairs (t, i) of level l."""
    nl = int(np.log2(C))
    if 2**nl != C:
        raise ValueError(f"chunk {C} must be a power of two")
    t = np.arange(C)[:, None]
    i = np.arange(C)[None, :]
    lc = (i <= t).astype(np.float32)
    s_last = (i > t).astype(np.float32)
    S, M = [], []
    for lv in range(nl):
        b = 1 << lv
        ref = (t & ~(2 * b - 1)) + b - 1
        S.append(lc - (i <= ref))
        M.append((((t ^ i) >> (lv + 1)) == 0) & ((t & b) != 0) & ((i & b) == 0))
    return lc, s_last, np.stack(S).astype(np.float32), np.stack(M)


def pair_scores(q, k, g):
    """Level form of (A_kk strictly lower, A_qk lower incl. diagonal) and (G, D_last = G_C - G):
    q (pre-scaled), k, g [..., C, K] f32."""
    C = q.shape[-2]
    lc, s_last, S, M = (jnp.asarray(x) for x in level_tables(C))
    mm = lambda a, b: jnp.einsum("ti,...ik->...tk", a, b, precision=HI)
    G, d_last = mm(lc, g), mm(s_last, g)
    akk = jnp.zeros(q.shape[:-1] + (C,), jnp.float32)
    aqk = jnp.where(jnp.eye(C, dtype=bool), jnp.einsum("...tk,...ik->...ti", q, k), 0.0)
    for lv in range(S.shape[0]):
        d = mm(S[lv], g)
        fl, fr = jnp.exp(jnp.minimum(d, 0.0)), jnp.exp(jnp.minimum(-d, 0.0))
        rk = k * fr
        akk += jnp.where(M[lv], jnp.einsum("...tk,...ik->...ti", k * fl, rk), 0.0)
        aqk += jnp.where(M[lv], jnp.einsum("...tk,...ik->...ti", q * fl, rk), 0.0)
    return akk, aqk, G, d_last


def unit_lower_inverse(A, sub=SUB):
    """(I + A)^-1 for A [..., C, C] strictly lower: Neumann doubling on the sub x sub diagonal
    blocks, then the block merge (I - M)(I + M^2) D^-1 (C / sub <= 4 block rows)."""
    C = A.shape[-1]
    if C % sub or C // sub > 4:
        raise ValueError(f"chunk {C} must be 1-4 blocks of {sub}")
    mm = lambda a, b: jnp.matmul(a, b, precision=HI)
    eye = jnp.eye(C, dtype=A.dtype)
    blk = np.arange(C) // sub
    diag = jnp.asarray(blk[:, None] == blk[None, :])
    N = jnp.where(diag, -A, 0.0)
    Dinv = eye + N
    for _ in range(int(np.ceil(np.log2(sub))) - 1):
        N = mm(N, N)
        Dinv = Dinv + mm(Dinv, N)
    M = mm(Dinv, jnp.where(diag, 0.0, A))
    Y = Dinv + mm(mm(M, M), Dinv)
    return Y - mm(M, Y)


def chunk_prep(q, k, v, g, beta):
    """q (pre-scaled), k, g [..., C, K], v [..., C, V], beta [..., C], f32 ->
    (w [..., C, K], u0 [..., C, V], Aqk [..., C, C], qg [..., C, K], kd [..., C, K], gl [..., K])."""
    akk, aqk, G, d_last = pair_scores(q, k, g)
    Tinv = unit_lower_inverse(beta[..., :, None] * akk)
    eG = jnp.exp(G)
    bt = beta[..., None]
    w = jnp.matmul(Tinv, bt * eG * k, precision=HI)
    u0 = jnp.matmul(Tinv, bt * v, precision=HI)
    return w, u0, aqk, q * eG, k * jnp.exp(d_last), jnp.exp(G[..., -1, :])
