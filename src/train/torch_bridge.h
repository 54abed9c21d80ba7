// Moving tensors between the format layer (uckpt::Tensor, no libtorch) and
// libtorch (at::Tensor). Both directions copy.
#pragma once

#include <ATen/ATen.h>

#include "format/value.h"

namespace uckpt::train {

at::ScalarType ToScalarType(DType d);  // throws std::invalid_argument if torch has no such type
DType FromScalarType(at::ScalarType t);

// A contiguous CPU copy of `t` (any strides / storage offset).
at::Tensor ToTorch(const Tensor& t);
// A contiguous copy of `t` over a fresh storage of its own.
Tensor FromTorch(const at::Tensor& t);

}  // namespace uckpt::train
