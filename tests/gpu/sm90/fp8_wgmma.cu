// Checks the e4m3 wgmma rows (include/flashgen/sm90_fp8.cuh) on their own: one warpgroup
// copies A (64 x 128 e4m3) and B (N x 128 e4m3), both K-major, into SW128 shared-memory tiles
// (a 128-byte row is one swizzle row), then computes S = A B^T twice: with SS-wgmma, and with
// RS-wgmma whose A fragment is read from global memory in the m64nNk32 layout this pins down
// (sm90.cuh's k16 layout with each 16-bit pair a quadruple of bytes: thread t, warp w = t / 32,
// g = lane / 4, c = lane % 4, a[0] holds A[16w + g][4c .. 4c + 3], a[1] row + 8, a[2] and
// a[3] the same rows at column 16 + 4c, low byte first, per k32 slice). Both are written in fp32, row-major; tests/gpu/test_sm90_fp8_wgmma.py compares
// them with NumPy. Built with nvcc -arch=sm_90a -shared.
#include <cuda_runtime.h>

#include "include/flashgen/sm90_fp8.cuh"

namespace {

constexpr int kM = 64;
constexpr int kK = 128;  // bytes of a row: one SW128 row, four k32 slices

// Byte (r, k) of a K-major SW128 tile of 128-byte rows: 8-row atoms of 1024 bytes, the
// 16-byte chunk k / 16 of row r at chunk (k / 16) ^ (r % 8).
__device__ int sw128(int r, int k) {
  return (r / 8) * 1024 + (r % 8) * 128 + (((k / 16) ^ (r % 8)) * 16) + k % 16;
}

template <int kN>
__global__ void __launch_bounds__(128) fp8_kernel(const uint8_t* a, const uint8_t* b,
                                                  float* s_ss, float* s_rs) {
  using namespace fg::sm90;
  using Op = Wgmma<__nv_fp8_e4m3, kN>;
  extern __shared__ unsigned char smem_raw[];
  uint8_t* sa = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                           ~uintptr_t{1023});
  uint8_t* sb = sa + kM * kK;
  const int tid = threadIdx.x;
  for (int i = tid; i < kM * kK; i += 128) sa[sw128(i / kK, i % kK)] = a[i];
  for (int i = tid; i < kN * kK; i += 128) sb[sw128(i / kK, i % kK)] = b[i];
  fence_proxy_async_smem();
  __syncthreads();

  const int w = tid / 32, g = (tid % 32) / 4, c = tid % 4;
  float s[kN / 2], t[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) s[i] = t[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kK / 32; ++kk)
    Op::ss(s, desc_k_major(sa + 32 * kk), desc_k_major(sb + 32 * kk), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(s);

  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kK / 32; ++kk) {
    uint32_t frag[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = 16 * w + g + 8 * (r % 2), col = 32 * kk + 16 * (r / 2) + 4 * c;
      frag[r] = *reinterpret_cast<const uint32_t*>(a + row * kK + col);
    }
    Op::rs(t, frag, desc_k_major(sb + 32 * kk), kk > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(t);

#pragma unroll
  for (int j = 0; j < kN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int at = (16 * w + g + 8 * h) * kN + 8 * j + 2 * c + e;
        s_ss[at] = s[4 * j + 2 * h + e];
        s_rs[at] = t[4 * j + 2 * h + e];
      }
}

template <int kN>
int launch(const uint8_t* a, const uint8_t* b, float* s_ss, float* s_rs) {
  const int smem = (kM + kN) * kK + 1024;  // + alignment slack
  cudaError_t err = cudaFuncSetAttribute(fp8_kernel<kN>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  fp8_kernel<kN><<<1, 128, smem>>>(a, b, s_ss, s_rs);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  return cudaDeviceSynchronize();
}

}  // namespace

// n: 64, 128 or 256 (the rows of B). 0 on success, -2 for another n, else a cudaError_t.
extern "C" int fg_sm90_fp8_wgmma_run(int n, const uint8_t* a, const uint8_t* b, float* s_ss,
                                     float* s_rs) {
  if (n == 64) return launch<64>(a, b, s_ss, s_rs);
  if (n == 128) return launch<128>(a, b, s_ss, s_rs);
  if (n == 256) return launch<256>(a, b, s_ss, s_rs);
  return -2;
}
