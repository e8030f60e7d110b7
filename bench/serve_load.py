"""Load benchmark of `k3jax-serve`: a real server subprocess on loopback, driven by this process.

    python bench/serve_load.py                     # k3-tiny on CPU; writes bench/results/serve_load.json

Starts `python -m serve.server` (the `k3jax-serve` entry point) for the model on 127.0.0.1 with a
free gRPC and metrics port, waits until health reports SERVING (warm-up compiles every step
bucket), then, for each concurrency level N, drives it with N concurrent grpc.aio clients (one
channel each):

- arrivals: a Poisson process of --request-rate requests/s (exponential gaps); an arrived request
  waits on the client side until one of the N clients is free (open loop with a concurrency cap,
  as vLLM's benchmark_serving with --max-concurrency);
- prompts: token ids; a --shared-prefix-frac share of them starts with one of --num-prefixes
  shared prefixes of --prefix-len tokens (a fresh set per level, so no level reuses another's
  cache); every prompt then has a unique part of log-uniform length in --prompt-len; output
  lengths are uniform in --output-len, exact: the requests set ignore_eos, so a random-weight model's
  EOS does not cut them short (--no-ignore-eos lets EOS finish them, as real traffic does);
- measured per request on the client: TTFT (send -> first streamed token), inter-token latency
  (gap between streamed responses, split evenly over the tokens a response carries, as the server's
  histogram does), TPOT ((e2e - TTFT) / (tokens - 1)), e2e latency, and the client-side queue wait
  (arrival -> send, not part of TTFT).

Reported per level: throughput (finished requests/s and output tokens/s over the level's wall time,
first send to last response), p50/p99 TTFT and inter-token latency, the prefix-cache hit rate
from the responses' usage (cached_tokens / prompt tokens) and from the server's Prometheus counters
(delta of k3jax_cached_tokens_total / k3jax_prompt_tokens_total over the level), plus the server's
own histogram estimates and the load average (the machine may be shared: see "noise" in the JSON).
On exit the server gets SIGTERM (drain, exit status 0 expected and recorded); it is killed if it
does not stop. `--target` drives an already running server instead (nothing is started or stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402
from tqdm import tqdm  # noqa: E402

from serve import pb  # noqa: E402
from serve.server import stop_process, wait_listening  # noqa: E402

NOISE = ("2-core CPU shared with a concurrently running test suite (pytest, XLA:CPU compiles): every figure "
         "is noisy, latencies most of all; see load_avg per level. Client and server share the same 2 cores.")


DEFINITIONS = {
    "duration_s": "first send to last response of the level",
    "requests_per_s / output_tokens_per_s": "finished requests / generated tokens over duration_s",
    "ttft_s": "client: Generate sent -> first response with tokens (excludes client_queue_wait_s)",
    "itl_s": "client: gap between responses with tokens, split evenly over the tokens of a response; tokens that "
             "arrive with the first one count 0 (as the server's histogram)",
    "tpot_s": "client, per request: (last token time - first token time) / (tokens - 1)",
    "e2e_s": "client: Generate sent -> last response",
    "client_queue_wait_s": "Poisson arrival -> send (waiting for one of the N clients)",
    "cache_hit_rate": "sum usage.cached_tokens / sum usage.prompt_tokens of the level's requests",
    "cache_hit_rate_upper_bound": "if every shared-prefix request but the first per prefix restored the prefix "
                                  "(rounded down to 64-token chunks)",
    "server_metrics": "deltas of the server's Prometheus counters/histograms over the level; p50_hist / p99_hist are "
                      "histogram_quantile-style bucket interpolations (coarse); step_host_ms / step_wait_ms: the "
                      "engine loop's mean time a step on the host and blocked on the device's tokens (with overlap "
                      "the host works on step N + 1 while the device runs N: wait ~0 means host-bound)",
    "p99": "numpy percentile (linear); with few requests it is close to the maximum",
}


def commit() -> str:
    try:
        c = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                    stderr=subprocess.DEVNULL).strip()
    except Exception:
        return os.environ.get("K3JAX_COMMIT", "unknown")
    try:  # the benchmarked code may be uncommitted
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "serve", "k3jax"], cwd=ROOT).returncode != 0
        untracked = subprocess.check_output(["git", "ls-files", "--others", "--exclude-standard", "serve", "k3jax"],
                                            cwd=ROOT, text=True).strip()
        return c + ("+dirty" if dirty or untracked else "")
    except Exception:
        return c


# ---- command line -----------------------------------------------------------------------------
def _rate(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], metavar="N",
                   help="concurrency levels: clients with a request in flight at most (default: 1 16 64)")
    w.add_argument("--requests", type=int, nargs="+", default=None, metavar="N",
                   help="measured requests per level: one value for every level or one per level (default: 8 per "
                        "client, at least 20, at most 320: 20 128 320 for 1 16 64, about 4-5 minutes with the "
                        "warm-up on a busy 2-core CPU)")
    w.add_argument("--request-rate", type=_rate, nargs="+", default=None, metavar="R",
                   help="Poisson arrival rate in requests/s, one value or one per level; inf: every request "
                        "arrives at t=0 (default: N/2 for N clients, at least 2: 2 8 32 for 1 16 64, above what "
                        "k3-tiny serves on a 2-core CPU, so the concurrency cap binds; lower it to measure "
                        "latency at a given load)")
    w.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="unique prompt tokens per request, log-uniform in [MIN, MAX] (default: 16 256)")
    w.add_argument("--output-len", type=int, nargs=2, default=[16, 32], metavar=("MIN", "MAX"),
                   help="max_new_tokens per request, uniform in [MIN, MAX] (default: 16 32)")
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="requests generate past the model's EOS, so each produces exactly its max_new_tokens "
                        "(default: on, as benchmarks of random-weight models want; --no-ignore-eos: EOS finishes them)")
    w.add_argument("--shared-prefix-frac", type=float, default=0.5, metavar="F",
                   help="share of requests whose prompt starts with a shared prefix (default: 0.5)")
    w.add_argument("--prefix-len", type=int, default=128, metavar="N",
                   help="tokens of each shared prefix (default: 128; the cache restores at 64-token chunk "
                        "boundaries, so a multiple of 64 can be restored whole)")
    w.add_argument("--num-prefixes", type=int, default=4, metavar="K",
                   help="distinct shared prefixes per level (default: 4)")
    w.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature of every request, 0 = greedy (default: 0); T > 0 sets a "
                        "per-request seed, so runs repeat")
    w.add_argument("--warmup-requests", type=int, default=4, metavar="N",
                   help="unmeasured requests (unique prompts) sent before the first level (default: 4)")
    w.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="deadline of each Generate call in seconds (default: 600)")
    w.add_argument("--seed", type=int, default=0, help="workload seed: prompts, lengths, arrivals (default: 0)")

    s = p.add_argument_group("server (started unless --target is given)")
    s.add_argument("--model", default="k3-tiny", help="preset or checkpoint directory (default: k3-tiny)")
    s.add_argument("--model-seed", type=int, default=0, metavar="S", help="seed of a preset's random weights (default: 0)")
    s.add_argument("--python", default=sys.executable, metavar="PATH",
                   help="Python interpreter that runs `-m serve.server` (default: this one)")
    s.add_argument("--platform", default="cpu", metavar="NAME",
                   help="JAX_PLATFORMS of the server (and of this process's device report) (default: cpu)")
    s.add_argument("--max-running", type=int, default=64, metavar="N",
                   help="server --max-running: the largest decode batch (default: 64, the top concurrency level)")
    s.add_argument("--max-seq-len", type=int, default=512, metavar="N", help="server --max-seq-len (default: 512)")
    s.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="server --prefill-chunk: prefill tokens per step (default: 256)")
    s.add_argument("--single-bucket", action=argparse.BooleanOptionalAction, default=True,
                   help="server --single-bucket: 2 compiles (~30 s), every step padded to the largest shapes "
                        "(max-running decode rows, prefill-chunk tokens); --no-single-bucket compiles every "
                        "bucket (31 with the defaults: ~7 minutes on a busy 2-core CPU) (default: on; off with "
                        "--decode-buckets)")
    s.add_argument("--decode-buckets", default=None, metavar="N,N,...",
                   help="server --decode-buckets: compile these decode batch sizes (ending with --max-running) and "
                        "the prefill-chunk mixed shapes, instead of --single-bucket, e.g. 1,16,64: 7 compiles "
                        "(default: none)")
    s.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="server --[no-]prefix-cache (default: on)")
    s.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for k3jax-serve, repeatable, e.g. --server-arg=--no-overlap")
    s.add_argument("--server-log", default=None, metavar="PATH",
                   help="server stdout/stderr (default: a temporary file, removed unless the server fails)")
    s.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for health SERVING (default: 600)")
    s.add_argument("--target", default=None, metavar="HOST:PORT",
                   help="drive this running server instead of starting one (server flags above are ignored)")
    s.add_argument("--metrics-url", default=None, metavar="URL",
                   help="with --target: its Prometheus endpoint, e.g. http://127.0.0.1:9400/metrics (default: none)")
    s.add_argument("--api-key", default=os.environ.get("K3JAX_API_KEY"), metavar="KEY",
                   help="with --target: API key sent as 'authorization: Bearer KEY' (default: $K3JAX_API_KEY)")

    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "serve_load.json"), metavar="PATH",
                   help="JSON output path (default: bench/results/serve_load.json); '' writes none")
    return p


def check_args(p: argparse.ArgumentParser, a) -> None:
    n = len(a.concurrency)
    if a.requests is None:
        a.requests = [min(320, max(20, 8 * c)) for c in a.concurrency]
    if a.request_rate is None:
        a.request_rate = [max(2.0, c / 2) for c in a.concurrency]
    for flag in ("requests", "request_rate"):
        v = getattr(a, flag)
        if len(v) not in (1, n):
            p.error(f"--{flag.replace('_', '-')}: give one value or one per level ({n}), got {len(v)}")
        setattr(a, flag, v * n if len(v) == 1 else v)
    if min(a.concurrency) < 1 or min(a.requests) < 1:
        p.error("--concurrency and --requests must be >= 1")
    if not 1 <= a.prompt_len[0] <= a.prompt_len[1] or not 1 <= a.output_len[0] <= a.output_len[1]:
        p.error("--prompt-len / --output-len: need 1 <= MIN <= MAX")
    if not 0 <= a.shared_prefix_frac <= 1:
        p.error(f"--shared-prefix-frac must be in [0, 1], got {a.shared_prefix_frac}")
    if a.prefix_len < 1 or a.num_prefixes < 1:
        p.error("--prefix-len and --num-prefixes must be >= 1")
    if not (a.temperature >= 0 and math.isfinite(a.temperature)):
        p.error(f"--temperature must be a finite number >= 0, got {a.temperature}")
    if a.target is None:
        longest = a.prefix_len * (a.shared_prefix_frac > 0) + a.prompt_len[1] + a.output_len[1]
        if longest > a.max_seq_len:
            p.error(f"the longest request ({longest} tokens: prefix + prompt + output) exceeds --max-seq-len "
                    f"{a.max_seq_len}")
        if max(a.concurrency) > a.max_running:
            print(f"note: concurrency {max(a.concurrency)} > --max-running {a.max_running}: the server queues the rest",
                  file=sys.stderr)


# ---- workload -----------------------------------------------------------------------------------
def make_level(a, level: int, n: int, rate: float, vocab: int, special: set[int]):
    """n requests of one level: dicts with prompt ids, max_new_tokens, arrival time, prefix id."""
    rng = np.random.default_rng([a.seed, level])
    ok = np.array([t for t in range(vocab) if t not in special])
    toks = lambda k: ok[rng.integers(0, len(ok), k)].tolist()
    prefixes = [toks(a.prefix_len) for _ in range(a.num_prefixes)]
    lo, hi = a.prompt_len
    gaps = rng.exponential(1.0 / rate, n) if math.isfinite(rate) else np.zeros(n)
    arrivals = np.cumsum(gaps) - (gaps[0] if n else 0)  # the first request arrives at t=0
    out = []
    for i in range(n):
        shared = rng.random() < a.shared_prefix_frac
        k = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi + 0.5)))))
        pid = int(rng.integers(a.num_prefixes)) if shared else None
        prompt = (prefixes[pid] if shared else []) + toks(min(max(k, lo), hi))
        out.append({"i": i, "prompt": prompt, "max_new_tokens": int(rng.integers(a.output_len[0], a.output_len[1] + 1)),
                    "arrival": float(arrivals[i]), "prefix": pid})
    return out


def gen_request(r: dict, a, rid: str):
    req = pb.GenerateRequest(request_id=rid, max_new_tokens=r["max_new_tokens"], ignore_eos=a.ignore_eos)
    req.token_ids.ids.extend(r["prompt"])
    req.sampling.temperature = a.temperature
    if a.temperature > 0:
        req.sampling.seed = zlib.crc32(f"{a.seed}:{rid}".encode()) & 0x7FFFFFFF
    return req


# ---- metrics ------------------------------------------------------------------------------------
def scrape(url: str | None) -> dict | None:
    """{(name, labels): value} of every sample at the endpoint (None without one or on failure)."""
    if not url:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _hist_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus histogram_quantile over cumulative (le, count) pairs (linear within a bucket)."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, prev_le, prev_c = q * total, 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-12)
        prev_le, prev_c = le, c
    return prev_le


def metrics_delta(before: dict | None, after: dict | None) -> dict | None:
    """The server's view of one level: counter deltas, histogram mean / p50 / p99 estimates."""
    if before is None or after is None:
        return None
    d = lambda name, labels=(): after.get((name, labels), 0.0) - before.get((name, labels), 0.0)
    prompt, cached = d("k3jax_prompt_tokens_total"), d("k3jax_cached_tokens_total")
    out = {"prompt_tokens": prompt, "cached_tokens": cached, "cache_hit_rate": cached / prompt if prompt else None,
           "generation_tokens": d("k3jax_generation_tokens_total"),
           "requests": {dict(k[1])["finish_reason"]: after[k] - before.get(k, 0.0)
                        for k in after if k[0] == "k3jax_requests_total" and after[k] - before.get(k, 0.0)},
           "errors": {dict(k[1])["code"]: after[k] - before.get(k, 0.0)
                      for k in after if k[0] == "k3jax_request_errors_total" and after[k] - before.get(k, 0.0)},
           "cache_hit_rate_cumulative_gauge": after.get(("k3jax_cache_hit_rate", ())),
           "kv_token_usage_after": after.get(("k3jax_token_usage", ()))}
    steps = d("k3jax_engine_steps_total")  # the engine loop: host work and device wait per step
    out["engine_steps"] = steps
    out["step_host_ms"] = d("k3jax_engine_step_host_seconds_total") * 1e3 / steps if steps else None
    out["step_wait_ms"] = d("k3jax_engine_step_wait_seconds_total") * 1e3 / steps if steps else None
    for short, name in (("ttft_s", "k3jax_time_to_first_token_seconds"), ("itl_s", "k3jax_inter_token_latency_seconds"),
                        ("e2e_s", "k3jax_e2e_request_latency_seconds")):
        n = d(name + "_count")
        buckets = [(float(dict(k[1])["le"]), after[k] - before.get(k, 0.0)) for k in after if k[0] == name + "_bucket"]
        out[short] = {"count": n, "mean": d(name + "_sum") / n if n else None,
                      "p50_hist": _hist_quantile(0.5, buckets), "p99_hist": _hist_quantile(0.99, buckets)}
    return out


# ---- the load -----------------------------------------------------------------------------------
def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def summary(xs) -> dict:
    return {"p50": pct(xs, 50), "p99": pct(xs, 99), "mean": float(np.mean(xs)) if len(xs) else None}


async def one_request(stub, req, metadata, timeout):
    """Stream one request: (send time, [(time, n tokens)], last response)."""
    t_send = time.perf_counter()
    events, last = [], None
    async for r in stub.Generate(req, metadata=metadata, timeout=timeout):
        n = len(r.token_ids)
        if n:
            events.append((time.perf_counter(), n))
        last = r
    return t_send, events, last


async def drive(target: str, a, reqs: list[dict], concurrency: int, tag: str, metadata, pbar=None) -> dict:
    """Send `reqs` (arrival times relative to the start) with at most `concurrency` in flight."""
    queue: asyncio.Queue = asyncio.Queue()
    records: list[dict] = []
    t0 = time.perf_counter()

    async def arrivals():
        for r in reqs:
            delay = t0 + r["arrival"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            queue.put_nowait(r)
        for _ in range(concurrency):
            queue.put_nowait(None)

    async def client(k: int):
        async with grpc.aio.insecure_channel(target) as ch:
            stub = pb.GenerationStub(ch)
            while (r := await queue.get()) is not None:
                rec = {"i": r["i"], "prompt_tokens": len(r["prompt"]), "prefix": r["prefix"],
                       "max_new_tokens": r["max_new_tokens"], "arrival": t0 + r["arrival"]}
                try:
                    rec["send"], events, last = await one_request(
                        stub, gen_request(r, a, f"{tag}-{r['i']}"), metadata, a.timeout)
                    rec["events"] = events
                    rec["end"] = time.perf_counter()
                    u = last.usage
                    rec.update(finish=pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower(),
                               usage_prompt=u.prompt_tokens, cached=u.cached_tokens, completion=u.completion_tokens)
                except grpc.aio.AioRpcError as e:
                    rec["error"] = f"{e.code().name}: {e.details()}"
                    rec.setdefault("send", rec["arrival"])
                    rec["end"] = time.perf_counter()
                records.append(rec)
                if pbar is not None:
                    pbar.update()

    await asyncio.gather(arrivals(), *(client(k) for k in range(concurrency)))
    return {"records": records, "t0": t0}


def level_figures(recs: list[dict], concurrency: int, rate: float, a) -> dict:
    ok = [r for r in recs if "error" not in r]
    ttft, itl, tpot, e2e, wait = [], [], [], [], []
    for r in ok:
        ev = r["events"]
        wait.append(r["send"] - r["arrival"])
        e2e.append(r["end"] - r["send"])
        if not ev:
            continue
        ttft.append(ev[0][0] - r["send"])
        for (tp, _), (t, n) in zip(ev, ev[1:]):
            itl.extend([(t - tp) / n] * n)
        itl.extend([0.0] * (ev[0][1] - 1))  # tokens that arrived with the first one
        ntok = sum(n for _, n in ev)
        if ntok > 1:
            tpot.append((ev[-1][0] - ev[0][0]) / (ntok - 1))
    start = min(r["send"] for r in recs)
    end = max(r["end"] for r in recs)
    dur = end - start
    out_tokens = sum(r["completion"] for r in ok)
    prompt = sum(r["usage_prompt"] for r in ok)
    cached = sum(r["cached"] for r in ok)
    shared = [r for r in ok if r["prefix"] is not None]
    sh_prompt = sum(r["usage_prompt"] for r in shared)
    # upper bound of the hit rate: every shared request but the first of its prefix restores the prefix
    # (at 64-token chunk granularity, as the recurrent-state checkpoints are chunk-aligned)
    restorable = (len(shared) - len({r["prefix"] for r in shared})) * (a.prefix_len // 64 * 64)
    reasons: dict = {}
    for r in ok:
        reasons[r["finish"]] = reasons.get(r["finish"], 0) + 1
    return {
        "concurrency": concurrency, "request_rate": rate if math.isfinite(rate) else "inf",
        "requests": len(recs), "completed": len(ok), "failed": len(recs) - len(ok),
        "errors": sorted({r["error"] for r in recs if "error" in r})[:5],
        "duration_s": dur, "requests_per_s": len(ok) / dur, "output_tokens_per_s": out_tokens / dur,
        "prompt_tokens_per_s": prompt / dur, "output_tokens": out_tokens, "prompt_tokens": prompt,
        "cached_tokens": cached, "cache_hit_rate": cached / prompt if prompt else None,
        "cache_hit_rate_shared_requests": sum(r["cached"] for r in shared) / sh_prompt if sh_prompt else None,
        "cache_hit_rate_upper_bound": restorable / prompt if prompt else None,
        "shared_prefix_requests": len(shared),
        "finish_reasons": reasons,
        "ttft_s": summary(ttft), "itl_s": summary(itl), "tpot_s": summary(tpot), "e2e_s": summary(e2e),
        "client_queue_wait_s": summary(wait),
    }


# ---- the server ---------------------------------------------------------------------------------
def server_env(a) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=a.platform, PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    env.pop("PJRT_NPROC", None)  # test-suite setting: 32 XLA:CPU threads on 2 cores slow a step ~8x
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def _die_with_parent():  # the server gets SIGTERM if this process dies without cleaning up
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Server:
    def __init__(self, a):
        self.cmd = [a.python, "-m", "serve.server", "--model", a.model, "--model-seed", str(a.model_seed),
                    "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--max-running", str(a.max_running),
                    "--max-seq-len", str(a.max_seq_len), "--prefill-chunk", str(a.prefill_chunk),
                    "--drain-timeout", "30",
                    "--prefix-cache" if a.prefix_cache else "--no-prefix-cache",
                    *(["--single-bucket"] if a.single_bucket and not a.decode_buckets else []),
                    *(["--decode-buckets", a.decode_buckets, "--prefill-buckets", str(a.prefill_chunk)]
                      if a.decode_buckets else []), *a.server_arg]
        self.keep_log = a.server_log is not None
        self.log_path = a.server_log or tempfile.mkstemp(prefix="serve_load_", suffix=".log")[1]
        self._log = open(self.log_path, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=server_env(a), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.exit_code = None
        self.failed = False

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def ports(self, timeout: float = 120.0) -> tuple[str, str]:
        try:
            return wait_listening(self.log, self.proc, timeout)
        except RuntimeError as e:
            self.failed = True
            raise RuntimeError(f"{e}; log: {self.log_path}") from None

    def wait_ready(self, target: str, timeout: float) -> float:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        note = time.monotonic() + 30
        print("waiting for the server's warm-up (compiling the step buckets) ...", file=sys.stderr)
        with grpc.insecure_channel(target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    st = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    if st == health_pb2.HealthCheckResponse.SERVING:
                        return time.perf_counter() - self.t0
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
                if time.monotonic() > note:
                    print(f"  ... still warming up after {time.perf_counter() - self.t0:.0f} s", file=sys.stderr)
                    note += 30
        self.failed = True
        raise RuntimeError(f"the server is not SERVING (rc={self.proc.poll()}); log: {self.log_path}")

    def stop(self) -> int | None:
        """SIGTERM (drain), then kill after 60 s; the exit status."""
        self.exit_code = stop_process(self.proc)
        self._log.close()
        if self.exit_code != 0:
            self.failed = True
        if self.failed:
            print(f"server log: {self.log_path}", file=sys.stderr)
        elif not self.keep_log:
            os.unlink(self.log_path)
        return self.exit_code


def model_info(target: str, metadata) -> dict:
    from google.protobuf import json_format

    with grpc.insecure_channel(target) as ch:
        info = pb.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=60)
    d = json_format.MessageToDict(info, preserving_proto_field_name=True)
    if d.get("config", {}).get("config_json"):
        d["config"]["config_json"] = json.loads(d["config"]["config_json"])
    return d


def device_report(a) -> dict:
    """JAX version and device of the server's platform (this process, same environment)."""
    if a.target is not None:  # a server elsewhere: its device is not known here
        from importlib.metadata import version

        return {"jax": version("jax"), "device": "unknown (--target)"}
    os.environ["JAX_PLATFORMS"] = a.platform
    import jax

    d = jax.devices()[0]
    return {"jax": jax.__version__, "device": str(d), "device_kind": d.device_kind, "platform": d.platform}


# ---- main ---------------------------------------------------------------------------------------
def run(a, target: str, metrics_url: str | None, metadata, info: dict) -> list[dict]:
    vocab = int(info["config"]["vocab_size"])
    cfgj = info["config"].get("config_json", {})
    special = {cfgj.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} - {None}
    rows = []
    if a.warmup_requests:
        warm = make_level(a, 10_000, a.warmup_requests, float("inf"), vocab, special)
        for r in warm:
            r["prefix"] = None
        asyncio.run(drive(target, a, warm, min(4, len(warm)), "warmup", metadata))
    for level, (c, n, rate) in enumerate(zip(a.concurrency, a.requests, a.request_rate)):
        reqs = make_level(a, level, n, rate, vocab, special)
        before, load0 = scrape(metrics_url), os.getloadavg()
        with tqdm(total=n, desc=f"concurrency {c:>3}", unit="req", file=sys.stderr) as bar:
            res = asyncio.run(drive(target, a, reqs, c, f"c{c}-l{level}", metadata, bar))
        row = level_figures(res["records"], c, rate, a)
        row["server_metrics"] = metrics_delta(before, scrape(metrics_url))
        row["load_avg_1m"] = {"start": load0[0], "end": os.getloadavg()[0]}
        rows.append(row)
        f = lambda x: "-" if x is None else f"{x * 1e3:.0f}"
        print(f"concurrency {c:>3}: {row['completed']}/{n} ok in {row['duration_s']:.1f} s, "
              f"{row['requests_per_s']:.2f} req/s, {row['output_tokens_per_s']:.1f} out tok/s; "
              f"TTFT p50/p99 {f(row['ttft_s']['p50'])}/{f(row['ttft_s']['p99'])} ms; "
              f"ITL p50/p99 {f(row['itl_s']['p50'])}/{f(row['itl_s']['p99'])} ms; "
              f"cache hit {row['cache_hit_rate']:.3f} (upper bound {row['cache_hit_rate_upper_bound']:.3f})"
              + step_figures(row.get("server_metrics")), file=sys.stderr)
    return rows


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    check_args(p, a)
    t_start = time.perf_counter()
    res = {"bench": "serve_load", "commit": commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "grpcio": grpc.__version__, "noise": NOISE, "model": a.model, "definitions": DEFINITIONS}
    server = None
    try:
        if a.target is None:
            server = Server(a)
            target, metrics_url = server.ports()
            metadata = ()
        else:
            target, metrics_url = a.target, a.metrics_url
            metadata = (("authorization", f"Bearer {a.api_key}"),) if a.api_key else ()
        res.update(device_report(a))  # while the server warms up
        if server is not None:
            res["server"] = {"command": ["python" if i == 0 else x for i, x in enumerate(server.cmd)],
                             "ready_s": server.wait_ready(target, a.ready_timeout)}
            print(f"server SERVING after {res['server']['ready_s']:.1f} s", file=sys.stderr)
        else:
            res["server"] = {"target": target}
        info = model_info(target, metadata)
        res["model_config"] = info.get("config", {})
        res["server"].update(limits=info.get("limits", {}), features=info.get("features", {}))
        res["workload"] = {k: v for k, v in vars(a).items()
                           if k not in ("out", "server_log", "python", "api_key", "target", "metrics_url")}
        res["workload"]["request_rate"] = [r if math.isfinite(r) else "inf" for r in a.request_rate]
        res["results"] = run(a, target, metrics_url, metadata, info)
    finally:
        if server is not None:
            code = server.stop()
            res.setdefault("server", {})["exit_code"] = code
    res["wall_s"] = time.perf_counter() - t_start
    print(table(res["results"]))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        print(f"wrote {a.out}", file=sys.stderr)
    return 0 if server is None or server.exit_code == 0 else 1


def step_figures(sm: dict | None) -> str:
    """'; engine N steps, host H / wait W ms a step' from a level's server metrics ('' without them)."""
    if not sm or not sm.get("engine_steps"):
        return ""
    return f"; engine {sm['engine_steps']:.0f} steps, host {sm['step_host_ms']:.2f} / wait {sm['step_wait_ms']:.2f} ms a step"


def table(rows: list[dict]) -> str:
    ms = lambda x: "-" if x is None else f"{x * 1e3:,.0f}"
    f2 = lambda x: "-" if x is None else f"{x:.2f}"
    lines = ["| concurrency | requests | req/s | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
             "| cache hit (usage) | cache hit (metrics) | step host / wait (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sm = r.get("server_metrics") or {}
        hit_m = sm.get("cache_hit_rate")
        lines.append(f"| {r['concurrency']} | {r['completed']}/{r['requests']} | {r['requests_per_s']:.2f} | "
                     f"{r['output_tokens_per_s']:.1f} | {ms(r['ttft_s']['p50'])} / {ms(r['ttft_s']['p99'])} | "
                     f"{ms(r['itl_s']['p50'])} / {ms(r['itl_s']['p99'])} | {r['cache_hit_rate']:.2f} | "
                     f"{'-' if hit_m is None else f'{hit_m:.2f}'} | {f2(sm.get('step_host_ms'))} / "
                     f"{f2(sm.get('step_wait_ms'))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
