#include "engine/async_save.h"

#include <ATen/ATen.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "ckpt/copy_plan.h"
#include "ckpt/deepspeed_names.h"
#include "ckpt/manifest.h"
#include "ckpt/parallel.h"
#include "engine/torch_bridge.h"
#include "format/env.h"
#include "format/error.h"
#include "format/file.h"
#include "format/pickle_writer.h"
#include "format/torch_file.h"

namespace uckpt::engine {

namespace fs = std::filesystem;

namespace {

// Files per rank and name bytes per file in the gathered table (a rank
// writes its optimizer file, rank 0 the model-states file too).
constexpr int kMaxFiles = 2;
constexpr int kNameWords = 16;  // 128 bytes
constexpr int kWords = kMaxFiles * (kNameWords + 2);

// Files above this are laid out, CRC'd on every thread, and written by one
// thread while another hashes them.
constexpr uint64_t kSplitBytes = 64ull << 20;
std::atomic<uint64_t> g_range_bytes{0};  // SetSaveRangeBytes

// The buffer a file's streamed storages pass through: bounded host memory
// for device tensors of any size.
constexpr uint64_t kStreamBufferBytes = 64ull << 20;

// The largest streamed storage of a file's value (0: none).
uint64_t LargestStreamed(const ValuePtr& value) {
  uint64_t n = 0;
  for (const auto& st : PickleForTorch(value).storages)
    if (st->streamed()) n = std::max(n, st->stream_size);
  return n;
}

// Collective: whether every rank runs on rank 0's machine (the same kernel:
// its boot id) and sees `dir` on the same filesystem (device), so that rank
// 0's syncfs also covers the other ranks' files of a save. A host name would
// not do: containers and cloned images share them. UCKPT_MACHINE_ID stands
// for the boot id (tests of several machines on one).
bool AllOnOneHost(Comm& comm, const std::string& dir) {
  if (comm.world_size() == 1) return true;
  std::string id;
  if (const char* given = std::getenv("UCKPT_MACHINE_ID"); given && *given) {
    id = given;
  } else {
    std::ifstream boot("/proc/sys/kernel/random/boot_id");
    std::getline(boot, id);
    if (id.empty()) id = "no boot id, rank " + std::to_string(comm.rank());  // (then never the same as rank 0's)
  }
  struct stat st {};
  id += ":" + std::to_string(::stat(dir.c_str(), &st) == 0 ? static_cast<unsigned long long>(st.st_dev) : 0ULL);
  char name[256] = {};
  std::strncpy(name, id.c_str(), sizeof(name) - 1);
  at::Tensor host = at::zeros({static_cast<int64_t>(sizeof(name))}, at::kByte);
  if (comm.rank() == 0) std::memcpy(host.data_ptr(), name, sizeof(name));
  comm.Broadcast(host, 0);
  const bool same = std::memcmp(host.data_ptr(), name, sizeof(name)) == 0;
  at::Tensor differs = at::full({1}, same ? 0.0f : 1.0f);
  comm.AllReduceMax(differs);
  return differs.item<float>() == 0;
}

}  // namespace

void RemoveQuietly(const std::string& path) {
  try {
    Env::Current().RemoveAll(path);
  } catch (const std::exception&) {
    // The first error is the one to report.
  }
}

std::shared_ptr<Storage> SnapshotPool::Copy(const at::Tensor& t) {
  const size_t n = t.nbytes();
  at::Tensor* buffer = nullptr;
  for (auto& b : buffers_)  // a free buffer, the smallest that fits
    if (b.use_count() == 1 && static_cast<size_t>(b.numel()) >= n && (!buffer || b.numel() < buffer->numel()))
      buffer = &b;
  if (!buffer) {
    auto options = at::TensorOptions().dtype(at::kByte).pinned_memory(t.is_cuda());
    buffers_.push_back(at::empty({static_cast<int64_t>(std::max<size_t>(n, 1))}, options));
    buffer = &buffers_.back();
  }
  if (n > 0) {
    at::Tensor dst = buffer->narrow(0, 0, static_cast<int64_t>(n)).view(t.scalar_type()).view(t.sizes());
    dst.copy_(t);
  }
  auto owner = std::make_shared<at::Tensor>(*buffer);
  return Storage::View({static_cast<const uint8_t*>(owner->data_ptr()), n}, FromScalarType(t.scalar_type()), owner);
}

uint64_t SnapshotPool::bytes() const {
  uint64_t n = 0;
  for (const auto& b : buffers_) n += b.numel();
  return n;
}

int FailingRank(Comm& comm, const std::string& error) {
  at::Tensor failed = at::full({1}, error.empty() ? -1.0f : static_cast<float>(comm.rank()), at::kFloat);
  comm.AllReduceMax(failed);
  return static_cast<int>(failed.item<float>());
}

std::string AgreedError(Comm& comm, const std::string& error) {
  const int bad = FailingRank(comm, error);
  if (bad < 0) return "";
  at::Tensor text = at::zeros({kAgreedErrorBytes}, at::kByte);
  if (comm.rank() == bad)
    std::memcpy(text.data_ptr(), error.data(), std::min<size_t>(error.size(), kAgreedErrorBytes - 1));
  comm.Broadcast(text, bad);
  return std::string(static_cast<const char*>(text.data_ptr()));
}

void AgreeOrThrow(Comm& comm, const std::string& folder, const std::string& error) {
  const int bad = FailingRank(comm, error);
  if (bad < 0) return;
  if (!error.empty()) throw IoError("checkpoint " + folder + " not saved: " + error);
  throw IoError("checkpoint " + folder + " not saved: rank " + std::to_string(bad) + " could not write its part");
}

void SetSaveRangeBytes(uint64_t bytes) { g_range_bytes = bytes; }

CheckpointWriter::~CheckpointWriter() {
  Join();
  // Without the collective that ends a sync (the program ended first), one
  // rank alone may still vouch for its folder: the marker goes, else it stays
  // and the next reader checks the files by hash.
  if (syncing_ && done_ && error_.empty() && drop_marker_at_exit_ && !marker_.empty()) {
    try {
      ckpt::RemoveUnsyncedMarker(dir_ + "/" + tag_);
    } catch (const std::exception&) {
      // Left in place: only costs the next reader a hash check.
    }
  }
}

void CheckpointWriter::Join() {
  if (thread_.joinable()) thread_.join();
}

void CheckpointWriter::Abandon() {
  Join();
  pending_ = false;
  syncing_ = false;
  files_.clear();
  written_.clear();
  state_.reset();
}

void CheckpointWriter::Start(std::string dir, std::string tag, std::string tmp, std::vector<SnapshotFile> files,
                             bool async, uint64_t snapshot_bytes, bool sync_after_publish, std::string marker) {
  if (pending_) throw std::logic_error("CheckpointWriter::Start: the previous save is not published");
  if (async && sync_after_publish) throw std::logic_error("CheckpointWriter::Start: a background save is synced first");
  sync_after_publish_ = sync_after_publish;
  syncing_ = false;
  marker_ = std::move(marker);
  dir_ = std::move(dir);
  tag_ = std::move(tag);
  tmp_ = std::move(tmp);
  files_ = std::move(files);
  state_.reset();
  if (files_.size() > kMaxFiles) throw std::logic_error("CheckpointWriter: too many files for one rank");
  for (const auto& f : files_)
    if (f.name.size() > kNameWords * 8) throw std::logic_error("CheckpointWriter: file name too long: " + f.name);
  written_.clear();
  error_.clear();
  snapshot_bytes_ = snapshot_bytes;
  pending_ = true;
  done_ = false;
  if (async) {
    thread_ = std::thread([this] { Write(); });
  } else {
    Write();
  }
}

// This rank's files as one copy plan, hashed as written, then one syncfs.
// With one host thread each file is generated front to back; with more,
// each is laid out first (its CRCs on every thread), and one larger than
// 64 MiB is written by one thread while another hashes it (ckpt/copy_plan.h):
// the same bytes.
// A file with streamed storages (a synchronous save's device tensors) is
// always generated front to back, its device bytes copied through a buffer
// of its own (files may be written at once).
void CheckpointWriter::Write() {
  try {
    const auto start = std::chrono::steady_clock::now();
    const int threads = ckpt::DefaultThreads();
    ckpt::CopyPlan plan;
    for (size_t k = 0; k < files_.size(); ++k) {
      const SnapshotFile& f = files_[k];
      const std::string path = tmp_ + "/" + f.name;
      const uint64_t streamed = LargestStreamed(f.value);
      if (threads > 1 && streamed == 0) {
        plan.files.push_back(ckpt::TorchFilePlan(path, f.value, threads));
        continue;
      }
      SaveOptions o;
      if (streamed > 0) o.stream_buffer = StreamBuffer(k, streamed);
      ckpt::PlannedFile p;
      p.path = path;
      p.generate = [&f, o](ckpt::OrderedSink& out) { SaveTorchFile(out, out.path(), f.value, o); };
      plan.files.push_back(std::move(p));
    }
    ckpt::CopyOptions options;
    options.threads = threads;
    const uint64_t ranges = g_range_bytes;
    options.split_bytes = ranges > 0 ? ranges : kSplitBytes;
    options.writers_per_file = ranges > 0 ? 0 : 1;
    options.overwrite_in_place = overwrite_in_place_;
    // Writeback started early for every save, published before durable
    // too: the disk works while the files are copied (on its own thread, the
    // copying threads never wait for it), so the syncfs after publishing has
    // little left, and the next save does not wait for this one's bytes. On
    // the 2-core VM (0.69 GB folder) the time until durable fell from 1.8-2.0
    // to 1.3-1.6 s, the time to return unchanged (docs/training.md).
    options.durable = true;
    const auto laid_out = std::chrono::steady_clock::now();
    layout_s_ = std::chrono::duration<double>(laid_out - start).count();
    const std::vector<ckpt::CopyResult> results = ckpt::ExecuteCopyPlan(plan, options);
    copy_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - laid_out).count();
    if (!files_.empty() && !sync_after_publish_) Env::Current().SyncFilesystem(tmp_);
    for (size_t k = 0; k < files_.size(); ++k) written_.push_back({files_[k].name, results[k].size, results[k].xxh64});
  } catch (const std::exception& ex) {
    error_ = ex.what();
  }
  done_ = true;
}

std::span<uint8_t> CheckpointWriter::StreamBuffer(size_t k, uint64_t largest) {
  const int64_t want = static_cast<int64_t>(std::min<uint64_t>(largest, kStreamBufferBytes));
  if (stream_buffers_.size() <= k) stream_buffers_.resize(k + 1);
  at::Tensor& b = stream_buffers_[k];
  if (!b.defined() || b.numel() < want)
    b = at::empty({want}, at::TensorOptions().dtype(at::kByte).pinned_memory(at::hasCUDA()));
  return {b.data_ptr<uint8_t>(), static_cast<size_t>(want)};
}

uint64_t CheckpointWriter::stream_buffer_bytes() const {
  uint64_t n = 0;
  for (const auto& b : stream_buffers_)
    if (b.defined()) n += b.numel();
  return n;
}

bool CheckpointWriter::PublishIfDone(Comm& comm) {
  if (!pending_) return false;
  // [any rank failed, any rank still writing]
  at::Tensor state = at::zeros({2}, at::kFloat);
  if (done_ && !error_.empty()) state[0] = 1.0f;
  if (!done_) state[1] = 1.0f;
  comm.AllReduceMax(state);
  if (state[0].item<float>() == 0 && state[1].item<float>() != 0) return false;
  Publish(comm);  // every rank done, or one failed: wait for the rest and report
  return true;
}

// Rank 0, after a failed save: the temporary folder, and the marker unless
// the folder was renamed into place already (then the marker stays: the
// folder is not known durable on every rank, and a reader checks it by hash).
void CheckpointWriter::DiscardFailed(const std::string& folder) const {
  RemoveQuietly(tmp_);
  std::error_code ec;
  if (marker_.empty() || !sync_after_publish_ || fs::exists(folder, ec) || ec) return;
  RemoveQuietly(marker_);
}

// Collective: every rank's file names, sizes and hashes, packed kWords to a
// rank, on every rank.
at::Tensor CheckpointWriter::GatherWritten(Comm& comm) const {
  at::Tensor mine = at::zeros({kWords}, at::kLong);
  int64_t* w = mine.data_ptr<int64_t>();
  for (size_t k = 0; k < written_.size(); ++k) {
    int64_t* e = w + k * (kNameWords + 2);
    std::memcpy(e, written_[k].name.data(), written_[k].name.size());
    e[kNameWords] = static_cast<int64_t>(written_[k].size);
    std::memcpy(&e[kNameWords + 1], &written_[k].xxh64, 8);
  }
  at::Tensor all = at::zeros({comm.world_size() * kWords}, at::kLong);
  if (comm.world_size() > 1) comm.AllGather(mine, all);
  else all.copy_(mine);
  return all;
}

namespace {

// The manifest's entries from GatherWritten's tensor.
std::vector<ckpt::ManifestEntry> UnpackWritten(const at::Tensor& all, int world_size) {
  std::vector<ckpt::ManifestEntry> known;
  const int64_t* a = all.data_ptr<int64_t>();
  for (int64_t k = 0; k < world_size * kMaxFiles; ++k) {
    const int64_t* e = a + k * (kNameWords + 2);
    const char* name = reinterpret_cast<const char*>(e);
    if (name[0] == 0) continue;
    ckpt::ManifestEntry m;
    m.path = std::string(name, strnlen(name, kNameWords * 8));
    m.size = static_cast<uint64_t>(e[kNameWords]);
    std::memcpy(&m.xxh64, &e[kNameWords + 1], 8);
    known.push_back(std::move(m));
  }
  return known;
}

}  // namespace

// Rank 0: the manifest into the temporary folder, the folder renamed to the
// tag, then `latest`.
void CheckpointWriter::PublishFolder(const std::vector<ckpt::ManifestEntry>& known, const std::string& folder) {
  const bool later = sync_after_publish_;
  Env& env = Env::Current();
  // A reused folder (overwrite_in_place_) holds only this save's files once published.
  if (overwrite_in_place_)
    for (const std::string& path : ListTree(env, tmp_))
      if (std::none_of(known.begin(), known.end(), [&](const ckpt::ManifestEntry& k) { return k.path == path; }))
        env.RemoveAll(tmp_ + "/" + path);
  // durable: its commit fsyncs `tmp` too. Published before durable, no
  // fsync at all: each would wait for the files' data (ext4's ordered mode).
  ckpt::WriteManifest(tmp_, known, /*durable=*/!later, state_ ? &*state_ : nullptr);
  ReplaceFolder(env, tmp_, folder);
  if (!later) env.SyncDir(dir_);
  AtomicFile latest(dir_ + "/" + ckpt::kLatestFile, /*durable=*/!later);
  latest.Write(tag_);
  latest.Commit();
  // A marker an interrupted earlier save of this tag left: this folder is durable.
  if (!later && !marker_.empty() && fs::exists(marker_)) ckpt::RemoveUnsyncedMarker(folder);
}

std::string CheckpointWriter::Publish(Comm& comm) {
  const std::string folder = dir_ + "/" + tag_;
  if (!pending_) return folder;
  Join();
  if (syncing_) {
    FinishSync(comm);
    return folder;
  }
  const bool rank0 = comm.rank() == 0;
  const bool later = sync_after_publish_;  // durable after publishing (above)
  // The snapshot is freed and the writer ready for the next save whatever
  // happens (unless a published folder's sync is to follow).
  struct Reset {
    CheckpointWriter& w;
    bool keep = false;
    ~Reset() {
      w.pending_ = keep;
      w.files_.clear();
    }
  } reset{*this};
  try {
    AgreeOrThrow(comm, folder, error_);
  } catch (...) {
    if (rank0) DiscardFailed(folder);
    throw;
  }
  const at::Tensor all = GatherWritten(comm);  // to rank 0, for the manifest
  std::string error;
  if (rank0) {
    try {
      PublishFolder(UnpackWritten(all, comm.world_size()), folder);
    } catch (const std::exception& ex) {
      error = ex.what();
      DiscardFailed(folder);
    }
  }
  AgreeOrThrow(comm, folder, error);
  if (later) {
    reset.keep = true;
    syncing_ = true;
    done_ = false;
    const bool one_host = AllOnOneHost(comm, dir_);  // collective: on every rank
    drop_marker_at_exit_ = rank0 && one_host;
    StartSync();
  }
  return folder;
}

// Every rank's syncfs of the filesystem holding the checkpoint folder (through
// `dir`, which a script does not move as it may the tag folder), on a
// background thread (FinishSync waits for it); on this thread if none can start.
void CheckpointWriter::StartSync() {
  error_.clear();
  auto sync = [this] {
    try {
      Env::Current().SyncFilesystem(dir_);
    } catch (const std::exception& ex) {
      error_ = ex.what();
    }
    done_ = true;
  };
  try {
    thread_ = std::thread(sync);
  } catch (const std::system_error&) {
    sync();
  }
}

void CheckpointWriter::FinishSync(Comm& comm) {
  const std::string folder = dir_ + "/" + tag_;
  pending_ = false;
  syncing_ = false;
  std::string error = AgreedError(comm, error_);
  if (error.empty() && comm.rank() == 0 && !marker_.empty()) {
    try {
      ckpt::RemoveUnsyncedMarker(dir_ + "/" + tag_);
    } catch (const std::exception& ex) {
      error = ex.what();
    }
  }
  error = AgreedError(comm, error);
  if (!error.empty())
    throw IoError("checkpoint " + folder + " is saved and published, but could not be made durable: " + error +
                  " (until it is, a load checks its files by hash: " + ckpt::UnsyncedMarkerPath(folder) + ")");
}

}  // namespace uckpt::engine
