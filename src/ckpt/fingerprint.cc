#include "ckpt/fingerprint.h"

#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "ckpt/deepspeed_names.h"
#include "ckpt/deepspeed_state.h"
#include "ckpt/folder.h"
#include "ckpt/manifest.h"
#include "ckpt/parallel.h"
#include "ckpt/reshard.h"
#include "ckpt/tag_folder.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/values.h"
#include "ckpt/zero_checkpoint.h"
#include "format/env.h"
#include "format/error.h"

namespace uckpt::ckpt {

using nlohmann::json;

uint64_t FingerprintSeed(std::string_view param, std::string_view key) {
  std::string s;
  s.reserve(param.size() + key.size() + 1);
  s.append(param).append("/").append(key);
  return XXH64(s.data(), s.size(), 0);
}

namespace {

// The hot loop, vectorised where the CPU has 64-bit vector multiplies
// (AVX-512: about 5x the scalar loop); the same value on every path.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default"), optimize("O3")))
#endif
uint64_t
SumTerms(uint64_t seed, uint64_t start, const uint32_t* bits, size_t n) {
  uint64_t sum = 0;
  for (size_t j = 0; j < n; ++j) {
    sum += FingerprintTerm(seed, start + j, bits[j]);
  }
  return sum;
}

}  // namespace

uint64_t FingerprintBits(uint64_t seed, int64_t start, std::span<const uint32_t> bits) {
  return SumTerms(seed, static_cast<uint64_t>(start), bits.data(), bits.size());
}

uint64_t FingerprintElements(uint64_t seed, int64_t start, DType dtype, std::span<const uint8_t> bytes) {
  const size_t es = DTypeSize(dtype);
  if (!DTypeIsFloating(dtype))
    throw FormatError("state fingerprint: a tensor of " + std::string(DTypeName(dtype)) +
                      " is not a floating-point state");
  const size_t n = bytes.size() / es;
  if (dtype == DType::kFloat32 && reinterpret_cast<uintptr_t>(bytes.data()) % alignof(uint32_t) == 0)
    return FingerprintBits(seed, start, {reinterpret_cast<const uint32_t*>(bytes.data()), n});
  // In blocks of fp32 bits, converted from the stored dtype.
  constexpr size_t kBlock = 4096;
  uint32_t buf[kBlock];
  uint64_t sum = 0;
  for (size_t at = 0; at < n; at += kBlock) {
    const size_t m = std::min(kBlock, n - at);
    const uint8_t* p = bytes.data() + at * es;
    if (dtype == DType::kFloat32) {
      std::memcpy(buf, p, m * 4);
    } else {
      for (size_t j = 0; j < m; ++j) {
        float f;
        if (dtype == DType::kBFloat16 || dtype == DType::kFloat16) {
          uint16_t h;
          std::memcpy(&h, p + j * 2, 2);
          f = dtype == DType::kBFloat16 ? BFloat16ToFloat(h) : HalfToFloat(h);
        } else {
          f = static_cast<float>(ElementToDouble(dtype, p + j * es));
        }
        std::memcpy(&buf[j], &f, 4);
      }
    }
    sum += FingerprintBits(seed, start + static_cast<int64_t>(at), {buf, m});
  }
  return sum;
}

const uint64_t* ParamFingerprint::find(const std::string& key) const {
  for (const auto& [k, v] : states)
    if (k == key) return &v;
  return nullptr;
}

uint64_t StateFingerprint::total() const {
  uint64_t t = 0;
  for (uint64_t s : sums()) t += s;
  return t;
}

size_t StateFingerprint::tensors() const {
  size_t n = 0;
  for (const auto& p : params) n += p.states.size();
  return n;
}

std::vector<uint64_t> StateFingerprint::sums() const {
  std::vector<uint64_t> v;
  for (const auto& p : params)
    for (const auto& s : p.states) v.push_back(s.second);
  return v;
}

void StateFingerprint::set_sums(const std::vector<uint64_t>& v) {
  if (v.size() != tensors()) throw std::logic_error("StateFingerprint::set_sums: wrong count");
  size_t k = 0;
  for (auto& p : params)
    for (auto& s : p.states) s.second = v[k++];
}

// ---- JSON ----

json FingerprintToJson(const StateFingerprint& f) {
  json params = json::array();
  for (const auto& p : f.params) {
    json states = json::object();
    for (const auto& [k, v] : p.states) states[k] = HashToHex(v);
    params.push_back({{"name", p.name}, {"numel", p.numel}, {"states", states}});
  }
  json counters = json::object();
  const FingerprintCounters& c = f.counters;
  if (c.global_steps) counters["global_steps"] = *c.global_steps;
  if (c.skipped_steps) counters["skipped_steps"] = *c.skipped_steps;
  if (c.global_samples) counters["global_samples"] = *c.global_samples;
  if (c.optimizer_step) counters["optimizer_step"] = *c.optimizer_step;
  if (c.loss_scale) counters["loss_scale"] = *c.loss_scale;
  return {
      {"version", kFingerprintVersion}, {"total", HashToHex(f.total())}, {"counters", counters}, {"params", params}};
}

StateFingerprint FingerprintFromJson(const json& j, const std::string& where) {
  auto bad = [&](const std::string& what) { return FormatError(where + ": state_fingerprint " + what); };
  if (!j.is_object()) throw bad("is not an object");
  if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int64_t>() != kFingerprintVersion)
    throw bad("has no \"version\" " + std::to_string(kFingerprintVersion) + " (written by a newer uckpt?)");
  if (!j.contains("params") || !j["params"].is_array()) throw bad("has no \"params\" array");
  StateFingerprint f;
  for (const auto& p : j["params"]) {
    if (!p.is_object() || !p.contains("name") || !p["name"].is_string() || !p.contains("numel") ||
        !p["numel"].is_number_integer() || !p.contains("states") || !p["states"].is_object())
      throw bad("entry " + p.dump() + " lacks a string \"name\", an integer \"numel\" or a \"states\" object");
    ParamFingerprint pf;
    pf.name = p["name"].get<std::string>();
    pf.numel = p["numel"].get<int64_t>();
    for (const auto& [k, v] : p["states"].items()) {
      uint64_t h = 0;
      if (!v.is_string() || !HexToHash(v.get<std::string>(), &h))
        throw bad("of " + pf.name + " has a \"" + k + "\" that is not 16 lower-case hex digits");
      pf.states.emplace_back(k, h);
    }
    // "fp32" first, then sorted: the canonical order.
    std::stable_sort(pf.states.begin(), pf.states.end(), [](const auto& a, const auto& b) {
      return (a.first == kFp32) != (b.first == kFp32) ? a.first == kFp32 : a.first < b.first;
    });
    f.params.push_back(std::move(pf));
  }
  if (j.contains("counters")) {
    const json& c = j["counters"];
    if (!c.is_object()) throw bad("\"counters\" is not an object");
    auto geti = [&](const char* k, std::optional<int64_t>& out) {
      if (!c.contains(k)) return;
      if (!c[k].is_number_integer()) throw bad("counter \"" + std::string(k) + "\" is not an integer");
      out = c[k].get<int64_t>();
    };
    auto getd = [&](const char* k, std::optional<double>& out) {
      if (!c.contains(k)) return;
      if (!c[k].is_number()) throw bad("counter \"" + std::string(k) + "\" is not a number");
      out = c[k].get<double>();
    };
    geti("global_steps", f.counters.global_steps);
    geti("skipped_steps", f.counters.skipped_steps);
    geti("global_samples", f.counters.global_samples);
    getd("optimizer_step", f.counters.optimizer_step);
    getd("loss_scale", f.counters.loss_scale);
  }
  if (j.contains("total")) {
    uint64_t t = 0;
    if (!j["total"].is_string() || !HexToHash(j["total"].get<std::string>(), &t)) throw bad("\"total\" is not hex");
    if (t != f.total())
      throw bad("\"total\" " + HashToHex(t) + " is not the sum of its parameters' (" + HashToHex(f.total()) + ")");
  }
  return f;
}

// ---- From files ----

namespace {

std::vector<std::string> CanonicalKeys(std::vector<std::string> keys) {
  std::sort(keys.begin(), keys.end());
  keys.insert(keys.begin(), kFp32);
  return keys;
}

// A parameter's own per-element state keys, canonical: an optimizer's groups
// may keep different states (Muon's momentum_buffer beside Adam's moments).
std::vector<std::string> ParamKeys(const ParamPlan& p) {
  std::vector<std::string> keys;
  for (const StatePlan& s : p.states)
    if (s.key != kFp32) keys.push_back(s.key);
  return CanonicalKeys(keys);
}

// The same of a universal folder's parameter: its zero/<name>/ files that are
// not step.pt or a scalar of the optimizer's.
std::vector<std::string> UniversalParamKeys(const UniversalCheckpoint& u, const std::string& name) {
  std::vector<std::string> keys;
  const std::string dir = UniversalParamDir(u.folder, name);
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return CanonicalKeys(u.state_keys);
  for (const Env::DirEntry& e : Env::Current().ListDir(dir)) {
    const std::optional<std::string> key = UniversalStateKey(e.name);
    if (!key || *key == kStep || *key == kFp32) continue;
    if (std::find(u.scalar_keys.begin(), u.scalar_keys.end(), *key) != u.scalar_keys.end()) continue;
    keys.push_back(*key);
  }
  return CanonicalKeys(keys);
}

void SetModelCounters(const TorchFile& model, FingerprintCounters& c) {
  const ModelStatesView m = ReadModelStates(model.root, model.file->path());
  c.global_steps = m.global_steps;
  c.skipped_steps = m.skipped_steps;
  c.global_samples = m.global_samples;
}

// The jobs k with k % shards == shard (a rank's share: all shares add up to
// the whole) on `threads` threads, largest first; job k's sum is added to
// state at[k].second of parameter at[k].first.
template <typename Hash>
void RunShare(StateFingerprint& f, const std::vector<std::pair<size_t, size_t>>& at, const std::vector<uint64_t>& sizes,
              int shard, int shards, int threads, Hash hash) {
  std::vector<size_t> mine;
  std::vector<uint64_t> mine_sizes;
  for (size_t k = 0; k < at.size(); ++k)
    if (static_cast<int>(k % static_cast<size_t>(shards)) == shard) {
      mine.push_back(k);
      mine_sizes.push_back(sizes[k]);
    }
  std::vector<uint64_t> sums(mine.size(), 0);
  ParallelBySize(mine_sizes, WorkerThreads(threads, mine.size()), [&](size_t m) { sums[m] = hash(mine[m]); });
  for (size_t m = 0; m < mine.size(); ++m) f.params[at[mine[m]].first].states[at[mine[m]].second].second += sums[m];
}

void CheckShard(int shard, int shards) {
  if (shards < 1 || shard < 0 || shard >= shards) throw std::invalid_argument("state fingerprint: bad shard");
}

}  // namespace

namespace {

// A job's bytes from files (FingerprintZeroCheckpoint) at most.
constexpr size_t kJobBytes = size_t{4} << 20;

// The hash of one piece of a memory-mapped rank file, 4 MiB at a time (a
// job's piece in one go: one madvise, one TLB flush per job); the pages read
// are dropped again, so fingerprinting a checkpoint larger than
// memory keeps the resident set small (as the converter does).
uint64_t FingerprintMappedPiece(uint64_t seed, int64_t start, DType dtype, std::span<const uint8_t> piece,
                                const ZeroCheckpoint& z) {
  bool mapped = false;
  for (const auto& f : z.optim) {
    auto m = f.file->bytes();
    if (piece.data() >= m.data() && piece.data() + piece.size() <= m.data() + m.size()) mapped = true;
  }
  const size_t elem = DTypeSize(dtype);
  const size_t chunk = kJobBytes / elem * elem;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  uint64_t sum = 0;
  for (size_t off = 0; off < piece.size(); off += chunk) {
    const size_t n = std::min(chunk, piece.size() - off);
    sum += FingerprintElements(seed, start + static_cast<int64_t>(off / elem), dtype, piece.subspan(off, n));
    if (!mapped) continue;
    // Only whole pages inside this chunk: its neighbours may still be read by other threads.
    const uintptr_t b = (reinterpret_cast<uintptr_t>(piece.data() + off) + page - 1) & ~(page - 1);
    const uintptr_t e = reinterpret_cast<uintptr_t>(piece.data() + off + n) & ~(page - 1);
    if (e > b) ::madvise(reinterpret_cast<void*>(b), e - b, MADV_DONTNEED);
  }
  return sum;
}

}  // namespace

StateFingerprint FingerprintLayout(const ZeroCheckpoint& z) {
  StateFingerprint f;
  for (const ParamPlan& p : z.params) {
    ParamFingerprint pf{p.name, p.numel, {}};
    for (const auto& k : ParamKeys(p)) pf.states.emplace_back(k, 0);
    f.params.push_back(std::move(pf));
  }
  SetModelCounters(z.model, f.counters);
  // A stage-0 folder has no rank files (and no loss scaler: its files are fp32).
  const std::string path = z.optim.empty() ? z.model.file->path() : z.optim[0].file->path();
  if (!z.optim.empty()) f.counters.loss_scale = ReadLossScale(ReadOptimStatesLossScaler(z.optim[0].root, path));
  if (!z.state_keys.empty() && !z.params.empty()) {
    if (ValuePtr step = z.steps.at(z.params[0].group)) f.counters.optimizer_step = ScalarOf(step, path + ": step");
  }
  return f;
}

StateFingerprint FingerprintZeroCheckpoint(const ZeroCheckpoint& z, int shard, int shards, int threads) {
  CheckShard(shard, shards);
  StateFingerprint f = FingerprintLayout(z);
  // Jobs of at most 4 MiB of one state's piece: the largest parameter's
  // tensors spread over every thread (and rank) as the small ones do.
  struct Job {
    uint64_t seed;
    int64_t start;
    DType dtype;
    std::span<const uint8_t> bytes;
  };
  std::vector<Job> jobs;
  std::vector<std::pair<size_t, size_t>> at;
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < z.params.size(); ++i) {
    const ParamPlan& p = z.params[i];
    const std::vector<std::string> keys = ParamKeys(p);
    for (size_t k = 0; k < keys.size(); ++k) {
      auto s = std::find_if(p.states.begin(), p.states.end(), [&](const StatePlan& s) { return s.key == keys[k]; });
      if (s == p.states.end())
        throw FormatError(z.folder + ": parameter " + p.name + " has no state '" + keys[k] + "'");
      const uint64_t seed = FingerprintSeed(p.name, keys[k]);
      const size_t elem = DTypeSize(s->dtype), step = kJobBytes / elem * elem;
      int64_t start = 0;  // of the piece, in the parameter's elements
      for (auto piece : s->pieces) {
        for (size_t off = 0; off < piece.size(); off += step) {
          const size_t n = std::min(step, piece.size() - off);
          jobs.push_back({seed, start + static_cast<int64_t>(off / elem), s->dtype, piece.subspan(off, n)});
          at.emplace_back(i, k);
          sizes.push_back(n);
        }
        start += static_cast<int64_t>(piece.size() / elem);
      }
    }
  }
  RunShare(f, at, sizes, shard, shards, threads, [&](size_t j) {
    return FingerprintMappedPiece(jobs[j].seed, jobs[j].start, jobs[j].dtype, jobs[j].bytes, z);
  });
  return f;
}

StateFingerprint FingerprintLayout(const UniversalCheckpoint& u) {
  StateFingerprint f;
  for (const auto& g : u.groups)
    for (const UniversalParam& p : g) {
      ParamFingerprint pf{p.name, p.numel, {}};
      for (const auto& k : UniversalParamKeys(u, p.name)) pf.states.emplace_back(k, 0);
      f.params.push_back(std::move(pf));
    }
  SetModelCounters(u.model, f.counters);
  const UniversalOptimizerFile saved = ReadUniversalOptimizerState(u);
  f.counters.loss_scale = ReadLossScale(saved.loss_scaler);
  if (!u.state_keys.empty() && !f.params.empty()) {
    if (u.has_step) {
      f.counters.optimizer_step = ReadUniversalStep(u, f.params[0].name);
    } else if (u.zero3 || saved.zero3_step) {
      // ZeRO-3's optimizer_state.pt: the whole stage-3 optimizer state; Adam's
      // step per sub-group (the first parameter is in sub-group 0). (A folder
      // converted from ZeRO-3 with TP ranks has dict files, and this step too.)
      if (saved.zero3_step)
        f.counters.optimizer_step = ScalarOf(saved.zero3_step, UniversalOptimizerStateFile(u.folder) + ": step");
    }
  }
  return f;
}

StateFingerprint FingerprintUniversalCheckpoint(const UniversalCheckpoint& u, int shard, int shards, int threads) {
  CheckShard(shard, shards);
  StateFingerprint f = FingerprintLayout(u);
  // One job per file (parameter and state).
  std::vector<std::pair<size_t, size_t>> at;
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < f.params.size(); ++i)
    for (size_t k = 0; k < f.params[i].states.size(); ++k) {
      at.emplace_back(i, k);
      sizes.push_back(static_cast<uint64_t>(f.params[i].numel));
    }
  RunShare(f, at, sizes, shard, shards, threads, [&](size_t j) {
    const ParamFingerprint& p = f.params[at[j].first];
    const std::string& key = p.states[at[j].second].first;
    LoadedState ls = LoadUniversalState(u, p.name, key);
    const std::string where = UniversalStateFile(u.folder, p.name, key);
    if (ls.tensor->numel() != p.numel)
      throw FormatError(where + ": has " + std::to_string(ls.tensor->numel()) + " elements, " + p.name + " has " +
                        std::to_string(p.numel));
    return FingerprintElements(FingerprintSeed(p.name, key), 0, ls.tensor->dtype, TensorBytes(*ls.tensor, where));
  });
  return f;
}

SourceFingerprintIndex::SourceFingerprintIndex(const ReadSource& source) {
  for (const ParamPlan& p : source.params)
    for (const StatePlan& s : p.states) {
      const size_t state = states_.size();
      states_.push_back({p.name, s.key, FingerprintSeed(p.name, s.key), s.dtype});
      const size_t es = DTypeSize(s.dtype);
      int64_t start = 0;
      for (auto piece : s.pieces) {
        if (!piece.empty()) ranges_.push_back({piece.data(), piece.data() + piece.size(), state, start});
        start += static_cast<int64_t>(piece.size() / es);
      }
    }
  std::sort(ranges_.begin(), ranges_.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges_.size(); ++i)
    if (ranges_[i].begin < ranges_[i - 1].end) {
      const State &a = states_[ranges_[i - 1].state], &b = states_[ranges_[i].state];
      throw FormatError(source.folder + ": state '" + a.key + "' of " + a.param + " and state '" + b.key + "' of " +
                        b.param + " share bytes");
    }
}

std::vector<SourceFingerprintIndex::Part> SourceFingerprintIndex::Locate(std::span<const uint8_t> bytes) const {
  std::vector<Part> parts;
  const uint8_t* at = bytes.data();
  const uint8_t* const end = bytes.data() + bytes.size();
  while (at < end) {
    // The last range beginning at or before `at`.
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), at,
                               [](const uint8_t* p, const Range& r) { return p < r.begin; });
    if (it == ranges_.begin() || (--it)->end <= at)
      throw std::logic_error("state fingerprint: a load read bytes that are no parameter's state");
    const size_t es = DTypeSize(states_[it->state].dtype);
    const size_t into = static_cast<size_t>(at - it->begin);
    const size_t n = static_cast<size_t>(std::min(end, it->end) - at);
    if (into % es || n % es) throw std::logic_error("state fingerprint: a load's read splits an element");
    parts.push_back(
        {it->state, it->start + static_cast<int64_t>(into / es), static_cast<size_t>(at - bytes.data()), n});
    at += n;
  }
  return parts;
}

StateFingerprint FingerprintFolder(const std::string& folder, int threads) {
  const TagFolder opened = OpenTagFolder(folder);
  switch (opened.kind) {
    case FolderKind::kZero: return FingerprintZeroCheckpoint(OpenZeroCheckpoint(opened), 0, 1, threads);
    case FolderKind::kUniversal: return FingerprintUniversalCheckpoint(OpenUniversalCheckpoint(opened), 0, 1, threads);
    default: throw FormatError(folder + ": not a ZeRO tag folder or a universal checkpoint folder");
  }
}

// ---- Comparison ----

namespace {

std::string Num(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

template <typename T>
std::optional<std::string> CounterDiff(const char* name, const std::optional<T>& want, const std::optional<T>& got,
                                       const std::string& actual_is) {
  if (!want || !got || *want == *got) return std::nullopt;
  return std::string("counter ") + name + " is " + Num(static_cast<double>(*got)) + " " + actual_is +
         ", the checkpoint's record is " + Num(static_cast<double>(*want));
}

}  // namespace

std::optional<std::string> FirstFingerprintDifference(const StateFingerprint& expected, const StateFingerprint& actual,
                                                      const FingerprintScope& scope, const std::string& actual_is) {
  std::map<std::string, const ParamFingerprint*> held;
  for (const auto& p : actual.params) held[p.name] = &p;
  auto in_scope = [&](const std::string& key) { return key == kFp32 ? scope.masters : scope.optimizer; };
  for (const auto& want : expected.params) {
    auto it = held.find(want.name);
    if (it == held.end()) return "parameter " + want.name + " is in the checkpoint, not " + actual_is;
    const ParamFingerprint& got = *it->second;
    if (got.numel != want.numel)
      return "parameter " + want.name + " has " + std::to_string(got.numel) + " elements " + actual_is +
             ", the checkpoint " + std::to_string(want.numel);
    for (const auto& [key, value] : want.states) {
      if (!in_scope(key)) continue;
      const uint64_t* h = got.find(key);
      if (!h) return "parameter " + want.name + " has no '" + key + "' " + actual_is + ", the checkpoint has one";
      if (*h != value)
        return "parameter " + want.name + " '" + key + "' differs: fingerprint " + HashToHex(*h) + " " + actual_is +
               ", the checkpoint's is " + HashToHex(value);
    }
    for (const auto& [key, value] : got.states)
      if (in_scope(key) && !want.find(key))
        return "parameter " + want.name + " has '" + key + "' " + actual_is + ", the checkpoint has none";
  }
  if (scope.masters || scope.optimizer) {
    std::map<std::string, bool> recorded;
    for (const auto& p : expected.params) recorded[p.name] = true;
    for (const auto& p : actual.params)
      if (!recorded.count(p.name)) return "parameter " + p.name + " " + actual_is + " is not in the checkpoint";
  }
  const FingerprintCounters &w = expected.counters, &g = actual.counters;
  std::optional<std::string> d;
  if (scope.counters && ((d = CounterDiff("global_steps", w.global_steps, g.global_steps, actual_is)) ||
                         (d = CounterDiff("skipped_steps", w.skipped_steps, g.skipped_steps, actual_is)) ||
                         (d = CounterDiff("global_samples", w.global_samples, g.global_samples, actual_is))))
    return d;
  if (scope.optimizer) {
    if (w.optimizer_step.has_value() != g.optimizer_step.has_value() && (w.optimizer_step || g.optimizer_step))
      return std::string("Adam's step is ") + (g.optimizer_step ? Num(*g.optimizer_step) : "absent") + " " + actual_is +
             ", the checkpoint's is " + (w.optimizer_step ? Num(*w.optimizer_step) : "absent");
    if ((d = CounterDiff("optimizer_step", w.optimizer_step, g.optimizer_step, actual_is)) ||
        (d = CounterDiff("loss_scale", w.loss_scale, g.loss_scale, actual_is)))
      return d;
  }
  return std::nullopt;
}

}  // namespace uckpt::ckpt
