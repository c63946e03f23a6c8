#!/usr/bin/env bash
# The pending patches' benchmarks, one device call (under ten minutes on an H200): the A/B
# against the shipped kernels ($BASELINE: the generated/ folder of main before the patches,
# `git archive HEAD generated | tar -x -C old`), the deterministic backward beside its twins
# and its repeat control, and the sm_90a backward against SDPA's backends. JSONs and logs go
# under $OUT (default bench/results/session). Run from the repository root, patches applied.
set -u
OUT=${OUT:-bench/results/session}
BASELINE=${BASELINE:-old/generated}
S=$(date +%s)
el() { echo "[$(($(date +%s) - S))s] $*"; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
flashgen compile specs/bwd_det.yaml specs/bwd_sm90a.yaml specs/bwd_dense.yaml \
  specs/fwd_sm90a.yaml -j "$(nproc)" > "$OUT/compile.txt" 2>&1
el "compile rc=$?"
timeout 200 python3 -m flashgen.bench.ab_bench --backward --specs specs/fwd_sm90a.yaml \
  specs/bwd_sm90a.yaml --head-dims 64 128 --seqlens 1024 4096 16384 --repeats 2 \
  --baseline "$BASELINE" --out "$OUT/ab_bwd_ring_h200.json" > "$OUT/ab.txt" 2>&1
el "ab rc=$?"; tail -30 "$OUT/ab.txt"
timeout 90 python3 -m flashgen.bench.det_repeat --out "$OUT/det_repeat_h200.json" \
  > "$OUT/det_repeat.txt" 2>&1
el "det_repeat rc=$?"; tail -15 "$OUT/det_repeat.txt"
timeout 150 python3 -m flashgen.bench.bwd_bench --specs specs/bwd_det.yaml \
  specs/bwd_sm90a.yaml specs/bwd_dense.yaml --deterministic --seqlens 1024 4096 16384 \
  --out "$OUT/bwd_det_h200.json" > "$OUT/det.txt" 2>&1
el "det rc=$?"; tail -25 "$OUT/det.txt"
timeout 150 python3 -m flashgen.bench.bwd_bench --specs specs/bwd_sm90a.yaml \
  --fwd-specs specs/fwd_sm90a.yaml --seqlens 4096 8192 16384 --check \
  --out "$OUT/bwd_h200.json" > "$OUT/bwd.txt" 2>&1
el "bwd rc=$?"; tail -16 "$OUT/bwd.txt"
el done
