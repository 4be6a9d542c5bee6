inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// fp32 -> bf16 bits, round to nearest even (a NaN stays a quiet NaN), as torch rounds.
inline __m128i bf16_bits(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(v)); }

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// max |x| over n inputs (n % 32 == 0).
template <typename T>
float abs_max(const T* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, load8(x + i)));
  return hmax8(top);
}

// q = round(x * inv) for one block of 32 (|x * inv| <= 127); lo and hi: the sums of q over inputs
// 0-15 and 16-31.
template <typename T>
void quantize_block(const T* x, float inv, int8_t* q, int32_t& lo, int32_t& hi) {
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + 8 * i), _mm256_set1_ps(inv)));
  // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute puts them back.
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  lo = hsum8(_mm256_add_epi32(qi[0], qi[1])), hi = hsum8(_mm256_add_epi32(qi[2], qi[3]));
}

inline __m256i quad(const int8_t* x) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x)); }

// 16 in each byte of one register's fifth bits whose bit P (< 4) is set, else 0.
template <int P>
inline __m256i sixteens(__m256i group) {
  return _mm256_and_si256(_mm256_slli_epi16(group, 4 - P), _mm256_set1_epi8(16));
}

inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Adds to dot[r][h] the dots of R rows with block b of an int4 tile, columns 8h-8h+7, each
// widened from int16 by madd with by[h]: ones for the dot itself, or a K-quant's sc in both int16
// of a column's dword for sc times it. High: 5-bit codes, the fifth bits read from wh. A 64-byte
// chunk is columns 0-7 then 8-15, both unpacked once for all R rows. Per row and half the maddubs
// results (|pair| <= 2 * 15 * 127, or 2 * 31 * 127 for 5-bit codes) add up in int16 over 4 chunks
// (2 for 5-bit codes: <= 31496, no overflow) before the madd widens them. Asks for block
// b + kPrefetch's codes: a tile's weights are one stream (the next tile's follow on). Inlined, as
// the AVX-512 one.
template <int R, bool High>
[[gnu::always_inline]] inline void q4_block_dots(const int8_t* xq, int64_t k, int64_t b, const uint8_t* w,
                                                 const uint8_t* wh, const __m256i* by, __m256i (*dot)[2]) {
  constexpr int kWiden = High ? 2 : 4;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (b + kPrefetch) * 256 + j * 64), _MM_HINT_T0);
  if constexpr (High) _mm_prefetch(reinterpret_cast<const char*>(wh + (b + kPrefetch) * 64), _MM_HINT_T0);
  __m256i sum[R][2];
  for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const uint8_t* wj = w + (b * 4 + j) * 64;
    __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj));
    __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 32));
    __m256i lo0 = _mm256_and_si256(raw0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), mask);
    __m256i lo1 = _mm256_and_si256(raw1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), mask);
    if constexpr (High) {
      // bits 0-3 (even chunks) or 4-7 (odd ones) of the group: low-nibble lanes of columns 0-7,
      // 8-15, then the high-nibble lanes
      __m256i group = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh + (b * 2 + j / 2) * 32));
      if (j % 2) group = _mm256_srli_epi16(group, 4);
      lo0 = _mm256_or_si256(lo0, sixteens<0>(group)), lo1 = _mm256_or_si256(lo1, sixteens<1>(group));
      hi0 = _mm256_or_si256(hi0, sixteens<2>(group)), hi1 = _mm256_or_si256(hi1, sixteens<3>(group));
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * k + b * kBlock + 4 * j;
      __m256i xa = quad(xr), xb = quad(xr + 16);
      sum[r][0] = _mm256_add_epi16(sum[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa), _mm256_maddubs_epi16(hi0, xb)));
      sum[r][1] = _mm256_add_epi16(sum[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa), _mm256_maddubs_epi16(hi1, xb)));
      if ((j + 1) % kWiden == 0)
        for (int h = 0; h < 2; ++h)
          dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(sum[r][h], by[h])), sum[r][h] = _mm256_setzero_si256();
    }
  }
}

inline __m256 u8_8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Block b's scales d and mins m (w = d q + m) of columns 8h-8h+7: a K-quant's as d sc and -dmin m.
template <bool K>
inline void q4_block_scales(const Q4Scales& s, int64_t b, int h, __m256& d, __m256& m) {
  if constexpr (K) {
    const uint16_t* dd = s.d + b / 8 * 2 * kTile + 8 * h;
    d = _mm256_mul_ps(half8(dd), u8_8(s.sc_m + b * 2 * kTile + 8 * h));
    m = _mm256_mul_ps(half8(dd + kTile), u8_8(s.sc_m + b * 2 * kTile + kTile + 8 * h));
  } else {
    d = half8(s.d + b * kTile + 8 * h), m = half8(s.m + b * kTile + 8 * h);
  }
}

// R rows x 16 columns of y = x W^T for int4 weights against rows quantised per 32; High: 5-bit
// codes; K: a K-quant's scales; kept: the scales in fp32 (Reuse).
template <int R, bool High, bool K, Reuse Mode, typename T>
void q4_tile(const Rows& x, int64_t k, const uint8_t* w, const uint8_t* wh, const Q4Scales& s, float* kept, T* y, int64_t ldy) {
  const int64_t nb = k / kBlock;
  const __m256i ones[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(1)};
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (Mode != Reuse::kept) q4_prefetch<K>(s, b + kPrefetch);
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    q4_block_dots<R, High>(x.q, k, b, w, wh, ones, dot);
    for (int h = 0; h < 2; ++h) {
      __m256 d, m;
      const int64_t at = b * 2 * kTile + 8 * h;  // these scales in kept (null with Reuse::none)
      if constexpr (Mode == Reuse::kept) {
        d = _mm256_loadu_ps(kept + at), m = _mm256_loadu_ps(kept + at + kTile);
      } else {
        q4_block_scales<K>(s, b, h, d, m);
        if constexpr (Mode == Reuse::keep) _mm256_storeu_ps(kept + at, d), _mm256_storeu_ps(kept + at + kTile, m);
      }
      for (int r = 0; r < R; ++r) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(x.d[r * nb + b])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.ds[r * nb + b]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store8(y + r * ldy, acc[r][0]), store8(y + r * ldy + 8, acc[r][1]);
}

// R rows x 16 columns for Q4_K (w = d sc q - dmin m) against rows quantised per 256
// (quantize_row_256): each block's dot is widened by madd with its columns' sc, so sc times it
// adds up in int32 over the super-block (|sum| <= 8 * 32 * 15 * 127 * 63 < 2^31); the mins as m
// times each block's sum of q (madd over block pairs); d and -dmin times x's d apply once per
// super-block, not a float multiply and two FMAs a block, row and half.
template <int R, typename T>
void q4k_tile(const Rows& x, int64_t k, const uint8_t* w, const uint16_t* wd, const uint8_t* sc_m, T* y, int64_t ldy) {
  const int64_t nb = k / kBlock;
  const __m128i twice[2] = {_mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                            _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)};
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    _mm_prefetch(reinterpret_cast<const char*>(wd + (sb + 1) * 2 * kTile), _MM_HINT_T0);
    __m256i sum[R][2];
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
    for (int64_t b = sb * 8; b < sb * 8 + 8; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(sc_m + (b + kPrefetch) * 2 * kTile), _MM_HINT_T0);
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc_m + b * 2 * kTile));
      const __m256i by[2] = {_mm256_cvtepu8_epi16(_mm_shuffle_epi8(sc, twice[0])), _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sc, twice[1]))};
      q4_block_dots<R, false>(x.q, k, b, w, nullptr, by, sum);
    }
    __m256i mins[R][2];
    for (int r = 0; r < R; ++r) mins[r][0] = mins[r][1] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {  // blocks 2i and 2i + 1: each column's two m as int16 beside each other
      const uint8_t* m0 = sc_m + (sb * 8 + 2 * i) * 2 * kTile + kTile;
      __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m0));
      __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m0 + 2 * kTile));
      const __m256i pair[2] = {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(lo, hi)), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(lo, hi))};
      for (int r = 0; r < R; ++r) {
        const __m256i sums = _mm256_set1_epi32(x.s16[r * nb + sb * 4 + i]);
        for (int h = 0; h < 2; ++h) mins[r][h] = _mm256_add_epi32(mins[r][h], _mm256_madd_epi16(pair[h], sums));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = half8(wd + sb * 2 * kTile + 8 * h), neg_dmin = half8(wd + sb * 2 * kTile + kTile + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 x_d = _mm256_set1_ps(x.d[r * nb + sb]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), _mm256_mul_ps(d, x_d), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[r][h]), _mm256_mul_ps(neg_dmin, x_d), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store8(y + r * ldy, acc[r][0]), store8(y + r * ldy + 8, acc[r][1]);
}

// R rows x 16 columns for int8 weights stored as q + 128: q = byte ^ 0x80, and maddubs takes
// |q| (unsigned, 128 for -128) times x with q's sign (|pair| <= 2 * 128 * 127, no saturation).
// Blocked: an fp16 scale per column and block (wd, GGUF Q8_0), else per column (ws).
template <int R, bool Blocked, typename T>
void q8_tile(const int8_t* xq, const float* xd, const int32_t*, int64_t k, const uint8_t* w,
             const float* ws, const uint16_t* wd, T* y, int64_t ldy) {
  const int64_t nb = k / kBlock;
  const __m256i top = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 8; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (b + kPrefetch) * 512 + j * 64), _MM_HINT_T0);
    if constexpr (Blocked) _mm_prefetch(reinterpret_cast<const char*>(wd + (b + kPrefetch) * kTile), _MM_HINT_T0);
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const uint8_t* wj = w + (b * 8 + j) * 64;
      __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj)), top);
      __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 32)), top);
      __m256i aq0 = _mm256_abs_epi8(q0), aq1 = _mm256_abs_epi8(q1);  // |-128| = 128 as unsigned
      for (int r = 0; r < R; ++r) {
        __m256i x = quad(xq + r * k + b * kBlock + 4 * j);
        dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(aq0, _mm256_sign_epi8(x, q0)), ones));
        dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(aq1, _mm256_sign_epi8(x, q1)), ones));
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 d = _mm256_setzero_ps();
      if constexpr (Blocked) d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b * kTile + 8 * h)));
      for (int r = 0; r < R; ++r) {
        __m256 scale = _mm256_set1_ps(xd[r * nb + b]);
        if constexpr (Blocked) scale = _mm256_mul_ps(d, scale);
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), scale, acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      store8(y + r * ldy + 8 * h, Blocked ? acc[r][h] : _mm256_mul_ps(_mm256_loadu_ps(ws + 8 * h), acc[r][h]));
}

// R rows x 16 columns for Q6_K weights (the q6k layout above). A chunk's two lanes are one
// sub-block: their maddubs of 6-bit codes against x add in int16 (|pair| <= 2 * 63 * 127, two
// of them 32004) and widen through madd by the sub-block's scale (sc in both int16 of a
// column's dword): one int32 dot a row and column half per block; the -32 comes off as madd of
// x's two sub-block sums by (32 sc_0, 32 sc_1), then d and x's d.
template <int R, Reuse Mode, typename T>
void q6_tile(const int8_t* xq, const float* xd, const int32_t* xs, int64_t k, const uint8_t* w, const uint8_t* wh,
             const int8_t* wsc, const uint16_t* wd, uint8_t* kept, T* y, int64_t ldy) {
  const int64_t nb = k / kBlock;
  const __m256i mask = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
  const __m128i twice[2] = {_mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                            _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)};
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (Mode != Reuse::kept) {
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (b + kPrefetch) * 256 + j * 64), _MM_HINT_T0);
      for (int j = 0; j < 2; ++j) _mm_prefetch(reinterpret_cast<const char*>(wh + (b + kPrefetch) * 128 + j * 64), _MM_HINT_T0);
    }
    _mm_prefetch(reinterpret_cast<const char*>(wsc + (b + kPrefetch) * 32), _MM_HINT_T0);
    const __m128i lo_sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wsc + b * 32));
    const __m128i hi_sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wsc + b * 32 + 16));
    __m256i scale[2][2], offset[2];  // [sub-block][column half h: columns 8h-8h+7]
    for (int h = 0; h < 2; ++h) {
      scale[0][h] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(lo_sc, twice[h]));
      scale[1][h] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(hi_sc, twice[h]));
      offset[h] = _mm256_slli_epi16(_mm256_cvtepi8_epi16(h ? _mm_unpackhi_epi8(lo_sc, hi_sc) : _mm_unpacklo_epi8(lo_sc, hi_sc)), 5);
    }
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int p = 0; p < 2; ++p) {
      const uint8_t* wp = wh + (b * 2 + p) * 64;
      __m256i plane0 = _mm256_setzero_si256(), plane1 = _mm256_setzero_si256();
      if constexpr (Mode != Reuse::kept) {
        plane0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
        plane1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32));
      }
      for (int c = 0; c < 2; ++c) {
        const int j = 2 * p + c;
        // kept as the AVX-512 build keeps them: the low-nibble lanes' codes (columns 0-7, 8-15), then the
        // high ones' (formed only where kept is a buffer: null with Reuse::none)
        __m256i lo0, lo1, hi0, hi1;
        if constexpr (Mode == Reuse::kept) {
          const __m256i* codes = reinterpret_cast<const __m256i*>(kept + (b * 4 + j) * 128);
          lo0 = _mm256_loadu_si256(codes), lo1 = _mm256_loadu_si256(codes + 1);
          hi0 = _mm256_loadu_si256(codes + 2), hi1 = _mm256_loadu_si256(codes + 3);
        } else {
          const uint8_t* wj = w + (b * 4 + j) * 64;
          __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj));
          __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 32));
          // the top bits at 16 and 32: chunk c's lane l sits at bit 2(2c + l) of the plane
          auto lo_top = [&](__m256i v) { return _mm256_and_si256(c ? v : _mm256_slli_epi16(v, 4), top); };
          auto hi_top = [&](__m256i v) { return _mm256_and_si256(c ? _mm256_srli_epi16(v, 2) : _mm256_slli_epi16(v, 2), top); };
          lo0 = _mm256_or_si256(_mm256_and_si256(raw0, mask), lo_top(plane0));
          hi0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw0, 4), mask), hi_top(plane0));
          lo1 = _mm256_or_si256(_mm256_and_si256(raw1, mask), lo_top(plane1));
          hi1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw1, 4), mask), hi_top(plane1));
          if constexpr (Mode == Reuse::keep) {
            __m256i* codes = reinterpret_cast<__m256i*>(kept + (b * 4 + j) * 128);
            _mm256_storeu_si256(codes, lo0), _mm256_storeu_si256(codes + 1, lo1);
            _mm256_storeu_si256(codes + 2, hi0), _mm256_storeu_si256(codes + 3, hi1);
          }
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * k + b * kBlock + 8 * j;
          __m256i xa = quad(xr), xb = quad(xr + 4);
          __m256i sum0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa), _mm256_maddubs_epi16(hi0, xb));
          __m256i sum1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa), _mm256_maddubs_epi16(hi1, xb));
          dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(sum0, scale[p][0]));
          dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(sum1, scale[p][1]));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b / 8 * kTile + 8 * h)));
      for (int r = 0; r < R; ++r) {
        __m256i net = _mm256_sub_epi32(dot[r][h], _mm256_madd_epi16(_mm256_set1_epi32(xs[r * nb + b]), offset[h]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(net), _mm256_mul_ps(d, _mm256_set1_ps(xd[r * nb + b])), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store8(y + r * ldy, acc[r][0]), store8(y + r * ldy + 8, acc[r][1]);
}

// exp(v), 8 lanes, as exp16 in the AVX-512 build (2^n built in the exponent bits: n in [-127, 127]).
inline __m256 exp8(__m256 v) {
  v = _mm256_max_ps(_mm256_min_ps(v, _mm256_set1_ps(88.f)), _mm256_set1_ps(-88.f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), v);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), f);
  __m256 e = _mm256_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) e = _mm256_fmadd_ps(e, f, _mm256_set1_ps(c));
  __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(pow2));
}

inline __m256 round_as(__m256 v, const float*) { return v; }
inline __m256 round_as(__m256 v, const at::BFloat16*) {  // to bf16 and back
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits(v)), 16));
}

// Gemma's gelu-tanh, 8 lanes, as gelu_tanh16 in the AVX-512 build.
inline __m256 gelu_tanh8(__m256 x) {
  const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(kGeluBeta),
                                     _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(kGeluKappa), _mm256_mul_ps(_mm256_mul_ps(x, x), x))));
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  const __m256 a = _mm256_andnot_ps(sign, inner);
  __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(exp8(_mm256_add_ps(a, a)), one)));
  t = _mm256_blendv_ps(t, one, _mm256_cmp_ps(a, _mm256_set1_ps(kTanhOne), _CMP_GT_OQ));
  t = _mm256_or_ps(t, _mm256_and_ps(inner, sign));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t));
}

// y = act(g) * u for 16 columns of fp32 gate and up, as the AVX-512 build's gated16.
template <Gate G, typename T>
inline void gated16(const float* gate, const float* up, T* y) {
  const T* tag = nullptr;
  for (int h = 0; h < 16; h += 8) {
    __m256 g = round_as(load8(gate + h), tag), u = round_as(load8(up + h), tag), s;
    if constexpr (G == Gate::gelu_tanh)
      s = gelu_tanh8(g);
    else
      s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    store8(y + h, _mm256_mul_ps(round_as(s, tag), u));
  }
}
