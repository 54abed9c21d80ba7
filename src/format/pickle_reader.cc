#include "format/pickle_reader.h"

#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "format/error.h"
#include "format/pickle_opcodes.h"
#include "format/strict_globals.h"

namespace uckpt {
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

// Appends code point `cp` to `out` as UTF-8 (surrogates passed through, as
// Python's "surrogatepass" does).
void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
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

ValuePtr MakeSet(Kind kind, std::vector<ValuePtr> items) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  v->items = std::move(items);
  return v;
}

// Normalizes little-endian two's complement bytes into an int value.
ValuePtr IntFromBytes(const uint8_t* p, size_t n) {
  auto v = Value::Int(0);
  if (n == 0) return v;
  // Drop redundant sign-extension bytes.
  while (n > 1 && ((p[n - 1] == 0x00 && !(p[n - 2] & 0x80)) || (p[n - 1] == 0xFF && (p[n - 2] & 0x80)))) --n;
  if (n <= 8) {
    uint64_t u = 0;
    for (size_t k = 0; k < n; ++k) u |= uint64_t{p[k]} << (8 * k);
    if (n < 8 && (p[n - 1] & 0x80)) u |= ~uint64_t{0} << (8 * n);
    v->i = static_cast<int64_t>(u);
  } else {
    v->big.assign(p, p + n);
  }
  return v;
}

// Parses a decimal integer of any size (text opcodes INT / LONG).
// Python refuses decimal integers of more than 4300 digits (its
// int_max_str_digits); so do we, which also keeps this quadratic loop cheap.
constexpr size_t kMaxDecimalDigits = 4300;

ValuePtr IntFromDecimal(std::string text, size_t max_bytes) {
  if (!text.empty() && (text.back() == 'L')) text.pop_back();
  bool neg = false;
  size_t k = 0;
  if (k < text.size() && (text[k] == '-' || text[k] == '+')) neg = text[k++] == '-';
  if (k == text.size() || text.size() - k > kMaxDecimalDigits) return nullptr;
  std::vector<uint8_t> mag{0};
  for (; k < text.size(); ++k) {
    if (text[k] < '0' || text[k] > '9') return nullptr;
    uint32_t carry = static_cast<uint32_t>(text[k] - '0');
    for (auto& b : mag) {
      uint32_t cur = b * 10u + carry;
      b = static_cast<uint8_t>(cur & 0xFF);
      carry = cur >> 8;
    }
    if (carry) mag.push_back(static_cast<uint8_t>(carry));
    if (mag.size() > max_bytes) return nullptr;
  }
  mag.push_back(0);  // room for the sign bit
  if (neg) {
    for (auto& b : mag) b = static_cast<uint8_t>(~b);
    for (auto& b : mag)
      if (++b != 0) break;
  }
  return IntFromBytes(mag.data(), mag.size());
}

class Machine {
 public:
  Machine(std::span<const uint8_t> data, const std::string& where, const PersistentLoader& load,
          const PickleLimits& limits, PicklePolicy policy)
      : data_(data), where_(where), load_(load), limits_(limits), strict_(policy == PicklePolicy::kStrict) {}

  ~Machine() {
    // Values left out of the result (all of them on failure) may hold cycles
    // or very deep chains; cut their edges first so that freeing them neither
    // leaks nor recurses deeply.
    for (auto& v : created_) {
      if (done_ && reachable_.count(v.get())) continue;
      v->items.clear();
      v->entries.clear();
      v->listitems.clear();
      v->state.reset();
      v->kwargs.reset();
      v->tensor.reset();  // a tensor's attrs can lead back to it
    }
  }

  ValuePtr Run();

 private:
  [[noreturn]] void Fail(const std::string& what) const {
    throw FormatError(where_ + ": pickle offset " + std::to_string(op_pos_) + ": " + what);
  }
  const uint8_t* Take(size_t n) {
    if (data_.size() - pos_ < n) Fail("unexpected end of data");
    const uint8_t* p = data_.data() + pos_;
    pos_ += n;
    return p;
  }
  uint8_t U8() { return *Take(1); }
  uint32_t U32() {
    const uint8_t* p = Take(4);
    return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
  }
  uint64_t U64() {
    uint64_t lo = U32();
    return lo | (uint64_t{U32()} << 32);
  }
  std::string Line() {
    const uint8_t* start = data_.data() + pos_;
    const void* nl = std::memchr(start, '\n', data_.size() - pos_);
    if (!nl) Fail("unterminated text argument");
    size_t n = static_cast<const uint8_t*>(nl) - start;
    pos_ += n + 1;
    return std::string(reinterpret_cast<const char*>(start), n);
  }
  std::string Bytes(uint64_t n) {
    if (n > data_.size() - pos_) Fail("length " + std::to_string(n) + " runs past the end of data");
    const uint8_t* p = Take(static_cast<size_t>(n));
    return std::string(reinterpret_cast<const char*>(p), static_cast<size_t>(n));
  }

  ValuePtr Track(ValuePtr v) {
    if (v->kind == Kind::kList || v->kind == Kind::kTuple || v->kind == Kind::kDict ||
        v->kind == Kind::kOrderedDict || v->kind == Kind::kSet || v->kind == Kind::kFrozenSet ||
        v->kind == Kind::kObject || v->kind == Kind::kParameter || v->kind == Kind::kTensor)
      created_.push_back(v);
    return v;
  }
  void Push(ValuePtr v) {
    if (stack_.size() >= limits_.max_stack) Fail("stack limit exceeded");
    stack_.push_back(Track(std::move(v)));
  }
  size_t Base() const { return marks_.empty() ? 0 : marks_.back(); }
  ValuePtr Pop() {
    if (stack_.size() <= Base()) Fail("stack underflow");
    ValuePtr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  ValuePtr& Top() {
    if (stack_.size() <= Base()) Fail("stack underflow");
    return stack_.back();
  }
  std::vector<ValuePtr> PopMark() {
    if (marks_.empty()) Fail("no MARK on the stack");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> items(std::make_move_iterator(stack_.begin() + static_cast<ptrdiff_t>(m)),
                                std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return items;
  }
  void Put(uint64_t idx) {
    if (memo_.size() >= limits_.max_memo && !memo_.count(idx)) Fail("memo limit exceeded");
    memo_[idx] = Top();
  }
  ValuePtr Get(uint64_t idx) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) Fail("memo key " + std::to_string(idx) + " is not defined");
    return it->second;
  }

  ValuePtr MakeGlobal(std::string module, std::string name);
  void CheckStrictGetattr(const ValuePtr& args);
  void CheckStrictResult();
  ValuePtr Call(const ValuePtr& callable, const ValuePtr& args);
  ValuePtr CallTorchUtils(const std::string& fn, const std::vector<ValuePtr>& a);
  ValuePtr CallRebuildFromType(const std::vector<ValuePtr>& a);
  ValuePtr CallOrderedDict(const std::vector<ValuePtr>& a);
  ValuePtr CallBuiltin(const std::string& fn, const std::vector<ValuePtr>& a);
  ValuePtr CallOther(const std::string& path, const std::vector<ValuePtr>& a);
  ValuePtr RebuildTensor(const std::string& fn, const std::vector<ValuePtr>& a);
  void SetItem(Value& target, ValuePtr key, ValuePtr value);
  void Append(Value& target, ValuePtr item);
  void Build(Value& target, ValuePtr state);
  void CheckShape();

  // The VM: Run() dispatches each opcode to its group's handler
  // (pickle::Group); the handlers switch on the opcode.
  [[noreturn]] void UnknownOpcode(uint8_t op) const;
  [[noreturn]] void NoHandler(uint8_t op) const;
  ValuePtr Stop();
  void Framing(uint8_t op);
  void StackOp(uint8_t op);
  void Constant(uint8_t op);
  void Integer(uint8_t op);
  void Float(uint8_t op);
  void String(uint8_t op);
  std::string QuotedString(const std::string& line);
  std::string RawUnicode(const std::string& line);
  void Container(uint8_t op);
  void Fill(uint8_t op);
  void Object(uint8_t op);
  void NewObject(uint8_t op);
  void Memo(uint8_t op);
  uint64_t LineIndex(const char* error);
  void Persistent(uint8_t op);

  std::span<const uint8_t> data_;
  const std::string& where_;
  const PersistentLoader& load_;
  const PickleLimits& limits_;
  const bool strict_;
  size_t pos_ = 0, op_pos_ = 0;
  std::vector<ValuePtr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, ValuePtr> memo_;
  std::vector<ValuePtr> created_;
  // Key index of large dicts so that SETITEMS stays linear.
  std::unordered_map<const Value*, std::unordered_map<std::string, size_t>> dict_index_;
  bool done_ = false;
  std::unordered_set<const Value*> reachable_;  // from the result, filled by CheckShape
};

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
    case Kind::kParameter:
      target.state = std::move(state);
      return;
    case Kind::kTensor:
      // torch restores Python attributes of a tensor this way.
      target.tensor->attrs = std::move(state);
      return;
    default:
      Fail("BUILD on a " + KindName(target));
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
  if (callable->kind != Kind::kGlobal)
    Fail("call of a " + KindName(*callable) + ", which is not a class or function");
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
  if (a.size() == 2 && a[0]->kind == Kind::kGlobal && a[1]->kind == Kind::kStr &&
      StrictAllowsGetattr(a[0]->s, a[1]->s))
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

// ---- The VM loop and one handler per opcode group ---------------------------
//
// Run() looks each byte up in pickle::kOpcodeTable and hands it to its group's
// handler, which switches on the opcode. Adding an opcode to a group means a
// table entry and a case in that group's handler; a table entry without one
// fails loudly (NoHandler) instead of being skipped.

ValuePtr Machine::Run() {
  using pickle::Group;
  while (true) {
    op_pos_ = pos_;
    const uint8_t op = U8();
    const pickle::OpInfo* info = pickle::FindOpcode(op);
    if (!info) UnknownOpcode(op);
    switch (info->group) {
      case Group::kFraming:
        if (op == pickle::kStop) return Stop();
        Framing(op);
        break;
      case Group::kStack: StackOp(op); break;
      case Group::kConstant: Constant(op); break;
      case Group::kInteger: Integer(op); break;
      case Group::kFloat: Float(op); break;
      case Group::kString: String(op); break;
      case Group::kContainer: Container(op); break;
      case Group::kObject: Object(op); break;
      case Group::kMemo: Memo(op); break;
      case Group::kPersistent: Persistent(op); break;
      // Both would need Python-side state (the copyreg registry, buffers
      // handed to the unpickler) that a torch file cannot carry.
      case Group::kExtension: Fail("extension-registry opcodes (EXT1/2/4) are not supported");
      case Group::kBuffer: Fail("out-of-band buffers (protocol 5) are not supported");
    }
  }
}

void Machine::UnknownOpcode(uint8_t op) const {
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02x", op);
  Fail(std::string("unknown opcode ") + hex);
}

void Machine::NoHandler(uint8_t op) const {
  Fail("opcode " + std::string(pickle::FindOpcode(op)->name) + " has no handler in its group (a uckpt bug)");
}

// STOP: the top of the stack is the result; check its shape before handing it out.
ValuePtr Machine::Stop() {
  ValuePtr result = Pop();
  stack_.assign(1, result);
  CheckShape();
  if (strict_) CheckStrictResult();
  done_ = true;
  return result;
}

void Machine::Framing(uint8_t op) {
  switch (op) {
    case pickle::kProto:
      if (U8() > pickle::kHighestProtocol) Fail("unsupported pickle protocol");
      return;
    case pickle::kFrame: Take(8); return;  // a length hint only
    default: NoHandler(op);
  }
}

void Machine::StackOp(uint8_t op) {
  switch (op) {
    case pickle::kMark: marks_.push_back(stack_.size()); return;
    case pickle::kPop:  // pops the mark when nothing is above it, like Python
      if (stack_.size() > Base()) stack_.pop_back();
      else if (!marks_.empty()) marks_.pop_back();
      else Fail("POP on an empty stack");
      return;
    case pickle::kPopMark: PopMark(); return;
    case pickle::kDup: Push(Top()); return;
    default: NoHandler(op);
  }
}

void Machine::Constant(uint8_t op) {
  switch (op) {
    case pickle::kNone: Push(Value::None()); return;
    case pickle::kNewTrue: Push(Value::Bool(true)); return;
    case pickle::kNewFalse: Push(Value::Bool(false)); return;
    default: NoHandler(op);
  }
}

void Machine::Integer(uint8_t op) {
  switch (op) {
    case pickle::kBinInt1: Push(Value::Int(U8())); return;
    case pickle::kBinInt2: {
      const uint8_t* p = Take(2);
      Push(Value::Int(p[0] | (p[1] << 8)));
      return;
    }
    case pickle::kBinInt: Push(Value::Int(static_cast<int32_t>(U32()))); return;
    case pickle::kLong1: {
      size_t n = U8();
      Push(IntFromBytes(Take(n), n));
      return;
    }
    case pickle::kLong4: {
      int32_t n = static_cast<int32_t>(U32());
      if (n < 0) Fail("negative LONG4 length");
      if (static_cast<size_t>(n) > limits_.max_int_bytes) Fail("integer of " + std::to_string(n) + " bytes exceeds the limit");
      Push(IntFromBytes(Take(static_cast<size_t>(n)), static_cast<size_t>(n)));
      return;
    }
    case pickle::kInt: {  // text; protocol 0 wrote bools as INT 01 / 00
      std::string t = Line();
      if (t == "01" || t == "00") return Push(Value::Bool(t == "01"));
      auto v = IntFromDecimal(t, limits_.max_int_bytes);
      if (!v) Fail("bad or over-long INT text");
      return Push(v);
    }
    case pickle::kLong: {
      auto v = IntFromDecimal(Line(), limits_.max_int_bytes);
      if (!v) Fail("bad or over-long LONG text");
      return Push(v);
    }
    default: NoHandler(op);
  }
}

void Machine::Float(uint8_t op) {
  switch (op) {
    case pickle::kBinFloat: {  // big-endian
      const uint8_t* p = Take(8);
      uint64_t u = 0;
      for (int k = 0; k < 8; ++k) u = (u << 8) | p[k];
      return Push(Value::Float(std::bit_cast<double>(u)));
    }
    case pickle::kFloat: {  // text
      std::string t = Line();
      char* end = nullptr;
      double d = std::strtod(t.c_str(), &end);
      if (t.empty() || end != t.c_str() + t.size()) Fail("bad FLOAT text");
      return Push(Value::Float(d));
    }
    default: NoHandler(op);
  }
}

void Machine::String(uint8_t op) {
  switch (op) {
    case pickle::kBinUnicode: return Push(Value::Str(Bytes(U32())));
    case pickle::kShortBinUnicode: return Push(Value::Str(Bytes(U8())));
    case pickle::kBinUnicode8: return Push(Value::Str(Bytes(U64())));
    // Python 2 str: read as text, as torch.load's default encoding does.
    case pickle::kBinString: return Push(Value::Str(Bytes(U32())));
    case pickle::kShortBinString: return Push(Value::Str(Bytes(U8())));
    case pickle::kBinBytes: return Push(Value::Bytes(Bytes(U32())));
    case pickle::kShortBinBytes: return Push(Value::Bytes(Bytes(U8())));
    case pickle::kBinBytes8: return Push(Value::Bytes(Bytes(U64())));
    case pickle::kByteArray8: {
      auto v = Value::Bytes(Bytes(U64()));
      v->kind = Kind::kByteArray;
      return Push(v);
    }
    case pickle::kString: return Push(Value::Str(QuotedString(Line())));
    case pickle::kUnicode: return Push(Value::Str(RawUnicode(Line())));
    default: NoHandler(op);
  }
}

namespace {
int HexDigit(char h) {
  return (h >= '0' && h <= '9') ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
}
}  // namespace

// STRING's argument: a quoted Python 2 literal.
std::string Machine::QuotedString(const std::string& t) {
  if (t.size() < 2 || (t.front() != '\'' && t.front() != '"') || t.back() != t.front()) Fail("bad STRING quoting");
  std::string out;
  for (size_t k = 1; k + 1 < t.size(); ++k) {
    char c = t[k];
    if (c != '\\' || k + 2 >= t.size()) {
      out.push_back(c);
      continue;
    }
    char e = t[++k];
    switch (e) {
      case 'n': out.push_back('\n'); break;
      case 't': out.push_back('\t'); break;
      case 'r': out.push_back('\r'); break;
      case '0': out.push_back('\0'); break;
      case 'x':  // two hex digits, as Python requires
        if (k + 2 >= t.size() - 1 || HexDigit(t[k + 1]) < 0 || HexDigit(t[k + 2]) < 0) Fail("bad \\x escape in STRING");
        out.push_back(static_cast<char>(HexDigit(t[k + 1]) * 16 + HexDigit(t[k + 2])));
        k += 2;
        break;
      default: out.push_back(e);
    }
  }
  return out;
}

// UNICODE's argument: raw-unicode-escape text (only \u and \U are escapes;
// every other byte is the code point of its value).
std::string Machine::RawUnicode(const std::string& t) {
  std::string out;
  for (size_t k = 0; k < t.size(); ++k) {
    uint8_t c = static_cast<uint8_t>(t[k]);
    if (c == '\\' && k + 1 < t.size() && (t[k + 1] == 'u' || t[k + 1] == 'U')) {
      size_t n = t[k + 1] == 'u' ? 4 : 8;
      if (k + 2 + n > t.size()) Fail("bad \\u escape");
      uint32_t cp = 0;
      for (size_t j = 0; j < n; ++j) {
        int d = HexDigit(t[k + 2 + j]);
        if (d < 0) Fail("bad \\u escape");
        cp = cp * 16 + static_cast<uint32_t>(d);
      }
      if (cp > 0x10FFFF) Fail("code point out of range");
      AppendUtf8(out, cp);
      k += 1 + n;
    } else {
      AppendUtf8(out, c);
    }
  }
  return out;
}

// Making tuples, lists, dicts and sets.
void Machine::Container(uint8_t op) {
  switch (op) {
    case pickle::kEmptyTuple: return Push(Value::Tuple());
    case pickle::kTuple1: {
      auto a = Pop();
      return Push(Value::Tuple({a}));
    }
    case pickle::kTuple2: {
      auto b = Pop(), a = Pop();
      return Push(Value::Tuple({a, b}));
    }
    case pickle::kTuple3: {
      auto c = Pop(), b = Pop(), a = Pop();
      return Push(Value::Tuple({a, b, c}));
    }
    case pickle::kTuple: return Push(Value::Tuple(PopMark()));
    case pickle::kEmptyList: return Push(Value::List());
    case pickle::kList: return Push(Value::List(PopMark()));
    case pickle::kEmptyDict: return Push(Value::Dict());
    case pickle::kDict: {
      auto items = PopMark();
      if (items.size() % 2) Fail("DICT with an odd number of items");
      auto d = Value::Dict();
      for (size_t k = 0; k < items.size(); k += 2) SetItem(*d, items[k], items[k + 1]);
      return Push(d);
    }
    case pickle::kEmptySet: return Push(MakeSet(Kind::kSet, {}));
    case pickle::kFrozenSet: return Push(MakeSet(Kind::kFrozenSet, PopMark()));
    default: return Fill(op);
  }
}

// Adding to the container on top of the stack.
void Machine::Fill(uint8_t op) {
  switch (op) {
    case pickle::kAddItems: {
      auto items = PopMark();
      auto& s = Top();
      if (s->kind != Kind::kSet) Fail("ADDITEMS on a " + KindName(*s));
      for (auto& it : items) s->items.push_back(std::move(it));
      return;
    }
    case pickle::kAppend: {
      auto item = Pop();
      return Append(*Top(), std::move(item));
    }
    case pickle::kAppends: {
      auto items = PopMark();
      auto& target = *Top();
      for (auto& it : items) Append(target, std::move(it));
      return;
    }
    case pickle::kSetItem: {
      auto v = Pop(), k = Pop();
      return SetItem(*Top(), std::move(k), std::move(v));
    }
    case pickle::kSetItems: {
      auto items = PopMark();
      if (items.size() % 2) Fail("SETITEMS with an odd number of items");
      auto& target = *Top();
      for (size_t k = 0; k < items.size(); k += 2) SetItem(target, items[k], items[k + 1]);
      return;
    }
    default: NoHandler(op);
  }
}

// Globals, calls and BUILD. No opcode here runs anything: MakeGlobal names a
// global (strict mode checks the name), Call models known builders.
void Machine::Object(uint8_t op) {
  switch (op) {
    case pickle::kGlobal: {
      std::string module = Line(), name = Line();
      return Push(MakeGlobal(module, name));
    }
    case pickle::kStackGlobal: {
      auto name = Pop(), module = Pop();
      if (module->kind != Kind::kStr || name->kind != Kind::kStr) Fail("STACK_GLOBAL needs two strings");
      return Push(MakeGlobal(module->s, name->s));
    }
    case pickle::kReduce: {
      auto args = Pop();
      auto callable = Pop();
      return Push(Call(callable, args));
    }
    case pickle::kInst: {  // module, name; args up to the mark
      std::string module = Line(), name = Line();
      auto args = Value::Tuple(PopMark());
      return Push(Call(MakeGlobal(module, name), args));
    }
    case pickle::kObj: {  // class and args up to the mark
      auto items = PopMark();
      if (items.empty()) Fail("OBJ without a class");
      auto cls = items.front();
      items.erase(items.begin());
      return Push(Call(cls, Value::Tuple(std::move(items))));
    }
    case pickle::kBuild: {
      auto state = Pop();
      return Build(*Top(), std::move(state));
    }
    default: return NewObject(op);
  }
}

// NEWOBJ / NEWOBJ_EX: cls.__new__(cls, *args[, **kwargs]) becomes an inert
// object; strict mode still refuses getattr as the class.
void Machine::NewObject(uint8_t op) {
  switch (op) {
    case pickle::kNewObj: {
      auto args = Pop();
      auto cls = Pop();
      if (cls->kind != Kind::kGlobal || args->kind != Kind::kTuple) Fail("NEWOBJ needs a class and a tuple");
      if (strict_ && cls->s == "builtins.getattr") CheckStrictGetattr(Value::Tuple());
      return Push(Value::Object(cls->s, args, true));
    }
    case pickle::kNewObjEx: {
      auto kwargs = Pop(), args = Pop(), cls = Pop();
      if (cls->kind != Kind::kGlobal || args->kind != Kind::kTuple || !kwargs->is_dict())
        Fail("NEWOBJ_EX needs a class, a tuple and a dict");
      if (strict_ && cls->s == "builtins.getattr") CheckStrictGetattr(Value::Tuple());
      auto v = Value::Object(cls->s, args, true);
      if (!kwargs->entries.empty()) v->kwargs = kwargs;
      return Push(v);
    }
    default: NoHandler(op);
  }
}

void Machine::Memo(uint8_t op) {
  switch (op) {
    case pickle::kBinPut: return Put(U8());
    case pickle::kLongBinPut: return Put(U32());
    case pickle::kPut: return Put(LineIndex("bad PUT index"));
    case pickle::kMemoize: return Put(memo_.size());
    case pickle::kBinGet: return Push(Get(U8()));
    case pickle::kLongBinGet: return Push(Get(U32()));
    case pickle::kGet: return Push(Get(LineIndex("bad GET index")));
    default: NoHandler(op);
  }
}

// The decimal memo index of PUT / GET.
uint64_t Machine::LineIndex(const char* error) {
  std::string t = Line();
  char* end = nullptr;
  unsigned long long idx = std::strtoull(t.c_str(), &end, 10);
  if (t.empty() || end != t.c_str() + t.size()) Fail(error);
  return idx;
}

// Persistent ids are how torch refers to storages; the loader resolves them.
void Machine::Persistent(uint8_t op) {
  ValuePtr pid;
  switch (op) {
    case pickle::kBinPersId: pid = Pop(); break;
    case pickle::kPersId: pid = Value::Str(Line()); break;
    default: NoHandler(op);
  }
  if (!load_) Fail("persistent id found but no loader given");
  Push(load_(pid));
}

}  // namespace

namespace {
std::atomic<PicklePolicy> g_default_policy{PicklePolicy::kStrict};
}

PicklePolicy DefaultPicklePolicy() { return g_default_policy.load(std::memory_order_relaxed); }
void SetDefaultPicklePolicy(PicklePolicy policy) { g_default_policy.store(policy, std::memory_order_relaxed); }

ValuePtr ReadPickle(std::span<const uint8_t> data, const std::string& where,
                    const PersistentLoader& persistent_load, const PickleLimits& limits, PicklePolicy policy) {
  Machine m(data, where, persistent_load, limits, policy);
  return m.Run();
}

}  // namespace uckpt
