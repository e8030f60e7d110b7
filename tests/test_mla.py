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


# ---- the decode kernel (Mosaic GPU; here in its interpret mode) -------------------------------------------

KDK, KVD = 128, 128  # the kernel's widths: Dk a multiple of 64, v_dim of 128


def kernel_case(G, C, H, ps, P, seed=0):
    """Decode-like groups (the last C positions of each context) over bf16 pages: group 0 empty, group 1 one
    key, the last one full; a query before its context's start is padding (position -1)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((G, C, H, KDK)), jnp.float32)
    pages = jnp.asarray(rng.standard_normal((G * P + 1, 2, ps, KDK)), jnp.bfloat16)
    rows = jnp.asarray(rng.permutation(np.arange(1, G * P + 1)).reshape(G, P), jnp.int32)
    kv_len = rng.integers(2, P * ps, G)
    kv_len[:2], kv_len[-1] = [0, 1], P * ps
    pos = kv_len[:, None] - C + np.arange(C)[None, :]
    return q, jnp.asarray(np.where(pos >= 0, pos, -1), jnp.int32), rows, pages, jnp.asarray(kv_len, jnp.int32)


def test_bf16_halves_carry_17_bits():
    """q's two bf16 halves: hi is x rounded to bf16 (to nearest), lo the rest, so hi + lo is x to ~2^-17."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(4096) * 3, jnp.float32)
    hi, lo = jax.jit(mla.bf16_halves)(x)
    assert hi.dtype == lo.dtype == jnp.bfloat16
    rel = np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - np.asarray(x, np.float64)) / np.abs(x)
    assert rel.max() < 2.0 ** -16 and np.asarray(lo).any()
    assert (np.asarray(hi) == np.asarray(x.astype(jnp.bfloat16))).mean() > 0.999  # ties may round apart


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("C,H,ps,P,splits", [(1, 4, 16, 6, 1), (3, 4, 64, 2, 3), (5, 16, 16, 5, 2)])
def test_decode_kernel_equals_the_reference(C, H, ps, P, splits, packed):
    """The kernel against the one-pass f32 reference: one query a group (decode) and several (verify); pages
    smaller than a block (several copies a block) and larger (a block's part of a page); one row block and
    several (5 x 16 = 80 rows: two of 64, three packed blocks of 32); one split and several (the splits'
    softmaxes combined, empty splits included); q's halves packed into one tile and in two."""
    args = kernel_case(4, C, H, ps, P)
    kw = dict(layer=1, scale=KDK ** -0.5, v_dim=KVD)
    want = np.asarray(mla.mla_paged_attention_ref(*args, **kw))
    got = np.asarray(mla.mla_decode_mgpu(*args, splits=splits, packed=packed, warpgroups=1, interpret=True, **kw))
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # q and the weights in two bf16 halves: ~f32
    assert not got[0].any()  # an empty context: zeros
    np.testing.assert_allclose(got[1, -1], np.broadcast_to(np.asarray(args[3][args[2][1, 0], 1, 0, :KVD], np.float32),
                                                           (H, KVD)), rtol=1e-6)  # one key: its value channels


@pytest.mark.parametrize("C,H,ps,P,splits,packed", [(1, 4, 16, 6, 1, True), (3, 4, 64, 2, 3, False)])
def test_decode_kernel_on_two_warpgroups(C, H, ps, P, splits, packed, monkeypatch):
    """Both value halves in one CTA, a warpgroup each, sharing q and the key ring (the leader loads; a slot is
    refilled once both have released it): the same result as the reference. Interpret mode runs the warpgroups as
    two threads on XLA:CPU's pool: a pool of fewer than 3 (it can hang) is named in an error."""
    args = kernel_case(4, C, H, ps, P, seed=3)
    kw = dict(layer=1, scale=KDK ** -0.5, v_dim=KVD)
    want = np.asarray(mla.mla_paged_attention_ref(*args, **kw))
    got = np.asarray(mla.mla_decode_mgpu(*args, splits=splits, packed=packed, warpgroups=2, interpret=True, **kw))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="warpgroups"):
        mla.mla_decode_mgpu(*args, warpgroups=3, interpret=True, **kw)
    from pallas_kernels import mgpu_common

    assert mgpu_common.cpu_pool_threads() >= 8  # conftest: PJRT_NPROC 12, 8 host devices
    monkeypatch.setattr(mgpu_common, "cpu_pool_threads", lambda: 2)  # a 2-core machine's default
    with pytest.raises(ValueError, match="PJRT_NPROC=3"):
        mla.mla_decode_mgpu(*args, splits=splits, packed=packed, warpgroups=2, interpret=True, **kw)


def test_decode_kernel_reads_only_the_blocks_it_needs():
    """A group's loop stops at its last visible block: pages past it poisoned with NaN change no bit."""
    q, pos, rows, pages, kv_len = kernel_case(3, 1, 4, 16, 6)
    kv_len, pos = jnp.array([0, 20, 33], jnp.int32), jnp.array([[-1], [19], [32]], jnp.int32)  # 1 and 2 blocks
    run = lambda pages: np.asarray(mla.mla_decode_mgpu(q, pos, rows, pages, kv_len, layer=1, scale=KDK ** -0.5,
                                                       v_dim=KVD, splits=1, interpret=True))
    clean = run(pages)
    poisoned = pages.at[rows[:, 4:].reshape(-1), 1].set(jnp.nan)  # keys 64 and on: past every group's blocks
    np.testing.assert_array_equal(run(poisoned), clean)
    assert np.isnan(np.asarray(mla.mla_paged_attention_xla(q, pos, rows, poisoned, kv_len, layer=1, scale=KDK ** -0.5,
                                                           v_dim=KVD, block_pages=1, blocks="static"))).any()


@pytest.mark.parametrize("packed", [True, False])
def test_kernel_takes_prefill_chunks(monkeypatch, packed):
    """With PREFILL_KERNEL, prefill-sized groups (40 queries x 4 heads = 160 rows: three 64-row blocks, five packed
    ones of 32) run on the kernel: equal to the reference, for a prompt's first chunk (positions 0-39) and a later
    one (56-95, over 96 keys). Each row block reads only up to its own last visible key: with the first chunk's
    keys from 32 on poisoned with NaN, its queries 0-31 keep their bits and 32-39, which see them, do not."""
    monkeypatch.setattr(mla, "PREFILL_KERNEL", True)
    q, _, rows, pages, _ = kernel_case(2, 40, 4, 16, 6, seed=5)
    pos = jnp.asarray(np.stack([np.arange(40), np.arange(56, 96)]), jnp.int32)
    kv_len = jnp.array([40, 96], jnp.int32)
    kw = dict(layer=1, scale=KDK ** -0.5, v_dim=KVD)
    run = lambda pages: np.asarray(mla.mla_decode_mgpu(q, pos, rows, pages, kv_len, packed=packed, splits=1, warpgroups=1,
                                                       interpret=True, **kw))
    clean = run(pages)
    np.testing.assert_allclose(clean, np.asarray(mla.mla_paged_attention_ref(q, pos, rows, pages, kv_len, **kw)),
                               rtol=1e-5, atol=1e-5)
    poisoned = run(pages.at[rows[0, 2:], 1].set(jnp.nan))  # 16-key pages: the first chunk's keys 32 and on
    np.testing.assert_array_equal(poisoned[0, :32], clean[0, :32])
    assert np.isnan(poisoned[0, 32:]).all()


def test_pallas_impls_take_the_kernel_where_it_applies(monkeypatch):
    """With DECODE_KERNEL on, impl "pallas_interpret" runs the kernel for bf16 pages and decode-sized groups, the
    XLA path otherwise (f32 pages; a prefill group's rows past DECODE_MAX_ROWS, until PREFILL_KERNEL); DECODE_KERNEL
    False turns it off."""
    monkeypatch.setattr(mla, "DECODE_KERNEL", True)
    monkeypatch.setattr(mla, "PREFILL_KERNEL", False)
    calls = []
    real = mla.mla_decode_mgpu
    monkeypatch.setattr(mla, "mla_decode_mgpu", lambda *a, **k: calls.append(k["interpret"]) or real(*a, **k))
    q, pos, rows, pages, kv_len = kernel_case(2, 1, 4, 16, 3)
    kw = dict(layer=0, scale=0.1, v_dim=KVD)
    mla.mla_paged_attention(q, pos, rows, pages, kv_len, impl="pallas_interpret", **kw)
    assert calls == [True]
    mla.mla_paged_attention(q, pos, rows, pages.astype(jnp.float32), kv_len, impl="pallas_interpret", **kw)
    big = jnp.zeros((2, 64, 4, KDK), jnp.float32)  # 256 rows a group: prefill-sized
    mla.mla_paged_attention(big, jnp.zeros((2, 64), jnp.int32), rows, pages, kv_len, impl="pallas_interpret", **kw)
    mla.mla_paged_attention(q, pos, rows, pages, kv_len, impl="xla", **kw)
    assert calls == [True]
    monkeypatch.setattr(mla, "PREFILL_KERNEL", True)  # prefill chunks too
    mla.mla_paged_attention(big, jnp.zeros((2, 64), jnp.int32), rows, pages, kv_len, impl="pallas_interpret", **kw)
    assert calls == [True, True]
    monkeypatch.setattr(mla, "DECODE_KERNEL", False)
    mla.mla_paged_attention(q, pos, rows, pages, kv_len, impl="pallas_interpret", **kw)
    mla.mla_paged_attention(big, jnp.zeros((2, 64), jnp.int32), rows, pages, kv_len, impl="pallas_interpret", **kw)
    assert calls == [True, True]


def test_decode_kernel_names_what_it_does_not_take(monkeypatch):
    monkeypatch.setattr(mla, "PREFILL_KERNEL", False)  # so a prefill-sized group is refused by its rows
    q, pos, rows, pages, kv_len = kernel_case(2, 1, 4, 16, 3)
    kw = dict(layer=0, scale=0.1, interpret=True)
    for args, v_dim, msg in (((q, pos, rows, pages.astype(jnp.float32), kv_len), KVD, "bfloat16"),
                             ((jnp.zeros((2, 40, 4, KDK)), pos, rows, pages, kv_len), KVD, "DECODE_MAX_ROWS"),
                             ((q, pos, rows, pages, kv_len), 96, "multiple of 128"),
                             ((q, pos, rows, pages[:, :, :12], kv_len), KVD, "page size 12")):
        with pytest.raises(ValueError, match=msg):
            mla.mla_decode_mgpu(*args, v_dim=v_dim, **kw)


def test_decode_layout(monkeypatch):
    assert mla.decode_layout(12) == (True, 3)  # decode: q's halves in one tile, three ring stages
    assert mla.decode_layout(96) == (False, 2)  # verify (8 x 12 rows)
    monkeypatch.setattr(mla, "DECODE_PACKED", False)
    assert mla.decode_layout(12) == (False, 2)
    monkeypatch.setattr(mla, "DECODE_PACKED", "yes")
    with pytest.raises(ValueError, match="DECODE_PACKED"):
        mla.decode_layout(12)


def test_decode_splits():
    assert mla.decode_splits(1, 16384) == 64  # batch 1: the most splits
    assert mla.decode_splits(64, 16384) == 2  # 64 groups x 2 splits x 2 halves: ~two waves of 132 CTAs
    assert mla.decode_splits(512, 16384) == 1
    assert mla.decode_splits(1, 64) == 1  # a short table: at least 4 blocks a split
    assert mla.decode_splits(64, 16384, ctas_per_split=1) == 4  # both value halves in one CTA


def test_decode_kernel_lowers_for_cuda(monkeypatch):
    """Lowering only (no GPU): the kernel lowers to the Mosaic GPU custom call at k3-mini's widths (12 heads,
    576-wide keys, 512-wide values) for decode at 64-token pages and verify (8 x 12 rows: two row blocks) at
    16-token pages, with and without splits, q's halves packed and not, on one and two warpgroups a CTA, and
    for prefill chunks (64 x 12 rows: 12 row blocks)."""
    import functools

    sd = jax.ShapeDtypeStruct
    monkeypatch.setattr(mla, "PREFILL_KERNEL", True)
    for G, C, ps, packed, wgs in ((64, 1, 64, None, 1), (64, 1, 64, False, 1), (4, 8, 16, None, 1), (4, 8, 16, True, 1),
                                  (1, 1, 128, None, 1), (64, 1, 64, None, 2), (4, 8, 16, None, 2), (4, 64, 64, None, 1)):
        P = 16384 // ps
        f = functools.partial(mla.mla_decode_mgpu, layer=1, scale=0.07, v_dim=512, packed=packed, warpgroups=wgs)
        try:
            e = jax.export.export(jax.jit(f), platforms=["cuda"])(
                sd((G, C, 12, 576), jnp.float32), sd((G, C), jnp.int32), sd((G, P), jnp.int32),
                sd((G * P + 1, 2, ps, 576), jnp.bfloat16), sd((G,), jnp.int32))
        except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Mosaic GPU dialect
            pytest.skip(f"Mosaic GPU lowering unavailable: {e}")
        assert "mosaic_gpu" in e.mlir_module()


def test_engine_tokens_with_the_decode_kernel(monkeypatch):
    """The engine's greedy tokens with the MLA decode and verify groups on the kernel (interpret mode; everything
    else on the XLA path) equal those without it (`engine_tokens_with_the_kernel`; tests/gpu runs the same on a
    GPU)."""
    engine_tokens_with_the_kernel(monkeypatch, "pallas_interpret", one_mla_layer=True)


def engine_tokens_with_the_kernel(monkeypatch, kernel_impl, spec_against_plain=True, one_mla_layer=False):
    """On a bf16 k3-tiny with the kernel's widths (192-wide keys: latent 128 + rope 64), the engine's greedy tokens
    with the MLA attention on the kernel (impl `kernel_impl`) equal those with its XLA path: the engine's padded
    decode rows and page tables through the kernel, and speculative verify blocks (5 queries a group) drafted by an
    oracle that is partly right, with the prefill chunks on the kernel as well (`PREFILL_KERNEL`). The speculative
    tokens are checked against plain decoding's, or with `spec_against_plain=False` against the same speculative
    run on the XLA path (on a GPU the default engine's speculative tokens may part from plain decoding's through
    GEMM row-count noise, which only the batch-invariant mode closes: tests/gpu/test_engine_gpu.py)."""
    from k3jax import LLM, SamplingParams
    from k3jax.api import Model
    from k3jax.config import preset
    from k3jax.model.init import init_params
    from k3jax.spec.drafter import OracleDrafter

    base = preset("k3-tiny").replace(dtype="bfloat16", kv_lora_rank=128, qk_rope_head_dim=64)
    if one_mla_layer:  # 4 layers, the last MLA: each step runs the interpreted kernel once, not twice (CPU time)
        base = base.replace(num_layers=4, full_attn_layers=(4,))
    params = init_params(base, 0)
    prompts = [list(range(100, 171))]  # 71 tokens: contexts of 3 key blocks
    monkeypatch.setattr(mla, "DECODE_KERNEL", True)
    monkeypatch.setattr(mla, "PREFILL_KERNEL", False)  # decode groups alone first; the prefill chunks below
    real = mla.mla_paged_attention
    rows = []  # the query rows of each call the kernel took

    def run(name, kernel, **kw):
        def attend(*a, impl, **k):
            if kernel and mla.decode_supported(a[0].shape, a[3].shape, a[3].dtype, k["v_dim"]):
                rows.append(a[0].shape[1])
            return real(*a, impl=kernel_impl if kernel else "xla", **k)

        monkeypatch.setattr(mla, "mla_paged_attention", attend)
        llm = LLM(Model(base.replace(name=name), params, None), page_size=16, max_running=2, max_seq_len=128,
                  prefill_chunk=64, single_bucket=True, **kw)
        out = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=5))]
        llm.check_invariants()
        return out, llm.stats

    want, _ = run("k3-tiny-mla-xla", False)
    got, _ = run("k3-tiny-mla-kernel", True)
    assert rows and set(rows) == {1}  # decode groups went through the kernel (prefill chunks stay on XLA)
    assert got == want
    oracle = OracleDrafter({tuple(p): o for p, o in zip(prompts, want)}, base.vocab_size)
    rows.clear()
    monkeypatch.setattr(mla, "PREFILL_KERNEL", True)  # and the prefill chunks (64 tokens a group) on it too
    got, stats = run("k3-tiny-mla-kernel-spec", True, speculative=oracle, num_draft_tokens=4)
    assert {5, 64} <= set(rows) and stats["spec_accepted"] > 0  # verify blocks of 1 + 4 queries a group, prefill
    if not spec_against_plain:
        want, _ = run("k3-tiny-mla-xla-spec", False, speculative=oracle, num_draft_tokens=4)
    assert got == want
