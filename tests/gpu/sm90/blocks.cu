// Checks the Hopper building blocks (include/flashgen/sm90.cuh, sm90_host.h) on their own:
// one warpgroup loads A (64 x D), B (64 x D) and V (64 x D) by TMA into SW128 tiles, computes
// S = A B^T with SS-wgmma (both operands K-major), then O = bf16/fp16(S) V with RS-wgmma (P
// from S's accumulator registers, V MN-major), and writes S and O in fp32, row-major.
// Built with nvcc -arch=sm_90a -shared; tests/gpu/test_sm90_blocks.py compares with NumPy.
#include <cuda_runtime.h>

#include <type_traits>
#include <utility>

#include "include/flashgen/sm90.cuh"
#include "include/flashgen/sm90_host.h"

namespace {

constexpr int kRows = 64;          // rows of A, B (keys) and V (keys)
constexpr int kBox = kRows * 64;   // elements of one 64-column SW128 box

template <class Elem, int kD>
__global__ void __launch_bounds__(128) blocks_kernel(const __grid_constant__ CUtensorMap ta,
                                                     const __grid_constant__ CUtensorMap tb,
                                                     const __grid_constant__ CUtensorMap tv,
                                                     float* s_out, float* o_out) {
  using namespace fg::sm90;
  extern __shared__ unsigned char smem_raw[];  // SW128 tiles need 1024-byte alignment
  Elem* sa = reinterpret_cast<Elem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  Elem* sb = sa + (kD / 64) * kBox;
  Elem* sv = sb + (kD / 64) * kBox;
  __shared__ uint64_t bar;
  const int tid = threadIdx.x;
  if (tid == 0) {
    mbar_init(&bar, 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (tid == 0) {
    mbar_arrive_expect_tx(&bar, 3 * kRows * kD * sizeof(Elem));
    for (int j = 0; j < kD / 64; ++j) {
      tma_load_2d(sa + j * kBox, &ta, &bar, j * 64, 0);
      tma_load_2d(sb + j * kBox, &tb, &bar, j * 64, 0);
      tma_load_2d(sv + j * kBox, &tv, &bar, j * 64, 0);
    }
  }
  mbar_wait(&bar, 0);

  // S = A B^T: k16 slice kk is box kk / 4, 32 bytes * (kk % 4) into each 128-byte row.
  float s[kRows / 2];
#pragma unroll
  for (int i = 0; i < kRows / 2; ++i) s[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const int off = (kk / 4) * kBox + (kk % 4) * 16;
    Wgmma<Elem, kRows>::template ss<0>(s, desc_k_major(sa + off), desc_k_major(sb + off), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(s);

  const int w = tid / 32, g = (tid % 32) / 4, c = tid % 4;
#pragma unroll
  for (int j = 0; j < kRows / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        s_out[(16 * w + g + 8 * h) * kRows + 8 * j + 2 * c + e] = s[4 * j + 2 * h + e];

  // O = P V: P's k16 slice kk2 (keys 16 kk2 ..) from S's accumulator; V's rows 16 kk2 ..
  // start 2048 bytes * kk2 into each box, boxes kBox elements apart.
  float o[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk2 = 0; kk2 < kRows / 16; ++kk2) {
    uint32_t a[4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
      a[r] = fg::Mma<Elem>::pack(s[8 * kk2 + 2 * r], s[8 * kk2 + 2 * r + 1]);
    Wgmma<Elem, kD>::template rs<1>(o, a, desc_mn_major(sv + kk2 * 16 * 64, kBox * sizeof(Elem)),
                                    kk2 > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(o);
#pragma unroll
  for (int j = 0; j < kD / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        o_out[(16 * w + g + 8 * h) * kD + 8 * j + 2 * c + e] = o[4 * j + 2 * h + e];
}

template <class Elem, int kD>
int launch(const void* a, const void* b, const void* v, float* s, float* o) {
  CUtensorMap ta, tb, tv;
  const bool bf16 = sizeof(Elem) == 2 && !std::is_same<Elem, __half>::value;
  for (auto [map, ptr] : {std::pair{&ta, a}, std::pair{&tb, b}, std::pair{&tv, v}})
    if (fg::sm90::make_tmap_2d(map, ptr, bf16, kRows, kD, kD, kRows) != nullptr) return -1;
  const int smem = 3 * kRows * kD * sizeof(Elem) + 1024;  // + alignment slack
  cudaError_t err = cudaFuncSetAttribute(blocks_kernel<Elem, kD>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  blocks_kernel<Elem, kD><<<1, 128, smem>>>(ta, tb, tv, s, o);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  return cudaDeviceSynchronize();
}

}  // namespace

// dtype 0: bf16, 1: fp16; d: 64 or 128. 0 on success, -1 for a refused tensor map, else a
// cudaError_t.
extern "C" int fg_sm90_blocks_run(int dtype, int d, const void* a, const void* b, const void* v,
                                  float* s, float* o) {
  if (dtype == 0 && d == 64) return launch<__nv_bfloat16, 64>(a, b, v, s, o);
  if (dtype == 0 && d == 128) return launch<__nv_bfloat16, 128>(a, b, v, s, o);
  if (dtype == 1 && d == 64) return launch<__half, 64>(a, b, v, s, o);
  if (dtype == 1 && d == 128) return launch<__half, 128>(a, b, v, s, o);
  return -2;
}
