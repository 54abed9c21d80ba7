// Protocol-2 pickle writer for torch.save's data.pkl. Uses only the opcodes
// torch.load(weights_only=True) accepts (LONG4 only for ints over 255 bytes);
// whether a file loads that way also depends on its values: tensors, dicts,
// lists, tuples, strings, ints and bools load in PyTorch 1.13 and 2.x, while
// 1.13 refuses floats and torch.device, and both refuse sets and opaque
// objects (which are written back as they were read). Shared values are
// memoized, so sharing survives a round trip.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "format/value.h"

namespace uckpt {

struct PickledValue {
  std::string pickle;
  // Storages referenced by the pickle; storage i is saved as record data/<i>.
  std::vector<std::shared_ptr<Storage>> storages;
};

PickledValue PickleForTorch(const ValuePtr& root);

}  // namespace uckpt
