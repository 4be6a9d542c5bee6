inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// max |x| over n inputs (n % 32 == 0).
template <typename T>
float abs_max(const T* x, int64_t n) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(x + i)));
  return _mm512_reduce_max_ps(top);
}

// q = round(x * inv) for one block of 32 (|x * inv| <= 127); lo and hi: the sums of q over inputs
// 0-15 and 16-31.
template <typename T>
void quantize_block(const T* x, float inv, int8_t* q, int32_t& lo, int32_t& hi) {
  __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x), _mm512_set1_ps(inv)));
  __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + 16), _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
  lo = _mm512_reduce_add_epi32(qlo), hi = _mm512_reduce_add_epi32(qhi);
}

inline __m512i quad(const int8_t* x) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x)); }

inline __m512 half16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// Adds to dot[r] the int32 dots of R rows with block b of an int4 tile, 16 columns each; High:
// 5-bit codes, the fifth bits read from wh. Asks for block b + kPrefetch's codes: a tile's weights
// are one stream (the next tile's follow on; at batch 1 the hardware prefetcher alone left it at
// ~20 GB/s). Inlined: called, its dot registers went through memory (SmolLM2's Q4_1 at 16 rows:
// 12% slower).
template <int R, bool High>
[[gnu::always_inline]] inline void q4_block_dots(const int8_t* xq, int64_t k, int64_t b, const uint8_t* w,
                                                 const uint8_t* wh, __m512i* dot) {
  const __m512i mask = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
  for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (b + kPrefetch) * 256 + j * 64), _MM_HINT_T0);
  if constexpr (High) _mm_prefetch(reinterpret_cast<const char*>(wh + (b + kPrefetch) * 64), _MM_HINT_T0);
  for (int j = 0; j < 4; ++j) {
    __m512i raw = _mm512_loadu_si512(w + (b * 4 + j) * 64);
    __m512i lo = _mm512_and_si512(raw, mask), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
    if constexpr (High) {
      uint64_t bits[2];
      std::memcpy(bits, wh + (b * 4 + j) * 16, 16);
      lo = _mm512_mask_add_epi8(lo, bits[0], lo, sixteen);
      hi = _mm512_mask_add_epi8(hi, bits[1], hi, sixteen);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * k + b * kBlock + 4 * j;
      dot[r] = _mm512_dpbusd_epi32(dot[r], lo, quad(xr));
      dot[r] = _mm512_dpbusd_epi32(dot[r], hi, quad(xr + 16));
    }
  }
}

inline __m512 u8_16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Block b's 16 column scales d and mins m (w = d q + m): a K-quant's as d sc and -dmin m.
template <bool K>
inline void q4_block_scales(const Q4Scales& s, int64_t b, __m512& d, __m512& m) {
  if constexpr (K) {
    const uint16_t* dd = s.d + b / 8 * 2 * kTile;
    d = _mm512_mul_ps(half16(dd), u8_16(s.sc_m + b * 2 * kTile));
    m = _mm512_mul_ps(half16(dd + kTile), u8_16(s.sc_m + b * 2 * kTile + kTile));
  } else {
    d = half16(s.d + b * kTile), m = half16(s.m + b * kTile);
  }
}

// R rows x 16 columns of y = x W^T for int4 weights against rows quantised per 32 (tile: one
// 16-column slice of the packed weight); High: 5-bit codes; K: a K-quant's scales; kept: the
// scales in fp32 (Reuse).
template <int R, bool High, bool K, Reuse Mode, typename T>
void q4_tile(const Rows& x, int64_t k, const uint8_t* w, const uint8_t* wh, const Q4Scales& s, float* kept, T* y, int64_t ldy) {
  const int64_t nb = k / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (Mode != Reuse::kept) q4_prefetch<K>(s, b + kPrefetch);
    __m512 d, m;
    const int64_t at = b * 2 * kTile;  // this block's scales in kept (null with Reuse::none)
    if constexpr (Mode == Reuse::kept) {
      d = _mm512_loadu_ps(kept + at), m = _mm512_loadu_ps(kept + at + kTile);
    } else {
      q4_block_scales<K>(s, b, d, m);
      if constexpr (Mode == Reuse::keep) _mm512_storeu_ps(kept + at, d), _mm512_storeu_ps(kept + at + kTile, m);
    }
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    q4_block_dots<R, High>(x.q, k, b, w, wh, dot);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(x.d[r * nb + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.ds[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(y + r * ldy, acc[r]);
}

// R rows x 16 columns for Q4_K (w = d sc q - dmin m) against rows quantised per 256
// (quantize_row_256): each block's int32 dot times its columns' sc adds up in int32 over the
// super-block (|sum| <= 8 * 32 * 15 * 127 * 63 < 2^31), the mins as m times each block's sum of
// q (vpdpwssd over block pairs); d and -dmin times x's d apply once per super-block, where a
// float multiply and two FMAs a block and row shared the dot products' pipes (the ~3B file at 16
// rows: ~10% faster end to end, AMD EPYC Zen 4).
template <int R, typename T>
void q4k_tile(const Rows& x, int64_t k, const uint8_t* w, const uint16_t* wd, const uint8_t* sc_m, T* y, int64_t ldy) {
  const int64_t nb = k / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    _mm_prefetch(reinterpret_cast<const char*>(wd + (sb + 1) * 2 * kTile), _MM_HINT_T0);
    __m512i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
    for (int64_t b = sb * 8; b < sb * 8 + 8; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(sc_m + (b + kPrefetch) * 2 * kTile), _MM_HINT_T0);
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
      q4_block_dots<R, false>(x.q, k, b, w, nullptr, dot);
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc_m + b * 2 * kTile)));
      for (int r = 0; r < R; ++r) sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(dot[r], sc));
    }
    __m512i mins[R];
    for (int r = 0; r < R; ++r) mins[r] = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {  // blocks 2i and 2i + 1: each column's two m as int16 beside each other
      const uint8_t* m0 = sc_m + (sb * 8 + 2 * i) * 2 * kTile + kTile;
      __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m0));
      __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m0 + 2 * kTile));
      __m512i pair = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
      for (int r = 0; r < R; ++r) mins[r] = _mm512_dpwssd_epi32(mins[r], pair, _mm512_set1_epi32(x.s16[r * nb + sb * 4 + i]));
    }
    const __m512 d = half16(wd + sb * 2 * kTile), neg_dmin = half16(wd + sb * 2 * kTile + kTile);
    for (int r = 0; r < R; ++r) {
      const __m512 x_d = _mm512_set1_ps(x.d[r * nb + sb]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(d, x_d), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[r]), _mm512_mul_ps(neg_dmin, x_d), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(y + r * ldy, acc[r]);
}

// R rows x 16 columns for int8 weights stored as q + 128: each block's 128 * sum(x) comes off
// its int32 dot (in fp32 at the end, that large a term cancelled ~1e-4 of the output at K = 8192).
// Blocked: an fp16 scale per column and block (wd, GGUF Q8_0), else per column (ws).
template <int R, bool Blocked, typename T>
void q8_tile(const int8_t* xq, const float* xd, const int32_t* xs, int64_t k, const uint8_t* w,
             const float* ws, const uint16_t* wd, T* y, int64_t ldy) {
  const int64_t nb = k / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 8; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (b + kPrefetch) * 512 + j * 64), _MM_HINT_T0);
    if constexpr (Blocked) _mm_prefetch(reinterpret_cast<const char*>(wd + (b + kPrefetch) * kTile), _MM_HINT_T0);
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i wv = _mm512_loadu_si512(w + (b * 8 + j) * 64);
      for (int r = 0; r < R; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], wv, quad(xq + r * k + b * kBlock + 4 * j));
    }
    for (int r = 0; r < R; ++r) {
      const int32_t sums = xs[r * nb + b], sum = static_cast<int16_t>(sums & 0xffff) + (sums >> 16);
      __m512i net = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * sum));
      __m512 scale = _mm512_set1_ps(xd[r * nb + b]);
      if constexpr (Blocked)
        scale = _mm512_mul_ps(scale, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wd + b * kTile))));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(net), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(y + r * ldy, Blocked ? acc[r] : _mm512_mul_ps(_mm512_loadu_ps(ws), acc[r]));
}

// R rows x 16 columns for Q6_K weights (the q6k layout above). Per block and row the two
// sub-blocks (chunks 0-1, 2-3) add up apart; each takes its 32 * sum(x) off and its scale sc,
// in int32 (|dot| <= 32 * 127 * (63 * 128 + 32 * 128)), then d and x's d.
template <int R, Reuse Mode, typename T>
void q6_tile(const int8_t* xq, const float* xd, const int32_t* xs, int64_t k, const uint8_t* w, const uint8_t* wh,
             const int8_t* wsc, const uint16_t* wd, uint8_t* kept, T* y, int64_t ldy) {
  const int64_t nb = k / kBlock;
  const __m512i mask = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (Mode != Reuse::kept) {
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (b + kPrefetch) * 256 + j * 64), _MM_HINT_T0);
      for (int j = 0; j < 2; ++j) _mm_prefetch(reinterpret_cast<const char*>(wh + (b + kPrefetch) * 128 + j * 64), _MM_HINT_T0);
    }
    _mm_prefetch(reinterpret_cast<const char*>(wsc + (b + kPrefetch) * 32), _MM_HINT_T0);
    __m512i lo_dot[R], hi_dot[R];
    for (int r = 0; r < R; ++r) lo_dot[r] = hi_dot[r] = _mm512_setzero_si512();
    for (int p = 0; p < 2; ++p) {
      __m512i plane = Mode == Reuse::kept ? _mm512_setzero_si512() : _mm512_loadu_si512(wh + (b * 2 + p) * 64);
      for (int c = 0; c < 2; ++c) {
        const int j = 2 * p + c;
        const int64_t at = (b * 4 + j) * 128;  // this chunk's codes in kept (null with Reuse::none)
        __m512i lo, hi;
        if constexpr (Mode == Reuse::kept) {
          lo = _mm512_loadu_si512(kept + at), hi = _mm512_loadu_si512(kept + at + 64);
        } else {
          __m512i raw = _mm512_loadu_si512(w + (b * 4 + j) * 64);
          lo = _mm512_and_si512(raw, mask), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
          __m512i lo_top = c ? plane : _mm512_slli_epi16(plane, 4);
          __m512i hi_top = c ? _mm512_srli_epi16(plane, 2) : _mm512_slli_epi16(plane, 2);
          lo = _mm512_or_si512(lo, _mm512_and_si512(lo_top, top));
          hi = _mm512_or_si512(hi, _mm512_and_si512(hi_top, top));
          if constexpr (Mode == Reuse::keep) _mm512_storeu_si512(kept + at, lo), _mm512_storeu_si512(kept + at + 64, hi);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * k + b * kBlock + 8 * j;
          __m512i& dot = p ? hi_dot[r] : lo_dot[r];  // sub-block p
          dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot, lo, quad(xr)), hi, quad(xr + 4));
        }
      }
    }
    __m512i lo_sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wsc + b * 32)));
    __m512i hi_sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wsc + b * 32 + 16)));
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wd + b / 8 * kTile)));
    for (int r = 0; r < R; ++r) {
      const int32_t s = xs[r * nb + b];
      __m512i lo_off = _mm512_set1_epi32(32 * static_cast<int16_t>(s & 0xffff)), hi_off = _mm512_set1_epi32(32 * (s >> 16));
      __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_sub_epi32(lo_dot[r], lo_off), lo_sc),
                                     _mm512_mullo_epi32(_mm512_sub_epi32(hi_dot[r], hi_off), hi_sc));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(xd[r * nb + b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(y + r * ldy, acc[r]);
}

// exp(v) for v in fp32, 16 lanes: 2^n * e^f with n = round(v / ln 2), |f| <= ln 2 / 2, e^f by
// its degree-6 Taylor polynomial (relative error < 2e-7, below the bf16 / fp32 rounding after it).
inline __m512 exp16(__m512 v) {
  v = _mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), v);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), f);
  __m512 e = _mm512_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(e, n);
}

inline __m512 round_as(__m512 v, const float*) { return v; }
inline __m512 round_as(__m512 v, const at::BFloat16*) {  // to bf16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// Gemma's gelu-tanh in torch's formula and order: 0.5 x (1 + tanh(beta (x + kappa (x x) x))), +-1
// past |u| > kTanhOne; only the tanh is this file's, sign(u) (1 - 2 / (exp(2|u|) + 1)). The 1 + tanh
// cancels for x < 0 in torch too, so that is where an fp32 value may differ most (~6e-6 of itself);
// bf16 values round to torch's. Computed as x sigmoid(2u) instead (more exact), 7% of bf16 values
// differed from torch's by a step.
inline __m512 gelu_tanh16(__m512 x) {
  const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(kGeluBeta),
                                     _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(kGeluKappa), _mm512_mul_ps(_mm512_mul_ps(x, x), x))));
  const __m512 a = _mm512_abs_ps(inner), one = _mm512_set1_ps(1.f);
  __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(exp16(_mm512_add_ps(a, a)), one)));
  t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(kTanhOne), _CMP_GT_OQ), t, one);
  t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),  // t >= 0: u's sign (no AVX512DQ)
                                          _mm512_and_si512(_mm512_castps_si512(inner), _mm512_castps_si512(_mm512_set1_ps(-0.f)))));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, t));
}

// y = act(g) * u for 16 columns of fp32 gate and up, each value rounded to T where PyTorch's ops
// round; SiLU as torch's g / (1 + exp(-g)).
template <Gate G, typename T>
inline void gated16(const float* gate, const float* up, T* y) {
  const T* tag = nullptr;
  __m512 g = round_as(load16(gate), tag), u = round_as(load16(up), tag), s;
  if constexpr (G == Gate::gelu_tanh)
    s = gelu_tanh16(g);
  else
    s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  store16(y, _mm512_mul_ps(round_as(s, tag), u));
}
