// The decoder stack of a Llama-family model run in one call per step: for each layer RMSNorm,
// fused qkv, RoPE in place, the KV write, paged attention, o, residual, RMSNorm, fused
// gate/up, gated activation, down, residual -- the same kernels in the same order as the
// Python modules (fastforward/models/llama.py), without the ~25 Python-dispatched ops per layer
// between them. Built once from the loaded model (fastforward/kernels/decoder.py); the Python
// path stays the reference and the fallback for what this does not cover (prefills longer than
// the attention kernel takes, q/k norms, other weight formats).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"

namespace ff {
namespace {

// How a linear layer multiplies (the Python module it mirrors in parentheses).
enum LinearKind : int64_t {
  kBf16 = 0,  // packed bf16 tiles, dense copy for large batches (kernels/linear.py PackedLinear)
  kQ4 = 1,    // 4-bit codes through a 16-entry table (quant/int4.py, quant/codebook.py)
  kInt8 = 2,  // int8 codes, one scale per output row (quant/int8.py Int8Linear; ATen's layout,
              // or blocks of 16 rows for linear_i8_rows)
  kDense = 3,  // a plain weight in the activations' dtype (nn.Linear: float32 engines)
  kQ5 = 4,     // 5-bit codes, float16 group scales (quant/int5.py Int5Linear)
  kConcat = 5,  // parts side by side, one bias (quant/base.py ConcatLinear; add_concat)
  kI8G = 6,     // int8 codes, float32 scales per group of inputs (quant/int8.py Int8GroupLinear)
};

// x @ W^T through oneDNN with W already in its blocked layout (mkldnn::_reorder_linear_weight,
// kernels/linear.py): the same numbers as at::linear on the plain weight, without reordering
// the weight on every call.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, c10::IValue(), std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Rows up to which the AMX tiles take a bf16 linear layer (kernels/linear.py AMX_ROWS_MAX).
constexpr int64_t kAmxRowsMax = 512;

struct Linear {
  int64_t kind = kBf16;
  at::Tensor w;      // packed weight (or the AMX tiles, where they are the only copy) / codes
  at::Tensor aux;    // kBf16: AMX tiles, oneDNN-blocked or dense copy (may be undefined); scales
  at::Tensor table;  // kQ4: the 16 levels
  int64_t n = 0;     // output features
  int64_t group = 0;
  int64_t rows_max = 0;  // batches up to this many rows run the packed kernel
  std::optional<at::Tensor> bias;
  std::vector<Linear> parts;  // kConcat
  Q4Table q4{};               // kQ4: the table, read and checked when the layer is added

  at::Tensor operator()(const at::Tensor& x) const {
    const int64_t rows = x.size(0);
    if (kind == kDense) return at::linear(x, w, bias);
    if (kind == kConcat) {
      std::vector<at::Tensor> ys;
      for (const auto& p : parts) ys.push_back(p(x));
      auto y = at::cat(ys, -1);
      if (bias) y = y + *bias;
      return y;
    }
    if (kind == kBf16) {
      if (packed_bf16(rows)) return linear_bf16(x, w, n, bias);
      if (tiles_bf16(rows)) return linear_amx(x, w, n, bias, false);
      // AMX tiles above kAmxRowsMax: oneDNN on the weight unpacked from the tiles
      auto y = aux.is_mkldnn()   ? onednn_linear(x.to(at::kBFloat16), aux)
               : w.dim() == 4 ? at::linear(x.to(at::kBFloat16), unpack_amx_weight(w, n, x.size(-1)))
                              : at::linear(x.to(at::kBFloat16), aux);
      if (bias) y = y + *bias;
      return y.to(x.scalar_type());
    }
    TORCH_CHECK(rows <= rows_max, "fused decoder: ", rows, " rows exceed the packed kernel's ",
                rows_max);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const auto xb = bf16 && x.is_contiguous() ? x : x.to(at::kBFloat16).contiguous();
    at::Tensor y;
    if (kind == kQ4 && !linear_q4_takes_amx(rows, q4)) {  // checked in add_linear
      y = at::empty({rows, n}, xb.options());
      q4_rows(xb, y);
    } else {
      y = kind == kQ4      ? linear_q4(xb, w, aux, table, group)  // on AMX tiles
          : kind == kQ5    ? linear_q5(xb, w, aux, group)
          : kind == kI8G   ? (bf16_tiles_native() ? linear_i8g_amx(xb, w, aux, group)
                                           : linear_i8g_rows(xb, w, aux, group))
          : w.dim() == 4 ? linear_i8_rows(xb, w, aux)  // codes in blocks of 16 rows
                         : at::_weight_int8pack_mm(xb, w, aux);
    }
    if (!bf16) y = y.to(x.scalar_type());
    if (bias) y = y + *bias;
    return y;
  }

  int64_t out_features() const { return kind == kDense ? w.size(0) : n; }

  // The same numbers written into y (contiguous [rows, n], x's dtype), where this layer's
  // kernel for x's rows can write in place: the packed bf16 and the 4-bit kernels. False
  // (y untouched) where it cannot; operator() then allocates.
  bool into(const at::Tensor& x, at::Tensor& y) const {
    const int64_t rows = x.size(0);
    if (kind == kBf16) {
      if (tiles_bf16(rows)) {
        linear_amx_out(x, w, n, bias, y);
        return true;
      }
      if (!packed_bf16(rows)) return false;
      linear_bf16_out(x, w, n, bias, y);
      return true;
    }
    if (kind != kQ4 || rows > rows_max || linear_q4_takes_amx(rows, q4) ||
        x.scalar_type() != at::kBFloat16 || !x.is_contiguous())
      return false;
    q4_rows(x, y);
    if (bias) y.add_(*bias);
    return true;
  }

 private:
  // kBf16: whether the packed kernel takes these rows (else the AMX tiles, the one copy where w
  // holds them, or the large-batch copy in aux).
  bool packed_bf16(int64_t rows) const {
    return w.dim() != 4 && (!aux.defined() || rows <= rows_max);
  }

  // kBf16: whether the tiles, the one copy (in w), take these rows (every batch without AMX,
  // up to kAmxRowsMax rows on AMX tiles).
  bool tiles_bf16(int64_t rows) const {
    return w.dim() == 4 && (rows <= kAmxRowsMax || !amx_native());
  }

  // kQ4 on the few-row kernel: xb bf16 [rows, K] into y [rows, n], without the bias.
  void q4_rows(const at::Tensor& xb, at::Tensor& y) const {
    TORCH_CHECK(xb.dim() == 2 && xb.size(1) == w.size(1) * 4, "fused decoder: x of ", xb.sizes(),
                " for a 4-bit linear of ", w.size(1) * 4, " inputs");
    linear_q4_out(xb, w, aux, q4, group, y);
  }
};

// A step of few tokens (decode) writes each layer's outputs into buffers kept between steps --
// the fused q/k/v projection (with its q, k and v views made once), o, the two norms, gate/up,
// the gated activation and down -- where the kernels can write in place (Linear::into), instead
// of allocating ~10 tensors and views a layer (~1 us an ATen op on the 2-core Xeon, more
// between the weight streams' cache misses). Layers run in turn, so one set serves them all.
// Up to 64 rows (~1 MB of buffers at SmolLM2's sizes), not only the few-token steps it began
// with: a batch-64 decode step's layers 54.4 -> 53.2 ms with the buffers, the same outputs
// (Zen 4 EPYC, 2 threads, modes alternating every two steps in one engine; with the attention
// items on steal_for as well 54.6 -> 51.8 in another run).
struct StepScratch {
  static constexpr int64_t kRowsMax = 64;
  int64_t t = -1, heads = 0, kv_heads = 0, head_dim = 0, hidden = 0, inter = 0;
  at::Tensor qkv, q, k, v;  // [t, (heads + 2 kv_heads) head_dim] and views
  at::Tensor a, h, h2, m;   // [t, hidden]: o's output, the two norms' outputs, down's output
  at::Tensor gu, act;       // [t, 2 inter], [t, inter]

  // The buffers for t tokens of layer L, with x's dtype and device (made again when any of
  // them changes).
  void fit(int64_t t_, const int64_t (&dims)[5], const at::Tensor& x) {
    if (t_ == t && dims[0] == heads && dims[1] == kv_heads && dims[2] == head_dim &&
        dims[3] == hidden && dims[4] == inter && qkv.scalar_type() == x.scalar_type() &&
        qkv.device() == x.device())
      return;
    t = t_, heads = dims[0], kv_heads = dims[1], head_dim = dims[2], hidden = dims[3];
    inter = dims[4];
    const int64_t qd = heads * head_dim, kd = kv_heads * head_dim;
    qkv = at::empty({t, qd + 2 * kd}, x.options());
    q = qkv.narrow(1, 0, qd).view({t, heads, head_dim});
    k = qkv.narrow(1, qd, kd).view({t, kv_heads, head_dim});
    v = qkv.narrow(1, qd + kd, kd).view({t, kv_heads, head_dim});
    for (auto* b : {&a, &h, &h2, &m}) *b = at::empty({t, hidden}, x.options());
    gu = at::empty({t, 2 * inter}, x.options());
    act = at::empty({t, inter}, x.options());
  }
};

struct Layer {
  at::Tensor ln1, ln2;
  at::Tensor q_norm, k_norm;  // Qwen3's RMSNorm over each head of q and k (may be undefined)
  double eps1 = 0, eps2 = 0, qk_eps = 0;
  Linear qkv, o, gate_up, down;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  at::Tensor rope_table;  // [positions, rotary_dim] fp32
  double scale = 0, softcap = 0;
  int64_t window = 0;  // 0: full attention
  at::Tensor kv_cache;
  std::optional<at::Tensor> kv_scales;
  // per-channel key scale (kv/calibrate.py): keys stored as k * key_mult [KVH, D], queries read
  // them as q * query_mult [H, D], both in fp32 (undefined: none)
  at::Tensor query_mult, key_mult;
  int64_t group = 0;  // KV cache group: which block tables and slot mapping
  bool gelu = false;
  // steps whose query runs are all longer than max_short tokens (prompt chunks only) go to a
  // prompt kernel (1: paged_prefill_attention, 2: paged_prefill_attention_amx; 0:
  // paged_attention takes them), over the cache itself, or an int8 cache's blocks they read
  // dequantized
  int64_t prompts = 0, max_short = 0;
};

// The blocks the sequences' keys fill, in table order (a block two sequences share comes
// twice), and the block table renumbered to index that list (Attention's blocks_read).
struct BlocksRead {
  at::Tensor blocks, table;
};

BlocksRead blocks_read(const at::Tensor& table, const at::Tensor& seq_lens, int64_t block_size,
                       int64_t num_blocks) {
  const auto tab = table.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t B = tab.size(0), W = tab.size(1);
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  BlocksRead r{at::empty({0}, tab.options()), at::zeros_like(tab)};
  int64_t* op = r.table.data_ptr<int64_t>();
  std::vector<int64_t> src;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = std::min((lp[b] + block_size - 1) / block_size, W);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t blk = tp[b * W + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block ", blk, " outside the cache");
      op[b * W + j] = int64_t(src.size());
      src.push_back(blk);
    }
  }
  r.blocks = at::tensor(src, tab.options());
  return r;
}

// Those blocks of an int8 cache [2, NB, BS, KVH, D] as a cache of dtype dt: the same ATen ops
// as the module path's kv.quant.dequantize (codes times scales in fp32, rounded once to dt).
at::Tensor dequantize_blocks(const at::Tensor& cache, const at::Tensor& scales,
                             const at::Tensor& blocks, at::ScalarType dt) {
  const auto codes = cache.index_select(1, blocks).to(at::kFloat);
  const auto sc = scales.index_select(1, blocks).to(at::kFloat).unsqueeze(-1);
  return (codes * sc).to(dt);
}

}  // namespace

class DecoderStack : public torch::CustomClassHolder {
 public:
  // One linear layer; returns its index for add_layer.
  int64_t add_linear(int64_t kind, at::Tensor w, std::optional<at::Tensor> aux,
                     std::optional<at::Tensor> table, int64_t n, int64_t group,
                     int64_t rows_max, std::optional<at::Tensor> bias) {
    TORCH_CHECK(kind >= kBf16 && kind <= kI8G && kind != kConcat, "unknown linear kind ", kind);
    TORCH_CHECK(kind == kBf16 || kind == kDense || aux.has_value(), "quantized linear needs its scales");
    TORCH_CHECK(kind != kQ4 || table.has_value(), "4-bit linear needs its table");
    Linear l;
    l.kind = kind;
    l.w = std::move(w);
    if (aux) l.aux = *aux;
    if (table) l.table = *table;
    if (kind == kQ4) {
      check_linear_q4(at::empty({0, l.w.size(1) * 4}, at::kBFloat16), l.w, l.aux, l.table, group);
      TORCH_CHECK(n == l.w.size(0) * 16, "4-bit linear: ", n, " outputs for ", l.w.size(0),
                  " tiles");
      l.q4 = q4_table(l.table);
    }
    l.n = n;
    l.group = group;
    l.rows_max = rows_max;
    l.bias = std::move(bias);
    linears_.push_back(std::move(l));
    return int64_t(linears_.size()) - 1;
  }

  // Linears added before (by index) as the parts of one, their outputs side by side; returns
  // its index for add_layer.
  int64_t add_concat(std::vector<int64_t> parts, std::optional<at::Tensor> bias) {
    TORCH_CHECK(!parts.empty(), "a concatenated linear needs parts");
    Linear l;
    l.kind = kConcat;
    for (auto i : parts) {
      TORCH_CHECK(i >= 0 && i < int64_t(linears_.size()), "no linear ", i);
      l.parts.push_back(linears_[i]);
      l.n += linears_[i].n;
    }
    l.bias = std::move(bias);
    linears_.push_back(std::move(l));
    return int64_t(linears_.size()) - 1;
  }

  // linears: qkv, o, gate_up, down (indices from add_linear); dims: heads, kv_heads,
  // head_dim, window, group, gelu; scalars: eps of the two norms, scale, softcap, eps of the
  // q/k norms.
  void add_layer(at::Tensor ln1, at::Tensor ln2, std::vector<int64_t> linears,
                 std::vector<int64_t> dims, std::vector<double> scalars, at::Tensor rope_table,
                 at::Tensor kv_cache, std::optional<at::Tensor> kv_scales,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 std::optional<at::Tensor> query_mult, std::optional<at::Tensor> key_mult) {
    TORCH_CHECK(linears.size() == 4 && dims.size() == 6 && scalars.size() == 5,
                "add_layer: 4 linears, 6 dims and 5 scalars expected");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    TORCH_CHECK(query_mult.has_value() == key_mult.has_value(),
                "query and key channel scales come together");
    for (auto i : linears)
      TORCH_CHECK(i >= 0 && i < int64_t(linears_.size()), "no linear ", i);
    Layer L;
    L.ln1 = std::move(ln1);
    L.ln2 = std::move(ln2);
    L.qkv = linears_[linears[0]];
    L.o = linears_[linears[1]];
    L.gate_up = linears_[linears[2]];
    L.down = linears_[linears[3]];
    L.heads = dims[0];
    L.kv_heads = dims[1];
    L.head_dim = dims[2];
    L.window = dims[3];
    L.group = dims[4];
    L.gelu = dims[5] != 0;
    L.eps1 = scalars[0];
    L.eps2 = scalars[1];
    L.scale = scalars[2];
    L.softcap = scalars[3];
    L.qk_eps = scalars[4];
    if (q_norm) {
      L.q_norm = *q_norm;
      L.k_norm = *k_norm;
    }
    L.rope_table = std::move(rope_table);
    L.kv_cache = std::move(kv_cache);
    L.kv_scales = std::move(kv_scales);
    if (key_mult) {
      L.query_mult = query_mult->to(at::kFloat).contiguous();
      L.key_mult = key_mult->to(at::kFloat).contiguous();
    }
    layers_.push_back(std::move(L));
  }

  // Layer `layer` takes steps of prompt chunks only (every query run longer than max_short
  // tokens) on a prompt kernel (kind 1: paged_prefill_attention, 2:
  // paged_prefill_attention_amx), as the module path does: over a float cache as it is (its
  // dtype the activations'), over an int8 cache's blocks they read, dequantized.
  void set_prompt_kernel(int64_t layer, int64_t kind, int64_t max_short) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "no layer ", layer);
    TORCH_CHECK(kind >= 0 && kind <= 2, "prompt kernel kind 0, 1 or 2");
    Layer& L = layers_[layer];
    TORCH_CHECK(kind == 0 || (L.window == 0 && L.softcap == 0 &&
                              (L.kv_scales || !L.key_mult.defined())),
                "a prompt kernel needs plain causal attention (no window or softcap), over an "
                "int8 cache or a float one without key scales");
    L.prompts = kind;
    L.max_short = max_short;
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // The longest context the RoPE tables cover (a longer step takes the Python path, which
  // grows them).
  int64_t max_positions() const {
    int64_t m = INT64_MAX;
    for (const auto& L : layers_) m = std::min(m, L.rope_table.size(0));
    return layers_.empty() ? 0 : m;
  }

  // x: the embedded tokens [T, hidden]; layer_ids: the layers to run, in order (empty: all).
  // Returns the hidden states after the last layer (before the final norm).
  at::Tensor forward(at::Tensor x, at::Tensor positions, std::vector<at::Tensor> block_tables,
                     std::vector<at::Tensor> slot_mappings, at::Tensor query_start_loc,
                     at::Tensor seq_lens, std::vector<int64_t> layer_ids) const {
    const int64_t n = layer_ids.empty() ? num_layers() : int64_t(layer_ids.size());
    std::vector<const Layer*> run;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t li = layer_ids.empty() ? i : layer_ids[i];
      TORCH_CHECK(li >= 0 && li < num_layers(), "no layer ", li);
      const Layer& L = layers_[li];
      TORCH_CHECK(L.group < int64_t(block_tables.size()) && L.group < int64_t(slot_mappings.size()),
                  "no metadata for KV group ", L.group);
      run.push_back(&L);
    }
    if (run.empty()) return x;
    // The residual stream is updated in place (a copy: the caller's tensor stays), each
    // residual add fused with the norm that follows it (add_rms_norm_): the same numbers as
    // x = x + delta, then rms_norm(x).
    x = x.contiguous().clone();
    at::Tensor h = rms_norm(x, run[0]->ln1, run[0]->eps1, false);
    const int64_t t = x.size(0);
    const auto qsl = query_start_loc.contiguous();
    const int64_t* qs = qsl.data_ptr<int64_t>();
    int64_t shortest = INT64_MAX;  // the shortest query run
    for (int64_t b = 0; b + 1 < qsl.size(0); ++b) shortest = std::min(shortest, qs[b + 1] - qs[b]);
    // per KV group, built by its first layer whose prompt kernel takes the step
    std::vector<std::optional<BlocksRead>> read(block_tables.size());
    for (size_t i = 0; i < run.size(); ++i) {
      const Layer& L = *run[i];
      StepScratch* s = nullptr;
      if (t <= StepScratch::kRowsMax && !L.q_norm.defined() && !L.key_mult.defined()) {
        s = &scratch_;
        s->fit(t, {L.heads, L.kv_heads, L.head_dim, x.size(1), L.gate_up.out_features() / 2}, x);
      }
      const bool prompts = L.prompts && shortest > L.max_short;
      const BlocksRead* dequantized = nullptr;
      if (prompts && L.kv_scales) {
        auto& r = read[L.group];
        if (!r) r = blocks_read(block_tables[L.group], seq_lens, L.kv_cache.size(2),
                                L.kv_cache.size(1));
        dequantized = &*r;
      }
      auto a = attention(L, h, positions, block_tables[L.group], slot_mappings[L.group],
                         query_start_loc, seq_lens, s, prompts, dequantized);
      a = a.contiguous();
      at::Tensor h2;
      if (s) add_rms_norm_out(x, a, L.ln2, L.eps2, false, h2 = s->h2);
      else h2 = add_rms_norm_(x, a, L.ln2, L.eps2, false);
      at::Tensor gu, act, m;
      if (!(s && L.gate_up.into(h2, gu = s->gu))) gu = L.gate_up(h2);
      if (s) gated_act_out(gu, L.gelu, act = s->act);
      else act = gated_act(gu, L.gelu);
      if (!(s && L.down.into(act, m = s->m))) m = L.down(act).contiguous();
      if (i + 1 == run.size()) x.add_(m);
      else if (s) add_rms_norm_out(x, m, run[i + 1]->ln1, run[i + 1]->eps1, false, h = s->h);
      else h = add_rms_norm_(x, m, run[i + 1]->ln1, run[i + 1]->eps1, false);
    }
    return x;
  }

 private:
  // The attention block's output (o's); s: the step's buffers (none: allocate); prompts: the
  // layer's prompt kernel takes the step (Layer::prompts); dequantized: the blocks it reads
  // (an int8 cache).
  static at::Tensor attention(const Layer& L, const at::Tensor& h, const at::Tensor& positions,
                              const at::Tensor& block_table, const at::Tensor& slot_mapping,
                              const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                              StepScratch* s, bool prompts, const BlocksRead* dequantized) {
    const int64_t t = h.size(0), qd = L.heads * L.head_dim, kd = L.kv_heads * L.head_dim;
    at::Tensor q, k, v;
    if (s && L.qkv.into(h, s->qkv)) {
      q = s->q, k = s->k, v = s->v;
    } else {
      auto qkv = L.qkv(h);
      q = qkv.narrow(1, 0, qd).view({t, L.heads, L.head_dim});
      k = qkv.narrow(1, qd, kd).view({t, L.kv_heads, L.head_dim});
      v = qkv.narrow(1, qd + kd, kd).view({t, L.kv_heads, L.head_dim});
    }
    if (L.q_norm.defined()) {
      q = rms_norm(q, L.q_norm, L.qk_eps, false);
      k = rms_norm(k, L.k_norm, L.qk_eps, false);
    }
    rope_(q, positions, L.rope_table);
    rope_(k, positions, L.rope_table);
    if (L.key_mult.defined()) {  // as the module path: q * m and k / m in fp32
      q = q.to(at::kFloat) * L.query_mult;
      k = k.to(at::kFloat) * L.key_mult;
      v = v.to(at::kFloat);
    }
    at::Tensor cache = L.kv_cache;
    write_kv(cache, k, v, slot_mapping, L.kv_scales);
    at::Tensor out;
    if (prompts) {  // the queries in the model's dtype, as the module path's _mixed
      const auto blocks =
          dequantized ? dequantize_blocks(L.kv_cache, *L.kv_scales, dequantized->blocks,
                                          h.scalar_type())
                      : L.kv_cache;
      const auto qm = q.to(h.scalar_type()).contiguous();
      const auto& table = dequantized ? dequantized->table : block_table;
      out = L.prompts == 2
                ? paged_prefill_attention_amx(qm, blocks, table, query_start_loc, seq_lens, L.scale)
                : paged_prefill_attention(qm, blocks, table, query_start_loc, seq_lens, L.scale);
    } else {
      out = paged_attention(q.contiguous(), L.kv_cache, block_table, query_start_loc, seq_lens,
                            L.scale, L.window, L.softcap, L.kv_scales);
    }
    const auto o_in = out.view({t, qd}).to(h.scalar_type());
    if (s && L.o.into(o_in, s->a)) return s->a;
    return L.o(o_in);
  }

  std::vector<Linear> linears_;
  std::vector<Layer> layers_;
  mutable StepScratch scratch_;  // forward runs one step at a time (the engine's loop)
};

}  // namespace ff

TORCH_LIBRARY_FRAGMENT(fastforward, m) {
  m.class_<ff::DecoderStack>("DecoderStack")
      .def(torch::init<>())
      .def("add_linear", &ff::DecoderStack::add_linear)
      .def("add_concat", &ff::DecoderStack::add_concat)
      .def("add_layer", &ff::DecoderStack::add_layer)
      .def("set_prompt_kernel", &ff::DecoderStack::set_prompt_kernel)
      .def("num_layers", &ff::DecoderStack::num_layers)
      .def("max_positions", &ff::DecoderStack::max_positions)
      .def("forward", &ff::DecoderStack::forward);
}
