// DeepSpeed's file names (ckpt/deepspeed_names.h) and each field's encoder
// against its decoder (ckpt/deepspeed_state.h): what is written through the
// torch-file writer reads back through the reader the loads use.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "ckpt/deepspeed_names.h"
#include "ckpt/deepspeed_state.h"
#include "ckpt/torch_out.h"
#include "format/error.h"
#include "format/torch_file.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

using testing::TempDir;

TEST(DeepSpeedNames, TagFolderFilesAsDeepSpeedNamesThem) {
  EXPECT_EQ(ModelStatesFileName(), "mp_rank_00_model_states.pt");
  EXPECT_EQ(Zero3ModelStatesFileName(12), "zero_pp_rank_12_mp_rank_00_model_states.pt");
  EXPECT_EQ(OptimStatesFileName(1, false), "zero_pp_rank_1_mp_rank_00_optim_states.pt");
  EXPECT_EQ(OptimStatesFileName(0, true), "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt");
  EXPECT_EQ(OptimStatesFileNameWithPrefix(3, "fp16_"), "fp16_zero_pp_rank_3_mp_rank_00_optim_states.pt");
}

// The parser reads back every name the makers make.
TEST(DeepSpeedNames, ClassifyFileParsesTheMadeNames) {
  CheckpointFile m = ClassifyFile("d", ModelStatesFileName());
  EXPECT_EQ(m.kind, FileKind::kModelStates);
  EXPECT_EQ(m.mp, 0);
  EXPECT_EQ(m.path, "d/mp_rank_00_model_states.pt");
  CheckpointFile z = ClassifyFile("d", Zero3ModelStatesFileName(10));
  EXPECT_EQ(z.kind, FileKind::kZero3ModelStates);
  EXPECT_EQ(z.dp, 10);
  for (const std::string prefix : {"", "bf16_", "fp16_"}) {
    CheckpointFile o = ClassifyFile("d", OptimStatesFileNameWithPrefix(7, prefix));
    EXPECT_EQ(o.kind, FileKind::kOptimStates) << prefix;
    EXPECT_EQ(o.dp, 7);
    EXPECT_EQ(o.mp, 0);
    EXPECT_EQ(o.prefix, prefix);
  }
}

TEST(DeepSpeedNames, TagFilesAndUniversalLayout) {
  EXPECT_STREQ(TagFileName(false), "latest");
  EXPECT_STREQ(TagFileName(true), "latest_universal");
  EXPECT_EQ(UniversalZeroDir("ck/u"), "ck/u/zero");
  EXPECT_EQ(UniversalParamDir("ck/u", "h.0.w"), "ck/u/zero/h.0.w");
  EXPECT_EQ(UniversalStateFile("ck/u", "h.0.w", "exp_avg"), "ck/u/zero/h.0.w/exp_avg.pt");
  EXPECT_EQ(UniversalStateFile("ck/u", "h.0.w", "fp32"), "ck/u/zero/h.0.w/fp32.pt");
  EXPECT_EQ(UniversalOptimizerStateFile("ck/u"), "ck/u/zero/optimizer_state.pt");
  EXPECT_EQ(UniversalStateKey("exp_avg_sq.pt"), "exp_avg_sq");
  EXPECT_EQ(UniversalStateKey("step.pt"), "step");
  EXPECT_EQ(UniversalStateKey(".pt"), std::nullopt);
  EXPECT_EQ(UniversalStateKey("notes.txt"), std::nullopt);
}

// `v` written as a torch file and read back, as every reader sees it.
class Codec : public ::testing::Test {
 protected:
  ValuePtr Reload(const ValuePtr& v) {
    const std::string path = tmp_ / ("f" + std::to_string(n_++) + ".pt");
    WriteTorchFile(path, v);
    files_.push_back(LoadTorchFile(path));
    return files_.back().root;
  }
  std::string Path() const { return tmp_ / ("f" + std::to_string(n_ - 1) + ".pt"); }

  TempDir tmp_;
  int n_ = 0;
  std::vector<TorchFile> files_;
};

ValuePtr Floats(const std::vector<float>& v, bool requires_grad = false) {
  std::vector<uint8_t> bytes(v.size() * 4);
  if (!v.empty()) std::memcpy(bytes.data(), v.data(), bytes.size());
  ValuePtr t =
      Value::FromTensor(Tensor::FromBytes(DType::kFloat32, {static_cast<int64_t>(v.size())}, std::move(bytes)));
  t->tensor->requires_grad = requires_grad;
  return t;
}

ValuePtr Root(const std::string& key, ValuePtr v) {
  ValuePtr d = Value::Dict();
  d->set(key, std::move(v));
  return d;
}

TEST_F(Codec, ParamShapes) {
  const ParamShapes shapes = {{{"wte.weight", {40, 8}}, {"h.0.bias", {8}}}, {{"ln.w", {}}}};
  ValuePtr root = Reload(Root("param_shapes", ParamShapesValue(shapes)));
  EXPECT_EQ(ReadParamShapes(root, Path()), shapes);
  EXPECT_EQ(ReadRequiredParamShapes(root, Path()), shapes);
  EXPECT_EQ(shapes[0][0].numel(), 320);
  // Stage 0 writes None: nothing for the lenient reader, an error naming the key for the strict one.
  ValuePtr none = Reload(Root("param_shapes", Value::None()));
  EXPECT_TRUE(ReadParamShapes(none, Path()).empty());
  try {
    ReadRequiredParamShapes(none, Path());
    FAIL() << "None param_shapes accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(Path() + ": param_shapes"), std::string::npos) << e.what();
  }
  ValuePtr bad = ParamShapesValue({{{"a", {2}}}});
  bad->items[0]->set("a", Value::Str("2"));
  EXPECT_THROW(ReadParamShapes(Reload(Root("param_shapes", bad)), Path()), FormatError);
}

// Every field of the scaler read back, named in the failure.
void ExpectSameScaler(const LossScalerState& got, const LossScalerState& want) {
  EXPECT_EQ(got.dynamic, want.dynamic);
  EXPECT_EQ(got.cur_scale, want.cur_scale);
  EXPECT_EQ(got.cur_iter, want.cur_iter);
  EXPECT_EQ(got.last_overflow_iter, want.last_overflow_iter);
  EXPECT_EQ(got.scale_factor, want.scale_factor);
  EXPECT_EQ(got.scale_window, want.scale_window);
  EXPECT_EQ(got.min_scale, want.min_scale);
  EXPECT_EQ(got.delayed_shift, want.delayed_shift);
  EXPECT_EQ(got.cur_hysteresis, want.cur_hysteresis);
  EXPECT_EQ(got.consecutive_hysteresis, want.consecutive_hysteresis);
  EXPECT_EQ(got.raise_error_at_min_scale, want.raise_error_at_min_scale);
}

TEST_F(Codec, ZeroStageFragmentAddressHparamsLossScaler) {
  for (int stage = 0; stage <= 3; ++stage)
    EXPECT_EQ(ParseZeroStage(Reload(Root("s", ZeroStageValue(stage)))->get("s"), "s"), stage);
  EXPECT_EQ(ParseZeroStage(nullptr, "s"), 0);  // BF16_Optimizer's files have none

  FragmentAddress a = ReadFragmentAddress(Reload(Root("f", FragmentAddressValue(17, 5)))->get("f"), "f");
  EXPECT_EQ(a.numel, 17);
  EXPECT_EQ(a.start, 5);

  const AdamHparams h{0.25, 0.5, 0.75, 1e-6, 0.125};
  AdamHparams back = ReadAdamHparams(Reload(Root("g", ParamGroupValue(h, {0, 1})))->get("g"), AdamHparams{}, "g");
  EXPECT_EQ(back.lr, h.lr);
  EXPECT_EQ(back.beta1, h.beta1);
  EXPECT_EQ(back.beta2, h.beta2);
  EXPECT_EQ(back.eps, h.eps);
  EXPECT_EQ(back.weight_decay, h.weight_decay);

  LossScalerState s;
  s.dynamic = true;
  s.cur_scale = 1024;
  s.cur_iter = 9;
  s.last_overflow_iter = 3;
  s.scale_window = 50;
  s.cur_hysteresis = 2;
  ExpectSameScaler(ReadLossScaler(Reload(Root("l", LossScalerValue(s)))->get("l"), LossScalerState{}), s);

  // The same scaler from a stage-0 fp16 file's FP16_Optimizer entries: a static one keeps the
  // growth fields it does not save.
  Fp16OptimizerView w;
  w.dynamic = true;
  w.cur_scale = 256;
  w.cur_iter = 12;
  w.last_overflow_iter = 7;
  w.scale_factor = 4;
  w.scale_window = 3;
  LossScalerState from_wrapper = s;  // cur_hysteresis: not the wrapper's, base's
  from_wrapper.cur_scale = 256;
  from_wrapper.cur_iter = 12;
  from_wrapper.last_overflow_iter = 7;
  from_wrapper.scale_factor = 4;
  from_wrapper.scale_window = 3;
  ExpectSameScaler(ReadLossScaler(w, s), from_wrapper);
  w.dynamic = false;
  LossScalerState static_scale = s;
  static_scale.dynamic = false;
  static_scale.cur_scale = 256;
  static_scale.cur_iter = 12;
  ExpectSameScaler(ReadLossScaler(w, s), static_scale);
}

std::vector<std::string> KeysOf(const ValuePtr& dict) {
  std::vector<std::string> out;
  for (const auto& [k, v] : dict->entries) out.push_back(k->s);
  return out;
}

// Each Adam class DeepSpeed 0.14.5 builds keeps its own param-group keys
// (its load_state_dict hands them to that class's step, which reads them),
// and DeepSpeed's own classes count 'step' in an int.
TEST_F(Codec, ParamGroupsAndStepAsEachAdamClassKeepsThem) {
  AdamHparams h{0.25, 0.5, 0.75, 1e-6, 0.125};
  h.bias_correction = false;
  using Keys = std::vector<std::string>;
  const std::vector<std::pair<AdamClass, Keys>> classes{
      {AdamClass::kTorch,
       {"lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable", "params"}},
      {AdamClass::kFusedAdam, {"lr", "bias_correction", "betas", "eps", "weight_decay", "step", "params"}},
      {AdamClass::kCpuAdam, {"lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "params"}}};
  for (const auto& [cls, keys] : classes) {
    h.cls = cls;
    ValuePtr g = Reload(Root("g", ParamGroupValue(h, {0, 1})))->get("g");
    EXPECT_EQ(KeysOf(g), keys);
    AdamHparams back = ReadAdamHparams(g, AdamHparams{}, "g");
    EXPECT_EQ(back.lr, h.lr);
    EXPECT_EQ(back.beta2, h.beta2);
    EXPECT_EQ(back.weight_decay, h.weight_decay);
    if (cls != AdamClass::kTorch) {
      EXPECT_FALSE(g->get("bias_correction")->b);
    }
    AdamState s = AdamStateOfClass({{"step", Floats({3})}, {"exp_avg", Floats({0, 0})}}, cls, 3);
    if (cls == AdamClass::kTorch) {
      EXPECT_TRUE(s[0].second->tensor);
    } else {
      ASSERT_EQ(s[0].second->kind, Kind::kInt);
      EXPECT_EQ(s[0].second->i, 3);
    }
  }
  h.cls = AdamClass::kFusedAdam;  // FusedAdam adds its group's 'step' at its first step
  EXPECT_FALSE(ParamGroupValue(h, {0}, /*stepped=*/false)->get("step"));
  // Betas the config listed stay a list; otherwise the optimizer's default tuple.
  EXPECT_EQ(Reload(Root("g", ParamGroupValue(h, {0})))->get("g")->get("betas")->kind, Kind::kList);
  h.betas_given = false;
  ValuePtr defaults = Reload(Root("g", ParamGroupValue(h, {0})))->get("g");
  EXPECT_EQ(defaults->get("betas")->kind, Kind::kTuple);
  EXPECT_EQ(ReadAdamHparams(defaults, AdamHparams{}, "g").beta2, h.beta2);
  h.betas_given = true;

  // The stage 1/2 writer: DeepSpeed's FusedAdam group and an int step, read back as uckpt reads them.
  RankOptimStates o;
  o.stage = 2;
  OptimGroupState gs;
  gs.fp32 = Floats({1, 2}, true);
  gs.adam =
      AdamStateOfClass({{"step", Floats({5})}, {"exp_avg", Floats({0, 0})}, {"exp_avg_sq", Floats({1, 1})}}, h.cls, 5);
  gs.hparams = h;
  o.groups.push_back(gs);
  RankOptimView v = ReadRankOptimStates(Reload(OptimStatesValue(o)), Path());
  EXPECT_EQ(v.partitions.at(0).state->get("step")->kind, Kind::kInt);
  EXPECT_EQ(ScalarOf(v.partitions.at(0).state->get("step"), "step"), 5);
  EXPECT_EQ(KeysOf(v.param_groups->items.at(0)),
            (Keys{"lr", "bias_correction", "betas", "eps", "weight_decay", "step", "params"}));
}

TEST_F(Codec, Stage12OptimStates) {
  RankOptimStates o;
  o.stage = 2;
  o.dp = 2;
  OptimGroupState g;
  g.fp32 = Floats({1, 2, 3}, true);
  g.adam = {{"step", Value::Int(4)}, {"exp_avg", Floats({0, 0, 0, 0})}, {"exp_avg_sq", Floats({1, 1, 1, 1})}};
  g.padding = 1;
  g.mappings = {{"a", Fragment{0, 1, 2, 0, 3}}};
  o.groups.push_back(g);
  o.scaler.cur_scale = 8;
  ValuePtr root = Reload(OptimStatesValue(o));
  OptimStatesHeader h = ReadOptimStatesHeader(root, Path());
  EXPECT_EQ(h.zero_stage, 2);
  EXPECT_EQ(h.dp, 2);
  RankOptimView v = ReadRankOptimStates(root, Path());
  ASSERT_EQ(v.partitions.size(), 1u);
  EXPECT_EQ(v.partitions[0].fp32->numel(), 3);
  ASSERT_EQ(v.partitions[0].mappings.size(), 1u);
  EXPECT_EQ(v.partitions[0].mappings[0].first, "a");
  EXPECT_EQ(v.partitions[0].mappings[0].second.numel, 3);
  EXPECT_EQ(v.partitions[0].mappings[0].second.start, 0);
  ASSERT_TRUE(v.partitions[0].state);
  EXPECT_EQ(ScalarOf(v.partitions[0].state->get("step"), "step"), 4);
  EXPECT_EQ(ReadLossScaler(v.loss_scaler, LossScalerState{}).cur_scale, 8);
  EXPECT_EQ(ReadAdamHparams(v.param_groups->items.at(0), AdamHparams{}, "g").lr, AdamHparams{}.lr);

  o.bf16_optimizer = true;  // BF16_Optimizer: no zero_stage, no loss scaler
  o.stage = 1;
  ValuePtr bf16 = Reload(OptimStatesValue(o));
  EXPECT_EQ(ReadOptimStatesHeader(bf16, Path()).zero_stage, 0);
  EXPECT_FALSE(ReadRankOptimStates(bf16, Path()).loss_scaler);
}

TEST_F(Codec, Stage3OptimStatesAndUniversalOptimizerState) {
  Stage3RankOptimStates o;
  o.dp = 4;
  o.sub_groups.push_back({Floats({1, 2}, true), {{"step", Value::Float(6)}, {"exp_avg", Floats({0, 0})}}});
  o.sub_groups.push_back({Floats({3}, true), {}});
  o.param_groups.push_back({AdamHparams{}, {0, 1}});
  o.scaler.cur_scale = 2;
  ValuePtr root = Reload(Stage3OptimStatesValue(o));
  const std::string path = Path();
  OptimStatesHeader h = ReadOptimStatesHeader(root, path);
  EXPECT_EQ(h.zero_stage, 3);
  EXPECT_EQ(h.dp, 4);
  RankOptimView v = ReadStage3RankOptimStates(root, path);
  ASSERT_EQ(v.partitions.size(), 2u);
  EXPECT_EQ(v.partitions[0].fp32->numel(), 2);
  EXPECT_EQ(v.partitions[1].fp32->numel(), 1);
  ASSERT_TRUE(v.partitions[0].state);
  EXPECT_FALSE(v.partitions[1].state);  // no state before the first step
  EXPECT_EQ(ReadLossScaler(v.loss_scaler, LossScalerState{}).cur_scale, 2);

  // zero/optimizer_state.pt made from it: the whole state plus param_groups.
  ValuePtr u = Reload(UniversalOptimizerStateValue(root, path, 3, 2, 4));
  UniversalOptimizerStateView uv = ReadUniversalOptimizerStateValue(u, Path());
  EXPECT_EQ(ReadLossScaler(uv.loss_scaler, LossScalerState{}).cur_scale, 2);
  ASSERT_TRUE(uv.param_groups && uv.param_groups->is_seq());
  EXPECT_EQ(uv.param_groups->items.size(), 1u);
  EXPECT_EQ(ParseZeroStage(uv.zero_stage, "zero_stage"), 3);
  ASSERT_TRUE(uv.zero3_step);
  EXPECT_EQ(ScalarOf(uv.zero3_step, "step"), 6);
}

// Where a tree's storages say they live, each distinct storage once.
std::multiset<std::string> StorageLocations(const ValuePtr& v, std::set<const Storage*>* seen) {
  std::multiset<std::string> out;
  if (!v) return out;
  auto add = [&](const std::shared_ptr<Storage>& s) {
    if (s && seen->insert(s.get()).second) out.insert(s->location);
  };
  if (v->tensor) add(v->tensor->storage);
  add(v->storage);
  auto merge = [&](const ValuePtr& c) { out.merge(StorageLocations(c, seen)); };
  for (const ValuePtr& c : v->items) merge(c);
  for (const auto& [k, c] : v->entries) merge(c);
  merge(v->state);
  return out;
}
std::multiset<std::string> StorageLocations(const ValuePtr& v) {
  std::set<const Storage*> seen;
  return StorageLocations(v, &seen);
}

// A GPU run's rank file (storages at "cuda:0"): the universal optimizer_state.pt
// says "cpu" for every tensor, as DeepSpeed's converter (map_location="cpu")
// writes it, at stage 3 (which keeps rank 0's partitions) and 1/2; the rank
// file's own tree is left as it was.
TEST_F(Codec, UniversalOptimizerStateIsOnTheCpu) {
  Stage3RankOptimStates o;
  o.dp = 2;
  ValuePtr shared = Floats({4, 5});  // one storage under two keys stays one
  o.sub_groups.push_back({Floats({1, 2}, true), {{"exp_avg", shared}, {"exp_avg_sq", shared}}});
  o.param_groups.push_back({AdamHparams{}, {0}});
  ValuePtr gpu = WithStorageLocation(Reload(Stage3OptimStatesValue(o)), "cuda:0");
  ASSERT_GE(StorageLocations(gpu).count("cuda:0"), 2u);
  ValuePtr u = UniversalOptimizerStateValue(gpu, Path(), 3, 1, 2);
  const std::multiset<std::string> where = StorageLocations(u);
  EXPECT_EQ(where.count("cuda:0"), 0u);
  EXPECT_EQ(where.count("cpu"), StorageLocations(gpu).size());
  EXPECT_EQ(StorageLocations(gpu).count("cpu"), 0u);  // the input is not changed
  // Reloaded, exp_avg and exp_avg_sq still share their one storage.
  ValuePtr state = Reload(u)->get("optimizer_state_dict")->get("state");
  ASSERT_TRUE(state && state->is_dict() && !state->entries.empty());
  ValuePtr s0 = state->entries[0].second;
  ASSERT_TRUE(s0->get("exp_avg") && s0->get("exp_avg_sq"));
  EXPECT_EQ(s0->get("exp_avg")->tensor->storage, s0->get("exp_avg_sq")->tensor->storage);
}

}  // namespace
}  // namespace uckpt::ckpt
