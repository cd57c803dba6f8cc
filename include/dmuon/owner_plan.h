// owner_plan.h -- who owns which Muon matrix (pure C++, no LibTorch).
//
// The planner is a deterministic free function: the same parameter list, grid and options give
// the same plan, bit for bit, on every machine (no hash seeds, no pointer values). Every rank of a
// job computes it locally, with no communication; the runtime then checks the plan's fingerprint
// across ranks so a mismatch is a clear error instead of a hang.
//
// Owner slots form a grid of G shard ranks x R replicate groups (R = 1 for a 1-D mesh). A slot is
// written (shard, replicate). Parameters are grouped into allocation units (small same-layer
// parameters packed together when pack_small_params), each unit is given one slot.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/ns_profile.h"

namespace dmuon {

// One Muon-target parameter, in model order.
struct ParamSpec {
  std::string name;             // fully qualified name, e.g. "model.layers.3.self_attn.q_proj.weight"
  std::vector<int64_t> shape;   // logical (full) shape; every dimension >= 1
  int64_t elem_bytes = 4;       // bytes per element of the published tensor (bf16 = 2, fp32 = 4)
  std::string group_key;        // optional assignment group key; empty = derive from the name
  std::string route;            // optional route label ("muon", "adamw", ...); informational here
  // Tensor parallelism (plan_owners_tp): the dimension of `shape` split over the T TP ranks, -1 when
  // the matrix is whole (and identical) on every TP rank.
  int tp_split_dim = -1;

  int64_t numel() const;
  int64_t bytes() const { return numel() * elem_bytes; }
};

// An owner slot. `replicate` is 0 on a 1-D mesh.
struct OwnerCoord {
  int shard = 0;
  int replicate = 0;
  bool operator==(const OwnerCoord&) const = default;
};

// Planner options. Unset optionals are resolved by resolve_plan_options(): the explicit value
// wins, else the environment override (DMUON_OWNER_STRATEGY, DMUON_OWNER_COST_MODEL,
// DMUON_HSDP_COLUMN_BALANCE, DMUON_OWNER_PACK_SMALL_PARAMS), else the default.
struct PlanOptions {
  std::optional<std::string> owner_strategy;    // "lpt" (default) | "round_robin" | "rank0"
  std::optional<std::string> owner_cost_model;  // "optimizer" (default) | "numel" | "profiled"
  // The measured NS times "profiled" balances by (ns_profile.h); unset: the file named by
  // DMUON_NS_PROFILE. Required by "profiled", ignored by the other cost models.
  std::shared_ptr<const NsProfile> ns_profile;
  std::optional<bool> hsdp_column_balance;      // default true (only matters when R > 1)
  std::optional<bool> pack_small_params;        // default true
  std::optional<int> max_owners_per_group;      // cap on distinct slots per assignment group
  int64_t pack_threshold_numel = 5'000'000;     // parameters below this are "small"
  int ns_steps = 5;                             // Newton-Schulz steps in the optimizer cost
};
// Cost models (param_cost), for a parameter viewed as an m x n matrix (m = shape[0], n = the
// product of the other dimensions; a 1-D parameter is 1 x shape[0]), s = min(m,n), b = max(m,n):
//   "optimizer": ns_steps * s*(m*n + 2*b*s)  (multiply-adds of ns_steps Newton-Schulz steps)
//                + bytes                      (publish footprint: equal-FLOP tensors that publish
//                                              more bytes weigh more, and slot ties are broken
//                                              by bytes, so publish bytes spread too)
//   "numel":     m*n
//   "profiled":  measured time in ns (ns_profile.h) of the matrix in the batch its owner runs:
//                per_matrix + fixed / max(1, k / S), k the matrices of its shape (and element size)
//                in the plan, S = G*R slots -- a shape's k matrices spread over min(k, S) owners,
//                each running its share as one batch, pay the per-batch cost once per owner. So
//                owners of many small same-shape matrices (MoE experts) are balanced on what the
//                batched step costs, and small and skinny matrices on their real per-call cost.
//
// Packing (pack_small_params, default on): a group's parameters with numel < pack_threshold_numel
// share allocation units. Packing never costs more than 1% of makespan: plan_owners computes the
// per-matrix plan (no packing) and returns the first packed variant whose makespan is within 1%
// of it (or of lower_bound, which needs no per-matrix plan), trying the plain packing (one unit
// per group's small parameters) first, then units capped at L/k for k = 1, 1.5, 2, 3, ..., 64
// (L = max(total / slots, largest parameter); a group's small parameters cut into consecutive
// runs of about equal cost); when none fits, the per-matrix plan. OwnerPlan::pack_cap says which
// variant was kept.
//
// Strategy "lpt" (default): units in decreasing cost (ties: first parameter index), each to the
// eligible slot with the least cost (ties: fewer bytes, then lower slot index). Eligible: the
// slot holds fewer than ceil(u / min(S, cap)) units of the unit's group (u = units in the group,
// S = G*R slots, cap = max_owners_per_group or S) -- so a layer with u <= S units uses u
// distinct slots (layer concurrency) -- and a group that already uses `cap` distinct slots only
// gets one of those. HSDP (R > 1) with hsdp_column_balance: first the shard column with the least
// column cost among columns holding fewer than ceil(u / min(G, cap)) units of the group (if any),
// then the least loaded eligible replicate in it. A deterministic refinement pass then lowers the
// most loaded slot while it can: moves, one-for-one and one-for-many swaps with another slot, and
// (when those fail) chains that shed a unit to a third, lightly loaded slot -- always keeping every
// constraint, and with column balance never raising the column makespan. It stops at the
// granularity floor (within 5e-4), when nothing improves, or after a fixed count of candidate
// evaluations (a count, not a clock, so the plan never depends on the machine). Without layer
// constraints greedy LPT alone is within 4/3 of the optimum (Graham); measured results against
// lower_bound / granularity_bound are in docs/PERF.md ("Owner planner").
// "round_robin": units in model order to slots 0,1,2,... (a capped group reuses its slots).
// "rank0": every unit on slot (0, 0). Both are ablations; their broken constraints are listed
// in OwnerPlan::violations.

// How owners are chosen (PlanOptions::owner_strategy spells it; the strings stay at the edges).
enum class OwnerStrategy { Lpt, RoundRobin, Rank0 };
const char* owner_strategy_name(OwnerStrategy s);  // "lpt" | "round_robin" | "rank0"
std::optional<OwnerStrategy> parse_owner_strategy(const std::string& s);  // nullopt: not a strategy
std::vector<std::string> owner_strategy_names();

struct ResolvedPlanOptions;
// What the owner planner balances: a cost per parameter (the cost models above). The shape of
// Distributed Shampoo's cost models: one object asked for every parameter's cost at once, since a
// matrix may cost what the batch it runs in costs. A new cost model is one class and one entry in
// owner_cost_model() (owner_plan.cpp; docs/ARCHITECTURE.md).
class OwnerCostModel {
 public:
  virtual ~OwnerCostModel() = default;
  virtual const char* name() const = 0;  // as PlanOptions::owner_cost_model spells it
  virtual std::string unit(const ResolvedPlanOptions& opts) const = 0;  // what a cost counts, for reports
  // it prices matrices by measured times: resolve_plan_options must find an NS profile
  virtual bool needs_ns_profile() const { return false; }
  // one parameter alone
  virtual double cost(const ParamSpec& p, const ResolvedPlanOptions& opts) const = 0;
  // every parameter of a plan over `slots` owners (default: cost() of each)
  virtual std::vector<double> costs(const std::vector<ParamSpec>& params, const ResolvedPlanOptions& opts,
                                    int slots) const;
};
// The cost model of that name ("optimizer", "numel", "profiled"); null for any other name.
std::shared_ptr<const OwnerCostModel> owner_cost_model(const std::string& name);
std::vector<std::string> owner_cost_model_names();

// Options with every optional resolved (explicit > environment > default). Throws
// std::invalid_argument naming the field and the bad value (e.g. an unknown strategy).
struct ResolvedPlanOptions {
  OwnerStrategy owner_strategy = OwnerStrategy::Lpt;
  std::shared_ptr<const OwnerCostModel> cost_model = owner_cost_model("optimizer");
  std::shared_ptr<const NsProfile> ns_profile;  // set when cost_model->needs_ns_profile()
  bool hsdp_column_balance = true;
  bool pack_small_params = true;
  std::optional<int> max_owners_per_group;
  int64_t pack_threshold_numel = 5'000'000;
  int ns_steps = 5;
};
ResolvedPlanOptions resolve_plan_options(const PlanOptions& opts);

// The hook-boundary / layer key of a parameter name: the `layers.N` or `blocks.N` ancestor
// including its prefix ("model.layers.3", "visual.blocks.5"); "" when there is none.
// Details: name components are split at '.', N is all digits; the outermost match wins
// ("a.layers.2.blocks.1.w" -> "a.layers.2"). Only when no `layers.N`/`blocks.N` exists, the
// secondary patterns `h.N` (GPT-2: "transformer.h.7") and `layer.N` (BERT: "encoder.layer.3")
// are tried, outermost first.
std::string layer_key_of(const std::string& param_name);

// Cost of one parameter under a cost model ("optimizer": shape-aware Newton-Schulz FLOP estimate
// plus a byte term; "numel": element count; "profiled": its measured time alone, k = 1).
double param_cost(const ParamSpec& p, const ResolvedPlanOptions& opts);
// The planner's cost of each parameter of a plan over `slots` owner slots: param_cost, except that
// "profiled" shares a shape's per-batch time among the matrices of that shape an owner batches.
std::vector<double> param_costs(const std::vector<ParamSpec>& params, const ResolvedPlanOptions& opts, int slots);

struct AllocationUnit {
  std::vector<int> params;  // indices into the input list, model order
  std::string group;        // assignment group (layer key, caller key, or the param's own name)
  double cost = 0;
  int64_t bytes = 0;
  OwnerCoord owner;
};

struct SlotLoad {
  OwnerCoord owner;
  double cost = 0;
  int64_t bytes = 0;
  int units = 0;
  int params = 0;
};

struct OwnerPlan {
  int shard_size = 1;                // G
  int replicate_size = 1;            // R
  ResolvedPlanOptions options;
  std::vector<OwnerCoord> owners;    // per input parameter
  std::vector<std::string> groups;   // per input parameter: its assignment group
  std::vector<AllocationUnit> units;
  std::vector<SlotLoad> slots;       // G*R entries, index = replicate * G + shard
  double makespan = 0;               // max slot cost
  // max(total / slots, largest single parameter's cost): a bound on every plan of these
  // parameters, packed or not (a packed unit above total / slots raises imbalance()).
  double lower_bound = 0;
  std::vector<std::string> violations;  // constraints that could not be met, one sentence each
  uint64_t fingerprint = 0;          // stable 64-bit hash of inputs + assignment

  double imbalance() const { return lower_bound > 0 ? makespan / lower_bound : 1.0; }
  int num_slots() const { return shard_size * replicate_size; }
  static int slot_index(OwnerCoord c, int shard_size) { return c.replicate * shard_size + c.shard; }

  // ---- additions (not part of the original contract; nothing above depends on them) ----
  double total_cost = 0;             // sum of unit costs
  int64_t total_bytes = 0;           // sum of unit bytes (= P_M)
  // A lower bound on the makespan of ANY assignment, >= lower_bound: the pigeonhole bound
  // (among the k*S+1 costliest units some slot holds k+1 of them, so makespan >= the sum of the
  // k+1 cheapest of those, for every k >= 1). When granularity_bound > lower_bound, no plan can
  // reach imbalance() == 1; granularity_imbalance() = makespan / granularity_bound says how far
  // this plan is from that floor. It ignores the layer constraints (a bound, not the optimum).
  double granularity_bound = 0;
  std::vector<double> column_cost;   // per shard column s (sum over replicates), G entries
  std::vector<int64_t> column_bytes; // per shard column s, G entries
  double granularity_imbalance() const {
    return granularity_bound > 0 ? makespan / granularity_bound : 1.0;
  }
  // Index of each parameter's allocation unit in `units`, per input parameter.
  std::vector<int> unit_of_param;

  // Packing (see plan_owners). per_matrix_makespan: the makespan of the plan with every parameter
  // its own unit, which this plan's makespan never exceeds by more than 1%; 0 when it was not
  // computed because this plan is within 1% of lower_bound (so within 1% of every plan). pack_cap:
  // the cost cap on a packed unit in this plan; 0 = no packing (pack_small_params off, or packing
  // would have cost more than 1%), +infinity = uncapped (one unit per group's small parameters).
  // packed_units: units holding more than one parameter.
  double per_matrix_makespan = 0;
  double pack_cap = 0;
  int packed_units = 0;
  double largest_param_cost = 0;     // the largest single parameter's cost

  // ---- tensor parallelism (plan_owners_tp; T = 1 otherwise) ----
  // Slot grid G x R x T: the DP slot (shard, replicate) above and a TP owner t that runs Newton-Schulz
  // on the full matrix. tp_slot_cost is indexed slot_index * T + t and holds the full-matrix costs.
  int tp_size = 1;
  std::vector<int> tp_owners;        // per input parameter, in [0, T)
  std::vector<double> tp_slot_cost;  // G*R*T entries
  double tp_makespan = 0;            // max over tp_slot_cost
  double tp_lower_bound = 0;         // max(total full cost / (G*R*T), largest full cost)
  double tp_imbalance() const { return tp_lower_bound > 0 ? tp_makespan / tp_lower_bound : 1.0; }
};

// The assignment group of a parameter: its group_key, else layer_key_of(name), else its own name.
std::string assignment_group_of(const ParamSpec& p);

// The default hook boundary of a parameter name: layer_key_of(name), else the name itself.
std::string default_boundary_of(const std::string& param_name);

// 16 lower-case hex digits, e.g. "00ff12ab34cd56ef" (how tools print OwnerPlan::fingerprint).
std::string format_fingerprint(uint64_t fingerprint);

// Plan owners for `params` on a G x R slot grid. Throws std::invalid_argument for G or R < 1, an
// empty or non-positive shape, or a bad option (message names the parameter/value); also for an
// empty or repeated parameter name, elem_bytes < 1, or G*R above 2^24 slots. An empty `params`
// gives a plan with G*R empty slots.
OwnerPlan plan_owners(const std::vector<ParamSpec>& params, int shard_size, int replicate_size,
                      const PlanOptions& opts = {});

// Plan owners on a G x R x T grid (tensor parallelism). `params` carry their full logical shapes and
// tp_split_dim. The DP plan (owners, units, slots, makespan, ...) is plan_owners of the TP-local
// shapes (split dimension / T: what each TP rank's DP route holds, reduces and broadcasts); then,
// per DP slot, its parameters go to TP owners by LPT on the full-matrix cost (decreasing cost, ties
// by parameter index; each to the least loaded t, ties lower t). With T = 1 the result equals
// plan_owners (fingerprint included). Throws std::invalid_argument for T < 1, a split dimension out
// of range, or one not divisible by T (naming the parameter).
OwnerPlan plan_owners_tp(const std::vector<ParamSpec>& params, int shard_size, int replicate_size, int tp_size,
                         const PlanOptions& opts = {});

// ---- communication plan (what summarize_comm_plan reports) --------------------------------
// Byte convention (the one comm/ measures): a broadcast or reduce of S bytes costs S for every
// participating rank except the root; an all-reduce of S bytes costs 2(N-1)/N*S per rank.
struct RootPayload {
  OwnerCoord root;
  int64_t bytes = 0;
  std::vector<int> params;
};
struct BoundaryComm {
  std::string boundary;              // hook boundary (layer key by default)
  std::vector<RootPayload> roots;    // one entry per distinct owner used in this boundary
  int64_t payload_bytes = 0;         // sum over roots
  // Per step, over the shard group: forward broadcasts (Z2 and Z3), backward broadcasts (Z3 only),
  // backward reduces (both modes).
  int64_t fwd_broadcast_bytes = 0;
  int64_t bwd_broadcast_bytes_z3 = 0;
  int64_t bwd_reduce_bytes = 0;
};
// Muon::step's verdict on non-finite gradients (and its agreement of the groups' values): one all-gather of a
// row of four int64 per rank -- refused, entries, their digest, the call (comm/agreement.h) -- read on the host.
inline constexpr int64_t kStepVerdictRowBytes = 4 * 8;

struct CommPlan {
  std::vector<BoundaryComm> boundaries;     // in model order of first appearance
  int64_t muon_bytes = 0;                   // P_M
  int shard_size = 1, replicate_size = 1;
  // Per rank and step, indexed by slot index (replicate * G + shard), G*R entries. Shard axis: in
  // every replicate group the shard-local owner (shard s) is the root of the param's broadcasts and
  // reduces. Replicate axis (HSDP, zero when R = 1): stage-2 reduce to the global owner and the
  // post-step publish from it, over the replicate group of the owner's shard.
  std::vector<int64_t> per_rank_bytes_z2;
  std::vector<int64_t> per_rank_bytes_z3;
  std::vector<int64_t> per_rank_replicate_bytes;
  double formula_z2 = 0;                    // 2(N-1)/N * P_M
  double formula_z3 = 0;                    // 3(N-1)/N * P_M
  double mean_z2() const;
  double mean_z3() const;

  // ---- additions ----
  // The replicate-axis figure every rank would see with balanced owners: 2(R-1)/(G*R) * P_M
  // (equal to FSDP/HSDP's all-reduce of 1/G gradient shards over R replicas). 0 when R = 1.
  double formula_replicate = 0;
  double mean_replicate() const;
  int64_t max_z2() const;
  int64_t max_z3() const;
  int64_t max_replicate() const;
};
// boundary_of_param: per input parameter, its hook boundary ("" = the layer key / own name).
// Per boundary: roots in order of first appearance (model order), each with the bytes and the
// parameter indices it publishes; fwd_broadcast_bytes = bwd_reduce_bytes = (G-1) * payload_bytes
// and bwd_broadcast_bytes_z3 = (G-1) * payload_bytes (the sum over the G ranks of one shard
// group). Per rank (shard s, replicate r): Z2 = 2 * (bytes of params whose owner shard != s),
// Z3 = 3 * the same; so mean_z2() == formula_z2 and mean_z3() == formula_z3 exactly (N = G), and
// only the spread between ranks depends on the plan. per_rank_replicate_bytes[(s, r)] =
// 2 * (bytes of params owned in column s by a replicate != r) (stage-2 reduce + publish).
// Throws std::invalid_argument when params/plan/boundary sizes disagree.
CommPlan plan_comm(const std::vector<ParamSpec>& params, const OwnerPlan& plan,
                   const std::vector<std::string>& boundary_of_param = {});

// The TP Newton-Schulz exchange of one step in the gather form (MuonOptions::tp_distributed_gram
// off), per rank of the G x R x T grid (index (replicate * G + shard) * T + tp = the global rank):
// each TP rank other than a matrix's TP owner, at the matrix's DP slot, sends its slice in the gather
// and receives it in the scatter (2 * slice elements) when the matrix is split, and receives the
// broadcast update (the whole matrix) when it is not. `params` have the TP-local shapes (what
// plan_owners_tp planned); `elem_bytes[i]` is parameter i's optimizer-dtype element size (the
// momentum-update input and the update travel in it), one value for all when of size 1. Zeros
// when plan.tp_size == 1.
std::vector<int64_t> plan_tp_exchange(const std::vector<ParamSpec>& params, const OwnerPlan& plan,
                                      const std::vector<int64_t>& elem_bytes = {4});

}  // namespace dmuon
