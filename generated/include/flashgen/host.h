// flashgen: host-side helpers shared by every family's C launcher.
//
// Glossary
//   opt-in   a kernel using more than 48 KiB of dynamic shared memory must be allowed to,
//            once per device (cudaFuncAttributeMaxDynamicSharedMemorySize is per device)
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

namespace fg {

inline bool aligned(const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

// Opts `kernel` in to `bytes` of dynamic shared memory on the current device, once per
// device: `devices` (one static per kernel, at the call site) remembers which devices
// (ordinals below 64; above, every launch sets the attribute again) are done.
template <class Kernel>
cudaError_t opt_in_smem(Kernel kernel, int64_t bytes, std::atomic<unsigned long long>& devices) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const unsigned long long bit = dev >= 0 && dev < 64 ? 1ull << dev : 0ull;
  if (bit != 0 && (devices.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes));
  if (err == cudaSuccess && bit != 0) devices.fetch_or(bit, std::memory_order_release);
  return err;
}

}  // namespace fg
