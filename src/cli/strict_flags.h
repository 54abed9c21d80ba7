// --strict / --no-strict: which globals a loaded pickle may name
// (format/pickle_reader.h, docs/security.md).
#pragma once

#include <CLI/CLI.hpp>

namespace uckpt::cli {

// Adds both flags to `cmd`; `strict_by_default` is what it does without them.
// They set the process-wide DefaultPicklePolicy() when `cmd` is parsed.
void AddStrictFlags(CLI::App* cmd, bool strict_by_default);

}  // namespace uckpt::cli
