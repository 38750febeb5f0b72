// Work split over threads by a shared counter (the few-row kernels: int16_rows.h, linear.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace ff {

// fn(i0, i1) over [0, n) in chunks handed out from a shared counter rather than split in equal
// parts up front: a thread that starts late (woken from its wait between kernels) or reads
// slower memory no longer leaves the others at the barrier. Chunks are at least grain long,
// about an eighth of each thread's share; below two grains the calling thread does it all.
template <typename F>
void dynamic_for(int64_t n, int64_t grain, F&& fn) {
  const int64_t threads = n >= 2 * grain ? at::get_num_threads() : 1;
  const int64_t chunk = std::max<int64_t>(grain, n / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i0 = next.fetch_add(chunk); i0 < n; i0 = next.fetch_add(chunk))
      fn(i0, std::min(n, i0 + chunk));
  });
}

}  // namespace ff
