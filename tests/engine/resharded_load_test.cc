// Resuming a ZeRO checkpoint of any stage at another world size straight from
// its rank files (engine/resharded_load.h), into a stage 0-2 or a stage-3
// engine, equals converting it and resuming from the universal checkpoint,
// bit for bit: every rank's masters, moments, step, weights, loss scaler and
// lr, and the next step after them. Each rank reads exactly its own
// partition's bytes; no universal folder is written.
#include <gtest/gtest.h>

#include <filesystem>

#include "ckpt/convert.h"
#include "ckpt/partition.h"
#include "ckpt/zero_checkpoint.h"
#include "cli/trainer.h"
#include "engine/engine_access.h"
#include "engine/engine_impl.h"
#include "engine/zero3_runtime.h"
#include "fixture.h"
#include "format/error.h"
#include "ranks.h"
#include "tiny.h"

namespace uckpt::engine {
namespace {

using cli::StepMetrics;
using cli::Trainer;
using cli::TrainOptions;

namespace fs = std::filesystem;
using testing::RunRanks;

// 798 parameters: padded at world sizes 2 and 4 (as resume_test.cc's).
// Stage 3 cuts its groups into sub-groups of at most 300 elements.
TrainOptions TinyOptions(int stage, bool bf16, int world) {
  nlohmann::json ds = {
      {"train_batch_size", 12},
      {"gradient_accumulation_steps", 12 % (world * 2) == 0 ? 2 : 1},
      {"gradient_clipping", 1.0},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}, {"weight_decay", 0.1}}}}},
      {"scheduler",
       {{"type", "WarmupLR"},
        {"params",
         {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 0.01}, {"warmup_num_steps", 3}, {"warmup_type", "linear"}}}}},
      {"zero_optimization", {{"stage", stage}}},
      {"bf16", {{"enabled", bf16}}}};
  if (stage == 3) ds["zero_optimization"]["sub_group_size"] = 300;
  TrainOptions o = testing::TinyGpt2(ds);
  o.seed = 7;
  o.init_seed = 11;
  return o;
}

std::string TempDir(const std::string& name) { return testing::FreshTempDir("engine_" + name); }

void ExpectSameRun(Trainer& a, Trainer& b, const std::string& what) {
  EXPECT_EQ(a.engine().optimizer().loss_scale(), b.engine().optimizer().loss_scale()) << what;
  EXPECT_EQ(a.engine().optimizer().lr(), b.engine().optimizer().lr()) << what;
  EXPECT_EQ(a.counters().global_steps, b.counters().global_steps) << what;
  EXPECT_EQ(a.counters().global_samples, b.counters().global_samples) << what;
  EXPECT_EQ(a.engine().optimizer().lr_schedule_iteration(), b.engine().optimizer().lr_schedule_iteration()) << what;
}

void ExpectSamePartition(const PartitionState& x, const PartitionState& y, const std::string& what) {
  EXPECT_TRUE(at::equal(x.master, y.master)) << what << ": fp32";
  ASSERT_EQ(x.exp_avg.defined(), y.exp_avg.defined()) << what;
  if (x.exp_avg.defined()) {
    EXPECT_TRUE(at::equal(x.exp_avg, y.exp_avg)) << what << ": exp_avg";
    EXPECT_TRUE(at::equal(x.exp_avg_sq, y.exp_avg_sq)) << what << ": exp_avg_sq";
    EXPECT_EQ(x.step.item<double>(), y.step.item<double>()) << what << ": step";
  }
}

// Typed, for what only stage 3 has (its sub-groups); null at stages 0-2.
const Zero3Runtime* Zero3Of(Trainer& t) {
  return dynamic_cast<const Zero3Runtime*>(engine::EngineAccess::State(t.engine()).runtime.get());
}

// Two engines on the same rank hold the same state, bit for bit.
void ExpectSameState(Trainer& a, Trainer& b, const std::string& what) {
  ExpectSameRun(a, b, what);
  if (const Zero3Runtime* x = Zero3Of(a)) {
    const Zero3Runtime& y = *Zero3Of(b);
    ASSERT_EQ(x->sub_groups().size(), y.sub_groups().size()) << what;
    for (size_t i = 0; i < x->sub_groups().size(); ++i)
      ExpectSamePartition(x->sub_groups()[i].state, y.sub_groups()[i].state, what + " sub-group " + std::to_string(i));
    for (size_t p = 0; p < x->params().size(); ++p)
      EXPECT_TRUE(at::equal(x->params()[p].partition, y.params()[p].partition)) << what << ": " << x->params()[p].name;
    return;
  }
  ExpectSamePartition(testing::ZeroOf(a).state(), testing::ZeroOf(b).state(), what);
  EXPECT_TRUE(at::equal(testing::ZeroOf(a).model_flat(), testing::ZeroOf(b).model_flat())) << what << ": weights";
}

// This rank's real (non-padding) optimizer bytes: fp32 + exp_avg + exp_avg_sq.
uint64_t PartitionBytes(Trainer& t) {
  if (const Zero3Runtime* z = Zero3Of(t)) {
    int64_t real = 0;
    for (const auto& p : z->params())
      real += ckpt::Stage3RealNumel(p.numel, z->dp(), engine::EngineAccess::State(t.engine()).comm->rank());
    return static_cast<uint64_t>(real) * 4 * 3;
  }
  const auto& l = testing::ZeroOf(t).layout();
  return static_cast<uint64_t>(l.real_numel(testing::ZeroOf(t).partition_rank())) * 4 * 3;
}

// `converted` loaded the universal conversion, `direct` the ZeRO files: the
// bytes `direct` read are its partition's, and both hold the same state, also
// after one more step. Returns those bytes.
uint64_t ExpectSameAsConverted(Trainer& converted, Trainer& direct, const std::string& what) {
  const uint64_t bytes = direct.engine().stats().last_load().optimizer_bytes_read;
  EXPECT_EQ(bytes, PartitionBytes(direct)) << what;
  ExpectSameState(converted, direct, what);
  const StepMetrics a = converted.TrainStep(), b = direct.TrainStep();
  EXPECT_EQ(a.loss, b.loss) << what;
  ExpectSameState(converted, direct, what + " after a step");
  return bytes;
}

// A checkpoint saved at stage `from` and loaded into stage `to` engines.
struct Variant {
  int from, to;
  bool bf16;
};
class ReshardedResume : public ::testing::TestWithParam<Variant> {};

TEST_P(ReshardedResume, EveryWorldSizeToEveryWorldSizeEqualsConvertPath) {
  const Variant v = GetParam();
  const std::string root = TempDir("resharded");
  for (int n = 1; n <= 4; ++n) {
    const std::string dir = root + "/n" + std::to_string(n);
    RunRanks(n, [&](Comm& comm) {
      Trainer t(comm, TinyOptions(v.from, v.bf16, n));
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
        Trainer converted(comm, TinyOptions(v.to, v.bf16, m));
        converted.LoadCheckpoint(universal, "", true);
        Trainer direct(comm, TinyOptions(v.to, v.bf16, m));
        direct.engine().LoadCheckpoint(dir, "");
        read[comm.rank()] = ExpectSameAsConverted(converted, direct, what);
      });
      // Over all ranks, each optimizer byte of the old files once: 3 fp32
      // states of 798 elements (stage 0 keeps all of them on every rank).
      uint64_t sum = 0;
      for (uint64_t b : read) sum += b;
      EXPECT_EQ(sum, 798u * 4 * 3 * (v.to == 0 ? m : 1)) << n << "->" << m;
    }
    // Nothing was written beside the checkpoint (no universal folder).
    EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), before);
  }
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(StagesDtypes, ReshardedResume,
                         ::testing::Values(Variant{1, 1, false}, Variant{2, 2, false}, Variant{1, 1, true},
                                           Variant{2, 2, true}, Variant{2, 3, false}, Variant{3, 3, false},
                                           Variant{3, 3, true}, Variant{1, 3, true}, Variant{3, 1, false},
                                           Variant{3, 2, false}, Variant{3, 2, true}, Variant{3, 0, false},
                                           Variant{2, 0, false}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.from) + "_to_stage" +
                                  std::to_string(info.param.to) + (info.param.bf16 ? "_bf16" : "_fp32");
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
      EXPECT_EQ(direct.engine().stats().last_load().optimizer_bytes_read, PartitionBytes(direct)) << what;
      ExpectSameState(converted, direct, what);
      converted.TrainStep();
      direct.TrainStep();
      ExpectSameState(converted, direct, what + " after a step");
    });
  }
}

// DeepSpeed's own ZeRO-3 checkpoint of the refrun fixture (world size 2),
// resumed at 1-4 ranks at stage 3 (optimizer on the device, and offloaded to
// host memory) and at stage 2: equal to resuming DeepSpeed's universal
// checkpoint of it.
TEST(ReshardedResume, DeepSpeedRefrunZero3CheckpointEqualsItsUniversal) {
  const std::string ckpt = testing::RefrunDir() + "/ckpt_zero3";
  for (auto [stage, offload] : {std::pair{3, false}, std::pair{3, true}, std::pair{2, false}})
    for (int m = 1; m <= 4; ++m) {
      std::vector<uint64_t> read(m);
      RunRanks(m, [&](Comm& comm) {
        nlohmann::json ds = testing::RefrunDsConfig("z3_ws2_baseline");
        ds["train_batch_size"] = 2 * m;
        ds["gradient_accumulation_steps"] = 1;
        ds["zero_optimization"]["stage"] = stage;
        if (offload) ds["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
        const std::string what = "stage " + std::to_string(stage) + (offload ? " offload" : "") + " 2->" +
                                 std::to_string(m) + " rank " + std::to_string(comm.rank());
        Trainer converted(comm, testing::RefrunOptions(ds, "z3"));
        converted.LoadCheckpoint(ckpt, "global_step6_universal", true);
        Trainer direct(comm, testing::RefrunOptions(ds, "z3"));
        direct.engine().LoadCheckpoint(ckpt, "global_step6");
        read[comm.rank()] = ExpectSameAsConverted(converted, direct, what);
      });
      uint64_t sum = 0;
      for (uint64_t b : read) sum += b;
      EXPECT_EQ(sum, ckpt::OpenZeroCheckpoint(ckpt + "/global_step6").total_bytes()) << stage << " at " << m;
    }
}

// Loading into another model names the file that lists the parameters and
// the parameter, from a stage-2 and a stage-3 source into stage 2 and 3.
TEST(ReshardedResume, AnotherModelNamesTheFileAndParameter) {
  const std::string root = TempDir("resharded_errors");
  for (int from : {2, 3}) {
    const std::string dir = root + "/s" + std::to_string(from);
    RunRanks(2, [&](Comm& comm) {
      Trainer t(comm, TinyOptions(from, false, 2));
      t.TrainStep();
      t.SaveCheckpoint(dir, "global_step1");
    });
    for (int to : {2, 3}) {
      const std::string what = std::to_string(from) + "->" + std::to_string(to);
      RunRanks(1, [&](Comm& comm) {
        TrainOptions deeper = TinyOptions(to, false, 1);
        deeper.model.n_layer = 2;
        Trainer t(comm, deeper);
        try {
          t.engine().LoadCheckpoint(dir, "");
          ADD_FAILURE() << what << ": a model with another layer loaded";
        } catch (const FormatError& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("model_states.pt"), std::string::npos) << what << ": " << m;
          // The parameter, or (stage 1/2 files) the count of param_shapes.
          EXPECT_TRUE(m.find("h.1.") != std::string::npos || m.find("param_shapes") != std::string::npos)
              << what << ": " << m;
        }
        TrainOptions wider = TinyOptions(to, false, 1);
        wider.model.n_embd = 8;
        Trainer w(comm, wider);
        try {
          w.engine().LoadCheckpoint(dir, "");
          ADD_FAILURE() << what << ": a wider model loaded";
        } catch (const FormatError& e) {
          EXPECT_NE(std::string(e.what()).find("model_states.pt"), std::string::npos) << what << ": " << e.what();
        }
      });
    }
  }
  fs::remove_all(root);
}

// load_optimizer_states = false: the masters only, as from the universal
// checkpoint, into stage 3 from a stage-2 source and into stage 2 from a
// stage-3 one (whose module state holds no trainable weights).
TEST(ReshardedResume, WithoutOptimizerStatesLoadsTheMastersOnly) {
  const std::string root = TempDir("resharded_masters");
  for (auto [from, to] : {std::pair{2, 3}, std::pair{3, 2}}) {
    const std::string dir = root + "/s" + std::to_string(from);
    RunRanks(2, [&](Comm& comm) {
      Trainer t(comm, TinyOptions(from, false, 2));
      t.TrainStep();
      t.SaveCheckpoint(dir, "global_step1");
    });
    ckpt::ConvertOptions co;
    co.durable = false;
    ckpt::ConvertToUniversal(dir + "/global_step1", dir + "/global_step1_universal", co);
    RunRanks(3, [&](Comm& comm) {
      const std::string what =
          std::to_string(from) + "->" + std::to_string(to) + " rank " + std::to_string(comm.rank());
      LoadCheckpointOptions lo;
      lo.load_optimizer_states = false;
      Trainer direct(comm, TinyOptions(to, false, 3));
      direct.engine().LoadCheckpoint(dir, "global_step1", lo);
      lo.universal = true;
      Trainer converted(comm, TinyOptions(to, false, 3));
      converted.engine().LoadCheckpoint(dir, "global_step1_universal", lo);
      ExpectSameState(converted, direct, what);
      const PartitionState& st =
          Zero3Of(direct) ? Zero3Of(direct)->sub_groups()[0].state : testing::ZeroOf(direct).state();
      EXPECT_FALSE(st.exp_avg.defined()) << what;
      EXPECT_EQ(direct.engine().stats().last_load().optimizer_bytes_read, PartitionBytes(direct) / 3) << what;
    });
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace uckpt::engine
