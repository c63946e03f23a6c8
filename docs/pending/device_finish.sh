#!/usr/bin/env bash
# One device call (about five minutes on an H200) that finishes the pending work, with
# sm90a-forward-skip-zero-columns.patch and sm90a-backward-alibi-rows.patch applied and
# generated: the records the fifteenth session did not make (tests/gpu/test_extras.py on the
# sm_90a forward: its 12 dropout and block-sparse kernels; the suite and the sanitizers on the
# causal ALiBi backward that takes 128 rows again), and the ALiBi rows of scoremod_bench with
# the 128-row kernel without causal (alibi128.yaml, allow_spills) beside the 64-row one.
# Records under $OUT/rec (backward) and $OUT/rec_x (extras), logs in $OUT/verify.tgz, the bench JSON beside it.
set -u
S=$(date +%s); el() { echo "[$(($(date +%s) - S))s] $*"; }
mkdir -p "$OUT/rec" "$OUT/rec_x"
export FLASHGEN_RECORDS_DIR=$OUT/rec OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1
flashgen compile specs/fwd_sm90a.yaml specs/scoremod.yaml specs/shapes.yaml specs/bwd_sm90a.yaml \
  specs/bwd_det.yaml docs/pending/alibi128.yaml -j 16 > "$OUT/compile.txt" 2>&1; el "compile rc=$?"; tail -2 "$OUT/compile.txt"
for i in 0 1; do
  FLASHGEN_SPECS=specs/scoremod.yaml FLASHGEN_SHARD=$i/2 FLASHGEN_GPU_EXAMPLES=200 timeout 170 python3 -m pytest -q \
    tests/gpu/test_backward.py -k "sm90a and alibi" -p no:cacheprovider > "$OUT/suite_$i.txt" 2>&1 &
done
for i in 0 1 2 3 4 5; do
  FLASHGEN_SPECS=specs/fwd_sm90a.yaml:specs/scoremod.yaml:specs/shapes.yaml FLASHGEN_RECORDS_DIR=$OUT/rec_x \
    FLASHGEN_SHARD=$i/6 FLASHGEN_GPU_EXAMPLES=200 timeout 170 python3 -m pytest -q \
    tests/gpu/test_extras.py -k sm90a -p no:cacheprovider > "$OUT/extras_$i.txt" 2>&1 &
done
for tool in memcheck racecheck synccheck; do
  FLASHGEN_SANITIZE_FEATURES=1 FLASHGEN_SANITIZE_ONLY=backward:sm_90a timeout 160 compute-sanitizer --tool $tool \
    python3 -m flashgen.bench.sanitize run 0/1 > "$OUT/${tool}_0.txt" 2>&1 &
done
wait; el suite+sanitize; tail -qn1 "$OUT"/suite_*.txt "$OUT"/extras_*.txt
grep -h "SUMMARY" "$OUT"/*check_0.txt | sort | uniq -c; grep -c "^ran" "$OUT"/*check_0.txt
python3 -m flashgen.bench.sanitize merge "$OUT"/*check_0.txt > "$OUT/sanitize.txt" 2>&1
(cd "$OUT" && tar -czf verify.tgz rec rec_x *.txt && rm -rf rec rec_x *.txt)
timeout ${BENCH_S:-90} python3 -m flashgen.bench.scoremod_bench --specs specs/scoremod.yaml docs/pending/alibi128.yaml \
  --match "fa_bwd.*alibi" --seqlens ${SEQLENS:-4096 8192} --out "$OUT/scoremod_alibi.json" > "$OUT/scoremod.txt" 2>&1
el "scoremod rc=$?"; grep "TFLOP" "$OUT/scoremod.txt" | tail -12
ls "$OUT"
