// flashgen: the forward FlashAttention kernel on Hopper (sm_90a): TMA loads into an mbarrier
// ring, SS-wgmma for Q K^T and RS-wgmma for P V (P straight from S's accumulators).
//
// Glossary
//   CTA        one query tile of block_m = 64 * groups rows of one (batch b, head h)
//   group      a consumer warpgroup (4 warps, 128 threads) owning 64 query rows; warp w of
//              it owns 16 of them, and its wgmma accumulators have the m16n8 C layout per
//              warp (sm90.cuh), so mask, dropout and the online softmax are the mma.sync
//              forward's own functions (frag.cuh, softmax.cuh) on acc[1][kNT][4]
//   Dp         head_dim rounded up to 64 (the TMA box width): columns d..Dp-1 read as 0 and
//              are never stored, so every head dim runs on 64-column SW128 boxes. The MMAs
//              skip what is zero: Q K^T runs ceil(d / 16) k16 slices, and where d_v is not
//              a multiple of 64 P V runs 64-column chunks then a tail of d_v % 64 (kOTail),
//              not Dp_v
//   d, d_v     kHeadDim: Q and K (Dp, kBoxes boxes); kHeadDimV: V and O (kHeadDimVPad,
//              kBoxesV boxes); d_v = d unless the spec sets head_dim_v
//   slot       ring position of a K/V tile (it % stages); full[slot] completes when its TMA
//              bytes land, empty[slot] when every warp has finished reading it
//   parity     the phase of a slot's barriers for tile it: (it / stages) & 1
//   schedule   the K/V tiles the CTA visits (fwd_cta.cuh: the forward's dense range or its
//              block-sparse row); producer and consumers walk the same one, so slot and
//              parity of tile it agree on both sides. Sparse: the producer reads each tile's
//              index and hands it to the consumers in s_tile[slot], written before its
//              full[slot] arrive (release) and read after the wait (acquire)
//
// Per CTA: a producer warpgroup (24 registers) whose one thread loads Q and streams the K/V
// tiles by TMA into the ring; every consumer group (the rest of the registers) then, per
// tile: waits full[slot], S = Q K^T (wgmma, fp32), masks (mask.cuh), folds S into the online
// softmax, dropout (frag.cuh, the forward's Philox stream), O += P V (wgmma, P in registers),
// and signals empty[slot]. With three or more stages, Q K^T of the next tile and P V of this
// one are issued together and the groups take turns (ping-pong), FlashAttention-3's schedule.
// O = acc / l and LSE are stored from registers. Rows without a visible key give O = 0 and
// LSE = -inf, as everywhere.
//
// Varlen: the maps span the packed tensors (one batch entry, total_q / total_k rows), and a
// sequence's tiles start at its packed row (cu_seqlens). A tile running past the sequence's
// end loads rows of the next sequence (zeros past total): the mask never lets a score see
// them (col_end), their P is exactly 0, and O and LSE are stored for the sequence's rows only.
// Those V rows are multiplied by P = 0, so they must be finite (they are the next sequence's
// values, or rows of the packed tensor below total_k).
//
// instrument_io: the producer thread counts, per TMA box, the bytes it requests inside the
// sequence (rows below Sq or Sk, columns below head_dim): TMA zero-fills rows past the map's
// extent and the padded columns without reading them, which makes that count exact for dense
// calls; a varlen box's rows past its sequence are read from the next sequence but not
// counted (verify/io_model.py). META, O, LSE and the keep-mask are counted as the mma.sync
// forward counts them (tile_io.cuh).
#pragma once

#include <cuda.h>
#include <stdint.h>

#include "arch.cuh"
#include "block_info.cuh"
#include "frag.cuh"
#include "fwd_cta.cuh"
#include "mask.cuh"
#include "mask_mod.cuh"
#include "params.h"
#include "philox.cuh"
#include "schedule.cuh"
#include "sm90.cuh"
#include "sm90_narrow.cuh"
#include "score_mod.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"
#include "warp_mma.cuh"

// Ablation switches, for bench/ablation_bench.py only (FlashAttention-3's Table 2: each
// feature's share of the speed, measured side by side). Shipped builds never define them
// (generator/compile.py passes no -D), so the defaults below are the shipped kernel. Defined
// to 1 on the nvcc command line:
//   FG_SM90_ABLATE_NO_PINGPONG    the consumer warpgroups do not take turns (kPingPong false)
//   FG_SM90_ABLATE_NO_OVERLAP     the plain loop at any stage count (kOverlap false; no
//                                 ping-pong either, which only the overlapped loop has)
//   FG_SM90_ABLATE_NO_SETMAXNREG  no register reallocation: the producer warpgroup stays and
//                                 every warp keeps the launch's registers (not "no warp
//                                 specialisation": the TMA producer warpgroup still exists)
// The K/V stages need no switch: the tile's `stages` is 1..4 (1 and 2 run the plain loop; one
// slot is a correct ring, its refill waiting for the release of the tile before).
#ifndef FG_SM90_ABLATE_NO_PINGPONG
#define FG_SM90_ABLATE_NO_PINGPONG 0
#endif
#ifndef FG_SM90_ABLATE_NO_OVERLAP
#define FG_SM90_ABLATE_NO_OVERLAP 0
#endif
#ifndef FG_SM90_ABLATE_NO_SETMAXNREG
#define FG_SM90_ABLATE_NO_SETMAXNREG 0
#endif

namespace fg {

// The TMA tensor maps of one call (built by the launcher, sm90_host.h).
struct FwdSm90Maps {
  CUtensorMap q, k, v;
  int q_heads_inner, kv_heads_inner;  // coordinate order of the maps (make_tmap_bshd)
};

template <class S>
struct FwdSm90Config : S {
  using S::kBlockM, S::kBlockN, S::kHeadDim, S::kHeadDimV, S::kWarps, S::kStages;
  using Elem = typename S::Elem;
  // `warps` are the consumers; one more warpgroup is the TMA producer.
  static constexpr int kConsumerThreads = kWarps * 32;
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kGroups = kWarps / 4;
  // setmaxnreg: the producer keeps 24 registers, the consumers share the rest of the 64K
  // (multiples of 8: 240 for one or two consumer warpgroups, 160 for three).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kGroups == 3 ? 160 : 240;
  using S::kHeadDimPad, S::kHeadDimVPad;  // head_dim, head_dim_v rounded up to 64 (the TMA box)
  static_assert(kHeadDimPad == (kHeadDim + 63) / 64 * 64, "head_dim_pad: the next multiple of 64");
  static_assert(kHeadDimVPad == (kHeadDimV + 63) / 64 * 64, "head_dim_v_pad: next multiple of 64");
  static constexpr int kBoxes = kHeadDimPad / 64, kBoxesV = kHeadDimVPad / 64;  // Q/K, V
  // Q K^T's k16 slices: the columns past head_dim are zero (TMA's fill) in Q and K alike
  static constexpr int kQkSlices = (kHeadDim + 15) / 16;
  // P V's wgmma N: kOChunks chunks of kOChunk columns, then, when d_v is not a multiple of
  // 64, one tail chunk of kOTailN = d_v % 64 (the boxes' zero-filled columns are not
  // multiplied); otherwise chunks over all of kHeadDimVPad (128 wide where they divide it)
  static constexpr bool kOTail = kHeadDimV % 64 != 0;
  static constexpr int kOChunk = kOTail ? 64 : kHeadDimVPad % 128 == 0 ? 128 : 64;
  static constexpr int kOChunks = kOTail ? kHeadDimV / 64 : kHeadDimVPad / kOChunk;
  static constexpr int kOTailN = kOTail ? kHeadDimV % 64 : 0;
  static constexpr int kNT = kBlockN / 8;
  static constexpr int kQBox = kBlockM * 64, kKvBox = kBlockN * 64;  // elements per box
  static constexpr int kElem = static_cast<int>(sizeof(Elem));
  static constexpr int kQBytes = kBlockM * kHeadDimPad * kElem;
  static constexpr int kKvBytes = kBlockN * kHeadDimPad * kElem;  // one K tile
  static constexpr int kVBytes = kBlockN * kHeadDimVPad * kElem;  // one V tile
  static constexpr int kSmemBytes = kQBytes + kStages * (kKvBytes + kVBytes) + 1024;  // + align
  // Softmax overlapped with the neighbouring tiles' wgmma (with two stages the next tile's
  // load would wait for the slot released at the end of this one, exposing its latency).
  static constexpr bool kOverlap = kStages >= 3 && !FG_SM90_ABLATE_NO_OVERLAP;
  // ... and the consumer warpgroups take turns issuing their wgmma (ping-pong), so one's
  // softmax runs while another's GEMMs occupy the tensor cores.
  static constexpr bool kPingPong = kOverlap && kGroups >= 2 && !FG_SM90_ABLATE_NO_PINGPONG;
  static constexpr bool kRegRealloc = !FG_SM90_ABLATE_NO_SETMAXNREG;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 65536, "registers");

  static_assert(kWarps % 4 == 0 && kGroups >= 1 && kGroups <= 3, "1 to 3 warpgroups");
  static_assert(kBlockM == 64 * kGroups, "block_m = 64 rows per warpgroup");
  static_assert(kBlockN == 64 || kBlockN == 128, "block_n: 64 or 128");
  static_assert(kHeadDim % 8 == 0 && kHeadDim >= 8 && kHeadDim <= 256, "head_dim");
  static_assert(kHeadDimV % 8 == 0 && kHeadDimV >= 8 && kHeadDimV <= 256, "head_dim_v");
  static_assert(kStages >= 1 && kStages <= 4, "stages");
  static_assert(!S::kKeepMaskOut || S::kDropout, "the keep-mask output needs dropout");
};

template <class C>
__device__ __forceinline__ void fwd_sm90_kernel_body(const fg_fwd_params& p,
                                                     const FwdSm90Maps& maps) {
  using Elem = typename C::Elem;
  using MmaT = Mma<Elem>;
  using namespace sm90;
  extern __shared__ unsigned char smem_raw[];  // SW128 tiles need 1024-byte alignment
  Elem* sQ = reinterpret_cast<Elem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                     ~uintptr_t{1023});
  Elem* sK = sQ + C::kBlockM * C::kHeadDimPad;
  Elem* sV = sK + C::kStages * C::kBlockN * C::kHeadDimPad;  // V slots: kBlockN * kHeadDimVPad
  __shared__ uint64_t bar_q, full[C::kStages], empty[C::kStages];
  __shared__ int32_t s_tile[C::kSparse ? C::kStages : 1];  // sparse: K/V tile of each slot

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = warp / 4, g = lane >> 2, t = lane & 3;
  Io<C::kInstrumentIo, FwdIo> io_setup;  // the setup's META reads (cu_seqlens, layout counts)

  // ---- which (query tile, head, batch) this CTA is (fwd_cta.cuh), and where its sequence lies
  fwd_record_philox<C>(p);
  const FwdTileId id = fwd_tile_id<C>(p);
  if (id.b >= p.batch) return;  // a grid larger than the problem's (the launcher never makes one)
  const int64_t qt = id.qt, h = id.h, b = id.b;
  const SeqInfo<C::kVarlen> seq(b, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k,
                                io_setup, tid == 0);
  const int64_t sq = seq.sq, sk = seq.sk;
  const int64_t r0 = qt * C::kBlockM;
  if (r0 >= sq) {  // a shorter sequence of a varlen batch: the whole CTA leaves, before any barrier
    io_setup.flush(p.io_counters);
    return;
  }
  const int64_t valid_rows = min(static_cast<int64_t>(C::kBlockM), sq - r0);
  const int64_t r1 = r0 + valid_rows - 1;
  const int64_t hk = C::kGqa ? h / (p.heads / p.kv_heads) : h;
  Elem* gO = static_cast<Elem*>(p.o) + seq.q_off(p.o_batch_stride, p.o_row_stride, r0) +
             h * p.o_head_stride;
  float* gLse = p.lse + seq.lse_off(p.lse_batch_stride, p.lse_head_stride, h, r0);

  const MaskPolicy<C::kCausal, C::kWindow> mask(sq, sk, p.window_left, p.window_right);
  // The mask stage of a spec's mask_mod (mask_mod.cuh; off and free without one): it trims
  // the schedule's EMPTY ends; the producer and consumers walk the same tiles, so an EMPTY
  // tile inside the range is masked whole rather than skipped. A mask reading per-token
  // vectors masks every tile per element (its per-tile class, a loop over the tile's tokens,
  // spilled beside the consumers' accumulators: 88 bytes at d 128, ptxas 13.0).
  const MaskModOf<C> umask(p.score, b, h, seq.q_off(p.seqlen_q, 1, 0), seq.k_off(p.seqlen_k, 1, 0),
                           sq, sk);
  const FwdSchedule<C> sched = fwd_schedule<C>(p, id, mask, r0, r1, io_setup, tid == 0, umask);
  const int n_iter = sched.count;

  if (tid == 0) {
    mbar_init(&bar_q, 1);
#pragma unroll
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], C::kConsumerThreads);
    }
    mbar_init_fence();
  }
  __syncthreads();
  // instrument_io: the setup's counters are flushed before the roles split, so no 64-bit
  // counter of theirs stays live through a loop (the producer has 24 registers); each role
  // counts into a fresh one from here on.
  io_setup.flush(p.io_counters);
  Io<C::kInstrumentIo, FwdIo> io;

  // TMA coordinates (column, row, head, batch) in the maps' dimension order. Rows are the
  // sequence's own (dense: batch coordinate b) or packed rows (varlen: the maps' one batch
  // entry, rows from the sequence's start q0 / k0, which are 0 for dense calls).
  const int tma_b = C::kVarlen ? 0 : static_cast<int>(b);
  auto tma = [&](Elem* dst, const CUtensorMap& map, bool heads_inner, uint64_t* bar, int col,
                 int64_t row, int64_t head) {
    tma_load_bshd(dst, &map, heads_inner, bar, col, row, head, tma_b);
  };
  // instrument_io: box j of a tile (columns 64 j .. 64 j + 63) reads its rows inside the
  // sequence times its min(64, head_dim - 64 j) columns (see the top); summed over the boxes,
  // a tile's K bytes are rows * head_dim * elt (V's: rows * head_dim_v * elt).
  auto tile_bytes = [](uint64_t rows) { return rows * C::kHeadDim * C::kElem; };
  auto tile_bytes_v = [](uint64_t rows) { return rows * C::kHeadDimV * C::kElem; };
  // Loads K/V tile it into its slot (the producer thread); returns its rows inside the sequence.
  auto load_kv = [&](int it) -> uint32_t {
    const int slot = it % C::kStages;
    const int64_t n = sched.tile(it, io, false);  // sparse: META counted by the caller
    if constexpr (C::kSparse) s_tile[slot] = static_cast<int32_t>(n);  // before the arrive
    const int64_t row = seq.k0 + n * C::kBlockN;
    mbar_arrive_expect_tx(&full[slot], C::kKvBytes + C::kVBytes);
    // box j of K, then of V (d_v != d: one of them has fewer boxes)
#pragma unroll
    for (int j = 0; j < (C::kBoxes > C::kBoxesV ? C::kBoxes : C::kBoxesV); ++j) {
      if (j < C::kBoxes)
        tma(sK + slot * C::kBlockN * C::kHeadDimPad + j * C::kKvBox, maps.k, maps.kv_heads_inner,
            &full[slot], j * 64, row, hk);
      if (j < C::kBoxesV)
        tma(sV + slot * C::kBlockN * C::kHeadDimVPad + j * C::kKvBox, maps.v,
            maps.kv_heads_inner, &full[slot], j * 64, row, hk);
    }
    // (a sparse layout may name a tile past a shorter sequence: none of its rows count)
    return static_cast<uint32_t>(
        max(int64_t{0}, min(static_cast<int64_t>(C::kBlockN), sk - n * C::kBlockN)));
  };
  // ---- producer warpgroup: one thread issues every TMA load; slot s is refilled once every
  // consumer thread has released it (empty[s]) ----------------------------------------------
  if (warp >= C::kWarps) {
    if constexpr (C::kRegRealloc) regs_dealloc<C::kProducerRegs>();
    if (warp == C::kWarps && lane == 0 && n_iter > 0) {
      mbar_arrive_expect_tx(&bar_q, C::kQBytes);
#pragma unroll
      for (int j = 0; j < C::kBoxes; ++j)
        tma(sQ + j * C::kQBox, maps.q, maps.q_heads_inner, &bar_q, j * 64, seq.q0 + r0, h);
      // instrument_io: the rows of the K/V tiles are summed in 32 bits and counted once after
      // the loop, which keeps the producer within its 24 registers (64-bit counters updated
      // per tile spilled); likewise the n_iter layout indices a sparse schedule read.
      uint32_t kv_rows = 0;
      for (int it = 0; it < n_iter; ++it) {
        if (it >= C::kStages)
          mbar_wait(&empty[it % C::kStages], ((it / C::kStages) - 1) & 1);
        kv_rows += load_kv(it);
      }
      io.add(FwdIo::kQ, tile_bytes(valid_rows));
      io.add(FwdIo::kK, tile_bytes(kv_rows));
      io.add(FwdIo::kV, tile_bytes_v(kv_rows));
      if (C::kSparse) io.add(FwdIo::kMeta, 4 * static_cast<uint64_t>(n_iter));
    }
    io.flush(p.io_counters);  // the whole warp, converged again
    return;
  }
  if constexpr (C::kRegRealloc) regs_alloc<C::kConsumerRegs>();

  RowState st[2] = {RowState{-INFINITY, 0.f}, RowState{-INFINITY, 0.f}};
  // O's accumulators: the chunks, then the tail (arrays of at least one, unused when empty)
  float acc_o[C::kOChunks > 0 ? C::kOChunks : 1][C::kOChunk / 8][4];
  float acc_t[C::kOTail ? C::kOTailN / 8 : 1][4];
#pragma unroll
  for (int c = 0; c < C::kOChunks; ++c)
#pragma unroll
    for (int j = 0; j < C::kOChunk / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[c][j][e] = 0.f;
#pragma unroll
  for (int j = 0; j < C::kOTailN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_t[j][e] = 0.f;

  const int row0 = warp * 16;  // the warp's first row of the tile (group * 64 + 16 * w)
  const ScoreModOf<C> mod(p.score, p.softmax_scale, b, h, io, tid == 0, FwdIo::kMeta);
  const FwdDropout drop = fwd_dropout<C>(p, b, h);

  // ---- the steps of one K/V tile, shared by both loop orders below ------------------------
  auto slot_k = [&](int it) { return sK + (it % C::kStages) * C::kBlockN * C::kHeadDimPad; };
  auto slot_v = [&](int it) { return sV + (it % C::kStages) * C::kBlockN * C::kHeadDimVPad; };
  // Issues S = Q K^T of tile it (k16 slice kk: box kk / 4, 32 bytes * (kk % 4) into each
  // 128-byte row) and commits it as one wgmma group.
  auto issue_s = [&](float (&s)[C::kNT * 4], int it) {
    mbar_wait(&full[it % C::kStages], (it / C::kStages) & 1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C::kQkSlices; ++kk) {
      const int box = kk / 4, col = (kk % 4) * 16;
      Wgmma<Elem, C::kBlockN>::template ss<0>(
          s, desc_k_major(sQ + box * C::kQBox + group * 64 * 64 + col),
          desc_k_major(slot_k(it) + box * C::kKvBox + col), kk > 0);
    }
    wgmma_commit();
  };
  // Mask, online softmax (alpha: the rescale of acc_o, applied by the caller) and dropout,
  // in place: acc_s becomes P.
  // (Sparse: tile it's index comes from s_tile, read after its full[slot] wait in issue_s and
  // before its release.)
  auto softmax = [&](float (&acc_s)[1][C::kNT][4], int it, float (&alpha)[2]) {
    const int64_t n = C::kSparse ? s_tile[it % C::kStages] : sched.tile(it, io, false);
    score_frag(acc_s, mod, tile_at(r0 + row0, n * C::kBlockN, mask), lane);
    if (fwd_tile_masked<C>(sched, mask, it, n, r0, r1))
      mask_frag(acc_s, mask.tile(r0 + row0, n * C::kBlockN), lane);
    if (MaskModOf<C>::kOn &&
        (MaskModOf<C>::kTokens || umask.kv_tile_class(r0, r1, n, C::kBlockN) != kMaskFull))
      umask.mask_frag(acc_s, r0 + row0, n * C::kBlockN, lane);
    online_softmax_update(st, acc_s[0], mod.scale_log2, alpha);
    if (C::kDropout)
      fwd_dropout_frag<C>(acc_s, drop.rng, p, b, h, sq, sk, r0 + row0, n * C::kBlockN, lane, io);
  };
  // P packed as RS-wgmma A operands (S's n8 tiles 2 kk2 and 2 kk2 + 1 are P's k16 slice kk2).
  auto pack_p = [&](const float (&acc_s)[1][C::kNT][4], uint32_t (&pf)[C::kBlockN / 16][4]) {
#pragma unroll
    for (int kk2 = 0; kk2 < C::kBlockN / 16; ++kk2)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        pf[kk2][r] = MmaT::pack(acc_s[0][2 * kk2 + (r >> 1)][2 * (r & 1)],
                                acc_s[0][2 * kk2 + (r >> 1)][2 * (r & 1) + 1]);
  };
  // Issues O += P V of tile it (V's rows 16 kk2 .. start 2048 bytes * kk2 into each box; the
  // boxes of one wgmma N chunk are kKvBox apart) as one wgmma group.
  auto issue_pv = [&](const uint32_t (&pf)[C::kBlockN / 16][4], int it) {
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < C::kOChunks; ++c) {
      auto& o_flat = reinterpret_cast<float(&)[C::kOChunk / 2]>(acc_o[c]);
#pragma unroll
      for (int kk2 = 0; kk2 < C::kBlockN / 16; ++kk2)
        Wgmma<Elem, C::kOChunk>::template rs<1>(
            o_flat, pf[kk2],
            desc_mn_major(slot_v(it) + (c * C::kOChunk / 64) * C::kKvBox + kk2 * 16 * 64,
                          C::kKvBox * C::kElem),
            1);
    }
    if constexpr (C::kOTail) {  // the tail: the first d_v % 64 columns of the last box
      auto& t_flat = reinterpret_cast<float(&)[C::kOTailN / 2]>(acc_t);
#pragma unroll
      for (int kk2 = 0; kk2 < C::kBlockN / 16; ++kk2)
        Wgmma<Elem, C::kOTailN>::template rs<1>(
            t_flat, pf[kk2],
            desc_mn_major(slot_v(it) + C::kOChunks * C::kKvBox + kk2 * 16 * 64,
                          C::kKvBox * C::kElem),
            1);
    }
    wgmma_commit();
  };
  auto fence_o = [&] {
#pragma unroll
    for (int c = 0; c < C::kOChunks; ++c)
      reg_fence(reinterpret_cast<float(&)[C::kOChunk / 2]>(acc_o[c]));
    if constexpr (C::kOTail) reg_fence(reinterpret_cast<float(&)[C::kOTailN / 2]>(acc_t));
  };
  auto scale_o = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int c = 0; c < C::kOChunks; ++c) scale_rows(acc_o[c], alpha);
    if constexpr (C::kOTail) scale_rows(acc_t, alpha);
  };
  // This thread is done with tile it's slot (every consumer thread arrives: no divergence
  // beside in-flight wgmma).
  auto release = [&](int it) { mbar_arrive(&empty[it % C::kStages]); };
  // Ping-pong: a warpgroup issues its wgmma between taking its turn (named barrier 1 + group)
  // and passing it on to the next group; the last group opens the first turn.
  auto turn_take = [&] {
    if constexpr (C::kPingPong) named_bar_sync(1 + group, 256);
  };
  auto turn_pass = [&] {
    if constexpr (C::kPingPong) named_bar_arrive(1 + (group + 1) % C::kGroups, 256);
  };
  if constexpr (C::kPingPong)
    if (group == C::kGroups - 1) named_bar_arrive(1, 256);

  if (n_iter > 0) mbar_wait(&bar_q, 0);
  if constexpr (C::kOverlap) {
    // FlashAttention-3's intra-warpgroup pipelining: Q K^T of tile it + 1 is issued before
    // P V of tile it, and tile it + 1's softmax runs while P V of tile it is on the tensor
    // cores. wgmma inputs (P, the rescaled O) are only written while no S is in flight that
    // they would wait behind, so ptxas keeps the wgmma pipeline (no serialisation).
    float acc_s[1][C::kNT][4];
    auto& s_flat = reinterpret_cast<float(&)[C::kNT * 4]>(acc_s);
    uint32_t pf[C::kBlockN / 16][4];
    float alpha[2];
    if (n_iter > 0) {
      turn_take();
      issue_s(s_flat, 0);
      turn_pass();
      wgmma_wait<0>();
      reg_fence(s_flat);
      softmax(acc_s, 0, alpha);
      pack_p(acc_s, pf);
    }
    // Every tile but the last has a next one; the last is peeled off, so each wgmma_wait
    // below retires the same groups on every path (ptxas serialises wgmma otherwise).
    for (int it = 0; it + 1 < n_iter; ++it) {
      scale_o(alpha);
      turn_take();
      issue_s(s_flat, it + 1);
      issue_pv(pf, it);
      turn_pass();
      wgmma_wait<1>();  // Q K^T of tile it + 1 (P V of tile it still runs)
      reg_fence(s_flat);
      softmax(acc_s, it + 1, alpha);
      wgmma_wait<0>();
      fence_o();
      release(it);
      pack_p(acc_s, pf);
    }
    if (n_iter > 0) {
      scale_o(alpha);
      turn_take();
      issue_pv(pf, n_iter - 1);
      turn_pass();
      wgmma_wait<0>();
      fence_o();
      release(n_iter - 1);
    }
  } else {
    for (int it = 0; it < n_iter; ++it) {
      float acc_s[1][C::kNT][4];
      auto& s_flat = reinterpret_cast<float(&)[C::kNT * 4]>(acc_s);
      issue_s(s_flat, it);
      wgmma_wait<0>();
      reg_fence(s_flat);
      float alpha[2];
      uint32_t pf[C::kBlockN / 16][4];
      softmax(acc_s, it, alpha);
      pack_p(acc_s, pf);
      scale_o(alpha);
      issue_pv(pf, it);
      wgmma_wait<0>();
      fence_o();
      release(it);
    }
  }

  // ---- epilogue: O = acc_o / l, LSE; empty rows give 0 and -inf ----------------------------
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float inv_l, lse;
    mod.finalize(st[r], inv_l, lse);
    // Dropout's 1/(1-p) scales O once, in fp32 (FlashAttention-2 does the same): applied
    // to P before its 16-bit rounding it would cost up to 2x the baseline's error
    // (a row max p = 1 is exact in bf16, 1/(1-p) is not).
    if (C::kDropout) inv_l *= drop.scale;
    const int row = row0 + g + r * 8;
    if (row < valid_rows) {
#pragma unroll
      for (int c = 0; c < C::kOChunks; ++c)
#pragma unroll
        for (int j = 0; j < C::kOChunk / 8; ++j) {
          const int col = c * C::kOChunk + j * 8 + 2 * t;
          if (col < C::kHeadDimV)
            store_pair(gO + row * p.o_row_stride + col,
                       MmaT::pack(acc_o[c][j][2 * r] * inv_l, acc_o[c][j][2 * r + 1] * inv_l),
                       io, FwdIo::kO);
        }
#pragma unroll
      for (int j = 0; j < C::kOTailN / 8; ++j)  // the tail's columns are all below d_v
        store_pair(gO + row * p.o_row_stride + C::kOChunks * C::kOChunk + j * 8 + 2 * t,
                   MmaT::pack(acc_t[j][2 * r] * inv_l, acc_t[j][2 * r + 1] * inv_l), io,
                   FwdIo::kO);
      if (t == 0) store_f32(gLse + row, lse, io, FwdIo::kLse);
    }
  }
  io.flush(p.io_counters);
}

}  // namespace fg
