#include "engine/fingerprint.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "ckpt/folder.h"
#include "ckpt/manifest.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/zero_checkpoint.h"
#include "format/error.h"

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

uint64_t HostSum(const at::Tensor& t, uint64_t seed, int64_t start) {
  const at::Tensor c = t.reshape(-1).contiguous();
  const uint32_t* bits = static_cast<const uint32_t*>(c.data_ptr());
  constexpr int64_t kChunk = int64_t{1} << 20;
  const int64_t n = c.numel(), chunks = (n + kChunk - 1) / kChunk;
  std::vector<uint64_t> parts(static_cast<size_t>(chunks), 0);
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const int64_t at = k * kChunk, m = std::min(kChunk, n - at);
      parts[static_cast<size_t>(k)] = ckpt::FingerprintBits(seed, start + at, {bits + at, static_cast<size_t>(m)});
    }
  });
  uint64_t sum = 0;
  for (uint64_t p : parts) sum += p;
  return sum;
}

// Sums of every (parameter, key), as this rank holds them: host values, or
// device tensors summed at the end (one copy to the host).
class Accumulator {
 public:
  void Add(size_t k, const at::Tensor& t, uint64_t seed, int64_t start) {
    if (t.numel() == 0) return;
    if (t.device().is_cpu()) {
      host_[k] += HostSum(t, seed, start);
      return;
    }
    if (!device_.defined()) device_ = at::zeros({static_cast<int64_t>(host_.size())}, t.options().dtype(at::kLong));
    device_[static_cast<int64_t>(k)].add_(FingerprintSum(t, seed, start));
  }
  explicit Accumulator(size_t n) : host_(n, 0) {}
  std::vector<uint64_t> Take() {
    if (device_.defined()) {
      at::Tensor d = device_.cpu();
      for (size_t k = 0; k < host_.size(); ++k) host_[k] += static_cast<uint64_t>(d.data_ptr<int64_t>()[k]);
    }
    return host_;
  }

 private:
  std::vector<uint64_t> host_;
  at::Tensor device_;
};

// The tensors of one partition: "fp32" and, once Adam has stepped, its moments.
std::vector<std::pair<std::string, at::Tensor>> Tensors(const PartitionState& st) {
  std::vector<std::pair<std::string, at::Tensor>> out = {{"fp32", st.master}};
  if (st.step.defined()) out.insert(out.end(), {{"exp_avg", st.exp_avg}, {"exp_avg_sq", st.exp_avg_sq}});
  return out;
}

// One piece of a parameter this rank holds: elements [start, start + n) of
// the parameter at element `offset` of its partition's tensors.
struct Piece {
  size_t param = 0;  // index into the fingerprint's params
  const PartitionState* state = nullptr;
  int64_t offset = 0, start = 0, numel = 0;
};

ckpt::StateFingerprint Hash(Comm& comm, ckpt::StateFingerprint f, const std::vector<Piece>& pieces) {
  std::vector<size_t> first(f.params.size(), 0);  // index of each param's first sum
  for (size_t i = 1; i < f.params.size(); ++i) first[i] = first[i - 1] + f.params[i - 1].states.size();
  Accumulator acc(f.tensors());
  for (const Piece& p : pieces) {
    const ckpt::ParamFingerprint& pf = f.params[p.param];
    for (const auto& [key, t] : Tensors(*p.state)) {
      size_t k = 0;
      while (k < pf.states.size() && pf.states[k].first != key) ++k;
      acc.Add(first[p.param] + k, t.narrow(0, p.offset, p.numel), ckpt::FingerprintSeed(pf.name, key), p.start);
    }
  }
  std::vector<uint64_t> sums = acc.Take();
  AllReduceWrapping(comm, sums);
  f.set_sums(sums);
  return f;
}

ckpt::ParamFingerprint Entry(const std::string& name, int64_t numel, const PartitionState& st) {
  ckpt::ParamFingerprint p{name, numel, {}};
  for (const auto& kv : Tensors(st)) p.states.emplace_back(kv.first, 0);
  return p;
}

std::optional<double> StepOf(const PartitionState& st) {
  if (!st.step.defined()) return std::nullopt;
  return st.step.item<double>();
}

}  // namespace

uint64_t FingerprintTensorOps(const at::Tensor& t, uint64_t seed, int64_t start) {
  return static_cast<uint64_t>(FingerprintSum(t, seed, start).item<int64_t>());
}

uint64_t FingerprintTensor(const at::Tensor& t, uint64_t seed, int64_t start) {
  return t.device().is_cpu() ? HostSum(t, seed, start) : FingerprintTensorOps(t, seed, start);
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
  for (int64_t k = 0; k < n; ++k)
    sums[k] = static_cast<uint64_t>(h[k]) + (static_cast<uint64_t>(h[n + k]) << 32);
}

ckpt::StateFingerprint EngineStateFingerprint(Engine::Impl& e) {
  ckpt::StateFingerprint f;
  std::vector<Piece> pieces;
  // Stage 0 keeps every partition whole on every rank: rank 0 hashes them.
  const bool hashes = e.runtime->partition_dp() > 1 || e.comm->rank() == 0;
  const std::vector<PartitionSlot> slots = e.runtime->Slots();
  for (const PartitionSlot& slot : slots) {
    const size_t base = f.params.size();
    for (const auto& p : slot.target.params) f.params.push_back(Entry(p.name, p.numel, *slot.state));
    if (!hashes) continue;
    for (const ckpt::TargetFragment& fr : slot.target.fragments)
      pieces.push_back({base + fr.param, slot.state, fr.offset, fr.param_offset, fr.numel});
  }
  if (!slots.empty()) f.counters.optimizer_step = StepOf(*slots.front().state);
  f.counters.loss_scale = e.runtime->loss_scale();
  f.counters.global_steps = e.global_steps;
  f.counters.skipped_steps = e.skipped_steps;
  f.counters.global_samples = e.global_samples;
  return Hash(*e.comm, std::move(f), pieces);
}

namespace {

// The highest rank whose `error` is not empty, or -1: one all-reduce.
int FailedRank(Comm& comm, const std::string& error) {
  at::Tensor failed = at::full({1}, error.empty() ? -1.0f : static_cast<float>(comm.rank()), at::kFloat);
  comm.AllReduceMax(failed);
  return static_cast<int>(failed.item<float>());
}

bool HasOptimFiles(const std::string& folder) {
  for (const auto& f : ckpt::ListCheckpointFolder(folder))
    if (f.kind == ckpt::FileKind::kOptimStates) return true;
  return false;
}

// The fingerprint a checkpoint without a record holds, from its files: each
// rank hashes parameters p with p % world == rank, then one reduction. Not
// through the loaders' resharding: the converter's plan of the files, or the
// universal files whole. nullopt for a folder it cannot say (stage 0's).
std::optional<ckpt::StateFingerprint> FromFiles(Comm& comm, const std::string& folder, bool universal) {
  std::optional<ckpt::StateFingerprint> f;
  std::string error;
  try {
    const int rank = comm.rank(), world = comm.world_size();
    if (universal) {
      f = ckpt::FingerprintUniversalCheckpoint(ckpt::OpenUniversalCheckpoint(folder, false, false), rank, world);
    } else if (HasOptimFiles(folder)) {
      f = ckpt::FingerprintZeroCheckpoint(ckpt::OpenZeroCheckpoint(folder, false, false), rank, world);
    }
  } catch (const std::exception& ex) {
    error = ex.what();
  }
  if (const int bad = FailedRank(comm, error); bad >= 0)
    throw FormatError(folder + ": its state fingerprint could not be computed from its files: " +
                      (error.empty() ? "rank " + std::to_string(bad) + " failed" : error));
  if (f) {
    std::vector<uint64_t> sums = f->sums();
    AllReduceWrapping(comm, sums);
    f->set_sums(sums);
  }
  return f;
}

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

void CheckStateFingerprint(Engine::Impl& e, const std::string& folder, const LoadCheckpointOptions& o) {
  if (folder.empty()) return;  // nothing loaded
  const auto start = std::chrono::steady_clock::now();
  std::optional<ckpt::StateFingerprint> expected;
  if (ckpt::HasManifest(folder)) expected = ckpt::ReadManifest(folder).state;
  const bool recorded = expected.has_value();
  if (!recorded) {
    expected = FromFiles(*e.comm, folder, o.universal);
    e.last_load.fingerprint_files_s = Since(start);
  }
  if (!expected) {
    e.last_load.fingerprint = "unchecked: a stage-0 checkpoint without a recorded fingerprint";
    return;
  }
  // What the load set: weights-only and no-optimizer loads leave Adam's state
  // (and, weights-only, the counters) as they were. Their stage 1/2 masters
  // may come from the 16-bit module weights: compared only in fp32 training.
  ckpt::FingerprintScope scope;
  const bool partial = o.load_module_only || !o.load_optimizer_states;
  scope.optimizer = !partial;
  scope.counters = !o.load_module_only;
  scope.masters = !partial || e.runtime->partitions_parameters() || (!e.config.fp16.enabled && !e.config.bf16);
  const ckpt::StateFingerprint held = EngineStateFingerprint(e);
  e.last_load.fingerprint_s = Since(start);
  if (auto diff = ckpt::FirstFingerprintDifference(*expected, held, scope))
    throw FormatError(folder + ": the state after the load is not the saved one (the state fingerprint " +
                      std::string(recorded ? "recorded in " + std::string(ckpt::kManifestName)
                                           : "computed from the checkpoint's files") +
                      "): " + *diff + "; refusing to train on it");
  e.last_load.fingerprint = recorded ? "recorded" : "computed from the files";
}

}  // namespace uckpt::engine
