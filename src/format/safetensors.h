// safetensors files (Hugging Face's format): an 8-byte little-endian header
// length N, N bytes of JSON ({name: {"dtype", "shape", "data_offsets"}, and an
// optional "__metadata__" of string values}), then the tensors' bytes,
// row-major, little-endian, tiling the rest of the file exactly. And the
// sharded layout's `model.safetensors.index.json` ({"weight_map": {tensor:
// file}}), whose files lie beside it.
//
// Reading maps the file (through Env::Current()) and checks the whole header
// before anything is returned: a caller then reads any element range of one
// tensor as a span of the map, so only the pages it touches are read.
// Writing streams tensors one after another behind a header written first
// (the shapes are known up front), through AtomicFile: the file appears
// under its name only once complete.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "format/dtype.h"
#include "format/file.h"

namespace uckpt {

// safetensors' dtype names ("F32", "BF16", ...) and uckpt's dtypes.
std::optional<DType> SafetensorsDTypeFromName(std::string_view name);
// Throws FormatError for a dtype safetensors has no name for.
std::string SafetensorsDTypeName(DType d);

// The most header bytes accepted (safetensors' own limit).
constexpr uint64_t kSafetensorsMaxHeader = 100'000'000;

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t begin = 0, end = 0;  // byte range in the file (data_offsets past the header)
};

class SafetensorsFile {
 public:
  // Maps `path` through Env::Current() and checks its header. Throws IoError
  // naming the file when it cannot be read, FormatError naming the file (and
  // the tensor) when it is not a valid safetensors file.
  static SafetensorsFile Open(const std::string& path);
  // The same over bytes already mapped (tests, fuzzers).
  static SafetensorsFile Parse(std::shared_ptr<const MappedFile> file);

  const std::string& path() const { return file_->path(); }
  // In the order their bytes lie in the file.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The bytes of elements [first, first + count) of `t` flattened: a view
  // into the map, valid while this object (or a copy) lives. Throws
  // std::out_of_range naming the file and tensor for a range past its end.
  std::span<const uint8_t> Elements(const SafetensorsTensor& t, int64_t first, int64_t count) const;

 private:
  std::shared_ptr<const MappedFile> file_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A `model.safetensors.index.json`: which file holds each tensor.
struct SafetensorsIndex {
  std::string path;
  // Tensor name -> file path (the index's folder joined with the listed name).
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> files;  // each listed file once, in name order
};

// Reads an index through Env::Current(). Throws FormatError naming it for a
// file that is not a JSON object with a "weight_map" object of string values,
// or that lists an absolute file name or one with "..".
SafetensorsIndex ReadSafetensorsIndex(const std::string& path);

// Weights to load: one safetensors file, or the files of an index, each
// tensor found by name.
class SafetensorsSource {
 public:
  // `path`: a .safetensors file, an index (a name ending in ".json"), or a
  // folder holding model.safetensors.index.json or model.safetensors. Every
  // file is opened and checked; a tensor the index lists must be in its file.
  static SafetensorsSource Open(const std::string& path);
  // Movable, not copyable: the name table points into the files.
  SafetensorsSource(SafetensorsSource&&) = default;
  SafetensorsSource& operator=(SafetensorsSource&&) = default;
  SafetensorsSource(const SafetensorsSource&) = delete;
  SafetensorsSource& operator=(const SafetensorsSource&) = delete;

  struct Found {
    const SafetensorsFile* file = nullptr;
    const SafetensorsTensor* tensor = nullptr;
  };
  // Null members when the source has no such tensor.
  Found Find(const std::string& name) const;
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  const std::string& path() const { return path_; }  // what was opened, for messages

 private:
  SafetensorsSource() = default;
  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::pair<size_t, const SafetensorsTensor*>> tensors_;
};

// Writes a safetensors file of the tensors `entries` in that order: the
// header at construction, then each tensor's bytes (Write, in any pieces),
// then Commit, which renames the temporary file into place. Destroying an
// uncommitted writer removes the temporary file.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    DType dtype = DType::kFloat32;
    std::vector<int64_t> shape;
  };
  // Throws FormatError for a repeated name, "__metadata__" as a tensor name,
  // a negative dimension, or a dtype safetensors cannot name.
  SafetensorsWriter(std::string path, std::vector<Entry> entries,
                    const std::map<std::string, std::string>& metadata = {}, bool durable = true);
  // The next bytes of the tensors, in order. Throws std::logic_error past the last one.
  void Write(std::span<const uint8_t> bytes);
  // Throws std::logic_error unless every tensor's bytes were written.
  void Commit();
  uint64_t size() const { return out_.offset(); }

 private:
  struct Header {
    std::string text;        // the JSON, padded
    uint64_t file_size = 0;  // once every tensor is written
  };
  static Header MakeHeader(const std::string& path, const std::vector<Entry>& entries,
                           const std::map<std::string, std::string>& metadata);
  Header header_;  // checked before the temporary file is created
  AtomicFile out_;
};

}  // namespace uckpt
