// Files: read-only memory maps, and output files that appear under their final
// name only once complete (write to a temporary name, fsync, rename). Both go
// through the I/O seam (format/env.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "format/env.h"

namespace uckpt {

class MappedFile {
 public:
  // Maps `path` read-only, through Env::Current(). Throws IoError naming the path.
  static std::shared_ptr<const MappedFile> Open(const std::string& path);
  // The same without the Env (what the POSIX Env does).
  static std::shared_ptr<const MappedFile> OpenDirect(const std::string& path);
  // Wraps bytes already in memory (tests, fuzzers); `name` stands for the path.
  static std::shared_ptr<const MappedFile> FromMemory(std::vector<uint8_t> data, std::string name);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }
  // Whether `piece` lies inside this file's bytes.
  bool Holds(std::span<const uint8_t> piece) const {
    return !piece.empty() && piece.data() >= data_ && piece.data() + piece.size() <= data_ + size_;
  }
  // Drops the whole pages inside `piece` (which Holds) from this process once
  // they have been read, so that reading a file larger than memory leaves
  // no more of it resident than is being read; the bytes stay readable (read
  // again from the page cache). Nothing for a file held in memory.
  void DropPages(std::span<const uint8_t> piece) const;

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::vector<uint8_t> memory_;  // FromMemory only
};

// Where a writer of a file format puts its bytes, front to back (ZipWriter).
class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual void Write(std::span<const uint8_t> data) = 0;
  void Write(const std::string& s) { Write({reinterpret_cast<const uint8_t*>(s.data()), s.size()}); }
  // As Write, for bytes that stay valid and unchanged until the file is
  // complete: a sink may keep a reference to them instead of copying them.
  virtual void WriteKept(std::span<const uint8_t> data) { Write(data); }
  // Bytes written so far.
  virtual uint64_t offset() const = 0;
};

// Writes `path` through a temporary file beside it (`path`.tmp.<pid>), all
// through the Env current at construction. Commit() flushes, fsyncs, renames
// and fsyncs the folder; destroying an uncommitted file removes the temporary.
class AtomicFile : public ByteSink {
 public:
  // `durable`: fsync the file and its folder on Commit (off only for scratch
  // output and for benchmarks that compare against plain `cp`).
  explicit AtomicFile(std::string path, bool durable = true);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void Write(std::span<const uint8_t> data) override;
  using ByteSink::Write;
  uint64_t offset() const override { return offset_; }
  void Commit();
  const std::string& path() const { return path_; }

 private:
  void Flush();
  void WriteRaw(const uint8_t* p, size_t n);
  std::string path_, tmp_path_;
  Env& env_;
  std::unique_ptr<WritableFile> file_;
  uint64_t offset_ = 0;
  std::vector<uint8_t> buf_;
  bool committed_ = false;
  bool durable_ = true;
};

}  // namespace uckpt
