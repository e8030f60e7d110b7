"""Mosaic GPU (`plgpu`) helpers shared by the KDA, MoE and MLA kernels.

Register layouts, shared-memory tilings, the JAX 0.10 / 0.11 difference in `plgpu.load`, and the
interpret-mode parameters with which the CPU tests run a `plgpu.kernel`.
"""

from __future__ import annotations

import inspect
import os

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

SMS = 132  # streaming multiprocessors of an H100 / H200: a grid of fewer CTAs leaves SMs idle
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)  # [M] vector along the rows of a WGMMA tile
COL = plgpu.Layout.WGMMA.reduce(0)  # [N] vector along the columns
# JAX 0.10's `plgpu.load` takes an index argument; 0.11 deprecates it (index the ref instead)
LOAD_IDX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def load_tile(ref, layout, **kw):
    """`plgpu.load` of a whole (already indexed) ref into registers, on JAX 0.10 and 0.11."""
    return plgpu.load(ref, (), layout=layout, **kw) if LOAD_IDX else plgpu.load(ref, layout=layout, **kw)


def f32_tiled():
    """Shared-memory transforms for an f32 tile: 8 x 32 tiles, 128-byte swizzle."""
    return dict(transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))


def bf16_tiled(cols, max_swizzle=128):
    """Shared-memory transforms for a bf16 tile `cols` wide: the widest swizzle up to
    `max_swizzle` bytes (a wgmma's K must be a multiple of the swizzle's columns)."""
    sw = min(max_swizzle, cols * 2)
    return dict(transforms=(plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw)))


def cpu_pool_threads() -> int:
    """XLA:CPU's client thread pool: `PJRT_NPROC`, else the core count, and at least the CPU device count."""
    return max(int(os.environ.get("PJRT_NPROC") or 0) or os.cpu_count() or 1, len(jax.devices("cpu")))


def gpu_interpret_params(threads: int = 1):
    """Mosaic GPU interpret mode (runs a `plgpu.kernel` on the CPU, simulating SMEM, TMA and
    barriers): how the CPU tests check the kernels themselves. Not exported by
    `jax.experimental.pallas.mosaic_gpu` in JAX 0.10, hence the private import.

    A kernel of `threads` > 1 (warpgroups a CTA) runs as that many Python threads, each a program on
    XLA:CPU's thread pool, waiting on each other at the barriers, while the callback that started them
    holds a pool thread of its own: with fewer than threads + 1 pool threads it can hang for good (measured:
    the two-warpgroup MLA kernel inside the engine's step, on a 2-core machine). XLA:CPU sizes its pool
    when JAX starts (`cpu_pool_threads`); too small a pool is a ValueError here."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    if threads > 1:
        pool = cpu_pool_threads()
        if pool < threads + 1:
            raise ValueError(
                f"interpret mode runs this kernel's {threads} warpgroups as {threads} threads on XLA:CPU's pool of "
                f"{pool}, which needs at least {threads + 1} (else it can deadlock): set PJRT_NPROC={threads + 1} or "
                "more before JAX starts, or run the kernel on one warpgroup")
    return InterpretGPUParams()
