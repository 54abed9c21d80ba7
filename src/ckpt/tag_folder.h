// A checkpoint tag folder opened once: what every load, check, convert and
// verify decides from the folder's names and its manifest, read with one
// listing of the folder and one read of its manifest (through format/env.h).
// Nothing else of the folder is read here; the openers of its files
// (zero_checkpoint.h, universal_checkpoint.h) and the manifest check work
// from this value instead of listing and reading again.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "ckpt/deepspeed_names.h"
#include "ckpt/fingerprint.h"
#include "ckpt/folder.h"
#include "ckpt/manifest.h"

namespace uckpt::ckpt {

// The layout the file names say: stage 0 (the model states alone), stages
// 1-2 (mp_rank_00_model_states.pt beside rank files; the rank files' headers
// tell 1 from 2 and BF16_Optimizer), stage 3 (a model-states file per rank).
enum class FolderStage { kNone, kStage0, kStage12, kStage3 };

struct TagFolder {
  std::string path;                        // without trailing slashes
  FolderKind kind = FolderKind::kUnknown;  // folder.h
  FolderStage stage = FolderStage::kNone;
  // The ranks that saved it, as its file names count them (rank files, else
  // ZeRO-3's model-states files; 1 for stage 0); the openers check it
  // against what the files record.
  int saved_dp = 0;
  // The regular files at its top level, classified, sorted by (kind, dp, mp, name).
  std::vector<CheckpointFile> files;
  // The model-states files (mp_rank_00_model_states.pt first, then ZeRO-3's
  // by rank) and the optimizer rank files, by rank: views of `files`.
  std::vector<CheckpointFile> model_states;
  std::vector<CheckpointFile> rank_files;
  // Every regular file under it ('/'-separated, relative, sorted, the
  // manifest left out): what a manifest check compares. Only the top level
  // when there is no manifest (nothing to compare).
  std::vector<std::string> tree;
  bool has_manifest = false;
  std::optional<Manifest> manifest;  // parsed; absent when it has none or it cannot be parsed
  std::string manifest_error;        // why it cannot be parsed (names the manifest)
  // The marker beside it (manifest.h): the tag `latest` named before it was
  // published, when it was published before its files were on disk.
  std::optional<std::string> unsynced;

  // The state fingerprint its manifest records, if any.
  std::optional<StateFingerprint> recorded() const;
  // The file named `name` at its top level; null when there is none.
  const CheckpointFile* Find(const std::string& name) const;
};

// Opens `path`: lists it (and, when it has a manifest, its sub-folders) and
// reads its manifest and the marker beside it. Throws IoError if the folder
// cannot be listed; never for what the folder holds (a damaged manifest is
// `manifest_error`, for the check to report).
TagFolder OpenTagFolder(const std::string& path);

// Reads the manifest of `folder` again (after its pages were dropped from
// the page cache, so that the check compares what the disk holds).
void ReadManifestAgain(TagFolder& folder);

// The check of an opened folder against its manifest (CheckFolderAgainstManifest,
// manifest.h), from what the open read: sizes always, hashes with `hashes`
// or an unsynced marker, only share `shard` of `shards`. Throws FormatError
// naming each bad file, and the previous tag for a marked folder.
void CheckFolderAgainstManifest(const TagFolder& folder, bool hashes, int shard = 0, int shards = 1);

}  // namespace uckpt::ckpt
