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
//              z = score_mod(s = scale * x, ...)  (a spec's score_mod, with units = 1)
//   y        what the stage leaves in the accumulator: z / units. The softmax multiplies by
//            `scale_log2` = units * log2 e (the plain kernels' arithmetic), so it sees
//            z * log2 e. units = scale, except with softcap (units = c: y = tanh(scale x / c),
//            which keeps c out of the registers) and with a score_mod (units = 1: y = z, the
//            user's logit as the expression gives it)
//   dist     j - (i + shift): signed distance from the mask's diagonal (shift = Sk - Sq for
//            bottom_right and no causal mask, 0 for top_left), as flash-attn's ALiBi defines it
//   g        dz/dx / scale: the factor the backward applies to dS (1 - tanh^2 with softcap,
//            d(score_mod)/ds with a score_mod)
//   i, j     a score's query and key positions, 0-based within the sequence (varlen: within
//            the batch's own sequence; decode: i the new query, j the cache row), and sq, sk
//            the sequence's lengths (ScorePos): what a score_mod reads as i, j, seqlen_q,
//            seqlen_k (docs/usermod.md)
//   sink     a per-head logit (natural-log units of z) that joins the softmax denominator only
//
// Why tanh.approx: one MUFU instruction per score, beside the softmax's ex2 (FlashAttention-3
// uses it too); its relative error (2^-11) is below the 16-bit rounding of the capped logit
// that standard attention in the kernel's precision makes (docs/verification.md).
#pragma once

#include <math.h>
#include <stdint.h>

#include "score_check.h"
#include "score_params.h"
#include "softmax.cuh"
#include "usermod_helpers.h"

namespace fg {

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- the modifiers: one functor each. `kOn = false` is an empty functor whose calls compile
// away, so a kernel pays only for the modifiers its spec names. A transform sees the raw
// score x and the value y so far and returns the new y (and multiplies g by its derivative);
// `init` may change the units; `load_head` reads (b, h)'s parameters. A new modifier is one
// functor here, one member and one line of ScoreMod below, and one generator/features row.

// softcap: y = tanh(x * scale / c) in units of c (z = c tanh(scale x / c)); g *= 1 - y^2.
template <bool kOn>
struct Softcap {
  static constexpr bool kTransforms = kOn, kHasGrad = kOn;
  float pre = 0.f;  // scale / c
  __device__ __forceinline__ void init(const fg_score_params& sp, double scale, double& units) {
    if constexpr (kOn) {
      units = sp.softcap;
      pre = static_cast<float>(scale / sp.softcap);
    }
  }
  template <class IoT>
  __device__ __forceinline__ void load_head(const fg_score_params&, int64_t, int64_t, IoT&, bool,
                                            int) {}
  __device__ __forceinline__ float apply(float x, float y, float, float& g) const {
    if constexpr (kOn) {
      y = tanh_approx(x * pre);
      g *= fmaf(-y, y, 1.f);
    }
    return y;
  }
};

// ALiBi: z -= slope_h |dist|, i.e. y -= (slope_h / units) |dist|; no derivative.
template <bool kOn>
struct Alibi {
  static constexpr bool kTransforms = kOn, kHasGrad = false;
  float inv_units = 1.f, slope = 0.f;  // slope of (b, h) / units
  __device__ __forceinline__ void init(const fg_score_params&, double, const double& units) {
    if constexpr (kOn) inv_units = static_cast<float>(1.0 / units);
  }
  template <class IoT>
  __device__ __forceinline__ void load_head(const fg_score_params& sp, int64_t b, int64_t h,
                                            IoT& io, bool count, int key) {
    if constexpr (kOn) {
      slope = __ldg(sp.alibi_slopes + b * sp.alibi_batch_stride + h) * inv_units;
      if (count) io.add(key, 4);
    }
  }
  __device__ __forceinline__ float apply(float, float y, float dist, float&) const {
    if constexpr (kOn) y = fmaf(-slope, fabsf(dist), y);
    return y;
  }
};

// The position of one score (glossary: i, j, sq, sk), what a score_mod reads besides s, b, h.
// int32: positions and lengths are below 2^31 (the masks' tile offsets are int32 already), and
// four 32-bit registers stay live beside the accumulators where four 64-bit pairs spilled (the
// Hopper backward); a score_mod widens them to int64 as it reads them.
// fi, fj and fij are i, j and i - j as floats (exact below 2^24): a per-lane base plus a
// compile-time offset once unrolled, read where a score_mod's float reads an int expression
// linear in i and j (generator/usermod/emit.py, float positions), so that no score pays an
// int-to-float conversion; dead code otherwise.
struct ScorePos {
  int i, j, sq, sk;
  float fi, fj, fij;
};

// A spec's score_mod (generator/usermod): `U` is the Spec's rendered `UserScore` (value, grad,
// the per-(b, h) `Vals` and their `load`; generator/features/user.py), or NoUserScore.
// z = value(s = scale x) is left in the accumulator as y (units = 1); g *= d(value)/ds.
template <class U>
struct User {
  static constexpr bool kTransforms = U::kOn, kHasGrad = U::kHasGrad;
  float scale = 0.f;
  typename U::Vals v{};
  __device__ __forceinline__ void init(const fg_score_params&, double softmax_scale,
                                       double& units) {
    if constexpr (U::kOn) {
      units = 1.0;
      scale = static_cast<float>(softmax_scale);
    }
  }
  template <class IoT>
  __device__ __forceinline__ void load_head(const fg_score_params& sp, int64_t b, int64_t h,
                                            IoT&, bool, int) {
    if constexpr (U::kOn) U::load(sp, b, h, v);
  }
  __device__ __forceinline__ float apply(float x, float y, const ScorePos& q, float& g) const {
    if constexpr (U::kOn) {
      const float s = x * scale;
      if constexpr (U::kHasGrad) g *= U::grad(s, v, q);
      y = U::value(s, v, q);
    }
    return y;
  }
};

// Attention sink: a logit of head h in the denominator only (natural-log units of z).
template <bool kOn>
struct Sink {
  float sink_log2 = 0.f;  // sink_h * log2 e
  template <class IoT>
  __device__ __forceinline__ void load_head(const fg_score_params& sp, int64_t, int64_t h,
                                            IoT& io, bool count, int key) {
    if constexpr (kOn) {
      sink_log2 = __ldg(sp.sinks + h) * 1.4426950408889634f;
      if (count) io.add(key, 4);
    }
  }
  // (1 / l, LSE) from a row's max m (log2 units) and its complete sum l; with the sink, a row
  // that saw no key gives O = 0 and LSE = sink, else (0, -inf).
  __device__ __forceinline__ void finalize_ml(float m, float l, float& inv_l, float& lse) const {
    float r = 1.f;
    if constexpr (kOn) {
      const float mf = fmaxf(m, sink_log2);
      const float base = mf == -INFINITY ? 0.f : mf;  // the -inf guard (a -inf sink, no key)
      r = exp2_approx(m - base);                        // 0 when no key was seen
      l = l * r + exp2_approx(sink_log2 - base);
      m = base;
    }
    const bool empty = !(l > 0.f);
    inv_l = empty ? 0.f : r / l;
    lse = empty ? -INFINITY : (m + log2f(l)) * 0.69314718055994530942f;
  }
};

// ---- the stage: the modifiers a spec names, composed in a fixed order (softcap on the raw
// score, then ALiBi's bias, then the user's score_mod, then the sink in the denominator; a
// spec with a score_mod has neither softcap nor ALiBi, generator/spec.py).
template <bool kSoftcap, bool kAlibi, bool kSink, class U = NoUserScore>
struct ScoreMod {
  static constexpr bool kTransforms =
      Softcap<kSoftcap>::kTransforms || Alibi<kAlibi>::kTransforms || User<U>::kTransforms;
  static constexpr bool kHasGrad =
      Softcap<kSoftcap>::kHasGrad || Alibi<kAlibi>::kHasGrad || User<U>::kHasGrad;
  static constexpr bool kHasSink = kSink;
  // A score_mod: its value and derivative may be inf or NaN where P must be 0 (masked scores,
  // rows past the sequence), where the built-in modifiers stay finite; the backward selects
  // 0 there (kUser) and does not multiply dS by the derivative where P = 0 (kUserGrad).
  static constexpr bool kUser = User<U>::kTransforms, kUserGrad = User<U>::kHasGrad;

  float scale_log2;  // the softmax's multiplier: units * log2 e
  Softcap<kSoftcap> softcap;
  Alibi<kAlibi> alibi;
  User<U> user;
  Sink<kSink> sink;

  // The stage's per-kernel part: the units and the softmax's scale.
  __device__ __forceinline__ ScoreMod(const fg_score_params& sp, double softmax_scale) {
    double units = softmax_scale;
    softcap.init(sp, softmax_scale, units);
    alibi.init(sp, softmax_scale, units);
    user.init(sp, softmax_scale, units);
    scale_log2 = static_cast<float>(units * 1.4426950408889634);
  }
  // ... and of one (batch b, head h). Thread `count` counts the parameter reads (4 bytes per
  // slope or sink) under counter `key`.
  template <class IoT>
  __device__ __forceinline__ ScoreMod(const fg_score_params& sp, double softmax_scale, int64_t b,
                                      int64_t h, IoT& io, bool count, int key)
      : ScoreMod(sp, softmax_scale) {
    load_head(sp, b, h, io, count, key);
  }
  // A copy of this stage for (b, h), keeping the per-kernel part (the backward builds that
  // once and takes one per step).
  template <class IoT>
  __device__ __forceinline__ ScoreMod at(const fg_score_params& sp, double, int64_t b, int64_t h,
                                         IoT& io, bool count, int key) const {
    ScoreMod m = *this;
    m.load_head(sp, b, h, io, count, key);
    return m;
  }
  template <class IoT>
  __device__ __forceinline__ void load_head(const fg_score_params& sp, int64_t b, int64_t h,
                                            IoT& io, bool count, int key) {
    softcap.load_head(sp, b, h, io, count, key);
    alibi.load_head(sp, b, h, io, count, key);
    user.load_head(sp, b, h, io, count, key);
    sink.load_head(sp, b, h, io, count, key);
  }

  // y of one score at diagonal distance `dist` (a float: exact below 2^24, and no int-to-float
  // conversion per score, which runs at the MUFU's quarter rate) and position `q` (read by a
  // score_mod only: without one it is dead code), and g (the backward).
  __device__ __forceinline__ float logit(float x, float dist, const ScorePos& q, float& g) const {
    g = 1.f;
    return user.apply(x, alibi.apply(x, softcap.apply(x, x, dist, g), dist, g), q, g);
  }
  __device__ __forceinline__ float logit(float x, float dist, const ScorePos& q) const {
    float g;
    return logit(x, dist, q, g);
  }

  // (1 / l, natural-log LSE) of a row from its softmax state (the sink joins l).
  __device__ __forceinline__ void finalize(const RowState& st, float& inv_l, float& lse) const {
    if constexpr (!kSink) {
      online_softmax_finalize(st, inv_l, lse);  // the plain kernels' code
    } else {
      sink.finalize_ml(st.m, quad_sum(st.l), inv_l, lse);
    }
  }
  __device__ __forceinline__ void finalize_ml(float m, float l, float& inv_l, float& lse) const {
    sink.finalize_ml(m, l, inv_l, lse);
  }
  static __device__ __forceinline__ void finalize_ml_plain(float m, float l, float& inv_l,
                                                           float& lse) {
    Sink<false>{}.finalize_ml(m, l, inv_l, lse);
  }
};

// The stage a kernel of spec C runs; kWithSink = false where the sink is not read (the
// backward's main kernel: the forward's LSE already holds it).
template <class C, bool kWithSink = C::kSink>
using ScoreModOf = ScoreMod<C::kSoftcap, C::kAlibi, kWithSink, typename C::UserScore>;

// The signed diagonal distance of a tile's corner element (i0, j0): element (il, jl) of the
// tile lies at dist0 + jl - il.
__device__ __forceinline__ int tile_dist0(int64_t i0, int64_t j0, int64_t shift) {
  return static_cast<int>(j0 - i0 - shift);
}

// A tile's corner (i0, j0) in its sequence, with the corner's diagonal distance and the
// sequence's lengths (from the kernel's mask policy, mask.cuh): element (il, jl) is at
// distance dist0 + jl - il and position pos(il, jl).
// The corner's float positions (ScorePos) are converted once here, per tile and lane.
struct TileAt {
  int dist0, i0, j0, sq, sk;
  float fi0, fj0, fij0;
  static __device__ __forceinline__ TileAt make(int dist0, int i0, int j0, int sq, int sk) {
    return TileAt{dist0, i0, j0, sq, sk, static_cast<float>(i0), static_cast<float>(j0),
                  static_cast<float>(i0 - j0)};
  }
  // the corner moved by (di, dj) (a lane's first element)
  __device__ __forceinline__ TileAt moved(int di, int dj) const {
    return make(dist0, i0 + di, j0 + dj, sq, sk);
  }
  __device__ __forceinline__ ScorePos pos(int il, int jl) const {
    return ScorePos{i0 + il,
                    j0 + jl,
                    sq,
                    sk,
                    fi0 + static_cast<float>(il),
                    fj0 + static_cast<float>(jl),
                    fij0 + static_cast<float>(il - jl)};
  }
};
template <class Mask>
__device__ __forceinline__ TileAt tile_at(int64_t i0, int64_t j0, const Mask& mask) {
  return TileAt::make(tile_dist0(i0, j0, mask.shift), static_cast<int>(i0), static_cast<int>(j0),
                      static_cast<int>(mask.sq), static_cast<int>(mask.sk));
}

// The stage on one warp's m16n8 fragments (frag.cuh's coordinates; the warp's corner `at`).
// The lane's distances are one float base plus compile-time offsets once unrolled, and so
// are its positions (an int base and a float base per lane).
template <class Mod, int kMT, int kNT>
__device__ __forceinline__ void score_frag(float (&acc)[kMT][kNT][4], const Mod& mod,
                                           const TileAt& at, int lane) {
  if constexpr (Mod::kTransforms) {
    const float base = static_cast<float>(at.dist0 + 2 * (lane & 3) - (lane >> 2));
    const TileAt lat = at.moved(lane >> 2, 2 * (lane & 3));
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[mt][nt][e] = mod.logit(
              acc[mt][nt][e], base + static_cast<float>(nt * 8 + (e & 1) - mt * 16 - (e >> 1) * 8),
              lat.pos(mt * 16 + (e >> 1) * 8, nt * 8 + (e & 1)));
  }
}

// The backward's: y in place and g per element (g is unused, and may be [1][1][4], when
// the stage has no derivative).
template <class Mod, int kMT, int kNT, int kGM, int kGN>
__device__ __forceinline__ void score_frag(float (&acc)[kMT][kNT][4], const Mod& mod,
                                           const TileAt& at, int lane,
                                           float (&grad)[kGM][kGN][4]) {
  if constexpr (Mod::kHasGrad) {
    static_assert(kGM == kMT && kGN == kNT, "grad has the fragments' shape");
    const float base = static_cast<float>(at.dist0 + 2 * (lane & 3) - (lane >> 2));
    const TileAt lat = at.moved(lane >> 2, 2 * (lane & 3));
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[mt][nt][e] = mod.logit(
              acc[mt][nt][e], base + static_cast<float>(nt * 8 + (e & 1) - mt * 16 - (e >> 1) * 8),
              lat.pos(mt * 16 + (e >> 1) * 8, nt * 8 + (e & 1)), grad[mt][nt][e]);
  } else {
    score_frag(acc, mod, at, lane);
  }
}

// Fragments whose two rows per thread (g and g + 8 of one m16 tile) belong to different
// heads (decode packs a GQA group's query heads into the rows): one stage per row, and one
// corner per row (`at[r]`: that row's query i0 and the lane group's first key j0).
template <class Mod, int kNT>
__device__ __forceinline__ void score_frag_rows(float (&acc)[1][kNT][4], const Mod (&mods)[2],
                                                const TileAt (&at)[2], int lane) {
  if constexpr (Mod::kTransforms) {
    const float base[2] = {static_cast<float>(at[0].dist0 + 2 * (lane & 3)),
                           static_cast<float>(at[1].dist0 + 2 * (lane & 3))};
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[0][nt][e] = mods[e >> 1].logit(acc[0][nt][e],
                                           base[e >> 1] + static_cast<float>(nt * 8 + (e & 1)),
                                           at[e >> 1].pos(0, 2 * (lane & 3) + nt * 8 + (e & 1)));
  }
}

}  // namespace fg
