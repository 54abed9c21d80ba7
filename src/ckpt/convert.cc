#include "ckpt/convert.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <random>

#include "ckpt/copy_plan.h"
#include "ckpt/deepspeed_names.h"
#include "ckpt/manifest.h"
#include "ckpt/state_keys.h"
#include "ckpt/torch_out.h"
#include "format/env.h"
#include "format/error.h"
#include "format/file.h"

namespace uckpt::ckpt {

namespace fs = std::filesystem;

namespace {

// The temporary output folder beside OUT is TempPrefix(OUT's name) + "<pid>-<n>".
std::string TempPrefix(const std::string& base) { return "." + base + ".uckpt-tmp-"; }

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

// `t.float()` of a module entry, as DeepSpeed >= 0.19.8's converter saves it:
// the same tensor when it is fp32 already, else a new contiguous fp32 copy.
ValuePtr AsFloat32(const ValuePtr& v) {
  const Tensor& t = *v->tensor;
  if (t.dtype == DType::kFloat32) return v;
  if (!DTypeIsFloating(t.dtype))
    throw FormatError("module entry of dtype " + std::string(DTypeName(t.dtype)) + " cannot be written as fp32");
  const std::vector<uint8_t> in = t.contiguous_bytes();
  const size_t n = static_cast<size_t>(t.numel()), w = DTypeSize(t.dtype);
  std::vector<uint8_t> out(n * sizeof(float));
  for (size_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(ElementToDouble(t.dtype, in.data() + i * w));
    std::memcpy(out.data() + i * sizeof(float), &f, sizeof f);
  }
  return Value::FromTensor(Tensor::FromBytes(DType::kFloat32, t.shape, std::move(out)));
}

// The dict DeepSpeed writes for stage 1/2 states: {'cat_dim': 0, 'param': tensor}.
ValuePtr CatDimDict(ValuePtr tensor) {
  auto d = Value::Dict();
  d->set("cat_dim", Value::Int(0));
  d->set(kUniversalParam, std::move(tensor));
  return d;
}

// The dict DeepSpeed writes for a state merged across TP ranks: its rule's
// keys ({'cat_dim': 1}, {'vocab_tensor': True}, none), then 'param'.
ValuePtr TpMergedDict(const TpUniversalFile& f, ValuePtr tensor) {
  auto d = Value::Dict();
  for (const auto& [k, v] : f.keys) d->set(k, v);
  d->set(kUniversalParam, std::move(tensor));
  return d;
}

// A tensor of `shape` whose storage holds `tail` more bytes after it: the
// rows DeepSpeed cut from a TP vocabulary parameter (a view it saves whole).
ValuePtr TensorWithTail(const StatePlan& s, const std::vector<std::span<const uint8_t>>& storage_tail,
                        const std::vector<int64_t>& shape, bool requires_grad) {
  ValuePtr t = PiecewiseTensor(s.dtype, shape, requires_grad);
  uint64_t tail = 0;
  for (auto piece : storage_tail) tail += piece.size();
  if (tail > 0) t->tensor->storage = PiecewiseStorage(s.dtype, s.bytes() + tail);
  return t;
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
    // Files are laid out as the torch that wrote the checkpoint lays them out,
    // as DeepSpeed's converter run on that torch would write them.
    release_.records = RecordsOf(ckpt_.model);
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
    if (!ckpt_.unused_tp_patterns.empty() && options_.strict)
      throw FormatError(ckpt_.model.file->path() + ": universal_checkpoint_info pattern '" +
                        ckpt_.unused_tp_patterns[0] + "' matches no trained parameter (" +
                        std::to_string(ckpt_.unused_tp_patterns.size()) +
                        " unused); DeepSpeed's converter refuses it unless --no_strict");
    for (const auto& p : ckpt_.params) CheckParamName(p.name, ckpt_.folder + ": param_shapes");
    for (const auto& [name, t] : ckpt_.module_only) CheckParamName(name, ckpt_.folder + ": module");
    std::error_code ec;
    if (fs::exists(output_, ec) && !options_.force)
      throw IoError(output_ + " already exists (use --force to replace it)");
    fs::path out(output_);
    parent_ = out.has_parent_path() ? out.parent_path().string() : ".";
    base_ = out.filename().string();
    if (base_.empty() || base_ == "." || base_ == "..") throw IoError(output_ + ": not a usable output folder name");
    for (const std::string& stale : StaleConvertTemporaries(output_)) {
      env_.RemoveAll(stale);
      if (options_.notice) options_.notice("removed " + stale + ", left by an interrupted conversion");
    }
    tmp_ = (fs::path(parent_) / (TempPrefix(base_) + RandomSuffix())).string();
    if (fs::exists(tmp_, ec)) throw IoError(tmp_ + " already exists");
    try {
      env_.CreateDirs(UniversalZeroDir(tmp_));
      WriteFiles();
      Publish();
    } catch (...) {
      try {
        env_.RemoveAll(tmp_);
      } catch (const std::exception&) {
        // The first error is the one to report.
      }
      throw;
    }
    return stats_;
  }

 private:
  static std::string RandomSuffix() {
    std::random_device rd;
    return std::to_string(::getpid()) + "-" + std::to_string(rd() % 1000000);
  }

  // What the copy plan's files are, for its completion callback.
  struct FileRole {
    size_t param = SIZE_MAX;   // the parameter the file belongs to
    uint64_t state_bytes = 0;  // parameter state bytes it holds
    uint64_t copied = 0;       // bytes of a whole-file copy
  };
  struct FilePlan {
    CopyPlan copy;
    std::vector<FileRole> roles;  // one per file of `copy`
  };

  // Every output file but the manifest and latest_universal, as one copy
  // plan (ckpt/copy_plan.h) run on the worker threads, largest file first:
  // per parameter step.pt and one torch file per optimizer state, written
  // from the memory-mapped rank files; zero/optimizer_state.pt; the
  // model-states files copied whole. Each file's XXH64 is computed as it is
  // written, for the manifest.
  void WriteFiles() {
    CreateParamDirs();
    progress_.params_total = ckpt_.params.size();
    progress_.bytes_total = ckpt_.total_bytes();
    FilePlan plan;
    files_left_.assign(ckpt_.params.size(), 0);
    for (size_t i = 0; i < ckpt_.params.size(); ++i) PlanParamFiles(plan, i);
    PlanModuleOnlyFiles(plan);
    PlanTopLevelFiles(plan);
    for (size_t i = 0; i < ckpt_.params.size(); ++i)
      if (files_left_[i] == 0) FinishParam(i);  // (a parameter without state files)
    RunFilePlan(plan);
  }

  // One folder per parameter, with or without optimizer state.
  void CreateParamDirs() {
    for (const auto& p : ckpt_.params) env_.CreateDirs(UniversalParamDir(tmp_, p.name));
    for (const auto& entry : ckpt_.module_only) env_.CreateDirs(UniversalParamDir(tmp_, entry.first));
  }

  void AddGenerated(FilePlan& plan, std::string path, uint64_t estimate, std::function<void(OrderedSink&)> generate,
                    FileRole role) {
    PlannedFile f;
    f.path = std::move(path);
    f.size = estimate;
    f.generate = std::move(generate);
    f.hash = options_.write_manifest;
    plan.copy.files.push_back(std::move(f));
    plan.roles.push_back(role);
  }

  // Parameter i's files: step.pt, the optimizer's other scalars (as step.pt)
  // and one file per optimizer state.
  void PlanParamFiles(FilePlan& plan, size_t i) {
    const ParamPlan& p = ckpt_.params[i];
    if (p.step) {
      AddGenerated(plan, UniversalStateFile(tmp_, p.name, kStep), 0,
                   [this, &p](OrderedSink& out) { WriteTorchFile(out, out.path(), p.step, {}, release_); }, {i, 0, 0});
      ++files_left_[i];
    }
    for (const auto& [key, value] : p.scalars) {
      AddGenerated(plan, UniversalStateFile(tmp_, p.name, key), 0,
                   [this, v = value](OrderedSink& out) { WriteTorchFile(out, out.path(), v, {}, release_); },
                   {i, 0, 0});
      ++files_left_[i];
    }
    for (size_t k = 0; k < p.states.size(); ++k) {
      const StatePlan& s = p.states[k];
      uint64_t bytes = 0;
      for (auto piece : s.pieces) bytes += piece.size();
      AddGenerated(plan, UniversalStateFile(tmp_, p.name, s.key), bytes,
                   [this, i, k](OrderedSink& out) { WriteStateFile(out, i, k); }, {i, bytes, 0});
      ++files_left_[i];
    }
  }

  // Stage 1/2: the parameter's shape inside {'cat_dim', 'param'}; stage 3: a
  // bare 1-D tensor. fp32 masters are saved with requires_grad, as
  // DeepSpeed's clones of the partitions are.
  void WriteStateFile(OrderedSink& out, size_t i, size_t k) {
    const ParamPlan& p = ckpt_.params[i];
    const StatePlan& s = p.states[k];
    const bool stage3 = ckpt_.stage == 3;
    if (!ckpt_.tp_files.empty()) {  // merged across TP ranks (ZeRO-3 too: DeepSpeed writes dicts then)
      const TpUniversalFile& f = ckpt_.tp_files[i];
      ValuePtr t = TensorWithTail(s, f.storage_tails[k], p.shape, s.key == kFp32);
      std::vector<std::span<const uint8_t>> all = s.pieces;
      all.insert(all.end(), f.storage_tails[k].begin(), f.storage_tails[k].end());
      StoragePieces pieces{{t->tensor->storage.get(), all}};
      WriteTorchFile(out, out.path(), TpMergedDict(f, t), pieces, release_);
      return;
    }
    ValuePtr t = PiecewiseTensor(s.dtype, stage3 ? std::vector<int64_t>{p.numel} : p.shape, s.key == kFp32);
    StoragePieces pieces{{t->tensor->storage.get(), s.pieces}};
    WriteTorchFile(out, out.path(), stage3 ? t : CatDimDict(t), pieces, release_);
  }

  // DeepSpeed >= 0.19.8: the module's entries without optimizer state.
  void PlanModuleOnlyFiles(FilePlan& plan) {
    for (const auto& [name, tensor] : ckpt_.module_only) {
      AddGenerated(plan, UniversalStateFile(tmp_, name, kFp32), 0,
                   [this, t = tensor](OrderedSink& out) {
                     ValuePtr d = Value::Dict();
                     d->set(kUniversalParam, AsFloat32(t));
                     WriteTorchFile(out, out.path(), d, {}, release_);
                   },
                   {});
    }
  }

  // zero/optimizer_state.pt and the model-states files.
  void PlanTopLevelFiles(FilePlan& plan) {
    // (Stage 3 embeds rank 0's partitions, as DeepSpeed does.)
    AddGenerated(
        plan, UniversalOptimizerStateFile(tmp_), 0,
        [this](OrderedSink& out) { WriteTorchFile(out, out.path(), UniversalOptimizerState(ckpt_), {}, release_); },
        {});
    for (const auto& m : ckpt_.model_files) {
      if (ckpt_.stage == 0) {  // with param_shapes, its optimizer state moved into zero/
        AddGenerated(plan, tmp_ + "/" + m.name, 0,
                     [this](OrderedSink& out) {
                       WriteTorchFile(out, out.path(), Stage0UniversalModelStates(ckpt_), {}, release_);
                     },
                     {});
        continue;
      }
      PlannedFile f;  // copied as shutil.copy2 does: data, mode, times
      f.path = tmp_ + "/" + m.name;
      f.copy_from = m.path;
      std::error_code ec;
      f.size = fs::file_size(m.path, ec);
      f.hash = options_.write_manifest;
      plan.copy.files.push_back(std::move(f));
      plan.roles.push_back({});
      plan.roles.back().copied = 1;
    }
  }

  // Runs the plan on the worker threads, counting what each file finishes.
  void RunFilePlan(const FilePlan& plan) {
    CopyOptions copy;
    copy.threads = options_.threads;
    copy.durable = options_.durable;
    copy.done = [&](size_t k, const CopyResult& r) {  // one call at a time
      const FileRole& role = plan.roles[k];
      if (role.copied) stats_.bytes_read += r.size;
      stats_.files += 1;
      stats_.bytes_written += r.size;
      if (role.param == SIZE_MAX) return;
      progress_.bytes_done += role.state_bytes;
      if (--files_left_[role.param] == 0) FinishParam(role.param);
    };
    std::vector<CopyResult> results = ExecuteCopyPlan(plan.copy, copy);
    for (size_t k = 0; k < plan.copy.files.size(); ++k)
      written_.push_back({plan.copy.files[k].path.substr(tmp_.size() + 1), results[k].size, results[k].xxh64});
  }

  void FinishParam(size_t i) {
    stats_.params += 1;
    stats_.bytes_read += ckpt_.params[i].bytes();
    progress_.params_done += 1;
    if (options_.progress) options_.progress(progress_);
  }

  // Makes the finished folder durable, renames it into place (replacing an
  // old output only now, with --force: swapped atomically where the
  // filesystem can, so a name that latest_universal holds always names a
  // complete folder) and writes latest_universal.
  void Publish() {
    if (options_.write_manifest) {
      // The folder's last file lists all the others (docs/manifest-format.md);
      // the sync below makes it durable with them.
      // With the state fingerprint of what was converted, which `uckpt verify
      // --state` and a resume recompute from the universal files.
      const StateFingerprint state = FingerprintZeroCheckpoint(ckpt_, 0, 1, options_.threads);
      WriteManifest(tmp_, written_, /*durable=*/false, &state);
      stats_.files += 1;
    }
    if (options_.durable) env_.SyncFilesystem(tmp_);  // every file, not an fsync each
    ReplaceFolder(env_, tmp_, output_);
    if (options_.durable) env_.SyncDir(parent_);
    // DeepSpeed writes this beside the output (into it when the output path
    // ends with '/', a bug we do not reproduce).
    AtomicFile latest(parent_ + "/" + kLatestUniversalFile, options_.durable);
    latest.Write(base_);
    latest.Commit();
    stats_.files += 1;
  }

  const ZeroCheckpoint& ckpt_;
  Env& env_ = Env::Current();
  std::string output_, parent_, base_, tmp_;
  ConvertOptions options_;
  TorchWriteOptions release_;
  std::vector<size_t> files_left_;      // per parameter: its files not yet written
  std::vector<ManifestEntry> written_;  // every file the plan wrote, with its hash
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

std::vector<std::string> StaleConvertTemporaries(const std::string& output) {
  const fs::path out(output);
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  const std::string prefix = TempPrefix(out.filename().string());
  std::vector<std::string> stale;
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0 || !it->is_directory(ec)) continue;
    // The suffix is <pid>-<n>; only a pid that is certainly gone counts.
    const std::string suffix = name.substr(prefix.size());
    const size_t dash = suffix.find('-');
    if (dash == 0 || dash == std::string::npos || suffix.find_first_not_of("0123456789") != dash ||
        suffix.size() - dash - 1 == 0 || suffix.find_first_not_of("0123456789", dash + 1) != std::string::npos)
      continue;
    const long pid = std::strtol(suffix.substr(0, dash).c_str(), nullptr, 10);
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH) stale.push_back(it->path().string());
  }
  std::sort(stale.begin(), stale.end());
  return stale;
}

ConvertStats ConvertToUniversal(const std::string& input, const std::string& output, const ConvertOptions& options) {
  ZeroCheckpoint ckpt = OpenZeroCheckpoint(input);
  return ConvertToUniversal(ckpt, output, options);
}

}  // namespace uckpt::ckpt
