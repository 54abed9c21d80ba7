// Filling tensors from read plans (byte ranges of memory-mapped checkpoint
// files, ckpt/copy_plan.h), on whatever device the tensors live.
//
// A CPU tensor of the source's dtype is read into directly: no buffer, no
// extra copy, and only the bytes no read covers (padding) are zeroed. Any
// other destination (a GPU tensor, another dtype, a non-contiguous tensor)
// is filled through a few reused staging chunks: the copy engine's threads
// read chunk k+1 while chunk k goes to the device. For a GPU destination the
// chunks are pinned host memory and each is copied with an asynchronous copy
// on a side stream of its own, waited for only before that chunk is reused;
// a dtype conversion runs on the device after the upload. Many small
// destinations share a chunk, so a stage-3 load with one tensor per
// sub-group pays no per-tensor round trip.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "ckpt/copy_plan.h"

namespace uckpt::engine {

// The reads that fill one tensor.
struct TensorReads {
  at::Tensor dst;                       // any device, dtype and layout
  at::ScalarType source = at::kFloat;   // the dtype of the bytes the pieces hold
  std::vector<ckpt::ReadPiece> pieces;  // to: byte offsets in dst.numel() elements of `source`
};

struct StagedOptions {
  // Bytes per staging chunk; 0: $UCKPT_LOAD_CHUNK_BYTES, else 32 MiB.
  uint64_t chunk_bytes = 0;
  int chunks = 3;          // chunks in flight (host memory: chunks x chunk_bytes)
  bool stage_cpu = false;  // stage CPU destinations a direct read could fill too (tests)
  // Reading threads; 0: $UCKPT_LOAD_THREADS, else min(8, this rank's host
  // threads): a load from the page cache is bound by memory copies, not by one disk.
  // reads.chunk 0: each staging chunk is split over the threads.
  ckpt::ReadOptions reads{0, 0};
};

// The staging chunk size: $UCKPT_LOAD_CHUNK_BYTES when set (a positive
// integer, at least 64; else std::invalid_argument naming the variable),
// else 32 MiB.
uint64_t DefaultChunkBytes();

// The reading threads: $UCKPT_LOAD_THREADS when set (1 to 1024, else
// std::invalid_argument naming the variable), else min(8, this rank's host
// threads, engine/host_threads.h).
int DefaultLoadThreads();

// Fills every target's dst from its pieces; bytes no piece covers become
// zero. Returns the bytes read. Throws std::invalid_argument for a piece
// that does not fit its tensor or pieces that overlap (before anything is
// read), and what the reads throw. When it returns, every copy to a device
// has finished.
uint64_t FillFromReads(std::vector<TensorReads>& targets, const StagedOptions& options = {});

}  // namespace uckpt::engine
