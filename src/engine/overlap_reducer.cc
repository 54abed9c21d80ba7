#include "engine/overlap_reducer.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "ckpt/partition.h"

namespace uckpt::engine {
OverlappedGradReducer::OverlappedGradReducer(Comm& comm, const std::vector<at::Tensor>& params,
                                             const std::vector<int64_t>& numels, at::Tensor grad_flat,
                                             int64_t partition_begin, int64_t partition_size, int64_t bucket_numel)
    : comm_(comm), grad_flat_(std::move(grad_flat)), part_begin_(partition_begin), part_size_(partition_size) {
  if (params.size() != numels.size()) throw std::invalid_argument("OverlappedGradReducer: wrong parameter count");
  // Buckets from the last parameter backwards; bucket_of[k] for parameter k.
  ckpt::ReverseBuckets plan = ckpt::PlanReverseBuckets(numels, bucket_numel);
  for (const auto& p : plan.buckets) {
    buckets_.emplace_back();
    buckets_.back().begin = p.begin;
    buckets_.back().numel = p.numel;
    buckets_.back().params = p.params;
  }
  for (auto& b : buckets_) b.pending = b.params;
  hooks_.Set(
      params, [this, bucket_of = std::move(plan.bucket_of)](size_t k) { OnGradReady(bucket_of[k]); },
      "OverlappedGradReducer");
}

OverlappedGradReducer::~OverlappedGradReducer() = default;

void OverlappedGradReducer::OnGradReady(size_t bucket) {
  std::lock_guard<std::mutex> lock(mu_);
  --buckets_[bucket].pending;
  started_during_backward_ += static_cast<int64_t>(StartReadyBuckets());
}

size_t OverlappedGradReducer::StartReadyBuckets() {
  c10::NoGradGuard no_grad;
  const double dp = comm_.world_size();
  const size_t first = next_;
  while (next_ < buckets_.size() && buckets_[next_].pending <= 0) {
    while (next_ - retired_ >= kInFlight) Retire(buckets_[retired_++]);
    Bucket& b = buckets_[next_++];
    // DeepSpeed's average_tensor: divide by dp, then sum over ranks (in the model dtype).
    b.copy = grad_flat_.narrow(0, b.begin, b.numel).clone();
    b.copy.div_(dp);
    b.work = comm_.StartAllReduceSum(b.copy);
  }
  return next_ - first;
}

void OverlappedGradReducer::Retire(Bucket& b) {
  c10::NoGradGuard no_grad;
  b.work->Wait();
  if (!part_.defined()) {
    part_ = at::zeros({part_size_}, grad_flat_.options());
    add_ = false;
  }
  const int64_t lo = std::max(b.begin, part_begin_), hi = std::min(b.begin + b.numel, part_begin_ + part_size_);
  if (lo < hi) {
    at::Tensor dst = part_.narrow(0, lo - part_begin_, hi - lo);
    const at::Tensor src = b.copy.narrow(0, lo - b.begin, hi - lo);
    // (Added: the same sum as the caller adding a partition of these values afterwards.)
    if (add_) {
      dst.add_(src);
    } else {
      dst.copy_(src);
    }
  }
  b.copy = at::Tensor();
  b.work.reset();
}

void OverlappedGradReducer::SetDestination(at::Tensor sum) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sum.defined() && (sum.numel() != part_size_ || sum.scalar_type() != grad_flat_.scalar_type()))
    throw std::invalid_argument(
        "OverlappedGradReducer::SetDestination: not a partition of this rank in the model dtype");
  part_ = std::move(sum);
  add_ = part_.defined();
}

at::Tensor OverlappedGradReducer::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& b : buckets_) b.pending = 0;  // a parameter without gradient leaves its bucket short
  StartReadyBuckets();
  while (retired_ < buckets_.size()) Retire(buckets_[retired_++]);
  if (!part_.defined()) part_ = at::zeros({part_size_}, grad_flat_.options());  // no bucket
  for (Bucket& b : buckets_) b.pending = b.params;
  next_ = 0;
  retired_ = 0;
  add_ = false;
  return std::exchange(part_, at::Tensor());
}

}  // namespace uckpt::engine
