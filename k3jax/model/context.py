"""Step inputs: the packed ragged batch (`StepBatch`) and what every layer derives from it
(`StepContext`, computed once per step inside the jitted function).

Token layout: `tokens[:D*B]` is the decode segment (sequence i owns token slots [i*B, (i+1)*B);
D = number of decode sequences; B = 1, or gamma+1 in a speculative verify step), `tokens[D*B:]` the
prefill segment packed by `prefill_cu` (offsets relative to D*B).
Sequences `[0, D)` decode, `[D, N)` prefill. Media (image) tokens carry ids >= vocab_size and their input
embeddings in `embeds`. Padded sequences use slot 0 and page 0 (the sinks);
padded tokens fall outside every sequence and are ignored. All static sizes come from array shapes,
so a step compiles once per (T, N, NP, pages-per-sequence, R) bucket.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.varlen import CHUNK_TOKENS, ChunkTable, chunk_table


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    tokens: jax.Array  # i32[T] packed token ids
    positions: jax.Array  # i32[T] absolute position of each token in its sequence
    token_seq: jax.Array  # i32[T] owning sequence (anything for padded tokens)
    seq_slot: jax.Array  # i32[N] recurrent slot (0 = sink)
    seq_start: jax.Array  # i32[N] tokens already in context before this step (0 = fresh state)
    seq_len: jax.Array  # i32[N] new tokens this step (0 for padded sequences)
    seq_tok: jax.Array  # i32[N] packed index of the sequence's first new token
    page_table: jax.Array  # i32[N, P] KV page ids (0 = sink)
    prefill_cu: jax.Array  # i32[NP+1] prefill-segment offsets (relative to D)
    logit_idx: jax.Array  # i32[R] packed token rows to produce logits for
    # [T, D] input embeddings of media tokens (vision): a token id >= vocab_size takes its row here instead of
    # the embedding table (the host keys image tokens so; `k3jax.media`). None in text-only steps (another compile)
    embeds: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepContext:
    positions: jax.Array  # i32[T]
    token_seq: jax.Array  # i32[T]
    token_valid: jax.Array  # bool[T]
    seq_slot: jax.Array  # i32[N]
    seq_fresh: jax.Array  # bool[N] no carried state (seq_start == 0)
    seq_end: jax.Array  # i32[N] context length after this step
    page_table: jax.Array  # i32[N, P]
    prefill_cu: jax.Array  # i32[NP+1]
    prefill_chunks: ChunkTable  # over the prefill segment, in segment-relative token indices
    conv_idx: jax.Array  # i32[T, W] rows of concat(x, carried) read by each conv tap
    conv_state_idx: jax.Array  # i32[N, W-1] rows that become the new carried inputs
    num_decode: int = dataclasses.field(metadata=dict(static=True), default=0)
    block: int = dataclasses.field(metadata=dict(static=True), default=1)  # token slots per decode sequence

    @property
    def decode_tokens(self) -> int:
        return self.num_decode * self.block


def make_context(b: StepBatch, conv_size: int, block: int = 1) -> StepContext:
    """`block` > 1: speculative verify; decode sequence i owns token slots [i*block, (i+1)*block)
    (its first seq_len[i] are real: the last sampled token and its drafts)."""
    T = b.tokens.shape[0]
    N = b.seq_slot.shape[0]
    NP = b.prefill_cu.shape[0] - 1
    D = N - NP
    W1 = conv_size - 1
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(b.token_seq, 0, N - 1)
    off = t - b.seq_tok[seq]
    valid = (off >= 0) & (off < b.seq_len[seq])
    # conv taps: tap w of token t reads input offset m = off - W1 + w of its sequence; m < 0 reads
    # the carried inputs, stored after the T token rows as [N, W1] blocks.
    w = jnp.arange(conv_size, dtype=jnp.int32)
    m = off[:, None] - W1 + w[None, :]
    carried = T + seq[:, None] * W1 + W1 + m
    conv_idx = jnp.clip(jnp.where(m >= 0, t[:, None] - W1 + w[None, :], carried), 0, T + N * W1 - 1)
    # new carried inputs of sequence s: its last W1 inputs, counting the old carried ones
    e = jnp.arange(W1, dtype=jnp.int32)
    ms = b.seq_len[:, None] - W1 + e[None, :]
    s = jnp.arange(N, dtype=jnp.int32)
    conv_state_idx = jnp.where(ms >= 0, b.seq_tok[:, None] + ms, T + s[:, None] * W1 + W1 + ms)
    return StepContext(
        positions=b.positions,
        token_seq=seq,
        token_valid=valid,
        seq_slot=b.seq_slot,
        seq_fresh=b.seq_start == 0,
        seq_end=b.seq_start + b.seq_len,
        page_table=b.page_table,
        prefill_cu=b.prefill_cu,
        prefill_chunks=chunk_table(b.prefill_cu, T - D * block, CHUNK_TOKENS),
        conv_idx=conv_idx,
        conv_state_idx=conv_state_idx,
        num_decode=D,
        block=block,
    )
