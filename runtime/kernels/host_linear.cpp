// Linear with int8, fp8 (e4m3), float32, bf16 or fp16 weights for a few rows of activations (decode), host only.
//
// out[m, n] = sum_g scale[n, g] * sum_{k in group g} x[m, k] * w[n, k] + bias[n], with w [N, K] and float
// scales [N, G] over G groups of K / G columns (G = 1: one scale per output channel; none for float weights). x is
// converted to float once, each weight exactly to float, and the products are summed in float, so the only
// difference from the dequantized float product is the order of the sums (bf16 with AVX512_BF16 sums the exact
// products of x and w as they are, subnormals flushed to zero). Four weight rows are done per pass (four
// independent FMA chains sharing each load of x), and the next pass's rows are prefetched: decode reads the
// weights from memory once per step, and without the prefetch the loop waits on it.
#include <torch/extension.h>  // a Python module: pybind11 and its tensor casters

#include "host_float.h"

#include <ATen/Dispatch_v2.h>

#include <algorithm>
#include <vector>

constexpr int64_t ROWS = 4;
constexpr int64_t AHEAD = 4;  // passes between a prefetch and the pass that reads it

struct Fp8 {  // float8_e4m3fn bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities
  uint8_t bits;
};

static inline float weight_value(int8_t w) { return static_cast<float>(w); }
static inline float weight_value(float w) { return w; }
static inline float weight_value(at::BFloat16 w) { return to_float(w); }
static inline float weight_value(at::Half w) { return to_float(w); }
static inline float weight_value(Fp8 w) {
  const uint32_t bits = (static_cast<uint32_t>(w.bits & 0x7F) << 20) | (static_cast<uint32_t>(w.bits & 0x80) << 24);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * 0x1p120f;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// e4m3 bits moved into a float's exponent and mantissa fields make 2^-120 times the value, subnormals included
// (as float subnormals); one exact multiply rescales
static inline __m256 load8(const Fp8* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(magnitude, sign)), _mm256_set1_ps(0x1p120f));
}

// bf16 is the upper half of a float
static inline __m256 load8(const at::BFloat16* p) {
  const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
}

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// dot products of x[0, len) with ROWS weight rows `stride` apart
template <typename W>
static inline void dot_rows(const float* x, const W* w, int64_t len, int64_t stride, float* acc) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 8 <= len; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    a0 = _mm256_fmadd_ps(xv, load8(w + k), a0);
    a1 = _mm256_fmadd_ps(xv, load8(w + stride + k), a1);
    a2 = _mm256_fmadd_ps(xv, load8(w + 2 * stride + k), a2);
    a3 = _mm256_fmadd_ps(xv, load8(w + 3 * stride + k), a3);
  }
  acc[0] = hsum(a0), acc[1] = hsum(a1), acc[2] = hsum(a2), acc[3] = hsum(a3);
  for (; k < len; ++k)
    for (int64_t r = 0; r < ROWS; ++r) acc[r] += x[k] * weight_value(w[r * stride + k]);
}
#else
template <typename W>
static inline void dot_rows(const float* x, const W* w, int64_t len, int64_t stride, float* acc) {
  for (int64_t r = 0; r < ROWS; ++r) {
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int64_t k = 0; k < len; ++k) a += x[k] * weight_value(w[r * stride + k]);
    acc[r] = a;
  }
}
#endif

// body(n0, rows) for each pass of up to ROWS rows of a weight [N, K] of `bytes`-byte elements, the passes split
// across threads, each thread prefetching the rows of its pass AHEAD passes on
template <typename F>
static void for_each_pass(const void* w, int64_t N, int64_t K, int64_t bytes, F body) {
  const int64_t passes = (N + ROWS - 1) / ROWS;
  at::parallel_for(0, passes, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * ROWS;
      if (p + AHEAD < end) {
        const char* next = static_cast<const char*>(w) + (n0 + AHEAD * ROWS) * K * bytes;
        for (int64_t off = 0; off < ROWS * K * bytes; off += 64) __builtin_prefetch(next + off);
      }
      body(n0, std::min(ROWS, N - n0));
    }
  });
}

template <typename T, typename W>
static void quantized_gemv(const T* xt, const W* w, const float* scale, const T* bias, T* out, int64_t M,
                           int64_t N, int64_t K, int64_t G) {
  const int64_t group = K / G;
  std::vector<float> xf;  // x in float, where it is not already
  const float* x = reinterpret_cast<const float*>(xt);
  if constexpr (!std::is_same_v<T, float>) {
    xf.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(xt[i]);
    x = xf.data();
  }
  for_each_pass(w, N, K, sizeof(W), [&](int64_t n0, int64_t rows) {
    for (int64_t m = 0; m < M; ++m) {
      float acc[ROWS] = {0.f, 0.f, 0.f, 0.f}, part[ROWS];
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x + m * K + g * group;
        const W* wg = w + n0 * K + g * group;
        if (rows == ROWS) {
          dot_rows(xg, wg, group, K, part);
        } else {
          for (int64_t r = 0; r < rows; ++r) {
            part[r] = 0.f;
            for (int64_t k = 0; k < group; ++k) part[r] += xg[k] * weight_value(wg[r * K + k]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) acc[r] += scale ? part[r] * scale[(n0 + r) * G + g] : part[r];
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = n0 + r;
        out[m * N + n] = static_cast<T>(acc[r] + (bias ? to_float(bias[n]) : 0.f));
      }
    }
  });
}

// x [.., K] as contiguous rows, the output rows to fill and the bias in x's dtype, for a weight [N, K]
struct Product {
  torch::Tensor rows, out, bias;
  int64_t N, K;

  Product(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& b)
      : N(weight.size(0)), K(weight.size(1)) {
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight: contiguous [N, K]");
    TORCH_CHECK(x.size(-1) == K, "x's last dimension must be the weight's input size");
    rows = x.reshape({-1, K}).contiguous();
    out = torch::empty({rows.size(0), N}, x.options());
    if (b) {
      bias = b->to(x.scalar_type()).contiguous();
      TORCH_CHECK(bias.numel() == N, "bias: one value per output channel");
    }
  }

  template <typename T>
  const T* bias_ptr() const { return bias.defined() ? bias.data_ptr<T>() : nullptr; }

  torch::Tensor shaped(const torch::Tensor& x) const {
    auto shape = x.sizes().vec();
    shape.back() = N;
    return out.view(shape);
  }
};

template <typename W>
static torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale,
                                      c10::optional<torch::Tensor> bias) {
  const Product p(x, weight, bias);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
              scale.size(0) == p.N && p.K % scale.size(1) == 0,
              "scale: contiguous float32 [N, G], G dividing the input size");
  const W* w = reinterpret_cast<const W*>(weight.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantized_linear", [&] {
    quantized_gemv<scalar_t, W>(p.rows.data_ptr<scalar_t>(), w, scale.data_ptr<float>(), p.bias_ptr<scalar_t>(),
                                p.out.data_ptr<scalar_t>(), p.rows.size(0), p.N, p.K, scale.size(1));
  });
  return p.shaped(x);
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.scalar_type() == torch::kChar, "weight: int8");
  return quantized_linear<int8_t>(x, weight, scale, bias);
}

torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale,
                         c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, "weight: float8_e4m3fn");
  return quantized_linear<Fp8>(x, weight, scale, bias);
}

#if defined(__AVX512BF16__)
// bf16 pairs multiplied and summed into float lanes (vdpbf16ps), the last K % 32 columns through a masked load; a
// pass takes four weight rows as quantized_gemv does, so each load of x serves four independent chains. Reads the
// weight at the memory's bandwidth for one row (a SmolLM2 decode step's layers: 4.0 ms against 5.3 ms for
// oneDNN's prepacked one-row products on an AMD EPYC with AVX512_BF16, 2 threads).
#include <immintrin.h>

static inline __m512bh load32(const at::BFloat16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// dot products of x[0, K) with R weight rows K apart
template <int64_t R>
static inline void dot_rows_bf16(const at::BFloat16* x, const at::BFloat16* w, int64_t K, float* acc) {
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K % 32)) - 1);
  __m512 a[R];
  for (int64_t r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = k + 32 <= K ? static_cast<__mmask32>(~0u) : tail;
    const __m512bh xv = load32(x + k, mask);
    for (int64_t r = 0; r < R; ++r) a[r] = _mm512_dpbf16_ps(a[r], xv, load32(w + r * K + k, mask));
  }
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_reduce_add_ps(a[r]);
}

static void bf16_gemv(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* out,
                      int64_t M, int64_t N, int64_t K) {
  for_each_pass(w, N, K, sizeof(at::BFloat16), [&](int64_t n0, int64_t rows) {
    for (int64_t m = 0; m < M; ++m) {
      float acc[ROWS];
      if (rows == ROWS)
        dot_rows_bf16<ROWS>(x + m * K, w + n0 * K, K, acc);
      else
        for (int64_t r = 0; r < rows; ++r) dot_rows_bf16<1>(x + m * K, w + (n0 + r) * K, K, acc + r);
      for (int64_t r = 0; r < rows; ++r)
        out[m * N + n0 + r] = from_float<at::BFloat16>(acc[r] + (bias ? to_float(bias[n0 + r]) : 0.f));
    }
  });
}
#endif

// x [.., K] and weight [N, K] of one float type (float32, bf16 or fp16): F.linear for a few rows, reading the
// weight once
torch::Tensor float_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight: the same dtype");
  const Product p(x, weight, bias);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    bf16_gemv(p.rows.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), p.bias_ptr<at::BFloat16>(),
              p.out.data_ptr<at::BFloat16>(), p.rows.size(0), p.N, p.K);
    return p.shaped(x);
  }
#endif
  AT_DISPATCH_V2(x.scalar_type(), "float_linear", AT_WRAP([&] {
    quantized_gemv<scalar_t, scalar_t>(p.rows.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), nullptr,
                                       p.bias_ptr<scalar_t>(), p.out.data_ptr<scalar_t>(), p.rows.size(0), p.N,
                                       p.K, 1);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return p.shaped(x);
}

// x [.., K] times a weight in oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight): the library's
// product behind an operator of our own, which torch.compile'd graphs call as it is (inductor cannot lower
// mkldnn::_linear_pointwise on an already packed weight).
torch::Tensor onednn_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  auto shape = x.sizes().vec();
  torch::jit::Stack stack{x.reshape({-1, x.size(-1)}), packed, bias, "none", c10::List<c10::optional<at::Scalar>>(),
                          c10::optional<c10::string_view>()};
  op.callBoxed(&stack);
  shape.back() = packed.size(0);
  return stack.front().toTensor().view(shape);
}

TORCH_LIBRARY_FRAGMENT(skill, m) {
  m.def("onednn_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("float_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");  // for compiled graphs
}

TORCH_LIBRARY_IMPL(skill, CPU, m) {
  m.impl("onednn_linear", &onednn_linear);
  m.impl("float_linear", &float_linear);
}

TORCH_LIBRARY_IMPL(skill, MkldnnCPU, m) { m.impl("onednn_linear", &onednn_linear); }  // dispatched on the weight

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear);
  m.def("fp8_linear", &fp8_linear);
  m.def("float_linear", &float_linear);
}
