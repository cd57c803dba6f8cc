// The agreement before a state dict loads (see load_agreement.h).
#include "io/load_agreement.h"

#include <c10/util/Exception.h>

#include "comm/agreement.h"
#include "dmuon/checkpoint.h"
#include "dmuon/digest.h"

namespace dmuon::io {

uint64_t tensor_digest(const at::Tensor& t) {
  if (!t.defined()) return fnv1a("undefined");
  Fnv1a h;
  h.u64(static_cast<uint64_t>(t.scalar_type())).u64(static_cast<uint64_t>(t.layout()));
  h.u64(static_cast<uint64_t>(t.dim()));
  for (int64_t s : t.sizes()) h.u64(static_cast<uint64_t>(s));
  if (t.layout() != at::kStrided || t.is_quantized() || t.device().is_meta() || t.numel() == 0) return h.value();
  const at::Tensor c = t.detach().to(at::kCPU).contiguous();  // (CUDA: one host copy, then the bytes)
  return h.u64(static_cast<uint64_t>(checkpoint_crc32c(c.data_ptr(), c.nbytes()))).value();
}

void agree_load(Mesh& mesh, const std::string& fn, const std::function<void()>& check,
                const std::function<std::vector<LoadEntry>()>& summary) {
  detail::AgreementText text;
  text.fn = fn;
  text.given = "the state dict";
  text.outcome = "no rank loads anything";
  text.differs = [&](const detail::Disagreement& d) {
    const std::string fix =
        "; nothing was loaded. Pass the same full state dict on every rank (each reads the same "
        "checkpoint file, or get_*_state_dict with rank0_only = false).";
    const std::string first = std::to_string(mesh.world().global_ranks().front());
    if (!d.entry)
      return "the ranks were given different state dicts (" + std::to_string(d.count0) + " entries on rank " + first +
             ", " + std::to_string(d.count) + " on rank " + std::to_string(d.ranks.front()) +
             "), so each would load its own and the replicas would drift apart" + fix;
    return "the ranks were given different state dicts (" + d.entry->key + " differs between rank " + first +
           " and rank " + std::to_string(d.ranks.front()) +
           "), so each would load its own and the replicas would "
           "drift apart" +
           fix;
  };
  detail::agree(mesh.world(), text, check, [&] {
    std::vector<detail::AgreedEntry> out;
    for (auto& [key, digest] : summary()) out.push_back({std::move(key), digest, ""});
    return out;
  });
}

}  // namespace dmuon::io
