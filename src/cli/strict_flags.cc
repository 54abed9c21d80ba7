#include "cli/strict_flags.h"
#include "format/pickle_reader.h"

namespace uckpt::cli {

void AddStrictFlags(CLI::App* cmd, bool strict_by_default) {
  // Set before the command's own flags are parsed, so that a flag given
  // after it wins; the runner then loads every file with this policy.
  cmd->preparse_callback([strict_by_default](size_t) {
    SetDefaultPicklePolicy(strict_by_default ? PicklePolicy::kStrict : PicklePolicy::kLenient);
  });
  auto* on = cmd->add_flag_callback(
      "--strict", [] { SetDefaultPicklePolicy(PicklePolicy::kStrict); },
      std::string("Refuse pickles that name anything but tensors, containers and DeepSpeed's classes") +
          (strict_by_default ? " (the default)" : "") + "; docs/security.md");
  auto* off = cmd->add_flag_callback(
      "--no-strict", [] { SetDefaultPicklePolicy(PicklePolicy::kLenient); },
      std::string("Accept any class or function a pickle names, kept as an inert object (never run)") +
          (strict_by_default ? "" : " (the default)"));
  on->excludes(off);
}

}  // namespace uckpt::cli
