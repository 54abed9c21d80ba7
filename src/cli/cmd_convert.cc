#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "ckpt/convert.h"
#include "ckpt/folder.h"
#include "cli/commands.h"
#include "cli/strict_flags.h"
#include "format/error.h"
#include "format/value_print.h"

namespace uckpt::cli {

namespace {

using Clock = std::chrono::steady_clock;

// Ctrl-C / SIGTERM / SIGHUP stop the conversion at the next parameter
// boundary; the converter then removes its temporary folder as on any error.
std::atomic<int> g_stop_signal{0};

void OnStopSignal(int sig) { g_stop_signal.store(sig); }

void CatchStopSignals() {
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
}

std::string Duration(double s) {
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%.0fs", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(s) / 3600, static_cast<int>(s) / 60 % 60);
  }
  return buf;
}

// A bar redrawn in place on a terminal; otherwise a plain line every few
// seconds (logs of batch jobs).
class ProgressReporter {
 public:
  explicit ProgressReporter(bool tty) : tty_(tty), start_(Clock::now()), last_(start_) {}

  void Update(const ckpt::ConvertProgress& p) {
    auto now = Clock::now();
    bool done = p.params_done == p.params_total;
    double since = std::chrono::duration<double>(now - last_).count();
    if (!done && since < (tty_ ? 0.1 : 5.0)) return;
    last_ = now;
    double elapsed = std::chrono::duration<double>(now - start_).count();
    double rate = elapsed > 0 ? p.bytes_done / elapsed : 0;
    double eta = rate > 0 ? (p.bytes_total - p.bytes_done) / rate : 0;
    double frac = p.bytes_total ? static_cast<double>(p.bytes_done) / p.bytes_total : 1.0;
    char line[256];
    if (tty_) {
      const int width = 30;
      int fill = static_cast<int>(frac * width);
      std::string bar(fill, '#');
      bar.resize(width, '.');
      std::snprintf(line, sizeof line, "\r[%s] %3.0f%% %s/%s  %zu/%zu params  %s/s  ETA %s   ", bar.c_str(), frac * 100,
                    HumanBytes(p.bytes_done).c_str(), HumanBytes(p.bytes_total).c_str(), p.params_done, p.params_total,
                    HumanBytes(static_cast<uint64_t>(rate)).c_str(), Duration(eta).c_str());
      std::cerr << line << (done ? "\n" : "") << std::flush;
    } else {
      std::snprintf(line, sizeof line, "convert: %3.0f%% %s of %s, %zu of %zu params, %s/s, ETA %s", frac * 100,
                    HumanBytes(p.bytes_done).c_str(), HumanBytes(p.bytes_total).c_str(), p.params_done, p.params_total,
                    HumanBytes(static_cast<uint64_t>(rate)).c_str(), Duration(eta).c_str());
      std::cerr << line << "\n" << std::flush;
    }
  }

 private:
  bool tty_;
  Clock::time_point start_, last_;
};

// What `uckpt convert` parses.
struct ConvertArgs {
  std::string input, output, input_flag, output_flag;
  int threads = 0;
  bool force = false, quiet = false, no_sync = false, verify = false, no_manifest = false;
};

void AddConvertFlags(CLI::App* cmd, ConvertArgs& args) {
  cmd->add_option("INPUT", args.input,
                  "The ZeRO checkpoint's tag folder (e.g. ckpt/global_step100), or the folder whose `latest` names it");
  cmd->add_option("OUTPUT", args.output, "The universal checkpoint folder to create");
  cmd->add_option("--input_folder,--input-folder", args.input_flag, "Same as INPUT (ds_to_universal.py's spelling)");
  cmd->add_option("--output_folder,--output-folder", args.output_flag,
                  "Same as OUTPUT (ds_to_universal.py's spelling)");
  cmd->add_option("-j,--threads", args.threads, "Worker threads (default: one per core)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--force", args.force, "Replace an existing output folder (only once the new one is complete)");
  cmd->add_flag("-q,--quiet", args.quiet, "No progress output");
  AddStrictFlags(cmd, true);
  cmd->add_flag("--no-sync", args.no_sync, "Do not sync the output to disk before renaming it into place");
  cmd->add_flag("--verify", args.verify,
                "If the input has a manifest (uckpt-manifest.json), compare every file's hash with it, not only its "
                "size");
  // Hidden: only bench/manifest.sh uses it, to measure what the manifest costs.
  cmd->add_flag("--no-manifest", args.no_manifest, "Write no uckpt-manifest.json")->group("");
}

// INPUT and OUTPUT, each given once: as an argument or as ds_to_universal.py's flag.
std::pair<std::string, std::string> InputAndOutput(const ConvertArgs& args) {
  std::string input = !args.input_flag.empty() ? args.input_flag : args.input;
  std::string output = !args.output_flag.empty() ? args.output_flag : args.output;
  if (!args.input_flag.empty() && !args.input.empty() && args.input != args.input_flag)
    throw CLI::ValidationError("give the input folder once (INPUT or --input_folder)");
  if (!args.output_flag.empty() && !args.output.empty() && args.output != args.output_flag)
    throw CLI::ValidationError("give the output folder once (OUTPUT or --output_folder)");
  if (input.empty() || output.empty()) throw CLI::ValidationError("convert needs an input and an output folder");
  return {input, output};
}

// What was written, how fast and at what peak memory.
void PrintConvertSummary(const std::string& output, const ckpt::ConvertStats& stats, double secs) {
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  char line[512];
  std::snprintf(line, sizeof line,
                "convert: wrote %s: %zu parameters, %zu files, read %s (%llu bytes), wrote %s (%llu bytes) in "
                "%.2fs, peak RSS %s\n",
                output.c_str(), stats.params, stats.files, HumanBytes(stats.bytes_read).c_str(),
                static_cast<unsigned long long>(stats.bytes_read), HumanBytes(stats.bytes_written).c_str(),
                static_cast<unsigned long long>(stats.bytes_written), secs,
                HumanBytes(static_cast<uint64_t>(ru.ru_maxrss) * 1024).c_str());
  std::cerr << line;
}

}  // namespace

Runner AddConvert(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "convert",
      "Convert a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3) into a universal checkpoint, as DeepSpeed's\n"
      "ds_to_universal.py does: same files, same keys, bit-identical tensors, but each byte is copied once,\n"
      "with no temporary fragment files. latest_universal is written beside the output folder.\n\n"
      "Examples:\n"
      "  uckpt convert ckpt/global_step100 ckpt/global_step100_universal\n"
      "  uckpt convert --input_folder ckpt/global_step100 --output_folder ckpt/global_step100_universal -j 8");
  auto args = std::make_shared<ConvertArgs>();
  AddConvertFlags(cmd, *args);
  return [args] {
    std::string input, output;
    std::tie(input, output) = InputAndOutput(*args);
    ckpt::ConvertOptions options;
    options.threads = args->threads;
    options.force = args->force;
    options.durable = !args->no_sync;
    options.write_manifest = !args->no_manifest;
    options.notice = [](const std::string& line) { std::cerr << "convert: " << line << "\n"; };
    auto start = Clock::now();
    // A checkpoint root (ckpt/) means the tag its `latest` names, checked by
    // the one tag resolver (a tag must be a plain folder name inside it).
    if (auto tag = ckpt::ResolveTagFolder(input); tag && *tag != ckpt::StripTrailingSlashes(input)) {
      if (!args->quiet) std::cerr << "convert: " << input << ": latest names " << *tag << "\n";
      input = *tag;
    }
    ckpt::ZeroCheckpoint zc = ckpt::OpenZeroCheckpoint(input, args->verify);
    for (const auto& w : zc.warnings) std::cerr << "convert: warning: " << w << "\n";
    std::mutex mu;
    ProgressReporter reporter(::isatty(2));
    CatchStopSignals();
    options.progress = [](const ckpt::ConvertProgress&) {
      if (int sig = g_stop_signal.load())
        throw IoError("interrupted by signal " + std::to_string(sig) + " (" + strsignal(sig) +
                      "); the partial output was removed");
    };
    if (!args->quiet) {
      std::cerr << "convert: " << input << ": ZeRO-" << zc.stage << (zc.bf16_optimizer ? " (BF16_Optimizer)" : "")
                << ", data-parallel size " << zc.dp << ", " << zc.params.size() << " parameters, "
                << HumanBytes(zc.total_bytes()) << " of state\n";
      options.progress = [&, check_signal = options.progress](const ckpt::ConvertProgress& p) {
        check_signal(p);
        std::lock_guard<std::mutex> lock(mu);
        reporter.Update(p);
      };
    }
    ckpt::ConvertStats stats = ckpt::ConvertToUniversal(zc, output, options);
    double secs = std::chrono::duration<double>(Clock::now() - start).count();
    if (!args->quiet) PrintConvertSummary(output, stats, secs);
    return 0;
  };
}

}  // namespace uckpt::cli
