// A pickle virtual machine for protocols 0-5 that never imports or calls
// anything. Calls of known-safe builders (tensor rebuilds, OrderedDict, set,
// bytes, torch.Size, ...) become typed values; every other call becomes an
// inert kObject node.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "format/value.h"

namespace uckpt {

struct PickleLimits {
  size_t max_depth = 1000;           // nesting of containers in the result
  size_t max_stack = 1u << 24;       // values on the VM stack
  size_t max_memo = 1u << 24;        // memo entries
  size_t max_int_bytes = 1u << 14;   // LONG1/LONG4 payload
};

// Turns a persistent id (a tuple for torch files) into a value, or throws.
using PersistentLoader = std::function<ValuePtr(const ValuePtr& pid)>;

// Decodes `data`. `where` names the file/record in error messages. Throws
// FormatError (with the byte offset) on malformed or over-limit input.
ValuePtr ReadPickle(std::span<const uint8_t> data, const std::string& where,
                    const PersistentLoader& persistent_load, const PickleLimits& limits = {});

}  // namespace uckpt
