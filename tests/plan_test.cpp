// plan_test -- the owner planner, the comm plan and the model specs (no LibTorch, shapes only).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "dmuon/tools/model_specs.h"
#include "dmuon/ns_profile.h"
#include "dmuon/owner_plan.h"
#include "dmuon/tools/step_simulator.h"

namespace dmuon {
namespace {

ParamSpec P(const std::string& name, std::vector<int64_t> shape, int64_t eb = 2,
            const std::string& group = "") {
  ParamSpec p;
  p.name = name;
  p.shape = std::move(shape);
  p.elem_bytes = eb;
  p.group_key = group;
  return p;
}

std::vector<ParamSpec> muon(const std::string& preset) {
  return select_muon_params(model_preset(preset));
}

// Clears the planner's environment overrides for the test's duration and restores them after.
class EnvGuard {
 public:
  EnvGuard() {
    for (const char* v : kVars) {
      const char* cur = std::getenv(v);
      saved_.emplace_back(v, cur ? std::optional<std::string>(cur) : std::nullopt);
      ::unsetenv(v);
    }
  }
  ~EnvGuard() {
    for (const auto& [k, v] : saved_) {
      if (v) ::setenv(k.c_str(), v->c_str(), 1);
      else ::unsetenv(k.c_str());
    }
  }
  static constexpr const char* kVars[] = {"DMUON_OWNER_STRATEGY", "DMUON_OWNER_COST_MODEL",
                                          "DMUON_HSDP_COLUMN_BALANCE",
                                          "DMUON_OWNER_PACK_SMALL_PARAMS", "DMUON_NS_PROFILE"};

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// Structural invariants every plan satisfies, whatever the strategy.
void ExpectWellFormed(const std::vector<ParamSpec>& params, const OwnerPlan& plan) {
  const int G = plan.shard_size, R = plan.replicate_size;
  ASSERT_EQ(plan.owners.size(), params.size());
  ASSERT_EQ(plan.groups.size(), params.size());
  ASSERT_EQ(plan.unit_of_param.size(), params.size());
  ASSERT_EQ(static_cast<int>(plan.slots.size()), G * R);
  // Every parameter is in exactly one unit, and its owner is that unit's owner.
  std::vector<int> seen(params.size(), 0);
  double total = 0;
  int64_t bytes = 0;
  const std::vector<double> pc = param_costs(params, plan.options, G * R);
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const AllocationUnit& unit = plan.units[u];
    ASSERT_FALSE(unit.params.empty());
    ASSERT_TRUE(std::is_sorted(unit.params.begin(), unit.params.end()));
    double c = 0;
    for (int i : unit.params) {
      ++seen[i];
      EXPECT_EQ(plan.unit_of_param[i], static_cast<int>(u));
      EXPECT_EQ(plan.owners[i], unit.owner);
      EXPECT_EQ(plan.groups[i], unit.group);
      c += pc[static_cast<size_t>(i)];
    }
    EXPECT_NEAR(unit.cost, c, 1e-9 * std::max(1.0, c));
    total += unit.cost;
    bytes += unit.bytes;
    if (u > 0) {
      EXPECT_LT(plan.units[u - 1].params.front(), unit.params.front());
    }
  }
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(seen[i], 1) << params[i].name;
  for (const OwnerCoord& o : plan.owners) {
    EXPECT_GE(o.shard, 0);
    EXPECT_LT(o.shard, G);
    EXPECT_GE(o.replicate, 0);
    EXPECT_LT(o.replicate, R);
  }
  // Slot loads add up, and the bounds are what the header says.
  double slot_total = 0, makespan = 0, largest = 0;
  int64_t slot_bytes = 0;
  int units = 0, nparams = 0;
  for (int s = 0; s < G * R; ++s) {
    const SlotLoad& sl = plan.slots[s];
    EXPECT_EQ(OwnerPlan::slot_index(sl.owner, G), s);
    slot_total += sl.cost;
    slot_bytes += sl.bytes;
    units += sl.units;
    nparams += sl.params;
    makespan = std::max(makespan, sl.cost);
  }
  // The lower bound is over single parameters, not packed units (a packed unit above
  // total / slots is the packing's cost, which imbalance() must show).
  for (const auto& p : params) largest = std::max(largest, param_cost(p, plan.options));
  EXPECT_DOUBLE_EQ(plan.largest_param_cost, largest);
  EXPECT_NEAR(slot_total, total, 1e-9 * std::max(1.0, total));
  EXPECT_EQ(slot_bytes, bytes);
  EXPECT_EQ(plan.total_bytes, bytes);
  EXPECT_EQ(units, static_cast<int>(plan.units.size()));
  EXPECT_EQ(nparams, static_cast<int>(params.size()));
  EXPECT_DOUBLE_EQ(plan.makespan, makespan);
  EXPECT_DOUBLE_EQ(plan.lower_bound, std::max(plan.total_cost / (G * R), largest));
  EXPECT_GE(plan.granularity_bound, plan.lower_bound);
  EXPECT_GE(plan.makespan, plan.granularity_bound * (1 - 1e-12));
}

// Per group: units, distinct slots, max units on one slot, max units in one shard column.
struct GroupUse {
  int units = 0;
  std::map<int, int> per_slot, per_col;
};
std::map<std::string, GroupUse> group_use(const OwnerPlan& plan) {
  std::map<std::string, GroupUse> out;
  for (const auto& u : plan.units) {
    GroupUse& g = out[u.group];
    ++g.units;
    ++g.per_slot[OwnerPlan::slot_index(u.owner, plan.shard_size)];
    ++g.per_col[u.owner.shard];
  }
  return out;
}
int max_count(const std::map<int, int>& m) {
  int x = 0;
  for (const auto& [k, v] : m) x = std::max(x, v);
  return x;
}

// ---- names, costs, options ------------------------------------------------------------------

TEST(OwnerPlanTest, LayerKeyOfTable) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"model.layers.3.self_attn.q_proj.weight", "model.layers.3"},
      {"visual.blocks.5.attn.qkv.weight", "visual.blocks.5"},
      {"layers.0.w", "layers.0"},
      {"blocks.12", "blocks.12"},
      {"transformer.h.7.attn.c_attn.weight", "transformer.h.7"},
      {"bert.encoder.layer.11.attention.self.query.weight", "bert.encoder.layer.11"},
      {"a.layers.2.blocks.1.w", "a.layers.2"},        // outermost match
      {"model.h.3.layers.1.w", "model.h.3.layers.1"},  // primary pattern beats h.N
      {"model.layers.x.w", ""},
      {"model.layers", ""},
      {"model.layers3.w", ""},
      {"lm_head.weight", ""},
      {"model.embed_tokens.weight", ""},
      {"", ""},
  };
  for (const auto& [name, key] : cases) EXPECT_EQ(layer_key_of(name), key) << name;
  EXPECT_EQ(default_boundary_of("lm_head.weight"), "lm_head.weight");
  EXPECT_EQ(assignment_group_of(P("model.layers.1.w", {2, 2})), "model.layers.1");
  EXPECT_EQ(assignment_group_of(P("model.layers.1.w", {2, 2}, 2, "custom")), "custom");
  EXPECT_EQ(assignment_group_of(P("proj.weight", {2, 2})), "proj.weight");
}

TEST(OwnerPlanTest, CostModelsMatchTheFormula) {
  ResolvedPlanOptions opt;  // optimizer, 5 steps
  const ParamSpec sq = P("sq", {4096, 4096});
  const double s = 4096, mn = 4096.0 * 4096;
  EXPECT_DOUBLE_EQ(param_cost(sq, opt), 5 * s * (mn + 2 * s * s) + 2 * mn);
  // Rectangular: s = min, b = max, orientation does not matter.
  const ParamSpec wide = P("wide", {1024, 14336}), tall = P("tall", {14336, 1024});
  const double w = 5 * 1024.0 * (1024.0 * 14336 + 2 * 14336.0 * 1024) + 2 * 1024.0 * 14336;
  EXPECT_DOUBLE_EQ(param_cost(wide, opt), w);
  EXPECT_DOUBLE_EQ(param_cost(tall, opt), w);
  // >2-D flattens to shape[0] x rest; 1-D is 1 x n.
  EXPECT_DOUBLE_EQ(param_cost(P("conv", {8, 3, 3, 3}, 4), opt),
                   5 * 8.0 * (8 * 27 + 2 * 27.0 * 8) + 4 * 216);
  EXPECT_DOUBLE_EQ(param_cost(P("vec", {100}), opt), 5 * 1.0 * (100 + 2 * 100.0) + 200);
  // ns_steps scales the NS part; the byte term separates equal-FLOP tensors of different dtypes.
  ResolvedPlanOptions three = opt;
  three.ns_steps = 3;
  EXPECT_DOUBLE_EQ(param_cost(sq, three), 3 * s * (mn + 2 * s * s) + 2 * mn);
  EXPECT_GT(param_cost(P("f32", {4096, 4096}, 4), opt), param_cost(sq, opt));
  ResolvedPlanOptions numel = opt;
  numel.cost_model = owner_cost_model("numel");
  EXPECT_DOUBLE_EQ(param_cost(sq, numel), mn);
  EXPECT_DOUBLE_EQ(param_cost(P("f32", {4096, 4096}, 4), numel), mn);
}

TEST(OwnerPlanTest, ResolveOptionsExplicitBeatsEnvironmentBeatsDefault) {
  EnvGuard env;
  ResolvedPlanOptions d = resolve_plan_options({});
  EXPECT_EQ(d.owner_strategy, OwnerStrategy::Lpt);
  EXPECT_STREQ(d.cost_model->name(), "optimizer");
  EXPECT_TRUE(d.hsdp_column_balance);
  EXPECT_TRUE(d.pack_small_params);
  EXPECT_FALSE(d.max_owners_per_group.has_value());
  EXPECT_EQ(d.pack_threshold_numel, 5'000'000);

  ::setenv("DMUON_OWNER_STRATEGY", "round_robin", 1);
  ::setenv("DMUON_OWNER_COST_MODEL", "numel", 1);
  ::setenv("DMUON_HSDP_COLUMN_BALANCE", "0", 1);
  ::setenv("DMUON_OWNER_PACK_SMALL_PARAMS", "false", 1);
  ResolvedPlanOptions e = resolve_plan_options({});
  EXPECT_EQ(e.owner_strategy, OwnerStrategy::RoundRobin);
  EXPECT_STREQ(e.cost_model->name(), "numel");
  EXPECT_FALSE(e.hsdp_column_balance);
  EXPECT_FALSE(e.pack_small_params);

  PlanOptions explicit_opts;
  explicit_opts.owner_strategy = "rank0";
  explicit_opts.owner_cost_model = "optimizer";
  explicit_opts.hsdp_column_balance = true;
  explicit_opts.pack_small_params = true;
  ResolvedPlanOptions x = resolve_plan_options(explicit_opts);
  EXPECT_EQ(x.owner_strategy, OwnerStrategy::Rank0);
  EXPECT_STREQ(x.cost_model->name(), "optimizer");
  EXPECT_TRUE(x.hsdp_column_balance);
  EXPECT_TRUE(x.pack_small_params);

  // The environment reaches plan_owners too.
  const auto plan = plan_owners({P("a.w", {64, 64}), P("b.w", {64, 64})}, 2, 1);
  EXPECT_EQ(plan.options.owner_strategy, OwnerStrategy::RoundRobin);
}

TEST(OwnerPlanTest, BadOptionsNameTheFieldAndValue) {
  EnvGuard env;
  auto msg = [](const PlanOptions& o) {
    try {
      resolve_plan_options(o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  PlanOptions o;
  o.owner_strategy = "greedy";
  EXPECT_NE(msg(o).find("owner_strategy: 'greedy'"), std::string::npos) << msg(o);
  o = {};
  o.owner_cost_model = "flops";
  EXPECT_NE(msg(o).find("owner_cost_model: 'flops'"), std::string::npos) << msg(o);
  o = {};
  o.max_owners_per_group = 0;
  EXPECT_NE(msg(o).find("max_owners_per_group: 0"), std::string::npos) << msg(o);
  o = {};
  o.ns_steps = 0;
  EXPECT_NE(msg(o).find("ns_steps: 0"), std::string::npos) << msg(o);
  ::setenv("DMUON_OWNER_STRATEGY", "fastest", 1);
  EXPECT_NE(msg({}).find("DMUON_OWNER_STRATEGY: 'fastest'"), std::string::npos) << msg({});
  ::unsetenv("DMUON_OWNER_STRATEGY");
  ::setenv("DMUON_OWNER_PACK_SMALL_PARAMS", "maybe", 1);
  EXPECT_NE(msg({}).find("DMUON_OWNER_PACK_SMALL_PARAMS"), std::string::npos) << msg({});
}

TEST(OwnerPlanTest, BadInputsThrowWithTheOffendingValue) {
  EnvGuard env;
  auto msg = [](const std::vector<ParamSpec>& ps, int G, int R) {
    try {
      plan_owners(ps, G, R);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  const std::vector<ParamSpec> ok = {P("a.w", {4, 4})};
  EXPECT_NE(msg(ok, 0, 1).find("G must be >= 1, got 0"), std::string::npos) << msg(ok, 0, 1);
  EXPECT_NE(msg(ok, 4, -1).find("R must be >= 1, got -1"), std::string::npos) << msg(ok, 4, -1);
  EXPECT_NE(msg({P("a.w", {4, 0})}, 2, 1).find("[4, 0]"), std::string::npos);
  EXPECT_NE(msg({P("a.w", {-3, 4})}, 2, 1).find("[-3, 4]"), std::string::npos);
  EXPECT_NE(msg({P("a.w", {})}, 2, 1).find("empty shape"), std::string::npos);
  EXPECT_NE(msg({P("a.w", {4, 4}), P("a.w", {2, 2})}, 2, 1).find("repeats the name"),
            std::string::npos);
  EXPECT_NE(msg({P("", {4, 4})}, 2, 1).find("empty name"), std::string::npos);
  EXPECT_NE(msg({P("a.w", {4, 4}, 0)}, 2, 1).find("elem_bytes 0"), std::string::npos);
}

// ---- structure and balance --------------------------------------------------------------------

struct GridCase {
  std::string preset;
  int G, R;
};

TEST(OwnerPlanTest, EveryParamHasExactlyOneOwnerOnEveryPresetAndGrid) {
  EnvGuard env;
  const std::vector<GridCase> cases = {
      {"gpt2-small", 8, 1},   {"gpt2-xl", 64, 1},    {"llama3-8b", 8, 1},
      {"llama3-8b", 64, 1},   {"llama3-8b", 8, 4},   {"llama3-70b", 512, 1},
      {"qwen2.5-7b", 16, 2},  {"mixtral-8x7b", 8, 1}, {"mixtral-8x7b", 32, 2},
      {"vit-l16", 8, 1},      {"vit-l16", 5, 3},     {"llama3-405b", 4096, 1}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.preset + " " + std::to_string(c.G) + "x" + std::to_string(c.R));
    const auto params = muon(c.preset);
    for (const char* strategy : {"lpt", "round_robin", "rank0"}) {
      PlanOptions o;
      o.owner_strategy = strategy;
      const OwnerPlan plan = plan_owners(params, c.G, c.R, o);
      ExpectWellFormed(params, plan);
      if (std::string(strategy) == "lpt") {
        EXPECT_TRUE(plan.violations.empty()) << plan.violations.front();
      }
    }
  }
}

TEST(OwnerPlanTest, Llama3_8B_ImbalanceAtG8IsWithinTarget) {
  EnvGuard env;
  const auto plan = plan_owners(muon("llama3-8b"), 8, 1);
  EXPECT_EQ(plan.units.size(), 192u);  // 32 layers x (q, o, {k,v} packed, gate, up, down)
  EXPECT_LE(plan.imbalance(), 1.05);
  EXPECT_LE(plan.imbalance(), 1.001);  // what LPT + refinement reaches today
}

TEST(OwnerPlanTest, Llama3_8B_AtG64IsBoundByTheMlpMatrices) {
  EnvGuard env;
  const auto params = muon("llama3-8b");
  const auto plan = plan_owners(params, 64, 1);
  // 96 MLP matrices on 64 slots: some slot holds two, so no plan beats 2 * c(MLP).
  const double c_mlp = param_cost(params[4], plan.options);  // layer 0 gate_proj
  ASSERT_EQ(params[4].name, "model.layers.0.mlp.gate_proj.weight");
  EXPECT_DOUBLE_EQ(plan.granularity_bound, 2 * c_mlp);
  EXPECT_NEAR(plan.granularity_bound / plan.lower_bound, 1.1089, 1e-3);  // > 1.05: impossible
  EXPECT_DOUBLE_EQ(plan.makespan, plan.granularity_bound);              // LPT reaches the floor
  EXPECT_TRUE(plan.violations.empty());
}

TEST(OwnerPlanTest, LptIsNearTheFloorOnPresetTables) {
  EnvGuard env;
  // (preset, G, R, max makespan / granularity_bound) -- measured values with a little slack.
  const std::vector<std::tuple<std::string, int, int, double>> cases = {
      {"llama3-8b", 8, 1, 1.001},    {"llama3-8b", 8, 4, 1.001},  {"llama3-8b", 8, 8, 1.001},
      {"llama3-70b", 8, 1, 1.001},   {"llama3-70b", 64, 1, 1.03}, {"qwen2.5-7b", 8, 1, 1.01},
      {"mixtral-8x7b", 8, 1, 1.001}, {"mixtral-8x7b", 64, 1, 1.01}, {"vit-l16", 8, 1, 1.001},
      {"gpt2-xl", 8, 1, 1.001},      {"llama3-405b", 64, 1, 1.02}, {"llama3-405b", 4096, 1, 1.0},
      // 48 x (2 MLP + attn.c_proj) + 16 x (3 c_attn) is perfect; needs the refinement's chains.
      {"gpt2-xl", 64, 1, 1.001},     {"gpt2-xl", 8, 8, 1.001}};
  for (const auto& [preset, G, R, limit] : cases) {
    const auto plan = plan_owners(muon(preset), G, R);
    EXPECT_LE(plan.granularity_imbalance(), limit) << preset << " " << G << "x" << R;
  }
}

TEST(OwnerPlanTest, LptBeatsRoundRobinOnLlama) {
  EnvGuard env;
  const auto params = muon("llama3-70b");
  PlanOptions rr;
  rr.owner_strategy = "round_robin";
  // At G = 8 both are within 0.1% of the bound (7 units per layer rotate well); beyond, LPT wins.
  EXPECT_LE(plan_owners(params, 8, 1).imbalance(), 1.001);
  EXPECT_LE(plan_owners(params, 8, 1, rr).imbalance(), 1.001);
  for (int G : {64, 512}) {
    const auto lpt = plan_owners(params, G, 1);
    const auto rrp = plan_owners(params, G, 1, rr);
    EXPECT_LT(lpt.makespan, 0.9 * rrp.makespan) << G;
  }
  EXPECT_GT(plan_owners(params, 512, 1, rr).imbalance(), 1.9);  // two MLP mats on one slot
  EXPECT_DOUBLE_EQ(plan_owners(params, 512, 1).imbalance(), 1.0);
}

TEST(OwnerPlanTest, SameLayerUnitsUseDistinctSlotsWhenTheyFit) {
  EnvGuard env;
  for (const auto& c : std::vector<GridCase>{{"llama3-8b", 8, 1},
                                             {"llama3-8b", 64, 1},
                                             {"llama3-70b", 8, 1},
                                             {"gpt2-xl", 4, 1},
                                             {"qwen2.5-7b", 6, 1},
                                             {"llama3-8b", 4, 2}}) {
    const auto plan = plan_owners(muon(c.preset), c.G, c.R);
    const int S = c.G * c.R;
    for (const auto& [name, use] : group_use(plan)) {
      if (use.units <= S) {
        EXPECT_EQ(static_cast<int>(use.per_slot.size()), use.units) << c.preset << " " << name;
      } else {
        EXPECT_LE(max_count(use.per_slot), (use.units + S - 1) / S) << c.preset << " " << name;
      }
    }
  }
}

TEST(OwnerPlanTest, LayersWithMoreUnitsThanSlotsSpreadEvenly) {
  EnvGuard env;
  // Mixtral: 24 expert matrices + q + o + {k, v, router} = 27 units per layer on 8 slots.
  const auto plan = plan_owners(muon("mixtral-8x7b"), 8, 1);
  const auto use = group_use(plan);
  ASSERT_EQ(use.size(), 32u);
  for (const auto& [name, u] : use) {
    EXPECT_EQ(u.units, 27) << name;
    EXPECT_EQ(u.per_slot.size(), 8u) << name;
    EXPECT_LE(max_count(u.per_slot), 4) << name;  // ceil(27 / 8)
  }
  EXPECT_LE(plan.imbalance(), 1.001);
}

TEST(OwnerPlanTest, HsdpColumnBalanceSpreadsLayersOverShardColumns) {
  EnvGuard env;
  const auto params = muon("llama3-8b");
  const auto plan = plan_owners(params, 8, 4);
  ASSERT_EQ(plan.column_cost.size(), 8u);
  // Each layer's 6 units sit in 6 distinct shard columns (distinct broadcast roots in every
  // replicate group), and the columns carry equal load.
  for (const auto& [name, use] : group_use(plan)) EXPECT_EQ(use.per_col.size(), 6u) << name;
  const double mean = plan.total_cost / 8;
  for (double c : plan.column_cost) EXPECT_NEAR(c / mean, 1.0, 0.005);
  EXPECT_LE(plan.imbalance(), 1.001);

  PlanOptions off;
  off.hsdp_column_balance = false;
  const auto ablation = plan_owners(params, 8, 4, off);
  ExpectWellFormed(params, ablation);
  EXPECT_NE(ablation.fingerprint, plan.fingerprint);
  // Without column balance, only slot-level concurrency is promised.
  for (const auto& [name, use] : group_use(ablation)) EXPECT_EQ(use.per_slot.size(), 6u);
}

TEST(OwnerPlanTest, MoreSlotsThanUnits) {
  EnvGuard env;
  const std::vector<ParamSpec> ps = {P("a.w", {4096, 4096}), P("b.w", {1024, 4096}),
                                     P("c.w", {8192, 8192})};
  const auto plan = plan_owners(ps, 8, 1);
  ExpectWellFormed(ps, plan);
  std::set<int> used;
  for (const auto& o : plan.owners) used.insert(o.shard);
  EXPECT_EQ(used.size(), 3u);
  int empty = 0;
  for (const auto& s : plan.slots) empty += s.units == 0;
  EXPECT_EQ(empty, 5);
  EXPECT_DOUBLE_EQ(plan.makespan, param_cost(ps[2], plan.options));
  EXPECT_DOUBLE_EQ(plan.imbalance(), 1.0);
  EXPECT_EQ(plan.owners[2], (OwnerCoord{0, 0}));  // the largest goes first, to slot 0
}

TEST(OwnerPlanTest, OneSlotOwnsEverything) {
  EnvGuard env;
  const auto params = muon("llama3-8b");
  const auto plan = plan_owners(params, 1, 1);
  ExpectWellFormed(params, plan);
  for (const auto& o : plan.owners) EXPECT_EQ(o, (OwnerCoord{0, 0}));
  EXPECT_DOUBLE_EQ(plan.makespan, plan.total_cost);
  EXPECT_DOUBLE_EQ(plan.imbalance(), 1.0);
  EXPECT_TRUE(plan.violations.empty());
}

TEST(OwnerPlanTest, OneUnitLargerThanTotalOverSlots) {
  EnvGuard env;
  std::vector<ParamSpec> ps = {P("big.w", {8192, 8192})};
  for (int i = 0; i < 12; ++i) ps.push_back(P("small" + std::to_string(i) + ".w", {2048, 2048}));
  const auto plan = plan_owners(ps, 4, 1);
  ExpectWellFormed(ps, plan);
  const double big = param_cost(ps[0], plan.options);
  EXPECT_GT(big, plan.total_cost / 4);
  EXPECT_DOUBLE_EQ(plan.lower_bound, big);
  EXPECT_DOUBLE_EQ(plan.makespan, big);  // the big one alone; the rest fit elsewhere
  const int big_slot = OwnerPlan::slot_index(plan.owners[0], 4);
  EXPECT_EQ(plan.slots[big_slot].units, 1);
}

TEST(OwnerPlanTest, EmptyParameterListGivesAnEmptyPlan) {
  EnvGuard env;
  const auto plan = plan_owners({}, 4, 2);
  EXPECT_EQ(plan.slots.size(), 8u);
  EXPECT_TRUE(plan.units.empty());
  EXPECT_DOUBLE_EQ(plan.makespan, 0.0);
  EXPECT_DOUBLE_EQ(plan.imbalance(), 1.0);
  EXPECT_NE(plan.fingerprint, 0u);
}

TEST(OwnerPlanTest, MoePresetHasPerExpertMatricesAndPacksTheRouter) {
  EnvGuard env;
  const auto params = muon("mixtral-8x7b");
  EXPECT_EQ(params.size(), 32u * 29u);  // q k v o router + 8 x (w1 w2 w3)
  const auto plan = plan_owners(params, 8, 1);
  // Layer 0: k_proj, v_proj and the router gate (all < 5M elements) share one unit.
  const AllocationUnit& u = plan.units[plan.unit_of_param[1]];
  ASSERT_EQ(u.params.size(), 3u);
  EXPECT_EQ(params[u.params[0]].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(params[u.params[1]].name, "model.layers.0.self_attn.v_proj.weight");
  EXPECT_EQ(params[u.params[2]].name, "model.layers.0.block_sparse_moe.gate.weight");
  EXPECT_EQ(params[5].name, "model.layers.0.block_sparse_moe.experts.0.w1.weight");
  EXPECT_EQ(params[5].shape, (std::vector<int64_t>{14336, 4096}));
}

TEST(OwnerPlanTest, VitBlocksAreGroupsAndSmallMatricesPack) {
  EnvGuard env;
  const auto params = muon("vit-l16");
  ASSERT_EQ(params.size(), 96u);  // qkv, proj, fc1, fc2 per block; no patch_embed/head
  const auto plan = plan_owners(params, 8, 1);
  EXPECT_EQ(plan.units.size(), 24u);  // every ViT-L matrix is < 5M elements
  for (const auto& u : plan.units) {
    EXPECT_EQ(u.params.size(), 4u);
    EXPECT_EQ(u.group.rfind("blocks.", 0), 0u) << u.group;
  }
  EXPECT_DOUBLE_EQ(plan.imbalance(), 1.0);  // 24 equal units on 8 slots
  PlanOptions nopack;
  nopack.pack_small_params = false;
  const auto unpacked = plan_owners(params, 8, 1, nopack);
  EXPECT_EQ(unpacked.units.size(), 96u);
  for (const auto& [name, use] : group_use(unpacked)) EXPECT_EQ(use.per_slot.size(), 4u);
}

TEST(OwnerPlanTest, NamesWithNoLayerAreTheirOwnGroupsAndNeverPack) {
  EnvGuard env;
  const std::vector<ParamSpec> ps = {P("encoder.proj.weight", {64, 64}),
                                     P("decoder.out.weight", {64, 64}),
                                     P("adapter.weight", {32, 64}),
                                     P("model.layers.0.a.weight", {64, 64}),
                                     P("model.layers.0.b.weight", {64, 64})};
  // 2 slots: packing the layer's two matrices costs nothing here, so it is kept (on 4 slots the
  // packed pair would be the makespan, 1.6x the per-matrix plan's, and packing is dropped).
  const auto plan = plan_owners(ps, 2, 1);
  ExpectWellFormed(ps, plan);
  EXPECT_EQ(plan.groups[0], "encoder.proj.weight");
  EXPECT_EQ(plan.groups[2], "adapter.weight");
  EXPECT_EQ(plan.groups[3], "model.layers.0");
  ASSERT_EQ(plan.units.size(), 4u);  // three loners + one packed layer unit
  EXPECT_EQ(plan.units[3].params, (std::vector<int>{3, 4}));
  EXPECT_NE(plan.unit_of_param[0], plan.unit_of_param[1]);
}

TEST(OwnerPlanTest, CallerGroupKeyOverridesTheLayer) {
  EnvGuard env;
  const std::vector<ParamSpec> ps = {P("model.layers.0.w", {64, 64}, 2, "stage0"),
                                     P("model.layers.1.w", {64, 64}, 2, "stage0"),
                                     P("model.layers.2.w", {64, 64})};
  // One slot: packing is free, so it is kept (on 4 slots the packed pair would cost 2x).
  const auto plan = plan_owners(ps, 1, 1);
  EXPECT_EQ(plan.groups[0], "stage0");
  EXPECT_EQ(plan.groups[2], "model.layers.2");
  EXPECT_EQ(plan.unit_of_param[0], plan.unit_of_param[1]);  // packed by the caller's key
  EXPECT_NE(plan.unit_of_param[0], plan.unit_of_param[2]);
}

TEST(OwnerPlanTest, PackingThresholdIsExclusive) {
  EnvGuard env;
  // 4,999,000 elements is small, 5,000,000 is not (the default threshold).
  const std::vector<ParamSpec> ps = {
      P("layers.0.a", {1000, 4999}), P("layers.0.b", {1000, 5000}), P("layers.0.c", {10, 10}),
      P("layers.0.d", {1000, 5001})};
  const auto plan = plan_owners(ps, 4, 1);
  EXPECT_EQ(plan.unit_of_param[0], plan.unit_of_param[2]);  // a + c packed
  EXPECT_NE(plan.unit_of_param[0], plan.unit_of_param[1]);
  EXPECT_NE(plan.unit_of_param[1], plan.unit_of_param[3]);
  EXPECT_EQ(plan.units.size(), 3u);

  PlanOptions t;
  t.pack_threshold_numel = 100;
  const std::vector<ParamSpec> qs = {P("layers.0.a", {9, 11}), P("layers.0.b", {10, 10}),
                                     P("layers.0.c", {1, 99})};
  const auto q = plan_owners(qs, 4, 1, t);
  EXPECT_EQ(q.unit_of_param[0], q.unit_of_param[2]);  // 99 < 100
  EXPECT_NE(q.unit_of_param[0], q.unit_of_param[1]);  // 100 is not < 100
  t.pack_threshold_numel = 0;
  EXPECT_EQ(plan_owners(qs, 4, 1, t).units.size(), 3u);  // nothing is < 0
  t.pack_threshold_numel = 100;
  t.pack_small_params = false;
  EXPECT_EQ(plan_owners(qs, 4, 1, t).units.size(), 3u);
}

TEST(OwnerPlanTest, MaxOwnersPerGroupCapsDistinctSlots) {
  EnvGuard env;
  const auto params = muon("llama3-8b");
  PlanOptions o;
  o.max_owners_per_group = 2;
  for (const char* strategy : {"lpt", "round_robin"}) {
    o.owner_strategy = strategy;
    const auto plan = plan_owners(params, 8, 1, o);
    ExpectWellFormed(params, plan);
    for (const auto& [name, use] : group_use(plan)) {
      EXPECT_LE(use.per_slot.size(), 2u) << strategy << " " << name;
      // ceil(units / 2): 6 units with k/v packed, 7 when packing would cost more than 1%.
      EXPECT_LE(max_count(use.per_slot), (use.units + 1) / 2) << strategy << " " << name;
    }
    EXPECT_TRUE(plan.violations.empty()) << strategy;
  }
}

TEST(OwnerPlanTest, Llama3_70B_AtG64IsOptimalAboveTheFloor) {
  EnvGuard env;
  // 240 MLP matrices on 64 slots put 4 on at least 48 slots; the 160 q/o matrices then cannot all
  // stay under the mean, so 4 MLP + 2 q/o (+ k/v) is optimal: 1.021 although the floor says 1.0.
  const auto params = muon("llama3-70b");
  const auto plan = plan_owners(params, 64, 1);
  const double mlp = param_cost(params[4], plan.options), q = param_cost(params[0], plan.options);
  ASSERT_EQ(params[4].name, "model.layers.0.mlp.gate_proj.weight");
  EXPECT_GE(plan.makespan, 4 * mlp + 2 * q);
  EXPECT_LE(plan.imbalance(), 1.0215);
  EXPECT_LE(plan.makespan / (4 * mlp + 2 * q), 1.001);
}

// ---- packing never makes a plan worse (issue 11, section 5) ------------------------------------

// A DeepSeek-V2-Lite-like MoE: 27 layers of q/o attention and 64 experts x (gate, up, down)
// [1408, 2048], every matrix under the 5M-element packing threshold.
std::vector<ParamSpec> moe_like(int layers = 27, int experts = 64) {
  std::vector<ParamSpec> ps;
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    ps.push_back(P(p + "self_attn.q_proj.weight", {2048, 2048}));
    ps.push_back(P(p + "self_attn.o_proj.weight", {2048, 2048}));
    for (int e = 0; e < experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      ps.push_back(P(x + "gate_proj.weight", {1408, 2048}));
      ps.push_back(P(x + "up_proj.weight", {1408, 2048}));
      ps.push_back(P(x + "down_proj.weight", {2048, 1408}));
    }
  }
  return ps;
}

TEST(OwnerPlanTest, PackingNeverCostsMoreThanOnePercentOnAnMoe) {
  EnvGuard env;
  const auto ps = moe_like();
  PlanOptions off;
  off.pack_small_params = false;
  const auto plan = plan_owners(ps, 64, 1);
  const auto per_matrix = plan_owners(ps, 64, 1, off);
  ExpectWellFormed(ps, plan);
  // Packing each layer into one unit gave 27 units on 64 slots: 2.3x the per-matrix makespan.
  EXPECT_LE(plan.makespan, 1.01 * per_matrix.makespan);
  EXPECT_LE(per_matrix.imbalance(), 1.005);
  EXPECT_LE(plan.imbalance(), 1.011);
  // The bound is over single matrices, so a bad packing would show in imbalance().
  double largest = 0;
  for (const auto& p : ps) largest = std::max(largest, param_cost(p, plan.options));
  EXPECT_DOUBLE_EQ(plan.lower_bound, std::max(plan.total_cost / 64, largest));
  EXPECT_DOUBLE_EQ(plan.lower_bound, plan.total_cost / 64);
  // Packing is still used, in capped units: far fewer units than matrices, none above total / S.
  EXPECT_GT(plan.packed_units, 0);
  EXPECT_LT(plan.units.size(), ps.size() / 2);
  EXPECT_GT(plan.pack_cap, 0.0);
  EXPECT_LE(plan.pack_cap, plan.lower_bound);
  for (const auto& u : plan.units) EXPECT_LE(u.cost, plan.pack_cap * (1 + 1e-9));
  EXPECT_DOUBLE_EQ(plan.per_matrix_makespan, per_matrix.makespan);
  EXPECT_TRUE(plan.violations.empty());
  // Where packing whole layers is harmless (27 layers on 27 slots), it is kept as before.
  const auto whole = plan_owners(ps, 27, 1);
  EXPECT_EQ(whole.units.size(), 27u);
  EXPECT_TRUE(std::isinf(whole.pack_cap));
  EXPECT_DOUBLE_EQ(whole.imbalance(), 1.0);
}

TEST(OwnerPlanTest, PackingIsDroppedWhenEveryVariantCostsMore) {
  EnvGuard env;
  // Four equal small matrices of one layer on 4 slots: any packing doubles the makespan.
  const std::vector<ParamSpec> ps = {P("layers.0.a", {64, 64}), P("layers.0.b", {64, 64}),
                                     P("layers.0.c", {64, 64}), P("layers.0.d", {64, 64})};
  const auto plan = plan_owners(ps, 4, 1);
  ExpectWellFormed(ps, plan);
  EXPECT_EQ(plan.units.size(), 4u);
  EXPECT_EQ(plan.packed_units, 0);
  EXPECT_DOUBLE_EQ(plan.pack_cap, 0.0);
  EXPECT_DOUBLE_EQ(plan.imbalance(), 1.0);
  EXPECT_TRUE(plan.options.pack_small_params);  // the option as resolved; the plan says what won
  // On 2 slots two pairs are as good as four singles: the packing kept is one capped at L / 1.
  const auto two = plan_owners(ps, 2, 1);
  EXPECT_EQ(two.units.size(), 2u);
  EXPECT_DOUBLE_EQ(two.imbalance(), 1.0);
  EXPECT_DOUBLE_EQ(two.pack_cap, two.lower_bound);
}

// Packed vs per-matrix plans on every preset at 8 ... 512 slots. Values: packed imbalance (makespan
// / max(total / S, largest matrix)), measured; the limit allows 0.002 above. Below each table
// value the per-matrix plan's; packing never costs more than 1% of it.
struct PresetTable {
  std::string preset;
  std::vector<double> imbalance;  // at S = 8, 16, 32, 64, 128, 256, 512 (1-D)
};
const std::vector<int> kSlotCounts = {8, 16, 32, 64, 128, 256, 512};

void CheckPresetTable(const PresetTable& t, bool hsdp) {
  SCOPED_TRACE(t.preset);
  const auto params = muon(t.preset);
  PlanOptions off;
  off.pack_small_params = false;
  double largest = 0, total = 0;
  for (const auto& p : params) {
    const double c = param_cost(p, ResolvedPlanOptions{});
    largest = std::max(largest, c);
    total += c;
  }
  for (size_t i = 0; i < kSlotCounts.size(); ++i) {
    const int S = kSlotCounts[i];
    SCOPED_TRACE("S = " + std::to_string(S));
    const auto plan = plan_owners(params, S, 1);
    const auto per_matrix = plan_owners(params, S, 1, off);
    EXPECT_LE(plan.makespan, 1.01 * per_matrix.makespan);
    EXPECT_NEAR(plan.lower_bound, std::max(total / S, largest), 1e-12 * plan.lower_bound);
    EXPECT_LE(plan.imbalance(), t.imbalance[i] + 0.002);
    // <= 1.05 wherever the granularity floor allows it (llama3-70b at 256 slots: every MLP
    // matrix needs its own slot and no q/o fits beside one under the mean, so ~M + Q is optimal
    // although the pigeonhole floor says 1.0; documented in the table below).
    if (per_matrix.granularity_bound / per_matrix.lower_bound <= 1.05 &&
        !(t.preset == "llama3-70b" && S == 256)) {
      EXPECT_LE(plan.imbalance(), 1.05);
    }
    EXPECT_TRUE(plan.violations.empty());
    if (hsdp && S >= 16) {
      const auto h = plan_owners(params, 8, S / 8);
      const auto hp = plan_owners(params, 8, S / 8, off);
      EXPECT_LE(h.makespan, 1.01 * hp.makespan) << "HSDP 8 x " << S / 8;
    }
  }
}

TEST(OwnerPlanTest, PackingNeverCostsMoreThanOnePercentOnDensePresets) {
  EnvGuard env;
  // Measured with this planner. The old always-pack planner had gpt2-small at 8 slots at 1.333
  // (12 packed layers on 8 slots) and vit-l16 at 64 slots at 2.667 (24 packed blocks on 64 slots),
  // while reporting 1.000 for the latter.
  const std::vector<PresetTable> tables = {
      {"gpt2-small", {1.0, 1.0, 1.3333, 1.0, 1.0, 1.0, 1.0}},
      {"gpt2-xl", {1.0, 1.0, 1.0, 1.0, 1.3333, 1.0, 1.0}},
      {"llama3-8b", {1.0, 1.0, 1.0, 1.1089, 1.0, 1.0, 1.0}},
      {"llama3-70b", {1.0004, 1.0005, 1.0055, 1.0214, 1.0214, 1.1491, 1.0}},
      {"llama3-405b", {1.0035, 1.0044, 1.0152, 1.0152, 1.0152, 1.1232, 1.0}},
      {"qwen2.5-7b", {1.0041, 1.0125, 1.0125, 1.3501, 1.0, 1.0, 1.0}},
      {"vit-l16", {1.0, 1.0, 1.0, 1.3333, 1.0, 1.0, 1.0}}};
  for (const auto& t : tables) CheckPresetTable(t, t.preset != "llama3-405b");
}

TEST(OwnerPlanTest, PackingNeverCostsMoreThanOnePercentOnMoePresets) {
  EnvGuard env;
  // Packed imbalance, measured (packing keeps the most packing within 1% of the per-matrix
  // plan, so it may sit up to 1% above it). Per-matrix imbalance for comparison -- deepseek-v2-lite: 1.0003 1.0003 1.0005 1.0039 1.0136
  // 1.0329 1.0000; qwen1.5-moe-a2.7b: 1.0000 1.0007 1.0035 1.0092 1.0131 1.0360 1.0360;
  // qwen3-30b-a3b: 1.0000 1.0000 1.0000 1.0003 1.0014 1.0064 1.0064; mixtral-8x7b: 1.0000 1.0000
  // 1.0000 1.0000 1.0218 1.0682 1.3004 (the last two at the granularity floor: 768 equal expert
  // matrices on 256 / 512 slots).
  const std::vector<PresetTable> tables = {
      {"deepseek-v2-lite", {1.0005, 1.0017, 1.0103, 1.0104, 1.0157, 1.0415, 1.0}},
      {"qwen1.5-moe-a2.7b", {1.0, 1.0037, 1.0019, 1.0078, 1.0101, 1.0360, 1.0360}},
      {"qwen3-30b-a3b", {1.0, 1.0, 1.0007, 1.0061, 1.0064, 1.0064, 1.0064}},
      {"mixtral-8x7b", {1.0004, 1.0, 1.0, 1.0015, 1.0218, 1.0682, 1.3004}}};
  for (const auto& t : tables) CheckPresetTable(t, t.preset == "deepseek-v2-lite");
}

TEST(OwnerPlanTest, DeepSeekV3PlansNearTheBound) {
  EnvGuard env;
  // 45,090 Muon matrices (58 MoE layers x 256 experts x 3 + attention + dense MLPs).
  const auto params = muon("deepseek-v3");
  ASSERT_EQ(params.size(), 45090u);
  for (int S : {64, 512}) {
    const auto plan = plan_owners(params, S, 1);
    EXPECT_LE(plan.imbalance(), S == 64 ? 1.0011 : 1.0067) << S;
    EXPECT_TRUE(plan.violations.empty());
  }
}

TEST(OwnerPlanTest, HsdpWithOwnerCap) {
  EnvGuard env;
  const auto params = muon("llama3-8b");
  PlanOptions o;
  o.max_owners_per_group = 3;
  const auto plan = plan_owners(params, 8, 4, o);
  ExpectWellFormed(params, plan);
  for (const auto& [name, use] : group_use(plan)) {
    EXPECT_LE(use.per_slot.size(), 3u) << name;
    EXPECT_LE(max_count(use.per_slot), 2) << name;  // ceil(6 / 3)
    EXPECT_LE(max_count(use.per_col), 2) << name;   // ceil(6 / min(G, 3))
  }
  EXPECT_TRUE(plan.violations.empty());
}

TEST(OwnerPlanTest, StrategiesRoundRobinAndRank0) {
  EnvGuard env;
  const std::vector<ParamSpec> ps = {P("layers.0.a", {4096, 4096}), P("layers.0.b", {4096, 4096}),
                                     P("layers.1.a", {4096, 4096}), P("layers.1.b", {8192, 8192}),
                                     P("head_proj", {4096, 4096})};
  PlanOptions o;
  o.owner_strategy = "round_robin";
  const auto rr = plan_owners(ps, 3, 1, o);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(rr.owners[i].shard, i % 3) << i;  // units in model order
  EXPECT_TRUE(rr.violations.empty());

  o.owner_strategy = "rank0";
  const auto r0 = plan_owners(ps, 3, 2, o);
  for (const auto& ow : r0.owners) EXPECT_EQ(ow, (OwnerCoord{0, 0}));
  ASSERT_FALSE(r0.violations.empty());
  EXPECT_NE(r0.violations[0].find("layer concurrency: 2 of 3 groups"), std::string::npos)
      << r0.violations[0];
  EXPECT_DOUBLE_EQ(r0.makespan, r0.total_cost);

  const auto lpt = plan_owners(ps, 3, 1);
  EXPECT_EQ(lpt.owners[3], (OwnerCoord{0, 0}));  // the largest unit first
  EXPECT_LT(lpt.makespan, rr.makespan + 1);
  EXPECT_NE(lpt.fingerprint, rr.fingerprint);
}

TEST(OwnerPlanTest, CostModelChangesThePlan) {
  EnvGuard env;
  // Same element count, 8x different Newton-Schulz work.
  const std::vector<ParamSpec> ps = {P("a.w", {8192, 8192}), P("b.w", {1024, 65536}),
                                     P("c.w", {1024, 65536}), P("d.w", {1024, 65536})};
  PlanOptions numel;
  numel.owner_cost_model = "numel";
  const auto n = plan_owners(ps, 2, 1, numel);
  const auto f = plan_owners(ps, 2, 1);
  EXPECT_DOUBLE_EQ(n.units[0].cost, n.units[1].cost);
  EXPECT_GT(f.units[0].cost, 7.9 * f.units[1].cost);
  // numel: 2 + 2 units; optimizer: the square matrix alone, the three wide ones together.
  EXPECT_EQ(n.slots[0].units, 2);
  EXPECT_EQ(f.slots[OwnerPlan::slot_index(f.owners[0], 2)].units, 1);
  EXPECT_NE(n.fingerprint, f.fingerprint);
}

TEST(OwnerPlanTest, FingerprintIsStableAcrossRunsAndMachines) {
  EnvGuard env;
  const std::vector<ParamSpec> ps = {P("model.layers.0.q.weight", {256, 256}),
                                     P("model.layers.0.k.weight", {64, 256}),
                                     P("model.layers.1.q.weight", {256, 256}),
                                     P("lm_head.weight", {1000, 256}, 4)};
  const auto a = plan_owners(ps, 2, 2);
  const auto b = plan_owners(ps, 2, 2);
  EXPECT_EQ(a.fingerprint, b.fingerprint);
  EXPECT_EQ(a.owners, b.owners);
  // A golden value: the hash covers a canonical serialization, no std::hash, no pointers, so it
  // is the same on every machine and every run. If a deliberate change moves it, update it here.
  EXPECT_EQ(format_fingerprint(a.fingerprint), "a5f169cf3c109442");
  // Anything that changes the inputs changes it.
  auto changed = ps;
  changed[1].shape = {64, 255};
  EXPECT_NE(plan_owners(changed, 2, 2).fingerprint, a.fingerprint);
  changed = ps;
  changed[3].elem_bytes = 2;
  EXPECT_NE(plan_owners(changed, 2, 2).fingerprint, a.fingerprint);
  EXPECT_NE(plan_owners(ps, 4, 1).fingerprint, a.fingerprint);
  PlanOptions o;
  o.ns_steps = 6;
  EXPECT_NE(plan_owners(ps, 2, 2, o).fingerprint, a.fingerprint);
  // Big plans are deterministic too.
  const auto big = muon("mixtral-8x7b");
  const auto x = plan_owners(big, 64, 2), y = plan_owners(big, 64, 2);
  EXPECT_EQ(x.fingerprint, y.fingerprint);
  EXPECT_EQ(x.owners, y.owners);
  EXPECT_EQ(format_fingerprint(0x00ff12ab34cd56efULL), "00ff12ab34cd56ef");
}

// ---- the communication plan -------------------------------------------------------------------

TEST(CommPlanTest, ClosedFormOnTwoRanks) {
  EnvGuard env;
  const std::vector<ParamSpec> ps = {P("layers.0.a", {10, 5}), P("layers.0.b", {6, 5})};
  PlanOptions o;
  o.pack_small_params = false;
  const auto plan = plan_owners(ps, 2, 1, o);
  ASSERT_EQ(plan.owners[0], (OwnerCoord{0, 0}));  // 100 bytes, the larger, first
  ASSERT_EQ(plan.owners[1], (OwnerCoord{1, 0}));  // 60 bytes
  const CommPlan c = plan_comm(ps, plan);
  EXPECT_EQ(c.muon_bytes, 160);
  ASSERT_EQ(c.boundaries.size(), 1u);
  const BoundaryComm& b = c.boundaries[0];
  EXPECT_EQ(b.boundary, "layers.0");
  ASSERT_EQ(b.roots.size(), 2u);
  EXPECT_EQ(b.roots[0].root, (OwnerCoord{0, 0}));
  EXPECT_EQ(b.roots[0].bytes, 100);
  EXPECT_EQ(b.roots[1].bytes, 60);
  EXPECT_EQ(b.payload_bytes, 160);
  EXPECT_EQ(b.fwd_broadcast_bytes, 160);
  EXPECT_EQ(b.bwd_broadcast_bytes_z3, 160);
  EXPECT_EQ(b.bwd_reduce_bytes, 160);
  EXPECT_EQ(c.per_rank_bytes_z3, (std::vector<int64_t>{180, 300}));
  EXPECT_EQ(c.per_rank_bytes_z2, (std::vector<int64_t>{120, 200}));
  EXPECT_EQ(c.per_rank_replicate_bytes, (std::vector<int64_t>{0, 0}));
  EXPECT_DOUBLE_EQ(c.formula_z3, 240.0);
  EXPECT_DOUBLE_EQ(c.mean_z3(), 240.0);
  EXPECT_DOUBLE_EQ(c.formula_z2, 160.0);
  EXPECT_DOUBLE_EQ(c.mean_z2(), 160.0);
  EXPECT_EQ(c.max_z3(), 300);
}

TEST(CommPlanTest, MeansEqualTheFormulasOnPresets) {
  EnvGuard env;
  for (const auto& c : std::vector<GridCase>{{"llama3-8b", 8, 1}, {"llama3-8b", 8, 4},
                                             {"mixtral-8x7b", 16, 2}, {"vit-l16", 64, 1}}) {
    const auto params = muon(c.preset);
    const auto plan = plan_owners(params, c.G, c.R);
    const CommPlan comm = plan_comm(params, plan);
    const double PM = static_cast<double>(plan.total_bytes);
    EXPECT_EQ(comm.muon_bytes, plan.total_bytes);
    EXPECT_DOUBLE_EQ(comm.formula_z3, 3.0 * (c.G - 1) / c.G * PM);
    EXPECT_DOUBLE_EQ(comm.formula_z2, 2.0 * (c.G - 1) / c.G * PM);
    EXPECT_NEAR(comm.mean_z3() / comm.formula_z3, 1.0, 1e-12) << c.preset;
    EXPECT_NEAR(comm.mean_z2() / comm.formula_z2, 1.0, 1e-12) << c.preset;
    if (c.R > 1) {
      EXPECT_NEAR(comm.mean_replicate() / comm.formula_replicate, 1.0, 1e-12) << c.preset;
    } else {
      EXPECT_EQ(comm.max_replicate(), 0);
    }
    int64_t payload = 0;
    for (const BoundaryComm& b : comm.boundaries) {
      int64_t roots = 0;
      std::set<std::pair<int, int>> distinct;
      for (const RootPayload& r : b.roots) {
        roots += r.bytes;
        distinct.insert({r.root.shard, r.root.replicate});
      }
      EXPECT_EQ(distinct.size(), b.roots.size());
      EXPECT_EQ(roots, b.payload_bytes);
      EXPECT_EQ(b.fwd_broadcast_bytes, (c.G - 1) * b.payload_bytes);
      payload += b.payload_bytes;
    }
    EXPECT_EQ(payload, comm.muon_bytes);
  }
  // Llama-3-8B at G = 8: 32 boundaries, each with 6 concurrent roots.
  const auto params = muon("llama3-8b");
  const CommPlan comm = plan_comm(params, plan_owners(params, 8, 1));
  ASSERT_EQ(comm.boundaries.size(), 32u);
  EXPECT_EQ(comm.boundaries[3].boundary, "model.layers.3");
  for (const auto& b : comm.boundaries) EXPECT_EQ(b.roots.size(), 6u);
  // Spread between ranks stays small for a balanced plan: the busiest rank within 1% of the mean.
  EXPECT_LE(static_cast<double>(comm.max_z3()) / comm.mean_z3(), 1.01);
}

TEST(CommPlanTest, CustomBoundariesAndSizeChecks) {
  EnvGuard env;
  const std::vector<ParamSpec> ps = {P("layers.0.a", {64, 64}), P("layers.1.a", {64, 64}),
                                     P("proj.weight", {64, 64})};
  const auto plan = plan_owners(ps, 2, 1);
  const auto def = plan_comm(ps, plan);
  ASSERT_EQ(def.boundaries.size(), 3u);
  EXPECT_EQ(def.boundaries[2].boundary, "proj.weight");
  const auto custom = plan_comm(ps, plan, {"stage", "stage", ""});
  ASSERT_EQ(custom.boundaries.size(), 2u);
  EXPECT_EQ(custom.boundaries[0].boundary, "stage");
  EXPECT_EQ(custom.boundaries[0].payload_bytes, 2 * 64 * 64 * 2);
  EXPECT_THROW(plan_comm(ps, plan, {"x"}), std::invalid_argument);
  EXPECT_THROW(plan_comm({ps[0]}, plan), std::invalid_argument);
}

// ---- model specs ------------------------------------------------------------------------------

int64_t total_numel(const ModelSpec& m) {
  int64_t n = 0;
  for (const auto& p : m.params) n += p.numel();
  return n;
}

TEST(ModelSpecsTest, PresetsHaveTheRealParameterCounts) {
  // The published parameter counts of these models (tied embeddings counted once).
  const std::vector<std::pair<std::string, int64_t>> cases = {
      {"gpt2-small", 124'439'808},      {"gpt2-xl", 1'557'611'200},
      {"llama3-8b", 8'030'261'248},     {"llama3-70b", 70'553'706'496},
      {"qwen2.5-7b", 7'615'616'512},    {"mixtral-8x7b", 46'702'792'704},
      {"vit-l16", 304'326'632},
      // MoE: the published totals are 15.7B, 671B (without the MTP layer), 14.3B and 30.5B.
      {"deepseek-v2-lite", 15'706'484'224}, {"deepseek-v3", 671'026'419'200},
      {"qwen1.5-moe-a2.7b", 14'315'784'192}, {"qwen3-30b-a3b", 30'532'122'624}};
  for (const auto& [name, count] : cases) EXPECT_EQ(total_numel(model_preset(name)), count) << name;
  const ModelSpec l = model_preset("llama3-405b");
  EXPECT_EQ(l.params.size(), 1u + 126u * 9u + 2u);
  EXPECT_EQ(l.params[1].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(l.params[1].shape, (std::vector<int64_t>{16384, 16384}));
  EXPECT_EQ(l.params[2].shape, (std::vector<int64_t>{1024, 16384}));
  EXPECT_EQ(l.params[5].shape, (std::vector<int64_t>{53248, 16384}));
  EXPECT_GT(total_numel(l), 405'000'000'000);
  EXPECT_LT(total_numel(l), 406'000'000'000);
  EXPECT_EQ(model_preset_names().size(), 12u);
}

TEST(ModelSpecsTest, PresetLookupAndDtype) {
  EXPECT_EQ(model_preset("Llama-3-8B").name, "llama3-8b");
  EXPECT_EQ(model_preset("ViT-L/16").name, "vit-l16");
  EXPECT_EQ(model_preset("gpt2").name, "gpt2-small");
  EXPECT_EQ(model_preset("llama3-8b").params[0].elem_bytes, 2);
  EXPECT_EQ(model_preset("llama3-8b", "fp32").params[0].elem_bytes, 4);
  try {
    model_preset("llama9");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown preset 'llama9'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("llama3-8b"), std::string::npos);
  }
  EXPECT_THROW(model_preset("llama3-8b", "int3"), std::invalid_argument);
  EXPECT_EQ(dtype_bytes("BFloat16"), 2);
  EXPECT_EQ(dtype_bytes("float32"), 4);
  EXPECT_EQ(dtype_bytes("fp8"), 1);
}

TEST(ModelSpecsTest, Gpt2UsesHNLayersAndConv1DShapes) {
  const auto m = model_preset("gpt2-small");
  const auto ps = select_muon_params(m);
  ASSERT_EQ(ps.size(), 48u);
  EXPECT_EQ(ps[0].name, "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(ps[0].shape, (std::vector<int64_t>{768, 2304}));
  EXPECT_EQ(ps[3].name, "transformer.h.0.mlp.c_proj.weight");
  EXPECT_EQ(ps[3].shape, (std::vector<int64_t>{3072, 768}));
  EXPECT_EQ(layer_key_of(ps[0].name), "transformer.h.0");
  for (const auto& p : ps) EXPECT_EQ(p.route, "muon");
}

TEST(ModelSpecsTest, DefaultPredicateSkipsEmbeddingsHeadNormsAndVectors) {
  const auto m = model_preset("qwen2.5-7b");
  const auto ps = select_muon_params(m);
  EXPECT_EQ(ps.size(), 28u * 7u);
  for (const auto& p : ps) {
    EXPECT_EQ(p.shape.size(), 2u) << p.name;
    EXPECT_EQ(p.name.find("embed"), std::string::npos);
    EXPECT_EQ(p.name.find("lm_head"), std::string::npos);
  }
  EXPECT_FALSE(is_default_muon_target(P("model.embed_tokens.weight", {10, 4})));
  EXPECT_FALSE(is_default_muon_target(P("lm_head.weight", {10, 4})));
  EXPECT_FALSE(is_default_muon_target(P("head.weight", {10, 4})));
  EXPECT_FALSE(is_default_muon_target(P("transformer.wte.weight", {10, 4})));
  EXPECT_FALSE(is_default_muon_target(P("transformer.h.0.ln_1.weight", {4, 4})));
  EXPECT_FALSE(is_default_muon_target(P("blocks.0.norm1.weight", {4, 4})));
  EXPECT_FALSE(is_default_muon_target(P("cls_token", {1, 1, 4})));
  EXPECT_FALSE(is_default_muon_target(P("patch_embed.proj.weight", {4, 3, 2, 2})));
  EXPECT_FALSE(is_default_muon_target(P("layers.0.q_proj.bias", {4})));
  EXPECT_TRUE(is_default_muon_target(P("layers.0.attn.num_heads_proj.weight", {4, 4})));
  EXPECT_TRUE(is_default_muon_target(P("layers.0.q_proj.weight", {4, 4})));
}

TEST(ModelSpecsTest, IncludeAndExcludePatterns) {
  const auto m = model_preset("mixtral-8x7b");
  MuonTargetSelector experts_only;
  experts_only.include = {"*.experts.*"};
  EXPECT_EQ(select_muon_params(m, experts_only).size(), 32u * 24u);
  MuonTargetSelector no_router;
  no_router.exclude = {"block_sparse_moe.gate"};
  EXPECT_EQ(select_muon_params(m, no_router).size(), 32u * 28u);
  MuonTargetSelector with_head;
  with_head.include = {"proj", "*.w?.weight", "lm_head"};
  const auto ps = select_muon_params(m, with_head);
  EXPECT_EQ(ps.size(), 32u * 28u + 1u);
  EXPECT_EQ(ps.back().name, "lm_head.weight");
  EXPECT_TRUE(name_matches("model.layers.3.mlp.w1.weight", "model.layers.*.w1.*"));
  EXPECT_FALSE(name_matches("model.layers.3.mlp.w1.weight", "model.layers.*.w2.*"));
  EXPECT_TRUE(name_matches("abc", "a?c"));
  EXPECT_TRUE(name_matches("model.layers.3.mlp", "layers.3"));
}

TEST(ModelSpecsTest, HfConfigLlamaMatchesThePreset) {
  const std::string cfg = R"({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";
  const ModelSpec a = model_from_hf_config(cfg, "config.json");
  const ModelSpec b = model_preset("llama3-8b");
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    EXPECT_EQ(a.params[i].name, b.params[i].name);
    EXPECT_EQ(a.params[i].shape, b.params[i].shape);
    EXPECT_EQ(a.params[i].elem_bytes, 2);
  }
  EXPECT_EQ(model_from_hf_config(cfg, "c", "fp32").params[0].elem_bytes, 4);
}

TEST(ModelSpecsTest, HfConfigFamilies) {
  // Qwen2: q/k/v biases; tied embeddings drop lm_head.
  const auto q = model_from_hf_config(
      R"({"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 2,
          "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
          "vocab_size": 151936, "tie_word_embeddings": true})", "qwen");
  EXPECT_EQ(q.params[2].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(q.params[2].shape, (std::vector<int64_t>{896}));
  EXPECT_EQ(q.params[3].shape, (std::vector<int64_t>{128, 896}));  // k_proj: 2 heads x 64
  EXPECT_EQ(q.params.back().name, "model.norm.weight");
  // Mistral with an explicit head_dim.
  const auto mi = model_from_hf_config(
      R"({"model_type": "mistral", "hidden_size": 5120, "num_hidden_layers": 1,
          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
          "intermediate_size": 14336, "vocab_size": 131072})", "nemo");
  EXPECT_EQ(mi.params[1].shape, (std::vector<int64_t>{4096, 5120}));
  EXPECT_EQ(mi.params[4].shape, (std::vector<int64_t>{5120, 4096}));
  // GPT-2 config keys; model_type inferred from architectures.
  const auto g = model_from_hf_config(
      R"({"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_layer": 12, "n_head": 12,
          "vocab_size": 50257, "n_positions": 1024, "n_inner": null})", "gpt2");
  EXPECT_EQ(total_numel(g), 124'439'808);
}

TEST(ModelSpecsTest, HfConfigErrorsNameTheProblem) {
  auto msg = [](const std::string& text) {
    try {
      model_from_hf_config(text, "cfg.json");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  EXPECT_NE(msg("{not json").find("malformed JSON in cfg.json"), std::string::npos);
  EXPECT_NE(msg(R"({"model_type": "t5"})").find("unsupported model_type 't5'"), std::string::npos);
  EXPECT_NE(msg(R"({"model_type": "llama"})").find("missing required field 'hidden_size'"),
            std::string::npos);
  EXPECT_NE(msg(R"({"model_type": "llama", "hidden_size": -4096})").find("got -4096"),
            std::string::npos);
  EXPECT_NE(msg("[1, 2]").find("must be a JSON object"), std::string::npos);
}

// ---- MoE configs and size limits ---------------------------------------------------------------

std::map<std::string, std::vector<int64_t>> shapes_of(const ModelSpec& m) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& p : m.params) out[p.name] = p.shape;
  return out;
}

TEST(ModelSpecsTest, HfConfigDeepSeekMlaAndMoe) {
  // DeepSeek-V2-Lite's config.json (size fields): layer 0 dense, then 64 routed + 2 shared.
  const std::string v2 = R"({"architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 3,
    "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": null,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";
  const ModelSpec m = model_from_hf_config(v2, "v2.json");
  const auto sh = shapes_of(m);
  using V = std::vector<int64_t>;
  EXPECT_EQ(sh.at("model.layers.0.self_attn.q_proj.weight"), (V{3072, 2048}));  // 16 x (128+64)
  EXPECT_EQ(sh.at("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), (V{576, 2048}));
  EXPECT_EQ(sh.at("model.layers.0.self_attn.kv_a_layernorm.weight"), (V{512}));
  EXPECT_EQ(sh.at("model.layers.0.self_attn.kv_b_proj.weight"), (V{4096, 512}));  // 16 x (128+128)
  EXPECT_EQ(sh.at("model.layers.0.self_attn.o_proj.weight"), (V{2048, 2048}));
  EXPECT_EQ(sh.at("model.layers.0.mlp.gate_proj.weight"), (V{10944, 2048}));  // dense layer
  EXPECT_EQ(sh.count("model.layers.0.mlp.experts.0.gate_proj.weight"), 0u);
  EXPECT_EQ(sh.at("model.layers.1.mlp.experts.63.gate_proj.weight"), (V{1408, 2048}));
  EXPECT_EQ(sh.at("model.layers.1.mlp.experts.63.down_proj.weight"), (V{2048, 1408}));
  EXPECT_EQ(sh.at("model.layers.1.mlp.gate.weight"), (V{64, 2048}));
  EXPECT_EQ(sh.at("model.layers.1.mlp.shared_experts.up_proj.weight"), (V{2816, 2048}));
  EXPECT_EQ(sh.count("model.layers.1.mlp.gate.e_score_correction_bias"), 0u);  // V3 only
  EXPECT_EQ(sh.count("model.layers.1.mlp.gate_proj.weight"), 0u);
  // Module order: attention, experts, router, shared experts, norms.
  EXPECT_EQ(m.params[1].name, "model.layers.0.self_attn.q_proj.weight");
  // 1 dense + 2 MoE layers: per MoE layer 64 x 3 + router + 3 shared + 5 attention + 3 norms.
  EXPECT_EQ(m.params.size(), 1u + (4 + 3 + 3) + 2 * (4 + 192 + 1 + 3 + 3) + 2);
  EXPECT_EQ(select_muon_params(m).size(), 7u + 2 * (4 + 192 + 1 + 3));
  // Inferred from architectures; the preset is this config at 27 layers.
  nlohmann::json j = nlohmann::json::parse(v2);
  j.erase("model_type");
  j["num_hidden_layers"] = 27;
  EXPECT_EQ(model_from_hf_config(j.dump(), "v2").params.size(),
            model_preset("deepseek-v2-lite").params.size());

  // DeepSeek-V3 style: q LoRA, the router's score-correction bias, MoE every 2nd layer after 1.
  const ModelSpec v3 = model_from_hf_config(
      R"({"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 4,
          "num_attention_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
          "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
          "moe_layer_freq": 2, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280})", "v3");
  const auto s3 = shapes_of(v3);
  EXPECT_EQ(s3.at("model.layers.0.self_attn.q_a_proj.weight"), (V{1536, 7168}));
  EXPECT_EQ(s3.at("model.layers.0.self_attn.q_a_layernorm.weight"), (V{1536}));
  EXPECT_EQ(s3.at("model.layers.0.self_attn.q_b_proj.weight"), (V{24576, 1536}));
  EXPECT_EQ(s3.count("model.layers.0.self_attn.q_proj.weight"), 0u);
  EXPECT_EQ(s3.at("model.layers.0.self_attn.o_proj.weight"), (V{7168, 16384}));
  // layers 0 (< first_k_dense_replace), 1 and 3 (odd: moe_layer_freq 2) are dense, 2 is MoE
  for (int l : {0, 1, 3})
    EXPECT_EQ(s3.count("model.layers." + std::to_string(l) + ".mlp.down_proj.weight"), 1u) << l;
  EXPECT_EQ(s3.at("model.layers.2.mlp.experts.7.up_proj.weight"), (V{2048, 7168}));
  EXPECT_EQ(s3.at("model.layers.2.mlp.gate.e_score_correction_bias"), (V{8}));
  EXPECT_EQ(s3.at("model.layers.2.mlp.shared_experts.down_proj.weight"), (V{7168, 2048}));
}

TEST(ModelSpecsTest, HfConfigQwenMoe) {
  using V = std::vector<int64_t>;
  // Qwen1.5-MoE (qwen2_moe): qkv biases, a shared expert with its sigmoid gate, sparse step 2,
  // mlp_only_layers.
  const ModelSpec q2 = model_from_hf_config(
      R"({"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048,
          "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 16,
          "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_experts": 60,
          "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 2,
          "mlp_only_layers": [3], "vocab_size": 151936})", "q2");
  const auto s2 = shapes_of(q2);
  EXPECT_EQ(s2.at("model.layers.0.self_attn.k_proj.bias"), (V{2048}));
  // sparse: (l + 1) % 2 == 0 and l not in mlp_only_layers -> layers 1 and 5; 3 is dense
  for (int l : {0, 2, 3, 4})
    EXPECT_EQ(s2.at("model.layers." + std::to_string(l) + ".mlp.up_proj.weight"), (V{5632, 2048}));
  EXPECT_EQ(s2.at("model.layers.1.mlp.gate.weight"), (V{60, 2048}));
  EXPECT_EQ(s2.at("model.layers.5.mlp.experts.59.down_proj.weight"), (V{2048, 1408}));
  EXPECT_EQ(s2.at("model.layers.1.mlp.shared_expert.gate_proj.weight"), (V{5632, 2048}));
  EXPECT_EQ(s2.at("model.layers.1.mlp.shared_expert_gate.weight"), (V{1, 2048}));
  EXPECT_EQ(s2.count("model.layers.3.mlp.gate.weight"), 0u);
  // Qwen3-MoE: head_dim, per-head q/k norms, no biases, no shared expert.
  const ModelSpec q3 = model_from_hf_config(
      R"({"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 2,
          "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
          "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
          "vocab_size": 151936, "tie_word_embeddings": true})", "q3");
  const auto s3 = shapes_of(q3);
  EXPECT_EQ(s3.at("model.layers.0.self_attn.q_proj.weight"), (V{4096, 2048}));
  EXPECT_EQ(s3.at("model.layers.0.self_attn.k_proj.weight"), (V{512, 2048}));
  EXPECT_EQ(s3.at("model.layers.0.self_attn.q_norm.weight"), (V{128}));
  EXPECT_EQ(s3.count("model.layers.0.self_attn.q_proj.bias"), 0u);
  EXPECT_EQ(s3.at("model.layers.1.mlp.experts.127.gate_proj.weight"), (V{768, 2048}));
  EXPECT_EQ(s3.count("model.layers.1.mlp.shared_expert.gate_proj.weight"), 0u);
  EXPECT_EQ(s3.count("lm_head.weight"), 0u);
  // 2 x (4 attention + 2 qk norms + router + 128 x 3 + 2 norms) + embed + norm
  EXPECT_EQ(q3.params.size(), 2u * (4 + 2 + 1 + 384 + 2) + 2);
  // num_experts 0: a dense Qwen3-MoE config.
  const ModelSpec dense = model_from_hf_config(
      R"({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "intermediate_size": 128, "num_experts": 0,
          "vocab_size": 100})", "dense");
  EXPECT_EQ(shapes_of(dense).at("model.layers.0.mlp.gate_proj.weight"), (V{128, 64}));
}

TEST(ModelSpecsTest, ConfigSizesAboveSaneLimitsFailFastNamingTheField) {
  auto msg = [](const std::string& text) {
    try {
      model_from_hf_config(text, "cfg.json");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  const std::string llama = R"({"model_type": "llama", "hidden_size": 4096,
    "num_attention_heads": 32, "intermediate_size": 14336, "vocab_size": 128256, )";
  const std::string deep = msg(llama + R"("num_hidden_layers": 100000000})");
  EXPECT_NE(deep.find("field 'num_hidden_layers' is 100000000, above the limit of 10000 layers"),
            std::string::npos) << deep;
  EXPECT_NE(deep.find("check the value"), std::string::npos) << deep;
  EXPECT_NE(msg(R"({"model_type": "llama", "hidden_size": 4194304, "num_hidden_layers": 1,
                    "num_attention_heads": 32, "intermediate_size": 14336, "vocab_size": 10})")
                .find("field 'hidden_size' is 4194304, above the limit of 1048576"),
            std::string::npos);
  EXPECT_NE(msg(R"({"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 1,
                    "num_attention_heads": 32, "moe_intermediate_size": 768,
                    "num_experts": 1000000, "vocab_size": 10})")
                .find("field 'num_experts' is 1000000, above the limit of 65536 experts"),
            std::string::npos);
  EXPECT_NE(msg(llama + R"("num_hidden_layers": 18446744073709551615})")
                .find("'num_hidden_layers' is 18446744073709551615, above the limit"),
            std::string::npos);
  // Each size within its limit, but together too many tensors: caught before building.
  const std::string many = msg(R"({"model_type": "deepseek_v2", "hidden_size": 64,
    "num_hidden_layers": 10000, "num_attention_heads": 4, "moe_intermediate_size": 32,
    "n_routed_experts": 65536, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "v_head_dim": 8, "vocab_size": 100})");
  EXPECT_NE(many.find("10000 layers x"), std::string::npos) << many;
  EXPECT_NE(many.find("above the limit of 2000000 tensors"), std::string::npos) << many;
  EXPECT_NE(many.find("reduce 'num_hidden_layers' (10000) or the expert count (65536)"),
            std::string::npos) << many;
  // ... or too many elements.
  const std::string big = msg(R"({"model_type": "llama", "hidden_size": 1048576,
    "num_hidden_layers": 10000, "num_attention_heads": 1024, "intermediate_size": 1048576,
    "vocab_size": 1048576})");
  EXPECT_NE(big.find("more than 1000000000000000 elements"), std::string::npos) << big;
  // The planner's own limits on parameter lists.
  std::string list = "[";
  for (int i = 0; i < 3; ++i) list += std::string(i ? "," : "") + R"({"name": "w)" +
                                      std::to_string(i) + R"(", "shape": [1048576, 1048576, 1024]})";
  list += "]";
  try {
    model_from_params_json(list, "p.json");
    ADD_FAILURE() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("elements in total"), std::string::npos) << e.what();
  }
}

TEST(ModelSpecsTest, ParamsJson) {
  const auto m = model_from_params_json(
      R"([{"name": "enc.layers.0.w", "shape": [64, 32]},
          {"name": "enc.layers.0.v", "shape": [64, 32], "dtype": "fp32", "group": "g"},
          {"name": "scale", "shape": []}])", "p.json");
  ASSERT_EQ(m.params.size(), 3u);
  EXPECT_EQ(m.params[0].elem_bytes, 2);
  EXPECT_EQ(m.params[1].elem_bytes, 4);
  EXPECT_EQ(m.params[1].group_key, "g");
  EXPECT_TRUE(m.params[2].shape.empty());
  EXPECT_EQ(select_muon_params(m).size(), 2u);
  EXPECT_EQ(model_from_params_json(R"({"params": [{"name": "a", "shape": [2, 2]}]})", "p")
                .params.size(), 1u);
  auto msg = [](const std::string& text) {
    try {
      model_from_params_json(text, "p.json");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  EXPECT_NE(msg(R"([{"name": "a", "shape": [4, 0]}])").find("'a' has shape [4,0]: dimension 0"),
            std::string::npos) << msg(R"([{"name": "a", "shape": [4, 0]}])");
  EXPECT_NE(msg(R"([{"name": "a", "shape": [-2, 3]}])").find("dimension -2"), std::string::npos);
  EXPECT_NE(msg(R"([{"name": "a", "shape": [2.5, 3]}])").find("must be integers"),
            std::string::npos);
  EXPECT_NE(msg(R"([{"name": "a", "shape": [2]}, {"name": "a", "shape": [2]}])").find("twice"),
            std::string::npos);
  EXPECT_NE(msg(R"([{"shape": [2]}])").find("entry 0 needs a non-empty string \"name\""),
            std::string::npos);
  EXPECT_NE(msg(R"([{"name": "a", "shape": [2], "dtype": "int4"}])").find("unknown dtype 'int4'"),
            std::string::npos);
  EXPECT_NE(msg(R"({"a": 1})").find("expected a JSON array"), std::string::npos);
  EXPECT_NE(msg("[{]").find("malformed JSON"), std::string::npos);
}

TEST(ModelSpecs, MoeActiveParametersCountTheTopKExpertsAndDriveTheSimulatedCompute) {
  EnvGuard env;
  auto total = [](const ModelSpec& m) {
    int64_t n = 0;
    for (const auto& p : m.params) n += p.numel();
    return n;
  };
  const ModelSpec mix = model_preset("mixtral-8x7b"), q3 = model_preset("qwen3-30b-a3b");
  // 32 sparse layers, 8 experts, top 2, experts of 3 x [14336, 4096]
  EXPECT_EQ(mix.active_params, total(mix) - int64_t{32} * 6 * 3 * 14336 * 4096);
  // 48 sparse layers, 128 experts, top 8, experts of 3 x [768, 2048]: the "A3B" of its name
  EXPECT_EQ(q3.active_params, total(q3) - int64_t{48} * 120 * 3 * 768 * 2048);
  EXPECT_NEAR(static_cast<double>(q3.active_params), 3.3e9, 0.1e9);
  EXPECT_EQ(model_preset("llama3-8b").active_params, 0);
  const std::vector<ParamSpec> ps = select_muon_params(mix);
  const OwnerPlan plan = plan_owners(ps, 8, 1, PlanOptions{});
  SimLayout l;
  l.shard = 8;
  const HardwareSpec hw = hardware_preset("h200");
  const Simulation sim = simulate_step(mix, ps, plan, l, hw);
  EXPECT_NEAR(sim.designs[0].compute_s,
              6.0 * static_cast<double>(mix.active_params) * static_cast<double>(l.tokens) /
                  (8 * hw.matmul_tflops * 1e12 * hw.mfu),
              1e-9);
}

// ---- owner_cost_model = "profiled" (ns_profile.h) ----------------------------------------------

NsTiming timing(int64_t r, int64_t c, int64_t eb, double single, int batch = 1, double batched = 0) {
  NsTiming t;
  t.rows = r, t.cols = c, t.elem_bytes = eb, t.single_us = single, t.batch = batch, t.batch_us = batched;
  return t;
}

TEST(NsProfile, TwoPointCostsAndALeastSquaresFitForUnmeasuredShapes) {
  NsProfile p;
  p.timings = {timing(32, 32, 4, 60, 8, 200), timing(64, 64, 4, 200)};
  const NsCost a = p.cost_of(32, 32, 4);
  EXPECT_TRUE(a.measured);
  EXPECT_DOUBLE_EQ(a.per_matrix_us, 20.0);  // (200 - 60) / 7
  EXPECT_DOUBLE_EQ(a.fixed_us, 40.0);       // 60 - 20
  EXPECT_DOUBLE_EQ(a.of(8), 200.0);
  EXPECT_DOUBLE_EQ(a.of(0), 0.0);
  const NsCost b = p.cost_of(64, 64, 2);  // same shape, another element size: the measured one
  EXPECT_DOUBLE_EQ(b.per_matrix_us, 200.0);
  EXPECT_DOUBLE_EQ(b.fixed_us, 0.0);
  // unmeasured: single_us = icept + slope * work through both points (work = 5 * s * 3 s b)
  const double xa = 5.0 * 32 * 3 * 32 * 32, xb = 5.0 * 64 * 3 * 64 * 64, x = 5.0 * 48 * 3 * 48 * 96;
  const double slope = 140.0 / (xb - xa), icept = 60.0 - slope * xa;
  const NsCost c = p.cost_of(96, 48, 4);
  EXPECT_FALSE(c.measured);
  EXPECT_NEAR(c.per_matrix_us, icept + slope * x, 1e-9);
  EXPECT_DOUBLE_EQ(c.fixed_us, 0.0);
  // orientation-free
  EXPECT_DOUBLE_EQ(p.cost_of(96, 48, 4).per_matrix_us, p.cost_of(48, 96, 4).per_matrix_us);
  EXPECT_THROW(NsProfile{}.cost_of(4, 4, 4), std::invalid_argument);
}

TEST(NsProfile, JsonRoundTripAndErrorsNameTheEntry) {
  NsProfile p;
  p.device = "cpu";
  p.source = "test";
  p.timings = {timing(8, 512, 4, 100, 8, 380), timing(256, 256, 2, 10000)};
  const NsProfile q = ns_profile_from_json(ns_profile_to_json(p), "rt");
  ASSERT_EQ(q.timings.size(), 2u);
  EXPECT_EQ(q.digest(), p.digest());
  EXPECT_DOUBLE_EQ(q.cost_of(512, 8, 4).per_matrix_us, 40.0);
  NsProfile r = p;
  r.timings[1].single_us = 10001;
  EXPECT_NE(r.digest(), p.digest());
  // inside a hardware description
  const std::string hw = R"({"devices_per_node": 2, "matmul_tflops": 0.1, "mfu": 0.5, "ns_efficiency": 0.5,
      "memory_bandwidth_GBps": 10, "memory_GB": 8, "intra_node": {"bandwidth_GBps": 1, "latency_us": 50},
      "inter_node": {"bandwidth_GBps": 1, "latency_us": 50}, "ns_profile": )" + ns_profile_to_json(p) + "}";
  EXPECT_EQ(ns_profile_from_json(hw, "hw.json").digest(), p.digest());
  const HardwareSpec h = hardware_from_json(hw, "hw.json");
  ASSERT_TRUE(h.ns_profile);
  EXPECT_EQ(h.ns_profile->digest(), p.digest());
  auto msg = [](const std::string& text) {
    try {
      ns_profile_from_json(text, "prof.json");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  EXPECT_NE(msg(R"({"timings": [{"rows": 4, "cols": 4, "single_us": 1}, {"rows": 4, "cols": 8, "single_us": -1}]})")
                .find("prof.json: timings[1]: single_us"),
            std::string::npos);
  EXPECT_NE(msg(R"({"timings": [{"rows": 4, "single_us": 1}]})").find("timings[0] needs a number \"cols\""),
            std::string::npos);
  EXPECT_NE(msg(R"({"timings": []})").find("empty"), std::string::npos);
  EXPECT_NE(msg(R"([1, 2])").find("--calibrate"), std::string::npos);
  EXPECT_NE(msg("{").find("not JSON"), std::string::npos);
}

// The batched time of each slot's matrices under the profile (what the step would take per owner).
std::vector<double> profiled_slot_us(const std::vector<ParamSpec>& ps, const OwnerPlan& plan, const NsProfile& prof) {
  std::vector<std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t>> per(static_cast<size_t>(plan.num_slots()));
  for (size_t i = 0; i < ps.size(); ++i) {
    const int64_t m = ps[i].shape[0], n = ps[i].shape[1];
    ++per[static_cast<size_t>(OwnerPlan::slot_index(plan.owners[i], plan.shard_size))]
         [{std::min(m, n), std::max(m, n), ps[i].elem_bytes}];
  }
  std::vector<double> out;
  for (const auto& slot : per) {
    double us = 0;
    for (const auto& [k, c] : slot) us += prof.cost_of(std::get<0>(k), std::get<1>(k), std::get<2>(k)).of(c);
    out.push_back(us);
  }
  return out;
}

double max_over_mean(const std::vector<double>& v) {
  double mx = 0, sum = 0;
  for (double x : v) mx = std::max(mx, x), sum += x;
  return mx / (sum / static_cast<double>(v.size()));
}

TEST(ProfiledCostModel, BalancesMeasuredTimeWhereTheFlopModelMisjudgesSkinnyMatrices) {
  EnvGuard env;
  // 5 square 256 x 256 matrices and 600 skinny 8 x 512 ones (each its own group: no layer constraint).
  // The FLOP model prices a skinny one at 1/512 of a square one; measured (this profile) it is 1/50
  // alone and 1/125 in a batch of 8 -- per-call overhead, not multiply-adds (bench/owner_cost_bench
  // measures the same on this CPU).
  std::vector<ParamSpec> ps;
  for (int i = 0; i < 5; ++i) ps.push_back(P("sq" + std::to_string(i), {256, 256}, 4));
  for (int i = 0; i < 600; ++i) ps.push_back(P("sk" + std::to_string(i), {8, 512}, 4));
  auto prof = std::make_shared<NsProfile>();
  prof->timings = {timing(256, 256, 4, 10000), timing(8, 512, 4, 200, 8, 760)};
  PlanOptions flops;
  PlanOptions profiled;
  profiled.owner_cost_model = "profiled";
  profiled.ns_profile = prof;
  const OwnerPlan a = plan_owners(ps, 4, 1, flops), b = plan_owners(ps, 4, 1, profiled);
  ExpectWellFormed(ps, b);
  const double ra = max_over_mean(profiled_slot_us(ps, a, *prof)), rb = max_over_mean(profiled_slot_us(ps, b, *prof));
  EXPECT_LE(rb, 1.01) << "profiled plan's measured max/mean";
  EXPECT_GT(ra, rb + 0.04) << "the FLOP plan should misjudge the skinny matrices here";
  // unit costs: per_matrix + fixed / max(1, k / S), in ns; 600 skinny over 4 slots batch 150 each
  const std::vector<double> c = param_costs(ps, b.options, 4);
  EXPECT_DOUBLE_EQ(c[0], 1e7);
  EXPECT_DOUBLE_EQ(c[5], 1e3 * (80.0 + 120.0 / 150.0));
  EXPECT_DOUBLE_EQ(param_cost(ps[5], b.options), 1e3 * 200.0);  // alone
  // a plan at 10 NS steps scales the profile's 5-step times
  PlanOptions ten = profiled;
  ten.ns_steps = 10;
  EXPECT_DOUBLE_EQ(param_costs(ps, resolve_plan_options(ten), 4)[5], 2e3 * (80.0 + 120.0 / 150.0));
  // the profile is part of the fingerprint: ranks that read different files disagree loudly
  auto other = std::make_shared<NsProfile>(*prof);
  other->timings[1].batch_us = 761;
  PlanOptions profiled2 = profiled;
  profiled2.ns_profile = other;
  EXPECT_NE(plan_owners(ps, 4, 1, profiled2).fingerprint, b.fingerprint);
  EXPECT_EQ(plan_owners(ps, 4, 1, profiled).fingerprint, b.fingerprint);
}

TEST(ProfiledCostModel, NeedsAProfileAndSaysWhereToGetOne) {
  EnvGuard env;
  PlanOptions o;
  o.owner_cost_model = "profiled";
  try {
    resolve_plan_options(o);
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("DMUON_NS_PROFILE"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("dmuon plan --calibrate"), std::string::npos) << e.what();
  }
  // a profile built in code is validated like a file
  auto bad = std::make_shared<NsProfile>();
  bad->timings = {timing(4, 4, 4, std::nan(""))};
  o.ns_profile = bad;
  try {
    resolve_plan_options(o);
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("timings[0]: single_us"), std::string::npos) << e.what();
  }
  o.ns_profile = nullptr;
  ::setenv("DMUON_NS_PROFILE", "/nonexistent/prof.json", 1);
  try {
    resolve_plan_options(o);
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/prof.json"), std::string::npos) << e.what();
  }
}

TEST(ProfiledCostModel, SimulatorPricesEachOwnersBatchFromTheProfile) {
  EnvGuard env;
  HardwareSpec hw = hardware_preset("cpu-2core");
  auto prof = std::make_shared<NsProfile>();
  prof->timings = {timing(256, 256, 4, 10000), timing(8, 512, 4, 100, 8, 380)};
  hw.ns_profile = prof;
  ModelSpec m;
  m.name = "t";
  std::vector<ParamSpec> ps;
  for (int i = 0; i < 4; ++i) ps.push_back(P("layers." + std::to_string(i) + ".sq", {256, 256}, 4));
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) ps.push_back(P("layers." + std::to_string(i) + ".sk" + std::to_string(j), {8, 512}, 4));
  m.params = ps;
  const OwnerPlan plan = plan_owners(ps, 2, 1, PlanOptions{});
  SimLayout l;
  l.shard = 2;
  l.tokens = 256;
  const Simulation sim = simulate_step(m, ps, plan, l, hw);
  const std::vector<double> slots = profiled_slot_us(ps, plan, *prof);
  EXPECT_NEAR(sim.designs[0].ns_s, *std::max_element(slots.begin(), slots.end()) * 1e-6, 1e-12);
  // naive DP Muon: every matrix on every rank, each shape one batch
  EXPECT_NEAR(sim.designs[2].ns_s, (4 * 10000.0 + (60.0 + 40.0 * 24)) * 1e-6, 1e-12);
}


// Owner strategies and cost models are one table each: names round-trip, unknown names are refused,
// and a cost model that prices each matrix alone gives costs() == cost() of each.
TEST(OwnerPlanTest, StrategiesAndCostModelsAreOneTableEach) {
  for (const std::string& n : owner_strategy_names()) {
    const auto s = parse_owner_strategy(n);
    ASSERT_TRUE(s.has_value()) << n;
    EXPECT_EQ(owner_strategy_name(*s), n);
  }
  EXPECT_FALSE(parse_owner_strategy("greedy").has_value());
  EXPECT_EQ(owner_cost_model_names(), (std::vector<std::string>{"optimizer", "numel", "profiled"}));
  for (const std::string& n : owner_cost_model_names()) {
    const auto m = owner_cost_model(n);
    ASSERT_NE(m, nullptr) << n;
    EXPECT_EQ(m->name(), n);
    EXPECT_EQ(m->needs_ns_profile(), n == "profiled");
  }
  EXPECT_EQ(owner_cost_model("flops"), nullptr);
  const std::vector<ParamSpec> ps = {P("a", {64, 256}), P("b", {256, 64}), P("c", {32, 32}, 4)};
  for (const char* n : {"optimizer", "numel"}) {
    ResolvedPlanOptions o;
    o.cost_model = owner_cost_model(n);
    const std::vector<double> all = param_costs(ps, o, 4);
    ASSERT_EQ(all.size(), ps.size());
    for (size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(all[i], param_cost(ps[i], o)) << n << " " << i;
  }
}

}  // namespace
}  // namespace dmuon
