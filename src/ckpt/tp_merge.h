// DeepSpeed's rules for putting a tensor-parallel (AutoTP) parameter back
// together from its TP ranks' shards, as its converter (ds_to_universal.py's
// merge_tp_slices, DeepSpeed 0.19.8) applies them, planned without I/O: which
// elements of which rank's shard land where in the whole parameter.
//
// The rules come from the model states' `universal_checkpoint_info`
// (docs/deepspeed-releases.md §4): a parameter whose name an `affine_map`
// pattern matches is rebuilt from that map's pieces (every rank holds affine
// views of the whole tensor); otherwise by category, in DeepSpeed's order:
// TP-replicated (every rank holds it whole, and all must agree), else the
// shards concatenated on dim 1 (row-parallel weights) or dim 0 (the rest).
// A vocabulary parameter is then cut to `original_vocab_size` rows.
// Refused, naming the parameter: averaged parameters, sub-parameters (fused
// QKV without an affine map), scaled affine pieces, maps that do not cover
// the parameter exactly once.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "format/value.h"

namespace uckpt::ckpt {

// One block of a parameter held by a rank: `shape` elements at `source_offset`
// with `source_strides` in the whole parameter, at `dest_offset` with
// `dest_strides` in the rank's shard (torch.as_strided's arguments).
struct TpAffinePiece {
  std::vector<int64_t> shape;
  int64_t source_offset = 0, dest_offset = 0;
  std::vector<int64_t> source_strides, dest_strides;
  std::vector<int64_t> locations;  // the ranks holding it (several: replicated)
  double scale = 1.0;              // the shard holds whole * scale
};

struct TpAffineMap {
  std::vector<int64_t> logical_shape;
  // Per rank, in the order the file lists them: its shard's shape and pieces.
  std::vector<std::pair<int64_t, std::vector<int64_t>>> shard_shapes;
  std::vector<std::pair<int64_t, std::vector<TpAffinePiece>>> pieces;
};

// A pattern as Python's re.match applies it (anchored at the start). The
// `^<re.escape(name)>$` patterns AutoTP writes are compared as text.
struct TpPattern {
  std::string text;
  std::optional<std::string> literal;  // the one name it matches, when it is such a pattern
  std::shared_ptr<const std::regex> re;
  bool Matches(const std::string& name) const;
};

// universal_checkpoint_info, as the merge reads it.
struct TpRules {
  std::string where;  // the file and key, for messages
  double version = 0;
  std::vector<TpPattern> replicated, average, row_parallel, vocabulary, two_sub_params_cat_dim_0, sub_params;
  std::optional<int64_t> original_vocab_size;
  std::vector<std::pair<TpPattern, TpAffineMap>> affine;         // pattern -> map
  std::vector<std::pair<std::string, std::string>> unsupported;  // pattern -> reason (AutoTP's own refusals)
  // The category patterns DeepSpeed's strict check requires every one of to
  // match some parameter (affine patterns are not among them).
  std::set<std::string> CategoryPatterns() const;
};

// Parses `info` (the model states' universal_checkpoint_info); `where` names
// it. Throws FormatError naming the key for a value of the wrong type, an
// affine map format newer than version 1, or a pattern std::regex cannot read.
TpRules ReadTpRules(const ValuePtr& info, const std::string& where);

// Shard elements [shard_start, shard_start + length) of TP rank `rank` are the
// whole parameter's (flattened, row-major) [out_start, out_start + length).
struct TpRun {
  int rank = 0;
  int64_t shard_start = 0, out_start = 0, length = 0;
};

struct TpParamMerge {
  std::vector<int64_t> merged_shape;  // the shards put together
  std::vector<int64_t> shape;         // after the vocabulary cut (merged_shape otherwise)
  // In output order, covering [0, numel(merged_shape)) exactly once; the
  // elements past numel(shape) are the cut rows, which DeepSpeed's file still
  // holds in the tensor's storage.
  std::vector<TpRun> runs;
  // Replicated elements read again from the other ranks: each must equal what
  // `runs` put at its out_start (DeepSpeed checks they agree).
  std::vector<TpRun> replicas;
  // The keys DeepSpeed's universal file dict holds before 'param'.
  std::vector<std::pair<std::string, ValuePtr>> universal_keys;
  std::string rule;                // "affine map", "replicated", "cat dim 1", ... (for messages)
  std::set<std::string> patterns;  // the category patterns it used (DeepSpeed's strict check)
};

// The merge of parameter `name` from its shards, `rank_shapes[t]` being TP rank
// t's shape. Throws FormatError naming the parameter when the rules refuse it
// or its shards do not fit them.
TpParamMerge PlanTpMerge(const TpRules& rules, const std::string& name,
                         const std::vector<std::vector<int64_t>>& rank_shapes);

}  // namespace uckpt::ckpt
