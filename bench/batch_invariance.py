"""Batch invariance of the step: does a token's logit row depend on the shape of the step it runs in?

Speculative decoding is greedy-identical to plain decoding only if a token's logits come out bit for
bit the same in a verify step (blocks of gamma + 1 tokens per sequence) as in a plain decode step
(one token per sequence), and plain batching needs the same between decode-only and mixed
(decode + prefill) steps. The KDA kernels are bit-identical between verify + fold and decode
(tests/gpu); this script measures the rest of the step, on whatever backend JAX runs on:

1. step: one sequence with a prompt in context; its next token's logit row from a plain decode
   step (D = 4 slots), from a mixed step (the same decode plus a 128-token prefill of another
   sequence) and from slot 0 of a verify block (`forward_verify`, block = gamma + 1). Max abs
   difference against the plain decode row, and whether it is exactly 0. And every row j of the
   verify block against the j-th of gamma + 1 decode steps run one after the other on the block's
   tokens (what plain decoding computes for them).
2. layers (with `--layers`): the same row's output of every attention (KDA / MLA) and FFN (dense /
   MoE) layer in each step, against the decode step's: the first layer whose output moves is where
   the step stops being batch-invariant (read through `jax.debug.callback`: on a GPU run with
   JAX_PLATFORMS=cuda,cpu).
3. engine (with `--engine`): the engine's greedy tokens on tests/test_engine.py's workload, plain
   against speculative (an oracle drafter, gamma 4, partial acceptance), with and without overlap, and
   plain against plain run again (is the step reproducible?): the first differing token of each
   request (None: identical), and for each parted request the f32 XLA path's logit margin there
   (`parted_requests`: near-tie or not).
4. gemm: for every distinct 2-D weight shape of the model, row 0 of x[:M] @ W at the row counts
   these steps use (M = 4, 20, 132, 148 and 1), against M = 4.
5. `--every-expert` runs 1-3 on the model routed to every expert (no discrete choice inside the model);
   `--gemm-noise EPS` emulates the GPU's row-count-dependent GEMMs on any backend (every weight product
   times 1 + EPS u(M, column)). Session 15 on the CPU: with EPS = 1e-6 and 1e-5 (the H200's rows differ
   by ~1e-6) the engine's speculative tokens equal plain decoding's for 8 and 6 noise patterns, routed
   or not; at 1e-4 the routed model parts in 2 of 6, every-expert in none. So the H200's ~1e-6 alone
   does not explain session 14's parting. On the XLA path the fold did: it ran outside the matmul
   precision scope, in TF32 on a GPU (fixed in session 15); emulated on the CPU (its products' inputs
   rounded to TF32) it parts request 5, one of the two the H200's XLA path parted. `--bf16-chunk`
   rounds the chunked prefill's operands to bf16 as the Pallas chunk kernels do (`bf16_chunk`); with
   `--gemm-noise 1e-6` on the XLA path that is the Pallas path's numerics, and it parts the workload in
   3 of 4 noise patterns (session 16): the bf16 roundings turn the prefill rows' ~1e-6 row-count noise
   (a mixed step's GEMMs hold one decode row per request in plain decoding, gamma + 1 in a verify
   block) into ~4e-3 changes of single elements, enough to flip router near-ties.

6. `--batch-invariant ROWS` runs all of it in the engine's batch-invariant mode
   (`ModelConfig.batch_invariant_rows`, docs/batch_invariance.md; session 17): on the CPU the step rows
   are then bit for bit equal in every step shape (results/batch_invariance_cpu_invariant.json).

    python3 bench/batch_invariance.py --out bench/results/batch_invariance_h200.json
    python3 bench/batch_invariance.py --seeds 1 --layers --batch-invariant 128 --engine
    python3 bench/batch_invariance.py --engine --gemm-noise 1e-5 --no-gemm --seeds 1
    python3 bench/batch_invariance.py --engine --impl xla --gemm-noise 1e-6 --bf16-chunk --no-gemm --seeds 1

Measured on the CPU (k3-tiny with 128-wide KDA heads, f32, XLA path; `results/batch_invariance_cpu.json`):
the step is not bitwise batch-invariant there either. The logit rows differ by up to ~4e-5, and
4 of the 10 GEMM shapes give a different row 0 at M = 1, 132 and 148 than at M = 4 (~1e-6). The
differences are small enough that tests/test_engine.py's speculative runs stay token-identical
on the CPU. On the H200 in session 10 (TF32 GEMMs) the logit row moved by ~0.02 between verify and
decode steps. Since session 12 an f32 model's step multiplies at "highest" precision
(`k3jax.model.forward.matmul_precision`); on the H200 in session 14 (`results/session14/`,
`results/batch_invariance_h200.json`) the rows then differ by 2-3e-5, as on the CPU; every layer's
output moves by ~1e-6 from layer 0 on (the weight products: 0 of 10 GEMM shapes are bitwise
row-invariant, ~1e-6); the engine's speculative tokens equal plain decoding's on the Pallas path but
not on the XLA path (2 of 8 requests part at tokens 3 and 5), with overlap on and off alike. That run
still had the MoE combine as a scatter-add, whose GPU atomics sum a token's expert outputs in
arrival order (not reproducible from run to run); it is a gather and ordered adds since.
"""

from __future__ import annotations

import argparse
import contextlib
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


class LayerTap:
    """Records row 0 of every layer's attention and FFN output while a step runs (`jax.debug.callback`
    inside `forward._attention` / `forward._ffn`, wrapped for the life of the tap)."""

    def __init__(self):
        import k3jax.model.forward as fwd_mod

        self.mod, self.rows, self.mode = fwd_mod, {}, None
        self.orig = fwd_mod._attention, fwd_mod._ffn

    def _store(self, key, x):
        self.rows.setdefault(self.mode, {})[key] = np.asarray(x, np.float64)

    def __enter__(self):
        attn, ffn = self.orig
        kind = lambda cfg, i, kinds: getattr(cfg, kinds)[i]

        def tapped_attention(params, h, ctx, state, i, cfg, *a, **kw):
            y, state = attn(params, h, ctx, state, i, cfg, *a, **kw)
            jax.debug.callback(lambda r, k=(i, kind(cfg, i, "layer_kinds")): self._store(k, r), y[0])
            return y, state

        def tapped_ffn(params, h, i, cfg, *a, **kw):
            y = ffn(params, h, i, cfg, *a, **kw)
            jax.debug.callback(lambda r, k=(i, kind(cfg, i, "ffn_kinds")): self._store(k, r), y[0])
            return y

        self.mod._attention, self.mod._ffn = tapped_attention, tapped_ffn
        jax.clear_caches()  # retrace through the taps
        return self

    def __exit__(self, *exc):
        self.mod._attention, self.mod._ffn = self.orig
        jax.clear_caches()

    def diffs(self) -> dict:
        """{mode: [{"layer", "kind", "maxabs", "rel"} per tapped output, in layer order]} against decode."""
        base, out = self.rows["decode"], {}
        for mode, rows in self.rows.items():
            if mode in ("decode", "prefill", "chain"):
                continue
            out[mode] = [{"layer": i, "kind": k, "maxabs": float(np.abs(rows[(i, k)] - b).max()),
                          "rel": float(np.linalg.norm(rows[(i, k)] - b) / max(np.linalg.norm(b), 1e-30))}
                         for (i, k), b in sorted(base.items(), key=lambda kv: (kv[0][0], kv[0][1] in ("dense", "moe")))]
        return out


def step_rows(model, prompt_len: int, gamma: int, seed: int, tap: LayerTap | None = None) -> dict:
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
    if tap is not None:
        tap.mode = "prefill"  # not compared
    pre = pack_step([], [SeqWork(prompt, 0, 1, pages_a)], D=0, P=P, NP=1, pages_per_seq=npp)
    logits, state = fwd(params, state, pre.batch, cfg=cfg, impl=impl)
    t0 = int(np.asarray(logits)[pre.rows[0]].argmax(-1).reshape(-1)[-1])
    fresh = lambda: jax.tree.map(jnp.copy, state)
    work = SeqWork([t0], prompt_len, 1, pages_a)

    def a_rows(mode, run):  # sequence A's logit rows in a step (one, or a verify block's B; A leads every step)
        if tap is not None:
            tap.mode = mode
        out = run()
        jax.effects_barrier()
        return np.asarray(out[0])[out_rows[mode]].reshape(-1, cfg.vocab_size)

    dec = pack_step([work], [], D=D, P=0, NP=0, pages_per_seq=npp)
    wide = pack_step([work], [], D=4 * D, P=0, NP=0, pages_per_seq=npp)  # a larger decode batch bucket
    mix = pack_step([work], [SeqWork(other, 0, 2, pages_b)], D=D, P=128, NP=1, pages_per_seq=npp)
    block = SeqWork([t0] + rng.integers(0, cfg.vocab_size, gamma).tolist(), prompt_len, 1, pages_a)
    vb = pack_step([block], [], D=D, P=0, NP=0, pages_per_seq=npp, block=B)
    out_rows = {"decode": dec.rows[0], "mixed": mix.rows[0], "verify": vb.rows[0], "wide": wide.rows[0]}
    row_dec = a_rows("decode", lambda: fwd(params, fresh(), dec.batch, cfg=cfg, impl=impl))[0]
    row_mix = a_rows("mixed", lambda: fwd(params, fresh(), mix.batch, cfg=cfg, impl=impl))[0]
    row_wide = a_rows("wide", lambda: fwd(params, fresh(), wide.batch, cfg=cfg, impl=impl))[0]
    rows_ver = a_rows("verify", lambda: ver(params, fresh(), vb.batch, cfg=cfg, block=B, impl=impl))
    row_ver = rows_ver[0]
    # the block's tokens decoded one step at a time (what plain decoding runs): row j against verify's row j
    if tap is not None:
        tap.mode = "chain"  # not compared per layer
    st, chain = fresh(), []
    for j, tok in enumerate(block.tokens):
        dj = pack_step([SeqWork([tok], prompt_len + j, 1, pages_a)], [], D=D, P=0, NP=0, pages_per_seq=npp)
        logits, st = fwd(params, st, dj.batch, cfg=cfg, impl=impl)
        chain.append(np.asarray(logits)[dj.rows[0]].reshape(-1, cfg.vocab_size)[0])
    jax.effects_barrier()

    diff = lambda a: float(np.abs(a.astype(np.float64) - row_dec.astype(np.float64)).max())
    res = {"rows": {"decode": D, "mixed": D + 128, "verify": D * B, "wide": 4 * D},
           "mixed_vs_decode_maxabs": diff(row_mix), "verify_vs_decode_maxabs": diff(row_ver),
           "wide_vs_decode_maxabs": diff(row_wide),
           "mixed_bitwise_equal": bool(np.array_equal(row_mix, row_dec)),
           "verify_bitwise_equal": bool(np.array_equal(row_ver, row_dec)),
           "wide_bitwise_equal": bool(np.array_equal(row_wide, row_dec)),
           "same_argmax": bool(row_ver.argmax() == row_dec.argmax() == row_mix.argmax() == row_wide.argmax()),
           "verify_vs_decode_chain_maxabs": [float(np.abs(v.astype(np.float64) - c).max())
                                             for v, c in zip(rows_ver, chain)],
           "verify_vs_decode_chain_bitwise_equal": bool(all(np.array_equal(v, c) for v, c in zip(rows_ver, chain)))}
    if tap is not None:
        res["layers"] = tap.diffs()
        tap.rows = {}
    return res


def first_diff(a, b):
    """The first index where token lists a and b differ (None: none within the shorter)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def parted_requests(ref_model, prompts, got, want) -> list[dict]:
    """Each request whose tokens part (`got` against `want`): its first differing token, both tokens,
    and the referee's logits there (`ref_model`, e.g. the f32 XLA path, on the prompt and the common
    prefix): `margin` = logit(want's token) - logit(got's token), and the top-2 gap. A margin near 0 is a
    near-tie (DESIGN.md section 4); a large one means one of the runs computed something else."""
    out = []
    for i, (p, g, w) in enumerate(zip(prompts, got, want)):
        j = first_diff(g, w)
        if j is None:
            if len(g) != len(w):
                out.append({"request": i, "index": min(len(g), len(w)), "lengths": [len(g), len(w)]})
            continue
        row = np.asarray(ref_model.logits(list(p) + list(w[:j]))[-1], np.float64)
        top = np.sort(row)[-2:]
        out.append({"request": i, "index": j, "want": int(w[j]), "got": int(g[j]),
                    "margin": float(row[w[j]] - row[g[j]]), "top2_gap": float(top[1] - top[0]),
                    "referee_argmax": int(row.argmax())})
    return out


def engine_runs(model) -> dict:
    """First differing token per request, speculative (overlap on and off) against plain decoding."""
    from k3jax import LLM
    from k3jax.spec.drafter import OracleDrafter
    from tests.test_engine import ENGINE_KW, run_workload, workload

    want = run_workload(LLM(model, prefix_cache=True, overlap=True, **ENGINE_KW))
    phase1, phase2 = workload()
    prompts = phase1 + phase2(want[: len(phase1)])
    oracle = OracleDrafter({tuple(p): o for p, o in zip(prompts, want)}, model.config.vocab_size)
    again = run_workload(LLM(model, prefix_cache=True, overlap=True, **ENGINE_KW))
    out = {"plain_again": {"first_diff": [first_diff(g, w) for g, w in zip(again, want)]}}
    print(f"engine, plain run again vs plain: first differing token per request {out['plain_again']['first_diff']}",
          flush=True)
    for overlap in (True, False):
        spec = LLM(model, prefix_cache=True, overlap=overlap, speculative=oracle, num_draft_tokens=4, **ENGINE_KW)
        got = run_workload(spec)
        out[f"overlap={overlap}"] = {"first_diff": [first_diff(g, w) for g, w in zip(got, want)],
                                     "accepted": spec.stats["spec_accepted"], "drafted": spec.stats["spec_drafted"],
                                     "parted": parted_requests(dataclasses.replace(model, impl="xla"), prompts, got,
                                                               want)}
        print(f"engine, speculative vs plain, overlap={overlap}: first differing token per request "
              f"{out[f'overlap={overlap}']['first_diff']}", flush=True)
        for r in out[f"overlap={overlap}"]["parted"]:
            print(f"  parted: {r}", flush=True)
    return out


def every_expert(model):
    """`model` with every token routed to all of its experts: the same step, no discrete choice inside."""
    cfg = model.config.replace(name=model.config.name + "-every-expert", num_experts_per_token=model.config.num_experts)
    return dataclasses.replace(model, config=cfg, params=split_layers(init_params(cfg, 0)))


@contextlib.contextmanager
def _swapped(mods, name: str, make):
    """Inside the block, attribute `name` of every module in `mods` is make(its value); restored after.
    What it replaces is read at trace time: use a fresh model name."""
    exact = getattr(mods[0], name)
    for m in mods:
        setattr(m, name, make(exact))
    try:
        yield
    finally:
        for m in mods:
            setattr(m, name, exact)


def _proj_replaced(make):
    """Every weight product of the model (`common.proj` as the KDA, MLA and MoE layers call it) replaced by
    make(exact proj) inside the block."""
    import k3jax.model.kda as mk
    import k3jax.model.mla as mm
    import k3jax.model.moe as mo

    return _swapped((mk, mm, mo), "proj", make)


def gemm_noise(eps: float, salt: int = 0):
    """Emulates the GPU's row-count-dependent GEMMs on any backend: every weight product comes out times
    (1 + eps u), u in [-1, 1] a fixed pseudo-random function of the product's row count M and the output
    column (and `salt`: another autotuning outcome). A row then depends on the step's shape,
    deterministically per shape, as XLA's GEMMs on the H200 (~1e-6 relative, session 14)."""

    def make(exact):
        def noisy(x, w):
            out = exact(x, w)
            m = int(np.prod(x.shape[:-1]))
            u = jnp.sin(m * 12.9898 + jnp.arange(out.shape[-1], dtype=jnp.float32) * 78.233 + salt * 3.7) * 43758.5453
            return (out.astype(jnp.float32) * (1 + eps * (2 * (u - jnp.floor(u)) - 1))).astype(out.dtype)

        return noisy

    return _proj_replaced(make)


def bf16_chunk():
    """Emulates the Mosaic GPU chunk kernels' operand rounding on the XLA path (any backend): the chunked
    prefill's q, k, v enter in bf16 and its intra-chunk products (w, u0, Aqk, qg, kd: the inter kernel's
    wgmma operands) leave in bf16, as `mgpu.chunk_operands` hands them over; the gate and the state stay
    f32. A rounding to bf16 turns a ~1e-6 change of an f32 input into a change of one bf16 ulp (~4e-3
    relative) in a few elements: an amplifier of the GEMM rows' row-count dependence (`gemm_noise`).
    Read at trace time: use a fresh model name."""
    import pallas_kernels.kda.ref as kref

    bf = lambda x: x.astype(jnp.bfloat16).astype(x.dtype)

    def make(exact):
        def rounded(q, k, v, g, beta):
            w, u0, aqk, qg, kd, gl = exact(bf(q), bf(k), bf(v), g, beta)
            return bf(w), bf(u0), bf(aqk), bf(qg), bf(kd), gl

        return rounded

    return _swapped((kref,), "_chunk_intra", make)


def gemm_rows(params, cfg, ms=(1, 4, 20, 132, 148), seed=0) -> list[dict]:
    """Row 0 of x[:M] @ W (`common.proj`) for every distinct 2-D weight shape, against M = 4, as the model's
    step runs it (`forward.step_numerics`: "highest" precision for an f32 model since session 12; with
    `cfg.batch_invariant_rows`, in fixed blocks of that many rows)."""
    from k3jax.model.common import proj
    from k3jax.model.forward import step_numerics

    shapes = sorted({(x.shape, str(x.dtype)) for x in jax.tree.leaves(params) if x.ndim == 2 and min(x.shape) >= 16})
    out = []
    key = jax.random.key(seed)

    def mm(x, w):
        with step_numerics(cfg):
            return proj(x, w)

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
    ap.add_argument("--layers", action="store_true",
                    help="also compare every layer's output row between the steps (where the step first moves)")
    ap.add_argument("--engine", action="store_true",
                    help="also run the engine workload plain vs speculative (first differing token per request)")
    ap.add_argument("--no-step", action="store_true",
                    help="skip the step rows (and --layers, --engine): the GEMM table only, e.g. to compare XLA_FLAGS")
    ap.add_argument("--no-gemm", action="store_true", help="skip the per-weight-shape GEMM check")
    ap.add_argument("--every-expert", action="store_true",
                    help="route every token to all experts (no discrete choice inside the model) for the step, "
                         "--layers and --engine checks")
    ap.add_argument("--gemm-noise", type=float, default=0.0, metavar="EPS",
                    help="emulate row-count-dependent GEMMs (any backend): every weight product times (1 + EPS u), "
                         "u a fixed function of its row count and column (`gemm_noise`); e.g. 1e-6 as on the H200")
    ap.add_argument("--gemm-noise-salt", type=int, default=0, help="another pattern of --gemm-noise (another "
                    "autotuning outcome); default: %(default)s")
    ap.add_argument("--bf16-chunk", action="store_true",
                    help="emulate the Pallas chunk kernels' bf16 operands on the XLA path (`bf16_chunk`; with "
                         "--impl xla): with --gemm-noise, the Pallas path's numerics on any backend")
    ap.add_argument("--batch-invariant", type=int, default=0, metavar="ROWS",
                    help="run the model in the batch-invariant mode with row blocks of ROWS "
                         "(`ModelConfig.batch_invariant_rows`, what `LLM(batch_invariant=True)` sets to 128): the "
                         "step rows, --layers, --engine and the GEMM table; 0: off (default)")
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)

    model = build_model(args.model, args.kda_head_dim or None, args.impl)
    if args.every_expert:
        model = every_expert(model)
    tag = (f"-gemm-noise-{args.gemm_noise:g}-{args.gemm_noise_salt}" if args.gemm_noise else "") + \
        ("-bf16-chunk" if args.bf16_chunk else "")
    if tag:  # a config name of its own: these are read at trace time
        model = dataclasses.replace(model, config=model.config.replace(name=model.config.name + tag))
    if args.batch_invariant:
        model = dataclasses.replace(model, config=model.config.replace(batch_invariant_rows=args.batch_invariant))
    # the emulations, entered together with the taps below
    patches = ([gemm_noise(args.gemm_noise, args.gemm_noise_salt)] if args.gemm_noise else []) + \
        ([bf16_chunk()] if args.bf16_chunk else [])
    res = {"bench": "batch_invariance", **run_meta(), "model": model.config.name, "impl": args.impl,
           "matmul_precision": "highest" if jnp.dtype(model.config.dtype) == jnp.float32 else "default",
           "prompt_len": args.prompt_len, "gamma": args.gamma, "step": [], "gemm": []}
    res["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    res["every_expert"] = args.every_expert
    res["gemm_noise"] = {"eps": args.gemm_noise, "salt": args.gemm_noise_salt} if args.gemm_noise else None
    res["bf16_chunk"] = args.bf16_chunk
    res["batch_invariant_rows"] = args.batch_invariant
    tap = LayerTap() if args.layers and not args.no_step else contextlib.nullcontext()
    with tap, contextlib.ExitStack() as noise:
        for p in patches:
            noise.enter_context(p)
        for s in tqdm(range(0 if args.no_step else args.seeds), desc="step shapes", leave=False):
            r = step_rows(model, args.prompt_len, args.gamma, s, tap if args.layers else None)
            res["step"].append(r)
            print(f"seed {s}: mixed vs decode {r['mixed_vs_decode_maxabs']:.3g}, decode x4 rows vs decode "
                  f"{r['wide_vs_decode_maxabs']:.3g}, verify vs decode "
                  f"{r['verify_vs_decode_maxabs']:.3g}, same argmax {r['same_argmax']}; verify block row j vs "
                  f"the j-th decode step: {['%.3g' % x for x in r['verify_vs_decode_chain_maxabs']]}", flush=True)
            for mode, rows in r.get("layers", {}).items():
                moved = [x for x in rows if x["maxabs"] > 0]
                where = f"first at layer {moved[0]['layer']} ({moved[0]['kind']}, maxabs {moved[0]['maxabs']:.3g})" \
                    if moved else "none"
                print(f"  {mode} vs decode: {len(moved)} of {len(rows)} layer outputs move; {where}", flush=True)
        if args.engine and not args.no_step:
            res["engine"] = engine_runs(model)
    if args.no_gemm:
        return _finish(res, args)
    res["gemm"] = gemm_rows(model.params, model.config)
    bad = [g for g in res["gemm"] if not g["bitwise_equal"]]
    print(f"gemm: {len(res['gemm']) - len(bad)} of {len(res['gemm'])} weight shapes give row 0 bit for bit at every M")
    for g in bad:
        print(f"  {g['shape']} {g['dtype']}: {g['row0_maxabs_vs_M4']}")
    return _finish(res, args)


def _finish(res, args):
    if args.out:
        write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
