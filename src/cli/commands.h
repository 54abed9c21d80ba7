// Each subcommand registers its flags on the app and returns the function
// that runs it (its exit code).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace uckpt::cli {

using Runner = std::function<int()>;

Runner AddInspect(CLI::App& app);
Runner AddConvert(CLI::App& app);
Runner AddDsToUniversal(CLI::App& app);  // DeepSpeed's ds_to_universal.py, same flags
Runner AddExport(CLI::App& app);
Runner AddPlot(CLI::App& app);
Runner AddVerify(CLI::App& app);
#ifdef UCKPT_HAVE_ENGINE
Runner AddTrain(CLI::App& app);  // needs libtorch
Runner AddLaunch(CLI::App& app);
#endif
#ifdef UCKPT_ENGINE_EXEC
// `name` as a command that replaces this process with uckpt-engine (the
// executable beside this one, which links libtorch), passing every argument.
Runner AddEngineCommand(CLI::App& app, const std::string& name, const std::string& description);
#endif

}  // namespace uckpt::cli
