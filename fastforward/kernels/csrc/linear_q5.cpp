// y = x @ W^T for 5-bit weights with one float16 scale per group of inputs, for batches of a few
// rows (decode): W[n, k] = (code[n, k] - 16) * s[n, g], codes 0..31 -- GGUF's Q5_0 grid, which
// our int5 quantizer reproduces (fastforward/quant/int5.py).
//
// Codes: [N/16, K/4, 40] bytes, one stream per tile of 16 outputs. Of the 40 bytes of tile t and
// input quad p, the first 32 hold the low four bits in linear_q4's packed layout (byte 2i holds
// code[16t+i][4p] (low nibble) and code[16t+i][4p+2] (high), byte 2i+1 codes 4p+1 and 4p+3), the
// last 8 the fifth bits as a 64-bit mask: bit 2i+j is code[16t+i][4p+j]'s, bit 32+2i+j is
// code[16t+i][4p+2+j]'s. (Two streams a tile, low bits and masks apart, ran 25-40% slower per
// byte than int4 at one row.) So one zero-extension of the 32 bytes to words, two masks and two masked
// adds of 16 give the 64 codes as words, in the order of the int16 pairs of x (int16_rows.h), and
// AVX512-VNNI's vpdpwssd takes exact int32 dot products per group:
// d = sum_k xq[k] * code[k], then y += s * (xs * d - 16 * sum_k x[k]).
//
// A decode step reads 5 bits per weight plus the group scales (0.5 bits at groups of 32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "expand.h"
#include "int16_rows.h"
#include "ops.h"

namespace ff {

constexpr int QUAD_BYTES_Q5 = 40;  // a tile's quad: 32 bytes of low bits, 8 of fifth bits

#ifdef FF_INT16_ROWS
namespace {

constexpr int TILE = 16;
constexpr int QUAD_BYTES = QUAD_BYTES_Q5;
constexpr int PF_TILES = 4;  // the same quad of the next run's tile (linear_q4.cpp PF_TILES)

// The int5 codes of int_codes_block (int16_rows.h): low bits and masks from the tile's stream.
struct Int5Codes {
  const uint8_t* w;     // [N/16, K/4, 40]
  const uint16_t* sc;   // [N/16, G, 16] float16
  int64_t quads, G;

  // word 2i + j of lo: code[i][4q + j]; of hi: code[i][4q + 2 + j] (times 16 if HI16)
  template <bool HI16>
  void words(int64_t tile, int64_t q, __m512i& lo, __m512i& hi) const {
    const __m512i nib = _mm512_set1_epi16(0x000f), sixteen = _mm512_set1_epi16(16);
    const uint8_t* src = w + (tile * quads + q) * QUAD_BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(src + PF_TILES * quads * QUAD_BYTES), _MM_HINT_T0);
    const __m512i b =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    // the masks straight from memory (kmovd k, m32: a load, not a move from a register)
    auto* bits = reinterpret_cast<__mmask32*>(const_cast<uint8_t*>(src + 32));
    lo = _mm512_and_si512(b, nib);
    lo = _mm512_mask_add_epi16(lo, _load_mask32(bits), lo, sixteen);
    if constexpr (HI16) {
      hi = _mm512_and_si512(b, _mm512_set1_epi16(0x00f0));
      hi = _mm512_mask_add_epi16(hi, _load_mask32(bits + 1), hi, _mm512_set1_epi16(256));
    } else {
      hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
      hi = _mm512_mask_add_epi16(hi, _load_mask32(bits + 1), hi, sixteen);
    }
  }

  // w = (code - 16) * s: the zero term is -16 s.
  void scale_zero(int64_t tile, int64_t g, __m512& s, __m512& z) const {
    s = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + (tile * G + g) * TILE)));
    z = _mm512_mul_ps(_mm512_set1_ps(-16.f), s);
  }
};

}  // namespace
#endif

namespace {

// codes [N/16, K/4, 40] uint8, scales [N/16, K/group, 16] float16.
void check_q5(const at::Tensor& codes, const at::Tensor& scales, int64_t group_size) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == QUAD_BYTES_Q5 &&
                  codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be a contiguous [N/16, K/4, 40] uint8 tensor");
  const int64_t tiles = codes.size(0), quads = codes.size(1), K = quads * 4;
  TORCH_CHECK(group_size >= 4 && group_size % 4 == 0 && K % group_size == 0, "group size ",
              group_size, " must be a multiple of 4 dividing K=", K);
  const int64_t G = K / group_size;
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == tiles && scales.size(1) == G &&
                  scales.size(2) == 16 && scales.scalar_type() == at::kHalf &&
                  scales.is_contiguous(),
              "scales must be a contiguous [N/16, K/group, 16] float16 tensor");
}

}  // namespace

// x [.., K] bf16, the weight in the layouts above (check_q5). Meant for few rows: the cost grows
// with them.
at::Tensor linear_q5(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     int64_t group_size) {
  check_q5(codes, scales, group_size);
  const int64_t tiles = codes.size(0), K = codes.size(1) * 4, N = tiles * 16, G = K / group_size;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K, "x must be bf16 with ", K,
              " features");
#ifdef FF_INT16_ROWS
  auto xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(out_sizes);
  std::vector<int16_t> xq(M * K);
  std::vector<float> xs(M * G), sx(M * G);
  quantize_groups(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K, group_size, xq.data(),
                  xs.data(), sx.data());
  const Int5Codes c{codes.data_ptr<uint8_t>(),
                    reinterpret_cast<const uint16_t*>(scales.data_ptr()), K / 4, G};
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t qpg = group_size / 4;
  for_row_blocks(tiles, M, K * 10, [&](auto nt, auto mr, int64_t m0, int64_t t0) {
    int_codes_block<decltype(mr)::value, decltype(nt)::value>(
        c, xq.data() + m0 * K, K, xs.data() + m0 * G, sx.data() + m0 * G, G, qpg, t0,
        yp + m0 * N, N);
  });
  return y.view(out_sizes);
#else
  TORCH_CHECK(false, "linear_q5 needs AVX512-VNNI");
#endif
}

// The weight [N, K] as float32 or bf16 (out's dtype, [N, K], written here): for the dense
// matmul of large batches, where one expansion per call serves every row. With rows, only
// those ([R, K]: embedding lookups).
void dequantize_q5(const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out,
                   const std::optional<at::Tensor>& rows) {
  const int64_t tiles = codes.size(0), quads = codes.size(1), K = quads * 4;
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) > 0 && K % scales.size(1) == 0,
              "scales must be [N/16, K/group, 16]");
  const int64_t G = scales.size(1), group_size = K / G;
  check_q5(codes, scales, group_size);
  const auto* wp = codes.data_ptr<uint8_t>();
  const auto* sp = scales.data_ptr<at::Half>();
  expand_tiles(out, tiles, K, rows, [&](int64_t t, int i, float* row) {
    for (int64_t q = 0; q < quads; ++q) {
      const uint8_t* quad = wp + (t * quads + q) * QUAD_BYTES_Q5;
      const uint8_t* b = quad + 2 * i;
      uint64_t bits;
      std::memcpy(&bits, quad + 32, 8);
      const float s = float(sp[(t * G + 4 * q / group_size) * 16 + i]);
      const int c0 = (b[0] & 15) | int((bits >> (2 * i)) & 1) << 4;
      const int c1 = (b[1] & 15) | int((bits >> (2 * i + 1)) & 1) << 4;
      const int c2 = (b[0] >> 4) | int((bits >> (32 + 2 * i)) & 1) << 4;
      const int c3 = (b[1] >> 4) | int((bits >> (33 + 2 * i)) & 1) << 4;
      float* r = row + 4 * q;
      r[0] = float(c0 - 16) * s, r[1] = float(c1 - 16) * s;
      r[2] = float(c2 - 16) * s, r[3] = float(c3 - 16) * s;
    }
  });
}

}  // namespace ff
