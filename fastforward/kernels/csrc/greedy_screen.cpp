// The greedy token of a few rows without reading the whole bf16 output projection: an int8
// copy of it (one scale per output row) gives every logit within a proven radius, and only
// the rows that could still be the largest are computed in bf16 -- by the same vdpbf16ps chain
// as linear_amx's, so the pick is the argmax of the very logits the full projection gives.
//
// Decode of a few sequences reads every weight once a token; the output projection of a large
// vocabulary is a good part of it (SmolLM2-135M: 49,152 x 576, 21% of the bf16 bytes; Gemma 3
// 270M: 63%). Its int8 copy is half the bytes. For a row x of the projection's input (its bf16
// values, as the full projection reads them) and output row i:
//
//   |x . w_i - x . w^_i| <= |x| |w_i - w^_i|                  (Cauchy-Schwarz, w^_i = s_i q_i)
//
// The estimate multiplies x's own int8 form, two parts of 127 steps (x^ = sx (hi + lo / 256),
// off x by at most sx / 512 an element) by the codes with vpdpbusd, exactly in int32, so
//
//   |x . w_i - x^ . w^_i| <= |x| |w_i - w^_i| + |x - x^| |w^_i|
//
// plus the fp32 rounding of the full projection's sums (<= 4 Kp 2^-24 |x| |w| for vdpbf16ps,
// which rounds twice a step) and of the estimate's few float steps, over-counted into radius_i
// (greedy_screen_pack) with a relative margin. With a_i the estimate and
// b_i = |x| radius_i + |x - x^| |w^_i|, every computed logit f_i lies in [a_i - b_i, a_i + b_i], so
// f_i >= max_j (a_j - b_j) = L for the largest f. The rows with a_i + b_i >= L (the candidates)
// hold every row that reaches the maximum, and among them the first one with the largest exact
// logit is the full projection's argmax (argmax_rows: first maximum). On SmolLM2 the radius
// leaves 1-23 candidates of 49,152 (median 3) along real greedy text.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16_tiles.h"
#include "ops.h"
#include "parallel.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FF_SCREEN 1
#include <immintrin.h>
#endif

namespace ff {
namespace {

using bf16_tiles::TILE;
using bf16_tiles::TK;  // K per tile row of linear_amx's layout
using bf16_tiles::TN;  // output rows per block (linear_amx's B tile width)
constexpr int64_t kRowsMax = 8;

#ifdef FF_SCREEN
// The int8 estimates' integer sums for the 16 rows of each of NB blocks from b (codes
// [nb, Kq, 16, 4]: four K of a row in one int32 lane): for each of MR rows of x, hi and lo (u8,
// offset by 128, four K in an int32) dotted with the codes by vpdpbusd; then with the offsets
// taken out (128 rowsum_i each) a[m][i] = s_i sx_m (S_hi + S_lo / 256).
template <int MR, int NB>
void estimate(const uint32_t* xh, const uint32_t* xl, int64_t Kq, const int8_t* codes,
              const int32_t* rowsum, const float* scales, const float* sx, int64_t b, float* a,
              int64_t lda) {
  __m512i hi[MR][NB], lo[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < NB; ++u) hi[m][u] = lo[m][u] = _mm512_setzero_si512();
  const int8_t* c = codes + b * Kq * TN * 4;
  for (int64_t k = 0; k < Kq; ++k) {
    __m512i w[NB];
#pragma GCC unroll 4
    for (int u = 0; u < NB; ++u) w[u] = _mm512_loadu_si512(c + (u * Kq + k) * TN * 4);
#pragma GCC unroll 2
    for (int m = 0; m < MR; ++m) {
      const __m512i h = _mm512_set1_epi32(int(xh[m * Kq + k]));
      const __m512i l = _mm512_set1_epi32(int(xl[m * Kq + k]));
#pragma GCC unroll 4
      for (int u = 0; u < NB; ++u) {
        hi[m][u] = _mm512_dpbusd_epi32(hi[m][u], h, w[u]);
        lo[m][u] = _mm512_dpbusd_epi32(lo[m][u], l, w[u]);
      }
    }
  }
  for (int u = 0; u < NB; ++u) {
    const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(rowsum + (b + u) * TN), 7);
    const __m512 s = _mm512_loadu_ps(scales + (b + u) * TN);
    for (int m = 0; m < MR; ++m) {
      const __m512 sh = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi[m][u], off));
      const __m512 sl = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo[m][u], off));
      const __m512 sum = _mm512_fmadd_ps(sl, _mm512_set1_ps(1.f / 256), sh);
      _mm512_storeu_ps(a + m * lda + (b + u) * TN,
                       _mm512_mul_ps(sum, _mm512_mul_ps(s, _mm512_set1_ps(sx[m]))));
    }
  }
}

// Blocks [b0, b1) for all M rows: NB blocks at a time (4 streams from memory), their rows two
// at a time (more would spill the hi and lo accumulators), the later pairs reading the blocks
// from cache.
template <int NB>
void estimate_blocks(const uint32_t* xh, const uint32_t* xl, int64_t M, int64_t Kq,
                     const int8_t* codes, const int32_t* rowsum, const float* scales,
                     const float* sx, int64_t b, float* a, int64_t lda) {
  for (int64_t m = 0; m < M; m += 2) {
    const int64_t o = m * Kq;
    if (M - m >= 2) estimate<2, NB>(xh + o, xl + o, Kq, codes, rowsum, scales, sx + m, b, a + m * lda, lda);
    else estimate<1, NB>(xh + o, xl + o, Kq, codes, rowsum, scales, sx + m, b, a + m * lda, lda);
  }
}

void estimate_range(const uint32_t* xh, const uint32_t* xl, int64_t M, int64_t Kq,
                    const int8_t* codes, const int32_t* rowsum, const float* scales,
                    const float* sx, int64_t b0, int64_t b1, float* a, int64_t lda) {
  int64_t b = b0;
  for (; b + 4 <= b1; b += 4) estimate_blocks<4>(xh, xl, M, Kq, codes, rowsum, scales, sx, b, a, lda);
  for (; b < b1; ++b) estimate_blocks<1>(xh, xl, M, Kq, codes, rowsum, scales, sx, b, a, lda);
}

#endif

}  // namespace

bool greedy_screen_native() {
#ifdef FF_SCREEN
  return true;
#else
  return false;
#endif
}

std::vector<at::Tensor> greedy_screen_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "greedy_screen_pack: w must be a 2-D bf16 tensor");
  const int64_t N = w.size(0), K = w.size(1), nb = (N + TN - 1) / TN, Kq = (K + 3) / 4;
  const int64_t Kp = (K + TK - 1) / TK * TK;
  const auto wc = w.contiguous();  // read a row at a time (a double copy would be 8 bytes a weight)
  auto opts = w.options();
  auto codes = at::zeros({nb, Kq, TN, 4}, opts.dtype(at::kChar));
  auto rowsum = at::zeros({nb * TN}, opts.dtype(at::kInt));
  auto scales = at::zeros({nb * TN}, opts.dtype(at::kFloat));
  auto radius = at::zeros({nb * TN}, opts.dtype(at::kFloat));
  auto qnorm = at::zeros({nb * TN}, opts.dtype(at::kFloat));
  const at::BFloat16* src = wc.data_ptr<at::BFloat16>();
  int8_t* cp = codes.data_ptr<int8_t>();
  int32_t* rs = rowsum.data_ptr<int32_t>();
  float* sp = scales.data_ptr<float>();
  float* rp = radius.data_ptr<float>();
  float* qp = qnorm.data_ptr<float>();
  // the full projection's fp32 rounding, at most 4 Kp 2^-24 |x| |w| (two roundings a vdpbf16ps
  // step), counted for |w| and |w^| both (which also covers the estimate's few float steps)
  const double rounding = 4.0 * double(Kp) * std::ldexp(1.0, -24);
  const double margin = 1.0 + 1.0 / 1024;
  at::parallel_for(0, N, 256, [&](int64_t i0, int64_t i1) {
    std::vector<double> row(K);
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t k = 0; k < K; ++k) row[k] = double(float(src[i * K + k]));
      double mx = 0;
      for (int64_t k = 0; k < K; ++k) mx = std::max(mx, std::abs(row[k]));
      TORCH_CHECK(std::isfinite(mx), "greedy_screen_pack: row ", i, " is not finite");
      const float s = mx > 0 ? float(mx / 127.0) : 1.f;
      double err = 0, norm = 0, q2 = 0;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double q = std::clamp(std::nearbyint(row[k] / double(s)), -127.0, 127.0);
        cp[(((i / TN) * Kq + k / 4) * TN + i % TN) * 4 + k % 4] = int8_t(q);
        sum += int32_t(q);
        const double e = row[k] - q * double(s);
        err += e * e;
        norm += row[k] * row[k];
        q2 += q * q;
      }
      const double qn = std::sqrt(q2) * double(s);
      rs[i] = sum;
      sp[i] = s;
      qp[i] = float(qn * margin);
      rp[i] = float((std::sqrt(err) + rounding * (std::sqrt(norm) + qn)) * margin);
    }
  });
  return {codes, rowsum, scales, radius, qnorm};
}

at::Tensor greedy_screen(const at::Tensor& x, const std::vector<at::Tensor>& screen,
                         const at::Tensor& tiles, int64_t N, int64_t max_candidates) {
#ifdef FF_SCREEN
  TORCH_CHECK(screen.size() == 5, "greedy_screen: the screen is greedy_screen_pack's 5 tensors");
  const auto &codes = screen[0], &rowsum = screen[1], &scales = screen[2], &radius = screen[3],
             &qnorm = screen[4];
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == TN && codes.size(3) == 4 &&
                  codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "greedy_screen: codes must come from greedy_screen_pack");
  const int64_t nb = codes.size(0), Kq = codes.size(1);
  TORCH_CHECK(N > (nb - 1) * TN && N <= nb * TN, "greedy_screen: N=", N,
              " does not match the codes");
  for (const auto* t : {&scales, &radius, &qnorm})
    TORCH_CHECK(t->numel() == nb * TN && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "greedy_screen: scales, radius and norms must come from greedy_screen_pack");
  TORCH_CHECK(rowsum.numel() == nb * TN && rowsum.scalar_type() == at::kInt &&
                  rowsum.is_contiguous(),
              "greedy_screen: row sums must come from greedy_screen_pack");
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(0) == nb && tiles.size(2) == TK / 2 &&
                  tiles.size(3) == 2 * TN && tiles.scalar_type() == at::kBFloat16 &&
                  tiles.is_contiguous(),
              "greedy_screen: tiles must come from pack_amx_weight, ", nb, " blocks");
  const int64_t kc = tiles.size(1);
  TORCH_CHECK(x.dim() == 2, "greedy_screen: x must be 2-D");
  const int64_t K = x.size(1), M = x.size(0);
  TORCH_CHECK(K > 4 * (Kq - 1) && K <= 4 * Kq && K > (kc - 1) * TK && K <= kc * TK,
              "greedy_screen: x has ", K, " features, the screen ", 4 * Kq);
  TORCH_CHECK(M >= 1 && M <= kRowsMax, "greedy_screen: 1 to ", kRowsMax, " rows, got ", M);
  auto tokens = at::full({M}, -1, x.options().dtype(at::kLong));
  int64_t* tp = tokens.data_ptr<int64_t>();
  // the bf16 values the full projection multiplies: as floats, and as K pairs (padded to Kp)
  const auto xb = x.to(at::kBFloat16).contiguous();
  const auto xf = xb.to(at::kFloat).contiguous();
  const auto xpairs = bf16_tiles::dp_pairs(xb, kc * TK);
  const float* xp = xf.data_ptr<float>();
  // x^ = sx (hi + lo / 256) as u8 + 128 (K padded with 128: zero); its error's and x's norms
  std::vector<uint8_t> qh(M * Kq * 4, 128), ql(M * Kq * 4, 128);
  std::vector<float> sx(M);
  std::vector<double> xn(M), en(M);
  std::vector<char> skip(M, 0);  // rows left to the full projection
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * K;
    float mx = 0;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      finite &= std::isfinite(r[k]);
      mx = std::max(mx, std::abs(r[k]));
    }
    if (!finite) {  // NaN or inf: the full projection decides (its codes stay 0)
      skip[m] = 1;
      continue;
    }
    const double step = mx > 0 ? double(mx) / 127 : 1.0;
    sx[m] = float(step);
    double n2 = 0, e2 = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = double(r[k]) / double(sx[m]);
      const double h = std::clamp(std::nearbyint(v), -127.0, 127.0);
      const double l = std::clamp(std::nearbyint((v - h) * 256), -127.0, 127.0);
      qh[m * Kq * 4 + k] = uint8_t(int(h) + 128);
      ql[m * Kq * 4 + k] = uint8_t(int(l) + 128);
      const double e = double(r[k]) - double(sx[m]) * (h + l / 256);
      n2 += double(r[k]) * r[k];
      e2 += e * e;
    }
    xn[m] = std::sqrt(n2) * (1.0 + 1.0 / 1024);
    en[m] = std::sqrt(e2) * (1.0 + 1.0 / 1024);
  }
  // the estimates, in a buffer kept between calls: a fresh 200 KB a call (SmolLM2) cost
  // ~0.15 ms of page faults and zeroing when the memory came back cold
  // (the calling thread's: the parallel regions below use ap, not their own threads' buffers)
  static thread_local std::vector<float> buffer;
  if (buffer.size() < size_t(M * nb * TN)) buffer.resize(M * nb * TN);
  float* ap = buffer.data();
  const auto* xh = reinterpret_cast<const uint32_t*>(qh.data());
  const auto* xl = reinterpret_cast<const uint32_t*>(ql.data());
  const int8_t* cp = codes.data_ptr<int8_t>();
  const int32_t* rs = rowsum.data_ptr<int32_t>();
  const float* sp = scales.data_ptr<float>();
  const float* rp = radius.data_ptr<float>();
  const float* np = qnorm.data_ptr<float>();
  steal_for(nb, nb, 4, [&](int64_t b0, int64_t b1) {
    estimate_range(xh, xl, M, Kq, cp, rs, sp, sx.data(), b0, b1, ap, nb * TN);
  });
  const auto* tw = reinterpret_cast<const uint16_t*>(tiles.data_ptr());
  const auto* xq = reinterpret_cast<const uint32_t*>(xpairs.data_ptr());
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
  std::vector<int64_t> cand;
  for (int64_t m = m0; m < m1; ++m) {
    if (skip[m]) continue;
    const float* am = ap + m * nb * TN;
    const __m512 xv = _mm512_set1_ps(float(xn[m])), ev = _mm512_set1_ps(float(en[m]));
    // b = |x| radius + |x - x^| |w^| (the norms rounded up); L = max (a - b), then the
    // candidates a + b >= L (rows past N are not outputs), 16 at a time
    auto bound = [&](int64_t i) {
      return _mm512_fmadd_ps(ev, _mm512_loadu_ps(np + i), _mm512_mul_ps(xv, _mm512_loadu_ps(rp + i)));
    };
    auto inside = [&](int64_t i) {
      return N - i >= TN ? __mmask16(0xffff) : __mmask16((1u << (N - i)) - 1);
    };
    __m512 lv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < N; i += TN)
      lv = _mm512_mask_max_ps(lv, inside(i), lv, _mm512_sub_ps(_mm512_loadu_ps(am + i), bound(i)));
    const float L = _mm512_reduce_max_ps(lv);
    if (!std::isfinite(L)) continue;
    const __m512 Lv = _mm512_set1_ps(L);
    cand.clear();
    for (int64_t i = 0; i < N && int64_t(cand.size()) <= max_candidates; i += TN) {
      const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(am + i), bound(i));
      for (uint32_t hit = _mm512_mask_cmp_ps_mask(inside(i), hi, Lv, _CMP_GE_OQ); hit;
           hit &= hit - 1)
        cand.push_back(i + __builtin_ctz(hit));
    }
    if (cand.empty() || int64_t(cand.size()) > max_candidates) continue;
    // the candidates' exact logits, ascending: the first largest is the argmax
    int64_t best = -1, block = -1;
    float best_v = 0;
    alignas(64) float exact[TN];
    bool ok = true;
    for (const int64_t i : cand) {
      if (i / TN != block) {
        block = i / TN;
        // the block's logits as linear_amx computes them (one_row adds the zero bias)
        const __m512 sums = bf16_tiles::block_sums(xq + m * kc * TK / 2, tw + block * kc * TILE,
                                                   kc * TK / 2);
        _mm512_store_ps(exact, _mm512_add_ps(sums, _mm512_setzero_ps()));
      }
      const float v = exact[i % TN];
      if (std::isnan(v)) {
        ok = false;
        break;
      }
      if (best < 0 || v > best_v) best = i, best_v = v;
    }
    if (ok) tp[m] = best;
  }
  });
  return tokens;
#else
  TORCH_CHECK(false, "greedy_screen: the kernels were built without AVX512-BF16 and VNNI");
#endif
}

}  // namespace ff
