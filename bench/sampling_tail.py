"""What the step's sampling tail costs, and what the always-on logit bias adds to it.

The engine's tail (`k3jax.engine.runner._sample_step`) gathers each logit row's penalty counts and bias row from
the per-request buffers (`sampling.penalized`), samples, and counts the samples. Both gathers run every step (no
device-side branch). This times `penalized` + `sample` with the bias rows and without them (bias=None: the tail
before logit bias existed), greedy and sampled, at K3's vocabulary (163,840) and k3-mini's (32,768).

    python bench/sampling_tail.py --out bench/results/sampling_tail.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from k3jax.sampling import penalized, request_keys, sample  # noqa: E402


def _tail(with_bias: bool, hot: bool):
    def f(logits, counts, bias, rows, rep, pres, freq, temp, top_k, top_p, keys):
        scored = penalized(logits, counts, rows, rep, pres, freq, bias if with_bias else None)
        return sample(scored, temp, top_k, top_p, keys, hot=hot)

    return jax.jit(f)


def _median_ms(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[163840, 32768], help="vocabulary sizes (default: %(default)s)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256], help="logit rows a step (default: %(default)s)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per row, median reported (default: %(default)s)")
    p.add_argument("--out", default="bench/results/sampling_tail.json", help="JSON output (default: %(default)s)")
    a = p.parse_args(argv)
    results = []
    cases = [(x, r, hot) for x in a.vocab for r in a.rows for hot in (False, True)]
    for x, r, hot in tqdm(cases, desc="sampling tail"):
        rng = np.random.default_rng(0)
        P = r + 1  # one buffer row per request, row 0 nobody's
        args = (jnp.asarray(rng.normal(size=(r, x)).astype(np.float32)), jnp.zeros((P, x), jnp.int32),
                jnp.zeros((P, x), jnp.float32), jnp.arange(1, r + 1, dtype=jnp.int32), jnp.ones(r, jnp.float32),
                jnp.zeros(r, jnp.float32), jnp.zeros(r, jnp.float32), jnp.full(r, 0.7 if hot else 0.0, jnp.float32),
                jnp.zeros(r, jnp.int32), jnp.ones(r, jnp.float32), jnp.asarray(request_keys(range(r), [0] * r)))
        base = _median_ms(_tail(False, hot), args, a.iters)
        biased = _median_ms(_tail(True, hot), args, a.iters)
        results.append({"vocab": x, "rows": r, "sampled": hot, "without_bias_ms": base, "with_bias_ms": biased,
                        "bias_overhead_ms": biased - base, "bias_bytes_read": r * x * 4})
        print(json.dumps(results[-1]), flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    out = {"bench": "sampling_tail", "commit": commit, "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "iters": a.iters, "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
