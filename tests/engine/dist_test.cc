// Multi-rank training against the fixture's real DeepSpeed runs.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <mutex>

#include "cli/init_weights.h"
#include "cli/trainer.h"
#include "engine/torch_bridge.h"
#include "fixture.h"
#include "format/torch_file.h"
#include "ranks.h"

namespace uckpt::engine {
namespace {

using cli::LoadStateDictFile;
using cli::StepMetrics;
using cli::Trainer;
using cli::TrainOptions;

using testing::ReadJson;
using testing::RefrunDir;
using testing::RefrunModel;
using testing::RunRanks;

// The fixture run's DeepSpeed config, as given.
TrainOptions RunOptions(const std::string& run) { return testing::RefrunOptions(testing::RefrunDsConfig(run), run); }

struct RunResult {
  std::map<int64_t, StepMetrics> steps;
  double final_weight_diff = -1;
};

// Trains `run`'s config at `world` ranks from step `from` (after loading
// `load_dir`/`tag` when given) to 12, and compares with `losses_of`: within
// the tolerance, or (`bitwise`) every loss, grad norm and final weight
// equal. One intra-op thread per rank, as DeepSpeed ran (OMP_NUM_THREADS=1):
// libtorch's threaded kernels sum in another order.
RunResult TrainAndCompare(const std::string& run, int world, const std::string& losses_of,
                          const std::string& load_dir = "", const std::string& tag = "", bool universal = false,
                          bool bitwise = false) {
  RunResult out;
  std::mutex mu;
  RunRanks(world, [&](Comm& comm) {
    at::set_num_threads(1);
    Trainer t(comm, RunOptions(run));
    if (!load_dir.empty()) t.LoadCheckpoint(load_dir, tag, universal);
    while (t.counters().global_steps < 12) {
      StepMetrics m = t.TrainStep();
      if (comm.rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        out.steps[m.step] = m;
      }
    }
    if (comm.rank() == 0) {
      double worst = 0;
      for (const auto& r : LoadStateDictFile(RefrunDir() + "/runs/" + losses_of + "/final_model.pt"))
        for (const auto& p : t.parameters())
          if (p.name == r.name) worst = std::max(worst, (p.tensor - r.tensor).abs().max().item<double>());
      out.final_weight_diff = worst;
    }
  });
  auto ref = ReadJson(RefrunDir() + "/runs/" + losses_of + "/losses.json")["steps"];
  double worst = 0;
  for (const auto& [step, m] : out.steps) {
    const auto& r = ref[std::to_string(step)];
    const double want = r["loss"].get<double>();
    EXPECT_NEAR(m.loss, want, 1e-6 * want) << losses_of << " step " << step;
    EXPECT_DOUBLE_EQ(m.lr, r["lr_used"].get<double>()) << losses_of << " step " << step;
    if (bitwise) {
      EXPECT_EQ(m.loss, want) << losses_of << " step " << step;
      EXPECT_EQ(static_cast<float>(m.grad_norm), r["grad_norm"].get<float>()) << losses_of << " step " << step;
    }
    worst = std::max(worst, std::fabs(m.loss - want) / want);
  }
  EXPECT_LT(out.final_weight_diff, 1e-5) << losses_of;
  if (bitwise) {
    EXPECT_EQ(out.final_weight_diff, 0.0) << losses_of;
  }
  std::cout << "[ measured ] " << losses_of << " at world size " << world << ": " << out.steps.size()
            << " steps, max rel loss diff " << worst << ", max final weight diff " << out.final_weight_diff << "\n";
  return out;
}

// At DeepSpeed's world size our arithmetic is DeepSpeed's, op for op (stage 2:
// each micro-step's gradient divided by dp, summed over ranks, accumulated in
// fp32; stage 1: accumulated in the model's grads, then divided and summed),
// so the runs are bit-identical.
TEST(Distributed, Zero2BaselineAtWorldSize2EqualsDeepSpeedBitwise) {
  auto r = TrainAndCompare("z2_ws2_baseline", 2, "z2_ws2_baseline", "", "", false, true);
  EXPECT_EQ(r.steps.size(), 12u);
}

TEST(Distributed, Zero2ClippedAtWorldSize2EqualsDeepSpeedBitwise) {
  auto r = TrainAndCompare("z2_ws2_baseline_clip0.5", 2, "z2_ws2_baseline_clip0.5", "", "", false, true);
  EXPECT_EQ(r.steps.size(), 12u);
}

TEST(Distributed, Zero1BaselineAtWorldSize2EqualsDeepSpeedBitwise) {
  auto r = TrainAndCompare("z1_ws2_baseline", 2, "z1_ws2_baseline", "", "", false, true);
  EXPECT_EQ(r.steps.size(), 12u);
}

TEST(Distributed, ResumeFromDeepSpeedZeroCheckpointAtSameSize) {
  auto r = TrainAndCompare("z2_zero_ws2_resume", 2, "z2_zero_ws2_resume", RefrunDir() + "/ckpt", "", false, true);
  ASSERT_EQ(r.steps.size(), 6u);
  EXPECT_EQ(r.steps.begin()->first, 7);
}

// At 4 ranks Gloo's ring all-reduce sums each element's 4 terms in an order
// set by where it sits in the reduced buffer: bit-identical because we reduce
// DeepSpeed's buffer layout (gradients in the order backward produced them).
TEST(Distributed, ResumeFromDeepSpeedUniversalAtWorldSize4) {
  auto r = TrainAndCompare("z2_univ_ws4_resume", 4, "z2_univ_ws4_resume", RefrunDir() + "/ckpt", "", true, true);
  ASSERT_EQ(r.steps.size(), 6u);
  EXPECT_EQ(r.steps.begin()->first, 7);
}

TEST(Distributed, ResumeFromDeepSpeedUniversalAtWorldSize1) {
  auto r = TrainAndCompare("z2_univ_ws1_resume", 1, "z2_univ_ws1_resume", RefrunDir() + "/ckpt", "", true, true);
  ASSERT_EQ(r.steps.size(), 6u);
}

// After loading the universal checkpoint at world size 4, every rank's
// partition equals DeepSpeed's own re-sharded state bit for bit.
TEST(Distributed, UniversalLoadAtWorldSize4EqualsDeepSpeedResharding) {
  RunRanks(4, [&](Comm& comm) {
    Trainer t(comm, RunOptions("z2_univ_ws4_resume"));
    t.LoadCheckpoint(RefrunDir() + "/ckpt", "", true);
    const std::string path = RefrunDir() + "/resharded_ws4/global_step6/zero_pp_rank_" + std::to_string(comm.rank()) +
                             "_mp_rank_00_optim_states.pt";
    TorchFile f = LoadTorchFile(path);
    ValuePtr osd = f.root->get("optimizer_state_dict");
    ValuePtr state0 = osd->get("base_optimizer_state")->get("state")->entries.at(0).second;
    const PartitionState& s = testing::ZeroOf(t).state();
    auto fp32 = ToTorch(*osd->get("single_partition_of_fp32_groups")->items.at(0)->tensor);
    EXPECT_TRUE(at::equal(s.master.narrow(0, 0, fp32.numel()), fp32)) << "rank " << comm.rank();
    EXPECT_TRUE(at::equal(s.exp_avg, ToTorch(*state0->get("exp_avg")->tensor))) << "rank " << comm.rank();
    EXPECT_TRUE(at::equal(s.exp_avg_sq, ToTorch(*state0->get("exp_avg_sq")->tensor))) << "rank " << comm.rank();
    EXPECT_EQ(s.step.item<float>(), ToTorch(*state0->get("step")->tensor).item<float>());
    EXPECT_EQ(t.counters().global_steps, 6);
    EXPECT_EQ(t.counters().global_samples, 48);
    EXPECT_EQ(t.engine().optimizer().lr_schedule_iteration(), 5);
  });
}

// DeepSpeed's world-size-2 ZeRO checkpoint loads at 4 ranks without
// converting, into the state its universal checkpoint gives
// (tests/engine/resharded_load_test.cc checks every pair of sizes).
TEST(Distributed, ZeroCheckpointOfAnotherWorldSizeLoadsLikeItsUniversal) {
  RunRanks(4, [&](Comm& comm) {
    Trainer direct(comm, RunOptions("z2_univ_ws4_resume"));
    direct.LoadCheckpoint(RefrunDir() + "/ckpt", "global_step6", false);
    Trainer universal(comm, RunOptions("z2_univ_ws4_resume"));
    universal.LoadCheckpoint(RefrunDir() + "/ckpt", "global_step6_universal", true);
    const PartitionState &a = testing::ZeroOf(direct).state(), &b = testing::ZeroOf(universal).state();
    EXPECT_TRUE(at::equal(a.master, b.master) && at::equal(a.exp_avg, b.exp_avg) &&
                at::equal(a.exp_avg_sq, b.exp_avg_sq))
        << "rank " << comm.rank();
    EXPECT_EQ(direct.counters().global_steps, 6);
  });
}

}  // namespace
}  // namespace uckpt::engine
