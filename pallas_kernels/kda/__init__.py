"""Kimi Delta Attention (KDA) core: jnp references, Pallas kernels, and the dispatching entry points.

Conventions (flash-linear-attention's naive reference): q, k `[B, T, H, K]` already
L2-normalised, v `[B, T, HV, V]`, g `[B, T, HV, K]` natural-log decay (<= 0), beta `[B, T, HV]`,
state `[B, HV, K, V]` f32; HV is a multiple of H (value head `h` reads q/k head `h // (HV // H)`).
See `ref.py` for the recurrence. Outputs are f32.

Entry points, `impl` in "xla" | "pallas" | "pallas_interpret" | "auto" (`pallas_kernels.dispatch`):
- `kda_chunk(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, impl, gate, qk_l2norm)` -> (o,
  final_state): chunked prefill, dense `[B, T]` or varlen packed (`B == 1` with `cu_seqlens [N+1]`);
  optionally the gate (g = logits, `Gate`) and the q/k L2 norm computed inside.
- `kda_chunk_pool(q, k, v, g, beta, pool, slots, *, layer, cu_seqlens, reset, snapshot_at,
  snapshot_slots, scale, impl)` -> (o, pool): varlen prefill with the states read from and written
  to the recurrent pool by slot (and optional snapshots at a given token into other slots).
- `kda_decode(q, k, v, g, beta, pool, slots, *, layer, reset, scale, impl)` -> (o, pool): one
  token for each of N sequences, reading and writing the recurrent pool by slot id in place.

Implementations: "xla" = `ref.py`; "pallas_interpret" = `portable.py` (`pl.pallas_call`, interpret
mode, any backend); "pallas" = `mgpu.py` (Mosaic GPU, sm_90, K = V = 128-style shapes).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.dispatch import IMPLS, resolve_impl
from pallas_kernels.kda import checks
from pallas_kernels.kda.ref import (
    Gate,
    _state0,
    fused_inputs_ref,
    kda_chunk_ref,
    kda_chunk_varlen_ref,
    kda_decode_ref,
    kda_recurrent_ref,
)
from pallas_kernels.varlen import CHUNK_TOKENS as CHUNK

__all__ = ["IMPLS", "Gate", "kda_chunk", "kda_chunk_pool", "kda_chunk_ref", "kda_decode", "kda_recurrent_ref"]


def _dense_to_varlen(q, k, v, g, beta, initial_state):
    """[B, T] -> packed [1, B*T] with cu_seqlens (the kernels are varlen-only)."""
    B, T = q.shape[:2]
    pack = lambda x: x.reshape((1, B * T) + x.shape[2:])
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    return (*map(pack, (q, k, v, g, beta)), initial_state, cu)


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, impl="xla", chunk_size=CHUNK,
              snapshot_at=None, gate=None, qk_l2norm=False):
    """Chunked KDA prefill. Dense `[B, T]`, or varlen packed `[1, T]` with `cu_seqlens [N+1]`
    (then `initial_state` / `final_state` are `[N, HV, K, V]`). Returns (o f32, final_state f32).

    gate (`Gate`): g holds the forget-gate logits and the log decay is computed from them;
    qk_l2norm: q and k come un-normalised and are L2-normalised here (flash-linear-attention's
    `use_gate_in_kernel` / `use_qk_l2norm_in_kernel`). The Mosaic GPU prep kernel does both on its
    loaded tiles (g, and normalised q and k, are never written out); the other implementations
    compute them first with `ref.fused_inputs_ref`.

    snapshot_at `[N]` int (N = B when dense): also return the state after the first snapshot_at[i]
    tokens of sequence i (clipped to its length; rows with snapshot_at < 0 are zero), as a third
    output `[N, HV, K, V]` f32. The Mosaic GPU kernel ends a chunk at that token and stores the
    state there; the other implementations run the sequences' two parts one after the other."""
    N = _check_chunk("kda_chunk", q, k, v, g, beta, initial_state, cu_seqlens)
    checks.gate("kda_chunk", gate, v.shape[-2], q.shape[-1])
    if (gate is not None or qk_l2norm) and not _fuses(impl, q.shape[-1], v.shape[-1], chunk_size):
        q, k, g = fused_inputs_ref(q, k, g, gate, qk_l2norm)
        gate, qk_l2norm = None, False
    if q.shape[1] == 0:  # no tokens: nothing to run
        h0 = _state0(initial_state, (N, v.shape[-2], q.shape[-1], v.shape[-1]))
        o = jnp.zeros(v.shape, jnp.float32)
        if snapshot_at is None:
            return o, h0
        return o, h0, jnp.where((jnp.asarray(snapshot_at) >= 0)[:, None, None, None], h0, 0.0)
    if snapshot_at is not None:
        return _chunk_with_snapshot(q, k, v, g, beta, scale, initial_state, cu_seqlens, impl, chunk_size,
                                    jnp.asarray(snapshot_at, jnp.int32), gate, qk_l2norm)
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

        o, ht = mgpu.chunk(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale, gate=gate, qk_l2norm=qk_l2norm)
    if dense:
        o = o.reshape((B, T) + o.shape[2:])
    return o, ht


def _chunk_with_snapshot(q, k, v, g, beta, scale, initial_state, cu_seqlens, impl, chunk_size, snapshot_at,
                         gate=None, qk_l2norm=False):
    """`kda_chunk` with `snapshot_at` -> (o, final_state, snapshot_state). gate / qk_l2norm only
    where the Mosaic GPU kernel fuses them (`kda_chunk` computes them first for the others)."""
    B, T = q.shape[:2]
    dense = cu_seqlens is None
    if dense:
        q, k, v, g, beta, initial_state, cu_seqlens = _dense_to_varlen(q, k, v, g, beta, initial_state)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    N = cu.shape[0] - 1
    HV, K, V = v.shape[-2], q.shape[-1], v.shape[-1]
    if snapshot_at.shape != (N,):
        raise ValueError(f"snapshot_at must have one entry per sequence ({N}), got shape {snapshot_at.shape}")
    resolved = resolve_impl(impl, "kda_chunk")
    if resolved == "pallas" and _gpu_shapes_ok(K, V) and chunk_size == CHUNK:
        from pallas_kernels.kda import mgpu

        o, ht, snap = mgpu.chunk(q, k, v, g, beta, initial_state, cu, scale=K**-0.5 if scale is None else scale,
                                 snapshot_at=snapshot_at, gate=gate, qk_l2norm=qk_l2norm)
    else:  # each sequence as two segments, run twice: the first parts' final states are the snapshots
        a = jnp.clip(snapshot_at, 0, cu[1:] - cu[:-1])
        seg = jnp.concatenate([jnp.stack([cu[:-1], cu[:-1] + a], 1).reshape(-1), cu[N:]])
        h0 = jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
        z = jnp.zeros_like(h0)
        run = lambda s0: kda_chunk(q, k, v, g, beta, scale=scale, initial_state=jnp.stack([s0[0], s0[1]], 1).reshape(
            2 * N, HV, K, V), cu_seqlens=seg, impl=impl, chunk_size=chunk_size)
        o1, h1 = run((h0, z))
        snap = h1[0::2]
        o2, h2 = run((z, snap))
        first = jnp.searchsorted(seg, jnp.arange(q.shape[1]), side="right") % 2 == 1  # in a first part
        o = jnp.where(first[None, :, None, None], o1, o2)
        ht = h2[1::2]
        snap = jnp.where((snapshot_at >= 0)[:, None, None, None], snap, 0.0)
    if dense:
        o = o.reshape((B, T) + o.shape[2:])
    return o, ht, snap


def kda_chunk_pool(q, k, v, g, beta, pool, slots, *, layer, cu_seqlens, reset=None, snapshot_at=None,
                   snapshot_slots=None, scale=None, impl="xla", gate=None, qk_l2norm=False):
    """Varlen chunked prefill with its states in the recurrent pool `[slots, L, HV, K, V]` f32:
    sequence i (packed `[1, T]`, `cu_seqlens [N+1]`) starts from `pool[slots[i], layer]` (zeros
    where `reset[i]`) and its final state is written back there; with `snapshot_at` `[N]`, the state
    after its first snapshot_at[i] tokens goes to `pool[snapshot_slots[i], layer]` (none where
    snapshot_at < 0). Returns (o `[1, T, HV, V]` f32, pool). gate, qk_l2norm: as `kda_chunk`.

    "pallas": the Mosaic GPU kernel reads each state from the pool by slot and writes it back in
    place (JAX >= 0.11); the other implementations gather and scatter around `kda_chunk`."""
    op = "kda_chunk_pool"
    _, _, HV, K, V = checks.tokens(op, q, k, v, g, beta, lead=2)
    if q.shape[0] != 1:
        raise ValueError(f"kda_chunk_pool takes packed inputs with batch 1, got batch {q.shape[0]}")
    if np.ndim(slots) != 1:
        raise ValueError(f"{op}: slots must be a 1-D [N] vector, got shape {np.shape(slots)}")
    N = np.shape(slots)[0]
    if np.shape(cu_seqlens) != (N + 1,):
        raise ValueError(f"cu_seqlens must have {N + 1} entries for {N} slots, got shape {np.shape(cu_seqlens)}")
    checks.cu_seqlens(op, cu_seqlens, q.shape[1])
    if (snapshot_at is None) != (snapshot_slots is None):
        raise ValueError("snapshot_at and snapshot_slots go together")
    for name, x in (("reset", reset), ("snapshot_at", snapshot_at), ("snapshot_slots", snapshot_slots)):
        checks.per_sequence(op, name, x, N)
    checks.pool(op, pool, HV, K, V, layer=layer, slots=[("slots", slots), ("snapshot_slots", snapshot_slots)])
    checks.gate(op, gate, HV, K)
    auto = impl == "auto"
    impl = resolve_impl(impl, "kda_chunk")
    if (auto and impl == "pallas" and not _gpu_shapes_ok(q.shape[-1], v.shape[-1])) or q.shape[1] == 0:
        impl = "xla"  # (no tokens: the jnp path writes the reset rows and snapshots without a launch)
    if (gate is not None or qk_l2norm) and impl != "pallas":
        q, k, g = fused_inputs_ref(q, k, g, gate, qk_l2norm)
        gate, qk_l2norm = None, False
    slots = jnp.asarray(slots, jnp.int32)
    reset = jnp.zeros((N,), bool) if reset is None else jnp.asarray(reset, bool)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    if impl == "pallas":
        from pallas_kernels.kda import mgpu

        K = q.shape[-1]
        return mgpu.chunk_pool(q, k, v, g, beta, pool, slots, reset, cu, layer=layer,
                               scale=K**-0.5 if scale is None else scale, snapshot_at=snapshot_at,
                               snapshot_slots=snapshot_slots, gate=gate, qk_l2norm=qk_l2norm)
    s0 = jnp.where(reset[:, None, None, None], 0.0, pool[slots, layer])
    if snapshot_at is None:
        o, ht = kda_chunk(q, k, v, g, beta, scale=scale, initial_state=s0, cu_seqlens=cu, impl=impl)
        return o, write_states(pool, layer, slots, ht)
    o, ht, snap = kda_chunk(q, k, v, g, beta, scale=scale, initial_state=s0, cu_seqlens=cu, impl=impl,
                            snapshot_at=snapshot_at)
    return o, write_states(pool, layer, slots, ht, snapshot_at, snapshot_slots, snap)


def write_states(pool, layer, slots, ht, snapshot_at=None, snapshot_slots=None, snaps=None):
    """pool[slots[i], layer] = ht[i], and where snapshot_at[i] >= 0, pool[snapshot_slots[i], layer]
    = snaps[i] (the other rows go to an out-of-range slot and are dropped)."""
    pool = pool.at[jnp.asarray(slots, jnp.int32), layer].set(ht)
    if snapshot_at is None:
        return pool
    to = jnp.where(jnp.asarray(snapshot_at) >= 0, jnp.asarray(snapshot_slots, jnp.int32), pool.shape[0])
    return pool.at[to, layer].set(snaps, mode="drop")


def _check_chunk(op, q, k, v, g, beta, initial_state, cu_seqlens):
    """kda_chunk's arguments: the token arrays, the initial states `[N, HV, K, V]` (N = B dense,
    else the sequences of `cu_seqlens`), cu_seqlens with packed batch-1 inputs. -> N."""
    (B, T), _, HV, K, V = checks.tokens(op, q, k, v, g, beta, lead=2)
    N = B
    if cu_seqlens is not None:
        checks.cu_seqlens(op, cu_seqlens, T)
        N = np.shape(cu_seqlens)[0] - 1
    checks.states(op, "initial_state", initial_state, (N, HV, K, V))
    return N


def _gpu_shapes_ok(K: int, V: int) -> bool:
    """Shapes the Mosaic GPU kernels take (K, V multiples of 64); "auto" falls back to "xla"."""
    return K % 64 == 0 and V % 64 == 0


def _fuses(impl, K, V, chunk_size):
    """Whether `kda_chunk` runs the Mosaic GPU kernels, which fuse the gate and the L2 norm."""
    return resolve_impl(impl, "kda_chunk") == "pallas" and _gpu_shapes_ok(K, V) and chunk_size == CHUNK


def kda_decode(q, k, v, g, beta, pool, slots, *, layer, reset=None, scale=None, impl="xla"):
    """One decode token per sequence, in place on the recurrent pool.

    q, k `[N, H, K]`; v `[N, HV, V]`; g `[N, HV, K]`; beta `[N, HV]`; pool `[slots, L, HV, K, V]`
    f32; slots `[N]` int; `reset [N]` bool starts a sequence from the zero state. Returns
    (o `[N, HV, V]` f32, pool). The Pallas kernels alias the pool input to the output: under a
    jit that donates the pool, only the rows of `slots` are read and written.
    """
    op = "kda_decode"
    _, _, HV, K, V = checks.tokens(op, q, k, v, g, beta, lead=1)
    for name, x in (("slots", slots), ("reset", reset)):
        checks.per_sequence(op, name, x, q.shape[0])
    checks.pool(op, pool, HV, K, V, layer=layer, slots=[("slots", slots)])
    auto = impl == "auto"
    impl = resolve_impl(impl, "kda_decode")
    if (auto and impl == "pallas" and not _gpu_shapes_ok(q.shape[-1], v.shape[-1])) or q.shape[0] == 0:
        impl = "xla"  # (no sequences: nothing to launch)
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
