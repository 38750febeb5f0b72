// Work split over threads at run time (the few-row kernels: int16_rows.h, linear.cpp): chunks
// handed out from a shared counter, or equal ranges whose ends the threads done early take.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

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

// fn(i0, i1) over [0, n) split into one equal range for each of up to max_threads threads, each
// taken from its front ``step`` units at a time (the last piece shorter); a thread done with its
// own range then takes the others' last units one at a time from the back, until none is left.
// For decode's few-row matmuls, whose ranges are a few dozen units of ~0.3 us: split exactly,
// the second thread started late (woken from its wait after the engine's Python between steps)
// or read slower memory, and the first waited for it at the region's end -- on average 2.2 us a
// call (3.8-4.8 with a bf16 engine in the same process), 120 calls a SmolLM2 int4 decode step.
// Taking each other's ends, they finish 0.7-1.0 us apart (the 2-core Xeon, rdtsc at each
// thread's end in a throwaway build).
template <typename F>
void steal_for(int64_t n, int64_t max_threads, int64_t step, F&& fn) {
  const int64_t threads = at::in_parallel_region()
                              ? 1
                              : std::min({n, max_threads, int64_t(at::get_num_threads())});
  TORCH_CHECK(n < (int64_t(1) << 32), "steal_for: too many units");
  if (threads <= 1) {
    for (int64_t i = 0; i < n; i += step) fn(i, std::min(n, i + step));
    return;
  }
  struct alignas(64) Range {  // [lo, hi) as lo << 32 | hi, one cache line per thread
    std::atomic<uint64_t> v;
  };
  auto pack = [](int64_t lo, int64_t hi) { return uint64_t(lo) << 32 | uint64_t(hi); };
  std::vector<Range> ranges(threads);
  for (int64_t t = 0; t < threads; ++t)
    ranges[t].v.store(pack(n * t / threads, n * (t + 1) / threads), std::memory_order_relaxed);
  // Claims [lo, lo + take) from the front or [hi - take, hi) from the back of a range.
  auto claim = [&](Range& r, bool front, int64_t take, int64_t& i0, int64_t& i1) {
    uint64_t cur = r.v.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = int64_t(cur >> 32), hi = int64_t(cur & 0xffffffffu);
      if (lo >= hi) return false;
      const int64_t k = std::min(take, hi - lo);
      i0 = front ? lo : hi - k;
      i1 = i0 + k;
      if (r.v.compare_exchange_weak(cur, front ? pack(lo + k, hi) : pack(lo, hi - k),
                                    std::memory_order_relaxed))
        return true;
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t i0, i1;
      while (claim(ranges[t], true, step, i0, i1)) fn(i0, i1);
      for (int64_t o = 1; o < threads; ++o)
        while (claim(ranges[(t + o) % threads], false, 1, i0, i1)) fn(i0, i1);
    }
  });
}

}  // namespace ff
