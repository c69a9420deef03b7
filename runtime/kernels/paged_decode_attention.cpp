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

template <typename T>
static void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* lens, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t Dv,
                          int64_t block_size, int64_t width, float scale, int64_t window, float soft_cap,
                          const float* sinks) {
  const int64_t group = H / Hkv;
  const int64_t token_stride = Hkv * D, block_stride = block_size * token_stride;
  const int64_t v_token_stride = Hkv * Dv, v_block_stride = block_size * v_token_stride;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * Dv), qf(group * D), kf(std::max(D, Dv));
    for (int64_t bk = begin; bk < end; ++bk) {
      const int64_t b = bk / Hkv, kvh = bk % Hkv, n = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, n - window) : 0, len = n - start;
      const T* qb = q + (b * H + kvh * group) * D;
      for (int64_t i = 0; i < group * D; ++i) qf[i] = to_float(qb[i]) * scale;
      scores.assign(group * len, 0.f);
      for (int64_t j = start; j < n; ++j) {
        const T* k = k_cache + tables[b * width + j / block_size] * block_stride +
                     (j % block_size) * token_stride + kvh * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = to_float(k[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * len + j - start] = soft_cap > 0.f ? std::tanh(s / soft_cap) * soft_cap : s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        const float sink = sinks ? sinks[kvh * group + g] : -std::numeric_limits<float>::infinity();
        float best = sink, total = 0.f;
#pragma omp simd reduction(max : best)
        for (int64_t j = 0; j < len; ++j) best = std::max(best, sg[j]);
        if (sinks) total = exp_nonpositive(sink - best);
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < len; ++j) {
          sg[j] = exp_nonpositive(sg[j] - best);
          total += sg[j];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) sg[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = start; j < n; ++j) {
        const T* v = v_cache + tables[b * width + j / block_size] * v_block_stride +
                     (j % block_size) * v_token_stride + kvh * Dv;
        for (int64_t d = 0; d < Dv; ++d) kf[d] = to_float(v[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + j - start];
          float* ag = acc.data() + g * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) ag[d] += p * kf[d];
        }
      }
      T* ob = out + (b * H + kvh * group) * Dv;
      for (int64_t i = 0; i < group * Dv; ++i) ob[i] = static_cast<T>(acc[i]);
    }
  });
}
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
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B,
                            H, Hkv, D, Dv, k_cache.size(1), tables.size(1), static_cast<float>(scale), window,
                            static_cast<float>(soft_cap), sinks ? sink_logits.data_ptr<float>() : nullptr);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode_attention", &paged_decode_attention); }
