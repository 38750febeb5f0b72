// What the prompt attention kernels share (attention_amx.cpp on AMX tiles, attention_prompt.cpp
// on AVX-512 float32 FMAs): the step's prompts read from the block-paged cache, and the
// schedule that hands their work to the threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace ff {

// The prompt chunks of a step: sequence b's queries are rows qs[b] .. qs[b + 1] of q [T, H, D],
// the last of its S[b] keys, which sit in the block-paged cache [2, NB, BS, KVH, D] through its
// row of the block tables (its cached context first).
struct PromptBatch {
  std::vector<int64_t> qs, S;
  at::Tensor tables;  // [B, W] int64, contiguous
  int64_t W = 0, NB = 0, BS = 0;

  // Checks the metadata against q and the cache (what `name` takes is checked by the caller).
  PromptBatch(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
              const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const char* name) {
    TORCH_CHECK(q.dim() == 3, name, ": q must be [T, H, D]");
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), name,
                ": kv_cache must be a contiguous [2, num_blocks, block_size, KVH, D] tensor");
    TORCH_CHECK(kv_cache.size(4) == q.size(2), name, ": head_dim of q and the cache differ");
    const int64_t KVH = kv_cache.size(3);
    TORCH_CHECK(KVH > 0 && q.size(1) % KVH == 0, name, ": heads ", q.size(1), " / KV heads ",
                KVH, " mismatch");
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                    query_start_loc.scalar_type() == at::kLong &&
                    seq_lens.scalar_type() == at::kLong && query_start_loc.dim() == 1 &&
                    seq_lens.dim() == 1,
                name, ": block_tables [B, W], query_start_loc [B + 1] and seq_lens [B] must be ",
                "int64");
    const int64_t B = seq_lens.size(0);
    NB = kv_cache.size(1);
    BS = kv_cache.size(2);
    TORCH_CHECK(query_start_loc.size(0) == B + 1 && block_tables.size(0) == B, name,
                ": metadata sizes disagree");
    auto qsl = query_start_loc.contiguous(), sl = seq_lens.contiguous();
    tables = block_tables.contiguous();
    qs.assign(qsl.data_ptr<int64_t>(), qsl.data_ptr<int64_t>() + B + 1);
    S.assign(sl.data_ptr<int64_t>(), sl.data_ptr<int64_t>() + B);
    W = tables.size(1);
    const int64_t* tab = tables.data_ptr<int64_t>();
    TORCH_CHECK(qs[0] == 0 && qs[B] == q.size(0), name, ": query_start_loc must run from 0 to ",
                q.size(0));
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(qs[b + 1] >= qs[b] && qs[b + 1] - qs[b] <= S[b], name, ": sequence ", b,
                  " has more queries than keys");
      TORCH_CHECK((S[b] + BS - 1) / BS <= W, name, ": sequence ", b, " outgrows its block table");
      for (int64_t i = 0; i < (S[b] + BS - 1) / BS; ++i)
        TORCH_CHECK(tab[b * W + i] >= 0 && tab[b * W + i] < NB, name, ": block ",
                    tab[b * W + i], " outside the cache");
    }
  }

  // rows(b, h)(k0, n, kr, vr): pointers to the K and V rows of keys k0 .. k0 + n of sequence
  // b's KV head h in the cache (cp: its first element), one division per call.
  template <typename T>
  auto rows(const T* cp, int64_t KVH, int64_t D, int64_t b, int64_t h) const {
    const int64_t* row = tables.data_ptr<int64_t>() + b * W;
    const int64_t half = NB * BS * KVH * D;  // K half -> V half
    const int64_t bs = BS;
    return [=](int64_t k0, int64_t n, const T** kr, const T** vr) {
      int64_t blk = k0 / bs, off = k0 % bs;
      for (int64_t j = 0; j < n; ++j) {
        kr[j] = cp + ((row[blk] * bs + off) * KVH + h) * D;
        vr[j] = kr[j] + half;
        if (++off == bs) off = 0, ++blk;
      }
    };
  }
};

// Hands the prompts' work to the threads. An item is one query block of up to `gmax` query
// heads that share a KV head; its keys are those of one (sequence, KV head) group, packed first
// into a buffer of head_size(b) elements by pack(b, h, buf). run(b, h, c0, t0, buf) runs the
// item of query heads h * group + c0 .. (at most gmax) and query rows t0 .. t0 + block of
// sequence b. thread(body) runs a thread's share (AMX: tile configuration around it).
//
// Sequences with the most work go first. With enough (sequence, KV head) groups to keep the
// threads busy, a thread takes a whole group: it packs the group's keys into its own buffer
// and runs all its items while they are in its cache (32 prompts of 50 tokens over 1,536
// cached keys spent most of their time re-reading packed keys from memory when all were packed
// first). Otherwise (one long prompt: 3 groups on 2 threads) every group is packed first and
// the items go out one by one, the longest query blocks first.
template <typename Elem, typename HeadSize, typename Pack, typename Run, typename Thread>
void schedule_prompts(int64_t H, int64_t KVH, int64_t gmax, int64_t block,
                      const std::vector<int64_t>& qs, const std::vector<int64_t>& S,
                      HeadSize&& head_size, Pack&& pack, Run&& run, Thread&& thread) {
  const int64_t B = int64_t(S.size());
  const int64_t group = H / KVH, chunks = (group + gmax - 1) / gmax;
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  auto work = [&](int64_t b) {  // ~ query-key pairs
    const int64_t t = qs[b + 1] - qs[b];
    return t * (S[b] - t) + t * t / 2;
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return work(a) > work(b); });
  auto blocks_desc = [&](int64_t b, auto&& f) {  // a sequence's query blocks, longest first
    for (int64_t t0 = (qs[b + 1] - qs[b] - 1) / block * block; t0 >= 0; t0 -= block) f(t0);
  };
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> next{0};
  if (B * KVH >= 4 * threads) {
    int64_t max_size = 0;
    for (int64_t b = 0; b < B; ++b) max_size = std::max(max_size, head_size(b));
    // each thread drains the shared counter (a second share of the same thread finds it empty)
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      std::vector<Elem> buf(max_size);
      thread([&] {
        for (int64_t i = next++; i < B * KVH; i = next++) {
          const int64_t b = order[i / KVH], h = i % KVH;
          if (qs[b + 1] == qs[b]) continue;
          pack(b, h, buf.data());
          for (int64_t c = 0; c < chunks; ++c)
            blocks_desc(b, [&](int64_t t0) { run(b, h, c * gmax, t0, buf.data()); });
        }
      });
    });
    return;
  }
  std::vector<int64_t> base(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) base[b + 1] = base[b] + KVH * head_size(b);
  std::vector<Elem> packed(base[B]);
  at::parallel_for(0, B * KVH, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / KVH, h = i % KVH;
      pack(b, h, packed.data() + base[b] + h * head_size(b));
    }
  });
  struct Work {
    int64_t seq, t0, kvh, c0;
  };
  std::vector<Work> items;
  for (int64_t b : order)
    blocks_desc(b, [&](int64_t t0) {
      for (int64_t h = 0; h < KVH; ++h)
        for (int64_t c = 0; c < chunks; ++c) items.push_back({b, t0, h, c * gmax});
    });
  auto keys_seen = [&](const Work& w) {  // by the block's first query: context + t0
    return S[w.seq] - (qs[w.seq + 1] - qs[w.seq]) + w.t0;
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Work& a, const Work& b) { return keys_seen(a) > keys_seen(b); });
  const int64_t n = int64_t(items.size());
  at::parallel_for(0, std::min(threads, n), 1, [&](int64_t, int64_t) {
    thread([&] {
      for (int64_t i = next++; i < n; i = next++) {
        const Work& it = items[i];
        run(it.seq, it.kvh, it.c0, it.t0,
            packed.data() + base[it.seq] + it.kvh * head_size(it.seq));
      }
    });
  });
}

}  // namespace ff
