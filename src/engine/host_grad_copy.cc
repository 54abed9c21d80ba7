#include "engine/host_grad_copy.h"

#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>

#include "ckpt/partition.h"

namespace uckpt::engine {
namespace {

// Runs after AccumulateGrad added a parameter's gradient into its .grad view.
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

BucketedHostCopy::BucketedHostCopy(const std::vector<int64_t>& numels, at::Tensor grad_flat, int64_t bucket_numel)
    : grad_flat_(std::move(grad_flat)) {
  const at::Device device = grad_flat_.device();
  host_ = at::empty({grad_flat_.numel()},
                    grad_flat_.options().device(at::kCPU).pinned_memory(device.is_cuda()));
  const auto offsets = ckpt::FlatOffsets(numels);
  bucket_of_.resize(numels.size());
  int64_t end = grad_flat_.numel();  // the first bucket (the last parameters) takes the padding too
  for (size_t j = numels.size(); j-- > 0;) {
    if (buckets_.empty() || buckets_.back().numel >= bucket_numel) {
      if (!buckets_.empty()) end = buckets_.back().begin;
      buckets_.push_back(Bucket{end, 0, 0, 0, false});
    }
    Bucket& b = buckets_.back();
    b.begin = offsets[j];
    b.numel = end - b.begin;
    ++b.params;
    bucket_of_[j] = buckets_.size() - 1;
  }
  if (buckets_.empty()) buckets_.push_back(Bucket{0, grad_flat_.numel(), 0, 0, false});
  buckets_.back().numel += buckets_.back().begin;  // from offset 0 (the first parameter's)
  buckets_.back().begin = 0;
  for (Bucket& b : buckets_) b.pending = b.params;
  fired_.assign(numels.size(), 0);
  if (!device.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    stream_ = impl.getStreamFromGlobalPool(device);
    ready_.emplace(device.type());
    copied_.emplace(device.type());
  }
}

BucketedHostCopy::~BucketedHostCopy() {
  Unhook();
  if (stream_) {
    try {
      stream_->synchronize();  // no copy into host_ outlives it
    } catch (...) {
      // An error is already on its way out.
    }
  }
}

void BucketedHostCopy::Hook(const std::vector<at::Tensor>& params) {
  if (params.size() != bucket_of_.size()) throw std::invalid_argument("BucketedHostCopy: wrong parameter count");
  Unhook();
  for (size_t k = 0; k < params.size(); ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(params[k]);
    if (!acc) throw std::invalid_argument("BucketedHostCopy: parameter " + std::to_string(k) + " is not a leaf");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<AccumulatedHook>([this, k] { OnGradReady(k); })));
    accumulators_.push_back(std::move(acc));
  }
}

void BucketedHostCopy::Unhook() {
  for (size_t k = 0; k < accumulators_.size(); ++k) accumulators_[k]->del_post_hook(hook_keys_[k]);
  accumulators_.clear();
  hook_keys_.clear();
}

void BucketedHostCopy::OnGradReady(size_t param) {
  std::lock_guard<std::mutex> lock(mu_);
  Bucket& b = buckets_[bucket_of_[param]];
  if (fired_[param]) {
    b.copied = false;  // accumulated again (a reentrant backward): Finish copies the final values
    return;
  }
  fired_[param] = 1;
  if (--b.pending == 0 && copy_during_backward_) {
    Copy(b);
    ++copied_during_backward_;
  }
}

void BucketedHostCopy::Copy(Bucket& b) {
  c10::NoGradGuard no_grad;
  at::Tensor to = host_.narrow(0, b.begin, b.numel);
  const at::Tensor from = grad_flat_.narrow(0, b.begin, b.numel);
  b.copied = true;
  if (!on_device()) {
    to.copy_(from);
    return;
  }
  // After the kernels that accumulated the bucket (queued on this thread's
  // current stream: autograd's for the hook, the caller's for Finish).
  c10::impl::VirtualGuardImpl impl(grad_flat_.device().type());
  ready_->record(impl.getStream(grad_flat_.device()));
  ready_->block(*stream_);
  c10::StreamGuard guard(*stream_);
  to.copy_(from, /*non_blocking=*/true);
}

void BucketedHostCopy::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Bucket& b : buckets_)
    if (!b.copied) Copy(b);  // a parameter without gradient left it short, or copies were off
  Rearm();
  if (on_device()) {
    c10::impl::VirtualGuardImpl impl(grad_flat_.device().type());
    copied_->record(*stream_);
    copied_->block(impl.getStream(grad_flat_.device()));
  }
}

void BucketedHostCopy::Discard() {
  std::lock_guard<std::mutex> lock(mu_);
  Rearm();
}

void BucketedHostCopy::Rearm() {
  for (Bucket& b : buckets_) {
    b.copied = false;
    b.pending = b.params;
  }
  std::fill(fired_.begin(), fired_.end(), 0);
}

const at::Tensor& BucketedHostCopy::Host() {
  if (stream_) stream_->synchronize();
  return host_;
}

}  // namespace uckpt::engine
