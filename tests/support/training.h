// Test support: the small GPT training setup shared by the runtime tests, and the independent
// single-process reference they compare against (plain Muon + AdamW on the whole global batch,
// implemented without dmuon's runtime or optimizer).
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/dedicate.h"
#include "dmuon/mesh.h"
#include "dmuon/muon.h"
#include "model/gpt.h"
#include "support/multirank.h"

namespace dmuon::testing {

using StateDict = std::map<std::string, at::Tensor>;

// 32-token vocabulary, d_model 32, 4 heads, d_ff 48.
models::GPTConfig small_config(int64_t layers = 3);
// Parameters of a freshly initialised GPT (seeded), norms at non-trivial values.
StateDict init_state(const models::GPTConfig& cfg, uint64_t seed);
void load_state(models::GPT& m, const StateDict& sd);
// `steps` batches of learnable sequences [batch, seq] (seeded).
std::vector<at::Tensor> make_batches(int steps, int64_t batch, int64_t seq, int64_t vocab, uint64_t seed);

struct TrainConfig {
  int steps = 10;
  double lr = 0.01, momentum = 0.95, wd = 0.01;
  double adamw_lr = 3e-3, adamw_wd = 0.01;
  bool nesterov = true;
  bool scheduler = false;  // StepLR(step_size 3, gamma 0.5) on every group
  std::vector<bool> frozen;  // blocks run under no_grad
  int accum = 1;             // micro-batches per optimizer step (each rank splits its slice)
  bool no_sync = false;      // accumulate inside dmuon::NoSync (reduce once per step)
  std::vector<int> block_order;  // e.g. {0, 1, 0}: block 0 runs twice per forward
  bool two_forwards = false;     // each rank: two forward passes, one backward of the mean loss
};

struct RefResult {
  StateDict params;
  StateDict momentum;  // Muon buffers
  StateDict exp_avg;   // AdamW first moments
  std::vector<double> losses;
};

// Single-process fp32 training on the whole global batch (Muon on models::is_muon_matrix, AdamW
// on the rest), independent of dmuon's runtime and optimizer.
RefResult reference_train(const models::GPTConfig& cfg, const StateDict& init, const std::vector<at::Tensor>& batches,
                          const TrainConfig& tc);

// MuonOptions with the config's hyperparameters (first-step progress log off).
MuonOptions muon_options(const TrainConfig& tc);

// One optimizer step per batch on this rank's rows [rank * per, (rank + 1) * per); returns the
// local losses.
std::vector<double> train_slices(models::GPT& m, Muon& opt, const std::vector<at::Tensor>& batches, int rank,
                                 int64_t per);

// Relative difference of one tensor: |a - b|_F / |b|_F (the tests take the max over all tensors).
double max_rel(const at::Tensor& a, const at::Tensor& b);

// How a test dedicates the GPT: mesh shape and runtime path.
struct Layout {
  std::string label;
  int world = 2;
  int replicate = 1;       // HSDP when > 1
  bool z3 = true;
  bool ddp = false;        // dedicate_params_ddp
  bool sharded = false;    // the non-matrix parameters on sharded_adamw (via route_hint_fn)
  std::string unshard = "broadcast";
  std::optional<bool> pack_small_params = false;  // false: spread a layer's matrices; nullopt: planner default
};
// dedicate_params (or _ddp) with models::is_muon_matrix as predicate, then replicate; `o` carries
// any further options (policies).
void dedicate_gpt(models::GPT& m, const std::shared_ptr<Mesh>& mesh, const Layout& l, DedicateOptions o = {});

// A mesh over the rank's Gloo group (replicate > 1: HSDP).
std::shared_ptr<Mesh> make_mesh(RankContext& ctx, std::chrono::milliseconds timeout = std::chrono::seconds(60),
                                int replicate = 1);

}  // namespace dmuon::testing
