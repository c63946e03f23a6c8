// flashgen: host side of the Hopper (sm_90a) building blocks: TMA tensor maps.
//
// Glossary
//   tensor map  a 128-byte CUtensorMap describing a global tensor and the box one TMA load
//               copies; built on the host, passed to kernels as a __grid_constant__ parameter
//   box         64 elements (128 bytes, the SW128 row) x box_rows rows
//
// cuTensorMapEncodeTiled is a driver API function; it is reached through the runtime's
// cudaGetDriverEntryPointByVersion, so vendored code links against cudart alone (no -lcuda).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>

namespace fg {
namespace sm90 {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled_fn() {
  static EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// One encode. cuTensorMapEncodeTiled is a driver call and needs a current context, which a
// thread may lack although its device is set: the runtime makes the primary context current
// lazily, on its first call that needs one, and a thread whose CUDA calls so far went through
// another copy of the runtime (autograd's worker thread, calling through torch's) may have
// made none. Seen on an H200: CUDA_ERROR_INVALID_CONTEXT on the first sm_90a backward in
// autograd's worker thread. Only then (no context at all, so no caller's context is
// replaced) is the runtime's current device's primary context made current, and the encode
// tried again. Not a stream operation, so it is legal during graph capture.
inline const char* encode(EncodeTiledFn fn, CUtensorMap* map, CUtensorMapDataType type,
                          cuuint32_t rank, const void* base, const cuuint64_t* dims,
                          const cuuint64_t* strides, const cuuint32_t* box,
                          const cuuint32_t* elem_strides) {
  auto once = [&] {
    return fn(map, type, rank, const_cast<void*>(base), dims, strides, box, elem_strides,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  CUresult r = once();
  if (r == CUDA_ERROR_INVALID_CONTEXT) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaSetDevice(dev) != cudaSuccess)
      return "no CUDA context is current in this thread and none could be made current";
    r = once();
  }
  return r == CUDA_SUCCESS ? nullptr : "cuTensorMapEncodeTiled rejected the tensor map";
}
inline CUtensorMapDataType half_type(bool bf16) {
  return bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// A 2D view (rows x cols, 16-bit elements, `row_stride` elements between rows) loaded in
// SW128 boxes of 64 columns x `box_rows` rows. Returns nullptr or what is wrong: TMA needs a
// 16-byte aligned base, a row stride that is a multiple of 16 bytes and below 2^40 bytes.
inline const char* make_tmap_2d(CUtensorMap* map, const void* base, bool bf16, uint64_t rows,
                                uint64_t cols, uint64_t row_stride, uint32_t box_rows) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return "TMA needs a 16-byte aligned base";
  if ((row_stride * 2) % 16 != 0)
    return "TMA needs row strides that are multiples of 8 elements (16 bytes)";
  if (row_stride * 2 >= (1ull << 40)) return "TMA row stride must be below 2^40 bytes";
  if (box_rows < 1 || box_rows > 256) return "TMA boxes have 1 to 256 rows";
  EncodeTiledFn fn = encode_tiled_fn();
  if (!fn) return "cuTensorMapEncodeTiled is not available (driver too old for TMA)";
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_stride * 2};
  const cuuint32_t box[2] = {64, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(fn, map, half_type(bf16), 2, base, dims, strides, box, elem_strides);
}

// TMA's rules for a (batch, rows, heads, cols) tensor of 16-bit elements with element
// strides `batch_stride`, `row_stride`, `head_stride` (cols contiguous): nullptr, or what is
// wrong and what is allowed. Arithmetic only (no driver call), so a launcher's check can use it.
inline const char* tmap_bshd_problem(const void* base, int64_t batch_stride, int64_t row_stride,
                                     int64_t head_stride, uint32_t box_rows) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return "TMA needs a 16-byte aligned base";
  const int64_t strides_elems[3] = {row_stride, head_stride, batch_stride};
  for (int64_t s : strides_elems)
    if (s <= 0 || (s * 2) % 16 != 0 || s * 2 >= (int64_t{1} << 40))
      return "TMA needs positive row, head and batch strides that are multiples of 8 elements "
             "(16 bytes) and below 2^40 bytes";
  if (box_rows < 1 || box_rows > 256) return "TMA boxes have 1 to 256 rows";
  return nullptr;
}

// Varlen (packed tensors, total rows): the batch stride a map gets. The maps span the packed
// (total, heads, cols) tensors as one batch entry, never stepped over, so the stride is the
// packed tensor's extent (its outer stride times that dimension's size), and the map's
// dimensions do not overlap; it saturates instead of overflowing (tmap_bshd_problem's 2^40
// bytes then refuses it). Dense tensors keep their own.
inline int64_t map_batch_stride(bool varlen, int64_t batch_stride, int64_t row_stride,
                                int64_t head_stride, int64_t total, int64_t heads) {
  if (!varlen) return batch_stride;
  const int64_t outer = row_stride > head_stride ? row_stride : head_stride;
  const int64_t size = row_stride > head_stride ? (total > 1 ? total : 1) : heads;
  const int64_t too_large = int64_t{1} << 40;  // elements: over TMA's limit, no overflow in * 2
  return outer > 0 && size > too_large / outer ? too_large : outer * size;
}

// Varlen's packed totals, which the launcher learns from the params (cu_seqlens are on the
// device): nullptr or the problem. Whether total_q >= cu_seqlens_q[batch] (and total_k) holds
// can only be checked on the device; the host checks what it can: a total at least the
// longest sequence (seqlen_q, seqlen_k) and below 2^31 (the int32 cu_seqlens and TMA
// coordinates).
inline const char* varlen_totals_problem(int64_t total_q, int64_t total_k, int64_t seqlen_q,
                                         int64_t seqlen_k) {
  if (total_q < seqlen_q)
    return "varlen needs total_q, the rows of the packed q tensor (>= cu_seqlens_q[batch], so "
           ">= seqlen_q): the sm_90a kernels' tensor maps span them";
  if (total_k < seqlen_k)
    return "varlen needs total_k, the rows of the packed k and v tensors (>= "
           "cu_seqlens_k[batch], so >= seqlen_k): the sm_90a kernels' tensor maps span them";
  if (total_q > INT32_MAX || total_k > INT32_MAX)
    return "total_q and total_k must be below 2^31 (cu_seqlens and TMA coordinates are int32)";
  return nullptr;
}

// The map of such a tensor, loaded in SW128 boxes of 64 columns x `box_rows` rows of one
// (head, batch); rows past `rows` and columns past `cols` read as 0. The map's dimensions are
// (cols, rows, heads, batch), or (cols, heads, rows, batch) when the head stride is the smaller
// one (`heads_inner`, the usual (b, s, h, d) layout), so strides grow with the dimension; a
// kernel passes its coordinates in the same order. nullptr, or what is wrong.
inline const char* make_tmap_bshd(CUtensorMap* map, bool* heads_inner, const void* base,
                                  bool bf16, uint64_t batch, uint64_t rows, uint64_t heads,
                                  uint64_t cols, int64_t batch_stride, int64_t row_stride,
                                  int64_t head_stride, uint32_t box_rows) {
  if (const char* msg = tmap_bshd_problem(base, batch_stride, row_stride, head_stride, box_rows))
    return msg;
  EncodeTiledFn fn = encode_tiled_fn();
  if (!fn) return "cuTensorMapEncodeTiled is not available (driver too old for TMA)";
  // Degenerate sizes (a zero batch) never reach a load; the map still needs sizes >= 1.
  auto at_least_1 = [](uint64_t x) { return x < 1 ? uint64_t{1} : x; };
  *heads_inner = head_stride < row_stride;
  const cuuint64_t r = at_least_1(rows), h = at_least_1(heads);
  const cuuint64_t rs = static_cast<cuuint64_t>(row_stride) * 2;
  const cuuint64_t hs = static_cast<cuuint64_t>(head_stride) * 2;
  const cuuint64_t dims[4] = {cols, *heads_inner ? h : r, *heads_inner ? r : h, at_least_1(batch)};
  const cuuint64_t strides[3] = {*heads_inner ? hs : rs, *heads_inner ? rs : hs,
                                 static_cast<cuuint64_t>(batch_stride) * 2};
  const cuuint32_t box[4] = {64, *heads_inner ? 1u : box_rows, *heads_inner ? box_rows : 1u, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(fn, map, half_type(bf16), 4, base, dims, strides, box, elem_strides);
}

}  // namespace sm90
}  // namespace fg
