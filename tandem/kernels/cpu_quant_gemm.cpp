// Integer-activation GEMMs for the quantised linears on CPU (W4A8, W6A8 and W8A8, as llama.cpp's
// Q4_1 x Q8_1, Q4_K x Q8_K, Q6_K x Q8_K and Q8_0 x Q8_0): each activation row is quantised to int8
// with one fp32 scale per block of 32 (per 256 against Q4_K, as llama.cpp's Q8_K, so its
// sub-block scales apply in integer), and the dot products run on integer instructions instead of
// dequantising every weight to floats, which made torch's int4 / int8 kernels compute-bound. Two
// builds of one design, chosen by the compiler's target (-march=native):
//  AVX-512 (VNNI, BW, BF16): `vpdpbusd`, 64 u8 x s8 products per instruction, 16 columns a register.
//  AVX2 (FMA, F16C): `vpmaddubsw` (u8 x s8 pairs to int16) then `vpmaddwd` (to int32), 8 columns
//  a register; its int32 dot products equal vpdpbusd's exactly.
// Output column tiles are handed out in chunks over torch's own thread pool (at::parallel_for in
// torch's OpenMP runtime: no second team). A row's result does not depend on the other rows.
//
// Packed weights, 16 output columns per tile, 32 inputs per block (one layout for both builds but
// the fifth-bit plane):
//  int4: [N/16][K/32][4][64] bytes; byte (j, 4n+i) holds column n's code for input 4j+i in
//        its low nibble and for input 16+4j+i in its high nibble. Scales d and mins m: fp16 [N/16][K/32][16],
//        w = d q + m (GGUF Q4_1, whose d and m are fp16 too). A K-quant (GGUF Q4_K / Q5_K, w = d sc q -
//        dmin m) keeps its own factors instead: u8 sc and m [N/16][K/32][2][16] (sc then m per block)
//        and fp16 d and -dmin [N/16][K/256][2][16], 4.625 bits a weight against fp16 d and m's 5.
//        Q4_K's tile sums sc times each block's dot in int32 over a super-block (q4k_tile);
//        Q5_K's forms d sc and -dmin m in fp32 per block, exactly as gguf's dequantisation does.
//        5-bit codes (GGUF Q5_0 / Q5_1 / Q5_K, q in [0, 31]) add their fifth bits as a plane beside
//        the nibbles, 64 bytes per tile and block, laid out for the build that reads it (the tile
//        adds 16 where a bit is set):
//         AVX-512: [4][2][8] bytes, for chunk j the 64 bits of its low-nibble lanes then of its
//           high-nibble lanes, bit 4n+i for byte (j, 4n+i): a mask register each.
//         AVX2: [2][32] bytes, the 16 registers' worth of a block (chunk j, nibble lane l,
//           columns 0-7 or 8-15 as h) as bit 4(j%2) + 2l + h of group j/2, byte 4n'+i for column
//           8h+n': an and and a shift place a register's bits at 16 (a bit spread costs five ops).
//  q6k (GGUF Q6_K as it is, w = d sc (q - 32), q in [0, 63]): the low 4 bits of q in int4's
//        nibble layout, but for the inputs' order: nibble lane l of chunk j holds input 8j + 4l + i,
//        so both lanes of chunks 0-1 are the block's first Q6_K sub-block (16 inputs, one scale)
//        and of chunks 2-3 its second. The top 2 bits a plane beside them, [N/16][K/32][2][64]
//        bytes, one layout for both builds: byte (p, 4n+i) holds, in bits 2(2c + l) and
//        2(2c + l) + 1, the top bits of the code in nibble lane l of chunk 2p + c at byte 4n+i,
//        so a shift and an and place a register's bits at 16 and 32. Scales sc int8
//        [N/16][K/32][2][16] (sub-block s: inputs 16s-16s+15 of the block), d fp16
//        [N/16][K/256][16]. u8 codes against s8 inputs need no sign trick; the -32 comes back as
//        32 sc times each sub-block's sum of inputs.
//  int8: [N/16][K/32][8][64] bytes, byte (j, 4n+i) = q(n, 4j+i) + 128 (unsigned for vpdpbusd),
//        q in [-127, 127]; one fp32 scale per column, or (GGUF Q8_0 as it is, q in [-128, 127])
//        an fp16 d per column and block, [N/16][K/32][16]. AVX-512 takes the +128 back out of each
//        block's int32 dot as 128 * sum(x); AVX2 flips the top bit back to q and multiplies |q|
//        by x with q's sign.
//
// gate: for a fused gate_up projection ([gate | up], N = 2I) the kernel computes a chunk of
// gate tiles, then the matching up tiles, and writes act(gate) * up, [M, I] (act: SiLU, or
// Gemma's gelu-tanh), rounding where the unfused path rounds (gate and up to the output dtype,
// act, the product): at batch 1 the separate chunk / act / mul ops cost more than the GEMM's own
// epilogue, and at 16 rows torch's gelu and mul took 3 ms of Gemma 3 270M's ~53 ms step (AVX2).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: its C++ frontend headers add ~15 s of parsing (21 s against 5 s, g++ -fsyntax-only, AMD EPYC Zen 3)
#include <immintrin.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace tandem_cpu_quant_gemm {

namespace {

constexpr int64_t kBlock = 32, kTile = 16, kPrefetch = 8, kChunksPerThread = 8;
// gate: the most fp32 outputs of gate (and of up) a thread holds at a time (128 KB each).
constexpr int64_t kGateFloats = 32768;

// A gate_up projection's activation (Python's models.layers.Gate has the same values).
enum class Gate : int64_t { none = 0, silu = 1, gelu_tanh = 2 };
// gelu-tanh's sqrt(2 / pi) and cubic factor as torch has them, and where Sleef's tanhf (torch's)
// returns +-1.
constexpr float kGeluBeta = 0.7978845608028654f, kGeluKappa = 0.044715f, kTanhOne = 8.664339742f;

// Where a tile takes several row reads (more rows than it reads each weight for), the first read
// keeps what it derives from the weights in a per-thread buffer and the later reads load it: a
// Q6_K tile's unpacked codes (a byte a code, [K/32][4][2][64]; at 16 rows, 4 reads, unpacking was
// most of its work beside the dot products), an int4 tile's scales d and m in fp32 ([K/32][2][16]).
// A single read keeps nothing.
enum class Reuse { none, keep, kept };

// The activations of R rows: int8 codes [R][K] and, per row (each K / 32 long), each block's d,
// d * sum(q) and sums of q over its inputs 0-15 and 16-31 as two int16 (quantize_row); for
// Q4_K's tiles (quantize_row_256) one d per 256 inputs, and at s16[i] blocks 2i and 2i + 1's
// sums of q as two int16.
struct Rows {
  const int8_t* q;
  const float *d, *ds;
  const int32_t* s16;
};

// An int4 tile's scales: fp16 d and m per block, or a 5-bit K-quant's factors (sc_m set; d then
// holds d and -dmin per 256, m is null), formed per block as d sc and -dmin m.
struct Q4Scales {
  const uint16_t* d;
  const uint16_t* m;
  const uint8_t* sc_m;
};

// Prefetch block b's scales.
template <bool K>
inline void q4_prefetch(const Q4Scales& s, int64_t b) {
  if constexpr (K) {
    _mm_prefetch(reinterpret_cast<const char*>(s.sc_m + b * 2 * kTile), _MM_HINT_T0);
    if (b % 8 == 0) _mm_prefetch(reinterpret_cast<const char*>(s.d + b / 8 * 2 * kTile), _MM_HINT_T0);
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(s.d + b * kTile), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(s.m + b * kTile), _MM_HINT_T0);
  }
}

// Rows per weight read (at most; `max_rows`): an int4 row holds an accumulator and a dot register,
// so 8 fit in AVX-512's 32 registers beside the codes (with 4 the int4 GEMMs of 1B shapes at 16
// rows ran 6% slower, AMD EPYC Zen 4). AVX2 reads for 8 too, though its 16 ymm registers then
// spill: on an AVX2-only Zen 3 the int4 GEMMs at 16 rows ran 4-10% faster than reading for 4
// (Q4_K and Q4_1; 16 a read was slower again). The q6k and int8 tiles keep more registers a row
// and read for kNarrowRows (on that Zen 3, 2 or 8 rows a read were slower, 3 and 6 no faster).
constexpr int64_t kRows = 8, kNarrowRows = 4;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TANDEM_QUANT_GEMM 512
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

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TANDEM_QUANT_GEMM 256

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
#endif

enum class Format { int4, int8, q6k };

// A packed weight as the GEMM reads it, made once per layer (its shapes are checked then, not per
// call). It holds its tensors, not their addresses: host_memory.py re-points a tensor at a copy
// on huge pages in place, so the addresses are read at each call. Fields as in Weights below;
// undefined where the format has none.
struct PackedWeight {
  Format format;
  int64_t n, k;
  at::Tensor w, h, d, m, scales, sc, sc_m;
};

#ifdef TANDEM_QUANT_GEMM
constexpr bool kBuilt = true;

inline int32_t two_int16(int32_t lo, int32_t hi) {
  return static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xffff) | (static_cast<uint32_t>(hi) << 16));
}

// One row, GGUF's Q8_1: q = round(x / d) in [-127, 127] per block of 32, d = max|x| / 127;
// ds = d * sum(q); s16 the sums of q over inputs 0-15 and 16-31 as two int16 (low, high half).
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* d, float* ds, int32_t* s16) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float top = abs_max(x + b * kBlock, kBlock), inv = top > 0.f ? 127.f / top : 0.f;
    int32_t lo, hi;
    quantize_block(x + b * kBlock, inv, q + b * kBlock, lo, hi);
    d[b] = top / 127.f;
    ds[b] = d[b] * static_cast<float>(lo + hi);
    s16[b] = two_int16(lo, hi);
  }
}

// One row for Q4_K's tiles, GGUF's Q8_K: one d = max|x| / 127 per 256 inputs, so a
// super-block's sub-block scales apply in integer; s16[i]: blocks 2i and 2i + 1's sums of q as
// two int16.
template <typename T>
void quantize_row_256(const T* x, int64_t k, int8_t* q, float* d, int32_t* s16) {
  for (int64_t s = 0; s < k / 256; ++s) {
    const float top = abs_max(x + s * 256, 256), inv = top > 0.f ? 127.f / top : 0.f;
    int32_t sums[8];
    for (int b = 0; b < 8; ++b) {
      int32_t lo, hi;
      quantize_block(x + s * 256 + b * kBlock, inv, q + s * 256 + b * kBlock, lo, hi);
      sums[b] = lo + hi;
    }
    d[s] = top / 127.f;
    for (int i = 0; i < 4; ++i) s16[s * 4 + i] = two_int16(sums[2 * i], sums[2 * i + 1]);
  }
}

// One packed weight: int4 (fp16 d and m per tile and block, or with sc_m a K-quant's factors; h:
// the fifth bits of 5-bit codes, or null), int8 (fp32 column scales, or fp16 d per tile and block)
// or q6k (h: the top-bit plane, sc, d per 256).
struct Weights {
  const uint8_t* w;
  const uint8_t* h;
  const uint16_t* d;
  const uint16_t* m;
  const float* scales;
  const int8_t* sc;
  const uint8_t* sc_m;
  int64_t n, k;
  Format format;
};


// f(std::integral_constant<Reuse, reuse>): the mode as a template argument.
template <typename F>
void with_reuse(Reuse reuse, F&& f) {
  if (reuse == Reuse::keep)
    f(std::integral_constant<Reuse, Reuse::keep>{});
  else if (reuse == Reuse::kept)
    f(std::integral_constant<Reuse, Reuse::kept>{});
  else
    f(std::integral_constant<Reuse, Reuse::none>{});
}

// Whether a weight takes its activations per 256 (quantize_row_256, GGUF's Q8_K) rather than per
// 32: Q4_K, whose tile then applies its sub-block scales in integer. Q5_K keeps them per 32: per
// 256 cost Gemma 3's Q5_K_M file +0.54% perplexity, 1.13% above its fp32 model (Q4_K_M: -0.25%).
bool per_256(const Weights& p) { return p.format == Format::int4 && p.sc_m && !p.h; }

// An int4 tile: Q4_K's (q4k_tile), or one against rows quantised per 32 with its fifth-bit
// plane, its scales' form and what it keeps as template arguments.
template <int R, typename T>
void q4_dispatch(const Weights& p, const Rows& x, int64_t t, Reuse reuse, uint8_t* kept, T* y, int64_t ldy) {
  const int64_t nb = p.k / kBlock;
  const uint8_t* w = p.w + t * nb * 256;
  if (per_256(p)) return q4k_tile<R>(x, p.k, w, p.d + t * (nb / 8) * 2 * kTile, p.sc_m + t * nb * 2 * kTile, y, ldy);
  const uint8_t* h = p.h ? p.h + t * nb * 64 : nullptr;
  const Q4Scales s = p.sc_m ? Q4Scales{p.d + t * (nb / 8) * 2 * kTile, nullptr, p.sc_m + t * nb * 2 * kTile}
                            : Q4Scales{p.d + t * nb * kTile, p.m + t * nb * kTile, nullptr};
  float* f = reinterpret_cast<float*>(kept);
  auto with_high = [&](auto high) {
    constexpr bool H = decltype(high)::value;
    // kept: the scales come from the buffer, whatever form they are stored in. (Not with_reuse:
    // in that form GCC's K-quant tile ran 22% slower at 16 rows, cause not found.)
    if (reuse == Reuse::kept) return q4_tile<R, H, false, Reuse::kept>(x, p.k, w, h, s, f, y, ldy);
    auto with_mode = [&](auto mode) {
      constexpr Reuse M = decltype(mode)::value;
      if constexpr (H)  // a K-quant here has 5-bit codes (Q5_K): Q4_K went to q4k_tile
        if (p.sc_m) return q4_tile<R, H, true, M>(x, p.k, w, h, s, f, y, ldy);
      q4_tile<R, H, false, M>(x, p.k, w, h, s, f, y, ldy);
    };
    reuse == Reuse::keep ? with_mode(std::integral_constant<Reuse, Reuse::keep>{}) : with_mode(std::integral_constant<Reuse, Reuse::none>{});
  };
  h ? with_high(std::true_type{}) : with_high(std::false_type{});
}

// R rows of 16-column tile t, written to y with row stride ldy; reuse: what this read keeps or
// loads (Reuse), kept: the buffer for it (null with Reuse::none).
template <int R, typename T>
void tile(const Weights& p, const Rows& x, int64_t t, Reuse reuse, uint8_t* kept, T* y, int64_t ldy) {
  const int64_t nb = p.k / kBlock;
  if (p.format == Format::q6k) {
    if constexpr (R <= kNarrowRows) {
      with_reuse(reuse, [&](auto mode) {
        q6_tile<R, decltype(mode)::value>(x.q, x.d, x.s16, p.k, p.w + t * nb * 256, p.h + t * nb * 128, p.sc + t * nb * 32,
                                          p.d + t * (nb / 8) * kTile, kept, y, ldy);
      });
    } else {
      TORCH_CHECK(false, "quant gemm: a q6k tile reads at most ", kNarrowRows, " rows (max_rows)");
    }
  } else if (p.format == Format::int8) {
    if constexpr (R <= kNarrowRows) {
      if (p.d)
        q8_tile<R, true>(x.q, x.d, x.s16, p.k, p.w + t * nb * 512, nullptr, p.d + t * nb * kTile, y, ldy);
      else
        q8_tile<R, false>(x.q, x.d, x.s16, p.k, p.w + t * nb * 512, p.scales + t * kTile, nullptr, y, ldy);
    } else {
      TORCH_CHECK(false, "quant gemm: an int8 tile reads at most ", kNarrowRows, " rows (max_rows)");
    }
  } else {
    q4_dispatch<R>(p, x, t, reuse, kept, y, ldy);
  }
}

// f(std::integral_constant<int, n>), for n in [1, R]: the tiles' row count as a template argument.
template <int R, typename F>
void with_rows(int64_t n, F&& f) {
  if constexpr (R > 1)
    if (n < R) return with_rows<R - 1>(n, f);
  f(std::integral_constant<int, R>{});
}

// Per-thread scratch for the quantised activations (no tensor allocation per call).
struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> s16;
};

// Rows a tile of this format reads each weight for: the q6k and int8 tiles keep two or more int32
// registers a row, and past 4 rows they spill (Q6_K at 16 rows: 27% slower on AVX-512; at 6, 35%).
int64_t max_rows(Format format) { return format == Format::int4 ? kRows : kNarrowRows; }

// Bytes a tile of this weight keeps per block across its row reads (Reuse): Q6_K's unpacked codes,
// int4's fp32 d and m; Q4_K and int8 tiles derive nothing worth keeping.
int64_t kept_bytes(const Weights& p) {
  return p.format == Format::q6k ? 512 : p.format == Format::int4 && !per_256(p) ? 2 * kTile * sizeof(float) : 0;
}

// One part of the output's columns: its weight, its first tile in the output, the rows a read
// takes (the rows split evenly over the reads: 9 rows as 5 and 4, not 8 and 1), whether its
// first read keeps what the later ones load.
struct Part {
  Weights w;
  int64_t first_tile, per_read;
  bool keeps;
};

// y [M, sum of the parts' N] = x [p_1 | p_2 | ...]^T: quantise x's rows (per 32, and per 256 where a
// part reads them so), then every 16-column tile of every part in one parallel region, up to
// max_rows rows per weight read. One part with a gate: act(gate) * up of its [gate | up].
at::Tensor run(const at::Tensor& x, const std::vector<Weights>& weights, Gate gate_act) {
  const bool gated = gate_act != Gate::none;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quant gemm: contiguous [M, K] input");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant gemm: float32 or bfloat16 input");
  TORCH_CHECK(!weights.empty() && (!gated || weights.size() == 1), "quant gemm: one weight or more; a gate takes one");
  const int64_t m = x.size(0), k = x.size(1), nb = k / kBlock;
  std::vector<Part> parts;
  int64_t n = 0, most_kept = 0;
  bool forms[2] = {false, false};  // rows quantised per 32, per 256
  for (const Weights& w : weights) {
    TORCH_CHECK(w.k == k, "quant gemm: every weight takes K = ", k, " inputs, got ", w.k);
    TORCH_CHECK(!gated || w.n % (2 * kTile) == 0, "quant gemm: a gate needs N % 32 == 0");
    const int64_t cap = max_rows(w.format), reads = (m + cap - 1) / cap;
    parts.push_back({w, n / kTile, reads ? (m + reads - 1) / reads : 1, reads > 1 && kept_bytes(w) > 0});
    n += w.n;
    most_kept = std::max(most_kept, parts.back().keeps ? kept_bytes(w) : 0);
    forms[per_256(w)] = true;
  }
  const int64_t n_out = gated ? n / 2 : n;
  // Each form's slot of scratch: a call of one form uses the first (its size, kept per thread,
  // is then what a single scratch held), parts of both forms the two.
  const int slot[2] = {0, forms[0] && forms[1] ? 1 : 0};
  thread_local Scratch scratch[2];
  Scratch* const acts = scratch;  // this thread's: the lambdas below also run on the pool's threads
  for (int f = 0; f < 2; ++f)
    if (forms[f]) {
      Scratch& a = acts[slot[f]];
      a.q.resize(m * k), a.d.resize(m * nb), a.ds.resize(m * nb), a.s16.resize(m * nb);
    }
  auto y = at::empty({m, n_out}, x.options());
  auto body = [&](auto* xp, auto* yp) {
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (forms[1]) {
          Scratch& a = acts[slot[1]];
          quantize_row_256(xp + r * k, k, a.q.data() + r * k, a.d.data() + r * nb, a.s16.data() + r * nb);
        }
        if (forms[0]) {
          Scratch& a = acts[slot[0]];
          quantize_row(xp + r * k, k, a.q.data() + r * k, a.d.data() + r * nb, a.ds.data() + r * nb, a.s16.data() + r * nb);
        }
      }
    });
    // Tiles are handed out in chunks as threads ask, not as one fixed share each: on a shared
    // machine a thread is often held up, and with fixed shares the other waited at the end of the
    // GEMM (the worker thread idled ~6% of a 3B decode step at 16 rows, AMD EPYC Zen 4).
    const int64_t tiles = n_out / kTile, chunk = std::max<int64_t>(1, tiles / (kChunksPerThread * at::get_num_threads()));
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      thread_local std::vector<uint8_t> kept;  // what a tile keeps across its row reads (Reuse)
      kept.resize(nb * most_kept);
      // Tile t of part `part` (counted from its first; past its N with a gate: up's), every row,
      // into y (row stride ldy).
      auto tile_of = [&](const Part& part, int64_t t, auto* y, int64_t ldy) {
        const Scratch& a = acts[slot[per_256(part.w)]];
        for (int64_t r = 0; r < m; r += part.per_read) {
          const Rows xr{a.q.data() + r * k, a.d.data() + r * nb, a.ds.data() + r * nb, a.s16.data() + r * nb};
          const Reuse reuse = !part.keeps ? Reuse::none : r == 0 ? Reuse::keep : Reuse::kept;
          with_rows<kRows>(std::min(part.per_read, m - r), [&](auto rows) {
            tile<decltype(rows)::value>(part.w, xr, t, reuse, kept.data(), y + r * ldy, ldy);
          });
        }
      };
      thread_local std::vector<float> gate, up;  // a gate: gate's and up's outputs, [m][tiles * 16]
      for (int64_t t0; (t0 = next.fetch_add(chunk, std::memory_order_relaxed)) < tiles;) {
        const int64_t t1 = std::min(t0 + chunk, tiles);
        if (!gated) {
          size_t i = 0;
          for (int64_t t = t0; t < t1; ++t) {
            while (i + 1 < parts.size() && t >= parts[i + 1].first_tile) ++i;
            tile_of(parts[i], t - parts[i].first_tile, yp + t * kTile, n_out);
          }
          continue;
        }
        // Gate tiles, then the same up tiles: one stream through memory at a time. Read as a gate
        // tile then its up tile (9 MB apart at 1B shapes), gate_up streamed ~15% slower at batch 1
        // (AMD EPYC Zen 4). As many tiles at a time as keep both halves' outputs within
        // kGateFloats each: the whole chunk at a few rows, a tile at a time at prefill sizes.
        const int64_t step = std::max<int64_t>(1, kGateFloats / (m * kTile));
        for (int64_t s0 = t0; s0 < t1; s0 += step) {
          const int64_t s1 = std::min(s0 + step, t1), width = (s1 - s0) * kTile;
          gate.resize(m * width), up.resize(m * width);
          for (int64_t t = s0; t < s1; ++t) tile_of(parts[0], t, gate.data() + (t - s0) * kTile, width);
          for (int64_t t = s0; t < s1; ++t) tile_of(parts[0], tiles + t, up.data() + (t - s0) * kTile, width);
          auto epilogue = [&](auto act) {
            for (int64_t r = 0; r < m; ++r)
              for (int64_t c = 0; c < width; c += kTile)
                gated16<decltype(act)::value>(gate.data() + r * width + c, up.data() + r * width + c, yp + r * n_out + s0 * kTile + c);
          };
          if (gate_act == Gate::silu)
            epilogue(std::integral_constant<Gate, Gate::silu>{});
          else
            epilogue(std::integral_constant<Gate, Gate::gelu_tanh>{});
        }
      }
    });
  };
  if (x.scalar_type() == at::kFloat)
    body(x.data_ptr<float>(), y.data_ptr<float>());
  else
    body(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  return y;
}

#else
constexpr bool kBuilt = false;
#endif

bool supported() {
  if (!kBuilt) return false;
  __builtin_cpu_init();
#if TANDEM_QUANT_GEMM == 512
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
}

// codes [N, K] as contiguous bytes, whole tiles and blocks.
at::Tensor tile_codes(const at::Tensor& codes, const char* what) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(0) % kTile == 0 && codes.size(1) % kBlock == 0, what, ": [N % 16, K % 32]");
  return codes.to(at::kByte).contiguous();
}

// codes [N, K] uint8 -> the int4 tile layout above (their low 4 bits).
at::Tensor pack_int4(at::Tensor codes) {
  auto c = tile_codes(codes, "pack_int4");
  const int64_t n = c.size(0), k = c.size(1);
  auto out = at::empty({n * k / 2}, c.options());
  const uint8_t* cp = c.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t t = 0; t < n / kTile; ++t)
    for (int64_t b = 0; b < k / kBlock; ++b)
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t col = 0; col < kTile; ++col)
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t* row = cp + (t * kTile + col) * k + b * kBlock + 4 * j + i;
            *op++ = static_cast<uint8_t>((row[0] & 15) | ((row[16] & 15) << 4));
          }
  return out;
}

// codes [N, K] -> a plane of the bits above their nibbles, `bytes` per tile and block: place(op,
// j, lane, col, i, high) puts the code's high bits where the layout keeps them, in op's block.
template <typename Place>
at::Tensor pack_plane(at::Tensor codes, const char* what, int64_t bytes, Place place) {
  auto c = tile_codes(codes, what);
  const int64_t n = c.size(0), k = c.size(1);
  auto out = at::zeros({n / kTile * (k / kBlock) * bytes}, c.options());
  const uint8_t* cp = c.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t t = 0; t < n / kTile; ++t)
    for (int64_t b = 0; b < k / kBlock; ++b, op += bytes)
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t lane = 0; lane < 2; ++lane)
          for (int64_t col = 0; col < kTile; ++col)
            for (int64_t i = 0; i < 4; ++i)
              place(op, j, lane, col, i, cp[(t * kTile + col) * k + b * kBlock + 16 * lane + 4 * j + i] >> 4);
  return out;
}

// codes [N, K] uint8 in [0, 31] -> the fifth-bit plane above, in this build's layout.
at::Tensor pack_high_bits(at::Tensor codes) {
  return pack_plane(codes, "pack_high_bits", 64, [](uint8_t* op, int64_t j, int64_t lane, int64_t col, int64_t i, int high) {
    const int bit = high & 1;
#if TANDEM_QUANT_GEMM == 512
    const int64_t index = (j * 2 + lane) * 64 + 4 * col + i;  // bit of the block's 512
    op[index / 8] |= static_cast<uint8_t>(bit << (index % 8));
#else
    const int64_t h = col / 8, byte = 4 * (col % 8) + i;
    op[(j / 2) * 32 + byte] |= static_cast<uint8_t>(bit << (4 * (j % 2) + 2 * lane + h));
#endif
  });
}

// codes [N, K] uint8 in [0, 63] -> the q6k top-bit plane above (bits 4-5 of each code).
at::Tensor pack_top_bits(at::Tensor codes) {
  return pack_plane(codes, "pack_top_bits", 128, [](uint8_t* op, int64_t j, int64_t lane, int64_t col, int64_t i, int high) {
    op[(j / 2) * 64 + 4 * col + i] |= static_cast<uint8_t>((high & 3) << (2 * (2 * (j % 2) + lane)));
  });
}

// qweight [N, K] int8 -> the int8 tile layout above, in place: a tile is a permutation of its
// own 16 rows' bytes, so a vocabulary's table (Gemma 3: 160 MiB) is never held twice.
// Returns the same storage as [N * K] uint8.
at::Tensor pack_int8_(at::Tensor qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(0) % kTile == 0 && qweight.size(1) % kBlock == 0, "pack_int8_: [N % 16, K % 32]");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(), "pack_int8_: contiguous int8");
  const int64_t n = qweight.size(0), k = qweight.size(1);
  uint8_t* base = reinterpret_cast<uint8_t*>(qweight.data_ptr<int8_t>());
  std::vector<int8_t> rows(kTile * k);
  for (int64_t t = 0; t < n / kTile; ++t) {
    uint8_t* op = base + t * kTile * k;
    std::memcpy(rows.data(), op, rows.size());
    for (int64_t j = 0; j < k / 4; ++j)
      for (int64_t col = 0; col < kTile; ++col)
        for (int64_t i = 0; i < 4; ++i) *op++ = static_cast<uint8_t>(rows[col * k + 4 * j + i] + 128);
  }
  return qweight.view({n * k}).view(at::kByte);
}

// Rows `ids` of an [n, k] weight in its tiles, dequantised: fp32 [len(ids), K], row(t, lane, y)
// writing row `lane` of tile t (row id is column id % 16 of tile id / 16) to y. An embedding
// lookup in a tied quantised vocabulary, where a dozen torch ops per lookup took 50-170 us a step
// at batch 1.
template <typename F>
at::Tensor rows_of(const at::Tensor& ids, int64_t n, int64_t k, const char* what, F&& row) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, what, ": ids [T] int64");
  auto ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  for (int64_t r = 0; r < ids_c.numel(); ++r) TORCH_CHECK(id[r] >= 0 && id[r] < n, what, ": id ", id[r], " out of range");
  auto out = at::empty({ids_c.numel(), k}, at::kFloat);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, ids_c.numel(), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(id[r] / kTile, id[r] % kTile, op + r * k);
  });
  return out;
}

// A Q6_K weight's rows (the q6k tiles gemm reads), dequantised as gguf does: d sc in fp32,
// times q - 32.
at::Tensor q6k_rows(at::Tensor ids, at::Tensor packed, at::Tensor top, at::Tensor sc, at::Tensor d, int64_t k) {
  TORCH_CHECK(k % 256 == 0, "q6k_rows: K % 256");
  const int64_t n = packed.numel() * 2 / k, nb = k / kBlock;
  TORCH_CHECK(n % kTile == 0 && top.numel() == n * k / 4 && sc.numel() == n * k / 16 && d.numel() == n * k / 256 &&
              top.scalar_type() == at::kByte && sc.scalar_type() == at::kChar && d.scalar_type() == at::kHalf,
              "q6k_rows: weight shapes");
  const uint8_t *w = packed.data_ptr<uint8_t>(), *wt = top.data_ptr<uint8_t>();
  const int8_t* wsc = sc.data_ptr<int8_t>();
  const at::Half* wd = d.data_ptr<at::Half>();
  return rows_of(ids, n, k, "q6k_rows", [&](int64_t t, int64_t lane, float* y) {
    for (int64_t b = 0; b < nb; ++b, y += kBlock) {
      const uint8_t *low = w + (t * nb + b) * 256 + 4 * lane, *high = wt + (t * nb + b) * 128 + 4 * lane;
      const float dd = static_cast<float>(wd[(t * (k / 256) + b / 8) * kTile + lane]);
      for (int j = 0; j < 4; ++j) {  // chunk j's nibble lane l: inputs 8j + 4l + i, sub-block j / 2
        const float scale = dd * static_cast<float>(wsc[((t * nb + b) * 2 + j / 2) * kTile + lane]);
        for (int l = 0; l < 2; ++l)
          for (int i = 0; i < 4; ++i) {
            const int q = ((low[j * 64 + i] >> (4 * l)) & 15) | (((high[j / 2 * 64 + i] >> (2 * (2 * (j % 2) + l))) & 3) << 4);
            y[8 * j + 4 * l + i] = scale * static_cast<float>(q - 32);
          }
      }
    }
  });
}

// An int8 weight's rows (the int8 tiles gemm reads), q times its scale: an fp16 d per block of 32 (GGUF
// Q8_0), or an fp32 scale per row.
at::Tensor int8_rows(at::Tensor ids, at::Tensor packed, at::Tensor scales, int64_t k) {
  TORCH_CHECK(k % kBlock == 0, "int8_rows: K % 32");
  const int64_t n = packed.numel() / k, nb = k / kBlock;
  const bool blocked = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(n % kTile == 0 && scales.numel() == (blocked ? n * nb : n) && (blocked || scales.scalar_type() == at::kFloat),
              "int8_rows: weight shapes");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* wd = blocked ? scales.data_ptr<at::Half>() : nullptr;
  const float* ws = blocked ? nullptr : scales.data_ptr<float>();
  return rows_of(ids, n, k, "int8_rows", [&](int64_t t, int64_t lane, float* y) {
    for (int64_t b = 0; b < nb; ++b, y += kBlock) {
      const float scale = wd ? static_cast<float>(wd[(t * nb + b) * kTile + lane]) : ws[t * kTile + lane];
      const uint8_t* q = w + (t * nb + b) * 512 + 4 * lane;  // chunk j's inputs 4j + i at q[64 j + i]
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 4; ++i) y[4 * j + i] = static_cast<float>(q[64 * j + i] - 128) * scale;
    }
  });
}

// An int4 weight: packed from pack_int4, d and m [N/16, K/32, 16] fp16, or (a K-quant: m null) d
// the fp16 d and -dmin [N/16, K/256, 2, 16] and sc_m the u8 sc and m [N/16, K/32, 2, 16]; high:
// the fifth bits from pack_high_bits for 5-bit codes.
std::shared_ptr<PackedWeight> int4_weight(at::Tensor packed, at::Tensor d, std::optional<at::Tensor> m, int64_t n,
                                          std::optional<at::Tensor> high, std::optional<at::Tensor> sc_m) {
  TORCH_CHECK(n > 0 && n % kTile == 0 && packed.numel() % n == 0, "int4_weight: N % 16 and packed [N * K / 2]");
  const int64_t k = packed.numel() * 2 / n;
  TORCH_CHECK(packed.scalar_type() == at::kByte && k % kBlock == 0, "int4_weight: uint8 tiles, K % 32");
  TORCH_CHECK(!high || (high->numel() == n * k / 8 && high->scalar_type() == at::kByte), "int4_weight: fifth-bit plane shape");
  TORCH_CHECK(d.scalar_type() == at::kHalf && (!m || m->scalar_type() == at::kHalf), "int4_weight: fp16 d and m");
  TORCH_CHECK(m.has_value() != sc_m.has_value(), "int4_weight: either m (fp16 d and m per block) or sc_m (a K-quant's factors)");
  if (sc_m) {
    TORCH_CHECK(k % 256 == 0 && d.numel() == n * k / 128 && sc_m->numel() == n * k / 16 && sc_m->scalar_type() == at::kByte,
                "int4_weight: K-quant shapes (K % 256, d and -dmin [N/16, K/256, 2, 16] fp16, sc and m [N/16, K/32, 2, 16] uint8)");
  } else {
    TORCH_CHECK(d.numel() == n * k / kBlock && m->numel() == d.numel(), "int4_weight: weight shapes");
  }
  return std::make_shared<PackedWeight>(PackedWeight{Format::int4, n, k, packed, high.value_or(at::Tensor()), d,
                                                     m.value_or(at::Tensor()), {}, {}, sc_m.value_or(at::Tensor())});
}

// A Q6_K weight: the codes' low nibbles from pack_int4 and top bits from pack_top_bits, sc
// [N/16, K/32, 2, 16] int8, d [N/16, K/256, 16] fp16.
std::shared_ptr<PackedWeight> q6k_weight(at::Tensor packed, at::Tensor top, at::Tensor sc, at::Tensor d, int64_t n) {
  TORCH_CHECK(n > 0 && n % kTile == 0 && packed.numel() % n == 0, "q6k_weight: N % 16 and packed [N * K / 2]");
  const int64_t k = packed.numel() * 2 / n;
  TORCH_CHECK(k % 256 == 0, "q6k_weight: K % 256 (Q6_K blocks)");
  TORCH_CHECK(top.numel() == n * k / 4 && sc.numel() == n * k / 16 && d.numel() == n * k / 256, "q6k_weight: weight shapes");
  TORCH_CHECK(packed.scalar_type() == at::kByte && top.scalar_type() == at::kByte && sc.scalar_type() == at::kChar &&
              d.scalar_type() == at::kHalf, "q6k_weight: uint8 codes and top bits, int8 sc, fp16 d");
  return std::make_shared<PackedWeight>(PackedWeight{Format::q6k, n, k, packed, top, d, {}, {}, sc, {}});
}

// An int8 weight of K inputs: packed by pack_int8_, scales one fp32 per column [N] or an fp16 d
// per column and block [N/16, K/32, 16] (GGUF Q8_0).
std::shared_ptr<PackedWeight> int8_weight(at::Tensor packed, at::Tensor scales, int64_t k) {
  TORCH_CHECK(k > 0 && k % kBlock == 0 && packed.numel() % (k * kTile) == 0 && packed.scalar_type() == at::kByte,
              "int8_weight: K % 32, uint8 tiles [N * K], N % 16");
  const int64_t n = packed.numel() / k;
  if (scales.scalar_type() == at::kHalf) {
    TORCH_CHECK(scales.numel() == n * k / kBlock, "int8_weight: weight shapes");
    return std::make_shared<PackedWeight>(PackedWeight{Format::int8, n, k, packed, {}, scales, {}, {}, {}, {}});
  }
  TORCH_CHECK(scales.numel() == n && scales.scalar_type() == at::kFloat, "int8_weight: weight shapes");
  return std::make_shared<PackedWeight>(PackedWeight{Format::int8, n, k, packed, {}, {}, {}, scales, {}, {}});
}

// y [M, sum of N] = x [W_1 | W_2 | ...]^T (gate, one weight: act(gate) * up of it, Gate's values).
at::Tensor gemm(at::Tensor x, const std::vector<std::shared_ptr<PackedWeight>>& weights, int64_t gate) {
  TORCH_CHECK(gate >= 0 && gate <= static_cast<int64_t>(Gate::gelu_tanh), "quant gemm: gate 0 (none), 1 (SiLU) or 2 (gelu-tanh), got ", gate);
#ifdef TANDEM_QUANT_GEMM
  TORCH_CHECK(supported(), "quant gemm: this CPU lacks the instructions the kernel was built for");
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  std::vector<Weights> views;
  for (const auto& p : weights)
    views.push_back({static_cast<const uint8_t*>(ptr(p->w)), static_cast<const uint8_t*>(ptr(p->h)),
                     static_cast<const uint16_t*>(ptr(p->d)), static_cast<const uint16_t*>(ptr(p->m)),
                     static_cast<const float*>(ptr(p->scales)), static_cast<const int8_t*>(ptr(p->sc)),
                     static_cast<const uint8_t*>(ptr(p->sc_m)), p->n, p->k, p->format});
  return run(x, views, static_cast<Gate>(gate));
#else
  TORCH_CHECK(false, "quant gemm: built without AVX2 / AVX512-VNNI");
#endif
}

}  // namespace

// This kernel's functions, in its submodule of the unit's module (kernels/__init__.py: UNITS).
void bind(pybind11::module_ mod) {
#ifdef TANDEM_QUANT_GEMM
  mod.attr("vector_bits") = TANDEM_QUANT_GEMM;  // which build: 512 (AVX-512) or 256 (AVX2)
#else
  mod.attr("vector_bits") = 0;
#endif
  mod.def("supported", &supported, "whether this CPU runs the build here (AVX512-VNNI / BW / BF16, or AVX2 / FMA / F16C)");
  mod.def("pack_int4", &pack_int4, "int4 codes [N, K] -> packed tiles (their low 4 bits)");
  mod.def("pack_high_bits", &pack_high_bits, "5-bit codes [N, K] -> the tiles' fifth-bit plane");
  mod.def("pack_top_bits", &pack_top_bits, "6-bit codes [N, K] -> the q6k tiles' top-bit plane");
  mod.def("pack_int8_", &pack_int8_, "int8 weights [N, K] -> packed tiles, in place");
  mod.def("q6k_rows", &q6k_rows, "rows ids of a Q6_K weight (q6k tiles) dequantised, fp32 [len(ids), K]",
          py::arg("ids"), py::arg("packed"), py::arg("top"), py::arg("sc"), py::arg("d"), py::arg("k"));
  mod.def("int8_rows", &int8_rows, "rows ids of an int8 weight (int8 tiles) dequantised, fp32 [len(ids), K]",
          py::arg("ids"), py::arg("packed"), py::arg("scales"), py::arg("k"));
  py::class_<PackedWeight, std::shared_ptr<PackedWeight>>(mod, "PackedWeight", "a packed weight as gemm reads it");
  mod.def("int4_weight", &int4_weight, "an int4 weight for gemm: packed tiles, fp16 d and m or a K-quant's d / -dmin and sc_m, fifth bits",
          py::arg("packed"), py::arg("d"), py::arg("m"), py::arg("n"), py::arg("high") = py::none(), py::arg("sc_m") = py::none());
  mod.def("q6k_weight", &q6k_weight, "a Q6_K weight for gemm", py::arg("packed"), py::arg("top"), py::arg("sc"), py::arg("d"),
          py::arg("n"));
  mod.def("int8_weight", &int8_weight, "an int8 weight of K inputs for gemm, per-column fp32 or per-block fp16 scales",
          py::arg("packed"), py::arg("scales"), py::arg("k"));
  mod.def("gemm", &gemm, "x [M, K] @ [W_1 | W_2 | ...]^T in one parallel region, activations quantised to int8 per 32 (per 256 "
          "against Q4_K); gate (one weight): act(gate) * up of it, 1 SiLU, 2 gelu-tanh", py::arg("x"), py::arg("weights"), py::arg("gate") = 0);
}

}  // namespace tandem_cpu_quant_gemm
