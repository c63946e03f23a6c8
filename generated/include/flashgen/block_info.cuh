// flashgen: where one (batch b) sequence lies, shared by every family.
//
// Glossary
//   sq, sk   the sequence's query / key length (varlen: from cu_seqlens; else the params')
//   q0, k0   its first packed row (varlen) or 0
//   grow(r)  the row's index among all rows of every sequence: q0 + r (varlen) or
//            b * seqlen_q + r; workspaces laid out (rows, heads, ...) use it
//   off(...) the element offset of a row of a (batch, row, head, d) tensor: varlen tensors
//            are packed (total, heads, d), so the batch stride is not used
#pragma once

#include <stdint.h>

#include "tile_io.cuh"

namespace fg {

template <bool kVarlen>
struct SeqInfo {
  int64_t b, sq, sk, q0, k0, seqlen_q;

  // Reads cu_seqlens (META bytes, counted once per CTA by `count`) when varlen.
  template <class IoT>
  __device__ __forceinline__ SeqInfo(int64_t b_, int64_t seqlen_q_, int64_t seqlen_k_,
                                     const int32_t* cu_q, const int32_t* cu_k, IoT& io,
                                     bool count)
      : b(b_), sq(seqlen_q_), sk(seqlen_k_), q0(0), k0(0), seqlen_q(seqlen_q_) {
    if (kVarlen) {
      q0 = load_meta(cu_q + b, io, count);
      sq = load_meta(cu_q + b + 1, io, count) - q0;
      k0 = load_meta(cu_k + b, io, count);
      sk = load_meta(cu_k + b + 1, io, count) - k0;
    }
  }

  // Element offset of query row r (k: key row) of a tensor with these strides.
  __device__ __forceinline__ int64_t q_off(int64_t batch_stride, int64_t row_stride,
                                           int64_t r) const {
    return kVarlen ? (q0 + r) * row_stride : b * batch_stride + r * row_stride;
  }
  __device__ __forceinline__ int64_t k_off(int64_t batch_stride, int64_t row_stride,
                                           int64_t r) const {
    return kVarlen ? (k0 + r) * row_stride : b * batch_stride + r * row_stride;
  }
  // LSE (batch, heads, seqlen_q) or, varlen, (heads, total_q): offset of row r of head h.
  __device__ __forceinline__ int64_t lse_off(int64_t batch_stride, int64_t head_stride,
                                             int64_t h, int64_t r) const {
    return (kVarlen ? q0 : b * batch_stride) + h * head_stride + r;
  }
  __device__ __forceinline__ int64_t grow(int64_t r) const {
    return kVarlen ? q0 + r : b * seqlen_q + r;
  }
};

}  // namespace fg
