// Tensor element types as PyTorch names them, with their storage classes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace uckpt {

enum class DType : uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt64,
  kInt32,
  kInt16,
  kInt8,
  kUInt8,
  kBool,
  kComplex64,
  kComplex128,
  // Types without a legacy storage class: saved through UntypedStorage and
  // torch._utils._rebuild_tensor_v3.
  kUInt16,
  kUInt32,
  kUInt64,
  kFloat8E4M3FN,
  kFloat8E5M2,
  kFloat8E4M3FNUZ,
  kFloat8E5M2FNUZ,
};

// "float32", "bfloat16", ... (torch's canonical name without "torch.").
std::string_view DTypeName(DType d);
std::optional<DType> DTypeFromName(std::string_view name);
size_t DTypeSize(DType d);
bool DTypeIsFloating(DType d);

// The legacy typed storage class ("FloatStorage"), or empty for types that are
// saved through UntypedStorage.
std::string_view DTypeStorageClass(DType d);
// Maps "FloatStorage" (without the "torch." module) back to its dtype.
std::optional<DType> DTypeFromStorageClass(std::string_view cls);

// Widens one element to double (integers exactly where representable).
double ElementToDouble(DType d, const uint8_t* p);
// Narrows a float32 value to bf16/fp16 bits with round-to-nearest-even, as torch does.
uint16_t FloatToBFloat16(float f);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
float HalfToFloat(uint16_t h);

}  // namespace uckpt
