// Row-wise ops of the decoder layer fused into one pass each (in PyTorch they are 5-8 small
// ops apiece, whose dispatch costs more than their arithmetic at decode sizes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec.h"

namespace ff {
namespace {

// out = x / rms(x) * w (Llama: the normalised row is rounded to x's dtype before the scale, as
// HF does) or * (1 + w) in fp32 (Gemma's unit offset).
template <typename T, typename WT>
inline void rms_row(const T* xr, const WT* w, T* o, int64_t D, float eps, bool unit_offset) {
  vf a0{}, a1{};
  int64_t i = 0;
  for (; i + 2 * VL <= D; i += 2 * VL) {
    const vf u = ldv(xr + i), v = ldv(xr + i + VL);
    a0 += u * u;
    a1 += v * v;
  }
  for (; i + VL <= D; i += VL) {
    const vf u = ldv(xr + i);
    a0 += u * u;
  }
  float ss = hsum(a0 + a1);
  for (; i < D; ++i) {
    const float v = ld(xr, i);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / float(D) + eps);
  i = 0;
  for (; i + VL <= D; i += VL) {
    const vf h = ldv(xr + i) * inv;
    if (unit_offset) {
      stv(o + i, h * (1.f + ldv(w + i)));
    } else if constexpr (std::is_same_v<T, uint16_t>) {
      stv(o + i, round_bf16(h) * ldv(w + i));
    } else {
      stv(o + i, h * ldv(w + i));
    }
  }
  for (; i < D; ++i) {
    const float h = ld(xr, i) * inv;
    if (unit_offset) {
      st(o, i, h * (1.f + ld(w, i)));
    } else if constexpr (std::is_same_v<T, uint16_t>) {
      st(o, i, bf16_to_float(float_to_bf16(h)) * ld(w, i));
    } else {
      st(o, i, h * ld(w, i));
    }
  }
}

template <typename T, typename WT>
void rms_rows(const T* x, const WT* w, T* out, int64_t rows, int64_t D, int64_t stride,
              float eps, bool unit_offset) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(x + r * stride, w, out + r * D, D, eps, unit_offset);
  });
}

// x += d (rounded to x's dtype, as x + d is), then out = rms_norm(x): the residual add and the
// next norm in one pass over the row, the norm computed from the stored sum exactly as rms_rows
// computes it.
template <typename T, typename WT>
void add_rms_rows(T* x, const T* d, const WT* w, T* out, int64_t rows, int64_t D, float eps,
                  bool unit_offset) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * D;
      const T* dr = d + r * D;
      int64_t i = 0;
      for (; i + VL <= D; i += VL) stv(xr + i, ldv(xr + i) + ldv(dr + i));
      for (; i < D; ++i) st(xr, i, ld(xr, i) + ld(dr, i));
      rms_row(xr, w, out + r * D, D, eps, unit_offset);
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t I, bool gelu) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * 2 * I;
      const T* u = g + I;
      T* o = out + r * I;
      int64_t i = 0;
      if (!gelu) {
        for (; i + VL <= I; i += VL) {
          const vf gv = ldv(g + i);
          stv(o + i, gv * vrecip(1.f + vexp(-gv)) * ldv(u + i));
        }
      }
      for (; i < I; ++i) {
        const float a = ld(g, i);
        float act;
        if (gelu) {
          act = 0.5f * a * (1.f + std::tanh(0.7978845608028654f * (a + 0.044715f * a * a * a)));
        } else {
          act = a / (1.f + std::exp(-a));
        }
        st(o, i, act * ld(u, i));
      }
    }
  });
}

}  // namespace

namespace {

// Checks a norm's weight against x and calls f(T{}, w) with x's element type T (uint16_t for
// bf16, or float) and the weight as const WT* (x's type, or float).
template <typename F>
void with_norm_types(const char* op, const at::Tensor& x, const at::Tensor& weight, F&& f) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D && weight.is_contiguous(), "weight must have ", D, " entries");
  const bool bf = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf || x.scalar_type() == at::kFloat, op, ": float32 or bfloat16 only");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              op, ": weight dtype must be x's or float32");
  const void* wp = weight.data_ptr();
  const bool wf = weight.scalar_type() == at::kFloat;
  if (bf && wf) f(uint16_t{}, static_cast<const float*>(wp));
  else if (bf) f(uint16_t{}, static_cast<const uint16_t*>(wp));
  else f(float{}, static_cast<const float*>(wp));
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D && weight.is_contiguous(), "weight must have ", D, " entries");
  TORCH_CHECK(x.stride(-1) == 1, "rows of x must be contiguous");
  auto x2 = x.dim() == 2 ? x : x.reshape({-1, D});
  TORCH_CHECK(x2.stride(-1) == 1, "rows of x must be contiguous");
  const int64_t rows = x2.size(0), stride = rows > 1 ? x2.stride(0) : D;
  auto out = at::empty({rows, D}, x.options());
  with_norm_types("rms_norm", x, weight, [&](auto tag, const auto* wp) {
    using T = decltype(tag);
    rms_rows(static_cast<const T*>(x2.data_ptr()), wp, static_cast<T*>(out.data_ptr()), rows, D,
             stride, float(eps), unit_offset);
  });
  return out.view(x.sizes());
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                         double eps, bool unit_offset) {
  auto out = at::empty_like(x);
  add_rms_norm_out(x, delta, weight, eps, unit_offset, out);
  return out;
}

void add_rms_norm_out(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                      double eps, bool unit_offset, at::Tensor& out) {
  TORCH_CHECK(x.is_contiguous() && delta.is_contiguous() && delta.sizes() == x.sizes(),
              "add_rms_norm_: x and delta must be contiguous and of one shape");
  TORCH_CHECK(delta.scalar_type() == x.scalar_type(), "add_rms_norm_: x and delta dtypes differ");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() &&
                  out.scalar_type() == x.scalar_type() && !out.is_same(x) && !out.is_same(delta),
              "add_rms_norm_: out must be a contiguous tensor of x's shape and dtype, apart "
              "from x and delta");
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  with_norm_types("add_rms_norm_", x, weight, [&](auto tag, const auto* wp) {
    using T = decltype(tag);
    add_rms_rows(static_cast<T*>(x.data_ptr()), static_cast<const T*>(delta.data_ptr()), wp,
                 static_cast<T*>(out.data_ptr()), rows, D, float(eps), unit_offset);
  });
}

at::Tensor gated_act(const at::Tensor& x, bool gelu) {
  auto sizes = x.sizes().vec();
  sizes.back() = x.size(-1) / 2;
  auto out = at::empty(sizes, x.options());
  gated_act_out(x, gelu, out);
  return out;
}

void gated_act_out(const at::Tensor& x, bool gelu, at::Tensor& out) {
  TORCH_CHECK(x.size(-1) % 2 == 0, "gate/up input must have an even width");
  const auto xc = x.contiguous();
  const int64_t I = x.size(-1) / 2, rows = I ? xc.numel() / (2 * I) : 0;
  TORCH_CHECK(out.is_contiguous() && out.numel() == rows * I &&
                  out.scalar_type() == x.scalar_type(),
              "gated_act: out must be a contiguous tensor of x's dtype with half its width");
  if (x.scalar_type() == at::kBFloat16) {
    silu_mul_rows((const uint16_t*)xc.data_ptr(), (uint16_t*)out.data_ptr(), rows, I, gelu);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "gated_act: float32 or bfloat16 only");
    silu_mul_rows(xc.data_ptr<float>(), out.data_ptr<float>(), rows, I, gelu);
  }
}

}  // namespace ff

namespace ff {
namespace {

// Rotate-half RoPE in place on x [T, heads, D] (any token and head strides, D contiguous):
// the first `rot` features rotate pairwise (i, i + rot/2) by the angles of table row pos[t]
// (cos in [0, rot/2), sin in [rot/2, rot), fp32); the rest pass through.
template <typename T>
void rope_rows(T* x, int64_t Tn, int64_t heads, int64_t ts, int64_t sh, const int64_t* pos,
               const float* table, int64_t rot, int64_t P) {
  const int64_t half = rot / 2;
  at::parallel_for(0, Tn, std::max<int64_t>(1, 4096 / (heads * rot)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " outside the RoPE table");
      const float* c = table + pos[t] * rot;
      const float* s = c + half;
      for (int64_t h = 0; h < heads; ++h) {
        T* r = x + t * ts + h * sh;
        int64_t i = 0;
        for (; i + VL <= half; i += VL) {
          const vf a = ldv(r + i), b = ldv(r + i + half), cv = load(c + i), sv = load(s + i);
          stv(r + i, a * cv - b * sv);
          stv(r + i + half, b * cv + a * sv);
        }
        for (; i < half; ++i) {
          const float a = ld(r, i), b = ld(r, i + half);
          st(r, i, a * c[i] - b * s[i]);
          st(r, i + half, b * c[i] + a * s[i]);
        }
      }
    }
  });
}

}  // namespace

void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& table) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, D] with contiguous D");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat && table.is_contiguous(),
              "table must be a contiguous float32 [positions, rotary_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == x.size(0),
              "positions must be int64 [T]");
  const int64_t rot = table.size(1);
  TORCH_CHECK(rot % 2 == 0 && rot <= x.size(2), "rotary dim ", rot, " does not fit head dim");
  auto pos = positions.contiguous();
  const auto* pp = pos.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    rope_rows(reinterpret_cast<uint16_t*>(x.data_ptr()), x.size(0), x.size(1), x.stride(0),
              x.stride(1), pp, table.data_ptr<float>(), rot, table.size(0));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rope_: float32 or bfloat16 only");
    rope_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), x.stride(1), pp,
              table.data_ptr<float>(), rot, table.size(0));
  }
}

namespace {

// Row x[0, V)'s first NaN, else its first maximum (torch.max(dim=-1).indices' pick).
int64_t row_argmax(const float* x, int64_t V) {
  auto first_nan = [&]() -> int64_t {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return i;
    return -1;
  };
  int64_t i = 0, best_i = 0;
  float best = x[0];
#if defined(__AVX512F__)
  if (V >= 32) {
    // Two sets of 16 lanes (independent chains), each lane keeping its first maximum.
    __m512 b0 = _mm512_loadu_ps(x), b1 = _mm512_loadu_ps(x + 16);
    __m512i i0 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(16));
    __m512i c0 = i0, c1 = i1;
    const __m512i step = _mm512_set1_epi32(32);
    __mmask16 nan = _mm512_cmp_ps_mask(b0, b0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b1, b1, _CMP_UNORD_Q);
    for (i = 32; i + 32 <= V; i += 32) {
      c0 = _mm512_add_epi32(c0, step);
      c1 = _mm512_add_epi32(c1, step);
      const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
      nan |= _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
      const __mmask16 g0 = _mm512_cmp_ps_mask(v0, b0, _CMP_GT_OQ);
      const __mmask16 g1 = _mm512_cmp_ps_mask(v1, b1, _CMP_GT_OQ);
      b0 = _mm512_mask_mov_ps(b0, g0, v0);
      b1 = _mm512_mask_mov_ps(b1, g1, v1);
      i0 = _mm512_mask_mov_epi32(i0, g0, c0);
      i1 = _mm512_mask_mov_epi32(i1, g1, c1);
    }
    if (nan) return first_nan();
    // the larger of the two sets per lane (the earlier index on ties), then across lanes
    const __mmask16 take1 = _mm512_cmp_ps_mask(b1, b0, _CMP_GT_OQ) |
                            (_mm512_cmp_ps_mask(b1, b0, _CMP_EQ_OQ) & _mm512_cmp_epi32_mask(i1, i0, _MM_CMPINT_LT));
    const __m512 b = _mm512_mask_mov_ps(b0, take1, b1);
    const __m512i bi = _mm512_mask_mov_epi32(i0, take1, i1);
    best = _mm512_reduce_max_ps(b);
    const __mmask16 at = _mm512_cmp_ps_mask(b, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_i = _mm512_mask_reduce_min_epi32(at, bi);
  }
#endif
  for (; i < V; ++i) {
    if (std::isnan(x[i])) return first_nan();
    if (x[i] > best) {
      best = x[i];
      best_i = i;
    }
  }
  return best_i;
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "argmax_rows: x must be 2-D float32");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  TORCH_CHECK(x.size(1) < (int64_t(1) << 31), "argmax_rows: rows over 2^31 entries");
  auto xc = x.contiguous();
  const int64_t R = xc.size(0), V = xc.size(1);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, std::max<int64_t>(1, (1 << 16) / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_argmax(xp + r * V, V);
  });
  return out;
}

namespace {

// A row's max, a vector at a time (a NaN does not pass into it), and whether it holds a NaN.
float row_max(const float* x, int64_t V, bool& nan) {
  vf vmx = splat(-std::numeric_limits<float>::infinity());
  auto vnan = vmx != vmx;  // all false
  int64_t i = 0;
  for (; i + VL <= V; i += VL) {
    const vf v = load(x + i);
    vmx = v > vmx ? v : vmx;
    vnan |= v != v;
  }
  float mx = hmax(vmx);
  nan = false;
  for (int l = 0; l < VL; ++l) nan |= vnan[l] != 0;
  for (; i < V; ++i) {
    mx = std::max(mx, x[i]);
    nan |= std::isnan(x[i]);
  }
  return mx;
}

}  // namespace

// Sampling from softmax(logits) by inverse CDF, one uniform u[r] in [0, 1) a row, without the
// [rows, vocab] probabilities or noise in memory: per row its max, exp(x - max) into a buffer
// of the thread's, the sum of each block of VL (one vector), their total in double; then the
// first block whose running sum passes u x total and, inside it, the first token whose running
// sum does (rounding inside the block can leave it short: then the block's last token of
// nonzero weight). A token of weight 0 (a masked -inf, or under e^-87 of the max) is never
// taken. -1 where the total is not a positive finite number (NaN or +inf logits). At 64 rows of
// SmolLM2's 49,152 tokens this replaced softmax, Exp(1) noise through torch's serial generator
// and an argmax: ~70 ms -> ~1 ms (Zen 4 EPYC, 2 threads).
at::Tensor sample_logits(const at::Tensor& logits, const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "sample_logits: logits must be 2-D float32");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.size(0) == logits.size(0),
              "sample_logits: u must be float64 with one value per row of logits");
  TORCH_CHECK(logits.size(1) > 0, "sample_logits: rows must not be empty");
  const auto lc = logits.contiguous();
  const auto uc = u.contiguous();
  const int64_t R = lc.size(0), V = lc.size(1);
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t nb = (V + VL - 1) / VL;
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> w(nb * VL, 0.f), block(nb);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = lp + r * V;
      bool nan;
      const float mx = row_max(x, V, nan);
      int64_t i = 0;
      for (; i + VL <= V; i += VL) store(w.data() + i, vexp(load(x + i) - splat(mx)));
      for (; i < V; ++i) w[i] = std::exp(x[i] - mx);
      double total = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        block[b] = hsum(load(w.data() + b * VL));  // the tail's padding lanes hold 0
        total += block[b];
      }
      op[r] = -1;
      if (nan || !(total > 0.0) || !std::isfinite(total)) continue;
      const double target = up[r] * total;
      double sum = 0.0;
      int64_t b = 0;
      while (b + 1 < nb && sum + block[b] <= target) sum += block[b++];
      const int64_t hi = std::min(V, (b + 1) * VL);
      for (int64_t j = b * VL; j < hi; ++j) {
        if (w[j] <= 0.f) continue;
        op[r] = j;  // the block's last token of nonzero weight, unless one passes the target
        sum += w[j];
        if (sum > target) break;
      }
    }
  });
  return out;
}

namespace {

// Top-p on one row x [V] in place (keep the smallest set of most likely tokens whose mass
// reaches p): a token is dropped when the mass of the tokens ranked no higher than it, itself
// included, is at most (1 - p) x the row's total -- the sorted reference's test
// (sampler.py apply_top_k_top_p_sorted), here in float64. Tokens rank by logit, equal logits
// by index (the higher index ranks lower). Without sorting the row: each token's weight
// exp(x - max) goes to a bin by its distance below the max (kTopPBins bins over the ~88 where
// float32 weights are not 0; the last takes everything further), the bins' masses are summed
// in double from the bottom up to the one where the running mass passes the limit, and only
// that bin's tokens are sorted to find the cut inside it. Bins below it are dropped, bins above
// kept. w, nz and bin: buffers of V. False (x untouched) where the row's total is not a positive
// finite number.
constexpr int kTopPBins = 4096;
constexpr float kTopPRange = 88.f;  // exp(-88) is under float32's smallest normal

bool top_p_row(float* x, int64_t V, double p, float* w, int32_t* nz, uint16_t* bin,
               double* mass) {
  bool nan;
  const float mx = row_max(x, V, nan);
  if (nan || !std::isfinite(mx)) return false;
  // The weights, and the indices of the tokens of positive weight into nz (room for V + 16):
  // only those take part; a token of weight 0 (masked, or under e^-87) is dropped. After top-k
  // or min-p they are a few dozen, visited through their indices; a dense row is walked whole
  // (the indirection cost more than it saved there). With AVX-512 the indices are compressed
  // in a register and stored whole (Zen 4 runs the compressing store to memory in microcode).
  int64_t n = 0, i = 0;
#if defined(__AVX512F__)
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; i + 16 <= V; i += 16) {
    const vf e = vexp(load(x + i) - splat(mx));  // VL == 16
    store(w + i, e);
    const __m512 wv = reinterpret_cast<const __m512&>(e);
    const __mmask16 pos = _mm512_cmp_ps_mask(wv, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_storeu_si512(nz + n, _mm512_maskz_compress_epi32(pos, ids));
    n += __builtin_popcount(pos);
    ids = _mm512_add_epi32(ids, _mm512_set1_epi32(16));
  }
#else
  for (; i + VL <= V; i += VL) store(w + i, vexp(load(x + i) - splat(mx)));
  for (int64_t j = 0; j < i; ++j)
    if (w[j] > 0.f) nz[n++] = int32_t(j);
#endif
  for (; i < V; ++i) {
    w[i] = std::exp(x[i] - mx);
    if (w[i] > 0.f) nz[n++] = int32_t(i);
  }
  const bool dense = 8 * n > V;
  auto each = [&](auto&& f) {
    if (dense) {
      for (int64_t j = 0; j < V; ++j)
        if (w[j] > 0.f) f(j);
    } else {
      for (int64_t k = 0; k < n; ++k) f(int64_t(nz[k]));
    }
  };
  std::fill(mass, mass + kTopPBins, 0.0);
  const float per = kTopPBins / kTopPRange;
  each([&](int64_t j) {
    const float d = (mx - x[j]) * per;  // >= 0
    const int b = d < float(kTopPBins - 1) ? int(d) : kTopPBins - 1;
    bin[j] = uint16_t(b);
    mass[b] += w[j];
  });
  // (summed from the bins, not token by token: one double chain a token was most of the pass)
  double total = 0.0;
  for (int b = 0; b < kTopPBins; ++b) total += mass[b];
  if (!(total > 0.0) || !std::isfinite(total)) return false;
  const double limit = (1.0 - p) * total;
  double acc = 0.0;  // the mass of the bins below the cut's
  int cut = kTopPBins - 1;
  while (cut > 0 && acc + mass[cut] <= limit) acc += mass[cut--];
  // the cut's bin, ascending by rank: (x, -index)
  std::vector<std::pair<float, int64_t>> in;
  each([&](int64_t j) {
    if (bin[j] == cut) in.emplace_back(x[j], -j);
  });
  std::sort(in.begin(), in.end());
  int64_t dropped = 0;  // the first `dropped` of `in` go
  while (dropped < int64_t(in.size()) && acc + w[-in[dropped].second] <= limit)
    acc += w[-in[dropped++].second];
  const float ninf = -std::numeric_limits<float>::infinity();
  const std::pair<float, int64_t> last = dropped ? in[dropped - 1] : std::make_pair(ninf, int64_t(0));
  auto drop = [&](int64_t j) {
    return bin[j] > cut || (bin[j] == cut && dropped && std::make_pair(x[j], -j) <= last);
  };
  int64_t kept = 0;
  if (dense) {
    for (int64_t j = 0; j < V; ++j) {
      if (!(w[j] > 0.f) || drop(j)) x[j] = ninf;
      else ++kept;
    }
  } else {  // weight 0: -inf a vector at a time; then the dropped ones among the rest
    i = 0;
    for (; i + VL <= V; i += VL) store(x + i, load(w + i) > splat(0.f) ? load(x + i) : splat(ninf));
    for (; i < V; ++i)
      if (!(w[i] > 0.f)) x[i] = ninf;
    each([&](int64_t j) {
      if (drop(j)) x[j] = ninf;
      else ++kept;
    });
  }
  if (kept == 0) {  // rounding at p ~ 0: the most likely token stays (its first occurrence)
    for (int64_t j = 0; j < V; ++j)
      if (w[j] == 1.f) {
        x[j] = mx;
        break;
      }
  }
  return true;
}

}  // namespace

// Top-p over the rows of logits [R, V] (float32, contiguous) in place, top_p [R] in [0, 1]:
// top_p_row on each, a row a thread at a time; returns which rows it took (bool [R]). Zen 4
// EPYC, 2 threads, top_p 0.95 over SmolLM2's 49,152 tokens: 64 rows of its logits at
// temperature 0.8 4.5 ms, where looking among each row's 256 and 2,048 most likely tokens
// first (the sampler's torch path) took 23.8; 64 flat rows, which that path sorts, 4.6 against
// 188 ms; one row 0.15 ms.
at::Tensor top_p_filter_(at::Tensor& logits, const at::Tensor& top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "top_p_filter_: logits must be 2-D contiguous float32");
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == logits.size(0),
              "top_p_filter_: top_p must hold one value per row of logits");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "top_p_filter_: rows of 1 to 2^31 - 1 tokens");
  const auto pc = top_p.to(at::kDouble).contiguous();
  // 0 is taken (the most likely token alone): a valid top_p under float32's range, e.g. 1e-217
  // from a request, arrives as 0
  TORCH_CHECK(R == 0 || (pc.min().item<double>() >= 0.0 && pc.max().item<double>() <= 1.0),
              "top_p_filter_: top_p must be in [0, 1]");
  auto done = at::zeros({R}, logits.options().dtype(at::kBool));
  float* lp = logits.data_ptr<float>();
  const double* pp = pc.data_ptr<double>();
  bool* dp = done.data_ptr<bool>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> w(V);
    std::vector<int32_t> nz(V + 16);
    std::vector<uint16_t> bin(V);
    std::vector<double> mass(kTopPBins);
    for (int64_t r = r0; r < r1; ++r)
      dp[r] = top_p_row(lp + r * V, V, pp[r], w.data(), nz.data(), bin.data(), mass.data());
  });
  return done;
}

// -inf in place wherever x[r, i] < threshold[r] (x [R, V] float32, contiguous; threshold [R]
// float32): the min-p and top-k masks in one pass, where `x.masked_fill_(x < t, -inf)` built a
// [R, V] bool mask first (64 rows of SmolLM2's 49,152 tokens: ~4 ms of the sampler's step on the
// Zen 4 EPYC). A NaN threshold masks nothing, as the comparison is false.
void mask_below_(at::Tensor& x, const at::Tensor& threshold) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "mask_below_: x must be 2-D contiguous float32");
  TORCH_CHECK(threshold.dim() == 1 && threshold.size(0) == x.size(0),
              "mask_below_: threshold must hold one value per row of x");
  const auto tc = threshold.to(at::kFloat).contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* tp = tc.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, R * V, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {
      const int64_t r = i / V, end = std::min(i1, (r + 1) * V);
      const float t = tp[r];
      for (; i < end; ++i)
        if (xp[i] < t) xp[i] = ninf;
    }
  });
}

}  // namespace ff
