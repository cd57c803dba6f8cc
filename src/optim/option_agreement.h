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

}  // namespace dmuon::detail
