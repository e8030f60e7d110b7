"""MLA attention over the paged latent cache: the blocked XLA form (keys in page blocks, online softmax)
against the one-pass reference, its memory bound, and the model on it."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import mla

G, C, H, DK, VD, PS, P = 4, 5, 2, 24, 16, 4, 7  # P pages of PS tokens: 28 keys a group


def inputs(dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (G, C, H, DK), jnp.float32)
    pages = jax.random.normal(ks[1], (40, 2, PS, DK), jnp.float32).astype(dtype)
    rows = jax.random.permutation(ks[2], jnp.arange(1, 40, dtype=jnp.int32))[: G * P].reshape(G, P)
    # group 0: nothing in context (a padding group); 1: 1 key; 2: part of its pages; 3: every key
    kv_len = jnp.array([0, 1, 13, P * PS], jnp.int32)
    pos = jnp.array([[-1] * C, [0, 0, 3, 3, -1], [0, 4, 7, 12, 12], [0, 9, 17, 26, 27]], jnp.int32)
    return q, pos, rows, pages, kv_len


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_pages", [1, 2, 3, 7, None])
def test_blocked_equals_the_reference(dtype, block_pages):
    q, pos, rows, pages, kv_len = inputs(dtype)
    kw = dict(layer=1, scale=DK ** -0.5, v_dim=VD)
    want = np.asarray(mla.mla_paged_attention_ref(q, pos, rows, pages, kv_len, **kw))
    got = np.asarray(jax.jit(lambda *a: mla.mla_paged_attention_xla(*a, block_pages=block_pages, **kw))(
        q, pos, rows, pages, kv_len))
    assert got.shape == (G, C, H, VD) and got.dtype == np.float32
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    # no visible key (a padding group, a padding query): zeros, as the reference gives
    assert not got[0].any() and not got[1, 4].any()
    # a query that sees one key gets that key's value channels
    np.testing.assert_allclose(got[1, 0], np.broadcast_to(np.asarray(pages[rows[1, 0], 1, 0, :VD], np.float32),
                                                          (H, VD)), rtol=1e-6)


def test_needed_blocks_stop_at_the_last_visible_key():
    """KEY_BLOCKS "needed": the loop ends after the last block a query of the call can see. Same bits as
    "static" (the skipped blocks add exact zeros), and the blocks past it are never read: poisoned with NaN
    there, "static" returns NaN (0 x NaN in the weighted sum, as the reference would) and "needed" does not."""
    q, pos, rows, pages, kv_len = inputs(jnp.bfloat16)
    q, pos, rows, kv_len = q[:3], pos[:3], rows[:3], kv_len[:3]  # groups 0-2: at most 13 keys visible
    kw = dict(layer=1, scale=DK ** -0.5, v_dim=VD)
    run = lambda pages, blocks: np.asarray(jax.jit(lambda *a: mla.mla_paged_attention_xla(
        *a, blocks=blocks, block_pages=2, **kw))(q, pos, rows, pages, kv_len))  # 8 keys a block, 4 blocks
    static, needed = run(pages, "static"), run(pages, "needed")
    np.testing.assert_array_equal(needed, static)
    np.testing.assert_allclose(needed, np.asarray(mla.mla_paged_attention_ref(q, pos, rows, pages, kv_len, **kw)),
                               rtol=2e-5, atol=2e-6)
    # the pages of blocks 2 and 3 (keys 16-31) of every group, poisoned
    poisoned = pages.at[rows[:, 4:].reshape(-1), 1].set(jnp.nan)
    assert np.isnan(run(poisoned, "static")).any()
    np.testing.assert_array_equal(run(poisoned, "needed"), needed)


def test_a_rows_bits_do_not_depend_on_the_others_trips():
    """What the batch-invariant mode needs of "needed": a group's result is the same bits whether the call's
    loop stops at its own last block or runs on for a longer neighbour (same call shape)."""
    q, pos, rows, pages, kv_len = inputs(jnp.float32)
    f = jax.jit(lambda *a: mla.mla_paged_attention_xla(*a, layer=0, scale=DK ** -0.5, v_dim=VD, block_pages=1,
                                                        blocks="needed"))
    pick = lambda idx: tuple(x[jnp.array(idx)] for x in (q, pos, rows)) + (pages, kv_len[jnp.array(idx)])
    short = np.asarray(f(*pick([2, 0])))  # 13 keys: 4 blocks of 4
    long = np.asarray(f(*pick([2, 3])))  # 28 keys: 7 blocks
    np.testing.assert_array_equal(short[0], long[0])


def test_key_blocks_names_a_bad_setting(monkeypatch):
    monkeypatch.setattr(mla, "KEY_BLOCKS", "some")
    with pytest.raises(ValueError, match="KEY_BLOCKS"):
        mla.key_blocks()
    monkeypatch.setattr(mla, "KEY_BLOCKS", "auto")
    assert mla.key_blocks() == ("static" if jax.default_backend() == "gpu" else "needed")


def test_key_block_pages_keeps_the_budget():
    for g, c, h, p, dk in [(256, 64, 12, 1024, 576), (256, 1, 12, 2048, 576), (1, 1, 4, 3, 24), (8, 64, 96, 512, 576)]:
        per_page = g * (c * h * 8 + dk * 6) * 16
        for budget in (1, per_page, 3 * per_page + 1, 100 * per_page, 1 << 40):
            bp = mla.key_block_pages(g, c, h, p, 16, dk, budget)
            nb = -(-p // bp)
            assert 1 <= bp <= p
            assert bp * per_page <= max(budget, per_page)  # within the budget (one page at least)
            assert nb * bp - p < nb  # the blocks are even: less than a page of padding each
    assert mla.key_block_pages(1, 1, 4, 3, 16, 24, 1 << 40) == 3  # everything fits: one block


def compiled_temps(G, C, H, Dk, v_dim, pool_pages, page_rows, layers, ps=16):
    """The compiled temporaries (bytes, no allocation) of the dense and the blocked form for [G, C, H, Dk]
    queries over `page_rows` pages a group of a bf16 pool of `pool_pages` x `layers` pages (read at its
    last layer). Also used by tests/gpu/test_mla_gpu.py."""
    sds = jax.ShapeDtypeStruct
    args = (sds((G, C, H, Dk), jnp.float32), sds((G, C), jnp.int32), sds((G, page_rows), jnp.int32),
            sds((pool_pages, layers, ps, Dk), jnp.bfloat16), sds((G,), jnp.int32))
    temp = {}
    for name, fn in (("dense", mla.mla_paged_attention_ref), ("blocked", mla.mla_paged_attention_xla)):
        f = jax.jit(lambda *a, fn=fn: fn(*a, layer=layers - 1, scale=Dk ** -0.5, v_dim=v_dim))
        temp[name] = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
    return temp


def test_blocked_memory_does_not_grow_with_the_context(monkeypatch):
    """Compiled temporaries: the reference's grow with groups x context; the blocked form's stay near one
    block's budget."""
    monkeypatch.setattr(mla, "KEY_BLOCK_BYTES", 4 << 20)
    g, c, h, dk, p = 16, 64, 4, 64, 256  # 4,096 keys a group
    temp = compiled_temps(g, c, h, dk, 32, p + 1, p, 1)
    scores = g * c * h * p * 16 * 4  # the reference's f32 scores alone: 64 MiB
    assert temp["dense"] >= scores, temp
    assert temp["blocked"] <= 3 * (4 << 20) + g * c * h * 32 * 4 * 2, temp  # ~a block, plus the carried sums


def test_the_model_on_small_key_blocks_matches_the_reference(monkeypatch):
    """k3-tiny's logits through the blocked form with one page a key block (every MLA read a loop of many
    blocks) against the f64 numpy reference."""
    from k3jax.api import Model
    from k3jax.config import preset
    from k3jax.model.init import init_params
    from tests.reference_model import reference_logits

    monkeypatch.setattr(mla, "KEY_BLOCK_BYTES", 1)  # one page a block
    cfg = preset("k3-tiny")
    params = init_params(cfg, 0)
    cfg = cfg.replace(name="k3-tiny-mla-blocks")  # a fresh trace: the budget is read while tracing
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 70)
    got = Model(cfg, params, None).logits(ids)
    want = reference_logits(params, cfg, ids)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
