// owner_plan.cpp -- the owner planner's public functions and the search over packing variants
// (the planner itself: planner.h, planner.cpp, planner_refine.cpp).
//
// Determinism: every ordering below has an explicit tie-break on an index, no container is
// iterated in hash order, and the fingerprint hashes a canonical byte serialization with FNV-1a.
// Costs are doubles computed from integers in a fixed order (IEEE-754, no fast-math), so two
// machines compute the same loads and take the same branches.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <tuple>
#include <utility>
#include <vector>

#include "dmuon/owner_plan.h"
#include "planner.h"

namespace dmuon {

// ---- small public helpers -----------------------------------------------------------------

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n))
      throw std::invalid_argument("parameter '" + name +
                                  "': element count overflows int64; check its shape");
  }
  return n;
}

namespace {

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t dot = s.find('.', start);
    out.push_back(s.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return out;
}

bool is_index(const std::string& t) {
  return !t.empty() && std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string find_key(const std::vector<std::string>& tok, const std::vector<std::string>& names) {
  for (size_t i = 0; i + 1 < tok.size(); ++i) {
    if (std::find(names.begin(), names.end(), tok[i]) == names.end() || !is_index(tok[i + 1]))
      continue;
    std::string key;
    for (size_t j = 0; j <= i + 1; ++j) key += (j ? "." : "") + tok[j];
    return key;
  }
  return "";
}

}  // namespace

std::string layer_key_of(const std::string& param_name) {
  const auto tok = split_dots(param_name);
  std::string key = find_key(tok, {"layers", "blocks"});
  if (key.empty()) key = find_key(tok, {"h", "layer"});
  return key;
}

std::string assignment_group_of(const ParamSpec& p) {
  if (!p.group_key.empty()) return p.group_key;
  std::string key = layer_key_of(p.name);
  return key.empty() ? p.name : key;
}

std::string default_boundary_of(const std::string& param_name) {
  std::string key = layer_key_of(param_name);
  return key.empty() ? param_name : key;
}

std::string format_fingerprint(uint64_t fingerprint) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(fingerprint));
  return buf;
}

// ---- owner strategies and cost models --------------------------------------------------------
namespace {
constexpr std::pair<OwnerStrategy, const char*> kStrategies[] = {
    {OwnerStrategy::Lpt, "lpt"}, {OwnerStrategy::RoundRobin, "round_robin"}, {OwnerStrategy::Rank0, "rank0"}};
}  // namespace

const char* owner_strategy_name(OwnerStrategy s) {
  for (const auto& [k, name] : kStrategies)
    if (k == s) return name;
  return "?";
}

std::optional<OwnerStrategy> parse_owner_strategy(const std::string& s) {
  for (const auto& [k, name] : kStrategies)
    if (s == name) return k;
  return std::nullopt;
}

std::vector<std::string> owner_strategy_names() {
  std::vector<std::string> out;
  for (const auto& entry : kStrategies) out.push_back(entry.second);
  return out;
}

std::vector<double> OwnerCostModel::costs(const std::vector<ParamSpec>& params, const ResolvedPlanOptions& opts,
                                          int /*slots*/) const {
  std::vector<double> out(params.size());
  for (size_t i = 0; i < params.size(); ++i) out[i] = cost(params[i], opts);
  return out;
}

namespace {
// "optimizer": multiply-adds of ns_steps Newton-Schulz steps plus the publish bytes. Costs are
// computed exactly in 128-bit integers and rounded to double once, so no compiler contraction (FMA)
// or evaluation order can make two machines disagree on them.
class OptimizerCost final : public OwnerCostModel {
 public:
  const char* name() const override { return "optimizer"; }
  std::string unit(const ResolvedPlanOptions&) const override { return "NS multiply-adds + bytes"; }
  double cost(const ParamSpec& p, const ResolvedPlanOptions& opts) const override {
    using i128 = __int128;
    const int64_t numel = p.numel();
    const int64_t m = p.shape.size() >= 2 ? p.shape[0] : 1;
    const int64_t n = m > 0 ? numel / m : 0;
    const i128 s = std::min(m, n), b = std::max(m, n);
    i128 ns = 0;
    const bool overflow = __builtin_mul_overflow(b * s, static_cast<i128>(2), &ns) ||
                          __builtin_add_overflow(ns, static_cast<i128>(numel), &ns) ||
                          __builtin_mul_overflow(ns, s, &ns) ||
                          __builtin_mul_overflow(ns, static_cast<i128>(opts.ns_steps), &ns);
    if (overflow) {  // beyond any real tensor; fall back to double arithmetic
      const double sd = static_cast<double>(s), bd = static_cast<double>(b);
      return opts.ns_steps * sd * (static_cast<double>(numel) + 2.0 * bd * sd) + static_cast<double>(p.bytes());
    }
    return static_cast<double>(ns) + static_cast<double>(p.bytes());
  }
};

// "numel": the element count.
class NumelCost final : public OwnerCostModel {
 public:
  const char* name() const override { return "numel"; }
  std::string unit(const ResolvedPlanOptions&) const override { return "elements"; }
  double cost(const ParamSpec& p, const ResolvedPlanOptions&) const override { return static_cast<double>(p.numel()); }
};

// "profiled": the matrix's measured time in ns within the batch its owner runs (`same` matrices of
// its shape in the plan over `slots` owners; see owner_plan.h).
class ProfiledCost final : public OwnerCostModel {
 public:
  const char* name() const override { return "profiled"; }
  std::string unit(const ResolvedPlanOptions& opts) const override {
    return "measured NS ns, batched per shape (" + (opts.ns_profile ? opts.ns_profile->source : std::string("?")) + ")";
  }
  bool needs_ns_profile() const override { return true; }
  double cost(const ParamSpec& p, const ResolvedPlanOptions& opts) const override { return batched(p, opts, 1, 1); }
  std::vector<double> costs(const std::vector<ParamSpec>& params, const ResolvedPlanOptions& opts,
                            int slots) const override {
    // matrices of one shape (orientation-free, as NS transposes tall ones) and element size
    std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t> count;
    auto key = [](const ParamSpec& p) {
      const int64_t m = p.shape.size() >= 2 ? p.shape[0] : 1, n = m > 0 ? p.numel() / m : 0;
      return std::make_tuple(std::min(m, n), std::max(m, n), p.elem_bytes);
    };
    for (const ParamSpec& p : params) ++count[key(p)];
    std::vector<double> out(params.size());
    for (size_t i = 0; i < params.size(); ++i) out[i] = batched(params[i], opts, count[key(params[i])], slots);
    return out;
  }

 private:
  static double batched(const ParamSpec& p, const ResolvedPlanOptions& opts, int64_t same, int slots) {
    if (!opts.ns_profile)
      throw std::invalid_argument("owner_cost_model 'profiled' has no NS profile (resolve_plan_options sets it from "
                                  "PlanOptions::ns_profile or DMUON_NS_PROFILE)");
    const int64_t m = p.shape.size() >= 2 ? p.shape[0] : 1;
    const NsCost c = opts.ns_profile->cost_of(m, m > 0 ? p.numel() / m : 0, p.elem_bytes);
    const double per_owner = std::max(1.0, static_cast<double>(same) / std::max(1, slots));
    // NS time scales with its step count: a profile measured at other steps is scaled to the plan's;
    // whole ns, so last-bit differences between machines' floating point never reach the planner
    const double steps = static_cast<double>(opts.ns_steps) / opts.ns_profile->ns_steps;
    return std::round(1e3 * steps * (c.per_matrix_us + c.fixed_us / per_owner));
  }
};

// The cost models by name: a new one is a class above and one entry here.
const std::vector<std::shared_ptr<const OwnerCostModel>>& cost_models() {
  static const std::vector<std::shared_ptr<const OwnerCostModel>> models = {
      std::make_shared<OptimizerCost>(), std::make_shared<NumelCost>(), std::make_shared<ProfiledCost>()};
  return models;
}
}  // namespace

std::shared_ptr<const OwnerCostModel> owner_cost_model(const std::string& name) {
  for (const auto& m : cost_models())
    if (name == m->name()) return m;
  return nullptr;
}

std::vector<std::string> owner_cost_model_names() {
  std::vector<std::string> out;
  for (const auto& m : cost_models()) out.push_back(m->name());
  return out;
}

std::vector<double> param_costs(const std::vector<ParamSpec>& params, const ResolvedPlanOptions& opts, int slots) {
  return opts.cost_model->costs(params, opts, slots);
}

double param_cost(const ParamSpec& p, const ResolvedPlanOptions& opts) { return opts.cost_model->cost(p, opts); }

// ---- the packing search ------------------------------------------------------------------
namespace detail {
namespace {
std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void validate_inputs(const std::vector<ParamSpec>& params, int G, int R) {
  if (G < 1)
    throw std::invalid_argument("plan_owners: shard size G must be >= 1, got " +
                                std::to_string(G) + ".");
  if (R < 1)
    throw std::invalid_argument("plan_owners: replicate size R must be >= 1, got " +
                                std::to_string(R) + " (use 1 for a 1-D mesh).");
  if (static_cast<int64_t>(G) * R > kMaxSlots)
    throw std::invalid_argument("plan_owners: G*R = " + std::to_string(static_cast<int64_t>(G) * R) +
                                " owner slots is more than the supported " +
                                std::to_string(kMaxSlots) + ".");
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    const std::string who = "plan_owners: parameter " + std::to_string(i) + " '" + p.name + "'";
    if (p.name.empty())
      throw std::invalid_argument("plan_owners: parameter " + std::to_string(i) +
                                  " has an empty name; give every parameter its qualified name.");
    auto [it, fresh] = seen.emplace(p.name, i);
    if (!fresh)
      throw std::invalid_argument(who + " repeats the name of parameter " +
                                  std::to_string(it->second) + "; names must be unique.");
    if (p.shape.empty())
      throw std::invalid_argument(who + " has an empty shape []; Muon targets need >= 1 dimension.");
    for (int64_t d : p.shape)
      if (d < 1)
        throw std::invalid_argument(who + " has shape " + shape_str(p.shape) +
                                    ": every dimension must be >= 1.");
    if (p.elem_bytes < 1)
      throw std::invalid_argument(who + " has elem_bytes " + std::to_string(p.elem_bytes) +
                                  "; must be >= 1 (bf16 = 2, fp32 = 4).");
    (void)p.numel();  // throws on overflow
  }
}

// Packing must never make a plan worse. Merging a layer's small matrices into one unit saves
// broadcast roots (fewer distinct owners per hook boundary), but a merged unit can be far larger
// than total / S: a DeepSeek-V2-Lite MoE layer packs its 192 expert matrices into one unit, 27
// units on 64 slots, makespan 2.3x the per-matrix plan's. So a packed plan is kept only when its
// makespan is within kPackTolerance (1%) of the per-matrix plan (every parameter its own unit).
//
// The variants, most packing first: the seed's packing (one unit per group's small parameters;
// kept wherever it is harmless, so those plans are unchanged), then packed units capped at L/k,
// L = max(total / S, largest matrix) the per-matrix lower bound, for k in kCapDivisors. Capping
// at L/k leaves list scheduling about 1/k of slack per slot; but equal-sized chunks also need a
// count that spreads evenly over S slots (1026 chunks of 5 experts on 64 slots put 17 on some
// slot: +2.7%, while chunks of 3 fit exactly), hence the finely spaced divisors. The first
// variant within the tolerance wins; when none is, the per-matrix plan is returned (packing off,
// in effect). "Most packing within 1%" rather than "the best makespan": finer granularity almost
// always plans a little better, so the best makespan would give up packing nearly everywhere.
//
// Cheap paths, same result: a variant whose unit granularity floor already exceeds the
// tolerance is rejected without planning it (no assignment of its units could pass); a variant
// within the tolerance of L is within it of every plan, so it is taken without planning per
// matrix at all (per_matrix_makespan stays 0); variants whose unit partition equals one already
// tried are skipped (a model without small matrices plans once).
constexpr double kPackTolerance = 0.01;
constexpr double kCapDivisors[] = {1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64};

OwnerPlan plan_search(const std::vector<ParamSpec>& params, int G, int R,
                      const ResolvedPlanOptions& opts) {
  std::optional<OwnerPlan> per_matrix;
  auto baseline = [&]() -> const OwnerPlan& {
    if (!per_matrix) {
      Planner base(params, G, R, opts, kNoPacking);
      base.build_units();
      per_matrix = base.run();
      per_matrix->per_matrix_makespan = per_matrix->makespan;
    }
    return *per_matrix;
  };
  if (!opts.pack_small_params || params.empty()) return baseline();
  double total = 0, largest = 0;
  for (const double c : param_costs(params, opts, G * R)) {
    total += c;
    largest = std::max(largest, c);
  }
  const double L = std::max(total / (G * R), largest);
  const double at_bound = L * (1.0 + kPackTolerance);  // a makespan no plan can beat by > 1%
  std::vector<double> caps = {kUncapped};
  if (L > 0)
    for (double k : kCapDivisors) caps.push_back(L / k);
  std::vector<std::vector<std::vector<int>>> tried;
  {  // the per-matrix partition counts as tried: a variant equal to it is the baseline itself
    Planner none(params, G, R, opts, kNoPacking);
    none.build_units();
    tried.push_back(none.partition());
  }
  for (double cap : caps) {
    Planner variant(params, G, R, opts, cap);
    variant.build_units();
    std::vector<std::vector<int>> part = variant.partition();
    if (std::find(tried.begin(), tried.end(), part) != tried.end()) continue;
    tried.push_back(std::move(part));
    const double floor = variant.unit_floor();
    if (floor > at_bound && floor > baseline().makespan * (1.0 + kPackTolerance)) continue;
    OwnerPlan plan = variant.run();
    if (plan.makespan <= at_bound || plan.makespan <= baseline().makespan * (1.0 + kPackTolerance)) {
      plan.per_matrix_makespan = per_matrix ? per_matrix->makespan : 0.0;
      return plan;
    }
  }
  return baseline();
}

}  // namespace
}  // namespace detail

OwnerPlan plan_owners(const std::vector<ParamSpec>& params, int shard_size, int replicate_size,
                      const PlanOptions& opts) {
  detail::validate_inputs(params, shard_size, replicate_size);
  return detail::plan_search(params, shard_size, replicate_size, resolve_plan_options(opts));
}

}  // namespace dmuon
