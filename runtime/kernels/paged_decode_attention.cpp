// Decode attention that reads the paged KV cache in place (host only).
//
// One query token per request: out[b, h] = softmax(scale * q[b, h] . K[ctx(b)]) V[ctx(b)], where ctx(b) are the
// request's cached positions [start, len) reached through its block table, start = len - window with a sliding
// window. The query heads sharing a KV head are done together, so each cached row is read once; scores and sums
// are float. Soft-capping is tanh(s / cap) * cap as in Gemma 2. An attention sink (GPT-OSS) is one more logit per
// query head in the softmax's denominator, with no value row. Values may have another head size than keys (MLA).
// Where the compiler targets AVX-512, head sizes 64 and 128 run hand-vectorised loops (below).
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include "host_float.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>


// s = softmax(s), with the attention sink's logit in the denominator where there is one.
static void softmax(float* s, int64_t len, const float* sink) {
  const float sink_logit = sink ? *sink : -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const auto lanes = [len](int64_t j) {  // the lanes of s[j : j + 16] that exist
    return static_cast<__mmask16>(len - j >= 16 ? 0xFFFF : (1u << (len - j)) - 1);
  };
  __m512 most = none, sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 16) most = _mm512_max_ps(most, _mm512_mask_loadu_ps(none, lanes(j), s + j));
  const __m512 best = _mm512_set1_ps(std::max(_mm512_reduce_max_ps(most), sink_logit));
  for (int64_t j = 0; j < len; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes(j), s + j), best));
    _mm512_mask_storeu_ps(s + j, lanes(j), e);
    sum = _mm512_mask_add_ps(sum, lanes(j), sum, e);
  }
  const float total = _mm512_reduce_add_ps(sum) + (sink ? exp_nonpositive(*sink - _mm512_cvtss_f32(best)) : 0.f);
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (int64_t j = 0; j < len; j += 16)
    _mm512_mask_storeu_ps(s + j, lanes(j), _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes(j), s + j), inv));
#else
  float best = sink_logit, total = 0.f;
#pragma omp simd reduction(max : best)
  for (int64_t j = 0; j < len; ++j) best = std::max(best, s[j]);
  if (sink) total = exp_nonpositive(*sink - best);
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < len; ++j) {
    s[j] = exp_nonpositive(s[j] - best);
    total += s[j];
  }
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) s[j] *= inv;
#endif
}

// visit(block, offset in block, count, first position) for runs of up to kRun consecutive positions covering
// [start, end) of a request whose block table is `table`; a run never crosses a block.
template <int64_t kRun, typename F>
static inline void for_each_run(const int64_t* table, int64_t start, int64_t end, int64_t block_size, F visit) {
  for (int64_t first = start - start % block_size; first < end; first += block_size) {
    const int64_t block = table[first / block_size];
    for (int64_t j = std::max(first, start), stop = std::min(first + block_size, end); j < stop; j += kRun)
      visit(block, j - first, std::min(kRun, stop - j), j);
  }
}

#if defined(__AVX512F__)
// AVX-512 loops for head sizes that are a multiple of 16, used by decode_kernel where they apply. Cached rows
// are converted to float 16 tokens at a time (a tile in L1), then every query head of the group reads the tile:
// 16 dot products are summed across lanes together (sum_lanes16), and values are accumulated from the tile.
constexpr int64_t kTile = 16;

// r[i] = the sum of v[i]'s lanes: halves, quarters, pairs and neighbours of the vectors are added in a tree
// (15 additions for 16 sums instead of 4 per sum); the last permutation puts the sums in order.
static inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[i], b[i + 2]), _mm512_unpackhi_ps(b[i], b[i + 2]));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), d);
}

// tile[t, :D] = rows[t * stride, :D] as float for t < count, zeros after (their scores are never stored).
template <typename T, int64_t D>
static inline void load_tile(const T* rows, int64_t stride, int64_t count, float* tile) {
  for (int64_t t = 0; t < kTile; ++t)
    for (int64_t c = 0; c < D; c += 16)
      _mm512_storeu_ps(tile + t * D + c, t < count ? load_floats(rows + t * stride + c) : _mm512_setzero_ps());
}

// scores[h, j - start] = qf[h] . k[j] for the query heads of `kv_heads` KV heads (qf already scaled). A tile's
// rows are read for every KV head in turn, so the cache is streamed once.
template <typename T, int64_t D>
static void tile_scores(const float* qf, const T* k_cache, const int64_t* table, int64_t start, int64_t end,
                        int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t kv_heads,
                        int64_t group, int64_t len, float* scores) {
  alignas(64) float tile[kTile * D];
  for_each_run<kTile>(table, start, end, block_size, [&](int64_t block, int64_t offset, int64_t count, int64_t j) {
    const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t g = 0; g < kv_heads; ++g) {
      load_tile<T, D>(k_cache + block * block_stride + offset * token_stride + g * D, token_stride, count, tile);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        __m512 q[D / 16], dots[kTile];
        for (int64_t c = 0; c < D / 16; ++c) q[c] = _mm512_loadu_ps(qf + h * D + c * 16);
        for (int64_t t = 0; t < kTile; ++t) {
          __m512 s = _mm512_mul_ps(q[0], _mm512_load_ps(tile + t * D));
          for (int64_t c = 1; c < D / 16; ++c) s = _mm512_fmadd_ps(q[c], _mm512_load_ps(tile + t * D + c * 16), s);
          dots[t] = s;
        }
        _mm512_mask_storeu_ps(scores + h * len + j - start, keep, sum_lanes16(dots));
      }
    }
  });
}

// acc[h] += sum_j p[h, j - start] v[j] for the query heads of `kv_heads` KV heads.
template <typename T, int64_t D>
static void tile_values(const float* p, const T* v_cache, const int64_t* table, int64_t start, int64_t end,
                        int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t kv_heads,
                        int64_t group, int64_t len, float* acc) {
  alignas(64) float tile[kTile * D];
  for_each_run<kTile>(table, start, end, block_size, [&](int64_t block, int64_t offset, int64_t count, int64_t j) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      load_tile<T, D>(v_cache + block * block_stride + offset * token_stride + g * D, token_stride, count, tile);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        __m512 a[D / 16];
        for (int64_t c = 0; c < D / 16; ++c) a[c] = _mm512_loadu_ps(acc + h * D + c * 16);
        const float* ph = p + h * len + j - start;
        for (int64_t t = 0; t < count; ++t) {
          const __m512 w = _mm512_set1_ps(ph[t]);
          for (int64_t c = 0; c < D / 16; ++c)
            a[c] = _mm512_fmadd_ps(w, _mm512_load_ps(tile + t * D + c * 16), a[c]);
        }
        for (int64_t c = 0; c < D / 16; ++c) _mm512_storeu_ps(acc + h * D + c * 16, a[c]);
      }
    }
  });
}
#endif

// kD / kDv: head sizes fixed at compile time (0: read at run time), so the dot products unroll into independent
// chains. Work items are a request with all its KV heads, whose cached rows are then read contiguously, or,
// with too few requests to keep every thread busy, one KV head of a request.
template <typename T, int64_t kD, int64_t kDv>
static void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* lens, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t head_dim,
                          int64_t v_head_dim, int64_t block_size, int64_t width, float scale, int64_t window,
                          float soft_cap, const float* sinks) {
  // the AVX-512 loops, where built: 16-bit or float caches, head sizes a multiple of 16
  [[maybe_unused]] constexpr bool kVectorLoops = !std::is_same_v<T, double> && kD > 0 && kD % 16 == 0 && kDv == kD;
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
      const int64_t* table = tables + b * width;
#if defined(__AVX512F__)
      if constexpr (kVectorLoops)
        tile_scores<T, kD>(qf.data(), k_cache + kv0 * D, table, start, n, block_size, block_stride,
                           token_stride, kv_heads, group, len, scores.data());
      else
#endif
      // Tokens are walked block by block: no division per token to find its block and offset.
      for_each_run<1>(table, start, n, block_size, [&](int64_t block, int64_t offset, int64_t, int64_t j) {
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
      for (int64_t h = 0; h < heads; ++h) softmax(scores.data() + h * len, len, sinks ? sinks + h0 + h : nullptr);
      std::fill(acc.begin(), acc.end(), 0.f);
#if defined(__AVX512F__)
      if constexpr (kVectorLoops)
        tile_values<T, kDv>(scores.data(), v_cache + kv0 * Dv, table, start, n, block_size,
                            v_block_stride, v_token_stride, kv_heads, group, len, acc.data());
      else
#endif
      for_each_run<1>(table, start, n, block_size, [&](int64_t block, int64_t offset, int64_t, int64_t j) {
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

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                  at::Tensor lens, double scale, int64_t window, double soft_cap,
                                  c10::optional<at::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "q [B, H, D] and caches [blocks, block_size, Hkv, D | Dv], contiguous");
  TORCH_CHECK(v_cache.dim() == 4 && v_cache.size(2) == k_cache.size(2) && k_cache.size(3) == q.size(2),
              "keys of the query's head size, values with as many heads as keys");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "one dtype");
  auto tables = block_table.to(at::kLong).contiguous();
  auto lengths = lens.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2), Dv = v_cache.size(3);
  auto out = at::empty({B, H, Dv}, q.options());
  at::Tensor sink_logits;
  if (sinks) {
    sink_logits = sinks->to(at::kFloat).contiguous();
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
