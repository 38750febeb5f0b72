// Causal attention of a prompt (or prompt chunk) on AMX tiles: bf16 queries [T, H, D] over
// keys and values [S, KVH, D] (the cached context first, then the chunk's own: query t sees
// keys 0 .. S - T + t), flash-attention style.
//
// An item is 16 query rows of the query heads that share a KV head (up to 3 at a time), and
// everything runs transposed, keys down the tiles and the item's 16 queries across them:
// scores S^T = K Q^T (K's rows tile-loaded once for the item's heads, Q^T packed once per
// item), so each key's 16 scores are one vector and the online softmax is all vertical (the
// running max, the exponentials and the sums lane by lane, one rescaling factor per query as
// one vector: no reduction across lanes); the weights P^T go back as a B tile (key pairs
// interleaved) and O^T = V^T P^T (V^T packed once per KV head) is added into fp32
// accumulators [D][16] rescaled by that vector. The heads' chains (tiles to memory to vectors
// and back) are independent, so they overlap. The weights are rounded to bf16 (the row sums
// add the rounded ones, through vdpbf16ps), so their exponential needs only a degree-4
// polynomial.
//
// Q^T, V^T and the output are transposed 16 x 16 (32-bit lanes) in registers. The prompts of
// a step go in one call (paged_prefill_attention_amx), their keys read from the block-paged
// cache through the block tables.
//
// Against PyTorch's CPU flash attention (AMX Xeon, 2 threads, SmolLM2's 9 heads over 3 KV
// heads, a throwaway timing script), a layer: 512 fresh tokens 0.40-0.56 vs 0.80-0.99 ms,
// 2,048 5.3 vs 8.7, 1,952 tokens over 4,000 keys 14.9 vs 35.4 (masked) or 28.5 (two calls
// merged), 20 prompts of 100 tokens 0.83 vs 1.50.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "prompts.h"
#include "vec.h"

namespace ff {

#ifdef FF_AMX
namespace {

constexpr int64_t TR = 16;     // query rows per item, keys per score tile, dims per P V tile
constexpr int64_t KS = 32;     // keys per step (one P tile's K), dims per Q K^T tile
constexpr int64_t TILE = 512;  // bf16 of one tile
constexpr int64_t D_MAX = 256;

// One KV head's K as contiguous rows [Sp][D] (zero past S) for A tiles of 16 keys, and V^T
// as A tiles of P V: vt[vb][n] = 16 dims (16n + d) x 32 keys (32vb + j), zero past S. A V^T
// tile is 16 key pairs (one 32-bit lane each: the pair's two values of a dimension) by 16
// dimensions, transposed in registers. rows(k0, n, kr, vr): the K and V rows of keys k0 .. k0 + n.
template <typename Rows>
void pack_head(Rows rows, int64_t S, int64_t D, uint16_t* kpad, uint16_t* vt) {
  const int64_t vbs = (S + KS - 1) / KS, ns = D / TR;
  const __m256i none = _mm256_setzero_si256();
  const uint16_t* kr[KS];
  const uint16_t* vr[KS];
  for (int64_t vb = 0; vb < vbs; ++vb) {
    const int64_t k0 = vb * KS, n = std::min(KS, S - k0);
    rows(k0, n, kr, vr);
    for (int64_t j = 0; j < KS; ++j) {
      if (j < n) std::memcpy(kpad + (k0 + j) * D, kr[j], D * sizeof(uint16_t));
      else std::memset(kpad + (k0 + j) * D, 0, D * sizeof(uint16_t));
    }
    auto dims = [&](int64_t j, int64_t c) {  // key k0 + j's 16 values of dims 16c .., zero past S
      return j < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr[j] + c * TR)) : none;
    };
    for (int64_t c = 0; c < ns; ++c) {
      __m512i r[TR];  // r[pair] lane d: (v[2 pair][d], v[2 pair + 1][d])
      for (int64_t jp = 0; jp < TR; ++jp)
        r[jp] = _mm512_or_si512(_mm512_cvtepu16_epi32(dims(2 * jp, c)),
                                _mm512_slli_epi32(_mm512_cvtepu16_epi32(dims(2 * jp + 1, c)), 16));
      transpose16(r);
      uint16_t* t = vt + (vb * ns + c) * TILE;
      for (int64_t d = 0; d < TR; ++d) _mm512_storeu_si512(t + d * KS, r[d]);
    }
  }
}

// 2^x lane by lane for the softmax weights, which are rounded to bf16 (2^-9) right after: a
// degree-4 polynomial for 2^f on [-1/2, 1/2] (relative error ~4e-5), and vscalefps for 2^n,
// which gives exactly 0 for -inf (masked keys).
inline __m512 exp2_weights(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(0.0096181291f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265070f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471806f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GT_OQ);
  return _mm512_maskz_scalef_ps(finite, p, n);
}

struct Shapes {
  int64_t T, S, H, KVH, D;
  float scale;
};

constexpr int64_t GMAX = 3;  // query heads of one KV head per item (tiles: G C + 1 A + G B)

// One item: rows t0 .. t0 + 16 of heads h0 .. h0 + G, which share a KV head (kpad, vt: its
// packed K and V^T): the K and V^T tiles are loaded once for all G, and the G heads' chains
// (AMX tiles to memory to vectors and back) are independent, so they overlap.
void attend(const Shapes& g, const uint16_t* q, const uint16_t* kpad, const uint16_t* vt,
            int64_t h0, int64_t G, int64_t t0, uint16_t* out) {
  const int64_t D = g.D, rows = std::min(TR, g.T - t0), cs = D / KS, ns = D / TR;
  alignas(64) uint16_t qt[GMAX][D_MAX / KS][TILE];  // Q^T as B tiles: dim pairs x 16 queries
  alignas(64) uint16_t pt[GMAX][TILE];              // P^T as B tiles: key pairs x 16 queries
  alignas(64) float sbuf[GMAX][KS][TR];             // S^T: 32 keys x 16 queries
  alignas(64) float cbuf[GMAX][TR][TR];
  alignas(64) float acc[GMAX][D_MAX][TR];  // O^T
  for (int64_t gi = 0; gi < G; ++gi) {  // Q^T: tile row p holds dim pair p of the 16 queries
    std::memset(acc[gi], 0, sizeof(float) * TR * D);
    for (int64_t c = 0; c < cs; ++c) {
      __m512i r[TR];
      for (int64_t qi = 0; qi < TR; ++qi)
        r[qi] = qi < rows ? _mm512_loadu_si512(q + ((t0 + qi) * g.H + h0 + gi) * D + c * KS)
                          : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t p = 0; p < TR; ++p) _mm512_store_si512(qt[gi][c] + p * 2 * TR, r[p]);
    }
  }
  const int64_t offset = g.S - g.T;          // query t sees keys up to offset + t
  const int64_t k_end = offset + t0 + rows;  // keys any row of the item sees
  const __m512i last = _mm512_add_epi32(  // each lane's last key
      _mm512_set1_epi32(int(offset + t0)),
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  const __m512 scale = _mm512_set1_ps(g.scale * 1.4426950408889634f);  // scores in log2 units
  __m512 m[GMAX], l[GMAX];
  for (int64_t gi = 0; gi < GMAX; ++gi) m[gi] = ninf, l[gi] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < k_end; k0 += KS) {
    for (int64_t half = 0; half < 2 && k0 + half * TR < k_end; ++half) {
      // S^T of keys k0 + 16 half .. + 16, head gi in tile gi
      _tile_zero(0);
      if (G > 1) _tile_zero(1);
      if (G > 2) _tile_zero(2);
      for (int64_t c = 0; c < cs; ++c) {
        _tile_loadd(3, kpad + (k0 + half * TR) * D + c * KS, D * 2);
        _tile_loadd(4, qt[0][c], 64);
        _tile_dpbf16ps(0, 3, 4);
        if (G > 1) {
          _tile_loadd(5, qt[1][c], 64);
          _tile_dpbf16ps(1, 3, 5);
        }
        if (G > 2) {
          _tile_loadd(6, qt[2][c], 64);
          _tile_dpbf16ps(2, 3, 6);
        }
      }
      _tile_stored(0, sbuf[0][half * TR], 64);
      if (G > 1) _tile_stored(1, sbuf[1][half * TR], 64);
      if (G > 2) _tile_stored(2, sbuf[2][half * TR], 64);
    }
    const int64_t keys = std::min(KS, k_end - k0);  // the rest of the 32 see nothing
    __m512 alpha[GMAX];
    for (int64_t gi = 0; gi < G; ++gi) {
      __m512 mx = m[gi];
      for (int64_t j = 0; j < KS; ++j) {  // scaled, masked scores; their max per query
        const __mmask16 see = j < keys ? _mm512_cmpge_epi32_mask(last, _mm512_set1_epi32(int(k0 + j))) : 0;
        const __m512 sj = _mm512_mask_mul_ps(ninf, see, _mm512_load_ps(sbuf[gi][j]), scale);
        _mm512_store_ps(sbuf[gi][j], sj);
        mx = _mm512_max_ps(mx, sj);
      }
      // key 0 is seen by every query, so mx is finite from the first step on
      alpha[gi] = exp2_weights(_mm512_sub_ps(m[gi], mx));
      m[gi] = mx;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < KS; j += 2) {  // weights as bf16 key pairs, and their sum
        const __m512 p0 = exp2_weights(_mm512_sub_ps(_mm512_load_ps(sbuf[gi][j]), mx));
        const __m512 p1 = exp2_weights(_mm512_sub_ps(_mm512_load_ps(sbuf[gi][j + 1]), mx));
        const __m512i w = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        _mm512_store_si512(pt[gi] + j * TR, w);
        sum = _mm512_dpbf16_ps(sum, (__m512bh)w, ones);  // the rounded weights, exactly
      }
      l[gi] = _mm512_fmadd_ps(l[gi], alpha[gi], sum);
    }
    _tile_loadd(4, pt[0], 64);
    if (G > 1) _tile_loadd(5, pt[1], 64);
    if (G > 2) _tile_loadd(6, pt[2], 64);
    for (int64_t n = 0; n < ns; ++n) {
      _tile_loadd(3, vt + (k0 / KS * ns + n) * TILE, 64);
      _tile_zero(0);
      _tile_dpbf16ps(0, 3, 4);
      if (G > 1) {
        _tile_zero(1);
        _tile_dpbf16ps(1, 3, 5);
      }
      if (G > 2) {
        _tile_zero(2);
        _tile_dpbf16ps(2, 3, 6);
      }
      _tile_stored(0, cbuf[0], 64);
      if (G > 1) _tile_stored(1, cbuf[1], 64);
      if (G > 2) _tile_stored(2, cbuf[2], 64);
      for (int64_t gi = 0; gi < G; ++gi)
        for (int64_t d = 0; d < TR; ++d) {
          float* a = acc[gi][n * TR + d];
          _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), alpha[gi],
                                             _mm512_load_ps(cbuf[gi][d])));
        }
    }
  }
  for (int64_t gi = 0; gi < G; ++gi) {  // O = (O^T / l)^T, 16 dims at a time
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l[gi]);
    for (int64_t n = 0; n < ns; ++n) {
      __m512i r[TR];
      for (int64_t d = 0; d < TR; ++d)
        r[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(acc[gi][n * TR + d]), inv));
      transpose16(r);
      for (int64_t qi = 0; qi < rows; ++qi) {
        uint16_t* o = out + ((t0 + qi) * g.H + h0 + gi) * D + n * TR;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[qi])));
      }
    }
  }
}

// The prompts of a step (schedule_prompts): sequence b's queries are rows qs[b] .. qs[b + 1]
// of q [T, H, D] and its keys 0 .. S[b] (the last qs[b + 1] - qs[b] its own); pack(b, h, kpad,
// vt) packs its KV head h.
template <typename Pack>
void attend_prompts(const uint16_t* qp, uint16_t* op, int64_t H, int64_t KVH, int64_t D,
                    float scale, const std::vector<int64_t>& qs, const std::vector<int64_t>& S,
                    Pack&& pack) {
  auto k_size = [&](int64_t b) { return (S[b] + KS - 1) / KS * KS * D; };
  const int64_t group = H / KVH;
  schedule_prompts<uint16_t>(
      H, KVH, GMAX, TR, qs, S, [&](int64_t b) { return 2 * k_size(b); },  // K, then V^T
      [&](int64_t b, int64_t h, uint16_t* buf) { pack(b, h, buf, buf + k_size(b)); },
      [&](int64_t b, int64_t h, int64_t c0, int64_t t0, const uint16_t* kpad) {
        const Shapes g{qs[b + 1] - qs[b], S[b], H, KVH, D, scale};
        attend(g, qp + qs[b] * H * D, kpad, kpad + k_size(b), h * group + c0,
               std::min(GMAX, group - c0), t0, op + qs[b] * H * D);
      },
      [](auto&& body) {
        amx::configure_tiles();
        body();
        _tile_release();
      });
}

}  // namespace
#endif

bool prefill_attention_amx_native(int64_t head_dim) {
#ifdef FF_AMX
  return amx::permitted() && head_dim % KS == 0 && head_dim <= D_MAX;
#else
  (void)head_dim;
  return false;
#endif
}

// Checks shared by both ops: bf16, [T, H, D] queries, GQA, a head dim the tiles take.
static void check_prompt_queries(const at::Tensor& q, int64_t KVH) {
  TORCH_CHECK(q.dim() == 3, "q must be [T, H, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "prefill_attention_amx takes bf16 q, k, v");
  TORCH_CHECK(KVH > 0 && q.size(1) % KVH == 0, "heads ", q.size(1), " / KV heads ", KVH,
              " mismatch");
  TORCH_CHECK(prefill_attention_amx_native(q.size(2)), "prefill_attention_amx: needs AMX and a "
              "head_dim that is a multiple of 32 up to 256, got ", q.size(2));
}

// out [T, H, D] = causal attention of q [T, H, D] over k, v [S, KVH, D] (S >= T: the last T
// keys are the queries' own), all bf16.
at::Tensor prefill_attention_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "q must be [T, H, D], k and v [S, KVH, D]");
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prefill_attention_amx takes bf16 q, k, v");
  TORCH_CHECK(k.size(2) == q.size(2), "head_dim of q and k differ");
  check_prompt_queries(q, k.size(1));
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = k.size(0), KVH = k.size(1);
  TORCH_CHECK(S >= T, "fewer keys (", S, ") than queries (", T, ")");
#ifdef FF_AMX
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = at::empty_like(qc);
  if (T == 0) return out;
  const auto* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  attend_prompts(reinterpret_cast<const uint16_t*>(qc.data_ptr()),
                 reinterpret_cast<uint16_t*>(out.data_ptr()), H, KVH, D, float(scale), {0, T},
                 {S}, [&](int64_t, int64_t h, uint16_t* kpad, uint16_t* vt) {
                   pack_head([&](int64_t k0, int64_t n, const uint16_t** kr, const uint16_t** vr) {
                     for (int64_t j = 0; j < n; ++j) {
                       const int64_t o = ((k0 + j) * KVH + h) * D;
                       kr[j] = kp + o;
                       vr[j] = vp + o;
                     }
                   }, S, D, kpad, vt);
                 });
  return out;
#else
  return at::Tensor();
#endif
}

// The prompt chunks of a step over the block-paged cache [2, NB, BS, KVH, D] (bf16; this
// step's keys and values already written): sequence b's queries are rows query_start_loc[b] ..
// query_start_loc[b + 1] of q, the last of its seq_lens[b] keys, which are read in place through
// its row of block_tables (its cached context first). The same attention as
// prefill_attention_amx over each sequence's keys, bit for bit.
at::Tensor paged_prefill_attention_amx(const at::Tensor& q, const at::Tensor& kv_cache,
                                       const at::Tensor& block_tables,
                                       const at::Tensor& query_start_loc,
                                       const at::Tensor& seq_lens, double scale) {
  const PromptBatch batch(q, kv_cache, block_tables, query_start_loc, seq_lens,
                          "paged_prefill_attention_amx");
  TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16,
              "paged_prefill_attention_amx: kv_cache must be bf16");
  check_prompt_queries(q, kv_cache.size(3));
#ifdef FF_AMX
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  if (q.size(0) == 0) return out;
  const int64_t H = q.size(1), D = q.size(2), KVH = kv_cache.size(3);
  const auto* cp = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr());
  attend_prompts(reinterpret_cast<const uint16_t*>(qc.data_ptr()),
                 reinterpret_cast<uint16_t*>(out.data_ptr()), H, KVH, D, float(scale), batch.qs,
                 batch.S, [&](int64_t b, int64_t h, uint16_t* kpad, uint16_t* vt) {
                   pack_head(batch.rows(cp, KVH, D, b, h), batch.S[b], D, kpad, vt);
                 });
  return out;
#else
  return at::Tensor();
#endif
}

}  // namespace ff
