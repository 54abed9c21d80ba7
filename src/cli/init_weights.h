// `uckpt train --init FILE`: initial weights from a torch.save state dict (a plain dict of
// tensors, or DeepSpeed's model-states file with its `module`), or a
// safetensors file. Read through the format layer, never by running pickles.
#pragma once

#include <string>
#include <vector>

#include "models/gpt2.h"

namespace uckpt::cli {

// The file's tensors in file order, copied into libtorch tensors. Throws
// FormatError naming the file if it holds no state dict.
std::vector<models::NamedTensor> LoadStateDictFile(const std::string& path);

// Copies `state` into `params` by name (shapes must match; dtypes are cast).
// Tied aliases (`lm_head.weight`) and HF's attention-mask buffers are
// accepted and skipped; a missing parameter or an unknown key is an error
// that names `source`.
void CopyStateDict(const std::vector<models::NamedTensor>& state, const std::vector<models::NamedTensor>& params,
                   const std::string& source);

}  // namespace uckpt::cli
