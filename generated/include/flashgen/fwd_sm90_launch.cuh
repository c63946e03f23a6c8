// flashgen: host side of the Hopper forward's launcher: TMA's rules as argument checks, and the
// call's tensor maps, cached per kernel by call shape.
//
// Glossary
//   MapKey   what a call's maps depend on: the q, k, v addresses, sizes and strides
//   varlen   the maps span the packed (total, heads, d) tensors as one batch entry of total_q
//            (q) or total_k (k, v) rows: fg_fwd_params carries those totals because the
//            cu_seqlens are on the device; the batch stride is unused (the check ignores it)
//   cache    the last calls' maps of one kernel (sm90_cache.h, shared with the backward)
#pragma once

#include <stdint.h>

#include "fwd_sm90_kernel.cuh"
#include "params.h"
#include "sm90_cache.h"
#include "sm90_host.h"

namespace fg {

// The batch stride a map gets (the check and the map share it): sm90::map_batch_stride.
template <class C>
int64_t fwd_sm90_batch_stride(int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                              int64_t total, int64_t heads) {
  return sm90::map_batch_stride(C::kVarlen, batch_stride, row_stride, head_stride, total, heads);
}

// TMA's rules on q, k, v (fg_fwd_params' strides are in elements), and varlen's packed totals
// (sm90::varlen_totals_problem): nullptr or the problem.
template <class C>
const char* check_fwd_sm90_params(const fg_fwd_params& p) {
  if (p.batch == 0 || p.seqlen_q == 0) return nullptr;  // nothing is loaded
  if (C::kVarlen)
    if (const char* m = sm90::varlen_totals_problem(p.total_q, p.total_k, p.seqlen_q, p.seqlen_k))
      return m;
  if (const char* m = sm90::tmap_bshd_problem(
          p.q, fwd_sm90_batch_stride<C>(p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                                   p.total_q, p.heads),
          p.q_row_stride, p.q_head_stride, C::kBlockM))
    return m;
  if (const char* m = sm90::tmap_bshd_problem(
          p.k, fwd_sm90_batch_stride<C>(p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                   p.total_k, p.kv_heads),
          p.k_row_stride, p.k_head_stride, C::kBlockN))
    return m;
  if (const char* m = sm90::tmap_bshd_problem(
          p.v, fwd_sm90_batch_stride<C>(p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                                   p.total_k, p.kv_heads),
          p.v_row_stride, p.v_head_stride, C::kBlockN))
    return m;
  if ((p.k_head_stride < p.k_row_stride) != (p.v_head_stride < p.v_row_stride))
    return "k and v must order their strides alike (head stride below or above row stride)";
  return nullptr;
}

struct FwdSm90MapKey {
  const void *q, *k, *v;
  int64_t batch, seqlen_q, seqlen_k, total_q, total_k, heads, kv_heads, strides[9];
};

// The call's maps (from the kernel's cache when this shape and these buffers were seen).
template <class C, bool kBf16>
const char* fwd_sm90_maps(const fg_fwd_params& p, FwdSm90Maps* maps) {
  static sm90::MapCache<FwdSm90MapKey, FwdSm90Maps> cache;
  // Varlen maps are one batch entry of the packed totals (the key keeps every size anyway).
  const int64_t total_q = C::kVarlen ? p.total_q : 0, total_k = C::kVarlen ? p.total_k : 0;
  const FwdSm90MapKey key{p.q, p.k, p.v, p.batch, p.seqlen_q, p.seqlen_k, total_q, total_k,
                          p.heads, p.kv_heads,
                          {p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.k_batch_stride,
                           p.k_row_stride, p.k_head_stride, p.v_batch_stride, p.v_row_stride,
                           p.v_head_stride}};  // no padding: compared bytewise
  if (cache.find(key, maps)) return nullptr;
  bool q_inner = false, k_inner = false, v_inner = false;
  const int64_t batch = C::kVarlen ? 1 : p.batch;
  const int64_t rows_q = C::kVarlen ? p.total_q : p.seqlen_q;
  const int64_t rows_k = C::kVarlen ? p.total_k : p.seqlen_k;
  if (const char* msg = sm90::make_tmap_bshd(
          &maps->q, &q_inner, p.q, kBf16, batch, rows_q, p.heads, C::kHeadDim,
          fwd_sm90_batch_stride<C>(p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                                   p.total_q, p.heads),
          p.q_row_stride, p.q_head_stride, C::kBlockM))
    return msg;
  if (const char* msg = sm90::make_tmap_bshd(
          &maps->k, &k_inner, p.k, kBf16, batch, rows_k, p.kv_heads, C::kHeadDim,
          fwd_sm90_batch_stride<C>(p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                                   p.total_k, p.kv_heads),
          p.k_row_stride, p.k_head_stride, C::kBlockN))
    return msg;
  if (const char* msg = sm90::make_tmap_bshd(
          &maps->v, &v_inner, p.v, kBf16, batch, rows_k, p.kv_heads, C::kHeadDimV,
          fwd_sm90_batch_stride<C>(p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                                   p.total_k, p.kv_heads),
          p.v_row_stride, p.v_head_stride, C::kBlockN))
    return msg;
  if (k_inner != v_inner)
    return "k and v must order their strides alike (head stride below or above row stride)";
  maps->q_heads_inner = q_inner;
  maps->kv_heads_inner = k_inner;
  cache.put(key, *maps);
  return nullptr;
}

}  // namespace fg
