#include "engine/pinned_host.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef UCKPT_CUDART
#include <sys/mman.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#endif

namespace uckpt::engine {
namespace {

#ifdef UCKPT_CUDART
[[noreturn]] void CannotLock(size_t bytes, cudaError_t e) {
  cudaGetLastError();  // clear it: the caller decides what happens next
  throw std::runtime_error("uckpt: cannot lock " + std::to_string(bytes) + " bytes of host memory (" +
                           cudaGetErrorString(e) + ")");
}

// Faults in every page of [p, p + bytes) on the rank's host threads (libtorch's
// intra-op count: at::parallel_for would run serially in this library, which
// is not built with OpenMP).
void TouchPages(char* p, size_t bytes) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t pages = (bytes + page - 1) / page;
  const size_t threads = std::clamp<size_t>(pages / 4096, 1, static_cast<size_t>(std::max(1, at::get_num_threads())));
  auto touch = [&](size_t t) {
    for (size_t i = pages * t / threads; i < pages * (t + 1) / threads; ++i)
      static_cast<volatile char*>(p)[i * page] = 0;
  };
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < threads; ++t) helpers.emplace_back(touch, t);
  touch(0);
  for (std::thread& h : helpers) h.join();
}

// Fresh anonymous pages (zeros), faulted in by the host threads in parallel,
// then locked in one call: cudaHostAlloc faults and locks them on one thread,
// a few GB/s, which made the offloaded state of a 3B model take seconds.
// Where the range cannot be registered, cudaHostAlloc's memory (zeroed here).
// Returns whether the memory is registered (else cudaHostAlloc's).
bool LockedZeros(size_t bytes, void** out) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p != MAP_FAILED) {
    madvise(p, bytes, MADV_HUGEPAGE);  // fewer, larger pages to fault and lock where the kernel allows
    // Not into children: a fork (a DataLoader's workers) would otherwise copy every locked page at once.
    madvise(p, bytes, MADV_DONTFORK);
    TouchPages(static_cast<char*>(p), bytes);
    if (cudaHostRegister(p, bytes, cudaHostRegisterPortable) == cudaSuccess) {
      *out = p;
      return true;
    }
    cudaGetLastError();
    munmap(p, bytes);
  }
  static std::once_flag said;
  std::call_once(said, [] {
    std::cerr << "uckpt: cannot register mapped host memory with CUDA; pinned buffers come from cudaHostAlloc "
                 "(slower to make)\n";
  });
  if (cudaError_t e = cudaHostAlloc(out, bytes, cudaHostAllocPortable); e != cudaSuccess) CannotLock(bytes, e);
  std::memset(*out, 0, bytes);
  return false;
}
#endif

}  // namespace

at::Tensor PinnedHostZeros(at::IntArrayRef sizes, at::ScalarType dtype) {
#ifdef UCKPT_CUDART
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (bytes == 0) return at::zeros(sizes, at::TensorOptions().dtype(dtype).device(at::kCPU));
  void* p = nullptr;
  const bool registered = LockedZeros(static_cast<size_t>(bytes), &p);
  return at::from_blob(
      p, sizes,
      [bytes, registered](void* q) {
        // No copy still queued may read or write freed pages: the owners free
        // these buffers rarely (their engine's end, a staging buffer grown).
        cudaDeviceSynchronize();
        // At exit the runtime may be gone already: the unmap frees the pages anyway.
        if (registered) {
          cudaHostUnregister(q);
          munmap(q, static_cast<size_t>(bytes));
        } else {
          cudaFreeHost(q);
        }
        cudaGetLastError();  // a failure here is no later call's error
      },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
#else
  return at::zeros(sizes, at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(true));
#endif
}

}  // namespace uckpt::engine
