// Rows of bf16 activations as int16 per group of inputs, for integer dot products with
// weight codes (AVX512-VNNI's vpdpwssd: two int16 products per int32 lane, exact): the 4-bit
// kernel's int4 path (linear_q4.cpp) and the int8-group kernel's few-row path
// (linear_i8g.cpp). A group's step is max |x| / 32767, 2^-16 of its largest element, where
// bf16 itself carries 2^-9 of each element.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FF_INT16_ROWS 1
#include <immintrin.h>

namespace ff {

// Each group of each row of x [M, K] bf16 as int16: xq = round(x / xs) with xs = max |x| / 32767
// (0 for an all-zero group), and the group's sum of x in fp32 (sx; may be null).
inline void quantize_groups(const uint16_t* x, int64_t M, int64_t K, int64_t group, int16_t* xq,
                            float* xs, float* sx) {
  constexpr int64_t L = 16;
  auto load16 = [](const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  const int64_t G = K / group;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* src = x + m * K + g * group;
      int16_t* dst = xq + m * K + g * group;
      __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + L <= group; k += L) {
        const __m512 v = load16(src + k);
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
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(src + k), iv));
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

}  // namespace ff
#endif
