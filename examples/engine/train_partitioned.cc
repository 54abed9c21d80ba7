// A model built partitioned at ZeRO stage 3 (uckpt::ZeroInit, DeepSpeed's
// zero.Init for C++): each block is partitioned across the ranks as soon as
// it is built, so no rank ever holds the whole model; the same seed gives the
// whole build's values, so the losses are the whole build's bit for bit.
//
//   uckpt launch -n 2 -- train_partitioned            # built partitioned
//   uckpt launch -n 2 -- train_partitioned --whole    # the same model built whole: the same losses
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/utils.h>
#include <uckpt/engine.h>
#include <uckpt/zero_init.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace {

constexpr int64_t kWidth = 256, kLayers = 8, kSteps = 3;

// One gather unit: a residual MLP block.
struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
  BlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    up = register_module("up", torch::nn::Linear(kWidth, 4 * kWidth));
    down = register_module("down", torch::nn::Linear(4 * kWidth, kWidth));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down(at::gelu(up(norm(x)))); }
};

// The model: every block goes through ZeroInit::Built as it is built (whole
// outside a ZeroInit scope), then the head.
struct Net : torch::nn::Module {
  std::vector<std::shared_ptr<BlockImpl>> blocks;
  torch::nn::Linear head{nullptr};
  Net() {
    for (int64_t i = 0; i < kLayers; ++i)
      blocks.push_back(register_module("h" + std::to_string(i), uckpt::ZeroInit::Built(std::make_shared<BlockImpl>())));
    head = register_module("head", torch::nn::Linear(kWidth, 1));
  }
  at::Tensor Loss(const at::Tensor& x_in, const at::Tensor& y, const uckpt::UnitCalls& calls) {
    at::Tensor x = x_in;
    for (size_t i = 0; i < blocks.size(); ++i) x = calls.Exit(i, blocks[i]->forward(calls.Enter(i, x)));
    return (head(x) - y).pow(2).mean();
  }
};

uckpt::Config StageThree() {
  return uckpt::Config::FromJson({{"train_micro_batch_size_per_gpu", 8},
                                  {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-4}}}}},
                                  {"zero_optimization", {{"stage", 3}}}},
                                 "train_partitioned's config");
}

}  // namespace

int main(int argc, char** argv) try {
  const bool whole = argc > 1 && std::string(argv[1]) == "--whole";
  if (argc > 2 || (argc == 2 && !whole)) throw std::invalid_argument("usage: train_partitioned [--whole]");
  torch::manual_seed(1234);  // the program's generator builds the blocks, whole or partitioned
  const uckpt::Config config = StageThree();
  uckpt::EngineOptions options;
  std::shared_ptr<Net> net;
  int64_t held = 0;
  if (whole) {
    net = std::make_shared<Net>();
  } else {
    uckpt::ZeroInit init(config, options);                  // this thread's construction scope
    net = uckpt::ZeroInit::Built(std::make_shared<Net>());  // the head partitioned too
    held = init.partition_bytes();
    init.AddTo(options);  // partitions + communicator, for the engine
  }
  options.gather_units.assign(net->blocks.begin(), net->blocks.end());
  uckpt::Engine engine(net, config, std::move(options));
  const uckpt::Engine::Settings& settings = engine.settings();  // rank, batch sizes, device
  int64_t whole_bytes = 0;
  for (const auto& p : net->parameters()) whole_bytes += p.numel() * static_cast<int64_t>(p.element_size());
  if (settings.rank() == 0 && !whole)
    std::printf("built partitioned: rank 0 held %lld bytes of partitions; the whole model is %lld bytes\n",
                static_cast<long long>(held), static_cast<long long>(whole_bytes));

  const uckpt::UnitCalls calls = engine.unit_calls();
  // One batch per rank, fitted step after step (the loss falls).
  at::Generator data = at::make_generator<at::CPUGeneratorImpl>(100 + settings.rank());
  const at::Tensor x = at::randn({8, kWidth}, data), y = at::randn({8, 1}, data);
  for (int64_t step = 0; step < kSteps; ++step) {
    at::Tensor loss = net->Loss(x, y, calls);
    // Rank 0's loss of its own micro-batch, every digit.
    if (settings.rank() == 0) std::printf("step %lld loss %.17g\n", static_cast<long long>(step), loss.item<double>());
    engine.Backward(loss);
    engine.Step();
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "train_partitioned: " << e.what() << "\n";
  return 1;
}
