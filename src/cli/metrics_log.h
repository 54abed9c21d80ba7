// Per-step metrics: logs/<run>/metrics.csv (step,loss,lr,grad_norm,loss_scale,
// tokens_per_s; floats with 17 significant digits) and TensorBoard event files
// in the same folder (TFRecord framing with masked CRC32C, scalar summaries).
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace uckpt::cli {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;       // the global batch's mean token loss
  double lr = 0;         // the lr this step used
  double grad_norm = 0;  // pre-clipping global norm
  double loss_scale = 1;
  double tokens_per_s = 0;
};

// CRC-32C (Castagnoli), and TFRecord's masked form of it.
uint32_t Crc32c(const uint8_t* data, size_t n, uint32_t crc = 0);
uint32_t MaskedCrc32c(const uint8_t* data, size_t n);

// One TFRecord: length, masked CRC of the length, data, masked CRC of the data.
std::string TfRecord(const std::string& data);
// A serialized tensorflow.Event with one scalar summary (tag = value).
std::string ScalarEvent(double wall_time, int64_t step, const std::string& tag, float value);
// The first event of every file: file_version "brain.Event:2".
std::string FileVersionEvent(double wall_time);

class MetricsLog {
 public:
  // Creates `dir` if needed; appends to an existing metrics.csv (a resumed
  // run) and starts a new event file.
  explicit MetricsLog(const std::string& dir);
  void Write(const StepMetrics& m);
  const std::string& csv_path() const { return csv_path_; }
  const std::string& events_path() const { return events_path_; }

 private:
  std::string csv_path_, events_path_;
  std::ofstream csv_, events_;
};

}  // namespace uckpt::cli
