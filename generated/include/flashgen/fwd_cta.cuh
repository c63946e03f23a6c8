// flashgen: what one forward CTA owns, shared by the two forward mainloops (the mma.sync one,
// fwd_kernel.cuh, and the Hopper one, fwd_sm90_kernel.cuh): its (query tile, head, batch), the
// K/V tiles it visits and which of them need the element-wise mask, and its dropout stream.
//
// Glossary (docs/conventions.md, "Tile schedule" and "Block sparsity")
//   num_qt      ceil(seqlen_q / block_m): query tiles per (batch, head) (varlen: of the longest)
//   qt          this CTA's query tile; the grid is flattened with qt fastest, and with a causal
//               mask the last query tiles (the longest schedules) start first
//   r0, r1      first and last valid query row of the tile (r1 < Sq)
//   layout row  (layout head, qt) of a block-sparse layout; every head reads layout head 0
//               when blk_layout_heads == 1
#pragma once

#include <stdint.h>

#include "frag.cuh"
#include "mask.cuh"
#include "mask_mod.cuh"
#include "params.h"
#include "philox.cuh"
#include "philox_seed.cuh"
#include "schedule.cuh"
#include "tile_io.cuh"

namespace fg {

struct FwdTileId {
  int64_t num_qt, qt, h, b;
};

template <class C>
__device__ __forceinline__ FwdTileId fwd_tile_id(const fg_fwd_params& p) {
  FwdTileId id;
  id.num_qt = (p.seqlen_q + C::kBlockM - 1) / C::kBlockM;
  int64_t bid = blockIdx.x;
  const int64_t qt_raw = bid % id.num_qt;
  bid /= id.num_qt;
  id.h = bid % p.heads;
  id.b = bid / p.heads;
  id.qt = C::kCausal != Causal::kNone ? id.num_qt - 1 - qt_raw : qt_raw;
  return id;
}

// The (seed, offset) of this launch into p.philox_seed_out / _offset_out (philox_seed.cuh);
// every forward body calls it first, before a CTA can leave.
template <class C>
__device__ __forceinline__ void fwd_record_philox(const fg_fwd_params& p) {
  if constexpr (C::kDropout) record_philox_seed(p);
}

template <class C>
using FwdSchedule = TileSchedule<C::kSparse, /*descending=*/true>;

// The K/V tiles of rows [r0, r1]: the mask policy's dense range, visited from the top (the
// diagonal tile first), or the CTA's row of the block-sparse layout (full tiles, then partial
// ones; its counts are META bytes, counted by the thread `count` names).
// A spec's mask_mod (`umask`, mask_mod.cuh) trims the EMPTY tiles at either end of the dense
// range (it is refused with block sparsity).
template <class C, class Mask, class IoT, class UMask>
__device__ __forceinline__ FwdSchedule<C> fwd_schedule(const fg_fwd_params& p, const FwdTileId& id,
                                                       const Mask& mask, int64_t r0, int64_t r1,
                                                       IoT& io, bool count, const UMask& umask) {
  if constexpr (C::kSparse) {
    const int64_t row = (p.blk_layout_heads == 1 ? 0 : id.h) * id.num_qt + id.qt;
    return FwdSchedule<C>::sparse(p.blk_full_count, p.blk_full_idx, p.blk_part_count,
                                  p.blk_part_idx, row, p.blk_max_blocks, io, count);
  } else {
    int64_t n_lo, n_hi;
    mask.tile_range(r0, r1, C::kBlockN, n_lo, n_hi);
    umask.trim(r0, r1, C::kBlockN, n_lo, n_hi);
    return FwdSchedule<C>::dense(n_lo, n_hi);
  }
}

// Whether K/V tile n, at schedule position it, runs the element-wise mask. A sparse "full"
// tile still gets the tail mask if it reaches past Sk (a layout built for other lengths, or a
// varlen batch's shorter sequence), so no key past the sequence is ever scored.
template <class C, class Mask>
__device__ __forceinline__ bool fwd_tile_masked(const FwdSchedule<C>& sched, const Mask& mask,
                                                int it, int64_t n, int64_t r0, int64_t r1) {
  return C::kSparse ? (sched.partial(it) || (n + 1) * C::kBlockN > mask.sk)
                    : mask.tile_needs_mask(r0, r1, n, C::kBlockN);
}

// The dropout stream of one (batch b, head h) and the 1/(1-p) that scales O at the end.
struct FwdDropout {
  DropoutRng rng;
  float scale;
};

template <class C>
__device__ __forceinline__ FwdDropout fwd_dropout(const fg_fwd_params& p, int64_t b, int64_t h) {
  FwdDropout d{DropoutRng{}, 1.f};
  if (C::kDropout) {
    const PhiloxSeed s = philox_seed(p);
    d.rng = make_dropout_rng(s.seed, s.offset, b * p.heads + h, p.dropout_p);
    d.scale = static_cast<float>(1.0 / (1.0 - p.dropout_p));
  }
  return d;
}

// Dropout on one warp's S fragments (kMT m16 x kNT n8 tiles, corner (i0, j0)): dropped
// elements become 0 (the 1/(1-p) scales O at the end, FwdDropout::scale); debug builds write
// the keep-mask of every element inside the sequence, masked or not.
template <class C, int kMT, int kNT, class IoT>
__device__ __forceinline__ void fwd_dropout_frag(float (&acc)[kMT][kNT][4], const DropoutRng& rng,
                                                 const fg_fwd_params& p, int64_t b, int64_t h,
                                                 int64_t sq, int64_t sk, int64_t i0, int64_t j0,
                                                 int lane, IoT& io) {
  dropout_frag<kMT, kNT>(rng, i0, j0, lane,
                         [&](int mt, int nt, int e, bool keep, int64_t i, int64_t j) {
                           if (C::kKeepMaskOut && i < sq && j < sk)
                             store_keep(p.keep_mask +
                                            ((b * p.heads + h) * p.seqlen_q + i) * p.seqlen_k + j,
                                        keep, io);
                           acc[mt][nt][e] = keep ? acc[mt][nt][e] : 0.f;
                         });
}

}  // namespace fg
