// The state fingerprint's sums on a CUDA device (fingerprint_kernel.h): one
// block per chunk, each thread summing strided terms, a warp then a block
// reduction, one atomic add per chunk (wrapping, as the host sum).
#include <cuda_runtime.h>

#include "ckpt/fingerprint_term.h"
#include "engine/fingerprint_kernel.h"

namespace uckpt::engine {

namespace {

constexpr int kThreads = 256;

__global__ void FingerprintChunks(const FingerprintChunk* chunks, unsigned long long* sums) {
  const FingerprintChunk c = chunks[blockIdx.x];
  uint64_t sum = 0;
  for (uint32_t j = threadIdx.x; j < c.n; j += kThreads)
    sum += ckpt::FingerprintTerm(c.seed, c.start + j, __ldg(c.bits + j));
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
  __shared__ uint64_t warps[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t s = 0;
    for (int w = 0; w < kThreads / 32; ++w) s += warps[w];
    atomicAdd(sums + c.out, static_cast<unsigned long long>(s));
  }
}

}  // namespace

const char* LaunchFingerprintKernel(const FingerprintChunk* chunks, int64_t count, uint64_t* sums, void* stream) {
  if (count <= 0) return nullptr;
  FingerprintChunks<<<static_cast<unsigned>(count), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      chunks, reinterpret_cast<unsigned long long*>(sums));
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace uckpt::engine
