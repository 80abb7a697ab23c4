// What a stable-ABI kernel (kernel.toml: stable_abi = "X.Y") needs beyond torch/csrc/stable and torch/headeronly to
// keep the exact-ABI build's behaviour: argument checks whose messages read word for word as TORCH_CHECK's (torch's
// STD_TORCH_CHECK prefixes the function, file and line), tensors' shapes and devices printed as c10 prints them,
// at::opmath_type (which headeronly lacks), ATen's no-op shortcuts of contiguous() and to(dtype) (the stable ops always
// go through the dispatcher), the current CUDA stream and the SM count. Header-only on the stable C shim: nothing here
// binds the module to one torch.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <torch/headeronly/util/shim_utils.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace prime_kernels::stable {

// a.sizes() == b.sizes() (torch 2.11's IntHeaderOnlyArrayRef has no operator==).
inline bool same_sizes(const torch::stable::Tensor& a, const torch::stable::Tensor& b) {
  if (a.dim() != b.dim()) return false;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) != b.size(d)) return false;
  return true;
}

// "[2, 3, 64]", as c10 prints an IntArrayRef.
inline std::string shape(const torch::stable::Tensor& t) {
  std::ostringstream out;
  out << "[";
  for (int64_t d = 0; d < t.dim(); ++d) out << (d ? ", " : "") << t.size(d);
  out << "]";
  return out.str();
}

// A Tensor argument passed None arrives undefined, and every accessor of it then throws a sentence that names nothing:
// name the argument first.
inline void require_defined(const torch::stable::Tensor& t, const char* op, const char* argument) {
  if (!t.defined()) throw std::runtime_error(std::string(op) + ": " + argument + " must be a tensor, got None");
}

// t.scalar_type(), or Undefined for a dtype the stable ABI of this build has no name for (the sub-byte integers, dtypes
// newer than its floor): torch's conversion throws there, which would lose the name of the argument being checked.
inline torch::headeronly::ScalarType scalar_type(const torch::stable::Tensor& t) {
  try {
    return t.scalar_type();
  } catch (const std::runtime_error&) {
    return torch::headeronly::ScalarType::Undefined;
  }
}

// The dtype as c10 prints it ("Float"); for a dtype the stable ABI cannot name, its code in the C shim.
inline std::string dtype(const torch::stable::Tensor& t) {
  const auto type = scalar_type(t);
  if (type != torch::headeronly::ScalarType::Undefined) return torch::headeronly::toString(type);
  int32_t code = -1;
  aoti_torch_get_dtype(t.get(), &code);
  return "dtype code " + std::to_string(code) + " (a dtype the LibTorch stable ABI of this build does not name)";
}

// "cpu", "cuda:0", "meta", as c10 prints a tensor's device.
inline std::string device(const torch::stable::Tensor& t) {
  const auto where = t.device();
  std::string type;
  switch (where.type()) {
    case torch::headeronly::DeviceType::CPU: type = "cpu"; break;
    case torch::headeronly::DeviceType::CUDA: type = "cuda"; break;
    case torch::headeronly::DeviceType::Meta: type = "meta"; break;
    default: type = "device type " + std::to_string(static_cast<int>(where.type()));
  }
  return where.has_index() ? type + ":" + std::to_string(where.index()) : type;
}

// The type arithmetic on T runs in, as at::opmath_type: float for the 16-bit floats, T itself otherwise.
template <typename T>
struct OpMath {
  using type = T;
};
template <>
struct OpMath<torch::headeronly::Half> {
  using type = float;
};
template <>
struct OpMath<torch::headeronly::BFloat16> {
  using type = float;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

// at::empty(sizes, like.options().dtype(dtype)): a new contiguous tensor on like's device. Straight through the C shim's
// empty_strided, not torch::stable::empty's boxed dispatcher call (a few microseconds per output on every op call).
inline torch::stable::Tensor empty(const torch::stable::Tensor& like, torch::headeronly::IntHeaderOnlyArrayRef sizes,
                                   torch::headeronly::ScalarType dtype) {
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  int64_t strides[16];
  STD_TORCH_CHECK(ndim <= 16, "prime_kernels::stable::empty: at most 16 dimensions, got ", ndim);
  for (int64_t d = ndim - 1, step = 1; d >= 0; step *= std::max<int64_t>(sizes[d], 1), --d) strides[d] = step;
  int32_t device_type = 0, device_index = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  const int32_t shim_dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  AtenTensorHandle handle = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(ndim, sizes.data(), strides, shim_dtype, device_type,
                                                  device_index, &handle));
  return torch::stable::Tensor(handle);
}

// t.contiguous(): t itself when it is contiguous already, as at::Tensor::contiguous.
inline torch::stable::Tensor contiguous(const torch::stable::Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}

// t.to(dtype): t itself when it has that dtype already, as at::Tensor::to.
inline torch::stable::Tensor to(const torch::stable::Tensor& t, torch::headeronly::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : torch::stable::to(t, dtype);
}

template <typename... Args>
[[noreturn]] void fail(const Args&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  throw std::runtime_error(out.str());  // RuntimeError in Python, as c10::Error
}

}  // namespace prime_kernels::stable

// TORCH_CHECK for stable-ABI sources: the message is the arguments' concatenation, nothing more.
#define PK_CHECK(cond, ...)                                 \
  do {                                                      \
    if (!(cond)) ::prime_kernels::stable::fail(__VA_ARGS__); \
  } while (0)

#ifdef USE_CUDA
#include <cuda_runtime_api.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/macros.h>

#include <atomic>

namespace prime_kernels::stable {

// The stream torch runs its work on for device ``index`` (c10::cuda::getCurrentCUDAStream), through the C shim.
inline cudaStream_t current_cuda_stream(int32_t index) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(index, &stream));
  return static_cast<cudaStream_t>(stream);
}

// The SM count of device ``index`` (at::cuda::getCurrentDeviceProperties()->multiProcessorCount), asked of the runtime
// once per device (ATen caches its device properties likewise).
inline int multiprocessor_count(int32_t index) {
  constexpr int32_t kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices];  // 0: not asked yet
  const int cached = index < kMaxDevices ? counts[index].load(std::memory_order_relaxed) : 0;
  if (cached > 0) return cached;
  int sms = 0;
  STD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, index));
  if (index < kMaxDevices) counts[index].store(sms, std::memory_order_relaxed);
  return sms;
}

}  // namespace prime_kernels::stable
#endif  // USE_CUDA
