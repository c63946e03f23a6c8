// flashgen: host side of the decode kernels: argument checks, the split heuristic, the
// workspace layout and the grids (the C ABI launcher's half; docs/decode.md).
//
// Glossary
//   C          an fg::DecConfig (compile-time tile sizes and features)
//   row tiles  ceil(seqlen_q * heads / kv_heads / block_m): CTAs along the packed rows
//   key tiles  ceil(bound / block_n), bound = max_seqlen_k (or the cache's capacity)
//   slots      CTAs of the main kernel the device holds at once (SMs x CTAs per SM)
//   workspace  [error word, 256 bytes][o_parts: splits x batch x seqlen_q x heads x d fp32]
//              [lse_parts: splits x batch x heads x seqlen_q fp32], each part 256-byte aligned;
//              the parts exist only when splits > 1
#pragma once

#include <math.h>
#include <stdint.h>

#include "decode_params.h"
#include "score_check.h"

namespace fg {

inline bool dec_aligned(const void* ptr, uintptr_t n) {
  return reinterpret_cast<uintptr_t>(ptr) % n == 0;
}
inline int64_t dec_round256(int64_t n) { return (n + 255) / 256 * 256; }
constexpr int64_t kDecodeErrorBytes = 256;

// The split heuristic: no split when the CTAs already fill 80% of the target; otherwise as
// many splits as reach the target, at most 128 and the key tiles. The target is
// `ctas_per_sm` CTAs on each SM, or every resident slot when it is 0, and never more than
// the slots. Measured on the H200 (docs/benchmarks.md, "Decode v3" and "FP8 decode v3"):
// - a contiguous 16-bit cache's cp.async chunks stream best with one CTA per SM (batch 1,
//   8 KV heads, 16 splits: 3.9 TB/s at 128k, 1.5 TB/s at 4k; 33 splits, two per SM: 3.8
//   and 1.2; FlashAttention's wave-efficiency rule picked 29, 1.76 per SM: 3.5);
// - a paged cache's bulk row copies want every slot (33 splits: 3.7 TB/s at 128k; 16: 2.3),
//   and so do FP8 paged caches (batch 16, d 128: 2 splits 0.23 ms, 1 split 0.38);
// - a contiguous FP8 cache wants two CTAs per SM (batch 8, d 128, 16k: 4 splits 0.077 ms,
//   2 splits 0.096; every slot, d 64: 6 splits, 2-8% slower than 2).
// The 80% rule counts against the target, so a paged grid of one CTA per SM splits too
// (batch 16: 1.7x faster than unsplit).
// generator/families/decode.py:num_splits mirrors it (tested).
inline int64_t decode_num_splits(int64_t ctas, int64_t key_tiles, int64_t sms, int64_t slots,
                                 int64_t ctas_per_sm) {
  if (ctas <= 0 || key_tiles <= 1 || sms <= 0 || slots <= 0 || ctas_per_sm < 0) return 1;
  const int64_t target =
      ctas_per_sm == 0 || slots < ctas_per_sm * sms ? slots : ctas_per_sm * sms;
  if (ctas * 5 >= target * 4) return 1;
  int64_t s = target / ctas;
  if (s > key_tiles) s = key_tiles;
  if (s > 128) s = 128;
  return s < 1 ? 1 : s;
}

// The heuristic's CTAs per SM for a kernel (0: every resident slot), as measured above.
template <class C>
constexpr int64_t decode_split_ctas_per_sm() {
  return C::kPaged ? 0 : C::kKvFp8 ? 2 : 1;
}

template <class C>
int64_t decode_capacity(const fg_decode_params& p) {
  return C::kPaged ? p.max_pages * p.page_size : p.seqlen_k;
}

template <class C>
int64_t decode_row_tiles(const fg_decode_params& p) {
  if (p.kv_heads < 1) return 0;
  return (p.seqlen_q * (p.heads / p.kv_heads) + C::kBlockM - 1) / C::kBlockM;
}

// The split count a launch uses: the caller's, else the heuristic's.
template <class C>
int64_t decode_splits(const fg_decode_params& p, int64_t sms, int64_t slots) {
  if (p.num_splits > 0) return p.num_splits;
  const int64_t cap = decode_capacity<C>(p);
  const int64_t bound = p.max_seqlen_k > 0 && p.max_seqlen_k < cap ? p.max_seqlen_k : cap;
  const int64_t key_tiles = (bound + C::kBlockN - 1) / C::kBlockN;
  return decode_num_splits(decode_row_tiles<C>(p) * p.kv_heads * p.batch, key_tiles, sms, slots,
                           decode_split_ctas_per_sm<C>());
}

template <class C>
int64_t decode_o_parts_bytes(const fg_decode_params& p, int64_t splits) {
  return splits > 1 ? dec_round256(splits * p.batch * p.seqlen_q * p.heads * C::kHeadDim * 4) : 0;
}

template <class C>
int64_t decode_workspace_bytes(const fg_decode_params& p, int64_t splits) {
  const int64_t lse = splits > 1 ? dec_round256(splits * p.batch * p.heads * p.seqlen_q * 4) : 0;
  return kDecodeErrorBytes + decode_o_parts_bytes<C>(p, splits) + lse;
}

// Points the merge fields at the workspace's parts (contiguous layouts above).
template <class C>
void decode_use_workspace_parts(fg_decode_params& q, int64_t splits) {
  char* ws = static_cast<char*>(q.workspace);
  q.num_splits = splits;
  q.o_parts = ws + kDecodeErrorBytes;
  q.lse_parts = reinterpret_cast<const float*>(ws + kDecodeErrorBytes +
                                               decode_o_parts_bytes<C>(q, splits));
  q.num_parts = splits;
  q.parts_dtype = 0;
  q.o_parts_head_stride = C::kHeadDim;
  q.o_parts_row_stride = q.heads * C::kHeadDim;
  q.o_parts_batch_stride = q.seqlen_q * q.o_parts_row_stride;
  q.o_parts_part_stride = q.batch * q.o_parts_batch_stride;
  q.lse_parts_head_stride = q.seqlen_q;
  q.lse_parts_batch_stride = q.heads * q.seqlen_q;
  q.lse_parts_part_stride = q.batch * q.lse_parts_batch_stride;
}

// Checks shared by the decode call and merge_states: the output and the sizes.
template <class C>
const char* check_decode_output(const fg_decode_params& p) {
  if (!p.o) return "o must be non-null";
  if (!dec_aligned(p.o, 16)) return "o must be 16-byte aligned";
  if (p.o_batch_stride % 8 || p.o_row_stride % 8 || p.o_head_stride % 8)
    return "o strides must be multiples of 8 elements (16 bytes)";
  if (p.lse && !dec_aligned(p.lse, 4)) return "lse must be 4-byte aligned (or NULL)";
  if (p.batch < 0) return "batch must be >= 0";
  if (p.heads < 1 || p.kv_heads < 1) return "heads and kv_heads must be >= 1";
  if (C::kInstrumentIo && (!p.io_counters || !dec_aligned(p.io_counters, 8)))
    return "instrument_io needs 9 8-byte aligned uint64 io_counters";
  return nullptr;
}

// FP8 caches (C::kKvFp8, spec kv_dtype: e4m3): both descales given (fp32, (batch, kv_heads)
// with the given strides; strides 0 broadcast a per-tensor scalar), and K/V strides in whole
// 16-byte chunks (16 elements). Other kernels take no descales.
template <class C>
const char* check_kv_descale(const fg_decode_params& p) {
  if (!C::kKvFp8)
    return p.k_descale || p.v_descale
               ? "k_descale / v_descale are for FP8 caches (spec kv_dtype: e4m3); this kernel's "
                 "K/V have the q dtype: pass NULL"
               : nullptr;
  if (!p.k_descale || !p.v_descale)
    return "FP8 cache (kv_dtype e4m3): k_descale and v_descale (float32, batch x kv_heads, or "
           "strides 0 for a per-tensor scalar) must be non-null";
  if (!dec_aligned(p.k_descale, 4) || !dec_aligned(p.v_descale, 4))
    return "k_descale and v_descale must be 4-byte aligned float32 arrays";
  if (p.k_descale_batch_stride < 0 || p.k_descale_head_stride < 0 ||
      p.v_descale_batch_stride < 0 || p.v_descale_head_stride < 0)
    return "k_descale / v_descale strides must be >= 0 (0: broadcast)";
  const int64_t kv_strides[] = {p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                p.v_batch_stride, p.v_row_stride, p.v_head_stride};
  for (int64_t s : kv_strides)
    if (s % 16 != 0) return "FP8 cache: k/v strides must be multiples of 16 elements (16 bytes)";
  return nullptr;
}

// Returns nullptr when the parameters are acceptable, else what is wrong and what is allowed.
template <class C>
const char* check_decode_params(const fg_decode_params& p, int64_t splits) {
  if (!p.q || !p.k || !p.v) return "q, k and v must all be non-null";
  if (!p.cache_seqlens) return "cache_seqlens (int32, one per sequence) must be non-null";
  if (!p.workspace)
    return "workspace must be non-null (<name>_workspace_bytes(&p) bytes; its first word "
           "is the error flag)";
  if (!dec_aligned(p.q, 16) || !dec_aligned(p.k, 16) || !dec_aligned(p.v, 16))
    return "q, k and v must be 16-byte aligned";
  if (!dec_aligned(p.workspace, 16)) return "workspace must be 16-byte aligned";
  if (!dec_aligned(p.cache_seqlens, 4)) return "cache_seqlens must be a 4-byte aligned int32 array";
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride,  p.q_head_stride,
                             p.k_batch_stride, p.k_row_stride,  p.k_head_stride,
                             p.v_batch_stride, p.v_row_stride,  p.v_head_stride};
  for (int64_t s : strides)
    if (s % 8 != 0)
      return "q/k/v strides must be multiples of 8 elements (16 bytes; paged: the page stride too)";
  if (const char* why = check_decode_output<C>(p)) return why;
  if (C::kGqa ? p.heads % p.kv_heads != 0 : p.kv_heads != p.heads)
    return C::kGqa ? "kv_heads must divide heads" : "kv_heads must equal heads (spec has gqa: false)";
  if (p.seqlen_q < 1 || p.seqlen_q > kDecodeMaxQueries)
    return "seqlen_q (queries per sequence) must be in 1..16";
  if (C::kPaged) {
    if (!p.block_table) return "paged: block_table (int32, batch x max_pages) must be non-null";
    if (!dec_aligned(p.block_table, 4)) return "paged: block_table must be 4-byte aligned";
    if (p.page_size < 16 || p.page_size > 256 || (p.page_size & (p.page_size - 1)))
      return "paged: page_size must be a power of two in 16..256";
    if (p.num_pages < 1) return "paged: num_pages must be >= 1";
    if (p.max_pages < 0 || p.block_table_stride < p.max_pages)
      return "paged: max_pages must be >= 0 and block_table_stride >= max_pages";
    if (p.max_pages > INT32_MAX / p.page_size)
      return "paged: max_pages * page_size must stay below 2^31 keys";
  } else if (p.seqlen_k < 0 || p.seqlen_k > INT32_MAX) {
    return "seqlen_k (the contiguous cache's capacity) must be in 0..2^31-1";
  }
  if (p.max_seqlen_k < 0) return "max_seqlen_k must be >= 0 (0: the cache's capacity)";
  if (!(p.softmax_scale > 0.0) || !isfinite(p.softmax_scale))
    return "softmax_scale must be finite and > 0";
  if (C::kWindow && (p.window_left < -1 || p.window_right < -1))
    return "window sizes must be >= 0, or -1 for unbounded";
  if (p.num_splits < 0 || p.num_splits > kDecodeMaxSplits)
    return "num_splits must be 0 (the heuristic) or 1..128";
  if (p.workspace_size < decode_workspace_bytes<C>(p, splits))
    return "workspace_size is below <name>_workspace_bytes(&p)";
  // Each factor is below 2^31 before the product is formed, so it cannot overflow.
  const int64_t mts = decode_row_tiles<C>(p);
  if (p.batch > INT32_MAX || p.heads > INT32_MAX || mts * splits > INT32_MAX ||
      mts * splits * p.kv_heads > INT32_MAX || mts * splits * p.kv_heads * p.batch > INT32_MAX)
    return "grid too large: row tiles * splits * kv_heads * batch > 2^31-1";
  if (const char* why = check_kv_descale<C>(p)) return why;
  return check_score_params<C>(p.score, /*backward=*/false);  // score_check.h
}

template <class C>
int64_t decode_grid(const fg_decode_params& p, int64_t splits) {
  return decode_row_tiles<C>(p) * splits * p.kv_heads * p.batch;
}

template <class C>
const char* check_merge_params(const fg_decode_params& p) {
  if (!p.o_parts || !p.lse_parts) return "merge_states needs o_parts and lse_parts";
  if (!dec_aligned(p.o_parts, 16)) return "o_parts must be 16-byte aligned";
  if (!dec_aligned(p.lse_parts, 4)) return "lse_parts must be 4-byte aligned";
  if (p.parts_dtype != 0 && p.parts_dtype != 1)
    return "parts_dtype must be 0 (float32 o_parts) or 1 (the kernel's dtype)";
  const int64_t vec = p.parts_dtype == 0 ? 4 : 8;  // elements in 16 bytes
  if (p.o_parts_part_stride % vec || p.o_parts_batch_stride % vec ||
      p.o_parts_row_stride % vec || p.o_parts_head_stride % vec)
    return "o_parts strides must be multiples of 16 bytes (4 float32 or 8 fp16/bf16 elements)";
  if (p.num_parts < 1) return "num_parts must be >= 1";
  if (p.seqlen_q < 0) return "seqlen_q must be >= 0";
  if (const char* why = check_decode_output<C>(p)) return why;
  const int64_t rows_per_cta = C::kCombineRows;
  if (p.batch > INT32_MAX || p.seqlen_q > INT32_MAX || p.heads > INT32_MAX ||
      p.batch * p.seqlen_q > INT32_MAX ||
      (p.batch * p.seqlen_q * p.heads + rows_per_cta - 1) / rows_per_cta > INT32_MAX)
    return "merge grid too large: batch * seqlen_q * heads rows";
  return nullptr;
}

template <class C>
int64_t combine_grid(const fg_decode_params& p) {
  return (p.batch * p.seqlen_q * p.heads + C::kCombineRows - 1) / C::kCombineRows;
}

}  // namespace fg
