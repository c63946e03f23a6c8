// flashgen: host side of the Hopper forward's launcher: TMA's rules as argument checks, and the
// call's tensor maps, cached per kernel by call shape.
//
// Glossary
//   MapKey   what a call's maps depend on: the q, k, v addresses, sizes and strides
//   cache    the last kSlots calls' maps of one kernel (a mutex guards it): a training loop or
//            a decode server repeats its shapes and buffers, and an encode costs microseconds
#pragma once

#include <stdint.h>
#include <string.h>

#include <mutex>

#include "fwd_sm90_kernel.cuh"
#include "params.h"
#include "sm90_host.h"

namespace fg {

// TMA's rules on q, k, v (fg_fwd_params' strides are in elements): nullptr or the problem.
template <class C>
const char* check_fwd_sm90_params(const fg_fwd_params& p) {
  if (p.batch == 0 || p.seqlen_q == 0) return nullptr;  // nothing is loaded
  if (const char* m = sm90::tmap_bshd_problem(p.q, p.q_batch_stride, p.q_row_stride,
                                              p.q_head_stride, C::kBlockM))
    return m;
  if (const char* m = sm90::tmap_bshd_problem(p.k, p.k_batch_stride, p.k_row_stride,
                                              p.k_head_stride, C::kBlockN))
    return m;
  if (const char* m = sm90::tmap_bshd_problem(p.v, p.v_batch_stride, p.v_row_stride,
                                              p.v_head_stride, C::kBlockN))
    return m;
  if ((p.k_head_stride < p.k_row_stride) != (p.v_head_stride < p.v_row_stride))
    return "k and v must order their strides alike (head stride below or above row stride)";
  return nullptr;
}

struct FwdSm90MapKey {
  const void *q, *k, *v;
  int64_t batch, seqlen_q, seqlen_k, heads, kv_heads, strides[9];
};

// The call's maps (from the kernel's cache when this shape and these buffers were seen).
template <class C, bool kBf16>
const char* fwd_sm90_maps(const fg_fwd_params& p, FwdSm90Maps* maps) {
  constexpr int kSlots = 8;
  static std::mutex mu;
  static FwdSm90MapKey keys[kSlots];
  static FwdSm90Maps cached[kSlots];
  static int used = 0, next = 0;
  const FwdSm90MapKey key{p.q, p.k, p.v, p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.kv_heads,
                      {p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.k_batch_stride,
                       p.k_row_stride, p.k_head_stride, p.v_batch_stride, p.v_row_stride,
                       p.v_head_stride}};  // no padding: compared bytewise
  {
    std::lock_guard<std::mutex> lock(mu);
    for (int i = 0; i < used; ++i)
      if (memcmp(&keys[i], &key, sizeof key) == 0) {
        *maps = cached[i];
        return nullptr;
      }
  }
  bool q_inner = false, k_inner = false, v_inner = false;
  if (const char* msg = sm90::make_tmap_bshd(&maps->q, &q_inner, p.q, kBf16, p.batch, p.seqlen_q,
                                             p.heads, C::kHeadDim, p.q_batch_stride,
                                             p.q_row_stride, p.q_head_stride, C::kBlockM))
    return msg;
  if (const char* msg = sm90::make_tmap_bshd(&maps->k, &k_inner, p.k, kBf16, p.batch, p.seqlen_k,
                                             p.kv_heads, C::kHeadDim, p.k_batch_stride,
                                             p.k_row_stride, p.k_head_stride, C::kBlockN))
    return msg;
  if (const char* msg = sm90::make_tmap_bshd(&maps->v, &v_inner, p.v, kBf16, p.batch, p.seqlen_k,
                                             p.kv_heads, C::kHeadDim, p.v_batch_stride,
                                             p.v_row_stride, p.v_head_stride, C::kBlockN))
    return msg;
  if (k_inner != v_inner)
    return "k and v must order their strides alike (head stride below or above row stride)";
  maps->q_heads_inner = q_inner;
  maps->kv_heads_inner = k_inner;
  std::lock_guard<std::mutex> lock(mu);
  keys[next] = key;
  cached[next] = *maps;
  next = (next + 1) % kSlots;
  if (used < kSlots) ++used;
  return nullptr;
}

}  // namespace fg
