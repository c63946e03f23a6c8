// flashgen: the launch check of the score-stage parameters (score_params.h), host code only
// (the launch headers include it; the stage's device code is score_mod.cuh).
#pragma once

#include <math.h>
#include <stdint.h>

#include "score_params.h"

namespace fg {

// The score stage of a kernel generated without score_mod (the Spec's `UserScore`; with one,
// spec_struct.j2 renders its own struct, generator/features/user.py): nothing to read, and
// its launch check refuses a set user slot.
struct NoUserScore {
  static constexpr bool kOn = false, kHasGrad = false;
  struct Vals {};
  static const char* check(const fg_score_params& s) {
    return fg_score_user_slots_set(&s)
               ? "a user slot (user_ptr/f/i) is set but the kernel was generated without score_mod"
               : nullptr;
  }
};

// The mask stage of a kernel generated without mask_mod (the Spec's `UserMask`; with one,
// spec_struct.j2 renders its own struct, generator/features/user_mask.py): off.
struct NoUserMask {
  static constexpr bool kOn = false, kTokens = false;
  struct Vals {};
};

// The launch check of the score parameters: a feature the kernel was generated with needs
// its field, and a field of a feature it was not generated with is refused (nothing would
// read it); likewise the score_mod's slots. `backward` kernels also write dsinks.
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
  // the parameter slots, which score_mod and mask_mod share (each struct checks them all)
  if constexpr (C::UserMask::kOn) return C::UserMask::check(s);
  return C::UserScore::check(s);
}

}  // namespace fg
