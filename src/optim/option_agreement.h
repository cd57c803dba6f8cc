// Internal: Muon's options agreed across ranks at construction.
//
// What decides the math or the collectives must be the same on every rank: a learning rate that
// differs trains each replica with its own (they drift apart, never noticed); a different ns backend
// or prefetch setting issues other collectives (a hang until the timeout). The agreement is comm's
// (comm/agreement.h): this rank's validation, then one small all-gather over the world, so a value one
// rank refuses is refused on every rank with its reason, not left to a collective the others wait in.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "comm/agreement.h"
#include "dmuon/grad_clip.h"
#include "dmuon/muon.h"
#include "runtime/runtime_face.h"

namespace dmuon::detail {

// Each option that must agree, as (name, its exact value as text): numbers in hexadecimal floating
// point (0.05 and 0.050001 differ, 1 and 1.0 agree), param groups by name, parameter names and overrides.
std::vector<std::pair<std::string, std::string>> agreed_options(const RuntimeFace& runtime, const MuonOptions& o);

// collective over runtime.mesh().world(), every rank, whatever `check` (this rank's validation) throws: an
// error on every rank when any rank's check threw (its reason named on the others), and a ValueError on every
// rank naming the first option whose value differs from global rank 0's, this rank's value and the ranks that
// differ. A world of one: `check` only.
void agree_options(const RuntimeFace& runtime, const MuonOptions& o, const std::function<void()>& check);

// What each param group's update uses in a step (lr, momentum, weight decay, Nesterov, NS steps, Adam's betas
// and eps), one entry per group, exact: step()'s verdict agrees them, so a value one rank changed alone (a
// scheduler stepped on a rank's own metric, a write on one rank) is an error on every rank, not replicas that
// drift apart in silence. step_values_differ: the error for a disagreement (after "rank R: Muon::step: ").
std::vector<AgreedEntry> step_group_values(const std::vector<torch::optim::OptimizerParamGroup>& groups);
std::string step_values_differ(const Disagreement& d);

// clip_grad_norm_'s arguments (max_norm, norm_type, scope, strategy, error_if_nonfinite), checked and agreed
// over runtime.mesh().world() before any rank clips (collective, every rank): an argument one rank refuses
// raises on every rank, and so do arguments that differ (each replica would clip by its own) and a rank in
// another collective call (a clip on some ranks only). `refusal` (non-empty): a caller's own check refused this
// rank's arguments for that reason (a ValueError on this rank, naming it everywhere else).
void agree_clip_arguments(const RuntimeFace& runtime, std::optional<double> max_norm, const GradClipOptions& opts,
                          const std::string& refusal = "");

}  // namespace dmuon::detail
