#!/usr/bin/env bash
# The pending H200 measurements for issue 6 [pallas-kda], as numbered device calls (bench/NOTES.md,
# sessions 12 and 13, say what each one decides). Run one call per `device` run, from the repo root,
# with carry [".whl"] (fla-core 0.6.0, pytest-xdist, execnet and grpc wheels: bench/NOTES.md, "How to run"):
#
#     bash bench/device_calls.sh 1     # then 2, 3, 4; each < 10 minutes
#     bash bench/device_calls.sh list  # what each call runs
#
# Everything goes under $OUT (tests.txt, the bench JSON, a log per step), at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/.."

calls() {
    cat <<'EOF'
1  tests/gpu in full (~9 min on an H100 with -n 8: session 21's run reached its last test as the 560 s limit
   came, 89 passed, the two strict speculative tests without the mode failed as in call 15) -> tests.txt.
   Session 29 (H100, MLA kernel on by default): 110 passed, none failed, four of the mode's compile-bound cases cut
2  decode at batch 64, 256, 1024 x 12 and 96 heads: the default against colwarp8 at 1, 2, 4 tiles a CTA
   (~5 min) -> kda_colwarp8.json. Ran in session 19 (H100, results/session19/): colwarp8 1.8-2.5% slower
   than the default at every batch >= 64, two and four tiles slower still: STEP_LAYOUT stays "colwarp"
3  prefill rows with the gate and the L2 norm fused (ours fused, XLA first; fla fused) at
   1 x 32k x 12 and 8 x 4k x 12, then verify + fold without barriers and in colwarp8 at 256 x 12 and
   64 x 12, then the prep kernel alone and with no levels (~6 min; ran in session 13)
   -> kda_fused.json, kda_verify.json, ablation.json
4  k3-mini prefill 4k and 16k (pallas, xla) and decode at batch 1, with the profile's kda_proj/qk_norm
   and kda_proj/gate scopes (~6 min) -> k3_mini_prefill.json. Session 23 (H100) got 187 s of it, in the
   stacked layout (the bench's default then; now split, the engine's): decode 8.43 ms pallas / 8.55 xla,
   prefill 4k pallas 76.1 ms, with the fused inputs 75.9 (no gain: dropped from the call); the profile puts
   29 of the 76 ms in the routed experts' grouped-matmul kernel (~260 TFLOP/s: untuned for prefill).
   Session 24 (H100, split): decode 3.70 / 3.72 ms; prefill 4k 75.7 ms Pallas, 88.5 XLA; 16k out of memory
   on both paths (a 27.6 GiB temporary: the MLA attention's f32 keys and scores, quadratic in the context).
   Now (session 24): prefill 4k and 16k and decode at batch 64 with 16k in context, Pallas path, each with
   the MLA attention's blocked XLA form (`mla.XLA_FORM`, keys in page blocks, online softmax; the default)
   and the dense one (~6 min) -> k3_mini_prefill.json, k3_mini_long.json. Prediction: the blocked form runs
   the 16k prefill (temporaries ~1-3 GB; the dense one runs out of memory again), in ~300-400 ms; at 4k
   both within 5% (75.7 ms); decode at 64 x 16k: the blocked form's mla_ms well under the dense one's (no
   f32 copy of every key). Rule: blocked stays the default unless it is > 10% slower at 4k or in decode.
   Ran in session 24 (H100, results/session24/*_mla_*): 4k 79.8 ms blocked / 77.0 dense (mla 9.0 / 5.9;
   temporaries 1.8 / 2.5 GB); 16k 485.8 ms blocked (mla 182, temporaries 6.8 GB), dense out of memory (28.3
   GB); decode 64 x 16k 13.29 / 12.94 ms (mla 7.2 / 6.8; 0.34 / 2.17 GB). The 16k held, its time missed (486,
   not 300-400: MLA is quadratic), decode missed (blocked 6% slower in MLA, not faster). Rule: blocked stays
5  batch invariance (session 14): bench/batch_invariance.py --layers --engine on the XLA and the Pallas
   path (the first layer whose output row moves between decode, mixed and verify steps; the engine's
   speculative tokens against plain, overlap on and off), the Pallas path again with
   --xla_gpu_deterministic_ops (~7 min) -> bi_xla.json, bi_pallas.json, bi_pallas_det.json
6  tests/gpu in full, then call 5's Pallas-path check with one seed and no GEMM table (the layers, the
   engine: plain twice, speculative with and without overlap, the verify rows against a decode chain),
   then the XLA path's verify rows against the chain (~9 min) -> tests.txt, bi_pallas.json, bi_xla.json
7  call 6 cut to a short budget: tests/gpu/test_engine_gpu.py (the model and the engine on the kernels,
   the speculative test, since session 15 on both paths and strict), then the Pallas-path engine
   check (~6 min) -> tests.txt, bi_pallas.json
8  which XLA_FLAGS make the f32 GEMM rows batch-invariant: the GEMM table (--no-step) under seven flag
   sets, one process each (~2 min) -> gemm_<set>.json. Ran in session 19 (H100): none, autotune level 0,
   cuBLAS only and deterministic ops leave 0 of 10 weight shapes bitwise equal at every M; the split-K and
   dot-strength-reduction flags no longer exist in JAX 0.11.2's XLA. No flag route: the batch-invariant
   mode is the remedy (call 9, the speculative tests under such a flag, was dropped)
10 verify + fold with two and four V tiles a CTA (session 14): tests/gpu's tiles and bitwise cases, then
   verify + fold at 64 x 12 and 256 x 12 in colwarp and colwarp8 at 1 and 2 tiles (~6 min)
   -> tests.txt, kda_verify_tiles.json. Ran in session 19 (H100): the 12 cases pass; colwarp8 at 256 x 12
   0.50-0.51 ms against colwarp's 0.43-0.48; with call 2, colwarp8 is not adopted
11 aligned segments (session 15): tests/gpu's pack-offset, varlen, snapshot / pool cases with and without
   mgpu.ALIGN_SEGMENTS and the speculative engine tests, then 8 x 4k x 12 prefill timed packed and aligned,
   with equal and unaligned starts (~6 min) -> tests.txt, kda_aligned.json. Rule: ALIGN_SEGMENTS = True
   if the tests pass and the aligned varlen prefill costs <= 5% (fla 8 x 4k: 1.47 ms). Ran in session 23
   (H100, results/session23/): the kernel cases pass (the speculative ones part, as in calls 12 and 15:
   without the mode); 8 x 4k x 12 packed 1.35 ms, aligned 1.92 (equal starts) and 1.91 (unaligned), fla
   1.64: +42%, so ALIGN_SEGMENTS stays off (the batch-invariant mode aligns anyway)
12 the batch-invariant mode (session 17: `LLM(batch_invariant=True)`, row blocks of 128): k3-mini decode at
   batch 1 and 64 with and without the mode, then tests/gpu/test_engine_gpu.py -k "batch_invariant or
   speculative" on both paths. Ran in session 18 (on an H100, results/session18/): the mode's mixed step
   parted from decode by ~1.7e-5 on both paths (the GEMM autotuner, per fusion shape); fixed by
   `dispatch.block_loop`; call 13 checks the fix
13 the batch-invariant mode after session 18's `block_loop`: tests/gpu/test_engine_gpu.py -k batch_invariant on
   both paths, then k3-mini decode at batch 1 and 64 with and without the mode. Ran in session 18 (H100):
   both paths pass; 5.02 -> 14.6 ms at batch 1, 6.86 -> 24.9 ms at batch 64 (the MoE's expert blocks)
14 the mode's cost: k3-mini decode at batch 1 and 64 without the mode and in it with one and four expert
   blocks a loop step (`moe.EXPERT_GROUP`), then with XLA_FLAGS command buffers that include WHILE and
   CONDITIONAL, then the mode's tests/gpu test under those flags (~6 min) -> k3_mini_invariant.json,
   k3_mini_cmdbuf.json, tests.txt. Ran in session 19 (H100): four blocks a step 17.7 ms at batch 1 (one:
   15.7), 25.7 at 64 (one: 26.4): EXPERT_GROUP stays 1; the command buffers made the mode slower (18.1 and
   29.2 ms) and left the mode-off step within noise; the mode's bits held under them
15 the speculative tests without the mode on both paths (~4 min) -> tests.txt. Ran in session 19 (H100):
   both paths part (Pallas: request 7; XLA: requests 5 and 7) with the f32 referee's margins 4.05 and -1.80
   (top-2 gaps 0.17 and 0.92): not logit near-ties (bench/NOTES.md, session 19)
16 the routed experts' grouped matmul: `jax.lax.ragged_dot`, which XLA's GPU backend lowers as a zero-padded
   dense product (the k3-mini profile, session 4: moe_experts 2.2 of 3.7 ms at batch 1; at 64 and 256 the
   cuBLAS kernels filed under "other", 2.6 and 10.8 ms), against `moe.GROUPED_MATMUL = "slabs"` (batched
   products over all experts, T rows each), "pallas" (the Mosaic GPU grouped-matmul kernel,
   pallas_kernels/moe.py: one CTA per (64-row expert block, N tile), unused blocks skipped; first run on a
   GPU in call 18) and ragged_dot under XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true
   (cuDNN's grouped GEMM): tests/gpu/test_moe_gpu.py (every form against float64; the ragged cases again
   under the flag), then k3-mini decode at batch 1, 64 and 256: ragged, slabs and pallas without the flag,
   ragged with it (~8 min) -> tests.txt, tests_rd.txt, k3_mini_ragged0.json, k3_mini_ragged1.json.
   Predictions: slabs level with ragged at batch 1 (both read all 16 experts' weights) and 2x or more faster
   at 256 (1/4 of the dense form's products); pallas at or below ragged everywhere, reading only the used
   experts at batch 1 (moe ~1 ms, not ~2.8); the flag's ragged_dot level with pallas if cuDNN has a plan
   for these shapes (else the flagged runs fail at compile). Rule: the fastest form that passes its tests
   at every batch becomes the GPU default (`GROUPED_MATMUL`, or the flag set by the engine on GPUs).
   Session 19's call 18 (H100) already made the kernel the default ("auto"); this call re-times it on the
   H200 and decides between it and cuDNN's. Ran in session 20 (H100; results/session20/): every form passes
   (32 cases); the kernel is fastest at every batch (4.12 / 6.21 / 11.49 ms against ragged 5.61 / 7.82 /
   18.13, slabs 5.71 / 7.00 / 12.03); the flag changes nothing there (cuDNN 9.19 on the device, below the
   9.22 it needs): the kernel stays the default
17 the mode's routed experts by rounds (`moe.INVARIANT_EXPERTS = "rounds"`: every expert's next block of 128
   rows a loop step as one batched product over the whole weights; "blocks", the default, slices one used
   expert's weights a step, and call 14's profile put 6.5 of the mode's 15.2 ms of MoE at batch 64 in
   those slices' copies): tests/gpu/test_engine_gpu.py -k batch_invariant (both forms, both paths), then
   k3-mini decode at batch 1 and 64 without the mode and in it with blocks and rounds (~6 min) -> tests.txt,
   k3_mini_rounds.json. Prediction: the four cases pass; rounds cut the mode's moe_ms at batch 64 from
   ~15 to ~3 ms (all 16 experts' weights read once a layer: 7.4 GB a step) and at batch 1 from ~5 to
   ~2.5-3. Rule: rounds becomes the mode's default if it passes and is faster at both batches. Ran in
   session 20 (H100): the four cases pass; rounds 17.5 / 18.4 ms at batch 1 / 64 against blocks' 15.5 / 26.6
   (moe 6.5 / 6.6 against 5.2 / 15.2): slower at batch 1, so blocks stays (call 20 tries the kernel)
18 call 16 cut to a short budget: the grouped-matmul kernel's first GPU run (tests/gpu/test_moe_gpu.py's
   bf16 "pallas" cases), then k3-mini decode at batch 1 and 64 with ragged and pallas (~3 min) -> tests.txt,
   k3_mini_moe.json. Ran in session 19 (H100): the tests pass; 5.01 -> 3.76 ms at batch 1, 7.06 -> 6.10 at
   64 (and, run by hand after it, 17.59 -> 10.69 at 256): the kernel is the GPU default since then
19 decode against fla's kernel in its serving form (session 20): the state pool read by slot index and
   written in place, as vLLM calls `fused_recurrent_kda_fwd` for Kimi Linear and as our kernel works, beside
   the public `fused_recurrent_kda` on a dense h0 (no slot read), kernel times from a profile; 12 heads at
   batch 1, 64, 256, 1024 and 96 heads at 1, 64, 256, colwarp8 at batch 1 (~5 min) -> kda_pool12.json,
   kda_pool96.json. Ran in session 20 (H100, results/session20/): fla's serving form is slower than ours at
   every shape (1 x 96: 6.97 against 6.73 us; 1024 x 12: 588 against 557), its dense form faster at batch >= 64
   (by 1.5-3%) and at 1 x 96 (6.09)
20 the batch-invariant mode's routed experts on the grouped-matmul kernel (`moe.INVARIANT_EXPERTS = "kernel"`,
   session 20: no loop, the N tile fixed by the width): tests/gpu/test_engine_gpu.py -k "batch_invariant and
   kernel" (bf16 k3-tiny, both paths), then k3-mini decode at batch 1 and 64 without the mode and in it with
   blocks and kernel (~6 min) -> tests.txt, k3_mini_kernel_mode.json. Prediction: both cases pass (a wgmma
   row is its own row's products whatever the block's other rows) and the mode's moe_ms drops to the
   mode-off figure (~2.1 / 2.6 ms at batch 1 / 64 on the H100, against blocks' 5.2 / 15.2). Rule: "kernel"
   becomes the mode's default if the tests pass and it is faster at both batches. Ran in session 21 (H100,
   results/session21/): the "kernel" cases pass on both paths (run again by hand: the old -k also matched the
   test's name, ran all six cases and hit its limit; now by node id); the mode's step 12.9 / 13.1 ms against
   blocks' 14.7 / 25.2 (moe 1.5 / 2.3 against 5.2 / 15.3; mode off 3.7 / 5.7): "kernel" is the default. The
   mode's remaining cost is outside the MoE ("other" 7.6 / 6.2 ms: the row-block loops' GEMMs and copies)
21 the grouped-matmul kernel's TMA stages (`pallas_kernels.moe.STAGES`, 2 until now): tests/gpu/test_moe_gpu.py
   -k "kernel_rows or pallas" (bits equal at 2, 3, 4, 6 stages; a row's bits alone, elsewhere in its block
   and in another grid), then k3-mini decode at batch 1, 64, 256 with 2, 3, 4 and 6 stages (~6 min)
   -> tests.txt, k3_mini_stages.json. Prediction: at batch 1 (1-2 CTAs an SM, each waiting one TMA
   latency a K step with 2 stages) 4 stages take the routed experts from ~0.6 to ~0.85 of copy bandwidth:
   the step ~0.3 ms faster (4.1 -> ~3.8 ms on the H100); at 256 (many CTAs an SM) within 2%. Rule: STAGES =
   the fewest stages within 1% of the fastest at every batch. Ran in session 21 (H100): the 9 cases pass;
   step ms 2 stages 3.70 / 5.64 / 10.51, 3 stages 3.66 / 5.62 / 10.40, 4 3.76 / 5.65 / 10.63, 6 3.70 / 5.68 /
   10.63 (moe_ms at batch 1: 2.16, 2.08, 2.09, 2.12): STAGES = 3. The prediction (4 stages ~0.3 ms faster at
   batch 1) missed: the lookahead is not what holds the routed experts at ~0.6 of copy bandwidth
22 the issue's k3-mini table on today's defaults (the grouped-matmul kernel, the split layout): decode at
   batch 1, 16, 64 and 256 on the Pallas and the XLA path, with the profile's breakdown (~6 min)
   -> k3_mini_decode.json. The README's table is session 4's (H200, ragged_dot). Watch kernel_ms_per_step
   against step_ms: in call 16 (H100) 0.86 ms of the 4.12 ms batch-1 step and 1.5 of 11.5 at 256 were not
   kernel time (launch gaps and host work between a step's kernels). Ran in session 21 (H100, STAGES 2):
   pallas / xla step ms 3.72 / 3.86 (batch 1), 4.42 / 4.76 (16), 5.88 / 7.24 (64), 10.68 / 16.77 (256); in
   the README
23 the persistent decode (session 21: `mgpu.decode(ctas=P)`, P CTAs each stepping its tiles through two
   buffers, the next tile's loads and the slot id of the one after in flight while a tile is stepped):
   tests/gpu's persistent cases (in place against the f32 reference; bit for bit the grid form), then decode
   at 64, 256, 1024 x 12 and 96 heads, the default against P = 132, 264, 396, fla's two forms in the same
   run (~6 min) -> tests.txt, kda_persistent.json. Why: against fla's dense form ours is 1.5-3% slower at
   batch >= 64 on the H100 (call 19), and what ours does that it does not is the slot read before each
   CTA's state load, and a CTA launch per tile. Prediction: P = 264 (two CTAs an SM) 1-3% faster than the
   grid form at batch >= 256, level with or faster than fla's dense form; at 64 x 12 (1,536 tiles) within
   1%. Rule: the persistent form becomes decode's default above the grid size where it wins at every
   measured batch by > 0.5%, with the P that wins. Ran in session 22 (H100, results/session22/): 26 tests
   passed (the "ref" api in place; bit for bit the grid form); every P 1.7-3.5% slower than the grid form at
   batch >= 256 and 64 x 96, within 2% at 64 x 12 (kernel us 64 x 12: 37.8 grid, 37.1 at P = 396; fla dense
   36.3): not adopted, `ctas=` stays opt-in
24 the batch-invariant mode's projections on the grouped-matmul kernel (session 21: `common.INVARIANT_PROJ =
   "auto"`, one group, the N tile fixed by the width, no row-block loop; call 20's profile put 6-8 ms of the
   mode's step in the loops' cuBLAS GEMMs and copies): tests/gpu/test_engine_gpu.py's "kernel_proj" mode cases
   (bf16 k3-tiny, both paths), then k3-mini decode at batch 1 and 64 without the mode and in it with the
   projections in blocks and on the kernel (~6 min) -> tests.txt, k3_mini_proj_mode.json. Prediction: both
   pass (the kernel's rows were bit for bit alone and among others in call 21) and the mode's step drops
   from ~12.9 / 13.1 ms to ~7-8 ms at batch 1 / 64 ("other" from 7.6 / 6.2 to ~3). Rule: "auto" becomes the
   default if the tests pass and it is faster at both batches. Ran in session 22 (H100): the tests did not
   finish (300 s under -n 2; the pallas case alone > 290 s: compile-bound); step 10.22 / 11.35 ms against
   blocks' 13.70 / 13.88 (the projections' kernel runs N / 128 CTAs at batch <= 64): stays "blocks"
25 the mode's projections with K splits (session 22: `gmm.fixed_k_splits`, K cut by the weight's shape alone
   so a projection's one row block runs on ~one CTA an SM, the partials added in a fixed order):
   tests/gpu/test_moe_gpu.py's kernel-rows test (a row's bits alone and among others, K in one range and in
   four splits), then k3-mini decode at batch 1 and 64 without the mode and in it with the projections in
   blocks and on the kernel (~6 min) -> tests.txt, k3_mini_proj_split.json. Why: call 24's projections on
   the kernel took ~2.9 ms of the step at batch 1 on N / 128 CTAs (12 for a 7168 -> 1536 weight).
   Prediction: the test passes; the projections go from ~2.9 ms to ~0.7 and the mode's step from 10.2 /
   11.4 ms to ~8 / ~9. Rule: with calls 26 and 27 passing, "auto" becomes the default if it is faster than
   blocks at both batches. Ran in session 23 (H100, results/session23/): the test passes; the mode's step
   8.50 / 9.44 ms against blocks' 13.23 / 13.25 (mode off 3.74 / 5.89); the projections ~1.4 ms (the
   prediction's ~0.7 missed, the step's ~8 / ~9 held); with 26 and 27: "auto" is the default
26 the "kernel_proj" mode case on the Pallas path alone, with a 560 s limit and the slowest phases named
   (--durations): whether it passes at all, and how long it takes (call 24's runs did not finish in 290 s)
   (~10 min) -> tests.txt. Then call 27 for the XLA path's case. Ran in session 23 (H100): passed in 364 s
27 call 26 for the XLA path's case (~10 min) -> tests.txt. Ran in session 23 (H100): passed in 340 s
28 the batch-invariant mode's copies (session 23): k3-mini decode at batch 1 and 64 with and without the
   mode, each row's compiled HLO (hlo.tgz) and its copy count and MB (entry computation / loop bodies,
   `bench._common.hlo_copies`) -> k3_mini_copies.json, hlo.tgz (~4 min). Ran in session 24 (H100,
   results/session24/) with `dispatch.DISTINCT_FILLS` (fills unique in the trace for the carries' starts and
   the pads) on and off: the flag took the entry copies from 233 / 229 MB to 0 at batch 1 / 64, and the
   step got no faster (8.63 -> 8.69 ms, 9.65 -> 9.89; prediction 8.5 -> ~8 missed): each copy became a fill
   kernel of the same bytes. The flag failed its rule and was removed. The HLO: every loop body copies 2-13
   carried blocks a trip (the rotation of the carry from one tuple slot to the next), ~1,000 copy kernels a
   step at batch 1 (memcpy kernels 1.8 ms in the profile), and the step's kernels leave ~1.8 ms of gaps
29 (dropped in session 24: tests/gpu's "kernel_proj_fills" mode case, for DISTINCT_FILLS, which call 28 removed)
30 the MLA attention's key blocks on a GPU (session 24): tests/gpu/test_mla_gpu.py (the blocked form, static
   and needed, and the dense one against float64 at k3-mini's widths; static == needed bit for bit; no f32
   copy of the pool in the compiled temporaries, which the CPU's XLA makes), then k3-mini decode at batch
   64 with a page table of 16k tokens a sequence (as an engine with max_seq_len 16k) and 1k in context,
   with the blocked form's `mla.KEY_BLOCKS` "static" (every block of the table) and "needed" (the loop
   stops after the last block a query sees: a device-bounded loop, whose condition XLA reads back to the
   host every trip) and the dense form; then 16k in context, static against needed (~6 min) -> tests.txt,
   k3_mini_blocks_1k.json,
   k3_mini_blocks_16k.json. Prediction: at 1k in the 16k table static ~13 ms (the whole table scored, as
   call 4's 64 x 16k) and needed ~6.5 (MLA ~0.6 ms plus a host read per trip); at 16k needed within 3% of
   static (9 reads a layer). Rule: "auto" takes "needed" on a GPU too if it is >= 30% faster at 1k in the
   16k table and <= 5% slower at 16k
31 the MLA decode kernel (session 25, `mla.mla_decode_mgpu`: Mosaic GPU, absorbed, ragged, q and the weights in
   two bf16 halves, key-range splits combined in XLA): tests/gpu/test_mla_gpu.py, then bench/mla_decode.py at
   batch 1, 64, 256 x context 16k (the kernel with q packed and not, on one and two warpgroups a CTA, and
   the blocked XLA form) (~4 min) -> tests.txt, mla_decode.json. Prediction: the tests pass (error vs float64
   < 1e-4); the kernel reads the keys at >= 0.6 of copy bandwidth at batch >= 64 with 16k (one CTA an SM,
   72-108 KiB in flight each) and is >= 5x faster than the blocked form there; packed faster than not; two
   warpgroups faster than one at 16k (the keys read once). Rule: with the tests passing, DECODE_KERNEL and
   GPU_KERNELS["mla_paged_attention"] become True (the kernel by default on a Hopper GPU) if it is faster than
   the blocked form at every measured shape, in its fastest layout (which becomes DECODE_PACKED /
   DECODE_WARPGROUPS's default). Ran in session 26 (H100, results/session26/): 4.4x / 4.9x the blocked form at 64 /
   256 x 16k (0.58 / 0.63 of copy), two warpgroups fastest (now the default); the float64 tests failed (q's low
   half zeroed by XLA, fixed since): call 36 reruns them
32 k3-mini decode at batch 1 and 64 with 16k in context, the MLA decode kernel against the blocked XLA form
   (~4 min) -> k3_mini_mla_kernel.json. Prediction: the 64 x 16k step from ~13.3 ms to ~7 (MLA 7.2 -> ~1 ms).
   Ran in session 26 (H100): 13.22 -> 7.61 ms (MLA 7.32 -> 1.96), batch 1 4.30 -> 4.20
33 the MLA kernel on prefill chunks too (session 26, `mla.PREFILL_KERNEL`: a 64-token chunk x 12 heads = 12 row
   blocks of 64 rows, each stopping at its own last visible key): tests/gpu/test_mla_gpu.py, then
   k3-mini prefill of 4k and 16k in one step, the blocked XLA form against the kernel (~6 min) -> tests.txt,
   k3_mini_prefill_kernel.json. Prediction: MLA in the 16k prefill from ~182 ms (session 24, blocked, H100) to
   ~40-60 (~11 TFLOP of wgmma with q's and the weights' two halves and the scores computed once a value half,
   at ~200-250 TFLOP/s), the step from ~486 to ~350 ms; at 4k MLA 9 -> ~3 ms. Rule: with the tests passing,
   PREFILL_KERNEL becomes True if the step is faster with it at both lengths
35 call 33 cut to a short budget: tests/gpu/test_mla_gpu.py, then k3-mini prefill of 4k alone, blocked against the
   kernel (~4 min) -> tests.txt, k3_mini_prefill_kernel.json (prediction and rule as 33's, at 4k)
36 tests/gpu/test_mla_gpu.py alone (~1.5 min) -> tests.txt: the MLA kernel against float64 after the bf16_halves fix.
   Rule: if they pass, DECODE_KERNEL and GPU_KERNELS["mla_paged_attention"] become True (call 31 found the kernel,
   two warpgroups, faster than the blocked form at every shape it measured); then 35 or 33 (prefill)
37 the MLA kernel as the default (session 28: DECODE_KERNEL, PREFILL_KERNEL and GPU_KERNELS["mla_paged_attention"] on
   after call 33): tests/gpu/test_engine_gpu.py without the two strict speculative cases (known to part on a GPU
   without the batch-invariant mode) and the compile-bound "kernel_proj" ones, then k3-mini decode at batch 1, 16,
   64, 256 x context 1k, Pallas path against XLA path (~9 min) -> tests.txt, k3_mini_h200.json. Prediction: the
   tests pass (the mode's "kernel" cases run a bf16 k3-tiny, so their MLA goes through the kernel one token a
   group); Pallas-path steps at 1k within a few % of session 4's H200 rows at batch 1-64 (MLA is ~0.3 ms of a
   1k step) and ~1-2 ms faster at 256. Ran in session 28 (H100, results/session28/): the tests' 270 s limit cut
   three cases (the mode's "kernel" ones on both paths, then run alone: both pass; "xla-rounds" not run), the
   other six pass; steps 3.73 / 4.37 / 5.47 / 9.65 ms at batch 1 / 16 / 64 / 256 (XLA path 3.71 / 4.80 / 7.24 /
   16.88), against session 21's 3.72 / 4.42 / 5.88 / 10.68 with MLA on XLA: 7% faster at 64, 1.0 ms at 256.
   The tests' bf16 k3-tiny has 80-wide MLA keys, which the kernel does not take: they never reached it (call 38)
38 tests/gpu/test_mla_gpu.py::test_engine_tokens_with_the_kernel (session 28): the engine's greedy tokens with the
   MLA attention on the kernel (decode, verify blocks, prefill chunks) against its XLA path, on a bf16 k3-tiny
   with the kernel's widths (192-wide keys), plain and speculative (~3 min) -> tests.txt. Its first run (session
   28) stopped in the speculative part on the KDA fold: impl "auto" sent k3-tiny's 32-wide keys to the fold
   kernel, which takes multiples of 64 (fixed: `kda.spec.kernel_impl` now rules for the fold too); the rerun hit
   its 150 s limit. Prediction: passes. Rule: if it fails, the tokens' first difference and margin decide
   (DESIGN.md section 4) whether DECODE_KERNEL stays the default. Ran in session 29 (H100): passed (155 s)
39 the dense decode (session 29, `mgpu.decode(slots=None)`: sequence n's state is pool[n], no slot id read
   before the state's loads, fla's dense job): tests/gpu's dense (bits equal the slot form) and
   persistent decode cases, then decode at 1 and 64 x 12 and 96 heads, the default (the serving job: a slot
   read first) and dense against fla's dense and serving forms, kernel time from the profile (~4 min)
   -> tests.txt, kda_dense.json (then call 38). Prediction: the
   slot read is what the default pays over fla's dense form at batch 1 (session 20 measured it at +0.56 /
   +0.88 us for fla's own kernel at 1 x 12 / 1 x 96): dense 1 x 96 ~5.3-5.6 us against fla's dense ~5.4 and the
   default's ~6.1, 1 x 12 ~2.5-2.7 (default ~2.9); at 64 x 12 within 1% of the default. Rule: if dense is
   at or below fla's dense kernel time at every shape measured, the decode goal holds in both jobs (ours
   against fla doing the same work); otherwise the slot read is not the gap, and what is left is named.
   Ran in session 29 (H100, results/session29/): dense 2.72 / 37.5 / 6.63 / 280.1 us at 1 x 12 / 64 x 12 / 1 x 96
   / 64 x 96 against the default's 2.90 / 37.8 / 6.69 / 280.3 and fla dense 2.99 / 36.4 / 6.05 / 275.9: the slot
   read is hidden already; the 1 x 96 gap is the grid (bench/NOTES.md)
34 the serving binary on a GPU (never measured there): bench/serve_load.py starts k3jax-serve with k3-mini
   (random bf16 weights, the defaults' kernels, --single-bucket, max_running 64, max_seq_len 4096, 1,024-token
   prefill chunks) and drives it with 1, 16 and 64 gRPC clients (Poisson arrivals at N/2 requests/s;
   128-2,048-token prompts, half behind 4 shared 512-token prefixes; 64-128 new tokens) (~8 min)
   -> serve_k3_mini.json. Prediction: inter-token p50 ~5 ms at 1 client (the 3.7 ms step plus host work),
   ~8-12 ms at 64; output ~4-6k tok/s at 64 clients; TTFT p50 ~0.1-0.3 s. Needs the grpcio-health-checking and
   grpcio-reflection wheels in .whl (bench/NOTES.md, How to run). Ran in session 29 (H100): ITL p50 8.2 / 10 / 31
   ms, 2,120 tok/s at 64 clients, TTFT p50 69-135 ms: every step padded to the single bucket (bench/NOTES.md)
40 call 34 cut to 1 and 16 clients (16 and 48 requests; ~4 min with the 2-bucket warm-up), for the engine loop's
   split of a step (session 29: StepTiming; serve_load's step host / wait ms) -> serve_k3_mini.json. With
   overlap a step's host work runs while the previous step is on the device, so host + wait is the loop's
   period (~8 ms at 1 client, the ITL of call 34). Prediction: host ~2-3 ms, wait ~5-6 ms: the padded 64-row
   device step sets the latency (slower in the server than call 37's 5.5 ms bench step), not the host.
   Ran in session 30 (H100): inverted, host 9.12 / wait 0.63 ms: the step's lax.conds blocked the dispatch until
   the forward finished (bench/NOTES.md); after the fix (no device branch in the step) 3.49 / 3.94, ITL p50 7 ms
41 call 40 with the step shapes sized to the load instead of the single bucket: --decode-buckets 1,16,64 (and the
   1,024-token prefill chunk: 7 compiles, ~6.5 min of warm-up at call 34's ~55 s a shape) (~8 min)
   -> serve_k3_mini_buckets.json. Prediction: at 1 client ITL ~4.5-5 ms (call 37's 3.7 ms batch-1 step plus the
   host share call 40 shows), at 16 clients ~6-8 ms
42 the issue's k3-mini decode table on an H200 with today's defaults (results/k3_mini_h200.json is session 4's,
   before the MoE grouped-matmul and MLA kernels; call 37 ran today's on an H100): batch 1 / 16 / 64 / 256,
   Pallas and XLA paths, with the profile's split by layer type (~5 min) -> k3_mini_h200.json. Prediction (call
   37's H100 figures scaled by the H200's 1.4x bandwidth where the step is memory-bound): Pallas 3.0-3.5 ms at
   batch 1, ~4 at 64, 7-8 at 256; Pallas/XLA 1.3x at 64 and 1.6-1.8x at 256. Run only on an H200
44 images on a GPU (session 31's vision tower, never run there): tests/test_media.py on the GPU (k3-tiny, the
   default kernels: image requests' greedy tokens against the whole sequence's logits), then bench/vision.py at
   K3's tower size (448 / 896 / 1344-pixel squares: 256 / 1,024 / 2,304 tokens), attention in XLA's form and
   in cuDNN's fused kernel (~4 min) -> media_gpu.txt, vision.json. Prediction: the tests pass (the image rows
   take the same path as the table's); the tower ~3-6 ms at 448 and, with XLA's O(n^2) scores, ~60-120 ms at
   1344 (9,216 patches, 16 heads); cuDNN 2-4x faster at 1344 with a bf16-level difference (~1e-2 of max |x|)
46 the step's sampling tail with and without the logit-bias rows (session 32: the bias gather runs every step):
   tests/test_sampling.py on the GPU, then bench/sampling_tail.py at K3's and k3-mini's vocabularies, 1 / 64 / 256
   rows, greedy and sampled (~2 min) -> sampling_gpu.txt, sampling_tail.json. Prediction: the bias adds one
   [rows, vocab] f32 gather and add: ~0.1-0.15 ms at 256 rows of 163,840 (168 MB read at ~3 TB/s, plus the add),
   ~0.03 at 64, launch-bound (< 0.01 ms) at 1 row; the sampled tail (a sort) 5-20x the greedy one
EOF
}

[ "${1:-}" = "list" ] || [ -z "${1:-}" ] && { calls; exit 0; }
: "${OUT:?OUT must be set (the device tool sets it)}"

SITE=$(mktemp -d)  # the carried wheels, installed outside the tree
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
K="python3 bench/kda_kernels.py"
PY_PREFIX=$(python3 -c 'import sys; print(sys.prefix)')

step() {  # step NAME CMD...: run CMD, its output in $OUT/NAME.log (the tail also on stdout)
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    # results are committed: no path of the device machine in them (the tree relative, Python's prefix named)
    sed -i -e "s#$PWD/##g" -e "s#$PY_PREFIX/#<python>/#g" "$OUT/$name.log"
    tail -n 25 "$OUT/$name.log"
    echo "== $name: rc=$rc, $((SECONDS - t0)) s"
}

gpu_tests() {  # gpu_tests NAME SECONDS PYTEST_ARGS...: pytest -m gpu under a time limit, output in NAME.txt
    local name=$1 limit=$2; shift 2
    step "$name" timeout "$limit" python3 -m pytest -m gpu -p no:cacheprovider -rfEX "$@"
    mv "$OUT/$name.log" "$OUT/$name.txt"
}

case "$1" in
46)
    step sampling_gpu timeout 240 python3 -m pytest -p no:cacheprovider -rfEX -q tests/test_sampling.py
    mv "$OUT/sampling_gpu.log" "$OUT/sampling_gpu.txt"
    step sampling_tail timeout 300 python3 bench/sampling_tail.py --out "$OUT/sampling_tail.json"
    ;;
44)
    step media_gpu timeout 240 python3 -m pytest -p no:cacheprovider -rfEX -q tests/test_media.py
    mv "$OUT/media_gpu.log" "$OUT/media_gpu.txt"
    step vision timeout 300 python3 bench/vision.py --sizes 448 896 1344 --out "$OUT/vision.json"
    ;;
1)
    # -v: each test's name as it finishes, so a run the time limit cuts still says which ones failed
    gpu_tests tests 560 -v tests/gpu -n 8
    ;;
2)
    step kda_colwarp8 $K --heads 12 96 --decode-batch 64 256 1024 --variant-batch 64 256 1024 \
        --decode-variants colwarp8 colwarp8_tiles2 colwarp8_tiles4 --profile 2 --verify --prefill \
        --breakdown none --out "$OUT/kda_colwarp8.json"
    ;;
3)
    step kda_fused $K --decode-batch --verify --prefill 1x32768x12 8x4096x12 --fused-inputs \
        --breakdown none --out "$OUT/kda_fused.json"
    step kda_verify $K --decode-batch --verify 256x12 64x12 --verify-no-auto-barriers \
        --verify-layouts colwarp8 --prefill --breakdown none --out "$OUT/kda_verify.json"
    step ablation python3 bench/kda_prep_ablation.py --variants base A_nolevels \
        --out "$OUT/ablation.json"
    ;;
4)
    step k3_mini timeout 400 python3 bench/k3_mini_h200.py --batch --prefill 4096 16384 --impl pallas \
        --mla-form blocked dense --iters 10 --profile-steps 3 --out "$OUT/k3_mini_prefill.json"
    step k3_mini_long timeout 170 python3 bench/k3_mini_h200.py --batch 64 --context 16384 --impl pallas \
        --mla-form blocked dense --iters 10 --profile-steps 3 --out "$OUT/k3_mini_long.json"
    ;;
5)
    BI="python3 bench/batch_invariance.py --seeds 2 --layers --engine"
    step bi_xla $BI --impl xla --out "$OUT/bi_xla.json"
    step bi_pallas $BI --impl pallas --out "$OUT/bi_pallas.json"
    step bi_pallas_det env XLA_FLAGS=--xla_gpu_deterministic_ops=true $BI --impl pallas --no-gemm \
        --out "$OUT/bi_pallas_det.json"
    ;;
6)
    gpu_tests tests 300 -q tests/gpu -n 8
    step bi_pallas timeout 180 python3 bench/batch_invariance.py --seeds 1 --layers --engine --no-gemm \
        --impl pallas --out "$OUT/bi_pallas.json"
    step bi_xla timeout 100 python3 bench/batch_invariance.py --seeds 1 --no-gemm --impl xla \
        --out "$OUT/bi_xla.json"
    ;;
7)
    gpu_tests tests 300 -q tests/gpu/test_engine_gpu.py -n 4
    step bi_pallas timeout 150 python3 bench/batch_invariance.py --seeds 1 --engine --no-gemm --impl pallas \
        --out "$OUT/bi_pallas.json"
    ;;
8)
    sets=("none:" "nosplitk:--xla_gpu_enable_split_k_autotuning=false" "autotune0:--xla_gpu_autotune_level=0"
          "cublas:--xla_gpu_enable_triton_gemm=false"
          "nosplitk_nodsr:--xla_gpu_enable_split_k_autotuning=false --xla_gpu_enable_dot_strength_reduction=false"
          "determ:--xla_gpu_deterministic_ops=true"
          "cublas_nodsr:--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dot_strength_reduction=false")
    for s in "${sets[@]}"; do
        name=${s%%:*} flags=${s#*:}
        step "gemm_$name" env XLA_FLAGS="$flags" timeout 90 python3 bench/batch_invariance.py --no-step \
            --out "$OUT/gemm_$name.json"
        rm -f "$OUT/gemm_$name.log"  # the tail is on stdout; at most 8 files come back
    done
    ;;
10)
    gpu_tests tests 240 -q tests/gpu/test_kda_gpu.py -n 4 -k "tiles or bitwise or auto_barriers"
    step kda_verify_tiles $K --decode-batch --verify 64x12 256x12 --verify-layouts colwarp colwarp8 \
        --verify-tiles 1 2 --prefill --breakdown none --out "$OUT/kda_verify_tiles.json"
    ;;
11)
    gpu_tests tests 300 -q tests/gpu -n 4 -k "pack_offset or varlen_chunk or snapshot_and_pool or speculative"
    step kda_aligned $K --decode-batch --verify --prefill 8x4096x12 --align-segments --breakdown none \
        --out "$OUT/kda_aligned.json"
    ;;
12)
    step k3_mini_invariant timeout 270 python3 bench/k3_mini_h200.py --batch 1 64 --impl pallas --layouts split \
        --batch-invariant 0 128 --iters 10 --out "$OUT/k3_mini_invariant.json"
    gpu_tests tests 280 -q tests/gpu/test_engine_gpu.py -n 2 -k "batch_invariant or speculative"
    ;;
13)
    gpu_tests tests 220 -q tests/gpu/test_engine_gpu.py -n 2 -k "batch_invariant"
    step k3_mini_invariant timeout 170 python3 bench/k3_mini_h200.py --batch 1 64 --impl pallas --layouts split \
        --batch-invariant 0 128 --iters 10 --out "$OUT/k3_mini_invariant.json"
    ;;
14)
    CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
    step k3_mini_invariant timeout 160 python3 bench/k3_mini_h200.py --batch 1 64 --impl pallas --layouts split \
        --batch-invariant 0 128 --expert-group 1 4 --iters 10 --out "$OUT/k3_mini_invariant.json"
    step k3_mini_cmdbuf env XLA_FLAGS="$CB" timeout 150 python3 bench/k3_mini_h200.py --batch 1 64 --impl pallas \
        --layouts split --batch-invariant 0 128 --iters 10 --out "$OUT/k3_mini_cmdbuf.json"
    XLA_FLAGS="$CB" gpu_tests tests 230 -q tests/gpu/test_engine_gpu.py -n 2 -k "batch_invariant"
    ;;
15)
    gpu_tests tests 400 -q tests/gpu/test_engine_gpu.py -n 2 -k "speculative"
    ;;
16)
    RD="--xla_gpu_experimental_use_ragged_dot_fusion=true"
    step versions sh -c "python3 -m pip list 2>/dev/null | grep -i -E 'cudnn|^jax'"  # the flag needs cuDNN >= 9.22
    gpu_tests tests 200 -q tests/gpu/test_moe_gpu.py
    XLA_FLAGS="$RD" gpu_tests tests_rd 100 -q tests/gpu/test_moe_gpu.py -k ragged
    step k3_mini_ragged0 timeout 200 python3 bench/k3_mini_h200.py --batch 1 64 256 --impl pallas --layouts split \
        --moe-impl ragged slabs pallas --iters 10 --out "$OUT/k3_mini_ragged0.json"
    step k3_mini_ragged1 env XLA_FLAGS="$RD" timeout 90 python3 bench/k3_mini_h200.py --batch 1 64 256 \
        --impl pallas --layouts split --moe-impl ragged --iters 10 --out "$OUT/k3_mini_ragged1.json"
    ;;
17)
    gpu_tests tests 330 -q tests/gpu/test_engine_gpu.py -n 4 -k "batch_invariant"
    step k3_mini_rounds timeout 200 python3 bench/k3_mini_h200.py --batch 1 64 --impl pallas --layouts split \
        --batch-invariant 0 128 --invariant-experts blocks rounds --iters 10 --out "$OUT/k3_mini_rounds.json"
    ;;
18)
    gpu_tests tests 90 -q tests/gpu/test_moe_gpu.py -k "pallas and bfloat16"
    step k3_mini_moe timeout 100 python3 bench/k3_mini_h200.py --batch 1 64 --impl pallas --layouts split \
        --moe-impl ragged pallas --iters 10 --out "$OUT/k3_mini_moe.json"
    ;;
19)
    step kda_pool12 timeout 280 $K --heads 12 --decode-batch 1 64 256 1024 --variant-batch 1 \
        --decode-variants colwarp8 --profile 2 --verify --prefill --breakdown none --out "$OUT/kda_pool12.json"
    step kda_pool96 timeout 250 $K --heads 96 --decode-batch 1 64 256 --variant-batch 1 \
        --decode-variants colwarp8 --profile 2 --verify --prefill --breakdown none --out "$OUT/kda_pool96.json"
    ;;
20)
    T=tests/gpu/test_engine_gpu.py::test_batch_invariant_mode_on_kernels  # by node id: -k kernel matches the name
    gpu_tests tests 300 -q "$T[pallas-kernel]" "$T[xla-kernel]" -n 2
    step k3_mini_kernel_mode timeout 200 python3 bench/k3_mini_h200.py --batch 1 64 --impl pallas --layouts split \
        --batch-invariant 0 128 --invariant-experts blocks kernel --iters 10 --out "$OUT/k3_mini_kernel_mode.json"
    ;;
21)
    gpu_tests tests 200 -q tests/gpu/test_moe_gpu.py -k "kernel_rows or pallas"
    step k3_mini_stages timeout 330 python3 bench/k3_mini_h200.py --batch 1 64 256 --impl pallas --layouts split \
        --moe-stages 2 3 4 6 --iters 10 --out "$OUT/k3_mini_stages.json"
    ;;
22)
    step k3_mini_decode timeout 420 python3 bench/k3_mini_h200.py --batch 1 16 64 256 --impl pallas xla \
        --layouts split --iters 10 --out "$OUT/k3_mini_decode.json"
    ;;
23)
    gpu_tests tests 240 -q tests/gpu/test_kda_gpu.py -n 2 -k "persistent or decode_in_place"
    step kda_persistent timeout 330 $K --heads 12 96 --decode-batch 64 256 1024 --variant-batch 64 256 1024 \
        --decode-variants persistent132 persistent264 persistent396 --profile 2 --verify --prefill \
        --breakdown none --out "$OUT/kda_persistent.json"
    ;;
24)
    T=tests/gpu/test_engine_gpu.py::test_batch_invariant_mode_on_kernels
    gpu_tests tests 300 -q "$T[pallas-kernel_proj]" "$T[xla-kernel_proj]" -n 2
    step k3_mini_proj_mode timeout 200 python3 bench/k3_mini_h200.py --batch 1 64 --impl pallas --layouts split \
        --batch-invariant 0 128 --invariant-proj blocks auto --iters 10 --out "$OUT/k3_mini_proj_mode.json"
    ;;
25)
    gpu_tests tests 120 -q tests/gpu/test_moe_gpu.py::test_kernel_rows_do_not_depend_on_stages_or_other_rows
    step k3_mini_proj_split timeout 400 python3 bench/k3_mini_h200.py --batch 1 64 --impl pallas --layouts split \
        --batch-invariant 0 128 --invariant-proj blocks auto --iters 10 --out "$OUT/k3_mini_proj_split.json"
    ;;
28)
    step k3_mini_copies timeout 500 python3 bench/k3_mini_h200.py --batch 1 64 --impl pallas \
        --batch-invariant 0 128 --iters 10 --hlo-out "$OUT/hlo" --out "$OUT/k3_mini_copies.json"
    tar czf "$OUT/hlo.tgz" -C "$OUT" hlo && rm -r "$OUT/hlo"
    ;;
30)
    gpu_tests tests 100 -q tests/gpu/test_mla_gpu.py
    step k3_mini_blocks_1k timeout 300 python3 bench/k3_mini_h200.py --batch 64 --context 1024 --table-tokens 16384 \
        --impl pallas --mla-form blocked dense --mla-blocks static needed --iters 10 --profile-steps 3 \
        --out "$OUT/k3_mini_blocks_1k.json"
    step k3_mini_blocks_16k timeout 200 python3 bench/k3_mini_h200.py --batch 64 --context 16384 --impl pallas \
        --mla-form blocked --mla-blocks static needed --iters 10 --profile-steps 3 --out "$OUT/k3_mini_blocks_16k.json"
    ;;
31)
    gpu_tests tests 120 -q tests/gpu/test_mla_gpu.py
    step mla_decode timeout 150 python3 bench/mla_decode.py --batch 1 64 256 --context 16384 --packed 1 0 --warpgroups 1 2 \
        --calls 5 --reps 5 --out "$OUT/mla_decode.json"
    ;;
33)
    gpu_tests tests 120 -q tests/gpu/test_mla_gpu.py
    step k3_mini_prefill_kernel timeout 280 python3 bench/k3_mini_h200.py --batch --prefill 4096 16384 --impl pallas \
        --mla-form blocked kernel_prefill --iters 3 --profile-steps 1 --out "$OUT/k3_mini_prefill_kernel.json"
    ;;
35)
    gpu_tests tests 110 -q tests/gpu/test_mla_gpu.py
    step k3_mini_prefill_kernel timeout 150 python3 bench/k3_mini_h200.py --batch --prefill 4096 --impl pallas \
        --mla-form blocked kernel_prefill --iters 3 --profile-steps 1 --out "$OUT/k3_mini_prefill_kernel.json"
    ;;
36)
    gpu_tests tests 110 -q tests/gpu/test_mla_gpu.py
    ;;
38)
    gpu_tests tests 400 -q tests/gpu/test_mla_gpu.py::test_engine_tokens_with_the_kernel --durations=3
    ;;
39)
    gpu_tests tests 100 -q tests/gpu/test_kda_gpu.py -k "dense_decode or persistent_decode"
    step kda_dense timeout 300 $K --heads 12 96 --decode-batch 1 64 --variant-batch 1 64 --decode-variants dense \
        --profile 2 --verify --prefill --breakdown none --out "$OUT/kda_dense.json"
    ;;
37)
    gpu_tests tests 270 -v tests/gpu/test_engine_gpu.py -n 4 -k "not kernel_proj and not speculative_on_kernels"
    step k3_mini_h200 timeout 300 python3 bench/k3_mini_h200.py --batch 1 16 64 256 --impl pallas xla --iters 10 \
        --profile-steps 2 --out "$OUT/k3_mini_h200.json"
    ;;
34)
    step serve_k3_mini timeout 540 python3 bench/serve_load.py --model k3-mini --platform cuda --concurrency 1 16 64 \
        --requests 16 96 256 --prompt-len 128 2048 --output-len 64 128 --prefix-len 512 --max-running 64 \
        --max-seq-len 4096 --prefill-chunk 1024 --ready-timeout 300 --server-log "$OUT/serve_k3_mini_server.log" \
        --out "$OUT/serve_k3_mini.json"
    ;;
40)
    step serve_k3_mini timeout 250 python3 bench/serve_load.py --model k3-mini --platform cuda --concurrency 1 16 \
        --requests 16 48 --prompt-len 128 2048 --output-len 64 128 --prefix-len 512 --max-running 64 \
        --max-seq-len 4096 --prefill-chunk 1024 --ready-timeout 200 --server-log "$OUT/serve_k3_mini_server.log" \
        --out "$OUT/serve_k3_mini.json"
    ;;
42)
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "call 42 wants an H200"; exit 3; }
    step k3_mini_h200 timeout 420 python3 bench/k3_mini_h200.py --batch 1 16 64 256 --impl pallas xla --iters 10 \
        --profile-steps 2 --out "$OUT/k3_mini_h200.json"
    ;;
41)
    step serve_k3_mini_buckets timeout 560 python3 bench/serve_load.py --model k3-mini --platform cuda --concurrency 1 16 \
        --requests 16 48 --prompt-len 128 2048 --output-len 64 128 --prefix-len 512 --max-running 64 \
        --max-seq-len 4096 --prefill-chunk 1024 --decode-buckets 1,16,64 --ready-timeout 480 \
        --server-log "$OUT/serve_k3_mini_buckets_server.log" --out "$OUT/serve_k3_mini_buckets.json"
    ;;
32)
    step k3_mini_mla_kernel timeout 240 python3 bench/k3_mini_h200.py --batch 1 64 --context 16384 --impl pallas \
        --mla-form kernel blocked --iters 10 --profile-steps 3 --out "$OUT/k3_mini_mla_kernel.json"
    ;;
26|27)
    T=tests/gpu/test_engine_gpu.py::test_batch_invariant_mode_on_kernels
    case "$1" in 26) P=pallas ;; *) P=xla ;; esac
    gpu_tests tests 560 -q "$T[$P-kernel_proj]" --durations=5
    ;;
*)
    echo "unknown call '$1'"; calls; exit 2
    ;;
esac
