// A pickle virtual machine for protocols 0-5 that never imports or calls
// anything. Calls of known-safe builders (tensor rebuilds, OrderedDict, set,
// bytes, torch.Size, ...) become typed values; every other call becomes an
// inert kObject node. In strict mode a pickle may only name the globals of
// format/strict_globals.h; any other one is a FormatError (docs/security.md).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "format/value.h"

namespace uckpt {

struct PickleLimits {
  size_t max_depth = 1000;          // nesting of containers in the result
  size_t max_stack = 1u << 24;      // values on the VM stack
  size_t max_memo = 1u << 24;       // memo entries
  size_t max_int_bytes = 1u << 14;  // LONG1/LONG4 payload
};

// Which classes and functions a pickle may name.
enum class PicklePolicy : uint8_t {
  kStrict,   // only the allow-list of format/strict_globals.h; others: FormatError naming the global
  kLenient,  // any name; what the reader does not model stays an inert object
};

// The policy used when a caller passes none: kStrict, unless the program
// changed it (the CLI does, for `inspect` and for --no-strict).
PicklePolicy DefaultPicklePolicy();
void SetDefaultPicklePolicy(PicklePolicy policy);

// Turns a persistent id (a tuple for torch files) into a value, or throws.
using PersistentLoader = std::function<ValuePtr(const ValuePtr& pid)>;

// Decodes `data`. `where` names the file/record in error messages. Throws
// FormatError (with the byte offset) on malformed or over-limit input, and in
// strict mode on a global outside the allow-list.
ValuePtr ReadPickle(std::span<const uint8_t> data, const std::string& where, const PersistentLoader& persistent_load,
                    const PickleLimits& limits = {}, PicklePolicy policy = DefaultPicklePolicy());

}  // namespace uckpt
