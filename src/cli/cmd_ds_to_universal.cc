// `uckpt ds_to_universal`: a drop-in for DeepSpeed's
// `python -m deepspeed.checkpoint.ds_to_universal`, for the frameworks that
// shell out to it. Every flag of its argparse (the same in v0.14.5 through
// v0.19.8) is taken; exit 0 on success, 1 on a failed conversion and 2 on a
// wrong command line, as Python's argparse and an uncaught exception give.
#include <iostream>
#include <string>

#include "ckpt/convert.h"
#include "ckpt/folder.h"
#include "cli/commands.h"
#include "format/error.h"

namespace uckpt::cli {

Runner AddDsToUniversal(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "ds_to_universal",
      "DeepSpeed's ds_to_universal.py, same flags and exit codes: converts the ZeRO checkpoint tag folder\n"
      "--input_folder into the universal folder --output_folder (the files DeepSpeed writes, no manifest) and\n"
      "writes latest_universal beside it. Without --inject_missing_state a ZeRO-1/2 checkpoint must hold\n"
      "universal_checkpoint_info, as DeepSpeed requires.\n\n"
      "Example:\n"
      "  uckpt ds_to_universal --input_folder ckpt/global_step100 --output_folder ckpt/global_step100_universal");
  struct Args {
    std::string input, output;
    int extract_workers = 4, merge_workers = 2;
    bool keep_temp = false, no_strict = false, inject = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--input_folder", args->input, "Input DeepSpeed Checkpoint folder")->required();
  cmd->add_option("--output_folder", args->output, "Output DeepSpeed checkpoint folder")->required();
  cmd->add_option("--num_extract_workers", args->extract_workers,
                  "How many parallel processes to extract zero shards (uckpt: worker threads of its one pass)");
  cmd->add_option("--num_merge_workers", args->merge_workers,
                  "How many parallel processes to merge tp slices (uckpt: no merge phase)");
  cmd->add_flag("--keep_temp_folder", args->keep_temp,
                "Preserve temporary folder of intermediate checkpoint slice files (uckpt writes none)");
  cmd->add_flag("--no_strict", args->no_strict, "Do not perform validity checks on converted checkpoint");
  cmd->add_flag("--inject_missing_state", args->inject,
                "Inject missing checkpoint state into the checkpoint if it is absent");
  return [args] {
    const char* say = "ds_to_universal: ";
    // What uckpt has nothing to do for is accepted and said.
    if (args->keep_temp)
      std::cerr << say << "--keep_temp_folder: nothing to keep (uckpt writes no temporary slice files)\n";
    if (args->merge_workers != 2)
      std::cerr << say << "--num_merge_workers " << args->merge_workers
                << ": no merge phase (each output file is written once, from the rank files)\n";
    try {
      ckpt::ZeroCheckpoint zc = ckpt::OpenZeroCheckpoint(args->input);
      for (const auto& w : zc.warnings) std::cerr << say << "warning: " << w << "\n";
      // DeepSpeed's strict check: every tensor-parallel pattern of universal_checkpoint_info is used.
      if (args->no_strict && zc.tp == 1)
        std::cerr << say
                  << "--no_strict: nothing to relax (no tensor-parallel ranks; DeepSpeed's strict check is about "
                     "their pattern rules)\n";
      if (args->no_strict)
        for (const std::string& p : zc.unused_tp_patterns)
          std::cerr << say << "warning: unused pattern '" << p << "' while merging tp slices (--no_strict)\n";
      // DeepSpeed's _check_for_required_state (stage 1/2; its stage-3 path reads no such info).
      const bool has_info = zc.model.root && zc.model.root->get("universal_checkpoint_info");
      if (zc.stage >= 1 && zc.stage <= 2 && !has_info && !args->inject) {
        std::cerr << say << "error: " << zc.model.file->path()
                  << ": Required universal_checkpoint_info state is missing in checkpoint (pass "
                     "--inject_missing_state, as DeepSpeed's script needs)\n";
        return 1;
      }
      ckpt::ConvertOptions options;
      options.threads = args->extract_workers > 0 ? args->extract_workers : 0;
      options.force = true;            // DeepSpeed writes into an existing output folder
      options.write_manifest = false;  // only the files DeepSpeed writes
      options.strict = !args->no_strict;
      ckpt::ConvertStats stats = ckpt::ConvertToUniversal(zc, args->output, options);
      std::cout << "*** Done! " << stats.params << " parameters, " << stats.files << " files in " << args->output
                << "\n";
    } catch (const FormatError& e) {
      std::cerr << say << "error: " << e.what() << "\n";
      return 1;
    } catch (const IoError& e) {
      std::cerr << say << "error: " << e.what() << "\n";
      return 1;
    }
    return 0;
  };
}

}  // namespace uckpt::cli
