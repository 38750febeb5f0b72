// The dense weight of a packed format (dequantize_q4, dequantize_q5), or some of its rows: for
// the dense matmul of large batches and for embedding lookups. Rows of 16-output tiles computed
// in float32, written as out's dtype.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "vec.h"

namespace ff {

// row(t, i, dst) writes the K float32 weights of output 16t + i into out, float32 or bf16
// (rounded once), checked here: all 16 * tiles outputs (out [N, K]; tiles split over threads),
// or the outputs in ``rows`` (int64 [R]; out [R, K]: an embedding lookup reading only its rows).
template <typename F>
void expand_tiles(at::Tensor& out, int64_t tiles, int64_t K, const std::optional<at::Tensor>& rows,
                  F&& row) {
  const int64_t R = rows ? rows->numel() : tiles * 16;
  TORCH_CHECK(!rows || (rows->dim() == 1 && rows->scalar_type() == at::kLong),
              "rows must be a 1-D int64 tensor");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == R && out.size(1) == K && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be a contiguous [", R, ", ", K, "] float32 or bf16 tensor");
  at::Tensor ids = rows ? rows->contiguous() : at::Tensor();
  const int64_t* ip = rows ? ids.data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; ip && r < R; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < tiles * 16, "row ", ip[r], " outside the weight's ",
                tiles * 16);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  auto* of = bf16 ? nullptr : out.data_ptr<float>();
  auto* ob = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  auto write = [&](int64_t t, int i, int64_t r, float* buf) {
    row(t, i, buf);
    if (bf16)
      for (int64_t k = 0; k < K; ++k) ob[r * K + k] = float_to_bf16(buf[k]);
    else
      std::memcpy(of + r * K, buf, K * sizeof(float));
  };
  if (ip) {
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(K);
      for (int64_t r = r0; r < r1; ++r) write(ip[r] / 16, int(ip[r] % 16), r, buf.data());
    });
    return;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(K);
    for (int64_t t = t0; t < t1; ++t)
      for (int i = 0; i < 16; ++i) write(t, i, t * 16 + i, buf.data());
  });
}

}  // namespace ff
