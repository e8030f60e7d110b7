"""Device state pytrees: the slot-major recurrent pool and the page-major MLA KV pool.

Slot 0 and page 0 are padding sinks: padded sequences read and write them, so no step ever
needs a mask on its state writes. Everything the engine touches on device lives in one
`DeviceState`, donated to every step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.model.common import dtype_of


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RecurrentPool:
    ssm: jax.Array  # f32[S, L_kda, H, K, V] KDA state per slot and layer
    conv: jax.Array  # dtype[S, L_kda, W-1, C] last W-1 conv inputs (q|k|v channels)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPool:
    pages: jax.Array  # dtype[P, L_mla, page_size, R + N_rope] MLA latent c and shared k_pe

    @property
    def page_size(self) -> int:
        return self.pages.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    recurrent: RecurrentPool
    kv: KVPool


def state_shapes(cfg: ModelConfig, slots: int, pages: int, page_size: int) -> DeviceState:
    """ShapeDtypeStructs of a `DeviceState` (no allocation)."""
    dt = dtype_of(cfg)
    sds = jax.ShapeDtypeStruct
    Lk, Lm = cfg.num_kda_layers, cfg.num_mla_layers
    return DeviceState(
        recurrent=RecurrentPool(
            ssm=sds((slots, Lk, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32),
            conv=sds((slots, Lk, cfg.kda_conv_size - 1, cfg.kda_conv_channels), dt),
        ),
        kv=KVPool(pages=sds((pages, Lm, page_size, cfg.mla_cache_dim), dt)),
    )


def init_state(cfg: ModelConfig, slots: int, pages: int, page_size: int, sharding=None) -> DeviceState:
    """Zeroed device state with `slots` recurrent slots and `pages` KV pages (both incl. the sink)."""
    if slots < 2 or pages < 2:
        raise ValueError("need at least 2 slots and 2 pages (index 0 is the padding sink)")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    shapes = state_shapes(cfg, slots, pages, page_size)
    if sharding is None:
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.jit(
        lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=sharding
    )()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StateOps:
    """Per-sequence recurrent-state transitions of one step (0 = none; slot 0 is the sink)."""

    restore_src: jax.Array  # i32[N] checkpoint slot copied into the sequence's working slot before the step
    snap_dst: jax.Array  # i32[N] slot that receives a copy of the working slot after the step


def copy_slots(pool: RecurrentPool, src: jax.Array, dst: jax.Array) -> RecurrentPool:
    """pool[dst] = pool[src] for every pair (gather then scatter, so all sources are read first).
    Pairs with dst 0 write the sink."""
    return RecurrentPool(ssm=pool.ssm.at[dst].set(pool.ssm[src]), conv=pool.conv.at[dst].set(pool.conv[src]))


def restore_checkpoints(state: DeviceState, ops: StateOps, slots: jax.Array) -> DeviceState:
    dst = jnp.where(ops.restore_src > 0, slots, 0)
    return DeviceState(recurrent=copy_slots(state.recurrent, ops.restore_src, dst), kv=state.kv)


def snapshot_slots(state: DeviceState, ops: StateOps, slots: jax.Array) -> DeviceState:
    src = jnp.where(ops.snap_dst > 0, slots, 0)
    return DeviceState(recurrent=copy_slots(state.recurrent, src, ops.snap_dst), kv=state.kv)
