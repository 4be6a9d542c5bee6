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

#include <algorithm>
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
#include "cpu_quant_gemm_avx512.h"

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TANDEM_QUANT_GEMM 256

#include "cpu_quant_gemm_avx2.h"
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

// The part of weight w read for m rows, its first tile `first_tile`.
Part part_of(const Weights& w, int64_t m, int64_t first_tile) {
  const int64_t cap = max_rows(w.format), reads = (m + cap - 1) / cap;
  return {w, first_tile, reads ? (m + reads - 1) / reads : 1, reads > 1 && kept_bytes(w) > 0};
}

// Quantise rows [r0, r1) of x (K inputs each) into a, per 256 or per 32.
template <typename T>
void quantize_rows(const T* x, int64_t r0, int64_t r1, int64_t k, bool per256, Scratch& a) {
  const int64_t nb = k / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    if (per256)
      quantize_row_256(x + r * k, k, a.q.data() + r * k, a.d.data() + r * nb, a.s16.data() + r * nb);
    else
      quantize_row(x + r * k, k, a.q.data() + r * k, a.d.data() + r * nb, a.ds.data() + r * nb, a.s16.data() + r * nb);
  }
}

void resize(Scratch& a, int64_t m, int64_t k) {
  const int64_t nb = k / kBlock;
  a.q.resize(m * k), a.d.resize(m * nb), a.ds.resize(m * nb), a.s16.resize(m * nb);
}

// Tile t of a part (counted from its first; past its N with a gate: up's) over the m quantised
// rows of a from row r0, into y (row stride ldy).
template <typename T>
void tile_rows(const Part& part, const Scratch& a, int64_t r0, int64_t m, int64_t t, uint8_t* kept, T* y, int64_t ldy) {
  const int64_t k = part.w.k, nb = k / kBlock;
  for (int64_t r = 0; r < m; r += part.per_read) {
    const int64_t at = r0 + r;
    const Rows xr{a.q.data() + at * k, a.d.data() + at * nb, a.ds.data() + at * nb, a.s16.data() + at * nb};
    const Reuse reuse = !part.keeps ? Reuse::none : r == 0 ? Reuse::keep : Reuse::kept;
    with_rows<kRows>(std::min(part.per_read, m - r), [&](auto rows) {
      tile<decltype(rows)::value>(part.w, xr, t, reuse, kept, y + r * ldy, ldy);
    });
  }
}

// Gate tiles [t0, t1) of a [gate | up] part (`tiles` gate tiles) over m rows of a from r0, then
// the same up tiles, written as act(gate) * up into y (row stride ldy) from column t0 * 16. One
// stream through memory at a time: read as a gate tile then its up tile (9 MB apart at 1B
// shapes), gate_up streamed ~15% slower at batch 1 (AMD EPYC Zen 4). As many tiles at a time as
// keep both halves' outputs within kGateFloats each: the whole chunk at a few rows, a tile at a
// time at prefill sizes.
template <typename T>
void gated_tiles(const Part& part, const Scratch& a, int64_t r0, int64_t m, int64_t t0, int64_t t1, int64_t tiles,
                 Gate gate_act, uint8_t* kept, T* y, int64_t ldy) {
  thread_local std::vector<float> gate, up;  // gate's and up's outputs, [m][width]
  const int64_t step = std::max<int64_t>(1, kGateFloats / (m * kTile));
  for (int64_t s0 = t0; s0 < t1; s0 += step) {
    const int64_t s1 = std::min(s0 + step, t1), width = (s1 - s0) * kTile;
    gate.resize(m * width), up.resize(m * width);
    for (int64_t t = s0; t < s1; ++t) tile_rows(part, a, r0, m, t, kept, gate.data() + (t - s0) * kTile, width);
    for (int64_t t = s0; t < s1; ++t) tile_rows(part, a, r0, m, tiles + t, kept, up.data() + (t - s0) * kTile, width);
    auto epilogue = [&](auto act) {
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < width; c += kTile)
          gated16<decltype(act)::value>(gate.data() + r * width + c, up.data() + r * width + c, y + r * ldy + s0 * kTile + c);
    };
    if (gate_act == Gate::silu)
      epilogue(std::integral_constant<Gate, Gate::silu>{});
    else
      epilogue(std::integral_constant<Gate, Gate::gelu_tanh>{});
  }
}

// Tiles of a GEMM's output handed out in chunks as threads ask, not as one fixed share each: on a
// shared machine a thread is often held up, and with fixed shares the other waited at the end of
// the GEMM (the worker thread idled ~6% of a 3B decode step at 16 rows, AMD EPYC Zen 4).
// f(t0, t1, kept) for every chunk of [0, tiles); kept: the thread's buffer of `kept` bytes.
template <typename F>
void for_tile_chunks(int64_t tiles, int64_t kept_size, F&& f) {
  const int64_t chunk = std::max<int64_t>(1, tiles / (kChunksPerThread * at::get_num_threads()));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local std::vector<uint8_t> kept;  // what a tile keeps across its row reads (Reuse)
    kept.resize(kept_size);
    for (int64_t t0; (t0 = next.fetch_add(chunk, std::memory_order_relaxed)) < tiles;)
      f(t0, std::min(t0 + chunk, tiles), kept.data());
  });
}

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
    parts.push_back(part_of(w, m, n / kTile));
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
    if (forms[f]) resize(acts[slot[f]], m, k);
  auto y = at::empty({m, n_out}, x.options());
  auto body = [&](auto* xp, auto* yp) {
    at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
      for (int f = 1; f >= 0; --f)
        if (forms[f]) quantize_rows(xp, r0, r1, k, f, acts[slot[f]]);
    });
    const int64_t tiles = n_out / kTile;
    for_tile_chunks(tiles, nb * most_kept, [&](int64_t t0, int64_t t1, uint8_t* kept) {
      if (gated) return gated_tiles(parts[0], acts[slot[per_256(parts[0].w)]], 0, m, t0, t1, tiles, gate_act, kept, yp, n_out);
      size_t i = 0;
      for (int64_t t = t0; t < t1; ++t) {
        while (i + 1 < parts.size() && t >= parts[i + 1].first_tile) ++i;
        tile_rows(parts[i], acts[slot[per_256(parts[i].w)]], 0, m, t - parts[i].first_tile, kept, yp + t * kTile, n_out);
      }
    });
  };
  if (x.scalar_type() == at::kFloat)
    body(x.data_ptr<float>(), y.data_ptr<float>());
  else
    body(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  return y;
}

// Every chosen expert's weight w[e] over its pairs' rows of a (rows start[e] to start[e + 1]),
// into y (row stride ldy); its output tiles (its gate tiles where gated) in the chunks of
// for_tile_chunks, counted over the chosen experts one after another.
template <typename T>
void expert_tiles(const std::vector<Weights>& w, const std::vector<int64_t>& chosen, const std::vector<int64_t>& start,
                  const Scratch& a, Gate gate_act, T* y, int64_t ldy) {
  std::vector<Part> parts;
  int64_t most_kept = 0;
  for (int64_t e : chosen) {
    parts.push_back(part_of(w[e], start[e + 1] - start[e], 0));
    most_kept = std::max(most_kept, parts.back().keeps ? kept_bytes(w[e]) : 0);
  }
  const bool gated = gate_act != Gate::none;
  const int64_t tiles = (gated ? w[chosen[0]].n / 2 : w[chosen[0]].n) / kTile;
  const int64_t total = static_cast<int64_t>(chosen.size()) * tiles;
  for_tile_chunks(total, w[chosen[0]].k / kBlock * most_kept, [&](int64_t t0, int64_t t1, uint8_t* kept) {
    for (int64_t t = t0; t < t1;) {  // a chunk may run into the next expert's tiles
      const int64_t i = t / tiles, first = i * tiles, end = std::min(t1, first + tiles);
      const int64_t r0 = start[chosen[i]], m = start[chosen[i] + 1] - r0;
      if (gated) {
        gated_tiles(parts[i], a, r0, m, t - first, end - first, tiles, gate_act, kept, y + r0 * ldy, ldy);
      } else {
        for (int64_t u = t; u < end; ++u) tile_rows(parts[i], a, r0, m, u - first, kept, y + r0 * ldy + (u - first) * kTile, ldy);
      }
      t = end;
    }
  });
}

// A mixture-of-experts block's routed experts (see experts below), into out [T, H].
template <typename T>
void run_experts(const T* x, int64_t n_tok, int64_t top_k, const int64_t* ids, const T* wts, const std::vector<Weights>& gate_up,
                 const std::vector<Weights>& down, Gate gate_act, T* out) {
  const int64_t n_exp = gate_up.size(), pairs = n_tok * top_k;
  // the pairs grouped by expert, in order within each (a stable counting sort): pair p's row slot[p]
  std::vector<int64_t> start(n_exp + 1, 0), slot(pairs), order(pairs), chosen;
  for (int64_t p = 0; p < pairs; ++p) ++start[ids[p] + 1];  // ids checked by experts
  for (int64_t e = 0; e < n_exp; ++e) {
    if (start[e + 1]) chosen.push_back(e);
    start[e + 1] += start[e];
  }
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    slot[p] = fill[ids[p]]++;
    order[slot[p]] = p;
  }
  const int64_t h = gate_up[chosen[0]].k, inter = down[chosen[0]].k;  // the others unviewed
  const bool up256 = per_256(gate_up[chosen[0]]), down256 = per_256(down[chosen[0]]);
  for (int64_t e : chosen)
    TORCH_CHECK(gate_up[e].n == gate_up[chosen[0]].n && per_256(gate_up[e]) == up256 && per_256(down[e]) == down256,
                "quant gemm experts: one width and one form of activations a projection");
  thread_local Scratch scratch[3];  // x's rows; them again per pair, grouped; the experts' intermediate rows
  Scratch* const acts = scratch;    // this thread's: the lambdas below also run on the pool's threads
  resize(acts[0], n_tok, h), resize(acts[1], pairs, h), resize(acts[2], pairs, inter);
  at::parallel_for(0, n_tok, 16, [&](int64_t r0, int64_t r1) { quantize_rows(x, r0, r1, h, up256, acts[0]); });
  const int64_t nb = h / kBlock;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t r = order[i] / top_k;
    std::memcpy(acts[1].q.data() + i * h, acts[0].q.data() + r * h, h);
    std::memcpy(acts[1].d.data() + i * nb, acts[0].d.data() + r * nb, nb * sizeof(float));
    std::memcpy(acts[1].ds.data() + i * nb, acts[0].ds.data() + r * nb, nb * sizeof(float));
    std::memcpy(acts[1].s16.data() + i * nb, acts[0].s16.data() + r * nb, nb * sizeof(int32_t));
  }
  std::vector<T> mid(pairs * inter), ys(pairs * h);
  expert_tiles(gate_up, chosen, start, acts[1], gate_act, mid.data(), inter);
  at::parallel_for(0, pairs, 16, [&](int64_t r0, int64_t r1) { quantize_rows(mid.data(), r0, r1, inter, down256, acts[2]); });
  expert_tiles(down, chosen, start, acts[2], Gate::none, ys.data(), h);
  at::parallel_for(0, n_tok, 16, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> js(top_k);
    for (int64_t t = r0; t < r1; ++t) {
      for (int64_t j = 0; j < top_k; ++j) js[j] = t * top_k + j;
      std::sort(js.begin(), js.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
      T* o = out + t * h;
      std::fill(o, o + h, T(0.f));
      for (int64_t p : js) {
        const T* y = ys.data() + slot[p] * h;
        const float wt = static_cast<float>(wts[p]);
        for (int64_t c = 0; c < h; ++c) o[c] = T(static_cast<float>(o[c]) + static_cast<float>(T(static_cast<float>(y[c]) * wt)));
      }
    }
  });
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

#ifdef TANDEM_QUANT_GEMM
// The kernel's view of a packed weight: its tensors' addresses now.
Weights view(const PackedWeight& p) {
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  return {static_cast<const uint8_t*>(ptr(p.w)), static_cast<const uint8_t*>(ptr(p.h)), static_cast<const uint16_t*>(ptr(p.d)),
          static_cast<const uint16_t*>(ptr(p.m)), static_cast<const float*>(ptr(p.scales)), static_cast<const int8_t*>(ptr(p.sc)),
          static_cast<const uint8_t*>(ptr(p.sc_m)), p.n, p.k, p.format};
}

std::vector<Weights> views(const std::vector<std::shared_ptr<PackedWeight>>& weights) {
  TORCH_CHECK(supported(), "quant gemm: this CPU lacks the instructions the kernel was built for");
  std::vector<Weights> out;
  out.reserve(weights.size());
  for (const auto& p : weights) out.push_back(view(*p));
  return out;
}
#endif

// y [M, sum of N] = x [W_1 | W_2 | ...]^T (gate, one weight: act(gate) * up of it, Gate's values).
at::Tensor gemm(at::Tensor x, const std::vector<std::shared_ptr<PackedWeight>>& weights, int64_t gate) {
  TORCH_CHECK(gate >= 0 && gate <= static_cast<int64_t>(Gate::gelu_tanh), "quant gemm: gate 0 (none), 1 (SiLU) or 2 (gelu-tanh), got ", gate);
#ifdef TANDEM_QUANT_GEMM
  return run(x, views(weights), static_cast<Gate>(gate));
#else
  TORCH_CHECK(false, "quant gemm: built without AVX2 / AVX512-VNNI");
#endif
}

// A mixture-of-experts block's routed experts in one call: out [T, H], each token's sum of its
// experts' act(gate) * up then down, times their weights. x [T, H]; ids [T, k] int64 each
// token's experts, weights [T, k] theirs in x's dtype; gate_up ([gate | up], 2I outputs) and
// down (I -> H) every expert's weights. The (token, expert) pairs are grouped by expert, x's rows
// quantised once (not once per expert a token chose) and every chosen expert's gate_up tiles run
// in one parallel region, its down tiles in another, each over its pairs' rows. Each token adds
// its experts' outputs times their weights in order of expert id, rounded as torch's per-expert
// loop rounds (the product, then each sum, in x's dtype), so the tokens are the loop's.
at::Tensor experts(at::Tensor x, at::Tensor ids, at::Tensor weights, const std::vector<std::shared_ptr<PackedWeight>>& gate_up,
                   const std::vector<std::shared_ptr<PackedWeight>>& down, int64_t gate) {
  TORCH_CHECK(gate == 1 || gate == 2, "quant gemm experts: gate 1 (SiLU) or 2 (gelu-tanh), got ", gate);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quant gemm experts: contiguous [T, H] input");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant gemm experts: float32 or bfloat16 input");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "quant gemm experts: ids [T, k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == x.scalar_type() && weights.is_contiguous(),
              "quant gemm experts: weights [T, k] in x's dtype");
  TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), "quant gemm experts: a gate_up and a down per expert");
#ifdef TANDEM_QUANT_GEMM
  TORCH_CHECK(supported(), "quant gemm: this CPU lacks the instructions the kernel was built for");
  // views of the chosen experts only (the others left null): a decode step at 1 row chooses 8
  // of Qwen3-MoE's 128 experts, whose 256 weights' addresses a call need not look up
  const int64_t n_exp = gate_up.size();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<Weights> up(n_exp), dn(n_exp);
  for (int64_t p = 0; p < ids.numel(); ++p) {
    const int64_t e = id[p];
    TORCH_CHECK(e >= 0 && e < n_exp, "quant gemm experts: expert id ", e, " of ", n_exp);
    if (up[e].w) continue;
    up[e] = view(*gate_up[e]), dn[e] = view(*down[e]);
    TORCH_CHECK(up[e].k == x.size(1) && up[e].n % (2 * kTile) == 0 && dn[e].k == up[e].n / 2 && dn[e].n == x.size(1),
                "quant gemm experts: every expert's gate_up [2I, H] (I % 16 == 0) and down [H, I]");
  }
  auto out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  if (x.scalar_type() == at::kFloat)
    run_experts(x.data_ptr<float>(), x.size(0), ids.size(1), ids.data_ptr<int64_t>(), weights.data_ptr<float>(), up, dn,
                static_cast<Gate>(gate), out.data_ptr<float>());
  else
    run_experts(x.data_ptr<at::BFloat16>(), x.size(0), ids.size(1), ids.data_ptr<int64_t>(), weights.data_ptr<at::BFloat16>(), up,
                dn, static_cast<Gate>(gate), out.data_ptr<at::BFloat16>());
  return out;
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
  mod.def("experts", &experts, "a mixture-of-experts block's routed experts: x [T, H], ids and weights [T, k], every expert's "
          "gate_up and down; each token's weighted sum of its experts' outputs, [T, H]", py::arg("x"), py::arg("ids"),
          py::arg("weights"), py::arg("gate_up"), py::arg("down"), py::arg("gate") = 1);
}

}  // namespace tandem_cpu_quant_gemm
