// flashgen: the decode kernels (FlashDecoding: split-KV over a contiguous or paged KV cache),
// and the combine that merges partial results by their LSE (also the public merge_states).
//
// Glossary (docs/decode.md)
//   group      heads / kv_heads: the query heads that share one KV head
//   rows       seqlen_q * group: a CTA packs the queries of every head of its KV head's group
//              into the M dimension of the MMA, row r = query (r / group), head (r % group),
//              so each K/V byte is read once per KV head
//   CTA        block_m rows (one row tile mt) x one split of the key tiles of one (batch b,
//              KV head hk); the grid is ceil(rows / block_m) x splits x kv_heads x batch
//   warp (wm, wn)  owns rows [16 wm, 16 wm + 16) and keys [wn * kWarpKeys, ...) of each K/V
//              tile: warps along the keys keep their own softmax state and accumulator and are
//              merged once, at the end, through shared memory
//   sk         cache_seqlens[b], the sequence's keys (new queries included)
//   split      the key tiles [n_lo, n_hi) the mask leaves are cut into `splits` equal runs
//              of `per` tiles; `used` = ceil(tiles / per) of them hold a tile (the others
//              exit at once). used <= 1: that CTA writes O and LSE itself. Otherwise each
//              used CTA writes its normalised O and its LSE in fp32 to the workspace and
//              arrives at its (sequence, KV head, row tile) counter; the last to arrive
//              merges the parts (fused combine: no second kernel, no launch gap)
//   page ids   paged caches: lane l of every warp holds the block-table entry of page l of a
//              K/V tile, fetched one tile ahead (one lookup per page per tile, overlapping
//              the loads in flight); each row's source is a shuffle away
//
// The maths per tile is the forward's: S = Q K^T and acc_o += P V (warp_mma.cuh), the online
// softmax (softmax.cuh), masks (mask.cuh, frag.cuh); loads and stores go through tile_io.cuh.
#pragma once

#include <math.h>
#include <stdint.h>

#include "arch.cuh"
#include "decode_params.h"
#include "frag.cuh"
#include "mask.cuh"
#include "schedule.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"
#include "warp_mma.cuh"

namespace fg {

// The decode family's IO counters, in the order of its Python table (families/decode.py).
struct DecIo {
  enum IoTensor {
    kQ = 0, kK, kV, kO, kLse, kOParts, kLseParts, kSeqlens, kBlockTable, kCounter,
    kNumIoTensors
  };
  static constexpr int kCount = kNumIoTensors;
  // TileSchedule's sparse path names kMeta; the dense schedule decode uses never reads any.
  static constexpr int kMeta = kSeqlens;
};

constexpr int kDecodeMaxQueries = 16;   // seqlen_q per sequence
constexpr int kDecodeMaxSplits = 128;   // num_splits
constexpr int kCombineThreads = 128;    // threads of a combine CTA
// The workspace opens with the error word (padded to 256 bytes), then, with splits > 1, one
// uint32 arrival counter per (sequence, KV head, row tile), then the fp32 parts
// (decode_launch.cuh has the layout).
constexpr int64_t kDecodeErrorBytes = 256;

// S: the spec as named constants (templates/common/spec_struct.j2, plus kPaged).
template <class S>
struct DecConfig : S {
  using S::kBlockM, S::kBlockN, S::kHeadDim, S::kWarps, S::kStages;
  using Elem = typename S::Elem;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpsM = kBlockM / 16;        // warps along the rows (16 each)
  static constexpr int kWarpsN = kWarps / kWarpsM;    // warps along the keys of a tile
  static constexpr int kWarpKeys = kBlockN / kWarpsN; // keys of a tile per warp
  static constexpr int kNT = kWarpKeys / 8;           // n8 tiles of a warp's S
  static constexpr int kDT = kHeadDim / 8;            // n8 tiles of O along d
  static constexpr int kKS = kHeadDim / 16;           // k16 steps of Q K^T
  static constexpr int kStride = kHeadDim + 8;        // smem row stride, elements
  // Q is re-read from smem each tile (8 ldmatrix per warp for d = 128): a memory-bound loop
  // has the time, and the registers go to the address arithmetic of the loads in flight.
  static constexpr bool kQInRegs = false;
  static constexpr int kElem = static_cast<int>(sizeof(Elem));
  static constexpr int kTileBytes = (kBlockM + 2 * kStages * kBlockN) * kStride * kElem;
  // The end-of-loop merge of the key warps reuses the tiles' memory: per warp, its rows'
  // accumulators (rows padded to d + 4 floats) and (m, l).
  static constexpr int kMergeStride = kHeadDim + 4;
  static constexpr int kMergeBytes = kWarpsN * kBlockM * (kMergeStride + 2) * 4;
  static constexpr int kSmemBytes = kTileBytes > kMergeBytes ? kTileBytes : kMergeBytes;
  // The fused combine stages (split, row) parts of kHeadDim fp32 and their LSEs in the
  // tiles' memory, at most 256 rows a pass (a multiple of 16; always >= kBlockM: the key
  // warps' merge buffer alone holds kBlockM such rows); 8-column items, kMergeItems a thread.
  static constexpr int kPartRowBytes = kHeadDim * 4;
  static constexpr int kStageFit = kSmemBytes / (kPartRowBytes + 4) / 16 * 16;
  static constexpr int kStageRows = kStageFit < 256 ? kStageFit : 256;
  static constexpr int kMergeItems = (kBlockM * (kHeadDim / 8) + kThreads - 1) / kThreads;
  // combine: kHeadDim / 8 threads per output row, 8 columns each
  static constexpr int kCombineRowThreads = kHeadDim / 8;
  static constexpr int kCombineRows = kCombineThreads / kCombineRowThreads;

  static_assert(kHeadDim % 16 == 0 && 32 % kCombineRowThreads == 0, "head_dim: 32, 64 or 128");
  static_assert(kBlockM % 16 == 0 && kWarpsM >= 1 && kWarps % kWarpsM == 0, "block_m = 16 * warps_m");
  static_assert(kWarpKeys % 16 == 0 && kWarpKeys * kWarpsN == kBlockN, "16-key multiples per warp");
  static_assert(kStages >= 2, "the page-id prefetch and the ring need two stages");
  static_assert((kBlockN * kHeadDim / 8) % kThreads == 0,
                "whole K/V tiles per load pass (the page shuffle needs converged warps)");
  static_assert(kBlockN / 16 <= 32, "page ids of a tile fit a warp");
  static_assert(S::kCausal != Causal::kTopLeft, "decode aligns causal masks bottom_right");
  static_assert(kStageRows >= kBlockM, "a pass of the fused combine holds one split's rows");
};

// Row (b, query i, head h), columns [col, col + 8) of O: o * inv_l in the kernel's dtype, and
// its LSE (natural log) from the row's first thread when the caller asked for LSEs.
template <class C, class IoT>
__device__ __forceinline__ void store_o_row(const fg_decode_params& p, int64_t b, int64_t i,
                                            int64_t h, int col, const float (&o)[8],
                                            float inv_l, float lse, IoT& io) {
  using MmaT = Mma<typename C::Elem>;
  const uint4 packed = make_uint4(
      MmaT::pack(o[0] * inv_l, o[1] * inv_l), MmaT::pack(o[2] * inv_l, o[3] * inv_l),
      MmaT::pack(o[4] * inv_l, o[5] * inv_l), MmaT::pack(o[6] * inv_l, o[7] * inv_l));
  store_16(static_cast<typename C::Elem*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride +
               h * p.o_head_stride + col,
           packed, io, DecIo::kO);
  if (col == 0 && p.lse)
    store_f32(p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + i, lse, io, DecIo::kLse);
}

// A split's arrival at its counter; returns how many had arrived before it. atomicInc wraps
// to 0 at the `used`-th arrival, so the last CTA leaves the counter zero for the next call
// (CUDA graph replays need no reset). Counted as an atomic add: 4 bytes read, 4 written.
// (tile_io.cuh has no counter atomic yet; this is the family's one global access outside it.)
template <class IoT>
__device__ __forceinline__ unsigned int arrive_split(unsigned int* counter, unsigned int used,
                                                     IoT& io) {
  io.add(DecIo::kCounter, 8);
  return atomicInc(counter, used - 1);
}

// The fused combine, run by the last split CTA of (sequence b, KV head hk, row tile at m0):
// O = sum_s exp(LSE_s - LSE) O_s, LSE = log sum_s exp(LSE_s) over the `used` splits, in split
// order (so the result does not depend on which CTA came last). Passes of whole splits: the
// LSEs (plain loads: written in this launch, seen through the counter's fences, so not the
// read-only path) and the parts (cp.async, L2) of up to kStageRows (split, row) pairs land
// in shared memory together, one round trip per pass; each thread then folds its 8-column
// items over the pass's splits with an online max, as the softmax does.
template <class C, class IoT>
__device__ __forceinline__ void merge_split_parts(const fg_decode_params& p, IoT& io,
                                                  int64_t used, int64_t b, int64_t hk,
                                                  int64_t m0, int valid, int64_t group,
                                                  unsigned char* smem) {
  using Elem = typename C::Elem;
  constexpr int kCols8 = C::kHeadDim / 8;  // 8-column items per row
  float* stage = reinterpret_cast<float*>(smem);
  float* s_lse = stage + C::kStageRows * C::kHeadDim;
  const float* o_parts = static_cast<const float*>(p.o_parts);
  const int tid = threadIdx.x;
  const int per_pass = C::kStageRows / valid;  // >= 1: valid <= kBlockM <= kStageRows
  auto part_row = [&](int64_t s, int r, int64_t& i, int64_t& h) -> int64_t {
    const int64_t gr = m0 + r;
    i = gr / group;
    h = hk * group + (gr - i * group);
    return s * p.o_parts_part_stride + b * p.o_parts_batch_stride + i * p.o_parts_row_stride +
           h * p.o_parts_head_stride;
  };

  float m[C::kMergeItems], l[C::kMergeItems], acc[C::kMergeItems][8];
#pragma unroll
  for (int j = 0; j < C::kMergeItems; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[j][e] = 0.f;
  }
  for (int64_t s0 = 0; s0 < used; s0 += per_pass) {
    const int n_s = static_cast<int>(min(static_cast<int64_t>(per_pass), used - s0));
    const int n_rows = n_s * valid;
    for (int q = tid; q < n_rows; q += C::kThreads) {
      const int s = q / valid, r = q - s * valid;
      int64_t i, h;
      part_row(0, r, i, h);
      s_lse[q] = load_f32(p.lse_parts + (s0 + s) * p.lse_parts_part_stride +
                              b * p.lse_parts_batch_stride + h * p.lse_parts_head_stride + i,
                          io, DecIo::kLseParts);
    }
    // fp32 rows moved as 2 * kHeadDim 16-bit elements (16-byte chunks; counted as O_PARTS)
    load_rows_async<C::kStageRows, 2 * C::kHeadDim, C::kThreads, 2 * C::kHeadDim>(
        reinterpret_cast<Elem*>(stage),
        [&](int q) -> const Elem* {
          if (q >= n_rows) return nullptr;
          const int s = q / valid;
          int64_t i, h;
          return reinterpret_cast<const Elem*>(o_parts + part_row(s0 + s, q - s * valid, i, h));
        },
        reinterpret_cast<const Elem*>(o_parts), io, DecIo::kOParts);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int j = 0; j < C::kMergeItems; ++j) {
      const int c = tid + j * C::kThreads;
      if (c >= valid * kCols8) break;
      const int r = c / kCols8, col = (c % kCols8) * 8;
      float mx = m[j];
#pragma unroll 4
      for (int s = 0; s < n_s; ++s) mx = fmaxf(mx, s_lse[s * valid + r]);
      const float base = mx == -INFINITY ? 0.f : mx;
      const float rescale = expf(m[j] - base);  // 0 while nothing was seen (m = -inf)
      l[j] *= rescale;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[j][e] *= rescale;
      // No branch, so the unrolled loads overlap: a split whose keys this row does not see
      // has LSE -inf, weight exp(-inf) = 0 and a finite (zero) part.
#pragma unroll 4
      for (int s = 0; s < n_s; ++s) {
        const float w = expf(s_lse[s * valid + r] - base);
        const float4* src = reinterpret_cast<const float4*>(
            stage + static_cast<int64_t>(s * valid + r) * C::kHeadDim + col);
        const float4 lo4 = src[0], hi4 = src[1];
        l[j] += w;
        acc[j][0] += w * lo4.x;
        acc[j][1] += w * lo4.y;
        acc[j][2] += w * lo4.z;
        acc[j][3] += w * lo4.w;
        acc[j][4] += w * hi4.x;
        acc[j][5] += w * hi4.y;
        acc[j][6] += w * hi4.z;
        acc[j][7] += w * hi4.w;
      }
      m[j] = mx;
    }
    __syncthreads();  // the next pass overwrites the stage
  }
#pragma unroll
  for (int j = 0; j < C::kMergeItems; ++j) {
    const int c = tid + j * C::kThreads;
    if (c >= valid * kCols8) break;
    const int r = c / kCols8, col = (c % kCols8) * 8;
    const bool empty = !(l[j] > 0.f);
    int64_t i, h;
    part_row(0, r, i, h);
    store_o_row<C>(p, b, i, h, col, acc[j], empty ? 0.f : 1.f / l[j],
                   empty ? -INFINITY : m[j] + logf(l[j]), io);
  }
}

template <class C>
__device__ __forceinline__ void decode_kernel_body(const fg_decode_params& p) {
  using Elem = typename C::Elem;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sK = sQ + C::kBlockM * C::kStride;
  Elem* sV = sK + C::kStages * C::kBlockN * C::kStride;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / C::kWarpsN, wn = warp % C::kWarpsN;
  const LaneOffsets lo(lane);
  Io<C::kInstrumentIo, DecIo> io;
  unsigned int* err = static_cast<unsigned int*>(p.workspace);

  // ---- which (row tile, split, KV head, sequence) this CTA is -------------------------------
  const int64_t group = p.heads / p.kv_heads;
  const int64_t rows = p.seqlen_q * group;
  const int64_t num_mt = (rows + C::kBlockM - 1) / C::kBlockM;
  const int64_t splits = p.num_splits;
  int64_t bid = blockIdx.x;
  const int64_t mt = bid % num_mt;
  bid /= num_mt;
  const int64_t split = bid % splits;
  bid /= splits;
  const int64_t hk = bid % p.kv_heads, b = bid / p.kv_heads;
  if (b >= p.batch) return;  // a grid larger than the problem's (the launcher never makes one)

  // The sequence's length, clamped to the cache (and flagged) when the caller's is impossible.
  const int64_t capacity = C::kPaged ? p.max_pages * p.page_size : p.seqlen_k;
  int64_t sk = load_index(p.cache_seqlens + b, io, DecIo::kSeqlens, tid == 0);
  if (sk < 0 || sk > capacity) {
    if (tid == 0) raise_error_flag(err, FG_DECODE_ERR_SEQLEN);
    sk = sk < 0 ? 0 : capacity;
  }

  const int64_t m0 = mt * C::kBlockM;
  const int64_t valid_rows = min(static_cast<int64_t>(C::kBlockM), rows - m0);
  const int64_t q_lo = m0 / group, q_hi = (m0 + valid_rows - 1) / group;  // queries of the CTA
  const MaskPolicy<C::kCausal, C::kWindow> mask(p.seqlen_q, sk, p.window_left, p.window_right);
  int64_t n_lo, n_hi;
  mask.tile_range(q_lo, q_hi, C::kBlockN, n_lo, n_hi);
  const int64_t tiles = n_hi > n_lo ? n_hi - n_lo : 0;
  const int64_t per = (tiles + splits - 1) / splits;
  const int64_t used = per > 0 ? (tiles + per - 1) / per : 0;  // splits that hold a tile
  if (split > 0 && split >= used) {  // no tile: no part, no arrival (split 0 always runs)
    io.flush(p.io_counters);
    return;
  }
  // One CTA holds every tile (or there is none): it writes O and LSE itself.
  const bool direct = used <= 1;
  const int64_t s_lo = n_lo + split * per;
  const auto sched = TileSchedule<false, false>::dense(s_lo, min(s_lo + per, n_hi));
  const int n_iter = sched.count;

  // ---- sources of the rows: Q's packed (query, head) rows, the cache's keys -----------------
  const Elem* q_base =
      static_cast<const Elem*>(p.q) + b * p.q_batch_stride + hk * group * p.q_head_stride;
  auto q_row = [&](int r) -> const Elem* {
    if (r >= valid_rows) return nullptr;
    const int64_t gr = m0 + r, i = gr / group;
    return q_base + i * p.q_row_stride + (gr - i * group) * p.q_head_stride;
  };
  const Elem* k_base = static_cast<const Elem*>(p.k) + hk * p.k_head_stride +
                       (C::kPaged ? 0 : b * p.k_batch_stride);
  const Elem* v_base = static_cast<const Elem*>(p.v) + hk * p.v_head_stride +
                       (C::kPaged ? 0 : b * p.v_batch_stride);
  const int page_shift = C::kPaged ? __ffsll(p.page_size) - 1 : 0;
  const int64_t pages_per_tile = C::kPaged ? max(static_cast<int64_t>(C::kBlockN) >> page_shift,
                                                 static_cast<int64_t>(1))
                                           : 0;
  const int32_t* bt = C::kPaged ? p.block_table + b * p.block_table_stride : nullptr;
  // Paged: the page of the tile `it` whose id this lane holds, and whether it holds one (the
  // page has a key below sk; entries past the sequence's pages are never read).
  auto lane_page = [&](int it, int64_t& page) -> bool {
    page = ((sched.tile(it, io, false) * C::kBlockN) >> page_shift) + lane;
    return it < n_iter && lane < pages_per_tile && (page << page_shift) < sk;
  };
  auto fetch_page_id = [&](int it) -> int32_t {  // issued a tile ahead; checked at use
    int64_t page;
    if (!C::kPaged || !lane_page(it, page)) return -1;
    return load_index(bt + page, io, DecIo::kBlockTable, warp == 0);
  };
  auto checked_page_id = [&](int it, int32_t id) -> int32_t {
    int64_t page;
    if (!C::kPaged || !lane_page(it, page)) return -1;
    if (id < 0 || id >= p.num_pages) {  // never read out of bounds: zero rows, and say so
      raise_error_flag(err, FG_DECODE_ERR_PAGE_ID);
      return -1;
    }
    return id;
  };

  auto load_kv = [&](int it, int32_t ids) {
    const int slot = it % C::kStages;
    const int64_t key0 = sched.tile(it, io, false) * C::kBlockN;
    auto rows_of = [&](const Elem* base, int64_t row_stride, int64_t page_stride) {
      return [&, base, row_stride, page_stride](int r) -> const Elem* {
        if (C::kPaged) {
          const int64_t in_page = (key0 & (p.page_size - 1)) + r;  // key0's page holds page 0
          const int32_t id = __shfl_sync(0xffffffffu, ids, static_cast<int>(in_page >> page_shift));
          if (key0 + r >= sk || id < 0) return nullptr;
          return base + id * page_stride + (in_page & (p.page_size - 1)) * row_stride;
        }
        return key0 + r < sk ? base + (key0 + r) * row_stride : nullptr;
      };
    };
    load_rows_async<C::kBlockN, C::kHeadDim, C::kThreads, C::kStride>(
        sK + slot * C::kBlockN * C::kStride, rows_of(k_base, p.k_row_stride, p.k_batch_stride),
        k_base, io, DecIo::kK);
    load_rows_async<C::kBlockN, C::kHeadDim, C::kThreads, C::kStride>(
        sV + slot * C::kBlockN * C::kStride, rows_of(v_base, p.v_row_stride, p.v_batch_stride),
        v_base, io, DecIo::kV);
  };

  // ---- per-warp state: the thread's two rows (g, g + 8) of the warp's m16 tile --------------
  RowState st[2] = {RowState{-INFINITY, 0.f}, RowState{-INFINITY, 0.f}};
  float acc_o[1][C::kDT][4];
#pragma unroll
  for (int dt = 0; dt < C::kDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;
  const int warp_row0 = wm * 16;
  // queries of the thread's rows, for the element masks (padding rows past `rows` are discarded)
  const int q_row_g = static_cast<int>((m0 + warp_row0 + g) / group);
  const int q_row_g8 = static_cast<int>((m0 + warp_row0 + g + 8) / group);

  constexpr uint32_t kElemBytes = sizeof(Elem);
  constexpr uint32_t kSlotBytes = C::kBlockN * C::kStride * kElemBytes;
  const uint32_t q_lane =
      smem_addr(sQ) + ((warp_row0 + lo.a_row) * C::kStride + lo.a_col) * kElemBytes;
  const uint32_t k_lane =
      smem_addr(sK) + ((wn * C::kWarpKeys + lo.b_row) * C::kStride + lo.b_col) * kElemBytes;
  const uint32_t v_lane =
      smem_addr(sV) + ((wn * C::kWarpKeys + lo.a_row) * C::kStride + lo.a_col) * kElemBytes;
  const float scale_log2 = static_cast<float>(p.softmax_scale * 1.4426950408889634);

  if (n_iter > 0) {
    load_rows_async<C::kBlockM, C::kHeadDim, C::kThreads, C::kStride>(sQ, q_row, q_base, io,
                                                                       DecIo::kQ);
    cp_async_commit();
    // The page ids of the first kStages tiles in one round trip (not one per prologue tile).
    int32_t ids_first[C::kStages];
#pragma unroll
    for (int s = 0; s < C::kStages; ++s) ids_first[s] = fetch_page_id(s);
#pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
      if (s < n_iter) load_kv(s, checked_page_id(s, ids_first[s]));
      cp_async_commit();
    }
    int32_t ids_next = ids_first[C::kStages - 1];
    cp_async_wait<C::kStages - 1>();  // the Q group
    __syncthreads();

    uint32_t qf[C::kQInRegs ? C::kKS : 1][4];
    if (C::kQInRegs) {
#pragma unroll
      for (int kk = 0; kk < C::kKS; ++kk)
        ldmatrix_x4(qf[C::kQInRegs ? kk : 0], q_lane + kk * 16 * kElemBytes);
    }

    for (int it = 0; it < n_iter; ++it) {
      // One barrier per tile (as the forward): tile `it` has landed and every warp is done
      // with tile it - 1, whose slot now takes tile it + kStages - 1.
      cp_async_wait<C::kStages - 2>();
      __syncthreads();
      const int next = it + C::kStages - 1;
      if (next < n_iter) load_kv(next, checked_page_id(next, ids_next));
      cp_async_commit();
      ids_next = fetch_page_id(next + 1);

      const int slot = it % C::kStages;
      const int64_t n = sched.tile(it, io, false);
      float acc_s[1][C::kNT][4];
#pragma unroll
      for (int nt = 0; nt < C::kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = 0.f;
      warp_qk<Elem, 1, C::kNT, C::kKS, C::kStride>(
          acc_s,
          [&](int, int kk, uint32_t (&a)[4]) {
            if (C::kQInRegs) {
#pragma unroll
              for (int e = 0; e < 4; ++e) a[e] = qf[C::kQInRegs ? kk : 0][e];
            } else {
              ldmatrix_x4(a, q_lane + kk * 16 * kElemBytes);
            }
          },
          k_lane + slot * kSlotBytes);
      if (mask.tile_needs_mask(q_lo, q_hi, n, C::kBlockN))
        mask_frag_rows(acc_s, mask.tile(0, n * C::kBlockN + wn * C::kWarpKeys), lane,
                       [&](int r) { return r >= 8 ? q_row_g8 : q_row_g; });
      float alpha[2];
      online_softmax_update(st, acc_s[0], scale_log2, alpha);
      scale_rows(acc_o[0], alpha);
      warp_pv<Elem, 1, C::kNT, C::kDT, C::kStride>(acc_o, acc_s, v_lane + slot * kSlotBytes);
    }
  }

  // ---- merge the key warps through smem, then O and LSE (or the split's fp32 part) ---------
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the tiles: their memory takes the merge
  float* sO = reinterpret_cast<float*>(smem_raw);
  float* sM = sO + C::kWarpsN * C::kBlockM * C::kMergeStride;
  float* sL = sM + C::kWarpsN * C::kBlockM;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wn * C::kBlockM + warp_row0 + g + r * 8;
    const float l = quad_sum(st[r].l);
    if (t == 0) {
      sM[row] = st[r].m;
      sL[row] = l;
    }
#pragma unroll
    for (int dt = 0; dt < C::kDT; ++dt)
      *reinterpret_cast<float2*>(sO + row * C::kMergeStride + dt * 8 + 2 * t) =
          make_float2(acc_o[0][dt][2 * r], acc_o[0][dt][2 * r + 1]);
  }
  __syncthreads();

  for (int c = tid; c < C::kBlockM * C::kDT; c += C::kThreads) {
    const int row = c / C::kDT, col = (c % C::kDT) * 8;
    if (row >= valid_rows) continue;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < C::kWarpsN; ++w) mx = fmaxf(mx, sM[w * C::kBlockM + row]);
    const float base = mx == -INFINITY ? 0.f : mx;  // the softmax's -inf guard
    float l = 0.f, o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < C::kWarpsN; ++w) {
      const int wr = w * C::kBlockM + row;
      const float f = exp2_approx(sM[wr] - base);  // 1 exactly for the warp holding the max
      l += sL[wr] * f;
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] += f * sO[wr * C::kMergeStride + col + e];
    }
    const bool empty = !(l > 0.f);
    const float inv_l = empty ? 0.f : 1.f / l;
    const float lse = empty ? -INFINITY : (mx + log2f(l)) * 0.69314718055994530942f;
    const int64_t gr = m0 + row, i = gr / group, h = hk * group + (gr - i * group);
    if (direct) {
      store_o_row<C>(p, b, i, h, col, o, inv_l, lse, io);
    } else {
      float* part = const_cast<float*>(static_cast<const float*>(p.o_parts)) +
                    split * p.o_parts_part_stride + b * p.o_parts_batch_stride +
                    i * p.o_parts_row_stride + h * p.o_parts_head_stride + col;
#pragma unroll
      for (int half = 0; half < 2; ++half)
        store_16(part + 4 * half,
                 make_uint4(__float_as_uint(o[4 * half] * inv_l),
                            __float_as_uint(o[4 * half + 1] * inv_l),
                            __float_as_uint(o[4 * half + 2] * inv_l),
                            __float_as_uint(o[4 * half + 3] * inv_l)),
                 io, DecIo::kOParts);
      if (col == 0)
        store_f32(const_cast<float*>(p.lse_parts) + split * p.lse_parts_part_stride +
                      b * p.lse_parts_batch_stride + h * p.lse_parts_head_stride + i,
                  lse, io, DecIo::kLseParts);
    }
  }
  if (!direct) {
    // Release this CTA's part (every thread fences its own stores), then arrive; the last of
    // the `used` splits to arrive acquires the others' parts and merges them all.
    __shared__ unsigned int s_arrived_before;
    __threadfence();
    __syncthreads();  // also: every thread is done with sO / sM / sL (the merge reuses them)
    if (tid == 0) {
      unsigned int* counters = reinterpret_cast<unsigned int*>(
          static_cast<unsigned char*>(p.workspace) + kDecodeErrorBytes);
      s_arrived_before = arrive_split(counters + (b * p.kv_heads + hk) * num_mt + mt,
                                      static_cast<unsigned int>(used), io);
    }
    __syncthreads();
    if (s_arrived_before == static_cast<unsigned int>(used) - 1) {
      __threadfence();
      merge_split_parts<C>(p, io, used, b, hk, m0, static_cast<int>(valid_rows), group,
                           smem_raw);
    }
  }
  io.flush(p.io_counters);
}

// Eight values of one part's output row (fp32 parts: two 16-byte reads; Elem parts: one).
template <typename PartT, class IoT>
__device__ __forceinline__ void load_part8(const PartT* src, float (&v)[8], IoT& io) {
  if constexpr (sizeof(PartT) == 4) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint4 x = load_16(src + 4 * half, io, DecIo::kOParts);
      v[4 * half] = __uint_as_float(x.x);
      v[4 * half + 1] = __uint_as_float(x.y);
      v[4 * half + 2] = __uint_as_float(x.z);
      v[4 * half + 3] = __uint_as_float(x.w);
    }
  } else {
    const uint4 x = load_16(src, io, DecIo::kOParts);
    const PartT* e = reinterpret_cast<const PartT*>(&x);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = to_float(e[k]);
  }
}

// merge_states: row (b, i, h) of O is sum_s exp(LSE_s - LSE) O_s with LSE = log sum_s
// exp(LSE_s), parts with LSE_s = -inf skipped (their O is not read); no part: O = 0, LSE =
// -inf. kCombineRowThreads threads share a row, 8 columns each, and walk the parts in chunks
// of that many, each thread reading one LSE per chunk (an online max, as the softmax's).
template <class C, typename PartT>
__device__ __forceinline__ void decode_combine_body(const fg_decode_params& p) {
  using Elem = typename C::Elem;
  using MmaT = Mma<Elem>;
  constexpr int kTpr = C::kCombineRowThreads;
  Io<C::kInstrumentIo, DecIo> io;
  const int tid = threadIdx.x, t = tid % kTpr, col = t * 8;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * C::kCombineRows + tid / kTpr;
  // No early return: the row's threads shuffle, and a warp may hold an active row too.
  const bool active = row < p.batch * p.seqlen_q * p.heads;
  const int64_t h = active ? row % p.heads : 0;
  const int64_t i = active ? (row / p.heads) % p.seqlen_q : 0;
  const int64_t b = active ? row / (p.heads * p.seqlen_q) : 0;
  const PartT* o_row = static_cast<const PartT*>(p.o_parts) + b * p.o_parts_batch_stride +
                       i * p.o_parts_row_stride + h * p.o_parts_head_stride + col;
  const float* lse_row = p.lse_parts + b * p.lse_parts_batch_stride + h * p.lse_parts_head_stride + i;

  float m = -INFINITY, l = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float base = 0.f;
  for (int64_t c0 = 0; c0 < p.num_parts; c0 += kTpr) {
    const int64_t s = c0 + t;
    float lse_s = -INFINITY;
    if (active && s < p.num_parts)
      lse_s = load_f32(lse_row + s * p.lse_parts_part_stride, io, DecIo::kLseParts);
    float cmax = lse_s;
#pragma unroll
    for (int off = kTpr / 2; off > 0; off >>= 1)
      cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, off, kTpr));
    const float m_new = fmaxf(m, cmax);
    base = m_new == -INFINITY ? 0.f : m_new;
    const float r = expf(m - base);  // 0 while nothing was seen (m = -inf)
    l *= r;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= r;
    const int jn = static_cast<int>(min(static_cast<int64_t>(kTpr), p.num_parts - c0));
    for (int j = 0; j < jn; ++j) {
      const float lse_j = __shfl_sync(0xffffffffu, lse_s, j, kTpr);
      if (active && lse_j > -INFINITY) {  // an empty part (or a NaN) contributes nothing
        const float w = expf(lse_j - base);
        float v[8];
        load_part8(o_row + (c0 + j) * p.o_parts_part_stride, v, io);
        l += w;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += w * v[e];
      }
    }
    m = m_new;
  }
  if (active) {
    const bool empty = !(l > 0.f);
    const float inv_l = empty ? 0.f : 1.f / l;
    const uint4 packed = make_uint4(
        MmaT::pack(acc[0] * inv_l, acc[1] * inv_l), MmaT::pack(acc[2] * inv_l, acc[3] * inv_l),
        MmaT::pack(acc[4] * inv_l, acc[5] * inv_l), MmaT::pack(acc[6] * inv_l, acc[7] * inv_l));
    store_16(static_cast<Elem*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride +
                 h * p.o_head_stride + col,
             packed, io, DecIo::kO);
    if (t == 0 && p.lse)
      store_f32(p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + i,
                empty ? -INFINITY : base + logf(l), io, DecIo::kLse);
  }
  io.flush(p.io_counters);
}

}  // namespace fg
