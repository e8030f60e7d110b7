"""Host side of a step: pack the scheduled work of many requests into a padded `StepBatch`.

Shapes come from a small fixed bucket set, so the jitted step compiles once per bucket:
decode sequences `D` from `decode_buckets`, prefill tokens from `token_buckets` with a fixed number
`max_prefill_seqs` of prefill sequences, a fixed page-table width, one logit row per sequence.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.model.context import StepBatch
from k3jax.model.forward import forward
from k3jax.sampling import request_keys, sample
from k3jax.state import StateOps, init_state, restore_checkpoints, snapshot_slots

if TYPE_CHECKING:
    from k3jax.engine.scheduler import StepPlan


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
    single: bool = False  # only the largest buckets: decode-only (D, 0) and mixed (D, P): two compiles

    @staticmethod
    def pick(options: Sequence[int], n: int, what: str) -> int:
        i = bisect.bisect_left(options, n)
        if i == len(options):
            raise ValueError(f"{what} {n} exceeds the largest bucket {options[-1]}")
        return options[i]

    def shapes(self):
        """Every (D, P) pair a step can take: decode-only, prefill-only and mixed."""
        if self.single:
            return [(self.decode[-1], 0), (self.decode[-1], self.tokens[-1])]
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
    if any(len(s.tokens) != 1 for s in decode):
        raise ValueError("a decode sequence takes exactly one token")
    lens = [len(s.tokens) for s in prefill]
    if sum(lens) > P:
        raise ValueError(f"{sum(lens)} prefill tokens exceed bucket {P}")
    seqs = list(decode) + list(prefill)
    n_pages = [len(s.pages) for s in seqs]
    if n_pages and max(n_pages) > pages_per_seq:
        raise ValueError(f"a sequence needs {max(n_pages)} pages, the page table holds {pages_per_seq}")
    T, N = D + P, D + NP
    nd = len(decode)
    # sequence index of each packed sequence: decode i -> i, prefill j -> D + j
    seq_idx = np.concatenate([np.arange(nd), D + np.arange(len(prefill))]).astype(np.int32)
    cu = np.zeros(NP + 1, np.int32)
    cu[1: len(prefill) + 1] = np.cumsum(lens)
    cu[len(prefill) + 1:] = cu[len(prefill)]
    first_tok = np.concatenate([np.arange(nd), D + cu[: len(prefill)]]).astype(np.int32)
    seq_len = np.array([1] * nd + lens, np.int32)
    starts = np.array([s.start for s in seqs], np.int32)

    tokens = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    token_seq = np.zeros(T, np.int32)
    if nd:
        tokens[:nd] = [s.tokens[0] for s in decode]
    if prefill:
        tokens[D: D + cu[len(prefill)]] = [t for s in prefill for t in s.tokens]
    owner = np.repeat(np.arange(len(seqs)), seq_len)  # packed sequence of each real token
    tok_idx = np.repeat(first_tok, seq_len) + (np.arange(len(owner)) - np.repeat(np.cumsum(seq_len) - seq_len, seq_len))
    positions[tok_idx] = np.repeat(starts, seq_len) + tok_idx - np.repeat(first_tok, seq_len)
    token_seq[tok_idx] = seq_idx[owner]

    seq_slot = np.zeros(N, np.int32)
    seq_start = np.zeros(N, np.int32)
    seq_len_full = np.zeros(N, np.int32)
    seq_tok = np.full(N, T, np.int32)  # padded sequences own no token
    seq_slot[seq_idx] = [s.slot for s in seqs]
    seq_start[seq_idx] = starts
    seq_len_full[seq_idx] = seq_len
    seq_tok[seq_idx] = first_tok
    page_table = np.zeros((N, pages_per_seq), np.int32)
    if seqs:
        rows = np.repeat(seq_idx, n_pages)
        cols = np.arange(sum(n_pages)) - np.repeat(np.cumsum(n_pages) - n_pages, n_pages)
        page_table[rows, cols] = [p for s in seqs for p in s.pages]

    R = N if R is None else R
    logit_idx = np.zeros(R, np.int32)
    rows_out: list[list[int]] = []
    nrow = 0
    if not any(s.all_logits for s in seqs):  # one row per sequence: its last token
        logit_idx[: len(seqs)] = first_tok + seq_len - 1
        rows_out = [[i] for i in range(len(seqs))]
        seqs = []
    for i, s in enumerate(seqs):
        t0, n = int(first_tok[i]), int(seq_len[i])
        want = range(t0, t0 + n) if s.all_logits else (t0 + n - 1,)
        if nrow + len(want) > R:
            raise ValueError(f"more logit rows than the bucket's {R}")
        logit_idx[nrow: nrow + len(want)] = want
        rows_out.append(list(range(nrow, nrow + len(want))))
        nrow += len(want)
    batch = StepBatch(
        tokens=tokens, positions=positions, token_seq=token_seq, seq_slot=seq_slot, seq_start=seq_start,
        seq_len=seq_len_full, seq_tok=seq_tok, page_table=page_table, prefill_cu=cu, logit_idx=logit_idx,
    )
    return PackedStep(batch=batch, rows=rows_out)


# ---- the engine's device step ---------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    temperature: jax.Array  # f32[N] (0: greedy)
    top_k: jax.Array  # i32[N] (0: off)
    top_p: jax.Array  # f32[N] (1: off)
    keys: jax.Array  # u32[N, 2] raw threefry key data


def _engine_step(params, state, batch: StepBatch, ops: StateOps, prev_tokens, samp: SamplingBatch, cfg, impl):
    """Restore checkpoints -> resolve placeholders -> forward -> snapshot -> sample, all on device.
    Returns (sampled tokens padded to prev_tokens' length, state)."""
    tokens = jnp.where(batch.tokens < 0, prev_tokens[jnp.maximum(-batch.tokens - 1, 0)], batch.tokens)
    batch = dataclasses.replace(batch, tokens=tokens)
    state = restore_checkpoints(state, ops, batch.seq_slot)
    logits, state = forward(params, state, batch, cfg, impl)
    state = snapshot_slots(state, ops, batch.seq_slot)
    toks = sample(logits, samp.temperature, samp.top_k, samp.top_p, samp.keys)
    return jnp.zeros_like(prev_tokens).at[: toks.shape[0]].set(toks), state


engine_step = jax.jit(_engine_step, static_argnames=("cfg", "impl"), donate_argnames=("state",))


@dataclasses.dataclass
class InFlight:
    plan: "StepPlan"
    tokens: jax.Array  # i32[N_max] on device

    def host(self) -> np.ndarray:
        return np.asarray(self.tokens)


class ModelRunner:
    """Owns the parameters and the donated device state; turns a `StepPlan` into one step."""

    def __init__(self, model, *, slots: int, pages: int, page_size: int, buckets: Buckets, impl: str = "xla"):
        self.model = model
        self.cfg = model.config
        self.buckets = buckets
        self.impl = impl
        self.state = init_state(self.cfg, slots, pages, page_size)
        self.n_max = buckets.decode[-1] + buckets.max_prefill_seqs
        self.prev = jnp.zeros((self.n_max,), jnp.int32)

    def _shape(self, n_decode: int, n_prefill_tokens: int) -> tuple[int, int, int]:
        if self.buckets.single:
            P = self.buckets.tokens[-1] if n_prefill_tokens else 0
            return self.buckets.decode[-1], P, self.buckets.max_prefill_seqs if P else 0
        D = self.buckets.pick(self.buckets.decode, n_decode, "decode batch") if n_decode else 0
        P = self.buckets.pick(self.buckets.tokens, n_prefill_tokens, "prefill tokens") if n_prefill_tokens else 0
        return D, P, self.buckets.max_prefill_seqs if P else 0

    def _run(self, packed: PackedStep, ops: StateOps, samp: SamplingBatch) -> jax.Array:
        tokens, self.state = engine_step(self.model.params, self.state, packed.batch, ops, self.prev, samp,
                                         self.cfg, self.impl)
        self.prev = tokens
        return tokens

    def launch(self, plan: "StepPlan") -> InFlight:
        seqs = plan.decode + plan.prefill
        D, P, NP = self._shape(len(plan.decode), sum(len(s.tokens) for s in plan.prefill))
        work = lambda s: SeqWork(s.tokens, s.start, s.req.slot, s.req.pages)
        packed = pack_step([work(s) for s in plan.decode], [work(s) for s in plan.prefill], D=D, P=P, NP=NP,
                           pages_per_seq=self.buckets.pages_per_seq)
        N = D + NP
        restore, snap = np.zeros(N, np.int32), np.zeros(N, np.int32)  # per sequence (decode i, prefill D + j)
        temp, top_p = np.zeros(N, np.float32), np.ones(N, np.float32)  # per logit row (plan order)
        top_k, keys = np.zeros(N, np.int32), np.zeros((N, 2), np.uint32)
        for i, s in enumerate(seqs):
            seq = i if i < len(plan.decode) else D + (i - len(plan.decode))
            restore[seq], snap[seq] = s.restore_src, s.snap_dst
            sp = s.req.sampling
            temp[i], top_k[i], top_p[i] = sp.temperature, sp.top_k, sp.top_p
        keys[: len(seqs)] = request_keys([s.req.seed for s in seqs], [s.req.scheduled_samples for s in seqs])
        samp = SamplingBatch(temperature=temp, top_k=top_k, top_p=top_p, keys=keys)
        return InFlight(plan=plan, tokens=self._run(packed, StateOps(restore_src=restore, snap_dst=snap), samp))

    def warmup(self, progress=None) -> int:
        """Compile every bucket with padding-only steps (they only touch the sinks)."""
        shapes = self.buckets.shapes()
        for D, P in shapes:
            NP = self.buckets.max_prefill_seqs if P else 0
            packed = pack_step([], [], D=D, P=P, NP=NP, pages_per_seq=self.buckets.pages_per_seq)
            N = D + NP
            z = np.zeros(N, np.int32)
            samp = SamplingBatch(np.zeros(N, np.float32), z, np.ones(N, np.float32), np.zeros((N, 2), np.uint32))
            self._run(packed, StateOps(z, z), samp)
            if progress is not None:
                progress.update()
        jax.block_until_ready(self.prev)
        return len(shapes)
