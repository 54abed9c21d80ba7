// libFuzzer target: checkpoint folders. Small synthetic checkpoints (ZeRO 1, 2,
// 3, BF16_Optimizer, universal with and without a manifest) are written once;
// each input picks one of them and one of its files and replaces that file's
// bytes (or deletes it), then runs everything that reads a folder: open and
// validate and plan (ZeRO), conversion to universal, the universal partition
// load a resuming engine does, safetensors export and `inspect DIR`, all in
// process and in strict mode.
//
// Input: [seed][file][op][bytes...]; seed and file are taken modulo the counts;
// op bit 0 deletes the file instead of writing `bytes`.
// UCKPT_FUZZ_WRITE_SEEDS=DIR writes one input per seed file (its real bytes)
// to DIR and exits: that is how corpus/fuzz_checkpoint was made.
//
// Findings besides crashes and sanitizer reports: an exception other than
// FormatError/IoError, and output left behind by a failed convert or export.
#include <stdlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ckpt/convert.h"
#include "ckpt/export.h"
#include "ckpt/inspect.h"
#include "ckpt/manifest.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/zero_checkpoint.h"
#include "ckpt/zero_writer.h"
#include "format/error.h"

namespace {

using namespace uckpt;
using namespace uckpt::ckpt;
namespace fs = std::filesystem;

struct Seed {
  std::string name;
  bool universal = false;
  fs::path folder;                 // the pristine folder
  std::vector<std::string> files;  // relative paths, sorted
};

fs::path g_root;  // scratch folder (tmpfs when there is one)
std::vector<Seed> g_seeds;

std::vector<uint8_t> ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void WriteAll(const fs::path& p, const uint8_t* data, size_t size) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) __builtin_trap();  // the scratch disk, not the code under test
}

std::vector<std::string> ListFiles(const fs::path& folder) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(folder))
    if (e.is_regular_file()) out.push_back(fs::relative(e.path(), folder).string());
  std::sort(out.begin(), out.end());
  return out;
}

ZeroWriteSpec Spec(int stage, bool bf16) {
  ZeroWriteSpec s;
  s.stage = stage;
  s.bf16_optimizer = bf16;
  s.optim_prefix = bf16 ? "bf16_" : "";
  s.dp = 2;
  s.groups = {{{"h.0.attn.weight", {3, 4}}, {"h.0.attn.bias", {3}}}, {{"ln_f.weight", {5}}}};
  s.sub_group_size = 10;  // stage 3: two sub-groups
  s.source = PatternSource();
  return s;
}

void MakeSeeds() {
  std::string base = fs::exists("/dev/shm") ? "/dev/shm" : fs::temp_directory_path().string();
  std::string pattern = base + "/uckpt-fuzz-ckpt-XXXXXX";
  if (!mkdtemp(pattern.data())) __builtin_trap();
  g_root = pattern;
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(g_root, ec);
  });
  const fs::path seeds = g_root / "seeds";
  fs::create_directories(seeds);
  auto zero = [&](const std::string& name, int stage, bool bf16) {
    WriteZeroCheckpoint((seeds / name).string(), Spec(stage, bf16));
    g_seeds.push_back({name, false, seeds / name, {}});
  };
  zero("z1", 1, false);
  zero("z2", 2, false);
  zero("z3", 3, false);
  zero("bf16", 1, true);
  auto universal = [&](const std::string& name, const std::string& from, bool keep_manifest) {
    ConvertOptions o;
    o.threads = 1;
    o.durable = false;
    fs::create_directories(seeds / (name + "_parent"));
    const fs::path out = seeds / (name + "_parent") / name;
    ConvertToUniversal((seeds / from).string(), out.string(), o);
    if (!keep_manifest) fs::remove(out / kManifestName);
    g_seeds.push_back({name, true, out, {}});
  };
  universal("u2", "z2", false);
  universal("u3", "z3", false);
  universal("u2_manifest", "z2", true);
  for (auto& s : g_seeds) s.files = ListFiles(s.folder);
}

void WriteSeedInputs(const std::string& dir) {
  fs::create_directories(dir);
  for (size_t s = 0; s < g_seeds.size(); ++s)
    for (size_t f = 0; f < g_seeds[s].files.size(); ++f) {
      std::vector<uint8_t> in = {static_cast<uint8_t>(s), static_cast<uint8_t>(f), 0};
      auto bytes = ReadAll(g_seeds[s].folder / g_seeds[s].files[f]);
      in.insert(in.end(), bytes.begin(), bytes.end());
      std::string name = g_seeds[s].name + "-" + g_seeds[s].files[f];
      std::replace(name.begin(), name.end(), '/', '_');
      WriteAll(fs::path(dir) / name, in.data(), in.size());
    }
}

// Runs `step`; FormatError and IoError are the expected refusals. Returns
// whether it succeeded.
template <typename F>
bool Try(F&& step) {
  try {
    step();
    return true;
  } catch (const FormatError&) {
  } catch (const IoError&) {}
  return false;
}

void ReadUniversal(const std::string& folder) {
  UniversalCheckpoint u;
  if (!Try([&] { u = OpenUniversalCheckpoint(folder); })) return;
  // What a resuming engine reads: every rank's partition at a few world sizes.
  std::vector<std::string> keys = {"fp32"};
  keys.insert(keys.end(), u.state_keys.begin(), u.state_keys.end());
  for (size_t g = 0; g < u.groups.size(); ++g)
    for (const auto& key : keys)
      for (int dp : {1, 3})
        for (int rank = 0; rank < dp; ++rank) Try([&] { (void)LoadUniversalPartition(u, g, key, dp, rank); });
  for (const auto& group : u.groups)
    for (const auto& p : group) Try([&] { (void)LoadUniversalState(u, p.name, "fp32"); });
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  SetDefaultPicklePolicy(PicklePolicy::kStrict);  // how training state is loaded
  MakeSeeds();
  if (const char* dir = getenv("UCKPT_FUZZ_WRITE_SEEDS")) {
    WriteSeedInputs(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const Seed& seed = g_seeds[data[0] % g_seeds.size()];
  const std::string& file = seed.files[data[1] % seed.files.size()];
  const bool remove = data[2] & 1;

  // A fresh copy of the seed folder with the one file changed.
  const fs::path work = g_root / "work", dir = work / "ckpt" / seed.name;
  std::error_code ec;
  fs::remove_all(work, ec);
  fs::create_directories(dir.parent_path());
  fs::copy(seed.folder, dir, fs::copy_options::recursive);
  if (remove) fs::remove(dir / file);
  else WriteAll(dir / file, data + 3, size - 3);

  if (seed.universal) {
    ReadUniversal(dir.string());
  } else {
    ZeroCheckpoint z;
    if (Try([&] { z = OpenZeroCheckpoint(dir.string()); })) {
      ConvertOptions o;
      o.threads = 1;
      o.durable = false;
      const fs::path out = work / "out" / "universal";
      fs::create_directories(out.parent_path());
      if (Try([&] { ConvertToUniversal(z, out.string(), o); })) ReadUniversal(out.string());
      else if (fs::exists(out)) __builtin_trap();  // a failed conversion left its output behind
    }
  }
  const fs::path st = work / "model.safetensors";
  if (!Try([&] { ExportSafetensors(dir.string(), st.string()); }) && fs::exists(st))
    __builtin_trap();  // a failed export left its output behind
  Try([&] { (void)InspectCheckpoint(dir.string()); });
  fs::remove_all(work, ec);
  return 0;
}
