#include "format/file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "format/error.h"

namespace uckpt {
namespace {

constexpr size_t kBufferSize = 1 << 20;

}  // namespace

std::shared_ptr<const MappedFile> MappedFile::Open(const std::string& path) { return Env::Current().MapFile(path); }

std::shared_ptr<const MappedFile> MappedFile::OpenDirect(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) ThrowErrno("cannot open", path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    ThrowErrno("cannot stat", path);
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw IoError(path + " is a directory, not a file");
  }
  std::shared_ptr<MappedFile> m(new MappedFile);
  m->path_ = path;
  m->size_ = static_cast<size_t>(st.st_size);
  if (m->size_ > 0) {
    void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      ThrowErrno("cannot map", path);
    }
    m->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return m;
}

std::shared_ptr<const MappedFile> MappedFile::FromMemory(std::vector<uint8_t> data, std::string name) {
  std::shared_ptr<MappedFile> m(new MappedFile);
  m->path_ = std::move(name);
  m->memory_ = std::move(data);
  m->size_ = m->memory_.size();
  m->data_ = m->memory_.empty() ? nullptr : m->memory_.data();
  return m;
}

void MappedFile::DropPages(std::span<const uint8_t> piece) const {
  if (!memory_.empty() || !Holds(piece)) return;  // MADV_DONTNEED would discard memory of our own
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t b = (reinterpret_cast<uintptr_t>(piece.data()) + page - 1) & ~(page - 1);
  const uintptr_t e = reinterpret_cast<uintptr_t>(piece.data() + piece.size()) & ~(page - 1);
  if (e > b) ::madvise(reinterpret_cast<void*>(b), e - b, MADV_DONTNEED);
}

MappedFile::~MappedFile() {
  if (data_ && memory_.empty()) ::munmap(const_cast<uint8_t*>(data_), size_);
}

AtomicFile::AtomicFile(std::string path, bool durable)
    : path_(std::move(path)), env_(Env::Current()), durable_(durable) {
  tmp_path_ = path_ + ".tmp." + std::to_string(::getpid());
  file_ = env_.NewWritableFile(tmp_path_);
  buf_.reserve(kBufferSize);
}

AtomicFile::~AtomicFile() {
  file_.reset();
  if (committed_) return;
  try {
    env_.RemoveAll(tmp_path_);
  } catch (const std::exception&) {
    // The error that got us here is the one to report.
  }
}

void AtomicFile::WriteRaw(const uint8_t* p, size_t n) {
  if (!file_) throw IoError("cannot write " + tmp_path_ + ": already closed");
  while (n > 0) {
    size_t w = file_->Write({p, n});  // may be short; throws on error
    p += w;
    n -= w;
  }
}

void AtomicFile::Flush() {
  if (!buf_.empty()) WriteRaw(buf_.data(), buf_.size());
  buf_.clear();
}

void AtomicFile::Write(std::span<const uint8_t> data) {
  offset_ += data.size();
  if (buf_.size() + data.size() <= kBufferSize) {
    buf_.insert(buf_.end(), data.begin(), data.end());
    return;
  }
  Flush();
  if (data.size() >= kBufferSize) {
    WriteRaw(data.data(), data.size());
  } else {
    buf_.insert(buf_.end(), data.begin(), data.end());
  }
}

void AtomicFile::Commit() {
  Flush();
  if (!file_) throw IoError("cannot commit " + path_ + ": already closed");
  if (durable_) file_->Sync();
  std::unique_ptr<WritableFile> f = std::move(file_);
  f->Close();
  env_.Rename(tmp_path_, path_);
  committed_ = true;
  if (durable_) env_.SyncDir(std::filesystem::path(path_).parent_path().string());
}

}  // namespace uckpt
