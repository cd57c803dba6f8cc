// model_view.h -- a model as data: what dedicate_params needs of a model, whatever framework
// defines it. The runtime is built from a ModelView; a LibTorch torch::nn::Module is one adapter
// onto it (model_view(module)), a front end for other model code (e.g. Python nn.Modules) another.
//
// The forward hooks stay the caller's: a LibTorch model runs its boundaries through
// dmuon::forward; a front end without LibTorch modules runs each boundary's forward inside a
// detail::BoundaryScope(runtime, boundary) (dedicate.h).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dmuon/dedicate.h"
#include "dmuon/mesh.h"
#include "dmuon/unshard_profile.h"

namespace torch::nn {
class Module;
}

namespace dmuon {

struct ModelView {
  struct Tensor {
    std::string name;  // dotted path, as named_parameters() / named_buffers() spell it
    at::Tensor tensor;
    // a tied parameter's other names (other modules hold the same tensor): its hook boundary is the
    // lowest module containing every one of them, so every module that uses it runs inside it
    std::vector<std::string> aliases = {};
  };
  struct Module {
    std::string name;  // dotted path ("" = the root)
    int parent = -1;   // index in `modules` (-1: the root)
    // The LibTorch module, when the model is one (hook_boundary_predicate and dmuon::forward's
    // boundary lookup need it); empty for other front ends. Weak: the runtime that keeps the view
    // must not keep its model alive (the registry keeps the runtime while the model lives).
    std::weak_ptr<torch::nn::Module> libtorch;
    // A container that runs no forward of its own (ModuleList, ModuleDict, ParameterList,
    // ParameterDict): its parent's forward uses what it holds, so it is never a hook boundary (a
    // parameter's boundary goes up to the lowest ancestor that runs a forward).
    bool container = false;
  };
  std::vector<Tensor> params;   // model order; a tied parameter once (its first name); requires_grad as the tensor's
  std::vector<Tensor> buffers;  // checkpointed with the parameters
  std::vector<Module> modules;  // model order, the root first; a parent before its children
  std::map<std::string, int> tp_split;  // TP-split parameters (this TP rank holds a slice) -> split dimension
  // Modules that run tensor-parallel collectives, with the mesh they were built on (checked to be
  // the dedicate mesh).
  std::vector<std::pair<std::string, const Mesh*>> tp_modules;
  // A front end's checks of its own arguments, run first inside dedicate's agreement: what it refuses on one
  // rank fails every rank (naming that rank and its reason) instead of leaving the others in a collective.
  std::function<void()> precheck;

  // Runs precheck, then checks the view (names unique and non-empty for parameters; parents before children; every
  // module's parent is the dotted prefix of its name). Throws naming the first problem and `rank`.
  void check(int rank) const;
  const Module* module(const std::string& name) const;  // null when absent
};

// The LibTorch adapter: parameters, buffers and modules of `model` (tied parameters once), its TP
// modules' split dimensions and meshes.
ModelView model_view(const torch::nn::Module& model);

class Runtime;  // the runtime of a dedicated model (internal)
// dedicate_params for a model given as data (collective: every rank, like dedicate_params). The
// caller keeps the returned runtime alive -- nothing registers it by module -- runs each
// boundary's forward inside a detail::BoundaryScope(runtime, boundary name) and builds Muon from it.
std::shared_ptr<Runtime> dedicate_model_view(ModelView view, const std::shared_ptr<Mesh>& mesh,
                                             const ParamPredicate& predicate, const DedicateOptions& options = {});

// dedicate_params_ddp for a model given as data: every rank keeps every matrix whole; the owner runs
// Newton-Schulz and publishes the update (1-D meshes without TP). collective: every rank.
std::shared_ptr<Runtime> dedicate_model_view_ddp(ModelView view, const std::shared_ptr<Mesh>& mesh,
                                                 const ParamPredicate& predicate, const DedicateOptions& options = {});

// dedicate_params_ddp_tp for a model given as data: the DDP path on a data-parallel x tensor-parallel
// mesh (no replicate axis); view.tp_split names the TP-split parameters. collective: every rank.
std::shared_ptr<Runtime> dedicate_model_view_ddp_tp(ModelView view, const std::shared_ptr<Mesh>& mesh,
                                                    const ParamPredicate& predicate, const DedicateOptions& options = {});

// ---- what a front end asks of a runtime made by dedicate_model_view ----
class RuntimeFace;  // what Muon takes: Muon(runtime_face(runtime), options)
std::shared_ptr<RuntimeFace> runtime_face(const std::shared_ptr<Runtime>& runtime);
// The hook boundaries (module names, model order): the modules whose forward runs in a BoundaryScope.
std::vector<std::string> runtime_boundaries(const Runtime& runtime);
// The dedicated matrices as this rank sees them (get_dedicated_params of a LibTorch model).
std::vector<DedicatedParam> runtime_dedicated_params(const Runtime& runtime);
// dmuon::replicate: every trainable parameter on no other route is replicated (whole on every rank,
// gradients all-reduced in buckets of `bucket_mb` MiB). collective: every rank (rank 0's values).
// tp (dmuon::replicate_tp): TP slices too, their gradients all-reduced over the data-parallel ranks.
void runtime_replicate(const std::shared_ptr<Runtime>& runtime, double bucket_mb = 25.0, bool tp = false);
// The full value of every trainable parameter (master precision, model order; TP slices gathered over
// the TP group), on every rank. collective: every rank.
std::vector<std::pair<std::string, at::Tensor>> runtime_full_params(const std::shared_ptr<Runtime>& runtime);
// Takes every trainable parameter's value from `values` (full tensors by name, as runtime_full_params
// gives them; each rank keeps its part). Throws naming a missing or misshapen parameter. collective.
void runtime_assign_params(const std::shared_ptr<Runtime>& runtime, std::map<std::string, at::Tensor> values);
// Parameters another data-parallel wrapper took over after dedicate_params (FSDP2's fully_shard
// replaces the module's parameters with its DTensor shards, trained by the caller's optimizer): the
// runtime forgets them -- no optimizer state, not in full params or checkpoints. Each must be a
// parameter on no dmuon route; throws (naming it and the rank) for one dmuon trains. Local.
void runtime_release_params(const std::shared_ptr<Runtime>& runtime, const std::vector<std::string>& names);
// The full-precision master copy this rank keeps of parameter `name` (mixed precision: param_policy's
// param_dtype cast it), undefined where it keeps none. Local.
at::Tensor runtime_master_of(const std::shared_ptr<Runtime>& runtime, const std::string& name);
// Every trainable parameter's route as route_name spells it ("muon", "sharded_adamw", "replicated",
// "local"), model order. Local.
std::vector<std::pair<std::string, std::string>> runtime_param_routes(const Runtime& runtime);
// The schedule's entry points for a model given as data (dedicate.h's for a LibTorch model):
// prepare_muon_grads (coalesce_wait: one wait for every reduce; else group by group), broadcast_all_updates
// (async: broadcast_all_updates_async), wait_all_post_step_broadcasts. collective except the last (local).
void runtime_prepare_grads(const std::shared_ptr<Runtime>& runtime, bool coalesce_wait = true);
void runtime_publish(const std::shared_ptr<Runtime>& runtime, bool async);
void runtime_wait_publishes(const std::shared_ptr<Runtime>& runtime);
// collect_forward_unshard_profile for a model given as data (unshard_profile.h). Local.
// synchronize: on CUDA, wait for the device first (unshard_profile.h).
ForwardUnshardProfile runtime_forward_unshard_profile(const std::shared_ptr<Runtime>& runtime, bool clear = true,
                                                      bool synchronize = true);
// Gradient accumulation: inside no_sync no reduce happens (dmuon::NoSync for a LibTorch model). Local.
bool runtime_set_no_sync(const std::shared_ptr<Runtime>& runtime, bool on);  // returns the setting before
// Drops every gradient the runtime holds outside p.grad (a matrix owner's reduced sum, sharded_adamw
// slices; in-flight reduces are waited), as Muon::zero_grad does before clearing p.grad: the model's own
// zero_grad() in Python. Local. set_to_none=false: the sharded_adamw slices that had a gradient keep a zero
// one, as torch's zero_grad(set_to_none=False) keeps zeros in p.grad (the next step steps them).
void runtime_discard_grads(const std::shared_ptr<Runtime>& runtime, bool set_to_none = true);
// How many boundaries ahead the forward issues its unshards (DedicateOptions::forward_prefetch_depth;
// the Python Muon's forward_prefetch_depth). Local; takes effect at the next boundary.
void runtime_set_forward_prefetch_depth(const std::shared_ptr<Runtime>& runtime, int depth);
// reset_post_forward_order / post_forward_order (unshard_profile.h) for a model given as data. Local.
void runtime_reset_post_forward_order(const std::shared_ptr<Runtime>& runtime);
std::vector<std::string> runtime_post_forward_order(const std::shared_ptr<Runtime>& runtime);

}  // namespace dmuon
