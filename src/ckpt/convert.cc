#include "ckpt/convert.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "ckpt/torch_out.h"
#include "format/error.h"
#include "format/file.h"

namespace uckpt::ckpt {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void ThrowErrno(const std::string& what, const std::string& path) {
  throw IoError(what + " " + path + ": " + std::strerror(errno));
}

// Drops the pages around `data` (inside the mapped file `file`) from this
// process's page tables once they have been copied, so the resident set stays
// bounded however large the input is (the page cache keeps them; a later read
// faults them back in). The 2 MiB margin covers the pages the kernel maps
// beside each faulting page — fault-around, and whole large folios of the
// page cache (up to PMD size) — which would otherwise stay mapped at every
// chunk boundary (measured: ~90 MB left over 4.5 GB without it).
void ReleasePages(std::span<const uint8_t> data, std::span<const uint8_t> file) {
  if (data.empty()) return;
  constexpr uintptr_t kMargin = 2 << 20;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(file.data()), hi = lo + file.size();
  uintptr_t b = reinterpret_cast<uintptr_t>(data.data());
  uintptr_t e = b + data.size();
  b = (b - lo > kMargin ? b - kMargin : lo) & ~(page - 1);
  e = (hi - e > kMargin ? e + kMargin : hi);
  e = (e + page - 1) & ~(page - 1);
  ::madvise(reinterpret_cast<void*>(b), e - b, MADV_DONTNEED);
}

// Byte copy of a model-states file (as shutil.copy2: data, mode, times).
uint64_t CopyFile(const std::string& from, const std::string& to) {
  int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) ThrowErrno("cannot open", from);
  struct stat st;
  if (::fstat(in, &st) != 0) {
    ::close(in);
    ThrowErrno("cannot stat", from);
  }
  int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, st.st_mode & 0777);
  if (out < 0) {
    ::close(in);
    ThrowErrno("cannot create", to);
  }
  uint64_t done = 0;
  try {
    std::vector<char> buf;
    while (done < static_cast<uint64_t>(st.st_size)) {
      ssize_t n = ::copy_file_range(in, nullptr, out, nullptr, static_cast<size_t>(st.st_size) - done, 0);
      if (n < 0 && (errno == EXDEV || errno == ENOSYS || errno == EINVAL || errno == EOPNOTSUPP)) {
        // Fall back to read/write.
        if (buf.empty()) buf.resize(1 << 20);
        ssize_t r = ::pread(in, buf.data(), buf.size(), static_cast<off_t>(done));
        if (r < 0) ThrowErrno("cannot read", from);
        if (r == 0) break;
        for (ssize_t w = 0; w < r;) {
          ssize_t k = ::pwrite(out, buf.data() + w, static_cast<size_t>(r - w), static_cast<off_t>(done + w));
          if (k < 0) ThrowErrno("cannot write", to);
          w += k;
        }
        n = r;
      } else if (n < 0) {
        if (errno == EINTR) continue;
        ThrowErrno("cannot write", to);
      } else if (n == 0) {
        break;
      }
      done += static_cast<uint64_t>(n);
    }
    if (done != static_cast<uint64_t>(st.st_size)) throw IoError("cannot copy " + from + ": file shrank while copying");
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

// The dict DeepSpeed writes for stage 1/2 states: {'cat_dim': 0, 'param': tensor}.
ValuePtr CatDimDict(ValuePtr tensor) {
  auto d = Value::Dict();
  d->set("cat_dim", Value::Int(0));
  d->set("param", std::move(tensor));
  return d;
}

class Converter {
 public:
  Converter(const ZeroCheckpoint& ckpt, std::string output, const ConvertOptions& options)
      : ckpt_(ckpt), output_(StripTrailingSlashes(std::move(output))), options_(options) {
    // Source pages are dropped from the process as soon as each 1 MiB is
    // written, so the resident set stays small (about threads x 1 MiB plus
    // the parsed metadata) whatever the model size. Only pages of the
    // memory-mapped rank files are dropped: on any other memory
    // MADV_DONTNEED would discard data.
    release_.written = [this](std::span<const uint8_t> piece) {
      for (const auto& f : ckpt_.optim) {
        auto m = f.file->bytes();
        if (piece.data() >= m.data() && piece.data() + piece.size() <= m.data() + m.size()) {
          ReleasePages(piece, m);
          return;
        }
      }
    };
  }

  ConvertStats Run() {
    for (const auto& p : ckpt_.params) CheckParamName(p.name, ckpt_.folder + ": param_shapes");
    std::error_code ec;
    if (fs::exists(output_, ec) && !options_.force)
      throw IoError(output_ + " already exists (use --force to replace it)");
    fs::path out(output_);
    parent_ = out.has_parent_path() ? out.parent_path().string() : ".";
    base_ = out.filename().string();
    if (base_.empty() || base_ == "." || base_ == "..") throw IoError(output_ + ": not a usable output folder name");
    tmp_ = (fs::path(parent_) / ("." + base_ + ".uckpt-tmp-" + RandomSuffix())).string();
    if (!fs::create_directories(fs::path(tmp_) / "zero", ec))
      throw IoError("cannot create " + tmp_ + "/zero: " + ec.message());
    try {
      WriteParams();
      WriteOptimizerState();
      CopyModelFiles();
      Publish();
    } catch (...) {
      fs::remove_all(tmp_, ec);
      throw;
    }
    return stats_;
  }

 private:
  static std::string RandomSuffix() {
    std::random_device rd;
    return std::to_string(::getpid()) + "-" + std::to_string(rd() % 1000000);
  }

  void WriteParams() {
    // Parameter folders first (cheap, serial), then the data in parallel,
    // largest first so the long copies do not end up last.
    for (const auto& p : ckpt_.params) {
      std::error_code ec;
      fs::create_directory(fs::path(tmp_) / "zero" / p.name, ec);
      if (ec) throw IoError("cannot create " + tmp_ + "/zero/" + p.name + ": " + ec.message());
    }
    std::vector<size_t> order(ckpt_.params.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return ckpt_.params[a].bytes() > ckpt_.params[b].bytes(); });
    progress_.params_total = order.size();
    progress_.bytes_total = ckpt_.total_bytes();

    int threads = options_.threads > 0 ? options_.threads : static_cast<int>(std::thread::hardware_concurrency());
    threads = std::clamp(threads, 1, std::max(1, static_cast<int>(order.size())));
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;
    std::mutex error_mu;
    auto work = [&] {
      while (!failed.load()) {
        size_t k = next.fetch_add(1);
        if (k >= order.size()) return;
        try {
          WriteParam(ckpt_.params[order[k]]);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mu);
          if (!error) error = std::current_exception();
          failed = true;
          return;
        }
      }
    };
    if (threads == 1) {
      work();
    } else {
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) pool.emplace_back(work);
      for (auto& t : pool) t.join();
    }
    if (error) std::rethrow_exception(error);
  }

  void WriteParam(const ParamPlan& p) {
    const std::string dir = tmp_ + "/zero/" + p.name;
    uint64_t written = 0;
    size_t files = 0;
    if (p.step) {
      written += WriteTorchFile(dir + "/step.pt", p.step, {}, release_);
      ++files;
    }
    for (const StatePlan& s : p.states) {
      // Stage 1/2: the parameter's shape inside {'cat_dim', 'param'}; stage 3:
      // a bare 1-D tensor. fp32 masters are saved with requires_grad, as
      // DeepSpeed's clones of the partitions are.
      const bool stage3 = ckpt_.stage == 3;
      ValuePtr t = PiecewiseTensor(s.dtype, stage3 ? std::vector<int64_t>{p.numel} : p.shape, s.key == "fp32");
      StoragePieces pieces{{t->tensor->storage.get(), s.pieces}};
      written += WriteTorchFile(dir + "/" + s.key + ".pt", stage3 ? t : CatDimDict(t), pieces, release_);
      ++files;
    }
    std::lock_guard<std::mutex> lock(mu_);
    stats_.params += 1;
    stats_.files += files;
    stats_.bytes_read += p.bytes();
    stats_.bytes_written += written;
    progress_.params_done += 1;
    progress_.bytes_done += p.bytes();
    if (options_.progress) options_.progress(progress_);
  }

  void WriteOptimizerState() {
    // (Stage 3 embeds rank 0's partitions, as DeepSpeed does.)
    stats_.bytes_written +=
        WriteTorchFile(tmp_ + "/zero/optimizer_state.pt", UniversalOptimizerState(ckpt_), {}, release_);
    stats_.files += 1;
  }

  void CopyModelFiles() {
    for (const auto& f : ckpt_.model_files) {
      uint64_t n = CopyFile(f.path, tmp_ + "/" + f.name);
      stats_.bytes_read += n;
      stats_.bytes_written += n;
      stats_.files += 1;
    }
  }

  // Makes the finished folder durable, renames it into place (replacing an
  // old output only now, with --force) and writes latest_universal.
  void Publish() {
    if (options_.durable) {
      int fd = ::open(tmp_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (fd >= 0) {
        if (::syncfs(fd) != 0) {
          int e = errno;
          ::close(fd);
          errno = e;
          ThrowErrno("cannot sync", tmp_);
        }
        ::close(fd);
      }
    }
    std::error_code ec;
    std::string old;
    if (fs::exists(output_, ec)) {
      old = (fs::path(parent_) / ("." + base_ + ".uckpt-old-" + RandomSuffix())).string();
      if (::rename(output_.c_str(), old.c_str()) != 0) ThrowErrno("cannot move aside", output_);
    }
    if (::rename(tmp_.c_str(), output_.c_str()) != 0) {
      int e = errno;
      if (!old.empty()) ::rename(old.c_str(), output_.c_str());
      errno = e;
      ThrowErrno("cannot rename " + tmp_ + " to", output_);
    }
    if (!old.empty()) fs::remove_all(old, ec);
    // DeepSpeed writes this beside the output (into it when the output path
    // ends with '/', a bug we do not reproduce).
    AtomicFile latest(parent_ + "/latest_universal", options_.durable);
    latest.Write(base_);
    latest.Commit();
    stats_.files += 1;
  }

  const ZeroCheckpoint& ckpt_;
  std::string output_, parent_, base_, tmp_;
  ConvertOptions options_;
  TorchWriteOptions release_;
  std::mutex mu_;
  ConvertStats stats_;
  ConvertProgress progress_;
};

}  // namespace

void CheckParamName(const std::string& name, const std::string& where) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos)
    throw FormatError(where + ": parameter name '" + name + "' cannot be used as a folder name");
}

ConvertStats ConvertToUniversal(const ZeroCheckpoint& ckpt, const std::string& output, const ConvertOptions& options) {
  return Converter(ckpt, output, options).Run();
}

ConvertStats ConvertToUniversal(const std::string& input, const std::string& output, const ConvertOptions& options) {
  ZeroCheckpoint ckpt = OpenZeroCheckpoint(input);
  return ConvertToUniversal(ckpt, output, options);
}

}  // namespace uckpt::ckpt
