// Internal: one way a parameter is trained. The Runtime keeps the boundary schedule and calls every
// route at the same points of the step, in a fixed order (dedicated, sharded, replicated), so all
// ranks issue the same collectives in the same order.
//
// Lifetimes: a Route belongs to its Runtime and holds a reference to it. Autograd hooks and
// functions never hold a Route or Runtime pointer: they hold a std::weak_ptr<Runtime> (or its id in
// the registry), so a hook that outlives its model does nothing.
//
// Threading: every method runs under the Runtime's mutex (autograd may call hooks from its worker
// threads); none is re-entrant from another thread.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dmuon/deferred_init.h"
#include "runtime/precision.h"

namespace dmuon {

enum class RouteKind { Dedicated, Sharded, Replicated, Local };
const char* route_name(RouteKind k);

// A gradient ready for the optimizer (after Runtime::prepare_grads).
struct ReadyGrad {
  RouteKind route = RouteKind::Local;
  std::string name;
  at::Tensor param;      // the module's parameter: optimizer state key and param-group membership
  at::Tensor target;     // what the optimizer updates: the master copy, this rank's shard, or param
  at::Tensor grad;       // averaged gradient, in the master dtype, shaped like target
  Precision prec;
  bool write_back = false;  // target is a master: round it into param after the update
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
};

using TensorSink = std::function<void(const std::string& name, const at::Tensor& full)>;
using FullValues = std::map<std::string, at::Tensor>;

class Route {
 public:
  virtual ~Route() = default;
  virtual RouteKind kind() const = 0;

  // ---- forward / backward of boundary b (collective: every rank, same order) ----
  virtual void issue_unshard(int /*b*/, const char* /*phase*/) {}  // broadcast / all-gather its parameters
  virtual void wait_unshard(int /*b*/) {}                           // local: wait, install the full data
  virtual void release(int /*b*/) {}                                // local: free what this rank does not keep
  virtual void issue_reduce(int /*b*/) {}                           // boundary b's gradients are complete
  virtual void end_of_backward() {}                                 // every boundary reduced (not in NoSync)
  virtual void reset_pass() {}                                      // a backward pass ended: clear per-pass bits

  // ---- optimizer ----
  virtual void finish_reduces() {}                               // wait, fold into the accumulators
  virtual void collect_flags(std::vector<at::Tensor>& /*out*/) {}  // device flags, read once per step
  virtual void install_grads(const float*& /*flag*/) {}            // walks the host copy of collect_flags
  virtual void ready_grads(std::vector<ReadyGrad>& /*out*/) {}     // what this rank updates; hands them over
  virtual void discard_grads() {}                                // zero_grad: waits, drops, issues nothing
  virtual void upcast_local_grads() {}                           // NoSync: accumulate in the master dtype
  virtual void publish(bool /*async*/) {}                        // after the update
  virtual void wait_publishes() {}

  // ---- checkpoints (collective: every rank, same order) ----
  virtual void gather_full(const TensorSink& /*put*/) {}             // full values (master precision)
  // takes each parameter's value from `source` (this rank reads only what it keeps)
  virtual void assign_from(ParamSource& /*source*/) {}
  virtual void full_shapes(std::map<std::string, std::vector<int64_t>>& /*out*/) const {}
};

}  // namespace dmuon
