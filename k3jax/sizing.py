"""Memory sizing from a config: parameters, per-request KDA state, per-token MLA KV, weights per device,
the smallest deployment that fits, and the collective traffic of a decode token.

Everything is computed from the parameter shapes the model itself builds (`param_shapes`, no
allocation), the device state layout in `k3jax.state`, and the sharding rules in `sharding.rules`
(which dims shard over dp / tp / ep), so the figures cannot drift from the code.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from k3jax.config import ModelConfig

MXFP4_BITS = 4.25  # 4-bit E2M1 values plus one 8-bit scale per 32


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    tp: int
    ep: int
    param_count: int
    expert_param_count: int
    kda_recurrent_bytes_per_request: int  # f32 KDA state, per device
    kda_conv_bytes_per_request: int  # carried conv inputs, per device
    mla_kv_bytes_per_token: int  # c + k_pe over all MLA layers, per device holding it (latent replicated over tp)
    weight_bytes_per_device: int
    dp: int = 1
    expert_weight_bytes_per_device: int = 0
    state_shards: int = 1  # devices a request's recurrent slots are spread over (slots axis)
    kv_shards: int = 1  # devices the KV pages are spread over (pages axis; dp with DP-attention)

    @property
    def kda_state_bytes_per_request(self) -> int:
        return self.kda_recurrent_bytes_per_request + self.kda_conv_bytes_per_request

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.ep

    def request_bytes_per_device(self, context: int) -> float:
        """Device memory one request of `context` tokens costs on average per device."""
        return self.kda_state_bytes_per_request / self.state_shards + context * self.mla_kv_bytes_per_token / self.kv_shards

    def max_requests(self, hbm_bytes: int, context: int, reserve_frac: float = 0.1) -> int:
        """Concurrent requests of `context` tokens that fit beside the weights (`reserve_frac` of HBM
        kept for activations and workspace)."""
        free = hbm_bytes * (1 - reserve_frac) - self.weight_bytes_per_device
        return max(int(free // self.request_bytes_per_device(context)), 0)


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path)


def memory_plan(cfg: ModelConfig, tp: int = 1, *, ep: int = 1, dp: int = 1, rules=None,
                expert_bits: float | None = None, kv_dtype_bytes: int = 2,
                conv_dtype_bytes: int | None = None) -> MemoryPlan:
    """Sizing of `cfg` on a dp x tp x ep mesh, sharded as `rules` say (default `sharding.rules.Rules()`).

    `expert_bits`: storage bits per routed-expert parameter (None: the config dtype; 4.25 for
    MXFP4). KV and conv state are costed in `kv_dtype_bytes` (bf16 unless told otherwise).
    """
    from k3jax.model.init import param_shapes
    from k3jax.state import state_shapes
    from sharding.rules import Rules, check_divisible, param_logical_axes, param_specs, shard_factor, state_specs

    if min(tp, ep, dp) < 1:
        raise ValueError("tp, ep and dp must be >= 1")
    rules = rules or Rules()
    sizes = {"dp": dp, "tp": tp, "ep": ep}
    check_divisible(cfg, sizes, rules)
    specs = jax.tree_util.tree_leaves(param_specs(cfg, rules), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    axes = jax.tree_util.tree_leaves(param_logical_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    total = experts = 0
    per_device = expert_bytes = 0.0
    for leaf, spec, logical in zip(jax.tree_util.tree_leaves(param_shapes(cfg)), specs, axes):
        n = int(np.prod(leaf.shape))
        total += n
        nbytes = n * leaf.dtype.itemsize
        if "experts" in logical:
            experts += n
            if expert_bits is not None:
                nbytes = n * expert_bits / 8
            expert_bytes += nbytes / shard_factor(spec, sizes)
        per_device += nbytes / shard_factor(spec, sizes)
    st, st_specs = state_shapes(cfg, 1, 1, 1), state_specs(cfg, rules)
    conv_b = conv_dtype_bytes if conv_dtype_bytes is not None else kv_dtype_bytes
    per_slot = lambda a, spec, b: int(np.prod(a.shape[1:])) * b // shard_factor(spec, sizes, skip_dims=(0,))
    return MemoryPlan(
        tp=tp,
        ep=ep,
        dp=dp,
        param_count=total,
        expert_param_count=experts,
        kda_recurrent_bytes_per_request=per_slot(st.recurrent.ssm, st_specs.recurrent.ssm, 4),
        kda_conv_bytes_per_request=per_slot(st.recurrent.conv, st_specs.recurrent.conv, conv_b),
        mla_kv_bytes_per_token=per_slot(st.kv.pages, st_specs.kv.pages, kv_dtype_bytes),  # one page of 1 token
        weight_bytes_per_device=int(per_device),
        expert_weight_bytes_per_device=int(expert_bytes),
        state_shards=shard_factor(st_specs.recurrent.ssm[:1], sizes),
        kv_shards=shard_factor(st_specs.kv.pages[:1], sizes),
    )


@dataclasses.dataclass(frozen=True)
class Deployment:
    nodes: int
    plan: MemoryPlan
    max_requests: int


def smallest_deployment(cfg: ModelConfig, hbm_bytes: int, context: int, *, gpus_per_node: int = 8,
                        requests: int = 1, max_nodes: int = 64, reserve_frac: float = 0.1, rules=None,
                        **plan_kw) -> Deployment | None:
    """Fewest nodes of `gpus_per_node` devices holding `requests` requests of `context` tokens: tp
    within a node (largest first), ep over the rest; on that node count, the mesh serving the most
    requests. None if nothing up to `max_nodes` fits."""
    tps = [t for t in range(gpus_per_node, 0, -1) if gpus_per_node % t == 0]
    for nodes in range(1, max_nodes + 1):
        best = None
        for tp in tps:
            ep = nodes * gpus_per_node // tp
            try:
                plan = memory_plan(cfg, tp, ep=ep, rules=rules, **plan_kw)
            except ValueError:  # tp or ep does not divide heads / experts
                continue
            n = plan.max_requests(hbm_bytes, context, reserve_frac)
            if n >= requests and (best is None or n > best.max_requests):
                best = Deployment(nodes, plan, n)
        if best is not None:
            return best
    return None


@dataclasses.dataclass(frozen=True)
class DecodeTraffic:
    """Bytes one decode token moves per layer (payload, and per device on a ring for reductions)."""

    attn_allreduce_payload: int  # o_proj partial sums [D] over tp (reduce-scatter + all-gather)
    attn_allreduce_per_device: float
    ffn_allreduce_per_device: float  # dense FFN, or shared experts + latent_up, over tp
    latent_allgather_per_device: float  # LatentMoE z [Din] sharded by tp, gathered for the experts
    expert_dispatch_payload: int  # k routed copies of z (all-to-all); the combine returns as many
    expert_alltoall_per_device: float  # dispatch + combine bytes that leave an ep rank
    expert_allreduce_per_device: float  # as implemented now: psum of z-width f32 over ep x tp
    logits_allgather_per_device: float  # once per token (not per layer): vocab-sharded f32 logits


def decode_traffic(cfg: ModelConfig, tp: int, ep: int, act_bytes: int = 2) -> DecodeTraffic:
    D, Din, k = cfg.hidden_size, cfg.moe_expert_dim, cfg.num_experts_per_token
    ring = lambda n, payload: 2 * (n - 1) / n * payload
    latent = cfg.routed_expert_hidden_size is not None
    return DecodeTraffic(
        attn_allreduce_payload=D * act_bytes,
        attn_allreduce_per_device=ring(tp, D * act_bytes),
        ffn_allreduce_per_device=ring(tp, D * act_bytes),
        latent_allgather_per_device=(tp - 1) / tp * Din * act_bytes if latent else 0.0,
        expert_dispatch_payload=k * Din * act_bytes,
        expert_alltoall_per_device=2 * k * Din * act_bytes * (ep - 1) / ep,
        expert_allreduce_per_device=ring(ep * tp, Din * 4),
        logits_allgather_per_device=(tp - 1) / tp * cfg.vocab_size * 4,
    )


def spec_window_bytes(K: int, V: int, gamma: int, in_bytes: int = 2) -> dict:
    """Per request-layer-head memory of a speculative block of gamma+1 tokens: `snapshot` = keeping
    gamma+1 f32 K x V states (the brute-force rollback), `replay` = ReplaySSM's captured step inputs.
    Computed from the constants the engine sizes its capture with (`pallas_kernels.kda.spec`)."""
    from pallas_kernels.kda.spec import replay_bytes, snapshot_bytes

    return {"snapshot": snapshot_bytes(K, V, gamma), "replay": replay_bytes(K, V, gamma, in_bytes)}
