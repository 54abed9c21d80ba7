// The corrupt-input matrix: every reader over corrupted copies of every
// fixture. Each case runs in a forked child under a timeout (alarm), so a
// crash, a sanitizer report or a hang is counted instead of ending the run.
//
// Fixtures: every torch.save file of shared/fixtures/torch; every ZeRO tag
// folder and universal folder of shared/fixtures/deepspeed and refrun-gpt2.
// Corruptions per fixture: truncations (one file cut at an offset), byte flips
// (one byte xor-ed), and for folders a missing file and a swapped pair of files.
// Each folder case runs twice: on a copy without a manifest (like DeepSpeed's
// own folders) and on a copy that got a manifest before it was corrupted.
//
// What runs (in process, no libtorch; the same library calls as the CLI):
//   torch file: strict load (what training does), lenient load + JSON + tree (`inspect FILE`)
//   ZeRO folder: open/validate/plan, convert to a temporary folder, export, `inspect DIR`, `verify`
//   universal:   open + every group's partition at two world sizes (what a resume reads),
//                export, `inspect DIR`, `verify`
// With a manifest the loads run with hash checks (--verify).
//
// Fails (exit 1) on: a crash or sanitizer report, a hang, an exception other
// than FormatError/IoError, an error message that names no file, output left
// behind by a failed convert/export, a corrupted copy with a manifest accepted
// by a verifying reader, or a truncated copy with a manifest accepted at all.
//
// Usage: corrupt_matrix_test SHARED_DIR. Sample sizes: 6 truncations and 12
// flips per fixture by default; UCKPT_CORRUPT_FULL=1 runs the full
// matrix (50 truncations, 200 flips); UCKPT_CORRUPT_TRUNCATIONS / _FLIPS set
// them; UCKPT_CORRUPT_TIMEOUT the per-case seconds (default 60); UCKPT_CORRUPT_JOBS
// runs fixtures in that many processes; UCKPT_CORRUPT_ONLY=TEXT only fixtures
// whose name contains TEXT; UCKPT_CORRUPT_VERBOSE=1 prints every case.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ckpt/convert.h"
#include "ckpt/export.h"
#include "ckpt/inspect.h"
#include "ckpt/manifest.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/verify.h"
#include "ckpt/zero_checkpoint.h"
#include "format/error.h"
#include "format/torch_file.h"
#include "format/value_json.h"
#include "format/value_print.h"

namespace {

using namespace uckpt;
using namespace uckpt::ckpt;
namespace fs = std::filesystem;

enum class FixtureKind { kTorchFile, kZero, kUniversal };

struct Fixture {
  std::string name;  // relative to shared/fixtures
  FixtureKind kind;
  fs::path source;
  fs::path plain, with_manifest;   // working copies (folders: both; torch files: plain only)
  std::vector<std::string> files;  // relative paths of the files that get corrupted
};

enum class Corruption { kTruncate, kFlip, kMissing, kSwap };
const char* Name(Corruption c) {
  switch (c) {
    case Corruption::kTruncate: return "truncate";
    case Corruption::kFlip: return "flip";
    case Corruption::kMissing: return "missing";
    case Corruption::kSwap: return "swap";
  }
  return "?";
}

struct Case {
  Corruption what;
  std::string file, other;  // other: the swap partner
  uint64_t offset = 0;
  uint8_t mask = 0;
  std::string Text() const {
    std::string t = std::string(Name(what)) + " " + file;
    if (what == Corruption::kTruncate) t += " at " + std::to_string(offset);
    if (what == Corruption::kFlip) t += " byte " + std::to_string(offset) + " ^ " + std::to_string(mask);
    if (what == Corruption::kSwap) t += " <-> " + other;
    return t;
  }
};

// One letter per operation, written by the child: A accepted, F FormatError,
// I IoError, X another exception, N an error that names no file, P a failed
// convert/export that left output behind, - not run.
struct Op {
  const char* name;
  char result = '-';
};

std::string g_root;  // every working path starts with it, so error messages can be checked for it

std::vector<uint8_t> ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void WriteAll(const fs::path& p, const std::vector<uint8_t>& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  if (!out) {
    std::cerr << "cannot write " << p << "\n";
    std::exit(2);
  }
}

template <typename F>
char Run(F&& f) {
  try {
    f();
    return 'A';
  } catch (const FormatError& e) {
    return std::string(e.what()).find(g_root) == std::string::npos ? 'N' : 'F';
  } catch (const IoError& e) {
    return std::string(e.what()).find(g_root) == std::string::npos ? 'N' : 'I';
  } catch (const std::exception& e) {
    std::cerr << "unexpected exception: " << e.what() << "\n";
    return 'X';
  }
}

void ReadPartitions(const std::string& folder, bool verify) {
  UniversalCheckpoint u = OpenUniversalCheckpoint(folder, verify);
  std::vector<std::string> keys = {"fp32"};
  keys.insert(keys.end(), u.state_keys.begin(), u.state_keys.end());
  for (size_t g = 0; g < u.groups.size(); ++g)
    for (const auto& key : keys)
      for (int dp : {1, std::max(2, u.source_dp + 1)})
        for (int rank : {0, dp - 1}) (void)LoadUniversalPartition(u, g, key, dp, rank);
}

// The child: runs every operation on `dir` (or the torch file `dir`).
std::string RunOps(const Fixture& fx, const fs::path& target, bool manifest, const fs::path& scratch) {
  std::vector<Op> ops;
  if (fx.kind == FixtureKind::kTorchFile) {
    Op load{"load"}, inspect{"inspect"};
    load.result = Run([&] { LoadTorchFile(target.string(), {.policy = PicklePolicy::kStrict}); });
    inspect.result = Run([&] {
      TorchFile f = LoadTorchFile(target.string(), {.policy = PicklePolicy::kLenient});
      (void)ValueToJson(*f.root).dump(1, ' ', false, nlohmann::json::error_handler_t::replace);
      std::ostringstream tree;
      PrintValue(tree, *f.root);
    });
    return std::string{load.result, inspect.result};
  }
  const std::string dir = target.string();
  std::string out;
  if (fx.kind == FixtureKind::kZero) {
    ZeroCheckpoint z;
    char open = Run([&] { z = OpenZeroCheckpoint(dir, manifest); });
    out += open;
    if (open == 'A') {
      const fs::path u = scratch / "universal";
      ConvertOptions o;
      o.threads = 1;
      o.durable = false;
      char c = Run([&] { ConvertToUniversal(z, u.string(), o); });
      out += (c != 'A' && fs::exists(u)) ? 'P' : c;
    } else {
      out += '-';
    }
  } else {
    out += Run([&] { ReadPartitions(dir, manifest); });
    out += '-';
  }
  const fs::path st = scratch / "model.safetensors";
  char e = Run([&] { ExportSafetensors(dir, st.string(), DType::kFloat32, manifest); });
  out += (e != 'A' && fs::exists(st)) ? 'P' : e;
  out += Run([&] {  // what `uckpt inspect DIR` and `inspect --json DIR` print
    CheckpointInfo info = InspectCheckpoint(dir);
    std::ostringstream text;
    PrintCheckpointInfo(text, info);
    (void)CheckpointInfoJson(info).dump(1, ' ', false, nlohmann::json::error_handler_t::replace);
  });
  out += Run([&] {
    VerifyReport r = VerifyCheckpoint(dir, {.hashes = true, .threads = 1});
    if (!r.ok()) throw FormatError(dir + ": verify found " + std::to_string(r.problem_count()) + " problems");
  });
  // Without --verify, a reader still compares sizes with the manifest.
  if (manifest)
    out += Run([&] {
      if (fx.kind == FixtureKind::kZero) (void)OpenZeroCheckpoint(dir, false);
      else (void)OpenUniversalCheckpoint(dir, false);
    });
  return out;
}

const char* kTorchOps[] = {"load", "inspect"};
const char* kFolderOps[] = {"open", "convert", "export", "inspect", "verify", "open-sizes"};

struct Tally {
  size_t cases = 0, rejected = 0, accepted = 0, crashes = 0, hangs = 0, unclean = 0, unnamed = 0, partial = 0,
         silent_with_manifest = 0;
  void Add(const Tally& o) {
    cases += o.cases, rejected += o.rejected, accepted += o.accepted, crashes += o.crashes, hangs += o.hangs;
    unclean += o.unclean, unnamed += o.unnamed, partial += o.partial, silent_with_manifest += o.silent_with_manifest;
  }
  size_t failures() const { return crashes + hangs + unclean + unnamed + partial + silent_with_manifest; }
  std::string Text() const {
    std::ostringstream o;
    o << cases << " cases: " << rejected << " rejected with an error, " << accepted << " accepted; " << crashes
      << " crashes/sanitizer reports, " << hangs << " hangs, " << unclean << " other exceptions, " << unnamed
      << " errors naming no file, " << partial << " partial outputs, " << silent_with_manifest
      << " accepted silently with a manifest";
    return o.str();
  }
};

int g_timeout = 60;
bool g_verbose = false;

// Forks, runs the operations in the child under alarm(), and classifies.
void RunCase(const Fixture& fx, bool manifest, const Case& c, bool changed, Tally& t) {
  const fs::path target = fx.kind == FixtureKind::kTorchFile ? fx.plain : (manifest ? fx.with_manifest : fx.plain);
  const fs::path scratch = fs::path(g_root) / "scratch";
  std::error_code ec;
  fs::remove_all(scratch, ec);
  fs::create_directories(scratch);
  int pipefd[2];
  if (pipe(pipefd) != 0) std::exit(2);
  std::cout.flush();
  std::cerr.flush();
  pid_t pid = fork();
  if (pid < 0) std::exit(2);
  if (pid == 0) {
    close(pipefd[0]);
    alarm(static_cast<unsigned>(g_timeout));
    std::string r = RunOps(fx, target, manifest, scratch);
    (void)!write(pipefd[1], r.data(), r.size());
    _exit(0);
  }
  close(pipefd[1]);
  std::string r;
  char buf[64];
  ssize_t n;
  while ((n = read(pipefd[0], buf, sizeof buf)) > 0) r.append(buf, static_cast<size_t>(n));
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  ++t.cases;
  const std::string where = fx.name + (manifest ? " (manifest)" : "") + ": " + c.Text();
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) {
    ++t.hangs;
    std::cout << "HANG (> " << g_timeout << " s): " << where << "\n";
    return;
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    ++t.crashes;
    std::cout << "CRASH ("
              << (WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                                      : "exit " + std::to_string(WEXITSTATUS(status)))
              << "): " << where << "\n";
    return;
  }
  const char* const* names = fx.kind == FixtureKind::kTorchFile ? kTorchOps : kFolderOps;
  auto report = [&](const char* what, size_t k) {
    std::cout << what << " in " << names[k] << ": " << where << " [" << r << "]\n";
  };
  for (size_t k = 0; k < r.size(); ++k) {
    if (r[k] == 'X') ++t.unclean, report("OTHER EXCEPTION", k);
    if (r[k] == 'N') ++t.unnamed, report("ERROR NAMING NO FILE", k);
    if (r[k] == 'P') ++t.partial, report("PARTIAL OUTPUT", k);
  }
  // The primary reader: strict load / open (with --verify when there is a manifest).
  if (r[0] == 'A') ++t.accepted;
  else ++t.rejected;
  if (manifest && changed) {
    // open, export and verify check hashes here; sizes alone catch a truncation.
    bool silent = r[0] == 'A' || r[2] == 'A' || r[4] == 'A';
    if (c.what == Corruption::kTruncate || c.what == Corruption::kMissing) silent = silent || r[5] == 'A';
    if (silent) ++t.silent_with_manifest, std::cout << "ACCEPTED WITH A MANIFEST: " << where << " [" << r << "]\n";
  }
  if (g_verbose) std::cout << "  " << where << " [" << r << "]\n";
}

// Applies `c` to the copy at `root`, runs the case, and puts the bytes back.
void ApplyAndRun(const Fixture& fx, bool manifest, const Case& c, Tally& t) {
  const fs::path root =
      fx.kind == FixtureKind::kTorchFile ? fx.plain.parent_path() : (manifest ? fx.with_manifest : fx.plain);
  const fs::path file = fx.kind == FixtureKind::kTorchFile ? fx.plain : root / c.file;
  const auto original = ReadAll(file);
  bool changed = true;
  switch (c.what) {
    case Corruption::kTruncate: {
      auto b = original;
      b.resize(std::min<uint64_t>(c.offset, b.size()));
      changed = b.size() != original.size();
      WriteAll(file, b);
      break;
    }
    case Corruption::kFlip: {
      auto b = original;
      if (!b.empty()) b[c.offset % b.size()] ^= c.mask;
      changed = !b.empty();
      WriteAll(file, b);
      break;
    }
    case Corruption::kMissing: fs::remove(file); break;
    case Corruption::kSwap: {
      const auto other = ReadAll(root / c.other);
      changed = other != original;
      WriteAll(file, other);
      WriteAll(root / c.other, original);
      break;
    }
  }
  RunCase(fx, manifest, c, changed, t);
  if (c.what == Corruption::kSwap) WriteAll(root / c.other, ReadAll(file));
  WriteAll(file, original);
}

std::vector<std::string> ListFiles(const fs::path& folder) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(folder))
    if (e.is_regular_file() && e.path().filename() != kManifestName)
      out.push_back(fs::relative(e.path(), folder).string());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<Fixture> FindFixtures(const fs::path& shared) {
  std::vector<Fixture> out;
  const fs::path fixtures = shared / "fixtures";
  for (const char* v : {"torch/torch-1.13", "torch/torch-2.11"})
    for (const auto& e : fs::directory_iterator(fixtures / v))
      if (e.path().extension() == ".pt")
        out.push_back({fs::relative(e.path(), fixtures).string(), FixtureKind::kTorchFile, e.path(), {}, {}, {}});
  for (const char* sub : {"deepspeed", "refrun-gpt2"})
    for (const auto& e : fs::recursive_directory_iterator(fixtures / sub)) {
      if (!e.is_directory()) continue;
      bool zero = false;
      for (const auto& f : fs::directory_iterator(e.path()))
        zero = zero || f.path().filename().string().find("_optim_states.pt") != std::string::npos;
      bool universal = fs::exists(e.path() / "zero" / "optimizer_state.pt");
      if (zero || universal)
        out.push_back({fs::relative(e.path(), fixtures).string(),
                       zero ? FixtureKind::kZero : FixtureKind::kUniversal,
                       e.path(),
                       {},
                       {},
                       {}});
    }
  std::sort(out.begin(), out.end(), [](const Fixture& a, const Fixture& b) { return a.name < b.name; });
  return out;
}

size_t EnvSize(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : fallback;
}

}  // namespace

struct Totals {
  Tally by_kind[3], with_manifest, without_manifest;
  std::vector<Tally*> All() { return {&by_kind[0], &by_kind[1], &by_kind[2], &with_manifest, &without_manifest}; }
};

std::string Serialize(Totals& t) {
  std::ostringstream o;
  for (Tally* x : t.All())
    o << x->cases << ' ' << x->rejected << ' ' << x->accepted << ' ' << x->crashes << ' ' << x->hangs << ' '
      << x->unclean << ' ' << x->unnamed << ' ' << x->partial << ' ' << x->silent_with_manifest << '\n';
  return o.str();
}
void AddSerialized(Totals& t, const std::string& text) {
  std::istringstream in(text);
  for (Tally* x : t.All()) {
    Tally y;
    in >> y.cases >> y.rejected >> y.accepted >> y.crashes >> y.hangs >> y.unclean >> y.unnamed >> y.partial >>
        y.silent_with_manifest;
    x->Add(y);
  }
}

// Fixtures worker, worker + jobs, ... (each worker in its own folder).
void RunFixtures(std::vector<Fixture>& fixtures, size_t worker, size_t jobs, size_t truncations, size_t flips,
                 Totals& tot) {
  for (size_t index = worker; index < fixtures.size(); index += jobs) {
    Fixture& fx = fixtures[index];
    const fs::path home = fs::path(g_root) / std::to_string(index);
    fs::create_directories(home);
    std::mt19937_64 rng(0x5eed0000 + index + 1);  // reproducible: the same cases every run
    std::vector<Case> cases;
    if (fx.kind == FixtureKind::kTorchFile) {
      fx.plain = home / fx.source.filename();
      fs::copy_file(fx.source, fx.plain);
      fx.files = {fx.source.filename().string()};
      const uint64_t size = fs::file_size(fx.plain);
      for (size_t k = 0; k < truncations; ++k)
        cases.push_back({Corruption::kTruncate, fx.files[0], "", size * k / truncations});
      for (size_t k = 0; k < flips; ++k)
        cases.push_back({Corruption::kFlip, fx.files[0], "", rng() % size, static_cast<uint8_t>(1 + rng() % 255)});
    } else {
      fx.plain = home / "plain";
      fx.with_manifest = home / "manifest";
      fs::copy(fx.source, fx.plain, fs::copy_options::recursive);
      fs::copy(fx.source, fx.with_manifest, fs::copy_options::recursive);
      fs::remove(fx.plain / kManifestName);
      WriteManifest(fx.with_manifest.string(), false);
      fx.files = ListFiles(fx.plain);
      std::vector<std::string> shuffled = fx.files;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      for (size_t k = 0; k < truncations; ++k) {
        const std::string& f = shuffled[k % shuffled.size()];
        cases.push_back({Corruption::kTruncate, f, "", rng() % std::max<uint64_t>(1, fs::file_size(fx.plain / f))});
      }
      for (size_t k = 0; k < flips; ++k) {
        const std::string& f = fx.files[rng() % fx.files.size()];
        cases.push_back({Corruption::kFlip, f, "", rng() % std::max<uint64_t>(1, fs::file_size(fx.plain / f)),
                         static_cast<uint8_t>(1 + rng() % 255)});
      }
      // A missing rank file / parameter file, and two swapped ones.
      std::vector<std::string> ranks;
      for (const auto& f : fx.files)
        if (f.find("zero_pp_rank_") != std::string::npos && f.find("optim_states") != std::string::npos)
          ranks.push_back(f);
      if (fx.kind == FixtureKind::kZero && ranks.size() >= 2) {
        cases.push_back({Corruption::kMissing, ranks.back(), ""});
        cases.push_back({Corruption::kSwap, ranks[0], ranks[1]});
      } else if (fx.kind == FixtureKind::kUniversal) {
        std::vector<std::string> fp32;
        for (const auto& f : fx.files)
          if (f.size() > 8 && f.compare(f.size() - 8, 8, "/fp32.pt") == 0) fp32.push_back(f);
        if (fp32.size() >= 2) {
          const std::string& victim = fp32[rng() % fp32.size()];
          cases.push_back({Corruption::kMissing, victim, ""});
          // Same shape, same size: only the content says which is which.
          cases.push_back({Corruption::kSwap, victim, victim.substr(0, victim.size() - 7) + "exp_avg.pt"});
        }
      }
    }
    Tally t;
    for (const Case& c : cases) {
      Tally one;
      ApplyAndRun(fx, false, c, one);
      (fx.kind == FixtureKind::kTorchFile ? t : tot.without_manifest).Add(one);
      if (fx.kind != FixtureKind::kTorchFile) {
        t.Add(one);
        Tally m;
        ApplyAndRun(fx, true, c, m);
        tot.with_manifest.Add(m);
        t.Add(m);
      }
    }
    tot.by_kind[static_cast<int>(fx.kind)].Add(t);
    std::cout << fx.name << ": " << t.Text() << "\n" << std::flush;
  }
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: corrupt_matrix_test SHARED_DIR\n";
    return 2;
  }
  const bool full = std::getenv("UCKPT_CORRUPT_FULL") && std::string(std::getenv("UCKPT_CORRUPT_FULL")) == "1";
  const size_t truncations = EnvSize("UCKPT_CORRUPT_TRUNCATIONS", full ? 50 : 6);
  const size_t flips = EnvSize("UCKPT_CORRUPT_FLIPS", full ? 200 : 12);
  g_timeout = static_cast<int>(EnvSize("UCKPT_CORRUPT_TIMEOUT", 60));
  g_verbose = std::getenv("UCKPT_CORRUPT_VERBOSE") != nullptr;
  SetDefaultPicklePolicy(PicklePolicy::kStrict);

  std::string base = fs::exists("/dev/shm") ? "/dev/shm" : fs::temp_directory_path().string();
  std::string pattern = base + "/uckpt-corrupt-XXXXXX";
  if (!mkdtemp(pattern.data())) return 2;
  g_root = pattern;

  std::vector<Fixture> fixtures = FindFixtures(argv[1]);
  const size_t found = fixtures.size();
  if (const char* only = std::getenv("UCKPT_CORRUPT_ONLY"))  // reproduce: fixtures whose name contains it
    std::erase_if(fixtures, [&](const Fixture& f) { return f.name.find(only) == std::string::npos; });
  const auto start = std::chrono::steady_clock::now();
  const size_t jobs = std::max<size_t>(1, EnvSize("UCKPT_CORRUPT_JOBS", 1));
  Totals tot;
  if (jobs == 1) {
    RunFixtures(fixtures, 0, 1, truncations, flips, tot);
  } else {
    // Workers over disjoint fixtures, each with its own folder; the parent adds up.
    const std::string root = g_root;
    std::vector<pid_t> pids;
    for (size_t w = 0; w < jobs; ++w) {
      std::cout.flush();
      pid_t pid = fork();
      if (pid == 0) {
        g_root = root + "/w" + std::to_string(w);
        fs::create_directories(g_root);
        Totals mine;
        RunFixtures(fixtures, w, jobs, truncations, flips, mine);
        std::ofstream(root + "/w" + std::to_string(w) + ".tally") << Serialize(mine);
        std::cout.flush();
        _exit(0);
      }
      pids.push_back(pid);
    }
    for (size_t w = 0; w < jobs; ++w) {
      int status = 0;
      waitpid(pids[w], &status, 0);
      std::ifstream in(root + "/w" + std::to_string(w) + ".tally");
      std::string text((std::istreambuf_iterator<char>(in)), {});
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || text.empty()) {
        std::cout << "FAIL: worker " << w << " died\n";
        return 1;
      }
      AddSerialized(tot, text);
    }
  }
  std::error_code ec;
  fs::remove_all(g_root, ec);

  Tally total;
  for (const Tally& t : tot.by_kind) total.Add(t);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "\n== corrupt-input matrix (" << truncations << " truncations, " << flips
            << " flips per fixture; missing and swapped files per folder; timeout " << g_timeout << " s; " << secs
            << " s)\n";
  std::cout << "torch files:        " << tot.by_kind[0].Text() << "\n";
  std::cout << "ZeRO folders:       " << tot.by_kind[1].Text() << "\n";
  std::cout << "universal folders:  " << tot.by_kind[2].Text() << "\n";
  std::cout << "folders, no manifest:   " << tot.without_manifest.Text() << "\n";
  std::cout << "folders, with manifest: " << tot.with_manifest.Text() << "\n";
  std::cout << "TOTAL: " << total.Text() << "\n";
  if (found < 80) {
    std::cout << "FAIL: only " << found << " fixtures found under " << argv[1] << "\n";
    return 1;
  }
  return total.failures() == 0 ? 0 : 1;
}
