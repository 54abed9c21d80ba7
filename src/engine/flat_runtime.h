// ZeRO stage 0/1/2 data parallelism over flat parameter groups, laid out
// exactly as DeepSpeed's DeepSpeedZeroOptimizer lays them out (ckpt/partition.h):
// each group's parameters are views into one flat buffer padded to a multiple
// of 2*dp; rank r owns flat[r*P, (r+1)*P) and keeps the fp32 master copy and
// the Adam moments of that slice only.
//
// Per micro-batch: backward (the parameters' .grad are views into grad_flat),
// then FinishBackward(). Stage 2 averages (divide by dp, then sum over
// ranks) into each owner's fp32 partition every micro-step; stage 1 lets
// gradients accumulate locally and reduces once at the boundary; stage 0 does
// the same over an unpartitioned buffer. Step() then computes DeepSpeed's
// global norm, clips, runs torch's Adam/AdamW on the partition and
// all-gathers the updated weights into the model. Under offload_optimizer
// the update is the fused host Adam of cpu_adam.h (torch's formula), and on
// a GPU the copies go through pinned, reused buffers overlapped with the
// host work. At world size 1 each bucket of gradients comes down in the
// model dtype while backward goes on (host_grad_copy.h) and the update pass
// widens it as it reads it; across ranks the averaged fp32 gradient comes
// down chunk by chunk after the reduction while earlier chunks are
// accumulated. The norms are taken on the device first when the gradient
// comes down once. Each updated range of weights, written in the model dtype
// by the update pass, goes up on a side stream while the next range is updated.
//
// Overlapped with the next forward (OverlapUpdateWithForward: offload at one
// rank, EngineOptions::overlap_update_with_forward): Step updates the root
// unit's ranges of the partition, then a background thread (UnitPipeline)
// updates each gather unit's ranges in forward order, writing its weights
// into the model (from a GPU: uploading them on side streams, an event per
// unit), and EnterUnit(i) waits for unit i. Every other call waits for the
// whole update first. The same elements get the same operations, so the
// results are the synchronous update's, bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/partition.h"
#include "engine/config.h"
#include "engine/loss_scaler.h"
#include "engine/sharded_runtime.h"
#include "uckpt/comm.h"

namespace uckpt::engine {

class BucketedHostCopy;
class CpuAdamPass;
class OverlappedGradReducer;
class UnitPipeline;
class UnscaleAndClip;

// torch.optim.Adam/AdamW's single-tensor step (PyTorch 2.x) on one partition:
// `st.master` updated with `grad` (moments created on the first step), in
// pieces of `chunk_elements` so that its temporaries are a piece's (0: at once).
// A 16-bit `grad` (a sum in the model dtype) is widened piece by piece and
// each piece unscaled and clipped by `unscale` (when given): the values of
// an fp32 copy unscaled as a whole, without that copy.
void TorchAdamStep(PartitionState& st, const at::Tensor& grad, const OptimizerConfig& o, double lr,
                   int64_t chunk_elements = kStepChunkElements, const UnscaleAndClip* unscale = nullptr);

class FlatRuntime : public ShardedRuntime {
 public:
  // One flat buffer per group, each laid out and partitioned as DeepSpeed's
  // stage 1/2 does. `device` holds the model.
  FlatRuntime(Comm& comm, std::vector<GroupSpec> groups, ZeroSettings settings, at::Device device = at::kCPU);
  // One group with settings.optimizer.
  FlatRuntime(Comm& comm, std::vector<int64_t> numels, ZeroSettings settings, at::Device device = at::kCPU);
  ~FlatRuntime() override;

  // One slot per group: its flat partition.
  std::vector<PartitionSlot> Slots() override;
  int partition_dp() const override { return groups_.at(0).layout.dp; }
  int partition_rank() const override { return s_.stage == 0 ? 0 : comm_.rank(); }

  const ZeroSettings& settings() const { return s_; }
  size_t num_groups() const override { return groups_.size(); }
  const OptimizerConfig& optimizer_config(size_t g = 0) const override { return groups_.at(g).optimizer; }
  void set_optimizer_config(size_t g, const OptimizerConfig& o) override { groups_.at(g).optimizer = o; }
  // The layout of group g's flat buffer (dp = 1 for stage 0).
  const ckpt::FlatLayout& layout(size_t g = 0) const { return groups_.at(g).layout; }
  const std::vector<int64_t>& numels(size_t g = 0) const { return groups_.at(g).numels; }

  // [Npad], model dtype (as it is: under an overlapped update, WaitForUpdate first)
  at::Tensor model_flat(size_t g = 0) const { return groups_.at(g).model_flat; }
  at::Tensor group_weights(size_t g) const override {
    AwaitUpdate();
    return model_flat(g);
  }
  at::Tensor grad_flat(size_t g = 0) const { return groups_.at(g).grad_flat; }  // [Npad], model dtype
  PartitionState& state(size_t g = 0) {
    AwaitUpdate();
    return groups_.at(g).state;
  }
  const PartitionState& state(size_t g = 0) const {
    AwaitUpdate();
    return groups_.at(g).state;
  }
  // Set for stage 2 with overlap_comm at dp > 1, after BindGradients.
  const OverlappedGradReducer* overlap_reducer(size_t g = 0) const { return groups_.at(g).overlap.get(); }
  // Set under offload_optimizer at world size 1 (host_grad_copy.h).
  const BucketedHostCopy* host_copy(size_t g = 0) const { return groups_.at(g).host_copy.get(); }
  LossScaler& loss_scaler() override { return scaler_; }
  const LossScaler& loss_scaler() const override { return scaler_; }

  // Binds each parameter's .grad to its slice of its group's grad_flat.
  // `params[g]` are views into model_flat(g) in flat order.
  void BindGradients(const std::vector<std::vector<at::Tensor>>& params);
  void BindGradients(const std::vector<at::Tensor>& params) {
    BindGradients(std::vector<std::vector<at::Tensor>>{params});
  }
  // Before each backward (PrepareBackward): a parameter whose .grad is no longer its view (the
  // caller set it to None, as module.zero_grad() does, or to another tensor)
  // gets the view back. Its gradient since the last reduction is dropped at
  // stages 0-1, where DeepSpeed keeps it in .grad until the boundary; another
  // tensor's values are added, as backward would add to it. One pointer check
  // per parameter otherwise.
  void PrepareBackward() override;

  // Before a micro-batch's backward: whether it is the last one of a step.
  void BeginMicroStep(bool boundary) override;
  // After each micro-batch's backward; `boundary` on the last one of a step.
  void FinishBackward(bool boundary) override;

  using StepResult = engine::StepResult;
  // The optimizer step with learning rate group_lrs[g] in group g, then the all-gather.
  StepResult Step(const std::vector<double>& group_lrs) override;
  void StepFromParameterGradients(const std::vector<double>& group_lrs) override;
  StepResult Step(double lr) { return Step(std::vector<double>(groups_.size(), lr)); }  // every group

  // EngineOptions::overlap_update_with_forward: from now on Step overlaps the
  // update with the next forward (see above). unit_of[g][k]: parameter k of
  // group g's gather unit in [0, num_units), -1 for the root. Only under
  // offload_optimizer at stages 1-2 at world size 1 with the engine's Adam
  // and num_units > 0; elsewhere nothing changes. Returns whether it is on.
  bool OverlapUpdateWithForward(const std::vector<std::vector<int>>& unit_of, size_t num_units);
  bool overlaps_update() const { return pipeline_ != nullptr; }
  bool uses_unit_calls() const override { return overlaps_update(); }
  // Waits for unit `unit`'s update (the device for its upload); returns `input`.
  at::Tensor EnterUnit(size_t unit, const at::Tensor& input) override;
  void WaitForUpdate() override { AwaitUpdate(); }
  void ForgetFailedUpdate() override;
  // For tests: called on the update's thread before gather unit i's update.
  void set_before_unit_update(std::function<void(size_t unit)> f) { before_unit_update_ = std::move(f); }

  // ZeRO stage 0 in fp16 (settings().stage0_fp16): the step DeepSpeed's FP16_Optimizer
  // takes when it is built, of the optimizer on zero gradients (its state made, step 1,
  // weight decay applied to the masters, the weights left as they are). Elsewhere nothing.
  void Fp16WrapperInitialStep();

  // Master weights from the model (after loading weights into model_flat).
  void MastersFromWeights() override;
  // Model weights from the masters of every rank (after loading partitions).
  void WeightsFromMasters() override;

 private:
  struct Group {
    std::vector<int64_t> numels;
    std::vector<std::string> names;
    std::vector<std::vector<int64_t>> shapes;
    OptimizerConfig optimizer;
    ckpt::FlatLayout layout;
    std::vector<int64_t> offsets;           // each parameter's start in the flat buffers
    std::vector<ckpt::Fragment> fragments;  // of this rank's partition
    std::vector<int> fragment_of;           // per parameter: its index in fragments, or -1 (none on this rank)
    at::Tensor model_flat, grad_flat;
    at::Tensor grad_partition;  // [P] fp32, the averaged gradient being accumulated
    bool have_grad_partition = false;
    // offload_optimizer at world size 1: the gradient goes to the host bucket
    // by bucket during backward, in the model dtype. When `in_host_copy`, the
    // step's gradient is host_copy's buffer (one micro-step's, unconverted);
    // else grad_partition (fp32, the sum of several micro-steps).
    std::unique_ptr<BucketedHostCopy> host_copy;
    bool in_host_copy = false;
    // offload_optimizer from a GPU: each fragment's fp64 gradient norm, taken
    // on the device before the copy down (undefined when the host gradient
    // sums several reductions: then measured on the host).
    at::Tensor device_norms;
    PartitionState state;
    std::unique_ptr<OverlappedGradReducer> overlap;  // stage 2 with overlap_comm, dp > 1
    // Gloo: parameters in the order DeepSpeed's reduction buffer holds them
    // (stage 2: the order backward produced their gradients, recorded by hooks
    // each micro-step; stage 1: flat order).
    std::vector<int> ready_order;
    std::vector<at::Tensor> params, grad_views;  // bound by BindGradients
    // offload_optimizer with the model on a GPU: reused buffers for the host
    // update's copies (pinned staging for both directions, and this rank's
    // updated partition in the model dtype on the device).
    std::vector<at::Tensor> host_staging;
    at::Tensor device_partition;
  };
  at::Tensor PartitionOf(const Group& g, const at::Tensor& flat) const;
  void ReduceIntoPartition(Group& g, bool boundary);
  at::Tensor ReduceScatterInBuckets(Group& g, bool add_in_place);
  at::Tensor Stage0AllReduce(Group& g);
  at::Tensor AllReduceInDeepSpeedOrder(Group& g);
  at::Tensor GlobalNorm();
  void AdamStep(Group& g, const at::Tensor& grad, double lr);
  // settings.optimizer_step over every group's partition, then the all-gather.
  void ClientStep(const UnscaleAndClip& unscale, const std::vector<double>& group_lrs);
  void AddToHostGradient(Group& g, const at::Tensor& part);
  void TakeHostCopy(Group& g, bool boundary);
  // The host copy becomes the fp32 sum that later micro-steps add to.
  void KeepHostCopyAsSum(Group& g);
  at::Tensor HostFloatBuffer(int64_t n) const;
  const at::Tensor& StepGradient(Group& g);
  void DropGradient(Group& g);
  void OffloadedAdamStep(Group& g, float grad_scale, double lr);
  void GatherModel(Group& g, const at::Tensor& mine);
  // ZeRO stage 0 in fp16 (fp16_stage0.cc): the engine's fp16 all-reduce of the group's
  // gradients, and FP16_Optimizer's / FP16_UnfusedOptimizer's step.
  at::Tensor Fp16WrapperAllReduce(Group& g);
  StepResult Fp16WrapperStep(const std::vector<double>& group_lrs);
  double Fp16WrapperScaledNorm() const;
  void Fp16WrapperUpdate(const std::vector<at::Tensor>& grads, const std::vector<double>& group_lrs);
  // The overlapped update (OverlapUpdateWithForward).
  struct Piece {
    size_t group;
    int64_t begin, end;  // of the group's partition
  };
  struct Uploads;  // a GPU's side streams, pinned staging and per-unit events
  void AwaitUpdate() const;
  // Throws (and keeps throwing, until a checkpoint load) where the overlapped
  // update failed: its state is partly stepped.
  [[noreturn]] void UpdateFailed(const std::exception& error) const;
  void RefuseAfterFailedUpdate() const;
  void StartOverlappedStep(float grad_scale, const std::vector<double>& group_lrs);
  void UpdateUnit(size_t u);  // u: index into unit_pieces_ (0: the root)

  Comm& comm_;
  ZeroSettings s_;
  std::vector<Group> groups_;
  LossScaler scaler_;
  bool deepspeed_order_ = false;
  double fp16_wrapper_norm_ = 0;  // stage 0 in fp16: the last applied step's norm (kept over skipped ones)
  std::vector<std::vector<Piece>> unit_pieces_;  // [0] the root's, [1 + i] gather unit i's
  std::vector<CpuAdamPass> passes_;              // per group: the step under way
  std::unique_ptr<Uploads> uploads_;
  std::function<void(size_t)> before_unit_update_;
  mutable std::string failed_update_;  // why the last overlapped update failed ("" if it did not)
  // Last: destroyed (joined) first, while what its thread writes still exists.
  std::unique_ptr<UnitPipeline> pipeline_;
};

}  // namespace uckpt::engine
