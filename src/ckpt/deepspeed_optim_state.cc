// What DeepSpeed's optimizer-state files hold (deepspeed_state.h): the ZeRO
// rank files of stages 1-3 and the universal folder's zero/optimizer_state.pt,
// each encoder beside its decoder.
#include <algorithm>
#include <cstring>
#include <set>

#include "ckpt/deepspeed_state.h"
#include "ckpt/deepspeed_state_build.h"
#include "ckpt/values.h"
#include "format/error.h"

namespace uckpt::ckpt {

// The ZeRO optimizers' flag that their last step was skipped (fp16 overflow).
constexpr const char* kOverflowKey = "overflow";

// ---- Optimizer states ----

OptimStatesHeader ReadOptimStatesHeader(const ValuePtr& root, const std::string& path) {
  const std::string w = path + ": optimizer_state_dict";
  ValuePtr osd = Need(root, "optimizer_state_dict", path);
  OptimStatesHeader h;
  h.zero_stage = ParseZeroStage(osd->get("zero_stage"), w + ".zero_stage");
  const std::string where = w + ".partition_count";
  ValuePtr pc = Need(osd, "partition_count", w);
  int64_t dp = -1;
  if (pc->kind == Kind::kInt) {
    dp = pc->i;
  } else {
    for (const auto& v : AsList(pc, where)) {
      int64_t x = AsInt(v, where);
      if (dp >= 0 && x != dp)
        Fail(where, "param groups are partitioned over different sizes (" + std::to_string(dp) + " and " +
                        std::to_string(x) + "); MoE expert groups are not supported");
      dp = x;
    }
  }
  if (dp < 1 || dp > (1 << 20)) Fail(where, "invalid data-parallel size " + std::to_string(dp));
  h.dp = static_cast<int>(dp);
  return h;
}

ValuePtr OptimStatesValue(const RankOptimStates& s) {
  if (s.stage != 1 && s.stage != 2) throw std::invalid_argument("OptimStatesValue: stage 1 or 2");
  ValuePtr state = Value::Dict();
  ValuePtr param_groups = Value::List(), fp32 = Value::List(), paddings = Value::List(), mappings = Value::List();
  for (size_t g = 0; g < s.groups.size(); ++g) {
    const OptimGroupState& gs = s.groups[g];
    const int64_t id = static_cast<int64_t>(g);
    if (!gs.adam.empty()) state->set(Value::Int(id), StateDict(gs.adam));
    param_groups->items.push_back(gs.group ? ParamGroupValue(gs.group, {id})
                                           : ParamGroupValue(gs.hparams, {id}, !gs.adam.empty()));
    fp32->items.push_back(gs.fp32);
    paddings->items.push_back(Value::Int(gs.padding));
    ValuePtr m = Value::Dict(/*ordered=*/true);
    for (const auto& [name, f] : gs.mappings) m->set(name, FragmentAddressValue(f.numel, f.partition_offset));
    mappings->items.push_back(m);
  }
  ValuePtr osd = Value::Dict();
  if (!s.bf16_optimizer) {
    osd->set("loss_scaler", LossScalerValue(s.scaler));
    osd->set("dynamic_loss_scale", Value::Bool(s.scaler.dynamic));
    osd->set(kOverflowKey, Value::Bool(s.overflow));
  }
  osd->set("clip_grad", Value::Float(s.clip_grad));
  osd->set("base_optimizer_state", Dict({{"state", state}, {"param_groups", param_groups}}));
  osd->set("single_partition_of_fp32_groups", fp32);
  if (!s.bf16_optimizer) osd->set("zero_stage", ZeroStageValue(s.stage));
  osd->set("group_paddings", paddings);
  osd->set("partition_count", IntList(std::vector<int64_t>(s.groups.size(), s.dp)));
  osd->set("ds_version", Value::Str(kDeepSpeedVersion));
  osd->set("param_slice_mappings", mappings);
  return Dict({{"optimizer_state_dict", osd},
               {"ds_config", s.ds_config ? s.ds_config : Value::Dict()},
               {"ds_version", Value::Str(kDeepSpeedVersion)}});
}

namespace {
// Partition i: entry i of the fp32 list and the optimizer's state of id i.
PartitionView ReadPartition(const std::vector<ValuePtr>& fp32, const std::string& fp32_list, const ValuePtr& states,
                            const std::string& states_where, size_t i) {
  const std::string at = "[" + std::to_string(i) + "]";
  PartitionView p;
  p.fp32_where = fp32_list + at;
  p.fp32 = &AsTensor(fp32[i], p.fp32_where);
  p.state_where = states_where + at;
  p.state = GetIntKey(states, static_cast<int64_t>(i));
  return p;
}
}  // namespace

RankOptimView ReadRankOptimStates(const ValuePtr& root, const std::string& path) {
  RankOptimView r;
  r.where = path + ": optimizer_state_dict";
  const std::string& w = r.where;
  ValuePtr osd = Need(root, "optimizer_state_dict", path);
  ValuePtr bos = Need(osd, "base_optimizer_state", w);
  if (bos->is_seq())
    Fail(w + ".base_optimizer_state", "is a list: elastic checkpoints (elastic_checkpoint=true) are not supported");
  ValuePtr state = Need(bos, "state", w + ".base_optimizer_state");
  r.param_groups = bos->get("param_groups");
  r.loss_scaler = osd->get("loss_scaler");
  r.partitions_where = w + ".single_partition_of_fp32_groups";
  const auto& fp32 = AsList(Need(osd, "single_partition_of_fp32_groups", w), r.partitions_where);
  const auto& maps = AsList(Need(osd, "param_slice_mappings", w), w + ".param_slice_mappings");
  // DeepSpeed >= 0.19.8 records the padding it puts after each parameter of the
  // flat buffer with zero_optimization.parameter_alignment (all 0 without it).
  if (ValuePtr pads = osd->get("param_alignment_paddings"); pads && !IsNone(pads)) {
    const std::string pw = w + ".param_alignment_paddings";
    for (const auto& group : AsList(pads, pw))
      for (const auto& pad : AsList(group, pw))
        if (!pad || pad->kind != Kind::kInt || pad->i != 0)
          Fail(pw,
               "holds padding between parameters (zero_optimization.parameter_alignment); such flat "
               "buffers are not supported: save with parameter_alignment false");
  }
  if (fp32.size() != maps.size())
    Fail(w, "has " + std::to_string(fp32.size()) + " fp32 partitions but " + std::to_string(maps.size()) +
                " slice mappings");
  for (size_t g = 0; g < fp32.size(); ++g) {
    PartitionView p = ReadPartition(fp32, r.partitions_where, state, w + ".base_optimizer_state.state", g);
    p.mappings_where = w + ".param_slice_mappings[" + std::to_string(g) + "]";
    for (const auto& [name, v] : NamedEntries(maps[g], p.mappings_where))
      p.mappings.emplace_back(name, ReadFragmentAddress(v, p.mappings_where + "['" + name + "']"));
    r.partitions.push_back(std::move(p));
  }
  return r;
}

// DeepSpeedZeroOptimizer_Stage3.state_dict() as its checkpoint holds it.
ValuePtr Stage3OptimStatesValue(const Stage3RankOptimStates& s) {
  ValuePtr state = Value::Dict();
  ValuePtr flat = Value::List();
  bool stepped = false;
  for (size_t i = 0; i < s.sub_groups.size(); ++i) {
    const Stage3SubGroupState& sg = s.sub_groups[i];
    if (!sg.adam.empty()) {
      state->set(Value::Int(static_cast<int64_t>(i)), StateDict(sg.adam));
      stepped = true;
    }
    flat->items.push_back(sg.fp32);
  }
  ValuePtr groups = Value::List();
  for (size_t g = 0; g < s.param_groups.size(); ++g) {
    const auto& [h, ids] = s.param_groups[g];
    const bool own = g < s.param_group_entries.size() && s.param_group_entries[g];
    groups->items.push_back(own ? ParamGroupValue(s.param_group_entries[g], ids) : ParamGroupValue(h, ids, stepped));
  }
  ValuePtr inner = Value::Dict();
  inner->set("state", state);
  inner->set("param_groups", groups);
  ValuePtr osd = Value::Dict();
  osd->set("zero_stage", ZeroStageValue(3));
  osd->set("loss_scaler", LossScalerValue(s.scaler));
  osd->set("dynamic_loss_scale", Value::Bool(s.scaler.dynamic));
  osd->set(kOverflowKey, Value::Bool(s.overflow));
  osd->set("partition_count", Value::Int(s.dp));
  osd->set("optimizer_state_dict", inner);
  osd->set("fp32_flat_groups", flat);
  return Dict({{"optimizer_state_dict", osd},
               {"ds_config", s.ds_config ? s.ds_config : Value::Dict()},
               {"ds_version", Value::Str(kDeepSpeedVersion)}});
}

RankOptimView ReadStage3RankOptimStates(const ValuePtr& root, const std::string& path) {
  RankOptimView r;
  r.where = path + ": optimizer_state_dict";
  const std::string& w = r.where;
  ValuePtr osd = Need(root, "optimizer_state_dict", path);
  r.partitions_where = w + ".fp32_flat_groups";
  const auto& fp32 = AsList(Need(osd, "fp32_flat_groups", w), r.partitions_where);
  ValuePtr inner = Need(osd, "optimizer_state_dict", w);
  ValuePtr state = Need(inner, "state", w + ".optimizer_state_dict");
  r.param_groups = inner->get("param_groups");
  r.loss_scaler = osd->get("loss_scaler");
  for (size_t s = 0; s < fp32.size(); ++s)
    r.partitions.push_back(ReadPartition(fp32, r.partitions_where, state, w + ".optimizer_state_dict.state", s));
  return r;
}

// ---- zero/optimizer_state.pt ----

// DeepSpeed's converter reads the rank file with map_location="cpu" and saves what
// it keeps: a GPU run's tensors (stage 3 keeps rank 0's partitions) say "cpu".
ValuePtr UniversalOptimizerStateValue(const ValuePtr& rank0, const std::string& path, int stage, size_t groups,
                                      int dp) {
  ValuePtr osd = Need(rank0, "optimizer_state_dict", path);
  auto out = Value::Dict();
  if (stage == 3) {
    for (const auto& [k, v] : osd->entries) out->entries.emplace_back(k, v);
    ValuePtr inner = Need(osd, "optimizer_state_dict", path + ": optimizer_state_dict");
    out->set("param_groups", Need(inner, "param_groups", path + ": optimizer_state_dict.optimizer_state_dict"));
    return WithStorageLocation(out, "cpu");
  }
  for (const auto& [k, v] : osd->entries) {
    const std::string key = k && k->kind == Kind::kStr ? k->s : std::string();
    if (key == "base_optimizer_state" || key == "param_slice_mappings" || key == "single_partition_of_fp32_groups")
      continue;
    if (key == "group_paddings") {
      std::vector<ValuePtr> zeros;
      for (size_t g = 0; g < groups; ++g) zeros.push_back(Value::Int(0));
      out->entries.emplace_back(k, Value::List(std::move(zeros)));
    } else if (key == "partition_count" && v && v->is_seq()) {
      std::vector<ValuePtr> counts;
      for (size_t g = 0; g < groups; ++g) counts.push_back(Value::Int(dp));
      out->entries.emplace_back(k, Value::List(std::move(counts)));
    } else {
      out->entries.emplace_back(k, v);
    }
  }
  ValuePtr bos = Need(osd, "base_optimizer_state", path + ": optimizer_state_dict");
  out->set("param_groups", Need(bos, "param_groups", path + ": optimizer_state_dict.base_optimizer_state"));
  return WithStorageLocation(out, "cpu");
}

ValuePtr ReadOptimStatesLossScaler(const ValuePtr& root, const std::string& path) {
  return Need(root, "optimizer_state_dict", path)->get("loss_scaler");
}

std::optional<double> ReadLossScale(const ValuePtr& v) {
  if (!v || v->kind != Kind::kObject || !v->state || !v->state->is_dict()) return std::nullopt;
  ValuePtr s = v->state->get("cur_scale");
  if (!s) return std::nullopt;
  return ScalarOf(s, "loss_scaler.cur_scale");
}

UniversalOptimizerStateView ReadUniversalOptimizerStateValue(const ValuePtr& root, const std::string& path) {
  if (!root || !root->is_dict()) throw FormatError(path + ": is not a dict");
  UniversalOptimizerStateView v{root->get("loss_scaler"), root->get("param_groups"), std::nullopt,
                                root->get("zero_stage"), nullptr};
  if (ValuePtr overflow = root->get(kOverflowKey)) {
    if (overflow->kind != Kind::kBool) throw FormatError(path + ": '" + kOverflowKey + "' is not a bool");
    v.overflow = overflow->b;
  }
  ValuePtr inner = root->get("optimizer_state_dict");
  ValuePtr state = inner && inner->is_dict() ? inner->get("state") : nullptr;
  ValuePtr first = GetIntKey(state, 0);
  if (first && first->is_dict()) v.zero3_step = first->get(kStep);
  return v;
}

}  // namespace uckpt::ckpt
