// The state fingerprint's sums on a CUDA device in one pass over the fp32
// bits (fingerprint_kernel.cu). Built only where libtorch has CUDA and nvcc
// is found (UCKPT_FINGERPRINT_KERNEL); elsewhere CUDA tensors are hashed by
// tensor ops. Plain types only: nvcc compiles it without libtorch.
#pragma once

#include <cstdint>

namespace uckpt::engine {

// Elements [0, n) at `bits` (device memory, fp32 bit patterns) are elements
// [start, start + n) of the tensor whose seed is `seed`; their sum goes to
// sums[out].
struct FingerprintChunk {
  const uint32_t* bits;
  uint64_t seed;
  uint64_t start;
  uint32_t n;  // at most kFingerprintChunkElements
  uint32_t out;
};

inline constexpr uint32_t kFingerprintChunkElements = 1u << 16;

// Adds each of `count` chunks' (`chunks`: device memory) sum to
// sums[chunk.out] (device memory, wrapping) on `stream` (a cudaStream_t of
// the current device). Returns nullptr, or the CUDA error's text.
const char* LaunchFingerprintKernel(const FingerprintChunk* chunks, int64_t count, uint64_t* sums, void* stream);

}  // namespace uckpt::engine
