// The linear_logp backward's GEMMs on the LibTorch stable ABI (host code only).
//
// Plain products go through the dispatcher (aten::mm.out / mm.dtype_out, called by schema name as torch::stable's own
// ops are): ATen runs them exactly as the exact-ABI build's at::mm_out did. The accumulating ones (grad_hidden +=
// dZ @ W chunk by chunk, the token-chunked grad_weight) were at::addmm_out(acc, acc, a, b, out_dtype=float32, beta,
// alpha), and aten::addmm's beta and alpha are `Scalar`s, a schema type torch_call_dispatcher cannot convert (its
// StableIValue <-> IValue conversion has no Scalar case, in 2.11 and after): no stable route reaches it. They call
// cuBLAS as ATen's default backend does for a 16-bit product into float32 (cublasGemmEx, fp32 compute,
// CUBLAS_GEMM_DEFAULT_TENSOR_OP) on torch's own handle for the current device and stream (with its workspace), the
// cublasGemmEx of the libcublas torch has loaded: the module links no CUDA library and stays torch-independent.
// Not followed here: torch.backends.cuda.preferred_blas_library("cublaslt") and TunableOp, which ATen's addmm obeys.
#pragma once

#include <prime_kernels/stable.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/stableivalue_conversions.h>

#include <cublas_v2.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace linear_logp_gemm {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// out = a @ b (aten::mm.out), or with out_dtype (aten::mm.dtype_out: 16-bit operands, float32 out), into out's memory.
inline void mm_out(Tensor& out, const Tensor& a, const Tensor& b, std::optional<ScalarType> out_dtype) {
  namespace detail = torch::stable::detail;
  if (out_dtype.has_value()) {
    std::array<StableIValue, 4> stack{detail::from(a), detail::from(b), detail::from(*out_dtype), detail::from(out)};
    TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::mm", "dtype_out", stack.data(), TORCH_ABI_VERSION));
    (void)detail::to<Tensor>(stack[0]);  // the returned alias of out: release its handle
  } else {
    std::array<StableIValue, 3> stack{detail::from(a), detail::from(b), detail::from(out)};
    TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::mm", "out", stack.data(), TORCH_ABI_VERSION));
    (void)detail::to<Tensor>(stack[0]);
  }
}

// The C symbol's signature (cublas_api.h also declares a C++ overload taking a cudaDataType_t compute type).
using GemmExFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                    const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                                    cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);

// cublasGemmEx of the libcublas that torch loaded (same CUDA major as this build: the registry's gate), or null.
inline GemmExFn loaded_gemm_ex() {
  static const GemmExFn fn = [] {
    const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* library = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);
    return library ? reinterpret_cast<GemmExFn>(dlsym(library, "cublasGemmEx")) : nullptr;
  }();
  return fn;
}

// A row-major [rows, cols] operand (or a transposed view of one) as cuBLAS's column-major operand of the transposed
// product: C^T = B^T A^T, as ATen lays out a row-major result.
struct Operand {
  const void* data;
  cublasOperation_t op;
  int64_t ld;
};

inline Operand column_major(const Tensor& t) {
  if (t.stride(1) == 1) return {t.const_data_ptr(), CUBLAS_OP_N, std::max<int64_t>(t.stride(0), t.size(1))};
  return {t.const_data_ptr(), CUBLAS_OP_T, std::max<int64_t>(t.stride(1), t.size(0))};
}

// acc = beta * acc + a @ b: a [m, k] and b [k, n] bfloat16 or float16 (row-major or transposed views), acc a float32
// [m, n] row-major view; products and sums in float32 (ATen's addmm(acc, a, b, out_dtype=float32, beta=beta)).
inline void addmm_f32(Tensor& acc, const Tensor& a, const Tensor& b, float beta) {
  const GemmExFn gemm_ex = loaded_gemm_ex();
  PK_CHECK(gemm_ex != nullptr, "linear_logp: cublasGemmEx not found in libcublas.so.", CUBLAS_VER_MAJOR,
           " (torch loads it on its first CUDA call; this build needs a torch built with CUDA ", CUBLAS_VER_MAJOR,
           ".x)");
  PK_CHECK(acc.stride(1) == 1, "linear_logp: addmm_f32 accumulator must be row-major, got strides [", acc.stride(0),
           ", ", acc.stride(1), "]");
  void* handle = nullptr;
  TORCH_ERROR_CODE_CHECK(torch_get_current_cuda_blas_handle(&handle));  // the current device's, on its current stream
  const cudaDataType_t type = a.scalar_type() == ScalarType::BFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  const Operand lhs = column_major(b), rhs = column_major(a);
  const int64_t m = acc.size(1), n = acc.size(0), k = a.size(1);
  const float alpha = 1.f;
  const cublasStatus_t status =
      gemm_ex(static_cast<cublasHandle_t>(handle), lhs.op, rhs.op, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), &alpha, lhs.data, type, static_cast<int>(lhs.ld), rhs.data, type,
              static_cast<int>(rhs.ld), &beta, acc.mutable_data_ptr(), CUDA_R_32F,
              static_cast<int>(std::max<int64_t>(acc.stride(0), m)), CUBLAS_COMPUTE_32F,
              CUBLAS_GEMM_DEFAULT_TENSOR_OP);
  PK_CHECK(status == CUBLAS_STATUS_SUCCESS, "linear_logp: cublasGemmEx failed with status ", static_cast<int>(status),
           " (", m, " x ", n, " x ", k, ")");
}

}  // namespace linear_logp_gemm
