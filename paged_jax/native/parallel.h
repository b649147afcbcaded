// Work sharing for the native CPU kernels: a team of helper threads that stay awake between the
// calls of one step, and XLA's intra-op thread pool when the team is busy.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace paged_jax_native {

// One call's ranges: threads take chunk numbers from `next` until none are left.
struct RangeJob {
  std::function<void(int64_t, int64_t)> fn;
  int64_t n = 0, per = 1, chunks = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<int> helpers_out{0};  // team helpers that took this job and have not finished with it

  void Work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      fn(c * per, std::min(n, (c + 1) * per));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Helper threads that, after each job, spin on their slot for a bounded time and then sleep on a
// condition variable. At batch 1 a kernel call lasts 5-25 us: a pool task scheduled per call
// started 1.5-3.8 us into it (a sleeping thread's wake-up), so the second core did well under half
// of the work; a helper still spinning from the previous call starts at once. The spin is bounded
// (PAGED_JAX_NATIVE_SPIN_US, default 50 us): a step's calls, microseconds apart, find the helpers
// awake, an idle engine burns no CPU, and the host's work between steps keeps its core (200 us
// measured no faster at batch 1 and slower in the engine's float32 steps; 0 turns the team off). One caller owns the team at a time; a call
// that finds it owned (XLA running two kernels at once) uses XLA's pool as before. The team is made
// once and never destroyed: its threads are detached and only touch this leaked object, so process
// exit neither waits on them nor runs a destructor under them.
class SpinTeam {
 public:
  // The process's team of `helpers` threads (the first caller's count), or nullptr when spinning
  // is off (PAGED_JAX_NATIVE_SPIN_US=0) or no helper is wanted.
  static SpinTeam* Get(int64_t helpers) {
    static SpinTeam* team = [helpers]() -> SpinTeam* {
      const char* env = std::getenv("PAGED_JAX_NATIVE_SPIN_US");
      const int64_t spin_us = env ? std::atoll(env) : 50;
      if (spin_us <= 0 || helpers <= 0) return nullptr;
      return new SpinTeam(helpers, spin_us);  // leaked on purpose (see above)
    }();
    return team;
  }

  int64_t helpers() const { return static_cast<int64_t>(slots_.size()); }

  bool TryClaim() { return !claimed_.exchange(true, std::memory_order_acquire); }

  // Runs `job` on the caller and up to `helpers` of the team; the caller must hold the claim.
  // Returns when every chunk is done and no helper touches the job any more.
  void Run(RangeJob& job, int64_t helpers) {
    helpers = std::min(helpers, this->helpers());
    job.helpers_out.store(static_cast<int>(helpers), std::memory_order_relaxed);
    for (int64_t i = 0; i < helpers; ++i) slots_[i]->job.store(&job, std::memory_order_seq_cst);
    for (int64_t i = 0; i < helpers; ++i) {
      Slot& s = *slots_[i];
      if (s.sleeping.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lock(s.mu);
        s.cv.notify_one();
      }
    }
    job.Work();
    // A helper that has not taken the job yet is not waited for: the job is taken back from its
    // slot. One that took it finishes its last range (or finds none left) and says so.
    for (int64_t i = 0; i < helpers; ++i) {
      RangeJob* expected = &job;
      if (slots_[i]->job.compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel))
        job.helpers_out.fetch_sub(1, std::memory_order_acq_rel);
    }
    while (job.done.load(std::memory_order_acquire) < job.chunks ||
           job.helpers_out.load(std::memory_order_acquire) > 0)
      CpuRelax();
    claimed_.store(false, std::memory_order_release);
  }

 private:
  struct Slot {
    std::atomic<RangeJob*> job{nullptr};
    std::atomic<bool> sleeping{false};
    std::mutex mu;
    std::condition_variable cv;
  };

  SpinTeam(int64_t helpers, int64_t spin_us) : spin_(std::chrono::microseconds(spin_us)) {
    for (int64_t i = 0; i < helpers; ++i) slots_.push_back(std::make_unique<Slot>());
    for (int64_t i = 0; i < helpers; ++i) std::thread([this, i] { Loop(*slots_[i]); }).detach();
  }

  void Loop(Slot& s) {
    using Clock = std::chrono::steady_clock;
    for (;;) {
      auto until = Clock::now() + spin_;
      for (int spins = 0;; ++spins) {
        if (s.job.load(std::memory_order_relaxed) != nullptr) {
          if (RangeJob* job = s.job.exchange(nullptr, std::memory_order_acq_rel)) {
            job->Work();
            job->helpers_out.fetch_sub(1, std::memory_order_acq_rel);  // the caller may return now
            until = Clock::now() + spin_;
          }
          continue;
        }
        CpuRelax();
        if ((spins & 63) == 0 && Clock::now() > until) break;
      }
      std::unique_lock<std::mutex> lock(s.mu);
      s.sleeping.store(true, std::memory_order_seq_cst);
      s.cv.wait(lock, [&s] { return s.job.load(std::memory_order_seq_cst) != nullptr; });
      s.sleeping.store(false, std::memory_order_relaxed);
    }
  }

  std::vector<std::unique_ptr<Slot>> slots_;
  std::atomic<bool> claimed_{false};
  const std::chrono::steady_clock::duration spin_;
};

// Cuts [0, n) into contiguous ranges, about chunks_per_thread for each thread at work (the caller
// and all but one of the pool's threads), and runs fn(begin, end) on each. Threads take ranges
// from a shared counter; the calling thread takes them too, so nothing waits on a task that never
// started, and a helper that starts after the last range is taken returns at once. The ranges
// (and so every result) are the same whichever threads run them. Returns when every range is done.
//
// `small`: a call of a few microseconds (decode at batch 1-8), which takes the spinning helpers (a
// pool task would start microseconds into it); a larger call takes XLA's pool, whose threads are the
// cores' (the helpers beside them slowed a 48-request run ~12 %: a third thread on two cores).
inline void ParallelRanges(xla::ffi::ThreadPool& pool, int64_t n, int64_t chunks_per_thread,
                           std::function<void(int64_t, int64_t)> fn, bool small = false) {
  if (n <= 0) return;
  // The calling thread works too, so it takes one of the pool's cores: as many pool tasks as the
  // pool has threads put one thread more than cores to work, and a few tens of microseconds of
  // descheduling land on every call (measured: the decode step 3-11 % slower at batch 1-32).
  const int64_t workers = std::max<int64_t>(1, pool.num_threads() - 1);
  const int64_t want = std::min<int64_t>(n, std::max<int64_t>(1, chunks_per_thread) * (workers + 1));
  const int64_t per = (n + want - 1) / want, chunks = (n + per - 1) / per;
  const int64_t helpers = std::min(workers, chunks - 1);
  if (helpers <= 0) {  // one range: the caller alone
    fn(0, n);
    return;
  }
  if (SpinTeam* team = small ? SpinTeam::Get(workers) : nullptr; team && team->TryClaim()) {
    RangeJob job;
    job.fn = std::move(fn);
    job.n = n, job.per = per, job.chunks = chunks;
    team->Run(job, helpers);
    return;
  }
  auto st = std::make_shared<RangeJob>();  // shared: a pool task may start after this call returned
  st->fn = std::move(fn);
  st->n = n, st->per = per, st->chunks = chunks;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([st] { st->Work(); });
  st->Work();
  while (st->done.load(std::memory_order_acquire) < st->chunks) std::this_thread::yield();
}

// The matmuls' work units: calls fn(panel, first row, end row) for every (row chunk, panel) of
// an [M, K] x [K, P panels] product, over the helper threads; panels innermost so that a thread's
// range runs along the panel stream. Rows of x per pass over the weights: 1024, fewer when few
// panels and many rows (a narrow projection in a long prefill), so that every thread gets work.
template <typename F>
void ForEachPanelChunk(xla::ffi::ThreadPool& pool, int64_t M, int64_t P, F fn) {
  constexpr int64_t kRowChunk = 1024, kMinRows = 64, kSmallRows = 8;  // kSmallRows: see ParallelRanges
  const int64_t threads = std::max<int64_t>(1, pool.num_threads()) + 1;
  int64_t rows = kRowChunk;
  while (rows > kMinRows && P * ((M + rows - 1) / rows) < 2 * threads) rows /= 2;
  const int64_t chunks = (M + rows - 1) / rows;
  ParallelRanges(
      pool, P * chunks, 2,
      [=](int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; ++u) fn(u % P, (u / P) * rows, std::min(M, (u / P) * rows + rows));
      },
      M <= kSmallRows);
}

}  // namespace paged_jax_native
