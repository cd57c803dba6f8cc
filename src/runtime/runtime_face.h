// Internal: the one face a dedicated model's runtime shows the layers above it (optim, io). The
// optimizer prepares the gradients, is handed them group by group, and publishes; checkpoints
// gather and assign parameters and optimizer state; diagnostics describe. Which route trains a
// parameter, and how, stays behind this face: a new route changes nothing above the runtime.
//
// Every method takes the runtime's lock; the ones marked collective must be called by every rank
// in the same order.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dmuon/dedicate.h"
#include "dmuon/deferred_init.h"
#include "dmuon/mesh.h"
#include "dmuon/owner_plan.h"
#include "runtime/route.h"

namespace torch::nn {
class Module;
}

namespace dmuon {

// What Muon::step does with the gradients the runtime hands it (RuntimeFace::step).
class StepVisitor {
 public:
  virtual ~StepVisitor() = default;
  // One group of ready gradients: update each (the weights are final on return; the group may be
  // published at once). Called once per group, in the same order on every rank.
  virtual void update(const std::vector<ReadyGrad>& group) = 0;
  // every group updated, before the post-step publish (TP: scatter the gathered updates)
  virtual void before_publish() {}
  // timing: the runtime is preparing gradients (waiting reduces) / publishing
  enum class Phase { Prepare, Publish };
  virtual void begin(Phase /*p*/) {}
  virtual void end(Phase /*p*/) {}
};

class RuntimeFace {
 public:
  virtual ~RuntimeFace() = default;

  // ---- queries (local) ----
  virtual Mesh& mesh() const = 0;
  virtual const DedicateOptions& options() const = 0;
  virtual bool ddp() const = 0;  // dedicate_params_ddp
  virtual bool z3() const = 0;
  virtual std::vector<ParamView> describe() const = 0;  // every trainable parameter, model order
  virtual bool has_replicated_route() const = 0;        // dmuon::replicate was called
  virtual const std::map<std::string, int>& tp_split() const = 0;  // TP-split parameters -> split dim
  virtual const OwnerPlan& plan() const = 0;
  // every route's collectives of one training step on this rank (Route::plan_step_traffic)
  virtual std::vector<PlannedTraffic> planned_step_traffic() const = 0;
  virtual const std::vector<ParamSpec>& specs() const = 0;               // planner input, per Muon matrix
  virtual const std::vector<std::string>& boundary_of_param() const = 0;  // per Muon matrix
  virtual std::vector<int64_t> optim_element_sizes() const = 0;          // per Muon matrix (TP exchange)

  // ---- the optimizer (collective) ----
  // Waits every gradient collective and installs the averaged gradients (idempotent).
  virtual void prepare_grads() = 0;
  // Before gradients are used to update (step, clipping; step() checks itself): refuses those of a backward
  // that ran inside no_sync on several data-parallel ranks -- never reduced, each replica's own. Local.
  virtual void require_reduced_grads(const char* fn) const = 0;
  // after prepare_grads: what this rank updates (clip_grad_norm_ takes them before step)
  virtual std::vector<ReadyGrad> take_ready_grads() = 0;
  // One optimizer step: prepares the gradients and hands them to `v` group by group -- per hook
  // group ahead of the next group's reduce where that overlaps (group_prepare_ahead on HSDP), in one
  // group otherwise, or exactly `taken` (gradients taken before, e.g. by clipping) -- then publishes
  // (async: the next forward waits the publishes).
  virtual void step(bool group_prepare_ahead, bool async, std::optional<std::vector<ReadyGrad>> taken,
                    StepVisitor& v) = 0;
  // After step(): the next forward pass begins now; the first `groups` boundaries of the recorded
  // forward order issue their dedicated unshards (and, with `sharded_adamw`, their sharded_adamw
  // all-gathers; of the first boundary when `groups` is 0), which that forward then only waits.
  // Nothing without a recorded order or on the DDP path.
  virtual void prefetch_next_forward(int groups, bool sharded_adamw) = 0;
  // The sharded_adamw all-gathers on the mesh's sharded_unshard group (true; the mesh must have one:
  // Mesh::set_sharded_unshard_group) or on the shard group with the dedicated broadcasts. Local; every
  // rank the same, before the next forward.
  virtual void set_separate_sharded_unshard(bool on) = 0;
  // The optimizer ends each step with the world's verdict on non-finite gradients (one all-gather of
  // kStepVerdictRowBytes per rank, Muon::step): counted in planned_step_traffic. Local.
  virtual void set_step_verdict(bool on) = 0;
  // A dmuon optimizer was built on this runtime: it takes the gradients dmuon holds (a dedicated matrix's
  // reduced sum outside p.grad). Without one (and no prepare_grads), a second backward warns once that no
  // other optimizer sees them. Returns the optimizer's number (1, 2, ... on this runtime). Local.
  virtual uint64_t attach_optimizer() = 0;
  // Optimizer `id` (attach_optimizer's number) takes the current gradients (its step or clipping): returns
  // the number of another optimizer that took them already -- since the last backward or zero_grad --
  // and changes nothing then; else records `id` and returns 0. Local (every rank steps its optimizers in
  // one order).
  virtual uint64_t take_gradients(uint64_t id) = 0;
  // optimizer `id` is gone: whatever it took, no optimizer holds any more. Local.
  virtual void release_gradients(uint64_t id) = 0;
  // TP: `apply` finishes the update of `name` when its slice has arrived -- before the holder's data
  // are read or sent again (local)
  virtual void defer_update(const std::string& name, std::function<void()> apply) = 0;
  // zero_grad: drops every gradient dmuon holds (waits what is in flight; issues nothing); with
  // set_to_none false, what dmuon keeps outside p.grad becomes zeros where a gradient was, as torch leaves
  // p.grad (so a parameter without a gradient in the next backward is still stepped, with a zero one)
  virtual void discard_grads(bool set_to_none) = 0;
  // counts the changes of the gradients since setup: every backward's end and every discard_grads
  // (gradients taken before one are stale: Muon::clip_grad_norm_'s set). Local.
  virtual uint64_t grads_epoch() const = 0;

  // ---- checkpoints (collective) ----
  // waits every post-step publish, prefetch and pending reduce
  // (collective: first agrees that no rank's model had a dedicated or sharded_adamw parameter replaced since
  // dedicate_params -- its bytes would reach the other ranks' buffers -- refusing on every rank, naming `fn`)
  virtual void drain(const std::string& fn) = 0;
  // every parameter's full value (master precision; TP: this TP rank's slice) to `put`
  virtual void gather_params(const TensorSink& put) = 0;
  // every parameter's full shape (TP: the full tensor's), model order
  virtual std::vector<std::pair<std::string, std::vector<int64_t>>> param_shapes() const = 0;
  // every parameter (and each of `extra`, e.g. buffers, whole) from `source`; drops gradients;
  // throws on every rank when a read failed on any
  virtual void assign_params(ParamSource& source, const std::vector<std::pair<std::string, at::Tensor>>& extra,
                             const std::string& what) = 0;
  virtual std::vector<StateSlot> state_slots() const = 0;  // local
  virtual void gather_state(const OptimizerStateReader& opt, const StateSink& put) = 0;
  virtual void assign_state(OptimizerStateAccess& opt, const StateSource& get) = 0;  // local
};

namespace detail {
// The runtime of a dedicated model (null when the model was not dedicated).
std::shared_ptr<RuntimeFace> face_of(const torch::nn::Module& model);
// face_of, or an error naming `fn` when the model was not dedicated
std::shared_ptr<RuntimeFace> require_face(const torch::nn::Module& model, const char* fn);
}  // namespace detail

}  // namespace dmuon
