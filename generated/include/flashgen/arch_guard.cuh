// flashgen: one clear compile error for device code built below sm_80.
//
// The kernels use cp.async, ldmatrix and bf16 mma.sync, which exist from sm_80 on. Without
// this guard, nvcc's default target (below sm_80) reaches ptxas and fails with a wall of
// "cp.async requires sm_80" errors; with it, the device pass stops at the one #error below.
// __CUDA_ARCH__ is only defined while compiling device code, so host passes are unaffected.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "flashgen kernels need sm_80 or newer: compile with -arch=sm_80 (or newer), e.g. nvcc -arch=sm_90 ..."
#endif
