// `uckpt train` / `uckpt launch` end to end: processes, files, failures.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli/metrics_log.h"
#include "fixture.h"
#include "ranks.h"

namespace uckpt::engine {
namespace {

namespace fs = std::filesystem;
using cli::Crc32c;
using cli::MaskedCrc32c;
using testing::RefrunDir;

struct Result {
  int code;
  std::string output;
  double seconds;
};

Result Shell(const std::string& cmd) {
  auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int status = pclose(p);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out, s};
}

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("uckpt_cli_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "ds.json") << ReadFile(RefrunDir() + "/runs/z2_ws2_baseline/config.json",
                                                "ds_config_as_passed");
  }
  void TearDown() override { fs::remove_all(dir_); }
  static std::string ReadFile(const std::string& path, const std::string& key) {
    return testing::ReadJson(path)[key].dump();
  }
  std::string Train(const std::string& extra) const {
    return std::string(UCKPT_BIN) + " train --config " + (dir_ / "ds.json").string() +
           " --n_layer 2 --n_head 2 --n_embd 16 --vocab_size 97 --n_positions 16 --seq_len 16 --init " + RefrunDir() +
           "/init.pt --checkpoint_dir " + (dir_ / "ckpt").string() + " --log_dir " + (dir_ / "logs").string() + " " +
           extra;
  }
  fs::path dir_;
};

TEST_F(Cli, LaunchTrainResumeAndLogs) {
  Result a =
      Shell(std::string(UCKPT_BIN) + " launch -n 2 --master_port 0 -- " + Train("--steps 4 --run_name r --timeout 60"));
  ASSERT_EQ(a.code, 0) << a.output;
  EXPECT_EQ(Slurp(dir_ / "ckpt" / "latest"), "global_step4");
  EXPECT_TRUE(fs::exists(dir_ / "ckpt" / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"));
  // Resume in one process straight from the ZeRO files of 2 (resharded while loading)...
  Result direct = Shell(Train("--steps 6 --run_name direct --resume --gradient_accumulation_steps 4"));
  ASSERT_EQ(direct.code, 0) << direct.output;
  // Convert, then resume at world size 1 from the universal checkpoint.
  Result c = Shell(std::string(UCKPT_BIN) + " convert " + (dir_ / "ckpt" / "global_step4").string() + " " +
                   (dir_ / "ckpt" / "global_step4_universal").string());
  ASSERT_EQ(c.code, 0) << c.output;
  Result b = Shell(Train("--steps 6 --run_name r --resume --universal_checkpoint --gradient_accumulation_steps 4"));
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_EQ(Slurp(dir_ / "ckpt" / "latest"), "global_step6");

  // metrics.csv: one header, steps 1..6 (5 and 6 appended by the resumed run).
  std::ifstream csv(dir_ / "logs" / "r" / "metrics.csv");
  std::string line;
  std::getline(csv, line);
  EXPECT_EQ(line, "step,loss,lr,grad_norm,loss_scale,tokens_per_s");
  auto losses = testing::ReadJson(RefrunDir() + "/runs/z2_ws2_baseline/losses.json")["steps"];
  int step = 0;
  while (std::getline(csv, line)) {
    ++step;
    std::stringstream ss(line);
    std::string f[6];
    for (auto& x : f) std::getline(ss, x, ',');
    EXPECT_EQ(std::stoi(f[0]), step);
    double want = losses[std::to_string(step)]["loss"].get<double>();
    EXPECT_NEAR(std::stod(f[1]), want, 1e-6 * want) << line;
    EXPECT_EQ(std::stod(f[2]), losses[std::to_string(step)]["lr_used"].get<double>()) << line;
    EXPECT_GE(f[1].size(), 11u) << "loss printed with >= 9 significant digits: " << line;
  }
  EXPECT_EQ(step, 6);
  // ...logs the same steps 5 and 6 as the resume from the converted checkpoint.
  auto rows = [&](const std::string& run) {
    std::ifstream in(dir_ / "logs" / run / "metrics.csv");
    std::vector<std::string> out;
    for (std::string l; std::getline(in, l);)
      if (l.rfind("5,", 0) == 0 || l.rfind("6,", 0) == 0) out.push_back(l.substr(0, l.rfind(',')));  // not tokens/s
    return out;
  };
  EXPECT_EQ(rows("direct").size(), 2u);
  EXPECT_EQ(rows("direct"), rows("r"));

  // TensorBoard event files: TFRecord framing with valid masked CRC32Cs.
  int files = 0, records = 0;
  for (const auto& e : fs::directory_iterator(dir_ / "logs" / "r")) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) != 0) continue;
    ++files;
    std::string d = Slurp(e.path());
    size_t at = 0;
    while (at < d.size()) {
      ASSERT_LE(at + 12, d.size());
      uint64_t len;
      uint32_t len_crc, data_crc;
      std::memcpy(&len, d.data() + at, 8);
      std::memcpy(&len_crc, d.data() + at + 8, 4);
      EXPECT_EQ(len_crc, MaskedCrc32c(reinterpret_cast<const uint8_t*>(d.data() + at), 8));
      ASSERT_LE(at + 12 + len + 4, d.size());
      std::memcpy(&data_crc, d.data() + at + 12 + len, 4);
      EXPECT_EQ(data_crc, MaskedCrc32c(reinterpret_cast<const uint8_t*>(d.data() + at + 12), len));
      at += 12 + len + 4;
      ++records;
    }
  }
  EXPECT_EQ(files, 2);
  EXPECT_EQ(records, 2 + 6 * 5);  // a version record per file, 5 scalars per step
}

TEST_F(Cli, LaunchStopsEveryRankWhenOneFails) {
  Result r = Shell(std::string(UCKPT_BIN) +
                   " launch -n 3 --grace 2 -- sh -c 'if [ \"$RANK\" = 1 ]; then exit 7; fi; sleep 60'");
  EXPECT_EQ(r.code, 7) << r.output;
  EXPECT_LT(r.seconds, 20);
  EXPECT_NE(r.output.find("rank 1 exited with code 7"), std::string::npos) << r.output;
}

TEST_F(Cli, LaunchHoldsTheRendezvousPortWhileItsRanksRun) {
  // Another program binding MASTER_PORT during the run must fail: had the launcher let the port go,
  // a concurrent job could take it and the ranks would join that job's store.
  Result r = Shell(std::string(UCKPT_BIN) +
                   " launch -n 1 --master_port 0 -- /usr/bin/python3 -c 'import os, socket; "
                   "socket.socket().bind((\"127.0.0.1\", int(os.environ[\"MASTER_PORT\"])))'");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("Address already in use"), std::string::npos) << r.output;
}

TEST_F(Cli, MissingRankEndsWithAClearMessageNotAHang) {
  const ReservedPort reserved;
  const int port = reserved.port();
  Result r = Shell("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " " +
                   Train("--steps 2 --timeout 3"));
  EXPECT_NE(r.code, 0);
  EXPECT_LT(r.seconds, 60);
  EXPECT_NE(r.output.find("rank 0 of 2"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << "no C++ backtrace for users: " << r.output;
}

TEST_F(Cli, ConfigErrorsNameTheFile) {
  std::ofstream(dir_ / "bad.json") << R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3})";
  Result r = Shell(std::string(UCKPT_BIN) + " train --config " + (dir_ / "bad.json").string() + " --steps 1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("train_batch_size 8 is not a multiple of train_micro_batch_size_per_gpu 3"),
            std::string::npos)
      << r.output;
}

TEST(Crc32c, KnownVector) {
  const char* s = "123456789";
  EXPECT_EQ(Crc32c(reinterpret_cast<const uint8_t*>(s), 9), 0xE3069283u);
}

}  // namespace
}  // namespace uckpt::engine
