#include "ckpt/stage0_names.h"

#include <map>
#include <set>

#include "ckpt/deepspeed_state.h"
#include "format/error.h"

namespace uckpt::ckpt {

namespace {

std::string Stage0ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

[[noreturn]] void Ambiguous(const std::string& path, const std::string& why) {
  throw FormatError(path + ": which parameter each optimizer state id is cannot be told from this stage-0 file " +
                    "(DeepSpeed's does not name them): " + why +
                    "; resume it with the engine, which knows its param groups");
}

}  // namespace

std::vector<std::string> Stage0NamesByShape(const std::vector<std::pair<std::string, std::vector<int64_t>>>& module,
                                            const std::vector<std::vector<std::vector<int64_t>>>& group_shapes,
                                            const std::string& path) {
  std::map<std::vector<int64_t>, std::vector<std::string>> module_by_shape;
  for (const auto& [name, shape] : module) module_by_shape[shape].push_back(name);
  std::map<std::vector<int64_t>, std::set<size_t>> groups_by_shape;
  std::map<std::vector<int64_t>, size_t> states_by_shape;
  for (size_t g = 0; g < group_shapes.size(); ++g)
    for (const auto& shape : group_shapes[g]) {
      groups_by_shape[shape].insert(g);
      ++states_by_shape[shape];
    }
  for (const auto& [shape, groups] : groups_by_shape) {
    if (groups.size() > 1)
      Ambiguous(path, "param groups " + std::to_string(*groups.begin()) + " and " + std::to_string(*groups.rbegin()) +
                          " both hold parameters of shape " + Stage0ShapeText(shape));
    const size_t have = module_by_shape.count(shape) ? module_by_shape[shape].size() : 0;
    if (have != states_by_shape[shape])
      Ambiguous(path, "param group " + std::to_string(*groups.begin()) + " has " +
                          std::to_string(states_by_shape[shape]) + " state(s) of shape " + Stage0ShapeText(shape) +
                          " and the module " + std::to_string(have) +
                          " parameter(s) of it (frozen or tied parameters of a trained shape?)");
  }
  std::map<std::vector<int64_t>, size_t> next;
  std::vector<std::string> names;
  for (const auto& group : group_shapes)
    for (const auto& shape : group) names.push_back(module_by_shape[shape][next[shape]++]);
  return names;
}

std::vector<std::string> Stage0NamesOfFile(const ModelStatesView& v,
                                           const std::vector<std::pair<std::string, std::vector<int64_t>>>& module,
                                           const std::vector<std::vector<int64_t>>& ids, const std::string& path) {
  if (v.fp16_optimizer && v.fp16_optimizer->fused)
    throw FormatError(path + ": optimizer['fp32_groups_flat']: DeepSpeed's FP16_Optimizer keeps one flat master " +
                      "per param group and does not say which parameters it holds; resume it with the engine, " +
                      "which knows its param groups");
  std::vector<std::vector<std::vector<int64_t>>> shapes;
  int64_t expect = 0;
  for (size_t g = 0; g < ids.size(); ++g) {
    shapes.emplace_back();
    for (size_t k = 0; k < ids[g].size(); ++k, ++expect) {
      const std::string where = path + ": optimizer.param_groups[" + std::to_string(g) + "]['params']";
      if (ids[g][k] != expect)
        throw FormatError(where + " lists id " + std::to_string(ids[g][k]) + " where torch numbers " +
                          std::to_string(expect) + " (ids 0..N-1 over the groups in order)");
      if (v.fp16_optimizer) {
        const auto& masters = v.fp16_optimizer->fp32;
        if (g >= masters.size() || k >= masters[g].size())
          throw FormatError(path + ": optimizer['fp32_groups'] has no master for state id " + std::to_string(expect));
        shapes.back().push_back(masters[g][k]->shape);
        continue;
      }
      auto st = v.stage0_state.find(expect);
      if (st == v.stage0_state.end() || st->second.tensors.empty())
        throw FormatError(path + ": optimizer.state[" + std::to_string(expect) +
                          "] holds no tensor of its parameter's shape (a parameter never updated?), so which " +
                          "parameter it is cannot be told; resume it with the engine, which knows its param groups");
      shapes.back().push_back(st->second.tensors[0].second->shape);
    }
  }
  return Stage0NamesByShape(module, shapes, path);
}

}  // namespace uckpt::ckpt
