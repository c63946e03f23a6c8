// flashgen: runtime parameters of every backward kernel (C ABI).
//
// Glossary: see docs/conventions.md. Strides are in elements; head_dim has unit stride. As
// for the forward, every field is 8 bytes wide (no padding, one layout from C and Python;
// the Python table is generator/families/backward.py and a test proves they agree).
// Start from fg_bwd_params_default(): the defaults are not all zero.
//
// Inputs are the forward's q, k, v, its output o and LSE (natural log, -inf on empty rows;
// a context-parallel caller may pass merged ones), and dout = dL/dO. Outputs dq, dk, dv have
// the layouts of q, k, v. The workspace (fp32, caller-allocated, see <name>_workspace_bytes)
// holds dq_accum (rows, heads, head_dim) and dsum = rowsum(dO * O) (rows, heads), rows being
// batch * seqlen_q (varlen: the same bound, rows indexed by packed position, except the sm_90a
// backward's dq_accum, indexed by b * seqlen_q + row so a tile never reaches the next
// sequence's rows); deterministic
// builds also need dq_sem, one int32 per (batch, head, query tile), which orders the dQ adds.
#ifndef FLASHGEN_BWD_PARAMS_H
#define FLASHGEN_BWD_PARAMS_H

#include <stdint.h>
#include <string.h>

#include "score_params.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fg_bwd_params {
  /* inputs: Q, O, dO (batch, seqlen_q, heads, d); K, V (batch, seqlen_k, kv_heads, d) */
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  const float* lse; /* (batch, heads, seqlen_q) natural log; varlen: (heads, total_q) */
  /* outputs: dQ like Q, dK and dV like K and V (summed over each GQA group) */
  void* dq;
  void* dk;
  void* dv;
  /* workspace: see the header comment */
  float* dq_accum;
  float* dsum;
  int32_t* dq_sem; /* deterministic builds: (batch, heads, ceil(seqlen_q/block_m)) counters */

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t lse_batch_stride, lse_head_stride; /* row stride is 1; varlen: batch stride unused */

  int64_t batch, heads, kv_heads;
  int64_t seqlen_q, seqlen_k; /* varlen: the maxima over the batch */

  /* varlen: int32 cumulative lengths, batch + 1 entries each */
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;

  double softmax_scale;
  int64_t window_left, window_right; /* -1: unbounded on that side */

  /* dropout: the forward's Philox stream; keep iff philox word >= floor(p * 2^32) */
  double dropout_p;
  uint64_t seed, offset;
  /* when philox_seed_ptr is not NULL: seed = *philox_seed_ptr, offset = *philox_offset_ptr +
     philox_offset_add, read at run time (e.g. the forward's philox_seed_out / _offset_out) */
  const uint64_t* philox_seed_ptr;
  const uint64_t* philox_offset_ptr;
  uint64_t philox_offset_add;
  uint8_t* keep_mask; /* debug only: (batch, heads, seqlen_q, seqlen_k), written */

  /* block sparsity (int32), the forward's layout transposed: per layout head and K/V tile,
     [layout_heads][num_k_tiles](...) lists of query tiles, full then partial */
  const int32_t* blk_full_count;
  const int32_t* blk_full_idx;
  const int32_t* blk_part_count;
  const int32_t* blk_part_idx;
  int64_t blk_layout_heads; /* 1 (shared across heads) or heads */
  int64_t blk_max_blocks;   /* row length of the idx arrays */

  /* instrument_io: 13 uint64 counters (bytes), in the order of FgBwdIo (bwd_kernel.cuh) */
  unsigned long long* io_counters;

  /* score-stage features (score_params.h, rendered from generator/features/) */
  fg_score_params score;

  /* the caller's head dims: q and k (head_dim), v and o (head_dim_v); <name>_check refuses any
     but the kernel's, so a caller built against another kernel cannot pass a mismatch */
  int64_t head_dim, head_dim_v;

  /* varlen on the sm_90a backward: the rows of the packed q (and o, dout, dq) and of the packed
     k and v (and dk, dv) tensors, which its tensor maps span (>= cu_seqlens_q[batch] and
     cu_seqlens_k[batch]); the mma.sync backward does not read them */
  int64_t total_q, total_k;
} fg_bwd_params;

/* Every pointer NULL, every stride and size 0, windows unbounded, one shared layout. */
static inline fg_bwd_params fg_bwd_params_default(void) {
  fg_bwd_params p;
  memset(&p, 0, sizeof(p));
  p.window_left = -1;
  p.window_right = -1;
  p.blk_layout_heads = 1;
  return p;
}

#ifdef __cplusplus
}
#endif
#endif /* FLASHGEN_BWD_PARAMS_H */
