// Registers the fast CPU kernels as torch.ops.fastforward.*.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace ff {
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor unpack_linear_weight(const at::Tensor& wpacked, int64_t N);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& wpacked, int64_t N,
                       const std::optional<at::Tensor>& bias);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap, const std::optional<at::Tensor>& kv_scales);
void write_kv(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping, const std::optional<at::Tensor>& kv_scales);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset);
at::Tensor gated_act(const at::Tensor& x, bool gelu);
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& table);
bool linear_q4_native();
bool paged_attention_bf16_native();
at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sz,
                     const at::Tensor& table, int64_t group_size);
}  // namespace ff

TORCH_LIBRARY(fastforward, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &ff::pack_linear_weight);
  m.def("unpack_linear_weight(Tensor wpacked, int N) -> Tensor", &ff::unpack_linear_weight);
  m.def("linear_bf16(Tensor x, Tensor wpacked, int N, Tensor? bias) -> Tensor", &ff::linear_bf16);
  m.def("linear_q4_native() -> bool", &ff::linear_q4_native);
  m.def("paged_attention_bf16_native() -> bool", &ff::paged_attention_bf16_native);
  m.def("linear_q4(Tensor x, Tensor wq, Tensor sz, Tensor table, int group_size) -> Tensor",
        &ff::linear_q4);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor", &ff::rms_norm);
  m.def("gated_act(Tensor x, bool gelu) -> Tensor", &ff::gated_act);
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
