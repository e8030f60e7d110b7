"""Step-level benchmark of the model on the XLA (jnp) path: prefill and decode step times.

    python bench/step_xla.py --model k3-mini --decode-batch 1 16 64 --prefill 512 4096 \
        --out bench/results/step_xla_h200.json

Random weights (seeded). Decode steps run with a context of `--context` tokens per sequence.
Times are medians over `--iters` runs after one warm-up call (the warm-up's wall time is reported
as the compile time of that bucket). Writes JSON with the commit, JAX version, device and shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from k3jax.config import preset  # noqa: E402
from k3jax.engine.runner import SeqWork, pack_step  # noqa: E402
from k3jax.model.forward import step  # noqa: E402
from k3jax.model.init import init_params  # noqa: E402
from k3jax.state import init_state  # noqa: E402


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return os.environ.get("K3JAX_COMMIT", "unknown")


def measure(params, cfg, state, batch, iters):
    """-> (first call's wall time incl. compile [s], median step time [s]); the state is threaded
    through the donated step, the batch is on device."""
    batch = jax.device_put(batch)
    holder = {"state": state}

    def run():
        out, holder["state"] = step(params, holder["state"], batch, cfg)
        return out

    t = time.perf_counter()
    jax.block_until_ready(run())
    compile_s = time.perf_counter() - t
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(run())
        ts.append(time.perf_counter() - t)
    return compile_s, statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-mini", help="preset name (default k3-mini)")
    ap.add_argument("--decode-batch", type=int, nargs="*", default=[1, 16, 64], help="decode batch sizes")
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 4096], help="prefill lengths (one sequence)")
    ap.add_argument("--context", type=int, default=1024, help="context tokens per decoding sequence")
    ap.add_argument("--page-size", type=int, default=64, help="KV page size")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per shape")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)

    cfg = preset(args.model)
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_params(cfg, 0))
    init_s = time.perf_counter() - t0
    ps = args.page_size
    rows = []
    pbar = tqdm(total=len(args.decode_batch) + len(args.prefill), desc="bench", file=sys.stderr)
    for T in args.prefill:
        n_pages = -(-T // ps)
        state = init_state(cfg, 2, n_pages + 1, ps)
        work = SeqWork(list(np.random.default_rng(0).integers(0, cfg.vocab_size, T)), 0, 1, list(range(1, n_pages + 1)))
        pk = pack_step([], [work], D=0, P=-(-T // 64) * 64, NP=1, pages_per_seq=n_pages)
        compile_s, med = measure(params, cfg, state, pk.batch, args.iters)
        rows.append({"op": "prefill", "tokens": T, "compile_s": round(compile_s, 2), "ms": med * 1e3,
                     "tokens_per_s": T / med})
        pbar.update()
    for B in args.decode_batch:
        ctx = args.context
        n_pages = -(-(ctx + 1) // ps)
        state = init_state(cfg, B + 1, B * n_pages + 1, ps)
        works = [SeqWork([7], ctx, i + 1, list(range(1 + i * n_pages, 1 + (i + 1) * n_pages))) for i in range(B)]
        pk = pack_step(works, [], D=B, P=0, NP=0, pages_per_seq=n_pages)
        compile_s, med = measure(params, cfg, state, pk.batch, args.iters)
        rows.append({"op": "decode", "batch": B, "context": ctx, "compile_s": round(compile_s, 2), "ms": med * 1e3,
                     "tokens_per_s": B / med})
        pbar.update()
    pbar.close()
    result = {
        "bench": "step_xla", "commit": commit(), "jax": jax.__version__, "device": str(jax.devices()[0]),
        "model": args.model, "dtype": cfg.dtype, "page_size": ps, "init_s": round(init_s, 2), "results": rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
