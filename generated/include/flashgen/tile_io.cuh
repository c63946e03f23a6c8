// flashgen: every global-memory access of the forward kernel goes through this file, so that
// an `instrument_io` build can count the bytes each one moves (docs/conventions.md, "HBM bytes").
//
// Glossary
//   Io<kOn>   per-thread byte counters; with kOn = false they compile away entirely
//   tensor    counter index: kQ, kK, kV, kO, kLse, kMeta, kKeepMask
//   chunk     16 bytes = 8 elements of a row, the unit of cp.async
//   stride    smem row stride in elements (head_dim + 8: the 16-byte pad keeps the 8 rows an
//             ldmatrix reads in 8 different bank groups)
#pragma once

#include <stdint.h>

#include "arch.cuh"

namespace fg {

enum IoTensor { kQ = 0, kK, kV, kO, kLse, kMeta, kKeepMask, kNumIoTensors };

template <bool kOn>
struct Io {
  __device__ __forceinline__ void add(int, uint64_t) {}
  __device__ __forceinline__ void flush(unsigned long long*) {}
};

template <>
struct Io<true> {
  uint64_t bytes[kNumIoTensors] = {0, 0, 0, 0, 0, 0, 0};
  __device__ __forceinline__ void add(int tensor, uint64_t n) { bytes[tensor] += n; }
  // One atomic per warp and tensor: sum over the warp's lanes first.
  __device__ __forceinline__ void flush(unsigned long long* counters) {
#pragma unroll
    for (int t = 0; t < kNumIoTensors; ++t) {
      uint64_t v = bytes[t];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if ((threadIdx.x & 31) == 0 && v != 0) atomicAdd(counters + t, (unsigned long long)v);
    }
  }
};

// Rows [0, kRows) x kD elements of a row-major global tile into smem, zero-filling rows
// >= valid_rows (those bytes are not read, and not counted).
template <int kRows, int kD, int kThreads, int kStride, typename Elem, class IoT>
__device__ __forceinline__ void load_tile_async(Elem* smem, const Elem* gmem, int64_t row_stride,
                                                int64_t valid_rows, IoT& io, int tensor) {
  constexpr int kChunksPerRow = kD / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
  for (int it = 0; it < (kChunks + kThreads - 1) / kThreads; ++it) {
    const int c = it * kThreads + threadIdx.x;
    if (kChunks % kThreads != 0 && c >= kChunks) break;
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const bool valid = row < valid_rows;
    const Elem* src = valid ? gmem + row * row_stride + col : gmem;
    cp_async_16(smem + row * kStride + col, src, valid);
    io.add(tensor, valid ? 16 : 0);
  }
}

// A read of one int32 of metadata (cu_seqlens, block layout); `count` says whether this
// thread's read is the CTA's accounted one (the others hit the same L1 line).
template <class IoT>
__device__ __forceinline__ int32_t load_meta(const int32_t* p, IoT& io, bool count) {
  if (count) io.add(kMeta, 4);
  return __ldg(p);
}

template <typename Elem, class IoT>
__device__ __forceinline__ void store_pair(Elem* gmem, uint32_t packed, IoT& io) {
  *reinterpret_cast<uint32_t*>(gmem) = packed;
  io.add(kO, 4);
}

template <class IoT>
__device__ __forceinline__ void store_lse(float* gmem, float lse, IoT& io) {
  *gmem = lse;
  io.add(kLse, 4);
}

template <class IoT>
__device__ __forceinline__ void store_keep(uint8_t* gmem, bool keep, IoT& io) {
  *gmem = keep ? 1 : 0;
  io.add(kKeepMask, 1);
}

}  // namespace fg
