// `uckpt train` and `uckpt launch` in the executable without libtorch: they
// exec uckpt-engine (beside this executable) with the same arguments, so the
// process id, environment, open files and signals are those of the command.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "cli/commands.h"

namespace uckpt::cli {

Runner AddEngineCommand(CLI::App& app, const std::string& name, const std::string& description) {
  auto* cmd = app.add_subcommand(name, description);
  cmd->prefix_command();  // every argument after the name, --help included, is uckpt-engine's
  cmd->set_help_flag();
  return [cmd, name] {
    std::error_code ec;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    std::filesystem::path path = ec ? std::filesystem::path("uckpt") : self;
    const std::string engine = path.replace_filename("uckpt-engine").string();
    std::vector<std::string> args = {engine, name};
    for (const auto& a : cmd->remaining()) args.push_back(a);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(engine.c_str(), argv.data());
    std::cerr << "uckpt: error: `uckpt " << name << "` runs " << engine
              << ", which cannot be started: " << std::strerror(errno) << "\n";
    return 2;
  };
}

}  // namespace uckpt::cli
