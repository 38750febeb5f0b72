// Registers the fast CPU kernels as torch.ops.fastforward.*.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(fastforward, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &ff::pack_linear_weight);
  m.def("unpack_linear_weight(Tensor wpacked, int N) -> Tensor", &ff::unpack_linear_weight);
  m.def("linear_bf16(Tensor x, Tensor wpacked, int N, Tensor? bias) -> Tensor", &ff::linear_bf16);
  m.def("linear_bf16_gemm(Tensor x, Tensor wpacked, int N, Tensor? bias, bool fp32_out) -> Tensor",
        &ff::linear_bf16_gemm);
  m.def("rescore_logits(Tensor y, Tensor x, Tensor w, Tensor? bias, int k) -> Tensor",
        &ff::rescore_logits);
  m.def("amx_native() -> bool", &ff::amx_native);
  m.def("bf16_tiles_native() -> bool", &ff::bf16_tiles_native);
  m.def("pack_amx_weight(Tensor w) -> Tensor", &ff::pack_amx_weight);
  m.def("unpack_amx_weight(Tensor wpacked, int N, int K) -> Tensor", &ff::unpack_amx_weight);
  m.def("linear_amx(Tensor x, Tensor wpacked, int N, Tensor? bias, bool fp32_out) -> Tensor",
        &ff::linear_amx);
  m.def("linear_q4_native() -> bool", &ff::linear_q4_native);
  m.def("paged_attention_bf16_native() -> bool", &ff::paged_attention_bf16_native);
  m.def("paged_attention_int8_native() -> bool", &ff::paged_attention_int8_native);
  m.def("linear_q4(Tensor x, Tensor wq, Tensor sz, Tensor table, int group_size) -> Tensor",
        &ff::linear_q4);
  m.def("linear_q4_amx(Tensor x, Tensor wq, Tensor sz, Tensor table, int group_size) -> Tensor",
        &ff::linear_q4_amx);
  m.def("linear_q4_rows(Tensor x, Tensor wq, Tensor sz, Tensor table, int group_size) -> Tensor",
        &ff::linear_q4_rows);
  m.def("prefill_attention_amx_native(int head_dim) -> bool", &ff::prefill_attention_amx_native);
  m.def("prefill_attention_amx(Tensor q, Tensor k, Tensor v, float scale) -> Tensor",
        &ff::prefill_attention_amx);
  m.def(
      "paged_prefill_attention_amx(Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale) -> Tensor",
      &ff::paged_prefill_attention_amx);
  m.def("prefill_attention_f32_native(int head_dim) -> bool", &ff::prefill_attention_f32_native);
  m.def(
      "paged_prefill_attention(Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale) -> Tensor",
      &ff::paged_prefill_attention);
  m.def("linear_i8g_amx(Tensor x, Tensor codes, Tensor scales, int group_size) -> Tensor",
        &ff::linear_i8g_amx);
  m.def("int8_rows_native() -> bool", &ff::int8_rows_native);
  m.def("linear_i8g_rows(Tensor x, Tensor codes, Tensor scales, int group_size) -> Tensor",
        &ff::linear_i8g_rows);
  m.def("linear_i8_rows(Tensor x, Tensor codes, Tensor scales) -> Tensor", &ff::linear_i8_rows);
  m.def("linear_q5(Tensor x, Tensor codes, Tensor scales, int group_size) -> Tensor",
        &ff::linear_q5);
  m.def("dequantize_q5(Tensor codes, Tensor scales, Tensor(a!) out, Tensor? rows=None) -> ()",
        &ff::dequantize_q5);
  m.def(
      "dequantize_q4(Tensor wq, Tensor sz, Tensor table, Tensor(a!) out, Tensor? rows=None) -> ()",
      &ff::dequantize_q4);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor", &ff::rms_norm);
  m.def(
      "add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps, bool unit_offset) "
      "-> Tensor",
      &ff::add_rms_norm_);
  m.def("gated_act(Tensor x, bool gelu) -> Tensor", &ff::gated_act);
  m.def("argmax_rows(Tensor x) -> Tensor", &ff::argmax_rows);
  m.def("greedy_screen_native() -> bool", &ff::greedy_screen_native);
  m.def("greedy_screen_pack(Tensor w) -> Tensor[]", &ff::greedy_screen_pack);
  m.def(
      "greedy_screen(Tensor x, Tensor[] screen, Tensor tiles, int N, int max_candidates) -> Tensor",
      &ff::greedy_screen);
  m.def("sample_logits(Tensor logits, Tensor u) -> Tensor", &ff::sample_logits);
  m.def("top_p_filter_(Tensor(a!) logits, Tensor top_p) -> Tensor", &ff::top_p_filter_);
  m.def("mask_below_(Tensor(a!) x, Tensor threshold) -> ()", &ff::mask_below_);
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor table) -> ()", &ff::rope_);
  m.def(
      "write_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping, "
      "Tensor(b!)? kv_scales=None) -> ()",
      &ff::write_kv);
  m.def(
      "paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, "
      "Tensor seq_lens, float scale, int window, float softcap, Tensor? kv_scales=None) -> Tensor",
      &ff::paged_attention);
}
