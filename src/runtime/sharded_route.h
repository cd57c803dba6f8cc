// Internal: the sharded_adamw route (ZeRO-3 style base parameters).
//
// Each shard rank keeps 1/G of the parameter (padded to a multiple of G) and the AdamW state of that
// slice; a boundary's forward all-gathers the full tensor, backward reduce-scatters the gradient
// (averaged over all ranks; on HSDP the shard is then all-reduced over the replicate group).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/communicator.h"
#include "runtime/grad_accumulator.h"
#include "runtime/route.h"

namespace dmuon {

class RouteContext;

// One collective that the entries of a boundary with one dtype share: one all-gather (forward/backward)
// and one reduce-scatter (backward) per boundary and dtype, not one per parameter (a model's norms and biases
// are hundreds of small tensors: each collective's fixed cost dominated their step).
struct ShardedPack {
  at::Tensor src;           // all-gather: the shards back to back (param dtype); reduce-scatter: [G, W] payload
  at::Tensor buf;           // all-gather: [G * S] gathered; reduce-scatter: this rank's [W] output
  int64_t width = 0;        // S = sum of L (all-gather) or W = sum of (L + 1) (reduce-scatter)
  bool replicated = false;  // reduce-scatter on HSDP: `buf` was all-reduced over the replicate group
  std::string name;         // what it carries, for the collectives' names
};

struct ShardedEntry {
  enum class State { Released, Pending, Ready };
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
  State state = State::Released;
  int64_t ready_pass = -1;
  Pending gather;
  std::shared_ptr<ShardedPack> gather_pack;  // the boundary's packed all-gather in flight (null: its own)
  int64_t gather_at = 0;            // this entry's offset in each rank's packed shards
  at::Tensor rs_out;                // this rank's [L grads, 1 flag] of the reduce-scatter (a view of rs_pack's)
  std::shared_ptr<ShardedPack> rs_pack;  // the boundary's packed reduce-scatter in flight
  Pending rs;
  bool rs_issued = false;
  GradAccumulator acc;              // averaged shard gradient over backward passes, has-grad flag
  at::Tensor grad;                  // set by install_grads when some rank produced a gradient
  bool had_grad = false;            // torch's p.grad would be a tensor: stepped with one since set_to_none
  bool accumulated = false;
  std::shared_ptr<torch::autograd::Node> grad_acc;
};

class ShardedRoute final : public Route {
 public:
  explicit ShardedRoute(RouteContext& ctx) : ctx_(ctx) {}
  RouteKind kind() const override { return RouteKind::Sharded; }

  // ---- setup (setup's route table) ----
  // Refuses what sharded_adamw cannot train: every parameter on the DDP path, empty or
  // non-contiguous tensors.
  static void check(const std::string& name, const at::Tensor& p, const RoutingContext& ctx);
  // The route over `params`, one entry per parameter: this rank's slice of rank 0's value
  // (collective: broadcasts over the world, packed per dtype, in order).
  static std::unique_ptr<Route> make(RouteContext& ctx, std::vector<BoundParam> params);
  void add(const BoundParam& p);
  void take_initial_slices();
  // After the parameters took their forward dtype: hooks, and the parameters become placeholders.
  void install() override;

  // ---- Route ----
  void issue_unshard(int b, const char* phase) override;
  void wait_unshard(int b) override;
  void release(int b) override;
  void issue_reduce(int b) override;
  void reset_pass() override;
  void check_params(int b, const std::string& during) const override;
  void finish_reduces() override;
  void collect_flags(std::vector<at::Tensor>& out) override;
  void install_grads(const float*& flag) override;
  void ready_grads(std::vector<ReadyGrad>& out) override;
  void stepped() override;
  void discard_grads() override;
  void after_zero_grad(bool set_to_none) override;
  bool in_flight() override;
  void plan_step_traffic(std::vector<PlannedTraffic>& out) const override;
  void upcast_local_grads() override;
  void gather_full(const TensorSink& put) override;
  void assign_from(ParamSource& source) override;
  void full_shapes(std::map<std::string, std::vector<int64_t>>& out) const override;
  bool describe(const std::string& name, ParamView& v) const override;
  void state_slots(std::vector<StateSlot>& out) const override;
  void gather_state(const OptimizerStateReader& opt, const StateSink& put) override;
  void assign_state(OptimizerStateAccess& opt, const StateSource& get) override;

  // ---- queries and checkpoint helpers ----
  const std::vector<ShardedEntry>& entries() const { return entries_; }
  const ShardedEntry* find(const std::string& name) const;
  // the full tensor from every shard rank's `slice` of entry `e` (collective over the shard group)
  void gather_packed(const std::vector<std::pair<size_t, at::Tensor>>& items, const std::string& what,
                     const std::function<void(size_t, const at::Tensor&)>& got) const;
  // this rank's zero-padded slice of a full tensor of entry `e`
  at::Tensor slice_of(const ShardedEntry& e, const at::Tensor& full, const at::TensorOptions& options) const;
  // Writes this rank's slice of e's value, read from `source`, into e.shard (zero padding after).
  void fill_shard(ShardedEntry& e, ParamSource& source) const;

 private:
  void finish(ShardedEntry& e);
  // `ids` (entries of one boundary) split by `dtype` of each, in order of first appearance: one collective each
  template <typename DtypeOf>
  std::vector<std::vector<int>> packs(const std::vector<int>& ids, DtypeOf dtype) const;
  std::string pack_name(const std::vector<int>& pack) const;
  RouteContext& ctx_;
  std::vector<ShardedEntry> entries_;
  std::map<std::string, int> index_;                 // name -> entry
  std::vector<std::vector<int>> by_boundary_;
};

}  // namespace dmuon
