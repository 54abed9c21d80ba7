#include "engine/host_threads.h"

#include <ATen/Parallel.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "ckpt/parallel.h"

namespace uckpt::engine {
namespace {

std::atomic<int> g_applied{0};  // the budget ApplyHostThreads last applied; 0: never
std::atomic<int> g_ours{0};     // libtorch's count as uckpt set it by its own choice; 0: not ours
std::mutex g_print_mu;
int g_printed = 0;  // the count last printed

std::string Plural(int n, const char* one, const char* many) { return std::to_string(n) + " " + (n == 1 ? one : many); }

std::string Share(const HostThreadInputs& in) {
  return Plural(in.cores, "core", "cores") + " / " + Plural(in.local_ranks, "local rank", "local ranks");
}

// A positive thread count from `text` (surrounding blanks allowed), else
// std::invalid_argument naming `name`.
int ParseCount(const char* name, const std::string& text) {
  const size_t b = text.find_first_not_of(" \t");
  const size_t e = text.find_last_not_of(" \t");
  const std::string t = b == std::string::npos ? "" : text.substr(b, e - b + 1);
  char* end = nullptr;
  errno = 0;
  const long v = t.empty() ? 0 : std::strtol(t.c_str(), &end, 10);
  if (t.empty() || *end != '\0' || errno != 0 || v < 1 || v > 1 << 20)
    throw std::invalid_argument(std::string(name) + "='" + text + "': not a positive number");
  return static_cast<int>(v);
}

// The variable's count, 0 when unset or empty.
int EnvCount(const char* name, bool first_level = false) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  std::string text = v;
  if (first_level) text = text.substr(0, text.find(','));  // OpenMP's nested list: "4,2"
  return ParseCount(name, text);
}

// CPUs in this process's affinity mask; every online CPU where it cannot be read.
int AffinityCores() {
  for (int size = 1024; size <= (1 << 16); size *= 4) {
    cpu_set_t* set = CPU_ALLOC(size);
    if (!set) break;
    const size_t bytes = CPU_ALLOC_SIZE(size);
    CPU_ZERO_S(bytes, set);
    const int rc = sched_getaffinity(0, bytes, set);
    const int n = CPU_COUNT_S(bytes, set);
    CPU_FREE(set);
    if (rc == 0) return std::max(1, n);
    if (errno != EINVAL) break;  // EINVAL: more CPUs than the mask holds
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int LocalRanks() {
  for (const char* name : {"LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"})
    if (int n = EnvCount(name)) return n;
  return 1;
}

}  // namespace

std::string HostThreadChoice::Message() const {
  return "uckpt: " + Plural(threads, "host thread", "host threads") + " per rank (" + why + ")";
}

HostThreadChoice ChooseHostThreads(const HostThreadInputs& in) {
  const int split = std::max(1, std::max(1, in.cores) / std::max(1, in.local_ranks));
  const bool bounded = in.libtorch_default > 0 && in.libtorch_default < split;
  const int share = bounded ? in.libtorch_default : split;
  auto above_share = [&](int n) {
    return n > share ? "; above this rank's share of " + std::to_string(share) + ": " + Share(in) +
                           (bounded ? ", at most libtorch's default" : "")
                     : std::string();
  };
  if (in.requested > 0)
    return {in.requested, in.requested_by + " " + std::to_string(in.requested) + above_share(in.requested)};
  if (in.program_threads > 0)
    return {in.program_threads,
            "set by the program (torch.set_num_threads / at::set_num_threads)" + above_share(in.program_threads)};
  if (in.omp_num_threads > 0)
    return {in.omp_num_threads,
            "OMP_NUM_THREADS=" + std::to_string(in.omp_num_threads) + above_share(in.omp_num_threads)};
  const std::string bound = bounded ? ", at most libtorch's default of " + std::to_string(share) : "";
  return {share, Share(in) + bound + "; " + in.how_to_change};
}

HostThreadInputs HostThreadInputsFromProcess(int requested, const std::string& requested_by,
                                             const std::string& how_to_change) {
  if (requested < 0) throw std::invalid_argument(requested_by + ": " + std::to_string(requested) + " threads");
  HostThreadInputs in;
  const int test_cores = EnvCount("UCKPT_HOST_CORES");
  const int affinity = AffinityCores();
  in.cores = test_cores ? test_cores : affinity;
  in.local_ranks = LocalRanks();
  in.requested = requested;
  in.requested_by = requested_by;
  in.omp_num_threads = EnvCount("OMP_NUM_THREADS", /*first_level=*/true);
  in.how_to_change = how_to_change;
  // libtorch starts at its default (OMP_NUM_THREADS when set; PyTorch 2.x caps
  // that at the cores this process may run on); any other count that uckpt did
  // not set by its own choice came from the program.
  const int now = at::get_num_threads();
  const int libtorch_default = at::intraop_default_num_threads();
  const bool libtorch_start = now == libtorch_default || now == std::min(libtorch_default, affinity);
  if (!libtorch_start && now != g_ours.load()) in.program_threads = now;
  in.libtorch_default = test_cores ? test_cores : libtorch_default;
  return in;
}

HostThreadChoice ApplyHostThreads(int requested, const std::string& requested_by, const std::string& how_to_change,
                                  bool print) {
  const HostThreadInputs in = HostThreadInputsFromProcess(requested, requested_by, how_to_change);
  const HostThreadChoice choice = ChooseHostThreads(in);
  const bool programs = in.requested == 0 && in.program_threads > 0;  // libtorch already has it
  if (!programs) at::set_num_threads(choice.threads);
  g_ours = programs ? 0 : choice.threads;
  g_applied = choice.threads;
  ckpt::SetDefaultThreads(choice.threads);
  if (print) {
    std::lock_guard<std::mutex> lock(g_print_mu);
    if (g_printed != choice.threads) std::fprintf(stderr, "%s\n", choice.Message().c_str());
    g_printed = choice.threads;
  }
  return choice;
}

int HostThreads() {
  const int applied = g_applied.load();
  return applied > 0 ? applied : at::get_num_threads();
}

}  // namespace uckpt::engine
