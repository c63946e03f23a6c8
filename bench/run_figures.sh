#!/usr/bin/env bash
# Regenerates the extras' benchmark JSON and figures on a GPU host (see bench/extras_bench.py).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${FIGURES_OUT:-bench/results}
python3 -m flashgen.bench.extras_bench blocksize --out "$out/blocksize_h200.json"
python3 -m flashgen.bench.extras_bench sparse --check --out "$out/sparse_h200.json"
ncu --clock-control none --csv --metrics dram__bytes_read.sum,dram__bytes_write.sum \
    python3 -m flashgen.bench.extras_bench gpt2 --out "$out/gpt2_model.json" > "$out/ncu_gpt2.csv"
python3 bench/ncu_io.py "$out/ncu_gpt2.csv" "$out/gpt2_model.json" "$out/hbm_gpt2_h200.json"
python3 bench/figures.py "$out" "${FIGURES_DOCS:-docs}"
