// flashgen: the interval arithmetic of a mask_mod's tile classifier, host and device (the
// C++ twin of generator/usermod/blocks.py; generator/features/user_mask.py emits calls of these
// from the mask's tree, and tests/test_maskmod.py compiles them for the host and compares them
// with blocks.py on every tile of small shapes).
//
// Glossary
//   fg_iv    an int interval [lo, hi]: exact integer bounds held as doubles, +-inf unbounded.
//            Bounds beyond +-2^52 make the whole interval unbounded (blocks.py does this past
//            int64, where numpy wraps): below 2^52 every sum, difference and product of
//            bounds is exact in double (or rounds past 2^52 and is dropped), so every bound
//            is a true bound
//   fg_tri   a bool's possible values (t: may be true, f: may be false)
//   class    0 EMPTY (false on every element), 1 PARTIAL, 2 FULL (true on every element)
// Float subexpressions are not bounded here: a comparison with a float operand may be either
// (fg_tri_any), so a mask whose decisions need floats classifies its tiles PARTIAL, and every
// element is then masked by the mask itself (sound; blocks.py may do better). Per-token
// vectors are bounded by their values over the tile's rows or keys (fg_tok_bounds), as
// blocks.py bounds a vector it is given.
#pragma once

#include <math.h>
#include <stdint.h>

#include "usermod_helpers.h"

struct fg_iv {
  double lo, hi;
};
struct fg_tri {
  bool t, f;
};

#define FG_IV_LIMIT 4503599627370496.0  // 2^52

FG_USERMOD_FN fg_iv fg_iv_top() { return fg_iv{-INFINITY, INFINITY}; }
// an int interval: unbounded as a whole when an end leaves +-2^52 (blocks.py's _ints)
FG_USERMOD_FN fg_iv fg_iv_ints(double lo, double hi) {
  if (!(lo >= -FG_IV_LIMIT && hi <= FG_IV_LIMIT)) return fg_iv_top();
  return fg_iv{lo, hi};
}
FG_USERMOD_FN fg_iv fg_iv_of(int64_t lo, int64_t hi) {
  return fg_iv_ints(static_cast<double>(lo), static_cast<double>(hi));
}
FG_USERMOD_FN bool fg_iv_finite(fg_iv a) { return isfinite(a.lo) && isfinite(a.hi); }
FG_USERMOD_FN fg_iv fg_iv_hull(fg_iv a, fg_iv b) {
  return fg_iv{fmin(a.lo, b.lo), fmax(a.hi, b.hi)};
}
FG_USERMOD_FN fg_iv fg_iv_add(fg_iv a, fg_iv b) { return fg_iv_ints(a.lo + b.lo, a.hi + b.hi); }
FG_USERMOD_FN fg_iv fg_iv_sub(fg_iv a, fg_iv b) { return fg_iv_ints(a.lo - b.hi, a.hi - b.lo); }
FG_USERMOD_FN fg_iv fg_iv_neg(fg_iv a) { return fg_iv_ints(-a.hi, -a.lo); }
FG_USERMOD_FN double fg_iv_mul_bound(double x, double y) {
  return (x == 0.0 || y == 0.0) ? 0.0 : x * y;  // 0 * inf = 0: a bound, not a value
}
FG_USERMOD_FN fg_iv fg_iv_mul(fg_iv a, fg_iv b) {
  const double c0 = fg_iv_mul_bound(a.lo, b.lo), c1 = fg_iv_mul_bound(a.lo, b.hi);
  const double c2 = fg_iv_mul_bound(a.hi, b.lo), c3 = fg_iv_mul_bound(a.hi, b.hi);
  return fg_iv_ints(fmin(fmin(c0, c1), fmin(c2, c3)), fmax(fmax(c0, c1), fmax(c2, c3)));
}
FG_USERMOD_FN int64_t fg_iv_int(double x) { return static_cast<int64_t>(x); }
// floor division: monotone in x and in y for one sign of divisor; 0 for a zero divisor
FG_USERMOD_FN fg_iv fg_iv_floordiv(fg_iv a, fg_iv b) {
  if (!(fg_iv_finite(a) && fg_iv_finite(b))) return fg_iv_top();
  bool any = false;
  fg_iv out{0.0, 0.0};
  if (b.lo <= 0.0 && 0.0 <= b.hi) any = true;
  for (int side = 0; side < 2; ++side) {
    const double lo = side == 0 ? b.lo : fmax(b.lo, 1.0);
    const double hi = side == 0 ? fmin(b.hi, -1.0) : b.hi;
    if (lo <= hi) {
      const int64_t al = fg_iv_int(a.lo), ah = fg_iv_int(a.hi);
      const int64_t yl = fg_iv_int(lo), yh = fg_iv_int(hi);
      const double c0 = static_cast<double>(fg_floordiv(al, yl));
      const double c1 = static_cast<double>(fg_floordiv(al, yh));
      const double c2 = static_cast<double>(fg_floordiv(ah, yl));
      const double c3 = static_cast<double>(fg_floordiv(ah, yh));
      const fg_iv part{fmin(fmin(c0, c1), fmin(c2, c3)), fmax(fmax(c0, c1), fmax(c2, c3))};
      out = any ? fg_iv_hull(out, part) : part;
      any = true;
    }
  }
  return fg_iv_ints(out.lo, out.hi);
}
// Python's floor of x / y on doubles holding exact integers (|x| <= 2^52)
FG_USERMOD_FN double fg_iv_fdiv(double x, double y) {
  return static_cast<double>(fg_floordiv(fg_iv_int(x), fg_iv_int(y)));
}
// the remainder with the divisor's sign (0 for a zero divisor): blocks.py's _i_mod
FG_USERMOD_FN fg_iv fg_iv_mod(fg_iv a, fg_iv b) {
  bool any = false;
  fg_iv out{0.0, 0.0};
  if (b.lo <= 0.0 && 0.0 <= b.hi) any = true;
  {  // positive divisors: remainders in [0, c)
    const double lo = fmax(b.lo, 1.0), hi = b.hi;
    if (lo <= hi) {
      fg_iv part;
      if (lo == hi && fg_iv_finite(a) && fg_iv_fdiv(a.lo, lo) == fg_iv_fdiv(a.hi, lo)) {
        part = fg_iv{static_cast<double>(fg_mod(fg_iv_int(a.lo), fg_iv_int(lo))),
                     static_cast<double>(fg_mod(fg_iv_int(a.hi), fg_iv_int(lo)))};
      } else if (a.lo >= 0.0 && a.hi < lo) {
        part = a;
      } else {
        part = fg_iv{0.0, a.lo < 0.0 ? hi - 1.0 : fmin(hi - 1.0, a.hi)};
      }
      out = any ? fg_iv_hull(out, part) : part;
      any = true;
    }
  }
  {  // negative divisors: remainders in (c, 0]
    const double lo = b.lo, hi = fmin(b.hi, -1.0);
    if (lo <= hi) {
      fg_iv part;
      if (lo == hi && fg_iv_finite(a) && fg_iv_fdiv(a.lo, lo) == fg_iv_fdiv(a.hi, lo)) {
        part = fg_iv{static_cast<double>(fg_mod(fg_iv_int(a.lo), fg_iv_int(lo))),
                     static_cast<double>(fg_mod(fg_iv_int(a.hi), fg_iv_int(lo)))};
      } else if (a.hi <= 0.0 && a.lo > hi) {
        part = a;
      } else {
        part = fg_iv{a.hi > 0.0 ? lo + 1.0 : fmax(lo + 1.0, a.lo), 0.0};
      }
      out = any ? fg_iv_hull(out, part) : part;
      any = true;
    }
  }
  return out;
}
FG_USERMOD_FN fg_iv fg_iv_abs(fg_iv a) {
  if (a.lo >= 0.0) return a;
  if (a.hi <= 0.0) return fg_iv_ints(-a.hi, -a.lo);
  return fg_iv_ints(0.0, fmax(-a.lo, a.hi));
}
FG_USERMOD_FN fg_iv fg_iv_min(fg_iv a, fg_iv b) {
  return fg_iv{fmin(a.lo, b.lo), fmin(a.hi, b.hi)};
}
FG_USERMOD_FN fg_iv fg_iv_max(fg_iv a, fg_iv b) {
  return fg_iv{fmax(a.lo, b.lo), fmax(a.hi, b.hi)};
}
FG_USERMOD_FN fg_iv fg_iv_where(fg_tri c, fg_iv a, fg_iv b) {
  if (c.t && c.f) return fg_iv_hull(a, b);
  return c.t ? a : b;
}

// ---- bools -------------------------------------------------------------------------------
FG_USERMOD_FN fg_tri fg_tri_const(bool v) { return fg_tri{v, !v}; }
FG_USERMOD_FN fg_tri fg_tri_any() { return fg_tri{true, true}; }
FG_USERMOD_FN fg_tri fg_tri_not(fg_tri a) { return fg_tri{a.f, a.t}; }
FG_USERMOD_FN fg_tri fg_tri_and(fg_tri a, fg_tri b) { return fg_tri{a.t && b.t, a.f || b.f}; }
FG_USERMOD_FN fg_tri fg_tri_or(fg_tri a, fg_tri b) { return fg_tri{a.t || b.t, a.f && b.f}; }
FG_USERMOD_FN fg_tri fg_tri_where(fg_tri c, fg_tri a, fg_tri b) {
  if (c.t && c.f) return fg_tri{a.t || b.t, a.f || b.f};
  return c.t ? a : b;
}
// comparisons of int intervals: op 0 <, 1 <=, 2 >, 3 >=, 4 ==, 5 != (blocks.py's _compare)
FG_USERMOD_FN fg_tri fg_iv_lt(fg_iv a, fg_iv b) { return fg_tri{!(a.lo >= b.hi), !(a.hi < b.lo)}; }
FG_USERMOD_FN fg_tri fg_iv_le(fg_iv a, fg_iv b) { return fg_tri{!(a.lo > b.hi), !(a.hi <= b.lo)}; }
FG_USERMOD_FN fg_tri fg_iv_gt(fg_iv a, fg_iv b) { return fg_iv_lt(b, a); }
FG_USERMOD_FN fg_tri fg_iv_ge(fg_iv a, fg_iv b) { return fg_iv_le(b, a); }
FG_USERMOD_FN fg_tri fg_iv_eq(fg_iv a, fg_iv b) {
  const bool same = a.lo == a.hi && a.hi == b.lo && b.lo == b.hi;
  const bool apart = a.hi < b.lo || b.hi < a.lo;
  return fg_tri{!apart, !same};
}
FG_USERMOD_FN fg_tri fg_iv_ne(fg_iv a, fg_iv b) { return fg_tri_not(fg_iv_eq(a, b)); }
// The bounds [lo, hi] of an int32 per-token vector over positions [k0, k1] (read one by one:
// a tile's rows or keys, at most a tile long): a classifier's per-token reads.
FG_USERMOD_FN void fg_tok_bounds(const int32_t* v, int64_t k0, int64_t k1, int64_t& lo,
                                 int64_t& hi) {
  int32_t a = v[k0], b = v[k0];
  for (int64_t k = k0 + 1; k <= k1; ++k) {
    const int32_t x = v[k];
    a = x < a ? x : a;
    b = x > b ? x : b;
  }
  lo = a, hi = b;
}
// the class of a tile from the mask's possible values
FG_USERMOD_FN int fg_tri_class(fg_tri m) { return !m.f ? 2 : (!m.t ? 0 : 1); }
