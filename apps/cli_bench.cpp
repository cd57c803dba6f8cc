// `dmuon bench step`: per-step time and bytes of DMuon Z2/Z3 against the designs users would pick
// instead, on one model and one global batch, for N in {2, 4} local ranks:
//   A  naive data-parallel Muon: all-reduce every gradient, every rank runs NS on every matrix
//   B  round-robin owners (the public Muon reference): all-reduce, each rank NS on its share
//      (matrix i on rank i mod N), then all-gather of the updates
//   AdamW only (DDP)
// Every variant trains the same model from the same init on the same batches; the baselines use
// the same NS backend and coefficients (tall matrices are transposed inside the NS kernel).
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <numeric>
#include <optional>
#include <sstream>
#include <tuple>

#include <unistd.h>

#include "cli_commands.h"
#include "cli_files.h"
#include "cli_launch.h"
#include "cli_text.h"
#include "dmuon/bootstrap.h"
#include "dmuon/dedicate.h"
#include "dmuon/memory.h"
#include "dmuon/muon.h"
#include "dmuon/tools/ns_calibration.h"
#include "dmuon/tools/step_simulator.h"
#include "model/dedicated_gpt.h"
#include "model/gpt.h"

namespace dmuon::cli {

namespace {

struct BenchArgs {
  std::string ranks = "2,4";
  int steps = 6;
  int warmup = 2;
  int64_t batch = 8;
  int64_t seq_len = 32;
  int64_t d_model = 256;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t d_ff = 1024;
  std::string out = "runs/bench_step";
  std::string ns_backend = "gram";
  uint64_t seed = 0;
  int pack = -1;  // pack_small_params for DMuon: -1 = library default
  int replicate = 1;  // HSDP replicate groups for the DMuon variants (adds dmuon_z3_1pass)
  bool one_pass = false;  // add dmuon_z3_1pass on any mesh
  bool shard_base = false;  // adds dmuon_z3_sb: Z3 with the non-matrix parameters on sharded_adamw
  std::string predict;      // a hardware description: price every variant with the step simulator
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double elapsed_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// AdamW (PyTorch's formula) for the baselines' non-matrix parameters.
struct SimpleAdamW {
  double lr = 3e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  std::map<const c10::TensorImpl*, std::pair<at::Tensor, at::Tensor>> st;
  std::map<const c10::TensorImpl*, int64_t> t;
  void update(at::Tensor& p) {
    const at::Tensor g = p.grad();
    auto& [m, v] = st[p.unsafeGetTensorImpl()];
    if (!m.defined()) {
      m = at::zeros_like(p);
      v = at::zeros_like(p);
    }
    const int64_t k = ++t[p.unsafeGetTensorImpl()];
    p.mul_(1 - lr * wd);
    m.mul_(b1).add_(g, 1 - b1);
    v.mul_(b2).addcmul_(g, g, 1 - b2);
    const double bc1 = 1 - std::pow(b1, k), bc2 = 1 - std::pow(b2, k);
    p.addcdiv_(m, (v.sqrt() / std::sqrt(bc2)).add_(eps), -lr / bc1);
  }
};

// One training setup; step() runs one optimizer step and reports (step ms, NS ms, bytes).
class Variant {
 public:
  // `tag`: the memory tag its allocations are charged to (memory.h), one per variant
  Variant(std::string name, const BenchArgs& a, Bootstrap& b, int tag)
      : name_(std::move(name)), a_(a), b_(b), tag_(tag) {
    memory::MemoryTag mt(tag_);
    models::MeshSetup ms;
    ms.store = b.store;
    ms.tag = "bench-" + name_;
    dmuon_ = name_.rfind("dmuon_", 0) == 0;
    if (dmuon_) ms.replicate = a.replicate;  // the baselines stay data-parallel over the world
    mesh_ = models::make_training_mesh(b.world, ms);
    models::DedicatedGptSetup gs;
    gs.config.vocab_size = 256;
    gs.config.d_model = a.d_model;
    gs.config.n_layers = a.layers;
    gs.config.n_heads = a.heads;
    gs.config.d_ff = a.d_ff;
    gs.seed = a.seed;
    gs.muon = dmuon_;
    gs.z3 = name_ != "dmuon_z2";
    gs.shard_base = name_ == "dmuon_z3_sb";
    if (a.pack >= 0) gs.pack_small_params = a.pack == 1;
    model_ = models::make_dedicated_gpt(mesh_, gs);
    opts_.ns_backend = a.ns_backend;
    ns_ = NewtonSchulz(a.ns_backend);
    opts_.record_step_profile = true;
    opts_.first_step_progress_log = false;
    opts_.group_prepare_ahead = name_ != "dmuon_z3_1pass";  // per-group prepare / publish, or one pass
    if (dmuon_ || name_ == "adamw") opt_ = std::make_unique<Muon>(model_.ptr(), opts_);
    for (const auto& item : model_->named_parameters(true))
      (models::is_muon_matrix(item.key(), item.value()) ? matrices_ : others_).emplace_back(item.key(), item.value());
    // B: rounds of N matrices, largest first (as the public reference groups by size)
    order_.resize(matrices_.size());
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(),
                     [&](int x, int y) { return matrices_[x].second.numel() > matrices_[y].second.numel(); });
  }

  const std::string& name() const { return name_; }
  int tag() const { return tag_; }

  // The matrices' shapes, fp32 (what --predict calibrates).
  std::vector<NsShape> matrix_shapes() const {
    std::vector<NsShape> out;
    for (const auto& [n, t] : matrices_) out.push_back({t.size(0), t.numel() / t.size(0), 4});
    return out;
  }

  // The step simulator's price of this variant on `hw` (step_simulator.h), from this rank's view: the
  // runtime's own plan (DMuon) and the model's real parameter list, `tokens` per step. Bytes are this
  // rank's: its share of the comm plan (Z2/Z3, replicate axis) plus the base all-reduce, and the
  // runtime's has-gradient flags (one fp32 element per parameter in every gradient payload: a matrix's
  // reduce, a replicated bucket). Empty for the variants the simulator has no design for (DDP AdamW).
  std::optional<nlohmann::json> predict(const HardwareSpec& hw, int64_t tokens) const {
    const int world = b_.world_size, rank = b_.rank;
    ModelSpec spec;
    spec.name = "bench GPT";
    std::vector<ParamSpec> muon;
    std::vector<std::string> boundary;
    for (const auto& item : model_->named_parameters(true)) {
      ParamSpec p;
      p.name = item.key();
      p.elem_bytes = static_cast<int64_t>(item.value().element_size());
      p.shape = item.value().sizes().vec();
      spec.params.push_back(p);
    }
    OwnerPlan plan;
    if (dmuon_) {
      for (const DedicatedParam& d : get_dedicated_params(*model_)) {
        ParamSpec p;
        p.name = d.name;
        p.shape = d.shape;
        p.elem_bytes = static_cast<int64_t>(d.param.element_size());
        muon.push_back(p);
        boundary.push_back(d.boundary);
      }
      for (auto& p : spec.params)  // placeholders on non-owners: the full shapes
        for (const auto& m : muon)
          if (m.name == p.name) p.shape = m.shape;
      plan = *get_owner_plan(*model_);
    } else {
      for (const auto& [n, t] : matrices_) {
        ParamSpec p;
        p.name = n;
        p.shape = t.sizes().vec();
        p.elem_bytes = static_cast<int64_t>(t.element_size());
        muon.push_back(p);
      }
      plan = plan_owners(muon, world, 1, PlanOptions{});  // the designs below do not use its owners
    }
    SimLayout l;
    l.replicate = dmuon_ ? a_.replicate : 1;
    l.shard = world / l.replicate;
    l.z3 = name_ != "dmuon_z2";
    l.tokens = tokens;
    l.prefetch_depth = DedicateOptions{}.forward_prefetch_depth;  // make_dedicated_gpt keeps the default
    l.ns_steps = opts_.ns_steps;
    l.shard_base = name_ == "dmuon_z3_sb";
    const Simulation sim = simulate_step(spec, muon, plan, l, hw);
    const StepEstimate* e = nullptr;
    if (dmuon_) e = &sim.designs[0];
    if (name_ == "baseline_a") e = &sim.designs[2];
    if (name_ == "baseline_b") e = &sim.designs[3];
    if (!e) return std::nullopt;
    double pb = 0, base = 0;
    for (const auto& p : spec.params) pb += static_cast<double>(ParamSpec(p).numel() * p.elem_bytes);
    for (const auto& m : muon) base -= static_cast<double>(m.numel() * m.elem_bytes);
    base += pb;
    double bytes = 0;
    const double flag = 4.0, ring = 2.0 * (world - 1) / world;
    const double n_base = static_cast<double>(spec.params.size() - muon.size());
    if (dmuon_) {
      const CommPlan comm = plan_comm(muon, plan, boundary);
      bytes = static_cast<double>(l.z3 ? comm.per_rank_bytes_z3[static_cast<size_t>(rank)]
                                       : comm.per_rank_bytes_z2[static_cast<size_t>(rank)]);
      if (l.replicate > 1) bytes += static_cast<double>(comm.per_rank_replicate_bytes[static_cast<size_t>(rank)]);
      const double verdict = static_cast<double>(kStepVerdictRowBytes) * (world - 1);  // Muon::step's verdict: a row from every other rank
      bytes += l.shard_base ? e->bytes_per_rank - static_cast<double>(l.z3 ? comm.max_z3() : comm.max_z2()) - verdict
                            : ring * (base + flag * n_base);
      // flags: every matrix this rank reduces to another shard's owner, and (HSDP) to another replicate's
      const int shard = rank % l.shard, rep = rank / l.shard;
      for (const OwnerCoord& o : plan.owners) {
        if (o.shard != shard) bytes += flag;
        else if (o.replicate != rep) bytes += flag;
      }
      bytes += verdict;
    } else {
      bytes = 2.0 * (world - 1) / world * pb + ring * flag * static_cast<double>(spec.params.size());
      if (name_ == "baseline_b")  // this implementation's all-gather: rounds of N matrices, padded to the largest
        for (size_t r0 = 0; r0 < order_.size(); r0 += static_cast<size_t>(world)) {
          int64_t maxn = 0;
          for (size_t k = r0; k < std::min(order_.size(), r0 + world); ++k)
            maxn = std::max<int64_t>(maxn, matrices_[static_cast<size_t>(order_[k])].second.numel());
          bytes += static_cast<double>(world - 1) * static_cast<double>(maxn) * 4.0;
        }
    }
    return nlohmann::json{{"step_ms", e->step_s * 1e3}, {"ns_ms", e->ns_s * 1e3}, {"bytes", bytes},
                          {"memory_bytes", e->memory_bytes_per_rank},
                          {"compute_ms", e->compute_s * 1e3}, {"exposed_comm_ms", e->exposed_comm_s * 1e3},
                          {"forward_ms", e->forward_s * 1e3}, {"backward_ms", e->backward_s * 1e3}};
  }

  // returns {step ms, NS ms, forward ms, backward ms, bytes}
  std::array<double, 5> step(const at::Tensor& batch, double& loss_out) {
    memory::MemoryTag mt(tag_);
    const int rank = b_.rank, world = b_.world_size;
    const int64_t per = a_.batch / world;
    mesh_->counters().reset();
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& p : model_->parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor loss = model_->loss(batch.narrow(0, rank * per, per));
    const double fwd_ms = elapsed_ms(t0);
    loss.backward();
    const double bwd_ms = elapsed_ms(t0) - fwd_ms;
    double ns_time = 0;
    if (opt_) {
      opt_->step();
      ns_time = opt_->consume_last_step_profile().ns_ms;
    } else {
      ns_time = baseline_step();
    }
    const double ms = elapsed_ms(t0);
    loss_out = loss.item<double>();
    return {ms, ns_time, fwd_ms, bwd_ms, static_cast<double>(mesh_->counters().snapshot().total_bytes())};
  }

 private:
  // Muon on the replicated matrices by hand (A: every rank all matrices; B: round-robin share +
  // all-gather of the updates), AdamW on the rest. Returns the NS milliseconds.
  double baseline_step() {
    at::NoGradGuard ng;
    const int rank = b_.rank, world = b_.world_size;
    prepare_muon_grads(*model_);  // waits the all-reduces of every gradient
    const bool round_robin = name_ == "baseline_b";
    double ns_time = 0;
    std::vector<at::Tensor> updates(matrices_.size());
    for (size_t k = 0; k < order_.size(); ++k) {
      const int i = order_[k];
      if (round_robin && static_cast<int>(k % world) != rank) continue;
      at::Tensor& p = matrices_[i].second;
      const at::Tensor g = p.grad();
      at::Tensor& buf = bufs_[matrices_[i].first];
      if (!buf.defined()) buf = at::zeros_like(g);
      buf.mul_(opts_.momentum).add_(g);
      const auto tn = std::chrono::steady_clock::now();
      updates[i] = ns_.local(g.add(buf, opts_.momentum), opts_.ns_steps);
      ns_time += elapsed_ms(tn);
    }
    if (round_robin) {
      for (size_t r0 = 0; r0 < order_.size(); r0 += world) {
        int64_t maxn = 0;
        for (size_t k = r0; k < std::min(order_.size(), r0 + world); ++k)
          maxn = std::max<int64_t>(maxn, matrices_[order_[k]].second.numel());
        at::Tensor mine = at::zeros({maxn}, mesh_->options(matrices_[order_[r0]].second.scalar_type()));
        const size_t my = r0 + static_cast<size_t>(rank);
        if (my < order_.size()) mine.narrow(0, 0, updates[order_[my]].numel()).copy_(updates[order_[my]].reshape(-1));
        at::Tensor all = at::empty({maxn * world}, mine.options());
        mesh_->world().allgather_flat(all, mine, "baseline B update all-gather").wait();
        for (size_t k = r0; k < std::min(order_.size(), r0 + world); ++k) {
          const auto& p = matrices_[order_[k]].second;
          updates[order_[k]] = all.narrow(0, static_cast<int64_t>(k - r0) * maxn, p.numel()).view(p.sizes());
        }
      }
    }
    for (size_t i = 0; i < matrices_.size(); ++i) {
      at::Tensor& p = matrices_[i].second;
      const double scale = 0.2 * std::sqrt(static_cast<double>(std::max(p.size(0), p.size(1))));
      p.add_(updates[i], -opts_.lr * scale);
    }
    for (auto& [n, p] : others_)
      if (p.grad().defined()) adamw_.update(p);
    return ns_time;
  }

  std::string name_;
  const BenchArgs& a_;
  Bootstrap& b_;
  int tag_ = 0;
  models::GPT model_{nullptr};
  std::shared_ptr<Mesh> mesh_;
  bool dmuon_ = false;
  MuonOptions opts_;
  std::unique_ptr<Muon> opt_;
  NewtonSchulz ns_{"gram"};
  SimpleAdamW adamw_;
  std::vector<std::pair<std::string, at::Tensor>> matrices_, others_;
  std::vector<int> order_;
  std::map<std::string, at::Tensor> bufs_;
};

// The max over the group's ranks of each rank's x.
double max_over_ranks(Communicator& group, double x) {
  at::Tensor all = at::zeros({group.size()}, group.options(at::kDouble));
  group.allgather_flat(all, at::tensor({x}, at::kDouble).to(group.device()), "bench calibration timing").wait_host();
  return all.max().item<double>();
}

// What --predict measures, in the same run as the steps and interleaved with them (after each
// measured round), so that the box's drift hits both alike; medians over the rounds.
//   * Rank 0 alone, the others waiting at a barrier (one rank on a core, what a description's rates
//     mean; HardwareSpec::cores_per_node prices the sharing): the matmul rate, the memory bandwidth,
//     the mfu of a plain forward + backward of the same model on one rank's micro-batch (no hooks),
//     and the NS profile of the model's shapes.
//   * Every rank at once: the link, from broadcasts and reduces rooted at rank 0 of a small and a
//     large payload (latency from the small one over ceil(log2 N) hops, bandwidth from the
//     difference), as the simulator prices a rooted collective; once every core has a rank (where
//     the simulator hides no collective) the large one is timed while every rank computes.
class Calibration {
 public:
  // `base`: the description whose links, mfu and cores the measurements replace
  Calibration(const BenchArgs& a, const std::string& text, int world, int rank, std::vector<NsShape> shapes,
              HardwareSpec base)
      : shapes_(std::move(shapes)), world_(world), base_(std::move(base)) {
    ns_opts_.reps = 3;
    ns_opts_.backend = a.ns_backend;  // the NS every variant runs (MuonOptions' default steps)
    if (rank != 0) return;  // rank 0 alone times the model
    models::GPTConfig cfg;
    cfg.vocab_size = 256;
    cfg.d_model = a.d_model;
    cfg.n_layers = a.layers;
    cfg.n_heads = a.heads;
    cfg.d_ff = a.d_ff;
    plain_ = models::GPT(cfg);
    batch_ = sample_batch(text, a.batch, a.seq_len, a.seed, 0).narrow(0, 0, a.batch / world);
    for (const auto& p : plain_->parameters()) flops_ += static_cast<double>(p.numel());
    flops_ *= 6.0 * static_cast<double>(a.batch / world * a.seq_len);
  }

  void round(Communicator& group, int rank) {
    group.barrier("bench calibration");
    if (rank == 0) {
      const DeviceRates r = measure_device_rates(at::kCPU, 3);
      tflops_.push_back(r.matmul_tflops);
      gbps_.push_back(r.memory_bandwidth_GBps);
      std::vector<double> t;
      for (int k = 0; k < 4; ++k) {
        const auto t0 = std::chrono::steady_clock::now();
        plain_->zero_grad();
        plain_->loss(batch_).backward();
        if (k > 0) t.push_back(elapsed_ms(t0) * 1e-3);
      }
      mfu_.push_back(std::min(1.0, flops_ / median(t) / (r.matmul_tflops * 1e12)));
      ns_.push_back(measure_ns_profile(shapes_, ns_opts_));
    }
    group.barrier("bench calibration: the link");
    // every rank must agree on `busy` (it adds collectives): the fewest cores any rank reports
    if (cores_ == 0) cores_ = static_cast<int>(-max_over_ranks(group, -static_cast<double>(local_cores())));
    const double hops = world_ > 1 ? std::ceil(std::log2(static_cast<double>(world_))) : 1.0;
    const bool busy = world_ >= cores_;
    const double small = rooted_ms(group, kSmall, false), large = rooted_ms(group, kLarge, busy);
    latency_us_.push_back(small * 1e3 / hops);
    link_GBps_.push_back(static_cast<double>(kLarge - kSmall) * 4.0 / std::max(1e-6, (large - small) * 1e-3) / 1e9);
  }

  // Rank 0, after at least one round: the base description with the medians in place of its rates,
  // mfu, links and NS profile, and this host's cores.
  HardwareSpec apply() const {
    HardwareSpec hw = base_;
    hw.matmul_tflops = median(tflops_);
    hw.memory_bandwidth_GBps = median(gbps_);
    hw.mfu = median(mfu_);
    // a transfer on one host is at least one copy: no faster than the memory (a collective that the
    // busy measurement saw fully hidden reads as no cost at all)
    hw.intra_node = hw.inter_node =
        LinkSpec{std::min(median(link_GBps_), hw.memory_bandwidth_GBps), median(latency_us_)};
    hw.devices_per_node = std::max(hw.devices_per_node, world_);  // one host
    hw.cores_per_node = cores_;
    NsProfile p = ns_.front();
    for (size_t i = 0; i < p.timings.size(); ++i) {
      // over the rounds that measured the shape the same way (batched or not: that is a measured choice)
      std::vector<double> single, batch;
      for (const auto& q : ns_) {
        if (q.timings[i].batch != p.timings[i].batch) continue;
        single.push_back(q.timings[i].single_us);
        batch.push_back(q.timings[i].batch_us);
      }
      p.timings[i].single_us = median(single);
      p.timings[i].batch_us = median(batch);
    }
    hw.ns_profile = std::make_shared<const NsProfile>(std::move(p));
    return hw;
  }

 private:
  static constexpr int64_t kSmall = 1024, kLarge = 1 << 20;  // fp32 elements

  // the ranks this host runs at once at one rank's rates: its cores over each rank's threads
  static int local_cores() {
    return static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN) / std::max(1, at::get_num_threads())));
  }

  // Broadcasts and reduces of n floats from rank 0, alternately: the median of kReps, max over ranks.
  // `busy`: every rank multiplies matrices meanwhile, and what counts is the time the collective adds
  // to the same multiplications alone (each rank's own difference, timed back to back).
  double rooted_ms(Communicator& group, int64_t n, bool busy) {
    at::Tensor x = at::ones({n});
    const at::Tensor a = at::ones({256, 256});
    auto work = [&] {
      for (int i = 0; i < kBusyGemms; ++i) (void)at::mm(a, a);
    };
    std::vector<double> t;
    for (int k = 0; k < kReps; ++k) {
      double alone = 0;
      if (busy) {
        group.barrier("bench calibration: compute alone");
        const auto t0 = std::chrono::steady_clock::now();
        work();
        alone = elapsed_ms(t0);
      }
      group.barrier("bench calibration: rooted collective");
      const auto t0 = std::chrono::steady_clock::now();
      Pending p = k % 2 == 0 ? group.broadcast(x, 0, "bench calibration broadcast")
                             : group.reduce(x, 0, Reduction::Sum, "bench calibration reduce");
      if (busy) work();
      p.wait();
      t.push_back(max_over_ranks(group, std::max(0.0, elapsed_ms(t0) - alone)));
    }
    return median(t);
  }
  static constexpr int kReps = 8;
  static constexpr int kBusyGemms = 24;  // ~8 ms of one core's multiplications, longer than the collective

  std::vector<NsShape> shapes_;
  int world_ = 1;
  HardwareSpec base_;
  int cores_ = 0;  // agreed in the first round
  models::GPT plain_{nullptr};
  at::Tensor batch_;
  double flops_ = 0;
  NsCalibrationOptions ns_opts_;
  std::vector<double> tflops_, gbps_, mfu_, latency_us_, link_GBps_;
  std::vector<NsProfile> ns_;
};

int run_bench_rank(const BenchArgs& a, std::ostream& out) {
  memory::install_counting_allocator();  // each variant's peak live bytes, under its own tag
  Bootstrap b = bootstrap_from_environment(c10::DeviceType::CPU);
  const int world = b.world_size;
  const std::string text = load_text("", static_cast<size_t>(a.seq_len + 2));
  std::vector<int> ranks(world);
  std::iota(ranks.begin(), ranks.end(), 0);
  Communicator trainer(b.world, "bench", ranks, kDefaultCollectiveTimeout, nullptr);
  std::vector<std::unique_ptr<Variant>> vs;
  std::vector<std::string> names = {"dmuon_z2", "dmuon_z3", "baseline_a", "baseline_b", "adamw"};
  if (a.replicate > 1 || a.one_pass) names.insert(names.begin() + 2, "dmuon_z3_1pass");
  if (a.shard_base) names.insert(names.begin() + 2, "dmuon_z3_sb");
  for (const auto& v : names) vs.push_back(std::make_unique<Variant>(v, a, b, static_cast<int>(vs.size()) + 1));
  // Interleaved: every step runs all variants in turn on the same batch, so machine noise hits them
  // alike; per step and variant the time is the max over ranks.
  std::optional<Calibration> calibration;
  // every rank reads the description first, so a bad one fails them all here
  if (!a.predict.empty()) calibration.emplace(a, text, world, b.rank, vs.back()->matrix_shapes(), load_hardware(a.predict));
  // per variant and measured step, the max over ranks of: step, NS, forward, backward ms
  constexpr int kCols = 4;
  std::vector<std::vector<std::array<double, kCols>>> times(vs.size());
  std::vector<std::vector<double>> bytes(vs.size());
  std::vector<double> loss(vs.size());
  for (int step = 1; step <= a.warmup + a.steps; ++step) {
    const at::Tensor batch = sample_batch(text, a.batch, a.seq_len, a.seed, step);
    for (size_t v = 0; v < vs.size(); ++v) {
      if (step == a.warmup + 1) memory::reset_peaks(vs[v]->tag());  // measured steps only
      trainer.barrier("bench step start");
      const auto r = vs[v]->step(batch, loss[v]);
      at::Tensor all = at::zeros({kCols * world}, trainer.options(at::kDouble));
      at::Tensor mine = at::tensor({r[0], r[1], r[2], r[3]}, at::kDouble).to(trainer.device());
      trainer.allgather_flat(all, mine, "bench timings").wait_host();
      const at::Tensor per_col = all.view({world, kCols}).amax(0);
      std::array<double, kCols> m{};
      for (int c = 0; c < kCols; ++c) m[static_cast<size_t>(c)] = per_col[c].item<double>();
      if (step > a.warmup) {
        times[v].push_back(m);
        bytes[v].push_back(r[4]);
      }
    }
    if (calibration && step > a.warmup) calibration->round(trainer, b.rank);
    if (b.rank == 0) out << "  N=" << world << " step " << step << "/" << a.warmup + a.steps << "\n" << std::flush;
  }
  // peak live bytes per variant: the max over ranks (each rank's own tag)
  std::vector<double> peak(vs.size());
  for (size_t v = 0; v < vs.size(); ++v) {
    at::Tensor all = at::zeros({world}, trainer.options(at::kDouble));
    at::Tensor mine =
        at::tensor({static_cast<double>(memory::stats(vs[v]->tag()).peak)}, at::kDouble).to(trainer.device());
    trainer.allgather_flat(all, mine, "bench peak memory").wait_host();
    peak[v] = all.max().item<double>();
  }
  nlohmann::json res = nlohmann::json::array();
  std::optional<HardwareSpec> hw;
  if (calibration && b.rank == 0) {
    hw = calibration->apply();
    hw->source = "measured by `dmuon bench step --predict` interleaved with its steps: rates, mfu (a plain forward + "
                 "backward) and NS profile by one rank alone, links by broadcasts and reduces over all " +
                 std::to_string(world) + " ranks (under load once every core has a rank), cores_per_node = this host's "
                 "cores over a rank's threads; ns_efficiency and memory_GB from '" + hw->name + "'";
    hw->name = "calibrated " + hw->name + " (dmuon bench step, N=" + std::to_string(world) + ")";
  }
  for (size_t v = 0; v < vs.size(); ++v) {
    auto col = [&](int c) {
      std::vector<double> x;
      for (const auto& t : times[v]) x.push_back(t[static_cast<size_t>(c)]);
      return median(x);
    };
    res.push_back({{"variant", vs[v]->name()},
                   {"peak_bytes", peak[v]},
                   {"step_ms", col(0)},
                   {"ns_ms", col(1)},
                   {"forward_ms", col(2)},
                   {"backward_ms", col(3)},
                   {"bytes", std::accumulate(bytes[v].begin(), bytes[v].end(), 0.0) / bytes[v].size()},
                   {"loss", loss[v]}});
    if (hw)
      if (auto p = vs[v]->predict(*hw, a.batch * a.seq_len)) res.back()["predicted"] = *p;
  }
  if (b.rank == 0) {
    std::filesystem::create_directories(a.out);
    write_file_atomic(a.out + "/bench_step_N" + std::to_string(world) + ".json", res.dump(2));
    if (hw)  // the calibrated description, for `dmuon plan --simulate --hardware FILE`
      write_file_atomic(a.out + "/hardware_N" + std::to_string(world) + ".json", hardware_to_json(*hw));
  }
  leave_together(trainer, b.store, "bench", std::chrono::duration<double>(kDefaultCollectiveTimeout).count());
  return 0;
}

}  // namespace

int run_bench_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  if (args.empty() || args[0] != "step") {
    err << "usage: dmuon bench step [--ranks 2,4] [--steps N] [--batch B] [--d-model D] [--layers L] [--out DIR]\n";
    return 2;
  }
  CLI::App app{"dmuon bench step: DMuon Z2/Z3 vs naive DP Muon (A), round-robin owners (B) and AdamW",
               "dmuon bench step"};
  BenchArgs a;
  app.add_option("--ranks", a.ranks, "comma-separated rank counts")->capture_default_str();
  app.add_option("--steps", a.steps, "measured steps per variant")->capture_default_str();
  app.add_option("--warmup", a.warmup, "unmeasured steps per variant")->capture_default_str();
  app.add_option("--batch", a.batch, "global batch (sequences)")->capture_default_str();
  app.add_option("--seq-len", a.seq_len, "sequence length")->capture_default_str();
  app.add_option("--d-model", a.d_model, "model width")->capture_default_str();
  app.add_option("--layers", a.layers, "blocks")->capture_default_str();
  app.add_option("--heads", a.heads, "heads")->capture_default_str();
  app.add_option("--d-ff", a.d_ff, "MLP width")->capture_default_str();
  app.add_option("--ns-backend", a.ns_backend, "gram or direct")->capture_default_str();
  app.add_option("--out", a.out, "where the per-N JSON results go")->capture_default_str();
  app.add_option("--pack", a.pack, "DMuon pack_small_params: 1, 0, or -1 for the default (env/planner)");
  app.add_option("--replicate", a.replicate,
                 "HSDP replicate groups R for the DMuon variants (N/R shard ranks each); R > 1 adds dmuon_z3_1pass, "
                 "Z3 with group_prepare_ahead off")
      ->capture_default_str();
  app.add_flag("--one-pass", a.one_pass,
               "add dmuon_z3_1pass (Z3 with group_prepare_ahead off: the one-pass step) on any mesh, for the "
               "step/1pass column");
  app.add_flag("--shard-base", a.shard_base, "add dmuon_z3_sb: Z3 with the non-matrix parameters on sharded_adamw");
  app.add_option("--predict", a.predict,
                 "a hardware description: print the step simulator's prediction of every variant next to the "
                 "measurement, priced with the matmul rate, memory bandwidth, mfu, NS profile (one rank alone), links "
                 "(all ranks) and cores measured between the steps; the calibrated description goes to "
                 "OUT/hardware_N<n>.json");
  if (auto rc = parse_args(app, std::vector<std::string>(args.begin() + 1, args.end()), out, err)) return *rc;
  try {
    if (launched_as_rank()) return run_bench_rank(a, out);
    if (!a.predict.empty()) {
      if (std::filesystem::exists(a.predict))  // a file, not a preset name
        if (const std::string why = input_file_problem(a.predict); !why.empty())
          throw std::invalid_argument("--predict " + a.predict + ": " + why);
      load_hardware(a.predict);  // a bad description fails here, before any rank starts
      if (a.steps < 1)
        throw std::invalid_argument("--predict calibrates between measured steps: it needs --steps >= 1, got " +
                                    std::to_string(a.steps));
    }
    std::vector<int> ns;
    std::stringstream ss(a.ranks);
    for (std::string tok; std::getline(ss, tok, ',');) {
      if (tok.empty() || tok.size() > 3 || tok.find_first_not_of("0123456789") != std::string::npos ||
          std::stoi(tok) < 1 || std::stoi(tok) > 64)
        throw std::invalid_argument("--ranks '" + a.ranks + "': '" + tok + "' is not a rank count; --ranks is a "
                                    "comma-separated list of rank counts from 1 to 64, e.g. 2,4");
      ns.push_back(std::stoi(tok));
    }
    if (ns.empty()) throw std::invalid_argument("--ranks is empty; pass rank counts, e.g. --ranks 2,4");
    for (const auto& [flag, v, min] : {std::tuple<const char*, int64_t, int64_t>{"--steps", a.steps, 1},
                                       {"--warmup", a.warmup, 0}, {"--batch", a.batch, 1}, {"--seq-len", a.seq_len, 2},
                                       {"--d-model", a.d_model, 1}, {"--layers", a.layers, 1}, {"--heads", a.heads, 1},
                                       {"--d-ff", a.d_ff, 0}})
      if (v < min)
        throw std::invalid_argument(std::string(flag) + " must be >= " + std::to_string(min) + " (got " +
                                    std::to_string(v) + ")");
    for (int n : ns) {
      if (a.batch % n != 0)
        throw std::invalid_argument("--batch " + std::to_string(a.batch) + " must split evenly over " +
                                    std::to_string(n) + " ranks");
      if (a.replicate < 1 || n % a.replicate != 0)
        throw std::invalid_argument("--replicate " + std::to_string(a.replicate) + " must divide every rank count (" +
                                    std::to_string(n) + ")");
    }
    out << "dmuon bench step: GPT d=" << a.d_model << " ff=" << a.d_ff << " layers=" << a.layers << ", batch "
        << a.batch << "x" << a.seq_len << ", " << a.steps << " measured steps (+" << a.warmup << " warm-up), NS "
        << a.ns_backend << "\n" << std::flush;
    nlohmann::json all;
    for (int n : ns) {
      LaunchOptions lo;
      lo.ranks = n;
      lo.args = args;
      lo.subcommand = "bench";
      const int rc = launch_local_ranks(lo, err);
      if (rc != 0) return rc;
      std::ifstream f(a.out + "/bench_step_N" + std::to_string(n) + ".json");
      all[std::to_string(n)] = nlohmann::json::parse(f);
    }
    out << "\n" << std::left << std::setw(4) << "N" << std::setw(12) << "variant" << std::right << std::setw(10)
        << "step_ms" << std::setw(10) << "NS_ms" << std::setw(14) << "bytes/rank" << std::setw(9) << "step/A"
        << std::setw(9) << "NS/A" << std::setw(11) << "step/AdamW" << std::setw(11) << "peak_MB"
        << (a.replicate > 1 || a.one_pass ? "  step/1pass" : "") << "\n";
    for (int n : ns) {
      const auto& rows = all[std::to_string(n)];
      double a_step = 0, a_ns = 0, w_step = 0, p_step = 0;
      for (const auto& r : rows) {
        if (r["variant"] == "baseline_a") a_step = r["step_ms"], a_ns = r["ns_ms"];
        if (r["variant"] == "adamw") w_step = r["step_ms"];
        if (r["variant"] == "dmuon_z3_1pass") p_step = r["step_ms"];
      }
      for (const auto& r : rows) {
        const double st = r["step_ms"], nsm = r["ns_ms"], by = r["bytes"];
        out << std::left << std::setw(4) << n << std::setw(12) << r["variant"].get<std::string>() << std::right
            << std::fixed << std::setprecision(1) << std::setw(10) << st << std::setw(10) << nsm << std::setw(14)
            << std::setprecision(0) << by << std::setprecision(3) << std::setw(9) << (a_step > 0 ? st / a_step : 0)
            << std::setw(9) << (a_ns > 0 ? nsm / a_ns : 0) << std::setw(11) << (w_step > 0 ? st / w_step : 0)
            << std::setprecision(2) << std::setw(11) << r["peak_bytes"].get<double>() / 1e6 << std::setprecision(3);
        if (p_step > 0) out << std::setw(12) << st / p_step;
        out << "\n";
      }
    }
    if (!a.predict.empty()) {
      out << "\npredicted by the step simulator (--predict " << a.predict << "), rank 0's bytes; peak_MB measured "
          << "(live tensors, max over ranks) against the simulator's model state per rank (no activations)\n"
          << std::left << std::setw(4) << "N" << std::setw(12) << "variant" << std::right << std::setw(10) << "step_ms"
          << std::setw(10) << "pred_ms" << std::setw(10) << "pred/meas" << std::setw(10) << "fwdbwd_ms"
          << std::setw(10) << "pred_fb" << std::setw(10) << "NS_ms" << std::setw(10)
          << "pred_NS" << std::setw(14) << "bytes" << std::setw(14) << "pred_bytes" << std::setw(10) << "diff"
          << std::setw(10) << "peak_MB" << std::setw(10) << "state_MB" << "\n";
      for (int n : ns)
        for (const auto& r : all[std::to_string(n)]) {
          if (!r.contains("predicted")) continue;
          const auto& p = r["predicted"];
          const double st = r["step_ms"], ps = p["step_ms"], by = r["bytes"], pby = p["bytes"];
          out << std::left << std::setw(4) << n << std::setw(12) << r["variant"].get<std::string>() << std::right
              << std::fixed << std::setprecision(1) << std::setw(10) << st << std::setw(10) << ps << std::setprecision(3)
              << std::setw(10) << (st > 0 ? ps / st : 0) << std::setprecision(1) << std::setw(10)
              << r["forward_ms"].get<double>() + r["backward_ms"].get<double>() << std::setw(10)
              << p["forward_ms"].get<double>() + p["backward_ms"].get<double>() << std::setw(10)
              << r["ns_ms"].get<double>() << std::setw(10) << p["ns_ms"].get<double>() << std::setprecision(0)
              << std::setw(14) << by << std::setw(14) << pby << std::setw(10) << std::abs(by - pby) << std::setprecision(2)
              << std::setw(10) << r["peak_bytes"].get<double>() / 1e6 << std::setw(10)
              << p["memory_bytes"].get<double>() / 1e6 << "\n";
        }
    }
    write_file_atomic(a.out + "/bench_step.json", all.dump(2));
    return 0;
  } catch (const std::exception& e) {
    err << "error: " << error_text(e) << "\n";
    return 1;
  }
}

}  // namespace dmuon::cli
