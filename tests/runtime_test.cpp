// Dedicated ownership at run time: N-rank training equals single-process training.
//
// Every multi-rank test runs N ranks as threads (Gloo on 127.0.0.1, a fresh FileStore per test).
// The single-process reference below is implemented independently of dmuon's runtime and
// optimizer: plain Muon (momentum, Nesterov, NS via the ns/ module, scaled update) and AdamW
// (PyTorch's formula) on the whole global batch.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "dmuon/bootstrap.h"
#include "dmuon/checkpoint.h"
#include "dmuon/compat.h"
#include "dmuon/dedicate.h"
#include "dmuon/diagnostics.h"
#include "dmuon/host_sync.h"
#include "dmuon/model_view.h"
#include "dmuon/muon.h"
#include "dmuon/newton_schulz.h"
#include "dmuon/torch_version.h"
#include "model/gpt.h"
#include "optim/multi_tensor.h"  // fused_adamw_available
#include "runtime/inspect.h"  // white-box checks of buffer storage
#include "support/multirank.h"
#include "support/training.h"

namespace dmuon {
namespace {

using models::GPT;
using models::GPTConfig;
using testing::StateDict;

using testing::init_state;
using testing::load_state;
using testing::make_batches;
using testing::make_mesh;
using testing::max_rel;
using testing::RefResult;
using testing::reference_train;
using testing::small_config;
using testing::TrainConfig;

using testing::error_of;

// ---- distributed run ------------------------------------------------------------------------------
// The layout (world, HSDP replicate groups, Z2/Z3, DDP path, sharded_adamw, unshard mode) plus the
// runtime knobs these tests vary.
struct DistConfig : testing::Layout {
  DistConfig() { pack_small_params.reset(); }  // the planner's default unless a test says otherwise
  std::string owner_strategy;
  bool replicate_async = true;
  bool group_prepare_ahead = true;
  bool delay_stage2 = true;
  double bucket_mb = 0.0;
  int min_idle_ranks = 0;  // ranks that must own no Muon matrix in this layout
  // dmuon's loopback backend for every group (unset: Gloo / the store backend on the CPU); on a
  // device, the model and the data live there too
  std::optional<LoopbackOptions> loopback;
  bool side_stream = false;  // a device: each rank trains on a side stream (not the default stream)
  std::optional<bool> fused, foreach;  // MuonOptions' multi-tensor kernels (unset: on CUDA)
  // when set, every rank's steps must have run this many AdamW / momentum updates on them
  std::optional<int> expect_fused_min, expect_foreach_min;
};

// Runs the distributed training and compares every rank's view with the reference.
void check_equivalence(const GPTConfig& cfg, const TrainConfig& tc, const DistConfig& dc, int64_t global_batch = 12,
                       int64_t seq = 12) {
  const StateDict init = init_state(cfg, 1234, tc.dtype);
  const double bound = testing::equivalence_bound(tc.dtype);
  const auto batches = make_batches(tc.steps, global_batch, seq, cfg.vocab_size, 99);
  const RefResult ref = reference_train(cfg, init, batches, tc);
  ASSERT_LT(ref.losses.back(), ref.losses.front()) << "the reference did not learn";
  std::mutex mu;
  std::map<std::string, int> checked_owned;
  std::set<int> owning_ranks;
  double worst = 0;  // the largest relative difference seen, reported with the bound
  auto within = [&](double e, const std::string& what) {
    {
      std::lock_guard<std::mutex> g(mu);
      worst = std::max(worst, e);
    }
    if (!(e <= bound)) throw std::runtime_error(what + ": " + std::to_string(e) + " > bound " + std::to_string(bound));
  };
  ASSERT_EQ(global_batch % dc.world, 0) << "the global batch must split evenly";
  ASSERT_EQ((global_batch / dc.world) % tc.accum, 0) << "the per-rank batch must split into micro-batches";
  testing::run_ranks(dc.world, [&](testing::RankContext& ctx) {
    std::optional<c10::StreamGuard> on_side_stream;
    if (dc.side_stream) {
      const c10::impl::VirtualGuardImpl impl(ctx.device.type());
      on_side_stream.emplace(impl.getStreamFromGlobalPool(ctx.device));
    }
    GPT m(cfg);
    load_state(m, init);
    if (!ctx.device.is_cpu()) m->to(ctx.device);
    if (!tc.frozen.empty()) m->frozen_blocks = tc.frozen;
    m->block_order = tc.block_order;
    m->frozen_embedding = tc.frozen_embedding;
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), dc.replicate);
    DedicateOptions dopts;
    dopts.delay_stage2_to_optimizer = dc.delay_stage2;
    dopts.replicate_broadcast_bucket_mb = dc.bucket_mb;
    if (!dc.owner_strategy.empty()) dopts.plan.owner_strategy = dc.owner_strategy;
    testing::dedicate_gpt(m, mesh, dc, dopts);
    MuonOptions mo = testing::muon_options(tc);
    mo.replicate_async = dc.replicate_async;
    mo.group_prepare_ahead = dc.group_prepare_ahead;
    mo.fused = dc.fused;
    mo.foreach = dc.foreach;
    mo.record_step_profile = dc.expect_fused_min.has_value() || dc.expect_foreach_min.has_value();
    Muon opt(m.ptr(), mo);
    std::unique_ptr<torch::optim::StepLR> sched;
    if (tc.scheduler) sched = std::make_unique<torch::optim::StepLR>(opt, 3, 0.5);
    const int64_t per = global_batch / ctx.world;
    if (m->frozen_blocks.empty()) m->frozen_blocks.assign(static_cast<size_t>(cfg.n_layers), false);
    auto raise_now = std::make_shared<bool>(false);
    if (tc.raised_backward) {  // on a matrix of the middle block: the last block's gradients are reduced by then
      bool hooked = false;
      for (const auto& item : m->named_parameters())
        if (item.key().find("layers." + std::to_string((cfg.n_layers - 1) / 2) + ".") == 0 && item.value().dim() == 2) {
          at::Tensor(item.value()).register_hook([raise_now](const at::Tensor& g) {
            if (*raise_now) {
              *raise_now = false;
              throw std::runtime_error("simulated CUDA out of memory");
            }
            return g;
          });
          hooked = true;
          break;
        }
      if (!hooked) throw std::runtime_error("no matrix in the middle block to raise in");
    }
    for (size_t s = 0; s < batches.size(); ++s) {
      const at::Tensor& tokens = batches[s];
      if (tc.frozen_on_odd_steps >= 0) m->frozen_blocks[static_cast<size_t>(tc.frozen_on_odd_steps)] = s % 2 == 1;
      if (!tc.keep_grads) opt.zero_grad(tc.zero_grad_to_none);
      const at::Tensor mine = tokens.narrow(0, ctx.rank * per, per).to(ctx.device);
      if (tc.discarded_backward) {  // a backward whose gradients zero_grad must discard
        std::optional<NoSync> ns;
        if (tc.discarded_in_no_sync) ns.emplace(*m);
        m->loss((mine * 7 + 3).remainder(cfg.vocab_size)).backward();
        ns.reset();
        if (tc.module_zero_grad)
          m->zero_grad(/*set_to_none=*/true);
        else
          opt.zero_grad(tc.zero_grad_to_none);
      }
      if (tc.raised_backward && s > 0) {
        *raise_now = true;
        const std::string raised = error_of([&] { m->loss(mine).backward(); });
        if (raised.find("simulated CUDA out of memory") == std::string::npos)
          throw std::runtime_error("the backward did not raise the hook's error: " + raised);
        if (tc.raised_backward_zero_grad) {
          const std::string refused = error_of([&] { opt.step(); });
          if (refused.find("rank " + std::to_string(ctx.rank) + ": the last backward through this dmuon model did not "
                           "finish") == std::string::npos)
            throw std::runtime_error("step() after a backward that raised: " + refused);
          opt.zero_grad(tc.zero_grad_to_none);
        }
      }
      const int64_t micro = per / tc.accum;
      for (int a = 0; a < tc.accum; ++a) {
        std::optional<NoSync> ns;
        if (tc.no_sync && a + 1 < tc.accum) ns.emplace(*m);
        const at::Tensor mb = mine.narrow(0, a * micro, micro);
        at::Tensor loss;
        if (tc.two_forwards) {  // two graphs, one backward
          const int64_t h = micro / 2;
          loss = (m->loss(mb.narrow(0, 0, h)) + m->loss(mb.narrow(0, h, micro - h))) / (2.0 * tc.accum);
        } else {
          loss = m->loss(mb) / tc.accum;
        }
        loss.backward();
      }
      if (tc.clip > 0) {  // the global norm over every parameter, as the reference clips it
        GradClipOptions co;
        co.scope = ClipScope::AllParams;
        opt.clip_grad_norm_(tc.clip, co);
      }
      if (tc.edit_grads) {
        std::vector<std::pair<std::string, at::Tensor>> named;
        for (const auto& item : m->named_parameters(true)) named.emplace_back(item.key(), item.value());
        tc.edit_grads(s, named);
      }
      opt.step();
      if (mo.record_step_profile) {  // the multi-tensor kernels ran (a path that silently fell back fails here)
        const StepProfile p = opt.consume_last_step_profile();
        if (p.adamw_fused < dc.expect_fused_min.value_or(0) || p.momentum_foreach < dc.expect_foreach_min.value_or(0))
          throw std::runtime_error("rank " + std::to_string(ctx.rank) + ": " + std::to_string(p.adamw_fused) +
                                   " fused AdamW and " + std::to_string(p.momentum_foreach) +
                                   " foreach momentum updates in a step");
      }
      if (sched) sched->step();
    }
    // compare: owned matrices (param + momentum), replicated params (param + AdamW moment)
    const bool gather = dc.unshard == "all_gather";
    if (dc.ddp || dc.replicate > 1 || gather) wait_all_post_step_broadcasts(*m);
    if (gather) {
      // every rank's shard of every packed unit is the slice of the reference's packed value (between
      // steps the shards are what is current; the forward's all-gather rebuilds the matrices)
      for (const auto& u : inspect::packed_units(*m)) {
        std::vector<at::Tensor> parts;
        for (const auto& n : u.params) parts.push_back(ref.params.at(n).reshape(-1));
        at::Tensor flat = at::cat(parts);
        flat = at::cat({flat, at::zeros({u.shard_len * mesh->shard_size() - flat.numel()}, flat.options())});
        const int64_t start = mesh->shard_rank() * u.shard_len, len = std::min(u.shard_len, u.numel - start);
        if (len > 0) within(max_rel(u.shard.narrow(0, 0, len), flat.narrow(0, start, len)), u.boundary + " shard differs");
      }
    }
    for (const auto& d : get_dedicated_params(*m)) {
      const bool holder = d.owner.shard == mesh->shard_rank();
      // HSDP in all_gather mode: the holders of the other replicate groups get the new value from the
      // next all-gather (their shards were checked above)
      if (!d.is_owner && dc.replicate > 1 && holder && gather && !dc.ddp) continue;
      if (!d.is_owner && (dc.ddp || (dc.replicate > 1 && holder))) {
        // the DDP path: every rank holds the owner's published value
        const double e = max_rel(d.param, ref.params.at(d.name));
        within(e, d.name + " (published copy) differs");
        continue;
      }
      if (!d.is_owner) {
        if (d.param.numel() != 0)
          throw std::runtime_error("non-owner holds data between steps for " + d.name);
        continue;
      }
      const double e = max_rel(d.param, ref.params.at(d.name));
      within(e, d.name + " differs from the reference");
      const auto* st = opt.state_of(d.param);
      if (ref.momentum.count(d.name)) {
        if (!st || !st->momentum_buffer().defined()) throw std::runtime_error("no momentum for " + d.name);
        const double em = max_rel(st->momentum_buffer(), ref.momentum.at(d.name));
        within(em, d.name + " momentum differs");
      }
      std::lock_guard<std::mutex> g(mu);
      checked_owned[d.name]++;
      owning_ranks.insert(ctx.rank);
    }
    if (dc.sharded) {
      // every rank holds only its slice (padded to a multiple of G) of the embedding, norms and head
      const auto sharded = inspect::sharded_params(*m);
      if (sharded.empty()) throw std::runtime_error("no sharded_adamw parameters");
      for (const auto& e : sharded) {
        if (e.param.numel() != 0 || e.full.storage().nbytes() != 0)
          throw std::runtime_error("sharded parameter " + e.name + " keeps its full tensor between steps");
        const int64_t G = mesh->shard_size(), L = e.shard_len, start = mesh->shard_rank() * L;
        if (L != (e.numel + G - 1) / G || e.shard.numel() != L) throw std::runtime_error("shard size of " + e.name);
        const int64_t len = std::max<int64_t>(0, std::min(L, e.numel - start));
        if (len == 0) continue;
        const at::Tensor want = ref.params.at(e.name).reshape(-1).narrow(0, start, len);
        const double err = max_rel(e.shard.narrow(0, 0, len), want);
        within(err, e.name + " (sharded) differs");
        const auto* ost = opt.state_of(e.param);
        if (!ost || !ost->exp_avg().defined() || ost->exp_avg().numel() != L)
          throw std::runtime_error("no shard-sized AdamW state for " + e.name);
        const double em = max_rel(ost->exp_avg().narrow(0, 0, len), ref.exp_avg.at(e.name).reshape(-1).narrow(0, start, len));
        within(em, e.name + " sharded exp_avg differs");
      }
      // summarize_param_groups reports them with their full shape, route and this rank's slice
      const auto summary = summarize_param_groups(*m, opt, 1000);
      size_t rows = 0;
      for (const auto& grp : summary["groups"])
        for (const auto& row : grp["params"]) {
          if (row.value("route", "") != "sharded_adamw") continue;
          ++rows;
          const std::string name = row["name"];
          if (row["shape"].get<std::vector<int64_t>>() != ref.params.at(name).sizes().vec())
            throw std::runtime_error("summarize_param_groups: shape of " + name + ": " + row.dump());
          const int64_t L = (ref.params.at(name).numel() + mesh->shard_size() - 1) / mesh->shard_size();
          if (row["shard_numel"] != L || row["shard_offset"] != L * mesh->shard_rank() || row["boundary"].empty())
            throw std::runtime_error("summarize_param_groups: slice of " + name + ": " + row.dump());
        }
      if (rows != sharded.size() || summary["totals"]["sharded_adamw_params"] != sharded.size())
        throw std::runtime_error("summarize_param_groups: sharded rows " + std::to_string(rows) + ": " +
                                 summary["totals"].dump());
    }
    for (const auto& [name, p] : get_base_params(*m)) {
      const double e = max_rel(p, ref.params.at(name));
      within(e, name + " (AdamW) differs");
      if (ref.exp_avg.count(name)) {
        const auto* st = opt.state_of(p);
        if (!st || !st->exp_avg().defined()) throw std::runtime_error("no AdamW state for " + name);
        const double em = max_rel(st->exp_avg(), ref.exp_avg.at(name));
        within(em, name + " exp_avg differs");
      }
    }
  }, std::chrono::seconds(60), dc.loopback);
  std::fprintf(stderr, "[equivalence] %s: worst relative difference %.2e (bound %.0e)\n",
               tc.dtype == at::kDouble ? "float64" : "float32", worst, bound);
  // every Muon matrix was checked exactly once, on its owner
  int muon_count = 0;
  for (const auto& [k, v] : ref.params) muon_count += models::is_muon_matrix(k, v) ? 1 : 0;
  EXPECT_EQ(static_cast<int>(checked_owned.size()), muon_count);
  for (const auto& [k, n] : checked_owned) EXPECT_EQ(n, 1) << k;
  EXPECT_GE(dc.world - static_cast<int>(owning_ranks.size()), dc.min_idle_ranks) << "ranks owning nothing";
}

class EquivalenceTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(EquivalenceTest, TrainingMatchesSingleProcess) {
  const auto [world, z3] = GetParam();
  TrainConfig tc;
  DistConfig dc;
  dc.world = world;
  dc.z3 = z3;
  dc.pack_small_params = false;  // spread the matrices of a layer over the ranks
  check_equivalence(small_config(), tc, dc);
}

INSTANTIATE_TEST_SUITE_P(Ranks, EquivalenceTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Values(true, false)),
                         [](const auto& info) {
                           std::string name = "N";  // (appended, not "N" + ...: GCC 12's -Wrestrict false positive)
                           name += std::to_string(std::get<0>(info.param));
                           name += std::get<1>(info.param) ? "_Z3" : "_Z2";
                           return name;
                         });

// ---- the same equivalence through dmuon's loopback backend ----------------------------------------
// Every group is the loopback backend (ranks as threads, copies and rank-order sums on one device):
// on the CPU here, and on CUDA tensors where a GPU is present, where it behaves as NCCL (its own
// stream per group, stream-dependency waits, tensors held until the wait) and sleeps before every
// copy, so a wait dmuon forgot (or a buffer freed on the wrong stream) becomes a wrong result. The
// side-stream variants train each rank on a non-default stream.
enum class Transport { Cpu, Cuda, CudaSideStream };
struct LoopbackCase {
  std::string name;
  Transport transport;
  DistConfig dc;
  TrainConfig tc;
};

std::vector<LoopbackCase> loopback_cases() {
  std::vector<std::pair<std::string, std::pair<DistConfig, TrainConfig>>> layouts;
  auto add = [&](const std::string& name, auto&& set) {
    DistConfig dc;
    TrainConfig tc;
    tc.steps = 4;
    dc.pack_small_params = false;
    set(dc, tc);
    layouts.push_back({name, {dc, tc}});
  };
  add("Z3_N3", [](DistConfig& d, TrainConfig&) { d.world = 3; });
  add("Z2_N2", [](DistConfig& d, TrainConfig&) { d.world = 2, d.z3 = false; });
  add("Hsdp2x2AsyncPublishPrepareAhead", [](DistConfig& d, TrainConfig&) { d.world = 4, d.replicate = 2; });
  add("Hsdp2x2Synchronous", [](DistConfig& d, TrainConfig&) {
    d.world = 4, d.replicate = 2, d.replicate_async = false, d.group_prepare_ahead = false;
  });
  add("DdpPath", [](DistConfig& d, TrainConfig&) { d.world = 2, d.ddp = true; });
  add("AllGatherMode", [](DistConfig& d, TrainConfig&) { d.world = 2, d.unshard = "all_gather"; });
  add("ShardedAdamw", [](DistConfig& d, TrainConfig&) { d.world = 2, d.sharded = true; });
  add("NoSyncAccumulation", [](DistConfig& d, TrainConfig& t) { d.world = 2, t.accum = 2, t.no_sync = true; });
  std::vector<LoopbackCase> out;
  for (const auto& [name, cfg] : layouts)
    for (const auto& [tname, t] : std::vector<std::pair<std::string, Transport>>{
             {"Cpu", Transport::Cpu}, {"Cuda", Transport::Cuda}, {"CudaSideStream", Transport::CudaSideStream}})
      out.push_back({tname + "_" + name, t, cfg.first, cfg.second});
  return out;
}

class LoopbackEquivalenceTest : public ::testing::TestWithParam<LoopbackCase> {};

TEST_P(LoopbackEquivalenceTest, TrainingMatchesSingleProcess) {
  LoopbackCase c = GetParam();
  LoopbackOptions lo;
  if (c.transport != Transport::Cpu) {
    if (!DMUON_WITH_CUDA) GTEST_SKIP() << "this dmuon build has no CUDA (CPU LibTorch)";
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
    lo.device = at::Device(at::kCUDA, 0);
    lo.sleep_cycles = 200000;  // ~0.1 ms before every copy: a missing wait reads stale data
  }
  c.dc.loopback = lo;
  c.dc.side_stream = c.transport == Transport::CudaSideStream;
  check_equivalence(small_config(), c.tc, c.dc);
}

INSTANTIATE_TEST_SUITE_P(Layouts, LoopbackEquivalenceTest, ::testing::ValuesIn(loopback_cases()),
                         [](const auto& info) { return info.param.name; });

// Global-norm clipping (ClipScope::AllParams) before every step, against the reference clipping
// its whole model: the norm counts each element once on every layout, so the scaled gradients, and
// with them the momentum and AdamW moments, match.
// One synchronous Muon step on random tokens, counted from a reset of the mesh's counters.
std::unique_ptr<Muon> counted_sync_step(GPT& m, Mesh& mesh) {
  MuonOptions mo;
  mo.first_step_progress_log = false;
  mo.replicate_async = false;
  auto opt = std::make_unique<Muon>(m.ptr(), mo);
  mesh.counters().reset();
  m->loss(at::randint(32, {2, 6}, at::kLong)).backward();
  opt->step();
  return opt;
}

TEST(RuntimeTest, GlobalNormClippingMatchesSingleProcess) {
  struct Case {
    int world, replicate;
    bool z3, sharded;
    int accum;
  };
  for (const Case c : {Case{1, 1, true, false, 1}, Case{2, 1, true, false, 1}, Case{3, 1, false, false, 1},
                       Case{4, 2, true, false, 1}, Case{2, 1, true, true, 1}, Case{2, 1, true, false, 2}}) {
    TrainConfig tc;
    tc.steps = 4;
    tc.clip = 0.05;  // well below the gradient norm of this model: every step clips
    tc.accum = c.accum;
    tc.no_sync = c.accum > 1;
    DistConfig dc;
    dc.world = c.world;
    dc.replicate = c.replicate;
    dc.z3 = c.z3;
    dc.sharded = c.sharded;
    dc.pack_small_params = false;
    SCOPED_TRACE(std::string("N") + std::to_string(c.world) + " R" + std::to_string(c.replicate) + (c.sharded ? " sharded" : "") +
                 " accum " + std::to_string(c.accum));
    check_equivalence(small_config(), tc, dc);
  }
}

// The same comparison in fp32: distributed and single-process runs differ by fp32 reduction order
// (BLAS kernel, thread count, Gloo's sum order), which Newton-Schulz amplifies. The bound
// (testing::kFloat32Bound) is 10x above the worst case measured on several machines; see training.h.
TEST(RuntimeTest, Float32TrainingMatchesSingleProcessWithinTheMeasuredNoise) {
  struct Case {
    int world, replicate;
    bool z3, sharded;
  };
  for (const Case c : {Case{2, 1, true, false}, Case{3, 1, false, false}, Case{4, 2, true, false},
                       Case{3, 1, true, true}}) {
    TrainConfig tc;
    tc.dtype = at::kFloat;
    DistConfig dc;
    dc.world = c.world;
    dc.replicate = c.replicate;
    dc.z3 = c.z3;
    dc.sharded = c.sharded;
    dc.pack_small_params = false;
    SCOPED_TRACE(std::string("N") + std::to_string(c.world) + " R" + std::to_string(c.replicate));
    check_equivalence(small_config(), tc, dc);
  }
}

// A layout with one buffer per matrix (pack_small_params off).
DistConfig unpacked_layout(int world, int replicate, bool ddp, bool sharded) {
  DistConfig dc;
  dc.world = world;
  dc.replicate = replicate;
  dc.ddp = ddp;
  dc.sharded = sharded;
  dc.pack_small_params = false;
  return dc;
}

// backward(b1) -- discarded --; backward(b2); step() == backward(b2); step(), as in single-process LibTorch:
// each case's layout, with b1 discarded by the optimizer's zero_grad(to_none) or by the model's own
// zero_grad(true) (module_zero_grad), inside NoSync or not, then `accum` micro-batches.
struct DiscardCase {
  std::string label;
  int world, replicate;
  bool ddp, sharded, to_none, in_no_sync;
  int accum;
};
void check_discarded_backward(const std::vector<DiscardCase>& cases, bool module_zero_grad) {
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    TrainConfig tc;
    tc.steps = 3;
    tc.discarded_backward = true;
    tc.discarded_in_no_sync = c.in_no_sync;
    tc.zero_grad_to_none = c.to_none;
    tc.module_zero_grad = module_zero_grad;
    tc.accum = c.accum;
    tc.no_sync = c.accum > 1;
    check_equivalence(small_config(2), tc, unpacked_layout(c.world, c.replicate, c.ddp, c.sharded));
  }
}

// The optimizer's zero_grad discards what dmuon already holds (reduced Muon sums, replicated buckets, sharded
// slices), on every route and path, with set_to_none either way.
TEST(RuntimeTest, ZeroGradDiscardsGradientsDmuonAlreadyHolds) {
  check_discarded_backward({{"one rank", 1, 1, false, false, true, false, 1},
                            {"N2 Muon + replicated", 2, 1, false, false, true, false, 1},
                            {"N3 sharded_adamw, zero_grad(false)", 3, 1, false, true, false, false, 1},
                            {"HSDP 2x2", 4, 2, false, false, true, false, 1},
                            {"HSDP 2x2 sharded, zero_grad(false)", 4, 2, false, true, false, false, 1},
                            {"DDP path N2", 2, 1, true, false, true, false, 1},
                            {"discarded inside NoSync, then NoSync accumulation", 2, 1, false, false, true, true, 2},
                            {"discarded inside NoSync, zero_grad(false)", 3, 1, false, true, false, true, 1}},
                           /*module_zero_grad=*/false);
}

// The same with the model's zero_grad (LibTorch's Module::zero_grad(true): a GAN loop clears the discriminator
// after the generator's backward went through it, as LibTorch's DCGAN example does) instead of the optimizer's:
// every p.grad the earlier backward left is gone, so what dmuon holds outside p.grad (the owners' reduced sums,
// replicated parameters' buckets) is dropped too -- the step was 1e-2 off torch's, silently. (The signal is the
// gradients dmuon leaves in p.grad: a model whose every trainable parameter is dedicated or sharded_adamw
// leaves none, and needs the optimizer's zero_grad.)
TEST(RuntimeTest, TheModelsZeroGradDiscardsGradientsDmuonHolds) {
  check_discarded_backward({{"one rank", 1, 1, false, false, true, false, 1},
                            {"N2 Muon + replicated", 2, 1, false, false, true, false, 1},
                            {"N3 Muon + replicated", 3, 1, false, false, true, false, 1},
                            {"HSDP 2x2", 4, 2, false, false, true, false, 1},
                            {"DDP path N2", 2, 1, true, false, true, false, 1},
                            {"discarded inside NoSync", 2, 1, false, false, true, true, 1}},
                           /*module_zero_grad=*/true);
}

// zero_grad(false) and then a step in which a block runs under no_grad: torch steps that block's parameters
// with the zeros left in p.grad (AdamW's moments decay and it moves on; Muon's momentum carries the matrix
// on), and so does dmuon on every route -- also sharded_adamw, whose slices are never in p.grad.
TEST(RuntimeTest, ZeroGradFalseStepsParametersLeftWithoutAGradientAsTorchDoes) {
  struct Case {
    std::string label;
    int world, replicate;
    bool ddp, sharded;
  };
  const std::vector<Case> cases = {
      {"one rank", 1, 1, false, false},          {"N3 Muon + replicated", 3, 1, false, false},
      {"N3 sharded_adamw", 3, 1, false, true},    {"HSDP 2x2 sharded_adamw", 4, 2, false, true},
      {"DDP path N2", 2, 1, true, false},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    TrainConfig tc;
    tc.steps = 4;
    tc.frozen_on_odd_steps = 1;
    tc.zero_grad_to_none = false;
    check_equivalence(small_config(2), tc, unpacked_layout(c.world, c.replicate, c.ddp, c.sharded));
  }
}

// Without zero_grad between steps each step uses the sum of every gradient so far, as in torch, on
// any number of ranks: a matrix's owner keeps its averaged gradient in p.grad() after the step, and
// the next reduce must not average it over the ranks a second time (it would then depend on the
// world size: g0 / N + g1).
TEST(RuntimeTest, GradientsKeptAcrossStepsAccumulateAsInTorch) {
  struct Case {
    std::string label;
    int world, replicate;
    bool ddp, no_sync;
    int frozen_on_odd_steps;
  };
  // (block 1 frozen on odd steps: its owners get no new gradient there and step on the kept one)
  const std::vector<Case> cases = {
      {"one rank", 1, 1, false, false, 1},       {"N2", 2, 1, false, false, -1},
      {"N3, block 1 frozen on odd steps", 3, 1, false, false, 1},
      {"HSDP 2x2, block 1 frozen on odd steps", 4, 2, false, false, 1},
      {"DDP path N3", 3, 1, true, false, -1},    {"N2, NoSync accumulation", 2, 1, false, true, 1},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    TrainConfig tc;
    tc.steps = 4;
    tc.keep_grads = true;
    tc.frozen_on_odd_steps = c.frozen_on_odd_steps;
    tc.accum = c.no_sync ? 2 : 1;
    tc.no_sync = c.no_sync;
    check_equivalence(small_config(2), tc, unpacked_layout(c.world, c.replicate, c.ddp, false));
  }
}

// A backward that raises (a caught out-of-memory error) runs no end-of-backward callback: the engine
// drops it with its graph task. step() then refuses the incomplete gradients; zero_grad(), or else the
// next forward (with a warning), waits what it issued, drops it and the pass goes on. Training the batch
// again gives the reference's result, on every route and path.
TEST(RuntimeTest, ABackwardThatRaisesIsDroppedAndTrainingGoesOn) {
  struct Case {
    std::string label;
    int world, replicate;
    bool ddp, sharded, zero_grad, no_sync;
    bool to_none = true;
  };
  const std::vector<Case> cases = {
      {"one rank", 1, 1, false, false, true, false},
      {"N2, zero_grad(false)", 2, 1, false, false, true, false, false},
      {"N3 sharded_adamw, the next forward drops it", 3, 1, false, true, false, false},
      {"HSDP 2x2, zero_grad", 4, 2, false, false, true, false},
      {"DDP path N2, the next forward drops it", 2, 1, true, false, false, false},
      {"N2 NoSync accumulation, zero_grad", 2, 1, false, false, true, true},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    TrainConfig tc;
    tc.steps = 3;
    tc.raised_backward = true;
    tc.raised_backward_zero_grad = c.zero_grad;
    tc.zero_grad_to_none = c.to_none;
    tc.accum = c.no_sync ? 2 : 1;
    tc.no_sync = c.no_sync;
    check_equivalence(small_config(2), tc, unpacked_layout(c.world, c.replicate, c.ddp, c.sharded));
  }
}

// The replicated parameters' gradients are their averages over the ranks in p.grad when backward
// returns (as after torch's DDP), and what the loop does to them before step() is what step() uses:
// scaled in place, replaced, dropped on the last step -- also after clipping took the gradients.
TEST(RuntimeTest, ReplicatedGradientsAreAveragesInGradAfterBackwardAndEditsCount) {
  struct Case {
    std::string label;
    int world, replicate;
    bool ddp;
    double clip;
  };
  const std::vector<Case> cases = {
      {"one rank", 1, 1, false, 0},          {"N2", 2, 1, false, 0},
      {"N3, clipped first", 3, 1, false, 0.5}, {"HSDP 2x2", 4, 2, false, 0},
      {"DDP path N2, clipped first", 2, 1, true, 0.5},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    TrainConfig tc;
    tc.steps = 3;
    tc.clip = c.clip;
    tc.edit_grads = [last = static_cast<size_t>(tc.steps - 1)](size_t s,
                                                               const std::vector<std::pair<std::string, at::Tensor>>& ps) {
      for (const auto& [name, p] : ps) {
        if (name.rfind("layers.", 0) == 0 && name.find("norm") == std::string::npos) continue;  // a Muon matrix
        at::Tensor param = p;
        if (!param.grad().defined()) throw std::runtime_error(name + " has no gradient after backward");
        if (name.find("norm") != std::string::npos)
          param.mutable_grad().mul_(0.5);
        else
          param.mutable_grad() = param.grad() * 2.0;
        if (s == last && name == "final_norm.weight") param.mutable_grad() = at::Tensor();
      }
    };
    check_equivalence(small_config(2), tc, unpacked_layout(c.world, c.replicate, c.ddp, false));
  }
}

// step() after backward passes run only inside NoSync (the synced last micro-batch forgotten, or step() inside
// the scope): the gradients were never reduced, so each replica would step with its own and the ranks drift
// apart. Refused on every rank before any collective; zero_grad() drops them and training goes on. A checkpoint
// taken in the middle of the accumulation is no update: it works.
TEST(RuntimeTest, AStepOnGradientsNoRankReducedIsRefused) {
  testing::run_ranks(2, [](testing::RankContext& ctx) {
    const GPTConfig cfg = small_config(2);
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    testing::dedicate_gpt(m, mesh, DistConfig{});
    Muon opt(m.ptr(), testing::muon_options(TrainConfig{}));
    const auto batch = make_batches(1, 4, 8, cfg.vocab_size, 5)[0].narrow(0, ctx.rank * 2, 2);
    std::map<std::string, at::Tensor> before;
    for (const auto& item : m->named_parameters()) before[item.key()] = item.value().detach().clone();
    for (bool inside : {false, true}) {  // after the scope, and inside it
      std::optional<NoSync> ns(std::in_place, *m);
      m->loss(batch).backward();
      if (!inside) ns.reset();
      testing::expect(get_model_state_dict(*m, StateDictOptions{}).size() == before.size() || ctx.rank != 0,
                      "a state dict in the middle of the accumulation");
      for (const auto& [fn, call] : std::vector<std::pair<std::string, std::function<void()>>>{
               {"step", [&] { opt.step(); }}, {"clip_grad_norm_", [&] { opt.clip_grad_norm_(1.0); }}}) {
        const std::string err = error_of(call);
        testing::expect(err.find("rank " + std::to_string(ctx.rank) + ": " + fn + ": the last backward through this "
                                 "dmuon model ran inside no_sync") != std::string::npos &&
                            err.find("across the 2 data-parallel ranks") != std::string::npos,
                        "unexpected: " + err);
      }
      ns.reset();
      opt.zero_grad();
    }
    for (const auto& item : m->named_parameters())
      testing::expect(item.value().detach().equal(before.at(item.key())), item.key() + " changed");
    // the accumulation done right: the synced last backward reduces it all
    {
      NoSync ns(*m);
      m->loss(batch).backward();
    }
    m->loss(batch).backward();
    opt.step();
  });
}

// zero_grad(false) leaves zeros where gradients were (as LibTorch does), zero_grad() leaves none.
TEST(RuntimeTest, ZeroGradFalseLeavesZeros) {
  testing::run_ranks(2, [](testing::RankContext& ctx) {
    const GPTConfig cfg = small_config(2);
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    DistConfig dc;
    testing::dedicate_gpt(m, mesh, dc);
    Muon opt(m.ptr(), testing::muon_options(TrainConfig{}));
    const auto batch = make_batches(1, 4, 8, cfg.vocab_size, 5)[0];
    for (bool to_none : {false, true}) {
      m->loss(batch).backward();
      opt.step();
      int defined = 0;
      for (const auto& p : m->parameters()) defined += p.grad().defined() ? 1 : 0;
      testing::expect(defined > 0, "gradients after step");
      opt.zero_grad(to_none);
      for (const auto& item : m->named_parameters()) {
        const at::Tensor& g = item.value().grad();
        if (to_none)
          testing::expect(!g.defined(), item.key() + ": zero_grad() leaves no gradient");
        else
          testing::expect(!g.defined() || g.abs().max().item<double>() == 0, item.key() + ": zero_grad(false) zeros");
        if (!to_none && g.defined()) --defined;
      }
      if (!to_none) testing::expect(defined == 0, "zero_grad(false) keeps every gradient defined, as zeros");
    }
  });
}

// A parameter whose data were replaced after dedicate_params (torch::load into the model sets each tensor's storage,
// p.set_data, model->to(dtype)) would be used on its own rank only (the owner updates and sends dmuon's buffer):
// the next forward refuses it on every rank, naming the parameter and the way to load values; nothing trained
// in silence with ranks apart. The layouts whose parameters dmuon re-points: Z3, Z2, sharded_adamw, the DDP path.
TEST(RuntimeTest, AParameterReplacedAfterDedicateIsAnErrorAtTheNextForward) {
  struct Case {
    std::string label;
    DistConfig dc;
    std::string param;  // what is replaced
    std::string how;    // "set_", "set_data", "to"
  };
  std::vector<Case> cases;
  auto layout = [](bool z3, bool ddp, bool sharded) {
    DistConfig dc;
    dc.z3 = z3;
    dc.ddp = ddp;
    dc.sharded = sharded;
    return dc;
  };
  cases.push_back({"Z3, torch::load's set_", layout(true, false, false), "layers.0.q_proj.weight", "set_"});
  cases.push_back({"Z2, set_data", layout(false, false, false), "layers.1.gate_proj.weight", "set_data"});
  cases.push_back({"DDP path, set_", layout(false, true, false), "layers.0.down_proj.weight", "set_"});
  cases.push_back({"sharded_adamw, set_data", layout(true, false, true), "layers.0.attn_norm.weight", "set_data"});
  cases.push_back({"Z3, model->to(kFloat64)", layout(true, false, false), "", "to"});
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      const GPTConfig cfg = small_config(2);
      GPT m(cfg);
      auto mesh = make_mesh(ctx);
      testing::dedicate_gpt(m, mesh, c.dc);
      Muon opt(m.ptr(), testing::muon_options(TrainConfig{}));
      const auto batch = make_batches(1, 4, 8, cfg.vocab_size, 5)[0];
      m->loss(batch).backward();
      opt.step();
      opt.zero_grad();
      {
        at::NoGradGuard ng;
        if (c.how == "to") {
          m->to(at::kDouble);
        } else {  // a full value, as a load brings it (also where this rank holds a 0-element placeholder)
          at::Tensor p = m->named_parameters()[c.param];
          const at::Tensor value = GPT(cfg)->named_parameters()[c.param].detach().clone();
          if (c.how == "set_") p.set_(value);
          else p.set_data(value);
        }
      }
      const std::string err = error_of([&] { m->loss(batch).backward(); });
      for (const std::string& said : {"rank " + std::to_string(ctx.rank) + ": the forward of boundary",
                                      std::string("no longer holds the data dmuon gave it"),
                                      std::string("set_model_state_dict")})
        if (err.find(said) == std::string::npos) throw std::runtime_error("unexpected message: " + err);
      if (err.find("has not run through dmuon::forward") != std::string::npos)
        throw std::runtime_error("the boundary hint is not about this error: " + err);
      if (c.how != "to" && err.find("parameter '" + c.param + "'") == std::string::npos)
        throw std::runtime_error("the replaced parameter is not named: " + err);
      // a state dict is refused too, before anything is sent (the replacement's bytes would reach the other
      // ranks' buffers of dmuon's dtype: garbage there, without an error)
      const std::string ck = error_of([&] { get_model_state_dict(*m.ptr()); });
      if (ck.find("rank " + std::to_string(ctx.rank) + ": get_model_state_dict: parameter '") == std::string::npos ||
          ck.find("no longer holds the data dmuon gave it") == std::string::npos)
        throw std::runtime_error("the state dict was not refused: " + ck);
    });
  }
}

// Muon on several ranks needs every trainable parameter routed: without replicate() each rank
// would update its base parameters with its own local gradient. Frozen parameters need nothing.
TEST(RuntimeTest, MuonWithoutReplicateOnSeveralRanksIsAnError) {
  testing::run_ranks(2, [](testing::RankContext& ctx) {
    GPT m(small_config(2));
    auto mesh = make_mesh(ctx);
    dedicate_params(m.ptr(), mesh, models::is_muon_matrix);
    const std::string err = error_of([&] { Muon opt(m.ptr(), testing::muon_options(TrainConfig{})); });
    for (const char* want : {"no distributed route", "'tok_emb.weight'", "dmuon::replicate(model, mesh)", "rank "})
      testing::expect(err.find(want) != std::string::npos, "message lacks '" + std::string(want) + "': " + err);
    // every base parameter frozen: nothing to replicate, Muon constructs
    GPT f(small_config(2));
    for (auto& item : f->named_parameters())
      if (!models::is_muon_matrix(item.key(), item.value())) item.value().set_requires_grad(false);
    dedicate_params(f.ptr(), mesh, models::is_muon_matrix);
    Muon ok(f.ptr(), testing::muon_options(TrainConfig{}));
  });
  // one rank: single-process training needs no replicate()
  testing::run_ranks(1, [](testing::RankContext& ctx) {
    GPT m(small_config(2));
    dedicate_params(m.ptr(), make_mesh(ctx), models::is_muon_matrix);
    Muon ok(m.ptr(), testing::muon_options(TrainConfig{}));
  });
}

// ParamPolicy::grad_dtype: float64 matrices reduced in fp32. The reduce carries 4-byte elements
// (measured), and the trained weights show fp32 gradient rounding (more than float64 noise) while
// staying close to the float64 run.
TEST(RuntimeTest, GradDtypeSetsTheReducePayload) {
  TrainConfig tc;
  tc.steps = 3;
  const GPTConfig cfg = small_config(2);
  const StateDict init = init_state(cfg, 1234);
  const auto batches = make_batches(tc.steps, 8, 12, cfg.vocab_size, 99);
  const RefResult ref = reference_train(cfg, init, batches, tc);
  // two ranks reduce in fp32; one rank reduces nothing and still rounds its gradients as the reduce would
  for (const int world : {2, 1}) {
    std::mutex mu;
    double worst = 0;
    testing::run_ranks(world, [&](testing::RankContext& ctx) {
      GPT m(cfg);
      load_state(m, init);
      auto mesh = make_mesh(ctx);
      DedicateOptions o;
      ParamPolicy fp32_grads;
      fp32_grads.grad_dtype = at::kFloat;
      o.param_policy.push_back({"layers.", fp32_grads});
      DistConfig dc;
      dc.pack_small_params = false;
      testing::dedicate_gpt(m, mesh, dc, o);
      Muon opt(m.ptr(), testing::muon_options(tc));
      for (const auto& tokens : batches) {
        opt.zero_grad();
        mesh->counters().reset();
        const int64_t per = 8 / world;
        m->loss(tokens.narrow(0, ctx.rank * per, per)).backward();
        opt.step();
        int64_t want = 0;  // every matrix this rank does not own, and its has-gradient flag, in fp32
        for (const auto& d : get_dedicated_params(*m))
          if (!d.is_owner) want += 4 * (d.shape[0] * d.shape[1] + 1);
        const int64_t got = mesh->counters().bytes(CommOp::Reduce);
        testing::expect(got == want, "reduce bytes " + std::to_string(got) + " != " + std::to_string(want));
      }
      for (const auto& d : get_dedicated_params(*m)) {
        if (!d.is_owner) continue;
        testing::expect(d.param.scalar_type() == at::kDouble, d.name + " stays float64");
        const double e = max_rel(d.param, ref.params.at(d.name));
        std::lock_guard<std::mutex> g(mu);
        worst = std::max(worst, e);
      }
    });
    std::fprintf(stderr, "[grad_dtype] N=%d, fp32 reduce of float64 matrices: worst relative difference %.2e\n", world,
                 worst);
    // fp32 rounding of the gradient (2^-24 relative) amplified by NS: measured 1.6e-7 (N=2)
    EXPECT_GT(worst, 1e-12) << "N=" << world << ": the reduce did not run in fp32";
    EXPECT_LT(worst, 1e-4) << "N=" << world;
  }
}

// get_owned_params: each rank's owned matrices, by 1-D shard or by (shard, replicate) coordinate;
// the owners partition the matrices.
TEST(RuntimeTest, GetOwnedParamsPartitionsTheMatrices) {
  for (const int replicate : {1, 2}) {
    std::mutex mu;
    std::map<std::string, int> owners;
    testing::run_ranks(4, [&](testing::RankContext& ctx) {
      GPT m(small_config(2));
      auto mesh = make_mesh(ctx, std::chrono::seconds(60), replicate);
      DistConfig dc;
      dc.world = 4;
      dc.replicate = replicate;
      dc.pack_small_params = false;
      testing::dedicate_gpt(m, mesh, dc);
      const OwnerCoord me{mesh->shard_rank(), mesh->replicate_rank()};
      const auto mine = get_owned_params(*m, me);
      std::set<std::string> expected;
      for (const auto& d : get_dedicated_params(*m))
        if (d.is_owner) expected.insert(d.name);
      std::set<std::string> got;
      for (const auto& d : mine) {
        testing::expect(d.is_owner && d.owner.shard == me.shard && d.owner.replicate == me.replicate,
                        d.name + " is not owned by this rank");
        got.insert(d.name);
      }
      testing::expect(got == expected, "get_owned_params(coord) differs from the is_owner flags");
      if (replicate == 1) {
        std::set<std::string> by_shard;
        for (const auto& d : get_owned_params(*m, mesh->shard_rank())) by_shard.insert(d.name);
        testing::expect(by_shard == expected, "get_owned_params(shard) differs from the is_owner flags");
      }
      std::lock_guard<std::mutex> g(mu);
      for (const auto& n : got) owners[n]++;
    });
    EXPECT_EQ(owners.size(), 14u);
    for (const auto& [n, c] : owners) EXPECT_EQ(c, 1) << n << " has " << c << " owners";
  }
}

// No host synchronisation per parameter: backward and step() read device values on the host a
// fixed number of times per step (all has-gradient flags in one read, the finiteness of all owned
// Muon gradients in one read), however many parameters the model has, on every route and mesh.
TEST(RuntimeTest, HostReadsPerStepDoNotGrowWithTheParameterCount) {
  struct Case {
    std::string label;
    int world, replicate;
    bool sharded, ddp;
  };
  for (const Case& c : {Case{"N2", 2, 1, false, false}, Case{"N2 sharded", 2, 1, true, false},
                        Case{"HSDP 2x2", 4, 2, false, false}, Case{"DDP path", 2, 1, false, true}}) {
    std::map<int, std::vector<int64_t>> reads;  // layers -> per rank
    std::mutex mu;
    for (const int layers : {1, 4}) {
      testing::run_ranks(c.world, [&](testing::RankContext& ctx) {
        const GPTConfig cfg = small_config(layers);
        GPT m(cfg);
        auto mesh = make_mesh(ctx, std::chrono::seconds(60), c.replicate);
        DistConfig dc;
        dc.world = c.world;
        dc.replicate = c.replicate;
        dc.sharded = c.sharded;
        dc.ddp = c.ddp;
        testing::dedicate_gpt(m, mesh, dc);
        MuonOptions mo = testing::muon_options(TrainConfig{});
        mo.group_prepare_ahead = false;  // HSDP: two reads per group with it (checked below)
        Muon opt(m.ptr(), mo);
        const auto batches = make_batches(3, 8, 8, cfg.vocab_size, 3);
        int64_t most = 0;
        for (const auto& tokens : batches) {
          const int64_t before = host_sync_count();
          opt.zero_grad();
          m->loss(tokens.narrow(0, ctx.rank * (8 / c.world), 8 / c.world)).backward();
          opt.step();
          most = std::max(most, host_sync_count() - before);
        }
        std::lock_guard<std::mutex> g(mu);
        reads[layers].push_back(most);
      });
    }
    for (const int layers : {1, 4})
      for (const int64_t n : reads[layers]) EXPECT_LE(n, 2) << c.label << ", " << layers << " layer(s)";
    EXPECT_EQ(*std::max_element(reads[1].begin(), reads[1].end()), *std::max_element(reads[4].begin(), reads[4].end()))
        << c.label << ": host reads grow with the number of parameters";
  }
}

// NaN or Inf in a gradient (NaN; +Inf; -Inf; +Inf and -Inf together, whose sum is NaN): the matrix is not
// updated (weights, momentum), and step() raises on every rank naming it -- not on its owner alone, which would
// leave the others in the next forward's broadcast until the timeout. The next step trains on.
TEST(RuntimeTest, NonFiniteMuonGradientIsAnErrorOnEveryRankNamingTheMatrix) {
  const double inf = std::numeric_limits<double>::infinity();
  // foreach: the check by one _foreach_norm per dtype (the CUDA default) instead of a sum per gradient
  for (bool foreach : {false, true})
  for (const std::pair<double, double>& poison :
       std::vector<std::pair<double, double>>{{std::nan(""), 0.0}, {inf, 0.0}, {-inf, 0.0}, {inf, -inf}}) {
    SCOPED_TRACE(foreach ? "foreach" : "per-gradient sums");
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      const GPTConfig cfg = small_config(1);
      GPT m(cfg);
      auto mesh = make_mesh(ctx);
      DistConfig dc;
      dc.pack_small_params = false;
      testing::dedicate_gpt(m, mesh, dc);
      MuonOptions mo = testing::muon_options(TrainConfig{});
      mo.foreach = foreach;
      Muon opt(m.ptr(), mo);
      const auto batches = make_batches(2, 4, 8, cfg.vocab_size, 3);
      const std::string bad = "layers.0.k_proj.weight";
      auto train = [&](int i, bool poisoned) {
        m->loss(batches[static_cast<size_t>(i)].narrow(0, ctx.rank * 2, 2)).backward();
        prepare_muon_grads(*m);
        std::map<std::string, at::Tensor> before;
        for (const auto& d : get_dedicated_params(*m))
          if (d.is_owner) {
            before[d.name] = d.param.detach().clone();
            if (poisoned && d.name == bad) {
              d.param.grad()[0][0] = poison.first;
              if (poison.second != 0) d.param.grad()[1][1] = poison.second;
            }
          }
        std::string err = error_of([&] {
          try {
            opt.step();
          } catch (const NonFiniteGradientError&) {  // the verdict's own type (Python: NonFiniteGradientError)
            throw;
          } catch (const std::exception& e) {
            throw std::runtime_error(std::string("not a NonFiniteGradientError: ") + e.what());
          }
        });
        opt.zero_grad();
        return std::make_pair(err, before);
      };
      // a first clean step: the poisoned matrix has momentum, which must stay as it is
      const auto [clean, start] = train(0, false);
      testing::expect(clean.empty(), "a clean step failed: " + clean);
      std::map<std::string, at::Tensor> momentum;
      for (const auto& d : get_dedicated_params(*m))
        if (d.is_owner) momentum[d.name] = opt.state_of(d.param)->momentum_buffer().clone();
      const auto [err, before] = train(1, true);
      const bool owns_bad = before.count(bad) > 0;
      const std::string want = owns_bad ? "rank " + std::to_string(ctx.rank) + ": Muon::step: the averaged gradient of '" + bad + "'"
                                        : "rank " + std::to_string(ctx.rank) + ": Muon::step: a Muon gradient is not finite on rank(s) " +
                                              std::to_string(1 - ctx.rank) + ": rank " + std::to_string(1 - ctx.rank) +
                                              ": Muon::step: the averaged gradient of '" + bad + "'";
      testing::expect(err.find(want) != std::string::npos && err.find("NaN or Inf") != std::string::npos &&
                          err.find("No rank updated it") != std::string::npos,
                      "rank " + std::to_string(ctx.rank) + ": unexpected message: " + err);
      for (const auto& d : get_dedicated_params(*m))
        if (d.is_owner) {
          const bool same = d.param.equal(before.at(d.name));
          testing::expect(same == (d.name == bad), d.name + (same ? " was not updated" : " changed"));
          const at::Tensor& buf = opt.state_of(d.param)->momentum_buffer();
          testing::expect(buf.equal(momentum.at(d.name)) == (d.name == bad), d.name + ": momentum");
        }
      // the replicas agree, and the next step trains every matrix again
      const auto [next, unused] = train(0, false);
      testing::expect(next.empty(), "the step after the error failed: " + next);
      for (const auto& d : get_dedicated_params(*m))
        if (d.is_owner && d.name == bad) testing::expect(!d.param.equal(before.at(bad)), "not updated after the error");
    });
  }
}

TEST(RuntimeTest, EquivalenceWithLrSchedulerAndPackedUnits) {
  TrainConfig tc;
  tc.scheduler = true;
  DistConfig dc;
  dc.world = 2;
  check_equivalence(small_config(), tc, dc);  // packed: one unit per layer
}

// `accum` micro-batches per step (inside NoSync when `no_sync`) on `world` ranks against the
// reference's one big batch, Z3 and Z2, a layer's matrices spread over the ranks.
void check_accumulation(int world, int accum, bool no_sync, int64_t global_batch = 12) {
  for (bool z3 : {true, false}) {
    TrainConfig tc;
    tc.steps = 4;
    tc.accum = accum;
    tc.no_sync = no_sync;
    DistConfig dc;
    dc.world = world;
    dc.z3 = z3;
    dc.pack_small_params = false;
    check_equivalence(small_config(2), tc, dc, global_batch);
  }
}

TEST(RuntimeTest, GradientAccumulationEqualsOneBigBatch) {
  for (int accum : {2, 3}) check_accumulation(2, accum, /*no_sync=*/false);
}

// One data-parallel rank folds its gradients straight into the accumulators (no payload, no
// collective): accumulation over three backward passes, with and without NoSync, Z2 and Z3, and the
// one-rank DDP path match the single-process reference in float64.
TEST(RuntimeTest, OneRankAccumulatesWithoutAPayload) {
  for (bool no_sync : {false, true}) check_accumulation(1, 3, no_sync);  // (a boundary's matrices in one buffer)
  TrainConfig tc;
  tc.steps = 3;
  tc.accum = 2;
  DistConfig dc;
  dc.world = 1;
  dc.ddp = true;
  check_equivalence(small_config(2), tc, dc);
}

TEST(RuntimeTest, NoSyncAccumulationEqualsOneBigBatch) {
  for (int accum : {2, 4}) check_accumulation(3, accum, /*no_sync=*/true, /*global_batch=*/12);
}

TEST(RuntimeTest, NoSyncReducesOnceAndRejectsMisuse) {
  const GPTConfig cfg = small_config(2);
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(cfg);
    auto fail = [](const std::string& w) { throw std::runtime_error(w); };
    if (error_of([&] { NoSync ns(*m); }).find("not dedicated") == std::string::npos) fail("no_sync without dedicate");
    auto mesh = make_mesh(ctx);
    dedicate_params(m.ptr(), mesh, models::is_muon_matrix);
    if (replicate(m.ptr(), mesh).get() != m.ptr().get()) fail("replicate returns the model (chaining)");
    MuonOptions mo;
    mo.first_step_progress_log = false;
    Muon opt(m.ptr(), mo);
    mesh->counters().reset();
    for (int i = 0; i < 3; ++i) {
      std::optional<NoSync> ns, nested;  // a scope nested in another (torch's DDP allows it): still inside
      if (i < 2) ns.emplace(*m);
      if (i == 1) {
        nested.emplace(*m);
        nested.reset();
      }
      m->loss(at::randint(32, {2, 6}, at::kLong)).backward();
      if (i < 2 && (mesh->counters().calls(CommOp::Reduce) != 0 || mesh->counters().calls(CommOp::AllReduce) != 0))
        fail("a reduce happened inside no_sync");
    }
    opt.step();
    // one reduce per (boundary, owner) and one all-reduce bucket, once
    const int64_t buffers = static_cast<int64_t>(inspect::packed_units(*m).size());
    if (mesh->counters().calls(CommOp::Reduce) != buffers) fail("expected exactly one reduce per packed buffer");
    if (mesh->counters().calls(CommOp::AllReduce) != 1) fail("expected one replicated all-reduce");
  });
}

TEST(RuntimeTest, DdpPathMatchesSingleProcess) {
  for (int world : {2, 3}) {
    for (bool async : {true, false}) {
      TrainConfig tc;
      tc.steps = 6;
      DistConfig dc;
      dc.world = world;
      dc.ddp = true;
      dc.replicate_async = async;
      dc.pack_small_params = false;
      check_equivalence(small_config(2), tc, dc);
    }
  }
}

TEST(RuntimeTest, DdpPathKeepsFullParamsAndMovesTwoPayloads) {
  const GPTConfig cfg = small_config(2);
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    testing::Layout ddp;
    ddp.ddp = true;
    testing::dedicate_gpt(m, mesh, ddp);
    auto opt = counted_sync_step(m, *mesh);
    int64_t not_owned = 0, flags = 0;
    for (const auto& d : get_dedicated_params(*m)) {
      if (d.param.numel() != d.shape[0] * d.shape[1]) throw std::runtime_error("DDP path released " + d.name);
      if (!d.is_owner) {
        not_owned += 4 * d.shape[0] * d.shape[1];
        flags += 4;
      }
    }
    // reduce after backward + publish after step: 2(N-1)/N * P_M on average
    const int64_t bytes = mesh->counters().bytes(CommOp::Broadcast) + mesh->counters().bytes(CommOp::Reduce);
    if (bytes != 2 * not_owned + flags) throw std::runtime_error("DDP bytes " + std::to_string(bytes));
  });
}

TEST(RuntimeTest, DdpPathRejectsA2DMesh) {
  testing::run_ranks(4, [&](testing::RankContext& ctx) {
    GPT m(small_config(2));
    MeshOptions mo;
    mo.store = ctx.store;
    mo.factory = process_group_factory(c10::DeviceType::CPU);
    mo.replicate_size = 2;
    auto mesh = Mesh::create(ctx.pg, mo);
    const std::string err = error_of([&] { dedicate_params_ddp(m.ptr(), mesh, models::is_muon_matrix); });
    if (err.find("accepts a 1-D mesh only, got a 2 x 2") == std::string::npos)
      throw std::runtime_error("unexpected message: " + err);
  });
}

// ---- HSDP -------------------------------------------------------------------------------------------
struct HsdpCase {
  int replicate, shard;
};

TEST(RuntimeTest, HsdpMatchesSingleProcess) {
  for (const HsdpCase c : {HsdpCase{2, 2}, HsdpCase{2, 3}, HsdpCase{3, 2}}) {
    for (bool z3 : {true, false}) {
      for (bool async : {true, false}) {
        TrainConfig tc;
        tc.steps = 5;
        DistConfig dc;
        dc.world = c.replicate * c.shard;
        dc.replicate = c.replicate;
        dc.z3 = z3;
        dc.replicate_async = async;
        dc.pack_small_params = false;
        SCOPED_TRACE(std::to_string(c.replicate) + "x" + std::to_string(c.shard) + (z3 ? " Z3" : " Z2") +
                     (async ? " async" : " sync"));
        check_equivalence(small_config(2), tc, dc);
      }
    }
  }
}

TEST(RuntimeTest, HsdpWithAccumulationEagerStage2AndBuckets) {
  TrainConfig tc;
  tc.steps = 4;
  tc.accum = 2;
  DistConfig dc;
  dc.world = 4;
  dc.replicate = 2;
  dc.pack_small_params = false;
  check_equivalence(small_config(2), tc, dc, /*global_batch=*/16);  // accumulation across backward passes
  tc.no_sync = true;
  check_equivalence(small_config(2), tc, dc, 16);
  dc.delay_stage2 = false;  // stage 2 at the end of backward
  check_equivalence(small_config(2), tc, dc, 16);
  dc.bucket_mb = 0.001;  // publish in ~1 KiB chunks
  check_equivalence(small_config(2), tc, dc, 16);
}

// group_prepare_ahead (the default on HSDP) against the one-pass step, and prepare_muon_grads group by
// group against the coalesced wait: the same numbers; the per-group step reads the host twice per
// group at most (flags and finiteness), whatever the number of parameters in a group.
TEST(RuntimeTest, HsdpGroupPrepareAheadAndPerGroupPrepareMatchTheOnePassPath) {
  for (bool ahead : {true, false}) {
    for (bool async : {true, false}) {
      TrainConfig tc;
      tc.steps = 4;
      DistConfig dc;
      dc.world = 6;
      dc.replicate = 2;
      dc.group_prepare_ahead = ahead;
      dc.replicate_async = async;
      SCOPED_TRACE(std::string(ahead ? "ahead" : "one pass") + (async ? " async" : " sync"));
      check_equivalence(small_config(3), tc, dc);
    }
  }
  const GPTConfig cfg = small_config(3);
  testing::run_ranks(4, [&](testing::RankContext& ctx) {
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), /*replicate=*/2);
    const StateDict init = init_state(cfg, 7, at::kDouble);
    const at::Tensor tokens = make_batches(1, 8, 8, cfg.vocab_size, 5)[0].narrow(0, 2 * ctx.rank, 2);
    std::vector<std::map<std::string, at::Tensor>> grads;
    for (bool coalesce : {true, false}) {
      GPT m(cfg);
      load_state(m, init);
      testing::dedicate_gpt(m, mesh, {});
      m->loss(tokens).backward();
      prepare_muon_grads(*m, PrepareGradsOptions{coalesce});
      std::map<std::string, at::Tensor> g;
      for (const auto& d : get_dedicated_params(*m))
        if (d.is_owner) g[d.name] = d.param.grad().clone();
      grads.push_back(g);
      // the per-group step on HSDP: at most 1 + 2 * groups host reads
      Muon opt(m.ptr(), testing::muon_options(TrainConfig{}));
      opt.zero_grad();
      m->loss(tokens).backward();
      const int64_t before = host_sync_count();
      opt.step();
      const int64_t reads = host_sync_count() - before;
      testing::expect(reads <= 1 + 2 * cfg.n_layers, "host reads per step: " + std::to_string(reads));
    }
    testing::expect(grads[0].size() == grads[1].size(), "same owned matrices");
    for (const auto& [name, g] : grads[0])
      testing::expect(at::equal(g, grads[1].at(name)), name + ": per-group prepare differs from the coalesced one");
  });
}

// issue 37: group_prepare_ahead on every mesh where it pays (Runtime::step's rule): on a CPU mesh
// the 1-D step (Z2, Z3, all_gather mode) and the DDP path prepare group by group too, with the same
// numbers as the one-pass step; the host reads show which path ran (two per step for the one pass,
// up to two per group for the per-group one).
TEST(RuntimeTest, OneDAndDdpGroupPrepareAheadMatchTheOnePassPath) {
  TrainConfig tc;
  tc.steps = 3;
  for (const char* mode : {"z3", "z2", "all_gather", "ddp"})
    for (const bool ahead : {true, false}) {
      SCOPED_TRACE(std::string(mode) + (ahead ? " per group" : " one pass"));
      DistConfig dc;
      dc.world = 3;
      dc.z3 = std::string(mode) != "z2";
      dc.ddp = std::string(mode) == "ddp";
      if (std::string(mode) == "all_gather") dc.unshard = "all_gather";
      dc.group_prepare_ahead = ahead;
      check_equivalence(small_config(3), tc, dc);
    }
  const GPTConfig cfg = small_config(3);
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    auto mesh = make_mesh(ctx);
    const at::Tensor tokens = make_batches(1, 4, 8, cfg.vocab_size, 5)[0].narrow(0, 2 * ctx.rank, 2);
    std::map<bool, int64_t> reads;
    for (const bool ahead : {true, false}) {
      GPT m(cfg);
      load_state(m, init_state(cfg, 7, at::kDouble));
      testing::Layout l;
      l.pack_small_params = true;  // one packed unit per (boundary, owner): every rank owns in every group
      testing::dedicate_gpt(m, mesh, l);
      MuonOptions mo = testing::muon_options(TrainConfig{});
      mo.group_prepare_ahead = ahead;
      Muon opt(m.ptr(), mo);
      for (int step = 0; step < 2; ++step) {  // the second: the forward order is recorded
        opt.zero_grad();
        m->loss(tokens).backward();
        const int64_t before = host_sync_count();
        opt.step();
        reads[ahead] = host_sync_count() - before;
      }
    }
    const std::string r = "rank " + std::to_string(ctx.rank) + ": " + std::to_string(reads[true]) + " host reads per " +
                          "group, " + std::to_string(reads[false]) + " one pass";
    testing::expect(reads[false] <= 2, r + " (the one-pass step reads at most twice)");
    testing::expect(reads[true] >= cfg.n_layers && reads[true] <= 1 + 2 * cfg.n_layers,
                    r + " (the per-group step reads each group's flags, at most twice per group)");
  });
}

TEST(RuntimeTest, HsdpBytesPerAxisMatchThePlanAndStaleReadsEndAtTheWait) {
  const GPTConfig cfg = small_config(2);
  for (bool async : {true, false}) {
    testing::run_ranks(4, [&](testing::RankContext& ctx) {
      GPT m(cfg);
      auto mesh = make_mesh(ctx, std::chrono::seconds(60), /*replicate=*/2);
      testing::dedicate_gpt(m, mesh, {});
      MuonOptions mo;
      mo.first_step_progress_log = false;
      mo.replicate_async = async;
      Muon opt(m.ptr(), mo);
      auto fail = [&](const std::string& w) { throw std::runtime_error(w); };
      // warm-up step so that the forward order is recorded
      m->loss(at::randint(32, {2, 6}, at::kLong)).backward();
      opt.step();
      opt.zero_grad();
      mesh->replicate()->own_counters().reset();
      mesh->replicate_publish()->own_counters().reset();
      m->loss(at::randint(32, {2, 6}, at::kLong)).backward();
      mesh->shard().own_counters().reset();
      // backward issued stage 1 (not counted: the shard counters are reset after it) and stage 2
      // (counted); step adds the publish
      opt.step();
      // Documented: with the async publish (default) a holder in another replicate group may read
      // the previous value until its boundary's next forward or wait_all_replicate_broadcasts; with
      // replicate_async=false step() itself drains the publish, so no wait is needed.
      if (async) wait_all_replicate_broadcasts(*m);
      const ModelCommPlan plan = get_comm_plan(*m);
      int64_t flags = 0;
      for (const auto& d : get_dedicated_params(*m))
        if (d.owner.shard == mesh->shard_rank() && !d.is_owner) flags += 4;
      // the stage-2 reduces on the replicate group, the publish on its own twin (Mesh::create's)
      if (!mesh->has_replicate_publish_group()) fail("Mesh::create built no publish group");
      if (mesh->replicate()->own_counters().bytes(CommOp::Broadcast) != 0) fail("a publish ran on the replicate group");
      const int64_t rep_bytes =
          mesh->replicate()->own_counters().total_bytes() + mesh->replicate_publish()->own_counters().total_bytes();
      const int64_t planned = plan.comm.per_rank_replicate_bytes[static_cast<size_t>(ctx.rank)];
      if (rep_bytes - flags != planned)
        fail("replicate-axis bytes " + std::to_string(rep_bytes - flags) + " vs plan " + std::to_string(planned));
      // every holder now has the global owner's value: compare across the replicate group
      for (const auto& d : get_dedicated_params(*m)) {
        if (d.owner.shard != mesh->shard_rank()) {
          if (d.param.numel() != 0) fail("non-holder keeps " + d.name);
          continue;
        }
        at::Tensor v = d.param.detach().clone();
        at::Tensor ref = v.clone();
        mesh->replicate()->broadcast(ref, d.owner.replicate, "test compare").wait();
        if (!at::equal(v, ref)) fail("holder copy of " + d.name + " is stale after wait_all_replicate_broadcasts");
      }
      // one more forward + backward: the shard axis moves exactly the planned Z3 bytes
      opt.zero_grad();
      mesh->shard().own_counters().reset();
      m->loss(at::randint(32, {2, 6}, at::kLong)).backward();
      int64_t shard_flags = 0;
      for (const auto& d : get_dedicated_params(*m))
        if (d.owner.shard != mesh->shard_rank()) shard_flags += 4;
      const int64_t shard_bytes = mesh->shard().own_counters().bytes(CommOp::Broadcast) +
                                  mesh->shard().own_counters().bytes(CommOp::Reduce);
      const int64_t planned_z3 = plan.comm.per_rank_bytes_z3[static_cast<size_t>(ctx.rank)];
      if (shard_bytes - shard_flags != planned_z3)
        fail("shard-axis bytes " + std::to_string(shard_bytes - shard_flags) + " vs plan " +
             std::to_string(planned_z3));
      opt.step();
    });
  }
}

// issue 37: delay_stage2_to_optimizer as the API reference has it. Either way the stage-2
// (replicate-axis) reduces go out during backward, each boundary's as the next one's stage 1 is
// issued: when backward reaches the token embedding (after every block), some rank has issued some;
// at its end every holder has issued all of its units' (one per boundary and owner), and step()
// issues none. The training itself: check_equivalence in both modes, with and without the per-group step.
TEST(RuntimeTest, HsdpStage2ReducesGoOutDuringBackwardAndStepWaitsThem) {
  const GPTConfig cfg = small_config(3);
  for (const bool delay : {true, false}) {
    SCOPED_TRACE(delay ? "delay_stage2_to_optimizer" : "stage 2 waited in backward");
    std::atomic<int64_t> issued_before_the_embedding{0};
    testing::run_ranks(4, [&](testing::RankContext& ctx) {
      GPT m(cfg);
      auto mesh = make_mesh(ctx, std::chrono::seconds(60), /*replicate=*/2);
      testing::Layout l;
      l.world = 4;
      l.replicate = 2;
      DedicateOptions dopts;
      dopts.delay_stage2_to_optimizer = delay;
      testing::dedicate_gpt(m, mesh, l, dopts);
      MuonOptions mo;
      mo.first_step_progress_log = false;
      Muon opt(m.ptr(), mo);
      std::set<std::tuple<std::string, int, int>> held;  // this rank's stage-2 reduces: (boundary, owner)
      for (const auto& d : get_dedicated_params(*m))
        if (d.owner.shard == mesh->shard_rank()) held.insert({d.boundary, d.owner.shard, d.owner.replicate});
      CommCounters& rep = mesh->replicate()->own_counters();
      m->tok_emb->weight.register_hook([&](const at::Tensor&) { issued_before_the_embedding += rep.calls(CommOp::Reduce); });
      for (int step = 0; step < 2; ++step) {  // the first step records the forward order
        opt.zero_grad();
        rep.reset();
        m->loss(at::randint(32, {2, 6}, at::kLong)).backward();
        const int64_t after_backward = rep.calls(CommOp::Reduce);
        opt.step();
        testing::expect(after_backward == static_cast<int64_t>(held.size()),
               "rank " + std::to_string(ctx.rank) + " step " + std::to_string(step) + ": " +
                   std::to_string(after_backward) + " stage-2 reduces issued in backward, " +
                   std::to_string(held.size()) + " units held");
        testing::expect(rep.calls(CommOp::Reduce) == after_backward, "step() issued a stage-2 reduce");
      }
    });
    EXPECT_GT(issued_before_the_embedding.load(), 0) << "no stage-2 reduce before the end of backward";
  }
  TrainConfig tc;
  tc.steps = 3;
  DistConfig dc;
  dc.world = 4;
  dc.replicate = 2;
  for (const bool delay : {true, false})
    for (const bool ahead : {true, false}) {
      SCOPED_TRACE(std::string(delay ? "delayed" : "waited in backward") + (ahead ? ", per group" : ", one pass"));
      dc.delay_stage2 = delay;
      dc.group_prepare_ahead = ahead;
      check_equivalence(small_config(3), tc, dc);
    }
}

TEST(RuntimeTest, HsdpStrictPostStepFence) {
  // DMUON_ISOLATED_PG_BARRIER=1: each step() ends with one barrier on the shard group and one on the
  // replicate group (HSDP), one on the shard group (1-D, and the DDP path: its groups are dmuon's too);
  // none without it
  for (const int replicate : {2, 1, 0}) {  // (0: the DDP path)
    for (const bool fence : {true, false}) {
      if (fence) setenv("DMUON_ISOLATED_PG_BARRIER", "1", 1);
      testing::run_ranks(4, [&](testing::RankContext& ctx) {
        const GPTConfig cfg = small_config(2);
        GPT m(cfg);
        auto mesh = make_mesh(ctx, std::chrono::seconds(60), std::max(replicate, 1));
        DistConfig dc;
        dc.world = 4;
        dc.replicate = std::max(replicate, 1);
        dc.ddp = replicate == 0;
        testing::dedicate_gpt(m, mesh, dc);
        Muon opt(m.ptr(), testing::muon_options(TrainConfig{}));
        const auto batches = make_batches(2, 8, 8, cfg.vocab_size, 3);
        for (const auto& tokens : batches) {
          opt.zero_grad();
          m->loss(tokens.narrow(0, ctx.rank * 2, 2)).backward();
          const int64_t before = mesh->counters().calls(CommOp::Barrier);
          opt.step();
          const int64_t fences = mesh->counters().calls(CommOp::Barrier) - before;
          const int64_t want = fence ? (replicate > 1 ? 2 : 1) : 0;
          testing::expect(fences == want, "step() ran " + std::to_string(fences) + " barrier(s), expected " +
                                              std::to_string(want));
        }
      });
      unsetenv("DMUON_ISOLATED_PG_BARRIER");
    }
  }
  // and training with the fence still equals single-process training
  setenv("DMUON_ISOLATED_PG_BARRIER", "1", 1);
  TrainConfig tc;
  tc.steps = 3;
  DistConfig dc;
  dc.world = 4;
  dc.replicate = 2;
  check_equivalence(small_config(2), tc, dc);
  unsetenv("DMUON_ISOLATED_PG_BARRIER");
}

TEST(RuntimeTest, ShardedAdamwRouteMatchesSingleProcess) {
  for (int world : {2, 3, 4}) {
    for (bool z3 : {true, false}) {
      TrainConfig tc;
      tc.steps = 5;
      DistConfig dc;
      dc.world = world;
      dc.z3 = z3;
      dc.sharded = true;
      dc.pack_small_params = false;
      SCOPED_TRACE("N=" + std::to_string(world) + (z3 ? " Z3" : " Z2"));
      check_equivalence(small_config(2), tc, dc);
    }
  }
  TrainConfig tc;  // with accumulation, and on an HSDP mesh (sharded over G, replicated over R)
  tc.steps = 4;
  tc.accum = 2;
  DistConfig dc;
  dc.world = 4;
  dc.sharded = true;
  check_equivalence(small_config(2), tc, dc, 16);
  dc.replicate = 2;
  tc.accum = 1;
  check_equivalence(small_config(2), tc, dc);
}

// MuonOptions::fused / foreach (issue 37): AdamW by LibTorch's fused kernel and Muon's momentum,
// finiteness check and weight update by _foreach_ ops train as the single-process reference does (float64, the equivalence bound), on the
// replicated, sharded_adamw and HSDP routes, and the profile shows each rank ran them; both off, the
// per-parameter path does. Unset on the CPU: fused where LibTorch has the kernel, no foreach. (The
// fused kernel needs LibTorch >= 2.4 on the CPU: the 1.13 build checks foreach, and that fused=true
// is refused at construction.)
TEST(RuntimeTest, FusedAdamwAndForeachMomentumMatchSingleProcess) {
  const bool fused = detail::fused_adamw_available(c10::DeviceType::CPU);
  struct Case {
    const char* name;
    int world, replicate;
    bool sharded, multi_tensor;
  };
  for (const Case& c : {Case{"Z3_N3", 3, 1, false, true}, Case{"ShardedAdamw_N2", 2, 1, true, true},
                        Case{"Hsdp2x2ShardedAdamw", 4, 2, true, true}, Case{"ShardedAdamw_N2_PerParam", 2, 1, true, false}}) {
    SCOPED_TRACE(std::string(c.name) + (!c.multi_tensor ? " per-parameter" : fused ? " fused+foreach" : " foreach"));
    TrainConfig tc;
    tc.steps = 4;
    tc.scheduler = true;  // lr changes between steps reach the fused call
    DistConfig dc;
    dc.world = c.world;
    dc.replicate = c.replicate;
    dc.sharded = c.sharded;
    dc.pack_small_params = false;
    dc.fused = c.multi_tensor && fused;
    dc.foreach = c.multi_tensor;
    dc.expect_fused_min = c.multi_tensor && fused ? 1 : 0;  // every rank updates AdamW parameters (or shards)
    check_equivalence(small_config(2), tc, dc);
  }
  // what each setting runs on one rank: every matrix's momentum, every other parameter's AdamW
  testing::run_ranks(1, [&](testing::RankContext& ctx) {
    GPT m(small_config(2));
    load_state(m, init_state(small_config(2), 1234, at::kDouble));
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), 1);
    DistConfig dc;
    dc.world = 1;
    testing::dedicate_gpt(m, mesh, dc, DedicateOptions{});
    const int matrices = static_cast<int>(get_dedicated_params(*m).size());
    const int others = static_cast<int>(get_base_params(*m).size());
    ASSERT_GT(matrices, 0);
    ASSERT_GT(others, 0);
    for (std::optional<bool> setting : {std::optional<bool>(), std::optional<bool>(true), std::optional<bool>(false)}) {
      SCOPED_TRACE(setting ? (*setting ? "on" : "off") : "unset");
      MuonOptions mo = testing::muon_options(TrainConfig{});
      mo.record_step_profile = true;
      mo.foreach = setting;
      mo.fused = setting && *setting && !fused ? std::nullopt : setting;
      Muon opt(m.ptr(), mo);
      opt.zero_grad();
      m->loss(make_batches(1, 2, 12, small_config(2).vocab_size, 7)[0]).backward();
      opt.step();
      const StepProfile p = opt.consume_last_step_profile();
      EXPECT_EQ(p.momentum_foreach, setting.value_or(false) ? matrices : 0);
      EXPECT_EQ(p.update_foreach, setting.value_or(false) ? matrices : 0);
      EXPECT_EQ(p.adamw_fused, setting.value_or(true) && fused ? others : 0);
      EXPECT_EQ(to_json(p)["adamw_fused"].get<int>(), p.adamw_fused);
    }
    if (!fused) {
      MuonOptions mo;
      mo.fused = true;
      const std::string e = error_of([&] { Muon opt(m.ptr(), mo); });
      EXPECT_NE(e.find("fused=true, but this LibTorch"), std::string::npos) << e;
      EXPECT_NE(e.find("rank 0"), std::string::npos) << e;
    }
  });
}

TEST(RuntimeTest, AllGatherUnshardModeMatchesSingleProcess) {
  for (int world : {2, 3, 4}) {
    for (bool z3 : {true, false}) {
      TrainConfig tc;
      tc.steps = 5;
      DistConfig dc;
      dc.world = world;
      dc.z3 = z3;
      dc.unshard = "all_gather";
      dc.pack_small_params = world != 3;  // packed units and single matrices, sizes not divisible by N
      SCOPED_TRACE("N=" + std::to_string(world) + (z3 ? " Z3" : " Z2"));
      check_equivalence(small_config(2), tc, dc);
    }
  }
}

TEST(RuntimeTest, AllGatherUnshardModeOnHsdpAndTheDdpPathMatchesSingleProcess) {
  struct Case {
    const char* label;
    int world, replicate;
    bool z3, ddp, async;
  };
  for (const Case& c : {Case{"HSDP 2x2 Z3", 4, 2, true, false, true}, Case{"HSDP 2x2 Z2 sync", 4, 2, false, false, false},
                        Case{"HSDP 3x2 Z3", 6, 2, true, false, true}, Case{"DDP N3", 3, 1, true, true, true},
                        Case{"DDP N2 sync", 2, 1, true, true, false}}) {
    TrainConfig tc;
    tc.steps = 4;
    DistConfig dc;
    dc.world = c.world;
    dc.replicate = c.replicate;
    dc.z3 = c.z3;
    dc.ddp = c.ddp;
    dc.replicate_async = c.async;
    dc.unshard = "all_gather";
    dc.pack_small_params = c.world != 6;  // packed units and single matrices, sizes not divisible by G
    SCOPED_TRACE(c.label);
    check_equivalence(small_config(2), tc, dc);
  }
}

TEST(RuntimeTest, AllGatherModeKeepsShardsAndCountsItsBytes) {
  const GPTConfig cfg = small_config(2);
  for (const testing::Layout& l : {testing::Layout{"N3", 3}, testing::Layout{"HSDP 2x2", 4, 2},
                                   testing::Layout{"DDP N3", 3, 1, true, true}}) {
    SCOPED_TRACE(l.label);
    testing::run_ranks(l.world, [&](testing::RankContext& ctx) {
      GPT m(cfg);
      auto mesh = make_mesh(ctx, std::chrono::seconds(60), l.replicate);
      testing::Layout gather_mode = l;
      gather_mode.unshard = "all_gather";
      testing::dedicate_gpt(m, mesh, gather_mode);
      auto opt = counted_sync_step(m, *mesh);
      // per step and rank, per packed unit of S = G*L padded bytes (B = its unpadded bytes, F = its
      // has-grad flags):
      //  * forward unshard (not on the DDP path): all-gather (G-1)/G*S, twice in Z3
      //  * gradient reduce to the holder: B + F from each non-holder; HSDP stage 2 from the holders of
      //    the other replicate groups
      //  * publish: the owner's group scatters S/G into each non-holder; HSDP: each shard crosses the
      //    replicate axis (S/G into every rank of the other groups); DDP: then all-gather (G-1)/G*S
      //  * the step's non-finite verdict: an all-gather of a row (kStepVerdictRowBytes) from every other rank of the world
      const int64_t G = mesh->shard_size();
      int64_t gather = kStepVerdictRowBytes * (mesh->world_size() - 1), reduce = 0, scatter = 0, bcast = 0;
      for (const auto& buf : inspect::packed_units(*m)) {
        const auto& d = get_dedicated_params(*m);
        const auto it = std::find_if(d.begin(), d.end(), [&](const DedicatedParam& p) { return p.name == buf.params[0]; });
        const bool owner_row = it->owner.replicate == mesh->replicate_rank();
        const int64_t S = buf.flat.numel() * 4, B = buf.numel * 4, F = 4 * static_cast<int64_t>(buf.params.size());
        gather += (l.ddp ? 1 : 2) * (G - 1) * S / G;
        if (!buf.holder) reduce += B + F;
        if (buf.holder && !owner_row) reduce += B + F;
        if (owner_row && !buf.holder) scatter += S / G;
        if (!owner_row) bcast += S / G;
        if (buf.shard.numel() != buf.shard_len || buf.shard_len != (buf.numel + G - 1) / G)
          throw std::runtime_error("shard of " + buf.boundary);
        if (!l.ddp && !buf.holder && buf.flat.storage().nbytes() != 0)
          throw std::runtime_error("not released: " + buf.boundary);
      }
      auto& c = mesh->counters();
      if (c.bytes(CommOp::AllGather) != gather || c.bytes(CommOp::Reduce) != reduce ||
          c.bytes(CommOp::Scatter) != scatter || c.bytes(CommOp::Broadcast) != bcast)
        throw std::runtime_error("all_gather-mode bytes: gather " + std::to_string(c.bytes(CommOp::AllGather)) + "/" +
                                 std::to_string(gather) + " reduce " + std::to_string(c.bytes(CommOp::Reduce)) + "/" +
                                 std::to_string(reduce) + " scatter " + std::to_string(c.bytes(CommOp::Scatter)) + "/" +
                                 std::to_string(scatter) + " broadcast " + std::to_string(c.bytes(CommOp::Broadcast)) +
                                 "/" + std::to_string(bcast));
    });
  }
}

TEST(RuntimeTest, ForwardUnshardProfileCountsEveryBoundarysUnshardsBytesAndWaits) {
  const GPTConfig cfg = small_config(3);
  using testing::expect;
  testing::run_ranks(3, [&](testing::RankContext& ctx) {
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    DedicateOptions o;
    o.record_forward_profile = true;
    testing::dedicate_gpt(m, mesh, testing::Layout{}, o);
    auto opt = counted_sync_step(m, *mesh);  // one Z3 forward + backward + step (1-D: no publish)
    const int64_t measured = mesh->counters().bytes(CommOp::Broadcast);
    const ForwardUnshardProfile p = collect_forward_unshard_profile(*m, /*clear=*/true, /*synchronize=*/true);
    expect(p.enabled && p.rank == ctx.rank && p.forward_passes == 1 && p.boundaries.size() == 3, "profile header");
    int64_t expect_bytes = 0;
    for (const auto& u : inspect::packed_units(*m))
      if (!u.holder) expect_bytes += 2 * u.numel * 4;  // forward and backward broadcast, fp32
    expect(p.total_bytes() == measured && measured == expect_bytes,
           "profiled " + std::to_string(p.total_bytes()) + " vs measured " + std::to_string(measured) + " vs " +
               std::to_string(expect_bytes));
    for (size_t b = 0; b < p.boundaries.size(); ++b) {
      const BoundaryUnshardStats& s = p.boundaries[b];
      expect(s.boundary == "layers." + std::to_string(b), "boundary name " + s.boundary);
      // each boundary once per pass; layers.1 and .2 arrive by the forward prefetch (depth 1), layers.1
      // and .0 by the backward one
      expect(s.forward_unshards == 1 && s.backward_unshards == 1, s.boundary + " unshards");
      expect(s.forward_prefetched == (b > 0 ? 1 : 0), s.boundary + " prefetched");
      expect(s.forward_waits == 1 && s.backward_waits == 1 && s.forward_wait_ms >= 0, s.boundary + " waits");
      expect(!p.device_timed && s.forward_device_wait_ms == 0 && s.backward_device_wait_ms == 0,
             s.boundary + ": no device timing on the CPU");
      expect(s.forward_bytes == s.backward_bytes, s.boundary + " Z3: the same bytes twice");
    }
    const nlohmann::json j = to_json(p);
    expect(j["total_bytes"] == measured && j["boundaries"].size() == 3 && j["boundaries"][1]["forward_prefetched"] == 1,
           "JSON " + j.dump());
    // cleared: nothing until the next pass; the recorded order can be forgotten and is re-recorded
    const ForwardUnshardProfile empty = consume_forward_unshard_profile(*m);
    expect(empty.total_bytes() == 0 && empty.forward_passes == 0 && empty.boundaries[1].forward_unshards == 0, "cleared");
    reset_post_forward_order(*m);
    m->loss(at::randint(32, {2, 6}, at::kLong)).backward();
    opt->step();
    const ForwardUnshardProfile again = consume_forward_unshard_profile(*m);
    expect(again.forward_passes == 1 && again.boundaries[2].forward_prefetched == 1 && again.total_bytes() == expect_bytes,
           "after reset_post_forward_order");
    // off by default: no counters
    GPT m2(cfg);
    testing::dedicate_gpt(m2, mesh, testing::Layout{});
    const ForwardUnshardProfile off = collect_forward_unshard_profile(*m2);
    expect(!off.enabled && off.boundaries.empty(), "off by default");
  });
}

// issue 37: on CUDA a wait is a stream dependency (the host spends ~0 in it), so the profile times
// the compute stream's stall with CUDA events around each wait: with dmuon's loopback backend
// sleeping before every copy, the first boundary's forward broadcast (never prefetched) stalls it.
TEST(RuntimeTest, ForwardUnshardProfileTimesTheStreamStallOnCuda) {
  if (!DMUON_WITH_CUDA) GTEST_SKIP() << "this dmuon build has no CUDA (CPU LibTorch)";
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
  LoopbackOptions lo;
  lo.device = at::Device(at::kCUDA, 0);
  lo.sleep_cycles = 2000000;  // ~1 ms at the GPU's clock
  const GPTConfig cfg = small_config(3);
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(cfg);
    m->to(ctx.device);
    auto mesh = make_mesh(ctx);
    DedicateOptions o;
    o.record_forward_profile = true;
    testing::dedicate_gpt(m, mesh, testing::Layout{}, o);
    m->loss(at::randint(32, {2, 6}, at::kLong).to(ctx.device)).backward();
    const ForwardUnshardProfile p = collect_forward_unshard_profile(*m, /*clear=*/true);
    testing::expect(p.boundaries.size() == 3 && p.device_timed, "CUDA events time the waits");
    testing::expect(p.boundaries[0].forward_device_wait_ms > 0.05,
                    "the stream stalled " + std::to_string(p.boundaries[0].forward_device_wait_ms) +
                        " ms for layers.0's broadcast (the loopback sleeps ~1 ms before it)");
    testing::expect(p.total_device_wait_ms() >= p.boundaries[0].forward_device_wait_ms, "totals");
    const ForwardUnshardProfile cleared = collect_forward_unshard_profile(*m);
    testing::expect(cleared.total_device_wait_ms() == 0 && cleared.device_timed, "cleared");
  }, std::chrono::seconds(60), lo);
}

TEST(RuntimeTest, Bf16CommunicationStaysFiniteAndCloseToFp32) {
  TrainConfig tc;
  tc.steps = 5;
  tc.dtype = at::kFloat;
  const GPTConfig cfg = small_config(2);
  const StateDict init = init_state(cfg, 1234, tc.dtype);
  const auto batches = make_batches(tc.steps, 12, 12, cfg.vocab_size, 99);
  const RefResult ref = reference_train(cfg, init, batches, tc);
  for (bool z3 : {true, false}) {
    testing::run_ranks(3, [&](testing::RankContext& ctx) {
      GPT m(cfg);
      load_state(m, init);
      auto mesh = make_mesh(ctx);
      DedicateOptions o;
      o.compute_dtype = at::kBFloat16;  // broadcast and reduce payloads in bf16; fp32 master weights
      testing::Layout l;
      l.z3 = z3;
      testing::dedicate_gpt(m, mesh, l, o);
      Muon opt(m.ptr(), testing::muon_options(tc));
      mesh->counters().reset();
      testing::train_slices(m, opt, batches, ctx.rank, 4);
      // bf16 payloads: half the Muon bytes of fp32
      int64_t not_owned = 0;
      for (const auto& d : get_dedicated_params(*m))
        if (!d.is_owner) not_owned += 2 * d.shape[0] * d.shape[1];
      const int64_t per_step = mesh->counters().bytes(CommOp::Broadcast) / tc.steps;
      if (per_step != (z3 ? 2 : 1) * not_owned) throw std::runtime_error("bf16 broadcast bytes " + std::to_string(per_step));
      for (const auto& d : get_dedicated_params(*m)) {
        if (!d.is_owner) continue;
        if (d.param.scalar_type() != at::kFloat) throw std::runtime_error("master weights must stay fp32");
        if (!at::isfinite(d.param).all().item<bool>()) throw std::runtime_error("non-finite " + d.name);
        const double e = max_rel(d.param, ref.params.at(d.name));
        if (!(e <= 2e-2)) throw std::runtime_error(d.name + " drifted from the fp32 run: " + std::to_string(e));
      }
    });
  }
}

TEST(RuntimeTest, IntegerComputeDtypeIsAClearError) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(small_config(2));
    auto mesh = make_mesh(ctx);
    DedicateOptions o;
    o.compute_dtype = at::kInt;
    const std::string err = error_of([&] { dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o); });
    if (err.find("compute_dtype Int cannot carry parameters and gradients") == std::string::npos)
      throw std::runtime_error("unexpected message: " + err);
  });
}

TEST(RuntimeTest, UnknownRouteIsAClearError) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(small_config(2));
    auto mesh = make_mesh(ctx);
    DedicateOptions o;
    ParamPolicy bad;
    bad.route = "zero_adam";
    o.param_policy.push_back({"tok_emb", bad});
    const std::string err = error_of([&] { dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o); });
    if (err.find("'tok_emb.weight' has route 'zero_adam', which does not exist") == std::string::npos)
      throw std::runtime_error("unexpected message: " + err);
  });
}

TEST(RuntimeTest, BlockUsedTwicePerForwardAndTwoForwardsPerBackward) {
  for (bool z3 : {true, false}) {
    TrainConfig tc;
    tc.steps = 4;
    tc.block_order = {0, 1, 0};  // block 0's weights used at two positions
    DistConfig dc;
    dc.world = 2;
    dc.z3 = z3;
    dc.pack_small_params = false;
    check_equivalence(small_config(2), tc, dc);
    tc.block_order.clear();
    tc.two_forwards = true;
    check_equivalence(small_config(2), tc, dc);
  }
}

// A block used several times whose first use's input needs no gradient (a recurrent cell fed the
// raw input, a frozen embedding in front): that use installs no post-backward hook, so the other
// uses' hooks must not declare the block's gradients ready (its reduce would go out before the first
// use's share reaches the weights, and the step would see none of it).
TEST(RuntimeTest, ReusedBlockWhoseFirstInputNeedsNoGradientKeepsEveryUsesGradient) {
  for (bool z3 : {true, false})
    for (const std::vector<int>& order : {std::vector<int>{0, 0, 1}, std::vector<int>{0, 1, 0}, std::vector<int>{0, 1, 0, 1}}) {
      TrainConfig tc;
      tc.steps = 3;
      tc.block_order = order;
      tc.frozen_embedding = true;
      DistConfig dc;
      dc.world = 2;
      dc.z3 = z3;
      dc.pack_small_params = false;
      check_equivalence(small_config(2), tc, dc);
    }
}

TEST(RuntimeTest, RankThatOwnsNothingStillTrains) {
  // 7 matrices on 8 ranks: at least one rank owns nothing, yet takes part in every collective.
  TrainConfig tc;
  tc.steps = 4;
  DistConfig dc;
  dc.world = 8;
  dc.pack_small_params = false;
  dc.min_idle_ranks = 1;
  check_equivalence(small_config(1), tc, dc, /*global_batch=*/16);
}

TEST(RuntimeTest, BlockWithoutGradientIsSkippedLikeSingleProcess) {
  TrainConfig tc;
  tc.steps = 4;
  tc.frozen = {false, true, false};  // layers.1 runs under no_grad: its matrices get no gradient
  for (int world : {3, 1})  // (one rank: no payload, its flags stay 0)
    for (bool z3 : {true, false}) {
      DistConfig dc;
      dc.world = world;
      dc.z3 = z3;
      dc.pack_small_params = false;
      check_equivalence(small_config(), tc, dc);
    }
}

TEST(RuntimeTest, Rank0StrategyPutsEverythingOnRankZero) {
  TrainConfig tc;
  tc.steps = 3;
  DistConfig dc;
  dc.world = 2;
  dc.owner_strategy = "rank0";
  check_equivalence(small_config(2), tc, dc);
}

// ---- memory, bytes, plan --------------------------------------------------------------------------
TEST(RuntimeTest, NonOwnersKeepNoBytesBetweenStepsAndBytesMatchFormula) {
  const GPTConfig cfg = small_config();
  const StateDict init = init_state(cfg, 7);
  const auto batches = make_batches(2, 8, 10, cfg.vocab_size, 5);
  for (bool z3 : {true, false}) {
    testing::run_ranks(4, [&](testing::RankContext& ctx) {
      GPT m(cfg);
      load_state(m, init);
      auto mesh = make_mesh(ctx);
      testing::Layout l;
      l.z3 = z3;
      testing::dedicate_gpt(m, mesh, l);
      MuonOptions mo;
      mo.first_step_progress_log = false;
      Muon opt(m.ptr(), mo);
      for (const auto& tokens : batches) {
        mesh->counters().reset();
        opt.zero_grad();
        m->loss(tokens.narrow(0, ctx.rank * 2, 2)).backward();
        opt.step();
        // expected per-rank bytes: every matrix this rank does not own, once per broadcast pass
        // (forward, and backward in Z3) and once for the reduce, plus one has-gradient flag (an element
        // of the payload's dtype) per matrix
        int64_t not_owned = 0, flags = 0;
        for (const auto& d : get_dedicated_params(*m))
          if (!d.is_owner) {
            not_owned += static_cast<int64_t>(d.param.element_size()) * d.shape[0] * d.shape[1];
            flags += static_cast<int64_t>(d.param.element_size());
          }
        const int64_t bcast = mesh->counters().bytes(CommOp::Broadcast);
        const int64_t reduce = mesh->counters().bytes(CommOp::Reduce);
        if (bcast != (z3 ? 2 : 1) * not_owned)
          throw std::runtime_error("broadcast bytes " + std::to_string(bcast) + " != " +
                                   std::to_string((z3 ? 2 : 1) * not_owned));
        if (reduce != not_owned + flags)
          throw std::runtime_error("reduce bytes " + std::to_string(reduce) + " != " + std::to_string(not_owned + flags));
        for (const auto& d : get_dedicated_params(*m)) {
          if (d.is_owner) continue;
          if (d.param.numel() != 0 || d.param.storage().nbytes() != 0)
            throw std::runtime_error("non-owner keeps storage for " + d.name);
        }
        for (const auto& buf : inspect::packed_units(*m))
          if (!buf.holder && buf.flat.storage().nbytes() != 0)
            throw std::runtime_error("packed buffer of " + buf.boundary + " not released");
      }
    });
  }
}

TEST(RuntimeTest, Z3ReleasesBetweenBoundariesInForward) {
  const GPTConfig cfg = small_config();
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    DedicateOptions o;
    o.plan.pack_small_params = false;
    o.forward_prefetch_depth = 0;
    dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o);
    // run layer 0 alone: after its forward, its non-owned buffers are released again
    at::Tensor x = at::randn({2, 5, cfg.d_model});
    at::Tensor y = dmuon::forward(m->blocks[0], x);
    for (const auto& buf : inspect::packed_units(*m, 0))
      if (!buf.holder && buf.flat.storage().nbytes() != 0) throw std::runtime_error("layer 0 not released in Z3");
    (void)y;
  });
}

TEST(RuntimeTest, SummariesReportRoutingAndPlannedBytes) {
  const GPTConfig cfg = small_config(2);
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    testing::dedicate_gpt(m, mesh, {});
    MuonOptions mo;
    mo.first_step_progress_log = false;
    Muon opt(m.ptr(), mo);
    const auto groups = summarize_param_groups(*m, opt);
    auto fail = [](const std::string& w) { throw std::runtime_error(w); };
    if (groups["groups"].size() != 2) fail("expected a Muon and an AdamW subgroup");
    if (groups["groups"][0]["route"] != "muon" || groups["groups"][1]["route"] != "adamw") fail("routes");
    if (groups["totals"]["muon_params_all"] != 14) fail("14 Muon matrices expected");
    int owned = 0;
    for (const auto& d : get_dedicated_params(*m)) owned += d.is_owner ? 1 : 0;
    if (groups["totals"]["muon_params_owned_here"] != owned) fail("owned count");
    // AdamW: embedding, 2x2 norms, final norm, head
    if (groups["totals"]["adamw_params"] != 7) fail("7 AdamW params expected, got " + groups["totals"].dump());
    const auto plan = summarize_comm_plan(*m);
    if (plan["comm"]["boundaries"].size() != 2) fail("two boundaries expected");
    if (plan["comm"]["boundaries"][0]["boundary"] != "layers.0") fail("boundary name");
    int64_t pm = 0;
    for (const auto& d : get_dedicated_params(*m)) pm += 4 * d.shape[0] * d.shape[1];
    if (plan["comm"]["muon_bytes"] != pm) fail("P_M");
    const double f3 = plan["comm"]["per_rank"]["z3"]["formula"], f2 = plan["comm"]["per_rank"]["z2"]["formula"];
    if (std::abs(f3 - 1.5 * pm) > 1e-6 || std::abs(f2 - 1.0 * pm) > 1e-6) fail("formulas for N = 2");
    // this rank's planned Z3 bytes equal what the comm layer measures over one step (minus flags)
    mesh->counters().reset();
    m->loss(at::randint(32, {2, 6}, at::kLong)).backward();
    opt.step();
    int64_t flags = 0;
    for (const auto& d : get_dedicated_params(*m)) flags += d.is_owner ? 0 : 4;
    const int64_t measured = mesh->counters().bytes(CommOp::Broadcast) + mesh->counters().bytes(CommOp::Reduce);
    if (measured - flags != plan["this_rank"]["z3"].get<int64_t>())
      fail("planned " + plan["this_rank"]["z3"].dump() + " vs measured " + std::to_string(measured - flags));
    for (const auto& b : plan["comm"]["boundaries"])
      for (const auto& r : b["roots"])  // 1-D mesh: the owner's shard rank is its global rank
        if (r["owner"][0].get<int>() < 0 || r["owner"][0].get<int>() > 1 || r["owner"][1].get<int>() != 0)
          fail("root rank");
  });
}

// One rank (a world of one): dedicate + replicate the GPT, one step; the counters of that step.
CommCounters::Snapshot one_rank_step_counters(bool* owns_everything = nullptr) {
  CommCounters::Snapshot c;
  testing::run_ranks(1, [&](testing::RankContext& ctx) {
    GPT m(small_config());
    auto mesh = make_mesh(ctx);
    dedicate_params(m.ptr(), mesh, models::is_muon_matrix);
    replicate(m.ptr(), mesh);
    MuonOptions mo;
    mo.first_step_progress_log = false;
    Muon opt(m.ptr(), mo);
    mesh->counters().reset();
    m->loss(at::randint(32, {2, 8}, at::kLong)).backward();
    opt.step();
    c = mesh->counters().snapshot();
    if (owns_everything) {
      *owns_everything = true;
      for (const auto& d : get_dedicated_params(*m)) *owns_everything &= d.is_owner && d.param.numel() > 0;
    }
  });
  return c;
}

TEST(RuntimeTest, WorldSizeOneHasNoCommunication) {
  bool owns = false;
  const auto c = one_rank_step_counters(&owns);
  EXPECT_EQ(c.total_bytes(), 0) << "world size 1 communicated";
  EXPECT_TRUE(owns) << "world size 1 must own everything";
}

// DMUON_FORCE_COLLECTIVES=1 at world size 1 (what one GPU runs with NCCL): the groups issue real
// collectives, the dedicated route takes its reduce path instead of the one-rank shortcut, and the
// training still equals the single-process reference in float64 (Z3 and Z2, with accumulation).
TEST(RuntimeTest, ForcedCollectivesAtWorldSizeOneTakeTheMultiRankPath) {
  setenv("DMUON_FORCE_COLLECTIVES", "1", 1);
  struct Unset {
    ~Unset() { unsetenv("DMUON_FORCE_COLLECTIVES"); }
  } unset;
  for (const bool z3 : {true, false}) {
    SCOPED_TRACE(z3 ? "Z3" : "Z2");
    TrainConfig tc;
    tc.steps = 4;
    DistConfig dc;
    dc.world = 1;
    dc.z3 = z3;
    check_equivalence(small_config(), tc, dc);
    tc.accum = 2;
    check_equivalence(small_config(), tc, dc);
  }
  const auto c = one_rank_step_counters();
  EXPECT_GT(c.calls[static_cast<int>(CommOp::Broadcast)], 0) << "forward broadcasts issued";
  EXPECT_GT(c.calls[static_cast<int>(CommOp::Reduce)], 0) << "gradient reduces issued";
  EXPECT_GT(c.calls[static_cast<int>(CommOp::AllReduce)], 0) << "replicated all-reduces issued";
  EXPECT_EQ(c.total_bytes(), 0) << "a group of one moves no bytes";
}

// ---- bad input ------------------------------------------------------------------------------------

TEST(RuntimeTest, PredicateSelectingNonMatrixIsAClearError) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(small_config());
    auto mesh = make_mesh(ctx);
    const std::string err = error_of([&] {
      dedicate_params(m.ptr(), mesh, [](const std::string& n, const at::Tensor&) { return n.find("layers.0") == 0; });
    });
    if (err.find("the predicate routed 'layers.0.attn_norm.weight' to Muon, but it has shape [32] (1-D)") ==
            std::string::npos ||
        err.find("rank " + std::to_string(ctx.rank)) == std::string::npos)
      throw std::runtime_error("unexpected message: " + err);
  });
}

// The registry keeps a runtime while its model lives; once the model is gone its runtime (and every
// tensor the runtime holds) is released at the next lookup, not only at the next dedicate_params.
TEST(RuntimeTest, ADestroyedModelsRuntimeIsReleasedAtTheNextLookup) {
  testing::run_ranks(1, [&](testing::RankContext& ctx) {
    auto mesh = make_mesh(ctx);
    std::weak_ptr<Runtime> gone;
    {
      GPT m(small_config(2));
      dedicate_params(m.ptr(), mesh, models::is_muon_matrix);
      gone = inspect::runtime_of(*m);
      testing::expect(!gone.expired(), "the registry keeps the runtime while the model lives");
    }
    GPT other(small_config(2));
    testing::expect(!detail::state_of_model(other.ptr().get()), "the other model is not dedicated");
    testing::expect(gone.expired(), "the destroyed model's runtime was released by the lookup");
  });
}

TEST(RuntimeTest, DedicatingTwiceIsAClearError) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(small_config());
    auto mesh = make_mesh(ctx);
    dedicate_params(m.ptr(), mesh, models::is_muon_matrix);
    const std::string err = error_of([&] { dedicate_params(m.ptr(), mesh, models::is_muon_matrix); });
    if (err.find("already called on this model") == std::string::npos)
      throw std::runtime_error("unexpected message: " + err);
  });
}

TEST(RuntimeTest, StrictBoundaryPredicateMatchingNothingNamesTheParameter) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(small_config());
    auto mesh = make_mesh(ctx);
    DedicateOptions o;
    o.hook_boundary_predicate = [](const std::string& name, const torch::nn::Module&) {
      return name == "no.such.module";
    };
    const std::string err = error_of([&] { dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o); });
    if (err.find("no ancestor module of 'layers.0.q_proj.weight' matches hook_boundary_predicate") ==
        std::string::npos)
      throw std::runtime_error("unexpected message: " + err);
    // non-strict: falls back to the parent module, and training still works
  });
}

// Trains the GPT for 3 steps on 2 ranks with the boundary options `o`, checks that every matrix's
// boundary is its block ("layers.N") and that each owner equals single-process training, then runs
// `then(ctx, mesh)` on every rank.
template <typename Then>
void train_with_boundary_options(const DedicateOptions& o, Then&& then) {
  TrainConfig tc;
  tc.steps = 3;
  const GPTConfig cfg = small_config(2);
  const StateDict init = init_state(cfg, 3);
  const auto batches = make_batches(tc.steps, 12, 12, cfg.vocab_size, 4);
  const RefResult ref = reference_train(cfg, init, batches, tc);
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(cfg);
    load_state(m, init);
    auto mesh = make_mesh(ctx);
    dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o);
    replicate(m.ptr(), mesh);
    Muon opt(m.ptr(), testing::muon_options(tc));
    testing::train_slices(m, opt, batches, ctx.rank, 6);
    for (const auto& d : get_dedicated_params(*m)) {
      testing::expect(d.boundary == d.name.substr(0, 8), d.name + ": unexpected boundary " + d.boundary);
      if (d.is_owner)
        testing::expect(max_rel(d.param, ref.params.at(d.name)) <= testing::kFloat64Bound, d.name + " differs");
    }
    then(ctx, mesh);
  });
}

TEST(RuntimeTest, CustomBoundaryPredicateAndNonStrictFallback) {
  DedicateOptions o;
  // boundary = the blocks, chosen by predicate (same as the default heuristic, found another way)
  o.hook_boundary_predicate = [](const std::string& name, const torch::nn::Module& mod) {
    return name.rfind("layers.", 0) == 0 && mod.named_children().size() == 9;
  };
  train_with_boundary_options(o, [](testing::RankContext&, const std::shared_ptr<Mesh>& mesh) {
    // hook_boundary_strict = false: a parameter no ancestor of which matches falls back to its
    // direct parent module (here layers.1's projections)
    const GPTConfig cfg = small_config(2);
    GPT f(cfg);
    DedicateOptions fo;
    fo.hook_boundary_predicate = [](const std::string& name, const torch::nn::Module&) { return name == "layers.0"; };
    fo.hook_boundary_strict = false;
    dedicate_params(f.ptr(), mesh, models::is_muon_matrix, fo);
    replicate(f.ptr(), mesh);
    for (const auto& d : get_dedicated_params(*f)) {
      const std::string want = d.name.rfind("layers.0.", 0) == 0 ? "layers.0" : d.name.substr(0, d.name.rfind('.'));
      testing::expect(d.boundary == want, d.name + ": boundary " + d.boundary + ", expected " + want);
    }
    // strict (the default) refuses the same predicate, naming the parameter
    GPT g(cfg);
    fo.hook_boundary_strict = true;
    const std::string err = error_of([&] { dedicate_params(g.ptr(), mesh, models::is_muon_matrix, fo); });
    testing::expect(err.find("no ancestor module of 'layers.1.") != std::string::npos, err);
  });
}

// hook_boundary_resolver: the boundary of each parameter from a function of its name (here the
// block, found by string parsing); training equals single process. A name that is not a module is
// a clear error naming the parameter.
TEST(RuntimeTest, HookBoundaryResolverPicksBoundariesAndMatchesSingleProcess) {
  std::atomic<int> calls{0};
  DedicateOptions o;
  o.hook_boundary_resolver = [&](const std::string& name, const at::Tensor&) {
    ++calls;
    return name.substr(0, name.find('.', name.find('.') + 1));  // "layers.N"
  };
  train_with_boundary_options(o, [&](testing::RankContext&, const std::shared_ptr<Mesh>& mesh) {
    GPT bad(small_config(2));
    DedicateOptions bo;
    bo.hook_boundary_resolver = [](const std::string&, const at::Tensor&) { return std::string("no.such.module"); };
    const std::string err = error_of([&] { dedicate_params(bad.ptr(), mesh, models::is_muon_matrix, bo); });
    testing::expect(err.find("hook_boundary_resolver returned 'no.such.module' for parameter 'layers.0.") !=
                        std::string::npos, err);
  });
  EXPECT_EQ(calls.load(), 2 * 14) << "the resolver is asked once per dedicated matrix on each of 2 ranks";
}

// A model whose forward calls its first block directly instead of through dmuon::forward.
struct BypassModel : torch::nn::Module {
  GPT gpt{nullptr};
  bool bypass = false;
  explicit BypassModel(const GPTConfig& cfg) { gpt = register_module("gpt", GPT(cfg)); }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = gpt->tok_emb(tokens);
    h = bypass ? gpt->blocks[0]->forward(h) : dmuon::forward(gpt->blocks[0], h);
    return h;
  }
};

TEST(RuntimeTest, BypassingABoundaryNamesIt) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    auto model = std::make_shared<BypassModel>(small_config(2));
    auto mesh = make_mesh(ctx);
    DedicateOptions o;
    o.plan.owner_strategy = "rank0";  // rank 1 holds only placeholders
    dedicate_params(model, mesh, [](const std::string& n, const at::Tensor& p) {
      return p.dim() == 2 && n.find("layers.") != std::string::npos;
    }, o);
    const at::Tensor tokens = at::randint(32, {2, 5}, at::kLong);
    {
      at::NoGradGuard ng;
      (void)dmuon::forward(model, tokens);  // the proper path works on both ranks
    }
    if (ctx.rank != 1) return;  // rank 0 owns everything: a bypass there cannot fail
    model->bypass = true;
    at::NoGradGuard ng;
    const std::string err = error_of([&] { (void)dmuon::forward(model, tokens); });
    if (err.find("hook boundary 'gpt.layers.0' has not run through dmuon::forward in this forward pass") ==
            std::string::npos ||
        err.find("call `x = dmuon::forward(module, x)` for 'gpt.layers.0'") == std::string::npos ||
        err.find("rank 1") == std::string::npos)
      throw std::runtime_error("unexpected message: " + err);
  });
}

TEST(RuntimeTest, PeerThatDiesMidStepFailsTheOthersWithinTheTimeout) {
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<int> errors{0};
  std::string message;
  std::mutex mu;
  try {
    testing::run_ranks(3, [&](testing::RankContext& ctx) {
      GPT m(small_config(2));
      auto mesh = make_mesh(ctx, std::chrono::seconds(3));
      dedicate_params(m.ptr(), mesh, models::is_muon_matrix);
      replicate(m.ptr(), mesh);
      MuonOptions mo;
      mo.first_step_progress_log = false;
      Muon opt(m.ptr(), mo);
      m->loss(at::randint(32, {2, 6}, at::kLong)).backward();
      opt.step();
      if (ctx.rank == 2) throw std::runtime_error("simulated death of rank 2");  // leaves mid-run
      try {
        m->loss(at::randint(32, {2, 6}, at::kLong)).backward();
        opt.step();
      } catch (const std::exception& e) {
        ++errors;
        std::lock_guard<std::mutex> g(mu);
        message = e.what();
        throw;
      }
    });
  } catch (const std::exception&) {
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(errors.load(), 2) << "both surviving ranks must fail";
  EXPECT_NE(message.find("collective failed on dmuon group"), std::string::npos) << message;
  EXPECT_LT(secs, 30.0);
}

TEST(RuntimeTest, PlanFingerprintMismatchIsAnErrorNotAHang) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    // rank 1 builds a different model: wider MLP in every block
    GPTConfig cfg = small_config(2);
    if (ctx.rank == 1) cfg.d_ff = 64;
    GPT m(cfg);
    auto mesh = make_mesh(ctx, std::chrono::seconds(10));
    const std::string err = error_of([&] { dedicate_params(m.ptr(), mesh, models::is_muon_matrix); });
    if (err.find("the owner plan differs between ranks") == std::string::npos ||
        err.find("layers.0.gate_proj.weight") == std::string::npos)
      throw std::runtime_error("unexpected message: " + err);
  });
}

// Ranks whose planner options differ (here the owner strategy) are told so: no parameter is blamed.
TEST(RuntimeTest, PlannerOptionsMismatchIsNamedNotBlamedOnAParameter) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(small_config(2));
    auto mesh = make_mesh(ctx, std::chrono::seconds(60));
    DedicateOptions o;
    o.plan.owner_strategy = ctx.rank == 1 ? "round_robin" : "lpt";
    const std::string err = error_of([&] { dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o); });
    if (err.find("the planner options differ between rank 0 and rank 1") == std::string::npos ||
        err.find("parameter #") != std::string::npos)
      throw std::runtime_error("rank " + std::to_string(ctx.rank) + ": unexpected message: " + err);
  });
}

// Ranks given different options that decide which collectives run (Z3 on one, Z2 on the other; broadcast or
// all-gather unshard; publish chunks) are told so at dedicate_params, naming the option and its value, instead
// of waiting in different collectives; an option one rank refuses fails every rank.
TEST(RuntimeTest, DedicateOptionsThatShapeTheCollectivesMustAgree) {
  struct Case {
    std::function<void(DedicateOptions&)> set;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](DedicateOptions& o) { o.reshard_after_forward = false; }, "reshard_after_forward = "},
      {[](DedicateOptions& o) { o.muon_forward_unshard = "all_gather"; }, "muon_forward_unshard = "},
      {[](DedicateOptions& o) { o.replicate_broadcast_bucket_mb = 4.000001; }, "replicate_broadcast_bucket_mb = "},
      {[](DedicateOptions& o) { o.delay_stage2_to_optimizer = false; }, "delay_stage2_to_optimizer = "},
      {[](DedicateOptions& o) { o.param_policy.push_back({"layers.1.", [] {
                                  ParamPolicy p;
                                  p.muon_forward_unshard = "all_gather";
                                  return p;
                                }()}); },
       "muon_forward_unshard or mixed-precision policy"},
      {[](DedicateOptions& o) { o.replicate_broadcast_bucket_mb = -1; }, "replicate_broadcast_bucket_mb must be >= 0"},
  };
  for (const Case& c : cases)
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      GPT m(small_config(2));
      auto mesh = make_mesh(ctx, std::chrono::seconds(60));
      DedicateOptions o;
      o.replicate_broadcast_bucket_mb = 4;
      if (ctx.rank == 1) c.set(o);
      const std::string err = error_of([&] { dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o); });
      const bool refused = c.want.find("must be") != std::string::npos;
      const std::string want = refused && ctx.rank == 0 ? "setup failed on rank(s) 1" : c.want;
      if (err.find(want) == std::string::npos || err.find("rank " + std::to_string(ctx.rank) + ": ") != 0)
        throw std::runtime_error("rank " + std::to_string(ctx.rank) + ": unexpected message: " + err);
    });
}

// A setup failure on one rank only (here: rank 1's planner options are invalid) fails every rank at
// the plan check, naming the rank, instead of leaving the others in its collective until the timeout.
TEST(RuntimeTest, SetupFailureOnOneRankFailsEveryRankNotAHang) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(small_config(2));
    auto mesh = make_mesh(ctx, std::chrono::seconds(60));
    DedicateOptions o;
    if (ctx.rank == 1) o.plan.owner_strategy = "no-such-strategy";
    const std::string err = error_of([&] { dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o); });
    const std::string want = ctx.rank == 1 ? "owner planning failed" : "setup failed on rank(s) 1";
    if (err.find(want) == std::string::npos || err.find("rank " + std::to_string(ctx.rank)) == std::string::npos)
      throw std::runtime_error("rank " + std::to_string(ctx.rank) + ": unexpected message: " + err);
    if (ctx.rank == 1 && err.find("no-such-strategy") == std::string::npos)
      throw std::runtime_error("rank 1's error does not name the bad strategy: " + err);
    // a caller mistake on rank 1 is one on every rank (Python: ValueError everywhere, not RuntimeError)
    GPT again(small_config(2));
    try {
      dedicate_params(again.ptr(), mesh, models::is_muon_matrix, o);
      throw std::runtime_error("rank " + std::to_string(ctx.rank) + ": the second dedicate_params did not fail");
    } catch (const c10::ValueError&) {
    }
  });
}


// ---- the model seam: a model given as data ---------------------------------------------------------

// Three blocks y = tanh(x W_i^T + b_i), then a scale: plain float64 tensors, no nn::Module. W_i are
// Muon matrices, b_i sharded_adamw slices, the scale replicated.
struct PlainModel {
  static constexpr int kBlocks = 3, kDim = 8;
  std::vector<at::Tensor> w, b;
  at::Tensor scale;
  PlainModel() {
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    for (int i = 0; i < kBlocks; ++i) {
      w.push_back((at::arange(kDim * kDim, f64).reshape({kDim, kDim}) * 0.37 + i).sin().mul(0.4).requires_grad_());
      b.push_back((at::arange(kDim, f64) * 0.21 - i).cos().mul(0.1).requires_grad_());
    }
    scale = at::full({1}, 1.3, f64).requires_grad_();
  }
  ModelView view() const {
    ModelView v;
    v.modules.push_back({"", -1, {}});
    v.modules.push_back({"blocks", 0, {}});
    for (int i = 0; i < kBlocks; ++i) {
      const std::string block = "blocks." + std::to_string(i);
      v.modules.push_back({block, 1, {}});
      v.params.push_back({block + ".weight", w[static_cast<size_t>(i)]});
      v.params.push_back({block + ".bias", b[static_cast<size_t>(i)]});
    }
    v.params.push_back({"scale", scale});
    return v;
  }
  // every boundary through its scope, as a front end's hooks would run it
  at::Tensor forward(const std::shared_ptr<Runtime>& rt, at::Tensor x) {
    detail::BoundaryScope root(rt, "");
    root.enter();
    for (int i = 0; i < kBlocks; ++i) {
      detail::BoundaryScope s(rt, "blocks." + std::to_string(i));
      const at::Tensor h = s.enter(x);
      x = s.exit(at::tanh(at::linear(h, w[static_cast<size_t>(i)], b[static_cast<size_t>(i)])));
    }
    root.exit();
    return x * scale;
  }
};

// Trains PlainModel for 3 steps on `world` ranks (a global batch of 6 rows split evenly); returns
// every parameter's full value after training.
std::map<std::string, at::Tensor> train_plain_model(int world) {
  return testing::rank0_result<std::map<std::string, at::Tensor>>(world, [&](testing::RankContext& ctx) {
    PlainModel m;
    DedicateOptions o;
    o.route_hint_fn = [](const std::string& name, const at::Tensor&) {
      return name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0 ? std::string("sharded_adamw")
                                                                                : std::string();
    };
    auto rt = dedicate_model_view(m.view(), make_mesh(ctx),
                                  [](const std::string&, const at::Tensor& p) { return p.dim() == 2; }, o);
    rt->add_replicated(25.0, /*tp=*/false);  // the scale: what a front end's replicate() does
    MuonOptions mo;
    mo.lr = 0.05;
    mo.adamw_lr = 0.01;
    Muon opt(std::static_pointer_cast<RuntimeFace>(rt), mo);
    const int64_t per = 6 / ctx.world;
    for (int step = 0; step < 3; ++step) {
      const auto f64 = at::TensorOptions().dtype(at::kDouble);
      const at::Tensor x = (at::arange(6 * PlainModel::kDim, f64).reshape({6, PlainModel::kDim}) * 0.11 + step).cos();
      const at::Tensor target = x.sin();
      opt.zero_grad();
      const at::Tensor mine = x.narrow(0, ctx.rank * per, per), goal = target.narrow(0, ctx.rank * per, per);
      (m.forward(rt, mine) - goal).pow(2).mean().backward();
      opt.step();
    }
    testing::expect(opt.steps_taken() == 3, "three steps");
    std::map<std::string, at::Tensor> full;
    rt->gather_params([&](const std::string& name, const at::Tensor& t) { full[name] = t.detach().clone(); });
    return full;
  });
}


TEST(RuntimeTest, ModelViewOverPlainTensorsMatchesSingleProcess) {
  const auto single = train_plain_model(1);
  const auto three = train_plain_model(3);
  const PlainModel init;
  ASSERT_EQ(single.size(), 7u);
  ASSERT_EQ(three.size(), 7u);
  for (const auto& [name, v] : single) {
    ASSERT_TRUE(three.count(name)) << name;
    // float64: the same math in another order of reductions only (bound 1e-10)
    EXPECT_LT(max_rel(three.at(name), v), 1e-10) << name;
  }
  // and training moved every kind of parameter (Muon, sharded AdamW, replicated AdamW)
  EXPECT_GT((single.at("blocks.1.weight") - init.w[1].detach()).abs().max().item<double>(), 1e-3);
  EXPECT_GT((single.at("blocks.2.bias") - init.b[2].detach()).abs().max().item<double>(), 1e-4);
  EXPECT_GT((single.at("scale") - init.scale.detach()).abs().max().item<double>(), 1e-4);
}

// ---- blocks returning several tensors --------------------------------------------------------------

// y = x W_i^T; returns (sin y, (y, i)): nested std::tuples, as an LSTM's (output, (h, c)), with a non-tensor.
struct PairBlockImpl : torch::nn::Module {
  explicit PairBlockImpl(int i) {
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    w = register_parameter("weight", (at::arange(36, f64).reshape({6, 6}) * 0.29 + i).sin().mul(0.5));
    index = i;
  }
  // (index, a reference to the block's own member, passes on as the reference it is)
  std::tuple<at::Tensor, std::tuple<at::Tensor, const int&>> forward(const at::Tensor& x) {
    const at::Tensor y = at::matmul(x, w.t());
    return {at::sin(y), {y * 1.0, index}};
  }
  at::Tensor w;
  int index = 0;
};
TORCH_MODULE(PairBlock);

struct PairNetImpl : torch::nn::Module {
  PairNetImpl() {
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), PairBlock(i)));
    scale = register_parameter("scale", at::full({1}, 1.1, at::TensorOptions().dtype(at::kDouble)));
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto [h, rest] = dmuon::forward(blocks[i], x);
      auto [z, index] = rest;
      static_assert(std::is_same_v<decltype(index), const int&>, "a reference in a block's tuple stays one");
      testing::expect(&index == &blocks[i]->index, "the tuple's reference to the block's member passes on");
      h.mul_(2);  // the caller changes the block's outputs in place, as it may a plain module's
      z.add_(0.5);
      x = i + 1 < blocks.size() ? h + 0.1 * z : z;  // the last block: only its second output reaches the loss
    }
    return x * scale;
  }
  std::vector<PairBlock> blocks;
  at::Tensor scale;
};
TORCH_MODULE(PairNet);

// A block whose ops run on a worker thread: autograd numbers those nodes on the worker's counter, so the
// weight's gradient node may run after the input's post-backward hook. On LibTorch 2.x dmuon renumbers them at
// the block's exit and the gradient is in the boundary's reduce; 1.13 cannot renumber a node, and says so (a
// warning naming the boundary, once) rather than dropping the gradient in silence.
struct ThreadedBlockImpl : torch::nn::Module {
  ThreadedBlockImpl() {
    w = register_parameter("weight", at::arange(16, at::TensorOptions().dtype(at::kDouble)).reshape({4, 4}).sin());
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y;
    std::thread([&] { y = at::matmul(x, w.t()).sin(); }).join();
    return y;
  }
  at::Tensor w;
};
TORCH_MODULE(ThreadedBlock);

struct CollectWarnings : c10::WarningHandler {
#if DMUON_TORCH_AT_LEAST(2, 0)
  void process(const c10::Warning& w) override { seen.push_back(w.msg()); }
#else  // LibTorch 1.13: (location, message, verbatim)
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override { seen.push_back(msg); }
#endif
  std::vector<std::string> seen;
};
#if DMUON_TORCH_AT_LEAST(2, 0)
using WarningGuard = c10::WarningUtils::WarningHandlerGuard;
#else
using WarningGuard = c10::Warning::WarningHandlerGuard;
#endif

template <typename N>
constexpr bool kRenumbersNodes = requires(N& n) { n.set_sequence_nr(uint64_t{0}); };
constexpr bool kRenumbers = kRenumbersNodes<torch::autograd::Node>;

// A block whose weight's gradient node is numbered below its input's post-backward wrapper, on this thread
// (as an overlap helper renumbering a node would): autograd runs it after the wrapper, so after the
// boundary's reduce, and no renumbering at the exit can tell it from a node made before the block.
struct LateWeightBlockImpl : ThreadedBlockImpl {
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor wt = w.t();
    renumber(*wt.grad_fn());
    return at::matmul(x, wt).sin();
  }
  template <typename N>
  static void renumber(N& n) {
    if constexpr (kRenumbersNodes<N>) n.set_sequence_nr(0);
  }
};
TORCH_MODULE(LateWeightBlock);

// Two backwards of `Block` on 2 ranks (each its own batch), each followed by prepare_muon_grads. `in_reduce`:
// the owner's gradient of the weight is the plain block's, averaged over the ranks (1e-12), and nothing is
// warned; otherwise the weight's gradient came after the reduce: dropped on every rank (no gradient on the
// owner, nothing left in param.grad) and warned once per rank.
template <typename Block>
void two_backwards_of(bool in_reduce) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    struct Net : torch::nn::Module {
      Net() { block = register_module("block", Block()); }
      Block block{nullptr};
    };
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    auto input = [&](int rank, int pass) { return (at::arange(8, f64).reshape({2, 4}) * (0.3 + rank) + pass).cos(); };
    auto m = std::make_shared<Net>();
    dedicate_params(m, make_mesh(ctx), [](const std::string&, const at::Tensor& p) { return p.dim() == 2; });
    const bool owner = get_owned_params(*m, ctx.rank).size() == 1;
    {  // this thread's autograd numbering well past the worker's, which starts at 0 on every new thread
      at::Tensor t = at::ones({1}, f64).requires_grad_(true);
      for (int i = 0; i < 64; ++i) t = t * 1.0;
    }
    MuonOptions mo;
    mo.first_step_progress_log = false;
    Muon opt(m, mo);
    CollectWarnings warnings;
    WarningGuard guard(&warnings);
    const std::string who = "rank " + std::to_string(ctx.rank);
    for (int pass = 0; pass < 2; ++pass) {
      opt.zero_grad();
      dmuon::forward(m->block, input(ctx.rank, pass).requires_grad_(true)).sum().backward();
      prepare_muon_grads(*m);
      Block plain;  // the plain block's gradient of each rank's loss, averaged: what the owner must hold
      for (int r = 0; r < ctx.world; ++r) plain->forward(input(r, pass)).sum().div(ctx.world).backward();
      const at::Tensor g = m->block->w.grad();
      const std::string at = who + ", pass " + std::to_string(pass);
      if (in_reduce && owner) {
        testing::expect(g.defined() && g.numel() == 16, at + ": the owner has no gradient");
        const double err = max_rel(g, plain->w.grad());
        testing::expect(err < 1e-12, at + ": the owner's gradient differs from the plain block's by " + std::to_string(err));
      } else if (!in_reduce) {
        testing::expect(!g.defined() || g.numel() == 0, at + ": a gradient that came after the reduce was kept");
      }
    }
    size_t late = 0;
    for (const auto& msg : warnings.seen)
      if (msg.find("boundary 'block' arrived after the boundary's reduce went out this backward and is dropped") !=
          std::string::npos)
        ++late;
    const size_t want = in_reduce ? 0 : 1;
    testing::expect(late == want, who + ": " + std::to_string(late) + " late-gradient warnings, not " +
                                      std::to_string(want) + " (" + std::to_string(warnings.seen.size()) +
                                      " warnings in all)");
  });
}

TEST(RuntimeTest, ABlocksOpsOnAWorkerThreadGiveTheirGradientsToTheReduce) {
  // (LibTorch 1.13 cannot renumber a node: there the gradient is dropped and warned)
  two_backwards_of<ThreadedBlock>(/*in_reduce=*/kRenumbers);
}

TEST(RuntimeTest, AGradientAfterItsBoundarysReduceIsDroppedWithAWarning) {
  if (!kRenumbers) GTEST_SKIP() << "LibTorch 1.13 cannot renumber a node (the threaded block's test covers it there)";
  two_backwards_of<LateWeightBlock>(/*in_reduce=*/false);
}

struct PlainBlockImpl : ThreadedBlockImpl {
  at::Tensor forward(const at::Tensor& x) { return at::matmul(x, w.t()).sin(); }
};
TORCH_MODULE(PlainBlock);

// A C++ model calls its blocks through dmuon::forward, with no scope of its own: an evaluation forward under
// NoGradGuard before a training step must not hold that step's reduces to the end of its backward (its
// no-grad uses are no reentrant checkpoint's, which only Python has): block b's reduce goes out before
// block a's backward, as without the evaluation, and nothing is warned.
TEST(RuntimeTest, AnEvaluationForwardLeavesTheNextBackwardsReducesInIt) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    struct Net : torch::nn::Module {
      Net() {
        a = register_module("a", PlainBlock());
        b = register_module("b", PlainBlock());
      }
      PlainBlock a{nullptr}, b{nullptr};
    };
    auto m = std::make_shared<Net>();
    auto mesh = make_mesh(ctx);
    DedicateOptions opts;
    opts.reshard_after_forward = true;
    dedicate_params(m, mesh, [](const std::string&, const at::Tensor& p) { return p.dim() == 2; }, opts);
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    CollectWarnings warnings;
    WarningGuard guard(&warnings);
    for (bool evaluate : {false, true}) {
      if (evaluate) {
        at::NoGradGuard ng;
        dmuon::forward(m->b, dmuon::forward(m->a, at::ones({2, 4}, f64)));
      }
      const at::Tensor x = (at::arange(8, f64).reshape({2, 4}) * (0.2 + ctx.rank)).cos().requires_grad_(true);
      const at::Tensor h = dmuon::forward(m->a, x);
      const int64_t before = mesh->counters().calls(CommOp::Reduce);
      int64_t at_a = -1;  // reduces issued when block a's output gradient is ready, before a's own backward
      h.register_hook([&](const at::Tensor&) { at_a = mesh->counters().calls(CommOp::Reduce) - before; });
      dmuon::forward(m->b, h).sum().backward();
      prepare_muon_grads(*m);
      testing::expect(at_a >= 1, "rank " + std::to_string(ctx.rank) + (evaluate ? ", after an evaluation" : "") +
                                     ": block b's reduce had not gone out before block a's backward (" +
                                     std::to_string(at_a) + " reduces)");
      for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
    }
    for (const auto& msg : warnings.seen)
      testing::expect(msg.find("ran under no_grad inside a training forward") == std::string::npos,
                      "rank " + std::to_string(ctx.rank) + ": " + msg);
  });
}

// Trains PairNet for 3 steps on `world` ranks (Z3: every matrix released after its block's forward,
// gathered again before its backward); returns the full parameters.
TensorDict train_pair_net(int world) {
  return testing::rank0_result<TensorDict>(world, [&](testing::RankContext& ctx) {
    PairNet m;
    auto mesh = make_mesh(ctx);
    dedicate_params(m.ptr(), mesh, [](const std::string&, const at::Tensor& p) { return p.dim() == 2; });
    replicate(m.ptr(), mesh);
    MuonOptions mo;
    mo.lr = 0.05;
    mo.adamw_lr = 0.01;
    mo.first_step_progress_log = false;
    Muon opt(m.ptr(), mo);
    const int64_t per = 6 / ctx.world;
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    auto loss = [&](PairNet& net, const at::Tensor& x) { return (net->forward(x) - x.sin()).pow(2).mean(); };
    {  // the first gradients: a plain PairNet's (no dmuon) on the whole batch, averaged over the ranks
      const at::Tensor x = at::arange(36, f64).reshape({6, 6}).mul(0.13).cos();
      PairNet plain;
      loss(plain, x).backward();
      loss(m, x.narrow(0, ctx.rank * per, per)).backward();
      prepare_muon_grads(*m);
      const auto want = plain->named_parameters();
      int checked = 0;
      std::string missing;
      for (const auto& item : m->named_parameters()) {
        const at::Tensor& g = item.value().grad();
        if (!g.defined() || g.numel() == 0) {  // a matrix this rank does not own
          missing += " " + item.key();
          continue;
        }
        const double err = max_rel(g, want[item.key()].grad());
        testing::expect(err < 1e-12, "rank " + std::to_string(ctx.rank) + ": the gradient of " + item.key() +
                                         " differs from the plain model's by " + std::to_string(err));
        ++checked;
      }
      testing::expect(checked >= (ctx.world == 1 ? 4 : 2),
                      "rank " + std::to_string(ctx.rank) + ": every owned matrix and the scale checked; none for" + missing);
      opt.zero_grad();
    }
    for (int step = 0; step < 3; ++step) {
      const at::Tensor x = (at::arange(36, f64).reshape({6, 6}) * 0.13 + step).cos();
      opt.zero_grad();
      loss(m, x.narrow(0, ctx.rank * per, per)).backward();
      opt.step();
    }
    StateDictOptions all;
    all.rank0_only = false;
    return get_model_state_dict(*m, all);
  });
}

// A block returning (nested) std::tuples gets the pre-backward hook on every tensor in them: on Z3 its
// matrix is gathered again before its backward even when the loss uses only its nested output, and the
// caller may change the outputs in place. Gradients equal a plain model's; 2 ranks equal 1 in float64.
TEST(RuntimeTest, ABlockReturningATupleTrainsOnZ3AndItsOutputsMayChangeInPlace) {
  const auto single = train_pair_net(1);
  const auto two = train_pair_net(2);
  ASSERT_EQ(single.size(), 4u);
  const PairNet init;
  for (const auto& [name, v] : single) {
    ASSERT_TRUE(two.count(name)) << name;
    EXPECT_LT(max_rel(two.at(name), v), 1e-10) << name;  // float64, another order of reductions only
  }
  for (int i = 0; i < 3; ++i) {
    const std::string w = "block" + std::to_string(i) + ".weight";
    EXPECT_GT((single.at(w) - init->blocks[static_cast<size_t>(i)]->w).abs().max().item<double>(), 1e-3) << w;
  }
}

}  // namespace
}  // namespace dmuon

namespace dmuon {
namespace {

// post_step_prefetch_groups / post_step_prefetch_sharded_adamw: step() issues the first K boundaries'
// unshards of the next forward. Same values (float64, bitwise: the same collectives carry the same data),
// the same unshard bytes per training step (moved from the forward into step(), none added), and the
// bytes step() issues are exactly the forward unshards of the first K boundaries of the recorded order.
struct PrefetchRun {
  std::map<std::string, at::Tensor> params;  // "name@rank"
  std::vector<int64_t> per_step_bytes;       // rank 0: shard-group broadcast + all-gather bytes of each step
  std::vector<int64_t> in_step_bytes;        // rank 0: of those, issued inside step()
  int64_t prefetched = 0;                    // rank 0: forward_prefetched in the unshard profile
};

PrefetchRun train_with_prefetch(const testing::Layout& l, int groups, bool sharded) {
  const models::GPTConfig cfg = testing::small_config(3);
  const auto init = testing::init_state(cfg, 7);
  const int steps = 4;
  const auto batches = testing::make_batches(steps, 8, 8, cfg.vocab_size, 3);
  PrefetchRun out;
  std::mutex mu;
  testing::run_ranks(l.world, [&](testing::RankContext& ctx) {
    models::GPT m(cfg);
    testing::load_state(m, init);
    auto mesh = testing::make_mesh(ctx, std::chrono::seconds(60), l.replicate);
    DedicateOptions o;
    o.record_forward_profile = true;
    testing::dedicate_gpt(m, mesh, l, o);
    testing::TrainConfig tc;
    MuonOptions mo = testing::muon_options(tc);
    mo.post_step_prefetch_groups = groups;
    mo.post_step_prefetch_sharded_adamw = sharded;
    Muon opt(m.ptr(), mo);
    Communicator& shard = mesh->shard();
    auto unshard_bytes = [&] {
      return shard.own_counters().bytes(CommOp::Broadcast) + shard.own_counters().bytes(CommOp::AllGather);
    };
    const int64_t per = 8 / l.world;
    std::vector<int64_t> per_step, in_step;
    for (const auto& tokens : batches) {
      const int64_t start = unshard_bytes();
      opt.zero_grad();
      m->loss(tokens.narrow(0, ctx.rank * per, per)).backward();
      const int64_t before_step = unshard_bytes();
      opt.step();
      per_step.push_back(unshard_bytes() - start);
      in_step.push_back(unshard_bytes() - before_step);
    }
    wait_all_post_step_broadcasts(*m);
    // the order prefetching follows: the layers in model order (their blocks are the dedicated boundaries)
    std::vector<std::string> layers;
    for (const std::string& b : post_forward_order(*m))
      if (b.rfind("layers.", 0) == 0) layers.push_back(b);
    testing::expect(layers == std::vector<std::string>{"layers.0", "layers.1", "layers.2"},
                    "post_forward_order: " + std::to_string(layers.size()) + " layers");
    const ForwardUnshardProfile prof = consume_forward_unshard_profile(*m);
    int64_t prefetched = 0;
    for (const auto& b : prof.boundaries) prefetched += b.forward_prefetched;
    reset_post_forward_order(*m);
    testing::expect(post_forward_order(*m).empty(), "reset_post_forward_order leaves no order");
    const TensorDict sd = get_model_state_dict(*m);  // collective; rank 0 holds every full value (sharded_adamw too)
    std::lock_guard<std::mutex> g(mu);
    for (const auto& d : get_dedicated_params(*m))
      if (d.is_owner) out.params[d.name + "@" + std::to_string(ctx.rank)] = d.param.clone();
    for (const auto& [name, v] : sd) out.params[name + "@sd" + std::to_string(ctx.rank)] = v.clone();
    if (ctx.rank == 0) {
      out.per_step_bytes = per_step;
      out.in_step_bytes = in_step;
      out.prefetched = prefetched;
    }
  });
  return out;
}

TEST(RuntimeTest, PostStepPrefetchMovesTheFirstUnshardsIntoStepWithSameValuesAndBytes) {
  testing::Layout z3;
  z3.label = "1-D Z3";
  testing::Layout z2 = z3;
  z2.label = "1-D Z2";
  z2.z3 = false;
  testing::Layout hsdp;
  hsdp.label = "HSDP 2x2 Z3, sharded_adamw";
  hsdp.world = 4;
  hsdp.replicate = 2;
  hsdp.sharded = true;
  testing::Layout gather = z3;
  gather.label = "1-D Z3 all_gather, sharded_adamw";
  gather.unshard = "all_gather";
  gather.sharded = true;
  for (const auto& l : {z3, z2, hsdp, gather}) {
    SCOPED_TRACE(l.label);
    const PrefetchRun off = train_with_prefetch(l, 0, false);
    for (const auto& [groups, sharded] : std::vector<std::pair<int, bool>>{{2, false}, {1, l.sharded}}) {
      const PrefetchRun on = train_with_prefetch(l, groups, sharded);
      ASSERT_EQ(on.params.size(), off.params.size());
      for (const auto& [key, v] : off.params) EXPECT_TRUE(at::equal(on.params.at(key), v)) << key;
      // the first step has no recorded order before its forward; afterwards each training step moves the
      // same bytes, and step() issues some of them (none without prefetch: 1-D broadcast mode publishes nothing)
      for (size_t i = 0; i < off.per_step_bytes.size(); ++i) {
        EXPECT_EQ(on.per_step_bytes[i] - on.in_step_bytes[i] + (i > 0 ? on.in_step_bytes[i - 1] : 0),
                  off.per_step_bytes[i] - off.in_step_bytes[i] + (i > 0 ? off.in_step_bytes[i - 1] : 0))
            << "step " << i << ": the unshard bytes of its forward and backward";
        EXPECT_GT(on.in_step_bytes[i], off.in_step_bytes[i]) << "step " << i;
      }
      EXPECT_GT(on.prefetched, off.prefetched);
    }
  }
}

}  // namespace
}  // namespace dmuon

namespace dmuon {
namespace {

// A model dropped right after step() with its async publish in flight (ranks as threads of one process):
// its runtime stays registered until that collective finished -- releasing it earlier destroyed its groups
// under the peers' side, which then waited out the mesh timeout inside whichever rank thread made the
// next lookup -- and is released by a later lookup once the collective finished (no leak).
TEST(RuntimeTest, ADroppedModelsRuntimeIsReleasedOnceItsCollectivesFinished) {
  const models::GPTConfig cfg = testing::small_config(2);
  std::mutex mu;
  std::vector<std::weak_ptr<Runtime>> dropped;
  testing::run_ranks(4, [&](testing::RankContext& ctx) {
    models::GPT m(cfg);
    auto mesh = testing::make_mesh(ctx, std::chrono::seconds(60), /*replicate=*/2);
    testing::Layout l;
    l.world = 4;
    l.replicate = 2;
    testing::dedicate_gpt(m, mesh, l);
    Muon opt(m.ptr(), testing::muon_options(testing::TrainConfig{}));
    m->loss(at::randint(cfg.vocab_size, {2, 6}, at::kLong)).backward();
    opt.step();  // HSDP: the publish over the replicate group is still in flight when the model goes
    std::lock_guard<std::mutex> g(mu);
    dropped.push_back(detail::state_of_model(m.ptr().get()));
  });
  ASSERT_EQ(dropped.size(), 4u);
  auto alive = [&] {
    detail::state_of_model(nullptr);  // a lookup: releases the dead models' finished runtimes
    return std::count_if(dropped.begin(), dropped.end(), [](const auto& w) { return !w.expired(); });
  };
  for (int i = 0; i < 500 && alive() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(alive(), 0) << "runtimes of dropped models still alive after their collectives finished";
}

}  // namespace
}  // namespace dmuon

namespace dmuon {
namespace {

// sharded_adamw_unshard_separate_stream: the sharded_adamw all-gathers run on the mesh's second shard
// group (its own connections here; its own stream on NCCL) and the dedicated broadcasts stay on the shard
// group: bitwise the same training, the same total bytes, every all-gather byte on the second group.
TEST(RuntimeTest, ShardedAdamwAllGathersOnTheirOwnGroupTrainTheSame) {
  const models::GPTConfig cfg = testing::small_config(2);
  const auto init = testing::init_state(cfg, 7);
  const auto batches = testing::make_batches(3, 4, 8, cfg.vocab_size, 3);
  std::map<std::string, at::Tensor> results[2];
  int64_t total[2] = {0, 0};
  for (int separate = 0; separate < 2; ++separate) {
    std::mutex mu;
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      models::GPT m(cfg);
      testing::load_state(m, init);
      auto mesh = testing::make_mesh(ctx);
      if (separate) {
        auto store = c10::make_intrusive<c10d::PrefixStore>("sharded-unshard", ctx.store);
        mesh->set_sharded_unshard_group({ctx.factory(store, ctx.rank, 2, std::chrono::seconds(60)), {0, 1}});
        const std::string e = testing::error_of([&] { mesh->set_sharded_unshard_group({ctx.pg, {0, 1}}); });
        testing::expect(e.find("has one already") != std::string::npos, e);
      }
      testing::Layout l;
      l.sharded = true;
      testing::dedicate_gpt(m, mesh, l);
      MuonOptions mo = testing::muon_options(testing::TrainConfig{});
      mo.sharded_adamw_unshard_separate_stream = separate == 1;
      Muon opt(m.ptr(), mo);
      for (const auto& tokens : batches) {
        opt.zero_grad();
        m->loss(tokens.narrow(0, 2 * ctx.rank, 2)).backward();
        opt.step();
      }
      wait_all_post_step_broadcasts(*m);
      const int64_t on_shard = mesh->shard().own_counters().bytes(CommOp::AllGather);
      const int64_t on_twin = separate ? mesh->sharded_unshard().own_counters().bytes(CommOp::AllGather) : 0;
      testing::expect(separate ? on_shard == 0 && on_twin > 0 : on_shard > 0,
                      "all-gather bytes: shard group " + std::to_string(on_shard) + ", second group " +
                          std::to_string(on_twin));
      const TensorDict sd = get_model_state_dict(*m);
      std::lock_guard<std::mutex> g(mu);
      total[separate] += mesh->counters().total_bytes();
      for (const auto& [name, v] : sd) results[separate][name + "@" + std::to_string(ctx.rank)] = v.clone();
    });
  }
  EXPECT_EQ(total[0], total[1]);
  ASSERT_EQ(results[0].size(), results[1].size());
  for (const auto& [key, v] : results[0]) EXPECT_TRUE(at::equal(results[1].at(key), v)) << key;
  // without the group, the option is a clear error
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    models::GPT m(cfg);
    auto mesh = testing::make_mesh(ctx);
    testing::Layout l;
    l.sharded = true;
    testing::dedicate_gpt(m, mesh, l);
    MuonOptions mo;
    mo.sharded_adamw_unshard_separate_stream = true;
    const std::string e = testing::error_of([&] { Muon opt(m.ptr(), mo); });
    testing::expect(e.find("set_sharded_unshard_group") != std::string::npos, e);
  });
}

}  // namespace
}  // namespace dmuon

namespace dmuon {
namespace {

// get_comm_plan's step_traffic (summarize_comm_plan's "step_traffic"): every collective of one training
// step that the broadcast-mode tables do not cover -- sharded_adamw (all-gathers, reduce-scatters, HSDP
// replicate all-reduces), the replicated buckets' all-reduces and the all_gather-mode dedicated units --
// equals what each group's counters measure in that step, per group and operation, exactly.
// A parameter dmuon trains that is frozen when Muon is built (staged unfreezing: the optimizer first, the
// layers later) is in its groups as torch's optimizer keeps model.parameters(): once unfrozen it trains as if it
// had never been frozen (float64, bit for bit against a run without the freeze). Before, Muon left it out of its
// groups and it took gradients without ever being updated, silently. A Muon matrix, a replicated and a
// sharded_adamw parameter.
TEST(RuntimeTest, AParameterFrozenWhenMuonIsBuiltTrainsOnceUnfrozen) {
  const GPTConfig cfg = small_config(2);
  const auto init = init_state(cfg, 21);
  const auto batches = make_batches(2, 8, 9, cfg.vocab_size, 6);
  for (const bool sharded : {false, true}) {
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      auto mesh = make_mesh(ctx);
      const testing::Layout layout{"N2", 2, 1, true, false, sharded};
      GPT staged = testing::make_gpt(cfg), plain = testing::make_gpt(cfg);
      load_state(staged, init);
      load_state(plain, init);
      testing::dedicate_gpt(staged, mesh, layout);
      testing::dedicate_gpt(plain, mesh, layout);
      const std::set<std::string> frozen{"layers.0.q_proj.weight", "layers.1.attn_norm.weight", "final_norm.weight"};
      auto set_frozen = [&](bool on) {
        for (auto& item : staged->named_parameters(true))
          if (frozen.count(item.key())) item.value().set_requires_grad(!on);
      };
      set_frozen(true);
      Muon opt(staged.ptr(), testing::muon_options({})), plain_opt(plain.ptr(), testing::muon_options({}));
      set_frozen(false);
      testing::train_slices(staged, opt, batches, ctx.rank, 4);
      testing::train_slices(plain, plain_opt, batches, ctx.rank, 4);
      StateDictOptions all;
      all.rank0_only = false;
      const TensorDict a = get_model_state_dict(*staged, all), b = get_model_state_dict(*plain, all);
      for (const auto& [k, v] : b) {
        EXPECT_TRUE(a.at(k).equal(v)) << k << (sharded ? " (sharded_adamw)" : "");
      }
      for (const std::string& k : frozen) EXPECT_FALSE(a.at(k).equal(init.at(k))) << k << " was trained";
    });
  }
}

TEST(RuntimeTest, StepTrafficPlanEqualsTheMeasuredBytesOfEveryGroup) {
  testing::Layout a;
  a.label = "1-D Z3 all_gather, sharded_adamw";
  a.unshard = "all_gather";
  a.sharded = true;
  testing::Layout b = a;
  b.label = "1-D Z2 all_gather on 3 ranks, replicated";
  b.world = 3;
  b.z3 = false;
  b.sharded = false;
  testing::Layout c = a;
  c.label = "HSDP 2x2 Z3 all_gather, sharded_adamw";
  c.world = 4;
  c.replicate = 2;
  testing::Layout d = b;
  d.label = "DDP path all_gather, replicated";
  d.world = 2;
  d.ddp = true;
  const models::GPTConfig cfg = testing::small_config(2);
  const auto batches = testing::make_batches(2, 12, 8, cfg.vocab_size, 3);
  for (const auto& l : {a, b, c, d}) {
    SCOPED_TRACE(l.label);
    testing::run_ranks(l.world, [&](testing::RankContext& ctx) {
      models::GPT m(cfg);
      auto mesh = testing::make_mesh(ctx, std::chrono::seconds(60), l.replicate);
      testing::dedicate_gpt(m, mesh, l);
      Muon opt(m.ptr(), testing::muon_options(testing::TrainConfig{}));
      const int64_t per = 12 / l.world;
      std::map<std::string, Communicator*> groups;  // by name: each distinct group once
      for (Communicator* g : {&mesh->world(), &mesh->shard(), mesh->replicate(), mesh->replicate_publish(), &mesh->dp()})
        if (g) groups[g->name()] = g;
      std::map<std::string, CommCounters::Snapshot> before;
      for (size_t i = 0; i < batches.size(); ++i) {
        if (i == 1)  // the second step is measured (the first set up the forward order)
          for (auto& [name, g] : groups) before[name] = g->own_counters().snapshot();
        opt.zero_grad();
        m->loss(batches[i].narrow(0, ctx.rank * per, per)).backward();
        opt.step();
        wait_all_post_step_broadcasts(*m);
      }
      const ModelCommPlan plan = get_comm_plan(*m);
      testing::expect(!plan.step_traffic.empty(), "a plan");
      std::map<std::pair<std::string, int>, int64_t> planned, measured, planned_calls, measured_calls;
      int64_t sharded_calls = 0;  // sharded_adamw's collectives other than its all-gathers
      for (const PlannedTraffic& t : plan.step_traffic) {
        planned[{t.group, static_cast<int>(t.op)}] += t.bytes;
        planned_calls[{t.group, static_cast<int>(t.op)}] += t.calls;
        if (t.route == "sharded_adamw" && t.op != CommOp::AllGather) sharded_calls += t.calls;
      }
      for (auto& [name, g] : groups) {
        const auto now = g->own_counters().snapshot();
        for (int op = 0; op < static_cast<int>(CommOp::kCount); ++op)
          if (const int64_t n = now.bytes[static_cast<size_t>(op)] - before[name].bytes[static_cast<size_t>(op)]) {
            measured[{name, op}] = n;
            measured_calls[{name, op}] = now.calls[static_cast<size_t>(op)] - before[name].calls[static_cast<size_t>(op)];
          }
      }
      for (const auto& [key, n] : measured)
        testing::expect(planned.count(key) && planned.at(key) == n && planned_calls.at(key) == measured_calls.at(key),
                        "rank " + std::to_string(ctx.rank) + ": " + comm_op_name(static_cast<CommOp>(key.second)) +
                            " on " + key.first + ": measured " + std::to_string(n) + " bytes in " +
                            std::to_string(measured_calls.at(key)) + " calls, planned " +
                            std::to_string(planned.count(key) ? planned.at(key) : -1) + " in " +
                            std::to_string(planned_calls.count(key) ? planned_calls.at(key) : -1));
      if (l.sharded) {  // one reduce-scatter (and on HSDP one all-reduce) per boundary, not one per parameter
        int64_t params = 0;
        for (const auto& p : m->named_parameters())
          params += models::is_muon_matrix(p.key(), p.value()) ? 0 : 1;
        const int64_t per_boundary = l.replicate > 1 ? 2 : 1;
        // (1-D: 5 reduce-scatters for the 14 parameters of 5 boundaries; one per parameter before)
        testing::expect(sharded_calls > 0 && sharded_calls * 2 <= per_boundary * params,
                        "sharded_adamw's reduces per step: " + std::to_string(sharded_calls) + " for " +
                            std::to_string(params) + " parameters");
      }
      for (const auto& [key, n] : planned)
        testing::expect(n == 0 || measured.count(key), "planned but not measured: " +
                                                          std::string(comm_op_name(static_cast<CommOp>(key.second))) +
                                                          " on " + key.first);
      testing::expect(summarize_comm_plan(*m)["this_rank"]["step_traffic"].get<int64_t>() == plan.step_traffic_bytes(),
                      "summarize_comm_plan's step_traffic");
    });
  }
}

}  // namespace
}  // namespace dmuon
