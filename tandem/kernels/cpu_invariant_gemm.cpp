// Batch-invariant GEMM for CPU: y = x W^T (+ b) where every output element is one fp32 FMA chain
// over k = 0 .. K-1 in order, started at 0, whatever the number of rows M, the row's place in
// the batch or the thread count. MKL's and oneDNN's GEMMs choose their blocking (and split K)
// by shape, so a row's result there depends on how many rows share the call.
//
// Vectorised over output columns only (a lane is a column, never a partial sum), so the
// register blocking (rows x columns per micro-kernel tile, chosen by M) changes which elements
// are computed together but never the arithmetic of one. The scalar fallback uses std::fma,
// which rounds exactly as the vector FMA does.
//
// Packed weight: [ceil(N/16)][K][16] in the weight's dtype (fp32 or bf16; bf16 widens to fp32
// exactly), columns past N zero. Activations bf16 are widened to fp32 once per call; the output
// is rounded to x's dtype after the bias add.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: its C++ frontend headers add ~15 s of parsing (21 s against 5 s, g++ -fsyntax-only, AMD EPYC Zen 3)
#include <immintrin.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

namespace tandem_cpu_invariant_gemm {

namespace {

constexpr int64_t kPanel = 16, kMaxRows = 6;

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// MR rows x NP panels: acc[r][2p + h] holds columns 8h .. 8h + 7 of panel p for row r. The
// unroll pragmas matter: unrolled before scalar replacement, acc lives in registers (else GCC
// keeps a stack copy and stores every accumulator every k).
template <typename W, int MR, int NP>
void tile(const float* x, int64_t ldx, const W* w, int64_t k, float* out) {
  __m256 acc[MR][2 * NP];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * NP; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t panel = k * kPanel;
  for (int64_t i = 0; i < k; ++i) {
#pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      const W* wp = w + p * panel + i * kPanel;
      const __m256 w0 = widen8(wp), w1 = widen8(wp + 8);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m256 b = _mm256_broadcast_ss(x + r * ldx + i);
        acc[r][2 * p] = _mm256_fmadd_ps(b, w0, acc[r][2 * p]);
        acc[r][2 * p + 1] = _mm256_fmadd_ps(b, w1, acc[r][2 * p + 1]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < 2 * NP; ++j) _mm256_storeu_ps(out + r * NP * kPanel + j * 8, acc[r][j]);
}
#else
inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

template <typename W, int MR, int NP>
void tile(const float* x, int64_t ldx, const W* w, int64_t k, float* out) {
  float acc[MR][NP * kPanel] = {};
  for (int64_t i = 0; i < k; ++i)
    for (int p = 0; p < NP; ++p)
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < kPanel; ++c)
          acc[r][p * kPanel + c] = std::fma(x[r * ldx + i], widen(w[(p * k + i) * kPanel + c]), acc[r][p * kPanel + c]);
  std::memcpy(out, acc, sizeof(acc));
}
#endif

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, float*);

// The widest tile for `rows` rows that keeps its accumulators in 12 of the 16 ymm registers.
template <typename W>
int panels_for(int rows, TileFn<W>* fn) {
  switch (rows) {
    case 1: *fn = tile<W, 1, 4>; return 4;
    case 2: *fn = tile<W, 2, 3>; return 3;
    case 3: *fn = tile<W, 3, 2>; return 2;
    case 4: *fn = tile<W, 4, 1>; return 1;
    case 5: *fn = tile<W, 5, 1>; return 1;
    default: *fn = tile<W, 6, 1>; return 1;
  }
}

template <typename W>
TileFn<W> one_panel(int rows) {
  static const TileFn<W> fns[] = {tile<W, 1, 1>, tile<W, 2, 1>, tile<W, 3, 1>, tile<W, 4, 1>, tile<W, 5, 1>, tile<W, 6, 1>};
  return fns[rows - 1];
}

// Rows [m0, m0 + rows) x panels [p, p + np) of the tile buffer into y, bias added, rounded.
template <typename T>
void store(const float* buf, int rows, int64_t np, int64_t m0, int64_t p, int64_t n, const float* bias, T* y) {
  const int64_t end = std::min(n, (p + np) * kPanel);
  for (int r = 0; r < rows; ++r) {
    const float* src = buf + r * np * kPanel - p * kPanel;
    T* dst = y + (m0 + r) * n;
    for (int64_t col = p * kPanel; col < end; ++col) dst[col] = static_cast<T>(bias ? src[col] + bias[col] : src[col]);
  }
}

// Threads split the output panels (the split never changes a column's arithmetic). Within a thread, rows go in blocks whose activations stay in
// L2 (~192 KB); each panel's weights are read once per block, by every 6-row tile of it, and the
// block's last rows (fewer than 6) take a tile as wide as their registers allow.
template <typename W, typename T>
void run_gemm(const float* x, int64_t m, int64_t k, const W* w, int64_t n, const float* bias, T* y) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t block = std::max<int64_t>(kMaxRows, (48 * 1024 / k) / kMaxRows * kMaxRows);
  // A thread takes at least ~1M multiply-adds: below that, waking the team costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / (m * k * kPanel));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    float buf[kMaxRows * 4 * kPanel];
    for (int64_t b0 = 0; b0 < m; b0 += block) {
      const int64_t b1 = std::min(m, b0 + block);
      const int tail = static_cast<int>((b1 - b0) % kMaxRows);
      const int64_t full_end = b1 - tail;
      TileFn<W> wide = nullptr;
      const int64_t np = tail ? panels_for<W>(tail, &wide) : 1;
      for (int64_t p = p0; p < p1; p += np) {
        const int64_t take = std::min(np, p1 - p);
        for (int64_t q = p; q < p + take; ++q) {
          for (int64_t m0 = b0; m0 < full_end; m0 += kMaxRows) {
            tile<W, kMaxRows, 1>(x + m0 * k, k, w + q * k * kPanel, k, buf);
            store(buf, kMaxRows, 1, m0, q, n, bias, y);
          }
        }
        if (!tail) continue;
        if (take == np) {
          wide(x + full_end * k, k, w + p * k * kPanel, k, buf);
          store(buf, tail, np, full_end, p, n, bias, y);
        } else {
          for (int64_t q = p; q < p + take; ++q) {
            one_panel<W>(tail)(x + full_end * k, k, w + q * k * kPanel, k, buf);
            store(buf, tail, 1, full_end, q, n, bias, y);
          }
        }
      }
    }
  });
}

}  // namespace

// weight [N, K] fp32 or bf16 -> [ceil(N/16), K, 16], same dtype, zero-padded columns.
at::Tensor pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack: weight must be [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

// x [M, K] fp32 or bf16; packed from `pack`; bias [N] or None. Returns [M, N] in x's dtype.
at::Tensor gemm(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel, "gemm: x [M, K], packed [P, K, 16]");
  TORCH_CHECK(packed.is_contiguous() && x.size(1) == packed.size(1) && n <= packed.size(0) * kPanel);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gemm: x must be fp32 or bf16");
  TORCH_CHECK(packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16, "gemm: weight fp32 or bf16");
  const auto x32 = x.to(at::kFloat).contiguous();
  std::optional<at::Tensor> b32;
  if (bias.has_value() && bias->defined()) b32 = bias->to(at::kFloat).contiguous();
  const float* bp = b32.has_value() ? b32->data_ptr<float>() : nullptr;
  auto y = at::empty({x.size(0), n}, x.options());
  const int64_t m = x.size(0), k = x.size(1);
  auto run = [&](auto* w) {
    if (x.scalar_type() == at::kFloat) run_gemm(x32.data_ptr<float>(), m, k, w, n, bp, y.data_ptr<float>());
    else run_gemm(x32.data_ptr<float>(), m, k, w, n, bp, y.data_ptr<at::BFloat16>());
  };
  if (packed.scalar_type() == at::kFloat) run(packed.data_ptr<float>());
  else run(packed.data_ptr<at::BFloat16>());
  return y;
}

// This kernel's functions, in its submodule of the unit's module (kernels/__init__.py: UNITS).
void bind(pybind11::module_ mod) {
  mod.def("pack", &pack, "pack a [N, K] weight into 16-column panels");
  mod.def("gemm", &gemm, "batch-invariant y = x W^T (+ b)", py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("n"));
}

}  // namespace tandem_cpu_invariant_gemm
