"""Host side of a step: pack the scheduled work of many requests into a padded `StepBatch`.

Shapes come from a small fixed bucket set, so the jitted step compiles once per bucket:
decode sequences `D` from `decode_buckets`, prefill tokens from `token_buckets` with a fixed number
`max_prefill_seqs` of prefill sequences, a fixed page-table width, one logit row per sequence.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.model.context import StepBatch
from k3jax.model.forward import forward, is_split
from k3jax.sampling import bias_row, count_sampled, is_hot, penalized, penalty_counts, request_keys, sample, token_logprobs
from k3jax.state import StateOps, init_state, init_unified_state, restore_checkpoints, snapshot_slots

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
    embeds: np.ndarray | None = None  # [len(tokens), D] input rows of media tokens (ids >= vocab; others ignored)


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
              pages_per_seq: int, R: int | None = None, block: int = 1) -> PackedStep:
    """Pad `decode` (one token each) and `prefill` sequences into a StepBatch of the given bucket.

    D decode sequences, P prefill tokens, NP prefill sequences, `pages_per_seq` page-table width,
    R logit rows (default: one per sequence, D + NP). `block` > 1 (a speculative verify step):
    decode sequence i takes 1..block tokens in token slots [i*block, (i+1)*block) and gets a logit
    row for every slot (rows [0, D*block)), then one row per prefill sequence.
    """
    if len(decode) > D:
        raise ValueError(f"{len(decode)} decode sequences exceed bucket {D}")
    if len(prefill) > NP:
        raise ValueError(f"{len(prefill)} prefill sequences exceed bucket {NP}")
    if any(not 1 <= len(s.tokens) <= block for s in decode):
        raise ValueError(f"a decode sequence takes 1 to {block} tokens")
    lens = [len(s.tokens) for s in prefill]
    if sum(lens) > P:
        raise ValueError(f"{sum(lens)} prefill tokens exceed bucket {P}")
    seqs = list(decode) + list(prefill)
    n_pages = [len(s.pages) for s in seqs]
    if n_pages and max(n_pages) > pages_per_seq:
        raise ValueError(f"a sequence needs {max(n_pages)} pages, the page table holds {pages_per_seq}")
    Dt = D * block  # decode-segment token slots
    T, N = Dt + P, D + NP
    nd = len(decode)
    # sequence index of each packed sequence: decode i -> i, prefill j -> D + j
    seq_idx = np.concatenate([np.arange(nd), D + np.arange(len(prefill))]).astype(np.int32)
    cu = np.zeros(NP + 1, np.int32)
    cu[1: len(prefill) + 1] = np.cumsum(lens)
    cu[len(prefill) + 1:] = cu[len(prefill)]
    first_tok = np.concatenate([np.arange(nd) * block, Dt + cu[: len(prefill)]]).astype(np.int32)
    seq_len = np.array([len(s.tokens) for s in decode] + lens, np.int32)
    starts = np.array([s.start for s in seqs], np.int32)

    tokens = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    token_seq = np.zeros(T, np.int32)
    for i, s in enumerate(decode):
        tokens[i * block: i * block + len(s.tokens)] = s.tokens
    if prefill:
        tokens[Dt: Dt + cu[len(prefill)]] = [t for s in prefill for t in s.tokens]
    owner = np.repeat(np.arange(len(seqs)), seq_len)  # packed sequence of each real token
    tok_idx = np.repeat(first_tok, seq_len) + (np.arange(len(owner)) - np.repeat(np.cumsum(seq_len) - seq_len, seq_len))
    positions[tok_idx] = np.repeat(starts, seq_len) + tok_idx - np.repeat(first_tok, seq_len)
    token_seq[tok_idx] = seq_idx[owner]

    embeds = None
    with_media = [(i, s) for i, s in enumerate(seqs) if s.embeds is not None]
    if with_media:
        e0 = with_media[0][1].embeds
        embeds = np.zeros((T, e0.shape[1]), e0.dtype)
        for i, s in with_media:
            if s.embeds.shape != (len(s.tokens), e0.shape[1]):
                raise ValueError(f"a sequence's embeds are {s.embeds.shape}, its tokens {len(s.tokens)}")
            embeds[first_tok[i]: first_tok[i] + len(s.tokens)] = s.embeds

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

    nrow = 0
    if block > 1:  # every decode token slot, then each prefill sequence's last token
        R = Dt + NP
        logit_idx = np.zeros(R, np.int32)
        logit_idx[:Dt] = np.arange(Dt)
        logit_idx[Dt: Dt + len(prefill)] = Dt + cu[1: len(prefill) + 1] - 1
        rows_out = [list(range(i * block, i * block + len(s.tokens))) for i, s in enumerate(decode)]
        rows_out += [[Dt + j] for j in range(len(prefill))]
        seqs = []
    else:
        R = N if R is None else R
        logit_idx = np.zeros(R, np.int32)
        rows_out = []
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
        embeds=embeds,
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
    min_p: jax.Array  # f32[N] (0: off)
    logprobs: jax.Array  # i32[N] alternatives wanted (-1: off; any row >= 0 computes `token_logprobs` for all)
    # penalties: the row of the runner's penalty counts each logit row reads and counts its sample in (0: none)
    pen_row: jax.Array  # i32[N]
    repetition: jax.Array  # f32[N] (1: off)
    presence: jax.Array  # f32[N] (0: off)
    frequency: jax.Array  # f32[N] (0: off)

    @classmethod
    def neutral(cls, n: int) -> "SamplingBatch":
        """n greedy rows with every filter, penalty and logprobs off (padding-only steps: warm-up, lowering)."""
        zf = np.zeros(n, np.float32)
        return cls(temperature=zf, top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
                   keys=np.zeros((n, 2), np.uint32), min_p=zf, logprobs=np.full(n, -1, np.int32),
                   pen_row=np.zeros(n, np.int32), repetition=np.ones(n, np.float32), presence=zf, frequency=zf)


def _engine_step(params, state, batch: StepBatch, ops: StateOps, prev_tokens, cfg, impl, shard=None):
    """Restore checkpoints -> resolve placeholders -> forward -> snapshot, all on device: (logits f32[R, X], state).
    With a mesh (`shard`, see `sharding.step.ShardedStep`) the slot copies act on whole slots, so they are local to
    every shard whatever the conv-state channel grouping; the logits are replicated. `sample_step` follows it.
    No device-side branch (`lax.cond`, a while loop of unknown trip count): on a GPU XLA runs one by copying the
    predicate to the host and blocking the dispatching thread until the stream drains, so the host could not build
    step N+1 while the device runs step N."""
    tokens = jnp.where(batch.tokens < 0, prev_tokens[jnp.maximum(-batch.tokens - 1, 0)], batch.tokens)
    batch = dataclasses.replace(batch, tokens=tokens)
    state = restore_checkpoints(state, ops, batch.seq_slot)
    logits, state = forward(params, state, batch, cfg, impl, shard)
    state = snapshot_slots(state, ops, batch.seq_slot)
    return logits, state


engine_step = jax.jit(_engine_step, static_argnames=("cfg", "impl"), donate_argnames=("state",))


def _sample_step(logits, samp: SamplingBatch, pen, bias, n_tokens: int, hot: bool, logprobs: bool):
    """The step's tail: penalties and logit bias -> sample -> count the samples into `pen` (i32[P, X], the penalty
    counts of the requests with penalties or a bias, one row each: `sampling.apply_penalties`; bias f32[P, X] their
    bias rows). Returns (sampled tokens padded to
    n_tokens, `token_logprobs` of the raw logits by logit row or None, pen). `hot` / `logprobs` (static, decided
    on the host: `sampling.is_hot`, any row asking for logprobs) choose the variant, small programs compiled
    apart from the forward, instead of device-side branches."""
    scored = penalized(logits, pen, samp.pen_row, samp.repetition, samp.presence, samp.frequency, bias)
    toks = sample(scored, samp.temperature, samp.top_k, samp.top_p, samp.keys, samp.min_p, hot=hot)
    lp = token_logprobs(logits, toks) if logprobs else None
    pen = count_sampled(pen, samp.pen_row, toks)
    return jnp.zeros((n_tokens,), jnp.int32).at[: toks.shape[0]].set(toks), lp, pen


sample_step = jax.jit(_sample_step, static_argnames=("n_tokens", "hot", "logprobs"), donate_argnames=("pen",))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _set_logit_rows(pen, bias, row, counts, bias_row):
    return pen.at[row].set(counts), bias.at[row].set(bias_row)

MOVE_BUCKETS = (8, 64, 512, 4096)  # compaction copies per step are padded to these (one compile each)


@functools.partial(jax.jit, donate_argnames=("state",))
def _copy_blocks(state, src, dst):
    return state.copy_blocks(src, dst)


@functools.partial(jax.jit, donate_argnames=("state",))
def _move_pages(state, src, dst):
    return state.move_pages(src, dst)


def _padded_pairs(pairs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) arrays padded with (0, 0): the sink block/page copied onto itself is a no-op."""
    n = Buckets.pick(MOVE_BUCKETS, len(pairs), "compaction moves") if len(pairs) <= MOVE_BUCKETS[-1] else len(pairs)
    src, dst = np.zeros(n, np.int32), np.zeros(n, np.int32)
    if pairs:
        src[: len(pairs)], dst[: len(pairs)] = zip(*pairs)
    return src, dst


@dataclasses.dataclass
class InFlight:
    plan: "StepPlan"
    tokens: jax.Array  # i32[N_max] on device (speculative: i32[N, block + 1], count then tokens)
    order: np.ndarray | None = None  # speculative: the output row of each plan row
    logprobs: tuple | None = None  # `token_logprobs` on device (plain steps), fetched only if a request wants them

    def host(self) -> np.ndarray:
        out = np.asarray(self.tokens)
        return out if self.order is None else out[self.order]

    def host_logprobs(self) -> tuple | None:
        """`token_logprobs`' arrays on the host (one transfer, cached), by logit row; None for a speculative step."""
        if self.logprobs is not None and not isinstance(self.logprobs[0], np.ndarray):
            self.logprobs = tuple(np.asarray(a) for a in self.logprobs)
        return self.logprobs


class ModelRunner:
    """Owns the parameters and the donated device state; turns a `StepPlan` into one step."""

    on_launch = None  # hook(packed, ops, samp) before each scheduled step (sharding.lockstep checks lockstep)

    def __init__(self, model, *, slots: int, pages: int, page_size: int, buckets: Buckets, impl: str = "xla",
                 mesh=None, ids=None, memory=None, spec_block: int = 1):
        """`ids`: the scheduler's (slot pool, page pool); with unified memory (`memory`, a
        `k3jax.cache.unified.UnifiedMemory`) they hand out virtual ids that `launch` maps to physical
        block/page positions, after applying the compaction moves queued since the last step."""
        if memory is not None and mesh is not None:
            raise NotImplementedError("unified memory with a mesh is not supported yet")
        self.spec_block = spec_block  # > 1: every step is a verify step with blocks of this many tokens
        self.model = model
        self.ids, self.memory = ids, memory
        self.cfg = model.config
        self.buckets = buckets
        self.impl = impl
        self.n_max = buckets.decode[-1] + buckets.max_prefill_seqs
        self.sharded = None  # with a mesh: the engine step under jit with explicit shardings
        if mesh is None:
            self.params = model.params
            if memory is not None:
                self.state = init_unified_state(self.cfg, memory.total, page_size)
            else:
                self.state = init_state(self.cfg, slots, pages, page_size)
            self.prev = jnp.zeros((self.n_max,), jnp.int32)
            self.pen = jnp.zeros((buckets.decode[-1] + 1, self.cfg.vocab_size), jnp.int32)
            self.bias = jnp.zeros((buckets.decode[-1] + 1, self.cfg.vocab_size), jnp.float32)
        else:
            from sharding.step import make_sharded_step

            if spec_block > 1:
                from k3jax.spec.step import mesh_step_fn

                fn = mesh_step_fn(spec_block)
            else:
                fn = _engine_step
            self.sharded = make_sharded_step(self.cfg, mesh, impl=impl, fn=fn, split=is_split(model.params))
            self.params = self.sharded.shard_params(model.params)  # no copy when already laid out so
            self.state = self.sharded.init_state(slots, pages, page_size)
            self.prev = self.sharded.replicate(np.zeros((self.n_max,), np.int32))
            self.pen = self.sharded.replicate(np.zeros((buckets.decode[-1] + 1, self.cfg.vocab_size), np.int32))
            self.bias = self.sharded.replicate(np.zeros((buckets.decode[-1] + 1, self.cfg.vocab_size), np.float32))
        # penalty counts and logit bias: row r > 0 belongs to the running request the scheduler gave it
        # (`Request.pen_row`, one per running request with penalties or a logit bias: max_running rows), row 0 to
        # none (its entries stay 0)

    def _shape(self, n_decode: int, n_prefill_tokens: int) -> tuple[int, int, int]:
        if self.buckets.single:
            P = self.buckets.tokens[-1] if n_prefill_tokens else 0
            return self.buckets.decode[-1], P, self.buckets.max_prefill_seqs if P else 0
        D = self.buckets.pick(self.buckets.decode, n_decode, "decode batch") if n_decode else 0
        P = self.buckets.pick(self.buckets.tokens, n_prefill_tokens, "prefill tokens") if n_prefill_tokens else 0
        return D, P, self.buckets.max_prefill_seqs if P else 0

    def _run(self, packed: PackedStep, ops: StateOps, samp: SamplingBatch, snap_at=None):
        """-> (the step's sampled tokens, `token_logprobs` by logit row, or None for a speculative step)."""
        if self.spec_block > 1 and self.sharded is not None:
            out, self.state = self.sharded(self.params, self.state, packed.batch, ops, snap_at, samp)
            return out, None
        if self.spec_block > 1:
            from k3jax.spec.step import spec_step

            out, self.state = spec_step(self.params, self.state, packed.batch, ops, snap_at, samp, self.cfg,
                                        self.impl, self.spec_block)
            return out, None
        if self.sharded is not None:
            logits, self.state = self.sharded(self.params, self.state, packed.batch, ops, self.prev)
        else:
            logits, self.state = engine_step(self.params, self.state, packed.batch, ops, self.prev, self.cfg, self.impl)
        tokens, lp = self._sample(logits, samp, is_hot(samp.temperature), bool((samp.logprobs >= 0).any()))
        self.prev = tokens
        return tokens, lp

    def _sample(self, logits, samp: SamplingBatch, hot: bool, logprobs: bool):
        if self.sharded is not None:
            samp = self.sharded.replicate(samp)
        tokens, lp, self.pen = sample_step(logits, samp, self.pen, self.bias, n_tokens=self.n_max, hot=hot,
                                           logprobs=logprobs)
        return tokens, lp

    def _apply_moves(self) -> None:
        """Queue the compaction copies on the stream before the step that reads the moved blocks
        (all sources gathered before any destination is written; no host sync)."""
        moves = self.memory.take_moves()
        if moves["slot"]:
            self.state = _copy_blocks(self.state, *_padded_pairs(moves["slot"]))
        if moves["page"]:
            self.state = _move_pages(self.state, *_padded_pairs(moves["page"]))

    def launch(self, plan: "StepPlan") -> InFlight:
        seqs = plan.decode + plan.prefill
        D, P, NP = self._shape(len(plan.decode), sum(len(s.tokens) for s in plan.prefill))
        if self.memory is not None:
            self._apply_moves()
            slot_p, page_p = self.ids[0].physical, self.ids[1].physical
            phys_slot = lambda v: slot_p([v])[0] if v else 0
            work = lambda s: SeqWork(s.tokens, s.start, phys_slot(s.req.slot), page_p(s.req.pages),
                                     embeds=s.req.media_embeds(s.start, len(s.tokens)))
        else:
            phys_slot = lambda v: v
            work = lambda s: SeqWork(s.tokens, s.start, s.req.slot, s.req.pages,
                                     embeds=s.req.media_embeds(s.start, len(s.tokens)))
        packed = pack_step([work(s) for s in plan.decode], [work(s) for s in plan.prefill], D=D, P=P, NP=NP,
                           pages_per_seq=self.buckets.pages_per_seq, block=self.spec_block)
        N = D + NP
        B = self.spec_block
        restore, snap = np.zeros(N, np.int32), np.zeros(N, np.int32)  # per sequence (decode i, prefill D + j)
        R = D * B + NP if B > 1 else N
        temp, top_p, min_p = np.zeros(R, np.float32), np.ones(R, np.float32), np.zeros(R, np.float32)  # per logit row
        logprobs = np.full(R, -1, np.int32)
        top_k, keys = np.zeros(R, np.int32), np.zeros((R, 2), np.uint32)
        pen_row, repetition = np.zeros(R, np.int32), np.ones(R, np.float32)
        presence, frequency = np.zeros(R, np.float32), np.zeros(R, np.float32)
        for req in plan.pen_init:  # requests admitted by this plan with penalties or a bias: their rows
            rows = (np.int32(req.pen_row), penalty_counts(req.prompt, req.output, self.cfg.vocab_size),
                    bias_row(req.sampling.logit_bias, self.cfg.vocab_size))
            self.pen, self.bias = _set_logit_rows(self.pen, self.bias,
                                                  *(rows if self.sharded is None else self.sharded.replicate(rows)))
        rows, seeds, positions = [], [], []
        for i, s in enumerate(seqs):
            seq = i if i < len(plan.decode) else D + (i - len(plan.decode))
            restore[seq], snap[seq] = phys_slot(s.restore_src), phys_slot(s.snap_dst)
            if B == 1:
                r = [i]
            else:  # a verify block samples at each of its token slots: the request's next B tokens
                r = list(range(seq * B, seq * B + B)) if seq < D else [D * B + seq - D]
            rows += r
            seeds += [s.req.seed] * len(r)
            positions += range(s.req.scheduled_samples, s.req.scheduled_samples + len(r))
            sp = s.req.sampling
            temp[r], top_k[r], top_p[r], min_p[r] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
            logprobs[r] = -1 if sp.logprobs is None else sp.logprobs
            if s.req.pen_row and s.sample and B == 1:  # (a verify block never carries penalties: the engine refuses)
                pen_row[r], repetition[r] = s.req.pen_row, sp.repetition_penalty
                presence[r], frequency[r] = sp.presence_penalty, sp.frequency_penalty
        if rows:
            keys[rows] = request_keys(seeds, positions)
        samp = SamplingBatch(temperature=temp, top_k=top_k, top_p=top_p, keys=keys, min_p=min_p, logprobs=logprobs,
                             pen_row=pen_row, repetition=repetition, presence=presence, frequency=frequency)
        ops = StateOps(restore_src=restore, snap_dst=snap)
        if self.on_launch is not None:  # multi-process lockstep: every process must launch the same inputs
            self.on_launch(packed, ops, samp)
        if B == 1:
            tokens, lp = self._run(packed, ops, samp)
            return InFlight(plan=plan, tokens=tokens, logprobs=lp)
        snap_at = np.zeros(D, np.int32)
        snap_at[: len(plan.decode)] = [s.snap_at for s in plan.decode]
        order = np.array(list(range(len(plan.decode))) + [D + j for j in range(len(plan.prefill))], np.int64)
        return InFlight(plan=plan, tokens=self._run(packed, ops, samp, snap_at)[0], order=order)

    def warmup(self, progress=None) -> int:
        """Compile every bucket with padding-only steps (they only touch the sinks); for a vision model each
        prefill bucket also with image rows (`StepBatch.embeds`: another program)."""
        shapes = self.buckets.shapes()
        for D, P in shapes:
            NP = self.buckets.max_prefill_seqs if P else 0
            packed = pack_step([], [], D=D, P=P, NP=NP, pages_per_seq=self.buckets.pages_per_seq,
                               block=self.spec_block)
            N, R = D + NP, packed.batch.logit_idx.shape[0]
            z = np.zeros(N, np.int32)
            out = self._run(packed, StateOps(z, z), SamplingBatch.neutral(R), np.zeros(D, np.int32))
            if P and self.cfg.vision is not None:
                T = packed.batch.tokens.shape[0]
                packed.batch.embeds = np.zeros((T, self.cfg.hidden_size), jnp.dtype(self.cfg.dtype))
                out = self._run(packed, StateOps(z, z), SamplingBatch.neutral(R), np.zeros(D, np.int32))
            if self.spec_block == 1:  # the tail's other variants (sampled rows, logprobs): small programs
                logits = np.zeros((R, self.cfg.vocab_size), np.float32)
                logits = jnp.asarray(logits) if self.sharded is None else self.sharded.replicate(logits)
                for hot, lp in ((True, False), (False, True), (True, True)):
                    out = self._sample(logits, SamplingBatch.neutral(R), hot, lp)
            if progress is not None:
                progress.update()
        jax.block_until_ready((self.prev, out))
        return len(shapes)
