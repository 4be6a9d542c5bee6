// Paged decode attention for CPU: one query token per sequence, K/V read in place from the
// block-paged cache (no gather copy), fp32 accumulation, one work item per (sequence, KV head)
// so the query heads of a GQA group share every K/V row they read.
// window > 0: a sliding-window layer; each query sees only the last `window` positions (itself
// included), and blocks before them are not read.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: its C++ frontend headers add ~15 s of parsing (21 s against 5 s, g++ -fsyntax-only, AMD EPYC Zen 3)

#include <algorithm>
#include <cmath>
#include <vector>

namespace tandem_cpu_paged_attention {

// q: row b at q + b * q_row, [Hq, D] inside it; out: [B, Hq, D].
template <typename T, int D>
static void decode(const T* q, int64_t q_row, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, T* out, int64_t num_seqs, int64_t hq, int64_t hkv,
                   int64_t max_blocks, int64_t block_size, float scale, int64_t window) {
  const int64_t g = hq / hkv, row_stride = hkv * D;
  at::parallel_for(0, num_seqs * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * D), acc(g * D), scores;
    float row[D];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hkv, h = item % hkv, end_pos = seq_lens[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, end_pos - window) : 0, len = end_pos - lo;
      const int64_t* table = block_tables + b * max_blocks;
      scores.resize(g * len);
      for (int64_t i = 0; i < g * D; ++i) qf[i] = static_cast<float>(q[b * q_row + h * g * D + i]) * scale;
      // Scores, block by block (the first one from the window's start): rows of one block are a
      // fixed stride apart.
      for (int64_t p0 = lo, n; p0 < end_pos; p0 += n) {
        const int64_t off = p0 % block_size;
        n = std::min(block_size - off, end_pos - p0);
        const T* kp = k_cache + ((table[p0 / block_size] * block_size + off) * hkv + h) * D;
        for (int64_t t = 0; t < n; ++t, kp += row_stride) {
          for (int i = 0; i < D; ++i) row[i] = static_cast<float>(kp[i]);
          for (int64_t j = 0; j < g; ++j) {
            const float* qj = qf.data() + j * D;
            float s = 0.f;
            for (int i = 0; i < D; ++i) s += qj[i] * row[i];
            scores[j * len + p0 - lo + t] = s;
          }
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        float* sj = scores.data() + j * len;
        const float mx = *std::max_element(sj, sj + len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) sum += (sj[t] = std::exp(sj[t] - mx));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p0 = lo, n; p0 < end_pos; p0 += n) {
        const int64_t off = p0 % block_size;
        n = std::min(block_size - off, end_pos - p0);
        const T* vp = v_cache + ((table[p0 / block_size] * block_size + off) * hkv + h) * D;
        for (int64_t t = 0; t < n; ++t, vp += row_stride) {
          for (int i = 0; i < D; ++i) row[i] = static_cast<float>(vp[i]);
          for (int64_t j = 0; j < g; ++j) {
            const float p = scores[j * len + p0 - lo + t];
            float* aj = acc.data() + j * D;
            for (int i = 0; i < D; ++i) aj[i] += p * row[i];
          }
        }
      }
      for (int64_t i = 0; i < g * D; ++i) out[(b * hq + h * g) * D + i] = static_cast<T>(acc[i]);
    }
  });
}

// q: [B, Hq, D]; k_cache, v_cache: [num_slots, Hkv, D]; block_tables: [B, max_blocks] int64;
// seq_lens: [B] int64 (context length including the query token). Returns [B, Hq, D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens,
                                  int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  auto out = at::empty_like(q);
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(1);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "paged_decode_attention supports head_dim 64, 128 or 256");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto run = d == 64 ? decode<scalar_t, 64> : d == 128 ? decode<scalar_t, 128> : decode<scalar_t, 256>;
    run(q.data_ptr<scalar_t>(), hq * d, k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
        b, hq, hkv, block_tables.size(1), block_size, static_cast<float>(scale), window);
  });
  return out;
}

// A decode-only step's whole attention from the layer's fused projection: qkv [B, (Hq + 2 Hkv) D]
// (q, k, v of one token per sequence, RoPE applied); writes k and v at slot_mapping [B] of
// kv_cache [2, num_slots, Hkv, D], then attends. Returns [B, Hq * D]. At batch 1 the separate
// split / index_copy_ / slice / copy ops around the kernel cost more than the attention.
at::Tensor paged_decode_qkv(at::Tensor qkv, at::Tensor kv_cache, at::Tensor slot_mapping,
                            at::Tensor block_tables, at::Tensor seq_lens, int64_t num_heads,
                            int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && kv_cache.dim() == 4 && kv_cache.is_contiguous());
  TORCH_CHECK(qkv.scalar_type() == kv_cache.scalar_type(), "paged_decode_qkv: qkv and cache dtypes differ");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && slot_mapping.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              slot_mapping.scalar_type() == at::kLong);
  const int64_t b = qkv.size(0), hkv = kv_cache.size(2), d = kv_cache.size(3), slots = kv_cache.size(1);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "paged_decode_qkv supports head_dim 64, 128 or 256");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * hkv) * d && slot_mapping.numel() == b && seq_lens.numel() >= b);
  auto out = at::empty({b, num_heads * d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "paged_decode_qkv", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    scalar_t* k_cache = kv_cache.data_ptr<scalar_t>();
    scalar_t* v_cache = k_cache + slots * hkv * d;
    const int64_t row = qkv.size(1), kv = hkv * d;
    const int64_t* slot = slot_mapping.data_ptr<int64_t>();
    for (int64_t i = 0; i < b; ++i) {
      TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "paged_decode_qkv: slot out of range");
      std::copy_n(src + i * row + num_heads * d, kv, k_cache + slot[i] * kv);
      std::copy_n(src + i * row + num_heads * d + kv, kv, v_cache + slot[i] * kv);
    }
    auto run = d == 64 ? decode<scalar_t, 64> : d == 128 ? decode<scalar_t, 128> : decode<scalar_t, 256>;
    run(src, row, k_cache, v_cache, block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
        out.data_ptr<scalar_t>(), b, num_heads, hkv, block_tables.size(1), block_size, static_cast<float>(scale),
        window);
  });
  return out;
}

// This kernel's functions, in its submodule of the unit's module (kernels/__init__.py: UNITS).
void bind(pybind11::module_ m) {
  using pybind11::arg;
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", arg("q"), arg("k_cache"),
        arg("v_cache"), arg("block_tables"), arg("seq_lens"), arg("block_size"), arg("scale"), arg("window") = 0);
  m.def("paged_decode_qkv", &paged_decode_qkv, "KV write and paged decode attention from a fused qkv (CPU)",
        arg("qkv"), arg("kv_cache"), arg("slot_mapping"), arg("block_tables"), arg("seq_lens"), arg("num_heads"),
        arg("block_size"), arg("scale"), arg("window") = 0);
}

}  // namespace tandem_cpu_paged_attention
