// flashgen: where a launch's Philox seed and offset come from, shared by every kernel that
// drops out (the forward and backward mainloops; the decode kernels have no dropout).
//
// Glossary
//   by value    `seed`, `offset` of the parameter struct: known on the host at launch
//   by pointer  `philox_seed_ptr` set: seed = *philox_seed_ptr, offset = *philox_offset_ptr +
//               philox_offset_add, read when the kernel runs. This is torch's graph-safe
//               generator state (at::PhiloxCudaState under CUDA-graph capture: the pointers
//               are refilled before each replay, the add is the call's place in the graph), so
//               every replay draws a fresh mask; at::cuda::philox::unpack reads it the same way.
// The counter and key built from (seed, offset) are philox.cuh's; nothing else changes, so a
// launch by pointer draws the mask a launch by value of the same (seed, offset) draws.
#pragma once

#include <stdint.h>

namespace fg {

struct PhiloxSeed {
  uint64_t seed, offset;
};

// P: fg_fwd_params or fg_bwd_params (both have the five fields). The loads are a broadcast of
// two words, made once per thread before the mainloop.
template <class P>
__device__ __forceinline__ PhiloxSeed philox_seed(const P& p) {
  if (p.philox_seed_ptr == nullptr) return PhiloxSeed{p.seed, p.offset};
  return PhiloxSeed{*p.philox_seed_ptr, *p.philox_offset_ptr + p.philox_offset_add};
}

// The forward's record of what it used: one thread of the grid writes (seed, offset) to the
// optional outputs, so the backward (and a caller, and verification) read back the values of
// this launch, also under a graph replay whose values the host never sees. Called by every
// thread before any of them may leave the kernel.
template <class P>
__device__ __forceinline__ void record_philox_seed(const P& p) {
  if (p.philox_seed_out != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 &&
      threadIdx.x == 0) {
    const PhiloxSeed s = philox_seed(p);
    *p.philox_seed_out = s.seed;
    if (p.philox_offset_out != nullptr) *p.philox_offset_out = s.offset;
  }
}

}  // namespace fg
