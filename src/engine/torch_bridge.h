// Moving tensors between the format layer (uckpt::Tensor, no libtorch) and
// libtorch (at::Tensor). Both directions copy.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "format/value.h"

namespace uckpt::engine {

at::ScalarType ToScalarType(DType d);  // throws std::invalid_argument if torch has no such type
DType FromScalarType(at::ScalarType t);

// A contiguous CPU copy of `t` (any strides / storage offset).
at::Tensor ToTorch(const Tensor& t);
// A contiguous copy of `t` over a fresh storage of its own.
Tensor FromTorch(const at::Tensor& t);

// The CUDA caching allocator's peaks on `device` since the start (bytes);
// nullopt on the CPU or in a build without CUDA.
struct CudaMemoryPeak {
  int64_t allocated = 0, reserved = 0;
};
std::optional<CudaMemoryPeak> PeakCudaMemory(at::Device device);

}  // namespace uckpt::engine
