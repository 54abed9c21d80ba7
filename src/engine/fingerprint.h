// The resume proof on the engine's side (ckpt/fingerprint.h defines the
// state fingerprint): what the engine holds, hashed where it lies (each rank
// its own partitions, one reduction), recorded at every save and checked
// after every load.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/fingerprint.h"
#include "engine/module_tensors.h"
#include "engine/resharded_load.h"
#include "engine/sharded_runtime.h"
#include "engine/staged_upload.h"
#include "uckpt/comm.h"
#include "uckpt/engine.h"

namespace uckpt::engine {

// The fingerprint sum of a 1-D fp32 tensor whose element 0 is the tensor's
// element `start`: ckpt::FingerprintBits over a CPU tensor's memory on the
// intra-op threads; on a CUDA device one kernel (fingerprint_kernel.h) where
// it was built, else the same arithmetic in int64 tensor ops.
uint64_t FingerprintTensor(const at::Tensor& t, uint64_t seed, int64_t start);
// The tensor-op version on any device (what a GPU runs; tests compare it
// with the host function on the CPU).
uint64_t FingerprintTensorOps(const at::Tensor& t, uint64_t seed, int64_t start);

// Collective: adds every rank's `sums` (wrapping, as uint64), in place.
void AllReduceWrapping(Comm& comm, std::vector<uint64_t>& sums);

// Collective: the fingerprint of the trainable parameters' fp32 masters and
// Adam state and of the counters this engine holds now.
// What the fingerprint reads of the engine: the runtime's partition slots
// and loss scale, the communicator and the counters.
struct FingerprintInputs {
  ShardedRuntime& runtime;
  Comm& comm;
  const StepCounters& counters;
};

ckpt::StateFingerprint EngineStateFingerprint(const FingerprintInputs& in);

// The same in two halves, so that a save hashes while it writes. The
// constructor (no collective) hashes this rank's device state at once and
// starts its host state on a thread of its own; Finish (collective) waits for
// it and adds up the ranks' sums. The state must not change in between.
class PendingStateFingerprint {
 public:
  explicit PendingStateFingerprint(const FingerprintInputs& in);
  ~PendingStateFingerprint();  // waits for the thread
  PendingStateFingerprint(const PendingStateFingerprint&) = delete;
  PendingStateFingerprint& operator=(const PendingStateFingerprint&) = delete;
  ckpt::StateFingerprint Finish(Comm& comm);
  double hash_seconds() const { return hash_s_; }  // this rank's hashing, start to end (after Finish)

 private:
  ckpt::StateFingerprint f_;
  std::vector<uint64_t> sums_;
  std::thread thread_;
  std::string error_;
  double hash_s_ = 0;
};

// The check of one load (StartStateFingerprintCheck .. FinishStateFingerprintCheck).
struct FingerprintCheck {
  std::string folder;
  const ckpt::TagFolder* opened = nullptr;  // the folder as the load opened it (outlives the check)
  bool universal = false;
  std::optional<ckpt::StateFingerprint> recorded;  // the manifest's
  // A folder without a record (DeepSpeed's), after HashLoadedState: what its
  // files hold (their parameters, tensors and counters; no value: a folder
  // it cannot say, stage 0's) and this rank's share of the sums.
  std::optional<ckpt::StateFingerprint> files;
  std::vector<ckpt::SourceFingerprintIndex::State> loaded_states;
  std::vector<uint64_t> loaded_sums;
  std::string error;
  bool hashed = false;
  double start_s = 0;  // the time Start took on the load's thread
  double hash_s = 0;   // and HashLoadedState
};

// Before a load of `folder` (as opened, ckpt/tag_folder.h; it must outlive
// the check) reads any state: the fingerprint its manifest recorded, if any.
// No collective, no I/O.
FingerprintCheck StartStateFingerprintCheck(const ckpt::TagFolder& folder, const LoadCheckpointOptions& o);

// Right after the load filled this rank's partitions (`loads`, from
// `source`), for a checkpoint without a record: what the source's files
// cover (from the files the load opened), and the bytes read hashed where
// they landed, each piece placed by the files' own layout of `source`
// (ckpt::SourceFingerprintIndex), not by the partitions the load planned: a
// piece put in the wrong place, twice, or not at all shows as a difference,
// and nothing is read from the files a second time. No collective.
void HashLoadedState(const FingerprintInputs& in, FingerprintCheck& check, const LoadSource& source,
                     const std::vector<TensorReads>& loads);

// Collective, after the load: the expected fingerprint (the record, or the
// files' layout with the loaded shares reduced over the ranks) compared with what the engine now
// holds, within what `o` loaded. Throws FormatError on every rank, naming the
// first parameter and state (or counter) that differs. Records what it did
// in `stats`. fp32_training: stage 1/2 masters are compared after a partial load too.
void FinishStateFingerprintCheck(const FingerprintInputs& in, bool fp32_training, FingerprintCheck& check,
                                 const LoadCheckpointOptions& o, LoadStats& stats);

}  // namespace uckpt::engine
