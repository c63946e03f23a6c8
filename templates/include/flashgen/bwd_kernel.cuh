// flashgen: the backward FlashAttention kernels (FlashAttention-2's layout) on mma.sync.
//
// Glossary
//   CTA        one K/V tile of block_n keys [c0, c0 + kr) of one (batch b, KV head hk); it
//              walks every query head h of hk's GQA group and, per head, the query tiles of
//              its schedule (a step = one (h, query tile m) pair)
//   slot       smem buffer of a step's Q, dO, LSE and D: step % kStages
//   S, P       scores Q K^T of a step (block_m x block_n) and P = exp(scale S - LSE)
//   dP, dS     dO V^T and dS = P * (dP - D), D = rowsum(dO * O) (the preprocess kernel)
//   Pd         P with dropout applied (P * keep / (1 - p)), the operand of dV
//   d, d_v     kHeadDim: Q, K, dQ, dK (the k of S = Q K^T); kHeadDimV: V, O, dO, dV (the k of
//              dP = dO V^T, the n of dV); d_v = d unless the spec sets head_dim_v
//   warp layouts  each stage tiles its output over the warps differently: S/dP over (query
//              rows, keys), dK/dV over (keys, head dim), dQ over (query rows, head dim); P
//              and dS go through shared memory between them (as in FlashAttention-2)
//   dq_accum   fp32 workspace (rows, heads, d), rows = batch * seqlen_q (varlen: seqlen_q is
//              the longest sequence); query row r of sequence b is row seq.grow(r) (varlen:
//              packed) or, where C::kDqAccumPacked is false (the sm_90a backward, which adds
//              whole tiles by TMA), b * seqlen_q + r, so that a tile's rows past a varlen
//              sequence's end stay in that sequence's own rows (dq_accum_row); steps add their
//              dQ = dS K into it with atomics; the convert kernel scales it by softmax_scale and
//              writes dQ
//   dq_sem     deterministic builds: per (batch, head, query tile) the number of K/V tiles
//              whose dQ adds are done; the CTA of K/V tile n waits for its turn (the K/V
//              tiles visiting query tile m are a contiguous range, added in ascending order),
//              so the fp32 sums are the same on every run. CTAs only wait for CTAs of lower
//              index, which the hardware starts first: no deadlock.
//
//   P scratch  kPScratch builds: each thread's P in fp32 shared memory (its own slots, no
//              barrier) while dP is computed, so S's registers are free at the step's peak
//              (the dK/dV accumulators of 128 keys x d = 128 fill half the register file)
//   keep bits  dropout's keep decisions of a thread's fragment, one bit per element
//
// Per step: S = Q K^T (mma), mask (mask.cuh) and dropout (frag.cuh) exactly as the forward,
// P from the caller's LSE, Pd to shared memory; then dP = dO V^T and dS = P (dP - D); then
// dV += Pd^T dO and dK += dS^T Q, one product at a time (kept in registers over all steps,
// so GQA groups sum with no expanded copy) and dQ += dS K (atomics). Q/dO of the next step
// stream in with cp.async while this one computes.
#pragma once

#include <stdint.h>

#include "arch.cuh"
#include "block_info.cuh"
#include "bwd_params.h"
#include "frag.cuh"
#include "mask.cuh"
#include "mask_mod.cuh"
#include "philox.cuh"
#include "philox_seed.cuh"
#include "schedule.cuh"
#include "score_mod.cuh"
#include "tile_io.cuh"

namespace fg {

// The backward family's IO counters, in the order of its Python table (families/backward.py).
struct BwdIo {
  enum IoTensor {
    kQ = 0, kK, kV, kO, kDO, kLse, kDsum, kDqAccum, kDq, kDk, kDv, kMeta, kKeepMask,
    kNumIoTensors
  };
  static constexpr int kCount = kNumIoTensors;
};

constexpr int cmin(int a, int b) { return a < b ? a : b; }

// A compile-time int passed to a generic lambda (the scores product runs over d or d_v).
template <int N>
struct IntC {
  static constexpr int value = N;
};

// S: the spec as named constants (templates/common/spec_struct.j2).
template <class S>
struct BwdConfig : S {
  using S::kBlockM, S::kBlockN, S::kHeadDim, S::kHeadDimV, S::kWarps, S::kStages;
  using Elem = typename S::Elem;
  static constexpr int kThreads = kWarps * 32;
  static constexpr bool kDqAccumPacked = true;  // dq_accum's varlen rows (glossary)
  // kHeadDimPad: the head dim on chip (families/backward.py chip_head_dim: the next multiple
  // of 16, beyond 128 of 32). Columns d..kHeadDimPad-1 of the K, V, Q and dO tiles are
  // zero-filled in smem (never read from HBM), so every product's padded columns are 0, and
  // the padded columns of dQ, dK and dV are never stored. kHeadDimVPad: d_v's, for V and dO.
  using S::kHeadDimPad, S::kHeadDimVPad;
  static constexpr int kStride = kHeadDimPad + 8;    // K, Q rows (elements)
  static constexpr int kStrideV = kHeadDimVPad + 8;  // V, dO rows (elements)
  static constexpr int kPStride = kBlockN + 8;   // P, dS rows (elements)
  // Warps along rows of each stage's output (families/backward.py warp_layouts: up to
  // d = 128 warp tiles as square as the block allows, which minimises each warp's ldmatrix
  // reads per mma; beyond, 16-row warp tiles, lighter on registers).
  // S/dP: warps over (query rows, keys)
  static constexpr int kSRows = S::kSRows, kSCols = kWarps / kSRows;
  static constexpr int kSMT = kBlockM / 16 / kSRows, kSNT = kBlockN / kSCols / 8;
  // dK/dV: warps over (keys, head dim)
  static constexpr int kKvRows = S::kKvRows, kKvCols = kWarps / kKvRows;
  static constexpr int kKvMT = kBlockN / 16 / kKvRows, kKvDT = kHeadDimPad / kKvCols / 8;
  static constexpr int kKvDTV = kHeadDimVPad / kKvCols / 8;  // dV's n8 tiles per warp
  // dQ: warps over (query rows, head dim)
  static constexpr int kQRows = S::kQRows, kQCols = kWarps / kQRows;
  static constexpr int kQMT = kBlockM / 16 / kQRows, kQDT = kHeadDimPad / kQCols / 8;
  static constexpr int kKS = kHeadDimPad / 16, kMS = kBlockM / 16, kNS = kBlockN / 16;
  static constexpr int kKSV = kHeadDimVPad / 16;  // k16 steps of dP = dO V^T

  static constexpr int kElem = static_cast<int>(sizeof(Elem));
  static constexpr int kKvTile = kBlockN * kStride, kQTile = kBlockM * kStride;  // K, Q
  static constexpr int kVTile = kBlockN * kStrideV, kDoTile = kBlockM * kStrideV;  // V, dO
  static constexpr int kPTile = kBlockM * kPStride;
  // P through an fp32 scratch instead of registers while dP is computed (the generator's
  // choice, families/backward.py p_scratch): frees kBlockM * kBlockN / kThreads registers at
  // the step's peak, where the dK/dV accumulators, S and dP would all be live.
  static constexpr bool kPScratch = S::kPScratch;
  static constexpr int kSmemBytes =
      (kKvTile + kVTile + kStages * (kQTile + kDoTile) + 2 * kPTile) * kElem +
                                    2 * kStages * kBlockM * 4 +
                                    (kPScratch ? kBlockM * kBlockN * 4 : 0);

  static_assert(kSRows * kSCols == kWarps && kSNT % 2 == 0, "S/dP warp layout");
  static_assert(kKvRows * kKvCols == kWarps && kKvDT % 2 == 0 && kKvDTV % 2 == 0,
                "dK/dV warp layout");
  static_assert(kQRows * kQCols == kWarps && kQDT % 2 == 0, "dQ warp layout");
  // Each layout covers its output exactly (families/backward.py tile_problems checks the same).
  static_assert(kSMT * kSRows * 16 == kBlockM && kSNT * kSCols * 8 == kBlockN, "S/dP cover");
  static_assert(kKvMT * kKvRows * 16 == kBlockN && kKvDT * kKvCols * 8 == kHeadDimPad &&
                    kKvDTV * kKvCols * 8 == kHeadDimVPad,
                "dK/dV cover");
  static_assert(kQMT * kQRows * 16 == kBlockM && kQDT * kQCols * 8 == kHeadDimPad, "dQ cover");
  static_assert(kHeadDim % 8 == 0 && kHeadDim >= 8 && kHeadDim <= 256, "head_dim");
  static_assert(kHeadDimPad % 16 == 0 && kHeadDimPad >= kHeadDim, "head_dim_pad");
  static_assert(kHeadDimV % 8 == 0 && kHeadDimV >= 8 && kHeadDimV <= 256, "head_dim_v");
  static_assert(kHeadDimVPad % 16 == 0 && kHeadDimVPad >= kHeadDimV, "head_dim_v_pad");
  static_assert(kStages == 1 || kStages == 2, "stages");
  static_assert(!S::kKeepMaskOut || S::kDropout, "the keep-mask output needs dropout");
};

__device__ __forceinline__ int ld_acquire(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The first K/V tile (of tiles [0, n]) whose dense schedule visits query tile m: m_hi grows
// with the tile, so a binary search over m_hi(n') > m finds it.
// dq_accum's row of query row r of sequence `seq` (glossary: packed, or b * seqlen_q + r).
template <class C, class Seq>
__device__ __forceinline__ int64_t dq_accum_row(const fg_bwd_params& p, const Seq& seq,
                                                int64_t r) {
  if constexpr (C::kDqAccumPacked) return seq.grow(r);
  return seq.b * p.seqlen_q + r;
}

template <class Mask>
__device__ __forceinline__ int64_t first_visitor(const Mask& mask, int64_t m, int64_t n,
                                                 int64_t sk, int block_m, int block_n) {
  int64_t lo = 0, hi = n;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    const int64_t c0 = mid * block_n, c1 = min(c0 + block_n, sk) - 1;
    int64_t m_lo, m_hi;
    mask.q_tile_range(c0, c1, block_m, m_lo, m_hi);
    if (m_hi > m) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// One step of a CTA's walk: query head offset g in the group, schedule position it, query
// tile m (sparse: read from the layout once, when the step is planned).
struct BwdStep {
  int g = 0, it = 0;
  int64_t m = 0;
  bool partial = false, valid = false;
};

template <class C>
__device__ __forceinline__ void bwd_kernel_body(const fg_bwd_params& p) {
  using Elem = typename C::Elem;
  using MmaT = Mma<Elem>;
  using Schedule = TileSchedule<C::kSparse, /*descending=*/false>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Elem* sK = reinterpret_cast<Elem*>(smem_raw);
  Elem* sV = sK + C::kKvTile;
  Elem* sQ = sV + C::kVTile;
  Elem* sdO = sQ + C::kStages * C::kQTile;
  Elem* sP = sdO + C::kStages * C::kDoTile;
  Elem* sdS = sP + C::kPTile;
  float* sLse = reinterpret_cast<float*>(sdS + C::kPTile);
  float* sD = sLse + C::kStages * C::kBlockM;
  float* sPf = sD + C::kStages * C::kBlockM;  // kPScratch: each thread's P (fp32)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g8 = lane >> 2, t4 = lane & 3;
  const LaneOffsets lo(lane);
  Io<C::kInstrumentIo, BwdIo> io;

  // ---- which (K/V tile, KV head, batch) this CTA is, and where its sequence lies ---------
  const int64_t num_nt = (p.seqlen_k + C::kBlockN - 1) / C::kBlockN;
  int64_t bid = blockIdx.x;
  const int64_t nt = bid % num_nt;
  bid /= num_nt;
  const int64_t hk = bid % p.kv_heads, b = bid / p.kv_heads;
  if (b >= p.batch) return;
  const SeqInfo<C::kVarlen> seq(b, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k, io,
                                tid == 0);
  const int64_t sq = seq.sq, sk = seq.sk, c0 = nt * C::kBlockN;
  if (c0 >= sk) {  // a shorter sequence of a varlen batch
    io.flush(p.io_counters);
    return;
  }
  const int64_t kr = min(static_cast<int64_t>(C::kBlockN), sk - c0);
  const int group = C::kGqa ? static_cast<int>(p.heads / p.kv_heads) : 1;
  const int64_t h0 = hk * group;
  const MaskPolicy<C::kCausal, C::kWindow> mask(sq, sk, p.window_left, p.window_right);

  // ---- the walk: heads of the group x each head's query tiles ----------------------------
  auto schedule = [&](int g) {
    if (C::kSparse) {
      const int64_t row = (p.blk_layout_heads == 1 ? 0 : h0 + g) * num_nt + nt;
      return Schedule::sparse(p.blk_full_count, p.blk_full_idx, p.blk_part_count,
                              p.blk_part_idx, row, p.blk_max_blocks, io, tid == 0);
    }
    int64_t m_lo, m_hi;
    mask.q_tile_range(c0, c0 + kr - 1, C::kBlockM, m_lo, m_hi);
    return Schedule::dense(m_lo, m_hi);
  };
  // The step after `s`: the next position of head s.g's schedule `sched`, else the first of
  // the next head with a non-empty one (`sched` then becomes that head's). Steps are planned
  // in order, one ahead of the one computing, so one schedule is live at a time.
  Schedule sched = schedule(0);
  // The mask stage of a spec's mask_mod (mask_mod.cuh; off and free without one), for the
  // group's first head; `umask0.at(h)` is head h's.
  const MaskModOf<C> umask0(p.score, b, h0, seq.q_off(p.seqlen_q, 1, 0),
                            seq.k_off(p.seqlen_k, 1, 0), sq, sk);
  auto advance = [&](BwdStep s) {
    s.it += 1;
    while (s.it >= sched.count) {
      if (s.g + 1 >= group) {
        s.valid = false;
        return s;
      }
      s.g += 1;
      s.it = 0;
      sched = schedule(s.g);
    }
    s.m = sched.tile(s.it, io, tid == 0);
    s.partial = sched.partial(s.it);
    s.valid = true;
    return s;
  };
  // ... skipping the steps whose tile the mask_mod leaves EMPTY (with one: a kernel without
  // calls `advance` itself, as before).
  auto advance_mm = [&](BwdStep s) {
    s = advance(s);
    while (MaskModOf<C>::kOn && s.valid &&
           umask0.at(p.score, h0 + s.g)
                   .tile_class(s.m * C::kBlockM, s.m * C::kBlockM + C::kBlockM - 1, c0,
                               c0 + kr - 1) == kMaskEmpty)
      s = advance(s);
    return s;
  };
  // (a macro, not a third lambda: a kernel without a mask_mod then compiles to the very PTX it
  // had, which a wrapping lambda changed; #undef after the walk)
#define FG_BWD_ADVANCE(s) (MaskModOf<C>::kOn ? advance_mm(s) : advance(s))
  BwdStep first;
  first.it = -1;
  BwdStep cur = FG_BWD_ADVANCE(first);

  const Elem* gK = static_cast<const Elem*>(p.k) + seq.k_off(p.k_batch_stride, p.k_row_stride, c0) +
                   hk * p.k_head_stride;
  const Elem* gV = static_cast<const Elem*>(p.v) + seq.k_off(p.v_batch_stride, p.v_row_stride, c0) +
                   hk * p.v_head_stride;

  // Loads one step's Q, dO, LSE and D into `slot` (one cp.async group).
  auto load_step = [&](const BwdStep& s, int slot) {
    const int64_t h = h0 + s.g, r0 = s.m * C::kBlockM;
    const int64_t qr = min(static_cast<int64_t>(C::kBlockM), sq - r0);
    const Elem* gQ = static_cast<const Elem*>(p.q) +
                     seq.q_off(p.q_batch_stride, p.q_row_stride, r0) + h * p.q_head_stride;
    const Elem* gdO = static_cast<const Elem*>(p.dout) +
                      seq.q_off(p.do_batch_stride, p.do_row_stride, r0) + h * p.do_head_stride;
    load_tile_async<C::kBlockM, C::kHeadDimPad, C::kThreads, C::kStride, C::kHeadDim>(
        sQ + slot * C::kQTile, gQ, p.q_row_stride, qr, io, BwdIo::kQ);
    load_tile_async<C::kBlockM, C::kHeadDimVPad, C::kThreads, C::kStrideV, C::kHeadDimV>(
        sdO + slot * C::kDoTile, gdO, p.do_row_stride, qr, io, BwdIo::kDO);
    for (int r = tid; r < C::kBlockM; r += C::kThreads) {
      const bool ok = r < qr;
      const int64_t row = ok ? r0 + r : 0;
      cp_async_4(sLse + slot * C::kBlockM + r,
                 p.lse + seq.lse_off(p.lse_batch_stride, p.lse_head_stride, h, row), ok);
      cp_async_4(sD + slot * C::kBlockM + r, p.dsum + seq.grow(row) * p.heads + h, ok);
      io.add(BwdIo::kLse, ok ? 4 : 0);
      io.add(BwdIo::kDsum, ok ? 4 : 0);
    }
    cp_async_commit();
  };

  float acc_dk[C::kKvMT][C::kKvDT][4], acc_dv[C::kKvMT][C::kKvDTV][4];
#pragma unroll
  for (int mt = 0; mt < C::kKvMT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < C::kKvDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[mt][dt][e] = 0.f;
#pragma unroll
    for (int dt = 0; dt < C::kKvDTV; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dv[mt][dt][e] = 0.f;
  }

  // Warp corners of the three layouts.
  const int s_row0 = (warp % C::kSRows) * C::kSMT * 16, s_col0 = (warp / C::kSRows) * C::kSNT * 8;
  const int kv_row0 = (warp % C::kKvRows) * C::kKvMT * 16;
  const int kv_col = warp / C::kKvRows;  // the warp's column of the dK/dV layout
  const int kv_col0 = kv_col * C::kKvDT * 8, kv_col0_v = kv_col * C::kKvDTV * 8;  // dK's, dV's
  const int q_row0 = (warp % C::kQRows) * C::kQMT * 16, q_col0 = (warp / C::kQRows) * C::kQDT * 8;
  constexpr uint32_t kE = sizeof(Elem);
  const uint32_t sK_a = smem_addr(sK), sV_a = smem_addr(sV), sQ_a = smem_addr(sQ);
  const uint32_t sdO_a = smem_addr(sdO), sP_a = smem_addr(sP), sdS_a = smem_addr(sdS);
  using Mod = ScoreModOf<C, false>;  // the score stage (score_mod.cuh); the LSE holds the sink
  const Mod mod0(p.score, p.softmax_scale);
  const float drop_scale = C::kDropout ? static_cast<float>(1.0 / (1.0 - p.dropout_p)) : 1.f;
  // the Philox stream's (seed, offset): by value, or read once here (philox_seed.cuh)
  const PhiloxSeed philox = C::kDropout ? philox_seed(p) : PhiloxSeed{0, 0};

  if (cur.valid) {
    load_tile_async<C::kBlockN, C::kHeadDimPad, C::kThreads, C::kStride, C::kHeadDim>(
        sK, gK, p.k_row_stride, kr, io, BwdIo::kK);
    load_tile_async<C::kBlockN, C::kHeadDimVPad, C::kThreads, C::kStrideV, C::kHeadDimV>(
        sV, gV, p.v_row_stride, kr, io, BwdIo::kV);
    load_step(cur, 0);  // K and V ride in the same group
  }
  BwdStep nxt = cur.valid ? FG_BWD_ADVANCE(cur) : cur;

  for (int step = 0; cur.valid; ++step) {
    const int slot = C::kStages == 2 ? (step & 1) : 0;
    if (C::kStages == 1 && step > 0) load_step(cur, 0);
    cp_async_wait<0>();
    __syncthreads();  // this step's tiles are visible; every warp finished the last step
    if (C::kStages == 2 && nxt.valid) load_step(nxt, slot ^ 1);

    const int64_t h = h0 + cur.g, r0 = cur.m * C::kBlockM;
    const int64_t qr = min(static_cast<int64_t>(C::kBlockM), sq - r0);
    const uint32_t q_slot = sQ_a + slot * C::kQTile * kE, do_slot = sdO_a + slot * C::kDoTile * kE;
    const float* lse_s = sLse + slot * C::kBlockM;
    const float* d_s = sD + slot * C::kBlockM;

    // ---- S = Q K^T, P and Pd; then dP = dO V^T and dS, over (query rows, keys) ----------
    // KS: the k16 steps (of d for S, of d_v for dP); St: the operands' smem row stride.
    auto scores = [&](auto ks_c, auto stride_c, uint32_t a_slot, uint32_t b_base,
                      float (&acc)[C::kSMT][C::kSNT][4]) {
      constexpr int KS = decltype(ks_c)::value, St = decltype(stride_c)::value;
#pragma unroll
      for (int mt = 0; mt < C::kSMT; ++mt)
#pragma unroll
        for (int n8 = 0; n8 < C::kSNT; ++n8)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][n8][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        uint32_t a[C::kSMT][4];
#pragma unroll
        for (int mt = 0; mt < C::kSMT; ++mt)
          ldmatrix_x4(a[mt], a_slot + ((s_row0 + mt * 16 + lo.a_row) * St + kk * 16 +
                                       lo.a_col) * kE);
#pragma unroll
        for (int np = 0; np < C::kSNT / 2; ++np) {
          uint32_t bk[4];
          ldmatrix_x4(bk, b_base + ((s_col0 + np * 16 + lo.b_row) * St + kk * 16 +
                                    lo.b_col) * kE);
#pragma unroll
          for (int mt = 0; mt < C::kSMT; ++mt) {
            MmaT::run(acc[mt][2 * np], a[mt], bk[0], bk[1]);
            MmaT::run(acc[mt][2 * np + 1], a[mt], bk[2], bk[3]);
          }
        }
      }
    };
    // The fragment element (mt, n8, e) of this thread: its row in the tile, its bit in `keep`
    // and its fp32 slot in the thread's scratch (float4 c at (c * threads + tid) * 4: each
    // quarter warp touches 128 consecutive bytes, no bank conflict).
    auto frag_row = [&](int mt, int e) { return s_row0 + mt * 16 + g8 + (e >> 1) * 8; };
    auto sp_slot = [&](int mt, int n8) {
      return sPf + ((mt * C::kSNT + n8) * C::kThreads + tid) * 4;
    };

    // The score stage of (b, h) (score_mod.cuh); g: its derivative per element (softcap).
    const Mod mod = mod0.at(p.score, p.softmax_scale, b, h, io, tid == 0, BwdIo::kMeta);
    float acc_s[C::kSMT][C::kSNT][4];
    float gmod[Mod::kHasGrad ? C::kSMT : 1][Mod::kHasGrad ? C::kSNT : 1][4];
    scores(IntC<C::kKS>{}, IntC<C::kStride>{}, q_slot, sK_a, acc_s);
    score_frag(acc_s, mod, tile_at(r0 + s_row0, c0 + s_col0, mask), lane, gmod);
    const bool masked = C::kSparse ? (cur.partial || c0 + C::kBlockN > sk)
                                   : mask.tile_needs_mask(r0, r0 + qr - 1, nt, C::kBlockN);
    if (masked) mask_frag(acc_s, mask.tile(r0 + s_row0, c0 + s_col0), lane);
    if constexpr (MaskModOf<C>::kOn) {  // a step is never EMPTY here (advance skips those)
      const MaskModOf<C> umask = umask0.at(p.score, h);
      if (umask.tile_class(r0, r0 + qr - 1, c0, c0 + kr - 1) != kMaskFull)
        umask.mask_frag(acc_s, r0 + s_row0, c0 + s_col0, lane);
    }
    // P = exp2(S * scale * log2 e - LSE * log2 e); a row whose LSE is -inf (no visible key)
    // gets P = 0, never inf * 0.
#pragma unroll
    for (int mt = 0; mt < C::kSMT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float lse = lse_s[frag_row(mt, e)];
        float base = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
        // Rows past the sequence (zero Q, dO and LSE) give P = 1 times zeros without a score
        // modifier; a modifier can make their scores large (ALiBi with a negative slope), so
        // they get P = 0 instead. A score_mod may even give +inf or NaN there (an expression
        // of i past seqlen_q), where exp2(y - inf) is NaN: such rows take P = 0 by a select.
        if constexpr (Mod::kTransforms)
          if (frag_row(mt, e) >= qr) base = INFINITY;
        const bool dead = Mod::kUser && base == INFINITY;
#pragma unroll
        for (int n8 = 0; n8 < C::kSNT; ++n8) {
          const float pv =
              exp2_approx(__fsub_rn(__fmul_rn(acc_s[mt][n8][e], mod.scale_log2), base));
          acc_s[mt][n8][e] = dead ? 0.f : pv;
        }
      }
    // Dropout's keep decisions, one bit per fragment element (the forward's Philox stream).
    uint32_t keep_bits[(C::kSMT * C::kSNT * 4 + 31) / 32];
#pragma unroll
    for (int w = 0; w < (C::kSMT * C::kSNT * 4 + 31) / 32; ++w) keep_bits[w] = 0u;
    if (C::kDropout) {
      const DropoutRng rng =
          make_dropout_rng(philox.seed, philox.offset, b * p.heads + h, p.dropout_p);
      dropout_frag<C::kSMT, C::kSNT>(
          rng, r0 + s_row0, c0 + s_col0, lane,
          [&](int mt, int n8, int e, bool keep, int64_t i, int64_t j) {
            if (C::kKeepMaskOut && i < sq && j < sk)
              store_keep(p.keep_mask + ((b * p.heads + h) * p.seqlen_q + i) * p.seqlen_k + j, keep,
                         io);
            const int bit = (mt * C::kSNT + n8) * 4 + e;
            if (keep) keep_bits[bit / 32] |= 1u << (bit % 32);
          });
    }
    auto kept = [&](int mt, int n8, int e) {
      const int bit = (mt * C::kSNT + n8) * 4 + e;
      return !C::kDropout || ((keep_bits[bit / 32] >> (bit % 32)) & 1u);
    };
    // Pd (P * keep / (1 - p)) to shared memory, rows = query, columns = key; with kPScratch
    // P itself goes to the thread's fp32 scratch, so S's registers are free while dP runs.
#pragma unroll
    for (int mt = 0; mt < C::kSMT; ++mt)
#pragma unroll
      for (int n8 = 0; n8 < C::kSNT; ++n8) {
        float pd[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          pd[e] = !C::kDropout      ? acc_s[mt][n8][e]
                  : kept(mt, n8, e) ? acc_s[mt][n8][e] * drop_scale
                                    : 0.f;
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<uint32_t*>(sP + frag_row(mt, 2 * r) * C::kPStride + s_col0 + n8 * 8 +
                                       2 * t4) = MmaT::pack(pd[2 * r], pd[2 * r + 1]);
        if (C::kPScratch)
          *reinterpret_cast<float4*>(sp_slot(mt, n8)) =
              make_float4(acc_s[mt][n8][0], acc_s[mt][n8][1], acc_s[mt][n8][2], acc_s[mt][n8][3]);
      }

    float acc_dp[C::kSMT][C::kSNT][4];
    scores(IntC<C::kKSV>{}, IntC<C::kStrideV>{}, do_slot, sV_a, acc_dp);
    // dS = P * (dP * keep / (1 - p) - D), to shared memory like Pd.
#pragma unroll
    for (int mt = 0; mt < C::kSMT; ++mt)
#pragma unroll
      for (int n8 = 0; n8 < C::kSNT; ++n8) {
        float pe[4];
        if (C::kPScratch) {
          const float4 v = *reinterpret_cast<const float4*>(sp_slot(mt, n8));
          pe[0] = v.x, pe[1] = v.y, pe[2] = v.z, pe[3] = v.w;
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) pe[e] = acc_s[mt][n8][e];
        }
        float ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float dsum = d_s[frag_row(mt, e)];
          const float dp = !C::kDropout ? acc_dp[mt][n8][e]
                                        : kept(mt, n8, e) ? acc_dp[mt][n8][e] * drop_scale : 0.f;
          ds[e] = pe[e] * (dp - dsum);
          // d(mod)/ds where P = 0 (masked, past the sequence) is never used: a score_mod's
          // derivative may be inf or NaN there (log(i - j + 1) above the diagonal), and
          // 0 * inf would be NaN in dQ and dK
          if constexpr (Mod::kHasGrad) {
            const float gm = gmod[Mod::kHasGrad ? mt : 0][Mod::kHasGrad ? n8 : 0][e];
            ds[e] = Mod::kUserGrad && pe[e] == 0.f ? 0.f : ds[e] * gm;
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<uint32_t*>(sdS + frag_row(mt, 2 * r) * C::kPStride + s_col0 + n8 * 8 +
                                       2 * t4) = MmaT::pack(ds[2 * r], ds[2 * r + 1]);
      }
    __syncthreads();  // Pd and dS visible to every warp

    // ---- dV += Pd^T dO and dK += dS^T Q over (keys, head dim) ---------------------------
    // One product at a time: each operand is read once either way, and only one A set (the
    // transposed Pd or dS rows) is live next to the accumulators.
    // DT: the warp's n8 tiles (of d for dK, of d_v for dV); St: the B operand's row stride.
    auto kv_update = [&](auto st_c, uint32_t a_base, uint32_t b_slot, auto& acc) {
      constexpr int St = decltype(st_c)::value;
      constexpr int DT = sizeof(acc[0]) / sizeof(acc[0][0]);
      const int col0 = kv_col * DT * 8;
#pragma unroll
      for (int ks = 0; ks < C::kMS; ++ks) {
        uint32_t a[C::kKvMT][4];
#pragma unroll
        for (int mt = 0; mt < C::kKvMT; ++mt)  // A = Pd^T or dS^T, stored [query][key]: .trans
          ldmatrix_x4_trans(a[mt], a_base + ((ks * 16 + lo.b_row) * C::kPStride + kv_row0 +
                                             mt * 16 + lo.b_col) * kE);
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
          uint32_t bt[4];
          ldmatrix_x4_trans(bt, b_slot + ((ks * 16 + lo.a_row) * St + col0 + dp * 16 +
                                          lo.a_col) * kE);
#pragma unroll
          for (int mt = 0; mt < C::kKvMT; ++mt) {
            MmaT::run(acc[mt][2 * dp], a[mt], bt[0], bt[1]);
            MmaT::run(acc[mt][2 * dp + 1], a[mt], bt[2], bt[3]);
          }
        }
      }
    };
    kv_update(IntC<C::kStrideV>{}, sP_a, do_slot, acc_dv);
    kv_update(IntC<C::kStride>{}, sdS_a, q_slot, acc_dk);

    // ---- dQ += dS K over (query rows, head dim), added to dq_accum ----------------------
    {
      float acc_dq[C::kQMT][C::kQDT][4];
#pragma unroll
      for (int mt = 0; mt < C::kQMT; ++mt)
#pragma unroll
        for (int dt = 0; dt < C::kQDT; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dq[mt][dt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < C::kNS; ++ks) {
        uint32_t a[C::kQMT][4];
#pragma unroll
        for (int mt = 0; mt < C::kQMT; ++mt)
          ldmatrix_x4(a[mt], sdS_a + ((q_row0 + mt * 16 + lo.a_row) * C::kPStride + ks * 16 +
                                      lo.a_col) * kE);
#pragma unroll
        for (int dp = 0; dp < C::kQDT / 2; ++dp) {
          uint32_t bk[4];
          ldmatrix_x4_trans(bk, sK_a + ((ks * 16 + lo.a_row) * C::kStride + q_col0 + dp * 16 +
                                        lo.a_col) * kE);
#pragma unroll
          for (int mt = 0; mt < C::kQMT; ++mt) {
            MmaT::run(acc_dq[mt][2 * dp], a[mt], bk[0], bk[1]);
            MmaT::run(acc_dq[mt][2 * dp + 1], a[mt], bk[2], bk[3]);
          }
        }
      }
      int32_t* sem = nullptr;
      int turn = 0;
      if (C::kDeterministic) {  // wait until the K/V tiles before this one have added
        sem = p.dq_sem + (b * p.heads + h) * ((p.seqlen_q + C::kBlockM - 1) / C::kBlockM) + cur.m;
        turn = static_cast<int>(nt - first_visitor(mask, cur.m, nt, sk, C::kBlockM, C::kBlockN));
        if (tid == 0)
          while (ld_acquire(sem) != turn) __nanosleep(64);
        __syncthreads();
      }
#pragma unroll
      for (int mt = 0; mt < C::kQMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = q_row0 + mt * 16 + g8 + r * 8;
          if (row < qr) {
            float* dst = p.dq_accum + (dq_accum_row<C>(p, seq, r0 + row) * p.heads + h) *
                                          C::kHeadDim + q_col0 + 2 * t4;
#pragma unroll
            for (int dt = 0; dt < C::kQDT; ++dt) {
              if (C::kHeadDimPad != C::kHeadDim && q_col0 + dt * 8 >= C::kHeadDim) continue;
              atomic_add_f32(dst + dt * 8, acc_dq[mt][dt][2 * r], io, BwdIo::kDqAccum);
              atomic_add_f32(dst + dt * 8 + 1, acc_dq[mt][dt][2 * r + 1], io, BwdIo::kDqAccum);
            }
          }
        }
      if (C::kDeterministic) {  // this tile's adds are done: the next K/V tile's turn
        __syncthreads();  // every thread's adds precede thread 0's fence (CTA order) ...
        if (tid == 0) {
          __threadfence();  // ... and the fence is cumulative: all of them before the release
          atomicExch(sem, turn + 1);
        }
      }
    }
    if (C::kStages == 1) __syncthreads();  // the only buffers are refilled next step
    cur = nxt;
    if (nxt.valid) nxt = FG_BWD_ADVANCE(nxt);
  }
#undef FG_BWD_ADVANCE

  // ---- epilogue: dK = scale * dS^T Q, dV; zeros when no step saw these keys ---------------
  const float scale = static_cast<float>(p.softmax_scale);
  Elem* gdK = static_cast<Elem*>(p.dk) + seq.k_off(p.dk_batch_stride, p.dk_row_stride, c0) +
              hk * p.dk_head_stride;
  Elem* gdV = static_cast<Elem*>(p.dv) + seq.k_off(p.dv_batch_stride, p.dv_row_stride, c0) +
              hk * p.dv_head_stride;
#pragma unroll
  for (int mt = 0; mt < C::kKvMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = kv_row0 + mt * 16 + g8 + r * 8;
      if (row < kr) {
#pragma unroll
        for (int dt = 0; dt < C::kKvDT; ++dt) {
          const int col = kv_col0 + dt * 8 + 2 * t4;
          if (C::kHeadDimPad != C::kHeadDim && col >= C::kHeadDim) continue;  // padded columns
          store_pair(gdK + row * p.dk_row_stride + col,
                     MmaT::pack(acc_dk[mt][dt][2 * r] * scale, acc_dk[mt][dt][2 * r + 1] * scale),
                     io, BwdIo::kDk);
          if constexpr (C::kHeadDimV == C::kHeadDim)  // one loop for both (the code it had before d_v)
            store_pair(gdV + row * p.dv_row_stride + col,
                       MmaT::pack(acc_dv[mt][dt][2 * r], acc_dv[mt][dt][2 * r + 1]), io,
                       BwdIo::kDv);
        }
        if constexpr (C::kHeadDimV != C::kHeadDim) {
#pragma unroll
          for (int dt = 0; dt < C::kKvDTV; ++dt) {
            const int col = kv_col0_v + dt * 8 + 2 * t4;
            if (C::kHeadDimVPad != C::kHeadDimV && col >= C::kHeadDimV) continue;
            store_pair(gdV + row * p.dv_row_stride + col,
                       MmaT::pack(acc_dv[mt][dt][2 * r], acc_dv[mt][dt][2 * r + 1]), io,
                       BwdIo::kDv);
          }
        }
      }
    }
  io.flush(p.io_counters);
}

// ---- the two row kernels: one warp per row, lanes over 8-element chunks ----------------
constexpr int kRowWarps = 4, kRowsPerWarp = 8;  // 32 rows of one head per CTA

template <class C>
__device__ __forceinline__ void bwd_row_coords(const fg_bwd_params& p, int64_t& r_first,
                                               int64_t& h, int64_t& b) {
  const int64_t row_blocks = (p.seqlen_q + kRowWarps * kRowsPerWarp - 1) / (kRowWarps * kRowsPerWarp);
  int64_t bid = blockIdx.x;
  r_first = (bid % row_blocks) * kRowWarps * kRowsPerWarp;
  bid /= row_blocks;
  h = bid % p.heads;
  b = bid / p.heads;
}

// D = rowsum(dO * O) in fp32, into dsum (rows, heads).
template <class C>
__device__ __forceinline__ void bwd_preprocess_body(const fg_bwd_params& p) {
  using Elem = typename C::Elem;
  Io<C::kInstrumentIo, BwdIo> io;
  int64_t r_first, h, b;
  bwd_row_coords<C>(p, r_first, h, b);
  if (b >= p.batch) return;
  Io<false, BwdIo> quiet;  // cu_seqlens reads of the row kernels are not counted
  const SeqInfo<C::kVarlen> seq(b, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k, quiet,
                                false);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r_first + warp * kRowsPerWarp + i;
    if (r >= seq.sq) break;
    const Elem* o = static_cast<const Elem*>(p.o) + seq.q_off(p.o_batch_stride, p.o_row_stride, r) +
                    h * p.o_head_stride;
    const Elem* d = static_cast<const Elem*>(p.dout) +
                    seq.q_off(p.do_batch_stride, p.do_row_stride, r) + h * p.do_head_stride;
    float acc = 0.f;
    for (int c = lane; c < C::kHeadDimV / 8; c += 32) {  // O and dO are d_v wide
      const uint4 ov = load_16(o + c * 8, io, BwdIo::kO), dv = load_16(d + c * 8, io, BwdIo::kDO);
      const Elem* oe = reinterpret_cast<const Elem*>(&ov);
      const Elem* de = reinterpret_cast<const Elem*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc += to_float(oe[e]) * to_float(de[e]);
    }
#pragma unroll
    for (int o2 = 16; o2 > 0; o2 >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o2);
    if (lane == 0) store_f32(p.dsum + seq.grow(r) * p.heads + h, acc, io, BwdIo::kDsum);
  }
  io.flush(p.io_counters);
}

// Attention sinks (score_mod.cuh): dsink_h = -sum over batches and query rows of
// exp(sink_h - LSE) * D, one CTA per query head (grid: heads), after the preprocess wrote D.
// Each thread walks rows in a fixed order and the CTA reduces in a fixed order, so dsinks is
// bitwise repeatable; it is written, not accumulated. A row whose LSE is -inf adds nothing.
constexpr int kDsinkThreads = 128;

template <class C>
__device__ __forceinline__ void bwd_dsink_body(const fg_bwd_params& p) {
  if constexpr (C::kSink) {
    Io<C::kInstrumentIo, BwdIo> io;
    Io<false, BwdIo> quiet;
    const int64_t h = blockIdx.x;
    const int tid = threadIdx.x;
    const float sink = __ldg(p.score.sinks + h);  // every thread reads it; one counts it
    if (tid == 0) io.add(BwdIo::kMeta, 4);
    float acc = 0.f;
    for (int64_t b = 0; b < p.batch; ++b) {
      const SeqInfo<C::kVarlen> seq(b, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k,
                                    quiet, false);
      for (int64_t r = tid; r < seq.sq; r += kDsinkThreads) {
        const float lse = load_f32(p.lse + seq.lse_off(p.lse_batch_stride, p.lse_head_stride, h, r),
                                   io, BwdIo::kLse);
        const float d = load_f32(p.dsum + seq.grow(r) * p.heads + h, io, BwdIo::kDsum);
        if (lse != -INFINITY) acc += expf(sink - lse) * d;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ float part[kDsinkThreads / 32];
    if ((tid & 31) == 0) part[tid >> 5] = acc;
    __syncthreads();
    if (tid == 0) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kDsinkThreads / 32; ++w) total += part[w];
      store_f32(p.score.dsinks + h, -total, io, BwdIo::kMeta);
    }
    io.flush(p.io_counters);
  }
}

// dQ = softmax_scale * dq_accum, in the output dtype.
template <class C>
__device__ __forceinline__ void bwd_convert_body(const fg_bwd_params& p) {
  using Elem = typename C::Elem;
  using MmaT = Mma<Elem>;
  Io<C::kInstrumentIo, BwdIo> io;
  int64_t r_first, h, b;
  bwd_row_coords<C>(p, r_first, h, b);
  if (b >= p.batch) return;
  Io<false, BwdIo> quiet;
  const SeqInfo<C::kVarlen> seq(b, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q, p.cu_seqlens_k, quiet,
                                false);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = static_cast<float>(p.softmax_scale);
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r_first + warp * kRowsPerWarp + i;
    if (r >= seq.sq) break;
    const float* acc = p.dq_accum + (dq_accum_row<C>(p, seq, r) * p.heads + h) * C::kHeadDim;
    Elem* dq = static_cast<Elem*>(p.dq) + seq.q_off(p.dq_batch_stride, p.dq_row_stride, r) +
               h * p.dq_head_stride;
    for (int c = lane; c < C::kHeadDim / 8; c += 32) {
      const float4 a0 = *reinterpret_cast<const float4*>(acc + c * 8);
      const float4 a1 = *reinterpret_cast<const float4*>(acc + c * 8 + 4);
      io.add(BwdIo::kDqAccum, 32);
      uint4 out;
      out.x = MmaT::pack(a0.x * scale, a0.y * scale);
      out.y = MmaT::pack(a0.z * scale, a0.w * scale);
      out.z = MmaT::pack(a1.x * scale, a1.y * scale);
      out.w = MmaT::pack(a1.z * scale, a1.w * scale);
      store_16(dq + c * 8, out, io, BwdIo::kDq);
    }
  }
  io.flush(p.io_counters);
}

template <class C>
int64_t bwd_grid(const fg_bwd_params& p) {
  return (p.seqlen_k + C::kBlockN - 1) / C::kBlockN * p.kv_heads * p.batch;
}
template <class C>
int64_t bwd_row_grid(const fg_bwd_params& p) {
  return (p.seqlen_q + kRowWarps * kRowsPerWarp - 1) / (kRowWarps * kRowsPerWarp) * p.heads *
         p.batch;
}

// The caller's fp32 workspace: dq_accum, then dsum, each rounded up to 256 bytes.
// `_used` is what the kernels touch (and the launcher zeroes), `_bytes` its padded share.
inline int64_t bwd_round256(int64_t n) { return (n + 255) / 256 * 256; }
template <class C>
int64_t bwd_dq_accum_used(const fg_bwd_params& p) {
  return p.batch * p.seqlen_q * p.heads * C::kHeadDim * 4;
}
template <class C>
int64_t bwd_dq_accum_bytes(const fg_bwd_params& p) {
  return bwd_round256(bwd_dq_accum_used<C>(p));
}
template <class C>
int64_t bwd_sem_used(const fg_bwd_params& p) {
  return C::kDeterministic ? p.batch * p.heads * ((p.seqlen_q + C::kBlockM - 1) / C::kBlockM) * 4
                           : 0;
}
template <class C>
int64_t bwd_sem_bytes(const fg_bwd_params& p) {
  return bwd_round256(bwd_sem_used<C>(p));
}
template <class C>
int64_t bwd_workspace_bytes(const fg_bwd_params& p) {
  return bwd_dq_accum_bytes<C>(p) + bwd_round256(p.batch * p.seqlen_q * p.heads * 4) +
         bwd_sem_bytes<C>(p);
}

}  // namespace fg
