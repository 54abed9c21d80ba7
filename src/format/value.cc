#include "format/value.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

namespace uckpt {

std::shared_ptr<Storage> Storage::Owned(std::vector<uint8_t> data, DType dtype) {
  auto holder = std::make_shared<std::vector<uint8_t>>(std::move(data));
  return View(*holder, dtype, holder);
}

std::shared_ptr<Storage> Storage::View(std::span<const uint8_t> data, DType dtype, std::shared_ptr<const void> owner) {
  auto s = std::make_shared<Storage>();
  auto cls = DTypeStorageClass(dtype);
  if (cls.empty()) {
    s->storage_class = "torch.storage.UntypedStorage";
    s->numel = static_cast<int64_t>(data.size());
  } else {
    s->storage_class = "torch." + std::string(cls);
    s->numel = static_cast<int64_t>(data.size() / DTypeSize(dtype));
  }
  s->bytes = data;
  s->owner = std::move(owner);
  return s;
}

std::shared_ptr<Storage> Storage::Streamed(uint64_t size, DType dtype,
                                           std::function<void(uint64_t offset, std::span<uint8_t> into)> fill) {
  auto s = View({}, dtype, nullptr);
  s->numel = static_cast<int64_t>(
      size / std::max<size_t>(1, s->storage_class == "torch.storage.UntypedStorage" ? 1 : DTypeSize(dtype)));
  s->stream_size = size;
  s->fill = std::move(fill);
  return s;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> Tensor::ContiguousStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size());
  int64_t acc = 1;
  for (size_t k = shape.size(); k-- > 0;) {
    st[k] = acc;
    acc *= std::max<int64_t>(shape[k], 1);
  }
  return st;
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (size_t k = shape.size(); k-- > 0;) {
    if (shape[k] == 1) continue;
    if (shape[k] == 0) return true;
    if (stride[k] != expected) return false;
    expected *= shape[k];
  }
  return true;
}

std::span<const uint8_t> Tensor::contiguous_view() const {
  if (!is_contiguous() || !storage || storage->streamed()) return {};  // streamed: not in memory
  if (numel() == 0) return {};  // an empty view's offset may lie past the storage end
  size_t es = DTypeSize(dtype);
  return storage->bytes.subspan(static_cast<size_t>(storage_offset) * es, nbytes());
}

std::vector<uint8_t> Tensor::contiguous_bytes() const {
  if (storage && storage->streamed())
    throw std::logic_error("Tensor::contiguous_bytes: a streamed storage's bytes are not in memory");
  size_t es = DTypeSize(dtype);
  int64_t n = numel();
  std::vector<uint8_t> out(static_cast<size_t>(n) * es);
  if (n == 0) return out;
  if (is_contiguous()) {
    auto v = contiguous_view();
    std::memcpy(out.data(), v.data(), v.size());
    return out;
  }
  // Walk the index space in C order with an odometer.
  std::vector<int64_t> idx(shape.size(), 0);
  const uint8_t* base = storage->bytes.data();
  for (int64_t e = 0; e < n; ++e) {
    int64_t off = storage_offset;
    for (size_t k = 0; k < shape.size(); ++k) off += idx[k] * stride[k];
    std::memcpy(out.data() + static_cast<size_t>(e) * es, base + static_cast<size_t>(off) * es, es);
    for (size_t k = shape.size(); k-- > 0;) {
      if (++idx[k] < shape[k]) break;
      idx[k] = 0;
    }
  }
  return out;
}

Tensor Tensor::FromBytes(DType dtype, std::vector<int64_t> shape, std::vector<uint8_t> data) {
  Tensor t;
  t.dtype = dtype;
  t.stride = ContiguousStrides(shape);
  t.shape = std::move(shape);
  t.storage = Storage::Owned(std::move(data), dtype);
  if (DTypeStorageClass(dtype).empty()) t.rebuild = "torch._utils._rebuild_tensor_v3";
  return t;
}

namespace {
ValuePtr Make(Kind k) {
  auto v = std::make_shared<Value>();
  v->kind = k;
  return v;
}
}  // namespace

ValuePtr Value::None() { return Make(Kind::kNone); }
ValuePtr Value::Bool(bool b) {
  auto v = Make(Kind::kBool);
  v->b = b;
  return v;
}
ValuePtr Value::Int(int64_t i) {
  auto v = Make(Kind::kInt);
  v->i = i;
  return v;
}
ValuePtr Value::Float(double f) {
  auto v = Make(Kind::kFloat);
  v->f = f;
  return v;
}
ValuePtr Value::Str(std::string s) {
  auto v = Make(Kind::kStr);
  v->s = std::move(s);
  return v;
}
ValuePtr Value::Bytes(std::string s) {
  auto v = Make(Kind::kBytes);
  v->s = std::move(s);
  return v;
}
ValuePtr Value::List(std::vector<ValuePtr> items) {
  auto v = Make(Kind::kList);
  v->items = std::move(items);
  return v;
}
ValuePtr Value::Tuple(std::vector<ValuePtr> items) {
  auto v = Make(Kind::kTuple);
  v->items = std::move(items);
  return v;
}
ValuePtr Value::Dict(bool ordered) { return Make(ordered ? Kind::kOrderedDict : Kind::kDict); }
ValuePtr Value::FromTensor(Tensor t) {
  auto v = Make(Kind::kTensor);
  v->tensor = std::make_shared<Tensor>(std::move(t));
  return v;
}
ValuePtr Value::Size(const std::vector<int64_t>& dims) {
  auto v = Make(Kind::kTorchSize);
  for (int64_t d : dims) v->items.push_back(Int(d));
  return v;
}
ValuePtr Value::Dtype(DType d) {
  auto v = Make(Kind::kTorchDtype);
  v->s = std::string(DTypeName(d));
  return v;
}
ValuePtr Value::Object(std::string cls, ValuePtr args, bool newobj) {
  auto v = Make(Kind::kObject);
  v->s = std::move(cls);
  v->items.push_back(args ? std::move(args) : Tuple());
  v->newobj = newobj;
  return v;
}

ValuePtr Value::Global(const std::string& module, const std::string& name) {
  auto v = Make(Kind::kGlobal);
  v->s = module + "." + name;
  v->split = module.size();
  return v;
}

std::string Value::module() const {
  size_t at = split ? split : s.rfind('.');
  return at == std::string::npos ? std::string() : s.substr(0, at);
}

std::string Value::name() const {
  size_t at = split ? split : s.rfind('.');
  return at == std::string::npos ? s : s.substr(at + 1);
}

ValuePtr Value::get(std::string_view key) const {
  if (!is_dict() && kind != Kind::kObject) return nullptr;
  for (const auto& [k, v] : entries)
    if (k->kind == Kind::kStr && k->s == key) return v;
  return nullptr;
}

void Value::set(ValuePtr key, ValuePtr value) {
  // String keys (nearly all) compare directly; other hashable keys by HashKey.
  auto same = [&](const Value& k) { return k.kind == Kind::kStr && k.s == key->s; };
  if (key->kind != Kind::kStr) {
    const std::string hk = HashKey(*key);
    if (hk.empty()) {
      entries.emplace_back(std::move(key), std::move(value));
      return;
    }
    for (auto& e : entries)
      if (e.first->kind != Kind::kStr && HashKey(*e.first) == hk) {
        e.second = std::move(value);
        return;
      }
  } else {
    for (auto& e : entries)
      if (same(*e.first)) {
        e.second = std::move(value);
        return;
      }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

std::string KindName(const Value& v) {
  switch (v.kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kComplex: return "complex";
    case Kind::kStr: return "str";
    case Kind::kBytes: return "bytes";
    case Kind::kByteArray: return "bytearray";
    case Kind::kList: return "list";
    case Kind::kTuple: return "tuple";
    case Kind::kDict: return "dict";
    case Kind::kOrderedDict: return "OrderedDict";
    case Kind::kSet: return "set";
    case Kind::kFrozenSet: return "frozenset";
    case Kind::kTensor: return "tensor";
    case Kind::kParameter: return "Parameter";
    case Kind::kTorchSize: return "torch.Size";
    case Kind::kTorchDevice: return "torch.device";
    case Kind::kTorchDtype: return "torch.dtype";
    case Kind::kGlobal: return "global " + v.s;
    case Kind::kObject: return "object " + v.s;
    case Kind::kStorage: return "storage";
  }
  return "?";
}

std::string HashKey(const Value& v) {
  switch (v.kind) {
    case Kind::kNone: return "N";
    // Python: True == 1 and hash(True) == hash(1), so they are the same key.
    case Kind::kBool: return "i" + std::to_string(v.b ? 1 : 0);
    case Kind::kInt: return v.big.empty() ? "i" + std::to_string(v.i) : "I" + IntToDecimal(v);
    case Kind::kFloat: {
      // Range first: converting NaN or a huge float to int64 is undefined.
      if (v.f > -9e18 && v.f < 9e18 && v.f == static_cast<double>(static_cast<int64_t>(v.f)))
        return "i" + std::to_string(static_cast<int64_t>(v.f));
      return "f" + std::to_string(std::bit_cast<uint64_t>(v.f));
    }
    case Kind::kStr: return "s" + std::to_string(v.s.size()) + ":" + v.s;
    case Kind::kBytes: return "b" + std::to_string(v.s.size()) + ":" + v.s;
    case Kind::kTuple: {
      std::string out = "t(";
      for (const auto& it : v.items) {
        std::string k = HashKey(*it);
        if (k.empty()) return {};
        out += k + ",";
      }
      return out + ")";
    }
    default: return {};
  }
}

std::string IntToDecimal(const Value& v) {
  if (v.kind == Kind::kBool) return v.b ? "1" : "0";
  if (v.big.empty()) return std::to_string(v.i);
  // Two's complement little-endian bytes -> magnitude, then repeated division.
  std::vector<uint8_t> mag = v.big;
  bool neg = mag.back() & 0x80;
  if (neg) {
    for (auto& b : mag) b = static_cast<uint8_t>(~b);
    for (auto& b : mag)
      if (++b != 0) break;
  }
  std::string digits;
  std::vector<uint32_t> words;  // base 2^32, little-endian
  for (size_t k = 0; k < mag.size(); k += 4) {
    uint32_t w = 0;
    for (size_t j = 0; j < 4 && k + j < mag.size(); ++j) w |= uint32_t{mag[k + j]} << (8 * j);
    words.push_back(w);
  }
  while (!words.empty() && words.back() == 0) words.pop_back();
  if (words.empty()) return "0";
  while (!words.empty()) {
    uint64_t rem = 0;
    for (size_t k = words.size(); k-- > 0;) {
      uint64_t cur = (rem << 32) | words[k];
      words[k] = static_cast<uint32_t>(cur / 1000000000u);
      rem = cur % 1000000000u;
    }
    while (!words.empty() && words.back() == 0) words.pop_back();
    std::string chunk = std::to_string(rem);
    if (!words.empty()) chunk.insert(0, 9 - chunk.size(), '0');
    digits.insert(0, chunk);
  }
  return neg ? "-" + digits : digits;
}

}  // namespace uckpt

namespace uckpt {
namespace {

class StorageRelocator {
 public:
  explicit StorageRelocator(const std::string& location) : location_(location) {}

  ValuePtr Copy(const ValuePtr& v) {
    if (!v) return v;
    if (auto it = values_.find(v.get()); it != values_.end()) return it->second;
    auto out = std::make_shared<Value>(*v);
    values_[v.get()] = out;  // before the children: a cycle meets the copy
    for (ValuePtr& item : out->items) item = Copy(item);
    for (ValuePtr& item : out->listitems) item = Copy(item);
    for (auto& [key, value] : out->entries) {
      key = Copy(key);
      value = Copy(value);
    }
    out->state = Copy(out->state);
    out->kwargs = Copy(out->kwargs);
    if (out->tensor) {
      out->tensor = std::make_shared<Tensor>(*out->tensor);
      out->tensor->storage = Relocated(out->tensor->storage);
      out->tensor->attrs = Copy(out->tensor->attrs);
      out->tensor->metadata = Copy(out->tensor->metadata);
    }
    out->storage = Relocated(out->storage);
    return out;
  }

 private:
  std::shared_ptr<Storage> Relocated(const std::shared_ptr<Storage>& s) {
    if (!s) return s;
    auto [it, fresh] = storages_.emplace(s.get(), nullptr);
    if (fresh) {
      it->second = std::make_shared<Storage>(*s);  // the bytes stay where they are (owner shared)
      it->second->location = location_;
    }
    return it->second;
  }

  std::string location_;
  std::unordered_map<const Value*, ValuePtr> values_;
  std::unordered_map<const Storage*, std::shared_ptr<Storage>> storages_;
};

}  // namespace

ValuePtr WithStorageLocation(const ValuePtr& v, const std::string& location) {
  return StorageRelocator(location).Copy(v);
}

}  // namespace uckpt
