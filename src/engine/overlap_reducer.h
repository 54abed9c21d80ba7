// ZeRO stage 2 with overlap_comm: gradients are averaged over the ranks bucket
// by bucket while backward still runs, instead of after it.
//
// Buckets are contiguous ranges of the flat gradient buffer in reverse
// parameter order (the order backward produces them), whole parameters, about
// `bucket_numel` elements each (ckpt::PlanReverseBuckets). A post-hook on each parameter's gradient
// accumulator counts the bucket down; a complete bucket is copied (in the
// model dtype, DeepSpeed's communication_data_type), divided by dp and all-reduced asynchronously. Buckets start
// strictly in bucket order, so every rank issues the same collectives in the same order. A range may span several
// ranks' partitions, hence an all-reduce (not a reduce-scatter); each rank then keeps the part of its own partition.
//
// At most kInFlight buckets hold their copy at once (DeepSpeed keeps two
// IPG buffers): starting a bucket first retires the oldest one still held —
// waits for its all-reduce, puts this rank's share into the partition, frees
// the copy. Held to the end of backward, the copies would be the whole
// gradient, not this rank's partition of it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/grad_hooks.h"
#include "uckpt/comm.h"

namespace uckpt::engine {

class OverlappedGradReducer {
 public:
  // `params`: leaves whose .grad are views into `grad_flat` at the flat
  // offsets of `numels`. This rank owns grad_flat[partition_begin, +partition_size).
  OverlappedGradReducer(Comm& comm, const std::vector<at::Tensor>& params, const std::vector<int64_t>& numels,
                        at::Tensor grad_flat, int64_t partition_begin, int64_t partition_size, int64_t bucket_numel);
  ~OverlappedGradReducer();
  OverlappedGradReducer(const OverlappedGradReducer&) = delete;
  OverlappedGradReducer& operator=(const OverlappedGradReducer&) = delete;

  // Before a backward: the partition [partition_size] (grad_flat's dtype) this backward's
  // averaged gradient is added into (the sum of the step's earlier
  // micro-steps), or undefined: a new one, zeros and then this backward's
  // average. Finish() forgets it.
  void SetDestination(at::Tensor sum);
  // After backward: starts any bucket whose hooks did not all fire, waits for
  // all of them and returns this rank's partition of the averaged gradient:
  // the destination with it added, else a new [partition_size] in grad_flat's dtype. The
  // caller zeroes grad_flat afterwards.
  at::Tensor Finish();

  static constexpr size_t kInFlight = 2;

  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  // Buckets started by the hooks (during backward) rather than by Finish(), over all steps.
  int64_t started_during_backward() const { return started_during_backward_; }

 private:
  struct Bucket {
    int64_t begin = 0, numel = 0;  // range of the flat buffer
    int params = 0;                // hooks to wait for
    int pending = 0;               // hooks still to fire; <= 0: ready to start
    at::Tensor copy;               // the averaged values once started
    std::unique_ptr<Comm::Pending> work;
  };
  void OnGradReady(size_t bucket);
  size_t StartReadyBuckets();  // with mu_ held; returns how many it started
  void Retire(Bucket& b);      // with mu_ held: waits, adds this rank's share, frees the copy

  Comm& comm_;
  at::Tensor grad_flat_;
  int64_t part_begin_, part_size_;
  std::vector<Bucket> buckets_;
  size_t next_ = 0;     // the next bucket to start
  size_t retired_ = 0;  // buckets before it are in the partition
  at::Tensor part_;     // this backward's destination (undefined until set or needed)
  bool add_ = false;    // part_ is a sum to add to (else it was made zero here)
  int64_t started_during_backward_ = 0;
  std::mutex mu_;
  GradAccumulatedHooks hooks_;
};

}  // namespace uckpt::engine
