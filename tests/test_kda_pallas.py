"""Pallas KDA kernels on CPU: the portable kernels in interpret mode (`impl="pallas_interpret"`)
against the f32 jnp references at tiny shapes, on fresh random inputs; the Mosaic GPU kernels are
lowered for CUDA (no GPU needed) so API drift shows up in CI. GPU numerics: tests/gpu/."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.kda import kda_chunk, kda_decode, kda_recurrent_ref

IMPL = "pallas_interpret"


def l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def inputs(rng, lead, H, HV, K, V, lower=-5.0):
    f = lambda x: jnp.asarray(x, jnp.float32)
    q = f(l2(rng.normal(size=lead + (H, K))))
    k = f(l2(rng.normal(size=lead + (H, K))))
    v = f(rng.normal(size=lead + (HV, V)))
    g = f(lower / (1 + np.exp(-rng.normal(size=lead + (HV, K)))))
    beta = f(1 / (1 + np.exp(-rng.normal(size=lead + (HV,)))))
    return q, k, v, g, beta


def close(a, b, tol=2e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(a).all(), "non-finite values"
    np.testing.assert_allclose(a, b, atol=tol, rtol=0)


def test_auto_resolves_to_xla_on_cpu():
    assert resolve_impl("auto", "kda_decode") == "xla"
    assert resolve_impl("auto", "kda_chunk") == "xla"
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("triton", "kda_decode")


@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])
def test_decode_in_place_by_slot(heads):
    rng = np.random.default_rng()
    H, HV = heads
    N, K, V, NS, L = 3, 16, 8, 6, 2
    q, k, v, g, beta = inputs(rng, (N,), H, HV, K, V)
    pool = rng.normal(size=(NS, L, HV, K, V)).astype(np.float32)
    pool[3, 1] = np.nan  # a reset slot may hold anything: it must not be read
    slots = np.array([4, 3, 1], np.int32)
    reset = np.array([False, True, False])
    fn = jax.jit(functools.partial(kda_decode, layer=1, impl=IMPL), donate_argnums=(5,))
    o, new = fn(q, k, v, g, beta, jnp.asarray(pool), jnp.asarray(slots), reset=jnp.asarray(reset))
    new = np.asarray(new)
    for i, s in enumerate(slots):
        S0 = jnp.zeros((1, HV, K, V)) if reset[i] else jnp.asarray(pool[s : s + 1, 1])
        o_r, S_r = kda_recurrent_ref(*(x[i : i + 1, None] for x in (q, k, v, g, beta)), initial_state=S0)
        close(o[i], o_r[0, 0])
        close(new[s, 1], S_r[0])
    untouched = [s for s in range(NS) if s not in slots]
    np.testing.assert_array_equal(new[untouched], pool[untouched])
    np.testing.assert_array_equal(new[:, 0], pool[:, 0])


def test_decode_matches_xla_path_without_reset():
    rng = np.random.default_rng()
    N, H, HV, K, V = 2, 1, 2, 16, 16
    q, k, v, g, beta = inputs(rng, (N,), H, HV, K, V)
    pool = jnp.asarray(rng.normal(size=(4, 1, HV, K, V)), jnp.float32)
    slots = jnp.array([2, 0], jnp.int32)
    o_x, p_x = kda_decode(q, k, v, g, beta, pool, slots, layer=0, scale=0.3)
    o_p, p_p = kda_decode(q, k, v, g, beta, pool, slots, layer=0, scale=0.3, impl=IMPL)
    close(o_p, o_x)
    close(p_p, p_x)


def test_varlen_chunk_empty_and_short_sequences():
    """Packed sequences incl. empty and 1-token ones, lengths not multiples of 64, padding."""
    rng = np.random.default_rng()
    lens = [37, 0, 64, 1, 70]
    H, HV, K, V = 2, 4, 16, 8
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + 5  # trailing padding tokens
    q, k, v, g, beta = inputs(rng, (1, T), H, HV, K, V)
    S0 = jnp.asarray(rng.normal(size=(len(lens), HV, K, V)), jnp.float32)
    fn = jax.jit(lambda *a: kda_chunk(*a[:5], initial_state=a[5], cu_seqlens=a[6], impl=IMPL))
    o, S = fn(q, k, v, g, beta, S0, jnp.asarray(cu))
    o = np.asarray(o)
    for i, n in enumerate(lens):
        a, b = cu[i], cu[i + 1]
        o_r, S_r = kda_recurrent_ref(*(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=S0[i : i + 1])
        close(o[:, a:b], o_r)
        close(S[i], S_r[0])
    assert np.isfinite(o).all()
    np.testing.assert_array_equal(o[:, cu[-1]:], 0.0)


def test_dense_chunk_with_state():
    rng = np.random.default_rng()
    B, T, H, HV, K, V = 2, 70, 1, 2, 16, 8
    q, k, v, g, beta = inputs(rng, (B, T), H, HV, K, V)
    S0 = jnp.asarray(rng.normal(size=(B, HV, K, V)), jnp.float32)
    o, S = kda_chunk(q, k, v, g, beta, initial_state=S0, impl=IMPL)
    o_r, S_r = kda_recurrent_ref(q, k, v, g, beta, initial_state=S0)
    close(o, o_r)
    close(S, S_r)


@pytest.mark.parametrize("impl", ["xla", IMPL])
def test_varlen_chunk_snapshot_at_a_token(impl):
    """snapshot_at: the state after the first a tokens of each sequence (a anywhere: 0, inside a
    chunk, on a chunk boundary, the whole sequence, past its end (clipped), none), next to the
    unchanged outputs and final states."""
    rng = np.random.default_rng()
    lens = [37, 0, 130, 1, 70, 64]
    at = [5, 0, 64, 1, 500, -1]
    H, HV, K, V = 2, 4, 16, 8
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + 5
    q, k, v, g, beta = inputs(rng, (1, T), H, HV, K, V)
    S0 = jnp.asarray(rng.normal(size=(len(lens), HV, K, V)), jnp.float32)
    fn = jax.jit(lambda *a: kda_chunk(*a[:5], initial_state=a[5], cu_seqlens=a[6], snapshot_at=a[7], impl=impl))
    o, S, snap = fn(q, k, v, g, beta, S0, jnp.asarray(cu), jnp.asarray(at, jnp.int32))
    o_p, S_p = kda_chunk(q, k, v, g, beta, initial_state=S0, cu_seqlens=jnp.asarray(cu), impl=impl)
    close(o, o_p)
    close(S, S_p)
    for i, (n, a) in enumerate(zip(lens, at)):
        if a < 0:
            np.testing.assert_array_equal(snap[i], 0.0)
            continue
        s = cu[i]
        e = s + min(a, n)
        _, S_r = kda_recurrent_ref(*(x[:, s:e] for x in (q, k, v, g, beta)), initial_state=S0[i : i + 1])
        close(snap[i], S_r[0])
    # dense inputs take one entry per batch row
    qd, kd, vd, gd, bd = (x[:, :128].reshape((2, 64) + x.shape[2:]) for x in (q, k, v, g, beta))
    _, Sd, snapd = kda_chunk(qd, kd, vd, gd, bd, initial_state=S0[:2], snapshot_at=jnp.array([10, 64]), impl=impl)
    _, S_r = kda_recurrent_ref(*(x[:1, :10] for x in (qd, kd, vd, gd, bd)), initial_state=S0[:1])
    close(snapd[0], S_r[0])
    close(snapd[1], Sd[1])
    with pytest.raises(ValueError, match="one entry per sequence"):
        kda_chunk(qd, kd, vd, gd, bd, snapshot_at=jnp.array([1, 2, 3]), impl=impl)


@pytest.mark.parametrize("impl", ["xla", IMPL])
def test_chunk_pool_reads_and_writes_states_by_slot(impl):
    """kda_chunk_pool: states read from the pool by slot (a reset slot is never read: NaN there),
    final states and snapshots written back by slot, every other row untouched bit for bit."""
    from pallas_kernels.kda import kda_chunk_pool

    rng = np.random.default_rng()
    lens = [37, 0, 70, 1]
    H, HV, K, V, NS, L = 2, 4, 16, 8, 9, 2
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + 3
    q, k, v, g, beta = inputs(rng, (1, T), H, HV, K, V)
    pool = rng.normal(size=(NS, L, HV, K, V)).astype(np.float32)
    slots = np.array([5, 2, 7, 0], np.int32)
    reset = np.array([False, False, True, False])
    pool[7, 1] = np.nan
    at, snap_slots = np.array([20, -1, 64, 1], np.int32), np.array([1, 8, 3, 6], np.int32)
    fn = jax.jit(lambda *a: kda_chunk_pool(*a[:6], a[6], layer=1, cu_seqlens=a[7], reset=a[8], snapshot_at=a[9],
                                           snapshot_slots=a[10], impl=impl), donate_argnums=(5,))
    o, new = fn(q, k, v, g, beta, jnp.asarray(pool), jnp.asarray(slots), jnp.asarray(cu), jnp.asarray(reset),
                jnp.asarray(at), jnp.asarray(snap_slots))
    new = np.asarray(new)
    S0 = jnp.asarray(np.where(reset[:, None, None, None], 0.0, pool[slots, 1]))
    o_r, S_r, snap_r = kda_chunk(q, k, v, g, beta, initial_state=S0, cu_seqlens=jnp.asarray(cu),
                                 snapshot_at=jnp.asarray(at), impl="xla")
    close(o, o_r)
    close(new[slots, 1], S_r)
    has = at >= 0
    close(new[snap_slots[has], 1], np.asarray(snap_r)[has])
    written = set(slots) | set(snap_slots[has])
    untouched = [s for s in range(NS) if s not in written]
    np.testing.assert_array_equal(new[untouched], pool[untouched])
    np.testing.assert_array_equal(new[:, 0], pool[:, 0])
    with pytest.raises(ValueError, match="go together"):
        kda_chunk_pool(q, k, v, g, beta, jnp.asarray(pool), slots, layer=1, cu_seqlens=jnp.asarray(cu),
                       snapshot_at=jnp.asarray(at), impl=impl)


@pytest.mark.parametrize("gate", [0.05, 1.0, 30.0])
def test_matmul_form_prep_matches_reference(gate):
    """`prep.chunk_prep` (the algorithm of the GPU prep kernel: level-factored pair scores, blocked
    Neumann inverse) equals the reference's intra-chunk part, for weak gates up to gates where
    every decay across a few tokens underflows (no inf or NaN from the factored exponentials)."""
    from pallas_kernels.kda.prep import chunk_prep
    from pallas_kernels.kda.ref import _chunk_intra

    rng = np.random.default_rng(int(gate * 100))
    n, C, K, V = 3, 64, 32, 16
    l2 = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = jnp.asarray(l2(rng.normal(size=(n, C, K))) * K**-0.5, jnp.float32)
    k = jnp.asarray(l2(rng.normal(size=(n, C, K))), jnp.float32)
    k = k.at[0].set(k[0, :1])  # one chunk of identical keys, beta 1, no decay: the worst-conditioned solve
    v = jnp.asarray(rng.normal(size=(n, C, V)), jnp.float32)
    g = -gate * jnp.asarray(np.log1p(np.exp(rng.normal(size=(n, C, K)))), jnp.float32)
    g = g.at[0].set(0.0)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(n, C)))), jnp.float32).at[0].set(1.0)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(chunk_prep)(q, k, v, g, beta)
        want = jax.jit(_chunk_intra)(q, k, v, g, beta)
    for name, a, b in zip(("w", "u0", "Aqk", "qg", "kd", "gl"), got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(a).all(), name
        for c in range(n):  # per chunk: the ill-conditioned one lands near 4e-4, the others near 1e-6
            err = np.linalg.norm(a[c] - b[c]) / max(np.linalg.norm(b[c]), 1e-30)
            assert err < (2e-3 if c == 0 else 1e-4), (name, c, err)


@pytest.mark.parametrize("prep", ["mgpu", "mgpu_loop"])
def test_prep_kernel_in_interpret_mode(prep):
    """The Mosaic GPU prep kernel itself, run by Mosaic GPU interpret mode on the CPU, gives the
    XLA prep's chunk operands: varlen with an empty sequence, partial chunks, padding tokens and
    two value heads per q/k head (the same check tests/gpu runs on the H200)."""
    from pallas_kernels.kda import mgpu

    rng = np.random.default_rng(7)
    lens = [5, 0, 64, 70]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    T, H, HV, K, V = int(cu[-1]) + 3, 1, 2, 64, 64
    q, k, v, g, beta = inputs(rng, (1, T), H, HV, K, V)
    q, k, v, beta = (x.astype(jnp.bfloat16) for x in (q, k, v, beta))
    # NaN padding tokens: chunk boxes reach into them, and the kernel must mask them out
    q, k, v, g, beta = (x.at[:, int(cu[-1]):].set(jnp.nan) for x in (q, k, v, g, beta))
    args = (q, k, v, g, beta, None, cu)
    got = mgpu.chunk_operands(*args, scale=None, interpret=True, prep=prep)
    with jax.default_matmul_precision("highest"):
        want = mgpu.chunk_operands(*args, scale=None, prep="xla")
    _assert_operands_close(got, want)


def _assert_operands_close(got, want):
    """The prep kernel's chunk operands (`mgpu.chunk_operands`) against the XLA prep's, over the live
    chunks of the sequences [5, 0, 64, 70]: chunk boxes on multiples of 8 rows, so sequences 3 and 4
    start at rows 5 and 69 and take 2 chunks each (the first with 5 rows of the previous sequence,
    zeroed), then one chunk of padding tokens (zero operands)."""
    live = np.asarray(got[-1]) > 0
    assert live.sum() == 6
    for name, a, b in zip(("w", "qg", "kdT", "aqk", "u0", "gl"), got[:6], want[:6]):
        a, b = (np.asarray(x.astype(jnp.float32), np.float64)[live] for x in (a, b))
        assert np.isfinite(a).all(), name
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2, name


def _fused_inputs(rng, lead, H, HV, K, V, lower_bound):
    """Raw inputs of a chunk that fuses the gate and the L2 norm: q, k of assorted row lengths, the
    gate logits f (bf16, as the model's projection gives them) and the `Gate`."""
    from pallas_kernels.kda import Gate

    q, k, v, _, beta = inputs(rng, lead, H, HV, K, V)
    q = q * jnp.asarray(rng.uniform(0.2, 6, size=lead + (H, 1)), jnp.float32)
    k = k * jnp.asarray(rng.uniform(0.2, 6, size=lead + (H, 1)), jnp.float32)
    f = jnp.asarray(rng.normal(size=lead + (HV, K)) * 2, jnp.bfloat16)
    gate = Gate(jnp.asarray(rng.normal(size=HV), jnp.float32), jnp.asarray(rng.normal(size=HV * K), jnp.float32),
                lower_bound)
    return q, k, v, f, beta, gate


def _gate_numpy(f, gate):
    """The log decay from the logits in float64 numpy (an independent check of `ref.kda_gate_ref`)."""
    HV, K = f.shape[-2:]
    x = np.asarray(f, np.float64) + np.asarray(gate.dt_bias, np.float64).reshape(HV, K)
    a = np.exp(np.asarray(gate.a_log, np.float64))[:, None]
    if gate.lower_bound is None:
        return -a * np.logaddexp(0.0, x)
    return gate.lower_bound / (1.0 + np.exp(-a * x))


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_prep_kernel_fuses_gate_and_l2norm(lower_bound):
    """The Mosaic GPU prep kernel with the gate and the L2 norm fused (`gate=`, `qk_l2norm=True`: it
    loads bf16 gate logits and raw q, k), in Mosaic GPU interpret mode, gives the chunk operands of
    the XLA prep on the gate and the norms computed first (`ref.fused_inputs_ref`), for both gate
    forms; NaN padding tokens stay masked."""
    from pallas_kernels.kda import mgpu
    from pallas_kernels.kda.ref import fused_inputs_ref

    rng = np.random.default_rng(11)
    lens = [5, 0, 64, 70]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    T, H, HV, K, V = int(cu[-1]) + 3, 1, 2, 64, 64
    q, k, v, f, beta, gate = _fused_inputs(rng, (1, T), H, HV, K, V, lower_bound)
    f = f.at[:, 70:110].set(30.0)  # saturated: decays at the bound
    q, k, v, beta = (x.astype(jnp.bfloat16) for x in (q, k, v, beta))
    q, k, v, f, beta = (x.at[:, int(cu[-1]):].set(jnp.nan) for x in (q, k, v, f, beta))
    got = mgpu.chunk_operands(q, k, v, f, beta, None, cu, scale=None, interpret=True, gate=gate, qk_l2norm=True)
    qr, kr, gr = fused_inputs_ref(q, k, f, gate, True)
    np.testing.assert_allclose(np.asarray(gr[0, :5]), _gate_numpy(f[0, :5], gate), rtol=1e-5, atol=1e-6)
    with jax.default_matmul_precision("highest"):
        want = mgpu.chunk_operands(qr, kr, v, gr, beta, None, cu, scale=None, prep="xla")
    _assert_operands_close(got, want)


@pytest.mark.parametrize("impl", ["xla", IMPL])
def test_chunk_entry_points_fuse_gate_and_l2norm(impl):
    """`kda_chunk` and `kda_chunk_pool` with `gate=` and `qk_l2norm=True` (what the GPU prep kernel
    fuses; here computed first) against the token recurrence on the gate and norms computed in
    float64 numpy, varlen with an empty sequence, with a snapshot, and in the pool by slot."""
    from pallas_kernels.kda import kda_chunk_pool

    rng = np.random.default_rng(12)
    lens = [3, 0, 70]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    N, T, H, HV, K, V = len(lens), int(cu[-1]), 1, 2, 16, 8
    q, k, v, f, beta, gate = _fused_inputs(rng, (1, T), H, HV, K, V, -5.0)
    h0 = jnp.asarray(rng.normal(size=(N, HV, K, V)) * 0.1, jnp.float32)
    gn = jnp.asarray(_gate_numpy(f, gate), jnp.float32)
    qn, kn = (jnp.asarray(l2(np.asarray(x, np.float64)), jnp.float32) for x in (q, k))
    want_o, want_h = [], []
    for i in range(N):
        s = slice(int(cu[i]), int(cu[i + 1]))
        o_i, h_i = kda_recurrent_ref(qn[:, s], kn[:, s], v[:, s], gn[:, s], beta[:, s], initial_state=h0[i:i + 1])
        want_o.append(o_i)
        want_h.append(h_i[0])
    want_o = jnp.concatenate(want_o, axis=1)
    o, ht, snap = kda_chunk(q, k, v, f, beta, initial_state=h0, cu_seqlens=cu, snapshot_at=jnp.asarray([1, -1, 64]),
                            gate=gate, qk_l2norm=True, impl=impl)
    close(o, want_o, 1e-4)
    for i in range(N):
        close(ht[i], want_h[i], 1e-4)
    _, want_snap = kda_recurrent_ref(qn[:, 3:67], kn[:, 3:67], v[:, 3:67], gn[:, 3:67], beta[:, 3:67],
                                     initial_state=h0[2:3])
    close(snap[2], want_snap[0], 1e-4)
    pool = jnp.zeros((5, 2, HV, K, V), jnp.float32).at[jnp.asarray([4, 0, 2]), 1].set(h0)
    o, p = kda_chunk_pool(q, k, v, f, beta, pool, jnp.asarray([4, 0, 2]), layer=1, cu_seqlens=cu, gate=gate,
                          qk_l2norm=True, impl=impl)
    close(o, want_o, 1e-4)
    for i, sl in enumerate([4, 0, 2]):
        close(p[sl, 1], want_h[i], 1e-4)


def test_prep_ablation_variants_apply():
    """bench/kda_prep_ablation.py builds each variant of the prep kernel by exact text substitution in
    mgpu.py: every substitution still finds its text (a kernel refactor must update them)."""
    from bench import kda_prep_ablation

    for name in kda_prep_ablation.VARIANTS:
        assert hasattr(kda_prep_ablation.build(name), "_chunk_prep_call"), name


@pytest.fixture
def lowered_modules(monkeypatch):
    """The text of every Mosaic GPU module lowered while the test runs (a hook on Mosaic GPU's serde
    pass), in order: what `_export_cuda` produced, before LLVM."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    texts = []
    serde = mgpu_core._run_serde_pass

    def record(module, **kw):
        texts.append(str(module))
        return serde(module, **kw)

    monkeypatch.setattr(mgpu_core, "_run_serde_pass", record)
    return texts


def test_fused_prep_reads_logits_not_g(lowered_modules):
    """Lowered for CUDA, the prep kernel with the gate and the L2 norm fused reads the bf16 gate
    logits (no f32 [R, HV, K] input: g is never materialised) and normalises q and k itself (rsqrt,
    one per row of each); without them it reads the f32 log decay."""
    from pallas_kernels.kda import Gate, mgpu

    sd = jax.ShapeDtypeStruct
    H, HV, K, V, T = 2, 4, 128, 128, 203
    bf = jnp.bfloat16
    g_in = f"memref<208x{HV}x{K}x"  # the g / logits input, rows padded to a multiple of 8
    # unfused; fused with the softplus gate; fused with K3's lower-bound gate
    for fused, lb in ((False, None), (True, None), (True, -5.0)):
        kw = {"gate": Gate(jnp.zeros(HV), jnp.zeros(HV * K), lb), "qk_l2norm": True} if fused else {}
        lowered_modules.clear()
        _export_cuda(functools.partial(mgpu.chunk, scale=K**-0.5, **kw), sd((1, T, H, K), bf), sd((1, T, H, K), bf),
                     sd((1, T, HV, V), bf), sd((1, T, HV, K), bf if fused else jnp.float32), sd((1, T, HV), bf),
                     sd((3, HV, K, V), jnp.float32), sd((4,), jnp.int32))
        prep = next(t for t in lowered_modules if "kda_chunk_prep_mgpu" in t)
        assert (g_in + "f32>" in prep) != fused  # (v is the other bf16 [208, 4, 128] input)
        assert ("rsqrt" in prep) == fused


@pytest.mark.parametrize("vt,tiles,auto_barriers,ctas", [(64, 1, True, None), (32, 4, True, None), (64, 2, True, None),
                                                          (64, None, True, None), (64, 2, False, None),
                                                          (32, 1, False, None), (64, None, False, 5),
                                                          (32, 1, True, 1), (64, 1, False, 100)])
def test_decode_kernel_in_interpret_mode(vt, tiles, auto_barriers, ctas):
    """The Mosaic GPU decode kernel itself (its TMA loads by slot, barriers, V tiles per CTA and
    stores), run by Mosaic GPU interpret mode on the CPU, against the f32 reference: bf16 inputs,
    two value heads per q/k head, a reset slot holding NaN (never read), untouched slots unchanged.
    ctas: the persistent form (5 CTAs for 12 tiles: 3, 3, 2, 2, 2 each; one CTA for all 24 32-wide
    tiles; 100, more CTAs than tiles)."""
    from pallas_kernels.kda import mgpu
    from pallas_kernels.kda.ref import kda_decode_ref

    rng = np.random.default_rng(3)
    N, H, HV, K, V = 3, 1, 2, 64, 128
    q, k, v, g, beta = inputs(rng, (N,), H, HV, K, V)
    q, k, v, beta = (x.astype(jnp.bfloat16) for x in (q, k, v, beta))
    pool = jnp.asarray(rng.normal(size=(5, 2, HV, K, V)) * 0.05, jnp.float32)
    slots = jnp.asarray([4, 0, 2], jnp.int32)
    reset = jnp.asarray([False, True, False])
    pool = pool.at[0, 1].set(jnp.nan)
    with jax.default_matmul_precision("highest"):
        o_r, p_r = kda_decode_ref(*(x.astype(jnp.float32) for x in (q, k, v, g, beta)), pool, slots, layer=1,
                                  reset=reset, scale=K**-0.5)
    o, p = mgpu.decode(q, k, v, g, beta, pool, slots, reset, layer=1, scale=K**-0.5, vt=vt, tiles=tiles,
                       api="scatter", auto_barriers=auto_barriers, ctas=ctas, interpret=True)
    close(o, o_r)
    close(p[slots, 1], p_r[slots, 1])
    np.testing.assert_array_equal(np.asarray(p)[[1, 3]], np.asarray(pool)[[1, 3]])
    np.testing.assert_array_equal(np.asarray(p)[:, 0], np.asarray(pool)[:, 0])


def test_dense_decode_in_interpret_mode():
    """`mgpu.decode(slots=None)`, the dense form the bench times against fla's dense decode: sequence n
    steps pool[n] (the slot form's result with slots 0..N-1, bit for bit), the pool's other rows and
    layers untouched; the form refuses a pool with fewer than N slots and the persistent form."""
    from pallas_kernels.kda import mgpu

    rng = np.random.default_rng(5)
    N, H, HV, K, V = 2, 1, 2, 64, 64
    q, k, v, g, beta = inputs(rng, (N,), H, HV, K, V)
    pool = jnp.asarray(rng.normal(size=(3, 2, HV, K, V)) * 0.05, jnp.float32)
    reset = jnp.asarray([False, True])
    kw = dict(layer=1, scale=K**-0.5, api="scatter", interpret=True)
    o_d, p_d = mgpu.decode(q, k, v, g, beta, pool, None, reset, **kw)
    o_s, p_s = mgpu.decode(q, k, v, g, beta, pool, jnp.arange(N, dtype=jnp.int32), reset, **kw)
    np.testing.assert_array_equal(np.asarray(o_d), np.asarray(o_s))
    np.testing.assert_array_equal(np.asarray(p_d), np.asarray(p_s))
    assert not np.array_equal(np.asarray(p_d[:N, 1]), np.asarray(pool[:N, 1]))
    np.testing.assert_array_equal(np.asarray(p_d)[N:], np.asarray(pool)[N:])
    np.testing.assert_array_equal(np.asarray(p_d)[:, 0], np.asarray(pool)[:, 0])
    with pytest.raises(ValueError, match="pool of >= N = 2 slots"):
        mgpu.decode(q, k, v, g, beta, pool[:1], None, reset, **kw)
    with pytest.raises(ValueError, match="grid form only"):
        mgpu.decode(q, k, v, g, beta, pool, None, reset, ctas=2, **kw)


def test_decode_tiles_rule():
    """decode's default V tiles per CTA: two while the one-tile grid is one to two CTAs per SM (133 to
    264), where V holds two tiles, else one; 32-wide tiles while that grid fits in one CTA per SM; the
    automatic barriers only where the layout needs them."""
    from pallas_kernels.kda import mgpu

    assert mgpu.decode_tiles(1, 12, 128) == 1  # 24 CTAs
    assert mgpu.decode_tiles(66, 1, 128) == 1  # 132 CTAs: still one per SM
    assert mgpu.decode_tiles(67, 1, 128) == 2
    assert mgpu.decode_tiles(1, 96, 128) == 2  # 192 CTAs of one tile
    assert mgpu.decode_tiles(132, 1, 128) == 2 and mgpu.decode_tiles(133, 1, 128) == 1  # 264 / 266
    assert mgpu.decode_tiles(256, 12, 128) == 1
    assert mgpu.decode_tiles(2, 96, 64) == 1  # V holds one 64-wide tile
    assert mgpu.decode_tiles(3, 12, 128, vt=32) == 2  # 144 CTAs of 32 columns
    assert mgpu.decode_auto_barriers(None, 128, 64) is False  # colwarp at vt 64
    assert mgpu.decode_auto_barriers(None, 128, 32) is True  # colwarp's replicated warps
    assert mgpu.decode_auto_barriers("wgmma", 128, 64) is True
    # and 32-wide tiles while that grid fits (colwarp layout), else 64
    assert mgpu.decode_vt(1, 12, 128) == 32  # 48 CTAs
    assert mgpu.decode_vt(33, 1, 128) == 32 and mgpu.decode_vt(34, 1, 128) == 64  # 132 / 136 CTAs
    assert mgpu.decode_vt(1, 96, 128) == 64
    assert mgpu.decode_vt(1, 12, 128, layout="wgmma") == 64
    # "colwarp8" runs vt 32 at every grid, in all three recurrent kernels, with no replicas to wait for
    assert mgpu.decode_vt(1024, 96, 128, layout="colwarp8") == 32
    assert mgpu.step_vt("colwarp8", 128) == 32 and mgpu.step_vt(None, 128) == 64 and mgpu.step_vt(None, 32) == 32
    assert mgpu.decode_auto_barriers("colwarp8", 128, 32) is False
    assert [mgpu.layout_label(lay, 128, vt) for lay, vt in ((None, 32), (None, 64), (None, 128), ("colwarp8", 32))] == [
        "colwarp_replicated", "colwarp", "wgmma", "colwarp8"]
    with pytest.raises(NotImplementedError, match="colwarp8 layout needs vt in"):
        mgpu.step_layouts("colwarp8", 128, 64)
    with pytest.raises(ValueError, match="unknown state tile layout"):
        mgpu.step_layouts("colwarp4", 128, 64)


def _float_ops(module_text):
    """The float arithmetic and shuffles of a lowered Mosaic GPU module, in order, without operands."""
    return re.findall(r"= (arith\.(?:addf|subf|mulf|divf)|math\.\w+|nvvm\.shfl\.sync \w+)", module_text)


def test_decode_vt32_steps_as_vt64(lowered_modules):
    """decode at vt 32 (the colwarp layout's replicated warps) lowers to the same float operations in
    the same order as at vt 64, so each column is reduced alike (the GPU test checks the bits);
    without the automatic barriers it keeps one per tile before the stores (its replicas share
    state elements), and vt 64 none."""
    from pallas_kernels.kda import mgpu

    sd = jax.ShapeDtypeStruct
    N, H, K, V = 1, 12, 128, 128
    f32 = jnp.float32
    args = (sd((N, H, K), f32), sd((N, H, K), f32), sd((N, H, V), f32), sd((N, H, K), f32), sd((N, H), f32),
            sd((1, 1, H, K, V), f32), sd((N,), jnp.int32), sd((N,), bool))
    ops, bars = {}, {}
    for vt, auto in itertools.product((32, 64), (True, False)):
        _export_cuda(functools.partial(mgpu.decode, layer=0, scale=K**-0.5, vt=vt, tiles=1, layout="colwarp",
                                       auto_barriers=auto), *args)
        ops[vt, auto], bars[vt, auto] = _float_ops(lowered_modules[-1]), lowered_modules[-1].count("bar.sync")
    assert len(ops[64, True]) > 100 and ops[32, True] == ops[64, True] == ops[32, False] == ops[64, False]
    assert bars[32, False] == bars[64, False] + 1 < bars[32, True], bars


@pytest.mark.parametrize("layout", ["colwarp", "colwarp8"])
def test_verify_steps_as_decode(layout, lowered_modules):
    """The verify kernel's float arithmetic and reduction shuffles are the decode kernel's, T times
    over, in each colwarp layout at its default V tile (what lets verify + fold reproduce decode bit for
    bit: tests/gpu checks the bits). The scalar broadcasts (shuffle idx) differ and are left out."""
    from pallas_kernels.kda import mgpu
    from pallas_kernels.kda import spec_kernels as sk

    sd = jax.ShapeDtypeStruct
    N, T, H, K, V = 2, 8, 4, 128, 128
    f32 = jnp.float32
    arith = lambda text: [op for op in _float_ops(text) if op != "nvvm.shfl.sync idx"]
    _export_cuda(functools.partial(mgpu.decode, layer=0, scale=1.0, tiles=1, layout=layout, vt=mgpu.step_vt(layout, V)),
                 sd((N, H, K), f32), sd((N, H, K), f32), sd((N, H, V), f32), sd((N, H, K), f32), sd((N, H), f32),
                 sd((N, 1, H, K, V), f32), sd((N,), jnp.int32), sd((N,), bool))
    dec = arith(lowered_modules[-1])
    vec = lambda X: sd((N, T, H, X), f32)
    _export_cuda(functools.partial(sk.verify_mgpu, layout=layout, auto_barriers=False), vec(K), vec(K), vec(V), vec(K),
                 sd((N, T, H), f32), sd((N * H, K, V), f32), sd((N,), jnp.int32), sd((N,), jnp.int32))
    assert len(dec) > 100 and arith(lowered_modules[-1]) == dec * T


def test_persistent_decode_steps_as_the_grid_form(lowered_modules):
    """The persistent decode (`ctas`) lowers to the grid form's float operations for one tile, in the same
    order (its loop body steps one tile through the same `step_tile` in the same layout), at vt 64 without
    the automatic barriers and at vt 32 (replicated warps) with them; tests/gpu checks the bits. The
    scalar broadcasts (shuffle idx) differ and are left out."""
    from pallas_kernels.kda import mgpu

    sd = jax.ShapeDtypeStruct
    N, H, HV, K, V = 4, 2, 4, 128, 128
    bf, f32 = jnp.bfloat16, jnp.float32
    args = (sd((N, H, K), bf), sd((N, H, K), bf), sd((N, HV, V), bf), sd((N, HV, K), f32), sd((N, HV), bf),
            sd((6, 2, HV, K, V), f32), sd((N,), jnp.int32), sd((N,), bool))
    for vt, auto in ((64, False), (32, True)):
        ops = {}
        for ctas in (None, 7):
            dec = functools.partial(mgpu.decode, layer=1, scale=K**-0.5, api="scatter", vt=vt, tiles=1, ctas=ctas,
                                    auto_barriers=auto)
            _export_cuda(dec, *args)
            assert ("kda_decode_persistent_mgpu" in lowered_modules[-1]) == (ctas is not None)
            ops[ctas] = [op for op in _float_ops(lowered_modules[-1]) if op != "nvvm.shfl.sync idx"]
        assert len(ops[None]) > 100 and ops[7] == ops[None], vt
    with pytest.raises(ValueError, match="tiles must be 1"):
        mgpu.decode(*(jnp.zeros(a.shape, a.dtype) for a in args), layer=1, scale=1.0, tiles=2, ctas=4)


def test_decode_without_auto_barriers_drops_them(lowered_modules):
    """`mgpu.decode(auto_barriers=False)` lowers with `unsafe_no_auto_barriers`: the Mosaic GPU
    module keeps only the barriers of commit_smem (one per tile) and the prologue, where Pallas
    otherwise puts a warpgroup barrier before and after every SMEM store."""
    from pallas_kernels.kda import mgpu

    sd = jax.ShapeDtypeStruct
    N, H, HV, K, V = 4, 2, 4, 128, 128
    bf = jnp.bfloat16
    count = {}
    for tiles, auto in itertools.product((1, 2), (True, False)):
        dec = functools.partial(mgpu.decode, layer=1, scale=K**-0.5, vt=64, tiles=tiles, auto_barriers=auto)
        _export_cuda(dec, sd((N, H, K), bf), sd((N, H, K), bf), sd((N, HV, V), bf), sd((N, HV, K), jnp.float32),
                     sd((N, HV), bf), sd((6, 2, HV, K, V), jnp.float32), sd((N,), jnp.int32), sd((N,), bool))
        count[tiles, auto] = lowered_modules[-1].count("bar.sync")
    for tiles in (1, 2):
        assert count[tiles, False] <= tiles + 1 < count[tiles, True], count


def _export_cuda(f, *args):
    try:
        return jax.export.export(jax.jit(f), platforms=["cuda"])(*args)
    except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Mosaic GPU dialect
        pytest.skip(f"Mosaic GPU lowering unavailable: {e}")


def test_mosaic_gpu_kernels_lower_for_cuda():
    """Lowering only (no GPU): the plgpu kernels trace and lower to the Mosaic GPU custom call."""
    from pallas_kernels.kda import Gate, mgpu

    sd = jax.ShapeDtypeStruct
    N, H, HV, K, V = 4, 2, 4, 128, 128
    bf = jnp.bfloat16
    apis = ["scatter", mgpu.default_decode_api()]  # JAX 0.11: "ref" (no pl.pallas_call for Mosaic GPU)
    # one 64-wide V tile per CTA, and two or four tiles per CTA on their own barriers; the WGMMA and
    # the colwarp register layout (K reductions inside a warp; at vt 32 two warps replicate the other two)
    # and its 8-columns-a-warp form colwarp8 (vt 32);
    # the defaults (None: here one tile of 32,
    # `mgpu.STEP_LAYOUT`), and vt 128, where the default layout falls back to WGMMA
    for api, vt, tiles, lay in ([(a, 64, 1, "wgmma") for a in apis]
                                + [(apis[-1], 64, 2, "wgmma"), (apis[-1], 32, 4, "wgmma"), (apis[-1], 64, 2, "colwarp"),
                                   (apis[-1], 32, 1, "colwarp"), (apis[-1], 32, 2, "colwarp8"),
                                   (apis[-1], None, None, None), (apis[-1], 128, 1, None)]) + [
            ("scatter", 64, 1, "persistent"), ("ref", 64, 1, "persistent")][:1 + (apis[-1] == "ref")]:
        ctas = 6 if lay == "persistent" else None  # the persistent form (JAX 0.10 lowers its scatter api only)
        lay = None if ctas else lay
        dec = functools.partial(mgpu.decode, layer=1, scale=K**-0.5, api=api, vt=vt, tiles=tiles, layout=lay,
                                ctas=ctas)
        e = _export_cuda(dec, sd((N, H, K), bf), sd((N, H, K), bf), sd((N, HV, V), bf), sd((N, HV, K), jnp.float32),
                         sd((N, HV), bf), sd((6, 2, HV, K, V), jnp.float32), sd((N,), jnp.int32), sd((N,), bool))
        assert "mosaic_gpu" in e.mlir_module()
    T = 203  # not a multiple of 8: the prep kernel reads the packed rows padded to one
    # the inter kernel's V tile (32: its A operands take 64-byte swizzles); the prep kernel with loops
    # (v6, the default) and unrolled (v4)
    for vt, prep in ((64, "mgpu_loop"), (32, "mgpu_loop"), (64, "mgpu")):
        ch = functools.partial(mgpu.chunk, scale=K**-0.5, vt=vt, prep=prep)
        e = _export_cuda(ch, sd((1, T, H, K), bf), sd((1, T, H, K), bf), sd((1, T, HV, V), bf),
                         sd((1, T, HV, K), jnp.float32), sd((1, T, HV), bf), sd((3, HV, K, V), jnp.float32),
                         sd((4,), jnp.int32))
        assert "mosaic_gpu" in e.mlir_module()
    # a snapshot at a given token; the states read from and written to the pool by slot (JAX 0.10 lowers
    # the scatter form only: no Mosaic GPU lowering of a JAX Ref there)
    qkvgb = (sd((1, T, H, K), bf), sd((1, T, H, K), bf), sd((1, T, HV, V), bf), sd((1, T, HV, K), jnp.float32),
             sd((1, T, HV), bf))
    snap = jnp.array([5, 64, -1], jnp.int32)
    e = _export_cuda(functools.partial(mgpu.chunk, scale=K**-0.5, snapshot_at=snap), *qkvgb,
                     sd((3, HV, K, V), jnp.float32), sd((4,), jnp.int32))
    assert "mosaic_gpu" in e.mlir_module()
    apis = ["scatter"] + ([] if mgpu._pallas_call_available() else ["ref"])
    gate = {"gate": Gate(jnp.zeros(HV), jnp.zeros(HV * K), -5.0), "qk_l2norm": True}
    for api, kw in [*itertools.product(apis, ({}, {"snapshot_at": snap, "snapshot_slots": jnp.array([4, 5, 6])})),
                    (apis[-1], gate)]:
        cp = functools.partial(mgpu.chunk_pool, layer=1, scale=K**-0.5, api=api, **kw)
        e = _export_cuda(cp, *qkvgb, sd((8, 2, HV, K, V), jnp.float32), sd((3,), jnp.int32), sd((3,), bool),
                         sd((4,), jnp.int32))
        assert "mosaic_gpu" in e.mlir_module()


def test_aligned_segments_lower_for_cuda(monkeypatch):
    """With `ALIGN_SEGMENTS` on, the chunk entry points (varlen, a snapshot, the pool form) still lower
    to the Mosaic GPU kernels, on the gathered rows: the prep kernel's inputs have the layout's row
    count (T + 7 segments, rounded up to 8), not T."""
    from pallas_kernels.kda import mgpu

    monkeypatch.setattr(mgpu, "ALIGN_SEGMENTS", True)
    sd = jax.ShapeDtypeStruct
    H, HV, K, V, T = 2, 4, 128, 128, 203
    bf = jnp.bfloat16
    qkvgb = (sd((1, T, H, K), bf), sd((1, T, H, K), bf), sd((1, T, HV, V), bf), sd((1, T, HV, K), jnp.float32),
             sd((1, T, HV), bf))
    e = _export_cuda(functools.partial(mgpu.chunk, scale=K**-0.5), *qkvgb, sd((3, HV, K, V), jnp.float32),
                     sd((4,), jnp.int32))
    text = e.mlir_module()
    assert "mosaic_gpu" in text and "x232x2x128xbf16>" in text  # 203 rows + 7 x 4 segments, to a multiple of 8
    api = "scatter" if mgpu._pallas_call_available() else "ref"
    kw = {"snapshot_at": jnp.array([5, 64, -1], jnp.int32), "snapshot_slots": jnp.array([4, 5, 6])}
    cp = functools.partial(mgpu.chunk_pool, layer=1, scale=K**-0.5, api=api, **kw)
    e = _export_cuda(cp, *qkvgb, sd((8, 2, HV, K, V), jnp.float32), sd((3,), jnp.int32), sd((3,), bool),
                     sd((4,), jnp.int32))
    assert "mosaic_gpu" in e.mlir_module()


def _inter_mirror(ops, rows):
    """The Mosaic GPU inter kernel's walk in numpy (`ref._chunk_inter` in f32 on the bf16 chunk operands)
    over `mgpu.chunk_operands`' table: each segment from its h0 row through its chunks, chunk c's outputs
    to rows [ctok, ctok + cnum) from chunk position ctok % 8, as the kernel stores them -> (o [rows, HV, V]
    with NaN where nothing is written, final state per segment)."""
    from pallas_kernels.kda.ref import _chunk_inter

    w, qg, kdT, aqk, u0, gl, h0, ccu, ctok, cnum = (np.asarray(x, np.float32) if x is not None else None for x in ops)
    HV, V = u0.shape[1], u0.shape[-1]
    o = np.full((rows, HV, V), np.nan, np.float32)
    finals = []
    for s in range(len(ccu) - 1):
        S = h0[s]
        for c in range(int(ccu[s]), int(ccu[s + 1])):
            oc, S = _chunk_inter(S, w[c], u0[c], aqk[c], qg[c], np.swapaxes(kdT[c], -1, -2), gl[c])
            t, n, lead = int(ctok[c]), int(cnum[c]), int(ctok[c]) % 8
            o[t:t + n] = np.swapaxes(np.asarray(oc), 0, 1)[lead:lead + n]
        finals.append(np.asarray(S))
    return o, np.stack(finals)


@pytest.mark.parametrize("prep", ["xla", "mgpu_loop"])
def test_aligned_segments_make_a_sequence_independent_of_its_offset(prep):
    """`mgpu.ALIGN_SEGMENTS` (`_segment_layout`): each varlen segment moved to a row that is a multiple of
    8, so its chunk grid starts at its first token. Sequence B then gets the same chunk operands, outputs
    and final state, bit for bit, after a 5-token and after an 8-token sequence, and the whole pack matches
    the f32 varlen reference (< 2e-2: bf16 operands); the packed layout (the default until timed on the
    H200) anchors B's grid at its row rounded down to 8, so there B's results depend on what precedes it.
    The inter kernel's part runs as a numpy mirror of its walk (`_inter_mirror`); the prep is the XLA one
    or the Mosaic GPU kernel in interpret mode."""
    from pallas_kernels.kda import mgpu
    from pallas_kernels.kda.ref import kda_chunk_varlen_ref

    rng = np.random.default_rng(21)
    H, HV, K, V = 1, 2, 64, 64
    tail = inputs(rng, (1, 103), H, HV, K, V)  # B (100 tokens), C (3)
    runs = {}
    for a_len in (5, 8):
        head = inputs(np.random.default_rng(a_len), (1, a_len), H, HV, K, V)
        x = [jnp.concatenate([h, t, jnp.zeros((1, 4) + t.shape[2:], t.dtype)], axis=1) for h, t in zip(head, tail)]
        T = x[0].shape[1]
        cu = jnp.asarray([0, a_len, a_len + 100, a_len + 103], jnp.int32)
        h0 = jnp.asarray(rng.normal(size=(3, HV, K, V)) * 0.1, jnp.float32).at[1].set(0.5)  # B's own start state
        want_o, want_s = kda_chunk_varlen_ref(*x, None, h0, cu, 64)
        for aligned in (True, False):
            lay = mgpu._segment_layout(mgpu._segments(cu, T), T, aligned)
            with jax.default_matmul_precision("highest"):
                ops = mgpu.chunk_operands(*x, h0, cu, scale=None, prep=prep, interpret=prep != "xla", layout=lay)
            o, fin = _inter_mirror(ops, lay.rows)
            o = o if lay.back is None else o[np.asarray(lay.back)]
            assert np.isfinite(o).all()  # every packed row written (padding rows as zeros)
            assert (o[int(cu[-1]):] == 0).all()
            rel = lambda a, b: np.linalg.norm(a - np.asarray(b)) / np.linalg.norm(np.asarray(b))
            assert rel(o[:int(cu[-1])], want_o[0, :int(cu[-1])]) < 2e-2 and rel(fin[:3], want_s) < 2e-2
            b_ops = [np.asarray(op)[np.asarray(ops[7])[1]:np.asarray(ops[7])[2]] for op in ops[:6]]  # B's chunks
            runs[a_len, aligned] = (o[a_len:a_len + 100], fin[1], b_ops)
    (o5, s5, ops5), (o8, s8, ops8) = runs[5, True], runs[8, True]
    for a, b in [(o5, o8), (s5, s8), *zip(ops5, ops8)]:
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(runs[5, False][0], runs[8, False][0])  # the packed grid: B depends on A


# ---- speculative verify-with-capture and the ReplaySSM fold -------------------------------------


def _spec_inputs(rng, N, T, H, HV, K, V):
    q, k, v, g, beta = inputs(rng, (N, T), H, HV, K, V)
    S0 = jnp.asarray(rng.normal(size=(N, HV, K, V)), jnp.float32)
    return q, k, v, g, beta, S0


def test_verify_matches_reference():
    from pallas_kernels.kda.spec import kda_verify

    rng = np.random.default_rng()
    q, k, v, g, beta, S0 = _spec_inputs(rng, 2, 4, 1, 2, 16, 8)
    o_r, cap_r = kda_verify(q, k, v, g, beta, S0, scale=0.3)
    o, cap = jax.jit(functools.partial(kda_verify, scale=0.3, impl=IMPL))(q, k, v, g, beta, S0)
    close(o, o_r)
    for a, b in zip(jax.tree_util.tree_leaves(cap), jax.tree_util.tree_leaves(cap_r)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the capture is the prepped input


def test_fold_all_layers_matches_reference_with_snapshot():
    """[N, L, ...] layers in one launch; n_keep from 0 to T; snap_at inside, at and past n_keep."""
    from pallas_kernels.kda.spec import Capture, kda_fold

    rng = np.random.default_rng()
    N, L, T, HV, K, V = 4, 2, 3, 2, 16, 8
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    S0 = f(N, L, HV, K, V)
    kk = jnp.asarray(l2(rng.normal(size=(N, L, T, HV, K))), jnp.float32)
    cap = Capture(k=kk, v=f(N, L, T, HV, V), g=-jnp.abs(f(N, L, T, HV, K)), beta=jax.nn.sigmoid(f(N, L, T, HV)))
    n_keep = jnp.array([0, 3, 1, 2], jnp.int32)
    snap_at = jnp.array([0, 2, 1, 3], jnp.int32)
    S_r, Ss_r = kda_fold(S0, cap, n_keep, snap_at)
    S, Ss = jax.jit(functools.partial(kda_fold, impl=IMPL))(S0, cap, n_keep, snap_at)
    close(S, S_r)
    close(Ss, Ss_r)
    close(jax.jit(functools.partial(kda_fold, impl=IMPL))(S0, cap, n_keep), S_r)


@pytest.mark.parametrize("impl", [IMPL, "xla"])
def test_fold_pool_in_place_by_slot(impl):
    """The fold on the pool by slot (the kernel; "xla": gather, fold, scatter) against the reference;
    untouched slots unchanged."""
    from pallas_kernels.kda.spec import Capture, kda_fold
    from pallas_kernels.kda.spec_kernels import fold_pool

    rng = np.random.default_rng()
    NS, N, L, T, HV, K, V = 7, 2, 2, 2, 2, 16, 8
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    pool = np.asarray(f(NS, L, HV, K, V))
    slots, dst = jnp.array([5, 2]), jnp.array([1, 0])
    cap = Capture(k=f(N, L, T, HV, K) * 0.3, v=f(N, L, T, HV, V), g=-jnp.abs(f(N, L, T, HV, K)),
                  beta=jax.nn.sigmoid(f(N, L, T, HV)))
    n_keep, snap_at = jnp.array([2, 1]), jnp.array([1, 1])
    new = jax.jit(functools.partial(fold_pool, impl=impl), donate_argnums=0)(
        jnp.asarray(pool), slots, cap, n_keep, snap_at, dst)
    new = np.asarray(new)
    S_r, Ss_r = kda_fold(jnp.asarray(pool)[slots], cap, n_keep, snap_at)
    close(new[np.asarray(slots)], S_r)
    close(new[np.asarray(dst)], Ss_r)
    untouched = [3, 4, 6]
    np.testing.assert_array_equal(new[untouched], pool[untouched])


def _spec_kernel_args(N=3, T=8, HV=4, K=128, V=128, L=2):
    """Abstract arguments of `spec_kernels.verify_mgpu` (N sequences of T tokens, a pool of N x HV
    state rows) and `fold_mgpu` (N x L rows over a pool of 5 x L x HV), f32, for lowering tests."""
    sd = jax.ShapeDtypeStruct
    f = jnp.float32
    vec = lambda X: sd((N, T, HV, X), f)
    vargs = (vec(K), vec(K), vec(V), vec(K), sd((N, T, HV), f), sd((N * HV, K, V), f), sd((N,), jnp.int32),
             sd((N,), jnp.int32))
    R = N * L
    cv = lambda X: sd((R, T, HV, X), f)
    i = sd((R,), jnp.int32)
    fargs = (sd((5 * L * HV, K, V), f), i, i, cv(K), cv(V), cv(K), sd((R, T, HV), f), i, i)
    return vargs, fargs


def test_spec_kernels_without_auto_barriers(lowered_modules):
    """verify (plain path) and fold with `auto_barriers=False` (their default in the colwarp layout at
    vt 64) lower with fewer `bar.sync` (verify at
    T = 8 keeps only commit_smem's and the prologue's) and the same float operations; refused where
    threads share state elements or wait on another thread's TMA (snapshots, WGMMA, colwarp vt 32)."""
    from pallas_kernels.kda import spec_kernels as sk

    vargs, fargs = _spec_kernel_args()
    for kernel, args in ((sk.verify_mgpu, vargs), (sk.fold_mgpu, fargs)):
        ops, bars = {}, {}
        for auto in (True, False):
            _export_cuda(functools.partial(kernel, auto_barriers=auto), *args)
            ops[auto], bars[auto] = _float_ops(lowered_modules[-1]), lowered_modules[-1].count("bar.sync")
        assert ops[True] == ops[False] and bars[False] < bars[True], (kernel.__name__, bars)
        _export_cuda(kernel, *args)  # the default (session 13): decode's rule, no barriers in colwarp at vt 64
        assert lowered_modules[-1].count("bar.sync") == bars[False], kernel.__name__
        for bad in (dict(layout="wgmma"), dict(vt=32)):
            with pytest.raises(ValueError, match="auto_barriers=True"):
                jax.eval_shape(functools.partial(kernel, auto_barriers=False, **bad), *args)
    with pytest.raises(ValueError, match="snapshots"):
        jax.eval_shape(functools.partial(sk.verify_mgpu, snapshots=True, auto_barriers=False), *vargs)


@pytest.mark.parametrize("layout", ["colwarp", "colwarp8"])
def test_verify_fold_tiles_step_as_one_tile(layout, lowered_modules):
    """verify and fold with two V tiles a CTA lower to one tile's float arithmetic and reduction
    shuffles twice over (each tile stepped alike, so the tile count cannot change a bit; tests/gpu
    checks the bits); verify with snapshots takes one tile; V must hold whole CTAs of tiles."""
    from pallas_kernels.kda import spec_kernels as sk

    vargs, fargs = _spec_kernel_args()
    arith = lambda text: [op for op in _float_ops(text) if op != "nvvm.shfl.sync idx"]
    for kernel, args in ((sk.verify_mgpu, vargs), (sk.fold_mgpu, fargs)):
        ops = {}
        for tiles in (1, 2):
            _export_cuda(functools.partial(kernel, layout=layout, tiles=tiles), *args)
            ops[tiles] = arith(lowered_modules[-1])
        assert len(ops[1]) > 100 and ops[2] == ops[1] * 2, kernel.__name__
        with pytest.raises(NotImplementedError, match="V % 256"):
            jax.eval_shape(functools.partial(kernel, layout=layout, tiles=8 if layout == "colwarp8" else 4), *args)
    with pytest.raises(NotImplementedError, match="one V tile"):
        jax.eval_shape(functools.partial(sk.verify_mgpu, layout=layout, tiles=2, snapshots=True), *vargs)


def test_spec_mosaic_gpu_kernels_lower_for_cuda():
    from pallas_kernels.kda import spec_kernels as sk

    vargs, fargs = _spec_kernel_args()
    for snaps, layout, ab in ((False, None, True), (True, None, True), (False, "colwarp", True),
                              (False, "colwarp8", False), (True, "colwarp8", True)):
        ver = functools.partial(sk.verify_mgpu, snapshots=snaps, layout=layout, auto_barriers=ab)
        assert "mosaic_gpu" in _export_cuda(ver, *vargs).mlir_module()
    # the state tile's register layout (mgpu.step_layouts); colwarp8 at vt 32 without the automatic barriers
    for layout, ab in ((None, True), ("colwarp", True), ("colwarp8", False)):
        fold = functools.partial(sk.fold_mgpu, layout=layout, auto_barriers=ab)
        assert "mosaic_gpu" in _export_cuda(fold, *fargs).mlir_module()


# ---- bad arguments: a clear error before any implementation runs --------------------------------


@pytest.mark.parametrize("impl", ["xla", IMPL, "pallas"])
def test_entry_points_reject_bad_arguments(impl):
    """Every KDA entry point checks its arguments before it dispatches (so "pallas" fails the same way
    on this CPU): shapes, heads, the pool's shape and dtype, a layer past the pool's, slots out of
    range or repeated (the kernels would read and write another request's rows), bad cu_seqlens; a
    ValueError that names the entry point and the argument. A good call still runs (impl xla)."""
    from pallas_kernels.kda import Gate, kda_chunk_pool
    from pallas_kernels.kda.spec import Capture, kda_fold, kda_verify
    from pallas_kernels.kda.spec_kernels import fold_pool

    rng = np.random.default_rng(0)
    N, T, H, HV, K, V, S, L = 2, 3, 1, 2, 8, 8, 5, 2
    q, k, v, g, beta = inputs(rng, (N,), H, HV, K, V)
    pool = jnp.zeros((S, L, HV, K, V), jnp.float32)
    slots = jnp.asarray([3, 1], jnp.int32)
    dec = functools.partial(kda_decode, impl=impl)
    cases = [
        (lambda: dec(q, k, v, g, beta, pool, slots, layer=L), "kda_decode: layer must be in \\[0, 2\\)"),
        (lambda: dec(q, k, v, g, beta, pool, jnp.asarray([3, 5]), layer=0), "slots must lie in \\[0, 5\\)"),
        (lambda: dec(q, k, v, g, beta, pool, jnp.asarray([1, 1]), layer=0), "slots must not repeat"),
        (lambda: dec(q, k, v, g, beta, pool, slots[:1], layer=0), "slots must have one entry per sequence"),
        (lambda: dec(q, k, v, g, beta, pool, slots.astype(jnp.float32), layer=0), "slots must be integers"),
        (lambda: dec(q, k, v, g, beta, pool[:, :, :1], slots, layer=0), "pool must be \\[slots, layers, 2, 8, 8\\]"),
        (lambda: dec(q, k, v, g, beta, pool.astype(jnp.bfloat16), slots, layer=0), "float32"),
        (lambda: dec(q, k, v, g[..., :4], beta, pool, slots, layer=0), "g must have shape \\(2, 2, 8\\)"),
        (lambda: dec(q, k[:, :, :4], v, g, beta, pool, slots, layer=0), "k must have shape"),
        (lambda: dec(q, k, v, g, beta, pool, slots, layer=0, reset=jnp.zeros(3, bool)), "reset must have one entry"),
    ]
    qc, kc, vc, gc, bc = inputs(rng, (1, 7), H, HV, K, V)
    cu = jnp.asarray([0, 4, 7], jnp.int32)
    chunk = functools.partial(kda_chunk, impl=impl)
    cp = functools.partial(kda_chunk_pool, impl=impl)
    h0 = jnp.zeros((2, HV, K, V), jnp.float32)
    cases += [
        (lambda: chunk(qc, kc, vc, gc, bc, initial_state=h0[:1], cu_seqlens=cu), "initial_state must have shape"),
        (lambda: chunk(qc, kc, vc, gc, bc, initial_state=h0, cu_seqlens=jnp.asarray([0, 5, 4])), "never decrease"),
        (lambda: chunk(qc, kc, vc, gc, bc, initial_state=h0, cu_seqlens=jnp.asarray([0, 4, 9])), "at most at T=7"),
        (lambda: chunk(qc, kc, vc[:, :5], gc, bc, initial_state=h0, cu_seqlens=cu), "kda_chunk: v must be"),
        (lambda: cp(qc, kc, vc, gc, bc, pool, slots, layer=2, cu_seqlens=cu), "kda_chunk_pool: layer must be"),
        (lambda: cp(qc, kc, vc, gc, bc, pool, jnp.asarray([0, 7]), layer=0, cu_seqlens=cu), "slots must lie in"),
        (lambda: cp(qc, kc, vc, gc, bc, pool, slots, layer=0, cu_seqlens=cu, snapshot_at=jnp.asarray([1, -1]),
                    snapshot_slots=jnp.asarray([4, 9])), "snapshot_slots must lie in"),
        (lambda: chunk(qc, kc, vc, gc, bc, cu_seqlens=cu, gate=Gate(jnp.zeros(HV + 1), jnp.zeros(HV * K))),
         "kda_chunk: gate.a_log must have shape \\(2,\\)"),
        (lambda: cp(qc, kc, vc, gc, bc, pool, slots, layer=0, cu_seqlens=cu, gate=Gate(jnp.zeros(HV), jnp.zeros(K))),
         "kda_chunk_pool: gate.dt_bias must have shape"),
        (lambda: chunk(qc, kc, vc, gc, bc, cu_seqlens=cu, gate=Gate(jnp.zeros(HV), jnp.zeros(HV * K), 5.0)),
         "gate.lower_bound must be a negative number"),
    ]
    qv, kv, vv, gv, bv = inputs(rng, (N, T), H, HV, K, V)
    S0 = jnp.zeros((N, HV, K, V), jnp.float32)
    cap = Capture(k=kv, v=vv, g=gv, beta=bv)  # H == HV / 2: k as captured must have HV heads
    capL = Capture(*(jnp.stack([jnp.repeat(x, 2, axis=2) if x.shape[2] == H else x] * L, 1)
                     for x in (kv, vv, gv, bv)))
    n_keep = jnp.asarray([1, 3], jnp.int32)
    cases += [
        (lambda: kda_verify(qv, kv, vv, gv, bv, S0[:1], impl=impl), "kda_verify: S0 must have shape"),
        (lambda: kda_verify(qv, kv, vv[:, :2], gv, bv, S0, impl=impl), "kda_verify: v must be"),
        (lambda: kda_fold(S0, cap, n_keep, impl=impl), "kda_fold: capture k must have shape \\(2, 3, 2, 8\\)"),
        (lambda: fold_pool(pool, slots, capL, n_keep[:1], impl=impl), "fold_pool: n_keep must have one entry"),
        (lambda: fold_pool(pool, jnp.asarray([2, 2]), capL, n_keep, impl=impl), "fold_pool: slots must not repeat"),
        (lambda: fold_pool(pool[:, :1], slots, capL, n_keep, impl=impl), "fold_pool: capture beta must be"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()
    if impl == "xla":  # the checks pass good arguments (traced ones too, under jit)
        o, p = jax.jit(functools.partial(kda_decode, layer=1, impl=impl))(q, k, v, g, beta, pool, slots)
        assert np.isfinite(np.asarray(o)).all()
        fold_pool(pool, slots, capL, n_keep, impl="pallas_interpret")


@pytest.mark.parametrize("impl", ["xla", IMPL])
def test_entry_points_take_empty_inputs(impl):
    """No sequences or no tokens is a valid call (nothing runs): decode of 0 sequences, a prefill of 0
    tokens (final state = initial state, snapshots of it where asked; in the pool a reset sequence's
    row becomes zero), verify of 0 sequences, a fold of 0 steps."""
    from pallas_kernels.kda import kda_chunk_pool
    from pallas_kernels.kda.spec import Capture, kda_fold, kda_verify
    from pallas_kernels.kda.spec_kernels import fold_pool

    rng = np.random.default_rng(1)
    H, HV, K, V, S, L = 1, 2, 8, 8, 4, 2
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    z = lambda *s: jnp.zeros(s, jnp.float32)
    pool = f(S, L, HV, K, V)
    o, p = kda_decode(z(0, H, K), z(0, H, K), z(0, HV, V), z(0, HV, K), z(0, HV), pool, jnp.zeros((0,), jnp.int32),
                      layer=1, impl=impl)
    assert o.shape == (0, HV, V)
    np.testing.assert_array_equal(np.asarray(p), np.asarray(pool))
    toks = (z(1, 0, H, K), z(1, 0, H, K), z(1, 0, HV, V), z(1, 0, HV, K), z(1, 0, HV))
    h0 = f(2, HV, K, V)
    o, ht, snap = kda_chunk(*toks, initial_state=h0, cu_seqlens=jnp.array([0, 0, 0]), snapshot_at=jnp.array([0, -1]),
                            impl=impl)
    assert o.shape == (1, 0, HV, V)
    np.testing.assert_array_equal(np.asarray(ht), np.asarray(h0))
    np.testing.assert_array_equal(np.asarray(snap), np.asarray(h0.at[1].set(0.0)))
    o, p = kda_chunk_pool(*toks, pool, jnp.array([1, 2]), layer=1, cu_seqlens=jnp.array([0, 0, 0]),
                          reset=jnp.array([False, True]), impl=impl)
    want = np.asarray(pool).copy()
    want[2, 1] = 0.0
    np.testing.assert_array_equal(np.asarray(p), want)
    o, cap = kda_verify(z(0, 3, H, K), z(0, 3, H, K), z(0, 3, HV, V), z(0, 3, HV, K), z(0, 3, HV), z(0, HV, K, V),
                        impl=impl)
    assert o.shape == (0, 3, HV, V) and cap.k.shape == (0, 3, HV, K)
    cap0 = Capture(z(2, L, 0, HV, K), z(2, L, 0, HV, V), z(2, L, 0, HV, K), z(2, L, 0, HV))
    S0 = f(2, L, HV, K, V)
    np.testing.assert_array_equal(np.asarray(kda_fold(S0, cap0, jnp.zeros(2, jnp.int32), impl=impl)), np.asarray(S0))
    p = fold_pool(pool, jnp.array([3, 0]), cap0, jnp.zeros(2, jnp.int32), impl=impl)
    np.testing.assert_array_equal(np.asarray(p), np.asarray(pool))
