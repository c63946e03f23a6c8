#!/usr/bin/env bash
# The pending patches' verification, one device call (3 minutes for the suite with the
# build, 5 more for the sanitizers, on an H200 with 16 CPU cores): build every kernel, the
# sm_90a backward's and forward's GPU suites at 200 examples (the extras' dropout,
# block-sparse and IO tests too) in 12 processes, flashgen.torch's GPU tests, the three
# sanitizers on the sm_90a backward and forward families, merged into the records. Run from
# the repository root with the patches applied and generated; records and logs go into
# $OUT/verify.tgz (default OUT: bench/results/session): copy its rec/*.json to
# verify/records/ afterwards. Needs PyCUDA importable (PYTHONPATH) and flashgen installed.
# STAGES (default "suite sanitize") picks the halves: under the 600 s a device call allows,
# run `STAGES=suite` and then `STAGES=sanitize` as two calls (the build is cached between
# them on a machine kept warm; each call builds what is missing). Copy the first call's
# records into verify/records/ before the second: the sanitizers' verdicts are merged into
# copies of them under $OUT/rec. Another patch's call picks its own suites and sanitizer
# families: SUITE_TESTS (test files), SUITE_K (a -k expression, empty for none),
# SANITIZE_KINDS (forward and/or backward) and SANITIZE_TARGET (":sm_90a", empty for every
# target).
set -u
STAGES=${STAGES:-suite sanitize}
SUITE_TESTS=${SUITE_TESTS:-tests/gpu/test_backward.py tests/gpu/test_forward.py tests/gpu/test_extras.py}
SUITE_K=${SUITE_K-sm90a or many_key_tiles}
SANITIZE_KINDS=${SANITIZE_KINDS:-backward forward}
SANITIZE_TARGET=${SANITIZE_TARGET-:sm_90a}
OUT=${OUT:-bench/results/session}
S=$(date +%s)
el() { echo "[$(($(date +%s) - S))s] $*"; }
mkdir -p "$OUT/rec"
[[ " $STAGES " == *" suite "* ]] || cp verify/records/*.json "$OUT/rec/"
export FLASHGEN_RECORDS_DIR=$OUT/rec OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONUNBUFFERED=1
# two commands: examples/torch_kernels.yaml repeats some of specs/, and one compile rejects duplicates
flashgen compile specs/ -j "$(nproc)" > "$OUT/compile.txt" 2>&1
flashgen compile examples/torch_kernels.yaml -j "$(nproc)" >> "$OUT/compile.txt" 2>&1
el "compile rc=$?"; tail -2 "$OUT/compile.txt"
if [[ " $STAGES " == *" suite "* ]]; then
for i in $(seq 0 11); do
  # shellcheck disable=SC2086  # SUITE_TESTS: a list of files
  FLASHGEN_SHARD=$i/12 FLASHGEN_GPU_EXAMPLES=200 timeout 330 python3 -m pytest -q \
    $SUITE_TESTS ${SUITE_K:+-k "$SUITE_K"} \
    -p no:cacheprovider \
    > "$OUT/suite_$i.txt" 2>&1 &
done
wait
el suite; for i in $(seq 0 11); do tail -1 "$OUT/suite_$i.txt"; done
echo "records: $(ls "$OUT/rec" | wc -l)"
fi
# a device call returns at most 8 files: records and logs leave as one tarball
pack() { (cd "$OUT" && tar -czf verify.tgz rec ./*.txt && rm -rf rec ./*.txt); }
[[ " $STAGES " == *" sanitize "* ]] || { pack; el done; exit 0; }
(timeout 200 python3 -m pytest -q tests/gpu/test_torch.py -p no:cacheprovider
 timeout 120 python3 -m pytest -q tests/gpu/test_torch_kvcache.py -k fp8 -p no:cacheprovider
) > "$OUT/torch.txt" 2>&1 &
for kind in $SANITIZE_KINDS; do
  for tool in memcheck racecheck synccheck; do
    for i in 0 1; do
      FLASHGEN_SANITIZE_ONLY=$kind$SANITIZE_TARGET timeout 220 compute-sanitizer --tool $tool \
        python3 -m flashgen.bench.sanitize run $i/2 > "$OUT/${tool}_${kind}_$i.txt" 2>&1 &
    done
  done
done
wait
el "sanitizers and torch"; grep -E "passed|failed|error" "$OUT/torch.txt"
python3 -m flashgen.bench.sanitize merge "$OUT"/memcheck_*.txt "$OUT"/racecheck_*.txt \
  "$OUT"/synccheck_*.txt > "$OUT/sanitize.txt" 2>&1
grep -h "SUMMARY" "$OUT"/*check_*.txt | sort | uniq -c
pack; el done
