// A small work pool for per-file jobs: manifest hashing, verify, the copy engine.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace uckpt::ckpt {

// The threads uckpt's own pools may use when a caller asks for none: the
// engine sets this rank's host-thread budget (engine/host_threads.h); until
// then, or when set to 0, every core of the machine.
void SetDefaultThreads(int threads);
int DefaultThreads();

// `requested` threads, or min(4, DefaultThreads()) for 0 (more seldom helps
// one disk); never more than `jobs`, never fewer than 1.
inline int WorkerThreads(int requested, size_t jobs) {
  int n = requested > 0 ? requested : std::min(4, DefaultThreads());
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(n), jobs)));
}

// Runs job(k) for k in [0, n) on `threads` threads, taking k in order, and
// rethrows the first exception once all threads have stopped (the others
// take no new job after it).
template <typename Job>
void ParallelFor(size_t n, int threads, Job job) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex mu;
  auto work = [&] {
    for (size_t k; !failed && (k = next++) < n;) {
      try {
        job(k);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// Runs job(i) for i in [0, sizes.size()) on `threads` threads, largest first
// (ties in index order).
template <typename Job>
void ParallelBySize(const std::vector<uint64_t>& sizes, int threads, Job job) {
  std::vector<size_t> order(sizes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sizes[a] > sizes[b]; });
  ParallelFor(order.size(), threads, [&](size_t k) { job(order[k]); });
}

}  // namespace uckpt::ckpt
