#include "format/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <set>
#include <stdexcept>

#include "format/error.h"

namespace uckpt {

namespace {

namespace fs = std::filesystem;

constexpr std::pair<std::string_view, DType> kNames[] = {
    {"F32", DType::kFloat32},        {"F64", DType::kFloat64},
    {"F16", DType::kFloat16},        {"BF16", DType::kBFloat16},
    {"I64", DType::kInt64},          {"I32", DType::kInt32},
    {"I16", DType::kInt16},          {"I8", DType::kInt8},
    {"U8", DType::kUInt8},           {"BOOL", DType::kBool},
    {"U16", DType::kUInt16},         {"U32", DType::kUInt32},
    {"U64", DType::kUInt64},         {"F8_E4M3", DType::kFloat8E4M3FN},
    {"F8_E5M2", DType::kFloat8E5M2}, {"C64", DType::kComplex64},
};

[[noreturn]] void Bad(const std::string& path, const std::string& what) {
  throw FormatError(path + ": not a valid safetensors file: " + what);
}

uint64_t ReadLe64(const uint8_t* p) {
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | p[k];
  return n;
}

// The header parsed, refusing repeated top-level keys (JSON parsers keep the last).
nlohmann::json ParseUniqueKeys(const std::string& path, std::string_view text) {
  std::set<std::string> seen;
  auto cb = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && !seen.insert(parsed.get<std::string>()).second)
      Bad(path, "the header names '" + parsed.get<std::string>() + "' twice");
    return true;
  };
  return nlohmann::json::parse(text.begin(), text.end(), cb);
}

int64_t CheckedNumel(const std::string& path, const std::string& name, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) Bad(path, "tensor '" + name + "' has a negative dimension");
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) Bad(path, "tensor '" + name + "' is too large");
    n *= d;
  }
  return n;
}

SafetensorsTensor ParseEntry(const std::string& path, const std::string& name, const nlohmann::json& info,
                             uint64_t data_start) {
  const std::string where = "tensor '" + name + "'";
  if (!info.is_object()) Bad(path, where + " is not a JSON object");
  auto field = [&](const char* key) -> const nlohmann::json& {
    auto it = info.find(key);
    if (it == info.end()) Bad(path, where + " has no \"" + key + "\"");
    return *it;
  };
  SafetensorsTensor t;
  t.name = name;
  const nlohmann::json& dtype = field("dtype");
  if (!dtype.is_string()) Bad(path, where + ": \"dtype\" is not a string");
  auto d = SafetensorsDTypeFromName(dtype.get<std::string>());
  if (!d) Bad(path, where + " has dtype '" + dtype.get<std::string>() + "', which uckpt does not read");
  t.dtype = *d;
  const nlohmann::json& shape = field("shape");
  if (!shape.is_array()) Bad(path, where + ": \"shape\" is not a list");
  for (const auto& dim : shape) {
    if (!dim.is_number_integer()) Bad(path, where + ": \"shape\" holds a non-integer");
    if (dim.is_number_unsigned() && dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      Bad(path, where + " is too large");
    t.shape.push_back(dim.get<int64_t>());
  }
  t.numel = CheckedNumel(path, name, t.shape);
  const nlohmann::json& off = field("data_offsets");
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    Bad(path, where + ": \"data_offsets\" is not a pair of non-negative integers");
  const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
  if (b > e)
    Bad(path,
        where + " has data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + "] that end before they begin");
  const uint64_t size = DTypeSize(t.dtype);
  if (static_cast<uint64_t>(t.numel) > std::numeric_limits<uint64_t>::max() / size ||
      e - b != static_cast<uint64_t>(t.numel) * size)
    Bad(path, where + " spans " + std::to_string(e - b) + " bytes, its shape and dtype need " +
                  std::to_string(static_cast<uint64_t>(t.numel) * size));
  if (e > std::numeric_limits<uint64_t>::max() - data_start) Bad(path, where + " lies past the file's end");
  t.begin = data_start + b;
  t.end = data_start + e;
  return t;
}

std::map<std::string, std::string> ParseMetadata(const std::string& path, const nlohmann::json& meta) {
  if (!meta.is_object()) Bad(path, "\"__metadata__\" is not a JSON object");
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : meta.items()) {
    if (!v.is_string()) Bad(path, "\"__metadata__\" value of '" + k + "' is not a string");
    out[k] = v.get<std::string>();
  }
  return out;
}

}  // namespace

std::optional<DType> SafetensorsDTypeFromName(std::string_view name) {
  for (const auto& [n, d] : kNames)
    if (n == name) return d;
  return std::nullopt;
}

std::string SafetensorsDTypeName(DType d) {
  for (const auto& [n, dt] : kNames)
    if (dt == d) return std::string(n);
  throw FormatError("safetensors has no dtype for " + std::string(DTypeName(d)));
}

SafetensorsFile SafetensorsFile::Open(const std::string& path) { return Parse(MappedFile::Open(path)); }

SafetensorsFile SafetensorsFile::Parse(std::shared_ptr<const MappedFile> file) {
  const std::string& path = file->path();
  const std::span<const uint8_t> b = file->bytes();
  if (b.size() < 8) Bad(path, "shorter (" + std::to_string(b.size()) + " bytes) than its 8-byte header length");
  const uint64_t n = ReadLe64(b.data());
  if (n > kSafetensorsMaxHeader) Bad(path, "header length " + std::to_string(n) + " is over safetensors' limit");
  if (n > b.size() - 8) Bad(path, "header length " + std::to_string(n) + " runs past the file's end");
  if (n < 2 || b[8] != '{') Bad(path, "the header is not a JSON object");
  const std::string_view text(reinterpret_cast<const char*>(b.data() + 8), n);
  nlohmann::json header;
  try {
    header = ParseUniqueKeys(path, text);  // trailing spaces (alignment padding) are whitespace
  } catch (const nlohmann::json::exception& e) {
    Bad(path, std::string("the header is not JSON: ") + e.what());
  }
  if (!header.is_object()) Bad(path, "the header is not a JSON object");
  SafetensorsFile out;
  out.file_ = std::move(file);
  const uint64_t data_start = 8 + n;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      out.metadata_ = ParseMetadata(path, info);
      continue;
    }
    out.tensors_.push_back(ParseEntry(path, name, info, data_start));
  }
  // The tensors tile the data exactly: no gap, no overlap, nothing past the end.
  std::stable_sort(out.tensors_.begin(), out.tensors_.end(),
                   [](const auto& x, const auto& y) { return x.begin != y.begin ? x.begin < y.begin : x.end < y.end; });
  uint64_t at = data_start;
  for (const SafetensorsTensor& t : out.tensors_) {
    if (t.begin < at) Bad(path, "tensor '" + t.name + "' overlaps the tensor before it");
    if (t.begin > at)
      Bad(path, "a gap of " + std::to_string(t.begin - at) + " bytes lies before tensor '" + t.name + "'");
    if (t.end > b.size()) Bad(path, "tensor '" + t.name + "' runs past the file's end (the file is cut short?)");
    at = t.end;
  }
  if (at != b.size()) Bad(path, std::to_string(b.size() - at) + " bytes follow the last tensor");
  for (size_t i = 0; i < out.tensors_.size(); ++i) out.index_[out.tensors_[i].name] = i;
  return out;
}

const SafetensorsTensor* SafetensorsFile::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> SafetensorsFile::Elements(const SafetensorsTensor& t, int64_t first, int64_t count) const {
  if (first < 0 || count < 0 || first > t.numel || count > t.numel - first)
    throw std::out_of_range(path() + ": elements [" + std::to_string(first) + ", " + std::to_string(first + count) +
                            ") of tensor '" + t.name + "' (" + std::to_string(t.numel) + " elements)");
  const uint64_t size = DTypeSize(t.dtype);
  return file_->bytes().subspan(t.begin + static_cast<uint64_t>(first) * size, static_cast<uint64_t>(count) * size);
}

SafetensorsIndex ReadSafetensorsIndex(const std::string& path) {
  auto file = MappedFile::Open(path);
  const auto b = file->bytes();
  auto bad = [&](const std::string& what) -> void { throw FormatError(path + ": not a safetensors index: " + what); };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(b.begin(), b.end());
  } catch (const nlohmann::json::exception& e) {
    bad(std::string("not JSON: ") + e.what());
  }
  if (!j.is_object()) bad("not a JSON object");
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object()) bad("no \"weight_map\" object");
  SafetensorsIndex out;
  out.path = path;
  const fs::path folder = fs::path(path).parent_path();
  std::set<std::string> files;
  for (const auto& [name, f] : wm->items()) {
    if (!f.is_string()) bad("the weight_map entry of '" + name + "' is not a file name");
    const fs::path listed(f.get<std::string>());
    if (listed.empty() || listed.is_absolute())
      bad("'" + name + "' is in '" + listed.string() + "', not a file beside the index");
    for (const auto& part : listed)
      if (part == "..") bad("'" + name + "' is in '" + listed.string() + "', outside the index's folder");
    const std::string resolved = (folder / listed).string();
    out.weight_map[name] = resolved;
    files.insert(resolved);
  }
  out.files.assign(files.begin(), files.end());
  return out;
}

SafetensorsSource SafetensorsSource::Open(const std::string& path) {
  std::string target = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path index = fs::path(path) / "model.safetensors.index.json";
    const fs::path single = fs::path(path) / "model.safetensors";
    if (fs::exists(index, ec)) target = index.string();
    else if (fs::exists(single, ec)) target = single.string();
    else throw FormatError(path + ": a folder without model.safetensors.index.json or model.safetensors");
  }
  SafetensorsSource s;
  s.path_ = target;
  if (!target.ends_with(".json")) {
    s.files_.push_back(SafetensorsFile::Open(target));
    for (const SafetensorsTensor& t : s.files_[0].tensors()) s.tensors_[t.name] = {0, &t};
    return s;
  }
  const SafetensorsIndex index = ReadSafetensorsIndex(target);
  std::map<std::string, size_t> file_of;
  s.files_.reserve(index.files.size());  // the tensors_ pointers stay valid
  for (const std::string& f : index.files) {
    file_of[f] = s.files_.size();
    s.files_.push_back(SafetensorsFile::Open(f));
  }
  for (const auto& [name, f] : index.weight_map) {
    const size_t k = file_of.at(f);
    const SafetensorsTensor* t = s.files_[k].Find(name);
    if (!t) throw FormatError(target + ": lists tensor '" + name + "' in " + f + ", which does not hold it");
    s.tensors_[name] = {k, t};
  }
  return s;
}

SafetensorsSource::Found SafetensorsSource::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return {};
  return {&files_[it->second.first], it->second.second};
}

std::vector<std::string> SafetensorsSource::names() const {
  std::vector<std::string> out;
  for (const auto& [name, where] : tensors_) out.push_back(name);
  return out;
}

// The header padded with spaces so the data starts 8-byte aligned, as
// safetensors' own writer pads it.
SafetensorsWriter::Header SafetensorsWriter::MakeHeader(const std::string& path, const std::vector<Entry>& entries,
                                                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& e : entries) {
    if (e.name == "__metadata__") throw FormatError(path + ": '__metadata__' cannot name a tensor");
    if (header.contains(e.name)) throw FormatError(path + ": tensor '" + e.name + "' is written twice");
    const int64_t numel = CheckedNumel(path, e.name, e.shape);
    const uint64_t n = static_cast<uint64_t>(numel) * DTypeSize(e.dtype);
    header[e.name] = {
        {"dtype", SafetensorsDTypeName(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  Header h;
  try {
    h.text = header.dump();
  } catch (const nlohmann::json::type_error&) {
    throw FormatError(path + ": a tensor name or metadata value is not valid UTF-8");
  }
  h.text.append((8 - h.text.size() % 8) % 8, ' ');
  h.file_size = 8 + h.text.size() + offset;
  return h;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<Entry> entries,
                                     const std::map<std::string, std::string>& metadata, bool durable)
    : header_(MakeHeader(path, entries, metadata)), out_(std::move(path), durable) {
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(header_.text.size()) >> (8 * i));
  out_.Write(std::span<const uint8_t>(len, 8));
  out_.Write(header_.text);
}

void SafetensorsWriter::Write(std::span<const uint8_t> bytes) {
  if (bytes.size() > header_.file_size - out_.offset())
    throw std::logic_error(out_.path() + ": more tensor bytes written than the header announced");
  out_.Write(bytes);
}

void SafetensorsWriter::Commit() {
  if (out_.offset() != header_.file_size)
    throw std::logic_error(out_.path() + ": " + std::to_string(header_.file_size - out_.offset()) +
                           " bytes of tensor data were not written");
  out_.Commit();
}

}  // namespace uckpt
