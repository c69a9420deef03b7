// RMS norm in one pass over each row (host only), with the roundings of the PyTorch expressions it replaces:
//   h = x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)
//   out = weight * h.to(x.dtype)          (Llama's RMSNorm: h rounded to the input's type first)
//   out = (weight * h).to(x.dtype)        (weight_in_float: the product rounded once)
// for x and weight of one type; only the order in which the squares are summed differs.
#include <ATen/ops/empty_like.h>

#include "host_float.h"

#include <cmath>

template <typename T>
static void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps,
                          bool weight_in_float) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* o = out + r * n;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) squares += to_float(xr[i]) * to_float(xr[i]);
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
      if (weight_in_float) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = from_float<T>(to_float(weight[i]) * (to_float(xr[i]) * scale));
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i)
          o[i] = from_float<T>(to_float(weight[i]) * rounded<T>(to_float(xr[i]) * scale));
      }
    }
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, bool weight_in_float) {
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0) && x.scalar_type() == weight.scalar_type(),
              "x [..., n] and weight [n] of one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16");
  auto rows = x.contiguous();
  auto w = weight.contiguous();
  auto out = at::empty_like(rows);
  if (out.numel() == 0) return out;
  const auto run = [&](auto element) {
    using T = decltype(element);
    rms_norm_rows<T>(rows.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(), rows.numel() / rows.size(-1),
                     rows.size(-1), static_cast<float>(eps), weight_in_float);
  };
  dispatch_float_or_bfloat16(x.scalar_type(), run);
  return out;
}

TORCH_LIBRARY_FRAGMENT(skill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool weight_in_float) -> Tensor");
}

TORCH_LIBRARY_IMPL(skill, CPU, m) { m.impl("rms_norm", &rms_norm); }
