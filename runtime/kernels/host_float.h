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
