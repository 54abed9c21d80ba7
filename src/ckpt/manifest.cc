#include "ckpt/manifest.h"

#include <sys/mman.h>
#include <xxhash.h>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "ckpt/parallel.h"
#include "ckpt/tag_folder.h"
#include "format/env.h"
#include "format/error.h"
#include "format/file.h"

namespace uckpt::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Hash this much at a time, then drop those pages from our page tables so the
// resident set stays small however large the file (the page cache keeps them).
constexpr size_t kHashChunk = 16 << 20;

std::string Join(const std::string& folder, const std::string& rel) { return folder + "/" + rel; }

// Regular files under `folder` (recursive, symlinks not followed), relative
// '/'-separated paths, sorted; without the manifest itself.
std::vector<std::string> ListFiles(const std::string& folder) {
  std::vector<std::string> out = ListTree(Env::Current(), folder);
  std::erase(out, std::string(kManifestName));
  return out;
}

bool SafeRelativePath(const std::string& rel) {
  if (rel.empty() || rel.front() == '/' || rel.find('\0') != std::string::npos) return false;
  std::stringstream ss(rel);
  for (std::string part; std::getline(ss, part, '/');)
    if (part.empty() || part == "." || part == "..") return false;
  return rel.back() != '/';
}

uint64_t FileSize(const std::string& path, std::string* problem) {
  std::error_code ec;
  fs::file_status st = fs::symlink_status(path, ec);
  if (ec || st.type() == fs::file_type::not_found) {
    *problem = "missing";
    return 0;
  }
  if (st.type() != fs::file_type::regular) {
    *problem = "is not a regular file";
    return 0;
  }
  uint64_t n = fs::file_size(path, ec);
  if (ec) *problem = "cannot stat: " + ec.message();
  return n;
}

}  // namespace

std::string HashToHex(uint64_t h) {
  static const char* digits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, h >>= 4) s[static_cast<size_t>(i)] = digits[h & 15];
  return s;
}

bool HexToHash(const std::string& hex, uint64_t* h) {
  if (hex.size() != 16) return false;
  uint64_t v = 0;
  for (char c : hex) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    v = v << 4 | static_cast<uint64_t>(d);
  }
  *h = v;
  return true;
}

uint64_t HashFile(const std::string& path, std::atomic<uint64_t>* progress, uint64_t* size) {
  auto file = MappedFile::Open(path);
  std::span<const uint8_t> bytes = file->bytes();
  if (size) *size = bytes.size();
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> state(XXH64_createState(), &XXH64_freeState);
  if (!state) throw std::bad_alloc();
  XXH64_reset(state.get(), 0);
  if (!bytes.empty()) ::madvise(const_cast<uint8_t*>(bytes.data()), bytes.size(), MADV_SEQUENTIAL);
  for (size_t off = 0; off < bytes.size(); off += kHashChunk) {
    size_t n = std::min(kHashChunk, bytes.size() - off);
    XXH64_update(state.get(), bytes.data() + off, n);
    // Chunks start at multiples of kHashChunk from the page-aligned map.
    ::madvise(const_cast<uint8_t*>(bytes.data() + off), n, MADV_DONTNEED);
    if (progress) *progress += n;
  }
  return XXH64_digest(state.get());
}

Manifest WriteManifest(const std::string& folder, bool durable) { return WriteManifest(folder, {}, durable); }

Manifest WriteManifest(const std::string& folder, const std::vector<ManifestEntry>& known, bool durable,
                       const StateFingerprint* state) {
  std::map<std::string, const ManifestEntry*> given;
  for (const auto& e : known) given[e.path] = &e;
  Manifest m;
  for (auto& rel : ListFiles(folder)) m.files.push_back({std::move(rel), 0, 0});
  std::vector<uint64_t> sizes;
  std::vector<size_t> to_hash;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const std::string path = Join(folder, m.files[i].path);
    std::error_code ec;
    uint64_t size = fs::file_size(path, ec);
    if (ec) throw IoError("cannot stat " + path + ": " + ec.message());
    auto it = given.find(m.files[i].path);
    if (it == given.end()) {
      to_hash.push_back(i);
      sizes.push_back(size);
      continue;
    }
    if (size != it->second->size)
      throw IoError(path + " is " + std::to_string(size) + " bytes on disk, but " + std::to_string(it->second->size) +
                    " bytes were written");
    m.files[i] = *it->second;
  }
  ParallelBySize(sizes, WorkerThreads(0, to_hash.size()), [&](size_t k) {
    ManifestEntry& e = m.files[to_hash[k]];
    // The size of what was hashed, not of the earlier stat: a file still being
    // written would show here as a mismatch later, never as a wrong hash.
    e.xxh64 = HashFile(Join(folder, e.path), nullptr, &e.size);
  });

  json files = json::array();
  for (const auto& e : m.files) files.push_back({{"path", e.path}, {"size", e.size}, {"xxh64", HashToHex(e.xxh64)}});
  json doc = {{"format", kManifestFormat}, {"version", kManifestVersion}, {"hash", "xxh64"}, {"files", files}};
  if (state) {
    doc["state_fingerprint"] = FingerprintToJson(*state);
    m.state = *state;
  }
  std::string text;
  try {
    text = doc.dump(1) + "\n";
  } catch (const json::exception&) {
    throw FormatError(folder + ": a file name is not valid UTF-8; it cannot be listed in " + kManifestName);
  }
  AtomicFile out(Join(folder, kManifestName), durable);
  out.Write(text);
  out.Commit();
  return m;
}

bool HasManifest(const std::string& folder) {
  std::error_code ec;
  return fs::is_regular_file(Join(folder, kManifestName), ec);
}

Manifest ReadManifest(const std::string& folder) {
  const std::string path = Join(folder, kManifestName);
  auto file = MappedFile::Open(path);
  auto bytes = file->bytes();
  json doc = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& what) { return FormatError(path + ": " + what); };
  if (doc.is_discarded()) throw bad("is not valid JSON (damaged manifest)");
  if (!doc.is_object()) throw bad("is not a JSON object");
  if (!doc.contains("format") || doc["format"] != kManifestFormat)
    throw bad(std::string("is not a uckpt manifest (\"format\" is not \"") + kManifestFormat + "\")");
  if (!doc.contains("version") || !doc["version"].is_number_integer()) throw bad("has no integer \"version\"");
  if (doc["version"].get<int64_t>() > kManifestVersion || doc["version"].get<int64_t>() < 1)
    throw bad("has version " + doc["version"].dump() + "; this uckpt reads version " +
              std::to_string(kManifestVersion));
  if (!doc.contains("hash") || doc["hash"] != "xxh64") throw bad("\"hash\" is not \"xxh64\"");
  if (!doc.contains("files") || !doc["files"].is_array()) throw bad("has no \"files\" array");
  Manifest m;
  std::set<std::string> seen;
  for (const auto& f : doc["files"]) {
    if (!f.is_object() || !f.contains("path") || !f["path"].is_string() || !f.contains("size") ||
        !f["size"].is_number_unsigned() || !f.contains("xxh64") || !f["xxh64"].is_string())
      throw bad("entry " + f.dump() + " lacks a string \"path\", an unsigned \"size\" or a string \"xxh64\"");
    ManifestEntry e;
    e.path = f["path"].get<std::string>();
    if (!SafeRelativePath(e.path) || e.path == kManifestName)
      throw bad("lists \"" + e.path + "\", which is not a relative path inside the folder");
    if (!seen.insert(e.path).second) throw bad("lists \"" + e.path + "\" twice");
    e.size = f["size"].get<uint64_t>();
    if (!HexToHash(f["xxh64"].get<std::string>(), &e.xxh64))
      throw bad("the hash of \"" + e.path + "\" is not 16 lower-case hex digits");
    m.files.push_back(std::move(e));
  }
  std::sort(m.files.begin(), m.files.end(), [](const auto& a, const auto& b) { return a.path < b.path; });
  if (doc.contains("state_fingerprint")) m.state = FingerprintFromJson(doc["state_fingerprint"], path);
  return m;
}

ManifestCheck CheckManifest(const std::string& folder, const ManifestCheckOptions& options) {
  ManifestCheck check;
  check.present = HasManifest(folder);
  if (!check.present) return check;
  Manifest m;
  try {
    m = ReadManifest(folder);
  } catch (const std::exception& e) {
    check.problems.push_back({Join(folder, kManifestName), e.what()});
    return check;
  }
  std::vector<std::string> files;
  std::string unlisted;
  try {
    files = ListFiles(folder);
  } catch (const std::exception& e) {
    unlisted = e.what();
  }
  check = CompareWithManifest(folder, m, files, options);
  if (!unlisted.empty()) check.problems.insert(check.problems.begin(), {folder, unlisted});
  return check;
}

ManifestCheck CompareWithManifest(const std::string& folder, const Manifest& m, const std::vector<std::string>& files,
                                  const ManifestCheckOptions& options) {
  ManifestCheck check;
  check.present = true;
  check.files = m.files.size();
  if (options.progress_total)
    for (const auto& e : m.files) *options.progress_total += e.size;
  std::set<std::string> listed;
  std::vector<size_t> to_hash;
  std::vector<uint64_t> hash_sizes;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const ManifestEntry& e = m.files[i];
    listed.insert(e.path);
    check.bytes += e.size;
    const std::string path = Join(folder, e.path);
    std::string problem;
    uint64_t size = FileSize(path, &problem);
    if (problem.empty() && size != e.size)
      problem = "size " + std::to_string(size) + " bytes, the manifest says " + std::to_string(e.size) +
                (size < e.size ? " (truncated)" : "");
    if (!problem.empty()) {
      check.problems.push_back({path, problem});
    } else if (options.hashes) {
      to_hash.push_back(i);
      hash_sizes.push_back(size);
    }
  }
  std::vector<std::string> extra;
  for (const auto& rel : files)
    if (!listed.count(rel)) extra.push_back(rel);
  if (options.hashes && options.shards > 1) {
    // Deal the files, largest first, round-robin; keep this shard's.
    std::vector<size_t> order(to_hash.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return hash_sizes[a] > hash_sizes[b]; });
    std::vector<size_t> mine;
    std::vector<uint64_t> mine_sizes;
    for (size_t j = 0; j < order.size(); ++j) {
      if (static_cast<int>(j % static_cast<size_t>(options.shards)) != options.shard) continue;
      mine.push_back(to_hash[order[j]]);
      mine_sizes.push_back(hash_sizes[order[j]]);
    }
    to_hash = std::move(mine);
    hash_sizes = std::move(mine_sizes);
  }
  if (options.hashes) {
    check.hashed = true;
    std::vector<std::string> results(to_hash.size());  // empty: hash matches
    ParallelBySize(hash_sizes, WorkerThreads(options.threads, to_hash.size()), [&](size_t k) {
      const ManifestEntry& e = m.files[to_hash[k]];
      try {
        uint64_t h = HashFile(Join(folder, e.path), options.progress);
        if (h != e.xxh64)
          results[k] =
              "content differs from the manifest (xxh64 " + HashToHex(h) + ", expected " + HashToHex(e.xxh64) + ")";
      } catch (const std::exception& ex) {
        results[k] = ex.what();
      }
    });
    for (size_t k = 0; k < to_hash.size(); ++k)
      if (!results[k].empty()) check.problems.push_back({Join(folder, m.files[to_hash[k]].path), results[k]});
  }
  for (const auto& rel : extra) check.problems.push_back({Join(folder, rel), "is not listed in the manifest"});
  std::stable_sort(check.problems.begin(), check.problems.end(),
                   [](const auto& a, const auto& b) { return a.file < b.file; });
  return check;
}

std::string UnsyncedMarkerPath(const std::string& folder) {
  fs::path p = fs::path(folder).lexically_normal();  // "a/b/", "a/./b/." -> "a/b"
  if (p.filename().empty()) p = p.parent_path();
  if (p.empty() || p.filename() == "." || p.filename() == "..") p = fs::absolute(p).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return (p.parent_path() / ("." + p.filename().string() + ".uckpt-unsynced")).string();
}

std::optional<std::string> ReadUnsyncedMarker(const std::string& folder) {
  const std::string path = UnsyncedMarkerPath(folder);
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return std::nullopt;
  std::ifstream in(path);
  std::string previous;
  std::getline(in, previous);
  return previous;
}

void RemoveUnsyncedMarker(const std::string& folder) {
  const std::string marker = UnsyncedMarkerPath(folder);
  Env::Current().RemoveAll(marker);
  Env::Current().SyncDir(fs::path(marker).parent_path().string());
}

void CheckFolderAgainstManifest(const std::string& folder, bool hashes, int shard, int shards) {
  CheckFolderAgainstManifest(OpenTagFolder(folder), hashes, shard, shards);
}

}  // namespace uckpt::ckpt
