// A Comm over a c10d process group that someone else created and owns, such
// as the default group of torch.distributed in the same process, so that the
// engine and the caller share one rendezvous (one store, one port).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <memory>

#include "uckpt/comm.h"

namespace uckpt {

// Collectives run on `pg` (its rank, size and backend); tensors not on
// `device` travel through a copy there (NCCL needs the GPU). The group must
// outlive the Comm; the Comm never shuts it down.
std::unique_ptr<Comm> CommOnProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device,
                                         std::chrono::milliseconds timeout = std::chrono::minutes(30));

}  // namespace uckpt
