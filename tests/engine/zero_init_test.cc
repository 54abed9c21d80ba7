// uckpt::ZeroInit (uckpt/zero_init.h): a C++ model built unit by unit, each
// unit partitioned as it is built, trains as the whole build does; the engine
// refuses such a model at stages 0-2, and a meta-device model at any stage.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <map>
#include <set>

#include "ckpt/partition.h"
#include "ranks.h"
#include "uckpt/engine.h"
#include "uckpt/zero_init.h"

namespace uckpt::engine {
namespace {

using testing::RunRanks;

constexpr int64_t kDim = 7;  // 49-element weights: padded partitions at 2 and 3 ranks

// One gather unit: its weights from `gen`; block 1 also registers block 0's
// bias (a parameter shared by two units: the root's) and a frozen scale.
struct Block : torch::nn::Module {
  at::Tensor w, b, frozen, tied;
  Block(at::Generator& gen, const at::Tensor& shared) {
    w = register_parameter("w", at::randn({kDim, kDim}, gen) * 0.3);
    b = register_parameter("b", at::randn({kDim}, gen) * 0.1);
    frozen = register_parameter("frozen", at::randn({kDim}, gen), /*requires_grad=*/false);
    if (shared.defined()) tied = register_parameter("tied", shared);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = at::tanh(x.mm(w) + b + frozen * 0.01);
    return tied.defined() ? y * tied : y;
  }
};

// Root parameters (emb, head), a buffer, and three units, each passed to
// ZeroInit::Built as it is built; after_unit(i) runs once unit i is built.
struct Net : torch::nn::Module {
  at::Tensor emb, head, offset;
  std::vector<std::shared_ptr<Block>> blocks;
  Net(uint64_t seed, const std::function<void(const Net&)>& after_unit = {}) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    emb = register_parameter("emb", at::randn({kDim}, gen));
    offset = register_buffer("offset", at::randn({kDim}, gen) * 0.01);
    for (int i = 0; i < 3; ++i) {
      at::Tensor shared = i == 1 ? blocks[0]->b : at::Tensor();
      blocks.push_back(register_module("h" + std::to_string(i), ZeroInit::Built(std::make_shared<Block>(gen, shared))));
      if (after_unit) after_unit(*this);
    }
    head = register_parameter("head", at::randn({kDim, 3}, gen));
  }
  std::vector<std::shared_ptr<torch::nn::Module>> units() const { return {blocks.begin(), blocks.end()}; }
  at::Tensor Loss(const at::Tensor& x_in, const UnitCalls& c) {
    at::Tensor x = x_in * emb + offset;
    for (size_t i = 0; i < blocks.size(); ++i) x = c.Exit(i, blocks[i]->forward(c.Enter(i, x)));
    return x.mm(head).pow(2).mean();
  }
};

nlohmann::json Ds(int stage, bool bf16 = false) {
  return {{"train_micro_batch_size_per_gpu", 4},
          {"gradient_accumulation_steps", 1},
          {"bf16", {{"enabled", bf16}}},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}, {"weight_decay", 0.1}}}}},
          {"zero_optimization", {{"stage", stage}, {"stage3_param_persistence_threshold", 0}}}};
}

std::shared_ptr<Comm> Borrowed(Comm& comm) {
  return std::shared_ptr<Comm>(&comm, [](Comm*) {});
}

// The bytes of one partition of each of the blocks' parameters (a shared one once).
int64_t PartitionBytes(const std::vector<std::shared_ptr<Block>>& blocks, int world) {
  int64_t bytes = 0;
  std::set<const void*> seen;
  for (const auto& block : blocks)
    for (const auto& p : block->parameters())
      if (seen.insert(p.unsafeGetTensorImpl()).second)
        bytes += ckpt::Stage3PartitionSize(p.numel(), world) * static_cast<int64_t>(p.element_size());
  return bytes;
}

struct BuildRun {
  std::vector<double> losses;                 // rank 0's
  std::map<std::string, at::Tensor> initial;  // rank 0's weights once the engine has them, gathered
};

// Trains Net for 3 steps at stage 3 and `world` ranks, built whole or under
// ZeroInit. Rank r builds from seed 7 + 100 r: the engine (whole) or the scope
// (partitioned) must make rank 0's values everyone's.
BuildRun Train(int world, bool partitioned, bool bf16 = false) {
  BuildRun out;
  RunRanks(world, [&](Comm& comm) {
    at::set_num_threads(1);
    const uint64_t seed = 7 + 100 * comm.rank();
    const Config config = Config::FromJson(Ds(3, bf16));
    EngineOptions o;
    o.comm = Borrowed(comm);
    std::shared_ptr<Net> net;
    if (partitioned) {
      ZeroInit init(config, o);
      // A rank holds its partitions plus the unit being built: every unit
      // built so far has no bytes of its own left.
      auto check = [&](const Net& n) {
        for (const auto& block : n.blocks) {
          for (const auto& p : block->parameters()) EXPECT_EQ(p.storage().nbytes(), 0u);
          EXPECT_EQ(block->w.sizes(), (at::IntArrayRef{kDim, kDim}));  // shapes stay
        }
        EXPECT_EQ(init.partition_bytes(), PartitionBytes(n.blocks, world));
      };
      net = ZeroInit::Built(std::make_shared<Net>(seed, check));
      EXPECT_EQ(net->emb.storage().nbytes(), 0u);       // the root's parameters too
      EXPECT_EQ(init.num_partitioned(), 3u * 3u + 2u);  // 3 per unit (the tied one once), emb, head
      init.AddTo(o);
      EXPECT_EQ(o.partitioned.size(), 11u);
      EXPECT_EQ(init.num_partitioned(), 0u);
    } else {
      net = std::make_shared<Net>(seed);
    }
    o.gather_units = net->units();
    Engine engine(net, config, std::move(o));
    engine.GatherParameters();
    if (comm.rank() == 0)
      for (const auto& p : net->named_parameters()) out.initial[p.key()] = p.value().detach().clone();
    engine.ReleaseParameters();
    const UnitCalls calls = engine.unit_calls();
    for (int step = 0; step < 3; ++step) {
      at::Tensor x = at::sin(at::arange(4 * kDim, at::kFloat).view({4, kDim}) * (1 + step + 7 * comm.rank()));
      if (bf16) x = x.to(at::kBFloat16);
      at::Tensor loss = net->Loss(x, calls);
      if (comm.rank() == 0) out.losses.push_back(loss.item<double>());
      engine.Backward(loss);
      engine.Step();
    }
  });
  return out;
}

// The same seed gives the whole build's values, so the losses are equal bit
// for bit (fp32 at 2 and 3 ranks, bf16 at 2).
TEST(ZeroInit, PartitionedBuildTrainsAsTheWholeBuildBitwise) {
  for (int world : {2, 3}) {
    for (bool bf16 : {false, true}) {
      if (bf16 && world == 3) continue;
      SCOPED_TRACE(std::to_string(world) + " ranks" + (bf16 ? ", bf16" : ""));
      const BuildRun whole = Train(world, false, bf16), parts = Train(world, true, bf16);
      ASSERT_EQ(parts.losses.size(), 3u);
      EXPECT_EQ(parts.losses, whole.losses);
      EXPECT_NE(parts.losses.front(), parts.losses.back());  // it trains
      ASSERT_EQ(parts.initial.size(), whole.initial.size());
      for (const auto& [name, w] : whole.initial) EXPECT_TRUE(at::equal(parts.initial.at(name), w)) << name;
    }
  }
}

// Outside a scope Built changes nothing; inside one it takes a ModuleHolder
// (torch::nn::Linear) too; a scope made without a communicator makes one
// from the environment and hands it over for the engine to end.
TEST(ZeroInit, BuiltOutsideAScopeIsTheWholeUnitAndHoldersArePartitioned) {
  torch::nn::Linear whole = ZeroInit::Built(torch::nn::Linear(4, 3));
  EXPECT_EQ(whole->weight.storage().nbytes(), 12u * sizeof(float));
  EXPECT_EQ(ZeroInit::Current(), nullptr);
  EngineOptions o;
  {
    ZeroInit init(Config::FromJson(Ds(3)));
    EXPECT_EQ(ZeroInit::Current(), &init);
    EXPECT_THROW(ZeroInit(Config::FromJson(Ds(3))), std::logic_error);  // one scope per thread
    torch::nn::Linear lin = ZeroInit::Built(torch::nn::Linear(4, 3));
    EXPECT_EQ(lin->weight.storage().nbytes(), 0u);
    EXPECT_EQ(lin->weight.sizes(), (at::IntArrayRef{3, 4}));
    EXPECT_EQ(init.num_partitioned(), 2u);
    init.AddTo(o);
    EXPECT_THROW(init.Partition(*lin), std::logic_error);
    EXPECT_THROW(init.AddTo(o), std::logic_error);
  }
  EXPECT_EQ(ZeroInit::Current(), nullptr);
  EXPECT_EQ(o.partitioned.size(), 2u);
  ASSERT_TRUE(o.comm);
  EXPECT_EQ(o.comm->world_size(), 1);
  EXPECT_TRUE(o.finish_comm);
}

// The scope keeps floating-point partitions in the config's dtype (as
// zero.Init does), not the fp32 they were built in: a bf16 or fp16 model's
// partitions hold half the bytes; other dtypes stay as built.
TEST(ZeroInit, PartitionsAreInTheConfigsDtype) {
  RunRanks(2, [&](Comm& comm) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      SCOPED_TRACE(c10::toString(dtype));
      nlohmann::json ds = Ds(3, dtype == at::kBFloat16);
      ds["fp16"] = {{"enabled", dtype == at::kHalf}};
      EngineOptions o;
      o.comm = Borrowed(comm);
      ZeroInit init(Config::FromJson(ds), o);
      torch::nn::Linear lin = ZeroInit::Built(torch::nn::Linear(kDim, 3));
      auto counts = std::make_shared<torch::nn::Module>();
      counts->register_parameter("n", at::arange(5, at::kLong), /*requires_grad=*/false);
      init.Partition(*counts);
      EXPECT_EQ(init.partition_bytes(), (ckpt::Stage3PartitionSize(3 * kDim, 2) + ckpt::Stage3PartitionSize(3, 2)) *
                                                static_cast<int64_t>(c10::elementSize(dtype)) +
                                            ckpt::Stage3PartitionSize(5, 2) * 8);
      EXPECT_EQ(lin->weight.scalar_type(), dtype);  // as zero.Init's parameter
      init.AddTo(o);
      ASSERT_EQ(o.partitioned.size(), 3u);
      EXPECT_EQ(o.partitioned[0].partition.scalar_type(), dtype);
      EXPECT_EQ(o.partitioned[1].partition.scalar_type(), dtype);
      EXPECT_EQ(o.partitioned[2].partition.scalar_type(), at::kLong);
      const std::vector<int64_t> mine =
          comm.rank() == 0 ? std::vector<int64_t>{0, 1, 2} : std::vector<int64_t>{3, 4, 0};
      EXPECT_TRUE(at::equal(o.partitioned[2].partition, at::tensor(mine)));
    }
  });
}

std::string MessageOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no std::invalid_argument)";
}

// Stages 0-2 refuse a partitioned build, naming the stage and what to do:
// the scope itself, and the engine given its partitions.
TEST(ZeroInit, StagesZeroToTwoRefuseAPartitionedBuild) {
  RunRanks(1, [&](Comm& comm) {
    for (int stage : {0, 1, 2}) {
      SCOPED_TRACE("stage " + std::to_string(stage));
      EngineOptions o;
      o.comm = Borrowed(comm);
      std::string m = MessageOf([&] { ZeroInit init(Config::FromJson(Ds(stage)), o); });
      EXPECT_NE(m.find("needs ZeRO stage 3"), std::string::npos) << m;
      EXPECT_NE(m.find("stage " + std::to_string(stage)), std::string::npos) << m;
      std::shared_ptr<Net> net;
      {
        ZeroInit init(Config::FromJson(Ds(3)), o);
        net = ZeroInit::Built(std::make_shared<Net>(7));
        init.AddTo(o);
      }
      m = MessageOf([&] { Engine engine(net, Config::FromJson(Ds(stage)), o); });
      EXPECT_NE(m.find("needs ZeRO stage 3; the config has stage " + std::to_string(stage)), std::string::npos) << m;
      EXPECT_NE(m.find("set zero_optimization.stage 3, or build the model whole"), std::string::npos) << m;
    }
  });
}

// A partitioned build whose partitions were not handed over, and a model on
// the meta device, are refused by name at every stage (never read).
TEST(ZeroInit, ModelsWithoutValuesAreRefusedByName) {
  RunRanks(1, [&](Comm& comm) {
    EngineOptions o;
    o.comm = Borrowed(comm);
    std::shared_ptr<Net> net;
    {
      ZeroInit init(Config::FromJson(Ds(3)), o);
      net = ZeroInit::Built(std::make_shared<Net>(7));
    }
    std::string m = MessageOf([&] { Engine engine(net, Config::FromJson(Ds(3)), o); });
    EXPECT_NE(m.find("parameter emb has no storage"), std::string::npos) << m;
    EXPECT_NE(m.find("ZeroInit::AddTo(options)"), std::string::npos) << m;
    for (int stage : {0, 2, 3}) {
      auto meta = std::make_shared<Net>(7);
      meta->blocks[2]->register_parameter("m", at::empty({kDim, kDim}, at::TensorOptions().device(at::kMeta)));
      m = MessageOf([&] { Engine engine(meta, Config::FromJson(Ds(stage)), o); });
      EXPECT_NE(m.find("parameter h2.m is on the meta device"), std::string::npos) << m;
      EXPECT_NE(m.find("uckpt::ZeroInit"), std::string::npos) << m;
    }
    auto meta_buffer = std::make_shared<Net>(7);
    meta_buffer->register_buffer("scale", at::empty({kDim}, at::TensorOptions().device(at::kMeta)));
    m = MessageOf([&] { Engine engine(meta_buffer, Config::FromJson(Ds(3)), o); });
    EXPECT_NE(m.find("buffer scale is on the meta device"), std::string::npos) << m;
    // The scope refuses them too.
    ZeroInit init(Config::FromJson(Ds(3)), o);
    auto meta = std::make_shared<torch::nn::Module>();
    meta->register_parameter("w", at::empty({2}, at::TensorOptions().device(at::kMeta)));
    m = MessageOf([&] { init.Partition(*meta); });
    EXPECT_NE(m.find("parameter w is on the meta device"), std::string::npos) << m;
  });
}

}  // namespace
}  // namespace uckpt::engine
