// Element conversions shared by the host kernels. The ATen headers are the few the kernels use: all of
// <torch/extension.h> takes four times as long to parse, most of a kernel's build.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

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

// f rounded to T's precision, as a float (PyTorch's rounding of an intermediate result held in T).
template <typename T>
static inline float rounded(float f) {
  return to_float(from_float<T>(f));
}

// run(T{}) for T the float32 or bfloat16 element type of `type` (the kernels' callers check it is one of them).
template <typename F>
static inline void dispatch_float_or_bfloat16(at::ScalarType type, F run) {
  if (type == at::kFloat)
    run(float{});
  else
    run(at::BFloat16{});
}

// exp(x) for x <= 0 as 2^i * 2^f: i = floor(x / ln 2), the remainder x - i ln 2 taken in two parts (Cody-Waite,
// so large |x| keeps its precision), 2^f by a degree-6 polynomial fitted for relative error: within 1.5e-7 of exp
// over [-87, 0], 0 below (where float's normal range ends), NaN for NaN; libm's expf would not vectorise (the
// softmax's and SiLU's hot loops).
constexpr float kLog2e = 1.44269504089f, kLn2High = 0.693145751953125f, kLn2Low = 1.428606820309417e-6f;
constexpr float kExp2[] = {0.000215405089f, 0.00124828820f, 0.00967454631f, 0.0554853231f, 0.240229398f,
                           0.693147004f, 1.f};

static inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.f;  // false for NaN
  const float y = underflow ? -87.f : x;
  const float i = std::floor(y * kLog2e), f = (y - i * kLn2High - i * kLn2Low) * kLog2e;
  float p = kExp2[0];
  for (int k = 1; k < 7; ++k) p = p * f + kExp2[k];
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return underflow ? 0.f : p * scale;
}

#if defined(__AVX512F__)
#include <immintrin.h>

// exp_nonpositive on 16 lanes.
static inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);  // false for NaN
  x = _mm512_mask_mov_ps(x, underflow, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(i, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(i, _mm512_set1_ps(kLn2High), x));
  const __m512 f = _mm512_mul_ps(r, _mm512_set1_ps(kLog2e));
  __m512 p = _mm512_set1_ps(kExp2[0]);
  for (int k = 1; k < 7; ++k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2[k]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(i), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p, _mm512_castsi512_ps(bits));
}

// 16 elements as floats.
static inline __m512 load_floats(const float* x) { return _mm512_loadu_ps(x); }
static inline __m512 load_floats(const at::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline __m512 load_floats(const at::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// 16 floats rounded to T's precision (nearest even; NaNs stay NaNs), as floats.
template <typename T>
static inline __m512 round_floats(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    static_assert(std::is_same_v<T, at::BFloat16>, "float or bfloat16");
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    const __m512i kept = _mm512_and_si512(up, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(kept, nan, _mm512_set1_epi32(0x7FC00000)));
  }
}

// Stores 16 floats as T, rounded to nearest even.
static inline void store_floats(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
static inline void store_floats(at::BFloat16* out, __m512 v) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_floats<at::BFloat16>(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(bits));
}
#endif
