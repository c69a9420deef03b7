// Decode attention that reads the paged KV cache in place (host only).
//
// One query token per request: out[b, h] = softmax(scale * q[b, h] . K[ctx(b)]) V[ctx(b)], where ctx(b) are the
// request's cached positions [start, len) reached through its block table, start = len - window with a sliding
// window. The query heads sharing a KV head are done together, so each cached row is read once; scores and sums
// are float. Soft-capping is tanh(s / cap) * cap as in Gemma 2. An attention sink (GPT-OSS) is one more logit per
// query head in the softmax's denominator, with no value row. Values may have another head size than keys (MLA).
#include <ATen/Parallel.h>

#include "host_float.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

// exp(x) for x <= 0 as 2^i * 2^f with a degree-6 polynomial for 2^f (relative error ~2e-7): unlike libm's
// expf it vectorises, and the softmax is the kernel's hot loop.
static inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.44269504089f;
  const float i = std::floor(t), f = t - i;
  const float p = 1.f + f * (0.693147182f + f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f +
                  f * (0.00133335581f + f * 0.000154035304f)))));
  const int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// visit(block, offset in block, position) for positions [start, end) of a request whose block table is `table`.
template <typename F>
static inline void for_each_token(const int64_t* table, int64_t start, int64_t end, int64_t block_size, F visit) {
  for (int64_t first = start - start % block_size; first < end; first += block_size) {
    const int64_t block = table[first / block_size];
    for (int64_t j = std::max(first, start), stop = std::min(first + block_size, end); j < stop; ++j)
      visit(block, j - first, j);
  }
}

// kD / kDv: head sizes fixed at compile time (0: read at run time), so the dot products unroll into independent
// chains. Work items are a request with all its KV heads, whose cached rows are then read contiguously, or,
// with too few requests to keep every thread busy, one KV head of a request.
template <typename T, int64_t kD, int64_t kDv>
static void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* lens, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t head_dim,
                          int64_t v_head_dim, int64_t block_size, int64_t width, float scale, int64_t window,
                          float soft_cap, const float* sinks) {
  const int64_t D = kD ? kD : head_dim, Dv = kDv ? kDv : v_head_dim, group = H / Hkv;
  const int64_t token_stride = Hkv * D, block_stride = block_size * token_stride;
  const int64_t v_token_stride = Hkv * Dv, v_block_stride = block_size * v_token_stride;
  const int64_t parts = B >= 2 * at::get_num_threads() ? 1 : Hkv, kv_heads = Hkv / parts, heads = kv_heads * group;
  at::parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(heads * Dv), qf(heads * D), row(kv_heads * std::max(D, Dv));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / parts, kv0 = item % parts * kv_heads, h0 = kv0 * group, n = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, n - window) : 0, len = n - start;
      const T* qb = q + (b * H + h0) * D;
      for (int64_t i = 0; i < heads * D; ++i) qf[i] = to_float(qb[i]) * scale;
      scores.assign(heads * len, 0.f);
      // Tokens are walked block by block: no division per token to find its block and offset.
      for_each_token(tables + b * width, start, n, block_size, [&](int64_t block, int64_t offset, int64_t j) {
        const T* k = k_cache + block * block_stride + offset * token_stride + kv0 * D;
        for (int64_t i = 0; i < kv_heads * D; ++i) row[i] = to_float(k[i]);
        for (int64_t h = 0; h < heads; ++h) {
          const float *qh = qf.data() + h * D, *kh = row.data() + h / group * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[h * len + j - start] = s;
        }
      });
      if (soft_cap > 0.f)
        for (float& s : scores) s = std::tanh(s / soft_cap) * soft_cap;
      for (int64_t h = 0; h < heads; ++h) {
        float* sh = scores.data() + h * len;
        const float sink = sinks ? sinks[h0 + h] : -std::numeric_limits<float>::infinity();
        float best = sink, total = 0.f;
#pragma omp simd reduction(max : best)
        for (int64_t j = 0; j < len; ++j) best = std::max(best, sh[j]);
        if (sinks) total = exp_nonpositive(sink - best);
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < len; ++j) {
          sh[j] = exp_nonpositive(sh[j] - best);
          total += sh[j];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) sh[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_token(tables + b * width, start, n, block_size, [&](int64_t block, int64_t offset, int64_t j) {
        const T* v = v_cache + block * v_block_stride + offset * v_token_stride + kv0 * Dv;
        for (int64_t i = 0; i < kv_heads * Dv; ++i) row[i] = to_float(v[i]);
        for (int64_t h = 0; h < heads; ++h) {
          const float p = scores[h * len + j - start], *vh = row.data() + h / group * Dv;
          float* ah = acc.data() + h * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) ah[d] += p * vh[d];
        }
      });
      T* ob = out + (b * H + h0) * Dv;
      for (int64_t i = 0; i < heads * Dv; ++i) ob[i] = static_cast<T>(acc[i]);
    }
  });
}

template <int64_t N>
using Size = std::integral_constant<int64_t, N>;

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor lens, double scale, int64_t window,
                                     double soft_cap, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "q [B, H, D] and caches [blocks, block_size, Hkv, D | Dv], contiguous");
  TORCH_CHECK(v_cache.dim() == 4 && v_cache.size(2) == k_cache.size(2) && k_cache.size(3) == q.size(2),
              "keys of the query's head size, values with as many heads as keys");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "one dtype");
  auto tables = block_table.to(torch::kLong).contiguous();
  auto lengths = lens.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2), Dv = v_cache.size(3);
  auto out = torch::empty({B, H, Dv}, q.options());
  torch::Tensor sink_logits;
  if (sinks) {
    sink_logits = sinks->to(torch::kFloat).contiguous();
    TORCH_CHECK(sink_logits.numel() == H, "one sink logit per query head");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto kD, auto kDv) {
      decode_kernel<scalar_t, decltype(kD)::value, decltype(kDv)::value>(
          q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
          tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, Hkv, D, Dv,
          k_cache.size(1), tables.size(1), static_cast<float>(scale), window, static_cast<float>(soft_cap),
          sinks ? sink_logits.data_ptr<float>() : nullptr);
    };
    if (D == 64 && Dv == 64)
      run(Size<64>{}, Size<64>{});
    else if (D == 128 && Dv == 128)
      run(Size<128>{}, Size<128>{});
    else
      run(Size<0>{}, Size<0>{});
  });
  return out;
}

// An operator rather than a Python binding, so that torch.compile'd decode steps call it too.
TORCH_LIBRARY_FRAGMENT(skill, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor lens, "
        "float scale, int window, float soft_cap, Tensor? sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(skill, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
