"""Speculative decoding on k3-tiny (CPU now; GPU figures come with the Pallas verify/fold kernels).

    python bench/spec_decode.py [--out bench/results/spec_decode.json] [--batches 1 16] [--gamma 4]

For each batch size, one run of plain decoding (the baseline, same process, same prompts) and
speculative runs with:
  - `ngram`: prompt-lookup drafts (k3jax.spec.NgramDrafter) on a repetitive workload (code with
    repeated blocks, few-shot prompts). With random weights the model's continuation does not
    repeat its prompt, so acceptance is near zero: this row is the drafter's overhead floor.
  - `oracle@p`: drafts from the baseline's own greedy output where each draft token is right with
    probability p (k3jax.spec.OracleDrafter), p in --oracle-accuracy: throughput at a known
    acceptance rate, what a drafter of that quality buys on this engine.
Greedy outputs are checked token-identical to the baseline in every run. Reported: mean accepted
tokens per verify step (acceptance length), drafts accepted, verify steps, decode tokens/s and the
ratio to the baseline. Each engine is warmed up (compiled) before it is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import run_meta, write_json  # noqa: E402
from k3jax import LLM, SamplingParams  # noqa: E402
from k3jax.api import load_model  # noqa: E402
from k3jax.spec.drafter import OracleDrafter  # noqa: E402

CODE = """def {name}(xs):
    total = 0
    for x in xs:
        if x % {k} == 0:
            total += x * {k}
    return total
"""
FEW_SHOT = "Q: what is {a} plus {b}?\nA: {a} plus {b} is {c}.\n"


def prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            text = "".join(CODE.format(name=f"f{j}", k=int(rng.integers(2, 9))) for j in range(4))
        else:
            text = "".join(FEW_SHOT.format(a=a, b=b, c=a + b) for a, b in rng.integers(0, 50, (6, 2)))
        out.append(tok.encode(text))
    return out


def leading_right(acc: float, seed: int = 0):
    """`OracleDrafter.right`: each draft token right with probability acc (the first wrong one ends
    what verification can accept)."""
    rng = np.random.default_rng(seed)

    def right(n: int, gamma: int) -> int:
        ok = rng.random(gamma) < acc
        return gamma if ok.all() else int(np.argmin(ok))
    return right


def timed(llm: LLM, ps, sp) -> tuple[list, float, dict]:
    t = time.perf_counter()
    outs = llm.generate(ps, sp)
    wall = time.perf_counter() - t
    first = min(o.metrics["first_token"] for o in outs)
    last = max(o.metrics["finish"] for o in outs)
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    return [o.token_ids for o in outs], wall, {"decode_tokens_per_s": decoded / (last - first), "wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/spec_decode.json", help="result JSON path (default: %(default)s)")
    ap.add_argument("--model", default="k3-tiny", help="preset or checkpoint directory (default: %(default)s)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="concurrent requests (default: 1 16)")
    ap.add_argument("--gamma", type=int, default=4, help="drafts per verify block (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per request (default: %(default)s)")
    ap.add_argument("--oracle-accuracy", type=float, nargs="*", default=[0.6, 0.9],
                    help="per-token draft accuracies for the oracle drafter (default: 0.6 0.9)")
    args = ap.parse_args(argv)
    model = load_model(args.model, seed=0)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    runs = [("ngram", None)] + [(f"oracle@{p}", p) for p in args.oracle_accuracy]
    bar = tqdm(total=len(args.batches) * (1 + len(runs)), desc="spec_decode")
    for batch in args.batches:
        ps = prompts(model.tokenizer, batch)
        kw = dict(max_running=batch, max_seq_len=max(map(len, ps)) + args.max_new_tokens + 64, prefill_chunk=256,
                  single_bucket=True, warmup=True)
        base = LLM(model, **kw)
        ref, _, base_fig = timed(base, ps, sp)
        bar.update()
        answers = {tuple(p): o for p, o in zip(ps, ref)}
        rows.append({"batch": batch, "drafter": "none", **base_fig})
        for name, acc in runs:
            if acc is None:
                drafter = "ngram"
            else:
                drafter = OracleDrafter(answers, model.config.vocab_size, right=leading_right(acc))
            llm = LLM(model, speculative=drafter, num_draft_tokens=args.gamma, **kw)
            got, _, fig = timed(llm, ps, sp)
            st = llm.stats
            blocks = st.get("spec_blocks", 0)
            rows.append({"batch": batch, "drafter": name, **fig, "identical_to_baseline": got == ref,
                         "verify_steps_per_request": blocks / batch,
                         "drafted": st.get("spec_drafted", 0), "accepted": st.get("spec_accepted", 0),
                         "acceptance_length": (blocks + st.get("spec_accepted", 0)) / max(blocks, 1),
                         "speedup_vs_baseline": fig["decode_tokens_per_s"] / base_fig["decode_tokens_per_s"]})
            assert got == ref, f"{name} at batch {batch}: speculative output differs from plain greedy decoding"
            bar.update()
    bar.close()
    res = {"bench": "spec_decode", **run_meta(), "model": args.model, "gamma": args.gamma,
           "max_new_tokens": args.max_new_tokens, "results": rows,
           "note": "CPU, k3-tiny with random weights; timings include host scheduling; acceptance_length = "
                   "tokens committed per verify step (1 + accepted drafts)"}
    write_json(args.out, res)
    print(f"{'batch':>5} {'drafter':>12} {'tok/s':>8} {'x base':>7} {'accept len':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['drafter']:>12} {r['decode_tokens_per_s']:>8.1f} "
              f"{r.get('speedup_vs_baseline', 1.0):>7.2f} {r.get('acceptance_length', 1.0):>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
