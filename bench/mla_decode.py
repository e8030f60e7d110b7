"""MLA attention in decode and verify: the Mosaic GPU decode kernel (`pallas_kernels.mla.mla_decode_mgpu`) against
the XLA path's blocked form (what runs without the kernel) at k3-mini's widths (12 heads, 576-wide keys, 512-wide
values), over batches and contexts, with the keys' bytes per second against the measured copy bandwidth.

    python3 bench/mla_decode.py --batch 1 64 256 --context 1024 16384 --out bench/results/mla_decode.json

Each row times one attention call (median over --reps runs of --calls calls each, the calls queued back to back)
and records its error against the blocked form's output (f32 products on the GPU's tensor cores: TF32) and, for
the kernel, against a float64 reference of a few groups. Bytes: every key a row's queries can see, read once
(the kernel's two value halves read the same keys; the second read mostly hits L2)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench._common import run_meta, write_json  # noqa: E402
from pallas_kernels import mla  # noqa: E402

H, DK, VD = 12, 576, 512
SCALE = 192 ** -0.5


def copy_gbps(nbytes=2 << 30):
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(ts) / 1e9


def case(B, C, ctx, ps, ragged, seed=0):
    rng = np.random.default_rng(seed)
    P = -(-ctx // ps)
    kv_len = rng.integers(1, ctx + 1, B) if ragged else np.full(B, ctx)
    pos = kv_len[:, None] - C + np.arange(C)[None, :]
    kq, kp = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(kq, (B, C, H, DK), jnp.float32)
    pages = jax.random.normal(kp, (B * P + 1, 2, ps, DK), jnp.bfloat16)  # on the device: up to ~10 GB
    rows = jnp.asarray(rng.permutation(np.arange(1, B * P + 1)).reshape(B, P), jnp.int32)
    return q, jnp.asarray(np.where(pos >= 0, pos, -1), jnp.int32), rows, pages, jnp.asarray(kv_len, jnp.int32)


def reference(q, pos, rows, pages, kv_len, groups):
    out = []
    for g in groups:
        k = np.asarray(pages[rows[g], 1].astype(jnp.float32), np.float64).reshape(-1, DK)
        o = np.zeros((pos.shape[1], H, VD))
        for c in range(pos.shape[1]):
            n = min(int(kv_len[g]), int(pos[g, c]) + 1)
            if n > 0:
                s = np.einsum("hd,sd->hs", np.asarray(q[g, c], np.float64), k[:n]) * SCALE
                w = np.exp(s - s.max(-1, keepdims=True))
                o[c] = (w / w.sum(-1, keepdims=True)) @ k[:n, :VD]
        out.append(o)
    return np.stack(out)


def timed(f, args, calls, reps):
    out = jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            r = f(*args)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t) / calls)
    return out, statistics.median(ts) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256], help="groups (sequences) a call")
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384], help="keys in each context")
    ap.add_argument("--queries", type=int, nargs="+", default=[1], help="queries a group: 1 (decode), gamma + 1 (verify)")
    ap.add_argument("--ragged", action="store_true", help="contexts drawn from 1..context instead of all equal")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--splits", nargs="+", default=["auto"], help="the kernel's key-range splits (mla.DECODE_SPLITS)")
    ap.add_argument("--packed", nargs="+", default=["auto"], choices=["auto", "1", "0"],
                    help="the kernel's q layout (mla.DECODE_PACKED): auto, 1 = q's two halves in one tile (32 rows a "
                         "block, 3 ring stages), 0 = in two tiles (64 rows a block, 2 stages)")
    ap.add_argument("--warpgroups", type=int, nargs="+", default=[0], choices=[0, 1, 2],
                    help="the kernel's warpgroups a CTA (mla.DECODE_WARPGROUPS; 0: its setting): 1 = a CTA per value "
                         "half, 2 = both halves in one CTA sharing the key ring")
    ap.add_argument("--forms", nargs="+", default=["kernel", "blocked"], choices=["kernel", "blocked", "needed", "dense"],
                    help="kernel = the decode kernel; blocked = the XLA path's blocked form with its GPU default key "
                         "blocks (static); needed = the same with KEY_BLOCKS needed; dense = the one-pass reference")
    ap.add_argument("--calls", type=int, default=10, help="calls queued per timed run")
    ap.add_argument("--reps", type=int, default=7, help="timed runs (the median is reported)")
    ap.add_argument("--check-groups", type=int, default=2, help="groups checked against float64 (0: none)")
    ap.add_argument("--out", default="bench/results/mla_decode.json")
    args = ap.parse_args(argv)

    res = {"bench": "mla_decode", **run_meta(), "heads": H, "dk": DK, "v_dim": VD, "page_size": args.page_size,
           "ragged": args.ragged, "decode_block": mla.DECODE_BLOCK, "decode_stages": mla.DECODE_STAGES, "results": []}
    res["copy_gbps"] = copy_gbps()
    print(f"copy bandwidth {res['copy_gbps']:.0f} GB/s", flush=True)
    kw = dict(layer=1, scale=SCALE, v_dim=VD)
    wg0 = mla.DECODE_WARPGROUPS
    forms = {"blocked": lambda *a: mla.mla_paged_attention_xla(*a, blocks="static", **kw),
             "needed": lambda *a: mla.mla_paged_attention_xla(*a, blocks="needed", **kw),
             "dense": lambda *a: mla.mla_paged_attention_ref(*a, **kw)}
    kernel_rows = [(x, y, z) for x in args.splits for y in args.packed for z in args.warpgroups]
    for C in args.queries:
        for B in args.batch:
            for ctx in args.context:
                a = case(B, C, ctx, args.page_size, args.ragged)
                seen = np.minimum(np.asarray(a[4]), np.asarray(a[1]).max(1) + 1)
                nbytes = int(np.maximum(seen, 0).sum()) * DK * 2
                base = None
                for form in sorted(args.forms, key=lambda f: f != "blocked"):  # the baseline first
                    for sp, pk, wg in (kernel_rows if form == "kernel" else [("-", "-", 0)]):
                        row = {"queries": C, "batch": B, "context": ctx, "form": form, "key_bytes": nbytes}
                        if form == "kernel":
                            mla.DECODE_SPLITS = sp if sp == "auto" else int(sp)
                            mla.DECODE_PACKED = pk if pk == "auto" else pk == "1"
                            mla.DECODE_WARPGROUPS = wg or wg0
                            plan = mla.decode_plan(B, C * H, a[2].shape[1] * args.page_size)
                            row.update(packed=plan.packed, stages=plan.stages, warpgroups=plan.warpgroups,
                                       splits=plan.splits)
                            f = jax.jit(lambda *x: mla.mla_decode_mgpu(*x, **kw))
                        else:
                            f = jax.jit(forms[form])
                        try:
                            out, ms = timed(f, a, args.calls, args.reps)
                        except Exception as e:  # e.g. the dense form out of memory
                            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                            print(row, flush=True)
                            res["results"].append(row)
                            write_json(args.out, res)
                            continue
                        out = np.asarray(out)
                        row.update(ms=ms, bandwidth_frac=nbytes / (ms * 1e-3) / 1e9 / res["copy_gbps"])
                        if form == "blocked":
                            base = out
                        elif base is not None:
                            row["rel_err_vs_blocked"] = float(np.abs(out - base).max() / np.abs(base).max())
                        if args.check_groups and form in ("kernel", "blocked"):
                            gs = list(range(min(args.check_groups, B)))
                            want = reference(*a, gs)
                            row["rel_err_vs_f64"] = float(np.abs(out[gs] - want).max() / np.abs(want).max())
                        res["results"].append(row)
                        write_json(args.out, res)
                        print(f"C {C} B {B:4} ctx {ctx:6} {form:8} splits {row.get('splits', '-')!s:3} "
                              f"packed {row.get('packed', '-')!s:5} wg {row.get('warpgroups', '-')} {ms:8.3f} ms "
                              f"{row['bandwidth_frac']:.2f} of copy bw  err f64 {row.get('rel_err_vs_f64', float('nan')):.1e}"
                              f"  vs blocked {row.get('rel_err_vs_blocked', float('nan')):.1e}", flush=True)
    mla.DECODE_SPLITS, mla.DECODE_PACKED, mla.DECODE_WARPGROUPS = "auto", "auto", wg0


if __name__ == "__main__":
    main()
