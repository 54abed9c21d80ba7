#include "format/torch_file.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <unordered_map>

#include "format/error.h"
#include "format/pickle_opcodes.h"
#include "format/pickle_writer.h"
#include "format/zip.h"

namespace uckpt {
namespace {

// A legacy torch.save file starts with a pickle of its magic number: PROTO 2,
// then LONG1 of the 10-byte integer 0x1950a86a20f9469cfc6c.
constexpr uint8_t kLegacyMagic[] = {pickle::kProto, 0x02, pickle::kLong1, 0x0A,
                                    0x6C, 0xFC, 0x9C, 0x46, 0xF9, 0x20, 0x6A, 0xA8, 0x50, 0x19};

void CheckKind(const MappedFile& f) {
  auto b = f.bytes();
  auto starts = [&](const void* magic, size_t n) { return b.size() >= n && std::memcmp(b.data(), magic, n) == 0; };
  if (starts(kLegacyMagic, sizeof kLegacyMagic))
    throw FormatError(f.path() +
                      ": legacy torch.save format (PyTorch < 1.6 or _use_new_zipfile_serialization=False) is not "
                      "supported; load it in PyTorch and save it again with a current torch.save");
  if (starts("PYTORCH1", 8)) throw FormatError(f.path() + ": pre-release TorchScript container, not a torch.save file");
  if (b.size() >= 262 && std::memcmp(b.data() + 257, "ustar", 5) == 0)
    throw FormatError(f.path() + ": tar archive (torch.save of PyTorch <= 0.3) is not supported");
  if (!starts("PK\x03\x04", 4)) throw FormatError(f.path() + ": not a torch.save file (no zip signature at the start)");
}

// Loads storages named by persistent ids, once per key.
class StorageLoader {
 public:
  StorageLoader(const ZipReader& zip, std::string prefix, bool big_endian)
      : zip_(zip), prefix_(std::move(prefix)), big_endian_(big_endian) {}

  ValuePtr operator()(const ValuePtr& pid) {
    const std::string& path = zip_.file()->path();
    if (pid->kind != Kind::kTuple || pid->items.size() != 5 || pid->items[0]->kind != Kind::kStr ||
        pid->items[0]->s != "storage")
      throw FormatError(path + ": persistent id is not a ('storage', class, key, location, numel) tuple");
    const auto& cls = pid->items[1];
    const auto& key = pid->items[2];
    const auto& loc = pid->items[3];
    const auto& numel = pid->items[4];
    if (cls->kind != Kind::kGlobal || key->kind != Kind::kStr || loc->kind != Kind::kStr ||
        numel->kind != Kind::kInt || !numel->big.empty() || numel->i < 0)
      throw FormatError(path + ": malformed persistent id for storage '" + (key->kind == Kind::kStr ? key->s : "?") + "'");
    std::string cls_path = cls->s;
    if (cls_path == "torch.UntypedStorage") cls_path = "torch.storage.UntypedStorage";
    size_t elem = 1;
    std::optional<DType> dtype;
    if (cls_path != "torch.storage.UntypedStorage") {
      if (cls->module() != "torch" || !(dtype = DTypeFromStorageClass(cls->name())))
        throw FormatError(path + ": storage '" + key->s + "' has unknown storage class " + cls->s);
      elem = DTypeSize(*dtype);
    }
    auto it = cache_.find(key->s);
    if (it != cache_.end()) {
      if (it->second->storage->storage_class != cls_path)
        throw FormatError(path + ": storage '" + key->s + "' is used as both " + it->second->storage->storage_class +
                          " and " + cls_path);
      return it->second;
    }
    const std::string record = prefix_ + "data/" + key->s;
    const ZipEntry* e = zip_.Find(record);
    if (!e) throw FormatError(path + ": record '" + record + "' is missing");
    const unsigned __int128 want = static_cast<unsigned __int128>(static_cast<uint64_t>(numel->i)) * elem;
    if (want != e->size)
      throw FormatError(path + ": record '" + record + "' has " + std::to_string(e->size) + " bytes but its storage (" +
                        cls_path + ", " + std::to_string(numel->i) + " elements) needs " +
                        std::to_string(static_cast<uint64_t>(want)));
    auto s = std::make_shared<Storage>();
    s->key = key->s;
    s->storage_class = cls_path;
    s->location = loc->s;
    s->numel = numel->i;
    if (big_endian_ && elem > 1) {
      auto data = zip_.Data(*e);
      auto copy = std::make_shared<std::vector<uint8_t>>(data.begin(), data.end());
      for (size_t k = 0; k + elem <= copy->size(); k += elem) std::reverse(copy->begin() + k, copy->begin() + k + elem);
      s->bytes = *copy;
      s->owner = copy;
    } else if (big_endian_ && !dtype) {
      throw FormatError(path + ": big-endian file with an untyped storage; its element size is unknown");
    } else {
      s->bytes = zip_.Data(*e);
      s->owner = zip_.file();
    }
    auto v = std::make_shared<Value>();
    v->kind = Kind::kStorage;
    v->storage = std::move(s);
    cache_.emplace(key->s, v);
    return v;
  }

 private:
  const ZipReader& zip_;
  std::string prefix_;
  bool big_endian_;
  std::unordered_map<std::string, ValuePtr> cache_;
};

std::string RecordText(const ZipReader& zip, const ZipEntry* e) {
  if (!e) return {};
  auto d = zip.Data(*e);
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

}  // namespace

TorchFile LoadTorchFile(const std::string& path, const LoadOptions& options) {
  return LoadTorchFile(MappedFile::Open(path), options);
}

TorchFile LoadTorchFile(std::shared_ptr<const MappedFile> file, const LoadOptions& options) {
  CheckKind(*file);
  ZipReader zip(file);
  const std::string& path = file->path();
  if (zip.entries().empty()) throw FormatError(path + ": zip archive has no records");
  const std::string& first = zip.entries().front().name;
  size_t slash = first.find('/');
  if (slash == std::string::npos) throw FormatError(path + ": record '" + first + "' is not inside a folder");
  std::string prefix = first.substr(0, slash + 1);
  for (const auto& e : zip.entries()) {
    if (e.name.compare(0, prefix.size(), prefix) != 0)
      throw FormatError(path + ": record '" + e.name + "' is outside the archive folder '" + prefix + "'");
    if (options.verify_crc && !zip.CrcMatches(e)) throw FormatError(path + ": record '" + e.name + "' fails its CRC-32 check");
  }
  if (zip.Find(prefix + "constants.pkl") || zip.Find(prefix + "code/"))
    throw FormatError(path + ": this is a TorchScript archive (torch.jit.save), not a torch.save file");
  const ZipEntry* pkl = zip.Find(prefix + "data.pkl");
  if (!pkl) throw FormatError(path + ": record '" + prefix + "data.pkl' is missing");
  std::string order = RecordText(zip, zip.Find(prefix + "byteorder"));
  if (!order.empty() && order != "little" && order != "big")
    throw FormatError(path + ": record '" + prefix + "byteorder' holds '" + order + "', not 'little' or 'big'");

  StorageLoader loader(zip, prefix, order == "big");
  TorchFile out;
  out.file = file;
  out.archive = prefix.substr(0, prefix.size() - 1);
  out.root = ReadPickle(zip.Data(*pkl), path + ": " + prefix + "data.pkl", std::ref(loader), options.limits, options.policy);
  return out;
}

namespace {

std::string ArchiveName(const std::string& path) {
  std::string base = std::filesystem::path(path).filename().string();
  for (unsigned char c : path)
    if (c >= 0x80) return "archive";
  size_t dot = base.rfind('.');
  return dot == std::string::npos ? base : base.substr(0, dot);
}

uint64_t Fnv1a(const std::string& s, uint64_t h = 0xcbf29ce484222325ull) {
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace

void SaveTorchFile(const std::string& path, const ValuePtr& root, const SaveOptions& options) {
  AtomicFile out(path, options.durable);
  SaveTorchFile(out, path, root, options);
  out.Commit();
}

void SaveTorchFile(ByteSink& out, const std::string& path, const ValuePtr& root, const SaveOptions& options) {
  PickledValue p = PickleForTorch(root);
  const std::string prefix = ArchiveName(path) + "/";
  ZipWriter zip(out, options.alignment);
  zip.AddRecord(prefix + "data.pkl", p.pickle);
  zip.AddRecord(prefix + ".format_version", std::string("1"));
  zip.AddRecord(prefix + ".storage_alignment", std::to_string(options.alignment));
  zip.AddRecord(prefix + "byteorder", std::string("little"));
  for (size_t k = 0; k < p.storages.size(); ++k) zip.AddRecord(prefix + "data/" + std::to_string(k), p.storages[k]->bytes);
  zip.AddRecord(prefix + "version", std::string("3\n"));
  // 40 digits as torch writes: a hash of the record names, then one of their CRCs.
  uint64_t names = 0xcbf29ce484222325ull, crcs = 0xcbf29ce484222325ull;
  for (const auto& r : zip.records()) {
    names = Fnv1a(r.name, names);
    crcs = Fnv1a(std::to_string(r.crc32), crcs);
  }
  char id[41];
  std::snprintf(id, sizeof id, "%020llu%020llu", static_cast<unsigned long long>(names),
                static_cast<unsigned long long>(crcs));
  zip.AddRecord(prefix + ".data/serialization_id", std::string(id, 40));
  zip.Finish();
}

}  // namespace uckpt
