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

std::string RenderLossSvg(const std::vector<LossCurve>& curves, const PlotOptions& options) {
  const double left = 70, right = 20, top = options.title.empty() ? 20 : 40, bottom = 50;
  const double w = options.width, h = options.height;
  const double plot_w = w - left - right, plot_h = h - top - bottom;

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
  auto X = [&](double x) { return left + (x - x0) / (x1 - x0) * plot_w; };
  auto Y = [&](double y) { return top + (y1 - y) / (y1 - y0) * plot_h; };

  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << w << "\" height=\"" << h << "\" viewBox=\"0 0 " << w
      << " " << h << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect x=\"0\" y=\"0\" width=\"" << w << "\" height=\"" << h << "\" fill=\"white\"/>\n";
  if (!options.title.empty()) {
    svg << "<text x=\"" << Num(w / 2) << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">"
        << XmlEscape(options.title) << "</text>\n";
  }

  // Grid and ticks.
  svg << "<g class=\"axes\" stroke=\"#dddddd\" stroke-width=\"1\">\n";
  double ys = NiceStep(y1 - y0, 6);
  for (double v = std::ceil(y0 / ys) * ys; v <= y1 + 1e-12; v += ys) {
    svg << "<line x1=\"" << Num(left) << "\" y1=\"" << Num(Y(v)) << "\" x2=\"" << Num(left + plot_w) << "\" y2=\""
        << Num(Y(v)) << "\"/>\n";
    svg << "<text x=\"" << Num(left - 6) << "\" y=\"" << Num(Y(v) + 4)
        << "\" text-anchor=\"end\" stroke=\"none\" fill=\"#333333\">" << TickLabel(v, ys) << "</text>\n";
  }
  double xs = std::max(1.0, NiceStep(x1 - x0, 8));
  for (double v = std::ceil(x0 / xs) * xs; v <= x1 + 1e-12; v += xs) {
    svg << "<line x1=\"" << Num(X(v)) << "\" y1=\"" << Num(top) << "\" x2=\"" << Num(X(v)) << "\" y2=\""
        << Num(top + plot_h) << "\"/>\n";
    svg << "<text x=\"" << Num(X(v)) << "\" y=\"" << Num(top + plot_h + 16)
        << "\" text-anchor=\"middle\" stroke=\"none\" fill=\"#333333\">" << TickLabel(v, xs) << "</text>\n";
  }
  svg << "</g>\n"
      << "<rect x=\"" << Num(left) << "\" y=\"" << Num(top) << "\" width=\"" << Num(plot_w) << "\" height=\""
      << Num(plot_h) << "\" fill=\"none\" stroke=\"#333333\"/>\n"
      << "<text x=\"" << Num(left + plot_w / 2) << "\" y=\"" << Num(h - 12) << "\" text-anchor=\"middle\">step</text>\n"
      << "<text x=\"16\" y=\"" << Num(top + plot_h / 2) << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 "
      << Num(top + plot_h / 2) << ")\">loss</text>\n";

  // Resume markers: a dashed vertical line after step K.
  for (int64_t s : options.resume_steps) {
    svg << "<g class=\"resume\" data-step=\"" << s << "\">"
        << "<line x1=\"" << Num(X(s)) << "\" y1=\"" << Num(top) << "\" x2=\"" << Num(X(s)) << "\" y2=\""
        << Num(top + plot_h) << "\" stroke=\"#888888\" stroke-dasharray=\"5,4\"/>"
        << "<text x=\"" << Num(X(s) + 4) << "\" y=\"" << Num(top + 14) << "\" fill=\"#555555\">resume @" << s
        << "</text></g>\n";
  }

  // Curves, drawn so that later (resumed) runs stay visible over the baseline:
  // each is wider than the next.
  const size_t n = curves.size();
  for (size_t i = 0; i < n; ++i) {
    const auto& c = curves[i];
    double width = 1.5 + 1.5 * static_cast<double>(n - 1 - i);
    svg << "<polyline class=\"curve\" data-run=\"" << XmlEscape(c.name) << "\" fill=\"none\" stroke=\""
        << kColours[i % 8] << "\" stroke-width=\"" << Num(width) << "\" stroke-opacity=\"0.85\" points=\"";
    bool first = true;
    for (const auto& p : c.points) {
      double y = std::isfinite(p.loss) ? p.loss : (p.loss > 0 ? y1 : y0);
      svg << (first ? "" : " ") << Num(X(p.step)) << "," << Num(Y(y));
      first = false;
    }
    svg << "\"/>\n";
    // A run that starts later than the others was resumed: mark its first point.
    if (!c.points.empty() && c.points.front().step > x0 && std::isfinite(c.points.front().loss)) {
      svg << "<circle class=\"resume-point\" cx=\"" << Num(X(c.points.front().step)) << "\" cy=\""
          << Num(Y(c.points.front().loss)) << "\" r=\"4\" fill=\"" << kColours[i % 8] << "\"/>\n";
    }
  }

  // Legend, top right.
  double lx = left + plot_w - 10, ly = top + 10;
  size_t longest = 0;
  for (const auto& c : curves) longest = std::max(longest, c.name.size());
  double box_w = 40 + 7.0 * longest;
  svg << "<g class=\"legend\"><rect x=\"" << Num(lx - box_w) << "\" y=\"" << Num(ly) << "\" width=\"" << Num(box_w)
      << "\" height=\"" << Num(8 + 18.0 * n) << "\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#bbbbbb\"/>\n";
  for (size_t i = 0; i < n; ++i) {
    double y = ly + 16 + 18.0 * i;
    svg << "<line x1=\"" << Num(lx - box_w + 8) << "\" y1=\"" << Num(y - 4) << "\" x2=\"" << Num(lx - box_w + 30)
        << "\" y2=\"" << Num(y - 4) << "\" stroke=\"" << kColours[i % 8] << "\" stroke-width=\"3\"/>"
        << "<text x=\"" << Num(lx - box_w + 36) << "\" y=\"" << Num(y) << "\">" << XmlEscape(curves[i].name)
        << "</text>\n";
  }
  svg << "</g>\n</svg>\n";
  return svg.str();
}

}  // namespace uckpt::cli
