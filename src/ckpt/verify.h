// `uckpt verify`: is a checkpoint intact? A folder with a manifest is compared
// with it (every listed file present, same size, same XXH64; nothing extra).
// Every folder, with or without a manifest (DeepSpeed's own folders have none),
// is also checked for structure: every expected file exists and parses (with
// its records' CRC-32s when `hashes`), and every expected tensor is present
// with the right number of elements. docs/manifest-format.md says what is
// checked where.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/folder.h"
#include "ckpt/manifest.h"

namespace uckpt::ckpt {

const char* FolderKindName(FolderKind k);  // "zero", "universal", "unknown"

struct FolderVerdict {
  std::string folder;
  FolderKind kind = FolderKind::kUnknown;
  bool manifest = false;                  // had a manifest
  size_t files = 0;                       // files checked (listed in the manifest, or parsed)
  uint64_t bytes = 0;                     // their total size
  std::vector<ManifestProblem> problems;  // one per bad file (or folder)
};

struct VerifyReport {
  std::string path;    // what was asked for
  bool hashes = true;  // contents were read (XXH64 / CRC-32), not only sizes
  std::vector<FolderVerdict> folders;
  std::vector<ManifestProblem> problems;  // about the root itself: `latest` naming nothing, ...
  std::vector<std::string> notes;         // worth saying, not wrong (skipped temporary folders)
  size_t problem_count() const;
  bool ok() const { return problem_count() == 0; }
};

struct VerifyProgress {
  std::atomic<uint64_t> bytes_done{0}, bytes_total{0};  // manifest bytes hashed / to hash
  std::atomic<size_t> folders_done{0}, folders_total{0};
};

struct VerifyOptions {
  bool hashes = true;  // false: sizes and structure only (no file is read whole)
  int threads = 0;     // hashing threads; 0: min(4, DefaultThreads()) (ckpt/parallel.h)
  VerifyProgress* progress = nullptr;
};

// `path` may be
//   - a tag folder (ZeRO: *_model_states.pt / *_optim_states.pt) or a
//     universal folder (zero/): that folder is verified;
//   - a checkpoint root (holds `latest` and/or `latest_universal`, or tag
//     folders): every tag and universal folder directly inside is verified,
//     and `latest` / `latest_universal` must name one of them. Folders whose
//     names start with '.' (temporaries of an interrupted save) are skipped
//     and noted.
// Throws IoError/FormatError only when `path` is none of these; every problem
// found inside a checkpoint is reported, not thrown.
VerifyReport VerifyCheckpoint(const std::string& path, const VerifyOptions& options = {});

}  // namespace uckpt::ckpt
