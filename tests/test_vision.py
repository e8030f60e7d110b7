"""The MoonViT3d vision tower + projector (`k3jax.model.vision`) and its checkpoint names: against HF
transformers' Kimi_K25VisionModel + Kimi_K25MultimodalProjection on weights that went through our
safetensors writer, packing invariance, torch's bicubic, preprocessing, and checkpoint round trips.
The tower compiles three times (one packed set of grids, then its two halves); k3-tiny's vision config."""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from k3jax import weights as W
from k3jax.config import preset
from k3jax.model import vision as V
from k3jax.model.init import param_shapes
from tests.test_weights import assert_params_equal

CFG = preset("k3-tiny")
VC = CFG.vision
P = VC.patch_size
# an image at the position table's size (no resize), one that needs the bicubic resize, a 2-frame video chunk
GRIDS = ((1, 8, 8), (1, 6, 10), (2, 4, 6))


def zero_text_params(cfg):
    return jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), param_shapes(cfg))




@pytest.fixture(scope="module")
def vparams():
    return V.init_vision_params(VC, jax.random.key(0), "float32")


@pytest.fixture(scope="module")
def patches():
    n = sum(t * h * w for t, h, w in GRIDS)
    return np.random.default_rng(0).uniform(-1, 1, (n, 3 * P * P)).astype(np.float32)


@pytest.fixture(scope="module")
def ours(vparams, patches):
    out = np.asarray(V.encode(vparams, VC, patches, GRIDS))
    assert out.shape == (sum(V.num_image_tokens(g, VC) for g in GRIDS), VC.text_hidden_size)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    return out


@pytest.fixture(scope="module")
def ckpt(vparams, tmp_path_factory):
    d = tmp_path_factory.mktemp("vision") / "ckpt"
    W.save_safetensors(zero_text_params(CFG), CFG, d, vision_params=vparams, progress=False)
    return str(d)


def disk_tensors(d, prefixes=("vision_tower.", "mm_projector.")):
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefixes)}


# ---- against HF transformers --------------------------------------------------------------

def hf_state_dicts(tensors: dict, full_cfg):
    """The original checkpoint names -> state dicts of HF's tower and projector modules, following
    the "kimi_k25" entry of transformers' conversion_mapping.py (renames; wqkv chunked into q/k/v
    with q and k permuted from interleaved rotary pairs to rotate-half by its PermuteForRope)."""
    import torch
    from transformers.core_model_loading import PermuteForRope

    perm = PermuteForRope(subconfig_key="vision_config", permute_layer_names=["q_proj", "k_proj"])
    block_renames = {"norm0.": "norm1.", "norm1.": "norm2.", "mlp.fc0.": "mlp.fc1.", "mlp.fc1.": "mlp.fc2.",
                     "wo.": "attn.proj."}
    tower, proj = {}, {}
    for name, a in tensors.items():
        if name.startswith("mm_projector."):
            n = name[len("mm_projector."):].replace("proj.0.", "in_proj.").replace("proj.2.", "out_proj.")
            proj[n] = a
            continue
        n = name[len("vision_tower."):]
        m = re.fullmatch(r"encoder\.blocks\.(\d+)\.(.*)", n)
        if m is None:
            n = n.replace("encoder.final_layernorm.", "final_layernorm.")
            tower[n.replace("pos_emb.weight", "pos_emb.position_embeddings")] = a
            continue
        i, rest = m.groups()
        if rest.startswith("wqkv."):
            kind = rest.split(".")[1]
            for x, part in zip("qkv", torch.chunk(a, 3, dim=0)):
                if x != "v":
                    part = perm._permute_for_rope(part, full_cfg)
                tower[f"layers.{i}.attn.{x}_proj.{kind}"] = part.contiguous()
            continue
        for old, new in block_renames.items():
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        tower[f"layers.{i}.{rest}"] = a
    return tower, proj


def test_tower_and_projector_match_transformers(ckpt, ours, patches):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.kimi_k25 import modeling_kimi_k25 as M
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig

    hv = Kimi_K25VisionConfig(
        patch_size=P, pos_emb_height=VC.init_pos_emb_height, pos_emb_width=VC.init_pos_emb_width,
        pos_emb_time=VC.init_pos_emb_time, num_attention_heads=VC.num_attention_heads,
        num_hidden_layers=VC.num_hidden_layers, hidden_size=VC.hidden_size, intermediate_size=VC.intermediate_size,
        merge_kernel_size=list(VC.merge_kernel_size))
    full = Kimi_K25Config(vision_config=hv, text_config={"model_type": "deepseek_v3", "hidden_size": VC.text_hidden_size},
                          projection_hidden_size=VC.hidden_size, projection_layer_norm_eps=VC.projector_ln_eps)
    full.vision_config._attn_implementation = "eager"
    tower = M.Kimi_K25VisionModel(full.vision_config).eval()
    proj = M.Kimi_K25MultimodalProjection(full).eval()

    tensors = disk_tensors(ckpt)
    assert tensors["vision_tower.patch_embed.proj.weight"].shape == (VC.hidden_size, 3, P, P)
    assert tensors["vision_tower.encoder.blocks.1.wqkv.weight"].shape == (3 * VC.hidden_size, VC.hidden_size)
    assert tensors["mm_projector.proj.2.weight"].shape == (VC.text_hidden_size, 4 * VC.hidden_size)
    assert len(tensors) == len(W.vision_tensors(VC)) == 11 + 12 * VC.num_hidden_layers
    tsd, psd = hf_state_dicts(tensors, full)
    tower.load_state_dict(tsd, strict=True)  # every HF parameter covered, nothing left over
    proj.load_state_dict(psd, strict=True)

    with torch.no_grad():
        pooled = tower(torch.from_numpy(patches.reshape(-1, 3, P, P).copy()), torch.tensor(GRIDS)).pooler_output
        ref = proj(pooled).squeeze(1).numpy()
    # the checkpoint's weights, read back by our loader, give the same rows (same compile as `ours`)
    got = np.asarray(V.encode(W.load_vision(ckpt, CFG), VC, patches, GRIDS))
    np.testing.assert_array_equal(got, ours)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    print(f"max abs error vs transformers {np.abs(ours - ref).max():.3g} (relative {rel:.3g})")
    assert rel < 1e-5, rel


def test_packing_invariance(vparams, patches, ours):
    n0 = GRIDS[0][0] * GRIDS[0][1] * GRIDS[0][2]
    a = np.asarray(V.encode(vparams, VC, patches[:n0], GRIDS[:1]))
    b = np.asarray(V.encode(vparams, VC, patches[n0:], GRIDS[1:]))
    np.testing.assert_array_equal(np.concatenate([a, b]), ours)  # exact on XLA:CPU (each chunk attends alone)


def test_pos_table_bicubic_matches_torch():
    """Against F.interpolate in float64 (exact up to f32 rounding) and in float32, whose own error
    reaches ~2e-5 on a 64 -> 38 downscale (its tap weights come from f32 coordinates; ours from f64)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    for (H0, W0), (h, w) in [((8, 8), (6, 10)), ((8, 8), (16, 24)), ((8, 8), (2, 2)), ((5, 7), (13, 3)),
                             ((64, 64), (38, 52)), ((8, 8), (1, 1))]:
        tab = rng.standard_normal((H0, W0, 16))
        got = np.asarray(V.resize_pos_table(jnp.asarray(tab.astype(np.float32)), h, w))
        for dt, atol in ((torch.float64, 2e-6), (torch.float32, 5e-5)):
            ref = torch.nn.functional.interpolate(torch.from_numpy(tab).to(dt).permute(2, 0, 1)[None], size=(h, w),
                                                  mode="bicubic", align_corners=False)[0].permute(1, 2, 0).numpy()
            np.testing.assert_allclose(got, ref, rtol=0, atol=atol, err_msg=f"{(H0, W0)} -> {(h, w)} {dt}")
    tab = rng.standard_normal((8, 8, 4)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(V.resize_pos_table(jnp.asarray(tab), 8, 8)), tab)  # own size: the table
    np.testing.assert_allclose(V.bicubic_matrix(8, 8), np.eye(8), atol=1e-7)
    np.testing.assert_allclose(V.bicubic_matrix(13, 5).sum(1), 1.0, atol=1e-6)


# ---- preprocessing ------------------------------------------------------------------------

def hf_navit_resize():
    """transformers' `navit_resize` (the grid rule of its Kimi-K2.5 processor), read from its source:
    the processor module itself needs torchvision."""
    spec = importlib.util.find_spec("transformers.models.kimi_k25.image_processing_kimi_k25")
    if spec is None or not spec.origin:
        pytest.skip("transformers' Kimi-K2.5 image processor is not installed")
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize"), None)
    if fn is None:
        pytest.skip("transformers' Kimi-K2.5 image processor has no navit_resize")
    ns = {"math": math}
    exec(compile(ast.Module([fn], []), spec.origin, "exec"), ns)
    return ns["navit_resize"]


def test_grid_rule_and_budget():
    navit = hf_navit_resize()
    sizes = [1, 5, 13, 14, 28, 50, 99, 150, 224, 333, 640, 1080, 4000, 9000]
    for budget in (VC.max_image_tokens, 16, 1):
        for H in sizes:
            for Wd in sizes:
                (nh, nw), (gh, gw) = V.fit_image(H, Wd, VC, max_tokens=budget)
                assert gh % 2 == 0 and gw % 2 == 0 and gh >= 2 and gw >= 2
                assert (gh // 2) * (gw // 2) <= budget and nh <= H and nw <= Wd
                assert nh <= gh * P and nw <= gw * P  # padded, never cropped
                (hh, hw), (ph, pw) = navit(H, Wd, P, 2, budget * 4, VC.rope_max_grid)
                if (ph // P // 2) * (pw // P // 2) <= budget:  # HF's grid fits the budget: the same choice
                    assert ((nh, nw), (gh, gw)) == ((hh, hw), (ph // P, pw // P)), (H, Wd, budget)
    assert V.fit_image(5, 5, VC) == ((5, 5), (2, 2))  # at least one merge group
    assert V.fit_image(28 * 4, 28 * 2, VC) == ((112, 56), (8, 4))  # fits: untouched
    (nh, nw), (gh, gw) = V.fit_image(3000, 2000, VC)  # a large image keeps its aspect
    assert (gh // 2) * (gw // 2) <= VC.max_image_tokens and abs(nh / nw - 1.5) < 0.02
    assert V.num_image_tokens((1, gh, gw), VC) == (gh // 2) * (gw // 2)
    assert V.num_image_tokens((4, 6, 8), VC) == 12  # frames are pooled


def test_preprocess_layout_and_normalisation():
    rng = np.random.default_rng(2)
    img = rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)  # fits the budget: no resize, no padding
    patches, grid = V.preprocess_image(img, VC)
    assert grid == (1, 4, 6) and patches.shape == (24, 3 * P * P) and patches.dtype == np.float32
    norm = (img / 255.0 - 0.5) / 0.5
    for r, c in [(0, 0), (1, 4), (3, 5)]:
        want = norm[r * P:(r + 1) * P, c * P:(c + 1) * P].transpose(2, 0, 1).reshape(-1)  # (c, row, col)
        np.testing.assert_allclose(patches[r * 6 + c], want, atol=1e-6)
    # float input in [0, 1] gives the same patches
    np.testing.assert_allclose(V.preprocess_image(img.astype(np.float32) / 255, VC)[0], patches, atol=1e-6)
    # known colours; a 20 x 30 image is padded with black to 28 x 42 (one group high, ... wide)
    solid = np.zeros((20, 30, 3), np.uint8)
    solid[...] = (255, 0, 51)
    patches, grid = V.preprocess_image(solid, VC)
    assert grid == (1, 2, 4)
    px = patches.reshape(2, 4, 3, P, P).transpose(0, 3, 1, 4, 2).reshape(28, 56, 3)  # back to the canvas
    np.testing.assert_allclose(px[:20, :30], np.broadcast_to([1.0, -1.0, 51 / 255 * 2 - 1], (20, 30, 3)), atol=1e-6)
    np.testing.assert_array_equal(px[20:], -1.0)
    np.testing.assert_array_equal(px[:, 30:], -1.0)
    # a large image is resized to fit
    patches, grid = V.preprocess_image(rng.integers(0, 256, (700, 500, 3), dtype=np.uint8), VC, max_tokens=10)
    assert patches.shape == (grid[1] * grid[2], 3 * P * P) and (grid[1] // 2) * (grid[2] // 2) <= 10
    assert np.abs(patches).max() <= 1.0 + 1e-6


def test_resize_matches_pil_bicubic():
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(3)
    img = rng.uniform(0, 1, (97, 143, 3)).astype(np.float32)
    for h, w in [(40, 60), (97, 50), (13, 143)]:
        got = V.resize_bicubic(img, h, w)
        ref = np.stack([np.asarray(Image.fromarray(img[..., c], mode="F").resize((w, h), Image.BICUBIC))
                        for c in range(3)], axis=-1)
        np.testing.assert_allclose(got, ref, atol=2e-5, err_msg=f"{(h, w)}")
    # a PIL image is accepted
    u8 = (img * 255).astype(np.uint8)
    np.testing.assert_array_equal(V.preprocess_image(Image.fromarray(u8), VC)[0], V.preprocess_image(u8, VC)[0])


def test_preprocess_video_chunks():
    frames = np.random.default_rng(4).integers(0, 256, (6, 40, 60, 3), dtype=np.uint8)
    chunks = V.preprocess_video(frames, VC)
    assert [g for _, g in chunks] == [(4, 4, 6), (2, 4, 6)]
    assert [p.shape for p, _ in chunks] == [(96, 3 * P * P), (48, 3 * P * P)]
    first = V.preprocess_image(frames[4], VC)[0]
    np.testing.assert_array_equal(chunks[1][0][:24], first)  # frame-major: frame 4 opens chunk 2
    packed, grids = V.pack(chunks)
    assert packed.shape == (144, 3 * P * P) and grids == ((4, 4, 6), (2, 4, 6))


@pytest.mark.parametrize("bad, match", [
    (np.zeros((10, 10), np.uint8), r"\[H, W, 3\].*shape \(10, 10\)"),
    (np.zeros((2, 10, 10, 3), np.uint8), r"\[H, W, 3\]"),
    (np.zeros((0, 10, 3), np.uint8), "empty"),
    (np.zeros((10, 10, 4), np.uint8), "3 channels"),
    (np.full((10, 10, 3), 2.0, np.float32), r"\[0, 1\]"),
    (np.zeros((10, 10, 3), np.int16), "uint8 .* or float"),
])
def test_preprocess_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        V.preprocess_image(bad, VC)


def test_encode_input_errors(vparams, patches):
    with pytest.raises(ValueError, match="multiples of the merge kernel"):
        V.encode(vparams, VC, patches[:63], ((1, 7, 9),))
    with pytest.raises(ValueError, match="at most 4 frames"):
        V.encode(vparams, VC, np.zeros((5 * 4, 3 * P * P), np.float32), ((5, 2, 2),))
    with pytest.raises(ValueError, match=r"need \(64, 588\)"):
        V.encode(vparams, VC, patches[:60], GRIDS[:1])
    with pytest.raises(ValueError, match="grids is empty"):
        V.encode(vparams, VC, patches[:0], ())
    with pytest.raises(ValueError, match="video must be an array"):
        V.preprocess_video(np.zeros((10, 10, 3), np.uint8), VC)


# ---- checkpoints --------------------------------------------------------------------------

def test_safetensors_roundtrip(vparams, ckpt, tmp_path):
    cfg, _ = W.load_checkpoint(ckpt)
    assert cfg == CFG.replace(name="ckpt")
    assert_params_equal(W.load_vision(ckpt, cfg), vparams)
    bf = W.load_vision(ckpt, cfg, "bfloat16")
    assert_params_equal(bf, jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), vparams))
    # bf16 vision tensors are written as BF16 and read back exactly
    W.save_safetensors(zero_text_params(CFG), CFG, tmp_path / "bf", vision_params=bf, progress=False)
    with safe_open(os.path.join(tmp_path / "bf", "model.safetensors"), "numpy") as f:
        assert f.get_slice("vision_tower.encoder.blocks.0.wqkv.weight").get_dtype() == "BF16"
    assert_params_equal(W.load_vision(tmp_path / "bf", CFG, "bfloat16"), bf)
    # sharded files
    W.save_safetensors(zero_text_params(CFG), CFG, tmp_path / "sh", vision_params=vparams, max_shard_bytes=1 << 18,
                       progress=False)
    assert_params_equal(W.load_vision(tmp_path / "sh", CFG), vparams)


def test_text_only_checkpoints(tmp_path):
    W.save_safetensors(zero_text_params(CFG), CFG, tmp_path / "st", progress=False)
    cfg, _ = W.load_checkpoint(tmp_path / "st")
    assert cfg.vision == VC and W.load_vision(tmp_path / "st", cfg) is None
    text = CFG.replace(vision=None)
    W.save_orbax(zero_text_params(text), text, tmp_path / "o")
    cfg, _ = W.load_checkpoint(tmp_path / "o")
    assert cfg == text and W.load_vision(tmp_path / "o", cfg) is None
    with pytest.raises(ValueError, match="cfg.vision is None"):
        W.save_safetensors(zero_text_params(text), text, tmp_path / "x", vision_params=object(), progress=False)


def test_orbax_roundtrip(vparams, tmp_path):
    W.save_orbax(zero_text_params(CFG), CFG, tmp_path, vision_params=vparams)
    cfg, _ = W.load_checkpoint(tmp_path)
    assert cfg == CFG and cfg.vision == VC  # the nested VisionConfig survives the config json
    assert isinstance(cfg.vision.merge_kernel_size, tuple) and isinstance(cfg.vision.image_mean, tuple)
    assert_params_equal(W.load_vision(tmp_path, cfg), vparams)
    assert_params_equal(W.load_vision(tmp_path, cfg, "bfloat16"),
                      jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), vparams))
    W.save_orbax(zero_text_params(CFG), CFG, tmp_path)  # overwritten without a tower: none left behind
    assert W.load_vision(tmp_path, CFG) is None


@pytest.mark.parametrize("case", ["missing", "misshaped", "unexpected"])
def test_vision_errors_name_the_tensor(ckpt, tmp_path, case):
    from safetensors.numpy import load_file, save_file

    t = load_file(os.path.join(ckpt, "model.safetensors"))
    name = "vision_tower.encoder.blocks.1.mlp.fc0.weight"
    if case == "missing":
        t.pop(name)
    elif case == "misshaped":
        t[name] = np.zeros((64, 128), np.float32)
    else:
        name = "vision_tower.encoder.blocks.2.wqkv.weight"
        t[name] = np.zeros((3, 3), np.float32)
    os.makedirs(tmp_path / "c")
    save_file(t, str(tmp_path / "c" / "model.safetensors"))
    with open(os.path.join(ckpt, "config.json")) as src, open(tmp_path / "c" / "config.json", "w") as dst:
        dst.write(src.read())
    W.load_checkpoint(tmp_path / "c")  # the text model does not care
    with pytest.raises(ValueError, match=re.escape(name)) as e:
        W.load_vision(tmp_path / "c", CFG)
    assert case.replace("misshaped", "mis-shaped") in str(e.value)
    if case == "misshaped":
        assert "[128, 64]" in str(e.value) and "[64, 128]" in str(e.value)


def test_encode_image_buckets_match_encode():
    """`encode_image` (one image padded to a power-of-two patch bucket, padding keys masked) gives `encode`'s rows,
    at the position table's own size and resized, and compiles once for two grids of one bucket."""
    from k3jax.compiles import count_compiles

    vc = preset("k3-tiny").vision
    params = V.init_vision_params(vc, jax.random.PRNGKey(3))
    assert [V.patch_bucket(n) for n in (1, 256, 257, 1024, 1025, 9216)] == [256, 256, 512, 1024, 2048, 9216]
    rng = np.random.default_rng(4)
    grids = [(1, 8, 8), (1, 8, 10), (1, 16, 4), (1, 6, 12)]  # 64 / 80 / 64 / 72 patches: all in bucket 256
    for i, g in enumerate(grids):
        patches = rng.normal(size=(g[1] * g[2], 3 * vc.patch_size ** 2)).astype(np.float32)
        want = np.asarray(V.encode(params, vc, patches, (g,)))
        if i == 2:
            with count_compiles() as compiles:
                got = np.asarray(V.encode_image(params, vc, patches, g))
            assert compiles() == 0  # same bucket as the grids before
        else:
            got = np.asarray(V.encode_image(params, vc, patches, g))
        assert got.shape == want.shape == (V.num_image_tokens(g, vc), vc.text_hidden_size)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="single images"):
        V.encode_image(params, vc, np.zeros((2 * 16, 3 * 14 * 14), np.float32), (2, 4, 4))
