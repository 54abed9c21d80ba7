#include "ckpt/zero_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "ckpt/deepspeed_state.h"
#include "ckpt/fp16_optimizer_state.h"
#include "ckpt/manifest.h"
#include "ckpt/stage0_names.h"
#include "ckpt/tp_checkpoint.h"
#include "ckpt/values.h"
#include "format/error.h"

namespace uckpt::ckpt {

uint64_t StatePlan::bytes() const {
  uint64_t n = 0;
  for (auto p : pieces) n += p.size();
  return n;
}

uint64_t ParamPlan::bytes() const {
  uint64_t n = 0;
  for (const auto& s : states) n += s.bytes();
  return n;
}

uint64_t ZeroCheckpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& p : params) n += p.bytes();
  return n;
}

namespace {

std::vector<int64_t> Numels(const std::vector<NamedShape>& group) {
  std::vector<int64_t> numels;
  for (const auto& p : group) numels.push_back(p.numel());
  return numels;
}

// Refuses what this converter does not handle, naming the first such file.
// `tp_rank`: the tensor-parallel rank whose files are opened (ckpt/tp_checkpoint.h).
void RefuseUnsupportedFiles(const std::vector<CheckpointFile>& files, int tp_rank) {
  for (const auto& f : files) {
    if (f.kind == FileKind::kPipelineLayer)
      throw FormatError(f.path +
                        ": pipeline-parallel checkpoints (layer_* files) are not supported; "
                        "only tensor/pipeline-parallel size 1 (mp_world_size 1) can be converted");
    if (f.kind == FileKind::kMoeExpert)
      throw FormatError(f.path +
                        ": MoE expert checkpoints are not supported (DeepSpeed's converter cannot "
                        "handle them either: their model states have no param_shapes)");
    if ((f.kind == FileKind::kModelStates || f.kind == FileKind::kZero3ModelStates ||
         f.kind == FileKind::kOptimStates) &&
        f.mp != tp_rank)
      throw FormatError(f.path + ": tensor/pipeline-parallel checkpoints (mp_rank " + std::to_string(f.mp) +
                        " > 0) are not supported; only mp_world_size 1 can be converted");
  }
}

class Opener {
 public:
  // `tp_rank` of `tp_degree`: one tensor-parallel rank's files (AutoTP), whose
  // patterns the caller applies (ckpt/tp_checkpoint.h).
  Opener(const TagFolder& folder, int tp_rank, int tp_degree) : tp_rank_(tp_rank), tp_degree_(tp_degree) {
    c_.folder = folder.path;
  }

  ZeroCheckpoint Open(const std::vector<CheckpointFile>& files) {
    RefuseUnsupportedFiles(files, tp_rank_);
    if (OpenStage0(files)) return std::move(c_);
    FindOptimFiles(files);
    LoadOptimFiles();
    FindModelFiles(files);
    PlanRankFiles();
    if (c_.stage != 3 && WritesModuleOnlyFp32(c_.model.root)) PlanModuleOnly();
    return std::move(c_);
  }

 private:
  // A stage-0 folder: no rank files, the model states hold the module's
  // whole weights and the torch optimizer's own state_dict ('optimizer').
  // False when `files` are not one.
  bool OpenStage0(const std::vector<CheckpointFile>& files) {
    const CheckpointFile* model = nullptr;
    for (const auto& f : files) {
      if (f.kind == FileKind::kOptimStates || f.kind == FileKind::kZero3ModelStates) return false;
      if (f.kind == FileKind::kModelStates) model = &f;
    }
    if (!model) return false;
    TorchFile m = LoadTorchFile(model->path);
    ValuePtr opt = m.root && m.root->is_dict() ? m.root->get("optimizer") : nullptr;
    if (!opt || !opt->is_dict()) return false;
    c_.stage = 0;
    c_.dp = 1;  // every rank held everything
    c_.model_files.push_back(*model);
    c_.model = std::move(m);
    RefusePatterns(c_.model);
    const ModelStatesRun run = ReadModelStatesRun(c_.model.root);
    if (run.mp_world_size && *run.mp_world_size != tp_degree_)
      Fail(model->path, "tensor/pipeline-parallel checkpoints (mp_world_size " + std::to_string(*run.mp_world_size) +
                            ") are not supported; only mp_world_size 1 can be converted");
    c_.global_steps = run.global_steps.value_or(-1);
    PlanStage0(ReadModelStates(c_.model.root, model->path), model->path);
    return true;
  }

  // Which parameter each stage-0 state id is: uckpt's record; else (DeepSpeed's file) with one group
  // over every parameter, the module's in order (as torch numbers them); else by shape (stage0_names.h).
  std::vector<std::string> Stage0Names(const ModelStatesView& v, const std::vector<std::vector<int64_t>>& ids,
                                       const std::string& path) {
    if (!v.stage0_param_names.empty()) return v.stage0_param_names;
    const ModuleEntriesView entries = ReadModuleEntries(c_.model.root, path);
    std::set<std::string> aliases;
    for (const auto& [alias, owner] : entries.shared_params) aliases.insert(alias);
    std::vector<std::pair<std::string, std::vector<int64_t>>> params;
    for (const auto& [k, t] : NamedEntries(RequiredModule(c_.model.root, path), path + ": module"))
      if (!entries.buffer_names.count(k) && !aliases.count(k))
        params.emplace_back(k, AsTensor(t, path + ": module['" + k + "']").shape);
    bool in_order = ids.size() == 1 && ids[0].size() == params.size();
    for (size_t k = 0; in_order && k < ids[0].size(); ++k) in_order = ids[0][k] == static_cast<int64_t>(k);
    if (!in_order || v.fp16_optimizer) return Stage0NamesOfFile(v, params, ids, path);
    std::vector<std::string> names;
    for (const auto& param : params) names.push_back(param.first);
    return names;
  }

  void PlanStage0(const ModelStatesView& v, const std::string& path) {
    if (!v.stage0_param_groups) Fail(path, "optimizer has no param_groups");
    std::vector<std::vector<int64_t>> ids;
    for (const ValuePtr& g : AsList(v.stage0_param_groups, path + ": optimizer.param_groups")) {
      const std::string where = path + ": optimizer.param_groups[" + std::to_string(ids.size()) + "]";
      ids.emplace_back();
      for (const ValuePtr& id : AsList(Need(g, "params", where), where + "['params']")) {
        if (!id || id->kind != Kind::kInt) Fail(where + "['params']", "holds a non-integer id");
        ids.back().push_back(id->i);
      }
    }
    const std::vector<std::string> names = Stage0Names(v, ids, path);
    if (v.fp16_optimizer) {  // the masters and states are the fp16/bf16 wrapper's
      c_.params = Fp16OptimizerReadSource(v, path, names).params;
      for (const ParamPlan& p : c_.params) {
        if (p.group >= c_.steps.size()) c_.steps.push_back(p.step);
        if (c_.state_keys.empty())  // the first parameter's keys (the wrapper's optimizer has one set)
          for (size_t k = 1; k < p.states.size(); ++k) c_.state_keys.push_back(p.states[k].key);
      }
      return;
    }
    for (size_t g = 0; g < ids.size(); ++g) {
      ValuePtr group_step;
      bool first = true;  // a group's parameters share their optimizer's state keys
      std::vector<std::pair<std::string, const Tensor*>> group_first;
      for (const int64_t id : ids[g]) {
        if (id < 0 || id >= static_cast<int64_t>(names.size()))
          Fail(path + ": optimizer.param_groups[" + std::to_string(g) + "]",
               "names state id " + std::to_string(id) + " of no recorded parameter");
        ParamPlan p;
        p.name = names[id];
        auto w = v.module.find(p.name);
        if (w == v.module.end()) Fail(path, "module has no tensor '" + p.name + "'");
        p.shape = w->second->shape;
        p.numel = w->second->numel();
        p.group = g;
        const std::string where = path + ": optimizer.state[" + std::to_string(id) + "] ('" + p.name + "')";
        p.states.push_back(
            {kFp32, w->second->dtype, {TensorElements(*w->second, 0, p.numel, path + ": '" + p.name + "'")}});
        auto st = v.stage0_state.find(id);
        std::vector<std::pair<std::string, const Tensor*>> tensors;
        if (st != v.stage0_state.end()) tensors = st->second.tensors;
        for (const auto& [key, t] : tensors) {
          if (t->numel() != p.numel)
            Fail(where, "'" + key + "' has " + std::to_string(t->numel()) + " elements, the parameter " +
                            std::to_string(p.numel) + " (only element-wise optimizer states can be converted)");
          p.states.push_back({key, t->dtype, {TensorElements(*t, 0, p.numel, where + " '" + key + "'")}});
        }
        CheckStateKeys(tensors, group_first, where, first);
        if (first) group_first = tensors;
        first = false;
        if (st != v.stage0_state.end()) {
          p.step = st->second.step;
          p.scalars = st->second.scalars;
          p.none_states = st->second.none_states;
        }
        if (!group_step) group_step = p.step;
        c_.params.push_back(std::move(p));
      }
      c_.steps.push_back(group_step);
    }
  }

  void FindOptimFiles(const std::vector<CheckpointFile>& files) {
    std::vector<CheckpointFile> optim;
    for (const auto& f : files)
      if (f.kind == FileKind::kOptimStates) optim.push_back(f);
    if (optim.empty())
      throw FormatError(c_.folder + ": no zero_pp_rank_*_optim_states.pt files; not a ZeRO checkpoint tag folder");
    c_.optim_prefix = optim[0].prefix;
    for (const auto& f : optim)
      if (f.prefix != c_.optim_prefix)
        throw FormatError(f.path + ": optimizer file prefix '" + f.prefix + "' differs from '" + optim[0].prefix +
                          "' of " + optim[0].name + " (files of two checkpoints mixed?)");
    for (size_t i = 1; i < optim.size(); ++i)
      if (optim[i].dp == optim[i - 1].dp)
        throw FormatError(optim[i].path + ": a second optimizer file for dp rank " + std::to_string(optim[i].dp) +
                          " (beside " + optim[i - 1].name + ")");
    // The world size comes from the first file's own record; every rank
    // 0..dp-1 must then be present, and no other.
    c_.optim.push_back(LoadTorchFile(optim[0].path));
    const TorchFile& first = c_.optim[0];
    const OptimStatesHeader header = ReadOptimStatesHeader(first.root, first.file->path());
    c_.stage = header.zero_stage;
    if (c_.stage == 0) {
      c_.bf16_optimizer = true;
      c_.stage = 1;  // as DeepSpeed's converter treats it
    }
    if (c_.stage < 1 || c_.stage > 3) Fail(first.file->path(), "unknown zero_stage " + std::to_string(c_.stage));
    c_.dp = header.dp;
    for (const auto& f : optim)
      if (f.dp >= c_.dp)
        throw FormatError(f.path + ": extra rank file: " + optim[0].name + " records a data-parallel size of " +
                          std::to_string(c_.dp) + ", so ranks are 0.." + std::to_string(c_.dp - 1));
    for (int r = 0; r < c_.dp; ++r)
      if (r >= static_cast<int>(optim.size()) || optim[r].dp != r)
        throw FormatError(c_.folder + "/" + OptimStatesFileNameWithPrefix(r, c_.optim_prefix, tp_rank_) +
                          ": missing rank file (data-parallel size " + std::to_string(c_.dp) + " recorded in " +
                          optim[0].name + ")");
    c_.optim_files = optim;
  }

  void LoadOptimFiles() {
    for (int r = 1; r < c_.dp; ++r) c_.optim.push_back(LoadTorchFile(c_.optim_files[r].path));
    for (int r = 0; r < c_.dp; ++r) {
      const TorchFile& f = c_.optim[r];
      const OptimStatesHeader header = ReadOptimStatesHeader(f.root, f.file->path());
      const int stage = header.zero_stage;
      if ((stage == 0) != c_.bf16_optimizer || (stage != 0 && stage != c_.stage))
        Fail(f.file->path(), "zero_stage " + std::to_string(stage) + " differs from " + c_.optim_files[0].name +
                                 " (stage " + std::to_string(c_.bf16_optimizer ? 0 : c_.stage) + ")");
      const int dp = header.dp;
      if (dp != c_.dp)
        Fail(f.file->path(), "mixed world sizes: partition_count says " + std::to_string(dp) + " but " +
                                 c_.optim_files[0].name + " says " + std::to_string(c_.dp));
    }
  }

  void FindModelFiles(const std::vector<CheckpointFile>& files) {
    const FileKind kind = c_.stage == 3 ? FileKind::kZero3ModelStates : FileKind::kModelStates;
    for (const auto& f : files)
      if (f.kind == kind) c_.model_files.push_back(f);
    if (c_.stage == 3) {
      for (const auto& f : c_.model_files)
        if (f.dp >= c_.dp)
          throw FormatError(f.path + ": extra rank file: the optimizer files record a data-parallel size of " +
                            std::to_string(c_.dp));
      // DeepSpeed bug: after resuming ZeRO-3 from a universal checkpoint every
      // rank saves its model states to zero_pp_rank_0_*. Those files hold no
      // weights (ZeRO-3 partitions live in the optimizer files), so rank 0's
      // is enough.
      if (c_.dp > 1 && c_.model_files.size() == 1 && c_.model_files[0].dp == 0) {
        c_.warnings.push_back(c_.folder + ": only " + c_.model_files[0].name +
                              " is present (DeepSpeed writes no other ZeRO-3 model-states file after a universal "
                              "resume); it alone is copied");
      } else {
        for (int r = 0; r < c_.dp; ++r)
          if (r >= static_cast<int>(c_.model_files.size()) || c_.model_files[r].dp != r)
            throw FormatError(c_.folder + "/" + Zero3ModelStatesFileName(r, tp_rank_) +
                              ": missing rank file (data-parallel size " + std::to_string(c_.dp) + ")");
      }
    } else if (c_.model_files.empty()) {
      throw FormatError(c_.folder + "/" + ModelStatesFileName(tp_rank_) + ": missing model-states file");
    }
    c_.model = LoadTorchFile(c_.model_files[0].path);
    if (c_.stage != 3 && tp_degree_ == 1) RefusePatterns(c_.model);
    for (size_t i = 0; i < c_.model_files.size(); ++i) {
      TorchFile m = i == 0 ? c_.model : LoadTorchFile(c_.model_files[i].path);
      const std::string& path = m.file->path();
      const ModelStatesRun run = ReadModelStatesRun(m.root);
      if (run.dp_world_size && *run.dp_world_size != c_.dp)
        Fail(path, "mixed world sizes: dp_world_size is " + std::to_string(*run.dp_world_size) + " but there are " +
                       std::to_string(c_.dp) + " optimizer rank files");
      if (run.mp_world_size && *run.mp_world_size != tp_degree_)
        Fail(path, "tensor/pipeline-parallel checkpoints (mp_world_size " + std::to_string(*run.mp_world_size) +
                       ") are not supported; only mp_world_size 1 can be converted");
      const int64_t steps = run.global_steps.value_or(-1);
      if (i == 0) {
        c_.global_steps = steps;
      } else if (steps != c_.global_steps) {
        Fail(path, "mixed steps: global_steps is " + std::to_string(steps) + " but " + c_.model_files[0].name +
                       " says " + std::to_string(c_.global_steps));
      }
      if (i > 0) {
        // Every ZeRO-3 rank records the same parameter set.
        if (ReadRequiredParamShapes(m.root, path) != Shapes())
          Fail(path, "param_shapes differ from those of " + c_.model_files[0].name);
      }
    }
  }

  // DeepSpeed's converter from 0.19.8 on also writes zero/<name>/fp32.pt for
  // every module entry without optimizer fragments; a checkpoint says which
  // release wrote it (ds_version), and so which converter's output it gets.
  static bool WritesModuleOnlyFp32(const ValuePtr& root) {
    ValuePtr v = root->get("ds_version");
    if (!v || v->kind != Kind::kStr) return false;
    int major = 0, minor = 0, patch = 0;
    if (std::sscanf(v->s.c_str(), "%d.%d.%d", &major, &minor, &patch) < 2) return false;
    return std::tuple(major, minor, patch) >= std::tuple(0, 19, 8);
  }

  void PlanModuleOnly() {
    std::set<std::string> planned;
    for (const auto& p : c_.params) planned.insert(p.name);
    const std::string& path = c_.model.file->path();
    for (const auto& [name, v] : NamedEntries(RequiredModule(c_.model.root, path), path + ": module")) {
      if (planned.count(name)) continue;
      if (!v || v->kind != Kind::kTensor) Fail(path + ": module['" + name + "']", "is not a tensor");
      c_.module_only.emplace_back(name, v);
    }
  }

  // universal_checkpoint_info pattern lists change the output (no cat_dim,
  // cat_dim 1, sub-parameter keys, trimmed vocabulary rows); DeepSpeed's
  // ZeRO 1/2 converter applies them even without tensor parallelism. They are
  // not implemented, so such checkpoints are refused rather than converted
  // differently.
  static void RefusePatterns(const TorchFile& model) {
    ValuePtr info = model.root->get("universal_checkpoint_info");
    if (!info || !info->is_dict()) return;
    for (const auto& [k, v] : info->entries) {
      if (!k || k->kind != Kind::kStr || k->s.find("pattern") == std::string::npos) continue;
      if (k->s == "pipeline_replicated_parameter_patterns") continue;  // only matters for pp > 0
      if (v && (v->is_seq() ? !v->items.empty() : !IsNone(v)))
        Fail(model.file->path(), "universal_checkpoint_info['" + k->s +
                                     "'] is set; parameter pattern rules (TP merging, vocabulary trimming) are not "
                                     "supported");
    }
    for (const char* key : {"parameter_with_2_sub_params_cat_dim_0", "parameter_with_sub_params"})
      if (ValuePtr v = info->get(key); v && v->is_seq() && !v->items.empty())
        Fail(model.file->path(),
             "universal_checkpoint_info['" + std::string(key) + "'] is set; sub-parameter rules are not supported");
  }

  // Per-element states of one (rank, group) state dict. `length` is the
  // element count every per-element state must have; `whole_length` (stage
  // 1/2) the full size of the parameters the partition touches, which a state
  // kept whole per parameter has (DeepSpeed's Muon momentum_buffer at ZeRO
  // 1/2); such states are flagged in `whole`.
  void ReadGroupState(const ValuePtr& st, int64_t length, int64_t whole_length, const std::string& where,
                      std::vector<std::pair<std::string, const Tensor*>>* tensors, std::vector<bool>* whole,
                      ValuePtr* step, std::vector<std::pair<std::string, ValuePtr>>* scalars,
                      std::vector<std::string>* nones) {
    whole->clear();
    tensors->clear();
    scalars->clear();
    nones->clear();
    *step = nullptr;
    if (!st) return;
    for (const auto& [key, v] : NamedEntries(st, where)) {
      const std::string kw = where + "['" + key + "']";
      if (key == kStep) {
        *step = v;
        continue;
      }
      if (!v || IsNone(v)) {  // torch's None state (SGD's momentum_buffer without momentum)
        nones->push_back(key);
        continue;
      }
      const bool number = v->kind == Kind::kInt || v->kind == Kind::kFloat;
      if (number || (v->kind == Kind::kTensor && v->tensor->shape.empty())) {
        scalars->emplace_back(key, v);  // another scalar of the optimizer (NAdam's mu_product)
        continue;
      }
      if (v->kind == Kind::kTensor && v->tensor->shape.size() == 1 && v->tensor->numel() == length) {
        tensors->emplace_back(key, v->tensor.get());
        whole->push_back(false);
        continue;
      }
      if (v->kind == Kind::kTensor && v->tensor->shape.size() == 1 && whole_length >= 0 &&
          v->tensor->numel() == whole_length && whole_length != length) {
        tensors->emplace_back(key, v->tensor.get());
        whole->push_back(true);
        continue;
      }
      if (v && v->kind == Kind::kTensor && v->tensor->shape.size() == 1)
        Fail(kw, "has " + std::to_string(v->tensor->numel()) + " elements but the partition has " +
                     std::to_string(length) +
                     (whole_length >= 0 ? " and the parameters it touches " + std::to_string(whole_length) : "") +
                     " (shapes do not add up)");
      Fail(kw, "is not a per-element state (" + KindName(*v) +
                   "); only per-element optimizer states and 'step' "
                   "can be converted");
    }
  }

  // Checks that every rank has the same per-element state keys in a group as
  // rank 0 (`first`), and records them: a group's keys are its optimizer's own
  // (Muon's momentum_buffer beside its Adam group's exp_avg, exp_avg_sq).
  void CheckStateKeys(const std::vector<std::pair<std::string, const Tensor*>>& tensors,
                      const std::vector<std::pair<std::string, const Tensor*>>& first, const std::string& where,
                      bool is_first) {
    std::vector<std::string> keys, want;
    for (const auto& [k, t] : tensors) keys.push_back(k);
    for (const auto& [k, t] : first) want.push_back(k);
    if (is_first) {
      for (const auto& k : keys)
        if (std::find(c_.state_keys.begin(), c_.state_keys.end(), k) == c_.state_keys.end()) c_.state_keys.push_back(k);
      return;
    }
    if (keys != want) {
      auto join = [](const std::vector<std::string>& v) {
        std::string s;
        for (const auto& k : v) s += (s.empty() ? "" : ", ") + k;
        return "{" + s + "}";
      };
      Fail(where, "optimizer state keys " + join(keys) + " differ from " + join(want) + " of rank 0 in this group");
    }
  }

  // param_shapes of the first model-states file, parsed once.
  const ParamShapes& Shapes() {
    if (!shapes_) shapes_ = ReadRequiredParamShapes(c_.model.root, c_.model.file->path());
    return *shapes_;
  }

  // One (rank, group) of the rank files (stage 3: a sub-group): the fp32
  // partition, the per-element states, the step and the other scalars.
  struct RankGroup {
    const Tensor* fp32 = nullptr;
    std::vector<std::pair<std::string, const Tensor*>> states;
    std::vector<bool> whole;  // per state: kept whole per parameter touched (Muon at ZeRO 1/2), not per element
    ValuePtr step;
    std::vector<std::pair<std::string, ValuePtr>> scalars;
    std::vector<std::string> nones;
  };
  using RankGroups = std::vector<std::vector<RankGroup>>;  // [rank][group]

  // The planner of every stage's rank files. The stages differ only in where
  // a parameter lies: stage 1/2 flatten each group into one buffer split over
  // the ranks (FlatLayout), stage 3 splits every parameter on its own and
  // concatenates a sub-group's pieces per rank.
  void PlanRankFiles() {
    const ParamShapes& groups = Shapes();
    const bool z3 = c_.stage == 3;
    std::vector<int64_t> lengths;  // every rank's padded partition of each group
    for (const auto& g : groups) {
      int64_t n = 0;
      for (const auto& p : g) n += z3 ? Stage3PartitionSize(p.numel(), c_.dp) : p.numel();
      if (!z3) c_.layouts.push_back(MakeFlatLayout(n, c_.dp));
      lengths.push_back(z3 ? n : c_.layouts.back().partition_size);
    }
    const RankGroups rg = ReadRankGroups(groups, lengths);
    CheckSteps(rg);
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::vector<int64_t> numels = Numels(groups[g]);
      for (size_t i = 0; i < groups[g].size(); ++i)
        c_.params.push_back(
            PlanParam(groups[g][i], g, rg, z3 ? Stage3Fragments(numels, i) : ParamFragments(numels, c_.dp, i), numels));
    }
  }

  // Every rank's groups read and checked against the layout.
  RankGroups ReadRankGroups(const ParamShapes& groups, const std::vector<int64_t>& lengths) {
    const size_t G = groups.size();
    RankGroups rg(c_.dp, std::vector<RankGroup>(G));
    for (int r = 0; r < c_.dp; ++r) {
      const TorchFile& file = c_.optim[r];
      const RankOptimView v = c_.stage == 3 ? ReadStage3RankOptimStates(file.root, file.file->path())
                                            : ReadRankOptimStates(file.root, file.file->path());
      CheckGroupCount(v, G);
      for (size_t g = 0; g < G; ++g) {
        const PartitionView& part = v.partitions[g];
        CheckPartitionLength(part, r, g, lengths[g]);
        RankGroup& x = rg[r][g];
        x.fp32 = part.fp32;
        const int64_t whole = c_.stage == 3 ? -1 : TouchedNumel(groups[g], r);
        ReadGroupState(part.state, lengths[g], whole, part.state_where, &x.states, &x.whole, &x.step, &x.scalars,
                       &x.nones);
        CheckStateKeys(x.states, rg[0][g].states, part.state_where, r == 0);
        if (r > 0 && x.whole != rg[0][g].whole)
          Fail(part.state_where, "keeps its states per element and whole per parameter differently from rank 0");
        if (c_.stage != 3) CheckMappings(groups[g], r, part);
      }
    }
    return rg;
  }

  // The full numel of the parameters of `group` that have a piece in rank
  // `r`'s partition (stage 1/2), what a state kept whole per parameter holds.
  int64_t TouchedNumel(const std::vector<NamedShape>& group, int r) const {
    const std::vector<int64_t> numels = Numels(group);
    int64_t n = 0;
    for (const Fragment& f : RankFragments(numels, c_.dp, r)) n += numels[f.param];
    return n;
  }

  // Where parameter `param` starts in rank `r`'s whole-per-parameter state:
  // after the parameters of the partition before it.
  int64_t WholeOffset(const std::vector<int64_t>& numels, int r, size_t param) const {
    int64_t at = 0;
    for (const Fragment& f : RankFragments(numels, c_.dp, r)) {
      if (f.param == param) return at;
      at += numels[f.param];
    }
    return -1;
  }

  void CheckGroupCount(const RankOptimView& v, size_t groups) {
    if (v.partitions.size() == groups) return;
    if (c_.stage == 3)
      Fail(v.partitions_where, "has " + std::to_string(v.partitions.size()) + " sub-groups but the model states list " +
                                   std::to_string(groups));
    Fail(v.where, "has " + std::to_string(v.partitions.size()) +
                      " fp32 partitions and slice mappings but the "
                      "model states list " +
                      std::to_string(groups) + " param groups");
  }

  // The fp32 partition of rank `r`, group `g` must be as long as the layout
  // says (`length`: the padded partition).
  void CheckPartitionLength(const PartitionView& part, int r, size_t g, int64_t length) {
    const Tensor& t = *part.fp32;
    if (c_.stage == 3) {
      if (t.shape.size() == 1 && t.shape[0] == length) return;
      if (t.numel() == 0 && length > 0)
        Fail(part.fp32_where, "is empty: NVMe-offloaded optimizer partitions (offloaded_tensors/) are not supported");
      Fail(part.fp32_where, "has shape " + ShapeText(t.shape) + " but its parameters need " + std::to_string(length) +
                                " elements per rank (shapes do not add up)");
    }
    const FlatLayout& l = c_.layouts[g];
    const int64_t len = t.shape.size() == 1 ? t.shape[0] : -1;
    // Stage 1/2 strip this rank's padding (older DeepSpeed only on the last
    // rank, possibly "negative" there); BF16_Optimizer keeps it.
    const int64_t min_len = c_.bf16_optimizer ? l.partition_size : l.real_numel(r);
    if (len < min_len || len > l.partition_size)
      Fail(part.fp32_where, "has shape " + ShapeText(t.shape) + " but the flat layout (" + std::to_string(l.numel) +
                                " elements over " + std::to_string(c_.dp) + " ranks, partition " +
                                std::to_string(l.partition_size) + ") needs " + std::to_string(min_len) +
                                " real elements (shapes do not add up)");
  }

  // The step must agree over ranks (mixed steps mean files of different saves).
  void CheckSteps(const RankGroups& rg) {
    const char* unit = c_.stage == 3 ? "sub-group " : "param group ";
    for (size_t g = 0; g < rg[0].size(); ++g) {
      for (int r = 1; r < c_.dp; ++r)
        if (!SameValue(rg[r][g].step, rg[0][g].step))
          Fail(c_.optim[r].file->path(), "mixed steps: " + std::string(unit) + std::to_string(g) + " has step " +
                                             StepText(rg[r][g].step) + " but rank 0 has " + StepText(rg[0][g].step));
      c_.steps.push_back(rg[0][g].step);
    }
  }

  // Parameter `i` of a stage-3 sub-group over the ranks: each rank's piece
  // sits after the padded pieces of the parameters before it.
  std::vector<Fragment> Stage3Fragments(const std::vector<int64_t>& numels, size_t i) const {
    int64_t slot = 0;
    for (size_t k = 0; k < i; ++k) slot += Stage3PartitionSize(numels[k], c_.dp);
    const int64_t ps = Stage3PartitionSize(numels[i], c_.dp);
    std::vector<Fragment> frags;
    for (int r = 0; r < c_.dp; ++r) {
      const int64_t real = Stage3RealNumel(numels[i], c_.dp, r);
      if (real == 0) break;
      frags.push_back(Fragment{i, r, r * ps, slot, real});
    }
    return frags;
  }

  // A parameter's plan: every state's pieces over `frags`, in rank order.
  // Every rank must hold each state in rank 0's dtype.
  ParamPlan PlanParam(const NamedShape& shape, size_t g, const RankGroups& rg, const std::vector<Fragment>& frags,
                      const std::vector<int64_t>& numels) {
    ParamPlan p;
    p.name = shape.name;
    p.shape = shape.shape;
    p.numel = shape.numel();
    p.group = g;
    const RankGroup& first = rg[0][g];
    p.states.push_back(StatePlan{kFp32, first.fp32->dtype, {}});
    for (const auto& [k, t] : first.states) p.states.push_back(StatePlan{k, t->dtype, {}});
    for (const Fragment& f : frags) {
      const RankGroup& x = rg[f.rank][g];
      const std::string where = c_.optim[f.rank].file->path() + ": '" + p.name + "'";
      for (size_t k = 0; k < p.states.size(); ++k) {
        StatePlan& st = p.states[k];
        const Tensor& t = k == 0 ? *x.fp32 : *x.states[k - 1].second;
        if (t.dtype != st.dtype)
          Fail(where, "'" + st.key + "' is " + std::string(DTypeName(t.dtype)) + ", but " +
                          std::string(DTypeName(st.dtype)) + " in " + c_.optim[0].file->path() +
                          ": the ranks' files disagree (files of two checkpoints "
                          "mixed?)");
        if (k > 0 && x.whole[k - 1]) {  // the whole parameter, from the first rank that holds a piece of it
          if (&f != &frags.front()) continue;
          const int64_t at = WholeOffset(numels, f.rank, f.param);
          st.pieces.push_back(TensorElements(t, at, p.numel, where + " " + st.key));
          continue;
        }
        st.pieces.push_back(TensorElements(t, f.partition_offset, f.numel, where + " " + st.key));
      }
    }
    // The step and scalars of the rank that holds the parameter's start
    // (stage 3: rank 0's, also for an empty parameter).
    const RankGroup* owner = !frags.empty() ? &rg[frags[0].rank][g] : c_.stage == 3 ? &first : nullptr;
    if (!owner) return p;
    p.scalars = owner->scalars;
    p.none_states = owner->nones;
    // DeepSpeed's converter writes no step of ZeRO-3's Adam (its step is
    // the applied steps); any other optimizer's step is kept as at stage 1/2.
    std::vector<std::string> group_keys;
    for (const auto& [k, t] : first.states) group_keys.push_back(k);
    if (c_.stage != 3 || !IsAdamStateKeys(group_keys) || !p.scalars.empty()) p.step = owner->step;
    return p;
  }

  // param_slice_mappings of (rank, group) must be exactly the fragments the
  // flat layout gives; anything else (round_robin_gradients, corruption) would
  // scramble parameters.
  void CheckMappings(const std::vector<NamedShape>& group, int r, const PartitionView& part) {
    const std::string& where = part.mappings_where;
    auto frags = RankFragments(Numels(group), c_.dp, r);
    if (part.mappings.size() != frags.size())
      Fail(where, "lists " + std::to_string(part.mappings.size()) +
                      " parameters but the flat layout of param_shapes puts " + std::to_string(frags.size()) +
                      " in this rank's partition (round_robin_gradients is not supported)");
    for (size_t k = 0; k < frags.size(); ++k) {
      const Fragment& f = frags[k];
      const std::string& name = group[f.param].name;
      const auto& [entry, address] = part.mappings[k];
      if (entry != name || address.numel != f.numel || address.start != f.partition_offset)
        Fail(where, "entry '" + entry + "' (start " + std::to_string(address.start) + ", numel " +
                        std::to_string(address.numel) + ") does not match the flat layout, which has '" + name +
                        "' (start " + std::to_string(f.partition_offset) + ", numel " + std::to_string(f.numel) +
                        ") (round_robin_gradients is not supported)");
    }
  }

  std::optional<ParamShapes> shapes_;
  int tp_rank_ = 0, tp_degree_ = 1;
  ZeroCheckpoint c_;
};

}  // namespace

ZeroCheckpoint OpenZeroCheckpoint(const std::string& folder, bool verify_hashes, bool check_manifest) {
  const TagFolder opened = OpenTagFolder(folder);
  if (check_manifest) CheckFolderAgainstManifest(opened, verify_hashes);
  return OpenZeroCheckpoint(opened);
}

ZeroCheckpoint OpenZeroCheckpoint(const TagFolder& folder) {
  if (const int tp = TensorParallelDegree(folder); tp > 1) return OpenTensorParallelCheckpoint(folder, tp);
  return Opener(folder, 0, 1).Open(folder.files);
}

ZeroCheckpoint OpenTensorParallelRank(const TagFolder& folder, int tp_rank, int tp_degree) {
  std::vector<CheckpointFile> files;
  for (const CheckpointFile& f : folder.files)
    if (f.mp < 0 || f.mp == tp_rank) files.push_back(f);
  return Opener(folder, tp_rank, tp_degree).Open(files);
}

}  // namespace uckpt::ckpt
