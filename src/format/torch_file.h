// torch.save files: load (memory-mapped, zero-copy, no code execution) and save
// (protocol-2 pickle, 64-byte aligned records, loadable by torch.load with
// weights_only=True in PyTorch 1.13 and 2.x).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "format/file.h"
#include "format/pickle_reader.h"
#include "format/value.h"
#include "format/zip.h"

namespace uckpt {

struct TorchFile {
  std::shared_ptr<const MappedFile> file;
  std::string archive;  // the record folder name inside the zip
  ValuePtr root;
};

struct LoadOptions {
  bool verify_crc = false;  // check every record's CRC-32 (a stored 0 is skipped)
  PickleLimits limits;
  // kStrict: refuse globals outside the allow-list (format/strict_globals.h).
  PicklePolicy policy = DefaultPicklePolicy();
};

// Throws FormatError naming the file on anything that is not a valid torch.save
// zip file (legacy pre-1.6 files and TorchScript archives are refused with a
// message saying so), IoError if it cannot be read.
TorchFile LoadTorchFile(const std::string& path, const LoadOptions& options = {});
TorchFile LoadTorchFile(std::shared_ptr<const MappedFile> file, const LoadOptions& options = {});

// The `.data/serialization_id` torch >= 2.1 writes last, from the records
// written before it (names start with `prefix`, "<archive>/") and the first
// (up to 8) bytes of each one's data, `leading[i]` for `records[i]`; empty where
// unknown. Deterministic: equal to torch's for the same records.
std::string TorchSerializationId(const std::vector<ZipEntry>& records, const std::string& prefix,
                                 const std::vector<std::span<const uint8_t>>& leading);

struct SaveOptions {
  bool durable = true;  // fsync before the rename
  uint32_t alignment = 64;
  // Where streamed storages (Storage::fill) pass through on their way to the
  // file; empty: a buffer of up to 64 MiB is allocated for the call.
  std::span<uint8_t> stream_buffer;
};

// Writes `root` to `path` through a temporary file renamed into place when
// complete. Throws FormatError for values torch cannot represent (e.g. one
// storage viewed with two dtypes), IoError on write failures.
void SaveTorchFile(const std::string& path, const ValuePtr& root, const SaveOptions& options = {});
// The same bytes into `out`, front to back, for a file named `path` (its
// archive name comes from it); the caller owns the file (`durable` unused).
void SaveTorchFile(ByteSink& out, const std::string& path, const ValuePtr& root, const SaveOptions& options = {});

// Bytes of a file at an offset.
struct FilePiece {
  std::span<const uint8_t> data;
  uint64_t offset = 0;
};

// The file SaveTorchFile would write, laid out instead of written, so that
// several threads can write its parts: the same bytes, as pieces in file
// order tiling [0, size). Each storage's bytes are referenced where they lie
// (they must stay valid while the pieces are used); the pickle, headers and
// directory are held by `keep`. Streamed storages cannot be laid out
// (std::invalid_argument): write such a value with SaveTorchFile.
struct TorchFileLayout {
  uint64_t size = 0;
  std::vector<FilePiece> pieces;
  std::shared_ptr<const void> keep;
};
// The CRC-32 of each storage's bytes, in order (the caller may spread the
// work over threads: Crc32Combine joins the CRCs of a storage's pieces).
using StorageCrcs = std::function<std::vector<uint32_t>(const std::vector<std::span<const uint8_t>>& storages)>;
TorchFileLayout LayOutTorchFile(const std::string& path, const ValuePtr& root, const StorageCrcs& crcs,
                                const SaveOptions& options = {});

}  // namespace uckpt
