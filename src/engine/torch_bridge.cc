#include "engine/torch_bridge.h"

#include <torch/version.h>
#ifdef UCKPT_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cstring>
#include <stdexcept>
#include <string>

namespace uckpt::engine {

at::ScalarType ToScalarType(DType d) {
  switch (d) {
    case DType::kFloat32: return at::kFloat;
    case DType::kFloat64: return at::kDouble;
    case DType::kFloat16: return at::kHalf;
    case DType::kBFloat16: return at::kBFloat16;
    case DType::kInt64: return at::kLong;
    case DType::kInt32: return at::kInt;
    case DType::kInt16: return at::kShort;
    case DType::kInt8: return at::kChar;
    case DType::kUInt8: return at::kByte;
    case DType::kBool: return at::kBool;
    case DType::kComplex64: return at::kComplexFloat;
    case DType::kComplex128: return at::kComplexDouble;
    default: break;
  }
  throw std::invalid_argument("dtype " + std::string(DTypeName(d)) + " has no libtorch equivalent here");
}

DType FromScalarType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kLong: return DType::kInt64;
    case at::kInt: return DType::kInt32;
    case at::kShort: return DType::kInt16;
    case at::kChar: return DType::kInt8;
    case at::kByte: return DType::kUInt8;
    case at::kBool: return DType::kBool;
    case at::kComplexFloat: return DType::kComplex64;
    case at::kComplexDouble: return DType::kComplex128;
    default: break;
  }
  throw std::invalid_argument(std::string("torch dtype ") + c10::toString(t) + " cannot be saved");
}

at::Tensor ToTorch(const Tensor& t) {
  auto opts = at::TensorOptions().dtype(ToScalarType(t.dtype));
  if (t.numel() == 0) return at::empty(t.shape, opts);
  if (!t.storage) throw std::invalid_argument("tensor without storage");
  const int64_t storage_numel = static_cast<int64_t>(t.storage->bytes.size() / DTypeSize(t.dtype));
  // from_blob never writes; the const_cast only satisfies its signature.
  at::Tensor whole = at::from_blob(const_cast<uint8_t*>(t.storage->bytes.data()), {storage_numel}, opts);
  return whole.as_strided(t.shape, t.stride, t.storage_offset).clone(at::MemoryFormat::Contiguous);
}

Tensor FromTorch(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  std::vector<uint8_t> bytes(c.nbytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), c.data_ptr(), bytes.size());
  return Tensor::FromBytes(FromScalarType(c.scalar_type()), c.sizes().vec(), std::move(bytes));
}

std::optional<CudaMemoryPeak> PeakCudaMemory(at::Device device) {
#ifdef UCKPT_CUDA
  if (!device.is_cuda()) return std::nullopt;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  // Index 0 of each stat array is StatType::AGGREGATE (all pools).
  return CudaMemoryPeak{stats.allocated_bytes[0].peak, stats.reserved_bytes[0].peak};
#else
  (void)device;
  return std::nullopt;
#endif
}

}  // namespace uckpt::engine
