#!/usr/bin/env bash
# One device call (about three minutes on an H100 or H200) for a change to the sm_90a backward,
# applied and generated: the sm_90a backward's suite at 200 examples (every one of its 53
# kernels is renamed; FLASHGEN_SPECS builds only the files that hold them), memcheck on the
# deterministic kernels, the deterministic backward beside its twins and the repeat control.
# Records and logs in $OUT/verify.tgz, the JSONs beside it.
set -u
S=$(date +%s); el() { echo "[$(($(date +%s) - S))s] $*"; }
mkdir -p "$OUT/rec"
export FLASHGEN_RECORDS_DIR=$OUT/rec OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1
F="specs/bwd_det.yaml specs/bwd_sm90a.yaml specs/scoremod.yaml specs/shapes.yaml specs/usermod.yaml"
flashgen compile $F specs/fwd_sm90a.yaml -j 16 > "$OUT/compile.txt" 2>&1; el "compile rc=$?"
for i in $(seq 0 11); do
  FLASHGEN_SPECS=${F// /:} FLASHGEN_SHARD=$i/12 FLASHGEN_GPU_EXAMPLES=200 timeout 150 \
    python3 -m pytest -q tests/gpu/test_backward.py -k "sm90a or many_key_tiles" \
    -p no:cacheprovider > "$OUT/suite_$i.txt" 2>&1 &
done
FLASHGEN_SANITIZE_ONLY=backward:sm_90a FLASHGEN_SANITIZE_MATCH=_det_ timeout 150 \
  compute-sanitizer --tool memcheck python3 -m flashgen.bench.sanitize run 0/1 \
  > "$OUT/memcheck_0.txt" 2>&1 &
wait; el suite; tail -qn1 "$OUT"/suite_*.txt; grep -h SUMMARY "$OUT"/memcheck_0.txt
python3 -m flashgen.bench.sanitize merge "$OUT"/memcheck_0.txt > "$OUT/sanitize.txt" 2>&1
echo "records: $(ls "$OUT/rec" | wc -l)"
(cd "$OUT" && tar -czf verify.tgz rec ./*.txt && rm -rf rec ./*.txt)
timeout 60 python3 -m flashgen.bench.bwd_bench --specs specs/bwd_det.yaml specs/bwd_sm90a.yaml \
  --deterministic --target sm_90a --backends FLASH CUDNN --seqlens 4096 16384 --out "$OUT/bwd_det_sm90a.json" > "$OUT/det.txt" 2>&1
el "det rc=$?"; grep vs_twin "$OUT/det.txt"
timeout 40 python3 -m flashgen.bench.det_repeat --out "$OUT/det_repeat.json" > "$OUT/rep.txt" 2>&1
el "repeat rc=$?"; cut -c1-70,150-260 "$OUT/rep.txt"
