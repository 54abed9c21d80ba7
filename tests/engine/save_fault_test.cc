// The engine's checkpoint save (Trainer::SaveCheckpoint) on 2 ranks under
// injected I/O faults: whichever rank fails at whichever point, every rank
// gets an error, `latest` still names the previous checkpoint, that
// checkpoint's files are unchanged, nothing else is left in the folder, and
// the run resumes from it. The same for background (async) saves, whose
// write errors surface at WaitForCheckpoint.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "ckpt/manifest.h"
#include "format/error.h"
#include "format/fault_env.h"
#include "ranks.h"
#include "tiny.h"
#include "engine/checkpoint.h"
#include "cli/trainer.h"

namespace uckpt::engine {
namespace {

using cli::TrainOptions;
using cli::Trainer;

namespace fs = std::filesystem;
using testing::RunRanks;

TrainOptions Tiny() {
  return testing::TinyGpt2({{"train_batch_size", 4},
                            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
                            {"zero_optimization", {{"stage", 2}}}});
}

std::set<std::string> Entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

struct SaveFault {
  const char* name;
  IoOp op;
  std::string path_contains;  // relative to the checkpoint folder's parent
  int error;
  std::string tag = "global_step2";  // the tag the failing save writes
};

class SaveUnderFault : public ::testing::TestWithParam<bool> {};

TEST_P(SaveUnderFault, PreviousCheckpointAndLatestSurvive) {
  const bool async = GetParam();
  const std::string dir = (fs::temp_directory_path() / ("uckpt_save_fault_" + std::to_string(::getpid()) +
                                                        (async ? "_async" : ""))).string();
  fs::remove_all(dir);
  const std::vector<SaveFault> faults = {
      {"prepare_mkdir", IoOp::kCreateDir, ".global_step2.uckpt-tmp", EACCES},
      {"rank1_optim_write", IoOp::kWrite, "zero_pp_rank_1", ENOSPC},
      {"manifest_fsync", IoOp::kSync, ckpt::kManifestName, EIO},
      {"rank0_model_create", IoOp::kCreate, "model_states", ENOSPC},
      {"manifest_write", IoOp::kCreate, ckpt::kManifestName, ENOSPC},
      {"folder_fsync", IoOp::kSyncDir, ".global_step2.uckpt-tmp", EIO},
      {"folder_rename", IoOp::kRename, "/global_step2", EXDEV},
      {"latest_rename", IoOp::kRename, "latest", EIO},
      // Saving over the tag `latest` names: the old folder must survive.
      {"same_tag_rename", IoOp::kRename, "/global_step1", EXDEV, "global_step1"},
  };
  std::unique_ptr<FaultEnv> env;
  std::unique_ptr<ScopedEnv> use;
  std::map<std::string, std::string> saved;
  std::mutex mu;
  std::map<int, std::string> errors;
  RunRanks(2, [&](Comm& comm) {
    const bool rank0 = comm.rank() == 0;
    Trainer t(comm, Tiny());
    // Saved and published (sync: before returning; async: at WaitForCheckpoint).
    auto save = [&](const std::string& tag) {
      SaveCheckpointOptions so;
      so.async_save = async;
      t.engine().SaveCheckpoint(dir, tag, c10::IValue(), so);
      t.engine().WaitForCheckpoint();
    };
    t.TrainStep();
    save("global_step1");
    if (rank0) saved = testing::FolderBytes(dir + "/global_step1");
    t.TrainStep();
    for (const SaveFault& f : faults) {
      comm.Barrier();
      if (rank0) {
        env = std::make_unique<FaultEnv>();
        env->Add({f.op, f.path_contains, 1, f.error});
        use = std::make_unique<ScopedEnv>(*env);
        errors.clear();
      }
      comm.Barrier();
      try {
        save(f.tag);
      } catch (const IoError& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors[comm.rank()] = e.what();
      }
      comm.Barrier();
      if (rank0) {
        SCOPED_TRACE(f.name);
        EXPECT_GE(env->injected(), 1u);
        use.reset();
        env.reset();
        EXPECT_EQ(errors.size(), 2u) << "every rank must see the failure";
        for (const auto& [r, msg] : errors) {
          EXPECT_NE(msg.find(dir + "/" + f.tag), std::string::npos) << "rank " << r << ": " << msg;
          EXPECT_NE(msg.find("not saved"), std::string::npos) << "rank " << r << ": " << msg;
        }
        EXPECT_EQ(testing::ReadBytes(dir + "/latest"), "global_step1");
        EXPECT_EQ(testing::FolderBytes(dir + "/global_step1"), saved);
        // A fault after the folder's rename (`latest`'s) leaves the new
        // folder in place: complete (its manifest checks out), but unnamed
        // by `latest`. Nothing else may be left.
        std::set<std::string> want = {"global_step1", "latest"};
        if (fs::exists(dir + "/global_step2")) {
          EXPECT_EQ(f.name, std::string("latest_rename"));
          EXPECT_EQ(Entries(dir + "/global_step2").size(), 4u);
          EXPECT_TRUE(ckpt::CheckManifest(dir + "/global_step2", {.hashes = true}).ok());
          fs::remove_all(dir + "/global_step2");
        }
        EXPECT_EQ(Entries(dir), want) << "a temporary or half-written checkpoint was left";
      }
    }
    comm.Barrier();
    // No fault: the save goes through, with a manifest of its files.
    save("global_step2");
  });
  EXPECT_EQ(testing::ReadBytes(dir + "/latest"), "global_step2");
  EXPECT_EQ(Entries(dir + "/global_step2"),
            (std::set<std::string>{"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                   "zero_pp_rank_1_mp_rank_00_optim_states.pt", ckpt::kManifestName}));
  EXPECT_TRUE(ckpt::CheckManifest(dir + "/global_step2", {.hashes = true}).ok());
  EXPECT_TRUE(saved.count(ckpt::kManifestName));
  // The checkpoint every failed save left in place still loads.
  RunRanks(2, [&](Comm& comm) {
    Trainer t(comm, Tiny());
    t.LoadCheckpoint(dir, "global_step1", false);
    EXPECT_EQ(t.counters().global_steps, 1);
  });
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(SyncAndAsync, SaveUnderFault, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "async" : "sync"; });

}  // namespace
}  // namespace uckpt::engine
