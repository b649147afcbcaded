// float8 e4m3fn to float32, shared by the decode kernel (an fp8 KV cache) and the matmul (fp8
// weights).
#pragma once

#include <cstdint>

namespace paged_jax_native {

// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, and NaN (0x7f, 0xff)
// never stored (the quantizers clip to +-448). Both cases are computed and one is picked with a bit
// mask: GCC does not vectorise the loops over a ternary here (7x slower). Subnormals go through an
// integer conversion, not a float32 subnormal (which XLA's flush-to-zero would read as 0).
inline float Fp8E4M3ToFloat(uint8_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80u) << 24, mag = bits & 0x7fu;
  const uint32_t normal = (mag << 20) + (120u << 23);                                              // rebias 7 -> 127
  const uint32_t subnormal = __builtin_bit_cast(uint32_t, static_cast<float>(mag) * 0x1p-9f);  // m / 8 * 2^-6
  const uint32_t is_normal = 0u - static_cast<uint32_t>(mag >= 8);                             // all ones or 0
  return __builtin_bit_cast(float, (normal & is_normal) | (subnormal & ~is_normal) | sign);
}

}  // namespace paged_jax_native
