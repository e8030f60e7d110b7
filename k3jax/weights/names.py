"""Safetensors tensor layouts: for every layer slice of every parameter, the accepted groups of
on-disk tensors ("variants") and how they map to our slice and back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from k3jax.config import ModelConfig
from k3jax.weights.mxfp4 import MXFP4_GROUP, dequantize_mxfp4, quantize_mxfp4

_SKIP_PREFIXES = ("vision_tower.", "mm_projector.")
_K3_PREFIX = "language_model."



@dataclass
class _Shape:
    """A shape check for tensors whose shape varies (A_log)."""
    desc: str
    ok: Callable[[tuple], bool]

    def __str__(self):
        return self.desc


@dataclass
class _V:
    """One accepted group of on-disk tensors for one layer slice of one parameter."""
    names: tuple[str, ...]
    shapes: tuple  # per name: tuple or _Shape
    load: Callable[[list[np.ndarray]], np.ndarray]  # disk tensors -> our slice
    save: Callable[[np.ndarray], list[np.ndarray]] | None = None  # our slice -> disk tensors
    kind: str = "pub"  # "pub" | "mxfp4" | "hf"
    dtypes: tuple | None = None  # per name: required safetensors dtype or None
    # part(read, idx) -> our slice `[idx]` reading only what it needs: `read(k, disk_idx)` reads part of
    # tensor `names[k]`. None: load the whole slice and index it.
    part: Callable | None = None

    def shape_ok(self, i: int, shape: tuple) -> bool:
        s = self.shapes[i]
        return s.ok(shape) if isinstance(s, _Shape) else tuple(s) == tuple(shape)


def _whole_part(read, ix):
    return read(0, ix)


def _mxfp4_part(read, k: int, in_sl: slice, out_sl: slice, inp: int) -> np.ndarray:
    """Our [in, out] slice of one MXFP4 expert (packed `names[k]`, scales `names[k+1]`); reads only the
    needed rows and, when `in_sl` is group aligned, only the needed packed columns."""
    s0, s1, _ = in_sl.indices(inp)
    a, b = (s0, s1) if s0 % MXFP4_GROUP == 0 and s1 % MXFP4_GROUP == 0 else (0, inp)
    w = dequantize_mxfp4(read(k, (out_sl, slice(a // 2, b // 2))),
                         read(k + 1, (out_sl, slice(a // MXFP4_GROUP, b // MXFP4_GROUP))))
    return w.T[s0 - a:s1 - a]


def _lin(name, out, inp):  # torch Linear weight [out, in] <-> ours [in, out]
    return [_V((name,), ((out, inp),), lambda a: a[0].T, lambda w: [w.T],
               part=lambda read, ix: read(0, (ix[1], ix[0])).T)]


def _vec(name, n):
    return [_V((name,), ((n,),), lambda a: a[0], lambda w: [w], part=_whole_part)]


def _row(name, n):  # [1, n] on disk (AttnRes pseudo-query) <-> [n]
    return [_V((name,), ((1, n),), lambda a: a[0].reshape(n), lambda w: [w.reshape(1, n)]),
            _V((name,), ((n,),), lambda a: a[0], kind="hf")]


def _conv(pre, P, W):
    names = tuple(f"{pre}{c}_conv1d.weight" for c in "qkv")
    return [
        _V(names, ((P, 1, W),) * 3, lambda a: np.concatenate([x[:, 0, :] for x in a], 0).T,
           lambda w: [w[:, j * P:(j + 1) * P].T[:, None, :] for j in range(3)]),
        _V(names, ((P, W),) * 3, lambda a: np.concatenate(a, 0).T, kind="hf"),
        _V((pre + "conv1d.weight",), ((3 * P, 1, W),), lambda a: a[0][:, 0, :].T, kind="hf"),
    ]


def _a_log(name, H, size, k3):
    def save(w):
        if size:
            return [np.concatenate([w, np.zeros(size - H, w.dtype)])]
        return [w] if k3 else [w.reshape(1, 1, H, 1)]

    pub = (size,) if size else ((H,) if k3 else (1, 1, H, 1))
    any_ = _Shape(f"(1, 1, {H}, 1) or (N>={H},)",
                  lambda s: tuple(s) == (1, 1, H, 1) or (len(s) == 1 and s[0] >= H))
    return [_V((name,), (pub,), lambda a: a[0].reshape(-1)[:H], save),
            _V((name,), (any_,), lambda a: a[0].reshape(-1)[:H], kind="hf")]


def _experts(pre, w, E, out, inp, fused_name, fused_load, fused_shape):
    """Routed experts `w` in {w1, w2, w3}: our [E, inp, out]; disk per expert [out, inp]."""
    names = tuple(f"{pre}experts.{e}.{w}.weight" for e in range(E))
    pub = _V(names, ((out, inp),) * E, lambda a: np.stack([x.T for x in a]), lambda s: [x.T for x in s],
             part=lambda read, ix: np.stack([read(e, (ix[2], ix[1])).T for e in range(E)[ix[0]]]))
    mx_names = tuple(f"{pre}experts.{e}.{w}.weight_{k}" for e in range(E) for k in ("packed", "scale"))
    g = max(inp // MXFP4_GROUP, 1)
    mx = _V(mx_names, ((out, inp // 2), (out, g)) * E,
            lambda a: np.stack([dequantize_mxfp4(a[2 * e], a[2 * e + 1]).T for e in range(E)]),
            lambda s: [t for x in s for t in quantize_mxfp4(x.T)], kind="mxfp4", dtypes=("U8", "U8") * E,
            part=lambda read, ix: np.stack([_mxfp4_part(read, 2 * e, ix[1], ix[2], inp) for e in range(E)[ix[0]]]))
    fused = _V((f"{pre}experts.{fused_name}",), (fused_shape,), lambda a: fused_load(a[0]), kind="hf")
    return [pub, mx, fused]


def _is_k3_layout(cfg: ModelConfig) -> bool:
    return cfg.uses_attn_res or cfg.routed_expert_hidden_size is not None


def _groups(cfg: ModelConfig) -> dict[str, list[int]]:
    kinds = {"kda": cfg.layer_kinds, "mla": cfg.layer_kinds, "dense": cfg.ffn_kinds, "moe": cfg.ffn_kinds}
    return {g: [i for i, k in enumerate(ks) if k == g] for g, ks in kinds.items()}


def _layers_of(cfg: ModelConfig, path: str, groups) -> list[int] | None:
    """Global layer indices stacked in leaf `path`; None for an unstacked leaf."""
    head = path.split(".")[0]
    if head in groups:
        return groups[head]
    if head in ("input_norm", "post_norm") or path.startswith(("attn_res.attn.", "attn_res.mlp.")):
        return list(range(cfg.num_layers))
    return None


def _variants(cfg: ModelConfig, path: str, i: int | None) -> list[_V]:
    """Accepted tensor groups for layer `i` of parameter `path` (canonical names)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    if i is None:
        if path == "embed":
            return [_V(("model.embed_tokens.weight",), ((V, D),), lambda a: a[0], lambda w: [w], part=_whole_part)]
        if path == "lm_head":
            vs = _lin("lm_head.weight", V, D)
            if cfg.tie_word_embeddings:
                vs.append(_V(("model.embed_tokens.weight",), ((V, D),), lambda a: a[0].T, kind="hf"))
            return vs
        if path == "final_norm":
            return _vec("model.norm.weight", D)
        site = path.split(".")[-1]  # attn_res.out.{proj,norm}
        return _row("model.output_attn_res_proj.weight", D) if site == "proj" else \
            _vec("model.output_attn_res_norm.weight", D)
    L = f"model.layers.{i}."
    a = L + "self_attn."
    group, leaf = path.split(".", 1) if "." in path else (path, "")
    if path == "input_norm":
        return _vec(L + "input_layernorm.weight", D)
    if path == "post_norm":
        return _vec(L + "post_attention_layernorm.weight", D)
    if group == "attn_res":
        site, kind = leaf.split(".")
        base = L + ("self_attention_res_" if site == "attn" else "mlp_res_")
        return _row(base + "proj.weight", D) if kind == "proj" else _vec(base + "norm.weight", D)
    if group == "kda":
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        P = H * K
        table = {
            "q_proj": lambda: _lin(a + "q_proj.weight", P, D),
            "k_proj": lambda: _lin(a + "k_proj.weight", P, D),
            "v_proj": lambda: _lin(a + "v_proj.weight", P, D),
            "conv": lambda: _conv(a, P, cfg.kda_conv_size),
            "f_a": lambda: _lin(a + "f_a_proj.weight", K, D),
            "f_b": lambda: _lin(a + "f_b_proj.weight", P, K),
            "dt_bias": lambda: _vec(a + "dt_bias", P) + [
                _V((a + "dt_bias",), ((H, K),), lambda x: x[0].reshape(P), kind="hf")],
            "a_log": lambda: _a_log(a + "A_log", H, cfg.kda_a_log_size, _is_k3_layout(cfg)),
            "b_proj": lambda: _lin(a + "b_proj.weight", H, D),
            "o_norm": lambda: _vec(a + "o_norm.weight", K),
            "o_proj": lambda: _lin(a + "o_proj.weight", D, P),
            "g_proj": lambda: _lin(a + "g_proj.weight", P, D),
            "g_a": lambda: _lin(a + "g_a_proj.weight", K, D),
            "g_b": lambda: _lin(a + "g_b_proj.weight", P, K),
        }
        return table[leaf]()
    if group == "mla":
        H, R, Nn, Nr, Vd, Q = (cfg.mla_num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                               cfg.v_head_dim, cfg.q_lora_rank)
        table = {
            "kv_a": lambda: _lin(a + "kv_a_proj_with_mqa.weight", R + Nr, D),
            "kv_a_norm": lambda: _vec(a + "kv_a_layernorm.weight", R),
            "kv_b": lambda: _lin(a + "kv_b_proj.weight", H * (Nn + Vd), R),
            "o_proj": lambda: _lin(a + "o_proj.weight", D, H * Vd),
            "q_a": lambda: _lin(a + "q_a_proj.weight", Q, D),
            "q_a_norm": lambda: _vec(a + "q_a_layernorm.weight", Q),
            "q_b": lambda: _lin(a + "q_b_proj.weight", H * (Nn + Nr), Q),
            "q_proj": lambda: _lin(a + "q_proj.weight", H * (Nn + Nr), D),
            "g_proj": lambda: _lin(a + "g_proj.weight", H * Vd, D),
        }
        return table[leaf]()
    m = L + "mlp."
    if group == "dense":
        I = cfg.intermediate_size
        return {"gate": lambda: _lin(m + "gate_proj.weight", I, D), "up": lambda: _lin(m + "up_proj.weight", I, D),
                "down": lambda: _lin(m + "down_proj.weight", D, I)}[leaf]()
    E, I, Din, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_expert_dim, cfg.shared_intermediate_size
    table = {
        "router": lambda: _lin(m + "gate.weight", E, D),
        "router_bias": lambda: _vec(m + "gate.e_score_correction_bias", E),
        "w1": lambda: _experts(m, "w1", E, I, Din, "gate_up_proj", lambda t: t[:, :I].transpose(0, 2, 1),
                               (E, 2 * I, Din)),
        "w3": lambda: _experts(m, "w3", E, I, Din, "gate_up_proj", lambda t: t[:, I:].transpose(0, 2, 1),
                               (E, 2 * I, Din)),
        "w2": lambda: _experts(m, "w2", E, Din, I, "down_proj", lambda t: t.transpose(0, 2, 1), (E, Din, I)),
        "latent_down": lambda: _lin(m + "routed_expert_down_proj.weight", Din, D),
        "latent_norm": lambda: _vec(m + "routed_expert_norm.weight", Din),
        "latent_up": lambda: _lin(m + "routed_expert_up_proj.weight", D, Din),
        "shared.gate": lambda: _lin(m + "shared_experts.gate_proj.weight", Is, D),
        "shared.up": lambda: _lin(m + "shared_experts.up_proj.weight", Is, D),
        "shared.down": lambda: _lin(m + "shared_experts.down_proj.weight", D, Is),
    }
    return table[leaf]()


def _canonical(name: str) -> str | None:
    """On-disk name -> canonical name; None for tensors we skip (vision)."""
    n = name[len(_K3_PREFIX):] if name.startswith(_K3_PREFIX) else name
    if n.startswith(_SKIP_PREFIXES):
        return None
    if n.startswith("layers."):
        n = "model." + n
    return n.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")


def _published(canon: str, cfg: ModelConfig, prefix: str) -> str:
    """Canonical name -> published name (MoE layers under `block_sparse_moe.`, K3 prefix)."""
    if canon.startswith("model.layers.") and ".mlp." in canon:
        i = int(canon.split(".")[2])
        if cfg.ffn_kinds[i] == "moe":
            canon = canon.replace(".mlp.", ".block_sparse_moe.", 1)
    return prefix + canon
