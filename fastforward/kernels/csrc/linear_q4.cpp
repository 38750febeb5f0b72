// y = x @ W^T for 4-bit weights looked up through a 16-entry table, with a scale (and an
// optional zero) per group of inputs: W[n, k] = table[code[n, k]] * s[n, g] + z[n, g]. One
// kernel serves int4 group-wise weights (table = code - 8, zeros) and codebook weights
// (table = the matrix's 16 centroids, no zeros), GGUF Q4_0/Q4_1/Q4_K included.
//
// Codebook tables: per group the kernel computes d = sum_k x[k] * table[code[k]] with
// AVX512-BF16 dot products (vdpbf16ps: two bf16 products per fp32 lane, fp32 accumulation),
// then y += s * d (+ z * sum_k x[k]). Codes are unpacked in registers: 32 bytes hold 64 codes
// of a tile of 16 outputs x 4 inputs; one zero-extension to words, one shift and two word
// permutations (vpermw, the table in one register) give the 64 bf16 weights.
//
// The int4 table (code - 8) needs no lookup and no floats in the loop: each row's group of x is
// held as int16 (int16_rows.h: 2^-16 of the group's largest element a step, where bf16 itself
// carries 2^-9 of each element), and the codes 0..15 multiply it as words with AVX512-VNNI's
// vpdpwssd (two int16 products per int32 lane, exact), so per group
// d = sum_k xq[k] * code[k] and y += s * xs * d + (z - 8 s) * sum_k x[k]. vdpbf16ps costs about
// twice a vpdpwssd here, and the codes need a mask instead of a lookup: 1.9 -> 1.1 ns per 64
// weights from L1 on the AMX Xeon (one core, a throwaway timing harness).
//
// Nothing is expanded in memory, so a decode step reads 4 bits per weight plus the group scales.
//
// Packed layout (fastforward/quant/q4pack.py): [N/16][K/4][32] bytes; in the 32 bytes of tile t
// and input quad p, byte 2i holds code[16t+i][4p] (low nibble) and code[16t+i][4p+2] (high),
// byte 2i+1 holds code[16t+i][4p+1] and code[16t+i][4p+3]. Scales (and zeros) are
// [N/16][G][C][16] bf16, C = 1 (scales) or 2 (scales, zeros): one read per tile and group.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "expand.h"
#include "int16_rows.h"
#include "ops.h"
#include "vec.h"

namespace ff {

// Batches from this many rows go to AMX tiles where the CPU has them (linear_q4_amx in
// linear_amx.cpp): the codes expanded to bf16 tiles once per call serve every row, where this
// kernel's cost grows with the rows. The int4 table's integer path stays ahead up to 8 rows
// (SmolLM2's 120 layer matrices from memory, 2 threads: 8 rows 7.6 against 9.0 ms, 12 rows
// 11.6 against 11.3, 16 rows 13.9 against 8.5); a codebook's bf16 lookups up to 4.
constexpr int64_t kQ4AmxRowsMin = 5;
constexpr int64_t kQ4Int4AmxRowsMin = 9;
// Without AMX (AVX512-BF16 alone: the Zen 4 and Zen 5 EPYCs) linear_q4_amx expands the codes
// the same way and multiplies on vdpbf16ps (dp_rows' register block). SmolLM2's 120 layer
// matrices from memory on the Zen 4 EPYC, 2 threads, ms, this kernel against the expansion
// (`python benchmarks/bench_matmul.py --paths int4-rows int4-tiles codebook-rows
// codebook-tiles`, two runs): int4 8 rows 12.4 / 11.6 and 9.5 / 12.0, 12 rows 16.6 / 11.7 and
// 12.9 / 13.6, 16 rows 20.6 / 14.7 and 16.6 / 14.7, 32 rows 33.7 / 22.8 and 30.0 / 22.2; a
// codebook 8 rows 10.7 / 10.5 and 10.3 / 10.1, 12 rows 14.9 / 11.9 and 15.2 / 13.1, 16 rows
// 18.8 / 14.9 and 18.3 / 14.4 (an earlier, slower hour of this VM put the codebook's
// crossover near 32 rows: 16 rows 13.6 / 15.3, 32 rows 22.9 / 21.9).
constexpr int64_t kQ4DpRowsMin = 16;
constexpr int64_t kQ4Int4DpRowsMin = 16;

// Codebook tables need AVX512-BF16 (FF_Q4); the int4 table only AVX512-VNNI (FF_Q4_INT).
#if defined(__AVX512BF16__) && defined(FF_INT16_ROWS)
#define FF_Q4 1
constexpr bool kQ4Native = true;
#else
constexpr bool kQ4Native = false;
#endif
#ifdef FF_INT16_ROWS
#define FF_Q4_INT 1
constexpr bool kQ4IntNative = true;
#else
constexpr bool kQ4IntNative = false;
#endif

bool linear_q4_native() { return kQ4Native; }

#ifdef FF_Q4_INT
namespace {

constexpr int TILE = 16;
constexpr int QUAD_BYTES = 32;
// Each even quad prefetches its line of the tile PF_TILES on: the same quad of the next run of
// tiles (for_row_blocks walks 4 at a time), ~18 KiB ahead for K = 576. A tile of SmolLM2's is
// only 4.5 KiB (K x 8 bytes), too short for the hardware prefetcher to get ahead before the next
// run starts new streams; 1 KiB ahead on the tile's own stream (before) left one thread at
// 10.5 GB/s from memory where a plain read gets 12, and two at 18.2 against 22.5. Prefetching the
// next run: 12.1 and 20.9 GB/s ([N, 576] int4, 524 MB, medians of 5-7 alternations in one
// process), the 2-core Xeon without AVX512-BF16; K = 1536 (12 KiB tiles) was at the bandwidth
// already (24.4 -> 24.8). int4 decode 199.9 -> 217.8 tok/s (medians of 12 in one process,
// paired ratio 1.10) with both prefetches; the next run's alone was level with both (1.04).
constexpr int PF_TILES = 4;

// Each of MR x NT vectors set to v.
template <int MR, int NT, typename V>
inline void fill(V (&a)[MR][NT], V v) {
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) a[m][t] = v;
}

// The 64 codes of quad q of tile t (from wt) as words, one byte each (both nibbles), with the
// same line of the tile PF_TILES on prefetched on even quads (past the last tile: a prefetch
// does not fault).
inline __m512i quad_bytes(const uint8_t* wt, int64_t tile_bytes, int t, int64_t q) {
  const uint8_t* src = wt + t * tile_bytes + q * QUAD_BYTES;
  if ((q & 1) == 0)
    _mm_prefetch(reinterpret_cast<const char*>(src + PF_TILES * tile_bytes), _MM_HINT_T0);
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

// acc[m][t] rounded to bf16 into row m of y, tile t0 + t.
template <int MR, int NT>
inline void store_rows(const __m512 (&acc)[MR][NT], uint16_t* y, int64_t N, int64_t t0) {
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t)
      store_bf16(y + m * N + (t0 + t) * TILE, reinterpret_cast<const vf&>(acc[m][t]));
}

#ifdef FF_Q4

// MR rows x NT tiles from tile t0, through the table. One row keeps the low and high halves of
// each quad in two dot-product chains (8 chains with NT = 4) to cover vdpbf16ps's latency; more
// rows have MR x NT independent chains already.
// noinline: kept out of for_row_blocks' walk (inlined there, the [3072, 576] int4 matrix
// from L3 took 62-65 us against 39-46)
template <int MR, int NT>
__attribute__((noinline)) void block(const uint16_t* x, int64_t K, const uint8_t* w, const uint16_t* sz, int C,
           const float* sx, int64_t G, int64_t quads_per_group, __m512i table, int64_t t0,
           uint16_t* y, int64_t N) {
  constexpr bool SPLIT = MR == 1;
  const int64_t tile_bytes = K / 4 * QUAD_BYTES;
  const uint8_t* wt = w + t0 * tile_bytes;
  __m512 acc[MR][NT];
  fill(acc, _mm512_setzero_ps());
  for (int64_t g = 0; g < G; ++g) {
    __m512 dl[MR][NT], dh[MR][NT];
    fill(dl, _mm512_setzero_ps());
    fill(dh, _mm512_setzero_ps());
    const int64_t q0 = g * quads_per_group;
    for (int64_t q = q0; q < q0 + quads_per_group; ++q) {
      __m512i xl[MR], xh[MR];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        xl[m] = splat_pair(x + m * K + 4 * q);
        xh[m] = splat_pair(x + m * K + 4 * q + 2);
      }
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const __m512i b = quad_bytes(wt, tile_bytes, t, q);
        // vpermw reads index bits 0-4: bit 4 (the high nibble's lowest) picks between two equal
        // halves of the 32-entry table, so the low nibble needs no mask.
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(b, table);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          dl[m][t] = _mm512_dpbf16_ps(dl[m][t], (__m512bh)xl[m], lo);
          if constexpr (SPLIT) dh[m][t] = _mm512_dpbf16_ps(dh[m][t], (__m512bh)xh[m], hi);
          else dl[m][t] = _mm512_dpbf16_ps(dl[m][t], (__m512bh)xh[m], hi);
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      const uint16_t* st = sz + ((t0 + t) * G + g) * C * TILE;
      const __m512 s = load_bf16x16(st);
      const __m512 z = C == 2 ? load_bf16x16(st + TILE) : _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m512 d = SPLIT ? _mm512_add_ps(dl[m][t], dh[m][t]) : dl[m][t];
        acc[m][t] = _mm512_fmadd_ps(s, d, acc[m][t]);
        if (C == 2) acc[m][t] = _mm512_fmadd_ps(z, _mm512_set1_ps(sx[m * G + g]), acc[m][t]);
      }
    }
  }
  store_rows(acc, y, N, t0);
}
#endif

// The int4 table's codes of int_codes_block (int16_rows.h): both nibbles of each byte, masked.
struct Int4Codes {
  const uint8_t* w;    // [N/16, K/4, 32]
  const uint16_t* sz;  // [N/16, G, C, 16] bf16
  int64_t tile_bytes, G;
  int C;

  // word 2i + j of lo: code[i][4q + j]; of hi: code[i][4q + 2 + j] (times 16 if HI16)
  template <bool HI16>
  void words(int64_t tile, int64_t q, __m512i& lo, __m512i& hi) const {
    const __m512i nib = _mm512_set1_epi16(0x000f);
    const __m512i b = quad_bytes(w, tile_bytes, int(tile), q);
    lo = _mm512_and_si512(b, nib);
    hi = HI16 ? _mm512_and_si512(b, _mm512_set1_epi16(0x00f0))
              : _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
  }

  // w = (code - 8) * s + z: the zero term is z - 8 s.
  void scale_zero(int64_t tile, int64_t g, __m512& s, __m512& z) const {
    const uint16_t* st = sz + (tile * G + g) * C * TILE;
    s = load_bf16x16(st);
    const __m512 z0 = C == 2 ? load_bf16x16(st + TILE) : _mm512_setzero_ps();
    z = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z0);
  }
};

}  // namespace
#endif

void check_linear_q4(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                     const at::Tensor& table, int64_t group_size) {
  TORCH_CHECK(wq.dim() == 3 && wq.size(2) == 32 && wq.scalar_type() == at::kByte &&
                  wq.is_contiguous(),
              "packed codes must be a contiguous [N/16, K/4, 32] uint8 tensor");
  const int64_t tiles = wq.size(0), K = wq.size(1) * 4, N = tiles * 16;
  TORCH_CHECK(group_size >= 4 && group_size % 4 == 0 && K % group_size == 0,
              "group size ", group_size, " must be a multiple of 4 dividing K=", K);
  const int64_t G = K / group_size;
  TORCH_CHECK(sz.dim() == 4 && sz.size(0) == tiles && sz.size(1) == G &&
                  (sz.size(2) == 1 || sz.size(2) == 2) && sz.size(3) == 16 &&
                  sz.scalar_type() == at::kBFloat16 && sz.is_contiguous(),
              "scales must be a contiguous [N/16, K/group, 1 or 2, 16] bf16 tensor");
  TORCH_CHECK(table.numel() == 16 && table.scalar_type() == at::kBFloat16,
              "table must hold 16 bf16 values");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K, "x must be bf16 with ", K,
              " features");
}

Q4Table q4_table(const at::Tensor& table) {
  TORCH_CHECK(table.numel() == 16 && table.scalar_type() == at::kBFloat16,
              "table must hold 16 bf16 values");
  auto tc = table.contiguous();
  Q4Table t;
  std::memcpy(t.tab, tc.data_ptr(), 32);
  std::memcpy(t.tab + 16, tc.data_ptr(), 32);
  t.int4 = true;  // the int4 table, code - 8: integer dot products, no lookup
  for (int c = 0; c < 16; ++c) t.int4 = t.int4 && bf16_to_float(t.tab[c]) == float(c - 8);
  TORCH_CHECK(kQ4Native || (t.int4 && kQ4IntNative),
              t.int4 ? "linear_q4 needs AVX512-VNNI (this build has no 4-bit kernel)"
                     : "linear_q4 with a codebook table needs AVX512-BF16 and AVX512-VNNI");
  return t;
}

bool linear_q4_takes_amx(int64_t rows, const Q4Table& t) {
  if (amx_native()) return rows >= (t.int4 ? kQ4Int4AmxRowsMin : kQ4AmxRowsMin);
  return bf16_tiles_native() && rows >= (t.int4 ? kQ4Int4DpRowsMin : kQ4DpRowsMin);
}

namespace {

at::Tensor q4_rows(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                   const Q4Table& t, int64_t group_size) {
  const int64_t K = x.size(-1);
  auto xc = x.reshape({-1, K}).contiguous();
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = wq.size(0) * 16;
  auto y = at::empty({xc.size(0), out_sizes.back()}, x.options());
  linear_q4_out(xc, wq, sz, t, group_size, y);
  return y.view(out_sizes);
}

}  // namespace

at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                     const at::Tensor& table, int64_t group_size) {
  check_linear_q4(x, wq, sz, table, group_size);
  const int64_t K = x.size(-1);
  const Q4Table t = q4_table(table);
  if (linear_q4_takes_amx(x.numel() / std::max<int64_t>(K, 1), t))
    return linear_q4_amx(x, wq, sz, table, group_size);
  return q4_rows(x, wq, sz, t, group_size);
}

// linear_q4's own kernel at every batch, never handed to linear_q4_amx (the crossover's other
// side, for benchmarks/bench_matmul.py and the tests).
at::Tensor linear_q4_rows(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                          const at::Tensor& table, int64_t group_size) {
  check_linear_q4(x, wq, sz, table, group_size);
  return q4_rows(x, wq, sz, q4_table(table), group_size);
}

// linear_q4's work, the shapes checked (check_linear_q4) and the table read once (q4_table) by
// the caller: the fused decoder stack checks its layers when they are added, so a decode step's
// 120 calls do not check, allocate or dispatch again.
void linear_q4_out(const at::Tensor& xc, const at::Tensor& wq, const at::Tensor& sz,
                   const Q4Table& t, int64_t group_size, at::Tensor& y) {
#ifdef FF_Q4_INT  // FF_Q4 (codebook tables) implies it
  const int64_t M = xc.size(0), K = xc.size(1), tiles = wq.size(0), N = tiles * 16;
  const int64_t G = K / group_size;
  if (M == 0) return;
  const int C = int(sz.size(2));
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = wq.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t qpg = group_size / 4;
  if (t.int4) {
    std::vector<int16_t> xq(M * K);
    std::vector<float> xs(M * G), sx(M * G);
    quantize_groups(xp, M, K, group_size, xq.data(), xs.data(), sx.data());
    const Int4Codes c{wp, sp, K / 4 * QUAD_BYTES, G, C};
    for_row_blocks(tiles, M, K * 8, [&](auto nt, auto mr, int64_t m0, int64_t t0) {
      int_codes_block<decltype(mr)::value, decltype(nt)::value>(
          c, xq.data() + m0 * K, K, xs.data() + m0 * G, sx.data() + m0 * G, G, qpg, t0,
          yp + m0 * N, N);
    });
    return;
  }
#ifdef FF_Q4
  // Per row and group, the sum of x (the zeros' term).
  std::vector<float> sx(C == 2 ? M * G : 0);
  for (int64_t m = 0; m < (C == 2 ? M : 0); ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k)
        s += bf16_to_float(xp[m * K + k]);
      sx[m * G + g] = s;
    }
  const __m512i tv = _mm512_load_si512(t.tab);
  for_row_blocks(tiles, M, K * 8, [&](auto nt, auto mr, int64_t m0, int64_t t0) {
    block<decltype(mr)::value, decltype(nt)::value>(xp + m0 * K, K, wp, sp, C,
                                                   sx.empty() ? nullptr : sx.data() + m0 * G, G,
                                                   qpg, tv, t0, yp + m0 * N, N);
  });
#endif
#else
  TORCH_CHECK(false, "linear_q4 needs AVX512-VNNI (this build has no 4-bit kernel)");
#endif
}

// The weight [N, K] as float32 or bf16 (out's dtype, written here): w = table[code] * s (+ z),
// for the dense matmul of large batches on CPUs where linear_q4_amx does not take them (one
// expansion per call serves every row; in float32 where the CPU has no native bf16 matmul).
// With rows, only those ([R, K]: embedding lookups). The product and the sum round apart, as
// PyTorch's ops on the module's side do (quant/int4.py _affine): the same float32 bits.
void dequantize_q4(const at::Tensor& wq, const at::Tensor& sz, const at::Tensor& table,
                   at::Tensor& out, const std::optional<at::Tensor>& rows) {
  constexpr int64_t T = 16, Q = 32;  // outputs per tile, bytes per tile and input quad
  const int64_t tiles = wq.size(0), quads = wq.size(1), K = quads * 4;
  TORCH_CHECK(sz.dim() == 4 && sz.size(1) > 0 && K % sz.size(1) == 0,
              "scales must be [N/16, K/group, 1 or 2, 16]");
  const int64_t G = sz.size(1), group_size = K / G, C = sz.size(2);
  check_linear_q4(at::empty({0, K}, at::kBFloat16), wq, sz, table, group_size);
  const auto tc = table.contiguous();
  float tab[16];
  const auto* tp = reinterpret_cast<const uint16_t*>(tc.data_ptr());
  for (int c = 0; c < 16; ++c) tab[c] = bf16_to_float(tp[c]);
  const auto* wp = wq.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr());
  // no fused multiply-add: the empty asm makes the product a value of its own
  auto affine = [](float level, float s, float z) {
    float p = level * s;
    asm("" : "+v"(p));
    return p + z;
  };
  expand_tiles(out, tiles, K, rows, [&](int64_t t, int i, float* row) {
    for (int64_t q = 0; q < quads; ++q) {
      const uint8_t* b = wp + (t * quads + q) * Q + 2 * i;
      const uint16_t* st = sp + (t * G + 4 * q / group_size) * C * T + i;
      const float s = bf16_to_float(st[0]), z = C == 2 ? bf16_to_float(st[T]) : 0.f;
      float* r = row + 4 * q;
      r[0] = affine(tab[b[0] & 15], s, z), r[1] = affine(tab[b[1] & 15], s, z);
      r[2] = affine(tab[b[0] >> 4], s, z), r[3] = affine(tab[b[1] >> 4], s, z);
    }
  });
}

}  // namespace ff
