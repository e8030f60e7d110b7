"""KDA kernels in Pallas Mosaic GPU (`plgpu`) for the H100/H200 (sm_90): `impl="pallas"` on GPU.

Status (see bench/NOTES.md): `chunk` (prep + inter kernels) and `decode` are checked and
measured on the H200 (JAX 0.11.2). `decode` is written for Lane semantics (0.11.2 defaults to
Warpgroup) and updates the pool in place through a JAX Ref on 0.11.2 (`pl.pallas_call` with an
alias on 0.10). The prep kernel also runs in Mosaic GPU interpret mode (CPU tests); it is written
for Lane semantics too; the inter kernel for Warpgroup semantics (named in its compiler params,
so JAX 0.10.2's CPU lowering test lowers it as the H200's 0.11.2 does).

Decode (`decode`): one CTA (one warpgroup, 128 threads) per (sequence, value head, V tile): 64-wide
tiles (32-wide while that grid fits in one CTA per SM: `decode_vt`; two tiles a CTA while the grid
is one to two CTAs per SM: `decode_tiles`), without Pallas's automatic barriers where that is safe
(`decode_auto_barriers`). It TMA-loads the state
tiles `pool[slot, layer, h, :, v0:v0+VT]` (f32, swizzled; each on its own barrier) and the
token's vectors into shared memory, holds a tile in registers in the colwarp layout
(`STEP_LAYOUT`: the warps split the columns, so the two reductions over K stay inside a warp; the
WGMMA layout and colwarp8, 8 columns a warp at vt 32, are options), does the gated delta step in f32,
and TMA-stores the tile. The
pool is aliased input -> output, so the update is in place and untouched slots are never read or
written (2 x 4 x K x V bytes per head): with `pl.pallas_call` on JAX <= 0.10, and on JAX 0.11.2
(no `pl.pallas_call` lowering for Mosaic GPU) by passing the pool to `plgpu.kernel` as a JAX Ref,
which Pallas discharges into an input/output alias (`api="ref"`). `api="scatter"`
(a fresh array that XLA scatters into the pool) remains for comparison: 1.7-1.8x slower.

Chunked prefill (`chunk`): the state-independent part of each chunk (w, u0, Aqk, q exp G,
k exp(G_C - G), exp G_C) comes from the prep kernel (`_chunk_prep_call`, the algorithm of
`prep.py`: one CTA per chunk and value head, every step a 64 x 64 wgmma); the sequential part
runs in `_chunk_inter_call`, one CTA per (sequence, value head, V tile) walking its sequence's
chunks with the state tile in registers (f32) and the chunk operands double-buffered in shared
memory by TMA. Per chunk, on the tensor cores (bf16 operands, f32 accumulation, as fla does):

    u = u0 - w S;   o = (q exp G) S + Aqk u;   S <- exp(G_C) * S + (k exp(G_C - G))^T u

o is written straight into the packed `[T, HV, V]` output with a ladder of TMA stores of
64/32/.../1 rows, so a chunk shorter than 64 tokens never touches the next sequence's rows.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.dispatch import batch_invariant_rows
from pallas_kernels.kda.prep import chunk_prep
from pallas_kernels.kda.ref import fused_inputs_ref
from pallas_kernels.mgpu_common import COL, ROW, SMS, WGMMA, bf16_tiled, f32_tiled, gpu_interpret_params, load_tile
from pallas_kernels.varlen import CHUNK_TOKENS, chunk_table

try:  # registers the pl.pallas_call lowering for Mosaic GPU where this JAX still has one
    from jax._src.pallas.mosaic_gpu import pallas_call_registration as _pcr  # noqa: F401
except ImportError:  # pragma: no cover
    _pcr = None

def _bc_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, (0,))


def _bc_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, (1,))


# ---- decode --------------------------------------------------------------------------------


# The decode kernel is written for Lane semantics (the default on JAX 0.10; JAX 0.11.2 defaults
# to Warpgroup semantics, which rejects its scalar-predicate select: seen on the H200).
_LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def lane_params(auto_barriers=True):
    """The recurrent kernels' compiler params (decode here, verify and fold in spec_kernels.py):
    Lane semantics, and with auto_barriers False Mosaic GPU's `unsafe_no_auto_barriers` (no
    warpgroup barrier around each shared-memory store; commit_smem keeps its own)."""
    return _LANE if auto_barriers else dataclasses.replace(_LANE, unsafe_no_auto_barriers=True)


# approx_math (exp as a multiply + ex2.approx.ftz, as Triton's tl.exp): 1.36 -> 1.03 ms at 32k / 12 heads
# (bench/kda_prep_ablation.py, run A4), outputs within 3e-5 of precise exp. Before the beta / row masks were
# made lean (session 7) the same flag gave a wrong G (the in-chunk cumulative decay: w, qg, gl) whenever
# H == HV, while kd, aqk and u0 stayed exact; so did a precise-exp variant without the level-index tile
# (session 5). The PTX around G is right and compute-sanitizer's racecheck finds nothing: a hazard that
# the code generation (ptxas, 255 registers with spills) hides or exposes, not the exp's accuracy. Any
# change to this kernel must pass tests/gpu on the H200 (three of its tests caught it).
_PREP_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True)


def _pallas_call_available() -> bool:
    try:
        from jax._src.pallas import core as pallas_core

        return pallas_core.get_lowering_rule(plgpu.CompilerParams, "gpu") is not None
    except Exception:  # older JAX: pallas_call picks the Mosaic GPU backend itself
        return _pcr is not None


def default_decode_api() -> str:
    """In-place form this JAX lowers: `pl.pallas_call` with aliasing (JAX <= 0.10) or the pool as a
    JAX Ref passed to `plgpu.kernel` (JAX >= 0.11, which has no Mosaic GPU `pl.pallas_call`)."""
    return "pallas_call" if _pallas_call_available() else "ref"


def step_tile(S, qv, kv, gv, vv, bt, layout=None):
    """`ref._step` on a [K, vt] f32 state tile in registers: decay by exp(g), predict k^T S, add
    k beta (v - pred)^T, read q^T S. qv, kv, gv [K] (the tile layout reduced over V: ROW for the
    WGMMA layout), vv [vt] (reduced over K: COL), bt a scalar,
    all f32, q pre-scaled; qv None: no output. -> (o [vt] or None, new tile). The decode, verify and
    fold kernels all step through this one function, so verify + fold reproduce the decode kernel's
    states and outputs bit for bit (tests/gpu: test_verify_fold_bitwise_equal_decode). layout: the
    tile's register layout when it is not WGMMA (its broadcasts are then cast to it)."""
    shape = S.shape
    bc = (lambda x: x) if layout is None else (lambda x: plgpu.layout_cast(x, layout))
    S = S * bc(_bc_rows(jnp.exp(gv), shape))
    kb = bc(_bc_rows(kv, shape))
    pred = jnp.sum(S * kb, axis=0)
    S = S + kb * bc(_bc_cols(bt * (vv - pred), shape))
    o = None if qv is None else jnp.sum(S * bc(_bc_rows(qv, shape)), axis=0)
    return o, S


# The colwarp layouts: columns a warp (its lanes 4 chunks of columns x 8 rows; a thread holds one chunk of
# columns, a quarter of these, for K / 8 rows) -> the V tile widths it takes. "colwarp": 16 columns a warp
# in 4-column vectors, vt 64 (four warps) or 32 (two, replicated); "colwarp8": 8 columns a warp in
# 2-column vectors, vt 32 only (four warps, none replicated).
_COLWARP = {"colwarp": (16, (32, 64)), "colwarp8": (8, (32,))}


def _colwarp_fits(K, vt, layout="colwarp"):
    """Whether `_colwarp_layout(K, vt, layout)` takes a [K, vt] tile: a width of that layout (see
    `_COLWARP`) and K a multiple of the 8 lanes along the rows."""
    return vt in _COLWARP[layout][1] and K % 8 == 0


def _colwarp_layout(K, vt, layout="colwarp"):
    """A register layout for a [K, vt] f32 state tile in which each warp holds `_COLWARP[layout]`
    adjacent columns (16 for "colwarp", 8 for "colwarp8"): its lanes are 4 chunks of adjacent columns
    x 8 rows, and each thread holds one chunk (4 or 2 columns) of K / 8 rows (rows lane, lane + 8,
    ...). The decode step's two reductions over K stay inside a warp (K / 8 in-thread sums and 3
    shuffle rounds), where the WGMMA layout spreads K over the warps and reduces through shared
    memory. The lanes run over rows fastest, so a quarter-warp's loads hit 8 distinct chunks of the
    128-byte swizzle (the other order fails Mosaic's bank-conflict planner, and so does vt = 128,
    where a quarter-warp spans only 4 rows).

    "colwarp" at vt = 64: the four warps split the columns. At vt = 32 two warps split them and the
    other two replicate them (`Replicated` warps: both copies compute and store the same values), so
    every column is reduced by the same instructions in the same order at either width, and decode at
    vt 32 is bit-identical to verify + fold at vt 64 (tests/gpu). Session 9's vt-32 form (16 row
    lanes, 8 rows a thread) reduced differently and was not. The replicas load and store the same
    shared memory: their stores must wait for both to have loaded (Pallas's automatic barriers, or
    decode's one barrier without them).

    "colwarp8" (vt 32 only): half the columns a thread and a warp, no replicas. Each column's sum has
    the association of "colwarp"'s, but a thread's instructions differ, and on the H200 the backend
    then rounds differently (session 11, run D22: 68% of decode's outputs differed from "colwarp" verify
    + fold by an ulp): it is bit-identical only to kernels that run it too, so it is a setting of
    `STEP_LAYOUT` (decode, verify and fold at vt 32), not a decode-only width."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    if layout not in _COLWARP or not _colwarp_fits(K, vt, layout):
        widths = _COLWARP.get(layout, (0, ()))[1]
        raise NotImplementedError(f"the {layout} layout needs vt in {widths} and K % 8 == 0 (K={K}, vt={vt})")
    cols = _COLWARP[layout][0]
    tiling = fa.Tiling(((K, vt), (K, cols), (8, cols), (cols // 4,)))
    warps = (-6,) if vt == 4 * cols else (-6, fa.Replicated(2))
    return plgpu.Layout.TILED(tiling, warp_dims=warps, lane_dims=(-2, -3), vector_dim=-1)


# The state tile's register layout in the recurrent kernels (decode here, verify and fold in
# spec_kernels.py). One setting for all three: verify + fold reproduce decode bit for bit only when
# their reductions run in the same layout.
# "colwarp" since session 9: as fast as or faster than "wgmma" in decode at every shape measured
# (bench/NOTES.md, runs D12-D14). "colwarp8" (vt 32 in all three kernels): session 12, not yet timed
# at batch > 1 nor in verify + fold.
STEP_LAYOUT = "colwarp"


def step_layout_name(layout, K, vt):
    """layout ("wgmma", "colwarp", "colwarp8" or None for `STEP_LAYOUT`) -> the layout a [K, vt] state
    tile gets: with layout None, a tile the setting's colwarp form cannot take (vt 128) gets "wgmma",
    in every kernel alike."""
    if layout is None:
        layout = STEP_LAYOUT
        if layout in _COLWARP and not _colwarp_fits(K, vt, layout):
            return "wgmma"
    if layout != "wgmma" and layout not in _COLWARP:
        raise ValueError(f"unknown state tile layout {layout!r}")
    return layout


def layout_label(layout, K, vt):
    """What a bench row records: `step_layout_name`, with "colwarp"'s replicated vt-32 form as
    "colwarp_replicated"."""
    name = step_layout_name(layout, K, vt)
    return name + "_replicated" if name == "colwarp" and vt < 64 else name


def step_layouts(layout, K, vt):
    """layout (as `step_layout_name`) -> (tile, [K] row vector and [vt] column vector register
    layouts, and `step_tile`'s layout argument)."""
    name = step_layout_name(layout, K, vt)
    if name == "wgmma":
        return WGMMA, ROW, COL, None
    tl = _colwarp_layout(K, vt, name)
    return tl, tl.reduce(1), tl.reduce(0), tl


def step_vt(layout, V):
    """The verify and fold kernels' V tile when not given: the widest the layout takes (`_COLWARP`:
    64 for "colwarp", 32 for "colwarp8"; 64 for "wgmma"), never more than V."""
    return min(max(_COLWARP.get(layout or STEP_LAYOUT, (0, (64,)))[1]), V)


def decode_vt(N, HV, V, layout=None):
    """decode's V tile width when not given: 32 in the "colwarp8" layout (its only width); in
    "colwarp", 32 while the 32-wide one-tile grid (N x HV x V / 32 CTAs) fits in one CTA per SM (its
    vt-32 form steps every column as vt 64 does, bit for bit), else 64; 64 in "wgmma". Twice the CTAs
    for the same bytes: at one sequence x 12 heads 48 CTAs of 16 KiB take 2.86 us against 24 of 32
    KiB's 3.13 (fla 2.84; bench/NOTES.md, session 11)."""
    if (layout or STEP_LAYOUT) == "colwarp" and V % 32 == 0 and N * HV * (V // 32) <= SMS:
        return 32
    return step_vt(layout, max(V, 64))  # the layout's widest tile (decode clips it to V)


def decode_auto_barriers(layout, K, vt):
    """decode's `auto_barriers` when not given: False (no automatic barriers around its shared-memory
    stores) where each thread stores only the state elements it loaded: "colwarp" at vt 64 and
    "colwarp8". True for "colwarp"'s vt-32 form (two warps replicate two others and share their
    elements: without the automatic barriers decode adds the one barrier they need, not yet timed)
    and for the WGMMA layout (its reductions over K cross warps). On the H200 the barriers cost ~1%
    at batch >= 64 with one tile per CTA (bench/NOTES.md, session 11)."""
    return layout_label(layout, K, vt) in ("wgmma", "colwarp_replicated")


def decode_tiles(N, HV, V, vt=64):
    """decode's V tiles per CTA when not given: two where V allows while the one-tile grid (N x HV x
    V / vt CTAs) is more than one CTA per SM but at most two, else one. On the H200 (session 11,
    kernel us): 1 x 96 heads (192 one-tile CTAs) 6.15 with two tiles against 6.3-6.4 with one; at
    batch >= 64 one tile without the automatic barriers is the fastest form (64 x 12: 28.9 against
    two tiles' 29.0-29.1; 1024 x 12: 404.1 against 406.7-407.0; 256 x 96: 804.7 against 807.8-809.5).
    Grids between 264 and 1,536 one-tile CTAs were not measured. The tile count never changes a bit:
    every tile steps alike (tests/gpu)."""
    if SMS < N * HV * (V // vt) <= 2 * SMS and V % (2 * vt) == 0:
        return 2
    return 1


def decode(q, k, v, g, beta, pool, slots, reset, *, layer, scale, vt=None, tiles=None, api=None, xla_casts=True,
           read_only_wait=False, layout=None, auto_barriers=None, ctas=None, interpret=False):
    """q, k [N, H, K]; v [N, HV, V]; g [N, HV, K]; beta [N, HV]; pool [S, L, HV, K, V] f32;
    slots [N] int; reset [N] bool -> (o [N, HV, V] f32, pool). K and V multiples of 64.
    slots None: the dense form (grid form only), sequence n's state is pool[n, layer]: no slot id is
    read before the state's loads, as fla's `fused_recurrent_kda` with a dense h0 (bench/kda_kernels.py
    times it against that form; the engine always passes slots).

    api: "pallas_call" (`pl.pallas_call` with input_output_aliases: the pool is updated in place;
    JAX <= 0.10), "ref" (`plgpu.kernel` with the pool passed as a JAX Ref, which Pallas discharges
    into an input/output alias: in place; JAX >= 0.11) or "scatter" (`plgpu.kernel` writes the
    new states to a fresh [N, HV, K, V] array that XLA scatters into the pool: twice the state
    traffic). Default: `default_decode_api()`.

    vt: the V tile width (None: `decode_vt`, 32 at small grids, else 64).

    tiles: V tiles of width vt per CTA (grid N x HV x V / (vt tiles)); None (the default):
    `decode_tiles` (2 while the one-tile grid is one to two CTAs per SM, else 1). All of a CTA's
    tile loads are issued up front, each on its own barrier; the tiles are then stepped and stored
    one after the other, so tile j + 1 is in flight while tile j is stepped (v5; with the automatic
    barriers and the WGMMA layout it beat one tile at batch >= 256 on the H200, without them and in
    the colwarp layout one tile is as fast or faster there: bench/NOTES.md, sessions 8 and 11).

    xla_casts: True (v1, the default) converts the inputs to f32 (and scales q) in XLA before the
    kernel; False (v2) reads them in their own dtypes (bf16 or f32) and converts in the kernel.
    v2 was predicted faster (no cast launches) but measured slower on the H200 (bench/NOTES.md).

    read_only_wait: the CTA ends once its TMA stores have read the shared memory, not once their
    writes have landed (as CUTLASS epilogues do; the grid's writes are complete when the kernel is).

    layout: the state tile's register layout (None: `STEP_LAYOUT`, "colwarp", which the verify and
    fold kernels use too, so their bitwise match with decode holds): "wgmma", "colwarp"
    (`_colwarp_layout`: K reductions inside a warp; 127 registers against the WGMMA layout's 162,
    and 0.105 ms at 256 x 12 heads on the H200 with tiles=2, 0.90 of copy bandwidth, against
    0.108) or "colwarp8" (8 columns a warp, vt 32 only; bit-identical to verify + fold only when
    they run it too, i.e. with `STEP_LAYOUT = "colwarp8"`; not yet timed at batch > 1).

    auto_barriers: None (the default): `decode_auto_barriers` (False for the colwarp layout at vt 64).
    False compiles with `unsafe_no_auto_barriers`, dropping the warpgroup barriers
    Pallas puts before and after every SMEM store (the lowered module keeps 3 of its 17 `bar.sync` at
    two tiles a CTA, 2 of 11 at one). Safe at vt 64: each thread stores only the state elements it
    loaded (no warp replicates another), the output vector's replicas store equal values, and
    `commit_smem` (fence and barrier) still orders the stores before each TMA store. At vt 32 in the
    colwarp layout, whose replicated warps share their state elements, one more barrier (a
    `commit_smem`) holds each tile's stores until every warp has loaded it (opt-in; not yet timed on
    the GPU: the default keeps the automatic barriers there).

    ctas: None (the default): the grid form, one CTA per (sequence, value head, `tiles` V tiles). An int P:
    the persistent form (session 21; measured 1.7-3.5% slower than the grid form at batch >= 256 on an H100,
    session 22, so opt-in): P CTAs (at most the N x HV x V / vt tiles),
    CTA p steps tiles p, p + P, p + 2P, ... (sequence-major) through two shared-memory buffers: tile i + 1's
    loads are in flight while tile i is stepped and stored, and tile i + 2's slot id is read a tile ahead,
    so neither the slot read nor a CTA's launch sits between a tile's loads and the previous tile's
    work. Each tile steps exactly as in the grid form (one `step_tile` in the same layout), so the bits
    are the same (tests/gpu). `tiles` must be 1 (or None).

    interpret: Mosaic GPU interpret mode, api "scatter" (the CPU tests run this kernel's tiles and
    barriers there; the "ref" api fails in interpret mode on JAX 0.10.2). It ignores layouts.
    """
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    S_, L = pool.shape[:2]
    G = HV // H
    vt = min(vt or decode_vt(N, HV, V, layout), V)
    auto_barriers = decode_auto_barriers(layout, K, vt) if auto_barriers is None else auto_barriers
    dense = slots is None
    if dense:
        if ctas is not None:
            raise ValueError("the dense decode (slots=None) is the grid form only: ctas must be None")
        if S_ < N:
            raise ValueError(f"the dense decode (slots=None) needs a pool of >= N = {N} slots, got {S_}")
        slots = jnp.arange(N, dtype=jnp.int32)  # passed, never read by the kernel
    if ctas is not None:
        if tiles not in (None, 1):
            raise ValueError(f"the persistent decode (ctas={ctas}) steps one V tile at a time: tiles must be 1, "
                             f"got {tiles}")
        if ctas < 1:
            raise ValueError(f"decode needs ctas >= 1 (or None for the grid form), got {ctas}")
        tiles = 1
    tiles = decode_tiles(N, HV, V, vt) if tiles is None else tiles
    if K % 64 or V % (vt * tiles) or vt % 32:
        raise NotImplementedError(f"decode kernel needs K % 64 == 0 and V % {vt * tiles} == 0 (K={K}, V={V})")
    api = api or default_decode_api()
    if xla_casts:  # v1: f32 inputs made by XLA (one small fusion launch per input and step)
        q = q.astype(jnp.float32) * scale
        k, v, g, beta = (x.astype(jnp.float32) for x in (k, v, g, beta))
        scale = 1.0
    f32 = jnp.float32
    pool3 = pool.reshape(S_ * L * HV, K, V)
    span = vt * tiles  # the V columns of one CTA
    params = lane_params(auto_barriers)
    TL, RL, CL, step_layout = step_layouts(layout, K, vt)
    # colwarp's vt-32 form: two warps replicate two others and load and store the same state elements, so
    # without the automatic barriers one barrier must hold every store until all replicas have loaded
    replica_barrier = not auto_barriers and layout_label(layout, K, vt) == "colwarp_replicated"
    ld = lambda ref, layout: (ref[...] if interpret else load_tile(ref, layout)).astype(f32)

    def vectors(q_s, k_s, g_s):
        """q (scaled), k and g of a (sequence, head) from shared memory, in the layout of the state's rows."""
        qv = ld(q_s, RL)
        if scale != 1.0:
            qv = qv * scale
        return qv, ld(k_s, RL), ld(g_s, RL)

    def step_in_smem(s_s, v_s, vecs, bt, rs):
        """One state tile stepped in place in shared memory (zeros for a reset slot, whose values are
        discarded) -> its output columns. Both forms of the kernel step through this."""
        S = jnp.where(rs != 0, 0.0, ld(s_s, TL))
        o, S = step_tile(S, *vecs, ld(v_s, CL), bt, layout=None if interpret else step_layout)
        if replica_barrier:  # every warp has its tile in registers before any stores
            plgpu.commit_smem()
        s_s[...] = S
        return o

    def step(n, h, v0, q_ref, k_ref, v_ref, g_ref, b_ref, slot_ref, reset_ref, o_ref, src_ref, dst_ref, *scr):
        hq = h // G
        s_smem, q_smem, k_smem, g_smem, v_smem, o_smem, vbar, tbar = scr
        # the vectors first: their loads do not wait on the slot read
        plgpu.copy_gmem_to_smem(q_ref.at[n, hq], q_smem, vbar.at[0])
        plgpu.copy_gmem_to_smem(k_ref.at[n, hq], k_smem, vbar.at[0])
        plgpu.copy_gmem_to_smem(g_ref.at[n, h], g_smem, vbar.at[0])
        plgpu.copy_gmem_to_smem(v_ref.at[n, h, pl.ds(v0, span)], v_smem, vbar.at[0])
        row = ((n if dense else slot_ref[n]) * L + layer) * HV + h
        srcs, dsts = [], []
        for j in range(tiles):
            cols = pl.ds(v0 + j * vt, vt)
            srcs.append(src_ref.at[row, :, cols])
            dsts.append(srcs[j] if dst_ref is None else dst_ref.at[n * HV + h, :, cols])
            plgpu.copy_gmem_to_smem(srcs[j], s_smem.at[j], tbar.at[j])
        bt = b_ref[n, h].astype(f32)
        rs = reset_ref[n]
        plgpu.barrier_wait(vbar.at[0])
        vecs = vectors(q_smem, k_smem, g_smem)
        for j in range(tiles):
            plgpu.barrier_wait(tbar.at[j])
            o_smem[pl.ds(j * vt, vt)] = step_in_smem(s_smem.at[j], v_smem.at[pl.ds(j * vt, vt)], vecs, bt, rs)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_smem.at[j], dsts[j])
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[n, h, pl.ds(v0, span)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=read_only_wait)

    n_tiles = N * HV * (V // vt)
    P = None if ctas is None else min(ctas, n_tiles)

    def persistent(q_ref, k_ref, v_ref, g_ref, b_ref, slot_ref, reset_ref, o_ref, src_ref, dst_ref, *scr):
        """The persistent form (`ctas`): this CTA's tiles p, p + P, ... in a loop over two buffers."""
        s_smem, q_smem, k_smem, g_smem, v_smem, o_smem, bar = scr
        nvt, p = V // vt, lax.axis_index("cta")
        count = (n_tiles - p + P - 1) // P  # >= 1: p < P <= n_tiles

        def coords(i):  # tile i -> (sequence, value head, first column)
            n, r = i // (HV * nvt), lax.rem(i, HV * nvt)
            return n, r // nvt, lax.rem(r, nvt) * vt

        def row_of(i):  # tile i's pool row (a clamped tile past the end: read, never used)
            n, h, _ = coords(jnp.minimum(i, n_tiles - 1))
            return (slot_ref[n] * L + layer) * HV + h

        def issue(i, row, b):
            n, h, v0 = coords(i)
            plgpu.copy_gmem_to_smem(q_ref.at[n, h // G], q_smem.at[b], bar.at[b])
            plgpu.copy_gmem_to_smem(k_ref.at[n, h // G], k_smem.at[b], bar.at[b])
            plgpu.copy_gmem_to_smem(g_ref.at[n, h], g_smem.at[b], bar.at[b])
            plgpu.copy_gmem_to_smem(v_ref.at[n, h, pl.ds(v0, vt)], v_smem.at[b], bar.at[b])
            plgpu.copy_gmem_to_smem(src_ref.at[row, :, pl.ds(v0, vt)], s_smem.at[b], bar.at[b])

        row0 = row_of(p)
        issue(p, row0, 0)

        def body(c, row_next):  # row_next: the pool row of this CTA's tile c + 1
            b, i = lax.rem(c, 2), p + c * P

            @pl.when(c + 1 < count)
            def _():  # tile c + 1 into the other buffer, once tile c - 1's stores have read it
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                issue(i + P, row_next, 1 - b)

            row_after = row_of(i + 2 * P)  # read now, used a tile later
            row = row_of(i) if dst_ref is None else None  # in place: tile c's own row (read before the wait)
            n, h, v0 = coords(i)
            bt = b_ref[n, h].astype(f32)
            rs = reset_ref[n]
            plgpu.barrier_wait(bar.at[b])
            vecs = vectors(q_smem.at[b], k_smem.at[b], g_smem.at[b])
            o_smem.at[b][...] = step_in_smem(s_smem.at[b], v_smem.at[b], vecs, bt, rs)
            plgpu.commit_smem()
            dst = src_ref.at[row, :, pl.ds(v0, vt)] if dst_ref is None else dst_ref.at[n * HV + h, :, pl.ds(v0, vt)]
            plgpu.copy_smem_to_gmem(s_smem.at[b], dst)
            plgpu.copy_smem_to_gmem(o_smem.at[b], o_ref.at[n, h, pl.ds(v0, vt)])
            return row_after

        lax.fori_loop(0, count, body, row_of(p + P))
        plgpu.wait_smem_to_gmem(0, wait_read_only=read_only_wait)

    if P is not None:
        pscratch = [
            plgpu.SMEM((2, K, vt), jnp.float32, **({} if interpret else f32_tiled())),
            plgpu.SMEM((2, K), q.dtype),
            plgpu.SMEM((2, K), k.dtype),
            plgpu.SMEM((2, K), g.dtype),
            plgpu.SMEM((2, vt), v.dtype),
            plgpu.SMEM((2, vt), jnp.float32),
            plgpu.Barrier(num_arrivals=5, num_barriers=2),
        ]
        o_type = jax.ShapeDtypeStruct((N, HV, V), jnp.float32)
        ins = (q, k, v, g, beta, slots.astype(jnp.int32), reset.astype(jnp.int32))
        interp = {"interpret": gpu_interpret_params()} if interpret else {}
        kw = dict(grid=(P,), grid_names=("cta",), scratch_types=pscratch, compiler_params=params,
                  kernel_name="kda_decode_persistent_mgpu", **interp)
        if api == "ref":
            pool_ref = jax.new_ref(pool3)
            o = plgpu.kernel(lambda *r: persistent(*r[:7], r[8], r[7], None, *r[9:]), out_type=o_type, **kw)(
                *ins, pool_ref)
            return o, pool_ref[...].reshape(pool.shape)
        if api == "scatter":
            o, new = plgpu.kernel(
                lambda *r: persistent(*r[:7], r[8], r[7], r[9], *r[10:]),
                out_type=[o_type, jax.ShapeDtypeStruct((N * HV, K, V), jnp.float32)], **kw)(*ins, pool3)
            return o, pool.at[slots, layer].set(new.reshape(N, HV, K, V))
        raise ValueError(f"the persistent decode takes api 'ref' or 'scatter', got {api!r}")

    scratch = [
        plgpu.SMEM((tiles, K, vt), jnp.float32, **({} if interpret else f32_tiled())),
        plgpu.SMEM((K,), q.dtype),
        plgpu.SMEM((K,), k.dtype),
        plgpu.SMEM((K,), g.dtype),
        plgpu.SMEM((span,), v.dtype),
        plgpu.SMEM((span,), jnp.float32),
        plgpu.Barrier(num_arrivals=4, num_barriers=1),
        plgpu.Barrier(num_arrivals=1, num_barriers=tiles),
    ]
    o_type = jax.ShapeDtypeStruct((N, HV, V), jnp.float32)
    ins = (q, k, v, g, beta, slots.astype(jnp.int32), reset.astype(jnp.int32))
    interp = {"interpret": gpu_interpret_params()} if interpret else {}
    if api == "ref":  # JAX >= 0.11: the pool goes in as a mutable JAX Ref, written in place
        pool_ref = jax.new_ref(pool3)

        def body(q_ref, k_ref, v_ref, g_ref, b_ref, slot_ref, reset_ref, pool_r, o_ref, *scr):
            n, h = lax.axis_index("seq"), lax.axis_index("head")
            v0 = lax.axis_index("vtile") * span
            step(n, h, v0, q_ref, k_ref, v_ref, g_ref, b_ref, slot_ref, reset_ref, o_ref, pool_r, None, *scr)

        o = plgpu.kernel(
            body, out_type=o_type, grid=(N, HV, V // span), grid_names=("seq", "head", "vtile"),
            scratch_types=scratch, compiler_params=params, kernel_name="kda_decode_mgpu", **interp,
        )(*ins, pool_ref)
        return o, pool_ref[...].reshape(pool.shape)
    if api == "scatter":
        def body(q_ref, k_ref, v_ref, g_ref, b_ref, slot_ref, reset_ref, pool_ref, o_ref, new_ref, *scr):
            n, h = lax.axis_index("seq"), lax.axis_index("head")
            v0 = lax.axis_index("vtile") * span
            step(n, h, v0, q_ref, k_ref, v_ref, g_ref, b_ref, slot_ref, reset_ref, o_ref, pool_ref, new_ref, *scr)

        o, new = plgpu.kernel(
            body, out_type=[o_type, jax.ShapeDtypeStruct((N * HV, K, V), jnp.float32)],
            grid=(N, HV, V // span), grid_names=("seq", "head", "vtile"),
            scratch_types=scratch, compiler_params=params, kernel_name="kda_decode_mgpu", **interp,
        )(*ins, pool3)
        return o, pool.at[slots, layer].set(new.reshape(N, HV, K, V))
    if api != "pallas_call":
        raise ValueError(f"unknown decode api {api!r}")

    def kernel(q_ref, k_ref, v_ref, g_ref, b_ref, slot_ref, reset_ref, _pool_in, o_ref, pool_ref, *scr):
        n, h = pl.program_id(0), pl.program_id(1)
        step(n, h, pl.program_id(2) * span, q_ref, k_ref, v_ref, g_ref, b_ref, slot_ref, reset_ref, o_ref,
             pool_ref, None, *scr)

    gm = pl.BlockSpec(memory_space=plgpu.GMEM)
    o, pool3 = pl.pallas_call(
        kernel,
        grid=(N, HV, V // span),
        in_specs=[gm] * 8,
        out_specs=[gm, gm],
        out_shape=[o_type, jax.ShapeDtypeStruct(pool3.shape, jnp.float32)],
        input_output_aliases={7: 1},
        scratch_shapes=scratch,
        compiler_params=params,
        name="kda_decode_mgpu",
    )(*ins, pool3)
    return o, pool3.reshape(pool.shape)


# ---- chunked prefill: intra-chunk prep -----------------------------------------------------


# chunk boxes start on multiples of this many packed rows (`chunk_table(..., align=_ALIGN)`): a chunk
# whose first token is row tok holds it at chunk position tok % _ALIGN
_ALIGN = 8
# Each segment of a varlen prefill (a sequence, or the parts of one around its snapshot token) moved to
# a row that is a multiple of 8 before the kernels (`_segment_layout`: a gather of the inputs, and of o
# back), so its chunk grid starts at its first token. Without it the grid starts at that row rounded down
# to 8, and a sequence's rounding (the chunk operands are bf16) depends on the lengths of the sequences
# before it in the pack: on batch composition. Off: the gathers copy the inputs and o when there are two or
# more segments (device call 11, session 23, H100: 8 x 4k x 12 prefill 1.92 ms aligned against 1.35 packed);
# the batch-invariant mode aligns regardless. Read at trace time.
ALIGN_SEGMENTS = False


class SegmentLayout(NamedTuple):
    """Where the kernels find a varlen prefill's segments (`_segment_layout`)."""

    cu: jax.Array  # i32[S + 1] the segments' bounds in the kernels' rows
    rows: int  # the kernels' row count R
    src: jax.Array | None  # i32[R] the packed row each kernel row holds (-1: a pad row); None: the same rows
    back: jax.Array | None  # i32[T] the kernel row of each packed row; None: the same rows


def _segments(cu_seqlens, T, snapshot_at=None):
    """The chunk kernels' segments over the T packed rows: each sequence (with snapshot_at, its first
    snapshot_at[i] tokens and the rest: a chunk ends at the snapshot token), then the padding tokens past
    cu[N] as one more (discarded) segment with zero inputs, so the kernels write every output row and the
    padding rows come out 0 -> i32[S + 1] bounds."""
    cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    if snapshot_at is None:
        return jnp.concatenate([cu, jnp.full((1,), T, jnp.int32)])
    a = jnp.clip(jnp.asarray(snapshot_at, jnp.int32), 0, cu[1:] - cu[:-1])
    mid = cu[:-1] + a  # segments [start, start + a), [start + a, end), then the padding and an empty one
    return jnp.concatenate([jnp.stack([cu[:-1], mid], 1).reshape(-1), cu[N:], jnp.full((2,), T, jnp.int32)])


def _segment_layout(seg, T, aligned: bool) -> SegmentLayout:
    """The packed rows as they are, or (aligned) every segment of `seg` starting on a multiple of
    _ALIGN rows, followed by up to _ALIGN - 1 pad rows (R = T + (_ALIGN - 1) S rounded up to _ALIGN)."""
    if not aligned:
        return SegmentLayout(seg, T, None, None)
    S = seg.shape[0] - 1
    lens = seg[1:] - seg[:-1]
    pcu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(-(-lens // _ALIGN) * _ALIGN).astype(jnp.int32)])
    R = -(-(T + (_ALIGN - 1) * S) // _ALIGN) * _ALIGN
    r = jnp.arange(R, dtype=jnp.int32)
    s_r = jnp.clip(jnp.searchsorted(pcu[1:], r, side="right"), 0, S - 1)
    off = r - pcu[s_r]
    src = jnp.where((r < pcu[S]) & (off < lens[s_r]), seg[s_r] + off, -1)
    t = jnp.arange(T, dtype=jnp.int32)
    s_t = jnp.clip(jnp.searchsorted(seg[1:], t, side="right"), 0, S - 1)
    return SegmentLayout(pcu, R, src, pcu[s_t] + t - seg[s_t])


def _layout_for(cu_seqlens, T, snapshot_at=None) -> SegmentLayout:
    """The layout a prefill of these sequences runs in: by segment when `ALIGN_SEGMENTS` (or the
    batch-invariant mode, `dispatch.batch_invariant`) is on and there
    are two or more real segments (a single sequence already starts at row 0), else the packed rows."""
    N = cu_seqlens.shape[0] - 1
    aligned = (ALIGN_SEGMENTS or batch_invariant_rows() > 0) and (N > 1 or snapshot_at is not None)
    return _segment_layout(_segments(cu_seqlens, T, snapshot_at), T, aligned)


def _bf16_split(x):
    """f32 -> (hi, lo) bf16 with hi + lo = x to ~16 bits: a product of two splits (three wgmma,
    dropping lo x lo) is close to f32."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


_L2_EPS = 1e-6  # `ref.l2norm`'s


def _gate_rows(gate, HV, K):
    """The gate's per-channel parameters as the prep kernel loads them: [2, HV, K] f32 (dt_bias and
    exp(a_log) repeated over the K channels), one TMA of a head's two rows."""
    a = jnp.exp(jnp.asarray(gate.a_log, jnp.float32))
    db = jnp.asarray(gate.dt_bias, jnp.float32).reshape(HV, K)
    return jnp.stack([db, jnp.broadcast_to(a[:, None], (HV, K))])


def _chunk_prep_call(q, k, v, g, beta_t, ctok, cnum, cval, *, scale, interpret=False, loops=False, gate=None,
                     qk_l2norm=False):
    """Intra-chunk prep (`prep.chunk_prep`'s algorithm) as one Mosaic GPU kernel: one CTA (one
    warpgroup) per (chunk, value head), its inputs TMA-loaded straight from the packed tokens.

    q, k [R, H, K] bf16; v [R, HV, V] bf16; g [R, HV, K] f32; beta_t [HV, R] f32, packed rows (R a
    multiple of 8); ctok [NC] the first packed row of each chunk: its box of C rows starts at
    ctok rounded down to a multiple of 8 (`chunk_table(..., align=8)`; TMA boxes into swizzled
    tiles start on whole tiles of 8 rows); cnum [NC] its token count (0: a dead chunk, skipped) and
    cval [NC] its count of real tokens (the box's rows outside [ctok, ctok + cval) are zeroed after
    the load, so chunks of padding come out zero). Returns the
    chunk-layout operands w, qg, kd [NC, HV, C, K] bf16, u0 [NC, HV, C, V] bf16, aqk
    [NC, HV, C, C] bf16 and gl [NC, HV, K] f32, chunk position p holding box row p (the first
    ctok % 8 positions are zero). interpret: Mosaic GPU interpret mode (CPU). loops
    (v6): the six levels and the Neumann doubling as `lax.fori_loop`s, one copy of each body in
    the kernel's code, instead of unrolled (v4: ~21k straight-line PTX instructions per thread).

    On the tensor cores (bf16 operands, f32 accumulation): the decay sums D = S g with g split in
    two bf16 parts (S in {-1, 0, 1}: exact); the level scores in bf16 (like the inter kernel's
    operands); the solve's ten 64 x 64 products with both sides split (three wgmma each); w and
    u0 from the bf16 inverse, as fla does.

    gate (`ref.Gate`): g [R, HV, K] holds the gate logits (bf16 or f32) and the kernel computes the
    log decay from them at the load (`ref.kda_gate_ref`'s formula; exp and log are approximate, as
    every exp here), so g is neither written nor read in f32. qk_l2norm: q and k come
    un-normalised and are L2-normalised at the load (`ref.l2norm`, rsqrt). Both as
    flash-linear-attention's `use_gate_in_kernel` / `use_qk_l2norm_in_kernel`."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    NC = ctok.shape[0]
    C = CHUNK_TOKENS
    Gq = HV // H
    f32, bf = jnp.float32, jnp.bfloat16
    nl = C.bit_length() - 1
    assert C == 64 and K % 64 == 0 and V % 64 == 0
    # swizzled tiles for TMA and wgmma (interpret mode simulates plain row-major SMEM)
    tiled = lambda shape, dt: {} if interpret else (f32_tiled() if dt == f32 else bf16_tiled(shape[-1]))

    fused_gate = gate is not None
    lower_bound = gate.lower_bound if fused_gate else None

    def kernel(q_ref, k_ref, v_ref, g_ref, b_ref, ctok_ref, cnum_ref, cval_ref, *refs):
        if fused_gate:
            gp_ref, *refs = refs
        w_ref, qg_ref, kd_ref, u0_ref, aqk_ref, gl_ref, q_s, k_s, gs_s, b_s, bar, vbar = refs
        c = lax.axis_index("chunk")
        h = lax.axis_index("head")
        tok = ctok_ref[c]
        cnt = cval_ref[c]
        lead = lax.rem(tok, _ALIGN)  # rows of the chunk's box before its first token
        box = tok - lead  # the box's first packed row: a multiple of 8, as a TMA box into swizzled tiles needs
        hq = h // Gq
        # Index tiles are rebuilt where used and constants stay splat scalars, to keep registers
        # free; the scratch beyond q, k, the g split and beta lives in scopes (SMEM is a stack),
        # so two CTAs fit on an SM.
        cast = (lambda x, layout: x) if interpret else plgpu.layout_cast
        it = lambda shape, d: cast(lax.broadcasted_iota(jnp.int32, shape, d), WGMMA)
        ti = lambda: it((C, C), 0)
        ii = lambda: it((C, C), 1)
        load = (lambda ref, layout: ref[...]) if interpret else load_tile
        ld = lambda ref: load(ref, WGMMA).astype(f32)
        smem = lambda shape, dt: plgpu.SMEM(shape, dt, **tiled(shape, dt))

        def mm(pairs, shape):
            """sum of a @ b (bf16 operands, f32 accumulation) on the tensor cores; a is an array,
            b a ref or ("T", ref) for its transpose. Interpret mode computes it with jnp."""
            if interpret:
                val = lambda b: b[1][...].T if isinstance(b, tuple) else b[...]
                return sum(jnp.dot(a.astype(f32), val(b).astype(f32), precision=lax.Precision.HIGHEST) for a, b in pairs)

            def fn(acc):
                for a, b in pairs:
                    plgpu.wgmma(acc, a, plgpu.transpose_ref(b[1], (1, 0)) if isinstance(b, tuple) else b)
                return acc[...]

            return pl.run_scoped(fn, plgpu.ACC(shape, f32))

        def dsum(S):  # S [C, C] in {-1, 0, 1} (f32) -> S @ g [C, K] f32
            Sb = S.astype(bf)
            return mm([(Sb, gs_s.at[0]), (Sb, gs_s.at[1])], (C, K))

        def store_out(val, out_ref, dt=bf):  # stage in a scoped buffer, TMA out, wait for the read
            def fn(buf):
                buf[...] = val.astype(dt)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(buf, out_ref)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            shape = val.shape
            pl.run_scoped(fn, smem(shape, dt) if len(shape) == 2 else plgpu.SMEM(shape, dt))

        @pl.when(cnum_ref[c] > 0)
        def _():
            # the chunk's box is read straight from the packed tokens; its rows outside the chunk's
            # real tokens [lead, lead + cnt) (the previous sequence's last tokens, the next one's
            # first, padding) -> 0, once, in place
            live = lambda n: (it((C, n), 0) >= lead) & (it((C, n), 0) < lead + cnt)

            def load_g(g_in, *gp_s):
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(box, C), hq], q_s, bar.at[0])
                plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(box, C), hq], k_s, bar.at[0])
                plgpu.copy_gmem_to_smem(b_ref.at[h, pl.ds(box, C)], b_s, bar.at[0])
                plgpu.copy_gmem_to_smem(g_ref.at[pl.ds(box, C), h], g_in, bar.at[0])
                for j, p_s in enumerate(gp_s):  # the gate's dt_bias and exp(a_log) rows of this head
                    plgpu.copy_gmem_to_smem(gp_ref.at[j, h], p_s, bar.at[0])
                plgpu.barrier_wait(bar.at[0])
                lk = live(K)  # built once: index tiles cost registers and instructions
                if qk_l2norm:  # x / sqrt(|x|^2 + eps) per row, in f32 (rows outside the chunk: masked below)
                    unit = lambda x: x * _bc_rows(lax.rsqrt(jnp.sum(x * x, axis=1) + _L2_EPS), (C, K))
                else:
                    unit = lambda x: x
                q_s[...] = jnp.where(lk, unit(ld(q_s)), 0.0).astype(bf)
                k_s[...] = jnp.where(lk, unit(ld(k_s)), 0.0).astype(bf)
                gv = ld(g_in)
                if fused_gate:  # the log decay from the logits (rows outside the chunk: masked below)
                    col = lambda p_s: _bc_cols(load(p_s, COL), (C, K))
                    x = gv + col(gp_s[0])
                    a = col(gp_s[1])
                    if lower_bound is None:  # -a softplus(x), softplus(x) = max(x, 0) + log(1 + exp(-|x|))
                        gv = -a * (jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x))))
                    else:  # lower_bound sigmoid(a x)
                        gv = lower_bound / (1.0 + jnp.exp(-(a * x)))
                g_hi, g_lo = _bf16_split(jnp.where(lk, gv, 0.0))
                gs_s[0] = g_hi
                gs_s[1] = g_lo
                plgpu.commit_smem()

            g_bufs = [smem((C, K), g_ref.dtype)]  # f32, or bf16 gate logits
            if fused_gate:
                g_bufs += [plgpu.SMEM((K,), f32), plgpu.SMEM((K,), f32)]
            with jax.named_scope("load"):
                pl.run_scoped(load_g, *g_bufs)

            # level of each pair, plus one: 1 + the highest bit of t ^ i, 0 on the diagonal (kept
            # non-negative: these int arrays compare unsigned); level l's pairs are t > i with
            # lev1 == l + 1, and its decay sums S_l g (G_t - G_ref) have S_l in {-1, 0, 1}
            x = ti() ^ ii()
            lev1 = jnp.where(x == 0, 0, 1)
            for bit in range(1, nl):
                lev1 = lev1 + jnp.where(x >= (1 << bit), 1, 0)

            def levels(r_s):
                # loops (v6): one level per iteration of a lax loop, the level a runtime value, so the
                # kernel's code holds one level; otherwise (v4) the six levels are unrolled
                rT = ("T", r_s)

                def level_sums(lv):  # D_t = G_t - G_r, r the middle row of t's 2^(lv+1)-row block
                    b = (1 << lv) if isinstance(lv, int) else jnp.left_shift(jnp.int32(1), lv)
                    t_, i_ = ti(), ii()
                    tb = (t_ & b) != 0
                    return dsum(jnp.where(lev1 <= lv, jnp.where(i_ <= t_, jnp.where(tb, 1.0, 0.0),
                                                                jnp.where(tb, 0.0, -1.0)), 0.0))

                def scores(ek, eq, pair_mask):
                    """The two score products ek r^T, eq r^T (r in r_s) under one wait, masked to the pairs
                    (the mask built meanwhile)."""
                    if interpret:
                        sel = pair_mask()
                        return jnp.where(sel, mm([(ek, rT)], (C, C)), 0.0), jnp.where(sel, mm([(eq, rT)], (C, C)), 0.0)

                    def pair(acc_k, acc_q):
                        plgpu.wgmma(acc_k, ek, plgpu.transpose_ref(r_s, (1, 0)))
                        plgpu.wgmma(acc_q, eq, plgpu.transpose_ref(r_s, (1, 0)))
                        sel = pair_mask()
                        return jnp.where(sel, acc_k[...], 0.0), jnp.where(sel, acc_q[...], 0.0)

                    return pl.run_scoped(pair, plgpu.ACC((C, C), f32), plgpu.ACC((C, C), f32))

                def level(j, carry):
                    lv = nl - 1 - j  # a Python int when unrolled (v4), traced in the loop (v6)
                    d = level_sums(lv)
                    # rows in the second half need exp(D), rows in the first half exp(-D): both are
                    # exp(-|D|), and the other rows' values are masked out below
                    e = jnp.exp(jnp.minimum(d, -d))
                    ek = (ld(k_s) * e).astype(bf)
                    r_s[...] = ek
                    plgpu.commit_smem()
                    eq = (ld(q_s) * e).astype(bf)
                    sk, sq = scores(ek, eq, lambda: (lev1 == lv + 1) & (ti() > ii()))
                    return (sk, sq) if carry is None else (carry[0] + sk, carry[1] + sq)

                if loops:
                    zero = jnp.zeros((C, C), f32) if interpret else plgpu.layout_cast(jnp.zeros((C, C), f32), WGMMA)
                    return lax.fori_loop(0, nl, level, (zero, zero))
                carry = None
                for j in range(nl):
                    carry = level(j, carry)
                return carry

            with jax.named_scope("levels"):
                akk, aqk = pl.run_scoped(levels, smem((C, K), bf))
            with jax.named_scope("aqk_out"):
                qk = mm([(load(q_s, WGMMA), ("T", k_s))], (C, C))
                store_out((aqk + jnp.where(ti() == ii(), qk, 0.0)) * scale, aqk_ref.at[c, h])

            # per-token outputs: G, G_C - G -> gl, kd, qg; the right-hand sides (beta exp(G) k,
            # beta v) go over the g split, whose last reads are G and G_C - G
            with jax.named_scope("token_outs"):
                G = dsum(jnp.where(ii() <= ti(), 1.0, 0.0))
                dl = dsum(jnp.where(ii() > ti(), 1.0, 0.0))
                store_out(jnp.exp(jnp.sum(jnp.where(it((C, K), 0) == C - 1, G, 0.0), axis=0)), gl_ref.at[c, h], f32)
                kk = ld(k_s)
                store_out(kk * jnp.exp(dl), kd_ref.at[c, h])
                eG = jnp.exp(G)
                # beta of the rows outside the chunk may be anything (NaN too): masked once, as a
                # row vector; k and g are already zero there, so the products below are zero
                rows = cast(lax.broadcasted_iota(jnp.int32, (C,), 0), ROW)
                bt = jnp.where((rows >= lead) & (rows < lead + cnt), load(b_s, ROW), 0.0)
                gs_s[0] = (kk * eG * _bc_rows(bt, (C, K))).astype(bf)

                def load_v(v_s):
                    plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(box, C), h], v_s, vbar.at[0])
                    plgpu.barrier_wait(vbar.at[0])
                    gs_s[1] = jnp.where(live(V), ld(v_s) * _bc_rows(bt, (C, V)), 0.0).astype(bf)

                pl.run_scoped(load_v, smem((C, V), bf))
                q_s[...] = (ld(q_s) * (eG * scale)).astype(bf)  # qg, stored last
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_s, qg_ref.at[c, h])

            # (I + A)^-1, A = beta * akk (rows past cnt are 0: k is 0 there): the 16 x 16 diagonal
            # blocks by Neumann doubling, then the merge (I - M)(I + M^2) D^-1
            A = akk * _bc_rows(bt, (C, C))

            def solve(p_s):
                def mm3(X, Y):
                    yh, yl = _bf16_split(Y)
                    p_s[0] = yh
                    p_s[1] = yl
                    plgpu.commit_smem()
                    xh, xl = _bf16_split(X)
                    return mm([(xh, p_s.at[0]), (xl, p_s.at[0]), (xh, p_s.at[1])], (C, C))

                diag = lambda: (ti() >> 4) == (ii() >> 4)
                N = jnp.where(diag(), -A, 0.0)
                Dinv = jnp.where(ti() == ii(), 1.0, 0.0) + N

                def neumann(_, carry):
                    N, Dinv = carry
                    N = mm3(N, N)
                    return N, Dinv + mm3(Dinv, N)

                if loops:
                    N, Dinv = lax.fori_loop(0, 3, neumann, (N, Dinv))
                else:
                    for j in range(3):
                        N, Dinv = neumann(j, (N, Dinv))
                M = mm3(Dinv, jnp.where(diag(), 0.0, A))
                Y = Dinv + mm3(mm3(M, M), Dinv)
                return (Y - mm3(M, Y)).astype(bf)

            with jax.named_scope("solve"):
                Tinv = pl.run_scoped(solve, plgpu.SMEM((2, C, C), bf, **tiled((C, C), bf)))
            with jax.named_scope("w_u0"):
                store_out(mm([(Tinv, gs_s.at[0])], (C, K)), w_ref.at[c, h])
                store_out(mm([(Tinv, gs_s.at[1])], (C, V)), u0_ref.at[c, h])
                plgpu.wait_smem_to_gmem(0)

    sds = jax.ShapeDtypeStruct
    f = plgpu.kernel(
        kernel,
        out_type=[sds((NC, HV, C, K), bf), sds((NC, HV, C, K), bf), sds((NC, HV, C, K), bf),
                  sds((NC, HV, C, V), bf), sds((NC, HV, C, C), bf), sds((NC, HV, K), f32)],
        grid=(NC, HV),
        grid_names=("chunk", "head"),
        scratch_types=[
            plgpu.SMEM((C, K), bf, **tiled((C, K), bf)),  # q (rows past cnt zeroed), at the end qg
            plgpu.SMEM((C, K), bf, **tiled((C, K), bf)),  # k
            plgpu.SMEM((2, C, K), bf, **tiled((C, K), bf)),  # g split, then the right-hand sides
            plgpu.SMEM((C,), f32),  # beta
            plgpu.Barrier(num_arrivals=6 if fused_gate else 4, num_barriers=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
        ],
        compiler_params=_PREP_PARAMS,
        kernel_name="kda_chunk_prep_mgpu" + ("_gate" if fused_gate else "") + ("_l2" if qk_l2norm else ""),
        **({"interpret": gpu_interpret_params()} if interpret else {}),
    )
    extra = [_gate_rows(gate, HV, K)] if fused_gate else []
    return f(q, k, v, g, beta_t, ctok, cnum, cval, *extra)


# ---- chunked prefill -----------------------------------------------------------------------

_LADDER = (64, 32, 16, 8, 4, 2, 1)


def _chunk_inter_call(w, qg, kdT, aqk, u0, gl, h0, ccu, ctok, cnum, T, *, vt, pool=None, rows=None,
                      snap=False, api="ref"):
    """Sequential part. Chunk-layout operands (NC chunks): w, qg [NC, HV, C, K] bf16; kdT
    [NC, HV, K, C] bf16; aqk [NC, HV, C, C] bf16; u0 [NC, HV, C, V] bf16; gl [NC, HV, K] f32;
    ctok / cnum [NC] first packed token and token count of each chunk (which holds that token at
    chunk position ctok % 8: `chunk_table(..., align=8)`). One CTA per (sequence, value
    head, V tile) walks its sequence's chunks.

    ccu: the chunk offsets of the NS sequences, [NS + 1]; with `snap`, of 2 NS segments, [2 NS + 1]:
    sequence n is segments 2n and 2n + 1, and the state after segment 2n is its snapshot.

    States, one of:
    - `h0` [NS, HV, K, V] f32 -> (o [T, HV, V] f32, ht [NS, HV, K, V] f32[, snapshots [NS, ...]]);
    - `pool` [R, K, V] f32 (state rows) with `rows` = (src, dst, snp) [NS] int32 row bases (row =
      base + value head; src < 0: start from zero; dst / snp < 0: not written). api "ref" (JAX >=
      0.11): the pool is passed as a JAX Ref and written in place -> (o, pool); api "scatter": the
      pool is read only and the states come back as arrays for the caller to scatter -> (o, ht[,
      snapshots])."""
    NC, HV, C, K = w.shape
    V = u0.shape[-1]
    NS = (ccu.shape[0] - 1) // (2 if snap else 1)
    assert C == 64 and K % 64 == 0 and V % vt == 0 and (h0 is None) != (pool is None)
    in_place = pool is not None and api == "ref"
    state_t = jax.ShapeDtypeStruct((NS, HV, K, V), jnp.float32)
    out_type = [jax.ShapeDtypeStruct((T, HV, V), jnp.float32)] + ([] if in_place else [state_t] * (2 if snap else 1))
    ins = [w, qg, kdT, aqk, u0, gl, ccu, ctok, cnum]
    if pool is None:
        ins.append(h0)
    else:
        ins += list(rows)
        if not in_place:
            ins.append(pool)
    n_in = len(ins) + (1 if in_place else 0)

    def kernel(*refs):
        w_ref, qg_ref, kdT_ref, aqk_ref, u0_ref, gl_ref, ccu_ref, ctok_ref, cnum_ref = refs[:9]
        outs = refs[n_in: n_in + len(out_type)]
        w_s, qg_s, kdT_s, aqk_s, u0_s, gl_s, sb, ub, obuf, sst, bar, sbar = refs[n_in + len(out_type):]
        o_ref = outs[0]
        n = lax.axis_index("seq")
        h = lax.axis_index("head")
        v0 = lax.axis_index("vtile") * vt
        tile = lambda ref, *row: ref.at[(*row, slice(None), pl.ds(v0, vt))]
        if pool is None:  # state tiles of the h0 / ht / snapshot arrays
            src, zero_start = tile(refs[9], n, h), None
            dst = lambda i: (tile(outs[1 + i], n, h), None)
        else:  # state rows of the pool (in place), or ht / snapshot arrays for the caller's scatter
            base = [r[n] for r in refs[9:12]]
            pool_ref = refs[12]
            src, zero_start = tile(pool_ref, jnp.maximum(base[0], 0) + h), base[0] < 0
            if in_place:
                dst = lambda i: (tile(pool_ref, jnp.maximum(base[i + 1], 0) + h), base[i + 1] >= 0)
            else:
                dst = lambda i: (tile(outs[1 + i], n, h), None)
        c0 = ccu_ref[2 * n if snap else n]
        cs = ccu_ref[2 * n + 1] - c0 if snap else None  # chunks before the snapshot
        nc = ccu_ref[2 * n + 2 if snap else n + 1] - c0

        def issue(ci, slot):
            b = bar.at[slot]
            plgpu.copy_gmem_to_smem(w_ref.at[ci, h], w_s.at[slot], b)
            plgpu.copy_gmem_to_smem(qg_ref.at[ci, h], qg_s.at[slot], b)
            plgpu.copy_gmem_to_smem(kdT_ref.at[ci, h], kdT_s.at[slot], b)
            plgpu.copy_gmem_to_smem(aqk_ref.at[ci, h], aqk_s.at[slot], b)
            plgpu.copy_gmem_to_smem(u0_ref.at[ci, h, :, pl.ds(v0, vt)], u0_s.at[slot], b)
            plgpu.copy_gmem_to_smem(gl_ref.at[ci, h], gl_s.at[slot], b)

        def store_state(S, i):
            """S -> state output i (0: final, 1: snapshot) through sst; a pool row with a negative
            base is not written (the TMA store's predicate: no store to the pool under a branch)."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            sst[...] = S
            plgpu.commit_smem()
            ref, pred = dst(i)
            if pred is None:
                plgpu.copy_smem_to_gmem(sst, ref)
            else:
                plgpu.copy_smem_to_gmem(sst, ref, predicate=pred)

        plgpu.copy_gmem_to_smem(src, sst, sbar.at[0])

        @pl.when(nc > 0)
        def _():
            issue(c0, 0)

        plgpu.barrier_wait(sbar.at[0])
        if zero_start is not None:  # a reset sequence starts from zeros, whatever the row it read holds
            # (not a select of the loaded tile: Warpgroup semantics has no scalar-vs-tile select)

            @pl.when(zero_start)  # (each thread rewrites its own fragment: no barrier before the load)
            def _():
                sst[...] = plgpu.layout_cast(jnp.zeros((K, vt), jnp.float32), WGMMA)

        S = load_tile(sst, WGMMA, optimized=False)

        def body(c, S):
            slot = lax.rem(c, 2)

            @pl.when(c + 1 < nc)
            def _():
                issue(c0 + c + 1, 1 - slot)

            plgpu.barrier_wait(bar.at[slot])
            sb[...] = S.astype(jnp.bfloat16)
            plgpu.commit_smem()

            def wS_fn(acc):
                plgpu.wgmma(acc, w_s.at[slot], sb)
                return acc[...]

            wS = pl.run_scoped(wS_fn, plgpu.ACC((C, vt), jnp.float32))
            u = load_tile(u0_s.at[slot], WGMMA).astype(jnp.float32) - wS
            ub[...] = u.astype(jnp.bfloat16)
            plgpu.commit_smem()
            glv = load_tile(gl_s.at[slot], ROW)

            def upd(refs):
                acc_o, acc_s = refs
                plgpu.wgmma(acc_o, qg_s.at[slot], sb)
                plgpu.wgmma(acc_o, aqk_s.at[slot], ub)
                plgpu.wgmma(acc_s, kdT_s.at[slot], ub)

            zeros = plgpu.layout_cast(jnp.zeros((C, vt), jnp.float32), WGMMA)
            o, S = pl.run_state(upd)((plgpu.ACC.init(zeros), plgpu.ACC.init(S * _bc_rows(glv, (K, vt)))))
            # o -> packed rows [tok, tok + cnt) through a ladder of static-size TMA stores
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this buffer's stores from chunk c-2
            obuf[pl.ds(slot * C, C), :] = o
            plgpu.commit_smem()
            ci = c0 + c
            tok = ctok_ref[ci]
            cnt = cnum_ref[ci]
            base = slot * C + lax.rem(tok, _ALIGN)  # the chunk's first token in obuf
            off = jnp.int32(0)
            for p in _LADDER:
                take = (cnt & p) != 0
                plgpu.copy_smem_to_gmem(
                    obuf.at[pl.ds(base + off, p)], o_ref.at[pl.ds(tok + off, p), h, pl.ds(v0, vt)],
                    predicate=take, commit_group=False,
                )
                off = off + jnp.where(take, p, 0)
            plgpu.commit_smem_to_gmem_group()
            return S

        if snap:  # two loops (no state store under a branch), the snapshot stored between them
            S = lax.fori_loop(0, cs, body, S)
            store_state(S, 1)
            S = lax.fori_loop(cs, nc, body, S)
        else:
            S = lax.fori_loop(0, nc, body, S)
        store_state(S, 0)
        plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(NS, HV, V // vt),
        grid_names=("seq", "head", "vtile"),
        scratch_types=[
            # the A operands' swizzle must match their B operands' ([*, vt] tiles: 2 * vt bytes a row)
            plgpu.SMEM((2, C, K), jnp.bfloat16, **bf16_tiled(K, 2 * vt)),
            plgpu.SMEM((2, C, K), jnp.bfloat16, **bf16_tiled(K, 2 * vt)),
            plgpu.SMEM((2, K, C), jnp.bfloat16, **bf16_tiled(C, 2 * vt)),
            plgpu.SMEM((2, C, C), jnp.bfloat16, **bf16_tiled(C, 2 * vt)),
            plgpu.SMEM((2, C, vt), jnp.bfloat16, **bf16_tiled(vt)),
            plgpu.SMEM((2, K), jnp.float32),
            plgpu.SMEM((K, vt), jnp.bfloat16, **bf16_tiled(vt)),
            plgpu.SMEM((C, vt), jnp.bfloat16, **bf16_tiled(vt)),
            plgpu.SMEM((2 * C, vt), jnp.float32),
            plgpu.SMEM((K, vt), jnp.float32),
            plgpu.Barrier(num_arrivals=6, num_barriers=2),
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
        ],
        # Warpgroup semantics, named: JAX 0.11.2's default (what the H200 runs), not 0.10.2's (Lane), so
        # the CPU lowering test checks the lowering the GPU gets
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name="kda_chunk_mgpu",
    )
    if in_place:
        pool_ref = jax.new_ref(pool)
        res = f(*ins, pool_ref)
        o = res[0] if isinstance(res, (list, tuple)) else res
        return o, pool_ref[...]
    return tuple(f(*ins))


def inter_vt(num_seqs: int, HV: int, V: int) -> int:
    """The inter kernel's V tile: 64, or 32 when the (sequence, head, 64-wide V tile) CTAs do not fill
    the SMs (one sequence x 12 heads: 24 CTAs). Measured on the H200 at 32k / 12 heads: vt 32 0.97 ms
    against vt 64 1.07 (bench/NOTES.md)."""
    return 32 if num_seqs * HV * (V // 64) < SMS else 64


def chunk(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, vt=None, prep="mgpu_loop", snapshot_at=None,
          gate=None, qk_l2norm=False):
    """Varlen chunked KDA: q, k [1, T, H, K]; v [1, T, HV, V]; g [1, T, HV, K]; beta [1, T, HV];
    initial_state [N, HV, K, V] f32 (or None); cu_seqlens [N + 1] -> (o [1, T, HV, V] f32,
    final_state [N, HV, K, V] f32). prep: "mgpu_loop" (the prep kernel with its levels and Neumann
    doubling as loops: v6, the default), "mgpu" (the same kernel unrolled: v4, 2.4x slower on the
    H200) or "xla" (`prep.chunk_prep`). vt: the inter kernel's V tile (None: `inter_vt`).
    snapshot_at [N] int: also return the state after the first snapshot_at[i] tokens of sequence i
    ([N, HV, K, V]; rows with snapshot_at < 0 are zero): the chunk before that token ends there.
    gate (`ref.Gate`: g holds the gate logits) and qk_l2norm (q, k un-normalised): computed by the
    prep kernel on its tiles (`_chunk_prep_call`)."""
    N = cu_seqlens.shape[0] - 1
    lay = _layout_for(cu_seqlens, q.shape[1], snapshot_at)
    ops = chunk_operands(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale, prep=prep, snapshot_at=snapshot_at,
                         gate=gate, qk_l2norm=qk_l2norm, layout=lay)
    vt = inter_vt(N, v.shape[-2], v.shape[-1]) if vt is None else vt
    res = _chunk_inter_call(*ops, lay.rows, vt=vt, snap=snapshot_at is not None)
    o = res[0] if lay.back is None else res[0][lay.back]
    if snapshot_at is None:
        return o[None], res[1][:N]
    snaps = jnp.where((jnp.asarray(snapshot_at) >= 0)[:, None, None, None], res[2][:N], 0.0)
    return o[None], res[1][:N], snaps


def chunk_pool(q, k, v, g, beta, pool, slots, reset, cu_seqlens, *, layer, scale, snapshot_at=None,
               snapshot_slots=None, vt=None, prep="mgpu_loop", api=None, gate=None, qk_l2norm=False):
    """`chunk` with the states in the recurrent pool [S, L, HV, K, V] f32: sequence i starts from
    pool[slots[i], layer] (zeros where reset[i]) and its final state goes back there; with
    snapshot_at, the state after its first snapshot_at[i] tokens goes to pool[snapshot_slots[i],
    layer] (rows with snapshot_at < 0: none). The kernel reads the states from the pool by row and
    (api "ref", JAX >= 0.11) writes them in place: no gather or scatter around it. api "scatter"
    (JAX 0.10, no Mosaic GPU lowering of a JAX Ref): the kernel returns the states and XLA scatters
    them. gate, qk_l2norm: as `chunk`. -> (o [1, T, HV, V] f32, pool)."""
    N = cu_seqlens.shape[0] - 1
    S_, L, HV, K, V = pool.shape
    api = api or ("scatter" if _pallas_call_available() else "ref")
    snap = snapshot_at is not None
    lay = _layout_for(cu_seqlens, q.shape[1], snapshot_at)
    ops = chunk_operands(q, k, v, g, beta, None, cu_seqlens, scale=scale, prep=prep, snapshot_at=snapshot_at,
                         states=False, gate=gate, qk_l2norm=qk_l2norm, layout=lay)
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    row = lambda sl: (i32(sl) * L + layer) * HV
    none = jnp.full((1,), -1, jnp.int32)  # the padding sequence reads zeros and writes nothing
    src = jnp.concatenate([jnp.where(jnp.asarray(reset, bool), -1, row(slots)), none])
    dst = jnp.concatenate([row(slots), none])
    snp = jnp.concatenate([jnp.where(i32(snapshot_at) >= 0, row(snapshot_slots), -1), none]) if snap else dst
    vt = inter_vt(N, HV, V) if vt is None else vt
    pool3 = pool.reshape(S_ * L * HV, K, V)
    res = _chunk_inter_call(*ops, lay.rows, vt=vt, pool=pool3, rows=(src, dst, snp), snap=snap, api=api)
    o = res[0] if lay.back is None else res[0][lay.back]
    if api == "ref":
        return o[None], res[1].reshape(pool.shape)
    if api != "scatter":
        raise ValueError(f"unknown chunk_pool api {api!r}")
    from pallas_kernels.kda import write_states

    return o[None], write_states(pool, layer, slots, res[1][:N], snapshot_at, snapshot_slots,
                                      res[2][:N] if snap else None)


def chunk_operands(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, prep="mgpu_loop", interpret=False,
                   snapshot_at=None, states=True, gate=None, qk_l2norm=False, layout: SegmentLayout | None = None):
    """The part of `chunk` before the sequential kernel: the chunk table and the intra-chunk prep
    -> the operands of `_chunk_inter_call` (w, qg, kdT, aqk, u0, gl, h0, ccu, ctok, cnum).
    interpret: run the prep kernel in Mosaic GPU interpret mode (CPU tests). snapshot_at [N]: each
    sequence is two segments (its first snapshot_at[i] tokens, the rest), so a chunk ends at the
    snapshot token; ccu then indexes the 2 (N + 1) segments. states=False: h0 is None (the pool
    form of the inter kernel reads the states itself). gate / qk_l2norm: the prep kernel computes the
    log decay from the logits g and normalises q and k (prep "xla": `ref.fused_inputs_ref` first).
    layout: the rows the kernels work on (`_segment_layout`; default: `ALIGN_SEGMENTS`'s choice); the
    chunk table's rows (ctok) are that layout's, and so are the inter kernel's output rows."""
    _, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    N = cu_seqlens.shape[0] - 1
    C = CHUNK_TOKENS
    cu = cu_seqlens.astype(jnp.int32)
    if layout is None:
        layout = _layout_for(cu, T, snapshot_at)
    T = layout.rows
    if layout.src is None:
        exists, real = None, jnp.arange(T) < cu[N]
    else:  # each segment moved to its row; pad rows (src -1) are zero and outside every chunk's tokens
        exists = layout.src >= 0
        real = exists & (layout.src < cu[N])
        take = lambda x: jnp.where(exists.reshape((1, T) + (1,) * (x.ndim - 2)), x[:, jnp.maximum(layout.src, 0)],
                                   jnp.zeros((), x.dtype))
        q, k, v, g, beta = map(take, (q, k, v, g, beta))
    tab = chunk_table(layout.cu, T, C, align=_ALIGN)
    tidx = jnp.clip(tab.token_idx, 0, T - 1)
    valid = tab.token_valid & real[tidx]
    scale = K**-0.5 if scale is None else scale
    bf = jnp.bfloat16
    ctok = tab.token_idx[:, 0] + tab.chunk_lead  # first token of each chunk
    # its token count (the inter kernel writes those output rows: padding tokens too, as zeros; not pad rows)
    cnum = jnp.sum(tab.token_valid if exists is None else tab.token_valid & exists[tidx], axis=1).astype(jnp.int32)
    if prep in ("mgpu", "mgpu_loop"):
        # the kernel reads each chunk's box straight from the packed tokens (rows padded to a
        # multiple of 8 only where T is not one: a TMA box into swizzled tiles covers whole tiles).
        # The last boxes may reach past the rows: the TMA fills those with zeros on the GPU, while
        # interpret mode rejects reads out of bounds, so there the rows are padded to cover them
        cval = jnp.sum(valid, axis=1).astype(jnp.int32)
        pad = (-T % _ALIGN) + (C if interpret else 0)
        rows = lambda x, dt: jnp.pad(x[0].astype(dt), [(0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x[0].astype(dt)
        beta_t = jnp.swapaxes(rows(beta, jnp.float32), 0, 1)
        # gate logits stay in their dtype (bf16 from the model's projection: half the bytes of g)
        gdt = bf if gate is not None and g.dtype == bf else jnp.float32
        w, qg, kd, u0, aqk, gl = _chunk_prep_call(
            rows(q, bf), rows(k, bf), rows(v, bf), rows(g, gdt), beta_t, ctok, cnum, cval, scale=scale,
            interpret=interpret, loops=prep == "mgpu_loop", gate=gate, qk_l2norm=qk_l2norm,
        )
    elif prep == "xla":
        q, k, g = fused_inputs_ref(q, k, g, gate, qk_l2norm)
        idx = jnp.clip(tab.token_idx, 0, T - 1)
        Gq = HV // H

        def gather(x, heads_rep=1):  # [T, h, X] -> [NC, HV, C, X] f32, zero outside valid tokens
            x = x[0][idx].astype(jnp.float32)  # [NC, C, h, X]
            if heads_rep > 1:
                x = jnp.repeat(x, heads_rep, axis=2)
            x = jnp.where(valid[:, :, None, None], x, 0.0)
            return jnp.swapaxes(x, 1, 2)

        parts = chunk_prep(gather(q, Gq) * scale, gather(k, Gq), gather(v), gather(g), gather(beta[..., None])[..., 0])
        w, u0, aqk, qg, kd = (x.astype(bf) for x in parts[:5])
        gl = parts[5]
    else:
        raise ValueError(f"unknown prep {prep!r}")
    kdT = jnp.swapaxes(kd, -1, -2)
    h0 = jnp.zeros((N + 1, HV, K, V), jnp.float32) if states else None
    if states and initial_state is not None:
        h0 = h0.at[:N].set(initial_state.astype(jnp.float32))
    return w, qg, kdT, aqk, u0, gl, h0, tab.seq_chunks, ctok, cnum
