// pk_example::residual_rmsnorm: the op schema and its CPU implementation (always built, so the op exists everywhere).
//   new_residual = x + residual                          (rounded to x's dtype)
//   y = new_residual * rsqrt(mean(new_residual^2, -1) + eps) * weight   (computed in fp32, stored in x's dtype)
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "residual_rmsnorm.h"

namespace pk_example {
namespace {

std::tuple<at::Tensor, at::Tensor> residual_rmsnorm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                        const at::Tensor& weight, double eps) {
  check_residual_rmsnorm_args(x, residual, weight, eps);
  TORCH_CHECK(x.device().is_cpu(), "residual_rmsnorm (CPU): x must be a CPU tensor, got ", x.device());
  const auto x_c = x.contiguous(), r_c = residual.contiguous(), w_c = weight.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  auto new_residual = at::empty(x.sizes(), x.options());
  const int64_t hidden = x.size(-1);
  const int64_t rows = x.numel() / hidden;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "residual_rmsnorm_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;  // float for float16/bfloat16/float32, double for float64
    const scalar_t* xp = x_c.const_data_ptr<scalar_t>();
    const scalar_t* rp = r_c.const_data_ptr<scalar_t>();
    const scalar_t* wp = w_c.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    scalar_t* np = new_residual.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t base = row * hidden;
        double sum_sq = 0.0;  // a double accumulator keeps a long row's sum as accurate as PyTorch's pairwise mean
        for (int64_t i = 0; i < hidden; ++i) {
          const scalar_t h = static_cast<scalar_t>(static_cast<opmath_t>(xp[base + i]) + static_cast<opmath_t>(rp[base + i]));
          np[base + i] = h;
          const double hv = static_cast<double>(h);
          sum_sq += hv * hv;
        }
        const opmath_t rstd = static_cast<opmath_t>(1.0 / std::sqrt(sum_sq / static_cast<double>(hidden) + eps));
        for (int64_t i = 0; i < hidden; ++i) {
          yp[base + i] = static_cast<scalar_t>(static_cast<opmath_t>(np[base + i]) * rstd * static_cast<opmath_t>(wp[i]));
        }
      }
    });
  });
  return {y, new_residual};
}

}  // namespace
}  // namespace pk_example

TORCH_LIBRARY(pk_example, m) {
  m.def("residual_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pk_example, CPU, m) { m.impl("residual_rmsnorm", &pk_example::residual_rmsnorm_cpu); }
