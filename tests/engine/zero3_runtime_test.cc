// ZeRO stage 3 against the fixture's real DeepSpeed stage-3 runs
// (shared/fixtures/refrun-gpt2/ZERO3.md), and stage 3's own properties.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include <unistd.h>

#include "ckpt/convert.h"
#include "ckpt/export.h"
#include "ckpt/verify.h"
#include "cli/init_weights.h"
#include "cli/trainer.h"
#include "engine/zero3_runtime.h"
#include "fixture.h"
#include "format/torch_file.h"
#include "ranks.h"
#include "uckpt/engine.h"

namespace uckpt::engine {
namespace {

using cli::LoadStateDictFile;
using cli::StepMetrics;
using cli::Trainer;
using cli::TrainOptions;

using testing::ReadJson;
using testing::RefrunDir;
using testing::RunRanks;

nlohmann::json Z3Config(const std::string& run, const nlohmann::json& zero_extra = nlohmann::json::object()) {
  nlohmann::json ds = testing::RefrunDsConfig(run);
  for (auto& [k, v] : zero_extra.items()) ds["zero_optimization"][k] = v;
  return ds;
}

struct Z3Run {
  std::map<int64_t, StepMetrics> steps;
  std::vector<models::NamedTensor> final_weights;  // rank 0's, gathered
};

// Trains `ds` at `world` ranks to step 12 (from `load_dir` when given); one
// intra-op thread per rank, as DeepSpeed ran.
Z3Run Train(const nlohmann::json& ds, int world, const std::string& load_dir = "", bool universal = false,
            const std::string& save_dir = "", int save_at = 0) {
  Z3Run out;
  std::mutex mu;
  RunRanks(world, [&](Comm& comm) {
    at::set_num_threads(1);
    Trainer t(comm, testing::RefrunOptions(ds, "z3"));
    if (!load_dir.empty()) t.LoadCheckpoint(load_dir, "", universal);
    while (t.counters().global_steps < 12) {
      StepMetrics m = t.TrainStep();
      if (comm.rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        out.steps[m.step] = m;
      }
      if (!save_dir.empty() && t.counters().global_steps == save_at) t.SaveCheckpoint(save_dir, "");
    }
    t.engine().GatherParameters();
    if (comm.rank() == 0)
      for (const auto& p : t.parameters()) out.final_weights.push_back({p.name, p.tensor.detach().clone()});
    t.engine().ReleaseParameters();
  });
  return out;
}

// Every loss within 1e-6 relative of `run`'s (bitwise: equal); returns the
// worst relative difference.
double CompareLosses(const Z3Run& r, const std::string& run, bool bitwise) {
  auto ref = ReadJson(RefrunDir() + "/runs/" + run + "/losses.json")["steps"];
  double worst = 0;
  for (const auto& [step, m] : r.steps) {
    const auto& s = ref[std::to_string(step)];
    const double want = s["loss"].get<double>();
    EXPECT_NEAR(m.loss, want, 1e-6 * want) << run << " step " << step;
    if (bitwise) {
      EXPECT_EQ(m.loss, want) << run << " step " << step;
    }
    worst = std::max(worst, std::fabs(m.loss - want) / want);
  }
  return worst;
}

double FinalWeightDiff(const Z3Run& r, const std::string& run) {
  double worst = 0;
  size_t matched = 0;
  for (const auto& ref : LoadStateDictFile(RefrunDir() + "/runs/" + run + "/final_model.pt"))
    for (const auto& p : r.final_weights)
      if (p.name == ref.name) {
        worst = std::max(worst, (p.tensor - ref.tensor).abs().max().item<double>());
        ++matched;
      }
  EXPECT_GT(matched, 0u) << run;
  return worst;
}

// DeepSpeed's stage-3 baseline equals its stage-2 baseline bit for bit; ours
// equals both: at world size 2 each element's sum has two terms.
TEST(Zero3, BaselineAtWorldSize2EqualsDeepSpeedBitwise) {
  Z3Run r = Train(Z3Config("z3_ws2_baseline"), 2);
  ASSERT_EQ(r.steps.size(), 12u);
  const double worst = CompareLosses(r, "z3_ws2_baseline", true);
  auto ref = ReadJson(RefrunDir() + "/runs/z3_ws2_baseline/losses.json")["steps"];
  for (const auto& [step, m] : r.steps)
    EXPECT_EQ(static_cast<float>(m.grad_norm), ref[std::to_string(step)]["grad_norm"].get<float>()) << "step " << step;
  const double wdiff = FinalWeightDiff(r, "z3_ws2_baseline");
  EXPECT_EQ(wdiff, 0.0);
  std::cout << "[ measured ] z3_ws2_baseline: max rel loss diff " << worst << ", final weight diff " << wdiff << "\n";
}

// Threshold 0: every block parameter is gathered and freed per unit (the
// fixture's parameters are all below DeepSpeed's default threshold of 1e5,
// which keeps them whole); small buckets and sub-groups change no number at ws 2.
TEST(Zero3, GatherPerUnitSmallBucketsAndSubGroupsSameLosses) {
  Z3Run r = Train(
      Z3Config("z3_ws2_baseline",
               {{"stage3_param_persistence_threshold", 0}, {"reduce_bucket_size", 300}, {"sub_group_size", 1000}}),
      2);
  ASSERT_EQ(r.steps.size(), 12u);
  CompareLosses(r, "z3_ws2_baseline", true);
  EXPECT_EQ(FinalWeightDiff(r, "z3_ws2_baseline"), 0.0);
}

// Between steps a unit's parameters hold no bytes; the root's (the tied
// embedding, used before and after the blocks) and GatherParameters' do.
TEST(Zero3, UnitParametersAreFreedOutsideTheirUnit) {
  RunRanks(2, [&](Comm& comm) {
    Trainer t(comm,
              testing::RefrunOptions(Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 0}}), "z3"));
    t.TrainStep();
    auto bytes = [&](const std::string& name) {
      for (const auto& p : t.parameters())
        if (p.name == name) return p.tensor.storage().nbytes();
      throw std::runtime_error("no parameter " + name);
    };
    EXPECT_EQ(t.engine().settings().num_gather_units(), 2u);
    EXPECT_EQ(bytes("transformer.h.0.attn.c_attn.weight"), 0u);
    EXPECT_EQ(bytes("transformer.h.1.mlp.c_fc.weight"), 0u);
    EXPECT_EQ(bytes("transformer.wte.weight"), 97u * 16 * 4);
    t.engine().GatherParameters();
    EXPECT_EQ(bytes("transformer.h.0.attn.c_attn.weight"), 16u * 48 * 4);
    t.engine().ReleaseParameters();
    EXPECT_EQ(bytes("transformer.h.0.attn.c_attn.weight"), 0u);
  });
}

TEST(Zero3, WorldSize4And1WithinToleranceOfTheBaseline) {
  for (int world : {4, 1}) {
    nlohmann::json ds = Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 0}});
    ds["train_micro_batch_size_per_gpu"] = 8 / world;
    ds["gradient_accumulation_steps"] = 1;
    Z3Run r = Train(ds, world);
    ASSERT_EQ(r.steps.size(), 12u);
    const double worst = CompareLosses(r, "z3_ws2_baseline", false);
    std::cout << "[ measured ] stage 3 at world size " << world << " vs z3_ws2_baseline: max rel loss diff " << worst
              << "\n";
  }
}

TEST(Zero3, OffloadOnAndOffSameLosses) {
  Z3Run off = Train(Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 0}}), 2);
  Z3Run on = Train(Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 0},
                                                {"offload_param", {{"device", "cpu"}, {"pin_memory", true}}},
                                                {"offload_optimizer", {{"device", "cpu"}, {"pin_memory", true}}}}),
                   2);
  ASSERT_EQ(on.steps.size(), 12u);
  for (const auto& [step, m] : on.steps) EXPECT_NEAR(m.loss, off.steps.at(step).loss, 1e-6 * m.loss) << step;
}

// bf16: under offload_optimizer the host gradient is a bf16 (grad_accum_dtype)
// accumulation buffer, which each step must leave zeroed: the losses and norms
// are those of the run without offload (a buffer left full adds the last
// step's gradients into the next).
TEST(Zero3, Bf16OffloadOnAndOffSameLosses) {
  // The same global batch of 8: GA 2 at 2 ranks, 1 at 4. The fused host Adam may differ from
  // torch's AdamW in an element's last bit (docs/engine.md), which bf16 grows by step 10 at 4 ranks
  // to 2e-5 of the norm: 1e-4 there, still far below a buffer left full (0.3-0.7 from step 2).
  for (auto [world, tol] : {std::pair{2, 1e-6}, std::pair{4, 1e-4}}) {
    nlohmann::json ds = Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 0}});
    ds["bf16"] = {{"enabled", true}};
    ds["gradient_accumulation_steps"] = 4 / world;
    Z3Run off = Train(ds, world);
    ds["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
    Z3Run on = Train(ds, world);
    ASSERT_EQ(on.steps.size(), 12u) << world;
    for (const auto& [step, m] : on.steps) {
      EXPECT_NEAR(m.loss, off.steps.at(step).loss, tol * m.loss) << world << " ranks, step " << step;
      EXPECT_NEAR(m.grad_norm, off.steps.at(step).grad_norm, tol * m.grad_norm) << world << " ranks, step " << step;
    }
  }
}

TEST(Zero3, Bf16TrainsAndUnitsMatchTheRootOnlyRun) {
  // bf16 with units gathered and freed against bf16 with everything in the
  // root unit: the same arithmetic, so the same losses.
  nlohmann::json ds = Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 0}});
  ds["bf16"] = {{"enabled", true}};
  Z3Run units = Train(ds, 2);
  ds["zero_optimization"]["stage3_param_persistence_threshold"] = 1000000;
  Z3Run root = Train(ds, 2);
  ASSERT_EQ(units.steps.size(), 12u);
  for (const auto& [step, m] : units.steps) {
    EXPECT_TRUE(std::isfinite(m.loss));
    EXPECT_EQ(m.loss, root.steps.at(step).loss) << step;
  }
}

// DeepSpeed's own ZeRO-3 files, resumed at the same size: its resumed run's losses.
TEST(Zero3, ResumeDeepSpeedZero3CheckpointAtWorldSize2Bitwise) {
  Z3Run r = Train(Z3Config("z3_zero_ws2_resume"), 2, RefrunDir() + "/ckpt_zero3");
  ASSERT_EQ(r.steps.size(), 6u);
  EXPECT_EQ(r.steps.begin()->first, 7);
  const double worst = CompareLosses(r, "z3_zero_ws2_resume", true);
  EXPECT_EQ(FinalWeightDiff(r, "z3_zero_ws2_resume"), 0.0);
  std::cout << "[ measured ] z3_zero_ws2_resume: max rel loss diff " << worst << "\n";
}

// DeepSpeed's universal conversion of its ZeRO-3 checkpoint at 4 and 1 ranks.
TEST(Zero3, ResumeDeepSpeedZero3UniversalAtWorldSizes4And1) {
  for (int world : {4, 1}) {
    const std::string run = "z3_univ_ws" + std::to_string(world) + "_resume";
    Z3Run r = Train(Z3Config(run), world, RefrunDir() + "/ckpt_zero3", /*universal=*/true);
    ASSERT_EQ(r.steps.size(), 6u) << run;
    EXPECT_EQ(r.steps.begin()->first, 7);
    const double worst = CompareLosses(r, run, false);
    std::cout << "[ measured ] " << run << ": max rel loss diff " << worst << ", final weight diff "
              << FinalWeightDiff(r, run) << "\n";
  }
}

// Our stage-3 checkpoint: DeepSpeed's files and keys (the fixture's as
// reference), and a same-size resume continues bit for bit.
TEST(Zero3, SaveInDeepSpeedLayoutAndResumeBitwise) {
  const std::string dir = ::testing::TempDir() + "/z3_save";
  std::filesystem::remove_all(dir);
  Z3Run whole = Train(Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 0}}), 2, "", false, dir, 6);
  for (int r = 0; r < 2; ++r)
    for (const char* kind : {"model", "optim"}) {
      const std::string name = "zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_" + kind + "_states.pt";
      TorchFile ours = LoadTorchFile(dir + "/global_step6/" + name);
      TorchFile theirs = LoadTorchFile(RefrunDir() + "/ckpt_zero3/global_step6/" + name);
      std::vector<std::string> ours_keys, theirs_keys;
      for (const auto& [k, v] : ours.root->entries) ours_keys.push_back(k->s);
      for (const auto& [k, v] : theirs.root->entries) theirs_keys.push_back(k->s);
      ours_keys.erase(std::remove(ours_keys.begin(), ours_keys.end(), "uckpt"), ours_keys.end());
      EXPECT_EQ(ours_keys, theirs_keys) << name;
      if (std::string(kind) == "optim") {
        auto shape = [](const TorchFile& f) {
          return f.root->get("optimizer_state_dict")->get("fp32_flat_groups")->items.at(0)->tensor->shape;
        };
        EXPECT_EQ(shape(ours), shape(theirs)) << name;
      }
    }
  Z3Run resumed = Train(Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 0}}), 2, dir);
  ASSERT_EQ(resumed.steps.size(), 6u);
  for (const auto& [step, m] : resumed.steps) EXPECT_EQ(m.loss, whole.steps.at(step).loss) << step;
}

// Stage switches through the universal layout (DeepSpeed 0.14.5 cannot do
// them; the reference is the uninterrupted run): DeepSpeed's ZeRO-2
// universal checkpoint resumed at stage 3, its ZeRO-3 one at stage 2, at 4 ranks.
TEST(Zero3, StageSwitchesThroughUniversalContinueTheRun) {
  nlohmann::json z3 = Z3Config("z3_univ_ws4_resume");
  Z3Run up = Train(z3, 4, RefrunDir() + "/ckpt", /*universal=*/true);
  ASSERT_EQ(up.steps.size(), 6u);
  const double worst_up = CompareLosses(up, "z2_univ_ws4_resume", false);
  nlohmann::json z2 = z3;
  z2["zero_optimization"]["stage"] = 2;
  Z3Run down = Train(z2, 4, RefrunDir() + "/ckpt_zero3", /*universal=*/true);
  ASSERT_EQ(down.steps.size(), 6u);
  const double worst_down = CompareLosses(down, "z3_univ_ws4_resume", false);
  std::cout << "[ measured ] stage 2 -> 3 at ws4: max rel loss diff " << worst_up
            << "; stage 3 -> 2 at ws4: " << worst_down << "\n";
}

// Ours end to end: a stage-3 checkpoint at 2 ranks passes verify, converts
// with uckpt convert, exports, and resumes at stage 2 on 4 ranks and at
// stage 3 on 1 rank, continuing the uninterrupted run.
TEST(Zero3, OwnCheckpointConvertsVerifiesExportsAndSwitchesStage) {
  const std::string dir = ::testing::TempDir() + "/z3_convert";
  std::filesystem::remove_all(dir);
  Z3Run whole = Train(Z3Config("z3_ws2_baseline"), 2, "", false, dir, 6);
  EXPECT_TRUE(ckpt::VerifyCheckpoint(dir).ok());
  ckpt::ConvertOptions co;
  co.durable = false;
  ckpt::ConvertToUniversal(dir + "/global_step6", dir + "/global_step6_universal", co);
  { std::ofstream(dir + "/latest_universal") << "global_step6_universal"; }
  EXPECT_TRUE(ckpt::VerifyCheckpoint(dir + "/global_step6_universal").ok());
  ckpt::ExportSafetensors(dir + "/global_step6", dir + "/model.safetensors");
  EXPECT_GT(std::filesystem::file_size(dir + "/model.safetensors"), 97u * 16 * 4);
  nlohmann::json z2 = Z3Config("z3_univ_ws4_resume");
  z2["zero_optimization"]["stage"] = 2;
  Z3Run down = Train(z2, 4, dir, /*universal=*/true);
  nlohmann::json z3 = Z3Config("z3_univ_ws1_resume", {{"stage3_param_persistence_threshold", 0}});
  Z3Run one = Train(z3, 1, dir, /*universal=*/true);
  for (const Z3Run* r : {&down, &one}) {
    ASSERT_EQ(r->steps.size(), 6u);
    for (const auto& [step, m] : r->steps) {
      const double want = whole.steps.at(step).loss;
      EXPECT_NEAR(m.loss, want, 1e-6 * want) << step;
    }
  }
}

TEST(Zero3, Bf16SaveAndResumeBitwise) {
  const std::string dir = ::testing::TempDir() + "/z3_bf16";
  std::filesystem::remove_all(dir);
  nlohmann::json ds = Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 0}});
  ds["bf16"] = {{"enabled", true}};
  Z3Run whole = Train(ds, 2, "", false, dir, 6);
  Z3Run resumed = Train(ds, 2, dir);
  ASSERT_EQ(resumed.steps.size(), 6u);
  for (const auto& [step, m] : resumed.steps) EXPECT_EQ(m.loss, whole.steps.at(step).loss) << step;
  for (size_t i = 0; i < whole.final_weights.size(); ++i)
    EXPECT_TRUE(at::equal(whole.final_weights[i].tensor, resumed.final_weights[i].tensor))
        << whole.final_weights[i].name;
}

// Any module through the public API: two units sharing a tied tensor (so it
// joins the root unit) plus a root parameter; stage 3 with every unit
// gathered and freed gives stage 2's losses (GA 2, 2 ranks).
struct TwoUnitNet : torch::nn::Module {
  std::shared_ptr<torch::nn::Module> u0, u1;
  at::Tensor w0, w1, tied, head;
  TwoUnitNet() {
    // A generator of its own: the rank threads would race on the global one.
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
    u0 = register_module("u0", std::make_shared<torch::nn::Module>());
    u1 = register_module("u1", std::make_shared<torch::nn::Module>());
    w0 = u0->register_parameter("w", at::randn({8, 8}, gen) * 0.3);
    w1 = u1->register_parameter("w", at::randn({8, 8}, gen) * 0.3);
    tied = u0->register_parameter("scale", at::randn({8}, gen));
    u1->register_parameter("scale", tied);
    head = register_parameter("head", at::randn({8, 3}, gen));
  }
  at::Tensor Loss(const at::Tensor& x_in, const uckpt::UnitCalls& c) {
    at::Tensor x = c.Enter(0, x_in);
    x = at::tanh(x.mm(w0) * tied);
    x = c.Exit(0, x);
    x = c.Enter(1, x);
    x = at::tanh(x.mm(w1) + tied);
    x = c.Exit(1, x);
    return x.mm(head).pow(2).mean();
  }
};

struct TwoUnitRun {
  std::vector<double> losses;                 // rank 0's, per step
  std::map<std::string, at::Tensor> loaded;   // rank 0's weights right after the load, gathered
  std::map<std::string, at::Tensor> weights;  // rank 0's final weights, gathered
  int64_t steps_after_load = -1;
  ClientState client_state;
};

std::map<std::string, at::Tensor> GatheredWeights(uckpt::Engine& engine, torch::nn::Module& net) {
  std::map<std::string, at::Tensor> out;
  engine.GatherParameters();
  for (const auto& p : net.named_parameters()) out[p.key()] = p.value().detach().clone();
  engine.ReleaseParameters();
  return out;
}

// Trains TwoUnitNet at `world` ranks for `steps` optimizer steps (GA 2);
// first loads `load_dir` with `load` when given; saves into `save_dir` at the
// end when given.
// from_partitions: every parameter arrives partitioned (EngineOptions::
// partitioned, each rank's slot of the whole value; the tensors emptied).
TwoUnitRun RunTwoUnitNet(int stage, int world, int steps, const std::string& save_dir = "",
                         const std::string& load_dir = "", const LoadCheckpointOptions& load = {},
                         bool from_partitions = false) {
  TwoUnitRun out;
  RunRanks(world, [&](Comm& comm) {
    at::set_num_threads(1);
    auto net = std::make_shared<TwoUnitNet>();
    nlohmann::json ds = {{"train_micro_batch_size_per_gpu", 4},
                         {"gradient_accumulation_steps", 2},
                         {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}, {"weight_decay", 0.1}}}}},
                         {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}};
    uckpt::EngineOptions o;
    o.comm = std::shared_ptr<Comm>(&comm, [](Comm*) {});
    o.gather_units = {net->u0, net->u1};
    if (from_partitions) {
      std::set<const void*> seen;  // the tied tensor is listed twice
      for (const at::Tensor& p : net->parameters())
        if (seen.insert(p.unsafeGetTensorImpl()).second)
          o.partitioned.push_back({p, p.sizes().vec(), uckpt::engine::RankSlot(p, world, comm.rank())});
      for (const auto& p : o.partitioned) p.param.set_data(at::empty({0}));  // nothing whole left to read
    }
    uckpt::Engine engine(net, uckpt::Config::FromJson(ds), o);
    if (stage == 3) {
      EXPECT_EQ(engine.settings().num_gather_units(), 2u);
    }
    if (from_partitions) {  // the units start sharded; the root (head, the tied scale) is whole
      EXPECT_EQ(net->w0.storage().nbytes(), 0u);
      EXPECT_EQ(net->w1.storage().nbytes(), 0u);
      EXPECT_TRUE(at::equal(net->head, TwoUnitNet().head));
    }
    if (!load_dir.empty()) {
      LoadResult r = engine.LoadCheckpoint(load_dir, "", load);
      auto loaded = GatheredWeights(engine, *net);
      if (comm.rank() == 0) {
        out.loaded = std::move(loaded);
        out.steps_after_load = engine.stats().global_steps();
        out.client_state = r.client_state;
      }
    }
    const uckpt::UnitCalls calls = engine.unit_calls();
    for (int step = 0; step < steps; ++step) {
      double total = 0;
      for (int m = 0; m < 2; ++m) {
        at::Tensor x = at::sin(at::arange(32, at::kFloat).view({4, 8}) * (1 + step + 3 * m + 7 * comm.rank()));
        at::Tensor loss = net->Loss(x, calls);
        total += loss.item<double>();
        engine.Backward(loss);
        engine.Step();
      }
      if (comm.rank() == 0) out.losses.push_back(total);
    }
    if (!save_dir.empty()) {
      c10::impl::GenericDict client(c10::StringType::get(), c10::AnyType::get());
      client.insert("epoch", int64_t{3});
      engine.SaveCheckpoint(save_dir, "", client);
    }
    auto weights = GatheredWeights(engine, *net);
    if (comm.rank() == 0) out.weights = std::move(weights);
  });
  return out;
}

// Parameters that arrive partitioned (zero.Init's construction): the same
// losses, bit for bit, as the whole build; the units never gathered whole
// before their first forward. Refused at stage 2.
TEST(Zero3, ConstructionFromPartitionsEqualsTheWholeBuildBitwise) {
  const TwoUnitRun whole = RunTwoUnitNet(3, 2, 3), parts = RunTwoUnitNet(3, 2, 3, "", "", {}, true);
  ASSERT_EQ(parts.losses.size(), 3u);
  EXPECT_EQ(parts.losses, whole.losses);
  for (const auto& [name, w] : whole.weights) EXPECT_TRUE(at::equal(parts.weights.at(name), w)) << name;
  EXPECT_THROW(
      {
        try {
          RunTwoUnitNet(2, 1, 1, "", "", {}, true);
        } catch (const std::invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("stage 3"), std::string::npos) << e.what();
          throw;
        }
      },
      std::invalid_argument);
}

TEST(Zero3, AnyModuleThroughThePublicApiMatchesStage2) {
  const std::vector<double> z2 = RunTwoUnitNet(2, 2, 5).losses, z3 = RunTwoUnitNet(3, 2, 5).losses;
  ASSERT_EQ(z3.size(), 5u);
  for (size_t i = 0; i < z2.size(); ++i) EXPECT_NEAR(z3[i], z2[i], 1e-6 * std::fabs(z2[i])) << i;
  EXPECT_NE(z3.front(), z3.back());  // it trains
}

// load_module_only at stage 3 (as DeepSpeed's): the weights of a checkpoint
// of stage 2 or 3 saved at 2 ranks, from its ZeRO files or its universal
// conversion, loaded at 3 ranks; counters, Adam's state and the schedule are
// not loaded, so training on gives what stage 2 gives from the same load.
TEST(Zero3, LoadModuleOnlyTakesTheWeightsOfAnyStage) {
  const std::string root = ::testing::TempDir() + "/z3_module_only";
  std::filesystem::remove_all(root);
  for (int source_stage : {2, 3}) {
    const std::string dir = root + "/stage" + std::to_string(source_stage);
    const TwoUnitRun saved = RunTwoUnitNet(source_stage, 2, 3, dir);
    ckpt::ConvertOptions co;
    co.durable = false;
    ckpt::ConvertToUniversal(dir + "/global_step3", dir + "/global_step3_universal", co);
    { std::ofstream(dir + "/latest_universal") << "global_step3_universal"; }
    for (bool universal : {false, true}) {
      SCOPED_TRACE("source stage " + std::to_string(source_stage) + (universal ? ", universal" : ", ZeRO files"));
      LoadCheckpointOptions lo;
      lo.load_module_only = true;
      lo.universal = universal;
      const TwoUnitRun z3 = RunTwoUnitNet(3, 3, 2, "", dir, lo), z2 = RunTwoUnitNet(2, 3, 2, "", dir, lo);
      ASSERT_EQ(z3.loaded.size(), saved.weights.size());
      for (const auto& [name, w] : saved.weights) {
        EXPECT_TRUE(at::equal(z3.loaded.at(name), w)) << name;
        EXPECT_TRUE(at::equal(z2.loaded.at(name), w)) << name;
      }
      EXPECT_EQ(z3.steps_after_load, 0);
      EXPECT_EQ(z3.client_state.toGenericDict().at("epoch").toInt(), 3);
      ASSERT_EQ(z3.losses.size(), 2u);
      for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(z3.losses[i], z2.losses[i], 1e-6 * std::fabs(z2.losses[i])) << i;
    }
  }
}

// The model of tests/engine/fixtures/ds_z3_frozen (make_ds_z3_frozen.py):
// real DeepSpeed's ZeRO-3 at 2 ranks, whose frozen emb.weight it saved
// partitioned (an empty module entry, one slot per rank's model states).
struct FrozenNet : torch::nn::Module {
  at::Tensor emb, w1, b1, w2;  // emb.weight (frozen), fc1.weight, fc1.bias, fc2.weight
  FrozenNet() {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
    emb = register_module("emb", std::make_shared<torch::nn::Module>())
              ->register_parameter("weight", at::randn({13, 6}, gen), /*requires_grad=*/false);
    auto fc1 = register_module("fc1", std::make_shared<torch::nn::Module>());
    w1 = fc1->register_parameter("weight", at::randn({5, 6}, gen));
    b1 = fc1->register_parameter("bias", at::randn({5}, gen));
    w2 = register_module("fc2", std::make_shared<torch::nn::Module>())
             ->register_parameter("weight", at::randn({3, 5}, gen));
  }
  at::Tensor Loss(const at::Tensor& ids) {
    return at::tanh(at::embedding(emb, ids).matmul(w1.t()) + b1).matmul(w2.t()).pow(2).mean();
  }
};

// Loads `dir` into FrozenNet at `stage` and `world` ranks; returns rank 0's
// weights after the load; trains one step; saves into `save_dir` when given.
std::map<std::string, at::Tensor> LoadFrozenNet(int stage, int world, const std::string& dir, bool universal,
                                                const std::string& save_dir = "") {
  std::map<std::string, at::Tensor> out;
  RunRanks(world, [&](Comm& comm) {
    at::set_num_threads(1);
    auto net = std::make_shared<FrozenNet>();
    nlohmann::json ds = {{"train_micro_batch_size_per_gpu", 2},
                         {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.05}, {"weight_decay", 0.01}}}}},
                         {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}};
    uckpt::EngineOptions o;
    o.comm = std::shared_ptr<Comm>(&comm, [](Comm*) {});
    uckpt::Engine engine(net, uckpt::Config::FromJson(ds), o);
    LoadCheckpointOptions lo;
    lo.universal = universal;
    engine.LoadCheckpoint(dir, "", lo);
    auto loaded = GatheredWeights(engine, *net);
    if (comm.rank() == 0) out = std::move(loaded);
    at::Tensor loss = net->Loss((at::arange(8).view({2, 4}) * 3 + comm.rank()) % 13);
    engine.Backward(loss);
    engine.Step();
    if (!save_dir.empty()) engine.SaveCheckpoint(save_dir);
  });
  return out;
}

TEST(Zero3, FrozenParametersDeepSpeedSavedPartitionedLoadAtAnyStageAndSize) {
  const std::string fixture = std::string(UCKPT_TEST_FIXTURES) + "/ds_z3_frozen";
  std::map<std::string, at::Tensor> want;
  for (const auto& t : LoadStateDictFile(fixture + "/final_state.pt")) want[t.name] = t.tensor;
  ASSERT_EQ(want.size(), 4u);
  const std::string work = ::testing::TempDir() + "/z3_frozen_" + std::to_string(getpid());
  std::filesystem::remove_all(work);
  std::filesystem::create_directories(work);
  std::filesystem::copy(fixture, work + "/ds", std::filesystem::copy_options::recursive);
  ckpt::ConvertOptions co;
  co.durable = false;
  ckpt::ConvertToUniversal(work + "/ds/global_step3", work + "/ds/global_step3_universal", co);
  { std::ofstream(work + "/ds/latest_universal") << "global_step3_universal"; }
  auto expect_equal = [&](const std::map<std::string, at::Tensor>& got, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (const auto& [name, w] : want) EXPECT_TRUE(at::equal(got.at(name), w)) << what << ": " << name;
  };
  for (int stage : {3, 2})
    for (int world : {1, 2, 3})
      for (bool universal : {false, true})
        expect_equal(
            LoadFrozenNet(stage, world, work + "/ds", universal),
            "stage " + std::to_string(stage) + " at " + std::to_string(world) + (universal ? ", universal" : ""));

  // Ours, saved at 3 ranks, as DeepSpeed's: slots of 26 of the 78 elements
  // (the last 0-padded), an empty module entry; export and a load at 2 ranks
  // put it together.
  LoadFrozenNet(3, 3, work + "/ds", false, work + "/ours");
  const std::string tag = work + "/ours/global_step4";
  for (int r = 0; r < 3; ++r) {
    TorchFile m = LoadTorchFile(tag + "/zero_pp_rank_" + std::to_string(r) + "_mp_rank_00_model_states.pt");
    EXPECT_EQ(m.root->get("frozen_param_fragments")->get("emb.weight")->tensor->numel(), 26) << r;
  }
  TorchFile m0 = LoadTorchFile(tag + "/zero_pp_rank_0_mp_rank_00_model_states.pt");
  EXPECT_EQ(m0.root->get("module")->get("emb.weight")->tensor->numel(), 0);
  ckpt::ExportSafetensors(tag, work + "/ours.safetensors");
  auto again = LoadFrozenNet(3, 2, work + "/ours", false);
  EXPECT_TRUE(at::equal(again.at("emb.weight"), want.at("emb.weight")));

  // DeepSpeed's folder without one rank's model states: an error naming the file.
  std::filesystem::remove(work + "/ds/global_step3/zero_pp_rank_1_mp_rank_00_model_states.pt");
  try {
    LoadFrozenNet(3, 1, work + "/ds", false);
    ADD_FAILURE() << "loaded without rank 1's model states";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("zero_pp_rank_1_mp_rank_00_model_states.pt"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(work);
}

// BERT declares its encoder layers as units too: stage 3 (every layer
// gathered and freed) gives stage 2's losses at 2 ranks.
std::vector<double> TrainBert(int stage) {
  std::vector<double> losses;
  RunRanks(2, [&](Comm& comm) {
    at::set_num_threads(1);
    nlohmann::json ds = Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 0}});
    ds["zero_optimization"]["stage"] = stage;
    TrainOptions o = testing::RefrunOptions(ds, "bert");
    o.model_name = "bert";
    o.model.vocab_size = 260;
    o.init_file = "";
    Trainer t(comm, o);
    for (int k = 0; k < 4; ++k) {
      StepMetrics m = t.TrainStep();
      if (comm.rank() == 0) losses.push_back(m.loss);
    }
  });
  return losses;
}

TEST(Zero3, BertStage3MatchesStage2) {
  const std::vector<double> z2 = TrainBert(2), z3 = TrainBert(3);
  ASSERT_EQ(z3.size(), 4u);
  for (size_t i = 0; i < z2.size(); ++i) EXPECT_NEAR(z3[i], z2[i], 1e-6 * z2[i]) << i;
}

TEST(Zero3, ConfigKnobsParsedWithWarningsWhereNotHonoured) {
  nlohmann::json ds = Z3Config("z3_ws2_baseline", {{"stage3_param_persistence_threshold", 7},
                                                   {"overlap_comm", true},
                                                   {"stage3_prefetch_bucket_size", 1000},
                                                   {"stage3_max_live_parameters", 2000},
                                                   {"stage3_max_reuse_distance", 3000},
                                                   {"sub_group_size", 4000},
                                                   {"reduce_bucket_size", 5000},
                                                   {"offload_param", {{"device", "cpu"}}}});
  TrainConfig c = ParseConfig(ds, "ds.json");
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.param_persistence_threshold, 7);
  EXPECT_EQ(c.zero.prefetch_bucket_size, 1000);
  EXPECT_EQ(c.zero.max_live_parameters, 2000);
  EXPECT_EQ(c.zero.sub_group_size, 4000);
  EXPECT_EQ(c.zero.reduce_bucket_size, 5000);
  EXPECT_TRUE(c.zero.offload_param_cpu);
  auto warned = [&](const std::string& key) {
    for (const auto& w : c.warnings)
      if (w.find(key) != std::string::npos) return true;
    return false;
  };
  EXPECT_FALSE(warned("stage3_prefetch_bucket_size"));  // honoured (zero3_overlap_test.cc)
  EXPECT_FALSE(warned("stage3_max_live_parameters"));
  EXPECT_TRUE(warned("stage3_max_reuse_distance"));
  EXPECT_FALSE(warned("sub_group_size"));
  EXPECT_FALSE(warned("stage3_param_persistence_threshold"));
  EXPECT_FALSE(warned("overlap_comm"));
  ds["zero_optimization"]["stage3_prefetch_bucket_size"] = -1;
  EXPECT_THROW(ParseConfig(ds, "ds.json"), ConfigError);
  ds["zero_optimization"]["stage3_prefetch_bucket_size"] = 0;  // prefetching off
  EXPECT_EQ(ParseConfig(ds, "ds.json").zero.prefetch_bucket_size, 0);
  // Stage-3 knobs at stage 2: a warning; offload_param at stage 2 too, and ignored (as DeepSpeed 0.14.5).
  ds["zero_optimization"]["stage"] = 2;
  ds["zero_optimization"].erase("offload_param");
  TrainConfig c2 = ParseConfig(ds, "ds.json");
  bool stage3_only = false;
  for (const auto& w : c2.warnings) stage3_only |= w.find("applies to stage 3 only") != std::string::npos;
  EXPECT_TRUE(stage3_only);
  ds["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
  EXPECT_FALSE(ParseConfig(ds, "ds.json").zero.offload_param_cpu);
  ds["zero_optimization"]["stage"] = 3;
  ds["zero_optimization"]["offload_param"] = {{"device", "nvme"}};
  EXPECT_THROW(ParseConfig(ds, "ds.json"), ConfigError);
}

}  // namespace
}  // namespace uckpt::engine
