"""Speculative decoding (verify -> accept -> fold): greedy identity with the plain engine across
engine features, the fold against plain decoding, lossless rejection sampling, memory accounting."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sstats

from k3jax import LLM, SamplingParams
from k3jax.api import load_model
from k3jax.engine.runner import SeqWork, pack_step
from k3jax.engine.simple import generate_stream
from k3jax.model.forward import forward, forward_verify
from k3jax.sampling import spec_accept, target_logprobs
from k3jax.sizing import spec_window_bytes
from k3jax.spec.drafter import NgramDrafter, OracleDrafter
from k3jax.spec.step import fold_blocks
from k3jax.state import init_state
from tests.test_engine import ENGINE_KW, workload

SP = SamplingParams(max_new_tokens=16)
GAMMA = 4


@pytest.fixture(scope="module")
def model():
    return load_model("k3-tiny", seed=0)


def spec_workload(seed=0):
    """The [engine] workload, plus a third phase that restores from a checkpoint a verify block
    planted while crossing depth 192 in phase 2."""
    phase1, phase2 = workload(seed)
    rng = np.random.default_rng(seed + 1)

    def phase3(prompts2, outs2):
        return [prompts2[2] + outs2[2] + rng.integers(0, 256, 5).tolist()]
    return phase1, phase2, phase3


def run(llm):
    phase1, phase2, phase3 = spec_workload()
    gen = lambda ps: [o.token_ids for o in llm.generate(ps, SP)]
    out1 = gen(phase1)
    p2 = phase2(out1)
    out2 = gen(p2)
    out3 = gen(phase3(p2, out2))
    llm.check_invariants()
    return out1 + out2 + out3


@pytest.fixture(scope="module")
def reference(model):
    phase1, phase2, phase3 = spec_workload()
    ref = lambda p: list(generate_stream(model, p, SP, prefill_chunk=128, max_seq_len=512))
    out1 = [ref(p) for p in phase1]
    p2 = phase2(out1)
    out2 = [ref(p) for p in p2]
    p3 = phase3(p2, out2)
    prompts = phase1 + p2 + p3
    out = out1 + out2 + [ref(p) for p in p3]
    return out, {tuple(p): o for p, o in zip(prompts, out)}


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_speculative_equals_plain(model, reference, page_size):
    want, answers = reference
    # at page_size 16 the cache and overlap each off in turn; at page_size 1 both on (the path page_size
    # changes: page-granular matching and KV writes)
    combos = [(True, True), (True, False), (False, True)] if page_size == 16 else [(True, True)]
    for prefix_cache, overlap in combos:
        oracle = OracleDrafter(answers, model.config.vocab_size)
        llm = LLM(model, page_size=page_size, prefix_cache=prefix_cache, overlap=overlap, speculative=oracle,
                  num_draft_tokens=GAMMA, **ENGINE_KW)
        assert run(llm) == want, f"prefix_cache={prefix_cache} overlap={overlap}"
        st = llm.stats
        assert 0 < st["spec_accepted"] < st["spec_drafted"]  # partial acceptance happened
        assert st["spec_blocks"] < sum(len(o) for o in want)  # fewer verify steps than tokens
        if prefix_cache:
            assert st["spec_block_snapshots"] > 0 and st["restored_tokens"] > 0
    if page_size == 16:
        llm = LLM(model, page_size=page_size, speculative="ngram", num_draft_tokens=GAMMA, **ENGINE_KW)
        assert run(llm) == want


def test_min_p_one_speculative_is_greedy(model, reference):
    """Sampled verify blocks with min_p 1 (temperature 50): a draft is accepted exactly when it is the target's
    argmax and the bonus token is the argmax, so the tokens are the greedy ones."""
    want, answers = reference
    phase1 = spec_workload()[0]
    llm = LLM(model, page_size=16, speculative=OracleDrafter(answers, model.config.vocab_size), num_draft_tokens=GAMMA,
              **ENGINE_KW)
    sp = SamplingParams(max_new_tokens=SP.max_new_tokens, temperature=50.0, min_p=1.0, seed=5)
    assert [o.token_ids for o in llm.generate(phase1, sp)] == want[: len(phase1)]
    assert llm.stats["spec_accepted"] > 0
    llm.check_invariants()


def test_speculative_with_unified_memory_under_pressure(model, reference):
    want, answers = reference
    llm = LLM(model, page_size=16, kv_pages=26, state_slots=12, enable_unified_memory=True,
              speculative=OracleDrafter(answers, model.config.vocab_size), num_draft_tokens=GAMMA, **ENGINE_KW)
    assert run(llm) == want
    assert llm.stats["preemptions"] > 0 and llm.stats["spec_accepted"] > 0


def test_fold_equals_plain_decode(model, monkeypatch):
    """verify + fold keeping n block tokens == decoding those n tokens one by one (f32 tolerance),
    for the working slot and an in-block snapshot; accepted drafts 0, partial and all. And impl "auto" as on a
    Hopper GPU folds k3-tiny's 32-wide keys on XLA, which the fold kernel does not take."""
    cfg = model.config
    B, ps = GAMMA + 1, 16
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, 70).tolist()
    block = rng.integers(0, 256, B).tolist()
    pages = list(range(1, 7))
    step = jax.jit(forward, static_argnames=("cfg", "impl"))
    verify = jax.jit(forward_verify, static_argnames=("cfg", "block", "impl"))
    fold = jax.jit(fold_blocks, static_argnames=("impl",))

    def packed(decode=(), prefill=(), block=1):
        return pack_step(list(decode), list(prefill), D=1 if decode else 0, P=128 if prefill else 0,
                         NP=1 if prefill else 0, pages_per_seq=8, block=block).batch

    state = init_state(cfg, 4, 8, ps)
    _, state = step(model.params, state, packed(prefill=[SeqWork(prompt, 0, 1, pages)]), cfg, "xla")
    plain = [state]
    for j, t in enumerate(block):
        _, s = step(model.params, plain[-1], packed(decode=[SeqWork([t], 70 + j, 1, pages)]), cfg, "xla")
        plain.append(s)
    _, vstate, caps = verify(model.params, state, packed(decode=[SeqWork(block, 70, 1, pages)], block=B), cfg, B, "xla")
    for a, b in zip(jax.tree_util.tree_leaves(vstate.recurrent), jax.tree_util.tree_leaves(state.recurrent)):
        np.testing.assert_array_equal(a, b)  # verify never writes the committed state
    # the jnp fold on gathered states, and the fold kernel on the pool in place (portable Pallas in
    # interpret mode: the engine's path on a GPU, where `impl` resolves to the Mosaic GPU kernel)
    for impl, n_keep in (("xla", 1), ("xla", 3), ("xla", B), ("pallas_interpret", 3), ("pallas_interpret", B)):
        snap_at = 2 if n_keep >= 2 else 0
        out = fold(vstate, caps, jnp.array([1]), jnp.array([n_keep]), jnp.array([snap_at]), jnp.array([2]), impl=impl)
        np.testing.assert_array_equal(out.recurrent.ssm[3], vstate.recurrent.ssm[3])  # slot 3: not in the block
        for slot, n in ((1, n_keep), (2, snap_at)):
            if slot == 2 and not snap_at:
                continue
            want = plain[n].recurrent
            np.testing.assert_allclose(out.recurrent.ssm[slot], want.ssm[1], rtol=1e-5, atol=2e-6)
            np.testing.assert_allclose(out.recurrent.conv[slot], want.conv[1], rtol=1e-5, atol=1e-5)
    # "auto" on a Hopper GPU takes the fold kernel only where K and V are multiples of 64, as verify does; k3-tiny's
    # K = 32 folds on XLA (before session 28 "auto" sent it to the kernel, which raised NotImplementedError)
    from pallas_kernels import dispatch

    monkeypatch.setattr(dispatch, "hopper_gpu", lambda: True)
    args = (vstate, caps, jnp.array([1]), jnp.array([3]), jnp.array([2]), jnp.array([2]))
    for a, b in zip(jax.tree_util.tree_leaves(fold(*args, impl="auto")), jax.tree_util.tree_leaves(fold(*args, impl="xla"))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("min_p", [None, 0.3])
def test_rejection_sampling_preserves_the_target_distribution(min_p):
    """The emitted tokens follow the target distribution (temperature, top-p and, with min_p, the
    min-p filter: at position 0 it drops tokens 1 and 4, at position 1 the second draft, 4)."""
    X, B, n = 6, 3, 40000
    rng = np.random.default_rng(0)
    logits = jnp.asarray(np.tile(rng.normal(size=(1, B, X)) * 1.5, (n, 1, 1)), jnp.float32)
    block = jnp.tile(jnp.array([[0, 2, 4]], jnp.int32), (n, 1))  # drafts 2 then 4
    temp, top_k, top_p = jnp.full(n, 0.9), jnp.zeros(n, jnp.int32), jnp.full(n, 0.95)
    mp = None if min_p is None else jnp.full(n, min_p)
    keys = jax.random.key_data(jax.random.split(jax.random.key(1), n * B)).reshape(n, B, 2)
    n_emit, toks = spec_accept(logits, block, jnp.full(n, 2), temp, top_k, top_p, keys, mp)
    n_emit, toks = np.asarray(n_emit), np.asarray(toks)
    p = np.exp(np.asarray(target_logprobs(logits[0], temp[:B], top_k[:B], top_p[:B], None if mp is None else mp[:B])))
    assert 0.05 < np.mean(n_emit > 1) < 0.95  # the test exercises both accept and reject
    if min_p is not None:
        plain = np.exp(np.asarray(target_logprobs(logits[0], temp[:B], top_k[:B], top_p[:B])))
        assert p[0, 1] == p[1, 4] == 0 < min(plain[0, 1], plain[1, 4])  # filtered by min_p, not by top-p
        assert not (n_emit > 2).any()  # the second draft lies outside the support: never accepted

    def check(observed_tokens, probs):
        support = probs > 0
        counts = np.bincount(observed_tokens, minlength=X)
        assert counts[~support].sum() == 0, "a token outside top-p was emitted"
        q = probs[support].astype(np.float64)
        res = sstats.chisquare(counts[support], q / q.sum() * counts.sum())
        assert res.pvalue > 1e-4, (counts, probs)

    check(toks[:, 0], p[0])  # the first emitted token follows the target
    second = n_emit >= 2  # given the first draft was accepted, the second follows the target too
    check(toks[second, 1], p[1])
    # greedy rows are exact: accept while the draft is the argmax
    g_emit, g_toks = spec_accept(logits[:2], block[:2], jnp.array([2, 0]), jnp.zeros(2), top_k[:2], top_p[:2] * 0 + 1,
                                 keys[:2])
    target = np.argmax(np.asarray(logits[0]), axis=-1)
    a = 0
    while a < 2 and target[a] == [2, 4][a]:
        a += 1
    assert list(np.asarray(g_emit)) == [a + 1, 1] and np.asarray(g_toks)[0, a] == target[a]


def test_spec_window_bytes():
    w = spec_window_bytes(128, 128, 7)
    assert w["snapshot"] == 512 * 1024
    assert w["replay"] <= 16 * 1024 and w["snapshot"] / w["replay"] >= 32
    assert spec_window_bytes(128, 128, 3)["replay"] * 2 == w["replay"]


def test_ngram_drafter_and_bad_options(model):
    d = NgramDrafter(min_n=1, max_n=3)
    assert d.propose("a", [1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert d.propose("a", [1, 2, 3, 9, 1, 2, 3, 9, 1], 2) == [2, 3]  # incremental index, latest match
    assert d.propose("b", [5, 6, 7], 4) == []
    with pytest.raises(ValueError, match="speculative"):
        LLM(model, speculative="medusa", **ENGINE_KW)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        LLM(model, speculative="ngram", num_draft_tokens=0, **ENGINE_KW)


def test_speculative_sharded_equals_plain(model, reference):
    """The verify scan and the fold over head-sharded state under a tp=2 mesh (conv channels in
    per-shard groups), and the experts over ep=2: same greedy tokens."""
    want, answers = reference
    llm = LLM(model, page_size=16, mesh="tp=2,ep=2", speculative=OracleDrafter(answers, model.config.vocab_size),
              num_draft_tokens=GAMMA, **ENGINE_KW)
    assert run(llm) == want
    assert llm.stats["spec_accepted"] > 0


def test_batch_invariance_bench_reports_every_layer():
    """bench/batch_invariance.py (run on the H200 through bench/device_calls.sh): its per-layer taps
    see every attention and FFN output in the mixed and verify steps, and its verify-vs-decode-chain
    rows cover the block; on the CPU every difference is f32 rounding (< 1e-3 on logits of std ~8)."""
    from bench import batch_invariance

    res = batch_invariance.main(["--seeds", "1", "--layers", "--no-gemm", "--kda-head-dim", "0",
                                 "--prompt-len", "40", "--gamma", "3"])
    (step,) = res["step"]
    cfg = load_model("k3-tiny", seed=0).config
    for mode in ("mixed", "verify"):
        rows = step["layers"][mode]
        assert [(r["layer"], r["kind"]) for r in rows[::2]] == list(enumerate(cfg.layer_kinds))
        assert [r["kind"] for r in rows[1::2]] == list(cfg.ffn_kinds)
        assert all(np.isfinite(r["maxabs"]) and r["maxabs"] < 1e-3 for r in rows)
    assert len(step["verify_vs_decode_chain_maxabs"]) == 4
    assert max(step["verify_vs_decode_chain_maxabs"]) < 1e-3 and step["same_argmax"]


def test_parted_requests_reports_the_first_difference_and_its_margin():
    """bench/batch_invariance.py's triage (also the GPU speculative test's failure message): for a request
    whose tokens part it names the first differing token and the referee's logit margin there; greedy
    tokens are the referee's argmax, so a changed token has a positive margin."""
    from bench.batch_invariance import parted_requests

    model = load_model("k3-tiny", seed=0)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    want = []
    for p in prompts:  # three greedy tokens from the plain forward
        toks = []
        for _ in range(3):
            toks.append(int(model.logits(p + toks)[-1].argmax()))
        want.append(toks)
    got = [want[0][:1] + [(want[0][1] + 1) % model.config.vocab_size] + want[0][2:], list(want[1])]
    (r,) = parted_requests(model, prompts, got, want)
    assert (r["request"], r["index"], r["want"], r["got"]) == (0, 1, want[0][1], got[0][1])
    assert r["referee_argmax"] == want[0][1] and r["margin"] > 0 and r["top2_gap"] > 0
    assert parted_requests(model, prompts, want, want) == []


def test_bf16_chunk_emulates_the_chunk_kernels_operand_rounding():
    """bench/batch_invariance.py's `bf16_chunk` (the Pallas chunk kernels' bf16 operands on the XLA path):
    inside it the chunked KDA rounds q, k and v to bf16 (inputs already in bf16 give the same output), its
    output stays within bf16 error of the exact one, and leaving it restores the exact path bit for bit."""
    from bench.batch_invariance import bf16_chunk
    from pallas_kernels.kda import kda_chunk

    T, H, K = 70, 2, 16
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    q, k, v = (jax.random.normal(ks[i], (1, T, H, K)) for i in range(3))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (1, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, H)))
    cu = jnp.array([0, 29, T], jnp.int32)
    bf = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    run = lambda q, k, v: np.asarray(kda_chunk(q, k, v, g, beta, cu_seqlens=cu, impl="xla")[0])
    exact, exact_rounded_in = run(q, k, v), run(bf(q), bf(k), bf(v))
    assert not np.array_equal(exact, exact_rounded_in)
    with bf16_chunk():
        emu, emu_rounded_in = run(q, k, v), run(bf(q), bf(k), bf(v))
    np.testing.assert_array_equal(emu, emu_rounded_in)
    rel = np.linalg.norm(emu - exact) / np.linalg.norm(exact)
    assert 1e-5 < rel < 2e-2, rel
    np.testing.assert_array_equal(run(q, k, v), exact)
