// Internal: the cross-rank plan check of dedicate_params. Ranks that planned differently would
// issue different collectives and hang; instead every rank exchanges a fingerprint of its plan and
// mixed-precision policy, and a mismatch is an error naming the first differing parameter.
#pragma once

#include <cstdint>
#include <exception>
#include <vector>

#include "dmuon/dedicate.h"
#include "dmuon/mesh.h"
#include "dmuon/owner_plan.h"
#include "runtime/precision.h"

namespace dmuon {

// collective: all-gathers over the world (a second one only to diagnose a mismatch).
// `precisions[i]` and `unshard[i]` (its muon_forward_unshard mode) belong to specs[i]; `base_digest` covers
// everything else that must agree; of `options`, the planner's and those that shape the collectives
// (reshard_after_forward, muon_forward_unshard, replicate_broadcast_bucket_mb, delay_stage2_to_optimizer), and
// `isolated_pg_barrier` (DMUON_ISOLATED_PG_BARRIER as this rank read it: a post-step barrier on its groups).
// `failure`: this rank's setup failed before the check (the rest is then ignored); every rank
// learns which ranks failed, the failing ones rethrow their own error.
void check_plan_agreement(Mesh& mesh, const OwnerPlan& plan, const std::vector<ParamSpec>& specs,
                          const std::vector<Precision>& precisions, const std::vector<int>& unshard,
                          uint64_t base_digest, const DedicateOptions& options, bool isolated_pg_barrier,
                          const std::exception_ptr& failure = nullptr);

}  // namespace dmuon
