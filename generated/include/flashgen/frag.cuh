// flashgen: mask and dropout applied to one warp's score fragments, shared by every family.
//
// Glossary
//   frag C tile  acc[kMT][kNT][4]: kMT m16 tiles (query rows) x kNT n8 tiles (keys) of
//                m16n8 accumulators; element e of tile (mt, nt) is query row
//                mt*16 + g + (e >> 1)*8 and key column nt*8 + 2t + (e & 1) of the warp's
//                corner, with g = lane / 4, t = lane % 4 (arch.cuh)
//   i0, j0       the warp corner's absolute query row and key column
// Every kernel that scores Q K^T in this orientation (forward, backward, decode) masks and
// drops out through these two functions, so the rules live in mask.cuh and philox.cuh alone.
#pragma once

#include <math.h>
#include <stdint.h>

#include "mask.cuh"
#include "philox.cuh"

namespace fg {

// Scores of keys that row i may not see become -inf (so exp gives exactly 0): the visibility
// of (il, jl), offsets from the warp's corner, given by a functor (a spec's mask_mod:
// mask_mod.cuh) ...
template <int kMT, int kNT, class Visible>
__device__ __forceinline__ void mask_frag_by(float (&acc)[kMT][kNT][4], int lane,
                                             Visible&& visible) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int il = mt * 16 + g + (e >> 1) * 8, jl = nt * 8 + 2 * t + (e & 1);
        if (!visible(il, jl)) acc[mt][nt][e] = -INFINITY;
      }
}

// ... or by the kernel's mask policy (mask.cuh's TileMask).
template <int kMT, int kNT>
__device__ __forceinline__ void mask_frag(float (&acc)[kMT][kNT][4], const TileMask& tm,
                                          int lane) {
  mask_frag_by(acc, lane, [&](int il, int jl) { return tm.visible(il, jl); });
}

// The same for fragments whose rows are not consecutive queries (decode packs the query heads
// of a GQA group into the rows): row_of(r) gives the query row, relative to the TileMask's
// corner, of fragment row r = mt*16 + g (+ 8).
template <int kMT, int kNT, class RowOf>
__device__ __forceinline__ void mask_frag_rows(float (&acc)[kMT][kNT][4], const TileMask& tm,
                                               int lane, RowOf&& row_of) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int il = row_of(mt * 16 + g + r * 8);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e)
          if (!tm.visible(il, nt * 8 + 2 * t + (e & 1))) acc[mt][nt][e] = -INFINITY;
    }
}

// Calls on(mt, nt, e, keep, i, j) for every element, with the Philox keep decision of
// (query i, key j); one Philox call serves the two adjacent keys a lane holds (the 4-key
// group of j = nt*8 + 2t). The caller decides what keeping means for its accumulators.
template <int kMT, int kNT, class On>
__device__ __forceinline__ void dropout_frag(const DropoutRng& rng, int64_t i0, int64_t j0,
                                             int lane, On&& on) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t i = i0 + mt * 16 + g + r * 8;
        const int64_t j = j0 + nt * 8 + 2 * t;
        const Philox4 words = rng.group(static_cast<uint32_t>(i), static_cast<uint32_t>(j));
#pragma unroll
        for (int e = 0; e < 2; ++e)
          on(mt, nt, 2 * r + e, DropoutRng::word(words, (j + e) & 3) >= rng.threshold, i, j + e);
      }
}

// The Philox stream of one (batch b, head h) and the keep threshold floor(p * 2^32).
__device__ __forceinline__ DropoutRng make_dropout_rng(uint64_t seed, uint64_t offset,
                                                       int64_t bh, double p) {
  return DropoutRng{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(bh), static_cast<uint32_t>(offset),
                    static_cast<uint32_t>(fmin(floor(p * 4294967296.0), 4294967295.0))};
}

}  // namespace fg
