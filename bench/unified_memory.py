"""Unified memory vs static state/KV splits, simulated on the host with K3 sizes at TP=8.

    python bench/unified_memory.py --out bench/results/unified_memory.json --plot bench/results/unified_memory.png

Sizes come from `k3jax.sizing`: a request's KDA state block (recurrent + conv) per device, MLA KV per
token, and the pool budget = 90% of a 141 GB H200 minus the weights per device of K3's smallest
deployment (tp=8, ep=4, MXFP4 experts). A request holds two state blocks (working slot + extra
buffer for checkpoints, as the engine does) and the KV pages of its whole context while it runs.

Workloads (requests arrive faster than they finish, so memory decides the concurrency):
- short: many short chats (2k tokens);
- long: few long contexts (256k to 1M tokens);
- shift: a mix that shifts from short to long over time.
For unified memory (the real `k3jax.cache.unified.UnifiedMemory`) and for 9 static splits (10% to
90% of the budget for state), report the mean requests running, the mean tokens held, requests
finished, and for unified the bytes moved by compaction per byte freed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3jax.cache.unified import UnifiedMemory  # noqa: E402
from k3jax.config import preset  # noqa: E402
from k3jax.sizing import memory_plan  # noqa: E402

HBM = 141e9
PAGE_SIZE = 64
STEPS = 3000
BLOCKS_PER_REQUEST = 2


def sizes():
    cfg = preset("k3")
    plan = memory_plan(cfg, tp=8, ep=4, expert_bits=4.25)
    block = plan.kda_state_bytes_per_request
    page = plan.mla_kv_bytes_per_token * PAGE_SIZE
    budget = int(0.9 * HBM - plan.weight_bytes_per_device)
    return block, page, budget, plan


def workload(kind: str, seed: int):
    """Per step: a list of (tokens, duration in steps) arrivals."""
    rng = np.random.default_rng(seed)

    def short():
        return int(rng.integers(1500, 2500)), int(rng.integers(40, 120))

    def long():
        return int(rng.integers(256_000, 1_000_001)), int(rng.integers(200, 600))

    for t in range(STEPS):
        if kind == "short":
            yield [short() for _ in range(rng.poisson(6))]
        elif kind == "long":
            yield [long() for _ in range(rng.poisson(0.05))]
        else:  # shift: short traffic fades out while long traffic fades in
            f = t / STEPS
            yield [short() for _ in range(rng.poisson(6 * (1 - f)))] + [long() for _ in range(rng.poisson(0.05 * f))]


class Static:
    def __init__(self, budget, block, page, frac):
        self.slots = int(frac * budget // block)
        self.pages = int((1 - frac) * budget // page)
        self.page = page

    def admit(self, tokens):
        need = -(-tokens // PAGE_SIZE)
        if self.slots >= BLOCKS_PER_REQUEST and self.pages >= need:
            self.slots -= BLOCKS_PER_REQUEST
            self.pages -= need
            return need
        return None

    def release(self, handle):
        self.slots += BLOCKS_PER_REQUEST
        self.pages += handle

    def usage(self):
        return None


class Unified:
    def __init__(self, budget, block, page):
        self.mem = UnifiedMemory(budget, block, page, PAGE_SIZE)

    def admit(self, tokens):
        need = -(-tokens // PAGE_SIZE)
        if BLOCKS_PER_REQUEST * self.mem.block_bytes + need * self.mem.page_bytes > self.mem.hole_bytes:
            return None
        return self.mem.slots.alloc(BLOCKS_PER_REQUEST), self.mem.pages.alloc(need)

    def release(self, handle):
        slots, pages = handle
        self.mem.slots.free(slots)
        self.mem.pages.free(pages)
        self.mem.take_moves()

    def usage(self):
        m = self.mem
        return ((m.blocks.n - 1) * m.block_bytes, (m.kv.n - 1) * m.page_bytes)


def simulate(pool, kind: str, seed: int) -> dict:
    queue = collections.deque()
    running = []  # (finish step, tokens, handle)
    held_req, held_tok, finished, trace = [], [], 0, []
    for t, arrivals in enumerate(workload(kind, seed)):
        keep = []
        for r in running:
            if r[0] <= t:
                pool.release(r[2])
                finished += 1
            else:
                keep.append(r)
        running = keep
        queue.extend(arrivals)
        while queue:  # FCFS admission by memory
            tokens, dur = queue[0]
            h = pool.admit(tokens)
            if h is None:
                break
            queue.popleft()
            running.append((t + dur, tokens, h))
        held_req.append(len(running))
        held_tok.append(sum(r[1] for r in running))
        trace.append(pool.usage())
    return {"mean_running": float(np.mean(held_req)), "mean_tokens_held": float(np.mean(held_tok)),
            "finished": finished, "trace": trace}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--plot", default=None, help="PNG of the unified pool over time (shift workload)")
    args = ap.parse_args(argv)
    block, page, budget, plan = sizes()
    res = {"bench": "unified_memory", "model": "k3", "tp": 8, "ep": 4, "hbm_bytes": HBM, "pool_bytes": budget,
           "state_block_bytes": block, "page_bytes": page, "page_size": PAGE_SIZE,
           "blocks_per_request": BLOCKS_PER_REQUEST, "workloads": {}}
    try:
        res["commit"] = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        res["commit"] = "unknown"
    print(f"pool {budget / 1e9:.1f} GB; state block {block / 1e6:.1f} MB; page of {PAGE_SIZE} tokens {page / 1e6:.2f} MB")
    traces = {}
    for kind in ("short", "long", "shift"):
        rows = {}
        for frac in [i / 10 for i in range(1, 10)]:
            r = simulate(Static(budget, block, page, frac), kind, args.seed)
            r.pop("trace")
            rows[f"static_{int(frac * 100)}%"] = r
        uni = Unified(budget, block, page)
        r = simulate(uni, kind, args.seed)
        traces[kind] = r.pop("trace")
        r["bytes_moved_per_byte_freed"] = uni.mem.bytes_moved / max(uni.mem.bytes_freed, 1)
        rows["unified"] = r
        statics = [v["mean_tokens_held"] for k, v in rows.items() if k.startswith("static")]
        best, worst = max(statics), min(statics)
        rows["goals"] = {"unified_ge_best_static": r["mean_tokens_held"] >= best,
                         "unified_ge_1.5x_worst_static": r["mean_tokens_held"] >= 1.5 * worst}
        res["workloads"][kind] = rows
        print(f"\n{kind}: {'pool':>12} {'mean running':>13} {'mean tokens held':>17} {'finished':>9}")
        for k, v in rows.items():
            if k != "goals":
                print(f"{'':7}{k:>12} {v['mean_running']:13.1f} {v['mean_tokens_held']:17,.0f} {v['finished']:9d}")
        print(f"       bytes moved per byte freed (unified): {r['bytes_moved_per_byte_freed']:.3f}; goals {rows['goals']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(14, 3.6), sharey=True)
        for ax, kind in zip(axes, ("short", "long", "shift")):
            st = np.array([u[0] for u in traces[kind]]) / 1e9
            kv = np.array([u[1] for u in traces[kind]]) / 1e9
            t = np.arange(len(st))
            ax.fill_between(t, 0, st, label="KDA state blocks (low end)", color="tab:orange")
            ax.fill_between(t, budget / 1e9 - kv, budget / 1e9, label="MLA KV pages (high end)", color="tab:blue")
            ax.set(title=f"{kind}: unified pool over time", xlabel="step")
        axes[0].set_ylabel("GB (the gap is the free hole)")
        axes[0].legend(loc="center right", fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=80)


if __name__ == "__main__":
    main()
