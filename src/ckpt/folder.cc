#include "ckpt/folder.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

#include "format/env.h"
#include "format/error.h"

namespace uckpt::ckpt {

namespace fs = std::filesystem;

FolderListing ListFolder(const std::string& folder) {
  using Type = Env::DirEntry::Type;
  FolderListing out;
  for (const Env::DirEntry& e : Env::Current().ListDir(folder)) {
    Type type = e.type;
    if (type == Type::kSymlink) {  // what it points to, as a stat would say
      out.links.push_back(e.name);
      std::error_code ec;
      const fs::file_type t = fs::status(folder + "/" + e.name, ec).type();
      type = t == fs::file_type::regular ? Type::kFile : t == fs::file_type::directory ? Type::kDir : Type::kOther;
    }
    if (type == Type::kFile) out.files.push_back(ClassifyFile(folder, e.name));
    if (type == Type::kDir) out.dirs.push_back(e.name);
  }
  std::sort(out.files.begin(), out.files.end(), [](const CheckpointFile& a, const CheckpointFile& b) {
    return std::tie(a.kind, a.dp, a.mp, a.name) < std::tie(b.kind, b.dp, b.mp, b.name);
  });
  std::sort(out.dirs.begin(), out.dirs.end());
  return out;
}

std::vector<CheckpointFile> ListCheckpointFolder(const std::string& folder) { return ListFolder(folder).files; }

std::string StripTrailingSlashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

FolderKind KindOf(const FolderListing& listing) {
  if (std::binary_search(listing.dirs.begin(), listing.dirs.end(), std::string(kUniversalZeroDirName)))
    return FolderKind::kUniversal;
  for (const auto& f : listing.files)
    if (f.kind == FileKind::kModelStates || f.kind == FileKind::kZero3ModelStates || f.kind == FileKind::kOptimStates)
      return FolderKind::kZero;
  return FolderKind::kUnknown;
}

FolderKind ClassifyTagFolder(const std::string& path) { return KindOf(ListFolder(path)); }

std::optional<std::string> TagProblem(const std::string& tag) {
  std::string why;
  if (tag.empty()) why = "it is empty";
  else if (tag == "." || tag == "..") why = "it is '" + tag + "'";
  else if (tag.find('\0') != std::string::npos) why = "it contains a NUL byte";
  else if (tag[0] == '/') why = "it is an absolute path";
  else if (tag.find('/') != std::string::npos) why = "it contains '/'";
  else if (tag.size() > 255) why = "it is " + std::to_string(tag.size()) + " bytes long, more than a file name's 255";
  if (why.empty()) return std::nullopt;
  // Show the tag readably: control bytes (NUL, newlines) escaped, long ones cut.
  std::string shown;
  for (char c : tag.substr(0, 80)) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(c));
      shown += buf;
    } else {
      shown += c;
    }
  }
  if (tag.size() > 80) shown += "...";
  return "names '" + shown + "', which is not a plain folder name in its checkpoint directory (" + why + ")";
}

const std::string& CheckTag(const std::string& tag, const std::string& source) {
  if (auto problem = TagProblem(tag)) throw FormatError(source + ": " + *problem);
  return tag;
}

std::optional<std::string> ReadTag(const std::string& file, std::string* problem) {
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    if (problem) *problem = "cannot be read";
    return std::nullopt;
  }
  // A tag file holds one short name; reading more than a few KiB would only
  // serve a hostile file.
  std::string tag(4096, '\0');
  in.read(tag.data(), static_cast<std::streamsize>(tag.size()));
  tag.resize(static_cast<size_t>(in.gcount()));
  if (in.bad()) {
    if (problem) *problem = "cannot be read";
    return std::nullopt;
  }
  size_t b = tag.find_first_not_of(" \t\r\n"), e = tag.find_last_not_of(" \t\r\n");
  if (b == std::string::npos) {
    if (problem) *problem = "is empty";
    return std::nullopt;
  }
  tag = tag.substr(b, e - b + 1);
  if (auto why = TagProblem(tag)) {
    if (problem) *problem = *why;
    return std::nullopt;
  }
  return tag;
}

std::string ReadLatestTag(const std::string& dir, const std::string& name) {
  const std::string file = dir + "/" + name;
  std::string problem;
  auto tag = ReadTag(file, &problem);
  if (!tag) {
    if (problem == "cannot be read")
      problem = "cannot read the tag file (give the tag explicitly, or check the folder)";
    throw FormatError(file + ": " + problem);
  }
  return *tag;
}

std::optional<std::string> ResolveTagFolder(const std::string& path_in, bool prefer_universal) {
  std::string path = StripTrailingSlashes(path_in);
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return std::nullopt;
  if (ClassifyTagFolder(path) != FolderKind::kUnknown) return path;
  const char* order[2] = {kLatestFile, kLatestUniversalFile};
  if (prefer_universal) std::swap(order[0], order[1]);
  for (const char* name : order) {
    const std::string file = path + "/" + name;
    if (!fs::exists(fs::symlink_status(file, ec))) continue;
    std::string problem;
    auto tag = ReadTag(file, &problem);
    if (!tag) throw FormatError(file + ": " + problem);
    if (fs::is_directory(path + "/" + *tag, ec)) return path + "/" + *tag;
  }
  return std::nullopt;
}

}  // namespace uckpt::ckpt
