"""`impl=` resolution for the kernel families, in one place.

`impl` is one of "xla" (the jnp path), "pallas" (the compiled Pallas kernels: Mosaic GPU on an
H100/H200), "pallas_interpret" (the portable Pallas kernels in interpret mode, for CPU tests), or
"auto": "pallas" for an op that has a compiled kernel for the default device, "xla" otherwise.
"""

from __future__ import annotations

import functools

import jax

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
