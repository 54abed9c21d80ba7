#include "format/value_json.h"

#include <openssl/evp.h>

#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <unordered_map>

#include "format/error.h"

namespace uckpt {

std::string PythonFloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's layout rules for repr.
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t e = sci.find('e');
  int exp10 = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (size_t k = 0; k < e; ++k)
    if (sci[k] != '.') digits.push_back(sci[k]);
  int decpt = exp10 + 1;  // value = 0.digits * 10^decpt
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out = "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
    } else if (static_cast<size_t>(decpt) >= digits.size()) {
      out = digits + std::string(static_cast<size_t>(decpt) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    int x = decpt - 1;
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", x < 0 ? '-' : '+', std::abs(x));
    out += eb;
  }
  return neg ? "-" + out : out;
}

std::string Sha256Hex(std::span<const uint8_t> data) {
  unsigned char md[32];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned k = 0; k < len; ++k) {
    out.push_back(hex[md[k] >> 4]);
    out.push_back(hex[md[k] & 15]);
  }
  return out;
}

namespace {

using nlohmann::json;

json FloatNode(double d) {
  char bits[17];
  std::snprintf(bits, sizeof bits, "%016llx", static_cast<unsigned long long>(std::bit_cast<uint64_t>(d)));
  return {{"type", "float"}, {"value", PythonFloatRepr(d)}, {"bits", bits}};
}

json NumberOrName(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  return d;
}

json ElementJson(DType dt, const uint8_t* p) {
  switch (dt) {
    case DType::kBool: return *p != 0;
    case DType::kInt64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DType::kUInt64: {
      uint64_t v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DType::kInt32:
    case DType::kInt16:
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kUInt16:
    case DType::kUInt32: return static_cast<int64_t>(ElementToDouble(dt, p));
    case DType::kComplex64: {
      float re, im;
      std::memcpy(&re, p, 4);
      std::memcpy(&im, p + 4, 4);
      return json::array({NumberOrName(re), NumberOrName(im)});
    }
    case DType::kComplex128: {
      double re, im;
      std::memcpy(&re, p, 8);
      std::memcpy(&im, p + 8, 8);
      return json::array({NumberOrName(re), NumberOrName(im)});
    }
    default: return NumberOrName(ElementToDouble(dt, p));
  }
}

bool IsAscii(const std::string& s) {
  for (unsigned char c : s)
    if (c >= 0x80) return false;
  return true;
}

std::string Hex(const std::string& s) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(hex[c >> 4]);
    out.push_back(hex[c & 15]);
  }
  return out;
}

class Renderer {
 public:
  explicit Renderer(const JsonOptions& o) : options_(o) {}

  json Render(const Value& v) {
    if (++nodes_ > options_.max_nodes)
      throw FormatError("value tree expands to more than " + std::to_string(options_.max_nodes) +
                        " nodes through shared references");
    switch (v.kind) {
      case Kind::kNone: return {{"type", "none"}};
      case Kind::kBool: return {{"type", "bool"}, {"value", v.b}};
      case Kind::kInt: return {{"type", "int"}, {"value", IntToDecimal(v)}};
      case Kind::kFloat: return FloatNode(v.f);
      case Kind::kComplex: return {{"type", "complex"}, {"real", FloatNode(v.f)}, {"imag", FloatNode(v.imag)}};
      case Kind::kStr: {
        json j = {{"type", "str"}, {"value", v.s}};
        if (!IsAscii(v.s)) j["utf8_hex"] = Hex(v.s);
        return j;
      }
      case Kind::kBytes: return {{"type", "bytes"}, {"hex", Hex(v.s)}};
      case Kind::kByteArray: return {{"type", "bytearray"}, {"hex", Hex(v.s)}};
      case Kind::kList: return Seq("list", v.items);
      case Kind::kTuple: return Seq("tuple", v.items);
      case Kind::kSet: return Seq("set", v.items);
      case Kind::kFrozenSet: return Seq("frozenset", v.items);
      case Kind::kDict:
      case Kind::kOrderedDict: {
        json j = {{"type", v.kind == Kind::kDict ? "dict" : "ordered_dict"}, {"items", Pairs(v.entries)}};
        if (v.state) j["state"] = Render(*v.state);
        return j;
      }
      case Kind::kTorchSize: {
        json dims = json::array();
        for (const auto& it : v.items) dims.push_back(it->i);
        return {{"type", "torch.Size"}, {"value", dims}};
      }
      case Kind::kTorchDevice: return {{"type", "torch.device"}, {"value", v.s}};
      case Kind::kTorchDtype: return {{"type", "torch.dtype"}, {"value", v.s}};
      case Kind::kGlobal: return {{"type", "global"}, {"value", v.s}};
      case Kind::kObject: {
        json j = {{"type", "object"},
                  {"class", v.s},
                  {"construct", v.newobj ? "newobj" : "reduce"},
                  {"args", Render(*v.items.at(0))}};
        if (v.state) j["state"] = Render(*v.state);
        if (v.kwargs) j["kwargs"] = Render(*v.kwargs);
        if (!v.listitems.empty()) j["listitems"] = Seq("list", v.listitems)["items"];
        if (!v.entries.empty()) j["dictitems"] = Pairs(v.entries);
        return j;
      }
      case Kind::kParameter: {
        json j = {{"type", "parameter"}, {"requires_grad", v.b}, {"tensor", TensorJson(*v.tensor)}};
        if (v.state) j["state"] = Render(*v.state);
        return j;
      }
      case Kind::kTensor: return TensorJson(*v.tensor);
      case Kind::kStorage:
        return {{"type", "storage"},
                {"storage_key", v.storage->key},
                {"storage_class", v.storage->storage_class},
                {"storage_numel", v.storage->numel},
                {"storage_location", v.storage->location},
                {"sha256", Sha256Hex(v.storage->bytes)}};
    }
    return {};
  }

 private:
  json Seq(const char* type, const std::vector<ValuePtr>& items) {
    json arr = json::array();
    for (const auto& it : items) arr.push_back(Render(*it));
    return {{"type", type}, {"items", arr}};
  }
  json Pairs(const std::vector<std::pair<ValuePtr, ValuePtr>>& entries) {
    json arr = json::array();
    for (const auto& [k, val] : entries) arr.push_back(json::array({Render(*k), Render(*val)}));
    return arr;
  }
  json TensorJson(const Tensor& t) {
    // Contiguous tensors are hashed in place; others are gathered first.
    std::vector<uint8_t> gathered;
    std::span<const uint8_t> bytes = t.contiguous_view();
    if (bytes.size() != t.nbytes()) {
      if (t.nbytes() > options_.max_gather_bytes)
        throw FormatError("tensor " + std::string(DTypeName(t.dtype)) + " of " + std::to_string(t.numel()) +
                          " elements over storage '" + t.storage->key + "' is too large to render: its strided view (" +
                          std::to_string(t.nbytes()) + " bytes) exceeds the limit of " +
                          std::to_string(options_.max_gather_bytes) + " bytes");
      gathered = t.contiguous_bytes();
      bytes = gathered;
    }
    json j = {{"type", "tensor"},
              {"dtype", std::string(DTypeName(t.dtype))},
              {"shape", t.shape},
              {"stride", t.stride},
              {"storage_offset", t.storage_offset},
              {"requires_grad", t.requires_grad},
              {"numel", t.numel()},
              {"storage_nbytes", t.storage->bytes.size()},
              {"sha256_of_contiguous_le_bytes", Sha256Hex(bytes)}};
    if (static_cast<size_t>(t.numel()) <= options_.values_limit) {
      json vals = json::array();
      size_t es = DTypeSize(t.dtype);
      for (size_t k = 0; k < bytes.size(); k += es) vals.push_back(ElementJson(t.dtype, bytes.data() + k));
      j["values"] = vals;
    }
    j["storage_key"] = t.storage->key;
    j["storage_class"] = t.storage->storage_class;
    j["storage_numel"] = t.storage->numel;
    j["storage_location"] = t.storage->location;
    j["rebuild"] = t.rebuild;
    if (t.attrs) j["attrs"] = Render(*t.attrs);
    if (t.metadata) j["metadata"] = Render(*t.metadata);
    return j;
  }

  const JsonOptions& options_;
  size_t nodes_ = 0;
};

// The number of nodes rendering `v` visits, counting a shared value once per
// reference (at most limit + 1). Memoized per value, so a small file whose
// references double at every level is measured without being expanded.
size_t ExpandedNodes(const Value& v, size_t limit, std::unordered_map<const Value*, size_t>& memo) {
  auto it = memo.find(&v);
  if (it != memo.end()) return it->second;
  size_t n = 1;
  auto add = [&](const ValuePtr& c) {
    if (c && n <= limit) n = std::min(limit + 1, n + ExpandedNodes(*c, limit, memo));
  };
  for (const auto& c : v.items) add(c);
  for (const auto& c : v.listitems) add(c);
  for (const auto& [k, val] : v.entries) {
    add(k);
    add(val);
  }
  add(v.state);
  add(v.kwargs);
  if (v.tensor) {
    add(v.tensor->attrs);
    add(v.tensor->metadata);
  }
  memo[&v] = n;
  return n;
}

}  // namespace

nlohmann::json ValueToJson(const Value& v, const JsonOptions& options) {
  std::unordered_map<const Value*, size_t> memo;
  if (ExpandedNodes(v, options.max_nodes, memo) > options.max_nodes)
    throw FormatError("value tree expands to more than " + std::to_string(options.max_nodes) +
                      " nodes through shared references");
  return Renderer(options).Render(v);
}

}  // namespace uckpt
