#include "ckpt/reshard.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include "ckpt/partition.h"
#include "ckpt/values.h"
#include "format/error.h"

namespace uckpt::ckpt {

uint64_t StateReads::bytes() const {
  uint64_t n = 0;
  for (const auto& p : pieces) n += p.from.size();
  return n;
}

PartitionTarget FlatPartitionTarget(std::vector<TargetParam> params, int dp, int rank) {
  std::vector<int64_t> numels;
  for (const auto& p : params) numels.push_back(p.numel);
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  const FlatLayout l = MakeFlatLayout(total, dp);
  PartitionTarget t;
  t.length = l.partition_size;
  for (const Fragment& f : RankFragments(numels, dp, rank))
    t.fragments.push_back({f.param, f.param_offset, f.numel, f.partition_offset});
  t.params = std::move(params);
  return t;
}

PartitionTarget Stage3PartitionTarget(std::vector<TargetParam> params, int dp, int rank) {
  PartitionTarget t;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t ps = Stage3PartitionSize(params[i].numel, dp);
    const int64_t real = Stage3RealNumel(params[i].numel, dp, rank);
    if (real > 0) t.fragments.push_back({i, rank * ps, real, t.length});
    t.length += ps;
  }
  t.params = std::move(params);
  return t;
}

namespace {

const StatePlan* FindState(const ParamPlan& p, const std::string& key) {
  for (const auto& s : p.states)
    if (s.key == key) return &s;
  return nullptr;
}

// Appends the source bytes [begin, end) of `state` (its pieces concatenated)
// to `out`, landing at destination byte `to`; adjacent ranges are merged.
void AddRange(const StatePlan& state, uint64_t begin, uint64_t end, uint64_t to, std::vector<ReadPiece>& out) {
  uint64_t at = 0;  // where the current piece starts in the concatenation
  for (const auto& piece : state.pieces) {
    const uint64_t lo = std::max(begin, at), hi = std::min<uint64_t>(end, at + piece.size());
    if (lo < hi) {
      ReadPiece r{piece.subspan(lo - at, hi - lo), to + (lo - begin)};
      if (!out.empty() && out.back().from.data() + out.back().from.size() == r.from.data() &&
          out.back().to + out.back().from.size() == r.to) {
        out.back().from = {out.back().from.data(), out.back().from.size() + r.from.size()};
      } else {
        out.push_back(r);
      }
    }
    at += piece.size();
    if (at >= end) break;
  }
}

// "[3, 4] (12 elements)", or "12 elements" without a shape.
std::string ShapeAndCountText(const std::vector<int64_t>& shape, int64_t numel) {
  std::string s;
  if (!shape.empty()) {
    s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    s += "] (";
  }
  s += std::to_string(numel) + " elements";
  return shape.empty() ? s : s + ")";
}

}  // namespace

namespace {

// The one planner: `params` are the source's, `folder` and `listed` named in errors.
StateReads PlanReads(std::span<const ParamPlan> params, const std::string& folder, const std::string& listed,
                     const PartitionTarget& target, const std::string& key) {
  std::unordered_map<std::string, const ParamPlan*> by_name;
  for (const auto& p : params) by_name.emplace(p.name, &p);
  // Every target parameter is checked (not only those in this rank's
  // partition), so that all ranks reach the same verdict.
  StateReads reads;
  std::vector<const StatePlan*> states;
  for (const TargetParam& want : target.params) {
    auto it = by_name.find(want.name);
    if (it == by_name.end()) throw FormatError(listed + ": has no parameter '" + want.name + "' (a different model?)");
    const ParamPlan& p = *it->second;
    if (p.numel != want.numel || (!want.shape.empty() && p.shape != want.shape))
      throw FormatError(listed + ": parameter '" + p.name + "' is " + ShapeAndCountText(p.shape, p.numel) +
                        ", this model's is " + ShapeAndCountText(want.shape, want.numel));
    const StatePlan* s = FindState(p, key);
    if (!s) throw FormatError(folder + ": parameter '" + p.name + "' has no optimizer state '" + key + "'");
    if (states.empty()) reads.dtype = s->dtype;
    if (s->dtype != reads.dtype)
      throw FormatError(folder + ": state '" + key + "' of '" + p.name +
                        "' has another dtype than the group's other parameters");
    if (s->bytes() != static_cast<uint64_t>(p.numel) * DTypeSize(s->dtype))
      throw FormatError(folder + ": state '" + key + "' of '" + p.name + "' has " + std::to_string(s->bytes()) +
                        " bytes, not " + std::to_string(p.numel) + " elements");
    states.push_back(s);
  }
  const uint64_t es = DTypeSize(reads.dtype);
  for (const TargetFragment& f : target.fragments)
    AddRange(*states.at(f.param), f.param_offset * es, (f.param_offset + f.numel) * es, f.offset * es, reads.pieces);
  return reads;
}

bool AllHave(std::span<const ParamPlan> params, const std::string& key) {
  if (params.empty()) return false;
  for (const auto& p : params)
    if (!FindState(p, key)) return false;
  return true;
}

std::string ListedIn(const ZeroCheckpoint& z) { return z.model_files.empty() ? z.folder : z.model_files.front().path; }

// A tensor of the model-states file as one state of a parameter.
StatePlan WholeState(const std::string& key, const Tensor& t, const std::string& where) {
  return {key, t.dtype, {TensorBytes(t, where)}};
}

}  // namespace

ReadSource ZeroReadSource(const ZeroCheckpoint& z) {
  // One optimizer resumes from it: every parameter that has optimizer state
  // must hold the same keys. DeepSpeed's Muon does not (momentum_buffer in
  // its Muon group, Adam's moments in the other), and no optimizer of the
  // engine's reads both; `uckpt convert` converts such a folder.
  const ParamPlan* first = nullptr;
  auto keys = [](const ParamPlan& p) {
    std::vector<std::string> k;
    for (const StatePlan& s : p.states)
      if (s.key != kFp32) k.push_back(s.key);
    return k;
  };
  for (const ParamPlan& p : z.params) {
    if (keys(p).empty()) continue;
    if (!first) {
      first = &p;
    } else if (keys(p) != keys(*first)) {
      std::string a, b;
      for (const auto& k : keys(*first)) a += (a.empty() ? "" : ", ") + k;
      for (const auto& k : keys(p)) b += (b.empty() ? "" : ", ") + k;
      throw FormatError(ListedIn(z) + ": the optimizer keeps {" + a + "} for " + first->name + " but {" + b + "} for " +
                        p.name +
                        " (DeepSpeed's Muon does: momentum_buffer for matrices, Adam's moments for the "
                        "rest); uckpt's engine has no such optimizer and cannot resume it. `uckpt convert` and "
                        "`uckpt export` read it");
    }
  }
  return {z.folder, ListedIn(z), z.params};
}

ReadSource ModuleReadSource(const ModelStatesView& m, const std::string& path, const std::vector<std::string>& names) {
  if (m.fp16_optimizer) return Fp16OptimizerReadSource(m, path, names);  // the masters are the wrapper's
  ReadSource s{path, path, {}};
  // Stage 0's state ids: the parameters uckpt recorded, else the order of `names`.
  std::map<std::string, int64_t> recorded;
  for (size_t k = 0; k < m.stage0_param_names.size(); ++k) recorded[m.stage0_param_names[k]] = static_cast<int64_t>(k);
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    int64_t id = static_cast<int64_t>(i);
    if (!recorded.empty()) {
      auto r = recorded.find(name);
      id = r == recorded.end() ? -1 : r->second;
    }
    auto it = m.module.find(name);
    if (it == m.module.end()) throw FormatError(path + ": module has no tensor '" + name + "'");
    const Tensor& w = *it->second;
    ParamPlan p{name, w.shape, w.numel(), 0, {WholeState(kFp32, w, path + ": '" + name + "'")}, nullptr, {}, {}};
    if (auto st = m.stage0_state.find(id); st != m.stage0_state.end()) {
      const std::string where = path + ": optimizer state of " + name;
      for (const auto& [key, t] : st->second.tensors) {
        if (t->numel() != w.numel())
          throw FormatError(where + ": '" + key + "' has " + std::to_string(t->numel()) + " elements, the parameter " +
                            std::to_string(w.numel()) + " (not an element-wise optimizer's state?)");
        p.states.push_back(WholeState(key, *t, where));
      }
      p.step = st->second.step;
      p.scalars = st->second.scalars;
      p.none_states = st->second.none_states;
    }
    s.params.push_back(std::move(p));
  }
  return s;
}

StateReads PlanStateReads(const ReadSource& source, const PartitionTarget& target, const std::string& key) {
  return PlanReads(source.params, source.folder, source.listed, target, key);
}

StateReads PlanStateReads(const ZeroCheckpoint& source, const PartitionTarget& target, const std::string& key) {
  return PlanReads(source.params, source.folder, ListedIn(source), target, key);
}

bool HasState(const ReadSource& source, const std::string& key) { return AllHave(source.params, key); }
bool HasState(const ZeroCheckpoint& source, const std::string& key) { return AllHave(source.params, key); }

}  // namespace uckpt::ckpt
