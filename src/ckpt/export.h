// The consolidated full weights of a ZeRO or universal checkpoint (what
// DeepSpeed's zero_to_fp32.py produces: buffers, frozen parameters, trainable
// parameters from the fp32 masters, tied aliases) as one safetensors file:
// an 8-byte little-endian header length, a JSON header, raw little-endian data.
#pragma once

#include <cstdint>
#include <string>

#include "format/dtype.h"

namespace uckpt::ckpt {

struct ExportStats {
  size_t tensors = 0;  // written tensors
  size_t aliases = 0;  // tied names recorded in the metadata instead
  uint64_t bytes = 0;  // file size
};

// Reads the checkpoint at `checkpoint` (tag folder, universal folder, or their
// parent with latest / latest_universal) and writes `out` atomically.
// Floating-point tensors are written as `dtype` (float32, bfloat16 or float16;
// rounding to nearest even), others unchanged. Tied parameters are written
// once; `__metadata__` maps each alias to the name holding the data (as
// safetensors' save_model does). Throws FormatError / IoError naming the file.
// The output gets no manifest: a safetensors header already gives every
// tensor's extent (docs/manifest-format.md). The input's manifest, if it has
// one, is checked (sizes; hashes with `verify_hashes`).
ExportStats ExportSafetensors(const std::string& checkpoint, const std::string& out, DType dtype = DType::kFloat32,
                              bool verify_hashes = false);

// safetensors' name for a dtype ("F32", "BF16", ...); throws FormatError for
// dtypes it has none for.
std::string SafetensorsDtype(DType d);

}  // namespace uckpt::ckpt
