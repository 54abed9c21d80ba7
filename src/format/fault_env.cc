#include "format/fault_env.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "format/error.h"

namespace uckpt {
namespace {

class FaultWritableFile : public WritableFile {
 public:
  FaultWritableFile(FaultEnv& env, std::unique_ptr<WritableFile> base) : env_(env), base_(std::move(base)) {}

  size_t Write(std::span<const uint8_t> data) override {
    env_.Before(IoOp::kWrite, path());
    if (env_.short_writes() && data.size() > 1) data = data.first(data.size() / 2);
    size_t n = base_->Write(data);
    env_.After();
    return n;
  }
  size_t WriteAt(uint64_t offset, std::span<const uint8_t> data) override {
    env_.Before(IoOp::kWrite, path());
    if (env_.short_writes() && data.size() > 1) data = data.first(data.size() / 2);
    size_t n = base_->WriteAt(offset, data);
    env_.After();
    return n;
  }
  // Allocate makes no data and no name durable or visible: not a write point.
  void Allocate(uint64_t size) override { base_->Allocate(size); }
  void Sync() override {
    env_.Before(IoOp::kSync, path());
    base_->Sync();
    env_.After();
  }
  void Close() override { base_->Close(); }
  const std::string& path() const override { return base_->path(); }

 private:
  FaultEnv& env_;
  std::unique_ptr<WritableFile> base_;
};

const char* Verb(IoOp op) {
  switch (op) {
    case IoOp::kMap: return "cannot open";
    case IoOp::kCreate: return "cannot create";
    case IoOp::kWrite: return "cannot write";
    case IoOp::kSync: return "cannot fsync";
    case IoOp::kCopy: return "cannot copy";
    case IoOp::kCreateDir: return "cannot create";
    case IoOp::kRename: return "cannot rename";
    case IoOp::kRemove: return "cannot remove";
    case IoOp::kSyncDir: return "cannot fsync the folder";
  }
  return "cannot access";
}

}  // namespace

const char* IoOpName(IoOp op) {
  switch (op) {
    case IoOp::kMap: return "map";
    case IoOp::kCreate: return "create";
    case IoOp::kWrite: return "write";
    case IoOp::kSync: return "fsync";
    case IoOp::kCopy: return "copy";
    case IoOp::kCreateDir: return "mkdir";
    case IoOp::kRename: return "rename";
    case IoOp::kRemove: return "remove";
    case IoOp::kSyncDir: return "fsync-dir";
  }
  return "?";
}

void FaultEnv::Add(Fault f) {
  std::lock_guard<std::mutex> lock(mu_);
  rules_.push_back({std::move(f), 0});
}

void FaultEnv::Before(IoOp op, const std::string& path, const std::string& path2) {
  std::lock_guard<std::mutex> lock(mu_);
  for (Rule& r : rules_) {
    if (r.fault.op != op) continue;
    const std::string& c = r.fault.path_contains;
    if (!c.empty() && path.find(c) == std::string::npos && path2.find(c) == std::string::npos) continue;
    ++r.seen;
    if (r.seen == r.fault.nth || (r.seen > r.fault.nth && !r.fault.once)) {
      ++injected_;
      std::string what = std::string(Verb(op)) + " " + path + (path2.empty() ? "" : " to " + path2);
      throw IoError(what + ": " + std::strerror(r.fault.error));
    }
  }
}

void FaultEnv::After() {
  const uint64_t n = ++write_points_;
  if (crash_after_ != 0 && n == crash_after_) {
    ::kill(::getpid(), SIGKILL);
    ::pause();  // SIGKILL is delivered before this returns
  }
}

std::shared_ptr<const MappedFile> FaultEnv::MapFile(const std::string& path) {
  Before(IoOp::kMap, path);
  return EnvWrapper::MapFile(path);
}

std::unique_ptr<WritableFile> FaultEnv::NewWritableFile(const std::string& path, unsigned mode) {
  Before(IoOp::kCreate, path);
  auto f = std::make_unique<FaultWritableFile>(*this, EnvWrapper::NewWritableFile(path, mode));
  After();
  return f;
}

uint64_t FaultEnv::CopyFile(const std::string& from, const std::string& to, const CopySeen& seen) {
  Before(IoOp::kCopy, to, from);
  uint64_t n = EnvWrapper::CopyFile(from, to, seen);
  After();
  return n;
}

void FaultEnv::CreateDirs(const std::string& path) {
  Before(IoOp::kCreateDir, path);
  EnvWrapper::CreateDirs(path);
  After();
}

void FaultEnv::Rename(const std::string& from, const std::string& to) {
  Before(IoOp::kRename, from, to);
  EnvWrapper::Rename(from, to);
  After();
}

bool FaultEnv::Exchange(const std::string& a, const std::string& b) {
  Before(IoOp::kRename, a, b);
  bool done = EnvWrapper::Exchange(a, b);
  After();
  return done;
}

void FaultEnv::RemoveAll(const std::string& path) {
  Before(IoOp::kRemove, path);
  EnvWrapper::RemoveAll(path);
  After();
}

void FaultEnv::SyncDir(const std::string& dir) {
  Before(IoOp::kSyncDir, dir);
  EnvWrapper::SyncDir(dir);
  After();
}

void FaultEnv::SyncFilesystem(const std::string& path) {
  Before(IoOp::kSyncDir, path);
  EnvWrapper::SyncFilesystem(path);
  After();
}

// ---- The crash hook. ----

namespace {

FaultEnv* g_hook = nullptr;
std::string g_hook_rank;

uint64_t ParseCount(const char* name, const char* value) {
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || value[0] == '-')
    throw std::invalid_argument(std::string(name) + "='" + value + "' is not a non-negative integer");
  return v;
}

void PrintWritePoints() {
  if (!g_hook) return;
  std::fprintf(stderr, "uckpt: write points: %llu%s\n", static_cast<unsigned long long>(g_hook->write_points()),
               g_hook_rank.empty() ? "" : (" rank " + g_hook_rank).c_str());
}

}  // namespace

void InstallWriteHookFromEnvironment() {
  const char* crash = std::getenv("UCKPT_CRASH_AFTER_WRITES");
  const char* crash_rank = std::getenv("UCKPT_CRASH_RANK");
  const char* count = std::getenv("UCKPT_COUNT_WRITES");
  const char* rank = std::getenv("RANK");
  if (g_hook || (!crash && !count)) return;
  uint64_t k = crash ? ParseCount("UCKPT_CRASH_AFTER_WRITES", crash) : 0;
  if (crash_rank) {
    ParseCount("UCKPT_CRASH_RANK", crash_rank);
    if (!rank || std::string(rank) != crash_rank) k = 0;  // another rank dies
  }
  g_hook = new FaultEnv(Env::Posix());  // lives until exit, as the process-wide Env
  g_hook->set_crash_after(k);
  g_hook_rank = rank ? rank : "";
  static ScopedEnv installed(*g_hook);
  if (count && std::string(count) != "0") std::atexit(PrintWritePoints);
}

}  // namespace uckpt
