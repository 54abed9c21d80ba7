#include "format/torch_file.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "format/error.h"
#include "format/pickle_opcodes.h"
#include "format/pickle_writer.h"
#include "format/zip.h"

namespace uckpt {
namespace {

// A legacy torch.save file starts with a pickle of its magic number: PROTO 2,
// then LONG1 of the 10-byte integer 0x1950a86a20f9469cfc6c.
constexpr uint8_t kLegacyMagic[] = {pickle::kProto, 0x02, pickle::kLong1, 0x0A, 0x6C, 0xFC, 0x9C,
                                    0x46,           0xF9, 0x20,           0x6A, 0xA8, 0x50, 0x19};

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
    if (cls->kind != Kind::kGlobal || key->kind != Kind::kStr || loc->kind != Kind::kStr || numel->kind != Kind::kInt ||
        !numel->big.empty() || numel->i < 0)
      throw FormatError(path + ": malformed persistent id for storage '" + (key->kind == Kind::kStr ? key->s : "?") +
                        "'");
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
    if (options.verify_crc && !zip.CrcMatches(e))
      throw FormatError(path + ": record '" + e.name + "' fails its CRC-32 check");
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
  out.root =
      ReadPickle(zip.Data(*pkl), path + ": " + prefix + "data.pkl", std::ref(loader), options.limits, options.policy);
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

// c10::hash_combine, which torch's writer folds its serialization id with.
uint64_t HashCombine(uint64_t seed, uint64_t value) {
  return seed ^ (value + 0x9e3779b9ull + (seed << 6) + (seed >> 2));
}

// torch's `.data/serialization_id` (caffe2 PyTorchStreamWriter): 20 digits of the
// record names' std::hash folded in the iteration order of the unordered_set torch
// keeps them in, then 20 of the CRC-32s folded in write order. torch takes a CRC from
// every write that starts with a data-descriptor signature: each non-empty record's
// descriptor, and also a record whose own data starts with one. libstdc++ gives the
// same hash and set order as the one torch is built with, so the id is torch's.
}  // namespace

std::string TorchSerializationId(const std::vector<ZipEntry>& records, const std::string& prefix,
                                 const std::vector<std::span<const uint8_t>>& leading) {
  std::unordered_set<std::string> written;
  for (const auto& r : records) written.insert(r.name.substr(prefix.size()));
  uint64_t name_hash = 0, crc_hash = 0;
  for (const auto& n : written) name_hash = HashCombine(name_hash, std::hash<std::string>{}(n));
  for (size_t i = 0; i < records.size(); ++i) {
    const auto& head = leading[i];
    if (head.size() >= 8 && head[0] == 'P' && head[1] == 'K' && head[2] == 7 && head[3] == 8)
      crc_hash = HashCombine(
          crc_hash, uint32_t(head[4]) | uint32_t(head[5]) << 8 | uint32_t(head[6]) << 16 | uint32_t(head[7]) << 24);
    if (records[i].size > 0) crc_hash = HashCombine(crc_hash, records[i].crc32);
  }
  char id[41];
  std::snprintf(id, sizeof id, "%020llu%020llu", static_cast<unsigned long long>(name_hash),
                static_cast<unsigned long long>(crc_hash));
  return std::string(id, 40);
}

namespace {

constexpr uint64_t kStreamBuffer = 64ull << 20;

// The largest streamed storage of `p`.
uint64_t StreamedBytes(const PickledValue& p) {
  uint64_t n = 0;
  for (const auto& st : p.storages)
    if (st->streamed()) n = std::max(n, st->stream_size);
  return n;
}

// The records of torch.save's file of `p`, in torch's order. With `crcs`
// (one per storage), storages are added as kept records with those CRCs.
void WriteTorchRecords(ByteSink& out, const std::string& path, const PickledValue& p, const SaveOptions& options,
                       const std::vector<uint32_t>* crcs) {
  const std::string prefix = ArchiveName(path) + "/";
  ZipWriter zip(out, options.alignment);
  // The first bytes of each record's data, as the serialization id needs them
  // (none for a streamed storage: its bytes pass through a buffer).
  std::vector<std::span<const uint8_t>> leading;
  auto head = [](std::span<const uint8_t> d) { return d.first(std::min<size_t>(d.size(), 8)); };
  auto text = [&](const std::string& name, const std::string& data) {
    zip.AddRecord(name, data);
    leading.push_back({});  // text records never start with a descriptor signature
  };
  zip.AddRecord(prefix + "data.pkl", p.pickle);
  leading.push_back({});  // a pickle starts with PROTO
  text(prefix + ".format_version", "1");
  text(prefix + ".storage_alignment", std::to_string(options.alignment));
  text(prefix + "byteorder", "little");
  std::vector<uint8_t> own_buffer;
  for (size_t k = 0; k < p.storages.size(); ++k) {
    const std::string name = prefix + "data/" + std::to_string(k);
    const Storage& st = *p.storages[k];
    if (st.streamed()) {
      std::span<uint8_t> buffer = options.stream_buffer;
      if (buffer.empty()) {
        if (own_buffer.empty())
          own_buffer.resize(static_cast<size_t>(std::min<uint64_t>(kStreamBuffer, StreamedBytes(p))));
        buffer = own_buffer;
      }
      zip.AddStreamedRecord(name, st.stream_size, st.fill, buffer);
      leading.push_back({});
    } else if (crcs) {
      zip.AddKeptRecord(name, st.bytes, (*crcs)[k]);
      leading.push_back(head(st.bytes));
    } else {
      zip.AddRecord(name, st.bytes);
      leading.push_back(head(st.bytes));
    }
  }
  text(prefix + "version", "3\n");
  zip.AddRecord(prefix + ".data/serialization_id", TorchSerializationId(zip.records(), prefix, leading));
  zip.Finish();
}

// Collects a file's bytes as pieces: kept bytes by reference, the rest
// copied into blocks it owns.
class LayoutSink : public ByteSink {
 public:
  void Write(std::span<const uint8_t> data) override {
    pending_.insert(pending_.end(), data.begin(), data.end());
    offset_ += data.size();
  }
  void WriteKept(std::span<const uint8_t> data) override {
    Seal();
    pieces_.push_back({data, offset_});
    offset_ += data.size();
  }
  uint64_t offset() const override { return offset_; }

  // The pieces, and the blocks they need, once the file is complete.
  std::vector<FilePiece> TakePieces() {
    Seal();
    return std::move(pieces_);
  }
  std::vector<std::vector<uint8_t>>& blocks() { return blocks_; }

 private:
  void Seal() {
    if (pending_.empty()) return;
    // A block is never resized once sealed: the pieces point into it.
    blocks_.push_back(std::move(pending_));
    pending_.clear();
    pieces_.push_back({blocks_.back(), offset_ - blocks_.back().size()});
  }
  std::vector<uint8_t> pending_;
  std::vector<std::vector<uint8_t>> blocks_;  // moved vectors keep their buffers
  std::vector<FilePiece> pieces_;
  uint64_t offset_ = 0;
};

}  // namespace

TorchFileLayout LayOutTorchFile(const std::string& path, const ValuePtr& root, const StorageCrcs& crcs,
                                const SaveOptions& options) {
  struct Kept {
    PickledValue pickled;
    std::vector<std::vector<uint8_t>> blocks;
  };
  auto kept = std::make_shared<Kept>();
  kept->pickled = PickleForTorch(root);
  std::vector<std::span<const uint8_t>> storages;
  for (const auto& st : kept->pickled.storages) {
    if (st->streamed())
      throw std::invalid_argument(path + ": a streamed storage cannot be laid out; write the file front to back");
    storages.push_back(st->bytes);
  }
  const std::vector<uint32_t> storage_crcs = crcs(storages);
  if (storage_crcs.size() != storages.size())
    throw std::logic_error("LayOutTorchFile: " + std::to_string(storage_crcs.size()) + " CRCs for " +
                           std::to_string(storages.size()) + " storages");
  LayoutSink sink;
  WriteTorchRecords(sink, path, kept->pickled, options, &storage_crcs);
  TorchFileLayout layout;
  layout.size = sink.offset();
  layout.pieces = sink.TakePieces();
  kept->blocks = std::move(sink.blocks());
  layout.keep = std::move(kept);
  return layout;
}

void SaveTorchFile(const std::string& path, const ValuePtr& root, const SaveOptions& options) {
  AtomicFile out(path, options.durable);
  SaveTorchFile(out, path, root, options);
  out.Commit();
}

void SaveTorchFile(ByteSink& out, const std::string& path, const ValuePtr& root, const SaveOptions& options) {
  WriteTorchRecords(out, path, PickleForTorch(root), options, nullptr);
}

}  // namespace uckpt
