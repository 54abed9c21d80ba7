// uckpt: universal checkpoints for ZeRO data-parallel training.
#include <iostream>
#include <map>

#include "cli/commands.h"
#include "format/error.h"
#include "format/fault_env.h"

int main(int argc, char** argv) {
  CLI::App app{
      "uckpt - read, convert and train with universal (any-world-size) checkpoints.\n\n"
      "Examples:\n"
      "  uckpt inspect model.pt            print the value tree of a torch.save file\n"
      "  uckpt inspect --json model.pt     the same as JSON (tensors with SHA-256)\n",
      "uckpt"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");

  std::map<CLI::App*, uckpt::cli::Runner> runners;
  auto add = [&](auto adder) {
    size_t before = app.get_subcommands({}).size();
    auto runner = adder(app);
    runners[app.get_subcommands({})[before]] = runner;
  };
  add(uckpt::cli::AddInspect);
  add(uckpt::cli::AddConvert);
  add(uckpt::cli::AddDsToUniversal);
  add(uckpt::cli::AddExport);
  add(uckpt::cli::AddPlot);
  add(uckpt::cli::AddVerify);
#ifdef UCKPT_HAVE_ENGINE
  add(uckpt::cli::AddTrain);
  add(uckpt::cli::AddLaunch);
#endif
#ifdef UCKPT_ENGINE_EXEC
  add([](CLI::App& a) {
    return uckpt::cli::AddEngineCommand(
        a, "train", "Train GPT-2 or BERT with ZeRO-0/1/2/3 data parallelism (`uckpt train --help`)");
  });
  add([](CLI::App& a) {
    return uckpt::cli::AddEngineCommand(a, "launch", "Start N local ranks of a command (`uckpt launch --help`)");
  });
#endif

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help is 0; a wrong command line is a usage error (2)
  }
  try {
    uckpt::InstallWriteHookFromEnvironment();  // UCKPT_CRASH_AFTER_WRITES etc. (docs/reliability.md)
    for (auto* sub : app.get_subcommands()) return runners.at(sub)();
  } catch (const uckpt::FormatError& e) {
    std::cerr << "uckpt: error: " << e.what() << "\n";
    return 2;
  } catch (const uckpt::IoError& e) {
    std::cerr << "uckpt: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "uckpt: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
