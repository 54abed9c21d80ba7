// The files of a DeepSpeed checkpoint tag folder, listed and classified by
// name (ckpt/deepspeed_names.h), and the tag-folder lookup through `latest` /
// `latest_universal`.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "ckpt/deepspeed_names.h"

namespace uckpt::ckpt {

// A folder's top level, listed once (Env::ListDir): its regular files
// classified, sorted by (kind, dp, mp, name), and its sub-folders' names,
// sorted (links followed in both); the names that are links. Throws IoError
// if the folder cannot be read.
struct FolderListing {
  std::vector<CheckpointFile> files;
  std::vector<std::string> dirs;
  std::vector<std::string> links;
};
FolderListing ListFolder(const std::string& folder);

// ListFolder's files alone.
std::vector<CheckpointFile> ListCheckpointFolder(const std::string& folder);

// What kind of checkpoint folder `path` is: universal (has zero/), a ZeRO tag
// folder (holds model-states or optimizer-states files), or neither.
// KindOf is the one place that decides it, from a listing.
enum class FolderKind { kZero, kUniversal, kUnknown };
FolderKind KindOf(const FolderListing& listing);
FolderKind ClassifyTagFolder(const std::string& path);

// The one tag resolver. A tag (what `latest` / `latest_universal` hold, or a
// --checkpoint_tag) must be a plain folder name inside the checkpoint
// directory: not empty, not "." or "..", no '/' and no NUL (so not absolute),
// at most 255 bytes (NAME_MAX). nullopt when it is; else why not ("names
// '../x', which is not a plain folder name in its checkpoint directory
// (it contains '/')").
std::optional<std::string> TagProblem(const std::string& tag);

// Throws FormatError("<source>: <TagProblem>") unless `tag` is a plain folder
// name; returns it. `source` names where the tag came from (a `latest` file,
// "--checkpoint_tag").
const std::string& CheckTag(const std::string& tag, const std::string& source);

// The tag a `latest` / `latest_universal` file names, surrounding whitespace
// stripped as DeepSpeed does; nullopt (and why in `problem`, if given) when it
// cannot be read, is empty, or is not a plain folder name (TagProblem).
std::optional<std::string> ReadTag(const std::string& file, std::string* problem = nullptr);

// The checked tag that `dir`/`name` (e.g. "ckpt", "latest") names; throws
// FormatError naming that file when it cannot be read or does not hold a
// plain folder name. The engine's resume and every command use this.
std::string ReadLatestTag(const std::string& dir, const std::string& name);

// `path` itself if it is a tag folder (holds *_model_states.pt or *_optim_states.pt
// or a zero/ folder); else, if it holds `latest_universal` (preferred when
// `prefer_universal`) or `latest`, the folder that file names. nullopt when
// it is none of these; throws FormatError naming the file when a `latest` /
// `latest_universal` it would follow holds a tag that is not a plain folder
// name (so no command ever reads outside the checkpoint directory).
std::optional<std::string> ResolveTagFolder(const std::string& path, bool prefer_universal = false);

// Removes trailing slashes ("ckpt/step5_universal/" -> "ckpt/step5_universal").
std::string StripTrailingSlashes(std::string path);

}  // namespace uckpt::ckpt
