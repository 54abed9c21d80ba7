// Writes a synthetic DeepSpeed ZeRO checkpoint for bench/convert.sh: a
// GPT-like parameter list (odd-sized embedding, then transformer blocks) of
// about --params elements, fp32 master + Adam moments, cheap pattern data.
//   convert_gen --params 3e8 --dp 4 --stage 2 OUT_TAG_FOLDER
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ckpt/zero_writer.h"

int main(int argc, char** argv) {
  double params = 3e8;
  int dp = 4, stage = 2, hidden = 1024;
  std::string out;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--params" && i + 1 < argc) params = std::atof(argv[++i]);
    else if (a == "--dp" && i + 1 < argc) dp = std::atoi(argv[++i]);
    else if (a == "--stage" && i + 1 < argc) stage = std::atoi(argv[++i]);
    else if (a == "--hidden" && i + 1 < argc) hidden = std::atoi(argv[++i]);
    else out = a;
  }
  if (out.empty() || params < 1 || dp < 1) {
    std::fprintf(stderr, "usage: convert_gen [--params N] [--dp D] [--stage S] [--hidden H] OUT_TAG_FOLDER\n");
    return 2;
  }
  const int64_t h = hidden, target = static_cast<int64_t>(params);
  std::vector<uckpt::ckpt::ZeroParam> group;
  int64_t total = 0;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (total + n > target) shape = {target - total}, n = target - total;  // trim the last one
    if (n <= 0) return false;
    group.push_back({name, shape});
    total += n;
    return total < target;
  };
  bool more = add("wte.weight", {50257, h}) && add("wpe.weight", {1024, h});
  for (int l = 0; more; ++l) {
    std::string p = "h." + std::to_string(l) + ".";
    more = add(p + "ln_1.weight", {h}) && add(p + "ln_1.bias", {h}) && add(p + "attn.c_attn.weight", {h, 3 * h}) &&
           add(p + "attn.c_attn.bias", {3 * h}) && add(p + "attn.c_proj.weight", {h, h}) &&
           add(p + "attn.c_proj.bias", {h}) && add(p + "ln_2.weight", {h}) && add(p + "ln_2.bias", {h}) &&
           add(p + "mlp.c_fc.weight", {h, 4 * h}) && add(p + "mlp.c_fc.bias", {4 * h}) &&
           add(p + "mlp.c_proj.weight", {4 * h, h}) && add(p + "mlp.c_proj.bias", {h});
  }
  uckpt::ckpt::ZeroWriteSpec spec;
  spec.stage = stage;
  spec.dp = dp;
  spec.groups = {group};
  spec.source = uckpt::ckpt::PatternSource();
  uckpt::ckpt::WriteZeroCheckpoint(out, spec);
  std::printf("%s: %zu parameters, %lld elements, world size %d, ZeRO-%d\n", out.c_str(), group.size(),
              static_cast<long long>(total), dp, stage);
  return 0;
}
