// Causal attention of a step's prompts (or prompt chunks) on AVX-512 float32 FMAs: the CPUs
// without AMX. Queries [T, H, D] over keys and values [S, KVH, D] read from the block-paged
// cache (the cached context first, then the chunk's own: query t sees keys 0 .. S - T + t),
// flash-attention style, bf16 or float32 in and out, float32 throughout.
//
// As the AMX kernel (attention_amx.cpp), everything runs transposed: an item is 16 query rows
// of up to 3 query heads that share a KV head, the 16 queries across the lanes, so each key's
// 16 scores are one vector and the online softmax is vertical (running max, exponentials and
// sums lane by lane, one rescaling vector per head: no reduction across lanes). Scores S^T =
// K Q^T take 8 keys x the item's heads per pass over the dimensions (a broadcast key element
// times a Q^T row), O^T += V^T P^T 8 dimensions x the heads per pass over the keys (a broadcast
// value times a P^T row): 24 accumulators and one load per FMA or fewer. A (sequence, KV head)
// group's keys and values are converted to float32 once, into the thread's buffer
// (schedule_prompts in prompts.h hands out the work).
//
// Against PyTorch's CPU flash attention (the path these CPUs took before; Xeon without
// AVX512-BF16, 2 threads, SmolLM2's 9 heads over 3 KV heads, a throwaway timing script,
// alternating), a layer of 512 fresh tokens: bf16 1.68-1.86 ms against 4.19-4.23, float32
// 1.57-1.74 against 3.73-4.02.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "ops.h"
#include "prompts.h"
#include "vec.h"

namespace ff {

#if defined(__AVX512F__)
namespace {

constexpr int64_t QB = 16;    // queries per item: the lanes
constexpr int64_t KB = 16;    // keys per softmax step
constexpr int64_t JB = 8;     // keys per pass of the scores
constexpr int64_t DB = 8;     // dimensions per pass of P V
constexpr int64_t GMAX = 3;   // query heads per item
constexpr int64_t D_MAX = 256;

// A (sequence, KV head) group's keys and values as float32 rows [Sp][D], zero past S (Sp: S
// rounded up to KB): the scores of keys past S are masked, and a zero value times a zero weight
// stays zero.
template <typename T, typename Rows>
void pack_head_f32(Rows rows, int64_t S, int64_t D, float* kf, float* vf_) {
  const T* kr[KB];
  const T* vr[KB];
  for (int64_t k0 = 0; k0 < S; k0 += KB) {
    const int64_t n = std::min(KB, S - k0);
    rows(k0, n, kr, vr);
    for (int64_t j = 0; j < KB; ++j) {
      float* kd = kf + (k0 + j) * D;
      float* vd = vf_ + (k0 + j) * D;
      for (int64_t d = 0; d < D; d += VL) {
        store(kd + d, j < n ? ldv(kr[j] + d) : vf{});
        store(vd + d, j < n ? ldv(vr[j] + d) : vf{});
      }
    }
  }
}

struct Shapes {
  int64_t T, S, H, D;
  float scale;
};

// One item: rows t0 .. t0 + 16 of heads h0 .. h0 + G, which share a KV head (kf, vf_: its
// keys and values in float32).
template <int G, typename T>
void attend(const Shapes& g, const T* q, const float* kf, const float* vf_, int64_t h0,
            int64_t t0, T* out) {
  const int64_t D = g.D, rows = std::min(QB, g.T - t0);
  alignas(64) float qt[G][D_MAX][QB];   // Q^T, scaled
  alignas(64) float pt[G][KB][QB];      // S^T, then P^T
  alignas(64) float acc[G][D_MAX][QB];  // O^T
  for (int gi = 0; gi < G; ++gi) {
    std::memset(acc[gi], 0, sizeof(float) * QB * D);
    for (int64_t c = 0; c < D; c += 16) {
      __m512i r[16];
      for (int64_t qi = 0; qi < 16; ++qi) {
        const vf x = qi < rows ? ldv(q + ((t0 + qi) * g.H + h0 + gi) * D + c) * g.scale : vf{};
        r[qi] = reinterpret_cast<const __m512i&>(x);
      }
      transpose16(r);
      for (int64_t p = 0; p < 16; ++p) _mm512_store_si512(qt[gi][c + p], r[p]);
    }
  }
  const int64_t offset = g.S - g.T;          // query t sees keys up to offset + t
  const int64_t k_end = offset + t0 + rows;  // keys any row of the item sees
  const __m512i last = _mm512_add_epi32(  // each lane's last key
      _mm512_set1_epi32(int(offset + t0)),
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  const float inf = std::numeric_limits<float>::infinity();
  vf m[G], l[G];
  for (int gi = 0; gi < G; ++gi) m[gi] = splat(-inf), l[gi] = vf{};
  for (int64_t k0 = 0; k0 < k_end; k0 += KB) {
    const int64_t keys = std::min(KB, k_end - k0);  // the rest of the 16 see nothing
    for (int64_t j0 = 0; j0 < keys; j0 += JB) {  // S^T rows j0 .. j0 + 8
      vf s[G][JB];
      for (int gi = 0; gi < G; ++gi)
        for (int64_t j = 0; j < JB; ++j) s[gi][j] = vf{};
      const float* kr = kf + (k0 + j0) * D;
      for (int64_t d = 0; d < D; ++d) {
        vf qd[G];
        for (int gi = 0; gi < G; ++gi) qd[gi] = load(qt[gi][d]);
        for (int64_t j = 0; j < JB; ++j) {
          const vf kj = splat(kr[j * D + d]);
          for (int gi = 0; gi < G; ++gi) s[gi][j] += kj * qd[gi];
        }
      }
      for (int gi = 0; gi < G; ++gi)
        for (int64_t j = 0; j < JB; ++j) store(pt[gi][j0 + j], s[gi][j]);
    }
    vf alpha[G];
    for (int gi = 0; gi < G; ++gi) {
      vf mx = m[gi];
      for (int64_t j = 0; j < keys; ++j) {  // masked scores; their max per query
        const __mmask16 see = _mm512_cmpge_epi32_mask(last, _mm512_set1_epi32(int(k0 + j)));
        const __m512 sj = _mm512_mask_mov_ps(_mm512_set1_ps(-inf), see, _mm512_load_ps(pt[gi][j]));
        _mm512_store_ps(pt[gi][j], sj);
        mx = _mm512_max_ps(reinterpret_cast<const __m512&>(mx), sj);
      }
      // key 0 is seen by every query, so mx is finite from the first step on
      alpha[gi] = vexp(m[gi] - mx);
      m[gi] = mx;
      vf sum{};
      for (int64_t j = 0; j < keys; ++j) {
        const vf p = vexp(load(pt[gi][j]) - mx);
        store(pt[gi][j], p);
        sum += p;
      }
      l[gi] = l[gi] * alpha[gi] + sum;
    }
    const float* vr = vf_ + k0 * D;
    for (int64_t d0 = 0; d0 < D; d0 += DB) {  // O^T rows d0 .. d0 + 8
      vf a[G][DB];
      for (int gi = 0; gi < G; ++gi)
        for (int64_t d = 0; d < DB; ++d) a[gi][d] = load(acc[gi][d0 + d]) * alpha[gi];
      for (int64_t j = 0; j < keys; ++j) {
        vf pj[G];
        for (int gi = 0; gi < G; ++gi) pj[gi] = load(pt[gi][j]);
        for (int64_t d = 0; d < DB; ++d) {
          const vf vd = splat(vr[j * D + d0 + d]);
          for (int gi = 0; gi < G; ++gi) a[gi][d] += vd * pj[gi];
        }
      }
      for (int gi = 0; gi < G; ++gi)
        for (int64_t d = 0; d < DB; ++d) store(acc[gi][d0 + d], a[gi][d]);
    }
  }
  for (int gi = 0; gi < G; ++gi) {  // O = (O^T / l)^T, 16 dims at a time
    const vf inv = 1.f / l[gi];
    for (int64_t c = 0; c < D; c += 16) {
      __m512i r[16];
      for (int64_t d = 0; d < 16; ++d) {
        const vf x = load(acc[gi][c + d]) * inv;
        r[d] = reinterpret_cast<const __m512i&>(x);
      }
      transpose16(r);
      for (int64_t qi = 0; qi < rows; ++qi)
        stv(out + ((t0 + qi) * g.H + h0 + gi) * D + c, reinterpret_cast<const vf&>(r[qi]));
    }
  }
}

template <typename T>
void attend_batch(const at::Tensor& q, const at::Tensor& kv_cache, const PromptBatch& batch,
                  float scale, at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), KVH = kv_cache.size(3);
  const auto* qp = reinterpret_cast<const T*>(q.data_ptr());
  auto* op = reinterpret_cast<T*>(out.data_ptr());
  const auto* cp = reinterpret_cast<const T*>(kv_cache.data_ptr());
  const auto& qs = batch.qs;
  const auto& S = batch.S;
  auto k_size = [&](int64_t b) { return (S[b] + KB - 1) / KB * KB * D; };
  const int64_t group = H / KVH;
  schedule_prompts<float>(
      H, KVH, GMAX, QB, qs, S, [&](int64_t b) { return 2 * k_size(b); },  // K, then V
      [&](int64_t b, int64_t h, float* buf) {
        pack_head_f32<T>(batch.rows(cp, KVH, D, b, h), S[b], D, buf, buf + k_size(b));
      },
      [&](int64_t b, int64_t h, int64_t c0, int64_t t0, const float* kf) {
        const Shapes g{qs[b + 1] - qs[b], S[b], H, D, scale};
        const T* qb = qp + qs[b] * H * D;
        T* ob = op + qs[b] * H * D;
        const float* vb = kf + k_size(b);
        switch (std::min(GMAX, group - c0)) {
          case 1: attend<1>(g, qb, kf, vb, h * group + c0, t0, ob); break;
          case 2: attend<2>(g, qb, kf, vb, h * group + c0, t0, ob); break;
          default: attend<3>(g, qb, kf, vb, h * group + c0, t0, ob); break;
        }
      },
      [](auto&& body) { body(); });
}

}  // namespace
#endif

bool prefill_attention_f32_native(int64_t head_dim) {
#if defined(__AVX512F__)
  return head_dim % 16 == 0 && head_dim <= D_MAX;
#else
  (void)head_dim;
  return false;
#endif
}

// The prompt chunks of a step over the block-paged cache [2, NB, BS, KVH, D] (this step's keys
// and values already written), q [T, H, D] and the cache both bf16 or both float32: sequence
// b's queries are rows query_start_loc[b] .. query_start_loc[b + 1] of q, the last of its
// seq_lens[b] keys, which are read in place through its row of block_tables.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                   const at::Tensor& block_tables,
                                   const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                   double scale) {
  const PromptBatch batch(q, kv_cache, block_tables, query_start_loc, seq_lens,
                          "paged_prefill_attention");
  TORCH_CHECK((q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat) &&
                  kv_cache.scalar_type() == q.scalar_type(),
              "paged_prefill_attention: q and kv_cache must be both bf16 or both float32, got ",
              q.scalar_type(), " and ", kv_cache.scalar_type());
  TORCH_CHECK(prefill_attention_f32_native(q.size(2)), "paged_prefill_attention: needs AVX-512 "
              "and a head_dim that is a multiple of 16 up to 256, got ", q.size(2));
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  if (q.size(0) == 0) return out;
#if defined(__AVX512F__)
  if (q.scalar_type() == at::kFloat) attend_batch<float>(qc, kv_cache, batch, float(scale), out);
  else attend_batch<uint16_t>(qc, kv_cache, batch, float(scale), out);
#endif
  return out;
}

}  // namespace ff
