// The dmuon command-line tool, run as a user would: `dmuon train` on 2 local ranks, and its
// bad-input cases (clear message, non-zero exit, never a hang).
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <sys/socket.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>
#include <thread>

#include "dmuon/checkpoint.h"
#include "dmuon/safetensors.h"
#include "support/temp_dir.h"

namespace {

struct Result {
  int status = -1;
  std::string output;
};

std::string cli() {
  const char* p = std::getenv("DMUON_CLI");
  return p ? p : "dmuon";
}

// Runs a shell command with a hard time limit (coreutils `timeout`), capturing stdout+stderr.
Result run(const std::string& args, int limit_s = 240, const std::string& env = "") {
  const std::string cmd = env + " timeout -k 5 " + std::to_string(limit_s) + " " + cli() + " " + args + " 2>&1";
  Result r;
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return r;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), f)) r.output.append(buf.data(), n);
  const int st = pclose(f);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string temp_dir() { return dmuon::testing::fresh_temp_dir("dmuon-cli"); }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

TEST(CliTest, TrainOnTwoRanksWritesLogPictureAndSummaryAndLossFalls) {
  const std::string out = temp_dir();
  const Result r = run("train --ranks 2 --steps 30 --batch 8 --seq-len 32 --d-model 64 --layers 2 --log-every 10 "
                       "--out " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("step 30/30"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("summary (2 ranks"), std::string::npos) << r.output;
  // metrics.csv: header + one row per step, loss is the global-batch mean
  std::ifstream csv(out + "/metrics.csv");
  ASSERT_TRUE(csv.good());
  std::string header;
  std::getline(csv, header);
  EXPECT_EQ(header.rfind("step,loss,", 0), 0u) << header;
  int rows = 0;
  double first = 0, last = 0;
  for (std::string line; std::getline(csv, line);) {
    std::stringstream ss(line);
    std::string step, loss;
    std::getline(ss, step, ',');
    std::getline(ss, loss, ',');
    if (rows == 0) first = std::stod(loss);
    last = std::stod(loss);
    ++rows;
  }
  EXPECT_EQ(rows, 30);
  EXPECT_LT(last, first - 1.0) << "the loss did not fall";
  std::ifstream js(out + "/summary.json");
  ASSERT_TRUE(js.good());
  const nlohmann::json s = nlohmann::json::parse(js);
  EXPECT_EQ(s["world_size"], 2);
  EXPECT_LT(s["final_loss"].get<double>(), s["first_loss"].get<double>());
  EXPECT_GT(s["unigram_baseline"].get<double>(), 2.0);
  EXPECT_NEAR(s["muon_bytes_per_step"]["measured_over_formula"].get<double>(), 1.0, 1e-3);
  EXPECT_EQ(s["ns_load_ms"]["per_rank"].size(), 2u);
  // peak live tensor bytes per rank (the counting allocator), overall and by phase; deferred
  // construction keeps setup below the forward/backward working set
  ASSERT_EQ(s["peak_memory_bytes"].size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const auto peak = s["peak_memory_bytes"][r].get<int64_t>();
    EXPECT_GT(peak, 0);
    for (const char* ph : {"setup", "forward", "backward", "step"}) {
      EXPECT_GT(s["peak_memory_by_phase"][ph][r].get<int64_t>(), 0) << ph;
      EXPECT_LE(s["peak_memory_by_phase"][ph][r].get<int64_t>(), peak) << ph;
    }
    EXPECT_LT(s["peak_memory_by_phase"]["setup"][r].get<int64_t>(), s["peak_memory_by_phase"]["backward"][r].get<int64_t>());
  }
  std::ifstream svg(out + "/loss.svg");
  std::stringstream sv;
  sv << svg.rdbuf();
  EXPECT_NE(sv.str().find("<polyline"), std::string::npos);
  EXPECT_NE(sv.str().find("unigram"), std::string::npos);
  std::filesystem::remove_all(out);
}

TEST(CliTest, SameDataAcrossRankCountsGivesTheSameLossCurve) {
  const std::string o1 = temp_dir(), o2 = temp_dir(), o3 = temp_dir();
  // float64 end to end: the runs differ only by float64 reduction order (bound 1e-10 relative)
  const std::string common = "train --param-dtype fp64 --steps 5 --batch 4 --seq-len 16 --d-model 32 --layers 2 --out ";
  ASSERT_EQ(run(common + o1 + " --ranks 1").status, 0);
  ASSERT_EQ(run(common + o2 + " --ranks 2 --mode z2").status, 0);
  // tensor parallelism: 2 data-parallel x 2 TP ranks see the same sequences and start from the same init
  const Result tp = run(common + o3 + " --ranks 4 --tp 2");
  ASSERT_EQ(tp.status, 0) << tp.output;
  EXPECT_NE(tp.output.find("(tensor parallel 2)"), std::string::npos) << tp.output;
  auto losses = [](const std::string& dir) {
    std::ifstream csv(dir + "/metrics.csv");
    std::string line;
    std::getline(csv, line);
    std::vector<double> v;
    while (std::getline(csv, line)) v.push_back(std::stod(line.substr(line.find(',') + 1)));
    return v;
  };
  const auto a = losses(o1), b = losses(o2), c = losses(o3);
  ASSERT_EQ(a.size(), 5u);
  ASSERT_EQ(b.size(), 5u);
  ASSERT_EQ(c.size(), 5u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], 1e-10 * a[i]) << "step " << i + 1;
    EXPECT_NEAR(a[i], c[i], 1e-10 * a[i]) << "step " << i + 1 << " (--tp 2)";
  }
  for (const auto& o : {o1, o2, o3}) std::filesystem::remove_all(o);
}

TEST(CliTest, ClipGradLogsTheNormAndClips) {
  const std::string out = temp_dir();
  const Result r = run("train --ranks 2 --clip-grad 0.01 --steps 4 --batch 4 --seq-len 16 --d-model 32 --layers 1 "
                       "--out " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("clipped to 0.01"), std::string::npos) << r.output;
  std::ifstream js(out + "/summary.json");
  const nlohmann::json s = nlohmann::json::parse(js);
  EXPECT_GT(s["grad_norm"]["first"].get<double>(), 0.01);
  EXPECT_DOUBLE_EQ(s["grad_norm"]["clipped_fraction"].get<double>(), 1.0);
  std::ifstream csv(out + "/metrics.csv");
  std::string header;
  std::getline(csv, header);
  EXPECT_NE(header.find(",grad_norm"), std::string::npos) << header;
  std::filesystem::remove_all(out);
}

TEST(CliTest, HsdpWithShardedBaseParamsTrains) {
  const std::string out = temp_dir();
  const Result r = run("train --ranks 4 --replicate 2 --shard-base --steps 12 --batch 8 --seq-len 16 --d-model 32 "
                       "--layers 2 --out " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("HSDP 2 x 2"), std::string::npos) << r.output;
  std::ifstream js(out + "/summary.json");
  const nlohmann::json s = nlohmann::json::parse(js);
  EXPECT_LT(s["final_loss"].get<double>(), s["first_loss"].get<double>());
  EXPECT_NEAR(s["muon_bytes_per_step"]["measured_over_formula"].get<double>(), 1.0, 0.05);
  std::filesystem::remove_all(out);
}

TEST(CliTest, Bf16ComputeTrains) {
  const std::string out = temp_dir();
  const Result r = run("train --ranks 2 --param-dtype bf16 --steps 12 --batch 8 --seq-len 16 --d-model 32 "
                       "--layers 2 --out " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("bf16 compute (fp32 masters)"), std::string::npos) << r.output;
  std::ifstream js(out + "/summary.json");
  const nlohmann::json s = nlohmann::json::parse(js);
  EXPECT_TRUE(std::isfinite(s["final_loss"].get<double>()));
  EXPECT_LT(s["final_loss"].get<double>(), s["first_loss"].get<double>());
  // measured bytes vs. the bf16 plan (Z3: two broadcasts and one reduce per step): the broadcasts
  // move bf16; Gloo cannot sum bf16, so there the reduce moves an fp32 copy: (2 + 2 + 4) / (2 + 2 + 2);
  // dmuon's store backend (LibTorch without Gloo) reduces bf16 itself: 1
  const bool gloo = s["process_group_backend"].get<std::string>() == "gloo";
  EXPECT_NEAR(s["muon_bytes_per_step"]["measured_over_formula"].get<double>(), gloo ? 4.0 / 3.0 : 1.0, 0.05);
  std::filesystem::remove_all(out);
}

// step,loss,... rows of metrics.csv: step -> loss
std::map<int, double> losses_of(const std::string& dir) {
  std::ifstream f(dir + "/metrics.csv");
  std::string line;
  std::getline(f, line);  // header
  std::map<int, double> out;
  while (std::getline(f, line)) {
    std::stringstream ss(line);
    std::string step, loss;
    std::getline(ss, step, ',');
    std::getline(ss, loss, ',');
    out[std::stoi(step)] = std::stod(loss);
  }
  return out;
}

TEST(CliTest, LossScalingTrainsLikeTheUnscaledRunAndReportsTheScale) {
  // float64 and the power-of-two scale 2^16: the scaled gradients unscale exactly, so the loss curve is the
  // unscaled run's (bound 1e-12 relative); the clip sees the unscaled norm
  const std::string o1 = temp_dir(), o2 = temp_dir();
  const std::string common = "train --ranks 2 --param-dtype fp64 --clip-grad 0.5 --steps 4 --batch 4 --seq-len 16 "
                             "--d-model 32 --layers 1 --out ";
  const Result off = run(common + o1 + " --loss-scale off");
  ASSERT_EQ(off.status, 0) << off.output;
  EXPECT_EQ(off.output.find("loss scale  "), std::string::npos) << off.output;
  const Result on = run(common + o2 + " --loss-scale dynamic");
  ASSERT_EQ(on.status, 0) << on.output;
  EXPECT_NE(on.output.find("loss scale      65536.0 at the end"), std::string::npos) << on.output;
  EXPECT_NE(on.output.find("0 step(s) skipped for an inf / NaN gradient"), std::string::npos) << on.output;
  std::ifstream js(o2 + "/summary.json");
  const nlohmann::json s = nlohmann::json::parse(js);
  EXPECT_EQ(s["loss_scale"]["final"].get<double>(), 65536.0);
  EXPECT_EQ(s["loss_scale"]["skipped_steps"].get<int>(), 0);
  const auto a = losses_of(o1), b = losses_of(o2);
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (const auto& [step, loss] : a) EXPECT_NEAR(b.at(step), loss, 1e-12 * loss) << "step " << step;
  const Result bad = run(common + o1 + " --loss-scale static");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("--loss-scale"), std::string::npos) << bad.output;
  for (const auto& o : {o1, o2}) std::filesystem::remove_all(o);
}

TEST(CliTest, CheckpointsKeepTheLossScaleAndAResumeGoesOnFromIt) {
  // float64: no overflow, so with a growth interval of 2 the scale doubles every 2nd step; the straight run
  // of 8 steps ends at 2^10 x 2^4. A resume at step 3 that restarted the scaler would end at 2^10 x 2^2,
  // one that dropped the growth tracker (1 at step 3) at 2^10 x 2^3. Power-of-two scales: the losses are
  // the straight run's (1e-10 relative, as every resume test).
  const std::string straight = temp_dir(), first = temp_dir(), second = temp_dir();
  const std::string common = " --param-dtype fp64 --batch 12 --seq-len 16 --d-model 32 --layers 1 --log-every 1 "
                             "--loss-scale dynamic --loss-scale-init 1024 --loss-scale-growth-interval 2";
  Result r = run("train --ranks 2 --steps 8" + common + " --out " + straight);
  ASSERT_EQ(r.status, 0) << r.output;
  r = run("train --ranks 2 --steps 3" + common + " --checkpoint " + first + "/ck.safetensors --out " + first);
  ASSERT_EQ(r.status, 0) << r.output;
  r = run("train --ranks 3 --steps 8" + common + " --resume " + first + "/ck.safetensors --out " + second);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loss scale from the checkpoint: 2048 after 1 clean step(s) in a row"), std::string::npos)
      << r.output;
  for (const auto& o : {straight, second}) {
    std::ifstream js(o + "/summary.json");
    EXPECT_EQ(nlohmann::json::parse(js)["loss_scale"]["final"].get<double>(), 16384.0) << o;
  }
  const auto a = losses_of(straight), b = losses_of(second);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 5u);
  for (int step = 4; step <= 8; ++step) EXPECT_NEAR(b.at(step), a.at(step), 1e-10 * a.at(step)) << "step " << step;
  // a smaller growth interval than the checkpoint's run: it grows at the next clean step (2048 -> 4096 at 4)
  r = run("train --ranks 2 --steps 4 --param-dtype fp64 --batch 12 --seq-len 16 --d-model 32 --layers 1 "
          "--loss-scale dynamic --loss-scale-growth-interval 1 --resume " + first + "/ck.safetensors --out " + second);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("(>= --loss-scale-growth-interval: it grows at the next clean step)"), std::string::npos)
      << r.output;
  {
    std::ifstream js(second + "/summary.json");
    EXPECT_EQ(nlohmann::json::parse(js)["loss_scale"]["final"].get<double>(), 4096.0);
  }
  // bad values are errors before anything runs
  r = run("train --ranks 1 --steps 1 --loss-scale dynamic --loss-scale-init 0 --out " + second);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--loss-scale-init must be a finite number > 0"), std::string::npos) << r.output;
  r = run("train --ranks 1 --steps 1 --loss-scale dynamic --loss-scale-growth-interval 0 --out " + second);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--loss-scale-growth-interval must be >= 1"), std::string::npos) << r.output;
  for (const auto& o : {straight, first, second}) std::filesystem::remove_all(o);
}

TEST(CliTest, CheckpointResumesOnAnotherNumberOfRanks) {
  const std::string straight = temp_dir(), first = temp_dir(), second = temp_dir();
  const std::string common = " --param-dtype fp64 --batch 12 --seq-len 16 --d-model 32 --layers 2 --log-every 1";
  Result r = run("train --ranks 2 --steps 6" + common + " --out " + straight);
  ASSERT_EQ(r.status, 0) << r.output;
  r = run("train --ranks 2 --steps 3" + common + " --checkpoint " + first + "/ck.pt --out " + first);
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_TRUE(std::filesystem::is_regular_file(first + "/ck.pt"));
  r = run("train --ranks 3 --steps 6" + common + " --resume " + first + "/ck.pt --out " + second);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + first + "/ck.pt at step 3"), std::string::npos) << r.output;
  const auto a = losses_of(straight), b = losses_of(second);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 3u);
  for (int step = 4; step <= 6; ++step)
    EXPECT_NEAR(b.at(step), a.at(step), 1e-10 * a.at(step)) << "step " << step << " after resuming on 3 ranks";
  r = run("train --ranks 2 --steps 3" + common + " --resume " + first + "/ck.pt --out " + second);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("the checkpoint is at step 3, so --steps 3 leaves nothing to do"), std::string::npos)
      << r.output;
  for (const auto& d : {straight, first, second}) std::filesystem::remove_all(d);
}

TEST(CliTest, CheckpointOfATensorParallelRunResumesWithoutTpAndBack) {
  const std::string straight = temp_dir(), first = temp_dir(), second = temp_dir(), third = temp_dir();
  const std::string common = " --param-dtype fp64 --batch 8 --seq-len 16 --d-model 32 --layers 2 --log-every 1";
  Result r = run("train --ranks 2 --steps 6" + common + " --out " + straight);
  ASSERT_EQ(r.status, 0) << r.output;
  // 2 data-parallel x 2 TP ranks write full tensors; 2 ranks without TP resume them; and back
  r = run("train --ranks 4 --tp 2 --steps 3" + common + " --checkpoint " + first + "/ck.pt --out " + first);
  ASSERT_EQ(r.status, 0) << r.output;
  r = run("train --ranks 2 --steps 5" + common + " --resume " + first + "/ck.pt --checkpoint " + second +
          "/ck.pt --out " + second);
  ASSERT_EQ(r.status, 0) << r.output;
  r = run("train --ranks 4 --tp 2 --steps 6" + common + " --resume " + second + "/ck.pt --out " + third);
  ASSERT_EQ(r.status, 0) << r.output;
  const auto a = losses_of(straight), b = losses_of(second), c = losses_of(third);
  for (int step = 4; step <= 5; ++step) EXPECT_NEAR(b.at(step), a.at(step), 1e-10 * a.at(step)) << "step " << step;
  EXPECT_NEAR(c.at(6), a.at(6), 1e-10 * a.at(6)) << "step 6 after resuming with --tp 2";
  for (const auto& d : {straight, first, second, third}) std::filesystem::remove_all(d);
}

// ---- issue 34: nothing silently wrong --------------------------------------------------------------
const std::string kTiny = " --ranks 1 --batch 2 --seq-len 16 --d-model 32 --layers 1 --heads 4 --log-every 1";

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Rewrites a safetensors checkpoint as another tool would: `edit` changes its tensors and metadata,
// then the "crc32c" table is recomputed (as a careful forger would) unless `keep_crc` is false.
void rewrite_checkpoint(const std::string& path,
                        const std::function<void(dmuon::SafetensorsDict&, std::map<std::string, std::string>&)>& edit,
                        bool recompute_crc = true) {
  dmuon::SafetensorsDict t;
  std::map<std::string, std::string> meta;
  {
    const dmuon::SafetensorsFile f(path);
    t = f.load_all();
    meta = f.metadata();
  }
  edit(t, meta);
  if (recompute_crc && meta.count("crc32c")) {
    nlohmann::json sums = nlohmann::json::object();
    for (const auto& [k, v] : t) {
      const at::Tensor c = v.contiguous();
      sums[k] = dmuon::checkpoint_crc32c(c.data_ptr(), c.nbytes());
    }
    for (const char* k : {"optimizer", "user"})
      if (meta.count(k)) sums[k] = dmuon::checkpoint_crc32c(meta[k].data(), meta[k].size());
    meta["crc32c"] = sums.dump();
  }
  dmuon::save_safetensors(path, t, meta);
}

int64_t csv_rows(const std::string& path, std::vector<std::string>* lr_column = nullptr) {
  std::ifstream csv(path);
  std::string line;
  int64_t n = 0;
  std::getline(csv, line);
  while (std::getline(csv, line)) {
    ++n;
    if (lr_column) {
      std::stringstream ss(line);
      std::string cell;
      for (int i = 0; i < 3; ++i) std::getline(ss, cell, ',');
      lr_column->push_back(cell);
    }
  }
  return n;
}

// Item 1: a checkpoint's hyperparameters are checked as the command line's; a given --lr overrides.
TEST(CliTest, ResumeChecksTheCheckpointsHyperparametersAndLogsOverrides) {
  const std::string d = temp_dir(), ck = d + "/ck.safetensors", bad = d + "/bad.safetensors";
  Result r = run("train --steps 2" + kTiny + " --checkpoint " + ck + " --out " + d);
  ASSERT_EQ(r.status, 0) << r.output;
  std::filesystem::copy_file(ck, bad);
  rewrite_checkpoint(bad, [](dmuon::SafetensorsDict&, std::map<std::string, std::string>& meta) {
    auto j = nlohmann::json::parse(meta.at("optimizer"));
    j["param_groups"][0]["lr"] = -1;
    meta["optimizer"] = j.dump();
  });
  r = run("train --steps 4" + kTiny + " --resume " + bad + " --out " + d + "/b");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("param_groups[0] ('default', Muon) has lr: -1. Must be >= 0."), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << "a C++ backtrace: " << r.output;
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"--lr -1", "--lr: -1. Must be >= 0."},
           {"--lr inf", "--lr: inf. Must be a finite number >= 0."},
           {"--adamw-lr inf", "--adamw-lr: inf. Must be a finite number >= 0."},
           {"--weight-decay nan", "--weight-decay: nan. Must be a finite number >= 0."}}) {
    r = run("train --steps 2" + kTiny + " " + args + " --out " + d + "/c", 60);
    EXPECT_EQ(r.status, 1) << args << ": " << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << args << ": " << r.output;
  }
  // --lr on resume is applied and said, never ignored
  r = run("train --steps 4" + kTiny + " --lr 0.01 --resume " + ck + " --out " + d);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--lr 0.01 overrides the checkpoint's Muon learning rate 0.02"), std::string::npos) << r.output;
  // the kept rate is said as the checkpoint's, the overridden one is not
  EXPECT_NE(r.output.find("AdamW learning rate from the checkpoint: "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("learning rates from the checkpoint"), std::string::npos) << r.output;
  std::vector<std::string> lrs;
  ASSERT_EQ(csv_rows(d + "/metrics.csv", &lrs), 4);
  EXPECT_EQ(lrs[1], "0.02");
  EXPECT_EQ(lrs[3], "0.01");
  std::filesystem::remove_all(d);
}

// Item 2: a checkpoint missing optimizer state (or its checksums) does not load silently.
TEST(CliTest, ResumeRefusesMissingOptimizerStateAndUncheckedFiles) {
  const std::string d = temp_dir(), ck = d + "/ck.safetensors", bad = d + "/bad.safetensors";
  Result r = run("train --steps 2" + kTiny + " --checkpoint " + ck + " --out " + d);
  ASSERT_EQ(r.status, 0) << r.output;
  std::filesystem::copy_file(ck, bad);
  rewrite_checkpoint(bad, [](dmuon::SafetensorsDict& t, std::map<std::string, std::string>&) {
    for (auto it = t.begin(); it != t.end();) it = it->first.rfind("optim_", 0) == 0 ? t.erase(it) : std::next(it);
  });
  r = run("train --steps 4" + kTiny + " --resume " + bad + " --out " + d + "/b");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("the state dict is at step 2 but holds no optimizer state for"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("resumed from"), std::string::npos) << r.output;
  // one parameter's AdamW moments removed
  std::filesystem::copy_file(ck, bad, std::filesystem::copy_options::overwrite_existing);
  rewrite_checkpoint(bad, [](dmuon::SafetensorsDict& t, std::map<std::string, std::string>&) {
    for (const char* f : {".exp_avg", ".exp_avg_sq", ".step"}) t.erase(std::string("optim_adamw/final_norm.weight") + f);
  });
  r = run("train --steps 4" + kTiny + " --resume " + bad + " --out " + d + "/b");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("'final_norm.weight (AdamW exp_avg, exp_avg_sq)'"), std::string::npos) << r.output;
  // no "crc32c" (another tool's file): refused unless allowed, and then said
  std::filesystem::copy_file(ck, bad, std::filesystem::copy_options::overwrite_existing);
  rewrite_checkpoint(bad, [](dmuon::SafetensorsDict&, std::map<std::string, std::string>& meta) { meta.erase("crc32c"); });
  r = run("train --steps 4" + kTiny + " --resume " + bad + " --out " + d + "/b");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("has no \"crc32c\" metadata"), std::string::npos) << r.output;
  r = run("train --steps 3" + kTiny + " --resume " + bad + " --allow-unverified-checkpoint --out " + d + "/b");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("loaded unverified"), std::string::npos) << r.output;
  std::filesystem::remove_all(d);
}

// Item 3: non-finite or absurd weights and config values are refused at load time, naming them.
// A rank that cannot read --resume (its host's copy missing or damaged) fails every rank at once: under torchrun
// on several hosts no launcher stops the others, which would wait in the load's collectives until --timeout
// (here 300 s, beyond the 120 s each rank is given). Both ranks run as torchrun starts them (RANK, WORLD_SIZE).
TEST(CliTest, AResumeOneRankCannotReadFailsEveryRankAtOnce) {
  const std::string d = temp_dir(), ck = d + "/ck.pt";
  Result r = run("train --steps 2" + kTiny + " --checkpoint " + ck + " --out " + d);
  ASSERT_EQ(r.status, 0) << r.output;
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  ::close(fd);
  const auto rank_env = [&](int rank) {
    return "RANK=" + std::to_string(rank) + " LOCAL_RANK=" + std::to_string(rank) +
           " WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " DMUON_TEST_FAIL_AT=1:resume";
  };
  const std::string args = "train --steps 4 --batch 2 --seq-len 16 --d-model 32 --layers 1 --heads 4 --timeout 300 "
                           "--resume " + ck + " --out " + d + "/b";
  Result r1;
  std::thread other([&] { r1 = run(args, 120, rank_env(1)); });
  const Result r0 = run(args, 120, rank_env(0));
  other.join();
  EXPECT_NE(r1.status, 0) << r1.output;
  EXPECT_NE(r1.output.find("rank 1: reading --resume " + ck + " failed: injected read failure"), std::string::npos)
      << r1.output;
  EXPECT_NE(r0.status, 0) << r0.output;
  EXPECT_NE(r0.status, 124) << "rank 0 waited for the timeout: " << r0.output;
  EXPECT_NE(r0.output.find("rank 0: reading --resume " + ck + ": failed on rank(s) 1: rank 1: injected read failure"),
            std::string::npos)
      << r0.output;
  std::filesystem::remove_all(d);
}

TEST(CliTest, NonFiniteWeightsAndConfigValuesAreRefusedNamingThem) {
  const std::string d = temp_dir(), w = d + "/w.safetensors", ck = d + "/ck.safetensors";
  Result r = run("train --steps 1" + kTiny + " --export-safetensors " + w + " --checkpoint " + ck + " --out " + d);
  ASSERT_EQ(r.status, 0) << r.output;
  const dmuon::SafetensorsDict good = dmuon::SafetensorsFile(w).load_all();
  for (const double v : {std::nan(""), 1e30}) {
    dmuon::SafetensorsDict t = good;
    t.at("layers.0.q_proj.weight").view(-1)[3] = v;
    dmuon::save_safetensors(d + "/bad.safetensors", t);
    r = run("train --steps 2" + kTiny + " --init-from " + d + "/bad.safetensors --out " + d + "/b");
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("tensor 'layers.0.q_proj.weight' holds"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << "trained on damaged weights: " << r.output;
  }
  rewrite_checkpoint(ck, [](dmuon::SafetensorsDict& t, std::map<std::string, std::string>&) {
    t.at("model/layers.0.q_proj.weight").view(-1)[0] = INFINITY;
  });
  r = run("train --steps 2" + kTiny + " --resume " + ck + " --out " + d + "/c");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("tensor 'layers.0.q_proj.weight' holds 1 NaN or infinite value(s)"), std::string::npos)
      << r.output;
  const std::string cfg = R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 1, "num_attention_heads": 4)";
  for (const auto& [extra, want] : std::vector<std::pair<std::string, std::string>>{
           {R"(, "rms_norm_eps": -1})", "rms_norm_eps -1 must be in (0, 1)"},
           {R"(, "rope_theta": 0})", "rope_theta 0 must be a finite number > 1"}}) {
    std::ofstream(d + "/config.json") << cfg << extra;
    r = run("train --steps 2" + kTiny + " --hf-config " + d + "/config.json --out " + d + "/h", 60);
    EXPECT_EQ(r.status, 1) << extra << ": " << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << extra << ": " << r.output;
  }
  std::filesystem::remove_all(d);
}

// Items 4 and 6: outputs that would overwrite an input, or that cannot be written, fail before step 1.
TEST(CliTest, OutputPathsAreCheckedBeforeTheFirstStep) {
  const std::string d = temp_dir(), data = d + "/text.txt";
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
  std::ofstream(data) << text;
  std::filesystem::create_directories(d + "/adir");
  struct Case {
    std::string args, want;
  };
  for (const Case& c : {Case{"--checkpoint " + data, "--checkpoint " + data + " is also --data"},
                        Case{"--export-safetensors " + data, "--export-safetensors " + data + " is also --data"},
                        Case{"--checkpoint " + d + "/adir", "--checkpoint " + d + "/adir: is a directory"},
                        Case{"--export-safetensors " + d + "/adir", ": is a directory"},
                        Case{"--checkpoint " + d + "/o", "is the --out directory"},
                        Case{"--checkpoint " + d + "/x.pt --export-safetensors " + d + "/x.pt", "are the same file"}}) {
    const Result r = run("train --steps 3" + kTiny + " --data " + data + " " + c.args + " --out " + d + "/o", 60);
    EXPECT_EQ(r.status, 1) << c.args << ": " << r.output;
    EXPECT_NE(r.output.find(c.want), std::string::npos) << c.args << ": " << r.output;
    EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << c.args << ": trained first: " << r.output;
  }
  EXPECT_EQ(read_text(data), text) << "the training text was overwritten";
  // inputs that are not regular files are named as such
  Result r = run("train --steps 3" + kTiny + " --data " + d + "/adir --out " + d + "/o", 60);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--data " + d + "/adir: is a directory"), std::string::npos) << r.output;
  // an --out that cannot be made (its parent is a file) is named as --out, not as a bare file-system error
  r = run("train --steps 3" + kTiny + " --data " + data + " --out " + data + "/o", 60);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--out " + data + "/o: cannot create the directory ("), std::string::npos) << r.output;
  std::filesystem::remove_all(d);
}

// Items 5 and 7: resuming into the same --out keeps the earlier metrics; a changed run is refused.
TEST(CliTest, ResumeKeepsEarlierMetricsAndRefusesAChangedRun) {
  const std::string d = temp_dir(), ck = d + "/ck.pt";
  Result r = run("train --steps 3" + kTiny + " --checkpoint " + ck + " --out " + d);
  ASSERT_EQ(r.status, 0) << r.output;
  // the checkpoint resumed from is an input: writing over it is refused before step 1
  r = run("train --steps 5" + kTiny + " --resume " + ck + " --checkpoint " + ck + " --out " + d);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--checkpoint " + ck + " is also --resume: the run would overwrite its own input"),
            std::string::npos) << r.output;
  {  // rows are appended as they are logged (what is there is not rewritten): a crash can cut the last one
     // ("1" of a row "13,...")
    std::ofstream cut(d + "/metrics.csv", std::ios::app);
    cut << "1";
  }
  r = run("train --steps 5" + kTiny + " --resume " + ck + " --checkpoint " + d + "/ck2.pt --out " + d);
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string csv = read_text(d + "/metrics.csv");
  EXPECT_EQ(csv.find("step,loss"), 0u);
  EXPECT_EQ(csv.find("step,loss", 1), std::string::npos) << "the header twice: " << csv;
  EXPECT_EQ(csv_rows(d + "/metrics.csv"), 5) << csv;
  const std::string tiny2 = " --ranks 1 --batch 2 --seq-len 16 --d-model 32 --layers 1 --log-every 1";
  r = run("train --steps 8" + tiny2 + " --heads 2 --resume " + ck + " --out " + d + "/b", 60);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("was written by another run; it differs in:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--heads: checkpoint 4, now 2"), std::string::npos) << r.output;
  r = run("train --steps 8" + kTiny + " --eval-every 0 --resume " + ck + " --out " + d + "/b", 60);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--eval-every/--val-fraction: checkpoint 0.100000 of the text, now none"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("--allow-data-change"), std::string::npos) << r.output;
  r = run("train --steps 6" + kTiny + " --eval-every 0 --allow-data-change --resume " + ck + " --out " + d + "/b", 60);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resuming on other data"), std::string::npos) << r.output;
  std::filesystem::remove_all(d);
}

// Items 11-14: sizes, non-regular files, messages and conflicts, each refused at once with a message
// that names the flag (no C++ backtrace, no allocator error).
TEST(CliTest, BadInputsOfIssue34AreRefusedNamingTheCause) {
  const std::string d = temp_dir();
  std::filesystem::create_directories(d + "/adir");
  const std::string fifo = d + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::ofstream(d + "/cfg.json") << R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3})";
  std::ofstream(d + "/empty.json") << "[]";
  struct Case {
    std::string args, want;
    int status;
  };
  const std::string t = "train --ranks 1 --steps 2 --seq-len 16 --d-model 32 --out " + d + "/o ";
  for (const Case& c : std::vector<Case>{
           {t + "--layers 100000000", "this run needs at least", 1},
           {"train --ranks 1 --batch 2 --seq-len 16 --d-model 1048576 --layers 2 --steps 2 --out " + d + "/o",
            "but this machine has", 1},
           {t + "--batch 1000000000", "this run needs at least", 1},
           {t + "--data " + fifo, "--data " + fifo + ": is not a regular file", 1},
           {t + "--hf-config " + d + "/adir", "--hf-config " + d + "/adir: is a directory", 1},
           {t + "--resume " + d + "/adir", "--resume " + d + "/adir: is a directory", 1},
           {t + "--port 70000", "--port 70000 is out of range 1-65535", 1},
           {t + "--port -1", "--port -1 is out of range 1-65535", 1},
           {t + "--seed -1", "--seed", 2},
           {t + "--compare adamw --optimizer adamw", "leave --optimizer out", 1},
           {t + "--hf-config " + d + "/cfg.json", "num_attention_heads 4 is not a multiple of num_key_value_heads 3", 1},
           {"plan --hf-config " + d + "/cfg.json", "num_attention_heads 4 is not a multiple of num_key_value_heads 3", 1},
           {"plan --hf-config " + d + "/adir", "--hf-config " + d + "/adir: is a directory", 2},
           {"plan --hf-config " + fifo, "is not a regular file", 2},
           {"plan --params " + d + "/empty.json", "has no parameters", 2},
           {"plan --model llama3-8b --simulate --hardware " + d + "/adir", "--hardware " + d + "/adir: is a directory", 2},
           {"bench step --predict " + d + "/adir", "--predict " + d + "/adir: is a directory", 1},
           {"plan --model llama3-8b --include no_such_param", "--include matches no parameter", 2},
           {"plan --model llama3-8b --calibrate " + d + "/adir", "--calibrate " + d + "/adir: is a directory", 2},
           {"bench step --ranks 0", "'0' is not a rank count", 1},
           {"bench step --ranks 2,x", "'x' is not a rank count", 1},
           {"bench step --steps 0", "--steps must be >= 1 (got 0)", 1}}) {
    const Result r = run(c.args, 60);
    EXPECT_EQ(r.status, c.status) << c.args << ": " << r.output;
    EXPECT_NE(r.output.find(c.want), std::string::npos) << c.args << ": " << r.output;
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << c.args << ": " << r.output;
    EXPECT_EQ(r.output.find("bad_alloc"), std::string::npos) << c.args << ": " << r.output;
  }
  // a dmuon checkpoint given as initial weights: said so, with the flag to use instead
  Result r = run("train" + kTiny + " --steps 1 --checkpoint " + d + "/ck.pt --out " + d + "/o");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run(t + "--init-from " + d + "/ck.pt", 60);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("is a dmuon checkpoint (model and optimizer state), not a weights file; continue that run "
                          "with --resume"), std::string::npos) << r.output;
  r = run(t + "--init-from " + d + "/cfg.json --resume " + d + "/ck.pt", 60);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--init-from and --resume both set the weights"), std::string::npos) << r.output;
  std::filesystem::remove_all(d);
}

TEST(CliTest, Fp16OnACpuWithoutHalfKernelsIsAClearError) {
  const std::string out = temp_dir();
  const Result r = run("train --ranks 1 --param-dtype fp16 --steps 2 --batch 2 --seq-len 16 --d-model 32 --layers 1 "
                       "--out " + out);
  // LibTorch 1.13 (Debian, CI) has no float16 matmul on the CPU: refused before training. Newer
  // LibTorch builds have one and train, with dynamic loss scaling (--loss-scale auto): a step whose
  // gradients overflow is skipped on every rank instead of stopping the run.
  const bool refused =
      r.output.find("--param-dtype fp16: this LibTorch has no fp16 matrix multiply on the CPU") != std::string::npos;
  const bool started = r.output.find("fp16 compute (fp32 masters)") != std::string::npos;
  EXPECT_TRUE(refused || started) << r.output;
  if (started) {
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("  loss scale      "), std::string::npos) << r.output;
  }
  if (refused) {
    EXPECT_NE(r.status, 0);
  }
  std::filesystem::remove_all(out);
}

TEST(CliTest, MissingDataFileIsAClearError) {
  const Result r = run("train --ranks 2 --steps 2 --data /no/such/file.txt --out " + temp_dir());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--data /no/such/file.txt: no such file"), std::string::npos) << r.output;
}

TEST(CliTest, UnevenBatchAndTooManyRanksAreClearErrors) {
  Result r = run("train --ranks 3 --batch 16 --steps 2 --out " + temp_dir());
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("does not split evenly across 3 ranks"), std::string::npos) << r.output;
  r = run("train --ranks 32 --batch 16 --steps 2 --out " + temp_dir());
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("larger than the global batch"), std::string::npos) << r.output;
  r = run("train --ranks 0 --steps 2");
  EXPECT_NE(r.status, 0);
  r = run("train --mode z5");
  EXPECT_EQ(r.status, 2);
}

TEST(CliTest, BadSizesNameTheFlagAtFault) {
  const std::string base = "train --ranks 1 --batch 4 --d-model 32 ";  // each case fails validation
  struct Case {
    std::string args, want;
  };
  for (const Case& c : {Case{"--layers 0", "--layers must be >= 1 (got 0)"},
                        Case{"--heads 0", "--heads must be >= 1 (got 0)"},
                        Case{"--grad-accum 0", "--grad-accum must be >= 1 (got 0)"},
                        Case{"--grad-accum 3", "--grad-accum 3 must divide the per-rank batch 4"},
                        Case{"--steps -5", "--steps must be >= 1 (got -5)"},
                        Case{"--steps=-5", "--steps must be >= 1 (got -5)"},
                        Case{"--log-every 0", "--log-every must be >= 1 (got 0)"},
                        Case{"--seq-len -3", "--seq-len must be >= 2 (got -3)"}}) {
    const Result r = run(base + c.args + " --out " + temp_dir(), 60);
    EXPECT_EQ(r.status, 1) << c.args << ": " << r.output;
    EXPECT_NE(r.output.find(c.want), std::string::npos) << c.args << ": " << r.output;
  }
  // a command-line mistake (exit 2), said in a short line (not CLI11's range up to DBL_MAX's 300 digits)
  for (const std::string seed : {"-1", "18446744073709551616", "1.5"}) {  // (2^64: past uint64, not wrapped)
    const Result r = run(base + "--seed " + seed + " --out " + temp_dir(), 60);
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("error: --seed: must be an integer in [0, 2^64), got " + seed + "\n"), std::string::npos)
        << r.output;
  }
}

// One rank dies: its error comes first and whole, the others' consequential errors after it, then
// the launcher's summary; no two ranks' lines are interleaved.
TEST(CliTest, AFailingRankIsReportedFirstAndLinesAreWhole) {
  const std::string out = temp_dir();
  const Result r = run("train --ranks 3 --steps 20 --batch 6 --seq-len 16 --d-model 32 --layers 2 --timeout 20 --out " +
                           out, 120, "DMUON_TEST_FAIL_AT=1:3");
  EXPECT_NE(r.status, 0) << r.output;
  std::vector<std::string> errors;
  std::stringstream ss(r.output);
  for (std::string line; std::getline(ss, line);) {
    const auto at = line.find("error");
    if (at == std::string::npos) continue;
    EXPECT_EQ(at, 0u) << "an error line was interleaved with other output: '" << line << "'";
    EXPECT_EQ(line.find("errorerror"), std::string::npos) << line;
    if (at == 0) errors.push_back(line);
  }
  ASSERT_GE(errors.size(), 2u) << r.output;
  EXPECT_NE(errors.front().find("error (rank 1): injected failure at step 3"), std::string::npos) << r.output;
  EXPECT_EQ(errors.back().rfind("error: rank 1 failed", 0), 0u) << r.output;
  EXPECT_NE(errors.back().find("; stopped the other ranks"), std::string::npos) << r.output;
  std::filesystem::remove_all(out);
}

// Item 8: a rank killed by a signal is the cause, whatever the survivors say after it.
// Item 10: after stopping its ranks the launcher removes the temporaries dead writers left beside the outputs.
TEST(CliTest, ARankKilledBySignalIsNamedNotASurvivor) {
  const std::string out = temp_dir();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // a PID of no process, as a killed rank's
  const std::string stale = out + "/.ck.pt.tmp-" + std::to_string(child);
  std::ofstream(stale) << "half a checkpoint";
  const Result r = run("train --ranks 3 --steps 20 --batch 6 --seq-len 16 --d-model 32 --layers 2 --timeout 20 "
                       "--checkpoint " + out + "/ck.pt --out " + out, 120, "DMUON_TEST_FAIL_AT=2:3:kill");
  EXPECT_FALSE(std::filesystem::exists(stale)) << "a dead writer's temporary file was left";
  EXPECT_NE(r.status, 0) << r.output;
  const auto at = r.output.rfind("error: rank ");
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_EQ(r.output.substr(at).rfind("error: rank 2 failed (was killed by signal 9 (SIGKILL))", 0), 0u) << r.output;
  std::filesystem::remove_all(out);
}

// Item 9 (the CLI's part): a rank that never connects fails setup within --timeout, naming the phase.
TEST(CliTest, ARankStoppedBeforeSetupFailsWithinTheTimeoutNamingThePhase) {
  const std::string out = temp_dir();
  const Result r = run("train --ranks 2 --steps 5 --batch 2 --seq-len 16 --d-model 32 --layers 1 --timeout 5 --out " +
                           out, 120, "DMUON_TEST_FAIL_AT=1:0:stop");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("could not connect to the other ranks within --timeout 5 s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("error: rank 1 was stopped (SIGSTOP) and answered no one"), std::string::npos) << r.output;
  // rank 0 names the rank that never checked in, and the phase
  EXPECT_NE(r.output.find("setup phase 'connecting to the store': rank(s) 1 of 2 did not answer"), std::string::npos)
      << r.output;
  std::filesystem::remove_all(out);
}

TEST(CliTest, AdamwBaselineAndGradientAccumulation) {
  // --optimizer adamw: no Muon matrix, no NS; trains
  const std::string o1 = temp_dir();
  Result r = run("train --optimizer adamw --ranks 2 --steps 12 --batch 8 --seq-len 16 --d-model 32 --layers 2 "
                 "--out " + o1);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("AdamW baseline"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Gram NS"), std::string::npos) << r.output;
  std::ifstream js(o1 + "/summary.json");
  const nlohmann::json s = nlohmann::json::parse(js);
  EXPECT_LT(s["final_loss"].get<double>(), s["first_loss"].get<double>());
  // --grad-accum 2 equals one batch per step (float64: the same data, the same steps)
  const std::string o2 = temp_dir(), o3 = temp_dir();
  const std::string common = "train --param-dtype fp64 --ranks 2 --steps 4 --batch 8 --seq-len 16 --d-model 32 "
                             "--layers 2 --log-every 1 --out ";
  ASSERT_EQ((r = run(common + o2)).status, 0) << r.output;
  ASSERT_EQ((r = run(common + o3 + " --grad-accum 2")).status, 0) << r.output;
  const auto a = losses_of(o2), b = losses_of(o3);
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (int step = 1; step <= 4; ++step) EXPECT_NEAR(b.at(step), a.at(step), 1e-10 * a.at(step)) << "step " << step;
  for (const auto& d : {o1, o2, o3}) std::filesystem::remove_all(d);
}

TEST(CliTest, BenchStepPrintsRatiosForEveryVariant) {
  const std::string out = temp_dir();
  const Result r = run("bench step --ranks 2 --steps 2 --warmup 1 --batch 4 --seq-len 16 --d-model 32 --layers 2 "
                       "--heads 4 --d-ff 64 --out " + out, 300);
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream f(out + "/bench_step.json");
  ASSERT_TRUE(f.good()) << r.output;
  const nlohmann::json j = nlohmann::json::parse(f);
  ASSERT_TRUE(j.contains("2")) << j.dump();
  std::set<std::string> variants;
  for (const auto& row : j["2"]) {
    variants.insert(row["variant"].get<std::string>());
    EXPECT_GT(row["step_ms"].get<double>(), 0) << row.dump();
  }
  for (const char* v : {"baseline_a", "adamw"}) EXPECT_TRUE(variants.count(v)) << v << " in " << j.dump();
  EXPECT_GE(variants.size(), 4u) << j.dump();
  EXPECT_NE(r.output.find("step/A"), std::string::npos) << r.output;
  // HSDP for the DMuon variants: the one-pass step beside the per-group one, with its ratio
  const Result h = run("bench step --ranks 2 --replicate 2 --steps 1 --warmup 0 --batch 4 --seq-len 16 --d-model 32 "
                       "--layers 2 --heads 4 --d-ff 64 --out " + out, 300);
  ASSERT_EQ(h.status, 0) << h.output;
  EXPECT_NE(h.output.find("dmuon_z3_1pass"), std::string::npos) << h.output;
  EXPECT_NE(h.output.find("step/1pass"), std::string::npos) << h.output;
  const Result bad = run("bench step --ranks 3 --batch 6 --replicate 2 --out " + out, 60);
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("--replicate 2 must divide every rank count (3)"), std::string::npos) << bad.output;
  std::filesystem::remove_all(out);
}

// The step simulator's bytes for this rank (comm plan + base all-reduce + has-gradient flags) equal
// what the ranks measure, for every design it prices: 1-D with an uneven owner split (N = 3) and HSDP.
TEST(CliTest, BenchStepPredictionMatchesTheMeasuredBytesExactly) {
  const std::string out = temp_dir();
  for (const auto& [n, layout] : {std::pair<long, std::string>{3, "--ranks 3 --batch 6"},
                                  std::pair<long, std::string>{4, "--ranks 4 --replicate 2 --batch 4"}}) {
    const Result r = run("bench step " + layout + " --steps 1 --warmup 1 --seq-len 16 --d-model 32 --layers 3 --heads 4 "
                         "--d-ff 64 --predict cpu-2core --out " + out, 300);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("pred/meas"), std::string::npos) << r.output;
    std::ifstream f(out + "/bench_step.json");
    const nlohmann::json j = nlohmann::json::parse(f);
    int priced = 0;
    for (const auto& [n, rows] : j.items())
      for (const auto& row : rows) {
        if (!row.contains("predicted")) continue;
        ++priced;
        EXPECT_NEAR(row["predicted"]["bytes"].get<double>(), row["bytes"].get<double>(), 0.5) << layout << " " << row.dump();
        EXPECT_GT(row["predicted"]["step_ms"].get<double>(), 0.0) << row.dump();
      }
    EXPECT_GE(priced, 4) << j.dump();  // DMuon Z2, Z3, naive DP Muon, round-robin
    // the description --predict calibrated in the run: measured rates and links, the box's cores,
    // and one NS timing per matrix shape (here [32, 32] and [32, 64]); `dmuon plan` reads it back
    const std::string file = out + "/hardware_N" + std::to_string(n) + ".json";
    std::ifstream hf(file);
    ASSERT_TRUE(hf.good()) << file;
    const nlohmann::json hw = nlohmann::json::parse(hf);
    EXPECT_GT(hw["matmul_tflops"].get<double>(), 0.0) << hw.dump();
    EXPECT_GT(hw["mfu"].get<double>(), 0.0) << hw.dump();
    EXPECT_LE(hw["mfu"].get<double>(), 1.0) << hw.dump();
    EXPECT_GT(hw["intra_node"]["bandwidth_GBps"].get<double>(), 0.0) << hw.dump();
    EXPECT_GT(hw["intra_node"]["latency_us"].get<double>(), 0.0) << hw.dump();
    // measured, not the preset's: no link on one host is faster than its memory
    EXPECT_LE(hw["intra_node"]["bandwidth_GBps"].get<double>(), hw["memory_bandwidth_GBps"].get<double>()) << hw.dump();
    // the cores over each rank's threads (the launcher gives a rank max(1, cores / N) threads)
    const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
    EXPECT_GE(hw["cores_per_node"].get<long>(), 1) << hw.dump();
    EXPECT_LE(hw["cores_per_node"].get<long>(), cores) << hw.dump();
    if (!std::getenv("OMP_NUM_THREADS") && !std::getenv("MKL_NUM_THREADS")) {
      EXPECT_EQ(hw["cores_per_node"].get<long>(), std::max(1L, cores / std::max(1L, cores / n))) << hw.dump();
    }
    EXPECT_EQ(hw["ns_profile"]["timings"].size(), 2u) << hw.dump();
    const Result plan = run("plan --model gpt2-small -G 4 --simulate --hardware " + file, 60);
    ASSERT_EQ(plan.status, 0) << plan.output;
    EXPECT_NE(plan.output.find("overhead"), std::string::npos) << plan.output;
  }
  // --predict's mistakes fail before any rank starts
  const Result bad_hw = run("bench step --ranks 2 --batch 2 --predict no-such-box --out " + out, 60);
  EXPECT_EQ(bad_hw.status, 1) << bad_hw.output;
  EXPECT_NE(bad_hw.output.find("unknown hardware 'no-such-box'"), std::string::npos) << bad_hw.output;
  const Result no_steps = run("bench step --ranks 2 --batch 2 --steps 0 --predict cpu-2core --out " + out, 60);
  EXPECT_EQ(no_steps.status, 1) << no_steps.output;
  EXPECT_NE(no_steps.output.find("--steps >= 1"), std::string::npos) << no_steps.output;
  std::filesystem::remove_all(out);
}

TEST(CliTest, PortInUseIsAClearError) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  const Result r = run("train --ranks 2 --steps 2 --port " + std::to_string(port) + " --out " + temp_dir(), 60);
  ::close(fd);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("port " + std::to_string(port) + " on 127.0.0.1 is in use"), std::string::npos) << r.output;
}

TEST(CliTest, InterruptedRunStopsAllRanksAndExitsNonZero) {
  // the shell's convention: 128 + the signal (130 for SIGINT, 143 for SIGTERM)
  for (const auto& [sig, want] : {std::pair{SIGINT, 130}, std::pair{SIGTERM, 143}}) {
    SCOPED_TRACE("signal " + std::to_string(sig));
    const std::string out = temp_dir();
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const std::string bin = cli();
      ::execl(bin.c_str(), bin.c_str(), "train", "--ranks", "2", "--steps", "100000", "--out", out.c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    std::this_thread::sleep_for(std::chrono::seconds(6));
    ::kill(pid, sig);
    int st = 0;
    const auto t0 = std::chrono::steady_clock::now();
    pid_t done = 0;
    while ((done = ::waitpid(pid, &st, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30))
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (done == 0) ::kill(pid, SIGKILL);
    ASSERT_EQ(done, pid) << "dmuon train did not stop within 30 s of SIGINT";
    ASSERT_TRUE(WIFEXITED(st));
    EXPECT_EQ(WEXITSTATUS(st), want);
    // no rank outlives the parent: nothing named dmuon with our out dir is left
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const Result ps = {0, ""};
    FILE* f = popen(("pgrep -f -- '--ou[t] " + out + "'").c_str(), "r");
    std::array<char, 256> buf{};
    std::string left;
    while (size_t n = fread(buf.data(), 1, buf.size(), f)) left.append(buf.data(), n);
    pclose(f);
    EXPECT_TRUE(left.empty()) << "ranks still running: " << left;
    (void)ps;
    std::filesystem::remove_all(out);
  }
}

TEST(CliTest, PlanToolBadInputExitsNonZeroWithOneLine) {
  Result r = run("plan --model no-such-model");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(first_line(r.output).find("no-such-model"), std::string::npos) << r.output;
  r = run("plan --model llama3-8b --shard 0");
  EXPECT_NE(r.status, 0);
  r = run("plan --model llama3-8b --shard 8 --json");
  EXPECT_EQ(r.status, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_TRUE(j.contains("fingerprint"));
}

TEST(CliTest, PlanCalibrateWritesADescriptionThePlannerAndSimulatorRead) {
  const std::string dir = temp_dir();
  {
    std::ofstream f(dir + "/params.json");
    f << R"([{"name": "layers.0.a", "shape": [32, 32], "dtype": "fp32"}, {"name": "layers.0.b", "shape": [8, 256], "dtype": "fp32"},
             {"name": "layers.1.a", "shape": [32, 32], "dtype": "fp32"}, {"name": "layers.1.b", "shape": [256, 8], "dtype": "fp32"},
             {"name": "layers.1.c", "shape": [96, 128], "dtype": "fp32"}, {"name": "norm", "shape": [32], "dtype": "fp32"}])";
  }
  Result r = run("plan --params " + dir + "/params.json --calibrate " + dir + "/cpu.json --reps 1 --batch 2 --hardware cpu-2core");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("wrote " + dir + "/cpu.json"), std::string::npos) << r.output;
  std::ifstream in(dir + "/cpu.json");
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["ns_profile"]["timings"].size(), 3u) << j.dump();  // 32x32, 8x256, 96x128
  EXPECT_GT(j["matmul_tflops"].get<double>(), 0.0);
  EXPECT_NE(j["source"].get<std::string>().find("measured"), std::string::npos);
  r = run("plan --params " + dir + "/params.json -G 2 --owner-cost-model profiled --ns-profile " + dir + "/cpu.json");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("owner_cost_model=profiled"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("measured NS ns"), std::string::npos) << r.output;
  // the calibrated description's own profile, with no --ns-profile
  r = run("plan --params " + dir + "/params.json -G 2 --simulate --tokens 256 --hardware " + dir +
          "/cpu.json --owner-cost-model profiled");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("overhead"), std::string::npos) << r.output;
  r = run("plan --params " + dir + "/params.json -G 2 --owner-cost-model profiled");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--calibrate"), std::string::npos) << r.output;
  std::filesystem::remove_all(dir);
}

// The columns of metrics.csv by name, one map per row.
std::vector<std::map<std::string, std::string>> metrics_rows(const std::string& dir) {
  std::ifstream f(dir + "/metrics.csv");
  auto split = [](const std::string& line) {
    std::vector<std::string> c;
    std::stringstream ss(line);
    for (std::string x; std::getline(ss, x, ',');) c.push_back(x);
    if (!line.empty() && line.back() == ',') c.emplace_back();
    return c;
  };
  std::string line;
  std::getline(f, line);
  const auto head = split(line);
  std::vector<std::map<std::string, std::string>> rows;
  while (std::getline(f, line)) {
    const auto c = split(line);
    std::map<std::string, std::string> row;
    for (size_t i = 0; i < head.size() && i < c.size(); ++i) row[head[i]] = c[i];
    rows.push_back(row);
  }
  return rows;
}

TEST(CliTest, HuggingFaceConfigTrainsWithValidationExportsAndReloads) {
  const std::string out = temp_dir();
  const nlohmann::json cfg = {{"model_type", "qwen3"},        {"vocab_size", 256},         {"hidden_size", 32},
                              {"intermediate_size", 48},      {"num_hidden_layers", 2},    {"num_attention_heads", 4},
                              {"num_key_value_heads", 2},     {"head_dim", 8},             {"max_position_embeddings", 64},
                              {"rope_theta", 10000.0},        {"tie_word_embeddings", true}, {"hidden_act", "silu"}};
  std::ofstream(out + "/config.json") << cfg.dump();
  const std::string common = " --hf-config " + out + "/config.json --batch 4 --seq-len 32 --log-every 1";
  Result r = run("train --ranks 2 --steps 6 --eval-every 3" + common + " --out " + out + "/a --export-safetensors " +
                 out + "/a/model.safetensors");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("qwen3 (Hugging Face config)"), std::string::npos) << r.output;
  const auto rows = metrics_rows(out + "/a");
  ASSERT_EQ(rows.size(), 6u);
  std::vector<int> evaluated;
  for (const auto& row : rows)
    if (!row.at("val_loss").empty()) evaluated.push_back(std::stoi(row.at("step")));
  EXPECT_EQ(evaluated, (std::vector<int>{3, 6}));
  const double val6 = std::stod(rows[5].at("val_loss"));
  std::ifstream sj(out + "/a/summary.json");
  const auto s = nlohmann::json::parse(sj);
  EXPECT_DOUBLE_EQ(s["val_loss"].get<double>(), val6);
  // the export: transformers' names, the single-process shapes, tied (no lm_head)
  const dmuon::SafetensorsFile f(out + "/a/model.safetensors");
  EXPECT_EQ(f.entry("model.layers.1.self_attn.q_proj.weight").shape, (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(f.entry("model.layers.0.self_attn.k_proj.weight").shape, (std::vector<int64_t>{16, 32}));
  EXPECT_TRUE(f.contains("model.layers.0.self_attn.k_norm.weight") && f.contains("model.norm.weight"));
  EXPECT_FALSE(f.contains("lm_head.weight"));
  // reloaded on 1 rank with nothing learning: the first validation sees the exported weights
  r = run("train --ranks 1 --steps 1 --eval-every 1 --lr 0 --adamw-lr 0" + common + " --init-from " + out +
          "/a/model.safetensors --out " + out + "/b");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto reload = metrics_rows(out + "/b");
  ASSERT_EQ(reload.size(), 1u);
  // float32 forwards of the same weights on the same held-out batches, split 2 ways vs 1: measured
  // |diff| ~1e-7; bound 1e-4
  EXPECT_NEAR(std::stod(reload[0].at("val_loss")), val6, 1e-4);
  // a config dmuon cannot feed bytes to
  nlohmann::json small = cfg;
  small["vocab_size"] = 100;
  std::ofstream(out + "/small.json") << small.dump();
  r = run("train --ranks 2 --steps 2 --hf-config " + out + "/small.json --out " + out + "/c");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("vocab_size 100 is below 256"), std::string::npos) << r.output;
  // a --tp the heads cannot be split by: refused before any rank starts
  r = run("train --ranks 4 --tp 4 --steps 2 --hf-config " + out + "/config.json --out " + out + "/d");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(first_line(r.output).find("--tp 4 must divide the config's num_attention_heads 4 and num_key_value_heads 2"),
            std::string::npos)
      << r.output;
  std::filesystem::remove_all(out);
}

TEST(CliTest, CompareAdamwDrawsBothCurvesAndCountsStepsToTarget) {
  const std::string out = temp_dir();
  Result r = run("train --ranks 2 --steps 30 --compare adamw --eval-every 10 --batch 8 --seq-len 32 --d-model 32 "
                 "--layers 2 --log-every 5 --out " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("compare (same model, data and steps)"), std::string::npos) << r.output;
  std::ifstream dj(out + "/dmuon/summary.json"), aj(out + "/adamw/summary.json"), cj(out + "/compare.json");
  EXPECT_EQ(nlohmann::json::parse(dj)["optimizer"], "dmuon");
  EXPECT_EQ(nlohmann::json::parse(aj)["optimizer"], "adamw");
  const auto c = nlohmann::json::parse(cj);
  // the target is AdamW's trailing mean over the last 3 logged steps (30 / 10); recomputed here
  const auto adamw = metrics_rows(out + "/adamw");
  ASSERT_EQ(adamw.size(), 30u);
  const double target =
      (std::stod(adamw[27].at("loss")) + std::stod(adamw[28].at("loss")) + std::stod(adamw[29].at("loss"))) / 3;
  EXPECT_NEAR(c["target_loss"].get<double>(), target, 1e-12);
  const int64_t dsteps = c["dmuon_steps_to_target"], asteps = c["adamw_steps_to_target"];
  ASSERT_GT(asteps, 0);
  EXPECT_LE(asteps, 30);
  if (dsteps > 0) {
    EXPECT_NEAR(c["steps_ratio_adamw_over_dmuon"].get<double>(), double(asteps) / double(dsteps), 1e-12);
  }
  std::ifstream svg(out + "/compare.svg");
  std::stringstream ss;
  ss << svg.rdbuf();
  EXPECT_NE(ss.str().find("AdamW validation"), std::string::npos);
  EXPECT_NE(ss.str().find("DMuon train"), std::string::npos);
  std::filesystem::remove_all(out);
}

}  // namespace
