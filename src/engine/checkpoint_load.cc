// LoadEngineCheckpoint (checkpoint.h): one load path for every stage and
// every source, read into the engine's partitions through resharded_load.h
// (the save side is checkpoint.cc).
#include "engine/checkpoint.h"

#include <c10/core/GradMode.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include "ckpt/deepspeed_names.h"
#include "ckpt/folder.h"
#include "ckpt/manifest.h"
#include "ckpt/tag_folder.h"
#include "ckpt/tp_checkpoint.h"
#include "ckpt/universal_checkpoint.h"
#include "engine/async_save.h"
#include "engine/fingerprint.h"
#include "engine/resharded_load.h"
#include "engine/torch_bridge.h"
#include "format/env.h"
#include "format/error.h"
#include "format/file.h"
#include "format/pickle_reader.h"
#include "format/pickle_writer.h"
#include "format/torch_file.h"

namespace uckpt::engine {
namespace fs = std::filesystem;

// ---- Loading: one path for every stage and every source. ----

namespace {

// The counters and the lr schedule's position.
void RestoreCounters(const CheckpointState& e, const ckpt::ModelStatesView& m, const LoadCheckpointOptions& o) {
  e.counters.global_steps = m.global_steps;
  e.counters.skipped_steps = m.skipped_steps;
  e.counters.global_samples = m.global_samples ? *m.global_samples : e.counters.global_steps * e.batch.train_batch_size;
  e.counters.micro_steps = e.counters.global_steps * e.batch.gradient_accumulation_steps;
  // DeepSpeed's load_state_dict sets the position only: the lr follows from
  // it now when the saved optimizer groups come with it, else at the next step.
  // Not loading the scheduler's state keeps its position, as DeepSpeed's.
  const bool set_lr = o.load_optimizer_states;
  if (o.load_lr_scheduler_states && m.last_batch_iteration) {
    e.schedule.Restore(*m.last_batch_iteration, set_lr);
  } else if (o.load_lr_scheduler_states && e.counters.global_steps > 0 && !e.config.scheduler.type.empty()) {
    // No saved scheduler: continue the schedule where the step count says.
    e.schedule.Restore(e.counters.global_steps - 1 - e.counters.skipped_steps, set_lr);
  }
}

// The saved param groups' hyper-parameters, kept only on request (as
// DeepSpeed's torch optimizer load_state_dict keeps them): lr for the next
// step (a configured scheduler sets the lr again from its own config and the
// restored position after that step, as DeepSpeed's does), and betas, eps and
// weight_decay for the rest of the run.
void ApplySavedHparams(const CheckpointState& e, const std::string& path, const ValuePtr& groups,
                       const LoadCheckpointOptions& o) {
  if (!o.keep_saved_hparams || !groups || !groups->is_seq()) return;
  const size_t n = e.runtime.num_groups();
  for (size_t g = 0; g < n && g < groups->items.size(); ++g) {
    OptimizerConfig c = e.runtime.optimizer_config(g);
    const ckpt::AdamHparams h =
        ckpt::ReadAdamHparams(groups->items[g], {e.schedule.current_lr(g), c.beta1, c.beta2, c.eps, c.weight_decay},
                              path + ": param_groups[" + std::to_string(g) + "]");
    e.schedule.set_current_lr(g, h.lr);
    c.beta1 = h.beta1;
    c.beta2 = h.beta2;
    c.eps = h.eps;
    c.weight_decay = h.weight_decay;
    e.runtime.set_optimizer_config(g, c);
  }
}

// The engine's own optimizer is Adam: a state whose param groups have Adam's
// betas but no eps was saved by another optimizer with Adam's state names
// (DeepSpeed's CPU Lion keeps exp_avg and exp_avg_sq); refused before any read.
// DeepSpeed's torch Adam would take it and fail at its step (KeyError: 'eps').
void RefuseOtherThanAdam(const LoadSource& source) {
  if (!source.param_groups || !source.param_groups->is_seq() || source.state_keys.empty()) return;
  for (size_t g = 0; g < source.param_groups->items.size(); ++g) {
    const ValuePtr& group = source.param_groups->items[g];
    if (group && group->is_dict() && group->get("betas") && !group->get("eps"))
      throw FormatError(source.optimizer_file + ": param_groups[" + std::to_string(g) +
                        "] has betas but no 'eps': its state was saved by an optimizer other than Adam with "
                        "Adam's state names (DeepSpeed's Lion: lr, betas, weight_decay); the engine's optimizer is "
                        "Adam and cannot resume it (`uckpt convert` and `uckpt export` read it)");
  }
}

// The tag folder a load reads: `tag`, else the one the tag file (`latest`,
// `latest_universal`) names; empty when there is neither (nothing saved yet).
std::string TagFolderPath(const std::string& dir, const std::string& tag, bool universal) {
  const char* tag_file = ckpt::TagFileName(universal);
  if (tag.empty() && !fs::exists(dir + "/" + tag_file)) return "";
  return dir + "/" + (tag.empty() ? ReadTagFile(dir, tag_file) : ckpt::CheckTag(tag, "checkpoint tag"));
}

// Before the hash check of a folder published before it was durable (its
// save was killed in the sync window, or its sync failed): every rank syncs
// the filesystem holding it, then drops the folder's files from the page
// cache, so that the check reads what the disk holds (pages a failed
// writeback left in the cache would pass it). Returns whether every rank
// did; if not, the check reads what it can and the marker stays.
bool SyncAndDropCached(Comm& comm, const ckpt::TagFolder& folder) {
  std::string error;
  try {
    Env::Current().SyncFilesystem(folder.path);
    for (const ckpt::CheckpointFile& f : folder.files) Env::Current().DropCached(f.path);
  } catch (const std::exception& ex) {
    error = ex.what();
  }
  error = AgreedError(comm, error);
  if (!error.empty() && comm.rank() == 0)
    std::fprintf(stderr,
                 "uckpt: warning: %s (published before its files were on disk) could not be synced: %s; "
                 "it stays marked\n",
                 folder.path.c_str(), error.c_str());
  return error.empty();
}

// After such a folder was synced and every file read back from the disk
// matched its manifest: rank 0 removes the marker, so that later loads need
// not hash it again (if it cannot, the marker stays).
void Unmark(Comm& comm, const std::string& folder) {
  if (comm.rank() != 0) return;
  try {
    ckpt::RemoveUnsyncedMarker(folder);
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "uckpt: warning: %s is whole, but %s stays (%s); later loads check it by hash too\n",
                 folder.c_str(), ckpt::UnsyncedMarkerPath(folder).c_str(), ex.what());
  }
}

// Sizes on every rank (cheap, and every rank reaches the same verdict); with
// verify_hashes the ranks split the hashing (each file is read once, not once
// per rank) and then agree, so that all of them stop if any file is bad.
void CheckManifestOnEveryRank(Comm& comm, ckpt::TagFolder& folder, bool hashes) {
  // A folder published before it was durable is checked by hash
  // (ckpt/manifest.h), on every rank if any sees the marker. Its manifest
  // is read again once the folder's pages are dropped, so that both sides
  // of the check come from the disk (only a marked folder's is read twice).
  at::Tensor unsynced = at::full({1}, folder.unsynced ? 1.0f : 0.0f);
  comm.AllReduceMax(unsynced);
  const bool marked = unsynced.item<float>() > 0;
  const bool synced = marked && SyncAndDropCached(comm, folder);
  if (marked) ckpt::ReadManifestAgain(folder);
  hashes = hashes || marked;
  if (!hashes) {
    ckpt::CheckFolderAgainstManifest(folder, false);
    return;
  }
  std::string error;
  try {
    ckpt::CheckFolderAgainstManifest(folder, true, comm.rank(), comm.world_size());
  } catch (const FormatError& ex) {
    error = ex.what();
  }
  // Every rank reports the finder's error (it names the files).
  if (std::string agreed = AgreedError(comm, error); !agreed.empty()) throw FormatError(agreed);
  if (synced) Unmark(comm, folder.path);
}

// The model-states file a rank reads, read.
struct ModelStatesFile {
  std::string path;
  TorchFile file;
  ckpt::ModelStatesView view;
  bool stage12 = false;  // mp_rank_00_model_states.pt: its module holds the whole weights
};

// A ZeRO folder: the one file of stages 0-2; of a ZeRO-3 folder its own
// rank's, else (saved by fewer ranks) rank 0's. A universal folder: its
// source's mp_rank_00_model_states.pt, or the lowest rank's ZeRO-3 copy.
ModelStatesFile ReadModelStatesFile(const ckpt::TagFolder& folder, int rank, bool universal) {
  ModelStatesFile f;
  if (universal) {
    // Listed by kind (stage 0-2 file first), then rank.
    if (folder.model_states.empty())
      throw FormatError(folder.path + ": no *model_states.pt file (not a universal checkpoint?)");
    f.path = folder.model_states.front().path;
  } else {
    for (const std::string& name :
         {ckpt::ModelStatesFileName(), ckpt::Zero3ModelStatesFileName(rank), ckpt::Zero3ModelStatesFileName(0)})
      if (const ckpt::CheckpointFile* c = folder.Find(name); f.path.empty() && c) f.path = c->path;
    if (f.path.empty())
      throw FormatError(folder.path + ": has no " + ckpt::ModelStatesFileName() + " and no " +
                        ckpt::Zero3ModelStatesFileName(0) + " (not a ZeRO checkpoint folder?)");
  }
  f.stage12 = f.path == folder.path + "/" + ckpt::ModelStatesFileName();
  f.file = LoadTorchFile(f.path);
  f.view = ckpt::ReadModelStates(f.file.root, f.path);
  return f;
}

// param_shapes must name this engine's groups and parameters in order.
void CheckParamShapes(const CheckpointState& e, const std::string& path, const ValuePtr& root) {
  const auto saved = ckpt::ReadParamShapes(root, path);
  if (saved.empty()) return;
  if (saved.size() != e.module.groups.size())
    throw FormatError(path + ": param_shapes has " + std::to_string(saved.size()) +
                      " parameter groups, this engine has " + std::to_string(e.module.groups.size()));
  for (size_t g = 0; g < e.module.groups.size(); ++g) {
    const auto& params = e.module.groups[g];
    if (saved[g].size() != params.size())
      throw FormatError(path + ": param_shapes[" + std::to_string(g) + "] has " + std::to_string(saved[g].size()) +
                        " parameters, this model's group has " + std::to_string(params.size()) +
                        " (a different model or model size?)");
    for (size_t k = 0; k < params.size(); ++k) {
      const ckpt::NamedShape& ns = saved[g][k];
      if (ns.name != params[k].name || ns.shape != params[k].tensor.sizes().vec())
        throw FormatError(path + ": parameter " + std::to_string(k) + " of group " + std::to_string(g) + " is " +
                          ns.name + " " + c10::str(at::IntArrayRef(ns.shape)) + ", this model has " + params[k].name +
                          " " + c10::str(params[k].tensor.sizes()));
    }
  }
}

// Every zero_pp_rank_<r>_mp_rank_00_model_states.pt of `folder`, in rank
// order: `dp` of them (the saving world size), else as many as there are.
std::vector<TorchFile> Zero3ModelStatesFiles(const ckpt::TagFolder& folder, std::optional<int64_t> dp) {
  std::map<int, std::string> by_rank;
  for (const auto& f : folder.model_states)
    if (f.kind == ckpt::FileKind::kZero3ModelStates) by_rank[f.dp] = f.path;
  const int n = static_cast<int>(dp.value_or(static_cast<int64_t>(by_rank.size())));
  std::vector<TorchFile> out;
  for (int r = 0; r < std::max(n, 1); ++r) {
    auto it = by_rank.find(r);
    if (it == by_rank.end())
      throw FormatError(folder.path + "/" + ckpt::Zero3ModelStatesFileName(r) +
                        ": missing; frozen parameters saved partitioned by ZeRO-3 need every rank's fragment");
    out.push_back(LoadTorchFile(it->second));
  }
  return out;
}

// A frozen parameter that ZeRO-3 saved partitioned, whole again.
at::Tensor WholeFrozen(const std::vector<TorchFile>& ranks, const std::string& name, int64_t numel) {
  const int dp = static_cast<int>(ranks.size());
  const std::vector<ValuePtr> frags = ckpt::Stage3FrozenFragments(ranks, name, numel);
  std::vector<at::Tensor> parts;
  for (int r = 0; r < dp; ++r)
    if (const int64_t real = ckpt::Stage3RealNumel(numel, dp, r); real > 0)
      parts.push_back(ToTorch(*frags[r]->tensor).reshape(-1).narrow(0, 0, real));
  return at::cat(parts);
}

// Frozen parameters and buffers from the model states (also from a universal
// checkpoint's copy of them, which DeepSpeed leaves out). One that the file
// holds empty is a frozen parameter DeepSpeed's ZeRO-3 saved partitioned: it
// is put together from every rank's frozen_param_fragments. A missing name
// or another shape is an error naming the file, unless !strict (DeepSpeed's
// load_module_strict=False): a missing one keeps the model's value.
void LoadFixedParams(const CheckpointState& e, const ckpt::TagFolder& folder, const ModelStatesFile& model,
                     bool strict) {
  std::vector<NamedParam> fixed = e.module.frozen;
  fixed.insert(fixed.end(), e.module.buffers.begin(), e.module.buffers.end());
  std::optional<std::vector<TorchFile>> ranks;
  for (const auto& p : fixed) {
    auto it = model.view.module.find(p.name);
    if (it == model.view.module.end() && !strict) continue;
    if (it == model.view.module.end())
      throw FormatError(model.path + ": module has no tensor '" + p.name + "'" +
                        (e.module.frozen.empty() ? ""
                                                 : " (saved with exclude_frozen_parameters? load with "
                                                   "load_module_strict=False)"));
    if (it->second->numel() == 0 && p.tensor.numel() > 0) {
      if (!ranks) ranks = Zero3ModelStatesFiles(folder, model.view.dp_world_size);
      p.tensor.copy_(WholeFrozen(*ranks, p.name, p.tensor.numel()).view(p.tensor.sizes()));
      continue;
    }
    if (it->second->shape != p.tensor.sizes().vec())
      throw FormatError(model.path + ": '" + p.name + "' has shape " + c10::str(at::IntArrayRef(it->second->shape)) +
                        ", the model needs " + c10::str(p.tensor.sizes()));
    p.tensor.copy_(ToTorch(*it->second).view(p.tensor.sizes()));
  }
}

// Whether the trainable weights come from a stage 0-2 folder's module state
// (16-bit in fp16/bf16 runs, as DeepSpeed's module load) rather than the
// fp32 masters of its rank files: where the weights are whole (stages 0-2)
// for weights-only and no-optimizer loads, and for stage-0 checkpoints (into
// any stage; stage 0 resumes a ZeRO 1/2 folder from its rank files). A
// ZeRO-3 folder's module holds no trainable weights; stage 3 reads its
// partitions' masters.
bool WeightsFromModule(const CheckpointState& e, const ckpt::TagFolder& folder, const ModelStatesFile& model,
                       const LoadCheckpointOptions& o) {
  if (!model.stage12) return false;
  const bool rank_files = !folder.rank_files.empty();
  // A stage-0 folder (torch's optimizer state in the model states, no rank files) into any stage.
  if (model.view.stage0_param_groups && !rank_files) return true;
  if (e.runtime.partitions_parameters()) return false;
  if (o.load_module_only || !o.load_optimizer_states) return true;
  return e.stage() == 0 && (model.view.stage0_param_groups || !rank_files);
}

// The planner's source, chosen by what the folder is.
LoadSource OpenSource(const CheckpointState& e, const ckpt::TagFolder& folder, const ModelStatesFile& model,
                      const std::vector<PartitionSlot>& slots, const LoadCheckpointOptions& o, bool moments) {
  if (o.universal) return OpenUniversalFolder(folder, slots, moments);
  if (WeightsFromModule(e, folder, model, o)) return ModelStatesSource(model.view, model.path, slots, moments);
  return OpenRankFiles(folder);
}

// The saved loss scale into the run's, from either layout: the scaler object a ZeRO
// optimizer file (or a universal folder) pickles, or the entries of a stage-0 fp16 file's
// FP16_Optimizer, which only an fp16 run takes back.
void LoadLossScaler(LossScaler& s, const LoadSource& source, const ckpt::ModelStatesView& m, bool fp16) {
  ckpt::LossScalerState& state = s;
  if (source.kind == SourceKind::kModelStates && m.fp16_optimizer) {
    if (!fp16) return;
    state = ckpt::ReadLossScaler(*m.fp16_optimizer, state);
    s.integral_scale = m.fp16_optimizer->cur_scale_integral;  // FP16_Optimizer pickles an int scale as one
    return;
  }
  state = ckpt::ReadLossScaler(source.loss_scaler, state);
}

// Every partition this rank owns from the source (resharded_load.h), hashed
// for the resume proof where the folder has no record, then
// the weights from them; with the optimizer state, the loss scaler and the
// saved hyper-parameters. Weights-only loads leave Adam's state, the loss
// scale and the hyper-parameters as they were.
void LoadPartitions(const CheckpointState& e, const ckpt::TagFolder& folder, const ModelStatesFile& model,
                    const LoadCheckpointOptions& o, FingerprintCheck& proof) {
  std::vector<PartitionSlot> slots = e.runtime.Slots();
  const bool moments = o.load_optimizer_states && !o.load_module_only;
  const LoadSource source = OpenSource(e, folder, model, slots, o, moments);
  if (moments && !e.client_optimizer) RefuseOtherThanAdam(source);
  std::vector<TensorReads> reads =
      PlanSlotLoads(source, slots, moments, static_cast<double>(e.counters.global_steps - e.counters.skipped_steps),
                    e.client_optimizer);
  StagedOptions read_options;
  read_options.reads.read = source.release;
  const uint64_t bytes = FillFromReads(reads, read_options);
  HashLoadedState(e.fingerprint(), proof, source, reads);
  e.runtime.WeightsFromMasters();
  if (o.load_module_only) {
    // Whole weights (stages 0-2) give the masters their 16-bit values, as
    // DeepSpeed refreshes its fp32 copies from the loaded module; stage 3's
    // masters stay the checkpoint's fp32.
    if (!e.runtime.partitions_parameters()) e.runtime.MastersFromWeights();
    return;
  }
  LoadLossScaler(e.runtime.loss_scaler(), source, model.view, e.config.fp16.enabled);
  // DeepSpeed's ZeRO optimizers take their `overflow` back with the loss scaler.
  if (source.overflow) e.counters.last_step_skipped = *source.overflow;
  ApplySavedHparams(e, source.optimizer_file, source.param_groups, o);
  // For a client optimizer's own keys (SGD's momentum, ...): the caller restores them into its groups.
  if (moments && source.param_groups) e.last_load.optimizer_param_groups = ToIValue(source.param_groups);
  if (source.kind == SourceKind::kRankFiles) e.last_load.optimizer_bytes_read = bytes;
}

// The client's keys: a dict of every top-level key that is not the file's own.
ClientState ClientStateOf(const ckpt::ModelStatesView& m) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [k, v] : m.client) d.insert(k, ToIValue(v));
  return c10::IValue(d);
}

// The default pickle policy for the scope of one load (LoadCheckpointOptions::trust_pickled_client_state).
class ScopedPicklePolicy {
 public:
  explicit ScopedPicklePolicy(PicklePolicy p) : saved_(DefaultPicklePolicy()) { SetDefaultPicklePolicy(p); }
  ~ScopedPicklePolicy() { SetDefaultPicklePolicy(saved_); }
  ScopedPicklePolicy(const ScopedPicklePolicy&) = delete;
  ScopedPicklePolicy& operator=(const ScopedPicklePolicy&) = delete;

 private:
  PicklePolicy saved_;
};

LoadResult LoadEngineCheckpointFiles(const CheckpointState& e, const std::string& dir, const std::string& tag,
                                     const LoadCheckpointOptions& o);

}  // namespace

// DeepSpeed pickles any object a script puts in client_state (torch.save); uckpt's reader names only its
// allow-list unless the caller trusts the checkpoint: then every file of the load is read naming any class (still
// never running one), and the client keys' objects come back as PickledObject capsules.
LoadResult LoadEngineCheckpoint(const CheckpointState& e, const std::string& dir, const std::string& tag,
                                const LoadCheckpointOptions& o) {
  std::optional<ScopedPicklePolicy> lenient;
  if (o.trust_pickled_client_state) lenient.emplace(PicklePolicy::kLenient);
  try {
    return LoadEngineCheckpointFiles(e, dir, tag, o);
  } catch (const FormatError& err) {
    if (o.trust_pickled_client_state || std::string(err.what()).find("strict mode refuses") == std::string::npos) throw;
    throw FormatError(std::string(err.what()) +
                      ". If that is an object the training script saved in client_state and you trust this "
                      "checkpoint, load it with LoadCheckpointOptions::trust_pickled_client_state (from Python: "
                      "UCKPT_TRUST_PICKLED_CLIENT_STATE=1, which has Python's pickle rebuild it, as DeepSpeed's "
                      "torch.load(weights_only=False) does)");
  }
}

namespace {

// Open, check, plan, read, verify: the folder is listed once and its
// manifest read once (ckpt/tag_folder.h); every step works from that.
LoadResult LoadEngineCheckpointFiles(const CheckpointState& e, const std::string& dir, const std::string& tag,
                                     const LoadCheckpointOptions& o) {
  const std::string path = TagFolderPath(dir, tag, o.universal);
  if (path.empty()) return LoadResult{"", c10::IValue()};
  ckpt::TagFolder folder = ckpt::OpenTagFolder(path);
  CheckManifestOnEveryRank(e.comm, folder, o.verify_hashes);
  FingerprintCheck proof = StartStateFingerprintCheck(folder, o);  // the resume proof
  const ModelStatesFile model = ReadModelStatesFile(folder, e.comm.rank(), o.universal);
  if (const std::string why = ckpt::TensorParallelLoadRefusal(folder, model.file.root); !why.empty())
    throw FormatError(why);
  if (model.stage12 && !e.runtime.partitions_parameters()) CheckParamShapes(e, model.path, model.file.root);
  c10::NoGradGuard no_grad;
  LoadFixedParams(e, folder, model, o.load_module_strict);
  if (!o.load_module_only) RestoreCounters(e, model.view, o);
  LoadPartitions(e, folder, model, o, proof);
  FinishStateFingerprintCheck(e.fingerprint(), !e.config.fp16.enabled && !e.config.bf16, proof, o, e.last_load);
  if (model.view.lr_scheduler) e.last_load.lr_scheduler_state = ToIValue(model.view.lr_scheduler);
  return LoadResult{path, ClientStateOf(model.view)};
}

}  // namespace

}  // namespace uckpt::engine
