// y = x @ W^T (+ bias) for bf16 weights with fp32 accumulation: the linear layer of the fast
// CPU path. W is pre-packed in column tiles of 16 output features, [N/16][K][16]. The kernel
// keeps an MR x NV block of accumulators (MR rows of x, NV native vectors of output columns)
// in registers; per input k it loads NV weight vectors, broadcasts x[m, k] for each row and
// does MR * NV FMAs -- no horizontal reductions. Few rows (decode) are memory-bound: every
// weight is read once per MR rows, streamed in order. Many rows (prefill) reuse a tile from L2.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "ops.h"
#include "parallel.h"
#include "vec.h"

// The BLAS's sgemm as libtorch_cpu exports it (MKL on x86 builds), weak: a PyTorch without it
// still loads the kernels, and linear_bf16_gemm multiplies through at::mm instead.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace ff {
namespace {

constexpr int TILE = 16;  // output features per packed tile
// A block is MR <= 6 rows x NV vectors of output columns: enough independent accumulators to
// cover the FMA latency, few enough to stay in registers with the weights and the broadcast x
// (AVX2: 6 x 2 of 16 ymm; AVX-512: 6 x 4 of 32 zmm). Measured on AVX2: 12 rows x 1 vector
// was slower at 8 rows and no faster at 256.
constexpr int MR_MAX = 6;
constexpr int NV = (VL == 16) ? 4 : 2;
// One row: 4 vectors. Every output is the same sequential sum over k in every block shape, so
// a row's result does not depend on the batch it is in (splitting even and odd k into two
// chains for one row was no faster, and made batch-1 and batched greedy output differ at
// near-ties; 8 vectors of one row ran ~40x slower).
constexpr int NV_ONE = 4;

template <typename T>
inline float xval(const T* x, int64_t i) {
  if constexpr (std::is_same_v<T, uint16_t>) return bf16_to_float(x[i]);
  else return x[i];
}

// Column-major C [m, n] (ldc) = A [m, k] (lda) B [k, n] (ldb k), on one thread where the
// caller is a parallel region's: the BLAS's sgemm, else at::mm on row-major views of the same
// memory (C^T = B^T A^T).
void sgemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, float* c,
           int64_t ldc) {
  if (sgemm_ != nullptr) {
    const int mi = m, ni = n, ki = k, ldai = lda, ldci = ldc;
    const float one = 1.f, zero = 0.f;
    sgemm_("N", "N", &mi, &ni, &ki, &one, a, &ldai, b, &ki, &zero, c, &ldci);
    return;
  }
  const auto opt = at::TensorOptions().dtype(at::kFloat);
  auto at_ = at::from_blob(const_cast<float*>(a), {k, m}, {lda, 1}, opt);
  auto bt = at::from_blob(const_cast<float*>(b), {n, k}, {k, 1}, opt);
  auto ct = at::from_blob(c, {n, m}, {ldc, 1}, opt);
  ct.copy_(at::mm(bt, at_));
}

// Address of W[col][k] in the packed layout, col a multiple of VL.
inline const uint16_t* wcol(const uint16_t* w, int64_t K, int64_t col) {
  return w + (col / TILE) * K * TILE + col % TILE;
}

template <int MR, int NV, typename XT, typename YT>
inline void kernel(const XT* x, int64_t K, const uint16_t* w, int64_t c0, YT* y, int64_t N,
                   const float* bias) {
  vf acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[m][j] = vf{};
  const uint16_t* wp[NV];
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) wp[j] = wcol(w, K, c0 + j * VL);
  for (int64_t k = 0; k < K; ++k) {
    vf wv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) wv[j] = load_bf16(wp[j] + k * TILE);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const vf xb = splat(xval(x, m * K + k));
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[m][j] += xb * wv[j];
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    float out[NV * VL];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      vf v = acc[m][j];
      if (bias) v += load(bias + c0 + j * VL);
      store(out + j * VL, v);
    }
    const int64_t n = std::min<int64_t>(NV * VL, N - c0);
    YT* yr = y + m * N + c0;
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<YT, uint16_t>) yr[i] = float_to_bf16(out[i]);
      else yr[i] = out[i];
    }
  }
}

template <typename XT, typename YT>
void rows(int r, const XT* x, int64_t K, const uint16_t* w, int64_t c0, int vecs, YT* y,
          int64_t N, const float* bias) {
  // r rows over `vecs` column vectors from c0: whole blocks of NV, then single vectors.
  if (r == 1 && vecs == NV_ONE) return kernel<1, NV_ONE>(x, K, w, c0, y, N, bias);
  const bool whole = vecs == NV;
  for (int v = 0; v < (whole ? 1 : vecs); ++v) {
    const int64_t c = c0 + int64_t(v) * VL;
    switch (r) {
#define FF_CASE(R)                                           \
  case R:                                                    \
    if (whole) kernel<R, NV>(x, K, w, c, y, N, bias);        \
    else kernel<R, 1>(x, K, w, c, y, N, bias);               \
    break;
      FF_CASE(1) FF_CASE(2) FF_CASE(3) FF_CASE(4) FF_CASE(5) FF_CASE(6)
#undef FF_CASE
      default: TORCH_CHECK(false, "bad row block ", r);
    }
  }
}

template <typename XT, typename YT>
void linear_impl(const XT* x, const uint16_t* w, const float* bias, YT* y, int64_t M,
                 int64_t K, int64_t N) {
  const int64_t padded = (N + TILE - 1) / TILE * TILE;  // columns that exist in the packing
  const int64_t width = int64_t(M == 1 ? NV_ONE : NV) * VL;
  const int64_t groups = (padded + width - 1) / width;
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / (K * width));  // >= 64 KiB of W
  dynamic_for(groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t c0 = g * width;
      const int vecs = int(std::min<int64_t>(width, padded - c0) / VL);
      for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
        const int r = int(std::min<int64_t>(MR_MAX, M - m0));
        rows(r, x + m0 * K, K, w, c0, vecs, y + m0 * N, N, bias);
      }
    }
  });
}


}  // namespace

// [N, K] float weight -> [ceil(N/16), K, 16] bf16 tiles (rows past N are zero).
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t tiles = (N + TILE - 1) / TILE;
  auto w = at::zeros({tiles * TILE, K}, weight.options().dtype(at::kBFloat16));
  w.narrow(0, 0, N).copy_(weight);
  return w.view({tiles, TILE, K}).transpose(1, 2).contiguous();
}

// The [N, K] weight back from its packing (tests, checkpoints).
at::Tensor unpack_linear_weight(const at::Tensor& wpacked, int64_t N) {
  const int64_t K = wpacked.size(1);
  return wpacked.transpose(1, 2).reshape({-1, K}).narrow(0, 0, N).contiguous();
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  auto y = at::empty({x.numel() / std::max<int64_t>(x.size(-1), 1), N}, x.options());
  linear_bf16_out(x, wpacked, N, bias, y);
  return y.view(out_sizes);
}

// linear_bf16 into y, a contiguous [rows, N] tensor of x's dtype (the fused decoder stack's
// buffers for few-token steps).
void linear_bf16_out(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                     const std::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(wpacked.dim() == 3 && wpacked.size(2) == TILE &&
                  wpacked.scalar_type() == at::kBFloat16 && wpacked.is_contiguous(),
              "packed weight must be a contiguous [N/16, K, 16] bf16 tensor");
  const int64_t K = wpacked.size(1);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight expects ", K);
  TORCH_CHECK(N > 0 && wpacked.size(0) * TILE >= N && (wpacked.size(0) - 1) * TILE < N,
              "N=", N, " does not match the packed weight");
  const auto xc = x.dim() == 2 && x.is_contiguous() ? x : x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.is_contiguous() &&
                  y.scalar_type() == x.scalar_type(),
              "linear_bf16: the output must be a contiguous [", M, ", ", N,
              "] tensor of x's dtype");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    // padded to whole tiles so the vector add never reads past the end
    b = at::zeros({wpacked.size(0) * TILE}, x.options().dtype(at::kFloat));
    b.narrow(0, 0, N).copy_(*bias);
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const auto* wp = reinterpret_cast<const uint16_t*>(wpacked.data_ptr());
  if (M == 0) return;
  if (x.scalar_type() == at::kFloat) {
    linear_impl(xc.data_ptr<float>(), wp, bp, y.data_ptr<float>(), M, K, N);
  } else if (x.scalar_type() == at::kBFloat16) {
    linear_impl(reinterpret_cast<const uint16_t*>(xc.data_ptr()), wp, bp,
                reinterpret_cast<uint16_t*>(y.data_ptr()), M, K, N);
  } else {
    TORCH_CHECK(false, "linear_bf16: x must be float32 or bfloat16, got ", x.scalar_type());
  }
}

// y = x @ W^T for many rows on a CPU without native bf16 matmul: float32 GEMM (the BLAS's
// sgemm, one thread per chunk) on the packed bf16 weight expanded a chunk of GEMM_TILES tiles
// at a time into a per-thread float32 buffer, laid out [K][columns] so the expansion is a
// straight copy of each tile's 16-wide rows. Against converting the whole weight per call
// (unpack, then .float(): two fresh copies the size of the weight, ~13% of a 512-token
// prefill's matmul time here) the chunk is expanded into cache and multiplied at once, and the
// bias and the conversion of the output happen on the chunk too. fp32 accumulation; x bf16 or
// float32; y float32 when fp32_out, else x's dtype.
at::Tensor linear_bf16_gemm(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                            const std::optional<at::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(wpacked.dim() == 3 && wpacked.size(2) == TILE &&
                  wpacked.scalar_type() == at::kBFloat16 && wpacked.is_contiguous(),
              "packed weight must be a contiguous [N/16, K, 16] bf16 tensor");
  const int64_t K = wpacked.size(1), tiles = wpacked.size(0);
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight expects ", K);
  TORCH_CHECK(N > 0 && tiles * TILE >= N && (tiles - 1) * TILE < N,
              "N=", N, " does not match the packed weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_bf16_gemm: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(K <= std::numeric_limits<int>::max() && N <= std::numeric_limits<int>::max(),
              "linear_bf16_gemm: K and N must fit the BLAS's int");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " entries");
    b = bias->to(at::kFloat).contiguous();
  }
  const auto xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  const bool f32 = fp32_out || x.scalar_type() == at::kFloat;
  auto y = at::empty({M, N}, x.options().dtype(f32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return y.view(out_sizes);
  TORCH_CHECK(M <= std::numeric_limits<int>::max(), "linear_bf16_gemm: too many rows");
  const float* xp = xf.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const auto* wp = reinterpret_cast<const uint16_t*>(wpacked.data_ptr());
  float* yf = f32 ? y.data_ptr<float>() : nullptr;
  auto* yh = f32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr());
  constexpr int64_t GEMM_TILES = 6;  // 96 columns: SmolLM2's 576 in six even chunks
  const int64_t chunks = (tiles + GEMM_TILES - 1) / GEMM_TILES;
  std::atomic<int64_t> next{0};  // chunks handed out one at a time (as dynamic_for)
  const int64_t threads = std::min<int64_t>(chunks, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // uninitialized: every element read is written first
    const std::unique_ptr<float[]> wf(new float[GEMM_TILES * TILE * K]);
    const bool direct = f32 && !bp;  // sgemm writes y itself
    const std::unique_ptr<float[]> yc(direct ? nullptr : new float[M * GEMM_TILES * TILE]);
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      const int64_t t0 = c * GEMM_TILES, nt = std::min(GEMM_TILES, tiles - t0);
      const int64_t ld = nt * TILE, n0 = t0 * TILE, cols = std::min(ld, N - n0);
      for (int64_t k = 0; k < K; ++k)
        for (int64_t t = 0; t < nt; ++t)
          for (int j = 0; j < TILE; j += VL)
            store(wf.get() + k * ld + t * TILE + j, load_bf16(wp + ((t0 + t) * K + k) * TILE + j));
      // column-major BLAS: C [cols, M] = A [cols, K] (wf, lda ld) x B [K, M] (x's rows)
      float* cp = direct ? yf + n0 : yc.get();
      sgemm(cols, M, K, wf.get(), ld, xp, cp, direct ? N : cols);
      if (direct) continue;
      for (int64_t r = 0; r < M; ++r) {
        const float* src = yc.get() + r * cols;
        if (f32) {
          float* dst = yf + r * N + n0;
          for (int64_t i = 0; i < cols; ++i) dst[i] = src[i] + bp[n0 + i];
        } else {
          uint16_t* dst = yh + r * N + n0;
          int64_t i = 0;
          for (; i + VL <= cols; i += VL) {
            vf v = load(src + i);
            if (bp) v += load(bp + n0 + i);
            store_bf16(dst + i, v);
          }
          for (; i < cols; ++i) dst[i] = float_to_bf16(src[i] + (bp ? bp[n0 + i] : 0.f));
        }
      }
    }
  });
  return y.view(out_sizes);
}

// fp32 logits from a bf16 matmul's y [R, V] (oneDNN has no fp32 output for bf16 inputs): each
// row converted (plus bias), its k largest found in the same pass (a threshold that only the
// rare larger entries cross) and recomputed from x [R, K] and w [V, K] with fp32 accumulation,
// so the greedy pick and the top logprobs are not bf16 ties. Ties at the k-th value keep the
// earliest entries.
at::Tensor rescore_logits(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& bias, int64_t k) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && w.dim() == 2, "y, x and w must be 2-D");
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 &&
                  w.scalar_type() == at::kBFloat16,
              "rescore_logits: y, x and w must be bfloat16");
  const int64_t R = y.size(0), V = y.size(1), K = x.size(1);
  TORCH_CHECK(x.size(0) == R && w.size(0) == V && w.size(1) == K, "y [R, V], x [R, K] and ",
              "w [V, K] disagree");
  TORCH_CHECK(k >= 1 && k <= 64 && k <= V, "k must be in [1, min(64, V)]");
  auto yc = y.contiguous(), xc = x.contiguous(), wc = w.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == V, "bias must have ", V, " entries");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto out = at::empty({R, V}, y.options().dtype(at::kFloat));
  const auto* yp = reinterpret_cast<const uint16_t*>(yc.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> val(k);
    std::vector<int64_t> idx(k);
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* yr = yp + r * V;
      float* o = op + r * V;
      int64_t n = 0, low = 0;  // entries kept; the smallest kept one
      float thr = -std::numeric_limits<float>::infinity();
      auto offer = [&](int64_t i, float v) {
        if (n < k) {
          val[n] = v;
          idx[n++] = i;
          if (n < k) return;
        } else {
          val[low] = v;
          idx[low] = i;
        }
        low = 0;  // the smallest kept entry, the latest among equals (the one to drop)
        for (int64_t t = 1; t < k; ++t)
          if (val[t] < val[low] || (val[t] == val[low] && idx[t] > idx[low])) low = t;
        thr = val[low];
      };
      int64_t i = 0;
      for (; i + VL <= V; i += VL) {
        vf v = load_bf16(yr + i);
        if (bp) v += load(bp + i);
        store(o + i, v);
        if (n < k || hmax(v) > thr) {
          for (int j = 0; j < VL; ++j)
            if (v[j] > thr || n < k) offer(i + j, v[j]);
        }
      }
      for (; i < V; ++i) {
        const float v = bf16_to_float(yr[i]) + (bp ? bp[i] : 0.f);
        o[i] = v;
        if (v > thr || n < k) offer(i, v);
      }
      const uint16_t* xr = xp + r * K;
      for (int64_t t = 0; t < n; ++t) {
        const uint16_t* wr = wp + idx[t] * K;
        vf a0{}, a1{};
        int64_t d = 0;
        for (; d + 2 * VL <= K; d += 2 * VL) {
          a0 += load_bf16(xr + d) * load_bf16(wr + d);
          a1 += load_bf16(xr + d + VL) * load_bf16(wr + d + VL);
        }
        for (; d + VL <= K; d += VL) a0 += load_bf16(xr + d) * load_bf16(wr + d);
        float sum = hsum(a0 + a1);
        for (; d < K; ++d) sum += bf16_to_float(xr[d]) * bf16_to_float(wr[d]);
        o[idx[t]] = sum + (bp ? bp[idx[t]] : 0.f);
      }
    }
  });
  return out;
}

}  // namespace ff
