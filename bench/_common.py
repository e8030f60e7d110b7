"""What every benchmark result records about the run: commit (with +dirty when the measured code
has uncommitted changes), machine, JAX version and devices, and the UTC time."""

from __future__ import annotations

import collections
import datetime
import glob
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit(paths=("k3jax", "pallas_kernels", "sharding", "serve")) -> str:
    try:
        c = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                    stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *paths], cwd=ROOT).returncode != 0
    untracked = subprocess.check_output(["git", "ls-files", "--others", "--exclude-standard", *paths], cwd=ROOT,
                                        text=True).strip()
    return c + ("+dirty" if dirty or untracked else "")


def run_meta() -> dict:
    import jax

    dev = jax.devices()[0]
    return {"commit": commit(), "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "jax": jax.__version__, "device": f"{dev.platform}:{dev.device_kind}",
            "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def write_json(path: str, res: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


def device_events(run, steps, device="/device:GPU"):
    """Runs `run()` `steps` times under `jax.profiler.trace` -> the trace's complete events ("X",
    with "ts" and "dur" in us) on the processes whose name contains `device`."""
    import jax

    d = tempfile.mkdtemp(prefix="k3prof")
    try:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(run())
        path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        tr = json.load(gzip.open(path))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    pids = {p for p, n in procs.items() if device in n}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e]


def kernel_summary(events, per):
    """Device events of `per` steps -> per step: each kernel's count and us, the busy time (the union
    of the kernel intervals), and the span from the first kernel's start to the last one's end (its
    gaps included); and the idle gaps between consecutive kernels (median, and the median of those
    under 200 us, which leaves out the host round trips between timed calls)."""
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        by[e["name"][:80]][0] += 1
        by[e["name"][:80]][1] += e["dur"]
    iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    busy, end = 0.0, None
    for a, b in iv:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    gaps = sorted(max(0.0, b[0] - a[1]) for a, b in zip(iv, iv[1:]))
    short = [x for x in gaps if x < 200.0]
    med = lambda xs: xs[len(xs) // 2] if xs else None
    return {"kernels": {n: {"per_step": c / per, "us_per_step": t / per, "mean_us": t / c}
                        for n, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])},
            "busy_us_per_step": busy / per,
            "span_us_per_step": (iv[-1][1] - iv[0][0]) / per if iv else 0.0,
            "gap_us_median": med(gaps), "gap_us_median_under_200": med(short), "gaps_over_200": len(gaps) - len(short)}


_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
              "f64": 8, "s64": 8, "u64": 8}
_HLO_COPY = re.compile(r"= (\w+)\[([\d,]*)\](?:\{[^}]*\})? copy\(")


def hlo_copies(text: str, top: int = 8) -> dict:
    """The `copy` instructions of a compiled module's HLO text (`compiled.as_text()`): their count and MB in
    the ENTRY computation (run once a step) and in the other computations (while-loop bodies: run once a
    trip, so a lower bound there), the module's while loops, and the largest copy shapes by MB. What the
    batch-invariant mode's row-block loops cost in copies is read from this (bench/NOTES.md, session 23)."""
    start = text.find("\nENTRY ")
    end = text.find("\n}\n", start) if start >= 0 else -1
    entry = text[start:end if end >= 0 else len(text)] if start >= 0 else ""
    rest = text[:start] + text[end:] if start >= 0 and end >= 0 else (text[:start] if start >= 0 else text)

    def scan(part, shapes):
        n, nbytes = 0, 0
        for m in _HLO_COPY.finditer(part):
            size = _HLO_BYTES.get(m.group(1), 4)
            for d in filter(None, m.group(2).split(",")):
                size *= int(d)
            n, nbytes = n + 1, nbytes + size
            shapes[f"{m.group(1)}[{m.group(2)}]"] += size
        return n, nbytes / 1e6

    shapes = collections.Counter()
    en, emb = scan(entry, shapes)
    on, omb = scan(rest, shapes)
    return {"entry_count": en, "entry_mb": round(emb, 3), "other_count": on, "other_mb": round(omb, 3),
            "whiles": text.count(" while("),
            "top_mb": {k: round(v / 1e6, 3) for k, v in shapes.most_common(top)}}
