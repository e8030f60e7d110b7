"""Logical axis names on every parameter and device-state leaf, and the rules that map them to mesh axes.

A leaf's logical axes name the dimensions that may be sharded (`None`: never sharded):

  vocab       embedding rows / LM-head columns                          -> tp
  kda_heads   KDA heads (H*K / H*V / H dims, head-major; conv channels)  -> tp
  mla_heads   MLA heads (H*(N+V) dims)                                   -> tp
  ffn         dense-FFN and shared-expert intermediate                   -> tp
  latent      LatentMoE latent width of latent_down / latent_up          -> tp
  experts     routed experts                                             -> ep
  expert_ffn  routed-expert intermediate                                 -> tp
  slots       recurrent-pool slots                                       -> (replicated)
  pages       MLA KV pages                                               -> (replicated; dp with DP-attention)

Replicated on purpose: norms, router and its bias, KDA f_a / g_a / o_norm / conv taps, MLA q_a /
kv_a (the latent is shared by all heads, so the KV pages are too), AttnRes sites. The KDA conv
taps are tiny (K3: 40 MB) and stay replicated so the step can regroup them for the conv state's
per-shard channel order (see `k3jax.model.kda.group_channels`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax.config import ModelConfig
from sharding.mesh import AXES, mesh_sizes

MeshAxes = str | tuple[str, ...] | None


class Logical(tuple):
    """Logical axis names of one leaf (a pytree leaf, unlike a plain tuple)."""

    def __repr__(self):
        return f"Logical{tuple(self)!r}"


_V3 = (None, None, "kda_heads")
_M3 = (None, None, "mla_heads")
PARAM_AXES: dict[str, tuple] = {
    "embed": ("vocab", None),
    "lm_head": (None, "vocab"),
    "final_norm": (None,),
    "input_norm": (None, None),
    "post_norm": (None, None),
    "kda.q_proj": _V3, "kda.k_proj": _V3, "kda.v_proj": _V3,
    "kda.conv": (None, None, None),
    "kda.f_a": (None, None, None),
    "kda.f_b": _V3,
    "kda.dt_bias": (None, "kda_heads"),
    "kda.a_log": (None, "kda_heads"),
    "kda.b_proj": _V3,
    "kda.o_norm": (None, None),
    "kda.o_proj": (None, "kda_heads", None),
    "kda.g_proj": _V3,
    "kda.g_a": (None, None, None),
    "kda.g_b": _V3,
    "mla.kv_a": (None, None, None),
    "mla.kv_a_norm": (None, None),
    "mla.kv_b": _M3,
    "mla.o_proj": (None, "mla_heads", None),
    "mla.q_a": (None, None, None),
    "mla.q_a_norm": (None, None),
    "mla.q_b": _M3,
    "mla.q_proj": _M3,
    "mla.g_proj": _M3,
    "dense.gate": (None, None, "ffn"), "dense.up": (None, None, "ffn"), "dense.down": (None, "ffn", None),
    "moe.router": (None, None, None),
    "moe.router_bias": (None, None),
    "moe.w1": (None, "experts", None, "expert_ffn"),
    "moe.w3": (None, "experts", None, "expert_ffn"),
    "moe.w2": (None, "experts", "expert_ffn", None),
    "moe.latent_down": (None, None, "latent"),
    "moe.latent_norm": (None, None),
    "moe.latent_up": (None, "latent", None),
    "moe.shared.gate": (None, None, "ffn"), "moe.shared.up": (None, None, "ffn"),
    "moe.shared.down": (None, "ffn", None),
    "attn_res.attn.proj": (None, None), "attn_res.attn.norm": (None, None),
    "attn_res.mlp.proj": (None, None), "attn_res.mlp.norm": (None, None),
    "attn_res.out.proj": (None,), "attn_res.out.norm": (None,),
}
STATE_AXES: dict[str, tuple] = {
    "recurrent.ssm": ("slots", None, "kda_heads", None, None),  # [S, L, H, K, V]
    "recurrent.conv": ("slots", None, None, "kda_heads"),  # [S, L, W-1, C], C in per-shard groups
    "kv.pages": ("pages", None, None, None),  # [P, L, page_size, R + N_rope]
}


@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical axis -> mesh axes (a name, a tuple of names, or None for replicated)."""

    vocab: MeshAxes = "tp"
    kda_heads: MeshAxes = "tp"
    mla_heads: MeshAxes = "tp"
    ffn: MeshAxes = "tp"
    latent: MeshAxes = "tp"
    experts: MeshAxes = "ep"
    expert_ffn: MeshAxes = "tp"
    slots: MeshAxes = None
    pages: MeshAxes = None

    @classmethod
    def dp_attention(cls, **kw) -> "Rules":
        """MLA attention data-parallel over dp: each dp shard holds its own requests' KV pages."""
        return cls(pages="dp", **kw)

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        try:
            m = getattr(self, logical)
        except AttributeError:
            raise ValueError(f"unknown logical axis {logical!r}") from None
        return () if m is None else ((m,) if isinstance(m, str) else tuple(m))

    def spec(self, logical: tuple) -> P:
        """PartitionSpec of a leaf with these logical axes; each mesh axis used at most once."""
        out, used = [], set()
        for name in logical:
            axes = self.mesh_axes(name)
            if set(axes) - set(AXES):
                raise ValueError(f"rules map {name!r} to {axes}; mesh axes are {AXES}")
            if used & set(axes):
                raise ValueError(f"rules map two dims of {tuple(logical)} to mesh axis {sorted(used & set(axes))}")
            used |= set(axes)
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*out)

    def size(self, logical: str, sizes: Mapping[str, int]) -> int:
        """Shards of `logical` on a mesh with these axis sizes."""
        return math.prod(sizes.get(a, 1) for a in self.mesh_axes(logical))


def _name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path)


def _tree_axes(shapes, table: dict, what: str):
    def one(path, leaf):
        name = _name(path)
        if name not in table:
            raise KeyError(f"{what} leaf {name!r} has no logical axes in sharding.rules; add it")
        axes = table[name]
        if len(axes) != len(leaf.shape):
            raise ValueError(f"{what} leaf {name!r}: logical axes {axes} do not fit its shape {leaf.shape}")
        return Logical(axes)

    return jax.tree_util.tree_map_with_path(one, shapes)


@functools.lru_cache(maxsize=16)
def param_logical_axes(cfg: ModelConfig):
    """A `Params` tree of `Logical` axes for `cfg` (no allocation)."""
    from k3jax.model.init import param_shapes

    return _tree_axes(param_shapes(cfg), PARAM_AXES, "parameter")


@functools.lru_cache(maxsize=16)
def state_logical_axes(cfg: ModelConfig):
    """A `DeviceState` tree of `Logical` axes."""
    from k3jax.state import state_shapes

    return _tree_axes(state_shapes(cfg, 2, 2, 1), STATE_AXES, "device-state")


def _specs(tree, rules: Rules):
    return jax.tree_util.tree_map(rules.spec, tree, is_leaf=lambda x: isinstance(x, Logical))


def param_specs(cfg: ModelConfig, rules: Rules | None = None):
    """A `Params` tree of mesh PartitionSpecs (mesh-free: also used by `k3jax.sizing`)."""
    return _specs(param_logical_axes(cfg), rules or Rules())


def state_specs(cfg: ModelConfig, rules: Rules | None = None):
    """A `DeviceState` tree of mesh PartitionSpecs."""
    return _specs(state_logical_axes(cfg), rules or Rules())


def shard_factor(spec: P, sizes: Mapping[str, int], skip_dims: tuple[int, ...] = ()) -> int:
    """Devices one leaf with `spec` is split over (dims in `skip_dims` not counted)."""
    n = 1
    for d, entry in enumerate(spec):
        if d in skip_dims or entry is None:
            continue
        for a in (entry,) if isinstance(entry, str) else entry:
            n *= sizes.get(a, 1)
    return n


def check_divisible(cfg: ModelConfig, sizes: Mapping[str, int], rules: Rules | None = None) -> None:
    """ValueError unless heads, experts, vocab and widths divide over their mesh axes."""
    rules = rules or Rules()
    need = [("kda_heads", cfg.kda_num_heads if cfg.num_kda_layers else 0, "KDA heads"),
            ("mla_heads", cfg.mla_num_heads if cfg.num_mla_layers else 0, "MLA heads"),
            ("vocab", cfg.vocab_size, "vocabulary rows"),
            ("ffn", cfg.intermediate_size if cfg.num_dense_layers else 0, "dense FFN intermediate"),
            ("ffn", cfg.shared_intermediate_size if cfg.num_moe_layers else 0, "shared-expert intermediate"),
            ("experts", cfg.num_experts if cfg.num_moe_layers else 0, "routed experts"),
            ("expert_ffn", cfg.moe_intermediate_size if cfg.num_moe_layers else 0, "expert intermediate"),
            ("latent", cfg.moe_expert_dim if cfg.routed_expert_hidden_size and cfg.num_moe_layers else 0,
             "LatentMoE latent width")]
    for logical, n, what in need:
        k = rules.size(logical, sizes)
        if n and n % k:
            axes = "x".join(f"{a}={sizes.get(a, 1)}" for a in rules.mesh_axes(logical))
            raise ValueError(f"{axes} does not divide the {n} {what} of {cfg.name} (logical axis {logical!r})")


def _named(mesh: Mesh, specs):
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules | None = None):
    """A `Params` tree of NamedSharding for `cfg` on `mesh`."""
    rules = rules or Rules()
    check_divisible(cfg, mesh_sizes(mesh), rules)
    return _named(mesh, param_specs(cfg, rules))


def split_shardings(shardings, cfg: ModelConfig):
    """`param_shardings` for the per-layer layout (`k3jax.model.forward.split_layers`): each stacked
    field becomes a tuple of its per-layer shardings (the spec without its leading layer axis)."""
    from k3jax.model.forward import layer_fields, map_layer_fields

    counts = layer_fields(cfg)
    drop = lambda sh: NamedSharding(sh.mesh, P(*tuple(sh.spec)[1:]))
    return map_layer_fields(shardings, lambda t, name: (jax.tree_util.tree_map(drop, t),) * counts[name])


def state_shardings(cfg: ModelConfig, mesh: Mesh, slots: int | None = None, pages: int | None = None,
                    page_size: int | None = None, rules: Rules | None = None):
    """A `DeviceState` tree of NamedSharding; `slots` / `pages` (when given) must divide over their axes."""
    rules = rules or Rules()
    sizes = mesh_sizes(mesh)
    check_divisible(cfg, sizes, rules)
    for logical, n in (("slots", slots), ("pages", pages)):
        k = rules.size(logical, sizes)
        if n is not None and n % k:
            raise ValueError(f"{n} {logical} do not divide over {k} shards of {rules.mesh_axes(logical)}")
    del page_size  # any page size shards the same way
    return _named(mesh, state_specs(cfg, rules))


def shard_params(params, shardings):
    """Place `params` (host or device arrays) onto `shardings` (e.g. `param_shardings(...)`)."""
    return jax.device_put(params, shardings)
