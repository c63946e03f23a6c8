// flashgen: one warp's two attention products on mma.sync, shared by the forward and decode
// mainloops (the forward's inner loop, factored out so that decode reuses it instead of a copy).
//
// Glossary (arch.cuh for the fragment layouts)
//   kMT        m16 tiles of query rows the warp owns
//   kNT        n8 tiles of keys in the warp's share of a K/V tile (S = Q K^T is kMT x kNT)
//   kKS        k16 steps over the head dim (Q K^T); kDT n8 tiles of the head dim (P V)
//   kStride    smem row stride of the K and V tiles, elements
//   k_addr     per-lane shared address of the first ldmatrix of the warp's K rows (a
//              LaneOffsets `b` position); v_addr the same for V (an `a` position, .trans)
//   load_a     load_a(mt, kk, a): the A fragment of m16 tile mt, k16 step kk of Q (from
//              registers or smem, the caller's choice)
// P is taken straight from the S accumulators: the m16n8 C layout of two adjacent n8 tiles is
// the m16k16 A layout, so P never goes through shared memory.
#pragma once

#include <stdint.h>

#include "arch.cuh"

namespace fg {

// acc_s += Q K^T over the head dim.
template <typename Elem, int kMT, int kNT, int kKS, int kStride, class LoadA>
__device__ __forceinline__ void warp_qk(float (&acc_s)[kMT][kNT][4], LoadA&& load_a,
                                        uint32_t k_addr) {
  constexpr uint32_t kElemBytes = sizeof(Elem);
#pragma unroll
  for (int kk = 0; kk < kKS; ++kk) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) load_a(mt, kk, a[mt]);
#pragma unroll
    for (int np = 0; np < kNT / 2; ++np) {
      uint32_t bk[4];
      ldmatrix_x4(bk, k_addr + (np * 16 * kStride + kk * 16) * kElemBytes);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        Mma<Elem>::run(acc_s[mt][2 * np], a[mt], bk[0], bk[1]);
        Mma<Elem>::run(acc_s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
      }
    }
  }
}

// acc_o += P V, P (kMT x kNT, fp32) re-packed to Elem from the S accumulators.
template <typename Elem, int kMT, int kNT, int kDT, int kStride>
__device__ __forceinline__ void warp_pv(float (&acc_o)[kMT][kDT][4],
                                        const float (&p)[kMT][kNT][4], uint32_t v_addr) {
  using MmaT = Mma<Elem>;
  constexpr uint32_t kElemBytes = sizeof(Elem);
#pragma unroll
  for (int ks = 0; ks < kNT / 2; ++ks) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      a[mt][0] = MmaT::pack(p[mt][2 * ks][0], p[mt][2 * ks][1]);
      a[mt][1] = MmaT::pack(p[mt][2 * ks][2], p[mt][2 * ks][3]);
      a[mt][2] = MmaT::pack(p[mt][2 * ks + 1][0], p[mt][2 * ks + 1][1]);
      a[mt][3] = MmaT::pack(p[mt][2 * ks + 1][2], p[mt][2 * ks + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < kDT / 2; ++dp) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, v_addr + (ks * 16 * kStride + dp * 16) * kElemBytes);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        MmaT::run(acc_o[mt][2 * dp], a[mt], bv[0], bv[1]);
        MmaT::run(acc_o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
      }
    }
  }
}

// The two rows of one m16 tile of acc_o scaled by the softmax's alpha (row g, row g + 8).
template <int kDT>
__device__ __forceinline__ void scale_rows(float (&acc)[kDT][4], const float (&alpha)[2]) {
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
    acc[dt][0] *= alpha[0];
    acc[dt][1] *= alpha[0];
    acc[dt][2] *= alpha[1];
    acc[dt][3] *= alpha[1];
  }
}

}  // namespace fg
