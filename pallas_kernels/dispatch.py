"""`impl=` resolution for the kernel families, in one place.

`impl` is one of "xla" (the jnp path), "pallas" (the compiled Pallas kernels: Mosaic GPU on an
H100/H200), "pallas_interpret" (the portable Pallas kernels in interpret mode, for CPU tests), or
"auto": "pallas" for an op that has a compiled kernel for the default device, "xla" otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

IMPLS = ("xla", "pallas", "pallas_interpret")

# Ops whose Mosaic GPU kernel "auto" picks on a Hopper GPU: only kernels that passed
# tests/gpu on the H200 (bench/NOTES.md has the measurements).
# - kda_chunk: the Mosaic GPU prep + inter kernels, correct on the H200 (JAX 0.11.2), rel. err.
#   4e-3 vs fla; faster than fla at 4k tokens (0.66 vs 0.95 ms), slower at >= 32k (4.9 vs 1.95:
#   the prep kernel dominates). Not timed against the XLA path yet; that path materialises a
#   [C, C, K] decay cube per chunk and scans chunk by chunk, so it is expected to be slower still.
# - kda_decode: correct and in place on the H200 (JAX 0.11.2, the pool passed as a JAX Ref), rel.
#   err. 1.7e-3 vs fla; 0.93 of copy bandwidth at batch 1024 x 96 heads (fla 0.87), but slower than
#   fla at 256 x 12 heads (0.68-0.71 vs 0.87). k3-mini decode at batch 256: 18.9 ms per step vs 24.9
#   on the XLA path.
# - kda_verify / kda_fold (spec_kernels.py): tests/gpu pass on the H200; verify + fold 0.53 ms vs
#   2.07 on the XLA path and 1.12 for verify with per-step snapshots (256 x 12 heads, gamma 7).
#   The engine's fold (`k3jax.spec.step.fold_blocks`) runs `fold_pool` in place with it; that
#   composition is checked on the CPU (portable kernel), not yet end to end on the H200.
GPU_KERNELS = {
    "kda_decode": True,
    "kda_chunk": True,
    "kda_verify": True,
    "kda_fold": True,
    "mla_paged_attention": False,
}


@functools.lru_cache(maxsize=None)
def hopper_gpu() -> bool:
    """True when the default backend is a CUDA GPU of compute capability 9.x (wgmma, TMA)."""
    try:
        if jax.default_backend() != "gpu":
            return False
        cc = getattr(jax.devices()[0], "compute_capability", "")
        return str(cc).split(".")[0] == "9"
    except Exception:  # no backend at all
        return False


def resolve_impl(impl: str, op: str) -> str:
    """Concrete impl for `op` ("kda_decode", "kda_chunk", ...); raises on an unknown name."""
    if impl == "auto":
        return "pallas" if GPU_KERNELS.get(op, False) and hopper_gpu() else "xla"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS + ('auto',)}, got {impl!r}")
    return impl


# The batch-invariant mode's row block (0: off), set at trace time by `batch_invariant` (the model's
# forward enters it from `ModelConfig.batch_invariant_rows`): the model's row-wise work runs over fixed
# blocks of this many rows (`rowwise`) and the chunk kernels lay every varlen segment
# out on its own (`mgpu.ALIGN_SEGMENTS`'s layout), so a token's result cannot depend on the other tokens
# of its step.
_INVARIANT_ROWS = contextvars.ContextVar("k3jax_batch_invariant_rows", default=0)


@contextlib.contextmanager
def batch_invariant(rows: int):
    """Inside the block (read while tracing), the batch-invariant mode with row blocks of `rows` (0: off)."""
    if rows < 0:
        raise ValueError(f"batch-invariant row block must be >= 0, got {rows}")
    token = _INVARIANT_ROWS.set(int(rows))
    try:
        yield
    finally:
        _INVARIANT_ROWS.reset(token)


def batch_invariant_rows() -> int:
    """The row block of the batch-invariant mode being traced (0: off)."""
    return _INVARIANT_ROWS.get()


def rowwise(fn, *xs):
    """fn(*xs), for arrays xs that share their leading (token) axis and an fn that treats each index of
    that axis on its own (its outputs, a pytree, lead with the same axis).

    In the batch-invariant mode (`batch_invariant`, entered by the model's forward from
    `ModelConfig.batch_invariant_rows`) fn runs on fixed blocks of that many rows (the last block padded
    with zero rows), one block per iteration of a while loop, so every product and reduction in fn is
    compiled for one shape in a computation of its own (the loop body), whatever the step's token count
    and whatever surrounds it: a row's bits cannot depend on the GEMM algorithm, reduction split or
    fusion XLA chooses for that count and that program. Two things keep the body to itself, both found on
    the CPU, where a decode step's rows moved by ~1e-9 between batch buckets without them:
    - the inputs ride in the loop carry and each block is cleared once read, so XLA cannot sink their
      producers (the padding, the ops before it) into the body and fuse them with fn's reductions
      (optimization barriers do not stop that: the CPU pipeline removes them before fusion);
    - the trip count is computed on the device (`_opaque_count`), so XLA cannot inline a one-block loop
      into the program around it.
    The cost on a GPU: the loop reads its predicate back each iteration (one sync per block).
    Off, fn(*xs) as is. Inside a block the mode is off: a `rowwise` (a `proj`, an `rms_norm`) within fn
    runs on the block as it is."""
    R = batch_invariant_rows()
    if not R:
        return fn(*xs)
    T = xs[0].shape[0]
    nb = max(1, -(-T // R))
    padded = tuple(jnp.pad(x, [(0, nb * R - T)] + [(0, 0)] * (x.ndim - 1)) for x in xs)

    def block(*b):
        with batch_invariant(0):
            return fn(*b)

    shapes = jax.eval_shape(block, *(jax.ShapeDtypeStruct((R, *x.shape[1:]), x.dtype) for x in xs))
    init = jax.tree.map(lambda s: jnp.zeros((nb * R, *s.shape[1:]), s.dtype), shapes)

    def body(i, carry):
        ins, out = carry
        y = block(*(jax.lax.dynamic_slice_in_dim(x, i * R, R) for x in ins))
        # the inputs ride in the carry and each block is cleared once read: a loop-carried value, so XLA
        # cannot sink their producers (the padding, the ops before) into the body and fuse them there
        ins = tuple(jax.lax.dynamic_update_slice_in_dim(x, jnp.zeros((R, *x.shape[1:]), x.dtype), i * R, 0)
                    for x in ins)
        return ins, jax.tree.map(lambda o, v: jax.lax.dynamic_update_slice_in_dim(o, v, i * R, 0), out, y)

    _, out = jax.lax.fori_loop(0, _opaque_count(nb, padded), body, (padded, init))
    return jax.tree.map(lambda o: o[:T], out)


def _opaque_count(n: int, xs) -> jax.Array:
    """n as an int32 that XLA cannot fold to a constant: min(n, n + isnan(a float input's first element))
    (n unless that element is NaN, and then still n)."""
    x = next((a for a in xs if jnp.issubdtype(a.dtype, jnp.floating) and a.size), None)
    if x is None:
        return jnp.int32(n)
    return jnp.minimum(n, n + jnp.isnan(x.reshape(-1)[0]).astype(jnp.int32))
