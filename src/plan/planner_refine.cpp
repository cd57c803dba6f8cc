// planner_refine.cpp -- the deterministic refinement pass, violations, the fingerprint, the finished plan.
//
// Determinism: every ordering below has an explicit tie-break on an index, no container is
// iterated in hash order, and the fingerprint hashes a canonical byte serialization with FNV-1a.
// Costs are doubles computed from integers in a fixed order (IEEE-754, no fast-math), so two
// machines compute the same loads and take the same branches.
#include "planner.h"

#include "dmuon/digest.h"

namespace dmuon::detail {

bool Planner::moves_feasible(const std::vector<Move>& moves) const {
  std::vector<std::pair<int, int>> delta;  // (slot, change) for one group
  for (size_t i = 0; i < moves.size(); ++i) {
    const int g = unit_group_[moves[i].unit];
    bool done = false;  // group already checked for an earlier move
    for (size_t j = 0; j < i && !done; ++j) done = unit_group_[moves[j].unit] == g;
    if (done) continue;
    delta.clear();
    auto bump = [&](int slot, int by) {
      for (auto& [s, d] : delta)
        if (s == slot) { d += by; return; }
      delta.emplace_back(slot, by);
    };
    for (size_t j = i; j < moves.size(); ++j)
      if (unit_group_[moves[j].unit] == g) {
        bump(moves[j].from, -1);
        bump(moves[j].to, +1);
      }
    const GroupInfo& gi = groups_[g];
    const GroupSlots& gs = gslots_[g];
    const int od = gs.distinct();
    int nd = od;
    for (const auto& [slot, d] : delta) {
      if (d == 0) continue;
      const int o = gs.count(slot), n = o + d;
      if (d > 0 && n > gi.slot_cap) return false;
      nd += (o == 0 && n > 0) - (o > 0 && n == 0);
    }
    if (nd > od && nd > gi.cap) return false;
    if (column_mode()) {
      for (const auto& [slot, unused] : delta) {
        int dc = 0;  // the group's change in this slot's column (its current count: column_count)
        const int col = slot % G_;
        for (const auto& [s2, d2] : delta)
          if (s2 % G_ == col) dc += d2;
        if (dc > 0 && gs.column_count(col) + dc > gi.col_cap) return false;
      }
    }
  }
  return true;
}

// Lowers the most loaded slot m while possible. Direct candidates, all between m and one slot t:
// move a unit a of m to t; swap a against one cheaper unit of t; swap a against a greedy subset
// of t's cheaper units (aiming at equal loads of m and t). Only when none of those helps, a
// chain: such a move or swap that overloads t, followed by moving one unit from t to one of the
// least loaded slots. The best candidate whose new loads all stay below the current makespan
// wins; every constraint that holds is kept. With HSDP column balance no column may end above
// the current column makespan, so column balance never gets worse. Stops when nothing improves,
// when the makespan is within kRefineTolerance of the granularity floor, or after kRefineBudget
// candidate evaluations (a count, not a clock: the result never depends on the machine's speed).
// Candidates are scanned in index order and ties keep the first, so the result is deterministic.
void Planner::refine(double floor) {
  constexpr double kRefineTolerance = 5e-4;
  constexpr int64_t kRefineBudget = 4'000'000;
  constexpr int kSwapTries = 4;     // one-for-one candidates tried per direction
  constexpr int kGreedyScan = 64;   // units of t examined by the one-for-many pick
  constexpr int kChainSinks = 4;    // least loaded slots a chain may shed a unit to
  const int U = static_cast<int>(units_.size());
  const int max_iters = 4 * U + 16;
  int64_t work = 0;
  std::vector<double> col_load(G_, 0.0);
  std::vector<std::vector<int>> by_cost(S_);  // per slot, units by cost desc (then index)
  auto sort_slot = [&](int s) {
    by_cost[s] = slot_units_[s];
    std::stable_sort(by_cost[s].begin(), by_cost[s].end(),
                     [&](int x, int y) { return units_[x].cost > units_[y].cost; });
  };
  for (int s = 0; s < S_; ++s) sort_slot(s);
  std::vector<Move> best, cand;
  std::vector<std::pair<int, double>> touched;  // (slot, load change) of a candidate
  std::vector<int> sinks;
  for (int iter = 0; iter < max_iters && work < kRefineBudget; ++iter) {
    int m = 0;
    for (int s = 1; s < S_; ++s)
      if (load_[s] > load_[m]) m = s;
    const double peak = load_[m];
    if (slot_units_[m].size() <= 1) break;                  // one unit: nothing lowers it
    if (peak <= floor * (1.0 + kRefineTolerance)) break;    // at the floor: good as it gets
    std::fill(col_load.begin(), col_load.end(), 0.0);
    for (int s = 0; s < S_; ++s) col_load[s % G_] += load_[s];
    const double col_max = *std::max_element(col_load.begin(), col_load.end());

    double best_peak = peak * (1.0 - 1e-12);  // a strict, non-negligible improvement
    best.clear();
    // The new makespan over the slots a candidate touches, or +inf when it breaks a rule.
    auto consider = [&](const std::vector<Move>& moves) {
      ++work;
      touched.clear();
      auto add = [&](int slot, double by) {
        for (auto& [s2, d] : touched)
          if (s2 == slot) { d += by; return; }
        touched.emplace_back(slot, by);
      };
      for (const Move& mv : moves) {
        add(mv.from, -units_[mv.unit].cost);
        add(mv.to, units_[mv.unit].cost);
      }
      double np = 0;
      for (const auto& [slot, d] : touched) np = std::max(np, load_[slot] + d);
      if (!(np < best_peak)) return false;
      if (column_mode()) {
        for (const auto& [slot, unused] : touched) {
          double dc = 0;
          for (const auto& [s2, d2] : touched)
            if (s2 % G_ == slot % G_) dc += d2;
          if (dc > 0 && col_load[slot % G_] + dc > col_max) return false;
        }
      }
      if (!moves_feasible(moves)) return false;
      best_peak = np;
      best = moves;
      return true;
    };
    // One-for-one swap partners of a (cost ca) in t: the best b costs ca - d/2; walk outward
    // from there in both directions; each direction only gets worse, so stop at its first success
    // (or after kSwapTries). `extra` receives every partner tried, for the chain step.
    auto swap_partners = [&](int t, double ca, std::vector<int>* extra) {
      const std::vector<int>& bc = by_cost[t];
      const double ideal = ca - (peak - load_[t]) / 2;
      const size_t split = static_cast<size_t>(
          std::partition_point(bc.begin(), bc.end(),
                               [&](int x) { return units_[x].cost >= ideal; }) - bc.begin());
      std::vector<int> out;
      int tries = 0;
      for (size_t k = split; k-- > 0 && tries < kSwapTries; ++tries)
        if (units_[bc[k]].cost < ca) out.push_back(bc[k]);
      tries = 0;
      for (size_t k = split; k < bc.size() && tries < kSwapTries; ++k, ++tries)
        out.push_back(bc[k]);
      if (extra) *extra = out;
      return out;
    };

    for (int a : slot_units_[m]) {
      const double ca = units_[a].cost;
      for (int t = 0; t < S_; ++t) {
        if (t == m || load_[t] >= peak) continue;
        const Move ma{a, m, t};
        if (load_[t] + ca < best_peak) {  // plain move
          cand.assign(1, ma);
          consider(cand);
        }
        const std::vector<int>& bc = by_cost[t];
        if (bc.empty()) continue;
        for (int b : swap_partners(t, ca, nullptr)) {
          const double cb = units_[b].cost;
          if (!(std::max(peak - ca + cb, load_[t] + ca - cb) < best_peak)) continue;
          cand.assign({ma, Move{b, t, m}});
          consider(cand);
        }
        // One-for-many: t's units cheaper than ca, largest first, up to ca - d/2 in total.
        const double ideal = ca - (peak - load_[t]) / 2;
        const size_t first = static_cast<size_t>(
            std::partition_point(bc.begin(), bc.end(),
                                 [&](int x) { return units_[x].cost > ideal; }) - bc.begin());
        const double smallest = units_[bc.back()].cost;
        cand.assign(1, ma);
        double sum = 0;
        for (size_t k = first; k < bc.size() && k < first + kGreedyScan; ++k) {
          if (ideal - sum < smallest) break;
          const double cb = units_[bc[k]].cost;
          if (cb >= ca || sum + cb > ideal) continue;
          ++work;
          cand.push_back(Move{bc[k], t, m});
          if (moves_feasible(cand)) sum += cb;
          else cand.pop_back();
        }
        if (cand.size() > 2) consider(cand);
      }
    }

    if (best.empty() && S_ >= 3) {
      // Chains: (a: m -> t [, b: t -> m]) then (c: t -> sink).
      sinks.clear();
      for (int s = 0; s < S_; ++s) {
        if (s == m) continue;
        auto pos = std::find_if(sinks.begin(), sinks.end(), [&](int x) {
          return load_[s] < load_[x] || (load_[s] == load_[x] && s < x);
        });
        sinks.insert(pos, s);
        if (static_cast<int>(sinks.size()) > kChainSinks + 1) sinks.pop_back();
      }
      std::vector<int> partners;
      for (int a : slot_units_[m]) {
        const double ca = units_[a].cost;
        for (int t = 0; t < S_ && work < kRefineBudget; ++t) {
          if (t == m || load_[t] >= peak) continue;
          swap_partners(t, ca, &partners);
          partners.insert(partners.begin(), -1);  // -1: plain move of a
          for (int b : partners) {
            const double cb = b >= 0 ? units_[b].cost : 0.0;
            if (cb >= ca) continue;
            const double new_t = load_[t] + ca - cb;
            if (!(peak - ca + cb < best_peak)) continue;
            for (int c : by_cost[t]) {
              if (c == b) continue;
              const double cc = units_[c].cost;
              if (!(new_t - cc < best_peak)) break;  // by_cost is descending
              for (int u : sinks) {
                if (u == t || !(load_[u] + cc < best_peak)) continue;
                cand.assign(1, Move{a, m, t});
                if (b >= 0) cand.push_back(Move{b, t, m});
                cand.push_back(Move{c, t, u});
                consider(cand);
              }
            }
          }
        }
      }
    }
    if (best.empty()) break;
    std::vector<int> resort;
    for (const Move& mv : best) {
      for (int s : {mv.from, mv.to})
        if (std::find(resort.begin(), resort.end(), s) == resort.end()) resort.push_back(s);
      unplace(mv.unit);
    }
    for (const Move& mv : best) place(mv.unit, mv.to);
    for (int s : resort) sort_slot(s);
  }
}

std::vector<std::string> Planner::find_violations() const {
  std::vector<std::string> out;
  struct Example {
    int count = 0;
    std::string text;
  };
  Example slot_conc, col_conc, cap;
  auto coord = [&](int slot) {  // (built by append: GCC 12 warns falsely on "(" + std::to_string(...))
    std::string c(1, '(');
    c.append(std::to_string(slot % G_)).append(1, ',').append(std::to_string(slot / G_)).append(1, ')');
    return c;
  };
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GroupInfo& gi = groups_[g];
    const GroupSlots& gs = gslots_[g];
    int worst_slot = -1, worst_col = -1;
    for (int s : gs.used) {
      const int c = gs.count(s);
      if (worst_slot < 0 || c > gs.count(worst_slot) || (c == gs.count(worst_slot) && s < worst_slot))
        worst_slot = s;
    }
    for (int s : gs.used) {
      const int col = s % G_;
      if (worst_col < 0 || gs.column_count(col) > gs.column_count(worst_col) ||
          (gs.column_count(col) == gs.column_count(worst_col) && col < worst_col))
        worst_col = col;
    }
    if (worst_slot >= 0 && gs.count(worst_slot) > gi.slot_cap) {
      if (slot_conc.count++ == 0)
        slot_conc.text = "'" + gi.name + "' has " + std::to_string(gs.count(worst_slot)) +
                         " of its " + std::to_string(gi.units) + " units on slot " +
                         coord(worst_slot) + ", allowed " + std::to_string(gi.slot_cap);
    }
    if (column_mode() && worst_col >= 0 && gs.column_count(worst_col) > gi.col_cap) {
      if (col_conc.count++ == 0)
        col_conc.text = "'" + gi.name + "' has " + std::to_string(gs.column_count(worst_col)) +
                        " of its " + std::to_string(gi.units) + " units in shard column " +
                        std::to_string(worst_col) + ", allowed " + std::to_string(gi.col_cap);
    }
    if (gs.distinct() > gi.cap) {
      if (cap.count++ == 0)
        cap.text = "'" + gi.name + "' uses " + std::to_string(gs.distinct()) +
                   " distinct slots, cap " + std::to_string(gi.cap);
    }
  }
  const std::string n_groups = std::to_string(groups_.size());
  if (slot_conc.count)
    out.push_back("layer concurrency: " + std::to_string(slot_conc.count) + " of " + n_groups +
                  " groups put more units on one owner slot than ceil(units / slots) allows, so "
                  "their broadcasts serialize (first: " + slot_conc.text + ").");
  if (col_conc.count)
    out.push_back("HSDP column concurrency: " + std::to_string(col_conc.count) + " of " +
                  n_groups + " groups put more units in one shard column than ceil(units / G) "
                  "allows (first: " + col_conc.text + ").");
  if (cap.count)
    out.push_back("max_owners_per_group: " + std::to_string(cap.count) + " of " + n_groups +
                  " groups exceed the cap (first: " + cap.text + ").");
  return out;
}

uint64_t Planner::fingerprint(const OwnerPlan& plan) const {
  Fnv1a h;
  h.str("dmuon.owner_plan.v1");
  h.i64(G_);
  h.i64(R_);
  h.str(owner_strategy_name(opts_.owner_strategy));
  h.str(opts_.cost_model->name());
  if (opts_.ns_profile) h.u64(opts_.ns_profile->digest());
  h.i64(opts_.hsdp_column_balance ? 1 : 0);
  h.i64(opts_.pack_small_params ? 1 : 0);
  h.i64(opts_.max_owners_per_group.value_or(-1));
  h.i64(opts_.pack_threshold_numel);
  h.i64(opts_.ns_steps);
  h.u64(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamSpec& p = params_[i];
    h.str(p.name);
    h.u64(p.shape.size());
    for (int64_t d : p.shape) h.i64(d);
    h.i64(p.elem_bytes);
    h.str(plan.groups[i]);
    h.str(p.route);
    h.i64(plan.unit_of_param[i]);
    h.i64(plan.owners[i].shard);
    h.i64(plan.owners[i].replicate);
  }
  return h.value();
}

void Planner::finish(OwnerPlan& plan) {
  const int P = static_cast<int>(params_.size());
  plan.owners.assign(P, OwnerCoord{});
  plan.groups = pgroup_;
  plan.unit_of_param.assign(P, -1);
  plan.slots.assign(S_, SlotLoad{});
  for (int s = 0; s < S_; ++s) plan.slots[s].owner = OwnerCoord{s % G_, s / G_};
  plan.column_cost.assign(G_, 0.0);
  plan.column_bytes.assign(G_, 0);
  double largest = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    AllocationUnit& unit = units_[u];
    const int slot = unit_slot_[u];
    unit.owner = OwnerCoord{slot % G_, slot / G_};
    for (int i : unit.params) {
      plan.owners[i] = unit.owner;
      plan.unit_of_param[i] = static_cast<int>(u);
    }
    SlotLoad& sl = plan.slots[slot];
    sl.cost += unit.cost;
    sl.bytes += unit.bytes;
    sl.units += 1;
    sl.params += static_cast<int>(unit.params.size());
    plan.total_cost += unit.cost;
    plan.total_bytes += unit.bytes;
    largest = std::max(largest, unit.cost);
  }
  for (const SlotLoad& sl : plan.slots) {
    plan.makespan = std::max(plan.makespan, sl.cost);
    plan.column_cost[sl.owner.shard] += sl.cost;
    plan.column_bytes[sl.owner.shard] += sl.bytes;
  }
  // The lower bound is over single matrices, not units: packing can only raise the makespan
  // above it, and the report must show that (a packed unit bigger than total / S is the
  // packing's fault, not a floor).
  double largest_param = 0;
  for (double c : pcost_) largest_param = std::max(largest_param, c);
  plan.largest_param_cost = largest_param;
  plan.lower_bound = std::max(plan.total_cost / S_, largest_param);
  plan.pack_cap = pack_cap_ == kNoPacking ? 0.0 : pack_cap_;
  for (const auto& u : units_) plan.packed_units += u.params.size() > 1;

  std::vector<double> c;
  c.reserve(units_.size());
  for (const auto& u : units_) c.push_back(u.cost);
  const double gb = granularity_bound_of(std::move(c), S_, std::max(plan.lower_bound, largest));
  plan.granularity_bound = gb;
  plan.units = units_;
  plan.violations = find_violations();
  plan.fingerprint = fingerprint(plan);
}

OwnerPlan Planner::run() {
  switch (opts_.owner_strategy) {
  case OwnerStrategy::Lpt: {
    assign_lpt();
    double total = 0, largest = 0;
    std::vector<double> c;
    for (const auto& u : units_) {
      total += u.cost;
      largest = std::max(largest, u.cost);
      c.push_back(u.cost);
    }
    refine(granularity_bound_of(std::move(c), S_, std::max(total / S_, largest)));
    break;
  }
  case OwnerStrategy::RoundRobin:
    assign_round_robin();
    break;
  case OwnerStrategy::Rank0:
    for (size_t u = 0; u < units_.size(); ++u) place(static_cast<int>(u), 0);
    break;
  }
  OwnerPlan plan;
  plan.shard_size = G_;
  plan.replicate_size = R_;
  plan.options = opts_;
  finish(plan);
  return plan;
}

}  // namespace dmuon::detail
