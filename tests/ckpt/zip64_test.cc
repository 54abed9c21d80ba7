// A rank file larger than 4 GiB (zip64 offsets and end records), made of
// cheap pattern data: conversion reads past 4 GiB through the memory map and
// every output byte is the pattern's. (Needs ~9 GB of scratch disk.)
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstring>
#include <filesystem>

#include "ckpt/convert.h"
#include "ckpt/universal_checkpoint.h"
#include "ckpt/zero_writer.h"
#include "format/torch_file.h"
#include "format/zip.h"
#include "test_util.h"

namespace uckpt::ckpt {
namespace {

TEST(Zip64, RankFileOver4GiB) {
  testing::TempDir tmp;
  ZeroWriteSpec s;
  s.stage = 2;
  s.dp = 1;
  s.groups = {{{"a", {3}}, {"big", {540000007}}, {"c", {5}}}};
  s.state_keys = {"exp_avg"};
  s.write_module = false;
  s.source = PatternSource();
  WriteZeroCheckpoint(tmp / "z", s);
  const std::string rank0 = tmp / "z/zero_pp_rank_0_mp_rank_00_optim_states.pt";
  ASSERT_GT(std::filesystem::file_size(rank0), uint64_t{4} << 30);
  {
    ZipReader zip(MappedFile::Open(rank0));
    uint64_t last = 0;
    for (const auto& e : zip.entries()) last = std::max(last, e.data_offset);
    EXPECT_GT(last, uint64_t{4} << 30);  // a record starts past 4 GiB
  }

  ConvertOptions o;
  o.threads = 2;
  o.durable = false;
  ConvertStats st = ConvertToUniversal(tmp / "z", tmp / "u", o);
  EXPECT_EQ(st.params, 3u);
  // Copying 4.3 GB through memory maps kept the resident set small: source
  // pages are dropped as they are written (the bound here would be
  // 2 x 4.3 GB + 256 MiB).
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  EXPECT_LT(ru.ru_maxrss, 256 * 1024) << "peak RSS KiB";
  std::filesystem::remove_all(tmp / "z");  // keep the scratch disk use down

  UniversalCheckpoint u = OpenUniversalCheckpoint(tmp / "u");
  size_t index = 0;
  for (const char* name : {"a", "big", "c"}) {
    for (const char* key : {"fp32", "exp_avg"}) {
      LoadOptions lo;
      lo.verify_crc = true;  // our CRC-32 of every record, end to end
      TorchFile f = LoadTorchFile(tmp / ("u/zero/" + std::string(name) + "/" + key + ".pt"), lo);
      const Tensor& t = *f.root->get("param")->tensor;
      auto bytes = t.contiguous_view();
      ASSERT_EQ(static_cast<int64_t>(bytes.size()), t.numel() * 4);
      int64_t bad = 0;
      for (int64_t e = 0; e < t.numel(); ++e) {
        float v;
        std::memcpy(&v, bytes.data() + 4 * e, 4);
        if (v != PatternValue(index, key, e)) ++bad;
      }
      EXPECT_EQ(bad, 0) << name << " " << key;
    }
    ++index;
  }
}

}  // namespace
}  // namespace uckpt::ckpt
