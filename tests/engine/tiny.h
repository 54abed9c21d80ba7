// A GPT-2 small enough to train in milliseconds (1 layer, 6 wide, vocab 37,
// 9 tokens: 798 parameters, padded at world sizes 2 and 4), and files read
// back whole: for the engine tests that save and compare checkpoints.
#pragma once

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "cli/trainer.h"

namespace uckpt::engine::testing {

using cli::TrainOptions;

// Its size: the tiny one by default; larger where a test needs bytes to
// measure. Sequences are n_positions tokens long.
struct TinyShape {
  int64_t n_layer = 1, n_embd = 6, vocab_size = 37, n_positions = 9;
};

inline TrainOptions TinyGpt2(const nlohmann::json& ds, const TinyShape& shape = {}) {
  TrainOptions o;
  o.config = ParseConfig(ds, "tiny");
  o.model.n_layer = shape.n_layer;
  o.model.n_head = 2;
  o.model.n_embd = shape.n_embd;
  o.model.vocab_size = shape.vocab_size;
  o.model.n_positions = shape.n_positions;
  o.seq_len = shape.n_positions;
  return o;
}

inline std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Changes one byte of `path` at `offset` (its lowest bit flipped).
inline void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ 1));
}

// Every regular file below `folder`, by relative path.
inline std::map<std::string, std::string> FolderBytes(const std::string& folder) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(folder))
    if (e.is_regular_file()) out[fs::relative(e.path(), folder).string()] = ReadBytes(e.path().string());
  return out;
}

// A fresh, empty folder for one test (named by it and the process), removed when the process that
// made it exits (not a forked child's exit).
inline std::string FreshTempDir(const std::string& name) {
  namespace fs = std::filesystem;
  struct Sweeper {
    pid_t owner = getpid();
    std::mutex mu;  // ranks on threads make folders too
    std::vector<fs::path> dirs;
    ~Sweeper() {
      std::error_code ec;
      if (getpid() == owner)
        for (const auto& d : dirs) fs::remove_all(d, ec);
    }
  };
  static Sweeper sweeper;
  auto d = fs::temp_directory_path() / ("uckpt_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  std::lock_guard<std::mutex> lock(sweeper.mu);
  sweeper.dirs.push_back(d);
  return d.string();
}

}  // namespace uckpt::engine::testing
