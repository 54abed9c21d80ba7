// Checkpoint manifests (docs/manifest-format.md): a file `uckpt-manifest.json`
// in a checkpoint folder that lists every other file of the folder (recursively)
// with its size and XXH64 hash, so that a truncated, corrupted, missing or
// added file is found before training resumes from it.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/fingerprint.h"

namespace uckpt::ckpt {

inline constexpr const char* kManifestName = "uckpt-manifest.json";
inline constexpr const char* kManifestFormat = "uckpt-manifest";
inline constexpr int kManifestVersion = 1;

struct ManifestEntry {
  std::string path;  // relative to the folder, '/'-separated
  uint64_t size = 0;
  uint64_t xxh64 = 0;
};

// Entries sorted by path.
struct Manifest {
  std::vector<ManifestEntry> files;
  // The state fingerprint recorded at save or conversion (ckpt/fingerprint.h);
  // absent in manifests written before it existed, and in none else.
  std::optional<StateFingerprint> state;
};

// Hashes every regular file under `folder` (recursively; not the manifest
// itself, not symlinks) on a few threads and writes `folder/uckpt-manifest.json`
// atomically (temporary name, fsync when `durable`, rename). Call it when every
// file of the folder is complete. Throws IoError / FormatError naming the file.
Manifest WriteManifest(const std::string& folder, bool durable = true);

// The same, taking the sizes and hashes of the files in `known` (relative
// paths, as the copy engine computed them while writing, ckpt/copy_plan.h)
// instead of reading those files again; only other files are hashed. A known
// file whose size on disk differs is an IoError naming it. `state`, if given,
// is recorded as the manifest's "state_fingerprint".
Manifest WriteManifest(const std::string& folder, const std::vector<ManifestEntry>& known, bool durable = true,
                       const StateFingerprint* state = nullptr);

// True if `folder/uckpt-manifest.json` exists.
bool HasManifest(const std::string& folder);

// Parses `folder/uckpt-manifest.json`. Throws FormatError naming the manifest
// if it is not a valid manifest (bad JSON, unknown format or newer version,
// a path that leaves the folder, a duplicate path, a malformed hash or
// state fingerprint).
Manifest ReadManifest(const std::string& folder);

// XXH64 (seed 0) of the whole file, read through a read-only map.
// `progress`, if given, is advanced by the bytes hashed as they are hashed.
// `size`, if given, receives the number of bytes hashed.
uint64_t HashFile(const std::string& path, std::atomic<uint64_t>* progress = nullptr, uint64_t* size = nullptr);

// 16 lower-case hex digits, and back (nullopt-like: returns false if malformed).
std::string HashToHex(uint64_t h);
bool HexToHash(const std::string& hex, uint64_t* h);

struct ManifestProblem {
  std::string file;  // the file's path (folder + "/" + relative path)
  std::string what;  // "missing", "size 10 bytes, the manifest says 12", ...
};

struct ManifestCheck {
  bool present = false;  // the folder has a manifest
  size_t files = 0;      // files listed
  uint64_t bytes = 0;    // their total size per the manifest
  bool hashed = false;   // hashes were compared
  std::vector<ManifestProblem> problems;
  bool ok() const { return problems.empty(); }
};

struct ManifestCheckOptions {
  bool hashes = false;  // also compare XXH64 (reads every byte); sizes are always compared
  int threads = 0;      // hashing threads; 0: min(4, DefaultThreads()) (ckpt/parallel.h)
  // Hash only share `shard` of `shards` (files largest first, dealt round-robin),
  // so that several processes reading one folder split the hashing.
  int shard = 0, shards = 1;
  // Advanced by bytes hashed while hashing (another thread may print it).
  std::atomic<uint64_t>* progress = nullptr;
  // Advanced by the listed files' total size once the manifest is read.
  std::atomic<uint64_t>* progress_total = nullptr;
};

// Checks `folder` against its manifest: every listed file present with the
// listed size (and hash); every regular file not listed is a problem too (a
// manifest describes the folder exactly). Without a manifest: present = false
// and no problems. A manifest that cannot be parsed is one problem naming it.
ManifestCheck CheckManifest(const std::string& folder, const ManifestCheckOptions& options = {});

// CheckManifest's comparison, of the manifest `m` already read and `files`
// already listed (every regular file under `folder`: relative, sorted, the
// manifest left out). Reads only the sizes, and with `options.hashes` the
// bytes, of the files it lists.
ManifestCheck CompareWithManifest(const std::string& folder, const Manifest& m, const std::vector<std::string>& files,
                                  const ManifestCheckOptions& options = {});

// A tag folder published before its files were durable (the engine's
// synchronous save, docs/reliability.md) has this file beside it,
// `<dir>/.<tag>.uckpt-unsynced`, until every rank's files are on disk. It is
// made durable before any of the folder's files is written and holds the tag
// `latest` named before the save. Found by a reader, it means the folder may
// have been cut short by a system crash: its files are checked by hash.
std::string UnsyncedMarkerPath(const std::string& folder);
// The previous tag the marker beside `folder` holds ("" if none was), or
// nullopt when there is no marker.
std::optional<std::string> ReadUnsyncedMarker(const std::string& folder);
// Removes the marker beside `folder` (absent is fine) and makes its removal
// durable (an fsync of the folder's parent). Throws IoError.
void RemoveUnsyncedMarker(const std::string& folder);

// What every checkpoint reader calls before it opens a folder: if the folder
// has a manifest, CheckManifest it (sizes; hashes with `hashes`, only share
// `shard` of `shards`) and throw FormatError naming each bad file; without a
// manifest, do nothing. With an unsynced marker beside the folder the hashes
// are always checked, and a folder without a manifest is refused; the error
// then says so and names the previous tag. (For a folder already opened:
// ckpt/tag_folder.h's, which this one calls.)
void CheckFolderAgainstManifest(const std::string& folder, bool hashes, int shard = 0, int shards = 1);

}  // namespace uckpt::ckpt
