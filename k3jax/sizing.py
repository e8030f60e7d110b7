"""Memory sizing from a config: parameters, per-request KDA state, per-token MLA KV, weights per device.

Everything is computed from the parameter shapes the model itself builds (`param_shapes`, no
allocation) and from the device state layout in `k3jax.state`, so the figures cannot drift from
the code. Tensor parallelism shards attention by heads, FFNs by their intermediate width, experts
and vocabulary; the small pieces listed in `REPLICATED` stay whole on every device.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from k3jax.config import ModelConfig

# parameter leaves (by their path in `Params`) that tensor parallelism does not shard
REPLICATED = (
    "final_norm", "input_norm", "post_norm", "attn_res",
    "kda.f_a", "kda.o_norm", "kda.g_a",
    "mla.q_a", "mla.q_a_norm", "mla.kv_a", "mla.kv_a_norm",
    "moe.router", "moe.router_bias", "moe.latent_norm",
)
EXPERT_LEAVES = ("moe.w1", "moe.w2", "moe.w3")
MXFP4_BITS = 4.25  # 4-bit E2M1 values plus one 8-bit scale per 32


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    tp: int
    ep: int
    param_count: int
    expert_param_count: int
    kda_recurrent_bytes_per_request: int  # f32 KDA state, per device
    kda_conv_bytes_per_request: int  # carried conv inputs, per device
    mla_kv_bytes_per_token: int  # c + k_pe over all MLA layers (latent replicated across TP)
    weight_bytes_per_device: int

    @property
    def kda_state_bytes_per_request(self) -> int:
        return self.kda_recurrent_bytes_per_request + self.kda_conv_bytes_per_request

    def max_requests(self, hbm_bytes: int, context: int, reserve_frac: float = 0.1) -> int:
        """Concurrent requests of `context` tokens that fit beside the weights."""
        free = hbm_bytes * (1 - reserve_frac) - self.weight_bytes_per_device
        per = self.kda_state_bytes_per_request + context * self.mla_kv_bytes_per_token
        return max(int(free // per), 0)


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "key", k))) for k in path)


def memory_plan(cfg: ModelConfig, tp: int = 1, *, ep: int = 1, expert_bits: float | None = None,
                kv_dtype_bytes: int = 2, conv_dtype_bytes: int | None = None) -> MemoryPlan:
    """Sizing of `cfg` on a `tp`-way tensor-parallel (and `ep`-way expert-parallel) device group.

    `expert_bits`: storage bits per routed-expert parameter (None: the config dtype; 4.25 for
    MXFP4). KV and conv state are costed in `kv_dtype_bytes` (bf16 unless told otherwise).
    """
    from k3jax.model.init import param_shapes

    if tp < 1 or ep < 1:
        raise ValueError("tp and ep must be >= 1")
    if cfg.kda_num_heads % tp or cfg.mla_num_heads % tp:
        raise ValueError(f"tp={tp} does not divide the attention heads")
    total = experts = 0
    per_device = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes(cfg))[0]:
        name = _path_name(path)
        n = int(np.prod(leaf.shape))
        total += n
        nbytes = n * leaf.dtype.itemsize
        if name in EXPERT_LEAVES:
            experts += n
            if expert_bits is not None:
                nbytes = n * expert_bits / 8
            per_device += nbytes / (tp * ep)
        elif any(name == r or name.startswith(r + ".") for r in REPLICATED):
            per_device += nbytes
        else:
            per_device += nbytes / tp
    H, K = cfg.kda_num_heads // tp, cfg.kda_head_dim
    conv_b = conv_dtype_bytes if conv_dtype_bytes is not None else kv_dtype_bytes
    return MemoryPlan(
        tp=tp,
        ep=ep,
        param_count=total,
        expert_param_count=experts,
        kda_recurrent_bytes_per_request=cfg.num_kda_layers * H * K * K * 4,
        kda_conv_bytes_per_request=cfg.num_kda_layers * (cfg.kda_conv_size - 1) * 3 * H * K * conv_b,
        mla_kv_bytes_per_token=cfg.num_mla_layers * cfg.mla_cache_dim * kv_dtype_bytes,
        weight_bytes_per_device=int(per_device),
    )
