// flashgen: host-side argument checks of the backward kernels (the C ABI launcher's half).
//
// Glossary
//   C      an fg::BwdConfig (compile-time tile sizes and features)
//   rows   batch * seqlen_q: the rows of the fp32 workspace (dq_accum, dsum)
#pragma once

#include <math.h>
#include <stdint.h>

#include "bwd_params.h"
#include "host.h"
#include "score_check.h"

namespace fg {

// Returns nullptr when the parameters are acceptable, else what is wrong and what is allowed.
template <class C>
const char* check_bwd_params(const fg_bwd_params& p) {
  if (!p.q || !p.k || !p.v || !p.o || !p.dout || !p.lse)
    return "q, k, v, o, dout and lse must all be non-null";
  if (!p.dq || !p.dk || !p.dv) return "dq, dk and dv must all be non-null";
  if (!p.dq_accum || !p.dsum)
    return "dq_accum and dsum (the workspace, see <name>_workspace_bytes) must be non-null";
  const void* tensors[] = {p.q, p.k, p.v, p.o, p.dout, p.dq, p.dk, p.dv, p.dq_accum, p.dsum};
  for (const void* t : tensors)
    if (!aligned(t, 16))
      return "q, k, v, o, dout, dq, dk, dv, dq_accum and dsum must be 16-byte aligned";
  if (!aligned(p.lse, 4)) return "lse must be 4-byte aligned";
  const int64_t strides[] = {
      p.q_batch_stride,  p.q_row_stride,  p.q_head_stride,  p.k_batch_stride,  p.k_row_stride,
      p.k_head_stride,   p.v_batch_stride, p.v_row_stride,  p.v_head_stride,   p.o_batch_stride,
      p.o_row_stride,    p.o_head_stride,  p.do_batch_stride, p.do_row_stride, p.do_head_stride,
      p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, p.dk_batch_stride, p.dk_row_stride,
      p.dk_head_stride,  p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride};
  for (int64_t s : strides)
    if (s % 8 != 0) return "tensor strides must be multiples of 8 elements (16 bytes)";
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0) return "batch and seqlens must be >= 0";
  if (p.heads < 1 || p.kv_heads < 1) return "heads and kv_heads must be >= 1";
  if (C::kGqa ? p.heads % p.kv_heads != 0 : p.kv_heads != p.heads)
    return C::kGqa ? "kv_heads must divide heads" : "kv_heads must equal heads (spec has gqa: false)";
  if (!(p.softmax_scale > 0.0) || !isfinite(p.softmax_scale))
    return "softmax_scale must be finite and > 0";
  if (C::kWindow && (p.window_left < -1 || p.window_right < -1))
    return "window sizes must be >= 0, or -1 for unbounded";
  if (C::kVarlen && (!p.cu_seqlens_q || !p.cu_seqlens_k))
    return "varlen needs cu_seqlens_q and cu_seqlens_k";
  if (C::kVarlen && (!aligned(p.cu_seqlens_q, 4) || !aligned(p.cu_seqlens_k, 4)))
    return "cu_seqlens_q and cu_seqlens_k must be 4-byte aligned int32 arrays";
  if (C::kDropout && !(p.dropout_p >= 0.0 && p.dropout_p < 1.0))
    return "dropout_p must be in [0, 1)";
  if (C::kDropout && (p.philox_seed_ptr == nullptr) != (p.philox_offset_ptr == nullptr))
    return "philox_seed_ptr and philox_offset_ptr must be given together (or neither)";
  if (C::kKeepMaskOut && !p.keep_mask) return "debug_keep_mask needs a keep_mask buffer";
  if (C::kDeterministic && (!p.dq_sem || !aligned(p.dq_sem, 4)))
    return "deterministic needs dq_sem (the workspace's third part), 4-byte aligned";
  if (C::kSparse) {
    if (!p.blk_full_count || !p.blk_full_idx || !p.blk_part_count || !p.blk_part_idx)
      return "block sparsity needs all four (transposed) layout arrays";
    if (p.blk_layout_heads != 1 && p.blk_layout_heads != p.heads)
      return "blk_layout_heads must be 1 or heads";
    if (p.blk_max_blocks < 1) return "blk_max_blocks must be >= 1";
  }
  if (C::kInstrumentIo && (!p.io_counters || !aligned(p.io_counters, 8)))
    return "instrument_io needs 13 8-byte aligned uint64 io_counters";
  // Grids: each factor is below 2^31 before a product is formed.
  const int64_t num_nt = (p.seqlen_k + C::kBlockN - 1) / C::kBlockN;
  const int64_t row_blocks = (p.seqlen_q + 31) / 32;
  if (num_nt > INT32_MAX || row_blocks > INT32_MAX || p.heads > INT32_MAX ||
      p.batch > INT32_MAX || num_nt * p.kv_heads > INT32_MAX ||
      num_nt * p.kv_heads * p.batch > INT32_MAX || row_blocks * p.heads > INT32_MAX ||
      row_blocks * p.heads * p.batch > INT32_MAX)
    return "grid too large: ceil(seqlen_k/block_n)*kv_heads*batch or "
           "ceil(seqlen_q/32)*heads*batch exceeds 2^31-1";
  return check_score_params<C>(p.score, /*backward=*/true);  // score_check.h
}

}  // namespace fg
