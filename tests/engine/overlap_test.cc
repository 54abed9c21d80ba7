// ZeRO-2 with overlap_comm: gradient buckets all-reduced from autograd hooks
// while backward runs give the same training as the reduce-scatter after it.
#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "cli/trainer.h"
#include "engine/host_grad_copy.h"
#include "engine/overlap_reducer.h"
#include "fixture.h"
#include "ranks.h"

namespace uckpt::engine {
namespace {

using cli::StepMetrics;
using cli::Trainer;
using cli::TrainOptions;

struct OverlapRun {
  std::map<int64_t, double> losses;
  int64_t buckets = 0, started_during_backward = 0;
};

OverlapRun TrainZero2(int world, bool overlap) {
  TrainOptions o = testing::RefrunOptions(testing::RefrunDsConfig("z2_ws2_baseline"), "z2_ws2_baseline");
  o.config.gradient_accumulation_steps.reset();  // batch 8 = micro 2 x GA x world
  o.config.zero.overlap_comm = overlap;
  o.config.zero.reduce_bucket_size = 1000;  // 8400 parameters: several buckets
  OverlapRun out;
  std::mutex mu;
  testing::RunRanks(world, [&](Comm& comm) {
    Trainer t(comm, o);
    while (t.counters().global_steps < 12) {
      StepMetrics m = t.TrainStep();
      std::lock_guard<std::mutex> lock(mu);
      if (comm.rank() == 0) out.losses[m.step] = m.loss;
    }
    std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0 && testing::ZeroOf(t).overlap_reducer() != nullptr) {
      out.buckets = testing::ZeroOf(t).overlap_reducer()->num_buckets();
      out.started_during_backward = testing::ZeroOf(t).overlap_reducer()->started_during_backward();
    }
  });
  return out;
}

TEST(OverlapComm, SameLossesAsReduceScatterAfterBackward) {
  for (int world : {2, 4}) {
    OverlapRun plain = TrainZero2(world, false), overlapped = TrainZero2(world, true);
    ASSERT_EQ(plain.losses.size(), 12u);
    ASSERT_EQ(overlapped.losses.size(), 12u);
    for (const auto& [step, loss] : plain.losses)
      EXPECT_NEAR(overlapped.losses[step], loss, 1e-6 * loss) << "world " << world << " step " << step;
    // The hooks, not the fallback in Finish(), started the buckets.
    EXPECT_GT(overlapped.buckets, 3) << world;
    const int64_t micro_steps = 12 * (4 / world);  // batch 8 = micro 2 x GA x world
    EXPECT_EQ(overlapped.started_during_backward, overlapped.buckets * micro_steps) << world;
  }
}

// offload_optimizer at one rank through the engine (GPT-2, GA 4): the
// gradients go to the host during backward, in each backward at stage 2 and
// in each step's last one at stage 1 (where they accumulate on the device
// until then); the losses are the optimizer-on-device run's (the fused host
// Adam may differ from torch's in an element's last bit).
TEST(OffloadAtOneRank, GradientsComeDownDuringBackwardAndTrainAsWithoutOffload) {
  for (int stage : {1, 2}) {
    std::map<bool, std::map<int64_t, double>> losses;
    int64_t buckets = 0, copied = 0;
    for (bool offload : {false, true}) {
      nlohmann::json ds = testing::RefrunDsConfig("z2_ws2_baseline");
      ds["zero_optimization"]["stage"] = stage;
      ds["zero_optimization"]["reduce_bucket_size"] = 1000;  // 8400 parameters: several buckets
      if (offload) ds["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
      TrainOptions o = testing::RefrunOptions(ds, "z2_ws2_baseline");
      o.config.gradient_accumulation_steps.reset();  // batch 8 = micro 2 x GA 4
      testing::RunRanks(1, [&](Comm& comm) {
        Trainer t(comm, o);
        while (t.counters().global_steps < 6) {
          StepMetrics m = t.TrainStep();
          losses[offload][m.step] = m.loss;
        }
        if (const BucketedHostCopy* h = testing::ZeroOf(t).host_copy()) {
          buckets = h->num_buckets();
          copied = h->copied_during_backward();
        }
      });
    }
    ASSERT_EQ(losses[true].size(), 6u);
    for (const auto& [step, loss] : losses[false])
      EXPECT_NEAR(losses[true][step], loss, 1e-6 * loss) << "stage " << stage << " step " << step;
    EXPECT_GT(buckets, 3) << stage;
    EXPECT_EQ(copied, buckets * 6 * (stage == 2 ? 4 : 1)) << stage;
  }
}

}  // namespace
}  // namespace uckpt::engine
