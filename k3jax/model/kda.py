"""KDA layer: projections -> causal depthwise conv (width W, SiLU, carried state) -> L2 norm ->
gated delta rule core -> per-head RMSNorm x sigmoid(output gate) -> o_proj.

Runs over the ragged packed tokens of one step (`StepContext`): the decode segment (one token per
sequence) goes through `kda_decode`, the prefill segment through varlen `kda_chunk`; both read the
recurrent pool by slot and write it back.

Sharded by heads (`shard`, a `sharding.step.MeshContext`, None on one device): the kernel calls run
per shard, and the conv channels (conv state and conv inputs) are kept in `groups` per-shard blocks
`[q_r | k_r | v_r]` (`group_channels`), so a head shard owns one contiguous block of the conv state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.model.common import proj, rms_norm, rowwise
from k3jax.model.context import StepContext
from k3jax.state import RecurrentPool
from pallas_kernels import kda as kda_kernels
from pallas_kernels.kda import spec as kda_spec
from pallas_kernels.kda.ref import Gate, kda_gate_ref, l2norm


# The prefill segment's L2 norm of q, k and its gate computed inside the chunk kernel
# (`kda_chunk_pool` / `kda_chunk(..., gate=, qk_l2norm=True)`: the Mosaic GPU prep kernel reads the raw
# conv outputs and the bf16 gate logits, so normalised q, k and the f32 g of every prefill token are
# never written), on one device, with the unified pool and per head shard on a mesh; decode and verify
# tokens always take them from XLA. Off until measured on the H200 (bench/NOTES.md, session 13): read
# at trace time.
PREFILL_FUSED_INPUTS = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KDAParams:  # stacked over KDA layers (leading dim L)
    q_proj: jax.Array  # [L, D, H*K]
    k_proj: jax.Array  # [L, D, H*K]
    v_proj: jax.Array  # [L, D, H*V]
    conv: jax.Array  # f32[L, W, 3*H*K] depthwise taps over q|k|v channels, oldest tap first
    f_a: jax.Array  # [L, D, K] forget gate, low rank
    f_b: jax.Array  # [L, K, H*K]
    dt_bias: jax.Array  # f32[L, H*K]
    a_log: jax.Array  # f32[L, H]
    b_proj: jax.Array  # [L, D, H] beta logits
    o_norm: jax.Array  # [L, V]
    o_proj: jax.Array  # [L, H*V, D]
    g_proj: jax.Array | None = None  # [L, D, H*V] full-rank output gate (K3)
    g_a: jax.Array | None = None  # [L, D, K] low-rank output gate (Kimi-Linear)
    g_b: jax.Array | None = None  # [L, K, H*V]


def kda_gate(f: jax.Array, p: KDAParams, cfg: ModelConfig) -> jax.Array:
    """Log decay g [T, H, K] (f32, <= 0) from the forget-gate logits f [T, H*K]."""
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    return kda_gate_ref(f.reshape(-1, H, K), gate_params(p, cfg))


def gate_params(p: KDAParams, cfg: ModelConfig) -> Gate:
    """This layer's forget gate as the kernels take it (`pallas_kernels.kda.ref.Gate`)."""
    return Gate(p.a_log, p.dt_bias, cfg.kda_gate_lower_bound if cfg.kda_gate == "safe" else None)


def group_channels(x: jax.Array, groups: int, H: int, K: int) -> jax.Array:
    """[..., 3*H*K] channels in q|k|v order -> `groups` blocks [q_r | k_r | v_r] of H/groups heads each."""
    if groups == 1:
        return x
    lead = x.shape[:-1]
    y = x.reshape(*lead, 3, groups, H * K // groups)
    return jnp.swapaxes(y, -3, -2).reshape(*lead, 3 * H * K)


def ungroup_channels(x: jax.Array, groups: int, H: int, K: int) -> jax.Array:
    """Inverse of `group_channels`."""
    if groups == 1:
        return x
    lead = x.shape[:-1]
    y = x.reshape(*lead, groups, 3, H * K // groups)
    return jnp.swapaxes(y, -3, -2).reshape(*lead, 3 * H * K)


def short_conv(x: jax.Array, w: jax.Array, init: jax.Array, ctx: StepContext):
    """Causal depthwise conv over each sequence's new tokens, continuing from its carried inputs.

    x [T, C] pre-conv inputs; w f32[W, C]; init [N, W-1, C] carried inputs (already zeroed for
    fresh sequences). Returns (SiLU(conv) [T, C] in x's dtype, new carried inputs [N, W-1, C]).
    """
    src = jnp.concatenate([x, init.reshape(-1, x.shape[-1]).astype(x.dtype)], axis=0)
    win = src[ctx.conv_idx].astype(jnp.float32)  # [T, W, C]
    y = rowwise(lambda win: jax.nn.silu(jnp.einsum("twc,wc->tc", win, w.astype(jnp.float32))), win)
    return y.astype(x.dtype), src[ctx.conv_state_idx]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyCapture:
    """What a verify step records per KDA layer for the fold (ReplaySSM): the recurrence inputs of
    every block step (k, v in the activation dtype, exact; g, beta in f32) and the block's pre-conv
    inputs (in the pool's conv channel layout). `pallas_kernels.kda.spec.replay_step_bytes` is its
    size per step and head."""

    core: kda_spec.Capture  # k, v, g, beta [D, B, H, ...]
    conv_x: jax.Array  # [D, B, C]


def kda_layer(p: KDAParams, x: jax.Array, ctx: StepContext, pool: RecurrentPool, layer: int, cfg: ModelConfig,
              impl: str = "xla", shard=None, captures: list | None = None):
    """x [T, D] (after input norm) -> (y [T, D], pool). `p` holds this layer's slice.

    In a verify step (`ctx.block` > 1) the decode segment holds blocks of block tokens per sequence:
    they read the committed recurrent and conv state and never write it; their `VerifyCapture` is
    appended to `captures` for the fold (`k3jax.spec.step`)."""
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    T = x.shape[0]
    G = shard.groups("kda_heads") if shard is not None else 1
    with jax.named_scope("kda_proj"):
        if G == 1:
            qkv = jnp.concatenate([proj(x, p.q_proj), proj(x, p.k_proj), proj(x, p.v_proj)], axis=-1)
        else:  # stack, then regroup: each head shard keeps its own q, k, v columns (no communication)
            qkv = jnp.stack([proj(x, p.q_proj), proj(x, p.k_proj), proj(x, p.v_proj)], axis=1)  # [T, 3, H*K]
            qkv = shard.constrain(qkv, (None, None, "kda_heads"))
            qkv = jnp.swapaxes(qkv.reshape(T, 3, G, H * K // G), 1, 2).reshape(T, 3 * H * K)
            qkv = shard.constrain(qkv, (None, "kda_heads"))
        fresh = ctx.seq_fresh
        nd, B, ndt = ctx.num_decode, ctx.block, ctx.decode_tokens
        conv_init = jnp.where(fresh[:, None, None], 0, pool.read_conv(ctx.seq_slot, layer))
        conv_x = qkv[:ndt]
        qkv, conv_new = short_conv(qkv, group_channels(p.conv, G, H, K), conv_init, ctx)
        if B == 1:
            pool = pool.write_conv(ctx.seq_slot, layer, conv_new)
        elif ctx.seq_slot.shape[0] > nd:  # verify blocks leave their conv state to the fold
            pool = pool.write_conv(ctx.seq_slot[nd:], layer, conv_new[nd:])
        q, k, v = jnp.split(ungroup_channels(qkv, G, H, K).reshape(T, 3, H, K), 3, axis=1)
        if G > 1:
            q, k, v = (shard.constrain(a, (None, None, "kda_heads", None)) for a in (q, k, v))
        q_raw, k_raw, v = q[:, 0], k[:, 0], v[:, 0]
        f = proj(proj(x, p.f_a), p.f_b)
        # the prefill segment's L2 norm and gate in the chunk kernel (`PREFILL_FUSED_INPUTS`): XLA
        # computes them for the decode / verify tokens only
        fused = PREFILL_FUSED_INPUTS and T > ndt
        nx = ndt if fused else T
        # k in the activation dtype for every kernel: a verify capture stores it so, and the fold
        # replays exactly the values verify used
        with jax.named_scope("qk_norm"):  # own scopes: the profile shows what fusing them into the kernels would save
            q, k = rowwise(l2norm, q_raw[:nx]), rowwise(l2norm, k_raw[:nx]).astype(x.dtype)
        with jax.named_scope("gate"):
            g = kda_gate(f[:nx], p, cfg)  # [nx, H, K]
        beta = jax.nn.sigmoid(proj(x, p.b_proj).astype(jnp.float32))  # [T, H]

    outs = []
    decode = lambda q, k, v, g, beta, ssm, slots, reset: kda_kernels.kda_decode(
        q, k, v, g, beta, ssm, slots, layer=layer, reset=reset, impl=impl)
    # the prefill segment's chunk inputs: normalised q, k and the log decay, or (fused) the raw q, k and
    # the gate logits with the gate's parameters (a_log [H], dt_bias [H, K]: arrays, so a mesh shards them)
    pre = (q_raw, k_raw, v, f.reshape(T, H, K), beta) if fused else (q, k, v, g, beta)
    gp = (p.a_log, p.dt_bias.reshape(H, K)) if fused else ()
    gate = gate_params(p, cfg) if fused else None

    def chunk(q, k, v, g, beta, s0, cu, *gp):  # gp: the shard's rows of the gate's parameters
        gate_s = Gate(gp[0], gp[1], gate.lower_bound) if gp else None
        return kda_kernels.kda_chunk(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, impl=impl, gate=gate_s,
                                     qk_l2norm=bool(gp))

    if shard is not None:  # each head shard runs the kernel on its heads and its part of the pool
        th, bth = (None, "kda_heads", None), (None, None, "kda_heads", None)
        pool_axes = ("slots", None, "kda_heads", None, None)
        decode = shard.kernel(decode, (th, th, th, th, (None, "kda_heads"), pool_axes, (None,), (None,)),
                              (th, pool_axes))
        gp_axes = (("kda_heads",), ("kda_heads", None)) if fused else ()
        chunk = shard.kernel(chunk, (bth, bth, bth, bth, (None, None, "kda_heads"), (None, "kda_heads", None, None),
                                     (None,), *gp_axes), (bth, (None, "kda_heads", None, None)))
    with jax.named_scope("kda_core"):
        if nd and B > 1:  # verify: from the committed state, read only; capture for the fold
            blk = lambda a: a[:ndt].reshape(nd, B, *a.shape[1:])
            s0 = jnp.where(fresh[:nd, None, None, None], 0.0, pool.read_ssm(ctx.seq_slot[:nd], layer))
            # the Pallas verify kernel on one device; under a mesh the jnp scan (partitioned by heads)
            o_d, cap = kda_spec.kda_verify(blk(q), blk(k), blk(v), blk(g), blk(beta), s0,
                                           impl=impl if shard is None else "xla")
            outs.append(o_d.reshape(ndt, *o_d.shape[2:]))
            narrow = kda_spec.Capture(k=cap.k.astype(x.dtype), v=cap.v.astype(x.dtype), g=cap.g, beta=cap.beta)
            captures.append(VerifyCapture(core=narrow, conv_x=blk(conv_x)))
        elif nd and pool.in_place:  # the kernel reads and writes the pool by slot in place
            o_d, ssm = decode(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], pool.ssm, ctx.seq_slot[:nd], fresh[:nd])
            pool = dataclasses.replace(pool, ssm=ssm)
            outs.append(o_d)
        elif nd:  # unified memory: gather the states, run the kernel on them, scatter back
            slots_d = ctx.seq_slot[:nd]
            compact = pool.read_ssm(slots_d, layer)[:, None]
            o_d, compact = kda_kernels.kda_decode(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], compact,
                                                  jnp.arange(nd), layer=0, reset=fresh[:nd], impl=impl)
            pool = pool.write_ssm(slots_d, layer, compact[:, 0])
            outs.append(o_d)
        if T > ndt:
            slots_p = ctx.seq_slot[nd:]
            seg = lambda a: a[None, ndt:]
            if shard is None and pool.in_place:  # the kernel reads and writes the states by slot
                o_p, ssm = kda_kernels.kda_chunk_pool(
                    *map(seg, pre), pool.ssm, slots_p, layer=layer, cu_seqlens=ctx.prefill_cu, reset=fresh[nd:],
                    impl=impl, gate=gate, qk_l2norm=fused)
                pool = dataclasses.replace(pool, ssm=ssm)
            else:  # unified memory or a mesh: gather the states, run the kernel on them, scatter back
                s0 = jnp.where(fresh[nd:, None, None, None], 0.0, pool.read_ssm(slots_p, layer))
                o_p, s_f = chunk(*map(seg, pre), s0, ctx.prefill_cu, *gp)
                pool = pool.write_ssm(slots_p, layer, s_f)
            outs.append(o_p[0])
        o = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]  # [T, H, V] f32

    with jax.named_scope("kda_out"):
        gate = proj(x, p.g_proj) if p.g_proj is not None else proj(proj(x, p.g_a), p.g_b)
        o = rms_norm(o, p.o_norm, cfg.rms_norm_eps) * jax.nn.sigmoid(gate.astype(jnp.float32).reshape(T, H, K))
        y = proj(o.reshape(T, H * K).astype(x.dtype), p.o_proj)
    return y, pool
