// Ranks agreeing on a value only one of them may be trusted for.
#pragma once

#include <string>

#include "uckpt/comm.h"

namespace uckpt::engine {

struct CheckpointPlace {
  std::string dir, tag;
};

// Rank 0's checkpoint folder and tag on every rank, through one broadcast. A
// rank that was given others (a script naming its folder by the clock, say)
// warns on stderr, naming its folder and rank 0's, and uses rank 0's: the
// checkpoint stays whole in one folder. `what` names the call ("save_checkpoint").
// With `tags_must_match` (the config's checkpoint.tag_validation "Fail", as
// DeepSpeed's save), a tag differing on any rank is an error on every rank.
CheckpointPlace AgreeOnCheckpointPlace(Comm& comm, const std::string& dir, const std::string& tag,
                                       const std::string& what, bool tags_must_match = false);

}  // namespace uckpt::engine
