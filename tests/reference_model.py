"""An independent float64 numpy forward of the whole model for one sequence, written straight from
DESIGN.md section 1 and K3-SPEC.md: naive causal conv, token-by-token KDA, non-absorbed MLA with a
dense causal softmax, MoE computing every selected expert on its own, AttnRes as the spec's loop.
It reads our `Params` layout but shares no math with `k3jax.model`."""

from __future__ import annotations

import jax
import numpy as np


def _np(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


def rms(x, w, eps):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


sigmoid = lambda x: 1 / (1 + np.exp(-x))
silu = lambda x: x * sigmoid(x)
softplus = lambda x: np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0)


def act(cfg, gate, up):
    if cfg.hidden_act == "silu":
        return silu(gate) * up
    b, bl = cfg.situ_beta, cfg.situ_linear_beta
    return b * np.tanh(gate / b) * sigmoid(gate) * bl * np.tanh(up / bl)


def sl(tree, i):
    return jax.tree_util.tree_map(lambda a: a[i], tree)


def kda(cfg, p, x):
    T = x.shape[0]
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    W = cfg.kda_conv_size
    pre = np.concatenate([x @ p.q_proj, x @ p.k_proj, x @ p.v_proj], -1)  # [T, C]
    padded = np.concatenate([np.zeros((W - 1, pre.shape[1])), pre])
    conv = np.stack([sum(p.conv[w] * padded[t + w] for w in range(W)) for t in range(T)])
    qkv = silu(conv).reshape(T, 3, H, K)
    l2 = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)
    q, k, v = l2(qkv[:, 0]), l2(qkv[:, 1]), qkv[:, 2]
    f = (x @ p.f_a @ p.f_b + p.dt_bias).reshape(T, H, K)
    A = np.exp(p.a_log)[:, None]
    g = cfg.kda_gate_lower_bound * sigmoid(A * f) if cfg.kda_gate == "safe" else -A * softplus(f)
    beta = sigmoid(x @ p.b_proj)
    S = np.zeros((H, K, K))
    o = np.zeros((T, H, K))
    for t in range(T):
        for h in range(H):
            S[h] = np.exp(g[t, h])[:, None] * S[h]
            S[h] = S[h] + beta[t, h] * np.outer(k[t, h], v[t, h] - S[h].T @ k[t, h])
            o[t, h] = S[h].T @ (K**-0.5 * q[t, h])
    gate = x @ p.g_proj if p.g_proj is not None else x @ p.g_a @ p.g_b
    o = rms(o, p.o_norm, cfg.rms_norm_eps) * sigmoid(gate.reshape(T, H, K))
    return o.reshape(T, H * K) @ p.o_proj


def mla(cfg, p, x):
    T = x.shape[0]
    H, Nn, Nr, Vd, R = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if p.q_a is not None:
        q = rms(x @ p.q_a, p.q_a_norm, cfg.mla_norm_eps) @ p.q_b
    else:
        q = x @ p.q_proj
    q = q.reshape(T, H, Nn + Nr)
    ckv = x @ p.kv_a
    c = rms(ckv[:, :R], p.kv_a_norm, cfg.mla_norm_eps)
    k_pe = ckv[:, R:]
    kv = (c @ p.kv_b).reshape(T, H, Nn + Vd)
    k_nope, v = kv[..., :Nn], kv[..., Nn:]
    s = (np.einsum("thn,shn->hts", q[..., :Nn], k_nope) + np.einsum("thr,sr->hts", q[..., Nn:], k_pe))
    s = s * (Nn + Nr) ** -0.5 + np.where(np.tril(np.ones((T, T))) > 0, 0.0, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a = a / a.sum(-1, keepdims=True)
    o = np.einsum("hts,shv->thv", a, v).reshape(T, H * Vd)
    if p.g_proj is not None:
        o = o * sigmoid(x @ p.g_proj)
    return o @ p.o_proj


def moe(cfg, p, x):
    T = x.shape[0]
    scores = sigmoid(x @ p.router)
    choice = scores + p.router_bias
    k = cfg.num_experts_per_token
    z = x @ p.latent_down if p.latent_down is not None else x
    y = np.zeros((T, z.shape[1]))
    for t in range(T):
        idx = np.argsort(-choice[t])[:k]
        w = scores[t, idx]
        if cfg.moe_renormalize and k > 1:
            w = w / (w.sum() + 1e-20)
        w = w * cfg.routed_scaling_factor
        for e, we in zip(idx, w):
            y[t] += we * (act(cfg, z[t] @ p.w1[e], z[t] @ p.w3[e]) @ p.w2[e])
    if p.latent_up is not None:
        if p.latent_norm is not None:
            y = rms(y, p.latent_norm, cfg.rms_norm_eps)
        y = y @ p.latent_up
    if p.shared is not None:
        y = y + act(cfg, x @ p.shared.gate, x @ p.shared.up) @ p.shared.down
    return y


def reference_logits(params, cfg, ids) -> np.ndarray:
    P = _np(params)
    eps = cfg.rms_norm_eps
    x = P.embed[np.asarray(ids)]

    def attn(i, h):
        j = cfg.kind_index[i]
        return kda(cfg, sl(P.kda, j), h) if cfg.layer_kinds[i] == "kda" else mla(cfg, sl(P.mla, j), h)

    def ffn(i, h):
        j = cfg.ffn_index[i]
        if cfg.ffn_kinds[i] == "moe":
            return moe(cfg, sl(P.moe, j), h)
        d = sl(P.dense, j)
        return act(cfg, h @ d.gate, h @ d.up) @ d.down

    def mix(bank, part, proj, norm):
        if not bank:
            return part
        V = np.stack(bank + [part])
        logit = np.einsum("std,d->st", rms(V, None, eps), proj * norm)
        a = np.exp(logit - logit.max(0))
        a = a / a.sum(0)
        return np.einsum("st,std->td", a, V)

    B = cfg.attn_res_block_size
    if not B:
        for i in range(cfg.num_layers):
            x = x + attn(i, rms(x, P.input_norm[i], eps))
            x = x + ffn(i, rms(x, P.post_norm[i], eps))
        out = x
    else:
        ar = P.attn_res
        bank, part = [], x
        for i in range(cfg.num_layers):
            h = mix(bank, part, ar.attn.proj[i], ar.attn.norm[i])
            if i % B == 0:
                bank.append(part)
                part = None
            a = attn(i, rms(h, P.input_norm[i], eps))
            part = a if part is None else part + a
            h = mix(bank, part, ar.mlp.proj[i], ar.mlp.norm[i])
            part = part + ffn(i, rms(h, P.post_norm[i], eps))
        out = mix(bank, part, ar.out.proj, ar.out.norm)
    return rms(out, P.final_norm, eps) @ P.lm_head
