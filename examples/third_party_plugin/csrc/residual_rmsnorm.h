// Shared by the CPU and CUDA implementations of pk_example::residual_rmsnorm: the argument checks, on the LibTorch
// stable ABI (kernel.toml: stable_abi), so that one build runs on every torch from its floor on.
#pragma once

#include <prime_kernels/stable.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

namespace pk_example {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;
namespace pks = prime_kernels::stable;

// Every failure names the argument, what is needed and what was found.
inline void check_residual_rmsnorm_args(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  pks::require_defined(x, "residual_rmsnorm", "x");
  pks::require_defined(residual, "residual_rmsnorm", "residual");
  pks::require_defined(weight, "residual_rmsnorm", "weight");
  PK_CHECK(x.dim() >= 1, "residual_rmsnorm: x must have at least 1 dimension [..., D], got a 0-d tensor");
  const int64_t hidden = x.size(x.dim() - 1);
  PK_CHECK(hidden > 0, "residual_rmsnorm: x's last dimension (the hidden size D) must be positive, got ", hidden);
  const auto dtype = pks::scalar_type(x);
  PK_CHECK(dtype == ScalarType::Float || dtype == ScalarType::Double || dtype == ScalarType::Half ||
               dtype == ScalarType::BFloat16,
           "residual_rmsnorm: x must be float32, float64, float16 or bfloat16, got ", pks::dtype(x));
  PK_CHECK(pks::same_sizes(residual, x), "residual_rmsnorm: residual must have x's shape ", pks::shape(x), ", got ",
           pks::shape(residual));
  PK_CHECK(pks::scalar_type(residual) == dtype, "residual_rmsnorm: residual must have x's dtype ", pks::dtype(x),
           ", got ", pks::dtype(residual));
  PK_CHECK(weight.dim() == 1 && weight.size(0) == hidden, "residual_rmsnorm: weight must have shape [", hidden,
           "] (x's last dimension), got ", pks::shape(weight));
  PK_CHECK(pks::scalar_type(weight) == dtype, "residual_rmsnorm: weight must have x's dtype ", pks::dtype(x),
           ", got ", pks::dtype(weight));
  PK_CHECK(residual.device() == x.device(), "residual_rmsnorm: residual must be on x's device ", pks::device(x),
           ", got ", pks::device(residual));
  PK_CHECK(weight.device() == x.device(), "residual_rmsnorm: weight must be on x's device ", pks::device(x), ", got ",
           pks::device(weight));
  PK_CHECK(eps >= 0.0, "residual_rmsnorm: eps must be non-negative, got ", eps);
}

}  // namespace pk_example
