// Protocol-2 pickle writer for torch.save's data.pkl. Emits only the opcodes
// and globals torch.load(weights_only=True) accepts for ordinary values
// (opaque objects are written back as they were read). Shared values are
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
