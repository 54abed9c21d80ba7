// Run as one rank of a launch: builds an Engine on a tiny module and prints
// this rank's host threads as the Engine left them, one line:
//   rank R torch T default D worker W load L
// torch: libtorch's intra-op threads (the host Adam's too); default: uckpt's
// own pools' default (copy engine, async save); worker: hashing/reading
// pools; load: checkpoint loading threads. Used by host_threads_test.sh.
#include <ATen/Parallel.h>
#include <torch/nn/modules/linear.h>

#include <cstdio>
#include <exception>

#include "ckpt/parallel.h"
#include "engine/staged_upload.h"
#include "uckpt/engine.h"

int main() {
  try {
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
    nlohmann::json config = {{"train_micro_batch_size_per_gpu", 1},
                             {"optimizer", {{"type", "Adam"}, {"params", {{"lr", 0.01}}}}}};
    uckpt::Engine engine(model, uckpt::Config::FromJson(config, "probe"));
    std::printf("rank %d torch %d default %d worker %d load %d\n", engine.settings().rank(), at::get_num_threads(),
                uckpt::ckpt::DefaultThreads(), uckpt::ckpt::WorkerThreads(0, 1000),
                uckpt::engine::DefaultLoadThreads());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "host_threads_probe: %s\n", e.what());
    return 1;
  }
}
