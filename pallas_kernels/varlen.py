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
    token_idx: jax.Array  # i32[NC, C] packed token index of each chunk position (box start + position)
    token_valid: jax.Array  # bool[NC, C]
    chunk_seq: jax.Array  # i32[NC] sequence of each chunk (clamped into [0, N) for empty chunks)
    chunk_first: jax.Array  # bool[NC] first chunk of its sequence
    chunk_last: jax.Array  # bool[NC] last chunk of its sequence
    chunk_start: jax.Array  # i32[NC] offset of the chunk's first token within its sequence
    chunk_lead: jax.Array  # i32[NC] positions of the chunk's box before its first token (0 unless align > 1)
    seq_chunks: jax.Array  # i32[N+1] offsets of each sequence's chunks (sequence n: chunks [seq_chunks[n], [n+1]))


def chunk_table(cu_seqlens: jax.Array, total_tokens: int, chunk: int, align: int = 1) -> ChunkTable:
    """Chunks of at most `chunk` tokens that never cross a sequence boundary. Each chunk is a box of
    `chunk` packed rows; align > 1 starts every box on a multiple of `align` rows (a sequence's first
    box then begins up to align - 1 rows before its first token: `chunk_lead` positions of the box
    belong to the previous sequence and are not valid), so a kernel can copy the box straight from
    the packed tokens with aligned block copies. NC = (T + N (align - 1)) // chunk + N bounds the
    chunk count."""
    cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    lead0 = cu[:-1] % align  # rows of a sequence's first box before its first token
    nch = jnp.where(lens > 0, (lens + lead0 + chunk - 1) // chunk, 0)
    ccu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch).astype(jnp.int32)])
    NC = (total_tokens + N * (align - 1)) // chunk + N
    c = jnp.arange(NC, dtype=jnp.int32)
    seq = jnp.searchsorted(ccu[1:], c, side="right").astype(jnp.int32)
    live = c < ccu[N]
    seq_c = jnp.clip(seq, 0, max(N - 1, 0))
    r = c - ccu[seq_c]
    box = cu[seq_c] - lead0[seq_c] + r * chunk  # first packed row of the chunk's box
    lead = jnp.where(r == 0, lead0[seq_c], 0)
    first = box + lead
    n = jnp.where(live, jnp.clip(cu[seq_c + 1] - first, 0, chunk - lead), 0)
    pos = jnp.arange(chunk, dtype=jnp.int32)
    return ChunkTable(
        token_idx=box[:, None] + pos[None, :],
        token_valid=(pos[None, :] >= lead[:, None]) & (pos[None, :] < (lead + n)[:, None]),
        chunk_seq=seq_c,
        chunk_first=live & (r == 0),
        chunk_last=live & (r == nch[seq_c] - 1),
        chunk_start=first - cu[seq_c],
        chunk_lead=lead,
        seq_chunks=ccu,
    )
