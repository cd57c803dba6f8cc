// Internal: the runtime dedicate_params attaches to a model -- a small scheduler over routes.
//
//   Muon::step ──► Runtime::prepare_grads / take_ready_grads / publish
//                     │  boundary schedule: pass, forward order, reduce order, NoSync
//                     ▼
//   routes:  DedicatedRoute (Muon matrices)  the route table's (ShardedRoute: sharded_adamw)
//            ReplicatedRoute (dmuon::replicate's buckets)  LocalRoute (the rest)
//                     │
//                     ▼
//   Communicator (shard / replicate / world groups of the Mesh)
//
// The Runtime knows boundaries and when things happen; each route knows how its parameters are
// unsharded, reduced, accumulated, installed and published. Every route is called at the same
// points in the same order on every rank (dedicated, the table's, replicated, local), which keeps the
// collectives of all ranks in one order.
//
// Lifetimes: the registry (registry.cpp) holds a Runtime while its model lives. Hooks registered on
// autograd nodes and the identity functions around boundaries hold a std::weak_ptr<Runtime> (or its
// id, resolved through the registry): a graph or hook that outlives the model does nothing.
//
// The layers above see the Runtime only through RuntimeFace (runtime_face.h); the routes see only
// their RouteContext (route_context.h).
//
// Threading: autograd may call hooks from its worker threads; every entry point takes the
// Runtime's recursive mutex (private: nothing outside the Runtime locks it). The collectives
// themselves are issued in program order of the hooks,
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
#include "dmuon/model_view.h"
#include "dmuon/owner_plan.h"
#include "device/device_spans.h"
#include "dmuon/unshard_profile.h"
#include "runtime/precision.h"
#include "runtime/route.h"
#include "runtime/route_context.h"
#include "runtime/runtime_face.h"
#include "runtime/storage.h"

namespace dmuon {

class DedicatedRoute;
class ReplicatedRoute;
class LocalRoute;

// A hook boundary's schedule state (what its routes keep per boundary lives in the routes).
struct Boundary {
  std::string name;
  std::weak_ptr<torch::nn::Module> module;
  int index = 0;                    // model order
  int num_params = 0;               // routed parameters whose gradient accumulation reports here
  // per backward pass
  bool ran_forward = false;         // entered in the current forward pass
  bool ran_since_backward = false;  // entered in any forward since the last backward (reduce set)
  int post_expected = 0;            // uses in grad mode since the last backward (hooked or not)
  // the last backward's post_expected: a backward again through its retained graph (retain_graph=True, no
  // forward since) runs every use's hook again, so it expects as many
  int retained_uses = 0;
  int post_fired = 0;
  bool grads_ready = false;         // post-backward fired or all params accumulated
  int accumulated = 0;
  bool reduced = false;
  bool warned_late = false;  // a gradient arrived after its reduce (said once per boundary)
  bool in_forward = false;
  bool recomputing = false;  // its forward runs inside backward (activation checkpointing): not released after
  int uncounted_uses = 0;    // uses without grad mode since the last backward (a recompute may count them)
  // mixed precision (from the policies of the boundary's parameters)
  std::optional<at::ScalarType> input_dtype;   // cast floating forward arguments to this
  std::optional<at::ScalarType> output_dtype;  // cast the tensor output to this
};

class Runtime final : public RuntimeFace, public GradEvents, public std::enable_shared_from_this<Runtime> {
 public:
  // `view`: the model as data (model_view.h); `module`: the LibTorch module it was made from, if any
  Runtime(ModelView view, std::shared_ptr<torch::nn::Module> module, std::shared_ptr<Mesh> mesh, DedicateOptions opts,
          bool ddp);
  ~Runtime();

  // ---- setup (build.cpp) ----
  // collective: fingerprint exchange, initial values of the owners / rank 0. `precheck` (the caller's checks
  // of its arguments) runs first, inside the plan agreement: one rank's refusal fails every rank, no hang.
  void build(const ParamPredicate& predicate, const std::function<void()>& precheck = {});
  // dmuon::replicate (tp: replicate_tp). collective: rank 0's initial values.
  void add_replicated(double bucket_mb, bool tp);
  // Trainable parameters on the local route that another data-parallel wrapper replaced after
  // dedicate_params (FSDP2's fully_shard): forgotten (no optimizer state, no checkpoint entry).
  // Throws naming one that is on a dmuon route. Local.
  void release_external(const std::vector<std::string>& names);
  // the master copy this rank keeps of parameter `name` (undefined where it keeps none). Local.
  at::Tensor master_of(const std::string& name) const;

  // ---- hooks (runtime.cpp; collective where they issue unshards and reduces) ----
  bool begin_root_forward();  // returns the grad mode of a root forward running around it (for end_root_forward)
  // note_backward's refusal of torch.autograd.grad(..., create_graph=True) through a model whose parameters a
  // backward frees (every rank, at the pass's first hook: before any collective)
  void refuse_graph_building_partial_backward();
  // the model's gradients were cleared without the optimizer: drop dmuon's too
  void drop_grads_if_cleared(bool in_backward);
  void end_root_forward(bool outer_grad_mode);  // the root's scope was left (or its forward raised)
  void pre_forward(int b);
  void post_forward(int b);
  void pre_backward(int b);
  // pre_backward(b) once per backward pass for the hooks sharing `last` (the outputs of one use of a
  // boundary): the first to fire in a pass runs it and records the pass in `last`.
  void pre_backward_once(int b, std::weak_ptr<void>& last);
  void post_backward(int b);
  // a use of boundary b (in grad mode, its backward may fire post_backward); a recompute inside backward
  // counts only a use that ran without grad mode before (a reentrant checkpoint's first run)
  void note_use(int b, bool grad_mode);
  void note_accumulated(bool& accumulated, int b);  // a parameter of b got its gradient (its own bit)
  // some hook ran in backward: queue the end-of-backward; engine_hook false: a checkpoint's recompute (its grad
  // mode is not the backward's create_graph)
  void note_backward(bool engine_hook = true);
  // GradEvents (route hooks; called under the lock)
  void accumulated(bool& flag, int b) override { note_accumulated(flag, b); }
  void backward_ran() override { note_backward(); }
  bool after_reduce(int b) override;
  std::string bypass_hint() const;             // names a boundary not entered in the current forward

  // ---- RuntimeFace: the optimizer (collective: every rank) ----
  void prepare_grads() override { prepare_grads(true); }
  void require_reduced_grads(const char* fn) const override;
  std::vector<ReadyGrad> take_ready_grads() override { return take_ready_grads(true); }
  void step(bool group_prepare_ahead, bool async, std::optional<std::vector<ReadyGrad>> taken,
            StepVisitor& v) override;
  void defer_update(const std::string& name, std::function<void()> apply) override;
  void prefetch_next_forward(int groups, bool sharded_adamw) override;
  void set_separate_sharded_unshard(bool on) override;
  void set_step_verdict(bool on) override;
  uint64_t attach_optimizer() override;
  uint64_t take_gradients(uint64_t id) override;
  void release_gradients(uint64_t id) override;
  std::vector<PlannedTraffic> planned_step_traffic() const override;
  void discard_grads(bool set_to_none) override;
  uint64_t grads_epoch() const override;
  // ---- RuntimeFace: checkpoints ----
  void drain(const std::string& fn) override;
  void gather_params(const TensorSink& put) override;
  std::vector<std::pair<std::string, std::vector<int64_t>>> param_shapes() const override;
  void assign_params(ParamSource& source, const std::vector<std::pair<std::string, at::Tensor>>& extra,
                     const std::string& what) override;
  std::vector<StateSlot> state_slots() const override;
  void gather_state(const OptimizerStateReader& opt, const StateSink& put) override;
  void assign_state(OptimizerStateAccess& opt, const StateSource& get) override;

  // ---- the schedule's optimizer entry points (prepare_muon_grads, broadcast_all_updates, ...) ----
  // wait reduces; owners get averaged grads. dedicated=false leaves the dedicated route to its
  // per-group calls
  void prepare_grads(bool dedicated);
  // prepare_grads for every route, the dedicated one group by group in publish order (each group's
  // stage 1 waited and stage 2 issued one group ahead of the group being finished)
  void prepare_grads_per_group();
  std::vector<ReadyGrad> take_ready_grads(bool dedicated);  // after prepare_grads: what this rank updates
  void publish(bool async);                    // after the update
  void wait_publishes();                       // local: waits every in-flight publish / unshard
  void drain_all();                            // waits every in-flight collective of this model
  bool set_no_sync(bool on);  // returns the setting before (nested scopes restore it)
  void set_forward_prefetch_depth(int depth);  // >= 0: boundaries broadcast ahead in forward

  // ---- queries (RuntimeFace and the runtime's own files) ----
  Mesh& mesh() const override { return ctx_.mesh(); }
  const std::shared_ptr<Mesh>& mesh_ptr() const { return ctx_.mesh_ptr(); }
  const DedicateOptions& options() const override { return ctx_.options(); }
  std::shared_ptr<torch::nn::Module> model() const { return model_.lock(); }  // null without a LibTorch module
  const ModelView& view() const { return view_; }
  bool ddp() const override { return ctx_.ddp(); }
  bool z3() const override { return ctx_.z3(); }
  bool no_sync() const { return no_sync_; }
  bool boundaries_seen() const { return ctx_.boundaries_seen(); }
  int64_t pass() const { return ctx_.pass(); }
  std::vector<int> publish_order() const { return ctx_.publish_order(); }
  const std::vector<Boundary>& boundaries() const { return boundaries_; }
  const OwnerPlan& plan() const override { return plan_; }
  const std::vector<ParamSpec>& specs() const override { return specs_; }
  const std::vector<std::string>& boundary_of_param() const override { return boundary_of_param_; }
  std::vector<int64_t> optim_element_sizes() const override;
  const std::map<std::string, int>& tp_split() const override { return ctx_.tp_split(); }
  bool has_replicated_route() const override { return replicated_ != nullptr; }
  // setup only: checks the deferred parameters against the source and mixes which are deferred
  // into the fingerprint `digest`
  void check_deferred(uint64_t& digest);
  Precision precision_of(const at::Tensor& p) const { return ctx_.precision_of(p); }
  at::Tensor master_of(const at::Tensor& p) const { return ctx_.master_of(p); }
  bool has_masters() const { return ctx_.has_masters(); }
  bool routed(const std::string& name) const;          // on the dedicated route or a route of the table
  std::vector<ParamView> describe() const override;     // every trainable parameter, model order
  DedicatedRoute& dedicated() const { return *dedicated_; }
  Route* route(RouteKind k) const;  // the route of that kind, null when this model has none
  ReplicatedRoute* replicated() const { return replicated_; }
  uint64_t id() const { return id_; }
  // unshard_profile.h: per-boundary unshard counters (empty unless recording)
  bool recording_unshards() const { return !unshard_stats_.empty(); }
  bool device_timed_unshards() const { return unshard_spans_ && unshard_spans_->active(); }
  std::vector<BoundaryUnshardStats> unshard_stats(bool clear);
  int64_t profiled_passes() const { return profiled_passes_; }
  void reset_post_forward_order();
  // a collective of this runtime is issued and not finished (non-blocking; true while another thread
  // holds the runtime's lock; a failed one counts as finished). The registry keeps a dead model's
  // runtime until this is false.
  bool in_flight();
  std::vector<std::string> post_forward_order() const;  // boundary names (unshard_profile.h)

 private:
  // Every TP module was built on this runtime's mesh; returns their split parameters (full name ->
  // split dimension).
  void check_tp_modules() const;
  void begin_forward_pass();
  // every route's unshard of boundary b (counted when recording), and the wait for it
  // (`only`: of those routes alone)
  void issue_unshards(int b, const char* phase, bool backward, bool prefetch, const std::vector<Route*>* only = nullptr);
  void wait_unshards(int b, bool backward);
  void prefetch_after(int b, bool backward);
  void try_issue_reduces();
  void issue_reduce(int b);
  void release(int b);
  void end_of_backward();
  // clears the per-pass state of every boundary and route after a backward (`accumulating`: inside
  // no_sync, the boundaries keep their reduce set for the last micro-batch's backward)
  void clear_pass_state(bool accumulating);
  // a backward that ended in an exception: waits what it issued, drops every gradient dmuon holds (as
  // zero_grad does) and clears the pass, so training goes on from the next forward; `warn_where`: the
  // call that found it, for the warning (null: zero_grad, which drops them anyway); `param_grads`: also
  // the parameters' .grad (not from zero_grad, which clears them its own way, nor inside a backward)
  void drop_abandoned_backward(const char* warn_where, bool param_grads);
  const std::vector<Route*>& routes() const { return routes_; }
  // the ready gradients of the one-pass path (every route, or every route but the dedicated one)
  std::vector<ReadyGrad> take_ready_grads_locked(bool dedicated);
  // gradients taken before the step (by clipping) as p.grad is now: the caller may have replaced or
  // dropped some since
  std::vector<ReadyGrad> current_grads(std::vector<ReadyGrad> taken);

  ModelView view_;                         // the model's parameters, buffers and modules
  std::weak_ptr<torch::nn::Module> model_;  // the LibTorch module view_ was made from (empty otherwise)
  RouteContext ctx_;  // what the routes see: mesh, options, boundary names, schedule, masters
  uint64_t id_ = 0;
  OwnerPlan plan_;
  std::vector<ParamSpec> specs_;               // planner input, per dedicated param
  std::vector<std::string> boundary_of_param_;  // hook boundary name, per dedicated param
  std::vector<Boundary> boundaries_;
  // The routes, in the order they are called (dedicated, the routes of setup's route table in row
  // order, replicated, local): every rank calls them in this order, so their collectives keep one order.
  std::unique_ptr<DedicatedRoute> dedicated_;
  std::vector<std::unique_ptr<Route>> table_routes_;
  std::unique_ptr<ReplicatedRoute> replicated_owner_;
  ReplicatedRoute* replicated_ = nullptr;
  std::unique_ptr<LocalRoute> local_;
  std::vector<Route*> routes_;

  mutable std::recursive_mutex mu_;
  bool no_sync_ = false;
  bool isolated_pg_barrier_ = false;  // DMUON_ISOLATED_PG_BARRIER as read (and agreed) at dedicate
  bool local_grads_only_ = false;  // the last backward ran inside no_sync: its gradients were never reduced
  bool backward_since_forward_ = true;
  bool step_verdict_ = false;  // set_step_verdict
  bool grads_taken_ = false;   // attach_optimizer or prepare_grads ran: something takes the held gradients
  uint64_t optimizers_ = 0;    // attach_optimizer's count
  uint64_t grads_taker_ = 0;   // the optimizer that took the gradients of grads_taken_epoch_ (0: none)
  uint64_t grads_taken_epoch_ = 0;
  int synced_backwards_ = 0;   // (to 2: a second backward with nothing taking them warns, once)
  bool pass_begun_by_step_ = false;  // prefetch_next_forward began the next pass: its root forward does not begin one
  // the root forward running now (its scope entered, not left: none where a C++ model calls its blocks alone, nor
  // where a block is called outside the model's forward) and whether it runs in grad mode (an evaluation
  // forward's no-grad uses are never recomputed)
  int root_open_ = 0;
  bool pass_mode_checked_ = false;  // refuse_graph_building_partial_backward ran in this backward pass
  bool root_grad_mode_ = true;
  bool warned_unrecomputed_ = false;  // a no-grad use held reduces to the end of backward (said once)
  // no use of the boundary run without grad mode is left to be recomputed in this backward (a reentrant
  // activation checkpoint's); one that never is (the block also run under no_grad inside a training
  // forward) leaves the boundary's reduce to the end of backward
  static bool done_with_uses(const Boundary& B) { return B.uncounted_uses == 0; }
  // A backward this runtime's hooks saw has begun and its end-of-backward callback has not run. The
  // callback holds the token backward_token_ watches: a backward that raises never runs its final
  // callbacks, and the engine destroys them with its graph task, so an open backward whose token
  // expired was abandoned (an exception in it, e.g. a caught out-of-memory error).
  // (Outside autograd an open backward is over: its callback would have closed it. Inside one, the
  // token tells: a device thread may hold a failed graph task a little longer.)
  bool backward_open_ = false;
  std::weak_ptr<void> backward_token_;
  // the graph task the open backward began in (its identity only): a parameter accumulated in another one
  // is inside a nested backward -- a reentrant activation checkpoint's, which accumulates the gradient of
  // the uses it recomputes only -- so it does not say the parameter's gradient is whole
  const void* pass_task_ = nullptr;
  bool backward_live() const { return backward_open_ && !backward_token_.expired(); }
  bool backward_abandoned() const;
  uint64_t grads_epoch_ = 0;
  // The gradients the last backward left in p.grad (the replicated averages, local gradients), weakly (a
  // gradient the caller drops is freed): when no parameter holds its own any more at the next forward or
  // backward, the caller cleared the model's gradients (LibTorch's Module::zero_grad, `p.grad = None` for
  // each), and dmuon drops what it holds outside p.grad as the optimizer's zero_grad would.
  struct LeftGrad {
    at::Tensor param;
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> grad;
  };
  std::vector<LeftGrad> left_grads_;
  size_t next_reduce_ = 0;                // position in reduce_order_
  std::vector<int> reduce_order_;         // reverse of the current forward order, fixed at the first backward hook
  bool reduce_order_fixed_ = false;
  std::vector<BoundaryUnshardStats> unshard_stats_;  // per boundary, when recording
  // when recording on CUDA: the compute stream's stall in each wait (key: boundary * 2 + backward)
  std::unique_ptr<detail::DeviceSpans> unshard_spans_;
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
// a runtime with no LibTorch module (dedicate_model_view): found by id only, while its owner keeps it
void register_runtime(const std::shared_ptr<Runtime>& state);
void register_boundary(const std::shared_ptr<torch::nn::Module>& module, const std::shared_ptr<Runtime>& s, int b);
// Whether a boundary's exit renumbers the autograd nodes its block made on another thread (LibTorch 2.x:
// Node::set_sequence_nr), so their gradients are in the boundary's reduce (boundary_scope.cpp).
bool renumbers_worker_nodes();
// Runs `fn` each time autograd has accumulated `param`'s gradient. Returns the accumulator node:
// keep it alive (autograd holds it only weakly) and create it while `param` has its full shape
// (the node caches it). Throws naming `name` and `rank` when `param` is not a leaf requiring grad.
// `before` (when set) runs each time a gradient arrives, before autograd adds it to param.grad(); returning
// false drops that gradient.
std::shared_ptr<torch::autograd::Node> on_grad_accumulated(const at::Tensor& param, const std::string& name, int rank,
                                                           std::function<void()> fn, std::function<bool()> before = {});
}  // namespace detail

}  // namespace dmuon
