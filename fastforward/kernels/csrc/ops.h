// The fast CPU kernels' entry points (registered as torch.ops.fastforward.* in ops.cpp and
// called directly by the fused decoder stack in decoder.cpp).
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace ff {
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor unpack_linear_weight(const at::Tensor& wpacked, int64_t N);
at::Tensor linear_bf16_gemm(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                            const std::optional<at::Tensor>& bias, bool fp32_out);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                       const std::optional<at::Tensor>& bias);
void linear_bf16_out(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                     const std::optional<at::Tensor>& bias, at::Tensor& y);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap, const std::optional<at::Tensor>& kv_scales);
void write_kv(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping, const std::optional<at::Tensor>& kv_scales);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset);
// x += delta in place, then rms_norm(x) (the residual add and the next norm in one pass).
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                         double eps, bool unit_offset);
void add_rms_norm_out(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                      double eps, bool unit_offset, at::Tensor& out);
at::Tensor gated_act(const at::Tensor& x, bool gelu);
void gated_act_out(const at::Tensor& x, bool gelu, at::Tensor& out);
// Each row's first NaN, else its first maximum: torch.max(x, dim=-1).indices for fp32 [R, V].
at::Tensor argmax_rows(const at::Tensor& x);
// The greedy token of a few rows of the output projection from its int8 copy (greedy_screen.cpp):
// -1 for a row the screen leaves to the full projection.
bool greedy_screen_native();
std::vector<at::Tensor> greedy_screen_pack(const at::Tensor& w);
at::Tensor greedy_screen(const at::Tensor& x, const std::vector<at::Tensor>& screen,
                         const at::Tensor& tiles, int64_t N, int64_t max_candidates);
// Each row's token for a uniform in [0, 1), sampled from softmax of fp32 logits [R, V] by
// inverse CDF (-1: no finite positive mass).
at::Tensor sample_logits(const at::Tensor& logits, const at::Tensor& u);
// Top-p in place over fp32 logits [R, V] (the smallest set of most likely tokens whose mass
// reaches top_p[r]); which rows it took (bool [R]: not those without finite positive mass).
at::Tensor top_p_filter_(at::Tensor& logits, const at::Tensor& top_p);
// -inf in place where x[r, i] < threshold[r] (fp32 [R, V]; the sampler's min-p and top-k).
void mask_below_(at::Tensor& x, const at::Tensor& threshold);
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& table);
at::Tensor rescore_logits(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& bias, int64_t k);
bool amx_native();
// linear_amx's tiles serve every batch without AMX too: vdpbf16ps (AVX512-BF16).
bool bf16_tiles_native();
at::Tensor pack_amx_weight(const at::Tensor& w);
at::Tensor unpack_amx_weight(const at::Tensor& wpacked, int64_t N, int64_t K);
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                      const std::optional<at::Tensor>& bias, bool fp32_out);
void linear_amx_out(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                    const std::optional<at::Tensor>& bias, at::Tensor& y);
bool linear_q4_native();
bool paged_attention_bf16_native();
bool paged_attention_int8_native();
at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                     const at::Tensor& table, int64_t group_size);
void check_linear_q4(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                     const at::Tensor& table, int64_t group_size);
// A 4-bit table read once (twice over, for the in-register lookup) and whether it is the int4
// table (code - 8), which takes the integer path; refused where this CPU has no kernel for it.
struct Q4Table {
  alignas(64) uint16_t tab[32];
  bool int4;
};
Q4Table q4_table(const at::Tensor& table);
bool linear_q4_takes_amx(int64_t rows, const Q4Table& t);
void linear_q4_out(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                   const Q4Table& t, int64_t group_size, at::Tensor& y);
at::Tensor linear_q4_amx(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                         const at::Tensor& table, int64_t group_size);
at::Tensor linear_q4_rows(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                          const at::Tensor& table, int64_t group_size);
bool prefill_attention_amx_native(int64_t head_dim);
bool prefill_attention_f32_native(int64_t head_dim);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                   const at::Tensor& block_tables,
                                   const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                   double scale);
at::Tensor prefill_attention_amx(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale);
at::Tensor paged_prefill_attention_amx(const at::Tensor& q, const at::Tensor& kv_cache,
                                       const at::Tensor& block_tables,
                                       const at::Tensor& query_start_loc,
                                       const at::Tensor& seq_lens, double scale);
at::Tensor linear_i8g_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          int64_t group_size);
// Batches up to this many rows of linear_i8g_amx take linear_i8g_rows where the CPU has
// AVX512-VNNI (int8_rows_native: int16 rows, integer dot products, linear_i8g.cpp): SmolLM2's
// 120 layer matrices as Q8_0 from memory, 2 threads, 8 rows 10.2 against 17.7 ms on AMX tiles,
// 16 rows 14.7 against 15.8.
constexpr int64_t kI8gRowsMax = 16;
constexpr int64_t TN_ROWS = 16;  // output features per block of the int8-group layout
bool int8_rows_native();
// codes [N/16, K/2, 16, 2] int8, scales [N/16, K/group, 16] float32, x bf16 [.., K].
void check_i8g(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
               int64_t group_size);
at::Tensor linear_i8g_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           int64_t group_size);
at::Tensor linear_i8_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
at::Tensor linear_q5(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     int64_t group_size);
void dequantize_q5(const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out,
                   const std::optional<at::Tensor>& rows);
void dequantize_q4(const at::Tensor& wq, const at::Tensor& sz, const at::Tensor& table,
                   at::Tensor& out, const std::optional<at::Tensor>& rows);
}  // namespace ff
