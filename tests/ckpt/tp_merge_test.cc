#include "ckpt/tp_merge.h"

#include <gtest/gtest.h>

#include "ckpt/values.h"
#include "format/error.h"

namespace uckpt::ckpt {
namespace {

ValuePtr StrList(std::initializer_list<const char*> items) {
  std::vector<ValuePtr> v;
  for (const char* s : items) v.push_back(Value::Str(s));
  return Value::List(v);
}

ValuePtr IntList(std::initializer_list<int64_t> items) {
  std::vector<ValuePtr> v;
  for (int64_t i : items) v.push_back(Value::Int(i));
  return Value::List(v);
}

// {'shape', 'source': [offset, strides], 'dest': [offset, strides], 'locations'} as AutoTP writes a piece.
ValuePtr Piece(std::initializer_list<int64_t> shape, int64_t src, std::initializer_list<int64_t> src_strides,
               int64_t dst, std::initializer_list<int64_t> dst_strides, std::initializer_list<int64_t> locations) {
  ValuePtr p = Value::Dict();
  p->set("shape", IntList(shape));
  p->set("source", Value::List({Value::Int(src), IntList(src_strides)}));
  p->set("dest", Value::List({Value::Int(dst), IntList(dst_strides)}));
  p->set("locations", IntList(locations));
  return p;
}

ValuePtr Rank(std::initializer_list<int64_t> shard_shape, std::vector<ValuePtr> pieces) {
  ValuePtr r = Value::Dict();
  r->set("shard_shape", IntList(shard_shape));
  r->set("pieces", Value::List(std::move(pieces)));
  return r;
}

// universal_checkpoint_info with one affine map, for parameter "w".
ValuePtr AffineInfo(std::initializer_list<int64_t> logical, ValuePtr rank0, ValuePtr rank1) {
  ValuePtr ranks = Value::Dict();
  ranks->set(Value::Int(0), rank0);
  ranks->set(Value::Int(1), rank1);
  ValuePtr map = Value::Dict();
  map->set("logical_shape", IntList(logical));
  map->set("ranks", ranks);
  ValuePtr params = Value::Dict();
  params->set("^w$", map);
  ValuePtr affine = Value::Dict();
  affine->set("params", params);
  affine->set("version", Value::Int(1));
  ValuePtr info = Value::Dict();
  info->set("affine_map", affine);
  return info;
}

void ExpectRuns(const std::vector<TpRun>& runs, std::vector<std::array<int64_t, 4>> want) {
  ASSERT_EQ(runs.size(), want.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    EXPECT_EQ(runs[i].rank, want[i][0]) << i;
    EXPECT_EQ(runs[i].shard_start, want[i][1]) << i;
    EXPECT_EQ(runs[i].out_start, want[i][2]) << i;
    EXPECT_EQ(runs[i].length, want[i][3]) << i;
  }
}

// A row-parallel weight [2, 5] split 3 + 2 on dim 1: each row takes rank 0's then rank 1's columns.
TEST(TpMerge, RowParallelInterleavesRows) {
  ValuePtr info = Value::Dict();
  info->set("parameter_with_row_parallelism_patterns", StrList({"^w$"}));
  const TpParamMerge m = PlanTpMerge(ReadTpRules(info, "info"), "w", {{2, 3}, {2, 2}});
  EXPECT_EQ(m.shape, (std::vector<int64_t>{2, 5}));
  ExpectRuns(m.runs, {{0, 0, 0, 3}, {1, 0, 3, 2}, {0, 3, 5, 3}, {1, 2, 8, 2}});
  ASSERT_EQ(m.universal_keys.size(), 1u);
  EXPECT_EQ(m.universal_keys[0].first, "cat_dim");
  EXPECT_EQ(m.universal_keys[0].second->i, 1);
  EXPECT_TRUE(m.patterns.count("^w$"));
}

// No pattern: the shards one after the other (dim 0), unevenly split.
TEST(TpMerge, DefaultConcatenatesOnDim0) {
  const TpParamMerge m = PlanTpMerge(ReadTpRules(Value::Dict(), "info"), "w", {{3, 2}, {2, 2}});
  EXPECT_EQ(m.shape, (std::vector<int64_t>{5, 2}));
  ExpectRuns(m.runs, {{0, 0, 0, 6}, {1, 0, 6, 4}});
  EXPECT_EQ(m.universal_keys[0].second->i, 0);
}

TEST(TpMerge, ReplicatedTakesRankZeroAndComparesTheRest) {
  ValuePtr info = Value::Dict();
  info->set("tp_replicated_parameter_patterns", StrList({"^norm\\.weight$"}));
  const TpParamMerge m = PlanTpMerge(ReadTpRules(info, "info"), "norm.weight", {{4}, {4}});
  ExpectRuns(m.runs, {{0, 0, 0, 4}});
  ExpectRuns(m.replicas, {{1, 0, 0, 4}});
  EXPECT_TRUE(m.universal_keys.empty());
  EXPECT_THROW(PlanTpMerge(ReadTpRules(info, "info"), "norm.weight", {{4}, {3}}), FormatError);
}

// The vocabulary cut: rows past original_vocab_size stay in the runs (DeepSpeed's storage) but
// not in the shape; 'vocab_tensor' follows 'cat_dim'.
TEST(TpMerge, VocabularyIsCutToTheOriginalSize) {
  ValuePtr info = Value::Dict();
  info->set("vocabulary_parameter_patterns", StrList({"^lm_head\\.weight$"}));
  info->set("original_vocab_size", Value::Int(5));
  const TpParamMerge m = PlanTpMerge(ReadTpRules(info, "info"), "lm_head.weight", {{3, 2}, {3, 2}});
  EXPECT_EQ(m.merged_shape, (std::vector<int64_t>{6, 2}));
  EXPECT_EQ(m.shape, (std::vector<int64_t>{5, 2}));
  ExpectRuns(m.runs, {{0, 0, 0, 6}, {1, 0, 6, 6}});
  ASSERT_EQ(m.universal_keys.size(), 2u);
  EXPECT_EQ(m.universal_keys[0].first, "cat_dim");
  EXPECT_EQ(m.universal_keys[1].first, "vocab_tensor");
}

// The affine map of a row split gives the same runs as the category rule, and no keys.
TEST(TpMerge, AffineMapOfARowSplit) {
  ValuePtr info = AffineInfo({2, 5}, Rank({2, 3}, {Piece({2, 3}, 0, {5, 1}, 0, {3, 1}, {0})}),
                             Rank({2, 2}, {Piece({2, 2}, 3, {5, 1}, 0, {2, 1}, {1})}));
  info->set("parameter_with_row_parallelism_patterns", StrList({"^w$"}));
  const TpParamMerge m = PlanTpMerge(ReadTpRules(info, "info"), "w", {{2, 3}, {2, 2}});
  ExpectRuns(m.runs, {{0, 0, 0, 3}, {1, 0, 3, 2}, {0, 3, 5, 3}, {1, 2, 8, 2}});
  EXPECT_TRUE(m.universal_keys.empty());
  EXPECT_EQ(m.rule, "affine map");
  EXPECT_TRUE(m.patterns.count("^w$"));  // the category it supersedes counts as used
}

TEST(TpMerge, AffineReplicatedPieceIsReadOnceAndCompared) {
  ValuePtr info =
      AffineInfo({4}, Rank({4}, {Piece({4}, 0, {1}, 0, {1}, {0, 1})}), Rank({4}, {Piece({4}, 0, {1}, 0, {1}, {0, 1})}));
  const TpParamMerge m = PlanTpMerge(ReadTpRules(info, "info"), "w", {{4}, {4}});
  ExpectRuns(m.runs, {{0, 0, 0, 4}});
  ExpectRuns(m.replicas, {{1, 0, 0, 4}});
}

TEST(TpMerge, RefusesWhatItCannotMerge) {
  // A map leaving the last column uncovered.
  ValuePtr gap = AffineInfo({2, 5}, Rank({2, 3}, {Piece({2, 3}, 0, {5, 1}, 0, {3, 1}, {0})}),
                            Rank({2, 1}, {Piece({2, 1}, 3, {5, 1}, 0, {1, 1}, {1})}));
  EXPECT_THROW(PlanTpMerge(ReadTpRules(gap, "info"), "w", {{2, 3}, {2, 1}}), FormatError);
  // A scaled piece (a pre-divided bias).
  ValuePtr scaled =
      AffineInfo({4}, Rank({4}, {Piece({4}, 0, {1}, 0, {1}, {0, 1})}), Rank({4}, {Piece({4}, 0, {1}, 0, {1}, {0, 1})}));
  Need(Need(Need(Need(scaled, "affine_map", ""), "params", ""), "^w$", ""), "ranks", "")
      ->entries[0]
      .second->get("pieces")
      ->items[0]
      ->set("scale", Value::Float(0.5));
  EXPECT_THROW(PlanTpMerge(ReadTpRules(scaled, "info"), "w", {{4}, {4}}), FormatError);
  // Averaged parameters, and a name two patterns of one list match.
  ValuePtr info = Value::Dict();
  info->set("parameter_to_average_patterns", StrList({"^w$"}));
  info->set("parameter_with_row_parallelism_patterns", StrList({"^v$", "^v"}));
  const TpRules rules = ReadTpRules(info, "info");
  EXPECT_THROW(PlanTpMerge(rules, "w", {{2}, {2}}), FormatError);
  EXPECT_THROW(PlanTpMerge(rules, "v", {{2, 2}, {2, 2}}), FormatError);
}

// re.match semantics: anchored at the start only; regex patterns other than AutoTP's escaped names.
TEST(TpMerge, PatternsMatchAsPythonsReMatch) {
  ValuePtr info = Value::Dict();
  info->set("parameter_with_row_parallelism_patterns", StrList({"layers\\.\\d+\\.o_proj"}));
  const TpRules rules = ReadTpRules(info, "info");
  EXPECT_EQ(PlanTpMerge(rules, "layers.12.o_proj.weight", {{2, 1}, {2, 1}}).rule, "cat dim 1");
  EXPECT_EQ(PlanTpMerge(rules, "model.layers.12.o_proj.weight", {{2, 1}, {2, 1}}).rule, "cat dim 0");
}

}  // namespace
}  // namespace uckpt::ckpt
