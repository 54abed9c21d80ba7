// Background checkpoint saves (engine/async_save.h): the files equal a
// synchronous save's of the same state byte for byte (manifest included),
// the snapshot is the state at the call (training on does not change it),
// snapshot buffers are reused, `latest` moves only once published, and a
// failed background write stops the run at a later step naming the file.
#include <gtest/gtest.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "ckpt/manifest.h"
#include "ckpt/parallel.h"
#include "cli/memory_snapshot.h"
#include "cli/trainer.h"
#include "engine/async_save.h"
#include "engine/checkpoint.h"
#include "engine/torch_bridge.h"
#include "format/error.h"
#include "format/fault_env.h"
#include "format/torch_file.h"
#include "ranks.h"
#include "tiny.h"

namespace uckpt::engine {
namespace {

using cli::Trainer;
using cli::TrainOptions;

namespace fs = std::filesystem;
using testing::RunRanks;

TrainOptions Tiny(int stage, bool bf16) {
  return testing::TinyGpt2({{"train_batch_size", 4},
                            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.01}}}}},
                            {"zero_optimization", {{"stage", stage}}},
                            {"bf16", {{"enabled", bf16}}}});
}

std::string TempDir(const std::string& name) { return testing::FreshTempDir("async_" + name); }

SaveCheckpointOptions Async(bool on) {
  SaveCheckpointOptions o;
  o.async_save = on;
  return o;
}

struct Variant {
  int world, stage;
  bool bf16;
};
class AsyncSave : public ::testing::TestWithParam<Variant> {};

TEST_P(AsyncSave, EqualsSyncSaveByteForByte) {
  const Variant v = GetParam();
  const std::string root = TempDir("equal");
  std::vector<std::array<uint64_t, 2>> snapshot(v.world);  // per rank: first and second save
  RunRanks(v.world, [&](Comm& comm) {
    Trainer t(comm, Tiny(v.stage, v.bf16));
    t.TrainStep();
    t.TrainStep();
    t.engine().SaveCheckpoint(root + "/sync", "global_step2", c10::IValue(), Async(false));
    EXPECT_FALSE(t.engine().stats().last_save().async);
    t.engine().SaveCheckpoint(root + "/async", "global_step2", c10::IValue(), Async(true));
    const SaveStats s = t.engine().stats().last_save();
    EXPECT_TRUE(s.async);
    EXPECT_GT(s.snapshot_bytes, 0u);
    snapshot[comm.rank()][0] = s.snapshot_bytes;
    // Training goes on while the files are written: the snapshot is the state at the call.
    t.TrainStep();
    t.TrainStep();
    t.engine().WaitForCheckpoint();
    EXPECT_EQ(testing::ReadBytes(root + "/async/latest"), "global_step2");
    // A second background save reuses the snapshot buffers.
    t.engine().SaveCheckpoint(root + "/async", "global_step4", c10::IValue(), Async(true));
    snapshot[comm.rank()][1] = t.engine().stats().last_save().snapshot_bytes;
    t.engine().SaveCheckpoint(root + "/sync", "global_step4", c10::IValue(), Async(false));  // waits for it
  });
  for (const auto& [first, second] : snapshot) EXPECT_EQ(second, first) << "snapshot memory grew between saves";
  for (const char* tag : {"global_step2", "global_step4"}) {
    const auto a = testing::FolderBytes(root + "/sync/" + tag), b = testing::FolderBytes(root + "/async/" + tag);
    // Optimizer files, model states (stage 3: one per rank), manifest.
    const int files = v.stage == 3 ? 2 * v.world + 1 : (v.stage > 0 ? v.world : 0) + 2;
    EXPECT_EQ(a.size(), static_cast<size_t>(files)) << tag;
    EXPECT_TRUE(a == b) << tag << ": the background save's files differ from the synchronous save's";
  }
  EXPECT_EQ(testing::ReadBytes(root + "/async/latest"), "global_step4");
  fs::remove_all(root);
}

// A memory snapshot takes the folder SaveCheckpointOptions::kReusedSnapshotFolder
// for its own and writes its files over in place (the same files as hard links
// taken before: fs::equivalent), and in the end the folder is byte for byte a
// synchronous save's of the same state: a file grown longer is cut, a file the
// save does not write is gone.
TEST_P(AsyncSave, MemorySnapshotWritesOverTheReusedFolder) {
  const Variant v = GetParam();
  const std::string root = TempDir("reuse");
  const std::string snap = root + "/snap", reuse = snap + "/" + SaveCheckpointOptions::kReusedSnapshotFolder;
  const std::string links = root + "/links";
  SaveCheckpointOptions memory;
  memory.memory_snapshot = true;
  std::vector<std::string> names;
  RunRanks(v.world, [&](Comm& comm) {
    Trainer t(comm, Tiny(v.stage, v.bf16));
    t.TrainStep();
    t.engine().SaveCheckpoint(snap, "global_step1", c10::IValue(), memory);
    t.engine().WaitForCheckpoint();
    if (comm.rank() == 0) {  // what cli::MemorySnapshots does with an older snapshot of the run
      fs::rename(snap + "/global_step1", reuse);
      fs::create_directories(links);
      for (const auto& f : fs::directory_iterator(reuse)) {
        const std::string name = f.path().filename().string();
        if (name == ckpt::kManifestName) continue;
        std::ofstream(f.path(), std::ios::app) << std::string(1000, 'x');
        fs::create_hard_link(f.path(), links + "/" + name);
        names.push_back(name);
      }
      std::ofstream(reuse + "/stray.pt") << "not this save's";
    }
    t.TrainStep();
    t.engine().SaveCheckpoint(snap, "global_step2", c10::IValue(), memory);
    t.engine().WaitForCheckpoint();
    t.engine().SaveCheckpoint(root + "/sync", "global_step2", c10::IValue(), Async(false));
  });
  EXPECT_FALSE(fs::exists(reuse));
  const auto got = testing::FolderBytes(snap + "/global_step2"),
             want = testing::FolderBytes(root + "/sync/global_step2");
  EXPECT_TRUE(got == want) << "the snapshot written over the reused folder differs from a synchronous save";
  EXPECT_FALSE(fs::exists(snap + "/global_step2/stray.pt"));
  for (const std::string& name : names)
    EXPECT_TRUE(fs::equivalent(links + "/" + name, snap + "/global_step2/" + name))
        << name << " was not written over in place";
  EXPECT_EQ(names.size(), want.size() - 1) << "every file but the manifest written over";
  fs::remove_all(root);
}

// cli::MemorySnapshots: each snapshot is written over the run's snapshot two
// before it, at 4 ranks (the same files as hard links taken of the older ones:
// fs::equivalent; the links keep the old files alive, so a match cannot be a
// new file given a freed inode); a folder to reuse that an earlier run left
// with another world's file is written over by the first, and that file is not in it.
TEST(MemorySnapshots, EachIsWrittenOverTheRunsOneTwoBefore) {
  const std::string root = TempDir("snapshots"), ckdir = root + "/ck", links = root + "/links";
  ::setenv("UCKPT_JOB_ID", "reuse-test", 1);
  ::setenv("UCKPT_SNAPSHOT_ROOT", root.c_str(), 1);
  constexpr int kWorld = 4;
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(kWorld).c_str(), 1);
  const std::string folder = cli::SnapshotFolder(root, "reuse-test");
  const std::string earlier = folder + "/" + SaveCheckpointOptions::kReusedSnapshotFolder;
  fs::create_directories(earlier);
  std::ofstream(earlier + "/zero_pp_rank_7_mp_rank_00_optim_states.pt") << "another world's";
  std::ofstream(folder + "/owner") << "job reuse-test\ncheckpoint_dir "
                                   << fs::absolute(ckdir).lexically_normal().string() << "\n";
  fs::create_directories(links);
  bool stray_gone = false;
  std::vector<std::string> names;  // step 1's files, linked into `links`
  std::map<std::string, bool> step3_is_step1;
  RunRanks(kWorld, [&](Comm& comm) {
    Trainer t(comm, Tiny(2, false));
    cli::MemorySnapshots snapshots(t.engine(), comm, 1, ckdir);
    for (int64_t step = 1; step <= 3; ++step) {
      t.TrainStep();
      snapshots.AfterStep(step, /*saved=*/false);
      t.engine().WaitForCheckpoint();
      if (comm.rank() != 0) continue;
      if (step == 1)
        stray_gone =
            !fs::exists(earlier) && !fs::exists(folder + "/global_step1/zero_pp_rank_7_mp_rank_00_optim_states.pt");
      for (const auto& f : fs::directory_iterator(folder + "/global_step" + std::to_string(step))) {
        const std::string name = f.path().filename().string();
        if (name == ckpt::kManifestName) continue;
        if (step == 1) {
          fs::create_hard_link(f.path(), links + "/" + name);
          names.push_back(name);
        }
        if (step == 3) step3_is_step1[name] = fs::equivalent(links + "/" + name, f.path());
      }
    }
    snapshots.Finish();
  });
  ::unsetenv("UCKPT_JOB_ID");
  ::unsetenv("UCKPT_SNAPSHOT_ROOT");
  ::unsetenv("LOCAL_WORLD_SIZE");
  EXPECT_TRUE(stray_gone) << "the earlier run's file is in the first snapshot";
  ASSERT_EQ(names.size(), kWorld + 1u);  // the optimizer files, the model states
  for (const std::string& name : names) EXPECT_TRUE(step3_is_step1[name]) << name << ": not written over";
  EXPECT_FALSE(fs::exists(folder)) << "Finish leaves nothing";
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(WorldStageDtype, AsyncSave,
                         ::testing::Values(Variant{1, 2, false}, Variant{2, 2, false}, Variant{2, 1, true},
                                           Variant{1, 0, false}, Variant{2, 3, false}, Variant{2, 3, true}),
                         [](const auto& info) {
                           return "ws" + std::to_string(info.param.world) + "_stage" +
                                  std::to_string(info.param.stage) + (info.param.bf16 ? "_bf16" : "_fp32");
                         });

// A tensor's bytes streamed to the writer a buffer at a time (what a
// synchronous save does with device tensors; here host tensors stand in)
// give the file its bytes viewed in place give, whatever the buffer's size.
// From 2 MiB on the buffer's halves take turns, one filled (and CRC'd) on
// another thread while the other is written: the 9 MB tensor spans several
// halves, the 2 MiB one exactly two of a 2 MiB buffer.
TEST(StreamedStorage, FileEqualsViewedBytes) {
  const std::string dir = TempDir("streamed");
  fs::create_directories(dir);
  std::vector<at::Tensor> tensors = {at::randn({1000, 3}), at::arange(7, at::kLong), at::empty({0}),
                                     at::randn({33}).to(at::kBFloat16), at::randn({4, 5}).t()};
  auto value = [&](bool streamed) {
    ValuePtr list = Value::List();
    for (const at::Tensor& t : tensors) {
      const at::Tensor c = t.contiguous();
      Tensor v;
      v.dtype = FromScalarType(c.scalar_type());
      v.shape = c.sizes().vec();
      v.stride = Tensor::ContiguousStrides(v.shape);
      v.storage = streamed ? StreamedStorageOf(t)
                           : Storage::View({static_cast<const uint8_t*>(c.data_ptr()), c.nbytes()}, v.dtype,
                                           std::make_shared<at::Tensor>(c));
      list->items.push_back(Value::FromTensor(std::move(v)));
    }
    return list;
  };
  SaveOptions plain;
  plain.durable = false;
  // The same file name (the archive's name inside the zip comes from it), in two folders.
  fs::create_directories(dir + "/viewed");
  fs::create_directories(dir + "/streamed");
  auto check = [&](std::vector<size_t> buffers) {
    SaveTorchFile(dir + "/viewed/x.pt", value(false), plain);
    const std::string want = testing::ReadBytes(dir + "/viewed/x.pt");
    for (size_t buffer : buffers) {
      std::vector<uint8_t> b(buffer);
      SaveOptions o;
      o.durable = false;
      o.stream_buffer = b;
      SaveTorchFile(dir + "/streamed/x.pt", value(true), o);
      EXPECT_TRUE(testing::ReadBytes(dir + "/streamed/x.pt") == want) << "buffer of " << buffer << " bytes";
    }
  };
  check({0, 1, 1000, 4096, 1 << 20});
  tensors.push_back(at::randn({2250001}));
  tensors.push_back(at::randn({1 << 19}));  // 2 MiB
  tensors.push_back(at::randn({7}));
  check({0, 1 << 20, 2 << 20, (3 << 20) + 5});
  EXPECT_THROW(
      LayOutTorchFile(dir + "/x.pt", value(true), [](const auto& s) { return std::vector<uint32_t>(s.size()); }),
      std::invalid_argument);
  if (!HasFailure()) fs::remove_all(dir);
}

// Files written with several threads (laid out, CRCs on every thread; then
// each written by one thread, or in ranges of 256 bytes by several at once)
// are a one-thread save's byte for byte (manifest included), at stages 1-3,
// synchronous and background.
struct ThreadsVariant {
  int stage;
  bool async;
};
class ParallelSave : public ::testing::TestWithParam<ThreadsVariant> {};

TEST_P(ParallelSave, EqualsOneThreadByteForByte) {
  const ThreadsVariant v = GetParam();
  const std::string root = TempDir("threads");
  RunRanks(2, [&](Comm& comm) {
    Trainer t(comm, Tiny(v.stage, v.stage == 1));
    t.TrainStep();
    t.TrainStep();
    // The engine set the pools' default from its host threads; the ranks share it (one process).
    // One thread; 4 (laid out, each file written by one); 4 with ranges of 256 bytes written at once.
    for (const auto& [name, threads, ranges] : {std::tuple{"one", 1, 0}, {"laid_out", 4, 0}, {"ranges", 4, 256}}) {
      comm.Barrier();
      if (comm.rank() == 0) {
        ckpt::SetDefaultThreads(threads);
        SetSaveRangeBytes(ranges);
      }
      comm.Barrier();
      t.engine().SaveCheckpoint(root + "/" + name, "global_step2", c10::IValue(), Async(v.async));
      t.engine().WaitForCheckpoint();
    }
    comm.Barrier();
    if (comm.rank() == 0) {
      ckpt::SetDefaultThreads(0);
      SetSaveRangeBytes(0);
    }
  });
  const auto one = testing::FolderBytes(root + "/one/global_step2");
  EXPECT_GE(one.size(), 3u);
  for (const char* name : {"laid_out", "ranges"})
    EXPECT_TRUE(testing::FolderBytes(root + "/" + name + "/global_step2") == one)
        << name << ": files written by 4 threads differ from one thread's";
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(StageAsync, ParallelSave,
                         ::testing::Values(ThreadsVariant{1, false}, ThreadsVariant{2, false}, ThreadsVariant{3, false},
                                           ThreadsVariant{2, true}, ThreadsVariant{3, true}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) + (info.param.async ? "_async" : "_sync");
                         });

// Rank 1's optimizer file failed the save of global_step2: each rank's error
// says so (rank 1's names the file); `latest` and global_step1 stay, nothing
// of global_step2 is left. Removes `dir`.
void ExpectStep2FailedOnRank1sOptimizerFile(const std::string& dir, const std::map<int, std::string>& errors) {
  EXPECT_NE(errors.at(1).find("zero_pp_rank_1_mp_rank_00_optim_states.pt"), std::string::npos) << errors.at(1);
  for (const auto& [r, msg] : errors) EXPECT_NE(msg.find("global_step2 not saved"), std::string::npos) << msg;
  EXPECT_EQ(testing::ReadBytes(dir + "/latest"), "global_step1");
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.insert(e.path().filename().string());
  EXPECT_EQ(left, (std::set<std::string>{"global_step1", "latest"}));
  fs::remove_all(dir);
}

// A write failing in one of the threads writing rank 1's optimizer file
// fails a synchronous save on every rank, naming the file on rank 1; the
// previous checkpoint and `latest` stay and nothing of the failed tag is left.
TEST(ParallelSaveFault, WriteFailureInOneThreadFailsTheSave) {
  const std::string dir = TempDir("threads_fault");
  std::unique_ptr<FaultEnv> env;
  std::unique_ptr<ScopedEnv> use;
  std::mutex mu;
  std::map<int, std::string> errors;
  RunRanks(2, [&](Comm& comm) {
    Trainer t(comm, Tiny(2, false));
    t.TrainStep();
    comm.Barrier();
    if (comm.rank() == 0) {
      ckpt::SetDefaultThreads(4);
      SetSaveRangeBytes(256);
    }
    comm.Barrier();
    t.engine().SaveCheckpoint(dir, "global_step1", c10::IValue(), Async(false));
    comm.Barrier();
    if (comm.rank() == 0) {
      env = std::make_unique<FaultEnv>();
      env->Add({IoOp::kWrite, "zero_pp_rank_1", 3, ENOSPC, /*once=*/true});
      use = std::make_unique<ScopedEnv>(*env);
    }
    comm.Barrier();
    try {
      t.engine().SaveCheckpoint(dir, "global_step2", c10::IValue(), Async(false));
    } catch (const IoError& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors[comm.rank()] = e.what();
    }
    comm.Barrier();
    if (comm.rank() == 0) {
      EXPECT_EQ(env->injected(), 1u);
      use.reset();
      env.reset();
      ckpt::SetDefaultThreads(0);
      SetSaveRangeBytes(0);
    }
  });
  ASSERT_EQ(errors.size(), 2u) << "every rank must see the failure";
  ExpectStep2FailedOnRank1sOptimizerFile(dir, errors);
}

// A background write that fails (rank 1's optimizer file, ENOSPC) fails the
// run at a later step on every rank, rank 1 naming the file; `latest` and
// the previous checkpoint stay; no folder of the failed tag is left.
TEST(AsyncSaveFault, FailedBackgroundWriteStopsTheRunNamingTheFile) {
  const std::string dir = TempDir("fault");
  std::unique_ptr<FaultEnv> env;
  std::unique_ptr<ScopedEnv> use;
  std::mutex mu;
  std::map<int, std::string> errors;
  std::map<int, int> steps_until_error;
  RunRanks(2, [&](Comm& comm) {
    Trainer t(comm, Tiny(2, false));
    t.TrainStep();
    t.engine().SaveCheckpoint(dir, "global_step1", c10::IValue(), Async(true));
    t.engine().WaitForCheckpoint();
    comm.Barrier();
    if (comm.rank() == 0) {
      env = std::make_unique<FaultEnv>();
      env->Add({IoOp::kWrite, "zero_pp_rank_1", 1, ENOSPC});
      use = std::make_unique<ScopedEnv>(*env);
    }
    comm.Barrier();
    t.engine().SaveCheckpoint(dir, "global_step2", c10::IValue(), Async(true));
    int steps = 0;
    try {
      for (; steps < 50; ++steps) t.TrainStep();
    } catch (const IoError& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors[comm.rank()] = e.what();
      steps_until_error[comm.rank()] = steps;
    }
    comm.Barrier();
    if (comm.rank() == 0) {
      use.reset();
      env.reset();
    }
  });
  ASSERT_EQ(errors.size(), 2u) << "every rank must stop";
  EXPECT_EQ(steps_until_error[0], steps_until_error[1]) << "the ranks stopped at different steps";
  ExpectStep2FailedOnRank1sOptimizerFile(dir, errors);
}

}  // namespace
}  // namespace uckpt::engine
