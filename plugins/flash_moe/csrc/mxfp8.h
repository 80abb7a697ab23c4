// mxfp8 (OCP MX: e4m3 elements, one e8m0 power-of-two scale per MXFP8_SCALE_BLOCK consecutive elements) numerics
// shared by the CPU and CUDA code, so that every path quantizes bit-identically.
//
// Scale of a block with amax = max |v| (fp32): the smallest power of two 2^e with amax / 2^e <= 448 (e4m3's largest
// finite value), i.e. e = ceil(log2(amax / 448)) in exact arithmetic (torchao's RCEIL rule, evaluated on the bits with
// no rounding of amax / 448), clamped below to e8m0's smallest scale 2^-127 (biased byte 0). amax = 0 (and any amax
// below 448 * 2^-127, fp32 subnormals included) gives that smallest scale. A block holding Inf or NaN gets the e8m0
// NaN byte 0xFF and NaN elements (0x7F). Elements: round-to-nearest-even of v * 2^-e to e4m3, saturated to +-448
// (v * 2^-e is exact in fp32, so there is a single rounding).
//
// Shared exponents (the Hopper kernels' fast path): a group of consecutive blocks may carry one scale, the largest of
// theirs (NaN if any is), each element of a block with a smaller scale re-rounded (RNE) onto the larger one: still an
// mxfp8 encoding (one scale per block, the blocks' scales equal). Only elements below e4m3's normal range at the
// shared scale (|v| < 2^-6 * 2^e) lose bits, by at most half of the subnormal step 2^-9 * 2^e.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>

namespace flash_moe {
namespace mx {

constexpr uint32_t kNanScale = 0xFF;
constexpr uint8_t kNanElement = 0x7F;

// Biased e8m0 scale byte for a block whose largest magnitude has fp32 bits `amax_bits` (sign bit clear; the largest
// of |v| compared as unsigned bits, so NaN and Inf dominate).
C10_HOST_DEVICE inline uint32_t scale_byte(uint32_t amax_bits) {
  const uint32_t exp = amax_bits >> 23, mant = amax_bits & 0x7FFFFFu;
  if (exp == 0xFFu) return kNanScale;
  if (exp == 0u) return 0u;  // zero or subnormal amax: e would be below -127
  // amax = 1.m * 2^(exp-127); 448 = 1.75 * 2^8: amax / 448 <= 2^e  <=>  e >= exp - 135 (+1 when 1.m > 1.75)
  const int e = static_cast<int>(exp) - 135 + (mant > 0x600000u ? 1 : 0);
  return e < -127 ? 0u : static_cast<uint32_t>(e + 127);  // e <= 120 for finite fp32: no upper clamp is reached
}

// fp32 bits of 2^-e, the factor that maps a block onto e4m3 (b = biased scale byte, not NaN).
C10_HOST_DEVICE inline uint32_t inv_scale_bits(uint32_t b) {
  return b <= 253u ? (253u - b + 1u) << 23 : 0x00400000u;  // 2^(127 - b); b = 254 gives the subnormal 2^-127
}

// fp32 bits of the scale 2^(b - 127) (b = 0 is the subnormal 2^-127; 255 is NaN).
C10_HOST_DEVICE inline uint32_t scale_bits(uint32_t b) {
  return b == 0u ? 0x00400000u : (b == 255u ? 0x7FC00000u : b << 23);
}

// Re-rounding onto a scale 2^d larger: |q| * 2^-d < 2^-10 (half the smallest e4m3 subnormal) once d >= this, a
// signed zero (448 * 2^-19 < 2^-10).
constexpr uint32_t kShareFlushShift = 19;

// An element of a block with scale byte `b`, re-rounded onto the group's shared scale byte `shared` >= b (not NaN).
C10_HOST_DEVICE inline uint8_t share_element(uint8_t q, uint32_t b, uint32_t shared) {
  const uint32_t d = shared - b;
  if (d == 0u || (q & 0x7Fu) == kNanElement) return q;
  if (d >= kShareFlushShift) return q & 0x80u;
  const float v = static_cast<float>(c10::Float8_e4m3fn(q, c10::Float8_e4m3fn::from_bits()));
  return c10::Float8_e4m3fn(v / static_cast<float>(1u << d)).x;  // exact quotient (a power of two), one rounding
}

}  // namespace mx
}  // namespace flash_moe
