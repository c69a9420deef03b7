// Decode attention that reads the paged KV cache in place (host only).
//
// One query token per request: out[b, h] = softmax(scale * q[b, h] . K[ctx(b)]) V[ctx(b)], where ctx(b) are the
// request's cached positions [start, len) reached through its block table, start = len - window with a sliding
// window. Scores are kept in float; soft-capping is tanh(s / cap) * cap as in Gemma 2.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* lens, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                          int64_t block_size, int64_t width, float scale, int64_t window, float soft_cap) {
  const int64_t group = H / Hkv;
  const int64_t token_stride = Hkv * D, block_stride = block_size * token_stride;
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(D), qf(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, kvh = h / group;
      const int64_t len = lens[b], start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.assign(len - start, 0.f);
      for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(q[bh * D + d]);
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t j = start; j < len; ++j) {
        const T* k = k_cache + tables[b * width + j / block_size] * block_stride + (j % block_size) * token_stride +
                     kvh * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qf[d] * static_cast<float>(k[d]);
        s *= scale;
        if (soft_cap > 0.f) s = std::tanh(s / soft_cap) * soft_cap;
        scores[j - start] = s;
        best = std::max(best, s);
      }
      float total = 0.f;
      for (auto& s : scores) total += (s = std::exp(s - best));
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = start; j < len; ++j) {
        const T* v = v_cache + tables[b * width + j / block_size] * block_stride + (j % block_size) * token_stride +
                     kvh * D;
        const float p = scores[j - start] / total;
        for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<float>(v[d]);
      }
      for (int64_t d = 0; d < D; ++d) out[bh * D + d] = static_cast<T>(acc[d]);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor lens, double scale, int64_t window,
                                     double soft_cap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "q [B, H, D] and caches [blocks, block_size, Hkv, D], contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "one dtype");
  auto tables = block_table.to(torch::kLong).contiguous();
  auto lengths = lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B,
                            H, Hkv, D, k_cache.size(1), tables.size(1), static_cast<float>(scale), window,
                            static_cast<float>(soft_cap));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode_attention", &paged_decode_attention); }
