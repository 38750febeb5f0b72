// Portable SIMD through GCC/Clang vector extensions at the machine's native width: one source
// that -march=native lowers to AVX-512 (16 floats a register), AVX2 (8) or SSE (4).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ff {

#if defined(__AVX512F__)
constexpr int VL = 16;
#elif defined(__AVX__)
constexpr int VL = 8;
#else
constexpr int VL = 4;
#endif

// Values in registers; memory is only touched through the unaligned may_alias types *_m.
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef int8_t vb __attribute__((vector_size(VL)));
typedef float vf_m __attribute__((vector_size(VL * 4), aligned(4), may_alias));
typedef uint16_t vh_m __attribute__((vector_size(VL * 2), aligned(2), may_alias));
typedef int8_t vb_m __attribute__((vector_size(VL), aligned(1), may_alias));

inline vf splat(float x) {
  vf v = {x};
  return __builtin_shuffle(v, vi{});  // lane 0 everywhere: one broadcast instruction
}
inline vf load(const float* p) { return *reinterpret_cast<const vf_m*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_m*>(p) = v; }

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits.
// (AVX-512: one vpmovzxwd from memory and a shift; GCC's generic widening takes 5 instructions.)
inline vf load_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
  __m512i u = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<vf&>(u);
#else
  vh h = *reinterpret_cast<const vh_m*>(p);
  vu u = __builtin_convertvector(h, vu) << 16;
  return reinterpret_cast<vf&>(u);
#endif
}

// int8 -> fp32. GCC scalarizes the generic widening of a 16-byte int8 vector (a byte at a time,
// ~4x slower than the load it replaces), so x86 gets the sign-extending intrinsics.
inline vf load_i8(const int8_t* p) {
#if defined(__AVX512F__)
  __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return reinterpret_cast<vf&>(f);
#elif defined(__AVX2__)
  __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  return reinterpret_cast<vf&>(f);
#else
  vb b = *reinterpret_cast<const vb_m*>(p);
  return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
#endif
}

// fp32 -> bf16, round to nearest even, NaN kept a quiet NaN (as c10::BFloat16). With
// AVX512-BF16 one vcvtneps2bf16 (which also flushes fp32 denormals, below 1.2e-38, to zero).
inline void store_bf16(uint16_t* p, vf f) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      (__m256i)_mm512_cvtneps_pbh(reinterpret_cast<__m512&>(f)));
#else
  vu u = reinterpret_cast<vu&>(f);
  vu rounded = (u + (((u >> 16) & 1u) + 0x7fffu)) >> 16;
  vu nan = reinterpret_cast<vu>(f != f);
  vu out = (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
  *reinterpret_cast<vh_m*>(p) = __builtin_convertvector(out, vh);
#endif
}

// f rounded to bf16 (nearest even, NaN kept quiet), still as fp32: float_to_bf16 lane-wise.
inline vf round_bf16(vf f) {
  vu u = reinterpret_cast<vu&>(f);
  vu rounded = (u + (((u >> 16) & 1u) + 0x7fffu)) & 0xffff0000u;
  vu nan = reinterpret_cast<vu>(f != f);
  vu out = (rounded & ~nan) | ((u | 0x400000u) & 0xffff0000u & nan);
  return reinterpret_cast<vf&>(out);
}

// 1 / d: AVX-512's 14-bit estimate and one Newton step (relative error ~2^-27, a fraction of
// an fp32 ulp from the quotient; vdivps costs ~10x the throughput), else the division.
inline vf vrecip(vf d) {
#if defined(__AVX512F__)
  const __m512 r0 = _mm512_rcp14_ps(reinterpret_cast<__m512&>(d));
  vf r = reinterpret_cast<const vf&>(r0);
  return r * (splat(2.f) - d * r);
#else
  return splat(1.f) / d;
#endif
}

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (f != f) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + (((u >> 16) & 1u) + 0x7fffu)) >> 16);
}

// Horizontal sum and max: a shuffle tree on AVX-512 (a serial chain of VL adds elsewhere).
inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512&>(v));
#else
  float s = 0.f;
#pragma GCC unroll 16
  for (int i = 0; i < VL; ++i) s += v[i];
  return s;
#endif
}

inline float hmax(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512&>(v));
#else
  float m = v[0];
#pragma GCC unroll 16
  for (int i = 1; i < VL; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

// exp(x) for a vector: 2^n * 2^f with n = round(x / ln 2) and a degree-6 polynomial for 2^f on
// [-1/2, 1/2] (relative error below 2e-7). Lanes below -87 (and -inf) give exactly 0.
inline vf vexp(vf x) {
  const vf lo = splat(-87.0f), hi = splat(88.0f);
  vf xc = x < lo ? lo : (x > hi ? hi : x);
  vf t = xc * 1.44269504088896341f;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (t + magic) - magic;
  vf f = (t - n) * 0.693147180559945309f;  // in [-ln2/2, ln2/2]
  vf p = splat(1.0f / 720) * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf r = p * reinterpret_cast<vf&>(e);
  return x < lo ? vf{} : r;
}

// Elements of the activation / cache types the kernels take, as float.
template <typename T>
inline float ld(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, uint16_t>) return bf16_to_float(p[i]);
  else return static_cast<float>(p[i]);
}

template <typename T>
inline void st(T* p, int64_t i, float v) {
  if constexpr (std::is_same_v<T, uint16_t>) p[i] = float_to_bf16(v);
  else p[i] = static_cast<T>(v);
}

template <typename T>
inline vf ldv(const T* p) {
  if constexpr (std::is_same_v<T, uint16_t>) return load_bf16(p);
  else if constexpr (std::is_same_v<T, int8_t>) return load_i8(p);
  else return load(p);
}

template <typename T>
inline void stv(T* p, vf v) {
  if constexpr (std::is_same_v<T, uint16_t>) store_bf16(p, v);
  else store(p, v);
}

#if defined(__AVX512F__)
// Transposes a 16 x 16 tile of 32-bit elements in registers: r[i] lane j <- r[j] lane i.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // rows now hold 4 x 4 transposed tiles per 128-bit lane; move the 128-bit lanes
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}
#endif

}  // namespace ff
