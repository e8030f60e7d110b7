"""HF safetensors checkpoints (published Kimi-Linear / Kimi-K3 layout, HF transformers' layouts,
MXFP4 experts): streaming load into our stacked `Params`, and save in the published layout."""

from __future__ import annotations

import json
import logging
import os
from typing import Sequence

import jax
import ml_dtypes
import numpy as np

from k3jax.config import ModelConfig, to_hf_dict
from k3jax.weights.mxfp4 import MXFP4_GROUP
from k3jax.weights.names import (_K3_PREFIX, _Shape, _canonical, _groups, _is_k3_layout, _layers_of, _published,
                                 _variants)
from k3jax.weights.orbax_io import _leaf_paths
from k3jax.weights.sharded import leaf_shardings, put_sharded

log = logging.getLogger(__name__)

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_MAX_LISTED = 8


# ---- safetensors reading ------------------------------------------------------------------

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_NP_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def _st_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


class _Reader:
    """Lazy access to the tensors of one HF checkpoint directory by canonical name: the text model's
    (`part="text"`; vision tensors are listed in `skipped`) or the vision tower's and projector's
    (`part="vision"`, by their on-disk names; the text model's are skipped)."""

    def __init__(self, directory: str, part: str = "text"):
        if part not in ("text", "vision"):
            raise ValueError(f"part must be 'text' or 'vision', got {part!r}")
        single = os.path.join(directory, SAFETENSORS_SINGLE)
        index = os.path.join(directory, SAFETENSORS_INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            weight_map = None
        else:
            raise FileNotFoundError(f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {directory}")
        files = sorted(set(weight_map.values())) if weight_map else [SAFETENSORS_SINGLE]
        self.directory = directory
        self.headers: dict[str, tuple[dict, int]] = {}
        self.where: dict[str, tuple[str, str]] = {}  # canonical -> (file, on-disk name)
        self.skipped: list[str] = []
        self.prefixed = False
        dup: list[str] = []
        for fn in files:
            path = os.path.join(directory, fn)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{SAFETENSORS_INDEX} names {fn}, which is not in {directory}")
            header, start = _st_header(path)
            self.headers[fn] = (header, start)
            for name in header:
                if name == "__metadata__" or (weight_map is not None and weight_map.get(name) != fn):
                    continue
                canon = _canonical(name)
                if part == "vision":
                    canon = name if canon is None else None
                if canon is None:
                    self.skipped.append(name)
                    continue
                self.prefixed |= name.startswith(_K3_PREFIX)
                if canon in self.where:
                    dup.append(f"{self.where[canon][1]} / {name}")
                self.where[canon] = (fn, name)
        if dup:
            raise ValueError(f"checkpoint {directory}: tensors given twice under aliased names: "
                             + _listing(dup))
        self._open: dict[str, object] = {}

    def info(self, canon: str) -> tuple[tuple, str]:
        fn, name = self.where[canon]
        meta = self.headers[fn][0][name]
        return tuple(meta["shape"]), meta["dtype"]

    def disk_name(self, canon: str) -> str:
        return self.where[canon][1]

    def get(self, canon: str) -> np.ndarray:
        fn, name = self.where[canon]
        path = os.path.join(self.directory, fn)
        try:
            from safetensors import safe_open

            if fn not in self._open:
                self._open[fn] = safe_open(path, framework="numpy").__enter__()
            return self._open[fn].get_tensor(name)
        except Exception:  # e.g. an old safetensors without bf16 / fp8 in numpy: read the bytes
            header, start = self.headers[fn]
            meta = header[name]
            b, e = meta["data_offsets"]
            dt = np.dtype(_ST_DTYPES[meta["dtype"]])
            arr = np.fromfile(path, dtype=np.uint8, count=e - b, offset=start + b)
            return arr.view(dt).reshape(meta["shape"])

    def get_slice(self, canon: str, index: tuple) -> np.ndarray:
        """`tensor[index]` reading only the pages it touches (a memory map of the file)."""
        fn, name = self.where[canon]
        header, start = self.headers[fn]
        meta = header[name]
        b, _ = meta["data_offsets"]
        shape = tuple(meta["shape"])
        dt = np.dtype(_ST_DTYPES[meta["dtype"]])
        if not shape or 0 in shape:
            return self.get(canon)[index]
        mm = np.memmap(os.path.join(self.directory, fn), dtype=dt, mode="r", offset=start + b, shape=shape)
        out = np.array(mm[index])
        del mm
        return out

    def close(self):
        for h in self._open.values():
            h.__exit__(None, None, None)
        self._open.clear()


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f", ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


def _plan(cfg: ModelConfig, reader: _Reader, paths: Sequence[str]):
    """Choose a variant for every layer slice of every leaf; raise ValueError listing every
    missing, mis-shaped and unexpected tensor. -> {path: [(layer_or_None, variant), ...]}"""
    groups = _groups(cfg)
    present = reader.where
    used: set[str] = set()
    missing: list[str] = []
    misshaped: list[str] = []
    prefix = _K3_PREFIX if reader.prefixed else ""
    plan = {}
    for path in paths:
        layers = _layers_of(cfg, path, groups)
        rows = []
        for i in (layers if layers is not None else [None]):
            vs = _variants(cfg, path, i)
            avail = [v for v in vs if all(n in present for n in v.names)]

            def fits(v):
                return all(v.shape_ok(k, reader.info(n)[0]) and (not v.dtypes or not v.dtypes[k]
                                                                  or reader.info(n)[1] == v.dtypes[k])
                           for k, n in enumerate(v.names))

            good = [v for v in avail if fits(v)]
            if good:
                rows.append((i, good[0]))
                used.update(good[0].names)
                continue
            if avail:  # present but wrong shape / dtype: report the first such group
                v = avail[0]
                for k, n in enumerate(v.names):
                    shape, dt = reader.info(n)
                    want_dt = v.dtypes[k] if v.dtypes else None
                    if not v.shape_ok(k, shape) or (want_dt and dt != want_dt):
                        misshaped.append(f"{reader.disk_name(n)}: expected {_fmt(v.shapes[k])}"
                                         f"{' ' + want_dt if want_dt else ''}, found {_fmt(shape)} {dt}")
                used.update(v.names)
                continue
            v = max(vs, key=lambda v: sum(n in present for n in v.names))  # first on ties
            for k, n in enumerate(v.names):
                if n in present:
                    used.add(n)
                else:
                    missing.append(f"{_published(n, cfg, prefix)} {_fmt(v.shapes[k])}")
        plan[path] = rows
    unexpected = [f"{reader.disk_name(n)} {_fmt(reader.info(n)[0])}" for n in present if n not in used]
    check_tensors(f"checkpoint {reader.directory} does not match its config.json:", missing, misshaped, unexpected)
    return plan


def check_tensors(header: str, missing, misshaped, unexpected) -> None:
    """Raise one ValueError under `header` listing the missing, mis-shaped and unexpected tensors, if any."""
    if missing or misshaped or unexpected:
        lines = [header]
        for what, items in (("missing", missing), ("mis-shaped", misshaped), ("unexpected", unexpected)):
            if items:
                lines.append(f"  {len(items)} {what}: " + _listing(items))
        raise ValueError("\n".join(lines))


def _fmt(shape) -> str:
    return str(shape) if isinstance(shape, _Shape) else "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _check_ffn_schedule(raw: dict, cfg: ModelConfig):
    types = (raw.get("text_config") or raw).get("mlp_layer_types")
    if types is not None:
        ours = ["sparse" if k == "moe" else "dense" for k in cfg.ffn_kinds]
        if list(types) != ours:
            raise ValueError(f"config.json mlp_layer_types {types} differs from the schedule given by "
                             f"first_k_dense_replace / moe_layer_freq ({ours}); such schedules are not supported")


def load_safetensors(directory: str | os.PathLike, dtype: str | None = None, *, progress: bool = True,
                     shardings=None):
    """-> (cfg, params) from a HF checkpoint directory (`config.json` + safetensors); see the
    module docstring for the accepted names. `dtype` overrides the config's dtype.

    `shardings`: a Params-shaped tree of shardings, or a function `cfg -> tree` (e.g.
    `lambda cfg: sharding.rules.param_shardings(cfg, mesh)`). Each leaf is then built directly on
    its shards: every distinct shard on this process is read from the files on its own (memory
    mapped; published and MXFP4 layouts read only the rows / columns / experts of the shard) and
    put on its devices, so no process ever holds a whole leaf, let alone the whole model."""
    from tqdm.auto import tqdm

    from k3jax.model.init import param_shapes

    directory = os.fspath(directory)
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in {directory}")
    with open(cfg_path) as f:
        raw = json.load(f)
    cfg = ModelConfig.from_hf(raw)
    cfg = cfg.replace(name=os.path.basename(os.path.abspath(directory)), **({"dtype": dtype} if dtype else {}))
    _check_ffn_schedule(raw, cfg)
    reader = _Reader(directory)
    if reader.skipped:
        log.info("skipping %d vision tensors (vision_tower.* / mm_projector.*)", len(reader.skipped))
    if cfg.num_kda_layers and cfg.kda_a_log_size is None:  # remember a padded A_log length (K3: 128)
        j = cfg.layer_kinds.index("kda")
        name = f"model.layers.{j}.self_attn.A_log"
        if name in reader.where:
            shape = reader.info(name)[0]
            if len(shape) == 1 and shape[0] > cfg.kda_num_heads:
                cfg = cfg.replace(kda_a_log_size=int(shape[0]))
    paths, shapes, treedef = _leaf_paths(param_shapes(cfg))
    plan = _plan(cfg, reader, paths)
    shard_leaves = leaf_shardings(shardings, cfg, len(paths))
    leaves = []
    total = sum(len(v.names) for rows in plan.values() for _, v in rows)
    try:
        with tqdm(total=total, desc="loading tensors", unit="tensor", disable=not progress) as bar:
            for k, (path, sds) in enumerate(zip(paths, shapes)):
                if shard_leaves is not None:
                    leaves.append(put_sharded(reader, plan[path], sds, shard_leaves[k]))
                    bar.update(sum(len(v.names) for _, v in plan[path]))
                    continue
                dt = np.dtype(sds.dtype)
                host = np.empty(sds.shape, dt)
                for j, (i, v) in enumerate(plan[path]):
                    parts = [reader.get(n) for n in v.names]
                    val = np.asarray(v.load(parts))
                    if i is None:
                        host[...] = val.astype(dt)
                    else:
                        host[j] = val.astype(dt)
                    del parts, val
                    bar.update(len(v.names))
                leaves.append(jax.device_put(host))
                del host
    finally:
        reader.close()
    return cfg, jax.tree_util.tree_unflatten(treedef, leaves)


# ---- safetensors writing ------------------------------------------------------------------

def _save_plan(cfg: ModelConfig, paths: Sequence[str], shapes, mxfp4_experts: bool, prefix: str):
    """-> list of (path, layer_pos, variant, [(published name, shape, st dtype), ...]) in file order."""
    groups = _groups(cfg)
    out = []
    for path, sds in zip(paths, shapes):
        layers = _layers_of(cfg, path, groups)
        st_dt = _NP_TO_ST[np.dtype(sds.dtype)]
        for j, i in enumerate(layers if layers is not None else [None]):
            vs = _variants(cfg, path, i)
            v = next((v for v in vs if v.kind == "mxfp4"), None) if mxfp4_experts else None
            v = v or vs[0]
            ents = [(_published(n, cfg, prefix), tuple(int(d) for d in s), (v.dtypes[k] if v.dtypes else None) or st_dt)
                    for k, (n, s) in enumerate(zip(v.names, v.shapes))]
            out.append((path, None if i is None else j, v, ents))
    return out


def _nbytes(shape, st_dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[st_dtype]).itemsize


def save_safetensors(params, cfg: ModelConfig, directory: str | os.PathLike, *, fmt: str = "published",
                     max_shard_bytes: int | None = None, mxfp4_experts: bool = False, progress: bool = True,
                     vision_params=None):
    """Write `config.json` (`to_hf_dict(cfg)`) and the tensors in the published HF layout.

    K3-style configs (AttnRes / LatentMoE, or with a vision tower) get the `language_model.` prefix,
    Kimi-Linear-style ones none. `max_shard_bytes` splits the tensors over
    `model-0000i-of-0000n.safetensors` with a `model.safetensors.index.json`. `mxfp4_experts=True`
    stores routed experts as MXFP4 (`quantize_mxfp4`: lossy, power-of-two scale per 32 inputs, round
    to nearest E2M1). Tensors are written one layer slice at a time, so host memory stays about one
    slice. `params` in the stacked or the per-layer layout (`load_model`'s; stacked here first).
    `vision_params` (a `VisionParams`, needs `cfg.vision`) are written after the text tensors under
    their published names (`vision_io`); without them the checkpoint has none.
    """
    from tqdm.auto import tqdm

    from k3jax.model.forward import stack_layers
    from k3jax.weights.vision_io import vision_save_entries

    params = stack_layers(params)

    if fmt != "published":
        raise ValueError(f"unknown safetensors format {fmt!r}; only 'published' is written")
    if vision_params is not None and cfg.vision is None:
        raise ValueError("vision_params given for a config without a vision tower (cfg.vision is None)")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    k3 = _is_k3_layout(cfg) or cfg.vision is not None  # to_hf_dict's kimi_k3 layout
    paths, leaves, _ = _leaf_paths(params)
    plan = _save_plan(cfg, paths, leaves, mxfp4_experts, _K3_PREFIX if k3 else "")
    entries = [e for *_, ents in plan for e in ents]
    vision_stream = None
    if vision_params is not None:
        v_entries, vision_stream = vision_save_entries(vision_params, cfg.vision)
        entries += [(name, shape, _NP_TO_ST[dt]) for name, shape, dt in v_entries]

    shards: list[list[tuple]] = [[]]
    size = 0
    for name, shape, dt in entries:
        n = _nbytes(shape, dt)
        if max_shard_bytes and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, dt))
        size += n
    if len(shards) == 1 and not max_shard_bytes:
        files = [SAFETENSORS_SINGLE]
    else:
        files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]

    def tensors():  # (name, array) in file order, one layer slice materialised at a time
        by_leaf = dict(zip(paths, leaves))
        for path, j, v, ents in plan:
            leaf = by_leaf[path]
            arrs = v.save(np.asarray(leaf if j is None else leaf[j]))
            for (name, shape, dt), a in zip(ents, arrs):
                a = np.ascontiguousarray(a, dtype=_ST_DTYPES[dt])
                if a.shape != shape:
                    raise AssertionError(f"{name}: produced {a.shape}, planned {shape}")
                yield name, a
        if vision_stream is not None:
            for name, a in vision_stream():
                yield name, np.ascontiguousarray(a)

    stream = tensors()
    weight_map = {}
    with tqdm(total=len(entries), desc="writing tensors", unit="tensor", disable=not progress) as bar:
        for fn, shard in zip(files, shards):
            header, off = {"__metadata__": {"format": "pt"}}, 0
            for name, shape, dt in shard:
                n = _nbytes(shape, dt)
                header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
                off += n
                weight_map[name] = fn
            hb = json.dumps(header, separators=(",", ":")).encode()
            hb += b" " * (-len(hb) % 8)
            with open(os.path.join(directory, fn), "wb") as f:
                f.write(len(hb).to_bytes(8, "little"))
                f.write(hb)
                for name, shape, dt in shard:
                    got, a = next(stream)
                    assert got == name, (got, name)
                    f.write(a.reshape(-1).view(np.uint8).data)
                    bar.update(1)
    if len(files) > 1 or max_shard_bytes:
        total = sum(_nbytes(s, d) for _, s, d in entries)
        with open(os.path.join(directory, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    stale = os.path.join(directory, SAFETENSORS_SINGLE if len(files) > 1 or max_shard_bytes else SAFETENSORS_INDEX)
    if os.path.exists(stale):
        os.remove(stale)
    hf = to_hf_dict(cfg)
    if mxfp4_experts:
        q = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "float", "group_size": MXFP4_GROUP, "strategy": "group"}}},
             "ignore": ["lm_head", "re:.*shared_experts.*", "re:.*self_attn.*", "re:.*gate$",
                        "re:.*routed_expert_(down|up)_proj$"]}
        hf["quantization_config"] = q
        if "text_config" in hf:
            hf["text_config"]["quantization_config"] = q
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
