// The cross-rank plan check (see fingerprint.h): an agreement (comm/agreement.h) on the plan.
#include "runtime/fingerprint.h"

#include <c10/util/Exception.h>

#include <iomanip>
#include <sstream>

#include "comm/agreement.h"
#include "dmuon/digest.h"

namespace dmuon {

namespace {

// FNV-1a 64 of what must agree per parameter, independent of the planner's options
uint64_t spec_digest(const ParamSpec& s, const Precision& prec, int unshard) {
  Fnv1a h;
  h.i64(unshard);
  h.str(s.name).i64(static_cast<int64_t>(s.shape.size()));
  for (int64_t v : s.shape) h.i64(v);
  h.i64(s.elem_bytes).str(s.group_key).str(s.route).i64(s.tp_split_dim).u64(precision_digest(prec));
  return h.value();
}

constexpr const char* kSame =
    ". Every rank must build the same model and pass the same options before dedicate_params.";

}  // namespace

void check_plan_agreement(Mesh& mesh, const OwnerPlan& plan, const std::vector<ParamSpec>& specs,
                          const std::vector<Precision>& precisions, const std::vector<int>& unshard,
                          uint64_t base_digest, const DedicateOptions& options, bool isolated_pg_barrier,
                          const std::exception_ptr& failure) {
  const PlanOptions& po = options.plan;
  // the options that shape the collectives, each an entry (its value shown where it differs)
  std::ostringstream bucket;
  bucket << std::setprecision(17) << options.replicate_broadcast_bucket_mb;
  const std::vector<std::pair<std::string, std::string>> shaping = {
      {"reshard_after_forward", options.reshard_after_forward ? "true" : "false"},
      {"muon_forward_unshard", options.muon_forward_unshard},
      {"replicate_broadcast_bucket_mb", bucket.str()},
      {"delay_stage2_to_optimizer", options.delay_stage2_to_optimizer ? "true" : "false"},
      // (as the runtime read it: it keeps that value)
      {"DMUON_ISOLATED_PG_BARRIER", isolated_pg_barrier ? "1" : "0"}};
  using detail::AgreedEntry;
  detail::AgreementText text;
  text.fn = "dedicate_params";
  text.refused = [](const std::vector<int>& ranks, const std::string& reason) {
    return "setup failed on rank(s) " + detail::rank_list(ranks) +
           " before the ranks compared their owner plans (this rank's setup succeeded; " + reason + ")" + kSame;
  };
  // the entries: the options that shape the collectives, the resolved planner options (the fingerprint of a plan
  // of no parameters), one per dedicated parameter (its spec), and last what they leave out (the plan itself,
  // the boundaries, every precision)
  const int64_t first_param = static_cast<int64_t>(shaping.size()) + 1;
  text.differs = [&](const detail::Disagreement& d) {
    std::ostringstream o;
    const std::string first = std::to_string(mesh.world().global_ranks().front());
    const std::string others = (d.ranks.size() == 1 ? "rank " : "ranks ") + detail::rank_list(d.ranks);
    o << "the owner plan differs between ranks: ";
    const std::string key = d.entry ? d.entry->key : "";
    if (!d.entry)
      o << "ranks select different numbers of dedicated parameters (rank " << first << " " << d.count0 - first_param - 1
        << ", " << others << " " << d.count - first_param - 1 << ")";
    else if (key == "parameter")
      o << "parameter #" << d.index - first_param << " (" << d.entry->shown << ") differs between rank " << first
        << " and " << others
        << " (its shape, name, assignment group, tensor-parallel split, muon_forward_unshard or mixed-precision "
           "policy)";
    else if (key == "planner options")
      o << "the planner options differ between rank " << first << " and " << others
        << " (PlanOptions or the DMUON_OWNER_* environment: strategy, cost model, "
        << "packing; with owner_cost_model \"profiled\", the NS profile: PlanOptions::ns_profile / DMUON_NS_PROFILE "
        << "must hold the same measurements on every rank)";
    else if (key == "plan")
      o << "the mixed-precision policy (dtypes of the non-dedicated parameters, the boundaries' "
           "cast_forward_inputs/output_dtype), the boundaries, the deferred parameters or their param_source (its "
           "seed, its file's tensors) differ between ranks";
    else if (key.rfind("DMUON_", 0) == 0)
      o << "the environment variable " << key << " differs between rank " << first << " and " << others
        << " (this rank's: " << key << "=" << d.entry->shown << "; a setting that decides which collectives run: the ranks would wait in different ones; "
           "set it alike on every rank, e.g. in the launcher's environment)";
    else
      o << "dedicate_params was given " << key << " = " << d.entry->shown << " here and another value on " << others
        << " (an option that decides which collectives run: the ranks would wait in different ones)";
    return o.str() + kSame;
  };
  detail::agree(
      mesh.world(), text,
      [&] {
        if (failure) std::rethrow_exception(failure);
      },
      [&] {
        std::vector<AgreedEntry> out;
        for (const auto& [name, value] : shaping) out.push_back({name, fnv1a(value), value});
        out.push_back({"planner options", plan_owners({}, 1, 1, po).fingerprint, ""});
        for (size_t i = 0; i < specs.size(); ++i) {
          std::ostringstream shown;
          shown << "'" << specs[i].name << "' on this rank, shape " << at::IntArrayRef(specs[i].shape);
          out.push_back({"parameter", spec_digest(specs[i], precisions[i], unshard[i]), shown.str()});
        }
        Fnv1a rest(plan.fingerprint ^ base_digest);
        for (const auto& pr : precisions) rest.u64(precision_digest(pr));
        out.push_back({"plan", rest.value(), ""});
        return out;
      });
}

}  // namespace dmuon
