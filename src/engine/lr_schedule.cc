#include "engine/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace uckpt::engine {

LrSchedule::LrSchedule(const SchedulerConfig& sched, double optimizer_lr)
    : sched_(sched), optimizer_lr_(optimizer_lr), initial_lrs_{optimizer_lr}, lrs_{optimizer_lr} {}

void LrSchedule::set_group_lrs(std::vector<double> lrs) {
  initial_lrs_ = lrs;
  lrs_ = std::move(lrs);
}

void LrSchedule::set_current_lr(double lr) { lrs_.assign(lrs_.size(), lr); }

double LrSchedule::LrAt(int64_t it) const {
  if (sched_.type.empty()) return optimizer_lr_;
  // DeepSpeed: warmup_num_steps = max(2, configured).
  const int64_t warmup = std::max<int64_t>(2, sched_.warmup_num_steps);
  double gamma;
  if (it < warmup) {
    if (sched_.warmup_type == "linear") {
      gamma = static_cast<double>(it) / static_cast<double>(warmup);
    } else {
      gamma = (1.0 / std::log(static_cast<double>(warmup))) * std::log(static_cast<double>(it + 1));
    }
  } else if (sched_.type == "WarmupDecayLR") {
    gamma = std::max(0.0, static_cast<double>(sched_.total_num_steps - it) /
                              std::max(1.0, static_cast<double>(sched_.total_num_steps - warmup)));
  } else {
    gamma = 1.0;
  }
  return sched_.warmup_min_lr + (sched_.warmup_max_lr - sched_.warmup_min_lr) * gamma;
}

void LrSchedule::Step(std::optional<int64_t> iteration) {
  last_batch_iteration_ = iteration ? *iteration : last_batch_iteration_ + 1;
  // Without a scheduler nothing sets the lr: a kept saved or hand-set lr stays.
  if (configured()) set_current_lr(LrAt(last_batch_iteration_));
}

void LrSchedule::Restore(int64_t last_batch_iteration) {
  last_batch_iteration_ = last_batch_iteration;
  if (configured() && last_batch_iteration >= 0) {
    set_current_lr(LrAt(last_batch_iteration));
  } else {
    lrs_ = initial_lrs_;
  }
}

}  // namespace uckpt::engine
