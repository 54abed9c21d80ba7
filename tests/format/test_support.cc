#include "test_support.h"

#include <stdlib.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <unordered_set>

#include "format/file.h"
#include "format/zip.h"

namespace uckpt::test {

// ---- Fixtures --------------------------------------------------------------

std::string SharedDir() {
  if (const char* env = std::getenv("UCKPT_SHARED")) return env;
#ifdef UCKPT_SHARED_DIR
  return UCKPT_SHARED_DIR;
#else
  return "../shared";
#endif
}

const std::vector<std::string>& FixtureVersions() {
  static const std::vector<std::string> versions = {"torch-1.13", "torch-2.11"};
  return versions;
}

std::string FixtureDir(const std::string& version) { return SharedDir() + "/fixtures/torch/" + version; }

const json& Manifest(const std::string& version) {
  static std::mutex mu;
  static std::map<std::string, json> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(version);
  if (it != cache.end()) return it->second;
  std::ifstream in(FixtureDir(version) + "/manifest.json");
  if (!in) throw std::runtime_error("cannot read " + FixtureDir(version) + "/manifest.json");
  return cache.emplace(version, json::parse(in)).first->second;
}

const json& Fixture::entry() const {
  for (const auto& f : Manifest(version)["files"])
    if (f["name"] == name) return f;
  throw std::runtime_error("no manifest entry " + name);
}

std::vector<Fixture> AllFixtures() {
  std::vector<Fixture> out;
  for (const auto& version : FixtureVersions()) {
    const json* m = nullptr;
    try {
      m = &Manifest(version);
    } catch (const std::exception&) {
      continue;  // reported by the FixturesPresent test
    }
    for (const auto& f : (*m)["files"]) {
      Fixture x;
      x.version = version;
      x.name = f["name"];
      x.path = FixtureDir(version) + "/" + f["file"].get<std::string>();
      x.legacy = f["format"] == "legacy";
      x.malicious = f.value("malicious", false);
      out.push_back(std::move(x));
    }
  }
  return out;
}

void PrintTo(const Fixture& f, std::ostream* os) { *os << f.version << "/" << f.name; }

std::vector<Fixture> ZipFixtures() {
  std::vector<Fixture> out;
  for (auto& f : AllFixtures())
    if (!f.legacy) out.push_back(std::move(f));
  return out;
}

std::string TestName(const Fixture& f) {
  std::string s = f.version + "__" + f.name;
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

bool FileExists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// ---- JSON comparison -------------------------------------------------------

namespace {

class Differ {
 public:
  explicit Differ(const CompareOptions& o) : o_(o) {}

  void Compare(const json& want, const json& got, const std::string& path) {
    if (want.is_number() && got.is_number()) return Numbers(want, got, path);
    if (want.type() != got.type()) return Report(path, "want " + Short(want) + ", got " + Short(got));
    if (want.is_array()) {
      if (want.size() != got.size())
        return Report(path, "want " + std::to_string(want.size()) + " items, got " + std::to_string(got.size()));
      for (size_t k = 0; k < want.size(); ++k) Compare(want[k], got[k], path + "[" + std::to_string(k) + "]");
      return;
    }
    if (want.is_object()) return Objects(want, got, path);
    if (want != got) Report(path, "want " + Short(want) + ", got " + Short(got));
  }

  std::vector<std::string> diffs;

 private:
  void Report(const std::string& path, const std::string& what) { diffs.push_back(path + ": " + what); }

  static std::string Short(const json& j) {
    std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
    return s.size() > 120 ? s.substr(0, 117) + "..." : s;
  }

  void Numbers(const json& want, const json& got, const std::string& path) {
    if (want.is_number_float() || got.is_number_float()) {
      if (!want.is_number_float() || !got.is_number_float())
        return Report(path, "want " + Short(want) + ", got " + Short(got) + " (int vs float)");
      double a = want.get<double>(), b = got.get<double>();
      bool same = (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b);
      if (!same) Report(path, "want " + Short(want) + ", got " + Short(got));
      return;
    }
    auto wide = [](const json& j) -> __int128 {
      return j.is_number_unsigned() ? static_cast<__int128>(j.get<uint64_t>())
                                    : static_cast<__int128>(j.get<int64_t>());
    };
    if (wide(want) != wide(got)) Report(path, "want " + Short(want) + ", got " + Short(got));
  }

  void Objects(const json& want, const json& got, const std::string& path) {
    for (auto it = want.begin(); it != want.end(); ++it)
      if (!got.contains(it.key())) Report(path, "missing key '" + it.key() + "'");
    for (auto it = got.begin(); it != got.end(); ++it)
      if (!want.contains(it.key())) Report(path, "unexpected key '" + it.key() + "' = " + Short(it.value()));
    const bool is_set = want.contains("type") && (want["type"] == "set" || want["type"] == "frozenset");
    for (auto it = want.begin(); it != want.end(); ++it) {
      if (!got.contains(it.key())) continue;
      const std::string sub = path + "." + it.key();
      if (is_set && it.key() == "items") {
        SetItems(it.value(), got["items"], sub);
      } else if (it.key() == "storage_key" && o_.map_storage_keys && it.value().is_string() &&
                 got["storage_key"].is_string()) {
        MapKey(it.value(), got["storage_key"], sub);
      } else {
        Compare(it.value(), got[it.key()], sub);
      }
    }
  }

  // Items of a set: equal as multisets.
  void SetItems(const json& want, const json& got, const std::string& path) {
    if (!want.is_array() || !got.is_array() || want.size() != got.size())
      return Report(path, "set sizes differ: want " + Short(want) + ", got " + Short(got));
    std::vector<bool> used(got.size(), false);
    for (size_t k = 0; k < want.size(); ++k) {
      bool found = false;
      for (size_t j = 0; j < got.size() && !found; ++j) {
        if (used[j]) continue;
        Differ d(o_);
        d.Compare(want[k], got[j], path);
        if (d.diffs.empty()) used[j] = found = true;
      }
      if (!found) Report(path, "set item " + Short(want[k]) + " not found");
    }
  }

  void MapKey(const json& want, const json& got, const std::string& path) {
    const std::string w = want, g = got;
    auto [f, fresh_f] = forward_.emplace(w, g);
    auto [b, fresh_b] = backward_.emplace(g, w);
    if (f->second != g)
      Report(path, "storage '" + w + "' became both '" + f->second + "' and '" + g + "' (sharing lost)");
    if (b->second != w)
      Report(path, "storages '" + b->second + "' and '" + w + "' both became '" + g + "' (sharing invented)");
  }

  const CompareOptions& o_;
  std::map<std::string, std::string> forward_, backward_;
};

}  // namespace

std::vector<std::string> JsonDiff(const json& want, const json& got, const CompareOptions& options) {
  Differ d(options);
  d.Compare(want, got, "$");
  return std::move(d.diffs);
}

std::string DiffText(const std::vector<std::string>& diffs, size_t max) {
  std::string out;
  for (size_t k = 0; k < diffs.size() && k < max; ++k) out += "  " + diffs[k] + "\n";
  if (diffs.size() > max) out += "  ... " + std::to_string(diffs.size() - max) + " more\n";
  return out;
}

// ---- Value trees -----------------------------------------------------------

namespace {

void Walk(const Value& root, const std::function<void(const Value&)>& visit) {
  std::unordered_set<const Value*> seen;
  std::vector<const Value*> todo{&root};
  while (!todo.empty()) {
    const Value* v = todo.back();
    todo.pop_back();
    if (!seen.insert(v).second) continue;
    visit(*v);
    // Pushed in reverse so that children are visited in order.
    std::vector<const Value*> kids;
    for (const auto& c : v->items) kids.push_back(c.get());
    for (const auto& c : v->listitems) kids.push_back(c.get());
    for (const auto& [k, val] : v->entries) {
      kids.push_back(k.get());
      kids.push_back(val.get());
    }
    if (v->state) kids.push_back(v->state.get());
    if (v->kwargs) kids.push_back(v->kwargs.get());
    if (v->tensor && v->tensor->attrs) kids.push_back(v->tensor->attrs.get());
    for (auto it = kids.rbegin(); it != kids.rend(); ++it) todo.push_back(*it);
  }
}

}  // namespace

std::vector<const Tensor*> Tensors(const Value& root) {
  std::vector<const Tensor*> out;
  Walk(root, [&](const Value& v) {
    if ((v.kind == Kind::kTensor || v.kind == Kind::kParameter) && v.tensor) out.push_back(v.tensor.get());
  });
  return out;
}

std::vector<std::string> ObjectClasses(const Value& root) {
  std::vector<std::string> out;
  Walk(root, [&](const Value& v) {
    if (v.kind == Kind::kObject || v.kind == Kind::kGlobal) out.push_back(v.s);
  });
  return out;
}

// ---- Building inputs -------------------------------------------------------

PickleBuilder& PickleBuilder::Proto(int v) { return Op(pickle::kProto).U8(static_cast<uint8_t>(v)); }
PickleBuilder& PickleBuilder::Op(pickle::Opcode op) {
  b_ += static_cast<char>(op);
  return *this;
}
PickleBuilder& PickleBuilder::U8(uint8_t v) {
  b_ += static_cast<char>(v);
  return *this;
}
PickleBuilder& PickleBuilder::U32(uint32_t v) {
  for (int k = 0; k < 4; ++k) b_ += static_cast<char>((v >> (8 * k)) & 0xff);
  return *this;
}
PickleBuilder& PickleBuilder::Line(const std::string& text) {
  b_ += text;
  b_ += '\n';
  return *this;
}
PickleBuilder& PickleBuilder::Raw(const std::string& bytes) {
  b_ += bytes;
  return *this;
}
PickleBuilder& PickleBuilder::Global(const std::string& module, const std::string& name) {
  return Op(pickle::kGlobal).Line(module).Line(name);
}
PickleBuilder& PickleBuilder::Inst(const std::string& module, const std::string& name) {
  return Op(pickle::kInst).Line(module).Line(name);
}
PickleBuilder& PickleBuilder::Str(const std::string& s) {
  return Op(pickle::kBinUnicode).U32(static_cast<uint32_t>(s.size())).Raw(s);
}
PickleBuilder& PickleBuilder::ShortStr(const std::string& s) {
  return Op(pickle::kShortBinUnicode).U8(static_cast<uint8_t>(s.size())).Raw(s);
}
PickleBuilder& PickleBuilder::Bytes(const std::string& s) {
  return Op(pickle::kBinBytes).U32(static_cast<uint32_t>(s.size())).Raw(s);
}
PickleBuilder& PickleBuilder::Int(int64_t v) {
  if (v >= 0 && v < 256) return Op(pickle::kBinInt1).U8(static_cast<uint8_t>(v));
  if (v >= 0 && v < 65536)
    return Op(pickle::kBinInt2).U8(static_cast<uint8_t>(v & 0xff)).U8(static_cast<uint8_t>(v >> 8));
  if (v >= INT32_MIN && v <= INT32_MAX) return Op(pickle::kBinInt).U32(static_cast<uint32_t>(static_cast<int32_t>(v)));
  Op(pickle::kLong1).U8(8);
  for (int k = 0; k < 8; ++k) U8(static_cast<uint8_t>((static_cast<uint64_t>(v) >> (8 * k)) & 0xff));
  return *this;
}
PickleBuilder& PickleBuilder::Put(uint8_t idx) { return Op(pickle::kBinPut).U8(idx); }
PickleBuilder& PickleBuilder::Get(uint8_t idx) { return Op(pickle::kBinGet).U8(idx); }
PickleBuilder& PickleBuilder::Tensor(const std::string& storage_class, const std::string& key, int64_t storage_numel,
                                     int64_t offset, const std::vector<int64_t>& shape,
                                     const std::vector<int64_t>& stride) {
  Global("torch._utils", "_rebuild_tensor_v2");
  Mark();
  Mark()
      .Str("storage")
      .Global("torch", storage_class)
      .Str(key)
      .Str("cpu")
      .Int(storage_numel)
      .Op(pickle::kTuple)
      .Op(pickle::kBinPersId);
  Int(offset);
  Mark();
  for (int64_t d : shape) Int(d);
  Op(pickle::kTuple);
  Mark();
  for (int64_t d : stride) Int(d);
  Op(pickle::kTuple);
  Op(pickle::kNewFalse);  // requires_grad = False
  Global("collections", "OrderedDict").Op(pickle::kEmptyTuple).Op(pickle::kReduce);
  Op(pickle::kTuple).Op(pickle::kReduce);
  return *this;
}

void WriteTorchZip(const std::string& path, const std::string& archive, const std::string& pickle,
                   const std::map<std::string, std::vector<uint8_t>>& storages) {
  AtomicFile out(path, /*durable=*/false);
  ZipWriter zip(out);
  zip.AddRecord(archive + "/data.pkl", pickle);
  for (const auto& [key, data] : storages) zip.AddRecord(archive + "/data/" + key, std::span<const uint8_t>(data));
  zip.AddRecord(archive + "/version", std::string("3\n"));
  zip.Finish();
  out.Commit();
}

TempDir::TempDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/uckpt-format-test-XXXXXX";
  if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed for " + tmpl);
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace uckpt::test
