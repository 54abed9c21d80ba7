// Stage 3's gather side as objects (engine/zero3_runtime.h):
// - ParamStorage: each parameter's bytes, there while its gather count is
//   positive, and the all-gathers that fill them (zero3_gather.cc);
// - GatherUnit: one gather unit's lifecycle, an explicit state with verbs
//   that move it and refuse what does not fit (zero3_unit.cc); FSDP2's
//   FSDPParamGroup (ShardedState, TrainingState) is the model;
// - UnitSchedule: the units in their order and what is gathered ahead of use
//   (zero3_unit.cc). Its decisions depend only on the unit calls and sizes, so
//   every rank issues the same collectives in the same order.
// The runtime (Zero3Runtime) owns them beside the gradient reducer
// (zero3_reduce.h) and the update.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "uckpt/comm.h"

namespace uckpt::engine {

struct Zero3Param;

// A tensor of `shape` without bytes (a partitioned parameter outside its
// unit): what a parameter that arrives partitioned is given.
at::Tensor StoragelessTensor(at::IntArrayRef shape, const at::TensorOptions& options);

// Parameters' storage: a parameter's bytes exist while its gather count
// (Zero3Param::live) is positive; gathering fills them from every rank's
// partition with one all-gather per call.
class ParamStorage {
 public:
  // An all-gather of partitions in flight: the buffers live until Finish or Cancel.
  struct Pending {
    std::vector<size_t> params;
    int64_t total = 0;  // elements per rank
    at::Tensor all;     // [dp * total]
    std::unique_ptr<Comm::Pending> work;
  };

  ParamStorage(Comm& comm, std::vector<Zero3Param>& params, at::Device device)
      : comm_(comm), params_(params), device_(device) {}

  // A unit parameter that starts whole (counted in gathered_elements).
  void TrackWhole(size_t p);
  // A unit parameter that starts sharded: its bytes (if any) freed, count 0.
  void StartSharded(size_t p);
  bool Hold(size_t p);    // +1 on p's count; true when p must be gathered
  void Unhold(size_t p);  // -1; frees p's bytes at 0
  bool IsWhole(size_t p) const;

  Pending Start(const std::vector<size_t>& ps);  // copies the partitions in, starts the all-gather
  void Finish(Pending& g);                       // waits, copies into the parameters' bytes
  void Cancel(Pending& g);                       // waits, drops the buffers
  void Fetch(const std::vector<size_t>& ps) {
    Pending g = Start(ps);
    Finish(g);
  }
  // Every whole parameter again from the partitions (after they changed).
  void RefetchWhole();

  // Engine::GatherParameters(params) / ReleaseParameters: +1 / -1 on each
  // of `ps`; modifier_rank >= 0 first broadcasts its whole values and
  // re-partitions them; -1: those staying whole are gathered again from the
  // partitions (writes discarded).
  void GatherSome(const std::vector<size_t>& ps);
  void ReleaseSome(const std::vector<size_t>& ps, int modifier_rank);

  // Unit parameters (not root, not persistent) whole now and at most so far.
  int64_t gathered_elements() const { return gathered_elements_; }
  int64_t peak_gathered_elements() const { return peak_gathered_elements_; }
  void ResetPeak() { peak_gathered_elements_ = gathered_elements_; }

 private:
  int dp() const { return comm_.world_size(); }

  Comm& comm_;
  std::vector<Zero3Param>& params_;
  at::Device device_;
  int64_t gathered_elements_ = 0, peak_gathered_elements_ = 0;
};

// One gather unit: the parameters of one declared submodule (not root, not
// persistent). Its state says where they are; its pass says what the last
// verb was for; holds counts its users (entries, backward gathers,
// GatherParameters(), the initial hold). A unit starts Gathered with one hold
// (parameters start whole). Verbs that do not fit the state throw
// std::logic_error naming the unit, before changing anything.
class GatherUnit {
 public:
  enum class State {
    kSharded,    // no hold: only this rank's partitions (GatheredParameters may still hold some whole)
    kGathering,  // prefetched: the all-gather in flight, for an entry to come
    kGathered,   // whole, held by `holds` users
  };
  enum class Pass {
    kIdle,          // not in a forward or backward (or between them)
    kForward,       // entered, for its forward (Enter)
    kBackward,      // gathered again for its backward (BackwardGather)
    kBackwardDone,  // its backward ran; gradients handed to the reducer (BackwardDone)
  };

  // whole: Gathered with the initial hold; else Sharded with none.
  GatherUnit(size_t index, std::vector<size_t> params, int64_t numel, bool whole = true)
      : index_(index),
        params_(std::move(params)),
        numel_(numel),
        state_(whole ? State::kGathered : State::kSharded),
        holds_(whole ? 1 : 0) {}

  size_t index() const { return index_; }
  const std::vector<size_t>& params() const { return params_; }
  int64_t numel() const { return numel_; }
  State state() const { return state_; }
  Pass pass() const { return pass_; }
  int holds() const { return holds_; }
  int backward_holds() const { return backward_holds_; }  // backward gathers not yet done

  // +1 hold: Gathered (a prefetch in flight becomes this hold). Returns
  // whether an all-gather was issued for it now.
  bool Gather(ParamStorage& s);
  // -1 hold: Sharded at 0. Refused while Sharded or Gathering (CheckFree).
  void Free(ParamStorage& s);
  void CheckFree() const;
  // Sharded -> Gathering: starts the all-gather (holds the parameters).
  void StartPrefetch(ParamStorage& s);
  // Gathering -> Sharded: waits for the all-gather, drops it.
  void CancelPrefetch(ParamStorage& s);

  // The lifecycle of a forward and backward (FSDP2's pre/post forward and backward).
  bool Enter(ParamStorage& s);           // Gather, for the forward
  void Exit(ParamStorage& s);            // Free after the forward; refused unless entered
  bool BackwardGather(ParamStorage& s);  // Gather, for the backward
  void BackwardDone(ParamStorage& s);    // Free what BackwardGather held (if it did)
  void EndBackward();                    // Idle; refused while a backward gather is held

  static const char* Name(State s);
  static const char* Name(Pass p);

 private:
  [[noreturn]] void Refuse(const std::string& verb, const std::string& why) const;

  size_t index_;
  std::vector<size_t> params_;
  int64_t numel_;
  State state_;
  Pass pass_ = Pass::kIdle;
  int holds_;
  int entries_ = 0;  // Enter calls not yet exited
  int backward_holds_ = 0;
  ParamStorage::Pending prefetch_;  // while Gathering
};

// What the schedule did (part of Stage3Stats).
struct UnitStats {
  int64_t unit_gathers = 0;        // all-gathers of units (prefetched ones included)
  int64_t prefetched_gathers = 0;  // of them, started before their unit was entered
  int64_t unused_prefetches = 0;   // prefetched units dropped before being entered
};

// The gather units in their declared order. Every unit is held from the
// start until the first Enter (a model that never enters a unit still runs,
// without the savings); from then on a unit is gathered only while used.
// Entering a unit prefetches the units after it (in backward: before it) up
// to prefetch_bucket_size elements ahead, while the gathered unit elements
// stay within max_live_parameters.
class UnitSchedule {
 public:
  UnitSchedule(ParamStorage& storage, int64_t prefetch_bucket_size, int64_t max_live_parameters, int dp)
      : storage_(storage), prefetch_bucket_size_(prefetch_bucket_size), max_live_(max_live_parameters), dp_(dp) {}

  // The units from the parameters' units (-1 root; persistent ones stay out).
  // start_whole: every unit held until the first Enter (parameters built
  // whole); else every unit starts sharded (parameters that arrived
  // partitioned), its parameters' bytes freed.
  void Build(const std::vector<Zero3Param>& params, int num_units, bool start_whole = true);

  size_t size() const { return units_.size(); }
  const GatherUnit& unit(size_t u) const { return units_.at(u); }
  const UnitStats& stats() const { return stats_; }

  void Enter(size_t u);           // gathers u, ends the initial hold, prefetches the next units
  void Exit(size_t u);            // frees u
  void BackwardGather(size_t u);  // gathers u for its backward, prefetches the units before it
  void BackwardDone(size_t u);    // frees what BackwardGather held
  void EndBackward();             // every unit Idle (after BackwardDone drained them)
  void GatherAll();               // +1 on every unit
  void ReleaseAll();              // -1 on every unit (refused unless each is held), drops prefetches
  void DropPrefetches();          // waits for and frees prefetches not used yet

 private:
  void Prefetch(size_t u, int direction);  // the units after (+1) or before (-1) u
  bool AnyWhole(const GatherUnit& unit) const;

  ParamStorage& storage_;
  int64_t prefetch_bucket_size_, max_live_;
  int dp_;
  std::vector<GatherUnit> units_;
  bool initial_hold_ = true;
  UnitStats stats_;
};

}  // namespace uckpt::engine
