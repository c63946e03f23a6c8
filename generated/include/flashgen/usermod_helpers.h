// generated from generator/usermod/emit.py (CPP_HELPERS): do not edit; a test holds it.
// flashgen: helpers of user-defined score_mod / mask_mod expressions
// (generator.usermod). Integer semantics are Python's, as in the float64 reference:
// floor division, a remainder with the divisor's sign, and 0 for a zero divisor.
#ifndef FLASHGEN_USERMOD_HELPERS
#define FLASHGEN_USERMOD_HELPERS
#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define FG_USERMOD_FN __host__ __device__ __forceinline__
#else
#define FG_USERMOD_FN inline
#endif

// (b == -1 is taken apart: INT64_MIN / -1 traps on x86; -a wraps, as numpy's does)
FG_USERMOD_FN int64_t fg_floordiv(int64_t a, int64_t b) {
  if (b == 0) return 0;
  if (b == -1) return static_cast<int64_t>(0ull - static_cast<uint64_t>(a));
  const int64_t q = a / b;  // truncates toward zero
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
FG_USERMOD_FN int64_t fg_mod(int64_t a, int64_t b) {
  if (b == 0 || b == -1) return 0;
  const int64_t r = a % b;  // takes a's sign
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
FG_USERMOD_FN int64_t fg_imin(int64_t a, int64_t b) { return a < b ? a : b; }
FG_USERMOD_FN int64_t fg_imax(int64_t a, int64_t b) { return a < b ? b : a; }
FG_USERMOD_FN int64_t fg_iabs(int64_t a) { return a < 0 ? -a : a; }
// floor(x) as an int: clamped to [-2^31, 2^31 - 1], 0 for NaN
FG_USERMOD_FN int64_t fg_floor_int(float x) {
  if (!(x == x)) return 0;
  const float f = floorf(x);
  if (f >= 2147483648.0f) return INT64_C(2147483647);
  if (f < -2147483648.0f) return -INT64_C(2147483648);
  return static_cast<int64_t>(f);
}
// a table column clamped to [0, n - 1]
FG_USERMOD_FN int64_t fg_clamp_index(int64_t k, int64_t n) {
  return k < 0 ? 0 : (k >= n ? n - 1 : k);
}
FG_USERMOD_FN float fg_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return expf(x);
#endif
}
FG_USERMOD_FN float fg_log(float x) {
#if defined(__CUDA_ARCH__)
  return __logf(x);
#else
  return logf(x);
#endif
}
FG_USERMOD_FN float fg_tanh(float x) { return tanhf(x); }
#endif  // FLASHGEN_USERMOD_HELPERS
