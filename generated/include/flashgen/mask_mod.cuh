// flashgen: the mask stage of a spec's mask_mod, shared by every family that serves it (the
// mma.sync forward and backward, the sm_90a forward). No kernel body names a mask: a kernel
// asks this stage which tiles to skip, which to mask element by element, and masks them.
//
// Glossary
//   U        the Spec's rendered `UserMask` (generator/features/user_mask.py: Vals, load,
//            visible, classify, check), or NoUserMask (score_check.h): kOn = false, and every
//            call here is a constant (kFull) or empty, so a kernel without a mask_mod compiles
//            to the code it had
//   class    of a tile, from U::classify's interval arithmetic over the tile's queries and
//            keys, clipped to the sequence (mask_mod_iv.h): kEmpty (no element visible: the
//            tile is skipped, or masked whole where a schedule cannot skip it), kPartial
//            (masked per element), kFull (every element visible: no per-element mask)
//   i, j     positions in the sequence (0-based; varlen: in the batch's own sequence), as the
//            mask's `i` and `j` (docs/usermod.md)
// The built-in masks (causal, window, the sequence's tail; mask.cuh) are applied as before;
// the mask_mod is ANDed with them. Rows that see no key end with O = 0 and LSE = -inf (the
// softmax's empty-row convention) and give zero gradients.
#pragma once

#include <math.h>
#include <stdint.h>

#include "frag.cuh"
#include "mask_mod_iv.h"
#include "score_check.h"
#include "score_params.h"

namespace fg {

enum : int { kMaskEmpty = 0, kMaskPartial = 1, kMaskFull = 2 };

template <class U>
struct MaskMod {
  static constexpr bool kOn = U::kOn;
  // reads per-token vectors: a tile's class reads them over its rows and keys
  static constexpr bool kTokens = U::kTokens;
  typename U::Vals v{};
  int64_t sq = 0, sk = 0, q_tok0 = 0, k_tok0 = 0;

  // The mask of (batch b, head h) over a sequence of lengths sq, sk whose first query and key
  // are tokens q_tok0, k_tok0 of the per-token vectors.
  __device__ __forceinline__ MaskMod(const fg_score_params& sp, int64_t b, int64_t h,
                                     int64_t q_tok0_, int64_t k_tok0_, int64_t sq_, int64_t sk_) {
    if constexpr (kOn) {
      sq = sq_, sk = sk_, q_tok0 = q_tok0_, k_tok0 = k_tok0_;
      U::load(sp, b, h, q_tok0, k_tok0, v);
    }
  }
  // The same mask for head h (the backward walks a GQA group's heads).
  __device__ __forceinline__ MaskMod at(const fg_score_params& sp, int64_t h) const {
    MaskMod m = *this;
    if constexpr (kOn) U::load(sp, v.b, h, q_tok0, k_tok0, m.v);
    return m;
  }

  // The class of rows [r0, r1] x keys [c0, c1] (clipped to the sequence; kFull when off).
  __device__ __forceinline__ int tile_class(int64_t r0, int64_t r1, int64_t c0,
                                            int64_t c1) const {
    if constexpr (kOn) {
      r1 = r1 < sq - 1 ? r1 : sq - 1;
      c1 = c1 < sk - 1 ? c1 : sk - 1;
      if (r1 < r0 || c1 < c0) return kMaskEmpty;  // nothing of the sequence
      return U::classify(v, r0, r1, c0, c1, sq, sk);
    } else {
      return kMaskFull;
    }
  }
  __device__ __forceinline__ int kv_tile_class(int64_t r0, int64_t r1, int64_t n,
                                               int block_n) const {
    return tile_class(r0, r1, n * block_n, n * block_n + block_n - 1);
  }

  // Trims the EMPTY K/V tiles at either end of [n_lo, n_hi) for rows [r0, r1] (the forward's
  // dense schedule).
  __device__ __forceinline__ void trim(int64_t r0, int64_t r1, int block_n, int64_t& n_lo,
                                       int64_t& n_hi) const {
    if constexpr (kOn) {
      while (n_lo < n_hi && kv_tile_class(r0, r1, n_lo, block_n) == kMaskEmpty) ++n_lo;
      while (n_hi > n_lo && kv_tile_class(r0, r1, n_hi - 1, block_n) == kMaskEmpty) --n_hi;
    }
  }

  // Whether (i, j) is visible: inside the sequence and the mask_mod true (the bounds go first,
  // so a per-token vector is never read past its sequence).
  __device__ __forceinline__ bool visible(int64_t i, int64_t j) const {
    if constexpr (kOn) {
      return i < sq && j < sk && U::visible(v, i, j, sq, sk);
    } else {
      return true;
    }
  }

  // Scores the mask_mod hides become -inf, on one warp's m16n8 fragments with corner (i0, j0)
  // (frag.cuh's coordinates).
  template <int kMT, int kNT>
  __device__ __forceinline__ void mask_frag(float (&acc)[kMT][kNT][4], int64_t i0, int64_t j0,
                                            int lane) const {
    if constexpr (kOn) {
      mask_frag_by(acc, lane,
                   [&](int il, int jl) { return visible(i0 + il, j0 + jl); });
    }
  }
};

template <class C>
using MaskModOf = MaskMod<typename C::UserMask>;

}  // namespace fg
