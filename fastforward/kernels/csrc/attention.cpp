// Paged attention for the CPU: new queries of a flat varlen batch attend over their sequences'
// keys, read in place from the block-paged cache [2, num_blocks, block_size, KVH, D] through the
// block tables -- nothing is gathered or padded.
//
// Work is split into items of (sequence, KV head, chunk of query tokens, part of the key
// range). An item's rows are its query tokens x the query heads that share the KV head (GQA),
// so every key and value loaded is used by all of them (a decode item takes all the sequence's
// KV heads, rows head-major, and reads each block's rows as one span). Per block of keys the
// generic item (no dot-product path: float caches, CPUs without AVX512-BF16) converts K to fp32
// once per KV head (16
// keys at a time, the next 16 prefetched), scores every row against all of them with one
// transposing reduction, updates each row's online softmax (running max m, sum l, accumulator
// acc) on the vector of scores, then accumulates V. When there are too few items to keep every
// thread busy (decode of a few long sequences), the key range is split into parts whose partial
// (m, l, acc) are merged at the end (flash-decoding).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "parallel.h"
#include "vec.h"

namespace ff {
namespace {

constexpr int ROWS_MAX = 16;  // query rows per item: tokens x heads of a GQA group
constexpr int BS_MAX = 1024;  // block sizes up to this (keys go VL at a time)
constexpr int D_MAX = 512;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Geometry {
  int64_t H, KVH, D, G, BS, NB, W;  // heads, KV heads, head dim, group, block size, blocks, table width
  int64_t qc;                       // query tokens per chunk
  float scale, softcap;
  int64_t window;  // 0: none
};

struct Item {
  int64_t seq, kvh, t0, nt, k_lo, k_hi;  // tokens [t0, t0 + nt); keys [k_lo, k_hi)
  int64_t nh = 1;  // KV heads [kvh, kvh + nh): rows are head-major, nt * G per head
};

// Row r of an item: its query token and query head.
inline int64_t row_token(const Item& it, const Geometry& g, int64_t r) {
  return it.t0 + r % (it.nt * g.G) / g.G;
}
inline int64_t row_head(const Item& it, const Geometry& g, int64_t r) {
  const int64_t per_head = it.nt * g.G;
  return (it.kvh + r / per_head) * g.G + r % per_head % g.G;
}

inline void axpy(float* y, float a, const float* x, int64_t D) {  // y += a * x
  const vf av = splat(a);
  int64_t i = 0;
  for (; i + VL <= D; i += VL) store(y + i, load(y + i) + av * load(x + i));
  for (; i < D; ++i) y[i] += a * x[i];
}

inline void scale_vec(float* y, float a, int64_t D) {
  const vf av = splat(a);
  int64_t i = 0;
  for (; i + VL <= D; i += VL) store(y + i, load(y + i) * av);
  for (; i < D; ++i) y[i] *= a;
}

template <typename T>
inline void to_float(float* dst, const T* src, int64_t D) {
  int64_t i = 0;
  for (; i + VL <= D; i += VL) store(dst + i, ldv(src + i));
  for (; i < D; ++i) dst[i] = ld(src, i);
}

// An int8 row's scale, applied to the row's dot product (K) or softmax weight (V) instead of
// to its D elements; 1 for a float cache. Rows n..VL get 0 where the CPU has AVX-512: one
// vcvtph2ps of the gathered halves (with to_int16 vectorized, the int8 dot-product path went
// 101 -> 92 us for 8 sequences of 175 keys from L2 on one thread).
inline void row_scales(float* dst, const at::Half* scales, int64_t stride, int64_t n) {
  if (!scales) {
    std::fill(dst, dst + n, 1.f);
    return;
  }
  const auto* h = reinterpret_cast<const uint16_t*>(scales);
#if defined(__AVX512F__)
  alignas(32) uint16_t hb[VL] = {};
  for (int64_t j = 0; j < n; ++j) hb[j] = h[j * stride];
  _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(hb))));
#else
  // float16 -> float32 by moving the bits (c10::Half's portable conversion costs more than the
  // attention of the row): exact for normal numbers, which the quantizer's scales always are.
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = h[j * stride];
    const uint32_t u = ((b & 0x8000u) << 16) | (((b & 0x7fffu) << 13) + (112u << 23));
    std::memcpy(dst + j, &u, sizeof u);
  }
#endif
}

// sums[j] = the sum of the lanes of p[j], for the VL vectors p[0..VL): a transposing reduction
// (AVX-512: 45 shuffles and adds for 16 sums, where 16 separate horizontal sums take ~4x that).
inline vf hsum_each(const vf* p) {
#if defined(__AVX512F__)
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: (x0+x2, y0+y2, x1+x3, y1+y3)
    const __m512 x = reinterpret_cast<const __m512&>(p[2 * i]);
    const __m512 y = reinterpret_cast<const __m512&>(p[2 * i + 1]);
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of 4 consecutive vectors
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // lane i of b[v] holds partial sums of vectors 4v..4v+3; add the 4 lanes, vector v to lane v
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                   _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                   _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88),
                                 _mm512_shuffle_f32x4(w01, w23, 0xDD));
  return reinterpret_cast<const vf&>(r);
#else
  vf out;
  for (int j = 0; j < VL; ++j) out[j] = hsum(p[j]);
  return out;
#endif
}

inline vi iota() {
  vi v;
  for (int i = 0; i < VL; ++i) v[i] = i;
  return v;
}

// Scores sc of keys s0 + lane with those outside [rlo, rhi) at -inf (none when all VL lanes
// are inside).
inline vf mask_keys(vf sc, int64_t s0, int64_t rlo, int64_t rhi) {
  if (rlo <= s0 && rhi >= s0 + VL) return sc;
  const vi kj = iota() + int(s0);
  return ((kj >= int(rlo)) & (kj < int(rhi))) ? sc : splat(NEG_INF);
}

// An item's rows: the keys [lo, hi) each may see (causal, sliding window, the item's part of
// the key range), their online-softmax state, and the keys some row needs.
struct RowState {
  int64_t lo[ROWS_MAX], hi[ROWS_MAX];
  float m[ROWS_MAX], l[ROWS_MAX];
  int64_t k_lo, k_hi;

  RowState(const Item& it, const Geometry& g, const int64_t* qpos0, int64_t rows) {
    k_lo = it.k_hi;
    k_hi = it.k_lo;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = qpos0[it.seq] + row_token(it, g, r);  // qpos0 = seq_len - qlen - qstart
      hi[r] = std::min(pos + 1, it.k_hi);
      lo[r] = std::max(g.window > 0 ? pos - g.window + 1 : 0, it.k_lo);
      m[r] = NEG_INF;
      l[r] = 0.f;
      if (lo[r] < hi[r]) {
        k_lo = std::min(k_lo, lo[r]);
        k_hi = std::max(k_hi, hi[r]);
      }
    }
  }

  // Row r's scores sc of keys s0 + lane (only those in [rlo, rhi) count) into its softmax
  // weights: updates m and l, rescales acc[0, n) when the max grows. ``round`` is applied to
  // the weights before l sums them (the bf16 path weights the values by rounded ones).
  template <typename Round>
  vf update(int64_t r, vf sc, int64_t s0, int64_t rlo, int64_t rhi, float* acc, int64_t n,
            Round round) {
    sc = mask_keys(sc, s0, rlo, rhi);
    const float m_new = std::max(m[r], hmax(sc));
    const float alpha = std::exp(m[r] - m_new);  // 0 on the first keys
    const vf pv = round(vexp(sc - splat(m_new)));  // masked lanes: exactly 0
    if (alpha != 1.f) scale_vec(acc, alpha, n);
    l[r] = l[r] * alpha + hsum(pv);
    m[r] = m_new;
    return pv;
  }
};

// The end of the sub-block from key s0: up to VL keys, inside one cache block.
inline int64_t sub_block_end(int64_t s0, int64_t block_size, int64_t k_hi) {
  return std::min({s0 + VL, s0 - s0 % block_size + block_size, k_hi});
}

// The cache lines of the next sub-block (its keys, then its values), prefetched a few at a time
// between the current sub-block's instructions. Issued in one burst, the 64 prefetches of a
// bf16 sub-block (16 keys x 128 bytes x K and V) fill the core's line-fill buffers and stall it
// until they drain, which made them worth nothing: with KV from DRAM the kernel ran at the sum
// of its memory and arithmetic times. Spread out they overlap (AMX Xeon, 2 threads, SmolLM2's
// heads, 30 layers of KV: one sequence of 4,000 keys 375 -> 196 us a layer, 64 of 164 keys
// 1,088 -> ~700; a throwaway timing script).
// The queue holds spans of bytes, one per K and V row of the sub-block, merged into one for K
// and one for V where the rows are adjacent (an item of all the KV heads reads whole cache
// rows), and the lines go to L2 (prefetcht1), not L1. With an address stored per line and
// prefetcht0, on a Zen 4 EPYC (2 threads, SmolLM2's heads, 30 layers of KV from DRAM, medians
// of alternating processes): one sequence of 4,000 keys 177-212 -> 116-150 us a layer, 64 of
// 174 keys 546-563 -> 392-399. (Spans alone, still prefetcht0, were no faster; prefetching
// one line in two, leaving the other to the hardware, was slower from DRAM.)
struct PrefetchQueue {
  static constexpr int CAP = 2 * VL;  // spans: a K and a V row per key, unmerged
  const char* pos[CAP];
  const char* end[CAP];
  const char* cur = nullptr;  // the span being issued: [cur, stop)
  const char* stop = nullptr;
  int n = 0, next = 0;

  void issue(int k) {
    while (k-- > 0) {
      if (cur >= stop) {
        if (next >= n) return;
        cur = pos[next];
        stop = end[next++];
      }
      __builtin_prefetch(cur, 0, 2);
      cur += 64;
    }
  }

  void push(const char* a, int64_t bytes) {
    const char* b = a + bytes;
    a = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(a) & ~uintptr_t(63));
    if (n > 0 && a <= end[n - 1] && a >= pos[n - 1]) {
      end[n - 1] = std::max(end[n - 1], b);
    } else {
      pos[n] = a;
      end[n++] = b;
    }
  }

  // Queue the sub-block from key s1 of KV head kvh of the sequence with block table row tab
  // (what is left of the previous one is issued first); ``kv_stride`` elements between keys,
  // ``half`` from the K to the V half of the cache. (Queueing the next item's first sub-block
  // at an item's end was tried too: no gain at 64 sequences of 164 keys.)
  template <typename CT>
  void queue(const CT* cache, const int64_t* tab, const Geometry& g, int64_t kvh, int64_t s1,
             int64_t k_hi, int64_t kv_stride, int64_t half, int64_t heads = 1) {
    issue(1 << 30);
    n = next = 0;
    if (s1 >= k_hi) return;
    const int64_t b0 = s1 - s1 % g.BS, keys = sub_block_end(s1, g.BS, k_hi) - s1;
    const CT* nk = cache + (tab[b0 / g.BS] * g.BS + (s1 - b0)) * kv_stride + kvh * g.D;
    const int64_t bytes = heads * g.D * int64_t(sizeof(CT));  // adjacent heads: one span
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t j = 0; j < keys; ++j)
        push(reinterpret_cast<const char*>(nk + h * half + j * kv_stride), bytes);
  }
};

// One item: writes each row's partial (m, l, acc[D]) to part = [rows][D + 2].
//
// Keys go VL at a time (a sub-block of a cache block), its KV heads in turn: each of a head's
// rows scores them into VL partial vectors reduced to one vector of VL scores at once, masks,
// exponentiates and sums them as a vector, then adds the VL values into its accumulator in 4
// independent FMA chains. K and V are converted to fp32 once per sub-block and head for all its
// rows, zero-padded to whole vectors; the next sub-block's span of all the item's heads is
// prefetched meanwhile.
template <typename QT, typename CT>
void attend_item(const Item& it, const Geometry& g, const QT* q, const CT* cache,
                 const at::Half* scales, const int64_t* table, const int64_t* qpos0,
                 float* part) {
  const int64_t D = g.D, per_head = it.nt * g.G, rows = per_head * it.nh;
  const int64_t Dp = (D + VL - 1) / VL * VL;
  alignas(64) float qf[ROWS_MAX][D_MAX];
  alignas(64) float kf[VL][D_MAX];
  alignas(64) float acc[ROWS_MAX][D_MAX];
  alignas(64) float p[ROWS_MAX][VL];  // the sub-block's softmax weights per row
  alignas(64) float ks_buf[VL], vs_buf[VL];
  RowState st(it, g, qpos0, rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = row_token(it, g, r), head = row_head(it, g, r);
    std::fill(qf[r], qf[r] + Dp, 0.f);
    to_float(qf[r], q + (t * g.H + head) * D, D);
    std::fill(acc[r], acc[r] + Dp, 0.f);
  }
  for (int j = 0; j < VL; ++j) std::fill(kf[j], kf[j] + Dp, 0.f);  // pads stay zero
  PrefetchQueue pf;
  const int64_t kv_stride = g.KVH * D;  // between consecutive keys in a block
  const int64_t half = g.NB * g.BS * kv_stride;  // K half -> V half of the cache
  const int64_t* tab = table + it.seq * g.W;
  for (int64_t s0 = st.k_lo; s0 < st.k_hi;) {
    const int64_t b0 = s0 - s0 % g.BS, s1 = sub_block_end(s0, g.BS, st.k_hi);
    const int n = int(s1 - s0);
    const int64_t row0 = tab[b0 / g.BS] * g.BS + (s0 - b0);  // first key's row in the pool
    const CT* kb0 = cache + row0 * kv_stride + it.kvh * D;
    // int8 cache: scales [2, NB, BS, KVH], one per key row and KV head
    const at::Half* ks0 = scales ? scales + row0 * g.KVH + it.kvh : nullptr;
    pf.queue(cache, tab, g, it.kvh, s1, st.k_hi, kv_stride, half, it.nh);
    // the queue's lines (a key's span of nh heads, K and V) spread over the 2 x nh x n rows
    const int issue = int(((it.nh * D * int64_t(sizeof(CT)) + 63) / 64 + it.nh - 1) / it.nh);
    for (int64_t hh = 0; hh < it.nh; ++hh) {  // each KV head: its rows [r_lo, r_hi)
      const CT* kb = kb0 + hh * D;
      const at::Half* ks = ks0 ? ks0 + hh : nullptr;
      const int64_t r_lo = hh * per_head, r_hi = r_lo + per_head;
      for (int j = 0; j < n; ++j) {
        pf.issue(issue);
        to_float(kf[j], kb + j * kv_stride, D);
      }
      for (int j = n; j < VL; ++j) std::fill(kf[j], kf[j] + D, 0.f);
      row_scales(ks_buf, ks, g.KVH, n);
      for (int j = n; j < VL; ++j) ks_buf[j] = 0.f;
      const vf kscale = load(ks_buf) * g.scale;
      bool any = false;
      for (int64_t r = r_lo; r < r_hi; ++r) {
        const int64_t rlo = std::max(st.lo[r], s0), rhi = std::min(st.hi[r], s1);
        if (rlo >= rhi) {
          std::fill(p[r], p[r] + VL, 0.f);
          continue;
        }
        vf dots[VL];
#pragma GCC unroll 16
        for (int j = 0; j < VL; ++j) {
          vf a0{}, a1{};
          int64_t d = 0;
          for (; d + 2 * VL <= Dp; d += 2 * VL) {
            a0 += load(qf[r] + d) * load(kf[j] + d);
            a1 += load(qf[r] + d + VL) * load(kf[j] + d + VL);
          }
          if (d < Dp) a0 += load(qf[r] + d) * load(kf[j] + d);
          dots[j] = a0 + a1;
        }
        vf sc = hsum_each(dots) * kscale;
        if (g.softcap > 0.f) {
          for (int j = 0; j < VL; ++j) sc[j] = g.softcap * std::tanh(sc[j] / g.softcap);
        }
        store(p[r], st.update(r, sc, s0, rlo, rhi, acc[r], Dp, [](vf v) { return v; }));
        any = true;
      }
      if (!any) continue;
      const CT* vb = kb + half;
      const at::Half* vs = ks ? ks + g.NB * g.BS * g.KVH : nullptr;
      for (int j = 0; j < n; ++j) {
        pf.issue(issue);
        to_float(kf[j], vb + j * kv_stride, D);
      }
      row_scales(vs_buf, vs, g.KVH, n);
      for (int64_t r = r_lo; r < r_hi; ++r) {
        float w[VL];
        for (int j = 0; j < VL; ++j) w[j] = j < n ? p[r][j] * vs_buf[j] : 0.f;
        int64_t d = 0;
        for (; d + 4 * VL <= Dp; d += 4 * VL) {
          vf a0 = load(acc[r] + d), a1 = load(acc[r] + d + VL);
          vf a2 = load(acc[r] + d + 2 * VL), a3 = load(acc[r] + d + 3 * VL);
          for (int j = 0; j < n; ++j) {
            const vf wj = splat(w[j]);
            a0 += wj * load(kf[j] + d);
            a1 += wj * load(kf[j] + d + VL);
            a2 += wj * load(kf[j] + d + 2 * VL);
            a3 += wj * load(kf[j] + d + 3 * VL);
          }
          store(acc[r] + d, a0);
          store(acc[r] + d + VL, a1);
          store(acc[r] + d + 2 * VL, a2);
          store(acc[r] + d + 3 * VL, a3);
        }
        for (; d < Dp; d += VL) {
          vf a0 = load(acc[r] + d), a1{};
          int j = 0;
          for (; j + 2 <= n; j += 2) {
            a0 += splat(w[j]) * load(kf[j] + d);
            a1 += splat(w[j + 1]) * load(kf[j + 1] + d);
          }
          if (j < n) a0 += splat(w[j]) * load(kf[j] + d);
          store(acc[r] + d, a0 + a1);
        }
      }
    }
    s0 = s1;
  }
  for (int64_t r = 0; r < rows; ++r) {
    part[r * (D + 2)] = st.m[r];
    part[r * (D + 2) + 1] = st.l[r];
    std::copy(acc[r], acc[r] + D, part + r * (D + 2) + 2);
  }
}

// The dot-product paths (attend_item_dp): bf16 caches where the CPU has AVX512-BF16, int8 ones
// where it has AVX512-VNNI (with or without AVX512-BF16).
#if defined(__AVX512BW__) && (defined(__AVX512BF16__) || defined(__AVX512VNNI__))

// The cache element's side of attend_item_dp: how a row's 32-dimension chunk is loaded as 16
// pairs, and the pairwise dot-product instruction.
template <typename CT>
struct DpCache;

#if defined(__AVX512BF16__)
constexpr bool kHaveDp = true;
template <>
struct DpCache<uint16_t> {  // bf16: vdpbf16ps, fp32 sums
  using Acc = __m512;
  static __m512i load(const uint16_t* src, __mmask32 m) { return _mm512_maskz_loadu_epi16(m, src); }
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static Acc dot(Acc a, __m512i x, __m512i y) {
    return _mm512_dpbf16_ps(a, (__m512bh)x, (__m512bh)y);
  }
};
#else
constexpr bool kHaveDp = false;
#endif

#if defined(__AVX512VNNI__)
constexpr bool kHaveDpI8 = true;
template <>
struct DpCache<int8_t> {  // int8 widened to int16 (vpmovsxbw): vpdpwssd, int32 sums
  using Acc = __m512i;
  static __m512i load(const int8_t* src, __mmask32 m) {
    return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, src));
  }
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc add(Acc a, Acc b) { return _mm512_add_epi32(a, b); }
  static Acc dot(Acc a, __m512i x, __m512i y) { return _mm512_dpwssd_epi32(a, x, y); }
};
#else
constexpr bool kHaveDpI8 = false;
#endif

constexpr float I16_MAX = 32767.f;

// A row of floats as int16 steps of one scale (returned): |x| <= 32767 steps, so a dot product
// with int8 codes over D <= 512 dimensions stays inside int32. One step for the whole row: where
// q * m (the calibrated key scales) has outlier channels, the small ones keep fewer bits than
// bf16 would give them; on SmolLM2 (fp32 weights, int8 KV) each layer's attention output stays
// within ~1e-4-5e-4 of the fp32 reference's, relative to its largest value, under the int8
// cache's own 1/254 rounding. (int16_rows.h's quantize_groups is the vectorized twin for bf16
// rows, with 32767 / max as the inverse step; its last-bit differences in the codes flipped a
// greedy near-tie in test_kv_quant's prefix-cache test, whose two paths already differ by their
// fp32 linears at 3 and 66 rows, so it is not reused here.) Vectorized with its own arithmetic
// (the step mx / 32767 and its inverse; cvtps rounds to nearest even as nearbyint does): the
// same bits as the scalar loops it replaced (row_scales has the figure).
inline float to_int16(int16_t* dst, const float* x, int64_t n) {
  __m512 mv = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float mx = _mm512_reduce_max_ps(mv);
  for (; i < n; ++i) mx = std::max(mx, std::abs(x[i]));
  const float step = mx > 0.f ? mx / I16_MAX : 1.f, inv = 1.f / step;
  const __m512 iv = _mm512_set1_ps(inv);
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), iv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(q));
  }
  for (; i < n; ++i) dst[i] = int16_t(std::nearbyint(x[i] * inv));
  return step;
}

// The dot products of NR query rows (pairs qp[0..NR)) with the VL keys of kt (pair p of all
// keys in kt[p]): four chains per row over the pairs, summed at the end; the same order for
// every row whatever NR. NR is a constant so the 4 * NR accumulators stay in registers (with
// a run-time row count GCC kept them on the stack, a store and a reload per instruction).
template <int NR, typename Tr>
inline void score_rows(typename Tr::Acc* out, const uint32_t (*qp)[D_MAX / 2], const __m512i* kt,
                       int P, PrefetchQueue& pf) {
  typename Tr::Acc a[NR][4];
  for (int u = 0; u < NR; ++u)
    for (int e = 0; e < 4; ++e) a[u][e] = Tr::zero();
  int pi = 0;
  for (; pi + 4 <= P; pi += 4) {
    pf.issue(2);
#pragma GCC unroll 4
    for (int e = 0; e < 4; ++e) {
      const __m512i k = kt[pi + e];
#pragma GCC unroll 4
      for (int u = 0; u < NR; ++u)
        a[u][e] = Tr::dot(a[u][e], _mm512_set1_epi32(int(qp[u][pi + e])), k);
    }
  }
  for (; pi < P; ++pi)
    for (int u = 0; u < NR; ++u)
      a[u][0] = Tr::dot(a[u][0], _mm512_set1_epi32(int(qp[u][pi])), kt[pi]);
  for (int u = 0; u < NR; ++u)
    out[u] = Tr::add(Tr::add(a[u][0], a[u][1]), Tr::add(a[u][2], a[u][3]));
}

// NR rows' accumulators (32 dimensions from chunk c on) plus their weights pp (pairs of keys)
// times the interleaved values vt: with bf16 the fp32 sums continue from acc; with int8 the
// sub-block's int32 sum is scaled by the row's weight step and added.
template <int NR, typename Tr>
inline void value_rows(float (*acc)[D_MAX], const uint32_t (*pp)[VL / 2], const float* wstep,
                       const __m512i (*vt)[D_MAX / 32][2], int npairs, int c, PrefetchQueue& pf) {
  constexpr bool kInt = std::is_same_v<typename Tr::Acc, __m512i>;
  typename Tr::Acc a[NR][2];
  for (int u = 0; u < NR; ++u)
    for (int h = 0; h < 2; ++h) {
      if constexpr (kInt) {
        a[u][h] = Tr::zero();
      } else {
        a[u][h] = _mm512_load_ps(acc[u] + 32 * c + 16 * h);
      }
    }
  for (int jp = 0; jp < npairs; ++jp) {
    pf.issue(1);
    const __m512i v0 = vt[jp][c][0], v1 = vt[jp][c][1];
#pragma GCC unroll 4
    for (int u = 0; u < NR; ++u) {
      const __m512i w = _mm512_set1_epi32(int(pp[u][jp]));
      a[u][0] = Tr::dot(a[u][0], w, v0);
      a[u][1] = Tr::dot(a[u][1], w, v1);
    }
  }
  for (int u = 0; u < NR; ++u)
    for (int h = 0; h < 2; ++h) {
      float* dst = acc[u] + 32 * c + 16 * h;
      if constexpr (kInt) {
        const __m512 sum = _mm512_cvtepi32_ps(a[u][h]);
        _mm512_store_ps(dst, _mm512_fmadd_ps(sum, _mm512_set1_ps(wstep[u]), _mm512_load_ps(dst)));
      } else {
        _mm512_store_ps(dst, a[u][h]);
      }
    }
}

// RowState::update for attend_item_dp, with a lazy max: the row's m moves only when a score
// passes it by more than LAZY_SLACK, so weights reach e^8 at most (the final division by l
// makes the result the same softmax), and most sub-blocks skip the horizontal max, the exp of
// the rescale factor and the rescale itself; l is summed as a vector (lv), reduced at the end.
constexpr float LAZY_SLACK = 8.f;

template <typename Round>
inline vf lazy_update(RowState& st, int64_t r, vf sc, int64_t s0, int64_t rlo, int64_t rhi,
                      float* acc, int64_t n, Round round, float* lv) {
  sc = mask_keys(sc, s0, rlo, rhi);
  const __m512 lim = _mm512_set1_ps(st.m[r] + LAZY_SLACK);
  if (_mm512_cmp_ps_mask(reinterpret_cast<const __m512&>(sc), lim, _CMP_GT_OQ)) {
    const float m_new = hmax(sc);  // > m + LAZY_SLACK
    const float alpha = std::exp(st.m[r] - m_new);  // 0 on the first keys
    scale_vec(acc, alpha, n);
    store(lv, load(lv) * alpha);
    st.m[r] = m_new;
  }
  const vf pv = round(vexp(sc - splat(st.m[r])));  // masked lanes: exactly 0
  store(lv, load(lv) + pv);
  return pv;
}

// f(std::integral_constant<int, NR>{}) for a run-time row count nr in 1..4.
template <typename F>
inline void with_rows(int nr, F&& f) {
  switch (nr) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// attend_item for a bf16 or int8 cache with a pairwise dot-product instruction, nothing
// converted to fp32 but the sums:
// - bf16 (bf16 queries): vdpbf16ps, two bf16 products per fp32 lane;
// - int8 (bf16 or fp32 queries): each query row becomes int16 steps of one scale (to_int16),
//   the int8 codes are widened to int16 and vpdpwssd sums pairs into
//   int32; the row's step, each key's scale and the softmax scale multiply the integer score.
//   Values: each row's VL weights (softmax weight x the value row's scale) become int16 steps
//   of one scale per row and sub-block, summed in int32 and added to the fp32 accumulator.
// Scores: the sub-block's keys are transposed once (16 x 16 tiles of pairs) so that vector p
// holds dimension pair p of all VL keys; a row's VL scores are then D/2 dot-product
// instructions against its broadcast query pairs, already one score per lane (no reduction
// across lanes) -- the GEMM layout, where scoring each key as a dot product would need a
// transposing reduction per row. Values are interleaved in key pairs once per sub-block
// (vpunpck{l,h}wd) so each row adds 2 keys x 16 dims per instruction (bf16: its softmax
// weights rounded to bf16, and the sum l uses the same rounded weights). Same items, masking
// and online softmax as attend_item; the accumulator is kept in the interleave's lane order and
// put back in dimension order at the end.
template <typename QT, typename CT>
void attend_item_dp(const Item& it, const Geometry& g, const QT* q, const CT* cache,
                    const at::Half* scales, const int64_t* table, const int64_t* qpos0,
                    float* part) {
  constexpr bool kI8 = std::is_same_v<CT, int8_t>;
  static_assert(kI8 || std::is_same_v<QT, uint16_t>, "a bf16 cache takes bf16 queries");
  using Tr = DpCache<CT>;
  using Acc = typename Tr::Acc;
  const int64_t D = g.D, per_head = it.nt * g.G, rows = it.nh * per_head;
  const int C = int((D + 31) / 32);  // 32-dimension chunks of a row
  const __mmask32 full = 0xffffffffu;
  const __mmask32 tail = D % 32 ? __mmask32((1u << (D % 32)) - 1) : full;
  const int P = int(D / 2);  // dimension pairs of a row
  alignas(64) uint32_t qp[ROWS_MAX][D_MAX / 2];  // each row's query as pairs
  alignas(64) float qstep[ROWS_MAX];  // int8: each row's int16 step
  __m512i kt[D_MAX / 2];  // pair p of the sub-block's keys (key j in lane j)
  __m512i vt[VL / 2][D_MAX / 32][2];  // key pair x chunk x (dims 0-3 / 4-7 of each 8)
  alignas(64) float acc[ROWS_MAX][D_MAX];
  alignas(64) float p[ROWS_MAX][VL];
  alignas(64) float lv[ROWS_MAX][VL];  // each row's l as a vector (lazy_update)
  alignas(64) float kscale[VL], vscale[VL], wstep[ROWS_MAX];
  bool seen[ROWS_MAX];
  auto load_row = [&](const CT* src, int c) {
    return Tr::load(src + 32 * c, c == C - 1 ? tail : full);
  };
  RowState st(it, g, qpos0, rows);
  for (int64_t r = 0; r < rows; ++r) {
    const QT* qr = q + (row_token(it, g, r) * g.H + row_head(it, g, r)) * D;
    if constexpr (kI8) {
      alignas(64) float qf[D_MAX];
      to_float(qf, qr, D);
      qstep[r] = to_int16(reinterpret_cast<int16_t*>(qp[r]), qf, D);
    } else {
      std::memcpy(qp[r], qr, D * sizeof(uint16_t));
    }
    std::fill(acc[r], acc[r] + 32 * C, 0.f);
    std::fill(lv[r], lv[r] + VL, 0.f);
  }
  const int64_t kv_stride = g.KVH * D;
  const int64_t half = g.NB * g.BS * kv_stride;
  const int64_t* tab = table + it.seq * g.W;
  const __m512i zero = _mm512_setzero_si512();
  PrefetchQueue pf;
  // bf16: round to bf16 now: the values are weighted by these, and l must sum the same numbers
  auto round_weights = [](vf v) {
    if constexpr (kI8) {
      return v;
    } else {
      const __m256i pb = (__m256i)_mm512_cvtneps_pbh(reinterpret_cast<__m512&>(v));
      const __m512i pw = _mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16);
      return reinterpret_cast<const vf&>(pw);
    }
  };
  for (int64_t s0 = st.k_lo; s0 < st.k_hi;) {
    const int64_t b0 = s0 - s0 % g.BS, s1 = sub_block_end(s0, g.BS, st.k_hi);
    const int n = int(s1 - s0);
    const int64_t row0 = tab[b0 / g.BS] * g.BS + (s0 - b0);
    const CT* kb0 = cache + row0 * kv_stride + it.kvh * D;
    // int8: scales [2, NB, BS, KVH], one per key row and KV head
    const at::Half* ks0 = kI8 ? scales + row0 * g.KVH + it.kvh : nullptr;
    pf.queue(cache, tab, g, it.kvh, s1, st.k_hi, kv_stride, half, it.nh);
    bool any = false;
    for (int64_t r = 0; r < rows; ++r) {
      seen[r] = std::max(st.lo[r], s0) < std::min(st.hi[r], s1);
      any |= seen[r];
    }
    if (!any) {
      s0 = s1;
      continue;
    }
    for (int64_t hh = 0; hh < it.nh; ++hh) {  // each KV head: its rows [r_lo, r_hi)
      const CT* kb = kb0 + hh * D;
      const int64_t r_lo = hh * per_head, r_hi = r_lo + per_head;
      for (int c = 0; c < C; ++c) {  // 16 pairs (32 dimensions) of the VL keys at a time
        __m512i tile[VL];
        for (int j = 0; j < VL; ++j) tile[j] = j < n ? load_row(kb + j * kv_stride, c) : zero;
        transpose16(tile);
        for (int i = 0; i < 16 && 16 * c + i < P; ++i) kt[16 * c + i] = tile[i];
      }
      if constexpr (kI8) {
        row_scales(kscale, ks0 + hh, g.KVH, n);  // 0 from n on
        row_scales(vscale, ks0 + hh + g.NB * g.BS * g.KVH, g.KVH, n);
      }
      // Scores: rows in groups of up to 4 (score_rows: 16 independent chains for 4 rows, each
      // key pair read once for the group).
      for (int64_t r0 = r_lo; r0 < r_hi; r0 += 4) {
        const int nr = int(std::min<int64_t>(4, r_hi - r0));
        Acc sums[4];
        with_rows(nr, [&](auto rows_c) {
          score_rows<decltype(rows_c)::value, Tr>(sums, qp + r0, kt, P, pf);
        });
        for (int u = 0; u < nr; ++u) {
          const int64_t r = r0 + u;
          if (!seen[r]) continue;
          const int64_t rlo = std::max(st.lo[r], s0), rhi = std::min(st.hi[r], s1);
          vf sc;
          if constexpr (kI8) {
            const __m512 sum = _mm512_cvtepi32_ps(sums[u]);
            sc = reinterpret_cast<const vf&>(sum) * load(kscale) * (qstep[r] * g.scale);
          } else {
            const __m512 sum = sums[u];
            sc = reinterpret_cast<const vf&>(sum) * g.scale;
          }
          if (g.softcap > 0.f) {
            for (int j = 0; j < VL; ++j) sc[j] = g.softcap * std::tanh(sc[j] / g.softcap);
          }
          store(p[r], lazy_update(st, r, sc, s0, rlo, rhi, acc[r], 32 * C, round_weights, lv[r]));
        }
      }
      const CT* vb = kb + half;
      for (int jp = 0; jp < (n + 1) / 2; ++jp) {
        const int j = 2 * jp;
        for (int c = 0; c < C; ++c) {
          pf.issue(1);
          const __m512i a = load_row(vb + j * kv_stride, c);
          const __m512i b = j + 1 < n ? load_row(vb + (j + 1) * kv_stride, c) : zero;
          vt[jp][c][0] = _mm512_unpacklo_epi16(a, b);
          vt[jp][c][1] = _mm512_unpackhi_epi16(a, b);
        }
      }
      // Values: rows in groups of up to 4 per 32-dimension chunk, so 8 accumulators (not 2)
      // are independent dot-product chains over the key pairs; rows that see no key of this
      // sub-block have weights 0 (adding exact zeros leaves them unchanged).
      alignas(64) uint32_t pp[ROWS_MAX][VL / 2];  // (w[j], w[j + 1]) as one pair per row
      for (int64_t r = r_lo; r < r_hi; ++r) {
        const __m512 pr = seen[r] ? _mm512_load_ps(p[r]) : _mm512_setzero_ps();
        __m256i packed;
        if constexpr (kI8) {
          const __m512 w = _mm512_mul_ps(pr, _mm512_load_ps(vscale));  // >= 0
          const float mx = _mm512_reduce_max_ps(w);
          wstep[r] = mx / I16_MAX;
          const __m512 wi = _mm512_mul_ps(w, _mm512_set1_ps(mx > 0.f ? I16_MAX / mx : 0.f));
          packed = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(wi));
        } else {
          packed = (__m256i)_mm512_cvtneps_pbh(pr);
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(pp[r]), packed);
      }
      const int npairs = (n + 1) / 2;
      for (int64_t r0 = r_lo; r0 < r_hi; r0 += 4) {
        const int nr = int(std::min<int64_t>(4, r_hi - r0));
        with_rows(nr, [&](auto rows_c) {
          for (int c = 0; c < C; ++c)
            value_rows<decltype(rows_c)::value, Tr>(acc + r0, pp + r0, wstep + r0, vt, npairs, c,
                                                    pf);
        });
      }
    }
    s0 = s1;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = part + r * (D + 2);
    out[0] = st.m[r];
    out[1] = hsum(load(lv[r]));
    // lane i of half h of chunk c holds dimension 32c + 8 (i / 4) + 4h + i % 4
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 16; ++i) {
          const int64_t d = 32 * c + 8 * (i / 4) + 4 * h + i % 4;
          if (d < D) out[2 + d] = acc[r][32 * c + 16 * h + i];
        }
  }
}
#else
constexpr bool kHaveDp = false;  // bf16 caches on vdpbf16ps
constexpr bool kHaveDpI8 = false;  // int8 caches on vpdpwssd
template <typename QT, typename CT>
void attend_item_dp(const Item&, const Geometry&, const QT*, const CT*, const at::Half*,
                    const int64_t*, const int64_t*, float*) {
  TORCH_CHECK(false, "attend_item_dp needs AVX512-BF16 or AVX512-VNNI");
}
#endif

template <typename QT, typename CT>
void run(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& table,
         const at::Tensor& qstart, const at::Tensor& seq_lens, const at::Half* scales, Geometry g,
         at::Tensor& out) {
  const int64_t B = seq_lens.size(0), T = q.size(0);
  const int64_t* qs = qstart.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  std::vector<int64_t> qpos0(B);
  constexpr bool bf16_pair = std::is_same_v<QT, uint16_t> && std::is_same_v<CT, uint16_t>;
  constexpr bool int8_cache = std::is_same_v<CT, int8_t>;
  // the types attend_item_dp is built for here (bf16: AVX512-BF16; int8: AVX512-VNNI)
  constexpr bool dp_types = (bf16_pair && kHaveDp) || (int8_cache && kHaveDpI8);
  const bool dp = dp_types && g.D % 2 == 0;
  // Decode on the dot-product paths: one item takes all the sequence's KV heads, so each cache
  // block is read as one span of its rows (the heads side by side) instead of KVH strided
  // passes, and a split key range splits that span. SmolLM2's 3 KV heads, 30 layers from
  // memory, 2 threads on the AMX Xeon (a throwaway timing script, alternating runs): 64
  // sequences of 174 keys 0.64-0.68 -> 0.55-0.60 ms a layer; one of 4,000 keys 288-315 ->
  // 198-206 us.
  // Without the dot-product path (CPUs without AVX512-BF16) the generic item takes the heads
  // in turn the same way: each KV head walked 128 of every 384 bytes of SmolLM2's key rows on
  // its own, the hardware prefetcher's streams helped little and a quarter of the time went
  // to software prefetches waiting for line-fill buffers (4,000 keys, perf annotate).
  const int64_t elem = dp ? 2 : int64_t(sizeof(CT));
  const bool spans = g.KVH > 1 && g.KVH * g.D * elem <= D_MAX * 4;  // prefetch queue's room
  auto all_heads = [&](int64_t nt) { return spans && nt * g.G * g.KVH <= ROWS_MAX; };
  int64_t max_len = 0, base = 0;  // base: items before the key range is split
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qlen = qs[b + 1] - qs[b];
    TORCH_CHECK(qlen >= 0 && qlen <= sl[b], "sequence ", b, " has more queries than keys");
    TORCH_CHECK((sl[b] + g.BS - 1) / g.BS <= g.W, "sequence ", b, " outgrows its block table");
    qpos0[b] = sl[b] - qlen - qs[b];
    max_len = std::max(max_len, sl[b]);
    for (int64_t t0 = 0; t0 < qlen; t0 += g.qc)
      base += all_heads(std::min(g.qc, qlen - t0)) ? 1 : g.KVH;
  }
  // Split the key range when the items would leave threads idle and the keys are many: parts
  // of at least 512 keys on the dot-product paths, 64 on the generic one, whose work per key is
  // larger (one sequence of SmolLM2's heads on 2 threads: 2 items from 128 keys). There, with an
  // item per KV head, parts of 128 keys had taken 350 keys 31.9 -> 25.9 us a layer, and parts of
  // 64 then 128 keys 15.0 -> 13.7 and 230 keys 22.2 -> 19.9; with the heads in one item
  // (spans, above), 30 layers' caches in turn: 1,000 keys 61 -> 58-59 us and 4,000 keys
  // 253-280 -> 219-222 (2 threads; one thread 482-486 -> 435-447), 128 and 230 keys as before
  // (bf16 cache, Xeon without AVX512-BF16, throwaway timing scripts, alternating processes).
  const int64_t threads = at::get_num_threads();
  int64_t parts = 1;
  if (base > 0 && base < 4 * threads) {
    const int64_t cap = std::max<int64_t>(1, max_len / (dp ? 512 : 64));
    parts = std::min((4 * threads + base - 1) / base, cap);
    // whole rounds of items per thread: up where the cap allows (3 KV heads on 2 threads: 4
    // parts), else down (one sequence's span capped at 7 parts: 6)
    while (parts < cap && (base * parts) % threads != 0) ++parts;
    while (parts > 1 && base * parts > threads && (base * parts) % threads != 0) --parts;
  }
  std::vector<Item> items;
  items.reserve(base * parts);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qlen = qs[b + 1] - qs[b];
    const int64_t span = (sl[b] + parts - 1) / parts;
    const int64_t step = (span + g.BS - 1) / g.BS * g.BS;  // block-aligned parts
    for (int64_t t0 = qs[b]; t0 < qs[b] + qlen; t0 += g.qc) {
      const int64_t nt = std::min(g.qc, qs[b] + qlen - t0);
      const int64_t nh = all_heads(nt) ? g.KVH : 1;
      // Rounding the parts up to whole blocks can leave the last ones past the sequence's end
      // (one sequence of 513 keys in 8 parts: 80 keys each, the 8th from key 560): those are
      // empty, [sl, sl). Unclamped, an item's keys ran from sl to its start and read the block
      // table past its row (a crash, or keys from a block that is not the sequence's).
      for (int64_t h = 0; h < g.KVH; h += nh)
        for (int64_t p = 0; p < parts; ++p)
          items.push_back({b, h, t0, nt, std::min(p * step, sl[b]),
                           std::min((p + 1) * step, sl[b]), nh});
    }
  }
  const int64_t D = g.D, stride = ROWS_MAX * (D + 2);
  const auto* qp = reinterpret_cast<const QT*>(q.data_ptr());
  const auto* cp = reinterpret_cast<const CT*>(cache.data_ptr());
  const int64_t* tp = table.data_ptr<int64_t>();
  auto* op = reinterpret_cast<QT*>(out.data_ptr());
  auto attend = [&](const Item& it, float* pi) {
    if constexpr (dp_types) {
      if (dp) return attend_item_dp<QT, CT>(it, g, qp, cp, scales, tp, qpos0.data(), pi);
    }
    attend_item<QT, CT>(it, g, qp, cp, scales, tp, qpos0.data(), pi);
  };
  // The rows of (chunk, KV head) group gi from its parts' partial (m, l, acc) (the parts side
  // by side from pg), merged and written to out [T, H, D].
  auto merge = [&](int64_t gi, const float* pg, float* o) {
    const Item& it = items[gi * parts];
    for (int64_t r = 0; r < it.nt * g.G * it.nh; ++r) {
      float M = NEG_INF;
      for (int64_t p = 0; p < parts; ++p) M = std::max(M, pg[p * stride + r * (D + 2)]);
      std::fill(o, o + D, 0.f);
      float L = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const float* pr = pg + p * stride + r * (D + 2);
        if (pr[0] == NEG_INF) continue;
        const float w = std::exp(pr[0] - M);
        L += w * pr[1];
        axpy(o, w, pr + 2, D);
      }
      const float inv = L > 0.f ? 1.f / L : 0.f;
      const int64_t t = row_token(it, g, r), head = row_head(it, g, r);
      QT* dst = op + (t * g.H + head) * D;
      for (int64_t i = 0; i < D; ++i) st(dst, i, o[i] * inv);
    }
  };
  if (parts == 1) {
    // Each item's rows written as it ends, from the thread's own partial: no second parallel
    // pass over a buffer of every item's partial (at batch 64, ~0.27 MB a layer written and
    // read back), the same numbers (a merge of one part scales its accumulator by 1/l).
    // Items go out as the matmuls' do (steal_for: each thread down its own half, then the
    // other's last items one at a time), not in two fixed halves: with equal items the halves
    // still ended apart (a thread woken late, slower memory), 8% of a 64-sequence decode's
    // attention spent waiting at the region's end (perf, 64 sequences of 164 keys).
    steal_for(int64_t(items.size()), int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
      thread_local std::vector<float> pi;  // one item's partial, then its merged row
      pi.resize(stride + D);
      for (int64_t i = i0; i < i1; ++i) {
        attend(items[i], pi.data());
        merge(i, pi.data(), pi.data() + stride);
      }
    });
    return;
  }
  // every row an item has is written before the merge reads it: no zero fill (at batch 64 it
  // was ~0.8 MB a layer)
  std::unique_ptr<float[]> partial(new float[items.size() * stride]);
  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) attend(items[i], partial.get() + i * stride);
  });
  // Merge the parts of each (chunk, KV head) and write rows to out [T, H, D].
  const int64_t groups = int64_t(items.size()) / parts;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    std::vector<float> o(D);
    for (int64_t gi = g0; gi < g1; ++gi) merge(gi, partial.get() + gi * parts * stride, o.data());
  });
  (void)T;
}

// Calls f(XT{}, CT{}) for the element types of an activation (fp32, bf16) and a cache (fp32,
// bf16, int8) -- the pairs both ops below take.
template <typename F>
void dispatch_kv(at::ScalarType xt, at::ScalarType ct, const char* op, F&& f) {
  const bool xf = xt == at::kFloat, xb = xt == at::kBFloat16;
  if (xf && ct == at::kFloat) f(float{}, float{});
  else if (xf && ct == at::kBFloat16) f(float{}, uint16_t{});
  else if (xf && ct == at::kChar) f(float{}, int8_t{});
  else if (xb && ct == at::kBFloat16) f(uint16_t{}, uint16_t{});
  else if (xb && ct == at::kFloat) f(uint16_t{}, float{});
  else if (xb && ct == at::kChar) f(uint16_t{}, int8_t{});
  else TORCH_CHECK(false, op, ": ", xt, " with a ", ct, " cache is not supported");
}

}  // namespace

// Whether bf16 queries over a bf16 cache take the vdpbf16ps path (fast for long query runs
// too: prefill), i.e. the CPU has AVX512-BF16.
bool paged_attention_bf16_native() { return kHaveDp; }

// Whether an int8 cache takes the vpdpwssd path (AVX512-VNNI as well), for any query length.
bool paged_attention_int8_native() { return kHaveDpI8; }

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap, const std::optional<at::Tensor>& kv_scales) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, H, D] tensor");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, KVH, D] tensor");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [B, W] tensor");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "query_start_loc and seq_lens must be int64");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1 &&
                  block_tables.size(0) == seq_lens.numel(),
              "metadata sizes disagree");
  Geometry g{};
  g.H = q.size(1);
  g.D = q.size(2);
  g.NB = kv_cache.size(1);
  g.BS = kv_cache.size(2);
  g.KVH = kv_cache.size(3);
  g.W = block_tables.size(1);
  TORCH_CHECK(kv_cache.size(4) == g.D, "head_dim of q and the cache differ");
  TORCH_CHECK(g.H % g.KVH == 0, "heads ", g.H, " not a multiple of KV heads ", g.KVH);
  TORCH_CHECK(g.D <= D_MAX && g.BS <= BS_MAX, "head_dim <= ", D_MAX, " and block_size <= ",
              BS_MAX, " supported");
  g.G = g.H / g.KVH;
  TORCH_CHECK(g.G <= ROWS_MAX, "more than ", ROWS_MAX, " query heads per KV head");
  g.qc = std::max<int64_t>(1, ROWS_MAX / g.G);
  g.scale = float(scale);
  g.softcap = float(softcap);
  g.window = window;
  auto qsl = query_start_loc.contiguous();
  auto sl = seq_lens.contiguous();
  TORCH_CHECK(qsl.data_ptr<int64_t>()[seq_lens.numel()] == q.size(0),
              "query_start_loc does not end at the number of tokens");
  auto out = at::empty_like(q);
  const auto qt = q.scalar_type(), ct = kv_cache.scalar_type();
  const at::Half* sp = nullptr;
  if (ct == at::kChar) {
    TORCH_CHECK(kv_scales.has_value(), "an int8 kv_cache needs kv_scales");
    const auto& s = *kv_scales;
    TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && s.dim() == 4 &&
                    s.size(0) == 2 && s.size(1) == g.NB && s.size(2) == g.BS && s.size(3) == g.KVH,
                "kv_scales must be a contiguous float16 [2, num_blocks, block_size, KVH] tensor");
    sp = s.data_ptr<at::Half>();
  }
  dispatch_kv(qt, ct, "paged_attention", [&](auto qtag, auto ctag) {
    run<decltype(qtag), decltype(ctag)>(q, kv_cache, block_tables, qsl, sl, sp, g, out);
  });
  return out;
}

namespace {

// Rows i = (token, head) of x [T, KVH, D] (any token/head strides) into their cache slots.
template <typename XT, typename CT>
void write_half(const at::Tensor& x, CT* cache, at::Half* scales, const int64_t* slots,
                int64_t KVH, int64_t D) {
  const int64_t T = x.size(0), s0 = x.stride(0), s1 = x.stride(1);
  const auto* xp = reinterpret_cast<const XT*>(x.data_ptr());
  constexpr float TINY = 6.103515625e-05f;  // smallest normal float16, as kv/quant.py
  at::parallel_for(0, T * KVH, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / KVH, h = i % KVH;
      const XT* src = xp + t * s0 + h * s1;
      const int64_t row = slots[t] * KVH + h;
      CT* dst = cache + row * D;
      if constexpr (std::is_same_v<CT, int8_t>) {
        float amax = 0.f;
        for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(ld(src, d)));
        const float sf = std::max(static_cast<float>(at::Half(amax / 127.f)), TINY);
        scales[row] = at::Half(sf);
        for (int64_t d = 0; d < D; ++d)
          dst[d] = int8_t(std::clamp(std::nearbyint(ld(src, d) / sf), -127.f, 127.f));
      } else {
        (void)scales;
        for (int64_t d = 0; d < D; ++d) st(dst, d, ld(src, d));
      }
    }
  });
}

}  // namespace

// The fused form of attention/reference.py's write_kv: k, v [T, KVH, D] into their slots of
// kv_cache [2, NB, BS, KVH, D], quantized (with kv_scales [2, NB, BS, KVH]) if it is int8.
void write_kv(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping, const std::optional<at::Tensor>& kv_scales) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, KVH, D] tensor");
  const int64_t KVH = kv_cache.size(3), D = kv_cache.size(4);
  const int64_t rows = kv_cache.size(1) * kv_cache.size(2) * KVH;  // per half
  for (const auto* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(1) == KVH && x->size(2) == D && x->stride(2) == 1,
                "k and v must be [T, KVH, D] with contiguous rows matching the cache");
    TORCH_CHECK(x->scalar_type() == k.scalar_type() && x->size(0) == slot_mapping.numel(),
                "k, v and slot_mapping disagree");
  }
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < rows / KVH, "slot ", sp[t], " outside the cache");
  const auto xt = k.scalar_type(), ct = kv_cache.scalar_type();
  at::Half* scales = nullptr;
  if (ct == at::kChar) {
    TORCH_CHECK(kv_scales.has_value() && kv_scales->scalar_type() == at::kHalf &&
                    kv_scales->is_contiguous() && kv_scales->numel() == 2 * rows,
                "an int8 kv_cache needs contiguous float16 kv_scales [2, num_blocks, "
                "block_size, KVH]");
    scales = kv_scales->data_ptr<at::Half>();
  }
  dispatch_kv(xt, ct, "write_kv", [&](auto xtag, auto ctag) {
    using XT = decltype(xtag);
    using CT = decltype(ctag);
    auto* c = reinterpret_cast<CT*>(kv_cache.data_ptr());
    write_half<XT, CT>(k, c, scales, sp, KVH, D);
    write_half<XT, CT>(v, c + rows * D, scales ? scales + rows : nullptr, sp, KVH, D);
  });
}

}  // namespace ff
