// An Env that counts, by path, the folders listed and the files mapped: the
// tests that a reader opens a folder once (ckpt's tag folder, the engine's
// load) count through it. Thread-safe: every rank's reads may count at once.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "format/env.h"

namespace uckpt::testing {

class CountingEnv : public EnvWrapper {
 public:
  CountingEnv() : EnvWrapper(Env::Posix()) {}
  std::shared_ptr<const MappedFile> MapFile(const std::string& path) override {
    Count(maps_, path);
    return EnvWrapper::MapFile(path);
  }
  std::vector<DirEntry> ListDir(const std::string& path) override {
    Count(lists_, path);
    return EnvWrapper::ListDir(path);
  }
  int maps(const std::string& path) { return Get(maps_, path); }
  int lists(const std::string& path) { return Get(lists_, path); }

 private:
  void Count(std::map<std::string, int>& m, const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    ++m[path];
  }
  int Get(std::map<std::string, int>& m, const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    return m[path];
  }
  std::mutex mu_;
  std::map<std::string, int> maps_, lists_;
};

}  // namespace uckpt::testing
