// A callback after autograd has accumulated a parameter's gradient: the one
// mechanism the overlapped reducer and the bucketed host copy start their
// per-bucket work from.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace uckpt::engine {

// Post-hooks on the parameters' AccumulateGrad nodes: `on_ready(k)` runs
// after parameter k's gradient was added into its .grad (on the thread
// autograd runs that node on), once per backward in which it gets one.
// Removed by Clear() or the destructor.
class GradAccumulatedHooks {
 public:
  GradAccumulatedHooks() = default;
  ~GradAccumulatedHooks() { Clear(); }
  GradAccumulatedHooks(const GradAccumulatedHooks&) = delete;
  GradAccumulatedHooks& operator=(const GradAccumulatedHooks&) = delete;

  // Replaces any hooks set before. `owner` names the caller in the error
  // thrown for a parameter that is not a leaf.
  void Set(const std::vector<at::Tensor>& params, std::function<void(size_t)> on_ready, const std::string& owner);
  void Clear();

 private:
  // The accumulators, held as libtorch hands them out (a shared_ptr before PyTorch 2.15, an
  // intrusive_ptr from it on).
  using NodeRef = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodeRef> accumulators_;
  std::vector<uintptr_t> keys_;
};

}  // namespace uckpt::engine
