// owner_plan.cpp -- the owner planner: allocation units, LPT with layer concurrency and HSDP
// column balance, a deterministic refinement pass, bounds, violations and the fingerprint.
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
#include <numeric>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dmuon/owner_plan.h"

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

// Costs are computed exactly in 128-bit integers and rounded to double once, so no compiler
// contraction (FMA) or evaluation order can make two machines disagree on them.
double param_cost(const ParamSpec& p, const ResolvedPlanOptions& opts) {
  using i128 = __int128;
  const int64_t numel = p.numel();
  const int64_t m = p.shape.size() >= 2 ? p.shape[0] : 1;
  const int64_t n = m > 0 ? numel / m : 0;
  if (opts.owner_cost_model == "numel") return static_cast<double>(numel);
  if (opts.owner_cost_model != "optimizer")
    throw std::invalid_argument("Invalid owner_cost_model: '" + opts.owner_cost_model +
                                "'. Must be one of: optimizer, numel.");
  const i128 s = std::min(m, n), b = std::max(m, n);
  i128 ns = 0;
  const bool overflow = __builtin_mul_overflow(b * s, static_cast<i128>(2), &ns) ||
                        __builtin_add_overflow(ns, static_cast<i128>(numel), &ns) ||
                        __builtin_mul_overflow(ns, s, &ns) ||
                        __builtin_mul_overflow(ns, static_cast<i128>(opts.ns_steps), &ns);
  if (overflow) {  // beyond any real tensor; fall back to double arithmetic
    const double sd = static_cast<double>(s), bd = static_cast<double>(b);
    return opts.ns_steps * sd * (static_cast<double>(numel) + 2.0 * bd * sd) +
           static_cast<double>(p.bytes());
  }
  return static_cast<double>(ns) + static_cast<double>(p.bytes());
}

// ---- planner internals --------------------------------------------------------------------
namespace detail {
namespace {

constexpr int kMaxSlots = 1 << 24;

// Slots used by one group: (slot, count) pairs, few per group.
struct GroupSlots {
  std::vector<std::pair<int, int>> used;
  int count(int slot) const {
    for (const auto& [s, c] : used)
      if (s == slot) return c;
    return 0;
  }
  int distinct() const { return static_cast<int>(used.size()); }
  void add(int slot) {
    for (auto& [s, c] : used)
      if (s == slot) { ++c; return; }
    used.emplace_back(slot, 1);
  }
  void remove(int slot) {
    for (size_t i = 0; i < used.size(); ++i)
      if (used[i].first == slot && --used[i].second == 0) {
        used.erase(used.begin() + static_cast<std::ptrdiff_t>(i));
        return;
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

int ceil_div(int a, int b) { return (a + b - 1) / b; }

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

void Planner::build_units() {
  const int P = static_cast<int>(params_.size());
  pcost_.resize(P);
  pgroup_.resize(P);
  std::map<std::string, int> group_id;  // ordered map: lookups only, ids by first appearance
  std::vector<std::vector<int>> members;
  for (int i = 0; i < P; ++i) {
    pcost_[i] = param_cost(params_[i], opts_);
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
  gslots_.assign(groups_.size(), {});
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
  std::vector<int> col_cnt(G_, 0);
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
      for (const auto& [sl, c] : gs.used) col_cnt[sl % G_] += c;
      auto better_col = [&](int pref_a, int a, int pref_b, int b) {
        if (b < 0) return true;
        if (pref_a != pref_b) return pref_a < pref_b;
        if (col_load[a] != col_load[b]) return col_load[a] < col_load[b];
        if (col_bytes[a] != col_bytes[b]) return col_bytes[a] < col_bytes[b];
        return a < b;
      };
      int best_col = -1, best_pref = 0;
      if (capped) {
        for (const auto& [sl, c] : gs.used) {
          if (!eligible(g, sl, -1)) continue;
          const int col = sl % G_, pref = col_cnt[col] < groups_[g].col_cap ? 0 : 1;
          if (best_col == col ? slot_less(sl, chosen) : better_col(pref, col, best_pref, best_col)) {
            best_col = col;
            best_pref = pref;
            chosen = sl;
          }
        }
      } else {
        for (const Key& ck : col_order) {
          const int col = std::get<2>(ck);
          const int pref = col_cnt[col] < groups_[g].col_cap ? 0 : 1;
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
      for (const auto& [sl, c] : gs.used) col_cnt[sl % G_] = 0;
    } else if (capped) {
      for (const auto& [sl, c] : gs.used)
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
        int dc = 0, cc = 0;  // change and current count of the group in this slot's column
        const int col = slot % G_;
        for (const auto& [s2, d2] : delta)
          if (s2 % G_ == col) dc += d2;
        if (dc <= 0) continue;
        for (const auto& [s2, c2] : gs.used)
          if (s2 % G_ == col) cc += c2;
        if (cc + dc > gi.col_cap) return false;
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
  std::vector<int> slot_cnt(S_, 0), col_cnt(G_, 0);
  auto coord = [&](int slot) {
    return "(" + std::to_string(slot % G_) + "," + std::to_string(slot / G_) + ")";
  };
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GroupInfo& gi = groups_[g];
    const GroupSlots& gs = gslots_[g];
    int worst_slot = -1, worst_col = -1;
    for (const auto& [s, c] : gs.used) {
      slot_cnt[s] = c;
      col_cnt[s % G_] += c;
      if (worst_slot < 0 || c > slot_cnt[worst_slot] || (c == slot_cnt[worst_slot] && s < worst_slot))
        worst_slot = s;
    }
    for (const auto& [s, c] : gs.used) {
      const int col = s % G_;
      if (worst_col < 0 || col_cnt[col] > col_cnt[worst_col] ||
          (col_cnt[col] == col_cnt[worst_col] && col < worst_col))
        worst_col = col;
    }
    if (worst_slot >= 0 && slot_cnt[worst_slot] > gi.slot_cap) {
      if (slot_conc.count++ == 0)
        slot_conc.text = "'" + gi.name + "' has " + std::to_string(slot_cnt[worst_slot]) +
                         " of its " + std::to_string(gi.units) + " units on slot " +
                         coord(worst_slot) + ", allowed " + std::to_string(gi.slot_cap);
    }
    if (column_mode() && worst_col >= 0 && col_cnt[worst_col] > gi.col_cap) {
      if (col_conc.count++ == 0)
        col_conc.text = "'" + gi.name + "' has " + std::to_string(col_cnt[worst_col]) +
                        " of its " + std::to_string(gi.units) + " units in shard column " +
                        std::to_string(worst_col) + ", allowed " + std::to_string(gi.col_cap);
    }
    if (gs.distinct() > gi.cap) {
      if (cap.count++ == 0)
        cap.text = "'" + gi.name + "' uses " + std::to_string(gs.distinct()) +
                   " distinct slots, cap " + std::to_string(gi.cap);
    }
    for (const auto& [s, c] : gs.used) {
      slot_cnt[s] = 0;
      col_cnt[s % G_] = 0;
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

// FNV-1a 64 over a canonical little-endian serialization.
class Fnv1a {
 public:
  void bytes(const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
      h_ ^= c[i];
      h_ *= 0x100000001b3ULL;
    }
  }
  void u64(uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    bytes(b, 8);
  }
  void i64(int64_t v) { u64(static_cast<uint64_t>(v)); }
  void str(const std::string& s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ULL;
};

uint64_t Planner::fingerprint(const OwnerPlan& plan) const {
  Fnv1a h;
  h.str("dmuon.owner_plan.v1");
  h.i64(G_);
  h.i64(R_);
  h.str(opts_.owner_strategy);
  h.str(opts_.owner_cost_model);
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
  if (opts_.owner_strategy == "lpt") {
    assign_lpt();
    double total = 0, largest = 0;
    std::vector<double> c;
    for (const auto& u : units_) {
      total += u.cost;
      largest = std::max(largest, u.cost);
      c.push_back(u.cost);
    }
    refine(granularity_bound_of(std::move(c), S_, std::max(total / S_, largest)));
  } else if (opts_.owner_strategy == "round_robin") {
    assign_round_robin();
  } else if (opts_.owner_strategy == "rank0") {
    for (size_t u = 0; u < units_.size(); ++u) place(static_cast<int>(u), 0);
  } else {
    throw std::invalid_argument("Invalid owner_strategy: '" + opts_.owner_strategy +
                                "'. Must be one of: lpt, round_robin, rank0.");
  }
  OwnerPlan plan;
  plan.shard_size = G_;
  plan.replicate_size = R_;
  plan.options = opts_;
  finish(plan);
  return plan;
}

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
  for (const ParamSpec& p : params) {
    const double c = param_cost(p, opts);
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
