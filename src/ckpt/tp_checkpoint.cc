#include "ckpt/tp_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "ckpt/deepspeed_state.h"
#include "ckpt/tp_merge.h"
#include "ckpt/values.h"
#include "format/error.h"

namespace uckpt::ckpt {

namespace {

using TpSpans = std::vector<std::span<const uint8_t>>;

// Byte ranges of a state whose data is the concatenation of `pieces`.
class TpPieceIndex {
 public:
  explicit TpPieceIndex(const TpSpans& pieces) : pieces_(pieces) {
    uint64_t at = 0;
    for (auto p : pieces_) {
      starts_.push_back(at);
      at += p.size();
    }
    total_ = at;
  }
  uint64_t total() const { return total_; }

  // Appends the spans of bytes [begin, begin + size) to `out`.
  void Append(uint64_t begin, uint64_t size, TpSpans* out) const {
    if (begin + size > total_) throw FormatError("tensor-parallel merge: a run reaches past its shard");
    size_t k = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
    while (size > 0) {
      const uint64_t off = begin - starts_[k];
      const uint64_t n = std::min<uint64_t>(size, pieces_[k].size() - off);
      if (n > 0) out->push_back(pieces_[k].subspan(off, n));
      begin += n;
      size -= n;
      ++k;
    }
  }

 private:
  const TpSpans& pieces_;
  std::vector<uint64_t> starts_;
  uint64_t total_ = 0;
};

bool TpSameBytes(const TpSpans& a, const TpSpans& b) {
  size_t i = 0, j = 0;
  uint64_t oa = 0, ob = 0;
  while (i < a.size() && j < b.size()) {
    const uint64_t n = std::min<uint64_t>(a[i].size() - oa, b[j].size() - ob);
    if (std::memcmp(a[i].data() + oa, b[j].data() + ob, n) != 0) return false;
    oa += n;
    ob += n;
    if (oa == a[i].size()) ++i, oa = 0;
    if (ob == b[j].size()) ++j, ob = 0;
  }
  return true;
}

// Splits `spans` at byte `keep`: the first part stays, the rest goes to `tail`.
void TpSplitAt(TpSpans& spans, uint64_t keep, TpSpans* tail) {
  TpSpans head;
  uint64_t at = 0;
  for (auto s : spans) {
    if (at >= keep) {
      tail->push_back(s);
    } else if (at + s.size() <= keep) {
      head.push_back(s);
    } else {
      head.push_back(s.subspan(0, keep - at));
      tail->push_back(s.subspan(keep - at));
    }
    at += s.size();
  }
  spans = std::move(head);
}

class TpMerger {
 public:
  TpMerger(const TagFolder& folder, int tp) : folder_(folder), tp_(tp) {}

  ZeroCheckpoint Merge() {
    for (int t = 0; t < tp_; ++t) ranks_.push_back(OpenTensorParallelRank(folder_, t, tp_));
    const ZeroCheckpoint& first = ranks_[0];
    where_ = first.model.file->path();
    CheckRanksAgree();
    const ValuePtr info = first.model.root->get("universal_checkpoint_info");
    if (!info || !info->is_dict())
      Fail(where_, "has " + std::to_string(tp_) +
                       " tensor-parallel ranks but no universal_checkpoint_info: only AutoTP checkpoints (DeepSpeed "
                       ">= 0.18.9, tensor_parallel.autotp_size) say how to merge their shards");
    rules_ = ReadTpRules(info, where_ + ": universal_checkpoint_info");
    if (!rules_.unsupported.empty())
      Fail(where_ + ": universal_checkpoint_info['autotp_unsupported_parameter_patterns']",
           "AutoTP marked '" + rules_.unsupported[0].first + "' as not convertible: " + rules_.unsupported[0].second +
               " (DeepSpeed's converter refuses it too)");
    ZeroCheckpoint out = Shell();
    std::set<std::string> unused = rules_.CategoryPatterns();
    for (size_t i = 0; i < first.params.size(); ++i) {
      out.tp_files.emplace_back();
      out.params.push_back(MergeParam(i, &unused, &out.tp_files.back()));
    }
    out.unused_tp_patterns.assign(unused.begin(), unused.end());
    return out;
  }

 private:
  // Every rank is one run's: the same stage, data-parallel size, parameters
  // (names and groups; shapes are the shards'), optimizer states and step.
  void CheckRanksAgree() {
    const ZeroCheckpoint& a = ranks_[0];
    if (a.stage == 0)
      Fail(where_, "is a ZeRO stage-0 checkpoint with tensor-parallel ranks, which uckpt does not read");
    if (ValuePtr dims = a.model.root->get("checkpoint_parallel_dimensions"); dims && dims->is_dict()) {
      const std::string at = where_ + ": checkpoint_parallel_dimensions";
      if (ValuePtr pp = dims->get("pp_degree"); pp && AsInt(pp, at) != 1)
        Fail(at, "says pp_degree " + std::to_string(AsInt(pp, at)) + "; pipeline parallelism is not supported");
      if (ValuePtr tp = dims->get("tp_degree"); tp && AsInt(tp, at) != tp_)
        Fail(at, "says tp_degree " + std::to_string(AsInt(tp, at)) + " but the folder has files of " +
                     std::to_string(tp_) + " tensor-parallel ranks");
    }
    for (int t = 1; t < tp_; ++t) {
      const ZeroCheckpoint& b = ranks_[t];
      const std::string& path = b.model.file->path();
      if (b.stage != a.stage || b.bf16_optimizer != a.bf16_optimizer || b.dp != a.dp ||
          b.optim_prefix != a.optim_prefix)
        Fail(path, "is not of the same ZeRO stage and data-parallel size as " + where_);
      if (b.params.size() != a.params.size())
        Fail(path, "lists " + std::to_string(b.params.size()) + " trainable parameters, " + where_ + " " +
                       std::to_string(a.params.size()));
      for (size_t i = 0; i < a.params.size(); ++i)
        if (b.params[i].name != a.params[i].name || b.params[i].group != a.params[i].group)
          Fail(path, "param_shapes differ from " + where_ + "'s at '" + a.params[i].name + "'");
      if (b.state_keys != a.state_keys) Fail(path, "has other optimizer states than " + where_);
      if (b.global_steps != a.global_steps) Fail(path, "records another global_steps than " + where_);
    }
    CheckUntrainedEntriesAgree();
  }

  // The module's entries that are not trained (buffers, frozen parameters)
  // are taken from TP rank 0, as DeepSpeed's converter does: they must be the
  // same on every rank (a sharded one could not be put back together).
  void CheckUntrainedEntriesAgree() {
    std::set<std::string> trained;
    for (const ParamPlan& p : ranks_[0].params) trained.insert(p.name);
    const auto first = NamedEntries(RequiredModule(ranks_[0].model.root, where_), where_ + ": module");
    for (int t = 1; t < tp_; ++t) {
      const std::string& path = ranks_[t].model.file->path();
      const auto other = NamedEntries(RequiredModule(ranks_[t].model.root, path), path + ": module");
      if (other.size() != first.size()) Fail(path, "module has other entries than " + where_ + "'s");
      for (size_t k = 0; k < first.size(); ++k) {
        const auto& [name, v] = first[k];
        if (other[k].first != name) Fail(path, "module has other entries than " + where_ + "'s");
        if (trained.count(name)) continue;
        const ValuePtr& w = other[k].second;
        const bool same = v && w && v->kind == Kind::kTensor && w->kind == Kind::kTensor &&
                          v->tensor->dtype == w->tensor->dtype && v->tensor->shape == w->tensor->shape &&
                          v->tensor->contiguous_bytes() == w->tensor->contiguous_bytes();
        if (!same)
          Fail(path + ": module['" + name + "']",
               "differs from TP rank 0's: an untrained entry (buffer or frozen parameter) that is sharded or "
               "differs across tensor-parallel ranks, which uckpt cannot put back together");
      }
    }
  }

  // The merged checkpoint without its parameters: rank 0's run and files, and
  // every rank's files (model states copied into a universal folder, in
  // mp_rank order as DeepSpeed copies them; the optimizer maps the plan points into).
  ZeroCheckpoint Shell() {
    ZeroCheckpoint& first = ranks_[0];
    ZeroCheckpoint out;
    out.folder = first.folder;
    out.stage = first.stage;
    out.bf16_optimizer = first.bf16_optimizer;
    out.dp = first.dp;
    out.tp = tp_;
    out.optim_prefix = first.optim_prefix;
    out.model = first.model;
    out.layouts = first.layouts;
    out.state_keys = first.state_keys;
    out.steps = first.steps;
    out.module_only = first.module_only;
    out.global_steps = first.global_steps;
    for (ZeroCheckpoint& r : ranks_) {
      for (auto& f : r.model_files) out.model_files.push_back(f);
      for (auto& f : r.optim_files) out.optim_files.push_back(f);
      for (auto& f : r.optim) out.optim.push_back(f);
      for (auto& w : r.warnings) out.warnings.push_back(w);
    }
    return out;
  }

  ParamPlan MergeParam(size_t i, std::set<std::string>* unused, TpUniversalFile* file) {
    const ParamPlan& p0 = ranks_[0].params[i];
    std::vector<std::vector<int64_t>> shapes;
    for (const ZeroCheckpoint& r : ranks_) shapes.push_back(r.params[i].shape);
    const TpParamMerge m = PlanTpMerge(rules_, p0.name, shapes);
    for (const std::string& used : m.patterns) unused->erase(used);
    ParamPlan out;
    out.name = p0.name;
    out.shape = m.shape;
    out.numel = NumelOf(m.shape);
    out.group = p0.group;
    out.step = p0.step;  // DeepSpeed's step.pt: TP rank 0's
    out.scalars = p0.scalars;
    out.none_states = p0.none_states;
    file->keys = m.universal_keys;
    for (size_t k = 0; k < p0.states.size(); ++k) {
      file->storage_tails.emplace_back();
      out.states.push_back(MergeState(i, k, m, &file->storage_tails.back()));
    }
    return out;
  }

  StatePlan MergeState(size_t i, size_t k, const TpParamMerge& m, TpSpans* tail) {
    const ParamPlan& p0 = ranks_[0].params[i];
    const StatePlan& s0 = p0.states[k];
    const std::string where = where_ + ": parameter '" + p0.name + "', state '" + s0.key + "'";
    const uint64_t elem = DTypeSize(s0.dtype);
    std::vector<TpPieceIndex> shards;
    for (int t = 0; t < tp_; ++t) {
      const ParamPlan& p = ranks_[t].params[i];
      if (p.states.size() != p0.states.size() || p.states[k].key != s0.key || p.states[k].dtype != s0.dtype)
        Fail(where, "is not the same state (key, dtype) on TP rank " + std::to_string(t));
      shards.emplace_back(p.states[k].pieces);
      if (shards.back().total() != static_cast<uint64_t>(NumelOf(p.shape)) * elem)
        Fail(where, "on TP rank " + std::to_string(t) + " does not hold its shard's " +
                        std::to_string(NumelOf(p.shape)) + " elements");
    }
    StatePlan out{s0.key, s0.dtype, {}};
    for (const TpRun& r : m.runs) shards[r.rank].Append(r.shard_start * elem, r.length * elem, &out.pieces);
    const TpPieceIndex merged(out.pieces);
    for (const TpRun& r : m.replicas) {
      TpSpans mine, theirs;
      merged.Append(r.out_start * elem, r.length * elem, &mine);
      shards[r.rank].Append(r.shard_start * elem, r.length * elem, &theirs);
      if (!TpSameBytes(mine, theirs))
        Fail(where, "TP rank " + std::to_string(r.rank) + " holds other values than the rank it is taken from, for " +
                        "elements replicated across TP ranks (rule: " + m.rule + "), from element " +
                        std::to_string(r.out_start) + " on; DeepSpeed's converter refuses it too");
    }
    TpSplitAt(out.pieces, static_cast<uint64_t>(NumelOf(m.shape)) * elem, tail);
    return out;
  }

  const TagFolder& folder_;
  const int tp_;
  std::vector<ZeroCheckpoint> ranks_;
  std::string where_;
  TpRules rules_;
};

}  // namespace

int TensorParallelDegree(const TagFolder& folder) {
  int tp = 1;
  for (const CheckpointFile& f : folder.files)
    if (f.kind == FileKind::kModelStates || f.kind == FileKind::kZero3ModelStates || f.kind == FileKind::kOptimStates)
      tp = std::max(tp, f.mp + 1);
  return tp;
}

ZeroCheckpoint OpenTensorParallelCheckpoint(const TagFolder& folder, int tp_degree) {
  // Files of mp_rank > 0 beside model states that do not record that many
  // TP ranks are not one AutoTP run's (another parallelism, or files mixed).
  const CheckpointFile* last = nullptr;
  const CheckpointFile* model = nullptr;
  for (const CheckpointFile& f : folder.files) {
    const bool states = f.kind == FileKind::kModelStates || f.kind == FileKind::kZero3ModelStates;
    if (states || f.kind == FileKind::kOptimStates)
      if (!last || f.mp > last->mp) last = &f;
    if (states && f.mp == 0 && !model) model = &f;
  }
  if (model && last) {
    const ModelStatesRun run = ReadModelStatesRun(LoadTorchFile(model->path).root);
    if (run.mp_world_size && *run.mp_world_size != tp_degree)
      Fail(last->path, "is a file of tensor-parallel rank " + std::to_string(last->mp) + " but " + model->name +
                           " records mp_world_size " + std::to_string(*run.mp_world_size) +
                           ": tensor/pipeline-parallel files that are not one AutoTP run's are not supported");
  }
  return TpMerger(folder, tp_degree).Merge();
}

std::string TensorParallelLoadRefusal(const TagFolder& folder, const ValuePtr& model_root) {
  int tp = TensorParallelDegree(folder);
  if (const ModelStatesRun run = ReadModelStatesRun(model_root); run.mp_world_size)
    tp = std::max<int>(tp, static_cast<int>(*run.mp_world_size));
  if (tp <= 1) return "";
  const std::string what = " (DeepSpeed AutoTP, TP degree " + std::to_string(tp) +
                           "): uckpt's engine has no tensor parallelism and cannot load it";
  if (folder.kind == FolderKind::kUniversal)
    return folder.path + ": a universal folder converted from a tensor-parallel checkpoint" + what +
           " (DeepSpeed's load_universal can, at any TP x DP size). Export its whole weights (`uckpt export " +
           folder.path + " model.safetensors`) to start a uckpt run from them";
  return folder.path + ": a tensor-parallel checkpoint" + what + ". Convert it (`uckpt convert " + folder.path +
         " OUT`: whole parameters, which DeepSpeed's load_universal resumes at any TP x DP size), then export the "
         "whole weights (`uckpt export OUT model.safetensors`) to start a uckpt run from them";
}

}  // namespace uckpt::ckpt
