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
#include "engine/pinned_host.h"

namespace uckpt::engine {
BucketedHostCopy::BucketedHostCopy(const std::vector<int64_t>& numels, at::Tensor grad_flat, int64_t bucket_numel)
    : grad_flat_(std::move(grad_flat)) {
  const at::Device device = grad_flat_.device();
  host_ = device.is_cuda() ? PinnedHostZeros({grad_flat_.numel()}, grad_flat_.scalar_type())
                           : at::empty({grad_flat_.numel()}, grad_flat_.options().device(at::kCPU));
  ckpt::ReverseBuckets plan = ckpt::PlanReverseBuckets(numels, bucket_numel);
  for (const auto& p : plan.buckets) buckets_.push_back(Bucket{p.begin, p.numel, p.params, 0, false});
  bucket_of_ = std::move(plan.bucket_of);
  // Together they cover the whole buffer: the first (the last parameters) takes the padding too.
  if (buckets_.empty()) buckets_.push_back(Bucket{0, 0, 0, 0, false});
  buckets_.front().numel = grad_flat_.numel() - buckets_.front().begin;
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
  hooks_.Set(
      params, [this](size_t k) { OnGradReady(k); }, "BucketedHostCopy");
}

void BucketedHostCopy::Unhook() { hooks_.Clear(); }

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

void BucketedHostCopy::Arm(bool copy_during_backward) {
  std::lock_guard<std::mutex> lock(mu_);
  Rearm();  // what a backward the engine did not start left counted
  copy_during_backward_ = copy_during_backward;
}

void BucketedHostCopy::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Bucket& b : buckets_)
    if (!b.copied) Copy(b);  // a parameter without gradient left it short, or copies were off
  Rearm();
  copy_during_backward_ = false;
  if (on_device()) {
    c10::impl::VirtualGuardImpl impl(grad_flat_.device().type());
    copied_->record(*stream_);
    copied_->block(impl.getStream(grad_flat_.device()));
  }
}

void BucketedHostCopy::Discard() {
  std::lock_guard<std::mutex> lock(mu_);
  Rearm();
  copy_during_backward_ = false;
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
