// The state fingerprint (docs/manifest-format.md, "State fingerprint"): a
// hash of the logical training state that does not depend on layout, ZeRO
// stage, world size or storage dtype. Per trainable parameter (by name) and
// per tensor of it ("fp32" master, "exp_avg", "exp_avg_sq", ...) a wrapping
// 64-bit sum over its logical (unpadded) elements i of
//   term(seed, i, bits) = Mix((seed + i * kGolden) ^ (uint64(bits) << 32)),
// seed = XXH64(name + "/" + key), bits = the element's fp32 bit pattern, Mix
// splitmix64's finaliser. A sum of terms combines: whoever holds a piece of a
// tensor hashes it with its global element indices, and adding the pieces'
// sums (one reduction over ranks) gives the tensor's. Plus the counters.
//
// Recorded in uckpt-manifest.json at every save and conversion; checked by
// the engine after every load; printed by `uckpt verify --state`. No libtorch.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckpt/fingerprint_term.h"
#include "format/dtype.h"

namespace uckpt::ckpt {

struct ZeroCheckpoint;       // zero_checkpoint.h
struct UniversalCheckpoint;  // universal_checkpoint.h
struct ReadSource;           // reshard.h

inline constexpr int kFingerprintVersion = 1;

// XXH64 (seed 0) of `param` + "/" + `key`.
uint64_t FingerprintSeed(std::string_view param, std::string_view key);

// Sum over j < bits.size() of term(seed, start + j, bits[j]), wrapping.
uint64_t FingerprintBits(uint64_t seed, int64_t start, std::span<const uint32_t> bits);

// The same over `bytes` holding elements of a floating dtype (fp32, bf16,
// fp16, fp64): each element's value as fp32 (exact for bf16/fp16) gives its
// bits. `bytes` need not be aligned.
uint64_t FingerprintElements(uint64_t seed, int64_t start, DType dtype, std::span<const uint8_t> bytes);

// One parameter's tensors: "fp32" first, then the optimizer's keys sorted.
struct ParamFingerprint {
  std::string name;
  int64_t numel = 0;
  std::vector<std::pair<std::string, uint64_t>> states;
  const uint64_t* find(const std::string& key) const;
};

// The counters where known (absent: not recorded / not in the files).
struct FingerprintCounters {
  std::optional<int64_t> global_steps, skipped_steps, global_samples;
  std::optional<double> optimizer_step;  // Adam's step of the first parameter (none before the first step)
  std::optional<double> loss_scale;
};

struct StateFingerprint {
  std::vector<ParamFingerprint> params;  // param_shapes order
  FingerprintCounters counters;
  uint64_t total() const;  // wrapping sum of every tensor's value
  size_t tensors() const;
  // Every tensor's sum in order (params, then states): what a reduction adds.
  std::vector<uint64_t> sums() const;
  void set_sums(const std::vector<uint64_t>& v);
};

nlohmann::json FingerprintToJson(const StateFingerprint& f);
// Throws FormatError naming `where` on a malformed record.
StateFingerprint FingerprintFromJson(const nlohmann::json& j, const std::string& where);

// What a checkpoint's fingerprint covers, from its files' headers alone:
// every parameter's name, size and tensors (sums zero) and the counters.
StateFingerprint FingerprintLayout(const ZeroCheckpoint& z);
StateFingerprint FingerprintLayout(const UniversalCheckpoint& u);

// From an opened ZeRO 1/2/3 checkpoint's plan: share `shard` of `shards` of
// the work (pieces of at most 4 MiB of a state, every shards-th one; the
// shares' sums add up to the whole; names and keys are complete), on
// `threads` threads (0: up to 4). Counters from the files.
StateFingerprint FingerprintZeroCheckpoint(const ZeroCheckpoint& z, int shard = 0, int shards = 1, int threads = 0);
// The same from a universal folder's per-parameter files (a job per file).
StateFingerprint FingerprintUniversalCheckpoint(const UniversalCheckpoint& u, int shard = 0, int shards = 1,
                                                int threads = 0);

// Where bytes of a load's source belong in the fingerprint, by the files'
// own layout (the source's pieces of each parameter's states), not by the
// partitions a load planned: hashing the bytes a load read with it gives
// the files' share of what that load read, without reading them again. No I/O.
class SourceFingerprintIndex {
 public:
  // Throws FormatError when two states of `source` share bytes.
  explicit SourceFingerprintIndex(const ReadSource& source);

  struct State {
    std::string param, key;
    uint64_t seed = 0;
    DType dtype = DType::kFloat32;
  };
  // `bytes` bytes from `offset` of a located span are elements [start, ...)
  // of states()[state].
  struct Part {
    size_t state = 0;
    int64_t start = 0;
    size_t offset = 0, bytes = 0;
  };
  // `bytes` (inside the source's files) split where states end, in order.
  // Throws std::logic_error for a byte outside every state, or a split
  // inside an element.
  std::vector<Part> Locate(std::span<const uint8_t> bytes) const;
  const std::vector<State>& states() const { return states_; }

 private:
  struct Range {
    const uint8_t* begin;
    const uint8_t* end;
    size_t state;
    int64_t start;
  };
  std::vector<Range> ranges_;  // by begin
  std::vector<State> states_;
};

// The fingerprint of a tag or universal folder computed from its files
// (FolderKind decides which). Throws FormatError when it is neither, or a
// ZeRO folder without optimizer files (stage 0).
StateFingerprint FingerprintFolder(const std::string& folder, int threads = 0);

// What a comparison covers.
struct FingerprintScope {
  bool masters = true;    // the "fp32" tensors
  bool optimizer = true;  // the other tensors, optimizer_step, loss_scale
  bool counters = true;   // global_steps, skipped_steps, global_samples
};

// The first difference between what was recorded (`expected`) and what is
// held (`actual`) within `scope`, in `expected`'s parameter order, as a
// sentence naming the parameter and key (or counter); nullopt if they agree.
// A counter absent from either side is not compared. `actual_is` says where
// `actual` comes from ("after the load", "in the files").
std::optional<std::string> FirstFingerprintDifference(const StateFingerprint& expected, const StateFingerprint& actual,
                                                      const FingerprintScope& scope = {},
                                                      const std::string& actual_is = "after the load");

}  // namespace uckpt::ckpt
