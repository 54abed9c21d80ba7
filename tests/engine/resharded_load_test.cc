// Resuming a ZeRO stage 1/2 checkpoint at another world size straight from
// its rank files (engine/resharded_load.h) equals converting it and resuming
// from the universal checkpoint, bit for bit: every rank's masters, moments,
// step, weights, loss scaler and lr, and the next step after them. Each rank
// reads exactly its own partition's bytes; no universal folder is written.
#include <gtest/gtest.h>

#include <filesystem>

#include "ckpt/convert.h"
#include "ckpt/partition.h"
#include "fixture.h"
#include "ranks.h"
#include "tiny.h"
#include "cli/trainer.h"

namespace uckpt::engine {
namespace {

namespace fs = std::filesystem;
using testing::RunRanks;

// 798 parameters: padded at world sizes 2 and 4 (as resume_test.cc's).
TrainOptions TinyOptions(int stage, bool bf16, int world) {
  nlohmann::json ds = {
      {"train_batch_size", 12},
      {"gradient_accumulation_steps", 12 % (world * 2) == 0 ? 2 : 1},
      {"gradient_clipping", 1.0},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}, {"weight_decay", 0.1}}}}},
      {"scheduler",
       {{"type", "WarmupLR"},
        {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 0.01}, {"warmup_num_steps", 3}, {"warmup_type", "linear"}}}}},
      {"zero_optimization", {{"stage", stage}}},
      {"bf16", {{"enabled", bf16}}}};
  TrainOptions o = testing::TinyGpt2(ds);
  o.seed = 7;
  o.init_seed = 11;
  return o;
}

std::string TempDir(const std::string& name) { return testing::FreshTempDir("engine_" + name); }

// Two engines on the same rank hold the same state, bit for bit.
void ExpectSameState(Trainer& a, Trainer& b, const std::string& what) {
  const auto &x = a.optimizer().state(), &y = b.optimizer().state();
  EXPECT_TRUE(at::equal(x.master, y.master)) << what << ": fp32";
  ASSERT_EQ(x.exp_avg.defined(), y.exp_avg.defined()) << what;
  if (x.exp_avg.defined()) {
    EXPECT_TRUE(at::equal(x.exp_avg, y.exp_avg)) << what << ": exp_avg";
    EXPECT_TRUE(at::equal(x.exp_avg_sq, y.exp_avg_sq)) << what << ": exp_avg_sq";
    EXPECT_EQ(x.step.item<double>(), y.step.item<double>()) << what << ": step";
  }
  EXPECT_TRUE(at::equal(a.optimizer().model_flat(), b.optimizer().model_flat())) << what << ": weights";
  EXPECT_EQ(a.engine().loss_scale(), b.engine().loss_scale()) << what;
  EXPECT_EQ(a.engine().lr(), b.engine().lr()) << what;
  EXPECT_EQ(a.counters().global_steps, b.counters().global_steps) << what;
  EXPECT_EQ(a.counters().global_samples, b.counters().global_samples) << what;
  EXPECT_EQ(a.schedule().last_batch_iteration(), b.schedule().last_batch_iteration()) << what;
}

// This rank's real (non-padding) optimizer bytes: fp32 + exp_avg + exp_avg_sq.
uint64_t PartitionBytes(Trainer& t) {
  const auto& l = t.optimizer().layout();
  return static_cast<uint64_t>(l.real_numel(t.optimizer().partition_rank())) * 4 * 3;
}

struct Variant {
  int stage;
  bool bf16;
};
class ReshardedResume : public ::testing::TestWithParam<Variant> {};

TEST_P(ReshardedResume, EveryWorldSizeToEveryWorldSizeEqualsConvertPath) {
  const Variant v = GetParam();
  const std::string root = TempDir("resharded");
  for (int n = 1; n <= 4; ++n) {
    const std::string dir = root + "/n" + std::to_string(n);
    RunRanks(n, [&](Comm& comm) {
      Trainer t(comm, TinyOptions(v.stage, v.bf16, n));
      t.TrainStep();
      t.TrainStep();
      t.SaveCheckpoint(dir, "global_step2");
    });
    const auto before = std::distance(fs::directory_iterator(dir), fs::directory_iterator());
    const std::string universal = root + "/u" + std::to_string(n);
    fs::create_directories(universal);
    ckpt::ConvertOptions co;
    co.durable = false;
    ckpt::ConvertToUniversal(dir + "/global_step2", universal + "/global_step2_universal", co);
    for (int m = 1; m <= 4; ++m) {
      std::vector<uint64_t> read(m);
      RunRanks(m, [&](Comm& comm) {
        const std::string what = std::to_string(n) + "->" + std::to_string(m) + " rank " + std::to_string(comm.rank());
        Trainer converted(comm, TinyOptions(v.stage, v.bf16, m));
        converted.LoadCheckpoint(universal, "", true);
        Trainer direct(comm, TinyOptions(v.stage, v.bf16, m));
        direct.engine().LoadCheckpoint(dir, "");
        const uint64_t bytes = direct.engine().last_load().optimizer_bytes_read;
        read[comm.rank()] = bytes;
        EXPECT_EQ(bytes, PartitionBytes(direct)) << what;
        ExpectSameState(converted, direct, what);
        converted.TrainStep();
        direct.TrainStep();
        ExpectSameState(converted, direct, what + " after a step");
      });
      // Over all ranks, each optimizer byte of the old files once: 3 fp32 states of 798 elements.
      uint64_t sum = 0;
      for (uint64_t b : read) sum += b;
      EXPECT_EQ(sum, 798u * 4 * 3) << n << "->" << m;
    }
    // Nothing was written beside the checkpoint (no universal folder).
    EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), before);
  }
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(StagesDtypes, ReshardedResume,
                         ::testing::Values(Variant{1, false}, Variant{2, false}, Variant{1, true}, Variant{2, true}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) + (info.param.bf16 ? "_bf16" : "_fp32");
                         });

// DeepSpeed's own ZeRO-2 checkpoint of the refrun fixture (world size 2),
// resumed at 1, 3 and 4 ranks: equal to resuming DeepSpeed's universal
// checkpoint of it.
TEST(ReshardedResume, DeepSpeedRefrunCheckpointEqualsItsUniversal) {
  const std::string ckpt = testing::RefrunDir() + "/ckpt";
  for (int m : {1, 3, 4}) {
    RunRanks(m, [&](Comm& comm) {
      nlohmann::json ds = testing::RefrunDsConfig("z2_ws2_baseline");
      ds["train_batch_size"] = 2 * m;
      ds["gradient_accumulation_steps"] = 1;
      const std::string what = "2->" + std::to_string(m) + " rank " + std::to_string(comm.rank());
      Trainer converted(comm, testing::RefrunOptions(ds, "z2"));
      converted.LoadCheckpoint(ckpt, "global_step6_universal", true);
      Trainer direct(comm, testing::RefrunOptions(ds, "z2"));
      direct.engine().LoadCheckpoint(ckpt, "global_step6");
      EXPECT_EQ(direct.engine().last_load().optimizer_bytes_read, PartitionBytes(direct)) << what;
      ExpectSameState(converted, direct, what);
      converted.TrainStep();
      direct.TrainStep();
      ExpectSameState(converted, direct, what + " after a step");
    });
  }
}

}  // namespace
}  // namespace uckpt::engine
