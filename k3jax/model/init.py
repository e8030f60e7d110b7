"""Seeded random parameters for any config (the random presets) and their shapes.

Scales keep a random model's activations O(1) through depth, and the LM head is scaled so logits
have a standard deviation of `OUTPUT_STD`: top-2 margins of random models are then large, so greedy
token identity across engine features is a meaningful test (DESIGN.md section 4).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.model.attn_res import AttnResParams, ResSite
from k3jax.model.common import dtype_of
from k3jax.model.forward import Params
from k3jax.model.kda import KDAParams
from k3jax.model.mla import MLAParams
from k3jax.model.moe import DenseParams, MoEParams

OUTPUT_STD = 8.0


class _Normals:
    """Standard normals for every weight from ONE threefry draw (compiles fast; deterministic on
    every backend): a first pass over the init code counts the elements, the second slices."""

    def __init__(self, seed: int, total: int | None):
        self.key = jax.random.key(seed)
        self.flat = None if total is None else jax.random.normal(jax.random.fold_in(self.key, 0), (total,), jnp.float32)
        self.offset = 0
        self.n_keys = 0

    def take(self, shape):
        n = math.prod(shape)
        out = jnp.zeros(shape, jnp.float32) if self.flat is None else self.flat[self.offset:self.offset + n].reshape(shape)
        self.offset += n
        return out

    def key_(self):
        self.n_keys += 1
        return jax.random.fold_in(self.key, self.n_keys)


def _init(cfg: ModelConfig, seed: int) -> Params:
    counting = _Normals(seed, None)
    _build(cfg, counting)
    return _build(cfg, _Normals(seed, counting.offset))


def _build(cfg: ModelConfig, normals: _Normals) -> Params:
    keys = normals.key_
    dt = dtype_of(cfg)
    f32 = jnp.float32

    def w(*shape, fan_in=None, std=None, dtype=dt):
        std = std if std is not None else (fan_in or shape[-2]) ** -0.5
        return (std * normals.take(shape)).astype(dtype)

    def ones(*shape):
        return jnp.ones(shape, dt)

    D, L = cfg.hidden_size, cfg.num_layers
    kda = mla = dense = moe = res = None
    if (Lk := cfg.num_kda_layers):
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        P = H * K
        dt_val = jnp.exp(jax.random.uniform(keys(), (Lk, P), f32, jnp.log(1e-3), jnp.log(1e-1)))
        kda = KDAParams(
            q_proj=w(Lk, D, P), k_proj=w(Lk, D, P), v_proj=w(Lk, D, P),
            conv=w(Lk, cfg.kda_conv_size, 3 * P, std=0.5, dtype=f32),
            f_a=w(Lk, D, K), f_b=w(Lk, K, P),
            dt_bias=dt_val + jnp.log(-jnp.expm1(-dt_val)),
            a_log=jnp.log(jax.random.uniform(keys(), (Lk, H), f32, 1.0, 4.0)),
            b_proj=w(Lk, D, H), o_norm=ones(Lk, K), o_proj=w(Lk, P, D),
            g_proj=w(Lk, D, P) if cfg.kda_full_rank_output_gate else None,
            g_a=None if cfg.kda_full_rank_output_gate else w(Lk, D, K),
            g_b=None if cfg.kda_full_rank_output_gate else w(Lk, K, P),
        )
    if (Lm := cfg.num_mla_layers):
        H, R, Nn, Nr, Vd = (cfg.mla_num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim)
        Q = cfg.q_lora_rank
        mla = MLAParams(
            kv_a=w(Lm, D, R + Nr), kv_a_norm=ones(Lm, R), kv_b=w(Lm, R, H * (Nn + Vd)), o_proj=w(Lm, H * Vd, D),
            q_a=w(Lm, D, Q) if Q else None, q_a_norm=ones(Lm, Q) if Q else None,
            q_b=w(Lm, Q, H * (Nn + Nr)) if Q else None,
            q_proj=None if Q else w(Lm, D, H * (Nn + Nr)),
            g_proj=w(Lm, D, H * Vd) if cfg.mla_output_gate else None,
        )
    if (Ld := cfg.num_dense_layers):
        I = cfg.intermediate_size
        dense = DenseParams(gate=w(Ld, D, I), up=w(Ld, D, I), down=w(Ld, I, D))
    if (Le := cfg.num_moe_layers):
        E, I, Din = cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_expert_dim
        lat = cfg.routed_expert_hidden_size is not None
        Is = cfg.shared_intermediate_size
        moe = MoEParams(
            router=w(Le, D, E, dtype=f32), router_bias=w(Le, E, std=0.05, dtype=f32),
            w1=w(Le, E, Din, I), w3=w(Le, E, Din, I), w2=w(Le, E, I, Din),
            latent_down=w(Le, D, Din) if lat else None,
            latent_norm=ones(Le, Din) if lat and cfg.latent_moe_use_norm else None,
            latent_up=w(Le, Din, D) if lat else None,
            shared=DenseParams(gate=w(Le, D, Is), up=w(Le, D, Is), down=w(Le, Is, D)) if Is else None,
        )
    if cfg.uses_attn_res:
        site = lambda *s: ResSite(proj=w(*s, D, fan_in=D), norm=ones(*s, D))
        res = AttnResParams(attn=site(L), mlp=site(L), out=site())
    V = cfg.vocab_size
    return Params(
        embed=w(V, D, std=1.0),
        lm_head=w(D, V, std=OUTPUT_STD * D**-0.5),
        final_norm=ones(D), input_norm=ones(L, D), post_norm=ones(L, D),
        kda=kda, mla=mla, dense=dense, moe=moe, attn_res=res,
    )


@partial(jax.jit, static_argnames=("cfg", "seed"))
def _init_jit(cfg: ModelConfig, seed: int) -> Params:
    return _init(cfg, seed)


def init_params(cfg: ModelConfig, seed: int = 0, shardings=None) -> Params:
    """Random parameters for `cfg`, deterministic in `seed`. `shardings` (a Params tree of shardings,
    e.g. `sharding.rules.param_shardings`) makes each device compute only its shards: same values,
    no full copy on one device, and valid with several processes."""
    if shardings is not None:
        return jax.jit(partial(_init, cfg, int(seed)), out_shardings=shardings)()
    return _init_jit(cfg, int(seed))


def param_shapes(cfg: ModelConfig) -> Params:
    """`Params` of ShapeDtypeStructs (no allocation; works for the full-size presets)."""
    return jax.eval_shape(lambda: _init(cfg, 0))
