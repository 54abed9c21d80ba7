// DeepSpeed AutoTP (tensor-parallel) checkpoints at ZeRO 1/2: each TP rank's
// files (mp_rank_<t>_model_states.pt, *zero_pp_rank_<d>_mp_rank_<t>_optim_states.pt)
// opened as a checkpoint of its own, and every parameter's plan merged into
// the whole parameter with DeepSpeed's rules (ckpt/tp_merge.h), so that
// convert, export, verify and inspect read it as they read a checkpoint
// without TP. The engine, which has no tensor parallelism, refuses it.
#pragma once

#include <string>

#include "ckpt/tag_folder.h"
#include "ckpt/zero_checkpoint.h"

namespace uckpt::ckpt {

// The tensor-parallel degree the folder's file names say: 1 + the largest
// mp_rank of its model-states and optimizer files (1 without any).
int TensorParallelDegree(const TagFolder& folder);

// Opens a folder of `tp_degree` TP ranks: every rank's files are opened
// (OpenTensorParallelRank) and checked against each other (stage, dp, the same
// parameters, checkpoint_parallel_dimensions), and each parameter's state
// pieces are merged across ranks by the universal_checkpoint_info of
// mp_rank_00 (required). Replicated elements are compared across ranks.
// Throws FormatError naming the file or parameter for anything DeepSpeed's
// converter would refuse or that uckpt does not convert (ZeRO-3 with TP,
// pipeline parallelism, sub-parameters without an affine map).
ZeroCheckpoint OpenTensorParallelCheckpoint(const TagFolder& folder, int tp_degree);

// Why a training engine without tensor parallelism cannot load `folder`
// (a tag folder with TP ranks, or a universal folder converted from one,
// whose first model states `model_root` record mp_world_size > 1): the TP
// degree and what to do instead. Empty when it can.
std::string TensorParallelLoadRefusal(const TagFolder& folder, const ValuePtr& model_root);

}  // namespace uckpt::ckpt
