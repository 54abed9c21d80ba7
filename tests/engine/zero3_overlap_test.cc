// ZeRO stage 3 with overlap_comm (reduce-scatters during backward) and
// prefetching (stage3_prefetch_bucket_size, stage3_max_live_parameters):
// the same numbers as without them, bit for bit, and the counters show that
// they happened (Engine::stage3_stats()).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "cli/trainer.h"
#include "fixture.h"
#include "ranks.h"
#include "uckpt/engine.h"

namespace uckpt::engine {
namespace {

using cli::StepMetrics;
using cli::Trainer;
using cli::TrainOptions;

using testing::RunRanks;

struct Outcome {
  std::vector<double> losses;                // rank 0's, per step
  std::vector<models::NamedTensor> weights;  // rank 0's, gathered after the last step
  Stage3Stats stats;                         // rank 0's
  int64_t unit_numel = 0;                    // elements of block 0's parameters
};

// The fixture's GPT-2 at stage 3 with every block parameter gathered and
// freed per unit (threshold 0), buckets of at most 300 elements (several
// reduce-scatters per unit), gradient accumulation 2, `zero` merged in.
nlohmann::json Config(const nlohmann::json& zero) {
  nlohmann::json ds = testing::RefrunDsConfig("z3_ws2_baseline");
  ds.erase("train_batch_size");
  ds["train_micro_batch_size_per_gpu"] = 2;
  ds["gradient_accumulation_steps"] = 2;
  ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
  ds["zero_optimization"]["reduce_bucket_size"] = 300;
  for (auto& [k, v] : zero.items()) ds["zero_optimization"][k] = v;
  return ds;
}

Outcome Train(const nlohmann::json& ds, int world, int steps = 12, int n_layer = 2) {
  Outcome out;
  std::mutex mu;
  RunRanks(world, [&](Comm& comm) {
    at::set_num_threads(1);
    TrainOptions o = testing::RefrunOptions(ds, "z3");
    if (n_layer != 2) {  // the fixture's init has two blocks: a seeded one instead
      o.model.n_layer = n_layer;
      o.init_file = "";
    }
    Trainer t(comm, o);
    for (int s = 0; s < steps; ++s) {
      StepMetrics m = t.TrainStep();
      if (comm.rank() == 0) out.losses.push_back(m.loss);
    }
    const Stage3Stats stats = t.engine().stats().stage3_stats();
    t.engine().GatherParameters();
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out.stats = stats;
      for (const auto& p : t.parameters()) {
        out.weights.push_back({p.name, p.tensor.detach().clone()});
        if (p.name.rfind("transformer.h.0.", 0) == 0) out.unit_numel += p.tensor.numel();
      }
    }
    t.engine().ReleaseParameters();
  });
  return out;
}

void ExpectBitwiseEqual(const Outcome& a, const Outcome& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << what << ", step " << i + 1;
  ASSERT_EQ(a.weights.size(), b.weights.size()) << what;
  for (size_t i = 0; i < a.weights.size(); ++i)
    EXPECT_TRUE(at::equal(a.weights[i].tensor, b.weights[i].tensor)) << what << ": " << a.weights[i].name;
}

// Overlap and prefetch on and off, at 2 and 3 ranks, with and without offload
// of parameters and optimizer: the same losses and weights, bit for bit, as
// the run with neither.
TEST(Zero3Overlap, OverlapAndPrefetchOnAndOffBitwiseEqual) {
  const nlohmann::json offload = {{"offload_param", {{"device", "cpu"}, {"pin_memory", true}}},
                                  {"offload_optimizer", {{"device", "cpu"}, {"pin_memory", true}}}};
  for (int world : {2, 3})
    for (bool offloaded : {false, true}) {
      auto config = [&](bool overlap, int64_t prefetch) {
        nlohmann::json z = {{"overlap_comm", overlap}, {"stage3_prefetch_bucket_size", prefetch}};
        if (offloaded) z.update(offload);
        return Config(z);
      };
      const std::string where = "world " + std::to_string(world) + (offloaded ? ", offload" : "");
      const Outcome plain = Train(config(false, 0), world);
      ASSERT_EQ(plain.losses.size(), 12u);
      EXPECT_EQ(plain.stats.prefetched_gathers, 0) << where;
      EXPECT_EQ(plain.stats.overlapped_buckets, 0) << where;
      for (bool overlap : {false, true})
        for (int64_t prefetch : {int64_t{0}, int64_t{50000000}}) {
          if (!overlap && prefetch == 0) continue;
          const Outcome r = Train(config(overlap, prefetch), world);
          const std::string what =
              where + ", overlap " + std::to_string(overlap) + ", prefetch " + std::to_string(prefetch);
          ExpectBitwiseEqual(r, plain, what);
          EXPECT_EQ(r.stats.overlapped_buckets > 0, overlap) << what;
          EXPECT_EQ(r.stats.prefetched_gathers > 0, prefetch > 0) << what;
          EXPECT_EQ(r.stats.unused_prefetches, 0) << what;
          EXPECT_EQ(r.stats.reduce_buckets, plain.stats.reduce_buckets) << what;
          EXPECT_EQ(r.stats.unit_gathers, plain.stats.unit_gathers) << what;
          std::cout << "[ measured ] " << what << ": " << r.stats.prefetched_gathers << " of " << r.stats.unit_gathers
                    << " unit gathers prefetched, " << r.stats.overlapped_buckets << " of " << r.stats.reduce_buckets
                    << " buckets overlapped\n";
        }
    }
}

// Against real DeepSpeed's stage-3 run at 2 ranks (its batch sizes, its
// bucket size): overlap and prefetch on give its losses bit for bit.
TEST(Zero3Overlap, OverlapAndPrefetchMatchDeepSpeedBitwise) {
  nlohmann::json ds = testing::RefrunDsConfig("z3_ws2_baseline");
  ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
  ds["zero_optimization"]["overlap_comm"] = true;
  ds["zero_optimization"]["reduce_bucket_size"] = 300;
  ds["zero_optimization"]["stage3_prefetch_bucket_size"] = 100000;
  const Outcome r = Train(ds, 2);
  auto ref = testing::ReadJson(testing::RefrunDir() + "/runs/z3_ws2_baseline/losses.json")["steps"];
  ASSERT_EQ(r.losses.size(), 12u);
  for (size_t i = 0; i < r.losses.size(); ++i)
    EXPECT_EQ(r.losses[i], ref[std::to_string(i + 1)]["loss"].get<double>()) << "step " << i + 1;
  EXPECT_GT(r.stats.prefetched_gathers, 0);
  EXPECT_GT(r.stats.overlapped_buckets, 0);
}

// Four blocks: stage3_max_live_parameters caps the gathered unit elements
// (one unit computing plus what is prefetched), stage3_prefetch_bucket_size
// how far ahead; the losses never change.
TEST(Zero3Overlap, MaxLiveParametersBoundsGatheredElements) {
  const nlohmann::json base = Config({{"overlap_comm", true}});
  auto run = [&](int64_t prefetch, int64_t max_live) {
    nlohmann::json ds = base;
    ds["zero_optimization"]["stage3_prefetch_bucket_size"] = prefetch;
    ds["zero_optimization"]["stage3_max_live_parameters"] = max_live;
    return Train(ds, 2, 3, 4);
  };
  const Outcome none = run(0, 1000000000);
  const int64_t unit = none.unit_numel;
  ASSERT_GT(unit, 0);
  EXPECT_EQ(none.stats.peak_gathered_elements, unit);  // one block at a time
  EXPECT_EQ(none.stats.prefetched_gathers, 0);
  struct Case {
    int64_t prefetch, max_live, want_peak;
  };
  for (const Case& c :
       {Case{1000000, 1000000000, 4 * unit},                                   // everything ahead fits
        Case{1000000, 3 * unit, 3 * unit},                                     // capped by max_live
        Case{1000000, 2 * unit, 2 * unit}, Case{1000000, 2 * unit - 1, unit},  // no room for a second unit: no prefetch
        Case{1, 1000000000, 2 * unit},                                         // one unit ahead
        Case{unit + 1, 1000000000, 3 * unit}}) {
    const Outcome r = run(c.prefetch, c.max_live);
    const std::string what = "prefetch " + std::to_string(c.prefetch) + ", max_live " + std::to_string(c.max_live);
    EXPECT_EQ(r.stats.peak_gathered_elements, c.want_peak) << what;
    EXPECT_LE(r.stats.peak_gathered_elements, std::max(c.max_live, unit)) << what;
    EXPECT_EQ(r.stats.prefetched_gathers > 0, c.want_peak > unit) << what;
    EXPECT_EQ(r.stats.unused_prefetches, 0) << what;
    ExpectBitwiseEqual(r, none, what);
  }
}

// One rank has no all-gather to overlap: nothing is prefetched.
TEST(Zero3Overlap, OneRankPrefetchesNothing) {
  nlohmann::json ds = Config({{"overlap_comm", true}, {"stage3_prefetch_bucket_size", 1000000}});
  ds["gradient_accumulation_steps"] = 4;
  const Outcome r = Train(ds, 1, 2);
  EXPECT_GT(r.stats.unit_gathers, 0);
  EXPECT_EQ(r.stats.prefetched_gathers, 0);
  EXPECT_EQ(r.stats.peak_gathered_elements, r.unit_numel);
}

// A model through the public API that skips a declared unit (it runs units
// 0 and 2 of 3): the prefetch of unit 1 is dropped unused at the end of
// backward, and the numbers stay those of no prefetch.
struct SkippingNet : torch::nn::Module {
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  std::vector<at::Tensor> w;
  SkippingNet() {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);  // not the global one: ranks are threads
    for (int u = 0; u < 3; ++u) {
      units.push_back(register_module("u" + std::to_string(u), std::make_shared<torch::nn::Module>()));
      w.push_back(units.back()->register_parameter("w", at::randn({8, 8}, gen) * 0.3));
    }
  }
  at::Tensor Loss(at::Tensor x, const uckpt::UnitCalls& c) {
    for (size_t u : {0, 2}) {
      x = c.Enter(u, x);
      x = at::tanh(x.mm(w[u]));
      x = c.Exit(u, x);
    }
    return x.pow(2).mean();
  }
};

std::pair<std::vector<double>, Stage3Stats> TrainSkipping(int64_t prefetch) {
  std::vector<double> losses;
  Stage3Stats stats;
  RunRanks(2, [&](Comm& comm) {
    at::set_num_threads(1);
    auto net = std::make_shared<SkippingNet>();
    nlohmann::json ds = {{"train_micro_batch_size_per_gpu", 4},
                         {"gradient_accumulation_steps", 2},
                         {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
                         {"zero_optimization",
                          {{"stage", 3},
                           {"stage3_param_persistence_threshold", 0},
                           {"overlap_comm", true},
                           {"reduce_bucket_size", 64},
                           {"stage3_prefetch_bucket_size", prefetch}}}};
    uckpt::EngineOptions o;
    o.comm = std::shared_ptr<Comm>(&comm, [](Comm*) {});
    o.gather_units = {net->units[0], net->units[1], net->units[2]};
    uckpt::Engine engine(net, uckpt::Config::FromJson(ds), o);
    const uckpt::UnitCalls calls = engine.unit_calls();
    for (int step = 0; step < 4; ++step)
      for (int m = 0; m < 2; ++m) {
        at::Tensor x = at::cos(at::arange(32, at::kFloat).view({4, 8}) * (1 + step + 3 * m + 5 * comm.rank()));
        at::Tensor loss = net->Loss(x, calls);
        if (comm.rank() == 0) losses.push_back(loss.item<double>());
        engine.Backward(loss);
        engine.Step();
      }
    if (comm.rank() == 0) stats = engine.stats().stage3_stats();
  });
  return {losses, stats};
}

TEST(Zero3Overlap, SkippedUnitsPrefetchIsDropped) {
  const auto [plain, plain_stats] = TrainSkipping(0);
  const auto [pre, stats] = TrainSkipping(1000);
  ASSERT_EQ(pre.size(), 8u);
  EXPECT_EQ(pre, plain);
  EXPECT_GT(stats.prefetched_gathers, 0);
  EXPECT_GT(stats.unused_prefetches, 0);
  EXPECT_EQ(plain_stats.prefetched_gathers, 0);
}

}  // namespace
}  // namespace uckpt::engine
