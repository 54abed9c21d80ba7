// The zip container of torch.save files: stored (uncompressed) records, zip64,
// 64-byte aligned data. The reader exposes records zero-copy from a memory map.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "format/file.h"

namespace uckpt {

struct ZipEntry {
  std::string name;      // full name, "<archive>/<record>"
  uint64_t data_offset;  // absolute offset of the first data byte
  uint64_t size;
  uint32_t crc32;
};

class ZipReader {
 public:
  // Parses the central directory of `file`. Throws FormatError naming the file
  // and the bad record on compressed, encrypted, overlapping or out-of-range
  // entries and on bad signatures.
  explicit ZipReader(std::shared_ptr<const MappedFile> file);

  const std::vector<ZipEntry>& entries() const { return entries_; }
  // The entry called `name`, or null.
  const ZipEntry* Find(const std::string& name) const;
  std::span<const uint8_t> Data(const ZipEntry& e) const;
  const std::shared_ptr<const MappedFile>& file() const { return file_; }
  // Checks a record's CRC-32 (a stored CRC of 0 means "not computed").
  bool CrcMatches(const ZipEntry& e) const;

 private:
  std::shared_ptr<const MappedFile> file_;
  std::vector<ZipEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
};

// Writes records exactly as PyTorch's writer lays them out: local header with
// data descriptor, "FB" padding field aligning data to `alignment`, zip64
// extra fields when needed, central directory, zip64 end records, end record.
class ZipWriter {
 public:
  ZipWriter(ByteSink& out, uint32_t alignment = 64) : out_(out), alignment_(alignment) {}

  // Writes one record whose data is the concatenation of `pieces`.
  // `written`, if set, is called with each piece once it has been written
  // (the converter drops memory-mapped source pages there).
  void AddRecord(const std::string& name, std::span<const std::span<const uint8_t>> pieces,
                 const std::function<void(std::span<const uint8_t>)>& written = nullptr);
  void AddRecord(const std::string& name, std::span<const uint8_t> data) { AddRecord(name, {&data, 1}); }
  void AddRecord(const std::string& name, const std::string& s) {
    AddRecord(name, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
  }
  // The same bytes as AddRecord for a record whose CRC-32 the caller computed
  // (crc32 of `data`); `data` goes to the sink in one WriteKept call, so it
  // must stay valid until the file is complete.
  void AddKeptRecord(const std::string& name, std::span<const uint8_t> data, uint32_t crc32);
  // The same bytes as AddRecord for a record of `size` bytes that are not in
  // memory: fill(offset, into) puts bytes [offset, offset + into.size()) into
  // `buffer` (or a prefix of it), which is CRC'd and written before it is
  // filled again. With a buffer of at least 2 MiB, its halves take turns:
  // fill (and the CRC) runs on another thread for one while the other is
  // written, so fill must be safe to call from any thread (one call at a time).
  void AddStreamedRecord(const std::string& name, uint64_t size,
                         const std::function<void(uint64_t offset, std::span<uint8_t> into)>& fill,
                         std::span<uint8_t> buffer);
  // Writes the central directory and end records.
  void Finish();

  // The CRC-32 of every record written so far, in order (for the serialization id).
  const std::vector<ZipEntry>& records() const { return records_; }

 private:
  // The local header; returns where the data starts.
  uint64_t WriteHeader(const std::string& name, uint64_t size);
  // The data descriptor, and the record's entry for the central directory.
  void EndRecord(const std::string& name, uint64_t header_offset, uint64_t data_offset, uint64_t size, uint32_t crc);
  ByteSink& out_;
  uint32_t alignment_;
  std::vector<ZipEntry> records_;
  std::vector<uint64_t> header_offsets_;
};

uint32_t Crc32(std::span<const uint8_t> data, uint32_t crc = 0);
// The CRC-32 of A followed by B from crc_a, crc_b and B's length (zlib's
// crc32_combine), so that pieces of a record can be hashed apart.
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

}  // namespace uckpt
