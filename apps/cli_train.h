// cli_train.h -- `dmuon train`'s pieces: the arguments, a rank's run (setup), what the loop
// measured, and the report (cli_train_report.cpp).
#pragma once

#include <chrono>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "dmuon/bootstrap.h"
#include "dmuon/communicator.h"
#include "dmuon/mesh.h"
#include "dmuon/muon.h"
#include "model/gpt.h"

namespace dmuon::cli::train {

struct TrainArgs {
  int ranks = 4;
  int steps = 300;
  std::string mode = "z3";
  std::string optimizer = "dmuon";
  std::string out = "runs/train";
  std::string data;
  int64_t batch = 16;
  int64_t seq_len = 64;
  int64_t d_model = 128;
  int64_t layers = 4;
  int64_t heads = 4;
  double lr = 0.02;
  double adamw_lr = 3e-3;
  double weight_decay = 0.0;
  int grad_accum = 1;
  uint64_t seed = 0;
  int port = 0;
  int log_every = 10;
  std::string ns_backend = "gram";
  double timeout_s = 300;
  std::string device = "cpu";
  int replicate = 1;
  int tp = 1;  // tensor-parallel ranks per group (ranks = R x G x T)
  bool shard_base = false;
  std::string param_dtype = "fp32";
  std::string checkpoint;       // write a checkpoint here (at the end, and every checkpoint_every steps)
  int checkpoint_every = 0;
  double clip_grad = 0;         // > 0: clip the global gradient norm (all parameters) to this
  std::string resume;           // continue from this checkpoint (any world size)
};

// Everything a rank trains with: the process groups, the data, the dedicated model, the optimizer.
struct TrainRun {
  Bootstrap boot;
  int rank = 0, world = 1;
  bool lead = true;
  at::Device device = at::kCPU;
  std::string text;
  double baseline = 0;
  bool use_muon = true;
  std::shared_ptr<Mesh> mesh;
  std::unique_ptr<Communicator> trainer;  // the run's own collectives (loss, checkpoint status, summary)
  models::GPT model{nullptr};
  std::unique_ptr<Muon> opt;
  int first_step = 1;
};

// What the loop measured, per step (rank 0 logs the loss and writes the outputs).
struct TrainLog {
  std::vector<int64_t> steps_logged;
  std::vector<double> losses, step_ms, fwd_ms, bwd_ms, ns_ms, adamw_ms, wait_ms, prep_ms;
  std::vector<double> bytes_per_step, muon_bytes_per_step;
  std::vector<double> grad_norms;  // pre-clip global gradient norm per step
  int clipped_steps = 0;
  std::ostringstream csv;
  std::chrono::steady_clock::time_point t_start;
  double total_s = 0;
};

std::string fmt_secs(double s);
double mean(const std::vector<double>& v);
// rank 0: metrics.csv always, loss.svg at the end and every 50 logged steps
void write_outputs(const TrainArgs& a, const TrainRun& r, const TrainLog& log, bool final_write);
// collective: the per-rank figures are gathered; rank 0 writes summary.json and prints the summary.
int report(const TrainArgs& a, TrainRun& r, TrainLog& log, std::ostream& out);

}  // namespace dmuon::cli::train
