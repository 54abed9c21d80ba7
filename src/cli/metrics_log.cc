#include "cli/metrics_log.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "format/error.h"

namespace uckpt::cli {
namespace {

std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

// Protocol-buffer wire format, just what Event/Summary need.
void Varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void Key(std::string& out, int field, int wire) { Varint(out, static_cast<uint64_t>(field << 3 | wire)); }
template <typename T>
void Fixed(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian host
  out.append(b, sizeof(T));
}
void Bytes(std::string& out, int field, const std::string& s) {
  Key(out, field, 2);
  Varint(out, s.size());
  out += s;
}

double Now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

std::string EventHeader(double wall_time, int64_t step) {
  std::string e;
  Key(e, 1, 1);  // wall_time: double
  Fixed(e, wall_time);
  Key(e, 2, 0);  // step: int64
  Varint(e, static_cast<uint64_t>(step));
  return e;
}

}  // namespace

uint32_t Crc32c(const uint8_t* data, size_t n, uint32_t crc) {
  static const auto table = MakeCrcTable();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t MaskedCrc32c(const uint8_t* data, size_t n) {
  uint32_t crc = Crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string TfRecord(const std::string& data) {
  std::string out;
  uint64_t len = data.size();
  Fixed(out, len);
  Fixed(out, MaskedCrc32c(reinterpret_cast<const uint8_t*>(out.data()), 8));
  out += data;
  Fixed(out, MaskedCrc32c(reinterpret_cast<const uint8_t*>(data.data()), data.size()));
  return out;
}

std::string ScalarEvent(double wall_time, int64_t step, const std::string& tag, float value) {
  std::string v;
  Bytes(v, 1, tag);  // Summary.Value.tag
  Key(v, 2, 5);      // Summary.Value.simple_value: float
  Fixed(v, value);
  std::string summary;
  Bytes(summary, 1, v);  // Summary.value
  std::string e = EventHeader(wall_time, step);
  Bytes(e, 5, summary);  // Event.summary
  return e;
}

std::string FileVersionEvent(double wall_time) {
  std::string e = EventHeader(wall_time, 0);
  Bytes(e, 3, "brain.Event:2");  // Event.file_version
  return e;
}

MetricsLog::MetricsLog(const std::string& dir) {
  std::filesystem::create_directories(dir);
  csv_path_ = dir + "/metrics.csv";
  bool fresh = !std::filesystem::exists(csv_path_) || std::filesystem::file_size(csv_path_) == 0;
  csv_.open(csv_path_, std::ios::app);
  if (!csv_) throw IoError(csv_path_ + ": cannot open for writing");
  if (fresh) csv_ << "step,loss,lr,grad_norm,loss_scale,tokens_per_s\n" << std::flush;
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  const double now = Now();
  events_path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host + "." +
                 std::to_string(getpid());
  events_.open(events_path_, std::ios::binary);
  if (!events_) throw IoError(events_path_ + ": cannot open for writing");
  events_ << TfRecord(FileVersionEvent(now)) << std::flush;
}

void MetricsLog::Write(const StepMetrics& m) {
  char line[512];
  std::snprintf(line, sizeof(line), "%lld,%.17g,%.17g,%.17g,%.17g,%.6g\n", static_cast<long long>(m.step), m.loss, m.lr,
                m.grad_norm, m.loss_scale, m.tokens_per_s);
  csv_ << line << std::flush;
  const double now = Now();
  for (auto [tag, value] : {std::pair<const char*, double>{"train/loss", m.loss},
                            {"train/lr", m.lr},
                            {"train/grad_norm", m.grad_norm},
                            {"train/loss_scale", m.loss_scale},
                            {"train/tokens_per_s", m.tokens_per_s}})
    events_ << TfRecord(ScalarEvent(now, m.step, tag, static_cast<float>(value)));
  events_.flush();
}

}  // namespace uckpt::cli
