// dedicate.h -- dedicated ownership of Muon matrices at run time.
//
//   rank:            0            1            2            3
//   q_proj (owner 0) [full]       [0-byte]     [0-byte]     [0-byte]     <- between steps (Z3)
//   forward pre:     broadcast from 0 ---------> every rank holds the full matrix
//   forward post:    Z3: non-owners free it again; Z2: keep it until after backward
//   backward pre:    Z3: broadcast from 0 again (the saved activations point into the same buffer)
//   backward post:   reduce(grad, AVG) -> 0; non-owners drop their gradient
//   optimizer.step:  rank 0 alone: momentum, Newton-Schulz on the full matrix, update (1-D mesh,
//                    broadcast mode: no collective; HSDP / DDP path / all_gather: the publish)
//
// Each matrix has one owner (the planner's LPT plan, identical on every rank and checked by a
// fingerprint exchange at setup). A hook boundary (a `layers.N` / `blocks.N` module by default) is
// where its matrices are broadcast and reduced, one collective per distinct owner inside the
// boundary, all in flight at once. LibTorch modules have no forward hooks, so model code runs each
// boundary through one line:
//
//     for (auto& layer : *layers) x = dmuon::forward(layer, x);
//
// Backward hooks come from autograd (identity functions around the boundary, AccumulateGrad
// post-hooks, an end-of-backward callback that fires any boundary whose hooks did not run).
// Optionally wrap the top-level call as well (`dmuon::forward(model, tokens)`): errors thrown inside
// then name a boundary that was bypassed.
//
// Two words, used the same way in every header and document:
//   * "the DDP path": dedicate_params_ddp / dedicate_params_ddp_tp. Ownership without sharding: every
//     rank keeps every matrix whole; the owner alone runs Newton-Schulz and publishes the update.
//   * "replicated": what dmuon::replicate / replicate_tp do to the parameters that are not dedicated
//     (DDP-style: whole on every rank, gradients all-reduced in buckets). It combines with either path.
//
// Contracts. Functions marked "collective" must be called by every rank of the mesh in the same
// order relative to dmuon's other collective calls; each collective waits at most the mesh's
// timeout, so a lost peer is an error naming the group, the payload and the rank, not a hang.
// Threads: one thread drives a dedicated model (forward, backward, step); autograd may run the
// hooks on its worker threads, which dmuon serialises per model. Two models are independent.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dmuon/deferred_init.h"
#include "dmuon/mesh.h"
#include "dmuon/owner_plan.h"

namespace dmuon {

using ParamPredicate = std::function<bool(const std::string& name, const at::Tensor& param)>;
using ModulePredicate = std::function<bool(const std::string& module_name, const torch::nn::Module& module)>;
// Returns the name (as in named_modules(), "" = the root) of the module whose boundary runs the
// parameter's hooks. Takes precedence over hook_boundary_predicate.
using HookBoundaryResolver = std::function<std::string(const std::string& param_name, const at::Tensor& param)>;
using AssignmentGroupKeyFn = std::function<std::string(const std::string& param_name, const at::Tensor& param)>;

// Per-parameter policy (param_policy). Every field is optional: a parameter's policy starts
// empty and each matching override (in order) sets the fields it has; what stays unset takes the
// default named below.
//
// Mixed precision (FSDP2-style): `param_dtype` is the dtype the module's parameter has in forward
// and backward (e.g. bf16). When it is narrower than the parameter's dtype at dedicate time, the
// optimizer keeps a master copy (default: that original dtype, e.g. fp32) on the rank that updates
// it — the owner of a Muon matrix, the shard holder of a sharded_adamw slice, every rank for a
// replicated parameter — updates the master and writes the rounded value back into the parameter.
// Gradients are reduced in `grad_dtype` and averaged/accumulated in the master dtype, so p.grad()
// after prepare_muon_grads (or in step()) is in the master dtype.
struct ParamPolicy {
  // "muon" (dedicated ownership + Newton-Schulz), "adamw" (replicated, AdamW) or "sharded_adamw"
  // (1/N per rank, AdamW on the slice). Unset: route_hint_fn, else the predicate (muon / adamw).
  std::optional<std::string> route;
  // Muon-routed only: "broadcast" (the owner broadcasts the full matrix) or "all_gather" (after
  // step() the owner scatters the update into 1/N shards; forward rebuilds the full matrix with an
  // all-gather). Empty = DedicateOptions::muon_forward_unshard.
  std::string muon_forward_unshard;
  std::optional<at::ScalarType> param_dtype;   // forward/backward dtype; unset: keep the parameter's dtype
  std::optional<at::ScalarType> grad_dtype;    // gradient reduce dtype; unset: compute_dtype, else param_dtype
  std::optional<at::ScalarType> master_dtype;  // optimizer-updated copy; unset: the dtype at dedicate time
  std::optional<at::ScalarType> optim_dtype;   // optimizer state (momentum, AdamW moments); unset: master
                                               // (float32 for a float16 master: its range is too small)
  // Boundary-level (all parameters of one hook boundary must agree): cast floating-point tensor
  // arguments of the boundary's forward to its param_dtype (unset: true when param_dtype narrows the
  // parameter), and cast its tensor output to output_dtype (unset: no cast).
  std::optional<bool> cast_forward_inputs;
  std::optional<at::ScalarType> output_dtype;
};
// An ordered override: applies when every token of `match` (split on spaces) is a substring of the
// parameter's full name. Later overrides win.
struct ParamPolicyOverride {
  std::string match;
  ParamPolicy policy;
};
using ParamPolicyFn = std::function<std::optional<ParamPolicy>(const std::string& param_name, const at::Tensor& param)>;
// Returns "muon", "adamw" or "sharded_adamw" for a parameter, or "" for no hint (the predicate decides).
using RouteHintFn = std::function<std::string(const std::string& param_name, const at::Tensor& param)>;

struct DedicateOptions {
  // Communication dtype of Muon matrices: broadcast payloads when it narrows the parameter, and the
  // default gradient reduce payload (ParamPolicy::grad_dtype). Default: the parameter's dtype.
  std::optional<at::ScalarType> compute_dtype;
  bool reshard_after_forward = true;            // true: DMuon-Z3, false: DMuon-Z2
  ModulePredicate hook_boundary_predicate;      // lowest matching ancestor is the boundary
  bool hook_boundary_strict = true;             // error when a dedicated param has no boundary
  HookBoundaryResolver hook_boundary_resolver;
  AssignmentGroupKeyFn assignment_group_key_fn;
  // The owner planner's options (owner_strategy, owner_cost_model, hsdp_column_balance,
  // pack_small_params, max_owners_per_group, ...; unset fields: DMUON_OWNER_* or the defaults).
  PlanOptions plan;
  std::vector<ParamPolicyOverride> param_policy;  // mutually exclusive with param_policy_fn
  ParamPolicyFn param_policy_fn;
  RouteHintFn route_hint_fn;                    // a policy's route takes precedence over the hint
  int forward_prefetch_depth = 1;               // boundaries broadcast ahead in forward (0 = none)
  // Per-boundary unshard counters (unshard_profile.h); unset: DMUON_RECORD_FORWARD_PROFILE.
  std::optional<bool> record_forward_profile;
  // or "all_gather": every rank keeps a 1/G shard of each unit and forward all-gathers it (1-D, HSDP
  // and the DDP path; not with tensor parallelism)
  std::string muon_forward_unshard = "broadcast";
  // HSDP (2-D mesh) only:
  double replicate_broadcast_bucket_mb = 0.0;   // post-step publish chunk size in MiB; 0 = one per packed unit
  // The stage-2 (replicate-axis) gradient reduce is issued in backward either way, each boundary's
  // as the next boundary's reduce goes out (so it runs under the rest of backward). true: backward
  // waits only the stage-1 (shard) reduces, step() waits stage 2, group by group, so late reduce
  // tails overlap earlier groups' Newton-Schulz and publish; false: backward waits stage 2 as well.
  bool delay_stage2_to_optimizer = true;
  // Post-step publish (HSDP, the DDP path, all_gather unshard): true returns from step() at once and
  // each boundary's next forward waits for its own publish; false waits in step(). No effect on a
  // 1-D mesh in broadcast mode. MuonOptions::replicate_async overrides it when set.
  bool replicate_async = true;
  // Tensor parallelism: which scratch of the TP Newton-Schulz exchange (gather form, and the broadcast
  // of a whole matrix) each matrix keeps across steps instead of allocating it every step: "off"
  // (default), "gather" (the TP owner's gather buffer and the full matrix NS reads), "scatter" (the
  // TP owner's send buffer and every rank's receive buffer), "all". Same results; the kept buffers
  // stay allocated between steps (the TP owner: about twice its full matrices, every rank: its slices).
  std::string tp_buffer_reuse = "off";
  // Deferred parameters (deferred_init.h: no storage yet) take their values from this source, each
  // rank only what it keeps. Required when the model has deferred parameters; ignored otherwise.
  std::shared_ptr<ParamSource> param_source;
};

// One dedicated matrix, as seen from this rank.
struct DedicatedParam {
  std::string name;                 // full name in the model
  at::Tensor param;                 // the module's parameter (placeholder data on non-owners)
  std::vector<int64_t> shape;       // full logical shape
  OwnerCoord owner;                 // (shard, replicate)
  int owner_rank = 0;               // global rank of the owner
  std::string boundary;             // hook boundary module name
  bool is_owner = false;            // this rank owns it
  // The owner's master copy when param_policy gives the matrix one (e.g. fp32 for a bf16 parameter):
  // the value the optimizer updates; undefined elsewhere.
  at::Tensor master;
  // Tensor parallelism (a mesh with tp_size T > 1): `shape` is this TP rank's slice; the split
  // dimension (-1: the matrix is whole and identical on every TP rank), the full logical shape, and
  // the TP owner: the TP rank of the owner's TP group that runs Newton-Schulz on the full matrix.
  int tp_split_dim = -1;
  int tp_owner = -1;
  std::vector<int64_t> full_shape;
};

class Runtime;  // the runtime attached to a dedicated model (see src/runtime/runtime.h)

// Marks the parameters selected by `predicate` (and routed "muon" by the policy) for dedicated
// ownership, plans owners, installs placeholders on non-owners and registers the boundaries.
// Returns param name -> owner coordinate.
//
// On a 2-D mesh (HSDP, R replicate groups x G shard ranks; MeshOptions::replicate_size) each matrix
// has one global owner (shard, replicate) among the G*R slots (column-balanced plan). Between steps
// the owner's shard column holds it: rank (owner.shard, r) in every replicate group r. Forward and
// backward broadcast over the shard group from that holder; backward reduces in two stages (shard
// group to the holder, then replicate group to the global owner; net divisor G*R); only the global
// owner runs Newton-Schulz; step() publishes the update over the replicate group, asynchronously by
// default (each boundary's next forward waits for its own publish; MuonOptions::replicate_async).
// Tensor parallelism (a mesh with tp_size T > 1, world = R x G x T): parameters of TP modules
// (tensor_parallel.h) are this TP rank's slices. Each TP position t trains its slices over its own
// R x G data-parallel ranks exactly as above, with the same owner (shard, replicate) on every TP
// position. A dedicated matrix also has a TP owner (the plan balances them over T; part of the
// fingerprint): in step(), the T owners of a split matrix gather its momentum-update input to the TP
// owner, which runs Newton-Schulz on the full matrix and scatters the slices of the update back (or,
// with MuonOptions::tp_distributed_gram, all-reduce only the Gram matrix); a whole matrix is
// orthogonalised by its TP owner alone and the update broadcast to the others. The scatter is
// asynchronous (MuonOptions::replicate_async / DedicateOptions::replicate_async, default true): each
// holder applies its slice of the update before its boundary's next unshard; read the weights outside
// the step cycle after wait_all_post_step_broadcasts(model).
// collective: all ranks of the mesh, same order (exchanges plan fingerprints, broadcasts the
// owners' initial values so every rank starts from the owner's copy).
std::map<std::string, OwnerCoord> dedicate_params(const std::shared_ptr<torch::nn::Module>& model,
                                                  const std::shared_ptr<Mesh>& mesh, const ParamPredicate& predicate,
                                                  const DedicateOptions& options = {});

// DDP-path variant: every rank keeps the full parameters live; ownership decides only who runs
// Newton-Schulz, where gradients are reduced after backward, and who broadcasts the new value after
// step() (Muon publishes automatically: asynchronously when the model runs its boundaries through
// dmuon::forward, each boundary waiting for its own publish in the next forward; synchronously
// otherwise). 1-D meshes only. Returns param name -> owner coordinate.
// collective: all ranks of the mesh, same order.
std::map<std::string, OwnerCoord> dedicate_params_ddp(const std::shared_ptr<torch::nn::Module>& model,
                                                      const std::shared_ptr<Mesh>& mesh,
                                                      const ParamPredicate& predicate,
                                                      const DedicateOptions& options = {});

// The DDP path with tensor parallelism: a data-parallel x TP mesh (no replicate axis). Each TP
// position runs dedicate_params_ddp over its data-parallel ranks; split matrices are orthogonalised
// whole as in dedicate_params. Pair it with replicate_tp. collective: all ranks of the mesh.
std::map<std::string, OwnerCoord> dedicate_params_ddp_tp(const std::shared_ptr<torch::nn::Module>& model,
                                                         const std::shared_ptr<Mesh>& mesh,
                                                         const ParamPredicate& predicate,
                                                         const DedicateOptions& options = {});

// Post-step publish of the owners' updated matrices (DDP path; a no-op for dedicate_params on a
// 1-D mesh, where the next forward broadcasts). The sync form waits; the async form returns at
// once and each boundary's next forward waits for its own publish.
// collective: all ranks, same order.
void broadcast_all_updates(torch::nn::Module& model);
void broadcast_all_updates_async(torch::nn::Module& model);
// Waits every pending post-step publish (read parameters outside the step cycle after this).
// local: waits collectives already issued, issues none.
void wait_all_post_step_broadcasts(torch::nn::Module& model);

// Gradient accumulation: inside the scope no dmuon reduce and no replicated all-reduce happens;
// gradients accumulate locally (non-owners keep theirs too). The next backward outside the scope
// reduces the accumulated gradient once; Newton-Schulz runs once per optimizer step.
//   for (int i = 0; i < accum; ++i) {
//     std::optional<dmuon::NoSync> ns;
//     if (i + 1 < accum) ns.emplace(*model);
//     (model->loss(micro[i]) / accum).backward();
//   }
//   opt.step();
// local: issues no collective (it suspends them).
class NoSync {
 public:
  explicit NoSync(torch::nn::Module& model);  // throws when the model is not dedicated; nests (as torch's DDP)
  ~NoSync();
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;

 private:
  std::shared_ptr<Runtime> state_;
  bool outer_ = false;  // inside another NoSync of the model: leaving this one stays in that one
};

// Replicated (DDP-style) training of every trainable parameter that is not dedicated: gradients are averaged
// over the mesh at the end of backward, coalesced into few all-reduces (buckets of
// `bucket_mb` MiB). Call after dedicate_params.
// collective: all ranks (broadcasts rank 0's initial values so replicas start identical).
// On a mesh with a TP axis the gradients are averaged over the R x G data-parallel ranks of each TP
// position (whole parameters are then identical on every TP rank: their gradients are). Parameters
// that are TP slices (e.g. a column-parallel bias) are refused here: use replicate_tp.
// Returns `model` (the API reference's chaining).
std::shared_ptr<torch::nn::Module> replicate(const std::shared_ptr<torch::nn::Module>& model,
                                             const std::shared_ptr<Mesh>& mesh, double bucket_mb = 25.0);
// replicate that also takes TP-split parameters: each TP rank's slice is averaged over its
// data-parallel ranks. collective: all ranks. Returns `model`.
std::shared_ptr<torch::nn::Module> replicate_tp(const std::shared_ptr<torch::nn::Module>& model,
                                                const std::shared_ptr<Mesh>& mesh, double bucket_mb = 25.0);

// What replicate / replicate_tp attached to a model (nullopt when neither was called).
struct ReplicatedGroup {
  std::vector<std::string> names;  // the replicated parameters, model order
  std::vector<int> tp_split_dims;  // per parameter: its TP split dimension, -1 when whole
  int num_buckets = 0;             // coalesced all-reduces per backward
  int group_size = 1;              // ranks each gradient is averaged over (R x G)
  bool tp = false;                 // attached by replicate_tp
};
std::optional<ReplicatedGroup> get_replicated_group(const torch::nn::Module& model);

// Runs `module` as a hook boundary when dmuon registered it as one (otherwise a plain call).
// collective: every rank runs the same boundaries in the same order (forward broadcasts and
// prefetches; in backward, the hooks it installs issue the Z3 re-broadcasts and the reduces).
// The first argument after the module may be an at::Tensor (the activation the backward hooks
// attach to); all arguments are forwarded to module->forward.
template <typename ModuleHolderOrPtr, typename... Args>
auto forward(ModuleHolderOrPtr& module, Args&&... args);

// After backward: waits for this rank's pending gradient reduces and makes the averaged gradient
// of every owned matrix available in param.grad(). Muon::step calls it; call it yourself only to
// read gradients between backward and step.
// collective: every rank (on HSDP it issues the delayed stage-2 reduces and the replicate-axis
// all-reduces of sharded_adamw slices; elsewhere it waits collectives already issued).
void prepare_muon_grads(torch::nn::Module& model);
// coalesce_wait=true waits every group's reduces in one pass (stage 1 of all, then stage 2 of all:
// the overload above); false (the default) prepares group by group in the forward order, issuing the
// next group's HSDP stage 2 before waiting the current one's. The gradients are the same either way.
// (Reduces run on the process group's own stream: there is no separate reduce stream to choose.)
struct PrepareGradsOptions {
  bool coalesce_wait = false;
};
void prepare_muon_grads(torch::nn::Module& model, const PrepareGradsOptions& opts);

// Queries (local: no collective, safe on any rank at any time between steps).
std::vector<DedicatedParam> get_dedicated_params(const torch::nn::Module& model);
// Dedicated params owned by `shard` (1-D) or by (shard, replicate).
std::vector<DedicatedParam> get_owned_params(const torch::nn::Module& model, int shard);
std::vector<DedicatedParam> get_owned_params(const torch::nn::Module& model, OwnerCoord owner);
// The plan dedicate_params computed for this model.
const OwnerPlan* get_owner_plan(const torch::nn::Module& model);
// The mesh the model was dedicated on.
std::shared_ptr<Mesh> get_mesh(const torch::nn::Module& model);

// Parameters trained by AdamW (everything trainable that is not dedicated), in model order.
std::vector<std::pair<std::string, at::Tensor>> get_base_params(const torch::nn::Module& model);

namespace detail {
// Boundary scope used by dmuon::forward. enter() runs the pre-forward work and returns the input
// wrapped for the post-backward hook; exit() runs the post-forward work and wraps the output for
// the pre-backward hook. Both are no-ops for modules that are not boundaries.
// What a scope of one module needs, resolved once: its boundary (if it is one) and, for the model's
// root, the runtime whose forward pass it starts. Hooks that run every forward keep one per module.
struct BoundarySite {
  std::shared_ptr<Runtime> state;  // set when the module is a boundary
  int boundary = -1;
  std::shared_ptr<Runtime> root;   // set when the module is the dedicated model's root
};
// The site of `module` (a name in the runtime's ModelView; "" the root); a mistyped name is a ValueError.
BoundarySite boundary_site(const std::shared_ptr<Runtime>& runtime, const std::string& module);

class BoundaryScope {
 public:
  explicit BoundaryScope(const torch::nn::Module* module);
  // A boundary of a runtime built from a ModelView (dedicate_model_view): `module` names it; the
  // root ("") starts a forward pass; a module that is no boundary does nothing.
  BoundaryScope(const std::shared_ptr<Runtime>& runtime, const std::string& module);
  explicit BoundaryScope(const BoundarySite& site);
  ~BoundaryScope();
  BoundaryScope(const BoundaryScope&) = delete;
  BoundaryScope& operator=(const BoundaryScope&) = delete;
  at::Tensor enter(const at::Tensor& input);  // returns the input to pass on (cast, wrapped)
  at::Tensor cast_input(const at::Tensor& t) const;  // another tensor argument: the boundary's input cast
  void enter();                               // boundary without a tensor first argument
  // A tensor the block is given (enter(input) and cast_input note theirs; a front end notes the others, e.g.
  // inside a list argument): the block returning it as it is (or a view of it) passes it through, with no
  // pre-backward hook, so its late gradient gathers no block. Every other output requiring grad is hooked.
  void note_argument(const at::Tensor& t) const;
  // returns the output to pass on: cast to output_dtype, and (requiring grad) with the pre-backward hook
  // registered on it -- the block's very tensor when no cast applies, so the caller may change it in place
  at::Tensor exit(const at::Tensor& output);
  void exit();                                // non-tensor output: post-forward work only
  // several outputs (a tuple, a dict): each as above; the hook runs before the block's backward
  // whichever of them the loss reaches it through
  std::vector<at::Tensor> exit(const std::vector<at::Tensor>& outputs);
  [[noreturn]] void rethrow(const std::exception& e);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

template <typename M>
torch::nn::Module* module_ptr(M& m) {
  if constexpr (requires { m.ptr(); }) {
    return m.ptr().get();
  } else if constexpr (requires { m.get(); }) {
    return m.get();
  } else {
    return &m;
  }
}
template <typename M>
decltype(auto) module_ref(M& m) {
  if constexpr (requires { m.ptr(); } || requires { m.get(); }) {
    return *m;
  } else {
    return (m);
  }
}
// Tensor arguments after the first get the boundary's input cast (when the module's forward accepts
// the cast copy; a forward taking a non-const at::Tensor& gets the caller's tensor); others pass through.
template <typename A>
decltype(auto) cast_arg(const BoundaryScope& scope, A&& a) {
  if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
    return scope.cast_input(a);
  } else {
    return std::forward<A>(a);
  }
}
template <typename T>
inline constexpr bool is_std_tuple = false;
template <typename... T>
inline constexpr bool is_std_tuple<std::tuple<T...>> = true;
// Notes the tensors of an argument as the block's: a tensor, an optional one, a std::vector or an
// at::TensorList of them, a std::tuple (nested ones too) holding any.
template <typename A>
void note_arg(const BoundaryScope& scope, const A& a) {
  if constexpr (std::is_same_v<A, at::Tensor>) {
    scope.note_argument(a);
  } else if constexpr (std::is_same_v<A, std::optional<at::Tensor>> || std::is_same_v<A, c10::optional<at::Tensor>>) {
    if (a) scope.note_argument(*a);
  } else if constexpr (std::is_same_v<A, std::vector<at::Tensor>> || std::is_same_v<A, at::TensorList>) {
    for (const at::Tensor& t : a) scope.note_argument(t);
  } else if constexpr (is_std_tuple<A>) {
    std::apply([&](const auto&... x) { (note_arg(scope, x), ...); }, a);
  }
}
// A forward's result as passed on: its tensors as values (each may come back cast or hooked) -- in a
// std::tuple, nested ones included, a tensor, a std::vector of tensors or a nested tuple becomes a value --
// and any other element as it was returned, an lvalue reference kept (std::tie(out, state_) hands back
// the module's own state_), anything else a value.
template <typename T>
struct result_values {
  using type = T;
};
template <typename... T>
struct result_values<std::tuple<T...>> {
  template <typename E, typename D = std::decay_t<E>>
  using element = std::conditional_t<std::is_same_v<D, at::Tensor> || std::is_same_v<D, std::vector<at::Tensor>> ||
                                         is_std_tuple<D>,
                                     typename result_values<D>::type,
                                     std::conditional_t<std::is_lvalue_reference_v<E>, E, std::remove_cv_t<std::remove_reference_t<E>>>>;
  using type = std::tuple<element<T>...>;
};
template <typename R>
using result_values_t = typename result_values<std::decay_t<R>>::type;
// A result whose tensors are a boundary's outputs: a tensor, a std::vector of them, or a std::tuple
// (nested ones too) holding any.
template <typename V>
inline constexpr bool holds_outputs = std::is_same_v<V, at::Tensor> || std::is_same_v<V, std::vector<at::Tensor>> ||
                                      is_std_tuple<V>;
template <typename E>
void put_tensors(std::vector<at::Tensor>& tensors, const E& e) {
  if constexpr (std::is_same_v<E, at::Tensor>) {
    tensors.push_back(e);
  } else if constexpr (std::is_same_v<E, std::vector<at::Tensor>>) {
    tensors.insert(tensors.end(), e.begin(), e.end());
  } else if constexpr (is_std_tuple<E>) {
    std::apply([&](const auto&... x) { (put_tensors(tensors, x), ...); }, e);
  }
}
template <typename E>
void take_tensors(E& e, const std::vector<at::Tensor>& passed, size_t& k) {
  if constexpr (std::is_same_v<E, at::Tensor>) {
    e = passed[k++];
  } else if constexpr (std::is_same_v<E, std::vector<at::Tensor>>) {
    for (at::Tensor& t : e) t = passed[k++];
  } else if constexpr (is_std_tuple<E>) {
    std::apply([&](auto&... x) { (take_tensors(x, passed, k), ...); }, e);
  }
}
// Every tensor of a forward's result -- a tensor, a std::vector of them, a std::tuple (nested ones
// too, e.g. an LSTM's (output, (h, c))) -- gets the output cast and the pre-backward hook, as a Python
// boundary's tuple does; such a result passes on by value. Anything else passes on as it is.
template <typename R>
auto finish_boundary(BoundaryScope& scope, R&& out)
    -> std::conditional_t<holds_outputs<result_values_t<R>>, result_values_t<R>, R> {
  using V = result_values_t<R>;
  if constexpr (std::is_same_v<V, at::Tensor>) {
    return scope.exit(out);
  } else if constexpr (holds_outputs<V>) {
    V result(std::forward<R>(out));
    std::vector<at::Tensor> tensors;
    put_tensors(tensors, result);
    const std::vector<at::Tensor> passed = scope.exit(tensors);
    size_t k = 0;
    take_tensors(result, passed, k);
    return result;
  } else {
    scope.exit();
    return std::forward<R>(out);
  }
}
}  // namespace detail

template <typename ModuleHolderOrPtr, typename... Args>
auto forward(ModuleHolderOrPtr& module, Args&&... args) {
  detail::BoundaryScope scope(detail::module_ptr(module));
  auto&& m = detail::module_ref(module);
  try {
    if constexpr (sizeof...(Args) >= 1) {
      return [&](auto&& first, auto&&... rest) {
        if constexpr (std::is_same_v<std::decay_t<decltype(first)>, at::Tensor>) {
          at::Tensor in = scope.enter(first);
          (detail::note_arg(scope, std::as_const(rest)), ...);
          if constexpr (requires { m.forward(in, detail::cast_arg(scope, std::forward<decltype(rest)>(rest))...); })
            return detail::finish_boundary(
                scope, m.forward(in, detail::cast_arg(scope, std::forward<decltype(rest)>(rest))...));
          else
            return detail::finish_boundary(scope, m.forward(in, std::forward<decltype(rest)>(rest)...));
        } else {
          scope.enter();
          detail::note_arg(scope, std::as_const(first));
          (detail::note_arg(scope, std::as_const(rest)), ...);
          if constexpr (requires {
                          m.forward(std::forward<decltype(first)>(first),
                                    detail::cast_arg(scope, std::forward<decltype(rest)>(rest))...);
                        })
            return detail::finish_boundary(
                scope, m.forward(std::forward<decltype(first)>(first),
                                 detail::cast_arg(scope, std::forward<decltype(rest)>(rest))...));
          else
            return detail::finish_boundary(
                scope, m.forward(std::forward<decltype(first)>(first), std::forward<decltype(rest)>(rest)...));
        }
      }(std::forward<Args>(args)...);
    } else {
      scope.enter();
      return detail::finish_boundary(scope, m.forward());
    }
  } catch (const std::exception& e) {
    scope.rethrow(e);
  }
}

}  // namespace dmuon
