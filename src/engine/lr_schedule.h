// DeepSpeed 0.14.5's learning-rate schedulers (runtime/lr_schedules.py:
// WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) with the lr
// each optimizer step really uses, as measured in
// shared/fixtures/refrun-gpt2/README.md. The scheduler starts at
// last_batch_iteration = -1 (or the config's); its constructor leaves the
// optimizer's lrs alone, except LRRangeTest and OneCycle starting at -1, which
// write their first lr (OneCycle also betas) into every group. So step 1 runs
// with each group's own lr (or that first value); after each applied step the
// scheduler advances one iteration and writes its value into every group, so
// step s >= 2 uses the schedule at iteration s - 2. A step skipped for fp16
// overflow does not advance it. Between steps a group's lr may be set by hand
// (DeepSpeed's param_groups[g]['lr'] = x): the next step uses it, and the next
// scheduler step overwrites it.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "engine/config.h"

namespace uckpt::engine {

class LrSchedule {
 public:
  using Betas = std::pair<double, double>;

  LrSchedule(const SchedulerConfig& sched, double optimizer_lr);

  // Each param group's lr before the scheduler exists (a group's own 'lr',
  // else the optimizer's); then the scheduler's constructor runs (LRRangeTest
  // and OneCycle write their first values). Called once the groups are known.
  void set_group_lrs(std::vector<double> lrs);
  size_t num_groups() const { return lrs_.size(); }

  // The lr the next optimizer step uses in `group`.
  double current_lr(size_t group = 0) const { return lrs_.at(group); }
  const std::vector<double>& current_lrs() const { return lrs_; }
  // OneCycle with cycle_momentum: the betas every group's next step uses (the
  // scheduler writes them with its lr); unset for the other schedulers.
  const std::optional<Betas>& current_betas() const { return betas_; }
  // DeepSpeed's last_batch_iteration (the checkpoint's lr_scheduler state).
  int64_t last_batch_iteration() const { return last_batch_iteration_; }
  bool configured() const { return !sched_.type.empty(); }
  // Whether step() ran since construction (DeepSpeed's get_last_lr() needs it).
  bool stepped() const { return stepped_; }
  // The keyword DeepSpeed's step() of this scheduler takes for the iteration
  // (engine.step(lr_kwargs={name: n})): "batch_iteration" for OneCycle and
  // LRRangeTest, "last_batch_iteration" for the others.
  const char* step_argument() const;

  // After an applied optimizer step: the next iteration, or `iteration` when
  // given (DeepSpeed's scheduler.step(iteration)).
  void Step(std::optional<int64_t> iteration = std::nullopt);
  // Restores a saved scheduler position (DeepSpeed's load_state_dict). With
  // `set_lr` the lr (and OneCycle's betas) follow from it at once, as when the
  // saved optimizer's groups are restored with it; without, the lrs stay until
  // the next step, as DeepSpeed's load_state_dict leaves the optimizer alone.
  void Restore(int64_t last_batch_iteration, bool set_lr = true);
  // Overrides the lr of the next step: of every group, or of one.
  void set_current_lr(double lr);
  void set_current_lr(size_t group, double lr) { lrs_.at(group) = lr; }

  // The schedule's lr at `iteration` (>= 0) in `group`; the optimizer's lr
  // when no scheduler is configured.
  double LrAt(int64_t iteration, size_t group = 0) const;

  // A client scheduler's state_dict() for the next save (engine.h,
  // SaveCheckpointOptions::lr_scheduler_state); None: the config scheduler's.
  c10::IValue client_state_to_save;
  // DeepSpeed's scheduler.get_lr() at the current position: one value per
  // group ([0.0] before the first step of WarmupLR, WarmupDecayLR and
  // WarmupCosineLR, as theirs).
  std::vector<double> GetLr() const;

 private:
  std::optional<Betas> BetasAt(int64_t iteration) const;
  void SetFromPosition();  // lrs_ and betas_ from last_batch_iteration_
  double OneCycleScale(int64_t iteration) const;

  SchedulerConfig sched_;
  double optimizer_lr_;
  int64_t last_batch_iteration_ = -1;
  bool stepped_ = false;
  std::vector<double> group_lrs_;    // per group, the optimizer's (WarmupCosineLR scales them)
  std::vector<double> initial_lrs_;  // per group, after the scheduler's constructor
  std::optional<Betas> initial_betas_;
  std::vector<double> lrs_;  // per group, for the next step
  std::optional<Betas> betas_;
};

}  // namespace uckpt::engine
