"""Sampling: per-request `SamplingParams` and one jitted batched sampler.

`sample(logits, temperature, top_k, top_p, keys, min_p, hot=)` draws one token per row with fixed shapes,
so it compiles once per row count R and `hot` (a host-side choice: no device branch, see `sample`). Rows with
temperature 0 take the argmax of the raw logits (exact greedy); other rows sample softmax(logits / T)
restricted to the top-k tokens (k = 0: off), to the top-p nucleus (the smallest set of most likely tokens
whose probability reaches top_p) and to the tokens whose probability is at least min_p times the top token's
(0: off); the top token is always kept. The three filters commute: min_p compares probabilities with the top
one, a ratio no renormalisation changes.

Penalties (`apply_penalties`: repetition over the prompt and output tokens, presence and frequency over the
output tokens, vLLM's definitions) and then the logit bias change the logits before all of that, greedy rows
included; the engine keeps each such request's token counts and bias row on the device (`penalized`,
`count_sampled`, `penalty_counts`, `bias_row`).

Randomness is per request and reproducible: the key of a request's n-th generated token is
`request_key(seed, n)`, a pure function of (seed, n), so a seeded request gets the same tokens
whatever else shares its batch. A request without a seed draws one once (`resolve_seed`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import secrets
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_MASK64 = (1 << 64) - 1
_MIN_TEMPERATURE = 1e-6  # below this, logits / T could overflow; such rows are greedy in effect
MAX_LOGPROBS = 20  # most alternatives a request may ask logprobs for (the step computes this many per row)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (as vLLM's and OpenAI's)
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)
PROMPT_BIT = 1 << 30  # penalty counts: bit 30 marks a prompt token, the low bits count the token in the output


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1: off
    top_k: int = 0  # keep the k most likely tokens; 0: off
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the top token; 0: off
    seed: int | None = None  # None: a random seed per request
    stop: str | list[str] | None = None  # stop after the token that completes any of these strings
    stop_token_ids: list[int] | None = None  # stop after any of these tokens (finish_reason "stop"; kept in the output)
    ignore_eos: bool = False  # generate past the model's EOS token (fixed output lengths, as benchmarks want)
    # None: off; N in [0, MAX_LOGPROBS]: each generated token's log-probability under the model (the raw
    # logits' log-softmax, before temperature and filters) plus the N most likely tokens' (RequestOutput.logprobs)
    logprobs: int | None = None
    # penalties on the raw logits before temperature and the filters (vLLM's and SGLang's definitions):
    # repetition divides a positive logit (multiplies a negative one) of every token in the prompt or the output
    # so far by this (1: off); presence subtracts this from the logit of every token in the output so far;
    # frequency subtracts this times the token's count in the output so far (0: off)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # {token id: bias} added to those tokens' logits after the penalties, before temperature and the filters (greedy
    # too; OpenAI's and vLLM's logit_bias): -100 all but bans a token, +100 all but forces it; None: off
    logit_bias: dict[int, float] | None = None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_logit_row(self) -> bool:
        """Whether the request holds a row of the engine's per-request logit state (penalty counts, logit bias)."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise ValueError naming the offending field; return self when every field is valid."""

        def is_int(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_real(v):
            return isinstance(v, numbers.Real) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):  # NaN fails the comparison
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise ValueError(f"top_k={self.top_k} exceeds the vocabulary size {vocab_size}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= _MASK64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        stop = self.stop
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise ValueError(f"stop must be None, a string or a list of strings, got {stop!r}")
        if any(s == "" for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(is_int(t) for t in ids)):
            raise ValueError(f"stop_token_ids must be None or a list of integer token ids, got {ids!r}")
        bad = sorted({int(t) for t in ids or () if t < 0 or (vocab_size is not None and t >= vocab_size)})
        if bad:
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"stop_token_ids: unknown token ids {bad[:5]} (ids lie in {bound})")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not is_real(self.repetition_penalty) or not (0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got "
                             f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_real(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 disables it), got {v!r}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be None or a dict {{token id: bias}}, got {type(bias).__name__}")
            bad = sorted({k for k in bias if not is_int(k) or k < 0 or (vocab_size is not None and k >= vocab_size)},
                         key=repr)
            if bad:
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"logit_bias: unknown token ids {bad[:5]} (ids lie in {bound})")
            for k, v in bias.items():
                if not is_real(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:  # NaN fails too
                    raise ValueError(f"logit_bias[{k}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {v!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        return self

    def token_stop(self, token: int, eos_token_id: int | None) -> str | None:
        """Whether emitting `token` ends the request, by the token alone: "eos" (the model's EOS, unless
        `ignore_eos`), "stop" (one of `stop_token_ids`), else None. Stop strings (they need the detokenized text)
        and `max_new_tokens` are the caller's, checked after this."""
        if eos_token_id is not None and token == eos_token_id and not self.ignore_eos:
            return "eos"
        if self.stop_token_ids and token in self.stop_token_ids:
            return "stop"
        return None


def resolve_seed(seed: int | None) -> int:
    """The request's seed: `seed` itself, or a fresh random 63-bit seed (draw it once per request)."""
    return int(seed) if seed is not None else secrets.randbits(63)


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit mix."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_key(seed: int, position: int) -> np.ndarray:
    """Raw threefry key data u32[2] for a request's `position`-th generated token (host-side, no jax)."""
    h = _mix64((_mix64(int(seed) & _MASK64) + (int(position) + 1) * 0x9E3779B97F4A7C15) & _MASK64)
    return np.array([h >> 32, h & 0xFFFFFFFF], dtype=np.uint32)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def request_keys(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """u32[R, 2]: `request_key` for each row (vectorised; uint64 arithmetic wraps like the & mask)."""
    s = np.array([int(x) & _MASK64 for x in seeds], np.uint64)
    p = np.asarray(positions, np.uint64)
    with np.errstate(over="ignore"):
        h = _mix64_np(_mix64_np(s) + (p + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))
    return np.stack([h >> np.uint64(32), h & np.uint64(0xFFFFFFFF)], axis=-1).astype(np.uint32).reshape(-1, 2)


def _min_p(min_p, rows):
    return jnp.zeros((rows,), jnp.float32) if min_p is None else jnp.asarray(min_p, jnp.float32)


def _filtered_sorted(logits, temperature, top_k, top_p, min_p=None):
    """The sampling distribution's support in sorted order: (order [R, X] most likely first, ties by
    token id; scaled logits in that order with the tokens outside top-k / top-p / min-p at -inf)."""
    X = logits.shape[-1]
    t = jnp.maximum(temperature, _MIN_TEMPERATURE)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    srt = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(X, dtype=jnp.int32)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, X), X).astype(jnp.int32)
    keep = rank < k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, srt, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    p = top_p.astype(jnp.float32)[:, None]
    keep &= (mass_before < p) | (p >= 1.0)
    # p / p_top >= min_p in log space (log 0 = -inf keeps every token)
    keep &= srt >= srt[:, :1] + jnp.log(_min_p(min_p, logits.shape[0]))[:, None]
    keep |= rank == 0
    return order, jnp.where(keep, srt, -jnp.inf)


def _typed_keys(keys):
    if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys.astype(jnp.uint32), impl="threefry2x32")
    return keys


@functools.partial(jax.jit, static_argnames=("hot",))
def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, keys: jax.Array,
           min_p: jax.Array | None = None, *, hot: bool = True) -> jax.Array:
    """logits f32[R, X], temperature f32[R], top_k i32[R], top_p f32[R], keys (u32[R, 2] raw
    threefry key data or typed keys [R]), min_p f32[R] (None: off) -> token ids i32[R].

    `hot` (static): some row may have temperature > 0. The caller decides it on the host (`is_hot`), so the step
    has no device-side branch: XLA's GPU conditional copies its predicate to the host and blocks the dispatching
    thread until the stream drains, which would serialise the engine's overlap. hot=False: every row is greedy
    (the argmax, no sort); hot=True: greedy rows still get exactly the argmax."""
    logits = logits.astype(jnp.float32)
    temperature = temperature.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not hot:
        return greedy
    order, masked = _filtered_sorted(logits, temperature, top_k, top_p, min_p)
    choice = jax.vmap(jax.random.categorical)(_typed_keys(keys), masked)
    tok = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, tok, greedy)


def is_hot(temperature) -> bool:
    """Host: whether any row samples (temperature > 0): `sample`'s static `hot`."""
    return bool((np.asarray(temperature) > 0).any())


def apply_penalties(logits: jax.Array, counts: jax.Array, repetition: jax.Array, presence: jax.Array,
                    frequency: jax.Array) -> jax.Array:
    """The penalised logits (vLLM's order: repetition over the prompt and output tokens, then frequency and
    presence over the output tokens): logits f32[R, X]; counts i32[R, X] per token `PROMPT_BIT` if it is in the
    prompt plus its count in the output so far; repetition / presence / frequency f32[R] (1 / 0 / 0: off, and
    such a row comes back bit for bit)."""
    out = counts & (PROMPT_BIT - 1)
    r = repetition.astype(jnp.float32)[:, None]
    logits = jnp.where(counts != 0, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency.astype(jnp.float32)[:, None] * out - presence.astype(jnp.float32)[:, None] * (out > 0)


def penalized(logits: jax.Array, counts: jax.Array, rows: jax.Array, repetition: jax.Array, presence: jax.Array,
              frequency: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """`apply_penalties` with each logit row's counts gathered from the engine's buffer counts i32[P, X] at
    rows i32[R], then the logit bias rows bias f32[P, X] (`bias_row`) added (row 0 is all zeros: a row without
    penalties or bias comes back bit for bit). Always computed (gathers and a few elementwise passes over [R, X]):
    no device-side branch (see `sample`)."""
    out = apply_penalties(logits, jnp.asarray(counts)[rows], repetition, presence, frequency)
    return out if bias is None else out + jnp.asarray(bias)[rows]


def bias_row(logit_bias: dict[int, float] | None, vocab_size: int) -> np.ndarray:
    """Host: one request's dense logit bias row f32[X] (zeros without `logit_bias`)."""
    row = np.zeros(vocab_size, np.float32)
    if logit_bias:
        row[np.fromiter(logit_bias.keys(), np.int64)] = np.fromiter(logit_bias.values(), np.float32)
    return row


def count_sampled(counts: jax.Array, rows: jax.Array, tokens: jax.Array) -> jax.Array:
    """counts i32[P, X] with each sampled token (tokens i32[R]) counted in its row (rows i32[R]; 0: not counted)."""
    return jnp.asarray(counts).at[rows, tokens].add((rows > 0).astype(jnp.int32))


def penalty_counts(prompt: Sequence[int], output: Sequence[int], vocab_size: int) -> np.ndarray:
    """Host: one request's row of penalty counts (i32[X]: `PROMPT_BIT` on its prompt tokens plus each token's
    count in `output`), the form `apply_penalties` reads. Media tokens of the prompt (keyed ids >= vocab_size,
    `k3jax.media`) are not vocabulary tokens and count nowhere."""
    row = np.bincount(np.asarray(output, np.int64), minlength=vocab_size).astype(np.int32)
    prompt = np.asarray(prompt, np.int64)
    row[prompt[prompt < vocab_size]] |= PROMPT_BIT
    return row


def token_logprobs(logits: jax.Array, tokens: jax.Array):
    """The model's log-probabilities (raw logits' log-softmax) of `tokens` and the MAX_LOGPROBS most likely tokens:
    logits f32[R, X], tokens i32[R] -> (token f32[R], top ids i32[R, MAX_LOGPROBS], top f32[R, MAX_LOGPROBS]), most
    likely first. (The engine computes it only in steps where a row asks: a static choice, see `sample`.)"""
    k = min(MAX_LOGPROBS, logits.shape[-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(logp, k)
    return jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0], ids.astype(jnp.int32), top


def logprob_entry(token: int, n: int, row: int, lp) -> dict[int, float]:
    """One generated token's `RequestOutput.logprobs` entry from `token_logprobs`' host arrays at `row`: the n most
    likely tokens and the sampled one, {token id: log-probability}."""
    tok_lp, ids, top = lp
    entry = {int(ids[row, j]): float(top[row, j]) for j in range(n)}
    entry[int(token)] = float(tok_lp[row])
    return entry


def target_logprobs(logits, temperature, top_k, top_p, min_p=None) -> jax.Array:
    """log of the distribution `sample` draws from, in vocabulary order (f32[R, X], -inf outside
    the top-k / top-p / min-p support)."""
    order, masked = _filtered_sorted(logits.astype(jnp.float32), temperature.astype(jnp.float32), top_k, top_p,
                                     min_p)
    return jax.nn.log_softmax(jnp.take_along_axis(masked, jnp.argsort(order, axis=-1), axis=-1), axis=-1)


def spec_accept(logits, block, n_draft, temperature, top_k, top_p, keys, min_p=None):
    """Lossless acceptance of draft blocks (speculative decoding with a deterministic drafter).

    logits f32[D, B, X] at the block's B tokens; block i32[D, B] (the last sampled token, then
    drafts); n_draft i32[D] real drafts per row (<= B-1); temperature / top_k / top_p / min_p [D]; keys
    u32[D, B, 2] (position j: the key of the request's j-th token of this step).
    Returns (n_emit i32[D] in [1, n_draft+1], tokens i32[D, B]: the first n_emit are the output).

    Greedy rows accept drafts while they equal the target's argmax, then emit the argmax: exactly
    the non-speculative tokens. Sampled rows accept draft d with probability p(d) (the drafter's
    proposal is a point mass, so min(1, p/q) = p(d)); at the first rejection they sample from the
    target with d removed and renormalised, and after a fully accepted block from the target itself:
    the output is distributed exactly as sampling the target token by token."""
    D, B, X = logits.shape
    logits = logits.astype(jnp.float32)
    drafts = block[:, 1:]
    valid = jnp.arange(B - 1)[None, :] < n_draft[:, None]
    count = lambda ok: jnp.sum(jnp.cumprod(ok & valid, axis=1), axis=1).astype(jnp.int32)
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [D, B]
    a_greedy = count(drafts == target[:, :-1])
    temperature = temperature.astype(jnp.float32)

    def sampled():
        rep = lambda a: jnp.repeat(a, B)
        logp = target_logprobs(logits.reshape(D * B, X), rep(temperature), rep(top_k), rep(top_p),
                               rep(_min_p(min_p, D))).reshape(D, B, X)
        k = _typed_keys(keys.reshape(D * B, 2))
        pair = jax.vmap(lambda kk: jax.random.split(kk, 2))(k)  # [D*B, 2]
        u = jax.vmap(jax.random.uniform)(pair[:, 0]).reshape(D, B)
        p_draft = jnp.exp(jnp.take_along_axis(logp[:, :-1], drafts[..., None], axis=-1)[..., 0])
        a = count(u[:, :-1] < p_draft)
        logp_a = jnp.take_along_axis(logp, a[:, None, None], axis=1)[:, 0]  # [D, X]
        d_next = jnp.take_along_axis(jnp.pad(drafts, ((0, 0), (0, 1)), constant_values=-1), a[:, None], axis=1)
        rejected = (a < n_draft)[:, None] & (jnp.arange(X)[None, :] == d_next)
        residual = jnp.where(rejected, -jnp.inf, logp_a)
        residual = jnp.where(jnp.all(residual == -jnp.inf, axis=-1, keepdims=True), logp_a, residual)
        key_a = jnp.take_along_axis(pair[:, 1].reshape(D, B), a[:, None], axis=1)[:, 0]
        bonus = jax.vmap(jax.random.categorical)(key_a, residual).astype(jnp.int32)
        j = jnp.arange(B)[None, :]
        toks = jnp.where(j < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
        hot = temperature > 0
        return jnp.where(hot, a, a_greedy), jnp.where(hot[:, None], toks, target)

    a, toks = jax.lax.cond(jnp.all(temperature <= 0), lambda: (a_greedy, target), sampled)
    return a + 1, toks


def sample_batch(logits, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """Host helper: sample one token per row of `logits` for requests with these params/seeds."""
    temperature = np.array([p.temperature for p in params], np.float32)
    top_k = np.array([p.top_k for p in params], np.int32)
    top_p = np.array([p.top_p for p in params], np.float32)
    min_p = np.array([p.min_p for p in params], np.float32)
    return np.asarray(sample(logits, temperature, top_k, top_p, request_keys(seeds, positions), min_p,
                             hot=is_hot(temperature)))
