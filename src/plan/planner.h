// planner.h -- internal: the owner planner's working state (src/plan/). planner.cpp builds the
// allocation units and assigns them (LPT, round robin); planner_refine.cpp improves the assignment,
// finds violations, fingerprints and finishes the plan; owner_plan.cpp searches the packing variants.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>


#include "dmuon/owner_plan.h"


namespace dmuon::detail {

constexpr int kMaxSlots = 1 << 24;

// Slots used by one group: its distinct slots in order of first use (iterated by the checks and the
// messages), and each slot's and each shard column's count of its units (the refinement asks them per
// candidate move: a scan of the slots made it O(slots) on large meshes). The maps are looked up, never
// iterated.
struct GroupSlots {
  int G = 1;  // shard columns: a slot's column is slot % G
  std::vector<int> used;
  std::unordered_map<int, int> per_slot, per_column;
  int count(int slot) const {
    const auto it = per_slot.find(slot);
    return it == per_slot.end() ? 0 : it->second;
  }
  int column_count(int column) const {
    const auto it = per_column.find(column);
    return it == per_column.end() ? 0 : it->second;
  }
  int distinct() const { return static_cast<int>(used.size()); }
  void add(int slot) {
    ++per_column[slot % G];
    if (++per_slot[slot] == 1) used.push_back(slot);
  }
  void remove(int slot) {
    if (--per_column[slot % G] == 0) per_column.erase(slot % G);
    if (--per_slot[slot] == 0) {
      per_slot.erase(slot);
      used.erase(std::find(used.begin(), used.end(), slot));
    }
  }
};

struct GroupInfo {
  std::string name;
  int units = 0;
  int cap = 0;       // max distinct slots (max_owners_per_group, else S)
  int slot_cap = 1;  // max units of this group on one slot
  int col_cap = 1;   // preferred max units of this group in one shard column
};

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// A packing variant: how a group's small parameters form allocation units. kNoPacking: every
// parameter is its own unit (the per-matrix plan). kUncapped: all of a group's small parameters
// share one unit (the seed's packing). A finite cap C: a group's small parameters, in model
// order, are cut into k = ceil(T / C) consecutive runs of about T / k cost each (T = their total
// cost), so no packed unit costs more than C unless one parameter alone does.
constexpr double kNoPacking = -1.0;
constexpr double kUncapped = std::numeric_limits<double>::infinity();

double granularity_bound_of(std::vector<double> c, int S, double simple);

class Planner {
 public:
  Planner(const std::vector<ParamSpec>& params, int G, int R, ResolvedPlanOptions opts,
          double pack_cap)
      : params_(params), G_(G), R_(R), S_(G * R), opts_(std::move(opts)), pack_cap_(pack_cap) {}

  void build_units();
  // The unit partition (parameter indices per unit, units by first parameter): two variants with
  // the same partition give the same plan, so the search skips the second.
  std::vector<std::vector<int>> partition() const {
    std::vector<std::vector<int>> out;
    out.reserve(units_.size());
    for (const auto& u : units_) out.push_back(u.params);
    return out;
  }
  OwnerPlan run();  // after build_units()
  // The granularity floor of the units built (no assignment of them has a smaller makespan):
  // cheap, so the search rejects a hopeless packing variant without planning it.
  double unit_floor() const {
    std::vector<double> c;
    c.reserve(units_.size());
    double total = 0, largest = 0;
    for (const auto& u : units_) {
      c.push_back(u.cost);
      total += u.cost;
      largest = std::max(largest, u.cost);
    }
    return granularity_bound_of(std::move(c), S_, std::max(total / S_, largest));
  }

 private:
  void assign_lpt();
  void assign_round_robin();
  struct Move {
    int unit, from, to;
  };
  bool moves_feasible(const std::vector<Move>& moves) const;
  void refine(double floor);
  void finish(OwnerPlan& plan);
  std::vector<std::string> find_violations() const;
  uint64_t fingerprint(const OwnerPlan& plan) const;

  bool column_mode() const { return R_ > 1 && opts_.hsdp_column_balance; }
  void place(int u, int slot);
  void unplace(int u);
  void recompute_slot(int slot);
  // a better than b as a destination: less cost, then fewer bytes, then lower index.
  bool slot_less(int a, int b) const {
    if (b < 0) return true;
    if (load_[a] != load_[b]) return load_[a] < load_[b];
    if (bytes_[a] != bytes_[b]) return bytes_[a] < bytes_[b];
    return a < b;
  }
  // May unit u (group g) go to `slot`, leaving `from` (-1 = unplaced)?
  bool eligible(int g, int slot, int from) const {
    const GroupSlots& gs = gslots_[g];
    const int c = gs.count(slot);
    if (slot == from) return true;
    if (c >= groups_[g].slot_cap) return false;
    if (c == 0) {
      const int distinct_after = gs.distinct() - (from >= 0 && gs.count(from) == 1 ? 1 : 0) + 1;
      if (distinct_after > groups_[g].cap) return false;
    }
    return true;
  }

  const std::vector<ParamSpec>& params_;
  int G_, R_, S_;
  ResolvedPlanOptions opts_;
  double pack_cap_;

  std::vector<double> pcost_;
  std::vector<std::string> pgroup_;
  std::vector<GroupInfo> groups_;
  std::vector<AllocationUnit> units_;   // ordered by first parameter index
  std::vector<int> unit_group_;         // group id per unit
  std::vector<int> unit_slot_;          // slot per unit
  std::vector<GroupSlots> gslots_;
  std::vector<std::vector<int>> slot_units_;  // sorted unit ids per slot
  std::vector<double> load_;
  std::vector<int64_t> bytes_;
};

}  // namespace dmuon::detail
