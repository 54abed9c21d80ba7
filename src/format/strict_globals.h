// The allow-list of strict mode: the classes and functions a pickle may name
// when it is loaded as training state. It is what PyTorch's weights_only=True
// unpickler accepts (tensors, storages, dtypes, plain containers), plus the
// few plain-value builders Python's protocol-2 pickler writes for bytes and
// frozenset, plus the DeepSpeed classes DeepSpeed writes into its checkpoints
// (shared/spec/deepspeed-zero-checkpoint.md §9). docs/security.md lists it.
//
// Nothing on the list is ever imported or called: the reader builds values of
// its own for the names it models and inert objects for the others. The list
// exists so that a checkpoint that names anything else (os.system, eval, a
// class nobody expects in training state) is refused instead of being carried
// along into the files uckpt writes.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace uckpt {

// Whether strict mode accepts the global `path` ("module.name", after the
// Python 2 renames: builtins, not __builtin__). builtins.getattr is not on it:
// the reader accepts it only in the one call DeepSpeed writes,
// StrictAllowsGetattr.
bool StrictAllowsGlobal(std::string_view path);

// getattr(ZeroStageEnum, member): how Python 3.11+ pickles the enum member
// DeepSpeed stores as `zero_stage`. True only for that class and its members.
bool StrictAllowsGetattr(std::string_view class_path, std::string_view attribute);

// Every accepted name, sorted (for docs and tests).
std::vector<std::string> StrictAllowList();

}  // namespace uckpt
