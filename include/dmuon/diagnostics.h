// diagnostics.h -- JSON summaries of how a dedicated model is routed and communicates.
// These read local state only: no collective, so they are safe in logging code on any rank.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#include "dmuon/communicator.h"
#include "dmuon/muon.h"
#include "dmuon/owner_plan.h"
#include "dmuon/unshard_profile.h"

namespace dmuon {

// How Muon routed this rank's trainable parameters: per lowered group its kind (muon | adamw),
// hyperparameters, parameter count and elements; per dedicated matrix its owner, boundary and
// whether this rank owns it (up to max_rows rows); totals. Counts are local facts unless the key
// says "all".
nlohmann::json summarize_param_groups(const torch::nn::Module& model, const Muon& optimizer, int max_rows = 128);
// The same for a model given as data (model_view.h): runtime_face(dedicate_model_view(...)).
nlohmann::json summarize_param_groups(const std::shared_ptr<RuntimeFace>& runtime, const Muon& optimizer,
                                      int max_rows = 128);

// The planned communication of a dedicated model (planned sizes, not measurements).
struct ModelCommPlan {
  int rank = 0;                        // this rank (global)
  int slot = 0;                        // its DP slot, replicate * G + shard (the index of comm's per-rank tables)
  int shard_size = 1, replicate_size = 1, tp_size = 1, world_size = 1;
  std::string policy;                  // process-group policy of the mesh
  bool z3 = true;                      // reshard_after_forward (and not the DDP path)
  OwnerPlan plan;                      // owners, makespan, imbalance(), fingerprint
  CommPlan comm;                       // per boundary and per rank (index = global rank) bytes, formulas
  std::vector<std::string> params;     // dedicated parameters in plan order (indices in comm's roots)
  // tensor parallelism: the TP Newton-Schulz exchange per step in the gather form, per global rank
  // (plan_tp_exchange with each matrix's optimizer dtype; empty without a TP axis)
  std::vector<int64_t> tp_exchange;
  int64_t tp_bytes() const;            // this rank's entry
  // The rest of one training step's collectives on this rank, per route, group and operation, as the
  // byte counters count them: sharded_adamw's all-gathers, reduce-scatters (Gloo: all-reduces) and
  // replicate all-reduces, the replicated route's bucket all-reduces, and the dedicated units in
  // muon_forward_unshard="all_gather" mode (all-gathers, reduces, post-step scatters and the HSDP shard
  // publish; `comm` and `tp_exchange` cover broadcast mode). One step: forward, backward, step.
  std::vector<PlannedTraffic> step_traffic;
  int64_t step_traffic_bytes() const;  // their sum
  // this rank's planned shard-axis bytes per step (Z3 or Z2 as configured) and replicate-axis bytes
  int64_t shard_bytes() const;
  int64_t replicate_bytes() const;
  // the per-rank formula for this layout: 3(N-1)/N*P_M (Z3) or 2(N-1)/N*P_M (Z2), + 2(R-1)/(G*R)*P_M
  double formula() const;
};
ModelCommPlan get_comm_plan(const torch::nn::Module& model);
ModelCommPlan get_comm_plan(const std::shared_ptr<RuntimeFace>& runtime);  // a model given as data

// get_comm_plan as JSON: mesh {shard, replicate, world, policy}, mode, fingerprint, owner_strategy,
// owner_cost_model, makespan, lower_bound, imbalance, violations, params (names), this_rank {rank, z2,
// z3, replicate, tp, step_traffic (the sum of step_traffic's bytes)}, step_traffic [{route, group, op,
// bytes, calls}], tp {tp_size, imbalance, exchange (per global rank)} on a TP mesh, and `comm` in the schema of `dmuon plan --json` (docs/PLAN_TOOL.md).
nlohmann::json summarize_comm_plan(const torch::nn::Module& model, int max_groups = 64, int max_params_per_group = 128);
nlohmann::json summarize_comm_plan(const std::shared_ptr<RuntimeFace>& runtime, int max_groups = 64,
                                   int max_params_per_group = 128);

// JSON forms of the profiles: a step profile (Muon::consume_last_step_profile) with its phases in
// milliseconds and its clock; a forward-unshard profile with per-boundary rows and totals.
nlohmann::json to_json(const StepProfile& p);
nlohmann::json to_json(const ForwardUnshardProfile& p);

}  // namespace dmuon
