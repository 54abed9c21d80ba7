// The engine's checkpoint save (Trainer::SaveCheckpoint) on 2 ranks under
// injected I/O faults: whichever rank fails at whichever point, every rank
// gets an error, `latest` still names the previous checkpoint, that
// checkpoint's files are unchanged, nothing else is left in the folder, and
// the run resumes from it. The same for background (async) saves, whose
// write errors surface at WaitForCheckpoint.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "ckpt/manifest.h"
#include "cli/trainer.h"
#include "engine/checkpoint.h"
#include "format/error.h"
#include "format/fault_env.h"
#include "ranks.h"
#include "tiny.h"

namespace uckpt::engine {
namespace {

using cli::Trainer;
using cli::TrainOptions;

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
  const std::string dir =
      (fs::temp_directory_path() / ("uckpt_save_fault_" + std::to_string(::getpid()) + (async ? "_async" : "")))
          .string();
  fs::remove_all(dir);
  std::vector<SaveFault> faults = {
      {"prepare_mkdir", IoOp::kCreateDir, ".global_step2.uckpt-tmp", EACCES},
      {"rank1_optim_write", IoOp::kWrite, "zero_pp_rank_1", ENOSPC},
      {"rank0_model_create", IoOp::kCreate, "model_states", ENOSPC},
      {"manifest_write", IoOp::kCreate, ckpt::kManifestName, ENOSPC},
      {"folder_rename", IoOp::kRename, "/global_step2", EXDEV},
      {"latest_rename", IoOp::kRename, "latest", EIO},
      // Saving over the tag `latest` names: the old folder must survive.
      {"same_tag_rename", IoOp::kRename, "/global_step1", EXDEV, "global_step1"},
  };
  if (async) {  // made durable before it is published
    faults.push_back({"manifest_fsync", IoOp::kSync, ckpt::kManifestName, EIO});
    faults.push_back({"folder_fsync", IoOp::kSyncDir, ".global_step2.uckpt-tmp", EIO});
  } else {
    // A new tag is published before durable, after its marker; over an
    // existing tag the save is durable first.
    faults.push_back({"marker_create", IoOp::kCreate, ".global_step2.uckpt-unsynced", ENOSPC});
    faults.push_back({"marker_fsync", IoOp::kSync, ".global_step2.uckpt-unsynced", EIO});
    faults.push_back({"same_tag_manifest_fsync", IoOp::kSync, ckpt::kManifestName, EIO, "global_step1"});
    faults.push_back({"same_tag_folder_fsync", IoOp::kSyncDir, ".global_step1.uckpt-tmp", EIO, "global_step1"});
  }
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
        EXPECT_FALSE(ckpt::ReadUnsyncedMarker(dir + "/global_step1"));
        // A fault after the folder's rename (`latest`'s) leaves the new
        // folder in place: complete (its manifest checks out), but unnamed
        // by `latest`; published before durable, still marked unsynced
        // (not known durable on every rank). Nothing else may be left.
        std::set<std::string> want = {"global_step1", "latest"};
        if (fs::exists(dir + "/global_step2")) {
          EXPECT_EQ(f.name, std::string("latest_rename"));
          EXPECT_EQ(Entries(dir + "/global_step2").size(), 4u);
          EXPECT_TRUE(ckpt::CheckManifest(dir + "/global_step2", {.hashes = true}).ok());
          EXPECT_EQ(ckpt::ReadUnsyncedMarker(dir + "/global_step2").has_value(), !async);
          fs::remove_all(dir + "/global_step2");
          fs::remove(ckpt::UnsyncedMarkerPath(dir + "/global_step2"));
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

// A synchronous save of a new tag returns published (the folder complete and
// named by `latest`, as DeepSpeed's save returns) with its unsynced marker
// beside it; the next collective wait makes it durable and removes the
// marker. A save over an existing tag is durable first and leaves none.
TEST(SaveDurability, PublishedAtOnceAndMarkedUntilDurable) {
  const std::string dir = testing::FreshTempDir("durability_published");
  const std::string step1 = dir + "/global_step1";
  RunRanks(2, [&](Comm& comm) {
    Trainer t(comm, Tiny());
    t.TrainStep();
    t.SaveCheckpoint(dir, "global_step1");
    comm.Barrier();
    if (comm.rank() == 0) {
      EXPECT_EQ(testing::ReadBytes(dir + "/latest"), "global_step1");
      EXPECT_TRUE(ckpt::CheckManifest(step1, {.hashes = true}).ok());
      ASSERT_TRUE(ckpt::ReadUnsyncedMarker(step1));
      EXPECT_EQ(*ckpt::ReadUnsyncedMarker(step1), "");  // no checkpoint before it
    }
    comm.Barrier();
    t.engine().WaitForCheckpoint();
    comm.Barrier();
    if (comm.rank() == 0) {
      EXPECT_FALSE(ckpt::ReadUnsyncedMarker(step1));
      EXPECT_EQ(Entries(dir), (std::set<std::string>{"global_step1", "latest"}));
    }
    t.TrainStep();
    t.SaveCheckpoint(dir, "global_step2");
    comm.Barrier();
    if (comm.rank() == 0) {
      EXPECT_EQ(ckpt::ReadUnsyncedMarker(dir + "/global_step2").value_or("none"), "global_step1");
    }
    comm.Barrier();
    t.engine().WaitForCheckpoint();
    comm.Barrier();
    if (comm.rank() == 0) {  // as an interrupted save of the tag would leave it
      std::ofstream stale(ckpt::UnsyncedMarkerPath(dir + "/global_step2"));
      stale << "global_step1";
    }
    comm.Barrier();
    t.SaveCheckpoint(dir, "global_step2");  // over the tag: durable first, then the stale marker goes
    comm.Barrier();
    if (comm.rank() == 0) {
      EXPECT_FALSE(ckpt::ReadUnsyncedMarker(dir + "/global_step2"));
      EXPECT_EQ(Entries(dir), (std::set<std::string>{"global_step1", "global_step2", "latest"}));
    }
    t.TrainStep();
    t.SaveCheckpoint(dir, "global_step3");
  });
  // The run ended without a wait: every rank on one host, rank 0's own sync covered the files.
  EXPECT_EQ(Entries(dir), (std::set<std::string>{"global_step1", "global_step2", "global_step3", "latest"}));
  EXPECT_EQ(testing::ReadBytes(dir + "/latest"), "global_step3");
  fs::remove_all(dir);
}

// Fails the first syncfs it sees, and only that one.
class FailFirstSyncfs : public EnvWrapper {
 public:
  using EnvWrapper::EnvWrapper;
  void SyncFilesystem(const std::string& path) override {
    if (calls++ == 0) throw IoError("cannot sync the filesystem of " + path + ": Input/output error");
    EnvWrapper::SyncFilesystem(path);
  }
  std::atomic<int> calls{0};
};

// Counts the files dropped from the page cache.
class CountDrops : public EnvWrapper {
 public:
  using EnvWrapper::EnvWrapper;
  void DropCached(const std::string& path) override {
    ++drops;
    EnvWrapper::DropCached(path);
  }
  std::atomic<int> drops{0};
};

// A failed sync of a published save is every rank's error at the next wait,
// naming the folder (one rank's syncfs fails: the others learn of it only by
// agreeing); the folder stays published and marked.
TEST(SaveDurability, FailedSyncIsEveryRanksError) {
  const std::string dir = testing::FreshTempDir("durability_failed_sync");
  std::unique_ptr<FailFirstSyncfs> env;
  std::unique_ptr<ScopedEnv> use;
  std::mutex mu;
  std::map<int, std::string> errors;
  RunRanks(2, [&](Comm& comm) {
    Trainer t(comm, Tiny());
    t.TrainStep();
    comm.Barrier();
    if (comm.rank() == 0) {
      env = std::make_unique<FailFirstSyncfs>(Env::Current());
      use = std::make_unique<ScopedEnv>(*env);
    }
    comm.Barrier();
    t.SaveCheckpoint(dir, "global_step1");
    try {
      t.engine().WaitForCheckpoint();
    } catch (const IoError& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors[comm.rank()] = e.what();
    }
    comm.Barrier();
    if (comm.rank() == 0) {
      EXPECT_EQ(env->calls.load(), 2) << "one syncfs per rank";
      use.reset();
      env.reset();
    }
  });
  ASSERT_EQ(errors.size(), 2u) << "every rank must see the failure";
  for (const auto& [r, msg] : errors) {
    EXPECT_NE(msg.find(dir + "/global_step1 is saved and published, but could not be made durable"), std::string::npos)
        << "rank " << r << ": " << msg;
  }
  EXPECT_EQ(testing::ReadBytes(dir + "/latest"), "global_step1");
  EXPECT_TRUE(ckpt::ReadUnsyncedMarker(dir + "/global_step1"));
  fs::remove_all(dir);
}

// What a reader does with a folder whose marker is still there, as after a
// power loss: every file is checked by hash (a changed byte is found without
// verify_checkpoint), and a folder cut short is refused on every rank,
// naming the previous checkpoint; intact, it loads and, once every rank has
// synced it, loses its marker (a folder that could not be synced keeps it).
TEST(SaveDurability, UnsyncedFolderIsCheckedByHashUnmarkedWhenWholeAndRefusedWhenCutShort) {
  const std::string dir = testing::FreshTempDir("durability_unsynced");
  RunRanks(2, [&](Comm& comm) {
    Trainer t(comm, Tiny());
    t.TrainStep();
    t.SaveCheckpoint(dir, "global_step1");
    t.TrainStep();
    t.SaveCheckpoint(dir, "global_step2");
    t.engine().WaitForCheckpoint();
  });
  const std::string step2 = dir + "/global_step2";
  auto mark = [&] {
    std::ofstream marker(ckpt::UnsyncedMarkerPath(step2));  // as a crash before the sync ended leaves it
    marker << "global_step1";
  };
  mark();
  auto resume = [&] {
    std::vector<std::string> errors(2);
    RunRanks(2, [&](Comm& comm) {
      Trainer t(comm, Tiny());
      try {
        t.LoadCheckpoint(dir, "", false);
        EXPECT_EQ(t.counters().global_steps, 2);
      } catch (const FormatError& e) {
        errors[comm.rank()] = e.what();
      }
    });
    return errors;
  };
  {
    FailFirstSyncfs failing(Env::Current());
    ScopedEnv use(failing);
    EXPECT_EQ(resume(), std::vector<std::string>(2)) << "an intact folder loads even if it cannot be synced";
    EXPECT_EQ(failing.calls.load(), 2) << "one syncfs per rank";
  }
  EXPECT_TRUE(ckpt::ReadUnsyncedMarker(step2)) << "a folder not synced keeps its marker";
  {
    int files = 0;
    for (const auto& entry : fs::directory_iterator(step2)) files += entry.is_regular_file() ? 1 : 0;
    CountDrops counting(Env::Current());
    ScopedEnv use(counting);
    EXPECT_EQ(resume(), std::vector<std::string>(2)) << "an intact folder loads";
    EXPECT_EQ(counting.drops.load(), 2 * files) << "each rank reads the files back from the disk, not the cache";
  }
  EXPECT_FALSE(ckpt::ReadUnsyncedMarker(step2)) << "a load that checked every file by hash and synced them unmarks it";
  mark();
  const std::string victim = step2 + "/" + ckpt::OptimStatesFileName(1, false);
  const auto size = fs::file_size(victim);
  testing::FlipByte(victim, size / 2);
  ASSERT_FALSE(ckpt::CheckManifest(step2, {.hashes = true}).ok());
  for (const std::string& e : resume()) {
    EXPECT_NE(e.find(step2 + " was published before its files were on disk"), std::string::npos) << e;
    EXPECT_NE(e.find("'global_step1' (load that tag)"), std::string::npos) << e;
    EXPECT_NE(e.find(victim + ": content differs"), std::string::npos) << e;
  }
  fs::resize_file(victim, size / 2);
  for (const std::string& e : resume()) EXPECT_NE(e.find(victim + ": size"), std::string::npos) << e;
  EXPECT_TRUE(ckpt::ReadUnsyncedMarker(step2)) << "a refused folder keeps its marker";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace uckpt::engine
