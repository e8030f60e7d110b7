"""Where the Mosaic GPU prep kernel's time goes: `mgpu._chunk_prep_call` (v7) alone, on the packed
rows of one sequence, against copies of it with one phase cut out (ablations,
"A_*": their outputs are wrong by design, only the time counts) or one candidate change applied.

Each variant is built from `pallas_kernels/kda/mgpu.py`'s source by exact text substitution, so a
variant whose target text has changed fails loudly (AssertionError naming it) instead of timing
something else; update the substitution with the kernel. Every variant's outputs are compared with
the unmodified kernel's (relative error per output, and whether all are finite): a candidate is
only worth landing with zeros there and tests/gpu passing.

    python3 bench/kda_prep_ablation.py --out bench/results/kda_prep_ablation_run.json

(`bench/results/kda_prep_ablation_h200.json` holds the runs so far, merged by hand under "runs".)

Needs an H100/H200 (run through the device tool). Timing: R launches inside one jit, the median
over 7 repeats, per launch. For ptxas's register / spill report, set
`MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=dir` (each variant's kernel is named `prep_<variant>`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._common import ROOT, run_meta, write_json  # noqa: E402

SRC_PATH = os.path.join(ROOT, "pallas_kernels", "kda", "mgpu.py")

_LEV_TABLE = """            x = ti() ^ ii()
            lev1 = jnp.where(x == 0, 0, 1)
            for bit in range(1, nl):
                lev1 = lev1 + jnp.where(x >= (1 << bit), 1, 0)
"""
_S_OLD = "return dsum(jnp.where(lev1 <= lv, jnp.where("
_S_NEW = "return dsum(jnp.where((t_ ^ i_) < b, jnp.where("
_SEL_OLD = "lambda: (lev1 == lv + 1) & (ti() > ii())"
_SEL_NEW = "lambda: ((ti() ^ ii()) >= (1 << lv)) & ((ti() ^ ii()) < (2 << lv)) & (ti() > ii())"
_SCORES = """                        plgpu.wgmma(acc_k, ek, plgpu.transpose_ref(r_s, (1, 0)))
                        plgpu.wgmma(acc_q, eq, plgpu.transpose_ref(r_s, (1, 0)))
"""
_PARAMS = "_PREP_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True)"

_PRECISE = (_PARAMS, _PARAMS.replace(", approx_math=True)", ")"))
_BARRIER = [
    ("""                    plgpu.wgmma(acc, a, plgpu.transpose_ref(b[1], (1, 0)) if isinstance(b, tuple) else b)
                return acc[...]""",
     """                    plgpu.wgmma(acc, a, plgpu.transpose_ref(b[1], (1, 0)) if isinstance(b, tuple) else b)
                out = acc[...]
                return lax.optimization_barrier((out, *[a for a, _ in pairs]))[0]"""),
    ("return jnp.where(sel, acc_k[...], 0.0), jnp.where(sel, acc_q[...], 0.0)",
     "rk, rq, _, _ = lax.optimization_barrier((acc_k[...], acc_q[...], ek, eq))\n"
     "                        return jnp.where(sel, rk, 0.0), jnp.where(sel, rq, 0.0)"),
]

# name -> (what it is, [(old text, new text)])
VARIANTS = {
    "base": ("v8 as on main (v7: chunk boxes from the packed rows, a level's two score products under one "
             "wait; + 'lean': beta masked once as a row vector, the load mask built once; + approx exp)", []),
    "precise_exp": ("baseline: exp without approx_math (main before session 7's run A4)", [_PRECISE]),
    "exp2_levels": ("candidate: precise exp, the levels' exp as exp2(x log2 e) (ex2.approx); session 6: G wrong",
                    [_PRECISE, ("e = jnp.exp(jnp.minimum(d, -d))", "e = jnp.exp2(jnp.minimum(d, -d) * 1.4426950408889634)")]),
    "barrier": ("diagnosis: every register A operand of a wgmma kept alive past the wait (lax.optimization_barrier "
                "after it); run A3: made no difference to the G hazard", _BARRIER),
    "nolev": ("candidate: no level-index tile (the level masks from t ^ i and the level's bit)",
              [(_LEV_TABLE, ""), (_S_OLD, _S_NEW), (_SEL_OLD, _SEL_NEW)]),
    "A_nolevels": ("ablation: no levels (akk = aqk = 0)",
                   [("return lax.fori_loop(0, nl, level, (zero, zero))", "return (zero, zero)")]),
    "A_nosolve": ("ablation: no solve (Tinv = A)",
                  [("Tinv = pl.run_scoped(solve, plgpu.SMEM((2, C, C), bf, **tiled((C, C), bf)))",
                    "Tinv = A.astype(bf)")]),
    "A_noscores": ("ablation: no score products in the levels (zero scores)", [(_SCORES, "")]),
    "A_noexp": ("ablation: no exp in the levels", [("e = jnp.exp(jnp.minimum(d, -d))", "e = jnp.minimum(d, -d)")]),
    "A_dsum_hi": ("ablation: decay sums from the hi bf16 half of g only (one wgmma instead of two)",
                  [("return mm([(Sb, gs_s.at[0]), (Sb, gs_s.at[1])], (C, K))", "return mm([(Sb, gs_s.at[0])], (C, K))")]),
}


def build(name: str):
    """mgpu.py with the variant's substitutions, as a fresh module."""
    src = open(SRC_PATH).read().replace('kernel_name="kda_chunk_prep_mgpu"', f'kernel_name="prep_{name}"')
    for old, new in VARIANTS[name][1]:
        assert old in src, f"variant {name!r}: its target text is no longer in mgpu.py: {old[:70]!r}"
        src = src.replace(old, new)
    mod = types.ModuleType(f"mgpu_{name}")
    exec(compile(src, f"mgpu_{name}.py", "exec"), mod.__dict__)
    return mod


def inputs(T, H, K, seed=0):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    bf = jnp.bfloat16
    q = jnp.asarray(unit(rng.normal(size=(T, H, K))), bf)  # L2-normed q, k as the model feeds them
    k = jnp.asarray(unit(rng.normal(size=(T, H, K))), bf)
    v = jnp.asarray(rng.normal(size=(T, H, K)), bf)
    g = jnp.asarray(-0.5 * np.log1p(np.exp(rng.normal(size=(T, H, K)))), jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(H, T)))), jnp.float32)
    return q, k, v, g, beta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS),
                    help="which variants, in order (the first one is the error baseline; default: all): "
                         + ", ".join(VARIANTS))
    ap.add_argument("--T", type=int, default=32768, help="tokens of the one sequence (a multiple of 64)")
    ap.add_argument("--heads", type=int, default=12, help="heads (q/k heads = value heads)")
    ap.add_argument("--repeats", type=int, default=5, help="launches per jit (R)")
    ap.add_argument("--out", default="bench/results/kda_prep_ablation_run.json",
                    help="JSON written after every variant (a run cut short keeps what it measured)")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    K, C, R = 128, 64, args.repeats
    assert args.T % C == 0, "--T must be a multiple of 64"
    q, k, v, g, beta = inputs(args.T, args.heads, K)
    ctok = jnp.arange(args.T // C, dtype=jnp.int32) * C
    cnum = jnp.full((args.T // C,), C, jnp.int32)
    res = dict(run_meta(), shape={"T": args.T, "heads": args.heads, "K": K, "V": K}, repeats=R, results={})
    ref = None
    for name in args.variants:
        mod = build(name)
        f = jax.jit(lambda *a, mod=mod: [mod._chunk_prep_call(*a, ctok, cnum, cnum, scale=K**-0.5, loops=True)
                                         for _ in range(R)])
        row = {"what": VARIANTS[name][0]}
        try:
            t0 = time.time()
            out = jax.block_until_ready(f(q, k, v, g, beta))
            row["compile_s"] = time.time() - t0
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                jax.block_until_ready(f(q, k, v, g, beta))
                ts.append((time.perf_counter() - t0) / R * 1e3)
            outs = [np.asarray(x.astype(jnp.float32), np.float64) for x in out[0]]
            ref = outs if ref is None else ref
            row["ms"], row["min_ms"] = float(np.median(ts)), float(np.min(ts))
            row["finite"] = bool(all(np.isfinite(x).all() for x in outs))
            row["rel_err_vs_first"] = {n: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
                                       for n, a, b in zip(("w", "qg", "kd", "u0", "aqk", "gl"), outs, ref)}
        except Exception as e:  # a variant that does not lower or run: recorded, the others go on
            row["error"] = repr(e)[:600]
        res["results"][name] = row
        print(name, row, flush=True)
        write_json(args.out, res)


if __name__ == "__main__":
    main()
