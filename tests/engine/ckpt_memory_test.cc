// Host memory of checkpoint saves and resumes (#25): a synchronous save
// views the host-resident state where it lies (no snapshot of it), an async
// save keeps its snapshot, and a resume's resident memory is the partitions
// it fills, not also the pages of the files it read (they are dropped once
// copied). Peak RSS is VmHWM, reset before each phase (/proc/self/clear_refs).
#include <gtest/gtest.h>
#include <malloc.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "cli/trainer.h"
#include "ranks.h"
#include "tiny.h"

namespace uckpt::engine {
namespace {

using cli::Trainer;
using cli::TrainOptions;
namespace fs = std::filesystem;

// A GPT-2 of 2.9M parameters: its fp32 optimizer state (master, exp_avg,
// exp_avg_sq) is 35 MB, enough to tell its pages from the allocator's noise.
TrainOptions Model(int stage) {
  nlohmann::json zero = {{"stage", stage}, {"offload_optimizer", {{"device", "cpu"}}}};
  if (stage == 3) zero["offload_param"] = {{"device", "cpu"}};
  return testing::TinyGpt2({{"train_batch_size", 2},
                            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.001}}}}},
                            {"zero_optimization", zero}},
                           {.n_layer = 3, .n_embd = 256, .vocab_size = 2048, .n_positions = 16});
}

int64_t StatusKb(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  return -1;
}

// Whether VmHWM can be reset (Linux >= 4.0, /proc writable).
bool ResetPeak() {
  malloc_trim(0);
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return out.good() && StatusKb("VmHWM") >= 0;
}

// Bytes the peak RSS rose above the RSS at the start of `fn`.
template <typename F>
int64_t ExtraPeakBytes(F&& fn) {
  if (!ResetPeak()) return -1;
  const int64_t before = StatusKb("VmRSS");
  fn();
  return (StatusKb("VmHWM") - before) * 1024;
}

uint64_t OptimFileBytes(const std::string& folder) {
  uint64_t n = 0;
  for (const auto& f : fs::directory_iterator(folder))
    if (f.path().filename().string().find("optim_states") != std::string::npos) n += f.file_size();
  return n;
}

class CheckpointMemory : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointMemory, SyncSaveViewsHostStateAndResumeDropsFilePages) {
  const int stage = GetParam();
  if (!ResetPeak()) GTEST_SKIP() << "/proc/self/clear_refs cannot reset the peak RSS here";
  const std::string root = testing::FreshTempDir("ckpt_memory_stage" + std::to_string(stage));
  // Two ranks train a step (Adam's moments exist) and save, synchronously
  // then in the background.
  testing::RunRanks(2, [&](Comm& comm) {
    Trainer t(comm, Model(stage));
    t.TrainStep();
    SaveCheckpointOptions sync;
    sync.async_save = false;
    t.engine().SaveCheckpoint(root + "/sync", "step1", c10::IValue(), sync);
    // The offloaded state is on the host: nothing is copied for the save.
    EXPECT_EQ(t.engine().stats().last_save().snapshot_bytes, 0u) << "rank " << comm.rank();
    SaveCheckpointOptions async;
    async.async_save = true;
    t.engine().SaveCheckpoint(root + "/async", "step1", c10::IValue(), async);
    // A background save keeps its copy of the state: at least the fp32 master and moments.
    EXPECT_GT(t.engine().stats().last_save().snapshot_bytes, OptimFileBytes(root + "/sync/step1") / 2 * 9 / 10);
    t.engine().WaitForCheckpoint();
  });
  const std::string folder = root + "/sync/step1";
  const uint64_t file_bytes = OptimFileBytes(folder);
  ASSERT_GT(file_bytes, 30u << 20);
  // One rank resumes the two ranks' checkpoint: the files' pages do not stay resident.
  testing::RunRanks(1, [&](Comm& comm) {
    Trainer t(comm, Model(stage));
    t.TrainStep();  // its moments exist: the load replaces them
    const int64_t extra = ExtraPeakBytes([&] { t.engine().LoadCheckpoint(root + "/sync", "step1"); });
    EXPECT_LT(extra, static_cast<int64_t>(file_bytes / 4 + (8 << 20)))
        << "the resume's peak RSS rose by " << extra << " bytes; the optimizer files hold " << file_bytes;
    // A synchronous save of a world of 1 adds no more than its file buffers.
    SaveCheckpointOptions sync;
    sync.async_save = false;
    const int64_t save_extra =
        ExtraPeakBytes([&] { t.engine().SaveCheckpoint(root + "/again", "step1", c10::IValue(), sync); });
    EXPECT_LT(save_extra, static_cast<int64_t>(file_bytes / 4 + (8 << 20)))
        << "the synchronous save's peak RSS rose by " << save_extra << " bytes; its state is " << file_bytes;
  });
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(Stage, CheckpointMemory, ::testing::Values(2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

}  // namespace
}  // namespace uckpt::engine
