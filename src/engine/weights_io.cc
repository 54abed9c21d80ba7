// Weights alone, in and out of a running engine (docs/safetensors.md):
// LoadWeights fills this rank's partition slots (sharded_runtime.h) from a
// safetensors source through the planner of ckpt/weights_plan.h, then makes
// the weights from the masters; Save16bitModel writes the module's
// state_dict from rank 0, one parameter at a time (gathered one by one at
// stage 3), as DeepSpeed's save_16bit_model.
#include <c10/core/GradMode.h>

#include <condition_variable>
#include <deque>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include "ckpt/torch_out.h"
#include "ckpt/weights_plan.h"
#include "engine/async_save.h"
#include "engine/staged_upload.h"
#include "engine/torch_bridge.h"
#include "engine/weights_io.h"
#include "format/error.h"
#include "format/safetensors.h"

namespace uckpt {

namespace {

namespace fs = std::filesystem;

// Gathered tensors waiting for rank 0's writer in save_16bit_model.
constexpr int64_t kWriteBehindBytes = int64_t{256} << 20;

// Every tensor of the module's state_dict by name: trainable parameters
// (partitioned at stage 3), frozen ones and persistent buffers.
std::map<std::string, at::Tensor> TensorsByName(const engine::ModuleTensors& e) {
  std::map<std::string, at::Tensor> out;
  for (const auto& g : e.groups)
    for (const auto& p : g) out[p.name] = p.tensor;
  for (const auto* list : {&e.frozen, &e.buffers})
    for (const auto& p : *list) out[p.name] = p.tensor;
  return out;
}

std::string OwnerOf(const engine::ModuleTensors& e, const std::string& name) {
  for (const auto& [alias, owner] : e.aliases)
    if (alias == name) return owner;
  return name;
}

std::vector<ckpt::ModelTensor> ModelTensors(const engine::ModuleTensors& e) {
  const auto tensors = TensorsByName(e);
  std::vector<ckpt::ModelTensor> out;
  for (const std::string& name : e.state_names) {
    const std::string owner = OwnerOf(e, name);
    out.push_back({name, owner, tensors.at(owner).sizes().vec()});
  }
  return out;
}

ckpt::WeightNameMap NameMapOf(const LoadWeightsOptions& o) {
  if (o.name_map) return o.name_map;
  if (o.strip_prefix.empty() && o.add_prefix.empty()) return nullptr;
  return ckpt::PrefixRule(o.strip_prefix, o.add_prefix);
}

// A tensor of the file whole, on the CPU (a view of the map: copy before it closes).
at::Tensor WholeTensor(const SafetensorsSource& source, const std::string& name) {
  const SafetensorsSource::Found f = source.Find(name);
  const std::span<const uint8_t> bytes = f.file->Elements(*f.tensor, 0, f.tensor->numel);
  return at::from_blob(const_cast<uint8_t*>(bytes.data()), f.tensor->shape,
                       at::TensorOptions().dtype(engine::ToScalarType(f.tensor->dtype)));
}

// The masters of every slot from the file (each rank its own partitions), then
// the frozen parameters and buffers whole. Returns the bytes read.
uint64_t FillFromSource(const engine::ModuleTensors& e, engine::ShardedRuntime& runtime,
                        const SafetensorsSource& source, const ckpt::WeightsMatch& match) {
  std::vector<engine::TensorReads> loads;
  for (engine::PartitionSlot& slot : runtime.Slots())
    for (const ckpt::WeightRead& r : ckpt::PlanWeightReads(source, match, slot.target))
      loads.push_back({slot.state->master.narrow(0, r.offset, r.numel), engine::ToScalarType(r.dtype), {{r.from, 0}}});
  uint64_t bytes = engine::FillFromReads(loads);
  c10::NoGradGuard no_grad;
  for (const auto* list : {&e.frozen, &e.buffers})
    for (const auto& p : *list) {
      auto it = match.source_of.find(p.name);
      if (it == match.source_of.end()) continue;
      at::Tensor whole = WholeTensor(source, it->second);
      p.tensor.copy_(whole);
      bytes += whole.nbytes();
    }
  return bytes;
}

// ---- Saving. ----

// One state_dict entry to write: a tensor, or a tied name of an earlier one.
struct SavedEntry {
  std::string name;
  at::Tensor tensor;
  int same_as = -1;  // index of the entry holding the tensor
};

std::vector<SavedEntry> SavedEntries(const engine::ModuleTensors& e, bool exclude_frozen) {
  const auto tensors = TensorsByName(e);
  std::set<std::string> frozen;
  for (const auto& p : e.frozen) frozen.insert(p.name);
  std::vector<SavedEntry> out;
  std::map<std::string, int> index_of_owner;
  for (const std::string& name : e.state_names) {
    const std::string owner = OwnerOf(e, name);
    if (exclude_frozen && frozen.count(owner)) continue;
    auto [it, fresh] = index_of_owner.emplace(owner, static_cast<int>(out.size()));
    out.push_back({name, tensors.at(owner), fresh ? -1 : it->second});
  }
  return out;
}

// Rank 0's writer of one format; entries' bytes come in order, each tensor once.
class WeightsWriter {
 public:
  virtual ~WeightsWriter() = default;
  virtual void Write(size_t entry, std::span<const uint8_t> bytes) = 0;
  virtual void Commit() = 0;
};

class SafetensorsWeightsWriter : public WeightsWriter {
 public:
  SafetensorsWeightsWriter(const std::string& path, const std::vector<SavedEntry>& entries)
      : writer_(path, Header(entries), Metadata(entries)) {}
  void Write(size_t, std::span<const uint8_t> bytes) override { writer_.Write(bytes); }
  void Commit() override { writer_.Commit(); }

 private:
  static std::vector<SafetensorsWriter::Entry> Header(const std::vector<SavedEntry>& entries) {
    std::vector<SafetensorsWriter::Entry> out;
    for (const auto& s : entries)
      if (s.same_as < 0)
        out.push_back({s.name, engine::FromScalarType(s.tensor.scalar_type()), s.tensor.sizes().vec()});
    return out;
  }
  // Tied names -> the name their tensor is stored under (safetensors' save_model convention).
  static std::map<std::string, std::string> Metadata(const std::vector<SavedEntry>& entries) {
    std::map<std::string, std::string> meta{{"format", "pt"}};
    for (const auto& s : entries)
      if (s.same_as >= 0) meta[s.name] = entries[static_cast<size_t>(s.same_as)].name;
    return meta;
  }
  SafetensorsWriter writer_;
};

class TorchWeightsWriter : public WeightsWriter {
 public:
  // DeepSpeed's stages 0-2 save module.state_dict() (an OrderedDict with
  // torch's _metadata); its stage 3 a plain OrderedDict.
  TorchWeightsWriter(const std::string& path, const std::vector<SavedEntry>& entries,
                     const std::vector<std::string>& module_prefixes)
      : stream_(path, Root(entries, module_prefixes, &storage_of_)) {
    const auto& order = stream_.storages();
    for (size_t k = 0; k < order.size(); ++k)
      if (k >= storage_of_.size() || order[k].get() != storage_of_[k])
        throw std::logic_error(path + ": the pickle orders the tensors unlike the state_dict");
  }
  void Write(size_t, std::span<const uint8_t> bytes) override { stream_.WriteNext({&bytes, 1}); }
  void Commit() override { stream_.Commit(); }

 private:
  static ValuePtr Root(const std::vector<SavedEntry>& entries, const std::vector<std::string>& module_prefixes,
                       std::vector<const Storage*>* storages) {
    ValuePtr dict = Value::Dict(/*ordered=*/true);
    std::vector<ValuePtr> values;
    for (const auto& s : entries) {
      ValuePtr v = s.same_as >= 0 ? values[static_cast<size_t>(s.same_as)]
                                  : ckpt::PiecewiseTensor(engine::FromScalarType(s.tensor.scalar_type()),
                                                          s.tensor.sizes().vec(), false);
      if (s.same_as < 0) storages->push_back(v->tensor->storage.get());
      values.push_back(v);
      dict->set(s.name, v);
    }
    if (!module_prefixes.empty()) {
      ValuePtr metadata = Value::Dict(/*ordered=*/true);
      for (const auto& m : module_prefixes) {
        ValuePtr version = Value::Dict();
        version->set("version", Value::Int(1));
        metadata->set(m, version);
      }
      ValuePtr state = Value::Dict();
      state->set("_metadata", metadata);
      dict->state = state;
    }
    return dict;
  }
  std::vector<const Storage*> storage_of_;
  ckpt::TorchFileStream stream_;
};

// Calls `use` with each entry's whole tensor (on rank 0 a CPU copy; on others
// undefined), in order, tied names skipped: at stage 3 each parameter is
// gathered for the call and freed after it. Every rank makes the same calls.
void ForEachWhole(engine::ShardedRuntime& runtime, Comm& comm, const std::vector<SavedEntry>& entries,
                  const std::function<void(size_t, const at::Tensor&)>& use) {
  const bool rank0 = comm.rank() == 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].same_as >= 0) continue;
    const at::Tensor& t = entries[i].tensor;
    runtime.GatherParameters({t});  // stage 3 (ignored for tensors it does not partition)
    at::Tensor whole;               // a copy of its own, also where the tensor is on the CPU already
    if (rank0)
      whole = t.detach().to(at::TensorOptions().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true,
                            at::MemoryFormat::Contiguous);
    runtime.ReleaseParameters({t}, -1);
    use(i, whole);
  }
}

// Rank 0's writes on a thread of their own, so that gathering the next
// tensors overlaps writing the last ones; at most `limit` bytes (or one
// tensor, if larger) wait in between. The first error stops the writes;
// later tensors are dropped (every rank still gathers them).
class WriteBehind {
 public:
  WriteBehind(WeightsWriter& writer, int64_t limit) : writer_(writer), limit_(limit), thread_([this] { Run(); }) {}
  ~WriteBehind() { Finish(); }

  void Push(size_t entry, at::Tensor whole) {
    std::unique_lock lock(mu_);
    space_.wait(lock,
                [&] { return waiting_bytes_ == 0 || waiting_bytes_ + static_cast<int64_t>(whole.nbytes()) <= limit_; });
    waiting_bytes_ += static_cast<int64_t>(whole.nbytes());
    queue_.emplace_back(entry, std::move(whole));
    ready_.notify_one();
  }
  // Waits for the writes; the first error ("" if none).
  std::string Finish() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    ready_.notify_one();
    if (thread_.joinable()) thread_.join();
    return error_;
  }

 private:
  void Run() {
    for (;;) {
      std::unique_lock lock(mu_);
      ready_.wait(lock, [&] { return done_ || !queue_.empty(); });
      if (queue_.empty()) return;
      auto [entry, whole] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      if (error_.empty()) try {
          writer_.Write(entry, {static_cast<const uint8_t*>(whole.data_ptr()), whole.nbytes()});
        } catch (const std::exception& ex) {
          error_ = ex.what();
        }
      const auto bytes = static_cast<int64_t>(whole.nbytes());
      whole = at::Tensor();
      lock.lock();
      waiting_bytes_ -= bytes;
      space_.notify_one();
    }
  }

  WeightsWriter& writer_;
  const int64_t limit_;
  std::mutex mu_;
  std::condition_variable ready_, space_;
  std::deque<std::pair<size_t, at::Tensor>> queue_;
  int64_t waiting_bytes_ = 0;
  bool done_ = false;
  std::string error_;  // the writer thread's, read after the join
  std::thread thread_;
};

}  // namespace

namespace engine {

LoadWeightsResult LoadWeights(const ModuleTensors& module, ShardedRuntime& runtime, Comm& comm, const std::string& path,
                              const LoadWeightsOptions& options) {
  std::optional<SafetensorsSource> source;
  ckpt::WeightsMatch match;
  std::string error;
  bool filling = false;
  try {
    source = SafetensorsSource::Open(path);
    match = ckpt::MatchWeights(*source, ModelTensors(module), NameMapOf(options));
    if (options.strict && !(match.missing.empty() && match.unexpected.empty()))
      throw FormatError(source->path() + ": Error(s) in loading state_dict: " + ckpt::MismatchText(match));
    filling = true;
    FillFromSource(module, runtime, *source, match);
  } catch (const std::exception& ex) {
    error = ex.what();
  }
  // One rank's bad file is every rank's error, before the weights' all-gather;
  // masters filled meanwhile go back to the weights' values (a local copy).
  if (std::string agreed = AgreedError(comm, error); !agreed.empty()) {
    if (filling) runtime.MastersFromWeights();
    throw FormatError(agreed);
  }
  runtime.WeightsFromMasters();
  return {match.missing, match.unexpected};
}

bool Save16bitModel(const ModuleTensors& module, ShardedRuntime& runtime, Comm& comm, int stage, bool gather_on_save,
                    const std::string& save_dir, const std::string& save_filename, bool exclude_frozen_parameters) {
  const std::string path = (fs::path(save_dir) / save_filename).string();
  const bool rank0 = comm.rank() == 0;
  if (stage == 3 && !gather_on_save) {
    if (rank0)
      std::cerr << "uckpt: Did not save the model " << path
                << " because `stage3_gather_16bit_weights_on_model_save` is False\n";
    return false;
  }
  const std::vector<SavedEntry> entries = SavedEntries(module, exclude_frozen_parameters);
  std::unique_ptr<WeightsWriter> writer;
  std::string error;
  if (rank0) try {
      Env::Current().CreateDirs(save_dir);
      if (save_filename.ends_with(".safetensors")) writer = std::make_unique<SafetensorsWeightsWriter>(path, entries);
      else
        writer = std::make_unique<TorchWeightsWriter>(path, entries,
                                                      stage == 3 ? std::vector<std::string>{} : module.module_prefixes);
    } catch (const std::exception& ex) {
      error = ex.what();
    }
  // Rank 0 stops writing at its first error but keeps gathering: the others wait on it.
  std::optional<WriteBehind> behind;
  if (writer) try {
      behind.emplace(*writer, kWriteBehindBytes);
    } catch (const std::exception& ex) {  // no thread: no writes, but rank 0 still gathers with the others
      error = ex.what();
    }
  ForEachWhole(runtime, comm, entries, [&](size_t i, const at::Tensor& whole) {
    if (behind) behind->Push(i, whole);
  });
  if (behind && error.empty()) error = behind->Finish();
  if (writer && error.empty()) try {
      writer->Commit();
    } catch (const std::exception& ex) {
      error = ex.what();
    }
  writer.reset();  // an uncommitted temporary file is removed
  if (std::string agreed = AgreedError(comm, error); !agreed.empty())
    throw IoError("save_16bit_model: " + path + " not saved: " + agreed);
  return true;
}

std::vector<std::pair<std::string, at::Tensor>> Consolidated16bitStateDict(const ModuleTensors& module,
                                                                           ShardedRuntime& runtime, Comm& comm,
                                                                           bool exclude_frozen_parameters) {
  const std::vector<SavedEntry> entries = SavedEntries(module, exclude_frozen_parameters);
  std::vector<at::Tensor> whole(entries.size());
  ForEachWhole(runtime, comm, entries, [&](size_t i, const at::Tensor& t) { whole[i] = t; });
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (comm.rank() != 0) return out;
  for (size_t i = 0; i < entries.size(); ++i) {
    const int same = entries[i].same_as;
    out.emplace_back(entries[i].name, same >= 0 ? whole[static_cast<size_t>(same)] : whole[i]);
  }
  return out;
}

}  // namespace engine
}  // namespace uckpt
