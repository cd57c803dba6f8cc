// planner.cpp -- allocation units and the first assignment (LPT with layer concurrency and HSDP column balance, or round robin).
//
// Determinism: every ordering below has an explicit tie-break on an index, no container is
// iterated in hash order, and the fingerprint hashes a canonical byte serialization with FNV-1a.
// Costs are doubles computed from integers in a fixed order (IEEE-754, no fast-math), so two
// machines compute the same loads and take the same branches.
#include "planner.h"

namespace dmuon::detail {

void Planner::build_units() {
  const int P = static_cast<int>(params_.size());
  pcost_.resize(P);
  pgroup_.resize(P);
  std::map<std::string, int> group_id;  // ordered map: lookups only, ids by first appearance
  std::vector<std::vector<int>> members;
  const std::vector<double> costs = param_costs(params_, opts_, S_);
  for (int i = 0; i < P; ++i) {
    pcost_[i] = costs[static_cast<size_t>(i)];
    pgroup_[i] = assignment_group_of(params_[i]);
    auto [it, fresh] = group_id.emplace(pgroup_[i], static_cast<int>(groups_.size()));
    if (fresh) {
      groups_.push_back(GroupInfo{pgroup_[i]});
      members.emplace_back();
    }
    members[it->second].push_back(i);
  }
  // One unit per large parameter; the group's small parameters share packed units (one when
  // uncapped, else consecutive runs of about equal cost under the cap), each placed at the
  // position of its first member.
  std::vector<std::pair<AllocationUnit, int>> built;
  const bool packing = pack_cap_ != kNoPacking;
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto small = [&](int i) { return packing && params_[i].numel() < opts_.pack_threshold_numel; };
    double small_total = 0;
    for (int i : members[g])
      if (small(i)) small_total += pcost_[i];
    double target = kUncapped;  // the cost at which a packed run is closed
    if (pack_cap_ < kUncapped && small_total > pack_cap_) {
      const double k = std::ceil(small_total / pack_cap_);
      target = small_total / k * (1.0 + 1e-9);  // equal costs must not split on rounding
    }
    int packed = -1;
    double packed_cost = 0;
    for (int i : members[g]) {
      if (small(i) && packed >= 0 && packed_cost + pcost_[i] <= target) {
        built[packed].first.params.push_back(i);
        packed_cost += pcost_[i];
        continue;
      }
      AllocationUnit u;
      u.params = {i};
      u.group = groups_[g].name;
      built.emplace_back(std::move(u), static_cast<int>(g));
      if (small(i)) {
        packed = static_cast<int>(built.size()) - 1;
        packed_cost = pcost_[i];
      }
    }
  }
  std::sort(built.begin(), built.end(), [](const auto& a, const auto& b) {
    return a.first.params.front() < b.first.params.front();
  });
  for (auto& [u, g] : built) {
    for (int i : u.params) {
      u.cost += pcost_[i];
      u.bytes += params_[i].bytes();
    }
    ++groups_[g].units;
    units_.push_back(std::move(u));
    unit_group_.push_back(g);
  }
  const int cap_opt = opts_.max_owners_per_group.value_or(S_);
  for (auto& gi : groups_) {
    gi.cap = std::min(cap_opt, S_);
    gi.slot_cap = ceil_div(gi.units, std::min(S_, gi.cap));
    gi.col_cap = ceil_div(gi.units, std::min(G_, gi.cap));
  }
  unit_slot_.assign(units_.size(), -1);
  gslots_.assign(groups_.size(), GroupSlots{G_, {}, {}, {}});
  slot_units_.assign(S_, {});
  load_.assign(S_, 0.0);
  bytes_.assign(S_, 0);
}

void Planner::recompute_slot(int slot) {
  double c = 0;
  int64_t b = 0;
  for (int u : slot_units_[slot]) {
    c += units_[u].cost;
    b += units_[u].bytes;
  }
  load_[slot] = c;
  bytes_[slot] = b;
}

void Planner::place(int u, int slot) {
  unit_slot_[u] = slot;
  gslots_[unit_group_[u]].add(slot);
  auto& v = slot_units_[slot];
  v.insert(std::lower_bound(v.begin(), v.end(), u), u);
  recompute_slot(slot);
}

void Planner::unplace(int u) {
  const int slot = unit_slot_[u];
  gslots_[unit_group_[u]].remove(slot);
  auto& v = slot_units_[slot];
  v.erase(std::lower_bound(v.begin(), v.end(), u));
  unit_slot_[u] = -1;
  recompute_slot(slot);
}

// Slots (and, with column balance, shard columns) are kept in ordered sets keyed exactly like
// slot_less (cost, bytes, index), so the first eligible entry is the choice: O(log S) per unit
// plus a skip over the few slots the unit's group already fills.
void Planner::assign_lpt() {
  using Key = std::tuple<double, int64_t, int>;
  std::vector<int> order(units_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (units_[a].cost != units_[b].cost) return units_[a].cost > units_[b].cost;
    return units_[a].params.front() < units_[b].params.front();
  });
  const bool cols = column_mode();
  std::set<Key> slot_order;                      // 1-D / no column balance
  std::vector<std::set<Key>> col_slots(cols ? G_ : 0);  // per column: its slots
  std::set<Key> col_order;                       // columns by (cost, bytes, index)
  std::vector<double> col_load(G_, 0.0);
  std::vector<int64_t> col_bytes(G_, 0);
  auto slot_key = [&](int s) { return Key{load_[s], bytes_[s], s}; };
  for (int s = 0; s < S_; ++s) {
    if (cols) col_slots[s % G_].insert(slot_key(s));
    else slot_order.insert(slot_key(s));
  }
  if (cols)
    for (int c = 0; c < G_; ++c) col_order.insert(Key{0.0, 0, c});

  for (int u : order) {
    const int g = unit_group_[u];
    const GroupSlots& gs = gslots_[g];
    const bool capped = gs.distinct() >= groups_[g].cap;  // only the group's own slots remain
    int chosen = -1;
    if (cols) {
      auto better_col = [&](int pref_a, int a, int pref_b, int b) {
        if (b < 0) return true;
        if (pref_a != pref_b) return pref_a < pref_b;
        if (col_load[a] != col_load[b]) return col_load[a] < col_load[b];
        if (col_bytes[a] != col_bytes[b]) return col_bytes[a] < col_bytes[b];
        return a < b;
      };
      int best_col = -1, best_pref = 0;
      if (capped) {
        for (int sl : gs.used) {
          if (!eligible(g, sl, -1)) continue;
          const int col = sl % G_, pref = gs.column_count(col) < groups_[g].col_cap ? 0 : 1;
          if (best_col == col ? slot_less(sl, chosen) : better_col(pref, col, best_pref, best_col)) {
            best_col = col;
            best_pref = pref;
            chosen = sl;
          }
        }
      } else {
        for (const Key& ck : col_order) {
          const int col = std::get<2>(ck);
          const int pref = gs.column_count(col) < groups_[g].col_cap ? 0 : 1;
          if (best_col >= 0 && pref >= best_pref) continue;  // a fallback is already held
          int in_col = -1;
          for (const Key& sk : col_slots[col])
            if (eligible(g, std::get<2>(sk), -1)) {
              in_col = std::get<2>(sk);
              break;
            }
          if (in_col < 0) continue;
          best_col = col;
          best_pref = pref;
          chosen = in_col;
          if (pref == 0) break;
        }
      }
    } else if (capped) {
      for (int sl : gs.used)
        if (eligible(g, sl, -1) && slot_less(sl, chosen)) chosen = sl;
    } else {
      for (const Key& k : slot_order)
        if (eligible(g, std::get<2>(k), -1)) {
          chosen = std::get<2>(k);
          break;
        }
    }
    if (chosen < 0)  // cannot happen: the caps always leave room (see GroupInfo)
      throw std::logic_error("plan_owners: internal error, no eligible slot for group '" +
                             groups_[g].name + "'");
    const int col = chosen % G_;
    if (cols) {
      col_slots[col].erase(slot_key(chosen));
      col_order.erase(Key{col_load[col], col_bytes[col], col});
    } else {
      slot_order.erase(slot_key(chosen));
    }
    place(u, chosen);
    col_load[col] += units_[u].cost;
    col_bytes[col] += units_[u].bytes;
    if (cols) {
      col_slots[col].insert(slot_key(chosen));
      col_order.insert(Key{col_load[col], col_bytes[col], col});
    } else {
      slot_order.insert(slot_key(chosen));
    }
  }
}

void Planner::assign_round_robin() {
  int cursor = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    const int g = unit_group_[u];
    int slot = cursor;
    // A group that already uses its cap of distinct slots reuses one of them: the next one at or
    // after the cursor.
    if (gslots_[g].distinct() >= groups_[g].cap && gslots_[g].count(slot) == 0) {
      for (int step = 1; step < S_; ++step) {
        const int cand = (cursor + step) % S_;
        if (gslots_[g].count(cand) > 0) {
          slot = cand;
          break;
        }
      }
    }
    place(static_cast<int>(u), slot);
    cursor = (slot + 1) % S_;
  }
}

// Pigeonhole bound over unit costs (see OwnerPlan::granularity_bound), at least `simple`.
double granularity_bound_of(std::vector<double> c, int S, double simple) {
  std::sort(c.begin(), c.end(), std::greater<double>());
  double gb = simple;
  for (int64_t k = 1; k * S + 1 <= static_cast<int64_t>(c.size()); ++k) {
    double sum = 0;
    for (int64_t j = k * S - k; j <= k * S; ++j) sum += c[j];
    gb = std::max(gb, sum);
  }
  return gb;
}

// Would moving these units keep every constraint that holds now? A group's count on a slot (or
// in a shard column, with column balance) may only grow up to its cap, and its number of
// distinct slots only up to max_owners_per_group.
}  // namespace dmuon::detail
