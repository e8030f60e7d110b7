"""Host side of a step: pack the scheduled work of many requests into a padded `StepBatch`.

Shapes come from a small fixed bucket set, so the jitted step compiles once per bucket:
decode sequences `D` from `decode_buckets`, prefill tokens from `token_buckets` with a fixed number
`max_prefill_seqs` of prefill sequences, a fixed page-table width, one logit row per sequence.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

import numpy as np

from k3jax.model.context import StepBatch


@dataclasses.dataclass
class SeqWork:
    """One sequence's share of a step."""

    tokens: Sequence[int]  # new tokens this step
    start: int  # tokens already in context (their KV is in `pages`, their state in `slot`)
    slot: int  # recurrent slot (state read at start, written at end)
    pages: Sequence[int]  # page ids covering positions [0, start + len(tokens))
    all_logits: bool = False  # logits for every new token (else only the last)


@dataclasses.dataclass(frozen=True)
class Buckets:
    decode: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    tokens: tuple[int, ...] = (64, 128, 256, 512)
    max_prefill_seqs: int = 4
    pages_per_seq: int = 64

    @staticmethod
    def pick(options: Sequence[int], n: int, what: str) -> int:
        i = bisect.bisect_left(options, n)
        if i == len(options):
            raise ValueError(f"{what} {n} exceeds the largest bucket {options[-1]}")
        return options[i]

    def shapes(self):
        """Every (D, P) pair a step can take: decode-only, prefill-only and mixed."""
        out = [(d, 0) for d in self.decode]
        out += [(d, p) for d in (0,) + tuple(self.decode) for p in self.tokens]
        return out


@dataclasses.dataclass
class PackedStep:
    batch: StepBatch  # numpy arrays
    rows: list[list[int]]  # per sequence (decode then prefill order): its logit rows


def pack_step(decode: Sequence[SeqWork], prefill: Sequence[SeqWork], *, D: int, P: int, NP: int,
              pages_per_seq: int, R: int | None = None) -> PackedStep:
    """Pad `decode` (one token each) and `prefill` sequences into a StepBatch of the given bucket.

    D decode sequences, P prefill tokens, NP prefill sequences, `pages_per_seq` page-table width,
    R logit rows (default: one per sequence, D + NP).
    """
    if len(decode) > D:
        raise ValueError(f"{len(decode)} decode sequences exceed bucket {D}")
    if len(prefill) > NP:
        raise ValueError(f"{len(prefill)} prefill sequences exceed bucket {NP}")
    for s in decode:
        if len(s.tokens) != 1:
            raise ValueError("a decode sequence takes exactly one token")
    n_pre = sum(len(s.tokens) for s in prefill)
    if n_pre > P:
        raise ValueError(f"{n_pre} prefill tokens exceed bucket {P}")
    T, N = D + P, D + NP
    tokens = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    token_seq = np.zeros(T, np.int32)
    seq_slot = np.zeros(N, np.int32)
    seq_start = np.zeros(N, np.int32)
    seq_len = np.zeros(N, np.int32)
    seq_tok = np.full(N, T, np.int32)  # padded sequences own no token
    page_table = np.zeros((N, pages_per_seq), np.int32)
    prefill_cu = np.zeros(NP + 1, np.int32)
    rows: list[list[int]] = []
    R = N if R is None else R
    logit_idx = np.zeros(R, np.int32)
    nrow = 0

    def place(i: int, s: SeqWork, t0: int):
        nonlocal nrow
        n = len(s.tokens)
        if len(s.pages) > pages_per_seq:
            raise ValueError(f"sequence needs {len(s.pages)} pages, page table holds {pages_per_seq}")
        tokens[t0 : t0 + n] = s.tokens
        positions[t0 : t0 + n] = np.arange(s.start, s.start + n)
        token_seq[t0 : t0 + n] = i
        seq_slot[i], seq_start[i], seq_len[i], seq_tok[i] = s.slot, s.start, n, t0
        page_table[i, : len(s.pages)] = s.pages
        want = list(range(t0, t0 + n)) if s.all_logits else [t0 + n - 1]
        if nrow + len(want) > R:
            raise ValueError(f"more logit rows than the bucket's {R}")
        logit_idx[nrow : nrow + len(want)] = want
        rows.append(list(range(nrow, nrow + len(want))))
        nrow += len(want)

    for i, s in enumerate(decode):
        place(i, s, i)
    t = D
    for j, s in enumerate(prefill):
        place(D + j, s, t)
        t += len(s.tokens)
        prefill_cu[j + 1] = t - D
    prefill_cu[len(prefill) + 1 :] = t - D
    batch = StepBatch(
        tokens=tokens, positions=positions, token_seq=token_seq, seq_slot=seq_slot, seq_start=seq_start,
        seq_len=seq_len, seq_tok=seq_tok, page_table=page_table, prefill_cu=prefill_cu, logit_idx=logit_idx,
    )
    return PackedStep(batch=batch, rows=rows)
