// Work sharing on XLA's intra-op thread pool, for the native CPU kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace paged_jax_native {

// Cuts [0, n) into contiguous ranges, about chunks_per_thread for each thread at work (the caller
// and all but one of the pool's threads), and runs fn(begin, end) on each. Threads take ranges
// from a shared counter; the calling thread takes them too, so nothing waits on a task that never
// started, and a task that starts after the last range is taken returns at once. Returns when
// every range is done.
inline void ParallelRanges(xla::ffi::ThreadPool& pool, int64_t n, int64_t chunks_per_thread,
                           std::function<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  struct State {
    std::function<void(int64_t, int64_t)> fn;
    int64_t n, per, chunks;
    std::atomic<int64_t> next{0}, done{0};
  };
  // The calling thread works too, so it takes one of the pool's cores: as many pool tasks as the
  // pool has threads put one thread more than cores to work, and a few tens of microseconds of
  // descheduling land on every call (measured: the decode step 3-11 % slower at batch 1-32).
  const int64_t workers = std::max<int64_t>(1, pool.num_threads() - 1);
  auto st = std::make_shared<State>();
  st->fn = std::move(fn);
  st->n = n;
  const int64_t want = std::min<int64_t>(n, std::max<int64_t>(1, chunks_per_thread) * (workers + 1));
  st->per = (n + want - 1) / want;
  st->chunks = (n + st->per - 1) / st->per;
  auto work = [](State& s) {
    for (int64_t c; (c = s.next.fetch_add(1)) < s.chunks;) {
      s.fn(c * s.per, std::min(s.n, (c + 1) * s.per));
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < std::min(workers, st->chunks - 1); ++i) pool.Schedule([st, work] { work(*st); });
  work(*st);
  while (st->done.load(std::memory_order_acquire) < st->chunks) std::this_thread::yield();
}

// The matmuls' work units: calls fn(panel, first row, end row) for every (row chunk, panel) of
// an [M, K] x [K, P panels] product, over XLA's threads; panels innermost so that a thread's range
// runs along the panel stream. Rows of x per pass over the weights: 1024, fewer when few panels and
// many rows (a narrow projection in a long prefill), so that every thread gets work.
template <typename F>
void ForEachPanelChunk(xla::ffi::ThreadPool& pool, int64_t M, int64_t P, F fn) {
  constexpr int64_t kRowChunk = 1024, kMinRows = 64;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads()) + 1;
  int64_t rows = kRowChunk;
  while (rows > kMinRows && P * ((M + rows - 1) / rows) < 2 * threads) rows /= 2;
  const int64_t chunks = (M + rows - 1) / rows;
  ParallelRanges(pool, P * chunks, 2, [=](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) fn(u % P, (u / P) * rows, std::min(M, (u / P) * rows + rows));
  });
}

}  // namespace paged_jax_native
