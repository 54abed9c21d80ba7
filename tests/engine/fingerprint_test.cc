// The resume proof (engine/fingerprint.h): every save records the state
// fingerprint in its manifest; every load recomputes it from what the engine
// holds and refuses a state that differs, on every rank, naming the
// parameter; DeepSpeed's checkpoints are checked against their files.
#include "engine/fingerprint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <mutex>

#include "ckpt/convert.h"
#include "ckpt/manifest.h"
#include "ckpt/partition.h"
#include "ckpt/zero_checkpoint.h"
#include "cli/trainer.h"
#include "fixture.h"
#include "format/error.h"
#include "format/torch_file.h"
#include "ranks.h"
#include "tiny.h"

namespace uckpt::engine {
namespace {

using cli::Trainer;
using cli::TrainOptions;

namespace fs = std::filesystem;
using testing::RunRanks;

TrainOptions Tiny(int stage, int world, bool bf16 = false) {
  nlohmann::json ds = {{"train_batch_size", 12},
                       {"gradient_accumulation_steps", 12 % (world * 2) == 0 ? 2 : 1},
                       {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}, {"weight_decay", 0.1}}}}},
                       {"zero_optimization", {{"stage", stage}}},
                       {"bf16", {{"enabled", bf16}}}};
  if (stage == 3) ds["zero_optimization"]["sub_group_size"] = 300;
  TrainOptions o = testing::TinyGpt2(ds);
  o.seed = 7;
  o.init_seed = 11;
  return o;
}

TEST(StateFingerprint, TensorOpsEqualTheHostFunction) {
  at::manual_seed(3);
  at::Tensor t = at::randn({100003});
  t[0] = -0.0f;
  t[1] = std::numeric_limits<float>::infinity();
  t[2] = std::numeric_limits<float>::quiet_NaN();
  t[3] = 1e-40f;  // subnormal
  for (uint64_t seed : {uint64_t{0}, ckpt::FingerprintSeed("h.0.attn.c_attn.weight", "fp32"), ~uint64_t{0}})
    for (int64_t start : {int64_t{0}, int64_t{12345}, (int64_t{1} << 33) + 5}) {
      std::vector<uint32_t> bits(static_cast<size_t>(t.numel()));
      std::memcpy(bits.data(), t.data_ptr(), bits.size() * 4);
      const uint64_t want = ckpt::FingerprintBits(seed, start, bits);
      EXPECT_EQ(FingerprintTensorOps(t, seed, start), want) << seed << " " << start;
      EXPECT_EQ(FingerprintTensor(t, seed, start), want) << seed << " " << start;
    }
}

// On a CUDA device (the kernel where it was built): the host function's
// value for chunks that straddle the kernel's blocks and views at an offset.
TEST(StateFingerprint, OnACudaDeviceEqualsTheHostFunction) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(5);
  const at::Tensor t = at::randn({(int64_t{1} << 18) + 77});
  const uint64_t seed = ckpt::FingerprintSeed("wte", "exp_avg");
  for (int64_t off : {int64_t{0}, int64_t{3}, int64_t{65537}}) {
    const at::Tensor v = t.narrow(0, off, t.numel() - off);
    EXPECT_EQ(FingerprintTensor(v.cuda(), seed, off + 9), FingerprintTensor(v, seed, off + 9)) << off;
    EXPECT_EQ(FingerprintTensor(t.cuda().narrow(0, off, t.numel() - off), seed, off), FingerprintTensor(v, seed, off))
        << off;
  }
}

// Saves a stage-2 checkpoint at 2 ranks after 2 steps; returns its folder.
std::string SaveStage2(const std::string& dir) {
  RunRanks(2, [&](Comm& comm) {
    Trainer t(comm, Tiny(2, 2));
    t.TrainStep();
    t.TrainStep();
    t.SaveCheckpoint(dir, "global_step2");
  });
  return dir + "/global_step2";
}

TEST(StateFingerprint, RecordedAtSaveAndCheckedAtEveryLoad) {
  const std::string dir = testing::FreshTempDir("engine_fingerprint");
  const std::string folder = SaveStage2(dir);
  const ckpt::Manifest m = ckpt::ReadManifest(folder);
  ASSERT_TRUE(m.state) << "the save records no state fingerprint";
  // What was recorded is what the files hold.
  const ckpt::StateFingerprint files = ckpt::FingerprintFolder(folder);
  EXPECT_FALSE(ckpt::FirstFingerprintDifference(*m.state, files)) << *ckpt::FirstFingerprintDifference(*m.state, files);
  EXPECT_EQ(m.state->counters.global_steps, 2);
  EXPECT_EQ(m.state->params.front().states.size(), 3u);

  // Loaded at 1 and 3 ranks at stage 2, at 2 ranks at stage 3 and at stage 1
  // weights only: checked against the record.
  struct Case {
    int world, stage;
    bool module_only;
  };
  for (Case c : {Case{1, 2, false}, Case{3, 2, false}, Case{2, 3, false}, Case{3, 3, false}, Case{2, 1, true}})
    RunRanks(c.world, [&](Comm& comm) {
      Trainer t(comm, Tiny(c.stage, c.world));
      LoadCheckpointOptions o;
      o.load_module_only = c.module_only;
      t.engine().LoadCheckpoint(dir, "global_step2", o);
      EXPECT_EQ(t.engine().stats().last_load().fingerprint, "recorded") << c.world << " ranks, stage " << c.stage;
      EXPECT_GT(t.engine().stats().last_load().fingerprint_s, 0);
    });

  // Its universal conversion records the same, and loads checked.
  ckpt::ConvertOptions co;
  co.durable = false;
  ckpt::ConvertToUniversal(folder, dir + "/global_step2_universal", co);
  const ckpt::Manifest u = ckpt::ReadManifest(dir + "/global_step2_universal");
  ASSERT_TRUE(u.state);
  EXPECT_EQ(u.state->total(), m.state->total());
  RunRanks(3, [&](Comm& comm) {
    Trainer t(comm, Tiny(3, 3));
    LoadCheckpointOptions o;
    o.universal = true;
    t.engine().LoadCheckpoint(dir, "global_step2_universal", o);
    EXPECT_EQ(t.engine().stats().last_load().fingerprint, "recorded");
  });
  fs::remove_all(dir);
}

// Rewrites rank 1's optimizer file with one fp32 master element changed, and
// the manifest with the new file hashes but the saved state fingerprint (as
// a bug in a loader, or an edit that also rewrote the hashes, would leave
// it). Returns the parameter that element belongs to.
std::string ChangeOneMasterElement(const std::string& folder) {
  const ckpt::ZeroCheckpoint z = ckpt::OpenZeroCheckpoint(folder);
  std::vector<int64_t> numels;
  for (const auto& p : z.params) numels.push_back(p.numel);
  const ckpt::Fragment first = ckpt::RankFragments(numels, 2, 1).front();
  const std::string name = z.params[first.param].name;

  const std::string path = folder + "/" + ckpt::OptimStatesFileName(1, false);
  TorchFile f = LoadTorchFile(path);
  ValuePtr fp32 = f.root->get("optimizer_state_dict")->get("single_partition_of_fp32_groups")->items[0];
  Tensor& t = *fp32->tensor;
  std::vector<uint8_t> bytes = t.contiguous_bytes();
  float x;
  std::memcpy(&x, bytes.data(), 4);
  x = std::nextafter(x, 1e9f);  // the smallest change there is
  std::memcpy(bytes.data(), &x, 4);
  t.storage = Storage::Owned(std::move(bytes), t.dtype);
  t.storage_offset = 0;
  SaveTorchFile(path + ".new", f.root);
  fs::rename(path + ".new", path);
  const std::optional<ckpt::StateFingerprint> saved = ckpt::ReadManifest(folder).state;
  ckpt::WriteManifest(folder, {}, false, saved ? &*saved : nullptr);
  return name;
}

TEST(StateFingerprint, AChangedMasterElementIsRefusedNamingItsParameter) {
  const std::string dir = testing::FreshTempDir("engine_fingerprint_bad");
  const std::string folder = SaveStage2(dir);
  const std::string name = ChangeOneMasterElement(folder);
  ckpt::CheckFolderAgainstManifest(folder, true);  // the file hashes pass
  for (auto [world, stage] : {std::pair{2, 2}, std::pair{3, 3}}) {
    std::vector<std::string> errors(static_cast<size_t>(world));
    RunRanks(world, [&](Comm& comm) {
      Trainer t(comm, Tiny(stage, world));
      try {
        t.engine().LoadCheckpoint(dir, "global_step2");
      } catch (const FormatError& e) {
        errors[static_cast<size_t>(comm.rank())] = e.what();
      }
    });
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("parameter " + name + " 'fp32' differs"), std::string::npos) << e;
      EXPECT_EQ(e, errors[0]) << "every rank refuses with the same message";
    }
  }
  // Without the optimizer states a stage-3 engine still reads the masters
  // from the rank files: still checked. (A stage-2 engine takes them from
  // the module weights, which this edit left as saved: nothing differs.)
  RunRanks(2, [&](Comm& comm) {
    LoadCheckpointOptions o;
    o.load_optimizer_states = false;
    Trainer z3(comm, Tiny(3, 2));
    EXPECT_THROW(z3.engine().LoadCheckpoint(dir, "global_step2", o), FormatError);
    Trainer z2(comm, Tiny(2, 2));
    z2.engine().LoadCheckpoint(dir, "global_step2", o);
    EXPECT_EQ(z2.engine().stats().last_load().fingerprint, "recorded");
  });
  fs::remove_all(dir);
}

// DeepSpeed's own checkpoints (no record): the expected value is computed
// from their files, ZeRO-2 and ZeRO-3, ZeRO files and universal folder.
TEST(StateFingerprint, DeepSpeedCheckpointsAreCheckedAgainstTheirFiles) {
  for (const char* run : {"z2", "z3"}) {
    const std::string ckpt = testing::RefrunDir() + (std::string(run) == "z2" ? "/ckpt" : "/ckpt_zero3");
    for (bool universal : {false, true})
      RunRanks(3, [&](Comm& comm) {
        nlohmann::json ds = testing::RefrunDsConfig(std::string(run) + "_ws2_baseline");
        ds["train_batch_size"] = 6;
        ds["gradient_accumulation_steps"] = 1;
        Trainer t(comm, testing::RefrunOptions(ds, run));
        LoadCheckpointOptions o;
        o.universal = universal;
        t.engine().LoadCheckpoint(ckpt, universal ? "global_step6_universal" : "global_step6", o);
        EXPECT_EQ(t.engine().stats().last_load().fingerprint, "computed from the files") << run << " " << universal;
        EXPECT_GT(t.engine().stats().last_load().fingerprint_files_s, 0);
      });
  }
}

}  // namespace
}  // namespace uckpt::engine
