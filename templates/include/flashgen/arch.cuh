// flashgen: the few PTX instructions the mma.sync kernels are built from (sm_80 .. sm_90).
//
// Glossary
//   frag A  4 x b32 registers of an m16n8k16 A operand (16 x 16, row-major), per lane
//   frag B  2 x b32 registers of an m16n8k16 B operand (16 x 8, "col"), per lane
//   frag C  4 x f32 registers of the m16n8 accumulator: lane (g = lane/4, t = lane%4) holds
//           rows g and g+8, columns 2t and 2t+1
//   Elem    __half or __nv_bfloat16; accumulation is always fp32
//
// Why these and not wgmma: mma.sync + ldmatrix + cp.async run unchanged from sm_80 to sm_90,
// so one template serves every target in the targets table.
#pragma once

#include "arch_guard.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace fg {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; when `valid` is false the 16 bytes are zero-filled and no
// global byte is read (src-size 0), which is how tail rows stay finite without a branch.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// 4-byte global -> shared copy (row metadata such as LSE); zero-filled when !valid.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_bytes));
}

// Lane -> smem (row, col) offsets of the ldmatrix.x4 loads of one 16 x 16 operand block.
//   a: an A operand from row-major storage (rows m, cols k) with ldmatrix; also a B operand
//      from storage [k][n] with ldmatrix.trans (V in P V): matrices (r, c), (r+8, c),
//      (r, c+8), (r+8, c+8)
//   b: a B operand from storage [n][k] with ldmatrix (K in Q K^T: two n8 tiles); also an A
//      operand from its transposed storage [k][m] with ldmatrix.trans (P^T in P^T dO):
//      matrices (r, c), (r, c+8), (r+8, c), (r+8, c+8)
struct LaneOffsets {
  int a_row, a_col, b_row, b_col;
  __device__ __forceinline__ explicit LaneOffsets(int lane)
      : a_row((lane & 7) + ((lane >> 3) & 1) * 8), a_col((lane >> 4) * 8),
        b_row((lane & 7) + (lane >> 4) * 8), b_col(((lane >> 3) & 1) * 8) {}
};

// ldmatrix takes 32-bit shared-state-space addresses: kernels form one per lane and tile and
// add compile-time offsets, so no 64-bit generic pointer stays live across the unrolled loops.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t saddr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(saddr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t saddr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(saddr));
}

template <typename Elem>
struct Mma;

template <>
struct Mma<__half> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// 2^x on the SFU. ex2.approx.ftz maps -inf to +0, which the online softmax relies on.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace fg
