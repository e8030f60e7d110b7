"""Kernels for speculative verify-with-capture and the ReplaySSM fold (`spec.kda_verify` /
`spec.kda_fold` with `impl="pallas"` or `"pallas_interpret"`).

Same arithmetic as the jnp reference in `spec.py`: every step is `ref._step`'s sequence (decay the
state by exp(g), predict k^T S, add k beta (v - pred)^T, read q^T S), on the f32 inputs that
`ref._prep` makes, and the fold uses the stored (captured) k, v, g, beta as they are: no gate is
recomputed. Layouts are the reference's: q, k `[N, T, H, K]`, v `[N, T, HV, V]`, g `[N, T, HV, K]`,
beta `[N, T, HV]`, states `[..., HV, K, V]` f32, Capture arrays `[N, ..., T, HV, X]` f32.

Both kernel families work on a *pool* of state rows `[R, K, V]` addressed by row bases (row =
base + value head), which is what lets the fold run over all layers and heads of every sequence in
one launch and write the pool in place:
- verify: one program per (sequence, value head[, V tile]); reads its state row (read only; a
  `reset` flag reads zeros instead), runs the T block tokens and writes o. With `snapshots`
  (the brute-force alternative, for the benchmark) it also writes the state after every step.
- fold: one program per (sequence x layer, value head[, V tile]); reads the state row, replays the
  T captured steps, keeping the first n_keep (a select per step, as the reference does), and
  writes the state to its main row; with `snap_at` the state after snap_at steps (the reference's
  `S_snap`, initialised to S0) goes to a second row of the same pool.

Implementations:
- portable (`pl.pallas_call`, no backend-specific primitives; `interpret=True` on CPU): it calls
  `ref._step` itself on the [K, V] state of one head;
- Mosaic GPU (`plgpu`, sm_90, Lane semantics like the decode kernel in `mgpu.py`): one CTA (128
  threads) per V tile; the [K, vt] state tile lives in registers in the layout `mgpu.STEP_LAYOUT`
  names (the decode kernel's; vt 64, or 32 in "colwarp8"), the T steps'
  vectors are TMA-loaded once into shared memory, beta is read from global memory as a scalar.
  Every step is `mgpu.step_tile`, the decode kernel's own step, so verify + fold give the decode
  kernel's outputs and states bit for bit.
  The pool is updated in place: `pl.pallas_call` with an input/output alias on JAX <= 0.10, the
  pool as a JAX Ref passed to `plgpu.kernel` on JAX >= 0.11.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.ref import _step

f32 = jnp.float32


# ---- shared index plumbing -----------------------------------------------------------------


def _fold_rows(N, Lx, HV, slots=None, pool_layers=None, layer0=0):
    """Row bases of the (sequence, layer) programs in a pool `[S, L, HV, K, V]` viewed as rows
    `[S * L * HV, K, V]`: base[n * Lx + l] = (slots[n] * L + layer0 + l) * HV."""
    L = Lx if pool_layers is None else pool_layers
    slots = jnp.arange(N, dtype=jnp.int32) if slots is None else slots.astype(jnp.int32)
    lays = jnp.arange(Lx, dtype=jnp.int32) + layer0
    return ((slots[:, None] * L + lays[None, :]) * HV).reshape(-1)


def _flat_capture(cap, N, Lx, T, HV):
    """Capture `[N, ..., T, HV, X]` -> k, g `[R, T, HV, K]`, v `[R, T, HV, V]`, beta `[R, T, HV]` f32."""
    R = N * Lx
    k = cap.k.astype(f32).reshape(R, T, HV, -1)
    v = cap.v.astype(f32).reshape(R, T, HV, -1)
    g = cap.g.astype(f32).reshape(R, T, HV, -1)
    b = cap.beta.astype(f32).reshape(R, T, HV)
    return k, v, g, b


# ---- portable Pallas (interpret mode on CPU) -----------------------------------------------


def verify_portable(q, k, v, g, beta, pool3, base, reset, *, snapshots=False, interpret=True):
    """q, k, g [N, T, HV, K]; v [N, T, HV, V]; beta [N, T, HV] (f32, prepped: q scaled, q/k
    expanded to the value heads); pool3 [R, K, V] f32; base [N] row bases; reset [N] ->
    o [N, T, HV, V] f32 (and with `snapshots` the state after every step, [N, HV, T, K, V]).
    One program per (sequence, value head)."""
    N, T, HV, K = q.shape
    V = v.shape[-1]

    def kernel(base_ref, reset_ref, q_ref, k_ref, v_ref, g_ref, b_ref, pool_ref, o_ref, *snap):
        n, h = pl.program_id(0), pl.program_id(1)
        S = pool_ref[base_ref[n] + h]
        S = jnp.where(reset_ref[n] != 0, 0.0, S)
        for t in range(T):
            o, S = _step(S, q_ref[t], k_ref[t], v_ref[t], g_ref[t], b_ref[t, 0])
            o_ref[t] = o
            if snapshots:
                snap[0][t] = S

    vec = lambda X: pl.BlockSpec((None, T, None, X), lambda n, h: (n, 0, h, 0))
    full = lambda x: pl.BlockSpec(x.shape, lambda n, h: (0,) * x.ndim)
    base = base.astype(jnp.int32)
    reset = reset.astype(jnp.int32)
    out_specs, out_shape = [vec(V)], [jax.ShapeDtypeStruct((N, T, HV, V), f32)]
    if snapshots:
        out_specs.append(pl.BlockSpec((None, None, T, K, V), lambda n, h: (n, h, 0, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((N, HV, T, K, V), f32))
    res = pl.pallas_call(
        kernel,
        grid=(N, HV),
        in_specs=[full(base), full(reset), vec(K), vec(K), vec(V), vec(K), vec(1), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
    )(base, reset, q, k, v, g, beta[..., None], pool3)
    return tuple(res) if snapshots else res[0]


def fold_portable(pool3, base, snap_base, k, v, g, beta, n_keep, snap_at, *, interpret=True):
    """pool3 [R_pool, K, V] f32 (updated in place: aliased); base / snap_base [R] row bases of the
    state (read and written) and of the snapshot (written where snap_base >= 0); k, g [R, T, HV, K],
    v [R, T, HV, V], beta [R, T, HV] f32; n_keep / snap_at [R] -> pool3."""
    R, T, HV, K = k.shape
    V = v.shape[-1]

    def kernel(base_ref, sbase_ref, nk_ref, sa_ref, k_ref, v_ref, g_ref, b_ref, _pool_in, pool_ref):
        r, h = pl.program_id(0), pl.program_id(1)
        zk = jnp.zeros((K,), f32)  # q: the fold reads no output
        row = base_ref[r] + h
        S = pool_ref[row]
        S_snap = S
        nk, sa = nk_ref[r], sa_ref[r]
        for t in range(T):
            _, S_next = _step(S, zk, k_ref[t], v_ref[t], g_ref[t], b_ref[t, 0])
            S = jnp.where(t < nk, S_next, S)
            S_snap = jnp.where(t + 1 == sa, S, S_snap)
        pool_ref[row] = S

        @pl.when(sbase_ref[r] >= 0)
        def _():
            pool_ref[sbase_ref[r] + h] = S_snap

    vec = lambda X: pl.BlockSpec((None, T, None, X), lambda r, h: (r, 0, h, 0))
    full = lambda x: pl.BlockSpec(x.shape, lambda r, h: (0,) * x.ndim)
    i32 = lambda x: x.astype(jnp.int32)
    base, snap_base, n_keep, snap_at = map(i32, (base, snap_base, n_keep, snap_at))
    return pl.pallas_call(
        kernel,
        grid=(R, HV),
        in_specs=[full(base), full(snap_base), full(n_keep), full(snap_at), vec(K), vec(V), vec(K), vec(1),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct(pool3.shape, f32),
        input_output_aliases={8: 0},
        interpret=interpret,
    )(base, snap_base, n_keep, snap_at, k, v, g, beta[..., None], pool3)


# ---- Mosaic GPU ------------------------------------------------------------------------------


def _mgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.kda import mgpu

    return plgpu, mgpu


def _launch(body, ins, pool3, out_types, grid, names, scratch, name, auto_barriers=True):
    """Runs `body(idx, *in_refs, pool_ref, *out_refs, *scratch)` over `grid` with the pool updated
    in place (read-only use is fine too); auto_barriers False: without Pallas's barriers around
    shared-memory stores (`mgpu.decode`'s `auto_barriers`). -> (outs list, pool3)."""
    plgpu, mgpu = _mgpu()
    params = mgpu.lane_params(auto_barriers)
    n_in = len(ins)
    if mgpu.default_decode_api() == "pallas_call":  # JAX <= 0.10
        def kernel(*refs):
            idx = [pl.program_id(i) for i in range(len(grid))]
            pool_out = refs[n_in + 1 + len(out_types)]
            outs = refs[n_in + 1: n_in + 1 + len(out_types)]
            body(idx, *refs[:n_in], pool_out, *outs, *refs[n_in + 2 + len(out_types):])

        gm = pl.BlockSpec(memory_space=plgpu.GMEM)
        res = pl.pallas_call(
            kernel, grid=grid, in_specs=[gm] * (n_in + 1), out_specs=[gm] * (len(out_types) + 1),
            out_shape=list(out_types) + [jax.ShapeDtypeStruct(pool3.shape, pool3.dtype)],
            input_output_aliases={n_in: len(out_types)}, scratch_shapes=scratch, compiler_params=params, name=name,
        )(*ins, pool3)
        return list(res[:-1]), res[-1]
    pool_ref = jax.new_ref(pool3)  # JAX >= 0.11: Pallas discharges the Ref into an input/output alias

    def kernel(*refs):
        idx = [lax.axis_index(a) for a in names]
        body(idx, *refs)

    outs = plgpu.kernel(
        kernel, out_type=list(out_types), grid=grid, grid_names=names, scratch_types=scratch,
        compiler_params=params, kernel_name=name,
    )(*ins, pool_ref)
    return list(outs), pool_ref[...]


def _check_no_auto_barriers(kernel, layout, K, vt, snapshots=False):
    """auto_barriers=False is safe where each thread stores only what it loaded (or writes what no
    one reads back): "colwarp" at vt 64 and "colwarp8" (where `mgpu.decode_auto_barriers` drops
    them), and not verify's snapshot ring, whose slot reuse waits on one thread's TMA wait."""
    _, mgpu = _mgpu()
    if snapshots or mgpu.decode_auto_barriers(layout, K, vt):
        raise ValueError(f"the {kernel} kernel needs auto_barriers=True with snapshots, the WGMMA layout or the "
                         f"colwarp layout's replicated vt-32 form (got layout={layout}, vt={vt}, snapshots={snapshots})")


def _tile_views(tiles, K, vt):
    """verify's and fold's shared-memory views for `tiles` V tiles a CTA: (the state buffer's shape,
    tile(ref, j) -> tile j of a state buffer, cols(ref, t, j) -> tile j's columns of row t of a
    [T, vt x tiles] vector buffer, pool_cols(v0, j) -> tile j's pool columns for a CTA starting at v0).
    One tile lowers exactly as the single-tile kernels did."""
    pool_cols = lambda v0, j: pl.ds(v0 + j * vt, vt) if j else pl.ds(v0, vt)
    if tiles == 1:
        return (K, vt), lambda ref, j: ref, lambda ref, t, j: ref.at[t], pool_cols
    return (tiles, K, vt), lambda ref, j: ref.at[j], lambda ref, t, j: ref.at[t, pl.ds(j * vt, vt)], pool_cols


def verify_mgpu(q, k, v, g, beta, pool3, base, reset, *, vt=None, tiles=1, snapshots=False, layout=None,
                auto_barriers=None):
    """Mosaic GPU verify: same contract as `verify_portable`; with `snapshots` also returns the
    state after every step, [N, HV, T, K, V] f32 (the per-step snapshot alternative to the fold).
    layout: the state tile's register layout (`mgpu.step_layouts`; None: `mgpu.STEP_LAYOUT`).
    vt: the V tile (None: `mgpu.step_vt`, 64, or 32 in "colwarp8").
    tiles: V tiles per CTA (grid N x HV x V / (vt tiles)), stepped one after the other from one load
    of the block's q, k, g vectors (as decode's `tiles`; not with snapshots). Every tile steps alike,
    so the count never changes a bit. For "colwarp8", whose vt 32 doubles the CTAs and the vector
    loads (session 13: verify + fold 0.245 ms at 64 x 12 against colwarp's 0.156): not yet timed.
    auto_barriers: False drops Pallas's barriers around shared-memory stores (16 at T = 8: the
    kernel's only stores are its output rows); "colwarp" at vt 64 or "colwarp8", without
    snapshots. None (the default since session 13): decode's rule (`mgpu.decode_auto_barriers`),
    barriers kept with snapshots. Measured on the H200 (bench/NOTES.md, session 13): verify + fold
    at 256 x 12 0.370 ms without against 0.466 with, at 64 x 12 0.156 against 0.217."""
    plgpu, mgpu = _mgpu()
    N, T, HV, K = q.shape
    V = v.shape[-1]
    vt = min(vt or mgpu.step_vt(layout, V), V)
    span = vt * tiles  # the V columns of one CTA
    if auto_barriers is None:
        auto_barriers = snapshots or mgpu.decode_auto_barriers(layout, K, vt)
    if K % 64 or V % span or vt % 32:
        raise NotImplementedError(f"verify kernel needs K % 64 == 0 and V % {span} == 0 (K={K}, V={V})")
    if snapshots and tiles != 1:
        raise NotImplementedError(f"verify with snapshots takes one V tile per CTA (tiles={tiles})")
    if not auto_barriers:
        _check_no_auto_barriers("verify", layout, K, vt, snapshots)
    WG, ROW, COL, SL = mgpu.step_layouts(layout, K, vt)
    tile_shape, tile, cols, pool_cols = _tile_views(tiles, K, vt)

    def body(idx, q_ref, k_ref, v_ref, g_ref, b_ref, base_ref, reset_ref, pool_ref, o_ref, *rest):
        if snapshots:
            snap_ref, s_smem, vec_smem, v_smem, o_smem, sb, bar = rest
        else:
            s_smem, vec_smem, v_smem, o_smem, bar = rest
        n, h, vi = idx
        v0 = vi * span
        row = base_ref[n] + h
        b = bar.at[0]
        for j in range(tiles):
            plgpu.copy_gmem_to_smem(pool_ref.at[row, :, pool_cols(v0, j)], tile(s_smem, j), b)
        plgpu.copy_gmem_to_smem(q_ref.at[n, :, h], vec_smem.at[0], b)
        plgpu.copy_gmem_to_smem(k_ref.at[n, :, h], vec_smem.at[1], b)
        plgpu.copy_gmem_to_smem(g_ref.at[n, :, h], vec_smem.at[2], b)
        plgpu.copy_gmem_to_smem(v_ref.at[n, :, h, pl.ds(v0, span)], v_smem, b)
        rs = reset_ref[n]
        plgpu.barrier_wait(b)
        for j in range(tiles):
            S = mgpu.load_tile(tile(s_smem, j), WG)
            S = jnp.where(rs != 0, 0.0, S)
            for t in range(T):
                ld = lambda i: mgpu.load_tile(vec_smem.at[i, t], ROW)
                o, S = mgpu.step_tile(S, ld(0), ld(1), ld(2), mgpu.load_tile(cols(v_smem, t, j), COL),
                                      b_ref[n, t, h], layout=SL)
                cols(o_smem, t, j)[...] = o
                if snapshots:
                    slot = t % 2
                    if t >= 2:
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    sb.at[slot][...] = S
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(sb.at[slot], snap_ref.at[n, h, t, :, pl.ds(v0, vt)])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[n, :, h, pl.ds(v0, span)])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM(tile_shape, f32, **mgpu.f32_tiled()),
        plgpu.SMEM((3, T, K), f32),
        plgpu.SMEM((T, span), f32),
        plgpu.SMEM((T, span), f32),
    ]
    out_types = [jax.ShapeDtypeStruct((N, T, HV, V), f32)]
    if snapshots:
        scratch.append(plgpu.SMEM((2, K, vt), f32, **mgpu.f32_tiled()))
        out_types.append(jax.ShapeDtypeStruct((N, HV, T, K, V), f32))
    scratch.append(plgpu.Barrier(num_arrivals=4 + tiles, num_barriers=1))
    i32 = lambda x: x.astype(jnp.int32)
    ins = (q, k, v, g, beta, i32(base), i32(reset))
    outs, _ = _launch(body, ins, pool3, out_types, (N, HV, V // span), ("seq", "head", "vtile"), scratch,
                      "kda_verify_mgpu", auto_barriers)
    return tuple(outs) if snapshots else outs[0]


def fold_mgpu(pool3, base, snap_base, k, v, g, beta, n_keep, snap_at, *, vt=None, tiles=1, layout=None,
              auto_barriers=None):
    """Mosaic GPU fold: same contract as `fold_portable` (pool3 updated in place). layout, vt and
    tiles: as `verify_mgpu`'s. auto_barriers: False drops Pallas's barriers around shared-memory stores
    (each thread stores only the state elements it loaded); "colwarp" at vt 64 or "colwarp8".
    None (the default since session 13): decode's rule (`mgpu.decode_auto_barriers`)."""
    plgpu, mgpu = _mgpu()
    R, T, HV, K = k.shape
    V = v.shape[-1]
    vt = min(vt or mgpu.step_vt(layout, V), V)
    span = vt * tiles
    if auto_barriers is None:
        auto_barriers = mgpu.decode_auto_barriers(layout, K, vt)
    if K % 64 or V % span or vt % 32:
        raise NotImplementedError(f"fold kernel needs K % 64 == 0 and V % {span} == 0 (K={K}, V={V})")
    if not auto_barriers:
        _check_no_auto_barriers("fold", layout, K, vt)
    WG, ROW, COL, SL = mgpu.step_layouts(layout, K, vt)
    tile_shape, tile, cols, pool_cols = _tile_views(tiles, K, vt)

    def body(idx, k_ref, v_ref, g_ref, b_ref, base_ref, sbase_ref, nk_ref, sa_ref, pool_ref,
             s_smem, f_smem, vec_smem, v_smem, bar):
        r, h, vi = idx
        v0 = vi * span
        row = base_ref[r] + h
        srow = sbase_ref[r]
        nk, sa = nk_ref[r], sa_ref[r]
        b = bar.at[0]
        for j in range(tiles):
            plgpu.copy_gmem_to_smem(pool_ref.at[row, :, pool_cols(v0, j)], tile(s_smem, j), b)
        plgpu.copy_gmem_to_smem(k_ref.at[r, :, h], vec_smem.at[0], b)
        plgpu.copy_gmem_to_smem(g_ref.at[r, :, h], vec_smem.at[1], b)
        plgpu.copy_gmem_to_smem(v_ref.at[r, :, h, pl.ds(v0, span)], v_smem, b)
        plgpu.barrier_wait(b)
        for j in range(tiles):
            S = mgpu.load_tile(tile(s_smem, j), WG)  # s_smem keeps S0: the snapshot's initial value
            for t in range(T):
                ld = lambda i: mgpu.load_tile(vec_smem.at[i, t], ROW)
                _, S_next = mgpu.step_tile(S, None, ld(0), ld(1), mgpu.load_tile(cols(v_smem, t, j), COL),
                                           b_ref[r, t, h], layout=SL)
                S = jnp.where(t < nk, S_next, S)

                @pl.when(t + 1 == sa)
                def _(S=S, j=j):
                    tile(s_smem, j)[...] = S

            tile(f_smem, j)[...] = S
        plgpu.commit_smem()
        for j in range(tiles):
            pc = pool_cols(v0, j)
            plgpu.copy_smem_to_gmem(tile(f_smem, j), pool_ref.at[row, :, pc])
            plgpu.copy_smem_to_gmem(tile(s_smem, j), pool_ref.at[jnp.maximum(srow, 0) + h, :, pc],
                                    predicate=srow >= 0)
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM(tile_shape, f32, **mgpu.f32_tiled()),
        plgpu.SMEM(tile_shape, f32, **mgpu.f32_tiled()),
        plgpu.SMEM((2, T, K), f32),
        plgpu.SMEM((T, span), f32),
        plgpu.Barrier(num_arrivals=3 + tiles, num_barriers=1),
    ]
    i32 = lambda x: x.astype(jnp.int32)
    ins = (k, v, g, beta, i32(base), i32(snap_base), i32(n_keep), i32(snap_at))
    _, pool3 = _launch(body, ins, pool3, [], (R, HV, V // span), ("row", "head", "vtile"), scratch, "kda_fold_mgpu",
                       auto_barriers)
    return pool3


# ---- entry points (spec.py's impl= dispatch lands here) --------------------------------------


def verify(q, k, v, g, beta, S0, *, scale=None, impl, reset=None):
    """`spec.kda_verify` through a kernel: -> (o [N, T, HV, V] f32, Capture)."""
    from pallas_kernels.kda.ref import _prep
    from pallas_kernels.kda.spec import Capture

    qf, kf, vf, gf, bf = _prep(q, k, v, g, beta, scale)
    N, T, HV, K = qf.shape
    V = vf.shape[-1]
    pool3 = S0.astype(f32).reshape(N * HV, K, V)
    base = jnp.arange(N, dtype=jnp.int32) * HV
    reset = jnp.zeros((N,), jnp.int32) if reset is None else reset
    if impl == "pallas_interpret":
        o = verify_portable(qf, kf, vf, gf, bf, pool3, base, reset)
    else:
        o = verify_mgpu(qf, kf, vf, gf, bf, pool3, base, reset)
    return o, Capture(k=kf, v=vf, g=gf, beta=bf)


def fold(S0, cap, n_keep, snap_at=None, *, impl):
    """`spec.kda_fold` through a kernel, all layers and heads in one launch. S0 `[N, ..., HV, K, V]`."""
    N = S0.shape[0]
    HV, K, V = S0.shape[-3:]
    Lx = math.prod(S0.shape[1:-3])
    T = cap.beta.shape[-2]
    R = N * Lx
    rep = lambda x: jnp.repeat(x.astype(jnp.int32), Lx)
    S0f = S0.astype(f32).reshape(R * HV, K, V)
    base = jnp.arange(R, dtype=jnp.int32) * HV
    if snap_at is None:
        pool3, sbase, sa = S0f, jnp.full((R,), -1, jnp.int32), jnp.zeros((R,), jnp.int32)
    else:  # snapshots go to a second copy of the rows, [R*HV, 2*R*HV)
        pool3, sbase, sa = jnp.concatenate([S0f, S0f]), base + R * HV, rep(snap_at)
    run = fold_portable if impl == "pallas_interpret" else fold_mgpu
    out = run(pool3, base, sbase, *_flat_capture(cap, N, Lx, T, HV), rep(n_keep), sa)
    S = out[: R * HV].reshape(S0.shape)
    return S if snap_at is None else (S, out[R * HV:].reshape(S0.shape))


def fold_pool(pool, slots, cap, n_keep, snap_at=None, snap_dst=None, *, impl="pallas", auto_barriers=None,
              layout=None, tiles=1):
    """The fold straight on the recurrent pool, in place: pool `[S, L, HV, K, V]` f32, slots
    `[N]`, cap `[N, L, T, HV, X]` (all L layers), n_keep `[N]`; with `snap_at` / `snap_dst` `[N]`
    the state after snap_at steps is written to slot snap_dst (where 0 < snap_at <= n_keep it is a
    real checkpoint; callers point the others at a sink slot). One launch, no gather or scatter:
    under a jit that donates the pool only the touched rows are read and written. auto_barriers,
    layout, tiles: `fold_mgpu`'s (impl "pallas"). impl "xla" (and any impl when there are no sequences or
    no steps): the states gathered, `spec.kda_fold`, scattered back (the working slots first, then
    the snapshots). -> pool."""
    from pallas_kernels.kda import checks

    op = "fold_pool"
    if pool.ndim != 5 or np.ndim(slots) != 1:
        raise ValueError(f"{op}: pool must be [S, L, HV, K, V] and slots [N], got shapes {pool.shape}, {np.shape(slots)}")
    S_, L, HV, K, V = pool.shape
    N = slots.shape[0]
    T = checks.capture(op, cap, (N, L), HV, K, V)
    for name, x in (("n_keep", n_keep), ("snap_at", snap_at), ("snap_dst", snap_dst)):
        checks.per_sequence(op, name, x, N)
    if (snap_at is None) != (snap_dst is None):
        raise ValueError(f"{op}: snap_at and snap_dst go together")
    checks.pool(op, pool, HV, K, V, slots=[("slots", slots), ("snap_dst", snap_dst)])
    if impl == "xla" or not cap.beta.size:
        from pallas_kernels.kda.spec import kda_fold

        out = kda_fold(pool[slots], cap, n_keep, snap_at)
        if snap_at is None:
            return pool.at[slots].set(out)
        return pool.at[slots].set(out[0]).at[snap_dst].set(out[1])
    if impl not in ("pallas", "pallas_interpret"):
        raise ValueError(f"{op}: impl must be 'xla', 'pallas' or 'pallas_interpret', got {impl!r}")
    rep = lambda x: jnp.repeat(x.astype(jnp.int32), L)
    base = _fold_rows(N, L, HV, slots)
    if snap_at is None:
        sbase, sa = jnp.full((N * L,), -1, jnp.int32), jnp.zeros((N * L,), jnp.int32)
    else:
        sbase, sa = _fold_rows(N, L, HV, snap_dst), rep(snap_at)
    run = (fold_portable if impl == "pallas_interpret"
           else functools.partial(fold_mgpu, auto_barriers=auto_barriers, layout=layout, tiles=tiles))
    out = run(pool.reshape(S_ * L * HV, K, V), base, sbase, *_flat_capture(cap, N, L, T, HV), rep(n_keep), sa)
    return out.reshape(pool.shape)
