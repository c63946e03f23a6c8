#!/usr/bin/env bash
# Verification of fp8-forward.patch: it adds descale fields to fg_fwd_params (params.h) and FP8
# paths to the sm_90a forward's headers, so every forward kernel is renamed (their PTX is
# unchanged apart from the parameter size: docs/benchmarks.md, "The FP8 forward"). Builds
# every kernel; the forward GPU suites (16-bit and FP8, every target) at 200 examples with the
# forward extras (dropout, block sparsity, IO); flashgen.torch's GPU tests; the three
# sanitizers on the forward families (device_verify.sh's stages, with this patch's suites);
# then the FP8 bench (STAGES "bench"). Run from the repository root with the patch applied
# and generated; records and logs go into $OUT/verify.tgz, the bench JSON into $OUT (default
# OUT: bench/results/session). Needs PyCUDA importable (PYTHONPATH) and flashgen installed.
# Under the 600 s a call allows: STAGES=suite, then STAGES=sanitize, then STAGES=bench.
set -u
STAGES=${STAGES:-suite sanitize bench}
OUT=${OUT:-bench/results/session}
here=$(dirname "$0")
if [[ " $STAGES " == *" suite "* || " $STAGES " == *" sanitize "* ]]; then
  STAGES=$STAGES OUT=$OUT SUITE_K="" SANITIZE_KINDS=forward SANITIZE_TARGET="" \
    SUITE_TESTS="tests/gpu/test_forward.py tests/gpu/test_forward_fp8.py tests/gpu/test_extras.py" \
    bash "$here/device_verify.sh"
fi
if [[ " $STAGES " == *" bench "* ]]; then
  python3 -m flashgen.bench.fp8_fwd_bench --out "$OUT/fp8_fwd.json" 2>&1 | tail -12
fi
