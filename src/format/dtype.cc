#include "format/dtype.h"

#include <bit>
#include <cmath>
#include <cstring>

namespace uckpt {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
  std::string_view storage_class;
  bool floating;
};

constexpr DTypeInfo kInfo[] = {
    {DType::kFloat32, "float32", 4, "FloatStorage", true},
    {DType::kFloat64, "float64", 8, "DoubleStorage", true},
    {DType::kFloat16, "float16", 2, "HalfStorage", true},
    {DType::kBFloat16, "bfloat16", 2, "BFloat16Storage", true},
    {DType::kInt64, "int64", 8, "LongStorage", false},
    {DType::kInt32, "int32", 4, "IntStorage", false},
    {DType::kInt16, "int16", 2, "ShortStorage", false},
    {DType::kInt8, "int8", 1, "CharStorage", false},
    {DType::kUInt8, "uint8", 1, "ByteStorage", false},
    {DType::kBool, "bool", 1, "BoolStorage", false},
    {DType::kComplex64, "complex64", 8, "ComplexFloatStorage", true},
    {DType::kComplex128, "complex128", 16, "ComplexDoubleStorage", true},
    {DType::kUInt16, "uint16", 2, "", false},
    {DType::kUInt32, "uint32", 4, "", false},
    {DType::kUInt64, "uint64", 8, "", false},
    {DType::kFloat8E4M3FN, "float8_e4m3fn", 1, "", true},
    {DType::kFloat8E5M2, "float8_e5m2", 1, "", true},
    {DType::kFloat8E4M3FNUZ, "float8_e4m3fnuz", 1, "", true},
    {DType::kFloat8E5M2FNUZ, "float8_e5m2fnuz", 1, "", true},
};

const DTypeInfo& Info(DType d) { return kInfo[static_cast<int>(d)]; }

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Decodes an 8-bit float with the given exponent/mantissa widths and bias.
// fnuz variants have no infinities and one NaN (0x80); e4m3fn has no
// infinities and NaN at S.1111.111.
double Float8ToDouble(uint8_t v, int exp_bits, int man_bits, int bias, bool fn, bool uz) {
  int sign = v >> 7;
  int exp = (v >> man_bits) & ((1 << exp_bits) - 1);
  int man = v & ((1 << man_bits) - 1);
  if (uz && v == 0x80) return std::nan("");
  double s = sign ? -1.0 : 1.0;
  int max_exp = (1 << exp_bits) - 1;
  if (!fn && !uz && exp == max_exp) return man ? std::nan("") : s * INFINITY;
  if (fn && exp == max_exp && man == (1 << man_bits) - 1) return std::nan("");
  if (exp == 0) return s * std::ldexp(man, 1 - bias - man_bits);
  return s * std::ldexp(man + (1 << man_bits), exp - bias - man_bits);
}

}  // namespace

std::string_view DTypeName(DType d) { return Info(d).name; }
size_t DTypeSize(DType d) { return Info(d).size; }
bool DTypeIsFloating(DType d) { return Info(d).floating; }
std::string_view DTypeStorageClass(DType d) { return Info(d).storage_class; }

std::optional<DType> DTypeFromName(std::string_view name) {
  for (const auto& i : kInfo)
    if (i.name == name) return i.dtype;
  // Aliases torch also accepts as attribute names.
  if (name == "float") return DType::kFloat32;
  if (name == "double") return DType::kFloat64;
  if (name == "half") return DType::kFloat16;
  if (name == "long") return DType::kInt64;
  if (name == "int") return DType::kInt32;
  if (name == "short") return DType::kInt16;
  if (name == "cfloat") return DType::kComplex64;
  if (name == "cdouble") return DType::kComplex128;
  return std::nullopt;
}

std::optional<DType> DTypeFromStorageClass(std::string_view cls) {
  for (const auto& i : kInfo)
    if (!i.storage_class.empty() && i.storage_class == cls) return i.dtype;
  return std::nullopt;
}

float BFloat16ToFloat(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }

float HalfToFloat(uint16_t h) {
  uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float s = sign ? -1.0f : 1.0f;
  if (exp == 0x1f) return man ? std::nanf("") : s * INFINITY;
  if (exp == 0) return s * std::ldexp(static_cast<float>(man), -24);
  return s * std::ldexp(static_cast<float>(man + 1024), static_cast<int>(exp) - 25);
}

uint16_t FloatToBFloat16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return 0x7fc0;
  uint32_t rounding_bias = 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

uint16_t FloatToHalf(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  if (std::isnan(f)) return sign | 0x7e00;
  float a = std::fabs(f);
  if (a >= 65520.0f) return sign | 0x7c00;  // rounds to infinity
  if (a < std::ldexp(1.0f, -14)) {
    // Subnormal half: value = m * 2^-24, m rounded to nearest even.
    float m = std::nearbyint(a * std::ldexp(1.0f, 24));
    return sign | static_cast<uint16_t>(m);
  }
  uint32_t mag = u & 0x7fffffff;
  // Re-bias exponent (127 -> 15), keep 10 mantissa bits, round to nearest even.
  uint32_t h = ((mag >> 13) - ((127 - 15) << 10));
  uint32_t rest = mag & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return sign | static_cast<uint16_t>(h);
}

double ElementToDouble(DType d, const uint8_t* p) {
  switch (d) {
    case DType::kFloat32: return Load<float>(p);
    case DType::kFloat64: return Load<double>(p);
    case DType::kFloat16: return HalfToFloat(Load<uint16_t>(p));
    case DType::kBFloat16: return BFloat16ToFloat(Load<uint16_t>(p));
    case DType::kInt64: return static_cast<double>(Load<int64_t>(p));
    case DType::kInt32: return Load<int32_t>(p);
    case DType::kInt16: return Load<int16_t>(p);
    case DType::kInt8: return Load<int8_t>(p);
    case DType::kUInt8: return *p;
    case DType::kBool: return *p ? 1.0 : 0.0;
    case DType::kUInt16: return Load<uint16_t>(p);
    case DType::kUInt32: return Load<uint32_t>(p);
    case DType::kUInt64: return static_cast<double>(Load<uint64_t>(p));
    case DType::kFloat8E4M3FN: return Float8ToDouble(*p, 4, 3, 7, true, false);
    case DType::kFloat8E5M2: return Float8ToDouble(*p, 5, 2, 15, false, false);
    case DType::kFloat8E4M3FNUZ: return Float8ToDouble(*p, 4, 3, 8, false, true);
    case DType::kFloat8E5M2FNUZ: return Float8ToDouble(*p, 5, 2, 16, false, true);
    case DType::kComplex64: return Load<float>(p);
    case DType::kComplex128: return Load<double>(p);
  }
  return 0;
}

}  // namespace uckpt
