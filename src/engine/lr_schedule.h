// DeepSpeed's learning-rate schedulers (WarmupLR, WarmupDecayLR) with the lr
// each optimizer step really uses, as measured in
// shared/fixtures/refrun-gpt2/README.md: the scheduler starts at
// last_batch_iteration = -1 without touching the optimizer, so step 1 runs
// with the optimizer's own lr; after each applied step it advances one
// iteration, so step s >= 2 uses the schedule at iteration s - 2. A step
// skipped for fp16 overflow does not advance it.
#pragma once

#include <cstdint>

#include "engine/config.h"

namespace uckpt::engine {

class LrSchedule {
 public:
  LrSchedule(const SchedulerConfig& sched, double optimizer_lr);

  // The lr the next optimizer step uses.
  double current_lr() const { return lr_; }
  // DeepSpeed's last_batch_iteration (the checkpoint's lr_scheduler state).
  int64_t last_batch_iteration() const { return last_batch_iteration_; }

  // After an applied optimizer step.
  void Step();
  // Restores a saved scheduler position; the next lr follows from it (the
  // config's schedule wins over a saved lr).
  void Restore(int64_t last_batch_iteration);
  // Overrides the lr of the next step (a saved param-group lr kept on resume).
  void set_current_lr(double lr) { lr_ = lr; }

  // The schedule's lr at `iteration` (>= 0); the optimizer's lr when no
  // scheduler is configured.
  double LrAt(int64_t iteration) const;

 private:
  SchedulerConfig sched_;
  double optimizer_lr_;
  int64_t last_batch_iteration_ = -1;
  double lr_;
};

}  // namespace uckpt::engine
