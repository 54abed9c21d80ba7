#include "ckpt/verify.h"

#include <algorithm>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "ckpt/deepspeed_names.h"
#include "ckpt/deepspeed_state.h"
#include "ckpt/folder.h"
#include "ckpt/parallel.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/values.h"
#include "ckpt/zero_checkpoint.h"
#include "format/env.h"
#include "format/error.h"
#include "format/torch_file.h"

namespace uckpt::ckpt {

namespace fs = std::filesystem;

const char* FolderKindName(FolderKind k) {
  switch (k) {
    case FolderKind::kZero: return "zero";
    case FolderKind::kUniversal: return "universal";
    default: return "unknown";
  }
}

size_t VerifyReport::problem_count() const {
  size_t n = problems.size();
  for (const auto& f : folders) n += f.problems.size();
  return n;
}

namespace {

// Splits "path/to/file.pt: what went wrong" (our errors name the file first)
// into a problem; messages that do not start with a path under `folder` are
// filed under `fallback`.
ManifestProblem ProblemFromError(const std::string& message, const std::string& folder, const std::string& fallback) {
  if (message.rfind(folder + "/", 0) == 0) {
    size_t colon = message.find(": ");
    if (colon != std::string::npos) return {message.substr(0, colon), message.substr(colon + 2)};
  }
  if (message.rfind(fallback + ": ", 0) == 0) return {fallback, message.substr(fallback.size() + 2)};
  return {fallback, message};
}

uint64_t SizeOr0(const std::string& path) {
  std::error_code ec;
  uint64_t n = fs::file_size(path, ec);
  return ec ? 0 : n;
}

// Checks one folder's structure without a manifest's help (or after it).
class StructureCheck {
 public:
  // Reads contents (CRC-32s) when hashes were asked for and no manifest's
  // hashes covered them; counts files only when no manifest did.
  StructureCheck(FolderVerdict& v, const VerifyOptions& o)
      : v_(v), o_(o), read_contents_(o.hashes && !v.manifest), counting_(!v.manifest) {}

  void Run() {
    try {
      if (v_.kind == FolderKind::kZero) Zero();
      if (v_.kind == FolderKind::kUniversal) Universal();
    } catch (const std::exception& e) {
      Add(ProblemFromError(e.what(), v_.folder, v_.folder));
    }
  }

 private:
  void Add(ManifestProblem p) {
    std::lock_guard<std::mutex> lock(mu_);
    v_.problems.push_back(std::move(p));
  }

  // Parses `path` (checking its records' CRC-32s when reading contents);
  // a problem and nullopt if that fails.
  std::optional<TorchFile> Parse(const std::string& path) {
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(path, ec))) {
      Add({path, "missing"});
      return std::nullopt;
    }
    const uint64_t size = SizeOr0(path);
    if (read_contents_ && o_.progress) o_.progress->bytes_total += size;
    try {
      LoadOptions lo;
      lo.verify_crc = read_contents_;
      TorchFile f = LoadTorchFile(path, lo);
      Count(size);
      return f;
    } catch (const std::exception& e) {
      Count(size);
      Add(ProblemFromError(e.what(), v_.folder, path));
      return std::nullopt;
    }
  }

  void Count(uint64_t size) {
    if (read_contents_ && o_.progress) o_.progress->bytes_done += size;
    std::lock_guard<std::mutex> lock(mu_);
    if (!counting_) return;
    v_.files += 1;
    v_.bytes += size;
  }

  // Every checkpoint file parses; then the folder opens as a whole, which
  // checks rank files (missing, extra, mixed sizes or steps) and that every
  // partition has the size its parameters need.
  void Zero() {
    std::vector<CheckpointFile> files;
    for (auto& f : ListCheckpointFolder(v_.folder))
      if (f.kind == FileKind::kModelStates || f.kind == FileKind::kZero3ModelStates || f.kind == FileKind::kOptimStates)
        files.push_back(std::move(f));
    const size_t before = v_.problems.size();
    ParallelBySize(std::vector<uint64_t>(files.size()), WorkerThreads(o_.threads, files.size()),
                   [&](size_t i) { Parse(files[i].path); });
    if (v_.problems.size() > before) return;  // opening would only repeat the first of them
    const bool has_optim = std::any_of(files.begin(), files.end(),
                                       [](const CheckpointFile& f) { return f.kind == FileKind::kOptimStates; });
    if (!has_optim) return Stage0(files);
    OpenZeroCheckpoint(v_.folder, false, /*check_manifest=*/false);  // VerifyFolder compared it
  }

  // ZeRO-0 (DeepSpeed's stage 0, and uckpt's): no optimizer-states files; the
  // model states hold the whole model and the torch optimizer's state_dict.
  // Every tensor of both must have its bytes, the optimizer state at most one
  // entry per module tensor, and each per-element state the size of a module tensor.
  void Stage0(const std::vector<CheckpointFile>& files) {
    std::string path;
    for (const auto& f : files)
      if (f.kind == FileKind::kModelStates && f.mp == 0) path = f.path;
    if (path.empty())
      throw FormatError(v_.folder +
                        ": no zero_pp_rank_*_optim_states.pt and no mp_rank_00_model_states.pt files; "
                        "not a ZeRO checkpoint tag folder");
    TorchFile f = LoadTorchFile(path);
    const ValuePtr& root = f.root;
    if (!root || !root->is_dict()) throw FormatError(path + ": is not a DeepSpeed model-states dict");
    if (IsFp16OptimizerState(root->get("optimizer"))) return Stage0Fp16(path, root);
    const auto optimizer = ReadStage0OptimizerEntries(root, path);
    if (!optimizer)
      throw FormatError(v_.folder + ": no zero_pp_rank_*_optim_states.pt files, and " + path +
                        " holds no optimizer state: not a ZeRO-0 checkpoint, and a ZeRO-1/2/3 one without its "
                        "optimizer files");
    std::multiset<int64_t> numels;
    for (const auto& [name, v] : NamedEntries(RequiredModule(root, path), path + ": module")) {
      if (!v || !v->tensor) continue;
      TensorBytes(*v->tensor, path + ": module." + name);
      numels.insert(v->tensor->numel());
    }
    if (optimizer->size() > numels.size())
      Fail(path + ": optimizer.state", "has " + std::to_string(optimizer->size()) + " entries, the module " +
                                           std::to_string(numels.size()) + " tensors");
    for (const Stage0OptimizerEntry& entry : *optimizer) {
      for (const auto& [name, t] : entry.tensors) {
        TensorBytes(*t, entry.where + "." + name);
        // Scalars (0-d: step, NAdam's mu_product) are not per-element states.
        if (!t->shape.empty() && !numels.count(t->numel()))
          Fail(entry.where + "." + name,
               "has " + std::to_string(t->numel()) + " elements, which no tensor of the module has");
      }
    }
  }

  // ZeRO-0 in fp16: the fp16 wrapper's state parses, its fp32 masters and the
  // wrapped optimizer's states have their bytes, each per-element state the
  // size of a master (FP16_Optimizer: a group's flat one), the masters no
  // more elements than the module's tensors.
  void Stage0Fp16(const std::string& path, const ValuePtr& root) {
    const Fp16OptimizerView w = ReadFp16Optimizer(root->get("optimizer"), path);
    int64_t module_elements = 0;
    for (const auto& [name, v] : NamedEntries(RequiredModule(root, path), path + ": module")) {
      if (!v || !v->tensor) continue;
      TensorBytes(*v->tensor, path + ": module." + name);
      module_elements += v->tensor->numel();
    }
    std::multiset<int64_t> masters;
    int64_t master_elements = 0;
    for (const auto& group : w.fp32)
      for (const Tensor* t : group) {
        TensorBytes(*t, path + ": optimizer's fp32 masters");
        masters.insert(t->numel());
        master_elements += t->numel();
      }
    if (master_elements > module_elements)
      Fail(path + ": optimizer's fp32 masters",
           "hold " + std::to_string(master_elements) + " elements, the module " + std::to_string(module_elements));
    const auto entries = ReadStage0OptimizerEntries(root, path);  // (kept: the range below views it)
    for (const Stage0OptimizerEntry& entry : *entries)
      for (const auto& [name, t] : entry.tensors) {
        TensorBytes(*t, entry.where + "." + name);
        if (!t->shape.empty() && !masters.count(t->numel()))
          Fail(entry.where + "." + name, "has " + std::to_string(t->numel()) + " elements, which no fp32 master has");
      }
  }

  // The copied model states parse and give the parameters; each has its
  // fp32 file and the optimizer's per-element states (those of the first
  // parameter, as DeepSpeed's loader assumes), each holding a tensor of the
  // parameter's size; zero/optimizer_state.pt parses; zero/ holds no folder
  // that is not a parameter.
  void Universal() {
    for (const auto& f : ListCheckpointFolder(v_.folder))
      if (f.kind == FileKind::kModelStates || f.kind == FileKind::kZero3ModelStates)
        if (!Parse(f.path)) return;
    UniversalCheckpoint u = OpenUniversalCheckpoint(v_.folder, false, /*check_manifest=*/false);
    Parse(UniversalOptimizerStateFile(v_.folder));
    struct Job {
      const UniversalParam* param;
      std::string key;
    };
    std::vector<Job> jobs;
    std::set<std::string> names;
    for (const auto& g : u.groups) {
      // A group's optimizer keeps the same files for each of its parameters:
      // those of its first one (Muon's groups and its Adam group differ).
      std::vector<std::string> keys = {kFp32};
      bool step = false;
      if (!g.empty()) {
        std::error_code ec;
        const std::string dir = UniversalParamDir(v_.folder, g[0].name);
        if (fs::is_directory(dir, ec))
          for (const Env::DirEntry& e : Env::Current().ListDir(dir)) {
            const std::optional<std::string> key = UniversalStateKey(e.name);
            if (!key || *key == kFp32) continue;
            if (*key == kStep) step = true;
            else keys.push_back(*key);
          }
      }
      for (const auto& p : g) {
        names.insert(p.name);
        for (const auto& k : keys) jobs.push_back({&p, k});
        if (step) jobs.push_back({&p, kStep});
      }
    }
    // DeepSpeed >= 0.19.8 also writes fp32.pt alone for the module's entries
    // without optimizer state (frozen parameters, buffers).
    std::set<std::string> module_only;
    if (u.model.root)
      if (ValuePtr module = u.model.root->get("module"); module && module->is_dict())
        for (const auto& [k, v] : module->entries)
          if (k && k->kind == Kind::kStr && !names.count(k->s)) module_only.insert(k->s);
    for (const auto& name : module_only) {
      std::error_code ec;
      if (!fs::is_directory(UniversalParamDir(v_.folder, name), ec)) continue;
      names.insert(name);
      Parse(UniversalStateFile(v_.folder, name, kFp32));
    }
    ParallelBySize(std::vector<uint64_t>(jobs.size()), WorkerThreads(o_.threads, jobs.size()), [&](size_t i) {
      const Job& j = jobs[i];
      const std::string path = UniversalStateFile(v_.folder, j.param->name, j.key);
      std::optional<TorchFile> f = Parse(path);
      // Scalars (step, NAdam's mu_product) only parse: they are not per-element states.
      const bool scalar =
          j.key == kStep || std::find(u.scalar_keys.begin(), u.scalar_keys.end(), j.key) != u.scalar_keys.end();
      if (!f || scalar) return;
      try {
        ValuePtr v = f->root;
        if (v && v->is_dict()) v = Need(v, kUniversalParam, path);
        const Tensor& t = AsTensor(v, path);
        if (t.numel() != j.param->numel)
          Add({path, "has " + std::to_string(t.numel()) + " elements, param_shapes gives " + j.param->name +
                         " the shape " + ShapeText(j.param->shape)});
        else TensorBytes(t, path);  // its storage holds all of them
      } catch (const std::exception& e) {
        Add(ProblemFromError(e.what(), v_.folder, path));
      }
    });
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(UniversalZeroDir(v_.folder), ec))
      if (e.is_directory(ec) && !names.count(e.path().filename().string()))
        Add({e.path().string(), "is a folder of a parameter that param_shapes does not list"});
  }

  FolderVerdict& v_;
  const VerifyOptions& o_;
  const bool read_contents_, counting_;
  std::mutex mu_;
};

FolderVerdict VerifyFolder(const std::string& folder, FolderKind kind, const VerifyOptions& o) {
  FolderVerdict v;
  v.folder = folder;
  v.kind = kind;
  v.manifest = HasManifest(folder);
  // Published before it was durable (ckpt/manifest.h): checked by hash, and only against its manifest.
  const bool unsynced = ReadUnsyncedMarker(folder).has_value();
  if (unsynced && !v.manifest) {
    v.problems.push_back({folder + "/" + kManifestName,
                          "is missing, and the folder was published before its files "
                          "were on disk (" +
                              UnsyncedMarkerPath(folder) + ")"});
    return v;
  }
  if (v.manifest) {
    ManifestCheckOptions mo;
    mo.hashes = o.hashes || unsynced;
    mo.threads = o.threads;
    mo.progress = o.progress ? &o.progress->bytes_done : nullptr;
    mo.progress_total = o.progress ? &o.progress->bytes_total : nullptr;
    ManifestCheck c = CheckManifest(folder, mo);
    v.files = c.files;
    v.bytes = c.bytes;
    v.problems = std::move(c.problems);
    // A folder that does not match its manifest is already condemned, file
    // by file; parsing it would mostly repeat the same problems.
    if (!v.problems.empty()) return v;
  }
  // Structure: with a matching manifest whose hashes were compared, the
  // files' CRC-32s need not be read again.
  StructureCheck(v, o).Run();
  std::stable_sort(v.problems.begin(), v.problems.end(), [](const auto& a, const auto& b) { return a.file < b.file; });
  return v;
}

}  // namespace

VerifyReport VerifyCheckpoint(const std::string& path_in, const VerifyOptions& options) {
  VerifyReport r;
  r.path = StripTrailingSlashes(path_in);
  r.hashes = options.hashes;
  std::error_code ec;
  if (!fs::is_directory(r.path, ec)) throw IoError(r.path + ": no such folder");
  auto run = [&](const std::string& folder, FolderKind kind) {
    r.folders.push_back(VerifyFolder(folder, kind, options));
    if (options.progress) options.progress->folders_done += 1;
  };
  FolderKind kind = ClassifyTagFolder(r.path);
  if (kind != FolderKind::kUnknown) {
    if (options.progress) options.progress->folders_total = 1;
    run(r.path, kind);
    return r;
  }

  // A checkpoint root: every checkpoint folder directly inside.
  std::vector<std::pair<std::string, FolderKind>> found;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(r.path, ec)) {
    if (!e.is_directory(ec)) continue;
    names.push_back(e.path().filename().string());
  }
  if (ec) throw IoError("cannot read folder " + r.path + ": " + ec.message());
  std::sort(names.begin(), names.end());
  std::set<std::string> checkpoints;
  for (const auto& name : names) {
    const std::string folder = r.path + "/" + name;
    FolderKind k = ClassifyTagFolder(folder);
    if (k == FolderKind::kUnknown) continue;
    if (name[0] == '.') {
      r.notes.push_back(folder +
                        ": skipped (a temporary folder of an interrupted save or conversion; "
                        "uckpt never loads it)");
      continue;
    }
    found.emplace_back(folder, k);
    checkpoints.insert(name);
  }
  bool has_latest = false;
  for (const char* tag_file : {kLatestFile, kLatestUniversalFile}) {
    const std::string p = r.path + "/" + tag_file;
    if (!fs::exists(fs::symlink_status(p, ec))) continue;
    has_latest = true;
    std::string problem;
    auto tag = ReadTag(p, &problem);
    if (!tag) {
      r.problems.push_back({p, problem});
    } else if (!checkpoints.count(*tag)) {
      r.problems.push_back({p, "names '" + *tag + "', which is not a checkpoint folder in " + r.path});
    }
  }
  if (found.empty() && !has_latest)
    throw FormatError(r.path +
                      ": not a checkpoint (no model/optimizer states, no zero/ folder, no latest file, no "
                      "checkpoint folders inside)");
  if (options.progress) options.progress->folders_total = found.size();
  for (const auto& [folder, k] : found) run(folder, k);
  return r;
}

}  // namespace uckpt::ckpt
