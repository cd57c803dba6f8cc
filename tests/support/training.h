// Test support: the small GPT training setup shared by the runtime tests, and the independent
// single-process reference they compare against (plain Muon + AdamW on the whole global batch,
// implemented without dmuon's runtime or optimizer).
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/dedicate.h"
#include "dmuon/mesh.h"
#include "dmuon/muon.h"
#include "dmuon/tensor_parallel.h"
#include "model/gpt.h"
#include "support/multirank.h"

namespace dmuon::testing {

using StateDict = std::map<std::string, at::Tensor>;

// 32-token vocabulary, d_model 32, 4 heads, d_ff 48.
models::GPTConfig small_config(int64_t layers = 3);
// Parameters of a freshly initialised GPT (seeded, drawn in fp32 and then converted to `dtype`, so
// both precisions start from the same point), norms at non-trivial values.
//
// Equivalence tests run in float64 by default: distributed and single-process training then differ
// only by float64 reduction order (~1e-16, amplified by Newton-Schulz to ~1e-13 after 10 steps),
// so their bound (kFloat64Bound) holds on any CPU, BLAS kernel and thread count. fp32 variants use
// measured bounds (kFloat32Bound).
StateDict init_state(const models::GPTConfig& cfg, uint64_t seed, at::ScalarType dtype = at::kDouble);
// Converts the model to the state's dtype and copies the state in (a TP model: each split
// parameter takes its TP rank's slice).
void load_state(models::GPT& m, const StateDict& sd);
// A GPT in `dtype` (its own random init; e.g. the target of a checkpoint load).
models::GPT make_gpt(const models::GPTConfig& cfg, at::ScalarType dtype = at::kDouble);

// Relative bound (|a - b|_F / |b|_F) of a distributed-vs-single-process comparison in `dtype`.
// Measured over the whole suite with OMP_NUM_THREADS=1 and 2 (2026-12-01, AMD EPYC, AVX2):
//  float64: worst 2.2e-14 (every layout, 10 steps), bound 1e-10: 4500x margin.
//  float32: worst 6.1e-6 here and 1.5e-5 on an AVX-512 EPYC (momentum after 10 steps; reduction
//           order of the BLAS kernel, thread count and Gloo sums, amplified by NS), bound 2e-4:
//           13x above the worst seen on any machine.
constexpr double kFloat64Bound = 1e-10;
constexpr double kFloat32Bound = 2e-4;
inline double equivalence_bound(at::ScalarType dtype) {
  return dtype == at::kDouble ? kFloat64Bound : kFloat32Bound;
}
// `steps` batches of learnable sequences [batch, seq] (seeded).
std::vector<at::Tensor> make_batches(int steps, int64_t batch, int64_t seq, int64_t vocab, uint64_t seed);

struct TrainConfig {
  at::ScalarType dtype = at::kDouble;  // of the parameters (and the reference); see init_state
  int steps = 10;
  double lr = 0.01, momentum = 0.95, wd = 0.01;
  double adamw_lr = 3e-3, adamw_wd = 0.01;
  bool nesterov = true;
  bool scheduler = false;  // StepLR(step_size 3, gamma 0.5) on every group
  std::vector<bool> frozen;  // blocks run under no_grad
  int accum = 1;             // micro-batches per optimizer step (each rank splits its slice)
  bool no_sync = false;      // accumulate inside dmuon::NoSync (reduce once per step)
  std::vector<int> block_order;  // e.g. {0, 1, 0}: block 0 runs twice per forward
  bool frozen_embedding = false;  // the embedding under no_grad: the first block's input needs no gradient
  bool two_forwards = false;     // each rank: two forward passes, one backward of the mean loss
  // Before each step's real micro-batches: a backward of other data (inside NoSync when
  // discarded_in_no_sync), then zero_grad(zero_grad_to_none); the result must not change.
  bool discarded_backward = false;
  bool discarded_in_no_sync = false;
  bool zero_grad_to_none = true;
  // the discarded backward's gradients cleared by the model's zero_grad (LibTorch's Module::zero_grad(true), as a
  // GAN loop clears the discriminator) instead of the optimizer's
  bool module_zero_grad = false;
  double clip = 0;  // > 0: clip the global gradient norm of all parameters to this before each step
  // no zero_grad between steps: each step's gradient is the sum of every backward so far, as in torch
  bool keep_grads = false;
  int frozen_on_odd_steps = -1;  // >= 0: this block runs under no_grad on steps 1, 3, ... (no gradient then)
  // Before each step's real micro-batches on steps 1, 2, ...: a backward that raises half-way (a hook on a
  // parameter of the middle block throws, as a caught out-of-memory error would), caught; then zero_grad
  // (raised_backward_zero_grad; step() in between must refuse) or straight on to the next forward, which
  // drops it. The result must not change.
  bool raised_backward = false;
  bool raised_backward_zero_grad = true;
  // After each step's backward (and clipping), before the step: what a training loop does to the
  // gradients in p.grad (torch's clipping, masks, replacing or dropping one), given the step and the
  // parameters by name; the reference does the same to its own.
  std::function<void(size_t step, const std::vector<std::pair<std::string, at::Tensor>>& params)> edit_grads;
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
                                int replicate = 1, int tp = 1);

}  // namespace dmuon::testing
