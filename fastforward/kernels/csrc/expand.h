// The dense weight of a packed format, for the dense matmul of large batches (dequantize_q4,
// dequantize_q5): rows of 16-output tiles computed in float32, written as out's dtype.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace ff {

// row(t, i, dst) writes the K float32 weights of output 16t + i; out [16 * tiles, K] float32 or
// bf16 (rounded once), checked here; tiles split over threads.
template <typename F>
void expand_tiles(at::Tensor& out, int64_t tiles, int64_t K, F&& row) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == tiles * 16 && out.size(1) == K &&
                  out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be a contiguous [N, K] float32 or bf16 tensor");
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  auto* of = bf16 ? nullptr : out.data_ptr<float>();
  auto* ob = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(K);
    for (int64_t t = t0; t < t1; ++t)
      for (int i = 0; i < 16; ++i) {
        row(t, i, buf.data());
        const int64_t n = t * 16 + i;
        if (bf16)
          for (int64_t k = 0; k < K; ++k) ob[n * K + k] = float_to_bf16(buf[k]);
        else
          std::memcpy(of + n * K, buf.data(), K * sizeof(float));
      }
  });
}

}  // namespace ff
