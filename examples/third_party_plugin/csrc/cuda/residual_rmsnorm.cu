// pk_example::residual_rmsnorm on CUDA: one block per row, fp32 (float64 for float64) math, x's dtype in memory.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/core/Dispatch_v2.h>

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
  using opmath_t = pks::opmath_t<scalar_t>;
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

// Outside the dispatch macro, whose body cannot hold the launch's unparenthesised commas.
template <typename scalar_t>
void launch(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& y, const Tensor& new_residual,
            int64_t rows, int64_t hidden, double eps, cudaStream_t stream) {
  residual_rmsnorm_kernel<scalar_t><<<static_cast<unsigned int>(rows), kBlockThreads, 0, stream>>>(
      x.const_data_ptr<scalar_t>(), residual.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
      y.mutable_data_ptr<scalar_t>(), new_residual.mutable_data_ptr<scalar_t>(), hidden, eps);
  STD_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<Tensor, Tensor> residual_rmsnorm_cuda(Tensor x, Tensor residual, Tensor weight, double eps) {
  check_residual_rmsnorm_args(x, residual, weight, eps);
  PK_CHECK(x.is_cuda(), "residual_rmsnorm (CUDA): x must be a CUDA tensor, got ", pks::device(x));
  const torch::stable::accelerator::DeviceGuard device_guard(x.get_device_index());
  const auto x_c = pks::contiguous(x), r_c = pks::contiguous(residual),
             w_c = pks::contiguous(weight);
  auto y = pks::empty(x, x.sizes(), x.scalar_type());
  auto new_residual = pks::empty(x, x.sizes(), x.scalar_type());
  const int64_t hidden = x.size(x.dim() - 1);
  const int64_t rows = x.numel() / hidden;
  if (rows == 0) return {y, new_residual};
  PK_CHECK(rows <= INT_MAX, "residual_rmsnorm (CUDA): at most ", INT_MAX, " rows (one block each), got ", rows);
  const cudaStream_t stream = pks::current_cuda_stream(x.get_device_index());

  THO_DISPATCH_V2(x.scalar_type(), "residual_rmsnorm_cuda", AT_WRAP([&] {
    launch<scalar_t>(x_c, r_c, w_c, y, new_residual, rows, hidden, eps, stream);
  }), AT_EXPAND(AT_FLOATING_TYPES), ScalarType::Half, ScalarType::BFloat16);
  return {y, new_residual};
}

}  // namespace
}  // namespace pk_example

STABLE_TORCH_LIBRARY_IMPL(pk_example, CUDA, m) {
  m.impl("residual_rmsnorm", TORCH_BOX(&pk_example::residual_rmsnorm_cuda));
}
