// The schema, the CPU implementation and the CUDA entry point of pk_arch_variants::scale. The CUDA entry point picks
// the launcher of whichever source set has code for the tensor's device: each launcher exists only when its source
// set was compiled (weak symbols), and returns false when its code does not run on the current device.
#include <torch/library.h>
#include <ATen/ATen.h>

bool scale_sm90a(at::Tensor& out, const at::Tensor& x, double factor) __attribute__((weak));
bool scale_generic(at::Tensor& out, const at::Tensor& x, double factor) __attribute__((weak));

namespace {

void check_args(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "pk_arch_variants::scale: x must be float32, found ", x.scalar_type());
}

at::Tensor scale_cpu(const at::Tensor& x, double factor) {
  check_args(x);
  return x.contiguous() * factor;
}

at::Tensor scale_cuda(const at::Tensor& x, double factor) {
  check_args(x);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  for (auto launch : {scale_sm90a, scale_generic}) {
    if (launch && launch(out, x.contiguous(), factor)) return out;
  }
  TORCH_CHECK(false, "pk_arch_variants::scale: this build has no CUDA code for the device of x (", x.device(), ")");
}

}  // namespace

TORCH_LIBRARY(pk_arch_variants, m) { m.def("scale(Tensor x, float factor) -> Tensor"); }
TORCH_LIBRARY_IMPL(pk_arch_variants, CPU, m) { m.impl("scale", &scale_cpu); }
TORCH_LIBRARY_IMPL(pk_arch_variants, CUDA, m) { m.impl("scale", &scale_cuda); }
