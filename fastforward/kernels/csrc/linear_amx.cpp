// bf16 matmul on AMX tiles (Intel's Advanced Matrix Extensions: eight 1 KB tile registers and a
// 16 x 16 x 32 bf16 multiply-add into fp32 per instruction), for the batches above the packed
// kernel's few rows: batched decode and prefill.
//
// oneDNN's AMX matmul (what PyTorch's bf16 linear calls) costs ~40-100 us of fixed work a call
// at 64 rows, as much as the matmul itself for SmolLM2's small matrices, and returns bf16 only.
// Here the weight is packed once into B tiles in the order they are read (blocks of 16 output
// features, 32 of K per tile, VNNI pairs), so a call streams it once per 64 rows; each step
// multiplies two row tiles by two weight tiles into four fp32 accumulator tiles (32 rows x 32
// features: a whole cache line of bf16 output per row), and the accumulators are converted
// once (bf16 with the activations, or fp32 for the output projection's logits, which then need
// no bf16 rounding and no rescoring).
//
// 4-bit weights (linear_q4's layout) take the same tiles in batches: linear_q4_amx expands each
// block of codes to bf16 B tiles in a buffer that stays in cache and multiplies every row by
// it, so the expansion is paid once per call rather than once per row.
//
// The same tiles are the layout vdpbf16ps multiplies (a tile row is a K pair of 16 features),
// so on a CPU with AVX512-BF16 and no AMX linear_amx serves every batch from them too: one row
// streaming them (one_row), several in registers (dp_rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"
#include "bf16_tiles.h"
#include "parallel.h"
#include "ops.h"
#include "vec.h"

#if defined(__AVX512BF16__)
#define FF_BF16_DP 1
#endif

namespace ff {
namespace {

using bf16_tiles::dp_pairs;
using bf16_tiles::TILE;  // bf16 elements of one tile
using bf16_tiles::TK;    // bf16 of K per tile row
using bf16_tiles::TN;    // output features per B tile
constexpr int64_t TM = 16;    // rows per A / C tile
constexpr int64_t MC = 4;     // row tiles per pass over the weight: 64 rows
constexpr int64_t GROUP_BYTES = 256 << 10;  // weight blocks kept in L2 across row chunks

#ifdef FF_AMX
using amx::configure_tiles;

// One pass over the weight blocks [b0, b1) (their tiles from wp on) for rows
// [m0, m0 + 16 * mt) of the padded a: two blocks (32 features, a whole cache line of bf16
// output per row) by two row tiles at a time.
template <typename OT>
void pass(const uint16_t* a, int64_t Kp, int64_t m0, int64_t mt, int64_t M, const uint16_t* wp,
          int64_t kc, int64_t b0, int64_t b1, const float* bias, int64_t N, OT* y) {
  alignas(64) float cbuf[4][TM][TN];
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two_b = b + 1 < b1;
    const uint16_t* w0 = wp + (b - b0) * kc * TILE;
    const uint16_t* w1 = w0 + kc * TILE;
    for (int64_t t0 = 0; t0 < mt; t0 += 2) {
      const bool two_m = t0 + 1 < mt;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* a0 = a + (m0 + t0 * TM) * Kp;
      const uint16_t* a1 = a0 + TM * Kp;
      for (int64_t c = 0; c < kc; ++c) {
        _tile_loadd(4, a0 + c * TK, Kp * 2);
        _tile_loadd(6, w0 + c * TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_b) {
          _tile_loadd(7, w1 + c * TILE, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_m) {
          _tile_loadd(5, a1 + c * TK, Kp * 2);
          _tile_dpbf16ps(2, 5, 6);
          if (two_b) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, cbuf[0], 64);
      if (two_b) _tile_stored(1, cbuf[1], 64);
      if (two_m) _tile_stored(2, cbuf[2], 64);
      if (two_m && two_b) _tile_stored(3, cbuf[3], 64);
      __mmask16 keep[2];  // each block's features inside N, and their bias
      __m512 bv[2];
      for (int64_t u = 0; u < 2; ++u) {
        const int64_t nv = std::clamp<int64_t>(N - (b + u) * TN, 0, TN);
        keep[u] = __mmask16((1u << nv) - 1);
        bv[u] = bias ? _mm512_maskz_loadu_ps(keep[u], bias + (b + u) * TN) : _mm512_setzero_ps();
      }
      // bf16 output, both blocks whole: a row's 32 features convert in one instruction
      const bool line = !std::is_same_v<OT, float> && two_b && keep[1] == 0xffff;
      for (int64_t h = 0; h < (two_m ? 2 : 1); ++h)
        for (int64_t r = 0; r < TM; ++r) {
          const int64_t m = m0 + (t0 + h) * TM + r;
          if (m >= M) break;
          if (line) {
            const __m512 v0 = _mm512_add_ps(_mm512_load_ps(cbuf[2 * h][r]), bv[0]);
            const __m512 v1 = _mm512_add_ps(_mm512_load_ps(cbuf[2 * h + 1][r]), bv[1]);
            _mm512_storeu_si512(y + m * N + b * TN, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
            continue;
          }
          for (int64_t u = 0; u < (two_b ? 2 : 1); ++u) {
            const int64_t n0 = (b + u) * TN;
            const __m512 v = _mm512_add_ps(_mm512_load_ps(cbuf[2 * h + u][r]), bv[u]);
            OT* dst = y + m * N + n0;
            if constexpr (std::is_same_v<OT, float>) {
              _mm512_mask_storeu_ps(dst, keep[u], v);
            } else {
              alignas(64) uint16_t hb[TN];
              store_bf16(hb, reinterpret_cast<const vf&>(v));
              _mm256_mask_storeu_epi16(dst, keep[u],
                                       _mm256_load_si256(reinterpret_cast<__m256i*>(hb)));
            }
          }
        }
    }
  }
}
#endif  // FF_AMX

#ifdef FF_BF16_DP
// One row: vdpbf16ps straight on the B tiles, whose rows are already the pairs it multiplies
// (tile row p of tile c: K pair 16c + p of the block's 16 features), so one copy of the weight
// serves every batch and the packed kernel's own copy is not kept. Four blocks stream side by
// side, one chain each (the row's sum runs over K in order): one core's reads from memory are
// bound by how many lines are in flight, and four streams keep the hardware prefetcher further
// ahead than one. SmolLM2's 120 layer matrices and output projection from memory, 2 threads:
// 12.6-13.3 ms, against 16.2-16.7 with one block at a time and 13.6-15.7 on linear_bf16's
// packed copy (a throwaway timing script, alternating runs).
constexpr int kRowBlocks = 4;

template <typename OT>
void one_row(const uint16_t* x, const uint16_t* wp, int64_t kc, int64_t b0, int64_t b1,
             const float* bias, int64_t N, OT* y) {
  const auto* xq = reinterpret_cast<const uint32_t*>(x);  // x's K pairs
  const int64_t pairs = kc * TK / 2, bstride = kc * TILE;
  for (int64_t bb = b0; bb < b1; bb += kRowBlocks) {
    const int nbk = int(std::min<int64_t>(kRowBlocks, b1 - bb));
    const uint16_t* w = wp + bb * bstride;
    __m512 acc[kRowBlocks];
    for (int u = 0; u < kRowBlocks; ++u) acc[u] = _mm512_setzero_ps();
    if (nbk == kRowBlocks) {  // the blocks side by side, each block_sums' chain
      for (int64_t j = 0; j < pairs; ++j)
#pragma GCC unroll 4
        for (int u = 0; u < kRowBlocks; ++u)
          acc[u] = bf16_tiles::dp_pair(acc[u], xq, w + u * bstride, j);
    } else {  // a short last run, block by block
      for (int u = 0; u < nbk; ++u) acc[u] = bf16_tiles::block_sums(xq, w + u * bstride, pairs);
    }
    for (int u = 0; u < nbk; ++u) {
      const int64_t b = bb + u;
      const int64_t nv = std::clamp<int64_t>(N - b * TN, 0, TN);
      const __mmask16 keep = __mmask16((1u << nv) - 1);
      const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + b * TN) : _mm512_setzero_ps();
      const __m512 v = _mm512_add_ps(acc[u], bv);
      if constexpr (std::is_same_v<OT, float>) {
        _mm512_mask_storeu_ps(y + b * TN, keep, v);
      } else {
        _mm256_mask_storeu_epi16(y + b * TN, keep, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

// Several rows without AMX (AVX512-BF16 only: the Zen 4 and Zen 5 EPYCs): vdpbf16ps on the
// same B tiles, kDpRows rows x kDpBlocks blocks of 16 features of fp32 accumulators in
// registers (24 of the 32, the block's weight vectors and one broadcast x pair beside them).
// Per K pair the weight vectors are loaded once and multiply every row of the block: the GEMM
// layout, twice the products per instruction of linear_bf16's fp32 FMAs on widened weights,
// and no second copy of the weight as oneDNN's prepacked one was. Each (row, block) output is
// the same sequential sum over K pairs as one_row's, so a row's result does not depend on the
// batch it is in. SmolLM2's 120 layer matrices and output projection from memory on the Zen 4
// EPYC, 2 threads, ms (linear_bf16 / oneDNN prepacked / this): 8 rows 22.2 / 22.9 / 13.8,
// 64 rows 89.6 / 53.0 / 47.0, 512 rows 677 / 357 / 350; at 64 rows with the weights in cache
// 381-430 GFLOP/s a matrix, the matmul's peak there (a throwaway timing script). 8 x 3 blocks
// and 4 x 6 were no faster, 12 x 2 spilled.
constexpr int kDpRows = 6;
constexpr int kDpBlocks = 4;
// Items (a group of kDpBlocks blocks x a chunk of rows) wanted per thread, so that the threads
// end together; rows per chunk at most what keeps x's chunk in L2 beside the group's weight.
constexpr int64_t kDpItemsPerThread = 8;
constexpr int64_t kDpRowBytes = 128 << 10;

// MR rows x NB blocks from w (block b0's tiles, bstride elements between blocks), pairs K
// pairs; meanwhile pf_n lines from pf (the weight this thread multiplies next) are prefetched
// into L2, spread over the loop: 64 rows from memory 5-10% faster than without.
template <int MR, int NB, typename OT>
inline void dp_block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t bstride,
                     int64_t pairs, int64_t b0, const float* bias, int64_t N, OT* y,
                     const char* pf, int64_t pf_n) {
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int u = 0; u < NB; ++u) acc[m][u] = _mm512_setzero_ps();
  // x's pair j of row m at xb + m * ldx * 2 bytes, the blocks' pair j at wb + u * bstride * 2:
  // both pointers step once a pair. The prefetches keep pace by a credit of pf_n per pair, a
  // line per pairs of credit. A division a pair to schedule them, and the loop's indexed loads,
  // cost ~4% of the block's speed (a standalone copy of the loop, one Zen 4 core, 64 rows in
  // cache: 209-210 -> 216-219 GFLOP/s of its 231 peak).
  const char* xb = reinterpret_cast<const char*>(x);
  const char* wb = reinterpret_cast<const char*>(w);
  const int64_t lb = ldx * 2, bs = bstride * 2;
  int64_t credit = 0;
  for (int64_t j = 0; j < pairs; ++j) {
    for (credit += pf_n; credit >= pairs; credit -= pairs, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    __m512bh wv[NB];
#pragma GCC unroll 8
    for (int u = 0; u < NB; ++u) wv[u] = (__m512bh)_mm512_loadu_si512(wb + u * bs);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv =
          (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xb + m * lb));
#pragma GCC unroll 8
      for (int u = 0; u < NB; ++u) acc[m][u] = _mm512_dpbf16_ps(acc[m][u], xv, wv[u]);
    }
    xb += 4;
    wb += 2 * TN * 2;
  }
#pragma GCC unroll 8
  for (int u = 0; u < NB; ++u) {
    const int64_t b = b0 + u;
    const int64_t nv = std::clamp<int64_t>(N - b * TN, 0, TN);
    const __mmask16 keep = __mmask16((1u << nv) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + b * TN) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 v = _mm512_add_ps(acc[m][u], bv);
      if constexpr (std::is_same_v<OT, float>) {
        _mm512_mask_storeu_ps(y + m * N + b * TN, keep, v);
      } else {
        _mm256_mask_storeu_epi16(y + m * N + b * TN, keep, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

template <int MR, int NB, typename OT>
void dp_rows_nb(int r, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t bstride,
                int64_t pairs, int64_t b0, const float* bias, int64_t N, OT* y,
                const char* pf, int64_t pf_n) {
  if (r == MR) return dp_block<MR, NB>(x, ldx, w, bstride, pairs, b0, bias, N, y, pf, pf_n);
  if constexpr (MR > 1) {
    return dp_rows_nb<MR - 1, NB>(r, x, ldx, w, bstride, pairs, b0, bias, N, y, pf, pf_n);
  }
  TORCH_CHECK(false, "bad row block ", r);
}

// Rows [m0, m1) of y for the nbk (<= kDpBlocks) blocks of w from block b0 (bstride elements
// apart), kDpRows at a time: a whole group in one register block, a short one block by block.
// pf_lines lines from pf (the weight multiplied next) are prefetched spread over the row
// blocks of a whole group.
template <typename OT>
void dp_group(const uint16_t* x, int64_t ldx, int64_t m0, int64_t m1, const uint16_t* w,
              int64_t bstride, int64_t pairs, int64_t b0, int64_t nbk, const float* bias,
              int64_t N, OT* y, const char* pf, int64_t pf_lines) {
  constexpr int MR = kDpRows, NB = kDpBlocks;
  const int64_t row_blocks = (m1 - m0 + MR - 1) / MR;
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    const int64_t m = m0 + rb * MR;
    const int r = int(std::min<int64_t>(MR, m1 - m));
    if (nbk == NB) {
      const int64_t l0 = pf_lines * rb / row_blocks, l1 = pf_lines * (rb + 1) / row_blocks;
      dp_rows_nb<MR, NB>(r, x + m * ldx, ldx, w, bstride, pairs, b0, bias, N, y + m * N,
                         pf + l0 * 64, l1 - l0);
    } else {
      for (int64_t u = 0; u < nbk; ++u)
        dp_rows_nb<MR, 1>(r, x + m * ldx, ldx, w + u * bstride, bstride, pairs, b0 + u, bias, N,
                          y + m * N, nullptr, 0);
    }
  }
}

// y [M, N] = x [M, ldx] (K pairs side by side, K padded to even) @ W^T on the tiles: threads
// over (group of kDpBlocks blocks, chunk of rows), each going down its rows kDpRows at a time
// over the group's weight, which stays in L2 between them.
template <typename OT>
void dp_rows(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t kc,
             int64_t nb, const float* bias, int64_t N, OT* y) {
  constexpr int MR = kDpRows, NB = kDpBlocks;
  const int64_t pairs = ldx / 2, bstride = kc * TILE;
  const int64_t groups = (nb + NB - 1) / NB;
  const int64_t want = kDpItemsPerThread * at::get_num_threads();
  // rows per item: at most what keeps x's rows in L2 beside the group's weight, fewer where
  // there are too few items for the threads to finish together
  const int64_t cap = std::max<int64_t>(MR, kDpRowBytes / (ldx * 2) / MR * MR);
  int64_t chunk = std::min(cap, (M + MR - 1) / MR * MR);
  while (chunk > MR && groups * ((M + chunk - 1) / chunk) < want)
    chunk = std::max<int64_t>(MR, (chunk / 2 + MR - 1) / MR * MR);
  const int64_t chunks = (M + chunk - 1) / chunk;
  const int64_t items = groups * chunks;
  auto body = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      // a chunk of rows goes over every group in turn (its x stays in L2)
      const int64_t c = i / groups, g = i % groups;
      const int64_t b0 = g * NB, nbk = std::min<int64_t>(NB, nb - b0);
      // the weight of the item this thread takes next (its blocks follow each other),
      // prefetched into L2 over this item's row blocks
      const int64_t bn = (i + 1) % groups * NB;
      const int64_t pf_lines =
          i + 1 < items ? std::min<int64_t>(NB, nb - bn) * bstride * 2 / 64 : 0;
      dp_group(x, ldx, c * chunk, std::min(M, (c + 1) * chunk), wp + b0 * bstride, bstride,
               pairs, b0, nbk, bias, N, y, reinterpret_cast<const char*>(wp + bn * bstride),
               pf_lines);
    }
  };
  // each thread down its own range of items (so the one it prefetches is the one it takes
  // next), then the others' last ones
  steal_for(items, items, 1, body);
}
#endif  // FF_BF16_DP

#ifdef FF_AMX
// x2 [M, K] as bf16 A tiles: rows padded to a multiple of 16 and K to Kp with zeros (tiles
// read whole 16 x 32 blocks).
at::Tensor a_tiles(const at::Tensor& x2, int64_t Kp) {
  const int64_t M = x2.size(0), K = x2.size(1), Mp = (M + TM - 1) / TM * TM;
  at::Tensor a = x2.to(at::kBFloat16);
  if (Mp == M && Kp == K && a.is_contiguous()) return a;
  auto padded = at::zeros({Mp, Kp}, a.options());
  padded.narrow(0, 0, M).narrow(1, 0, K).copy_(a);
  return padded;
}

#endif

}  // namespace

bool amx_native() {
#ifdef FF_AMX
  return amx::permitted();
#else
  return false;
#endif
}

// w [N, K] bf16 -> [ceil(N/16), ceil(K/32), 16, 32] bf16: per block of 16 output features, its
// B tiles along K in VNNI layout (tile row r holds K pair (2r, 2r + 1) of each feature, the
// pair's two values side by side), zero-padded.
at::Tensor pack_amx_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be a 2-D bf16 tensor");
  auto wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t nb = (N + TN - 1) / TN, kc = (K + TK - 1) / TK;
  auto out = at::zeros({nb, kc, TK / 2, 2 * TN}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < TN && b * TN + j < N; ++j) {
        const uint16_t* row = src + (b * TN + j) * K;
        for (int64_t k = 0; k < K; ++k)
          dst[((b * kc + k / TK) * (TK / 2) + (k % TK) / 2) * 2 * TN + 2 * j + k % 2] = row[k];
      }
  });
  return out;
}

// The [N, K] weight back from pack_amx_weight's tiles (batches above the AMX kernel's rows,
// checkpoints, tests): a view permuted into one copy.
at::Tensor unpack_amx_weight(const at::Tensor& wpacked, int64_t N, int64_t K) {
  TORCH_CHECK(wpacked.dim() == 4 && wpacked.size(2) == TK / 2 && wpacked.size(3) == 2 * TN,
              "unpack_amx_weight: the weight must come from pack_amx_weight");
  const int64_t nb = wpacked.size(0), kc = wpacked.size(1);
  TORCH_CHECK(N > (nb - 1) * TN && N <= nb * TN && K > (kc - 1) * TK && K <= kc * TK,
              "unpack_amx_weight: [", N, ", ", K, "] does not match the packed weight");
  return wpacked.view({nb, kc, TK / 2, TN, 2})
      .permute({0, 3, 1, 2, 4})
      .reshape({nb * TN, kc * TK})
      .narrow(0, 0, N)
      .narrow(1, 0, K)
      .contiguous();
}

// y [.., N] = x [.., K] @ W^T (+ bias) with W packed by pack_amx_weight; fp32 accumulation, y in
// x's dtype or fp32. One row: vdpbf16ps on the tiles (one_row); more rows: AMX tiles where the
// CPU has them, else vdpbf16ps in registers (dp_rows).
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                      const std::optional<at::Tensor>& bias, bool fp32_out) {
  // x's dtype is checked by linear_amx_out
  const bool f32 = fp32_out || x.scalar_type() == at::kFloat;
  auto y = at::empty({x.numel() / std::max<int64_t>(x.size(-1), 1), N},
                     x.options().dtype(f32 ? at::kFloat : at::kBFloat16));
  linear_amx_out(x, wpacked, N, bias, y);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// linear_amx into y, a contiguous [rows, N] bf16 or fp32 tensor (the fused decoder stack's
// buffers for few-token steps; fp32 for logits).
void linear_amx_out(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                    const std::optional<at::Tensor>& bias, at::Tensor& y) {
#ifdef FF_BF16_DP
  TORCH_CHECK(wpacked.dim() == 4 && wpacked.size(2) == TK / 2 && wpacked.size(3) == 2 * TN &&
                  wpacked.scalar_type() == at::kBFloat16 && wpacked.is_contiguous(),
              "linear_amx: the weight must come from pack_amx_weight");
  const int64_t nb = wpacked.size(0), kc = wpacked.size(1), K = x.size(-1);
  TORCH_CHECK(N > (nb - 1) * TN && N <= nb * TN, "N=", N, " does not match the packed weight");
  TORCH_CHECK(K > (kc - 1) * TK && K <= kc * TK, "x has ", K, " features, the weight ",
              kc * TK);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_amx: x must be fp32 or bf16");
  auto x2 = x.reshape({-1, K});
  const int64_t M = x2.size(0), Kp = kc * TK;
  const bool f32 = y.scalar_type() == at::kFloat;
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.is_contiguous() &&
                  (f32 || y.scalar_type() == at::kBFloat16),
              "linear_amx: the output must be a contiguous [", M, ", ", N,
              "] bf16 or fp32 tensor");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " entries");
    b = bias->to(at::kFloat).contiguous();
  }
  if (M == 0) return;
  const auto* wp = reinterpret_cast<const uint16_t*>(wpacked.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  void* yp = y.data_ptr();
#ifdef FF_AMX
  const bool tiles = M > 1 && amx::permitted();
#else
  constexpr bool tiles = false;
#endif
  if (!tiles) {
    // a single row's loop runs over whole tiles: K padded to the tiles' Kp
    const at::Tensor xb = dp_pairs(x2, M == 1 ? Kp : 0);
    const int64_t ldx = xb.size(1);
    const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
    if (M == 1) {
      // each thread from the front of its half, then the other's last blocks (a thread woken
      // late leaves the other waiting less)
      steal_for(nb, nb, kRowBlocks, [&](int64_t b0, int64_t b1) {
        if (f32) one_row(xp, wp, kc, b0, b1, bp, N, static_cast<float*>(yp));
        else one_row(xp, wp, kc, b0, b1, bp, N, static_cast<uint16_t*>(yp));
      });
    } else if (f32) {
      dp_rows(xp, ldx, M, wp, kc, nb, bp, N, static_cast<float*>(yp));
    } else {
      dp_rows(xp, ldx, M, wp, kc, nb, bp, N, static_cast<uint16_t*>(yp));
    }
    return;
  }
#ifdef FF_AMX
  const int64_t Mp = (M + TM - 1) / TM * TM;
  const at::Tensor a = a_tiles(x2, Kp);
  const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr());
  // Threads split the weight's blocks. Up to 64 rows (decode) each streams its share once;
  // more rows (prefill) go over it in groups of blocks that stay in L2 while every 64 rows
  // pass, so the weight is read from memory once and the activations once per group.
  const int64_t group = std::max<int64_t>(2, GROUP_BYTES / (kc * TILE * 2)) / 2 * 2;
  at::parallel_for(0, (nb + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    const int64_t b0 = 2 * p0, b1 = std::min(nb, 2 * p1);
    configure_tiles();
    for (int64_t g0 = b0; g0 < b1; g0 += group) {
      const int64_t g1 = std::min(b1, g0 + group);
      for (int64_t m0 = 0; m0 < Mp; m0 += MC * TM) {
        const int64_t mt = std::min(MC, (Mp - m0) / TM);
        const uint16_t* wg = wp + g0 * kc * TILE;
        if (f32) pass(ap, Kp, m0, mt, M, wg, kc, g0, g1, bp, N, static_cast<float*>(yp));
        else pass(ap, Kp, m0, mt, M, wg, kc, g0, g1, bp, N, static_cast<uint16_t*>(yp));
      }
    }
    _tile_release();
  });
#endif
#else
  (void)x, (void)wpacked, (void)N, (void)bias, (void)y;
  TORCH_CHECK(false, "linear_amx: built without AVX512-BF16");
#endif
}

bool bf16_tiles_native() {
#ifdef FF_BF16_DP
  return true;
#else
  return false;
#endif
}

#ifdef FF_BF16_DP
namespace {

// The 4-bit codes of one block of 16 output features (linear_q4's layout: K/4 quads of 32
// bytes; byte 2i of a quad holds feature i's inputs 4p (low nibble) and 4p + 2, byte 2i + 1
// inputs 4p + 1 and 4p + 3), expanded to the block's bf16 B tiles as pack_amx_weight lays them
// out: w = table[code] * scale + zero, rounded once to bf16. A quad's low nibbles are tile row
// 2p (inputs 4p, 4p + 1 of the 16 features, side by side) and its high nibbles row 2p + 1, so
// the codes need no shuffling: each byte widens to a 32-bit lane, whose low four bits index
// the table (vpermps), and two lanes per feature take its scale and zero.
// sz: the block's [G][C][16] bf16 scales (C = 2: then zeros); dst: kc tiles.
void expand_q4_block(const uint8_t* codes, int64_t quads, const uint16_t* sz, int C,
                     int64_t quads_per_group, __m512 table, int64_t kc, uint16_t* dst) {
  const __m512i lo8 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi8 = _mm512_add_epi32(lo8, _mm512_set1_epi32(8));
  __m512 z0 = _mm512_setzero_ps(), z1 = z0;
  for (int64_t q0 = 0; q0 < quads; q0 += quads_per_group) {
    const uint16_t* st = sz + q0 / quads_per_group * C * TN;  // the group's scales (and zeros),
    const __m512 s = load_bf16(st);                          // two lanes per feature
    const __m512 s0 = _mm512_permutexvar_ps(lo8, s), s1 = _mm512_permutexvar_ps(hi8, s);
    if (C == 2) {
      const __m512 z = load_bf16(st + TN);
      z0 = _mm512_permutexvar_ps(lo8, z);
      z1 = _mm512_permutexvar_ps(hi8, z);
    }
    for (int64_t q = q0; q < q0 + quads_per_group; ++q) {
      const auto* qb = reinterpret_cast<const __m128i*>(codes + q * 32);
      const __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(qb));      // features 0-7
      const __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(qb + 1));  // 8-15
      const __m512 l0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(d0, table), s0, z0);
      const __m512 l1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(d1, table), s1, z1);
      const __m512 h0 =
          _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d0, 4), table), s0, z0);
      const __m512 h1 =
          _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d1, 4), table), s1, z1);
      uint16_t* row = dst + q / 8 * TILE + q % 8 * 2 * 2 * TN;
      _mm512_storeu_si512(row, (__m512i)_mm512_cvtne2ps_pbh(l1, l0));
      _mm512_storeu_si512(row + 2 * TN, (__m512i)_mm512_cvtne2ps_pbh(h1, h0));
    }
  }
  // K past the codes, up to the last tile's 32: zero rows (the A tiles' padding is zero too)
  std::memset(dst + quads * 2 * 2 * TN, 0, (kc * TILE - quads * 2 * 2 * TN) * 2);
}
// One block of 16 output features of int8 codes with a float32 scale per group of inputs
// (linear_i8g_amx's layout: K/2 pairs of 32 bytes, byte 2i + h of pair p = feature i's input
// 2p + h, which is already a B tile row), expanded to bf16 B tiles: w = code * scale, rounded
// once to bf16. sc: the block's [G][16] scales; dst: kc tiles.
void expand_i8_block(const int8_t* codes, int64_t pairs, const float* sc,
                     int64_t pairs_per_group, int64_t kc, uint16_t* dst) {
  const __m512i lo8 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi8 = _mm512_add_epi32(lo8, _mm512_set1_epi32(8));
  for (int64_t p0 = 0; p0 < pairs; p0 += pairs_per_group) {
    const __m512 s = _mm512_loadu_ps(sc + p0 / pairs_per_group * TN);
    const __m512 s0 = _mm512_permutexvar_ps(lo8, s), s1 = _mm512_permutexvar_ps(hi8, s);
    for (int64_t p = p0; p < p0 + pairs_per_group; ++p) {
      const auto* pb = reinterpret_cast<const __m128i*>(codes + p * 32);
      const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pb))), s0);
      const __m512 w1 =
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pb + 1))), s1);
      _mm512_storeu_si512(dst + p / 16 * TILE + p % 16 * 2 * TN,
                          (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
  }
  std::memset(dst + pairs * 2 * TN, 0, (kc * TILE - pairs * 2 * TN) * 2);  // K's padding
}

// y [M, nb * 16] (bf16) = x2 [M, K] @ W^T for a weight stored in some compact form, expanded a
// block of 16 output features at a time by expand(b, dst) into dst's kc bf16 B tiles (the
// layout pack_amx_weight writes). Each thread expands its blocks into a buffer that stays in
// cache and multiplies every row by it: the expansion is paid once per call, not once per row.
// On AMX tiles where the CPU allows them; else (AVX512-BF16 alone: the Zen 4 and Zen 5 EPYCs)
// through dp_rows' register block, a group of kDpBlocks blocks expanded at a time and every
// row multiplied by it, kDpRows at a time, as linear_amx multiplies a bf16 weight there.
template <typename Expand>
at::Tensor expanded_linear(const at::Tensor& x2, int64_t nb, Expand&& expand) {
  const int64_t K = x2.size(1), kc = (K + TK - 1) / TK, N = nb * TN, M = x2.size(0);
  auto y = at::empty({M, N}, x2.options().dtype(at::kBFloat16));
  if (M == 0) return y;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
#ifdef FF_AMX
  if (amx::permitted()) {
    const int64_t Kp = kc * TK, Mp = (M + TM - 1) / TM * TM;
    const at::Tensor a = a_tiles(x2, Kp);
    const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr());
    // Up to 64 rows a pair of blocks is expanded and used at once (in L1); more rows take
    // groups of blocks that stay in L2 while every 64 rows pass, as in linear_amx.
    const int64_t group =
        Mp <= MC * TM ? 2 : std::max<int64_t>(2, GROUP_BYTES / (kc * TILE * 2)) / 2 * 2;
    at::parallel_for(0, (nb + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      const int64_t b0 = 2 * p0, b1 = std::min(nb, 2 * p1);
      std::vector<uint16_t> buf(std::min(group, b1 - b0) * kc * TILE);
      configure_tiles();
      for (int64_t g0 = b0; g0 < b1; g0 += group) {
        const int64_t g1 = std::min(b1, g0 + group);
        for (int64_t b = g0; b < g1; ++b) expand(b, buf.data() + (b - g0) * kc * TILE);
        for (int64_t m0 = 0; m0 < Mp; m0 += MC * TM)
          pass(ap, Kp, m0, std::min(MC, (Mp - m0) / TM), M, buf.data(), kc, g0, g1, nullptr, N,
               yp);
      }
      _tile_release();
    });
    return y;
  }
#endif
  const at::Tensor xb = dp_pairs(x2);
  const int64_t ldx = xb.size(1), pairs = ldx / 2, bstride = kc * TILE;
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  constexpr int64_t NB = kDpBlocks;
  const int64_t groups = (nb + NB - 1) / NB;
  steal_for(groups, groups, 1, [&](int64_t g0, int64_t g1) {
    thread_local std::vector<uint16_t> buf;
    buf.resize(NB * bstride);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * NB, nbk = std::min<int64_t>(NB, nb - b0);
      for (int64_t u = 0; u < nbk; ++u) expand(b0 + u, buf.data() + u * bstride);
      dp_group(xp, ldx, 0, M, buf.data(), bstride, pairs, b0, nbk, nullptr, N, yp, nullptr, 0);
    }
  });
  return y;
}

}  // namespace
#endif

// linear_q4 on bf16 tiles (AMX, or vdpbf16ps: expanded_linear): y [.., N] = x [.., K] @ W^T with
// W in linear_q4's 4-bit layout, each block's codes expanded to bf16 tiles (expand_q4_block)
// once per call. The weight is rounded
// to bf16 once (as dequantizing to bf16 and calling a bf16 linear would), products accumulate
// in fp32.
at::Tensor linear_q4_amx(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                         const at::Tensor& table, int64_t group_size) {
#ifdef FF_BF16_DP
  check_linear_q4(x, wq, sz, table, group_size);
  const int64_t nb = wq.size(0), quads = wq.size(1), K = quads * 4;
  const int64_t kc = (K + TK - 1) / TK, C = sz.size(2), G = K / group_size;
  const __m512 tab = load_bf16(reinterpret_cast<const uint16_t*>(table.contiguous().data_ptr()));
  const auto* codes = wq.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr());
  auto y = expanded_linear(x.reshape({-1, K}), nb, [&](int64_t b, uint16_t* dst) {
    expand_q4_block(codes + b * quads * 32, quads, sp + b * G * C * TN, int(C), group_size / 4,
                    tab, kc, dst);
  });
  auto sizes = x.sizes().vec();
  sizes.back() = nb * TN;
  return y.view(sizes);
#else
  (void)x, (void)wq, (void)sz, (void)table, (void)group_size;
  TORCH_CHECK(false, "linear_q4_amx: built without AVX512-BF16");
#endif
}

// y [.., N] = x [.., K] @ W^T for int8 codes with a scale per group of inputs (GGUF Q8_0, Q5_0,
// Q6_K), on bf16 tiles (AMX, or vdpbf16ps: expanded_linear): codes [N/16, K/2, 16, 2] int8 (per block of 16 output features and
// input pair, the 16 features' two codes side by side), scales [N/16, K/group, 16] float32.
// The weight is rounded to bf16 once, products accumulate in fp32; x bf16, y bf16. Up to
// kI8gRowsMax rows go to linear_i8g_rows (exact integer products of int16 rows, no rounding of
// the weight) where the CPU has AVX512-VNNI.
at::Tensor linear_i8g_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          int64_t group_size) {
#ifdef FF_BF16_DP
  check_i8g(x, codes, scales, group_size);
  const int64_t nb = codes.size(0), pairs = codes.size(1), K = pairs * 2;
  const int64_t G = K / group_size, kc = (K + TK - 1) / TK;
  if (x.numel() <= kI8gRowsMax * K && int8_rows_native())
    return linear_i8g_rows(x, codes, scales, group_size);
  const auto* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  auto y = expanded_linear(x.reshape({-1, K}), nb, [&](int64_t b, uint16_t* dst) {
    expand_i8_block(cp + b * pairs * 32, pairs, sp + b * G * TN, group_size / 2, kc, dst);
  });
  auto sizes = x.sizes().vec();
  sizes.back() = nb * TN;
  return y.view(sizes);
#else
  (void)x, (void)codes, (void)scales, (void)group_size;
  TORCH_CHECK(false, "linear_i8g_amx: built without AVX512-BF16");
#endif
}

}  // namespace ff
