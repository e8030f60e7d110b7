"""Orbax checkpoints of our stacked `Params` (`params/`), optionally the `VisionParams` (`vision/`),
with the `ModelConfig` (its `VisionConfig` nested) as json beside them."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Sequence

import jax

from k3jax.config import ModelConfig, VisionConfig

log = logging.getLogger(__name__)

ORBAX_CONFIG = "k3jax_config.json"
ORBAX_PARAMS = "params"
ORBAX_VISION = "vision"  # the VisionParams' orbax tree, beside `params`


# ---- config json --------------------------------------------------------------------------

def _cfg_to_json(cfg: ModelConfig) -> dict:
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    if cfg.vision is not None:  # a nested frozen dataclass: its fields as an object
        fields["vision"] = {f.name: getattr(cfg.vision, f.name) for f in dataclasses.fields(cfg.vision)}
    return {"format": "k3jax-orbax-v1", "config": fields}


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _dataclass_from_json(cls, raw: dict, what: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        log.warning("ignoring unknown %s fields %s", what, unknown)
    return {k: (_tuples(v) if str(fields[k].type).startswith("tuple") else v) for k, v in raw.items() if k in fields}


def _cfg_from_json(raw: dict) -> ModelConfig:
    raw = raw.get("config", raw)
    kw = _dataclass_from_json(ModelConfig, raw, "config")
    if isinstance(kw.get("vision"), dict):
        kw["vision"] = VisionConfig(**_dataclass_from_json(VisionConfig, kw["vision"], "vision config"))
    return ModelConfig(**kw)


# ---- orbax --------------------------------------------------------------------------------

def _leaf_paths(shapes) -> tuple[list[str], list, object]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    return [".".join(k.name for k in p) for p, _ in flat], [s for _, s in flat], treedef


def _nest(paths: Sequence[str], leaves: Sequence) -> dict:
    out: dict = {}
    for path, leaf in zip(paths, leaves):
        *head, last = path.split(".")
        d = out
        for k in head:
            d = d.setdefault(k, {})
        d[last] = leaf
    return out


def _unnest(tree: dict, paths: Sequence[str]) -> list:
    out = []
    for path in paths:
        d = tree
        for k in path.split("."):
            d = d[k]
        out.append(d)
    return out


def save_orbax(params, cfg: ModelConfig, directory: str | os.PathLike, *, vision_params=None) -> None:
    """Write `params` as an orbax checkpoint under `directory/params` and the config beside it
    (`params` stacked or per-layer: the file holds the stacked layout). `vision_params` (a
    `VisionParams`, needs `cfg.vision`) go to `directory/vision`; without them the checkpoint has none."""
    import orbax.checkpoint as ocp

    from k3jax.model.forward import stack_layers

    params = stack_layers(params)
    if vision_params is not None and cfg.vision is None:
        raise ValueError("vision_params given for a config without a vision tower (cfg.vision is None)")

    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    trees = [(ORBAX_PARAMS, params)] + ([(ORBAX_VISION, vision_params)] if vision_params is not None else [])
    for sub, tree in trees:
        paths, leaves, _ = _leaf_paths(tree)
        ckptr.save(os.path.join(directory, sub), _nest(paths, leaves), force=True)
        ckptr.wait_until_finished()
    stale = os.path.join(directory, ORBAX_VISION)
    if vision_params is None and os.path.isdir(stale):  # overwriting a checkpoint that had a tower
        shutil.rmtree(stale)
    with open(os.path.join(directory, ORBAX_CONFIG), "w") as f:
        json.dump(_cfg_to_json(cfg), f, indent=1)


def load_orbax_vision(directory: str | os.PathLike, vcfg: VisionConfig, dtype="float32", *, missing_ok: bool = False):
    """-> `VisionParams` (in `dtype`) from a `save_orbax(..., vision_params=)` directory;
    FileNotFoundError when it has none (None with `missing_ok`)."""
    import orbax.checkpoint as ocp

    from k3jax.model.vision import vision_param_shapes

    directory = os.path.abspath(os.fspath(directory))
    path = os.path.join(directory, ORBAX_VISION)
    if not os.path.isdir(path):
        if missing_ok:
            return None
        raise FileNotFoundError(f"no vision tower in {directory} (no {ORBAX_VISION}/ orbax tree)")
    paths, shapes, treedef = _leaf_paths(vision_param_shapes(vcfg, dtype))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = _nest(paths, [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev) for s in shapes])
    restored = ocp.StandardCheckpointer().restore(path, target)
    return jax.tree_util.tree_unflatten(treedef, _unnest(restored, paths))


def load_orbax(directory: str | os.PathLike, dtype: str | None = None, *, shardings=None):
    """-> (cfg, params) from a `save_orbax` directory; `dtype` overrides the model dtype (f32
    leaves such as the router, dt_bias, A_log and conv stay f32). `shardings` (a Params-shaped tree
    of shardings, or a function `cfg -> tree`) restores every leaf straight onto its shards."""
    import orbax.checkpoint as ocp

    from k3jax.model.init import param_shapes

    directory = os.path.abspath(os.fspath(directory))
    cfg_path = os.path.join(directory, ORBAX_CONFIG)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no {ORBAX_CONFIG} in {directory}")
    with open(cfg_path) as f:
        cfg = _cfg_from_json(json.load(f))
    if dtype:
        cfg = cfg.replace(dtype=dtype)
    paths, shapes, treedef = _leaf_paths(param_shapes(cfg))
    from k3jax.weights.sharded import leaf_shardings

    leaf_sh = leaf_shardings(shardings, cfg, len(shapes))
    if leaf_sh is None:
        leaf_sh = [jax.sharding.SingleDeviceSharding(jax.devices()[0])] * len(shapes)
    target = _nest(paths, [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh) for s, sh in zip(shapes, leaf_sh)])
    restored = ocp.StandardCheckpointer().restore(os.path.join(directory, ORBAX_PARAMS), target)
    return cfg, jax.tree_util.tree_unflatten(treedef, _unnest(restored, paths))
