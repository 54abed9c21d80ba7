// libFuzzer target: whole torch.save files. Load, render as JSON and as a tree,
// save what was loaded and load the saved file again: a file the writer
// produced must always load, and to the same JSON (up to what saving
// renumbers: storage keys and classes, the rebuild function).
#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "format/error.h"
#include "format/file.h"
#include "format/torch_file.h"
#include "format/value_json.h"
#include "format/value_print.h"

namespace {

using namespace uckpt;
using nlohmann::json;

// A private folder for the round-trip file, removed at exit. Never freed, so
// that it outlives the exit handler that removes the folder.
const std::string& ScratchDir() {
  static const std::string* dir = [] {
    std::string pattern = (std::filesystem::temp_directory_path() / "uckpt-fuzz-XXXXXX").string();
    if (!mkdtemp(pattern.data())) __builtin_trap();
    auto* d = new std::string(pattern);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(ScratchDir(), ec);
    });
    return d;
  }();
  return *dir;
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Drops what SaveTorchFile legitimately rewrites.
void Normalize(json& j) {
  if (j.is_object()) {
    for (const char* k : {"storage_key", "storage_class", "storage_numel", "rebuild"}) j.erase(k);
    for (auto& [k, v] : j.items()) Normalize(v);
  } else if (j.is_array()) {
    for (auto& v : j) Normalize(v);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  TorchFile f;
  json before;
  try {
    // Lenient: the most code. Strict mode is fuzzed in fuzz_pickle and fuzz_checkpoint.
    f = LoadTorchFile(MappedFile::FromMemory(std::vector<uint8_t>(data, data + size), "fuzz.pt"),
                      {.policy = PicklePolicy::kLenient});
    before = ValueToJson(*f.root);
    std::ostringstream tree;
    PrintValue(tree, *f.root);
  } catch (const FormatError&) {
    return 0;
  } catch (const IoError&) {
    return 0;
  }

  const std::string path = ScratchDir() + "/roundtrip.pt";
  try {
    SaveTorchFile(path, f.root, {.durable = false});
  } catch (const FormatError&) {
    return 0;  // a value torch cannot represent: refusing it is fine
  } catch (const IoError&) {
    return 0;  // the scratch disk, not the code under test
  }
  // From here on, an exception is a finding: we wrote a file we cannot read back.
  TorchFile again = LoadTorchFile(path, {.verify_crc = true, .policy = PicklePolicy::kLenient});
  json after = ValueToJson(*again.root);
  Normalize(before);
  Normalize(after);
  if (before != after) {
    fprintf(stderr, "round trip changed the value:\nbefore: %s\nafter:  %s\n", Dump(before).substr(0, 4000).c_str(),
            Dump(after).substr(0, 4000).c_str());
    __builtin_trap();
  }
  return 0;
}
