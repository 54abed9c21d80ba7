#include "format/zip.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <optional>
#include <stdexcept>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "format/error.h"

namespace uckpt {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kZip64EndSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint32_t kDescriptorSig = 0x08074b50;
constexpr uint64_t k32Max = 0xFFFFFFFFu;

uint16_t Le16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t Le32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}
uint64_t Le64(const uint8_t* p) { return uint64_t{Le32(p)} | (uint64_t{Le32(p + 4)} << 32); }

void Put16(std::string& b, uint16_t v) {
  b.push_back(static_cast<char>(v & 0xff));
  b.push_back(static_cast<char>(v >> 8));
}
void Put32(std::string& b, uint32_t v) {
  Put16(b, static_cast<uint16_t>(v & 0xffff));
  Put16(b, static_cast<uint16_t>(v >> 16));
}
void Put64(std::string& b, uint64_t v) {
  Put32(b, static_cast<uint32_t>(v & k32Max));
  Put32(b, static_cast<uint32_t>(v >> 32));
}

#if defined(__x86_64__)
// CRC-32 by carry-less multiplication, about 2.5x zlib's speed (saving a
// checkpoint is otherwise bound by it). Four 16-byte lanes are folded forward
// 64 bytes at a time, then into one lane, as in Intel's paper "Fast CRC
// Computation for Generic Polynomials Using PCLMULQDQ"; the constants are
// x^n mod P for the fold distances, bit-reflected. Folding keeps the data's
// residue mod P, so zlib's CRC of the 16 bytes left equals that of everything
// folded into them; zlib also does the tail of fewer than 16 bytes.
__attribute__((target("pclmul"))) inline __m128i Fold(__m128i x, __m128i k, __m128i next) {
  __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

inline __m128i Load(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// `n` >= 64.
__attribute__((target("pclmul"))) uint32_t Crc32Clmul(const uint8_t* p, size_t n, uint32_t crc) {
  const __m128i by64 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);
  const __m128i by16 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
  // zlib's running CRC is the complement of the register, which enters the first 4 bytes.
  __m128i x0 = _mm_xor_si128(Load(p), _mm_cvtsi32_si128(static_cast<int>(~crc)));
  __m128i x1 = Load(p + 16), x2 = Load(p + 32), x3 = Load(p + 48);
  for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
    x0 = Fold(x0, by64, Load(p));
    x1 = Fold(x1, by64, Load(p + 16));
    x2 = Fold(x2, by64, Load(p + 32));
    x3 = Fold(x3, by64, Load(p + 48));
  }
  __m128i x = Fold(Fold(Fold(x0, by16, x1), by16, x2), by16, x3);
  for (; n >= 16; p += 16, n -= 16) x = Fold(x, by16, Load(p));
  uint8_t rest[16];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(rest), x);
  const uint32_t folded = static_cast<uint32_t>(crc32_z(0xFFFFFFFFu, rest, 16));  // register starts at 0
  return static_cast<uint32_t>(crc32_z(folded, p, n));
}
#endif

}  // namespace

uint32_t Crc32(std::span<const uint8_t> data, uint32_t crc) {
#if defined(__x86_64__)
  static const bool clmul = __builtin_cpu_supports("pclmul");
  if (clmul && data.size() >= 64) return Crc32Clmul(data.data(), data.size(), crc);
#endif
  return static_cast<uint32_t>(crc32_z(crc, data.data(), data.size()));
}

uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return static_cast<uint32_t>(crc32_combine64(crc_a, crc_b, static_cast<z_off64_t>(length_b)));
}

namespace {

[[noreturn]] void Fail(const MappedFile& file, const std::string& what) {
  throw FormatError(file.path() + ": " + what);
}

// Where the central directory lies and how many records it claims.
struct DirectoryLocation {
  uint64_t count = 0, size = 0, offset = 0;
  uint64_t limit = 0;  // the directory must end before this offset (the end records follow it)
};

// The end-of-central-directory record: the last 22 bytes plus a comment of at
// most 64 KiB, whose length must reach exactly the end of the file.
uint64_t FindEndRecord(const MappedFile& file) {
  const uint8_t* base = file.bytes().data();
  const uint64_t size = file.bytes().size();
  if (size < 22) Fail(file, "too short to be a zip archive (" + std::to_string(size) + " bytes)");
  const uint64_t lowest = size > 22 + 0xFFFF ? size - 22 - 0xFFFF : 0;
  for (uint64_t pos = size - 22 + 1; pos-- > lowest;)
    if (Le32(base + pos) == kEndSig && pos + 22 + Le16(base + pos + 20) == size) return pos;
  Fail(file, "no zip end-of-central-directory record (truncated or not a zip file)");
}

// The end record's 16- and 32-bit fields.
DirectoryLocation DecodeEndRecord(const MappedFile& file, uint64_t eocd) {
  const uint8_t* e = file.bytes().data() + eocd;
  return DirectoryLocation{Le16(e + 10), Le32(e + 12), Le32(e + 16), eocd};
}

// Zip64: a locator right before the end record points at the zip64 end
// record, whose 64-bit fields replace the end record's. Nothing without a locator.
std::optional<DirectoryLocation> DecodeZip64EndRecord(const MappedFile& file, uint64_t eocd) {
  const uint8_t* base = file.bytes().data();
  if (eocd < 20 || Le32(base + eocd - 20) != kZip64LocatorSig) return std::nullopt;
  const uint64_t z64 = Le64(base + eocd - 20 + 8);
  if (z64 > eocd - 20 || eocd - 20 - z64 < 56 || Le32(base + z64) != kZip64EndSig)
    Fail(file, "bad zip64 end-of-central-directory record (locator points to offset " + std::to_string(z64) + ")");
  return DirectoryLocation{Le64(base + z64 + 32), Le64(base + z64 + 40), Le64(base + z64 + 48), z64};
}

// The central directory from the end records, checked to lie inside the file.
DirectoryLocation LocateCentralDirectory(const MappedFile& file) {
  const uint64_t eocd = FindEndRecord(file);
  const DirectoryLocation cd = DecodeZip64EndRecord(file, eocd).value_or(DecodeEndRecord(file, eocd));
  if (cd.offset > cd.limit || cd.size > cd.limit - cd.offset)
    Fail(file, "central directory (offset " + std::to_string(cd.offset) + ", size " + std::to_string(cd.size) +
                   ") lies outside the file");
  if (cd.count > cd.size / 46)
    Fail(file,
         "central directory claims " + std::to_string(cd.count) + " records in " + std::to_string(cd.size) + " bytes");
  return cd;
}

// A record's sizes and local-header offset; the zip64 extra field holds only
// the fields that overflowed (were 0xFFFFFFFF), in this order.
struct RecordSizes {
  uint64_t usize, csize, offset;
};
void DecodeZip64Extra(const MappedFile& file, const std::string& where, const uint8_t* x, const uint8_t* x_end,
                      RecordSizes& sizes) {
  while (x_end - x >= 4) {
    const uint16_t id = Le16(x), len = Le16(x + 2);
    if (x_end - x - 4 < len) Fail(file, where + " has a truncated extra field");
    if (id == 0x0001) {
      const uint8_t* z = x + 4;
      const uint8_t* z_end = z + len;
      for (uint64_t* field : {&sizes.usize, &sizes.csize, &sizes.offset}) {
        if (*field != k32Max) continue;
        if (z_end - z < 8) Fail(file, where + " has a short zip64 extra field");
        *field = Le64(z);
        z += 8;
      }
    }
    x += 4 + len;
  }
}

// Where a record's data starts, from its local header (whose name and extra
// lengths decide it), checked to end before the central directory.
uint64_t DataOffset(const MappedFile& file, const std::string& where, const DirectoryLocation& cd, const RecordSizes& s,
                    const uint8_t* name, uint16_t name_len) {
  const uint64_t size = file.bytes().size();
  if (s.offset > size || size - s.offset < 30)
    Fail(file, where + ": local header offset " + std::to_string(s.offset) + " is outside the file");
  const uint8_t* l = file.bytes().data() + s.offset;
  if (Le32(l) != kLocalSig) Fail(file, where + ": bad local header signature at offset " + std::to_string(s.offset));
  const uint64_t data = s.offset + 30 + Le16(l + 26) + Le16(l + 28);
  if (Le16(l + 26) != name_len || std::memcmp(l + 30, name, name_len) != 0)
    Fail(file, where + ": local header name differs from the central directory");
  if (data > cd.offset || s.usize > cd.offset - data)
    Fail(file, where + ": data (offset " + std::to_string(data) + ", " + std::to_string(s.usize) +
                   " bytes) runs past the start of the central directory");
  return data;
}

// One central-directory record, checked against its local header.
struct DirectoryRecord {
  ZipEntry entry;
  uint64_t local_offset = 0;  // its local header: where its bytes begin
  uint64_t next = 0;          // the next record's offset
};
DirectoryRecord DecodeDirectoryRecord(const MappedFile& file, const DirectoryLocation& cd, uint64_t pos, uint64_t k) {
  const uint64_t cd_end = cd.offset + cd.size;
  std::string where = "central directory record " + std::to_string(k);
  if (cd_end - pos < 46) Fail(file, where + " is truncated");
  const uint8_t* c = file.bytes().data() + pos;
  if (Le32(c) != kCentralSig) Fail(file, where + " has a bad signature");
  const uint16_t flags = Le16(c + 8), method = Le16(c + 10);
  RecordSizes s{Le32(c + 24), Le32(c + 20), Le32(c + 42)};
  const uint16_t name_len = Le16(c + 28), extra_len = Le16(c + 30), comment_len = Le16(c + 32);
  if (cd_end - pos < 46ull + name_len + extra_len + comment_len) Fail(file, where + " is truncated");
  DirectoryRecord r;
  r.entry.name.assign(reinterpret_cast<const char*>(c + 46), name_len);
  r.entry.crc32 = Le32(c + 16);
  where = "record '" + r.entry.name + "'";
  DecodeZip64Extra(file, where, c + 46 + name_len, c + 46 + name_len + extra_len, s);
  if (flags & 0x1) Fail(file, where + " is encrypted; torch files are never encrypted");
  if (method != 0)
    Fail(file, where + " is compressed (method " + std::to_string(method) +
                   "); torch.save writes stored records only, so this archive was re-zipped by another tool");
  if (s.csize != s.usize) Fail(file, where + " has different stored and original sizes");
  const uint64_t data = DataOffset(file, where, cd, s, c + 46, name_len);
  r.entry.data_offset = data;
  r.entry.size = s.usize;
  r.local_offset = s.offset;
  r.next = pos + 46ull + name_len + extra_len + comment_len;
  return r;
}

// The bytes of a record, from its local header to its data's end.
struct RecordSpan {
  uint64_t begin, end;
  size_t index;
};
void CheckNoOverlap(const MappedFile& file, std::vector<RecordSpan> spans, const std::vector<ZipEntry>& entries) {
  std::sort(spans.begin(), spans.end(), [](const RecordSpan& a, const RecordSpan& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < spans.size(); ++k)
    if (spans[k].begin < spans[k - 1].end)
      Fail(file,
           "records '" + entries[spans[k - 1].index].name + "' and '" + entries[spans[k].index].name + "' overlap");
}

}  // namespace

ZipReader::ZipReader(std::shared_ptr<const MappedFile> file) : file_(std::move(file)) {
  const DirectoryLocation cd = LocateCentralDirectory(*file_);
  std::vector<RecordSpan> spans;
  entries_.reserve(cd.count);
  uint64_t pos = cd.offset;
  for (uint64_t k = 0; k < cd.count; ++k) {
    DirectoryRecord r = DecodeDirectoryRecord(*file_, cd, pos, k);
    if (!index_.emplace(r.entry.name, entries_.size()).second)
      Fail(*file_, "record '" + r.entry.name + "' appears twice");
    spans.push_back({r.local_offset, r.entry.data_offset + r.entry.size, entries_.size()});
    entries_.push_back(std::move(r.entry));
    pos = r.next;
  }
  CheckNoOverlap(*file_, std::move(spans), entries_);
}

const ZipEntry* ZipReader::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

std::span<const uint8_t> ZipReader::Data(const ZipEntry& e) const {
  return file_->bytes().subspan(e.data_offset, e.size);
}

bool ZipReader::CrcMatches(const ZipEntry& e) const { return e.crc32 == 0 || Crc32(Data(e)) == e.crc32; }

uint64_t ZipWriter::WriteHeader(const std::string& name, uint64_t size) {
  const uint64_t cursor = out_.offset();
  const bool big_size = size >= k32Max, big_offset = cursor >= k32Max;
  const bool zip64 = big_size || big_offset;

  std::string zip64_extra;
  if (zip64) {
    Put16(zip64_extra, 0x0001);
    Put16(zip64_extra, static_cast<uint16_t>((big_size ? 16 : 0) + (big_offset ? 8 : 0)));
    if (big_size) {
      Put64(zip64_extra, size);
      Put64(zip64_extra, 0);  // compressed-size slot, left 0 as PyTorch's writer does
    }
    if (big_offset) Put64(zip64_extra, cursor);
  }
  uint64_t start = cursor + 30 + name.size() + 4 + zip64_extra.size();
  uint32_t pad = static_cast<uint32_t>((alignment_ - start % alignment_) % alignment_);

  std::string h;
  Put32(h, kLocalSig);
  Put16(h, 0);
  Put16(h, size > 0 ? 0x0808 : 0x0800);
  Put16(h, 0);  // stored
  Put32(h, 0);  // time, date
  Put32(h, 0);  // CRC (in the descriptor)
  Put32(h, 0);
  Put32(h, 0);
  Put16(h, static_cast<uint16_t>(name.size()));
  Put16(h, static_cast<uint16_t>(zip64_extra.size() + 4 + pad));
  h += name;
  h += zip64_extra;
  Put16(h, 0x4246);  // "FB"
  Put16(h, static_cast<uint16_t>(pad));
  h.append(pad, 'Z');
  out_.Write(h);
  return start + pad;
}

void ZipWriter::EndRecord(const std::string& name, uint64_t header_offset, uint64_t data_offset, uint64_t size,
                          uint32_t crc) {
  if (size > 0) {
    std::string d;
    Put32(d, kDescriptorSig);
    Put32(d, crc);
    if (size >= k32Max || header_offset >= k32Max) {  // zip64, as the header
      Put64(d, size);
      Put64(d, size);
    } else {
      Put32(d, static_cast<uint32_t>(size));
      Put32(d, static_cast<uint32_t>(size));
    }
    out_.Write(d);
  }
  records_.push_back({name, data_offset, size, crc});
  header_offsets_.push_back(header_offset);
}

void ZipWriter::AddRecord(const std::string& name, std::span<const std::span<const uint8_t>> pieces,
                          const std::function<void(std::span<const uint8_t>)>& written) {
  uint64_t size = 0;
  uint32_t crc = 0;
  for (auto p : pieces) size += p.size();
  const uint64_t cursor = out_.offset();
  const uint64_t data_offset = WriteHeader(name, size);
  // The CRC goes in the data descriptor after the data, so it is computed
  // as the data is written, 1 MiB at a time: each stretch is read from
  // memory once and is still in cache when the sink hashes and writes it
  // (a whole tensor at a time made three passes over memory).
  constexpr size_t kStep = 1 << 20;
  for (auto p : pieces) {
    for (size_t at = 0; at < p.size(); at += kStep) {
      auto c = p.subspan(at, std::min(kStep, p.size() - at));
      crc = Crc32(c, crc);
      out_.Write(c);
      if (written) written(c);
    }
  }
  EndRecord(name, cursor, data_offset, size, crc);
}

void ZipWriter::AddStreamedRecord(const std::string& name, uint64_t size,
                                  const std::function<void(uint64_t offset, std::span<uint8_t> into)>& fill,
                                  std::span<uint8_t> buffer) {
  if (size > 0 && buffer.empty())
    throw std::invalid_argument("ZipWriter::AddStreamedRecord: no buffer for '" + name + "'");
  const uint64_t cursor = out_.offset();
  const uint64_t data_offset = WriteHeader(name, size);
  // Written 1 MiB at a time, so that the sink hashes each stretch while it
  // is in cache. With a buffer of two halves of at least 1 MiB the work is
  // pipelined: another thread fills the next half (a device-to-host copy)
  // and computes its CRC while this one writes the current half; the halves'
  // CRCs are then combined.
  constexpr size_t kStep = 1 << 20;
  auto write = [&](std::span<const uint8_t> chunk, uint32_t* crc) {
    for (size_t step = 0; step < chunk.size(); step += kStep) {
      const auto c = chunk.subspan(step, std::min(kStep, chunk.size() - step));
      if (crc) *crc = Crc32(c, *crc);
      out_.Write(c);
    }
  };
  uint32_t crc = 0;
  if (buffer.size() < 2 * kStep || size <= buffer.size() / 2) {  // one buffer, filled then written
    for (uint64_t at = 0; at < size;) {
      std::span<uint8_t> chunk = buffer.first(static_cast<size_t>(std::min<uint64_t>(buffer.size(), size - at)));
      fill(at, chunk);
      write(chunk, &crc);
      at += chunk.size();
    }
    EndRecord(name, cursor, data_offset, size, crc);
    return;
  }
  const size_t part = buffer.size() / 2;
  auto half = [&](uint64_t at, size_t k) {
    return buffer.subspan(k * part, static_cast<size_t>(std::min<uint64_t>(part, size - at)));
  };
  auto load = [&](uint64_t at, size_t k) {  // fills half k with the bytes at `at`; their CRC
    const std::span<uint8_t> h = half(at, k);
    fill(at, h);
    return Crc32(h);
  };
  uint32_t loaded = load(0, 0);
  for (uint64_t at = 0, k = 0; at < size; k = 1 - k) {
    const std::span<uint8_t> chunk = half(at, k);
    const uint64_t next = at + chunk.size();
    std::future<uint32_t> ahead;  // (waits for the thread when destroyed, on an error too)
    if (next < size) ahead = std::async(std::launch::async, load, next, 1 - k);
    write(chunk, nullptr);
    crc = Crc32Combine(crc, loaded, chunk.size());
    if (ahead.valid()) loaded = ahead.get();  // rethrows the fill's error
    at = next;
  }
  EndRecord(name, cursor, data_offset, size, crc);
}

void ZipWriter::AddKeptRecord(const std::string& name, std::span<const uint8_t> data, uint32_t crc32) {
  const uint64_t cursor = out_.offset();
  const uint64_t data_offset = WriteHeader(name, data.size());
  if (!data.empty()) out_.WriteKept(data);
  EndRecord(name, cursor, data_offset, data.size(), crc32);
}

void ZipWriter::Finish() {
  const uint64_t cd_offset = out_.offset();
  std::string cd;
  for (size_t k = 0; k < records_.size(); ++k) {
    const ZipEntry& r = records_[k];
    const uint64_t off = header_offsets_[k];
    const bool big_size = r.size >= k32Max, big_offset = off >= k32Max;
    Put32(cd, kCentralSig);
    Put16(cd, 0);
    Put16(cd, 0);
    Put16(cd, r.size > 0 ? 0x0808 : 0x0800);
    Put16(cd, 0);
    Put32(cd, 0);
    Put32(cd, r.crc32);
    Put32(cd, big_size ? k32Max : static_cast<uint32_t>(r.size));
    Put32(cd, big_size ? k32Max : static_cast<uint32_t>(r.size));
    Put16(cd, static_cast<uint16_t>(r.name.size()));
    Put16(cd, static_cast<uint16_t>(big_size || big_offset ? 4 + (big_size ? 16 : 0) + (big_offset ? 8 : 0) : 0));
    Put16(cd, 0);  // comment
    Put16(cd, 0);  // disk
    Put16(cd, 0);  // internal attributes
    Put32(cd, 0);  // external attributes
    Put32(cd, big_offset ? k32Max : static_cast<uint32_t>(off));
    cd += r.name;
    if (big_size || big_offset) {
      Put16(cd, 0x0001);
      Put16(cd, static_cast<uint16_t>((big_size ? 16 : 0) + (big_offset ? 8 : 0)));
      if (big_size) {
        Put64(cd, r.size);
        Put64(cd, r.size);
      }
      if (big_offset) Put64(cd, off);
    }
  }
  const uint64_t n = records_.size();
  const uint64_t zip64_eocd = cd_offset + cd.size();
  Put32(cd, kZip64EndSig);
  Put64(cd, 44);
  Put16(cd, 0x031E);
  Put16(cd, 0x002D);
  Put32(cd, 0);
  Put32(cd, 0);
  Put64(cd, n);
  Put64(cd, n);
  Put64(cd, zip64_eocd - cd_offset);
  Put64(cd, cd_offset);
  Put32(cd, kZip64LocatorSig);
  Put32(cd, 0);
  Put64(cd, zip64_eocd);
  Put32(cd, 1);
  Put32(cd, kEndSig);
  Put16(cd, 0);
  Put16(cd, 0);
  Put16(cd, static_cast<uint16_t>(std::min<uint64_t>(n, 0xFFFF)));
  Put16(cd, static_cast<uint16_t>(std::min<uint64_t>(n, 0xFFFF)));
  Put32(cd, static_cast<uint32_t>(std::min<uint64_t>(zip64_eocd - cd_offset, k32Max)));
  Put32(cd, static_cast<uint32_t>(std::min<uint64_t>(cd_offset, k32Max)));
  Put16(cd, 0);
  out_.Write(cd);
}

}  // namespace uckpt
