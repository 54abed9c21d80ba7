#include <iostream>

#include <filesystem>

#include "ckpt/inspect.h"
#include "cli/commands.h"
#include "cli/strict_flags.h"
#include "format/torch_file.h"
#include "format/value_json.h"
#include "format/value_print.h"

namespace uckpt::cli {

Runner AddInspect(CLI::App& app) {
  auto* cmd = app.add_subcommand("inspect",
                                 "Show what a torch.save file holds, without running any code from it.\n\n"
                                 "Classes the file names (custom objects, even os.system) are shown as inert\n"
                                 "objects; nothing is imported or called.\n\n"
                                 "Examples:\n"
                                 "  uckpt inspect mp_rank_00_model_states.pt\n"
                                 "  uckpt inspect --json model.pt | jq '.items[0]'");
  struct Args {
    std::string path;
    bool json = false;
    size_t max_items = 50;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("FILE", args->path, "A file written by torch.save (PyTorch >= 1.6), or a checkpoint folder")
      ->required();
  cmd->add_flag("--json", args->json,
                "Print the value as JSON: type-tagged nodes; tensors with dtype, shape, stride, offset and the\n"
                "SHA-256 of their contiguous little-endian bytes (values too when they have <= 64 elements)");
  cmd->add_option("--max-items", args->max_items, "Items shown per container in the tree view")->capture_default_str();
  AddStrictFlags(cmd, false);  // lenient, so that hostile files can be looked at
  return [args] {
    if (std::filesystem::is_directory(args->path)) {  // a checkpoint folder
      ckpt::CheckpointInfo info = ckpt::InspectCheckpoint(args->path);
      if (args->json)
        std::cout << ckpt::CheckpointInfoJson(info).dump(1, ' ', false, nlohmann::json::error_handler_t::replace)
                  << "\n";
      else ckpt::PrintCheckpointInfo(std::cout, info);
      return 0;
    }
    TorchFile f = LoadTorchFile(args->path);
    if (args->json) {
      std::cout << ValueToJson(*f.root).dump(1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    } else {
      std::cout << args->path << " (" << HumanBytes(f.file->bytes().size()) << ", archive '" << f.archive << "')\n";
      PrintOptions po;
      po.max_items = args->max_items;
      PrintValue(std::cout, *f.root, po);
    }
    return 0;
  };
}

}  // namespace uckpt::cli
