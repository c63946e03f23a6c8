#!/usr/bin/env bash
# Patch 3's benchmarks (sm90a-forward-skip-zero-columns), one device call (about five
# minutes on an H200): the sm_90a forward against the shipped kernels ($BASELINE: main's
# generated/ before the patches) at the head dims it changes and at two it must not, and
# shapes_bench's d 72 / d 200 rows against their next multiple of 64 and SDPA. JSONs and
# logs under $OUT (default bench/results/session). Run from the repository root.
set -u
OUT=${OUT:-bench/results/session}
BASELINE=${BASELINE:-old/generated}
S=$(date +%s)
el() { echo "[$(($(date +%s) - S))s] $*"; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
flashgen compile specs/fwd_sm90a.yaml specs/shapes.yaml specs/bwd_sm90a.yaml \
  specs/fwd_dense.yaml specs/bwd_dense.yaml -j "$(nproc)" > "$OUT/compile_fwd.txt" 2>&1
el "compile rc=$?"
timeout 240 python3 -m flashgen.bench.ab_bench --specs specs/fwd_sm90a.yaml specs/shapes.yaml \
  --head-dims 40 72 96 64 128 --seqlens 4096 16384 --repeats 2 --baseline "$BASELINE" \
  --out "$OUT/ab_fwd_zero_columns_h200.json" > "$OUT/ab_fwd.txt" 2>&1
el "ab rc=$?"; tail -30 "$OUT/ab_fwd.txt"
timeout 300 python3 -m flashgen.bench.shapes_bench --specs specs/shapes.yaml specs/fwd_sm90a.yaml \
  specs/bwd_sm90a.yaml specs/fwd_dense.yaml specs/bwd_dense.yaml --seqlens 4096 8192 \
  --out "$OUT/shapes_h200.json" > "$OUT/shapes.txt" 2>&1
el "shapes rc=$?"; tail -30 "$OUT/shapes.txt"
el done
