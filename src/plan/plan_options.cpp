// plan_options.cpp -- resolve PlanOptions: explicit value > environment override > default.
// The environment is read only through dmuon/env.h (src/plan/environment.cpp), dmuon's one place
// for environment variables.
#include <algorithm>
#include <cctype>
#include <stdexcept>
#include <string>
#include <vector>

#include "dmuon/owner_plan.h"
#include "dmuon/env.h"

namespace dmuon {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out;
}

// `what` names the source: the option field or the environment variable.
std::string choice(const std::string& what, const std::string& value,
                   const std::vector<std::string>& allowed) {
  const std::string v = lower(value);
  if (std::find(allowed.begin(), allowed.end(), v) == allowed.end())
    throw std::invalid_argument("Invalid " + what + ": '" + value + "'. Must be one of: " +
                                join(allowed) + ".");
  return v;
}


}  // namespace

ResolvedPlanOptions resolve_plan_options(const PlanOptions& opts) {
  ResolvedPlanOptions r;

  if (opts.owner_strategy) {
    r.owner_strategy = *parse_owner_strategy(choice("owner_strategy", *opts.owner_strategy, owner_strategy_names()));
  } else if (const std::string v = env::owner_strategy(); !v.empty()) {
    r.owner_strategy = *parse_owner_strategy(choice("DMUON_OWNER_STRATEGY", v, owner_strategy_names()));
  }

  if (opts.owner_cost_model) {
    r.cost_model = owner_cost_model(choice("owner_cost_model", *opts.owner_cost_model, owner_cost_model_names()));
  } else if (const std::string v = env::owner_cost_model(); !v.empty()) {
    r.cost_model = owner_cost_model(choice("DMUON_OWNER_COST_MODEL", v, owner_cost_model_names()));
  }

  if (r.cost_model->needs_ns_profile()) {
    if (opts.ns_profile) {
      r.ns_profile = opts.ns_profile;
    } else if (const std::string path = env::ns_profile(); !path.empty()) {
      r.ns_profile = std::make_shared<const NsProfile>(load_ns_profile(path));
    } else {
      throw std::invalid_argument(
          "owner_cost_model 'profiled' needs measured NS times, and none were given: set "
          "PlanOptions::ns_profile (dmuon plan --ns-profile FILE) or DMUON_NS_PROFILE=FILE, after measuring "
          "them on the target device with `dmuon plan --calibrate FILE`");
    }
    validate_ns_profile(*r.ns_profile, "owner_cost_model 'profiled': NS profile '" + r.ns_profile->source + "'");
  }

  if (opts.hsdp_column_balance) {
    r.hsdp_column_balance = *opts.hsdp_column_balance;
  } else if (const std::optional<bool> v = env::hsdp_column_balance()) {
    r.hsdp_column_balance = *v;
  }

  if (opts.pack_small_params) {
    r.pack_small_params = *opts.pack_small_params;
  } else if (const std::optional<bool> v = env::pack_small_params()) {
    r.pack_small_params = *v;
  }

  if (opts.max_owners_per_group && *opts.max_owners_per_group < 1)
    throw std::invalid_argument("Invalid max_owners_per_group: " +
                                std::to_string(*opts.max_owners_per_group) +
                                ". Must be >= 1 (or unset for no cap).");
  r.max_owners_per_group = opts.max_owners_per_group;

  if (opts.pack_threshold_numel < 0)
    throw std::invalid_argument("Invalid pack_threshold_numel: " +
                                std::to_string(opts.pack_threshold_numel) +
                                ". Must be >= 0 (0 packs nothing).");
  r.pack_threshold_numel = opts.pack_threshold_numel;

  if (opts.ns_steps < 1)
    throw std::invalid_argument("Invalid ns_steps: " + std::to_string(opts.ns_steps) +
                                ". Must be >= 1.");
  r.ns_steps = opts.ns_steps;
  return r;
}

}  // namespace dmuon
