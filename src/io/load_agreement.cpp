// The agreement before a state dict loads (see load_agreement.h).
#include "io/load_agreement.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <exception>

#include "comm/error_text.h"
#include "dmuon/checkpoint.h"

namespace dmuon::io {

namespace {
constexpr uint64_t kFnvOffset = 1469598103934665603ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;
constexpr int64_t kMessageBytes = 1024;  // of a refusing rank's error, sent to the others

uint64_t mix_bytes(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

std::string list_ranks(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}
}  // namespace

uint64_t mix_digest(uint64_t h, uint64_t v) { return mix_bytes(h, &v, sizeof(v)); }
uint64_t mix_digest(uint64_t h, const std::string& s) {
  return mix_bytes(mix_digest(h, static_cast<uint64_t>(s.size())), s.data(), s.size());
}

uint64_t tensor_digest(const at::Tensor& t) {
  uint64_t h = kFnvOffset;
  if (!t.defined()) return mix_digest(h, std::string("undefined"));
  h = mix_digest(h, static_cast<uint64_t>(t.scalar_type()));
  h = mix_digest(h, static_cast<uint64_t>(t.layout()));
  h = mix_digest(h, static_cast<uint64_t>(t.dim()));
  for (int64_t s : t.sizes()) h = mix_digest(h, static_cast<uint64_t>(s));
  if (t.layout() != at::kStrided || t.is_quantized() || t.device().is_meta() || t.numel() == 0) return h;
  const at::Tensor c = t.detach().to(at::kCPU).contiguous();  // (CUDA: one host copy, then the bytes)
  return mix_digest(h, static_cast<uint64_t>(checkpoint_crc32c(c.data_ptr(), c.nbytes())));
}

void agree_load(Mesh& mesh, const std::string& fn, const std::function<void()>& check,
                const std::function<std::vector<LoadEntry>()>& summary) {
  std::exception_ptr error;
  std::string reason;
  std::vector<LoadEntry> entries;
  try {
    check();
    entries = summary();
  } catch (const std::exception& e) {  // reported to the other ranks first: none may leave before the gather
    error = std::current_exception();
    reason = detail::error_text(e);
  } catch (...) {
    error = std::current_exception();
    reason = "an exception that is not a std::exception";
  }
  Communicator& world = mesh.world();
  if (world.local_only()) {
    if (error) std::rethrow_exception(error);
    return;
  }
  const int n = world.size(), me = mesh.global_rank();
  const std::vector<int>& ranks = world.global_ranks();
  uint64_t all = kFnvOffset;
  for (const auto& [key, digest] : entries) all = mix_digest(mix_digest(all, key), digest);
  // one row per rank: [refused, entries, digest of them all]
  at::Tensor mine = at::empty({3}, at::kLong);
  int64_t* m3 = mine.data_ptr<int64_t>();
  m3[0] = error ? 1 : 0;
  m3[1] = static_cast<int64_t>(entries.size());
  m3[2] = static_cast<int64_t>(all);
  at::Tensor rows = at::empty({3 * n}, mesh.options(at::kLong));
  world.allgather_flat(rows, mine.to(mesh.device()), fn + ": agreement on the state dict").wait_host();
  const at::Tensor host = rows.cpu();
  const int64_t* row = host.data_ptr<int64_t>();

  std::vector<int> refused;
  for (int r = 0; r < n; ++r)
    if (row[3 * r] != 0) refused.push_back(r);
  if (!refused.empty()) {  // every rank learns the first refusal's reason
    at::Tensor msg = at::zeros({kMessageBytes}, at::kByte);
    std::memcpy(msg.data_ptr(), reason.data(), std::min<size_t>(reason.size(), kMessageBytes - 1));
    at::Tensor msgs = at::empty({kMessageBytes * n}, mesh.options(at::kByte));
    world.allgather_flat(msgs, msg.to(mesh.device()), fn + ": the refusing ranks' errors").wait_host();
    if (error) std::rethrow_exception(error);
    const at::Tensor text = msgs.cpu();
    const char* first = reinterpret_cast<const char*>(text.data_ptr()) + kMessageBytes * refused.front();
    std::vector<int> global;
    for (int r : refused) global.push_back(ranks[r]);
    TORCH_CHECK_VALUE(false, "rank ", me, ": ", fn, ": rank(s) ", list_ranks(global),
                      " refused the state dict they were given, so no rank loads anything (rank ", global.front(),
                      ": ", std::string(first, strnlen(first, kMessageBytes)), ")");
  }

  int differs = -1;  // the first rank whose dict differs from rank 0's
  for (int r = 1; r < n && differs < 0; ++r)
    if (row[3 * r + 1] != row[1] || row[3 * r + 2] != row[2]) differs = r;
  if (differs < 0) return;
  const char* fix = "; nothing was loaded. Pass the same full state dict on every rank (each reads the same "
                    "checkpoint file, or get_*_state_dict with rank0_only = false).";
  bool same_count = true;
  for (int r = 1; r < n; ++r) same_count = same_count && row[3 * r + 1] == row[1];
  TORCH_CHECK_VALUE(same_count, "rank ", me, ": ", fn, ": the ranks were given different state dicts (", row[1],
                    " entries on rank ", ranks[0], ", ", row[3 * differs + 1], " on rank ", ranks[differs],
                    "), so each would load its own and the replicas would drift apart", fix);
  // as many entries everywhere: find the first that differs and name it
  const int64_t m = row[1];
  at::Tensor digests = at::empty({m}, at::kLong);
  int64_t* dm = digests.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    dm[i] = static_cast<int64_t>(mix_digest(mix_digest(kFnvOffset, entries[i].first), entries[i].second));
  at::Tensor every = at::empty({m * n}, mesh.options(at::kLong));
  world.allgather_flat(every, digests.to(mesh.device()), fn + ": the state dicts' entries").wait_host();
  const at::Tensor eh = every.cpu();
  const int64_t* d = eh.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    for (int r = 1; r < n; ++r)
      TORCH_CHECK_VALUE(d[r * m + i] == d[i], "rank ", me, ": ", fn, ": the ranks were given different state dicts (",
                        entries[i].first, " differs between rank ", ranks[0], " and rank ", ranks[r],
                        "), so each would load its own and the replicas would drift apart", fix);
  TORCH_CHECK_VALUE(false, "rank ", me, ": ", fn, ": the ranks were given different state dicts (rank ", ranks[0],
                    " and rank ", ranks[differs], "), so each would load its own and the replicas would drift apart",
                    fix);
}

}  // namespace dmuon::io
