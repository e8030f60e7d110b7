"""Device meshes with the axes ("dp", "tp", "ep") from a spec string such as "tp=8,ep=8".

`make_mesh("dp=2,tp=4")` builds a mesh whose axis sizes multiply to the number of devices it uses.
On one process it takes the first `dp * tp * ep` devices (so "tp=2" runs on 2 of 8 host devices).
With several processes (`jax.process_count() > 1`, lockstep SPMD) every device joins: `tp` stays
inside a process (it carries the per-layer head all-reduces) and the processes are laid along
`dp` first, then `ep` (the slower inter-node network carries the expert all-to-all or nothing).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

try:  # topology-aware device order (TPU tori); a plain reshape elsewhere
    from jax.experimental import mesh_utils
except ImportError:  # pragma: no cover - if a JAX release drops it
    mesh_utils = None

AXES = ("dp", "tp", "ep")


def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """"tp=8,ep=8" -> {"dp": 1, "tp": 8, "ep": 8}; a mapping is checked the same way; None / "" -> all 1."""
    sizes = dict.fromkeys(AXES, 1)
    if spec is None:
        return sizes
    if isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        items = []
        for part in str(spec).replace(" ", "").split(","):
            if not part:
                continue
            name, eq, val = part.partition("=")
            if not eq:
                raise ValueError(f"mesh spec {spec!r}: {part!r} is not of the form axis=size (axes: {', '.join(AXES)})")
            items.append((name, val))
    seen = set()
    for name, val in items:
        if name not in AXES:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r}; axes are {', '.join(AXES)}")
        if name in seen:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        seen.add(name)
        try:
            n = int(val)
        except (TypeError, ValueError):
            raise ValueError(f"mesh spec {spec!r}: size of {name!r} must be a positive integer, got {val!r}") from None
        if n < 1:
            raise ValueError(f"mesh spec {spec!r}: size of {name!r} must be a positive integer, got {n}")
        sizes[name] = n
    return sizes


def format_mesh_spec(sizes: Mapping[str, int]) -> str:
    """{"dp": 1, "tp": 8, "ep": 8} -> "tp=8,ep=8" (axes of size 1 left out; "tp=1" if all are 1)."""
    parts = [f"{a}={sizes[a]}" for a in AXES if sizes.get(a, 1) > 1]
    return ",".join(parts) or "tp=1"


def mesh_sizes(mesh: Mesh | None) -> dict[str, int]:
    """Axis sizes of a mesh (1 for axes it lacks); all 1 for None."""
    out = dict.fromkeys(AXES, 1)
    if mesh is not None:
        out.update({k: int(v) for k, v in mesh.shape.items()})
    return out


def dcn_split(sizes: Mapping[str, int], num_processes: int, local_devices: int) -> tuple[tuple, tuple]:
    """Split mesh axis sizes into (per-process ICI shape, across-process DCN shape), both in AXES order.

    tp stays within a process; processes go along dp first, then ep. Raises ValueError when the
    layout cannot follow that rule.
    """
    dp, tp, ep = (sizes[a] for a in AXES)
    total = dp * tp * ep
    if total != num_processes * local_devices:
        raise ValueError(f"mesh {format_mesh_spec(sizes)} has {total} devices, but {num_processes} processes x "
                         f"{local_devices} local devices = {num_processes * local_devices}; with several processes "
                         "every device must be in the mesh")
    if local_devices % tp:
        raise ValueError(f"tp={tp} must divide the {local_devices} devices of one process (tp stays within a "
                         "process: its all-reduces run every layer)")
    dcn_dp = math.gcd(dp, num_processes)
    dcn_ep = num_processes // dcn_dp
    if ep % dcn_ep:
        raise ValueError(f"cannot lay {num_processes} processes over dp={dp} x ep={ep}: dp takes {dcn_dp}, "
                         f"and ep={ep} is not a multiple of the remaining {dcn_ep}")
    return (dp // dcn_dp, tp, ep // dcn_ep), (dcn_dp, 1, dcn_ep)


def _auto_mesh(devices: np.ndarray) -> Mesh:
    AxisType = getattr(jax.sharding, "AxisType", None)
    if AxisType is not None:  # sharding propagation (Auto), whatever the JAX default becomes
        return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return Mesh(devices, AXES)


def make_mesh(spec: str | Mapping[str, int] | Mesh | None = None, devices: Sequence | None = None) -> Mesh:
    """A Mesh with axes ("dp", "tp", "ep") from `spec` ("tp=8,ep=8", "dp=2,tp=4", "tp=2", a dict, or
    a Mesh, returned as is). `devices` defaults to `jax.devices()`."""
    if isinstance(spec, Mesh):
        if tuple(spec.axis_names) != AXES:
            raise ValueError(f"mesh axes must be {AXES}, got {tuple(spec.axis_names)}")
        return spec
    return _auto_mesh(device_grid(parse_mesh_spec(spec), jax.devices() if devices is None else devices))


def device_grid(sizes: Mapping[str, int], devices: Sequence) -> np.ndarray:
    """Devices arranged as a [dp, tp, ep] array: the first dp*tp*ep devices of one process, or every
    device of several processes laid out by `dcn_split`."""
    shape = tuple(sizes[a] for a in AXES)
    n = math.prod(shape)
    devices = list(devices)
    procs = sorted({getattr(d, "process_index", 0) for d in devices})
    if len(procs) > 1:
        ici, dcn = dcn_split(sizes, len(procs), len(devices) // len(procs))
        if mesh_utils is not None:
            return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
        by_proc = [[d for d in devices if getattr(d, "process_index", 0) == p] for p in procs]
        blocks = np.empty(dcn, dtype=object)
        for i, grp in enumerate(by_proc):  # process i -> block i of the dcn grid, its devices in ici shape
            blocks[np.unravel_index(i, dcn)] = np.asarray(sorted(grp, key=lambda d: d.id), dtype=object).reshape(ici)
        return np.block(blocks.tolist())
    if n > len(devices):
        raise ValueError(f"mesh {format_mesh_spec(sizes)} needs {n} devices, only {len(devices)} are available"
                         + (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)"
                            if devices and devices[0].platform == "cpu" else ""))
    if mesh_utils is not None:
        return mesh_utils.create_device_mesh(shape, devices[:n])
    return np.asarray(devices[:n], dtype=object).reshape(shape)
