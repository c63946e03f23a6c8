#!/usr/bin/env bash
# One GPU session's verification and benchmarks, split over two GPUs when there are two
# (the kernel libraries must be built first: `flashgen compile specs/` and, for the sm_80 PTX
# run, `flashgen compile specs/ --arch sm_80`). Writes records to $FLASHGEN_RECORDS_DIR
# (default: verify/records) and results/logs to ${RESULTS:-bench/results/session}.
#   1. forward suite, 200 Hypothesis examples per shipped spec (GPU 0)
#   2. backward suite, 200 examples per shipped spec (GPU 1, or after 1)
#   3. the sm_80 builds run as compute_80 PTX on this GPU (a few examples each)
#   4. compute-sanitizer memcheck and racecheck over one kernel per family
#   5. forward and backward benchmarks side by side with SDPA's backends, and (with
#      BASELINE=<an earlier version's generated/ folder>) this forward against that one
set -u
out=${RESULTS:-bench/results/session}
mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l)
examples=${FLASHGEN_GPU_EXAMPLES:-200}
fwd() {
  FLASHGEN_GPU_EXAMPLES=$examples python3 -m pytest -q tests/gpu -p no:cacheprovider \
    --ignore=tests/gpu/test_backward.py > "$out/fwd_suite.txt" 2>&1
  FLASHGEN_TARGET=sm_80 FLASHGEN_GPU_EXAMPLES=3 python3 -m pytest -q tests/gpu/test_forward.py \
    tests/gpu/test_backward.py -p no:cacheprovider -k "not repeat" > "$out/sm80.txt" 2>&1
  python3 -m flashgen.bench.fwd_bench --specs specs/fwd_dense.yaml --flex-min-seqlen 4096 \
    --check --out "$out/fwd_h200.json" > "$out/bench_fwd.txt" 2>&1
  if [ -n "${BASELINE:-}" ]; then
    python3 -m flashgen.bench.ab_bench --baseline "$BASELINE" --out "$out/fwd_ab.json" \
      > "$out/bench_ab.txt" 2>&1
  fi
}
bwd() {
  FLASHGEN_GPU_EXAMPLES=$examples python3 -m pytest -q tests/gpu/test_backward.py \
    -p no:cacheprovider > "$out/bwd_suite.txt" 2>&1
  python3 -m flashgen.bench.bwd_bench --specs specs/bwd_dense.yaml --fwd-specs \
    specs/fwd_dense.yaml --seqlens 4096 8192 16384 --check --out "$out/bwd_h200.json" \
    > "$out/bench_bwd.txt" 2>&1
  python3 -m flashgen.bench.bwd_bench --specs specs/bwd_det.yaml --deterministic \
    --seqlens 4096 16384 --out "$out/bwd_det_h200.json" >> "$out/bench_bwd.txt" 2>&1
}
if [ "$ngpu" -ge 2 ]; then
  (CUDA_VISIBLE_DEVICES=0 fwd) & (CUDA_VISIBLE_DEVICES=1 bwd) & wait
else
  fwd; bwd
fi
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool python3 -m flashgen.bench.sanitize run > "$out/$tool.txt" 2>&1
done
python3 -m flashgen.bench.sanitize merge "$out/memcheck.txt" "$out/racecheck.txt"
tail -n 3 "$out"/*_suite.txt "$out/sm80.txt"
