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
  std::vector<PartitionSlot> slots = e.runtime->Slots();
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
