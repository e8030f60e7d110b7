import math

import jax
import numpy as np
import pytest

from k3jax.sampling import SamplingParams, is_hot, request_key, request_keys, resolve_seed, sample

R, X = 8, 64  # one compiled shape for most tests


def _run(logits, temperature, top_k=0, top_p=1.0, keys=None, seed=0, position=0, min_p=None):
    n = logits.shape[0]
    full = lambda v, dt: np.full(n, v, dt)  # noqa: E731
    if keys is None:
        keys = request_keys([seed + i for i in range(n)], [position] * n)
    return np.asarray(sample(np.asarray(logits, np.float32), full(temperature, np.float32), full(top_k, np.int32),
                             full(top_p, np.float32), keys, None if min_p is None else full(min_p, np.float32)))


@pytest.fixture(scope="module")
def logits():
    return np.random.default_rng(0).normal(size=(R, X)).astype(np.float32) * 3


def test_greedy_is_argmax(logits):
    """Greedy rows get the argmax, in the greedy-only program (hot=False, no sort) and in the sampling one."""
    out = _run(logits, 0.0)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, logits.argmax(-1))
    zero = np.zeros(R, np.float32)
    cold = sample(logits, zero, np.zeros(R, np.int32), np.ones(R, np.float32), request_keys(range(R), [0] * R), hot=False)
    np.testing.assert_array_equal(np.asarray(cold), logits.argmax(-1))
    assert not is_hot(zero) and is_hot(np.array([0.0, 0.5], np.float32))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 100.0])
def test_top_k_1_is_argmax(logits, temperature):
    np.testing.assert_array_equal(_run(logits, temperature, top_k=1, seed=7), logits.argmax(-1))


def test_mixed_rows_greedy_rows_stay_exact(logits):
    temperature = np.array([0.0, 1.0] * (R // 2), np.float32)
    out = np.asarray(sample(logits, temperature, np.zeros(R, np.int32), np.ones(R, np.float32),
                            request_keys(range(R), [0] * R)))
    np.testing.assert_array_equal(out[::2], logits.argmax(-1)[::2])


def test_seeded_reproducible_and_seeds_differ(logits):
    flat = np.zeros((R, X), np.float32)  # uniform: draws depend only on the key
    a = _run(flat, 1.0, seed=123, position=5)
    b = _run(flat, 1.0, seed=123, position=5)
    c = _run(flat, 1.0, seed=999, position=5)
    d = _run(flat, 1.0, seed=123, position=6)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any() and (a != d).any()
    np.testing.assert_array_equal(request_key(123, 5), request_key(123, 5))
    assert (request_key(123, 5) != request_key(124, 5)).any()
    typed = jax.vmap(lambda k: jax.random.wrap_key_data(k, impl="threefry2x32"))(request_keys([123 + i for i in range(R)], [5] * R))
    np.testing.assert_array_equal(_run(flat, 1.0, keys=typed), a)  # typed keys == raw key data


def test_resolve_seed():
    assert resolve_seed(5) == 5
    assert resolve_seed(None) != resolve_seed(None)


def _many(logits_row, n, temperature=1.0, top_k=0, top_p=1.0, min_p=None):
    """n draws from one distribution: n rows with distinct keys (one compile for shape [n, X])."""
    rows = np.repeat(np.asarray(logits_row, np.float32)[None], n, axis=0)
    return _run(rows, temperature, top_k, top_p, keys=request_keys([42] * n, range(n)), min_p=min_p)


N_DRAWS = 4000


def test_top_p_never_samples_outside_nucleus():
    probs = np.full(X, 0.3 / (X - 3))
    probs[[10, 20, 30]] = [0.4, 0.2, 0.1]  # nucleus for top_p=0.65: {10, 20, 30} (0.4+0.2 < 0.65 <= 0.7)
    out = _many(np.log(probs), N_DRAWS, top_p=0.65)
    assert set(np.unique(out)) == {10, 20, 30}
    counts = np.bincount(out, minlength=X)[[10, 20, 30]] / N_DRAWS
    np.testing.assert_allclose(counts, np.array([0.4, 0.2, 0.1]) / 0.7, atol=0.04)
    assert set(np.unique(_many(np.log(probs), N_DRAWS, top_p=0.1))) == {10}  # top token always kept
    out_k = _many(np.log(probs), N_DRAWS, top_k=2)
    assert set(np.unique(out_k)) == {10, 20}


def test_min_p_keeps_tokens_near_the_top():
    """min_p keeps the tokens at least min_p times as likely as the top one (after temperature), in
    their renormalised proportions; 0 is off (the draws of no min_p, key for key); 1 keeps the top
    token alone; it composes with top-k."""
    probs = np.full(X, 0.3 / (X - 3))
    probs[[10, 20, 30]] = [0.4, 0.2, 0.1]  # the rest 0.0049 each, 0.012 of the top
    lp = np.log(probs)
    out = _many(lp, N_DRAWS, min_p=0.3)  # threshold 0.12: {10, 20}
    assert set(np.unique(out)) == {10, 20}
    np.testing.assert_allclose(np.bincount(out, minlength=X)[[10, 20]] / N_DRAWS, [2 / 3, 1 / 3], atol=0.04)
    assert set(np.unique(_many(lp, N_DRAWS, min_p=0.2))) == {10, 20, 30}  # threshold 0.08
    # at temperature 2 the ratios are square roots: 30 is sqrt(0.25) = 0.5 of the top, the rest ~0.11
    assert set(np.unique(_many(lp, N_DRAWS, temperature=2.0, min_p=0.3))) == {10, 20, 30}
    assert set(np.unique(_many(lp, N_DRAWS, min_p=1.0))) == {10}
    assert set(np.unique(_many(lp, N_DRAWS, min_p=0.2, top_k=2))) == {10, 20}
    np.testing.assert_array_equal(_many(lp, N_DRAWS, min_p=0.0), _many(lp, N_DRAWS))
    assert len(np.unique(_many(lp, N_DRAWS))) > 10  # without it, the tail is drawn too


def test_token_logprobs(logits):
    """`token_logprobs`: the raw logits' log-softmax at the given tokens and the MAX_LOGPROBS most likely, most likely
    first; `logprob_entry` keeps n of them plus the token."""
    from k3jax.sampling import MAX_LOGPROBS, logprob_entry, token_logprobs

    toks = np.arange(R, dtype=np.int32) * 3
    lp = [np.asarray(a) for a in token_logprobs(logits, toks)]
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(lp[0], ref[np.arange(R), toks], atol=1e-5)
    np.testing.assert_array_equal(lp[1], np.argsort(-ref, axis=-1, kind="stable")[:, :MAX_LOGPROBS])
    np.testing.assert_allclose(lp[2], -np.sort(-ref, axis=-1)[:, :MAX_LOGPROBS], atol=1e-5)
    e = logprob_entry(int(toks[1]), 2, 1, lp)
    assert set(e) == {int(toks[1])} | set(lp[1][1, :2].tolist()) and e[int(toks[1])] == lp[0][1]


def test_penalties_against_numpy():
    """`apply_penalties` as vLLM defines them: repetition divides positive / multiplies negative logits of tokens
    in the prompt or the output, then frequency x output count and presence x (in the output) are subtracted;
    neutral rows come back bit for bit; `penalized` gathers rows of the engine's buffer (row 0: untouched) and
    `count_sampled` counts sampled tokens only in rows > 0; `penalty_counts` builds a row from the host."""
    from k3jax.sampling import PROMPT_BIT, apply_penalties, count_sampled, penalized, penalty_counts

    rng = np.random.default_rng(7)
    X_ = 40
    logits = rng.normal(size=(3, X_)).astype(np.float32) * 3
    prompt, output = [1, 2, 2, 30], [2, 5, 5, 5, 39]
    row = penalty_counts(prompt, output, X_)
    assert row[2] == PROMPT_BIT + 1 and row[5] == 3 and row[1] == PROMPT_BIT and row[39] == 1 and row[0] == 0
    counts = np.stack([row, row, np.zeros(X_, np.int32)])
    rep, pres, freq = (np.array(v, np.float32) for v in ([1.5, 0.8, 1.0], [0.5, -1.0, 0.0], [0.25, 2.0, 0.0]))
    got = np.asarray(apply_penalties(logits, counts, rep, pres, freq))
    ref = logits.astype(np.float64).copy()
    for i in range(3):
        for t in range(X_):
            if t in prompt or t in output:
                ref[i, t] = ref[i, t] / rep[i] if ref[i, t] > 0 else ref[i, t] * rep[i]
            n = output.count(t)
            ref[i, t] -= freq[i] * n + pres[i] * (n > 0)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[2], logits[2])  # neutral row: bit for bit
    buf = np.stack([np.zeros(X_, np.int32), row, np.zeros(X_, np.int32)])
    rows = np.array([1, 0, 2], np.int32)
    out = np.asarray(penalized(logits, buf, rows, rep, pres, freq))
    np.testing.assert_array_equal(out[0], got[0])
    np.testing.assert_array_equal(out[1:], np.asarray(apply_penalties(logits[1:], buf[[0, 2]], rep[1:], pres[1:],
                                                                      freq[1:])))
    np.testing.assert_array_equal(np.asarray(penalized(logits, buf, np.zeros(3, np.int32), rep, pres, freq)), logits)
    after = np.asarray(count_sampled(buf, np.array([1, 0, 2], np.int32), np.array([5, 7, 9], np.int32)))
    want = buf.copy()
    want[1, 5] += 1
    want[2, 9] += 1
    np.testing.assert_array_equal(after, want)  # row 0 (nobody's) never counts


def test_logit_bias():
    """`bias_row` is the dense row of a {token: bias} dict; `penalized` adds each logit row's bias row from the
    engine's buffer after the penalties (row 0: nobody's, zeros, so a plain row comes back bit for bit); a +100 bias
    forces a token and a -100 bias bans the argmax, greedy and sampled alike."""
    from k3jax.sampling import apply_penalties, bias_row, penalized

    X_ = 40
    logits = np.random.default_rng(3).normal(size=(3, X_)).astype(np.float32) * 3
    b = bias_row({4: 2.5, 39: -100.0}, X_)
    assert b.dtype == np.float32 and b[4] == 2.5 and b[39] == -100 and np.count_nonzero(b) == 2
    assert not bias_row(None, X_).any()
    counts = np.zeros((3, X_), np.int32)
    counts[1, 4] = 1
    bias = np.stack([np.zeros(X_, np.float32), b, bias_row({0: 1.0}, X_)])
    rep, pres, freq = (np.array(v, np.float32) for v in ([1.5, 1.0, 1.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]))
    rows = np.array([1, 0, 2], np.int32)
    out = np.asarray(penalized(logits, counts, rows, rep, pres, freq, bias))
    np.testing.assert_array_equal(out[0], np.asarray(apply_penalties(logits[:1], counts[1:2], rep[:1], pres[:1],
                                                                     freq[:1]))[0] + b)
    np.testing.assert_array_equal(out[1], logits[1])
    np.testing.assert_array_equal(out[2], logits[2] + bias[2])
    top = logits.argmax(-1)
    for temperature in (0.0, 1.0):
        forced = logits + bias_row({7: 100.0}, X_)
        np.testing.assert_array_equal(_run(forced, temperature, seed=1), [7, 7, 7])
        banned = logits.copy()
        banned[np.arange(3), top] -= 100.0
        assert not (_run(banned, temperature, seed=2) == top).any()


def test_empirical_distribution_matches_softmax():
    row = np.random.default_rng(1).normal(size=X).astype(np.float32) * 1.5
    for temperature in (1.0, 2.0):
        p = np.exp(row / temperature - (row / temperature).max())
        p /= p.sum()
        counts = np.bincount(_many(row, N_DRAWS, temperature=temperature), minlength=X)
        expected = p * N_DRAWS
        big = expected >= 5  # chi-square over cells with enough mass, the rest pooled
        chi2 = (((counts[big] - expected[big]) ** 2) / expected[big]).sum()
        rest_e, rest_c = expected[~big].sum(), counts[~big].sum()
        if rest_e > 0:
            chi2 += (rest_c - rest_e) ** 2 / rest_e
        dof = int(big.sum()) + (rest_e > 0) - 1
        # mean dof, sd sqrt(2 dof): 5 sigma is a generous but still meaningful bound
        assert chi2 < dof + 5 * math.sqrt(2 * dof), (temperature, chi2, dof)


@pytest.mark.parametrize("kw, field", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(min_p="0.1"), "min_p"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=2.0), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(seed="abc"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(stop=[1, 2]), "stop"),
    (dict(stop=""), "stop"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids"),
    (dict(stop_token_ids=[1, True]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty="2"), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"),
    (dict(logit_bias=[(1, 2.0)]), "logit_bias"),
    (dict(logit_bias={-1: 2.0}), "logit_bias: unknown token ids"),
    (dict(logit_bias={"5": 2.0}), "logit_bias: unknown token ids"),
    (dict(logit_bias={5: 100.5}), r"logit_bias\[5\]"),
    (dict(logit_bias={5: float("nan")}), r"logit_bias\[5\]"),
    (dict(logit_bias={5: "1"}), r"logit_bias\[5\]"),
])
def test_validate_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw).validate()


def test_validate_accepts_defaults_and_checks_vocab():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (16, 0.0, 1.0, 0, None, None)
    assert p.validate(512) is p
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3, stop=["\n", "END"]).validate(512)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=1000).validate(vocab_size=512)
    assert SamplingParams(stop="x").stop_strings == ("x",)
    SamplingParams(stop_token_ids=[0, 511], ignore_eos=True).validate(512)
    with pytest.raises(ValueError, match=r"stop_token_ids: unknown token ids \[512\]"):
        SamplingParams(stop_token_ids=[3, 512]).validate(vocab_size=512)


def test_token_stop():
    """The stop conditions a token decides alone: the model's EOS (unless ignore_eos), then a stop token id."""
    assert SamplingParams().token_stop(7, eos_token_id=7) == "eos"
    assert SamplingParams().token_stop(7, eos_token_id=None) is None
    assert SamplingParams(ignore_eos=True).token_stop(7, eos_token_id=7) is None
    assert SamplingParams(ignore_eos=True, stop_token_ids=[7]).token_stop(7, eos_token_id=7) == "stop"
    assert SamplingParams(stop_token_ids=[3, 9]).token_stop(9, eos_token_id=7) == "stop"
    assert SamplingParams(stop_token_ids=[3, 9]).token_stop(4, eos_token_id=7) is None
