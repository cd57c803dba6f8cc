// Internal: one way a parameter is trained. The Runtime keeps the boundary schedule and calls every
// route at the same points of the step, in a fixed order (dedicated, sharded, replicated), so all
// ranks issue the same collectives in the same order.
//
// A route sees only its RouteContext (route_context.h), never the Runtime. A new route is one file
// implementing this interface and one line in setup's route table (docs/ARCHITECTURE.md).
//
// Lifetimes: a Route belongs to its Runtime. Gradient hooks are registered through
// RouteContext::on_grad_accumulated, which runs them only while the Runtime (and so the route) lives.
//
// Threading: every method runs under the Runtime's mutex (autograd may call hooks from its worker
// threads); none is re-entrant from another thread.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/deferred_init.h"
#include "runtime/precision.h"

namespace dmuon {

// Which route trains a parameter. The selectable ones have a row in setup's route table (setup.cpp),
// which also gives their names; Local is where every other parameter stays.
enum class RouteKind { Dedicated, Sharded, Replicated, Local };
// "muon", "sharded_adamw", "replicated" (replicated AdamW: also selected by "adamw"), "local"
const char* route_name(RouteKind k);

// What the setup knows when it routes a parameter (route_params, RouteRow::check).
struct RoutingContext {
  int rank = 0;
  bool ddp = false;
  bool tp = false;  // the mesh has a tensor-parallel axis
};

// A parameter handed to a route at build: name, tensor, precision and its hook boundary's index
// (routes whose parameters live on no boundary get -1).
struct BoundParam {
  std::string name;
  at::Tensor param;
  Precision prec;
  int boundary = -1;
};

// A gradient ready for the optimizer (after Runtime::prepare_grads).
struct ReadyGrad {
  std::string name;
  at::Tensor param;      // the module's parameter: optimizer state key and param-group membership
  at::Tensor target;     // what the optimizer updates: the master copy, this rank's shard, or param
  at::Tensor grad;       // averaged gradient, in the master dtype, shaped like target
  Precision prec;
  bool muon = false;        // a dedicated matrix: orthogonalised (Muon); otherwise AdamW
  bool write_back = false;  // target is a master: round it into param after the update
  // grad is param.grad() (not a slice the route keeps): what the caller puts there or drops before the
  // step, after the gradients were taken (clipping), is what the step uses
  bool in_param_grad = false;
  // Global gradient norms count every element once over the whole mesh: this rank counts this
  // gradient's elements (norm_counted) and the parameter itself (norm_counts_param). The route decides.
  bool norm_counted = true;
  bool norm_counts_param = true;
  // Tensor parallelism (dedicated matrices on a mesh with tp_size > 1): the TP rank that runs
  // Newton-Schulz on the full matrix (-1: no TP axis), the split dimension (-1: the matrix is whole
  // and identical on every TP rank) and the full logical shape.
  int tp_owner = -1;
  int tp_dim = -1;
  std::vector<int64_t> full_shape;
};

// How one trainable parameter is trained, as this rank sees it (Runtime::describe).
struct ParamView {
  std::string name;
  at::Tensor param;
  RouteKind route = RouteKind::Local;
  std::vector<int64_t> shape;      // full logical shape (a dedicated placeholder holds none)
  Precision prec;
  std::string boundary;            // dedicated and sharded: the hook boundary
  int owner_shard = -1, owner_replicate = -1, owner_rank = -1;  // dedicated: its owner
  int tp_dim = -1, tp_owner = -1;  // dedicated on a TP mesh: split dimension, TP owner
  bool updated_here = true;        // this rank runs its optimizer update (dedicated: the owner)
  // sharded_adamw: this rank's slice of the flat parameter padded to a multiple of the shard size
  int64_t shard_numel = 0, shard_offset = 0, padded_numel = 0;
  bool muon() const { return route == RouteKind::Dedicated; }        // a dedicated (Muon) matrix
  bool sharded() const { return route == RouteKind::Sharded; }       // sharded_adamw
  bool distributed() const { return route != RouteKind::Local; }     // on some data-parallel route
};

// One parameter's optimizer state as the optimizer keeps it on this rank.
struct ParamState {
  int64_t step = 0;
  std::vector<at::Tensor> tensors;  // in the order of OptimizerStateReader::fields; empty: no state
  bool defined() const { return !tensors.empty() && tensors.front().defined(); }
};

// The optimizer's per-parameter state, as the routes see it for checkpoints (the optimizer layer
// implements it; the runtime does not know the optimizer). Reading needs only the reader.
class OptimizerStateReader {
 public:
  virtual ~OptimizerStateReader() = default;
  // the state tensors of a Muon matrix (muon) or of an AdamW-trained parameter, by name
  virtual const std::vector<std::string>& fields(bool muon) const = 0;
  virtual ParamState get(const at::Tensor& param) const = 0;  // no state: step 0, no tensors
};
class OptimizerStateAccess : public OptimizerStateReader {
 public:
  virtual void set(const at::Tensor& param, ParamState state) = 0;  // no tensors: fresh state
};

// Adds `calls` collectives `op` of `bytes` (the payload Communicator::counted takes) on `comm` to `out`
// as `route`'s, merged with an entry of the same route, group and counted op.
void add_planned(std::vector<PlannedTraffic>& out, const char* route, const Communicator& comm, CommOp op,
                 int64_t bytes, int64_t calls = 1, bool root = false);

// A parameter with optimizer state in a checkpoint: its name, the shape of each state tensor (this
// TP rank's slice of the full parameter) and whether it is a Muon matrix.
struct StateSlot {
  std::string name;
  std::vector<int64_t> shape;
  bool muon = false;
  // its state must be in a state dict of a trained model: false for a parameter frozen now (it may have been
  // frozen before its first step, as torch's optimizer then holds no state for it either)
  bool required = true;
  at::ScalarType dtype = at::kFloat;  // the optimizer state's (the precision policy's optim dtype)
  at::Device device = at::kCPU;       // the parameter's
};
// the full state of `name` (this TP rank's slice), from whichever ranks hold it
using StateSink = std::function<void(const std::string& name, bool muon, const ParamState& full)>;
// the full state of `name` (this TP rank's slice), or nullopt: the parameter starts from fresh state
using StateSource = std::function<std::optional<ParamState>(const std::string& name, bool muon)>;

using TensorSink = std::function<void(const std::string& name, const at::Tensor& full)>;
using FullValues = std::map<std::string, at::Tensor>;

class Route {
 public:
  virtual ~Route() = default;
  virtual RouteKind kind() const = 0;

  // ---- setup ----
  // after every parameter took its forward dtype: hooks and initial values (collective: every rank,
  // in route order)
  virtual void install() {}

  // ---- forward / backward of boundary b (collective: every rank, same order) ----
  virtual void issue_unshard(int /*b*/, const char* /*phase*/) {}  // broadcast / all-gather its parameters
  virtual void wait_unshard(int /*b*/) {}                           // local: wait, install the full data
  virtual void release(int /*b*/) {}                                // local: free what this rank does not keep
  virtual void issue_reduce(int /*b*/) {}                           // boundary b's gradients are complete
  virtual void end_of_backward() {}                                 // every boundary reduced (not in NoSync)
  virtual void reset_pass() {}                                      // a backward pass ended: clear per-pass bits
  // local, before boundary b's forward: its parameters still hold the storage the route gave them (one it
  // updates and sends), else an error naming the parameter (torch::load, set_data, model->to(dtype) since)
  // `during`: what the check is for in the error ("" : the forward of boundary b)
  virtual void check_params(int /*b*/, const std::string& /*during*/) const {}

  // ---- optimizer ----
  virtual void finish_reduces() {}                               // wait, fold into the accumulators
  virtual void collect_flags(std::vector<at::Tensor>& /*out*/) {}  // device flags, read once per step
  virtual void install_grads(const float*& /*flag*/) {}            // walks the host copy of collect_flags
  virtual void ready_grads(std::vector<ReadyGrad>& out) = 0;      // what this rank updates (taken again until stepped)
  virtual void stepped() {}  // the step updated with them: drops what it holds outside p.grad
  virtual void discard_grads() {}                                // zero_grad: waits, drops, issues nothing
  // zero_grad, after discard_grads, for what a route keeps outside p.grad: set_to_none=false leaves a zero
  // gradient where a gradient was (torch's p.grad after it), set_to_none=true none
  virtual void after_zero_grad(bool /*set_to_none*/) {}
  virtual void upcast_local_grads() {}                           // NoSync: accumulate in the master dtype
  virtual void publish(bool /*async*/) {}                        // after the update
  virtual void wait_publishes() {}
  // a collective of this route is issued and not finished (non-blocking: polls; local)
  virtual bool in_flight() { return false; }
  // the collectives one training step (forward, backward, step; no accumulation) issues on this
  // rank, as the counters count them (local; the dedicated route: its all_gather-mode units only,
  // get_comm_plan's per-rank tables cover broadcast mode)
  virtual void plan_step_traffic(std::vector<PlannedTraffic>& /*out*/) const {}

  // ---- what it trains ----
  // true when this route trains `name` (fills v: route, full shape, boundary, owner, slice)
  virtual bool describe(const std::string& name, ParamView& v) const = 0;

  // ---- checkpoints (collective: every rank, same order) ----
  // Pure virtual: a route that forgot one would silently drop its parameters from checkpoints.
  virtual void gather_full(const TensorSink& put) = 0;  // full values (master precision)
  // takes each parameter's value from `source` (this rank reads only what it keeps)
  virtual void assign_from(ParamSource& source) = 0;
  // the shape of each parameter as this TP rank's routes hold it whole (placeholders hold none)
  virtual void full_shapes(std::map<std::string, std::vector<int64_t>>& out) const = 0;
  virtual void state_slots(std::vector<StateSlot>& out) const = 0;
  virtual void gather_state(const OptimizerStateReader& opt, const StateSink& put) = 0;
  // local: the ranks that update a parameter take its state from `get` (converted to their dtype,
  // device and slice); the others keep none
  virtual void assign_state(OptimizerStateAccess& opt, const StateSource& get) = 0;
};

}  // namespace dmuon
