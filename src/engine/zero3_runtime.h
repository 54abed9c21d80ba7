// ZeRO stage 3, laid out as DeepSpeed's DeepSpeedZeroOptimizer_Stage3 lays
// it out (ckpt/partition.h): every trainable parameter is split on its own,
// rank r keeping elements [r*ps, (r+1)*ps) of the flattened parameter
// (ps = ceil(numel/dp), zeros past the end). Each optimizer group is cut into
// sub-groups (sub_group_size); a sub-group's fp32 master, Adam moments and
// averaged gradient are the concatenation of its parameters' partitions.
//
// The module's parameters keep their shapes; their storage holds the whole
// tensor only while gathered. Gather units (Engine::EnterUnit/ExitUnit) are
// gathered for their forward and again for their backward; the root unit
// (parameters in no unit, tied across units, or persistent: numel <=
// stage3_param_persistence_threshold) stays gathered. Gradients go into a
// bucket when their unit's backward is done; a full bucket (reduce_bucket_size
// elements) or the end of backward reduce-scatters it as DeepSpeed does
// (reduce_scatter_coalesced: per rank, each parameter's chunk, padded; divided
// by dp; summed) into the owners' fp32 gradient partitions. Step() computes
// DeepSpeed's stage-3 global norm (fp64 per parameter partition), clips, runs
// torch's Adam/AdamW on each sub-group's partition (under offload_optimizer:
// the fused host Adam of cpu_adam.h, in host memory) and re-gathers what is live.
//
// The pieces: gather units with their lifecycle, the parameters' storage and
// the prefetch schedule (zero3_unit.h); the gradient buckets and their
// reduce-scatters (zero3_reduce.h); the unit calls and autograd hooks that
// drive them (zero3_hooks.cc); the step (this class, zero3_runtime.cc).
// Overlap: entering a unit starts the all-gathers of the units after it (in
// backward: before it) up to stage3_prefetch_bucket_size elements ahead,
// while the gathered unit elements stay within stage3_max_live_parameters;
// the decisions depend only on the unit calls, so every rank issues the same
// collectives in the same order. Under overlap_comm a full bucket's
// reduce-scatter runs while backward goes on (at most two in flight); buckets
// finish in the order they started, so every gradient partition sums the
// same values in the same order as without overlap.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/flat_runtime.h"
#include "engine/loss_scaler.h"
#include "engine/sharded_runtime.h"
#include "engine/zero3_reduce.h"
#include "engine/zero3_unit.h"
#include "uckpt/comm.h"

namespace uckpt::engine {

class UnscaleAndClip;

// Copies a flattened parameter of `numel` elements into (to_column) or out of
// its column `column` ([dp, ps]) of a rank-major layout, where rank r's chunk
// is elements [r*ps, (r+1)*ps): the full rows, then the short last one (the
// column's padding is neither read nor written).
void CopyRankColumn(const at::Tensor& flat, const at::Tensor& column, int64_t numel, bool to_column);

// Rank `rank`'s slot of `t` flattened: elements [rank*ps, (rank+1)*ps)
// (ps = ceil(numel/dp)), zeros past the end; a new tensor on t's device.
at::Tensor RankSlot(const at::Tensor& t, int dp, int rank);

struct Zero3Settings {
  ZeroSettings base;  // clipping, optimizer, dtype, fp16, offload_optimizer_cpu, reduce_bucket_size
  int64_t persistence_threshold = 100000;
  int64_t sub_group_size = 1000000000;
  bool offload_param_cpu = false;            // the 16-bit partitions in host memory
  int64_t prefetch_bucket_size = 50000000;   // unit elements gathered ahead of use; 0: no prefetch
  int64_t max_live_parameters = 1000000000;  // cap on gathered unit elements for prefetching
  // offload_optimizer: a reduced bucket's share reaches the host gradient
  // partitions in pieces of at most this many elements, through one reused
  // pinned buffer (a whole share would lock as much host memory as it holds).
  int64_t host_staging_elements = int64_t{32} << 20;
};

// One trainable parameter under stage 3.
struct Zero3Param {
  std::string name;
  at::Tensor tensor;  // the module's parameter (its storage is swapped in and out)
  size_t group = 0;   // optimizer group
  int64_t numel = 0, partition_size = 0;
  int unit = -1;  // gather unit; -1: the root unit (always gathered)
  bool persistent = false;
  at::Tensor partition;  // [ps] model dtype: this rank's slice (host memory under offload_param)
  size_t sub_group = 0;
  int64_t offset = 0;  // of the partition in its sub-group's flat buffers
  int live = 0;        // gather count; the storage is allocated while > 0 (ParamStorage)
};

// One optimizer sub-group of one rank (DeepSpeed's fp32_partitioned_groups_flat[i]).
struct Zero3SubGroup {
  size_t group = 0;
  std::vector<size_t> params;  // indices into Zero3Runtime::params()
  PartitionState state;        // master [sum ps] fp32 + Adam moments and step
  // [sum ps] in grad_dtype (DeepSpeed's grad_accum_dtype: the model's unless
  // the config says fp32): the averaged gradient being accumulated. Where the master
  // is on the device it is held only from a step's first reduce to its update
  // (torch's zero_grad(set_to_none)), so the forward's activation peak does
  // not carry it; in host memory (offload_optimizer) it stays.
  at::Tensor grad;
  at::ScalarType grad_dtype = at::kFloat;
  at::Tensor& Grad() {  // grad, zeros where not held
    if (!grad.defined()) grad = at::zeros_like(state.master, state.master.options().dtype(grad_dtype));
    return grad;
  }
};

class Zero3Runtime : public ShardedRuntime {
 public:
  // `groups[g]`: group g's parameters (whole, equal on every rank), in the
  // order DeepSpeed flattens them; `unit_of[g][k]`: their gather unit (-1 root).
  // `given` (by TensorImpl): this rank's partitions of parameters that
  // arrived partitioned (their tensors without storage: StoragelessTensor).
  // With any given, every unit starts sharded and only the root and
  // persistent parameters are gathered; the whole values are never formed.
  Zero3Runtime(Comm& comm, std::vector<std::vector<std::pair<std::string, at::Tensor>>> groups,
               std::vector<OptimizerConfig> group_optimizers, const std::vector<std::vector<int>>& unit_of,
               int num_units, Zero3Settings settings, at::Device device,
               const std::map<const void*, at::Tensor>& given = {});

  // One slot per sub-group: its parameters' partitions one after another.
  std::vector<PartitionSlot> Slots() override;
  int partition_dp() const override { return dp(); }
  int partition_rank() const override { return comm_.rank(); }

  const Zero3Settings& settings() const { return s_; }
  int dp() const { return comm_.world_size(); }
  std::vector<Zero3Param>& params() { return params_; }
  const std::vector<Zero3Param>& params() const { return params_; }
  std::vector<Zero3SubGroup>& sub_groups() { return subs_; }
  const std::vector<Zero3SubGroup>& sub_groups() const { return subs_; }
  size_t num_groups() const override { return group_optimizers_.size(); }
  const OptimizerConfig& optimizer_config(size_t g) const override { return group_optimizers_.at(g); }
  void set_optimizer_config(size_t g, const OptimizerConfig& o) override { group_optimizers_.at(g) = o; }
  LossScaler& loss_scaler() override { return scaler_; }
  const LossScaler& loss_scaler() const override { return scaler_; }
  int num_units() const { return static_cast<int>(units_.size()); }
  bool partitions_parameters() const override { return true; }
  size_t num_gather_units() const override { return units_.size(); }

  // The unit calls (Engine::EnterUnit/ExitUnit): gather/free plus the
  // autograd identities that wire the backward side.
  at::Tensor EnterUnit(size_t unit, const at::Tensor& input) override;
  at::Tensor ExitUnit(size_t unit, const at::Tensor& output) override;
  void GatherAll() override;   // +1 on every unit
  void ReleaseAll() override;  // -1 on every unit
  std::vector<std::pair<at::Tensor, at::Tensor>> ParameterPartitions() const override {
    std::vector<std::pair<at::Tensor, at::Tensor>> out;
    for (const Zero3Param& p : params_) out.emplace_back(p.tensor, p.partition);
    return out;
  }
  // GatherSome/ReleaseSome over those of `params` that are this runtime's.
  void GatherParameters(const std::vector<at::Tensor>& params) override;
  void ReleaseParameters(const std::vector<at::Tensor>& params, int modifier_rank) override;
  // Engine::GatherParameters(params): +1 on each of `ps` (indices into
  // params(), the same on every rank), gathering those not whole.
  void GatherSome(const std::vector<size_t>& ps);
  // -1 on each; modifier_rank >= 0 first broadcasts its whole values and
  // re-partitions them; -1: those staying whole are gathered again from the
  // partitions (writes discarded).
  void ReleaseSome(const std::vector<size_t>& ps, int modifier_rank);
  Stage3Stats stats() const override;
  // The gather units: their states, for tests and diagnostics.
  const UnitSchedule& units() const { return units_; }
  // Times FinishBackward, synchronising the device (UCKPT_TIMERS).
  void set_timing(bool on) override { timing_ = on; }

  void PrepareBackward() override {}
  // After loss.backward(): the gradients not reduced yet (the root unit's),
  // then the bucket; frees units that backward gathered and left gathered.
  void FinishBackward();
  void FinishBackward(bool boundary) override { FinishBackward(); }

  using StepResult = engine::StepResult;
  StepResult Step(const std::vector<double>& group_lrs) override;  // group_lrs[g]: group g's lr

  // The 16-bit partitions from the fp32 masters, then every gathered
  // parameter from the partitions (after loading a checkpoint).
  void WeightsFromMasters() override;
  // The fp32 masters from the 16-bit partitions.
  void MastersFromWeights() override;

  // For the backward identities (zero3_hooks.cc).
  void BackwardGather(size_t unit);
  void BackwardDone(size_t unit);

 private:
  Zero3Runtime(const Zero3Runtime&) = delete;  // its pieces refer to its members
  Zero3Runtime& operator=(const Zero3Runtime&) = delete;
  void FinishBackwardUntimed();
  void ClearGrads();  // after an update or a skipped step
  // offload_optimizer's update: the fused host pass per sub-group.
  void HostStep(double grad_scale, const std::vector<double>& group_lrs);
  void StartFromPartitions();
  at::Tensor GlobalNorm(bool* finite);
  // settings.optimizer_step over every sub-group's partition.
  void ClientStep(const UnscaleAndClip& unscale, const std::vector<double>& group_lrs);
  std::vector<size_t> IndicesOf(const std::vector<at::Tensor>& ts) const;

  Comm& comm_;
  Zero3Settings s_;
  at::Device device_;
  std::vector<OptimizerConfig> group_optimizers_;
  std::vector<Zero3Param> params_;
  std::vector<Zero3SubGroup> subs_;
  // The pieces (zero3_unit.h, zero3_reduce.h), over params_ and subs_.
  ParamStorage storage_{comm_, params_, device_};
  UnitSchedule units_{storage_, s_.prefetch_bucket_size, s_.max_live_parameters, comm_.world_size()};
  GradientReducer reducer_{comm_, params_, subs_, s_};
  bool timing_ = false;
  double reduce_tail_s_ = 0;
  LossScaler scaler_;
};

}  // namespace uckpt::engine
