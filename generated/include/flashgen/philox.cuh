// flashgen: Philox4x32-10 and the dropout keep rule (identical to verify/philox.py and
// verify/dropout.py; docs/conventions.md is the contract).
//
// Glossary
//   ctr     4 x uint32 counter (j >> 2, i, b * heads + h, offset)
//   key     2 x uint32 key (seed low word, seed high word)
//   word    output word j & 3 of philox(ctr, key); kept iff word >= threshold
//   threshold  floor(p * 2^32), computed once per CTA in double precision from dropout_p
#pragma once

#include <stdint.h>

namespace fg {

struct Philox4 {
  uint32_t x, y, z, w;
};

__device__ __forceinline__ Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z);
    const uint32_t lo1 = 0xCD9E8D57u * c.z;
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// The dropout decision for one (b, h, i) row and the 4-column group containing column j.
struct DropoutRng {
  uint32_t key0, key1, bh, offset, threshold;

  __device__ __forceinline__ Philox4 group(uint32_t row, uint32_t col) const {
    return philox4x32_10(Philox4{col >> 2, row, bh, offset}, key0, key1);
  }
  __device__ __forceinline__ static uint32_t word(const Philox4& r, uint32_t w) {
    return w == 0 ? r.x : (w == 1 ? r.y : (w == 2 ? r.z : r.w));
  }
};

}  // namespace fg
