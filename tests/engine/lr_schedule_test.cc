// DeepSpeed 0.14.5's config schedulers beyond WarmupLR: their parameters as
// the config gives them (each honoured or refused by name), and their lrs,
// worked out by hand from the formulas of runtime/lr_schedules.py.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/config.h"
#include "engine/lr_schedule.h"

namespace uckpt::engine {
namespace {

SchedulerConfig Parse(const std::string& scheduler) {
  return ParseConfig(nlohmann::json::parse(R"({"scheduler": )" + scheduler + "}"), "cfg.json").scheduler;
}

void ExpectRefused(const std::string& scheduler, const std::string& needle) {
  try {
    Parse(scheduler);
    ADD_FAILURE() << "accepted: " << scheduler;
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(LrScheduleConfig, EachParameterHonouredOrRefusedByName) {
  SchedulerConfig c = Parse(R"({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
      "decay_lr_rate": 0.5, "cycle_first_step_size": 4, "cycle_second_step_size": 6, "cycle_first_stair_count": 2,
      "cycle_second_stair_count": 3, "decay_step_size": 2, "cycle_momentum": false, "cycle_min_mom": 0.7,
      "cycle_max_mom": 0.95, "decay_mom_rate": 0.1, "last_batch_iteration": 3}})");
  EXPECT_EQ(c.cycle_min_lr, 0.1);
  EXPECT_EQ(c.cycle_max_lr, 1.0);
  EXPECT_EQ(c.decay_lr_rate, 0.5);
  EXPECT_EQ(c.cycle_first_step_size, 4);
  EXPECT_EQ(c.cycle_second_step_size, 6);
  EXPECT_EQ(c.decay_step_size, 2);
  EXPECT_FALSE(c.cycle_momentum);
  EXPECT_EQ(c.cycle_min_mom, 0.7);
  EXPECT_EQ(c.cycle_max_mom, 0.95);
  EXPECT_EQ(c.decay_mom_rate, 0.1);
  EXPECT_EQ(c.last_batch_iteration, 3);
  c = Parse(R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 12, "warmup_min_ratio": 0.1,
      "warmup_num_steps": 4, "cos_min_ratio": 0.01, "warmup_type": "linear"}})");
  EXPECT_EQ(c.total_num_steps, 12);
  EXPECT_EQ(c.warmup_min_ratio, 0.1);
  EXPECT_EQ(c.cos_min_ratio, 0.01);
  EXPECT_EQ(c.warmup_type, "linear");
  c = Parse(R"({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 4,
      "lr_range_test_step_rate": 0.5, "lr_range_test_staircase": true}})");
  EXPECT_EQ(c.lr_range_test_min_lr, 0.01);
  EXPECT_EQ(c.lr_range_test_step_size, 4);
  EXPECT_EQ(c.lr_range_test_step_rate, 0.5);
  EXPECT_TRUE(c.lr_range_test_staircase);
  EXPECT_EQ(Parse(R"({"type": "WarmupLR", "params": {"last_batch_iteration": 7}})").last_batch_iteration, 7);

  // A keyword the class does not take (DeepSpeed: TypeError), a missing required one, a bad value.
  ExpectRefused(R"({"type": "WarmupLR", "params": {"total_num_steps": 10}})",
                "'scheduler.params.total_num_steps' is not a parameter of DeepSpeed's WarmupLR");
  ExpectRefused(R"({"type": "OneCycle", "params": {"warmup_num_steps": 10, "cycle_min_lr": 0, "cycle_max_lr": 1}})",
                "warmup_num_steps' is not a parameter of DeepSpeed's OneCycle");
  ExpectRefused(R"({"type": "LRRangeTest", "params": {"cycle_min_lr": 0.1}})", "cycle_min_lr");
  ExpectRefused(R"({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}})", "cycle_max_lr");
  ExpectRefused(R"({"type": "WarmupCosineLR", "params": {}})", "total_num_steps");
  ExpectRefused(R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_type": "cos"}})",
                "warmup_type");
  ExpectRefused(R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 10}})",
                "must differ");
  ExpectRefused(R"({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}})", "lr_range_test_step_size");
  ExpectRefused(R"({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_first_step_size": 0}})",
                "cycle_first_step_size");
  ExpectRefused(R"({"type": "StepLR", "params": {}})", "StepLR");
  ExpectRefused(R"({"type": "onecycle", "params": {}})", "onecycle");  // DeepSpeed matches the name as written
  ExpectRefused(R"({"type": "WarmupLR", "params": {"last_batch_iteration": -2}})", "last_batch_iteration");
}

// LRRangeTest: min_lr * (1 + rate * interval), interval (it + 1) / size, or
// its floor with staircase; the constructor sets min_lr at once.
TEST(LrScheduleValues, LRRangeTest) {
  SchedulerConfig c = Parse(R"({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.01,
      "lr_range_test_step_size": 4, "lr_range_test_step_rate": 0.5}})");
  LrSchedule s(c, 0.3);
  s.set_group_lrs({0.3, 0.2});
  EXPECT_EQ(s.current_lrs(), (std::vector<double>{0.01, 0.01}));  // not the optimizer's 0.3
  s.Step();                                                       // iteration 0: 0.01 * (1 + 0.5 * 1/4)
  EXPECT_DOUBLE_EQ(s.current_lr(1), 0.01125);
  s.Step(7);  // 0.01 * (1 + 0.5 * 2)
  EXPECT_DOUBLE_EQ(s.current_lr(0), 0.02);
  EXPECT_FALSE(s.current_betas());
  c.lr_range_test_staircase = true;
  LrSchedule t(c, 0.3);
  EXPECT_DOUBLE_EQ(t.LrAt(2), 0.01);   // floor(3/4) = 0
  EXPECT_DOUBLE_EQ(t.LrAt(3), 0.015);  // floor(4/4) = 1
  EXPECT_DOUBLE_EQ(t.LrAt(10), 0.02);  // floor(11/4) = 2
  // Started elsewhere (last_batch_iteration given), the constructor leaves the lr alone.
  c.last_batch_iteration = 5;
  LrSchedule u(c, 0.3);
  EXPECT_EQ(u.current_lr(), 0.3);
  EXPECT_EQ(u.last_batch_iteration(), 5);
  EXPECT_STREQ(u.step_argument(), "batch_iteration");
}

// OneCycle over a cycle of 4 + 6 iterations (step ratio 0.4), then decay
// every 2: lr min + (max - min) * scale, momentum max - (max - min) * scale,
// betas (momentum, 0.99); after the cycle min_lr / (1 + rate * d / size).
TEST(LrScheduleValues, OneCycle) {
  SchedulerConfig c = Parse(R"({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
      "cycle_first_step_size": 4, "cycle_second_step_size": 6, "decay_step_size": 2, "decay_lr_rate": 0.5,
      "decay_mom_rate": 0.1}})");
  LrSchedule s(c, 0.3);
  s.set_group_lrs({0.3});
  EXPECT_EQ(s.current_lr(), 0.1);
  ASSERT_TRUE(s.current_betas());
  EXPECT_EQ(*s.current_betas(), (LrSchedule::Betas{0.8, 0.99}));
  s.Step(1);  // batch 2 of 10: x = 0.2, scale 0.5
  EXPECT_DOUBLE_EQ(s.current_lr(), 0.55);
  EXPECT_DOUBLE_EQ(s.current_betas()->first, 0.85);
  EXPECT_EQ(s.current_betas()->second, 0.99);
  s.Step(3);  // x = 0.4: the top
  EXPECT_DOUBLE_EQ(s.current_lr(), 1.0);
  EXPECT_DOUBLE_EQ(s.current_betas()->first, 0.8);
  s.Step(6);  // x = 0.7: (0.7 - 1) / (0.4 - 1) = 0.5
  EXPECT_DOUBLE_EQ(s.current_lr(), 0.55);
  EXPECT_DOUBLE_EQ(s.LrAt(9), 0.1);  // x = 0 of the next cycle
  s.Step(10);                        // decay: d = 1, interval 0.5
  EXPECT_DOUBLE_EQ(s.current_lr(), 0.1 / 1.25);
  EXPECT_DOUBLE_EQ(s.current_betas()->first, 0.9 * 1.05);
  EXPECT_DOUBLE_EQ(s.LrAt(13), 0.1 / 2.0);  // d = 4
  // Restoring a position: the lr and betas follow only when asked (the optimizer's groups restored with it).
  LrSchedule r(c, 0.3);
  r.Restore(3, /*set_lr=*/false);
  EXPECT_EQ(r.current_lr(), 0.1);
  r.Step();
  EXPECT_DOUBLE_EQ(r.current_lr(), 0.1 + 0.9 * ((0.5 - 1) / (0.4 - 1)));  // iteration 4: x = 0.5
  r.Restore(3);
  EXPECT_DOUBLE_EQ(r.current_lr(), 1.0);
  // Without momentum cycling, no betas; with no decay rate, min_lr after the cycle.
  c.cycle_momentum = false;
  c.decay_lr_rate = 0;
  LrSchedule n(c, 0.3);
  EXPECT_FALSE(n.current_betas());
  EXPECT_EQ(n.LrAt(20), 0.1);
}

// WarmupCosineLR scales each group's own lr: linear warmup from the min ratio
// over max(2, warmup) steps, then (1 + cos(pi * k / (total - warmup))) / 2
// down to cos_min_ratio; the first step keeps the optimizer's lrs.
TEST(LrScheduleValues, WarmupCosineLR) {
  SchedulerConfig c = Parse(R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 12, "warmup_num_steps": 4,
      "warmup_min_ratio": 0.1, "cos_min_ratio": 0.0, "warmup_type": "linear"}})");
  LrSchedule s(c, 0.2);
  s.set_group_lrs({0.2, 0.4});
  EXPECT_EQ(s.current_lrs(), (std::vector<double>{0.2, 0.4}));
  EXPECT_EQ(s.GetLr(), (std::vector<double>{0.0}));  // before its first step, as DeepSpeed's
  s.Step();
  EXPECT_DOUBLE_EQ(s.current_lr(0), 0.02);
  EXPECT_DOUBLE_EQ(s.current_lr(1), 0.04);
  EXPECT_DOUBLE_EQ(s.LrAt(2, 0), 0.2 * 0.55);
  EXPECT_DOUBLE_EQ(s.LrAt(4, 1), 0.4 * (1 + std::cos(M_PI / 8)) / 2);
  EXPECT_DOUBLE_EQ(s.LrAt(7, 0), 0.1);
  EXPECT_DOUBLE_EQ(s.LrAt(11, 1), 0.0);
  c.cos_min_ratio = 0.5;
  c.warmup_type = "log";
  LrSchedule t(c, 0.2);
  EXPECT_DOUBLE_EQ(t.LrAt(1), 0.2 * (0.1 + 0.9 * std::log(2.0) / std::log(4.0)));
  EXPECT_DOUBLE_EQ(t.LrAt(7), 0.2 * (0.5 + 0.5 * 0.5));
}

}  // namespace
}  // namespace uckpt::engine
