// LoRA's low-rank products for a whole batch in one call per linear, as Punica's SGMV: the rows are
// in segments by adapter (slot); each segment's rows take t = x @ A^T (shrink, rank r per part) and
// then y[:, part's columns] += t_part @ B_part^T (expand; the scaling is folded into B). In torch
// that was ~10 small ops per segment per linear, whose fixed cost made the step's LoRA cost grow
// with the number of adapters. fp32 accumulation, FMAs by intrinsics (the unit builds with
// -ffp-contract=off); one rounding of y per element. Row blocks over torch's own thread pool.
//
// The adapters are read where their tensors are (a slot views the host copy): a table per linear,
// one row per slot, [A's address, rank, parts, then per part: B's address, first column, width],
// A [parts * rank, K] and each B [width, rank] row-major in the activations' dtype; A's address 0:
// the slot leaves this linear as it is.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h (see cpu_fused_ops.cpp)
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

namespace tandem_cpu_lora_sgmv {

namespace {

constexpr int64_t kRows = 4;  // rows per block: they share each load of A and B (hsum8: 2 x 4 sums)
constexpr int64_t kSlotHead = 3, kPartCols = 3;

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The sums of eight vectors, one a lane.
inline __m256 hsum8(const __m256* v) {
  __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// t[i][p] = x[i] . a[p] for R rows of x (stride k) and p < n_out; t's rows are `ld` apart.
template <int64_t R, typename T>
void shrink(const T* x, const T* a, int64_t k, int64_t n_out, float* t, int64_t ld) {
  int64_t k8 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  k8 = k / 8 * 8;
#endif
  for (int64_t p = 0; p < n_out; p += 2) {
    const int64_t np = std::min<int64_t>(2, n_out - p);
    float s[R][2] = {};
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[R][2];
    for (int64_t i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const T* a1 = a + (p + np - 1) * k;  // a row again where n_out is odd: its sum is dropped
    for (int64_t c = 0; c < k8; c += 8) {
      __m256 w0 = load8(a + p * k + c), w1 = load8(a1 + c);
      for (int64_t i = 0; i < R; ++i) {
        __m256 v = load8(x + i * k + c);
        acc[i][0] = _mm256_fmadd_ps(v, w0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(v, w1, acc[i][1]);
      }
    }
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < np; ++j) s[i][j] = hsum(acc[i][j]);
#endif
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < np; ++j) {
        for (int64_t c = k8; c < k; ++c) s[i][j] += to_float(x[i * k + c]) * to_float(a[(p + j) * k + c]);
        t[i * ld + p + j] = s[i][j];
      }
  }
}

// y[i][c] += t[i] . b[c] for R rows (t's `ld` apart, y's `ldy`) and c < width (b [width, r]).
// Up to kRows rows per read of b, two columns at a time: their eight sums reduced in one go.
template <int64_t R, typename T>
void expand(const float* t, int64_t ld, const T* b, int64_t r, int64_t width, T* y, int64_t ldy) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (r % 8 == 0) {
    for (; c + 2 <= width; c += 2) {
      __m256 acc[2 * kRows];
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int64_t j = 0; j < r; j += 8) {
        __m256 w0 = load8(b + c * r + j), w1 = load8(b + (c + 1) * r + j);
        for (int64_t i = 0; i < R; ++i) {
          __m256 v = _mm256_loadu_ps(t + i * ld + j);
          acc[2 * i] = _mm256_fmadd_ps(v, w0, acc[2 * i]);
          acc[2 * i + 1] = _mm256_fmadd_ps(v, w1, acc[2 * i + 1]);
        }
      }
      alignas(32) float d[2 * kRows];
      _mm256_store_ps(d, hsum8(acc));
      for (int64_t i = 0; i < R; ++i)
        for (int64_t h = 0; h < 2; ++h) {
          T& o = y[i * ldy + c + h];
          o = static_cast<T>(to_float(o) + d[2 * i + h]);
        }
    }
  }
#endif
  for (; c < width; ++c)
    for (int64_t i = 0; i < R; ++i) {
      float d = 0.f;
      for (int64_t j = 0; j < r; ++j) d += t[i * ld + j] * to_float(b[c * r + j]);
      T& o = y[i * ldy + c];
      o = static_cast<T>(to_float(o) + d);
    }
}

// One block of R rows of a segment: t = x @ A^T, then each part's expand onto its columns.
template <int64_t R, typename T>
void block(const T* x, T* y, int64_t k, int64_t n, const int64_t* slot, std::vector<float>& t) {
  const T* a = reinterpret_cast<const T*>(slot[0]);
  const int64_t rank = slot[1], parts = slot[2], ld = parts * rank;
  t.resize(R * ld);
  shrink<R>(x, a, k, ld, t.data(), ld);
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t* part = slot + kSlotHead + p * kPartCols;
    expand<R>(t.data() + p * rank, ld, reinterpret_cast<const T*>(part[0]), rank, part[2], y + part[1], n);
  }
}

template <typename T>
void sgmv_rows(const T* x, T* y, int64_t k, int64_t n, const int64_t* slot, int64_t r0, int64_t rows, std::vector<float>& t) {
  x += r0 * k;
  y += r0 * n;
  switch (rows) {
    case 4: return block<4>(x, y, k, n, slot, t);
    case 3: return block<3>(x, y, k, n, slot, t);
    case 2: return block<2>(x, y, k, n, slot, t);
    default: return block<1>(x, y, k, n, slot, t);
  }
}

// y += each segment's LoRA product, in place. segments [S, 3]: (slot, first row, end row).
void sgmv(const at::Tensor& x, at::Tensor y, const at::Tensor& segments, const at::Tensor& table) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.is_contiguous() && x.size(0) == y.size(0),
              "lora sgmv: contiguous x [M, K] and y [M, N]");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora sgmv: x and y of one dtype");
  TORCH_CHECK(segments.scalar_type() == at::kLong && table.scalar_type() == at::kLong && segments.is_contiguous() &&
                  table.is_contiguous() && segments.size(1) == 3,
              "lora sgmv: int64 segments [S, 3] and slot table");
  const int64_t k = x.size(1), n = y.size(1), width = table.size(1);
  const int64_t* seg = segments.data_ptr<int64_t>();
  const int64_t* tab = table.data_ptr<int64_t>();
  std::vector<int64_t> blocks;  // (segment, first row) of every row block with an adapter here
  for (int64_t s = 0; s < segments.size(0); ++s) {
    TORCH_CHECK(seg[s * 3] >= 0 && seg[s * 3] < table.size(0) && seg[s * 3 + 2] <= x.size(0), "lora sgmv: bad segment");
    if (tab[seg[s * 3] * width] == 0) continue;
    for (int64_t r = seg[s * 3 + 1]; r < seg[s * 3 + 2]; r += kRows) blocks.insert(blocks.end(), {s, r});
  }
  auto run = [&](const auto* xp, auto* yp) {
    at::parallel_for(0, static_cast<int64_t>(blocks.size() / 2), 1, [&](int64_t b0, int64_t b1) {
      thread_local std::vector<float> t;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t* s = seg + blocks[2 * b] * 3;
        const int64_t r0 = blocks[2 * b + 1], rows = std::min(kRows, s[2] - r0);
        sgmv_rows(xp, yp, k, n, tab + s[0] * width, r0, rows, t);
      }
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: return run(x.data_ptr<float>(), y.data_ptr<float>());
    case at::kBFloat16: return run(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
    case at::kHalf: return run(x.data_ptr<c10::Half>(), y.data_ptr<c10::Half>());
    default: TORCH_CHECK(false, "lora sgmv: float32, bfloat16 or float16 activations");
  }
}

}  // namespace

// This kernel's functions, in its submodule of the unit's module (kernels/__init__.py: UNITS).
void bind(pybind11::module_ mod) {
  mod.attr("slot_head") = kSlotHead;
  mod.attr("part_cols") = kPartCols;
  mod.def("sgmv", &sgmv, "y [M, N] += each segment's (slot, first row, end row) LoRA product of x [M, K], in place",
          py::arg("x"), py::arg("y"), py::arg("segments"), py::arg("table"));
}

}  // namespace tandem_cpu_lora_sgmv
