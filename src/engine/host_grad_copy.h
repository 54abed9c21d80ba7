// offload_optimizer where one rank holds the whole gradient (world size 1):
// each bucket of the flat gradient buffer goes to host memory as soon as
// backward has finished it, in the model dtype, on a side stream of the
// device while backward goes on. The host update widens it to fp32 as it
// reads it (exact), so the device neither converts the buffer nor waits for
// one large copy after backward.
//
// Buckets are ranges of whole parameters in reverse flat order (the order
// backward produces their gradients), about `bucket_numel` elements each
// (ckpt::PlanReverseBuckets), together covering the whole buffer, padding included. A post-hook on each
// parameter's gradient accumulator counts its bucket down; a complete bucket
// is copied after an event recorded on the stream that accumulated it. On
// the CPU the copy happens at once.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "engine/grad_hooks.h"

namespace uckpt::engine {

class BucketedHostCopy {
 public:
  // `numels`: the parameters' sizes in flat order; `grad_flat` holds their
  // gradients from offset 0 on (and padding after them).
  BucketedHostCopy(const std::vector<int64_t>& numels, at::Tensor grad_flat, int64_t bucket_numel);
  ~BucketedHostCopy();
  BucketedHostCopy(const BucketedHostCopy&) = delete;
  BucketedHostCopy& operator=(const BucketedHostCopy&) = delete;

  // Hooks `params` (leaves whose .grad are views into grad_flat, in flat
  // order; replacing any hooked before): from now on a bucket is copied
  // during backward once each of its parameters' gradients was accumulated.
  // Without it, Finish copies everything.
  void Hook(const std::vector<at::Tensor>& params);
  // Before the engine's backward: whether the hooks copy during it (off for
  // a backward whose gradient keeps accumulating on the device: only the
  // last one's copy is used). Finish and Discard disarm them again, so a
  // backward the engine did not start (a script's own loss.backward()) never
  // copies over a gradient waiting for its step; Finish copies what is left.
  void Arm(bool copy_during_backward);

  // After backward: copies every bucket not copied yet (also one of whose
  // parameters' gradient was accumulated again after its copy), and makes
  // the device's current stream wait for every copy, so that grad_flat may be
  // overwritten next. The host does not wait.
  void Finish();
  // After a backward whose gradient stays on the device to accumulate
  // (stages 0-1 before the boundary): what it copied, if anything, is
  // superseded by the next Finish's copies.
  void Discard();
  // The host copy of grad_flat ([grad_flat.numel()], model dtype), once every
  // copy Finish issued has landed (the host waits for them here).
  const at::Tensor& Host();

  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  // Buckets copied by the hooks during backward rather than by Finish, over all backward passes.
  int64_t copied_during_backward() const { return copied_during_backward_; }

 private:
  struct Bucket {
    int64_t begin = 0, numel = 0;  // range of the flat buffer
    int params = 0;                // distinct parameters to wait for
    int pending = 0;               // of them, still to come this backward
    bool copied = false;           // this backward, with its final values
  };
  void OnGradReady(size_t param);
  void Unhook();
  void Rearm();          // with mu_ held: ready for the next backward
  void Copy(Bucket& b);  // with mu_ held
  bool on_device() const { return stream_.has_value(); }

  at::Tensor grad_flat_, host_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;      // per parameter
  std::vector<uint8_t> fired_;         // per parameter: its gradient was accumulated this backward
  bool copy_during_backward_ = false;  // armed by Arm for one backward
  int64_t copied_during_backward_ = 0;
  std::optional<c10::Stream> stream_;         // the copies' side stream (a GPU's)
  std::optional<c10::Event> ready_, copied_;  // compute -> copies, copies -> compute
  std::mutex mu_;
  GradAccumulatedHooks hooks_;
};

}  // namespace uckpt::engine
