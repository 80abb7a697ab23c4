// flash_moe::swiglu_backward on CUDA: one pass over the recomputed gate/up pre-activations and grad_h of the routed
// slots (the elementwise middle of moe()'s closed-form backward), one CTA per row, 16-byte loads and stores, the row
// dot product reduced in the CTA. Same formulas as the CPU implementation (flash_moe.cpp), in fp32.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include "../flash_moe.h"
#include "bf16x8.cuh"

namespace flash_moe {
namespace {

constexpr int kMaxThreads = 256;

__global__ void __launch_bounds__(kMaxThreads)
    swiglu_backward_kernel(const uint4* __restrict__ gate_up, const uint4* __restrict__ grad_h,
                           const float* __restrict__ row_weights, const bool* __restrict__ valid, int64_t vecs,
                           uint4* __restrict__ grad_gate, uint4* __restrict__ grad_up, uint4* __restrict__ weighted_h,
                           float* __restrict__ grad_row_weights) {
  __shared__ float warp_dots[kMaxThreads / 32];
  const int64_t row = blockIdx.x;
  const bool ok = valid[row];
  const float p = ok ? row_weights[row] : 0.f;
  const uint4* g_row = gate_up + row * 2 * vecs;
  const uint4* d_row = grad_h + row * vecs;
  uint4* dg_row = grad_gate + row * vecs;
  uint4* du_row = grad_up + row * vecs;
  uint4* ph_row = weighted_h + row * vecs;
  float dot = 0.f;
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
    float g[kVec], u[kVec], d[kVec], dg[kVec], du[kVec], ph[kVec];
    unpack8(g_row[v], g);
    unpack8(g_row[vecs + v], u);
    unpack8(d_row[v], d);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float sig = 1.f / (1.f + expf(-g[i]));
      const float a = g[i] * sig;
      const float h = a * u[i];
      const float d0 = ok ? d[i] : 0.f;  // rows past the routed ones may hold anything
      dot += d0 * h;
      const float dh = d0 * p;
      // selected, not multiplied by a zero dh: an invalid row's g | u may hold NaN or inf too
      du[i] = ok ? dh * a : 0.f;
      dg[i] = ok ? dh * u[i] * sig * (1.f + g[i] * (1.f - sig)) : 0.f;
      ph[i] = ok ? p * h : 0.f;
    }
    dg_row[v] = pack8(dg);
    du_row[v] = pack8(du);
    ph_row[v] = pack8(ph);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, off);
  if ((threadIdx.x & 31) == 0) warp_dots[threadIdx.x >> 5] = dot;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += warp_dots[w];
    grad_row_weights[row] = ok ? total : 0.f;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& gate_up,
                                                                    const at::Tensor& grad_h,
                                                                    const at::Tensor& row_weights,
                                                                    const at::Tensor& valid) {
  const int64_t hidden = check_swiglu_backward_args(gate_up, grad_h, row_weights, valid);
  TORCH_CHECK(gate_up.is_cuda(), "swiglu_backward (CUDA): gate_up must be a CUDA tensor, got ", gate_up.device());
  TORCH_CHECK(hidden % kVec == 0, "swiglu_backward (CUDA): the hidden size must be a multiple of ", kVec,
              " (16-byte rows), got ", hidden);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const auto gu = gate_up.contiguous(), gh = grad_h.contiguous(), pw = row_weights.contiguous();
  const auto ok = valid.contiguous();
  const int64_t rows = gu.size(0);
  auto grad_gate = at::empty_like(gh), grad_up = at::empty_like(gh), weighted_h = at::empty_like(gh);
  auto grad_row_weights = at::empty({rows}, pw.options());
  if (rows == 0 || hidden == 0) return {grad_gate, grad_up, weighted_h, grad_row_weights.zero_()};
  const int64_t vecs = hidden / kVec;
  const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, (vecs + 31) / 32 * 32));
  swiglu_backward_kernel<<<static_cast<unsigned>(rows), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(gu.const_data_ptr()), reinterpret_cast<const uint4*>(gh.const_data_ptr()),
      pw.const_data_ptr<float>(), ok.const_data_ptr<bool>(), vecs,
      reinterpret_cast<uint4*>(grad_gate.mutable_data_ptr()), reinterpret_cast<uint4*>(grad_up.mutable_data_ptr()),
      reinterpret_cast<uint4*>(weighted_h.mutable_data_ptr()),
      grad_row_weights.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {grad_gate, grad_up, weighted_h, grad_row_weights};
}

}  // namespace
}  // namespace flash_moe

TORCH_LIBRARY_IMPL(flash_moe, CUDA, m) { m.impl("swiglu_backward", &flash_moe::swiglu_backward_cuda); }
