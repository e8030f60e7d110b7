"""The sharded step: a step function (the model's `forward`, or the engine's device step around it)
under jit with explicit in/out shardings on a mesh; one construction serves both.

Parameters and device state are laid out by the rules (`sharding.rules`); the step's other inputs
(batch, state ops, sampling parameters) and its output are replicated; the state is donated.
Attention and dense FFNs run under plain jit (GSPMD propagates the head / intermediate shardings
from the weights and inserts the all-reduces); the model calls back into
`MeshContext` where code must run per shard:

- `kernel`: a kernel call (KDA decode / chunk) under `shard_map` over the head axis, so a Pallas
  kernel sees its local heads and its block of the recurrent pool;
- `paged_attention`: the MLA kernel per head shard; with DP-attention (pages on dp) each dp shard
  attends over the sequences whose pages it holds and the shards' outputs are summed;
- `experts`: the routed experts expert-parallel. Every token's latent is replicated within the
  expert group; each (ep, tp) shard runs a ragged grouped matmul over its local experts and its
  slice of their intermediate, and one psum over (ep, tp) combines. Correct and simple; its cost
  is an all-reduce of T x Din f32 per MoE layer and every shard sorting all T*k assignments, where
  an all-to-all dispatch would move only the k routed copies (see docs/sharding.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3jax.config import ModelConfig
from sharding.mesh import make_mesh
from sharding.rules import Rules, param_shardings, shard_params, split_shardings, state_shardings

try:  # JAX >= 0.6: jax.shard_map (check_vma); older: jax.experimental.shard_map (check_rep)
    _shard_map = jax.shard_map
    _CHECK = "check_vma"
except AttributeError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map as _shard_map
    _CHECK = "check_rep"


def shard_map(f, mesh: Mesh, in_specs, out_specs):
    """`shard_map` on either JAX API, without replication checking (kernels may be opaque to it)."""
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{_CHECK: False})


@dataclasses.dataclass(frozen=True)
class MeshContext:
    """What the model needs to know about the mesh (hashable: a static argument of the step)."""

    mesh: Mesh
    rules: Rules

    def groups(self, logical: str) -> int:
        """Shards of a logical axis (1 when it is replicated)."""
        return self.rules.size(logical, dict(self.mesh.shape))

    def spec(self, logical: tuple) -> P:
        return self.rules.spec(logical)

    def constrain(self, x: jax.Array, logical: tuple) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(logical)))

    def kernel(self, fn, in_axes: tuple, out_axes):
        """`fn(*arrays)` per shard: arguments and results laid out by their logical axes."""
        if self.rules.mesh_axes("slots"):
            raise NotImplementedError("kernels over a slot-sharded recurrent pool are not supported")
        many = bool(out_axes) and isinstance(out_axes[0], tuple)  # several results, or one
        out = tuple(self.spec(a) for a in out_axes) if many else self.spec(out_axes)
        return shard_map(fn, self.mesh, tuple(self.spec(a) for a in in_axes), out)

    def paged_attention(self, fn):
        """`fn(q [G,C,H,Dk], q_pos [G,C], rows [G,P], pages [P,L,ps,Dk], kv_len [G]) -> [G,C,H,R]` per
        head shard; with pages sharded (DP-attention) a dp shard sees only its pages, translates the
        page ids, attends only for sequences whose first page it holds, and the shards are summed."""
        heads = (None, None, "mla_heads", None)
        page_axes = self.rules.mesh_axes("pages")
        rep1, rep2 = P(None), P(None, None)

        def local(q, q_pos, rows, pages, kv_len):
            if page_axes:
                n = pages.shape[0]
                first = _axis_index(page_axes) * n
                owner = (rows[:, 0] >= first) & (rows[:, 0] < first + n)
                rows = jnp.clip(rows - first, 0, n - 1)
                kv_len = jnp.where(owner, kv_len, 0)
            o = fn(q, q_pos, rows, pages, kv_len)
            return jax.lax.psum(o, page_axes) if page_axes else o

        pages_spec = self.spec(("pages", None, None, None))
        return shard_map(local, self.mesh, (self.spec(heads), rep2, rep2, pages_spec, rep1), self.spec(heads))

    def experts(self, routed, p, z, idx, w, cfg: ModelConfig):
        """Expert-parallel `routed(p, z, idx, w, cfg, first_expert)`; z [T, Din] -> f32 [T, Din]."""
        e_axes, f_axes = self.rules.mesh_axes("experts"), self.rules.mesh_axes("expert_ffn")
        if not e_axes and not f_axes:
            return routed(p, z, idx, w, cfg)
        wp = dataclasses.replace(p, router=None, router_bias=None, latent_down=None, latent_norm=None,
                                 latent_up=None, shared=None)  # only the expert weights enter the shard_map
        w_specs = dataclasses.replace(wp, w1=self.spec((None, "experts", None, "expert_ffn")),
                                      w3=self.spec((None, "experts", None, "expert_ffn")),
                                      w2=self.spec((None, "experts", "expert_ffn", None)))
        w_specs = jax.tree_util.tree_map(lambda s: P(*s[1:]), w_specs, is_leaf=lambda s: isinstance(s, P))
        both = tuple(a for a in e_axes + f_axes)

        def local(wp, z, idx, w):
            first = _axis_index(e_axes) * wp.w1.shape[0] if e_axes else jnp.int32(0)
            y = routed(wp, z, idx, w, cfg, first_expert=first)
            return jax.lax.psum(y, both)

        return shard_map(local, self.mesh, (w_specs, P(None, None), P(None, None), P(None, None)),
                         P(None, None))(wp, z, idx, w)


def _axis_index(axes: tuple[str, ...]):
    """Linear index over several mesh axes (the first is major, as in a PartitionSpec entry)."""
    return jax.lax.axis_index(axes[0] if len(axes) == 1 else axes)


def put_replicated(tree, sharding: NamedSharding):
    """Host values -> global arrays replicated on the mesh, in one transfer; arrays already placed so
    are kept. Valid with several processes when every process passes the same values."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    todo = [i for i, a in enumerate(leaves) if not (isinstance(a, jax.Array) and a.sharding == sharding)]
    if todo:
        placed = jax.device_put([np.asarray(leaves[i]) for i in todo], sharding)
        for i, a in zip(todo, placed):
            leaves[i] = a
    return jax.tree_util.tree_unflatten(treedef, leaves)


class ShardedStep:
    """`step(params, state, *inputs) -> (out, state)` on `mesh`: `fn(params, state, *inputs, cfg=, impl=,
    shard=)` under jit with explicit shardings: params and state laid out by the rules, the inputs and
    `out` replicated, the state donated. `fn` defaults to the model's `forward` (out: logits [R, X] f32);
    the engine passes its device step (restore, forward, snapshot, sample).

    Also carries the layouts: `param_shardings`, `state_shardings`, `replicated` (= `batch_sharding`),
    and helpers to place parameters (`shard_params`), host inputs (`replicate`) and allocate sharded
    state (`init_state`).
    """

    def __init__(self, cfg: ModelConfig, mesh, rules: Rules | None = None, impl: str = "xla", fn=None,
                 split: bool = False):
        if fn is None:
            from k3jax.model.forward import forward as fn

        self.cfg, self.mesh, self.rules, self.impl = cfg, make_mesh(mesh), rules or Rules(), impl
        self.context = MeshContext(self.mesh, self.rules)
        self.param_shardings = param_shardings(cfg, self.mesh, self.rules)
        if split:  # the per-layer parameter layout (`split_layers`, what `load_model` gives)
            self.param_shardings = split_shardings(self.param_shardings, cfg)
        self.state_shardings = state_shardings(cfg, self.mesh, rules=self.rules)
        self.replicated = self.batch_sharding = NamedSharding(self.mesh, P())

        def body(params, state, inputs):
            return fn(params, state, *inputs, cfg=cfg, impl=impl, shard=self.context)

        self.jitted = jax.jit(body, in_shardings=(self.param_shardings, self.state_shardings, self.replicated),
                              out_shardings=(self.replicated, self.state_shardings), donate_argnums=(1,))

    def __call__(self, params, state, *inputs):
        return self.jitted(params, state, self.replicate(inputs))

    def replicate(self, tree):
        return put_replicated(tree, self.replicated)

    def shard_params(self, params):
        return shard_params(params, self.param_shardings)

    def init_state(self, slots: int, pages: int, page_size: int):
        from k3jax.state import init_state

        sh = state_shardings(self.cfg, self.mesh, slots, pages, page_size, self.rules)
        return init_state(self.cfg, slots, pages, page_size, sharding=sh)


@functools.lru_cache(maxsize=32)
def _cached_step(cfg, mesh, rules, impl, fn, split):
    return ShardedStep(cfg, mesh, rules, impl, fn, split)


def make_sharded_step(cfg: ModelConfig, mesh, rules: Rules | None = None, impl: str = "xla", fn=None,
                      split: bool = False) -> ShardedStep:
    """The jitted, sharded step for `cfg` on `mesh` (a Mesh or a spec such as "tp=4,ep=2"): `fn` (default
    the model's `forward`) with explicit in/out shardings; split: parameters in the per-layer layout
    (`split_layers`) rather than stacked. One object (and one compile cache) per (cfg, mesh, rules,
    impl, fn, split)."""
    if cfg.batch_invariant_rows:
        raise NotImplementedError("the batch-invariant mode (batch_invariant_rows) on a mesh is not supported yet: "
                                  "its collectives and expert-parallel MoE are not batch-invariant")
    return _cached_step(cfg, make_mesh(mesh), rules or Rules(), impl, fn, split)
