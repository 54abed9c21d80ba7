// Stage 3's checkpoints in DeepSpeed's ZeRO-3 layout (ckpt/deepspeed_state.h
// owns the names and keys): every rank writes
// zero_pp_rank_<r>_mp_rank_00_model_states.pt (the module's parameters as
// empty tensors, param_shapes per sub-group, counters, client state) and
// zero_pp_rank_<r>_mp_rank_00_optim_states.pt (its sub-groups' fp32
// partitions and Adam state). Loads: any ZeRO checkpoint (stage 1, 2 or 3,
// ours or DeepSpeed's) at any world size without converting it
// (resharded_load.h), or a universal checkpoint (made from any stage) at any
// size. SaveEngineCheckpoint (checkpoint.cc) saves these files as every
// stage's: crash-safe, synchronously or in the background (docs/reliability.md).
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "ckpt/folder.h"
#include "ckpt/manifest.h"
#include "ckpt/universal_checkpoint.h"
#include "engine/checkpoint.h"
#include "engine/engine_impl.h"
#include "engine/resharded_load.h"
#include "engine/torch_bridge.h"
#include "format/env.h"
#include "format/error.h"
#include "format/file.h"
#include "format/torch_file.h"

namespace uckpt::engine {
namespace fs = std::filesystem;
namespace {

ckpt::AdamHparams Hparams(const Engine::Impl& e, size_t g) {
  const OptimizerConfig& o = e.zero3->optimizer_config(g);
  return ckpt::AdamHparams{e.schedule.current_lr(g), o.beta1, o.beta2, o.eps, o.weight_decay};
}

ValuePtr Zero3ModelStates(const Engine::Impl& e, const std::vector<std::pair<std::string, ValuePtr>>& client) {
  const Zero3Optimizer& z = *e.zero3;
  ckpt::ModelStates m;
  m.stage = 3;
  // The parameters' entries are empty, as DeepSpeed's state_dict of released
  // ZeRO-3 parameters (DeepSpeed's load_state_dict needs that shape): each
  // rank's partition is in its optim file, its frozen slot below. Buffers are whole.
  std::map<std::string, ValuePtr> by_name;
  auto empty = [](const at::Tensor& t) { return TensorValue(at::empty({0}, t.options().device(at::kCPU))); };
  for (const auto& p : z.params()) by_name[p.name] = empty(p.tensor);
  for (const auto& p : e.frozen) by_name[p.name] = empty(p.tensor);
  for (const auto& p : e.buffers) by_name[p.name] = TensorValue(p.tensor);
  for (const auto& [alias, owner] : e.aliases) by_name[alias] = by_name.at(owner);
  for (const auto& name : e.state_names) m.module.emplace_back(name, by_name.at(name));
  m.module_prefixes = e.module_prefixes;
  for (const auto& b : e.buffers) m.buffer_names.push_back(b.name);
  for (const auto& sg : z.sub_groups()) {
    m.param_shapes.emplace_back();
    for (size_t i : sg.params) m.param_shapes.back().push_back({z.params()[i].name, z.params()[i].tensor.sizes().vec()});
  }
  // Frozen parameters: this rank's slot in frozen_param_fragments, as
  // DeepSpeed's ZeRO-3 saves them (LoadFixedParams puts them together).
  const int dp = z.dp(), rank = e.comm->rank();
  for (const auto& p : e.frozen) {
    m.frozen_shapes.push_back({p.name, p.tensor.sizes().vec()});
    m.frozen.emplace_back(p.name, TensorValue(RankSlot(p.tensor, dp, rank).cpu()));
  }
  SetCountersAndExtras(e, client, m);
  return ckpt::ModelStatesValue(m);
}

ValuePtr Zero3OptimStates(const Engine::Impl& e) {
  const Zero3Optimizer& z = *e.zero3;
  ckpt::Stage3RankOptimStates r;
  r.dp = z.dp();
  r.scaler = z.loss_scaler();
  r.ds_config = ckpt::JsonToValue(e.config.raw);
  std::vector<std::vector<int64_t>> ids(z.num_groups());
  for (size_t i = 0; i < z.sub_groups().size(); ++i) {
    const Zero3SubGroup& sg = z.sub_groups()[i];
    ckpt::Stage3SubGroupState s;
    s.fp32 = TensorValue(sg.state.master, /*requires_grad=*/true);
    if (sg.state.step.defined())
      s.adam = {{"step", TensorValue(sg.state.step)},
                {"exp_avg", TensorValue(sg.state.exp_avg)},
                {"exp_avg_sq", TensorValue(sg.state.exp_avg_sq)}};
    r.sub_groups.push_back(std::move(s));
    ids[sg.group].push_back(static_cast<int64_t>(i));
  }
  for (size_t g = 0; g < ids.size(); ++g) r.param_groups.emplace_back(Hparams(e, g), ids[g]);
  return ckpt::Stage3OptimStatesValue(r);
}

}  // namespace

std::vector<SnapshotFile> Zero3RankFiles(const Engine::Impl& e, std::vector<std::pair<std::string, ValuePtr>> client) {
  const int rank = e.comm->rank();
  std::vector<SnapshotFile> files;
  files.push_back({ckpt::OptimStatesFileName(rank, /*bf16=*/false), Zero3OptimStates(e)});
  files.push_back({ckpt::Zero3ModelStatesFileName(rank), Zero3ModelStates(e, client)});
  return files;
}

// ---- Loading. ----

namespace {

// Any ZeRO checkpoint (stage 1, 2 or 3, at any world size, its sub-groups
// cut anyhow): each rank reads its sub-groups' partitions straight from the
// rank files (resharded_load.h), bit for bit what the universal load gives.
void LoadZero3Resharded(Engine::Impl& e, const std::string& folder, const LoadCheckpointOptions& o) {
  Zero3Optimizer& z = *e.zero3;
  ReshardedLoad r = LoadReshardedPartitions(e, folder, o.load_optimizer_states);
  static_cast<ckpt::LossScalerState&>(z.loss_scaler()) = ckpt::ReadLossScaler(r.loss_scaler, z.loss_scaler());
  ApplySavedHparams(e, r.where, r.param_groups, o);
  z.PartitionsFromMasters();
  e.last_load.optimizer_bytes_read = r.bytes_read;
}

// Each rank copies its slice [r*ps, r*ps + real) of every parameter's files
// in a universal checkpoint (made at any stage and size): the fp32 masters,
// and Adam's moments and `step` with `with_state` (else no Adam state).
void LoadUniversalSlices(Engine::Impl& e, const ckpt::UniversalCheckpoint& u, const std::string& folder,
                         bool with_state, double step) {
  Zero3Optimizer& z = *e.zero3;
  const int dp = z.dp(), rank = e.comm->rank();
  for (size_t s = 0; s < z.sub_groups().size(); ++s) {
    PartitionState& st = z.sub_groups()[s].state;
    st.master.zero_();
    if (with_state) {
      st.exp_avg = at::zeros_like(st.master);
      st.exp_avg_sq = at::zeros_like(st.master);
      st.step = at::full({}, step, st.master.options());
    } else {
      st.step = st.exp_avg = st.exp_avg_sq = at::Tensor();
    }
  }
  for (const Zero3Param& p : z.params()) {
    PartitionState& st = z.sub_groups()[p.sub_group].state;
    const int64_t real = ckpt::Stage3RealNumel(p.numel, dp, rank);
    const int64_t first = std::min<int64_t>(p.numel, p.partition_size * rank);
    std::vector<std::pair<std::string, at::Tensor>> keys = {{"fp32", st.master}};
    if (with_state) keys.insert(keys.end(), {{"exp_avg", st.exp_avg}, {"exp_avg_sq", st.exp_avg_sq}});
    for (auto& [key, dst] : keys) {
      ckpt::LoadedState ls = ckpt::LoadUniversalState(u, p.name, key);
      const std::string where = ckpt::UniversalStateFile(folder, p.name, key);
      if (ls.tensor->numel() != p.numel)
        throw FormatError(where + ": has " + std::to_string(ls.tensor->numel()) + " elements, " + p.name + " has " +
                          std::to_string(p.numel));
      CopyElements(where, *ls.tensor, first, real, dst.narrow(0, p.offset, real));
    }
  }
}

// A universal checkpoint: the slices, the loss scaler and the saved hyper-parameters.
void LoadZero3Universal(Engine::Impl& e, const std::string& folder, const ckpt::ModelStatesView& m,
                        const LoadCheckpointOptions& o) {
  Zero3Optimizer& z = *e.zero3;
  const ckpt::UniversalCheckpoint u = ckpt::OpenUniversalCheckpoint(folder, false, /*check_manifest=*/false);
  const ckpt::UniversalOptimizerFile saved = ckpt::ReadUniversalOptimizerState(u);
  static_cast<ckpt::LossScalerState&>(z.loss_scaler()) = ckpt::ReadLossScaler(saved.loss_scaler, z.loss_scaler());
  ApplySavedHparams(e, ckpt::UniversalOptimizerStateFile(folder), saved.param_groups, o);
  // Adam's step: from step.pt (stage 1/2 universal), else the applied steps
  // (ZeRO-3's universal folders keep it only inside optimizer_state.pt).
  double step = static_cast<double>(m.global_steps - m.skipped_steps);
  if (u.has_step && !z.params().empty()) step = ckpt::ReadUniversalStep(u, z.params().front().name);
  LoadUniversalSlices(e, u, folder, o.load_optimizer_states, step);
  z.PartitionsFromMasters();
}

// load_module_only: the weights from the checkpoint's fp32 masters (a stage-3
// module state holds none), read as a resume reads them; Adam's state, the
// loss scale, the counters and the schedule stay as they are (as at stages
// 0-2, where the masters are set from the loaded module).
void LoadZero3Weights(Engine::Impl& e, const std::string& folder, const LoadCheckpointOptions& o) {
  std::vector<PartitionState> kept;
  for (const auto& sg : e.zero3->sub_groups()) kept.push_back(sg.state);
  if (o.universal) {
    const ckpt::UniversalCheckpoint u = ckpt::OpenUniversalCheckpoint(folder, false, /*check_manifest=*/false);
    LoadUniversalSlices(e, u, folder, /*with_state=*/false, 0);
  } else {
    LoadReshardedPartitions(e, folder, /*optimizer_states=*/false);
  }
  for (size_t s = 0; s < kept.size(); ++s) {
    PartitionState& st = e.zero3->sub_groups()[s].state;
    st.step = kept[s].step;
    st.exp_avg = kept[s].exp_avg;
    st.exp_avg_sq = kept[s].exp_avg_sq;
  }
  e.zero3->PartitionsFromMasters();
}

ClientState ClientStateOf(const ckpt::ModelStatesView& m) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, v] : m.client) d.insert(k, ToIValue(v));
  return c10::IValue(d);
}

}  // namespace

LoadResult LoadZero3Checkpoint(Engine::Impl& e, const std::string& dir, const std::string& tag_in,
                               const LoadCheckpointOptions& o) {
  const char* tag_file = ckpt::TagFileName(o.universal);
  if (tag_in.empty() && !fs::exists(dir + "/" + tag_file)) return LoadResult{"", c10::IValue()};
  const std::string tag = tag_in.empty() ? ReadTagFile(dir, tag_file) : ckpt::CheckTag(tag_in, "checkpoint tag");
  const std::string folder = dir + "/" + tag;
  ckpt::CheckFolderAgainstManifest(folder, o.verify_hashes);
  // The model states: a ZeRO-3 folder has one file per rank (this rank's,
  // else rank 0's when it was saved by fewer ranks), a stage 1/2 folder one
  // file, a universal folder the copies of its source's (any stage).
  const std::string model_path = ModelStatesPath(folder, e.comm->rank(), o.universal);
  TorchFile model_file = LoadTorchFile(model_path);
  const ckpt::ModelStatesView m = ckpt::ReadModelStates(model_file.root, model_path);
  LoadResult result{folder, ClientStateOf(m)};
  LoadFixedParams(e, folder, model_path, m);
  c10::NoGradGuard no_grad;
  if (o.load_module_only) {
    LoadZero3Weights(e, folder, o);
    return result;
  }
  RestoreCounters(e, m, o);
  if (o.universal) {
    LoadZero3Universal(e, folder, m, o);
    return result;
  }
  LoadZero3Resharded(e, folder, o);
  return result;
}

}  // namespace uckpt::engine
