// Writing a checkpoint's files and publishing them, synchronously or in the
// background (`"checkpoint": {"async_save": true}`).
//
// SaveEngineCheckpoint (checkpoint.cc) turns the engine's state into
// host-memory values and hands this rank's files to a CheckpointWriter: an
// async save copies every tensor into the SnapshotPool (that is the time the
// step blocks); a synchronous one views host tensors in place and copies
// only device tensors. The writer runs
// them as one copy plan (ckpt/copy_plan.h) on the rank's host threads
// (ckpt::DefaultThreads): torch files written straight into their final
// names inside the temporary folder (with one thread, generated front to
// back; with more, laid out with their CRCs computed on every thread, then
// written by one thread while another hashes them), hashed as
// they are written (nothing is read back for the manifest), writeback
// started early, then one syncfs instead of an fsync per file. With async the plan runs on a
// background thread and the snapshot is kept until it is done.
//
// Publishing is collective and happens on the training thread (the
// background thread never touches the communicator): every rank agrees that
// its files are durable, rank 0 gathers every file's size and XXH64, writes
// the manifest, renames the temporary folder to the tag and then replaces
// `latest`. A crash before that leaves the previous `latest` and only a
// temporary folder, which the next save removes (docs/reliability.md).
//
// A synchronous save of a new tag is published as soon as its files are
// written, as DeepSpeed's is, and made durable after: rank 0 first makes an
// "unsynced" marker durable beside the folder (ckpt::UnsyncedMarkerPath),
// the files are written without waiting for the disk (their writeback
// started early all the same), the folder is published, and every rank then
// runs syncfs on a background thread. The
// next collective call that waits for the writer (Publish, PublishIfDone)
// agrees that every rank's sync is done and rank 0 removes the marker (or,
// when every rank runs on its host, rank 0's writer does when it is
// destroyed, its own sync then covering every file); until then a reader
// finding the marker checks every file by hash, so a folder cut short by a
// system crash is refused, not loaded.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/fingerprint.h"
#include "ckpt/manifest.h"
#include "format/value.h"
#include "uckpt/comm.h"

namespace uckpt::engine {

// Host buffers for async saves' snapshots, reused from save to save (a buffer is free
// again once the values viewing it are gone, after its save is published):
// at most one snapshot's worth is held, since a save waits for the previous.
// Pinned memory when the tensors are on a GPU.
class SnapshotPool {
 public:
  // A storage holding a copy of `t` (contiguous, on the host).
  std::shared_ptr<Storage> Copy(const at::Tensor& t);
  uint64_t bytes() const;  // held by all buffers
 private:
  std::vector<at::Tensor> buffers_;
};

// One file of this rank: its name inside the tag folder and its contents.
struct SnapshotFile {
  std::string name;
  ValuePtr value;
};

class CheckpointWriter {
 public:
  // `overwrite_in_place`: files already in the temporary folder (a reused
  // folder's, SaveCheckpointOptions::memory_snapshot) are written over, their
  // pages kept (ckpt::CopyOptions::overwrite_in_place).
  explicit CheckpointWriter(bool overwrite_in_place = false) : overwrite_in_place_(overwrite_in_place) {}
  ~CheckpointWriter();  // joins a background write (its result is dropped)
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Starts writing `files` into `tmp` (which exists) for the checkpoint
  // `dir`/`tag`: on a background thread with `async`, else before returning
  // (errors are kept for Publish either way). `snapshot_bytes`: host memory
  // the values hold, reported by snapshot_bytes() until published.
  // `state`: the state fingerprint rank 0 records in the manifest.
  // `sync_after_publish` (synchronous saves only, the same on every rank):
  // published before durable (above); `marker`: rank 0's unsynced marker,
  // already durable ("" on the other ranks). A marker left by an earlier
  // save of the tag is removed once this one is durable either way.
  void Start(std::string dir, std::string tag, std::string tmp, std::vector<SnapshotFile> files, bool async,
             uint64_t snapshot_bytes, bool sync_after_publish = false, std::string marker = "");
  // The state fingerprint the manifest records; set before Publish.
  void SetStateFingerprint(ckpt::StateFingerprint state) { state_ = std::move(state); }
  // Drops the save Start began (after a failure on every rank, before the
  // temporary folder is removed): waits for its write, publishes nothing.
  void Abandon();
  // A save is under way: being written, or published and being synced.
  bool pending() const { return pending_; }
  bool syncing() const { return syncing_; }
  SnapshotPool& pool() { return pool_; }
  // Host memory of the buffers the last write streamed device tensors
  // through (one per file that had any, up to 64 MiB each, pinned on a GPU
  // machine), kept for the next save.
  uint64_t stream_buffer_bytes() const;
  uint64_t snapshot_bytes() const { return pending_ ? snapshot_bytes_ : 0; }
  // The last write's seconds on this rank: laying the files out (their
  // CRCs), then copying their bytes to the files.
  double layout_seconds() const { return layout_s_; }
  double copy_seconds() const { return copy_s_; }

  // Collective: waits for this rank's write, agrees with the others, and
  // publishes (manifest, rename, `latest`). Throws IoError on every rank if
  // any rank failed (the failing rank names its file). Returns the tag folder.
  // For a save published before durable: waits for this rank's sync, agrees,
  // and rank 0 removes the marker; a failed sync throws IoError on every rank
  // (the folder stays published, the marker stays).
  std::string Publish(Comm& comm);
  // Collective and cheap (one all-reduce): publishes (or finishes the sync)
  // if every rank's write (or sync) has ended, or one failed, which throws.
  // Returns whether it did.
  bool PublishIfDone(Comm& comm);

 private:
  struct Written {
    std::string name;
    uint64_t size = 0, xxh64 = 0;
  };
  void Write();
  void Join();
  void StartSync();
  void FinishSync(Comm& comm);
  // Publish's steps.
  void DiscardFailed(const std::string& folder) const;
  at::Tensor GatherWritten(Comm& comm) const;
  void PublishFolder(const std::vector<ckpt::ManifestEntry>& known, const std::string& folder);

  // A buffer for file k's streamed storages, sized for the largest.
  std::span<uint8_t> StreamBuffer(size_t k, uint64_t largest);

  SnapshotPool pool_;
  std::vector<at::Tensor> stream_buffers_;
  std::string dir_, tag_, tmp_;
  std::vector<SnapshotFile> files_;
  std::vector<Written> written_;
  std::optional<ckpt::StateFingerprint> state_;
  std::string error_;
  std::string marker_;  // rank 0: the unsynced marker beside the tag folder
  double layout_s_ = 0, copy_s_ = 0;
  bool overwrite_in_place_ = false;
  bool pending_ = false;
  bool sync_after_publish_ = false;
  bool syncing_ = false;              // published; this rank's syncfs under way or done
  bool drop_marker_at_exit_ = false;  // one rank: its own sync makes the folder durable
  uint64_t snapshot_bytes_ = 0;
  std::thread thread_;
  std::atomic<bool> done_{false};
};

// With more than one host thread (ckpt::DefaultThreads), a file larger than
// 64 MiB is written by one thread while another hashes it. `bytes` > 0
// instead splits files larger than `bytes` into ranges of that size written
// by several threads at once (tests; on ext4 and XFS that only adds lock
// contention, ckpt/copy_plan.h). 0: the default.
void SetSaveRangeBytes(uint64_t bytes);

// Cross-rank agreement on errors: every rank calls these with its own error
// ("" when it succeeded), so that all ranks stop together and none goes on
// alone into a collective the others never reach.
// The highest failing rank, or -1 when every rank succeeded: one all-reduce.
int FailingRank(Comm& comm, const std::string& error);
// "" when every rank succeeded, else on every rank the highest failing
// rank's error (cut at kAgreedErrorBytes - 1 bytes): one all-reduce, and a
// broadcast when one failed.
constexpr int64_t kAgreedErrorBytes = 4096;
std::string AgreedError(Comm& comm, const std::string& error);

// Every rank's verdict on a phase of a save: throws on every rank if any
// failed (the failing rank with its own error), so that no rank publishes a
// checkpoint another rank could not write.
void AgreeOrThrow(Comm& comm, const std::string& folder, const std::string& error);

// Removes `path` (a file or a tree; absent is fine) through Env::Current(),
// ignoring errors: a failed save's temporaries, whose first error is the one
// to report.
void RemoveQuietly(const std::string& path);

}  // namespace uckpt::engine
