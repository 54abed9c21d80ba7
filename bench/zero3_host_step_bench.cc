// The host side of a ZeRO-3 step under offload_optimizer + offload_param
// (Zero3Runtime::Step at the accumulation boundary), piece by piece, on one
// rank's sub-group laid out as a Llama's parameters (each parameter's
// partition after the one before it): the per-parameter gradient norms, the
// fused Adam pass over the fp32 master, moments and gradient, the gradient's
// zeroing, and the bf16 partitions written from the masters. Two sequences:
//   before: SumOfSquares per parameter, CpuAdamStep, grad.zero_(), copy_ per
//           parameter (what Step did);
//   after:  PieceSumsOfSquares (one pass), CpuAdamPass::RunInto (the bf16
//           partitions written inside the update's chunks; the pass zeroes
//           the gradient).
// It checks that both leave the same bits (norms, masters, moments,
// partitions, gradient), and prints each piece's wall and CPU ms (the least over
// the runs) and CPU ns per element.
//
//   zero3_host_step_bench [--hidden H] [--inter I] [--layers L] [--vocab V] [--threads T1,T2] [--runs K]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "engine/cpu_adam.h"
#include "engine/flat_runtime.h"

namespace {

using namespace uckpt::engine;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// This process's CPU seconds (all its threads): on a shared, loaded host a
// steadier measure of the work than the wall clock.
double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Wall and CPU seconds of one call, each kept as the least over runs.
struct Timed {
  double wall = 1e30, cpu = 1e30;
  template <typename Fn>
  void Measure(Fn fn) {
    const auto t0 = Clock::now();
    const double c0 = CpuSeconds();
    fn();
    cpu = std::min(cpu, CpuSeconds() - c0);
    wall = std::min(wall, Seconds(t0));
  }
};

// A Llama's parameter sizes: embeddings, per layer q k v o, gate up down and two norms, final norm, lm_head.
std::vector<int64_t> LlamaSizes(int64_t h, int64_t inter, int64_t layers, int64_t vocab) {
  std::vector<int64_t> sizes{vocab * h};
  for (int64_t l = 0; l < layers; ++l) {
    for (int k = 0; k < 4; ++k) sizes.push_back(h * h);
    for (int k = 0; k < 3; ++k) sizes.push_back(h * inter);
    sizes.push_back(h);
    sizes.push_back(h);
  }
  sizes.push_back(h);
  sizes.push_back(vocab * h);
  return sizes;
}

struct Rank {
  PartitionState st;
  at::Tensor grad;
  std::vector<at::Tensor> partitions;  // bf16, one per parameter
};

Rank MakeRank(const std::vector<int64_t>& sizes, int64_t n) {
  at::manual_seed(7);
  Rank r;
  r.st.master = at::randn({n});
  r.st.exp_avg = at::randn({n}).abs_() * 1e-3;
  r.st.exp_avg_sq = at::randn({n}).abs_() * 1e-6;
  r.st.step = at::full({}, 3.0);
  r.grad = at::randn({n}) * 1e-2;
  for (int64_t s : sizes) r.partitions.push_back(at::zeros({s}, at::kBFloat16));
  return r;
}

bool Same(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t h = 384, inter = 1032, layers = 16, vocab = 32000;
  int runs = 3;
  std::vector<int> thread_counts;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--hidden") h = std::atoll(v.c_str());
    else if (a == "--inter") inter = std::atoll(v.c_str());
    else if (a == "--layers") layers = std::atoll(v.c_str());
    else if (a == "--vocab") vocab = std::atoll(v.c_str());
    else if (a == "--runs") runs = std::atoi(v.c_str());
    else if (a == "--threads") {
      std::stringstream ss(v);
      for (std::string t; std::getline(ss, t, ',');) thread_counts.push_back(std::atoi(t.c_str()));
    } else {
      std::fprintf(stderr, "zero3_host_step_bench: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (thread_counts.empty()) thread_counts = {1, at::get_num_threads()};
  const std::vector<int64_t> sizes = LlamaSizes(h, inter, layers, vocab);
  std::vector<int64_t> offsets;
  int64_t n = 0;
  for (int64_t s : sizes) offsets.push_back(std::exchange(n, n + s));
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (size_t k = 0; k < sizes.size(); ++k) pieces.emplace_back(offsets[k], sizes[k]);
  OptimizerConfig o;
  o.lr = 1e-4;
  o.weight_decay = 0.01;
  o.decoupled_weight_decay = true;
  std::printf("ZeRO-3 offloaded step's host pieces: %zu parameters, %lld elements, best of %d\n", sizes.size(),
              static_cast<long long>(n), runs);
  std::printf("%7s %-34s %9s %9s %13s\n", "threads", "piece", "wall ms", "cpu ms", "cpu ns/elem");
  auto report = [&](int threads, const char* what, const Timed& t) {
    std::printf("%7d %-34s %9.2f %9.2f %13.3f\n", threads, what, t.wall * 1e3, t.cpu * 1e3,
                t.cpu * 1e9 / static_cast<double>(n));
    std::fflush(stdout);
  };
  for (int threads : thread_counts) {
    at::set_num_threads(threads);
    Timed t[6];
    for (int run = 0; run < runs; ++run) {
      Rank a = MakeRank(sizes, n), b = MakeRank(sizes, n);
      std::vector<double> norms_a, norms_b;
      t[0].Measure([&] {  // before
        for (const auto& [off, len] : pieces) norms_a.push_back(SumOfSquares(a.grad.narrow(0, off, len)));
      });
      t[1].Measure([&] { CpuAdamStep(a.st, a.grad, 0.5, o, o.lr); });
      t[2].Measure([&] { a.grad.zero_(); });
      t[3].Measure([&] {
        for (size_t k = 0; k < sizes.size(); ++k) a.partitions[k].copy_(a.st.master.narrow(0, offsets[k], sizes[k]));
      });
      t[4].Measure([&] { norms_b = PieceSumsOfSquares(b.grad, pieces); });  // after
      t[5].Measure([&] {
        const CpuAdamPass pass(b.st, b.grad, 0.5, o, o.lr);
        std::vector<CpuAdamPass::WeightOut> outs;
        for (size_t k = 0; k < sizes.size(); ++k) outs.push_back({offsets[k], b.partitions[k]});
        pass.RunInto(outs);
      });
      bool same = norms_a == norms_b && Same(a.st.master, b.st.master) && Same(a.st.exp_avg, b.st.exp_avg) &&
                  Same(a.st.exp_avg_sq, b.st.exp_avg_sq) && Same(a.grad, b.grad);
      for (size_t k = 0; k < sizes.size(); ++k) same = same && Same(a.partitions[k], b.partitions[k]);
      if (!same) {
        std::fprintf(stderr, "zero3_host_step_bench: before and after differ at %d threads\n", threads);
        return 1;
      }
    }
    const char* names[6] = {"before: norms, SumOfSquares each",
                            "before: CpuAdamStep",
                            "before: grad.zero_()",
                            "before: bf16 partitions copy_",
                            "after:  norms, PieceSumsOfSquares",
                            "after:  RunInto (update + bf16)"};
    for (int k = 0; k < 6; ++k) {
      report(threads, names[k], t[k]);
      if (k == 3)
        report(threads, "before: total",
               {t[0].wall + t[1].wall + t[2].wall + t[3].wall, t[0].cpu + t[1].cpu + t[2].cpu + t[3].cpu});
    }
    report(threads, "after:  total", {t[4].wall + t[5].wall, t[4].cpu + t[5].cpu});
  }
  std::printf("bits: before and after equal (norms, master, moments, gradient, partitions)\n");
  return 0;
}
