"""Speculative verify with capture, and the ReplaySSM fold (jnp reference = the XLA path).

Verify runs gamma+1 block tokens per sequence through the recurrence from the committed state,
reading the pool and never writing it, and records each step's raw inputs (k, v, g, beta: the
L2-normalised k, the value, the stored log decay, beta). Once sampling knows how many block tokens
each sequence keeps, `kda_fold` replays exactly those steps for all layers and heads in one op,
with the same step function (`ref._step`) and the same stored gate values, and writes the pool.
Rejected tokens cost nothing.

Capture layout per sequence and layer: k `[T, HV, K]`, v `[T, HV, V]`, g `[T, HV, K]`, beta
`[T, HV]` in f32 (HV heads: q/k expanded to the value heads). `REPLAY_FLOATS_PER_STEP(K, V)` is
the per-head size the engine and `k3jax.sizing.spec_window_bytes` both use.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import resolve_impl
from pallas_kernels.kda import checks
from pallas_kernels.kda.ref import _prep, step_rows


def replay_floats_per_step(K: int, V: int) -> int:
    """Values recorded per step per layer-head for the recurrence: k (K) + v (V) + g (K) + beta (1)."""
    return 2 * K + V + 1


def replay_step_bytes(K: int, V: int, in_bytes: int = 2) -> int:
    """Bytes the engine's replay buffer holds per step per layer-head: k and v in the activation
    dtype (`in_bytes`; the model rounds k to it before every KDA kernel, so the f32 recurrence
    reads them back exactly), g and beta in f32 (the stored gates), and the step's pre-conv inputs
    (q, k, v channels: 2K + V) in the activation dtype for the conv state."""
    return in_bytes * (K + V) + 4 * (K + 1) + in_bytes * (2 * K + V)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Capture:
    k: jax.Array  # f32[..., T, HV, K]
    v: jax.Array  # f32[..., T, HV, V]
    g: jax.Array  # f32[..., T, HV, K]
    beta: jax.Array  # f32[..., T, HV]


def kernel_impl(impl, op, K, V, empty=False):
    """impl -> "xla" | "pallas" | "pallas_interpret" ("auto": the Mosaic GPU kernel where it runs;
    empty, no sequences or no steps: "xla", nothing to launch)."""
    auto = impl == "auto"
    impl = resolve_impl(impl, op)
    if (auto and impl == "pallas" and (K % 64 or V % 64)) or empty:
        impl = "xla"
    return impl


def kda_verify(q, k, v, g, beta, S0, *, scale=None, impl="xla"):
    """q, k `[N, T, H, K]`, v `[N, T, HV, V]`, g `[N, T, HV, K]`, beta `[N, T, HV]`, S0 `[N, HV, K, V]`
    (the committed state, read only) -> (o `[N, T, HV, V]` f32, Capture).

    impl: "xla" (this jnp scan), "pallas" (Mosaic GPU) or "pallas_interpret" (portable Pallas),
    or "auto" (`pallas_kernels.dispatch`); the kernels are in `spec_kernels.py`."""
    (N, _), _, HV, K, V = checks.tokens("kda_verify", q, k, v, g, beta, lead=2)
    checks.states("kda_verify", "S0", S0, (N, HV, K, V))
    impl = kernel_impl(impl, "kda_verify", K, V, empty=not q.size)
    if impl != "xla":
        from pallas_kernels.kda import spec_kernels

        return spec_kernels.verify(q, k, v, g, beta, S0, scale=scale, impl=impl)
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale)

    def body(S, xs):
        o, S = step_rows(S, *xs)
        return S, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    _, o = jax.lax.scan(body, S0.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), Capture(k=k, v=v, g=g, beta=beta)


def kda_fold(S0, cap: Capture, n_keep, snap_at=None, *, impl="xla"):
    """Replay the first n_keep[i] captured steps of every sequence from its committed state.

    S0 `[N, ..., HV, K, V]` (any leading layer dims between N and HV, matching `cap`'s
    `[N, ..., T, HV, ...]`), n_keep `[N]` int. Returns the states after the kept steps; with
    `snap_at` `[N]` int also the state after the first snap_at[i] steps (a checkpoint inside the
    block; meaningful where 0 < snap_at[i] <= n_keep[i]), from the same replay.

    impl as in `kda_verify`: the kernels replay all layers and heads in one launch."""
    if S0.ndim < 4:
        raise ValueError(f"kda_fold: S0 must be [N, ..., HV, K, V], got shape {S0.shape}")
    checks.capture("kda_fold", cap, S0.shape[:-3], *S0.shape[-3:])
    for name, x in (("n_keep", n_keep), ("snap_at", snap_at)):
        checks.per_sequence("kda_fold", name, x, S0.shape[0])
    impl = kernel_impl(impl, "kda_fold", S0.shape[-2], S0.shape[-1], empty=not cap.beta.size)
    if impl != "xla":
        from pallas_kernels.kda import spec_kernels

        return spec_kernels.fold(S0, cap, n_keep, snap_at, impl=impl)
    T = cap.beta.shape[-2]
    xs = tuple(jnp.moveaxis(a, -3 if a is not cap.beta else -2, 0) for a in (cap.k, cap.v, cap.g, cap.beta))
    keep_shape = (-1,) + (1,) * (S0.ndim - 1)
    S0 = S0.astype(jnp.float32)

    def body(carry, inp):
        S, S_snap = carry
        t, (k, v, g, beta) = inp
        _, S_next = step_rows(S, jnp.zeros_like(k), k, v, g, beta)
        S = jnp.where((t < n_keep).reshape(keep_shape), S_next, S)
        if snap_at is not None:
            S_snap = jnp.where((t + 1 == snap_at).reshape(keep_shape), S, S_snap)
        return (S, S_snap), None

    (S, S_snap), _ = jax.lax.scan(body, (S0, S0 if snap_at is not None else None), (jnp.arange(T), xs))
    return S if snap_at is None else (S, S_snap)


def snapshot_bytes(K: int, V: int, gamma: int) -> int:
    """What the brute-force alternative keeps per request-layer-head: gamma+1 f32 K x V states."""
    return (gamma + 1) * K * V * 4


def replay_bytes(K: int, V: int, gamma: int, in_bytes: int = 2) -> int:
    """ReplaySSM's capture per request-layer-head for a block of gamma+1 tokens."""
    return (gamma + 1) * replay_step_bytes(K, V, in_bytes)
