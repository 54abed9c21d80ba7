// The copy engine: one way to turn "these bytes go into these files" into
// files on disk at the speed of the disk, and back. `uckpt convert` writes
// every file through it, the engine's save writes each rank's files as one
// plan (engine/async_save.cc), and a load fills its partitions through its
// read plans (below; engine/staged_upload.h).
//
// A plan is a list of output files. Each file is one of
//   - pieces: byte ranges of memory (usually of memory-mapped input files)
//     placed at given offsets of the output, tiling it exactly;
//   - generated: a function that writes the file front to back through an
//     OrderedSink (torch files, whose zip records need a CRC computed as the
//     data passes);
//   - a whole-file copy of an input file (permission bits and times as
//     `cp -p`): inside the kernel (copy_file_range) when no hash is wanted,
//     else through a 1 MiB buffer that is hashed before it is written, which
//     measured faster than a kernel copy followed by hashing the source
//     through a memory map (format/env.h, Env::CopyFile).
// ExecuteCopyPlan runs the files on N threads, largest first, and returns
// each file's size and XXH64 (what the manifest lists), computed from the
// bytes as they are written, so nothing is read back afterwards.
//
// Hashing and order. XXH64 is a streaming hash: its state must see a file's
// bytes in order, and two halves cannot be combined afterwards. A generated
// file is written front to back by one thread, hashing each piece right
// before it is written, while it is in the CPU's cache; so is a pieces file
// (sorted by offset) when one thread runs the plan or the file is no larger
// than `split_bytes`. A larger pieces file is split into byte ranges written
// by several threads at once with positioned writes (pwrite) into the
// preallocated file; when its hash is wanted, one more job reads its pieces
// in order and hashes them meanwhile (from memory, not from the file). With
// `writers_per_file` 1, a hashed file is written by one thread while another
// hashes it: what a checkpoint save does with a rank's one big optimizer
// file (TorchFilePlan), because ext4 and XFS let one thread at a time copy
// into a file's page cache (they take the file's lock for each buffered
// write), and several writers of one file only contend for it (measured on
// ext4, bench/save_parts_bench.cc: 2 writers of a 2 GiB file took about 4x
// the CPU time of one, and 3x as long). For convert,
// which writes hundreds of files (three per parameter), one file per thread
// keeps every core busy.
//
// Durability. With `durable`, the engine asks the kernel to start writing
// each file back as soon as a stretch of it is written
// (sync_file_range(SYNC_FILE_RANGE_WRITE)), so the disk works while the CPUs
// copy; the caller then makes the whole folder durable with one
// Env::SyncFilesystem (syncfs) before renaming it into place (a synchronous
// engine save of a new tag: after publishing it, engine/async_save.h), which
// by then has little left to wait for. No file is fsynced on its own. Those requests
// are made by a thread of their own, because sync_file_range can wait (for
// the device's queue, or for ext4 reading block bitmaps to allocate the
// blocks): the copying threads do not (measured 8-10% faster wall time on
// the 2-core VM).
//
// Files are created at their final names: the caller writes into a
// temporary folder that is renamed into place only when complete
// (docs/reliability.md), so a file cut short by a crash is never seen under
// the output's name. Every create, write and copy goes through Env::Current()
// (format/env.h): fault injection and the crash hook see them, and errors
// are IoError naming the file.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "format/file.h"
#include "format/value.h"

namespace uckpt::ckpt {

// Where a piece's bytes go.
struct CopyPiece {
  std::span<const uint8_t> data;  // must stay valid until ExecuteCopyPlan returns
  uint64_t offset = 0;            // in the output file
};

// The writer a generated file writes through, front to back. Large spans
// go to the file without being copied; small ones are gathered first.
class OrderedSink : public ByteSink {
 public:
  virtual const std::string& path() const = 0;
};

struct PlannedFile {
  std::string path;                            // created (or truncated); its folder must exist
  std::vector<CopyPiece> pieces;               // a pieces file: these, tiling [0, size)
  uint64_t size = 0;                           // a pieces file's size; else an estimate for ordering
  std::function<void(OrderedSink&)> generate;  // a generated file
  std::string copy_from;                       // a whole-file copy of this file
  bool hash = true;                            // compute its XXH64
  std::shared_ptr<const void> keep;            // holds bytes the pieces point into (a laid-out torch file)
};

struct CopyPlan {
  std::vector<PlannedFile> files;
};

struct CopyResult {
  uint64_t size = 0;
  uint64_t xxh64 = 0;  // valid when the file's `hash` was set
};

struct CopyOptions {
  int threads = 0;                     // 0: DefaultThreads() (ckpt/parallel.h)
  bool durable = true;                 // start writeback early (see above); the caller syncs at the end
  uint64_t split_bytes = 64ull << 20;  // pieces files above this are split over threads
  // 0: a split file's ranges (of split_bytes) are written by any number of
  // threads at once; 1: by one thread, front to back, while another hashes
  // it (a hashed file; an unhashed one is then not split).
  int writers_per_file = 0;
  // Files that exist are written over in place (Env::OverwriteFile: a reused
  // folder's pages kept), not truncated first; the bytes in the end are the same.
  bool overwrite_in_place = false;
  // Called with each range of piece data (at most 1 MiB) once written, from
  // the writing thread (the converter drops memory-mapped input pages there).
  std::function<void(std::span<const uint8_t>)> written;
  // Called once per finished file, from the thread that wrote it, one call at
  // a time; may throw to stop the plan (as on an error).
  std::function<void(size_t file, const CopyResult& result)> done;
};

// A torch.save file of `root` at `path` as a pieces file (format/torch_file.h,
// LayOutTorchFile: the same bytes as SaveTorchFile), its records' CRC-32s
// computed first on `threads` threads (0: DefaultThreads()), 16 MiB at a
// time; the storages' bytes must stay valid until the plan has run.
PlannedFile TorchFilePlan(const std::string& path, const ValuePtr& root, int threads = 0);

// The CRC-32 of each span, spread over `threads` threads in `chunk`-byte
// pieces joined with Crc32Combine.
std::vector<uint32_t> ParallelCrc32(const std::vector<std::span<const uint8_t>>& spans, int threads,
                                    uint64_t chunk = 16ull << 20);

// Writes every file of `plan`; results are in plan order. On an error (or an
// exception from `done`) the other threads stop after their current file and
// the first error is rethrown; files already written are left for the caller
// to remove with its temporary folder. Throws IoError naming the file, and
// std::invalid_argument for a pieces file whose pieces do not tile it.
std::vector<CopyResult> ExecuteCopyPlan(const CopyPlan& plan, const CopyOptions& options = {});

// ---- Reads: the reverse plan, byte ranges of (memory-mapped) input files
// into memory (a resume reading its partition, ckpt/reshard.h). ----

struct ReadPiece {
  std::span<const uint8_t> from;  // must stay valid until ExecuteReads returns
  uint64_t to = 0;                // byte offset in the batch's buffer
};

// Pieces that fill (parts of) one buffer.
struct ReadBatch {
  std::span<uint8_t> into;
  std::vector<ReadPiece> pieces;
};

struct ReadOptions {
  int threads = 0;              // 0: min(4, DefaultThreads())
  uint64_t chunk = 8ull << 20;  // pieces larger than this are split over threads
  // Called on the reading thread with each source range once it is copied
  // (a load drops the pages it read from memory-mapped files there).
  std::function<void(std::span<const uint8_t>)> read;
};

// Copies every piece into its buffer, on several threads. Returns the bytes
// read (the sum of the pieces' sizes). Throws std::invalid_argument for a
// piece that does not fit its buffer (before anything is copied).
uint64_t ExecuteReads(std::span<const ReadBatch> batches, const ReadOptions& options = {});

// Staging a buffer through smaller windows (a load onto a GPU reads its
// partition chunk by chunk into pinned host memory, engine/staged_upload.h).

// A range [begin, end) of bytes.
struct ByteRange {
  uint64_t begin = 0, end = 0;
  uint64_t size() const { return end - begin; }
  bool operator==(const ByteRange&) const = default;
};

// `pieces` sorted by destination offset (empty ones dropped). Throws
// std::invalid_argument when a piece does not fit a buffer of `size` bytes
// or two pieces overlap.
std::vector<ReadPiece> SortReads(std::span<const ReadPiece> pieces, uint64_t size);

// The parts of `sorted` (SortReads' result) that land in `window` of the
// buffer, cut at its edges, with destination offsets made relative to
// window.begin: the pieces that fill a buffer holding only that window.
std::vector<ReadPiece> ClipReads(std::span<const ReadPiece> sorted, ByteRange window);

// The ranges of [0, size) that no piece covers (padding, which a load must
// zero), in order; `sorted` as from SortReads.
std::vector<ByteRange> UncoveredRanges(std::span<const ReadPiece> sorted, uint64_t size);

}  // namespace uckpt::ckpt
