"""The vision tower (MoonViT3d + projector) at K3's published size (27 blocks, width 1152, 16 heads; projector to
7168) with random bf16 weights: time per image at several square resolutions, with the attention as XLA's
einsum-softmax-einsum and as `jax.nn.dot_product_attention`'s cuDNN kernel, through `encode` (compiled for the
image's grid: path "grid") and `encode_image` (padded to a power-of-two patch bucket, what `Model` runs: path
"bucket"), and the largest difference of each row's output from the first row's of its image.

    python3 bench/vision.py --sizes 448 896 1344 --attn xla cudnn --paths grid bucket --out bench/results/vision.json

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
from k3jax.model.vision import encode, encode_image, init_vision_params, patch_bucket, preprocess_image  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[448, 896, 1344],
                    help="square image sizes in pixels (default: %(default)s)")
    ap.add_argument("--attn", nargs="+", default=["xla", "cudnn"], choices=["xla", "cudnn"],
                    help="attention forms to time (default: %(default)s)")
    ap.add_argument("--paths", nargs="+", default=["grid", "bucket"], choices=["grid", "bucket"],
                    help="encode per grid and / or padded to the patch bucket (default: %(default)s)")
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
        first = None
        for path in args.paths:
            for attn in args.attn:
                fn = ((lambda: encode(params, vcfg, patches, (grid,), attn=attn)) if path == "grid"
                      else (lambda: encode_image(params, vcfg, patches, grid, attn=attn)))
                row = dict(size=size, grid=list(grid), patches=int(patches.shape[0]), path=path, attn=attn,
                           bucket=patch_bucket(int(patches.shape[0])) if path == "bucket" else None,
                           preprocess_ms=prep_ms)
                try:
                    t = time.perf_counter()
                    out = jax.block_until_ready(fn())
                    row["compile_s"] = time.perf_counter() - t
                    row["tokens"] = int(out.shape[0])
                    ts = []
                    for _ in range(args.iters):
                        t = time.perf_counter()
                        jax.block_until_ready(fn())
                        ts.append((time.perf_counter() - t) * 1e3)
                    row["ms"] = statistics.median(ts)
                    out = np.asarray(out, np.float32)
                    if first is None:
                        first = out
                        row["max_abs_out"] = float(np.abs(out).max())
                    else:
                        row["max_abs_diff_vs_first"] = float(np.abs(out - first).max())
                except Exception as e:  # e.g. no cuDNN kernel for this shape: recorded, the other forms still run
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(row, flush=True)
    write_json(args.out, run_meta() | dict(config=dict(vars(vcfg)), dtype=args.dtype, results=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
