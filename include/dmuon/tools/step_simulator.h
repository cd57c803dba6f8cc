// step_simulator.h -- the time of one training step of any model on any cluster, before renting
// it: DMuon's owner plan and byte plan (owner_plan.h) priced on a hardware description, next to
// the designs users would pick instead (FSDP-style AdamW, naive data-parallel Muon, round-robin
// owners). Pure C++, no LibTorch: `dmuon plan --simulate` runs it (docs/PLAN_TOOL.md).
//
// The model of one step, per rank (N = G x R x T devices, L hook boundaries, P parameters):
//   compute   6 P_active tokens / (N * matmul rate * mfu) (P_active: ModelSpec::active_params, an MoE
//             token's top-k experts; else P), split over the boundaries by their Muon bytes
//             (forward 1/3, backward 2/3);
//   a boundary's broadcast (or reduce) over the shard group of G ranks is root-bottlenecked: one
//             owner sending S bytes costs S / B, distinct owners run concurrently, and no rank can
//             receive faster than its link: time = latency * ceil(log2 G) + max(max_root S_o,
//             (G-1)/G * S_boundary) / B, B the intra-node link when G * T ranks fit in a node, else
//             the inter-node one (NCCL's bus-bandwidth view of a ring broadcast);
//   overlap   with prefetch depth >= 1: forward costs the first broadcast + sum_b max(compute_b,
//             broadcast_{b+1}); backward (in reverse) the first gather (Z3) + sum_k max(compute_k,
//             gather_{k-1} + reduce_{k+1}) + the last reduce; prefetch 0: every term added;
//   Z3        forward broadcast, backward broadcast + reduce; Z2 forward broadcast, backward reduce;
//   base      the non-matrix parameters' collectives (replicated: an all-reduce at the end of
//             backward; sharded: gathers and a reduce-scatter), exposed;
//   NS        the busiest owner slot's Newton-Schulz FLOPs (5 steps of 4 m^2 n + 2 m^3, m the smaller
//             side) / (matmul rate * ns_efficiency), a TP-split matrix's work shared by its T ranks
//             (a whole matrix runs on every TP rank);
//   AdamW     element-wise, memory-bound: 32 bytes per parameter updated / memory bandwidth;
//   HSDP      the stage-2 reduce over the replicate axis (inter-node) after backward is exposed; the
//             post-step publish overlaps the next forward;
//   shared    ranks time-sharing a host's cores (HardwareSpec::cores_per_node): compute and AdamW
//   cores     slowed by ranks / cores, NS by fair processor sharing of the node's owners, and no
//             collective hidden once every core has a rank.
// Every design is priced with the same terms, so their ratio (DMuon's overhead over AdamW) is what
// the description's absolute numbers matter least for.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/tools/model_specs.h"
#include "dmuon/ns_profile.h"
#include "dmuon/owner_plan.h"

namespace dmuon {

struct LinkSpec {
  double bandwidth_GBps = 0;  // per device and direction (bus bandwidth a ring collective reaches)
  double latency_us = 0;      // per hop
};

struct HardwareSpec {
  std::string name;
  std::string source;         // where the numbers come from ("estimate: ...", "measured: ...")
  int devices_per_node = 8;
  double matmul_tflops = 0;   // dense matmul rate in the training dtype, per device
  double mfu = 0.4;           // fraction of it forward/backward reach
  double ns_efficiency = 0.5; // fraction of it Newton-Schulz reaches
  double memory_bandwidth_GBps = 0;  // element-wise optimizer work
  double memory_GB = 0;
  LinkSpec intra_node, inter_node;
  // A host whose ranks time-share its cores (a CPU box; 0 = every device computes on its own, as a
  // GPU does): C = how many ranks it runs at once at the rates above (its cores over each rank's
  // threads), the rates being one rank's alone. With n ranks on a node (n = min(N, devices_per_node)): compute and AdamW take max(1, n / C) times as long; Newton-Schulz
  // is the node's owners' work shared fairly by its C cores (a finished owner frees its share); and
  // once n >= C no core is idle to move bytes under compute, so every collective is exposed (the
  // prefetch overlap, DDP's bucket overlap and HSDP's publish under the next forward).
  int cores_per_node = 0;
  // Measured NS times per shape (`dmuon plan --calibrate`): when set, an owner's NS time is priced
  // from it (the batch the step runs per shape) instead of FLOPs / (rate x ns_efficiency).
  std::shared_ptr<const NsProfile> ns_profile;
};

// Built-in descriptions: "h200" (NVIDIA H200 SXM, estimates from public specifications until
// docs/PERF.md has measured numbers) and "cpu-2core" (this project's 2-core CI box, from its
// measurements in docs/PERF.md). Names ignore case.
std::vector<std::string> hardware_preset_names();
HardwareSpec hardware_preset(const std::string& name);
// JSON: {"name", "source", "devices_per_node", "matmul_tflops", "mfu", "ns_efficiency",
// "memory_bandwidth_GBps", "memory_GB", "intra_node": {"bandwidth_GBps", "latency_us"},
// "inter_node": {...}, "cores_per_node" (optional), "ns_profile": {...} (optional, ns_profile.h)};
// every field but name/source, cores_per_node and ns_profile required. Throws std::invalid_argument naming
// the field and `source`.
HardwareSpec hardware_from_json(const std::string& json_text, const std::string& source);
// The JSON above (hardware_from_json reads it back to an equal description).
std::string hardware_to_json(const HardwareSpec& hw);
// A preset name, or a path to such a JSON file.
HardwareSpec load_hardware(const std::string& name_or_path);

struct SimLayout {
  int shard = 8, replicate = 1, tp = 1;  // G, R, T
  bool z3 = true;
  int64_t tokens = 4194304;              // per optimizer step, over the whole cluster
  int prefetch_depth = 1;
  int ns_steps = 5;
  bool shard_base = false;               // the non-matrix parameters on sharded_adamw (else replicated)
};

// One design's step, in seconds per step (the critical path of the busiest rank).
struct StepEstimate {
  std::string design;          // "DMuon-Z3", "FSDP AdamW", "naive DP Muon", "round-robin Muon"
  double step_s = 0;
  double compute_s = 0;        // forward + backward FLOPs at the device rate
  double forward_s = 0;        // the forward pass: its compute and the communication it exposes
  double backward_s = 0;       // the backward pass: compute + the shard-axis / data-parallel collectives it
                               // exposes (HSDP's replicate-axis exchange is replicate_s)
  double exposed_comm_s = 0;   // communication not hidden under compute (shard axis)
  double ns_s = 0;             // Newton-Schulz on the critical path
  double adamw_s = 0;
  double replicate_s = 0;      // exposed replicate-axis (HSDP) or post-NS all-gather time
  double verdict_s = 0;        // DMuon: Muon::step's non-finite-gradient verdict, one all-gather of 32 bytes
                               // per rank over the world at the end of the step (exposed: the host reads it)
  double bytes_per_rank = 0;   // sent + received per step: the shard/data-parallel groups (+ DMuon's verdict
                               // over the world)
  double inter_node_bytes_per_rank = 0;
  double memory_bytes_per_rank = 0;  // model state (parameters, gradients, optimizer state, gathered matrices)
  std::string dominant;        // the largest term beyond compute
};

struct Simulation {
  SimLayout layout;
  HardwareSpec hardware;
  std::string model;
  int64_t params = 0, muon_params = 0;
  int devices = 0;
  std::vector<StepEstimate> designs;  // DMuon first, then FSDP AdamW, naive DP Muon, round-robin Muon
  double overhead_vs_adamw() const;   // DMuon step / FSDP AdamW step - 1
};

// `muon`: the Muon targets as planned (TP-local shapes when layout.tp > 1, tp_split_dim set),
// `plan` their owner plan on layout's grid, `model` every parameter (for P and the AdamW part).
Simulation simulate_step(const ModelSpec& model, const std::vector<ParamSpec>& muon, const OwnerPlan& plan,
                         const SimLayout& layout, const HardwareSpec& hw);

// The time C cores shared fairly (each job at most one core, a finished job's share passing to the
// rest) take to finish jobs of the given single-core times: the processor-sharing makespan.
double shared_cores_makespan(std::vector<double> work, double cores);

// Newton-Schulz FLOPs of one matrix (ns_steps iterations of the Gram form: 4 m^2 n + 2 m^3).
double ns_flops(const std::vector<int64_t>& shape, int ns_steps);

}  // namespace dmuon
