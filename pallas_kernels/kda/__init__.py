"""Kimi Delta Attention (KDA) core: jnp references, Pallas kernels, and the dispatching entry points.

Conventions (flash-linear-attention's naive reference): q, k `[B, T, H, K]` already
L2-normalised, v `[B, T, HV, V]`, g `[B, T, HV, K]` natural-log decay (<= 0), beta `[B, T, HV]`,
state `[B, HV, K, V]` f32; HV is a multiple of H (value head `h` reads q/k head `h // (HV // H)`).
See `ref.py` for the recurrence. Outputs are f32.

Entry points, `impl` in "xla" | "pallas" | "pallas_interpret" | "auto" (`pallas_kernels.dispatch`):
- `kda_chunk(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, impl)` -> (o, final_state):
  chunked prefill, dense `[B, T]` or varlen packed (`B == 1` with `cu_seqlens [N+1]`).
- `kda_decode(q, k, v, g, beta, pool, slots, *, layer, reset, scale, impl)` -> (o, pool): one
  token for each of N sequences, reading and writing the recurrent pool by slot id in place.

Implementations: "xla" = `ref.py`; "pallas_interpret" = `portable.py` (`pl.pallas_call`, interpret
mode, any backend); "pallas" = `mgpu.py` (Mosaic GPU, sm_90, K = V = 128-style shapes).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.dispatch import IMPLS, resolve_impl
from pallas_kernels.kda.ref import (
    kda_chunk_ref,
    kda_chunk_varlen_ref,
    kda_decode_ref,
    kda_recurrent_ref,
)
from pallas_kernels.varlen import CHUNK_TOKENS as CHUNK

__all__ = ["IMPLS", "kda_chunk", "kda_chunk_ref", "kda_decode", "kda_recurrent_ref"]


def _dense_to_varlen(q, k, v, g, beta, initial_state):
    """[B, T] -> packed [1, B*T] with cu_seqlens (the kernels are varlen-only)."""
    B, T = q.shape[:2]
    pack = lambda x: x.reshape((1, B * T) + x.shape[2:])
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    return (*map(pack, (q, k, v, g, beta)), initial_state, cu)


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, impl="xla", chunk_size=CHUNK):
    """Chunked KDA prefill. Dense `[B, T]`, or varlen packed `[1, T]` with `cu_seqlens [N+1]`
    (then `initial_state` / `final_state` are `[N, HV, K, V]`). Returns (o f32, final_state f32)."""
    auto = impl == "auto"
    impl = resolve_impl(impl, "kda_chunk")
    if auto and impl == "pallas" and not (_gpu_shapes_ok(q.shape[-1], v.shape[-1]) and chunk_size == CHUNK):
        impl = "xla"
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"varlen kda_chunk takes packed inputs with batch 1, got batch {q.shape[0]}")
    if impl == "xla":
        if cu_seqlens is None:
            return kda_chunk_ref(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size)
        return kda_chunk_varlen_ref(q, k, v, g, beta, scale, initial_state, jnp.asarray(cu_seqlens, jnp.int32), chunk_size)
    B, T = q.shape[:2]
    dense = cu_seqlens is None
    if dense:
        q, k, v, g, beta, initial_state, cu_seqlens = _dense_to_varlen(q, k, v, g, beta, initial_state)
    cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if impl == "pallas_interpret":
        from pallas_kernels.kda import portable

        o, ht = portable.chunk(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale, chunk_size=chunk_size)
    else:
        if chunk_size != CHUNK:
            raise NotImplementedError(f"the Mosaic GPU chunk kernel uses chunk {CHUNK}")
        from pallas_kernels.kda import mgpu

        o, ht = mgpu.chunk(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale)
    if dense:
        o = o.reshape((B, T) + o.shape[2:])
    return o, ht


def _gpu_shapes_ok(K: int, V: int) -> bool:
    """Shapes the Mosaic GPU kernels take (K, V multiples of 64); "auto" falls back to "xla"."""
    return K % 64 == 0 and V % 64 == 0


def kda_decode(q, k, v, g, beta, pool, slots, *, layer, reset=None, scale=None, impl="xla"):
    """One decode token per sequence, in place on the recurrent pool.

    q, k `[N, H, K]`; v `[N, HV, V]`; g `[N, HV, K]`; beta `[N, HV]`; pool `[slots, L, HV, K, V]`
    f32; slots `[N]` int; `reset [N]` bool starts a sequence from the zero state. Returns
    (o `[N, HV, V]` f32, pool). The Pallas kernels alias the pool input to the output: under a
    jit that donates the pool, only the rows of `slots` are read and written.
    """
    auto = impl == "auto"
    impl = resolve_impl(impl, "kda_decode")
    if auto and impl == "pallas" and not _gpu_shapes_ok(q.shape[-1], v.shape[-1]):
        impl = "xla"
    if impl == "xla":
        return kda_decode_ref(q, k, v, g, beta, pool, slots, layer=layer, reset=reset, scale=scale)
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if reset is None:
        reset = jnp.zeros(slots.shape, bool)
    if impl == "pallas_interpret":
        from pallas_kernels.kda import portable

        return portable.decode(q, k, v, g, beta, pool, slots, reset, layer=layer, scale=scale)
    from pallas_kernels.kda import mgpu

    return mgpu.decode(q, k, v, g, beta, pool, slots, reset, layer=layer, scale=scale)
