// flashgen: the tiles one CTA visits along the other dimension, shared by every family.
//
// Glossary
//   it          position in the schedule, 0 .. count-1
//   dense       the tiles [lo, hi) the mask policy leaves (mask.cuh), visited from the top
//               (forward: the diagonal tile first, where a causal row's max usually is) or
//               from the bottom (backward)
//   sparse      a block-sparse layout's row: n_full "full" tiles, then partial ones, each an
//               int32 tile index; full tiles run the unmasked path
//   row         the layout row of this CTA: (layout head, own tile index)
#pragma once

#include <stdint.h>

#include "tile_io.cuh"

namespace fg {

template <bool kSparse, bool kDescending>
struct TileSchedule {
  int64_t lo = 0, hi = 0;
  int n_full = 0, count = 0;
  const int32_t* full_idx = nullptr;
  const int32_t* part_idx = nullptr;

  __device__ __forceinline__ static TileSchedule dense(int64_t lo_, int64_t hi_) {
    TileSchedule s;
    s.lo = lo_;
    s.hi = hi_;
    s.count = static_cast<int>(hi_ > lo_ ? hi_ - lo_ : 0);
    return s;
  }

  // Row `row` of a compact layout (counts [rows], index arrays [rows][max_blocks]).
  template <class IoT>
  __device__ __forceinline__ static TileSchedule sparse(const int32_t* full_count,
                                                        const int32_t* full_idx_,
                                                        const int32_t* part_count,
                                                        const int32_t* part_idx_, int64_t row,
                                                        int64_t max_blocks, IoT& io, bool cnt) {
    TileSchedule s;
    s.n_full = load_meta(full_count + row, io, cnt);
    s.count = s.n_full + load_meta(part_count + row, io, cnt);
    s.full_idx = full_idx_ + row * max_blocks;
    s.part_idx = part_idx_ + row * max_blocks;
    return s;
  }

  // The tile index at position it (sparse: reads the layout, META bytes counted by cnt).
  template <class IoT>
  __device__ __forceinline__ int64_t tile(int it, IoT& io, bool cnt) const {
    if (kSparse)
      return it < n_full ? load_meta(full_idx + it, io, cnt)
                         : load_meta(part_idx + (it - n_full), io, cnt);
    return kDescending ? hi - 1 - it : lo + it;
  }

  // Sparse: whether position it is a partial tile (runs the masked path).
  __device__ __forceinline__ bool partial(int it) const { return kSparse && it >= n_full; }
};

}  // namespace fg
