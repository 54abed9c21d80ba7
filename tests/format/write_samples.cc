// Writes torch files with our writer for torch_load_check.py to load in real
// PyTorch, with a JSON description (ValueToJson, the fixture manifest schema)
// of what each file holds.
//
//   write_samples OUT_DIR [FIXTURE_DIR...]
//
// OUT_DIR/samples/*.pt + OUT_DIR/samples.json: values built here, covering
// every dtype, views and shared storages, 0-dim and empty tensors, containers,
// ints past 2^63, floats, unicode, bytes, torch.Size, Parameter, state and
// optimizer dicts.
// OUT_DIR/roundtrip/<version>/<name>.pt + OUT_DIR/roundtrip.json: every zip
// fixture of each FIXTURE_DIR read and written again.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>

#include "format/error.h"
#include "format/torch_file.h"
#include "format/value_json.h"

namespace uckpt {
namespace {

using nlohmann::json;

// ---- Building values -------------------------------------------------------

template <typename T>
std::vector<uint8_t> RawBytes(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

template <typename T>
ValuePtr MakeTensor(DType d, std::vector<int64_t> shape, const std::vector<T>& elems) {
  return Value::FromTensor(Tensor::FromBytes(d, std::move(shape), RawBytes(elems)));
}

// A view of `base`'s storage.
ValuePtr View(const ValuePtr& base, std::vector<int64_t> shape, std::vector<int64_t> stride, int64_t offset) {
  Tensor t = *base->tensor;
  t.shape = std::move(shape);
  t.stride = std::move(stride);
  t.storage_offset = offset;
  t.requires_grad = false;
  return Value::FromTensor(std::move(t));
}

ValuePtr F32Range(std::vector<int64_t> shape, float scale = 1.0f) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) v[static_cast<size_t>(k)] = static_cast<float>(k % 4096) * scale;
  return MakeTensor(DType::kFloat32, std::move(shape), v);
}

ValuePtr Parameter(ValuePtr tensor, bool requires_grad) {
  auto p = std::make_shared<Value>();
  p->kind = Kind::kParameter;
  p->tensor = tensor->tensor;
  p->b = requires_grad;
  return p;
}

// +-2^n as two's complement little-endian bytes.
ValuePtr PowerOfTwo(int n, bool negative) {
  std::vector<uint8_t> mag(static_cast<size_t>(n / 8 + 2), 0);
  mag[static_cast<size_t>(n / 8)] = static_cast<uint8_t>(1u << (n % 8));
  if (negative) {
    for (auto& b : mag) b = static_cast<uint8_t>(~b);
    for (auto& b : mag)
      if (++b != 0) break;
  }
  // Minimal length, as the pickler writes it.
  while (mag.size() > 1 &&
         ((mag.back() == 0 && !(mag[mag.size() - 2] & 0x80)) || (mag.back() == 0xff && (mag[mag.size() - 2] & 0x80))))
    mag.pop_back();
  auto v = Value::Int(0);
  if (mag.size() <= 8) {
    uint64_t u = 0;
    for (size_t k = 0; k < mag.size(); ++k) u |= uint64_t{mag[k]} << (8 * k);
    if (mag.size() < 8 && (mag.back() & 0x80)) u |= ~uint64_t{0} << (8 * mag.size());
    v->i = static_cast<int64_t>(u);
  } else {
    v->big = std::move(mag);
  }
  return v;
}

// An int of up to 127 bits, as the pickler stores it (LONG1 past 64 bits).
ValuePtr Int128(__int128 x) {
  std::vector<uint8_t> b;
  for (int k = 0; k < 16; ++k) b.push_back(static_cast<uint8_t>(static_cast<unsigned __int128>(x) >> (8 * k)));
  while (b.size() > 1 &&
         ((b.back() == 0 && !(b[b.size() - 2] & 0x80)) || (b.back() == 0xff && (b[b.size() - 2] & 0x80))))
    b.pop_back();
  if (b.size() <= 8) return Value::Int(static_cast<int64_t>(x));
  auto v = Value::Int(0);
  v->big = std::move(b);
  return v;
}

ValuePtr Dict(std::vector<std::pair<std::string, ValuePtr>> items, bool ordered = false) {
  auto d = Value::Dict(ordered);
  for (auto& [k, v] : items) d->set(k, std::move(v));
  return d;
}

ValuePtr Device(const std::string& s) {
  auto v = std::make_shared<Value>();
  v->kind = Kind::kTorchDevice;
  v->s = s;
  return v;
}

ValuePtr Complex(double re, double im) {
  auto v = std::make_shared<Value>();
  v->kind = Kind::kComplex;
  v->f = re;
  v->imag = im;
  return v;
}

ValuePtr ByteArray(std::string s) {
  auto v = Value::Bytes(std::move(s));
  v->kind = Kind::kByteArray;
  return v;
}

ValuePtr Set(std::vector<ValuePtr> items, bool frozen) {
  auto v = std::make_shared<Value>();
  v->kind = frozen ? Kind::kFrozenSet : Kind::kSet;
  v->items = std::move(items);
  return v;
}

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr float kInfF = std::numeric_limits<float>::infinity();
constexpr float kNaNF = std::numeric_limits<float>::quiet_NaN();

// ---- The samples -----------------------------------------------------------

// Every dtype that has a typed storage class, with edge values.
ValuePtr Dtypes() {
  return Dict({
      {"float32", MakeTensor<float>(DType::kFloat32, {2, 5},
                                    {0.0f, -0.0f, 1.5f, -2.25f, kInfF, -kInfF, kNaNF, std::numeric_limits<float>::max(),
                                     std::numeric_limits<float>::denorm_min(), 1.0f / 3.0f})},
      {"float64", MakeTensor<double>(DType::kFloat64, {9},
                                     {0.0, -0.0, 0.1, kInf, -kInf, kNaN, std::numeric_limits<double>::max(),
                                      std::numeric_limits<double>::denorm_min(), -1e-300})},
      {"float16", MakeTensor<uint16_t>(DType::kFloat16, {9},
                                       {0x0000, 0x8000, 0x3c00, 0x7bff, 0x0001, 0x7c00, 0xfc00, 0x7e00, 0x3555})},
      {"bfloat16", MakeTensor<uint16_t>(DType::kBFloat16, {3, 3},
                                        {0x0000, 0x8000, 0x3f80, 0x7f7f, 0x0001, 0x7f80, 0xff80, 0x7fc0, 0x3eab})},
      {"int64",
       MakeTensor<int64_t>(DType::kInt64, {5},
                           {std::numeric_limits<int64_t>::min(), -1, 0, 1, std::numeric_limits<int64_t>::max()})},
      {"int32", MakeTensor<int32_t>(
                    DType::kInt32, {2, 3},
                    {std::numeric_limits<int32_t>::min(), -1, 0, 1, 65536, std::numeric_limits<int32_t>::max()})},
      {"int16", MakeTensor<int16_t>(DType::kInt16, {4}, {-32768, -1, 0, 32767})},
      {"int8", MakeTensor<int8_t>(DType::kInt8, {4}, {-128, -1, 0, 127})},
      {"uint8", MakeTensor<uint8_t>(DType::kUInt8, {5}, {0, 1, 127, 128, 255})},
      {"bool", MakeTensor<uint8_t>(DType::kBool, {2, 2}, {1, 0, 0, 1})},
      {"complex64", MakeTensor<float>(DType::kComplex64, {4},
                                      {1.0f, -1.0f, 0.0f, -0.0f, kInfF, kNaNF, std::numeric_limits<float>::denorm_min(),
                                       std::numeric_limits<float>::max()})},
      {"complex128", MakeTensor<double>(DType::kComplex128, {3}, {0.5, -0.25, -kInf, 1e-300, 0.1, 3.0})},
  });
}

// Types saved with _rebuild_tensor_v3 and an UntypedStorage (torch >= 2.3).
ValuePtr DtypesV3() {
  return Dict({
      {"uint16", MakeTensor<uint16_t>(DType::kUInt16, {4}, {0, 1, 32768, 65535})},
      {"uint32", MakeTensor<uint32_t>(DType::kUInt32, {3}, {0, 2147483648u, 4294967295u})},
      {"uint64", MakeTensor<uint64_t>(DType::kUInt64, {3}, {0, uint64_t{1} << 63, ~uint64_t{0}})},
      // 0, -0, 1, 448 (max), min subnormal, nan
      {"float8_e4m3fn", MakeTensor<uint8_t>(DType::kFloat8E4M3FN, {6}, {0x00, 0x80, 0x38, 0x7e, 0x01, 0x7f})},
      // 0, -0, 1, 57344 (max), inf, -inf, nan, min subnormal
      {"float8_e5m2",
       MakeTensor<uint8_t>(DType::kFloat8E5M2, {2, 4}, {0x00, 0x80, 0x3c, 0x7b, 0x7c, 0xfc, 0x7e, 0x01})},
  });
}

ValuePtr ViewsAndSharing() {
  auto base = F32Range({3, 4});
  auto transposed = View(base, {4, 3}, {1, 4}, 0);
  auto block = View(base, {2, 2}, {4, 1}, 5);  // base[1:, 1:3]
  auto every_third = View(base, {4}, {3}, 0);  // base.view(-1)[::3]
  auto expanded = MakeTensor<int64_t>(DType::kInt64, {2}, {1, 2});
  expanded = View(expanded, {3, 2}, {0, 1}, 0);          // tensor([1, 2]).expand(3, 2)
  auto slice_alone = View(F32Range({10}), {3}, {1}, 2);  // arange(10)[2:5], whole storage saved
  auto big = F32Range({16, 24}, 0.5f);
  auto big_t = View(big, {24, 16}, {1, 24}, 0);  // > 64 elements, not contiguous: hashed only
  auto other = MakeTensor<int32_t>(DType::kInt32, {2}, {7, 8});
  return Value::List({base, transposed, block, every_third, expanded, slice_alone, big_t, other, base, big});
}

ValuePtr ScalarsAndEmpty() {
  auto grad = MakeTensor<float>(DType::kFloat32, {2}, {0.5f, -0.5f});
  grad->tensor->requires_grad = true;
  return Dict({
      {"zero_dim_f32", MakeTensor<float>(DType::kFloat32, {}, {3.5f})},
      {"zero_dim_i64", MakeTensor<int64_t>(DType::kInt64, {}, {7})},
      {"empty_f32", MakeTensor<float>(DType::kFloat32, {0}, {})},
      {"empty_3d_i64", MakeTensor<int64_t>(DType::kInt64, {2, 0, 3}, {})},
      {"empty_bf16", MakeTensor<uint16_t>(DType::kBFloat16, {0, 4}, {})},
      {"requires_grad", grad},
  });
}

ValuePtr Nested() {
  auto w = F32Range({2, 2});
  auto inner = Dict({{"b", Value::Tuple({Value::Int(4), Value::Int(5), Value::Tuple({Value::Int(6)})})}});
  auto int_keys = Value::Dict();
  int_keys->set(Value::Int(1), Value::Str("one"));
  int_keys->set(Value::Int(-5), Value::Str("minus five"));
  int_keys->set(Value::Tuple({Value::Int(1), Value::Int(2)}), Value::Str("pair"));
  int_keys->set(Value::None(), Value::Bool(true));
  return Dict({
      {"deep", Value::List({Value::Int(1), Value::List({Value::Int(2), Value::List({Value::Int(3), inner})})})},
      {"tuples",
       Value::List({Value::Tuple(), Value::Tuple({Value::Str("x")}), Value::Tuple({Value::Int(1), Value::Int(2)}),
                    Value::Tuple({Value::Int(1), Value::Int(2), Value::Int(3)}),
                    Value::Tuple({Value::Int(1), Value::Int(2), Value::Int(3), Value::Int(4)})})},
      {"tensors", Dict({{"w", Value::List({w, Value::Tuple({F32Range({3}), Value::None()})})}, {"again", w}})},
      {"flags", Value::List({Value::Bool(true), Value::Bool(false), Value::None()})},
      {"empty", Dict({{"list", Value::List()}, {"dict", Value::Dict()}, {"tuple", Value::Tuple()}})},
      {"keys", int_keys},
  });
}

ValuePtr Ints() {
  std::vector<ValuePtr> v;
  for (int64_t x : {int64_t{0}, int64_t{1}, int64_t{-1}, int64_t{255}, int64_t{256}, int64_t{65535}, int64_t{65536},
                    int64_t{-65536}, int64_t{2147483647}, int64_t{2147483648}, int64_t{-2147483648},
                    int64_t{-2147483649}, int64_t{4294967296}, (int64_t{1} << 53) + 1,
                    std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()})
    v.push_back(Value::Int(x));
  const __int128 two63 = static_cast<__int128>(1) << 63;
  v.push_back(Int128(two63));          // 2^63: LONG1 of 9 bytes
  v.push_back(Int128(2 * two63 - 1));  // 2^64 - 1
  v.push_back(Int128(2 * two63));      // 2^64
  v.push_back(Int128(-two63 - 1));
  v.push_back(PowerOfTwo(100, false));
  v.push_back(PowerOfTwo(100, true));
  v.push_back(PowerOfTwo(2000, false));  // 251 bytes: still LONG1
  return Dict({{"ints", Value::List(v)}, {"as_key", [] {
                                            auto d = Value::Dict();
                                            d->set(PowerOfTwo(70, false), Value::Str("2^70"));
                                            return d;
                                          }()}});
}

ValuePtr Long4() { return Dict({{"two_pow_2100", PowerOfTwo(2100, false)}, {"minus", PowerOfTwo(2100, true)}}); }

ValuePtr Strings() {
  std::vector<ValuePtr> v;
  for (const std::string& s : {std::string(""), std::string("ascii"), std::string("h\xc3\xa9llo"),
                               std::string("\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e"),
                               std::string("emoji \xf0\x9f\x8e\x89"), std::string("nul\0inside", 10),
                               std::string("quote'\"\\"), std::string("line\n\ttab\r"), std::string("\xc3\xbf")})
    v.push_back(Value::Str(s));
  auto d = Value::Dict();
  d->set("\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87",
         Value::Str("\xd0\xb7\xd0\xbd\xd0\xb0\xd1\x87\xd0\xb5\xd0\xbd\xd0\xb8\xd0\xb5"));
  d->set("k", Value::Str("v"));
  return Dict({{"strings", Value::List(v)}, {"unicode_keys", d}});
}

ValuePtr Floats() {
  return Dict({
      {"zero", Value::Float(0.0)},
      {"neg_zero", Value::Float(-0.0)},
      {"tenth", Value::Float(0.1)},
      {"nan", Value::Float(kNaN)},
      {"inf", Value::Float(kInf)},
      {"neg_inf", Value::Float(-kInf)},
      {"tiny", Value::Float(5e-324)},
      {"big", Value::Float(1.5e300)},
      {"third", Value::Float(1.0 / 3.0)},
      {"list", Value::List({Value::Float(1.0), Value::Float(2.5), Value::Float(-1e-5)})},
      {"complex", Complex(1.5, -0.0)},
  });
}

ValuePtr BytesSample() {
  return Dict({
      {"empty", Value::Bytes("")},
      {"raw", Value::Bytes(std::string("\x00\x01\x7f\x80\xff abc", 9))},
      {"bytearray", ByteArray("xyz")},
      {"bytearray_empty", ByteArray("")},
  });
}

ValuePtr Sets() {
  return Dict({{"set", Set({Value::Int(1), Value::Int(2), Value::Int(3)}, false)},
               {"frozenset", Set({Value::Str("a"), Value::Str("b")}, true)},
               {"empty_set", Set({}, false)}});
}

ValuePtr TorchObjects() {
  return Dict({
      {"size", Value::Size({2, 3})},
      {"size0", Value::Size({})},
      {"dtypes",
       Value::List({Value::Dtype(DType::kFloat32), Value::Dtype(DType::kInt64), Value::Dtype(DType::kFloat16)})},
  });
}

ValuePtr DevicesAndDtypes() {
  return Dict({
      {"cpu", Device("cpu")},
      {"cuda1", Device("cuda:1")},
      {"dtypes",
       Value::List({Value::Dtype(DType::kBFloat16), Value::Dtype(DType::kBool), Value::Dtype(DType::kUInt8)})},
  });
}

ValuePtr ParametersInDict() {
  return Dict({
      {"w", Parameter(F32Range({2, 3}), false)},
      {"b", Parameter(F32Range({3}), true)},
      {"plain", F32Range({2})},
  });
}

// Like nn.Module.state_dict(): an OrderedDict whose BUILD state is {'_metadata': ...}.
ValuePtr StateDict() {
  auto metadata = Value::Dict(true);
  metadata->set("", Dict({{"version", Value::Int(1)}}));
  metadata->set("0", Dict({{"version", Value::Int(1)}}));
  metadata->set("1", Dict({{"version", Value::Int(2)}}));
  auto sd = Value::Dict(true);
  sd->set("0.weight", F32Range({3, 4}, 1.0f / 64));
  sd->set("0.bias", F32Range({3}, 1.0f / 64));
  sd->set("1.weight", F32Range({3}));
  sd->set("1.running_mean", MakeTensor<float>(DType::kFloat32, {3}, {0.f, 0.f, 0.f}));
  sd->set("1.num_batches_tracked", MakeTensor<int64_t>(DType::kInt64, {}, {0}));
  sd->state = Dict({{"_metadata", metadata}});
  return sd;
}

// Like torch.optim.AdamW(...).state_dict() after two steps.
ValuePtr OptimizerState() {
  auto state = Value::Dict();
  for (int p = 0; p < 2; ++p) {
    state->set(Value::Int(p), Dict({{"step", MakeTensor<float>(DType::kFloat32, {}, {2.0f})},
                                    {"exp_avg", F32Range({3}, 1.0f / 512)},
                                    {"exp_avg_sq", F32Range({3}, 1.0f / 4096)}}));
  }
  auto group = Dict({
      {"lr", Value::Float(0.001)},
      {"betas", Value::Tuple({Value::Float(0.9), Value::Float(0.999)})},
      {"eps", Value::Float(1e-08)},
      {"weight_decay", Value::Float(0.01)},
      {"amsgrad", Value::Bool(false)},
      {"maximize", Value::Bool(false)},
      {"foreach", Value::None()},
      {"capturable", Value::Bool(false)},
      {"params", Value::List({Value::Int(0), Value::Int(1)})},
  });
  return Dict({{"state", state}, {"param_groups", Value::List({group})}});
}

ValuePtr Large() {
  auto big = F32Range({300000}, 1.0f / 64);
  auto matrix = F32Range({100, 150}, 1.0f / 8);
  std::vector<uint16_t> halves(70000);
  for (size_t k = 0; k < halves.size(); ++k) halves[k] = FloatToHalf(static_cast<float>(k % 2048) / 16);
  return Dict({{"big", big},
               {"matrix_t", View(matrix, {150, 100}, {1, 150}, 0)},
               {"half", MakeTensor<uint16_t>(DType::kFloat16, {70000}, halves)}});
}

// More than 1000 items (APPENDS/SETITEMS batches) and more than 256 memo
// entries (LONG_BINPUT / LONG_BINGET).
ValuePtr Batching() {
  auto shared = F32Range({4});
  std::vector<ValuePtr> ints;
  for (int k = 0; k < 2500; ++k) ints.push_back(Value::Int(k * 7 - 1000));
  auto d = Value::Dict();
  for (int k = 0; k < 1500; ++k) d->set("key" + std::to_string(k), Value::Int(k));
  return Value::List({shared, Value::List(ints), d, shared});
}

ValuePtr TensorWithAttrs() {
  auto t = F32Range({2});
  t->tensor->attrs = Dict({{"ds_id", Value::Int(7)}, {"ds_shape", Value::Size({2})}});
  return t;
}

// Gives every distinct storage a key ("0", "1", ... in depth-first order) so
// that the description shows which tensors share one. The writer numbers
// storages itself; these keys only name them.
void NameStorages(const Value& root) {
  std::unordered_set<const Value*> seen;
  std::unordered_map<const Storage*, std::string> keys;
  std::function<void(const Value&)> walk = [&](const Value& v) {
    if (!seen.insert(&v).second) return;
    if (v.tensor && v.tensor->storage) {
      auto [it, fresh] = keys.emplace(v.tensor->storage.get(), std::to_string(keys.size()));
      v.tensor->storage->key = it->second;
      if (v.tensor->attrs) walk(*v.tensor->attrs);
    }
    for (const auto& c : v.items) walk(*c);
    for (const auto& [k, val] : v.entries) {
      walk(*k);
      walk(*val);
    }
    if (v.state) walk(*v.state);
  };
  walk(root);
}

struct Sample {
  std::string name;
  ValuePtr value;
};

std::vector<Sample> Samples() {
  return {
      {"dtypes", Dtypes()},
      {"dtypes_v3", DtypesV3()},
      {"views_and_sharing", ViewsAndSharing()},
      {"scalars_and_empty", ScalarsAndEmpty()},
      {"nested", Nested()},
      {"ints", Ints()},
      {"ints_long4", Long4()},
      {"strings", Strings()},
      {"floats", Floats()},
      {"bytes", BytesSample()},
      {"sets", Sets()},
      {"torch_objects", TorchObjects()},
      {"devices_and_dtypes", DevicesAndDtypes()},
      {"parameter", Parameter(F32Range({2, 3}, 0.25f), true)},
      {"parameters_in_dict", ParametersInDict()},
      {"state_dict", StateDict()},
      {"optimizer_state", OptimizerState()},
      {"large", Large()},
      {"batching", Batching()},
      {"tensor_with_attrs", TensorWithAttrs()},
  };
}

int Run(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: write_samples OUT_DIR [FIXTURE_DIR...]\n";
    return 2;
  }
  namespace fs = std::filesystem;
  const fs::path out = argv[1];
  fs::create_directories(out / "samples");
  SaveOptions so;
  so.durable = false;

  json index = json::array();
  for (const auto& s : Samples()) {
    NameStorages(*s.value);
    const std::string file = s.name + ".pt";
    SaveTorchFile((out / "samples" / file).string(), s.value, so);
    index.push_back({{"name", s.name}, {"file", "samples/" + file}, {"expected", ValueToJson(*s.value)}});
  }
  std::ofstream(out / "samples.json") << index.dump(1) << "\n";

  // Every zip fixture, read and written again.
  json roundtrip = json::array();
  for (int a = 2; a < argc; ++a) {
    const fs::path dir = argv[a];
    const std::string version = dir.filename().string();
    std::ifstream in(dir / "manifest.json");
    if (!in) throw IoError("cannot read " + (dir / "manifest.json").string());
    json manifest = json::parse(in);
    fs::create_directories(out / "roundtrip" / version);
    for (const auto& f : manifest["files"]) {
      if (f["format"] != "zip") continue;
      const std::string name = f["name"];
      TorchFile t = LoadTorchFile((dir / f["file"].get<std::string>()).string(), {.policy = PicklePolicy::kLenient});
      const std::string file = "roundtrip/" + version + "/" + name + ".pt";
      SaveTorchFile((out / file).string(), t.root, so);
      const bool opaque = f.value("malicious", false) || f.value("custom_classes", false);
      roundtrip.push_back({{"name", name},
                           {"version", version},
                           {"file", file},
                           {"unpickle", !opaque},
                           {"expected", opaque ? json() : f["expected"]}});
    }
  }
  std::ofstream(out / "roundtrip.json") << roundtrip.dump(1) << "\n";
  std::cout << "wrote " << index.size() << " samples and " << roundtrip.size() << " round-tripped fixtures to "
            << out.string() << "\n";
  return 0;
}

}  // namespace
}  // namespace uckpt

int main(int argc, char** argv) {
  try {
    return uckpt::Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "write_samples: " << e.what() << "\n";
    return 1;
  }
}
