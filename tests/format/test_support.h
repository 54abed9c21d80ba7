// Helpers shared by the format-layer tests: the golden fixtures and their
// manifests, a JSON comparison that knows the manifest schema, pickle and zip
// builders for hand-made (hostile or broken) inputs, and scratch folders.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "format/pickle_opcodes.h"
#include "format/value.h"

namespace uckpt::test {

using nlohmann::json;

// ---- Fixtures --------------------------------------------------------------

// The shared/ folder (compile definition UCKPT_SHARED_DIR, or $UCKPT_SHARED).
std::string SharedDir();
// "torch-1.13", "torch-2.11".
const std::vector<std::string>& FixtureVersions();
std::string FixtureDir(const std::string& version);
// The parsed manifest.json of `version` (parsed once per process).
const json& Manifest(const std::string& version);

struct Fixture {
  std::string version;  // "torch-1.13"
  std::string name;     // "tensor_f32_2x3"
  std::string path;     // absolute path of the .pt file
  bool legacy = false;
  bool malicious = false;
  const json& entry() const;  // its manifest entry
};
// gtest prints parameters with this.
void PrintTo(const Fixture& f, std::ostream* os);

// Every file entry of every manifest, in manifest order. Empty (and the
// FixturesPresent test fails) when shared/ is missing.
std::vector<Fixture> AllFixtures();
// The fixtures that are zip files (all but the legacy ones).
std::vector<Fixture> ZipFixtures();
// A gtest-safe name: "torch_1_13__tensor_f32_2x3".
std::string TestName(const Fixture& f);

std::vector<uint8_t> ReadFile(const std::string& path);

// ---- JSON comparison -------------------------------------------------------

struct CompareOptions {
  // false: storage keys must be equal. true: keys may differ, but the map
  // want-key -> got-key must be a bijection (the same sharing).
  bool map_storage_keys = false;
};

// Compares a value tree in the manifest schema: set/frozenset items as
// multisets, floats bit-exactly (so -0.0 != 0.0, nan == nan), ints by value,
// everything else exactly. Returns one line per difference (empty: equal).
std::vector<std::string> JsonDiff(const json& want, const json& got, const CompareOptions& options = {});
// The first few differences, for failure messages.
std::string DiffText(const std::vector<std::string>& diffs, size_t max = 12);

// ---- Value trees -----------------------------------------------------------

// Every tensor (including parameters' data) reachable from `root`, in
// depth-first order.
std::vector<const Tensor*> Tensors(const Value& root);
// Every kObject / kGlobal class path reachable from `root`.
std::vector<std::string> ObjectClasses(const Value& root);

// ---- Building inputs -------------------------------------------------------

// Assembles a pickle opcode by opcode, with the constants of
// format/pickle_opcodes.h. Starts with no PROTO: Proto() writes one.
class PickleBuilder {
 public:
  PickleBuilder& Proto(int v);
  PickleBuilder& Op(pickle::Opcode op);          // the opcode byte alone; its argument follows with the calls below
  PickleBuilder& U8(uint8_t v);                  // a 1-byte argument
  PickleBuilder& U32(uint32_t v);                // a 4-byte little-endian argument
  PickleBuilder& Line(const std::string& text);  // a text argument and its newline
  PickleBuilder& Raw(const std::string& bytes);
  PickleBuilder& Global(const std::string& module, const std::string& name);  // GLOBAL
  PickleBuilder& Inst(const std::string& module, const std::string& name);    // INST (after a MARK)
  PickleBuilder& Str(const std::string& s);                                   // BINUNICODE
  PickleBuilder& ShortStr(const std::string& s);                              // SHORT_BINUNICODE (protocol 4)
  PickleBuilder& Bytes(const std::string& s);                                 // BINBYTES (protocol 3)
  PickleBuilder& Int(int64_t v);                                              // BININT1 / BININT2 / BININT / LONG1
  PickleBuilder& Mark() { return Op(pickle::kMark); }
  PickleBuilder& Put(uint8_t idx);  // BINPUT
  PickleBuilder& Get(uint8_t idx);  // BINGET
  PickleBuilder& Stop() { return Op(pickle::kStop); }
  // Calls the callable on the stack with one string: `arg`, TUPLE1, REDUCE.
  PickleBuilder& CallWithStr(const std::string& arg) { return Str(arg).Op(pickle::kTuple1).Op(pickle::kReduce); }
  // A tensor over ('storage', torch.<cls>, key, 'cpu', numel) with
  // _rebuild_tensor_v2; leaves the tensor on the stack.
  PickleBuilder& Tensor(const std::string& storage_class, const std::string& key, int64_t storage_numel, int64_t offset,
                        const std::vector<int64_t>& shape, const std::vector<int64_t>& stride);
  const std::string& bytes() const { return b_; }

 private:
  std::string b_;
};

// Writes a torch.save-style zip to `path` with ZipWriter: <archive>/data.pkl,
// the given data/<key> records, then version.
void WriteTorchZip(const std::string& path, const std::string& archive, const std::string& pickle,
                   const std::map<std::string, std::vector<uint8_t>>& storages = {});

// A scratch folder under $TMPDIR, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

bool FileExists(const std::string& path);

}  // namespace uckpt::test
