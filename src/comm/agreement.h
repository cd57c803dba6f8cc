// Internal: an agreement across ranks -- the one mechanism behind every "the ranks must have been given the
// same" check: a state dict before it loads (io), Muon's options before it is built (optim).
//
// Two things go wrong silently or late when the ranks are left to themselves: an input one rank refuses
// (its error leaves the others alone in the next collective until the timeout), and inputs that differ
// between ranks (each replica trains or loads its own and they drift apart, never to be noticed; or they
// issue other collectives: a hang). agree() runs this rank's check, then one small all-gather over the
// world: a refusal anywhere raises on every rank with the first refusing rank's reason; a summary that
// differs from the group's first rank's raises on every rank, naming the first entry that differs. The
// exchange also carries the call (text.fn): ranks in different calls' agreements (one skipped or added a
// collective call) raise on every rank, each naming its own call, instead of reading another call's rows as
// this one's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/error_text.h"
#include "dmuon/communicator.h"

namespace dmuon::detail {

// One entry of what must agree: its name in messages, a digest of its value (dmuon/digest.h), and the value
// as text where the message should show it ("" where it should not: a tensor's bytes).
struct AgreedEntry {
  std::string key;
  uint64_t digest = 0;
  std::string shown;
};

// Where the ranks' summaries differ, for the caller's message: `entry` is the first entry that differs (null
// when the ranks hold different numbers of entries), `ranks` the global ranks whose entry (or count) differs
// from the group's first rank's; `count0` that rank's number of entries, `count` the first differing rank's.
struct Disagreement {
  const AgreedEntry* entry = nullptr;
  int64_t index = -1;  // entry's position in the summary
  std::vector<int> ranks;
  int64_t count0 = 0, count = 0;
};

struct AgreementText {
  std::string fn;       // the call, first in every message and in the collectives' names: "set_model_state_dict"
  std::string given;    // what a rank refused: "the state dict" -> "rank(s) 1 refused the state dict they were given"
  std::string outcome;  // after a refusal: "no rank loads anything"
  // the whole error for a refusal on other ranks (after "rank R: fn: "), from the refusing global ranks and the
  // first one's reason ("rank 1: ..."); empty: "rank(s) 1 refused <given> they were given, so <outcome> (reason)"
  std::function<std::string(const std::vector<int>& ranks, const std::string& reason)> refused;
  // the whole error for a disagreement (after "rank R: fn: "); empty: the differing ranks and entry's key
  std::function<std::string(const Disagreement&)> differs;
};

// The int64 words of a rank's row in the agreement's all-gather (refused, entries, digest, call): Muon::step's
// verdict is one, which the planners count (kStepVerdictRowBytes, owner_plan.h).
inline constexpr int kAgreementRowWords = 4;

// collective over `world`, every rank, whatever `check` throws: `check` validates this rank's input
// (throwing what the caller reports), `summary` lists what must agree (called only when `check` passed).
// Throws on every rank when any rank's check threw (this rank's own exception where it is this rank's; elsewhere
// one naming the first refusing rank and its reason, a ValueError where every refusal was a caller mistake, else
// a RuntimeError) or when the summaries differ from the group's first rank's (a ValueError with
// text.differs). A world of one exchanges nothing (check still runs).

void agree(Communicator& world, const AgreementText& text, const std::function<void()>& check,
           const std::function<std::vector<AgreedEntry>()>& summary);

}  // namespace dmuon::detail
