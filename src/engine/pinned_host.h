#pragma once

#include <ATen/ATen.h>

namespace uckpt::engine {

// Page-locked host memory of exactly the size asked for, zero-filled, for
// the big buffers that live as long as the engine (offloaded partitions,
// fp32 masters and gradients). libtorch's pinned allocator rounds every
// block up to a power of two, so a 6.4 GiB partition would lock 8 GiB.
// Where uckpt is built without the CUDA runtime it falls back to libtorch's
// pinned allocator. Only for a process that has a CUDA device.
at::Tensor PinnedHostZeros(at::IntArrayRef sizes, at::ScalarType dtype);

}  // namespace uckpt::engine
