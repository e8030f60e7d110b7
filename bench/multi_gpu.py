"""Multi-GPU run of the sharded model and engine (issue [multi-gpu-run]): correctness on several
meshes, TP scaling with a compute / collective split from a profile, and a K3-shaped 4-layer slice
at full width. Made to finish in ONE device call on nvidia-h200-x8 (< 9 minutes):

    JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 python3 bench/multi_gpu.py --out $OUT/multi_gpu.json

CPU check of every code path (8 host devices, k3-tiny, tiny shapes):

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 PJRT_NPROC=32 \\
        python bench/multi_gpu.py --quick --out bench/results/multi_gpu_cpu_check.json

Sections (`--sections`, default all three, in this order):

1. correctness: greedy tokens of the engine (`LLM(model, mesh=SPEC)`, one decode and one mixed
   bucket) for every `--meshes` spec against the single-device engine, and the full-prompt logits
   of the sharded forward against the single-device forward (relative max error <= --logits-rtol).
2. scaling: decode steps at every `--decode-batch` (each sequence at `--context` tokens) and a
   prefill step of `--prefill-tokens` tokens (sequences of `--prefill-seq-len`) for every `--tp`;
   tp=1 is the plain single-device step, tp>1 the sharded step (`make_sharded_step`). Step time
   = mean of `--iters` back-to-back steps after a warm call; then `--profile-steps` steps under
   `jax.profiler.trace`, whose device events are split into collectives (HLO opcode all-reduce /
   all-gather / reduce-scatter / all-to-all / collective-permute, or an NCCL kernel) and the rest.
   Weak scaling: step time of tp=1 at batch B/tp over step time of tp at batch B (same work per
   device); `--weak-base-batch` (default max batch / max tp) adds that tp=1 shape.
3. slice: one 4-layer group of K3 at full width (preset "k3": 3 KDA + 1 MLA layer, 96 heads,
   LatentMoE 896 experts top-16, bf16, random weights computed shard by shard) on `--slice-mesh`
   tp=8 with the experts expert-parallel over the same 8 devices (ep=8: `Rules(experts="tp",
   expert_ffn=None)`). Decode at `--slice-batch` 256: step time, per-layer-type device time from
   the profile, and achieved HBM bandwidth = bytes a step must move per device (weights touched,
   KDA state read + written, MLA KV read) / time, as a fraction of `--hbm-gbps` and of a measured
   copy. Variant "dense" (num_experts=0: K3's dense FFN, intermediate 33792) times the KDA / MLA
   layers even when the MoE variant is skipped: before running, XLA's cost analysis of the compiled
   step predicts its time, and a step predicted over `--slice-max-step-s` is not run (XLA on NVIDIA
   expands `ragged_dot` into a dense dot over every local expert: E_local x the FLOPs).

Model: `--model` (default k3-mini) with `--heads` KDA and MLA heads (default: rounded up to a multiple
of the largest tp: 12 -> 16 for k3-mini, 4 -> 8 for k3-tiny; 12 heads do not shard over tp=8),
random weights (`init_params`, seeded). Compiles: every step shape is lowered and compiled up front
in `--compile-workers` threads (XLA compiles outside the GIL); only the main thread runs device
programs (two threads launching collectives on shared devices can deadlock). The engine's steps are
compiled ahead with the very arguments its warm-up uses, so its warm-up finds them in jit's cache.
`--budget-s` bounds the whole run: rows that would not fit are skipped and say so; the JSON is
rewritten after every row, so a killed run still leaves its results.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

T_START = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QUICK = dict(model="k3-tiny", prompts=4, prompt_len=[8, 40], max_new_tokens=8, logits_len=32, decode_batch=[4, 8],
             context=48, prefill_tokens=256, prefill_seq_len=128, iters=2, prefill_iters=1, profile_steps=1,
             slice_scale=16, slice_batch=8, slice_context=48, page_size=16, compile_workers=2, budget_s=3600,
             copy_mb=64, slice_max_step_s=60.0)
FULL = dict(model="k3-mini", prompts=8, prompt_len=[16, 96], max_new_tokens=16, logits_len=64, decode_batch=[64, 256],
            context=1024, prefill_tokens=32768, prefill_seq_len=4096, iters=10, prefill_iters=3, profile_steps=3,
            slice_scale=1, slice_batch=256, slice_context=1024, page_size=64, compile_workers=8, budget_s=480,
            copy_mb=2048, slice_max_step_s=5.0)
SECTIONS = ("correctness", "scaling", "slice")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = lambda k: f"(default {FULL[k]}; --quick: {QUICK[k]})"
    g = ap.add_argument_group("run")
    g.add_argument("--quick", action="store_true", help="CPU check: k3-tiny, tiny shapes, slice at 1/16 width")
    g.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "multi_gpu.json"),
                   help="JSON output path (rewritten after every row)")
    g.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)} (default all)")
    g.add_argument("--budget-s", type=float, default=None,
                   help=f"wall-time budget of the whole run in seconds, from process start {d('budget_s')}")
    g.add_argument("--compile-workers", type=int, default=None,
                   help=f"threads compiling step shapes ahead {d('compile_workers')}")
    g.add_argument("--impl", default="auto", help="kernel choice: auto (Pallas on Hopper, XLA elsewhere), xla, pallas")
    g.add_argument("--no-xla-fallback", action="store_true",
                   help="do not retry a shape with impl=xla when it fails to compile or run with --impl")
    g.add_argument("--xla-ragged-dot-fusion", action="store_true",
                   help="set XLA_FLAGS --xla_gpu_experimental_use_ragged_dot_fusion=true (cuDNN grouped GEMM for "
                        "ragged_dot, needs cuDNN >= 9.22) for the whole process; off: XLA's dense expansion")
    g.add_argument("--seed", type=int, default=0, help="weight and prompt seed (default 0)")
    g.add_argument("--page-size", type=int, default=None, help=f"KV page size of the step benchmarks {d('page_size')}")
    g = ap.add_argument_group("model")
    g.add_argument("--model", default=None, help=f"preset {d('model')}")
    g.add_argument("--heads", type=int, default=0,
                   help="KDA and MLA heads (0: the preset's, rounded up to a multiple of the largest tp used)")
    g = ap.add_argument_group("1. correctness")
    g.add_argument("--meshes", nargs="*", default=["tp=8", "tp=4,ep=2", "dp=2,tp=4"],
                   help="mesh specs compared with one device (default: tp=8, tp=4,ep=2, dp=2,tp=4)")
    g.add_argument("--prompts", type=int, default=None, help=f"greedy prompts (random token ids) {d('prompts')}")
    g.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help=f"prompt length range {d('prompt_len')}")
    g.add_argument("--max-new-tokens", type=int, default=None, help=f"greedy tokens per prompt {d('max_new_tokens')}")
    g.add_argument("--logits-len", type=int, default=None, help=f"prompt length of the logits check {d('logits_len')}")
    g.add_argument("--logits-rtol", type=float, default=2.0**-5,
                   help="pass: max |logits - single-device logits| <= rtol * max |single-device logits| "
                        "(default 2^-5: a few bf16 ulps of the largest logit)")
    g = ap.add_argument_group("2. scaling")
    g.add_argument("--tp", type=int, nargs="*", default=[1, 2, 4, 8], help="tensor-parallel sizes (default 1 2 4 8)")
    g.add_argument("--decode-batch", type=int, nargs="*", default=None, help=f"decode batches {d('decode_batch')}")
    g.add_argument("--context", type=int, default=None, help=f"tokens in context per decoding sequence {d('context')}")
    g.add_argument("--prefill-tokens", type=int, default=None, help=f"tokens of the prefill step {d('prefill_tokens')}")
    g.add_argument("--prefill-seq-len", type=int, default=None,
                   help=f"prefill sequence length (the step packs prefill-tokens / this sequences; the XLA MLA "
                        f"path materialises [chunks, 64, heads, seq] f32 scores, so 1 x 32k does not fit at tp=1) "
                        f"{d('prefill_seq_len')}")
    g.add_argument("--weak-base-batch", type=int, default=None,
                   help="extra tp=1 decode batch for weak scaling (default: max decode batch / max tp)")
    g.add_argument("--iters", type=int, default=None, help=f"timed decode steps per row {d('iters')}")
    g.add_argument("--prefill-iters", type=int, default=None, help=f"timed prefill steps per row {d('prefill_iters')}")
    g.add_argument("--profile-steps", type=int, default=None,
                   help=f"steps under the profiler per row, 0: no profile {d('profile_steps')}")
    g = ap.add_argument_group("3. K3 slice")
    g.add_argument("--slice-mesh", default="tp=8", help="mesh of the slice (default tp=8)")
    g.add_argument("--slice-expert-axis", default="tp", choices=("tp", "ep"),
                   help="tp (default): experts expert-parallel over the tp devices (ep=8 on the same 8 GPUs), "
                        "expert intermediate unsharded; ep: the default rules (experts on ep, intermediate on tp)")
    g.add_argument("--slice-variants", default="moe,dense",
                   help="comma list: moe (K3's LatentMoE layers), dense (num_experts=0: K3's dense FFN)")
    g.add_argument("--slice-scale", type=int, default=None,
                   help=f"divide heads, experts, hidden, latent, FFN widths and vocab by this (1: full K3 width) "
                        f"{d('slice_scale')}")
    g.add_argument("--slice-batch", type=int, default=None, help=f"decode batch of the slice {d('slice_batch')}")
    g.add_argument("--slice-context", type=int, default=None, help=f"context per sequence {d('slice_context')}")
    g.add_argument("--slice-max-step-s", type=float, default=None,
                   help=f"do not run a slice step predicted (XLA cost analysis) slower than this "
                        f"{d('slice_max_step_s')}")
    g.add_argument("--hbm-gbps", type=float, default=4800.0, help="peak HBM bandwidth per device (default H200: 4800)")
    g.add_argument("--peak-tflops", type=float, default=790.0,
                   help="dense bf16 rate for the step-time prediction (default 790: measured 8k^3 matmul on H200)")
    g.add_argument("--copy-mb", type=int, default=None, help=f"array size of the copy benchmark, 0: skip {d('copy_mb')}")
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.sections = [s for s in args.sections.split(",") if s]
    bad = set(args.sections) - set(SECTIONS)
    if bad:
        ap.error(f"unknown section(s) {sorted(bad)}; choose from {SECTIONS}")
    args.slice_variants = [s for s in args.slice_variants.split(",") if s]
    if set(args.slice_variants) - {"moe", "dense"}:
        ap.error("--slice-variants takes moe and/or dense")
    if args.weak_base_batch is None and args.decode_batch and args.tp:
        args.weak_base_batch = max(1, max(args.decode_batch) // max(args.tp))
    return args


ARGS = parse_args() if __name__ == "__main__" else None

# ---- environment, before JAX starts -----------------------------------------------------------
if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
    os.environ.setdefault("PJRT_NPROC", "32")  # XLA:CPU pools; the default deadlocks sharded steps on 2 cores
    if ARGS is not None and ARGS.quick and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
if ARGS is not None and ARGS.xla_ragged_dot_fusion:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_experimental_use_ragged_dot_fusion=true").strip()

import collections  # noqa: E402
import concurrent.futures as cf  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench._common import run_meta, write_json  # noqa: E402
from bench.k3_mini_h200 import classify, hlo_scopes  # noqa: E402
from k3jax.api import Model  # noqa: E402
from k3jax.config import ModelConfig, preset  # noqa: E402
from k3jax.engine.engine import LLM  # noqa: E402
from k3jax.engine.runner import SeqWork, engine_step, pack_step  # noqa: E402
from k3jax.model.forward import step as plain_step  # noqa: E402
from k3jax.model.init import init_params, param_shapes  # noqa: E402
from k3jax.sampling import SamplingParams  # noqa: E402
from k3jax.state import StateOps, init_state, state_shapes  # noqa: E402
from k3jax.tokenizer import load_tokenizer  # noqa: E402
from sharding.mesh import make_mesh, mesh_sizes, parse_mesh_spec  # noqa: E402
from sharding.rules import Rules, check_divisible, param_specs, shard_factor  # noqa: E402
from sharding.step import make_sharded_step  # noqa: E402


# ---- small helpers ----------------------------------------------------------------------------

def now() -> float:
    return time.time() - T_START


class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - now()


def short_err(e: BaseException, n: int = 500) -> str:
    return f"{type(e).__name__}: {e}"[:n]


def sds_tree(tree):
    """ShapeDtypeStructs (no sharding) of a tree of arrays / structs: enough to lower a step whose
    jit fixes every input sharding."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def with_heads(cfg: ModelConfig, heads: int) -> ModelConfig:
    if heads in (cfg.kda_num_heads, 0) and heads in (cfg.mla_num_heads, 0):
        return cfg
    return cfg.replace(name=f"{cfg.name}/h{heads}", kda_num_heads=heads, mla_num_heads=heads)


def mesh_devices(spec: str) -> int:
    s = parse_mesh_spec(spec)
    return s["dp"] * s["tp"] * s["ep"]


def decode_inputs(cfg, B: int, ctx: int, ps: int):
    """(slots, pages, batch) of B sequences decoding one token each with ctx tokens in context."""
    n_pages = -(-(ctx + 1) // ps)
    works = [SeqWork([7 + i % 50], ctx, i + 1, list(range(1 + i * n_pages, 1 + (i + 1) * n_pages))) for i in range(B)]
    return B + 1, B * n_pages + 1, pack_step(works, [], D=B, P=0, NP=0, pages_per_seq=n_pages).batch


def prefill_inputs(cfg, tokens: int, seq_len: int, ps: int, seed: int):
    """(slots, pages, batch) of tokens // seq_len fresh sequences of seq_len tokens, one logit row each."""
    n = max(1, tokens // seq_len)
    n_pages = -(-seq_len // ps)
    rng = np.random.default_rng(seed)
    works = [SeqWork(rng.integers(0, cfg.vocab_size, seq_len).tolist(), 0, i + 1,
                     list(range(1 + i * n_pages, 1 + (i + 1) * n_pages))) for i in range(n)]
    P = -(-n * seq_len // 64) * 64
    return n + 1, n * n_pages + 1, pack_step([], works, D=0, P=P, NP=n, pages_per_seq=n_pages).batch


def logits_inputs(ids, ps: int):
    """(slots, pages, batch, rows) of one fresh sequence with a logit row per token (as Model.logits)."""
    T = len(ids)
    n_pages = -(-T // ps)
    work = SeqWork(tokens=list(ids), start=0, slot=1, pages=list(range(1, n_pages + 1)), all_logits=True)
    P = -(-T // 64) * 64
    packed = pack_step([], [work], D=0, P=P, NP=1, pages_per_seq=n_pages, R=P)
    return 2, n_pages + 1, packed.batch, packed.rows[0]


# ---- a compiled step on one device or a mesh ----------------------------------------------------

class Step:
    """One step shape compiled for a mesh (tp=1 / mesh None: the plain single-device step).

    `compile()` only lowers and compiles (safe in a worker thread); `new_state()` and `__call__`
    run device programs (main thread only). The state is donated and threaded by the caller."""

    def __init__(self, cfg, mesh_spec, impl, slots, pages, ps, batch, rules=None):
        self.cfg, self.mesh_spec, self.impl, self.rules = cfg, mesh_spec, impl, rules
        self.slots, self.pages, self.ps, self.batch = slots, pages, ps, batch
        self.sharded = None if mesh_spec is None else make_sharded_step(cfg, mesh_spec, rules, impl)
        self.compiled = None
        self.compile_s = None

    def with_impl(self, impl):
        return Step(self.cfg, self.mesh_spec, impl, self.slots, self.pages, self.ps, self.batch, self.rules)

    def compile(self, params_like):
        t = time.perf_counter()
        st = state_shapes(self.cfg, self.slots, self.pages, self.ps)
        if self.sharded is None:
            dev = jax.devices()[0]
            sh = jax.sharding.SingleDeviceSharding(dev)
            put = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
            low = plain_step.lower(jax.tree_util.tree_map(put, params_like), jax.tree_util.tree_map(put, st),
                                   jax.tree_util.tree_map(put, sds_tree(self.batch)), cfg=self.cfg, impl=self.impl)
        else:
            low = self.sharded.jitted.lower(sds_tree(params_like), st, (sds_tree(self.batch),))
        self.compiled = low.compile()
        self.compile_s = time.perf_counter() - t
        return self

    def new_state(self):
        if self.sharded is None:
            return init_state(self.cfg, self.slots, self.pages, self.ps)
        return self.sharded.init_state(self.slots, self.pages, self.ps)

    def place_inputs(self):
        if self.sharded is None:
            return jax.device_put(self.batch, jax.devices()[0])
        return self.sharded.replicate((self.batch,))

    def runner(self, params):
        """-> run() doing one step (state threaded inside); `run.state` holds the current state."""
        inputs = self.place_inputs()
        box = {"s": self.new_state()}
        compiled = self.compiled

        def run():
            out, box["s"] = compiled(params, box["s"], inputs)
            return out

        run.box = box
        return run

    def hlo_text(self) -> str:
        try:
            return self.compiled.as_text()
        except Exception:  # noqa: BLE001
            return ""

    def cost(self) -> dict:
        try:
            c = self.compiled.cost_analysis()
            c = c[0] if isinstance(c, (list, tuple)) else c
            return {"flops": float(c.get("flops", 0.0)), "bytes_accessed": float(c.get("bytes accessed", 0.0))}
        except Exception as e:  # noqa: BLE001
            return {"error": short_err(e, 200)}


def package_versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12",
                 "nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def timed(run, n: int) -> float:
    """Mean seconds per step of n back-to-back steps (one block at the end)."""
    t = time.perf_counter()
    out = None
    for _ in range(n):
        out = run()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


# ---- profile: collectives vs compute, per layer type ------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*->.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|async_execution_thread_calls)=%?([\w.\-]+)")


def _opcode(rhs: str) -> str:
    s = rhs.lstrip()
    if s.startswith("("):  # tuple-shaped result
        depth = 0
        for i, ch in enumerate(s):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                s = s[i + 1:]
                break
    else:
        s = s.split(" ", 1)[1] if " " in s else ""
    m = re.match(r"\s*([a-z][\w\-]*)\(", s)
    return m.group(1) if m else ""


def _coll_base(opcode: str) -> str | None:
    base = re.sub(r"-(start|done|update)$", "", opcode)
    return base if base in COLLECTIVES else None


def hlo_collectives(hlo_text: str) -> dict[str, str]:
    """Instruction name -> collective kind ("all-reduce", ...) for every collective instruction of the
    compiled module, including async wrappers and fusions whose called computation holds one."""
    comp_ops: dict[str, list[str]] = collections.defaultdict(list)
    inst: dict[str, tuple[str, list[str]]] = {}
    comp = None
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m and not line.rstrip().endswith("{"):
            name, rhs = m.group(1), m.group(2)
            op = _opcode(rhs)
            inst[name] = (op, _CALLS.findall(rhs))
            if comp is not None:
                comp_ops[comp].append(op)
            continue
        m = _COMP.match(line)
        if m:
            comp = m.group(1)
    out = {}
    for name, (op, calls) in inst.items():
        base = _coll_base(op)
        if base is None and op in ("async-start", "async-done", "async-update", "fusion"):
            for c in calls:
                for o in comp_ops.get(c, []):
                    base = base or _coll_base(o)
        if base:
            out[name] = base
    return out


_DERIVED = {"XLA Ops", "XLA Modules", "Steps", "TensorFlow Ops", "TensorFlow Name Scope", "Framework Name Scope",
            "Framework Ops", "Source code", "Launch Stats", "XLA TraceMe", "Host Threads"}


def _union(iv) -> float:
    tot, end = 0.0, -math.inf
    for a, b in sorted(iv):
        if b <= end:
            continue
        tot += b - max(a, end)
        end = b
    return tot


def parse_trace(events, hlo_text: str, steps: int) -> dict:
    """Device events of a perfetto trace -> per-step compute / collective split (mean over devices)
    and device time per layer type. GPU: kernel and memcpy events on the stream lines of each
    /device:GPU:N process (their `hlo_op` names the HLO instruction). CPU: the XLA thunk events
    (`hlo_op` and `device_ordinal` in their args)."""
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu_pid = {p: int(m.group(1)) for p, n in procs.items() if (m := re.search(r"/device:GPU:(\d+)", n))}
    stream_tids = {(p, t) for (p, t), n in threads.items() if p in gpu_pid and "stream" in n.lower()}
    derived = {(p, t) for (p, t), n in threads.items() if p in gpu_pid and (p, t) not in stream_tids}
    pids_with_streams = {p for p, _ in stream_tids}
    lines_used = sorted({threads[k] for k in stream_tids})[:8]
    lines_dropped = sorted({threads[k] for k in derived})[:8]
    colls = hlo_collectives(hlo_text)
    scopes = hlo_scopes(hlo_text) if hlo_text else {}
    per_dev = collections.defaultdict(lambda: {"all": [], "comp": [], "coll_ms": 0.0, "comp_ms": 0.0, "memcpy_ms": 0.0,
                                                "by_coll": collections.Counter(), "by_type": collections.Counter(),
                                                "by_type_coll": collections.Counter(), "unmatched": 0.0,
                                                "no_hlo_op": 0.0})
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        pid = e.get("pid")
        if pid in gpu_pid:
            if pid in pids_with_streams and (pid, e.get("tid")) not in stream_tids:
                continue  # derived lines ("XLA Ops", "XLA Modules", ...) repeat the kernels
            if pid not in pids_with_streams and threads.get((pid, e.get("tid")), "") in _DERIVED:
                continue
            dev = f"gpu:{gpu_pid[pid]}"
        elif "hlo_op" in args and "device_ordinal" in args:
            dev = f"cpu:{args['device_ordinal']}"
        else:
            continue
        name = e.get("name", "")
        op = args.get("hlo_op") or ""
        ts, dur = float(e["ts"]), float(e["dur"])
        d = per_dev[dev]
        d["all"].append((ts, ts + dur))
        base = colls.get(op) or _coll_base(name) or ("nccl" if "nccl" in name.lower() else None)
        kind, _ = classify(scopes.get(op, "")) if op in scopes else ("other", "")
        if op and op not in scopes:
            d["unmatched"] += dur
        d["by_type"][kind] += dur
        if not op:
            d["no_hlo_op"] += dur
        if base:
            d["coll_ms"] += dur
            d["by_coll"][base] += dur
            d["by_type_coll"][kind] += dur
        else:
            d["comp"].append((ts, ts + dur))
            d["comp_ms"] += dur
            if name.lower().startswith(("memcpy", "memset")):
                d["memcpy_ms"] += dur
    if not per_dev:
        return {"error": "no device events in the trace", "processes": sorted(procs.values())[:20]}
    k = 1e-3 / steps  # us -> ms per step
    n = len(per_dev)
    mean = lambda f: sum(f(d) for d in per_dev.values()) * k / n
    types = sorted({t for d in per_dev.values() for t in d["by_type"]})
    out = {
        "method": "jax.profiler perfetto trace; device events (GPU: stream lines; CPU: XLA thunks) summed per device "
                  "and step, mean over devices; collective = HLO collective opcode (incl. async / fused) or NCCL "
                  "kernel; exposed collective = busy time not covered by compute",
        "devices": n, "steps": steps,
        "kernel_ms": mean(lambda d: d["coll_ms"] + d["comp_ms"]),
        "compute_ms": mean(lambda d: d["comp_ms"]),
        "collective_ms": mean(lambda d: d["coll_ms"]),
        "memcpy_ms": mean(lambda d: d["memcpy_ms"]),
        "busy_ms": mean(lambda d: _union(d["all"])),
        "compute_busy_ms": mean(lambda d: _union(d["comp"])),
        "exposed_collective_ms": mean(lambda d: _union(d["all"]) - _union(d["comp"])),
        "unmatched_ms": mean(lambda d: d["unmatched"]),
        "no_hlo_op_ms": mean(lambda d: d["no_hlo_op"]),
        "trace_lines": {"used": lines_used, "dropped": lines_dropped},
        "collective_by_op_ms": {c: mean(lambda d, c=c: d["by_coll"][c])
                                for c in sorted({c for d in per_dev.values() for c in d["by_coll"]})},
        "by_layer_type_ms": {t: {"total": mean(lambda d, t=t: d["by_type"][t]),
                                 "collective": mean(lambda d, t=t: d["by_type_coll"][t])} for t in types},
        "per_device_kernel_ms": {dv: round((d["coll_ms"] + d["comp_ms"]) * k, 4) for dv, d in sorted(per_dev.items())},
    }
    out["collective_frac"] = out["collective_ms"] / out["kernel_ms"] if out["kernel_ms"] else 0.0
    return out


PROFILE_LOCK = threading.Lock()


def profile(run, hlo_text: str, steps: int) -> dict:
    d = tempfile.mkdtemp(prefix="k3mg")
    try:
        with PROFILE_LOCK:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                out = None
                for _ in range(steps):
                    out = run()
                jax.block_until_ready(out)
        paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            return {"error": "no perfetto trace written"}
        tr = json.load(gzip.open(paths[0]))
        events = tr["traceEvents"] if isinstance(tr, dict) else tr
        return parse_trace(events, hlo_text, steps)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- the run ----------------------------------------------------------------------------------

class Run:
    def __init__(self, args):
        self.args = args
        self.budget = Budget(args.budget_s)
        self.devices = jax.devices()
        self.res = {"bench": "multi_gpu", **run_meta(), "devices": [str(d) for d in self.devices],
                    "device_count": len(self.devices), "args": {k: v for k, v in vars(args).items()},
                    "xla_flags": os.environ.get("XLA_FLAGS", ""), "compile": [], "skipped": [], "errors": []}
        self.res["packages"] = package_versions()
        self.pool = cf.ThreadPoolExecutor(max_workers=max(1, args.compile_workers), thread_name_prefix="compile")
        self.bar = tqdm(total=0, desc="multi_gpu", file=sys.stderr, mininterval=2.0, dynamic_ncols=True)
        self.jobs: dict[str, cf.Future] = {}
        self._lock = threading.Lock()
        base = preset(args.model)
        max_tp = max([parse_mesh_spec(m)["tp"] for m in args.meshes] + list(args.tp) + [1])
        heads = args.heads or -(-max(base.kda_num_heads, base.mla_num_heads) // max_tp) * max_tp
        self.cfg = with_heads(base, heads)
        self.res["model"] = {"preset": args.model, "name": self.cfg.name, "dtype": self.cfg.dtype,
                             "kda_heads": self.cfg.kda_num_heads, "mla_heads": self.cfg.mla_num_heads,
                             "preset_heads": [base.kda_num_heads, base.mla_num_heads], "layers": self.cfg.num_layers,
                             "experts": self.cfg.num_experts, "top_k": self.cfg.num_experts_per_token,
                             "note": ("heads raised so that every tp divides them" if self.cfg is not base else "")}
        self.params_ref = None
        self.placed: dict[str, object] = {}

    # -- bookkeeping
    def save(self):
        self.res["elapsed_s"] = round(now(), 1)
        write_json(self.args.out, self.res)

    def skip(self, what: str, why: str):
        self.res["skipped"].append({"what": what, "why": why})
        tqdm.write(f"skip {what}: {why}", file=sys.stderr)

    def error(self, what: str, e: BaseException):
        self.res["errors"].append({"what": what, "error": short_err(e, 800)})
        tqdm.write(f"error {what}: {short_err(e, 300)}", file=sys.stderr)
        traceback.print_exc()

    def submit(self, key: str, fn):
        """Compile in a worker thread; the future's result is fn()'s (or the exception)."""
        self.bar.total += 1
        self.bar.refresh()

        def job():
            t = time.perf_counter()
            try:
                return fn()
            finally:
                with self._lock:
                    self.res["compile"].append({"job": key, "s": round(time.perf_counter() - t, 2),
                                                "done_at_s": round(now(), 1)})
                self.bar.update()
                self.bar.set_postfix_str(f"compiled {key}"[:60])

        self.jobs[key] = self.pool.submit(job)
        return self.jobs[key]

    def wait(self, key: str):
        """The job's result; raises its exception, or TimeoutError when the budget runs out first."""
        return self.jobs[key].result(timeout=max(self.budget.left(), 0.01))

    def unit(self, n: int = 1):
        self.bar.total += n
        self.bar.refresh()

    def compile_step(self, key, step: "Step", params_like):
        """Submit step.compile; with impl != xla a failure is retried with impl=xla (unless disabled)."""
        fallback = not self.args.no_xla_fallback and step.impl != "xla"

        def fn():
            try:
                return step.compile(params_like)
            except Exception as e:  # noqa: BLE001
                if not fallback:
                    raise
                self.res["errors"].append({"what": f"compile {key} impl={step.impl}", "error": short_err(e, 800),
                                           "retried_with": "xla"})
                return step.with_impl("xla").compile(params_like)

        return self.submit(key, fn)

    def params_on(self, spec):
        if spec is None:
            return self.params_ref
        if spec not in self.placed:
            self.placed[spec] = make_sharded_step(self.cfg, spec, impl=self.args.impl).shard_params(self.params_ref)
        return self.placed[spec]

    def fits(self, spec: str) -> str | None:
        need = mesh_devices(spec)
        if need > len(self.devices):
            return f"needs {need} devices, {len(self.devices)} present"
        try:
            check_divisible(self.cfg, parse_mesh_spec(spec))
        except ValueError as e:
            return str(e)
        return None

    # ---- 0. copy bandwidth (before any compile uses the devices) ---------------------------------
    def copy_bench(self):
        mb = self.args.copy_mb
        if not mb:
            return None
        try:
            n = mb * 2**20 // 2
            x = jnp.zeros((n,), jnp.bfloat16)
            f = jax.jit(lambda a: a + jnp.bfloat16(1))
            jax.block_until_ready(f(x))
            reps = 5
            t = time.perf_counter()
            for _ in range(reps):
                x = f(x)
            jax.block_until_ready(x)
            dt = (time.perf_counter() - t) / reps
            gbps = 2 * n * 2 / dt / 1e9
            self.res["copy_GBps"] = gbps
            del x
            return gbps
        except Exception as e:  # noqa: BLE001
            self.error("copy bench", e)
            return None

    # ---- 1. correctness ---------------------------------------------------------------------------
    def plan_correctness(self):
        a = self.args
        cfg = self.cfg
        rng = np.random.default_rng(a.seed + 1)
        hi = min(cfg.vocab_size, 256)  # byte-range ids: every preset's tokenizer can print them
        self.prompts = [rng.integers(0, hi, int(rng.integers(a.prompt_len[0], a.prompt_len[1] + 1))).tolist()
                        for _ in range(a.prompts)]
        self.logit_ids = rng.integers(0, cfg.vocab_size, a.logits_len).tolist()
        chunk = max(64, -(-max(len(p) for p in self.prompts) // 64) * 64)
        max_len = max(len(p) for p in self.prompts) + a.max_new_tokens
        self.engine_kw = dict(page_size=16, single_bucket=True, max_running=a.prompts, prefill_chunk=chunk,
                              max_prefill_seqs=min(4, a.prompts), max_seq_len=max_len, impl=a.impl)
        self.corr = []
        tok = load_tokenizer(None, cfg)
        for spec in [None] + list(a.meshes):
            label = spec or "single"
            why = self.fits(spec) if spec else None
            if why:
                self.skip(f"correctness {label}", why)
                continue
            entry = {"mesh": label, "spec": spec}
            try:
                mesh = make_mesh(spec) if spec else None
                model = Model(config=cfg, params=self.params_on(spec), tokenizer=tok, impl=a.impl, mesh=mesh)
                entry["llm"] = LLM(model, mesh=spec, **self.engine_kw)
                for i, fn in enumerate(self._engine_lowerings(entry["llm"])):
                    self.submit(f"correctness/{label}/engine{i}", fn)
                slots, pages, batch, rows = logits_inputs(self.logit_ids, 64)
                entry["logits_rows"] = rows
                entry["logits_step"] = Step(cfg, spec, a.impl, slots, pages, 64, batch)
                self.compile_step(f"correctness/{label}/logits", entry["logits_step"], self.params_on(spec))
                self.unit()
            except Exception as e:  # noqa: BLE001
                self.error(f"correctness {label}: setup", e)
                continue
            self.corr.append(entry)

    @staticmethod
    def _engine_lowerings(llm):
        """Lower + compile the engine's step for each of its buckets with the arguments its warm-up
        passes (runner.warmup), so the warm-up finds them in jit's cache (main thread: the sharded
        inputs are placed here; the returned functions only lower and compile)."""
        r = llm.core.runner
        fns = []
        for D, P in r.buckets.shapes():
            NP = r.buckets.max_prefill_seqs if P else 0
            packed = pack_step([], [], D=D, P=P, NP=NP, pages_per_seq=r.buckets.pages_per_seq, block=r.spec_block)
            z = np.zeros(D + NP, np.int32)
            ops = StateOps(z, z)
            if r.sharded is not None:  # placed here as the call places them: lowering with host arrays or
                # ShapeDtypeStructs gives another jit cache key, and the warm-up would compile again
                inputs = r.sharded.replicate((packed.batch, ops, r.prev))
                fns.append(lambda x=inputs: r.sharded.jitted.lower(r.params, r.state, x).compile())
            else:
                fns.append(lambda b=packed.batch, o=ops: engine_step.lower(
                    r.params, r.state, b, o, r.prev, r.cfg, r.impl).compile())
        return fns

    def run_correctness(self):
        a = self.args
        sec = {"reference": "single device (mesh None)", "model": self.cfg.name, "prompts": len(self.prompts),
               "prompt_lens": [len(p) for p in self.prompts], "max_new_tokens": a.max_new_tokens,
               "logits_len": a.logits_len, "logits_rtol": a.logits_rtol, "engine": {k: v for k, v in self.engine_kw.items()},
               "meshes": []}
        self.res["correctness"] = sec
        ref_tokens = ref_logits = None
        sp = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.0)
        for entry in self.corr:
            label = entry["mesh"]
            row = {"mesh": label}
            sec["meshes"].append(row)
            if self.budget.left() < 20:
                self.skip(f"correctness {label}", "time budget")
                row["skipped"] = "time budget"
                continue
            llm = entry.pop("llm")
            try:
                for k in [k for k in self.jobs if k.startswith(f"correctness/{label}/engine")]:
                    try:
                        self.wait(k)
                    except cf.TimeoutError:
                        raise
                    except Exception as e:  # noqa: BLE001  (warm-up below compiles it again, or fails for real)
                        row.setdefault("aot_errors", []).append(short_err(e, 300))
                t = time.perf_counter()
                llm.core.warmup()
                row["warmup_s"] = round(time.perf_counter() - t, 2)
                t = time.perf_counter()
                outs = llm.generate(self.prompts, sp)
                row["generate_s"] = round(time.perf_counter() - t, 2)
                toks = [list(o.token_ids) for o in outs]
                row["impl"] = llm.config.impl
            except Exception as e:  # noqa: BLE001
                row["error"] = short_err(e)
                self.error(f"correctness {label}: engine", e)
                toks = None
                if a.impl != "xla" and not a.no_xla_fallback and self.budget.left() > 60:
                    try:  # the engine again with the XLA kernels (compiles in this thread)
                        kw = dict(self.engine_kw, impl="xla")
                        llm = LLM(llm.model, mesh=entry["spec"], **kw)
                        outs = llm.generate(self.prompts, sp)
                        toks = [list(o.token_ids) for o in outs]
                        row["impl"] = "xla (fallback)"
                    except Exception as e2:  # noqa: BLE001
                        self.error(f"correctness {label}: engine xla fallback", e2)
            del llm
            if toks is not None:
                if entry["spec"] is None:
                    ref_tokens = toks
                    row["tokens"] = toks
                elif ref_tokens is not None:
                    mism = []
                    for i, (x, y) in enumerate(zip(ref_tokens, toks)):
                        if x != y:
                            first = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                            mism.append({"prompt": i, "first_diff": first, "ref": x[first:first + 4],
                                         "got": y[first:first + 4], "ref_len": len(x), "len": len(y)})
                    row["tokens_equal"] = not mism
                    row["mismatches"] = mism
            # logits
            try:
                st = self.wait(f"correctness/{label}/logits")
                run = st.runner(self.params_on(entry["spec"]))
                lg = np.asarray(run())[entry["logits_rows"]]
                row["logits_impl"] = st.impl
                if entry["spec"] is None:
                    ref_logits = lg
                elif ref_logits is not None:
                    diff = np.abs(lg - ref_logits)
                    scale = float(np.abs(ref_logits).max())
                    row["logits"] = {"max_abs_diff": float(diff.max()), "ref_max_abs": scale,
                                     "rel_max": float(diff.max()) / scale,
                                     "rel_rms": float(np.sqrt((diff**2).mean() / (ref_logits**2).mean())),
                                     "argmax_agree": float((lg.argmax(-1) == ref_logits.argmax(-1)).mean()),
                                     "pass": bool(diff.max() <= a.logits_rtol * scale)}
                del run
            except Exception as e:  # noqa: BLE001
                row["logits_error"] = short_err(e)
                self.error(f"correctness {label}: logits", e)
            self.bar.update()
            self.save()
        rows = [r for r in sec["meshes"] if r["mesh"] != "single"]
        sec["pass"] = bool(rows) and all(r.get("tokens_equal") and r.get("logits", {}).get("pass") for r in rows)
        self.corr = []
        self.save()

    # ---- 2. scaling ---------------------------------------------------------------------------------
    def plan_scaling(self):
        a = self.args
        self.scale_rows = []
        for tp in a.tp:
            spec = None if tp == 1 else f"tp={tp}"
            why = self.fits(spec) if spec else None
            if why:
                self.skip(f"scaling tp={tp}", why)
                continue
            shapes = [("prefill", a.prefill_tokens)] + [("decode", b) for b in a.decode_batch]
            if tp == 1 and a.weak_base_batch and a.weak_base_batch not in a.decode_batch:
                shapes.append(("decode", a.weak_base_batch))
            params = self.params_on(spec)
            for op, n in shapes:
                if op == "decode":
                    slots, pages, batch = decode_inputs(self.cfg, n, a.context, a.page_size)
                else:
                    slots, pages, batch = prefill_inputs(self.cfg, n, min(a.prefill_seq_len, n), a.page_size, a.seed)
                st = Step(self.cfg, spec, a.impl, slots, pages, a.page_size, batch)
                key = f"scaling/tp={tp}/{op}{n}"
                self.compile_step(key, st, params)
                self.unit()
                self.scale_rows.append({"key": key, "tp": tp, "spec": spec, "op": op, "n": n})

    def run_scaling(self, reserve_s: float):
        a = self.args
        sec = {"model": self.cfg.name, "context": a.context, "page_size": a.page_size,
               "prefill": {"tokens": a.prefill_tokens, "seq_len": min(a.prefill_seq_len, a.prefill_tokens)},
               "timing": "mean of back-to-back steps after a warm call (state donated and threaded)", "rows": []}
        self.res["scaling"] = sec
        for r in self.scale_rows:
            row = {"tp": r["tp"], "op": r["op"], ("batch" if r["op"] == "decode" else "tokens"): r["n"]}
            sec["rows"].append(row)
            if self.budget.left() < reserve_s + 10:
                row["skipped"] = "time budget"
                self.skip(r["key"], "time budget")
                self.bar.update()
                continue
            try:
                st = self.wait(r["key"])
                row["impl"], row["compile_s"] = st.impl, round(st.compile_s, 1)
                params = self.params_on(r["spec"])
                run = st.runner(params)
                t = time.perf_counter()
                jax.block_until_ready(run())
                row["first_call_s"] = round(time.perf_counter() - t, 3)
                one = timed(run, 1)
                left = self.budget.left() - reserve_s
                n_it = a.iters if r["op"] == "decode" else a.prefill_iters
                n_it = max(1, min(n_it, int(0.3 * left / max(one, 1e-6))))
                dt = timed(run, n_it)
                row.update(iters=n_it, step_ms=dt * 1e3,
                           tokens_per_s=(r["n"] if r["op"] == "decode" else st.batch.tokens.shape[0]) / dt)
                if r["op"] == "prefill":
                    row["tokens_per_s"] = r["n"] / dt
                self.save()
                if a.profile_steps and self.budget.left() - reserve_s > 15 + a.profile_steps * one * 3:
                    try:
                        row["profile"] = profile(run, st.hlo_text(), a.profile_steps)
                        p = row["profile"]
                        if "kernel_ms" in p:
                            row["split_ms"] = {"compute": p["compute_ms"], "collective": p["collective_ms"],
                                               "exposed_collective": p["exposed_collective_ms"],
                                               "idle": max(row["step_ms"] - p["busy_ms"], 0.0)}
                    except Exception as e:  # noqa: BLE001
                        row["profile_error"] = short_err(e)
                        self.error(f"{r['key']}: profile", e)
                del run
            except cf.TimeoutError:
                row["skipped"] = "not compiled within the time budget"
                self.skip(r["key"], row["skipped"])
            except Exception as e:  # noqa: BLE001
                row["error"] = short_err(e)
                self.error(r["key"], e)
            self.bar.update()
            self.save()
        self.scaling_summary(sec)
        self.save()

    def scaling_summary(self, sec):
        ms = {(r["tp"], r["op"], r.get("batch", r.get("tokens"))): r["step_ms"] for r in sec["rows"] if "step_ms" in r}
        weak, strong = [], []
        for (tp, op, n), t in sorted(ms.items()):
            if op != "decode" or tp == 1:
                continue
            if n % tp == 0 and (1, "decode", n // tp) in ms:
                base = ms[(1, "decode", n // tp)]
                weak.append({"tp": tp, "batch": n, "base_batch": n // tp, "efficiency": base / t})
        for (tp, op, n), t in sorted(ms.items()):
            if tp == 1 or (1, op, n) not in ms:
                continue
            base = ms[(1, op, n)]
            strong.append({"tp": tp, "op": op, "n": n, "speedup": base / t, "efficiency": base / t / tp})
        sec["weak_scaling"] = weak
        sec["strong_scaling"] = strong
        top = max(self.args.tp)
        best = [w for w in weak if w["tp"] == top and w["batch"] == max(self.args.decode_batch)]
        sec["weak_scaling_decode_top_tp"] = best[0] if best else None
        sec["weak_scaling_goal"] = 0.70

    # ---- 3. K3 slice --------------------------------------------------------------------------------
    def slice_config(self, variant: str) -> ModelConfig:
        s = self.args.slice_scale
        base = preset("k3")
        cfg = base.replace(name=f"k3-slice-{variant}" + (f"/{s}" if s > 1 else ""), num_layers=4,
                           full_attn_layers=(4,), first_k_dense_replace=0)
        if s > 1:
            m = 8

            def sc(v, mult=m):
                return max(mult, (v // s) // mult * mult)

            cfg = cfg.replace(kda_num_heads=sc(cfg.kda_num_heads), mla_num_heads=sc(cfg.mla_num_heads),
                              num_experts=sc(cfg.num_experts), hidden_size=sc(cfg.hidden_size, 64),
                              routed_expert_hidden_size=sc(cfg.routed_expert_hidden_size, 64),
                              moe_intermediate_size=sc(cfg.moe_intermediate_size, 64),
                              intermediate_size=sc(cfg.intermediate_size, 64), vocab_size=sc(cfg.vocab_size, 512),
                              q_lora_rank=sc(cfg.q_lora_rank, 64), kv_lora_rank=sc(cfg.kv_lora_rank, 64),
                              bos_token_id=None, eos_token_id=None, pad_token_id=None)
            cfg = cfg.replace(num_experts_per_token=min(cfg.num_experts_per_token, cfg.num_experts))
        if variant == "dense":
            cfg = cfg.replace(num_experts=0)
        return cfg

    def slice_rules(self) -> Rules:
        return Rules(experts="tp", expert_ffn=None) if self.args.slice_expert_axis == "tp" else Rules()

    def plan_slice(self):
        a = self.args
        self.slice_rows = []
        need = mesh_devices(a.slice_mesh)
        if need > len(self.devices):
            self.skip("slice", f"needs {need} devices, {len(self.devices)} present")
            return
        rules = self.slice_rules()
        for variant in a.slice_variants:
            cfg = self.slice_config(variant)
            try:
                check_divisible(cfg, parse_mesh_spec(a.slice_mesh), rules)
            except ValueError as e:
                self.skip(f"slice {variant}", str(e))
                continue
            slots, pages, batch = decode_inputs(cfg, a.slice_batch, a.slice_context, a.page_size)
            st = Step(cfg, a.slice_mesh, a.impl, slots, pages, a.page_size, batch, rules)
            key = f"slice/{variant}"
            self.compile_step(key, st, param_shapes(cfg))
            self.unit(2)
            self.slice_rows.append({"key": key, "variant": variant, "cfg": cfg})

    def init_slice_params(self, cfg, shardings, seed):
        """Random weights computed shard by shard with k3jax's init code (its shapes, scales and
        dtypes), but not its single flat normal draw (100s of GB at K3 width): small leaves get their
        own normal draw; a leaf of more than 2^26 elements reads a 2^20-entry normal table at a hash
        of each element's index (threefry's u64 counters would need ~8x the leaf as temporaries;
        this is one fused elementwise pass). Values only need to be random enough for timing."""
        from k3jax.model.init import _build, _Normals

        class LeafNormals(_Normals):
            def __init__(self, s):
                super().__init__(s, None)
                self.count = 0

            def take(self, shape):
                self.count += 1
                key = jax.random.fold_in(self.key, (1 << 20) + self.count)
                if math.prod(shape) <= 1 << 26:
                    return jax.random.normal(key, shape, jnp.float32)
                table = jax.random.normal(key, (1 << 20,), jnp.float32)
                lin = jnp.zeros(shape, jnp.uint32)
                stride = 1
                for d in reversed(range(len(shape))):
                    lin = lin + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % (1 << 32))
                    stride *= shape[d]
                h = (lin * jnp.uint32(0x9E3779B1) + jnp.uint32(self.count * 0x85EBCA6B % (1 << 32))) >> 12
                return table[h & jnp.uint32((1 << 20) - 1)]

        return jax.jit(lambda: _build(cfg, LeafNormals(seed)), out_shardings=shardings)()

    def slice_bytes(self, cfg, rules, B, ctx) -> dict:
        """Bytes one decode step must move per device, by layer type: weights (routed experts scaled by the
        expected fraction a batch of B touches under uniform routing), KDA state read + written, MLA KV
        read (latent replicated over tp) + written; activations left out."""
        sizes = mesh_sizes(make_mesh(self.args.slice_mesh))
        specs = jax.tree_util.tree_leaves_with_path(param_specs(cfg, rules),
                                                    is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        shapes = jax.tree_util.tree_leaves(param_shapes(cfg))
        out = collections.Counter()
        E, k = cfg.num_experts, cfg.num_experts_per_token
        touched = 1 - (1 - k / E) ** B if E else 1.0
        for (path, spec), leaf in zip(specs, shapes):
            name = ".".join(str(getattr(p, "name", getattr(p, "key", p))) for p in path)
            nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize / shard_factor(spec, sizes)
            top = name.split(".")[0]
            kind = {"kda": "kda", "mla": "mla", "moe": "moe", "dense": "dense", "lm_head": "lm_head"}.get(top, "other")
            if name in ("moe.w1", "moe.w2", "moe.w3"):
                nbytes *= touched
            if top == "embed":
                nbytes = B * cfg.hidden_size * np.dtype(leaf.dtype).itemsize
            out[kind] += nbytes
        hs = rules.size("kda_heads", sizes)
        dt = np.dtype(jnp.dtype(cfg.dtype)).itemsize
        Lk, Lm = cfg.num_kda_layers, cfg.num_mla_layers
        K = cfg.kda_head_dim
        out["kda"] += 2 * B * Lk * (cfg.kda_num_heads // hs) * K * K * 4  # f32 state read + written
        out["kda"] += 2 * B * Lk * (cfg.kda_conv_size - 1) * (cfg.kda_conv_channels // hs) * dt
        out["mla"] += B * Lm * (ctx + 1) * cfg.mla_cache_dim * dt + B * Lm * cfg.mla_cache_dim * dt
        return {"by_type": dict(out), "total": float(sum(out.values())), "expert_fraction_touched": touched}

    def run_slice(self):
        a = self.args
        rules = self.slice_rules()
        sec = {"mesh": a.slice_mesh, "expert_axis": a.slice_expert_axis,
               "rules": {f.name: getattr(rules, f.name) for f in dataclasses.fields(rules)},
               "batch": a.slice_batch, "context": a.slice_context, "scale": a.slice_scale, "hbm_GBps": a.hbm_gbps,
               "copy_GBps": self.res.get("copy_GBps"), "variants": []}
        self.res["slice"] = sec
        for r in self.slice_rows:
            cfg = r["cfg"]
            row = {"variant": r["variant"], "config": {
                "name": cfg.name, "layers": list(cfg.layer_kinds), "ffn": list(cfg.ffn_kinds),
                "hidden": cfg.hidden_size, "kda_heads": cfg.kda_num_heads, "mla_heads": cfg.mla_num_heads,
                "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token, "latent": cfg.routed_expert_hidden_size,
                "moe_intermediate": cfg.moe_intermediate_size, "dense_intermediate": cfg.intermediate_size,
                "vocab": cfg.vocab_size, "dtype": cfg.dtype}}
            sec["variants"].append(row)
            if self.budget.left() < 30:
                row["skipped"] = "time budget"
                self.skip(r["key"], "time budget")
                self.bar.update(2)
                continue
            try:
                t = time.perf_counter()
                shardings = make_sharded_step(cfg, a.slice_mesh, rules, a.impl).param_shardings
                params = jax.block_until_ready(self.init_slice_params(cfg, shardings, a.seed))
                row["init_s"] = round(time.perf_counter() - t, 1)
                self.bar.update()
                st = self.wait(r["key"])
                row["impl"], row["compile_s"] = st.impl, round(st.compile_s, 1)
                cost = st.cost()
                row["xla_cost_per_device"] = cost
                byt = self.slice_bytes(cfg, rules, a.slice_batch, a.slice_context)
                row["bytes_per_device"] = byt
                pred = max(cost.get("flops", 0.0) / (a.peak_tflops * 1e12), byt["total"] / (a.hbm_gbps * 1e9))
                row["predicted_step_s"] = pred
                if pred > a.slice_max_step_s:
                    row["skipped"] = (f"predicted {pred:.1f} s per step (XLA cost analysis: "
                                      f"{cost.get('flops', 0) / 1e15:.1f} PFLOP per device) > --slice-max-step-s "
                                      f"{a.slice_max_step_s}")
                    self.skip(r["key"], row["skipped"])
                    del params
                    self.bar.update()
                    self.save()
                    continue
                run = st.runner(params)
                t = time.perf_counter()
                jax.block_until_ready(run())
                row["first_call_s"] = round(time.perf_counter() - t, 2)
                one = timed(run, 1)
                n_it = max(1, min(a.iters, int(0.3 * self.budget.left() / max(one, 1e-6))))
                dt = timed(run, n_it)
                row.update(iters=n_it, step_ms=dt * 1e3, tokens_per_s=a.slice_batch / dt,
                           hbm_GBps=byt["total"] / dt / 1e9, hbm_frac=byt["total"] / dt / 1e9 / a.hbm_gbps)
                if self.res.get("copy_GBps"):
                    row["hbm_frac_of_copy"] = byt["total"] / dt / 1e9 / self.res["copy_GBps"]
                self.save()
                if a.profile_steps and self.budget.left() > 15 + a.profile_steps * one * 3:
                    try:
                        p = profile(run, st.hlo_text(), a.profile_steps)
                        row["profile"] = p
                        counts = {"kda": cfg.num_kda_layers, "mla": cfg.num_mla_layers, "moe": cfg.num_moe_layers,
                                  "dense": cfg.num_dense_layers, "lm_head": 1}
                        per = {}
                        for kind, v in p.get("by_layer_type_ms", {}).items():
                            n = counts.get(kind) or 1
                            b = byt["by_type"].get(kind, 0.0) / n
                            ms_l = v["total"] / n
                            per[kind] = {"layers": counts.get(kind, 0), "ms_per_layer": ms_l,
                                         "collective_ms_per_layer": v["collective"] / n, "bytes_per_layer": b}
                            if ms_l > 0 and b:
                                per[kind]["hbm_GBps"] = b / (ms_l * 1e-3) / 1e9
                                per[kind]["hbm_frac"] = per[kind]["hbm_GBps"] / a.hbm_gbps
                        row["per_layer_type"] = per
                    except Exception as e:  # noqa: BLE001
                        row["profile_error"] = short_err(e)
                        self.error(f"{r['key']}: profile", e)
                del run
            except cf.TimeoutError:
                row["skipped"] = "not compiled within the time budget"
                self.skip(r["key"], row["skipped"])
            except Exception as e:  # noqa: BLE001
                row["error"] = short_err(e)
                self.error(r["key"], e)
            params = None
            self.bar.update()
            self.save()

    # ---- tables ---------------------------------------------------------------------------------------
    def tables(self) -> str:
        L = []
        c = self.res.get("correctness")
        if c:
            L.append(f"correctness ({c['model']}, {c['prompts']} prompts x {c['max_new_tokens']} greedy tokens; "
                     f"logits over {c['logits_len']} tokens) pass={c.get('pass')}")
            L.append(f"{'mesh':12} {'impl':8} {'tokens_equal':>12} {'rel_max':>9} {'rel_rms':>9} {'argmax':>7} "
                     f"{'warmup_s':>8} {'gen_s':>6}")
            for r in c["meshes"]:
                lg = r.get("logits", {})
                f = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "-"
                eq = r.get("tokens_equal", "ref" if r["mesh"] == "single" else "-")
                L.append(f"{r['mesh']:12} {str(r.get('impl', '-')):8} {str(eq):>12} "
                         f"{f(lg.get('rel_max'), '9.2e'):>9} {f(lg.get('rel_rms'), '9.2e'):>9} "
                         f"{f(lg.get('argmax_agree'), '7.3f'):>7} {f(r.get('warmup_s'), '8.1f'):>8} "
                         f"{f(r.get('generate_s'), '6.1f'):>6}" + (f"  {r.get('error', r.get('skipped', ''))[:60]}"
                                                                   if r.get('error') or r.get('skipped') else ""))
        s = self.res.get("scaling")
        if s:
            L.append("")
            L.append(f"scaling ({s['model']}; decode context {s['context']}; prefill {s['prefill']['tokens']} tokens "
                     f"as sequences of {s['prefill']['seq_len']}); device ms per step from the profile")
            L.append(f"{'tp':>3} {'op':8} {'n':>6} {'step_ms':>9} {'tok/s':>10} {'compute':>8} {'collect':>8} "
                     f"{'exposed':>8} {'coll%':>6}")
            for r in s["rows"]:
                p = r.get("profile", {})
                g = lambda k: f"{p[k]:8.2f}" if k in p else "       -"
                L.append(f"{r['tp']:>3} {r['op']:8} {r.get('batch', r.get('tokens')):>6} "
                         + (f"{r['step_ms']:9.2f} {r['tokens_per_s']:10.0f} " if "step_ms" in r else f"{'-':>9} {'-':>10} ")
                         + f"{g('compute_ms')} {g('collective_ms')} {g('exposed_collective_ms')} "
                         + (f"{100 * p['collective_frac']:6.1f}" if "collective_frac" in p else "     -")
                         + (f"  {r.get('error', r.get('skipped', ''))[:50]}" if r.get("error") or r.get("skipped") else ""))
            for w in s.get("weak_scaling", []):
                L.append(f"weak scaling tp={w['tp']}: batch {w['batch']} vs tp=1 batch {w['base_batch']}: "
                         f"{100 * w['efficiency']:.0f}%")
            for w in s.get("strong_scaling", []):
                L.append(f"strong scaling tp={w['tp']} {w['op']} {w['n']}: speedup {w['speedup']:.2f} "
                         f"({100 * w['efficiency']:.0f}%)")
        sl = self.res.get("slice")
        if sl:
            L.append("")
            L.append(f"K3 slice on {sl['mesh']} (experts over {sl['expert_axis']}), decode batch {sl['batch']}, "
                     f"context {sl['context']}, width 1/{sl['scale']}")
            for r in sl["variants"]:
                head = f"  {r['variant']:6}"
                if "step_ms" in r:
                    head += (f" step {r['step_ms']:.2f} ms, {r['tokens_per_s']:.0f} tok/s, "
                             f"{r['hbm_GBps']:.0f} GB/s = {100 * r['hbm_frac']:.1f}% of {sl['hbm_GBps']:.0f}"
                             + (f" ({100 * r['hbm_frac_of_copy']:.1f}% of the measured copy)"
                                if "hbm_frac_of_copy" in r else ""))
                else:
                    head += " " + str(r.get("skipped", r.get("error", "not run")))[:150]
                L.append(head)
                for kind, v in (r.get("per_layer_type") or {}).items():
                    L.append(f"      {kind:8} {v['ms_per_layer']:8.3f} ms/layer (collective "
                             f"{v['collective_ms_per_layer']:.3f})"
                             + (f", {v['bytes_per_layer'] / 1e6:9.1f} MB/layer, {100 * v['hbm_frac']:5.1f}% HBM"
                                if "hbm_frac" in v else ""))
        if self.res["skipped"] or self.res["errors"]:
            L.append("")
            L.append(f"skipped: {len(self.res['skipped'])}, errors: {len(self.res['errors'])} (see JSON)")
        return "\n".join(L)


def main():
    a = ARGS
    print(f"multi_gpu: {len(jax.devices())} x {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"budget {a.budget_s:.0f} s, sections {','.join(a.sections)}", flush=True)
    R = Run(a)
    R.save()
    try:
        R.copy_bench()
        t = time.perf_counter()
        R.params_ref = jax.block_until_ready(init_params(R.cfg, a.seed))
        R.res["init_s"] = round(time.perf_counter() - t, 2)
        # plan everything (compiles go to the workers: correctness first, the slice next, then scaling)
        if "correctness" in a.sections:
            R.plan_correctness()
        if "slice" in a.sections:
            R.plan_slice()
        if "scaling" in a.sections:
            R.plan_scaling()
        R.save()
        if "correctness" in a.sections:
            R.run_correctness()
        if "scaling" in a.sections:
            # nothing runs on the devices while compiles are still autotuning there
            for k, f in list(R.jobs.items()):
                try:
                    f.result(timeout=max(R.budget.left() - 60, 0.01))
                except cf.TimeoutError:
                    break
                except Exception:  # noqa: BLE001  (reported where the result is used)
                    pass
            reserve = 90.0 if ("slice" in a.sections and R.slice_rows) else 0.0
            R.run_scaling(reserve_s=min(reserve, max(a.budget_s * 0.2, 0)))
        R.placed.clear()
        if "slice" in a.sections:
            R.run_slice()
    except Exception as e:  # noqa: BLE001
        R.error("run", e)
    finally:
        R.bar.close()
        R.res["elapsed_s"] = round(now(), 1)
        R.save()
        print(R.tables(), flush=True)
        print(f"wrote {a.out} after {now():.0f} s", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        R.pool.shutdown(wait=False, cancel_futures=True)
        os._exit(0)  # compiles still running in worker threads would otherwise hold the exit


if __name__ == "__main__":
    main()
