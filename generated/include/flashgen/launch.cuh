// flashgen: host-side argument checks and grid of the forward kernels (the C ABI launcher's
// half; verify/runner.py applies the same rules in Python, with the same messages).
//
// Glossary
//   C        an fg::FwdConfig (compile-time tile sizes and features)
//   grid     ceil(seqlen_q / block_m) * heads * batch CTAs, flattened into gridDim.x
#pragma once

#include <math.h>
#include <stdint.h>

#include "params.h"
#include "score_check.h"

namespace fg {

// Returns nullptr when the parameters are acceptable, else what is wrong and what is allowed.
template <class C>
const char* check_fwd_params(const fg_fwd_params& p) {
  if (!p.q || !p.k || !p.v || !p.o || !p.lse) return "q, k, v, o and lse must all be non-null";
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(p.q) | reinterpret_cast<uintptr_t>(p.k) |
                               reinterpret_cast<uintptr_t>(p.v) | reinterpret_cast<uintptr_t>(p.o);
  if (misaligned % 16 != 0) return "q, k, v and o must be 16-byte aligned";
  if (reinterpret_cast<uintptr_t>(p.lse) % 4 != 0) return "lse must be 4-byte aligned";
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                             p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                             p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                             p.o_batch_stride, p.o_row_stride, p.o_head_stride};
  for (int64_t s : strides)
    if (s % 8 != 0) return "q/k/v/o strides must be multiples of 8 elements (16 bytes)";
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
  if (C::kVarlen && ((reinterpret_cast<uintptr_t>(p.cu_seqlens_q) |
                      reinterpret_cast<uintptr_t>(p.cu_seqlens_k)) % 4 != 0))
    return "cu_seqlens_q and cu_seqlens_k must be 4-byte aligned int32 arrays";
  if (C::kDropout && !(p.dropout_p >= 0.0 && p.dropout_p < 1.0))
    return "dropout_p must be in [0, 1)";
  if (C::kDropout && (p.philox_seed_ptr == nullptr) != (p.philox_offset_ptr == nullptr))
    return "philox_seed_ptr and philox_offset_ptr must be given together (or neither)";
  if (C::kKeepMaskOut && !p.keep_mask) return "debug_keep_mask needs a keep_mask buffer";
  if (C::kSparse) {
    if (!p.blk_full_count || !p.blk_full_idx || !p.blk_part_count || !p.blk_part_idx)
      return "block sparsity needs all four layout arrays";
    if (p.blk_layout_heads != 1 && p.blk_layout_heads != p.heads)
      return "blk_layout_heads must be 1 or heads";
    if (p.blk_max_blocks < 1) return "blk_max_blocks must be >= 1";
  }
  if (C::kInstrumentIo && (!p.io_counters || reinterpret_cast<uintptr_t>(p.io_counters) % 8 != 0))
    return "instrument_io needs 7 8-byte aligned uint64 io_counters";
  // Each factor is below 2^31 before the product is formed, so the product cannot overflow.
  const int64_t num_qt = (p.seqlen_q + C::kBlockM - 1) / C::kBlockM;
  if (num_qt > INT32_MAX || p.heads > INT32_MAX || p.batch > INT32_MAX ||
      num_qt * p.heads > INT32_MAX || num_qt * p.heads * p.batch > INT32_MAX)
    return "grid too large: ceil(seqlen_q/block_m)*heads*batch > 2^31-1";
  return check_score_params<C>(p.score, /*backward=*/false);  // score_check.h
}

template <class C>
int64_t fwd_grid(const fg_fwd_params& p) {
  return (p.seqlen_q + C::kBlockM - 1) / C::kBlockM * p.heads * p.batch;
}

}  // namespace fg
