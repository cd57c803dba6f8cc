// The step simulator (see include/dmuon/tools/step_simulator.h).
#include "dmuon/tools/step_simulator.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "env/json_text.h"

namespace dmuon {

namespace {

using json = nlohmann::json;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

double log2_hops(int n) { return n <= 1 ? 0.0 : std::ceil(std::log2(static_cast<double>(n))); }

// Time of one rooted collective (broadcast or reduce) of a boundary over a group of n ranks:
// root-bottlenecked per owner, concurrent owners limited by each rank's receive rate.
double rooted_time(const std::vector<double>& root_bytes, int n, const LinkSpec& link) {
  if (n <= 1 || root_bytes.empty()) return 0.0;
  double total = 0, largest = 0;
  for (double b : root_bytes) {
    total += b;
    largest = std::max(largest, b);
  }
  const double bw = link.bandwidth_GBps * 1e9;
  return link.latency_us * 1e-6 * log2_hops(n) +
         std::max(largest, static_cast<double>(n - 1) / n * total) / bw;
}

// An all-gather / reduce-scatter of S bytes over n ranks: (n-1)/n * S / B (NCCL's bus bandwidth),
// with the same latency model as the rooted collectives (log2 n hops), so no design is favoured.
double ring_time(double bytes, int n, const LinkSpec& link) {
  if (n <= 1 || bytes <= 0) return 0.0;
  return link.latency_us * 1e-6 * log2_hops(n) + static_cast<double>(n - 1) / n * bytes / (link.bandwidth_GBps * 1e9);
}

// One pass over the boundaries: compute_b per boundary, comm_b per boundary; with prefetch the
// first collective is exposed and then each boundary costs the larger of its compute and the next
// boundary's communication.
double pass_time(const std::vector<double>& compute, const std::vector<double>& comm, int prefetch) {
  double t = 0;
  if (prefetch <= 0) {
    for (size_t b = 0; b < compute.size(); ++b) t += compute[b] + comm[b];
    return t;
  }
  if (!comm.empty()) t += comm.front();
  for (size_t b = 0; b < compute.size(); ++b) t += std::max(compute[b], b + 1 < comm.size() ? comm[b + 1] : 0.0);
  return t;
}

// Backward over the boundaries in reverse: boundary k needs its gather (Z3 re-broadcast, FSDP
// all-gather; 0 under Z2) before its compute and reduces after it. With prefetch the first gather is
// exposed, then boundary k's compute hides the next boundary's gather and the previous one's reduce,
// and the last reduce (boundary 0's) is exposed.
double backward_time(const std::vector<double>& compute, const std::vector<double>& gather,
                     const std::vector<double>& reduce, int prefetch) {
  const size_t L = compute.size();
  double t = 0;
  if (L == 0) return 0.0;
  if (prefetch <= 0) {
    for (size_t b = 0; b < L; ++b) t += compute[b] + gather[b] + reduce[b];
    return t;
  }
  t += gather[L - 1];
  for (size_t k = L; k-- > 0;) {
    const double hidden = (k > 0 ? gather[k - 1] : 0.0) + (k + 1 < L ? reduce[k + 1] : 0.0);
    t += std::max(compute[k], hidden);
  }
  return t + reduce[0];
}

const char* largest_term(const StepEstimate& e) {
  const std::pair<double, const char*> terms[] = {{e.exposed_comm_s, "exposed shard-axis communication"},
                                                  {e.ns_s, "Newton-Schulz on the busiest rank"},
                                                  {e.adamw_s, "AdamW"},
                                                  {e.replicate_s, "post-backward exchange (replicate axis / update all-gather)"},
                                                  {e.verdict_s, "the step's non-finite-gradient verdict (latency)"}};
  const auto* best = &terms[0];
  for (const auto& t : terms)
    if (t.first > best->first) best = &t;
  return best->first > 0 ? best->second : "none (compute-bound)";
}

double need(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j[key].is_number())
    throw std::invalid_argument(where + ": hardware description needs a number \"" + key + "\"");
  const double v = j[key].get<double>();
  if (!(v > 0)) throw std::invalid_argument(where + ": \"" + key + "\" must be > 0, got " + detail::json_brief(j[key]));
  return v;
}

// need() of a count: a whole number in [1, 1e6] (a cast of 1e10 or 2.7 to int would be undefined or silent)
int need_count(const json& j, const char* key, const std::string& where, const std::string& what) {
  const double c = need(j, key, where);
  if (c != std::floor(c) || c > 1e6)
    throw std::invalid_argument(where + ": \"" + key + "\" must be a whole number of " + what + " (1 to 1000000), got " +
                                detail::json_brief(j[key]));
  return static_cast<int>(c);
}

// an optional string field, or the default; another JSON type is an error naming the field
std::string text_or(const json& j, const char* key, const std::string& fallback, const std::string& where) {
  if (!j.contains(key)) return fallback;
  if (!j[key].is_string())
    throw std::invalid_argument(where + ": \"" + key + "\" must be a string, got " + detail::json_brief(j[key]));
  return j[key].get<std::string>();
}

LinkSpec link_of(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j[key].is_object())
    throw std::invalid_argument(where + ": hardware description needs an object \"" + key +
                                "\" {\"bandwidth_GBps\", \"latency_us\"}");
  return LinkSpec{need(j[key], "bandwidth_GBps", where + " " + key), need(j[key], "latency_us", where + " " + key)};
}

}  // namespace

std::vector<std::string> hardware_preset_names() { return {"h200", "cpu-2core"}; }

// The built-in descriptions, in the JSON format users write (hardware_from_json).
static const char* preset_json(const std::string& n) {
  if (n == "h200")
    return R"({"name": "h200",
      "source": "estimate: NVIDIA H200 SXM specifications (989 dense BF16 TFLOPS, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s bidirectional of which NCCL buses reach ~360 GB/s per direction), one 400 Gb/s InfiniBand NIC per GPU (~45 GB/s); mfu 0.40 and NS efficiency 0.50 assumed. Not measured: docs/PERF.md has no H200 numbers yet",
      "devices_per_node": 8, "matmul_tflops": 989, "mfu": 0.40, "ns_efficiency": 0.50,
      "memory_bandwidth_GBps": 4800, "memory_GB": 141,
      "intra_node": {"bandwidth_GBps": 360, "latency_us": 5}, "inter_node": {"bandwidth_GBps": 45, "latency_us": 10}})";
  if (n == "cpu-2core" || n == "cpu")
    return R"({"name": "cpu-2core",
      "source": "this project's 2-core Debian CI box, one rank per core (more ranks share the 2 cores): measured by `dmuon plan --calibrate --hardware cpu-2core --threads 1` on 2026-12-02 (fp32 1024^2 GEMM 85 GFLOP/s on one thread, an fp32 add 11.8 GB/s, NS of a 256x256 matrix 7.4 ms = 0.80 of the GEMM rate); mfu 0.6 and Gloo over 127.0.0.1 at about 1 GB/s and 50 us are estimates from docs/PERF.md runs",
      "devices_per_node": 64, "cores_per_node": 2, "matmul_tflops": 0.085, "mfu": 0.6, "ns_efficiency": 0.8,
      "memory_bandwidth_GBps": 11.8, "memory_GB": 24,
      "intra_node": {"bandwidth_GBps": 1.0, "latency_us": 50}, "inter_node": {"bandwidth_GBps": 1.0, "latency_us": 50}})";
  return nullptr;
}

HardwareSpec hardware_preset(const std::string& name) {
  if (const char* j = preset_json(lower(name))) return hardware_from_json(j, "built-in " + lower(name));
  std::string names;
  for (const auto& p : hardware_preset_names()) names += (names.empty() ? "" : ", ") + p;
  throw std::invalid_argument("unknown hardware '" + name + "'; built-in descriptions: " + names +
                              ", or a path to a JSON description (docs/PLAN_TOOL.md)");
}

HardwareSpec hardware_from_json(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": hardware description is not JSON: " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(source + ": hardware description must be a JSON object");
  HardwareSpec h;
  h.name = text_or(j, "name", source, source);
  h.source = text_or(j, "source", "file " + source, source);
  h.devices_per_node = need_count(j, "devices_per_node", source, "devices (ranks) per node");
  h.matmul_tflops = need(j, "matmul_tflops", source);
  h.mfu = need(j, "mfu", source);
  h.ns_efficiency = need(j, "ns_efficiency", source);
  h.memory_bandwidth_GBps = need(j, "memory_bandwidth_GBps", source);
  h.memory_GB = need(j, "memory_GB", source);
  h.intra_node = link_of(j, "intra_node", source);
  h.inter_node = link_of(j, "inter_node", source);
  if (j.contains("cores_per_node"))
    h.cores_per_node = need_count(j, "cores_per_node", source,
                                  "ranks the host runs at once (its cores over each rank's threads)");
  if (j.contains("ns_profile"))
    h.ns_profile = std::make_shared<const NsProfile>(ns_profile_from_json(j["ns_profile"].dump(), source + " ns_profile"));
  if (h.mfu > 1 || h.ns_efficiency > 1)
    throw std::invalid_argument(source + ": mfu and ns_efficiency are fractions of the matmul rate (<= 1)");
  return h;
}

std::string hardware_to_json(const HardwareSpec& h) {
  auto link = [](const LinkSpec& l) { return json{{"bandwidth_GBps", l.bandwidth_GBps}, {"latency_us", l.latency_us}}; };
  json j = {{"name", h.name},
            {"source", h.source},
            {"devices_per_node", h.devices_per_node},
            {"matmul_tflops", h.matmul_tflops},
            {"mfu", h.mfu},
            {"ns_efficiency", h.ns_efficiency},
            {"memory_bandwidth_GBps", h.memory_bandwidth_GBps},
            {"memory_GB", h.memory_GB},
            {"intra_node", link(h.intra_node)},
            {"inter_node", link(h.inter_node)}};
  if (h.cores_per_node > 0) j["cores_per_node"] = h.cores_per_node;
  if (h.ns_profile) j["ns_profile"] = json::parse(ns_profile_to_json(*h.ns_profile));
  return j.dump(2);
}

HardwareSpec load_hardware(const std::string& name_or_path) {
  if (preset_json(lower(name_or_path))) return hardware_preset(name_or_path);
  std::ifstream in(name_or_path);
  if (!in) return hardware_preset(name_or_path);  // the error lists the presets
  std::stringstream ss;
  ss << in.rdbuf();
  return hardware_from_json(ss.str(), name_or_path);
}

double ns_flops(const std::vector<int64_t>& shape, int ns_steps) {
  if (shape.size() < 2) return 0.0;
  const double a = static_cast<double>(shape[0]), b = static_cast<double>(shape[1]);
  const double m = std::min(a, b), n = std::max(a, b);
  return ns_steps * (4 * m * m * n + 2 * m * m * m);
}

double shared_cores_makespan(std::vector<double> work, double cores) {
  if (!(cores > 0)) throw std::invalid_argument("shared_cores_makespan: cores must be > 0");
  std::sort(work.begin(), work.end());
  double t = 0, done = 0;  // done: the work every unfinished job has received
  for (size_t i = 0; i < work.size(); ++i) {
    const double rate = std::min(1.0, cores / static_cast<double>(work.size() - i));
    t += std::max(0.0, work[i] - done) / rate;
    done = std::max(done, work[i]);
  }
  return t;
}

double Simulation::overhead_vs_adamw() const {
  if (designs.size() < 2 || designs[1].step_s <= 0) return 0.0;
  return designs[0].step_s / designs[1].step_s - 1.0;
}

Simulation simulate_step(const ModelSpec& model, const std::vector<ParamSpec>& muon, const OwnerPlan& plan,
                         const SimLayout& l, const HardwareSpec& hw) {
  if (l.shard < 1 || l.replicate < 1 || l.tp < 1 || l.tokens < 1)
    throw std::invalid_argument("simulate_step: G, R, T and tokens must be >= 1");
  if (static_cast<int>(plan.owners.size()) != static_cast<int>(muon.size()))
    throw std::invalid_argument("simulate_step: the plan has " + std::to_string(plan.owners.size()) +
                                " owners for " + std::to_string(muon.size()) + " Muon matrices");
  if (plan.shard_size != l.shard || plan.replicate_size != l.replicate)
    throw std::invalid_argument("simulate_step: the plan is for a G x R = " + std::to_string(plan.shard_size) + " x " +
                                std::to_string(plan.replicate_size) + " grid, the layout is " + std::to_string(l.shard) +
                                " x " + std::to_string(l.replicate));
  Simulation sim;
  sim.layout = l;
  sim.hardware = hw;
  sim.model = model.name;
  const int G = l.shard, R = l.replicate, T = l.tp, N = G * R * T, DP = G * R;
  sim.devices = N;
  double P_bytes = 0, PM_bytes_full = 0;
  int64_t e = 2;
  for (const auto& p : model.params) {
    sim.params += p.numel();
    P_bytes += static_cast<double>(p.bytes());
    e = p.elem_bytes;
  }
  // the Muon targets' full sizes (TP slices times T)
  std::vector<double> full_numel(muon.size());
  for (size_t i = 0; i < muon.size(); ++i) {
    full_numel[i] = static_cast<double>(muon[i].numel()) * (muon[i].tp_split_dim >= 0 ? T : 1);
    sim.muon_params += static_cast<int64_t>(full_numel[i]);
    PM_bytes_full += full_numel[i] * static_cast<double>(muon[i].elem_bytes);
  }
  const double PB_bytes = std::max(0.0, P_bytes - PM_bytes_full);
  const double P = static_cast<double>(sim.params), PB = PB_bytes / static_cast<double>(e);
  // compute: the parameters a token passes through (an MoE's top-k experts, not all of them)
  const double P_active = model.active_params > 0 ? static_cast<double>(model.active_params) : P;
  const double rate = hw.matmul_tflops * 1e12;
  const LinkSpec& shard_link = G * T <= hw.devices_per_node ? hw.intra_node : hw.inter_node;
  const LinkSpec& dp_link = DP * T <= hw.devices_per_node ? hw.intra_node : hw.inter_node;
  // ranks time-sharing a host's cores: n per node on C cores
  const int per_node = std::min(N, std::max(1, hw.devices_per_node));
  const bool shared = hw.cores_per_node > 0;
  const double slowdown = shared ? std::max(1.0, static_cast<double>(per_node) / hw.cores_per_node) : 1.0;
  const bool saturated = shared && per_node >= hw.cores_per_node;  // no idle core to move bytes under compute
  const int prefetch = saturated ? 0 : l.prefetch_depth;
  const double compute = 6.0 * P_active * static_cast<double>(l.tokens) / (N * rate * hw.mfu) * slowdown;
  const double adamw_per_param = 32.0 / (hw.memory_bandwidth_GBps * 1e9) * slowdown;  // read p, g, m, v; write p, m, v (+ master)
  // Newton-Schulz time of the matrices `idx` on one rank, full-size (a TP-split matrix's NS shared by
  // its T ranks: its TP owner, or the distributed Gram; a whole one runs on every TP rank). With a
  // measured NS profile: per shape, the batch the step runs (fixed + per matrix x k); else FLOPs at
  // the device rate times the NS efficiency.
  auto ns_time = [&](const std::vector<size_t>& idx) {
    std::map<std::tuple<int64_t, int64_t, int64_t, double>, int64_t> shapes;  // (s, b, elem, 1/T share): count
    double flops = 0;
    for (size_t i : idx) {
      std::vector<int64_t> full = muon[i].shape;
      if (muon[i].tp_split_dim >= 0) full[static_cast<size_t>(muon[i].tp_split_dim)] *= T;
      const double share = muon[i].tp_split_dim >= 0 ? 1.0 / T : 1.0;
      flops += ns_flops(full, l.ns_steps) * share;
      int64_t numel = 1;
      for (int64_t d : full) numel *= d;
      const int64_t m = full.size() >= 2 ? full[0] : 1, n = m > 0 ? numel / m : 0;
      ++shapes[{std::min(m, n), std::max(m, n), muon[i].elem_bytes, share}];
    }
    if (!hw.ns_profile) return flops / (rate * hw.ns_efficiency);
    double us = 0;
    for (const auto& [key, k] : shapes)
      us += hw.ns_profile->cost_of(std::get<0>(key), std::get<1>(key), std::get<2>(key)).of(k) * std::get<3>(key);
    return us * 1e-6 * l.ns_steps / hw.ns_profile->ns_steps;  // measured at the profile's step count
  };

  // the step's NS from each data-parallel rank's NS time (`t[r]`, rank r = replicate * G + shard): the
  // slowest rank's, or on shared cores each node's ranks' work shared by its cores
  auto ns_critical_of = [&](const std::vector<double>& t) {
    if (!shared) return t.empty() ? 0.0 : *std::max_element(t.begin(), t.end());
    std::vector<double> device;  // the T TP ranks of a data-parallel rank each run its share
    for (double x : t) device.insert(device.end(), static_cast<size_t>(T), x);
    double worst = 0;
    for (size_t n0 = 0; n0 < device.size(); n0 += static_cast<size_t>(per_node)) {
      const auto first = device.begin() + static_cast<std::ptrdiff_t>(n0);
      const auto last = device.begin() + static_cast<std::ptrdiff_t>(std::min(device.size(), n0 + per_node));
      worst = std::max(worst, shared_cores_makespan(std::vector<double>(first, last), hw.cores_per_node));
    }
    return worst;
  };
  // ... from each data-parallel rank's matrices (`per_rank[r]`)
  auto ns_critical = [&](const std::vector<std::vector<size_t>>& per_rank) {
    std::vector<double> t;
    for (const auto& on : per_rank) t.push_back(ns_time(on));
    return ns_critical_of(t);
  };

  // boundaries in model order: Muon bytes (this TP rank's slices) and their roots
  const CommPlan comm = plan_comm(muon, plan);
  const size_t L = comm.boundaries.size();
  // no Muon matrix (no boundary): one pass of the whole compute, with no matrix traffic
  std::vector<double> fwd_c(std::max<size_t>(L, 1), compute / 3.0), bwd_c(fwd_c.size(), 2.0 * compute / 3.0),
      bcast(fwd_c.size()), reduce(fwd_c.size()), ring(fwd_c.size());
  double local_PM = 0;
  for (const auto& b : comm.boundaries) local_PM += static_cast<double>(b.payload_bytes);
  for (size_t b = 0; b < L; ++b) {
    const auto& bc = comm.boundaries[b];
    const double share = local_PM > 0 ? static_cast<double>(bc.payload_bytes) / local_PM : 1.0 / L;
    fwd_c[b] = compute / 3.0 * share;
    bwd_c[b] = 2.0 * compute / 3.0 * share;
    // one root per (shard) owner in this replicate group: the roots of every replicate group are
    // the same shard columns, so the shard-axis collective is the same in each
    std::map<int, double> by_shard;
    for (const auto& r : bc.roots) by_shard[r.root.shard] += static_cast<double>(r.bytes);
    std::vector<double> roots;
    for (const auto& [s, bytes] : by_shard) roots.push_back(bytes);
    bcast[b] = reduce[b] = rooted_time(roots, G, shard_link);
    ring[b] = ring_time(static_cast<double>(bc.payload_bytes), DP, dp_link);  // FSDP: the same bytes sharded N ways
  }

  // ---- DMuon ----
  StepEstimate dm;
  dm.design = l.z3 ? "DMuon-Z3" : "DMuon-Z2";
  dm.compute_s = compute;
  // the non-matrix parameters: replicated (a gradient all-reduce at the end of backward) or
  // sharded_adamw (1/G per rank: all-gathers in forward and backward and a reduce-scatter over the
  // shard axis, an all-reduce of the slices over the replicate axis); exposed (embedding and head
  // sit at the ends of the passes)
  // (sharded: one gather in forward, the rest in backward)
  const double base_fwd = l.shard_base ? ring_time(PB_bytes / T, G, shard_link) : 0.0;
  const double base_bwd = l.shard_base ? 2.0 * ring_time(PB_bytes / T, G, shard_link) +
                                             2.0 * ring_time(PB_bytes / (G * T), R, hw.inter_node)
                                       : 2.0 * ring_time(PB_bytes / T, DP, dp_link);
  {
    std::vector<double> none(fwd_c.size(), 0.0);
    dm.forward_s = pass_time(fwd_c, bcast, prefetch) + base_fwd;
    dm.backward_s = backward_time(bwd_c, l.z3 ? bcast : none, reduce, prefetch) + base_bwd;
    dm.exposed_comm_s = dm.forward_s + dm.backward_s - compute;
    // Newton-Schulz: the busiest slot's full-matrix work
    std::vector<std::vector<size_t>> slot(static_cast<size_t>(plan.num_slots()));
    for (size_t i = 0; i < muon.size(); ++i)
      slot[static_cast<size_t>(OwnerPlan::slot_index(plan.owners[i], G))].push_back(i);
    dm.ns_s = ns_critical(slot);
    dm.adamw_s = PB / T / (l.shard_base ? G : 1) * adamw_per_param;
    // HSDP: the stage-2 reduce of the owners' gradients over the replicate axis (inter-node)
    if (R > 1) {
      const double hop = hw.inter_node.latency_us * 1e-6 * log2_hops(R);
      const double per_byte = 1.0 / (hw.inter_node.bandwidth_GBps * 1e9);
      const double rep_bytes = static_cast<double>(comm.max_replicate());  // stage-2 reduce + publish
      if (saturated || L == 0) {  // every core has a rank: nothing moves under compute, the publish neither
        dm.replicate_s = hop + rep_bytes * per_byte;
      } else {
        // the reduce half (the publish overlaps the next forward), issued in backward: boundary b's
        // stage 2 as the next boundary (in reduce order) ends its backward, the last one's at the end
        // of backward; the link runs them one after another and what outlasts backward is exposed
        std::vector<double> hook(L);
        double t = 0;
        for (size_t b = L; b-- > 0;) hook[b] = (t += bwd_c[b]);
        double link = 0;
        for (size_t b = L; b-- > 0;) {
          const double share = local_PM > 0 ? static_cast<double>(comm.boundaries[b].payload_bytes) / local_PM
                                             : 1.0 / static_cast<double>(L);
          link = std::max(link, b > 0 ? hook[b - 1] : t) + hop + share * rep_bytes / 2.0 * per_byte;
        }
        dm.replicate_s = std::max(0.0, link - t);
      }
      dm.inter_node_bytes_per_rank = rep_bytes;
    }
    // + the base: an all-reduce of the replicated parameters' gradients, or (sharded) an all-gather in
    // forward and backward and a reduce-scatter
    dm.bytes_per_rank = static_cast<double>(l.z3 ? comm.max_z3() : comm.max_z2()) +
                        (l.shard_base ? 3.0 * (G - 1) / G * PB_bytes / T + 2.0 * (R - 1) / R * PB_bytes / (G * T)
                                      : 2.0 * (DP - 1) / DP * PB_bytes / T);
    if (G * T > hw.devices_per_node) dm.inter_node_bytes_per_rank += dm.bytes_per_rank;
    // Muon::step's verdict on non-finite gradients: a row from every rank of the world, read on the host
    const double verdict_bytes = static_cast<double>(kStepVerdictRowBytes) * N;
    dm.verdict_s = ring_time(verdict_bytes, N, N <= hw.devices_per_node ? hw.intra_node : hw.inter_node);
    dm.bytes_per_rank += verdict_bytes * (N - 1) / N;
    if (N > hw.devices_per_node) dm.inter_node_bytes_per_rank += verdict_bytes * (N - 1) / N;
    // memory: parameters held (1/G of P_M), the owner's fp32 master, momentum and gradient (1/(G R)),
    // the gathered window (Z3: the prefetched boundaries; Z2: every other rank's matrices), the base
    const double held = local_PM / G, owned = local_PM / (G * R) / e * 12.0;
    const double window = l.z3 ? (L ? 2.0 * (1 + l.prefetch_depth) * local_PM / L : 0.0) : (G - 1.0) / G * local_PM;
    dm.memory_bytes_per_rank = held + owned + window + PB_bytes / T / (l.shard_base ? G : 1) * (1.0 + 16.0 / e);
    dm.step_s = compute + dm.exposed_comm_s + dm.ns_s + dm.adamw_s + dm.replicate_s + dm.verdict_s;
  }

  // ---- FSDP-style AdamW (ZeRO-3 over the data-parallel ranks, all parameters sharded) ----
  StepEstimate fs;
  fs.design = "FSDP AdamW";
  fs.compute_s = compute;
  {
    // all-gather in forward; all-gather before and reduce-scatter after each boundary's backward; the
    // non-matrix parameters sharded like the rest (gathers and reduce-scatter at the ends, exposed)
    const double base = ring_time(PB_bytes / T, DP, dp_link);
    fs.forward_s = pass_time(fwd_c, ring, prefetch) + base;
    fs.backward_s = backward_time(bwd_c, ring, ring, prefetch) + 2.0 * base;
    fs.exposed_comm_s = fs.forward_s + fs.backward_s - compute;
    fs.adamw_s = P / N * adamw_per_param;
    fs.bytes_per_rank = 3.0 * (DP - 1) / DP * P_bytes / T;
    if (DP * T > hw.devices_per_node) fs.inter_node_bytes_per_rank = fs.bytes_per_rank;
    fs.memory_bytes_per_rank = P_bytes / N * (1.0 + 16.0 / e) + (L ? 2.0 * (1 + l.prefetch_depth) * local_PM / L : 0.0);
    fs.step_s = compute + fs.exposed_comm_s + fs.adamw_s;
  }

  // ---- naive data-parallel Muon / round-robin owners (DDP: replicated parameters) ----
  auto ddp_base = [&](StepEstimate& s) {
    s.compute_s = compute;
    // the gradient all-reduce (2(N-1)/N P) in buckets under the backward; the forward has none
    const double allreduce = 2.0 * ring_time(P_bytes / T, DP, dp_link);
    s.forward_s = compute / 3.0;
    s.backward_s = !saturated ? std::max(2.0 * compute / 3.0, allreduce) + allreduce / std::max<size_t>(L, 1)
                                : 2.0 * compute / 3.0 + allreduce;  // shared cores: nothing hides it
    s.exposed_comm_s = s.backward_s - 2.0 * compute / 3.0;
    s.adamw_s = PB / T * adamw_per_param;
    s.bytes_per_rank = 2.0 * (DP - 1) / DP * P_bytes / T;
    if (DP * T > hw.devices_per_node) s.inter_node_bytes_per_rank = s.bytes_per_rank;
  };
  StepEstimate nv;
  nv.design = "naive DP Muon";
  ddp_base(nv);
  {
    std::vector<size_t> all(muon.size());  // every rank runs every matrix: one time, DP times
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    nv.ns_s = ns_critical_of(std::vector<double>(static_cast<size_t>(DP), ns_time(all)));
  }
  nv.memory_bytes_per_rank = P_bytes / T * (2.0 + 4.0 / e) + PM_bytes_full / T * 4.0 / e + PB_bytes / T * 8.0 / e;
  nv.step_s = compute + nv.exposed_comm_s + nv.ns_s + nv.adamw_s;

  StepEstimate rr;
  rr.design = "round-robin Muon";
  ddp_base(rr);
  {
    // matrices sorted by size, matrix k on rank k mod DP; then an all-gather of every update
    std::vector<size_t> order(muon.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return full_numel[a] > full_numel[b]; });
    std::vector<std::vector<size_t>> per_rank(static_cast<size_t>(DP));
    for (size_t k = 0; k < order.size(); ++k) per_rank[k % static_cast<size_t>(DP)].push_back(order[k]);
    rr.ns_s = ns_critical(per_rank);
    rr.replicate_s = ring_time(PM_bytes_full / T, DP, dp_link);
    rr.bytes_per_rank += static_cast<double>(DP - 1) / DP * PM_bytes_full / T;
    rr.memory_bytes_per_rank = P_bytes / T * (2.0 + 4.0 / e) + PM_bytes_full / T * (4.0 / e / DP + 1.0) +
                               PB_bytes / T * 8.0 / e;
    rr.step_s = compute + rr.exposed_comm_s + rr.ns_s + rr.adamw_s + rr.replicate_s;
  }
  for (StepEstimate* s : {&dm, &fs, &nv, &rr}) s->dominant = largest_term(*s);
  sim.designs = {dm, fs, nv, rr};
  return sim;
}

}  // namespace dmuon
