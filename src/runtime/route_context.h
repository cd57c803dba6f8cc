// Internal: what a route sees of the model it trains -- and all it sees. Routes never see the
// Runtime: they read the mesh, the options, the boundary names and the schedule's pass counter and
// forward order here; they keep the master copies of mixed precision here; they read parameter
// values (setup, checkpoints) and register gradient hooks through it.
//
// The Runtime owns one RouteContext and writes its schedule fields (`schedule`, the boundary
// names); everything else is set during setup. Threading as the routes: under the Runtime's mutex.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/dedicate.h"
#include "dmuon/deferred_init.h"
#include "dmuon/mesh.h"
#include "runtime/precision.h"
#include "runtime/route.h"

namespace dmuon {

// How the collectives of a full state dict (gather_full / gather_state) name themselves: a timeout there is
// most often a rank that skipped the call (`if rank == 0: get_..._state_dict(...)`), so they say it is collective.
inline const std::string kCheckpointWhat =
    "checkpoint (a full state dict is collective: every rank calls get_model_state_dict / get_optimizer_state_dict / "
    "opt.state_dict(), not rank 0 alone): ";


// Route::check_params's refusal says this (a forward's error that is not the bypass the boundary hint is about)
inline constexpr const char* kReplacedParamText = "no longer holds the data dmuon gave it";

// What a gradient hook reports to the schedule (the Runtime implements it).
class GradEvents {
 public:
  virtual ~GradEvents() = default;
  // a parameter of boundary b got its gradient; `flag` is the parameter's own "reported" bit
  virtual void accumulated(bool& flag, int b) = 0;
  // some gradient of this model was accumulated (queues the end-of-backward callback)
  virtual void backward_ran() = 0;
  // boundary b's reduce went out in this backward: a gradient arriving for its parameters now is not in it
  // (and, on a rank whose parameter is released, has nowhere to go). Warns once per boundary.
  virtual bool after_reduce(int b) = 0;
};

using GradHook = std::function<void(GradEvents&)>;
// Runs as a gradient arrives, before autograd adds it to param.grad(); false drops the gradient.
using GradArrival = std::function<bool(GradEvents&)>;
// Registers `hook` to run (under the schedule's lock, and not at all once the model is gone) each
// time autograd has accumulated `param`'s gradient, and `before` (when set; under the lock too) each
// time a gradient for `param` arrives, before autograd adds it to param.grad(); returns the
// accumulator node to keep alive.
using GradHookFactory = std::function<std::shared_ptr<torch::autograd::Node>(
    const at::Tensor& param, const std::string& name, GradHook hook, GradArrival before)>;

// The schedule's state the routes read (written by the Runtime only).
struct ScheduleState {
  int64_t pass = 0;                 // forward pass counter: an unshard is current when issued in this pass
  bool boundaries_seen = false;     // the model runs its boundaries through dmuon::forward
  std::vector<int> current_order;   // boundaries entered in the current forward pass
  std::vector<int> recorded_order;  // the previous pass's order
};

class RouteContext {
 public:
  RouteContext(std::shared_ptr<Mesh> mesh, DedicateOptions opts, bool ddp)
      : mesh_(std::move(mesh)), opts_(std::move(opts)), ddp_(ddp) {}

  Mesh& mesh() const { return *mesh_; }
  const std::shared_ptr<Mesh>& mesh_ptr() const { return mesh_; }
  const DedicateOptions& options() const { return opts_; }
  void set_forward_prefetch_depth(int depth) { opts_.forward_prefetch_depth = depth; }  // Runtime only
  // After setup (Runtime only): the options' callables and parameter source are setup's alone. Kept, they would
  // keep what they capture alive with the model (in Python a resolver over the model's modules: a cycle
  // through C++ that the garbage collector cannot see, so the model would never be freed).
  void drop_setup_callables() {
    opts_.hook_boundary_predicate = nullptr;
    opts_.hook_boundary_resolver = nullptr;
    opts_.assignment_group_key_fn = nullptr;
    opts_.param_policy_fn = nullptr;
    opts_.route_hint_fn = nullptr;
    opts_.param_source = nullptr;
  }
  // the sharded_adamw all-gathers on the mesh's sharded_unshard group (Runtime only)
  void set_separate_sharded_unshard(bool on) { separate_sharded_unshard_ = on; }
  Communicator& sharded_unshard_group() const {
    return separate_sharded_unshard_ ? mesh_->sharded_unshard() : mesh_->shard();
  }
  bool ddp() const { return ddp_; }  // dedicate_params_ddp: every rank keeps full matrices
  bool z3() const { return opts_.reshard_after_forward && !ddp_; }

  // ---- boundaries and the schedule ----
  const std::string& boundary_name(int b) const { return boundary_names_[static_cast<size_t>(b)]; }
  int num_boundaries() const { return static_cast<int>(boundary_names_.size()); }
  void add_boundary(std::string name) { boundary_names_.push_back(std::move(name)); }
  ScheduleState schedule;
  int64_t pass() const { return schedule.pass; }
  bool boundaries_seen() const { return schedule.boundaries_seen; }
  // the recorded forward order, then every other boundary in model order (post-step publishes); the DDP
  // path: model order (its ranks may run different blocks)
  std::vector<int> publish_order() const;

  // ---- mixed precision ----
  Precision precision_of(const at::Tensor& p) const;  // plain (own dtype) without a policy
  void set_precision(const at::Tensor& p, const Precision& prec) { precision_[p.unsafeGetTensorImpl()] = prec; }
  at::Tensor master_of(const at::Tensor& p) const;    // undefined when p has no master on this rank
  // Route::check_params for one parameter: `param` (boundary b's `name`) still holds the storage of one of
  // `given` (what the route set it to: its buffer, its placeholder) and the dtype of the first; else an
  // error saying what replaced it and how to load values instead (local); `during` names the call (empty: the
  // forward of boundary b)
  void require_given_storage(int b, const std::string& name, const at::Tensor& param,
                             std::initializer_list<const at::Tensor*> given, const std::string& during) const;
  void set_master(const at::Tensor& p, at::Tensor master) { masters_[p.unsafeGetTensorImpl()] = std::move(master); }
  bool has_masters() const { return !masters_.empty(); }
  // p's gradient for the optimizer: the update targets p's master when it has one here, else p.
  // `counted` / `counts_param`: this rank counts the gradient's elements / the parameter in a global
  // norm (before the TP rule, which this applies: a parameter whole on every TP rank counts on TP rank 0).
  ReadyGrad ready_grad(const std::string& name, const at::Tensor& p, const Precision& prec, bool muon, bool counted,
                       bool counts_param) const;

  // ---- tensor parallelism ----
  const std::map<std::string, int>& tp_split() const { return tp_split_; }  // TP-split params -> split dim
  void set_tp_split(std::map<std::string, int> split) { tp_split_ = std::move(split); }
  // The box of `name`'s full value this TP rank holds (the whole value without a TP split).
  TensorRegion region_of(const std::string& name, at::IntArrayRef local_shape) const;

  // ---- parameter values (setup, checkpoints) ----
  // Writes the box `region` of `name` into `out` from `source` (converting dtype and device). A
  // failure (a missing or damaged tensor, a read error) is recorded, not thrown, so every rank still
  // reaches the same collectives; agree_fills() then throws on every rank when any rank failed.
  void fill_from(ParamSource& source, const std::string& name, const TensorRegion& region, at::Tensor& out);
  // Work that uses what the fills wrote (a master copied into the forward copy, shards scattered; it may be
  // collective, in the same order on every rank): at once, or nothing in a dry run.
  void after_fills(std::function<void()> work);
  // A dry run, up to agree_fills: fill_from reads (and so verifies: a checkpoint's checksums) into scratch and
  // writes nothing, after_fills drops its work. A load into values the model has (set_model_state_dict) runs
  // the fills dry first, so a damaged tensor one rank finds leaves every rank's model as it was instead of
  // half-loaded; it costs a second read of what this rank keeps, one tensor at a time in host memory.
  void begin_dry_fills() { dry_ = true; }
  // collective (the world): throws on every rank, naming the ranks that failed and this rank's
  // error, when a fill_from since the last call failed anywhere (after a dry run: saying nothing was written).
  void agree_fills(const std::string& what);
  // setup only: the source of deferred parameters (null when none is deferred)
  ParamSource* deferred_source() const { return deferred_source_; }
  void set_deferred_source(ParamSource* source) { deferred_source_ = source; }

  // ---- hooks ----
  std::shared_ptr<torch::autograd::Node> on_grad_accumulated(const at::Tensor& param, const std::string& name,
                                                             GradHook hook, GradArrival before = {}) const {
    return hooks_(param, name, std::move(hook), std::move(before));
  }
  void set_hook_factory(GradHookFactory f) { hooks_ = std::move(f); }

 private:
  std::shared_ptr<Mesh> mesh_;
  DedicateOptions opts_;
  bool ddp_ = false;
  bool separate_sharded_unshard_ = false;
  std::vector<std::string> boundary_names_;
  // the resolved policy of every parameter dedicate_params cast or gave a master, and the master
  // copies this rank updates (owned Muon matrices: views into the packed master; replicated
  // parameters). A sharded_adamw parameter's master is its shard.
  std::map<const c10::TensorImpl*, Precision> precision_;
  std::map<const c10::TensorImpl*, at::Tensor> masters_;
  std::map<std::string, int> tp_split_;
  std::string fill_error_;  // the first failed fill_from since agree_fills
  bool dry_ = false;         // begin_dry_fills .. agree_fills
  ParamSource* deferred_source_ = nullptr;
  GradHookFactory hooks_;
};

}  // namespace dmuon
