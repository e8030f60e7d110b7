"""The MLA attention's XLA path on the GPU (`pallas_kernels/mla.py`): the blocked form (keys in page blocks,
online softmax) with "static" and "needed" key blocks, and the dense one-pass form, against a float64 numpy
reference, at k3-mini's widths (12 heads, 576-wide keys, 512-wide values) with prefill-like (64 queries a
group) and decode-like (1 query a group) calls over contexts from empty to full; and the blocked form's
compiled temporaries against the dense form's. Bit equality of "static" and "needed" is what the
batch-invariant mode relies on (device call 30 times the two). The decode kernel (`mla.mla_decode_mgpu`) against
the same reference for decode (1 query a group) and verify (8 queries: two row blocks of 64 rows), with and
without key-range splits, and prefill chunks (64 queries a group: 12 row blocks, `PREFILL_KERNEL`), and a
NaN-poisoned page past a group's last visible block left unread; and the engine's greedy tokens with the kernel
against those with the XLA path."""

import numpy as np
import pytest

from tests.gpu import require_gpu

require_gpu()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import mla  # noqa: E402
from tests.test_mla import compiled_temps, engine_tokens_with_the_kernel  # noqa: E402
from tests.test_mla import test_bf16_halves_carry_17_bits as _bf16_halves_checks  # noqa: E402

pytestmark = pytest.mark.gpu

H, DK, VD, PS, P = 12, 576, 512, 16, 64  # 1,024 keys a group
SCALE = 192 ** -0.5  # k3-mini: (nope 128 + rope 64) ** -0.5


def _case(G, C, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((G, C, H, DK)), jnp.float32)
    pages = jnp.asarray(rng.standard_normal((G * P + 1, 2, PS, DK)), jnp.bfloat16)
    rows = jnp.asarray(rng.permutation(np.arange(1, G * P + 1)).reshape(G, P), jnp.int32)
    kv_len = rng.integers(0, P * PS + 1, G)
    kv_len[:3] = [0, 1, P * PS]  # empty, one key, full
    pos = kv_len[:, None] - C + np.arange(C)[None, :]  # the last C tokens of each context (prefill-like)
    pos = np.where(pos >= 0, pos, -1)  # no query where the context is shorter than C
    return q, jnp.asarray(pos, jnp.int32), rows, pages, jnp.asarray(kv_len, jnp.int32)


def _reference(q, pos, rows, pages, kv_len):
    q, pos, rows, kv_len = (np.asarray(a) for a in (q, pos, rows, kv_len))
    keys = np.asarray(pages[:, 1].astype(jnp.float32), np.float64)  # layer 1
    G, C = pos.shape
    out = np.zeros((G, C, H, VD))
    for g in range(G):
        k = keys[rows[g]].reshape(P * PS, DK)
        for c in range(C):
            n = min(kv_len[g], pos[g, c] + 1)
            if n <= 0:
                continue
            s = np.einsum("hd,sd->hs", q[g, c].astype(np.float64), k[:n]) * SCALE
            w = np.exp(s - s.max(-1, keepdims=True))
            out[g, c] = (w / w.sum(-1, keepdims=True)) @ k[:n, :VD]
    return out


@pytest.mark.parametrize("G,C", [(8, 64), (64, 1)])
def test_blocked_and_dense_against_float64(G, C):
    args = _case(G, C)
    want = _reference(*args)
    kw = dict(layer=1, scale=SCALE, v_dim=VD)
    outs = {}
    for name, fn in (("static", lambda *a: mla.mla_paged_attention_xla(*a, block_pages=4, blocks="static", **kw)),
                     ("needed", lambda *a: mla.mla_paged_attention_xla(*a, block_pages=4, blocks="needed", **kw)),
                     ("default", lambda *a: mla.mla_paged_attention_xla(*a, **kw)),
                     ("dense", lambda *a: mla.mla_paged_attention_ref(*a, **kw))):
        got = np.asarray(jax.jit(fn)(*args))
        assert np.isfinite(got).all(), name
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 5e-3, (name, err)
        outs[name] = got
    np.testing.assert_array_equal(outs["needed"], outs["static"])
    assert not outs["static"][0].any()  # an empty context gives zeros


def test_blocked_temporaries_stay_near_one_block(monkeypatch):
    """One block's temporaries and the carried sums, not the context's, and no f32 copy of the pool: the CPU's
    XLA moves the keys' convert ahead of their gather and out of the loop (1.2 GB for this 0.6 GB pool, seen
    in session 24), and this asks whether the GPU's does (device call 4's temporaries said no)."""
    monkeypatch.setattr(mla, "KEY_BLOCK_BYTES", 64 << 20)
    G, C, Pw = 64, 64, 256  # 4,096 keys a group
    temp = compiled_temps(G, C, H, DK, VD, G * Pw + 1, Pw, 2, PS)
    assert temp["dense"] >= G * C * H * Pw * PS * 4, temp  # every f32 score: 768 MiB
    assert temp["blocked"] <= 4 * (64 << 20) + 2 * G * C * H * VD * 4, temp


def test_bf16_halves_survive_xla_on_the_gpu():
    """XLA on the GPU drops an f32 -> bf16 -> f32 round trip (openxla/xla#41605), which once made q's lo half all
    zeros (session 26, device call 31): the CPU test's checks, run on the GPU."""
    _bf16_halves_checks()


@pytest.mark.parametrize("G,C,ps,splits,packed,wgs", [
    (64, 1, 16, None, None, 1), (64, 1, 64, 1, None, 1), (64, 1, 64, None, False, 1), (8, 8, 16, None, None, 1),
    (8, 8, 64, 2, True, 1), (3, 1, 64, 7, None, 1), (64, 1, 64, None, None, 2), (8, 8, 16, 3, None, 2),
    (8, 64, 64, None, None, 1), (8, 64, 16, 2, True, 2)])
def test_decode_kernel_against_float64(G, C, ps, splits, packed, wgs, monkeypatch):
    """Within 1e-4 of float64 (q and the weights in two bf16 halves: ~f32 arithmetic on the bf16 keys), where
    the XLA path's f32 products (TF32 on the tensor cores) are checked to 5e-3 above. C = 64: prefill chunks
    (64 x 12 rows, `PREFILL_KERNEL`), each row block stopping at its own last visible key."""
    monkeypatch.setattr(mla, "PREFILL_KERNEL", C * H > mla.DECODE_MAX_ROWS)
    q, pos, rows, pages, kv_len = _case(G, C, seed=1)
    want = _reference(q, pos, rows, pages, kv_len)
    if ps != PS:  # the same keys in pages of ps tokens (page 0, the sink, zeros)
        n = P * PS // ps
        keys = pages[rows].transpose(0, 2, 1, 3, 4).reshape(G, 2, n, ps, DK).transpose(0, 2, 1, 3, 4)
        pages = jnp.concatenate([jnp.zeros((1, 2, ps, DK), pages.dtype), keys.reshape(G * n, 2, ps, DK)])
        rows = jnp.arange(1, G * n + 1, dtype=jnp.int32).reshape(G, n)
    got = np.asarray(jax.jit(lambda *a: mla.mla_decode_mgpu(
        *a, layer=1, scale=SCALE, v_dim=VD, splits=splits, packed=packed, warpgroups=wgs))(
        q, pos, rows, pages, kv_len))
    assert np.isfinite(got).all()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err
    assert not got[0].any()  # an empty context gives zeros


def test_decode_kernel_reads_only_the_blocks_it_needs():
    q, pos, rows, pages, kv_len = _case(4, 1, seed=2)
    kv_len = jnp.array([0, 20, 33, 100], jnp.int32)
    pos = kv_len[:, None] - 1
    poisoned = pages.at[rows[:, 8:].reshape(-1), 1].set(jnp.nan)  # keys 128 and on: past every group's blocks
    for packed, wgs in ((True, 1), (False, 1), (True, 2)):
        f = jax.jit(lambda pages: mla.mla_decode_mgpu(q, pos, rows, pages, kv_len, layer=1, scale=SCALE, v_dim=VD,
                                                      packed=packed, warpgroups=wgs))
        np.testing.assert_array_equal(np.asarray(f(poisoned)), np.asarray(f(pages)))


def test_engine_tokens_with_the_kernel(monkeypatch):
    """tests/test_mla.py's engine check on the GPU (the kernel compiled, not interpreted; k3-tiny's widths made
    the kernel's, which tests/gpu/test_engine_gpu.py's k3-tiny lacks): the greedy tokens with the MLA attention
    on the kernel, for decode, verify and prefill groups, equal those with the XLA path in the same engine."""
    engine_tokens_with_the_kernel(monkeypatch, "pallas", spec_against_plain=False)
