#!/usr/bin/env bash
# Verification of softcap-bwd-128-rows.patch, one device call (about two minutes): the one
# kernel it renames (fa_bwd_d64_bf16_cap_m128n128w8s2_sm90a, softcap without a mask or varlen
# at d 64 on the sm_90a backward, 128 query rows a step instead of 64) through the backward
# suite at 200 examples and the three sanitizers, and scoremod_bench with the 64-row build
# (an explicit-tile spec written here) beside it, both against the plain twin in one run.
# Run from the repository root with the patch applied and generated; records, logs and the
# bench JSON go into $OUT/verify.tgz (default OUT: bench/results/session). Needs PyCUDA
# importable (PYTHONPATH) and flashgen installed.
source "$(dirname "$0")/prologue.sh"
cat > "$OUT/softcap_rows.yaml" <<'YAML'
kernels:
  - kernel: backward
    target: sm_90a
    dtype: bf16
    head_dim: 64
    softcap: true
    tile: {block_m: 64, block_n: 128, warps: 8, stages: 2}
YAML
# the renamed kernel and its plain twin only (the same specs as specs/: the same names)
cat > "$OUT/softcap_pair.yaml" <<'YAML'
defaults: {kernel: backward, target: sm_90a, dtype: bf16, head_dim: 64}
kernels:
  - softcap: [true, false]
YAML
flashgen compile "$OUT/softcap_pair.yaml" -j "$(nproc)" > "$OUT/compile.txt" 2>&1
flashgen compile "$OUT/softcap_rows.yaml" -j "$(nproc)" >> "$OUT/compile.txt" 2>&1
el "compile: $(tail -1 "$OUT/compile.txt")"
for i in 0 1; do
  FLASHGEN_RECORDS_DIR=$OUT/rec FLASHGEN_SPECS=specs/scoremod.yaml FLASHGEN_SHARD=$i/2 \
    FLASHGEN_GPU_EXAMPLES=200 timeout 300 python3 -m pytest -q tests/gpu/test_backward.py \
    -k "fa_bwd_d64_bf16_cap_m128" -p no:cacheprovider > "$OUT/suite_$i.txt" 2>&1 &
done
wait
el "suite: $(tail -qn1 "$OUT"/suite_*.txt | tr '\n' ' ')"
for tool in memcheck racecheck synccheck; do
  FLASHGEN_RECORDS_DIR=$OUT/rec FLASHGEN_SANITIZE_ONLY=backward:sm_90a \
    FLASHGEN_SANITIZE_MATCH=fa_bwd_d64_bf16_cap_m128 timeout 200 compute-sanitizer --tool $tool \
    python3 -m flashgen.bench.sanitize run 0/1 > "$OUT/${tool}.txt" 2>&1 &
done
wait
FLASHGEN_RECORDS_DIR=$OUT/rec python3 -m flashgen.bench.sanitize merge "$OUT"/*check.txt \
  > "$OUT/sanitize.txt" 2>&1
el "sanitizers: $(grep -h SUMMARY "$OUT"/*check.txt | tr '\n' ' ')"
python3 -m flashgen.bench.scoremod_bench --check --specs specs/scoremod.yaml \
  "$OUT/softcap_rows.yaml" --match "fa_bwd_d64_bf16_cap_m" \
  --out "$OUT/scoremod_softcap_rows.json" > "$OUT/bench.txt" 2>&1
el "bench: $(tail -1 "$OUT/bench.txt")"
(cd "$OUT" && tar -czf verify.tgz rec ./*.txt ./*.json ./*.yaml && rm -rf rec ./*.txt ./*.json)
el done
