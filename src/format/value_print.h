// Human-readable rendering of a value tree (what `uckpt inspect FILE.pt` prints).
#pragma once

#include <ostream>

#include "format/value.h"

namespace uckpt {

struct PrintOptions {
  size_t max_items = 50;  // per container; the rest is summarized
  size_t max_depth = 64;
  size_t max_nodes = 100000;  // in all: shared references can expand a small file's tree exponentially
};

void PrintValue(std::ostream& os, const Value& v, const PrintOptions& options = {});

// "1.5 MiB"
std::string HumanBytes(uint64_t n);

}  // namespace uckpt
