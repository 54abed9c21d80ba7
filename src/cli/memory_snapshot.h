// Snapshots in host memory for a quick restart on this host
// (`"checkpoint": {"snapshot_interval": N}`, `uckpt train --snapshot-every N`;
// docs/reliability.md, "Little lost work").
//
// A snapshot is an ordinary checkpoint folder, written by the engine's own
// background save (SaveCheckpointOptions::memory_snapshot: a writer of its
// own, so a save to disk neither delays it nor is delayed by it) into
// <root>/uckpt-snapshots-<job id>/ on a memory filesystem (/dev/shm). The
// engine's save publishes it as every checkpoint: files into a temporary
// folder, the manifest with the state fingerprint, the rename, then
// `latest`. So a snapshot cut short by a kill is never named by `latest`, and
// the previous one stays whole until the next is published (two generations
// at most, while one is written; once it is published, the one before is
// removed). A snapshot due while the previous one is still being written is
// skipped, and counted.
//
// A restart of the same job (`uckpt launch --max_restarts`, torchrun's
// agent) loads the newest snapshot when it is newer than the durable
// checkpoint in --checkpoint_dir, at any world size, its files checked
// against the manifest's hashes and the state against its fingerprint; if
// that load fails it loads the durable one. The folder belongs to one job:
// its name carries the job's id and an `owner` file inside names the job and
// the durable folder; a folder of another job is never read. A clean end of
// the run removes it, as does the end of the launcher that made the id.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "uckpt/comm.h"
#include "uckpt/engine.h"

namespace uckpt::cli {

// $UCKPT_SNAPSHOT_ROOT, else /dev/shm.
std::string SnapshotRoot();
// The id snapshots are kept under: $UCKPT_JOB_ID (`uckpt launch` sets it
// for its ranks, kept across its restarts), else torchrun's
// $TORCHELASTIC_RUN_ID unless it is "none"; nullopt without either.
std::optional<std::string> SnapshotJobId();
// <root>/uckpt-snapshots-<job id, characters other than [A-Za-z0-9._-] as '_'>.
std::string SnapshotFolder(const std::string& root, const std::string& job_id);

class MemorySnapshots {
 public:
  // Checks that snapshots can serve a restart here: a --checkpoint_dir to
  // fall back to, a job id, every rank on this host. Throws
  // std::invalid_argument naming checkpoint.snapshot_interval otherwise.
  MemorySnapshots(Engine& engine, Comm& comm, int64_t interval, const std::string& checkpoint_dir);

  const std::string& folder() const { return folder_; }

  // Collective (rank 0 decides): the tag of this job's newest complete
  // snapshot when it is newer than the durable checkpoint `latest` names;
  // "" otherwise (rank 0 says why, when there is a snapshot).
  std::string NewerThanDurable();

  // Collective. After optimizer step `step`: a snapshot when one is due,
  // skipped (and counted) while the previous one is still being written;
  // none after a step saved to disk (`saved`).
  void AfterStep(int64_t step, bool saved);

  // Collective, at the end of a clean run: the last snapshot is waited for,
  // the counts and costs printed (rank 0), and the folder removed.
  void Finish();

 private:
  void ClaimFolder();  // rank 0: the folder ours, with its owner file
  // Rank 0: every entry but `latest` and the folder it names; one older
  // snapshot is kept as the next one's folder to write over.
  void RemoveOlder() const;
  std::string OwnerText() const;
  uint64_t FolderBytes() const;

  Engine& engine_;
  Comm& comm_;
  int64_t interval_;
  std::string checkpoint_dir_;  // absolute
  std::string job_id_;
  std::string folder_;
  bool claimed_ = false;
  bool unpublished_ = false;  // the last snapshot may not be published yet
  int64_t taken_ = 0, skipped_ = 0;
  // The first snapshot allocates the host copies (pinned on a GPU: slow), so
  // it is reported apart; the sums and the max are of the snapshots after it.
  double first_blocked_ = 0;
  double blocked_sum_ = 0, blocked_max_ = 0;
  double state_sum_ = 0;        // of blocked_sum_: until the state was copied (SaveStats::state_s)
  double fingerprint_sum_ = 0;  // hashing the state for the manifest's fingerprint (SaveStats::fingerprint_s)
  uint64_t copy_bytes_ = 0;     // this rank's host copy (the engine's snapshot buffers), the largest seen
};

}  // namespace uckpt::cli
