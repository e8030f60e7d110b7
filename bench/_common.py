"""What every benchmark result records about the run: commit (with +dirty when the measured code
has uncommitted changes), machine, JAX version and devices, and the UTC time."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

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
