// y = x @ W^T for int8 codes with a float32 scale per group of inputs (GGUF Q8_0, Q5_0, Q6_K)
// or a bf16 scale per output row (our int8), for batches of a few rows (decode): each row's
// groups of x as int16 (int16_rows.h), the codes sign-extended to words, exact int32 dot
// products per group with AVX512-VNNI's vpdpwssd, then y += s * xs * d (group scales), or
// y = s * sum over groups of xs * d (row scales, x in groups of 32). Codes stay in linear_i8g_amx's layout ([N/16, K/2, 16, 2]: per block of 16
// output features and input pair, the 16 features' two codes side by side, so 32 bytes widen
// to one vector of 16 lanes of (code[i][2p], code[i][2p + 1])), read once per call; AMX's
// expansion to bf16 tiles pays for itself only over many rows (Q8_0 [49152, 576] from memory,
// 2 threads: 1 row 3.3 ms there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "int16_rows.h"
#include "ops.h"

namespace ff {

constexpr int64_t kRowGroup = 32;  // linear_i8_rows: inputs per int16 group of x

#ifdef FF_INT16_ROWS
namespace {

constexpr int TN = int(TN_ROWS);  // output features per block
constexpr int PAIR_BYTES = 32;
constexpr int PF_BLOCKS = 4;  // the same line of the next run's block (linear_q4.cpp PF_TILES)

// MR rows x NT blocks from block b0. One row keeps even and odd input pairs in two chains per
// block (8 with NT = 4) to cover vpdpwssd's latency; more rows have MR x NT chains already.
// Scales: sc [N/16][G][16] float32 per group, or rs [N] bf16 per output row (ROW).
// noinline: kept out of for_row_blocks' walk (inlined there, the [3072, 576] int4 matrix
// from L3 took 62-65 us against 39-46)
template <int MR, int NT, bool ROW>
__attribute__((noinline)) void block(const int16_t* xq, const float* xs, int64_t K,
                                     const int8_t* w, const float* sc, const uint16_t* rs,
                                     int64_t G, int64_t pairs_per_group, int64_t b0, uint16_t* y,
                                     int64_t N) {
  constexpr int CH = MR == 1 ? 2 : 1;
  const int64_t block_bytes = K / 2 * PAIR_BYTES;
  const int8_t* wb = w + b0 * block_bytes;
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i d[CH][MR][NT];
    for (int c = 0; c < CH; ++c)
      for (int m = 0; m < MR; ++m)
        for (int t = 0; t < NT; ++t) d[c][m][t] = _mm512_setzero_si512();
    const int64_t p0 = g * pairs_per_group;
    for (int64_t p = p0; p < p0 + pairs_per_group; ++p) {
      __m512i xp[MR];
      for (int m = 0; m < MR; ++m) xp[m] = splat_pair(xq + m * K + 2 * p);
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const int8_t* src = wb + t * block_bytes + p * PAIR_BYTES;
        if ((p & 1) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(src + PF_BLOCKS * block_bytes), _MM_HINT_T0);
        const __m512i wv =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          __m512i& dc = d[CH == 2 ? int(p & 1) : 0][m][t];
          dc = _mm512_dpwssd_epi32(dc, wv, xp[m]);
        }
      }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      const __m512 s = ROW ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(sc + ((b0 + t) * G + g) * TN);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m512i dm = CH == 2 ? _mm512_add_epi32(d[0][m][t], d[CH - 1][m][t]) : d[0][m][t];
        const __m512 f = _mm512_set1_ps(xs[m * G + g]);
        acc[m][t] = _mm512_fmadd_ps(ROW ? f : _mm512_mul_ps(s, f), _mm512_cvtepi32_ps(dm), acc[m][t]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) {
      if constexpr (ROW) {
        acc[m][t] = _mm512_mul_ps(acc[m][t], load_bf16x16(rs + (b0 + t) * TN));
      }
      store_bf16(y + m * N + (b0 + t) * TN, reinterpret_cast<const vf&>(acc[m][t]));
    }
}

// The few-row product shared by both entry points: scales per group (sc) or per row (rs).
template <bool ROW>
at::Tensor run_rows(const at::Tensor& x, const at::Tensor& codes, const float* sc,
                    const uint16_t* rs, int64_t group_size) {
  const int64_t M = x.size(0), K = x.size(1), nb = codes.size(0), N = nb * TN;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t G = K / group_size;
  std::vector<int16_t> xq(M * K);
  std::vector<float> xs(M * G);
  quantize_groups(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, group_size, xq.data(),
                  xs.data(), nullptr);
  const auto* wp = codes.data_ptr<int8_t>();
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ppg = group_size / 2;
  for_row_blocks(nb, M, K * TN, [&](auto nt, auto mr, int64_t m0, int64_t b0) {
    block<decltype(mr)::value, decltype(nt)::value, ROW>(xq.data() + m0 * K, xs.data() + m0 * G,
                                                        K, wp, sc, rs, G, ppg, b0, yp + m0 * N,
                                                        N);
  });
  return y;
}

}  // namespace
#endif

bool int8_rows_native() {
#ifdef FF_INT16_ROWS
  return true;
#else
  return false;
#endif
}

void check_i8g(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
               int64_t group_size) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == TN_ROWS && codes.size(3) == 2 &&
                  codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be a contiguous [N/16, K/2, 16, 2] int8 tensor");
  const int64_t nb = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0 && K % group_size == 0, "group size ",
              group_size, " must be even and divide K=", K);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == nb && scales.size(1) == K / group_size &&
                  scales.size(2) == TN_ROWS && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous(),
              "scales must be a contiguous [N/16, K/group, 16] float32 tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K, "x must be bf16 with ", K,
              " features");
}

// x [.., K] bf16, codes and scales as linear_i8g_amx. Rows go 4 at a time over each block's
// codes, so the cost grows with the rows: meant for up to kI8gRowsMax (linear_i8g_amx hands
// those over; on CPUs without AMX Int8GroupLinear calls this directly for few rows).
at::Tensor linear_i8g_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           int64_t group_size) {
  check_i8g(x, codes, scales, group_size);
#ifdef FF_INT16_ROWS
  const int64_t K = x.size(-1);
  auto y = run_rows<false>(x.reshape({-1, K}).contiguous(), codes, scales.data_ptr<float>(),
                           nullptr, group_size);
  auto sizes = x.sizes().vec();
  sizes.back() = codes.size(0) * TN_ROWS;
  return y.view(sizes);
#else
  TORCH_CHECK(false, "linear_i8g_rows needs AVX512-VNNI");
#endif
}

// y [.., N] = x [.., K] @ W^T for int8 codes with one bf16 scale per output row (Int8Linear)
// in the int8-group layout (codes [N/16, K/2, 16, 2]), x in groups of 32 inputs; meant for
// few rows (Int8Linear.native_rows_max).
at::Tensor linear_i8_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == TN_ROWS && codes.size(3) == 2 &&
                  codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be a contiguous [N/16, K/2, 16, 2] int8 tensor");
  const int64_t N = codes.size(0) * TN_ROWS, K = codes.size(1) * 2;
  TORCH_CHECK(K % kRowGroup == 0, "linear_i8_rows needs K a multiple of ", kRowGroup, ", got ",
              K);
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N &&
                  scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(),
              "scales must be a contiguous [N] bf16 tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K, "x must be bf16 with ", K,
              " features");
  auto xc = x.reshape({-1, K}).contiguous();
#ifdef FF_INT16_ROWS
  auto y = run_rows<true>(xc, codes, nullptr,
                          reinterpret_cast<const uint16_t*>(scales.data_ptr()), kRowGroup);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
#else
  TORCH_CHECK(false, "linear_i8_rows needs AVX512-VNNI");
#endif
}

}  // namespace ff
