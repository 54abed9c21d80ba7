// The pickle reader's globals and calls (pickle_machine.h): a GLOBAL named
// and checked against the strict allow-list, REDUCE/BUILD/SETITEM applied to
// the values uckpt models (tensors, containers, DeepSpeed's classes; others
// stay inert objects), and the result's shape checked.
#include <cmath>
#include <cstring>

#include "format/pickle_machine.h"
#include "format/strict_globals.h"

namespace uckpt::pickle_vm {
namespace {

// Python 2 names that protocol-2 pickles use, mapped to Python 3 (the subset of
// _compat_pickle that can appear in checkpoints), plus torch's own rename.
std::pair<std::string, std::string> RenameGlobal(std::string module, std::string name) {
  if (module == "__builtin__") {
    module = "builtins";
    if (name == "xrange") name = "range";
    if (name == "unicode" || name == "basestring") name = "str";
    if (name == "long") name = "int";
  } else if (module == "copy_reg") {
    module = "copyreg";
  } else if (module == "exceptions") {
    module = "builtins";
    if (name == "StandardError") name = "Exception";
  } else if (module == "UserDict" && name == "UserDict") {
    module = "collections";
  } else if (module == "torch.tensor") {
    module = "torch._tensor";
  }
  return {module, name};
}

// UTF-8 -> latin-1 bytes (what _codecs.encode(s, 'latin1') does); false if a
// code point is above 255 or the text is not valid UTF-8.
bool Utf8ToLatin1(const std::string& in, std::string& out) {
  out.clear();
  for (size_t k = 0; k < in.size();) {
    uint8_t c = static_cast<uint8_t>(in[k]);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      k += 1;
    } else if ((c & 0xE0) == 0xC0 && k + 1 < in.size()) {
      uint32_t cp = ((c & 0x1Fu) << 6) | (static_cast<uint8_t>(in[k + 1]) & 0x3Fu);
      if (cp > 0xFF) return false;
      out.push_back(static_cast<char>(cp));
      k += 2;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

ValuePtr MakeSet(Kind kind, std::vector<ValuePtr> items) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  v->items = std::move(items);
  return v;
}

constexpr const char* kStrictWhy = "(not a tensor, container or DeepSpeed class; see docs/security.md)";

ValuePtr Machine::MakeGlobal(std::string module, std::string name) {
  auto [m, n] = RenameGlobal(module, name);
  if (strict_ && !(m == "builtins" && n == "getattr") && !StrictAllowsGlobal(m + "." + n)) {
    std::string as_written = module + "." + name;
    Fail("strict mode refuses global " + m + "." + n +
         (as_written != m + "." + n ? " (written " + as_written + ")" : "") + " " + kStrictWhy);
  }
  if (m == "torch") {
    if (auto d = DTypeFromName(n)) return Value::Dtype(*d);
  }
  return Value::Global(m, n);
}

void Machine::SetItem(Value& target, ValuePtr key, ValuePtr value) {
  if (target.kind == Kind::kObject) {
    target.entries.emplace_back(std::move(key), std::move(value));
    return;
  }
  if (!target.is_dict()) Fail("SETITEM on a " + KindName(target));
  std::string hk = HashKey(*key);
  if (hk.empty()) Fail("unhashable dict key of type " + KindName(*key));
  auto& index = dict_index_[&target];
  auto it = index.find(hk);
  if (it != index.end()) {
    target.entries[it->second].second = std::move(value);
  } else {
    index.emplace(std::move(hk), target.entries.size());
    target.entries.emplace_back(std::move(key), std::move(value));
  }
}

void Machine::Append(Value& target, ValuePtr item) {
  if (target.kind == Kind::kList) {
    target.items.push_back(std::move(item));
  } else if (target.kind == Kind::kObject) {
    target.listitems.push_back(std::move(item));
  } else {
    Fail("APPEND on a " + KindName(target));
  }
}

void Machine::Build(Value& target, ValuePtr state) {
  switch (target.kind) {
    case Kind::kOrderedDict:
    case Kind::kObject:
    case Kind::kParameter: target.state = std::move(state); return;
    case Kind::kTensor:
      // torch restores Python attributes of a tensor this way.
      target.tensor->attrs = std::move(state);
      return;
    default: Fail("BUILD on a " + KindName(target));
  }
}

namespace {
bool IsInt(const ValuePtr& v) { return v && (v->kind == Kind::kInt && v->big.empty()); }
bool IntTuple(const ValuePtr& v, std::vector<int64_t>& out) {
  if (!v || (v->kind != Kind::kTuple && v->kind != Kind::kList && v->kind != Kind::kTorchSize)) return false;
  out.clear();
  for (const auto& it : v->items) {
    if (!IsInt(it)) return false;
    out.push_back(it->i);
  }
  return true;
}
}  // namespace

ValuePtr Machine::RebuildTensor(const std::string& fn, const std::vector<ValuePtr>& a) {
  const bool v3 = fn == "_rebuild_tensor_v3";
  const bool v1 = fn == "_rebuild_tensor";
  size_t min_args = v1 ? 4 : (v3 ? 7 : 6);
  if (a.size() < min_args || a.size() > min_args + 1)
    Fail("torch._utils." + fn + " called with " + std::to_string(a.size()) + " arguments");
  if (a[0]->kind != Kind::kStorage) Fail("torch._utils." + fn + ": first argument is not a storage");
  Tensor t;
  t.storage = a[0]->storage;
  t.rebuild = "torch._utils." + fn;
  if (v3) {
    if (a[6]->kind != Kind::kTorchDtype) Fail("_rebuild_tensor_v3: 7th argument is not a dtype");
    t.dtype = *DTypeFromName(a[6]->s);
  } else {
    auto cls = t.storage->storage_class;
    auto d = cls.rfind("torch.", 0) == 0 ? DTypeFromStorageClass(cls.substr(6)) : std::nullopt;
    if (!d) Fail("torch._utils." + fn + " on storage class " + cls + " which has no element type");
    t.dtype = *d;
  }
  if (!IsInt(a[1]) || !IntTuple(a[2], t.shape) || !IntTuple(a[3], t.stride))
    Fail("torch._utils." + fn + ": offset, size or stride is not made of integers");
  t.storage_offset = a[1]->i;
  if (!v1) {
    if (a[4]->kind != Kind::kBool) Fail("torch._utils." + fn + ": requires_grad is not a bool");
    t.requires_grad = a[4]->b;
    size_t meta = v3 ? 7 : 6;
    if (a.size() > meta && a[meta]->kind != Kind::kNone) {
      if (!a[meta]->is_dict() || !a[meta]->entries.empty()) t.metadata = a[meta];
    }
  }
  if (t.shape.size() != t.stride.size()) Fail("tensor size and stride have different lengths");
  // The whole view must lie inside the storage.
  const size_t es = DTypeSize(t.dtype);
  const uint64_t storage_elems = t.storage->bytes.size() / es;
  if (t.storage_offset < 0) Fail("negative storage offset");
  bool empty = false;
  for (size_t k = 0; k < t.shape.size(); ++k) {
    if (t.shape[k] < 0 || t.stride[k] < 0) Fail("negative size or stride");
    if (t.shape[k] == 0) empty = true;
  }
  if (!empty) {
    unsigned __int128 last = static_cast<uint64_t>(t.storage_offset);
    unsigned __int128 count = 1;
    for (size_t k = 0; k < t.shape.size(); ++k) {
      last += static_cast<unsigned __int128>(t.shape[k] - 1) * static_cast<uint64_t>(t.stride[k]);
      count *= static_cast<uint64_t>(t.shape[k]);
      // In bytes, so that numel * element size never overflows 64 bits.
      if (count * es > (unsigned __int128)1 << 62) Fail("tensor has too many elements");
    }
    if (last >= storage_elems)
      Fail("tensor view (offset " + std::to_string(t.storage_offset) + ") reaches past the end of storage '" +
           t.storage->key + "' (" + std::to_string(storage_elems) + " elements)");
  }
  return Value::FromTensor(std::move(t));
}

// REDUCE / INST / OBJ: a call of a global. Known builders become typed
// values (each Call* returns null when the arguments do not fit it); any
// other call becomes an inert object.
ValuePtr Machine::Call(const ValuePtr& callable, const ValuePtr& args) {
  if (callable->kind != Kind::kGlobal) Fail("call of a " + KindName(*callable) + ", which is not a class or function");
  if (args->kind != Kind::kTuple) Fail("call arguments are a " + KindName(*args) + ", not a tuple");
  const std::string& path = callable->s;
  const std::string mod = callable->module(), fn = callable->name();
  const auto& a = args->items;
  if (strict_ && path == "builtins.getattr") CheckStrictGetattr(args);

  ValuePtr v;
  if (mod == "torch._utils") v = CallTorchUtils(fn, a);
  else if (path == "torch._tensor._rebuild_from_type_v2") v = CallRebuildFromType(a);
  else if (path == "collections.OrderedDict") v = CallOrderedDict(a);
  else if (mod == "builtins") v = CallBuiltin(fn, a);
  else v = CallOther(path, a);
  return v ? v : Value::Object(path, args, false);
}

ValuePtr Machine::CallTorchUtils(const std::string& fn, const std::vector<ValuePtr>& a) {
  if (fn == "_rebuild_tensor_v2" || fn == "_rebuild_tensor_v3" || fn == "_rebuild_tensor") return RebuildTensor(fn, a);
  if ((fn == "_rebuild_parameter" && a.size() == 3) || (fn == "_rebuild_parameter_with_state" && a.size() == 4)) {
    if (a[0]->kind != Kind::kTensor || a[1]->kind != Kind::kBool) Fail("torch._utils." + fn + ": bad arguments");
    auto p = std::make_shared<Value>();
    p->kind = Kind::kParameter;
    p->tensor = a[0]->tensor;
    p->b = a[1]->b;
    if (a.size() == 4 && !(a[3]->is_dict() && a[3]->entries.empty())) p->state = a[3];
    return p;
  }
  return nullptr;
}

// _rebuild_from_type_v2(rebuild, torch.Tensor or Parameter, args, attrs).
ValuePtr Machine::CallRebuildFromType(const std::vector<ValuePtr>& a) {
  if (a.size() != 4 || a[0]->kind != Kind::kGlobal || a[1]->kind != Kind::kGlobal || a[2]->kind != Kind::kTuple)
    return nullptr;
  ValuePtr inner = Call(a[0], a[2]);
  if (a[1]->s == "torch.Tensor" && inner->kind == Kind::kTensor) {
    if (!(a[3]->is_dict() && a[3]->entries.empty())) inner->tensor->attrs = a[3];
    return inner;
  }
  if (a[1]->s == "torch.nn.parameter.Parameter" && inner->kind == Kind::kTensor) {
    auto p = std::make_shared<Value>();
    p->kind = Kind::kParameter;
    p->tensor = inner->tensor;
    p->b = inner->tensor->requires_grad;
    inner->tensor->requires_grad = false;
    if (!(a[3]->is_dict() && a[3]->entries.empty())) p->state = a[3];
    return p;
  }
  return nullptr;
}

ValuePtr Machine::CallOrderedDict(const std::vector<ValuePtr>& a) {
  auto d = Value::Dict(true);
  if (a.empty()) return d;
  if (a.size() == 1 && (a[0]->kind == Kind::kList || a[0]->kind == Kind::kTuple)) {
    for (const auto& pair : a[0]->items) {
      if (pair->kind != Kind::kTuple || pair->items.size() != 2) {
        // d dies here; its key index must not outlive it, or a dict later
        // allocated at the same address would inherit it.
        dict_index_.erase(d.get());
        return nullptr;
      }
      SetItem(*d, pair->items[0], pair->items[1]);
    }
    return d;
  }
  return nullptr;
}

ValuePtr Machine::CallBuiltin(const std::string& fn, const std::vector<ValuePtr>& a) {
  if ((fn == "set" || fn == "frozenset") && a.size() <= 1) {
    if (a.size() == 1 && a[0]->kind != Kind::kList && a[0]->kind != Kind::kTuple) return nullptr;
    return MakeSet(fn == "set" ? Kind::kSet : Kind::kFrozenSet, a.empty() ? std::vector<ValuePtr>{} : a[0]->items);
  }
  if (fn == "bytes" && a.empty()) return Value::Bytes("");
  if (fn == "bytearray" && a.size() <= 1) {
    if (a.size() == 1 && a[0]->kind != Kind::kBytes) return nullptr;
    auto v = Value::Bytes(a.empty() ? "" : a[0]->s);
    v->kind = Kind::kByteArray;
    return v;
  }
  if (fn == "complex" && a.size() == 2 && a[0]->kind == Kind::kFloat && a[1]->kind == Kind::kFloat) {
    auto v = std::make_shared<Value>();
    v->kind = Kind::kComplex;
    v->f = a[0]->f;
    v->imag = a[1]->f;
    return v;
  }
  return nullptr;
}

// _codecs.encode(text, 'latin1') (how protocol 2 writes bytes), torch.Size, torch.device.
ValuePtr Machine::CallOther(const std::string& path, const std::vector<ValuePtr>& a) {
  if (path == "_codecs.encode" && a.size() == 2 && a[0]->kind == Kind::kStr && a[1]->kind == Kind::kStr &&
      (a[1]->s == "latin1" || a[1]->s == "latin-1")) {
    std::string raw;
    if (!Utf8ToLatin1(a[0]->s, raw)) return nullptr;
    return Value::Bytes(std::move(raw));
  }
  if (path == "torch.Size" && a.size() == 1) {
    std::vector<int64_t> dims;
    if (IntTuple(a[0], dims)) return Value::Size(dims);
    return nullptr;
  }
  if (path == "torch.device" && !a.empty() && a.size() <= 2 && a[0]->kind == Kind::kStr) {
    auto v = std::make_shared<Value>();
    v->kind = Kind::kTorchDevice;
    v->s = a[0]->s;
    if (a.size() == 2) {
      if (!IsInt(a[1])) return nullptr;
      v->s += ":" + std::to_string(a[1]->i);
    }
    return v;
  }
  return nullptr;
}

// Strict mode takes getattr only as getattr(ZeroStageEnum, member).
void Machine::CheckStrictGetattr(const ValuePtr& args) {
  const auto& a = args->items;
  if (a.size() == 2 && a[0]->kind == Kind::kGlobal && a[1]->kind == Kind::kStr && StrictAllowsGetattr(a[0]->s, a[1]->s))
    return;
  std::string what = "builtins.getattr";
  if (a.size() == 2 && a[0]->kind == Kind::kGlobal && a[1]->kind == Kind::kStr)
    what += "(" + a[0]->s + ", '" + a[1]->s.substr(0, 64) + "')";
  Fail("strict mode refuses global " + what + " (getattr is only accepted as getattr(ZeroStageEnum, member))");
}

// A getattr that was never called (kept as a value, or memoized and fetched
// into the result) is refused too: only its one checked call is data.
void Machine::CheckStrictResult() {
  for (const Value* v : reachable_)
    if (v->kind == Kind::kGlobal && v->s == "builtins.getattr")
      Fail("strict mode refuses global builtins.getattr outside a getattr(ZeroStageEnum, member) call");
}

void Machine::CheckShape() {
  // Iterative depth-first walk: rejects cycles and nesting beyond the limit,
  // so that every later recursive walk of the tree is safe.
  std::unordered_map<const Value*, int> state;  // 1 = on path, 2 = done
  struct Frame {
    const Value* v;
    std::vector<const Value*> kids;
    size_t next;
  };
  auto children = [](const Value* v) {
    std::vector<const Value*> out;
    for (const auto& c : v->items) out.push_back(c.get());
    for (const auto& c : v->listitems) out.push_back(c.get());
    for (const auto& [k, val] : v->entries) {
      out.push_back(k.get());
      out.push_back(val.get());
    }
    if (v->state) out.push_back(v->state.get());
    if (v->kwargs) out.push_back(v->kwargs.get());
    if (v->tensor) {
      if (v->tensor->attrs) out.push_back(v->tensor->attrs.get());
      if (v->tensor->metadata) out.push_back(v->tensor->metadata.get());
    }
    return out;
  };
  std::vector<Frame> path;
  path.push_back({stack_.back().get(), children(stack_.back().get()), 0});
  state[stack_.back().get()] = 1;
  while (!path.empty()) {
    Frame& f = path.back();
    if (f.next == f.kids.size()) {
      state[f.v] = 2;
      reachable_.insert(f.v);
      path.pop_back();
      continue;
    }
    const Value* c = f.kids[f.next++];
    int& s = state[c];
    if (s == 1) Fail("the object graph contains a cycle (a container inside itself)");
    if (s == 2) continue;
    s = 1;
    if (path.size() >= limits_.max_depth) Fail("nesting deeper than " + std::to_string(limits_.max_depth));
    path.push_back({c, children(c), 0});
  }
}

}  // namespace uckpt::pickle_vm
