#include "engine/grad_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <stdexcept>

namespace uckpt::engine {
namespace {

class AccumulatedHook : public torch::autograd::FunctionPostHook {
 public:
  explicit AccumulatedHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

void GradAccumulatedHooks::Set(const std::vector<at::Tensor>& params, std::function<void(size_t)> on_ready,
                               const std::string& owner) {
  Clear();
  for (size_t k = 0; k < params.size(); ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(params[k]);
    if (!acc) throw std::invalid_argument(owner + ": parameter " + std::to_string(k) + " is not a leaf");
    keys_.push_back(acc->add_post_hook(std::make_unique<AccumulatedHook>([on_ready, k] { on_ready(k); })));
    accumulators_.push_back(std::move(acc));
  }
}

void GradAccumulatedHooks::Clear() {
  for (size_t k = 0; k < accumulators_.size(); ++k) accumulators_[k]->del_post_hook(keys_[k]);
  accumulators_.clear();
  keys_.clear();
}

}  // namespace uckpt::engine
