// Element conversions shared by the host kernels.
#pragma once
#include <torch/extension.h>

#include <cstring>

static inline float to_float(float x) { return x; }
static inline float to_float(at::Half x) { return static_cast<float>(x); }
static inline float to_float(at::BFloat16 x) {  // a shift, so loops over it vectorise
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> T rounded to nearest even, as PyTorch converts; for bf16 in integer arithmetic, so loops vectorise
template <typename T>
static inline T from_float(float f) {
  return static_cast<T>(f);
}
template <>
inline at::BFloat16 from_float<at::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = f != f ? 0x7FC00000u : bits + 0x7FFFu + ((bits >> 16) & 1u);
  at::BFloat16 out;
  out.x = static_cast<uint16_t>(rounded >> 16);
  return out;
}
