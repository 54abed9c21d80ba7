#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "engine/config.h"
#include "engine/data/data.h"
#include "engine/loss_scaler.h"
#include "engine/lr_schedule.h"
#include "fixture.h"
#include "format/error.h"

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
  for (auto run :
       {"z2_ws2_baseline", "z1_ws2_baseline", "z2_univ_ws4_resume", "z2_univ_ws1_resume", "z2_ws2_baseline_clip0.5"}) {
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
    auto b = ResolveBatchSizes(c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps,
                               spec["world_size"].get<int>());
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
  fails(R"({"gradient_clipping": true})", "gradient_clipping' must be a finite number");
  fails(R"({"fp16": {"enabled": "yes"}})", "fp16.enabled");
  fails(R"({"zero_optimization": {"stage": 4}})", "stage 4");
  // offload_param below stage 3: ignored with a warning, as DeepSpeed 0.14.5 ignores it (issue 40).
  TrainConfig below3 = ParseConfig(nlohmann::json::parse(R"({"zero_optimization": {"stage": 2, "offload_param":
      {"device": "cpu"}}})"),
                                   "cfg.json");
  EXPECT_FALSE(below3.zero.offload_param_cpu);
  ASSERT_EQ(below3.warnings.size(), 1u);
  EXPECT_NE(below3.warnings[0].find("offload_param applies to stage 3 only"), std::string::npos) << below3.warnings[0];
  fails(R"({"optimizer": {"type": "SGD"}})", "SGD");
  fails(R"({"optimizer": {"params": {"betas": [0.9]}}})", "betas");
  fails(R"({"scheduler": {"type": "WarmupDecayLR", "params": {}}})", "total_num_steps");
  fails(R"({"train_micro_batch_size_per_gpu": "auto"})", "Hugging Face");
  fails(R"([1, 2])", "object");
  auto big = ParseConfig(nlohmann::json::parse(R"({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,
      "offload_optimizer": {"device": "cpu"}}})"),
                         "x");
  EXPECT_EQ(big.zero.reduce_bucket_size, 500000000);
  EXPECT_TRUE(big.zero.offload_optimizer_cpu);
}

// DeepSpeed 0.14.5's _configure_basic_optimizer, read for each combination:
// the type is lower-cased; effective adam_w_mode = (type == adamw) or
// adam_w_mode (default true); torch_adam picks torch.optim.AdamW or .Adam
// by it (AdamW's weight_decay defaults to 0.01), else FusedAdam or
// DeepSpeedCPUAdam with that adam_w_mode (weight_decay default 0).
TEST(Config, AdamModeFollowsDeepSpeedForEveryCombination) {
  struct Row {
    const char* type;
    const char* torch_adam;   // "" = not given
    const char* adam_w_mode;  // "" = not given
    bool decoupled;
    double default_weight_decay;
  };
  const Row rows[] = {
      {"Adam", "", "", true, 0.0},
      {"Adam", "", "true", true, 0.0},
      {"Adam", "", "false", false, 0.0},
      {"Adam", "false", "", true, 0.0},
      {"Adam", "false", "false", false, 0.0},
      {"Adam", "true", "", true, 0.01},
      {"Adam", "true", "true", true, 0.01},
      {"Adam", "true", "false", false, 0.0},
      {"adam", "true", "", true, 0.01},
      {"adam", "", "false", false, 0.0},
      {"ADAM", "true", "false", false, 0.0},
      {"AdamW", "", "", true, 0.0},
      {"AdamW", "", "false", true, 0.0},
      {"adamw", "true", "false", true, 0.01},
      {"ADAMW", "false", "false", true, 0.0},
      {"AdamW", "true", "", true, 0.01},
  };
  for (const Row& r : rows) {
    nlohmann::json params = nlohmann::json::object();
    if (*r.torch_adam) params["torch_adam"] = std::string(r.torch_adam) == "true";
    if (*r.adam_w_mode) params["adam_w_mode"] = std::string(r.adam_w_mode) == "true";
    const std::string what = std::string(r.type) + " torch_adam=" + r.torch_adam + " adam_w_mode=" + r.adam_w_mode;
    TrainConfig c = ParseConfig({{"optimizer", {{"type", r.type}, {"params", params}}}}, "x");
    EXPECT_EQ(c.optimizer.decoupled_weight_decay, r.decoupled) << what;
    EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, r.default_weight_decay) << what;
    EXPECT_TRUE(c.warnings.empty()) << what;
    params["weight_decay"] = 0.3;  // a given weight decay is kept in every mode
    c = ParseConfig({{"optimizer", {{"type", r.type}, {"params", params}}}}, "x");
    EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.3) << what;
    EXPECT_EQ(c.optimizer.decoupled_weight_decay, r.decoupled) << what;
  }
}

// Adam's keywords: honoured, or refused naming the key (as DeepSpeed's
// optimizer constructors refuse the other implementation's keywords).
TEST(Config, AdamKeywordsHonouredOrRefused) {
  auto adam = [](const char* params) {
    return ParseConfig(
        nlohmann::json::parse(std::string(R"({"optimizer": {"type": "Adam", "params": )") + params + "}}"), "cfg.json");
  };
  EXPECT_TRUE(adam("{}").optimizer.bias_correction);
  EXPECT_FALSE(adam(R"({"bias_correction": false})").optimizer.bias_correction);
  EXPECT_TRUE(adam(R"({"torch_adam": true, "foreach": true, "fused": false})").warnings.empty());
  EXPECT_TRUE(adam(R"({"set_grad_none": false})").warnings.empty());
  // What the checkpoint writes as DeepSpeed pickles it: listed betas stay a list, a whole clip an int.
  EXPECT_FALSE(adam("{}").optimizer.betas_given);
  EXPECT_TRUE(adam(R"({"betas": [0.8, 0.9]})").optimizer.betas_given);
  auto clip = [](const char* v) {
    return ParseConfig(nlohmann::json::parse(std::string(R"({"gradient_clipping": )") + v + "}"), "cfg.json");
  };
  EXPECT_TRUE(clip("1").gradient_clipping_integral);
  EXPECT_FALSE(clip("1.0").gradient_clipping_integral);
  EXPECT_FALSE(ParseConfig(nlohmann::json::object(), "cfg.json").gradient_clipping_integral);
  auto refused = [&](const char* params, const char* needle) {
    try {
      adam(params);
      ADD_FAILURE() << params;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused(R"({"bias_correction": false, "torch_adam": true})", "optimizer.params.bias_correction");
  refused(R"({"maximize": true, "torch_adam": true})", "optimizer.params.maximize");
  refused(R"({"capturable": true, "torch_adam": true})", "optimizer.params.capturable");
  refused(R"({"differentiable": true, "torch_adam": true})", "optimizer.params.differentiable");
  for (const char* key : {"maximize", "fused", "foreach", "capturable", "differentiable"})
    refused(("{\"" + std::string(key) + "\": false}").c_str(), (std::string("optimizer.params.") + key).c_str());
  refused(R"({"amsgrad": true})", "amsgrad");
  refused(R"({"max_grad_norm": 1.0})", "max_grad_norm");
  refused(R"({"fp32_optimizer_states": false})", "fp32_optimizer_states");
}

// The config-key audit: every DeepSpeed 0.14.5 key is honoured, refused
// naming it, or (logging and profiling only) warned about once.
TEST(Config, DeepSpeedKeysHonouredRefusedOrWarnedOnce) {
  auto parse = [](const std::string& text) { return ParseConfig(nlohmann::json::parse(text), "cfg.json"); };
  auto refused = [&](const std::string& text, const std::string& needle) {
    try {
      parse(text);
      ADD_FAILURE() << text;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // Honoured: the legacy cpu_offload booleans are their sections.
  EXPECT_TRUE(parse(R"({"zero_optimization": {"stage": 1, "cpu_offload": true}})").zero.offload_optimizer_cpu);
  EXPECT_FALSE(parse(R"({"zero_optimization": {"stage": 1, "cpu_offload": false}})").zero.offload_optimizer_cpu);
  EXPECT_TRUE(parse(R"({"zero_optimization": {"stage": 3, "cpu_offload_param": true}})").zero.offload_param_cpu);
  refused(R"({"zero_optimization": {"stage": 2, "cpu_offload": true, "offload_optimizer": {"device": "cpu"}}})",
          "zero_optimization.cpu_offload");
  // Refused at any value but DeepSpeed's default; accepted at the default.
  for (const char* key : {"sparse_gradients", "disable_allgather", "graph_harvesting"}) {
    refused(std::string("{\"") + key + "\": true}", key);
    EXPECT_TRUE(parse(std::string("{\"") + key + "\": false}").warnings.empty()) << key;
  }
  // DeepSpeed's gradient scaling keys: honoured at stage 0, warned about at stages 1-2 (DeepSpeed's
  // reduce_scatter averaging ignores them), refused at stage 3 and without reduce_scatter.
  EXPECT_TRUE(parse(R"({"prescale_gradients": true})").prescale_gradients);
  EXPECT_TRUE(parse(R"({"prescale_gradients": true})").warnings.empty());
  EXPECT_DOUBLE_EQ(parse(R"({"gradient_predivide_factor": 2.0})").gradient_predivide_factor, 2.0);
  EXPECT_EQ(parse(R"({"prescale_gradients": true, "zero_optimization": {"stage": 2}})").warnings.size(), 1u);
  refused(R"({"gradient_predivide_factor": 2.0, "zero_optimization": {"stage": 3}})", "gradient_predivide_factor");
  refused(R"({"prescale_gradients": true, "zero_optimization": {"stage": 2, "reduce_scatter": false}})",
          "reduce_scatter");
  refused(R"({"gradient_predivide_factor": 0})", "gradient_predivide_factor must be > 0");
  EXPECT_TRUE(parse(R"({"gradient_predivide_factor": 1.0})").warnings.empty());
  refused(R"({"communication_data_type": "fp16"})", "communication_data_type");
  EXPECT_TRUE(parse(R"({"fp16": {"enabled": true, "auto_cast": true}})").fp16.auto_cast);  // honoured in forward
  EXPECT_TRUE(parse(R"({"fp16": {"enabled": true, "auto_cast": false}})").fp16.enabled);
  refused(R"({"fp16": {"enabled": true, "fp16_master_weights_and_grads": true}})", "fp16_master_weights_and_grads");
  refused(R"({"bf16": {"enabled": true, "immediate_grad_update": true}})", "bf16.immediate_grad_update");
  // data_types.grad_accum_dtype (config_rules.cc): DeepSpeed's default and fp32 at stages 2-3 taken, the rest
  // refused naming the key, the value and the stage.
  EXPECT_EQ(parse(R"({"data_types": {"grad_accum_dtype": "float32"}})").grad_accum_dtype, "fp32");
  EXPECT_EQ(EffectiveGradAccumDtype(parse(R"({"bf16": {"enabled": true}})")), "fp32");  // stage 0: BF16_Optimizer
  EXPECT_EQ(EffectiveGradAccumDtype(parse(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}})")),
            "bf16");
  EXPECT_EQ(
      EffectiveGradAccumDtype(parse(
          R"({"fp16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 3}})")),
      "fp32");
  EXPECT_EQ(
      parse(
          R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "bf16"}, "zero_optimization": {"stage": 1}})")
          .grad_accum_dtype,
      "bf16");
  refused(R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "bf16"}})",
          "'data_types.grad_accum_dtype' = \"bf16\" with a bf16 model at ZeRO stage 0 is refused");
  refused(
      R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}})",
      "BF16_Optimizer");
  refused(
      R"({"fp16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}})",
      "unreduced");
  refused(
      R"({"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp16"}, "zero_optimization": {"stage": 3}})",
      "ZeRO stage 3");
  refused(R"({"data_types": {"grad_accum_dtype": "fp8"}})", "\"fp8\" is not a dtype");
  refused(R"({"amp": {"enabled": true}})", "amp");
  EXPECT_TRUE(parse(R"({"amp": {"enabled": false}, "elasticity": {"enabled": false}})").warnings.empty());
  // sparse_attention is parsed only (scripts build DeepSpeed's sparse attention from it; uckpt refuses those
  // modules): accepted without a warning, its mode checked as DeepSpeed 0.14.5 checks it.
  EXPECT_TRUE(parse(R"({"sparse_attention": {"mode": "variable", "block": 16, "local_window_blocks": [4],
                        "global_block_indices": [0], "attention": "unidirectional"}})")
                  .warnings.empty());
  EXPECT_TRUE(parse(R"({"sparse_attention": {}})").warnings.empty());
  refused(R"({"sparse_attention": {"mode": "sliding"}})", "sparse_attention.mode");
  // DeepSpeed's other config optimizers (bing_bert's Lamb): refused saying it is uckpt that lacks them.
  refused(R"({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})",
          "optimizer.type 'Lamb' is not supported by uckpt");
  refused(R"({"sparse_attention": {"mode": 3}})", "sparse_attention.mode");
  refused(R"({"sparse_attention": {"mode": null}})", "sparse_attention.mode");
  refused(R"({"zero_optimization": {"stage": 2, "zero_quantized_gradients": true}})",
          "zero_optimization.zero_quantized_gradients");
  refused(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})",
          "zero_optimization.offload_optimizer.ratio");
  refused(R"({"zero_optimization": {"stage": 1, "load_from_fp32_weights": false}})", "load_from_fp32_weights");
  refused(R"({"checkpoint": {"use_node_local_storage": true}})", "checkpoint.use_node_local_storage");
  // DeepSpeed's zero_optimization refuses keys it does not define; so does uckpt.
  refused(R"({"zero_optimization": {"stage": 2, "overlap_com": true}})", "zero_optimization.overlap_com");
  refused(R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pinned": true}}})",
          "zero_optimization.offload_optimizer.pinned");
  // Logging and profiling: one warning per key when on, none when off.
  TrainConfig monitors = parse(R"({"tensorboard": {"enabled": true, "output_path": "tb"}, "wandb": {"enabled": true},
      "csv_monitor": {"enabled": true}, "comet": {"enabled": true}, "flops_profiler": {"enabled": true},
      "comms_logger": {"enabled": true}, "wall_clock_breakdown": true, "memory_breakdown": true})");
  ASSERT_EQ(monitors.warnings.size(), 8u);
  for (const char* key : {"tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger",
                          "wall_clock_breakdown", "memory_breakdown"}) {
    int n = 0;
    for (const auto& w : monitors.warnings) n += w.find("'" + std::string(key) + "'") != std::string::npos;
    EXPECT_EQ(n, 1) << key;
  }
  EXPECT_TRUE(parse(R"({"tensorboard": {"enabled": false}, "wandb": {"project": "x"}, "wall_clock_breakdown": false,
      "flops_profiler": {"enabled": false}, "comms_logger": {"enabled": false}})")
                  .warnings.empty());
}

// DeepSpeed 0.14.5's ZeRO optimizers: get_dynamic_loss_scale_args gives None unless
// the fp16 section writes one of five keys, and CreateLossScaler then builds
// DynamicLossScaler() (2^32, delayed_shift 1, window 1000, minimum 1); once one is
// written, the rest take the config's defaults (2^16, hysteresis 2, ...).
TEST(Config, Fp16LossScalerStartsAsDeepSpeedsZeroOptimizers) {
  auto scaler = [](const std::string& fp16) {
    return LossScaler::FromConfig(ParseConfig(nlohmann::json::parse(R"({"fp16": )" + fp16 + "}"), "cfg.json").fp16);
  };
  for (const char* none : {R"({"enabled": true})", R"({"enabled": true, "loss_scale": 0})"}) {
    const LossScaler s = scaler(none);
    EXPECT_TRUE(s.dynamic) << none;
    EXPECT_EQ(s.cur_scale, 4294967296.0) << none;
    EXPECT_EQ(s.delayed_shift, 1) << none;
    EXPECT_EQ(s.cur_hysteresis, 1) << none;
    EXPECT_EQ(s.scale_window, 1000) << none;
    EXPECT_EQ(s.min_scale, 1.0) << none;
  }
  for (const char* key : {"initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis"}) {
    const std::string value = std::string(key) == "initial_scale_power" ? "16"
                              : std::string(key) == "hysteresis"        ? "2"
                              : std::string(key) == "loss_scale_window" ? "1000"
                                                                        : "1";
    const LossScaler s = scaler(std::string(R"({"enabled": true, ")") + key + "\": " + value + "}");
    EXPECT_EQ(s.cur_scale, 65536.0) << key;
    EXPECT_EQ(s.delayed_shift, 2) << key;
    EXPECT_EQ(s.scale_window, 1000) << key;
  }
  const LossScaler c = scaler(R"({"enabled": true, "consecutive_hysteresis": false})");
  EXPECT_EQ(c.cur_scale, 65536.0);
  EXPECT_EQ(c.delayed_shift, 2);
  const LossScaler w =
      scaler(R"({"enabled": true, "initial_scale_power": 12, "hysteresis": 3, "loss_scale_window": 50})");
  EXPECT_EQ(w.cur_scale, 4096.0);
  EXPECT_EQ(w.delayed_shift, 3);
  EXPECT_EQ(w.scale_window, 50);
  EXPECT_FALSE(scaler(R"({"enabled": true, "loss_scale": 128})").dynamic);
  // Without hysteresis the first overflow halves the scale.
  LossScaler d = scaler(R"({"enabled": true})");
  d.Update(/*overflow=*/true);
  EXPECT_EQ(d.cur_scale, 2147483648.0);
}

// ZeRO stage 0 in fp16: DeepSpeed 0.14.5's FP16_Optimizer (fused) and
// FP16_UnfusedOptimizer keep their own scale: their starting values, no
// hysteresis, growth once scale_window clean steps follow the step after the
// last overflow (cur_iter - last_overflow_iter - 1), the minimum, and the
// Python number types their checkpoints pickle.
TEST(Config, Fp16OptimizerLossScaleAtStage0) {
  auto fp16 = [](const std::string& section) {
    return ParseConfig(nlohmann::json::parse(R"({"fp16": )" + section + "}"), "cfg.json").fp16;
  };
  const LossScaler fused = LossScaler::ForFp16Optimizer(fp16(R"({"enabled": true})"), true);
  EXPECT_TRUE(fused.dynamic);
  EXPECT_EQ(fused.cur_scale, 65536.0);  // initial_dynamic_scale: 2**16, not ZeRO's 2**32
  EXPECT_TRUE(fused.integral_scale);
  EXPECT_EQ(fused.min_scale, 1.0);
  const LossScaler unfused = LossScaler::ForFp16Optimizer(fp16(R"({"enabled": true})"), false);
  EXPECT_EQ(unfused.cur_scale, 65536.0);
  EXPECT_FALSE(unfused.integral_scale);  // 1.0 * 2**16
  EXPECT_EQ(unfused.min_scale, 0.25);
  EXPECT_FALSE(unfused.integral_factor);

  // Window 2, hysteresis 2 (ignored): overflow at iteration 0 halves at once.
  LossScaler s = LossScaler::ForFp16Optimizer(
      fp16(
          R"({"enabled": true, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 2, "min_loss_scale": 4})"),
      true);
  EXPECT_EQ(s.cur_scale, 16.0);
  s.Update(true);  // iter 0
  EXPECT_EQ(s.cur_scale, 8.0);
  EXPECT_FALSE(s.integral_scale);  // 16 / 2 is a float
  EXPECT_EQ(s.last_overflow_iter, 0);
  s.Update(false);  // iter 1: stable 0
  s.Update(false);  // iter 2: stable 1
  EXPECT_EQ(s.cur_scale, 8.0);
  s.Update(false);  // iter 3: stable 2: doubles (DynamicLossScaler would have at iter 2)
  EXPECT_EQ(s.cur_scale, 16.0);
  s.Update(true);
  s.Update(true);
  s.Update(true);  // 8, then the minimum 4 (an int, as the config's)
  EXPECT_EQ(s.cur_scale, 4.0);
  EXPECT_TRUE(s.integral_scale);
  EXPECT_EQ(s.cur_iter, 7);

  // From the start (last_overflow_iter -1): the first growth at iteration `window`.
  LossScaler g = LossScaler::ForFp16Optimizer(fp16(R"({"enabled": true, "loss_scale_window": 3})"), false);
  for (int i = 0; i < 3; ++i) g.Update(false);
  EXPECT_EQ(g.cur_scale, 65536.0);
  g.Update(false);
  EXPECT_EQ(g.cur_scale, 131072.0);

  // Static: the scale stays, the iterations are counted.
  LossScaler st = LossScaler::ForFp16Optimizer(fp16(R"({"enabled": true, "loss_scale": 128})"), false);
  EXPECT_FALSE(st.dynamic);
  EXPECT_TRUE(st.integral_scale);
  st.Update(true);
  EXPECT_EQ(st.cur_scale, 128.0);
  EXPECT_EQ(st.cur_iter, 1);
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
