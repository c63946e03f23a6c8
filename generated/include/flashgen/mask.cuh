// flashgen: mask policies, shared by every family.
//
// Glossary (docs/conventions.md, "Masks" and "Tile schedule")
//   shift   0 for top_left alignment, Sk - Sq for bottom_right
//   L, R    sliding-window sizes left/right of the diagonal, -1 = unbounded
//   r0, r1  first and last valid query row of the CTA's tile
//   n_lo, n_hi  the K/V tiles [n_lo, n_hi) a dense forward CTA visits
//   m_lo, m_hi  the query tiles [m_lo, m_hi) a dense backward CTA visits
//
// Every policy answers three questions: which K/V tiles can hold a visible key (the schedule),
// which of those need element-wise masking (the rest run the unmasked path), and, per tile,
// whether key j is visible from query i. A new mask kind is one new set of answers here.
#pragma once

#include <stdint.h>

namespace fg {

enum class Causal { kNone, kTopLeft, kBottomRight };

__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

struct TileMask {
  int col_end, lo, hi;
  __device__ __forceinline__ bool visible(int il, int jl) const {
    const int dj = jl - il;
    return jl < col_end && dj >= lo && dj <= hi;
  }
};

template <Causal kCausal, bool kWindow>
struct MaskPolicy {
  int64_t sq, sk, shift, left, right;

  __device__ __forceinline__ MaskPolicy(int64_t sq_, int64_t sk_, int64_t left_, int64_t right_)
      : sq(sq_), sk(sk_),
        // A window without causal is bottom_right aligned, as in FlashAttention-2.
        shift(kCausal == Causal::kTopLeft ? 0 : sk_ - sq_),
        // Window sizes beyond Sq + Sk mean the same as that bound; clamping keeps every sum
        // below far from int64 overflow.
        left(kWindow && left_ >= 0 ? min(left_, sq_ + sk_) : -1),
        right(kWindow && right_ >= 0 ? min(right_, sq_ + sk_) : -1) {}

  // The rules restricted to one tile, in int32 offsets from its corner (i0, j0): visible iff
  // jl < col_end and lo <= jl - il <= hi. Built once per tile, so the per-element test is
  // three integer compares instead of 64-bit arithmetic.
  __device__ __forceinline__ TileMask tile(int64_t i0, int64_t j0) const {
    const int64_t big = 1 << 30;
    const int64_t diag = i0 + shift - j0;  // jl - il == diag is the diagonal
    int64_t hi = big, lo = -big;
    if (kCausal != Causal::kNone) hi = diag;
    if (kWindow && right >= 0) hi = min(hi, diag + right);
    if (kWindow && left >= 0) lo = diag - left;
    auto clamp = [&](int64_t x) { return static_cast<int>(max(-big, min(big, x))); };
    return TileMask{clamp(sk - j0), clamp(lo), clamp(hi)};
  }

  // K/V tiles that can hold a visible key for rows [r0, r1].
  __device__ __forceinline__ void tile_range(int64_t r0, int64_t r1, int block_n, int64_t& n_lo,
                                             int64_t& n_hi) const {
    n_lo = 0;
    n_hi = (sk + block_n - 1) / block_n;
    if (kCausal != Causal::kNone) n_hi = min(n_hi, floor_div(r1 + shift, block_n) + 1);
    if (kWindow && right >= 0) n_hi = min(n_hi, floor_div(r1 + shift + right, block_n) + 1);
    if (kWindow && left >= 0) n_lo = max(n_lo, floor_div(r0 + shift - left, block_n));
  }

  // Query tiles [m_lo, m_hi) that can hold a row seeing a key of columns [c0, c1] (the
  // transposed schedule: a backward CTA owns a K/V tile and walks query tiles).
  __device__ __forceinline__ void q_tile_range(int64_t c0, int64_t c1, int block_m,
                                               int64_t& m_lo, int64_t& m_hi) const {
    m_lo = 0;
    m_hi = (sq + block_m - 1) / block_m;
    // visible needs c0 <= j <= i + shift (+ right) and j >= i + shift - left
    int64_t reach = kCausal != Causal::kNone ? 0 : -1;  // -1: no right bound
    if (kWindow && right >= 0) reach = reach < 0 ? right : min(reach, right);
    if (reach >= 0) m_lo = max(m_lo, floor_div(c0 - shift - reach, block_m));
    if (kWindow && left >= 0) m_hi = min(m_hi, floor_div(c1 - shift + left, block_m) + 1);
  }

  // True when some (i, j) of rows [r0, r1] x tile n is not visible.
  __device__ __forceinline__ bool tile_needs_mask(int64_t r0, int64_t r1, int64_t n,
                                                  int block_n) const {
    const int64_t c0 = n * block_n, c1 = c0 + block_n - 1;
    bool need = c1 >= sk;
    if (kCausal != Causal::kNone) need = need || c1 > r0 + shift;
    if (kWindow) {
      if (right >= 0) need = need || c1 > r0 + shift + right;
      if (left >= 0) need = need || c0 < r1 + shift - left;
    }
    return need;
  }
};

}  // namespace fg
