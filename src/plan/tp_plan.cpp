// plan_owners_tp: the DP plan of the TP-local shapes, then TP owners per DP slot (see owner_plan.h).
#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "dmuon/digest.h"
#include "dmuon/owner_plan.h"

namespace dmuon {

OwnerPlan plan_owners_tp(const std::vector<ParamSpec>& params, int shard_size, int replicate_size, int tp_size,
                         const PlanOptions& opts) {
  if (tp_size < 1) throw std::invalid_argument("plan_owners_tp: tp_size must be >= 1, got " + std::to_string(tp_size));
  std::vector<ParamSpec> local = params;
  for (auto& p : local) {
    if (p.tp_split_dim < 0) continue;
    if (p.tp_split_dim >= static_cast<int>(p.shape.size()))
      throw std::invalid_argument("plan_owners_tp: parameter '" + p.name + "' has tp_split_dim " +
                                  std::to_string(p.tp_split_dim) + " but only " + std::to_string(p.shape.size()) +
                                  " dimensions");
    int64_t& d = p.shape[static_cast<size_t>(p.tp_split_dim)];
    if (d % tp_size != 0)
      throw std::invalid_argument("plan_owners_tp: parameter '" + p.name + "': dimension " +
                                  std::to_string(p.tp_split_dim) + " (size " + std::to_string(d) +
                                  ") is not divisible by tp_size " + std::to_string(tp_size) +
                                  "; every TP rank must hold an equal slice");
    d /= tp_size;
  }
  OwnerPlan plan = plan_owners(local, shard_size, replicate_size, opts);
  const int T = tp_size;
  plan.tp_size = T;
  plan.tp_owners.assign(params.size(), 0);
  plan.tp_slot_cost.assign(static_cast<size_t>(plan.num_slots()) * static_cast<size_t>(T), 0.0);
  const std::vector<double> cost = param_costs(params, plan.options, plan.num_slots() * T);
  double total = 0, largest = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    total += cost[i];
    largest = std::max(largest, cost[i]);
  }
  // per DP slot, LPT over its T TP ranks
  std::vector<std::vector<int>> by_slot(static_cast<size_t>(plan.num_slots()));
  for (size_t i = 0; i < params.size(); ++i)
    by_slot[static_cast<size_t>(OwnerPlan::slot_index(plan.owners[i], shard_size))].push_back(static_cast<int>(i));
  for (size_t slot = 0; slot < by_slot.size(); ++slot) {
    auto& ps = by_slot[slot];
    std::stable_sort(ps.begin(), ps.end(), [&](int a, int b) { return cost[static_cast<size_t>(a)] > cost[static_cast<size_t>(b)]; });
    double* load = &plan.tp_slot_cost[slot * static_cast<size_t>(T)];
    for (int p : ps) {
      const int t = static_cast<int>(std::min_element(load, load + T) - load);
      plan.tp_owners[static_cast<size_t>(p)] = t;
      load[t] += cost[static_cast<size_t>(p)];
    }
  }
  plan.tp_makespan = plan.tp_slot_cost.empty() ? 0 : *std::max_element(plan.tp_slot_cost.begin(), plan.tp_slot_cost.end());
  plan.tp_lower_bound = std::max(total / static_cast<double>(plan.tp_slot_cost.size()), largest);
  if (T > 1) {  // the TP layout is part of the plan every rank must agree on
    Fnv1a h(plan.fingerprint);
    h.i64(T);
    for (size_t i = 0; i < params.size(); ++i) h.i64(params[i].tp_split_dim).i64(plan.tp_owners[i]);
    plan.fingerprint = h.value();
  }
  return plan;
}

std::vector<int64_t> plan_tp_exchange(const std::vector<ParamSpec>& params, const OwnerPlan& plan,
                                      const std::vector<int64_t>& elem_bytes) {
  const int T = plan.tp_size;
  std::vector<int64_t> out(static_cast<size_t>(plan.num_slots()) * static_cast<size_t>(T), 0);
  if (T == 1) return out;
  if (params.size() != plan.tp_owners.size() || (elem_bytes.size() != 1 && elem_bytes.size() != params.size()))
    throw std::invalid_argument("plan_tp_exchange: " + std::to_string(params.size()) + " params, " +
                                std::to_string(plan.tp_owners.size()) + " TP owners and " +
                                std::to_string(elem_bytes.size()) + " element sizes do not match");
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    const int64_t esz = elem_bytes.size() == 1 ? elem_bytes[0] : elem_bytes[i];
    const int64_t bytes = p.numel() * esz * (p.tp_split_dim >= 0 ? 2 : 1);
    const size_t base = static_cast<size_t>(OwnerPlan::slot_index(plan.owners[i], plan.shard_size)) * T;
    for (int t = 0; t < T; ++t)
      if (t != plan.tp_owners[i]) out[base + static_cast<size_t>(t)] += bytes;
  }
  return out;
}

}  // namespace dmuon
