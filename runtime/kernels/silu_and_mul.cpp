// SiLU of the gate times the up projection in one pass (host only), with the roundings of the PyTorch expression
// it replaces, `F.silu(gate) * up`: the SiLU is rounded to the inputs' type before the product, then the product.
// The SiLU is x / (1 + e^-x) through exp_nonpositive (a few float ulps from libm's, which PyTorch's vectorised
// kernel also does not use).
#include <ATen/ops/empty.h>

#include "host_float.h"

static inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));  // e^-|x|: no overflow
  return (x >= 0.f ? x : x * e) / (1.f + e);
}

template <typename T>
static void silu_and_mul_rows(const T* gate, const T* up, T* out, int64_t rows, int64_t n, int64_t gate_stride,
                              int64_t up_stride) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *g = gate + r * gate_stride, *u = up + r * up_stride;
      T* o = out + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
      for (; i + 16 <= n; i += 16) {
        const __m512 x = load_floats(g + i);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(x)));
        const __m512 top = _mm512_mask_mul_ps(x, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), x, e);
        const __m512 silu = round_floats<T>(_mm512_div_ps(top, _mm512_add_ps(one, e)));
        store_floats(o + i, _mm512_mul_ps(silu, load_floats(u + i)));
      }
#endif
      for (; i < n; ++i) o[i] = from_float<T>(rounded<T>(silu(to_float(g[i]))) * to_float(u[i]));
    }
  });
}

at::Tensor silu_and_mul(at::Tensor gate, at::Tensor up) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() &&
                  (gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16),
              "gate and up: one shape and one dtype, float32 or bfloat16");
  if (gate.numel() == 0) return at::empty(gate.sizes(), gate.options());
  const int64_t n = gate.size(-1);
  const auto g = gate.reshape({-1, n}), u = up.reshape({-1, n});  // views where the rows allow
  const auto rows_g = g.stride(1) == 1 ? g : g.contiguous(), rows_u = u.stride(1) == 1 ? u : u.contiguous();
  auto out = at::empty(gate.sizes(), gate.options());
  const auto run = [&](auto element) {
    using T = decltype(element);
    silu_and_mul_rows<T>(rows_g.data_ptr<T>(), rows_u.data_ptr<T>(), out.data_ptr<T>(), rows_g.size(0), n,
                         rows_g.stride(0), rows_u.stride(0));
  };
  dispatch_float_or_bfloat16(gate.scalar_type(), run);
  return out;
}

TORCH_LIBRARY_FRAGMENT(skill, m) { m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor"); }

TORCH_LIBRARY_IMPL(skill, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
