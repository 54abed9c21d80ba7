// libFuzzer target: the safetensors header parser. Any input must either
// parse or raise FormatError; every tensor it accepts must lie inside the
// input, tile the data with the others, and read back through Elements.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "format/error.h"
#include "format/file.h"
#include "format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = uckpt::MappedFile::FromMemory(std::vector<uint8_t>(data, data + size), "fuzz.safetensors");
  try {
    uckpt::SafetensorsFile f = uckpt::SafetensorsFile::Parse(file);
    uint64_t end = 0;
    for (const auto& t : f.tensors()) {
      if (t.begin < end || t.end > size ||
          t.end - t.begin != static_cast<uint64_t>(t.numel) * uckpt::DTypeSize(t.dtype))
        __builtin_trap();
      end = t.end;
      if (f.Elements(t, 0, t.numel).size() != t.end - t.begin) __builtin_trap();
      if (f.Find(t.name) == nullptr) __builtin_trap();
    }
    if (!f.tensors().empty() && end != size) __builtin_trap();
  } catch (const uckpt::FormatError&) {}
  return 0;
}
