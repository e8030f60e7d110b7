"""MLA attention over the paged latent cache, absorbed form (MQA over `[c ; k_pe]`).

`mla_paged_attention(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim, impl)`:
q `[G, C, H, Dk]` absorbed queries (`Dk = kv_lora + rope`), grouped so every group reads one
sequence's pages; `q_pos [G, C]` absolute positions (causal: a query sees keys at positions <= its
own); `page_rows [G, P]` page ids of the group's sequence; `pages [pages, L, page_size, Dk]` the
whole pool (read at `layer`); `kv_len [G]` keys in context. Returns `[G, C, H, v_dim]` f32: the
softmax-weighted latent `c` (the first `v_dim` key channels).

The XLA path (`mla_paged_attention_xla`) reads the keys in blocks of whole pages with a running
(online) softmax, so its memory is one block's keys and scores (`KEY_BLOCK_BYTES`), whatever the
context; `mla_paged_attention_ref` is the one-pass form (every key gathered in f32, every score held:
quadratic in a prefill chunk's context), kept as the spec and as `XLA_FORM = "dense"`.

`mla_decode_mgpu` is the Mosaic GPU kernel for decode and verify groups (impl "pallas"; "pallas_interpret"
runs it in Mosaic GPU's interpret mode on the CPU), behind `DECODE_KERNEL`, and for prefill chunks behind
`PREFILL_KERNEL` too; docs/kernels.md describes it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.mgpu_common import SMS, bf16_tiled, gpu_interpret_params
from pallas_kernels.mgpu_common import load_tile as _load

IMPLS = ("xla", "pallas", "pallas_interpret")  # the kernels: decode and verify groups (`mla_decode_mgpu`)
_WGMMA = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)

# The XLA path's form: "blocked" (the default: keys in blocks, online softmax) or "dense" (the reference's
# one pass; its temporaries grow with groups x context: a 16k prefill chunk needs ~28 GB on k3-mini).
XLA_FORM = "blocked"
# Bytes of temporaries one key block may take (its keys, bf16 and f32, and its f32 scores and weights):
# the block holds as many whole pages as fit, at least one. 512 MiB: with 16-token pages, k3-mini's 16k
# prefill chunk (256 query groups of 64 tokens) reads 208 keys a block, decode at batch 256 576 keys.
# Device call 4 (session 24, H100, 64-token pages): a 16k prefill in 6.8 GB of temporaries (the dense form
# asked for 28 GB and ran out of memory); 3.6% slower than the dense form at 4k, 2.7% in decode at 64 x 16k.
KEY_BLOCK_BYTES = 512 << 20
# Which key blocks the blocked form's loop visits: "static" every block of the page table (a loop of known
# trip count), "needed" only up to the last block any query of the call can see (a trip count computed on
# the device: attention then costs what the contexts hold, not what the page table could, which the
# engine sizes for max_seq_len). The skipped blocks would add exact zeros (their weights are 0 and the
# running max does not move), so both give the same bits. "auto": "needed", except on a GPU, where XLA
# reads a device-bounded loop's condition back to the host every trip: "static" there until a device call
# measures that against the blocks it saves.
KEY_BLOCKS = "auto"


def mla_paged_attention_ref(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim):
    G, P = page_rows.shape
    ps, Dk = pages.shape[2], pages.shape[3]
    keys = pages[page_rows, layer].reshape(G, P * ps, Dk).astype(jnp.float32)  # [G, S, Dk]
    s = jnp.einsum("gchd,gsd->gchs", q.astype(jnp.float32), keys) * scale
    kpos = jnp.arange(P * ps, dtype=jnp.int32)
    mask = (kpos[None, None, :] <= q_pos[:, :, None]) & (kpos[None, None, :] < kv_len[:, None, None])
    s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.isnan(p), 0.0, p)  # queries with no visible key (padding only)
    return jnp.einsum("gchs,gsr->gchr", p, keys[..., :v_dim])


def key_block_pages(G, C, H, P, page_size, Dk, budget=None) -> int:
    """Pages per key block of the blocked form: as many as keep one block's temporaries within `budget`
    bytes (default `KEY_BLOCK_BYTES`), at least 1, at most P, spread evenly over the blocks (the last
    block pads with the sink page, masked)."""
    budget = KEY_BLOCK_BYTES if budget is None else budget
    per_key = G * (C * H * 8 + Dk * 6)  # f32 scores and weights; keys in the pool's bf16 and in f32
    most = max(1, min(P, budget // (per_key * page_size)))
    nb = -(-P // most)
    return -(-P // nb)


def key_blocks() -> str:
    """`KEY_BLOCKS` resolved: "static" or "needed"."""
    if KEY_BLOCKS not in ("auto", "static", "needed"):
        raise ValueError(f"mla.KEY_BLOCKS must be 'auto', 'static' or 'needed', got {KEY_BLOCKS!r}")
    if KEY_BLOCKS == "auto":
        return "static" if jax.default_backend() == "gpu" else "needed"
    return KEY_BLOCKS


def mla_paged_attention_xla(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim, block_pages=None,
                            blocks=None):
    """The blocked form: for each block of `block_pages` pages (default `key_block_pages`), its keys
    gathered, scored and folded into a running max, sum and weighted sum (f32), as in flash attention;
    a query with no visible key gets zeros, as in the reference. `blocks`: "static" or "needed" (default
    `key_blocks()`): whether the loop stops after the last block a query of the call can see."""
    G, C, H, Dk = q.shape
    P = page_rows.shape[1]
    ps = pages.shape[2]
    bp = block_pages or key_block_pages(G, C, H, P, ps, Dk)
    nb = -(-P // bp)
    rows = jnp.pad(page_rows, ((0, 0), (0, nb * bp - P)))  # page 0, the sink: masked by kv_len
    rows = rows.reshape(G, nb, bp).transpose(1, 0, 2)  # [nb, G, bp]
    qf = q.astype(jnp.float32)
    Sb = bp * ps
    f32 = jnp.float32

    def block(b, carry):
        m, l, acc = carry  # [G, C, H], [G, C, H], [G, C, H, v_dim]
        keys = pages[jax.lax.dynamic_index_in_dim(rows, b, 0, keepdims=False), layer].reshape(G, Sb, Dk)
        keys = keys.astype(f32)
        s = jnp.einsum("gchd,gsd->gchs", qf, keys) * scale
        kpos = b * Sb + jnp.arange(Sb, dtype=jnp.int32)
        mask = (kpos[None, None, :] <= q_pos[:, :, None]) & (kpos[None, None, :] < kv_len[:, None, None])
        s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing visible yet: every term is exp(-inf) = 0
        p = jnp.exp(s - shift[..., None])
        alpha = jnp.exp(m - shift)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("gchs,gsr->gchr", p, keys[..., :v_dim])
        return m_new, l, acc

    init = (jnp.full((G, C, H), -jnp.inf, f32), jnp.zeros((G, C, H), f32), jnp.zeros((G, C, H, v_dim), f32))
    if nb == 1:
        _, l, acc = block(0, init)
    else:
        trips = nb
        if (blocks or key_blocks()) == "needed":  # keys at positions < need are all any query here sees
            need = jnp.max(jnp.minimum(kv_len, q_pos.max(-1) + 1))
            trips = jnp.clip(-(-need // Sb), 0, nb)
        _, l, acc = jax.lax.fori_loop(0, trips, block, init)
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


# ---- the decode kernel (Mosaic GPU) ----------------------------------------------------------------

DECODE_BLOCK = 32  # keys a block of the decode kernel (one TMA ring stage: 32 x 576 bf16 = 36 KiB)
DECODE_STAGES = None  # ring stages (None: 3 packed, 2 not; see DECODE_PACKED), within ~227 KiB of shared memory
# Where q's two bf16 halves go: "auto" packs them into one 64-row tile when a row block's rows fit in 32 (decode:
# 12 rows; hi in rows r, lo in rows r + 32: one wgmma a product, the two halves' scores summed through shared
# memory, q in 72 KiB, room for 3 ring stages); otherwise (False, or verify's 96 rows) two 64-row tiles (two
# wgmma a product, 144 KiB, 2 stages)
DECODE_PACKED = "auto"
# Warpgroups a CTA: 1 (a CTA per value half: the grid's last axis; both halves' CTAs read the group's keys) or
# 2 (one CTA holds both halves, a warpgroup each, sharing q and the key ring: the keys read once). 2 since
# device call 31 (session 26, H100): 64 x 16k 0.81 ms against 0.99 on one (packed), 256 x 16k 3.01 against 3.74
DECODE_WARPGROUPS = 2
DECODE_MAX_ROWS = 128  # query rows (C x H) a group may have for the kernel without PREFILL_KERNEL: decode and verify
# Whether the kernel also takes prefill chunks (groups of more than DECODE_MAX_ROWS rows, e.g. a 64-token chunk x
# 12 heads) where DECODE_KERNEL sends decode and verify groups to it. A group's 64-row blocks each stop at their
# own last visible key (the causal skip); their re-reads of the shared keys are L2 hits. On since device call 33
# (session 28, H100): k3-mini prefill in one step 4k 79.2 -> 72.7 ms, 16k 485 -> 311 (MLA 182 -> 47) against the
# blocked XLA form.
PREFILL_KERNEL = True
# Whether impl "pallas" / "pallas_interpret" run decode and verify groups on the kernel (False: the XLA path, as
# impl "xla"). True since device call 33 (session 28, H100) passed tests/gpu/test_mla_gpu.py's float64 cases after
# the bf16_halves fix; call 31 ran it 4.4x / 4.9x faster than the blocked XLA form at 64 / 256 x 16k. The model's
# impl "auto" reaches it only on a Hopper GPU (`dispatch.GPU_KERNELS`); the CPU runs impl "xla".
DECODE_KERNEL = True
DECODE_SPLITS = "auto"  # key-range splits a (group, row block) runs in: "auto" (`decode_splits`) or an int


def _bf16_round(x):
    """f32 x rounded to bf16's 8 bits (to nearest, ties away from zero), still f32: integer arithmetic on its bits
    (finite x below bf16's largest), so no f32 -> bf16 -> f32 round trip appears for a compiler to drop."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return lax.bitcast_convert_type((bits + jnp.int32(0x8000)) & jnp.int32(-65536), jnp.float32)


def bf16_halves(x):
    """f32 x -> (hi, lo) bf16 with hi + lo = x to ~17 bits. hi comes from `_bf16_round`, not from x rounded to
    bf16 and back: XLA on the GPU drops such a round trip (its excess-precision rule turns convert(convert(x,
    bf16), f32) into x), which left lo all zeros and the kernel's q in bf16 alone (1.5e-3 from float64 in device
    call 31, session 26; openxla/xla#41605)."""
    hi = _bf16_round(x.astype(jnp.float32))
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def decode_unsupported(q_shape, pages_shape, pages_dtype, v_dim) -> str | None:
    """Why the decode kernel does not take these shapes (None: it does). It needs bf16 pages; C x H rows
    within `DECODE_MAX_ROWS` unless `PREFILL_KERNEL`; Dk a multiple of 64 and v_dim of 128, at most Dk; pages of
    a size that divides or is divided by `DECODE_BLOCK`."""
    _, C, H, Dk = q_shape
    ps = pages_shape[2]
    if jnp.dtype(pages_dtype) != jnp.bfloat16:
        return f"pages must be bfloat16, got {jnp.dtype(pages_dtype)}"
    if C * H > DECODE_MAX_ROWS and not PREFILL_KERNEL:
        return f"a group's {C} x {H} query rows exceed DECODE_MAX_ROWS ({DECODE_MAX_ROWS}) and PREFILL_KERNEL is off"
    if Dk % 64 or v_dim % 128 or v_dim > Dk:
        return f"key width {Dk} must be a multiple of 64 and value width {v_dim} a multiple of 128, at most {Dk}"
    if ps % DECODE_BLOCK and DECODE_BLOCK % ps:
        return f"page size {ps} must divide or be a multiple of DECODE_BLOCK ({DECODE_BLOCK})"
    return None


def decode_supported(q_shape, pages_shape, pages_dtype, v_dim) -> bool:
    """Whether the decode kernel takes these shapes (`decode_unsupported` says why not)."""
    return decode_unsupported(q_shape, pages_shape, pages_dtype, v_dim) is None


def decode_splits(groups: int, table_keys: int, ctas_per_split: int = 2) -> int:
    """Splits of each (group, row block)'s keys for the decode kernel: enough CTAs (`ctas_per_split`: 2 with a
    CTA per value half, 1 with both in one) for two waves (one CTA fits an SM: ~200-220 KiB of shared
    memory), with at least 4 blocks a split over the page table's keys; at most 64."""
    if DECODE_SPLITS != "auto":
        return max(1, int(DECODE_SPLITS))
    want = 2 * SMS // (ctas_per_split * groups)
    return int(max(1, min(want, 64, table_keys // (4 * DECODE_BLOCK))))


def decode_layout(rows: int, packed=None, stages=None) -> tuple[bool, int]:
    """(packed, stages) of the decode kernel for a group of `rows` query rows: the arguments where given, else
    `DECODE_PACKED` and `DECODE_STAGES` (None: 3 stages packed, 2 not)."""
    if packed is None:
        if DECODE_PACKED not in ("auto", True, False):
            raise ValueError(f"mla.DECODE_PACKED must be 'auto', True or False, got {DECODE_PACKED!r}")
        packed = rows <= 32 if DECODE_PACKED == "auto" else DECODE_PACKED
    return packed, stages or DECODE_STAGES or (3 if packed else 2)


class DecodePlan(NamedTuple):
    packed: bool
    stages: int
    row_rows: int  # query rows a row block: 32 packed, 64 not
    row_blocks: int  # row blocks a group
    warpgroups: int
    splits: int


def decode_plan(G: int, rows: int, table_keys: int, *, packed=None, stages=None, warpgroups=None,
                splits=None) -> DecodePlan:
    """The decode kernel's layout for G groups of `rows` query rows over page tables of `table_keys` keys: the
    arguments where given, else the module settings (`decode_layout`, `DECODE_WARPGROUPS`, `decode_splits`)."""
    packed, stages = decode_layout(rows, packed, stages)
    rr = 32 if packed else 64
    rb = -(-rows // rr)
    wgs = warpgroups or DECODE_WARPGROUPS
    if wgs not in (1, 2):
        raise ValueError(f"the decode kernel runs 1 or 2 warpgroups a CTA, got {wgs!r}")
    return DecodePlan(packed, stages, rr, rb, wgs, splits or decode_splits(G * rb, table_keys, 3 - wgs))


def mla_decode_mgpu(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim, splits=None, packed=None,
                    stages=None, warpgroups=None, interpret=False):
    """The absorbed, ragged MLA attention as a Mosaic GPU kernel (`mla_paged_attention`'s arguments and
    result), for decode and verify (a group's C x H query rows within `DECODE_MAX_ROWS`), and for prefill chunks
    with `PREFILL_KERNEL`.

    Grid (group row block, split, value half), or with `warpgroups` 2 (`DECODE_WARPGROUPS`) (group row block,
    split) and the two value halves on two warpgroups of one CTA, which share its shared memory. A CTA holds a
    row block of one group's query rows (C x H, padded) in shared memory as two bf16 halves, q = hi + lo to ~16
    bits, so the scores are as exact as f32 products with the bf16 keys: packed (32 rows a block: hi in rows r,
    lo in rows r + 32 of one 64-row tile, the halves' scores summed through shared memory) or not (64 rows a
    block, two tiles). It reads its split of the group's keys `DECODE_BLOCK` at a time by TMA from the pages the
    page table names (a ring of `stages`), scores them on the tensor cores (wgmma, f32 accumulation), folds them
    into a running max and sum in registers (masked by each row's last visible key: min(position, kv_len - 1)),
    and accumulates the weights (again hi + lo) times its half of the value channels. Only the blocks up to the
    last key any row of the group sees are read (the loop's trip count comes from the group's own positions), so
    a group costs its own context. The splits' outputs (divided by their sums) and log-sum-exps are combined in
    XLA; rows with no visible key give zeros."""
    G, C, H, Dk = q.shape
    P = page_rows.shape[1]
    ps = pages.shape[2]
    why = decode_unsupported(q.shape, pages.shape, pages.dtype, v_dim)
    if why is not None:
        raise ValueError(f"mla_decode_mgpu: {why}")
    f32, bf = jnp.float32, jnp.bfloat16
    M = C * H
    packed, NST, RR, RB, wgs, NS = decode_plan(G, M, P * ps, packed=packed, stages=stages, warpgroups=warpgroups,
                                               splits=splits)
    GR = G * RB
    BK = DECODE_BLOCK
    VH = v_dim // 2
    per_copy = min(ps, BK)  # keys a TMA copy brings: a whole page, or a block's part of one
    copies = BK // per_copy

    rows = (q.astype(f32) * scale).reshape(G, M, Dk)
    rows = jnp.pad(rows, ((0, 0), (0, RB * RR - M), (0, 0))).reshape(GR, RR, Dk)
    q_hi, q_lo = bf16_halves(rows)
    q_in = [jnp.concatenate([q_hi, q_lo], axis=1)] if packed else [q_hi, q_lo]  # [GR, 64, Dk] each
    lim = jnp.where(q_pos < 0, -1, jnp.minimum(q_pos, kv_len[:, None] - 1)).astype(jnp.int32)  # [G, C]
    lim = jnp.pad(jnp.repeat(lim, H, axis=1), ((0, 0), (0, RB * RR - M)), constant_values=-1).reshape(GR, RR)
    nblk = (-(-(lim.max(axis=1) + 1) // BK)).astype(jnp.int32)  # [GR] blocks a row block reads
    if packed:
        lim = jnp.concatenate([lim, lim], axis=1)
    page_rows = page_rows.astype(jnp.int32)
    nq = len(q_in)

    def kernel(*refs):
        q_refs, (lim_ref, nblk_ref, rows_ref, pages_ref, o_ref, lse_ref) = refs[:nq], refs[nq:nq + 6]
        q_s, (lim_s, k_s, lse_s, s_s, qbar, kbar, cbar) = refs[nq + 6:2 * nq + 6], refs[2 * nq + 6:]
        gr = lax.axis_index("rows")
        s = lax.axis_index("split")
        half = lax.axis_index("half" if wgs == 1 else "wg")
        lead = half == 0 if wgs == 2 else True  # the warpgroup that issues the loads
        s_s, lse_s = s_s.at[half if wgs == 2 else 0], lse_s.at[half if wgs == 2 else 0]
        g = gr // RB
        nb = nblk_ref[gr]
        per = (nb + NS - 1) // NS
        start = s * per
        cnt = jnp.clip(nb - start, 0, per)

        @pl.when(lead)
        def _():
            for src, dst in zip(q_refs, q_s):
                plgpu.copy_gmem_to_smem(src.at[gr], dst, qbar.at[0])
            plgpu.copy_gmem_to_smem(lim_ref.at[gr], lim_s, qbar.at[0])

        def issue(i, slot):  # block start + i of the group's keys -> ring slot
            for j in range(copies):
                key0 = (start + i) * BK + j * per_copy
                page = rows_ref[g, jnp.minimum(key0 // ps, P - 1)]
                src = pages_ref.at[page, layer, pl.ds(lax.rem(key0, ps), per_copy)] if ps > per_copy else \
                    pages_ref.at[page, layer]
                plgpu.copy_gmem_to_smem(src, k_s.at[slot, pl.ds(j * per_copy, per_copy)], kbar.at[slot])

        for st in range(NST):
            pl.when((st < cnt) & lead)(functools.partial(issue, st, st))
        plgpu.barrier_wait(qbar.at[0])
        if interpret:
            limv = lim_s[...]
            m0, l0, acc0 = jnp.full((64,), -jnp.inf, f32), jnp.zeros((64,), f32), jnp.zeros((64, VH), f32)
            iota = lambda d: lax.broadcasted_iota(jnp.int32, (64, BK), d)
        else:
            limv = _load(lim_s, _ROW)
            m0 = plgpu.layout_cast(jnp.full((64,), -jnp.inf, f32), _ROW)
            l0 = plgpu.layout_cast(jnp.zeros((64,), f32), _ROW)
            acc0 = plgpu.layout_cast(jnp.zeros((64, VH), f32), _WGMMA)
            iota = lambda d: plgpu.broadcasted_iota(jnp.int32, (64, BK), d, layout=_WGMMA)

        def scores(slot):  # [64, BK] f32: (q_hi + q_lo) . keys
            if interpret:
                kf = k_s.at[slot][...].astype(f32).T
                sc = sum(jnp.dot(a[...].astype(f32), kf, precision=lax.Precision.HIGHEST) for a in q_s)
            else:
                kT = plgpu.transpose_ref(k_s.at[slot], (1, 0))

                def fn(acc):
                    for a in q_s:
                        plgpu.wgmma(acc, a, kT)
                    return acc[...]

                sc = pl.run_scoped(fn, plgpu.ACC((64, BK), f32))
            if packed:  # row r + (row r + 32) mod 64, in both: s_s holds the tile twice, rows 32-95 are it rolled
                s_s[pl.ds(0, 64)] = sc
                s_s[pl.ds(64, 64)] = sc
                sc = sc + (s_s[pl.ds(32, 64)] if interpret else _load(s_s.at[pl.ds(32, 64)], _WGMMA, optimized=False))
            return sc

        def weighted(acc, p, slot):  # acc + p @ (this half's value channels of the block's keys)
            v = k_s.at[slot, :, pl.ds(half * VH, VH)]
            p_hi = _bf16_round(p)  # as `bf16_halves`: no f32 -> bf16 -> f32 round trip for a compiler to drop
            ps_ = [jnp.where(iota(0) < 32, p_hi, p - p_hi)] if packed else [p_hi, p - p_hi]  # packed: hi rows, lo rows
            ps_ = [x.astype(bf) for x in ps_]
            if interpret:
                vf = v[...].astype(f32)
                return acc + sum(jnp.dot(x.astype(f32), vf, precision=lax.Precision.HIGHEST) for x in ps_)

            def fn(acc_ref):
                for x in ps_:
                    plgpu.wgmma(acc_ref, x, v)

            return pl.run_state(fn)(plgpu.ACC.init(acc))

        def body(i, carry):
            m, l, acc = carry
            slot = lax.rem(i, NST)
            plgpu.barrier_wait(kbar.at[slot])
            sc = scores(slot)
            kpos = (start + i) * BK + iota(1)
            sc = jnp.where(kpos <= lax.broadcast_in_dim(limv, (64, BK), (0,)), sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(axis=1))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing visible yet: every term exp(-inf) = 0
            p = jnp.exp(sc - lax.broadcast_in_dim(shift, (64, BK), (0,)))
            alpha = jnp.exp(m - shift)
            l = l * alpha + p.sum(axis=1)
            acc = weighted(acc * lax.broadcast_in_dim(alpha, (64, VH), (0,)), p, slot)

            if wgs == 2:  # this warpgroup is done with the slot
                plgpu.barrier_arrive(cbar.at[slot])

            @pl.when((i + NST < cnt) & lead)  # the slot's wgmma are done (both warpgroups'): refill it
            def _():
                if wgs == 2:
                    plgpu.barrier_wait(cbar.at[slot])
                issue(i + NST, slot)

            return m_new, l, acc

        m, l, acc = lax.fori_loop(0, cnt, body, (m0, l0, acc0))
        if wgs == 2:  # every slot's last release, which no refill waited for (a barrier's phases all observed)
            for st in range(NST):
                pl.when((st < cnt) & lead)(functools.partial(plgpu.barrier_wait, cbar.at[st]))
        seen = l > 0
        inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
        o_ref.at[gr, s, :, pl.ds(half * VH, VH)][...] = acc * lax.broadcast_in_dim(inv, (64, VH), (0,))
        lse_s[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[gr, s, half])  # both halves: the same sums
        plgpu.wait_smem_to_gmem(0)

    # 64-byte swizzles: a wgmma's K (the block's 32 keys, in the weighted sum) must be a multiple of the swizzle's
    # 32 bf16 columns, and the A operands' swizzle must match their B operands'
    tiled = (lambda cols: {}) if interpret else (lambda cols: bf16_tiled(cols, 2 * BK))
    sds = jax.ShapeDtypeStruct
    f = plgpu.kernel(
        kernel,
        out_type=[sds((GR, NS, 64, v_dim), f32), sds((GR, NS, 2, 64), f32)],
        grid=(GR, NS, 2) if wgs == 1 else (GR, NS),
        grid_names=("rows", "split", "half") if wgs == 1 else ("rows", "split"),
        **({"num_threads": 2, "thread_name": "wg"} if wgs == 2 else {}),
        scratch_types=[
            *[plgpu.SMEM((64, Dk), bf, **tiled(Dk)) for _ in range(nq)],
            plgpu.SMEM((64,), jnp.int32),
            plgpu.SMEM((NST, BK, Dk), bf, **tiled(Dk)),
            plgpu.SMEM((wgs, 64), f32),
            plgpu.SMEM((wgs, 128 if packed else 8, BK), f32),  # packed: the score tile twice (a warpgroup's)
            plgpu.Barrier(num_arrivals=nq + 1, num_barriers=1),
            plgpu.Barrier(num_arrivals=copies, num_barriers=NST),
            plgpu.Barrier(num_arrivals=2, num_barriers=NST),  # 2 warpgroups: both done with a ring slot
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        kernel_name="mla_decode_mgpu" + ("_packed" if packed else "") + ("_2wg" if wgs == 2 else ""),
        **({"interpret": gpu_interpret_params(wgs)} if interpret else {}),
    )
    o, lse = f(*q_in, lim, nblk, page_rows, pages)
    lse = lse[:, :, 0, :RR]
    if packed:  # the hi rows' and the lo rows' weighted sums (the same softmax in both)
        o = o[:, :, :32] + o[:, :, 32:]
    if NS > 1:  # the splits' softmaxes combined: weights exp(lse_s - logsumexp_s lse_s)
        top = lse.max(axis=1, keepdims=True)
        w = jnp.exp(lse - jnp.where(top == -jnp.inf, 0.0, top))  # [GR, NS, RR]; 0 for an empty split
        tot = w.sum(axis=1)
        o = jnp.einsum("gsr,gsrv->grv", w, o, precision=lax.Precision.HIGHEST)
        o = o / jnp.where(tot > 0, tot, 1.0)[..., None]
    else:
        o = o[:, 0]
    return o.reshape(G, RB * RR, v_dim)[:, :M].reshape(G, C, H, v_dim)


def mla_paged_attention(q, q_pos, page_rows, pages, kv_len, *, layer, scale, v_dim, impl="xla"):
    """impl "pallas" (a Hopper GPU) / "pallas_interpret" (CPU): the decode kernel where it applies
    (`decode_supported`: decode and verify groups over bf16 pages), else the XLA path, as "xla"."""
    impl = resolve_impl(impl, "mla_paged_attention")
    if XLA_FORM not in ("blocked", "dense"):
        raise ValueError(f"mla.XLA_FORM must be 'blocked' or 'dense', got {XLA_FORM!r}")
    if impl != "xla" and DECODE_KERNEL and decode_supported(q.shape, pages.shape, pages.dtype, v_dim):
        return mla_decode_mgpu(q, q_pos, page_rows, pages, kv_len, layer=layer, scale=scale, v_dim=v_dim,
                               interpret=impl == "pallas_interpret")
    form = mla_paged_attention_xla if XLA_FORM == "blocked" else mla_paged_attention_ref
    return form(q, q_pos, page_rows, pages, kv_len, layer=layer, scale=scale, v_dim=v_dim)
