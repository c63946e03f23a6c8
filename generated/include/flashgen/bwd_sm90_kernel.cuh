// flashgen: the backward FlashAttention kernel on Hopper (sm_90a): TMA loads into an mbarrier
// ring, wgmma for the five products, the scores computed transposed so that P and dS feed
// dV and dK straight from registers.
//
// Glossary
//   CTA        one K/V tile of block_n = 64 * groups keys [c0, c0 + kr) of one (batch b, KV
//              head hk); it walks every query head h of hk's GQA group and, per head, the
//              query tiles of block_m rows its keys can see (a step = one (h, tile m) pair)
//   group      a consumer warpgroup (128 threads) owning 64 of the CTA's keys: its dK and dV
//              rows stay in its registers over the whole walk
//   S^T, P^T   scores transposed, K Q^T (keys x queries, wgmma M = keys, N = block_m), and
//              P^T = exp(scale S^T - LSE): the wgmma accumulator of 64 keys is the m16n8 C
//              layout per warp with rows = keys and columns = queries, so P^T packs into the
//              A registers of dV += P^T dO as P does into P V in the forward
//   dP^T, dS^T V dO^T and dS^T = P^T * (dP^T - D), D = rowsum(dO * O) (the preprocess); P^T
//              is formed while dP^T is still on the tensor cores (kPFirst, below)
//   dQ piece   dQ of a step = dS K (block_m x Dp, K = every key of the CTA) is cut into one
//              64-row x kDqN piece per group; dS^T goes through shared memory for it (the A
//              operand read MN-major); each group stores its piece into the step's fp32 dQ
//              tile in shared memory, and the dQ writer adds the tile's rows to dq_accum
//   kDqTma     how a step's dQ pieces reach dq_accum: through the dQ tile and the dQ writer
//              (below), or (false) by each consumer thread's red.global.add.v2.f32 of its
//              piece. The tile is taken without a user score_mod at Dp = 128 or block_m =
//              128 (H200, docs/benchmarks.md: 1.16-1.19x the backward's TFLOP/s at d 128);
//              at Dp 64 with block_m 64 (softcap) and with a user score_mod the kernels it
//              makes spill 20-164 bytes (ptxas 13.0), so those keep the adds
//   dQ tile    the step's block_m x Dp fp32 dQ in shared memory, as ceil(d / 32) SW128 boxes
//              of 32 columns (128 bytes) x block_m rows: what TMA reads for the map of
//              dq_accum (bwd_sm90_launch.cuh)
//   dQ writer  lane 0 of the producer warpgroup's second warp: per step it waits for the dQ
//              tile (dq_full), adds it to dq_accum by TMA (cp.reduce.async.bulk.tensor .add,
//              one instruction per box; rows past seqlen_q and columns past d are dropped by
//              the map's bounds), and frees the tile (dq_empty) once TMA has read it, so the
//              consumers issue no global atomics
//   Dp         head_dim rounded up to 64 (TMA box width); columns d..Dp-1 read as 0 and are
//              neither stored nor added
//   dq_sem     deterministic builds: per (batch, head, query tile) the number of K/V tiles
//              whose dQ adds have landed (the workspace's third part, as the mma.sync
//              backward's). A step's adds wait for their turn and release the next one once
//              they are complete in global memory, so the fp32 sums are made in one
//              key-tile order on every run: ascending, tile n - first_visitor(m) (n itself
//              without a mask: every K/V tile from 0 visits every query tile), except with
//              causal alone (kDescendingTurns), where the last visitor of m adds first (turn
//              last_visitor(m) - n) and the CTAs take the key tiles in descending order:
//              then the tiles past the diagonal add first, and a CTA's first query tiles are
//              its first turns (ascending, CTA n waited for n earlier tiles' adds at its
//              first query tile, and the causal CTAs ran as a wavefront: 0.52-0.60x the
//              non-deterministic kernel, H200, bwd_bench; with sk much above sq the tiles
//              that see every query still take turns there). CTAs wait only for CTAs of lower
//              blockIdx (same batch and KV head; lower key tile, or higher one when
//              descending), which the hardware starts first: no deadlock. Who waits: the dQ
//              writer (kDqTma; the turn and counter index come in dq_job), else consumer
//              thread 0, the other consumer threads held at a named barrier
//   slot       ring position of a step's Q, dO, LSE and D (step % stages); full[slot]
//              completes when its TMA bytes land and the producer warp has written LSE and D,
//              empty[slot] when every consumer thread is done with it
//
// Per CTA: a producer warpgroup (40 registers): its first warp loads K, V once and then Q, dO
// by TMA and LSE, D by plain loads, step by step, into the ring; its second warp is the dQ
// writer. Each consumer group per step: S^T = K Q^T and dP^T = V dO^T (SS-wgmma), mask
// (mask.cuh, transposed), P^T and dS^T in fp32 registers, dV += P^T dO and dK += dS^T Q
// (RS-wgmma), dS^T to shared memory, a barrier of the consumers, its dQ piece (SS-wgmma), the
// slot's release, and the piece into the dQ tile (after the writer freed it). dK = scale * dK
// and dV are stored from registers at the end (zeros when no step saw the keys).
#pragma once

#include <cuda.h>
#include <stdint.h>

#include "arch.cuh"
#include "block_info.cuh"
#include "bwd_kernel.cuh"
#include "bwd_params.h"
#include "mask.cuh"
#include "score_mod.cuh"
#include "sm90.cuh"
#include "tile_io.cuh"
#include "warp_mma.cuh"

namespace fg {

// The TMA tensor maps of one call (built by the launcher, bwd_sm90_launch.cuh).
struct BwdSm90Maps {
  CUtensorMap q, k, v, dout, dq_accum;  // dq_accum: fp32, reduce-add boxes of the dQ tile
  int q_heads_inner, kv_heads_inner, do_heads_inner;  // coordinate order (make_tmap_bshd)
};

template <class S>
struct BwdSm90Config : S {
  using S::kBlockM, S::kBlockN, S::kHeadDim, S::kWarps, S::kStages;
  using Elem = typename S::Elem;
  // dQ adds ordered per query tile (dq_sem, below); also read by bwd_kernel.cuh's workspace
  static constexpr bool kDeterministic = S::kDeterministic;
  // deterministic with causal and no window: turns in descending key-tile order, and the CTAs
  // take their key tiles in that order (dq_sem in the glossary)
  static constexpr bool kDescendingTurns =
      S::kDeterministic && S::kCausal != Causal::kNone && !S::kWindow;
  static constexpr int kConsumerThreads = kWarps * 32;
  // dq_accum's rows are b * seqlen_q + r, varlen too (bwd_kernel.cuh): the dQ writer adds whole
  // tiles of block_m rows, and those past a sequence's end must stay in its own rows
  static constexpr bool kDqAccumPacked = false;
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kGroups = kWarps / 4;
  // kRingCopies: the producer stages each step's LSE and D by cp.async (the consumers scale
  // LSE to log2 units), with 40 registers and the consumers 232; otherwise it loads and
  // converts them itself in 24, and the consumers have 240. setmaxnreg hands over exactly what
  // is given up: 12 warps launch at 168, 4 x (168 - 40) = 8 x (232 - 168) (and 4 x 144 = 8 x
  // 72). ptxas 13.0 over every sm_90a backward kernel: the copies at 24 spill 4-36 bytes
  // beside the P^T-first consumers (the old loads 12), at 40 / 232 nothing does; a score stage
  // with a derivative (softcap) or a user score_mod (positions, parameters) needs the
  // consumers' 240 (8-184 bytes at 232) and keeps the loads.
  static constexpr bool kRingCopies = !ScoreModOf<S, false>::kHasGrad && !ScoreModOf<S, false>::kUser;
  static constexpr int kProducerRegs = kRingCopies ? 40 : 24;
  static constexpr int kConsumerRegs = kRingCopies ? 232 : 240;
  using S::kHeadDimPad;  // head_dim rounded up to 64 (the TMA box)
  static_assert(kHeadDimPad == (kHeadDim + 63) / 64 * 64, "head_dim_pad: the next multiple of 64");
  // one head dim for Q, K, V and dO (families/backward_sm90.py refuses head_dim_v != head_dim)
  static_assert(S::kHeadDimV == kHeadDim && S::kHeadDimVPad == kHeadDimPad,
                "the sm_90a backward takes d_v = d");
  static constexpr int kBoxes = kHeadDimPad / 64;
  static constexpr int kMT = kBlockM / 8;  // n8 tiles of S^T's columns (queries)
  // dQ pieces: (block_m / 64) row blocks x (Dp / kDqN) column blocks, one per group.
  static constexpr int kDqRowBlocks = kBlockM / 64;
  static constexpr int kDqN = kDqRowBlocks * kHeadDimPad / kGroups;
  static constexpr int kDqColBlocks = kHeadDimPad / kDqN;
  static constexpr int kElem = static_cast<int>(sizeof(Elem));
  static constexpr int kQBox = kBlockM * 64, kKvBox = kBlockN * 64;  // elements per box
  static constexpr int kQBytes = kBlockM * kHeadDimPad * kElem;     // one Q (or dO) tile
  static constexpr int kKvBytes = kBlockN * kHeadDimPad * kElem;    // one K (or V) tile
  static constexpr int kDsBytes = kBlockN * kBlockM * kElem;        // one dS^T buffer
  static constexpr bool kDqTma =
      !ScoreModOf<S, false>::kUser && (kHeadDimPad == 128 || kBlockM == 128);
  static constexpr int kDqBoxes = (kHeadDim + 31) / 32;  // 32-column fp32 boxes holding d
  static constexpr int kDqBox = kBlockM * 32;               // floats per box
  static constexpr int kDqBytes = kDqTma ? kBlockM * kHeadDimPad * 4 : 0;  // the dQ tile
  static constexpr int kSmemBytes = 2 * kKvBytes + 2 * kStages * kQBytes + 2 * kDsBytes +
                                    kDqBytes + 2 * kStages * kBlockM * 4 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory: 227 KiB per CTA on sm_90");
  // setmaxnreg.inc waits for registers the producer gave up: never ask for more than the
  // launch's (65536 / kThreads, rounded down to 8, per thread)
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <=
                    65536 / kThreads / 8 * 8 * kThreads,
                "registers: the setmaxnreg split asks for more than the launch holds");
  static_assert(kWarps == 8, "two consumer warpgroups (block_n = 128)");
  static_assert(kBlockN == 64 * kGroups, "block_n = 64 keys per consumer warpgroup");
  static_assert(kBlockM == 64 || kBlockM == 128, "block_m: 64 or 128");
  static_assert(kHeadDim % 8 == 0 && (kHeadDimPad == 64 || kHeadDimPad == 128),
                "head_dim: multiples of 8 in 8..128");
  static_assert(kDqN == 32 || kDqN == 64 || kDqN == 128, "dQ piece width");
  static_assert(kDqRowBlocks * kDqColBlocks == kGroups, "one dQ piece per warpgroup");
  static_assert(kStages >= 1 && kStages <= 4, "stages");
  static_assert(!S::kSparse && !S::kInstrumentIo && !S::kDropout,
                "sparsity, dropout and instrument_io are not on the sm_90a backward");
};

// Deterministic builds' turn-taking on one dq_sem counter (see the glossary): wait until
// `turn` K/V tiles have added, then (after this tile's adds are complete and fenced) hand the
// counter to the next one. The mma.sync backward spells the same two steps inline.
__device__ __forceinline__ void dq_turn_wait(const int32_t* sem, int turn) {
  while (ld_acquire(sem) != turn) __nanosleep(32);
}
// Global memory accesses of the async proxy (the dQ writer's reduce-adds) ordered with this
// thread's generic-proxy ones (the turn's acquire before them, its release after).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ void dq_turn_release(int32_t* sem, int turn) {
  __threadfence();  // cumulative: the adds this thread has seen complete come first
  atomicExch(sem, turn + 1);
}

// The last K/V tile whose schedule visits query tile m, with causal alone: tile n visits the
// query tiles from m_lo(n) = floor((n block_n - shift) / block_m) on (MaskPolicy::q_tile_range),
// so the last is the largest n with n block_n <= (m + 1) block_m + shift - 1. Every tile below
// it visits m too.
template <class Mask>
__device__ __forceinline__ int64_t last_visitor(const Mask& mask, int64_t m, int64_t num_n,
                                                int block_m, int block_n) {
  return min(num_n - 1, floor_div((m + 1) * block_m + mask.shift - 1, block_n));
}

// The K/V tile of a CTA: blockIdx.x's, reversed where the turns descend.
template <class C>
__device__ __forceinline__ int64_t cta_key_tile(int64_t bid, int64_t num_nt) {
  const int64_t n = bid % num_nt;
  return C::kDescendingTurns ? num_nt - 1 - n : n;
}

// The turn of K/V tile nt at query tile m (ascending from the first visitor, or with causal
// alone descending from the last), and the dq_sem counter of (batch b, head h, query tile m).
template <class C, class Mask>
__device__ __forceinline__ int dq_turn(const Mask& mask, int64_t m, int64_t nt, int64_t num_nt,
                                       int64_t sk) {
  if constexpr (C::kWindow) return static_cast<int>(nt - first_visitor(mask, m, nt, sk,
                                                                       C::kBlockM, C::kBlockN));
  if constexpr (C::kDescendingTurns)
    return static_cast<int>(last_visitor(mask, m, num_nt, C::kBlockM, C::kBlockN) - nt);
  return static_cast<int>(nt);
}
template <class C>
__device__ __forceinline__ int dq_sem_index(const fg_bwd_params& p, int64_t b, int64_t h,
                                            int64_t m) {
  return static_cast<int>((b * p.heads + h) * ((p.seqlen_q + C::kBlockM - 1) / C::kBlockM) + m);
}

// dQ tile element (query row r, column c): box c / 32, and in its 128-byte row r the 16-byte
// chunk (c % 32) / 4 at chunk ((c % 32) / 4) ^ (r % 8) (SW128, as TMA reads it).
template <class C>
__device__ __forceinline__ int dq_tile_offset(int r, int c) {
  return (c >> 5) * C::kDqBox + r * 32 + ((((c & 31) >> 2) ^ (r & 7)) << 2) + (c & 3);
}

// dS^T element (key row r, query column c) of a [block_n keys][64 queries] SW128 box: the
// 16-byte chunk c / 8 of row r sits at chunk (c / 8) ^ (r % 8) (what TMA would write).
__device__ __forceinline__ int sw128_offset(int r, int c) {
  return r * 64 + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7);
}

// The LSE a row past the sequence gets on the copied ring: +inf, so P^T = exp2(y - inf) = 0
// there whatever the score stage makes of its zero Q row (ALiBi's bias -slope |i - j| is
// large and positive for a negative slope: with LSE 0 its exp2 overflowed to inf, and inf
// times the row's zero dO is NaN in dV and dK).
__device__ const float kLsePastEnd = INFINITY;

// 4 bytes from global to shared memory by the async copy unit (cp.async): no register holds
// the value. `valid` false: the 4 bytes are zero-filled and nothing is read.
__device__ __forceinline__ void cp_async_4(float* smem, const float* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 4 : 0)
               : "memory");
}
// This thread's arrival on `bar` once every cp.async it issued so far has landed (.noinc: it
// is the thread's arrive, counted in the barrier's expected count).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(b) : "memory");
}

// kRingCopies: LSE of the two query columns col, col + 1 of a step in log2 units, from the
// ring (else the producer stored them so). The producer copied the caller's LSE (natural
// log), +inf past the sequence (kLsePastEnd: P^T = 0). LSE = -inf (no visible key) stays
// -inf: such rows are masked in every tile the walk visits (P^T = 0 after the exp2). A user
// score_mod may be +inf or NaN there (an expression of i), so its kernels keep the producer's
// loads (+inf for both: P^T = 0, or NaN, which they turn into 0).
template <class C, class Mod>
__device__ __forceinline__ float2 lse_log2(const float* lse_s, int col) {
  static_assert(C::kRingCopies && !Mod::kUser, "the copied ring's LSE (natural log)");
  constexpr float kLog2e = 1.4426950408889634f;
  const float2 l = *reinterpret_cast<const float2*>(lse_s + col);
  return make_float2(l.x * kLog2e, l.y * kLog2e);
}

template <class C>
__device__ __forceinline__ void bwd_sm90_kernel_body(const fg_bwd_params& p,
                                                     const BwdSm90Maps& maps) {
  using Elem = typename C::Elem;
  using MmaT = Mma<Elem>;
  using namespace sm90;
  extern __shared__ unsigned char smem_raw[];  // SW128 tiles need 1024-byte alignment
  Elem* sK = reinterpret_cast<Elem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                     ~uintptr_t{1023});
  Elem* sV = sK + C::kBlockN * C::kHeadDimPad;
  Elem* sQ = sV + C::kBlockN * C::kHeadDimPad;
  Elem* sdO = sQ + C::kStages * C::kBlockM * C::kHeadDimPad;
  Elem* sdS = sdO + C::kStages * C::kBlockM * C::kHeadDimPad;
  float* sdQ = reinterpret_cast<float*>(sdS + 2 * C::kBlockN * C::kBlockM);  // 1024-aligned
  float* sLse = sdQ + C::kDqBytes / 4;
  float* sD = sLse + C::kStages * C::kBlockM;
  __shared__ uint64_t bar_kv, full[C::kStages], empty[C::kStages], dq_full, dq_empty;
  // the step's head and first query row (deterministic: its dq_sem index and turn), from
  // consumer thread 0 to the dQ writer
  __shared__ int dq_job[C::kDeterministic ? 4 : 2];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = warp / 4, g = lane >> 2, t = lane & 3;
  Io<false, BwdIo> io;

  // ---- which (K/V tile, KV head, batch) this CTA is (the backward's order) ---------------
  const int64_t num_nt = (p.seqlen_k + C::kBlockN - 1) / C::kBlockN;
  int64_t bid = blockIdx.x;
  const int64_t nt = cta_key_tile<C>(bid, num_nt);
  bid /= num_nt;
  const int64_t hk = bid % p.kv_heads, b = bid / p.kv_heads;
  if (b >= p.batch) return;
  const SeqInfo<C::kVarlen> seq(b, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k, io,
                                false);
  const int64_t sq = seq.sq, sk = seq.sk, c0 = nt * C::kBlockN;
  // varlen: a key tile past a shorter sequence's keys has nothing to do (the whole CTA leaves,
  // before any barrier), and the turns count the sequence's own key tiles
  if (C::kVarlen && c0 >= sk) return;
  const int64_t kr = min(static_cast<int64_t>(C::kBlockN), sk - c0);
  const int64_t seq_nt = C::kVarlen ? (sk + C::kBlockN - 1) / C::kBlockN : num_nt;
  const int heads_per_kv = C::kGqa ? static_cast<int>(p.heads / p.kv_heads) : 1;
  const int64_t h0 = hk * heads_per_kv;
  const MaskPolicy<C::kCausal, C::kWindow> mask(sq, sk, p.window_left, p.window_right);
  int64_t m_lo, m_hi;
  mask.q_tile_range(c0, c0 + kr - 1, C::kBlockM, m_lo, m_hi);
  // The walk: heads h0 .. h0 + heads_per_kv - 1, each over query tiles [m_lo, m_hi).
  const int n_steps = static_cast<int>(max(int64_t{0}, m_hi - m_lo)) * heads_per_kv;

  if (tid == 0) {
    mbar_init(&bar_kv, 1);
#pragma unroll
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(&full[s], 1 + 32);  // the TMA transaction + the producer lanes' LSE/D copies
      mbar_init(&empty[s], C::kConsumerThreads);
    }
    if constexpr (C::kDqTma) {
      mbar_init(&dq_full, C::kConsumerThreads);  // every consumer thread's piece is stored
      mbar_init(&dq_empty, 1);                   // the dQ writer: TMA has read the tile
    }
    mbar_init_fence();
  }
  __syncthreads();

  // TMA coordinates (column, row, head, batch): the sequence's own rows (dense: batch
  // coordinate b) or packed rows (varlen: the maps' one batch entry, from q0 / k0), as the
  // forward's. A varlen tile past its sequence's end loads the next sequence's rows: keys
  // past sk only reach dK and dV rows that are never stored (key_ok keeps them out of dQ),
  // and queries past sq have LSE +inf (P^T = 0, so dS^T = 0: finite dO rows are assumed
  // there, as the forward assumes finite V rows).
  const int tma_b = C::kVarlen ? 0 : static_cast<int>(b);
  auto tma = [&](Elem* dst, const CUtensorMap& map, bool heads_inner, uint64_t* bar, int col,
                 int64_t row, int64_t head) {
    tma_load_bshd(dst, &map, heads_inner, bar, col, row, head, tma_b);
  };

  // ---- producer warpgroup: its first warp fills the ring, its second writes dQ ------------
  if (warp >= C::kWarps) {
    regs_dealloc<C::kProducerRegs>();
    // the walk's bounds in 32 bits (TMA's coordinates are 32-bit, and the launcher refuses
    // longer sequences): with 64-bit ones the loads spilled 12 bytes of this warpgroup's 24
    // registers at block_m 128 beside the dQ writer (ptxas 13.0)
    const int w_lo = static_cast<int>(m_lo), w_hi = static_cast<int>(m_hi);
    const int w_sq = static_cast<int>(sq);
    if constexpr (C::kDqTma) {
      if (n_steps == 0 || warp > C::kWarps + 1) return;
      if (warp == C::kWarps + 1) {  // the dQ writer: each step's tile into dq_accum
        [[maybe_unused]] const int w_b = static_cast<int>(b), w_nt = static_cast<int>(nt);
        [[maybe_unused]] const int w_heads = static_cast<int>(p.heads);
        // dq_sem's rows per (batch, head): the longest sequence's query tiles (dq_sem_index)
        [[maybe_unused]] const int w_num_mt =
            static_cast<int>((p.seqlen_q + C::kBlockM - 1) / C::kBlockM);
        // Its head and rows come from the consumers (dq_job): this warp's 24 registers spilled
        // 40-130 bytes when it walked the steps itself (ptxas 13.0).
        if (lane != 0) return;
        for (int s = 0; s < n_steps; ++s) {
          mbar_wait(&dq_full, static_cast<uint32_t>(s & 1));
          const int h = dq_job[0], r0 = dq_job[1];
          [[maybe_unused]] int32_t* sem = nullptr;
          [[maybe_unused]] int turn = 0;
          if constexpr (C::kDeterministic) {  // the counter from 32-bit parts (launch check)
            sem = p.dq_sem + (w_b * w_heads + h) * w_num_mt + dq_job[2];
            turn = C::kWindow || C::kDescendingTurns ? dq_job[3] : w_nt;
            dq_turn_wait(sem, turn);
            fence_proxy_async_global();  // the acquire, then the async proxy's reduce-adds
          }
#pragma unroll
          for (int j = 0; j < C::kDqBoxes; ++j)
            tma_reduce_add_4d(sdQ + j * C::kDqBox, &maps.dq_accum, j * 32, h, r0,
                              static_cast<int>(b));
          bulk_commit();
          bulk_wait_read<0>();
          mbar_arrive(&dq_empty);  // the tile is read: the consumers may store the next one
          if constexpr (C::kDeterministic) {
            // the adds complete in global memory (not only read out of shared memory), then
            // the next key tile's turn
            bulk_wait<0>();
            fence_proxy_async_global();
            dq_turn_release(sem, turn);
          }
        }
        bulk_wait<0>();  // the adds have landed before the CTA's shared memory is released
        return;
      }
    } else if (warp != C::kWarps || n_steps == 0) {
      return;
    }
    if (lane == 0) {
      mbar_arrive_expect_tx(&bar_kv, 2 * C::kKvBytes);
#pragma unroll
      for (int j = 0; j < C::kBoxes; ++j) {
        tma(sK + j * C::kKvBox, maps.k, maps.kv_heads_inner, &bar_kv, j * 64, seq.k0 + c0, hk);
        tma(sV + j * C::kKvBox, maps.v, maps.kv_heads_inner, &bar_kv, j * 64, seq.k0 + c0, hk);
      }
    }
    int h_off = 0, m = w_lo;  // the step's head offset and query tile
    for (int s = 0; s < n_steps; ++s) {
      const int slot = s % C::kStages;
      if (s >= C::kStages) mbar_wait(&empty[slot], static_cast<uint32_t>((s / C::kStages - 1) & 1));
      const int64_t h = h0 + h_off, r0 = static_cast<int64_t>(m) * C::kBlockM;
      if (lane == 0) {
        mbar_arrive_expect_tx(&full[slot], 2 * C::kQBytes);
        const int off = slot * C::kBlockM * C::kHeadDimPad;
#pragma unroll
        for (int j = 0; j < C::kBoxes; ++j) {
          tma(sQ + off + j * C::kQBox, maps.q, maps.q_heads_inner, &full[slot], j * 64,
              seq.q0 + r0, h);
          tma(sdO + off + j * C::kQBox, maps.dout, maps.do_heads_inner, &full[slot], j * 64,
              seq.q0 + r0, h);
        }
      }
      if constexpr (C::kRingCopies) {
        // LSE (natural log, the caller's) and D of the step's rows, 4 bytes each by the async
        // copy unit; past the sequence LSE +inf (kLsePastEnd) and D 0 (a zero fill: src-size
        // 0 reads nothing): no register holds a value or waits for a load.
        const int row0 = static_cast<int>(r0) + lane;
        const float* lse_p = p.lse + seq.lse_off(p.lse_batch_stride, p.lse_head_stride, h, row0);
        const float* d_p = p.dsum + seq.grow(row0) * p.heads + h;
        const int64_t d_step = 32 * p.heads;
#pragma unroll
        for (int i = 0; i < C::kBlockM / 32; ++i) {
          const bool in = row0 + 32 * i < w_sq;
          cp_async_4(sLse + slot * C::kBlockM + lane + 32 * i, in ? lse_p : &kLsePastEnd, true);
          cp_async_4(sD + slot * C::kBlockM + lane + 32 * i, d_p, in);
          lse_p += 32;
          d_p += d_step;
        }
        cp_async_mbar_arrive(&full[slot]);  // this lane's arrival, once its copies have landed
      } else {
        // LSE in log2 units (+inf where no key is visible or past the sequence: P = 0) and D.
        for (int r = lane; r < C::kBlockM; r += 32) {
          const int64_t row = r0 + r;
          float lse2 = INFINITY, dsum = 0.f;
          if (row < w_sq) {
            const float lse = p.lse[seq.lse_off(p.lse_batch_stride, p.lse_head_stride, h, row)];
            lse2 = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
            dsum = p.dsum[seq.grow(row) * p.heads + h];
          }
          sLse[slot * C::kBlockM + r] = lse2;
          sD[slot * C::kBlockM + r] = dsum;
        }
        mbar_arrive(&full[slot]);  // release: the writes above precede the phase's completion
      }
      if (++m == w_hi) m = w_lo, ++h_off;
    }
    // the last copies land (and arrive) before this warp exits
    if constexpr (C::kRingCopies) asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  regs_alloc<C::kConsumerRegs>();

  // ---- consumers ---------------------------------------------------------------------------
  constexpr int kDvN = C::kHeadDimPad;  // wgmma N of dV/dK: one instruction per k16 slice
  float acc_dk[kDvN / 2], acc_dv[kDvN / 2];
#pragma unroll
  for (int i = 0; i < kDvN / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
  const int wk = warp % 4;            // warp within the group
  const int key0 = group * 64;        // the group's first key row of the tile
  const int dq_row = (group / C::kDqColBlocks) * 64;          // its dQ piece: query rows
  const int dq_col = (group % C::kDqColBlocks) * C::kDqN;     // and head-dim columns
  using Mod = ScoreModOf<C, false>;  // the score stage (score_mod.cuh); the LSE holds the sink
  const Mod mod0(p.score, p.softmax_scale);

  // Descriptors are a base plus byte offsets (desc_at): the bases are re-derived every step
  // (opaque to the compiler), so the per-slice descriptors are not hoisted out of the loop
  // into live registers beside the accumulators.
  auto desc_at = [](uint64_t base, int elems) {
    return base + static_cast<uint64_t>((elems * C::kElem) >> 4);
  };
  // This thread's two key rows (g, g + 8 of its warp's 16) exist. TMA reads the rows past the
  // sequence as 0 and the mask leaves them in (col_end is not tested, which keeps the scores'
  // loop within the registers): their P^T and dS^T only reach dK and dV rows that are never
  // stored, and dQ through dS^T in shared memory, where they are written as 0 (times K's zero
  // rows they would vanish, but P^T = exp(-LSE) may overflow to inf, and inf * 0 = NaN).
  const bool key_ok[2] = {key0 + wk * 16 + g < kr, key0 + wk * 16 + g + 8 < kr};
  [[maybe_unused]] const int64_t q_row_base = dq_accum_row<C>(p, seq, 0);  // dq_accum's rows
  if (n_steps > 0) mbar_wait(&bar_kv, 0);
  // the walk in 32 bits, as the producer's (fewer registers beside the step's peak)
  const int c_lo = static_cast<int>(m_lo), c_hi = static_cast<int>(m_hi);
  int h_off = 0, m = c_lo;  // the step's head offset and query tile
  for (int s = 0; s < n_steps; ++s) {
    const int slot = s % C::kStages;
    const int h = static_cast<int>(h0) + h_off, r0 = m * C::kBlockM;
    uint64_t k_base = desc_k_major(sK + key0 * 64), v_base = desc_k_major(sV + key0 * 64);
    uint64_t q_base = desc_k_major(sQ + slot * C::kBlockM * C::kHeadDimPad);
    uint64_t do_base = desc_k_major(sdO + slot * C::kBlockM * C::kHeadDimPad);
    asm volatile("" : "+l"(k_base), "+l"(v_base), "+l"(q_base), "+l"(do_base));
    Elem* ds_s = sdS + (s & 1) * C::kBlockN * C::kBlockM;
    mbar_wait(&full[slot], static_cast<uint32_t>((s / C::kStages) & 1));

    // S^T = K Q^T, then dP^T = V dO^T, two wgmma groups (k16 slice kk: box kk / 4, 32 bytes *
    // (kk % 4) into the rows). kPFirst: P^T is computed while dP^T is still on the tensor
    // cores (into S^T's registers, in place), and dS^T once it lands; a modifier with a
    // derivative computes both at once (its d(mod)/ds per element would be a third tile of
    // registers). kDInit: D enters as dP^T's initial accumulator (column q holds -D[q]), so
    // no register holds D at the step's peak, but ptxas then waits for S^T before it issues
    // dP^T (C7517: the two products do not overlap); otherwise dP^T starts from 0 and D is
    // read where dS^T is formed. H200, ab_bench (docs/benchmarks.md): the choice below.
    constexpr bool kPFirst = !Mod::kHasGrad;
    // Without causal or a window only keys past the sequence are masked, and key_ok covers
    // those: no element test at all (its predicates cost registers at the step's peak).
    constexpr bool kMasks = C::kCausal != Causal::kNone || C::kWindow;
    constexpr bool kDInit = C::kBlockM == 128 && !kMasks;
    const float* lse_s = sLse + slot * C::kBlockM;
    const float* d_s = sD + slot * C::kBlockM;
    float acc_s[1][C::kMT][4], acc_dp[1][C::kMT][4];
    auto& s_flat = reinterpret_cast<float(&)[C::kMT * 4]>(acc_s);
    auto& dp_flat = reinterpret_cast<float(&)[C::kMT * 4]>(acc_dp);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C::kHeadDimPad / 16; ++kk) {
      const int off_kv = (kk / 4) * C::kKvBox + (kk % 4) * 16;
      const int off_q = (kk / 4) * C::kQBox + (kk % 4) * 16;
      Wgmma<Elem, C::kBlockM>::template ss<0>(s_flat, desc_at(k_base, off_kv),
                                              desc_at(q_base, off_q), kk > 0);
    }
    wgmma_commit();
    if constexpr (kDInit) {
#pragma unroll
      for (int j = 0; j < C::kMT; ++j) {
        const float2 dsum = *reinterpret_cast<const float2*>(d_s + j * 8 + 2 * t);
        acc_dp[0][j][0] = acc_dp[0][j][2] = -dsum.x;
        acc_dp[0][j][1] = acc_dp[0][j][3] = -dsum.y;
      }
      wgmma_fence();
    }
#pragma unroll
    for (int kk = 0; kk < C::kHeadDimPad / 16; ++kk) {
      const int off_kv = (kk / 4) * C::kKvBox + (kk % 4) * 16;
      const int off_q = (kk / 4) * C::kQBox + (kk % 4) * 16;
      Wgmma<Elem, C::kBlockM>::template ss<0>(dp_flat, desc_at(v_base, off_kv),
                                              desc_at(do_base, off_q), kDInit || kk > 0);
    }
    wgmma_commit();

    // Mask (transposed: element (key kl, query ql) is visible iff the tile mask says (ql, kl)),
    // P^T = exp2(S^T scale log2 e - LSE log2 e) and dS^T = P^T (dP^T - D) in fp32, packed per
    // k16 slice kk2 (S^T's n8 tiles 2 kk2 and 2 kk2 + 1) as RS-wgmma A operands, so the fp32
    // tiles die slice by slice (the step's register peak is at the waits: dK, dV, S^T and
    // dP^T).
    const Mod mod = mod0.at(p.score, p.softmax_scale, b, h, io, false, BwdIo::kMeta);
    // element (query ql, key kl) lies at diagonal distance dist0 + kl - ql (as an int: a float
    // base per key row measured 24 bytes of spill here with softcap and ALiBi, ptxas)
    const TileAt at = tile_at(r0, c0, mask);  // and its positions, for a score_mod
    const int dist0 = at.dist0;
    const bool masked =
        kMasks && mask.tile_needs_mask(r0, min(int64_t{r0} + C::kBlockM, sq) - 1, nt, C::kBlockN);
    TileMask tm = mask.tile(r0, c0);
    tm.col_end = 1 << 30;  // keys past the sequence: key_ok above
    // P^T of element e of n8 tile j (and d(mod)/ds in gm).
    auto p_of = [&](int j, int e, float lse_e, float& gm) {
      const int ql = j * 8 + 2 * t;
      const int kl = key0 + wk * 16 + g + (e >> 1) * 8;
      const float y = mod.logit(acc_s[0][j][e], static_cast<float>(dist0 + kl - (ql + (e & 1))),
                                at.pos(ql + (e & 1), kl), gm);
      float pe = exp2_approx(__fsub_rn(__fmul_rn(y, mod.scale_log2), lse_e));
      // rows past the sequence (and, with the producer's loads, rows with no visible key)
      // have lse = +inf: P = 0, but a score_mod's +inf or NaN there (an expression of i past
      // seqlen_q) gives NaN, which fmaxf turns into 0 (one FMNMX; an explicit select of those
      // rows spilled 40 bytes more than this in the bias-table kernel, ptxas 13.0). A NaN of
      // a visible score becomes 0 too: the forward shows it.
      if constexpr (Mod::kUser) pe = fmaxf(pe, 0.f);
      if (masked && !tm.visible(ql + (e & 1), kl)) pe = 0.f;
      return pe;
    };
    wgmma_wait<kPFirst ? 1 : 0>();
    reg_fence(s_flat);
    if constexpr (kPFirst) {
#pragma unroll
      for (int j = 0; j < C::kMT; ++j) {
        float2 lse2;  // (a helper taking both cases spilled one kernel 24 bytes: ptxas 13.0)
        if constexpr (C::kRingCopies) lse2 = lse_log2<C, Mod>(lse_s, j * 8 + 2 * t);
        else lse2 = *reinterpret_cast<const float2*>(lse_s + j * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float gm;
          acc_s[0][j][e] = p_of(j, e, (e & 1) ? lse2.y : lse2.x, gm);
        }
      }
      wgmma_wait<0>();
    }
    reg_fence(dp_flat);
    uint32_t pf[C::kBlockM / 16][4], dsf[C::kBlockM / 16][4];
#pragma unroll
    for (int j = 0; j < C::kMT; ++j) {
      float2 lse2;  // (a helper taking both cases spilled one kernel 24 bytes: ptxas 13.0)
      if constexpr (C::kRingCopies) lse2 = lse_log2<C, Mod>(lse_s, j * 8 + 2 * t);
      else lse2 = *reinterpret_cast<const float2*>(lse_s + j * 8 + 2 * t);
      const float2 dsum = kDInit ? make_float2(0.f, 0.f)
                                 : *reinterpret_cast<const float2*>(d_s + j * 8 + 2 * t);
      float pe[4], ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float gm;
        pe[e] = kPFirst ? acc_s[0][j][e] : p_of(j, e, (e & 1) ? lse2.y : lse2.x, gm);
        const float dp = kDInit ? acc_dp[0][j][e] : acc_dp[0][j][e] - ((e & 1) ? dsum.y : dsum.x);
        ds[e] = pe[e] * dp;
        // d(mod)/ds where P = 0 is never used: it may be inf or NaN there (0 * inf = NaN)
        if constexpr (Mod::kHasGrad) ds[e] = Mod::kUserGrad && pe[e] == 0.f ? 0.f : ds[e] * gm;
      }
      // n8 tile j is registers 2 (j % 2) (row g) and 2 (j % 2) + 1 (row g + 8) of slice j / 2
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        pf[j / 2][2 * (j % 2) + r] = MmaT::pack(pe[2 * r], pe[2 * r + 1]);
        dsf[j / 2][2 * (j % 2) + r] = MmaT::pack(ds[2 * r], ds[2 * r + 1]);
      }
    }
    // dV += P^T dO and dK += dS^T Q (dO, Q read MN-major: rows 16 kk2.. of every box, the
    // boxes of the Dp columns kQBox apart).
    uint64_t dov_base = desc_mn_major(sdO + slot * C::kBlockM * C::kHeadDimPad,
                                      C::kQBox * C::kElem);
    uint64_t qv_base = desc_mn_major(sQ + slot * C::kBlockM * C::kHeadDimPad,
                                     C::kQBox * C::kElem);
    asm volatile("" : "+l"(dov_base), "+l"(qv_base));
    wgmma_fence();
#pragma unroll
    for (int kk2 = 0; kk2 < C::kBlockM / 16; ++kk2)
      Wgmma<Elem, kDvN>::template rs<1>(acc_dv, pf[kk2], desc_at(dov_base, kk2 * 16 * 64), 1);
#pragma unroll
    for (int kk2 = 0; kk2 < C::kBlockM / 16; ++kk2)
      Wgmma<Elem, kDvN>::template rs<1>(acc_dk, dsf[kk2], desc_at(qv_base, kk2 * 16 * 64), 1);
    wgmma_commit();

    // dS^T to shared memory ([block_n keys][64 queries] SW128 boxes, block_m / 64 of them,
    // from the packed A registers: dsf[j / 2][2 (j % 2) + r] holds n8 tile j's row g + 8 r),
    // then every group's rows are in place for the dQ pieces.
#pragma unroll
    for (int j = 0; j < C::kMT; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int kl = key0 + wk * 16 + g + r * 8, ql = j * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(ds_s + (ql / 64) * C::kBlockN * 64 +
                                     sw128_offset(kl, ql % 64)) =
            key_ok[r] ? dsf[j / 2][2 * (j % 2) + r] : 0u;
      }
    fence_proxy_async_smem();
    named_bar_sync(1, C::kConsumerThreads);

    // dQ piece = dS[dq_row.., keys] K[keys, dq_col..]: A = dS^T read MN-major (box dq_row / 64,
    // k16 slice = 16 key rows), B = K read MN-major (its boxes kKvBox apart). dV and dK retire
    // first, so P^T and dS^T (their A registers) die before dQ's accumulators are born.
    wgmma_wait<0>();
    reg_fence(acc_dk);
    reg_fence(acc_dv);
    uint64_t dsa_base = desc_mn_major(ds_s + (dq_row / 64) * C::kBlockN * 64,
                                      C::kBlockN * 64 * C::kElem);
    uint64_t kv_base = desc_mn_major(sK + (dq_col / 64) * C::kKvBox + dq_col % 64,
                                     C::kKvBox * C::kElem);  // a 32-wide piece: 64 bytes in
    asm volatile("" : "+l"(dsa_base), "+l"(kv_base));
    float acc_dq[C::kDqN / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk)
      Wgmma<Elem, C::kDqN>::template ss<1, 1>(acc_dq, desc_at(dsa_base, kk * 16 * 64),
                                              desc_at(kv_base, kk * 16 * 64), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(acc_dq);
    mbar_arrive(&empty[slot]);  // Q, dO, LSE, D of this slot are no longer read

    if constexpr (C::kDqTma) {
      // The piece into the dQ tile once TMA has read the last step's out (element 4 j + 2 r + e
      // is row 16 wk + g + 8 r, column 8 j + 2 t + e of the piece; rows past the sequence and
      // columns past d are stored and dropped by the map), then the writer's signal.
      if (s > 0) mbar_wait(&dq_empty, static_cast<uint32_t>((s - 1) & 1));
      // Rows 8 apart share row % 8 = g, so with x = (t / 2) ^ g the 16-byte chunk of column
      // dq_col + 8 j + 2 t is (2 (j % 4)) ^ x in box dq_col / 32 + j / 4 (dq_tile_offset). The
      // thread's base and x are re-derived every step, opaque to the compiler: hoisted out of
      // the loop, the addresses spilled 48 bytes beside the step's register peak (ptxas 13.0).
      float* dq_t = sdQ + dq_tile_offset<C>(dq_row + wk * 16 + g, dq_col + 2 * t) -
                    ((((t >> 1) ^ g)) << 2);  // chunk 0 of the thread's row, its pair in it
      int x = (t >> 1) ^ g;
      asm volatile("" : "+l"(dq_t), "+r"(x));
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < C::kDqN / 8; ++j)
          *reinterpret_cast<float2*>(dq_t + (j / 4) * C::kDqBox + r * 8 * 32 +
                                     (((2 * (j & 3)) ^ x) << 2)) =
              make_float2(acc_dq[4 * j + 2 * r], acc_dq[4 * j + 2 * r + 1]);
      if (tid == 0) {
        dq_job[0] = static_cast<int>(h), dq_job[1] = static_cast<int>(r0);
        if constexpr (C::kDeterministic) {  // the query tile, and the turn where it is searched
          dq_job[2] = m;
          if constexpr (C::kWindow || C::kDescendingTurns)
            dq_job[3] = dq_turn<C>(mask, m, nt, seq_nt, sk);
        }
      }
      fence_proxy_async_smem();  // the stores, seen by the bulk engine (the async proxy)
      mbar_arrive(&dq_full);
    } else {
      // The piece's adds: element 4 j + 2 r + e is (row 16 wk + g + 8 r, column 8 j + 2 t + e).
      if constexpr (C::kDeterministic) {  // thread 0 waits for the turn, the others with it
        if (tid == 0)
          dq_turn_wait(p.dq_sem + dq_sem_index<C>(p, b, h, m), dq_turn<C>(mask, m, nt, seq_nt, sk));
        named_bar_sync(2, C::kConsumerThreads);
      }
      const int64_t qr = min(static_cast<int64_t>(C::kBlockM), sq - r0);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = dq_row + wk * 16 + g + r * 8;
        if (row < qr) {
          float* dst = p.dq_accum + ((q_row_base + r0 + row) * p.heads + h) * C::kHeadDim +
                       dq_col + 2 * t;
#pragma unroll
          for (int j = 0; j < C::kDqN / 8; ++j)
            if (dq_col + j * 8 + 2 * t < C::kHeadDim)
              red_add_v2(dst + j * 8, acc_dq[4 * j + 2 * r], acc_dq[4 * j + 2 * r + 1]);
        }
      }
      if constexpr (C::kDeterministic) {  // every consumer's adds precede thread 0's release
        named_bar_sync(2, C::kConsumerThreads);
        if (tid == 0)
          dq_turn_release(p.dq_sem + dq_sem_index<C>(p, b, h, m), dq_turn<C>(mask, m, nt, seq_nt, sk));
      }
    }
    if (++m == c_hi) m = c_lo, ++h_off;
  }

  // ---- epilogue: dK = scale * dS^T Q and dV, rows of the group's keys --------------------
  // (the CTA's coordinates are derived again from blockIdx: nothing of the prologue but the
  // accumulators stays live through the walk)
  const int64_t e_nt = cta_key_tile<C>(blockIdx.x, num_nt);
  const int64_t e_hk = blockIdx.x / num_nt % p.kv_heads;
  const int64_t e_b = blockIdx.x / num_nt / p.kv_heads, e_c0 = e_nt * C::kBlockN;
  const SeqInfo<C::kVarlen> e_seq(e_b, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k,
                                  io, false);
  const int64_t e_kr = min(static_cast<int64_t>(C::kBlockN), e_seq.sk - e_c0);
  const float scale = static_cast<float>(p.softmax_scale);
  Elem* gdK = static_cast<Elem*>(p.dk) + e_seq.k_off(p.dk_batch_stride, p.dk_row_stride, e_c0) +
              e_hk * p.dk_head_stride;
  Elem* gdV = static_cast<Elem*>(p.dv) + e_seq.k_off(p.dv_batch_stride, p.dv_row_stride, e_c0) +
              e_hk * p.dv_head_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = key0 + wk * 16 + g + r * 8;
    if (row < e_kr) {
#pragma unroll
      for (int j = 0; j < kDvN / 8; ++j) {
        const int col = j * 8 + 2 * t;
        if (col < C::kHeadDim) {
          store_pair(gdK + row * p.dk_row_stride + col,
                     MmaT::pack(acc_dk[4 * j + 2 * r] * scale, acc_dk[4 * j + 2 * r + 1] * scale),
                     io, BwdIo::kDk);
          store_pair(gdV + row * p.dv_row_stride + col,
                     MmaT::pack(acc_dv[4 * j + 2 * r], acc_dv[4 * j + 2 * r + 1]), io,
                     BwdIo::kDv);
        }
      }
    }
  }
}

}  // namespace fg
