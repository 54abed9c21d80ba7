// Stage 3's checkpoints in DeepSpeed's ZeRO-3 layout (ckpt/deepspeed_state.h
// owns the names and keys): every rank writes
// zero_pp_rank_<r>_mp_rank_00_model_states.pt (the module's parameters as
// empty tensors, param_shapes per sub-group, counters, client state) and
// zero_pp_rank_<r>_mp_rank_00_optim_states.pt (its sub-groups' fp32
// partitions and Adam state). SaveEngineCheckpoint (checkpoint.cc) saves
// these files as every stage's: crash-safe, synchronously or in the
// background (docs/reliability.md); LoadEngineCheckpoint loads them, as any
// checkpoint, through the one load path.
#include <map>

#include "ckpt/deepspeed_state.h"
#include "engine/checkpoint.h"
#include "engine/zero3_runtime.h"

namespace uckpt::engine {
namespace {

ValuePtr Zero3ModelStates(const CheckpointState& e, std::vector<std::pair<std::string, ValuePtr>> client,
                          const ValuePtr& ds_config) {
  // The parameters' entries are empty, as DeepSpeed's state_dict of released
  // ZeRO-3 parameters (DeepSpeed's load_state_dict needs that shape): each
  // rank's partition is in its optim file, its frozen slot below.
  std::map<std::string, ValuePtr> params;
  auto empty = [](const at::Tensor& t) { return TensorValue(at::empty({0}, t.options().device(at::kCPU))); };
  for (const auto& g : e.module.groups)
    for (const auto& p : g) params[p.name] = empty(p.tensor);
  for (const auto& p : e.module.frozen) params[p.name] = empty(p.tensor);
  ckpt::ModelStates m = ModelStatesOf(e, std::move(params), std::move(client), ds_config);
  // Frozen parameters: this rank's slot in frozen_param_fragments, as
  // DeepSpeed's ZeRO-3 saves them (the load puts them together); none with
  // exclude_frozen_parameters.
  const int dp = e.runtime.partition_dp(), rank = e.runtime.partition_rank();
  for (const auto& p : e.module.frozen) {
    if (e.save_without_frozen) break;
    m.frozen_shapes.push_back({p.name, p.tensor.sizes().vec()});
    m.frozen.emplace_back(p.name, TensorValue(RankSlot(p.tensor, dp, rank).cpu()));
  }
  return ckpt::ModelStatesValue(m);
}

ValuePtr Zero3OptimStates(const CheckpointState& e, const ValuePtr& ds_config) {
  const ShardedRuntime& z = e.runtime;
  ckpt::Stage3RankOptimStates r;
  r.dp = z.partition_dp();
  r.scaler = z.loss_scaler();
  r.overflow = e.counters.last_step_skipped;
  r.ds_config = ds_config;
  std::vector<std::vector<int64_t>> ids(z.num_groups());
  for (const PartitionSlot& slot : e.runtime.Slots()) {  // one per sub-group
    const PartitionState& st = *slot.state;
    ckpt::Stage3SubGroupState s;
    s.fp32 = TensorValue(st.master, /*requires_grad=*/true);
    s.adam = SavedOptimizerState(st, SavedHparams(e, slot.group).cls);
    ids[slot.group].push_back(static_cast<int64_t>(r.sub_groups.size()));
    r.sub_groups.push_back(std::move(s));
  }
  for (size_t g = 0; g < ids.size(); ++g) {
    r.param_groups.emplace_back(SavedHparams(e, g), ids[g]);
    if (e.client_param_group)
      r.param_group_entries.push_back(FromIValue(e.client_param_group(g), "optimizer param group"));
  }
  return ckpt::Stage3OptimStatesValue(r);
}

}  // namespace

std::vector<SnapshotFile> Zero3RankFiles(const CheckpointState& e, std::vector<std::pair<std::string, ValuePtr>> client,
                                         const ValuePtr& ds_config) {
  const int rank = e.comm.rank();
  std::vector<SnapshotFile> files;
  files.push_back({ckpt::OptimStatesFileName(rank, /*bf16=*/false), Zero3OptimStates(e, ds_config)});
  files.push_back({ckpt::Zero3ModelStatesFileName(rank), Zero3ModelStates(e, std::move(client), ds_config)});
  return files;
}

}  // namespace uckpt::engine
