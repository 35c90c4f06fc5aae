// Work sharing for kvjax's CPU kernels over XLA's intra-op thread pool, and the small helpers
// every kernel's entry point shares (shape checks, run-time counts as template arguments).

#ifndef KVJAX_CSRC_PARALLEL_H_
#define KVJAX_CSRC_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace kvjax {

// Calls fn(task, worker) for every task in [0, tasks) on `workers` threads: the caller is
// worker 0, pool threads are 1, 2, ... Tasks are claimed from a shared counter, so a thread
// that wakes late takes fewer; a pool task that starts after all are claimed returns at once,
// so the caller never waits on a task that has not started (no deadlock when every pool thread
// is itself inside a kernel). Returns when every task is done.
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t tasks, int64_t workers, const Fn& fn) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
  };
  auto counters = std::make_shared<Counters>();  // outlives this call for pool tasks that start late
  const Fn* body = &fn;  // only called while a claimed task keeps the caller waiting
  auto work = [counters, body, tasks](int64_t worker) {
    for (int64_t t; (t = counters->next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      (*body)(t, worker);
      counters->finished.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 1; i < workers; ++i) pool.Schedule([work, i] { work(i); });
  work(0);
  while (counters->finished.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
}

// Whether an FFI buffer's dimensions are `want`: a kernel's shape check.
template <typename Dims>
bool Is(const Dims& d, std::initializer_list<int64_t> want) {
  return d.size() == want.size() && std::equal(want.begin(), want.end(), d.begin());
}

// fn(std::integral_constant<int, n>) for 1 <= n <= kMax: a run-time count as a template argument.
template <int kMax, typename Fn>
inline void WithConstant(int64_t n, Fn fn) {
  if constexpr (kMax > 1)
    if (n < kMax) return WithConstant<kMax - 1>(n, fn);
  fn(std::integral_constant<int, kMax>{});
}

}  // namespace kvjax

#endif  // KVJAX_CSRC_PARALLEL_H_
