// DeepSpeed's learning-rate schedulers (WarmupLR, WarmupDecayLR) with the lr
// each optimizer step really uses, as measured in
// shared/fixtures/refrun-gpt2/README.md: the scheduler starts at
// last_batch_iteration = -1 without touching the optimizer, so step 1 runs
// with each param group's own lr; after each applied step it advances one
// iteration and writes the schedule's value into every group, so step s >= 2
// uses the schedule at iteration s - 2. A step skipped for fp16 overflow does
// not advance it. Between steps a group's lr may be set by hand (DeepSpeed's
// param_groups[g]['lr'] = x): the next step uses it, and the next scheduler
// step overwrites it.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "engine/config.h"

namespace uckpt::engine {

class LrSchedule {
 public:
  LrSchedule(const SchedulerConfig& sched, double optimizer_lr);

  // Each param group's lr before the first scheduler step (a group's own
  // 'lr', else the optimizer's). Called once the groups are known.
  void set_group_lrs(std::vector<double> lrs);
  size_t num_groups() const { return lrs_.size(); }

  // The lr the next optimizer step uses in `group`.
  double current_lr(size_t group = 0) const { return lrs_.at(group); }
  const std::vector<double>& current_lrs() const { return lrs_; }
  // DeepSpeed's last_batch_iteration (the checkpoint's lr_scheduler state).
  int64_t last_batch_iteration() const { return last_batch_iteration_; }
  bool configured() const { return !sched_.type.empty(); }

  // After an applied optimizer step: the next iteration, or `iteration` when
  // given (DeepSpeed's scheduler.step(last_batch_iteration=...)).
  void Step(std::optional<int64_t> iteration = std::nullopt);
  // Restores a saved scheduler position; the next lr follows from it (the
  // config's schedule wins over a saved lr).
  void Restore(int64_t last_batch_iteration);
  // Overrides the lr of the next step: of every group, or of one.
  void set_current_lr(double lr);
  void set_current_lr(size_t group, double lr) { lrs_.at(group) = lr; }

  // The schedule's lr at `iteration` (>= 0); the optimizer's lr when no
  // scheduler is configured.
  double LrAt(int64_t iteration) const;

 private:
  SchedulerConfig sched_;
  double optimizer_lr_;
  int64_t last_batch_iteration_ = -1;
  std::vector<double> initial_lrs_;  // per group, before the first scheduler step
  std::vector<double> lrs_;          // per group, for the next step
};

}  // namespace uckpt::engine
