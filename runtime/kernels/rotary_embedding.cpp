// Rotary position embedding in one pass (host only), with the roundings of the PyTorch expression it replaces:
//   out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
// for x, cos and sin of one type (float32 or bfloat16), cos and sin broadcast to x's shape (strides of 0 where
// they repeat): each product is rounded to that type, then their sum (built without contracting a product and a
// sum into one fused multiply-add, so float32 too gives the expression's bits). Rows are x's innermost dimension,
// contiguous in all three; anything else runs the expression through ATen's operators.
#include <ATen/ExpandUtils.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "host_float.h"

#include <array>

constexpr int64_t kMaxDims = 8;

template <typename T>
static void rotate_rows(const T* x, const T* cos, const T* sin, T* out, int64_t rows, int64_t D, int64_t dims,
                        const std::array<int64_t, kMaxDims>& sizes, const std::array<int64_t, kMaxDims>* strides) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t offset[4] = {0, 0, 0, 0}, rest = r;  // of x, cos, sin, out
      for (int64_t d = dims - 1; d >= 0; --d) {
        const int64_t i = rest % sizes[d];
        rest /= sizes[d];
        for (int t = 0; t < 4; ++t) offset[t] += i * strides[t][d];
      }
      const T *xr = x + offset[0], *c = cos + offset[1], *s = sin + offset[2];
      T* o = out + offset[3];
#pragma omp simd
      for (int64_t i = 0; i < half; ++i)
        o[i] = from_float<T>(rounded<T>(to_float(xr[i]) * to_float(c[i])) -
                             rounded<T>(to_float(xr[i + half]) * to_float(s[i])));
#pragma omp simd
      for (int64_t i = half; i < D; ++i)
        o[i] = from_float<T>(rounded<T>(to_float(xr[i]) * to_float(c[i])) +
                             rounded<T>(to_float(xr[i - half]) * to_float(s[i])));
    }
  });
}

static at::Tensor rotate_half(const at::Tensor& x) {  // transformers' split: the first half rounds down
  const int64_t half = x.size(-1) / 2;
  return at::cat({x.narrow(-1, half, x.size(-1) - half).neg(), x.narrow(-1, 0, half)}, -1);
}

// x * cos + rotate_half(x) * sin: the kernel where x, cos and sin qualify, ATen's operators otherwise.
static at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const bool qualifies = x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type() &&
                         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() >= 1 &&
                         x.dim() <= kMaxDims + 1 && x.numel() > 0 && x.size(-1) % 2 == 0 &&
                         at::infer_size(at::infer_size(x.sizes(), cos.sizes()), sin.sizes()) == x.sizes();
  const auto expression = [&] { return x.mul(cos).add(rotate_half(x).mul(sin)); };
  if (!qualifies) return expression();
  const auto c = cos.expand_as(x), s = sin.expand_as(x);  // a broadcast last dimension has stride 0 now
  if (x.stride(-1) != 1 || c.stride(-1) != 1 || s.stride(-1) != 1) return expression();
  auto out = at::empty_like(x);
  if (out.stride(-1) != 1) out = at::empty(x.sizes(), x.options());
  const int64_t dims = x.dim() - 1, D = x.size(-1);
  std::array<int64_t, kMaxDims> sizes{}, strides[4]{};
  const at::Tensor* tensors[4] = {&x, &c, &s, &out};
  for (int64_t d = 0; d < dims; ++d) {
    sizes[d] = x.size(d);
    for (int t = 0; t < 4; ++t) strides[t][d] = tensors[t]->stride(d);
  }
  const auto run = [&](auto element) {
    using T = decltype(element);
    rotate_rows<T>(x.data_ptr<T>(), c.data_ptr<T>(), s.data_ptr<T>(), out.data_ptr<T>(), x.numel() / D, D, dims,
                   sizes, strides);
  };
  dispatch_float_or_bfloat16(x.scalar_type(), run);
  return out;
}

// transformers' apply_rotary_pos_emb: cos and sin unsqueezed at unsqueeze_dim, q and k rotated.
std::tuple<at::Tensor, at::Tensor> rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin,
                                                    int64_t unsqueeze_dim) {
  const auto c = cos.unsqueeze(unsqueeze_dim), s = sin.unsqueeze(unsqueeze_dim);
  return {rotate(q, c, s), rotate(k, c, s)};
}

TORCH_LIBRARY_FRAGMENT(skill, m) {
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(skill, CPU, m) { m.impl("rotary_embedding", &rotary_embedding); }
