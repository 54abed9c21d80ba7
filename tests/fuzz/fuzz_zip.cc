// libFuzzer target: the zip container parser. Any input must either parse or
// raise FormatError; every record it accepts must lie inside the input.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "format/error.h"
#include "format/file.h"
#include "format/zip.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace uckpt;
  try {
    ZipReader zip(MappedFile::FromMemory(std::vector<uint8_t>(data, data + size), "fuzz.zip"));
    // Read every byte of every record (ASan reports any access outside the input).
    uint64_t sum = 0;
    for (const ZipEntry& e : zip.entries()) {
      for (uint8_t b : zip.Data(e)) sum += b;
      if (zip.Find(e.name) == nullptr) __builtin_trap();  // a listed record must be found by name
      sum += zip.CrcMatches(e);
    }
    volatile uint64_t sink = sum;
    (void)sink;
  } catch (const FormatError&) {
  } catch (const IoError&) {
  }
  return 0;
}
