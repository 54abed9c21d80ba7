#include "cli/plot.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "format/error.h"

namespace uckpt::cli {

namespace {

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

std::vector<std::string> SplitCommas(const std::string& line) {
  std::vector<std::string> fields;
  std::stringstream in(line);
  std::string field;
  while (std::getline(in, field, ',')) fields.push_back(field);
  return fields;
}

std::string XmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

// Tick spacing of 1, 2 or 5 times a power of ten giving about `target` ticks.
double NiceStep(double span, int target) {
  if (span <= 0) return 1;
  double raw = span / target;
  double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * p >= raw) return m * p;
  }
  return 10 * p;
}

std::string TickLabel(double v, double step) {
  int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// Colour-blind-safe palette (Okabe-Ito).
const char* kColours[] = {"#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#F0E442", "#000000"};

}  // namespace

LossCurve ReadLossCurve(const std::string& run_dir) {
  std::string path = (std::filesystem::path(run_dir) / "metrics.csv").string();
  std::ifstream in(path);
  if (!in) throw IoError(path + ": cannot open (is " + run_dir + " a run folder of uckpt train?)");
  std::string line;
  if (!std::getline(in, line) || Trim(line).rfind("step,loss", 0) != 0) {
    throw FormatError(path + ": line 1: expected a header starting with `step,loss`");
  }
  std::map<int64_t, double> by_step;
  int line_no = 1;
  while (std::getline(in, line)) {
    ++line_no;
    line = Trim(line);
    if (line.empty()) continue;
    auto fields = SplitCommas(line);
    auto bad = [&](const std::string& why) {
      return FormatError(path + ": line " + std::to_string(line_no) + ": " + why + ": `" + line + "`");
    };
    if (fields.size() < 2) throw bad("expected step,loss,...");
    char* end = nullptr;
    errno = 0;
    long long step = std::strtoll(fields[0].c_str(), &end, 10);
    if (fields[0].empty() || *end != '\0' || errno != 0) throw bad("step is not an integer");
    errno = 0;
    double loss = std::strtod(fields[1].c_str(), &end);
    if (fields[1].empty() || *end != '\0' || errno != 0) throw bad("loss is not a number");
    by_step[step] = loss;
  }
  LossCurve curve;
  curve.name = std::filesystem::path(run_dir).lexically_normal().filename().string();
  if (curve.name.empty())
    curve.name = std::filesystem::path(run_dir).lexically_normal().parent_path().filename().string();
  for (auto [step, loss] : by_step) curve.points.push_back({step, loss});
  return curve;
}

namespace {

// Where the plot area lies in the picture and which steps and losses it spans.
struct PlotFrame {
  double w = 0, h = 0;                    // the picture
  double left = 70, top = 20;             // the plot area's corner
  double plot_w = 0, plot_h = 0;          // and its size
  double x0 = 0, x1 = 1, y0 = 0, y1 = 1;  // steps and losses at its edges
  double X(double x) const { return left + (x - x0) / (x1 - x0) * plot_w; }
  double Y(double y) const { return top + (y1 - y) / (y1 - y0) * plot_h; }
};

// The frame that holds every curve and resume step.
PlotFrame FrameFor(const std::vector<LossCurve>& curves, const PlotOptions& options) {
  PlotFrame f;
  const double right = 20, bottom = 50;
  f.top = options.title.empty() ? 20 : 40;
  f.w = options.width, f.h = options.height;
  f.plot_w = f.w - f.left - right, f.plot_h = f.h - f.top - bottom;

  // Data range (finite losses only; NaN/inf points break the line).
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& c : curves) {
    for (const auto& p : c.points) {
      x0 = std::min<double>(x0, p.step);
      x1 = std::max<double>(x1, p.step);
      if (std::isfinite(p.loss)) {
        y0 = std::min(y0, p.loss);
        y1 = std::max(y1, p.loss);
      }
    }
  }
  for (int64_t s : options.resume_steps) {
    x0 = std::min<double>(x0, s);
    x1 = std::max<double>(x1, s);
  }
  if (!std::isfinite(x0)) x0 = 0, x1 = 1;
  if (!std::isfinite(y0)) y0 = 0, y1 = 1;
  if (x1 == x0) x0 -= 1, x1 += 1;
  if (y1 == y0) y0 -= 0.5, y1 += 0.5;
  double pad = (y1 - y0) * 0.05;
  y0 -= pad, y1 += pad;
  f.x0 = x0, f.x1 = x1, f.y0 = y0, f.y1 = y1;
  return f;
}

// The picture's background, title, grid, tick labels and axis names.
void WriteAxes(std::ostream& out, const PlotFrame& f, const std::string& title) {
  out << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << f.w << "\" height=\"" << f.h << "\" viewBox=\"0 0 "
      << f.w << " " << f.h << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect x=\"0\" y=\"0\" width=\"" << f.w << "\" height=\"" << f.h << "\" fill=\"white\"/>\n";
  if (!title.empty()) {
    out << "<text x=\"" << Num(f.w / 2) << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">" << XmlEscape(title)
        << "</text>\n";
  }

  // Grid and ticks.
  out << "<g class=\"axes\" stroke=\"#dddddd\" stroke-width=\"1\">\n";
  double ys = NiceStep(f.y1 - f.y0, 6);
  for (double v = std::ceil(f.y0 / ys) * ys; v <= f.y1 + 1e-12; v += ys) {
    out << "<line x1=\"" << Num(f.left) << "\" y1=\"" << Num(f.Y(v)) << "\" x2=\"" << Num(f.left + f.plot_w)
        << "\" y2=\"" << Num(f.Y(v)) << "\"/>\n";
    out << "<text x=\"" << Num(f.left - 6) << "\" y=\"" << Num(f.Y(v) + 4)
        << "\" text-anchor=\"end\" stroke=\"none\" fill=\"#333333\">" << TickLabel(v, ys) << "</text>\n";
  }
  double xs = std::max(1.0, NiceStep(f.x1 - f.x0, 8));
  for (double v = std::ceil(f.x0 / xs) * xs; v <= f.x1 + 1e-12; v += xs) {
    out << "<line x1=\"" << Num(f.X(v)) << "\" y1=\"" << Num(f.top) << "\" x2=\"" << Num(f.X(v)) << "\" y2=\""
        << Num(f.top + f.plot_h) << "\"/>\n";
    out << "<text x=\"" << Num(f.X(v)) << "\" y=\"" << Num(f.top + f.plot_h + 16)
        << "\" text-anchor=\"middle\" stroke=\"none\" fill=\"#333333\">" << TickLabel(v, xs) << "</text>\n";
  }
  out << "</g>\n"
      << "<rect x=\"" << Num(f.left) << "\" y=\"" << Num(f.top) << "\" width=\"" << Num(f.plot_w) << "\" height=\""
      << Num(f.plot_h) << "\" fill=\"none\" stroke=\"#333333\"/>\n"
      << "<text x=\"" << Num(f.left + f.plot_w / 2) << "\" y=\"" << Num(f.h - 12)
      << "\" text-anchor=\"middle\">step</text>\n"
      << "<text x=\"16\" y=\"" << Num(f.top + f.plot_h / 2) << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 "
      << Num(f.top + f.plot_h / 2) << ")\">loss</text>\n";
}

// Resume markers: a dashed vertical line after step K.
void WriteResumeMarkers(std::ostream& out, const PlotFrame& f, const std::vector<int64_t>& resume_steps) {
  for (int64_t s : resume_steps) {
    out << "<g class=\"resume\" data-step=\"" << s << "\">"
        << "<line x1=\"" << Num(f.X(s)) << "\" y1=\"" << Num(f.top) << "\" x2=\"" << Num(f.X(s)) << "\" y2=\""
        << Num(f.top + f.plot_h) << "\" stroke=\"#888888\" stroke-dasharray=\"5,4\"/>"
        << "<text x=\"" << Num(f.X(s) + 4) << "\" y=\"" << Num(f.top + 14) << "\" fill=\"#555555\">resume @" << s
        << "</text></g>\n";
  }
}

// Curves, drawn so that later (resumed) runs stay visible over the baseline:
// each is wider than the next.
void WriteCurves(std::ostream& out, const PlotFrame& f, const std::vector<LossCurve>& curves) {
  const size_t n = curves.size();
  for (size_t i = 0; i < n; ++i) {
    const auto& c = curves[i];
    double width = 1.5 + 1.5 * static_cast<double>(n - 1 - i);
    out << "<polyline class=\"curve\" data-run=\"" << XmlEscape(c.name) << "\" fill=\"none\" stroke=\""
        << kColours[i % 8] << "\" stroke-width=\"" << Num(width) << "\" stroke-opacity=\"0.85\" points=\"";
    bool first = true;
    for (const auto& p : c.points) {
      double y = std::isfinite(p.loss) ? p.loss : (p.loss > 0 ? f.y1 : f.y0);
      out << (first ? "" : " ") << Num(f.X(p.step)) << "," << Num(f.Y(y));
      first = false;
    }
    out << "\"/>\n";
    // A run that starts later than the others was resumed: mark its first point.
    if (!c.points.empty() && c.points.front().step > f.x0 && std::isfinite(c.points.front().loss)) {
      out << "<circle class=\"resume-point\" cx=\"" << Num(f.X(c.points.front().step)) << "\" cy=\""
          << Num(f.Y(c.points.front().loss)) << "\" r=\"4\" fill=\"" << kColours[i % 8] << "\"/>\n";
    }
  }
}

// The legend, top right.
void WriteLegend(std::ostream& out, const PlotFrame& f, const std::vector<LossCurve>& curves) {
  const size_t n = curves.size();
  double lx = f.left + f.plot_w - 10, ly = f.top + 10;
  size_t longest = 0;
  for (const auto& c : curves) longest = std::max(longest, c.name.size());
  double box_w = 40 + 7.0 * longest;
  out << "<g class=\"legend\"><rect x=\"" << Num(lx - box_w) << "\" y=\"" << Num(ly) << "\" width=\"" << Num(box_w)
      << "\" height=\"" << Num(8 + 18.0 * n) << "\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#bbbbbb\"/>\n";
  for (size_t i = 0; i < n; ++i) {
    double y = ly + 16 + 18.0 * i;
    out << "<line x1=\"" << Num(lx - box_w + 8) << "\" y1=\"" << Num(y - 4) << "\" x2=\"" << Num(lx - box_w + 30)
        << "\" y2=\"" << Num(y - 4) << "\" stroke=\"" << kColours[i % 8] << "\" stroke-width=\"3\"/>"
        << "<text x=\"" << Num(lx - box_w + 36) << "\" y=\"" << Num(y) << "\">" << XmlEscape(curves[i].name)
        << "</text>\n";
  }
}

}  // namespace

std::string RenderLossSvg(const std::vector<LossCurve>& curves, const PlotOptions& options) {
  const PlotFrame frame = FrameFor(curves, options);
  std::ostringstream svg;
  WriteAxes(svg, frame, options.title);
  WriteResumeMarkers(svg, frame, options.resume_steps);
  WriteCurves(svg, frame, curves);
  WriteLegend(svg, frame, curves);
  svg << "</g>\n</svg>\n";
  return svg.str();
}

}  // namespace uckpt::cli
