// An agreement across ranks (see agreement.h).
#include "comm/agreement.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <stdexcept>

#include "dmuon/digest.h"
#include "dmuon/host_sync.h"

namespace dmuon::detail {

namespace {
constexpr int64_t kMessageBytes = 4096;  // of a refusing rank's error, sent to the others

// The first bytes of `s` that fit `cap`, cut before a UTF-8 character that would not fit whole (a text cut inside
// one is not UTF-8: Python could not decode the error).
size_t utf8_prefix(const std::string& s, size_t cap) {
  if (s.size() <= cap) return s.size();
  size_t n = cap;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // s[n]: the first byte left out
  return n;
}

uint64_t entry_digest(const AgreedEntry& e) { return Fnv1a().str(e.key).u64(e.digest).value(); }
}  // namespace

void agree(Communicator& world, const AgreementText& text, const std::function<void()>& check,
           const std::function<std::vector<AgreedEntry>()>& summary) {
  std::exception_ptr error;
  std::string reason;
  int64_t refusal = 0;  // 0 none, 1 a caller mistake, 2 anything else
  std::vector<AgreedEntry> entries;
  try {
    check();
    entries = summary();
  } catch (const std::exception& e) {  // reported to the other ranks first: none may leave before the gather
    error = std::current_exception();
    reason = error_text(e);
    refusal = is_caller_mistake(e) ? 1 : 2;
  } catch (...) {
    refusal = 2;
    error = std::current_exception();
    reason = "an exception that is not a std::exception";
  }
  if (world.local_only()) {
    if (error) std::rethrow_exception(error);
    return;
  }
  const int n = world.size(), me = world.global_rank();
  const std::vector<int>& ranks = world.global_ranks();
  Fnv1a all;
  for (const AgreedEntry& e : entries) all.u64(entry_digest(e));
  // one row per rank: [refused, entries, digest of them all, the call]
  constexpr int kRow = kAgreementRowWords;
  at::Tensor mine = at::empty({kRow}, at::kLong);
  int64_t* m4 = mine.data_ptr<int64_t>();
  m4[0] = error ? refusal : 0;
  m4[1] = static_cast<int64_t>(entries.size());
  m4[2] = static_cast<int64_t>(all.value());
  m4[3] = static_cast<int64_t>(Fnv1a().str(text.fn).value());
  at::Tensor rows = at::empty({kRow * n}, world.options(at::kLong));
  world.allgather_flat(rows, mine.to(world.device()), text.fn + ": agreement across ranks").wait_host();
  const at::Tensor host = read_to_host(rows);
  const int64_t* row = host.data_ptr<int64_t>();

  // ranks in another call's agreement (one skipped or added a collective call): said on every rank, each naming
  // its own call, before anything of the rows is read as this call's
  std::vector<int> elsewhere;
  for (int r = 0; r < n; ++r)
    if (row[kRow * r + 3] != m4[3]) elsewhere.push_back(ranks[static_cast<size_t>(r)]);
  TORCH_CHECK_VALUE(elsewhere.empty(), "rank ", me, ": ", text.fn, ": rank(s) ", rank_list(elsewhere),
                    " made another collective call of dmuon at this point (not ", text.fn, "): every rank of the "
                    "model's mesh makes dmuon's collective calls (the optimizer's step and clipping, the state-dict "
                    "and checkpoint functions, ...) in the same order. One rank skipped a call or made an extra one "
                    "(e.g. under `if rank == 0`, or after catching an error the others did not get); each rank's "
                    "error names the call it was in.", error ? " This rank's own call had failed: " + reason : "");

  std::vector<int> refused;
  bool mistakes_only = true;  // every refusal was a caller mistake: the others raise one too
  for (int r = 0; r < n; ++r)
    if (row[kRow * r] != 0) {
      refused.push_back(r);
      mistakes_only = mistakes_only && row[kRow * r] == 1;
    }
  if (!refused.empty()) {  // every rank learns the first refusal's reason
    at::Tensor msg = at::zeros({kMessageBytes}, at::kByte);
    std::memcpy(msg.data_ptr(), reason.data(), utf8_prefix(reason, kMessageBytes - 1));
    at::Tensor msgs = at::empty({kMessageBytes * n}, world.options(at::kByte));
    world.allgather_flat(msgs, msg.to(world.device()), text.fn + ": the refusing ranks' errors").wait_host();
    if (error) std::rethrow_exception(error);
    const at::Tensor all_text = read_to_host(msgs);
    const char* first = reinterpret_cast<const char*>(all_text.data_ptr()) + kMessageBytes * refused.front();
    std::vector<int> global;
    for (int r : refused) global.push_back(ranks[static_cast<size_t>(r)]);
    std::string said(first, strnlen(first, kMessageBytes));
    const std::string who = "rank " + std::to_string(global.front()) + ": ";
    if (said.rfind(who, 0) == 0) said.erase(0, who.size());  // (its error names its rank already)
    said = who + said;
    const std::string what = text.refused ? text.refused(global, said)
                                          : "rank(s) " + rank_list(global) + " refused " + text.given +
                                                " they were given, so " + text.outcome + " (" + said + ")";
    if (mistakes_only) TORCH_CHECK_VALUE(false, "rank ", me, ": ", text.fn, ": ", what);
    TORCH_CHECK(false, "rank ", me, ": ", text.fn, ": ", what);
  }

  const auto differs = [&text, &ranks](const Disagreement& d) {
    if (text.differs) return text.differs(d);
    return "the ranks were given different inputs: rank(s) " + rank_list(d.ranks) + " differ from rank " +
           std::to_string(ranks.front()) + " in " +
           (d.entry ? "'" + d.entry->key + "'" : "the number of entries (" + std::to_string(d.count0) + " vs " +
                                                   std::to_string(d.count) + ")") + ".";
  };
  Disagreement d;
  d.count0 = row[1];
  for (int r = n - 1; r >= 1; --r)
    if (row[kRow * r + 1] != row[1]) {
      d.ranks.insert(d.ranks.begin(), ranks[static_cast<size_t>(r)]);
      d.count = row[kRow * r + 1];
    }
  // different numbers of entries: nothing to compare one by one
  if (!d.ranks.empty()) TORCH_CHECK_VALUE(false, "rank ", me, ": ", text.fn, ": ", differs(d));
  bool same = true;
  for (int r = 1; r < n; ++r) same = same && row[kRow * r + 2] == row[2];
  if (same) return;
  // as many entries everywhere: find the first that differs and the ranks it differs on
  const int64_t m = row[1];
  at::Tensor digests = at::empty({m}, at::kLong);
  int64_t* dm = digests.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) dm[i] = static_cast<int64_t>(entry_digest(entries[static_cast<size_t>(i)]));
  at::Tensor every = at::empty({m * n}, world.options(at::kLong));
  world.allgather_flat(every, digests.to(world.device()), text.fn + ": the entries of every rank").wait_host();
  const at::Tensor eh = read_to_host(every);
  const int64_t* e = eh.data_ptr<int64_t>();
  for (int64_t i = 0; i < m && !d.entry; ++i)
    for (int r = 1; r < n; ++r)
      if (e[r * m + i] != e[i]) {
        d.entry = &entries[static_cast<size_t>(i)];
        d.index = i;
        d.ranks.push_back(ranks[static_cast<size_t>(r)]);
      }
  if (d.entry) TORCH_CHECK_VALUE(false, "rank ", me, ": ", text.fn, ": ", differs(d));
  // (the totals differ but no entry does: cannot happen with one digest per entry; said, never silent)
  TORCH_CHECK_VALUE(false, "rank ", me, ": ", text.fn, ": the ranks' summaries differ from rank ", ranks.front(),
                    "'s, but no entry does (a dmuon bug: please report it).");
}

}  // namespace dmuon::detail

namespace dmuon {

void agree_outcome(Communicator& comm, const std::string& what, bool here, const std::function<void()>& work) {
  detail::AgreementText text;
  text.fn = what;
  text.refused = [](const std::vector<int>& ranks, const std::string& reason) {
    return "failed on rank(s) " + detail::rank_list(ranks) + ": " + reason;
  };
  std::string own;  // the work's error here (it stands even where the agreement itself then fails)
  bool mistake = false;
  try {
    detail::agree(comm, text, [&] {
      if (!here) return;
      try {
        work();
      } catch (const std::exception& e) {
        own = detail::error_text(e);
        mistake = detail::is_caller_mistake(e);
        throw;
      } catch (...) {
        own = "an exception that is not a std::exception";
        throw;
      }
    }, [] { return std::vector<detail::AgreedEntry>{}; });
  } catch (...) {
    if (own.empty()) throw;
    const std::string m = "rank " + std::to_string(comm.global_rank()) + ": " + what + " failed: " + own;
    if (mistake) throw std::invalid_argument(m);
    throw std::runtime_error(m);
  }
}

void agree_call(Communicator& comm, const std::string& what, const std::string& given, const std::string& outcome,
                const std::optional<std::pair<bool, std::string>>& refusal) {
  detail::AgreementText text;
  text.fn = what;
  text.given = given;
  text.outcome = outcome;
  detail::agree(comm, text, [&] {
    if (!refusal) return;
    if (refusal->first) throw std::invalid_argument(refusal->second);
    throw std::runtime_error(refusal->second);
  }, [] { return std::vector<detail::AgreedEntry>{}; });
}

}  // namespace dmuon
