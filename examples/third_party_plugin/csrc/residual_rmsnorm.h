// Shared by the CPU and CUDA implementations of pk_example::residual_rmsnorm: the argument checks.
#pragma once

#include <ATen/ATen.h>

namespace pk_example {

// Every failure names the argument, what is needed and what was found.
inline void check_residual_rmsnorm_args(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                        double eps) {
  TORCH_CHECK(x.dim() >= 1, "residual_rmsnorm: x must have at least 1 dimension [..., D], got a 0-d tensor");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(hidden > 0, "residual_rmsnorm: x's last dimension (the hidden size D) must be positive, got ", hidden);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
              "residual_rmsnorm: x must be float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual_rmsnorm: residual must have x's shape ", x.sizes(), ", got ",
              residual.sizes());
  TORCH_CHECK(residual.scalar_type() == dtype, "residual_rmsnorm: residual must have x's dtype ", dtype, ", got ",
              residual.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "residual_rmsnorm: weight must have shape [", hidden,
              "] (x's last dimension), got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == dtype, "residual_rmsnorm: weight must have x's dtype ", dtype, ", got ",
              weight.scalar_type());
  TORCH_CHECK(residual.device() == x.device(), "residual_rmsnorm: residual must be on x's device ", x.device(),
              ", got ", residual.device());
  TORCH_CHECK(weight.device() == x.device(), "residual_rmsnorm: weight must be on x's device ", x.device(), ", got ",
              weight.device());
  TORCH_CHECK(eps >= 0.0, "residual_rmsnorm: eps must be non-negative, got ", eps);
}

}  // namespace pk_example
