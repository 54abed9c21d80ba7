// Fault injection at the I/O seam (format/env.h): an Env that fails chosen
// calls with a chosen errno, makes writes short, counts write points, and can
// SIGKILL its own process right after the k-th write point (the crash hook
// that tests use to kill a save at every point in turn).
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "format/env.h"

namespace uckpt {

enum class IoOp {
  kMap,        // MapFile (reading)
  kCreate,     // NewWritableFile
  kWrite,      // WritableFile::Write
  kSync,       // WritableFile::Sync
  kCopy,       // CopyFile
  kCreateDir,  // CreateDirs
  kRename,     // Rename and Exchange
  kRemove,     // RemoveAll
  kSyncDir,    // SyncDir and SyncFilesystem
};

const char* IoOpName(IoOp op);

// Fails the `nth` and every later call of `op` whose path contains
// `path_contains` ("" matches every path) with `error` (an errno value).
struct Fault {
  IoOp op;
  std::string path_contains;
  int nth = 1;
  int error = EIO;
  bool once = false;  // only the nth call fails, later ones succeed
};

class FaultEnv : public EnvWrapper {
 public:
  explicit FaultEnv(Env& target = Env::Posix()) : EnvWrapper(target) {}

  void Add(Fault f);
  // Every Write writes at most half of what it is given (at least one byte),
  // as a full disk or a signal can make write(2) do.
  void set_short_writes(bool on) { short_writes_ = on; }
  // Kill this process (SIGKILL, no cleanup) right after write point `k`
  // (1-based); 0: never.
  void set_crash_after(uint64_t k) { crash_after_ = k; }
  // Write points so far: every call of the writing operations (all but kMap).
  uint64_t write_points() const { return write_points_; }
  // Calls failed so far by a Fault.
  uint64_t injected() const { return injected_; }

  std::shared_ptr<const MappedFile> MapFile(const std::string& path) override;
  std::unique_ptr<WritableFile> NewWritableFile(const std::string& path, unsigned mode) override;
  uint64_t CopyFile(const std::string& from, const std::string& to, const CopySeen& seen = nullptr) override;
  void CreateDirs(const std::string& path) override;
  void Rename(const std::string& from, const std::string& to) override;
  bool Exchange(const std::string& a, const std::string& b) override;
  void RemoveAll(const std::string& path) override;
  void SyncDir(const std::string& dir) override;
  void SyncFilesystem(const std::string& path) override;

  // Used by the files this Env creates. Before() throws the injected
  // IoError; After() counts a write point (and crashes at the chosen one).
  void Before(IoOp op, const std::string& path, const std::string& path2 = "");
  void After();
  bool short_writes() const { return short_writes_; }

 private:
  struct Rule {
    Fault fault;
    int seen = 0;
  };
  std::mutex mu_;
  std::vector<Rule> rules_;
  std::atomic<bool> short_writes_{false};
  std::atomic<uint64_t> crash_after_{0}, write_points_{0}, injected_{0};
};

// The crash hook of the `uckpt` command, from the environment:
//   UCKPT_CRASH_AFTER_WRITES=k  SIGKILL this process right after its k-th write point
//   UCKPT_CRASH_RANK=r          only in the process whose RANK is r
//   UCKPT_COUNT_WRITES=1        print "uckpt: write points: N [rank R]" to stderr at exit
// Installs a process-wide FaultEnv when any of them is set; does nothing otherwise.
// Throws std::invalid_argument for malformed values.
void InstallWriteHookFromEnvironment();

}  // namespace uckpt
