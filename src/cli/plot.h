// Loss curves of training runs, drawn as SVG (no plotting library): what
// `uckpt plot` overlays to show that resumed runs track their baseline.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace uckpt::cli {

struct LossPoint {
  int64_t step;
  double loss;
};

struct LossCurve {
  std::string name;               // the run's folder name (legend)
  std::vector<LossPoint> points;  // ascending steps
};

// Reads <run_dir>/metrics.csv (header starting `step,loss`). A step logged
// twice (a run resumed into the same folder) keeps its last value. Throws
// FormatError naming the file and line on malformed input, IoError when the
// file cannot be read.
LossCurve ReadLossCurve(const std::string& run_dir);

struct PlotOptions {
  std::string title;
  std::vector<int64_t> resume_steps;  // a dashed marker after each
  int width = 800;
  int height = 480;
};

// One <polyline> per curve (and no other polylines), a legend by name, axes
// with ticks, and a vertical marker at each resume step.
std::string RenderLossSvg(const std::vector<LossCurve>& curves, const PlotOptions& options);

}  // namespace uckpt::cli
