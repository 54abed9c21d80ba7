#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "fixture.h"
#include "format/error.h"
#include "engine/config.h"
#include "engine/data/data.h"
#include "engine/lr_schedule.h"

namespace uckpt::engine {
namespace {

using testing::ReadJson;
using testing::RefrunDir;

TEST(Data, SplitMix64TestVectors) {
  auto v = ReadJson(RefrunDir() + "/data_test_vectors.json");
  ASSERT_EQ(v["splitmix64"].size(), 5u);
  for (const auto& e : v["splitmix64"])
    EXPECT_EQ(SplitMix64(e["x"].get<uint64_t>()), e["splitmix64"].get<uint64_t>()) << e["x_hex"];
}

TEST(Data, GlobalBatchesOfStep1And12) {
  auto v = ReadJson(RefrunDir() + "/data_test_vectors.json");
  SyntheticSource src(v["data_seed"].get<uint64_t>(), v["vocab_size"].get<int64_t>());
  const int64_t gb = v["global_batch"], T = v["seq_len"];
  for (auto [step, key] : {std::pair{1, "global_batch_step1"}, std::pair{12, "global_batch_step12"}}) {
    auto rows = GatherRows(src, step, (step - 1) * gb, 0, gb, T);
    for (int64_t i = 0; i < gb; ++i)
      for (int64_t t = 0; t < T; ++t)
        ASSERT_EQ(rows[static_cast<size_t>(i * T + t)], v[key][i][t].get<int64_t>()) << key << " " << i << " " << t;
  }
}

TEST(Data, EveryRowOnceWhateverTheSplit) {
  // GB = 24: each (W, MB, GA) with W*MB*GA = 24 covers rows 0..23 exactly once.
  for (auto [w, mb, ga] : {std::tuple{1, 24, 1}, {1, 8, 3}, {2, 4, 3}, {3, 2, 4}, {4, 3, 2}, {24, 1, 1}}) {
    std::vector<int> seen(24, 0);
    for (int m = 0; m < ga; ++m)
      for (int r = 0; r < w; ++r)
        for (int k = 0; k < mb; ++k) ++seen[static_cast<size_t>(FirstRow(m, r, w, mb) + k)];
    for (int i = 0; i < 24; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)], 1) << w << " " << mb << " " << ga;
  }
  // The fixture's micro-batch j = rows [2j, 2j+2): (m=1, r=0) of W=2, MB=2 is rows 4..5.
  EXPECT_EQ(FirstRow(1, 0, 2, 2), 4);
  EXPECT_EQ(FirstRow(0, 3, 4, 2), 6);
}

TEST(Data, TokenFilesFollowTheDataPosition) {
  auto path = std::filesystem::temp_directory_path() / "uckpt_tokens_test.bin";
  {
    std::ofstream out(path, std::ios::binary);
    for (uint16_t t = 0; t < 40; ++t) out.put(static_cast<char>(t)).put(0);
  }
  TokenFileSource src(path.string(), TokenFileSource::Encoding::kUInt16, 8, 50);
  EXPECT_EQ(src.num_sequences(), 5);
  // Row 1 of a step whose data position is 3: sample 4 = tokens 32..39.
  auto rows = GatherRows(src, 7, 3, 1, 2, 8);
  EXPECT_EQ(rows[0], 32);
  EXPECT_EQ(rows[7], 39);
  EXPECT_EQ(rows[8], 0);  // sample 5 wraps to sequence 0
  EXPECT_THROW(TokenFileSource(path.string(), TokenFileSource::Encoding::kUInt16, 8, 20), FormatError);
  EXPECT_THROW(TokenFileSource(path.string(), TokenFileSource::Encoding::kUInt16, 100, 50), FormatError);
  TokenFileSource bytes(path.string(), TokenFileSource::Encoding::kBytes, 8, 256);
  EXPECT_EQ(bytes.num_sequences(), 10);
  std::filesystem::remove(path);
}

TEST(Data, LlmCTokenFilesSkipTheirHeader) {
  auto path = std::filesystem::temp_directory_path() / "uckpt_llmc_test.bin";
  {
    std::ofstream out(path, std::ios::binary);
    int32_t header[256] = {20240520, 1, 20};
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
    for (uint16_t t = 100; t < 120; ++t) out.write(reinterpret_cast<const char*>(&t), 2);
    out.write("junk", 4);  // beyond the promised count: ignored
  }
  TokenFileSource src(path.string(), TokenFileSource::Encoding::kUInt16, 10, 200);
  EXPECT_EQ(src.num_sequences(), 2);
  EXPECT_EQ(GatherRows(src, 1, 0, 1, 1, 10)[0], 110);
  std::filesystem::remove(path);
}

TEST(Config, FixtureConfigsAreAcceptedAsIs) {
  for (auto run : {"z2_ws2_baseline", "z1_ws2_baseline", "z2_univ_ws4_resume", "z2_univ_ws1_resume",
                   "z2_ws2_baseline_clip0.5"}) {
    auto spec = ReadJson(RefrunDir() + "/runs/" + run + "/config.json");
    TrainConfig c = ParseConfig(spec["ds_config_as_passed"], run);
    EXPECT_TRUE(c.warnings.empty()) << run << ": " << c.warnings.front();
    EXPECT_EQ(c.zero.stage, spec["zero_stage"].get<int>());
    EXPECT_EQ(c.optimizer.type, "AdamW");
    EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.001);
    EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.01);
    EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.999);
    EXPECT_TRUE(c.optimizer.decoupled_weight_decay);
    EXPECT_EQ(c.scheduler.type, "WarmupLR");
    EXPECT_EQ(c.scheduler.warmup_type, "linear");
    EXPECT_EQ(c.scheduler.warmup_num_steps, 4);
    auto b = ResolveBatchSizes(c.train_batch_size, c.train_micro_batch_size_per_gpu,
                               c.gradient_accumulation_steps, spec["world_size"].get<int>());
    EXPECT_EQ(b.train_batch_size, 8);
    EXPECT_EQ(b.gradient_accumulation_steps, spec["gradient_accumulation_steps"].get<int64_t>());
  }
}

TEST(Config, UnknownKeysWarnWrongTypesFail) {
  auto j = nlohmann::json::parse(R"({"train_batch_size": 8, "frobnicate": 1, "optimizer": {"type": "Adam",
      "params": {"lr": 0.1, "colour": "red"}}})");
  TrainConfig c = ParseConfig(j, "cfg.json");
  ASSERT_EQ(c.warnings.size(), 2u);
  EXPECT_NE(c.warnings[0].find("optimizer.params.colour"), std::string::npos) << c.warnings[0];
  EXPECT_NE(c.warnings[1].find("frobnicate"), std::string::npos) << c.warnings[1];
  EXPECT_TRUE(c.optimizer.decoupled_weight_decay);  // DeepSpeed's Adam defaults to adam_w_mode
  auto fails = [](const char* text, const char* needle) {
    try {
      ParseConfig(nlohmann::json::parse(text), "cfg.json");
      ADD_FAILURE() << text;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("cfg.json"), std::string::npos) << e.what();
    }
  };
  fails(R"({"train_batch_size": "8"})", "train_batch_size' must be an integer");
  fails(R"({"train_batch_size": 8.5})", "must be an integer");
  fails(R"({"gradient_clipping": true})", "gradient_clipping' must be a number");
  fails(R"({"fp16": {"enabled": "yes"}})", "fp16.enabled");
  fails(R"({"zero_optimization": {"stage": 4}})", "stage 4");
  fails(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})", "offload_param needs stage 3");
  fails(R"({"optimizer": {"type": "SGD"}})", "SGD");
  fails(R"({"optimizer": {"params": {"betas": [0.9]}}})", "betas");
  fails(R"({"scheduler": {"type": "WarmupDecayLR", "params": {}}})", "total_num_steps");
  fails(R"({"train_micro_batch_size_per_gpu": "auto"})", "Hugging Face");
  fails(R"([1, 2])", "object");
  auto torch_adam = ParseConfig(nlohmann::json::parse(R"({"optimizer": {"type": "Adam", "params":
      {"torch_adam": true}}})"), "x");
  EXPECT_FALSE(torch_adam.optimizer.decoupled_weight_decay);
  auto big = ParseConfig(nlohmann::json::parse(R"({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,
      "offload_optimizer": {"device": "cpu"}}})"), "x");
  EXPECT_EQ(big.zero.reduce_bucket_size, 500000000);
  EXPECT_TRUE(big.zero.offload_optimizer_cpu);
}

TEST(Config, BatchArithmetic) {
  auto b = ResolveBatchSizes(32, 8, std::nullopt, 2);
  EXPECT_EQ(b.gradient_accumulation_steps, 2);
  b = ResolveBatchSizes(32, std::nullopt, 4, 2);
  EXPECT_EQ(b.micro_batch, 4);
  b = ResolveBatchSizes(std::nullopt, 8, 4, 3);
  EXPECT_EQ(b.train_batch_size, 96);
  b = ResolveBatchSizes(12, std::nullopt, std::nullopt, 3);
  EXPECT_EQ(b.micro_batch, 4);
  EXPECT_EQ(b.gradient_accumulation_steps, 1);
  try {
    ResolveBatchSizes(8, 2, 3, 2);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("8 != train_micro_batch_size_per_gpu 2 * gradient_accumulation_steps 3 * "
                                         "world size 2 = 12"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ResolveBatchSizes(10, 4, std::nullopt, 2), ConfigError);
  EXPECT_THROW(ResolveBatchSizes(std::nullopt, std::nullopt, 2, 2), ConfigError);
  EXPECT_THROW(ResolveBatchSizes(0, 2, std::nullopt, 1), ConfigError);
}

TEST(LrSchedule, MatchesTheLrDeepSpeedUsed) {
  auto spec = ReadJson(RefrunDir() + "/runs/z2_ws2_baseline/losses.json");
  TrainConfig c = ParseConfig(spec["ds_config_as_passed"], "baseline");
  LrSchedule s(c.scheduler, c.optimizer.lr);
  for (int step = 1; step <= 12; ++step) {
    EXPECT_DOUBLE_EQ(s.current_lr(), spec["steps"][std::to_string(step)]["lr_used"].get<double>()) << step;
    s.Step();
  }
  EXPECT_EQ(s.last_batch_iteration(), 11);
  // The 3-step check the README describes: optimizer lr 5e-4 -> 5e-4, 0, 2.5e-4.
  LrSchedule t(c.scheduler, 5e-4);
  EXPECT_DOUBLE_EQ(t.current_lr(), 5e-4);
  t.Step();
  EXPECT_DOUBLE_EQ(t.current_lr(), 0.0);
  t.Step();
  EXPECT_DOUBLE_EQ(t.current_lr(), 2.5e-4);
  // Resuming after step 6 (last_batch_iteration 5) gives step 7's lr.
  LrSchedule r(c.scheduler, c.optimizer.lr);
  r.Restore(5);
  EXPECT_DOUBLE_EQ(r.current_lr(), 0.001);
}

TEST(LrSchedule, LogWarmupAndDecay) {
  SchedulerConfig sc;
  sc.type = "WarmupDecayLR";
  sc.warmup_min_lr = 0.0;
  sc.warmup_max_lr = 1.0;
  sc.warmup_num_steps = 10;
  sc.total_num_steps = 20;
  LrSchedule s(sc, 0.5);
  EXPECT_DOUBLE_EQ(s.LrAt(0), 0.0);
  EXPECT_DOUBLE_EQ(s.LrAt(4), std::log(5.0) / std::log(10.0));
  EXPECT_DOUBLE_EQ(s.LrAt(10), 1.0);
  EXPECT_DOUBLE_EQ(s.LrAt(15), 0.5);
  EXPECT_DOUBLE_EQ(s.LrAt(25), 0.0);
}

}  // namespace
}  // namespace uckpt::engine
