"""KDA kernels on the H200: ours (Mosaic GPU, `impl="pallas"`) vs flash-linear-attention, same run,
same random inputs.

    python3 bench/kda_kernels.py --out bench/results/kda_h200.json

Needs torch + triton + fla-core (carry the fla-core 0.6.0 wheel, see bench/NOTES.md). Inputs
are drawn once in torch (bf16 q/k/v/beta, f32 g and state, K = V = 128) and shared with JAX
through DLPack. fla is timed with `triton.testing.do_bench` (median, L2 flushed before each
call); ours by timing R calls unrolled inside one jit (the state pool threaded through, donated,
in place) and taking the median over repeats, so both are device-time figures. Decode uses a
pool of distinct slots per step so the state stream never sits in L2. verify_fold rows (fla has no
such op) time one KDA layer's speculative block three ways: Mosaic GPU verify + fold, verify with
per-step snapshots + commit, and the jnp references (`bench_verify_fold`). Writes JSON rows
{"op", "shape", "ours_ms", "fla_ms", "bandwidth_frac", ...} with commit, JAX version and device.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench._common import device_events, kernel_summary  # noqa: E402


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return os.environ.get("K3JAX_COMMIT", "unknown")


def t2j(t):
    return jax.dlpack.from_dlpack(t.contiguous())


def jax_ms(run, reps=7):
    """run() launches R steps and returns (result, R); median device ms per step."""
    out, _ = run()
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        out, R = run()
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / R)
    return statistics.median(ts) * 1e3


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def prep_breakdown(jin, B, T, H, R):
    """Times the pieces of the XLA intra-chunk prep (`prep.py`, the kernel's algorithm in jnp) on
    chunk-layout f32 inputs."""
    from pallas_kernels.kda import prep as P

    C = 64
    n = B * T // C
    ch = lambda x: jnp.swapaxes(x.reshape((n, C) + x.shape[2:]), 1, 2).astype(jnp.float32)  # [n, H, C, X]
    q, k, v, g = (ch(x) for x in jin[:4])
    beta = ch(jin[4][..., None])[..., 0]
    out = {}
    pieces = {
        "gather_to_chunks": (jax.jit(lambda *a: tuple(ch(x) for x in a)), jin[:4]),
        "pair_scores": (jax.jit(P.pair_scores), (q, k, g)),
    }
    akk = pieces["pair_scores"][0](q, k, g)[0]
    pieces["inverse"] = (jax.jit(P.unit_lower_inverse), (beta[..., None] * akk,))
    pieces["chunk_prep"] = (jax.jit(P.chunk_prep), (q, k, v, g, beta))
    for name, (f, a) in pieces.items():
        try:
            out[name] = jax_ms(lambda: ([f(*a) for _ in range(R)], R), reps=3)
        except Exception as e:
            out[name] = repr(e)[:200]
    return out


def bench_verify_fold(inputs, N, H, gamma, copy_gbps, R=4, forms=()):
    """One KDA layer's speculative block of T = gamma + 1 tokens for N sequences, on a pool of slot
    sets (so the states stream from HBM), three ways, each R steps inside one jit:
    - fold: Mosaic GPU verify (reads the committed state, writes o; the capture is the f32 inputs)
      then the fold kernel (replays the first n_keep steps in place on the pool);
    - snapshots: Mosaic GPU verify that also writes the state after every step ([N, HV, T, K, V]
      scratch), then the commit (XLA: gather the n_keep-th snapshot, scatter it into the pool);
    - xla: the jnp references (`spec.kda_verify` + `spec.kda_fold` on gathered states, scatter back).
    ours_ms = fold; bandwidth_frac = the fold path's state bytes (3 x K x V x 4 per head: verify
    read, fold read + write) over its time, against the copy bandwidth. forms: (suffix, options of
    `verify_mgpu` and `fold_pool`) also timed on the fold path and its two kernels: `fold<sfx>_ms`,
    `verify_only<sfx>_ms`, `fold_only<sfx>_ms` (`verify_forms`: without the automatic barriers, other
    state tile layouts)."""
    from pallas_kernels.kda import spec_kernels as sk
    from pallas_kernels.kda.ref import _prep
    from pallas_kernels.kda.spec import Capture, kda_fold, kda_verify, replay_bytes, snapshot_bytes

    K = V = 128
    T = gamma + 1
    q, k, v, g, beta = (t2j(x) for x in inputs(N, T, H))
    per_slot = H * K * V * 4
    sets = max(4, -(-320 * 2**20 // (N * per_slot)))
    NS = N * sets
    slot_sets = jnp.arange(NS, dtype=jnp.int32).reshape(sets, N)
    n_keep = jax.random.randint(jax.random.key(1), (N,), 0, T + 1).astype(jnp.int32)
    zeros = jnp.zeros((N,), jnp.int32)

    def fold_step(pool, i, **kw):
        sl = slot_sets[i % sets]
        qf, kf, vf, gf, bf = _prep(q, k, v, g, beta, None)
        o = sk.verify_mgpu(qf, kf, vf, gf, bf, pool.reshape(-1, K, V), sl * H, zeros, **kw)
        cap = Capture(*(x[:, None] for x in (kf, vf, gf, bf)))
        return o, sk.fold_pool(pool, sl, cap, n_keep, **kw)

    def snap_step(pool, i):
        sl = slot_sets[i % sets]
        qf, kf, vf, gf, bf = _prep(q, k, v, g, beta, None)
        o, snaps = sk.verify_mgpu(qf, kf, vf, gf, bf, pool.reshape(-1, K, V), sl * H, zeros, snapshots=True)
        pick = snaps[jnp.arange(N), :, jnp.maximum(n_keep - 1, 0)]  # [N, HV, K, V]
        S = jnp.where((n_keep > 0)[:, None, None, None], pick, pool[sl, 0])
        return o, pool.at[sl, 0].set(S)

    def xla_step(pool, i):
        sl = slot_sets[i % sets]
        o, cap = kda_verify(q, k, v, g, beta, pool[sl, 0])
        S = kda_fold(pool[sl], Capture(*(x[:, None] for x in (cap.k, cap.v, cap.g, cap.beta))), n_keep)
        return o, pool.at[sl].set(S)

    out = {"n_keep_mean": float(jnp.mean(n_keep)),
           "scratch_bytes_fold": N * H * replay_bytes(K, V, gamma),
           "scratch_bytes_snapshots": N * H * snapshot_bytes(K, V, gamma)}
    pool0 = jax.random.normal(jax.random.key(0), (NS, 1, H, K, V), jnp.float32) * 0.01
    # correctness of the two kernel paths against the XLA path, one step from the same pool
    ref_o, ref_p = jax.jit(lambda p: xla_step(p, 0))(pool0)
    forms = [("", {})] + list(forms)
    paths = [("fold", fold_step), ("snapshots", snap_step)] + [
        ("fold" + sfx, functools.partial(fold_step, **kw)) for sfx, kw in forms[1:]]
    for name, f in paths:
        o, p = jax.jit(lambda p: f(p, 0))(pool0)
        out[f"rel_err_o_{name}_vs_xla"] = rel(o, ref_o)
        out[f"rel_err_state_{name}_vs_xla"] = rel(p[:N], ref_p[:N])
    del ref_o, ref_p
    times = {}
    for name, f in paths + [("xla", xla_step)]:
        def steps(pool, f=f):
            for i in range(R):
                o, pool = f(pool, i)
            return o, pool

        steps = jax.jit(steps, donate_argnums=0)
        box = {"pool": pool0 + 0}

        def run():
            o, box["pool"] = steps(box["pool"])
            return (o, box["pool"]), R

        times[name] = jax_ms(run)
        box = None
    # the two kernels of the fold path alone (and in the other forms)
    qf, kf, vf, gf, bf = jax.jit(lambda: _prep(q, k, v, g, beta, None))()
    cap = Capture(*(x[:, None] for x in (kf, vf, gf, bf)))
    for sfx, kw in forms:
        ver = jax.jit(lambda p, kw=kw: [sk.verify_mgpu(qf, kf, vf, gf, bf, p.reshape(-1, K, V), slot_sets[i % sets] * H,
                                                       zeros, **kw) for i in range(R)])
        times["verify_only" + sfx] = jax_ms(lambda: (ver(pool0), R))

        def folds(pool, kw=kw):
            for i in range(R):
                pool = sk.fold_pool(pool, slot_sets[i % sets], cap, n_keep, **kw)
            return pool

        folds = jax.jit(folds, donate_argnums=0)
        box = {"pool": pool0 + 0}

        def run_f():
            box["pool"] = folds(box["pool"])
            return box["pool"], R

        times["fold_only" + sfx] = jax_ms(run_f)
    state_bytes = 3 * N * H * K * V * 4
    out.update(ours_ms=times["fold"], fla_ms=None, bandwidth_frac=state_bytes / (times["fold"] * 1e-3) / 1e9 / copy_gbps,
               snapshots_ms=times["snapshots"], xla_ms=times["xla"], verify_only_ms=times["verify_only"],
               fold_only_ms=times["fold_only"], speedup_vs_snapshots=times["snapshots"] / times["fold"])
    for sfx, kw in forms[1:]:
        out.update({f"{t}{sfx}_ms": times[t + sfx] for t in ("fold", "verify_only", "fold_only")})
        out[f"form{sfx}"] = kw
    return out


def verify_forms(no_auto_barriers=False, layouts=(), tiles=(1,)):
    """bench_verify_fold's extra forms: `_nab` (no automatic barriers, the default layout and V tile;
    session 11) and `_<layout>` per layout (its default V tile, `mgpu.step_vt`; without the automatic
    barriers where `mgpu.decode_auto_barriers` drops them at that tile, as decode does), with
    `_tiles<t>` for each V-tile count t > 1 a CTA (session 14) that fits the layout's tile in V = 128."""
    from pallas_kernels.kda import mgpu

    forms = [("_nab", {"auto_barriers": False})] if no_auto_barriers else []
    for lay in layouts:
        vt = mgpu.step_vt(lay, 128)
        ab = mgpu.decode_auto_barriers(lay, 128, vt)
        for t in tiles:
            if 128 % (vt * t) == 0:
                forms.append((f"_{lay}" + (f"_tiles{t}" if t > 1 else ""), {"layout": lay, "auto_barriers": ab,
                                                                            "tiles": t}))
    return forms


# decode kernel variants the bench can time next to the default (since session 9: vt 64, two tiles per
# CTA, the colwarp layout, XLA casts): `mgpu.decode` options. The older ones name their base, v1 (the
# default until session 8: one tile per CTA, WGMMA layout), so each name keeps the kernel its rows in
# results/kda_h200.json measured.
_V1 = {"vt": 64, "tiles": 1, "layout": "wgmma", "auto_barriers": True}
_CW = {"layout": "colwarp", "vt": 64, "auto_barriers": True}  # session 9's colwarp decode
DECODE_VARIANTS = {
    "v1": _V1,
    "colwarp_tiles2": _CW | {"tiles": 2},  # = the default in sessions 9 and 10 (10: one tile at small grids)
    "v2": _V1 | {"xla_casts": False},
    "scatter": _V1 | {"api": "scatter"},
    "vt128": {"vt": 128, "tiles": 1},  # WGMMA layout either way (colwarp takes vt 32 or 64)
    "vt32": _V1 | {"vt": 32},
    "tiles2": _V1 | {"tiles": 2},
    "vt32_tiles2": _V1 | {"vt": 32, "tiles": 2},
    "vt32_tiles4": _V1 | {"vt": 32, "tiles": 4},
    "ro_wait": _V1 | {"read_only_wait": True},
    "tiles2_ro": _V1 | {"tiles": 2, "read_only_wait": True},
    "colwarp": _CW | {"tiles": 1},
    # colwarp at vt 32: 16 row lanes until session 10, replicated warps since session 11 (rows record which)
    "colwarp_vt32": _CW | {"vt": 32, "tiles": 1},
    "colwarp_vt32_tiles2": _CW | {"vt": 32, "tiles": 2},
    "colwarp_vt32_tiles4": _CW | {"vt": 32, "tiles": 4},
    # the vt-32 form without the automatic barriers: one barrier before each tile's stores (session 11, not timed)
    "vt32_one_barrier": {"layout": "colwarp", "vt": 32, "tiles": 1, "auto_barriers": False},
    "vt32_tiles2_one_barrier": {"layout": "colwarp", "vt": 32, "tiles": 2, "auto_barriers": False},
    # without Pallas's automatic barriers around SMEM stores (sessions 10-11; at 1 x 12 heads the rows
    # of "no_auto_barriers" ran one tile, the tile rule then); one tile a CTA is the default since 11
    "no_auto_barriers": {"vt": 64, "auto_barriers": False, "tiles": 2},
    "no_auto_barriers_tiles1": {"vt": 64, "auto_barriers": False, "tiles": 1},
    "colwarp_tiles2_ro": _CW | {"tiles": 2, "read_only_wait": True},
    # the colwarp8 layout (8 columns a warp, vt 32, no replicas, no automatic barriers; session 12, not
    # timed): what decode would run at every batch with STEP_LAYOUT = "colwarp8"
    "colwarp8": {"layout": "colwarp8", "vt": 32},
    "colwarp8_tiles2": {"layout": "colwarp8", "vt": 32, "tiles": 2},
    "colwarp8_tiles4": {"layout": "colwarp8", "vt": 32, "tiles": 4},
    # ... ending each CTA once its TMA stores have read shared memory (no difference at vt 64, session 9;
    # at batch 1 the store's wait is on the whole kernel's critical path)
    "colwarp8_ro": {"layout": "colwarp8", "vt": 32, "read_only_wait": True},
    # the persistent form (session 21; 1.7-3.5% slower than the default at batch >= 256, H100 session 22):
    # P CTAs, each stepping its tiles through two buffers, the next tile's loads and the one after's slot
    # read in flight while a tile is stepped (vt 64, colwarp, no automatic barriers, as the default at
    # batch >= 64); P = 1, 2 or 3 CTAs an SM
    "persistent132": {"vt": 64, "ctas": 132},
    "persistent264": {"vt": 64, "ctas": 264},
    "persistent396": {"vt": 64, "ctas": 396},
    # the default kernel in the dense form (session 29: `mgpu.decode(slots=None)`): sequence n's state is
    # pool[n], no slot id read before the state's loads; the job of fla's dense `fused_recurrent_kda` (fla_ms,
    # fla_kernel_us), where the default's job is the serving form's (fla_pool_ms). One dense pool a call.
    "dense": {"dense": True},
}

PREP_VERSION = ("mgpu prep kernel v8 (v7: chunk boxes read straight from the packed tokens, a level's two score "
                "products under one wait; + beta and the load row mask built once, and approx exp)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/kda_h200.json")
    ap.add_argument("--decode-batch", type=int, nargs="*", default=[1, 64, 256, 1024])
    ap.add_argument("--heads", type=int, nargs="*", default=[12, 96])
    ap.add_argument("--prefill", nargs="*", default=["1x4096x12", "1x32768x12", "8x4096x12", "1x32768x96", "1x131072x12"],
                    help="BxTxH shapes")
    ap.add_argument("--variant-batch", type=int, nargs="*", default=[1, 256],
                    help="decode batches at which the --decode-variants (options on top of the defaults) are "
                         "timed too, after the default")
    ap.add_argument("--decode-variants", nargs="*", default=["v2", "scatter", "vt128", "vt32"],
                    choices=sorted(DECODE_VARIANTS),
                    help="decode kernel variants (mgpu.decode options): " + "; ".join(
                        f"{k}: {v}" for k, v in DECODE_VARIANTS.items()))
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="decode rows: also trace CALLS timed calls (16 steps each) with jax.profiler and record "
                         "each kernel's device time per step, the busy time and the span (0: no trace)")
    ap.add_argument("--breakdown", default="1x32768x12",
                    help="prefill shape for the XLA prep breakdown (slow; 'none' skips it)")
    ap.add_argument("--prep-unrolled", action="store_true",
                    help="prefill rows also time the prep kernel unrolled (v4: slow to compile, 2.4x slower)")
    ap.add_argument("--inter-vt", type=int, nargs="*", default=[],
                    help="prefill rows time the inter kernel alone at these V tiles (default: the one "
                         "`mgpu.inter_vt` picks)")
    ap.add_argument("--fused-inputs", action="store_true",
                    help="prefill rows also time the chunk from raw q, k and bf16 gate logits (K3's lower-bound "
                         "gate): the gate and the L2 norm fused in the prep kernel (fused_inputs_ms) against XLA "
                         "computing them before the kernels (xla_inputs_ms, the model's default path), and fla's "
                         "chunk_kda with use_gate_in_kernel and use_qk_l2norm_in_kernel (fla_fused_inputs_ms)")
    ap.add_argument("--align-segments", action="store_true",
                    help="prefill rows of several sequences also time mgpu.ALIGN_SEGMENTS (each sequence moved to "
                         "a row that is a multiple of 8 first, so its chunk grid starts at its first token): "
                         "aligned_ms against ours_ms (and whether the bits are equal), and a varlen pack with "
                         "unaligned starts both ways (varlen_unaligned_packed_ms / _aligned_ms)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--verify", nargs="*", default=["1x12", "64x12", "256x12", "256x96"],
                    help="verify + fold shapes, batch x heads")
    ap.add_argument("--gamma", type=int, default=7, help="draft tokens per verify block (T = gamma + 1)")
    ap.add_argument("--verify-no-auto-barriers", action="store_true",
                    help="verify_fold rows also time the verify and fold kernels without Pallas's automatic "
                         "barriers (auto_barriers=False; fold_nab_ms, verify_only_nab_ms, fold_only_nab_ms)")
    ap.add_argument("--verify-layouts", nargs="*", default=[], choices=["wgmma", "colwarp", "colwarp8"],
                    help="verify_fold rows also time the verify and fold kernels with these state tile layouts "
                         "(at the layout's V tile, mgpu.step_vt; fold_<layout>_ms, verify_only_<layout>_ms, "
                         "fold_only_<layout>_ms); colwarp8 (vt 32) is what STEP_LAYOUT = 'colwarp8' would run")
    ap.add_argument("--verify-tiles", nargs="*", type=int, default=[1],
                    help="V tiles a CTA for the --verify-layouts forms (t > 1 adds fold_<layout>_tiles<t>_ms and "
                         "its two kernels alone: one load of the block's vectors for t tiles)")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from pallas_kernels.kda import kda_chunk
    from pallas_kernels.kda import mgpu

    dev = "cuda"
    res = {"commit": commit(), "jax": jax.__version__, "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "jax_devices": [str(d) for d in jax.devices()]}
    fla = None
    if not args.no_fla:
        try:
            import fla as fla_mod
            from fla.ops.kda import chunk_kda, fused_recurrent_kda

            fla = (chunk_kda, fused_recurrent_kda)
            try:  # the form vLLM's decode calls: the state pool read by slot index and written in place
                from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

                fla = fla + (fused_recurrent_kda_fwd,)
            except Exception as e:
                res["fla_pool_error"] = repr(e)[:300]
            res["fla"] = getattr(fla_mod, "__version__", "?")
        except Exception as e:
            res["fla_error"] = repr(e)[:300]

    x = torch.randn(1024 * 1024 * 1024 // 2, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    copy_gbps = 2 * x.numel() * 2 / (ms * 1e-3) / 1e9
    res["copy_GBps"] = copy_gbps
    x = y = None
    torch.cuda.empty_cache()

    def inputs(B, T, H, K=128, V=128):
        q = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
        k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(torch.bfloat16)
        v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
        g = F.logsigmoid(torch.randn(B, T, H, K, device=dev)) / 16
        beta = torch.rand(B, T, H, device=dev, dtype=torch.bfloat16).sigmoid()
        return q, k, v, g, beta

    def fla_pool_row(q, k, v, g, beta, h0, N, H):
        """fla's decode kernel in its serving form, the one vLLM calls for Kimi Linear: the tokens packed
        with cu_seqlens, the states in a pool read by `ssm_state_indices` and written in place, as our
        kernel reads and writes its pool by slot id. `fused_recurrent_kda` (the public entry, timed as
        fla_ms) reads a dense [N, H, K, V] h0 and writes a new final state: no slot read. Pool of >= 320
        MB, one set of N slots a call (cold states, as ours); the first set holds h0 so the outputs
        compare. -> {fla_pool_ms, fla_pool_kernel_us (with --profile), o (fla's outputs [N, H, V])}."""
        pk = lambda x: x.reshape((1, N) + x.shape[2:])
        qp, kp, vp, gp, bp = map(pk, (q, k, v, g, beta))
        cu = torch.arange(N + 1, device=dev, dtype=torch.long)
        sets = max(4, -(-320 * 2**20 // h0.nbytes))
        pool = torch.randn((sets * N,) + h0.shape[1:], device=dev) * 0.01
        pool[:N] = h0
        idx = torch.arange(sets * N, device=dev, dtype=torch.int32).reshape(sets, N)
        call = lambda i: fla[2](qp, kp, vp, gp, bp, initial_state=pool, inplace_final_state=True,
                                cu_seqlens=cu, ssm_state_indices=idx[i % sets], scale=128**-0.5)[0]
        out = {"o": call(0)[0].float()}
        pool[:N] = h0
        box = {"i": 0}

        def step():
            box["i"] += 1
            return call(box["i"])

        out["fla_pool_ms"] = do_bench(step, warmup=10, rep=200, return_mode="median")
        if args.profile:
            def frun():
                for i in range(sets):
                    call(i)
                torch.cuda.synchronize()

            prof = kernel_summary(device_events(frun, args.profile), args.profile * sets)
            fk = [v for n, v in prof.get("kernels", {}).items() if "recurrent" in n]
            out["fla_pool_kernel_us"] = fk[0]["mean_us"] if fk else None
        return out

    def fused_inputs_row(jin, tin, B, T, H, R, lower_bound=-5.0):
        """The gate and the L2 norm in the prep kernel vs in XLA before it, and fla's fused form, on
        raw q, k (row norms 0.2-6) and bf16 gate logits: {fused_inputs_ms, xla_inputs_ms,
        fla_fused_inputs_ms, rel_err_fused_vs_xla_inputs}. jin: the row's jax inputs (q, k, v, g, beta,
        h0), tin the same in torch."""
        from pallas_kernels.kda import Gate
        from pallas_kernels.kda.ref import fused_inputs_ref

        out = {"fused_prep": f"gate ({lower_bound} lower bound) and L2 norm at the prep kernel's load"}
        gen = torch.Generator(device=dev).manual_seed(B * T + H)
        scale_rows = lambda x: (x.float() * (0.2 + 5.8 * torch.rand(B, T, H, 1, device=dev, generator=gen))).to(x.dtype)
        qr, kr = scale_rows(torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16)), scale_rows(
            torch.randn(B, T, H, 128, device=dev, dtype=torch.bfloat16))
        f = (torch.randn(B, T, H, 128, device=dev, generator=gen) * 2).to(torch.bfloat16)
        a_log, dt_bias = torch.randn(H, device=dev, generator=gen), torch.randn(H * 128, device=dev, generator=gen)
        gate = Gate(t2j(a_log), t2j(dt_bias), lower_bound)
        # arguments, not closed-over arrays (those would be baked into the executables as constants)
        j = [t2j(t) for t in (qr, kr)] + [jin[2], t2j(f), jin[4], jin[5]]
        fused = jax.jit(lambda q, k, v, f, beta, h0, gate: kda_chunk(q, k, v, f, beta, initial_state=h0, gate=gate,
                                                                     qk_l2norm=True, impl="pallas"))

        @jax.jit
        def xla(q, k, v, f, beta, h0, gate):  # the model's path without the fusion: XLA's gate and norm first
            q, k, g = fused_inputs_ref(q, k, f, gate, True)
            return kda_chunk(q, k, v, g, beta, initial_state=h0, impl="pallas")

        try:
            a, b = fused(*j, gate), xla(*j, gate)
            out["rel_err_fused_vs_xla_inputs"] = rel(a[0], b[0])
            out["rel_err_state_fused_vs_xla_inputs"] = rel(a[1], b[1])
            del a, b
            out["fused_inputs_ms"] = jax_ms(lambda: ([fused(*j, gate) for _ in range(R)], R))
            out["xla_inputs_ms"] = jax_ms(lambda: ([xla(*j, gate) for _ in range(R)], R))
        except Exception as e:
            out["fused_inputs_error"] = repr(e)[:400]
            traceback.print_exc()
        if fla is not None:
            try:
                ff = lambda: fla[0](qr, kr, tin[2], f, tin[4], initial_state=tin[5], output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True,
                                    lower_bound=lower_bound, A_log=a_log, dt_bias=dt_bias)
                out["fla_fused_inputs_ms"] = do_bench(ff, warmup=10, rep=100, return_mode="median")
            except Exception as e:
                out["fla_fused_inputs_error"] = repr(e)[:400]
        return out

    def aligned_segments_row(jin, o_packed, B, T, R):
        """`mgpu.ALIGN_SEGMENTS` (each sequence moved to a row that is a multiple of 8 before the kernels,
        o gathered back) against the packed layout: on the row's B x T sequences (aligned starts already:
        the same grid, so the same bits), and on a varlen pack of the same rows with every sequence 5
        tokens shorter (unaligned starts: what the engine's prefill steps pack)."""
        pk = lambda x: x.reshape((1, B * T) + x.shape[2:])
        cu_eq = jnp.arange(B + 1, dtype=jnp.int32) * T
        lens = [T - 5] * (B - 1) + [T + 5 * (B - 1)]
        cu_un = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
        out = {}
        for on in (False, True):
            mgpu.ALIGN_SEGMENTS = on
            try:
                f = jax.jit(lambda *a: kda_chunk(*map(pk, a[:5]), initial_state=a[5], cu_seqlens=a[6], impl="pallas"))
                tag = "aligned" if on else "packed"
                if on:
                    o = f(*jin, cu_eq)[0]
                    out["aligned_bitwise_equal_packed"] = bool(jnp.array_equal(o[0], pk(o_packed)[0]))
                    out["aligned_ms"] = jax_ms(lambda: ([f(*jin, cu_eq) for _ in range(R)], R))
                out[f"varlen_unaligned_{tag}_ms"] = jax_ms(lambda: ([f(*jin, cu_un) for _ in range(R)], R))
            except Exception as e:
                out[f"align_segments_{on}_error"] = repr(e)[:400]
                traceback.print_exc()
            finally:
                mgpu.ALIGN_SEGMENTS = False
        return out

    rows = []
    res["results"] = rows

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    clock = {"t": time.perf_counter()}

    def emit(row):  # rewrite the JSON after every row, so a cut-off run keeps what it measured
        now = time.perf_counter()  # seconds since the previous row (or the start): plans device calls
        row["bench_s"], clock["t"] = round(now - clock["t"], 1), now
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)

    # ---- decode ----
    for H in args.heads:
        for N in args.decode_batch:
            variants = [("default", {})] + ([(v, DECODE_VARIANTS[v]) for v in args.decode_variants]
                                       if N in args.variant_batch else [])
            fla_ms = o_fla = ht_fla = h0 = fprof = None
            fpool = {}
            try:
                q, k, v, g, beta = inputs(N, 1, H)
                if fla is not None:
                    h0 = torch.randn(N, H, 128, 128, device=dev) * 0.01
                    f = lambda: fla[1](q, k, v, g, beta, initial_state=h0, output_final_state=True)
                    fla_ms = do_bench(f, warmup=10, rep=200, return_mode="median")
                    o_fla, ht_fla = f()
                    if args.profile:  # fla's kernel time by the same profiler, over >= 320 MB of states
                        hs = [torch.randn_like(h0) * 0.01 for _ in range(max(2, -(-320 * 2**20 // h0.nbytes)))]

                        def frun():
                            for hh in hs:
                                fla[1](q, k, v, g, beta, initial_state=hh, output_final_state=True)
                            torch.cuda.synchronize()

                        try:
                            fprof = kernel_summary(device_events(frun, args.profile), args.profile * len(hs))
                        except Exception as e:
                            fprof = {"error": repr(e)[:300]}
                        del hs
                if fla is not None and len(fla) > 2:
                    try:
                        fpool = fla_pool_row(q, k, v, g, beta, h0, N, H)
                    except Exception as e:
                        fpool = {"fla_pool_error": repr(e)[:400]}
                        traceback.print_exc()
            except Exception as e:
                print("fla decode failed", repr(e)[:300])
            for name, opts in variants:
                kw = dict(api=None, vt=None, tiles=None, xla_casts=True) | opts
                vt = min(kw["vt"] or mgpu.decode_vt(N, H, 128, kw.get("layout")), 128)
                # the colwarp layout's vt-32 form replicates two warps since session 11 (rows before: 16 row lanes)
                lay = mgpu.layout_label(kw.get("layout"), 128, vt)
                row = {"op": "decode", "shape": {"batch": N, "heads": H, "K": 128, "V": 128},
                       "variant": {"name": name, "api": kw["api"] or mgpu.default_decode_api(), "vt": vt,
                                   "tiles": 1 if kw.get("ctas") else kw["tiles"] or mgpu.decode_tiles(N, H, 128, vt),
                                   "layout": lay,
                                   "auto_barriers": (mgpu.decode_auto_barriers(kw.get("layout"), 128, vt)
                                                     if kw.get("auto_barriers") is None else kw["auto_barriers"]),
                                   "version": "XLA casts" if kw["xla_casts"] else "v2 (in-kernel casts)",
                                   "ctas": kw.get("ctas"),  # None: the grid form; P: the persistent form
                                   "dense": bool(kw.get("dense"))}}  # True: no slot ids (the pool's first N states)
                if name != "default":
                    row["variant_row"] = True
                try:
                    state_bytes = 2 * N * H * 128 * 128 * 4
                    # pool of >= 4 disjoint slot sets and >= 320 MB, one set per step
                    per_slot = H * 128 * 128 * 4
                    sets = max(4, -(-320 * 2**20 // (N * per_slot)))
                    NS = N * sets
                    jq, jk, jv, jg, jb = (t2j(t[:, 0]) for t in (q, k, v, g, beta))
                    pool = jax.random.normal(jax.random.key(0), (NS, 1, H, 128, 128), jnp.float32) * 0.01
                    if h0 is not None:  # the first slot set holds fla's h0: compare outputs
                        pool = pool.at[:N, 0].set(t2j(h0))
                    slot_sets = jnp.arange(NS, dtype=jnp.int32).reshape(sets, N)
                    no_reset = jnp.zeros((N,), bool)
                    R = 16
                    dense = kw.pop("dense", False)
                    dec = lambda pool, i: mgpu.decode(jq, jk, jv, jg, jb, pool, None if dense else slot_sets[i % sets],
                                                      no_reset, layer=0, scale=128**-0.5, **kw)
                    if dense:  # one dense pool a call, min(R, sets) of them (as fla's list of h0s)
                        pool = [pool[i * N:(i + 1) * N] for i in range(min(R, sets))]
                    o, pool_after = jax.jit(lambda p: dec(p[0] if dense else p, 0))(pool)
                    if dense:
                        pool[0] = pool_after
                        pool_after = pool
                    if o_fla is not None:
                        row["rel_err_o_vs_fla"] = rel(o, t2j(o_fla[:, 0].float()))
                        row["rel_err_state_vs_fla"] = rel((pool_after[0] if dense else pool_after)[:N, 0], t2j(ht_fla))
                    if "o" in fpool:
                        row["rel_err_o_vs_fla_pool"] = rel(o, t2j(fpool["o"]))
                    row.update({kk: vv for kk, vv in fpool.items() if kk != "o"})
                    if fpool.get("fla_pool_kernel_us"):
                        row["fla_pool_kernel_bandwidth_frac"] = (state_bytes / (fpool["fla_pool_kernel_us"] * 1e-6)
                                                                 / 1e9 / copy_gbps)
                    del pool

                    def steps(pool):
                        for i in range(R):
                            if dense:
                                o, pool[i % len(pool)] = dec(pool[i % len(pool)], i)
                            else:
                                o, pool = dec(pool, i)
                        return o, pool

                    steps = jax.jit(steps, donate_argnums=0)
                    box = {"pool": pool_after}
                    ptr0 = (box["pool"][0] if dense else box["pool"]).unsafe_buffer_pointer()

                    def run():
                        o, box["pool"] = steps(box["pool"])
                        return (o, box["pool"]), R

                    ours = jax_ms(run)
                    row["in_place"] = (box["pool"][0] if dense else box["pool"]).unsafe_buffer_pointer() == ptr0
                    row.update(ours_ms=ours, fla_ms=fla_ms, bandwidth_frac=state_bytes / (ours * 1e-3) / 1e9 / copy_gbps,
                               fla_bandwidth_frac=None if fla_ms is None else state_bytes / (fla_ms * 1e-3) / 1e9 / copy_gbps)
                    if args.profile:
                        try:
                            prof = kernel_summary(device_events(lambda: run()[0], args.profile), args.profile * R)
                            kern = [v for n, v in prof["kernels"].items() if "kda_decode" in n]
                            prof["decode_kernel_us"] = kern[0]["mean_us"] if kern else None
                            if kern:
                                row["kernel_bandwidth_frac"] = state_bytes / (kern[0]["mean_us"] * 1e-6) / 1e9 / copy_gbps
                            row["profile"] = prof
                            fk = [v for n, v in (fprof or {}).get("kernels", {}).items() if "recurrent" in n]
                            if fk:
                                row["fla_kernel_us"] = fk[0]["mean_us"]
                                row["fla_kernel_bandwidth_frac"] = state_bytes / (fk[0]["mean_us"] * 1e-6) / 1e9 / copy_gbps
                                row["fla_profile"] = fprof
                            elif fprof:
                                row["fla_profile"] = fprof
                        except Exception as e:
                            row["profile_error"] = repr(e)[:400]
                    box = pool_after = None
                except Exception as e:
                    row["error"] = repr(e)[:600]
                    traceback.print_exc()
                emit(row)
            del q, k, v, g, beta, h0, o_fla, ht_fla
            torch.cuda.empty_cache()

    # ---- speculative verify (gamma = 7) + fold vs verify with per-step snapshots ----
    for spec in args.verify:
        N, H = map(int, spec.split("x"))
        row = {"op": "verify_fold", "shape": {"batch": N, "heads": H, "gamma": args.gamma, "layers": 1, "K": 128, "V": 128}}
        try:
            row.update(bench_verify_fold(inputs, N, H, args.gamma, copy_gbps,
                                         forms=verify_forms(args.verify_no_auto_barriers, args.verify_layouts,
                                                            args.verify_tiles)))
        except Exception as e:
            row["error"] = repr(e)[:600]
            traceback.print_exc()
        emit(row)
        torch.cuda.empty_cache()

    # ---- prefill ----
    for spec in args.prefill:
        B, T, H = map(int, spec.split("x"))
        row = {"op": "prefill", "shape": {"batch": B, "T": T, "heads": H, "K": 128, "V": 128}}
        try:
            q, k, v, g, beta = inputs(B, T, H)
            h0 = torch.randn(B, H, 128, 128, device=dev) * 0.01
            fla_ms = None
            if fla is not None:
                f = lambda: fla[0](q, k, v, g, beta, initial_state=h0, output_final_state=True)
                fla_ms = do_bench(f, warmup=10, rep=100, return_mode="median")
                o_fla, ht_fla = f()
            jin = [t2j(t) for t in (q, k, v, g, beta, h0)]
            fn = jax.jit(lambda *a: kda_chunk(*a[:5], initial_state=a[5], impl="pallas"))
            o, ht = fn(*jin)
            if fla is not None:
                row["rel_err_o_vs_fla"] = rel(o, t2j(o_fla.float()))
                row["rel_err_state_vs_fla"] = rel(ht, t2j(ht_fla))
                del o_fla, ht_fla
            del o, ht
            R = 3 if B * T * H >= 32768 * 96 else 5

            def run():
                out = [fn(*jin) for _ in range(R)]
                return out, R

            ours = jax_ms(run)
            if args.fused_inputs:
                row.update(fused_inputs_row(jin, (q, k, v, g, beta, h0), B, T, H, R))
            if args.align_segments and B > 1:
                row.update(aligned_segments_row(jin, fn(*jin)[0], B, T, R))
            # split: the XLA intra-chunk prep vs the Mosaic GPU sequential kernel
            cu = jnp.arange(B + 1, dtype=jnp.int32) * T
            pk = lambda x: x.reshape((1, B * T) + x.shape[2:])
            prep = jax.jit(lambda *a: mgpu.chunk_operands(*map(pk, a[:5]), a[5], cu, scale=128**-0.5))
            ops = prep(*jin)
            row["prep_ms"] = jax_ms(lambda: ([prep(*jin) for _ in range(R)], R))
            row["prep_version"] = PREP_VERSION
            if args.prep_unrolled:  # v4: the same kernel unrolled (~21k straight-line PTX instructions per thread)
                prep4 = jax.jit(lambda *a: mgpu.chunk_operands(*map(pk, a[:5]), a[5], cu, scale=128**-0.5, prep="mgpu"))
                try:
                    row["prep_unrolled_ms"] = jax_ms(lambda: ([prep4(*jin) for _ in range(R)], R))
                except Exception as e:  # a variant's failure keeps the row's other figures
                    row["prep_unrolled_error"] = repr(e)[:400]
            # the inter kernel alone (vt 32: twice the CTAs, each chunk's products half as wide);
            # `chunk` picks `mgpu.inter_vt`
            row["inter_vt"] = mgpu.inter_vt(B, H, 128)
            for vt in args.inter_vt or [row["inter_vt"]]:
                inter = jax.jit(lambda *o, vt=vt: mgpu._chunk_inter_call(*o, B * T, vt=vt))
                try:
                    row[f"inter_vt{vt}_ms"] = jax_ms(lambda: ([inter(*ops) for _ in range(R)], R))
                except Exception as e:
                    row[f"inter_vt{vt}_error"] = repr(e)[:400]
            row["inter_ms"] = row.get(f"inter_vt{row['inter_vt']}_ms")
            ops = None
            if spec == args.breakdown:  # the XLA prep (same algorithm) for comparison
                prep_x = jax.jit(lambda *a: mgpu.chunk_operands(*map(pk, a[:5]), a[5], cu, scale=128**-0.5, prep="xla"))
                row["prep_xla_ms"] = jax_ms(lambda: ([prep_x(*jin) for _ in range(R)], R), reps=3)
                row["prep_breakdown_ms"] = prep_breakdown(jin, B, T, H, R)
            row.update(ours_ms=ours, fla_ms=fla_ms, bandwidth_frac=None)
        except Exception as e:
            row["error"] = repr(e)[:600]
            traceback.print_exc()
        emit(row)
        torch.cuda.empty_cache()

    print("\nop       shape                         ours_ms   fla_ms   bw_frac  fla_bw   err_vs_fla")
    for r in rows:
        sh = "x".join(f"{v}" for v in r["shape"].values())
        if "variant" in r:
            sh += f" {r['variant'].get('name', r['variant']['version'][:2])}"
        f = lambda x, fmt="{:8.4f}": "    -   " if x is None else fmt.format(x)
        print(f"{r['op']:8} {sh:28} {f(r.get('ours_ms'))} {f(r.get('fla_ms'))} {f(r.get('bandwidth_frac'), '{:7.3f}')} "
              f"{f(r.get('fla_bandwidth_frac'), '{:7.3f}')} {r.get('rel_err_o_vs_fla', r.get('error', ''))}")
    for r in rows:
        if r["op"] == "verify_fold" and "ours_ms" in r:
            print(f"verify_fold {r['shape']['batch']}x{r['shape']['heads']}: fold {r['ours_ms']:.4f} ms, snapshots "
                  f"{r['snapshots_ms']:.4f} ms, xla {r['xla_ms']:.4f} ms (verify {r['verify_only_ms']:.4f} + fold "
                  f"{r['fold_only_ms']:.4f}); scratch {r['scratch_bytes_fold'] / 2**20:.1f} vs "
                  f"{r['scratch_bytes_snapshots'] / 2**20:.1f} MiB; err {r['rel_err_state_fold_vs_xla']:.2e}")
            for sfx in (key[4:] for key in r if key.startswith("form_")):
                print(f"  {sfx[1:]} {r[f'form{sfx}']}: fold {r[f'fold{sfx}_ms']:.4f} ms (verify "
                      f"{r[f'verify_only{sfx}_ms']:.4f} + fold {r[f'fold_only{sfx}_ms']:.4f})")
        if r["op"] == "prefill" and "prep_ms" in r:
            sh = r["shape"]
            g = lambda k: "-" if r.get(k) is None else f"{r[k]:.3f}"
            print(f"prefill {sh['batch']}x{sh['T']}x{sh['heads']}: prep {g('prep_ms')} / v4 unrolled "
                  f"{g('prep_unrolled_ms')} ms, inter vt64 {g('inter_vt64_ms')} / vt32 {g('inter_vt32_ms')} ms "
                  f"(default vt {r.get('inter_vt')})")
            if "fused_inputs_ms" in r or "fused_inputs_error" in r:
                print(f"  gate + L2 norm in the prep kernel {g('fused_inputs_ms')} ms (six levels "
                      f"{g('fused_inputs_six_levels_ms')}) vs in XLA first "
                      f"{g('xla_inputs_ms')} ms, fla fused {g('fla_fused_inputs_ms')} ms (err "
                      f"{r.get('rel_err_fused_vs_xla_inputs', r.get('fused_inputs_error'))})")
        if r["op"] == "decode" and "profile" in r:
            sh, p = r["shape"], r["profile"]
            g = lambda x, fmt="{:.1f}": "-" if x is None else fmt.format(x)
            print(f"decode {sh['batch']}x{sh['heads']} {r['variant'].get('name')}: kernel {g(p.get('decode_kernel_us'))} us "
                  f"({g(r.get('kernel_bandwidth_frac'), '{:.3f}')} of copy bw), fla kernel {g(r.get('fla_kernel_us'))} us "
                  f"({g(r.get('fla_kernel_bandwidth_frac'), '{:.3f}')}); gaps between our kernels: median "
                  f"{g(p.get('gap_us_median_under_200'))} us")
    print(f"copy {copy_gbps:.0f} GB/s")


if __name__ == "__main__":
    main()
