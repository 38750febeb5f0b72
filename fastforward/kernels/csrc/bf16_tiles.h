// linear_amx's B tiles (pack_amx_weight): blocks of TN output features, K in tile rows of TK/2
// pairs (a tile row is the K pair of 16 features that vdpbf16ps multiplies), and the one sum
// every path over them computes per (row of x, block): linear_amx's single row (one_row), its
// rows in registers (dp_rows) and the greedy screen's exact rows (greedy_screen.cpp), whose
// pick is the full projection's argmax only while these sums are the same to the bit.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace ff {
namespace bf16_tiles {

constexpr int64_t TN = 16;     // output features per B tile (a block)
constexpr int64_t TK = 32;     // bf16 of K per tile row
constexpr int64_t TILE = 512;  // bf16 elements of one tile

// x2 [M, K] as the vdpbf16ps paths read it: bf16, contiguous, K pairs side by side (an odd K
// padded with a zero; to pad_to where given, as one_row's whole tiles want).
inline at::Tensor dp_pairs(const at::Tensor& x2, int64_t pad_to = 0) {
  const int64_t K = x2.size(1), ldx = pad_to ? pad_to : (K + 1) / 2 * 2;
  at::Tensor xb = x2.to(at::kBFloat16).contiguous();
  return ldx == K ? xb : at::constant_pad_nd(xb, {0, ldx - K});
}

#if defined(__AVX512BF16__)
// acc + x's K pair j times the block's tile row j (w: the block's first tile).
inline __m512 dp_pair(__m512 acc, const uint32_t* xq, const uint16_t* w, int64_t j) {
  const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * 2 * TN);
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(int(xq[j])), wv);
}

// The block's 16 sums over x's first `pairs` K pairs, in order from zero.
inline __m512 block_sums(const uint32_t* xq, const uint16_t* w, int64_t pairs) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) acc = dp_pair(acc, xq, w, j);
  return acc;
}
#endif

}  // namespace bf16_tiles
}  // namespace ff
