// Internal: Muon's options agreed across ranks at construction.
//
// What decides the math or the collectives must be the same on every rank: a learning rate that
// differs trains each replica with its own (they drift apart, never noticed); a different ns backend
// or prefetch setting issues other collectives (a hang until the timeout). The agreement is one small
// all-gather over the world, before any option is validated (so a value one rank refuses is refused
// on every rank, not left to a collective the others wait in).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "dmuon/muon.h"
#include "runtime/runtime_face.h"

namespace dmuon::detail {

// Each option that must agree, as (name, its exact value as text): numbers in hexadecimal floating
// point (0.05 and 0.050001 differ, 1 and 1.0 agree), param groups by name, parameter names and overrides.
std::vector<std::pair<std::string, std::string>> agreed_options(const RuntimeFace& runtime, const MuonOptions& o);

// collective over runtime.mesh().world(): a ValueError on every rank naming the first option whose value
// differs from global rank 0's, this rank's value and the ranks that differ. A world of one: nothing.
void agree_options(const RuntimeFace& runtime, const MuonOptions& o);

}  // namespace dmuon::detail
