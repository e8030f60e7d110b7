"""Engine: greedy token identity across prefix cache / page size / overlap / batch composition,
Marconi branch points, tombstones, memory pressure (eviction, preemption, abort), streaming."""

import asyncio
import dataclasses
import itertools

import numpy as np
import pytest

from k3jax import LLM, Engine, SamplingParams
from k3jax.api import load_model
from k3jax.engine.simple import generate_stream

SP = SamplingParams(max_new_tokens=10)
ENGINE_KW = dict(max_running=4, max_seq_len=512, prefill_chunk=128, max_prefill_seqs=4, single_bucket=True)


@pytest.fixture(scope="module")
def model():
    return load_model("k3-tiny", seed=0)


def workload(seed=0):
    """Phase 1: a shared system prompt with questions that branch from each other mid-chunk and
    mid-page. Phase 2 (built from phase-1 outputs): multi-turn continuations and late siblings."""
    rng = np.random.default_rng(seed)
    r = lambda n: rng.integers(0, 256, n).tolist()
    system = r(150)
    shared_q = r(23)  # two questions share 23 tokens: they fork at 173 (mid-chunk, mid-page)
    phase1 = [system + shared_q + r(30), system + shared_q + r(45), system + r(70), r(40)]

    def phase2(outs):
        return [phase1[0] + outs[0] + r(12),  # the next turn of conversation 0
                phase1[2] + outs[2] + r(80),  # the next turn of conversation 2
                system + shared_q + r(9),  # a late sibling of the first two questions
                system[:101] + r(60)]  # forks inside the system prompt
    return phase1, phase2


def run_workload(llm, together=True):
    phase1, phase2 = workload()

    def gen(prompts):
        if together:
            return [o.token_ids for o in llm.generate(prompts, SP)]
        return [llm.generate([p], SP)[0].token_ids for p in prompts]

    out1 = gen(phase1)
    out2 = gen(phase2(out1))
    llm.check_invariants()
    return out1 + out2


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens from the single-request loop (no engine, no cache): the ground truth."""
    phase1, phase2 = workload()
    ref = lambda p: list(generate_stream(model, p, SP, prefill_chunk=128, max_seq_len=512))
    out1 = [ref(p) for p in phase1]
    out2 = [ref(p) for p in phase2(out1)]
    return out1 + out2


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_identity_across_engine_features(model, reference, page_size):
    """Greedy tokens independent of the prefix cache, overlap, page size and batch composition. Every cache x
    overlap pair runs the workload batched; one request at a time (three times the steps) runs with overlap on
    (the axis the batched runs already cover) and, at page size 1 (the path it changes: page-granular matching
    and KV writes), only with the cache on."""
    combos = [(c, o, True) for c, o in itertools.product([True, False], [True, False])]
    combos += [(True, True, False)] + ([(False, True, False)] if page_size == 16 else [])
    for prefix_cache, overlap, together in combos:
        llm = LLM(model, page_size=page_size, prefix_cache=prefix_cache, overlap=overlap, **ENGINE_KW)
        got = run_workload(llm, together)
        assert got == reference, f"prefix_cache={prefix_cache} overlap={overlap} together={together}"
        if prefix_cache:
            assert llm.stats["restored_tokens"] > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_step_timing(model, overlap):
    """`LLM.stats`' step timing: every launched step is counted (with overlap, plus the last collect), its host
    and device-wait seconds are positive and add up to at most the wall time of the calls."""
    import time

    llm = LLM(model, page_size=16, overlap=overlap, **ENGINE_KW)
    t0 = time.perf_counter()
    llm.generate(workload()[0], SP)
    wall = time.perf_counter() - t0
    st = llm.stats
    assert st["steps"] == llm.core.step_count + (1 if overlap else 0)
    assert st["step_host_s"] > 0 and st["step_wait_s"] > 0 and st["step_host_s"] + st["step_wait_s"] <= wall


def test_explicit_buckets(model, reference):
    """`decode_buckets` / `prefill_buckets` (as SGLang's --cuda-graph-bs): only those step shapes exist, steps pad to
    them, and the tokens are the greedy reference; bad lists are refused by name."""
    kw = ENGINE_KW | dict(single_bucket=False)
    llm = LLM(model, page_size=16, decode_buckets=(4,), prefill_buckets=(128,), **kw)
    assert llm.core.buckets.shapes() == [(4, 0), (0, 128), (4, 128)]
    phase1, _ = workload()
    assert [o.token_ids for o in llm.generate(phase1, SP)] == reference[: len(phase1)]
    llm.check_invariants()
    for bad, msg in ((dict(decode_buckets=(2, 8)), "end with max_running"), (dict(decode_buckets=(4, 2)), "increasing"),
                     (dict(prefill_buckets=(100, 128)), "multiple of 64"), (dict(decode_buckets=[4]), "tuple"),
                     (dict(decode_buckets=(4,), single_bucket=True), "exclude each other")):
        with pytest.raises(ValueError, match=msg):
            LLM(model, **(kw | bad))


def test_logprobs(model):
    """SamplingParams.logprobs: per generated token the model's log-probability (raw logits' log-softmax; checked
    against `Model.logits` of the whole sequence) of the sampled token and of the N most likely, in outputs and
    stream deltas; sampled rows (temperature 50) include tokens outside the top N; requests without it get None;
    the speculative engine and the single-request loop refuse it by name."""
    import jax

    phase1, _ = workload()
    llm = LLM(model, page_size=16, **ENGINE_KW)
    sps = [SamplingParams(max_new_tokens=6, logprobs=2), SamplingParams(max_new_tokens=6, temperature=50.0, seed=1,
                                                                       logprobs=2), SamplingParams(max_new_tokens=6)]
    outs = [llm.generate([p], sp)[0] for p, sp in zip(phase1, sps)]
    assert outs[2].logprobs is None
    outside = 0
    for p, sp, o in zip(phase1, sps, outs[:2]):
        ref = np.asarray(jax.nn.log_softmax(model.logits(p + o.token_ids), axis=-1))[len(p) - 1:-1]
        assert len(o.logprobs) == len(o.token_ids) == 6
        for row, t, entry in zip(ref, o.token_ids, o.logprobs):
            top = np.argsort(-row)[: sp.logprobs]
            assert set(entry) == {t, *top.tolist()}
            np.testing.assert_allclose([entry[k] for k in entry], [row[k] for k in entry], atol=2e-4)
            outside += t not in top.tolist()
    assert outside > 0  # sampled tokens outside the top 2 (temperature 50) carry their own logprob too
    deltas = list(llm.stream(phase1[0], sps[0]))
    assert [e for d in deltas for e in d.logprobs] == outs[0].logprobs
    with pytest.raises(ValueError, match="logprobs: not supported with speculative"):
        LLM(model, page_size=16, speculative="ngram", **ENGINE_KW).generate([[1, 2]], sps[0])
    with pytest.raises(ValueError, match="logprobs: the single-request loop"):
        next(generate_stream(model, [1, 2], sps[0]))
    llm.check_invariants()


def test_min_p_reaches_the_step(model, reference):
    """min_p 1 keeps only the top token, so sampling at temperature 50 (near uniform over the vocabulary) gives
    the greedy tokens; without min_p the same seeds give others."""
    phase1, _ = workload()
    llm = LLM(model, page_size=16, **ENGINE_KW)
    hot = dict(max_new_tokens=SP.max_new_tokens, temperature=50.0, seed=3)
    got = [o.token_ids for o in llm.generate(phase1, SamplingParams(min_p=1.0, **hot))]
    assert got == reference[: len(phase1)]
    assert [o.token_ids for o in llm.generate(phase1, SamplingParams(**hot))] != got
    assert list(generate_stream(model, phase1[3], SamplingParams(min_p=1.0, **hot), prefill_chunk=128,
                                max_seq_len=512)) == reference[3]
    llm.check_invariants()


def _penalized_greedy(model, prompt, out, sp):
    """The greedy tokens under `sp`'s penalties and logit bias from `Model.logits` of the whole sequence (host
    reference), and the smallest top-2 margin on the way (DESIGN section 4: a mismatch must trace to a margin below
    1e-4)."""
    from k3jax.sampling import apply_penalties, bias_row, penalty_counts

    rows = np.asarray(model.logits(prompt + out))[len(prompt) - 1:-1]
    f = lambda v: np.array([v], np.float32)
    want, margin = [], np.inf
    for j, row in enumerate(rows):
        c = penalty_counts(prompt, out[:j], model.config.vocab_size)[None]
        r = np.asarray(apply_penalties(row[None], c, f(sp.repetition_penalty), f(sp.presence_penalty),
                                       f(sp.frequency_penalty)))[0] + bias_row(sp.logit_bias, model.config.vocab_size)
        want.append(int(r.argmax()))
        margin = min(margin, float(np.diff(np.sort(r)[-2:])[0]))
    return want, margin


PENALTIES = [SamplingParams(max_new_tokens=10, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
             SamplingParams(max_new_tokens=10, repetition_penalty=0.4, presence_penalty=-2.0, frequency_penalty=-2.0),
             SP, SamplingParams(max_new_tokens=10, repetition_penalty=0.7, presence_penalty=-1.0,
                                logit_bias={101: 4.0, 32: -100.0, 257: 2.5, 7: 6.0})]


@pytest.mark.parametrize("overlap, pressure", [(True, False), (False, False), (True, True)])
def test_penalties(model, reference, overlap, pressure):
    """Repetition / presence / frequency penalties (vLLM's definitions) over the prompt and every generated token
    (one request with a logit bias too, added after them), counted on the device as the step samples them (with
    overlap the host learns a token a step late): each penalised request's greedy tokens equal the host reference
    from the whole sequence's logits, a request without penalties in the same batch keeps the plain greedy tokens,
    the prefix cache (a repeat of the prompts restores from it) and preemption under memory pressure (rows rebuilt
    from prompt + outputs at re-admission) change nothing; the single-request loop agrees; the speculative engine
    refuses penalties and logit bias by name."""
    phase1, _ = workload()
    sps = PENALTIES
    if pressure:  # longer outputs, all penalised: requests are preempted mid-decode and resume with outputs
        sps = [dataclasses.replace(PENALTIES[i], max_new_tokens=40) for i in (0, 1, 3, 0)]
    llm = LLM(model, page_size=16, overlap=overlap, **(ENGINE_KW | (dict(kv_pages=26, state_slots=12) if pressure else {})))
    res = llm.generate(phase1, sps)
    outs = [o.token_ids for o in res]
    assert outs[0] != reference[0] and outs[1] != reference[1]  # the penalties change the tokens
    assert len(set(outs[1])) < len(outs[1])  # rewarded repeats (negative presence / frequency penalties)
    for p, o, sp in zip(phase1, outs, sps):
        if sp is SP:
            assert o == reference[2]
            continue
        want, margin = _penalized_greedy(model, p, o, sp)
        assert o == want and margin > 1e-4
    if pressure:
        assert sum(r.num_preemptions for r in res) >= 2
        llm.check_invariants()
        return
    assert [o.token_ids for o in llm.generate(phase1, sps)] == outs  # again, from the prefix cache
    assert llm.stats["restored_tokens"] > 0
    assert list(generate_stream(model, phase1[0], sps[0], prefill_chunk=128, max_seq_len=512)) == outs[0]
    llm.check_invariants()
    if overlap:
        spec = LLM(model, page_size=16, speculative="ngram", **ENGINE_KW)
        for sp in (PENALTIES[1], SamplingParams(logit_bias={3: 1.0})):
            with pytest.raises(ValueError, match="logit_bias: not supported with speculative"):
                spec.generate([[1, 2]], sp)


def test_branch_point_second_sibling_restores_without_replay(model):
    llm = LLM(model, page_size=16, **ENGINE_KW)
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 256, 200).tolist()  # fork at 200: mid-chunk (64) and mid-page (16)
    a, b, c, d = (shared + rng.integers(0, 256, n).tolist() for n in (100, 30, 40, 50))
    tree = llm.core.scheduler.tree
    llm.generate([a], SP)
    out_b = llm.generate([b], SP)[0]
    assert out_b.cached_tokens == 0 and out_b.recomputed_tokens >= len(b)  # replays, plants at 192
    assert 192 in {n.depth for n in tree.ckpt_nodes}
    out_c = llm.generate([c], SP)[0]
    assert out_c.cached_tokens == 192
    assert out_c.recomputed_tokens == len(c) - 192 + SP.max_new_tokens - 1  # no replay of the prefix
    # tombstone: drop every checkpoint; KV stays matched but the state must be recomputed
    freed = tree.evict_checkpoints(len(tree.ckpt_nodes))
    llm.core.scheduler.slots.free(freed)
    assert tree.match(d).kv_len >= 192 and tree.match(d).ckpt_node is None
    out_d = llm.generate([d], SP)[0]
    assert out_d.cached_tokens == 0
    want = [list(generate_stream(model, p, SP, prefill_chunk=128, max_seq_len=512)) for p in (b, c, d)]
    assert [o.token_ids for o in (out_b, out_c, out_d)] == want
    llm.check_invariants()


def test_memory_pressure_evicts_preempts_and_matches(model, reference):
    # 4 running requests of up to ~330 tokens need ~84 pages of 16; give them 25 and few slots
    llm = LLM(model, page_size=16, kv_pages=26, state_slots=12, **ENGINE_KW)
    got = run_workload(llm, together=True)
    assert got == reference
    stats = llm.stats
    assert stats["preemptions"] > 0 and stats["evicted_pages"] > 0
    llm.check_invariants()


def test_abort_frees_everything(model):
    llm = LLM(model, page_size=16, **ENGINE_KW)
    core = llm.core
    reqs = [core.make_request(list(range(i, i + 90)), SamplingParams(max_new_tokens=40)) for i in range(4)]
    for r in reqs:
        core.add(r)
    for _ in range(4):
        core.step()
    assert llm.abort(reqs[1].id) and llm.abort(reqs[3].id)
    assert not llm.abort("no-such-request")
    llm.check_invariants()
    while core.has_work():
        core.step()
    assert [r.finish_reason for r in reqs] == ["length", "abort", "length", "abort"]
    llm.check_invariants()
    assert core.scheduler.pages.free_count + core.scheduler.tree.num_pages == core.scheduler.pages.capacity


def test_stop_conditions_and_streaming(model, reference, monkeypatch):
    llm = LLM(model, page_size=16, **ENGINE_KW)
    phase1, _ = workload()
    ref = reference[0]
    full = llm.generate([phase1[0]], SP)[0]
    assert full.token_ids == ref and full.finish_reason == "length"
    deltas = list(llm.stream(phase1[0], SP))
    assert [t for d in deltas for t in d.token_ids] == ref
    assert deltas[-1].finished and deltas[-1].output.token_ids == ref
    assert "".join(d.text for d in deltas) == deltas[-1].output.text
    short = llm.generate([phase1[0]], SamplingParams(max_new_tokens=3))[0]
    assert short.token_ids == ref[:3] and short.finish_reason == "length"
    # a stop token id: the output ends at its first occurrence, the token included; the single-request loop agrees
    stop = ref[3]
    want = ref[: ref.index(stop) + 1]
    sp = dataclasses.replace(SP, stop_token_ids=[stop])
    out = llm.generate([phase1[0]], sp)[0]
    assert out.token_ids == want and out.finish_reason == "stop"
    stats = {}
    assert list(generate_stream(model, phase1[0], sp, prefill_chunk=128, max_seq_len=512, stats=stats)) == want
    assert stats["finish_reason"] == "stop"
    # the model's EOS (here made a token of the greedy output): the request ends there, unless ignore_eos
    monkeypatch.setattr(llm.core.scheduler, "cfg", dataclasses.replace(llm.core.scheduler.cfg, eos_token_id=stop))
    out = llm.generate([phase1[0]], SP)[0]
    assert out.token_ids == want and out.finish_reason == "eos"
    out = llm.generate([phase1[0]], dataclasses.replace(SP, ignore_eos=True))[0]
    assert out.token_ids == ref and out.finish_reason == "length"
    llm.check_invariants()


def test_bad_requests_are_rejected_cleanly(model):
    llm = LLM(model, page_size=16, **ENGINE_KW)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SP)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 100000]], SP)
    with pytest.raises(ValueError, match="max_seq_len"):
        llm.generate([[1] * 500], SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[1, 2]], SamplingParams(temperature=-1.0))
    assert not llm.core.has_work()
    llm.check_invariants()


def test_async_engine_streams_and_aborts(model, reference):
    llm = LLM(model, page_size=16, **ENGINE_KW)
    engine = Engine(llm.core)
    phase1, _ = workload()

    async def main():
        async def collect(prompt):
            return [t async for d in engine.generate(prompt, SP) for t in d.token_ids]

        long_id = engine.add_request(phase1[3], SamplingParams(max_new_tokens=200))
        outs = await asyncio.gather(*(collect(p) for p in phase1))
        engine.abort(long_id)
        last = [d async for d in engine.stream(long_id)][-1]
        return outs, last

    try:
        outs, last = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outs == reference[:4]
    assert last.finished and last.finish_reason in ("abort", "length")
    llm.check_invariants()
