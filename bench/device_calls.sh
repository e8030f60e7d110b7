#!/usr/bin/env bash
# The pending H200 measurements for issue 6 [pallas-kda], as numbered device calls (bench/NOTES.md,
# sessions 12 and 13, say what each one decides). Run one call per `device` run, from the repo root,
# with carry [".whl"] (fla-core 0.6.0, pytest-xdist, execnet wheels: bench/NOTES.md, "How to run"):
#
#     bash bench/device_calls.sh 1     # then 2, 3, 4; each < 10 minutes
#     bash bench/device_calls.sh list  # what each call runs
#
# Everything goes under $OUT (tests.txt, the bench JSON, a log per step), at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/.."

calls() {
    cat <<'EOF'
1  tests/gpu in full (~5 min; new: fused gate / L2 norm, colwarp8 cases), then batch-1 decode with the
   one-barrier vt-32 forms and colwarp8 (kernel times from a profile), ~2 min -> tests.txt, kda_b1.json
2  decode at batch 64, 256, 1024 x 12 and 96 heads: the default against colwarp8 at 1, 2, 4 tiles a CTA
   (~5 min) -> kda_colwarp8.json
3  prefill rows with the gate and the L2 norm fused (ours fused, six levels, XLA first; fla fused) at
   1 x 32k x 12 and 8 x 4k x 12, then verify + fold without barriers and in colwarp8 at 256 x 12 and
   64 x 12, then the prep kernel alone with levels 0-4 merged and with no levels (~6 min)
   -> kda_fused.json, kda_verify.json, ablation.json
4  k3-mini prefill 4k and 16k (pallas without and with the fused inputs, xla) and decode at batch 1,
   with the profile's kda_proj/qk_norm and kda_proj/gate scopes (~6 min) -> k3_mini_prefill.json
5  batch invariance (session 14): bench/batch_invariance.py --layers --engine on the XLA and the Pallas
   path (the first layer whose output row moves between decode, mixed and verify steps; the engine's
   speculative tokens against plain, overlap on and off), the Pallas path again with
   --xla_gpu_deterministic_ops (~7 min) -> bi_xla.json, bi_pallas.json, bi_pallas_det.json
6  tests/gpu in full, then call 5's Pallas-path check with one seed and no GEMM table (the layers, the
   engine: plain twice, speculative with and without overlap) (~8 min) -> tests.txt, bi_pallas.json
EOF
}

[ "${1:-}" = "list" ] || [ -z "${1:-}" ] && { calls; exit 0; }
: "${OUT:?OUT must be set (the device tool sets it)}"

SITE=$(mktemp -d)  # the carried wheels, installed outside the tree
python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
K="python3 bench/kda_kernels.py"

step() {  # step NAME CMD...: run CMD, its output in $OUT/NAME.log (the tail also on stdout)
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: rc=$rc, $((SECONDS - t0)) s"
}

case "$1" in
1)
    step tests python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -n 8 -rfE
    cp "$OUT/tests.log" "$OUT/tests.txt" && rm "$OUT/tests.log"
    step kda_b1 $K --heads 12 96 --decode-batch 1 --variant-batch 1 --decode-variants vt32_one_barrier \
        vt32_tiles2_one_barrier colwarp8 colwarp8_ro --profile 2 --verify --prefill --breakdown none \
        --out "$OUT/kda_b1.json"
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
    step ablation python3 bench/kda_prep_ablation.py --variants base merged5 A_nolevels \
        --out "$OUT/ablation.json"
    ;;
4)
    step k3_mini python3 bench/k3_mini_h200.py --batch 1 --prefill 4096 16384 --impl pallas xla \
        --fused-inputs --out "$OUT/k3_mini_prefill.json"
    ;;
5)
    BI="python3 bench/batch_invariance.py --seeds 2 --layers --engine"
    step bi_xla $BI --impl xla --out "$OUT/bi_xla.json"
    step bi_pallas $BI --impl pallas --out "$OUT/bi_pallas.json"
    step bi_pallas_det env XLA_FLAGS=--xla_gpu_deterministic_ops=true $BI --impl pallas --no-gemm \
        --out "$OUT/bi_pallas_det.json"
    ;;
6)
    step tests timeout 360 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -n 8 -rfEX
    cp "$OUT/tests.log" "$OUT/tests.txt" && rm "$OUT/tests.log"
    step bi_pallas timeout 200 python3 bench/batch_invariance.py --seeds 1 --layers --engine --no-gemm \
        --impl pallas --out "$OUT/bi_pallas.json"
    ;;
*)
    echo "unknown call '$1'"; calls; exit 2
    ;;
esac
