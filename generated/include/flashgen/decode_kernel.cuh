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
//   split      the key tiles [n_lo, n_hi) the mask leaves are cut into `splits` equal runs;
//              with splits > 1 each CTA writes its normalised O and its LSE in fp32 to the
//              workspace and the combine kernel merges them
//   page ids   paged caches: lane l of every warp holds the block-table entry of page l of a
//              K/V tile, fetched one tile ahead (one lookup per page per tile, overlapping
//              the loads in flight); each row's source is a shuffle away
//
//   FP8 cache  (kKvFp8, spec kv_dtype: e4m3) K/V tiles land as e4m3 bytes in a `stages`-deep
//              ring (half the HBM and smem bytes of a 16-bit tile); each lane reads its MMA
//              fragments' bytes straight from the ring and converts them in registers
//              (Fp8Kv below: K to the q dtype, V to fp16, P V in fp16); k_descale joins the
//              softmax scale and v_descale multiplies O, so the maths is that of the
//              dequantised cache
//
// The maths per tile is the forward's: S = Q K^T and acc_o += P V (warp_mma.cuh), the online
// softmax (softmax.cuh), masks (mask.cuh, frag.cuh); loads and stores go through tile_io.cuh.
#pragma once

#include <math.h>
#include <stdint.h>

#include <cuda_fp8.h>
#include <type_traits>

#include "arch.cuh"
#include "decode_params.h"
#include "frag.cuh"
#include "mask.cuh"
#include "schedule.cuh"
#include "score_mod.cuh"
#include "sm90.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"
#include "warp_mma.cuh"

namespace fg {

// The decode family's IO counters, in the order of its Python table (families/decode.py).
struct DecIo {
  enum IoTensor {
    kQ = 0, kK, kV, kO, kLse, kOParts, kLseParts, kSeqlens, kBlockTable, kNumIoTensors
  };
  static constexpr int kCount = kNumIoTensors;
  // TileSchedule's sparse path names kMeta; the dense schedule decode uses never reads any.
  static constexpr int kMeta = kSeqlens;
};

constexpr int kDecodeMaxQueries = 16;   // seqlen_q per sequence
constexpr int kDecodeMaxSplits = 128;   // num_splits
constexpr int kCombineThreads = 128;    // threads of a combine CTA

// Paged K/V rows on sm_90 and later go by bulk copy (cp.async.bulk: one instruction per
// 16-byte aligned row, completion counted in bytes on the slot's mbarrier); contiguous caches
// and sm_80 builds use 16-byte cp.async chunks. Measured on the H200 (docs/benchmarks.md,
// "Decode v3"): paged, the chunks (a block-table shuffle and checks per 16 bytes) streamed
// 1.8-3.2 TB/s, the bulk rows 3.7-4.1 with two CTAs per SM; contiguous, the chunks with one
// CTA per SM led (3.9-4.2 TB/s, and 1.2-1.4x at 4k-32k at batch 1), while bulk rows stall
// near 2.4 TB/s with one CTA per SM (about 19 GB/s per CTA, whatever the stages).
// FP8 caches take the chunks on every target: their ring rows are XOR-swizzled (Fp8Kv).
template <class C>
__host__ __device__ constexpr bool decode_bulk_loads() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return C::kPaged && !C::kKvFp8;
#else
  return false;
#endif
}

// `bytes` (a multiple of 16, both ends 16-byte aligned) from global to shared memory, counted
// on `bar`'s transaction bytes (sm_90).
__device__ __forceinline__ void bulk_load_row(void* smem, const void* gmem, uint32_t bytes,
                                              uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#endif
}

// Programmatic dependent launch (sm_90): the split kernel lets its combine be scheduled early
// (`decode_allow_dependents`), and the combine waits for the split kernel's completion and
// memory before it reads a part (`decode_wait_for_parts`; a no-op when launched plainly).
__device__ __forceinline__ void decode_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void decode_wait_for_parts() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// A bad device value (a length past the capacity, a page id outside the pool): never read or
// written through (the caller clamps or zero-fills), the error word's bit set, and with
// trap_on_error a device-side assert that ends the launch with cudaErrorAssert, as
// flash-attn's guard does. `allowed` names what is allowed; the assert prints it.
__device__ __forceinline__ void decode_bad_input(unsigned int* word, unsigned int bits, int64_t trap,
                                              const char* allowed) {
  raise_error_flag(word, bits);
  if (!trap) return;
#if defined(__CUDACC_RTC__)
  __assertfail(allowed, "flashgen decode kernel", 0, "bad input", 1);
#elif defined(__GNUC__)
  __assert_fail(allowed, "flashgen decode kernel", 0, "bad input");  // what assert() calls
#else
  printf("flashgen decode kernel: bad input; allowed: %s\n", allowed);
  __trap();  // no assert entry point known here: an unspecified launch failure instead
#endif
}

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
  // kHeadDimPad: the head dim rounded up to the k16 steps of Q K^T. Columns
  // d..kHeadDimPad-1 of the Q, K and V tiles are zero in smem (never read from HBM), and
  // O's padded columns are dropped at the merge.
  using S::kHeadDimPad;
  static constexpr bool kPadded = kHeadDimPad != kHeadDim;
  static constexpr int kDT = kHeadDimPad / 8;         // n8 tiles of O along d
  static constexpr int kKS = kHeadDimPad / 16;        // k16 steps of Q K^T
  // K/V rows in shared memory. Contiguous caches (cp.async chunks): 128-byte aligned rows
  // with their 16-byte chunks XOR-swizzled (chunk ^ row % 8), so each 128-byte global line of
  // a warp's cp.async lands in one 128-byte shared segment (one full-line L2 request; rows
  // padded by 16 bytes split a sector across two wavefronts and moved 1.5x the K/V bytes from
  // L2, docs/benchmarks.md "Decode v3") and ldmatrix still meets 8 distinct bank groups.
  // Paged caches (bulk row copies write a row as it is) and head dims below 64 pad rows by 8
  // elements instead. Q keeps the padded rows.
  static constexpr bool kSwizzle = !S::kPaged && kHeadDim % 64 == 0;
  static constexpr int kStride = kSwizzle ? kHeadDim : kHeadDimPad + 8;  // K/V row, elements
  static constexpr int kQStride = kHeadDimPad + 8;                       // Q row, elements
  // Q is re-read from smem each tile (8 ldmatrix per warp for d = 128): a memory-bound loop
  // has the time, and the registers go to the address arithmetic of the loads in flight.
  static constexpr bool kQInRegs = false;
  static constexpr int kElem = static_cast<int>(sizeof(Elem));
  // FP8 caches (S::kKvFp8): the ring holds e4m3 bytes (KvT), unpadded swizzled rows of
  // kHeadDim, which the MMA steps read through registers; otherwise the ring is the 16-bit
  // slots ldmatrix reads.
  static constexpr bool kKvFp8 = S::kKvFp8;
  using KvT = typename std::conditional<kKvFp8, uint8_t, Elem>::type;
  static constexpr int kRingStride = kKvFp8 ? kHeadDim : kStride;  // ring row, KvT elements
  static constexpr int kTileBytes =
      kBlockM * kQStride * kElem +
      2 * kStages * kBlockN * kRingStride * static_cast<int>(sizeof(KvT));
  // The end-of-loop merge of the key warps reuses the tiles' memory: per warp, its rows'
  // accumulators (rows padded to d + 4 floats) and (m, l).
  static constexpr int kMergeStride = kHeadDimPad + 4;
  static constexpr int kMergeBytes = kWarpsN * kBlockM * (kMergeStride + 2) * 4;
  static constexpr int kSmemBytes = kTileBytes > kMergeBytes ? kTileBytes : kMergeBytes;
  // combine: the power of two >= kHeadDim / 8 threads per output row (a shuffle group),
  // 8 columns each; those past the row's columns only take part in the shuffles.
  static constexpr int kCombineRowThreads = kHeadDim <= 8    ? 1
                                            : kHeadDim <= 16 ? 2
                                            : kHeadDim <= 32 ? 4
                                            : kHeadDim <= 64 ? 8
                                            : kHeadDim <= 128 ? 16
                                                              : 32;
  static constexpr int kCombineRows = kCombineThreads / kCombineRowThreads;

  static_assert(kHeadDim % 8 == 0 && kHeadDim >= 8 && kHeadDim <= 256, "head_dim");
  static_assert(kHeadDimPad == (kHeadDim + 15) / 16 * 16, "head_dim_pad: the next multiple of 16");
  static_assert(!kSwizzle || !kPadded, "swizzled rows are unpadded");
  static_assert(kBlockM % 16 == 0 && kWarpsM >= 1 && kWarps % kWarpsM == 0, "block_m = 16 * warps_m");
  static_assert(kWarpKeys % 16 == 0 && kWarpKeys * kWarpsN == kBlockN, "16-key multiples per warp");
  static_assert(kStages >= 2, "the page-id prefetch and the ring need two stages");
  static_assert((kBlockN * kHeadDimPad / 8) % kThreads == 0,
                "whole K/V tiles per load pass (the page shuffle needs converged warps)");
  static_assert(kBlockN / 16 <= 32, "page ids of a tile fit a warp");
  static_assert((2 * kBlockN) % kThreads == 0, "bulk loads: whole K/V rows per thread");
  static_assert(S::kCausal != Causal::kTopLeft, "decode aligns causal masks bottom_right");
  static_assert(!kKvFp8 || kHeadDim % 16 == 0, "FP8 rows: whole 16-byte chunks");
  static_assert(!kKvFp8 || (kBlockN * kHeadDim / 16) % kThreads == 0,
                "FP8 tiles: whole 16-byte chunk passes (the page shuffle needs converged warps)");
};

// FP8 caches: each lane reads its fragments' e4m3 bytes from the ring and converts them in
// registers (no 16-bit copy of the tile, no second barrier per tile).
//   K, S = Q K^T: lane (g, t) reads, of key row n = 8 nt + g, the 4-byte word k_word(kk, t)
//     for k16 step kk; its bytes are the B fragment's k = 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1).
//     That reorders the head dim of K; Q's smem columns are reordered the same way once per
//     CTA (dec_permute_q_fp8), so Q . K is the same sum taken in another order.
//   V, O += P V (in fp16: P is in [0, 1] and every e4m3 value is an fp16 value): lane (g, t)
//     reads byte v_byte(dt, g) of key rows 2t, 2t+1, 2t+8, 2t+9 of each k16 step for n8 tile
//     dt, so O's column c of tile dt is the head dim's v_byte(dt, c), undone where the key
//     warps merge.
//   A lane's bytes of a row are whole vectors (up to 16 bytes), and the 16-byte chunks of a
//   ring row are XOR-swizzled per buffer (k_chunk, v_chunk) so that the loads of a warp meet
//   distinct banks when a row is a multiple of 128 bytes (8 lanes of one 16-byte phase: two
//   K rows x four chunks, or four V rows x two chunks).
template <class C>
struct Fp8Kv {
  static constexpr int kD = C::kHeadDim, kKS = C::kKS, kDT = C::kDT;
  static constexpr int kChunks = kD / 16;  // 16-byte chunks of a ring row
  static constexpr int kKVec = kKS % 4 == 0 ? 4 : kKS % 2 == 0 ? 2 : 1;  // K words per load
  static constexpr int kVVec =  // V bytes per load
      kDT % 16 == 0 ? 16 : kDT % 8 == 0 ? 8 : kDT % 4 == 0 ? 4 : 2;
  static constexpr int kVWords = (kDT + 3) / 4;  // a lane's V bytes of one row, as words
  __device__ static constexpr int k_word(int kk, int t) {
    return kKVec * (4 * (kk / kKVec) + t) + kk % kKVec;
  }
  __device__ static constexpr int v_byte(int dt, int n) {
    return kVVec * (8 * (dt / kVVec) + n) + dt % kVVec;
  }
  __device__ static constexpr int k_chunk(int r, int c) {
    return kChunks % 8 == 0 ? c ^ ((r & 1) << 2) : c;
  }
  __device__ static constexpr int v_chunk(int r, int c) { return kChunks % 8 == 0 ? c ^ (r & 6) : c; }
  // the ring offset of byte x of row r
  __device__ static int k_at(int r, int x) { return r * kD + k_chunk(r, x >> 4) * 16 + (x & 15); }
  __device__ static int v_at(int r, int x) { return r * kD + v_chunk(r, x >> 4) * 16 + (x & 15); }
  static_assert(kD % 16 == 0, "FP8 rows: whole 16-byte chunks");
};

// e4m3 -> fp16 or bf16, two at a time: exact (every e4m3 value, NaN included, is an fp16 and a
// bf16 value; e4m3fn has no inf). fp16: one cvt.rn.f16x2.e4m3x2 (sm_89+); bf16: through
// fp32 (cvt.rn.bf16x2.f32 of exact values is exact).
template <typename Elem>
__device__ __forceinline__ uint32_t e4m3x2_to(uint32_t x) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xffffu), __NV_E4M3);
  if constexpr (std::is_same<Elem, __half>::value) {
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  } else {
    const float2 f = __half22float2(__half2(h));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

// kWords 4-byte words of shared memory (16-byte aligned for 4, 8 for 2).
template <int kWords>
__device__ __forceinline__ void lds_words(uint32_t* w, const uint8_t* p) {
  if constexpr (kWords == 4) {
    const uint4 x = *reinterpret_cast<const uint4*>(p);
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  } else if constexpr (kWords == 2) {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    w[0] = x.x, w[1] = x.y;
  } else {
    static_assert(kWords == 1, "1, 2 or 4 words");
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
}

// Q's columns in the order of Fp8Kv's K words: logical column (16 kk + 2j + e) of each row
// takes the head dim's 4 k_word(kk, j % 4) + 2 (j / 4) + e, so ldmatrix reads the A fragment
// that meets the lane's K bytes. In place, once per CTA, every thread of the CTA.
template <class C>
__device__ __forceinline__ void dec_permute_q_fp8(typename C::Elem* sQ) {
  using F = Fp8Kv<C>;
  constexpr int kPairs = C::kHeadDim / 2, kTotal = C::kBlockM * kPairs;
  constexpr int kPer = (kTotal + C::kThreads - 1) / C::kThreads;
  uint32_t v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int w = i * C::kThreads + threadIdx.x;
    if (w < kTotal) {
      const int row = w / kPairs, lp = w % kPairs, kk = lp / 8, j = lp % 8;
      const int col = 4 * F::k_word(kk, j & 3) + 2 * (j >> 2);
      v[i] = *reinterpret_cast<const uint32_t*>(sQ + row * C::kQStride + col);
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int w = i * C::kThreads + threadIdx.x;
    if (w < kTotal)
      *reinterpret_cast<uint32_t*>(sQ + (w / kPairs) * C::kQStride + 2 * (w % kPairs)) = v[i];
  }
  __syncthreads();
}

// S = Q K^T over an FP8 ring slot: the warp's keys start at ring row `row0`. K's words are
// held for as many n8 tiles at a time as fit 32 registers, Q's A fragment re-read per group.
template <class C>
__host__ __device__ constexpr int fp8_k_group() {
  int n = C::kNT;
  while (n > 1 && (n * C::kKS > 32 || C::kNT % n != 0)) --n;
  return n;
}

template <class C, class LoadA>
__device__ __forceinline__ void dec_qk_fp8(float (&acc_s)[1][C::kNT][4], LoadA&& load_a,
                                           const uint8_t* ring, int row0, int g, int t) {
  using F = Fp8Kv<C>;
  using Elem = typename C::Elem;
  using MmaT = Mma<Elem>;
  constexpr int kGroup = fp8_k_group<C>();
#pragma unroll
  for (int n0 = 0; n0 < C::kNT; n0 += kGroup) {
    uint32_t kw[kGroup][C::kKS];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const int row = row0 + 8 * (n0 + j) + g;
#pragma unroll
      for (int s = 0; s < C::kKS / F::kKVec; ++s)
        lds_words<F::kKVec>(&kw[j][s * F::kKVec],
                            ring + F::k_at(row, 4 * F::k_word(s * F::kKVec, t)));
    }
#pragma unroll
    for (int kk = 0; kk < C::kKS; ++kk) {
      uint32_t a[4];
      load_a(0, kk, a);
#pragma unroll
      for (int j = 0; j < kGroup; ++j)
        MmaT::run(acc_s[0][n0 + j], a, e4m3x2_to<Elem>(kw[j][kk]),
                  e4m3x2_to<Elem>(kw[j][kk] >> 16));
    }
  }
}

// O += P V over an FP8 ring slot (fp16 MMA; O's columns in Fp8Kv::v_byte order).
template <class C>
__device__ __forceinline__ void dec_pv_fp8(float (&acc_o)[1][C::kDT][4],
                                           const float (&p)[1][C::kNT][4], const uint8_t* ring,
                                           int row0, int g, int t) {
  using F = Fp8Kv<C>;
  using MmaH = Mma<__half>;
#pragma unroll
  for (int ks = 0; ks < C::kNT / 2; ++ks) {
    uint32_t a[4];
    a[0] = MmaH::pack(p[0][2 * ks][0], p[0][2 * ks][1]);
    a[1] = MmaH::pack(p[0][2 * ks][2], p[0][2 * ks][3]);
    a[2] = MmaH::pack(p[0][2 * ks + 1][0], p[0][2 * ks + 1][1]);
    a[3] = MmaH::pack(p[0][2 * ks + 1][2], p[0][2 * ks + 1][3]);
    uint32_t vw[4][F::kVWords];  // key rows 2t, 2t + 1, 2t + 8, 2t + 9 of the k16 step
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int row = row0 + 16 * ks + 2 * t + (q & 1) + 8 * (q >> 1);
#pragma unroll
      for (int s = 0; s < C::kDT / F::kVVec; ++s) {
        const uint8_t* src = ring + F::v_at(row, F::v_byte(s * F::kVVec, g));
        if constexpr (F::kVVec >= 4) {
          lds_words<F::kVVec / 4>(&vw[q][s * F::kVVec / 4], src);
        } else {  // two bytes: a half of word dt / 4
          const uint32_t h = *reinterpret_cast<const uint16_t*>(src);
          const int dt = 2 * s;
          vw[q][dt / 4] = dt % 4 == 0 ? h : (vw[q][dt / 4] | (h << 16));
        }
      }
    }
#pragma unroll
    for (int dq = 0; dq < C::kDT / 2; ++dq) {  // n8 tiles 2 dq and 2 dq + 1
      const int w = dq / 2;
      const uint32_t sel = (dq & 1) ? 0x7362u : 0x5140u;  // (row 2t, row 2t + 1) byte pairs
      const uint32_t lo = __byte_perm(vw[0][w], vw[1][w], sel);
      const uint32_t hi = __byte_perm(vw[2][w], vw[3][w], sel);
      MmaH::run(acc_o[0][2 * dq], a, e4m3x2_to<__half>(lo), e4m3x2_to<__half>(hi));
      MmaH::run(acc_o[0][2 * dq + 1], a, e4m3x2_to<__half>(lo >> 16),
                e4m3x2_to<__half>(hi >> 16));
    }
  }
}

// The FP8 cache's descale of (b, hk), or 1 (other kernels read none).
template <class C>
__device__ __forceinline__ float dec_descale(const float* d, int64_t b, int64_t hk, int64_t bs,
                                             int64_t hs) {
  if constexpr (C::kKvFp8) {
    return __ldg(d + b * bs + hk * hs);
  } else {
    return 1.f;
  }
}

// The swizzled 16-bit slot's layout (DecConfig::kSwizzle): chunk c of row r sits at chunk
// c ^ (r % 8) of the row. The loads place chunks by it, and the MMA readers take a lane's
// chunk from it: XOR is linear, so chunk(r, c ^ x) = chunk(r, c) ^ x lets a reader add the
// k16 step's chunk offset x to the lane's chunk with one XOR.
struct DecSlotSwizzle {
  __host__ __device__ static constexpr int chunk(int r, int c) { return c ^ (r & 7); }
};

// A lane's ldmatrix start in a 16-bit K/V slot, for its row r and column c of the warp's
// 16 x 16 block: the padded layout's linear address (chunk 0), or the swizzled layout's row
// start and the lane's chunk (DecSlotSwizzle). FP8 kernels read the e4m3 ring (Fp8Kv): none.
struct DecSlotLane {
  uint32_t addr, chunk;
};
template <class C>
__device__ __forceinline__ DecSlotLane dec_slot_lane(const typename C::Elem* slot, int r, int c) {
  constexpr uint32_t kBytes = sizeof(typename C::Elem);
  if constexpr (C::kKvFp8) {
    return {0u, 0u};
  } else if constexpr (C::kSwizzle) {
    return {smem_addr(slot) + r * C::kStride * kBytes,
            static_cast<uint32_t>(DecSlotSwizzle::chunk(r, c >> 3))};
  } else {
    return {smem_addr(slot) + (r * C::kStride + c) * kBytes, 0u};
  }
}

// Rows of kRowElems elements (unpadded) in 16-byte chunks, chunk c of row r placed at chunk
// swz(r, c) of the row: the swizzled 16-bit slot (DecSlotSwizzle) and the FP8 ring (Fp8Kv).
// load_rows_async's chunk walk (tile_io.cuh), swizzled destinations.
template <class C, int kRowElems, typename T, class RowPtr, class IoT, class Swz>
__device__ __forceinline__ void dec_load_rows_swizzled(T* smem, RowPtr&& row_ptr,
                                                       const T* fallback, IoT& io, int tensor,
                                                       Swz&& swz) {
  constexpr int kPerChunk = 16 / static_cast<int>(sizeof(T));
  constexpr int kChunksPerRow = kRowElems / kPerChunk;
  constexpr int kChunks = C::kBlockN * kChunksPerRow;
  static_assert(kChunks % C::kThreads == 0, "whole rows per pass");
#pragma unroll
  for (int it = 0; it < kChunks / C::kThreads; ++it) {
    const int c = it * C::kThreads + threadIdx.x;
    const int row = c / kChunksPerRow, chunk = c % kChunksPerRow;
    const T* src = row_ptr(row);
    const bool valid = src != nullptr;
    cp_async_16(smem + row * kRowElems + swz(row, chunk) * kPerChunk,
                valid ? src + chunk * kPerChunk : fallback, valid);
    io.add(tensor, valid ? 16 : 0);
  }
}

// warp_qk / warp_pv (warp_mma.cuh) over a swizzled slot: the same m16n8k16 steps, with each
// ldmatrix column chunk XOR-ed by the lane's `chunk` bits instead of added to a linear
// offset. (warp_mma.cuh takes linear offsets; an address policy there would serve both, but
// it renames the mma.sync forward and backward kernels, which share the padded layout.)
template <class C, class LoadA>
__device__ __forceinline__ void dec_qk_swizzled(float (&acc_s)[1][C::kNT][4], LoadA&& load_a,
                                                uint32_t k_row, uint32_t chunk) {
  using MmaT = Mma<typename C::Elem>;
  constexpr uint32_t kRowBytes = C::kStride * sizeof(typename C::Elem);
#pragma unroll
  for (int kk = 0; kk < C::kKS; ++kk) {
    uint32_t a[4];
    load_a(0, kk, a);
    const uint32_t col = ((2u * kk) ^ chunk) << 4;
#pragma unroll
    for (int np = 0; np < C::kNT / 2; ++np) {
      uint32_t bk[4];
      ldmatrix_x4(bk, k_row + np * 16 * kRowBytes + col);
      MmaT::run(acc_s[0][2 * np], a, bk[0], bk[1]);
      MmaT::run(acc_s[0][2 * np + 1], a, bk[2], bk[3]);
    }
  }
}

template <class C>
__device__ __forceinline__ void dec_pv_swizzled(float (&acc_o)[1][C::kDT][4],
                                                const float (&p)[1][C::kNT][4], uint32_t v_row,
                                                uint32_t chunk) {
  using MmaT = Mma<typename C::Elem>;
  constexpr uint32_t kRowBytes = C::kStride * sizeof(typename C::Elem);
#pragma unroll
  for (int ks = 0; ks < C::kNT / 2; ++ks) {
    uint32_t a[4];
    a[0] = MmaT::pack(p[0][2 * ks][0], p[0][2 * ks][1]);
    a[1] = MmaT::pack(p[0][2 * ks][2], p[0][2 * ks][3]);
    a[2] = MmaT::pack(p[0][2 * ks + 1][0], p[0][2 * ks + 1][1]);
    a[3] = MmaT::pack(p[0][2 * ks + 1][2], p[0][2 * ks + 1][3]);
#pragma unroll
    for (int dp = 0; dp < C::kDT / 2; ++dp) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, v_row + ks * 16 * kRowBytes + (((2u * dp) ^ chunk) << 4));
      MmaT::run(acc_o[0][2 * dp], a, bv[0], bv[1]);
      MmaT::run(acc_o[0][2 * dp + 1], a, bv[2], bv[3]);
    }
  }
}

template <class C>
__device__ __forceinline__ void decode_kernel_body(const fg_decode_params& p) {
  using Elem = typename C::Elem;
  using MmaT = Mma<Elem>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Elem* sQ = reinterpret_cast<Elem*>(smem_raw);
  using KvT = typename C::KvT;
  // the K and V rings the loads fill, `stages` tiles each: 16-bit slots ldmatrix reads, or
  // (FP8) e4m3 bytes read into registers
  KvT* rK = reinterpret_cast<KvT*>(sQ + C::kBlockM * C::kQStride);
  KvT* rV = rK + C::kStages * C::kBlockN * C::kRingStride;
  Elem* sK = reinterpret_cast<Elem*>(rK);
  Elem* sV = reinterpret_cast<Elem*>(rV);
  __shared__ uint64_t full[C::kStages];  // bulk loads: K/V tile of each slot landed

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
  decode_allow_dependents();  // the combine may be scheduled now; it waits for our parts

  // The sequence's length, clamped to the cache (and flagged) when the caller's is impossible.
  const int64_t capacity = C::kPaged ? p.max_pages * p.page_size : p.seqlen_k;
  int64_t sk = load_index(p.cache_seqlens + b, io, DecIo::kSeqlens, tid == 0);
  if (sk < 0 || sk > capacity) {
    if (tid == 0)
      decode_bad_input(err, FG_DECODE_ERR_SEQLEN, p.trap_on_error,
                       "cache_seqlens[b] <= capacity (block_table columns * page_size, or "
                       "the contiguous cache's rows), and >= 0");
    sk = sk < 0 ? 0 : capacity;
  }

  const int64_t m0 = mt * C::kBlockM;
  const int64_t valid_rows = min(static_cast<int64_t>(C::kBlockM), rows - m0);
  const int64_t q_lo = m0 / group, q_hi = (m0 + valid_rows - 1) / group;  // queries of the CTA
  const MaskPolicy<C::kCausal, C::kWindow> mask(p.seqlen_q, sk, p.window_left, p.window_right);
  int64_t n_lo, n_hi;
  mask.tile_range(q_lo, q_hi, C::kBlockN, n_lo, n_hi);
  const int64_t per = ((n_hi > n_lo ? n_hi - n_lo : 0) + splits - 1) / splits;
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
  const KvT* k_base = static_cast<const KvT*>(p.k) + hk * p.k_head_stride +
                      (C::kPaged ? 0 : b * p.k_batch_stride);
  const KvT* v_base = static_cast<const KvT*>(p.v) + hk * p.v_head_stride +
                      (C::kPaged ? 0 : b * p.v_batch_stride);
  const int page_shift = C::kPaged ? __ffsll(p.page_size) - 1 : 0;
  const int32_t* bt = C::kPaged ? p.block_table + b * p.block_table_stride : nullptr;
  // Paged: the block-table entries of the split's pages [first_page, last_page] (those
  // holding a key below sk) go through windows of 32 pages: lane l of every warp holds the
  // entry of page first_page + 32 win + l in `ids_cur` and the next window's in `ids_nxt`,
  // fetched when `win` is entered, so each entry is read once per CTA, 32 pages (8 tiles at
  // page 16 and block_n 64, 32 or more at page >= block_n) before a load needs it. (Fetched
  // one tile ahead instead, a dependent block-table read stood in front of every tile's
  // loads and one CTA per SM streamed at 0.5-0.7x of a contiguous cache.) A tile's pages never
  // straddle two windows: first_page is a multiple of the tile's pages (block_n / page_size,
  // a power of two <= 32) when that is above 1.
  const int64_t first_page = n_iter > 0 ? (sched.tile(0, io, false) * C::kBlockN) >> page_shift : 0;
  const int64_t last_key =
      n_iter > 0 ? min((sched.tile(n_iter - 1, io, false) + 1) * C::kBlockN, sk) - 1 : -1;
  const int64_t last_page = C::kPaged && last_key >= 0 ? last_key >> page_shift : -1;
  auto fetch_window = [&](int64_t w) -> int32_t {
    const int64_t page = first_page + 32 * w + lane;
    if (!C::kPaged || page > last_page) return -1;
    return load_index(bt + page, io, DecIo::kBlockTable, warp == 0);
  };
  int64_t win = 0;
  int32_t ids_cur = -1, ids_nxt = -1;

  auto load_kv = [&](int it) {
    const int slot = it % C::kStages;
    const int64_t key0 = sched.tile(it, io, false) * C::kBlockN;
    int64_t win_page0 = 0;  // the first page of the window holding this tile's pages
    if (C::kPaged) {
      const int64_t w = ((key0 >> page_shift) - first_page) >> 5;
      if (w > win) {  // tiles go in order, at most one window further each
        win = w;
        ids_cur = ids_nxt;
        ids_nxt = fetch_window(w + 1);
      }
      win_page0 = first_page + 32 * win;
    }
    auto rows_of = [&](const KvT* base, int64_t row_stride, int64_t page_stride) {
      return [&, base, row_stride, page_stride](int r) -> const KvT* {
        if (C::kPaged) {
          const int64_t key = key0 + r;
          const int32_t id = __shfl_sync(0xffffffffu, ids_cur,
                                         static_cast<int>((key >> page_shift) - win_page0));
          if (key >= sk) return nullptr;
          if (id < 0 || id >= p.num_pages) {  // never read out of bounds: zero rows, and say so
            decode_bad_input(err, FG_DECODE_ERR_PAGE_ID, p.trap_on_error,
                             "block_table entries of used pages in [0, num_pages)");
            return nullptr;
          }
          return base + id * page_stride + (key & (p.page_size - 1)) * row_stride;
        }
        return key0 + r < sk ? base + (key0 + r) * row_stride : nullptr;
      };
    };
    if constexpr (decode_bulk_loads<C>()) {
      // Thread i copies rows i, i + kThreads, ... of the 2 block_n rows (K's, then V's); each
      // thread arrives on the slot's barrier (count kThreads) announcing its own bytes first,
      // so the phase cannot end before every copy is announced. Rows past sk (or of a bad
      // page) are zeroed by plain stores instead, which the per-tile __syncthreads publishes.
      constexpr uint32_t kRowBytes = C::kHeadDim * sizeof(KvT);
      constexpr int kPerThread = 2 * C::kBlockN / C::kThreads;
      auto k_rows = rows_of(k_base, p.k_row_stride, p.k_batch_stride);
      auto v_rows = rows_of(v_base, p.v_row_stride, p.v_batch_stride);
      const KvT* src[kPerThread];
      KvT* dst[kPerThread];
      uint32_t bytes = 0;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int row = j * C::kThreads + tid;  // uniform per warp: K rows or V rows
        const bool is_k = row < C::kBlockN;
        const int r = is_k ? row : row - C::kBlockN;
        src[j] = is_k ? k_rows(r) : v_rows(r);
        dst[j] = (is_k ? rK : rV) + slot * C::kBlockN * C::kRingStride + r * C::kRingStride;
        bytes += src[j] ? kRowBytes : 0;
      }
      sm90::mbar_arrive_expect_tx(&full[slot], bytes);
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const bool is_k = j * C::kThreads + tid < C::kBlockN;
        if (src[j]) {
          bulk_load_row(dst[j], src[j], kRowBytes, &full[slot]);
          if (is_k)  // (a constant counter index each: a computed one puts the counters on the stack)
            io.add(DecIo::kK, kRowBytes);
          else
            io.add(DecIo::kV, kRowBytes);
        } else {
#pragma unroll
          for (int c = 0; c < C::kHeadDim; c += 16 / static_cast<int>(sizeof(KvT)))
            *reinterpret_cast<uint4*>(dst[j] + c) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    } else if constexpr (C::kKvFp8) {  // e4m3 rows, 16-byte chunks in Fp8Kv's swizzles
      using F = Fp8Kv<C>;
      dec_load_rows_swizzled<C, C::kHeadDim>(
          rK + slot * C::kBlockN * C::kRingStride, rows_of(k_base, p.k_row_stride, p.k_batch_stride),
          k_base, io, DecIo::kK, [](int r, int c) { return F::k_chunk(r, c); });
      dec_load_rows_swizzled<C, C::kHeadDim>(
          rV + slot * C::kBlockN * C::kRingStride, rows_of(v_base, p.v_row_stride, p.v_batch_stride),
          v_base, io, DecIo::kV, [](int r, int c) { return F::v_chunk(r, c); });
    } else if constexpr (C::kSwizzle) {
      auto swz = [](int r, int c) { return DecSlotSwizzle::chunk(r, c); };
      dec_load_rows_swizzled<C, C::kHeadDim>(sK + slot * C::kBlockN * C::kStride,
                                             rows_of(k_base, p.k_row_stride, p.k_batch_stride),
                                             k_base, io, DecIo::kK, swz);
      dec_load_rows_swizzled<C, C::kHeadDim>(sV + slot * C::kBlockN * C::kStride,
                                             rows_of(v_base, p.v_row_stride, p.v_batch_stride),
                                             v_base, io, DecIo::kV, swz);
    } else {
      load_rows_async<C::kBlockN, C::kHeadDimPad, C::kThreads, C::kStride, C::kHeadDim>(
          sK + slot * C::kBlockN * C::kStride, rows_of(k_base, p.k_row_stride, p.k_batch_stride),
          k_base, io, DecIo::kK);
      load_rows_async<C::kBlockN, C::kHeadDimPad, C::kThreads, C::kStride, C::kHeadDim>(
          sV + slot * C::kBlockN * C::kStride, rows_of(v_base, p.v_row_stride, p.v_batch_stride),
          v_base, io, DecIo::kV);
    }
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
      smem_addr(sQ) + ((warp_row0 + lo.a_row) * C::kQStride + lo.a_col) * kElemBytes;
  // the lane's K (B operand) and V (trans) ldmatrix starts in slot 0
  const DecSlotLane k_lane = dec_slot_lane<C>(sK, wn * C::kWarpKeys + lo.b_row, lo.b_col);
  const DecSlotLane v_lane = dec_slot_lane<C>(sV, wn * C::kWarpKeys + lo.a_row, lo.a_col);
  // The score stage of the thread's two rows (score_mod.cuh), each of its own head; a row's
  // slope read is counted once (t == 0 of the first key warp) when the row is valid.
  using Mod = ScoreModOf<C, false>;  // the sink joins where the row's LSE is formed, below
  // FP8 caches: S = (q . K8) * k_descale, so k_descale joins the softmax scale; v_descale
  // multiplies O where it is normalised (1 and the plain scale for other kernels)
  const double qk_scale =
      C::kKvFp8 ? p.softmax_scale * dec_descale<C>(p.k_descale, b, hk, p.k_descale_batch_stride,
                                                   p.k_descale_head_stride)
                : p.softmax_scale;
  [[maybe_unused]] const float v_scale =
      dec_descale<C>(p.v_descale, b, hk, p.v_descale_batch_stride, p.v_descale_head_stride);
  if (C::kKvFp8 && tid == 0) io.add(DecIo::kMeta, 8);  // the two descales, once per CTA
  auto row_mod = [&](int r) {
    const int fr = warp_row0 + g + 8 * r;
    const int64_t gr = m0 + fr, i = gr / group;
    return Mod(p.score, qk_scale, b, hk * group + (gr - i * group), io,
               t == 0 && wn == 0 && fr < valid_rows, DecIo::kMeta);
  };
  const Mod mods[2] = {row_mod(0), row_mod(1)};
  const float scale_log2 = mods[0].scale_log2;

  if (n_iter > 0) {
    if constexpr (decode_bulk_loads<C>()) {
      if (tid == 0) {
#pragma unroll
        for (int s = 0; s < C::kStages; ++s) sm90::mbar_init(&full[s], C::kThreads);
        sm90::mbar_init_fence();
      }
      if constexpr (C::kPadded) {  // the bulk copies write d columns: the padding is zeroed
        for (int r = tid; r < 2 * C::kStages * C::kBlockN; r += C::kThreads)  // once (sK, sV)
#pragma unroll
          for (int c = C::kHeadDim; c < C::kHeadDimPad; c += 8)
            *reinterpret_cast<uint4*>(sK + r * C::kStride + c) = make_uint4(0u, 0u, 0u, 0u);
      }
      __syncthreads();
    }
    load_rows_async<C::kBlockM, C::kHeadDimPad, C::kThreads, C::kQStride, C::kHeadDim>(
        sQ, q_row, q_base, io, DecIo::kQ);
    cp_async_commit();
    if (C::kPaged) {
      ids_cur = fetch_window(0);
      ids_nxt = fetch_window(1);
    }
#pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
      if (s < n_iter) load_kv(s);
      cp_async_commit();
    }
    cp_async_wait<C::kStages - 1>();  // the Q group
    __syncthreads();
    if constexpr (C::kKvFp8) dec_permute_q_fp8<C>(sQ);

    uint32_t qf[C::kQInRegs ? C::kKS : 1][4];
    if (C::kQInRegs) {
#pragma unroll
      for (int kk = 0; kk < C::kKS; ++kk)
        ldmatrix_x4(qf[C::kQInRegs ? kk : 0], q_lane + kk * 16 * kElemBytes);
    }

    for (int it = 0; it < n_iter; ++it) {
      // One barrier per tile (as the forward): tile `it` has landed and every warp is done
      // with tile it - 1, whose slot now takes tile it + kStages - 1.
      if constexpr (decode_bulk_loads<C>()) {
        sm90::mbar_wait(&full[it % C::kStages], (it / C::kStages) & 1);
      } else {
        cp_async_wait<C::kStages - 2>();
      }
      __syncthreads();
      const int next = it + C::kStages - 1;
      if (next < n_iter) load_kv(next);
      cp_async_commit();

      const int slot = it % C::kStages;
      // FP8: the slot's e4m3 bytes (unused otherwise)
      const uint8_t* k8 = reinterpret_cast<const uint8_t*>(rK + slot * C::kBlockN * C::kRingStride);
      const uint8_t* v8 = reinterpret_cast<const uint8_t*>(rV + slot * C::kBlockN * C::kRingStride);
      const int64_t n = sched.tile(it, io, false);
      float acc_s[1][C::kNT][4];
#pragma unroll
      for (int nt = 0; nt < C::kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = 0.f;
      auto load_q = [&](int, int kk, uint32_t (&a)[4]) {
        if (C::kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = qf[C::kQInRegs ? kk : 0][e];
        } else {
          ldmatrix_x4(a, q_lane + kk * 16 * kElemBytes);
        }
      };
      if constexpr (C::kKvFp8)
        dec_qk_fp8<C>(acc_s, load_q, k8, wn * C::kWarpKeys, g, t);
      else if constexpr (C::kSwizzle)
        dec_qk_swizzled<C>(acc_s, load_q, k_lane.addr + slot * kSlotBytes, k_lane.chunk);
      else
        warp_qk<Elem, 1, C::kNT, C::kKS, C::kStride>(acc_s, load_q,
                                                     k_lane.addr + slot * kSlotBytes);
      {
        const int64_t j0 = n * C::kBlockN + wn * C::kWarpKeys;
        const TileAt at[2] = {tile_at(q_row_g, j0, mask), tile_at(q_row_g8, j0, mask)};
        score_frag_rows(acc_s, mods, at, lane);
      }
      if (mask.tile_needs_mask(q_lo, q_hi, n, C::kBlockN))
        mask_frag_rows(acc_s, mask.tile(0, n * C::kBlockN + wn * C::kWarpKeys), lane,
                       [&](int r) { return r >= 8 ? q_row_g8 : q_row_g; });
      float alpha[2];
      online_softmax_update(st, acc_s[0], scale_log2, alpha);
      scale_rows(acc_o[0], alpha);
      if constexpr (C::kKvFp8)
        dec_pv_fp8<C>(acc_o, acc_s, v8, wn * C::kWarpKeys, g, t);
      else if constexpr (C::kSwizzle)
        dec_pv_swizzled<C>(acc_o, acc_s, v_lane.addr + slot * kSlotBytes, v_lane.chunk);
      else
        warp_pv<Elem, 1, C::kNT, C::kDT, C::kStride>(acc_o, acc_s,
                                                     v_lane.addr + slot * kSlotBytes);
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
    for (int dt = 0; dt < C::kDT; ++dt) {
      if constexpr (C::kKvFp8) {  // O's columns back in head-dim order (Fp8Kv::v_byte)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          sO[row * C::kMergeStride + Fp8Kv<C>::v_byte(dt, 2 * t + e)] = acc_o[0][dt][2 * r + e];
      } else {
        *reinterpret_cast<float2*>(sO + row * C::kMergeStride + dt * 8 + 2 * t) =
            make_float2(acc_o[0][dt][2 * r], acc_o[0][dt][2 * r + 1]);
      }
    }
  }
  __syncthreads();

  for (int c = tid; c < C::kBlockM * C::kDT; c += C::kThreads) {
    const int row = c / C::kDT, col = (c % C::kDT) * 8;
    if (row >= valid_rows || (C::kPadded && col >= C::kHeadDim)) continue;  // padded columns
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
    const int64_t gr = m0 + row, i = gr / group, h = hk * group + (gr - i * group);
    float inv_l, lse;
    if (splits == 1) {  // the row's LSE is formed here: its head's sink joins (score_mod.cuh)
      const ScoreMod<false, false, C::kSink> fin(p.score, p.softmax_scale, b, h, io, col == 0,
                                                 DecIo::kMeta);
      fin.finalize_ml(mx, l, inv_l, lse);
    } else {  // the combine adds the sink
      ScoreMod<false, false, false>::finalize_ml_plain(mx, l, inv_l, lse);
    }
    if constexpr (C::kKvFp8) inv_l *= v_scale;  // O of v_descale * V
    if (splits == 1) {
      const uint4 packed = make_uint4(
          MmaT::pack(o[0] * inv_l, o[1] * inv_l), MmaT::pack(o[2] * inv_l, o[3] * inv_l),
          MmaT::pack(o[4] * inv_l, o[5] * inv_l), MmaT::pack(o[6] * inv_l, o[7] * inv_l));
      store_16(static_cast<Elem*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride +
                   h * p.o_head_stride + col,
               packed, io, DecIo::kO);
      if (col == 0 && p.lse)
        store_f32(p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + i, lse, io,
                  DecIo::kLse);
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
// -inf. kCombineRowThreads threads share a row, 8 columns each. The parts go in blocks of
// 8 * kCombineRowThreads: each thread first reads 8 of the block's LSEs (independent loads),
// the row's threads agree on the block's max by shuffles, then every thread walks the block's
// parts 8 at a time, issuing the 8 parts' loads before using any of them. (The first version
// walked the parts one at a time behind a data-dependent branch: one L2 round trip per part,
// 10-19 us for 32 parts at batch 1 on the H200, longer than the split kernel itself.)
template <class C, typename PartT>
__device__ __forceinline__ void decode_combine_body(const fg_decode_params& p) {
  decode_wait_for_parts();
  using Elem = typename C::Elem;
  using MmaT = Mma<Elem>;
  constexpr int kTpr = C::kCombineRowThreads;
  constexpr int kBlock = 8 * kTpr;  // parts per block: 8 LSEs per thread
  constexpr int kSub = kTpr < 8 ? kTpr : 8;  // parts whose loads go out together
  Io<C::kInstrumentIo, DecIo> io;
  const int tid = threadIdx.x, t = tid % kTpr, col = t * 8;
  const bool col_ok = col < C::kHeadDim;  // a thread past the row's columns only shuffles
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
  for (int64_t c0 = 0; c0 < p.num_parts; c0 += kBlock) {
    // this thread holds the LSEs of the block's parts c0 + k kTpr + t, k = 0..7
    float lse_r[8];
    float bmax = -INFINITY;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t s = c0 + k * kTpr + t;
      lse_r[k] = active && s < p.num_parts
                     ? load_f32(lse_row + s * p.lse_parts_part_stride, io, DecIo::kLseParts)
                     : -INFINITY;
      bmax = fmaxf(bmax, lse_r[k]);
    }
#pragma unroll
    for (int off = kTpr / 2; off > 0; off >>= 1)
      bmax = fmaxf(bmax, __shfl_xor_sync(0xffffffffu, bmax, off, kTpr));
    const float m_new = fmaxf(m, bmax);
    base = m_new == -INFINITY ? 0.f : m_new;
    const float r = expf(m - base);  // 0 while nothing was seen (m = -inf)
    l *= r;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= r;
    const int64_t jn = min(static_cast<int64_t>(kBlock), p.num_parts - c0);
    // Parts j = k kTpr + q kSub + u; only u is unrolled: kSub parts' loads in flight at a time
    // (hoisting every part's loads took 255 registers and spilled). lse_r shifts down after
    // each k, so lse_r[0] is always k's (no register indexed at run time, no stack).
#pragma unroll 1
    for (int k = 0; k < 8; ++k) {
      if (k * kTpr >= jn) break;  // uniform: every thread of the grid has the same jn
#pragma unroll 1
      for (int q = 0; q < kTpr / kSub; ++q) {
        const int j0 = k * kTpr + q * kSub;
        if (j0 >= jn) break;
        float w[kSub], v[kSub][8];
#pragma unroll
        for (int u = 0; u < kSub; ++u) {
          const float lse_j = __shfl_sync(0xffffffffu, lse_r[0], q * kSub + u, kTpr);
          // an empty part (or a NaN, or one past num_parts) contributes nothing, unread
          const bool use = active && j0 + u < jn && lse_j > -INFINITY;
          w[u] = use ? expf(lse_j - base) : 0.f;
          if (use && col_ok) {
            load_part8(o_row + (c0 + j0 + u) * p.o_parts_part_stride, v[u], io);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[u][e] = 0.f;
          }
        }
#pragma unroll
        for (int u = 0; u < kSub; ++u) {
          l += w[u];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += w[u] * v[u][e];
        }
      }
#pragma unroll
      for (int x = 0; x < 7; ++x) lse_r[x] = lse_r[x + 1];
    }
    m = m_new;
  }
  if constexpr (C::kSink) {  // the sink of the row's head joins (a merge_states call without
    if (active && p.score.sinks) {  // sinks gives none)
      const float sink = __ldg(p.score.sinks + h);
      if (t == 0) io.add(DecIo::kMeta, 4);
      const float mf = fmaxf(l > 0.f ? base : -INFINITY, sink);
      const float nb = mf == -INFINITY ? 0.f : mf;
      const float r = l > 0.f ? expf(base - nb) : 0.f;
      l = l * r + expf(sink - nb);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= r;
      base = nb;
    }
  }
  if (active) {
    const bool empty = !(l > 0.f);
    const float inv_l = empty ? 0.f : 1.f / l;
    const uint4 packed = make_uint4(
        MmaT::pack(acc[0] * inv_l, acc[1] * inv_l), MmaT::pack(acc[2] * inv_l, acc[3] * inv_l),
        MmaT::pack(acc[4] * inv_l, acc[5] * inv_l), MmaT::pack(acc[6] * inv_l, acc[7] * inv_l));
    if (col_ok)
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
