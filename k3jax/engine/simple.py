"""A minimal single-request generation loop (the CLI's engine until the batched engine lands).

One request owns slot 1 and pages 1..n of a private state; the prompt is prefilled in chunks, then
one token is decoded per step. Shapes are fixed per request (one prefill bucket, one decode
bucket, one page-table width), so each step kind compiles once.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Sequence

import jax
import numpy as np

from k3jax.engine.runner import SeqWork, pack_step
from k3jax.sampling import (SamplingParams, apply_penalties, bias_row, is_hot, penalty_counts, request_key, resolve_seed,
                            sample)
from k3jax.tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)

SLOT = 1  # slot 0 is the padding sink
_penalize = jax.jit(apply_penalties)


def generate_stream(model, prompt_ids: Sequence[int], sampling: SamplingParams, *, page_size: int = 16,
                    prefill_chunk: int = 256, warmup: bool = False, stats: dict | None = None,
                    max_seq_len: int | None = None) -> Iterator[int]:
    """Yield the generated token ids of one request as they are sampled.

    Stops after `max_new_tokens` tokens, after EOS (yielded; not with `ignore_eos`), after a stop token
    id or the token that completes a stop string (yielded), or at the model's context limit.
    `warmup=True` first runs padding-only steps (they touch only the sinks) so compilation happens
    before the prompt is processed. `stats`, if
    given, receives `warmup_s`, `prompt_tokens`, `generated_tokens` and `finish_reason`.
    `max_seq_len` fixes every shape (page table width, prefill bucket) so that many requests of
    different lengths share two compiled steps.
    """
    cfg = model.config
    sampling.validate(cfg.vocab_size)
    if sampling.logprobs is not None:
        raise ValueError("logprobs: the single-request loop returns tokens only; use k3jax.LLM")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty")
    if min(prompt) < 0 or max(prompt) >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size})")
    if page_size < 1 or prefill_chunk < 1:
        raise ValueError("page_size and prefill_chunk must be positive")
    limit = cfg.max_position_embeddings
    if len(prompt) >= limit:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context holds {limit} "
                         f"(prompt plus at least one generated token)")
    max_new = min(sampling.max_new_tokens, limit - len(prompt))
    if max_seq_len is not None:
        if len(prompt) + max_new > max_seq_len:
            raise ValueError(f"prompt + max_new_tokens ({len(prompt) + max_new}) exceeds max_seq_len {max_seq_len}")
        pages_per_seq = -(-max_seq_len // page_size)
        P = -(-prefill_chunk // 64) * 64
    else:
        pages_per_seq = -(-(len(prompt) + max_new) // page_size)
        P = -(-min(prefill_chunk, len(prompt)) // 64) * 64
    chunk = min(prefill_chunk, P)
    stats = {} if stats is None else stats
    stats.update(prompt_tokens=len(prompt), generated_tokens=0, warmup_s=0.0, finish_reason=None)

    state = model.init_state(slots=2, pages=pages_per_seq + 1, page_size=page_size)  # sharded on model.mesh
    fwd = model.step_fn()
    temperature = np.array([sampling.temperature], np.float32)
    top_k = np.array([sampling.top_k], np.int32)
    top_p = np.array([sampling.top_p], np.float32)
    min_p = np.array([sampling.min_p], np.float32)
    hot = is_hot(temperature)
    seed = resolve_seed(sampling.seed)
    # penalties: the request's counts kept on the host (this loop knows every token before the next step)
    counts = penalty_counts(prompt, [], cfg.vocab_size)[None] if sampling.has_penalties else None
    bias = bias_row(sampling.logit_bias, cfg.vocab_size)[None] if sampling.logit_bias else None
    pen = [np.array([x], np.float32) for x in (sampling.repetition_penalty, sampling.presence_penalty,
                                                sampling.frequency_penalty)]

    def run(decode, prefill, D, P_, NP):
        nonlocal state
        packed = pack_step(decode, prefill, D=D, P=P_, NP=NP, pages_per_seq=pages_per_seq)
        logits, state = fwd(model.params, state, packed.batch)
        return logits

    if warmup:
        t0 = time.perf_counter()
        log.info("compiling prefill (%d tokens) and decode steps", P)
        for logits in (run([], [], 0, P, 1), run([], [], 1, 0, 0)):  # padding only: sinks absorb the writes
            np.asarray(sample(logits, temperature, top_k, top_p, request_key(0, 0)[None], min_p, hot=hot))
        stats["warmup_s"] = time.perf_counter() - t0
        log.info("compiled in %.2f s", stats["warmup_s"])

    def pages(end: int) -> list[int]:
        return list(range(1, 1 + -(-end // page_size)))

    for s in range(0, len(prompt), chunk):
        toks = prompt[s : s + chunk]
        logits = run([], [SeqWork(tokens=toks, start=s, slot=SLOT, pages=pages(s + len(toks)))], 0, P, 1)

    stops = sampling.stop_strings
    longest_stop = max((len(x) for x in stops), default=0)
    detok = IncrementalDecoder(model.tokenizer) if stops and model.tokenizer is not None else None
    text = ""
    pos = len(prompt)
    for n in range(max_new):
        if counts is not None:
            logits = _penalize(logits, counts, *pen)
        if bias is not None:
            logits = logits + bias
        tok = int(np.asarray(sample(logits, temperature, top_k, top_p, request_key(seed, n)[None], min_p, hot=hot))[0])
        if counts is not None:
            counts[0, tok] += 1
        stats["generated_tokens"] = n + 1
        yield tok
        reason = sampling.token_stop(tok, cfg.eos_token_id)
        if reason is not None:
            stats["finish_reason"] = reason
            return
        if detok is not None:
            new = detok.push(tok)
            text = text[-(longest_stop - 1):] if longest_stop > 1 else ""
            text += new
            if new and any(x in text for x in stops):
                stats["finish_reason"] = "stop"
                return
        if n + 1 == max_new:
            break
        logits = run([SeqWork(tokens=[tok], start=pos, slot=SLOT, pages=pages(pos + 1))], [], 1, 0, 0)
        pos += 1
    stats["finish_reason"] = "length"
