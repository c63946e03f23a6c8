// flashgen: runtime parameters of every forward kernel (C ABI).
//
// Glossary: see docs/conventions.md. Strides are in elements; head_dim has unit stride.
// Every field is 8 bytes wide (pointer, int64, uint64 or double), so the struct has no
// padding and the same layout from C, C++ and Python (verify/runner.py packs it by hand).
// Fields a kernel's spec does not use are ignored by that kernel.
// Start from fg_fwd_params_default() (below), not from `= {0}`: the defaults are not all zero.
#ifndef FLASHGEN_PARAMS_H
#define FLASHGEN_PARAMS_H

#include <stdint.h>
#include <string.h>

#include "score_params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fg_fwd_params {
  /* tensors: Q, O (batch, seqlen_q, heads, d); K, V (batch, seqlen_k, kv_heads, d) */
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse; /* (batch, heads, seqlen_q) natural log; varlen: (heads, total_q) */

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride; /* row stride is 1; varlen: batch stride unused */

  int64_t batch, heads, kv_heads;
  int64_t seqlen_q, seqlen_k; /* varlen: the maxima over the batch */

  /* varlen: int32 cumulative lengths, batch + 1 entries each */
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  /* varlen: rows of the packed q and k/v tensors (>= cu_seqlens_q[batch], cu_seqlens_k[batch]);
     the TMA kernels (sm_90a) build their tensor maps over these rows, the others ignore them */
  int64_t total_q, total_k;

  double softmax_scale;
  int64_t window_left, window_right; /* -1: unbounded on that side */

  /* dropout: keep iff philox word >= floor(p * 2^32) */
  double dropout_p;
  uint64_t seed, offset;
  /* graph-safe dropout (torch's at::PhiloxCudaState under CUDA-graph capture): when
     philox_seed_ptr is not NULL the kernel ignores seed and offset and reads, at run time (each
     graph replay), seed = *philox_seed_ptr and offset = *philox_offset_ptr + philox_offset_add */
  const uint64_t* philox_seed_ptr;
  const uint64_t* philox_offset_ptr;
  uint64_t philox_offset_add;
  /* when not NULL: the (seed, offset) the launch used, written once (one uint64 each); the
     backward reads them back through its philox_seed_ptr / philox_offset_ptr */
  uint64_t* philox_seed_out;
  uint64_t* philox_offset_out;
  uint8_t* keep_mask; /* debug only: (batch, heads, seqlen_q, seqlen_k) */

  /* block sparsity (int32), per layout head: [layout_heads][num_q_tiles](...) */
  const int32_t* blk_full_count;
  const int32_t* blk_full_idx;
  const int32_t* blk_part_count;
  const int32_t* blk_part_idx;
  int64_t blk_layout_heads; /* 1 (shared across heads) or heads */
  int64_t blk_max_blocks;   /* row length of the idx arrays */

  /* instrument_io: 7 uint64 counters: Q, K, V, O, LSE, META, KEEP_MASK (bytes) */
  unsigned long long* io_counters;

  /* score-stage features (score_params.h, rendered from generator/features/) */
  fg_score_params score;

  /* the caller's head dims: q and k (head_dim), v and o (head_dim_v); <name>_check refuses any
     but the kernel's, so a caller built against another kernel cannot pass a mismatch */
  int64_t head_dim, head_dim_v;
} fg_fwd_params;

/* The defaults: every pointer NULL, every stride, size, scale and dropout field 0, windows
   unbounded (window_left = window_right = -1), blk_layout_heads = 1 (one shared layout).
   Set the tensors, strides, sizes and softmax_scale (e.g. 1/sqrt(head_dim)) before launching,
   plus the fields of the features the kernel's spec enables. C99 or newer, and C++. */
static inline fg_fwd_params fg_fwd_params_default(void) {
  fg_fwd_params p;
  memset(&p, 0, sizeof(p));
  p.window_left = -1;
  p.window_right = -1;
  p.blk_layout_heads = 1;
  return p;
}

#ifdef __cplusplus
}
#endif
#endif /* FLASHGEN_PARAMS_H */
