// flashgen: the score stage. Functors that turn the raw Q K^T accumulators into the logits
// the online softmax sees, and add terms to its denominator; every family calls this stage
// and no kernel body names a modifier (docs/design.md, "The score stage").
//
// Glossary
//   x        the raw dot product q_i . k_j, as the S accumulator holds it
//   z        the logit the softmax is taken over, natural-log units:
//              z = scale * x                     (plain)
//              z = c * tanh(scale * x / c)       (softcap, c = softcap)
//              z -= slope_h * |dist|             (ALiBi)
//   y        what the stage leaves in the accumulator: z / units. The softmax multiplies by
//            `scale_log2` = units * log2 e (the plain kernels' arithmetic), so it sees
//            z * log2 e. units = scale, except with softcap (units = 1)
//   dist     j - (i + shift): signed distance from the mask's diagonal (shift = Sk - Sq for
//            bottom_right and no causal mask, 0 for top_left), as flash-attn's ALiBi defines it
//   g        dz/dx / scale: the factor the backward applies to dS (1 - tanh^2 with softcap)
//   sink     a per-head logit (natural-log units of z) that joins the softmax denominator only
//
// Why tanh.approx: one MUFU instruction per score, beside the softmax's ex2 (FlashAttention-3
// uses it too); its relative error (2^-11) is below the 16-bit rounding of the capped logit
// that standard attention in the kernel's precision makes (docs/verification.md).
#pragma once

#include <math.h>
#include <stdint.h>

#include "score_params.h"
#include "softmax.cuh"

namespace fg {

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <bool kSoftcap, bool kAlibi, bool kSink>
struct ScoreMod {
  static constexpr bool kTransforms = kSoftcap || kAlibi;  // the accumulators change
  static constexpr bool kHasGrad = kSoftcap;               // the backward needs g
  static constexpr bool kHasSink = kSink;

  float scale_log2;      // the softmax's multiplier: units * log2 e
  float pre = 0.f;       // softcap: scale / c
  float cap = 0.f;       // softcap: c
  float slope = 0.f;     // ALiBi: slope of (b, h) / units
  float sink_log2 = 0.f; // sink of h, times log2 e

  // The stage of one (batch b, head h). Thread `count` counts the parameter reads (4 bytes
  // per slope or sink) under counter `key`.
  template <class IoT>
  __device__ __forceinline__ ScoreMod(const fg_score_params& sp, double softmax_scale, int64_t b,
                                      int64_t h, IoT& io, bool count, int key) {
    if constexpr (kSoftcap) {
      scale_log2 = 1.4426950408889634f;
      pre = static_cast<float>(softmax_scale / sp.softcap);
      cap = static_cast<float>(sp.softcap);
    } else {
      scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
    }
    if constexpr (kAlibi) {
      const float s = __ldg(sp.alibi_slopes + b * sp.alibi_batch_stride + h);
      slope = kSoftcap ? s : static_cast<float>(s / softmax_scale);
      if (count) io.add(key, 4);
    }
    if constexpr (kSink) {
      sink_log2 = __ldg(sp.sinks + h) * 1.4426950408889634f;
      if (count) io.add(key, 4);
    }
  }

  // y of one score.
  __device__ __forceinline__ float logit(float x, int dist) const {
    float y = x;
    if constexpr (kSoftcap) y = cap * tanh_approx(x * pre);
    if constexpr (kAlibi) y = fmaf(-slope, fabsf(static_cast<float>(dist)), y);
    return y;
  }
  // y and g of one score (the backward).
  __device__ __forceinline__ float logit(float x, int dist, float& g) const {
    float y = x;
    g = 1.f;
    if constexpr (kSoftcap) {
      const float th = tanh_approx(x * pre);
      y = cap * th;
      g = fmaf(-th, th, 1.f);
    }
    if constexpr (kAlibi) y = fmaf(-slope, fabsf(static_cast<float>(dist)), y);
    return y;
  }

  // (1 / l, natural-log LSE) of a row from its softmax state; with a sink, the sink's term
  // joins l (a row that saw no key then gives O = 0 and LSE = sink).
  __device__ __forceinline__ void finalize(const RowState& st, float& inv_l, float& lse) const {
    if constexpr (!kSink) {
      online_softmax_finalize(st, inv_l, lse);
    } else {
      finalize_ml(st.m, quad_sum(st.l), inv_l, lse);
    }
  }
  // The same from a row's max m (log2 units) and its complete sum l.
  __device__ __forceinline__ void finalize_ml(float m, float l, float& inv_l, float& lse) const {
    if constexpr (kSink) {
      const float mf = fmaxf(m, sink_log2);
      const float base = mf == -INFINITY ? 0.f : mf;  // the -inf guard (a -inf sink, no key)
      const float r = exp2_approx(m - base);           // 0 when no key was seen
      l = l * r + exp2_approx(sink_log2 - base);
      const bool empty = !(l > 0.f);
      inv_l = empty ? 0.f : r / l;
      lse = empty ? -INFINITY : (base + log2f(l)) * 0.69314718055994530942f;
    } else {
      finalize_ml_plain(m, l, inv_l, lse);
    }
  }
  // Without a sink (a row that saw no key gives (0, -inf)).
  static __device__ __forceinline__ void finalize_ml_plain(float m, float l, float& inv_l,
                                                           float& lse) {
    const bool empty = !(l > 0.f);
    inv_l = empty ? 0.f : 1.f / l;
    lse = empty ? -INFINITY : (m + log2f(l)) * 0.69314718055994530942f;
  }
};

// The stage a kernel of spec C runs; kWithSink = false where the sink is not read (the
// backward's main kernel: the forward's LSE already holds it).
template <class C, bool kWithSink = C::kSink>
using ScoreModOf = ScoreMod<C::kSoftcap, C::kAlibi, kWithSink>;

// The signed diagonal distance of a tile's corner element (i0, j0): element (il, jl) of the
// tile lies at dist0 + jl - il.
__device__ __forceinline__ int tile_dist0(int64_t i0, int64_t j0, int64_t shift) {
  return static_cast<int>(j0 - i0 - shift);
}

// The stage on one warp's m16n8 fragments (frag.cuh's coordinates; corner distance dist0).
template <class Mod, int kMT, int kNT>
__device__ __forceinline__ void score_frag(float (&acc)[kMT][kNT][4], const Mod& mod, int dist0,
                                           int lane) {
  if constexpr (Mod::kTransforms) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int il = mt * 16 + g + (e >> 1) * 8, jl = nt * 8 + 2 * t + (e & 1);
          acc[mt][nt][e] = mod.logit(acc[mt][nt][e], dist0 + jl - il);
        }
  }
}

// The backward's: y in place and g per element (g is unused, and may be [1][1][4], when
// the stage has no derivative).
template <class Mod, int kMT, int kNT, int kGM, int kGN>
__device__ __forceinline__ void score_frag(float (&acc)[kMT][kNT][4], const Mod& mod, int dist0,
                                           int lane, float (&grad)[kGM][kGN][4]) {
  if constexpr (Mod::kHasGrad) {
    static_assert(kGM == kMT && kGN == kNT, "grad has the fragments' shape");
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int il = mt * 16 + g + (e >> 1) * 8, jl = nt * 8 + 2 * t + (e & 1);
          acc[mt][nt][e] = mod.logit(acc[mt][nt][e], dist0 + jl - il, grad[mt][nt][e]);
        }
  } else {
    score_frag(acc, mod, dist0, lane);
  }
}

// Fragments whose two rows per thread (g and g + 8 of one m16 tile) belong to different
// heads (decode packs a GQA group's query heads into the rows): one stage and one corner
// distance per row.
template <class Mod, int kNT>
__device__ __forceinline__ void score_frag_rows(float (&acc)[1][kNT][4], const Mod (&mods)[2],
                                                const int (&dist0)[2], int lane) {
  if constexpr (Mod::kTransforms) {
    const int t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[0][nt][e] = mods[e >> 1].logit(acc[0][nt][e], dist0[e >> 1] + nt * 8 + 2 * t + (e & 1));
  }
}

// The launch check of the score parameters: a feature the kernel was generated with needs
// its field, and a field of a feature it was not generated with is refused (nothing would
// read it). `backward` kernels also write dsinks.
template <class C>
inline const char* check_score_params(const fg_score_params& s, bool backward) {
  if (C::kSoftcap) {
    if (!(s.softcap > 0.0) || !isfinite(s.softcap)) return "softcap must be finite and > 0";
  } else if (s.softcap != 0.0) {
    return "softcap is set but the kernel was generated with softcap: false";
  }
  if (C::kAlibi) {
    if (!s.alibi_slopes) return "alibi_slopes must be non-null (spec has alibi: true)";
    if (reinterpret_cast<uintptr_t>(s.alibi_slopes) % 4 != 0)
      return "alibi_slopes must be 4-byte aligned";
    if (s.alibi_batch_stride < 0) return "alibi_batch_stride must be >= 0";
  } else if (s.alibi_slopes) {
    return "alibi_slopes is set but the kernel was generated with alibi: false";
  }
  if (C::kSink) {
    if (!s.sinks) return "sinks must be non-null (spec has sink: true)";
    if (reinterpret_cast<uintptr_t>(s.sinks) % 4 != 0) return "sinks must be 4-byte aligned";
    if (backward && !s.dsinks) return "dsinks must be non-null (spec has sink: true)";
    if (backward && reinterpret_cast<uintptr_t>(s.dsinks) % 4 != 0)
      return "dsinks must be 4-byte aligned";
  } else if (s.sinks || s.dsinks) {
    return "sinks is set but the kernel was generated with sink: false";
  }
  return nullptr;
}

}  // namespace fg
