// cli_train.h -- `dmuon train`'s pieces: the arguments, a rank's run (setup), what the loop
// measured, and the report (cli_train_report.cpp).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "dmuon/bootstrap.h"
#include "dmuon/communicator.h"
#include "dmuon/grad_scaler.h"
#include "dmuon/mesh.h"
#include "dmuon/muon.h"
#include "model/language_model.h"

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
  bool one_pass = false;         // MuonOptions::group_prepare_ahead off: every reduce waited, then one publish
  bool per_param_optim = false;  // MuonOptions::fused / foreach off: the per-parameter element-wise ops
  std::string param_dtype = "fp32";
  std::string checkpoint;       // write a checkpoint here (at the end, and every checkpoint_every steps)
  int checkpoint_every = 0;
  double clip_grad = 0;         // > 0: clip the global gradient norm (all parameters) to this
  std::string loss_scale = "auto";  // "dynamic" (dmuon::GradScaler), "off", "auto": dynamic with fp16
  double loss_scale_init = 65536;       // GradScalerOptions::init_scale
  int64_t loss_scale_growth_interval = 2000;  // GradScalerOptions::growth_interval
  std::string resume;           // continue from this checkpoint (any world size)
  std::string hf_config;        // build this Hugging Face config.json's architecture instead of the GPT
  std::string init_from;        // initial weights: a .safetensors file or a sharded *.safetensors.index.json
  std::string export_safetensors;  // write the final model's full state dict here (safetensors)
  int eval_every = 50;          // validation loss every N steps (and at the last); 0: never
  double val_fraction = 0.1;    // the held-out tail of the text
  int eval_batches = 4;         // global batches of held-out text per evaluation
  std::string compare;          // "adamw": also train the AdamW baseline and draw both (the launcher's job)
  bool allow_unverified = false;   // --resume a safetensors checkpoint without "crc32c" (another tool's)
  bool allow_data_change = false;  // --resume with other data or another split than the checkpoint's run
  // given on the command line (not defaults): on --resume they override the checkpoint's values
  bool lr_given = false, adamw_lr_given = false, weight_decay_given = false;
};

// Everything a rank trains with: the process groups, the data, the dedicated model, the optimizer.
struct TrainRun {
  Bootstrap boot;
  int rank = 0, world = 1;
  bool lead = true;
  at::Device device = at::kCPU;
  std::string text;      // the training split
  std::string val_text;  // the held-out split (empty: no evaluation)
  double baseline = 0;
  bool use_muon = true;
  std::shared_ptr<Mesh> mesh;
  std::unique_ptr<Communicator> trainer;  // the run's own collectives (loss, checkpoint status, summary)
  std::shared_ptr<models::LanguageModel> model;
  std::unique_ptr<Muon> opt;
  std::optional<GradScaler> scaler;  // --loss-scale: dynamic loss scaling (its state is in the checkpoints)
  int first_step = 1;
  uint32_t data_crc32c = 0;  // of the whole text (before the split): part of what defines the run
  size_t data_bytes = 0;
  std::string earlier_metrics;  // --resume into the same --out: metrics.csv's rows before first_step
};

// What the loop measured, per step (rank 0 logs the loss and writes the outputs).
struct TrainLog {
  std::vector<int64_t> steps_logged;
  std::vector<double> losses, step_ms, fwd_ms, bwd_ms, ns_ms, adamw_ms, wait_ms, prep_ms;
  std::vector<double> bytes_per_step, muon_bytes_per_step;
  std::vector<double> grad_norms;  // pre-clip global gradient norm per step
  std::vector<int64_t> val_steps;
  std::vector<double> val_losses;
  int clipped_steps = 0;
  int skipped_steps = 0;     // loss scaling: steps skipped for an inf / NaN gradient
  double loss_scale = 0;     // loss scaling: the final scale (0: off)
  std::ostringstream csv;   // metrics.csv's rows not yet written (write_outputs empties it)
  std::string csv_written;  // what metrics.csv holds (header, earlier rows, the rows written): later rows are appended
  std::chrono::steady_clock::time_point t_start;
  double total_s = 0;
};

std::string fmt_secs(double s);
double mean(const std::vector<double>& v);
// rank 0: metrics.csv always, loss.svg at the end and every 50 logged steps
void write_outputs(const TrainArgs& a, const TrainRun& r, TrainLog& log, bool final_write);
// collective: the per-rank figures are gathered; rank 0 writes summary.json and prints the summary.
int report(const TrainArgs& a, TrainRun& r, TrainLog& log, std::ostream& out);

// --compare (cli_train_compare.cpp) ------------------------------------------------------------
// `args` without any `name` (as "--x v" or "--x=v"), plus "name value" when `value` is set.
std::vector<std::string> with_option(const std::vector<std::string>& args, const std::string& name,
                                     const std::optional<std::string>& value);
struct Metrics {  // the columns of a run's metrics.csv that --compare reads
  std::vector<int64_t> steps, val_steps;
  std::vector<double> loss, val_loss;
};
Metrics read_metrics(const std::string& path);
std::vector<double> trailing_mean(const std::vector<double>& v, size_t window);
// target: AdamW's final train loss (trailing mean over `window` = clamp(n/10, 1, 10) logged steps);
// the first logged step at which each run's trailing mean is <= target (-1: never); ratio
// adamw_steps / dmuon_steps (0 when either never gets there).
struct StepsToTarget {
  double target = 0, dmuon_final = 0, ratio = 0;
  int64_t dmuon_steps = -1, adamw_steps = -1;
  size_t window = 1;
};
StepsToTarget steps_to_target(const Metrics& dmuon, const Metrics& adamw);
// Runs one training from the launcher (local ranks or in-process) with these arguments.
using LaunchFn = std::function<int(const TrainArgs&, const std::vector<std::string>&)>;
int run_compare(const TrainArgs& a, const std::vector<std::string>& args, const LaunchFn& launch, std::ostream& out);

}  // namespace dmuon::cli::train
