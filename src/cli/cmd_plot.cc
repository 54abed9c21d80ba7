#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>

#include "cli/commands.h"
#include "cli/plot.h"
#include "format/error.h"
#include "format/file.h"

namespace uckpt::cli {

namespace {

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void WriteFile(const std::string& path, const std::string& text) {
  AtomicFile out(path, /*durable=*/false);
  out.Write(text);
  out.Commit();
}

// PNG through librsvg's converter (Debian: librsvg2-bin); no raster code here.
void SvgToPng(const std::string& svg_path, const std::string& png_path) {
  pid_t pid = fork();
  if (pid < 0) throw IoError("fork failed for rsvg-convert");
  if (pid == 0) {
    execlp("rsvg-convert", "rsvg-convert", "--format", "png", "--output", png_path.c_str(), svg_path.c_str(),
           static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) == 127) {
    throw IoError(png_path +
                  ": PNG output needs rsvg-convert (Debian package librsvg2-bin; scripts/install-deps.sh); "
                  "write .svg instead");
  }
  if (WEXITSTATUS(status) != 0) throw IoError(png_path + ": rsvg-convert failed on " + svg_path);
}

}  // namespace

Runner AddPlot(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "plot",
      "Overlay the loss curves (by step) of training runs, read from each RUN_DIR/metrics.csv, with a\n"
      "legend by run name and a dashed marker at each resume step. SVG is drawn directly; PNG goes\n"
      "through rsvg-convert (librsvg2-bin).\n\n"
      "Examples:\n"
      "  uckpt plot logs/baseline logs/resume_zero logs/resume_universal -o resume.svg --resume-step 100\n"
      "  uckpt plot logs/ga_* -o ga.png --title \"gradient accumulation\"");
  struct Args {
    std::vector<std::string> runs;
    std::string output;
    std::string title;
    std::vector<int64_t> resume_steps;
    int width = 800, height = 480;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("RUN_DIR", args->runs, "Run folders (each with metrics.csv), legend in this order")->required();
  cmd->add_option("-o,--output", args->output, "Output file, .svg or .png")->required();
  cmd->add_option("--resume-step,--resume_step", args->resume_steps, "Mark a resume after this step (repeatable)")
      ->take_all();
  cmd->add_option("--title", args->title, "Title above the plot");
  cmd->add_option("--width", args->width, "Pixels")->check(CLI::Range(200, 8000));
  cmd->add_option("--height", args->height, "Pixels")->check(CLI::Range(150, 8000));
  return [args] {
    bool png = EndsWith(args->output, ".png");
    if (!png && !EndsWith(args->output, ".svg")) {
      throw std::invalid_argument(args->output + ": the output name must end in .svg or .png");
    }
    std::vector<LossCurve> curves;
    for (const auto& run : args->runs) curves.push_back(ReadLossCurve(run));
    std::string svg = RenderLossSvg(curves, {args->title, args->resume_steps, args->width, args->height});
    if (!png) {
      WriteFile(args->output, svg);
    } else {
      std::string tmp = args->output + ".tmp.svg";
      WriteFile(tmp, svg);
      try {
        SvgToPng(tmp, args->output);
      } catch (...) {
        std::filesystem::remove(tmp);
        throw;
      }
      std::filesystem::remove(tmp);
    }
    size_t points = 0;
    for (const auto& c : curves) points += c.points.size();
    std::cerr << "plot: " << curves.size() << " runs, " << points << " points -> " << args->output << "\n";
    return 0;
  };
}

}  // namespace uckpt::cli
