#include "engine/fingerprint.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <system_error>

#include "ckpt/folder.h"
#include "ckpt/manifest.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/zero_checkpoint.h"
#include "engine/checkpoint.h"
#include "format/error.h"

#ifdef UCKPT_FINGERPRINT_KERNEL
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "engine/fingerprint_kernel.h"
#endif

namespace uckpt::engine {

namespace {

int64_t Signed(uint64_t x) {
  int64_t y;
  std::memcpy(&y, &x, 8);
  return y;
}

// z >> s as a logical shift (torch's is arithmetic on int64).
at::Tensor ShiftRight(const at::Tensor& z, int s) {
  return z.bitwise_right_shift(s).bitwise_and_(Signed((uint64_t{1} << (64 - s)) - 1));
}

// The tensor-op sum as a 0-d int64 tensor on t's device (no host sync).
at::Tensor FingerprintSum(const at::Tensor& t_in, uint64_t seed, int64_t start) {
  const at::Tensor t = t_in.reshape(-1);
  if (t.scalar_type() != at::kFloat) throw std::logic_error("FingerprintTensor: an fp32 tensor is needed");
  const auto longs = t.options().dtype(at::kLong);
  at::Tensor total = at::zeros({}, longs);
  constexpr int64_t kChunk = int64_t{1} << 22;  // 32 MiB per int64 temporary
  for (int64_t at = 0; at < t.numel(); at += kChunk) {
    const int64_t m = std::min(kChunk, t.numel() - at);
    at::Tensor bits = t.narrow(0, at, m).view(at::kInt).to(at::kLong).bitwise_and_(int64_t{0xffffffff});
    at::Tensor z = at::arange(start + at, start + at + m, longs);
    z.mul_(Signed(ckpt::kFingerprintGolden)).add_(Signed(seed));
    z.bitwise_xor_(bits.mul_(int64_t{1} << 32));  // multiply, not shift: wraps alike everywhere
    z.bitwise_xor_(ShiftRight(z, 30)).mul_(Signed(ckpt::kFingerprintMul1));
    z.bitwise_xor_(ShiftRight(z, 27)).mul_(Signed(ckpt::kFingerprintMul2));
    z.bitwise_xor_(ShiftRight(z, 31));
    total.add_(z.sum());
  }
  return total;
}

// One piece to hash: `t` (1-D fp32, contiguous) holds elements [start,
// start + numel) of the tensor whose seed is `seed`; its sum goes to sums[out].
struct Job {
  at::Tensor t;
  uint64_t seed = 0;
  int64_t start = 0;
  size_t out = 0;
};

// Host memory: every job in chunks of 1 Mi elements on the intra-op
// threads (many small tensors and a few large ones alike), then added up.
void AddHostSums(const std::vector<Job>& jobs, std::vector<uint64_t>& sums) {
  constexpr int64_t kChunk = int64_t{1} << 20;
  struct Chunk {
    const Job* job;
    int64_t at, n;
  };
  std::vector<Chunk> chunks;
  for (const Job& j : jobs)
    for (int64_t at = 0; at < j.t.numel(); at += kChunk) chunks.push_back({&j, at, std::min(kChunk, j.t.numel() - at)});
  std::vector<uint64_t> parts(chunks.size(), 0);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Chunk& c = chunks[static_cast<size_t>(k)];
      const uint32_t* bits = static_cast<const uint32_t*>(c.job->t.data_ptr()) + c.at;
      parts[static_cast<size_t>(k)] =
          ckpt::FingerprintBits(c.job->seed, c.job->start + c.at, {bits, static_cast<size_t>(c.n)});
    }
  });
  for (size_t k = 0; k < chunks.size(); ++k) sums[chunks[k].job->out] += parts[k];
}

// The tensor-op sums of jobs on one device, one copy back.
at::Tensor TensorOpSums(const std::vector<Job>& jobs, int64_t n) {
  at::Tensor sums = at::zeros({n}, jobs.front().t.options().dtype(at::kLong));
  for (const Job& j : jobs) sums[static_cast<int64_t>(j.out)].add_(FingerprintSum(j.t, j.seed, j.start));
  return sums.cpu();
}

// Jobs on one device: on a CUDA device where the kernel was built, every
// job's chunks in one launch and one copy back; else tensor ops.
at::Tensor DeviceSums(const std::vector<Job>& jobs, int64_t n) {
  const at::Device device = jobs.front().t.device();
  for (const Job& j : jobs)
    if (j.t.device() != device) throw std::logic_error("state fingerprint: tensors on two devices");
#ifdef UCKPT_FINGERPRINT_KERNEL
  if (device.is_cuda()) {
    std::vector<FingerprintChunk> chunks;
    for (const Job& j : jobs) {
      const uint32_t* bits = static_cast<const uint32_t*>(j.t.data_ptr());
      for (int64_t at = 0; at < j.t.numel(); at += kFingerprintChunkElements)
        chunks.push_back({bits + at, j.seed, static_cast<uint64_t>(j.start + at),
                          static_cast<uint32_t>(std::min<int64_t>(kFingerprintChunkElements, j.t.numel() - at)),
                          static_cast<uint32_t>(j.out)});
    }
    const c10::cuda::CUDAGuard guard(device);
    const int64_t bytes = static_cast<int64_t>(chunks.size() * sizeof(FingerprintChunk));
    const at::Tensor table = at::from_blob(chunks.data(), {bytes}, at::kByte).to(device);
    at::Tensor sums = at::zeros({n}, at::TensorOptions(device).dtype(at::kLong));
    if (const char* error = LaunchFingerprintKernel(static_cast<const FingerprintChunk*>(table.data_ptr()),
                                                    static_cast<int64_t>(chunks.size()),
                                                    reinterpret_cast<uint64_t*>(sums.data_ptr<int64_t>()),
                                                    c10::cuda::getCurrentCUDAStream(device.index()).stream()))
      throw std::runtime_error(std::string("state fingerprint: the CUDA kernel failed: ") + error);
    return sums.cpu();  // waits for the kernel; `table` lives until then
  }
#endif
  return TensorOpSums(jobs, n);
}

// Sums of every (parameter, key), as this rank holds them: host tensors on
// the host's threads, device tensors on the device, summed at the end.
class Accumulator {
 public:
  explicit Accumulator(size_t n) : n_(n) {}
  void Add(size_t k, const at::Tensor& t, uint64_t seed, int64_t start) {
    if (t.numel() == 0) return;
    if (t.scalar_type() != at::kFloat) throw std::logic_error("state fingerprint: an fp32 tensor is needed");
    (t.device().is_cpu() ? host_ : device_).push_back({t.reshape(-1).contiguous(), seed, start, k});
  }
  std::vector<uint64_t> Take() {
    std::vector<uint64_t> sums = TakeDevice();
    AddHost(sums);
    return sums;
  }
  // The device jobs' sums (on this thread: its device and stream).
  std::vector<uint64_t> TakeDevice() {
    std::vector<uint64_t> sums(n_, 0);
    if (!device_.empty()) {
      const at::Tensor d = DeviceSums(device_, static_cast<int64_t>(n_));
      for (size_t k = 0; k < n_; ++k) sums[k] += static_cast<uint64_t>(d.data_ptr<int64_t>()[k]);
    }
    return sums;
  }
  // The host jobs' sums added into `sums` (any thread).
  void AddHost(std::vector<uint64_t>& sums) { AddHostSums(host_, sums); }

 private:
  size_t n_;
  std::vector<Job> host_, device_;
};

// The tensors of one partition: "fp32" and, once the optimizer has stepped, its per-element states.
std::vector<std::pair<std::string, at::Tensor>> Tensors(const PartitionState& st) {
  std::vector<std::pair<std::string, at::Tensor>> out = {{ckpt::kFp32, st.master}};
  for (auto& kv : ElementStates(st)) out.push_back(std::move(kv));
  return out;
}

// One piece of a parameter this rank holds: elements [start, start + n) of
// the parameter at element `offset` of its partition's tensors.
struct Piece {
  size_t param = 0;  // index into the fingerprint's params
  const PartitionState* state = nullptr;
  int64_t offset = 0, start = 0, numel = 0;
};

// The jobs that hash `pieces` of fingerprint f.
std::unique_ptr<Accumulator> Jobs(const ckpt::StateFingerprint& f, const std::vector<Piece>& pieces) {
  std::vector<size_t> first(f.params.size(), 0);  // index of each param's first sum
  for (size_t i = 1; i < f.params.size(); ++i) first[i] = first[i - 1] + f.params[i - 1].states.size();
  auto acc = std::make_unique<Accumulator>(f.tensors());
  for (const Piece& p : pieces) {
    const ckpt::ParamFingerprint& pf = f.params[p.param];
    for (const auto& [key, t] : Tensors(*p.state)) {
      size_t k = 0;
      while (k < pf.states.size() && pf.states[k].first != key) ++k;
      acc->Add(first[p.param] + k, t.narrow(0, p.offset, p.numel), ckpt::FingerprintSeed(pf.name, key), p.start);
    }
  }
  return acc;
}

ckpt::ParamFingerprint Entry(const std::string& name, int64_t numel, const PartitionState& st) {
  ckpt::ParamFingerprint p{name, numel, {}};
  for (const auto& kv : Tensors(st)) p.states.emplace_back(kv.first, 0);
  return p;
}

}  // namespace

uint64_t FingerprintTensorOps(const at::Tensor& t, uint64_t seed, int64_t start) {
  return static_cast<uint64_t>(FingerprintSum(t, seed, start).item<int64_t>());
}

uint64_t FingerprintTensor(const at::Tensor& t, uint64_t seed, int64_t start) {
  Accumulator acc(1);
  acc.Add(0, t, seed, start);
  return acc.Take()[0];
}

void AllReduceWrapping(Comm& comm, std::vector<uint64_t>& sums) {
  if (comm.world_size() <= 1 || sums.empty()) return;
  // Halves of 32 bits in int64 lanes: no lane overflows, whatever the backend.
  const int64_t n = static_cast<int64_t>(sums.size());
  at::Tensor halves = at::empty({2 * n}, at::kLong);
  int64_t* h = halves.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    h[k] = static_cast<int64_t>(sums[k] & 0xffffffffu);
    h[n + k] = static_cast<int64_t>(sums[k] >> 32);
  }
  comm.AllReduceSum(halves);
  halves = halves.cpu();
  h = halves.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) sums[k] = static_cast<uint64_t>(h[k]) + (static_cast<uint64_t>(h[n + k]) << 32);
}

namespace {

// The highest rank whose `error` is not empty, or -1: one all-reduce.
int FailedRank(Comm& comm, const std::string& error) {
  at::Tensor failed = at::full({1}, error.empty() ? -1.0f : static_cast<float>(comm.rank()), at::kFloat);
  comm.AllReduceMax(failed);
  return static_cast<int>(failed.item<float>());
}

// The fingerprint's parameters and counters, and the pieces this rank hashes.
ckpt::StateFingerprint Layout(const FingerprintInputs& in, std::vector<Piece>& pieces) {
  ckpt::StateFingerprint f;
  // The runtime's partition slots, in parameter order at every stage. Where
  // every rank holds the whole state (stage 0), rank 0 alone hashes it.
  const bool hashes = in.runtime.partition_dp() > 1 || in.comm.rank() == 0;
  const std::vector<PartitionSlot> slots = in.runtime.Slots();
  for (const PartitionSlot& slot : slots) {
    const size_t base = f.params.size();
    for (const ckpt::TargetParam& p : slot.target.params) f.params.push_back(Entry(p.name, p.numel, *slot.state));
    if (!hashes) continue;
    for (const ckpt::TargetFragment& fr : slot.target.fragments)
      pieces.push_back({base + fr.param, slot.state, fr.offset, fr.param_offset, fr.numel});
  }
  if (!slots.empty()) f.counters.optimizer_step = StepOf(*slots.front().state);
  f.counters.loss_scale = in.runtime.loss_scale();
  f.counters.global_steps = in.counters.global_steps;
  f.counters.skipped_steps = in.counters.skipped_steps;
  f.counters.global_samples = in.counters.global_samples;
  return f;
}

}  // namespace

ckpt::StateFingerprint EngineStateFingerprint(const FingerprintInputs& in) {
  return PendingStateFingerprint(in).Finish(in.comm);
}

PendingStateFingerprint::PendingStateFingerprint(const FingerprintInputs& in) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Piece> pieces;
  f_ = Layout(in, pieces);
  std::shared_ptr<Accumulator> acc = Jobs(f_, pieces);
  sums_ = acc->TakeDevice();
  auto hash = [this, acc, start] {
    try {
      acc->AddHost(sums_);
    } catch (const std::exception& ex) {
      error_ = ex.what();
    }
    hash_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  try {
    thread_ = std::thread(hash);
  } catch (const std::system_error&) {
    hash();  // no thread to be had: here, before the write
  }
}

PendingStateFingerprint::~PendingStateFingerprint() {
  if (thread_.joinable()) thread_.join();
}

ckpt::StateFingerprint PendingStateFingerprint::Finish(Comm& comm) {
  if (thread_.joinable()) thread_.join();
  // Every rank learns of a failure on any (no rank is left in the sums' reduction).
  if (const int failed = FailedRank(comm, error_); failed >= 0)
    throw std::runtime_error("state fingerprint: " +
                             (error_.empty() ? "failed on rank " + std::to_string(failed) : error_));
  AllReduceWrapping(comm, sums_);
  f_.set_sums(sums_);
  return std::move(f_);
}

namespace {

// What a checkpoint without a record covers: from the files the load
// opened, else (the load read the module's weights) from the folder's. No
// value for a folder it cannot say (stage 0's).
std::optional<ckpt::StateFingerprint> FilesLayout(const LoadSource& source, const ckpt::TagFolder& folder,
                                                  bool universal) {
  if (source.files_layout) return source.files_layout();
  if (universal) return ckpt::FingerprintLayout(ckpt::OpenUniversalCheckpoint(folder));
  if (!folder.rank_files.empty()) return ckpt::FingerprintLayout(ckpt::OpenZeroCheckpoint(folder));
  return std::nullopt;
}

// Collective: the files' layout with every rank's loaded share added in;
// throws on every rank if one failed.
std::optional<ckpt::StateFingerprint> FromShares(Comm& comm, FingerprintCheck& check) {
  std::optional<ckpt::StateFingerprint>& layout = check.files;
  std::string error = check.error;
  std::vector<uint64_t> sums;
  if (layout && error.empty()) {
    sums.assign(layout->tensors(), 0);
    std::map<std::pair<std::string, std::string>, size_t> at;
    for (const ckpt::ParamFingerprint& p : layout->params)
      for (const auto& kv : p.states) at.emplace(std::pair{p.name, kv.first}, at.size());
    for (size_t i = 0; i < check.loaded_states.size() && error.empty(); ++i) {
      const auto& st = check.loaded_states[i];
      auto it = at.find({st.param, st.key});
      if (it == at.end()) {
        error = "the load read state '" + st.key + "' of " + st.param + ", which the files' layout does not list";
      } else {
        sums[it->second] += check.loaded_sums[i];
      }
    }
  }
  if (const int bad = FailedRank(comm, error); bad >= 0)
    throw FormatError(check.folder + ": its state fingerprint could not be computed from its files: " +
                      (error.empty() ? "rank " + std::to_string(bad) + " failed" : error));
  if (!layout) return std::nullopt;
  AllReduceWrapping(comm, sums);
  layout->set_sums(sums);
  return layout;
}

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

FingerprintCheck StartStateFingerprintCheck(const ckpt::TagFolder& folder, const LoadCheckpointOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  FingerprintCheck check;
  check.folder = folder.path;
  check.opened = &folder;
  check.recorded = folder.recorded();
  check.universal = o.universal;
  check.start_s = Since(start);
  return check;
}

void HashLoadedState(const FingerprintInputs& in, FingerprintCheck& check, const LoadSource& source,
                     const std::vector<TensorReads>& loads) {
  if (check.folder.empty() || check.recorded) return;
  const auto start = std::chrono::steady_clock::now();
  check.hashed = true;
  try {
    check.files = FilesLayout(source, *check.opened, check.universal);
    // Where every rank read the whole state (stage 0), rank 0's read counts.
    if (check.files && (in.runtime.partition_dp() > 1 || in.comm.rank() == 0)) {
      const ckpt::SourceFingerprintIndex index(source.states);
      Accumulator acc(index.states().size());
      for (const TensorReads& t : loads) {
        const int64_t es = static_cast<int64_t>(c10::elementSize(t.source));
        const at::Tensor flat = t.dst.reshape(-1);
        for (const ckpt::ReadPiece& piece : t.pieces)
          for (const auto& part : index.Locate(piece.from)) {
            const auto& st = index.states()[part.state];
            const int64_t at = static_cast<int64_t>(piece.to + part.offset) / es;
            acc.Add(part.state, flat.narrow(0, at, static_cast<int64_t>(part.bytes) / es), st.seed, part.start);
          }
      }
      check.loaded_sums = acc.Take();
      check.loaded_states = index.states();
    }
  } catch (const std::exception& ex) {
    check.error = ex.what();
  }
  check.hash_s = Since(start);
}

void FinishStateFingerprintCheck(const FingerprintInputs& in, bool fp32_training, FingerprintCheck& check,
                                 const LoadCheckpointOptions& o, LoadStats& stats) {
  if (check.folder.empty()) return;  // nothing loaded
  const auto start = std::chrono::steady_clock::now();
  std::optional<ckpt::StateFingerprint> expected = check.recorded;
  if (check.hashed) {
    expected = FromShares(in.comm, check);
    stats.fingerprint_files_s = check.hash_s + Since(start);
  }
  if (!expected) {
    stats.fingerprint = "unchecked: a stage-0 checkpoint without a recorded fingerprint";
    return;
  }
  // What the load set: weights-only and no-optimizer loads leave Adam's state
  // (and, weights-only, the counters) as they were. Their stage 1/2 masters
  // may come from the 16-bit module weights: compared only in fp32 training.
  ckpt::FingerprintScope scope;
  const bool partial = o.load_module_only || !o.load_optimizer_states;
  scope.optimizer = !partial;
  scope.counters = !o.load_module_only;
  scope.masters = !partial || in.runtime.partitions_parameters() || fp32_training;
  const ckpt::StateFingerprint held = EngineStateFingerprint(in);
  stats.fingerprint_s = check.start_s + check.hash_s + Since(start);
  const bool recorded = check.recorded.has_value();
  if (auto diff = ckpt::FirstFingerprintDifference(*expected, held, scope))
    throw FormatError(check.folder + ": the state after the load is not the saved one (the state fingerprint " +
                      std::string(recorded ? "recorded in " + std::string(ckpt::kManifestName)
                                           : "computed from the checkpoint's files") +
                      "): " + *diff + "; refusing to train on it");
  stats.fingerprint = recorded ? "recorded" : "computed from the files";
}

}  // namespace uckpt::engine
