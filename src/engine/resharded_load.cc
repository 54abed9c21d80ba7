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

}  // namespace

ReshardedLoad LoadReshardedPartitions(Engine::Impl& e, const std::string& folder, bool optimizer_states) {
  const ckpt::ZeroCheckpoint z = ckpt::OpenZeroCheckpoint(folder, false, /*check_manifest=*/false);
  if (z.stage == 3)
    throw FormatError(folder + ": a ZeRO-3 checkpoint cannot be loaded into a stage " + std::to_string(e.stage()) +
                      " run at another world size; convert it with `uckpt convert` and load that with universal = true");
  ReshardedLoad out;
  out.where = z.optim[0].file->path();
  const ValuePtr saved = ckpt::UniversalOptimizerState(z);
  out.loss_scaler = saved->get("loss_scaler");
  out.param_groups = saved->get("param_groups");
  // Saved before any applied step (fp16 can skip the first steps): no moments, no step yet.
  const bool with_state = optimizer_states && !z.params.empty() && z.params[0].step;
  std::vector<TensorReads> loads;
  for (size_t g = 0; g < e.groups.size(); ++g) {
    std::vector<ckpt::TargetParam> params;
    for (const auto& p : e.groups[g]) params.push_back({p.name, p.tensor.numel()});
    const int dp = e.zero->layout(g).dp, rank = e.zero->partition_rank();
    const ckpt::PartitionTarget target = ckpt::FlatPartitionTarget(std::move(params), dp, rank);
    PartitionState& st = e.zero->state(g);
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
    // The group's step, as the converter writes it to step.pt of its first parameter.
    const ckpt::ParamPlan* first = nullptr;
    for (const auto& p : z.params)
      if (p.name == e.groups[g].front().name) first = &p;
    if (!first || !first->step) throw FormatError(folder + ": param group " + std::to_string(g) + " has no step");
    st.step = at::full({}, ckpt::ScalarOf(first->step, out.where + ": step"), st.master.options());
  }
  out.bytes_read = FillFromReads(loads);
  return out;
}

}  // namespace uckpt::engine
