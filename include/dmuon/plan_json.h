// plan_json.h -- the one JSON writer for a communication plan (used by `dmuon plan --json` and by
// summarize_comm_plan; schema: docs/PLAN_TOOL.md, the `comm` object).
#pragma once

#include <nlohmann/json.hpp>

#include "dmuon/owner_plan.h"

namespace dmuon {

// muon_bytes, per_rank {z2, z3, replicate: mean, max, formula, bytes}, fsdp_equivalent, and the
// boundaries (payload and per-step bytes, roots with owner, bytes and parameter indices). At most
// `max_boundaries` boundaries and `max_params_per_root` indices per root (-1: all).
nlohmann::json comm_plan_json(const CommPlan& comm, int max_boundaries = -1, int max_params_per_root = -1);

}  // namespace dmuon
