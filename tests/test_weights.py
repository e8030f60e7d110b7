"""Checkpoint I/O: orbax and safetensors round trips, MXFP4, name formats, errors, and logits
against HF transformers' KimiLinearForCausalLM. Tiny configs; the forward compiles twice (one
K3-style and one Kimi-Linear-style config), every other check compares arrays."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from k3jax import weights as W
from k3jax.api import Model, load_model
from k3jax.config import preset, to_hf_dict
from k3jax.model.forward import is_split
from k3jax.model.init import param_shapes

T_IDS = (np.arange(40) * 37 + 11) % 200 + 3  # one fixed length -> one compile per config

KIMI_TINY = preset("kimi-linear-48b").replace(
    name="kimi-tiny", vocab_size=256, hidden_size=64, num_layers=4, dtype="float32",
    bos_token_id=1, eos_token_id=2, pad_token_id=0, full_attn_layers=(4,),
    kda_num_heads=4, kda_head_dim=16, mla_num_heads=4, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96, num_experts=8, num_experts_per_token=2,
    moe_intermediate_size=32,
)
K3_TINY = preset("k3-tiny")


def random_params(cfg, seed=0):
    """Seeded random Params in numpy (no jit): projections ~ fan_in^-0.5, norms near 1."""
    rng = np.random.default_rng(seed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))
    leaves = []
    for path, s in flat:
        name = ".".join(k.name for k in path)
        last = name.split(".")[-1]
        n = rng.standard_normal(s.shape)
        if name == "embed":
            a = n
        elif name == "lm_head":
            a = n * 4 * s.shape[0] ** -0.5
        elif last == "a_log":
            a = np.log(rng.uniform(1, 4, s.shape))
        elif last == "dt_bias":
            a = np.log(np.expm1(rng.uniform(1e-3, 0.1, s.shape)))
        elif last == "router_bias":
            a = 0.05 * n
        elif last == "conv":
            a = 0.5 * n
        elif name.startswith("attn_res") and last == "proj":
            a = n * s.shape[-1] ** -0.5
        elif "norm" in last:
            a = 1 + 0.1 * n
        else:
            a = n * s.shape[-2] ** -0.5
        leaves.append(jnp.asarray(a.astype(s.dtype)))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def assert_params_equal(a, b):
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def disk_names(d):
    with safe_open(os.path.join(d, "model.safetensors"), "numpy") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    params = random_params(K3_TINY, 1)
    d = tmp_path_factory.mktemp("k3") / "ckpt"
    W.save_safetensors(params, K3_TINY, d, progress=False)
    return params, str(d)


@pytest.fixture(scope="module")
def kimi():
    return random_params(KIMI_TINY, 2)


def test_orbax_roundtrip(k3, tmp_path):
    params, _ = k3
    W.save_orbax(params, K3_TINY, tmp_path / "o")
    cfg, got = W.load_checkpoint(tmp_path / "o")
    assert cfg == K3_TINY and cfg.name == "k3-tiny" and cfg.full_attn_layers == (3, 6)
    assert_params_equal(params, got)
    # load_model gives the per-layer layout; the writers take it and store the stacked one
    model = load_model(str(tmp_path / "o"))
    assert is_split(model.params)
    W.save_orbax(model.params, K3_TINY, tmp_path / "o2")
    assert_params_equal(params, W.load_checkpoint(tmp_path / "o2")[1])


def test_safetensors_roundtrip_k3(k3, tmp_path):
    params, d = k3
    names = disk_names(d)
    assert all(n.startswith("language_model.") for n in names)
    assert names["language_model.model.layers.0.self_attn.q_conv1d.weight"] == ((128, 1, 4), "F32")
    assert names["language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight"] == ((128, 128), "F32")
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names
    assert names["language_model.model.output_attn_res_proj.weight"][0] == (1, 256)
    cfg, got = W.load_checkpoint(d)
    assert cfg == K3_TINY.replace(name="ckpt")
    assert_params_equal(params, got)
    W.save_safetensors(params, K3_TINY, tmp_path / "sh", max_shard_bytes=1 << 20, progress=False)
    index = json.loads((tmp_path / "sh" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "sh" / "model.safetensors").exists()
    _, got_sh = W.load_checkpoint(tmp_path / "sh")
    assert_params_equal(params, got_sh)
    ref = Model(K3_TINY, params, None).logits(T_IDS)
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(ref, Model(K3_TINY, got_sh, None).logits(T_IDS))


def test_safetensors_roundtrip_kimi(kimi, tmp_path):
    W.save_safetensors(kimi, KIMI_TINY, tmp_path, progress=False)
    names = disk_names(tmp_path)
    assert names["model.layers.0.self_attn.A_log"][0] == (1, 1, 4, 1)
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in names
    assert "model.layers.3.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    cfg, got = W.load_checkpoint(tmp_path)
    assert cfg == KIMI_TINY.replace(name=tmp_path.name)
    assert_params_equal(kimi, got)
    ref = Model(KIMI_TINY, kimi, None).logits(T_IDS)
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(ref, Model(KIMI_TINY, got, None).logits(T_IDS))


def test_dtype_override_and_bf16(k3, tmp_path):
    params, d = k3
    cfg, p16 = W.load_checkpoint(d, dtype="bfloat16")
    assert cfg.dtype == "bfloat16"
    f32 = {"kda.conv", "kda.dt_bias", "kda.a_log", "moe.router", "moe.router_bias"}
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(p16)[0], jax.tree_util.tree_leaves(params)):
        key = ".".join(k.name for k in path)
        want = jnp.float32 if key in f32 else jnp.bfloat16
        assert a.dtype == want, key
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(want), err_msg=key)
    W.save_safetensors(p16, cfg, tmp_path, progress=False)
    names = disk_names(tmp_path)
    assert names["language_model.model.layers.0.self_attn.q_proj.weight"][1] == "BF16"
    assert names["language_model.model.layers.0.self_attn.A_log"][1] == "F32"
    cfg2, back = W.load_checkpoint(tmp_path)
    assert cfg2.dtype == "bfloat16"
    assert_params_equal(p16, back)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def naive_mxfp4_decode(packed, scale):
    out, half = packed.shape
    w = np.zeros((out, 2 * half), np.float64)
    for r in range(out):
        for c in range(2 * half):
            byte = int(packed[r, c // 2])
            nib = byte & 0xF if c % 2 == 0 else byte >> 4
            v = E2M1[nib & 7] * (-1.0 if nib & 8 else 1.0)
            w[r, c] = v * 2.0 ** (int(scale[r, c // 32]) - 127)
    return w


def test_mxfp4_codec():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 96)).astype(np.float32) * np.array([1e-3, 0.1, 1, 10, 1e3, 1])[:, None]
    w[5, :32] = 0.0  # an all-zero group
    w[5, 32:64] = np.array(E2M1 * 4) * np.repeat([1, -1], 16) * 0.25  # exactly representable
    w[5, 64:70] = [0.25, 0.75, 1.25, 1.75, 2.5, 6.0]  # ties round to the even code: 0, 1, 1, 2, 2, 6
    packed, scale = W.quantize_mxfp4(w)
    assert packed.dtype == np.uint8 and packed.shape == (6, 48) and scale.shape == (6, 3)
    deq = W.dequantize_mxfp4(packed, scale)
    np.testing.assert_array_equal(deq, naive_mxfp4_decode(packed, scale).astype(np.float32))
    np.testing.assert_array_equal(deq[5, :64], w[5, :64])
    np.testing.assert_array_equal(deq[5, 64:70], [0.0, 1.0, 1.0, 2.0, 2.0, 6.0])
    # error at most half the widest E2M1 step (1.0 between 4 and 6) at each group's scale
    step = np.ldexp(1.0, scale.astype(int) - 127).repeat(32, axis=1)
    assert (np.abs(deq - w) <= step + 1e-30).all()
    assert (np.abs(w).reshape(6, 3, 32).max(-1) <= 6 * step[:, ::32]).all()


def test_mxfp4_checkpoint(k3, tmp_path):
    params, _ = k3
    W.save_safetensors(params, K3_TINY, tmp_path, mxfp4_experts=True, progress=False)
    names = disk_names(tmp_path)
    pre = "language_model.model.layers.2.block_sparse_moe.experts.3."
    assert names[pre + "w1.weight_packed"] == ((128, 64), "U8")
    assert names[pre + "w2.weight_scale"] == ((128, 4), "U8")
    assert pre + "w1.weight" not in names
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["format"] == "mxfp4-pack-quantized"
    _, got = W.load_checkpoint(tmp_path)
    for leaf in ("w1", "w2", "w3"):
        w = np.asarray(getattr(params.moe, leaf))  # [L, E, in, out]
        want = np.stack([np.stack([W.dequantize_mxfp4(*W.quantize_mxfp4(w[l, e].T)).T for e in range(w.shape[1])])
                         for l in range(w.shape[0])])
        np.testing.assert_array_equal(np.asarray(getattr(got.moe, leaf)), want)
    drop = lambda p: dataclasses.replace(p, moe=dataclasses.replace(p.moe, w1=None, w2=None, w3=None))
    assert_params_equal(drop(params), drop(got))  # everything else is stored exactly


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    t = load_file(os.path.join(dst, "model.safetensors"))
    edit(t)
    save_file(t, os.path.join(dst, "model.safetensors"))
    return dst


def test_k3_aliases_and_vision_skip(k3, tmp_path):
    params, d = k3

    def edit(t):
        for k in list(t):
            if k.startswith("language_model.model.layers."):
                t[k.replace("language_model.model.layers.", "language_model.layers.")] = t.pop(k)
        for k in [k for k in t if k.endswith("A_log")]:
            t[k] = np.concatenate([t[k], np.zeros(4, np.float32)])  # K3's zero padding
        t["vision_tower.patch_embed.weight"] = np.ones((3, 3), np.float32)
        t["mm_projector.proj.weight"] = np.ones((2,), np.float32)

    cfg, got = W.load_checkpoint(_rewrite(d, tmp_path / "a", edit))
    assert cfg.kda_a_log_size == 8
    assert_params_equal(params, got)


@pytest.mark.parametrize("case", ["missing", "unexpected", "misshaped"])
def test_errors_name_the_tensor(k3, tmp_path, case):
    _, d = k3
    q = "language_model.model.layers.1.self_attn.k_proj.weight"
    edits = {
        "missing": lambda t: t.pop(q),
        "unexpected": lambda t: t.__setitem__("language_model.model.layers.1.self_attn.extra.weight",
                                              np.zeros((2, 2), np.float32)),
        "misshaped": lambda t: t.__setitem__(q, np.zeros((64, 256), np.float32)),
    }
    name = "language_model.model.layers.1.self_attn.extra.weight" if case == "unexpected" else q
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as e:
        W.load_checkpoint(_rewrite(d, tmp_path / case, edits[case]))
    assert case.replace("misshaped", "mis-shaped") in str(e.value)
    if case == "misshaped":
        assert "[128, 256]" in str(e.value) and "[64, 256]" in str(e.value)


def test_no_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path.name)):
        W.load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(KIMI_TINY)))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        W.load_checkpoint(tmp_path)


def test_transformers_kimi_linear_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file as torch_save_file

    hf_cfg = transformers.KimiLinearConfig(
        vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, tie_word_embeddings=False,
        initializer_range=0.125, dtype="float32",
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
    )
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF init leaves norms at 1 and the selection bias at 0: make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
        hf_logits = model(torch.tensor([T_IDS.tolist()]), use_cache=False).logits[0].float().numpy()
    model.save_pretrained(tmp_path / "hf")
    names = disk_names(tmp_path / "hf")
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names  # HF's dense-layer naming
    cfg, params = W.load_checkpoint(tmp_path / "hf")
    assert cfg == KIMI_TINY.replace(name="hf")
    ours = Model(KIMI_TINY, params, None).logits(T_IDS)
    rel = np.abs(ours - hf_logits).max() / np.abs(hf_logits).max()
    assert rel < 1e-4, rel

    # HF's in-memory module names (forget_gate.*, fused conv1d, fused experts) load the same weights
    mem = tmp_path / "mem"
    mem.mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", mem / "config.json")
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd and "model.layers.0.self_attn.conv1d.weight" in sd
    torch_save_file(sd, str(mem / "model.safetensors"))
    _, params_mem = W.load_checkpoint(mem)
    assert_params_equal(params, params_mem)
