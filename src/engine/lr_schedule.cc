#include "engine/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace uckpt::engine {
namespace {

// DeepSpeed's warmup_num_steps = max(2, configured).
int64_t WarmupSteps(const SchedulerConfig& s) { return std::max<int64_t>(2, s.warmup_num_steps); }

// The warmup fraction at `it` (< warmup): log or linear.
double WarmupGamma(const SchedulerConfig& s, int64_t it) {
  const int64_t warmup = WarmupSteps(s);
  if (s.warmup_type == "linear") return static_cast<double>(it) / static_cast<double>(warmup);
  return (1.0 / std::log(static_cast<double>(warmup))) * std::log(static_cast<double>(it + 1));
}

// OneCycle's total cycle length (a float in DeepSpeed).
double CycleSize(const SchedulerConfig& s) {
  return s.cycle_first_step_size + s.cycle_second_step_size.value_or(s.cycle_first_step_size);
}

}  // namespace

LrSchedule::LrSchedule(const SchedulerConfig& sched, double optimizer_lr)
    : sched_(sched), optimizer_lr_(optimizer_lr), last_batch_iteration_(sched.last_batch_iteration) {
  set_group_lrs({optimizer_lr});
}

void LrSchedule::set_group_lrs(std::vector<double> lrs) {
  group_lrs_ = lrs;
  lrs_ = std::move(lrs);
  betas_.reset();
  // The constructors that write into the optimizer (only when starting at -1).
  if (sched_.last_batch_iteration == -1) {
    if (sched_.type == "LRRangeTest") lrs_.assign(lrs_.size(), sched_.lr_range_test_min_lr);
    if (sched_.type == "OneCycle") {
      lrs_.assign(lrs_.size(), sched_.cycle_min_lr);
      if (sched_.cycle_momentum) betas_ = Betas{sched_.cycle_min_mom, 0.99};
    }
  }
  initial_lrs_ = lrs_;
  initial_betas_ = betas_;
}

void LrSchedule::set_current_lr(double lr) { lrs_.assign(lrs_.size(), lr); }

const char* LrSchedule::step_argument() const {
  return sched_.type == "OneCycle" || sched_.type == "LRRangeTest" ? "batch_iteration" : "last_batch_iteration";
}

double LrSchedule::OneCycleScale(int64_t it) const {
  const double total = CycleSize(sched_);
  const double step_ratio = sched_.cycle_first_step_size / total;
  const double batch_iteration = static_cast<double>(it + 1);
  const double cycle = std::floor(1 + batch_iteration / total);
  const double x = 1. + batch_iteration / total - cycle;
  return x <= step_ratio ? x / step_ratio : (x - 1) / (step_ratio - 1);
}

double LrSchedule::LrAt(int64_t it, size_t group) const {
  const SchedulerConfig& s = sched_;
  if (s.type.empty()) return optimizer_lr_;
  if (s.type == "WarmupLR" || s.type == "WarmupDecayLR") {
    const int64_t warmup = WarmupSteps(s);
    double gamma = 1.0;
    if (it < warmup) {
      gamma = WarmupGamma(s, it);
    } else if (s.type == "WarmupDecayLR") {
      gamma = std::max(0.0, static_cast<double>(s.total_num_steps - it) /
                                std::max(1.0, static_cast<double>(s.total_num_steps - warmup)));
    }
    return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
  }
  if (s.type == "WarmupCosineLR") {
    const int64_t warmup = WarmupSteps(s);
    double ratio;
    if (it < warmup) {
      ratio = s.warmup_min_ratio + WarmupGamma(s, it) * (1. - s.warmup_min_ratio);
    } else {
      const double real_last_step = static_cast<double>(it - warmup + 1);
      const double real_total_steps = static_cast<double>(s.total_num_steps - warmup);
      const double cosine = (1 + std::cos(M_PI * real_last_step / real_total_steps)) / 2;
      ratio = std::max(0.0, s.cos_min_ratio + (1. - s.cos_min_ratio) * cosine);
    }
    return group_lrs_.at(group) * ratio;
  }
  if (s.type == "OneCycle") {
    const double total = CycleSize(s);
    if (static_cast<double>(it) < total) return s.cycle_min_lr + (s.cycle_max_lr - s.cycle_min_lr) * OneCycleScale(it);
    if (s.decay_step_size == 0 || s.decay_lr_rate == 0) return s.cycle_min_lr;
    const double decay_interval = (static_cast<double>(it) - total + 1) / s.decay_step_size;
    return s.cycle_min_lr / (1 + s.decay_lr_rate * decay_interval);
  }
  // LRRangeTest
  const double steps = static_cast<double>(it + 1) / s.lr_range_test_step_size;
  const double interval = s.lr_range_test_staircase ? std::floor(steps) : steps;
  return s.lr_range_test_min_lr * (1 + s.lr_range_test_step_rate * interval);
}

std::optional<LrSchedule::Betas> LrSchedule::BetasAt(int64_t it) const {
  const SchedulerConfig& s = sched_;
  if (s.type != "OneCycle" || !s.cycle_momentum) return std::nullopt;
  const double total = CycleSize(s);
  if (static_cast<double>(it) < total)
    return Betas{s.cycle_max_mom - (s.cycle_max_mom - s.cycle_min_mom) * OneCycleScale(it), 0.99};
  if (s.decay_step_size == 0 || s.decay_mom_rate == 0) return Betas{s.cycle_max_mom, 0.99};
  const double decay_interval = (static_cast<double>(it) - total + 1) / s.decay_step_size;
  return Betas{s.cycle_max_mom * (1 + s.decay_mom_rate * decay_interval), 0.99};
}

std::vector<double> LrSchedule::GetLr() const {
  const int64_t it = last_batch_iteration_;
  const bool warmup_kind = sched_.type.rfind("Warmup", 0) == 0;
  if (warmup_kind && it < 0) return {0.0};
  std::vector<double> out;
  for (size_t g = 0; g < lrs_.size(); ++g) out.push_back(LrAt(it, g));
  return out;
}

void LrSchedule::SetFromPosition() {
  for (size_t g = 0; g < lrs_.size(); ++g) lrs_[g] = LrAt(last_batch_iteration_, g);
  betas_ = BetasAt(last_batch_iteration_);
}

void LrSchedule::Step(std::optional<int64_t> iteration) {
  last_batch_iteration_ = iteration ? *iteration : last_batch_iteration_ + 1;
  stepped_ = true;
  // Without a scheduler nothing sets the lr: a kept saved or hand-set lr stays.
  if (configured()) SetFromPosition();
}

void LrSchedule::Restore(int64_t last_batch_iteration, bool set_lr) {
  last_batch_iteration_ = last_batch_iteration;
  if (!configured() || !set_lr) return;
  if (last_batch_iteration >= 0) {
    SetFromPosition();
  } else {
    lrs_ = initial_lrs_;
    betas_ = initial_betas_;
  }
}

}  // namespace uckpt::engine
