// plan_cmd.cpp -- `dmuon plan`: load a model's parameter list, select the Muon targets, plan their
// owners on a G x R grid and print a report or the whole plan as JSON (docs/PLAN_TOOL.md).
#include "plan_cmd.h"

#include "cli_files.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "dmuon/env.h"
#include "dmuon/files.h"
#include "dmuon/tools/model_specs.h"
#include "dmuon/owner_plan.h"
#include "dmuon/plan_json.h"
#include "dmuon/tools/step_simulator.h"

namespace dmuon::cli {
namespace {

using nlohmann::json;

// A usage error (exit code 2), as opposed to bad input data (exit code 1).
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

std::optional<bool> parse_flag_bool(const std::string& flag, const std::string& value) {
  if (value.empty()) return std::nullopt;
  std::string v = value;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw UsageError(flag + " expects true/false (or 1/0, yes/no, on/off), got '" + value + "'");
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (std::fabs(b) >= 1024.0 && u < 5) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

std::string sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4e", v);
  return buf;
}

std::string fixed(double v, int digits = 3) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string coord(OwnerCoord c) {
  return "(" + std::to_string(c.shard) + "," + std::to_string(c.replicate) + ")";
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string pad(std::string s, size_t w) {  // at least one space after s, so wide numbers stay apart
  s.append(s.size() < w ? w - s.size() : 1, ' ');
  return s;
}
std::string lpad(std::string s, size_t w) {
  if (s.size() < w) s.insert(0, w - s.size(), ' ');
  return s;
}

constexpr int64_t kMaxCliSlots = int64_t{1} << 20;

struct Args {
  std::string model_pos, model, hf_config, params_file;
  bool list_models = false;
  int shard = 8, replicate = 1, tp = 1;
  std::string strategy, cost_model, column_balance, pack;
  int max_owners = 0;
  bool max_owners_set = false;
  int64_t pack_threshold = 5'000'000;
  int ns_steps = 5;
  std::string dtype;
  std::vector<std::string> include, exclude;
  bool as_json = false;
  // --simulate: the step simulator (step_simulator.h)
  bool simulate = false;
  std::string hardware = "h200";
  int64_t tokens = 4194304;
  std::string mode = "z3";
  int prefetch = 1;
  std::string sweep;  // "G=8,64,512"
  bool shard_base = false;
  int show_slots = 16;
  int show_boundaries = 2;
  std::string ns_profile;  // --ns-profile FILE
  // --calibrate FILE: measure this device, write a hardware description with an NS profile
  std::string calibrate, device = "cpu";
  int reps = 5, batch = 8, threads = 0;
};

// ---- --calibrate ---------------------------------------------------------------------------------
// Measures the model's Muon shapes (and the device's matmul rate and memory bandwidth), and writes a
// hardware description: the --hardware one with the measured numbers in place and an "ns_profile".
// The links stay the base description's (named in "source"): --calibrate measures one device.
int run_calibration(std::ostream& out, const std::vector<ParamSpec>& full, const Args& a, const CalibrateFn& fn) {
  const bool cuda_n = a.device.rfind("cuda:", 0) == 0 && a.device.size() > 5 && a.device.size() <= 8 &&
                      a.device.find_first_not_of("0123456789", 5) == std::string::npos;
  if (a.device != "cpu" && a.device != "cuda" && !cuda_n)
    throw UsageError("--device '" + a.device + "': --calibrate measures the CPU (cpu) or a GPU (cuda, or cuda:N for "
                     "GPU N)");
  if (!fn)
    throw UsageError("--calibrate measures this device with LibTorch; this dmuon was built without it "
                     "(plan-only). Use the full build's `dmuon plan --calibrate`");
  if (a.reps < 1 || a.batch < 2 || a.threads < 0)
    throw UsageError("--reps must be >= 1, --batch >= 2 and --threads >= 0");
  if (full.empty()) throw UsageError("--calibrate: the model has no Muon targets to measure");
  const HardwareSpec base = load_hardware(a.hardware);  // before measuring: a typo costs nothing
  CalibrationRequest req;
  req.device = a.device;
  req.reps = a.reps;
  req.batch = a.batch;
  req.ns_steps = a.ns_steps;
  req.threads = a.threads;
  for (const ParamSpec& p : full) {
    const int64_t m = p.shape.size() >= 2 ? p.shape[0] : 1;
    req.shapes.push_back({m, m > 0 ? p.numel() / m : 0, p.elem_bytes});
    if (p.tp_split_dim >= 0 && a.tp > 1) {  // the TP slice the DP stage plans, too
      std::vector<int64_t> local = p.shape;
      local[static_cast<size_t>(p.tp_split_dim)] /= a.tp;
      const int64_t lm = local.size() >= 2 ? local[0] : 1;
      int64_t numel = 1;
      for (int64_t d : local) numel *= d;
      req.shapes.push_back({lm, lm > 0 ? numel / lm : 0, p.elem_bytes});
    }
  }
  const CalibrationResult r = fn(req, out);
  // NS efficiency: the largest measured shape's multiply rate against the matmul rate (<= 1); square
  // shapes first (they run the direct form, whose FLOPs ns_flops counts; the Gram form needs fewer)
  double eff = base.ns_efficiency;
  std::pair<bool, double> best{false, 0};
  for (const NsTiming& t : r.profile.timings) {
    const double fl = ns_flops({t.rows, t.cols}, r.profile.ns_steps);
    const std::pair<bool, double> rank{t.rows == t.cols, fl};
    if (rank > best && r.matmul_tflops > 0) {
      best = rank;
      eff = std::min(1.0, fl / (t.single_us * 1e-6) / (r.matmul_tflops * 1e12));
    }
  }
  HardwareSpec h = base;
  h.name = "calibrated-" + r.profile.device;
  h.source = "measured by `dmuon plan --calibrate` on " + r.profile.device + ": " + r.describe +
             "; NS efficiency from the largest measured (square, if any) shape; links, mfu, devices per node and memory "
             "from '" + base.name + "' (" + base.source + ")";
  h.matmul_tflops = r.matmul_tflops;
  h.ns_efficiency = eff;
  h.memory_bandwidth_GBps = r.memory_bandwidth_GBps;
  h.ns_profile = std::make_shared<const NsProfile>(r.profile);
  if (req.device == "cpu" && base.cores_per_node > 0) {
    // the rates are one rank's of `threads` threads: the host runs cores / threads such ranks at once
    const long cores = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
    h.cores_per_node = static_cast<int>(std::max(1L, cores / (a.threads > 0 ? a.threads : cores)));
    h.source += "; cores_per_node " + std::to_string(h.cores_per_node) + " (this host's " + std::to_string(cores) +
                " cores over --threads " + std::to_string(a.threads) + ")";
  }
  const json j = json::parse(hardware_to_json(h));
  hardware_from_json(j.dump(), a.calibrate);  // what is written reads back: checked before it replaces anything
  write_file_atomically(a.calibrate, j.dump(2) + "\n", "--calibrate");
  out << "calibration: " << r.describe << ", NS efficiency " << fixed(eff, 3) << "\n"
      << "  " << pad("shape", 16) << pad("elem", 6) << pad("single us", 12) << pad("batch", 7) << pad("batch us", 12)
      << pad("fixed us", 10) << "per-matrix us\n";
  for (const NsTiming& t : r.profile.timings) {
    const NsCost c = r.profile.cost_of(t.rows, t.cols, t.elem_bytes);
    out << "  " << pad(std::to_string(t.rows) + "x" + std::to_string(t.cols), 16) << pad(std::to_string(t.elem_bytes), 6)
        << pad(fixed(t.single_us, 1), 12) << pad(std::to_string(t.batch), 7)
        << pad(t.batch >= 2 ? fixed(t.batch_us, 1) : "-", 12) << pad(fixed(c.fixed_us, 1), 10)
        << fixed(c.per_matrix_us, 1) << "\n";
  }
  out << "wrote " << a.calibrate << " (use: --hardware " << a.calibrate << " --simulate, --owner-cost-model profiled "
      << "--ns-profile " << a.calibrate << ", or DMUON_NS_PROFILE=" << a.calibrate << ")\n";
  return 0;
}

// ---- --simulate ----------------------------------------------------------------------------------
json estimate_json(const StepEstimate& e) {
  return json{{"design", e.design},
              {"step_ms", e.step_s * 1e3},
              {"compute_ms", e.compute_s * 1e3},
              {"exposed_comm_ms", e.exposed_comm_s * 1e3},
              {"forward_ms", e.forward_s * 1e3},
              {"backward_ms", e.backward_s * 1e3},
              {"ns_ms", e.ns_s * 1e3},
              {"adamw_ms", e.adamw_s * 1e3},
              {"replicate_or_gather_ms", e.replicate_s * 1e3},
              {"verdict_ms", e.verdict_s * 1e3},
              {"bytes_per_rank", e.bytes_per_rank},
              {"inter_node_bytes_per_rank", e.inter_node_bytes_per_rank},
              {"memory_bytes_per_rank", e.memory_bytes_per_rank},
              {"dominant", e.dominant}};
}

std::vector<int> sweep_values(const std::string& sweep, int shard) {
  if (sweep.empty()) return {shard};
  std::string s = sweep;
  if (s.rfind("G=", 0) == 0 || s.rfind("g=", 0) == 0) s = s.substr(2);
  std::vector<int> out;
  std::stringstream ss(s);
  for (std::string tok; std::getline(ss, tok, ',');) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != tok.size() || v < 1)
      throw UsageError("--sweep expects G=<shard sizes>, e.g. G=8,64,512; '" + tok + "' is not a size >= 1");
    out.push_back(v);
  }
  if (out.empty()) throw UsageError("--sweep expects G=<shard sizes>, e.g. G=8,64,512");
  return out;
}

int run_simulation(std::ostream& out, const ModelSpec& model, const std::vector<ParamSpec>& full,
                   const PlanOptions& opts, const Args& a) {
  if (a.tokens < 1) throw UsageError("--tokens must be >= 1, got " + std::to_string(a.tokens));
  if (a.mode != "z3" && a.mode != "z2") throw UsageError("--mode must be z3 or z2, got '" + a.mode + "'");
  if (a.prefetch < 0) throw UsageError("--prefetch must be >= 0, got " + std::to_string(a.prefetch));
  const HardwareSpec hw = load_hardware(a.hardware);
  json all = json::array();
  std::ostringstream text;
  const auto gs = sweep_values(a.sweep, a.shard);
  bool header = false;
  for (int G : gs) {
    if (static_cast<int64_t>(G) * a.replicate * a.tp > kMaxCliSlots)
      throw UsageError("--sweep: G = " + std::to_string(G) + " gives more than " + std::to_string(kMaxCliSlots) +
                       " owner slots");
    const OwnerPlan plan = plan_owners_tp(full, G, a.replicate, a.tp, opts);
    std::vector<ParamSpec> params = full;
    for (auto& p : params)
      if (p.tp_split_dim >= 0) p.shape[static_cast<size_t>(p.tp_split_dim)] /= a.tp;
    SimLayout l;
    l.shard = G;
    l.replicate = a.replicate;
    l.tp = a.tp;
    l.z3 = a.mode == "z3";
    l.tokens = a.tokens;
    l.prefetch_depth = a.prefetch;
    l.ns_steps = a.ns_steps;
    l.shard_base = a.shard_base;
    const Simulation sim = simulate_step(model, params, plan, l, hw);
    json rows = json::array();
    for (const auto& e : sim.designs) rows.push_back(estimate_json(e));
    all.push_back({{"shard", G}, {"replicate", a.replicate}, {"tp", a.tp}, {"devices", sim.devices},
                   {"overhead_vs_adamw", sim.overhead_vs_adamw()}, {"designs", rows}});
    if (!header) {
      text << "step simulation: " << model.name << " (" << sci(static_cast<double>(sim.params)) << " params, "
           << sci(static_cast<double>(sim.muon_params)) << " in Muon matrices), " << a.tokens
           << " tokens per step, " << (l.z3 ? "DMuon-Z3" : "DMuon-Z2")
           << (a.shard_base ? " with sharded base" : " with replicated base") << ", prefetch " << a.prefetch << "\n"
           << "  hardware " << hw.name << ": " << hw.source << "\n"
           << "  (model state only in memory: activations depend on the batch split and are not counted)\n";
      header = true;
    }
    text << "\n  " << sim.devices << " x " << hw.name << " (G=" << G << " R=" << a.replicate << " T=" << a.tp
         << ", " << hw.devices_per_node << " per node"
         << (hw.cores_per_node > 0 ? ", time-sharing " + std::to_string(hw.cores_per_node) + " cores per node" : "")
         << ")\n"
         << "  " << pad("design", 18) << pad("step ms", 11) << pad("compute", 10) << pad("exp.comm", 10) << pad("NS", 9)
         << pad("AdamW", 8) << pad("repl/ag", 9) << pad("GB/rank", 9) << pad("inter GB", 9) << "mem GiB/rank\n";
    for (const auto& e : sim.designs)
      text << "  " << pad(e.design, 18) << pad(fixed(e.step_s * 1e3, 1), 11) << pad(fixed(e.compute_s * 1e3, 1), 10)
           << pad(fixed(e.exposed_comm_s * 1e3, 1), 10) << pad(fixed(e.ns_s * 1e3, 1), 9)
           << pad(fixed(e.adamw_s * 1e3, 1), 8) << pad(fixed(e.replicate_s * 1e3, 1), 9)
           << pad(fixed(e.bytes_per_rank / 1e9, 2), 9) << pad(fixed(e.inter_node_bytes_per_rank / 1e9, 2), 9)
           << fixed(e.memory_bytes_per_rank / (1024.0 * 1024 * 1024), 2) << "\n";
    const double ov = sim.overhead_vs_adamw();
    text << "  DMuon overhead over FSDP AdamW: " << (ov >= 0 ? "+" : "") << fixed(100 * ov, 2) << "% (step "
         << fixed(sim.designs[0].step_s * 1e3, 1) << " vs " << fixed(sim.designs[1].step_s * 1e3, 1)
         << " ms); largest term beyond compute: " << sim.designs[0].dominant << "\n";
  }
  if (a.as_json)
    out << json{{"model", model.name}, {"hardware", {{"name", hw.name}, {"source", hw.source}}},
                {"tokens", a.tokens}, {"mode", a.mode}, {"layouts", all}}
               .dump(2)
        << "\n";
  else
    out << text.str();
  return 0;
}

json options_json(const ResolvedPlanOptions& o) {
  return json{{"owner_strategy", owner_strategy_name(o.owner_strategy)},
              {"owner_cost_model", o.cost_model->name()},
              {"hsdp_column_balance", o.hsdp_column_balance},
              {"pack_small_params", o.pack_small_params},
              {"max_owners_per_group",
               o.max_owners_per_group ? json(*o.max_owners_per_group) : json(nullptr)},
              {"pack_threshold_numel", o.pack_threshold_numel},
              {"ns_steps", o.ns_steps}};
}

json owner_json(OwnerCoord c) { return json::array({c.shard, c.replicate}); }

// Which packing variant the planner kept (OwnerPlan::pack_cap): "off" (pack_small_params false),
// "per_matrix" (packing would have cost more than 1%, so none), "uncapped" (one unit per group's
// small matrices), "capped" (packed units of at most cost_cap).
std::string packing_mode(const OwnerPlan& plan) {
  if (!plan.options.pack_small_params) return "off";
  if (plan.pack_cap <= 0) return "per_matrix";
  return std::isinf(plan.pack_cap) ? "uncapped" : "capped";
}

// Tensor parallelism: the Megatron split of the Muon targets and the TP Newton-Schulz exchange per
// step (gather + scatter of each split matrix's slices, a broadcast of each whole matrix's update, in
// fp32: the optimizer dtype of the momentum-update input), per rank of the G x R x T grid.
struct TpSummary {
  int column = 0, row = 0, whole = 0;
  double exchange_mean = 0, exchange_max = 0;
};
TpSummary tp_summary(const std::vector<ParamSpec>& local, const OwnerPlan& plan) {
  TpSummary s;
  for (const ParamSpec& p : local) (p.tp_split_dim == 0 ? s.column : p.tp_split_dim == 1 ? s.row : s.whole)++;
  const std::vector<int64_t> per_rank = plan_tp_exchange(local, plan, {4});
  for (int64_t b : per_rank) {
    s.exchange_mean += static_cast<double>(b) / static_cast<double>(per_rank.size());
    s.exchange_max = std::max(s.exchange_max, static_cast<double>(b));
  }
  return s;
}

json packing_json(const OwnerPlan& plan) {
  const std::string mode = packing_mode(plan);
  return json{{"mode", mode},
              {"cost_cap", mode == "capped" ? json(plan.pack_cap) : json(nullptr)},
              {"packed_units", plan.packed_units},
              {"per_matrix_makespan",
               plan.per_matrix_makespan > 0 ? json(plan.per_matrix_makespan) : json(nullptr)}};
}

json plan_json(const ModelSpec& model, const std::vector<ParamSpec>& params, const OwnerPlan& plan,
               const CommPlan& comm) {
  json j;
  j["model"] = model.name;
  j["shard_size"] = plan.shard_size;
  j["replicate_size"] = plan.replicate_size;
  j["num_slots"] = plan.num_slots();
  j["options"] = options_json(plan.options);
  json jp = json::array();
  const std::vector<double> costs = param_costs(params, plan.options, plan.num_slots());  // the planner's
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    jp.push_back(json{{"name", p.name},
                      {"shape", p.shape},
                      {"elem_bytes", p.elem_bytes},
                      {"bytes", p.bytes()},
                      {"cost", costs[i]},
                      {"group", plan.groups[i]},
                      {"boundary", default_boundary_of(p.name)},
                      {"unit", plan.unit_of_param[i]},
                      {"owner", owner_json(plan.owners[i])}});
    if (plan.tp_size > 1) {
      jp.back()["tp_split_dim"] = p.tp_split_dim;
      jp.back()["tp_owner"] = plan.tp_owners[i];
    }
  }
  j["params"] = std::move(jp);
  std::vector<std::string> others;
  for (const ParamSpec& p : model.params)
    if (std::none_of(params.begin(), params.end(),
                     [&](const ParamSpec& q) { return q.name == p.name; }))
      others.push_back(p.name);
  j["non_muon_params"] = others;
  json ju = json::array();
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const AllocationUnit& unit = plan.units[u];
    ju.push_back(json{{"index", u},
                      {"group", unit.group},
                      {"params", unit.params},
                      {"cost", unit.cost},
                      {"bytes", unit.bytes},
                      {"owner", owner_json(unit.owner)}});
  }
  j["units"] = std::move(ju);
  json js = json::array();
  for (size_t s = 0; s < plan.slots.size(); ++s) {
    const SlotLoad& sl = plan.slots[s];
    js.push_back(json{{"index", s},
                      {"owner", owner_json(sl.owner)},
                      {"cost", sl.cost},
                      {"bytes", sl.bytes},
                      {"units", sl.units},
                      {"params", sl.params}});
  }
  j["slots"] = std::move(js);
  j["column_cost"] = plan.column_cost;
  j["column_bytes"] = plan.column_bytes;
  j["total_cost"] = plan.total_cost;
  j["total_bytes"] = plan.total_bytes;
  j["makespan"] = plan.makespan;
  j["lower_bound"] = plan.lower_bound;
  j["largest_param_cost"] = plan.largest_param_cost;
  j["packing"] = packing_json(plan);
  j["granularity_bound"] = plan.granularity_bound;
  j["imbalance"] = plan.imbalance();
  j["violations"] = plan.violations;
  j["fingerprint"] = format_fingerprint(plan.fingerprint);
  if (plan.tp_size > 1) {
    const TpSummary tp = tp_summary(params, plan);
    j["tp"] = json{{"tp_size", plan.tp_size},
                   {"num_slots", plan.tp_slot_cost.size()},
                   {"column_parallel", tp.column},
                   {"row_parallel", tp.row},
                   {"whole", tp.whole},
                   {"makespan", plan.tp_makespan},
                   {"lower_bound", plan.tp_lower_bound},
                   {"imbalance", plan.tp_imbalance()},
                   {"exchange_bytes_per_rank_mean", tp.exchange_mean},
                   {"exchange_bytes_per_rank_max", tp.exchange_max}};
  }

  j["comm"] = comm_plan_json(comm);
  return j;
}

void print_report(std::ostream& out, const ModelSpec& model, const std::vector<ParamSpec>& params,
                  const OwnerPlan& plan, const CommPlan& comm, const Args& a, double plan_ms) {
  const ResolvedPlanOptions& o = plan.options;
  const int G = plan.shard_size, R = plan.replicate_size, S = plan.num_slots();
  out << "dmuon plan: " << model.name << "\n";
  out << "  parameters " << model.params.size() << ", Muon targets " << params.size()
      << ", allocation units " << plan.units.size() << ", P_M = " << human_bytes(plan.total_bytes)
      << " (" << plan.total_bytes << " bytes)\n";
  out << "  grid G=" << G << " shard x R=" << R << " replicate = " << S << " owner slots\n";
  out << "  options owner_strategy=" << owner_strategy_name(o.owner_strategy)
      << " owner_cost_model=" << o.cost_model->name()
      << " hsdp_column_balance=" << (o.hsdp_column_balance ? "true" : "false")
      << " pack_small_params=" << (o.pack_small_params ? "true" : "false")
      << " max_owners_per_group="
      << (o.max_owners_per_group ? std::to_string(*o.max_owners_per_group) : "none")
      << " pack_threshold=" << o.pack_threshold_numel << " ns_steps=" << o.ns_steps << "\n\n";

  out << "balance (cost = " << o.cost_model->unit(o) << ")\n";
  out << "  makespan " << sci(plan.makespan) << ", lower bound " << sci(plan.lower_bound)
      << " = max(total/slots, largest matrix)\n";
  out << "  imbalance = makespan / lower bound = " << fixed(plan.imbalance()) << "\n";
  const std::string mode = packing_mode(plan);
  out << "  packing ";
  if (mode == "off") {
    out << "off (every matrix is its own unit)\n";
  } else if (mode == "per_matrix") {
    out << "dropped: packing small matrices would raise the makespan by more than 1%, so every "
           "matrix is its own unit\n";
  } else {
    int packed_params = 0;
    for (const AllocationUnit& u : plan.units)
      if (u.params.size() > 1) packed_params += static_cast<int>(u.params.size());
    out << plan.packed_units << " packed units hold " << packed_params << " small matrices ("
        << (mode == "uncapped" ? std::string("one unit per layer")
                               : "units of cost <= " + sci(plan.pack_cap))
        << "); ";
    if (plan.per_matrix_makespan > 0)
      out << "makespan / per-matrix plan's = " << fixed(plan.makespan / plan.per_matrix_makespan, 4)
          << " (kept: <= 1.01)\n";
    else
      out << "within 1% of the lower bound, so within 1% of any plan\n";
  }
  out << "  granularity floor " << fixed(plan.granularity_bound / std::max(plan.lower_bound, 1e-300))
      << " (no assignment of these units can do better; this plan is at "
      << fixed(plan.granularity_imbalance()) << "x of it)\n";
  out << "  violations: " << (plan.violations.empty() ? "none" : "") << "\n";
  for (const std::string& v : plan.violations) out << "    - " << v << "\n";
  out << "  fingerprint " << format_fingerprint(plan.fingerprint) << "\n\n";
  if (plan.tp_size > 1) {
    const TpSummary tp = tp_summary(params, plan);
    out << "tensor parallelism (T = " << plan.tp_size << ", Megatron layout; shapes below are TP slices)\n"
        << "  split " << tp.column << " column-parallel + " << tp.row << " row-parallel matrices, " << tp.whole
        << " whole on every TP rank\n"
        << "  NS on the full matrix by a TP owner: " << plan.tp_slot_cost.size() << " slots (G x R x T), makespan "
        << sci(plan.tp_makespan) << ", lower bound " << sci(plan.tp_lower_bound) << ", imbalance "
        << fixed(plan.tp_imbalance()) << "\n"
        << "  TP exchange per step (fp32 gather + scatter of slices, broadcast of whole updates): mean "
        << human_bytes(tp.exchange_mean) << ", max " << human_bytes(tp.exchange_max) << " per rank\n\n";
  }

  // Per-slot load: all slots when few, else the most and least loaded.
  std::vector<int> order(S);
  for (int s = 0; s < S; ++s) order[s] = s;
  std::vector<int> shown = order;
  const bool all = a.show_slots <= 0 || S <= a.show_slots;
  if (!all) {
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
      return plan.slots[x].cost > plan.slots[y].cost;
    });
    const int half = std::max(1, a.show_slots / 2);
    shown.assign(order.begin(), order.begin() + half);
    shown.insert(shown.end(), order.end() - half, order.end());
  }
  out << "per-slot load" << (all ? "" : " (most and least loaded; --show-slots 0 for all)") << "\n";
  out << "  " << pad("slot", 7) << pad("owner", 12) << lpad("cost", 12) << lpad("/ mean", 9)
      << lpad("bytes", 14) << lpad("units", 7) << lpad("params", 8) << "\n";
  const double mean = S ? plan.total_cost / S : 0.0;
  for (size_t i = 0; i < shown.size(); ++i) {
    if (!all && i == shown.size() / 2) out << "  ...\n";
    const SlotLoad& sl = plan.slots[shown[i]];
    out << "  " << pad(std::to_string(shown[i]), 7) << pad(coord(sl.owner), 12)
        << lpad(sci(sl.cost), 12) << lpad(fixed(mean > 0 ? sl.cost / mean : 0.0), 9)
        << lpad(human_bytes(static_cast<double>(sl.bytes)), 14) << lpad(std::to_string(sl.units), 7)
        << lpad(std::to_string(sl.params), 8) << "\n";
  }
  int empty = 0;
  for (const SlotLoad& sl : plan.slots) empty += sl.units == 0;
  if (empty) out << "  " << empty << " of " << S << " slots own nothing\n";
  out << "\n";

  out << "communication per step per rank (N = G = " << G << ", P_M = " << human_bytes(comm.muon_bytes)
      << ")\n";
  out << "  " << pad("", 22) << lpad("DMuon mean", 14) << lpad("DMuon max", 14)
      << lpad("FSDP-equiv.", 14) << "  formula\n";
  out << "  " << pad("Z2 (shard axis)", 22) << lpad(human_bytes(comm.mean_z2()), 14)
      << lpad(human_bytes(static_cast<double>(comm.max_z2())), 14)
      << lpad(human_bytes(comm.formula_z2), 14) << "  2(N-1)/N*P_M\n";
  out << "  " << pad("Z3 (shard axis)", 22) << lpad(human_bytes(comm.mean_z3()), 14)
      << lpad(human_bytes(static_cast<double>(comm.max_z3())), 14)
      << lpad(human_bytes(comm.formula_z3), 14) << "  3(N-1)/N*P_M\n";
  if (R > 1)
    out << "  " << pad("replicate (HSDP)", 22) << lpad(human_bytes(comm.mean_replicate()), 14)
        << lpad(human_bytes(static_cast<double>(comm.max_replicate())), 14)
        << lpad(human_bytes(comm.formula_replicate), 14) << "  2(R-1)/R*P_M/G\n";
  size_t min_roots = comm.boundaries.empty() ? 0 : SIZE_MAX, max_roots = 0;
  for (const BoundaryComm& b : comm.boundaries) {
    min_roots = std::min(min_roots, b.roots.size());
    max_roots = std::max(max_roots, b.roots.size());
  }
  out << "  hook boundaries " << comm.boundaries.size() << ", concurrent roots per boundary "
      << min_roots << ".." << max_roots << "\n";
  const size_t nb = std::min<size_t>(comm.boundaries.size(), std::max(0, a.show_boundaries));
  for (size_t i = 0; i < nb; ++i) {
    const BoundaryComm& b = comm.boundaries[i];
    out << "  " << b.boundary << ": payload " << human_bytes(static_cast<double>(b.payload_bytes))
        << ", fwd broadcast " << human_bytes(static_cast<double>(b.fwd_broadcast_bytes))
        << " over the shard group\n";
    for (const RootPayload& r : b.roots) {
      out << "    root " << pad(coord(r.root), 10) << lpad(human_bytes(static_cast<double>(r.bytes)), 12)
          << "  ";
      for (size_t k = 0; k < r.params.size(); ++k) {
        const std::string& n = params[r.params[k]].name;
        const std::string shortn = n.rfind(b.boundary + ".", 0) == 0 ? n.substr(b.boundary.size() + 1) : n;
        out << (k ? ", " : "") << shortn << " " << shape_str(params[r.params[k]].shape);
      }
      out << "\n";
    }
  }
  if (comm.boundaries.size() > nb)
    out << "  ... (" << comm.boundaries.size() - nb << " more; --show-boundaries N, or --json)\n";
  out << "\nplanned in " << fixed(plan_ms, 2) << " ms\n";
}

int run(const std::vector<std::string>& argv, std::ostream& out, const CalibrateFn& calibrate) {
  Args a;
  CLI::App app{"Plan which rank owns each Muon matrix, offline, for any model and cluster size.\n"
               "Model: a preset (--model), a Hugging Face config.json (--hf-config) or a parameter\n"
               "list (--params). Unset planner options fall back to DMUON_OWNER_STRATEGY,\n"
               "DMUON_OWNER_COST_MODEL, DMUON_HSDP_COLUMN_BALANCE, DMUON_OWNER_PACK_SMALL_PARAMS.",
               "dmuon plan"};
  app.add_option("model", a.model_pos, "Preset name (same as --model)");
  app.add_option("-m,--model", a.model, "Built-in preset (see --list-models)");
  app.add_option("--hf-config", a.hf_config,
                 "Hugging Face config.json (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, "
                 "qwen3_moe, deepseek_v2, deepseek_v3, gpt2)");
  app.add_option("--params", a.params_file,
                 "JSON parameter list: [{\"name\": ..., \"shape\": [...], \"dtype\": \"bf16\"}]");
  app.add_flag("--list-models", a.list_models, "List the presets and exit");
  app.add_option("-G,--shard", a.shard, "Shard ranks G (default 8)");
  app.add_option("-R,--replicate", a.replicate, "Replicate groups R (HSDP; default 1)");
  app.add_option("-T,--tp", a.tp, "Tensor-parallel ranks T (Megatron split of q/k/v, gate/up, o, down; default 1)");
  app.add_option("--owner-strategy", a.strategy, "lpt (default) | round_robin | rank0");
  app.add_option("--owner-cost-model", a.cost_model,
                 "optimizer (default) | numel | profiled (measured NS times: --ns-profile, or the --hardware file's)");
  app.add_option("--ns-profile", a.ns_profile, "NS profile (or calibrated hardware description) for --owner-cost-model profiled");
  app.add_option("--calibrate", a.calibrate,
                 "Measure this device (NS per shape of the model's Muon targets, matmul rate, memory bandwidth) and write "
                 "a hardware description with an NS profile to FILE");
  app.add_option("--device", a.device, "--calibrate: cpu (default) or cuda[:N]");
  app.add_option("--reps", a.reps, "--calibrate: timed repetitions per shape (median; default 5)");
  app.add_option("--batch", a.batch, "--calibrate: matrices in a shape's batched measurement (default 8)");
  app.add_option("--threads", a.threads, "--calibrate: LibTorch threads (0 = its default; a rank of N on one box: cores / N)");
  app.add_option("--hsdp-column-balance", a.column_balance, "true (default) | false");
  app.add_option("--pack-small-params", a.pack, "true (default) | false");
  auto* mo = app.add_option("--max-owners-per-group", a.max_owners,
                            "Cap on distinct owner slots per assignment group");
  app.add_option("--pack-threshold", a.pack_threshold,
                 "Parameters with fewer elements are packed per layer (default 5000000)");
  app.add_option("--ns-steps", a.ns_steps, "Newton-Schulz steps in the optimizer cost (default 5)");
  app.add_option("--dtype", a.dtype,
                 "Element type of the parameters: bf16 (default), fp16, fp32, fp64, fp8 (--hf-config: "
                 "torch_dtype unless given)");
  app.add_option("--include", a.include,
                 "Muon targets = >=2-D params whose name matches (substring, or glob with * ?); "
                 "replaces the default rule; repeatable")
      ->allow_extra_args(false);
  app.add_option("--exclude", a.exclude, "Drop matching params from the Muon targets; repeatable")
      ->allow_extra_args(false);
  app.add_flag("--json", a.as_json, "Print the whole plan as JSON (schema: docs/PLAN_TOOL.md)");
  app.add_flag("--simulate", a.simulate,
               "Project the step time on a cluster: DMuon vs FSDP AdamW, naive DP Muon and round-robin owners");
  app.add_option("--hardware", a.hardware, "--simulate: h200 (default), cpu-2core, or a JSON description file");
  app.add_option("--tokens", a.tokens, "--simulate: tokens per optimizer step over the cluster (default 4194304)");
  app.add_option("--mode", a.mode, "--simulate: z3 (default) or z2");
  app.add_option("--prefetch", a.prefetch, "--simulate: forward prefetch depth (default 1)");
  app.add_flag("--shard-base", a.shard_base, "--simulate: the non-matrix parameters on sharded_adamw (dmuon train --shard-base)");
  app.add_option("--sweep", a.sweep, "--simulate: a list of shard sizes, e.g. G=8,64,512 (replaces -G)");
  app.add_option("--show-slots", a.show_slots, "Slots listed in the report (default 16; 0 = all)");
  app.add_option("--show-boundaries", a.show_boundaries,
                 "Hook boundaries listed with their roots (default 2)");

  std::vector<std::string> rev(argv.rbegin(), argv.rend());
  try {
    app.parse(rev);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    return 0;
  }
  a.max_owners_set = mo->count() > 0;

  if (a.list_models) {
    for (const ModelPresetInfo& p : model_preset_infos())
      out << pad(p.name, 16) << p.description << "\n";
    return 0;
  }
  if (!a.model_pos.empty()) {
    if (!a.model.empty() && a.model != a.model_pos)
      throw UsageError("two models given: '" + a.model_pos + "' and --model '" + a.model + "'");
    a.model = a.model_pos;
  }
  const int sources = !a.model.empty() + !a.hf_config.empty() + !a.params_file.empty();
  if (sources != 1)
    throw UsageError(std::string(sources ? "more than one model given" : "no model given") +
                     ": choose exactly one of --model NAME, --hf-config FILE, --params FILE "
                     "(--list-models lists the presets)");
  if (a.shard < 1) throw UsageError("--shard must be >= 1, got " + std::to_string(a.shard));
  if (a.replicate < 1)
    throw UsageError("--replicate must be >= 1, got " + std::to_string(a.replicate));
  // A sane world size, checked before anything is loaded or planned: the report and the JSON
  // hold per-slot and per-rank tables, so a typo like -G 100000000 would otherwise take minutes
  // and gigabytes. 2^20 owner slots is far beyond any real cluster.
  if (a.tp < 1) throw UsageError("--tp must be >= 1, got " + std::to_string(a.tp));
  if (static_cast<int64_t>(a.shard) * a.replicate * a.tp > kMaxCliSlots)
    throw UsageError("--shard x --replicate x --tp = " +
                     std::to_string(static_cast<int64_t>(a.shard) * a.replicate * a.tp) +
                     " owner slots, above the limit of " + std::to_string(kMaxCliSlots) +
                     " (no real cluster is that large and the per-rank tables would not fit); "
                     "check --shard, --replicate and --tp");
  if (a.max_owners_set && a.max_owners < 1)
    throw UsageError("--max-owners-per-group must be >= 1, got " + std::to_string(a.max_owners));
  if (a.pack_threshold < 0)
    throw UsageError("--pack-threshold must be >= 0, got " + std::to_string(a.pack_threshold));
  if (a.ns_steps < 1) throw UsageError("--ns-steps must be >= 1, got " + std::to_string(a.ns_steps));
  if (!a.dtype.empty()) {
    try {
      (void)dtype_bytes(a.dtype);
    } catch (const std::invalid_argument& e) {
      throw UsageError(std::string("--dtype: ") + e.what());
    }
  }
  if (a.show_slots < 0)
    throw UsageError("--show-slots must be >= 0, got " + std::to_string(a.show_slots));
  if (a.show_boundaries < 0)
    throw UsageError("--show-boundaries must be >= 0, got " + std::to_string(a.show_boundaries));

  // the input files checked before any is read (a FIFO or a device would block the read, a directory
  // would read as empty JSON)
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--hf-config", a.hf_config},
                                   {"--params", a.params_file}, {"--ns-profile", a.ns_profile},
                                   {"--hardware", a.hardware}})
    if (!path.empty() && std::filesystem::exists(path))  // a missing one: the loader's "cannot open"
      if (const std::string why = input_file_problem(path); !why.empty())
        throw UsageError(std::string(flag) + " " + path + ": " + why);

  PlanOptions opts;
  if (!a.strategy.empty()) opts.owner_strategy = a.strategy;
  if (!a.cost_model.empty()) opts.owner_cost_model = a.cost_model;
  opts.hsdp_column_balance = parse_flag_bool("--hsdp-column-balance", a.column_balance);
  opts.pack_small_params = parse_flag_bool("--pack-small-params", a.pack);
  if (a.max_owners_set) opts.max_owners_per_group = a.max_owners;
  if (!a.ns_profile.empty()) {
    opts.ns_profile = std::make_shared<const NsProfile>(load_ns_profile(a.ns_profile));
  } else if (a.cost_model == "profiled" || (a.cost_model.empty() && env::owner_cost_model() == "profiled")) {
    // no --ns-profile: DMUON_NS_PROFILE (read by the planner), else a calibrated --hardware file's
    if (env::ns_profile().empty())
      if (const HardwareSpec hw = load_hardware(a.hardware); hw.ns_profile) opts.ns_profile = hw.ns_profile;
  }
  opts.pack_threshold_numel = a.pack_threshold;
  opts.ns_steps = a.ns_steps;

  if (!a.calibrate.empty())  // before minutes of measuring
    if (const std::string why = output_file_problem(a.calibrate); !why.empty())
      throw UsageError("--calibrate " + a.calibrate + ": " + why);

  ModelSpec model;
  if (!a.model.empty()) model = model_preset(a.model, a.dtype.empty() ? "bf16" : a.dtype);
  else if (!a.hf_config.empty()) model = load_hf_config(a.hf_config, a.dtype);
  else model = load_params_json(a.params_file, a.dtype.empty() ? "bf16" : a.dtype);

  MuonTargetSelector selector;
  selector.include = a.include;
  selector.exclude = a.exclude;
  if (model.params.empty())
    throw UsageError((a.params_file.empty() ? std::string("the model") : "--params " + a.params_file) +
                     " has no parameters; a parameter list needs at least one entry");
  std::vector<ParamSpec> full = select_muon_params(model, selector);
  if (full.empty() && !a.include.empty())
    throw UsageError("--include matches no parameter of at least 2 dimensions of the model (" +
                     std::to_string(model.params.size()) + " parameters, e.g. '" + model.params.front().name +
                     "'); patterns are substrings or globs with * and ?");
  for (auto& p : full) p.tp_split_dim = megatron_tp_split_dim(p, a.tp);

  if (!a.calibrate.empty()) return run_calibration(out, full, a, calibrate);
  const auto t0 = std::chrono::steady_clock::now();
  const OwnerPlan plan = plan_owners_tp(full, a.shard, a.replicate, a.tp, opts);
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<ParamSpec> params = full;  // what each TP rank's DP routes hold: the slices
  for (auto& p : params)
    if (p.tp_split_dim >= 0) p.shape[static_cast<size_t>(p.tp_split_dim)] /= a.tp;
  const CommPlan comm = plan_comm(params, plan);
  const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();

  if (a.simulate) return run_simulation(out, model, full, opts, a);
  if (a.as_json) out << plan_json(model, params, plan, comm).dump(2) << "\n";
  else print_report(out, model, params, plan, comm, a, ms);
  return 0;
}

}  // namespace

int run_plan_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
                     const CalibrateFn& calibrate) {
  try {
    return run(args, out, calibrate);
  } catch (const CLI::ParseError& e) {
    err << "error: " << one_line(e.what()) << " (dmuon plan --help lists the options)\n";
    return 2;
  } catch (const UsageError& e) {
    err << "error: " << one_line(e.what()) << "\n";
    return 2;
  } catch (const std::exception& e) {
    err << "error: " << one_line(e.what()) << "\n";
    return 1;
  } catch (...) {
    err << "error: unknown failure in dmuon plan\n";
    return 1;
  }
}

}  // namespace dmuon::cli
