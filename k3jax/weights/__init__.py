"""Checkpoints: HF safetensors (Kimi-Linear / Kimi-K3 names, MXFP4 experts) and orbax, to and from
our stacked `Params`.

`load_checkpoint(dir)` picks the format: orbax (`k3jax_config.json` beside an orbax tree) or HF
safetensors (`config.json` + `model.safetensors` or a sharded `model.safetensors.index.json`).

Safetensors names. Every on-disk name is first brought to one canonical form: the K3 prefix
`language_model.` is dropped (and `language_model.layers.N` read as `model.layers.N`),
`block_sparse_moe.` is read as `mlp.` and HF's in-memory `self_attn.forget_gate.` as `self_attn.`;
`vision_tower.*` / `mm_projector.*` are skipped here (`load_vision` reads them). Each layer slice
of each parameter then has a list of accepted tensor groups ("variants"): the published layout
first (torch `Linear [out, in]`, separate `{q,k,v}_conv1d [C, 1, W]`, per-expert
`experts.{e}.w{1,2,3}.weight`), then MXFP4 experts (`weight_packed` / `weight_scale`) and HF's fused
in-memory tensors (`conv1d.weight`, `experts.gate_up_proj`, `experts.down_proj`). Saving writes the
first (published) variant.

Host memory while loading is about one stacked parameter: each leaf is assembled in numpy from the
tensors it needs, put on the device, and dropped. With `shardings`, about one device's slice of one
leaf: each distinct slice is read on its own (see `load_safetensors`).
"""

from __future__ import annotations

import logging
import os

from k3jax.weights.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3jax.weights.orbax_io import ORBAX_CONFIG, load_orbax, load_orbax_vision, save_orbax
from k3jax.weights.safetensors_io import load_safetensors, save_safetensors
from k3jax.weights.vision_io import load_vision_safetensors, vision_tensors

log = logging.getLogger(__name__)

__all__ = ["load_checkpoint", "load_vision", "load_orbax", "load_orbax_vision", "save_orbax", "load_safetensors",
           "load_vision_safetensors", "save_safetensors", "vision_tensors", "quantize_mxfp4", "dequantize_mxfp4"]


def load_checkpoint(directory: str | os.PathLike, dtype: str | None = None, *, shardings=None):
    """-> (cfg, params): orbax when `k3jax_config.json` is present, else HF safetensors.
    `shardings` (a Params-shaped tree of shardings, or a function `cfg -> tree`) places every
    tensor directly into its shards."""
    directory = os.fspath(directory)
    if os.path.isfile(os.path.join(directory, ORBAX_CONFIG)):
        return load_orbax(directory, dtype=dtype, shardings=shardings)
    if os.path.isfile(os.path.join(directory, "config.json")):
        return load_safetensors(directory, dtype=dtype, shardings=shardings)
    raise FileNotFoundError(
        f"{directory!r} is not a checkpoint: it has neither {ORBAX_CONFIG} (orbax) nor config.json (HF safetensors)")


def load_vision(directory: str | os.PathLike, cfg, dtype: str | None = None):
    """-> `VisionParams` of the checkpoint in `directory` (orbax or HF safetensors, as
    `load_checkpoint`) in `dtype` (default `cfg.dtype`), or None when `cfg.vision` is None or the
    checkpoint holds no vision tensor at all (a text-only checkpoint of a vision config; logged).
    A partial or mis-shaped tower raises ValueError naming the tensors."""
    if cfg.vision is None:
        return None
    directory = os.fspath(directory)
    dtype = dtype or cfg.dtype
    if os.path.isfile(os.path.join(directory, ORBAX_CONFIG)):
        out = load_orbax_vision(directory, cfg.vision, dtype, missing_ok=True)
    elif os.path.isfile(os.path.join(directory, "config.json")):
        out = load_vision_safetensors(directory, cfg.vision, dtype, missing_ok=True)
    else:
        raise FileNotFoundError(
            f"{directory!r} is not a checkpoint: it has neither {ORBAX_CONFIG} (orbax) nor config.json (HF safetensors)")
    if out is None:
        log.warning("%s has a vision config but no vision tower weights", directory)
    return out
