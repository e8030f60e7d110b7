"""Ragged (varlen) packing helpers shared by the kernel families.

Packed tokens `[T]` hold N sequences back to back, delimited by `cu_seqlens [N+1]`; tokens past
`cu_seqlens[N]` are padding. A chunk table splits every sequence into chunks of at most C
tokens that never cross a sequence boundary, so chunked algorithms can run over a fixed
`[NC, C]` grid (NC = T // C + N is a static upper bound on the chunk count).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

CHUNK_TOKENS = 64  # chunk length of the chunked kernels (and of checkpoint alignment)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChunkTable:
    token_idx: jax.Array  # i32[NC, C] packed token index of each chunk position
    token_valid: jax.Array  # bool[NC, C]
    chunk_seq: jax.Array  # i32[NC] sequence of each chunk (clamped into [0, N) for empty chunks)
    chunk_first: jax.Array  # bool[NC] first chunk of its sequence
    chunk_last: jax.Array  # bool[NC] last chunk of its sequence
    chunk_start: jax.Array  # i32[NC] offset of the chunk's first token within its sequence


def chunk_table(cu_seqlens: jax.Array, total_tokens: int, chunk: int) -> ChunkTable:
    cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    nch = (lens + chunk - 1) // chunk
    ccu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch).astype(jnp.int32)])
    NC = total_tokens // chunk + N
    c = jnp.arange(NC, dtype=jnp.int32)
    seq = jnp.searchsorted(ccu[1:], c, side="right").astype(jnp.int32)
    live = c < ccu[N]
    seq_c = jnp.clip(seq, 0, max(N - 1, 0))
    r = c - ccu[seq_c]
    start = cu[seq_c] + r * chunk
    n = jnp.where(live, jnp.clip(lens[seq_c] - r * chunk, 0, chunk), 0)
    pos = jnp.arange(chunk, dtype=jnp.int32)
    return ChunkTable(
        token_idx=start[:, None] + pos[None, :],
        token_valid=pos[None, :] < n[:, None],
        chunk_seq=seq_c,
        chunk_first=live & (r == 0),
        chunk_last=live & (r == nch[seq_c] - 1),
        chunk_start=r * chunk,
    )
