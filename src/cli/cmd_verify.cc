#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "ckpt/fingerprint.h"
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

// `--state`: a folder's state fingerprint computed from its files, and
// whether the manifest's record agrees.
struct FolderState {
  bool computed = false;
  ckpt::StateFingerprint state;
  std::string record;  // "matches the manifest's record", "no record in the manifest", ...
};

FolderState ComputeState(ckpt::FolderVerdict& f, int threads, std::vector<std::string>& notes) {
  FolderState s;
  if (!f.problems.empty() || (f.kind != ckpt::FolderKind::kZero && f.kind != ckpt::FolderKind::kUniversal)) return s;
  try {
    s.state = ckpt::FingerprintFolder(f.folder, threads);
  } catch (const std::exception& e) {
    notes.push_back(f.folder + ": state fingerprint not computed: " + e.what());
    return s;
  }
  s.computed = true;
  s.record = "no record in the folder (not saved by uckpt, or before records existed)";
  if (!f.manifest) return s;
  std::optional<ckpt::StateFingerprint> recorded;
  try {
    recorded = ckpt::ReadManifest(f.folder).state;
  } catch (const std::exception& e) {
    f.problems.push_back({f.folder + "/" + ckpt::kManifestName, e.what()});
    return s;
  }
  if (!recorded) return s;
  if (auto diff = ckpt::FirstFingerprintDifference(*recorded, s.state, {}, "in the files")) {
    s.record = "differs from the manifest's record";
    // The files as they are ("after the load") against what the saver recorded.
    f.problems.push_back({f.folder + "/" + ckpt::kManifestName,
                          "the state fingerprint of the files differs from the one recorded: " + *diff});
  } else {
    s.record = "matches the manifest's record";
  }
  return s;
}

std::string CountersText(const ckpt::FingerprintCounters& c) {
  std::string s;
  auto add = [&](const char* k, const std::string& v) { s += std::string(s.empty() ? "" : ", ") + k + " " + v; };
  auto num = [](double v) {
    char b[64];
    std::snprintf(b, sizeof b, "%.17g", v);
    return std::string(b);
  };
  if (c.global_steps) add("global_steps", std::to_string(*c.global_steps));
  if (c.skipped_steps) add("skipped_steps", std::to_string(*c.skipped_steps));
  if (c.global_samples) add("global_samples", std::to_string(*c.global_samples));
  if (c.optimizer_step) add("optimizer_step", num(*c.optimizer_step));
  if (c.loss_scale) add("loss_scale", num(*c.loss_scale));
  return s;
}

nlohmann::json ReportJson(const ckpt::VerifyReport& r, const std::vector<FolderState>& states) {
  auto problems = [](const std::vector<ckpt::ManifestProblem>& ps) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& p : ps) a.push_back({{"file", p.file}, {"problem", p.what}});
    return a;
  };
  nlohmann::json folders = nlohmann::json::array();
  for (size_t i = 0; i < r.folders.size(); ++i) {
    const auto& f = r.folders[i];
    folders.push_back({{"folder", f.folder},
                       {"kind", ckpt::FolderKindName(f.kind)},
                       {"manifest", f.manifest},
                       {"files", f.files},
                       {"bytes", f.bytes},
                       {"ok", f.problems.empty()},
                       {"problems", problems(f.problems)}});
    if (i < states.size() && states[i].computed) {
      folders.back()["state_fingerprint"] = ckpt::FingerprintToJson(states[i].state);
      folders.back()["state_fingerprint_record"] = states[i].record;
    }
  }
  return {{"path", r.path},
          {"ok", r.ok()},
          {"contents_checked", r.hashes},
          {"problem_count", r.problem_count()},
          {"folders", folders},
          {"problems", problems(r.problems)},
          {"notes", r.notes}};
}

// What `uckpt verify` parses.
struct VerifyArgs {
  std::string dir;
  bool sizes_only = false, json = false, quiet = false, state = false, verbose = false;
  int threads = 0;
};

// The verification, with a progress line on a terminal unless told to be quiet.
ckpt::VerifyReport VerifyWithProgress(const VerifyArgs& args) {
  ckpt::VerifyProgress progress;
  ckpt::VerifyOptions options;
  options.hashes = !args.sizes_only;
  options.threads = args.threads;
  options.progress = &progress;
  std::unique_ptr<ProgressLine> line;
  if (!args.quiet && !args.json && ::isatty(2)) line = std::make_unique<ProgressLine>(progress);
  return ckpt::VerifyCheckpoint(args.dir, options);
}

// One line per problem: "FILE: what is wrong".
void PrintProblems(const ckpt::VerifyReport& r) {
  for (const auto& p : r.problems) std::cout << p.file << ": " << p.what << "\n";
  for (const auto& f : r.folders)
    for (const auto& p : f.problems) std::cout << p.file << ": " << p.what << "\n";
}

// Each folder's state fingerprint and how it compares with the record; with
// `verbose`, every parameter's.
void PrintStates(const ckpt::VerifyReport& r, const std::vector<FolderState>& states, bool verbose) {
  for (size_t i = 0; i < states.size(); ++i) {
    if (!states[i].computed) continue;
    const ckpt::StateFingerprint& s = states[i].state;
    std::cout << r.folders[i].folder << ": state fingerprint " << ckpt::HashToHex(s.total()) << " (" << s.params.size()
              << " parameters, " << s.tensors() << " tensors; " << CountersText(s.counters) << "); " << states[i].record
              << "\n";
    if (!verbose) continue;
    for (const auto& p : s.params) {
      std::cout << "  " << p.name << " (" << p.numel << ")";
      for (const auto& [k, v] : p.states) std::cout << " " << k << "=" << ckpt::HashToHex(v);
      std::cout << "\n";
    }
  }
}

void PrintSummary(const ckpt::VerifyReport& r, double secs) {
  size_t files = 0, with_manifest = 0;
  uint64_t bytes = 0;
  for (const auto& f : r.folders) {
    files += f.files;
    bytes += f.bytes;
    with_manifest += f.manifest;
  }
  char line[512];
  std::snprintf(line, sizeof line,
                "verify: %s: %s: %zu problem(s) in %zu folder(s) (%zu with a manifest), %zu files, %s, %s, %.2fs\n",
                r.path.c_str(), r.ok() ? "OK" : "FAILED", r.problem_count(), r.folders.size(), with_manifest, files,
                HumanBytes(bytes).c_str(), r.hashes ? "contents read" : "sizes only", secs);
  std::cout << line;
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
      "  uckpt verify --state ckpt/global_step100  also the state fingerprint: the same for a ZeRO folder\n"
      "                                            and its universal conversion (-v: per parameter)\n"
      "Loading checks too: resume, convert and export compare sizes with the manifest always, hashes\n"
      "with --verify.");
  auto args = std::make_shared<VerifyArgs>();
  cmd->add_option("DIR", args->dir, "Tag folder, universal folder, or checkpoint root")->required();
  cmd->add_flag("--sizes-only,--sizes_only", args->sizes_only,
                "Compare sizes and structure only; do not read whole files (much faster, misses flipped bytes)");
  cmd->add_flag("--json", args->json, "Print the report as JSON on stdout");
  cmd->add_flag("--state", args->state,
                "Also compute each folder's state fingerprint from its files (fp32 masters, optimizer states, "
                "counters; docs/manifest-format.md) and compare it with the manifest's record");
  cmd->add_flag("-v,--verbose", args->verbose, "With --state: print every parameter's fingerprints");
  cmd->add_flag("-q,--quiet", args->quiet, "Print only problems (no summary, no progress)");
  cmd->add_option("-j,--threads", args->threads, "Hashing threads (default: up to 4)")->check(CLI::NonNegativeNumber);
  return [args] {
    auto start = std::chrono::steady_clock::now();
    ckpt::VerifyReport r = VerifyWithProgress(*args);
    std::vector<FolderState> states;
    if (args->state)
      for (auto& f : r.folders) states.push_back(ComputeState(f, args->threads, r.notes));
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (args->json) {
      // Paths need not be UTF-8; replace what is not, as inspect does.
      std::cout << ReportJson(r, states).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
      return r.ok() ? 0 : 1;
    }
    PrintProblems(r);
    if (args->quiet) return r.ok() ? 0 : 1;
    PrintStates(r, states, args->verbose);
    for (const auto& n : r.notes) std::cerr << "verify: note: " << n << "\n";
    PrintSummary(r, secs);
    return r.ok() ? 0 : 1;
  };
}

}  // namespace uckpt::cli
