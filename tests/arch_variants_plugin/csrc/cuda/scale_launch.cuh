// The launcher both source sets share: it launches `kernel` when the CUDA runtime has code of it for the current
// device, else returns false (cudaFuncGetAttributes fails for a kernel without a cubin for the device).
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

template <typename Kernel>
bool launch_if_compiled(Kernel kernel, at::Tensor& out, const at::Tensor& x, double factor) {
  const c10::cuda::CUDAGuard guard(x.device());
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the lookup's error: the other source set may serve this device
    return false;
  }
  const int64_t n = x.numel();
  const int blocks = static_cast<int>(std::min<int64_t>((n + ARCH_VARIANTS_BLOCK_THREADS - 1) / ARCH_VARIANTS_BLOCK_THREADS, 65535));
  if (n > 0) {
    kernel<<<blocks, ARCH_VARIANTS_BLOCK_THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(
        out.data_ptr<float>(), x.data_ptr<float>(), static_cast<float>(factor), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return true;
}
