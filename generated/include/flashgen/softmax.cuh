// flashgen: online softmax state of one thread's rows.
//
// Glossary
//   m_i   running max of the scaled scores of row i, in the log2 domain (s * scale * log2 e)
//   l_i   running sum of 2^(s * scale * log2 e - m_i) over this thread's columns; the 4 lanes
//         of a quad hold disjoint columns of the same row and are summed once, at the end
//   alpha 2^(m_old - m_new): the factor that rescales acc and l when the max grows
// Why log2: ex2.approx is one SFU instruction; log2 e is folded into the scale once.
// The -inf guard: a row with no visible key yet has m = -inf; it uses 0 as its base so that
// 2^(-inf - base) = 0 and no NaN (-inf - -inf) is ever formed.
#pragma once

#include <math.h>

#include "arch.cuh"

namespace fg {

struct RowState {
  float m = -INFINITY;
  float l = 0.f;
};

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Folds one tile of raw scores into the state of the thread's two rows (frag C rows g and
// g + 8: elements 0,1 and 2,3 of each n8 tile) and turns the scores into p = 2^(s' - m).
// Writes alpha per row: the factor the caller applies to that row's accumulator.
template <int kNT>
__device__ __forceinline__ void online_softmax_update(RowState (&st)[2], float (&s)[kNT][4],
                                                      float scale_log2, float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    mx = __fmul_rn(quad_max(mx), scale_log2);
    const float m_new = fmaxf(st[r].m, mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = exp2_approx(st[r].m - base);
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        // Rounded multiply, then subtract (not one fma): the row's max gives 2^0 = 1 exactly,
        // so a one-key or one-hot row returns its V row bit for bit.
        s[nt][e] = exp2_approx(__fsub_rn(__fmul_rn(s[nt][e], scale_log2), base));
        sum += s[nt][e];
      }
    }
    st[r].m = m_new;
    st[r].l = st[r].l * alpha[r] + sum;
  }
}

// Final (1 / l, natural-log LSE) of a row; a row that saw no visible key gives (0, -inf).
__device__ __forceinline__ void online_softmax_finalize(const RowState& st, float& inv_l,
                                                        float& lse) {
  const float l = quad_sum(st.l);
  const bool empty = !(l > 0.f);
  inv_l = empty ? 0.f : 1.f / l;
  lse = empty ? -INFINITY : (st.m + log2f(l)) * 0.69314718055994530942f;
}

}  // namespace fg
