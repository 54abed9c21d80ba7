#include "ckpt/parallel.h"

namespace uckpt::ckpt {
namespace {
std::atomic<int> g_default_threads{0};
}

void SetDefaultThreads(int threads) { g_default_threads = threads > 0 ? threads : 0; }

int DefaultThreads() {
  const int set = g_default_threads.load();
  if (set > 0) return set;
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace uckpt::ckpt
