// Internal: the runtime state dedicate_params attaches to a model.
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
#include <tuple>
#include <vector>

#include "dmuon/communicator.h"
#include "dmuon/host_sync.h"
#include "dmuon/dedicate.h"
#include "dmuon/mesh.h"
#include "dmuon/owner_plan.h"

namespace dmuon {

// A parameter's resolved mixed-precision policy (ParamPolicy's dtype fields with defaults applied).
struct Precision {
  at::ScalarType param = at::kFloat;   // dtype of the module parameter in forward/backward
  at::ScalarType reduce = at::kFloat;  // gradient reduce payload
  at::ScalarType master = at::kFloat;  // what the optimizer updates and gradients are averaged in
  at::ScalarType optim = at::kFloat;   // optimizer state
  bool has_master() const { return master != param; }
  bool operator==(const Precision&) const = default;
  bool operator<(const Precision& o) const {
    return std::tie(param, reduce, master, optim) < std::tie(o.param, o.reduce, o.master, o.optim);
  }
};

// One (boundary, owner) pair: the params of one boundary that one owner publishes, packed into one
// flat buffer so each owner issues one broadcast and receives one reduce per boundary and step.
// Param data on every rank are views into `flat`. On the owner `flat` is never released (with mixed
// precision it is the param-dtype rounding of `master`, which the optimizer updates); on other ranks
// its storage is resized to 0 bytes while released, so every view and every tensor autograd saved
// sees the memory come and go (FSDP-style).
struct PackedBuffer {
  enum class State { Released, Pending, Ready };
  int root = 0;                     // owner's rank in the shard group
  int root_global = 0;              // owner's global rank
  OwnerCoord owner;
  std::vector<int> params;          // indices into DedicatedState::params
  std::vector<int64_t> offsets;     // element offset of each param in flat
  int64_t numel = 0;
  bool is_root = false;              // holds the full matrix between steps: shard rank == owner.shard
  bool is_owner = false;             // the global owner (== is_root on a 1-D mesh): runs NS
  bool gather_mode = false;          // muon_forward_unshard = all_gather
  int64_t shard_len = 0;             // all_gather: every rank keeps flat[r*L, (r+1)*L) of the owner's value
  at::Tensor shard;
  Pending scatter;
  at::Tensor flat;                  // [numel], param dtype
  Precision prec;                   // shared by every param of the buffer
  at::Tensor master;                // global owner, prec.has_master(): [numel] in the master dtype
  std::vector<at::Tensor> views;    // per param: flat.narrow(...).view(shape)
  State state = State::Released;
  int64_t ready_pass = -1;          // forward pass the data was broadcast for
  Pending bcast;
  at::Tensor bcast_payload;         // compute-dtype payload when it differs from the param dtype
  // backward
  at::Tensor grad_payload;          // [numel + params.size()] grads then has-grad flags
  Pending reduce;                    // stage 1: over the shard group to the shard-local holder
  bool reduce_issued = false;
  Pending stage2;                    // stage 2 (HSDP): over the replicate group to the global owner
  bool stage2_issued = false;
  std::vector<Pending> publish;      // HSDP post-step publish over the replicate group (chunks)
  // root: sum over backward passes (gradient accumulation) of the averaged gradients, and per param
  // the summed has-gradient flags (kept on the device: read once per step, in prepare_grads)
  at::Tensor reduced_sum;
  at::Tensor reduced_flags;
  int64_t bytes() const { return numel * flat.element_size(); }
};

// A base parameter on the sharded_adamw route (ZeRO-3 style): each shard rank keeps 1/G of it
// (padded to a multiple of G) and the AdamW state of that slice; a boundary's forward all-gathers
// the full tensor, backward reduce-scatters the gradient (averaged over all ranks; on HSDP the shard
// is then all-reduced over the replicate group).
struct ShardedEntry {
  std::string name;
  at::Tensor param;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t shard_len = 0;            // L: padded numel = L * G
  int boundary = 0;
  at::Tensor shard;                 // [L] this rank's slice: the master the optimizer updates (master dtype)
  Precision prec;
  at::Tensor gather_src;            // the shard cast to the param dtype while an all-gather is in flight
  at::Tensor full;                  // [L * G] gather target; its storage is 0 bytes while released
  at::Tensor view;                  // full[:numel] viewed as the parameter's shape
  at::Tensor placeholder;
  PackedBuffer::State state = PackedBuffer::State::Released;
  int64_t ready_pass = -1;
  Pending gather;
  at::Tensor rs_in, rs_out;         // reduce-scatter payload: G chunks of [L grads, 1 flag]
  Pending rs;
  bool rs_issued = false;
  at::Tensor grad_sum;              // averaged shard gradient, summed over backward passes
  at::Tensor grad_flag;             // [1] summed has-gradient flags (device), read in prepare_grads
  bool has_grad = false;            // set by prepare_grads: some rank produced a gradient
  bool accumulated = false;
  std::shared_ptr<torch::autograd::Node> grad_acc;
};

struct Boundary {
  std::string name;
  std::weak_ptr<torch::nn::Module> module;
  int index = 0;                    // model order
  std::vector<int> params;          // dedicated params in this boundary
  std::vector<int> sharded;         // sharded_adamw params in this boundary
  std::vector<PackedBuffer> buffers;
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

struct ParamEntry {
  std::string name;
  at::Tensor param;
  std::vector<int64_t> shape;
  Precision prec;
  OwnerCoord owner;
  int owner_rank = 0;
  int boundary = 0;
  int buffer = 0;
  int slot_in_buffer = 0;
  bool is_owner = false;
  bool accumulated = false;
  at::Tensor placeholder;           // 0-element tensor of the param's dtype/device
  std::shared_ptr<torch::autograd::Node> grad_acc;  // keep alive: autograd holds it weakly
};

// Replicated (DDP-style) base parameters.
struct ReplicatedParams {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<std::vector<int>> buckets;  // indices into params (one reduce dtype and master dtype each)
  std::vector<Precision> bucket_prec;
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accs;
  std::vector<at::Tensor> payloads;  // per bucket: grads then has-grad flags
  std::vector<Pending> pending;
  bool issued = false;
  std::vector<at::Tensor> sums;      // per bucket: sum over backward passes of averaged grads
  std::vector<at::Tensor> flags;     // per bucket: summed has-gradient flags (device)
};

class DedicatedState {
 public:
  DedicatedState(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<Mesh> mesh, DedicateOptions opts);

  // ---- setup (dedicate.cpp) ----
  void build(const ParamPredicate& predicate);

  // ---- boundary hooks (boundary.cpp) ----
  void begin_root_forward();  // the dedicated model itself runs through dmuon::forward
  void pre_forward(int b);
  void post_forward(int b);
  void pre_backward(int b);
  void post_backward(int b);
  void note_post_hook(int b);  // a use of boundary b whose backward will fire post_backward
  void on_param_accumulated(int p);
  void end_of_backward();
  void ensure_backward_callback();
  std::string bypass_hint() const;  // names a boundary not entered in the current forward pass

  // ---- optimizer interface ----
  void prepare_grads();             // wait reduces; owners get averaged grads
  void drain_all();                 // waits every in-flight collective of this model
  // zero_grad: waits the gradient collectives already in flight (every rank issued them) and drops
  // every gradient dmuon holds (reduced sums, replicated and sharded sums); issues no collective.
  void discard_grads();

  // ---- replicated params (replicate.cpp) ----
  void setup_replicate(double bucket_mb);
  void flush_replicated();  // end of backward: issue the coalesced all-reduces (async)
  // prepare_grads: install the averaged gradients; `flag` walks the host copy of the buckets'
  // has-gradient flags (advanced past them)
  void install_replicated(const float*& flag);
  void discard_replicated();  // zero_grad: wait them and drop the result

  std::weak_ptr<torch::nn::Module> model;
  std::shared_ptr<Mesh> mesh;
  DedicateOptions opts;
  OwnerPlan plan;
  std::vector<ParamSpec> specs;               // planner input, per dedicated param
  std::vector<std::string> boundary_of_param;  // hook boundary name, per dedicated param
  std::vector<ParamEntry> params;
  std::vector<Boundary> boundaries;
  std::map<std::string, int> param_index;
  std::vector<ShardedEntry> sharded;             // sharded_adamw base parameters
  std::map<std::string, int> sharded_index;
  ShardedEntry* sharded_of(const at::Tensor& p);
  void on_sharded_accumulated(int i);
  std::unique_ptr<ReplicatedParams> replicated;
  // mixed precision: the resolved policy of every parameter dedicate_params cast or gave a master
  // (absent: plain, the parameter's own dtype everywhere), and the master copies this rank updates
  // (owned Muon matrices: views into PackedBuffer::master; replicated parameters). A sharded_adamw
  // parameter's master is its ShardedEntry::shard.
  std::map<const c10::TensorImpl*, Precision> precision;
  std::map<const c10::TensorImpl*, at::Tensor> masters;
  Precision precision_of(const at::Tensor& p) const;  // the default for a parameter without a policy
  bool z3() const { return opts.reshard_after_forward && !ddp; }
  bool ddp = false;          // dedicate_params_ddp: full params everywhere, publish after step
  bool no_sync = false;      // inside a NoSync scope
  bool boundaries_seen = false;  // the model runs its boundaries through dmuon::forward
  void publish(bool async);  // DDP path: owners broadcast their updated matrices
  void wait_publishes();     // waits every in-flight broadcast
  void upcast_local_grads(); // NoSync: local gradients accumulate in the master dtype

  mutable std::recursive_mutex mu;
  // iteration bookkeeping
  int64_t pass = 0;                       // forward pass counter
  std::vector<int> current_order;         // boundaries entered in the current forward pass
  std::vector<int> recorded_order;        // the previous pass's order (prefetch schedule)
  bool backward_since_forward = true;
  bool callback_queued = false;
  size_t next_reduce = 0;                 // position in reduce_order
  std::vector<int> reduce_order;          // reverse of current_order, fixed at first backward hook
  bool reduce_order_fixed = false;

 private:
  // shared helpers (boundary.cpp)
  void issue_broadcasts(int b, const char* phase);
  void wait_broadcasts(int b);
  void release(int b);
  void issue_reduce(int b);
  void finish_reduce(PackedBuffer& buf);  // both stages, then the owner folds into reduced_sum
  void finish_stage1(PackedBuffer& buf);  // wait stage 1; HSDP holders issue stage 2
  void finish_stage2(PackedBuffer& buf);  // wait stage 2; the global owner folds
  void fold_into_sum(PackedBuffer& buf, double divisor);
  void finish_sharded(ShardedEntry& e);
  void wait_publish(PackedBuffer& buf);
  void fold_replicated();                 // wait the replicated all-reduces; fold into sums
  void try_issue_reduces();
  // a parameter of boundary b got its gradient in this backward pass (flag: its own accumulated bit)
  void note_accumulated(bool& accumulated, int b);
  void begin_forward_pass();
  void prefetch_after(int b, bool backward);
};

namespace detail {
// registry lookups
std::shared_ptr<DedicatedState> state_of_model(const torch::nn::Module* model);
// state_of_model, or an error naming `fn` when the model was not dedicated
std::shared_ptr<DedicatedState> require_state(const torch::nn::Module& model, const char* fn);
std::pair<std::shared_ptr<DedicatedState>, int> boundary_of_module(const torch::nn::Module* module);
void register_state(const std::shared_ptr<torch::nn::Module>& model, const std::shared_ptr<DedicatedState>& state);
void register_boundary(const std::shared_ptr<torch::nn::Module>& module, const std::shared_ptr<DedicatedState>& s,
                       int b);
// Runs `fn` each time autograd has accumulated `param`'s gradient. Returns the accumulator node:
// keep it alive (autograd holds it only weakly) and create it while `param` has its full shape
// (the node caches it). Throws naming `name` and `rank` when `param` is not a leaf requiring grad.
std::shared_ptr<torch::autograd::Node> on_grad_accumulated(const at::Tensor& param, const std::string& name, int rank,
                                                           std::function<void()> fn);
// resize a tensor's StorageImpl in place (every view and saved tensor sees it)
void resize_storage_bytes(const at::Tensor& t, size_t bytes);
}  // namespace detail

}  // namespace dmuon
