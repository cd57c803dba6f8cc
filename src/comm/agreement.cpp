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
constexpr int64_t kMessageBytes = 1024;  // of a refusing rank's error, sent to the others

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
  // one row per rank: [refused, entries, digest of them all]
  at::Tensor mine = at::empty({3}, at::kLong);
  int64_t* m3 = mine.data_ptr<int64_t>();
  m3[0] = error ? refusal : 0;
  m3[1] = static_cast<int64_t>(entries.size());
  m3[2] = static_cast<int64_t>(all.value());
  at::Tensor rows = at::empty({3 * n}, world.options(at::kLong));
  world.allgather_flat(rows, mine.to(world.device()), text.fn + ": agreement across ranks").wait_host();
  const at::Tensor host = read_to_host(rows);
  const int64_t* row = host.data_ptr<int64_t>();

  std::vector<int> refused;
  bool mistakes_only = true;  // every refusal was a caller mistake: the others raise one too
  for (int r = 0; r < n; ++r)
    if (row[3 * r] != 0) {
      refused.push_back(r);
      mistakes_only = mistakes_only && row[3 * r] == 1;
    }
  if (!refused.empty()) {  // every rank learns the first refusal's reason
    at::Tensor msg = at::zeros({kMessageBytes}, at::kByte);
    std::memcpy(msg.data_ptr(), reason.data(), std::min<size_t>(reason.size(), kMessageBytes - 1));
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

  Disagreement d;
  d.count0 = row[1];
  for (int r = n - 1; r >= 1; --r)
    if (row[3 * r + 1] != row[1]) {
      d.ranks.insert(d.ranks.begin(), ranks[static_cast<size_t>(r)]);
      d.count = row[3 * r + 1];
    }
  // different numbers of entries: nothing to compare one by one
  if (!d.ranks.empty()) TORCH_CHECK_VALUE(false, "rank ", me, ": ", text.fn, ": ", text.differs(d));
  bool same = true;
  for (int r = 1; r < n; ++r) same = same && row[3 * r + 2] == row[2];
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
  if (d.entry) TORCH_CHECK_VALUE(false, "rank ", me, ": ", text.fn, ": ", text.differs(d));
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

}  // namespace dmuon
