"""Prefix-cache policies on a synthetic trace, and host scheduler time per step (host only, no model).

    python bench/prefix_cache.py --out bench/results/prefix_cache.json

The real `Scheduler` runs the trace; a fake device "samples" a deterministic token per request and
position, so multi-turn prompts can be built from earlier outputs. Trace: shared system prompts,
multi-turn sessions, few-shot prompts with many branching queries. Policies:
- `marconi` (ours): checkpoints planted at chunk-aligned branch points and at sequence ends, with a
  per-path cap and LRU;
- `every_chunk`: a checkpoint at every chunk-aligned prefill chunk end (and sequence ends);
- `leaf_only`: checkpoints at sequence ends only (as sglang-jax).
Reported: token hit rate (prompt tokens restored instead of computed), recomputed tokens, peak
checkpoint slots. Then: host time of one scheduler step (schedule + pack + process) with 64 and 256
running decode requests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3jax.engine.request import Request  # noqa: E402
from k3jax.engine.runner import SeqWork, pack_step  # noqa: E402
from k3jax.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from k3jax.sampling import SamplingParams, request_keys  # noqa: E402


PREFILL_BUDGET = 2048  # prefill tokens per step (SGLang's chunked-prefill size on large GPUs is 2k-8k)


def fake_tokens(plan) -> np.ndarray:
    out = np.zeros(len(plan.decode) + len(plan.prefill), np.int64)
    for row, sp in plan.rows():
        out[row] = hash((sp.req.id, sp.req.scheduled_samples)) % 1000
    return out


def run_trace(sched: Scheduler, seed: int) -> dict:
    """Serve the trace: requests arrive over time (steps), sessions send their next turn a few
    steps after the previous one finished. Returns prompt-token and checkpoint counters."""
    rng = np.random.default_rng(seed)
    r = lambda n: rng.integers(1000, 30000, int(n)).tolist()
    systems = [r(rng.integers(800, 1600)) for _ in range(4)]
    fewshot = [systems[i % 4] + r(rng.integers(1200, 2000)) for i in range(3)]
    order = iter(range(10**9))
    arrivals = []  # (step, order, kind, prompt, session)
    for i in range(24):  # multi-turn sessions on shared system prompts, 4 turns each
        prompt = systems[i % 4] + r(rng.integers(40, 200))
        arrivals.append((int(rng.integers(0, 60)), next(order), "session", prompt, {"turns_left": 3}))
    for f in fewshot:  # few-shot prompts with 24 branching queries each
        for _ in range(24):
            arrivals.append((int(rng.integers(0, 240)), next(order), "fewshot", f + r(rng.integers(20, 120)), None))
    arrivals.sort(key=lambda a: a[:2])
    live: dict = {}
    prompt_tokens, peak, step = 0, 0, 0
    while arrivals or sched.has_work():
        while arrivals and arrivals[0][0] <= step:
            _, _, kind, prompt, sess = arrivals.pop(0)
            req = Request(f"{kind}-{next(order)}", prompt, SamplingParams(max_new_tokens=32), seed=0)
            sched.add(req)
            live[req.id] = (req, sess)
            prompt_tokens += len(prompt)
        plan = sched.schedule()
        if plan:
            sched.commit(plan)
            sched.process(plan, fake_tokens(plan))
        for req in sched.drain_finished():
            _, sess = live.pop(req.id)
            if sess is not None and sess["turns_left"] > 0:
                sess["turns_left"] -= 1
                follow = req.prompt + req.output + r(rng.integers(30, 150))
                arrivals.append((step + int(rng.integers(5, 30)), next(order), "session", follow, sess))
                arrivals.sort(key=lambda a: a[:2])
        if sched.tree is not None:
            peak = max(peak, len(sched.tree.ckpt_nodes))
        step += 1
    return {"prompt_tokens": prompt_tokens, "peak_ckpt": peak, "steps": step}


def run_policy(policy: str, seed: int, max_checkpoints: int | None = None) -> dict:
    cap = 4 if policy == "marconi" else 10**6
    sched = Scheduler(SchedulerConfig(page_size=16, num_pages=200_000, num_slots=20_000, max_running=64,
                                      prefill_budget=PREFILL_BUDGET, max_prefill_seqs=8, policy=policy,
                                      max_ckpt_per_path=cap, max_checkpoints=max_checkpoints))
    t = run_trace(sched, seed)
    sched.check_invariants()
    restored = sched.stats["restored_tokens"]
    return {"policy": policy, "prompt_tokens": t["prompt_tokens"], "restored_tokens": restored,
            "hit_rate": restored / t["prompt_tokens"], "recomputed_tokens": sched.stats["computed_tokens"],
            "peak_checkpoint_slots": t["peak_ckpt"], "checkpoints_at_end": len(sched.tree.ckpt_nodes),
            "steps": t["steps"], "max_checkpoints": max_checkpoints}


def scheduler_step_time(n_running: int, steps: int = 200) -> dict:
    """Host time of one decode step with n_running requests: schedule + pack + process."""
    sched = Scheduler(SchedulerConfig(page_size=16, num_pages=n_running * 64 + 64, num_slots=3 * n_running + 8,
                                      max_running=n_running, prefill_budget=512, max_prefill_seqs=8))
    rng = np.random.default_rng(0)
    for i in range(n_running):
        sched.add(Request(f"r{i}", rng.integers(0, 30000, 200).tolist(), SamplingParams(max_new_tokens=10**6), 0))
    while any(r.in_prefill or r.status.value == "waiting" for r in sched.requests.values()):
        plan = sched.schedule()
        sched.commit(plan)
        sched.process(plan, fake_tokens(plan))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        plan = sched.schedule()
        work = [SeqWork(s.tokens, s.start, s.req.slot, s.req.pages) for s in plan.decode]
        pack_step(work, [], D=n_running, P=0, NP=0, pages_per_seq=64)
        request_keys([s.req.seed for s in plan.decode], [s.req.scheduled_samples for s in plan.decode])
        sched.commit(plan)
        sched.process(plan, fake_tokens(plan))
        times.append(time.perf_counter() - t)
    assert len(plan.decode) == n_running
    return {"running": n_running, "median_ms": statistics.median(times) * 1e3,
            "p90_ms": float(np.percentile(times, 90)) * 1e3}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    every = run_policy("every_chunk", args.seed)
    leaf = run_policy("leaf_only", args.seed)
    unbounded = run_policy("marconi", args.seed)
    # ours again with a checkpoint budget of a third of every-chunk's peak (LRU evicts beyond it)
    ours = run_policy("marconi", args.seed, max_checkpoints=every["peak_checkpoint_slots"] // 3)
    policies = [ours, unbounded, every, leaf]
    steps = [scheduler_step_time(n) for n in (64, 256)]
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        commit = "unknown"
    res = {"bench": "prefix_cache", "commit": commit, "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "policies": policies, "scheduler_step": steps}
    res["goals"] = {
        "hit_rate_at_least_every_chunk": ours["hit_rate"] >= every["hit_rate"],
        "at_most_a_third_of_every_chunk_slots": ours["peak_checkpoint_slots"] * 3 <= every["peak_checkpoint_slots"],
        "hit_rate_above_leaf_only": ours["hit_rate"] > leaf["hit_rate"],
        "step_under_2ms_at_256": steps[1]["median_ms"] < 2.0,
    }
    print(f"{'policy':12} {'ckpt budget':>11} {'hit rate':>9} {'recomputed':>11} {'peak ckpt slots':>16}")
    for p in policies:
        budget = p["max_checkpoints"] if p["max_checkpoints"] is not None else "-"
        print(f"{p['policy']:12} {budget:>11} {p['hit_rate']:9.3f} {p['recomputed_tokens']:11d} "
              f"{p['peak_checkpoint_slots']:16d}")
    for s in steps:
        print(f"scheduler step at {s['running']} running: {s['median_ms']:.3f} ms median, {s['p90_ms']:.3f} ms p90")
    print(json.dumps(res["goals"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
