#!/usr/bin/env bash
# Verification of decode-launch-splits-once.patch, one device call: build the 45 decode
# kernels, the decode suite at 200 examples, flashgen.torch's kvcache trap/check/graph tests,
# then the host-cost A/B (`torch_overhead --cases kvcache`, the patch against the tree before
# it, in turn). Run from the repository root with the patch applied and generated; records
# and logs go into $OUT/verify.tgz (default OUT: bench/results/session). Needs PyCUDA
# importable (PYTHONPATH) and flashgen installed. The eighteenth session's attempt gave the
# suite 130 s per shard and it did not finish: give it 300.
source "$(dirname "$0")/prologue.sh"
python3 - > "$OUT/compile.txt" 2>&1 <<'PY'
from flashgen.generator.compile import compile_specs
from flashgen.generator.load import load_paths
from flashgen.generator.naming import kernel_name
specs = [s for s in load_paths(["specs"]) if kernel_name(s).startswith("fa_dec_")]
res = compile_specs(specs, jobs=16, progress=False)
print(len(specs), "decode kernels; not ok:", sum(1 for r in res if not getattr(r, "ok", True)))
PY
el "compile: $(tail -1 "$OUT/compile.txt")"
for i in $(seq 0 13); do
  FLASHGEN_RECORDS_DIR=$OUT/rec FLASHGEN_SHARD=$i/14 FLASHGEN_GPU_EXAMPLES=200 timeout 300 \
    python3 -m pytest -q tests/gpu/test_decode.py -p no:cacheprovider > "$OUT/suite_d_$i.txt" 2>&1 &
done
wait
el "decode suite: records $(ls "$OUT/rec" | wc -l) of 45"
grep -h -E "^(FAILED|ERROR)" "$OUT"/suite_d_*.txt | cut -c1-300 | head
timeout 120 python3 -m pytest -q tests/gpu/test_torch_kvcache.py -p no:cacheprovider \
  -k "trap or check_inputs or graph" > "$OUT/torch_kv.txt" 2>&1
el "torch kvcache: $(tail -1 "$OUT/torch_kv.txt")"
# the A/B: this tree, then the tree before the patch (reverted in place), then this tree again
python3 -m flashgen.bench.torch_overhead --cases kvcache --out "$OUT/overhead_new.json" > /dev/null 2>&1
patch -s -R -p1 < docs/pending/decode-launch-splits-once.patch
python3 -m flashgen.bench.torch_overhead --cases kvcache --out "$OUT/overhead_old.json" > /dev/null 2>&1
patch -s -p1 < docs/pending/decode-launch-splits-once.patch
python3 -m flashgen.bench.torch_overhead --cases kvcache --out "$OUT/overhead_new2.json" > /dev/null 2>&1
el "A/B done"
(cd "$OUT" && tar -czf verify.tgz rec ./*.txt ./*.json && rm -rf rec ./*.txt ./overhead_*.json)
el done
