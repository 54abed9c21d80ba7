// The module's tensors as the engine took them over, and its counters: the
// parts of the engine's state (engine_impl.h) that its helpers (the runtime
// factory, weights, checkpoint and fingerprint code) take on their own.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace uckpt {

struct NamedParam {
  std::string name;
  at::Tensor tensor;
};

namespace engine {

// The module's tensors as the engine took them over, by role: what the
// weights, checkpoint and fingerprint code read (not the engine's whole state).
struct ModuleTensors {
  std::shared_ptr<torch::nn::Module> model;
  // Trainable parameters by optimizer group, in flat order: views into the
  // group's flat buffer once the optimizer exists.
  std::vector<std::vector<NamedParam>> groups;
  std::vector<NamedParam> frozen;                            // requires_grad false (or in no group), own storage
  std::vector<std::pair<std::string, std::string>> aliases;  // tied: alias name -> owner name
  std::vector<NamedParam> buffers;                           // persistent buffers
  // The module's state_dict names in PyTorch's order (params, then buffers,
  // of each module, then its children), aliases included.
  std::vector<std::string> state_names;
  std::vector<std::string> module_prefixes;  // "" and every submodule (state_dict _metadata)
};

// DeepSpeed's engine counters (saved in the model-states file).
struct StepCounters {
  int64_t global_steps = 0, global_samples = 0, skipped_steps = 0, micro_steps = 0;
  bool last_step_skipped = false;  // the optimizer's `overflow` in its state_dict
};

}  // namespace engine

}  // namespace uckpt
