#include "ckpt/tag_folder.h"

#include <algorithm>

#include "format/env.h"
#include "format/error.h"

namespace uckpt::ckpt {

namespace {

// What the file names say of the stage and of the ranks that saved it.
void ClassifyLayout(TagFolder& f) {
  for (const CheckpointFile& c : f.files) {
    if (c.kind == FileKind::kModelStates || c.kind == FileKind::kZero3ModelStates) f.model_states.push_back(c);
    if (c.kind == FileKind::kOptimStates) f.rank_files.push_back(c);
  }
  int zero3 = 0;
  for (const CheckpointFile& c : f.model_states) zero3 += c.kind == FileKind::kZero3ModelStates;
  if (zero3 > 0) {
    f.stage = FolderStage::kStage3;
  } else if (!f.rank_files.empty()) {
    f.stage = FolderStage::kStage12;
  } else if (!f.model_states.empty()) {
    f.stage = FolderStage::kStage0;
  }
  f.saved_dp = !f.rank_files.empty() ? static_cast<int>(f.rank_files.size())
               : zero3 > 0           ? zero3
                                     : !f.model_states.empty();
}

// The tree a manifest check compares, as the manifest's writer lists it
// (links not followed), from the top level listed already.
void ListManifestTree(TagFolder& f, const FolderListing& listing) {
  auto link = [&](const std::string& name) {
    return std::find(listing.links.begin(), listing.links.end(), name) != listing.links.end();
  };
  for (const CheckpointFile& c : f.files)
    if (c.name != kManifestName && !link(c.name)) f.tree.push_back(c.name);
  for (const std::string& dir : listing.dirs)
    if (!link(dir))
      for (const std::string& rel : ListTree(Env::Current(), f.path + "/" + dir)) f.tree.push_back(dir + "/" + rel);
  std::sort(f.tree.begin(), f.tree.end());
}

void ReadManifestOf(TagFolder& f) {
  f.manifest.reset();
  f.manifest_error.clear();
  try {
    f.manifest = ReadManifest(f.path);
  } catch (const std::exception& e) {
    f.manifest_error = e.what();
  }
}

}  // namespace

std::optional<StateFingerprint> TagFolder::recorded() const { return manifest ? manifest->state : std::nullopt; }

const CheckpointFile* TagFolder::Find(const std::string& name) const {
  for (const CheckpointFile& c : files)
    if (c.name == name) return &c;
  return nullptr;
}

TagFolder OpenTagFolder(const std::string& path) {
  TagFolder f;
  f.path = StripTrailingSlashes(path);
  FolderListing listing = ListFolder(f.path);
  f.kind = KindOf(listing);
  f.files = std::move(listing.files);
  ClassifyLayout(f);
  f.has_manifest = f.Find(kManifestName) != nullptr;
  f.unsynced = ReadUnsyncedMarker(f.path);
  if (f.has_manifest) {
    ListManifestTree(f, listing);
    ReadManifestOf(f);
  } else {
    for (const CheckpointFile& c : f.files) f.tree.push_back(c.name);
  }
  return f;
}

void ReadManifestAgain(TagFolder& folder) {
  if (folder.has_manifest) ReadManifestOf(folder);
}

void CheckFolderAgainstManifest(const TagFolder& folder, bool hashes, int shard, int shards) {
  if (shards < 1 || shard < 0 || shard >= shards) throw std::invalid_argument("CheckFolderAgainstManifest: bad shard");
  const std::string& path = folder.path;
  const std::string manifest = path + "/" + kManifestName;
  ManifestCheckOptions options;
  options.hashes = hashes || folder.unsynced;
  options.shard = shard;
  options.shards = shards;
  ManifestCheck check;
  if (folder.manifest) {
    check = CompareWithManifest(path, *folder.manifest, folder.tree, options);
  } else if (folder.has_manifest) {
    check.present = true;
    check.problems.push_back({manifest, folder.manifest_error});
  }
  if (folder.unsynced && !check.present) check.problems.push_back({manifest, "is missing"});
  if (check.ok()) return;  // also without a manifest (DeepSpeed's own folders)
  std::string msg = path + " does not match its manifest (" + kManifestName + "):";
  if (folder.unsynced)
    msg = path + " was published before its files were on disk (" + UnsyncedMarkerPath(path) +
          " is still there) and does not match its manifest (" + kManifestName +
          "): the machine probably stopped before they were written. " +
          (folder.unsynced->empty()
               ? std::string("No checkpoint was published before it.")
               : "The checkpoint published before it is '" + *folder.unsynced + "' (load that tag).") +
          " Problems:";
  size_t shown = 0;
  for (const auto& p : check.problems) {
    if (++shown > 10) {
      msg += "\n  ... and " + std::to_string(check.problems.size() - 10) + " more (run `uckpt verify " + path + "`)";
      break;
    }
    msg += "\n  " + p.file + ": " + p.what;
  }
  throw FormatError(msg);
}

}  // namespace uckpt::ckpt
