#!/usr/bin/env bash
# One GPU session's verification and benchmarks, in one command. The kernel libraries must be
# built first (`flashgen compile specs/`, and for the sm_80 PTX run `flashgen compile specs/
# --arch sm_80`; FLASHGEN_BUILD_DIR points at them). Records go to $FLASHGEN_RECORDS_DIR
# (default verify/records), results and logs to ${RESULTS:-bench/results/session}.
#
# Two lanes: verification (GPU 0) and benchmarks (GPU 1), in parallel when there are two
# GPUs, one after the other otherwise, so no benchmark shares its GPU with other work.
#   verify lane, stages VERIFY (default "suite sm80 sanitize"):
#     suite     the GPU suite, FLASHGEN_GPU_EXAMPLES (200) Hypothesis examples per shipped
#               spec, in SHARDS (12) processes (FLASHGEN_SHARD): the float64 references
#               are CPU-bound, the GPU is shared
#     sm80      the sm_80 builds, run as compute_80 PTX on this GPU (5 examples each)
#     sanitize  compute-sanitizer memcheck, racecheck and synccheck on one kernel per family
#               (bench/sanitize.py), then merged into the records
#   bench lane, stages BENCH (default "fwd ab bwd det"):
#     fwd       forward vs SDPA's backends and FlexAttention   -> fwd_h200.json
#     fwd90a    the sm_90a (wgmma) forward vs SDPA's backends   -> fwd_sm90a_h200.json
#     ablation  the sm_90a forward without each feature (FA3 Table 2) -> fwd_sm90a_ablation_h200.json
#     prof90a   Nsight Compute, the d128 sm_90a forward and cuDNN's, 8k -> ncu_fwd90a.txt
#     ab        this version's plain kernels vs BASELINE (an earlier generated/), forwards and
#               backwards of every target                    -> fwd_ab.json
#     scoremod  each score modifier vs its plain twin (softcap, ALiBi, sinks) -> scoremod_h200.json
#     bwd       sm_90a backward and fwd+bwd (wgmma) vs SDPA    -> bwd_h200.json
#     bwd90     mma.sync (sm_90) backward and fwd+bwd vs SDPA   -> bwd_sm90_h200.json
#     det       deterministic backward                         -> bwd_det_h200.json
#     decode    decode / paged KV cache vs copy and SDPA        -> decode_h200.json
#     train     examples/train_gpt.py, flashgen vs SDPA         -> train_h200.json
#     torchov   host time per call of the torch op vs SDPA      -> torch_overhead_h200.json
#     hbm       Nsight DRAM bytes, forward+backward, GPT-2-medium -> hbm_fwdbwd_h200.json
set -u
out=${RESULTS:-bench/results/session}
mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l)
shards=${SHARDS:-12}
examples=${FLASHGEN_GPU_EXAMPLES:-200}
export OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2 PYTHONUNBUFFERED=1
t() { timeout "$@"; }  # every stage is bounded, so the session always ends with its logs

stage_suite() {
  for i in $(seq 0 $((shards - 1))); do
    FLASHGEN_SHARD=$i/$shards FLASHGEN_GPU_EXAMPLES=$examples t "${SUITE_TIMEOUT:-420}" \
      python3 -m pytest -q tests/gpu -p no:cacheprovider > "$out/suite_$i.txt" 2>&1 &
  done
  wait
}
stage_sm80() {
  for i in 0 1 2 3; do
    FLASHGEN_TARGET=sm_80 FLASHGEN_SHARD=$i/4 FLASHGEN_GPU_EXAMPLES=5 t 150 \
      python3 -m pytest -q tests/gpu/test_forward.py tests/gpu/test_backward.py \
      tests/gpu/test_extras.py -p no:cacheprovider -k "not repeat and not long" \
      > "$out/sm80_$i.txt" 2>&1 &
  done
  wait
}
stage_sanitize() {
  for tool in memcheck racecheck synccheck; do
    for i in 0 1 2 3; do
      t 240 compute-sanitizer --tool $tool python3 -m flashgen.bench.sanitize run $i/4 \
        > "$out/${tool}_$i.txt" 2>&1 &
    done
  done
  wait
  python3 -m flashgen.bench.sanitize merge "$out"/memcheck_*.txt "$out"/racecheck_*.txt \
    "$out"/synccheck_*.txt \
    > "$out/sanitize.txt" 2>&1
}
stage_fwd() {
  t 200 python3 -m flashgen.bench.fwd_bench --specs specs/fwd_dense.yaml \
    --seqlens 1024 4096 16384 --flex-min-seqlen 4096 --check --out "$out/fwd_h200.json" \
    > "$out/bench_fwd.txt" 2>&1
}
stage_fwd90a() {
  t 200 python3 -m flashgen.bench.fwd_bench --specs specs/fwd_sm90a.yaml --head-dims 64 128 256 \
    --seqlens 1024 4096 8192 16384 --no-flex --check --out "$out/fwd_sm90a_h200.json" \
    > "$out/bench_fwd90a.txt" 2>&1
}
stage_ablation() {
  t 240 python3 -m flashgen.bench.ablation_bench --out "$out/fwd_sm90a_ablation_h200.json" \
    > "$out/bench_ablation.txt" 2>&1
}
stage_prof90a() {  # one launch each: flashgen's d128 auto tile (non-causal), then cuDNN's
  local args="--specs specs/fwd_sm90a.yaml --head-dims 128 --seqlens 8192 --no-flex"
  t 120 ncu --clock-control none --set full -k regex:fa_fwd_d128_bf16_m128 --launch-skip 3 \
    --launch-count 1 -f -o "$out/ncu_fwd90a" python3 -m flashgen.bench.fwd_bench $args \
    --backends > "$out/ncu_fwd90a_run.txt" 2>&1
  t 120 ncu --clock-control none --set full -k regex:fprop --launch-skip 3 --launch-count 1 \
    -f -o "$out/ncu_cudnn" python3 -m flashgen.bench.fwd_bench $args --backends CUDNN \
    > "$out/ncu_cudnn_run.txt" 2>&1
  for r in ncu_fwd90a ncu_cudnn; do
    ncu -i "$out/$r.ncu-rep" --page details > "$out/$r.txt" 2>&1
  done
}
stage_torchov() {
  t 120 python3 -m flashgen.bench.torch_overhead --out "$out/torch_overhead_h200.json" \
    > "$out/bench_torchov.txt" 2>&1
}
stage_ab() {
  [ -n "${BASELINE:-}" ] || return 0
  t "${AB_TIMEOUT:-240}" python3 -m flashgen.bench.ab_bench --baseline "$BASELINE" --backward \
    --specs specs/fwd_dense.yaml specs/fwd_sm90a.yaml specs/bwd_dense.yaml specs/bwd_sm90a.yaml \
    --repeats 1 --out "$out/fwd_ab.json" > "$out/bench_ab.txt" 2>&1
}
stage_scoremod() {
  t "${SCOREMOD_TIMEOUT:-300}" python3 -m flashgen.bench.scoremod_bench --check \
    --out "$out/scoremod_h200.json" > "$out/bench_scoremod.txt" 2>&1
}
stage_bwd() {
  t 200 python3 -m flashgen.bench.bwd_bench --specs specs/bwd_sm90a.yaml --fwd-specs \
    specs/fwd_sm90a.yaml --seqlens 4096 8192 16384 --check --out "$out/bwd_h200.json" \
    > "$out/bench_bwd.txt" 2>&1
}
stage_bwd90() {
  t 200 python3 -m flashgen.bench.bwd_bench --specs specs/bwd_dense.yaml --fwd-specs \
    specs/fwd_dense.yaml --seqlens 4096 8192 16384 --out "$out/bwd_sm90_h200.json" \
    > "$out/bench_bwd90.txt" 2>&1
}
stage_det() {
  # each deterministic kernel beside its non-deterministic twin (sm_90a: bwd_sm90a.yaml; sm_90:
  # bwd_dense.yaml), then repeated runs of the sm_90a ones against their twins' (bitwise)
  t 200 python3 -m flashgen.bench.bwd_bench --specs specs/bwd_det.yaml specs/bwd_sm90a.yaml \
    specs/bwd_dense.yaml --deterministic --seqlens 1024 4096 16384 \
    --out "$out/bwd_det_h200.json" > "$out/bench_det.txt" 2>&1
  t 90 python3 -m flashgen.bench.det_repeat --out "$out/det_repeat_h200.json" \
    > "$out/det_repeat.txt" 2>&1
}
stage_decode() {
  t 170 python3 -m flashgen.bench.decode_bench --out "$out/decode_h200.json" ${DECODE_ARGS:-} \
    > "$out/bench_decode.txt" 2>&1
}
stage_train() {
  t 260 python3 examples/train_gpt.py --out "$out/train_h200.json" --plot "$out/train_h200.png" \
    ${TRAIN_ARGS:-} \
    > "$out/train.txt" 2>&1
}
stage_hbm() {
  for impl in flashgen math flash cudnn; do
    t 60 ncu --clock-control none --profile-from-start off --csv \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum \
      python3 -m flashgen.bench.hbm_fwdbwd run --impl $impl > "$out/$impl.csv" 2> "$out/hbm_$impl.err"
  done
  python3 -m flashgen.bench.hbm_fwdbwd summarize "$out"/{flashgen,math,flash,cudnn}.csv \
    --out "$out/hbm_fwdbwd_h200.json" > "$out/hbm.txt" 2>&1
}

lane() {  # lane GPU STAGES...
  local gpu=$1
  shift
  for s in "$@"; do
    echo "[$(date +%T)] gpu $gpu: $s"
    CUDA_VISIBLE_DEVICES=$gpu "stage_$s"
  done
}
# shellcheck disable=SC2086
if [ "$ngpu" -ge 2 ]; then
  lane 0 ${VERIFY-suite sm80 sanitize} &
  lane 1 ${BENCH-fwd ab bwd det} &
  wait
else
  lane 0 ${VERIFY-suite sm80 sanitize} ${BENCH-fwd ab bwd det}
fi
echo "[$(date +%T)] done"
for f in "$out"/suite_*.txt "$out"/sm80_*.txt; do [ -f "$f" ] && echo "$f: $(tail -n 1 "$f")"; done
