// The I/O seam (format/env.h) under injected faults: short writes, ENOSPC,
// EIO, a failing fsync or rename. Each must surface as an IoError naming the
// file, and leave nothing under the final name but what was there before.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "format/error.h"
#include "format/fault_env.h"
#include "format/file.h"
#include "format/torch_file.h"
#include "format/value.h"

namespace uckpt {
namespace {

namespace fs = std::filesystem;

class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');  // parameterized: "Test/param"
    dir_ = fs::temp_directory_path() / ("uckpt_env_test_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  static std::string Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  static void WriteText(const std::string& path, const std::string& text) { std::ofstream(path) << text; }
  std::set<std::string> Entries() const {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.insert(e.path().filename().string());
    return out;
  }

  fs::path dir_;
};

// 3 MiB + a bit: more than AtomicFile's 1 MiB buffer, so it takes several writes.
std::vector<uint8_t> Payload() {
  std::vector<uint8_t> v(3 * (1 << 20) + 12345);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(i * 131 + (i >> 11));
  return v;
}

void WriteAtomically(const std::string& path, const std::vector<uint8_t>& data) {
  AtomicFile f(path);
  // In pieces of odd sizes, the way the zip writer feeds it.
  for (size_t at = 0; at < data.size();) {
    size_t n = std::min<size_t>(data.size() - at, 70001);
    f.Write(std::span<const uint8_t>(data.data() + at, n));
    at += n;
  }
  f.Commit();
}

TEST_F(EnvTest, ShortWritesStillWriteEverything) {
  FaultEnv env;
  env.set_short_writes(true);
  ScopedEnv use(env);
  const auto data = Payload();
  WriteAtomically(Path("out.bin"), data);
  const std::string got = Read(Path("out.bin"));
  ASSERT_EQ(got.size(), data.size());
  EXPECT_TRUE(std::equal(data.begin(), data.end(), reinterpret_cast<const uint8_t*>(got.data())));
  // Each 1 MiB flush took ~20 halvings: many more write calls than without.
  EXPECT_GT(env.write_points(), 40u);
  EXPECT_EQ(Entries(), std::set<std::string>{"out.bin"});
}

// OverwriteFile writes over a longer file in place: the same file (as a hard
// link taken before: fs::equivalent), and in
// the end exactly the new bytes (cut at Close), written front to back or in
// ranges by several threads after Allocate.
TEST_F(EnvTest, OverwriteFileKeepsTheFileAndEndsWithTheNewBytes) {
  const auto old_bytes = Payload();
  std::vector<uint8_t> data(old_bytes.size() / 2 + 7);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(255 - i % 251);
  for (bool ranges : {false, true}) {
    const std::string path = Path(ranges ? "ranges.bin" : "sequential.bin");
    WriteAtomically(path, old_bytes);
    fs::create_hard_link(path, path + ".before");
    auto f = Env::Posix().OverwriteFile(path);
    EXPECT_EQ(fs::file_size(path), old_bytes.size()) << "opened truncated: its pages were freed";
    if (ranges) {
      f->Allocate(data.size());
      const size_t half = data.size() / 2;
      std::thread second([&] { f->WriteAt(half, std::span<const uint8_t>(data).subspan(half)); });
      f->WriteAt(0, std::span<const uint8_t>(data).first(half));
      second.join();
    } else {
      for (size_t at = 0; at < data.size();) at += f->Write(std::span<const uint8_t>(data).subspan(at));
    }
    f->Close();
    EXPECT_TRUE(fs::equivalent(path, path + ".before")) << "the file was not written over in place";
    const std::string got = Read(path);
    ASSERT_EQ(got.size(), data.size()) << (ranges ? "ranges" : "sequential");
    EXPECT_TRUE(std::equal(data.begin(), data.end(), reinterpret_cast<const uint8_t*>(got.data())));
  }
  // A new file, and an Env without its own (a wrapper): as NewWritableFile.
  FaultEnv env;
  ScopedEnv use(env);
  auto f = Env::Current().OverwriteFile(Path("new.bin"));
  for (size_t at = 0; at < data.size();) at += f->Write(std::span<const uint8_t>(data).subspan(at));
  f->Close();
  EXPECT_EQ(Read(Path("new.bin")).size(), data.size());
  EXPECT_GE(env.write_points(), 2u);  // the wrapper's create and write: its faults apply
}

TEST_F(EnvTest, WritePointsOfOneSmallDurableFile) {
  FaultEnv env;
  ScopedEnv use(env);
  AtomicFile f(Path("latest"));
  f.Write(std::string("global_step5"));
  f.Commit();
  // create, write, fsync, rename, fsync of the folder
  EXPECT_EQ(env.write_points(), 5u);
  EXPECT_EQ(Read(Path("latest")), "global_step5");
}

TEST_F(EnvTest, ScopedEnvRestoresThePrevious) {
  Env* before = &Env::Current();
  {
    FaultEnv env;
    ScopedEnv use(env);
    EXPECT_EQ(&Env::Current(), &env);
  }
  EXPECT_EQ(&Env::Current(), before);
  EXPECT_EQ(&Env::Current(), &Env::Posix());
}

struct FaultCase {
  const char* name;
  Fault fault;
  bool short_writes = false;
};

void PrintTo(const FaultCase& c, std::ostream* os) { *os << c.name; }

class AtomicFileFault : public EnvTest, public ::testing::WithParamInterface<FaultCase> {};

TEST_P(AtomicFileFault, ErrorNamesTheFileAndTheOldFileStays) {
  const FaultCase& c = GetParam();
  WriteText(Path("out.bin"), "the previous version");
  FaultEnv env;
  env.Add(c.fault);
  env.set_short_writes(c.short_writes);
  ScopedEnv use(env);
  try {
    WriteAtomically(Path("out.bin"), Payload());
    FAIL() << "no error";
  } catch (const IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(Path("out.bin")), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::strerror(c.fault.error)), std::string::npos) << msg;
  }
  EXPECT_EQ(env.injected(), 1u);
  EXPECT_EQ(Read(Path("out.bin")), "the previous version");
  EXPECT_EQ(Entries(), std::set<std::string>{"out.bin"}) << "the temporary file was not removed";
}

INSTANTIATE_TEST_SUITE_P(Faults, AtomicFileFault,
                         ::testing::Values(FaultCase{"create_enospc", {IoOp::kCreate, "out.bin", 1, ENOSPC}},
                                           FaultCase{"first_write_enospc", {IoOp::kWrite, "out.bin", 1, ENOSPC}},
                                           FaultCase{"third_write_enospc", {IoOp::kWrite, "out.bin", 3, ENOSPC}},
                                           // A short write, then the disk is full.
                                           FaultCase{
                                               "short_write_then_enospc", {IoOp::kWrite, "out.bin", 2, ENOSPC}, true},
                                           FaultCase{"write_eio", {IoOp::kWrite, "out.bin", 2, EIO}},
                                           FaultCase{"fsync_eio", {IoOp::kSync, "out.bin", 1, EIO}},
                                           FaultCase{"rename_exdev", {IoOp::kRename, "out.bin", 1, EXDEV}},
                                           FaultCase{"rename_eacces", {IoOp::kRename, "out.bin", 1, EACCES}}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_F(EnvTest, FailedFolderSyncAfterTheRenameIsReported) {
  // The rename has happened: the new file is complete under its name, but
  // its durability is unknown, so the caller must hear of it.
  FaultEnv env;
  env.Add({IoOp::kSyncDir, dir_.string(), 1, EIO});
  ScopedEnv use(env);
  EXPECT_THROW(WriteAtomically(Path("out.bin"), Payload()), IoError);
  EXPECT_EQ(Read(Path("out.bin")).size(), Payload().size());
}

TEST_F(EnvTest, MappedFileReadErrorNamesTheFile) {
  WriteText(Path("in.pt"), "bytes");
  FaultEnv env;
  env.Add({IoOp::kMap, "in.pt", 1, EIO});
  ScopedEnv use(env);
  try {
    MappedFile::Open(Path("in.pt"));
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(Path("in.pt") + ": Input/output error"), std::string::npos) << e.what();
  }
  EXPECT_THROW(LoadTorchFile(Path("in.pt")), IoError);
}

ValuePtr SampleState() {
  std::vector<uint8_t> bytes(2 * (1 << 20) + 4);  // 2 MiB + 4 of float32 data
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i % 251);
  Tensor t;
  t.dtype = DType::kFloat32;
  t.shape = {static_cast<int64_t>(bytes.size() / 4)};
  t.stride = Tensor::ContiguousStrides(t.shape);
  t.storage = Storage::Owned(std::move(bytes), DType::kFloat32);
  ValuePtr d = Value::Dict();
  d->set("weight", Value::FromTensor(std::move(t)));
  d->set("step", Value::Int(5));
  return d;
}

TEST_F(EnvTest, TorchFileSaveUnderFaults) {
  // Short writes: a file torch-identical to the one written without faults.
  // (Same file name in two folders: the name is part of the archive.)
  fs::create_directories(dir_ / "plain");
  fs::create_directories(dir_ / "short");
  SaveTorchFile(Path("plain/model.pt"), SampleState());
  {
    FaultEnv env;
    env.set_short_writes(true);
    ScopedEnv use(env);
    SaveTorchFile(Path("short/model.pt"), SampleState());
    EXPECT_GT(env.write_points(), 30u);
  }
  EXPECT_TRUE(Read(Path("short/model.pt")) == Read(Path("plain/model.pt")));
  // Each failing point: an IoError naming the file, the old file unchanged.
  WriteText(Path("model.pt"), "old");
  for (IoOp op : {IoOp::kCreate, IoOp::kWrite, IoOp::kSync, IoOp::kRename}) {
    SCOPED_TRACE(IoOpName(op));
    FaultEnv env;
    env.Add({op, "model.pt", 1, op == IoOp::kWrite ? ENOSPC : EIO});
    ScopedEnv use(env);
    try {
      SaveTorchFile(Path("model.pt"), SampleState());
      ADD_FAILURE() << "no error";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(Path("model.pt")), std::string::npos) << e.what();
    }
    EXPECT_EQ(Read(Path("model.pt")), "old");
  }
  EXPECT_EQ(Entries(), (std::set<std::string>{"model.pt", "plain", "short"}));
}

TEST_F(EnvTest, CrashAfterTheKthWritePointKillsBeforeTheRename) {
  // Write point 3 is the fsync: killed there, the file never gets its name.
  WriteText(Path("latest"), "global_step5");
  EXPECT_EXIT(
      {
        FaultEnv env;
        env.set_crash_after(3);
        ScopedEnv use(env);
        AtomicFile f(Path("latest"));
        f.Write(std::string("global_step10"));
        f.Commit();
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGKILL), "");
  EXPECT_EQ(Read(Path("latest")), "global_step5");
  // The killed process's temporary file stays (no cleanup runs after SIGKILL).
  EXPECT_EQ(Entries().size(), 2u);
}

}  // namespace
}  // namespace uckpt
