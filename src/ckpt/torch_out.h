// torch.save files as torch 1.13 lays them out (records data.pkl, data/<k>,
// version — what DeepSpeed 0.14 on torch 1.13 writes) or, on request, as
// torch >= 2.7 does (.format_version, .storage_alignment, byteorder and
// .data/serialization_id added), so that converted files can be byte-identical
// to DeepSpeed's on either. Tensor data can be given as pieces
// that are written one after another, straight from memory-mapped inputs,
// without being gathered first.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "format/file.h"
#include "format/torch_file.h"
#include "format/value.h"
#include "format/zip.h"

namespace uckpt::ckpt {

// A storage of `nbytes` whose bytes are not in memory: its data must be
// supplied as pieces to WriteTorchFile. (The pickle needs only its size.)
std::shared_ptr<Storage> PiecewiseStorage(DType dtype, uint64_t nbytes);

// A contiguous tensor of `shape` over a PiecewiseStorage.
ValuePtr PiecewiseTensor(DType dtype, const std::vector<int64_t>& shape, bool requires_grad);

using StoragePieces = std::unordered_map<const Storage*, std::vector<std::span<const uint8_t>>>;

// Which torch's record layout a file is written in.
enum class TorchRecords {
  kTorch1_13,  // data.pkl, data/<k>, version
  kTorch2,     // + .format_version, .storage_alignment, byteorder, .data/serialization_id (torch >= 2.7)
};

// The layout `file` was written in: kTorch2 when it has torch >= 2.7's
// `.format_version` record, else kTorch1_13.
TorchRecords RecordsOf(const TorchFile& file);

struct TorchWriteOptions {
  bool durable = false;  // fsync + rename (off inside a temporary output folder)
  TorchRecords records = TorchRecords::kTorch1_13;
  // Called with each piece of storage data (at most 1 MiB) once written.
  std::function<void(std::span<const uint8_t>)> written;
};

// Writes `root` to `path`. Storages listed in `pieces` are written from their
// pieces (which must add up to the storage's size); all others from their
// bytes. Returns the file size. Throws IoError naming the file on write errors.
uint64_t WriteTorchFile(const std::string& path, const ValuePtr& root, const StoragePieces& pieces = {},
                        const TorchWriteOptions& options = {});

// The same into `out` (front to back), for a file whose name is `path`
// (its archive name inside the zip comes from it). `options.durable` is not
// used: the caller owns the file. Returns the bytes written.
uint64_t WriteTorchFile(ByteSink& out, const std::string& path, const ValuePtr& root, const StoragePieces& pieces = {},
                        const TorchWriteOptions& options = {});

// torch.save of `root` with its storages' bytes supplied one storage at a
// time (a model saved parameter by parameter, never whole in memory): the
// pickle at construction, then each storage of storages() in that order
// (WriteNext), then Commit, which finishes the zip and renames the temporary
// file into place (AtomicFile). Destroying it uncommitted removes the temporary.
class TorchFileStream {
 public:
  TorchFileStream(const std::string& path, const ValuePtr& root, bool durable = true);
  ~TorchFileStream();
  // The storages the pickle references, in the order their bytes are written.
  const std::vector<std::shared_ptr<Storage>>& storages() const { return storages_; }
  // The next storage's bytes, `pieces` adding up to its size. Throws
  // FormatError naming the file on a size mismatch, std::logic_error past the last.
  void WriteNext(std::span<const std::span<const uint8_t>> pieces);
  // Throws std::logic_error unless every storage was written.
  void Commit();

 private:
  std::string path_, prefix_;
  std::unique_ptr<AtomicFile> out_;
  std::unique_ptr<ZipWriter> zip_;
  std::vector<std::shared_ptr<Storage>> storages_;
  size_t next_ = 0;
};

}  // namespace uckpt::ckpt
