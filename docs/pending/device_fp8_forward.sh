#!/usr/bin/env bash
# Verification of fp8-forward.patch, one device call: it adds descale fields to fg_fwd_params
# (params.h) and FP8 paths to the sm_90a forward's headers, so every forward kernel is renamed
# (their PTX is unchanged apart from the parameter size: docs/benchmarks.md, "The FP8 forward").
# Builds every kernel; the forward GPU suites (16-bit and FP8) at 200 examples in 12
# processes, with the forward extras (dropout, block sparsity, IO); flashgen.torch's GPU
# tests; the three sanitizers on the forward families; then the FP8 bench. Run from the
# repository root with the patch applied and generated; records, logs and the bench JSON go
# into $OUT/verify.tgz (default OUT: bench/results/session). Needs PyCUDA importable
# (PYTHONPATH) and flashgen installed. STAGES as device_verify.sh ("suite sanitize bench").
source "$(dirname "$0")/prologue.sh"
STAGES=${STAGES:-suite sanitize bench}
export FLASHGEN_RECORDS_DIR=$OUT/rec
[[ " $STAGES " == *" suite "* ]] || cp verify/records/*.json "$OUT/rec/"
flashgen compile specs/ -j "$(nproc)" > "$OUT/compile.txt" 2>&1
flashgen compile examples/torch_kernels.yaml -j "$(nproc)" >> "$OUT/compile.txt" 2>&1
el "compile rc=$?"; tail -2 "$OUT/compile.txt"
if [[ " $STAGES " == *" suite "* ]]; then
  for i in $(seq 0 11); do
    FLASHGEN_SHARD=$i/12 FLASHGEN_GPU_EXAMPLES=200 timeout 330 python3 -m pytest -q \
      tests/gpu/test_forward.py tests/gpu/test_forward_fp8.py tests/gpu/test_extras.py \
      -p no:cacheprovider > "$OUT/suite_$i.txt" 2>&1 &
  done
  wait
  el "suite: $(tail -qn1 "$OUT"/suite_*.txt | tr '\n' ' ')"
  grep -h -E "^(FAILED|ERROR)" "$OUT"/suite_*.txt | cut -c1-300 | head
  echo "records: $(ls "$OUT/rec" | wc -l)"
fi
if [[ " $STAGES " == *" sanitize "* ]]; then
  timeout 200 python3 -m pytest -q tests/gpu/test_torch.py -p no:cacheprovider > "$OUT/torch.txt" 2>&1 &
  for tool in memcheck racecheck synccheck; do
    for i in 0 1; do
      FLASHGEN_SANITIZE_ONLY=forward timeout 220 compute-sanitizer --tool $tool \
        python3 -m flashgen.bench.sanitize run $i/2 > "$OUT/${tool}_$i.txt" 2>&1 &
    done
  done
  wait
  el "sanitizers and torch: $(tail -1 "$OUT/torch.txt")"
  python3 -m flashgen.bench.sanitize merge "$OUT"/*check_*.txt > "$OUT/sanitize.txt" 2>&1
  grep -h "SUMMARY" "$OUT"/*check_*.txt | sort | uniq -c
fi
if [[ " $STAGES " == *" bench "* ]]; then
  python3 -m flashgen.bench.fp8_fwd_bench --out "$OUT/fp8_fwd.json" 2>&1 | tail -12
fi
(cd "$OUT" && tar -czf verify.tgz rec ./*.txt ./*.json 2>/dev/null && rm -rf rec ./*.txt)
el done
