// libFuzzer target: the zip container parser. Any input must either parse or
// raise FormatError; every record it accepts must lie inside the input.
// Also checks uckpt's CRC-32 (carry-less multiply on x86) against zlib's.
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "format/error.h"
#include "format/file.h"
#include "format/zip.h"

namespace {

// Crc32 over the input in two pieces, the split and the starting CRC taken
// from the input itself, must equal zlib's CRC of the whole.
void CheckCrc32(const uint8_t* data, size_t size) {
  uint32_t start = 0;
  size_t split = 0;
  if (size >= 6) {
    start = uint32_t{data[0]} | (uint32_t{data[1]} << 8) | (uint32_t{data[2]} << 16) | (uint32_t{data[3]} << 24);
    split = (size_t{data[4]} | (size_t{data[5]} << 8)) % (size + 1);
  }
  const uint32_t ours = uckpt::Crc32({data + split, size - split}, uckpt::Crc32({data, split}, start));
  if (ours != static_cast<uint32_t>(crc32_z(start, data, size))) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace uckpt;
  CheckCrc32(data, size);
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
  } catch (const IoError&) {}
  return 0;
}
