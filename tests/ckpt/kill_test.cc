// kill -9 at every write point of a conversion and of an export: a forked
// child runs the conversion with the crash hook's FaultEnv set to SIGKILL it
// right after write point k, for every k; after each kill the old universal
// folder and latest_universal (the old exported file) must be intact, and a
// folder or file under its final name must be complete. (The same through the
// `uckpt` command, for the engine save too: tests/engine/kill_test.sh.)
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "ckpt/convert.h"
#include "ckpt/export.h"
#include "ckpt/zero_writer.h"
#include "format/fault_env.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

namespace fs = std::filesystem;
using testing::ReadFile;
using testing::TempDir;

// A small synthetic ZeRO-2 checkpoint (3 parameters, 2 ranks); `salt`
// changes a shape and the step, so two salts give different outputs.
std::string MakeCheckpoint(const std::string& folder, int salt) {
  ZeroWriteSpec spec;
  spec.stage = 2;
  spec.dp = 2;
  spec.groups = {{{"wte.weight", {8, 4}}, {"ln.bias", {4}}, {"head.weight", {3 + salt, 4}}}};
  spec.step = static_cast<float>(5 + salt);
  spec.global_steps = 5 + salt;
  spec.source = PatternSource();
  WriteZeroCheckpoint(folder, spec);
  return folder;
}

std::map<std::string, std::string> Snapshot(const std::string& root) {
  std::map<std::string, std::string> out;
  for (const auto& f : testing::ListFiles(root)) out[f] = ReadFile(root + "/" + f);
  return out;
}

// Write points of `fn` run in this process (counted, not killed).
uint64_t CountWritePoints(const std::function<void()>& fn) {
  FaultEnv env;
  ScopedEnv use(env);
  fn();
  return env.write_points();
}

// Runs `fn` in a child killed right after its k-th write point. Returns
// true if the child was killed by SIGKILL (false: it finished first).
bool RunKilledAfter(uint64_t k, const std::function<void()>& fn) {
  pid_t pid = ::fork();
  if (pid == 0) {
    FaultEnv env;
    env.set_crash_after(k);
    ScopedEnv use(env);
    try {
      fn();
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

// One thread, so that write point k is the same point in every run. Not
// durable: fsync protects against power loss, not against a killed process,
// and the syncs would make ~250 conversions slow (the command-level kill test
// covers the durable path).
ConvertOptions OneThread(bool force) {
  ConvertOptions o;
  o.threads = 1;
  o.force = force;
  o.durable = false;
  return o;
}

TEST(KillEveryWritePoint, Convert) {
  TempDir tmp;
  const std::string old_ckpt = MakeCheckpoint(tmp / "old_ckpt", 0), new_ckpt = MakeCheckpoint(tmp / "new_ckpt", 1);
  ConvertToUniversal(new_ckpt, tmp / "ref_new", OneThread(false));
  const auto new_files = Snapshot(tmp / "ref_new");
  fs::remove_all(tmp / "ref_new");
  ConvertToUniversal(old_ckpt, tmp / "u", OneThread(false));  // latest_universal = u
  const auto old_files = Snapshot(tmp / "u");
  ASSERT_NE(old_files, new_files);
  ASSERT_EQ(ReadFile(tmp / "latest_universal"), "u");
  const std::string work = tmp / "work";

  int kills = 0;
  for (const bool force : {false, true}) {
    const std::string out = work + (force ? "/u" : "/v");
    auto convert = [&] { ConvertToUniversal(new_ckpt, out, OneThread(force)); };
    auto reset = [&] {
      fs::remove_all(work);
      fs::create_directories(work);
      fs::copy(tmp / "u", work + "/u", fs::copy_options::recursive);
      fs::copy_file(tmp / "latest_universal", work + "/latest_universal");
    };
    reset();
    const uint64_t points = CountWritePoints(convert);
    // (Files are written in place inside the temporary folder, with no
    // per-file rename: 38 points for this checkpoint.)
    ASSERT_GT(points, 30u);
    for (uint64_t k = 1; k <= points; ++k) {
      SCOPED_TRACE((force ? "--force, killed after write point " : "new folder, killed after write point ") +
                   std::to_string(k) + " of " + std::to_string(points));
      reset();
      ASSERT_TRUE(RunKilledAfter(k, convert)) << "the conversion was not killed";
      ++kills;
      const std::string latest = ReadFile(work + "/latest_universal");
      if (force) {
        const auto now = Snapshot(work + "/u");
        EXPECT_TRUE(now == old_files || now == new_files) << "u is neither the old nor the new output";
        EXPECT_EQ(latest, "u");
      } else {
        EXPECT_TRUE(Snapshot(work + "/u") == old_files) << "the old output changed";
        if (fs::exists(out)) {
          EXPECT_TRUE(Snapshot(out) == new_files) << "a partial output under its final name";
        }
        EXPECT_TRUE(latest == "u" || (latest == "v" && fs::exists(out))) << "latest_universal: " << latest;
      }
    }
    // One more than all: the child finishes.
    reset();
    EXPECT_FALSE(RunKilledAfter(points + 1, convert));
    EXPECT_TRUE(Snapshot(out) == new_files);
  }
  std::printf("convert: killed at %d write points, old output intact after every kill\n", kills);
}

TEST(KillEveryWritePoint, Export) {
  TempDir tmp;
  const std::string old_ckpt = MakeCheckpoint(tmp / "old_ckpt", 0), new_ckpt = MakeCheckpoint(tmp / "new_ckpt", 1);
  const std::string out = tmp / "model.safetensors";
  ExportSafetensors(new_ckpt, out);
  const std::string new_bytes = ReadFile(out);
  ExportSafetensors(old_ckpt, out);
  const std::string old_bytes = ReadFile(out);
  ASSERT_NE(old_bytes, new_bytes);
  auto run = [&] { ExportSafetensors(new_ckpt, out); };
  const uint64_t points = CountWritePoints(run);
  ASSERT_GE(points, 5u);  // create, write, fsync, rename, folder fsync
  for (uint64_t k = 1; k <= points; ++k) {
    SCOPED_TRACE("killed after write point " + std::to_string(k));
    {
      std::ofstream f(out, std::ios::binary | std::ios::trunc);
      f << old_bytes;
    }
    ASSERT_TRUE(RunKilledAfter(k, run));
    const std::string now = ReadFile(out);
    EXPECT_TRUE(now == old_bytes || now == new_bytes) << "neither the old nor the new file";
    // Killed before the rename (the second-last point) the old file stays.
    if (k + 1 < points) {
      EXPECT_TRUE(now == old_bytes);
    }
  }
  std::printf("export: killed at %llu write points\n", static_cast<unsigned long long>(points));
}

}  // namespace
}  // namespace uckpt::ckpt
