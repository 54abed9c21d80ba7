#include "format/env.h"

#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>  // renameat2
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "format/error.h"
#include "format/file.h"

namespace uckpt {
namespace {

namespace fs = std::filesystem;

class PosixWritableFile : public WritableFile {
 public:
  // `cut_at_close`: opened over an existing file (Env::OverwriteFile), cut at
  // Close() to the end of what was written.
  PosixWritableFile(std::string path, int fd, bool cut_at_close = false)
      : path_(std::move(path)), fd_(fd), cut_at_close_(cut_at_close) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  size_t Write(std::span<const uint8_t> data) override {
    if (data.empty()) return 0;
    for (;;) {
      ssize_t w = ::write(fd_, data.data(), data.size());
      if (w > 0) {
        if (cut_at_close_) Reached(position_ += static_cast<uint64_t>(w));
        return static_cast<size_t>(w);
      }
      if (w < 0 && errno == EINTR) continue;
      ThrowErrno("cannot write", path_, w == 0 ? ENOSPC : errno);
    }
  }

  size_t WriteAt(uint64_t offset, std::span<const uint8_t> data) override {
    if (data.empty()) return 0;
    for (;;) {
      ssize_t w = ::pwrite(fd_, data.data(), data.size(), static_cast<off_t>(offset));
      if (w > 0) {
        if (cut_at_close_) Reached(offset + static_cast<uint64_t>(w));
        return static_cast<size_t>(w);
      }
      if (w < 0 && errno == EINTR) continue;
      ThrowErrno("cannot write", path_, w == 0 ? ENOSPC : errno);
    }
  }

  void Allocate(uint64_t size) override {
    if (size == 0) return;
    if (cut_at_close_) Reached(size);
    int r;
    while ((r = ::fallocate(fd_, 0, 0, static_cast<off_t>(size))) != 0 && errno == EINTR) {}
    if (r == 0) return;
    if (errno != EOPNOTSUPP && errno != ENOSYS) ThrowErrno("cannot allocate space for", path_);
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) ThrowErrno("cannot set the size of", path_);
  }

  void Sync() override {
    if (::fsync(fd_) != 0) ThrowErrno("cannot fsync", path_);
  }

  void Close() override {
    if (fd_ < 0) return;
    int fd = fd_;
    fd_ = -1;
    if (cut_at_close_ && ::ftruncate(fd, static_cast<off_t>(end_.load())) != 0) {
      int e = errno;
      ::close(fd);
      ThrowErrno("cannot set the size of", path_, e);
    }
    if (::close(fd) != 0) ThrowErrno("cannot close", path_);
  }

  const std::string& path() const override { return path_; }

 private:
  // The file reaches at least `end` (WriteAt may run on several threads).
  void Reached(uint64_t end) {
    uint64_t seen = end_.load();
    while (seen < end && !end_.compare_exchange_weak(seen, end)) {}
  }

  std::string path_;
  int fd_;
  bool cut_at_close_;
  // With cut_at_close_: Write's position (one thread), and the end any write reached.
  uint64_t position_ = 0;
  std::atomic<uint64_t> end_{0};
};

class PosixEnv : public Env {
 public:
  std::shared_ptr<const MappedFile> MapFile(const std::string& path) override { return MappedFile::OpenDirect(path); }

  std::vector<DirEntry> ListDir(const std::string& path) override {
    std::error_code ec;
    fs::directory_iterator it(path, ec), end;
    if (ec) throw IoError("cannot read folder " + path + ": " + ec.message());
    std::vector<DirEntry> out;
    for (; it != end; it.increment(ec)) {
      if (ec) break;
      std::error_code sec;
      const fs::file_type t = it->symlink_status(sec).type();
      DirEntry e{it->path().filename().string(), DirEntry::Type::kOther};
      if (t == fs::file_type::regular) e.type = DirEntry::Type::kFile;
      if (t == fs::file_type::directory) e.type = DirEntry::Type::kDir;
      if (t == fs::file_type::symlink) e.type = DirEntry::Type::kSymlink;
      out.push_back(std::move(e));
    }
    if (ec) throw IoError("cannot read folder " + path + ": " + ec.message());
    return out;
  }

  std::unique_ptr<WritableFile> NewWritableFile(const std::string& path, unsigned mode) override {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (fd < 0) ThrowErrno("cannot create", path);
    return std::make_unique<PosixWritableFile>(path, fd);
  }

  std::unique_ptr<WritableFile> OverwriteFile(const std::string& path, unsigned mode) override {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, mode);
    if (fd < 0) ThrowErrno("cannot create", path);
    return std::make_unique<PosixWritableFile>(path, fd, /*cut_at_close=*/true);
  }

  uint64_t CopyFile(const std::string& from, const std::string& to, const CopySeen& seen) override {
    int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
    if (in < 0) ThrowErrno("cannot open", from);
    struct stat st;
    if (::fstat(in, &st) != 0) {
      int e = errno;
      ::close(in);
      ThrowErrno("cannot stat", from, e);
    }
    int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, st.st_mode & 0777);
    if (out < 0) {
      int e = errno;
      ::close(in);
      ThrowErrno("cannot create", to, e);
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    uint64_t done = 0;
    try {
      std::vector<uint8_t> buf;
      if (seen) buf.resize(1 << 20);
      while (done < size) {
        // The kernel copies (or reflinks) where it can; read/write otherwise.
        ssize_t n = buf.empty() ? ::copy_file_range(in, nullptr, out, nullptr, size - done, 0) : -1;
        if (n < 0 && (!buf.empty() || errno == EXDEV || errno == ENOSYS || errno == EINVAL || errno == EOPNOTSUPP)) {
          if (buf.empty()) buf.resize(1 << 20);
          ssize_t r = ::pread(in, buf.data(), std::min<uint64_t>(buf.size(), size - done), static_cast<off_t>(done));
          if (r < 0 && errno == EINTR) continue;
          if (r < 0) ThrowErrno("cannot read", from);
          if (r == 0) break;
          if (seen) seen({buf.data(), static_cast<size_t>(r)});
          for (ssize_t w = 0; w < r;) {
            ssize_t k = ::pwrite(out, buf.data() + w, static_cast<size_t>(r - w), static_cast<off_t>(done + w));
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) ThrowErrno("cannot write", to, k == 0 ? ENOSPC : errno);
            w += k;
          }
          n = r;
        } else if (n < 0) {
          if (errno == EINTR) continue;
          ThrowErrno("cannot write", to);  // (copy_file_range does not say which side failed)
        } else if (n == 0) {
          break;
        }
        done += static_cast<uint64_t>(n);
      }
      if (done != size) throw IoError("cannot copy " + from + ": file shrank while copying");
      struct timespec times[2] = {st.st_atim, st.st_mtim};
      ::futimens(out, times);
    } catch (...) {
      ::close(in);
      ::close(out);
      throw;
    }
    ::close(in);
    if (::close(out) != 0) ThrowErrno("cannot write", to);
    return done;
  }

  void CreateDirs(const std::string& path) override {
    std::error_code ec;
    fs::create_directories(path, ec);
    if (ec) throw IoError("cannot create " + path + ": " + ec.message());
  }

  void Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) ThrowErrno("cannot rename " + from + " to", to);
  }

  bool Exchange(const std::string& a, const std::string& b) override {
    if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
    if (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) return false;
    ThrowErrno("cannot exchange " + a + " and", b);
  }

  void RemoveAll(const std::string& path) override {
    // nftw, not std::filesystem::remove_all: the PyTorch wheels' libtorch.so
    // exports its own std::filesystem, and uckpt's remove_all bound to that
    // copy jumped to address 0 on a non-empty folder (docs/gpu.md).
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) return;  // absent is fine
      ThrowErrno("cannot remove", path);
    }
    auto remove_one = [](const char* p, const struct stat*, int type, struct FTW*) -> int {
      return (type == FTW_DP ? ::rmdir(p) : ::unlink(p)) == 0 || errno == ENOENT ? 0 : -1;
    };
    if (::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) ThrowErrno("cannot remove", path);
  }

  void SyncDir(const std::string& dir) override {
    const std::string d = dir.empty() ? "." : dir;
    int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;                         // best effort: some filesystems refuse directory opens
    if (::fsync(fd) != 0 && errno != EINVAL) {  // EINVAL: the filesystem does not sync folders
      int e = errno;
      ::close(fd);
      ThrowErrno("cannot fsync the folder", d, e);
    }
    ::close(fd);
  }

  void SyncFilesystem(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) ThrowErrno("cannot open", path);
    if (::syncfs(fd) != 0) {
      int e = errno;
      ::close(fd);
      ThrowErrno("cannot sync", path, e);
    }
    ::close(fd);
  }

  void DropCached(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
};

std::atomic<Env*> g_current{nullptr};

}  // namespace

Env& Env::Posix() {
  static PosixEnv env;
  return env;
}

Env& Env::Current() {
  Env* e = g_current.load(std::memory_order_acquire);
  return e ? *e : Posix();
}

ScopedEnv::ScopedEnv(Env& env) : previous_(g_current.exchange(&env)) {}

ScopedEnv::~ScopedEnv() { g_current.store(previous_); }

std::vector<std::string> ListTree(Env& env, const std::string& folder) {
  std::vector<std::string> out;
  std::vector<std::string> todo{""};  // folders still to list, relative
  while (!todo.empty()) {
    const std::string rel = std::move(todo.back());
    todo.pop_back();
    for (const Env::DirEntry& e : env.ListDir(rel.empty() ? folder : folder + "/" + rel)) {
      const std::string path = rel.empty() ? e.name : rel + "/" + e.name;
      if (e.type == Env::DirEntry::Type::kFile) out.push_back(path);
      if (e.type == Env::DirEntry::Type::kDir) todo.push_back(path);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void ReplaceFolder(Env& env, const std::string& tmp, const std::string& dest) {
  std::error_code ec;
  if (!fs::exists(dest, ec)) {
    env.Rename(tmp, dest);
    return;
  }
  if (env.Exchange(tmp, dest)) {
    env.RemoveAll(tmp);  // now the old folder
    return;
  }
  const fs::path d(dest);
  const std::string old = (d.parent_path() / ("." + d.filename().string() + ".uckpt-old")).string();
  env.RemoveAll(old);  // one a killed replacement left
  env.Rename(dest, old);
  try {
    env.Rename(tmp, dest);
  } catch (...) {
    try {
      env.Rename(old, dest);  // put the old one back
    } catch (const std::exception&) {
      // The first error is the one to report.
    }
    throw;
  }
  env.RemoveAll(old);
}

}  // namespace uckpt
