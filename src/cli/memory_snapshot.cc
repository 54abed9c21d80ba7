#include "cli/memory_snapshot.h"

#include <cctype>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ckpt/deepspeed_names.h"
#include "ckpt/folder.h"
#include "format/env.h"
#include "format/file.h"

namespace uckpt::cli {
namespace fs = std::filesystem;

namespace {

constexpr const char* kOwnerFile = "owner";
constexpr const char* kTagPrefix = "global_step";

const char* NonEmptyEnv(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// N of a tag "global_stepN"; nullopt for any other tag.
std::optional<int64_t> StepOfTag(const std::string& tag) {
  const std::string prefix = kTagPrefix;
  if (tag.size() <= prefix.size() || tag.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  int64_t n = 0;
  for (size_t i = prefix.size(); i < tag.size(); ++i) {
    if (tag[i] < '0' || tag[i] > '9' || n > (INT64_MAX - 9) / 10) return std::nullopt;
    n = n * 10 + (tag[i] - '0');
  }
  return n;
}

// The step of the checkpoint `latest` names in `dir`: -1 when there is none;
// INT64_MAX when it cannot be told (a tag of another form, an unreadable
// file): the durable checkpoint is then preferred, and its load says what is wrong.
int64_t DurableStep(const std::string& dir) {
  if (!fs::exists(dir + "/" + ckpt::kLatestFile)) return -1;
  try {
    return StepOfTag(ckpt::ReadLatestTag(dir, ckpt::kLatestFile)).value_or(INT64_MAX);
  } catch (const std::exception&) {
    return INT64_MAX;
  }
}

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

double ElapsedSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void RemoveWithWarning(const std::string& path) {
  try {
    Env::Current().RemoveAll(path);
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "uckpt train: warning: cannot remove %s: %s\n", path.c_str(), ex.what());
  }
}

}  // namespace

std::string SnapshotRoot() {
  const char* r = NonEmptyEnv("UCKPT_SNAPSHOT_ROOT");
  return r ? r : "/dev/shm";
}

std::optional<std::string> SnapshotJobId() {
  if (const char* id = NonEmptyEnv("UCKPT_JOB_ID")) return std::string(id);
  if (const char* id = NonEmptyEnv("TORCHELASTIC_RUN_ID"); id && std::string(id) != "none") return std::string(id);
  return std::nullopt;
}

std::string SnapshotFolder(const std::string& root, const std::string& job_id) {
  std::string name = job_id.substr(0, 200);
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  return root + "/uckpt-snapshots-" + name;
}

MemorySnapshots::MemorySnapshots(Engine& engine, Comm& comm, int64_t interval, const std::string& checkpoint_dir)
    : engine_(engine), comm_(comm), interval_(interval) {
  const std::string key = "checkpoint.snapshot_interval " + std::to_string(interval);
  if (checkpoint_dir.empty())
    throw std::invalid_argument(key + " needs --checkpoint_dir: the durable checkpoint a restart falls back to");
  const auto id = SnapshotJobId();
  if (!id)
    throw std::invalid_argument(key +
                                ": a snapshot is read by a restart of the same job, and this process has no job id; "
                                "run it under `uckpt launch` (which sets UCKPT_JOB_ID) or set UCKPT_JOB_ID");
  // Every rank writes into one folder on this host's memory: one host only.
  const char* local = NonEmptyEnv("LOCAL_WORLD_SIZE");
  if (comm.world_size() > 1 && (local == nullptr || std::atoi(local) != comm.world_size()))
    throw std::invalid_argument(key +
                                ": snapshots live in one host's memory, so every rank must run on this host "
                                "(LOCAL_WORLD_SIZE " +
                                (local ? std::string(local) : std::string("unset")) + ", WORLD_SIZE " +
                                std::to_string(comm.world_size()) + ")");
  job_id_ = *id;
  checkpoint_dir_ = fs::absolute(checkpoint_dir).lexically_normal().string();
  folder_ = SnapshotFolder(SnapshotRoot(), job_id_);
}

std::string MemorySnapshots::OwnerText() const {
  return "job " + job_id_ + "\ncheckpoint_dir " + checkpoint_dir_ + "\n";
}

std::string MemorySnapshots::NewerThanDurable() {
  double step = -1;
  if (comm_.rank() == 0 && fs::exists(folder_)) {
    std::string why;
    std::optional<int64_t> snapshot;
    if (ReadSmallFile(folder_ + "/" + kOwnerFile) != OwnerText()) {
      why = "it was made by another job or for another checkpoint folder (" + folder_ + "/" + kOwnerFile +
            " does not name job " + job_id_ + " and " + checkpoint_dir_ + ")";
    } else if (!fs::exists(folder_ + "/" + ckpt::kLatestFile)) {
      why = "it holds no complete snapshot";
    } else {
      std::string problem;
      const auto tag = ckpt::ReadTag(folder_ + "/" + ckpt::kLatestFile, &problem);
      snapshot = tag ? StepOfTag(*tag) : std::nullopt;
      if (!snapshot) why = folder_ + "/latest does not name a snapshot " + (tag ? *tag : problem);
    }
    const int64_t durable = DurableStep(checkpoint_dir_);
    if (snapshot && *snapshot <= durable)
      why = "its step " + std::to_string(*snapshot) + " is not newer than the durable checkpoint's" +
            (durable == INT64_MAX ? "" : " (step " + std::to_string(durable) + ")");
    if (why.empty()) step = static_cast<double>(*snapshot);
    else std::fprintf(stderr, "uckpt train: snapshot %s not used: %s\n", folder_.c_str(), why.c_str());
  }
  at::Tensor t = at::full({1}, step, at::kDouble);
  comm_.Broadcast(t, 0);
  const double agreed = t.item<double>();
  return agreed < 0 ? "" : kTagPrefix + std::to_string(static_cast<int64_t>(agreed));
}

void MemorySnapshots::ClaimFolder() {
  if (claimed_) return;
  // A folder under this name that is not this run's (another job with the
  // same id, another checkpoint folder) is replaced whole, never mixed in.
  if (fs::exists(folder_) && ReadSmallFile(folder_ + "/" + kOwnerFile) != OwnerText()) {
    std::fprintf(stderr, "uckpt train: replacing %s, which holds another job's snapshots\n", folder_.c_str());
    RemoveWithWarning(folder_);
  }
  Env::Current().CreateDirs(folder_);
  AtomicFile owner(folder_ + "/" + kOwnerFile, /*durable=*/false);  // memory: nothing to make durable
  owner.Write(OwnerText());
  owner.Commit();
  claimed_ = true;
}

void MemorySnapshots::RemoveOlder() const {
  std::string keep;
  try {
    keep = ckpt::ReadLatestTag(folder_, ckpt::kLatestFile);
  } catch (const std::exception&) {
    // none published yet: nothing to keep but the owner
  }
  const std::string reuse = folder_ + "/" + SaveCheckpointOptions::kReusedSnapshotFolder;
  std::error_code ec;
  bool reusing = fs::exists(reuse, ec);
  std::vector<fs::path> older;  // (not renamed while the folder is listed)
  for (const auto& entry : fs::directory_iterator(folder_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name != ckpt::kLatestFile && name != kOwnerFile && name != keep && entry.path() != reuse)
      older.push_back(entry.path());
  }
  for (const fs::path& path : older) {
    // An older snapshot becomes the next one's folder, its files written over
    // in place; the engine removes those the next one does not write (another
    // world's, from a run before a restart). SaveCheckpointOptions::memory_snapshot.
    const std::string name = path.filename().string();
    if (!reusing && StepOfTag(name)) {
      try {
        Env::Current().Rename(path.string(), reuse);
        reusing = true;
        continue;
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "uckpt train: warning: cannot keep %s for the next snapshot: %s\n", name.c_str(),
                     ex.what());
      }
    }
    RemoveWithWarning(path.string());
  }
}

void MemorySnapshots::AfterStep(int64_t step, bool saved) {
  // Agreed on every rank (Engine::Stats::save_pending), so all skip alike.
  const bool pending = engine_.stats().save_pending(/*memory_snapshot=*/true);
  if (unpublished_ && !pending) {  // published at this step: the one before can go
    if (comm_.rank() == 0) RemoveOlder();
    unpublished_ = false;
  }
  if (saved || step % interval_ != 0) return;
  if (pending) {
    ++skipped_;
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (comm_.rank() == 0) ClaimFolder();
  SaveCheckpointOptions options;
  options.memory_snapshot = true;
  engine_.SaveCheckpoint(folder_, kTagPrefix + std::to_string(step), c10::IValue(), options);
  const double blocked = ElapsedSince(t0);
  unpublished_ = true;
  const auto& save = engine_.stats().last_save();
  copy_bytes_ = std::max(copy_bytes_, save.snapshot_bytes);
  if (taken_++ == 0) {
    first_blocked_ = blocked;
    return;
  }
  blocked_sum_ += blocked;
  blocked_max_ = std::max(blocked_max_, blocked);
  state_sum_ += save.previous_s + save.state_s;
  fingerprint_sum_ += save.fingerprint_s;
}

uint64_t MemorySnapshots::FolderBytes() const {
  uint64_t bytes = 0;
  std::error_code ec;
  for (const auto& entry : fs::recursive_directory_iterator(folder_, ec))
    if (entry.is_regular_file(ec)) bytes += entry.file_size(ec);
  return bytes;
}

void MemorySnapshots::Finish() {
  engine_.WaitForCheckpoint();
  at::Tensor copies = at::full({1}, static_cast<double>(copy_bytes_), at::kDouble);
  comm_.AllReduceSum(copies);
  if (comm_.rank() != 0) return;
  RemoveOlder();
  const uint64_t folder_bytes = FolderBytes();
  const double mib = 1 << 20;
  const double n = taken_ > 1 ? static_cast<double>(taken_ - 1) : 1.0;
  std::fprintf(stderr,
               "uckpt train: snapshots every %lld step(s): %lld taken, %lld skipped (the previous one still being "
               "written); training blocked %.4f s per snapshot on rank 0 (mean of those after the first, %.4f s of it "
               "until the state was copied, then %.4f s hashing its fingerprint; max %.4f s; the first, which "
               "allocates the host copies, %.4f s); host memory held: %llu bytes (%.1f MiB) in "
               "%s (two snapshots: the newest, and the one the next is written over) + %llu bytes (%.1f MiB) of the "
               "ranks' copies\n",
               static_cast<long long>(interval_), static_cast<long long>(taken_), static_cast<long long>(skipped_),
               blocked_sum_ / n, state_sum_ / n, fingerprint_sum_ / n, blocked_max_, first_blocked_,
               static_cast<unsigned long long>(folder_bytes), static_cast<double>(folder_bytes) / mib, folder_.c_str(),
               static_cast<unsigned long long>(copies.item<double>()), copies.item<double>() / mib);
  RemoveWithWarning(folder_);
}

}  // namespace uckpt::cli
