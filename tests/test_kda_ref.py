"""KDA core: chunked == recurrent == an f64 numpy loop of DESIGN.md's recurrence; varlen and decode
entry points == the references per sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kda_chunk, kda_chunk_ref, kda_decode, kda_recurrent_ref
from pallas_kernels.kda.ref import kda_chunk_varlen_ref


def l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def make_inputs(rng, B, T, H, HV, K, V, lower=-5.0):
    q = l2(rng.normal(size=(B, T, H, K)))
    k = l2(rng.normal(size=(B, T, H, K)))
    v = rng.normal(size=(B, T, HV, V))
    g = lower / (1 + np.exp(-rng.normal(size=(B, T, HV, K))))  # safe gate range (lower, 0)
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, HV))))
    return q, k, v, g, beta


def numpy_loop(q, k, v, g, beta, S0=None):
    """DESIGN.md section 1, literally, in float64."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    S = np.zeros((B, HV, K, V)) if S0 is None else S0.astype(np.float64).copy()
    o = np.zeros((B, T, HV, V))
    scale = K**-0.5
    for b in range(B):
        for t in range(T):
            for h in range(HV):
                hq = h // (HV // H)
                S[b, h] = np.exp(g[b, t, h])[:, None] * S[b, h]
                kt = k[b, t, hq]
                S[b, h] = S[b, h] + beta[b, t, h] * np.outer(kt, v[b, t, h] - S[b, h].T @ kt)
                o[b, t, h] = S[b, h].T @ (scale * q[b, t, hq])
    return o, S


f32 = lambda *xs: [jnp.asarray(x, jnp.float32) for x in xs]


@pytest.mark.parametrize("T", [1, 63, 64, 100, 130])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])  # (H, HV): value-head groups when HV > H
def test_chunk_equals_recurrent_equals_numpy(T, with_state, heads):
    rng = np.random.default_rng(T * 7 + with_state)
    H, HV = heads
    K, V = 16, 8
    q, k, v, g, beta = make_inputs(rng, 2, T, H, HV, K, V)
    S0 = rng.normal(size=(2, HV, K, V)) if with_state else None
    o_np, S_np = numpy_loop(q, k, v, g, beta, S0)
    init = None if S0 is None else jnp.asarray(S0, jnp.float32)
    o_r, S_r = kda_recurrent_ref(*f32(q, k, v, g, beta), initial_state=init)
    o_c, S_c = kda_chunk_ref(*f32(q, k, v, g, beta), initial_state=init)
    assert o_r.dtype == jnp.float32 and S_c.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(S_c), np.asarray(S_r), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(o_r), o_np, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(S_r), S_np, atol=1e-5, rtol=0)


def test_chunk_strong_decay_no_overflow():
    """Softplus-gate models can decay by far more than exp(-88) within a chunk: no inf/NaN."""
    rng = np.random.default_rng(3)
    q, k, v, g, beta = make_inputs(rng, 1, 128, 2, 2, 16, 8)
    g = g * 40.0  # log decay down to -200 per step
    o_c, S_c = kda_chunk_ref(*f32(q, k, v, g, beta))
    o_r, S_r = kda_recurrent_ref(*f32(q, k, v, g, beta))
    assert np.isfinite(np.asarray(o_c)).all() and np.isfinite(np.asarray(S_c)).all()
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), atol=1e-5)


@pytest.mark.parametrize("align", [1, 8])
def test_varlen_chunk_matches_per_sequence(align):
    """align 8: chunk boxes on multiples of 8 packed rows (the Mosaic GPU path's table), so first
    chunks start with rows of the previous sequence masked to zero."""
    rng = np.random.default_rng(11)
    lens = [37, 0, 64, 1, 130, 5]
    H, HV, K, V = 2, 4, 16, 8
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + 9  # trailing padding tokens
    q, k, v, g, beta = make_inputs(rng, 1, T, H, HV, K, V)
    S0 = rng.normal(size=(len(lens), HV, K, V))
    if align == 1:  # the public entry point
        fn = jax.jit(lambda *a: kda_chunk(*a[:5], initial_state=a[5], cu_seqlens=a[6]))
    else:
        fn = jax.jit(lambda *a: kda_chunk_varlen_ref(*a[:5], None, a[5], a[6], 64, align))
    o, S = fn(*f32(q, k, v, g, beta, S0), jnp.asarray(cu))
    o, S = np.asarray(o), np.asarray(S)
    for i, n in enumerate(lens):
        a, b = cu[i], cu[i + 1]
        sl = lambda x: x[:, a:b]
        o_ref, S_ref = numpy_loop(sl(q), sl(k), sl(v), sl(g), sl(beta), S0[i : i + 1])
        np.testing.assert_allclose(o[:, a:b], o_ref, atol=2e-5)
        np.testing.assert_allclose(S[i], S_ref[0], atol=2e-5)
    assert not np.isnan(o).any()
    np.testing.assert_array_equal(o[:, cu[-1]:], 0.0)


def test_decode_updates_pool_in_place_by_slot():
    rng = np.random.default_rng(5)
    N, H, HV, K, V, L = 3, 2, 2, 16, 8, 2
    q, k, v, g, beta = (x[:, 0] for x in make_inputs(rng, N, 1, H, HV, K, V))
    pool = rng.normal(size=(6, L, HV, K, V)).astype(np.float32)
    slots = np.array([4, 1, 2], np.int32)
    reset = np.array([False, True, False])
    o, new_pool = kda_decode(*f32(q, k, v, g, beta), jnp.asarray(pool), jnp.asarray(slots), layer=1,
                             reset=jnp.asarray(reset))
    new_pool = np.asarray(new_pool)
    for i, s in enumerate(slots):
        S0 = np.zeros((1, HV, K, V)) if reset[i] else pool[s : s + 1, 1]
        o_ref, S_ref = numpy_loop(q[i : i + 1, None], k[i : i + 1, None], v[i : i + 1, None], g[i : i + 1, None],
                                  beta[i : i + 1, None], S0)
        np.testing.assert_allclose(np.asarray(o)[i], o_ref[0, 0], atol=1e-5)
        np.testing.assert_allclose(new_pool[s, 1], S_ref[0], atol=1e-5)
    untouched = [s for s in range(6) if s not in slots]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])
    np.testing.assert_array_equal(new_pool[:, 0], pool[:, 0])


def test_bad_impl_is_rejected():
    rng = np.random.default_rng(0)
    q, k, v, g, beta = f32(*make_inputs(rng, 1, 4, 1, 1, 8, 8))
    with pytest.raises(ValueError, match="impl"):
        kda_chunk(q, k, v, g, beta, impl="cuda")
