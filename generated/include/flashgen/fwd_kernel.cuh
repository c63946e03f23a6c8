// flashgen: the forward FlashAttention kernel (FlashAttention-2 loop order) on mma.sync.
//
// Glossary
//   CTA       one query tile of block_m rows of one (batch b, head h); grid is flattened
//   warp w    owns query rows [w * 16 * kMT, (w + 1) * 16 * kMT) of the tile: kMT m16 tiles
//   Tc, n     K/V tiles of block_n keys; n indexes them, `it` counts the ones visited
//   slot      smem ring buffer position of a K/V tile: it % kStages
//   acc_s     S = Q K^T of one K/V tile, frag C per (m16 tile, n8 tile), fp32
//   acc_o     the unnormalised output, frag C per (m16 tile, n8 column tile of d), fp32
//   st        online softmax state (m_i, l_i) of the thread's two rows per m16 tile
//
// Per CTA: Q tile -> smem (and to registers when small); for each scheduled K/V tile:
// S = Q K^T (mma), the score stage (score_mod.cuh), mask if the policy says the tile needs
// it, online softmax, dropout,
// acc_o += P V with P taken straight from the S accumulators (the m16n8 C layout of two
// adjacent n8 tiles is the m16k16 A layout); finally O = acc_o / l and LSE.
// K/V tiles stream through a kStages-deep cp.async ring, so the next tile's loads overlap
// this tile's maths.
#pragma once

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
#include "score_mod.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"
#include "warp_mma.cuh"

namespace fg {

// S: the kernel's spec as named constants, rendered by the family template (Elem, kHeadDim,
// kBlockM, kBlockN, kWarps, kStages, kCausal, kWindow, kVarlen, kGqa, kDropout,
// kKeepMaskOut, kSparse, kInstrumentIo). FwdConfig adds what the mainloop derives from it.
template <class S>
struct FwdConfig : S {
  using S::kBlockM, S::kBlockN, S::kHeadDim, S::kWarps, S::kStages;
  using Elem = typename S::Elem;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMT = kBlockM / (16 * kWarps);  // m16 tiles per warp
  // kHeadDimPad: the head dim rounded up to the k16 steps of Q K^T. Columns d..kHeadDimPad-1
  // of the Q, K and V tiles are zero-filled in smem (never read from HBM), so their products
  // are 0, and O's padded columns are never stored.
  using S::kHeadDimPad;
  static constexpr int kStride = kHeadDimPad + 8;      // smem row stride, elements
  static constexpr int kNT = kBlockN / 8;              // n8 tiles of S
  static constexpr int kDT = kHeadDimPad / 8;          // n8 tiles of O along d
  static constexpr int kKS = kHeadDimPad / 16;         // k16 steps of Q K^T
  static constexpr int kPS = kBlockN / 16;             // k16 steps of P V
  // Q fragments stay in registers when they cost at most 32 of them; otherwise they are
  // re-read from smem with ldmatrix each tile, which keeps large head dims off local memory.
  static constexpr bool kQInRegs = kMT * kKS * 4 <= 32;
  static constexpr int kSmemBytes =
      (kBlockM + 2 * kStages * kBlockN) * kStride * static_cast<int>(sizeof(Elem));

  static_assert(kHeadDim % 8 == 0 && kHeadDim >= 8 && kHeadDim <= 256, "head_dim");
  static_assert(kHeadDimPad == (kHeadDim + 15) / 16 * 16, "head_dim_pad: the next multiple of 16");
  static_assert(kBlockN % 16 == 0, "block_n must be a multiple of 16");
  static_assert(kMT >= 1 && kMT * 16 * kWarps == kBlockM, "block_m = 16 * warps * {1,2}");
  static_assert(kStages >= 1 && kStages <= 3, "stages");
  static_assert(!S::kKeepMaskOut || S::kDropout, "the keep-mask output needs dropout");
};

template <class C>
__device__ __forceinline__ void fwd_kernel_body(const fg_fwd_params& p) {
  using Elem = typename C::Elem;
  using MmaT = Mma<Elem>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  Elem* sK = sQ + C::kBlockM * C::kStride;
  Elem* sV = sK + C::kStages * C::kBlockN * C::kStride;
  __shared__ int64_t s_tile[C::kStages];  // sparse: K/V tile index of each ring slot

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const LaneOffsets lo(lane);
  Io<C::kInstrumentIo, FwdIo> io;

  // ---- which (query tile, head, batch) this CTA is (fwd_cta.cuh), and where its sequence lies
  fwd_record_philox<C>(p);
  const FwdTileId id = fwd_tile_id<C>(p);
  if (id.b >= p.batch) return;  // a grid larger than the problem's (the launcher never makes one)
  const int64_t qt = id.qt, h = id.h, b = id.b;
  const SeqInfo<C::kVarlen> seq(b, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k, io,
                                tid == 0);
  const int64_t sq = seq.sq, sk = seq.sk;
  const int64_t r0 = qt * C::kBlockM;
  if (r0 >= sq) {  // a shorter sequence of a varlen batch
    io.flush(p.io_counters);
    return;
  }
  const int64_t valid_rows = min(static_cast<int64_t>(C::kBlockM), sq - r0);
  const int64_t r1 = r0 + valid_rows - 1;
  const int64_t hk = C::kGqa ? h / (p.heads / p.kv_heads) : h;

  const Elem* gQ = static_cast<const Elem*>(p.q) + seq.q_off(p.q_batch_stride, p.q_row_stride, r0) +
                   h * p.q_head_stride;
  const Elem* gK = static_cast<const Elem*>(p.k) + seq.k_off(p.k_batch_stride, p.k_row_stride, 0) +
                   hk * p.k_head_stride;
  const Elem* gV = static_cast<const Elem*>(p.v) + seq.k_off(p.v_batch_stride, p.v_row_stride, 0) +
                   hk * p.v_head_stride;
  Elem* gO = static_cast<Elem*>(p.o) + seq.q_off(p.o_batch_stride, p.o_row_stride, r0) +
             h * p.o_head_stride;
  float* gLse = p.lse + seq.lse_off(p.lse_batch_stride, p.lse_head_stride, h, r0);

  const MaskPolicy<C::kCausal, C::kWindow> mask(sq, sk, p.window_left, p.window_right);
  // The score stage of (b, h) (score_mod.cuh): modifiers, the softmax's scale, the sink.
  const ScoreModOf<C> mod(p.score, p.softmax_scale, b, h, io, tid == 0, FwdIo::kMeta);
  // The mask stage of a spec's mask_mod (mask_mod.cuh; off and free without one).
  const MaskModOf<C> umask(p.score, b, h, seq.q_off(p.seqlen_q, 1, 0), seq.k_off(p.seqlen_k, 1, 0),
                           sq, sk);

  // ---- the tile schedule: a dense range visited from the top, or the sparse lists ----------
  const FwdSchedule<C> sched = fwd_schedule<C>(p, id, mask, r0, r1, io, tid == 0, umask);
  const int n_iter = sched.count;

  auto load_kv = [&](int it) {
    const int slot = it % C::kStages;
    const int64_t n = sched.tile(it, io, tid == 0);
    if (C::kSparse && tid == 0) s_tile[slot] = n;
    const int64_t rows = min(static_cast<int64_t>(C::kBlockN), sk - n * C::kBlockN);
    load_tile_async<C::kBlockN, C::kHeadDimPad, C::kThreads, C::kStride, C::kHeadDim>(
        sK + slot * C::kBlockN * C::kStride, gK + n * C::kBlockN * p.k_row_stride, p.k_row_stride,
        rows, io, FwdIo::kK);
    load_tile_async<C::kBlockN, C::kHeadDimPad, C::kThreads, C::kStride, C::kHeadDim>(
        sV + slot * C::kBlockN * C::kStride, gV + n * C::kBlockN * p.v_row_stride, p.v_row_stride,
        rows, io, FwdIo::kV);
  };

  // Explicit initialisation: with kMT = 2, nvcc 13.0 left st[1][*].m at 0 instead of the
  // member initialiser's -inf (seen on an H200: rows of the second m16 tile whose scores were
  // all negative came out empty), so the state is set here, not by a default initialiser.
  RowState st[C::kMT][2];
  float acc_o[C::kMT][C::kDT][4];
#pragma unroll
  for (int mt = 0; mt < C::kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) st[mt][r] = RowState{-INFINITY, 0.f};
#pragma unroll
    for (int dt = 0; dt < C::kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
  }

  const int warp_row0 = warp * 16 * C::kMT;
  // Per-lane shared addresses of the ldmatrix loads (see LaneOffsets); tiles add constants.
  constexpr uint32_t kElemBytes = sizeof(Elem);
  constexpr uint32_t kSlotBytes = C::kBlockN * C::kStride * kElemBytes;
  const uint32_t q_lane = smem_addr(sQ) + ((warp_row0 + lo.a_row) * C::kStride + lo.a_col) * kElemBytes;
  const uint32_t k_lane = smem_addr(sK) + (lo.b_row * C::kStride + lo.b_col) * kElemBytes;
  const uint32_t v_lane = smem_addr(sV) + (lo.a_row * C::kStride + lo.a_col) * kElemBytes;
  const FwdDropout drop = fwd_dropout<C>(p, b, h);

  if (n_iter > 0) {
    load_tile_async<C::kBlockM, C::kHeadDimPad, C::kThreads, C::kStride, C::kHeadDim>(
        sQ, gQ, p.q_row_stride, valid_rows, io, FwdIo::kQ);
    cp_async_commit();
#pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
      if (s < n_iter) load_kv(s);
      cp_async_commit();
    }
    cp_async_wait<C::kStages - 1>();  // the Q group
    __syncthreads();

    uint32_t qf[C::kQInRegs ? C::kMT : 1][C::kQInRegs ? C::kKS : 1][4];
    if (C::kQInRegs) {
#pragma unroll
      for (int mt = 0; mt < C::kMT; ++mt)
#pragma unroll
        for (int kk = 0; kk < C::kKS; ++kk)
          ldmatrix_x4(qf[C::kQInRegs ? mt : 0][C::kQInRegs ? kk : 0],
                      q_lane + (mt * 16 * C::kStride + kk * 16) * kElemBytes);
    }

    for (int it = 0; it < n_iter; ++it) {
      // One barrier per tile: after it, tile `it` is visible to all warps and every warp has
      // finished tile it - 1, so its slot can be refilled with tile it + kStages - 1 at once.
      // (kStages == 1 has no spare slot: load, wait, compute, and a second barrier.)
      if (C::kStages == 1) {
        load_kv(it);
        cp_async_commit();
      }
      cp_async_wait<(C::kStages > 1 ? C::kStages - 2 : 0)>();
      __syncthreads();
      if (C::kStages > 1) {
        if (it + C::kStages - 1 < n_iter) load_kv(it + C::kStages - 1);
        cp_async_commit();
      }

      const int slot = it % C::kStages;
      const uint32_t k_slot = k_lane + slot * kSlotBytes;
      const uint32_t v_slot = v_lane + slot * kSlotBytes;
      const int64_t n = C::kSparse ? s_tile[slot] : sched.tile(it, io, false);
      const bool masked = fwd_tile_masked<C>(sched, mask, it, n, r0, r1);
      // the mask_mod's class of the tile (kMaskFull without one): EMPTY tiles are skipped
      const int ucls = umask.kv_tile_class(r0, r1, n, C::kBlockN);
      if (MaskModOf<C>::kOn && ucls == kMaskEmpty) {
        if (C::kStages == 1) __syncthreads();  // the only slot is refilled next iteration
        continue;
      }

      // S = Q K^T
      float acc_s[C::kMT][C::kNT][4];
#pragma unroll
      for (int mt = 0; mt < C::kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;
      warp_qk<Elem, C::kMT, C::kNT, C::kKS, C::kStride>(
          acc_s,
          [&](int mt, int kk, uint32_t (&a)[4]) {
            if (C::kQInRegs) {
#pragma unroll
              for (int e = 0; e < 4; ++e) a[e] = qf[C::kQInRegs ? mt : 0][C::kQInRegs ? kk : 0][e];
            } else {
              ldmatrix_x4(a, q_lane + (mt * 16 * C::kStride + kk * 16) * kElemBytes);
            }
          },
          k_slot);

      score_frag(acc_s, mod, tile_at(r0 + warp_row0, n * C::kBlockN, mask), lane);
      if (masked) mask_frag(acc_s, mask.tile(r0 + warp_row0, n * C::kBlockN), lane);
      if (MaskModOf<C>::kOn && ucls != kMaskFull)
        umask.mask_frag(acc_s, r0 + warp_row0, n * C::kBlockN, lane);

#pragma unroll
      for (int mt = 0; mt < C::kMT; ++mt) {
        float alpha[2];
        online_softmax_update(st[mt], acc_s[mt], mod.scale_log2, alpha);
        scale_rows(acc_o[mt], alpha);
      }

      if (C::kDropout)
        fwd_dropout_frag<C>(acc_s, drop.rng, p, b, h, sq, sk, r0 + warp_row0, n * C::kBlockN,
                            lane, io);

      // acc_o += P V, P re-packed from the S accumulators
      warp_pv<Elem, C::kMT, C::kNT, C::kDT, C::kStride>(acc_o, acc_s, v_slot);
      if (C::kStages == 1) __syncthreads();  // the only slot is refilled next iteration
    }
  }

  // ---- epilogue: O = acc_o / l, LSE; empty rows give 0 and -inf ----------------------------
#pragma unroll
  for (int mt = 0; mt < C::kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float inv_l, lse;
      mod.finalize(st[mt][r], inv_l, lse);
      // Dropout's 1/(1-p) scales O once, in fp32 (FlashAttention-2 does the same): applied
      // to P before its 16-bit rounding it would cost up to 2x the baseline's error
      // (a row max p = 1 is exact in bf16, 1/(1-p) is not).
      if (C::kDropout) inv_l *= drop.scale;
      const int row = warp_row0 + mt * 16 + g + r * 8;
      if (row < valid_rows) {
#pragma unroll
        for (int dt = 0; dt < C::kDT; ++dt)
          if (dt * 8 < C::kHeadDim)  // the padded columns are not O's
            store_pair(gO + row * p.o_row_stride + dt * 8 + 2 * t,
                       MmaT::pack(acc_o[mt][dt][2 * r] * inv_l, acc_o[mt][dt][2 * r + 1] * inv_l), io,
                       FwdIo::kO);
        if (t == 0) store_f32(gLse + row, lse, io, FwdIo::kLse);
      }
    }
  io.flush(p.io_counters);
}

}  // namespace fg
