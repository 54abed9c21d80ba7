#include "engine/resharded_load.h"

#include "ckpt/copy_plan.h"
#include "ckpt/deepspeed_state.h"
#include "ckpt/reshard.h"
#include "ckpt/zero_checkpoint.h"
#include "engine/staged_upload.h"
#include "engine/torch_bridge.h"
#include "format/error.h"

namespace uckpt::engine {

namespace {

// The reads that fill `dst` with state `key` of `target`'s partition:
// straight into a CPU tensor of the source's dtype, else through staging
// chunks (staged_upload.h); padding is zeroed, nothing else.
TensorReads PlanLoad(const ckpt::ZeroCheckpoint& z, const ckpt::PartitionTarget& target, const std::string& key,
                     at::Tensor dst) {
  ckpt::StateReads reads = ckpt::PlanStateReads(z, target, key);
  return {std::move(dst), ToScalarType(reads.dtype), std::move(reads.pieces)};
}

// One partition this rank holds: a group's flat partition (stages 1/2) or a
// sub-group's (stage 3), and the parameter whose saved step is its Adam step.
struct PartitionSlot {
  ckpt::PartitionTarget target;
  PartitionState* state = nullptr;
  std::string step_param;
};

std::vector<int64_t> Shape(const at::Tensor& t) { return t.sizes().vec(); }

std::vector<PartitionSlot> FlatSlots(Engine::Impl& e) {
  std::vector<PartitionSlot> slots;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    std::vector<ckpt::TargetParam> params;
    for (const auto& p : e.groups[g]) params.push_back({p.name, p.tensor.numel(), Shape(p.tensor)});
    const int dp = e.zero->layout(g).dp, rank = e.zero->partition_rank();
    slots.push_back({ckpt::FlatPartitionTarget(std::move(params), dp, rank), &e.zero->state(g), e.groups[g].front().name});
  }
  return slots;
}

// Stage 3: each sub-group's parameters, each partitioned on its own; the
// planner's layout must be the optimizer's (zero3.h). Every sub-group takes
// the model's first parameter's step, as the universal load does.
std::vector<PartitionSlot> Zero3Slots(Engine::Impl& e) {
  Zero3Optimizer& z = *e.zero3;
  std::vector<PartitionSlot> slots;
  for (Zero3SubGroup& sg : z.sub_groups()) {
    std::vector<ckpt::TargetParam> params;
    int64_t offset = 0;
    for (size_t i : sg.params) {
      const Zero3Param& p = z.params()[i];
      if (p.offset != offset || p.partition_size != ckpt::Stage3PartitionSize(p.numel, z.dp()))
        throw std::logic_error("resharded load: " + p.name + "'s partition is not where the planner puts it");
      offset += p.partition_size;
      params.push_back({p.name, p.numel, Shape(p.tensor)});
    }
    slots.push_back({ckpt::Stage3PartitionTarget(std::move(params), z.dp(), e.comm->rank()), &sg.state,
                     z.params().front().name});
  }
  return slots;
}

// Adam's step of a partition, as loading the converted checkpoint gives it:
// a stage 1/2 source's group step (the converter's step.pt), else (stage 3
// keeps none per parameter) the applied steps.
double SavedStep(const ckpt::ZeroCheckpoint& z, const Engine::Impl& e, const std::string& param,
                 const std::string& where) {
  if (z.stage == 3) return static_cast<double>(e.global_steps - e.skipped_steps);
  for (const auto& p : z.params)
    if (p.name == param) {
      if (!p.step) break;
      return ckpt::ScalarOf(p.step, where + ": step");
    }
  throw FormatError(z.folder + ": the parameter group of " + param + " has no step");
}

// Whether the source holds Adam's moments (none before the first applied
// step; fp16 can skip the first steps).
bool HasMoments(const ckpt::ZeroCheckpoint& z) {
  if (z.stage == 3) return ckpt::HasState(z, "exp_avg") && ckpt::HasState(z, "exp_avg_sq");
  return !z.params.empty() && z.params[0].step;
}

}  // namespace

ReshardedLoad LoadReshardedPartitions(Engine::Impl& e, const std::string& folder, bool optimizer_states) {
  const ckpt::ZeroCheckpoint z = ckpt::OpenZeroCheckpoint(folder, false, /*check_manifest=*/false);
  ReshardedLoad out;
  out.where = z.optim[0].file->path();
  const ValuePtr saved = ckpt::UniversalOptimizerState(z);
  out.loss_scaler = saved->get("loss_scaler");
  out.param_groups = saved->get("param_groups");
  const bool with_state = optimizer_states && HasMoments(z);
  std::vector<PartitionSlot> slots = e.zero3 ? Zero3Slots(e) : FlatSlots(e);
  std::vector<TensorReads> loads;
  for (PartitionSlot& slot : slots) {
    const ckpt::PartitionTarget& target = slot.target;
    PartitionState& st = *slot.state;
    if (target.length != st.master.numel())
      throw std::logic_error("resharded load: partition sizes differ from the optimizer's");
    loads.push_back(PlanLoad(z, target, "fp32", st.master));
    if (!with_state) {
      st.step = st.exp_avg = st.exp_avg_sq = at::Tensor();
      continue;
    }
    st.exp_avg = at::empty_like(st.master);
    st.exp_avg_sq = at::empty_like(st.master);
    loads.push_back(PlanLoad(z, target, "exp_avg", st.exp_avg));
    loads.push_back(PlanLoad(z, target, "exp_avg_sq", st.exp_avg_sq));
    st.step = at::full({}, SavedStep(z, e, slot.step_param, out.where), st.master.options());
  }
  out.bytes_read = FillFromReads(loads);
  return out;
}

}  // namespace uckpt::engine
