// Weights alone (engine/weights_io.cc): LoadWeights of a safetensors file or
// a sharded index into a running engine at stages 0-3 and 1-3 ranks (bf16:
// the weights are the file's values in bf16, the fp32 masters the file's
// values exactly; each rank's reads are its own partitions), names mapped,
// strict errors that name the names; Save16bitModel's safetensors and torch
// files read back equal to the engine's weights at stages 2 and 3.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "ckpt/weights_plan.h"
#include "cli/init_weights.h"
#include "engine/engine_access.h"
#include "engine/engine_impl.h"
#include "engine/torch_bridge.h"
#include "format/error.h"
#include "format/fault_env.h"
#include "format/safetensors.h"
#include "ranks.h"
#include "tiny.h"
#include "uckpt/engine.h"

namespace uckpt::engine::testing {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kVocab = 11, kDim = 8, kHidden = 7;

// An embedding tied to the head, an odd-sized MLP (padding at every world
// size), a frozen parameter and a buffer.
struct Net : torch::nn::Module {
  explicit Net(uint64_t seed) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto emb = register_module("emb", std::make_shared<torch::nn::Module>());
    fc = register_module("fc", std::make_shared<torch::nn::Module>());
    auto head = register_module("head", std::make_shared<torch::nn::Module>());
    wte = emb->register_parameter("weight", at::randn({kVocab, kDim}, gen));
    fc_w = fc->register_parameter("weight", at::randn({kHidden, kDim}, gen));
    fc_b = fc->register_parameter("bias", at::randn({kHidden}, gen));
    head->register_parameter("weight", wte);
    head_b = head->register_parameter("bias", at::randn({kVocab}, gen));
    scale = register_parameter("scale", at::rand({kDim}, gen), /*requires_grad=*/false);
    shift = register_buffer("shift", at::randn({kDim}, gen));
  }
  std::shared_ptr<torch::nn::Module> fc;
  at::Tensor wte, fc_w, fc_b, head_b, scale, shift;
};

Config TestConfig(int stage, bool gather_on_save = true) {
  nlohmann::json j = {{"train_batch_size", 6},
                      {"train_micro_batch_size_per_gpu", 1},
                      {"bf16", {{"enabled", true}}},
                      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
                      {"zero_optimization", {{"stage", stage}}}};
  if (stage == 3) {
    j["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
    j["zero_optimization"]["sub_group_size"] = 100;  // several sub-groups
    j["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather_on_save;
  }
  return Config::FromJson(j, "weights test config");
}

struct TestRun {
  std::shared_ptr<Net> net;
  std::unique_ptr<Engine> engine;
};

TestRun MakeRun(Comm& comm, int stage, uint64_t seed = 1, bool gather_on_save = true) {
  TestRun r;
  r.net = std::make_shared<Net>(seed);
  EngineOptions o;
  o.comm = std::shared_ptr<Comm>(&comm, [](Comm*) {});
  o.gather_units = {r.net->fc};
  Config c = TestConfig(stage, gather_on_save);
  // The batch must split over the ranks: 6 = 1 x GA x world.
  c.json["gradient_accumulation_steps"] = 6 / comm.world_size();
  r.engine = std::make_unique<Engine>(r.net, c, o);
  return r;
}

// The values a file holds: seed 7's model under the file's names.
std::map<std::string, at::Tensor> FileValues() {
  Net n(7);
  return {{"emb.weight", n.wte},   {"fc.weight", n.fc_w}, {"fc.bias", n.fc_b},
          {"head.bias", n.head_b}, {"scale", n.scale},    {"shift", n.shift}};
}

at::ScalarType FileDtype(const std::string& name) {
  if (name == "fc.bias") return at::kBFloat16;
  if (name == "head.bias") return at::kHalf;
  return at::kFloat;
}

// Writes `values` (in FileDtype) to `path`, names through `rename`.
void WriteFile(const std::string& path, const std::map<std::string, at::Tensor>& values,
               const std::function<std::string(const std::string&)>& rename = nullptr) {
  std::vector<SafetensorsWriter::Entry> entries;
  std::vector<at::Tensor> data;
  for (const auto& [name, t] : values) {
    at::Tensor c = t.to(FileDtype(name)).contiguous();
    entries.push_back({rename ? rename(name) : name, FromScalarType(c.scalar_type()), c.sizes().vec()});
    data.push_back(c);
  }
  SafetensorsWriter w(path, entries);
  for (const auto& c : data) w.Write({static_cast<const uint8_t*>(c.data_ptr()), c.nbytes()});
  w.Commit();
}

// The engine's whole weights by state_dict name (gathered at stage 3).
std::map<std::string, at::Tensor> EngineWeights(Engine& e, Net& n) {
  e.GatherParameters();
  std::map<std::string, at::Tensor> out;
  for (const auto& item : n.named_parameters()) out[item.key()] = item.value().detach().clone();
  for (const auto& item : n.named_buffers()) out[item.key()] = item.value().detach().clone();
  e.ReleaseParameters();
  return out;
}

// Every slot's master fragment equals the file's fp32 value of its parameter.
void ExpectMastersEqualFile(Engine& e, const std::map<std::string, at::Tensor>& file, const std::string& what) {
  for (const PartitionSlot& slot : engine::EngineAccess::State(e).runtime->Slots())
    for (const ckpt::TargetFragment& f : slot.target.fragments) {
      const std::string& name = slot.target.params[f.param].name;
      at::Tensor want = file.at(name).to(FileDtype(name)).to(at::kFloat).flatten().narrow(0, f.param_offset, f.numel);
      EXPECT_TRUE(at::equal(slot.state->master.narrow(0, f.offset, f.numel), want)) << what << ": master of " << name;
    }
}

void ExpectWeightsEqualFile(Engine& e, Net& n, const std::map<std::string, at::Tensor>& file, const std::string& what) {
  auto w = EngineWeights(e, n);
  w.erase("head.weight");  // the tie: emb.weight's tensor
  for (const auto& [name, t] : w) {
    at::Tensor want = file.at(name).to(FileDtype(name)).to(t.scalar_type());
    EXPECT_TRUE(at::equal(t, want)) << what << ": " << name;
  }
}

class LoadWeightsTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(LoadWeightsTest, WeightsAndMastersEqualTheFile) {
  const auto [stage, world] = GetParam();
  const std::string dir = FreshTempDir("load_weights_" + std::to_string(stage) + "_" + std::to_string(world));
  const auto file = FileValues();
  WriteFile(dir + "/model.safetensors", file);
  RunRanks(world, [&](Comm& comm) {
    TestRun r = MakeRun(comm, stage);
    const std::string what = "stage " + std::to_string(stage) + " rank " + std::to_string(comm.rank());
    // Before: the model's own (seed 1) values, not the file's.
    ASSERT_FALSE(at::equal(r.net->fc_b, file.at("fc.bias").to(r.net->fc_b.scalar_type())));
    LoadWeightsOptions o;
    o.strict = false;  // head.weight, the tie, is not in the file
    LoadWeightsResult res = r.engine->weights().LoadWeights(dir, o);
    EXPECT_EQ(res.missing_keys, std::vector<std::string>{"head.weight"}) << what;
    EXPECT_TRUE(res.unexpected_keys.empty()) << what;
    ExpectMastersEqualFile(*r.engine, file, what);
    ExpectWeightsEqualFile(*r.engine, *r.net, file, what);
    // Each rank's reads are its partitions: their real elements, nothing else.
    SafetensorsSource src = SafetensorsSource::Open(dir);
    ckpt::WeightsMatch m;
    for (const auto& [name, t] : file) m.source_of[name] = name;
    for (const PartitionSlot& slot : engine::EngineAccess::State(*r.engine).runtime->Slots()) {
      uint64_t read = 0, real = 0;
      for (const auto& rd : ckpt::PlanWeightReads(src, m, slot.target)) read += rd.numel;
      for (const auto& f : slot.target.fragments) real += f.numel;
      EXPECT_EQ(read, real) << what;
      if (stage > 0 && world > 1) {
        EXPECT_LT(real, 100u) << what;
      }  // not the whole model (133 trainable elements)
    }
  });
}

INSTANTIATE_TEST_SUITE_P(StagesAndRanks, LoadWeightsTest,
                         ::testing::Combine(::testing::Values(0, 1, 2, 3), ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return "stage" + std::to_string(std::get<0>(info.param)) + "_ranks" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(LoadWeights, ShardedIndexAndPrefixRuleAndNameMap) {
  const std::string dir = FreshTempDir("load_weights_index");
  auto file = FileValues();
  std::map<std::string, at::Tensor> a, b;
  for (const auto& [name, t] : file) (name < "g" ? a : b)[name] = t;
  auto prefixed = [](const std::string& n) { return "model." + n; };
  WriteFile(dir + "/model-00001-of-00002.safetensors", a, prefixed);
  WriteFile(dir + "/model-00002-of-00002.safetensors", b, prefixed);
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  for (const auto& [name, t] : file)
    index["weight_map"]["model." + name] =
        name < "g" ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  RunRanks(2, [&](Comm& comm) {
    for (int stage : {2, 3}) {
      const std::string what = "stage " + std::to_string(stage);
      TestRun r = MakeRun(comm, stage);
      LoadWeightsOptions o;
      o.strip_prefix = "model.";
      o.strict = false;
      LoadWeightsResult res = r.engine->weights().LoadWeights(dir + "/model.safetensors.index.json", o);
      EXPECT_EQ(res.missing_keys, std::vector<std::string>{"head.weight"}) << what;
      ExpectMastersEqualFile(*r.engine, file, what);
      ExpectWeightsEqualFile(*r.engine, *r.net, file, what);
      // A function; strict: head.weight is missing, nothing is loaded.
      TestRun r2 = MakeRun(comm, stage);
      const auto before = EngineWeights(*r2.engine, *r2.net);
      LoadWeightsOptions f;
      f.name_map = [](const std::string& n) -> std::optional<std::string> { return n.substr(6); };
      EXPECT_THROW(r2.engine->weights().LoadWeights(dir, f), FormatError) << what;
      for (const auto& [name, t] : EngineWeights(*r2.engine, *r2.net))
        EXPECT_TRUE(at::equal(t, before.at(name))) << what << ": " << name << " changed by a refused load";
      // The tie filled through its second name.
      f.name_map = [](const std::string& n) -> std::optional<std::string> {
        return n == "model.emb.weight" ? "head.weight" : n.substr(6);
      };
      f.strict = false;
      res = r2.engine->weights().LoadWeights(dir, f);
      EXPECT_EQ(res.missing_keys, std::vector<std::string>{"emb.weight"}) << what;
      EXPECT_TRUE(res.unexpected_keys.empty()) << what;
      ExpectWeightsEqualFile(*r2.engine, *r2.net, file, what);
    }
  });
}

// The error text of `fn` on this rank (fails the test without one).
std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(LoadWeights, StrictErrorsNameTheNamesOnEveryRank) {
  const std::string dir = FreshTempDir("load_weights_strict");
  auto file = FileValues();
  file.erase("fc.bias");
  file["extra.w"] = at::ones({2});
  WriteFile(dir + "/extra.safetensors", file);
  auto bad = FileValues();
  bad["fc.weight"] = at::ones({kDim, kHidden});
  WriteFile(dir + "/shape.safetensors", bad);
  RunRanks(2, [&](Comm& comm) {
    TestRun r = MakeRun(comm, 3);
    std::string err = ErrorOf([&] { r.engine->weights().LoadWeights(dir + "/extra.safetensors"); });
    EXPECT_NE(err.find(dir + "/extra.safetensors"), std::string::npos) << err;
    EXPECT_NE(err.find(R"(Missing key(s) in state_dict: "fc.bias", "head.weight".)"), std::string::npos) << err;
    EXPECT_NE(err.find(R"(Unexpected key(s) in state_dict: "extra.w".)"), std::string::npos) << err;
    LoadWeightsOptions lax;
    lax.strict = false;
    LoadWeightsResult res = r.engine->weights().LoadWeights(dir + "/extra.safetensors", lax);
    EXPECT_EQ(res.missing_keys, (std::vector<std::string>{"fc.bias", "head.weight"}));
    EXPECT_EQ(res.unexpected_keys, std::vector<std::string>{"extra.w"});
    // A shape that differs is an error whatever strict says.
    err = ErrorOf([&] { r.engine->weights().LoadWeights(dir + "/shape.safetensors", lax); });
    EXPECT_NE(err.find("size mismatch for fc.weight: copying a param with shape [8, 7] from checkpoint, the shape in "
                       "current model is [7, 8]."),
              std::string::npos)
        << err;
    // One rank's missing file is every rank's error.
    err = ErrorOf([&] {
      r.engine->weights().LoadWeights(comm.rank() == 1 ? dir + "/absent.safetensors" : dir + "/extra.safetensors", lax);
    });
    EXPECT_NE(err.find("absent.safetensors"), std::string::npos) << err;
  });
}

// `uckpt train --init` reads safetensors through the same checked reader.
TEST(InitWeights, SafetensorsThroughTheCheckedReader) {
  const std::string dir = FreshTempDir("init_safetensors");
  const auto file = FileValues();
  WriteFile(dir + "/init.safetensors", file);
  const auto loaded = cli::LoadStateDictFile(dir + "/init.safetensors");
  ASSERT_EQ(loaded.size(), file.size());
  for (const auto& [name, t] : loaded) EXPECT_TRUE(at::equal(t, file.at(name).to(FileDtype(name)))) << name;
  // 4 bytes no tensor covers: refused (the data must tile exactly).
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  std::string bytes(8, '\0');
  bytes[0] = static_cast<char>(header.size());
  std::ofstream(dir + "/gap.safetensors", std::ios::binary) << bytes + header + std::string(8, '\0');
  EXPECT_THROW(cli::LoadStateDictFile(dir + "/gap.safetensors"), FormatError);
}

class Save16bitTest : public ::testing::TestWithParam<int> {};

TEST_P(Save16bitTest, FilesReadBackEqualTheWeights) {
  const int stage = GetParam();
  const std::string dir = FreshTempDir("save16_" + std::to_string(stage));
  RunRanks(2, [&](Comm& comm) {
    TestRun r = MakeRun(comm, stage, /*seed=*/comm.rank() + 3);  // rank 0's values win at construction
    // Some training first: the weights differ from construction's.
    for (int64_t m = 0; m < r.engine->settings().gradient_accumulation_steps(); ++m) {
      at::Tensor x = r.engine->EnterUnit(0, r.net->wte * 1.0);
      at::Tensor y = r.engine->ExitUnit(0, at::linear(x, r.net->fc_w, r.net->fc_b));
      at::Tensor loss = (y.square().sum() + r.net->head_b.sum()).to(at::kFloat);
      r.engine->Backward(loss);
      r.engine->Step();
    }
    ASSERT_EQ(r.engine->stats().global_steps(), 1);
    const auto weights = EngineWeights(*r.engine, *r.net);
    EXPECT_TRUE(r.engine->weights().Save16bitModel(dir, "model.safetensors"));
    EXPECT_TRUE(r.engine->weights().Save16bitModel(dir + "/bin"));
    comm.Barrier();
    // safetensors: every tensor once, the tie in the metadata.
    SafetensorsFile f = SafetensorsFile::Open(dir + "/model.safetensors");
    EXPECT_EQ(f.tensors().size(), weights.size() - 1);
    EXPECT_EQ(f.metadata().at("head.weight"), "emb.weight");
    for (const auto& [name, t] : weights) {
      if (name == "head.weight") continue;
      const SafetensorsTensor* st = f.Find(name);
      ASSERT_NE(st, nullptr) << name;
      EXPECT_EQ(st->shape, t.sizes().vec()) << name;
      EXPECT_EQ(st->dtype, FromScalarType(t.scalar_type())) << name;
      auto bytes = f.Elements(*st, 0, st->numel);
      EXPECT_EQ(std::memcmp(bytes.data(), t.contiguous().data_ptr(), bytes.size()), 0) << name;
    }
    // torch.save's format: every name of the state_dict, in its order.
    const auto bin = cli::LoadStateDictFile(dir + "/bin/pytorch_model.bin");
    std::vector<std::string> names;
    for (const auto& [name, t] : bin) {
      names.push_back(name);
      EXPECT_TRUE(at::equal(t, weights.at(name))) << name;
    }
    EXPECT_EQ(names, engine::EngineAccess::State(*r.engine).state_names);
    // exclude_frozen_parameters: the frozen parameter left out, the buffer kept.
    EXPECT_TRUE(
        r.engine->weights().Save16bitModel(dir + "/nofrozen", "model.safetensors", /*exclude_frozen_parameters=*/true));
    comm.Barrier();
    SafetensorsFile nf = SafetensorsFile::Open(dir + "/nofrozen/model.safetensors");
    EXPECT_EQ(nf.Find("scale"), nullptr);
    EXPECT_NE(nf.Find("shift"), nullptr);
    EXPECT_EQ(nf.tensors().size(), f.tensors().size() - 1);
    // Loading our own safetensors back is strict-clean (the tie from the metadata).
    LoadWeightsResult res = r.engine->weights().LoadWeights(dir + "/model.safetensors");
    EXPECT_TRUE(res.missing_keys.empty() && res.unexpected_keys.empty());
    for (const auto& [name, t] : EngineWeights(*r.engine, *r.net)) EXPECT_TRUE(at::equal(t, weights.at(name))) << name;
    if (stage == 3) {
      const auto sd = r.engine->weights().Zero3Consolidated16bitStateDict();
      if (comm.rank() == 0) {
        ASSERT_EQ(sd.size(), weights.size());
        for (const auto& [name, t] : sd) EXPECT_TRUE(at::equal(t, weights.at(name))) << name;
        EXPECT_TRUE(sd[0].second.is_same(sd[3].second) || sd[0].first != "emb.weight");
      } else {
        EXPECT_TRUE(sd.empty());
      }
    } else {
      EXPECT_THROW(r.engine->weights().Zero3Consolidated16bitStateDict(), std::invalid_argument);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Stages, Save16bitTest, ::testing::Values(2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

// A failed write on rank 0 (of the tensors, which a thread of their own
// writes, or of the file's name at the end) is every rank's error, naming the
// file; nothing is left under its name, and the next save works.
TEST(Save16bit, WriteFailureIsEveryRanksError) {
  for (const std::string name : {"model.safetensors", "pytorch_model.bin"})
    for (IoOp op : {IoOp::kWrite, IoOp::kRename}) {
      const std::string dir = FreshTempDir("save16_fault");
      FaultEnv faults;
      faults.Add({op, name, 1, ENOSPC, /*once=*/true});
      ScopedEnv scoped(faults);
      RunRanks(2, [&](Comm& comm) {
        TestRun r = MakeRun(comm, 3);
        std::string err = ErrorOf([&] { r.engine->weights().Save16bitModel(dir, name); });
        EXPECT_NE(err.find(dir + "/" + name), std::string::npos) << IoOpName(op) << ": " << err;
        comm.Barrier();
        EXPECT_FALSE(fs::exists(dir + "/" + name)) << IoOpName(op);
        EXPECT_TRUE(r.engine->weights().Save16bitModel(dir, name));
        comm.Barrier();
        EXPECT_TRUE(fs::exists(dir + "/" + name));
      });
    }
}

// DeepSpeed's key, its field name and its deprecated fp16 name, without a warning.
TEST(Save16bit, GatherKeyAndItsOlderNames) {
  for (const char* key : {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                          "stage3_gather_fp16_weights_on_model_save"}) {
    nlohmann::json ds = {{"train_batch_size", 1}, {"zero_optimization", {{"stage", 3}, {key, true}}}};
    TrainConfig c = ParseConfig(ds, "ds.json");
    EXPECT_TRUE(c.zero.gather_16bit_weights_on_model_save) << key;
    for (const auto& w : c.warnings) EXPECT_EQ(w.find("gather"), std::string::npos) << key << ": " << w;
  }
  EXPECT_FALSE(ParseConfig({{"train_batch_size", 1}}, "ds.json").zero.gather_16bit_weights_on_model_save);
}

TEST(Save16bit, Stage3WithoutTheGatherKeySavesNothing) {
  const std::string dir = FreshTempDir("save16_nogather");
  RunRanks(2, [&](Comm& comm) {
    TestRun r = MakeRun(comm, 3, 1, /*gather_on_save=*/false);
    EXPECT_FALSE(r.engine->settings().zero_gather_16bit_weights_on_model_save());
    EXPECT_FALSE(r.engine->weights().Save16bitModel(dir, "model.safetensors"));
    EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  });
}

}  // namespace
}  // namespace uckpt::engine::testing
