"""Safetensors names and layouts of the vision tower + projector (`k3jax.model.vision.VisionParams`).

The published Kimi-K2.5 / K3 names (the original MoonViT3d module tree; HF transformers renames them
on load, see its `conversion_mapping.py` "kimi_k25" entry), torch layouts on disk:

  vision_tower.patch_embed.proj.{weight [D, 3, p, p], bias [D]}      Conv2d k = s = p
  vision_tower.patch_embed.pos_emb.weight [H0, W0, D]                learned position table
  vision_tower.encoder.blocks.{i}.norm0.{weight, bias} [D]           pre-attention LayerNorm
  vision_tower.encoder.blocks.{i}.wqkv.{weight [3D, D], bias [3D]}   q | k | v, rotary pairs interleaved
  vision_tower.encoder.blocks.{i}.wo.{weight [D, D], bias [D]}
  vision_tower.encoder.blocks.{i}.norm1.{weight, bias} [D]           pre-MLP LayerNorm
  vision_tower.encoder.blocks.{i}.mlp.fc0.{weight [I, D], bias [I]}
  vision_tower.encoder.blocks.{i}.mlp.fc1.{weight [D, I], bias [D]}
  vision_tower.encoder.final_layernorm.{weight, bias} [D]
  mm_projector.pre_norm.{weight, bias} [D]
  mm_projector.proj.0.{weight [A*D, A*D], bias [A*D]}
  mm_projector.proj.2.{weight [Dt, A*D], bias [Dt]}

(HF transformers' in-memory modules differ: norm0/norm1 -> norm1/norm2, fc0/fc1 -> fc1/fc2, wo ->
attn.proj, wqkv unfused into q/k/v_proj with q and k permuted from interleaved rotary pairs to its
rotate-half layout; its `save_pretrained` writes the names above again.) The (non-persistent) sin-cos
time table and rotary tables are computed, never stored.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np

from k3jax.config import VisionConfig

log = logging.getLogger(__name__)

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


@dataclass
class VisionTensor:
    """One on-disk tensor: its name, the `VisionParams` leaf (and block) it fills, and the layouts."""
    name: str
    path: str  # leaf path in VisionParams, e.g. "blocks.wqkv"
    layer: int | None  # block index for the stacked `blocks.*` leaves
    shape: tuple[int, ...]  # on disk
    load: Callable[[np.ndarray], np.ndarray]  # disk tensor -> our slice
    save: Callable[[np.ndarray], np.ndarray]  # our slice -> disk tensor


def _same(a):
    return a


def _t(a):  # torch Linear [out, in] <-> ours [in, out]
    return a.T


def vision_tensors(vcfg: VisionConfig) -> list[VisionTensor]:
    """Every vision tensor of a checkpoint for `vcfg`, in file order."""
    D, I, L, p, A, Dt = (vcfg.hidden_size, vcfg.intermediate_size, vcfg.num_hidden_layers, vcfg.patch_size,
                         vcfg.merge_area, vcfg.text_hidden_size)
    out: list[VisionTensor] = []

    def vec(name, path, n, layer=None):
        out.append(VisionTensor(name, path, layer, (n,), _same, _same))

    def lin(name, path, n_out, n_in, layer=None):
        out.append(VisionTensor(name, path, layer, (n_out, n_in), _t, _t))

    pe = "vision_tower.patch_embed."
    out.append(VisionTensor(pe + "proj.weight", "patch_w", None, (D, 3, p, p),
                            lambda a: a.reshape(D, 3 * p * p).T, lambda w: w.T.reshape(D, 3, p, p)))
    vec(pe + "proj.bias", "patch_b", D)
    out.append(VisionTensor(pe + "pos_emb.weight", "pos_emb", None,
                            (vcfg.init_pos_emb_height, vcfg.init_pos_emb_width, D), _same, _same))
    for i in range(L):
        b = f"vision_tower.encoder.blocks.{i}."
        vec(b + "norm0.weight", "blocks.norm0_w", D, i)
        vec(b + "norm0.bias", "blocks.norm0_b", D, i)
        lin(b + "wqkv.weight", "blocks.wqkv", 3 * D, D, i)
        vec(b + "wqkv.bias", "blocks.wqkv_b", 3 * D, i)
        lin(b + "wo.weight", "blocks.wo", D, D, i)
        vec(b + "wo.bias", "blocks.wo_b", D, i)
        vec(b + "norm1.weight", "blocks.norm1_w", D, i)
        vec(b + "norm1.bias", "blocks.norm1_b", D, i)
        lin(b + "mlp.fc0.weight", "blocks.fc0", I, D, i)
        vec(b + "mlp.fc0.bias", "blocks.fc0_b", I, i)
        lin(b + "mlp.fc1.weight", "blocks.fc1", D, I, i)
        vec(b + "mlp.fc1.bias", "blocks.fc1_b", D, i)
    vec("vision_tower.encoder.final_layernorm.weight", "final_norm_w", D)
    vec("vision_tower.encoder.final_layernorm.bias", "final_norm_b", D)
    vec("mm_projector.pre_norm.weight", "proj_norm_w", D)
    vec("mm_projector.pre_norm.bias", "proj_norm_b", D)
    lin("mm_projector.proj.0.weight", "proj0", A * D, A * D)
    vec("mm_projector.proj.0.bias", "proj0_b", A * D)
    lin("mm_projector.proj.2.weight", "proj2", Dt, A * D)
    vec("mm_projector.proj.2.bias", "proj2_b", Dt)
    return out


def is_vision_name(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


# ---- writing (used by `save_safetensors`) -------------------------------------------------

def vision_save_entries(vparams, vcfg: VisionConfig):
    """-> ([(name, shape, numpy dtype), ...], producer) where `producer()` yields (name, array) in
    the same order, one tensor at a time."""
    from k3jax.weights.orbax_io import _leaf_paths

    paths, leaves, _ = _leaf_paths(vparams)
    by_path = dict(zip(paths, leaves))
    specs = vision_tensors(vcfg)
    for s in specs:
        if s.path not in by_path:
            raise ValueError(f"vision_params has no leaf {s.path!r}")
    extra = sorted(set(by_path) - {s.path for s in specs})
    if extra:
        raise ValueError(f"vision_params has leaves the checkpoint format does not know: {extra}")
    entries = [(s.name, s.shape, np.dtype(by_path[s.path].dtype)) for s in specs]

    def producer():
        for s in specs:
            leaf = by_path[s.path]
            a = np.asarray(leaf if s.layer is None else leaf[s.layer])
            out = s.save(a)
            if tuple(out.shape) != s.shape:
                raise ValueError(f"{s.name}: vision_params gives shape {tuple(out.shape)}, the config needs {s.shape}")
            yield s.name, out

    return entries, producer


# ---- reading ------------------------------------------------------------------------------

def load_vision_safetensors(directory: str | os.PathLike, vcfg: VisionConfig, dtype="float32", *,
                            missing_ok: bool = False):
    """-> `VisionParams` (in `dtype`) from a HF checkpoint directory's `vision_tower.*` /
    `mm_projector.*` tensors. ValueError listing every missing, mis-shaped and unexpected vision
    tensor; with `missing_ok`, None when the checkpoint holds no vision tensor at all."""
    from k3jax.model.vision import vision_param_shapes
    from k3jax.weights.orbax_io import _leaf_paths
    from k3jax.weights.safetensors_io import _fmt, _Reader, check_tensors

    directory = os.fspath(directory)
    reader = _Reader(directory, part="vision")
    try:
        if not reader.where and missing_ok:
            return None
        specs = vision_tensors(vcfg)
        known = {s.name for s in specs}
        missing = [f"{s.name} {_fmt(s.shape)}" for s in specs if s.name not in reader.where]
        misshaped = [f"{s.name}: expected {_fmt(s.shape)}, found {_fmt(reader.info(s.name)[0])}"
                     for s in specs if s.name in reader.where and tuple(reader.info(s.name)[0]) != s.shape]
        unexpected = [f"{n} {_fmt(reader.info(n)[0])}" for n in reader.where if n not in known]
        check_tensors(f"checkpoint {directory}: its vision tensors do not match the vision config:", missing,
                      misshaped, unexpected)
        paths, shapes, treedef = _leaf_paths(vision_param_shapes(vcfg, dtype))
        hosts = {path: np.empty(s.shape, np.dtype(s.dtype)) for path, s in zip(paths, shapes)}
        for s in specs:
            val = np.asarray(s.load(reader.get(s.name)))
            dst = hosts[s.path]
            if s.layer is None:
                dst[...] = val.astype(dst.dtype)
            else:
                dst[s.layer] = val.astype(dst.dtype)
        return jax.tree_util.tree_unflatten(treedef, [jax.device_put(hosts[p]) for p in paths])
    finally:
        reader.close()
