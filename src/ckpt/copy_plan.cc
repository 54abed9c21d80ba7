#include "ckpt/copy_plan.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <thread>

#include "ckpt/parallel.h"
#include "format/error.h"
#include "format/torch_file.h"
#include "format/zip.h"

namespace uckpt::ckpt {

namespace {

constexpr size_t kChunk = 1 << 20;                // largest single write; smaller writes are gathered to this
constexpr uint64_t kWritebackStep = 16ull << 20;  // start writeback after this many new bytes of a file

// Starts writeback (sync_file_range SYNC_FILE_RANGE_WRITE) on a thread of
// its own: the call can wait (for the device queue, or for ext4 to read
// block bitmaps while it allocates the blocks), and the copying threads
// should not. It opens the file by name for each change of file; the
// request is only a hint, so a file it cannot open is skipped.
class WritebackThread {
 public:
  explicit WritebackThread(bool on) {
    if (on) thread_ = std::thread([this] { Run(); });
  }
  ~WritebackThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }
  void Post(const std::string& path, uint64_t offset, uint64_t length) {
    if (!thread_.joinable() || length == 0) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({path, offset, length});
    }
    cv_.notify_one();
  }

 private:
  struct Request {
    std::string path;
    uint64_t offset, length;
  };
  void Run() {
    std::string open_path;
    int fd = -1;
    for (;;) {
      Request r;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) break;  // stopped, and every request done
        r = std::move(queue_.front());
        queue_.pop_front();
      }
      if (r.path != open_path) {
        if (fd >= 0) ::close(fd);
        fd = ::open(r.path.c_str(), O_RDONLY | O_CLOEXEC);
        open_path = r.path;
      }
      if (fd >= 0)
        ::sync_file_range(fd, static_cast<off_t>(r.offset), static_cast<off_t>(r.length), SYNC_FILE_RANGE_WRITE);
    }
    if (fd >= 0) ::close(fd);
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Request> queue_;
  bool stop_ = false;
  std::thread thread_;
};

using HashState = std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)>;

HashState NewHash(bool on) {
  HashState h(on ? XXH64_createState() : nullptr, &XXH64_freeState);
  if (on && !h) throw std::bad_alloc();
  if (h) XXH64_reset(h.get(), 0);
  return h;
}

// Writes one file front to back, hashing the bytes as they pass and starting
// writeback every kWritebackStep bytes when durable.
class SequentialWriter final : public OrderedSink {
 public:
  SequentialWriter(const std::string& path, bool hash, WritebackThread* writeback, bool overwrite)
      : path_(path),
        file_(overwrite ? Env::Current().OverwriteFile(path) : Env::Current().NewWritableFile(path)),
        hash_(NewHash(hash)),
        wb_(writeback) {}

  void Write(std::span<const uint8_t> data) override {
    if (data.empty()) return;
    if (hash_) XXH64_update(hash_.get(), data.data(), data.size());
    offset_ += data.size();
    if (buf_.empty() && data.size() >= kChunk) {  // a whole chunk: no need to gather it
      WriteAll(data);
      return;
    }
    if (buf_.size() + data.size() <= kChunk) {
      buf_.insert(buf_.end(), data.begin(), data.end());
      if (buf_.size() == kChunk) Flush();
      return;
    }
    Flush();
    if (data.size() >= kChunk) {
      WriteAll(data);
    } else {
      buf_.insert(buf_.end(), data.begin(), data.end());
    }
  }
  using ByteSink::Write;
  uint64_t offset() const override { return offset_; }
  const std::string& path() const override { return path_; }

  CopyResult Finish() {
    Flush();
    if (wb_) wb_->Post(path_, writeback_, written_ - writeback_);
    file_->Close();
    return {offset_, hash_ ? XXH64_digest(hash_.get()) : 0};
  }

 private:
  void Flush() {
    if (buf_.empty()) return;
    WriteAll(buf_);
    buf_.clear();
  }
  void WriteAll(std::span<const uint8_t> data) {
    while (!data.empty()) {
      size_t n = file_->WriteAt(written_, data);  // may be short; throws on error
      data = data.subspan(n);
      written_ += n;
    }
    if (wb_ && written_ - writeback_ >= kWritebackStep) {
      wb_->Post(path_, writeback_, written_ - writeback_);
      writeback_ = written_;
    }
  }

  std::string path_;
  std::unique_ptr<WritableFile> file_;
  HashState hash_;
  WritebackThread* wb_;
  std::vector<uint8_t> buf_;
  uint64_t offset_ = 0, written_ = 0, writeback_ = 0;
};

// The pieces of `f` sorted by offset; throws unless they tile [0, f.size).
std::vector<CopyPiece> SortedPieces(const PlannedFile& f) {
  std::vector<CopyPiece> pieces;
  pieces.reserve(f.pieces.size());
  for (const auto& p : f.pieces)
    if (!p.data.empty()) pieces.push_back(p);
  std::stable_sort(pieces.begin(), pieces.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  uint64_t at = 0;
  for (const auto& p : pieces) {
    if (p.offset != at)
      throw std::invalid_argument("copy plan for " + f.path + ": " + (p.offset < at ? "pieces overlap" : "a gap") +
                                  " at offset " + std::to_string(std::min(at, p.offset)));
    at += p.data.size();
  }
  if (at != f.size)
    throw std::invalid_argument("copy plan for " + f.path + ": pieces cover " + std::to_string(at) + " of " +
                                std::to_string(f.size) + " bytes");
  return pieces;
}

// Writes the pieces' bytes that fall in [begin, end) of the file with
// positioned writes of at most kChunk bytes.
void WriteRange(WritableFile& file, const std::vector<CopyPiece>& pieces, uint64_t begin, uint64_t end,
                const CopyOptions& options, WritebackThread* wb, const std::string& path) {
  auto it = std::upper_bound(pieces.begin(), pieces.end(), begin,
                             [](uint64_t v, const CopyPiece& p) { return v < p.offset; });
  if (it != pieces.begin()) --it;
  uint64_t writeback = begin;
  for (; it != pieces.end() && it->offset < end; ++it) {
    const uint64_t lo = std::max(begin, it->offset), hi = std::min(end, it->offset + it->data.size());
    for (uint64_t at = lo; at < hi;) {
      const uint64_t n = std::min<uint64_t>(kChunk, hi - at);
      std::span<const uint8_t> chunk = it->data.subspan(at - it->offset, n);
      for (std::span<const uint8_t> rest = chunk; !rest.empty();)
        rest = rest.subspan(file.WriteAt(at + (chunk.size() - rest.size()), rest));
      if (options.written) options.written(chunk);
      at += n;
      if (wb && at - writeback >= kWritebackStep) {
        wb->Post(path, writeback, at - writeback);
        writeback = at;
      }
    }
  }
  if (wb && end > writeback) wb->Post(path, writeback, end - writeback);
}

// A whole-file copy: inside the kernel (copy_file_range) when no hash is
// wanted; else through a 1 MiB buffer, hashing each buffer before it is
// written (faster than hashing the source's map after a kernel copy, see
// Env::CopyFile).
CopyResult CopyWhole(const PlannedFile& f, WritebackThread* wb) {
  HashState hash = NewHash(f.hash);
  Env::CopySeen seen;
  if (f.hash) seen = [&](std::span<const uint8_t> bytes) { XXH64_update(hash.get(), bytes.data(), bytes.size()); };
  const uint64_t size = Env::Current().CopyFile(f.copy_from, f.path, seen);
  if (wb) wb->Post(f.path, 0, size);
  return {size, hash ? XXH64_digest(hash.get()) : 0};
}

// One unit of work: a whole file, or one byte range of a split pieces file,
// or the hash of a split file.
struct Job {
  size_t file;
  uint64_t begin = 0, end = 0;  // a range of a split file; end == 0: the whole file
  uint64_t bytes = 0;           // for ordering
  bool hash = false;            // a split file's hash: its pieces read in order, nothing written
};

// A pieces file split over several jobs: opened by the first writer, closed
// by the last job.
struct SplitFile {
  std::once_flag open;
  std::unique_ptr<WritableFile> file;
  std::vector<CopyPiece> pieces;
  std::atomic<size_t> left{0};
  uint64_t xxh64 = 0;       // set by the hash job
  bool one_writer = false;  // one job writes it all, front to back
};

uint64_t HashPieces(const std::vector<CopyPiece>& sorted) {
  HashState hash = NewHash(true);
  for (const CopyPiece& p : sorted) XXH64_update(hash.get(), p.data.data(), p.data.size());
  return XXH64_digest(hash.get());
}

// The plan's jobs, largest first: a file is one job, or, when several threads
// write it or one hashes it beside its writer, one job per range (its
// SplitFile in `split`) and a hash job.
std::vector<Job> PlanJobs(const CopyPlan& plan, const CopyOptions& options, int threads,
                          std::vector<std::unique_ptr<SplitFile>>& split) {
  std::vector<Job> jobs;
  for (size_t i = 0; i < plan.files.size(); ++i) {
    const PlannedFile& f = plan.files[i];
    const int kinds = (f.generate ? 1 : 0) + (f.copy_from.empty() ? 0 : 1);
    if (kinds > 1 || (kinds == 1 && !f.pieces.empty()))
      throw std::invalid_argument("copy plan for " + f.path + ": more than one of pieces, generate, copy_from");
    const bool pieces = kinds == 0;
    const bool one_writer = options.writers_per_file == 1;
    const uint64_t split_bytes = std::max<uint64_t>(options.split_bytes, 1);
    const uint64_t step = one_writer ? f.size : split_bytes;
    if (pieces && threads > 1 && f.size > split_bytes && (f.hash || !one_writer)) {
      auto s = std::make_unique<SplitFile>();
      s->pieces = SortedPieces(f);
      s->one_writer = one_writer;
      for (uint64_t b = 0; b < f.size; b += step) {
        jobs.push_back({i, b, std::min(f.size, b + step), std::min(f.size, b + step) - b});
        ++s->left;
      }
      if (f.hash) {  // the longest job: sorted first, it runs while the ranges are written
        jobs.push_back({i, 0, 0, f.size, true});
        ++s->left;
      }
      split[i] = std::move(s);
    } else {
      jobs.push_back({i, 0, 0, f.size});
    }
  }
  std::stable_sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.bytes > b.bytes; });
  return jobs;
}

// One job of a split file: a range written, or the whole file hashed.
// Returns whether it was the file's last (then the file is closed).
bool RunSplitJob(const Job& job, const PlannedFile& f, SplitFile& s, const CopyOptions& options, WritebackThread* wb) {
  if (job.hash) {
    s.xxh64 = HashPieces(s.pieces);
  } else {
    std::call_once(s.open, [&] {
      s.file =
          options.overwrite_in_place ? Env::Current().OverwriteFile(f.path) : Env::Current().NewWritableFile(f.path);
      // Several writers need the file's whole size first; one writing it
      // front to back appends, as the sequential writer does.
      if (!s.one_writer) s.file->Allocate(f.size);
    });
    if (!s.file) throw IoError("cannot write " + f.path + ": it could not be created");
    WriteRange(*s.file, s.pieces, job.begin, job.end, options, wb, f.path);
  }
  if (--s.left != 0) return false;  // a failed range never counts down
  s.file->Close();
  return true;
}

// A file one job writes: copied whole, generated, or its pieces in order.
CopyResult WriteWholeFile(const PlannedFile& f, const CopyOptions& options, WritebackThread* wb) {
  if (!f.copy_from.empty()) return CopyWhole(f, wb);
  SequentialWriter out(f.path, f.hash, wb, options.overwrite_in_place);
  if (f.generate) {
    f.generate(out);
  } else {
    for (const CopyPiece& p : SortedPieces(f))
      for (size_t at = 0; at < p.data.size(); at += kChunk) {
        auto chunk = p.data.subspan(at, std::min(kChunk, p.data.size() - at));
        out.Write(chunk);
        if (options.written) options.written(chunk);
      }
  }
  return out.Finish();
}

}  // namespace

std::vector<CopyResult> ExecuteCopyPlan(const CopyPlan& plan, const CopyOptions& options) {
  const size_t n = plan.files.size();
  std::vector<CopyResult> results(n);
  int threads = options.threads > 0 ? options.threads : DefaultThreads();
  threads = std::max(1, threads);
  std::vector<std::unique_ptr<SplitFile>> split(n);
  const std::vector<Job> jobs = PlanJobs(plan, options, threads, split);
  threads = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), std::max<size_t>(1, jobs.size())));

  WritebackThread writeback(options.durable);
  WritebackThread* wb = options.durable ? &writeback : nullptr;
  std::mutex done_mu;
  auto run = [&](const Job& job) {
    const PlannedFile& f = plan.files[job.file];
    if (SplitFile* s = split[job.file].get()) {
      if (!RunSplitJob(job, f, *s, options, wb)) return;
      results[job.file] = {f.size, s->xxh64};
    } else {
      results[job.file] = WriteWholeFile(f, options, wb);
    }
    if (!options.done) return;
    std::lock_guard<std::mutex> lock(done_mu);
    options.done(job.file, results[job.file]);
  };
  ParallelFor(jobs.size(), threads, [&](size_t k) { run(jobs[k]); });
  return results;
}

std::vector<uint32_t> ParallelCrc32(const std::vector<std::span<const uint8_t>>& spans, int threads, uint64_t chunk) {
  struct Part {
    size_t span;
    uint64_t begin, size;
    uint32_t crc = 0;
  };
  chunk = std::max<uint64_t>(chunk, 1);
  std::vector<Part> parts;
  for (size_t k = 0; k < spans.size(); ++k)
    for (uint64_t at = 0; at < spans[k].size(); at += chunk)
      parts.push_back({k, at, std::min<uint64_t>(chunk, spans[k].size() - at)});
  const int n = threads > 0 ? threads : DefaultThreads();
  ParallelFor(parts.size(), std::max(1, std::min<int>(n, static_cast<int>(std::max<size_t>(1, parts.size())))),
              [&](size_t k) { parts[k].crc = Crc32(spans[parts[k].span].subspan(parts[k].begin, parts[k].size)); });
  std::vector<uint32_t> crcs(spans.size(), 0);
  for (const Part& p : parts) crcs[p.span] = p.begin == 0 ? p.crc : Crc32Combine(crcs[p.span], p.crc, p.size);
  return crcs;
}

PlannedFile TorchFilePlan(const std::string& path, const ValuePtr& root, int threads) {
  TorchFileLayout layout = LayOutTorchFile(path, root, [&](const std::vector<std::span<const uint8_t>>& storages) {
    return ParallelCrc32(storages, threads);
  });
  PlannedFile f;
  f.path = path;
  f.size = layout.size;
  f.pieces.reserve(layout.pieces.size());
  for (const FilePiece& p : layout.pieces) f.pieces.push_back({p.data, p.offset});
  f.keep = std::move(layout.keep);
  return f;
}

uint64_t ExecuteReads(std::span<const ReadBatch> batches, const ReadOptions& options) {
  struct Task {
    const uint8_t* from;
    uint8_t* to;
    uint64_t size;
  };
  std::vector<Task> tasks;
  uint64_t total = 0;
  const uint64_t chunk = std::max<uint64_t>(options.chunk, 1);
  for (const ReadBatch& b : batches) {
    for (const ReadPiece& p : b.pieces) {
      if (p.to > b.into.size() || p.from.size() > b.into.size() - p.to)
        throw std::invalid_argument("ExecuteReads: a piece of " + std::to_string(p.from.size()) + " bytes at " +
                                    std::to_string(p.to) + " does not fit a buffer of " +
                                    std::to_string(b.into.size()));
      for (uint64_t at = 0; at < p.from.size(); at += chunk)
        tasks.push_back({p.from.data() + at, b.into.data() + p.to + at, std::min(chunk, p.from.size() - at)});
      total += p.from.size();
    }
  }
  ParallelFor(tasks.size(), WorkerThreads(options.threads, tasks.size()), [&](size_t k) {
    std::memcpy(tasks[k].to, tasks[k].from, tasks[k].size);
    if (options.read) options.read({tasks[k].from, tasks[k].size});
  });
  return total;
}

std::vector<ReadPiece> SortReads(std::span<const ReadPiece> pieces, uint64_t size) {
  std::vector<ReadPiece> sorted;
  sorted.reserve(pieces.size());
  for (const ReadPiece& p : pieces) {
    if (p.to > size || p.from.size() > size - p.to)
      throw std::invalid_argument("read plan: a piece of " + std::to_string(p.from.size()) + " bytes at " +
                                  std::to_string(p.to) + " does not fit a buffer of " + std::to_string(size));
    if (!p.from.empty()) sorted.push_back(p);
  }
  std::stable_sort(sorted.begin(), sorted.end(), [](const ReadPiece& a, const ReadPiece& b) { return a.to < b.to; });
  for (size_t k = 1; k < sorted.size(); ++k)
    if (sorted[k].to < sorted[k - 1].to + sorted[k - 1].from.size())
      throw std::invalid_argument("read plan: pieces overlap at byte " + std::to_string(sorted[k].to));
  return sorted;
}

std::vector<ReadPiece> ClipReads(std::span<const ReadPiece> sorted, ByteRange window) {
  std::vector<ReadPiece> out;
  if (window.end <= window.begin) return out;
  // The first piece that ends after the window begins (pieces do not overlap,
  // so their ends are sorted too).
  auto it = std::partition_point(sorted.begin(), sorted.end(),
                                 [&](const ReadPiece& p) { return p.to + p.from.size() <= window.begin; });
  for (; it != sorted.end() && it->to < window.end; ++it) {
    const uint64_t lo = std::max(window.begin, it->to), hi = std::min(window.end, it->to + it->from.size());
    out.push_back({it->from.subspan(lo - it->to, hi - lo), lo - window.begin});
  }
  return out;
}

std::vector<ByteRange> UncoveredRanges(std::span<const ReadPiece> sorted, uint64_t size) {
  std::vector<ByteRange> gaps;
  uint64_t at = 0;
  for (const ReadPiece& p : sorted) {
    if (p.to > at) gaps.push_back({at, std::min(p.to, size)});
    at = std::max(at, p.to + p.from.size());
    if (at >= size) break;
  }
  if (at < size) gaps.push_back({at, size});
  return gaps;
}

}  // namespace uckpt::ckpt
