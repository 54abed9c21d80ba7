#include "ckpt/reshard.h"

#include <algorithm>
#include <unordered_map>

#include "ckpt/partition.h"
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
std::string ShapeText(const std::vector<int64_t>& shape, int64_t numel) {
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

StateReads PlanStateReads(const ZeroCheckpoint& source, const PartitionTarget& target, const std::string& key) {
  std::unordered_map<std::string, const ParamPlan*> by_name;
  for (const auto& p : source.params) by_name.emplace(p.name, &p);
  // Every target parameter is checked (not only those in this rank's
  // partition), so that all ranks reach the same verdict.
  StateReads reads;
  std::vector<const StatePlan*> states;
  const std::string listed = source.model_files.empty() ? source.folder : source.model_files.front().path;
  for (const TargetParam& want : target.params) {
    auto it = by_name.find(want.name);
    if (it == by_name.end())
      throw FormatError(listed + ": has no parameter '" + want.name + "' (a different model?)");
    const ParamPlan& p = *it->second;
    if (p.numel != want.numel || (!want.shape.empty() && p.shape != want.shape))
      throw FormatError(listed + ": parameter '" + p.name + "' is " + ShapeText(p.shape, p.numel) +
                        ", this model's is " + ShapeText(want.shape, want.numel));
    const StatePlan* s = FindState(p, key);
    if (!s) throw FormatError(source.folder + ": parameter '" + p.name + "' has no optimizer state '" + key + "'");
    if (states.empty()) reads.dtype = s->dtype;
    if (s->dtype != reads.dtype)
      throw FormatError(source.folder + ": state '" + key + "' of '" + p.name +
                        "' has another dtype than the group's other parameters");
    if (s->bytes() != static_cast<uint64_t>(p.numel) * DTypeSize(s->dtype))
      throw FormatError(source.folder + ": state '" + key + "' of '" + p.name + "' has " + std::to_string(s->bytes()) +
                        " bytes, not " + std::to_string(p.numel) + " elements");
    states.push_back(s);
  }
  const uint64_t es = DTypeSize(reads.dtype);
  for (const TargetFragment& f : target.fragments)
    AddRange(*states.at(f.param), f.param_offset * es, (f.param_offset + f.numel) * es, f.offset * es, reads.pieces);
  return reads;
}

bool HasState(const ZeroCheckpoint& source, const std::string& key) {
  if (source.params.empty()) return false;
  for (const auto& p : source.params)
    if (!FindState(p, key)) return false;
  return true;
}

}  // namespace uckpt::ckpt
