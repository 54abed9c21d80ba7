// FlatRuntime's backward side (flat_runtime.h): parameters' gradients bound
// into the flat gradient buffers, and each micro-step's reduction started
// and finished.
#include "engine/flat_runtime.h"

#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "engine/cpu_adam.h"
#include "engine/grad_numerics.h"
#include "engine/host_grad_copy.h"
#include "engine/overlap_reducer.h"
#include "engine/pinned_host.h"
#include "engine/unit_pipeline.h"

namespace uckpt::engine {

void FlatRuntime::BindGradients(const std::vector<std::vector<at::Tensor>>& params) {
  if (params.size() != groups_.size()) throw std::invalid_argument("BindGradients: wrong group count");
  // On Gloo, all-reduce the buffer DeepSpeed all-reduces (its
  // use_multi_rank_bucket_allreduce, the default): Gloo adds an element's dp
  // terms in an order set by the element's position, and the same layout
  // gives DeepSpeed's sums bit for bit at any dp, in bf16 and fp16 too.
  const bool overlap = s_.overlap_comm && s_.stage == 2 && groups_[0].layout.dp > 1;
  deepspeed_order_ = !overlap && groups_[0].layout.dp > 1 && comm_.backend() == "gloo";
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = groups_[gi];
    const auto& ps = params[gi];
    if (ps.size() != g.numels.size()) throw std::invalid_argument("BindGradients: wrong parameter count");
    g.params = ps;
    g.grad_views.clear();
    for (size_t k = 0; k < ps.size(); ++k) {
      g.grad_views.push_back(g.grad_flat.narrow(0, g.offsets[k], g.numels[k]).view(ps[k].sizes()));
      ps[k].mutable_grad() = g.grad_views.back();
    }
    if (g.host_copy) g.host_copy->Hook(ps);
    if (overlap)
      g.overlap =
          std::make_unique<OverlappedGradReducer>(comm_, ps, g.numels, g.grad_flat, g.layout.begin(partition_rank()),
                                                  g.layout.partition_size, s_.reduce_bucket_size);
    if (deepspeed_order_ && s_.stage == 2) {
      for (size_t k = 0; k < ps.size(); ++k) {
        at::Tensor p = ps[k];
        p.register_hook([&g, k](const at::Tensor& grad) {
          g.ready_order.push_back(static_cast<int>(k));
          return grad;
        });
      }
    }
  }
}

void FlatRuntime::PrepareBackward() {
  AwaitUpdate();
  const bool grads_live_in_dot_grad = s_.stage <= 1;  // DeepSpeed's, until the boundary (measured)
  // A reduced gradient not stepped on yet: this backward's copies would overwrite it.
  for (Group& g : groups_)
    if (g.in_host_copy) KeepHostCopyAsSum(g);
  for (Group& g : groups_)
    for (size_t k = 0; k < g.params.size(); ++k) {
      at::Tensor& grad = g.params[k].mutable_grad();
      if (grad.defined() && grad.unsafeGetTensorImpl() == g.grad_views[k].unsafeGetTensorImpl()) continue;
      c10::NoGradGuard no_grad;
      if (grads_live_in_dot_grad) g.grad_views[k].zero_();
      if (grad.defined()) g.grad_views[k].add_(grad);
      grad = g.grad_views[k];
    }
  // Overlapped reduction while accumulating: each bucket's share is added into the sum as it completes.
  for (Group& g : groups_)
    if (g.overlap)
      g.overlap->SetDestination(g.have_grad_partition && !s_.offload_optimizer_cpu ? g.grad_partition : at::Tensor());
}

at::Tensor FlatRuntime::AllReduceInDeepSpeedOrder(Group& g) {
  // DeepSpeed's stage-2 IPG buckets (stage 1: the same, in parameter order):
  // whole parameters in order, a bucket reduced when the next parameter would
  // overflow reduce_bucket_size, each divided by dp and all-reduced in the
  // model dtype (DeepSpeed's communication_data_type); the owner keeps its slice.
  std::vector<int> order;
  if (s_.stage == 2) {
    order = std::move(g.ready_order);
    g.ready_order.clear();
    // A parameter without a gradient this micro-step: DeepSpeed would not
    // reduce it either; its (zero) gradient goes last.
    std::vector<bool> seen(g.numels.size(), false);
    for (int k : order) seen.at(static_cast<size_t>(k)) = true;
    for (size_t k = 0; k < g.numels.size(); ++k)
      if (!seen[k]) order.push_back(static_cast<int>(k));
  } else {
    order.resize(g.numels.size());
    std::iota(order.begin(), order.end(), 0);
  }
  at::Tensor part = at::zeros({g.layout.partition_size}, g.grad_flat.options());
  size_t first = 0;
  while (first < order.size()) {
    size_t last = first;
    int64_t n = 0;
    while (last < order.size() && (last == first || n + g.numels[order[last]] <= s_.reduce_bucket_size))
      n += g.numels[order[last++]];
    std::vector<at::Tensor> pieces;
    for (size_t i = first; i < last; ++i)
      pieces.push_back(g.grad_flat.narrow(0, g.offsets[order[i]], g.numels[order[i]]));
    at::Tensor bucket = at::cat(pieces);  // a new tensor
    bucket.div_(static_cast<double>(g.layout.dp));
    comm_.AllReduceSum(bucket);
    int64_t at_bucket = 0;
    for (size_t i = first; i < last; ++i) {
      if (const int j = g.fragment_of[order[i]]; j >= 0) {
        const ckpt::Fragment& f = g.fragments[j];
        part.narrow(0, f.partition_offset, f.numel).copy_(bucket.narrow(0, at_bucket + f.param_offset, f.numel));
      }
      at_bucket += g.numels[order[i]];
    }
    first = last;
  }
  return part;
}

void FlatRuntime::BeginMicroStep(bool boundary) {
  AwaitUpdate();
  // Stages 0-1 keep accumulating on the device until the boundary: only its backward's copies count.
  for (Group& g : groups_)
    if (g.host_copy) g.host_copy->Arm(s_.stage == 2 || boundary);
}

void FlatRuntime::FinishBackward(bool boundary) {
  AwaitUpdate();
  for (Group& g : groups_) {
    if (s_.stage == 2 || boundary) {
      ReduceIntoPartition(g, boundary);
    } else if (g.host_copy) {
      g.host_copy->Discard();
    }
  }
}

}  // namespace uckpt::engine
