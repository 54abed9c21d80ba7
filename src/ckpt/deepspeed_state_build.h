// Value builders shared by deepspeed_state.cc (common fields, model states)
// and deepspeed_optim_state.cc (optimizer states). Internal to src/ckpt.
#pragma once

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/deepspeed_state.h"

namespace uckpt::ckpt {

// A dict of `items` in order (an OrderedDict when `ordered`).
ValuePtr Dict(std::initializer_list<std::pair<const char*, ValuePtr>> items, bool ordered = false);
// A DeepSpeed class instance pickled as NEWOBJ + BUILD(state).
ValuePtr NewObject(const std::string& cls, ValuePtr state);
ValuePtr IntList(const std::vector<int64_t>& v);
// An optimizer state's entries as a dict (torch's state[id]).
ValuePtr StateDict(const AdamState& s);

}  // namespace uckpt::ckpt
