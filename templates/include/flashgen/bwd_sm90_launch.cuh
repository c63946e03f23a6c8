// flashgen: host side of the Hopper backward's launcher: TMA's rules as argument checks, and
// the call's tensor maps (q, k, v, dout, dq_accum), cached per kernel by call shape and
// buffers (sm90_cache.h). Varlen: the maps of q, k, v and dout span the packed tensors as one
// batch entry of total_q or total_k rows (fg_bwd_params carries the totals, as the forward's),
// and dq_accum's stays dense (batch, seqlen_q rows: bwd_kernel.cuh's dq_accum_row).
#pragma once

#include <stdint.h>

#include "bwd_params.h"
#include "bwd_sm90_kernel.cuh"
#include "sm90_cache.h"
#include "sm90_host.h"

namespace fg {

// The batch stride the map of a loaded tensor gets (the check and the map share it).
template <class C>
int64_t bwd_sm90_batch_stride(int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                              int64_t total, int64_t heads) {
  return sm90::map_batch_stride(C::kVarlen, batch_stride, row_stride, head_stride, total, heads);
}

// TMA's rules on the four tensors it loads (strides in elements), and varlen's packed totals:
// nullptr or the problem.
template <class C>
const char* check_bwd_sm90_params(const fg_bwd_params& p) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) return nullptr;  // nothing is loaded
  if (C::kVarlen)
    if (const char* m = sm90::varlen_totals_problem(p.total_q, p.total_k, p.seqlen_q, p.seqlen_k))
      return m;
  constexpr int64_t kLimit = (int64_t{1} << 31) - 256;  // a tile's last row stays below 2^31
  if (p.seqlen_q >= kLimit || p.seqlen_k >= kLimit || p.heads >= kLimit || p.batch >= kLimit)
    return "seqlen_q, seqlen_k, heads and batch must be below 2^31 - 256 (TMA coordinates and "
           "the walk's rows are 32-bit)";
  if (C::kDeterministic &&
      p.batch * p.heads * ((p.seqlen_q + C::kBlockM - 1) / C::kBlockM) >= (int64_t{1} << 31))
    return "deterministic: batch * heads * ceil(seqlen_q / block_m) must be below 2^31 (the "
           "dq_sem counters are indexed in 32 bits)";
  struct Tensor {
    const void* base;
    int64_t batch_stride, row_stride, head_stride, total, heads;
    int box_rows;
  };
  const Tensor tensors[] = {
      {p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.total_q, p.heads, C::kBlockM},
      {p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, p.total_k, p.kv_heads, C::kBlockN},
      {p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, p.total_k, p.kv_heads, C::kBlockN},
      {p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride, p.total_q, p.heads,
       C::kBlockM}};
  for (const Tensor& t : tensors)
    if (const char* m = sm90::tmap_bshd_problem(
            t.base,
            bwd_sm90_batch_stride<C>(t.batch_stride, t.row_stride, t.head_stride, t.total,
                                     t.heads),
            t.row_stride, t.head_stride, t.box_rows))
      return m;
  if ((p.k_head_stride < p.k_row_stride) != (p.v_head_stride < p.v_row_stride))
    return "k and v must order their strides alike (head stride below or above row stride)";
  return nullptr;
}

// dq_accum (batch * seqlen_q rows, heads, d; fp32) as the map (d, heads, seqlen_q, batch) in
// SW128 boxes of 32 columns (128 bytes) x 1 head x block_m rows x 1 batch: the dQ writer adds
// the step's tile through it, and the map's bounds drop rows past seqlen_q and columns past d.
template <class C>
const char* make_tmap_dq_accum(CUtensorMap* map, const fg_bwd_params& p) {
  sm90::EncodeTiledFn fn = sm90::encode_tiled_fn();
  if (!fn) return "cuTensorMapEncodeTiled is not available (driver too old for TMA)";
  auto at_least_1 = [](int64_t x) { return static_cast<cuuint64_t>(x < 1 ? 1 : x); };
  const cuuint64_t d = C::kHeadDim, h = at_least_1(p.heads), sq = at_least_1(p.seqlen_q);
  const cuuint64_t dims[4] = {d, h, sq, at_least_1(p.batch)};
  const cuuint64_t strides[3] = {d * 4, h * d * 4, sq * h * d * 4};  // bytes
  const cuuint32_t box[4] = {32, 1, static_cast<cuuint32_t>(C::kBlockM), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return sm90::encode(fn, map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, p.dq_accum, dims, strides,
                      box, elem_strides);
}

struct BwdSm90MapKey {
  const void *q, *k, *v, *dout, *dq_accum;
  int64_t batch, seqlen_q, seqlen_k, total_q, total_k, heads, kv_heads, strides[12];
};

// The call's maps (from the kernel's cache when this shape and these buffers were seen).
template <class C, bool kBf16>
const char* bwd_sm90_maps(const fg_bwd_params& p, BwdSm90Maps* maps) {
  static sm90::MapCache<BwdSm90MapKey, BwdSm90Maps> cache;
  // Varlen maps are one batch entry of the packed totals (the key keeps every size anyway).
  const int64_t total_q = C::kVarlen ? p.total_q : 0, total_k = C::kVarlen ? p.total_k : 0;
  const BwdSm90MapKey key{p.q, p.k, p.v, p.dout, C::kDqTma ? p.dq_accum : nullptr, p.batch,
                          p.seqlen_q, p.seqlen_k, total_q, total_k, p.heads, p.kv_heads,
                          {p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.k_batch_stride,
                           p.k_row_stride, p.k_head_stride, p.v_batch_stride, p.v_row_stride,
                           p.v_head_stride, p.do_batch_stride, p.do_row_stride,
                           p.do_head_stride}};  // no padding: compared bytewise
  if (cache.find(key, maps)) return nullptr;
  bool q_inner = false, k_inner = false, v_inner = false, do_inner = false;
  const int64_t batch = C::kVarlen ? 1 : p.batch;
  const int64_t rows_q = C::kVarlen ? p.total_q : p.seqlen_q;
  const int64_t rows_k = C::kVarlen ? p.total_k : p.seqlen_k;
  auto bstride = [](int64_t batch_stride, int64_t row_stride, int64_t head_stride, int64_t total,
                    int64_t heads) {
    return bwd_sm90_batch_stride<C>(batch_stride, row_stride, head_stride, total, heads);
  };
  if (const char* m = sm90::make_tmap_bshd(
          &maps->q, &q_inner, p.q, kBf16, batch, rows_q, p.heads, C::kHeadDim,
          bstride(p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.total_q, p.heads),
          p.q_row_stride, p.q_head_stride, C::kBlockM))
    return m;
  if (const char* m = sm90::make_tmap_bshd(
          &maps->k, &k_inner, p.k, kBf16, batch, rows_k, p.kv_heads, C::kHeadDim,
          bstride(p.k_batch_stride, p.k_row_stride, p.k_head_stride, p.total_k, p.kv_heads),
          p.k_row_stride, p.k_head_stride, C::kBlockN))
    return m;
  if (const char* m = sm90::make_tmap_bshd(
          &maps->v, &v_inner, p.v, kBf16, batch, rows_k, p.kv_heads, C::kHeadDim,
          bstride(p.v_batch_stride, p.v_row_stride, p.v_head_stride, p.total_k, p.kv_heads),
          p.v_row_stride, p.v_head_stride, C::kBlockN))
    return m;
  if (const char* m = sm90::make_tmap_bshd(
          &maps->dout, &do_inner, p.dout, kBf16, batch, rows_q, p.heads, C::kHeadDim,
          bstride(p.do_batch_stride, p.do_row_stride, p.do_head_stride, p.total_q, p.heads),
          p.do_row_stride, p.do_head_stride, C::kBlockM))
    return m;
  if (k_inner != v_inner)
    return "k and v must order their strides alike (head stride below or above row stride)";
  if constexpr (C::kDqTma)
    if (const char* m = make_tmap_dq_accum<C>(&maps->dq_accum, p)) return m;
  maps->q_heads_inner = q_inner;
  maps->kv_heads_inner = k_inner;
  maps->do_heads_inner = do_inner;
  cache.put(key, *maps);
  return nullptr;
}

}  // namespace fg
