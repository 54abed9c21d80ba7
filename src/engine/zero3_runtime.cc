#include "engine/zero3_runtime.h"

#include <c10/core/GradMode.h>

#include <cmath>
#include <set>
#include <stdexcept>

#include "ckpt/partition.h"
#include "engine/cpu_adam.h"
#include "engine/grad_numerics.h"
#include "engine/pinned_host.h"

namespace uckpt::engine {
namespace {

at::Tensor HostOrDevice(at::IntArrayRef sizes, at::ScalarType dtype, at::Device device, bool host) {
  auto o = at::TensorOptions().dtype(dtype);
  if (!host || device.is_cpu()) return at::zeros(sizes, o.device(device));
  return PinnedHostZeros(sizes, dtype);  // pinned: copies to the GPU overlap
}

}  // namespace

Zero3Runtime::Zero3Runtime(Comm& comm, std::vector<std::vector<std::pair<std::string, at::Tensor>>> groups,
                           std::vector<OptimizerConfig> group_optimizers, const std::vector<std::vector<int>>& unit_of,
                           int num_units, Zero3Settings settings, at::Device device,
                           const std::map<const void*, at::Tensor>& given)
    : comm_(comm), s_(std::move(settings)), device_(device), group_optimizers_(std::move(group_optimizers)) {
  if (groups.empty() || groups.size() != group_optimizers_.size() || unit_of.size() != groups.size())
    throw std::invalid_argument("Zero3Runtime: parameter groups, optimizers and units do not match");
  const int dp = comm_.world_size();
  const at::ScalarType dtype = s_.base.model_dtype;
  c10::NoGradGuard no_grad;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<int64_t> numels;
    for (const auto& [name, t] : groups[g]) numels.push_back(t.numel());
    size_t k = 0;
    for (size_t count : ckpt::Stage3SubGroups(numels, dp, s_.sub_group_size)) {
      Zero3SubGroup sg;
      sg.group = g;
      int64_t total = 0;
      for (size_t end = k + count; k < end; ++k) {
        Zero3Param p;
        p.name = groups[g][k].first;
        p.tensor = groups[g][k].second;
        p.group = g;
        p.numel = p.tensor.numel();
        p.partition_size = ckpt::Stage3PartitionSize(p.numel, dp);
        p.unit = unit_of[g][k];
        if (p.unit >= num_units) throw std::invalid_argument("Zero3Runtime: unit index out of range for " + p.name);
        p.persistent = p.numel <= s_.persistence_threshold;
        p.sub_group = subs_.size();
        p.offset = total;
        total += p.partition_size;
        p.partition = HostOrDevice({p.partition_size}, dtype, device_, s_.offload_param_cpu);
        if (auto it = given.find(p.tensor.unsafeGetTensorImpl()); it != given.end()) {
          if (it->second.numel() != p.partition_size)
            throw std::invalid_argument(
                "uckpt::Engine: " + p.name + " arrived partitioned with " + std::to_string(it->second.numel()) +
                " elements per rank; at " + std::to_string(dp) + " ranks its partition has " +
                std::to_string(p.partition_size) + " (was it partitioned at another world size?)");
          p.partition.copy_(it->second.reshape({-1}));
          p.live = 0;  // no bytes (StoragelessTensor)
        } else {
          // The module's tensor gets storage of its own, exactly numel long
          // (freed and re-allocated as a whole), holding the whole value now.
          p.tensor.set_data(p.tensor.detach().contiguous().clone());
          p.partition.copy_(RankSlot(p.tensor, dp, comm_.rank()));
          p.live = 1;
        }
        sg.params.push_back(params_.size());
        params_.push_back(std::move(p));
      }
      const bool host = s_.base.offload_optimizer_cpu;
      sg.state.master = HostOrDevice({total}, at::kFloat, device_, host);
      for (size_t i : sg.params)
        sg.state.master.narrow(0, params_[i].offset, params_[i].partition_size).copy_(params_[i].partition);
      sg.grad_dtype = s_.base.grad_accum_dtype;
      if (host) sg.grad = HostOrDevice({total}, sg.grad_dtype, device_, host);
      subs_.push_back(std::move(sg));
    }
  }
  // Unit parameters stay gathered until the model first enters a unit; the
  // root and persistent ones stay gathered for good. From partitions, the
  // units start sharded.
  units_.Build(params_, num_units, /*start_whole=*/given.empty());
  if (!given.empty()) StartFromPartitions();
  if (dtype == at::kHalf) scaler_ = LossScaler::FromConfig(s_.base.fp16);
}

// The root and persistent parameters that arrived partitioned, gathered for
// good (one all-gather; the same list on every rank).
void Zero3Runtime::StartFromPartitions() {
  std::vector<size_t> need;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Zero3Param& p = params_[i];
    if ((p.unit < 0 || p.persistent) && p.live == 0 && storage_.Hold(i)) need.push_back(i);
  }
  storage_.Fetch(need);
}

// DeepSpeed's stage-3 global norm (grad_numerics.h): each parameter
// partition's fp64 norm, summed in fp64 per sub-group over the ranks.
at::Tensor Zero3Runtime::GlobalNorm(bool* finite) {
  std::vector<at::Tensor> group_norms;
  for (Zero3SubGroup& sg : subs_) {
    std::vector<GradPiece> pieces;
    for (size_t i : sg.params) pieces.push_back({params_[i].offset, params_[i].partition_size});
    // Each partition converted on its own (span 0); under offload measured
    // where the gradient lives, not after copying it back to the device.
    const at::Tensor norms = PieceNorms(sg.Grad(), pieces, device_, /*span_elements=*/0);
    group_norms.push_back(GroupGradNormStacked(comm_, norms, at::kDouble, device_, dp() > 1));
  }
  return GlobalGradNorm(group_norms, finite);
}

Zero3Runtime::StepResult Zero3Runtime::Step(const std::vector<double>& group_lrs) {
  c10::NoGradGuard no_grad;
  if (group_lrs.size() != num_groups()) throw std::logic_error("Zero3Runtime::Step: one lr per group");
  StepResult r;
  const double prev_scale = scaler_.cur_scale;
  r.loss_scale = prev_scale;
  bool overflow = false;
  if (s_.base.model_dtype == at::kHalf) {
    std::vector<at::Tensor> grads;
    for (Zero3SubGroup& sg : subs_) grads.push_back(sg.Grad());
    overflow = AnyRankOverflowed(comm_, grads, device_);
  }
  scaler_.Update(overflow);
  if (overflow) {
    ClearGrads();
    r.skipped = true;
    r.grad_norm = -1;
    return r;
  }
  bool finite = true;
  at::Tensor norm = GlobalNorm(&finite);  // fp64, of the scaled gradients
  // DeepSpeed 0.14.5's stage3.py divides the norm and the gradients by the scale it has just
  // updated (a grown one on a step where the scale grows), as its stage 1-2 do the gradients.
  r.grad_norm = finite ? norm.item<double>() / scaler_.cur_scale : -1;
  const UnscaleAndClip unscale(norm, scaler_.cur_scale, s_.base.gradient_clipping);
  if (s_.base.optimizer_step) {
    ClientStep(unscale, group_lrs);
    return r;
  }
  if (s_.base.offload_optimizer_cpu) {
    HostStep(unscale.host_factor(), group_lrs);
    return r;
  }
  for (Zero3SubGroup& sg : subs_) {
    at::Tensor grad = sg.Grad();
    const OptimizerConfig& o = group_optimizers_[sg.group];
    if (grad.scalar_type() == at::kFloat) {
      unscale.Apply(grad);
      TorchAdamStep(sg.state, grad, o, group_lrs[sg.group], s_.base.step_chunk_elements);
    } else {  // the model-dtype sum: each piece widened and unscaled (DeepSpeed: one fp32 copy of it)
      TorchAdamStep(sg.state, grad, o, group_lrs[sg.group], s_.base.step_chunk_elements, &unscale);
    }
  }
  ClearGrads();
  WeightsFromMasters();
  return r;
}

// offload_optimizer: the same factor, applied inside one fused host pass per
// sub-group, which also zeroes the gradient, fp32 or grad_accum_dtype (ready
// for the next accumulation) and, where the 16-bit partitions are in host memory
// (offload_param) in bf16 or fp16, writes each parameter's new partition
// from the chunk it has just updated (WeightsFromMasters's copy, the same
// bits, without a second pass over the masters).
void Zero3Runtime::HostStep(double grad_scale, const std::vector<double>& group_lrs) {
  units_.DropPrefetches();  // gathered from the old partitions
  bool partitions_written = true;
  for (Zero3SubGroup& sg : subs_) {
    const CpuAdamPass pass(sg.state, sg.Grad(), grad_scale, group_optimizers_[sg.group], group_lrs[sg.group],
                           /*zero_16bit_grad=*/true);
    std::vector<CpuAdamPass::WeightOut> outs;
    for (size_t i : sg.params) {
      const Zero3Param& p = params_[i];
      const at::ScalarType dtype = p.partition.scalar_type();
      if (p.partition.device().is_cpu() && p.partition.is_contiguous() &&
          (dtype == at::kBFloat16 || dtype == at::kHalf))
        outs.push_back({p.offset, p.partition});
    }
    if (outs.size() == sg.params.size()) {
      pass.RunInto(outs);
    } else {
      pass.Run(0, pass.numel());
      partitions_written = false;
    }
  }
  if (!partitions_written) return WeightsFromMasters();
  storage_.RefetchWhole();
}

void Zero3Runtime::ClearGrads() {
  for (Zero3SubGroup& sg : subs_) {
    if (s_.base.offload_optimizer_cpu) sg.grad.zero_();
    else sg.grad = at::Tensor();  // Grad() makes zeros at the next step's first reduce
  }
}

void Zero3Runtime::ClientStep(const UnscaleAndClip& unscale, const std::vector<double>& group_lrs) {
  std::vector<PartitionState*> states;
  std::vector<at::Tensor> grads;
  std::vector<size_t> groups;
  for (Zero3SubGroup& sg : subs_) {
    at::Tensor grad = sg.Grad().to(at::kFloat);  // DeepSpeed hands its optimizer an fp32 copy
    unscale.ApplyForClientStep(grad, s_.base.offload_optimizer_cpu);
    states.push_back(&sg.state);
    grads.push_back(grad);
    groups.push_back(sg.group);
  }
  RunOptimizerStep(s_.base.optimizer_step, states, grads, groups, group_lrs);
  ClearGrads();
  WeightsFromMasters();
}

void Zero3Runtime::WeightsFromMasters() {
  units_.DropPrefetches();  // gathered from the old partitions
  c10::NoGradGuard no_grad;
  for (const Zero3SubGroup& sg : subs_)
    for (size_t i : sg.params) {
      Zero3Param& p = params_[i];
      p.partition.copy_(sg.state.master.narrow(0, p.offset, p.partition_size));
    }
  storage_.RefetchWhole();
}

void Zero3Runtime::MastersFromWeights() {
  c10::NoGradGuard no_grad;
  for (Zero3SubGroup& sg : subs_)
    for (size_t i : sg.params) {
      const Zero3Param& p = params_[i];
      sg.state.master.narrow(0, p.offset, p.partition_size).copy_(p.partition);
    }
}

// The planner's layout (ckpt/reshard.h) must be this one. Every sub-group
// takes the model's first parameter's step, as the universal load does.
std::vector<PartitionSlot> Zero3Runtime::Slots() {
  std::vector<PartitionSlot> slots;
  for (Zero3SubGroup& sg : subs_) {
    std::vector<ckpt::TargetParam> params;
    int64_t offset = 0;
    for (size_t i : sg.params) {
      const Zero3Param& p = params_[i];
      if (p.offset != offset || p.partition_size != ckpt::Stage3PartitionSize(p.numel, dp()))
        throw std::logic_error("Zero3Runtime: " + p.name + "'s partition is not where the planner puts it");
      offset += p.partition_size;
      params.push_back({p.name, p.numel, p.tensor.sizes().vec()});
    }
    slots.push_back({sg.group, ckpt::Stage3PartitionTarget(std::move(params), dp(), comm_.rank()), &sg.state,
                     params_.front().name});
  }
  return slots;
}

void Zero3Runtime::GatherParameters(const std::vector<at::Tensor>& params) { GatherSome(IndicesOf(params)); }

void Zero3Runtime::ReleaseParameters(const std::vector<at::Tensor>& params, int modifier_rank) {
  ReleaseSome(IndicesOf(params), modifier_rank);
}

// The indices of those of `ts` that are this runtime's parameters, sorted:
// the same order on every rank.
std::vector<size_t> Zero3Runtime::IndicesOf(const std::vector<at::Tensor>& ts) const {
  std::set<const void*> given;
  for (const auto& t : ts) given.insert(t.unsafeGetTensorImpl());
  std::vector<size_t> out;
  for (size_t i = 0; i < params_.size(); ++i)
    if (given.count(params_[i].tensor.unsafeGetTensorImpl())) out.push_back(i);
  return out;
}

}  // namespace uckpt::engine
