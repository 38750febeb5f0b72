// What the few-row kernels of packed weights share (linear_q4.cpp, linear_i8g.cpp): rows of bf16
// activations as int16 per group of inputs, for integer dot products with weight codes
// (AVX512-VNNI's vpdpwssd: two int16 products per int32 lane, exact; a group's step is
// max |x| / 32767, 2^-16 of its largest element, where bf16 itself carries 2^-9 of each
// element), and the walk over blocks of 16 output features and rows.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "parallel.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FF_INT16_ROWS 1
#include <immintrin.h>

namespace ff {

// 16 bf16 -> fp32 (exact: the bf16 bits are the high half).
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Each group of each row of x [M, K] bf16 as int16: xq = round(x / xs) with xs = max |x| / 32767
// (0 for an all-zero group), and the group's sum of x in fp32 (sx; may be null).
inline void quantize_groups(const uint16_t* x, int64_t M, int64_t K, int64_t group, int16_t* xq,
                            float* xs, float* sx) {
  constexpr int64_t L = 16;
  const int64_t G = K / group;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* src = x + m * K + g * group;
      int16_t* dst = xq + m * K + g * group;
      __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + L <= group; k += L) {
        const __m512 v = load_bf16x16(src + k);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        vsum = _mm512_add_ps(vsum, v);
      }
      float amax = _mm512_reduce_max_ps(vmax), sum = _mm512_reduce_add_ps(vsum);
      for (int64_t j = k; j < group; ++j) {
        const float v = bf16_to_float(src[j]);
        amax = std::max(amax, std::fabs(v));
        sum += v;
      }
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      xs[m * G + g] = amax / 32767.f;
      if (sx) sx[m * G + g] = sum;
      const __m512 iv = _mm512_set1_ps(inv);
      for (k = 0; k + L <= group; k += L) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16x16(src + k), iv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), _mm512_cvtsepi32_epi16(q));
      }
      for (; k < group; ++k) dst[k] = int16_t(std::nearbyint(bf16_to_float(src[k]) * inv));
    }
}

// (p[0], p[1]) -- two int16 or bf16 -- in every 32-bit lane.
inline __m512i splat_pair(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// kernel(NT, MR, m0, b0) over blocks [0, blocks) of 16 output features and rows [0, M): blocks
// 4 at a time for 1-2 rows, 2 + 2 for 3-4 rows, a last short run one by one (NT and MR arrive as
// std::integral_constant); rows 4 at a time over each run of blocks, whose codes stay in cache
// meanwhile; threads over runs of at least 32 KiB of codes (block_bytes each).
//
// One or two rows (decode) split the blocks exactly into one range per thread and take each
// other's last blocks when done (steal_for, parallel.h), instead of handing out runs: SmolLM2's
// o and down matrices have 9 runs of 4 blocks, so on 2 threads one thread read 5 while the
// other waited (the end-of-region wait averaged ~2.5 us a call, ~0.3 ms a decode step). Split
// exactly, the int4 decoder stack went 5.02 -> 4.84 ms and int4 decode 190.8 -> 197.4 tok/s
// (medians of 8 alternating timings in one process; the 2-core Xeon without AVX512-BF16,
// throwaway scripts); taking the ends, the threads' wait for each other went 2.2 -> 0.8 us a
// call in the int4 engine's decode (see steal_for).
template <typename F>
void for_row_blocks(int64_t blocks, int64_t M, int64_t block_bytes, F&& kernel) {
  constexpr int NT = 4, MR_MAX = 4;
  const int64_t runs = (blocks + NT - 1) / NT;
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / (block_bytes * NT));
  auto with_rows = [&](auto nt, int r, int64_t m0, int64_t b0) {
    switch (r) {
      case 1: return kernel(nt, std::integral_constant<int, 1>{}, m0, b0);
      case 2: return kernel(nt, std::integral_constant<int, 2>{}, m0, b0);
      case 3: return kernel(nt, std::integral_constant<int, 3>{}, m0, b0);
      default: return kernel(nt, std::integral_constant<int, 4>{}, m0, b0);
    }
  };
  const int64_t threads =
      std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, runs / grain));
  if (M <= 2 && threads > 1) {
    steal_for(blocks, threads, NT, [&](int64_t b, int64_t b1) {  // 1 to NT blocks
      if (b1 - b == NT) return with_rows(std::integral_constant<int, NT>{}, int(M), 0, b);
      if (b1 - b >= 2) {
        with_rows(std::integral_constant<int, 2>{}, int(M), 0, b);
        b += 2;
      }
      if (b < b1) with_rows(std::integral_constant<int, 1>{}, int(M), 0, b);
    });
    return;
  }
  dynamic_for(runs, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t run = r0; run < r1; ++run) {
      const int64_t b0 = run * NT;
      const int nt = int(std::min<int64_t>(NT, blocks - b0));
      for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        const int r = int(std::min<int64_t>(MR_MAX, M - m0));
        if (nt == NT && r <= 2) {
          with_rows(std::integral_constant<int, 4>{}, r, m0, b0);
        } else if (nt == NT) {
          with_rows(std::integral_constant<int, 2>{}, r, m0, b0);
          with_rows(std::integral_constant<int, 2>{}, r, m0, b0 + 2);
        } else {
          for (int t = 0; t < nt; ++t) with_rows(std::integral_constant<int, 1>{}, r, m0, b0 + t);
        }
      }
    }
  });
}

// MR rows x NT tiles of 16 outputs from tile t0 for packed integer codes (the int4 and int5
// kernels, linear_q4.cpp and linear_q5.cpp): the codes of each tile and input quad (64 codes, 16
// outputs x 4 inputs) come as words from Codes::words(tile, quad, lo, hi) -- word 2i + j of lo
// is code[i][4q + j], of hi code[i][4q + 2 + j] -- and meet the rows' int16 pairs in exact int32
// dot products per group (vpdpwssd), then y += s * xs * d + z * sum(x) with
// (s, z) = Codes::scale_zero(tile, group). One row keeps the quads' two halves in two chains per
// tile to cover vpdpwssd's latency (more rows have MR x NT chains already), its high half as
// Codes::words<true>: the codes times 16 (the nibble masked in place, no shift), whose exact
// int32 sums (multiples of 16) shift back once per group. noinline: kept out of
// for_row_blocks' walk (inlined there, the [3072, 576] int4 matrix from L3 took 62-65 us
// against 39-46).
template <int MR, int NT, typename Codes>
__attribute__((noinline)) void int_codes_block(const Codes& codes, const int16_t* xq, int64_t K,
                                               const float* xs, const float* sx, int64_t G,
                                               int64_t quads_per_group, int64_t t0, uint16_t* y,
                                               int64_t N) {
  constexpr bool SPLIT = MR == 1;
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i dl[MR][NT], dh[MR][NT];
    for (int m = 0; m < MR; ++m)
      for (int t = 0; t < NT; ++t) dl[m][t] = dh[m][t] = _mm512_setzero_si512();
    const int64_t q0 = g * quads_per_group;
    for (int64_t q = q0; q < q0 + quads_per_group; ++q) {
      __m512i xl[MR], xh[MR];
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {  // (x[4q], x[4q + 1]) and (x[4q + 2], x[4q + 3]) as int16 pairs
        xl[m] = splat_pair(xq + m * K + 4 * q);
        xh[m] = splat_pair(xq + m * K + 4 * q + 2);
      }
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        __m512i lo, hi;
        codes.template words<SPLIT>(t0 + t, q, lo, hi);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          dl[m][t] = _mm512_dpwssd_epi32(dl[m][t], lo, xl[m]);
          if constexpr (SPLIT) dh[m][t] = _mm512_dpwssd_epi32(dh[m][t], hi, xh[m]);
          else dl[m][t] = _mm512_dpwssd_epi32(dl[m][t], hi, xh[m]);
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      __m512 s, z;
      codes.scale_zero(t0 + t, g, s, z);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m512i d =
            SPLIT ? _mm512_add_epi32(dl[m][t], _mm512_srai_epi32(dh[m][t], 4)) : dl[m][t];
        const __m512 sxs = _mm512_mul_ps(s, _mm512_set1_ps(xs[m * G + g]));
        acc[m][t] = _mm512_fmadd_ps(sxs, _mm512_cvtepi32_ps(d), acc[m][t]);
        acc[m][t] = _mm512_fmadd_ps(z, _mm512_set1_ps(sx[m * G + g]), acc[m][t]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t)
      store_bf16(y + m * N + (t0 + t) * 16, reinterpret_cast<const vf&>(acc[m][t]));
}

}  // namespace ff
#endif
