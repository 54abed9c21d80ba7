#include <iostream>

#include "ckpt/export.h"
#include "cli/commands.h"
#include "cli/strict_flags.h"
#include "format/value_print.h"

namespace uckpt::cli {

Runner AddExport(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "export",
      "Write the full model weights of a ZeRO or universal checkpoint as one safetensors file (what\n"
      "DeepSpeed's zero_to_fp32.py consolidates: buffers, frozen and trainable parameters, the latter from the\n"
      "fp32 masters). Tied parameters are stored once; the alias is recorded in the metadata.\n\n"
      "Examples:\n"
      "  uckpt export ckpt/global_step100 model.safetensors\n"
      "  uckpt export ckpt model-bf16.safetensors --dtype bf16     (ckpt/latest names the tag)");
  struct Args {
    std::string input, output, dtype = "fp32";
    bool quiet = false, verify = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("DIR", args->input, "Tag folder, universal folder, or their parent with latest/latest_universal")
      ->required();
  cmd->add_option("OUT", args->output, "The .safetensors file to write")->required();
  cmd->add_option("--dtype", args->dtype, "Floating-point dtype of the output")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "float32", "bfloat16", "float16"}))
      ->capture_default_str();
  cmd->add_flag("-q,--quiet", args->quiet, "Print nothing on success");
  AddStrictFlags(cmd, true);
  cmd->add_flag("--verify", args->verify,
                "If the input has a manifest (uckpt-manifest.json), compare every file's hash with it, not only its "
                "size");
  return [args] {
    DType d = DType::kFloat32;
    if (args->dtype == "bf16" || args->dtype == "bfloat16") d = DType::kBFloat16;
    if (args->dtype == "fp16" || args->dtype == "float16") d = DType::kFloat16;
    ckpt::ExportStats st = ckpt::ExportSafetensors(args->input, args->output, d, args->verify);
    if (!args->quiet)
      std::cerr << "export: wrote " << args->output << ": " << st.tensors << " tensors, " << st.aliases
                << " tied alias(es), " << HumanBytes(st.bytes) << "\n";
    return 0;
  };
}

}  // namespace uckpt::cli
