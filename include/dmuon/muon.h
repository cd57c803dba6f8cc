// muon.h -- the Muon optimizer over a dedicated model: Newton-Schulz on owned matrices, AdamW on
// everything else. A torch::optim::Optimizer, so LibTorch's LR schedulers drive it.
//
// Per owned matrix W with averaged gradient g (Moonlight / Gram-NS convention):
//   buf <- mu * buf + g
//   u    = g + mu * buf   (Nesterov, default)   |   u = buf
//   W   <- W * (1 - lr * wd)
//   W   <- W - lr * 0.2 * sqrt(max(rows, cols)) * NS(u)
// Only the owner runs this (tensor parallelism: the T owners of a split matrix's slices, one TP
// group, orthogonalise the full matrix together -- see tp_distributed_gram -- and rows/cols are the
// full matrix's). AdamW (decoupled weight decay, bias-corrected, PyTorch's formula) updates
// every other trainable parameter identically on every rank (sharded_adamw: each rank its slice).
//
// Contract: step() is collective -- every rank of the mesh calls it, in the same order relative to
// the other collective calls (forward/backward through dedicated boundaries, prepare_muon_grads,
// checkpoints). It waits the gradient reduces (on HSDP it issues and waits the replicate-axis
// stage 2 unless it ran at the end of backward), and after the updates it publishes: over the
// replicate group on HSDP, from the owners on the DDP path, as a scatter into every rank's shard in
// all_gather unshard mode; on a 1-D mesh in broadcast mode it issues no collective (the next
// forward broadcasts the new values). zero_grad() issues none. Not thread-safe: one thread drives
// one optimizer.
//
// Parameter groups: each user group (MuonParamGroup) is lowered into a Muon subgroup (its dedicated
// matrices) and an AdamW subgroup (its other parameters), so schedulers and checkpoints keep
// per-group hyperparameters. Parameters in no user group form a default group, so one Muon steps the
// whole model: a second Muon stepping (or clipping) the same gradients -- no backward or zero_grad since
// another one did -- is refused (two Muons cannot split a model; replacing the optimizer is fine).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dmuon/grad_clip.h"
#include "dmuon/newton_schulz.h"
#include "dmuon/ns_graphs.h"

namespace dmuon {

class Mesh;
struct ReadyGrad;    // a gradient the runtime hands to the optimizer (src/runtime/route.h)
class RuntimeFace;   // what the optimizer sees of a dedicated model's runtime (src/runtime/runtime_face.h)
class TpScratch;     // the TP Newton-Schulz exchange's kept buffers (src/optim/tp_newton_schulz.h)

// Options of one lowered parameter group.
struct MuonGroupOptions : torch::optim::OptimizerCloneableOptions<MuonGroupOptions> {
  MuonGroupOptions(double lr = 0.02) : lr_(lr) {}  // ctor(double) is required by torch's serializers
  TORCH_ARG(double, lr);
  TORCH_ARG(bool, is_muon) = true;     // true: Muon subgroup; false: AdamW subgroup
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(int64_t, ns_steps) = 5;
  TORCH_ARG(double, beta1) = 0.9;
  TORCH_ARG(double, beta2) = 0.999;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(std::string, group_name) = "default";

 public:
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
  double get_lr() const override { return lr(); }
  void set_lr(const double v) override { lr(v); }
};

struct MuonParamState : torch::optim::OptimizerCloneableParamState<MuonParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, momentum_buffer);  // Muon
  TORCH_ARG(at::Tensor, exp_avg);          // AdamW
  TORCH_ARG(at::Tensor, exp_avg_sq);       // AdamW

 public:
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
};

// The range of a hyperparameter. check_hyperparameter is the one check of every value Muon uses,
// wherever it comes from: MuonOptions, a checkpoint (load_checkpoint, set_optimizer_state_dict) or
// the command line.
enum class HparamRange {
  NonNegative,   // a learning rate or a weight decay: finite and >= 0
  UnitInterval,  // a momentum or an Adam beta: in [0, 1)
  Positive,      // Adam's eps: finite and > 0
  Count,         // ns_steps: an integer in [1, 1000]
};
// Throws c10::Error "<what>: <v>. Must be <range>." when v is outside `range` (NaN and +-inf always are).
void check_hyperparameter(const std::string& what, double v, HparamRange range);
// check_hyperparameter of every value a lowered group uses: lr and weight_decay; a Muon group's
// momentum and ns_steps; an AdamW group's beta1, beta2 and eps. `where` starts the message
// ("<where> has lr: nan. Must be ...").
void check_group_options(const MuonGroupOptions& g, const std::string& where);

// A user parameter group (PyTorch style): its parameters and the hyperparameters it overrides.
struct MuonParamGroup {
  std::string name;
  std::vector<at::Tensor> params;
  // unset: MuonOptions' value
  std::optional<double> lr, momentum, weight_decay;
  std::optional<bool> nesterov;
  std::optional<int> ns_steps;
  std::optional<double> adamw_lr, adamw_weight_decay, adamw_eps;
  std::optional<std::pair<double, double>> adamw_betas;
};

struct MuonOptions {
  double lr = 0.02;
  double momentum = 0.95;
  double weight_decay = 0.0;
  int ns_steps = 5;
  double adamw_lr = 1e-3;
  std::pair<double, double> adamw_betas{0.9, 0.999};
  double adamw_weight_decay = 0.01;
  double adamw_eps = 1e-8;
  std::vector<MuonParamGroup> param_groups;
  std::string ns_backend = "gram";          // "gram" | "direct" (ignored when `ns` is set)
  std::optional<NewtonSchulz> ns;           // a fully configured backend (custom coefficients...)
  bool nesterov = true;
  // The post-step publish mode lives in the runtime (DedicateOptions::replicate_async, default
  // true); set here it overrides that for this optimizer. A
  // model that does not run its boundaries through dmuon::forward is always waited: nothing else
  // would wait before the parameters are read again.
  std::optional<bool> replicate_async;
  bool record_step_profile = false;
  // Prepare the dedicated gradients group by group (hook boundaries): a later group's reduce (HSDP:
  // its stage-2 reduce) is still in flight while this group's Newton-Schulz runs, and with async
  // publishing each group publishes right after its own update (HSDP, the DDP path, all_gather
  // mode: groups in the next forward's order; 1-D broadcast mode: in reduce order). false: every
  // reduce is waited first, every group published after every update. Same results either way.
  // Cost: two host reads per group instead of two per step, so it applies where it pays (measured,
  // docs/PERF.md): wherever step() has per-group traffic (HSDP, a post-step publish) and on CPU
  // meshes (host reads are free); a 1-D GPU mesh in broadcast mode, TP meshes and steps after
  // clip_grad_norm_ (every gradient waited already) take the one-pass path.
  bool group_prepare_ahead = true;
  // One line per matrix in the first step (NS kernel, shape, time): off by default in the library
  // (the CLI turns it on). Lines go to `log` when set, else to stderr.
  bool first_step_progress_log = false;
  int first_step_progress_log_limit = 8;
  std::function<void(const std::string&)> log;
  // Tensor parallelism: how the T owners of a TP-split matrix orthogonalise it. false (default):
  // gather the momentum-update input to the TP owner, Newton-Schulz on the full matrix there,
  // scatter the update's slices back. true: the column-sharded Gram form (one all-reduce of the
  // small Gram matrix per NS window, factors applied locally; every TP rank computes its own slice)
  // where the split runs along the matrix's long side, chosen per matrix by the policy:
  // "beneficial" uses it when (windows * m^2) / (rows * cols) <= the ratio below (m = min(rows,
  // cols): the factor payload over the full-scatter payload), "always" wherever it applies.
  // Both give Newton-Schulz of the full matrix.
  bool tp_distributed_gram = false;
  std::string tp_distributed_gram_policy = "beneficial";
  double tp_distributed_gram_max_factor_to_scatter_ratio = 0.5;
  // CUDA: each (shape, batch) of whole-matrix Newton-Schulz is captured once into a CUDA graph and
  // replayed (ns_graphs.h): the host cost of an NS call drops from ~30 launches to one. Ignored on
  // the CPU and in CPU-only builds; DMUON_NS_CUDA_GRAPHS=0 overrides it to off. Same results.
  bool ns_cuda_graphs = true;
  // After step(): issue the first K boundaries' forward unshards of the next forward (the recorded
  // forward order of the last pass) so they overlap the tail of the step and whatever the trainer
  // does before its next forward; that forward then only waits them. 0 (default): the next forward
  // issues its own (forward_prefetch_depth ahead). post_step_prefetch_sharded_adamw: the same for
  // the sharded_adamw all-gathers of those boundaries (of the first one when K is 0). Same results
  // and the same bytes per step: the collectives move from the forward into step(). No effect on the
  // DDP path (no unshards) or before a forward order is recorded. Collective.
  int post_step_prefetch_groups = 0;
  bool post_step_prefetch_sharded_adamw = false;
  // The sharded_adamw all-gathers on a group of their own (the mesh's sharded_unshard group, which the
  // caller adds with Mesh::set_sharded_unshard_group; the Python Muon builds it), apart from the
  // dedicated broadcasts: on NCCL their own stream, on Gloo their own connections, so neither waits
  // behind the other. Same results and bytes. false: both on the shard group.
  bool sharded_adamw_unshard_separate_stream = false;
  // Multi-tensor element-wise kernels, as torch.optim's `fused` / `foreach`: one call per list of
  // parameters instead of several per parameter (the many small tensors of a model are launch-bound
  // on a GPU, dispatch-bound on the CPU). fused: AdamW through LibTorch's fused kernel
  // (at::_fused_adamw_; LibTorch >= 2.0 on CUDA, >= 2.4 on the CPU), one call per (parameter group,
  // device, dtype); unset: wherever LibTorch has it (3-7x faster AdamW on the CPU too, docs/PERF.md).
  // foreach: Muon's element-wise work through _foreach_ ops: the momentum, the finiteness check of
  // the gradients (one _foreach_norm per dtype) and the weight update after each batched NS; unset:
  // on CUDA (on the CPU the per-matrix host loops are as fast). fused=true where LibTorch has no fused kernel for the parameters' device is
  // an error at construction. A tensor the kernel cannot take (non-contiguous, moments in another
  // dtype) takes the per-parameter path. Same results up to rounding (float64: ~1e-16 relative per
  // step); StepProfile counts the updates each kernel did.
  std::optional<bool> fused;
  std::optional<bool> foreach;
};

// The split of the last step (milliseconds), when record_step_profile is on: host clocks on the
// CPU; CUDA events on the GPU (device time of each phase on the current stream; read, with one
// synchronize, by consume_last_step_profile -- the step itself gains no sync). Overhead: two
// steady_clock reads per span on the host (tens of ns); two event records per span on CUDA (a few
// us of host time each, one span per owned matrix for ns_ms). to_json (diagnostics.h) gives JSON.
struct StepProfile {
  double prepare_ms = 0;   // waiting for gradient reduces / all-reduces (HSDP: stage 2 too)
  double muon_ms = 0;      // momentum + Newton-Schulz + update on owned matrices
  double ns_ms = 0;        // of which Newton-Schulz
  double adamw_ms = 0;
  double publish_ms = 0;   // issuing the post-step publish (waiting it too when synchronous)
  double total_ms = 0;
  double host_total_ms = 0;  // the step's host time (equal to total_ms with host clocks)
  std::string clock = "host";  // "host" | "cuda_events"
  int owned_updates = 0;   // matrices this rank updated
  int tp_gathered = 0;     // TP-split matrices orthogonalised by gather / NS on the TP owner / scatter
  int tp_distributed = 0;  // TP-split matrices orthogonalised by the distributed Gram form
  double ns_flops = 0;     // plain-GEMM FLOP estimate of this rank's NS work
  int adamw_fused = 0;       // AdamW updates done by the fused kernel (MuonOptions::fused)
  int momentum_foreach = 0;  // Muon momentum updates done by _foreach_ ops (MuonOptions::foreach)
  int update_foreach = 0;    // Muon weight updates W (1 - lr wd) - lr s NS(u) done by _foreach_ ops
  int64_t step = 0;        // the optimizer step this profile belongs to (1-based)
  bool valid = false;
};

namespace detail {
class PhaseClock;
// The one way io and clipping write Muon's internals (defined below the class).
struct MuonInternals;
}

// Raised by Muon::step on every rank when a Muon matrix's averaged gradient holds NaN or Inf (or overflows) on
// any rank: that matrix is skipped (weights and momentum kept), the step's other updates are applied and
// counted, then every rank raises this, naming the matrix and the rank that saw it. A c10::Error, so
// `catch (const c10::Error&)` still catches it; Python: dmuon.NonFiniteGradientError (a RuntimeError).
class NonFiniteGradientError : public c10::Error {
 public:
  using c10::Error::Error;
};

class Muon : public torch::optim::Optimizer {
 public:
  // `model` must have gone through dedicate_params (a 1-rank mesh works for single-process use).
  // collective (the world, once): the ranks agree on every option that decides the math or the
  // collectives (hyperparameters, param groups, ns backend, prefetch and overlap settings); one that
  // differs is a ValueError on every rank naming it.
  explicit Muon(const std::shared_ptr<torch::nn::Module>& model, MuonOptions options = {});
  // The optimizer of a model dedicated from a ModelView (dedicate_model_view in model_view.h).
  explicit Muon(const std::shared_ptr<RuntimeFace>& runtime, MuonOptions options = {});
  ~Muon() override;  // (the runtime learns it holds none of the gradients any more)

  at::Tensor step(LossClosure closure = nullptr) override;
  // Clears gradients; set_to_none=true (default) leaves them undefined, as PyTorch 2.x does.
  void zero_grad(bool set_to_none = true);
  // LibTorch's optimizer archive (torch::save(opt, path) / torch::load(opt, path)) of this rank's own state,
  // with the rank, world size, plan fingerprint and steps_taken: load() refuses a file of another rank or plan
  // (a ValueError, before anything changes). To resume on another mesh: save_checkpoint / load_checkpoint.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  const MuonOptions& muon_options() const { return options_; }
  // null once destroyed, and for a model dedicated from a ModelView
  std::shared_ptr<torch::nn::Module> model() const { return model_.lock(); }
  const NewtonSchulz& ns() const { return ns_; }
  Mesh& mesh() const;  // the mesh the model was dedicated on
  // The NS runner of the whole matrices (its stats() count graph captures, replays and eager calls).
  const NsGraphs& ns_graphs() const { return *ns_graphs_; }
  // The last step's profile; resets it.
  StepProfile consume_last_step_profile();
  // Gradient-norm clipping between backward and step (grad_clip.h; collective).
  MuonGradClipStats clip_grad_norm_(std::optional<double> max_norm, const GradClipOptions& opts = {});
  // The argument agreement clip_grad_norm_ begins with, alone (collective, every rank): for a front end whose
  // own strategy clips after it, or whose own checks refused this rank's arguments -- `refusal`, the reason,
  // then raises on every rank (not only here, leaving the others in the next collective until the timeout).
  void agree_clip_arguments(std::optional<double> max_norm, const GradClipOptions& opts,
                            const std::string& refusal = "") const;
  const std::optional<MuonGradClipStats>& last_muon_grad_clip_stats() const { return last_clip_; }
  // collective (waits the gradient reduces, as step() would): the live gradients in `scope` that
  // the next step() uses -- scale or read them in place -- each with whether this rank counts it
  // in a norm (each element once over the mesh; see grad_clip.h). zero_grad() drops them.
  std::vector<ClipGrad> clip_grads(ClipScope scope);
  // Number of optimizer steps taken.
  int64_t steps_taken() const { return steps_; }
  // Per-parameter state of `p` (nullptr when none yet / not on this rank).
  const MuonParamState* state_of(const at::Tensor& p) const;

 private:
  // `model`: the LibTorch model (its parameters are checked to be the runtime's), or null
  Muon(const std::shared_ptr<RuntimeFace>& runtime, MuonOptions options, const torch::nn::Module* model);
  friend struct detail::MuonInternals;  // checkpoint restore and segmented clipping write through it
  // Muon on an owned matrix: momentum, Newton-Schulz, update of its target (the master copy under
  // mixed precision, rounded into the parameter).
  // TP: the T owners of a matrix orthogonalise it together over mesh.tp() (collective); the gather
  // form's gathers are queued in `run` and their NS and scatters issued before the publish; whole
  // matrices' NS is queued in `run` and batched by shape at the end of their group.
  struct StepRun;       // step()'s visitor of the runtime's gradient groups (muon.cpp)
  // `g` is the gradient in the optimizer's dtype; `momentum_done`: StepRun's multi-tensor momentum
  // updated the buffer already. (AdamW: StepRun::adamw.)
  void muon_update(const ReadyGrad& r, const at::Tensor& g, bool momentum_done, const MuonGroupOptions& o,
                   Mesh& mesh, StepProfile& prof, detail::PhaseClock& clock, StepRun& run);
  MuonParamState& state_for(const at::Tensor& p);
  void index_groups();  // group_of_ for the current param_groups_

  // the dedicated model's runtime (errors name `fn` when the model or runtime is gone)
  std::shared_ptr<RuntimeFace> runtime(const char* fn) const;
  // runtime(fn), refused when a later optimizer was built on it (what takes the gradients: step, clipping)
  std::shared_ptr<RuntimeFace> stepping_runtime(const char* fn) const;

  std::weak_ptr<torch::nn::Module> model_;  // the LibTorch model, when built from one
  bool has_model_ = false;
  std::weak_ptr<RuntimeFace> runtime_;      // otherwise: the runtime of a ModelView
  MuonOptions options_;
  NewtonSchulz ns_;
  std::shared_ptr<NsGraphs> ns_graphs_;  // ns_ for whole matrices, CUDA-graph replayed where it applies
  std::shared_ptr<TpScratch> tp_scratch_;  // the TP exchange's kept buffers (DedicateOptions::tp_buffer_reuse)
  bool check_finite_ = true;  // the configured NsOptions::check_finite, applied once per step
  std::map<const c10::TensorImpl*, size_t> group_of_;  // parameter -> index in param_groups_
  size_t group_of_count_ = 0;                         // parameters grouped when group_of_ was built
  StepProfile last_profile_;
  std::shared_ptr<detail::PhaseClock> last_clock_;  // its timings until consumed (CUDA events resolve late)
  std::optional<MuonGradClipStats> last_clip_;
  // gradients clip_grad_norm_ took from the runtime for this step (step() uses them, zero_grad drops them)
  std::shared_ptr<std::vector<ReadyGrad>> taken_;
  uint64_t taken_epoch_ = 0;  // the runtime's grads_epoch when taken_ was taken (stale after a change)
  int64_t steps_ = 0;
  int progress_logged_ = 0;
  uint64_t attachment_ = 0;  // RuntimeFace::attach_optimizer's number for this optimizer
};

namespace detail {
struct MuonInternals {
  static MuonParamState& param_state(Muon& m, const at::Tensor& p) { return m.state_for(p); }  // created when absent
  static void set_steps_taken(Muon& m, int64_t steps) { m.steps_ = steps; }
  static void set_last_clip(Muon& m, MuonGradClipStats s) { m.last_clip_ = std::move(s); }
};
}  // namespace detail

}  // namespace dmuon
