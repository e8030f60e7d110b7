"""The routed experts' grouped matmul over expert-aligned row blocks, as a Pallas Mosaic GPU kernel.

`grouped_matmul(x, w, block_expert, used_blocks, *, impl)`:
- x `[NB * BLOCK_ROWS, K]`: the token copies sorted by expert, each expert's group starting on a block of
  `BLOCK_ROWS` rows (its last block padded with zero rows), so every block belongs to one expert;
- w `[E, K, N]`: the experts' weights;
- block_expert `[NB]` int32: each block's expert;
- used_blocks `[1]` int32: blocks from this one on hold no copies and are not computed (their output rows
  are undefined: the caller never reads them; the bound NB is static, the count is not).
Returns `[NB * BLOCK_ROWS, N]` f32.

Why a kernel: XLA's GPU backend lowers `jax.lax.ragged_dot` as a zero-padded product of every row with
every expert (E times the work) unless cuDNN takes it, and a loop over the blocks launches a GEMM (and
copies a weight slice) per block. Here one launch per weight reads each used expert's weights once per
block and skips the unused blocks on the device. Each output tile is computed by one CTA from its own
block's rows with a fixed reduction order over K, whatever the other blocks hold.

impl: "xla" (`grouped_matmul_ref`: each block against its expert's gathered weights), "pallas" (Mosaic GPU,
sm_90: one CTA per (block, N tile, K split: `k_splits`, 1 unless asked), K in steps of `BK` through `STAGES`
TMA stages, wgmma into an f32 accumulator), "pallas_interpret" (the same kernel in Mosaic GPU interpret mode, CPU tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.mgpu_common import SMS, WGMMA, bf16_tiled, gpu_interpret_params

BLOCK_ROWS = 64  # one wgmma's M: the rows a block (and a CTA) holds
BK = 64  # K step: a [64, 64] bf16 A tile and a [64, BN] B tile a stage (128-byte swizzled rows)
# TMA stages a CTA keeps (`grouped_matmul(stages=None)`): step kk's wgmma runs while the loads of steps
# kk + 1 .. kk + STAGES - 1 are in flight. k3-mini decode on an H100 (session 21, device call 21), step ms at
# batch 1 / 64 / 256: 2 stages 3.70 / 5.64 / 10.51, 3 stages 3.66 / 5.62 / 10.40, 4 3.76 / 5.65 / 10.63, 6 3.70
# / 5.68 / 10.63 (bench/k3_mini_h200.py --moe-stages). 3 is the fewest within 1% of the fastest everywhere.
STAGES = 3


def grouped_matmul_ref(x, w, block_expert, used_blocks):
    NB = block_expert.shape[0]
    y = jnp.einsum("brk,bkn->brn", x.reshape(NB, BLOCK_ROWS, -1), w[block_expert], preferred_element_type=jnp.float32)
    live = (jnp.arange(NB) < used_blocks[0])[:, None, None]
    return jnp.where(live, y, 0.0).reshape(NB * BLOCK_ROWS, -1)


def tiles(K: int, N: int) -> bool:
    """Whether the kernel takes a [K, N] weight (else `grouped_matmul` raises)."""
    return K % BK == 0 and N % 64 == 0


def _tile_cols(NB: int, N: int) -> int:
    """N tile: 128 columns, or 64 where the grid would be under two CTAs per SM at 128 (a decode step's
    few blocks: more CTAs stream the weights)."""
    return 128 if N % 128 == 0 and NB * (N // 128) >= 2 * SMS else 64


def fixed_tile_cols(N: int) -> int:
    """An N tile that depends on the width alone (the batch-invariant mode: 128 where N allows, else 64)."""
    return 128 if N % 128 == 0 else 64


MIN_SPLIT_STEPS = 4  # K steps a split keeps at least (`fixed_k_splits`): enough for the stages to overlap


def fixed_k_splits(K: int, N: int) -> int:
    """A K split for the batch-invariant mode's one-group products (`common.proj`) that depends on the
    weight's shape alone: the most equal ranges of at least `MIN_SPLIT_STEPS` K steps, as many as bring the
    N tiles (`fixed_tile_cols`) up to one CTA an SM. At batch <= 64 a projection is one row block, so
    without a split a [7168, 1536] weight streams through 12 CTAs (a tenth of an H100's bandwidth, device
    call 24); with it, 8 splits of 14 steps, 96 CTAs."""
    nk, want = K // BK, -(-SMS // (N // fixed_tile_cols(N)))
    return max(d for d in range(1, nk + 1) if d == 1 or (nk % d == 0 and d <= want and nk // d >= MIN_SPLIT_STEPS))


def _grouped_matmul_mgpu(x, w, block_expert, used_blocks, *, bn: int, stages: int, splits: int, interpret: bool):
    """-> [splits, M, N] f32: each K range's partial products."""
    M, K = x.shape
    N = w.shape[-1]
    NB, nk = M // BLOCK_ROWS, K // BK // splits  # nk: the K steps of one split
    f32 = jnp.float32
    tiled = (lambda cols: {}) if interpret else bf16_tiled

    def kernel(x_ref, w_ref, be_ref, nb_ref, y_ref, x_s, w_s, o_s, bar):
        b, s = lax.axis_index("blk"), lax.axis_index("ksplit")
        n0 = lax.axis_index("ntile") * bn
        k0 = s * nk  # this split's first K step
        e = be_ref[b]
        rows = pl.ds(b * BLOCK_ROWS, BLOCK_ROWS)

        @pl.when(b < nb_ref[0])
        def _():
            def issue(kk, slot):
                kcols = pl.ds((k0 + kk) * BK, BK)
                plgpu.copy_gmem_to_smem(x_ref.at[rows, kcols], x_s.at[slot], bar.at[slot])
                plgpu.copy_gmem_to_smem(w_ref.at[e, kcols, pl.ds(n0, bn)], w_s.at[slot], bar.at[slot])

            for j in range(min(stages - 1, nk)):  # the first stages - 1 steps' loads
                issue(j, j)

            def body(kk, acc):
                slot = lax.rem(kk, stages)
                ahead = kk + stages - 1

                @pl.when(ahead < nk)  # its stage's operands were read by the last step's wgmma,
                def _():  # which returned (its accumulator was read) before this step began
                    issue(ahead, lax.rem(ahead, stages))

                plgpu.barrier_wait(bar.at[slot])
                if interpret:
                    return acc + jnp.dot(x_s[slot], w_s[slot], preferred_element_type=f32)

                def mm(a):
                    plgpu.wgmma(a, x_s.at[slot], w_s.at[slot])

                return pl.run_state(mm)(plgpu.ACC.init(acc))

            zero = jnp.zeros((BLOCK_ROWS, bn), f32)
            acc = lax.fori_loop(0, nk, body, zero if interpret else plgpu.layout_cast(zero, WGMMA))
            o_s[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, y_ref.at[s, rows, pl.ds(n0, bn)])
            plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, M, N), f32),
        grid=(NB, N // bn, splits),
        grid_names=("blk", "ntile", "ksplit"),
        scratch_types=[
            plgpu.SMEM((stages, BLOCK_ROWS, BK), x.dtype, **tiled(BK)),
            plgpu.SMEM((stages, BK, bn), w.dtype, **tiled(bn)),
            plgpu.SMEM((BLOCK_ROWS, bn), f32),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name="moe_grouped_matmul_mgpu",
        **({"interpret": gpu_interpret_params()} if interpret else {}),
    )
    return f(x, w, block_expert, used_blocks)


def grouped_matmul(x, w, block_expert, used_blocks, *, impl: str = "xla", bn: int | None = None,
                   stages: int | None = None, k_splits: int = 1):
    """See the module docstring. x and w bf16 for the kernel (f32 goes through the reference). bn: the N
    tile (None: `_tile_cols`); stages: TMA stages (None: `STAGES`), at least 2. Neither changes a bit of
    the output: every tile sums over K in the same order. k_splits: the kernel's K steps cut into this many
    equal ranges, a CTA each, whose f32 partials are then added in order 0, 1, ... (more CTAs for a grid of
    few blocks and N tiles; a row's bits depend on the split count and never on the other rows; the
    reference path sums over K in one go)."""
    M, K = x.shape
    E, K2, N = w.shape
    NB = block_expert.shape[0]
    if K2 != K or M != NB * BLOCK_ROWS or used_blocks.shape != (1,):
        raise ValueError(f"grouped_matmul: x {x.shape}, w {w.shape}, block_expert {block_expert.shape} and "
                         f"used_blocks {used_blocks.shape} do not fit (x rows = {BLOCK_ROWS} x blocks, used_blocks [1])")
    impl = resolve_impl(impl, "moe_grouped_matmul")
    if impl == "xla" or x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        return grouped_matmul_ref(x, w, block_expert, used_blocks)
    bn = bn or _tile_cols(NB, N)
    stages = STAGES if stages is None else stages
    if not tiles(K, N) or N % bn:
        raise ValueError(f"grouped_matmul: K = {K} must be a multiple of {BK} and N = {N} of {bn}")
    if stages < 2:
        raise ValueError(f"grouped_matmul: stages must be >= 2 (one step's wgmma, one step's loads), got {stages}")
    if k_splits < 1 or (K // BK) % k_splits:
        raise ValueError(f"grouped_matmul: k_splits = {k_splits} must divide the {K // BK} K steps of {BK}")
    parts = _grouped_matmul_mgpu(x, w, block_expert.astype(jnp.int32), used_blocks.astype(jnp.int32), bn=bn,
                                 stages=stages, splits=k_splits, interpret=impl == "pallas_interpret")
    y = parts[0]
    for s in range(1, k_splits):  # a fixed order of adds: elementwise, so no row's sum depends on another's
        y = y + parts[s]
    return y
