#include "format/pickle_writer.h"

#include <bit>
#include <charconv>
#include <unordered_map>

#include "format/error.h"
#include "format/pickle_opcodes.h"

namespace uckpt {
namespace {

class Pickler {
 public:
  PickledValue Run(const ValuePtr& root) {
    // Protocol 2: torch.save's default, and the one torch's weights_only loader expects.
    Op(pickle::kProto);
    b().push_back(2);
    Save(root);
    Op(pickle::kStop);
    return std::move(out_);
  }

 private:
  std::string& b() { return out_.pickle; }
  void Op(pickle::Opcode op) { b().push_back(static_cast<char>(op)); }
  void U32(uint32_t v) {
    for (int k = 0; k < 4; ++k) b().push_back(static_cast<char>((v >> (8 * k)) & 0xff));
  }

  void Put() {
    uint32_t idx = next_memo_++;
    if (idx < 256) {
      Op(pickle::kBinPut);
      b().push_back(static_cast<char>(idx));
    } else {
      Op(pickle::kLongBinPut);
      U32(idx);
    }
  }
  void Get(uint32_t idx) {
    if (idx < 256) {
      Op(pickle::kBinGet);
      b().push_back(static_cast<char>(idx));
    } else {
      Op(pickle::kLongBinGet);
      U32(idx);
    }
  }
  // Emits BINGET if `key` was memoized; otherwise returns false.
  bool Memoized(const void* key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) return false;
    Get(it->second);
    return true;
  }
  void Remember(const void* key) {
    memo_[key] = next_memo_;
    Put();
  }

  void Int(int64_t v) {
    if (v >= 0 && v <= 0xff) {
      Op(pickle::kBinInt1);
      b().push_back(static_cast<char>(v));
    } else if (v >= 0 && v <= 0xffff) {
      Op(pickle::kBinInt2);
      b().push_back(static_cast<char>(v & 0xff));
      b().push_back(static_cast<char>(v >> 8));
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      Op(pickle::kBinInt);
      U32(static_cast<uint32_t>(static_cast<int32_t>(v)));
    } else {
      std::vector<uint8_t> bytes;
      uint64_t u = static_cast<uint64_t>(v);
      for (int k = 0; k < 8; ++k) bytes.push_back(static_cast<uint8_t>(u >> (8 * k)));
      // Minimal two's complement length.
      while (bytes.size() > 1 && ((bytes.back() == 0 && !(bytes[bytes.size() - 2] & 0x80)) ||
                                  (bytes.back() == 0xff && (bytes[bytes.size() - 2] & 0x80))))
        bytes.pop_back();
      BigInt(bytes);
    }
  }
  void BigInt(const std::vector<uint8_t>& bytes) {
    if (bytes.size() < 256) {
      Op(pickle::kLong1);
      b().push_back(static_cast<char>(bytes.size()));
    } else {
      Op(pickle::kLong4);
      U32(static_cast<uint32_t>(bytes.size()));
    }
    b().append(bytes.begin(), bytes.end());
  }
  void Float(double d) {
    Op(pickle::kBinFloat);
    uint64_t u = std::bit_cast<uint64_t>(d);
    for (int k = 7; k >= 0; --k) b().push_back(static_cast<char>((u >> (8 * k)) & 0xff));
  }
  void Str(const std::string& s) {
    Op(pickle::kBinUnicode);
    U32(static_cast<uint32_t>(s.size()));
    b() += s;
  }
  void MemoStr(const std::string& s) {
    Str(s);
    Put();
  }
  // GLOBAL, memoized per class path as Python does per class object.
  void Global(const std::string& module, const std::string& name) {
    std::string m = module, n = name;
    // Protocol 2 writes Python 2 module names.
    if (m == "builtins") m = "__builtin__";
    else if (m == "copyreg") m = "copy_reg";
    // GLOBAL ends each name at a newline; one inside a name would corrupt the file.
    if (m.find('\n') != std::string::npos || n.find('\n') != std::string::npos)
      throw FormatError("cannot save the class '" + m + "." + n + "': its name holds a newline");
    std::string key = m + "\n" + n + "\n";
    auto it = global_memo_.find(key);
    if (it != global_memo_.end()) {
      Get(it->second);
      return;
    }
    Op(pickle::kGlobal);
    b() += key;
    global_memo_[key] = next_memo_;
    Put();
  }
  void GlobalPath(const std::string& path) {
    size_t dot = path.rfind('.');
    Global(dot == std::string::npos ? "" : path.substr(0, dot), dot == std::string::npos ? path : path.substr(dot + 1));
  }
  void TupleOf(size_t n) {
    switch (n) {
      case 0: Op(pickle::kEmptyTuple); return;
      case 1: Op(pickle::kTuple1); break;
      case 2: Op(pickle::kTuple2); break;
      case 3: Op(pickle::kTuple3); break;
      default: Op(pickle::kTuple); break;
    }
    Put();
  }

  void Items(const std::vector<ValuePtr>& items) {  // after a list/object on the stack
    if (items.size() == 1) {
      Save(items[0]);
      Op(pickle::kAppend);
      return;
    }
    for (size_t k = 0; k < items.size(); k += 1000) {
      Op(pickle::kMark);
      for (size_t j = k; j < std::min(items.size(), k + 1000); ++j) Save(items[j]);
      Op(pickle::kAppends);
    }
  }
  void Entries(const std::vector<std::pair<ValuePtr, ValuePtr>>& entries) {
    if (entries.size() == 1) {
      Save(entries[0].first);
      Save(entries[0].second);
      Op(pickle::kSetItem);
      return;
    }
    for (size_t k = 0; k < entries.size(); k += 1000) {
      Op(pickle::kMark);
      for (size_t j = k; j < std::min(entries.size(), k + 1000); ++j) {
        Save(entries[j].first);
        Save(entries[j].second);
      }
      Op(pickle::kSetItems);
    }
  }

  std::string StorageKey(const std::shared_ptr<Storage>& s) {
    auto it = storage_keys_.find(s.get());
    if (it != storage_keys_.end()) return it->second;
    std::string key = std::to_string(out_.storages.size());
    storage_keys_[s.get()] = key;
    out_.storages.push_back(s);
    return key;
  }

  // The persistent id of `s` viewed as `dtype` (nullopt: keep its class).
  void PersistentId(const std::shared_ptr<Storage>& s, std::optional<DType> dtype) {
    std::string cls = s->storage_class;
    int64_t numel = static_cast<int64_t>(s->size());  // a streamed storage has no bytes in memory
    if (dtype) {
      auto legacy = DTypeStorageClass(*dtype);
      cls = legacy.empty() ? "torch.storage.UntypedStorage" : "torch." + std::string(legacy);
      if (!legacy.empty()) numel /= static_cast<int64_t>(DTypeSize(*dtype));
    } else if (auto d = DTypeFromStorageClass(cls.substr(cls.rfind('.') + 1))) {
      numel /= static_cast<int64_t>(DTypeSize(*d));
    }
    auto seen = storage_class_.find(s.get());
    if (seen != storage_class_.end() && seen->second != cls)
      throw FormatError("cannot save one storage viewed as two types (" + seen->second + " and " + cls + ")");
    storage_class_[s.get()] = cls;
    std::string key = StorageKey(s);
    Op(pickle::kMark);
    // torch's persistent_id returns the same str objects each time: the literal
    // 'storage', the CPU location tag's literal 'cpu', and one key per storage.
    // Python's pickler memoizes objects, so it writes each once and BINGETs it
    // after; so does this.
    PidStr("storage", "storage");
    GlobalPath(cls);
    PidStr("key\n" + key, key);
    const std::string location = s->location.empty() ? "cpu" : s->location;
    if (location == "cpu") {
      PidStr("location\ncpu", location);
    } else {
      MemoStr(location);  // 'cuda:0' is built anew for every storage
    }
    Int(numel);
    TupleOf(5);
    Op(pickle::kBinPersId);
  }

  // A string of a persistent id, memoized under `id` (what object it is).
  void PidStr(const std::string& id, const std::string& s) {
    auto it = pid_memo_.find(id);
    if (it != pid_memo_.end()) {
      Get(it->second);
      return;
    }
    pid_memo_[id] = next_memo_;
    MemoStr(s);
  }

  void TensorArgs(const Tensor& t) {
    Op(pickle::kMark);
    PersistentId(t.storage, t.dtype);
    Int(t.storage_offset);
    SaveInts(t.shape);
    SaveInts(t.stride);
    Op(t.requires_grad ? pickle::kNewTrue : pickle::kNewFalse);
    EmptyOrderedDict(nullptr);
    const bool v3 = DTypeStorageClass(t.dtype).empty();
    if (v3) Global("torch", std::string(DTypeName(t.dtype)));
    if (t.metadata) Save(t.metadata);
    TupleOf(6 + (v3 ? 1 : 0) + (t.metadata ? 1 : 0));
  }
  void SaveInts(const std::vector<int64_t>& v) {
    if (v.size() >= 4) Op(pickle::kMark);
    for (int64_t x : v) Int(x);
    TupleOf(v.size());
  }

  void SaveTensor(const Tensor& t) {
    if (!t.storage) throw FormatError("cannot save a tensor without a storage");
    const bool v3 = DTypeStorageClass(t.dtype).empty();
    const char* fn = v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2";
    if (t.attrs) {
      Global("torch._tensor", "_rebuild_from_type_v2");
      Op(pickle::kMark);
      Global("torch._utils", fn);
      Global("torch", "Tensor");
      TensorArgs(t);
      Save(t.attrs);
      TupleOf(4);
    } else {
      Global("torch._utils", fn);
      TensorArgs(t);
    }
    Op(pickle::kReduce);
    Put();
  }

  void Save(const ValuePtr& vp) {
    const Value& v = *vp;
    switch (v.kind) {  // not memoized, as Python does not memoize them
      case Kind::kNone: Op(pickle::kNone); return;
      case Kind::kBool: Op(v.b ? pickle::kNewTrue : pickle::kNewFalse); return;
      case Kind::kInt:
        if (v.big.empty()) Int(v.i);
        else BigInt(v.big);
        return;
      case Kind::kFloat: Float(v.f); return;
      default: break;
    }
    if (Memoized(vp.get())) return;
    switch (v.kind) {
      case Kind::kStr: Str(v.s); break;
      case Kind::kBytes:
      case Kind::kByteArray: SaveBytes(v); break;
      case Kind::kComplex:
        Global("builtins", "complex");
        Float(v.f);
        Float(v.imag);
        TupleOf(2);
        Op(pickle::kReduce);
        break;
      case Kind::kList:
        Op(pickle::kEmptyList);
        Remember(vp.get());
        Items(v.items);
        return;
      case Kind::kTuple: return SaveTuple(vp);
      case Kind::kDict:
        Op(pickle::kEmptyDict);
        Remember(vp.get());
        Entries(v.entries);
        return;
      case Kind::kOrderedDict:
        EmptyOrderedDict(vp.get());
        Entries(v.entries);
        if (v.state) Build(v.state);
        return;
      case Kind::kSet:
      case Kind::kFrozenSet: SaveSet(v); break;
      case Kind::kTorchSize: SaveSize(v); break;
      case Kind::kTorchDevice: SaveDevice(v); break;
      case Kind::kTorchDtype: Global("torch", v.s); return;
      case Kind::kGlobal: Global(v.module(), v.name()); return;
      case Kind::kTensor:
        SaveTensor(*v.tensor);
        memo_[vp.get()] = next_memo_ - 1;
        return;
      case Kind::kParameter: SaveParameter(v); break;
      case Kind::kStorage: PersistentId(v.storage, std::nullopt); break;
      case Kind::kObject: return SaveObject(vp);
      default: throw FormatError("cannot pickle a value of type " + KindName(v));
    }
    Remember(vp.get());
  }

  // bytes as protocol 2 writes them: _codecs.encode(<latin-1 text>, 'latin1')
  // (bytes() when empty); a bytearray wraps that in bytearray(...).
  void SaveBytes(const Value& v) {
    if (v.kind == Kind::kByteArray) Global("builtins", "bytearray");
    if (v.s.empty()) {
      Global("builtins", "bytes");
      Op(pickle::kEmptyTuple);
    } else {
      Global("_codecs", "encode");
      std::string latin1;  // bytes as a str of code points 0..255, UTF-8 encoded
      for (unsigned char c : v.s) {
        if (c < 0x80) {
          latin1.push_back(static_cast<char>(c));
        } else {
          latin1.push_back(static_cast<char>(0xC0 | (c >> 6)));
          latin1.push_back(static_cast<char>(0x80 | (c & 0x3F)));
        }
      }
      MemoStr(latin1);
      MemoStr("latin1");
      TupleOf(2);
    }
    Op(pickle::kReduce);
    if (v.kind == Kind::kByteArray) {
      Put();
      TupleOf(1);
      Op(pickle::kReduce);
    }
  }

  void SaveTuple(const ValuePtr& vp) {
    const auto& items = vp->items;
    if (items.empty()) return Op(pickle::kEmptyTuple);  // not memoized, as in Python
    if (items.size() >= 4) Op(pickle::kMark);
    for (const auto& it : items) Save(it);
    switch (items.size()) {
      case 1: Op(pickle::kTuple1); break;
      case 2: Op(pickle::kTuple2); break;
      case 3: Op(pickle::kTuple3); break;
      default: Op(pickle::kTuple);
    }
    Remember(vp.get());
  }

  // OrderedDict(), memoized as `key` (null: under the next memo index only).
  void EmptyOrderedDict(const void* key) {
    Global("collections", "OrderedDict");
    Op(pickle::kEmptyTuple);
    Op(pickle::kReduce);
    if (key) Remember(key);
    else Put();
  }
  void Build(const ValuePtr& state) {
    Save(state);
    Op(pickle::kBuild);
  }

  // set(list) / frozenset(list).
  void SaveSet(const Value& v) {
    Global("builtins", v.kind == Kind::kSet ? "set" : "frozenset");
    Op(pickle::kEmptyList);
    Put();
    Items(v.items);
    TupleOf(1);
    Op(pickle::kReduce);
  }

  void SaveSize(const Value& v) {
    Global("torch", "Size");
    std::vector<int64_t> dims;
    for (const auto& it : v.items) dims.push_back(it->i);
    SaveInts(dims);
    TupleOf(1);
    Op(pickle::kReduce);
  }

  void SaveDevice(const Value& v) {
    Global("torch", "device");
    // torch.device("cuda", 1) as torch writes it; any other text (not
    // made by torch, but readable) as the single string it was.
    size_t colon = v.s.find(':');
    std::string index_text = colon == std::string::npos ? "" : v.s.substr(colon + 1);
    int64_t index = 0;
    auto parsed = std::from_chars(index_text.data(), index_text.data() + index_text.size(), index);
    if (colon == std::string::npos || parsed.ec != std::errc() || std::to_string(index) != index_text) {
      MemoStr(v.s);
      TupleOf(1);
    } else {
      MemoStr(v.s.substr(0, colon));
      Int(index);
      TupleOf(2);
    }
    Op(pickle::kReduce);
  }

  void SaveParameter(const Value& v) {
    Global("torch._utils", v.state ? "_rebuild_parameter_with_state" : "_rebuild_parameter");
    if (v.state) Op(pickle::kMark);  // 4 items need MARK ... TUPLE; 3 use TUPLE3
    SaveTensor(*v.tensor);
    Op(v.b ? pickle::kNewTrue : pickle::kNewFalse);
    EmptyOrderedDict(nullptr);
    if (v.state) Save(v.state);
    TupleOf(v.state ? 4 : 3);
    Op(pickle::kReduce);
  }

  // An opaque object written back as it was read: cls(*args) by REDUCE or
  // cls.__new__ by NEWOBJ (copyreg.__newobj_ex__ with keyword arguments),
  // then what APPEND(S), SETITEM(S) and BUILD added.
  void SaveObject(const ValuePtr& vp) {
    const Value& v = *vp;
    if (v.newobj && v.kwargs) {
      Global("copyreg", "__newobj_ex__");
      Global(v.module(), v.name());
      Save(v.items.at(0));
      Save(v.kwargs);
      TupleOf(3);
      Op(pickle::kReduce);
    } else {
      Global(v.module(), v.name());
      Save(v.items.at(0));
      Op(v.newobj ? pickle::kNewObj : pickle::kReduce);
    }
    Remember(vp.get());
    if (!v.listitems.empty()) Items(v.listitems);
    if (!v.entries.empty()) Entries(v.entries);
    if (v.state) Build(v.state);
  }

  PickledValue out_;
  uint32_t next_memo_ = 0;
  std::unordered_map<std::string, uint32_t> pid_memo_;  // persistent-id strings already written
  std::unordered_map<const void*, uint32_t> memo_;
  std::unordered_map<std::string, uint32_t> global_memo_;
  std::unordered_map<const Storage*, std::string> storage_keys_;
  std::unordered_map<const Storage*, std::string> storage_class_;
};

}  // namespace

PickledValue PickleForTorch(const ValuePtr& root) { return Pickler().Run(root); }

}  // namespace uckpt
