#include "ckpt/values.h"

#include "format/error.h"

namespace uckpt::ckpt {

void Fail(const std::string& where, const std::string& what) { throw FormatError(where + ": " + what); }

ValuePtr Need(const ValuePtr& dict, std::string_view key, const std::string& where) {
  if (!dict || !dict->is_dict())
    Fail(where, "expected a dict, found " + (dict ? KindName(*dict) : std::string("nothing")));
  ValuePtr v = dict->get(key);
  if (!v) Fail(where, "missing key '" + std::string(key) + "'");
  return v;
}

ValuePtr GetIntKey(const ValuePtr& dict, int64_t key) {
  if (!dict || !dict->is_dict()) return nullptr;
  for (const auto& [k, v] : dict->entries)
    if (k && k->kind == Kind::kInt && k->big.empty() && k->i == key) return v;
  return nullptr;
}

bool IsNone(const ValuePtr& v) { return !v || v->kind == Kind::kNone; }

int64_t AsInt(const ValuePtr& v, const std::string& where) {
  if (v && v->kind == Kind::kInt && v->big.empty()) return v->i;
  if (v && v->kind == Kind::kBool) return v->b ? 1 : 0;
  Fail(where, "expected an int, found " + (v ? KindName(*v) : std::string("nothing")));
}

const std::vector<ValuePtr>& AsList(const ValuePtr& v, const std::string& where) {
  if (!v || !v->is_seq()) Fail(where, "expected a list, found " + (v ? KindName(*v) : std::string("nothing")));
  return v->items;
}

const Tensor& AsTensor(const ValuePtr& v, const std::string& where) {
  if (!v || (v->kind != Kind::kTensor && v->kind != Kind::kParameter) || !v->tensor)
    Fail(where, "expected a tensor, found " + (v ? KindName(*v) : std::string("nothing")));
  return *v->tensor;
}

std::string AsStr(const ValuePtr& v, const std::string& where) {
  if (!v || v->kind != Kind::kStr) Fail(where, "expected a str, found " + (v ? KindName(*v) : std::string("nothing")));
  return v->s;
}

std::vector<int64_t> AsShape(const ValuePtr& v, const std::string& where) {
  if (!v || (v->kind != Kind::kTorchSize && !v->is_seq()))
    Fail(where, "expected a torch.Size, found " + (v ? KindName(*v) : std::string("nothing")));
  std::vector<int64_t> dims;
  for (const auto& d : v->items) {
    int64_t x = AsInt(d, where);
    if (x < 0) Fail(where, "negative dimension " + std::to_string(x));
    dims.push_back(x);
  }
  return dims;
}

int64_t NumelOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::span<const uint8_t> TensorElements(const Tensor& t, int64_t first, int64_t count, const std::string& where) {
  if (!t.is_contiguous()) Fail(where, "tensor is not contiguous");
  if (!t.storage) Fail(where, "tensor has no storage");
  const size_t es = DTypeSize(t.dtype);
  if (first < 0 || count < 0 || first + count > t.numel())
    Fail(where, "elements [" + std::to_string(first) + ", " + std::to_string(first + count) +
                    ") are outside the tensor of " + std::to_string(t.numel()) + " elements");
  const uint64_t begin = static_cast<uint64_t>(t.storage_offset + first) * es;
  const uint64_t size = static_cast<uint64_t>(count) * es;
  if (t.storage_offset < 0 || begin + size > t.storage->bytes.size())
    Fail(where, "tensor data runs past the end of its storage (" + std::to_string(t.storage->bytes.size()) + " bytes)");
  return t.storage->bytes.subspan(begin, size);
}

std::span<const uint8_t> TensorBytes(const Tensor& t, const std::string& where) {
  return TensorElements(t, 0, t.numel(), where);
}

std::vector<std::pair<std::string, ValuePtr>> NamedEntries(const ValuePtr& dict, const std::string& where) {
  if (!dict || !dict->is_dict())
    Fail(where, "expected a dict, found " + (dict ? KindName(*dict) : std::string("nothing")));
  std::vector<std::pair<std::string, ValuePtr>> out;
  for (const auto& [k, v] : dict->entries) {
    if (!k || k->kind != Kind::kStr)
      Fail(where, "expected str keys, found " + (k ? KindName(*k) : std::string("nothing")));
    out.emplace_back(k->s, v);
  }
  return out;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool SameValue(const ValuePtr& a, const ValuePtr& b) {
  if (!a || !b) return a == b;
  if (a->kind != b->kind) return false;
  if (a->kind == Kind::kTensor) {
    const Tensor &x = *a->tensor, &y = *b->tensor;
    if (x.dtype != y.dtype || x.shape != y.shape) return false;
    auto bx = x.contiguous_bytes(), by = y.contiguous_bytes();
    return bx == by;
  }
  if (a->kind == Kind::kInt) return a->i == b->i && a->big == b->big;
  if (a->kind == Kind::kFloat) return a->f == b->f;
  return HashKey(*a) == HashKey(*b) && !HashKey(*a).empty();
}

std::string StepText(const ValuePtr& v) {
  if (!v) return "none";
  if (v->kind == Kind::kTensor && v->tensor && v->tensor->numel() == 1) {
    auto b = v->tensor->contiguous_bytes();
    return std::to_string(ElementToDouble(v->tensor->dtype, b.data()));
  }
  if (v->kind == Kind::kInt) return std::to_string(v->i);
  if (v->kind == Kind::kFloat) return std::to_string(v->f);
  return KindName(*v);
}

}  // namespace uckpt::ckpt
