// Internal: the runtime dedicate_params attaches to a model -- a small scheduler over routes.
//
//   Muon::step ──► Runtime::prepare_grads / take_ready_grads / publish
//                     │  boundary schedule: pass, forward order, reduce order, NoSync
//                     ▼
//   routes:  DedicatedRoute (Muon matrices)  ShardedRoute (sharded_adamw)  ReplicatedRoute (DDP buckets)
//                     │
//                     ▼
//   Communicator (shard / replicate / world groups of the Mesh)
//
// The Runtime knows boundaries and when things happen; each route knows how its parameters are
// unsharded, reduced, accumulated, installed and published. Every route is called at the same
// points in the same order on every rank (dedicated, sharded, replicated), which keeps the
// collectives of all ranks in one order.
//
// Lifetimes: the registry (registry.cpp) holds a Runtime while its model lives. Hooks registered on
// autograd nodes and the identity functions around boundaries hold a std::weak_ptr<Runtime> (or its
// id, resolved through the registry): a graph or hook that outlives the model does nothing.
//
// Threading: autograd may call hooks from its worker threads; every entry point takes the
// Runtime's recursive mutex. The collectives themselves are issued in program order of the hooks,
// which autograd runs in the same order on every rank.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/communicator.h"
#include "dmuon/dedicate.h"
#include "dmuon/mesh.h"
#include "dmuon/owner_plan.h"
#include "dmuon/unshard_profile.h"
#include "runtime/precision.h"
#include "runtime/route.h"

namespace dmuon {

class DedicatedRoute;
class ShardedRoute;
class ReplicatedRoute;

// A hook boundary's schedule state (what its routes keep per boundary lives in the routes).
struct Boundary {
  std::string name;
  std::weak_ptr<torch::nn::Module> module;
  int index = 0;                    // model order
  int num_params = 0;               // routed parameters whose gradient accumulation reports here
  // per backward pass
  bool ran_forward = false;         // entered in the current forward pass
  bool ran_since_backward = false;  // entered in any forward since the last backward (reduce set)
  int post_expected = 0;            // post-backward hooks installed since the last backward (uses)
  int post_fired = 0;
  bool grads_ready = false;         // post-backward fired or all params accumulated
  int accumulated = 0;
  bool reduced = false;
  bool in_forward = false;
  // mixed precision (from the policies of the boundary's parameters)
  std::optional<at::ScalarType> input_dtype;   // cast floating forward arguments to this
  std::optional<at::ScalarType> output_dtype;  // cast the tensor output to this
};

class Runtime : public std::enable_shared_from_this<Runtime> {
 public:
  Runtime(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<Mesh> mesh, DedicateOptions opts, bool ddp);
  ~Runtime();

  // ---- setup (build.cpp) ----
  // collective: fingerprint exchange, initial values of the owners / rank 0.
  void build(const ParamPredicate& predicate);
  // dmuon::replicate (tp: replicate_tp). collective: rank 0's initial values.
  void add_replicated(double bucket_mb, bool tp);

  // ---- hooks (runtime.cpp; collective where they issue unshards and reduces) ----
  void begin_root_forward();
  void pre_forward(int b);
  void post_forward(int b);
  void pre_backward(int b);
  void post_backward(int b);
  void note_post_hook(int b);                  // a use of boundary b whose backward fires post_backward
  void note_accumulated(bool& accumulated, int b);  // a parameter of b got its gradient (its own bit)
  void note_backward();                        // some hook ran in backward: queue the end-of-backward
  std::string bypass_hint() const;             // names a boundary not entered in the current forward

  // ---- optimizer interface (collective: every rank) ----
  // wait reduces; owners get averaged grads. dedicated=false leaves the dedicated route to its
  // per-group calls (DedicatedRoute::prepare_group / finish_group: Muon::step's group_prepare_ahead)
  void prepare_grads(bool dedicated = true);
  // prepare_grads for every route, the dedicated one group by group in publish order (each group's
  // stage 1 waited and stage 2 issued one group ahead of the group being finished)
  void prepare_grads_per_group();
  std::vector<ReadyGrad> take_ready_grads(bool dedicated = true);  // after prepare_grads: what this rank updates
  void publish(bool async);                    // after the update
  void wait_publishes();                       // local: waits every in-flight publish / unshard
  void drain_all();                            // waits every in-flight collective of this model
  // zero_grad: waits the gradient collectives already in flight (every rank issued them) and drops
  // every gradient dmuon holds; issues no collective.
  void discard_grads();
  void set_no_sync(bool on);

  // ---- queries ----
  Mesh& mesh() const { return *mesh_; }
  const std::shared_ptr<Mesh>& mesh_ptr() const { return mesh_; }
  const DedicateOptions& options() const { return opts_; }
  std::shared_ptr<torch::nn::Module> model() const { return model_.lock(); }
  bool ddp() const { return ddp_; }
  bool z3() const { return opts_.reshard_after_forward && !ddp_; }
  bool no_sync() const { return no_sync_; }
  bool boundaries_seen() const { return boundaries_seen_; }
  int64_t pass() const { return pass_; }
  // the recorded forward order, then every other boundary in model order (post-step publishes)
  std::vector<int> publish_order() const;
  const std::vector<Boundary>& boundaries() const { return boundaries_; }
  const OwnerPlan& plan() const { return plan_; }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  const std::vector<std::string>& boundary_of_param() const { return boundary_of_param_; }
  // every TP-split parameter of the model (full name -> split dimension), found once by build()
  const std::map<std::string, int>& tp_split() const { return tp_split_; }
  // The box of `name`'s full value this TP rank holds (the whole value without a TP split).
  TensorRegion region_of(const std::string& name, at::IntArrayRef local_shape) const;
  // Writes the box `region` of `name` into `out` from `source` (converting dtype and device). A
  // failure (a missing or damaged tensor, a read error) is recorded, not thrown, so every rank still
  // reaches the same collectives; agree_fills() then throws on every rank when any rank failed.
  void fill_from(ParamSource& source, const std::string& name, const TensorRegion& region, at::Tensor& out);
  // collective (the world): throws on every rank, naming the ranks that failed and this rank's
  // error, when a fill_from since the last call failed anywhere.
  void agree_fills(const std::string& what);
  // setup only: checks the deferred parameters against the source and mixes which are deferred
  // into the fingerprint `digest`
  void check_deferred(const torch::nn::Module& model, uint64_t& digest);
  // setup only: the source of deferred parameters (DedicateOptions::param_source; null when none is deferred)
  ParamSource* deferred_source() const { return deferred_source_; }
  Precision precision_of(const at::Tensor& p) const;  // plain (own dtype) without a policy
  at::Tensor master_of(const at::Tensor& p) const;    // undefined when p has no master on this rank
  // p's gradient for the optimizer: the update targets p's master when it has one here, else p
  ReadyGrad ready_grad(RouteKind route, const std::string& name, const at::Tensor& p, const Precision& prec) const;
  bool has_masters() const { return !masters_.empty(); }
  void set_master(const at::Tensor& p, at::Tensor master) { masters_[p.unsafeGetTensorImpl()] = std::move(master); }
  bool routed(const std::string& name) const;          // dedicated or sharded_adamw
  std::vector<ParamView> describe() const;              // every trainable parameter, model order
  DedicatedRoute& dedicated() const { return *dedicated_; }
  ShardedRoute& sharded() const { return *sharded_; }
  ReplicatedRoute* replicated() const { return replicated_; }
  std::recursive_mutex& mutex() const { return mu_; }
  uint64_t id() const { return id_; }
  // unshard_profile.h: per-boundary unshard counters (empty unless recording)
  bool recording_unshards() const { return !unshard_stats_.empty(); }
  std::vector<BoundaryUnshardStats> unshard_stats(bool clear);
  int64_t profiled_passes() const { return profiled_passes_; }
  void reset_post_forward_order();

 private:
  // Every TP module was built on this runtime's mesh; returns their split parameters (full name ->
  // split dimension).
  std::map<std::string, int> check_tp_modules(const torch::nn::Module& model) const;
  void begin_forward_pass();
  // every route's unshard of boundary b (counted when recording), and the wait for it
  void issue_unshards(int b, const char* phase, bool backward, bool prefetch);
  void wait_unshards(int b, bool backward);
  void prefetch_after(int b, bool backward);
  void try_issue_reduces();
  void issue_reduce(int b);
  void release(int b);
  void end_of_backward();
  const std::vector<Route*>& routes() const { return routes_; }

  std::weak_ptr<torch::nn::Module> model_;
  std::shared_ptr<Mesh> mesh_;
  DedicateOptions opts_;
  bool ddp_ = false;
  uint64_t id_ = 0;
  OwnerPlan plan_;
  std::vector<ParamSpec> specs_;               // planner input, per dedicated param
  std::vector<std::string> boundary_of_param_;  // hook boundary name, per dedicated param
  std::string fill_error_;  // the first failed fill_from since agree_fills
  ParamSource* deferred_source_ = nullptr;
  std::map<std::string, int> tp_split_;         // TP-split parameters (build)
  std::vector<Boundary> boundaries_;
  std::unique_ptr<DedicatedRoute> dedicated_;
  std::unique_ptr<ShardedRoute> sharded_;
  std::vector<std::unique_ptr<Route>> extra_routes_;  // replicated (and future routes), in add order
  ReplicatedRoute* replicated_ = nullptr;
  std::vector<Route*> routes_;                 // every route, in the order they are called
  // trainable parameters on no distributed route (cached at the first take_ready_grads)
  std::optional<std::vector<std::pair<std::string, at::Tensor>>> local_params_;
  // mixed precision: the resolved policy of every parameter dedicate_params cast or gave a master,
  // and the master copies this rank updates (owned Muon matrices: views into the packed master;
  // replicated parameters). A sharded_adamw parameter's master is its shard.
  std::map<const c10::TensorImpl*, Precision> precision_;
  std::map<const c10::TensorImpl*, at::Tensor> masters_;

  mutable std::recursive_mutex mu_;
  bool no_sync_ = false;
  bool boundaries_seen_ = false;          // the model runs its boundaries through dmuon::forward
  int64_t pass_ = 0;                      // forward pass counter
  std::vector<int> current_order_;        // boundaries entered in the current forward pass
  std::vector<int> recorded_order_;       // the previous pass's order (prefetch schedule)
  bool backward_since_forward_ = true;
  bool callback_queued_ = false;
  size_t next_reduce_ = 0;                // position in reduce_order_
  std::vector<int> reduce_order_;         // reverse of current_order_, fixed at the first backward hook
  bool reduce_order_fixed_ = false;
  std::vector<BoundaryUnshardStats> unshard_stats_;  // per boundary, when recording
  int64_t profiled_passes_ = 0;
};

namespace detail {
// ---- registry (registry.cpp) ----
std::shared_ptr<Runtime> state_of_model(const torch::nn::Module* model);
// state_of_model, or an error naming `fn` when the model was not dedicated
std::shared_ptr<Runtime> require_state(const torch::nn::Module& model, const char* fn);
std::pair<std::shared_ptr<Runtime>, int> boundary_of_module(const torch::nn::Module* module);
std::shared_ptr<Runtime> runtime_by_id(uint64_t id);
uint64_t next_runtime_id();
void register_state(const std::shared_ptr<torch::nn::Module>& model, const std::shared_ptr<Runtime>& state);
void register_boundary(const std::shared_ptr<torch::nn::Module>& module, const std::shared_ptr<Runtime>& s, int b);
// Runs `fn` each time autograd has accumulated `param`'s gradient. Returns the accumulator node:
// keep it alive (autograd holds it only weakly) and create it while `param` has its full shape
// (the node caches it). Throws naming `name` and `rank` when `param` is not a leaf requiring grad.
std::shared_ptr<torch::autograd::Node> on_grad_accumulated(const at::Tensor& param, const std::string& name, int rank,
                                                           std::function<void()> fn);
// on_grad_accumulated for a route: `fn` runs with the Runtime locked, and not at all once the
// Runtime is gone (the hook holds a weak_ptr).
std::shared_ptr<torch::autograd::Node> on_grad_accumulated(Runtime& rt, const at::Tensor& param,
                                                           const std::string& name, std::function<void(Runtime&)> fn);
// resize a tensor's StorageImpl in place (every view and saved tensor sees it)
void resize_storage_bytes(const at::Tensor& t, size_t bytes);
void restore_storage(const at::Tensor& t);  // resize back to the tensor's full size
}  // namespace detail

}  // namespace dmuon
