"""Device state pytrees: the slot-major recurrent pool and the page-major MLA KV pool.

Slot 0 and page 0 are padding sinks: padded sequences read and write them, so no step ever
needs a mask on its state writes. Everything the engine touches on device lives in one
`DeviceState`, donated to every step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.model.common import dtype_of


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RecurrentPool:
    ssm: jax.Array  # f32[S, L_kda, H, K, V] KDA state per slot and layer
    conv: jax.Array  # dtype[S, L_kda, W-1, C] last W-1 conv inputs (q|k|v channels)

    in_place = True  # kernels may read and write `ssm` by slot directly

    def read_ssm(self, slots, layer: int):
        return self.ssm[slots, layer]

    def write_ssm(self, slots, layer: int, x) -> "RecurrentPool":
        return RecurrentPool(ssm=self.ssm.at[slots, layer].set(x), conv=self.conv)

    def read_conv(self, slots, layer: int):
        return self.conv[slots, layer]

    def write_conv(self, slots, layer: int, x) -> "RecurrentPool":
        return RecurrentPool(ssm=self.ssm, conv=self.conv.at[slots, layer].set(x.astype(self.conv.dtype)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPool:
    pages: jax.Array  # dtype[P, L_mla, page_size, R + N_rope] MLA latent c and shared k_pe

    @property
    def page_size(self) -> int:
        return self.pages.shape[2]

    in_place = True  # the attention reads `pages` at the layer directly

    def write_tokens(self, page, layer: int, offset, x) -> "KVPool":
        """x [T, Dk] into (page[t], layer, offset[t])."""
        return KVPool(pages=self.pages.at[page, layer, offset].set(x.astype(self.pages.dtype)))

    def attention_pages(self, page_rows, layer: int):
        """(rows, pages) for `mla_paged_attention` at `layer`: the pool itself, read in place."""
        return page_rows, self.pages


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceState:
    recurrent: RecurrentPool
    kv: KVPool

    def with_recurrent(self, rec) -> "DeviceState":
        return DeviceState(recurrent=rec, kv=self.kv)

    def with_kv(self, kv) -> "DeviceState":
        return DeviceState(recurrent=self.recurrent, kv=kv)


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


def copy_slots(state, src: jax.Array, dst: jax.Array):
    """state[dst] = state[src] for whole recurrent slots (all sources are read first; pairs with
    dst 0 write the sink). Works on `DeviceState` and `UnifiedState`."""
    if isinstance(state, UnifiedState):
        return state.copy_blocks(src, dst)
    pool = state.recurrent
    rec = RecurrentPool(ssm=pool.ssm.at[dst].set(pool.ssm[src]), conv=pool.conv.at[dst].set(pool.conv[src]))
    return state.with_recurrent(rec)


def restore_checkpoints(state, ops: StateOps, slots: jax.Array):
    return copy_slots(state, ops.restore_src, jnp.where(ops.restore_src > 0, slots, 0))


def snapshot_slots(state, ops: StateOps, slots: jax.Array):
    return copy_slots(state, jnp.where(ops.snap_dst > 0, slots, 0), ops.snap_dst)


# ---- unified memory: one buffer, state blocks from the low end, KV pages from the high end ----

def _words(n_elems: int, dtype) -> int:
    b = n_elems * jnp.dtype(dtype).itemsize
    if b % 4:
        raise ValueError("unified memory needs every view to be a whole number of 32-bit words")
    return b // 4


@dataclasses.dataclass(frozen=True)
class UnifiedGeometry:
    """Static layout of the unified buffer `u32[rows, R]` (R: a common divisor of every view).

    State block b: rows [b * block_rows, ...): per KDA layer its f32 state [H, K, V], then per layer
    the carried conv inputs [W-1, C]. KV page q: rows [rows - (q + 1) * page_rows, ...): per MLA
    layer `page_size` tokens of [Dk]."""

    rows: int
    R: int
    block_rows: int
    page_rows: int
    ssm_shape: tuple  # (H, K, V)
    conv_shape: tuple  # (W-1, C)
    conv_base: int  # rows from the block start to the conv part
    kv_dtype: str
    page_size: int
    dk: int
    L_kda: int
    L_mla: int

    @property
    def ssm_rows(self) -> int:
        return _words(math.prod(self.ssm_shape), jnp.float32) // self.R

    @property
    def conv_rows(self) -> int:
        return _words(math.prod(self.conv_shape), self.kv_dtype) // self.R

    @property
    def token_rows(self) -> int:
        return _words(self.dk, self.kv_dtype) // self.R

    @property
    def block_bytes(self) -> int:
        return self.block_rows * self.R * 4

    @property
    def page_bytes(self) -> int:
        return self.page_rows * self.R * 4

    @staticmethod
    def build(cfg: ModelConfig, total_bytes: int, page_size: int) -> "UnifiedGeometry":
        dt = dtype_of(cfg)
        H, K, W1, C = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size - 1, cfg.kda_conv_channels
        ssm_w = _words(H * K * K, jnp.float32)
        conv_w = _words(W1 * C, dt)
        tok_w = _words(cfg.mla_cache_dim, dt)
        R = math.gcd(ssm_w, conv_w, tok_w)
        block_rows = cfg.num_kda_layers * (ssm_w + conv_w) // R
        page_rows = cfg.num_mla_layers * page_size * tok_w // R
        return UnifiedGeometry(
            rows=total_bytes // (4 * R), R=R, block_rows=max(block_rows, 1), page_rows=max(page_rows, 1),
            ssm_shape=(H, K, K), conv_shape=(W1, C), conv_base=cfg.num_kda_layers * ssm_w // R,
            kv_dtype=str(jnp.dtype(dt)), page_size=page_size, dk=cfg.mla_cache_dim,
            L_kda=cfg.num_kda_layers, L_mla=cfg.num_mla_layers)


def _gather_rows(buf, start, n: int):
    """buf[start[i] : start[i] + n] for every i -> [*start.shape, n, R]."""
    idx = start.reshape(-1, 1).astype(jnp.int32)
    dn = jax.lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0,))
    out = jax.lax.gather(buf, idx, dn, (n, buf.shape[1]), mode=jax.lax.GatherScatterMode.CLIP)
    return out.reshape(start.shape + (n, buf.shape[1]))


def _scatter_rows(buf, start, rows):
    """buf[start[i] : start[i] + n] = rows[i] (rows [N, n, R])."""
    idx = start.reshape(-1, 1).astype(jnp.int32)
    dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(),
                                         scatter_dims_to_operand_dims=(0,))
    return jax.lax.scatter(buf, idx, rows.reshape((-1,) + rows.shape[-2:]), dn,
                           mode=jax.lax.GatherScatterMode.CLIP)


def _to_words(x, R: int):
    """Any-dtype array [N, ...] -> u32 [N, rows, R]."""
    x = x.reshape(x.shape[0], -1)
    if x.dtype.itemsize == 2:
        x = x.reshape(x.shape[0], -1, 2)
    w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return w.reshape(w.shape[0], -1, R)


def _from_words(w, dtype, shape):
    """u32 [N, rows, R] -> dtype [N, *shape]."""
    w = w.reshape(w.shape[0], -1)
    x = jax.lax.bitcast_convert_type(w, jnp.dtype(dtype))
    return x.reshape((w.shape[0],) + tuple(shape))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class UnifiedRecurrent:
    """The recurrent pool as a view of the unified buffer; slot ids are physical block ids."""

    buf: jax.Array  # u32[rows, R]
    geom: UnifiedGeometry = dataclasses.field(metadata=dict(static=True))

    in_place = False

    def _ssm_start(self, slots, layer):
        return slots * self.geom.block_rows + layer * self.geom.ssm_rows

    def _conv_start(self, slots, layer):
        return slots * self.geom.block_rows + self.geom.conv_base + layer * self.geom.conv_rows

    def read_ssm(self, slots, layer: int):
        w = _gather_rows(self.buf, self._ssm_start(slots, layer), self.geom.ssm_rows)
        return _from_words(w, jnp.float32, self.geom.ssm_shape)

    def write_ssm(self, slots, layer: int, x) -> "UnifiedRecurrent":
        w = _to_words(x.astype(jnp.float32), self.geom.R)
        return UnifiedRecurrent(_scatter_rows(self.buf, self._ssm_start(slots, layer), w), self.geom)

    def read_conv(self, slots, layer: int):
        w = _gather_rows(self.buf, self._conv_start(slots, layer), self.geom.conv_rows)
        return _from_words(w, self.geom.kv_dtype, self.geom.conv_shape)

    def write_conv(self, slots, layer: int, x) -> "UnifiedRecurrent":
        w = _to_words(x.astype(self.geom.kv_dtype), self.geom.R)
        return UnifiedRecurrent(_scatter_rows(self.buf, self._conv_start(slots, layer), w), self.geom)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class UnifiedKV:
    """The KV pages as a view of the unified buffer; page ids are physical ids from the high end."""

    buf: jax.Array  # u32[rows, R]
    geom: UnifiedGeometry = dataclasses.field(metadata=dict(static=True))

    @property
    def page_size(self) -> int:
        return self.geom.page_size

    def _page_start(self, page):
        return self.geom.rows - (page + 1) * self.geom.page_rows

    def write_tokens(self, page, layer: int, offset, x) -> "UnifiedKV":
        g = self.geom
        start = self._page_start(page) + (layer * g.page_size + offset) * g.token_rows
        return UnifiedKV(_scatter_rows(self.buf, start, _to_words(x.astype(g.kv_dtype), g.R)), g)

    in_place = False  # the attention reads a gathered one-layer copy (layer 0)

    def attention_pages(self, page_rows, layer: int):
        """Gather the pages a step reads -> (rows, pages [G*P, 1, ps, Dk]), read at layer 0."""
        g = self.geom
        n = g.page_size * g.token_rows
        w = _gather_rows(self.buf, self._page_start(page_rows.reshape(-1)) + layer * n, n)
        pages = _from_words(w, g.kv_dtype, (1, g.page_size, g.dk))
        return jnp.arange(page_rows.size, dtype=jnp.int32).reshape(page_rows.shape), pages


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class UnifiedState:
    buf: jax.Array  # u32[rows, R]: state blocks from row 0 up, KV pages from the last row down
    geom: UnifiedGeometry = dataclasses.field(metadata=dict(static=True))

    @property
    def recurrent(self) -> UnifiedRecurrent:
        return UnifiedRecurrent(self.buf, self.geom)

    @property
    def kv(self) -> UnifiedKV:
        return UnifiedKV(self.buf, self.geom)

    def with_recurrent(self, rec) -> "UnifiedState":
        return UnifiedState(rec.buf, self.geom)

    def with_kv(self, kv) -> "UnifiedState":
        return UnifiedState(kv.buf, self.geom)

    def copy_blocks(self, src, dst) -> "UnifiedState":
        """Whole state blocks dst <- src (all sources read first)."""
        n = self.geom.block_rows
        rows = _gather_rows(self.buf, src * n, n)
        return UnifiedState(_scatter_rows(self.buf, dst * n, rows), self.geom)

    def move_pages(self, src, dst) -> "UnifiedState":
        g = self.geom
        start = lambda q: g.rows - (q + 1) * g.page_rows
        rows = _gather_rows(self.buf, start(src), g.page_rows)
        return UnifiedState(_scatter_rows(self.buf, start(dst), rows), g)


def init_unified_state(cfg: ModelConfig, total_bytes: int, page_size: int) -> UnifiedState:
    geom = UnifiedGeometry.build(cfg, total_bytes, page_size)
    return UnifiedState(jnp.zeros((geom.rows, geom.R), jnp.uint32), geom)
