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
    # pallas_kernels/mla.py's kernel: decode 4.4x the XLA form on an H100 (session 26, device call 31); float64
    # tests pass there (session 28, call 33); prefill chunks too: k3-mini 16k prefill 485 -> 311 ms
    "mla_paged_attention": True,
    # pallas_kernels/moe.py: tests/gpu/test_moe_gpu.py's bf16 cases pass on an H100 (session 19, call 18); k3-mini
    # decode 1.2-1.6x faster than with ragged_dot (which XLA's GPU backend lowers as a dense product)
    "moe_grouped_matmul": True,
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

# Smaller blocks for row-wise work that reads each row's own context rather than weights shared by the
# block (`rowwise(..., max_rows=...)`): a padded row then costs as much as a real one, and a small block
# bounds that waste. CONTEXT_ROWS: the MLA attention of decode and verify tokens (each its own query
# over its sequence's pages) and the XLA path's KDA recurrence step (each sequence's state);
# CONTEXT_CHUNKS: the MLA attention of prefill chunks (each one sequence's `varlen.CHUNK_TOKENS` tokens
# as one query group over that sequence's pages).
CONTEXT_ROWS = 16
CONTEXT_CHUNKS = 4


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


def rowwise(fn, *xs, max_rows: int | None = None):
    """fn(*xs), for arrays xs that share their leading (token) axis and an fn that treats each index of
    that axis on its own (its outputs, a pytree, lead with the same axis).

    In the batch-invariant mode (`batch_invariant`, entered by the model's forward from
    `ModelConfig.batch_invariant_rows`) fn runs on fixed blocks of that many rows (the last block padded
    with zero rows) through `block_loop`, so every product and reduction in fn is compiled for one shape
    in a computation of its own (the loop body), whatever the step's token count and whatever surrounds
    it: a row's bits cannot depend on the GEMM algorithm, reduction split or fusion XLA chooses for that
    count and that program. Off, fn(*xs) as is. Inside a block the mode is off: a `rowwise` (a `proj`, an
    `rms_norm`) within fn runs on the block as it is. `max_rows` caps the block (a fixed number too, so
    still invariant) for an fn whose cost grows with each row's own work rather than with the weights it
    shares, where padding a block costs as much as a real row (`CONTEXT_ROWS`)."""
    R = batch_invariant_rows()
    if not R:
        return fn(*xs)
    if max_rows is not None:
        R = min(R, max_rows)
    T = xs[0].shape[0]
    nb = max(1, -(-T // R))
    blocks = tuple(jnp.pad(x, [(0, nb * R - T)] + [(0, 0)] * (x.ndim - 1)).reshape(nb, R, *x.shape[1:])
                   for x in xs)

    def block(*b):
        with batch_invariant(0):
            return fn(*b)

    out = block_loop(block, *blocks)
    return jax.tree.map(lambda o: o.reshape(nb * R, *o.shape[2:])[:T], out)


def block_loop(fn, *xs):
    """fn over the leading (block) axis of xs, one block per iteration of a while loop: the stacked
    outputs of fn(*(x[i] for x in xs)). The mode's way to run a computation at one shape in a computation
    of its own (`rowwise`, the MoE's expert blocks), so its bits cannot depend on the program around it:
    - fn's operands and outputs are loop-carried values of one block's shape: each iteration runs fn on
      the blocks the previous one read, and writes the outputs the previous one made. Otherwise the
      slicing out of (and the writing into) the stacked arrays fuses with fn's first and last ops, and
      such a fusion's shape, so its HLO, changes with the number of blocks: the GPU's GEMM autotuner
      then picks per program (on the H100 a decode step's rows moved by ~1.7e-5 between a 4-row and a
      132-row step, session 18).
    - The inputs ride in the carry and each block is cleared once read, so XLA cannot sink their
      producers (the padding, the ops before) into the body (optimization barriers do not stop that:
      the CPU pipeline removes them before fusion).
    - The pipeline adds one iteration (fn on zero blocks, discarded), so the loop always has at least two
      trips of a constant count: XLA inlines a one-trip loop into the program around it (a decode row
      then moved by ~3e-5 on the CPU), and a GPU runs a loop of known trip count with no host read-back.
    The cost: one spare block per loop."""
    nb = xs[0].shape[0]
    shapes = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs))
    take = lambda arrs, j: tuple(jax.lax.dynamic_index_in_dim(x, j, 0, keepdims=False) for x in arrs)
    put = lambda stack, v, j: jax.lax.dynamic_update_index_in_dim(stack, v, j, 0)

    def body(i, carry):
        ins, cur, prev, out = carry  # cur: block i - 1's inputs; prev: fn of block i - 2
        out = jax.tree.map(lambda o, v: put(o, v, jnp.maximum(i - 2, 0)), out, prev)
        y = fn(*cur)
        j = jnp.minimum(i, nb - 1)
        nxt = take(ins, j)
        ins = tuple(put(x, jnp.zeros(x.shape[1:], x.dtype), j) for x in ins)
        return ins, nxt, y, out

    init = (xs, tuple(jnp.zeros(x.shape[1:], x.dtype) for x in xs),
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
            jax.tree.map(lambda s: jnp.zeros((nb, *s.shape), s.dtype), shapes))
    _, _, last, out = jax.lax.fori_loop(0, nb + 1, body, init)
    return jax.tree.map(lambda o, v: put(o, v, nb - 1), out, last)
