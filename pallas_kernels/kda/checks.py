"""Argument checks of the KDA entry points (`kda_chunk`, `kda_chunk_pool`, `kda_decode`,
`kda_verify`, `kda_fold`, `spec_kernels.fold_pool`), run before any implementation is picked.

Every implementation indexes the recurrent pool by slot and layer: the Mosaic GPU kernels compute a
row `(slot * L + layer) * HV + head` and TMA-load and store it, so a layer past the pool's or an
out-of-range slot would read and write another request's state, and the jnp path would clamp or
drop it silently. Shapes are checked always; values (layer, slots, cu_seqlens) where they are
concrete (eager calls: a traced value under jit is the caller's contract, as the engine's slot
allocator keeps it). Errors are `ValueError`s that name the entry point and the argument.
"""

from __future__ import annotations

import jax
import numpy as np


def _concrete(x):
    """x as a numpy array, or None when it is None or traced (under jit)."""
    if x is None:
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _fail(op, msg):
    raise ValueError(f"{op}: {msg}")


def tokens(op, q, k, v, g, beta, lead):
    """q, k `[*lead, H, K]`, v `[*lead, HV, V]`, g `[*lead, HV, K]`, beta `[*lead, HV]` with the
    same `lead` leading dims (a count) and HV a multiple of H. -> (lead shape, H, HV, K, V)."""
    if q.ndim != lead + 2:
        _fail(op, f"q must have {lead + 2} dims ([{', '.join(['.'] * lead)}, H, K]), got shape {q.shape}")
    L, (H, K) = q.shape[:lead], q.shape[lead:]
    if v.ndim != lead + 2 or v.shape[:lead] != L:
        _fail(op, f"v must be [{', '.join(map(str, L))}, HV, V] like q {q.shape}, got shape {v.shape}")
    HV, V = v.shape[lead:]
    want = {"k": (k, L + (H, K)), "g": (g, L + (HV, K)), "beta": (beta, L + (HV,))}
    for name, (x, shape) in want.items():
        if x.shape != shape:
            _fail(op, f"{name} must have shape {shape} (q {q.shape}, v {v.shape}), got {x.shape}")
    if HV % H:
        _fail(op, f"value heads ({HV}) must be a multiple of q/k heads ({H})")
    return L, H, HV, K, V


def gate(op, gate, HV, K):
    """A `ref.Gate` for HV value heads of K channels: a_log `[HV]`, dt_bias `[HV * K]` or `[HV, K]`."""
    if gate is None:
        return
    if not (hasattr(gate, "a_log") and hasattr(gate, "dt_bias")):
        _fail(op, f"gate must be a pallas_kernels.kda.Gate (a_log, dt_bias, lower_bound), got {type(gate).__name__}")
    if np.shape(gate.a_log) != (HV,):
        _fail(op, f"gate.a_log must have shape ({HV},) (one per value head), got {np.shape(gate.a_log)}")
    if np.shape(gate.dt_bias) not in ((HV * K,), (HV, K)):
        _fail(op, f"gate.dt_bias must have shape ({HV * K},) or ({HV}, {K}), got {np.shape(gate.dt_bias)}")
    lb = gate.lower_bound
    if lb is not None and not (isinstance(lb, (int, float)) and lb < 0):
        _fail(op, f"gate.lower_bound must be a negative number or None, got {lb!r}")


def states(op, name, x, shape):
    """An `[N, HV, K, V]`-like state array of exactly `shape`."""
    if x is not None and x.shape != tuple(shape):
        _fail(op, f"{name} must have shape {tuple(shape)}, got {x.shape}")


def per_sequence(op, name, x, N):
    """A `[N]` vector (slots, reset, n_keep, snapshot_at...)."""
    if x is not None and np.shape(x) != (N,):
        _fail(op, f"{name} must have one entry per sequence ([{N}]), got shape {np.shape(x)}")


def pool(op, p, HV, K, V, *, layer=None, slots=(), unique=("slots",)):
    """The recurrent pool `[S, L, HV, K, V]` f32; `layer` (when given and concrete) in [0, L); each
    (name, array) of `slots` with concrete values in [0, S), those named in `unique` without
    repeats (two programs would write one row)."""
    if p.ndim != 5 or p.shape[2:] != (HV, K, V) or p.dtype != np.float32:
        _fail(op, f"pool must be [slots, layers, {HV}, {K}, {V}] float32 (HV, K, V of the inputs), "
                  f"got shape {p.shape} {p.dtype}")
    S, L = p.shape[:2]
    lv = _concrete(layer)
    if lv is not None and not (lv.ndim == 0 and 0 <= int(lv) < L):
        _fail(op, f"layer must be in [0, {L}) for a pool of {L} layers, got {layer}")
    for name, s in slots:
        if s is None:
            continue
        sv = _concrete(s)
        dtype = s.dtype if sv is None else sv.dtype
        if not np.issubdtype(dtype, np.integer):
            _fail(op, f"{name} must be integers, got {dtype}")
        if sv is None:
            continue
        if sv.size and (sv.min() < 0 or sv.max() >= S):
            _fail(op, f"{name} must lie in [0, {S}) for a pool of {S} slots, got {sv.tolist()}")
        if name in unique and np.unique(sv).size != sv.size:
            _fail(op, f"{name} must not repeat (each is read and written once), got {sv.tolist()}")


def cu_seqlens(op, cu, T):
    """`[N+1]` offsets: 1-D; where concrete, 0 first, non-decreasing, the last at most T."""
    if np.ndim(cu) != 1 or np.shape(cu)[0] < 1:
        _fail(op, f"cu_seqlens must be a 1-D [N+1] vector, got shape {np.shape(cu)}")
    c = _concrete(cu)
    if c is not None and (c[0] != 0 or np.any(np.diff(c) < 0) or c[-1] > T):
        _fail(op, f"cu_seqlens must start at 0, never decrease and end at most at T={T}, got {c.tolist()}")


def capture(op, cap, lead, HV, K, V):
    """A verify `Capture` for states `[*lead, HV, K, V]`: k, g `[*lead, T, HV, K]`, v `[*lead, T, HV,
    V]`, beta `[*lead, T, HV]`. -> T."""
    lead = tuple(lead)
    if cap.beta.ndim != len(lead) + 2 or cap.beta.shape[:len(lead)] != lead or cap.beta.shape[-1] != HV:
        _fail(op, f"capture beta must be [{', '.join(map(str, lead))}, T, {HV}] for states {lead + (HV, K, V)}, "
                  f"got {cap.beta.shape}")
    T = cap.beta.shape[-2]
    for name, x, last in (("k", cap.k, K), ("v", cap.v, V), ("g", cap.g, K)):
        if x.shape != lead + (T, HV, last):
            _fail(op, f"capture {name} must have shape {lead + (T, HV, last)}, got {x.shape}")
    return T
