// flashgen: every global-memory access of every kernel goes through this file, so that an
// `instrument_io` build can count the bytes each one moves (docs/conventions.md, "HBM bytes").
//
// Glossary
//   Io<kOn, Keys>  per-thread byte counters, one per tensor of the family's counter list
//             `Keys` (e.g. FwdIo below); with kOn = false they compile away entirely
//   tensor    counter index, a member of Keys (Keys::kMeta and Keys::kKeepMask must exist)
//   chunk     16 bytes = 8 elements of a row, the unit of cp.async
//   stride    smem row stride in elements (head_dim + 8: the 16-byte pad keeps the 8 rows an
//             ldmatrix reads in 8 different bank groups)
//   kD, kDValid  a tile's columns in smem (the head dim rounded up to the MMA's k16 steps)
//             and in global memory (the head dim): chunks at columns >= kDValid are
//             zero-filled without a read, and are not counted
#pragma once

#include <stdint.h>

#include "arch.cuh"

namespace fg {

// The forward family's counters, in the order of its Python table (families/forward.py).
struct FwdIo {
  enum IoTensor { kQ = 0, kK, kV, kO, kLse, kMeta, kKeepMask, kNumIoTensors };
  static constexpr int kCount = kNumIoTensors;
};

template <bool kOn, class Keys = FwdIo>
struct Io {
  using K = Keys;
  __device__ __forceinline__ void add(int, uint64_t) {}
  __device__ __forceinline__ void flush(unsigned long long*) {}
};

template <class Keys>
struct Io<true, Keys> {
  using K = Keys;
  uint64_t bytes[Keys::kCount] = {};
  __device__ __forceinline__ void add(int tensor, uint64_t n) { bytes[tensor] += n; }
  // One atomic per warp and tensor: sum over the warp's lanes first.
  __device__ __forceinline__ void flush(unsigned long long* counters) {
#pragma unroll
    for (int t = 0; t < Keys::kCount; ++t) {
      uint64_t v = bytes[t];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if ((threadIdx.x & 31) == 0 && v != 0) atomicAdd(counters + t, (unsigned long long)v);
    }
  }
};

// Rows [0, kRows) x kD elements of a row-major global tile into smem, zero-filling rows
// >= valid_rows and columns >= kDValid (those bytes are not read, and not counted).
template <int kRows, int kD, int kThreads, int kStride, int kDValid = kD, typename Elem,
          class IoT>
__device__ __forceinline__ void load_tile_async(Elem* smem, const Elem* gmem, int64_t row_stride,
                                                int64_t valid_rows, IoT& io, int tensor) {
  static_assert(kD % 8 == 0 && kDValid % 8 == 0 && kDValid <= kD, "16-byte chunks");
  constexpr int kChunksPerRow = kD / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
  for (int it = 0; it < (kChunks + kThreads - 1) / kThreads; ++it) {
    const int c = it * kThreads + threadIdx.x;
    if (kChunks % kThreads != 0 && c >= kChunks) break;
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const bool valid = row < valid_rows && (kDValid == kD || col < kDValid);
    const Elem* src = valid ? gmem + row * row_stride + col : gmem;
    cp_async_16(smem + row * kStride + col, src, valid);
    io.add(tensor, valid ? 16 : 0);
  }
}

// Rows [0, kRows) x kD elements into smem, row r from row_ptr(r): a pointer to its first
// element, or nullptr for a row that is zero-filled and neither read nor counted (`fallback`,
// any valid address, stands in for it). For tiles whose rows are not evenly strided: the
// pages of a paged KV cache, the query heads of a GQA group packed into one tile. Columns
// >= kDValid are zero-filled as in load_tile_async.
template <int kRows, int kD, int kThreads, int kStride, int kDValid = kD, typename Elem,
          class RowPtr, class IoT>
__device__ __forceinline__ void load_rows_async(Elem* smem, RowPtr&& row_ptr,
                                                const Elem* fallback, IoT& io, int tensor) {
  static_assert(kD % 8 == 0 && kDValid % 8 == 0 && kDValid <= kD, "16-byte chunks");
  constexpr int kChunksPerRow = kD / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
  for (int it = 0; it < (kChunks + kThreads - 1) / kThreads; ++it) {
    const int c = it * kThreads + threadIdx.x;
    if (kChunks % kThreads != 0 && c >= kChunks) break;
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const Elem* src = row_ptr(row);
    const bool valid = src != nullptr && (kDValid == kD || col < kDValid);
    cp_async_16(smem + row * kStride + col, valid ? src + col : fallback, valid);
    io.add(tensor, valid ? 16 : 0);
  }
}

// A counted read of one int32 index (a cache length, a block-table entry) into tensor
// `tensor`'s counter; `count` as for load_meta below.
template <class IoT>
__device__ __forceinline__ int32_t load_index(const int32_t* p, IoT& io, int tensor, bool count) {
  if (count) io.add(tensor, 4);
  return __ldg(p);
}

// Sets error bits in a caller-visible flag word (bad input found on the device); not counted:
// it happens only on input the IO model does not describe.
__device__ __forceinline__ void raise_error_flag(unsigned int* word, unsigned int bits) {
  atomicOr(word, bits);
}

// A read of one int32 of metadata (cu_seqlens, block layout); `count` says whether this
// thread's read is the CTA's accounted one (the others hit the same L1 line).
template <class IoT>
__device__ __forceinline__ int32_t load_meta(const int32_t* p, IoT& io, bool count) {
  if (count) io.add(IoT::K::kMeta, 4);
  return __ldg(p);
}

// Two adjacent elements (packed in 32 bits) of tensor `tensor`.
template <typename Elem, class IoT>
__device__ __forceinline__ void store_pair(Elem* gmem, uint32_t packed, IoT& io, int tensor) {
  *reinterpret_cast<uint32_t*>(gmem) = packed;
  io.add(tensor, 4);
}

template <class IoT>
__device__ __forceinline__ void store_f32(float* gmem, float x, IoT& io, int tensor) {
  *gmem = x;
  io.add(tensor, 4);
}

template <class IoT>
__device__ __forceinline__ float load_f32(const float* gmem, IoT& io, int tensor) {
  io.add(tensor, 4);
  return *gmem;
}

// fp32 accumulation into global memory (red.global.add): 4 bytes read and 4 written.
template <class IoT>
__device__ __forceinline__ void atomic_add_f32(float* gmem, float x, IoT& io, int tensor) {
  atomicAdd(gmem, x);
  io.add(tensor, 8);
}

// 16 bytes = 8 elements, read through the read-only path.
template <typename Elem, class IoT>
__device__ __forceinline__ uint4 load_16(const Elem* gmem, IoT& io, int tensor) {
  io.add(tensor, 16);
  return __ldg(reinterpret_cast<const uint4*>(gmem));
}

template <typename Elem, class IoT>
__device__ __forceinline__ void store_16(Elem* gmem, uint4 v, IoT& io, int tensor) {
  *reinterpret_cast<uint4*>(gmem) = v;
  io.add(tensor, 16);
}

template <class IoT>
__device__ __forceinline__ void store_keep(uint8_t* gmem, bool keep, IoT& io) {
  *gmem = keep ? 1 : 0;
  io.add(IoT::K::kKeepMask, 1);
}

}  // namespace fg
