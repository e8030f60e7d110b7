"""KDA Mosaic GPU kernels (`impl="pallas"`) on an H100/H200 against the f32 jnp references, at
realistic shapes with bf16 inputs (relative error < 1e-2, NaN never passes).

Run through the device tool: `JAX_PLATFORMS=cuda,cpu python3 -m pytest -m gpu tests/gpu`. Skipped
(not failed) on machines without a GPU.
"""

import functools

import numpy as np
import pytest

from tests.gpu import require_gpu

require_gpu()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.kda import kda_chunk, kda_decode  # noqa: E402
from pallas_kernels.kda.ref import _prep, kda_chunk_varlen_ref, kda_decode_ref  # noqa: E402

pytestmark = pytest.mark.gpu
bf16 = jnp.bfloat16


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "non-finite values in the kernel output"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make(key, lead, H, HV, K=128, V=128):
    ks = jax.random.split(key, 5)
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = l2(jax.random.normal(ks[0], lead + (H, K))).astype(bf16)
    k = l2(jax.random.normal(ks[1], lead + (H, K))).astype(bf16)
    v = jax.random.normal(ks[2], lead + (HV, V)).astype(bf16)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], lead + (HV, K))) / 4  # f32 log decay
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], lead + (HV,))).astype(bf16)
    return q, k, v, g, beta


def f32ref(x):
    return x.astype(jnp.float32)


# the default (kda_decode, impl="pallas") at five shapes (vt 32; two tiles; one tile), then the kernel's other forms (V tiles per
# CTA, the WGMMA or colwarp register layout, vt 32) through mgpu.decode
_DEFAULT = None
_OPTS = [dict(vt=64, tiles=2, layout="wgmma"), dict(vt=64, tiles=1, layout="wgmma"),
         dict(vt=64, tiles=1, layout="colwarp", auto_barriers=True), dict(vt=64, tiles=2, layout="colwarp", auto_barriers=True),
         dict(vt=32, tiles=1, layout="colwarp"), dict(vt=32, tiles=2, layout="colwarp"), dict(vt=128, tiles=1),
         # without Pallas's automatic barriers around SMEM stores (the default at vt 64 since session 11)
         dict(vt=64, tiles=1, auto_barriers=False), dict(vt=64, tiles=2, auto_barriers=False),
         # the vt-32 form with one barrier per tile instead (session 11: not yet run on the GPU)
         dict(vt=32, tiles=1, auto_barriers=False), dict(vt=32, tiles=2, auto_barriers=False),
         # the colwarp8 layout (8 columns a warp, vt 32; session 12: not yet run on the GPU)
         dict(vt=32, tiles=1, layout="colwarp8"), dict(vt=32, tiles=2, layout="colwarp8"),
         dict(vt=32, tiles=4, layout="colwarp8", auto_barriers=True),
         # the persistent form (session 21: not yet run on the GPU): 528 tiles over 7 CTAs (76 or 75 each),
         # two a CTA, and 32-wide tiles (replicated warps, with the automatic barriers) over 50 CTAs
         dict(vt=64, ctas=7), dict(vt=64, ctas=264), dict(vt=32, ctas=50)]


@pytest.mark.parametrize("N,H,HV,opts", [(1, 12, 12, _DEFAULT), (1, 96, 96, _DEFAULT), (256, 12, 12, _DEFAULT),
                                         (64, 4, 8, _DEFAULT), (33, 4, 8, _DEFAULT)] + [(33, 4, 8, o) for o in _OPTS])
def test_decode_in_place(N, H, HV, opts):
    """Against the f32 reference, in place: a NaN reset slot is never read, untouched slots and the
    other layer are unchanged. opts: `mgpu.decode` options, or the default path."""
    from pallas_kernels.kda import mgpu

    key = jax.random.key(np.random.randint(1 << 30))
    q, k, v, g, beta = make(key, (N,), H, HV)
    NS, L = N + 7, 2
    pool = jax.random.normal(jax.random.key(1), (NS, L, HV, 128, 128), jnp.float32) * 0.05
    slots = jax.random.permutation(jax.random.key(2), NS)[:N].astype(jnp.int32)
    reset = jnp.arange(N) % 5 == 1
    pool = pool.at[slots[reset], 1].set(jnp.nan)  # a reset slot is never read
    pool_np = np.asarray(pool)
    with jax.default_matmul_precision("highest"):
        o_r, p_r = kda_decode_ref(*map(f32ref, (q, k, v, g, beta)), pool, slots, layer=1, reset=reset)
    if opts == _DEFAULT:
        fn = jax.jit(functools.partial(kda_decode, layer=1, impl="pallas"), donate_argnums=(5,))
        o, p = fn(q, k, v, g, beta, pool, slots, reset=reset)
    else:
        fn = jax.jit(functools.partial(mgpu.decode, layer=1, scale=128**-0.5, **opts), donate_argnums=(5,))
        o, p = fn(q, k, v, g, beta, pool, slots, reset)
    assert rel_err(o, o_r) < 1e-2
    p, p_r = np.asarray(p), np.asarray(p_r)
    s = np.asarray(slots)
    assert rel_err(p[s, 1], p_r[s, 1]) < 1e-2
    untouched = np.setdiff1d(np.arange(NS), s)
    np.testing.assert_array_equal(p[untouched], pool_np[untouched])
    np.testing.assert_array_equal(p[:, 0], pool_np[:, 0])


@pytest.mark.parametrize("H,HV,vt,aligned", [(12, 12, 64, False), (4, 8, 64, False), (4, 8, 32, False),
                                             (12, 12, 64, True)])
def test_varlen_chunk(H, HV, vt, aligned, monkeypatch):
    """vt: the inter kernel's V tile (64 through `kda_chunk`; 32: twice the CTAs, 64-byte swizzles).
    aligned: `mgpu.ALIGN_SEGMENTS` (each sequence moved to a row that is a multiple of 8 first)."""
    from pallas_kernels.kda import mgpu

    monkeypatch.setattr(mgpu, "ALIGN_SEGMENTS", aligned)
    lens = [0, 1, 63, 64, 65, 1000, 130, 0, 2048]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + 37  # padding tokens, NaN: the kernels read chunk boxes around them and must mask them
    key = jax.random.key(np.random.randint(1 << 30))
    q, k, v, g, beta = (x.at[:, int(cu[-1]):].set(jnp.nan) for x in make(key, (1, T), H, HV))
    h0 = jax.random.normal(jax.random.key(3), (len(lens), HV, 128, 128), jnp.float32) * 0.05
    cu = jnp.asarray(cu)
    if vt == 64:
        fn = jax.jit(lambda *a: kda_chunk(*a[:5], initial_state=a[5], cu_seqlens=a[6], impl="pallas"))
    else:
        from pallas_kernels.kda import mgpu

        fn = jax.jit(functools.partial(mgpu.chunk, scale=None, vt=vt))
    o, ht = fn(q, k, v, g, beta, h0, cu)
    with jax.default_matmul_precision("highest"):
        o_r, ht_r = kda_chunk_varlen_ref(*map(f32ref, (q, k, v, g, beta)), None, h0, cu, 64)
    n = int(cu[-1])
    assert rel_err(o[:, :n], o_r[:, :n]) < 1e-2
    np.testing.assert_array_equal(np.asarray(o[:, n:]), 0.0)
    for i in range(len(lens)):  # each sequence, empty ones keep their initial state
        assert rel_err(ht[i], ht_r[i]) < 1e-2, i


@pytest.mark.parametrize("prep", ["mgpu", "mgpu_loop"])
@pytest.mark.parametrize("gate", [0.25, 8.0])
def test_chunk_prep_kernel(gate, prep):
    """The prep kernel's operands against the XLA prep (`prep.chunk_prep`, f32) chunk by chunk,
    with weak and strong gates (g down to ~ -40 per token: every cross-chunk decay underflows)."""
    from pallas_kernels.kda import mgpu

    lens = [5, 0, 64, 200, 1]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    T = int(cu[-1]) + 11
    q, k, v, g, beta = make(jax.random.key(np.random.randint(1 << 30)), (1, T), 2, 4)
    g = g * gate
    ops = jax.jit(lambda *a: mgpu.chunk_operands(*a[:5], None, a[5], scale=None, prep=prep))(q, k, v, g, beta, cu)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda *a: mgpu.chunk_operands(*a[:5], None, a[5], scale=None, prep="xla"))(
            *map(f32ref, (q, k, v, g, beta)), cu)
    cnum = np.asarray(ops[-1])
    live = cnum > 0
    for name, a, b in zip(("w", "qg", "kdT", "aqk", "u0", "gl"), ops[:6], ref[:6]):
        a, b = np.asarray(a.astype(jnp.float32))[live], np.asarray(b.astype(jnp.float32))[live]
        assert rel_err(a, b) < 1e-2, name


def test_dense_chunk_long():
    B, T, H = 2, 4096 + 100, 12
    q, k, v, g, beta = make(jax.random.key(np.random.randint(1 << 30)), (B, T), H, H)
    h0 = jax.random.normal(jax.random.key(4), (B, H, 128, 128), jnp.float32) * 0.05
    o, ht = jax.jit(lambda *a: kda_chunk(*a[:5], initial_state=a[5], impl="pallas"))(q, k, v, g, beta, h0)
    with jax.default_matmul_precision("highest"):
        o_r, ht_r = jax.jit(lambda *a: kda_chunk(*a[:5], initial_state=a[5], impl="xla"))(
            *map(f32ref, (q, k, v, g, beta)), h0)
    assert rel_err(o, o_r) < 1e-2
    assert rel_err(ht, ht_r) < 1e-2


@pytest.mark.parametrize("N,H,HV", [(1, 12, 12), (64, 4, 8)])
def test_verify_and_fold(N, H, HV):
    """Mosaic GPU verify (and its per-step snapshots) and the all-layer fold against the f32 jnp
    reference; the fold straight on the pool, in place, by slot."""
    from pallas_kernels.kda import spec_kernels as sk
    from pallas_kernels.kda.spec import Capture, kda_fold, kda_verify

    T, L = 8, 3
    key = jax.random.key(np.random.randint(1 << 30))
    q, k, v, g, beta = make(key, (N, T), H, HV)
    S0 = jax.random.normal(jax.random.key(5), (N, HV, 128, 128), jnp.float32) * 0.05
    with jax.default_matmul_precision("highest"):
        o_r, cap_r = kda_verify(*map(f32ref, (q, k, v, g, beta)), S0)
    o, cap = jax.jit(functools.partial(kda_verify, impl="pallas"))(q, k, v, g, beta, S0)
    assert rel_err(o, o_r) < 1e-2
    for a, b in zip(jax.tree_util.tree_leaves(cap), jax.tree_util.tree_leaves(cap_r)):
        assert rel_err(a, b) < 1e-6
    # snapshots: the state after every step, against the fold of the first t+1 steps
    qf = _prep(q, k, v, g, beta, None)[0]
    kf, vf, gf, bf = cap.k, cap.v, cap.g, cap.beta
    base = jnp.arange(N, dtype=jnp.int32) * HV
    o2, snaps = jax.jit(functools.partial(sk.verify_mgpu, snapshots=True))(
        qf, kf, vf, gf, bf, S0.reshape(N * HV, 128, 128), base, jnp.zeros((N,), jnp.int32))
    assert rel_err(o2, o_r) < 1e-2
    for t in (0, T - 1):
        with jax.default_matmul_precision("highest"):
            S_t = kda_fold(S0, cap_r, jnp.full((N,), t + 1))
        assert rel_err(snaps[:, :, t], S_t) < 1e-2, t
    # fold over L layers in one launch, with a snapshot
    capL = Capture(*(jnp.stack([x] * L, axis=1) for x in (cap.k, cap.v, cap.g, cap.beta)))
    S0L = jax.random.normal(jax.random.key(6), (N, L, HV, 128, 128), jnp.float32) * 0.05
    n_keep = jnp.arange(N, dtype=jnp.int32) % (T + 1)
    snap_at = jnp.arange(N, dtype=jnp.int32) % 4
    with jax.default_matmul_precision("highest"):
        S_r, Ss_r = kda_fold(S0L, capL, n_keep, snap_at)
    S, Ss = jax.jit(functools.partial(kda_fold, impl="pallas"))(S0L, capL, n_keep, snap_at)
    assert rel_err(S, S_r) < 1e-2
    assert rel_err(Ss, Ss_r) < 1e-2
    # in place on the pool
    NS = N + 5
    pool = jax.random.normal(jax.random.key(7), (NS, L, HV, 128, 128), jnp.float32) * 0.05
    perm = jax.random.permutation(jax.random.key(8), NS)
    slots, real, sink = perm[:N].astype(jnp.int32), perm[N], perm[N + 1]
    dst = jnp.where(jnp.arange(N) == 0, real, sink).astype(jnp.int32)  # only row 0 keeps its snapshot
    snap1 = jnp.where(jnp.arange(N) == 0, jnp.minimum(1, n_keep), 0)
    pool_np = np.asarray(pool)
    with jax.default_matmul_precision("highest"):
        P_r, Ps_r = kda_fold(pool[slots], capL, n_keep, snap1)
    new = np.asarray(jax.jit(sk.fold_pool, donate_argnums=0)(pool, slots, capL, n_keep, snap1, dst))
    assert rel_err(new[np.asarray(slots)], P_r) < 1e-2
    assert rel_err(new[int(real)], Ps_r[0]) < 1e-2
    untouched = np.setdiff1d(np.arange(NS), np.concatenate([np.asarray(slots), [int(real), int(sink)]]))
    np.testing.assert_array_equal(new[untouched], pool_np[untouched])


def _verify_fold_bits(layout, forms):
    """verify's outputs (plain path, some sequences reset) and the in-place fold's pools (snapshots to
    a real slot and a sink) under each of `forms` ({name: options of `verify_mgpu` and `fold_pool`}),
    on the same random inputs. -> (outputs, pools, N); pool rows [:N + 1] are specified (N + 1: the sink)."""
    from pallas_kernels.kda import spec_kernels as sk
    from pallas_kernels.kda.spec import Capture

    N, T, H, HV, L = 64, 8, 4, 8, 2
    key = jax.random.key(np.random.randint(1 << 30))
    qf, kf, vf, gf, bf = _prep(*make(key, (N, T), H, HV), None)
    S0 = jax.random.normal(jax.random.key(5), (N * HV, 128, 128), jnp.float32) * 0.05
    base = jnp.arange(N, dtype=jnp.int32) * HV
    reset = (jnp.arange(N) % 7 == 3).astype(jnp.int32)
    o = {name: np.asarray(jax.jit(functools.partial(sk.verify_mgpu, layout=layout, **kw))(
        qf, kf, vf, gf, bf, S0, base, reset)) for name, kw in forms.items()}
    capL = Capture(*(jnp.stack([x] * L, axis=1) for x in (kf, vf, gf, bf)))
    NS = N + 2
    pool = jax.random.normal(jax.random.key(7), (NS, L, HV, 128, 128), jnp.float32) * 0.05
    slots = jax.random.permutation(jax.random.key(8), N).astype(jnp.int32)
    n_keep = jnp.arange(N, dtype=jnp.int32) % (T + 1)
    snap_at = jnp.where(jnp.arange(N) == 0, jnp.minimum(1, n_keep), 0)
    dst = jnp.where(jnp.arange(N) == 0, N, N + 1).astype(jnp.int32)
    new = {name: np.asarray(jax.jit(functools.partial(sk.fold_pool, layout=layout, **kw))(
        pool, slots, capL, n_keep, snap_at, dst)) for name, kw in forms.items()}
    return o, new, N


@pytest.mark.parametrize("layout", [None, "colwarp8"])
def test_verify_fold_without_auto_barriers(layout):
    """verify and the in-place fold with `auto_barriers=False` give the same bits as with the
    barriers: a race between a thread's stores and another's loads would show up as differences. In
    the default layout and in colwarp8 (vt 32)."""
    o, new, N = _verify_fold_bits(layout, {a: dict(auto_barriers=a) for a in (True, False)})
    np.testing.assert_array_equal(o[False], o[True])
    np.testing.assert_array_equal(new[False][:N + 1], new[True][:N + 1])  # the sink slot's value is unspecified


@pytest.mark.parametrize("N,HV,vt,ctas", [(64, 12, 64, 264), (256, 12, 64, 132), (1, 96, 64, 132), (5, 12, 32, 17)])
def test_persistent_decode_bitwise_equal_grid(N, HV, vt, ctas):
    """The persistent decode (`mgpu.decode(ctas=)`, session 21) gives the grid form's outputs and states bit
    for bit (one `step_tile` in one layout: the verify + fold kernels' bitwise match with decode then
    holds for it too), in place by slot, with reset slots."""
    from pallas_kernels.kda import mgpu

    q, k, v, g, beta = make(jax.random.key(np.random.randint(1 << 30)), (N,), HV, HV)
    NS = N + 3
    pool = jax.random.normal(jax.random.key(1), (NS, 2, HV, 128, 128), jnp.float32) * 0.05
    slots = jax.random.permutation(jax.random.key(2), NS)[:N].astype(jnp.int32)
    reset = jnp.arange(N) % 3 == 1
    res = {}
    for c in (None, ctas):
        fn = jax.jit(functools.partial(mgpu.decode, layer=1, scale=128**-0.5, vt=vt, tiles=1, ctas=c),
                     donate_argnums=(5,))
        o, p = fn(q, k, v, g, beta, pool + 0.0, slots, reset)
        res[c] = np.asarray(o), np.asarray(p)
    np.testing.assert_array_equal(res[ctas][0], res[None][0])
    np.testing.assert_array_equal(res[ctas][1], res[None][1])


@pytest.mark.parametrize("N,HV", [(1, 12), (1, 96), (64, 12)])
def test_dense_decode_bitwise_equal_slots(N, HV):
    """The dense decode (`mgpu.decode(slots=None)`, session 29: the form the bench times against fla's dense
    `fused_recurrent_kda`) gives the slot form's bits with slots 0..N-1, in place, with reset slots, the
    pool's other slots and layers untouched."""
    from pallas_kernels.kda import mgpu

    q, k, v, g, beta = make(jax.random.key(np.random.randint(1 << 30)), (N,), HV, HV)
    pool = jax.random.normal(jax.random.key(1), (N + 2, 2, HV, 128, 128), jnp.float32) * 0.05
    reset = jnp.arange(N) % 3 == 1
    res = {}
    for dense in (True, False):
        fn = jax.jit(functools.partial(mgpu.decode, layer=1, scale=128**-0.5), donate_argnums=(5,))
        o, p = fn(q, k, v, g, beta, pool + 0.0, None if dense else jnp.arange(N, dtype=jnp.int32), reset)
        res[dense] = np.asarray(o), np.asarray(p)
    np.testing.assert_array_equal(res[True][0], res[False][0])
    np.testing.assert_array_equal(res[True][1], res[False][1])
    assert np.isfinite(res[True][0]).all()
    np.testing.assert_array_equal(res[True][1][N:], np.asarray(pool)[N:])
    np.testing.assert_array_equal(res[True][1][:, 0], np.asarray(pool)[:, 0])


@pytest.mark.parametrize("layout", [None, "colwarp8"])
def test_verify_fold_tiles_bitwise_equal_one_tile(layout):
    """verify and fold with two V tiles a CTA (session 14: one load of the block's vectors for both,
    the tiles stepped one after the other; not yet run on the GPU) give the bits of one tile a CTA, in
    the default layout (two 64-wide tiles: the whole V) and in colwarp8 (two 32-wide tiles)."""
    o, new, N = _verify_fold_bits(layout, {t: dict(tiles=t) for t in (1, 2)})
    np.testing.assert_array_equal(o[2], o[1])
    np.testing.assert_array_equal(new[2][:N + 1], new[1][:N + 1])


@pytest.mark.parametrize("layout,vt,tiles,auto_barriers", [("wgmma", 64, 1, True), ("wgmma", 64, 2, True),
                                                           ("colwarp", 64, 2, True), ("colwarp", 64, 2, False),
                                                           ("colwarp", 32, 1, True), ("colwarp", 32, 1, False),
                                                           ("colwarp8", 32, 1, False), ("colwarp8", 32, 2, False)])
def test_verify_fold_bitwise_equal_decode(layout, vt, tiles, auto_barriers, monkeypatch):
    """Speculative decoding on the kernels can only be token-identical to plain decoding if verify
    and fold compute what the decode kernel computes, bit for bit: the verify kernel's outputs for
    T tokens equal T decode-kernel steps, and folding all T captured steps leaves the decode
    kernel's state (strong K3 gates: g = -5 sigmoid(x)). For each state tile layout
    (`mgpu.STEP_LAYOUT`, which all three kernels read), V tile width of the decode kernel (verify and
    fold take `mgpu.step_vt`: 64, or 32 in colwarp8; colwarp's vt 32 replicates warps to step each column
    as at 64) and V tiles per CTA."""
    from pallas_kernels.kda import mgpu
    from pallas_kernels.kda.spec import kda_fold, kda_verify

    monkeypatch.setattr(mgpu, "STEP_LAYOUT", layout)

    N, T, H, HV = 4, 5, 12, 12
    ks = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 6)
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k = (l2(jax.random.normal(kk, (N, T, H, 128))) for kk in ks[:2])
    v = jax.random.normal(ks[2], (N, T, HV, 128))
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (N, T, HV, 128)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (N, T, HV)))
    S0 = jax.random.normal(ks[5], (N, HV, 128, 128)) * 0.05
    dec = jax.jit(functools.partial(mgpu.decode, layer=0, scale=128**-0.5, vt=vt, tiles=tiles,
                                    auto_barriers=auto_barriers))
    pool, outs = S0[:, None], []
    for t in range(T):
        o, pool = dec(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pool, jnp.arange(N, dtype=jnp.int32),
                      jnp.zeros((N,), bool))
        outs.append(o)
    o_ver, cap = jax.jit(functools.partial(kda_verify, impl="pallas"))(q, k, v, g, beta, S0)
    S = jax.jit(functools.partial(kda_fold, impl="pallas"))(S0, cap, jnp.full((N,), T))
    np.testing.assert_array_equal(np.asarray(o_ver), np.asarray(jnp.stack(outs, 1)))
    np.testing.assert_array_equal(np.asarray(S), np.asarray(pool[:, 0]))


def test_chunk_does_not_depend_on_the_pack_offset(monkeypatch):
    """DESIGN.md section 4 (tokens do not depend on batch composition), for the chunk kernels: with
    `ALIGN_SEGMENTS`, sequence B (1,000 tokens) prefilled after a 5-token sequence and after an 8-token
    one gets the same outputs and final state, bit for bit (its chunk grid starts at its first token).
    In the packed layout (the default until the gathers are timed) B's grid starts at its row rounded
    down to 8 and its bf16 chunk operands round differently (the CPU test shows that part)."""
    from pallas_kernels.kda import mgpu

    monkeypatch.setattr(mgpu, "ALIGN_SEGMENTS", True)
    H = HV = 12
    tail = make(jax.random.key(7), (1, 1000 + 3), H, HV)  # B, then a 3-token sequence
    h0 = jax.random.normal(jax.random.key(3), (3, HV, 128, 128), jnp.float32) * 0.05
    fn = jax.jit(lambda *a: kda_chunk(*a[:5], initial_state=a[5], cu_seqlens=a[6], impl="pallas"))
    outs = []
    for a_len in (5, 8):
        head = make(jax.random.key(a_len), (1, a_len), H, HV)
        x = [jnp.concatenate([h, t], axis=1) for h, t in zip(head, tail)]
        o, ht = fn(*x, h0, jnp.asarray([0, a_len, a_len + 1000, a_len + 1003], jnp.int32))
        outs.append((np.asarray(o[0, a_len:a_len + 1000]), np.asarray(ht[1])))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("aligned", [False, True])
def test_chunk_snapshot_and_pool_states_by_slot(aligned, monkeypatch):
    """The chunk kernels with a snapshot at a given token (inside a chunk, on a boundary, none) and
    with the states read from and written to the pool by slot in place (`kda_chunk_pool`): against
    the f32 references; a reset slot (NaN) is never read, every other pool row is untouched.
    aligned: `mgpu.ALIGN_SEGMENTS` (the two parts of a sequence around its snapshot token are segments)."""
    from pallas_kernels.kda import kda_chunk_pool, mgpu

    monkeypatch.setattr(mgpu, "ALIGN_SEGMENTS", aligned)

    lens = [0, 1, 65, 1000, 130]
    at = np.array([0, 1, 64, 500, -1], np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1]) + 11
    key = jax.random.key(np.random.randint(1 << 30))
    q, k, v, g, beta = make(key, (1, T), 4, 8)
    N, HV = len(lens), 8
    h0 = jax.random.normal(jax.random.key(3), (N, HV, 128, 128), jnp.float32) * 0.05
    cu_j, at_j = jnp.asarray(cu), jnp.asarray(at)
    o, ht, snap = jax.jit(lambda *a: kda_chunk(*a[:5], initial_state=a[5], cu_seqlens=a[6], snapshot_at=a[7],
                                               impl="pallas"))(q, k, v, g, beta, h0, cu_j, at_j)
    with jax.default_matmul_precision("highest"):
        o_r, ht_r, snap_r = kda_chunk(*map(f32ref, (q, k, v, g, beta)), initial_state=h0, cu_seqlens=cu_j,
                                      snapshot_at=at_j)
    n = int(cu[-1])
    assert rel_err(o[:, :n], o_r[:, :n]) < 1e-2
    for i in range(N):
        assert rel_err(ht[i], ht_r[i]) < 1e-2, i
        if at[i] >= 0:
            assert rel_err(snap[i], snap_r[i]) < 1e-2, i
    np.testing.assert_array_equal(np.asarray(snap[N - 1]), 0.0)

    NS, L = 12, 2
    pool = jax.random.normal(jax.random.key(4), (NS, L, HV, 128, 128), jnp.float32) * 0.05
    slots = jnp.array([3, 7, 0, 10, 5], jnp.int32)
    snap_slots = jnp.array([1, 2, 4, 6, 8], jnp.int32)
    reset = jnp.array([False, True, False, False, True])
    pool = pool.at[jnp.array([7, 5]), 1].set(jnp.nan)
    pool_np = np.asarray(pool)
    with jax.default_matmul_precision("highest"):
        o_r, p_r = kda_chunk_pool(*map(f32ref, (q, k, v, g, beta)), pool, slots, layer=1, cu_seqlens=cu_j,
                                  reset=reset, snapshot_at=at_j, snapshot_slots=snap_slots)
    fn = jax.jit(lambda *a: kda_chunk_pool(*a[:7], layer=1, cu_seqlens=a[7], reset=a[8], snapshot_at=a[9],
                                           snapshot_slots=a[10], impl="pallas"), donate_argnums=(5,))
    o, p = fn(q, k, v, g, beta, pool, slots, cu_j, reset, at_j, snap_slots)
    assert rel_err(o[:, :n], o_r[:, :n]) < 1e-2
    p, p_r = np.asarray(p), np.asarray(p_r)
    written = np.concatenate([np.asarray(slots), np.asarray(snap_slots)[at >= 0]])
    for s in written:
        assert rel_err(p[s, 1], p_r[s, 1]) < 1e-2, s
    untouched = np.setdiff1d(np.arange(NS), written)
    np.testing.assert_array_equal(p[untouched], pool_np[untouched])
    np.testing.assert_array_equal(p[:, 0], pool_np[:, 0])


@pytest.mark.parametrize("lower_bound,H,HV", [(None, 4, 8), (-5.0, 12, 12)])
def test_chunk_fuses_gate_and_l2norm(lower_bound, H, HV):
    """The prep kernel computing the log decay from bf16 gate logits and L2-normalising raw q and k
    (`kda_chunk(..., gate=, qk_l2norm=True)`, and the pool form) against the f32 reference of the
    whole thing (`ref.fused_inputs_ref` in f32, then the chunk reference), both gate forms (K3's
    lower-bound sigmoid, Kimi-Linear's softplus), varlen with empty, 1-token and partial-chunk
    sequences and NaN padding; value-head groups and H == HV (where approximate exp once broke the
    in-chunk decay sums: docs/kernels.md)."""
    from pallas_kernels.kda import Gate, kda_chunk_pool
    from pallas_kernels.kda.ref import fused_inputs_ref

    lens = [0, 1, 63, 65, 1000, 130]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T, n, N = int(cu[-1]) + 13, int(cu[-1]), len(lens)
    ks = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 8)
    q, k, v, _, beta = make(ks[0], (1, T), H, HV)
    q = (q.astype(jnp.float32) * 5).astype(bf16)  # un-normalised, rows of different lengths
    k = (k.astype(jnp.float32) * jax.random.uniform(ks[1], (1, T, H, 1), minval=0.3, maxval=4)).astype(bf16)
    f = (jax.random.normal(ks[2], (1, T, HV, 128)) * 2).astype(bf16)  # the gate logits
    f = f.at[:, 200:500].set(30.0)  # saturated: every token's decay near the bound (or very strong, softplus)
    gate = Gate(jax.random.normal(ks[3], (HV,)), jax.random.normal(ks[4], (HV * 128,)), lower_bound)
    q, k, v, f, beta = (x.at[:, n:].set(jnp.nan) for x in (q, k, v, f, beta))
    h0 = jax.random.normal(ks[5], (N, HV, 128, 128), jnp.float32) * 0.05
    cu_j = jnp.asarray(cu)
    with jax.default_matmul_precision("highest"):
        qr, kr, gr = fused_inputs_ref(*map(f32ref, (q, k, f)), gate, True)
        o_r, ht_r = kda_chunk_varlen_ref(qr, kr, f32ref(v), gr, f32ref(beta), None, h0, cu_j, 64)
    o, ht = jax.jit(lambda *a: kda_chunk(*a[:5], initial_state=a[5], cu_seqlens=a[6], gate=a[7], qk_l2norm=True,
                                         impl="pallas"))(q, k, v, f, beta, h0, cu_j, gate)
    assert rel_err(o[:, :n], o_r[:, :n]) < 1e-2
    np.testing.assert_array_equal(np.asarray(o[:, n:]), 0.0)
    for i in range(N):
        assert rel_err(ht[i], ht_r[i]) < 1e-2, i
    pool = jnp.zeros((N + 2, 1, HV, 128, 128), jnp.float32).at[1:N + 1, 0].set(h0)
    slots = jnp.arange(1, N + 1, dtype=jnp.int32)
    o, p = jax.jit(lambda *a: kda_chunk_pool(*a[:7], layer=0, cu_seqlens=a[7], gate=a[8], qk_l2norm=True,
                                             impl="pallas"))(q, k, v, f, beta, pool, slots, cu_j, gate)
    assert rel_err(o[:, :n], o_r[:, :n]) < 1e-2
    for i in range(N):
        assert rel_err(p[i + 1, 0], ht_r[i]) < 1e-2, i
