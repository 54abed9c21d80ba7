// Renders values as JSON in the schema of the fixture manifests
// ("uckpt-torch-fixtures/1"): type tags, Python float reprs, and tensors with
// the SHA-256 of their contiguous little-endian bytes.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "format/value.h"

namespace uckpt {

struct JsonOptions {
  size_t values_limit = 64;     // tensors with at most this many elements list their values
  size_t max_nodes = 10000000;  // shared references can expand a tree; stop past this
  // Non-contiguous tensors are copied into C order to be hashed; an expanded
  // view (stride 0) can claim far more elements than its storage holds.
  size_t max_gather_bytes = size_t{1} << 30;
};

nlohmann::json ValueToJson(const Value& v, const JsonOptions& options = {});

// Python's repr() of a float: "0.1", "1e-05", "inf", "-0.0", "65536.0".
std::string PythonFloatRepr(double d);

std::string Sha256Hex(std::span<const uint8_t> data);

}  // namespace uckpt
