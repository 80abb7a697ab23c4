// The 9.0a source set: compiled for 9.0a only (it may use Hopper-only instructions; the kit never gives it another arch).
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "scale_sm90a.cu was compiled for an arch other than 9.0a"
#endif
#include "scale_launch.cuh"

__global__ void scale_sm90a_kernel(float* out, const float* x, float factor, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __fmul_rn(x[i], factor);
}

bool scale_sm90a(at::Tensor& out, const at::Tensor& x, double factor) {
  return launch_if_compiled(scale_sm90a_kernel, out, x, factor);
}
