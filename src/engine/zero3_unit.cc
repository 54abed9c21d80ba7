// Stage 3's gather units and their schedule (engine/zero3_unit.h).
#include "engine/zero3_unit.h"

#include <stdexcept>

#include "engine/zero3_runtime.h"

namespace uckpt::engine {

const char* GatherUnit::Name(State s) {
  switch (s) {
    case State::kSharded: return "sharded";
    case State::kGathering: return "gathering (prefetch in flight)";
    case State::kGathered: return "gathered";
  }
  return "?";
}

const char* GatherUnit::Name(Pass p) {
  switch (p) {
    case Pass::kIdle: return "idle";
    case Pass::kForward: return "forward";
    case Pass::kBackward: return "backward";
    case Pass::kBackwardDone: return "backward done";
  }
  return "?";
}

void GatherUnit::Refuse(const std::string& verb, const std::string& why) const {
  throw std::logic_error("ZeRO-3: gather unit " + std::to_string(index_) + ": " + verb + " refused while " +
                         Name(state_) + ": " + why);
}

bool GatherUnit::Gather(ParamStorage& s) {
  if (state_ == State::kGathering) {  // the prefetch's hold becomes this one
    s.Finish(prefetch_);
    prefetch_ = ParamStorage::Pending();
    state_ = State::kGathered;
    ++holds_;
    return false;
  }
  std::vector<size_t> need;
  for (size_t i : params_)
    if (s.Hold(i)) need.push_back(i);
  s.Fetch(need);
  state_ = State::kGathered;
  ++holds_;
  return !need.empty();
}

void GatherUnit::CheckFree() const {
  if (state_ == State::kGathering) Refuse("free", "it was prefetched and not entered yet");
  if (state_ == State::kSharded) Refuse("free", "it was released more often than gathered");
}

void GatherUnit::Free(ParamStorage& s) {
  CheckFree();
  for (size_t i : params_) s.Unhold(i);
  if (--holds_ == 0) state_ = State::kSharded;
}

void GatherUnit::StartPrefetch(ParamStorage& s) {
  if (state_ != State::kSharded) Refuse("prefetch", "only a sharded unit is prefetched");
  for (size_t i : params_) s.Hold(i);
  prefetch_ = s.Start(params_);
  state_ = State::kGathering;
}

void GatherUnit::CancelPrefetch(ParamStorage& s) {
  if (state_ != State::kGathering) Refuse("cancelling a prefetch", "no prefetch is in flight");
  s.Cancel(prefetch_);
  prefetch_ = ParamStorage::Pending();
  for (size_t i : params_) s.Unhold(i);
  state_ = State::kSharded;
}

bool GatherUnit::Enter(ParamStorage& s) {
  const bool gathered = Gather(s);
  ++entries_;
  pass_ = Pass::kForward;
  return gathered;
}

void GatherUnit::Exit(ParamStorage& s) {
  if (state_ == State::kGathering) Refuse("ExitUnit", "it was prefetched and not entered yet");
  if (entries_ == 0) Refuse("ExitUnit", "it was not entered (each ExitUnit follows its EnterUnit)");
  Free(s);
  --entries_;
  pass_ = Pass::kIdle;
}

bool GatherUnit::BackwardGather(ParamStorage& s) {
  const bool gathered = Gather(s);
  ++backward_holds_;
  pass_ = Pass::kBackward;
  return gathered;
}

void GatherUnit::BackwardDone(ParamStorage& s) {
  if (backward_holds_ > 0) {
    Free(s);
    --backward_holds_;
  }
  pass_ = Pass::kBackwardDone;
}

void GatherUnit::EndBackward() {
  if (backward_holds_ > 0) Refuse("ending the backward", "a backward gather of it was not done");
  pass_ = Pass::kIdle;
}

void UnitSchedule::Build(const std::vector<Zero3Param>& params, int num_units, bool start_whole) {
  std::vector<std::vector<size_t>> members(static_cast<size_t>(num_units));
  std::vector<int64_t> numel(members.size(), 0);
  for (size_t i = 0; i < params.size(); ++i) {
    const Zero3Param& p = params[i];
    if (p.unit < 0 || p.persistent) continue;
    members[static_cast<size_t>(p.unit)].push_back(i);
    numel[static_cast<size_t>(p.unit)] += p.numel;
    if (start_whole) storage_.TrackWhole(i);
    else storage_.StartSharded(i);
  }
  units_.clear();
  for (size_t u = 0; u < members.size(); ++u) units_.emplace_back(u, std::move(members[u]), numel[u], start_whole);
  initial_hold_ = start_whole;
}

void UnitSchedule::Enter(size_t u) {
  if (units_.at(u).Enter(storage_)) ++stats_.unit_gathers;
  if (initial_hold_) {  // from now on units are gathered only while used
    initial_hold_ = false;
    ReleaseAll();
    storage_.ResetPeak();
  }
  Prefetch(u, +1);
}

void UnitSchedule::Exit(size_t u) { units_.at(u).Exit(storage_); }

void UnitSchedule::BackwardGather(size_t u) {
  if (units_.at(u).BackwardGather(storage_)) ++stats_.unit_gathers;
  Prefetch(u, -1);
}

void UnitSchedule::BackwardDone(size_t u) { units_.at(u).BackwardDone(storage_); }

void UnitSchedule::EndBackward() {
  for (GatherUnit& unit : units_) unit.EndBackward();
}

void UnitSchedule::GatherAll() {
  for (GatherUnit& unit : units_)
    if (unit.Gather(storage_)) ++stats_.unit_gathers;
}

void UnitSchedule::ReleaseAll() {
  for (const GatherUnit& unit : units_) unit.CheckFree();  // before changing any
  DropPrefetches();
  for (GatherUnit& unit : units_) unit.Free(storage_);
}

// The collectives finish before their buffers are dropped; the parameters'
// bytes were never allocated for them.
void UnitSchedule::DropPrefetches() {
  for (GatherUnit& unit : units_) {
    if (unit.state() != GatherUnit::State::kGathering) continue;
    unit.CancelPrefetch(storage_);
    ++stats_.unused_prefetches;
  }
}

bool UnitSchedule::AnyWhole(const GatherUnit& unit) const {
  for (size_t i : unit.params())
    if (storage_.IsWhole(i)) return true;
  return false;
}

// Walks from `u` in `direction`, prefetching units not gathered yet until
// prefetch_bucket_size elements are ahead (at least one unit when it is
// positive) or the next unit would take the gathered elements past
// max_live_parameters. One rank has no collective to overlap: the copies
// would run on the compute stream anyway, and prefetched buffers would only
// cost memory.
void UnitSchedule::Prefetch(size_t u, int direction) {
  if (prefetch_bucket_size_ <= 0 || dp_ == 1) return;
  int64_t ahead = 0;
  for (int64_t v = static_cast<int64_t>(u) + direction; v >= 0 && v < static_cast<int64_t>(units_.size());
       v += direction) {
    GatherUnit& next = units_[static_cast<size_t>(v)];
    if (next.state() == GatherUnit::State::kGathering) {
      ahead += next.numel();
      continue;
    }
    if (next.params().empty() || AnyWhole(next)) continue;
    if (ahead >= prefetch_bucket_size_) return;
    if (storage_.gathered_elements() + next.numel() > max_live_) return;
    next.StartPrefetch(storage_);
    ++stats_.unit_gathers;
    ++stats_.prefetched_gathers;
    ahead += next.numel();
  }
}

}  // namespace uckpt::engine
