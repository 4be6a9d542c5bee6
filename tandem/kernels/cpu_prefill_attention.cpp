// Paged prefill attention for CPU: causal attention of each sequence's new query tokens over its
// whole context, K/V read from the block-paged cache through the block table (no gather of the
// context), flash-style: key tiles with an online softmax, so memory stays one tile's worth
// whatever the length and no query x context score matrix is formed. The query heads of a GQA
// group share each K/V tile they load. window > 0: a sliding-window layer; a query sees only the
// last `window` positions (itself included), and no tile outside every query's window is read.
// fp32 accumulation whatever the cache holds.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: its C++ frontend headers add ~15 s of parsing

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace tandem_cpu_prefill_attention {

#ifdef __AVX512F__
typedef float vec __attribute__((vector_size(64)));
#else
typedef float vec __attribute__((vector_size(32)));
#endif
constexpr int kLanes = sizeof(vec) / sizeof(float);
// A micro-tile: kMR query rows x kNR keys (scores) or head dims (outputs) in 2 * kMR registers.
constexpr int kMR = 6, kNR = 2 * kLanes;
// A key tile is kKeys positions from a multiple of kKeys: a query's result depends on its own
// position and context only, never on the chunk or batch it comes in. A work item holds about
// kRows query rows (positions x the query heads of one KV head), so a K/V tile loaded once serves
// them all.
constexpr int64_t kKeys = 64, kRows = 128;
static_assert(kKeys % kNR == 0, "a key tile is whole micro-tiles");

inline vec loadv(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// One cache row widened to fp32.
inline void widen(const float* src, float* dst, int n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen(const at::BFloat16* src, float* dst, int n) {  // a bf16 is the top half of an fp32
  for (int i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i].x) << 16;
    std::memcpy(dst + i, &bits, sizeof bits);
  }
}
#ifdef __F16C__
inline void widen(const at::Half* src, float* dst, int n) {  // n: a multiple of 8 (head_dim)
  for (int i = 0; i < n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
}
#endif
template <typename T>  // fp64, and fp16 without F16C
inline void widen(const T* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// One KV head's rows of one sequence in a paged cache [num_slots, hkv, D]. `load` is the one place
// a cache row is read: another cache format (a quantised one with a scale per row) is another
// specialisation of it.
template <typename T, int D>
struct PagedRows {
  const T* cache;
  const int64_t* table;
  int64_t block_size, hkv, h;
  void load(int64_t pos, float* dst) const {
    widen(cache + ((table[pos / block_size] * block_size + pos % block_size) * hkv + h) * D, dst, D);
  }
};

// s[r][c .. c + kNR) = q[r] . kt[:, c ..] for MR rows: q [MR][D], kt [D][kKeys] (a K tile
// transposed), s [MR][kKeys].
template <int MR, int D>
inline void score_tile(const float* q, const float* kt, float* s) {
  vec a[MR][2] = {};
  for (int i = 0; i < D; ++i) {
    const vec k0 = loadv(kt + i * kKeys), k1 = loadv(kt + i * kKeys + kLanes);
    for (int r = 0; r < MR; ++r) {
      const float x = q[r * D + i];
      a[r][0] += x * k0;
      a[r][1] += x * k1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    storev(s + r * kKeys, a[r][0]);
    storev(s + r * kKeys + kLanes, a[r][1]);
  }
}

// o[r][d .. d + kNR) += sum over keys c in [c0, c1) of p[r][c] v[c][d ..]: p [MR][kKeys], v [kKeys][D],
// o [MR][D]; keys in ascending order.
template <int MR, int D>
inline void value_tile(const float* p, const float* v, int64_t c0, int64_t c1, float* o) {
  vec a[MR][2];
  for (int r = 0; r < MR; ++r) a[r][0] = loadv(o + r * D), a[r][1] = loadv(o + r * D + kLanes);
  for (int64_t c = c0; c < c1; ++c) {
    const vec v0 = loadv(v + c * D), v1 = loadv(v + c * D + kLanes);
    for (int r = 0; r < MR; ++r) {
      const float w = p[r * kKeys + c];
      a[r][0] += w * v0;
      a[r][1] += w * v1;
    }
  }
  for (int r = 0; r < MR; ++r) storev(o + r * D, a[r][0]), storev(o + r * D + kLanes, a[r][1]);
}

// f(r0, std::integral_constant<int, MR>) for rows r0 .. r0 + MR - 1 of `rows`, kMR at a time.
template <typename F>
inline void row_blocks(int64_t rows, F&& f) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMR) {
    switch (std::min<int64_t>(kMR, rows - r0)) {
      case 6: f(r0, std::integral_constant<int, 6>{}); break;
      case 5: f(r0, std::integral_constant<int, 5>{}); break;
      case 4: f(r0, std::integral_constant<int, 4>{}); break;
      case 3: f(r0, std::integral_constant<int, 3>{}); break;
      case 2: f(r0, std::integral_constant<int, 2>{}); break;
      default: f(r0, std::integral_constant<int, 1>{}); break;
    }
  }
}

// A work item: query positions [q0, q1) of sequence b (its first at row `row` of q) for KV head h.
struct Item {
  int64_t b, h, q0, q1, row, cost;
};

// Per-thread tiles, kept across calls (fresh pages are zeroed by the OS at each call).
struct Scratch {
  std::vector<float> q, kt, v, s, o, m, l, row;
  void size(int64_t rows, int64_t d) {
    q.resize(rows * d), o.resize(rows * d), s.resize(rows * kKeys), m.resize(rows), l.resize(rows);
    kt.resize(d * kKeys), v.resize(kKeys * d), row.resize(d);
  }
};

// One item: the online softmax over its key tiles, rows r = (position - q0) * g + query head.
template <typename TQ, typename T, int D>
void attend_item(const Item& it, const TQ* q, int64_t q_row, const PagedRows<T, D>& k_rows,
                 const PagedRows<T, D>& v_rows, int64_t g, float scale, int64_t window, TQ* out,
                 int64_t hq, Scratch& w) {
  const int64_t rows = (it.q1 - it.q0) * g;
  w.size(rows, D);
  for (int64_t t = 0; t < it.q1 - it.q0; ++t)
    for (int64_t i = 0; i < g * D; ++i)
      w.q[t * g * D + i] = static_cast<float>(q[(it.row + t) * q_row + it.h * g * D + i]) * scale;
  std::fill(w.o.begin(), w.o.begin() + rows * D, 0.f);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.f);
  std::fill(w.m.begin(), w.m.begin() + rows, std::numeric_limits<float>::lowest());
  const int64_t k_lo = window > 0 ? std::max<int64_t>(0, it.q0 - window + 1) : 0;
  for (int64_t t0 = k_lo / kKeys * kKeys; t0 < it.q1; t0 += kKeys) {
    const int64_t a = std::max(t0, k_lo) - t0, e = std::min(t0 + kKeys, it.q1) - t0;  // tile columns read
    for (int64_t c = a; c < e; ++c) {
      k_rows.load(t0 + c, w.row.data());
      for (int i = 0; i < D; ++i) w.kt[i * kKeys + c] = w.row[i];
      v_rows.load(t0 + c, w.v.data() + c * D);
    }
    const int64_t pa = a / kNR * kNR;  // whole micro-tiles: the columns outside [a, e) are masked below
    row_blocks(rows, [&](int64_t r0, auto mr) {
      constexpr int MR = decltype(mr)::value;
      for (int64_t c = pa; c < e; c += kNR) score_tile<MR, D>(w.q.data() + r0 * D, w.kt.data() + c, w.s.data() + r0 * kKeys + c);
    });
    // the softmax of each row over its visible columns [lo, hi); the others get weight 0
    const int64_t la = a / kLanes * kLanes, le = (e + kLanes - 1) / kLanes * kLanes;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = it.q0 + r / g;
      const int64_t lo = std::max(a, window > 0 ? pos - window + 1 - t0 : a), hi = std::min(e, pos + 1 - t0);
      float* s = w.s.data() + r * kKeys;
      if (lo >= hi) {
        std::fill(s + a, s + e, 0.f);
        continue;
      }
      float mx = w.m[r];
      for (int64_t c = lo; c < hi; ++c) mx = std::max(mx, s[c]);
      if (mx != w.m[r]) {
        const float alpha = std::exp(w.m[r] - mx);
        w.l[r] *= alpha;
        for (int i = 0; i < D; ++i) w.o[r * D + i] *= alpha;
        w.m[r] = mx;
      }
      // one vector of exps at a time over lane-aligned chunks of the tile (no scalar remainder,
      // and a sum's lanes fixed by the key positions), then the columns outside [lo, hi) zeroed
      for (int64_t c = la; c < le; c += kLanes) {
        float* x = s + c;
#pragma omp simd
        for (int u = 0; u < kLanes; ++u) x[u] = std::exp(std::min(x[u] - mx, 0.f));
      }
      std::fill(s + la, s + lo, 0.f);
      std::fill(s + hi, s + le, 0.f);
      vec sum = {};
      for (int64_t c = la; c < le; c += kLanes) sum += loadv(s + c);
      float total = 0.f;
      for (int u = 0; u < kLanes; ++u) total += sum[u];
      w.l[r] += total;
    }
    row_blocks(rows, [&](int64_t r0, auto mr) {
      constexpr int MR = decltype(mr)::value;
      for (int d = 0; d < D; d += kNR)
        value_tile<MR, D>(w.s.data() + r0 * kKeys, w.v.data() + d, a, e, w.o.data() + r0 * D + d);
    });
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / w.l[r];
    TQ* o = out + (it.row + r / g) * hq * D + (it.h * g + r % g) * D;
    for (int i = 0; i < D; ++i) o[i] = static_cast<TQ>(w.o[r * D + i] * inv);
  }
}

// q: row t at q + t * q_row, [Hq, D] inside it; out: [T, Hq, D]. The cache's type T may be narrower
// than the activations' TQ (fp32 activations over a bf16 / fp16 KV cache).
template <typename TQ, typename T, int D>
void prefill(const TQ* q, int64_t q_row, const T* k_cache, const T* v_cache, const int64_t* block_tables,
             const int64_t* seq_lens, const int64_t* query_start_loc, TQ* out, int64_t num_seqs, int64_t hq,
             int64_t hkv, int64_t max_blocks, int64_t block_size, float scale, int64_t window) {
  const int64_t g = hq / hkv, span = std::max<int64_t>(1, kRows / g);
  std::vector<Item> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b], first = seq_lens[b] - q_len;
    TORCH_CHECK(q_len >= 0 && first >= 0, "paged_prefill_attention: a query longer than its context");
    for (int64_t t = 0; t < q_len; t += span) {
      const int64_t q0 = first + t, q1 = std::min(q0 + span, seq_lens[b]);
      const int64_t keys = q1 - (window > 0 ? std::max<int64_t>(0, q0 - window + 1) : 0);
      for (int64_t h = 0; h < hkv; ++h)
        items.push_back({b, h, q0, q1, query_start_loc[b] - query_start_loc[0] + t, keys * (q1 - q0)});
    }
  }
  // The costliest items first, each thread taking the next when done: causal items' costs differ
  // up to the context's length in tiles, which a static split would leave to one thread.
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    thread_local Scratch scratch;
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      const Item& it = items[i];
      const int64_t* table = block_tables + it.b * max_blocks;
      const PagedRows<T, D> k_rows{k_cache, table, block_size, hkv, it.h}, v_rows{v_cache, table, block_size, hkv, it.h};
      attend_item<TQ, T, D>(it, q, q_row, k_rows, v_rows, g, scale, window, out, hq, scratch);
    }
  });
}

// q: [T, Hq, D] (rows may be strided); k_cache, v_cache: [num_slots, Hkv, D]; block_tables:
// [B, max_blocks] int64; seq_lens: [B] int64 (context length after this step); query_start_loc:
// [B + 1] int64 (sequence b's query is rows [qsl[b] - qsl[0], qsl[b + 1] - qsl[0]) of q, the last
// tokens of its context). Returns [T, Hq, D].
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                   at::Tensor seq_lens, at::Tensor query_start_loc, int64_t block_size, double scale,
                                   int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_prefill_attention: q's heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
              seq_lens.is_contiguous() && query_start_loc.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              query_start_loc.scalar_type() == at::kLong);
  const int64_t b = seq_lens.numel(), hq = q.size(1), d = q.size(2), hkv = k_cache.size(1);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "paged_prefill_attention supports head_dim 64, 128 or 256");
  TORCH_CHECK(hq % hkv == 0 && query_start_loc.numel() == b + 1 && block_tables.size(0) == b);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_prefill_attention: K and V caches' dtypes differ");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  TORCH_CHECK(qsl[b] - qsl[0] == q.size(0), "paged_prefill_attention: query_start_loc does not span q");
  auto out = at::empty({q.size(0), hq, d}, q.options());
  const at::ScalarType tq = q.scalar_type(), tc = k_cache.scalar_type();
  auto run = [&](auto q_type, auto cache_type) {
    using TQ = decltype(q_type);
    using T = decltype(cache_type);
    auto f = d == 64 ? prefill<TQ, T, 64> : d == 128 ? prefill<TQ, T, 128> : prefill<TQ, T, 256>;
    f(q.data_ptr<TQ>(), q.stride(0), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), block_tables.data_ptr<int64_t>(),
      seq_lens.data_ptr<int64_t>(), qsl, out.data_ptr<TQ>(), b, hq, hkv, block_tables.size(1), block_size,
      static_cast<float>(scale), window);
  };
  if (tq == tc) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, tq, "paged_prefill", [&] { run(scalar_t{}, scalar_t{}); });
  } else if (tq == at::kFloat && tc == at::kBFloat16) {
    run(float{}, at::BFloat16{});
  } else if (tq == at::kFloat && tc == at::kHalf) {
    run(float{}, at::Half{});
  } else {
    TORCH_CHECK(false, "paged_prefill_attention: ", tq, " activations over a ", tc,
                " KV cache (the cache holds the activations' type, or bf16 / fp16 under fp32)");
  }
  return out;
}

// This kernel's functions, in its submodule of the unit's module (kernels/__init__.py: UNITS).
void bind(pybind11::module_ m) {
  using pybind11::arg;
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal prefill attention (CPU)", arg("q"),
        arg("k_cache"), arg("v_cache"), arg("block_tables"), arg("seq_lens"), arg("query_start_loc"),
        arg("block_size"), arg("scale"), arg("window") = 0);
}

}  // namespace tandem_cpu_prefill_attention
