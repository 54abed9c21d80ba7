// The public Engine API on a model defined only here: an embedding, an MLP
// whose output projection is tied to the embedding, a frozen parameter, a
// buffer and two parameter groups with different weight decay. At world
// sizes 1-4: save with a client_state, resume at the same size from the ZeRO
// files (bit-identical losses) and at every other size through `uckpt
// convert` (within 1e-6 relative); client_state, frozen parameter and buffer
// come back; `uckpt verify` passes and `uckpt export` gives the weights.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include "ckpt/convert.h"
#include "ckpt/export.h"
#include "ckpt/verify.h"
#include "engine/data/data.h"
#include "ranks.h"
#include "tiny.h"
#include "uckpt/engine.h"

namespace uckpt::engine::testing {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kVocab = 11, kDim = 8, kHidden = 16, kSeq = 6;

// Submodules built from plain torch::nn::Module so the tie is explicit.
struct TestNet : torch::nn::Module {
  explicit TestNet(uint64_t seed) {
    // A generator of its own: ranks on threads must not share torch's global one.
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto randn = [&](std::vector<int64_t> shape) { return at::randn(shape, gen); };
    auto emb = register_module("emb", std::make_shared<torch::nn::Module>());
    auto fc = register_module("fc", std::make_shared<torch::nn::Module>());
    auto head = register_module("head", std::make_shared<torch::nn::Module>());
    wte = emb->register_parameter("weight", randn({kVocab, kDim}) * 0.5);
    fc_w = fc->register_parameter("weight", randn({kHidden, kDim}) * 0.3);
    fc_b = fc->register_parameter("bias", torch::zeros({kHidden}));
    proj_w = fc->register_parameter("proj", randn({kDim, kHidden}) * 0.3);
    head->register_parameter("weight", wte);  // tied: one tensor, two names
    head_b = head->register_parameter("bias", torch::zeros({kVocab}));
    scale = register_parameter("scale", at::rand({kDim}, gen) + 0.5, /*requires_grad=*/false);  // frozen
    shift = register_buffer("shift", randn({kDim}) * 0.1);
    fc_unit = fc;
  }
  // `units`: the engine's calls around fc, gather unit 0 at stage 3.
  at::Tensor Loss(const at::Tensor& ids, const UnitCalls& units = {}) {
    at::Tensor x = units.Enter(0, at::embedding(wte, ids.narrow(1, 0, kSeq - 1)) * scale + shift);
    at::Tensor h = at::gelu(at::linear(x, fc_w, fc_b));
    x = units.Exit(0, x + at::linear(h, proj_w));
    at::Tensor logits = at::linear(x, wte, head_b);
    return at::cross_entropy_loss(logits.reshape({-1, kVocab}), ids.narrow(1, 1, kSeq - 1).reshape({-1}));
  }
  at::Tensor wte, fc_w, fc_b, proj_w, head_b, scale, shift;
  std::shared_ptr<torch::nn::Module> fc_unit;
};

Config TestConfig(int stage) {
  return Config::FromJson(nlohmann::json::parse(R"({
    "train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 3}},
    "zero_optimization": {"stage": )" + std::to_string(stage) +
                                                "}}"),
                          "test config");
}

// Row r of global batch `step`: deterministic tokens, whatever the split.
at::Tensor Rows(int64_t step, int64_t first_row, int64_t n) {
  at::Tensor ids = at::empty({n, kSeq}, at::kLong);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t t = 0; t < kSeq; ++t)
      ids[i][t] = static_cast<int64_t>(SplitMix64((step * 1000 + first_row + i) * 100 + t) % kVocab);
  return ids;
}

struct TestRun {
  std::shared_ptr<TestNet> net;
  std::unique_ptr<Engine> engine;
};

// A fresh model (init `seed`) in an engine with two groups: 2-D weights
// decay, biases do not.
TestRun MakeRun(Comm& comm, int stage, uint64_t seed) {
  TestRun r;
  r.net = std::make_shared<TestNet>(seed);
  EngineOptions o;
  o.comm = std::shared_ptr<Comm>(&comm, [](Comm*) {});
  ParamGroup decay{{r.net->wte, r.net->fc_w, r.net->proj_w}}, no_decay{{r.net->fc_b, r.net->head_b}};
  no_decay.weight_decay = 0.0;
  o.param_groups = {decay, no_decay};
  r.engine = std::make_unique<Engine>(r.net, TestConfig(stage), o);
  return r;
}

// Trains to `steps`; returns the global loss of each step.
std::vector<double> Train(TestRun& r, int64_t steps) {
  Engine& e = *r.engine;
  std::vector<double> losses;
  while (e.stats().global_steps() < steps) {
    const int64_t step = e.stats().global_steps() + 1;
    double sum = 0;
    for (int64_t m = 0; m < e.settings().gradient_accumulation_steps(); ++m) {
      const int64_t first =
          FirstRow(m, e.settings().rank(), e.settings().world_size(), e.settings().train_micro_batch_size_per_gpu());
      at::Tensor loss = r.net->Loss(Rows(step, first, e.settings().train_micro_batch_size_per_gpu()));
      sum += loss.item<double>();
      e.Backward(loss);
      e.Step();
    }
    at::Tensor total = at::full({1}, sum, at::kDouble);
    e.comm().AllReduceSum(total);
    losses.push_back(total.item<double>() /
                     static_cast<double>(e.settings().gradient_accumulation_steps() * e.settings().world_size()));
  }
  return losses;
}

ClientState MakeClientState() {
  c10::impl::GenericDict nested(c10::StringType::get(), c10::AnyType::get());
  c10::impl::GenericList list(c10::AnyType::get());
  list.push_back(int64_t{1});
  list.push_back(2.5);
  list.push_back(std::string("three"));
  nested.insert(std::string("list"), list);
  nested.insert(std::string("tensor"), torch::arange(4, torch::kFloat));
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert(std::string("checkpoint_step"), int64_t{3});
  d.insert(std::string("nested"), nested);
  return d;
}

void ExpectClientState(const ClientState& got) {
  ASSERT_TRUE(got.isGenericDict());
  auto d = got.toGenericDict();
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d.at(std::string("checkpoint_step")).toInt(), 3);
  auto nested = d.at(std::string("nested")).toGenericDict();
  auto list = nested.at(std::string("list")).toListRef();
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].toInt(), 1);
  EXPECT_EQ(list[1].toDouble(), 2.5);
  EXPECT_EQ(list[2].toStringRef(), "three");
  EXPECT_TRUE(nested.at(std::string("tensor")).toTensor().equal(torch::arange(4, torch::kFloat)));
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want, double rel, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t k = 0; k < got.size(); ++k) {
    if (rel == 0) {
      EXPECT_EQ(got[k], want[k]) << what << " step " << k;
    } else {
      EXPECT_NEAR(got[k], want[k], rel * std::abs(want[k])) << what << " step " << k;
    }
  }
}

// The tensors of a safetensors file (fp32), by name; a tied alias (recorded
// in __metadata__ as alias -> owner) maps to its owner's tensor.
std::map<std::string, at::Tensor> ReadSafetensorsFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, at::Tensor> out;
  const nlohmann::json j = nlohmann::json::parse(header);
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") continue;  // the aliases, below
    EXPECT_EQ(v["dtype"], "F32") << name;
    const size_t begin = v["data_offsets"][0], end = v["data_offsets"][1];
    at::Tensor t = at::empty(v["shape"].get<std::vector<int64_t>>(), at::kFloat);
    EXPECT_EQ(static_cast<size_t>(t.nbytes()), end - begin) << name;
    std::memcpy(t.data_ptr(), data.data() + begin, end - begin);
    out[name] = t;
  }
  if (j.contains("__metadata__"))
    for (auto it = j["__metadata__"].begin(); it != j["__metadata__"].end(); ++it)
      if (out.count(it.value().get<std::string>())) out[it.key()] = out[it.value().get<std::string>()];
  return out;
}

class EngineApi : public ::testing::TestWithParam<int> {};

TEST_P(EngineApi, SaveResumeAnySizeWithClientStateFrozenAndBuffers) {
  const int stage = GetParam();
  const fs::path root = testing::FreshTempDir("engine_api_" + std::to_string(stage));
  std::map<int, std::vector<double>> uninterrupted;
  for (int w = 1; w <= 4; ++w) {
    const std::string dir = (root / ("w" + std::to_string(w))).string();
    RunRanks(w, [&](Comm& comm) {
      TestRun r = MakeRun(comm, stage, 7);
      at::Tensor frozen0 = r.net->scale.clone();
      r.net->shift.add_(1.0);  // a buffer whose value only the checkpoint knows
      at::Tensor shift = r.net->shift.clone();
      std::vector<double> first = Train(r, 3);
      EXPECT_EQ(r.engine->SaveCheckpoint(dir, "", MakeClientState()), dir + "/global_step3");
      std::vector<double> rest = Train(r, 6);
      EXPECT_TRUE(r.net->scale.equal(frozen0)) << "frozen parameter changed by training";
      first.insert(first.end(), rest.begin(), rest.end());
      if (comm.rank() == 0) uninterrupted[w] = first;

      // Same size, from the ZeRO files: bit-identical, from another init.
      TestRun again = MakeRun(comm, stage, 99);
      LoadResult lr = again.engine->LoadCheckpoint(dir);
      EXPECT_EQ(lr.path, dir + "/global_step3");
      ExpectClientState(lr.client_state);
      EXPECT_EQ(again.engine->stats().global_steps(), 3);
      EXPECT_TRUE(again.net->scale.equal(frozen0)) << "frozen parameter not restored";
      EXPECT_TRUE(again.net->shift.equal(shift)) << "buffer not restored";
      std::vector<double> resumed = Train(again, 6);
      if (comm.rank() == 0)
        ExpectNear(resumed, {first.begin() + 3, first.end()}, 0, "same size w=" + std::to_string(w));
    });
    const std::string tag = dir + "/global_step3";
    ckpt::VerifyReport v = ckpt::VerifyCheckpoint(tag);
    EXPECT_TRUE(v.ok()) << tag << ": " << (v.problem_count() ? v.folders.at(0).problems.at(0).what : "");
    ckpt::ConvertToUniversal(tag, dir + "/global_step3_universal");
    EXPECT_TRUE(ckpt::VerifyCheckpoint(dir + "/global_step3_universal").ok());
    std::ofstream(dir + "/latest_universal") << "global_step3_universal";
  }
  // Every other size through the universal checkpoint.
  for (int from = 1; from <= 4; ++from) {
    for (int to = 1; to <= 4; ++to) {
      if (to == from) continue;
      const std::string dir = (root / ("w" + std::to_string(from))).string();
      RunRanks(to, [&](Comm& comm) {
        TestRun r = MakeRun(comm, stage, 123);
        LoadCheckpointOptions o;
        o.universal = true;
        LoadResult lr = r.engine->LoadCheckpoint(dir, "", o);
        ExpectClientState(lr.client_state);
        std::vector<double> resumed = Train(r, 6);
        const auto& ref = uninterrupted.at(from);
        if (comm.rank() == 0)
          ExpectNear(resumed, {ref.begin() + 3, ref.end()}, 1e-6,
                     "universal " + std::to_string(from) + " -> " + std::to_string(to));
      });
    }
  }
  // Export: the trained weights at step 3 by name, the tied head included.
  const std::string out = (root / "w2.safetensors").string();
  ckpt::ExportSafetensors((root / "w2" / "global_step3").string(), out);
  auto exported = ReadSafetensorsFile(out);
  RunRanks(2, [&](Comm& comm) {
    TestRun r = MakeRun(comm, stage, 5);
    r.engine->LoadCheckpoint((root / "w2").string(), "global_step3");
    if (comm.rank() != 0) return;
    for (const auto& p : r.net->named_parameters()) {
      ASSERT_TRUE(exported.count(p.key())) << p.key();
      EXPECT_TRUE(exported[p.key()].equal(p.value().to(at::kFloat))) << p.key();
    }
    EXPECT_TRUE(exported.count("shift")) << "buffer not exported";
  });
}

INSTANTIATE_TEST_SUITE_P(Stages, EngineApi, ::testing::Values(1, 2),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

TEST(EngineApiErrors, ParamGroupsNameTheParameter) {
  RunRanks(1, [](Comm& comm) {
    auto net = std::make_shared<TestNet>(1);
    EngineOptions o;
    o.comm = std::shared_ptr<Comm>(&comm, [](Comm*) {});
    o.param_groups = {ParamGroup{{net->wte}}};  // the biases are in no group
    {                                           // stages 0-2: never updated, as DeepSpeed leaves them
      auto other = std::make_shared<TestNet>(1);
      o.param_groups = {ParamGroup{{other->wte}}};
      Engine e(other, TestConfig(2), o);
      EXPECT_EQ(e.optimizer().param_groups().at(0).size(), 1u);
      o.param_groups = {ParamGroup{{net->wte}}};
    }
    try {
      Engine e(net, TestConfig(3), o);  // stage 3 refuses them
      FAIL() << "expected an error";
    } catch (const std::invalid_argument& ex) {
      EXPECT_NE(std::string(ex.what()).find("trainable parameter fc.weight is in no param group"), std::string::npos)
          << ex.what();
    }
    o.param_groups = {ParamGroup{{net->wte, net->fc_w, net->proj_w, net->fc_b, net->head_b, net->scale}}};
    EXPECT_THROW(Engine(net, TestConfig(2), o), std::invalid_argument);  // frozen in a group
  });
}

// Each group updates with its own lr (ParamGroup::lr, then SetLearningRate);
// the config scheduler writes one value into every group after a step; the
// checkpoint keeps each group's lr.
TEST(EngineApi, PerGroupLearningRates) {
  RunRanks(1, [](Comm& comm) {
    for (int stage : {1, 3}) {
      const std::string what = "stage " + std::to_string(stage);
      auto net = std::make_shared<TestNet>(4);
      EngineOptions o;
      o.comm = std::shared_ptr<Comm>(&comm, [](Comm*) {});
      ParamGroup decay{{net->wte, net->fc_w, net->proj_w}}, no_decay{{net->fc_b, net->head_b}};
      decay.lr = 0.02;
      no_decay.lr = 0.005;
      o.param_groups = {decay, no_decay};
      Engine e(net, TestConfig(stage), o);
      ASSERT_EQ(e.optimizer().num_param_groups(), 2u) << what;
      EXPECT_EQ(e.optimizer().learning_rate(0), 0.02) << what;
      EXPECT_EQ(e.optimizer().learning_rate(1), 0.005) << what;
      auto step = [&] {
        for (int64_t m = 0; m < e.settings().gradient_accumulation_steps(); ++m) {
          e.Backward(net->Loss(Rows(e.stats().global_steps() + 1, 2 * m, 2)));
          e.Step();
        }
      };
      step();
      // WarmupLR at iteration 0: warmup_min_lr (0) in every group.
      EXPECT_EQ(e.optimizer().learning_rate(0), 0.0) << what;
      EXPECT_EQ(e.optimizer().learning_rate(1), 0.0) << what;
      EXPECT_EQ(e.optimizer().lr_schedule_iteration(), 0) << what;
      e.optimizer().SetLearningRate(1, 0.01);  // group 0 keeps lr 0: its weights must not move
      const at::Tensor fc_w = net->fc_w.detach().clone(), fc_b = net->fc_b.detach().clone();
      step();
      EXPECT_TRUE(at::equal(net->fc_w, fc_w)) << what << ": a group at lr 0 changed";
      EXPECT_FALSE(at::equal(net->fc_b, fc_b)) << what << ": a group at lr 0.01 did not change";
      e.optimizer().SetLearningRate(0, 0.03);
      e.optimizer().SetLearningRate(1, 0.04);
      const std::string dir = testing::FreshTempDir("per_group_lr_" + std::to_string(stage));
      e.SaveCheckpoint(dir, "t");
      auto net2 = std::make_shared<TestNet>(5);
      EngineOptions o2 = o;
      o2.param_groups = {ParamGroup{{net2->wte, net2->fc_w, net2->proj_w}}, ParamGroup{{net2->fc_b, net2->head_b}}};
      Engine f(net2, TestConfig(stage), o2);
      LoadCheckpointOptions keep;
      keep.keep_saved_hparams = true;
      keep.load_lr_scheduler_states = false;
      f.LoadCheckpoint(dir, "t", keep);
      EXPECT_EQ(f.optimizer().learning_rate(0), 0.03) << what;
      EXPECT_EQ(f.optimizer().learning_rate(1), 0.04) << what;
      EXPECT_THROW(e.optimizer().SetLearningRate(2, 0.1), std::out_of_range) << what;
    }
  });
}

// Stage 0's optimizer state through the public API (what Python's
// optimizer.state_dict()/load_state_dict() use): Adam's keys, the engine's
// own tensors, and a state set into a fresh engine continues the run bit for
// bit; what is not such a state, and other stages, are refused.
TEST(EngineApi, Stage0OptimizerStateReadsAndReplacesEachGroup) {
  RunRanks(1, [](Comm& comm) {
    auto make = [&](const std::shared_ptr<TestNet>& net, int stage) {
      EngineOptions o;
      o.comm = std::shared_ptr<Comm>(&comm, [](Comm*) {});
      o.param_groups = {ParamGroup{{net->wte, net->fc_w, net->proj_w}}, ParamGroup{{net->fc_b, net->head_b}}};
      return std::make_unique<Engine>(net, TestConfig(stage), o);
    };
    auto step = [](Engine& e, TestNet& net, int64_t batch) {
      for (int64_t m = 0; m < e.settings().gradient_accumulation_steps(); ++m) {
        e.Backward(net.Loss(Rows(batch, 2 * m, 2)));
        e.Step();
      }
    };
    auto net = std::make_shared<TestNet>(4);
    auto e = make(net, 0);
    EXPECT_TRUE(e->optimizer().stage0_optimizer_state(1).empty());  // before the first step
    step(*e, *net, 1);
    const int64_t numel0 = net->wte.numel() + net->fc_w.numel() + net->proj_w.numel();
    auto state = e->optimizer().stage0_optimizer_state(0);
    ASSERT_EQ(state.size(), 3u);
    EXPECT_EQ(state[0].first, "step");
    EXPECT_EQ(state[0].second.dim(), 0);
    EXPECT_EQ(state[0].second.item<double>(), 1.0);
    EXPECT_EQ(state[1].first, "exp_avg");
    EXPECT_EQ(state[2].first, "exp_avg_sq");
    EXPECT_GE(state[1].second.numel(), numel0);
    // The engine's own tensors: the same storage on a second read.
    EXPECT_TRUE(e->optimizer().stage0_optimizer_state(0)[1].second.is_same(state[1].second));

    // Into a fresh engine with the weights (group 0's state unpadded): the next step is the same.
    auto net2 = std::make_shared<TestNet>(4);
    {
      c10::NoGradGuard no_grad;
      for (const auto& p : net->named_parameters()) net2->named_parameters()[p.key()].copy_(p.value());
    }
    auto f = make(net2, 0);
    f->optimizer().StepLrSchedule(0);  // where e's schedule is
    for (size_t g = 0; g < 2; ++g) {
      auto s = e->optimizer().stage0_optimizer_state(g);
      if (g == 0)
        for (auto& [key, t] : s)
          if (t.dim() == 1) t = t.narrow(0, 0, numel0).clone();
      f->optimizer().SetStage0OptimizerState(g, s);
    }
    EXPECT_FALSE(f->optimizer().stage0_optimizer_state(0)[1].second.is_same(state[1].second));  // a copy
    step(*e, *net, 2);
    step(*f, *net2, 2);
    for (const auto& p : net->named_parameters())
      EXPECT_TRUE(at::equal(net2->named_parameters()[p.key()], p.value())) << p.key();
    // Empty: no state, the next step starts afresh.
    f->optimizer().SetStage0OptimizerState(1, {});
    EXPECT_TRUE(f->optimizer().stage0_optimizer_state(1).empty());

    // Refused: not Adam's keys, a wrong length, a bad group, stage 1.
    auto without_step = e->optimizer().stage0_optimizer_state(0);
    without_step.erase(without_step.begin());
    EXPECT_THROW(f->optimizer().SetStage0OptimizerState(0, without_step), std::invalid_argument);
    auto short_one = e->optimizer().stage0_optimizer_state(0);
    short_one[1].second = short_one[1].second.narrow(0, 0, numel0 - 1);
    EXPECT_THROW(f->optimizer().SetStage0OptimizerState(0, short_one), std::invalid_argument);
    EXPECT_THROW(f->optimizer().stage0_optimizer_state(2), std::out_of_range);
    auto net3 = std::make_shared<TestNet>(4);
    auto z1 = make(net3, 1);
    EXPECT_THROW(z1->optimizer().stage0_optimizer_state(0), std::logic_error);
    EXPECT_THROW(z1->optimizer().SetStage0OptimizerState(0, {}), std::logic_error);
  });
}

// Stage 3's counters and timing through the public API (what `uckpt train`
// prints under UCKPT_TIMERS): fc, a gather unit, is gathered in forward and
// again in backward, one unit at a time, and freed after; gradients are
// reduce-scattered in buckets; Backward's reduce wait is timed only while
// SetTiming is on. Stages 0-2 have no such counters.
TEST(EngineApi, Stage3StatsAndTiming) {
  RunRanks(2, [](Comm& comm) {
    for (int stage : {1, 3}) {
      const std::string what = "stage " + std::to_string(stage);
      auto net = std::make_shared<TestNet>(4);
      EngineOptions o;
      o.comm = std::shared_ptr<Comm>(&comm, [](Comm*) {});
      o.gather_units = {net->fc_unit};
      Config config = TestConfig(stage);
      config.json["zero_optimization"]["stage3_param_persistence_threshold"] = 0;  // gather even tiny units
      Engine e(net, config, o);
      const UnitCalls units = e.unit_calls();
      auto step = [&] {
        for (int64_t m = 0; m < e.settings().gradient_accumulation_steps(); ++m) {
          const int64_t first = FirstRow(m, e.settings().rank(), e.settings().world_size(),
                                         e.settings().train_micro_batch_size_per_gpu());
          e.Backward(net->Loss(Rows(e.stats().global_steps() + 1, first, e.settings().train_micro_batch_size_per_gpu()),
                               units));
          e.Step();
        }
      };
      step();  // the first forward finds fc whole, as the model came
      const Stage3Stats first = e.stats().stage3_stats();
      step();
      const Stage3Stats s = e.stats().stage3_stats();
      const int64_t micro_steps = e.settings().gradient_accumulation_steps();
      if (stage == 3) {
        EXPECT_EQ(s.unit_gathers - first.unit_gathers, 2 * micro_steps) << what << ": forward and backward gather fc";
        EXPECT_EQ(s.peak_gathered_elements, net->fc_w.numel() + net->fc_b.numel() + net->proj_w.numel()) << what;
        EXPECT_EQ(s.gathered_elements, 0) << what << ": fc is freed after its backward";
        EXPECT_GE(s.reduce_buckets, micro_steps) << what;
      } else {
        EXPECT_EQ(s.unit_gathers, 0) << what;
        EXPECT_EQ(s.peak_gathered_elements, 0) << what;
        EXPECT_EQ(s.reduce_buckets, 0) << what;
      }
      EXPECT_EQ(s.reduce_wait_s, 0) << what << ": timing is off by default";
      e.stats().SetTiming(true);
      step();
      const double timed = e.stats().stage3_stats().reduce_wait_s;
      if (stage == 3) {
        EXPECT_GT(timed, 0) << what;
      } else {
        EXPECT_EQ(timed, 0) << what;
      }
      e.stats().SetTiming(false);
      step();
      EXPECT_EQ(e.stats().stage3_stats().reduce_wait_s, timed) << what << ": timing off again";
    }
  });
}

TEST(EngineApiErrors, StepWithoutBackwardAndBadClientState) {
  RunRanks(1, [](Comm& comm) {
    TestRun r = MakeRun(comm, 1, 3);
    EXPECT_THROW(r.engine->Step(), std::logic_error);
    EXPECT_THROW(r.engine->SaveCheckpoint(::testing::TempDir() + "/bad_cs", "t", c10::IValue(int64_t{3})),
                 std::invalid_argument);
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert(std::string("module"), int64_t{1});  // would overwrite the weights
    EXPECT_THROW(r.engine->SaveCheckpoint(::testing::TempDir() + "/bad_cs", "t", d), std::invalid_argument);
    // A tag is a plain folder name inside the checkpoint directory, both ways.
    EXPECT_THROW(r.engine->SaveCheckpoint(::testing::TempDir() + "/bad_tag", "../escape"), std::invalid_argument);
    for (const char* tag : {"../victim/global_step5", "/etc", ".."}) {
      try {
        r.engine->LoadCheckpoint(::testing::TempDir() + "/bad_tag", tag);
        ADD_FAILURE() << "loaded tag " << tag;
      } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find("checkpoint tag"), std::string::npos) << e.what();
      }
    }
  });
}

}  // namespace
}  // namespace uckpt::engine::testing
