// EngineOptions::overlap_update_with_forward: the offloaded host update of
// stages 1-2 at one rank overlapped with the next forward, unit by unit.
// The runs here are the synchronous update's, bit for bit; EnterUnit waits
// for its unit; every other call for the whole update; a failure of the
// background update is thrown by the next wait.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "engine/engine_access.h"
#include "engine/engine_impl.h"
#include "engine/flat_runtime.h"
#include "ranks.h"
#include "uckpt/engine.h"

namespace uckpt {
namespace {

namespace fs = std::filesystem;

// kDim * kDim: two chunks of the host Adam's threads (host_adam_kernel.cc's kChunk).
constexpr int64_t kVocab = 64, kDim = 640, kBlocks = 3;

struct Block : torch::nn::Module {
  explicit Block(at::Generator& gen) {
    w1 = register_parameter("w1", at::randn({kDim, kDim}, gen) * 0.05);
    b1 = register_parameter("b1", at::zeros({kDim}));
    w2 = register_parameter("w2", at::randn({kDim, kDim}, gen) * 0.05);
  }
  at::Tensor w1, b1, w2;
};

// Embedding and tied head in the root, three blocks as gather units.
struct Net : torch::nn::Module {
  explicit Net(uint64_t seed) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);  // (ranks run as threads)
    wte = register_parameter("wte", at::randn({kVocab, kDim}, gen) * 0.1);
    for (int64_t i = 0; i < kBlocks; ++i)
      blocks.push_back(register_module("h" + std::to_string(i), std::make_shared<Block>(gen)));
    ln_b = register_parameter("ln_b", at::zeros({kDim}));
  }
  at::Tensor Loss(const at::Tensor& ids) const {
    at::Tensor x = at::embedding(wte, ids);
    for (size_t i = 0; i < blocks.size(); ++i) {
      x = units.Enter(i, x);
      const Block& b = *blocks[i];
      x = x + at::matmul(at::tanh(at::matmul(x, b.w1) + b.b1), b.w2);
      x = units.Exit(i, x);
    }
    at::Tensor logits = at::matmul(x + ln_b, wte.t()).to(at::kFloat);
    return at::cross_entropy_loss(logits.reshape({-1, kVocab}), ids.roll(1, 1).reshape({-1}));
  }
  at::Tensor wte, ln_b;
  std::vector<std::shared_ptr<Block>> blocks;
  UnitCalls units;
};

Config TestConfig(int stage) {
  nlohmann::json j = {{"train_batch_size", 4},
                      {"train_micro_batch_size_per_gpu", 2},  // 2 micro-steps: stage 2 sums on the host
                      {"gradient_clipping", 1.0},
                      {"bf16", {{"enabled", true}}},
                      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}, {"weight_decay", 0.1}}}}},
                      {"zero_optimization", {{"stage", stage}, {"offload_optimizer", {{"device", "cpu"}}}}}};
  return Config::FromJson(j, "overlapped update test config");
}

struct TestRun {
  std::shared_ptr<Net> net;
  std::unique_ptr<Engine> engine;
  engine::FlatRuntime& runtime() {
    return dynamic_cast<engine::FlatRuntime&>(*engine::EngineAccess::State(*engine).runtime);
  }
};

// Two param groups whose parameters interleave the units (a unit's
// elements lie in several ranges of each group's flat buffer).
TestRun MakeRun(int stage, bool overlap, Comm* comm = nullptr) {
  TestRun r;
  r.net = std::make_shared<Net>(7);
  EngineOptions o;
  o.comm = comm ? std::shared_ptr<Comm>(comm, [](Comm*) {}) : std::shared_ptr<Comm>(MakeSingleProcessComm());
  for (const auto& b : r.net->blocks) o.gather_units.push_back(b);
  ParamGroup weights, biases;
  for (const auto& b : r.net->blocks) weights.params.push_back(b->w1);
  weights.params.push_back(r.net->wte);
  for (const auto& b : r.net->blocks) weights.params.push_back(b->w2);
  for (const auto& b : r.net->blocks) biases.params.push_back(b->b1);
  biases.params.push_back(r.net->ln_b);
  biases.weight_decay = 0.0;
  o.param_groups = {weights, biases};
  o.overlap_update_with_forward = overlap;
  o.host_threads = 2;  // the host Adam's own threads too
  r.engine = std::make_unique<Engine>(r.net, TestConfig(stage), std::move(o));
  r.net->units = r.engine->unit_calls();
  return r;
}

at::Tensor Batch(int64_t step, int64_t micro) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(100 * step + micro));
  return at::randint(kVocab, {2, 8}, gen, at::kLong);
}

// One optimizer step of two micro-batches; returns their losses' bits.
std::vector<float> TrainStep(TestRun& r, int64_t step) {
  std::vector<float> losses;
  for (int64_t m = 0; m < 2; ++m) {
    at::Tensor loss = r.net->Loss(Batch(step, m));
    losses.push_back(loss.item<float>());
    r.engine->Backward(loss);
    r.engine->Step();
  }
  return losses;
}

bool SameBits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

void ExpectSameState(TestRun& a, TestRun& b, const std::string& where) {
  auto pa = a.net->named_parameters(), pb = b.net->named_parameters();
  for (const auto& p : pa) EXPECT_TRUE(SameBits(p.value(), pb[p.key()])) << where << ": " << p.key();
  for (size_t g = 0; g < 2; ++g) {
    const engine::PartitionState &sa = a.runtime().state(g), &sb = b.runtime().state(g);
    EXPECT_TRUE(SameBits(sa.master, sb.master)) << where << ": group " << g << " masters";
    EXPECT_TRUE(SameBits(sa.exp_avg, sb.exp_avg)) << where << ": group " << g << " exp_avg";
    EXPECT_TRUE(SameBits(sa.exp_avg_sq, sb.exp_avg_sq)) << where << ": group " << g << " exp_avg_sq";
    EXPECT_TRUE(SameBits(sa.step, sb.step)) << where << ": group " << g << " step";
  }
}

std::string FileBytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Steps with the flag on give the synchronous run's losses, weights and
// optimizer state, bit for bit, at stages 1 and 2; a checkpoint saved right
// after Step holds the updated state (the same files).
TEST(OverlappedUpdate, TrainsAndSavesAsTheSynchronousUpdate) {
  const fs::path dir = fs::temp_directory_path() / ("uckpt_overlapped_update_" + std::to_string(getpid()));
  fs::remove_all(dir);
  for (int stage : {1, 2}) {
    const std::string where = "stage " + std::to_string(stage);
    TestRun sync = MakeRun(stage, false), overlapped = MakeRun(stage, true);
    ASSERT_FALSE(sync.runtime().overlaps_update());
    ASSERT_TRUE(overlapped.runtime().overlaps_update()) << where;
    for (int64_t step = 1; step <= 4; ++step)
      ASSERT_EQ(TrainStep(sync, step), TrainStep(overlapped, step)) << where << " step " << step;
    sync.engine->SaveCheckpoint((dir / "sync").string(), "t");
    overlapped.engine->SaveCheckpoint((dir / "overlapped").string(), "t");  // right after the last Step
    for (const char* file : {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"})
      EXPECT_TRUE(FileBytes(dir / "sync" / "t" / file) == FileBytes(dir / "overlapped" / "t" / file))
          << where << ": " << file << " differs";
    ExpectSameState(sync, overlapped, where);
    fs::remove_all(dir);
  }
}

// A gate the update's thread waits at before a unit.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  void Wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return open; });
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu);
      open = true;
    }
    cv.notify_all();
  }
};

// Step returns with the root updated and the units still to come; EnterUnit(i)
// returns once unit i is updated.
TEST(OverlappedUpdate, EnterUnitWaitsForItsUnit) {
  TestRun sync = MakeRun(1, false), overlapped = MakeRun(1, true);
  Gate gate;
  overlapped.runtime().set_before_unit_update([&](size_t unit) {
    if (unit == 1) gate.Wait();
  });
  const at::Tensor before = overlapped.net->blocks[1]->w1.clone();
  TrainStep(sync, 1);
  TrainStep(overlapped, 1);
  EXPECT_TRUE(SameBits(overlapped.net->wte, sync.net->wte)) << "the root is updated when Step returns";
  EXPECT_TRUE(SameBits(overlapped.net->blocks[1]->w1, before)) << "unit 1 waits at the gate";
  EXPECT_FALSE(SameBits(before, sync.net->blocks[1]->w1)) << "the step changes unit 1";
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gate.Open();
  });
  const at::Tensor x = at::ones({2});
  EXPECT_TRUE(overlapped.engine->EnterUnit(1, x).is_same(x));
  EXPECT_TRUE(SameBits(overlapped.net->blocks[1]->w1, sync.net->blocks[1]->w1)) << "read after EnterUnit(1)";
  EXPECT_TRUE(SameBits(overlapped.net->blocks[1]->w2, sync.net->blocks[1]->w2)) << "read after EnterUnit(1)";
  opener.join();
  overlapped.engine->WaitForUpdate();
  ExpectSameState(sync, overlapped, "after WaitForUpdate");
}

// A failure of the background update is thrown by the next call that waits
// (here EnterUnit of a later unit), never lost; every later call that waits
// refuses too, naming it, since the state is partly stepped; a checkpoint
// load ends that. The engine's destructor does not hang on a failed update.
TEST(OverlappedUpdate, AFailedUpdateIsThrownAndRefusedUntilALoad) {
  const fs::path dir = fs::temp_directory_path() / ("uckpt_overlap_failed_" + std::to_string(getpid()));
  fs::remove_all(dir);
  TestRun r = MakeRun(2, true);
  r.engine->SaveCheckpoint(dir.string(), "before");
  bool fail = true;
  r.runtime().set_before_unit_update([&](size_t unit) {
    if (fail && unit == 1) throw std::runtime_error("unit 1's update failed");
  });
  TrainStep(r, 1);
  r.engine->EnterUnit(0, at::ones({1}));  // unit 0 was updated
  for (int k = 0; k < 2; ++k) {
    std::string err;
    try {
      if (k == 0) r.engine->EnterUnit(2, at::ones({1}));
      else r.engine->WaitForUpdate();
    } catch (const std::runtime_error& e) {
      err = e.what();
    }
    EXPECT_NE(err.find("unit 1's update failed"), std::string::npos) << k << ": " << err;
    EXPECT_NE(err.find("partly stepped"), std::string::npos) << k << ": " << err;
  }
  EXPECT_THROW(TrainStep(r, 2), std::runtime_error);
  fail = false;
  r.engine->LoadCheckpoint(dir.string(), "before");
  TrainStep(r, 2);  // goes on from the loaded state
  r.engine->WaitForUpdate();
  fail = true;
  TrainStep(r, 3);  // failing again, with nobody waiting: the destructor joins without hanging
  fs::remove_all(dir);
}

// Elsewhere the flag changes nothing: no unit calls without units, and the
// update is synchronous at stage 0 and without offload.
TEST(OverlappedUpdate, OnlyWhereItApplies) {
  TestRun r = MakeRun(1, true);
  EXPECT_TRUE(static_cast<bool>(r.engine->unit_calls().enter));
  auto net = std::make_shared<Net>(7);
  EngineOptions o;
  o.comm = MakeSingleProcessComm();
  o.overlap_update_with_forward = true;  // no gather units
  Engine e(net, TestConfig(1), std::move(o));
  EXPECT_FALSE(static_cast<bool>(e.unit_calls().enter));
  EXPECT_FALSE(dynamic_cast<engine::FlatRuntime&>(*engine::EngineAccess::State(e).runtime).overlaps_update());
}

// Across ranks the updated partitions are all-gathered after the update: it
// stays synchronous there, with the same results.
TEST(OverlappedUpdate, SynchronousAtTwoRanks) {
  engine::testing::RunRanks(2, [](Comm& comm) {
    TestRun sync = MakeRun(2, false, &comm), flagged = MakeRun(2, true, &comm);
    EXPECT_FALSE(flagged.runtime().overlaps_update());
    EXPECT_FALSE(static_cast<bool>(flagged.engine->unit_calls().enter));
    EXPECT_EQ(TrainStep(sync, 1), TrainStep(flagged, 1));
    ExpectSameState(sync, flagged, "rank " + std::to_string(comm.rank()));
  });
}

}  // namespace
}  // namespace uckpt
