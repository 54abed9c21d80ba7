// The I/O seam. Every file uckpt creates, writes, syncs, renames or removes
// for a checkpoint, and every file it maps for reading, goes through
// Env::Current(): the POSIX implementation, unless a test (fault injection)
// or the crash hook (src/format/fault_env.h) put another one in its place.
// Errors are IoError naming the file and the system's reason.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace uckpt {

class MappedFile;

// A file being written, as write(2): Write may take only a prefix of `data`.
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Writes a prefix of `data` (at least one byte when `data` is not empty)
  // and returns its length. Throws IoError naming the file.
  virtual size_t Write(std::span<const uint8_t> data) = 0;
  // As Write, at `offset` (pwrite): the file position does not move, and
  // several threads may write disjoint ranges at once.
  virtual size_t WriteAt(uint64_t offset, std::span<const uint8_t> data) = 0;
  // Reserves disk space for `size` bytes and makes the file that long
  // (fallocate; ftruncate where the filesystem cannot), so positioned writes
  // from several threads neither extend the file nor fail half-way for space.
  virtual void Allocate(uint64_t size) = 0;
  virtual void Sync() = 0;   // fsync
  virtual void Close() = 0;  // the destructor closes too, ignoring errors
  virtual const std::string& path() const = 0;
};

class Env {
 public:
  virtual ~Env() = default;

  // The Env in use (process-wide). Thread-safe.
  static Env& Current();
  // The operating system's, which Current() is unless overridden.
  static Env& Posix();

  // Reading: the whole file mapped read-only.
  virtual std::shared_ptr<const MappedFile> MapFile(const std::string& path) = 0;

  // Listing: the entries of the folder `path`, one level, without "." and
  // "..", in no particular order. Throws IoError naming the folder.
  struct DirEntry {
    enum class Type { kFile, kDir, kSymlink, kOther };  // as lstat(2) says: links not followed
    std::string name;
    Type type = Type::kOther;
  };
  virtual std::vector<DirEntry> ListDir(const std::string& path) = 0;

  // Writing. Each of these is a "write point" for the crash hook.
  // Creates (or truncates) `path` for writing with permission bits `mode`.
  virtual std::unique_ptr<WritableFile> NewWritableFile(const std::string& path, unsigned mode = 0644) = 0;
  // As NewWritableFile for a file the caller writes whole, but an existing
  // `path` is written over in place and cut at Close() to the end of what was
  // written (or Allocate'd), so its pages are reused, not freed and allocated
  // again (on tmpfs that is half the cost of writing). By default it
  // truncates (the same bytes in the end); the operating system's Env reuses.
  virtual std::unique_ptr<WritableFile> OverwriteFile(const std::string& path, unsigned mode = 0644) {
    return NewWritableFile(path, mode);
  }
  // Copies a file's bytes, permission bits and times (as cp -p); returns the size.
  // Without `seen`, the data is copied inside the kernel (copy_file_range)
  // where it can be. With `seen`, it goes through a 1 MiB buffer instead
  // (read, seen(bytes), write), so that the caller sees, in order, exactly
  // the bytes written (the copy engine hashes them there). Measured: that
  // is faster than copy_file_range followed by hashing the source through a
  // memory map (0.29 s against 0.37 s for 680 MB from the page cache).
  using CopySeen = std::function<void(std::span<const uint8_t> bytes)>;
  virtual uint64_t CopyFile(const std::string& from, const std::string& to, const CopySeen& seen = nullptr) = 0;
  virtual void CreateDirs(const std::string& path) = 0;  // mkdir -p
  virtual void Rename(const std::string& from, const std::string& to) = 0;
  // Swaps two existing paths atomically (renameat2 RENAME_EXCHANGE); false,
  // with nothing changed, where the filesystem cannot.
  virtual bool Exchange(const std::string& a, const std::string& b) = 0;
  virtual void RemoveAll(const std::string& path) = 0;  // a file or a tree; absent is fine
  // fsync of a folder, so the names created or renamed in it are durable.
  virtual void SyncDir(const std::string& dir) = 0;
  // Flushes every file of the filesystem holding `path` (syncfs): one call
  // instead of an fsync per file for folders of many files.
  virtual void SyncFilesystem(const std::string& path) = 0;
  // Asks the kernel to drop the file's clean pages from the page cache
  // (posix_fadvise DONTNEED), so that the next read comes from the disk.
  // Best effort: never throws.
  virtual void DropCached(const std::string& path) = 0;
};

// Renames the finished folder `tmp` to `dest`. An existing `dest` is swapped
// out atomically where the filesystem can (so `dest` always names a complete
// folder), else moved aside to a hidden `.<name>.uckpt-old` beside it and put
// back if the rename fails; the old folder is removed afterwards.
void ReplaceFolder(Env& env, const std::string& tmp, const std::string& dest);

// The regular files under `folder` (links not followed), recursively, as
// '/'-separated paths relative to it, sorted; one ListDir of each folder.
std::vector<std::string> ListTree(Env& env, const std::string& folder);

// Forwards every call to `target`; override what you want to change.
class EnvWrapper : public Env {
 public:
  explicit EnvWrapper(Env& target) : target_(target) {}

  std::shared_ptr<const MappedFile> MapFile(const std::string& path) override { return target_.MapFile(path); }
  std::vector<DirEntry> ListDir(const std::string& path) override { return target_.ListDir(path); }
  std::unique_ptr<WritableFile> NewWritableFile(const std::string& path, unsigned mode) override {
    return target_.NewWritableFile(path, mode);
  }
  uint64_t CopyFile(const std::string& from, const std::string& to, const CopySeen& seen = nullptr) override {
    return target_.CopyFile(from, to, seen);
  }
  void CreateDirs(const std::string& path) override { target_.CreateDirs(path); }
  void Rename(const std::string& from, const std::string& to) override { target_.Rename(from, to); }
  bool Exchange(const std::string& a, const std::string& b) override { return target_.Exchange(a, b); }
  void RemoveAll(const std::string& path) override { target_.RemoveAll(path); }
  void SyncDir(const std::string& dir) override { target_.SyncDir(dir); }
  void SyncFilesystem(const std::string& path) override { target_.SyncFilesystem(path); }
  void DropCached(const std::string& path) override { target_.DropCached(path); }

 private:
  Env& target_;
};

// Makes `env` the current Env for this object's lifetime (tests). Not nested
// across threads: one override at a time.
class ScopedEnv {
 public:
  explicit ScopedEnv(Env& env);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  Env* previous_;
};

}  // namespace uckpt
