// pk_example::residual_rmsnorm: the op schema and its CPU implementation (always built, so the op exists everywhere).
//   new_residual = x + residual                          (rounded to x's dtype)
//   y = new_residual * rsqrt(mean(new_residual^2, -1) + eps) * weight   (computed in fp32, stored in x's dtype)
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/core/Dispatch_v2.h>

#include <cmath>
#include <tuple>

#include "residual_rmsnorm.h"

namespace pk_example {
namespace {

std::tuple<Tensor, Tensor> residual_rmsnorm_cpu(Tensor x, Tensor residual, Tensor weight, double eps) {
  check_residual_rmsnorm_args(x, residual, weight, eps);
  PK_CHECK(x.is_cpu(), "residual_rmsnorm (CPU): x must be a CPU tensor, got ", pks::device(x));
  const auto x_c = pks::contiguous(x), r_c = pks::contiguous(residual),
             w_c = pks::contiguous(weight);
  auto y = pks::empty(x, x.sizes(), x.scalar_type());
  auto new_residual = pks::empty(x, x.sizes(), x.scalar_type());
  const int64_t hidden = x.size(x.dim() - 1);
  const int64_t rows = x.numel() / hidden;

  THO_DISPATCH_V2(x.scalar_type(), "residual_rmsnorm_cpu", AT_WRAP([&] {
    using opmath_t = pks::opmath_t<scalar_t>;  // float for float16/bfloat16/float32, double for float64
    const scalar_t* xp = x_c.const_data_ptr<scalar_t>();
    const scalar_t* rp = r_c.const_data_ptr<scalar_t>();
    const scalar_t* wp = w_c.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    scalar_t* np = new_residual.mutable_data_ptr<scalar_t>();
    torch::stable::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
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
  }), AT_EXPAND(AT_FLOATING_TYPES), ScalarType::Half, ScalarType::BFloat16);
  return {y, new_residual};
}

}  // namespace
}  // namespace pk_example

STABLE_TORCH_LIBRARY(pk_example, m) {
  m.def("residual_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(pk_example, CPU, m) {
  m.impl("residual_rmsnorm", TORCH_BOX(&pk_example::residual_rmsnorm_cpu));
}
