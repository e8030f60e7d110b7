"""Image prompts through the engine (k3jax.media): placeholder expansion, image keys in the prefix cache,
embedding rows in the step, greedy identity against the whole sequence's logits, refusals."""
import dataclasses

import numpy as np
import pytest

from k3jax import LLM, SamplingParams
from k3jax.api import load_model
from k3jax.media import KEY_LIMIT, MediaPrompt, expand_placeholders, image_key, prepare
from k3jax.sampling import PROMPT_BIT, penalty_counts

SP = SamplingParams(max_new_tokens=8)
# 64-token prefill chunks: the images below straddle chunk boundaries
ENGINE_KW = dict(max_running=4, max_seq_len=256, prefill_chunk=64, max_prefill_seqs=4, single_bucket=True)
PH = 259  # k3-tiny's media placeholder


@pytest.fixture(scope="module")
def model():
    return load_model("k3-tiny", seed=0)


def image(seed, h=112, w=140):
    """A random RGB image; 112 x 140 pixels -> 8 x 10 patches of 14 -> 4 x 5 = 20 LM tokens."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def text(seed, n):
    return np.random.default_rng(100 + seed).integers(0, 256, n).tolist()


def teacher_forced(model, prompt, images, out):
    """(the greedy tokens the whole sequence's logits give at each generated position, smallest top-2 margin)."""
    n = len(prepare(model, prompt, images).keyed) if images else len(prompt)
    logits = model.logits(prompt + out, images)[n - 1: n - 1 + len(out)]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return logits.argmax(-1).tolist(), float((top2[:, 1] - top2[:, 0]).min())


def test_expand_placeholders():
    ids, spans = expand_placeholders([1, PH, 2, PH], [3, 2], PH)
    assert ids == [1, PH, PH, PH, 2, PH, PH] and spans == [(1, 4), (5, 7)]
    assert expand_placeholders(ids, [3, 2], PH) == (ids, spans)  # already expanded: kept
    with pytest.raises(ValueError, match="3 media placeholder tokens .* for 2 image"):
        expand_placeholders([PH, 1, PH, PH], [2, 2], PH)
    with pytest.raises(ValueError, match="0 media placeholder tokens"):
        expand_placeholders([1, 2], [4], PH)


def test_image_keys_and_penalty_counts():
    k = image_key(512, bytes(range(32)))
    assert 512 <= k < KEY_LIMIT and k != image_key(512, bytes(range(1, 33)))
    row = penalty_counts([5, k, k, 7], [5, 9], 512)  # keyed image tokens count nowhere
    assert row.shape == (512,) and row[5] == 1 | PROMPT_BIT and row[7] == PROMPT_BIT and row[9] == 1


def test_image_rows_reach_the_model(model):
    """The image's tokens carry the projector's rows: logits before the image do not depend on it, the rows
    from the image on do; the same image gives the same key and rows, another image another key."""
    prompt = text(0, 30) + [PH] + text(1, 12)
    a, b = prepare(model, prompt, [image(1)]), prepare(model, prompt, [image(2)])
    s, e = a.spans[0]
    assert (s, e) == (30, 50) and a.token_ids[s:e] == [PH] * 20 and len(set(a.keyed[s:e])) == 1
    assert a.keyed[s] >= model.config.vocab_size and a.keyed[s] != b.keyed[s]
    hits = model.vision_cache_hits
    again = prepare(model, prompt, [image(1)])  # the tower's rows from the model's cache
    assert again.keyed == a.keyed and model.vision_cache_hits == hits + 1
    np.testing.assert_array_equal(again.embeds, a.embeds)
    np.testing.assert_array_equal(a.rows(s - 2, 4)[2:], a.embeds[:2])
    assert a.rows(0, s) is None and not a.rows(s - 2, 4)[:2].any()
    la, lb = model.logits(prompt, [image(1)]), model.logits(prompt, [image(2)])
    assert la.shape == (len(a.keyed), model.config.vocab_size)
    np.testing.assert_array_equal(la[:s], lb[:s])
    assert np.abs(la[s:] - lb[s:]).max(axis=-1).min() > 1e-3
    np.testing.assert_array_equal(la[:s], model.logits(prompt[:s])[:s])


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_greedy_with_images_and_prefix_cache(model, overlap):
    """Image requests (one image straddling a prefill-chunk boundary, two images, a text-only neighbour) decode
    the greedy tokens of the whole sequence's logits; a repeat restores the cached prefix through its image, the
    same prompt with another image restores nothing past the image's start."""
    sys_prompt = text(2, 50)
    prompts = [sys_prompt + [PH] + text(3, 10), sys_prompt + [PH] + text(4, 7) + [PH] + text(5, 5), text(6, 40)]
    images = [[image(1)], [image(3, 56, 84), image(4)], None]
    llm = LLM(model, page_size=16, overlap=overlap, **ENGINE_KW)
    res = llm.generate(prompts, SP, images=images)
    for p, im, r in zip(prompts, images, res):
        want, margin = teacher_forced(model, p, im, r.token_ids)
        assert r.token_ids == want and margin > 1e-4
    assert res[0].prompt_token_ids == prepare(model, prompts[0], images[0]).token_ids  # no keys leak out
    again = llm.generate(prompts[0], SP, images=images[0])[0]
    assert again.token_ids == res[0].token_ids and again.cached_tokens >= 64  # through the image (50..70)
    other = llm.generate(prompts[0], SP, images=[image(9)])[0]
    assert other.cached_tokens <= 50
    want, margin = teacher_forced(model, prompts[0], [image(9)], other.token_ids)
    assert other.token_ids == want and margin > 1e-4
    llm.check_invariants()
    deltas = list(llm.stream(prompts[0], SP, images=images[0]))
    assert sum((d.token_ids for d in deltas), []) == res[0].token_ids


def test_image_requests_refused_by_name(model):
    llm = LLM(model, page_size=16, **ENGINE_KW)
    p = text(7, 10) + [PH]
    with pytest.raises(ValueError, match="2 media placeholder tokens .* for 1 image"):
        llm.generate(p + [PH], SP, images=[image(1)])
    with pytest.raises(ValueError, match="placeholder tokens .* but no images"):
        llm.generate(p, SP)
    with pytest.raises(ValueError, match="image 0: .*"):
        llm.generate(p, SP, images=[np.zeros((4, 4), np.uint8)])
    with pytest.raises(ValueError, match="2 image lists for 1 prompts"):
        llm.generate([p], SP, images=[[image(1)], [image(2)]])
    with pytest.raises(ValueError, match="max_seq_len"):
        llm.generate(p, SamplingParams(max_new_tokens=240), images=[image(1)])
    text_only = dataclasses.replace(model, config=model.config.replace(vision=None), vision_params=None)
    with pytest.raises(ValueError, match="has no vision tower"):
        LLM(text_only, page_size=16, **ENGINE_KW).generate(p, SP, images=[image(1)])
    prepared = prepare(model, p, [image(1)])
    assert isinstance(prepared, MediaPrompt)
    with pytest.raises(ValueError, match="made for another prompt"):
        llm.core.make_request(text(8, 10) + [PH], SP, images=prepared)
    ok = llm.generate(p, SP, images=prepared)[0]  # a prepared prompt is taken as is
    assert ok.token_ids == llm.generate(p, SP, images=[image(1)])[0].token_ids
    llm.check_invariants()
    assert llm.memory_usage()["running"] == 0


def test_warmup_compiles_the_image_step(model):
    """A warmed-up engine runs an image request (its tower output prepared beforehand) without compiling."""
    from k3jax.compiles import count_compiles

    llm = LLM(model, page_size=16, warmup=True, **ENGINE_KW)
    p = text(9, 20) + [PH] + text(10, 5)
    media = prepare(model, p, [image(5, 56, 56)])
    with count_compiles() as compiles:
        out = llm.generate(p, SP, images=media)[0]
    assert compiles() == 0 and len(out.token_ids) == SP.max_new_tokens


def test_vision_cache_is_bounded_and_per_model(model):
    """The tower's outputs are kept by image digest within `vision_cache_bytes` (LRU); a replaced model (other
    params) starts with an empty cache."""
    small = dataclasses.replace(model, vision_cache_bytes=20 * 256 * 4)  # one 20-token image of width 256, f32
    assert small.vision_cache_hits == 0 and not small._vision_cache
    p = [PH]
    prepare(small, p, [image(1)])
    prepare(small, p, [image(1)])
    assert small.vision_cache_hits == 1
    prepare(small, p, [image(2)])  # evicts image 1
    prepare(small, p, [image(1)])
    assert small.vision_cache_hits == 1 and len(small._vision_cache) == 1


def test_speculative_decoding_with_images(model):
    """Verify blocks after an image prompt give the plain greedy tokens: with an oracle drafter (accepted drafts)
    and with a drafter proposing an image key first (an n-gram lookup can continue into the prompt's image):
    the scheduler cuts a draft before a key, so no verify block carries one."""
    from k3jax.spec.drafter import OracleDrafter

    p, imgs = text(11, 30) + [PH] + text(12, 8), [image(6)]
    plain = LLM(model, page_size=16, **ENGINE_KW).generate(p, SP, images=imgs)[0].token_ids
    keyed = prepare(model, p, imgs).keyed
    key = keyed[30]
    assert key >= model.config.vocab_size
    scheduled = []

    class KeyFirst:  # proposes the image's key, then the right continuation
        def propose(self, k, tokens, gamma, hidden=None):
            n = len(tokens) - len(keyed)
            return ([key] + plain[n: n + gamma])[:gamma]

        def forget(self, k):
            pass

    from k3jax.compiles import count_compiles

    media = prepare(model, p, imgs)
    for drafter in (KeyFirst(), OracleDrafter({tuple(keyed): plain}, model.config.vocab_size)):
        warm = isinstance(drafter, KeyFirst)  # warm-up compiles the verify step's image variant too
        llm = LLM(model, page_size=16, speculative=drafter, num_draft_tokens=3, warmup=warm, **ENGINE_KW)
        launch = llm.core.runner.launch
        llm.core.runner.launch = lambda plan: (scheduled.extend(t for s in plan.decode for t in s.tokens), launch(plan))[1]
        with count_compiles() as compiles:
            assert llm.generate(p, SP, images=media)[0].token_ids == plain
        assert compiles() == 0 or not warm
        llm.check_invariants()
        if isinstance(drafter, KeyFirst):
            assert llm.stats["spec_drafted"] == 0  # every proposal was cut at its first token
    assert scheduled and max(scheduled) < model.config.vocab_size
    assert llm.stats["spec_accepted"] > 0
