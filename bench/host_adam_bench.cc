// The host Adam of an offloaded step (engine/cpu_adam.h) on one rank's
// partition, as the offloaded stages run it (ranges of 4 Mi elements, the
// bf16 weights written in the same pass), at several thread counts, against
// two baselines in the same run: torch's own Adam step (TorchAdamStep, the
// formula the fused pass reproduces) and memcpy of the bytes the pass moves
// (28 per element: fp32 master, exp_avg, exp_avg_sq read and written, the
// bf16 gradient read and the bf16 weight written), so it says both how much
// faster than torch the pass is and how close it comes to the host's memory
// bandwidth.
//
//   host_adam_bench [--elements N] [--threads T1,T2,...] [--range R] [--runs K]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/cpu_adam.h"
#include "engine/flat_runtime.h"

namespace {

using namespace uckpt::engine;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The fastest of `runs` calls of fn.
template <typename Fn>
double Best(int runs, Fn fn) {
  double best = 1e30;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = Clock::now();
    fn();
    best = std::min(best, Seconds(t0));
  }
  return best;
}

// memcpy of `bytes` from src to dst on `threads` threads.
void ParallelCopy(char* dst, const char* src, size_t bytes, int threads) {
  std::vector<std::thread> ts;
  const size_t per = (bytes / static_cast<size_t>(threads) + 63) / 64 * 64;
  for (int t = 0; t < threads; ++t) {
    const size_t begin = std::min(bytes, per * static_cast<size_t>(t)), end = std::min(bytes, begin + per);
    ts.emplace_back([=] { std::memcpy(dst + begin, src + begin, end - begin); });
  }
  for (std::thread& t : ts) t.join();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 124439808;  // GPT-2 124M at one rank
  int64_t range = int64_t{1} << 22;
  int runs = 5;
  std::vector<int> thread_counts;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--elements") {
      n = std::atoll(v.c_str());
    } else if (a == "--range") {
      range = std::atoll(v.c_str());
    } else if (a == "--runs") {
      runs = std::atoi(v.c_str());
    } else if (a == "--threads") {
      std::stringstream ss(v);
      for (std::string t; std::getline(ss, t, ',');) thread_counts.push_back(std::atoi(t.c_str()));
    } else {
      std::fprintf(stderr, "host_adam_bench: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (n <= 0 || range <= 0 || runs <= 0) {
    std::fprintf(stderr, "host_adam_bench: --elements, --range and --runs must be positive\n");
    return 2;
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (thread_counts.empty()) thread_counts = {1, 4, 8, 16, std::max(1, cores / 2), cores};
  for (int t : thread_counts)
    if (t <= 0) {
      std::fprintf(stderr, "host_adam_bench: thread counts must be positive\n");
      return 2;
    }

  OptimizerConfig o;  // Adam, torch's defaults
  o.lr = 1e-4;
  PartitionState st;
  st.master = at::randn({n});
  const at::Tensor grad = at::randn({n}).to(at::kBFloat16);
  const at::Tensor out = at::empty({range}, at::kBFloat16);
  const double bytes = 28.0 * static_cast<double>(n);
  std::vector<char> copy_src(static_cast<size_t>(bytes / 2)), copy_dst(copy_src.size());
  std::printf("host Adam of %lld elements in ranges of %lld (bf16 gradient and weights), best of %d; %d cores\n",
              static_cast<long long>(n), static_cast<long long>(range), runs, cores);
  std::printf("%8s %12s %10s %12s %12s %10s %14s\n", "threads", "fused ms", "GB/s", "memcpy GB/s", "of memcpy",
              "torch ms", "fused vs torch");
  for (int threads : thread_counts) {
    at::set_num_threads(threads);
    const double fused = Best(runs, [&] {
      const CpuAdamPass pass(st, grad, 1.0, o, o.lr);
      for (int64_t b = 0; b < n; b += range) {
        const int64_t e = std::min(n, b + range);
        pass.Run(b, e, out.narrow(0, 0, e - b));
      }
    });
    const double copy = Best(runs, [&] { ParallelCopy(copy_dst.data(), copy_src.data(), copy_src.size(), threads); });
    const at::Tensor grad32 = grad.to(at::kFloat);
    const double torch_s = Best(std::min(runs, 2), [&] { TorchAdamStep(st, grad32, o, o.lr); });
    std::printf("%8d %12.2f %10.1f %12.1f %11.2fx %10.2f %13.2fx\n", threads, fused * 1e3, bytes / fused / 1e9,
                bytes / copy / 1e9, copy / fused, torch_s * 1e3, torch_s / fused);
    std::fflush(stdout);
  }
  return 0;
}
