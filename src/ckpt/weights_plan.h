// Loading pretrained weights (a safetensors file or a sharded index,
// format/safetensors.h) into a running engine's partitions: which model
// tensor each file tensor fills (names mapped, missing and unexpected names
// as torch's load_state_dict reports them), and which bytes of which file
// fill which elements of one partition (ckpt/reshard.h's PartitionTarget).
// No I/O here: the reads point into the files' maps.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/reshard.h"
#include "format/safetensors.h"

namespace uckpt::ckpt {

// A file's tensor name -> the model's name; std::nullopt: the tensor is skipped.
using WeightNameMap = std::function<std::optional<std::string>(const std::string&)>;

// A name map that replaces a leading `strip` with `add` (names without it are kept as they are).
WeightNameMap PrefixRule(std::string strip, std::string add);

// One entry of the model's state_dict, in its order: a parameter or buffer,
// or a tied alias (owner != name) of one.
struct ModelTensor {
  std::string name;
  std::string owner;  // the entry holding the tensor (== name unless tied)
  std::vector<int64_t> shape;
};

struct WeightsMatch {
  // Owner name -> the source tensor it is filled from. A tied tensor listed
  // under several names takes the value of the last one the file has, in
  // state_dict order (what load_state_dict's copies in that order leave).
  std::map<std::string, std::string> source_of;
  std::vector<std::string> missing;     // model names the source lacks, state_dict order
  std::vector<std::string> unexpected;  // mapped source names the model lacks, sorted
};

// Matches the source's tensors (names through `map`; null: as they are) to
// the model's. A safetensors file's "__metadata__" entries that name a tensor
// of the file (alias -> kept name, as safetensors' save_model records tied
// weights it stored once) count as that tensor under the alias too. Throws
// FormatError naming the source when two file tensors map to one name, and
// listing every tensor whose shape differs from the model's (as
// load_state_dict does whatever `strict` says).
WeightsMatch MatchWeights(const SafetensorsSource& source, const std::vector<ModelTensor>& model,
                          const WeightNameMap& map);

// What the error of a strict load says: "Missing key(s) ...", "Unexpected key(s) ..."
// (empty when both lists are).
std::string MismatchText(const WeightsMatch& m);

// One read: `from` (elements of a source tensor of dtype `dtype`) fills
// elements [offset, offset + numel) of a partition.
struct WeightRead {
  std::span<const uint8_t> from;
  DType dtype = DType::kFloat32;
  int64_t offset = 0;
  int64_t numel = 0;
};

// The reads that fill `target`'s fragments of the parameters `match` has a
// source for (others are not read; nor is padding). Throws FormatError
// naming the source and parameter when the sizes differ.
std::vector<WeightRead> PlanWeightReads(const SafetensorsSource& source, const WeightsMatch& match,
                                        const PartitionTarget& target);

}  // namespace uckpt::ckpt
