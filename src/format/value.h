// The value tree a pickle decodes to. Nothing here executes Python: classes and
// functions the reader does not model stay inert `Object` / `Global` nodes that
// can be printed and written back.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "format/dtype.h"

namespace uckpt {

struct Value;
using ValuePtr = std::shared_ptr<Value>;

// The bytes of one storage record (data/<key>). Either a view into a mapped
// file (kept alive by `owner`) or memory of its own.
struct Storage {
  std::string key;            // as in the file; rewritten by the writer
  std::string storage_class;  // "torch.FloatStorage", "torch.storage.UntypedStorage"
  std::string location = "cpu";
  int64_t numel = 0;  // as in the persistent id: elements, or bytes if untyped
  std::span<const uint8_t> bytes;
  std::shared_ptr<const void> owner;  // keeps `bytes` valid
  // A streamed storage has no `bytes`: a writer asks fill(offset, into) for
  // its `stream_size` bytes a buffer at a time (a GPU tensor copied to the
  // host piece by piece while a synchronous save writes it).
  uint64_t stream_size = 0;
  std::function<void(uint64_t offset, std::span<uint8_t> into)> fill;
  bool streamed() const { return static_cast<bool>(fill); }
  uint64_t size() const { return streamed() ? stream_size : bytes.size(); }

  // A storage that owns a copy of `data`.
  static std::shared_ptr<Storage> Owned(std::vector<uint8_t> data, DType dtype);
  // A storage viewing memory kept alive by `owner`.
  static std::shared_ptr<Storage> View(std::span<const uint8_t> data, DType dtype, std::shared_ptr<const void> owner);
  // A streamed storage of `size` bytes.
  static std::shared_ptr<Storage> Streamed(uint64_t size, DType dtype,
                                           std::function<void(uint64_t offset, std::span<uint8_t> into)> fill);
};

struct Tensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;  // in elements
  int64_t storage_offset = 0;   // in elements
  bool requires_grad = false;
  std::shared_ptr<Storage> storage;
  std::string rebuild = "torch._utils._rebuild_tensor_v2";
  ValuePtr attrs;     // Python attributes (rebuild_from_type_v2), or null
  ValuePtr metadata;  // 7th v2 argument (conj/neg flags), or null

  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
  bool is_contiguous() const;
  // The tensor's bytes in C order. Zero-copy when contiguous.
  std::span<const uint8_t> contiguous_view() const;  // empty span if not contiguous
  std::vector<uint8_t> contiguous_bytes() const;
  // Row-major strides for `shape`.
  static std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape);
  // A contiguous tensor over a fresh owned storage.
  static Tensor FromBytes(DType dtype, std::vector<int64_t> shape, std::vector<uint8_t> data);
};

enum class Kind : uint8_t {
  kNone,
  kBool,
  kInt,
  kFloat,
  kComplex,
  kStr,
  kBytes,
  kByteArray,
  kList,
  kTuple,
  kDict,
  kOrderedDict,
  kSet,
  kFrozenSet,
  kTensor,
  kParameter,
  kTorchSize,
  kTorchDevice,
  kTorchDtype,
  kGlobal,   // a class or function used as a value, not called
  kObject,   // an opaque call result: class path + how it was built
  kStorage,  // a storage not wrapped in a tensor (a bare persistent id)
};

struct Value {
  Kind kind = Kind::kNone;

  // kBool / kInt (when it fits in 64 bits).
  bool b = false;
  int64_t i = 0;
  // kInt beyond 64 bits: little-endian two's complement bytes (non-empty).
  std::vector<uint8_t> big;
  // kFloat; kComplex uses f (real) and imag.
  double f = 0, imag = 0;
  // kStr (UTF-8 as stored), kBytes/kByteArray (raw), kTorchDevice ("cuda:1"),
  // kTorchDtype ("float16"), kGlobal and kObject (class path "module.name").
  std::string s;
  // kList, kTuple, kSet, kFrozenSet, kTorchSize: elements.
  // kObject: items[0] = args tuple.
  std::vector<ValuePtr> items;
  // kDict, kOrderedDict: pairs in insertion order. kObject: dictitems.
  std::vector<std::pair<ValuePtr, ValuePtr>> entries;
  // kOrderedDict / kObject / kParameter: the BUILD argument, or null.
  ValuePtr state;
  // kGlobal / kObject: where the module part of `s` ends (s[split] == '.');
  // 0 means "at the last dot".
  size_t split = 0;
  // kTensor, kParameter (the data).
  std::shared_ptr<Tensor> tensor;
  // kStorage.
  std::shared_ptr<Storage> storage;
  // kObject: true for NEWOBJ (cls.__new__(cls, *args)), false for REDUCE.
  bool newobj = false;
  // kObject: APPEND(S) applied to it; NEWOBJ_EX keyword arguments.
  std::vector<ValuePtr> listitems;
  ValuePtr kwargs;

  // Constructors for the common cases.
  static ValuePtr None();
  static ValuePtr Bool(bool v);
  static ValuePtr Int(int64_t v);
  static ValuePtr Float(double v);
  static ValuePtr Str(std::string v);
  static ValuePtr Bytes(std::string v);
  static ValuePtr List(std::vector<ValuePtr> v = {});
  static ValuePtr Tuple(std::vector<ValuePtr> v = {});
  static ValuePtr Dict(bool ordered = false);
  static ValuePtr FromTensor(Tensor t);
  static ValuePtr Size(const std::vector<int64_t>& dims);
  static ValuePtr Dtype(DType d);
  static ValuePtr Object(std::string cls, ValuePtr args, bool newobj);
  static ValuePtr Global(const std::string& module, const std::string& name);

  // The module and name parts of a kGlobal / kObject class path.
  std::string module() const;
  std::string name() const;

  bool is_dict() const { return kind == Kind::kDict || kind == Kind::kOrderedDict; }
  bool is_seq() const { return kind == Kind::kList || kind == Kind::kTuple; }
  // Dict lookup by string key; null if absent or not a dict.
  ValuePtr get(std::string_view key) const;
  // Appends or replaces `key` in a dict.
  void set(ValuePtr key, ValuePtr value);
  void set(std::string_view key, ValuePtr value) { set(Str(std::string(key)), std::move(value)); }
};

// Type name for messages ("dict", "tensor", "object deepspeed...LossScaler").
std::string KindName(const Value& v);

// A canonical text for hashable values (str, int, float, bool, None, tuples of
// them), used to find duplicate dict keys. Empty for unhashable values.
std::string HashKey(const Value& v);

// Decimal text of an int value (any size).
std::string IntToDecimal(const Value& v);

// A copy of the tree `v` whose storages all say `location`, as torch.save writes
// what torch.load(map_location=location) read: nodes and storages are copied once
// each (what was shared stays shared), the tensors' bytes not at all.
ValuePtr WithStorageLocation(const ValuePtr& v, const std::string& location);

}  // namespace uckpt
