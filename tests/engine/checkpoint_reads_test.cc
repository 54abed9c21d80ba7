// A load opens its tag folder once (ckpt/tag_folder.h): counted at the I/O
// seam (format/env.h), each rank's load lists the folder once and reads its
// manifest once, whatever the folder (ZeRO 0-3, universal, without a
// manifest), the stage it loads into and the options.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <map>
#include <mutex>

#include "../format/counting_env.h"
#include "ckpt/convert.h"
#include "ckpt/manifest.h"
#include "format/env.h"
#include "ranks.h"
#include "tiny.h"

namespace uckpt::engine {
namespace {

namespace fs = std::filesystem;
using cli::Trainer;
using testing::RunRanks;

using uckpt::testing::CountingEnv;

cli::TrainOptions Options(int stage) {
  return testing::TinyGpt2({{"train_batch_size", 4},
                            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
                            {"zero_optimization", {{"stage", stage}}}});
}

// <dir>/step1: two steps at `stage` on two ranks (one at stage 0, whose
// checkpoints every rank holds whole).
std::string Save(const std::string& name, int stage) {
  const std::string dir = testing::FreshTempDir("reads_" + name);
  RunRanks(stage == 0 ? 1 : 2, [&](Comm& comm) {
    Trainer t(comm, Options(stage));
    t.TrainStep();
    t.TrainStep();
    t.SaveCheckpoint(dir, "step1");
  });
  return dir;
}

struct Counts {
  int lists = 0, manifest_reads = 0;
};

// Loads <dir>/<tag> at `stage` on `world` ranks; what the loads did to the folder.
Counts CountLoad(const std::string& dir, const std::string& tag, int stage, int world,
                 const std::function<void(LoadCheckpointOptions&)>& edit = nullptr) {
  CountingEnv env;
  ScopedEnv scoped(env);  // one override for every rank's thread
  RunRanks(world, [&](Comm& comm) {
    Trainer t(comm, Options(stage));
    LoadCheckpointOptions lo;
    lo.universal = tag.ends_with("_universal");
    if (edit) edit(lo);
    EXPECT_EQ(t.engine().LoadCheckpoint(dir, tag, lo).path, dir + "/" + tag);
  });
  const std::string folder = dir + "/" + tag;
  return {env.lists(folder), env.maps(folder + "/" + ckpt::kManifestName)};
}

void ExpectOncePerRank(const Counts& c, int world, bool manifest = true) {
  EXPECT_EQ(c.lists, world);
  EXPECT_EQ(c.manifest_reads, manifest ? world : 0);
}

TEST(CheckpointReads, RankFilesOfEveryStage) {
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const std::string dir = Save("z" + std::to_string(stage), stage);
    ExpectOncePerRank(CountLoad(dir, "step1", stage, 2), 2);
    ExpectOncePerRank(CountLoad(dir, "step1", stage == 3 ? 1 : 3, 1), 1);  // another stage and world size
    ExpectOncePerRank(CountLoad(dir, "step1", stage, 2, [](auto& lo) { lo.verify_hashes = true; }), 2);
    fs::remove_all(dir);
  }
}

TEST(CheckpointReads, WeightsOnlyAndStage0) {
  const std::string z2 = Save("weights", 2);
  ExpectOncePerRank(CountLoad(z2, "step1", 2, 2, [](auto& lo) { lo.load_module_only = true; }), 2);
  ExpectOncePerRank(CountLoad(z2, "step1", 2, 2, [](auto& lo) { lo.load_optimizer_states = false; }), 2);
  fs::remove_all(z2);
  const std::string z0 = Save("stage0", 0);
  ExpectOncePerRank(CountLoad(z0, "step1", 0, 1), 1);
  ExpectOncePerRank(CountLoad(z0, "step1", 2, 2), 2);
  fs::remove_all(z0);
}

TEST(CheckpointReads, UniversalFolder) {
  const std::string dir = Save("universal", 3);
  ckpt::ConvertOptions co;
  co.durable = false;
  ckpt::ConvertToUniversal(dir + "/step1", dir + "/step1_universal", co);
  ExpectOncePerRank(CountLoad(dir, "step1_universal", 2, 2), 2);
  ExpectOncePerRank(CountLoad(dir, "step1_universal", 3, 1), 1);
  fs::remove_all(dir);
}

// Without a manifest (DeepSpeed's folders) the fingerprint is computed from
// the files; reading the weights from the model states, that takes the
// layout of rank files the load did not read, from the same listing.
TEST(CheckpointReads, FolderWithoutManifest) {
  const std::string dir = Save("no_manifest", 2);
  fs::remove(dir + "/step1/" + ckpt::kManifestName);
  ExpectOncePerRank(CountLoad(dir, "step1", 2, 2), 2, false);
  ExpectOncePerRank(CountLoad(dir, "step1", 2, 2, [](auto& lo) { lo.load_optimizer_states = false; }), 2, false);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace uckpt::engine
