"""The vision tower (MoonViT3d + projector, `k3jax.model.vision.encode`) at K3's published size (27 blocks, width
1152, 16 heads; projector to 7168) with random bf16 weights: time per image at several square resolutions, with
the attention as XLA's einsum-softmax-einsum (the default) and as `jax.nn.dot_product_attention`'s cuDNN kernel,
and the largest difference between the two forms' outputs.

    python3 bench/vision.py --sizes 448 896 1344 --attn xla cudnn --out bench/results/vision.json

Each row: the image's patch grid and LM tokens, the compile time, and the median over --iters calls (each
blocked on its output) of `encode` on the preprocessed patches (preprocessing on the host is timed apart)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench._common import run_meta, write_json  # noqa: E402
from k3jax.config import VisionConfig  # noqa: E402
from k3jax.model.vision import encode, init_vision_params, preprocess_image  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[448, 896, 1344],
                    help="square image sizes in pixels (default: %(default)s)")
    ap.add_argument("--attn", nargs="+", default=["xla", "cudnn"], choices=["xla", "cudnn"],
                    help="attention forms to time (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per row (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", help="parameter dtype (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/vision.json", help="JSON output (default: %(default)s)")
    args = ap.parse_args(argv)

    vcfg = VisionConfig()
    params = init_vision_params(vcfg, jax.random.PRNGKey(0), args.dtype)
    rows = []
    rng = np.random.default_rng(0)
    for size in tqdm(args.sizes, desc="image sizes"):
        img = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        t = time.perf_counter()
        patches, grid = preprocess_image(img, vcfg)
        prep_ms = (time.perf_counter() - t) * 1e3
        outs = {}
        for attn in args.attn:
            row = dict(size=size, grid=list(grid), patches=int(patches.shape[0]), attn=attn, preprocess_ms=prep_ms)
            try:
                t = time.perf_counter()
                out = jax.block_until_ready(encode(params, vcfg, patches, (grid,), attn=attn))
                row["compile_s"] = time.perf_counter() - t
                row["tokens"] = int(out.shape[0])
                ts = []
                for _ in range(args.iters):
                    t = time.perf_counter()
                    jax.block_until_ready(encode(params, vcfg, patches, (grid,), attn=attn))
                    ts.append((time.perf_counter() - t) * 1e3)
                row["ms"] = statistics.median(ts)
                outs[attn] = np.asarray(out, np.float32)
            except Exception as e:  # e.g. no cuDNN kernel for this shape: recorded, the other forms still run
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(row, flush=True)
        if len(outs) == 2:
            a, b = outs.values()
            rows[-1]["max_abs_diff_vs_xla"] = float(np.abs(a - b).max())
            rows[-1]["max_abs_xla"] = float(np.abs(a).max())
    write_json(args.out, run_meta() | dict(config=dict(vars(vcfg)), dtype=args.dtype, results=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
