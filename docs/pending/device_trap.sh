#!/usr/bin/env bash
# The two pending patches' verification, one short device call (about 5 minutes on 16 CPU
# cores): build every decode kernel, the varlen score_mod sm_90a backwards and the varlen
# variant kernels; the decode suite (every decode kernel: decode_trap.patch renames them all)
# and those backwards' suite at 200 examples; the kvcache trap/check tests and the varlen
# variant tests of flashgen.torch. Run from the repository root with both patches applied and
# `flashgen generate specs/` run; records and logs go into $OUT/verify.tgz (default OUT:
# bench/results/session): copy its rec/*.json to verify/records/ afterwards. Needs PyCUDA
# importable (PYTHONPATH) and flashgen installed. flash-attn's own
# test_flash_attn_kvcache_paged_block_table_bounds is the held-out check of the trap (docs/torch.md).
set -u
OUT=${OUT:-bench/results/session}
S=$(date +%s)
el() { echo "[$(($(date +%s) - S))s] $*"; }
mkdir -p "$OUT/rec"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONUNBUFFERED=1
python3 - > "$OUT/compile.txt" 2>&1 <<'PY'
from flashgen.generator.compile import compile_specs
from flashgen.generator.load import load_paths
from flashgen.generator.naming import kernel_name

want = lambda n: n.startswith("fa_dec_") or ("_varlen_um" in n and "sm90a" in n)
specs = [s for s in load_paths(["specs"]) if want(kernel_name(s))]
specs += [s for s in load_paths(["examples/variant_kernels.yaml"]) if "varlen" in kernel_name(s)]
res = compile_specs(list(dict.fromkeys(specs)), progress=False)
print(len(res), "kernels,", sum(not r.ok for r in res), "failed")
PY
el "compile rc=$?"; tail -1 "$OUT/compile.txt"
DS=specs/decode.yaml:specs/decode_fp8.yaml:specs/scoremod.yaml:specs/shapes.yaml:specs/usermod.yaml
for i in $(seq 0 9); do
  FLASHGEN_RECORDS_DIR=$OUT/rec FLASHGEN_SPECS=$DS FLASHGEN_SHARD=$i/10 FLASHGEN_GPU_EXAMPLES=200 \
    timeout 200 python3 -m pytest -q tests/gpu/test_decode.py -p no:cacheprovider \
    > "$OUT/suite_d_$i.txt" 2>&1 &
done
for i in 0 1; do
  FLASHGEN_RECORDS_DIR=$OUT/rec FLASHGEN_SPECS=specs/usermod.yaml FLASHGEN_SHARD=$i/2 \
    FLASHGEN_GPU_EXAMPLES=200 timeout 200 python3 -m pytest -q tests/gpu/test_backward.py \
    -k "varlen and sm90a" -p no:cacheprovider > "$OUT/suite_b_$i.txt" 2>&1 &
done
FLASHGEN_RECORDS_DIR=/tmp/flashgen_rec_torch timeout 200 python3 -m pytest -q \
  tests/gpu/test_torch_kvcache.py -p no:cacheprovider \
  -k "device_side_assert or do_not_trap or check_inputs or cuda_graph" > "$OUT/torch_kv.txt" 2>&1 &
FLASHGEN_RECORDS_DIR=/tmp/flashgen_rec_torch timeout 200 python3 -m pytest -q \
  tests/gpu/test_torch_variant.py -k varlen -p no:cacheprovider > "$OUT/torch_var.txt" 2>&1 &
wait
el tests
for f in "$OUT"/suite_*.txt "$OUT"/torch_*.txt; do echo "$(basename "$f"): $(tail -n1 "$f")"; done
grep -h -E "^(FAILED|ERROR)" "$OUT"/suite_*.txt "$OUT"/torch_*.txt | cut -c1-300 | head -20
echo "records: $(ls "$OUT/rec" | wc -l)"
(cd "$OUT" && tar -czf verify.tgz rec ./*.txt && rm -rf rec ./*.txt)
el done
