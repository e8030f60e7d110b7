"""Batch invariance of the step: does a token's logit row depend on the shape of the step it runs in?

Speculative decoding is greedy-identical to plain decoding only if a token's logits come out bit for
bit the same in a verify step (blocks of gamma + 1 tokens per sequence) as in a plain decode step
(one token per sequence), and plain batching needs the same between decode-only and mixed
(decode + prefill) steps. The KDA kernels are bit-identical between verify + fold and decode
(tests/gpu); this script measures the rest of the step, on whatever backend JAX runs on:

1. step: one sequence with a prompt in context; its next token's logit row from a plain decode
   step (D = 4 slots), from a mixed step (the same decode plus a 128-token prefill of another
   sequence) and from slot 0 of a verify block (`forward_verify`, block = gamma + 1). Max abs
   difference against the plain decode row, and whether it is exactly 0.
2. gemm: for every distinct 2-D weight shape of the model, row 0 of x[:M] @ W at the row counts
   these steps use (M = 4, 20, 132, 148 and 1), against M = 4.

    python3 bench/batch_invariance.py --out bench/results/batch_invariance_h200.json

Measured on the CPU (k3-tiny with 128-wide KDA heads, f32, XLA path; `results/batch_invariance_cpu.json`):
the step is not bitwise batch-invariant there either. The logit rows differ by up to ~4e-5, and
4 of the 10 GEMM shapes give a different row 0 at M = 1, 132 and 148 than at M = 4 (~1e-6). The
differences are small enough that tests/test_engine.py's speculative runs stay token-identical
on the CPU. On the H200 the engine's speculative tokens differ from plain decoding (bench/NOTES.md,
"Engine on the H200"). Measured there (session 10, `results/batch_invariance_h200.json`): the logit
row moves by ~0.02 between verify and decode steps, and f32 GEMM rows at M = 1 differ from M = 4 by
~1e-3, TF32-sized. Since session 12 an f32 model's step multiplies at "highest" precision
(`k3jax.model.forward.matmul_precision`) and so does this script's GEMM check: not yet run on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._common import run_meta, write_json  # noqa: E402
from k3jax.api import LOGITS_PAGE_SIZE, load_model  # noqa: E402
from k3jax.engine.runner import SeqWork, pack_step  # noqa: E402
from k3jax.model.forward import forward, forward_verify, split_layers  # noqa: E402
from k3jax.model.init import init_params  # noqa: E402
from k3jax.state import init_state  # noqa: E402


def build_model(name: str, kda_head_dim: int | None, impl: str):
    base = load_model(name, seed=0)
    if kda_head_dim is None:
        return dataclasses.replace(base, impl=impl)
    cfg = base.config.replace(name=f"{name}-k{kda_head_dim}", kda_head_dim=kda_head_dim)
    return dataclasses.replace(base, config=cfg, params=split_layers(init_params(cfg, 0)), impl=impl)


def step_rows(model, prompt_len: int, gamma: int, seed: int) -> dict:
    """The next token's logit row in a decode, a mixed and a verify step, from the same state."""
    cfg, params, impl = model.config, model.params, model.impl
    ps = LOGITS_PAGE_SIZE
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
    other = rng.integers(0, cfg.vocab_size, 128).tolist()
    D, B = 4, gamma + 1
    ctx_pages = -(-(prompt_len + B) // ps)
    pages_a = list(range(1, ctx_pages + 1))  # sequence A in slot 1
    pages_b = list(range(ctx_pages + 1, ctx_pages + 1 + -(-128 // ps)))  # the prefilled sequence in slot 2
    npp = max(len(pages_a), len(pages_b))
    state = init_state(cfg, slots=3, pages=pages_b[-1] + 1, page_size=ps)
    fwd = jax.jit(forward, static_argnames=("cfg", "impl"))
    ver = jax.jit(forward_verify, static_argnames=("cfg", "block", "impl"))

    P = -(-prompt_len // 64) * 64
    pre = pack_step([], [SeqWork(prompt, 0, 1, pages_a)], D=0, P=P, NP=1, pages_per_seq=npp)
    logits, state = fwd(params, state, pre.batch, cfg=cfg, impl=impl)
    t0 = int(np.asarray(logits)[pre.rows[0]].argmax(-1).reshape(-1)[-1])
    fresh = lambda: jax.tree.map(jnp.copy, state)
    work = SeqWork([t0], prompt_len, 1, pages_a)

    dec = pack_step([work], [], D=D, P=0, NP=0, pages_per_seq=npp)
    first = lambda out, rows: np.asarray(out[0])[rows[0]].reshape(-1, cfg.vocab_size)[0]
    row_dec = first(fwd(params, fresh(), dec.batch, cfg=cfg, impl=impl), dec.rows)
    mix = pack_step([work], [SeqWork(other, 0, 2, pages_b)], D=D, P=128, NP=1, pages_per_seq=npp)
    row_mix = first(fwd(params, fresh(), mix.batch, cfg=cfg, impl=impl), mix.rows)
    block = SeqWork([t0] + rng.integers(0, cfg.vocab_size, gamma).tolist(), prompt_len, 1, pages_a)
    vb = pack_step([block], [], D=D, P=0, NP=0, pages_per_seq=npp, block=B)
    row_ver = first(ver(params, fresh(), vb.batch, cfg=cfg, block=B, impl=impl), vb.rows)

    diff = lambda a: float(np.abs(a.astype(np.float64) - row_dec.astype(np.float64)).max())
    return {"rows": {"decode": D, "mixed": D + 128, "verify": D * B},
            "mixed_vs_decode_maxabs": diff(row_mix), "verify_vs_decode_maxabs": diff(row_ver),
            "mixed_bitwise_equal": bool(np.array_equal(row_mix, row_dec)),
            "verify_bitwise_equal": bool(np.array_equal(row_ver, row_dec)),
            "same_argmax": bool(row_ver.argmax() == row_dec.argmax() == row_mix.argmax())}


def gemm_rows(params, cfg, ms=(1, 4, 20, 132, 148), seed=0) -> list[dict]:
    """Row 0 of x[:M] @ W for every distinct 2-D weight shape, against M = 4, at the matmul precision
    the model's step uses (`forward.matmul_precision`: "highest" for an f32 model since session 12)."""
    from k3jax.model.forward import matmul_precision

    shapes = sorted({(x.shape, str(x.dtype)) for x in jax.tree.leaves(params) if x.ndim == 2 and min(x.shape) >= 16})
    out = []
    key = jax.random.key(seed)

    def mm(x, w):
        with matmul_precision(cfg):
            return x @ w

    mm = jax.jit(mm)
    for (shape, dt) in tqdm(shapes, desc="gemm shapes", leave=False):
        k1, k2, key = jax.random.split(key, 3)
        w = jax.random.normal(k1, shape, jnp.float32).astype(dt) * shape[0] ** -0.5
        x = jax.random.normal(k2, (max(ms), shape[0]), jnp.float32).astype(dt)
        ref = np.asarray(mm(x[:4], w)[0], np.float64)
        d = {m: float(np.abs(np.asarray(mm(x[:m], w)[0], np.float64) - ref).max()) for m in ms if m != 4}
        out.append({"shape": list(shape), "dtype": dt, "row0_maxabs_vs_M4": d,
                    "bitwise_equal": all(v == 0.0 for v in d.values())})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-tiny", help="preset (random weights, seed 0); default: %(default)s")
    ap.add_argument("--kda-head-dim", type=int, default=128,
                    help="override the preset's KDA head dim (128: the Mosaic GPU kernels' shapes; 0 keeps the preset's)")
    ap.add_argument("--impl", default="auto", help="kernel choice: auto | xla | pallas | pallas_interpret")
    ap.add_argument("--prompt-len", type=int, default=100, help="tokens in context before the measured token")
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per verify block (block = gamma + 1)")
    ap.add_argument("--seeds", type=int, default=3, help="prompts measured (one seed each)")
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)

    model = build_model(args.model, args.kda_head_dim or None, args.impl)
    res = {"bench": "batch_invariance", **run_meta(), "model": model.config.name, "impl": args.impl,
           "matmul_precision": "highest" if jnp.dtype(model.config.dtype) == jnp.float32 else "default",
           "prompt_len": args.prompt_len, "gamma": args.gamma, "step": [], "gemm": []}
    for s in tqdm(range(args.seeds), desc="step shapes", leave=False):
        r = step_rows(model, args.prompt_len, args.gamma, s)
        res["step"].append(r)
        print(f"seed {s}: mixed vs decode {r['mixed_vs_decode_maxabs']:.3g}, verify vs decode "
              f"{r['verify_vs_decode_maxabs']:.3g}, same argmax {r['same_argmax']}", flush=True)
    res["gemm"] = gemm_rows(model.params, model.config)
    bad = [g for g in res["gemm"] if not g["bitwise_equal"]]
    print(f"gemm: {len(res['gemm']) - len(bad)} of {len(res['gemm'])} weight shapes give row 0 bit for bit at every M")
    for g in bad:
        print(f"  {g['shape']} {g['dtype']}: {g['row0_maxabs_vs_M4']}")
    if args.out:
        write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
