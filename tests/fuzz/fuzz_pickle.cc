// libFuzzer target: the pickle VM on raw pickle streams, then the JSON renderer
// and the writer on whatever the VM returns. Each input is read leniently and
// strictly: strict mode may refuse more, but what it accepts must be exactly
// what lenient mode builds.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "format/error.h"
#include "format/pickle_reader.h"
#include "format/pickle_writer.h"
#include "format/value_json.h"

namespace {

using namespace uckpt;

// Answers ('storage', class, key, location, numel) like the torch-file loader,
// but over a small fake buffer instead of a zip record.
class FakeStorages {
 public:
  ValuePtr operator()(const ValuePtr& pid) {
    if (pid->kind != Kind::kTuple || pid->items.size() != 5 || pid->items[0]->kind != Kind::kStr ||
        pid->items[0]->s != "storage")
      throw FormatError("fuzz: persistent id is not a storage tuple");
    const auto& cls = pid->items[1];
    const auto& key = pid->items[2];
    const auto& loc = pid->items[3];
    const auto& numel = pid->items[4];
    if (cls->kind != Kind::kGlobal || key->kind != Kind::kStr || loc->kind != Kind::kStr || numel->kind != Kind::kInt ||
        !numel->big.empty() || numel->i < 0)
      throw FormatError("fuzz: malformed storage tuple");
    auto it = cache_.find(key->s);
    if (it != cache_.end()) return it->second;

    auto d = DTypeFromStorageClass(cls->name());
    const size_t elem = d ? DTypeSize(*d) : 1;
    const size_t n = static_cast<size_t>(std::min<int64_t>(numel->i, 4096)) * elem;
    auto bytes = std::make_shared<std::vector<uint8_t>>(n);
    for (size_t k = 0; k < n; ++k) (*bytes)[k] = static_cast<uint8_t>(k * 131 + 7);
    auto s = std::make_shared<Storage>();
    s->key = key->s;
    s->storage_class = cls->s;
    s->location = loc->s;
    s->numel = numel->i;
    s->bytes = *bytes;
    s->owner = bytes;
    auto v = std::make_shared<Value>();
    v->kind = Kind::kStorage;
    v->storage = std::move(s);
    cache_.emplace(key->s, v);
    return v;
  }

 private:
  std::map<std::string, ValuePtr> cache_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ValuePtr root, strict_root;
  try {
    FakeStorages storages;
    strict_root = ReadPickle({data, size}, "fuzz.pkl", std::ref(storages), {}, PicklePolicy::kStrict);
  } catch (const FormatError&) {}
  try {
    FakeStorages storages;
    root = ReadPickle({data, size}, "fuzz.pkl", std::ref(storages), {}, PicklePolicy::kLenient);
  } catch (const FormatError&) {
    if (strict_root) __builtin_trap();  // strict accepted what lenient refuses
    return 0;
  }
  if (strict_root) {
    std::string a, b;
    try {
      a = ValueToJson(*strict_root).dump();
    } catch (const std::exception&) {}
    try {
      b = ValueToJson(*root).dump();
    } catch (const std::exception&) {}
    if (a != b) __builtin_trap();  // the policy changed the value, not only the verdict
  }
  try {
    (void)ValueToJson(*root).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);  // as `inspect --json`
  } catch (const FormatError&) {}
  try {
    // The writer may refuse a value torch cannot represent, but must not crash.
    (void)PickleForTorch(root);
  } catch (const FormatError&) {}
  return 0;
}
