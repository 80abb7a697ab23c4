// Host side of the sm_90 tensor-memory accelerator: cuTensorMapEncodeTiled through the runtime's driver entry point
// (no link against libcuda) and the 2-D, 128-byte-swizzled maps that sm90.cuh's tma_load_2d reads.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace prime_kernels {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled_fn() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
    return (err == cudaSuccess && q == cudaDriverEntryPointSuccess) ? reinterpret_cast<EncodeTiledFn>(f) : nullptr;
  }();
  return fn;
}

// A map over a row-major [rows, cols] matrix of 16-bit elements (8-bit for CU_TENSOR_MAP_DATA_TYPE_UINT8) with
// `row_stride` elements between rows, boxes of box_rows x box_cols (one 128-byte swizzle row at most) with 128-byte
// swizzle; reads past the edges are zero-filled. Returns a CUresult (0 on success).
inline int make_tmap_2d(CUtensorMap* map, const void* ptr, CUtensorMapDataType dtype, int64_t rows, int64_t cols,
                        int64_t row_stride, int box_rows, int box_cols) {
  const EncodeTiledFn fn = encode_tiled_fn();
  if (fn == nullptr) return -1;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t element_bytes = dtype == CU_TENSOR_MAP_DATA_TYPE_UINT8 ? 1 : 2;
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * element_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estr[2] = {1, 1};
  return static_cast<int>(fn(map, dtype, 2, const_cast<void*>(ptr), dims, strides, box, estr,
                             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
}

// A map over a row-major [batches, rows, cols] tensor of 16-bit elements (`row_stride` elements between rows,
// `batch_stride` between batches), boxes of 1 x box_rows x box_cols with 128-byte swizzle: a tile at the edge of one
// batch is clipped there (a 2-D map over all rows would spill into the next batch's). For TMA stores of per-batch
// tiles (tma_store_3d). Returns a CUresult (0 on success).
inline int make_tmap_3d(CUtensorMap* map, const void* ptr, int64_t batches, int64_t rows, int64_t cols,
                        int64_t row_stride, int64_t batch_stride, int box_rows, int box_cols) {
  const EncodeTiledFn fn = encode_tiled_fn();
  if (fn == nullptr) return -1;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(batches)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row_stride) * 2, static_cast<cuuint64_t>(batch_stride) * 2};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t estr[3] = {1, 1, 1};
  return static_cast<int>(fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(ptr), dims, strides, box,
                             estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
}

}  // namespace prime_kernels
