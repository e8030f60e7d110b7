"""Building parameter leaves directly on their shards (`load_safetensors(..., shardings=)`,
`load_orbax(..., shardings=)`): no process holds a whole leaf, let alone the whole model."""

from __future__ import annotations

import jax
import numpy as np

from k3jax.config import ModelConfig


def leaf_shardings(shardings, cfg: ModelConfig, n_leaves: int) -> list | None:
    """A Params-shaped tree of shardings (or a function cfg -> tree) -> its leaves in param order."""
    if shardings is None:
        return None
    tree = shardings(cfg) if callable(shardings) else shardings
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(leaves) != n_leaves:
        raise ValueError(f"shardings has {len(leaves)} leaves, the parameters of {cfg.name} have {n_leaves}")
    return leaves


def _slice_shape(index: tuple, shape: tuple) -> tuple:
    return tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape))


def _read_part(reader, rows, index: tuple, shape: tuple, dt) -> np.ndarray:
    """One device's slice `index` of a leaf, reading per layer only the tensors (and, where the
    layout allows, the bytes) it covers."""
    def part(v, ix):
        if v.part is not None:
            return v.part(lambda k, disk_ix: reader.get_slice(v.names[k], disk_ix), ix)
        return np.asarray(v.load([reader.get(n) for n in v.names]))[ix]

    if rows[0][0] is None:  # unstacked leaf
        return np.asarray(part(rows[0][1], index), dt)
    host = np.empty(_slice_shape(index, shape), dt)
    for jj, j in enumerate(range(*index[0].indices(shape[0]))):
        host[jj] = part(rows[j][1], index[1:])
    return host


def put_sharded(reader, rows, sds, sharding) -> jax.Array:
    """Build one leaf on `sharding`: each distinct slice on this process is read once and put on
    the devices that hold it; host memory is one device's slice at a time.

    `reader` has `get(name)` (a whole tensor) and `get_slice(name, index)`; `rows` is the leaf's
    `[(layer or None, variant), ...]` from the safetensors plan (`k3jax.weights.names._V`)."""
    dt = np.dtype(sds.dtype)
    by_index: dict[tuple, list] = {}
    for dev, index in sharding.addressable_devices_indices_map(sds.shape).items():
        index = tuple(slice(*sl.indices(n)) for sl, n in zip(index, sds.shape))
        by_index.setdefault(tuple((sl.start, sl.stop) for sl in index), []).append((dev, index))
    arrays = []
    for group in by_index.values():
        host = _read_part(reader, rows, group[0][1], sds.shape, dt)
        arrays += [jax.device_put(host, dev) for dev, _ in group]
        del host
    return jax.make_array_from_single_device_arrays(sds.shape, sharding, arrays)
