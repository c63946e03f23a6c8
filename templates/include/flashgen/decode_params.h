// flashgen: runtime parameters of every decode kernel (C ABI), and of its merge_states op.
//
// Glossary: see docs/decode.md and docs/conventions.md. Strides are in elements; head_dim has
// unit stride. As for the other families every field is 8 bytes wide (no padding, one layout
// from C and Python; the Python table is generator/families/decode.py and a test proves they
// agree). Start from fg_decode_params_default(): the defaults are not all zero.
//
// Decode: each of `batch` sequences has `seqlen_q` (1..16) new queries and a KV cache of
// cache_seqlens[b] keys that already includes them; query i sees keys
// j < cache_seqlens[b] - seqlen_q + i + 1 when the spec is causal (bottom_right).
//   Q, O      (batch, seqlen_q, heads, d)
//   K, V      contiguous: (batch, seqlen_k, kv_heads, d), seqlen_k the cache's capacity;
//             paged: (num_pages, page_size, kv_heads, d), k_batch_stride the page stride, and
//             block_table (batch, max_pages) int32 page ids: key j of sequence b is row
//             j % page_size of page block_table[b][j / page_size]
//   LSE       optional (NULL: not written), float32 (batch, heads, seqlen_q), natural log
//   workspace <name>_workspace_bytes(&p) bytes, 16-byte aligned, caller-allocated; its first
//             4 bytes are a sticky error word (see FG_DECODE_ERR_*) that the kernels OR into and
//             never clear: zero it once after allocating, read it when you want to know
//             (with trap_on_error = 1 a bad value stops the kernel instead, see below)
//
// merge_states (<name>_merge_states) reads o_parts (num_parts, batch, seqlen_q, heads, d)
// (float32, or the kernel's dtype when parts_dtype = 1) and lse_parts (num_parts, batch,
// heads, seqlen_q) float32 natural-log LSEs, and writes o and, when non-NULL, lse: the
// attention over the union of the parts' keys. seqlen_q is not limited to 16 there.
#ifndef FLASHGEN_DECODE_PARAMS_H
#define FLASHGEN_DECODE_PARAMS_H

#include <stdint.h>
#include <string.h>

#include "score_params.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bits of the workspace's error word. */
enum fg_decode_error {
  FG_DECODE_ERR_PAGE_ID = 1, /* a block_table entry of a used page is outside [0, num_pages) */
  FG_DECODE_ERR_SEQLEN = 2   /* a cache_seqlens entry is < 0 or > the cache's capacity */
};

typedef struct fg_decode_params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;                   /* optional */
  const int32_t* cache_seqlens; /* (batch) keys per sequence, new queries included */
  const int32_t* block_table;   /* paged: (batch, max_pages), row stride block_table_stride */
  void* workspace;

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride; /* paged: batch stride = page stride */
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride; /* row stride is 1 */

  int64_t batch, heads, kv_heads;
  int64_t seqlen_q;     /* queries per sequence, 1..16 */
  int64_t seqlen_k;     /* contiguous: the cache's capacity (rows per sequence); paged: unused */
  int64_t max_seqlen_k; /* optional upper bound of cache_seqlens for the split heuristic; 0: the capacity */
  int64_t page_size;    /* paged: 16..256, a power of two */
  int64_t num_pages;    /* paged: pages in K and V (page ids must be below it) */
  int64_t max_pages;    /* paged: columns of block_table a sequence may use */
  int64_t block_table_stride;

  double softmax_scale;
  int64_t window_left, window_right; /* -1: unbounded on that side */

  int64_t num_splits;     /* 0: the heuristic (docs/decode.md); else 1..128 */
  int64_t workspace_size; /* bytes at workspace */

  /* merge_states inputs (the decode launcher fills them itself for its split combine) */
  const void* o_parts;
  const float* lse_parts;
  int64_t num_parts;
  int64_t parts_dtype; /* 0: o_parts is float32; 1: o_parts has the kernel's dtype */
  int64_t o_parts_part_stride, o_parts_batch_stride, o_parts_row_stride, o_parts_head_stride;
  int64_t lse_parts_part_stride, lse_parts_batch_stride, lse_parts_head_stride;

  /* instrument_io: 9 uint64 counters (bytes), in the order of DecIo (decode_kernel.cuh) */
  unsigned long long* io_counters;

  /* FP8 caches (spec kv_dtype: e4m3; K and V hold float8_e4m3fn): fp32 descales, element
     (b, hk) at b * batch_stride + hk * head_stride; strides 0 broadcast a per-tensor scalar
     (vLLM's k_scale / v_scale). The kernel computes with k_descale * K and v_descale * V:
     k_descale joins the softmax scale, v_descale multiplies O. NULL for other kernels. */
  const float* k_descale;
  const float* v_descale;
  int64_t k_descale_batch_stride, k_descale_head_stride;
  int64_t v_descale_batch_stride, v_descale_head_stride;

  /* score-stage features (score_params.h, rendered from generator/features/) */
  fg_score_params score;

  /* the caller's head dims: q and k (head_dim), v and o (head_dim_v); <name>_check refuses any
     but the kernel's, so a caller built against another kernel cannot pass a mismatch */
  int64_t head_dim, head_dim_v;

  /* 1: a bad device value (FG_DECODE_ERR_*) also stops the kernel with a device-side assert,
     as flash-attn's guard does: the launch's stream reports cudaErrorAssert and the CUDA
     context is lost. 0 (the default): only the error word says so. flashgen.torch passes 1
     unless asked to read the word (check_inputs). */
  int64_t trap_on_error;
} fg_decode_params;

/* Every pointer NULL, every stride and size 0, windows unbounded, the split heuristic on. */
static inline fg_decode_params fg_decode_params_default(void) {
  fg_decode_params p;
  memset(&p, 0, sizeof(p));
  p.window_left = -1;
  p.window_right = -1;
  return p;
}

#ifdef __cplusplus
}
#endif
#endif /* FLASHGEN_DECODE_PARAMS_H */
