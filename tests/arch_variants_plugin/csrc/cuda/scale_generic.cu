// The generic source set: compiled for every arch of the kernel without a variant (8.0, 12.0), never for 9.0a.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "scale_generic.cu was compiled for 9.0a, which has its own source set (scale_sm90a.cu)"
#endif
#include "scale_launch.cuh"

__global__ void scale_generic_kernel(float* out, const float* x, float factor, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = x[i] * factor;
}

bool scale_generic(at::Tensor& out, const at::Tensor& x, double factor) {
  return launch_if_compiled(scale_generic_kernel, out, x, factor);
}
