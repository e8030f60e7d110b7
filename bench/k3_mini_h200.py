"""End-to-end decode of k3-mini on one H200: the Pallas path (`impl="pallas"`: the Mosaic GPU KDA
decode kernel, in place on the recurrent pool) vs the XLA path (`impl="xla"`), with a breakdown of
the step's GPU time by layer type from a profile; with `--prefill`, prefill steps too (the chunk
kernels), whose breakdown shows what the KDA layer spends outside the kernels (`kda_proj/qk_norm`,
`kda_proj/gate`: the L2 norm and the gate, which the kernels could fuse in).

    python3 bench/k3_mini_h200.py --out bench/results/k3_mini_h200.json
    python3 bench/k3_mini_h200.py --batch --prefill 4096 16384 --fused-inputs --out $OUT/k3_mini_prefill.json

Random weights (k3jax's `init_params`, seeded) and random recurrent/KV state. Every sequence decodes
one token with `--context` tokens already in context; a prefill row is one fresh sequence of that
many tokens in one step. Step times come from
`bench/step_xla.py: measure` (median wall time of the jitted, state-donating `step`, after a warm-up
call). The breakdown: `jax.profiler.trace` over a few steps; each GPU kernel event carries the HLO
instruction it ran (`hlo_op`), which is mapped to the `jax.named_scope` of the model code
(`layer{i}_kda/kda_core`, `layer{i}_kda/kda_proj/gate`, `layer{i}_mla`, `layer{i}_moe`, `lm_head`, ...)
through the op_name metadata
of the compiled module's HLO; kernel time is summed per layer type and sub-scope and divided by the
number of profiled steps (so it is device time, not wall time).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench.step_xla as step_xla  # noqa: E402
from bench._common import device_events, hlo_copies  # noqa: E402
from k3jax.config import preset  # noqa: E402
from k3jax.engine.runner import SeqWork, pack_step  # noqa: E402
from k3jax.model import kda as kda_model  # noqa: E402
from k3jax.model import moe as moe_model  # noqa: E402
from k3jax.model import common as common_model  # noqa: E402
from k3jax.model.forward import split_layers, step  # noqa: E402
from k3jax.model.init import init_params  # noqa: E402
from k3jax.state import init_state  # noqa: E402
import pallas_kernels.mla as mla_kernels  # noqa: E402
import pallas_kernels.moe as gmm  # noqa: E402


def random_state(state, seed=0):
    """Random values in every float leaf of the device state (timing never runs on zeros)."""
    leaves, tree = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [
        (jax.random.normal(k, x.shape, jnp.float32) * 0.02).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
        for k, x in zip(keys, leaves)
    ]
    return jax.tree_util.tree_unflatten(tree, out)


def prefill_batch(cfg, T, ps, seed=0):
    """(state, batch) for one fresh sequence prefilling T tokens in one step."""
    n_pages = -(-T // ps)
    state = random_state(init_state(cfg, 2, n_pages + 1, ps))
    ids = jax.random.randint(jax.random.key(seed), (T,), 0, cfg.vocab_size).tolist()
    work = SeqWork(ids, 0, 1, list(range(1, n_pages + 1)))
    return state, pack_step([], [work], D=0, P=T, NP=1, pages_per_seq=n_pages).batch


def decode_batch(cfg, B, ctx, ps, table=None):
    """(state, batch) for B sequences decoding one token each with `ctx` tokens in context; the page table
    holds `table` tokens a sequence (None: just the context and the new token; the engine's is
    max_seq_len)."""
    n_pages = -(-(ctx + 1) // ps)
    width = max(n_pages, -(-table // ps)) if table else n_pages
    state = random_state(init_state(cfg, B + 1, B * n_pages + 1, ps))
    works = [SeqWork([7], ctx, i + 1, list(range(1 + i * n_pages, 1 + (i + 1) * n_pages))) for i in range(B)]
    return state, pack_step(works, [], D=B, P=0, NP=0, pages_per_seq=width).batch


# ---- profile -> per-scope device time -------------------------------------------------------

_SCOPE = re.compile(r"layer(\d+)_(kda|mla|moe|dense)((?:/\w+)*)")


def hlo_scopes(hlo_text):
    """Instruction name -> op_name of the compiled module (fusions: the op_names of the fused
    computation they call, the most common layer scope first)."""
    comp_ops = collections.defaultdict(list)
    inst_own, inst_calls = {}, {}
    comp = None
    for line in hlo_text.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if m and "=" not in line.split("(")[0]:
            comp = m.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        if not m:
            continue
        name = m.group(1)
        op = re.search(r'op_name="([^"]*)"', line)
        if op:
            comp_ops[comp].append(op.group(1))
            inst_own[name] = op.group(1)
        calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
        if calls:
            inst_calls[name] = calls
    out = {}
    for name in set(inst_own) | set(inst_calls):
        ops = [inst_own[name]] if name in inst_own else []
        for c in inst_calls.get(name, []):
            ops += comp_ops.get(c, [])
        scoped = [o for o in ops if _SCOPE.search(o) or "lm_head" in o]
        out[name] = collections.Counter(scoped or ops).most_common(1)[0][0] if ops else ""
    return out


# name-stack parts that JAX's transformations add (a scan's while loop, a called jaxpr): not model scopes
_JAX_PARTS = re.compile(r"^(?:while|body|cond|closed_call|branch_\d+|checkpoint|remat|pjit|shard_map|jvp|vmap)$")


def classify(op_name):
    """op_name -> (layer type, the model's named scopes below the layer's, '/'-joined: the last part,
    the primitive, and the parts JAX's transformations add are dropped)."""
    m = _SCOPE.search(op_name)
    if m:
        return m.group(2), "/".join(x for x in m.group(3).split("/")[1:-1] if not _JAX_PARTS.match(x))
    if "lm_head" in op_name:
        return "lm_head", ""
    return "other", ""


def _event_op(e, scopes):
    """The HLO instruction of a GPU kernel event: its kernel name where that names an instruction
    (XLA:GPU kernels are named after their fusion; under CUDA graphs the event's `hlo_op` is the
    command buffer, seen on the H200), else `hlo_op`, else the kernel name."""
    name = e["name"]
    if name in scopes:
        return name
    return (e.get("args") or {}).get("hlo_op") or name


# Mosaic GPU kernels by a part of their kernel_name -> (layer type, scope) in the breakdown
_MOSAIC_KERNELS = {"kda": ("kda", "kda_core"), "moe_grouped_matmul": ("moe", "moe_experts"),
                   "mla_decode_mgpu": ("mla", "mla_attn")}


def profile_breakdown(run, hlo_text, steps, device="/device:GPU"):
    """Runs `run()` `steps` times under the profiler; -> {layer type: ms per step, ...}."""
    events = device_events(run, steps, device)
    scopes = hlo_scopes(hlo_text)
    # XLA:GPU names a kernel after its HLO instruction with '.' and '-' turned into '_'
    scopes.update({re.sub(r"[.\-]", "_", k): v for k, v in list(scopes.items())})
    by_type = collections.defaultdict(float)
    by_sub = collections.defaultdict(float)
    by_kernel = collections.defaultdict(float)
    total = unmatched = 0.0
    samples = []
    for e in events:
        args = e.get("args") or {}
        if device == "/host:CPU" and "hlo_op" not in args:  # CPU smoke test: only the XLA thunks
            continue
        op = _event_op(e, scopes)
        dur = e["dur"] / 1e3 / steps  # us -> ms per step
        total += dur
        by_kernel[e["name"][:60]] += dur
        named = _MOSAIC_KERNELS.get(next((n for n in _MOSAIC_KERNELS if n in op or n in e["name"]), None))
        if op not in scopes and named:  # Mosaic GPU kernels carry their kernel_name, not a scope
            kind, sub = named
        else:
            if op not in scopes:
                unmatched += dur
            kind, sub = classify(scopes.get(op, ""))
        if len(samples) < 3:
            samples.append({"name": e["name"], "args": args})
        by_type[kind] += dur
        by_sub[f"{kind}/{sub}" if sub else kind] += dur
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]
    unmatched_kernels = collections.Counter()
    for e in events:
        op = _event_op(e, scopes)
        if op not in scopes and not any(n in op or n in e["name"] for n in _MOSAIC_KERNELS):
            unmatched_kernels[e["name"][:80]] += e["dur"] / 1e3 / steps
    return {
        "method": "jax.profiler perfetto trace: GPU kernel events -> hlo_op -> named_scope (op_name metadata)",
        "device_process": device,
        "kernel_ms_per_step": total,
        "unmatched_ms_per_step": unmatched,
        "by_layer_type_ms": dict(sorted(by_type.items(), key=lambda kv: -kv[1])),
        "by_scope_ms": dict(sorted(by_sub.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": dict(top),
        "top_unmatched_kernels_ms": dict(unmatched_kernels.most_common(8)),
        "event_samples": samples,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-mini")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 16, 64, 256], help="decode batches (empty: none)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[],
                    help="prefill rows: one fresh sequence of this many tokens in one step (default: none)")
    ap.add_argument("--impl", nargs="*", default=["pallas", "xla"])
    ap.add_argument("--fused-inputs", action="store_true",
                    help="prefill rows of impl pallas also run with the KDA layer's L2 norm and gate in the chunk "
                         "kernel (k3jax.model.kda.PREFILL_FUSED_INPUTS; rows marked fused_inputs)")
    ap.add_argument("--layouts", nargs="*", default=["split"], choices=["stacked", "split"],
                    help="parameter layouts: split (the default, what `k3jax.load_model` and so the engine run: "
                         "`split_layers`, one array per layer) and/or stacked (one array per field with a leading "
                         "layer dim: the forward slices it per layer)")
    ap.add_argument("--batch-invariant", type=int, nargs="*", default=[0], metavar="ROWS",
                    help="row blocks of the batch-invariant mode to run every row in (0: off; 128: what "
                         "LLM(batch_invariant=True) runs); rows marked batch_invariant_rows (default: 0)")
    ap.add_argument("--expert-group", type=int, nargs="*", default=[1], metavar="G",
                    help="with a --batch-invariant row block: expert blocks per loop step of the mode's routed "
                         "experts (`k3jax.model.moe.EXPERT_GROUP`; 1, the default, one block a step); rows marked "
                         "expert_group")
    ap.add_argument("--invariant-experts", nargs="*", default=[moe_model.INVARIANT_EXPERTS],
                    choices=list(moe_model.INVARIANT_FORMS),
                    help="with a --batch-invariant row block: the mode's routed experts "
                         "(`k3jax.model.moe.INVARIANT_EXPERTS`, the default): kernel = the grouped-matmul kernel with a "
                         "fixed N tile and no loop (bf16 weights on a Hopper GPU; else blocks), blocks = one used "
                         "expert's block a loop step (--expert-group applies), rounds = every expert's next block a "
                         "step as one batched product; rows marked invariant_experts")
    ap.add_argument("--invariant-proj", nargs="*", default=[common_model.INVARIANT_PROJ], choices=["auto", "blocks"],
                    help="with a --batch-invariant row block: the mode's projections (`k3jax.model.common."
                         "INVARIANT_PROJ`, the default): auto = the grouped-matmul kernel with a fixed N tile and no "
                         "loop (bf16 weights on a Hopper GPU; else blocks), blocks = `rowwise` row-block loops; rows "
                         "marked invariant_proj")
    ap.add_argument("--moe-impl", nargs="*", default=["auto"], choices=["auto", "ragged", "slabs", "pallas"],
                    help="outside the batch-invariant mode: the routed experts' grouped matmul "
                         "(`k3jax.model.moe.GROUPED_MATMUL`): auto = the default (the Mosaic GPU kernel on a Hopper "
                         "GPU for bf16 weights, else ragged), ragged = jax.lax.ragged_dot, slabs = three batched "
                         "products over all experts (T rows an expert), pallas = the Mosaic GPU grouped-matmul "
                         "kernel (pallas_kernels/moe.py); rows marked moe_impl")
    ap.add_argument("--moe-stages", type=int, nargs="*", default=[0], metavar="S",
                    help="TMA stages of the grouped-matmul kernel (`pallas_kernels.moe.STAGES`; 0, the default: "
                         "its setting) for the rows that run it (--moe-impl auto or pallas, and the mode's kernel "
                         "form); rows marked moe_stages")
    ap.add_argument("--mla-form", nargs="*", default=[("kernel_prefill" if mla_kernels.PREFILL_KERNEL else "kernel")
                                                    if mla_kernels.DECODE_KERNEL else mla_kernels.XLA_FORM],
                    choices=["kernel", "kernel_prefill", "blocked", "dense"],
                    help="the MLA attention: kernel = the decode kernel for the pallas rows' decode and verify groups "
                         "(`pallas_kernels.mla.DECODE_KERNEL`, the default; the blocked XLA form elsewhere), "
                         "kernel_prefill = the kernel for their prefill chunks too (`pallas_kernels.mla.PREFILL_KERNEL`), "
                         "or the XLA "
                         "form alone (`pallas_kernels.mla.XLA_FORM`): blocked = keys in page blocks with an online "
                         "softmax (memory of one block), dense = the one-pass reference (every key gathered in f32, "
                         "every score held); rows marked mla_form")
    ap.add_argument("--mla-blocks", nargs="*", default=[mla_kernels.KEY_BLOCKS], choices=["auto", "static", "needed"],
                    help="the blocked form's key blocks (`pallas_kernels.mla.KEY_BLOCKS`, the default): static = every "
                         "block of the page table (a loop of known trip count), needed = up to the last block a query "
                         "can see (a trip count computed on the device), auto = needed except on a GPU; rows marked "
                         "mla_blocks")
    ap.add_argument("--context", type=int, default=1024, help="decode rows: tokens already in each sequence's context")
    ap.add_argument("--table-tokens", type=int, default=None,
                    help="decode rows: the page table's width in tokens (default: the context and the new token; the "
                         "engine's is max_seq_len, so its attention reads a table wider than most contexts)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/k3_mini_h200.json")
    ap.add_argument("--hlo-out", default=None, metavar="DIR",
                    help="also write each row's compiled HLO text to DIR (every row records its copies either way: "
                         "hlo_copies, the copy instructions' count and MB in the entry computation and in the loop "
                         "bodies)")
    ap.add_argument("--profile-device", default="/device:GPU", help="trace process to read ('/host:CPU' to smoke-test)")
    args = ap.parse_args(argv)

    cfg = preset(args.model)
    stacked = jax.block_until_ready(init_params(cfg, 0))
    layouts = {name: (stacked if name == "stacked" else jax.block_until_ready(split_layers(stacked)))
               for name in args.layouts}
    res = {"bench": "k3_mini_decode", "commit": step_xla.commit(), "jax": jax.__version__,
           "device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind, "model": args.model,
           "dtype": cfg.dtype, "context": args.context, "table_tokens": args.table_tokens, "page_size": args.page_size,
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "layers": {"kinds": list(cfg.layer_kinds), "ffn": list(cfg.ffn_kinds)}, "results": []}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    shapes = [("decode", B) for B in args.batch] + [("prefill", T) for T in args.prefill]
    kernel_rows = lambda bi, ie, mi: (ie == "kernel") if bi else mi in ("auto", "pallas")
    runs = [(s, impl, lay, fused, bi, ie, eg, ip, mi, ms, mf, mb) for s in shapes for impl in args.impl for lay in args.layouts
            for fused in ([False, True] if args.fused_inputs and s[0] == "prefill" and impl == "pallas" else [False])
            for bi in args.batch_invariant
            for ie, eg in ([(f, g) for f in args.invariant_experts for g in (args.expert_group if f == "blocks" else [1])]
                           if bi else [("blocks", 1)])
            for ip in (args.invariant_proj if bi else ["auto"])
            for mi in (["auto"] if bi else args.moe_impl)
            for ms in (args.moe_stages if kernel_rows(bi, ie, mi) else [0])
            for mf in args.mla_form
            for mb in (args.mla_blocks if mf == "blocked" else ["static"])]
    base_cfg = cfg
    stages0 = gmm.STAGES
    for (kind, B), impl, layout, fused, bi, ie, eg, ip, mi, ms, mf, mb in runs:
        params = layouts[layout]
        cfg = base_cfg.replace(batch_invariant_rows=bi)
        row = {"batch": B, "impl": impl, "layout": layout} if kind == "decode" else {
            "prefill_tokens": B, "impl": impl, "layout": layout, "fused_inputs": fused}
        row["batch_invariant_rows"] = bi
        if bi:
            row["invariant_experts"], row["expert_group"], row["invariant_proj"] = ie, eg, ip
        row["moe_impl"] = mi
        row["mla_form"] = mf
        mla_kernels.DECODE_KERNEL = mf.startswith("kernel")  # read when the step is traced
        mla_kernels.PREFILL_KERNEL = mf == "kernel_prefill"  # read when the step is traced
        mla_kernels.XLA_FORM = "blocked" if mf.startswith("kernel") else mf  # read when the step is traced
        if mf == "blocked":
            mla_kernels.KEY_BLOCKS = mb  # read when the step is traced
            row["mla_blocks"] = mla_kernels.key_blocks()
        gmm.STAGES = ms or stages0  # read when the step is traced
        if kernel_rows(bi, ie, mi):
            row["moe_stages"] = gmm.STAGES
        moe_model.INVARIANT_EXPERTS = ie  # read when the step is traced
        common_model.INVARIANT_PROJ = ip  # read when the step is traced
        moe_model.EXPERT_GROUP = eg  # read when the step is traced
        moe_model.GROUPED_MATMUL = mi  # read when the step is traced
        kda_model.PREFILL_FUSED_INPUTS = fused  # read when the step is traced
        step.clear_cache()
        make = ((lambda: decode_batch(cfg, B, args.context, args.page_size, args.table_tokens)) if kind == "decode"
                else (lambda: prefill_batch(cfg, B, args.page_size)))
        try:
            state, batch = make()
            batch = jax.device_put(batch)
            t = time.perf_counter()  # one compile, used by the timing and by the profile
            compiled = step.lower(params, state, batch, cfg=cfg, impl=impl).compile()
            row["compile_s"] = round(time.perf_counter() - t, 2)
            mem = compiled.memory_analysis()
            if mem is not None:  # the step's temporaries: what a prefill chunk or a long context costs beside the pools
                row["temp_mb"] = round(mem.temp_size_in_bytes / 2**20, 1)
            hlo = compiled.as_text()
            row["hlo_copies"] = hlo_copies(hlo)
            if args.hlo_out:
                os.makedirs(args.hlo_out, exist_ok=True)
                label = "_".join(str(row[k]) for k in row if k not in ("compile_s", "hlo_copies"))
                with open(os.path.join(args.hlo_out, f"{kind}_{label}.hlo.txt"), "w") as fh:
                    fh.write(hlo)
            step_xla.step = lambda p, s, b, c: compiled(p, s, b)  # what measure() calls
            _, med = step_xla.measure(params, cfg, state, batch, args.iters)
            row.update(step_ms=med * 1e3, tokens_per_s=B / med)
            try:
                box = {"s": make()[0]}  # measure() donated the first

                def run():
                    out, box["s"] = compiled(params, box["s"], batch)
                    return out

                jax.block_until_ready(run())
                row["profile"] = profile_breakdown(run, hlo, args.profile_steps, args.profile_device)
            except Exception as e:  # the step times stand without the breakdown
                row["profile_error"] = repr(e)[:400]
                traceback.print_exc()
        except Exception as e:
            row["error"] = repr(e)[:600]
            traceback.print_exc()
        res["results"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    print("\nmla: the MLA attention's form (k kernel, p kernel with prefill, b blocked, d dense), key blocks (s static, n needed)")
    print(f"{'batch':>5} {'impl':7} {'layout':7} {'inv':>4} {'eg':>2} {'moe':7} {'proj':6} {'mla':3} {'st':>2} "
          f"{'step_ms':>8} {'tok/s':>9}"
          "  kda_ms  mla_ms  moe_ms  lm_head  other"
          "   (device ms/step)  temp MB  copy MB (entry + loop bodies, once a trip)")
    # the MLA form's letter (kernel, p = kernel_prefill, blocked, dense) and the blocked form's key blocks
    mla_tag = lambda r: ("p" if r.get("mla_form") == "kernel_prefill" else r.get("mla_form", "dense")[0]) + \
        r.get("mla_blocks", "-")[0]
    for r in res["results"]:
        p = r.get("profile", {}).get("by_layer_type_ms", {})
        g = lambda k: f"{p.get(k, 0.0):7.3f}" if p else "    -  "
        n = r.get("batch", f"P{r.get('prefill_tokens')}{'f' if r.get('fused_inputs') else ''}")
        c = r.get("hlo_copies")
        copies = f"{c['entry_mb']:.0f} + {c['other_mb']:.0f}" if c else "-"
        print(f"{n:>5} {r['impl']:7} {r.get('layout', 'split'):7} {r.get('batch_invariant_rows', 0):4d} "
              f"{r.get('expert_group', 1):2d} {r.get('invariant_experts') or r.get('moe_impl', 'auto'):7} "
              f"{r.get('invariant_proj', '-'):6} {mla_tag(r):3} "
              f"{r.get('moe_stages', 0) or '-':>2} "
              f"{r.get('step_ms', float('nan')):8.3f} "
              f"{r.get('tokens_per_s', float('nan')):9.0f} "
              f"{g('kda')} {g('mla')} {g('moe')} {g('lm_head')} {g('other')}   {r.get('temp_mb', float('nan')):7.0f}  "
              f"{copies}")


if __name__ == "__main__":
    main()
