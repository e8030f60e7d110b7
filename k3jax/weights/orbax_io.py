"""Orbax checkpoints of our stacked `Params`, with the `ModelConfig` as json beside them."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Sequence

import jax

from k3jax.config import ModelConfig

log = logging.getLogger(__name__)

ORBAX_CONFIG = "k3jax_config.json"
ORBAX_PARAMS = "params"


# ---- config json --------------------------------------------------------------------------

def _cfg_to_json(cfg: ModelConfig) -> dict:
    return {"format": "k3jax-orbax-v1",
            "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}}


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _cfg_from_json(raw: dict) -> ModelConfig:
    raw = raw.get("config", raw)
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        log.warning("ignoring unknown config fields %s", unknown)
    kw = {k: (_tuples(v) if str(fields[k].type).startswith("tuple") else v) for k, v in raw.items() if k in fields}
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


def save_orbax(params, cfg: ModelConfig, directory: str | os.PathLike) -> None:
    """Write `params` as an orbax checkpoint under `directory/params` and the config beside it
    (`params` stacked or per-layer: the file holds the stacked layout)."""
    import orbax.checkpoint as ocp

    from k3jax.model.forward import stack_layers

    params = stack_layers(params)

    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    paths, leaves, _ = _leaf_paths(params)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(directory, ORBAX_PARAMS), _nest(paths, leaves), force=True)
    ckptr.wait_until_finished()
    with open(os.path.join(directory, ORBAX_CONFIG), "w") as f:
        json.dump(_cfg_to_json(cfg), f, indent=1)


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
