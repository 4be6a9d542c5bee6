// Paged decode attention for CPU: one query token per sequence, K read in place from the
// block-paged cache, a part's V rows read in place with one KV head and else copied into one buffer
// (no gather of the whole context), fp32 accumulation whatever the cache holds (the activations'
// type, or bf16 / fp16 under fp32 activations: half the bytes to stream); the query heads of a
// GQA group share every K/V row they read, and a context is split into fixed parts that the
// threads share.
// An int8 cache row is D int8 values and then a scale byte per scale_group(D) of them (max |x| / 127
// rounded up to an 8-bit float: executor/kv_quant.py): the scales travel with the row through every
// block copy (swap, P/D, prefix cache). K rows are scored in integers (scores_int8), their scales
// multiplying each group's sum; V's go into the weights of each group's outputs; neither is ever
// multiplied into the row.
// window > 0: a sliding-window layer; each query sees only the last `window` positions (itself
// included), and blocks before them are not read.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: its C++ frontend headers add ~15 s of parsing (21 s against 5 s, g++ -fsyntax-only, AMD EPYC Zen 3)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tandem_cpu_paged_attention {

// A work item is one (sequence, KV head, part of its context): a part is kPart positions from
// the window's start, so a sequence's result depends on its own length only, never on the batch,
// and a batch of one still spreads a long context over the threads (flash-decoding's split). An
// item writes its parts' max score, sum of exps and unnormalised output; a second pass merges them
// in order.
constexpr int64_t kPart = 64, kMaxGroup = 16;

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline v8 load8(const at::BFloat16* p) {  // a bf16 is the top half of an fp32
#ifdef __AVX2__  // one vpmovzxwd: GCC made __builtin_convertvector below a run of shuffles (~25% of the V loop)
  return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  return (v8)(__builtin_convertvector(h, u32x8) << 16);
#endif
}
#ifdef __F16C__
inline v8 load8(const at::Half* p) { return (v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
template <typename T>  // fp64, and fp16 without F16C
inline v8 load8(const T* p) {
  float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return load8(f);
}
inline v8 load8(const int8_t* p) {
#ifdef __AVX2__
  return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef int8_t i8x8 __attribute__((vector_size(8)));
  i8x8 h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, v8);
#endif
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(v8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// Lane i: the sum of v[i]'s lanes (eight horizontal sums in nine shuffles and adds, not 8 x 7).
inline v8 sums8(const v8 (&v)[8]) {
#ifdef __AVX__
  auto pair = [](v8 a, v8 b) { return (v8)_mm256_hadd_ps((__m256)a, (__m256)b); };
  const v8 u0 = pair(pair(v[0], v[1]), pair(v[2], v[3])), u1 = pair(pair(v[4], v[5]), pair(v[6], v[7]));
  return (v8)_mm256_permute2f128_ps((__m256)u0, (__m256)u1, 0x20) + (v8)_mm256_permute2f128_ps((__m256)u0, (__m256)u1, 0x31);
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = hsum(v[i]);
  return out;
#endif
}

// Elements of a cache row: an int8 row carries a scale byte per scale_group(d) values after its d
// values, one for a row of up to 64, else one per 32 (executor/kv_quant.py: scale_group, row_len).
constexpr int64_t scale_group(int64_t d) { return d <= 64 ? 64 : 32; }
constexpr int64_t int8_row_len(int64_t d) { return d + (d + scale_group(d) - 1) / scale_group(d); }
template <typename T, int D>
constexpr int64_t kRowLen = std::is_same<T, int8_t>::value ? int8_row_len(D) : D;

// A scale byte's fp32 bits are (byte << 20) + kScaleBiasBits: 5 exponent bits from 2^-20, 3 mantissa
// bits (kv_quant.py: SCALE_BIAS_BITS, decode_scales).
constexpr uint32_t kScaleBiasBits = 107u << 23;
inline float decode_scale(uint8_t code) {
  const uint32_t bits = (static_cast<uint32_t>(code) << 20) + kScaleBiasBits;
  float s;
  std::memcpy(&s, &bits, sizeof s);
  return s;
}

// Group c's scale of an int8 row of D values.
template <int D>
inline float scale_of(const int8_t* row, int64_t c) { return decode_scale(static_cast<uint8_t>(row[D + c])); }

// amax * (1 / 127) rounded up to a scale byte (kv_quant.py: encode_scales).
inline uint8_t encode_scale(float amax) {
  const float s = amax * (1.f / 127.f);
  uint32_t bits;
  std::memcpy(&bits, &s, sizeof bits);
  const int64_t code = ((static_cast<int64_t>(bits) + 0xFFFFF) >> 20) - (kScaleBiasBits >> 20);
  return static_cast<uint8_t>(std::min<int64_t>(255, std::max<int64_t>(0, code)));
}

// x [d] as an int8 cache row: per group of scale_group(d) values, its scale byte (encode_scale of
// the group's max |x|), values round(x / scale) in [-127, 127]. Written as x * (1 / scale), which
// -ffast-math leaves as it is: the same bits as kv_quant.quantize_kv_rows, the PyTorch form.
template <typename TQ>
inline void quantize_row(const TQ* x, int64_t d, int8_t* out) {
  const int64_t group = scale_group(d);
  for (int64_t c0 = 0; c0 < d; c0 += group) {
    const int64_t c1 = std::min(c0 + group, d);
    float amax = 0.f;
    for (int64_t i = c0; i < c1; ++i) amax = std::max(amax, std::abs(static_cast<float>(x[i])));
    const uint8_t code = encode_scale(amax);
    const float inv = 1.f / decode_scale(code);
    for (int64_t i = c0; i < c1; ++i)
      out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(x[i]) * inv))));
    out[d + c0 / group] = static_cast<int8_t>(code);
  }
}

// Position p's row for KV head h in a cache [num_slots, hkv, row] through block table `table`.
template <typename T, int D>
inline const T* row_of(const T* cache, const int64_t* table, int64_t block_size, int64_t hkv, int64_t h, int64_t p) {
  return cache + ((table[p / block_size] * block_size + p % block_size) * hkv + h) * kRowLen<T, D>;
}

// A K or V row's cache lines, asked for ahead of their use: a sequence's rows for one head lie
// hkv * D elements apart and its blocks anywhere in the pool, which the hardware prefetcher does not
// follow.
constexpr int64_t kAhead = 8;  // K rows ahead of the one being scored
template <typename T, int D, int Hint = _MM_HINT_T0>
inline void prefetch_row(const T* p) {
  for (int64_t o = 0; o < kRowLen<T, D> * static_cast<int64_t>(sizeof(T)); o += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + o, static_cast<_mm_hint>(Hint));
}

// Sums of q . k over a row into a[2j + r]: R K rows (widened), G query heads.
template <int G, int R, typename T, int D>
inline void dots(const float* qj, const T* kp, int64_t stride, v8 (&a)[8]) {
  for (int i = 0; i < D; i += 8) {
    v8 k[R];
    for (int r = 0; r < R; ++r) k[r] = load8(kp + r * stride + i);
    for (int j = 0; j < G; ++j) {
      const v8 q = load8(qj + j * D + i);
      for (int r = 0; r < R; ++r) a[2 * j + r] += q * k[r];
    }
  }
}

// Scores of R (1-2) float K rows (`stride` elements apart from kp) against G (1-4) query heads
// qj [G, D] (fp32, scaled) into s[j * kPart + r]: each K element is read and widened once for the
// G heads.
template <int G, int R, typename T, int D>
inline void scores_of(const float* qj, const T* kp, int64_t stride, float* s) {
  v8 a[8] = {};  // a[2j + r]
  dots<G, R, T, D>(qj, kp, stride, a);
  const v8 sums = sums8(a);
  for (int j = 0; j < G; ++j)
    for (int r = 0; r < R; ++r) s[j * kPart + r] = sums[2 * j + r];
}

// An int8 K row is scored in integers: the query heads as int16 (q16 [G, D], a scale qs[j] each:
// max |q| / 32767, an error some 500 times under the K row's own), and each group's sum of int16 x
// int8 products exact in int32 before its scale. vpmaddwd does 16 of those products an
// instruction, where the float path widens every K value to fp32 (two instructions per 8) first.
constexpr float kQ16Max = 32767.f;
template <int D>
inline void quantize_query(const float* qf, int64_t g, int16_t* q16, float* qs) {
  for (int64_t j = 0; j < g; ++j) {
    float amax = 0.f;
    for (int i = 0; i < D; ++i) amax = std::max(amax, std::abs(qf[j * D + i]));
    qs[j] = amax / kQ16Max;
    const float inv = amax > 0.f ? kQ16Max / amax : 0.f;
    for (int i = 0; i < D; ++i) q16[j * D + i] = static_cast<int16_t>(std::nearbyint(qf[j * D + i] * inv));
  }
}

// Group c's integer sums of R int8 K rows against G int16 query heads, as fp32, into a[2j + r]
// times the rows' group scales.
template <int G, int R, int D>
inline void group_dots(const int16_t* q16, const int8_t* kp, int64_t stride, int c, v8 (&a)[8]) {
  constexpr int kGroup = std::min<int>(D, scale_group(D));
  float ks[R];
  for (int r = 0; r < R; ++r) ks[r] = scale_of<D>(kp + r * stride, c);
#ifdef __AVX2__
  __m256i acc[G][R] = {};
  for (int i = c * kGroup; i < (c + 1) * kGroup; i += 16) {
    __m256i k[R];
    for (int r = 0; r < R; ++r) k[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kp + r * stride + i)));
    for (int j = 0; j < G; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + j * D + i));
      for (int r = 0; r < R; ++r) acc[j][r] = _mm256_add_epi32(acc[j][r], _mm256_madd_epi16(q, k[r]));
    }
  }
  for (int j = 0; j < G; ++j)
    for (int r = 0; r < R; ++r) a[2 * j + r] += (v8)_mm256_cvtepi32_ps(acc[j][r]) * ks[r];
#else
  for (int j = 0; j < G; ++j)
    for (int r = 0; r < R; ++r) {
      int32_t sum = 0;
      for (int i = c * kGroup; i < (c + 1) * kGroup; ++i) sum += q16[j * D + i] * kp[r * stride + i];
      a[2 * j + r][0] += static_cast<float>(sum) * ks[r];
    }
#endif
}

// Scores of R (1-2) int8 K rows against G (1-4) query heads (q16, qs: quantize_query) into
// s[j * kPart + r]. Rows of several groups go one at a time: a group's integer sums and the
// running fp32 ones for G = 4, R = 2 are more than AVX2's 16 registers.
template <int G, int R, int D>
inline void scores_int8(const int16_t* q16, const float* qs, const int8_t* kp, int64_t stride, float* s) {
  constexpr int kGroups = (D + scale_group(D) - 1) / scale_group(D);
  static_assert(D <= scale_group(D) || D % scale_group(D) == 0, "whole groups of K");
  if constexpr (kGroups > 1 && R > 1) {
    for (int r = 0; r < R; ++r) scores_int8<G, 1, D>(q16, qs, kp + r * stride, stride, s + r);
  } else {
    v8 a[8] = {};  // a[2j + r]
    for (int c = 0; c < kGroups; ++c) group_dots<G, R, D>(q16, kp, stride, c, a);
    const v8 sums = sums8(a);
    for (int j = 0; j < G; ++j)
      for (int r = 0; r < R; ++r) s[j * kPart + r] = sums[2 * j + r] * qs[j];
  }
}

// The V side: kW outputs of G query heads at a time summed in registers over the part, each V
// element read and widened once for the G heads, not once per head.
#ifdef __AVX512F__
constexpr int kW = 32;  // 32 registers
#else
constexpr int kW = 16;  // 16 registers: 2G accumulators, 2 V vectors, G weights
#endif
constexpr int64_t kSpanBytes = 16 << 10;  // V rows a pass span holds: half of a 32 KB L1

// f(j0, std::integral_constant<int, G>) for query heads j0 .. j0 + G - 1 of g, G <= 4 at a time.
template <typename F>
inline void head_groups(int64_t g, F&& f) {
  for (int64_t j0 = 0; j0 < g; j0 += 4) {
    switch (std::min<int64_t>(4, g - j0)) {
      case 4: f(j0, std::integral_constant<int, 4>{}); break;
      case 3: f(j0, std::integral_constant<int, 3>{}); break;
      case 2: f(j0, std::integral_constant<int, 2>{}); break;
      default: f(j0, std::integral_constant<int, 1>{}); break;
    }
  }
}

// Positions [lo, hi) (at most kPart) of one sequence (block table `table`) for KV head h and its
// g query heads qf [g, D]: part = m [g] (max score), l [g] (sum of exp(s - m)), acc [g, D]
// (sum of exp(s - m) v).
template <typename T, int D>
void attend_part(const float* qf, const T* k_cache, const T* v_cache, const int64_t* table, int64_t block_size,
                 int64_t hkv, int64_t h, int64_t g, int64_t lo, int64_t hi, float* part) {
  constexpr bool kInt8 = std::is_same<T, int8_t>::value;
  const int64_t len = hi - lo, row_stride = hkv * kRowLen<T, D>;
  auto row = [&](const T* cache, int64_t p) { return row_of<T, D>(cache, table, block_size, hkv, h, p); };
  for (int64_t p = lo; p < std::min(lo + kAhead, hi); ++p) prefetch_row<T, D>(row(k_cache, p));
  constexpr int64_t kGroup = scale_group(D), kGroups = (D + kGroup - 1) / kGroup;  // an int8 row's scales
  static_assert(!kInt8 || kGroup % kW == 0, "a V pass's kW outputs lie in one group");
  float scores[kMaxGroup * kPart], v_scale[kGroups * kPart];
  int16_t q16[kInt8 ? kMaxGroup * D : 1];
  float qs[kMaxGroup];
  if constexpr (kInt8) quantize_query<D>(qf, g, q16, qs);
  for (int64_t p0 = lo, n; p0 < hi; p0 += n) {  // block by block: a block's rows are row_stride apart
    n = std::min(block_size - p0 % block_size, hi - p0);
    const T* kp = row(k_cache, p0);
    // K rows kAhead on (into the next block: its first rows), V for the pass below (the item
    // before asked for it too; without this, ~15% slower), addressed from their block's first row:
    // row_of's division for each row took ~20% of this function.
    const T* vp = row(v_cache, p0);
    const T* next_k = p0 + n < hi ? row(k_cache, p0 + n) : nullptr;  // p0 + n starts a block
    for (int64_t t = 0; t < n; ++t) {
      const int64_t q = p0 + t + kAhead;
      if (q < hi)
        prefetch_row<T, D>(q < p0 + n ? kp + (t + kAhead) * row_stride
                           : q - (p0 + n) < block_size ? next_k + (q - p0 - n) * row_stride : row(k_cache, q));
      prefetch_row<T, D, _MM_HINT_T1>(vp + t * row_stride);
    }
    if constexpr (kInt8)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t c = 0; c < kGroups; ++c) v_scale[c * kPart + p0 - lo + t] = scale_of<D>(vp + t * row_stride, c);
    head_groups(g, [&](int64_t j0, auto g_const) {
      constexpr int G = decltype(g_const)::value;
      float* s = scores + j0 * kPart + (p0 - lo);
      auto score = [&](int64_t t, auto r_const) {
        constexpr int R = decltype(r_const)::value;
        if constexpr (kInt8)
          scores_int8<G, R, D>(q16 + j0 * D, qs + j0, kp + t * row_stride, row_stride, s + t);
        else
          scores_of<G, R, T, D>(qf + j0 * D, kp + t * row_stride, row_stride, s + t);
      };
      int64_t t = 0;
      for (; t + 2 <= n; t += 2) score(t, std::integral_constant<int, 2>{});
      if (t < n) score(t, std::integral_constant<int, 1>{});
    });
  }
  float *m = part, *l = part + g, *acc = part + 2 * g;
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * kPart;
    float mx = -INFINITY, sum = 0.f;  // locals: through m[j] the max is a store-to-load chain
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sj[t]);
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) sum += (sj[t] = std::exp(sj[t] - mx));
    m[j] = mx, l[j] = sum;
  }
  // The part's V rows (v_row): with one KV head a block's rows lie D apart and are read in
  // place (a copy was ~4% of Gemma 3 270M's decode step at 16 rows, AVX2 build); else they lie
  // hkv * D elements apart, in the few L1 sets those addresses map to, and are gathered into one
  // buffer first (read in place, the ~1B's rows, D 64 and 8 KV heads, took ~12% longer, AVX2 Zen 3).
  const T* v_row[kPart];
  thread_local std::vector<T> v_rows;
  if (hkv == 1) {
    for (int64_t p0 = lo, n; p0 < hi; p0 += n) {
      n = std::min(block_size - p0 % block_size, hi - p0);
      const T* vp = row(v_cache, p0);
      for (int64_t t = 0; t < n; ++t) v_row[p0 - lo + t] = vp + t * row_stride;
    }
  } else {
    v_rows.resize(kPart * D);
    for (int64_t p0 = lo, n; p0 < hi; p0 += n) {
      n = std::min(block_size - p0 % block_size, hi - p0);
      const T* vp = row(v_cache, p0);
      for (int64_t t = 0; t < n; ++t) std::memcpy(v_rows.data() + (p0 - lo + t) * D, vp + t * row_stride, D * sizeof(T));
    }
    for (int64_t t = 0; t < len; ++t) v_row[t] = v_rows.data() + t * D;
  }
  // The passes go over the rows a span at a time, a span small enough to stay in L1 across its
  // D / kW passes, the outputs through acc between spans (the same sums in the same order): over
  // a whole part, Gemma 3's 64 fp32 rows of 256 (64 KB) came from L2 in each of 16 passes.
  constexpr int64_t kSpan = std::max<int64_t>(1, kSpanBytes / (D * sizeof(T)));
  head_groups(g, [&](int64_t j0, auto g_const) {
    constexpr int G = decltype(g_const)::value;
    const float* p = scores + j0 * kPart;
    float v_weights[G * kPart];  // int8: the softmax's weights times the scales of V's group
    for (int64_t t0 = 0; t0 < len; t0 += kSpan) {
      const int64_t t1 = std::min(t0 + kSpan, len);
      for (int i0 = 0; i0 < D; i0 += kW) {
        const float* w = p;
        if constexpr (kInt8) {  // a group's outputs take kGroup / kW passes: its weights once
          const float* vs = v_scale + i0 / kGroup * kPart;
          if (i0 % kGroup == 0)
            for (int j = 0; j < G; ++j)
              for (int64_t t = t0; t < t1; ++t) v_weights[j * kPart + t] = p[j * kPart + t] * vs[t];
          w = v_weights;
        }
        v8 a[G][kW / 8] = {};
        if (t0 > 0)
          for (int j = 0; j < G; ++j)
            for (int u = 0; u < kW / 8; ++u) a[j][u] = load8(acc + (j0 + j) * D + i0 + 8 * u);
        for (int64_t t = t0; t < t1; ++t) {
          const T* vp = v_row[t] + i0;
          v8 v[kW / 8];
          for (int u = 0; u < kW / 8; ++u) v[u] = load8(vp + 8 * u);
          for (int j = 0; j < G; ++j) {
            const float wt = w[j * kPart + t];
            for (int u = 0; u < kW / 8; ++u) a[j][u] += wt * v[u];
          }
        }
        for (int j = 0; j < G; ++j)
          for (int u = 0; u < kW / 8; ++u) store8(acc + (j0 + j) * D + i0 + 8 * u, a[j][u]);
      }
    }
  });
}

// q: row b at q + b * q_row, [Hq, D] inside it; out: [B, Hq, D]. The cache's type T may be
// narrower than the activations' TQ (fp32 activations over a bf16 / fp16 KV cache).
template <typename TQ, typename T, int D>
static void decode(const TQ* q, int64_t q_row, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, TQ* out, int64_t num_seqs, int64_t hq, int64_t hkv,
                   int64_t max_blocks, int64_t block_size, float scale, int64_t window) {
  const int64_t g = hq / hkv, part_size = g * (D + 2);
  TORCH_CHECK(g <= kMaxGroup, "paged decode: at most ", kMaxGroup, " query heads per KV head");
  auto first_pos = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : int64_t{0}; };
  std::vector<int64_t> first_item(num_seqs + 1, 0);  // sequence b's items: [first_item[b], first_item[b + 1])
  for (int64_t b = 0; b < num_seqs; ++b)
    first_item[b + 1] = first_item[b] + hkv * std::max<int64_t>(1, (seq_lens[b] - first_pos(b) + kPart - 1) / kPart);
  // Every item writes its own part: no zeroing. Kept across calls: a fresh buffer is fresh pages,
  // which the OS zeroed at each call (batch 1, 160 positions, 28 layers: 1.07 -> 0.95 ms).
  thread_local std::vector<float> parts_buffer;
  parts_buffer.resize(std::max<size_t>(parts_buffer.size(), first_item[num_seqs] * part_size));
  float* const parts = parts_buffer.data();
  // A sequence's items go part by part, its KV heads within a part: a thread's next item reads
  // the same blocks (a position's rows for all heads lie together), whose pages and lines the
  // one before brought in (int8 at 16k, the ~1B shape: ~20% faster than head by head).
  struct Span { int64_t b, h, lo, hi; };  // an item's sequence, KV head and positions
  auto span = [&](int64_t item) {
    const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const int64_t lo = first_pos(b) + (item - first_item[b]) / hkv * kPart;
    return Span{b, (item - first_item[b]) % hkv, lo, std::min(lo + kPart, seq_lens[b])};
  };
  at::parallel_for(0, first_item[num_seqs], 1, [&](int64_t begin, int64_t end) {
    float qf[kMaxGroup * D];
    for (int64_t item = begin; item < end; ++item) {
      const Span at = span(item);
      if (item + 1 < end) {  // the next item's rows, on their way to L2 while this one computes
        const Span next = span(item + 1);
        const int64_t* table = block_tables + next.b * max_blocks;
        for (int64_t p0 = next.lo, n; p0 < next.hi; p0 += n) {
          n = std::min(block_size - p0 % block_size, next.hi - p0);
          const T* kp = row_of<T, D>(k_cache, table, block_size, hkv, next.h, p0);
          const T* vp = row_of<T, D>(v_cache, table, block_size, hkv, next.h, p0);
          for (int64_t t = 0; t < n; ++t) {
            prefetch_row<T, D, _MM_HINT_T1>(kp + t * hkv * kRowLen<T, D>);
            prefetch_row<T, D, _MM_HINT_T1>(vp + t * hkv * kRowLen<T, D>);
          }
        }
      }
      for (int64_t i = 0; i < g * D; ++i) qf[i] = static_cast<float>(q[at.b * q_row + at.h * g * D + i]) * scale;
      attend_part<T, D>(qf, k_cache, v_cache, block_tables + at.b * max_blocks, block_size, hkv, at.h, g, at.lo, at.hi,
                        parts + item * part_size);
    }
  });
  // merge each (sequence, KV head)'s parts in order
  at::parallel_for(0, num_seqs * hkv, 16, [&](int64_t begin, int64_t end) {
    float acc[D];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hkv, h = item % hkv, per_head = (first_item[b + 1] - first_item[b]) / hkv;
      const float* first = parts + (first_item[b] + h) * part_size;
      for (int64_t j = 0; j < g; ++j) {
        float m = -INFINITY, l = 0.f;
        for (int64_t p = 0; p < per_head; ++p) m = std::max(m, first[p * hkv * part_size + j]);
        std::fill(acc, acc + D, 0.f);
        for (int64_t p = 0; p < per_head; ++p) {
          const float* part = first + p * hkv * part_size;
          const float w = std::exp(part[j] - m);
          l += w * part[g + j];
          for (int i = 0; i < D; ++i) acc[i] += w * part[2 * g + j * D + i];
        }
        TQ* o = out + (b * hq + h * g + j) * D;
        for (int i = 0; i < D; ++i) o[i] = static_cast<TQ>(acc[i] / l);
      }
    }
  });
}

// f(TQ{}, T{}) for the (activations, cache) types a call pairs: one type, fp32 activations over
// a bf16 / fp16 cache, or any activations over an int8 cache.
template <typename F>
void dispatch_types(at::ScalarType q, at::ScalarType cache, const char* name, F&& f) {
  if (cache == at::kChar) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q, "paged_decode", [&] { f(scalar_t{}, int8_t{}); });
  } else if (q == cache) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q, "paged_decode", [&] { f(scalar_t{}, scalar_t{}); });
  } else if (q == at::kFloat && cache == at::kBFloat16) {
    f(float{}, at::BFloat16{});
  } else if (q == at::kFloat && cache == at::kHalf) {
    f(float{}, at::Half{});
  } else {
    TORCH_CHECK(false, name, ": ", q, " activations over a ", cache,
                " KV cache (the cache holds the activations' type, int8, or bf16 / fp16 under fp32)");
  }
}

// q: [B, Hq, D]; k_cache, v_cache: [num_slots, Hkv, D] (int8: int8_row_len(D)); block_tables: [B, max_blocks] int64;
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
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode_attention: K and V caches' dtypes differ");
  TORCH_CHECK(k_cache.size(2) == (k_cache.scalar_type() == at::kChar ? int8_row_len(d) : d),
              "paged_decode_attention: cache rows do not fit head_dim ", d);
  dispatch_types(q.scalar_type(), k_cache.scalar_type(), "paged_decode_attention", [&](auto tq, auto tkv) {
    using TQ = decltype(tq);
    using T = decltype(tkv);
    auto run = d == 64 ? decode<TQ, T, 64> : d == 128 ? decode<TQ, T, 128> : decode<TQ, T, 256>;
    run(q.data_ptr<TQ>(), hq * d, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), block_tables.data_ptr<int64_t>(),
        seq_lens.data_ptr<int64_t>(), out.data_ptr<TQ>(), b, hq, hkv, block_tables.size(1), block_size,
        static_cast<float>(scale), window);
  });
  return out;
}

// A decode-only step's whole attention from the layer's fused projection: qkv [B, (Hq + 2 Hkv) D]
// (q, k, v of one token per sequence, RoPE applied); writes k and v at slot_mapping [B] of
// kv_cache [2, num_slots, Hkv, D] (int8: quantised, int8_row_len(D)), then attends. Returns [B, Hq * D]. At batch 1 the separate
// split / index_copy_ / slice / copy ops around the kernel cost more than the attention.
at::Tensor paged_decode_qkv(at::Tensor qkv, at::Tensor kv_cache, at::Tensor slot_mapping,
                            at::Tensor block_tables, at::Tensor seq_lens, int64_t num_heads,
                            int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && kv_cache.dim() == 4 && kv_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && slot_mapping.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
              slot_mapping.scalar_type() == at::kLong);
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  const int64_t b = qkv.size(0), hkv = kv_cache.size(2), row_len = kv_cache.size(3),
                d = qkv.size(1) / (num_heads + 2 * hkv), slots = kv_cache.size(1);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "paged_decode_qkv supports head_dim 64, 128 or 256");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * hkv) * d && row_len == (int8 ? int8_row_len(d) : d) &&
              slot_mapping.numel() == b && seq_lens.numel() >= b);
  auto out = at::empty({b, num_heads * d}, qkv.options());
  dispatch_types(qkv.scalar_type(), kv_cache.scalar_type(), "paged_decode_qkv", [&](auto tq, auto tkv) {
    using TQ = decltype(tq);
    using T = decltype(tkv);
    const TQ* src = qkv.data_ptr<TQ>();
    T* k_cache = kv_cache.data_ptr<T>();
    T* v_cache = k_cache + slots * hkv * row_len;
    const int64_t row = qkv.size(1), kv = hkv * d;
    const int64_t* slot = slot_mapping.data_ptr<int64_t>();
    for (int64_t i = 0; i < b; ++i) {
      TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "paged_decode_qkv: slot out of range");
      const TQ* k = src + i * row + num_heads * d;
      if constexpr (std::is_same<T, int8_t>::value) {
        for (int64_t h = 0; h < 2 * hkv; ++h)  // K's heads, then V's
          quantize_row(k + h * d, d, (h < hkv ? k_cache : v_cache) + (slot[i] * hkv + h % hkv) * row_len);
      } else {  // a narrower cache rounds to nearest even, as torch's casts do
        std::copy_n(k, kv, k_cache + slot[i] * kv);
        std::copy_n(k + kv, kv, v_cache + slot[i] * kv);
      }
    }
    auto run = d == 64 ? decode<TQ, T, 64> : d == 128 ? decode<TQ, T, 128> : decode<TQ, T, 256>;
    run(src, row, k_cache, v_cache, block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
        out.data_ptr<TQ>(), b, num_heads, hkv, block_tables.size(1), block_size, static_cast<float>(scale),
        window);
  });
  return out;
}

// Writes k and v [T, Hkv, D] (unit inner stride) at slot_mapping [T] of an int8 kv_cache
// [2, num_slots, Hkv, int8_row_len(D)], quantised row by row: the KV write of a step that is not decode-only.
void reshape_and_cache_int8(at::Tensor k, at::Tensor v, at::Tensor kv_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kChar);
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.sizes() == v.sizes() &&
              k.scalar_type() == v.scalar_type());
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong);
  const int64_t t = k.size(0), hkv = k.size(1), d = k.size(2), slots = kv_cache.size(1), row = int8_row_len(d);
  TORCH_CHECK(kv_cache.size(2) == hkv && kv_cache.size(3) == row && slot_mapping.numel() == t);
  int8_t* cache = kv_cache.data_ptr<int8_t>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "reshape_and_cache_int8", [&] {
    for (int64_t i = 0; i < t; ++i) {
      TORCH_CHECK(slot[i] >= 0 && slot[i] < slots, "reshape_and_cache_int8: slot out of range");
      for (int64_t h = 0; h < hkv; ++h) {
        quantize_row(k.data_ptr<scalar_t>() + i * k.stride(0) + h * k.stride(1), d, cache + (slot[i] * hkv + h) * row);
        quantize_row(v.data_ptr<scalar_t>() + i * v.stride(0) + h * v.stride(1), d,
                     cache + ((slots + slot[i]) * hkv + h) * row);
      }
    }
  });
}

// This kernel's functions, in its submodule of the unit's module (kernels/__init__.py: UNITS).
void bind(pybind11::module_ m) {
  using pybind11::arg;
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", arg("q"), arg("k_cache"),
        arg("v_cache"), arg("block_tables"), arg("seq_lens"), arg("block_size"), arg("scale"), arg("window") = 0);
  m.def("paged_decode_qkv", &paged_decode_qkv, "KV write and paged decode attention from a fused qkv (CPU)",
        arg("qkv"), arg("kv_cache"), arg("slot_mapping"), arg("block_tables"), arg("seq_lens"), arg("num_heads"),
        arg("block_size"), arg("scale"), arg("window") = 0);
  m.def("reshape_and_cache_int8", &reshape_and_cache_int8, "quantised KV write into an int8 cache (CPU)", arg("k"),
        arg("v"), arg("kv_cache"), arg("slot_mapping"));
}

}  // namespace tandem_cpu_paged_attention
