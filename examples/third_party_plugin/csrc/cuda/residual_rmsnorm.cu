// pk_example::residual_rmsnorm on CUDA: one block per row, fp32 (float64 for float64) math, x's dtype in memory.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>
#include <tuple>

#include "../residual_rmsnorm.h"

// Set by the build kit from kernel.toml's [residual_rmsnorm.constants] BLOCK_THREADS.
#ifndef RESIDUAL_RMSNORM_BLOCK_THREADS
#error "RESIDUAL_RMSNORM_BLOCK_THREADS is not defined: build with prime_kernels_core.build (it reads kernel.toml)"
#endif

namespace pk_example {
namespace {

constexpr int kBlockThreads = RESIDUAL_RMSNORM_BLOCK_THREADS;
constexpr int kWarpSize = 32;
static_assert(kBlockThreads % kWarpSize == 0 && kBlockThreads >= kWarpSize && kBlockThreads <= 1024,
              "BLOCK_THREADS must be a multiple of 32 between 32 and 1024");

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads)
    residual_rmsnorm_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ residual,
                            const scalar_t* __restrict__ weight, scalar_t* __restrict__ y,
                            scalar_t* __restrict__ new_residual, int64_t hidden, double eps) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * hidden;

  // Pass 1: new_residual = x + residual (rounded to scalar_t, as the unfused path would store it); sum of squares.
  opmath_t sum_sq = 0;
  for (int64_t i = threadIdx.x; i < hidden; i += kBlockThreads) {
    const scalar_t h = static_cast<scalar_t>(static_cast<opmath_t>(x[base + i]) + static_cast<opmath_t>(residual[base + i]));
    new_residual[base + i] = h;
    const opmath_t hv = static_cast<opmath_t>(h);
    sum_sq += hv * hv;
  }

  // Block reduction: within each warp, then across the warps' partial sums.
  __shared__ opmath_t warp_sums[kBlockThreads / kWarpSize];
  __shared__ opmath_t rstd_shared;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  sum_sq = warp_sum(sum_sq);
  if (lane == 0) warp_sums[warp] = sum_sq;
  __syncthreads();
  if (warp == 0) {
    opmath_t total = lane < kBlockThreads / kWarpSize ? warp_sums[lane] : opmath_t(0);
    total = warp_sum(total);
    if (lane == 0) rstd_shared = opmath_t(1) / sqrt(total / static_cast<opmath_t>(hidden) + static_cast<opmath_t>(eps));
  }
  __syncthreads();
  const opmath_t rstd = rstd_shared;

  // Pass 2: each thread rereads the new_residual elements it wrote itself, so no further synchronisation is needed.
  for (int64_t i = threadIdx.x; i < hidden; i += kBlockThreads) {
    y[base + i] = static_cast<scalar_t>(static_cast<opmath_t>(new_residual[base + i]) * rstd *
                                        static_cast<opmath_t>(weight[i]));
  }
}

std::tuple<at::Tensor, at::Tensor> residual_rmsnorm_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                         const at::Tensor& weight, double eps) {
  check_residual_rmsnorm_args(x, residual, weight, eps);
  TORCH_CHECK(x.is_cuda(), "residual_rmsnorm (CUDA): x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard device_guard(x.device());
  const auto x_c = x.contiguous(), r_c = residual.contiguous(), w_c = weight.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  auto new_residual = at::empty(x.sizes(), x.options());
  const int64_t hidden = x.size(-1);
  const int64_t rows = x.numel() / hidden;
  if (rows == 0) return {y, new_residual};
  TORCH_CHECK(rows <= INT_MAX, "residual_rmsnorm (CUDA): at most ", INT_MAX, " rows (one block each), got ", rows);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "residual_rmsnorm_cuda", [&] {
    residual_rmsnorm_kernel<scalar_t><<<static_cast<unsigned int>(rows), kBlockThreads, 0, stream>>>(
        x_c.const_data_ptr<scalar_t>(), r_c.const_data_ptr<scalar_t>(), w_c.const_data_ptr<scalar_t>(),
        y.mutable_data_ptr<scalar_t>(), new_residual.mutable_data_ptr<scalar_t>(), hidden, eps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, new_residual};
}

}  // namespace
}  // namespace pk_example

TORCH_LIBRARY_IMPL(pk_example, CUDA, m) { m.impl("residual_rmsnorm", &pk_example::residual_rmsnorm_cuda); }
