// Internal: the route of dedicated Muon matrices.
//
// Each matrix has one owner. Per (boundary, owner) the matrices are packed into one flat buffer, so
// each owner issues one broadcast (or all-gather) and receives one reduce per boundary and step.
// Between steps the holder keeps the buffer (the owner; on HSDP the owner's shard column in every
// replicate group); other ranks resize its storage to 0 bytes, so every view and saved tensor sees
// the memory come and go (FSDP-style). Z3 releases after forward and unshards again in backward,
// Z2 keeps it until after backward. Gradients go to the holder by a reduce over the shard group and,
// on HSDP, to the global owner by a second reduce over the replicate group; only the global owner
// runs Newton-Schulz and publishes the update (HSDP: over the replicate group; all_gather unshard:
// a scatter into every rank's shard). The DDP path (dedicate_params_ddp) is a construction option:
// every rank keeps full matrices, and the owner broadcasts its update after step().
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <functional>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/communicator.h"
#include "dmuon/owner_plan.h"
#include "runtime/grad_accumulator.h"
#include "runtime/route.h"

namespace dmuon {

class RouteContext;

enum class UnshardMode { Broadcast, AllGather };

struct DedicatedEntry {
  std::string name;
  at::Tensor param;
  std::vector<int64_t> shape;       // as this rank's routes hold it (TP: this TP rank's slice)
  Precision prec;
  int tp_dim = -1;                  // TP: the split dimension (-1: whole on every TP rank)
  int tp_owner = -1;                // TP: the TP rank that runs Newton-Schulz (-1: no TP axis)
  std::vector<int64_t> full_shape;  // the full logical shape (== shape without TP split)
  UnshardMode unshard = UnshardMode::Broadcast;
  int boundary = 0;
  // from the plan
  OwnerCoord owner;
  int owner_rank = 0;
  bool is_owner = false;
  int buffer = 0;                   // index in the boundary's buffers
  int slot_in_buffer = 0;
  // per backward pass
  bool accumulated = false;
  // The owner's gradient from the last step (installed by prepare_grads) stays in param.grad() until
  // zero_grad, as torch's do. Autograd would add the next backward's local gradient to it, and the
  // reduce would then average it over the ranks a second time, so a gradient arriving for it moves it
  // here instead; prepare_grads adds it to the new average: torch's accumulation, on any world size.
  bool grad_installed = false;
  at::Tensor carried_grad;
  at::Tensor placeholder;           // 0-element tensor of the param's dtype/device
  bool preset = false;              // a deferred parameter whose holder filled its buffer slot at setup
  std::shared_ptr<torch::autograd::Node> grad_acc;  // keep alive: autograd holds it weakly
};

struct PackedBuffer {
  enum class State { Released, Pending, Ready };
  int root = 0;                     // holder's rank in the shard group
  int root_global = 0;              // holder's global rank
  OwnerCoord owner;
  std::vector<int> params;          // indices into DedicatedRoute::entries()
  std::vector<int64_t> offsets;     // element offset of each param in flat
  int64_t numel = 0;
  bool holder = false;              // holds the full matrix between steps: shard rank == owner.shard
  bool keeps = false;               // keeps its data between steps: the holder, or every rank on the DDP path
  bool is_owner = false;            // the global owner (== holder on a 1-D mesh): runs NS
  UnshardMode unshard = UnshardMode::Broadcast;
  int64_t shard_len = 0;            // all_gather: every rank keeps flat[r*L, (r+1)*L) of the owner's value
  at::Tensor shard;
  Pending scatter;
  at::Tensor flat;                  // [numel] (all_gather: padded to G*L), param dtype
  Precision prec;                   // shared by every param of the buffer
  at::Tensor master;                // global owner, prec.has_master(): [flat.numel()] in the master dtype
  std::vector<at::Tensor> views;    // per param: flat.narrow(...).view(shape)
  State state = State::Released;
  int64_t ready_pass = -1;          // forward pass the data was unsharded for
  Pending bcast;
  at::Tensor bcast_payload;         // compute-dtype payload when it differs from the param dtype
  // backward
  at::Tensor grad_payload;          // [numel + params.size()] grads then has-grad flags
  Pending reduce;                   // stage 1: over the shard group to the holder
  bool reduce_issued = false;
  Pending stage2;                   // stage 2 (HSDP): over the replicate group to the global owner
  bool stage2_issued = false;
  std::vector<Pending> publish;     // HSDP post-step publish over the replicate group (chunks)
  // TP: updates still arriving by scatter, applied before the holder's data are read or sent again
  std::vector<std::function<void()>> deferred;
  GradAccumulator acc;              // global owner: averaged gradients over backward passes
  bool gather_mode() const { return unshard == UnshardMode::AllGather; }
  int64_t bytes() const { return numel * flat.element_size(); }
};

class DedicatedRoute final : public Route {
 public:
  DedicatedRoute(RouteContext& ctx, bool ddp) : ctx_(ctx), ddp_(ddp) {}
  RouteKind kind() const override { return RouteKind::Dedicated; }

  // ---- setup ----
  // Takes the entries with owners from `plan` and packs them per (boundary, owner slot,
  // precision); owners copy the current values into their master. No collective.
  void build(std::vector<DedicatedEntry> entries, const OwnerPlan& plan, int num_boundaries);
  // After the parameters took their forward dtype: hooks, placeholders, initial data (collective:
  // all_gather shards, DDP / HSDP initial values from the owner).
  void install();

  // ---- Route ----
  void issue_unshard(int b, const char* phase) override;
  void wait_unshard(int b) override;
  void release(int b) override;
  void issue_reduce(int b) override;
  void end_of_backward() override;
  void reset_pass() override;
  void check_params(int b, const std::string& during) const override;
  void finish_reduces() override;
  void collect_flags(std::vector<at::Tensor>& out) override;
  void install_grads(const float*& flag) override;
  void ready_grads(std::vector<ReadyGrad>& out) override;
  void discard_grads() override;
  void after_zero_grad(bool set_to_none) override;
  void upcast_local_grads() override;
  void publish(bool async) override;
  void wait_publishes() override;
  bool in_flight() override;
  void plan_step_traffic(std::vector<PlannedTraffic>& out) const override;
  void gather_full(const TensorSink& put) override;
  void assign_from(ParamSource& source) override;
  void full_shapes(std::map<std::string, std::vector<int64_t>>& out) const override;
  bool describe(const std::string& name, ParamView& v) const override;
  void state_slots(std::vector<StateSlot>& out) const override;
  void gather_state(const OptimizerStateReader& opt, const StateSink& put) override;
  void assign_state(OptimizerStateAccess& opt, const StateSource& get) override;

  // TP (Muon::step): `apply` finishes the update of `name` (its slice arrives asynchronously). It runs
  // before the holder's buffer is read or sent again: the boundary's next unshard, a post-step
  // publish, wait_publishes, the next step. local.
  void defer_update(const std::string& name, std::function<void()> apply);
  void finish_deferred();  // every deferred update, now

  // Per group (hook boundary b), for Muon::step's group_prepare_ahead and prepare_muon_grads:
  // prepare_group waits b's stage-1 reduces (HSDP holders issue stage 2); finish_group waits stage 2,
  // installs the averaged gradients (one host read of b's flags) and returns b's ready gradients;
  // publish_group issues b's post-step publish (publish() then skips b until the step's end).
  // Collective in the same way as finish_reduces / publish: every rank, groups in the same order.
  void prepare_group(int b);
  std::vector<ReadyGrad> finish_group(int b);
  void publish_group(int b, bool async);
  // Whether step() sends anything per group: HSDP's publish, the DDP path's broadcasts, all_gather
  // mode's scatters (1-D broadcast mode publishes nothing: the next forward broadcasts).
  bool publishes_in_step() const;

  // ---- queries ----
  const std::vector<DedicatedEntry>& entries() const { return entries_; }
  const DedicatedEntry* find(const std::string& name) const;
  const std::vector<PackedBuffer>& buffers(int b) const { return buffers_[static_cast<size_t>(b)]; }
  // names a parameter of boundary b that is a placeholder on this rank ("" when none)
  std::string bypass_hint(int b) const;

 private:
  void finish_stage1(PackedBuffer& buf);  // wait stage 1; HSDP holders issue stage 2
  void finish_stage2(PackedBuffer& buf);  // wait stage 2; the global owner folds
  void wait_publish(PackedBuffer& buf);        // the buffer's deferred updates, then its publishes
  void publish_gather_hsdp(int b, bool async);  // HSDP, all_gather mode: scatter in the owner's group, shards across
  void install_buffer(PackedBuffer& buf, const float*& flag);  // the owner's averaged sums into p.grad()
  void carry_installed_grad(DedicatedEntry& e);  // a gradient arrives: the last step's leaves p.grad()
  void ready_grad_of(const DedicatedEntry& e, std::vector<ReadyGrad>& out) const;
  static void finish_deferred(PackedBuffer& buf);
  // all_gather mode: the holder's flat into every rank's shard (collective over the shard group)
  Pending scatter_shards(PackedBuffer& buf, const std::string& what);
  std::string what(const char* phase, int b, const PackedBuffer& buf) const;
  template <class F>
  void for_each_buffer(F&& f) {
    for (size_t b = 0; b < buffers_.size(); ++b)
      for (auto& buf : buffers_[b]) f(static_cast<int>(b), buf);
  }

  RouteContext& ctx_;
  bool ddp_ = false;
  std::vector<DedicatedEntry> entries_;
  std::map<std::string, int> index_;                 // name -> entry
  std::vector<std::vector<PackedBuffer>> buffers_;  // per boundary
  // Boundaries whose gradient reduces this rank sends without being their root, oldest first: their
  // payloads are freed as soon as the reduce is done, and at most kMaxReducesInFlight stay pending
  // (otherwise a rank would hold a full gradient of every matrix it does not own until step()).
  static constexpr size_t kMaxReducesInFlight = 1;
  std::deque<int> sent_reduces_;
  void release_sent_reduces();
  // HSDP: boundaries whose holders still owe the stage-2 (replicate-axis) reduce, in reduce order.
  // Each boundary's hook issues the stage 2 of those more than kStage2Lag boundaries back (waiting
  // their stage 1, issued that much earlier on every rank), so stage 2 runs under the rest of
  // backward; end_of_backward issues the rest. A fixed lag, never a poll: every rank of a replicate
  // group issues its collectives in the same order.
  static constexpr size_t kStage2Lag = 1;
  std::deque<int> stage2_due_;
  bool warned_user_grad_ = false;  // a gradient the caller set after the reduce was used (said once)
  void issue_due_stage2(size_t keep);
  std::vector<bool> published_;                      // per boundary: published in this step already
};

}  // namespace dmuon
