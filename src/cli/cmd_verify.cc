#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "ckpt/verify.h"
#include "cli/commands.h"
#include "format/value_print.h"

namespace uckpt::cli {

namespace {

// Redraws "verify: 2/5 folders, 1.2 GiB of 3.4 GiB" on stderr every 0.1 s
// while alive (a terminal only).
class ProgressLine {
 public:
  explicit ProgressLine(ckpt::VerifyProgress& p) : p_(p), thread_([this] { Loop(); }) {}
  ~ProgressLine() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
    std::cerr << "\r\033[K" << std::flush;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; })) {
      std::cerr << "\rverify: " << p_.folders_done.load() << "/" << p_.folders_total.load() << " folders, "
                << HumanBytes(p_.bytes_done.load()) << " of " << HumanBytes(p_.bytes_total.load()) << " read\033[K"
                << std::flush;
    }
  }
  ckpt::VerifyProgress& p_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

nlohmann::json ReportJson(const ckpt::VerifyReport& r) {
  auto problems = [](const std::vector<ckpt::ManifestProblem>& ps) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& p : ps) a.push_back({{"file", p.file}, {"problem", p.what}});
    return a;
  };
  nlohmann::json folders = nlohmann::json::array();
  for (const auto& f : r.folders)
    folders.push_back({{"folder", f.folder},
                       {"kind", ckpt::FolderKindName(f.kind)},
                       {"manifest", f.manifest},
                       {"files", f.files},
                       {"bytes", f.bytes},
                       {"ok", f.problems.empty()},
                       {"problems", problems(f.problems)}});
  return {{"path", r.path},  {"ok", r.ok()},       {"contents_checked", r.hashes}, {"problem_count", r.problem_count()},
          {"folders", folders}, {"problems", problems(r.problems)}, {"notes", r.notes}};
}

}  // namespace

Runner AddVerify(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "verify",
      "Check that a checkpoint is intact before you rely on it.\n\n"
      "A folder written by uckpt has a manifest (uckpt-manifest.json) listing each file's size and XXH64\n"
      "hash: every listed file must be there with that size and hash, and no other file may be there.\n"
      "Every folder, with or without a manifest (DeepSpeed's own folders have none), is also checked for\n"
      "structure: each model/optimizer states file parses (its zip records' CRC-32s are checked when no\n"
      "manifest hash covered it), no rank file is missing or extra, and every tensor has the number of\n"
      "elements the parameter needs. Nothing is modified.\n\n"
      "DIR is a ZeRO tag folder (ckpt/global_step100), a universal folder (ckpt/global_step100_universal),\n"
      "or a checkpoint root (ckpt/): then every checkpoint folder in it is verified, and `latest` /\n"
      "`latest_universal` must name one of them.\n\n"
      "Prints one line per problem, \"FILE: what is wrong\", then a summary line.\n"
      "Exit status: 0 intact, 1 problems found, 2 DIR is not a checkpoint or the command line is wrong.\n\n"
      "Examples:\n"
      "  uckpt verify ckpt/global_step100          one tag folder, every byte read\n"
      "  uckpt verify ckpt                         every checkpoint under ckpt/, and latest\n"
      "  uckpt verify --sizes-only ckpt            quick: sizes and structure, file contents not read\n"
      "  uckpt verify --json ckpt > report.json    machine-readable report\n"
      "Loading checks too: resume, convert and export compare sizes with the manifest always, hashes\n"
      "with --verify.");
  struct Args {
    std::string dir;
    bool sizes_only = false, json = false, quiet = false;
    int threads = 0;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("DIR", args->dir, "Tag folder, universal folder, or checkpoint root")->required();
  cmd->add_flag("--sizes-only,--sizes_only", args->sizes_only,
                "Compare sizes and structure only; do not read whole files (much faster, misses flipped bytes)");
  cmd->add_flag("--json", args->json, "Print the report as JSON on stdout");
  cmd->add_flag("-q,--quiet", args->quiet, "Print only problems (no summary, no progress)");
  cmd->add_option("-j,--threads", args->threads, "Hashing threads (default: up to 4)")->check(CLI::NonNegativeNumber);
  return [args] {
    ckpt::VerifyProgress progress;
    ckpt::VerifyOptions options;
    options.hashes = !args->sizes_only;
    options.threads = args->threads;
    options.progress = &progress;
    auto start = std::chrono::steady_clock::now();
    ckpt::VerifyReport r;
    {
      std::unique_ptr<ProgressLine> line;
      if (!args->quiet && !args->json && ::isatty(2)) line = std::make_unique<ProgressLine>(progress);
      r = ckpt::VerifyCheckpoint(args->dir, options);
    }
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (args->json) {
      // Paths need not be UTF-8; replace what is not, as inspect does.
      std::cout << ReportJson(r).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
      return r.ok() ? 0 : 1;
    }
    for (const auto& p : r.problems) std::cout << p.file << ": " << p.what << "\n";
    for (const auto& f : r.folders)
      for (const auto& p : f.problems) std::cout << p.file << ": " << p.what << "\n";
    if (args->quiet) return r.ok() ? 0 : 1;
    for (const auto& n : r.notes) std::cerr << "verify: note: " << n << "\n";
    size_t files = 0, with_manifest = 0;
    uint64_t bytes = 0;
    for (const auto& f : r.folders) {
      files += f.files;
      bytes += f.bytes;
      with_manifest += f.manifest;
    }
    char line[512];
    std::snprintf(line, sizeof line, "verify: %s: %s: %zu problem(s) in %zu folder(s) (%zu with a manifest), %zu files, %s, %s, %.2fs\n",
                  r.path.c_str(), r.ok() ? "OK" : "FAILED", r.problem_count(), r.folders.size(), with_manifest, files,
                  HumanBytes(bytes).c_str(), r.hashes ? "contents read" : "sizes only", secs);
    std::cout << line;
    return r.ok() ? 0 : 1;
  };
}

}  // namespace uckpt::cli
