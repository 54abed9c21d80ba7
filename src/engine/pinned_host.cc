#include "engine/pinned_host.h"

#include <atomic>
#include <stdexcept>
#include <string>

#ifdef UCKPT_CUDART
#include <cuda_runtime_api.h>
#endif

namespace uckpt::engine {
namespace {

std::atomic<int64_t> locked_bytes{0};

}  // namespace

at::Tensor PinnedHostZeros(at::IntArrayRef sizes, at::ScalarType dtype) {
#ifdef UCKPT_CUDART
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (bytes == 0) return at::zeros(sizes, at::TensorOptions().dtype(dtype).device(at::kCPU));
  void* p = nullptr;
  // Portable: every device of the process may copy from it.
  if (cudaError_t e = cudaHostAlloc(&p, static_cast<size_t>(bytes), cudaHostAllocPortable); e != cudaSuccess) {
    cudaGetLastError();  // clear it: the caller decides what happens next
    throw std::runtime_error("uckpt: cannot lock " + std::to_string(bytes) + " bytes of host memory (" +
                             cudaGetErrorString(e) + ")");
  }
  locked_bytes += bytes;
  at::Tensor t = at::from_blob(
      p, sizes,
      [bytes](void* q) {
        cudaFreeHost(q);  // at exit the runtime may be gone already: nothing left to do then
        locked_bytes -= bytes;
      },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
  t.zero_();
  return t;
#else
  return at::zeros(sizes, at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(true));
#endif
}

int64_t PinnedHostBytes() { return locked_bytes.load(); }

}  // namespace uckpt::engine
