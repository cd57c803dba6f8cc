// diagnostics.h -- JSON summaries of how a dedicated model is routed and communicates.
// These read local state only: no collective, so they are safe in logging code on any rank.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "dmuon/muon.h"

namespace dmuon {

// How Muon routed this rank's trainable parameters: per lowered group its kind (muon | adamw),
// hyperparameters, parameter count and elements; per dedicated matrix its owner, boundary and
// whether this rank owns it (up to max_rows rows); totals. Counts are local facts unless the key
// says "all".
nlohmann::json summarize_param_groups(const torch::nn::Module& model, const Muon& optimizer, int max_rows = 128);

// The planned communication of a dedicated model: mesh shape, policy, plan fingerprint and
// imbalance, per boundary the roots (global ranks) with their payload bytes and the per-step
// forward/backward broadcast and reduce bytes in Z2 and Z3, and per-rank totals next to the
// formulas 2(N-1)/N*P_M (Z2) and 3(N-1)/N*P_M (Z3). Planned sizes, not measurements.
nlohmann::json summarize_comm_plan(const torch::nn::Module& model, int max_groups = 64, int max_params_per_group = 128);

}  // namespace dmuon
