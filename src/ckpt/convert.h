// ZeRO checkpoint -> universal checkpoint (DeepSpeed's ds_to_universal.py
// output, shared/spec/universal-checkpoint.md), in one pass: each byte of
// every parameter's state is copied once, from the memory-mapped rank files
// into its output file. The output is built in a temporary folder beside the
// target and renamed into place when complete.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ckpt/zero_checkpoint.h"

namespace uckpt::ckpt {

struct ConvertProgress {
  uint64_t bytes_done = 0, bytes_total = 0;  // parameter state bytes
  size_t params_done = 0, params_total = 0;
};

struct ConvertOptions {
  int threads = 0;      // worker threads over output files (ckpt/copy_plan.h); 0: DefaultThreads() (ckpt/parallel.h)
  bool force = false;   // replace an existing output folder
  bool durable = true;  // sync the output to disk before it is renamed into place
  bool write_manifest = true;  // uckpt-manifest.json (ckpt/manifest.h); off only to benchmark its cost
  // A tensor-parallel checkpoint whose universal_checkpoint_info has patterns
  // no parameter matched is refused, as DeepSpeed's converter does unless
  // told --no_strict (false).
  bool strict = true;
  // Called after each parameter (from worker threads, one call at a time).
  std::function<void(const ConvertProgress&)> progress;
  // Called with a one-line notice: a stale temporary folder of an earlier
  // conversion to the same output (its process is gone) was removed.
  std::function<void(const std::string&)> notice;
};

struct ConvertStats {
  size_t params = 0;
  size_t files = 0;
  uint64_t bytes_read = 0;     // parameter state bytes + copied model-states files
  uint64_t bytes_written = 0;  // all output files
};

// Converts the tag folder `input` into the universal folder `output` and
// writes `latest_universal` (the output's folder name) beside `output`.
// Throws FormatError / IoError naming the file; then nothing is left at
// `output` (an existing one is untouched unless the conversion succeeded with
// `force`) and the temporary folder is removed.
ConvertStats ConvertToUniversal(const std::string& input, const std::string& output,
                                const ConvertOptions& options = {});

// The temporary folders `.<name>.uckpt-tmp-<pid>-<n>` beside `output` whose
// process <pid> is no longer running on this machine: left by a conversion
// that was killed (SIGKILL, power loss). ConvertToUniversal removes them.
std::vector<std::string> StaleConvertTemporaries(const std::string& output);

// The same from an already opened checkpoint.
ConvertStats ConvertToUniversal(const ZeroCheckpoint& ckpt, const std::string& output,
                                const ConvertOptions& options = {});

// Rejects parameter names that cannot be folder names ("", ".", "..", "/", NUL):
// a hostile checkpoint must not write outside the output folder.
void CheckParamName(const std::string& name, const std::string& where);

}  // namespace uckpt::ckpt
