// Tensor parallelism: the TP modules, TP-sharded Muon matrices on a (replicate x shard x tp) mesh,
// the TP Newton-Schulz exchange (gather / scatter and the distributed Gram form), its bytes, and the
// caller mistakes. Equivalence is against the independent single-process reference on the full
// model (support/training.h), in float64 with kFloat64Bound and in float32 with kFloat32Bound.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "dmuon/checkpoint.h"
#include "dmuon/dedicate.h"
#include "dmuon/diagnostics.h"
#include "dmuon/memory.h"
#include "dmuon/muon.h"
#include "dmuon/tensor_parallel.h"
#include "dmuon/model_view.h"
#include "runtime/runtime.h"
#include "support/training.h"

using namespace dmuon;
using namespace dmuon::testing;
using models::GPT;
using models::GPTConfig;

namespace {

struct TpLayout {
  int world = 2, replicate = 1, tp = 2;
  bool z3 = true;
  bool ddp = false;                 // dedicate_params_ddp_tp
  bool dgram = false;               // MuonOptions::tp_distributed_gram
  bool sharded = false;             // the non-matrix parameters on sharded_adamw
  std::string dgram_policy = "always";
  std::optional<bool> async;        // MuonOptions::replicate_async
  int accum = 1;
  bool no_sync = false;
  at::ScalarType dtype = at::kDouble;
  std::optional<LoopbackOptions> loopback;  // every group on dmuon's loopback backend (model and data on its device)
  // the mesh rebuilt by Mesh::from_groups over the groups of Mesh::create's (what `import dmuon` does with
  // torch's groups), and the runtime's full parameters (runtime_full_params: TP slices gathered) checked too
  bool from_groups = false;
};

// Mesh::from_groups over `made`'s own groups (world, shard, replicate, tp, dp): the layout checks and the
// wiring of a mesh whose groups the caller built. `made` keeps the groups alive.
std::shared_ptr<Mesh> mesh_from_groups_of(Mesh& made) {
  auto group = [](Communicator& c) { return MeshGroup{c.process_group(), c.global_ranks()}; };
  MeshGroups g{group(made.world()), group(made.shard()), std::nullopt, std::nullopt, std::nullopt};
  if (made.replicate()) g.replicate = group(*made.replicate());
  if (made.tp()) {
    g.tp = group(*made.tp());
    g.dp = group(made.dp());
  }
  MeshOptions o;
  o.timeout = made.timeout();
  o.process_group_policy = "shared";
  return Mesh::from_groups(g, o);
}

struct TpOutcome {
  double worst = 0;
  int gathered = 0, distributed = 0;  // TP-split matrices per path, summed over steps and ranks
};

TpOutcome check_tp_equivalence(const TpLayout& l) {
  const GPTConfig cfg = small_config(2);  // d_model 32, 4 heads, d_ff 48
  TrainConfig tc;
  tc.dtype = l.dtype;
  tc.steps = 6;
  tc.accum = l.accum;
  tc.no_sync = l.no_sync;
  const StateDict init = init_state(cfg, 11, tc.dtype);
  const int dp = l.world / l.tp;
  const int64_t global_batch = 8;
  const auto batches = make_batches(tc.steps, global_batch, 12, cfg.vocab_size, 5);
  const RefResult ref = reference_train(cfg, init, batches, tc);
  const double bound = equivalence_bound(tc.dtype);
  std::mutex mu;
  TpOutcome out;
  std::map<std::string, int> checked;  // "name@t" -> times checked on an owner
  run_ranks(l.world, [&](RankContext& ctx) {
    auto made = make_mesh(ctx, std::chrono::seconds(60), l.replicate, l.tp);
    auto mesh = l.from_groups ? mesh_from_groups_of(*made) : made;
    GPTConfig c = cfg;
    c.tp_mesh = mesh;
    GPT m(c);
    load_state(m, init);
    if (!ctx.device.is_cpu()) m->to(ctx.device);
    DedicateOptions o;
    o.reshard_after_forward = l.z3;
    o.plan.pack_small_params = false;
    if (l.sharded)
      o.route_hint_fn = [](const std::string& n, const at::Tensor& p) -> std::string {
        return models::is_muon_matrix(n, p) ? "" : "sharded_adamw";
      };
    if (l.ddp)
      dedicate_params_ddp_tp(m.ptr(), mesh, models::is_muon_matrix, o);
    else
      dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o);
    replicate_tp(m.ptr(), mesh);
    MuonOptions mo = muon_options(tc);
    mo.tp_distributed_gram = l.dgram;
    mo.tp_distributed_gram_policy = l.dgram_policy;
    mo.replicate_async = l.async;
    mo.record_step_profile = true;
    Muon opt(m.ptr(), mo);
    const int dp_rank = mesh->replicate_rank() * mesh->shard_size() + mesh->shard_rank();
    const int64_t per = global_batch / dp, micro = per / l.accum;
    int gathered = 0, distributed = 0;
    for (const auto& tokens : batches) {
      opt.zero_grad();
      const at::Tensor mine = tokens.narrow(0, dp_rank * per, per).to(ctx.device);
      for (int a = 0; a < l.accum; ++a) {
        std::optional<NoSync> ns;
        if (l.no_sync && a + 1 < l.accum) ns.emplace(*m);
        (m->loss(mine.narrow(0, a * micro, micro)) / l.accum).backward();
      }
      opt.step();
      const StepProfile prof = opt.consume_last_step_profile();
      gathered += prof.tp_gathered;
      distributed += prof.tp_distributed;
    }
    // async publish (default): the last step's TP scatters land at the next forward or here; sync:
    // step() applied everything
    if (l.async.value_or(true)) wait_all_post_step_broadcasts(*m);
    const int T = mesh->tp_size(), t = mesh->tp_rank();
    auto want = [&](const StateDict& sd, const std::string& name, int dim) {
      const at::Tensor& full = sd.at(name);
      return dim >= 0 ? tp_slice(full, dim, t, T) : full;
    };
    double worst = 0;
    auto within = [&](double e, const std::string& what) {
      worst = std::max(worst, e);
      expect(e <= bound, what + ": relative difference " + std::to_string(e) + " above " + std::to_string(bound));
    };
    for (const auto& d : get_dedicated_params(*m)) {
      expect(d.tp_owner >= 0 && d.tp_owner < T, "TP owner of " + d.name);
      expect(d.tp_split_dim >= 0, d.name + " should be TP-split");
      const bool holder = d.owner.shard == mesh->shard_rank();
      if (!d.is_owner) {
        if (l.ddp || (l.replicate > 1 && holder))
          within(max_rel(d.param, want(ref.params, d.name, d.tp_split_dim)), d.name + " (published copy)");
        else
          expect(d.param.numel() == 0, "non-owner holds data between steps for " + d.name);
        continue;
      }
      within(max_rel(d.param, want(ref.params, d.name, d.tp_split_dim)), d.name);
      const auto* st = opt.state_of(d.param);
      expect(st && st->momentum_buffer().defined(), "no momentum for " + d.name);
      within(max_rel(st->momentum_buffer(), want(ref.momentum, d.name, d.tp_split_dim)), d.name + " momentum");
      std::lock_guard<std::mutex> g(mu);
      checked[d.name + "@" + std::to_string(t)]++;
    }
    for (const auto& [name, p] : get_base_params(*m)) within(max_rel(p, ref.params.at(name)), name + " (AdamW)");
    if (l.sharded) {  // each TP position's slices of the embedding, norms and head, gathered by the state dict
      StateDictOptions all_ranks;
      all_ranks.rank0_only = false;
      const TensorDict sd = get_model_state_dict(*m, all_ranks);
      int n = 0;
      for (const auto& [name, v] : ref.params) {
        if (models::is_muon_matrix(name, v)) continue;
        within(max_rel(sd.at(name), v), name + " (sharded_adamw)");
        ++n;
      }
      expect(n > 0 && get_base_params(*m).empty(), "every non-matrix parameter is on sharded_adamw");
    }
    if (l.from_groups) {  // every parameter's full value on every rank: TP slices gathered over the TP group
      const auto full = runtime_full_params(dmuon::detail::state_of_model(m.ptr().get()));
      expect(full.size() == ref.params.size(), "runtime_full_params gives every trainable parameter");
      for (const auto& [name, v] : full) within(max_rel(v, ref.params.at(name)), name + " (runtime_full_params)");
    }
    std::lock_guard<std::mutex> g(mu);
    out.worst = std::max(out.worst, worst);
    out.gathered += gathered;
    out.distributed += distributed;
  }, std::chrono::seconds(60), l.loopback);
  int muon = 0;
  for (const auto& [k, v] : ref.params) muon += models::is_muon_matrix(k, v) ? 1 : 0;
  EXPECT_EQ(static_cast<int>(checked.size()), muon * l.tp);  // every slice checked once, on its owner
  for (const auto& [k, n] : checked) EXPECT_EQ(n, 1) << k;
  std::fprintf(stderr, "[tp equivalence] worst relative difference %.2e (bound %.0e)\n", out.worst, bound);
  return out;
}

}  // namespace

TEST(TpModules, InitialisationEqualsSlicingTheSingleProcessInit) {
  std::mutex rng;  // the ranks are threads of one process: one global RNG
  run_ranks(2, [&](RankContext& ctx) {
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), 1, 2);
    std::lock_guard<std::mutex> g(rng);
    at::manual_seed(3);
    torch::nn::Linear full(torch::nn::LinearOptions(6, 8).bias(true));
    at::manual_seed(3);
    ColumnParallelLinear col(ParallelLinearOptions(6, 8).with_bias(true), mesh);
    const int t = mesh->tp_rank();
    expect(at::equal(col->weight, full->weight.narrow(0, 4 * t, 4)), "column weight slice");
    expect(at::equal(col->bias, full->bias.narrow(0, 4 * t, 4)), "column bias slice");
    at::manual_seed(4);
    torch::nn::Linear full_row(torch::nn::LinearOptions(8, 6).bias(true));
    at::manual_seed(4);
    RowParallelLinear row(ParallelLinearOptions(8, 6).with_bias(true), mesh);
    expect(at::equal(row->weight, full_row->weight.narrow(1, 4 * t, 4)), "row weight slice");
    expect(at::equal(row->bias, full_row->bias), "row bias is whole");
    const auto split = tp_split_dims(*col);
    expect(split.size() == 2 && split.at("weight") == 0 && split.at("bias") == 0, "column split dims");
  });
}

TEST(TpModules, ColumnThenRowEqualsTheFullLayersInValueAndGradient) {
  // y = W2 silu(W1 x + b1) + b2 in float64: the TP pair against the full layers, forward and backward
  at::manual_seed(7);
  const at::Tensor W1 = at::randn({8, 5}, at::kDouble), b1 = at::randn({8}, at::kDouble);
  const at::Tensor W2 = at::randn({3, 8}, at::kDouble), b2 = at::randn({3}, at::kDouble);
  const at::Tensor x0 = at::randn({4, 5}, at::kDouble);
  at::Tensor fx = x0.clone().requires_grad_(true), fW1 = W1.clone().requires_grad_(true),
             fW2 = W2.clone().requires_grad_(true);
  at::Tensor fy = at::linear(at::silu(at::linear(fx, fW1, b1)), fW2, b2);
  fy.pow(2).sum().backward();
  run_ranks(2, [&](RankContext& ctx) {
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), 1, 2);
    const int t = mesh->tp_rank();
    ColumnParallelLinear col(ParallelLinearOptions(5, 8).with_bias(true), mesh);
    RowParallelLinear row(ParallelLinearOptions(8, 3).with_bias(true), mesh);
    col->to(at::kDouble);
    row->to(at::kDouble);
    {
      at::NoGradGuard ng;
      col->weight.copy_(tp_slice(W1, 0, t, 2));
      col->bias.copy_(tp_slice(b1, 0, t, 2));
      row->weight.copy_(tp_slice(W2, 1, t, 2));
      row->bias.copy_(b2);
    }
    at::Tensor x = x0.clone().requires_grad_(true);
    at::Tensor y = row(at::silu(col(x)));
    y.pow(2).sum().backward();
    expect(max_rel(y, fy) < 1e-12, "forward value");
    expect(max_rel(x.grad(), fx.grad()) < 1e-12, "input gradient (summed over TP)");
    expect(max_rel(col->weight.grad(), tp_slice(fW1.grad(), 0, t, 2)) < 1e-12, "column weight gradient");
    expect(max_rel(row->weight.grad(), tp_slice(fW2.grad(), 1, t, 2)) < 1e-12, "row weight gradient");
  });
}

// The same over a mesh built by Mesh::from_groups (the Python front end's way), HSDP 2 x 1 x TP 2 and
// DP 2 x TP 2: the layout accepted, the TP and DP groups wired, full parameters gathered over TP.
TEST(TpEquivalence, FromGroupsDp2Tp2Z3AndHsdp2Tp2) {
  TpLayout l;
  l.world = 4;
  l.from_groups = true;
  EXPECT_GT(check_tp_equivalence(l).gathered, 0);
  l.replicate = 2;
  EXPECT_GT(check_tp_equivalence(l).gathered, 0);
}

TEST(TpEquivalence, Tp2GatherZ3) {
  TpLayout l;
  const auto r = check_tp_equivalence(l);
  EXPECT_GT(r.gathered, 0);
  EXPECT_EQ(r.distributed, 0);
}

// TP 2 x DP 2 (Z3, gather and distributed Gram) through dmuon's loopback backend: on the CPU here, on
// CUDA tensors where a GPU is present (its own stream per group, a sleep before every copy).
TEST(TpEquivalence, LoopbackCpuDp2Tp2Z3DistributedGram) {
  TpLayout l;
  l.world = 4;
  l.dgram = true;
  l.loopback = LoopbackOptions{};
  const auto r = check_tp_equivalence(l);
  EXPECT_GT(r.distributed, 0);
}

TEST(TpEquivalence, LoopbackCudaDp2Tp2Z3DistributedGram) {
  if (!DMUON_WITH_CUDA) GTEST_SKIP() << "this dmuon build has no CUDA (CPU LibTorch)";
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
  TpLayout l;
  l.world = 4;
  l.dgram = true;
  LoopbackOptions lo;
  lo.device = at::Device(at::kCUDA, 0);
  lo.sleep_cycles = 200000;
  l.loopback = lo;
  const auto r = check_tp_equivalence(l);
  EXPECT_GT(r.distributed, 0);
}

TEST(TpEquivalence, Tp2SyncPublishNeedsNoWait) {
  TpLayout l;
  l.async = false;
  check_tp_equivalence(l);
}

TEST(TpEquivalence, Tp2DistributedGram) {
  TpLayout l;
  l.dgram = true;
  const auto r = check_tp_equivalence(l);
  // q/k/v (32 x 32 split by rows) need the gather; o, gate, up and down split along their long side
  EXPECT_GT(r.gathered, 0);
  EXPECT_GT(r.distributed, 0);
}

TEST(TpEquivalence, Dp2Tp2Z2) {
  TpLayout l;
  l.world = 4;
  l.z3 = false;
  check_tp_equivalence(l);
}

TEST(TpEquivalence, Dp2Tp2Z3DistributedGramBeneficial) {
  TpLayout l;
  l.world = 4;
  l.dgram = true;
  l.dgram_policy = "beneficial";  // ratios: 2 * 32^2 / (48 * 32) = 1.33 (gate/up/down), 2 (o): all gathered
  const auto r = check_tp_equivalence(l);
  EXPECT_EQ(r.distributed, 0);
}

TEST(TpEquivalence, Dp2Tp2ShardedBaseParams) {
  TpLayout l;
  l.world = 4;
  l.sharded = true;
  check_tp_equivalence(l);
}

TEST(TpEquivalence, Dp2Tp2AccumulationInNoSync) {
  TpLayout l;
  l.world = 4;
  l.accum = 2;
  l.no_sync = true;
  check_tp_equivalence(l);
}

TEST(TpEquivalence, Dp2Tp2Float32) {
  TpLayout l;
  l.world = 4;
  l.dtype = at::kFloat;
  l.dgram = true;
  check_tp_equivalence(l);
}

TEST(TpEquivalence, Hsdp2x2Tp2AsyncPublish) {
  TpLayout l;
  l.world = 8;
  l.replicate = 2;
  l.async = true;
  check_tp_equivalence(l);
}

TEST(TpEquivalence, Hsdp2x2Tp2SyncPublishZ2DistributedGram) {
  TpLayout l;
  l.world = 8;
  l.replicate = 2;
  l.async = false;
  l.z3 = false;
  l.dgram = true;
  check_tp_equivalence(l);
}

TEST(TpEquivalence, DdpTpPath) {
  TpLayout l;
  l.world = 4;
  l.ddp = true;
  check_tp_equivalence(l);
}

TEST(TpBytes, StepExchangeEqualsTheSlicesOfTheOwnedMatrices) {
  // The TP exchange of one step, measured on the TP group, against what the plan says: every owned
  // split matrix whose TP owner is another rank sends its slice (gather) and receives it (scatter)
  // once; the distributed Gram form all-reduces only Gram matrices.
  for (bool dgram : {false, true}) {
    run_ranks(4, [&](RankContext& ctx) {
      auto mesh = make_mesh(ctx, std::chrono::seconds(60), 1, 2);
      GPTConfig c = small_config(2);
      c.tp_mesh = mesh;
      GPT m(c);
      load_state(m, init_state(small_config(2), 11, at::kDouble));
      DedicateOptions o;
      o.plan.pack_small_params = false;
      dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o);
      replicate_tp(m.ptr(), mesh);
      MuonOptions mo;
      mo.tp_distributed_gram = dgram;
      mo.tp_distributed_gram_policy = "always";
      Muon opt(m.ptr(), mo);
      const auto tokens = make_batches(1, 4, 12, c.vocab_size, 5)[0];
      m->loss(tokens.narrow(0, 2 * mesh->shard_rank(), 2)).backward();
      prepare_muon_grads(*m);  // the reduces complete before the measured window
      Communicator& tp = *mesh->tp();
      const auto before = tp.own_counters().snapshot();
      opt.step();
      const auto after = tp.own_counters().snapshot();
      auto delta = [&](CommOp op) {
        return after.bytes[static_cast<int>(op)] - before.bytes[static_cast<int>(op)];
      };
      int64_t slices = 0, gram = 0;
      for (const auto& d : get_dedicated_params(*m)) {
        if (!d.is_owner) continue;
        const bool dist = dgram && ((d.full_shape[0] > d.full_shape[1]) ? d.tp_split_dim == 0 : d.tp_split_dim == 1);
        if (dist) {
          const int64_t mm = std::min(d.full_shape[0], d.full_shape[1]);
          gram += 1 + 2 * mm * mm;  // |X|^2, then the Gram matrix at the start and at the restart (step 2)
        } else if (d.tp_owner != mesh->tp_rank()) {
          slices += d.param.numel() * 8;
        }
      }
      expect(delta(CommOp::Gather) == slices, "gather bytes " + std::to_string(delta(CommOp::Gather)) +
                                                  " != " + std::to_string(slices));
      expect(delta(CommOp::Scatter) == slices, "scatter bytes " + std::to_string(delta(CommOp::Scatter)) +
                                                   " != " + std::to_string(slices));
      // all-reduce convention: 2 (T-1) / T * S = S for T = 2
      expect(delta(CommOp::AllReduce) == gram * 8, "Gram all-reduce bytes " +
                                                       std::to_string(delta(CommOp::AllReduce)) + " != " +
                                                       std::to_string(gram * 8));
      expect(delta(CommOp::Broadcast) == 0, "no broadcast over TP for split matrices");
      // the comm plan's figure for the gather form (what summarize_comm_plan reports as this_rank.tp)
      if (!dgram) {
        const ModelCommPlan cp = get_comm_plan(*m);
        expect(cp.tp_bytes() == 2 * slices, "planned TP bytes " + std::to_string(cp.tp_bytes()) + " != measured " +
                                                std::to_string(2 * slices));
        expect(summarize_comm_plan(*m)["this_rank"]["tp"].get<int64_t>() == 2 * slices, "summarize_comm_plan tp");
      }
    });
  }
}

// tp_buffer_reuse: the TP exchange's scratch kept across steps. Every policy trains exactly as "off" (float64,
// same operations on the same values), and the counting allocator sees, per step and rank, exactly the
// allocations the kept slots replace: "gather" the TP owner's gather buffer and full matrix (2 per matrix
// it orthogonalises), "scatter" every holder's receive buffer and the TP owner's send buffer (1 + 1).
TEST(TpBuffers, ReuseTrainsTheSameAndSavesExactlyTheKeptAllocations) {
  namespace mem = dmuon::memory;
  mem::install_counting_allocator();
  const GPTConfig cfg = small_config(2);
  const StateDict init = init_state(cfg, 11, at::kDouble);
  const int steps = 4;
  const auto batches = make_batches(steps, 8, 12, cfg.vocab_size, 5);
  struct Run {
    std::map<std::string, at::Tensor> params;  // "name@rank" after training
    std::vector<int64_t> step_allocations;     // per rank: allocations inside step() of steps 2..4
    std::vector<int64_t> gather_saving, scatter_saving;  // per rank, per step: what the plan says each saves
  };
  auto train = [&](const std::string& policy) {
    Run out;
    out.step_allocations.assign(4, 0);
    out.gather_saving.assign(4, 0);
    out.scatter_saving.assign(4, 0);
    std::mutex mu;
    run_ranks(4, [&](RankContext& ctx) {
      mem::MemoryTag tag(ctx.rank + 1);
      auto mesh = make_mesh(ctx, std::chrono::seconds(60), 1, 2);
      GPTConfig c = cfg;
      c.tp_mesh = mesh;
      GPT m(c);
      load_state(m, init);
      DedicateOptions o;
      o.plan.pack_small_params = false;
      o.tp_buffer_reuse = policy;
      dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o);
      replicate_tp(m.ptr(), mesh);
      MuonOptions mo;
      mo.lr = 0.02;
      Muon opt(m.ptr(), mo);
      int64_t allocations = 0;
      for (int i = 0; i < steps; ++i) {
        opt.zero_grad();
        m->loss(batches[static_cast<size_t>(i)].narrow(0, 4 * mesh->shard_rank(), 4)).backward();
        prepare_muon_grads(*m);
        const int64_t before = mem::stats().allocations;
        opt.step();
        if (i > 0) allocations += mem::stats().allocations - before;  // step 1 allocates what is kept
      }
      wait_all_post_step_broadcasts(*m);
      int64_t gather = 0, scatter = 0;
      for (const auto& d : get_dedicated_params(*m)) {
        if (!d.is_owner) continue;
        const bool tp_owner = d.tp_owner == mesh->tp_rank();
        gather += tp_owner ? 2 : 0;
        scatter += 1 + (tp_owner ? 1 : 0);
      }
      std::lock_guard<std::mutex> g(mu);
      for (const auto& [name, p] : get_base_params(*m)) out.params[name + "@" + std::to_string(ctx.rank)] = p.clone();
      for (const auto& d : get_dedicated_params(*m))
        if (d.is_owner) out.params[d.name + "@" + std::to_string(ctx.rank)] = d.param.clone();
      out.step_allocations[static_cast<size_t>(ctx.rank)] = allocations;
      out.gather_saving[static_cast<size_t>(ctx.rank)] = gather;
      out.scatter_saving[static_cast<size_t>(ctx.rank)] = scatter;
    });
    return out;
  };
  const Run off = train("off");
  int64_t kept_matrices = 0;
  for (int r = 0; r < 4; ++r) kept_matrices += off.gather_saving[static_cast<size_t>(r)];
  ASSERT_GT(kept_matrices, 0) << "the layout gives some rank a TP-owned split matrix";
  for (const std::string policy : {"gather", "scatter", "all"}) {
    const Run run = train(policy);
    ASSERT_EQ(run.params.size(), off.params.size());
    double worst = 0;
    for (const auto& [key, p] : off.params) worst = std::max(worst, max_rel(run.params.at(key), p));
    EXPECT_LE(worst, kFloat64Bound) << policy;
    for (int r = 0; r < 4; ++r) {
      const auto i = static_cast<size_t>(r);
      const int64_t per_step = (policy != "scatter" ? off.gather_saving[i] : 0) +
                               (policy != "gather" ? off.scatter_saving[i] : 0);
      EXPECT_EQ(off.step_allocations[i] - run.step_allocations[i], (steps - 1) * per_step)
          << policy << " rank " << r << ": " << off.step_allocations[i] << " allocations in steps 2.." << steps
          << " without reuse, " << run.step_allocations[i] << " with";
    }
    std::fprintf(stderr, "[tp_buffer_reuse %s] worst relative difference to \"off\" %.2e\n", policy.c_str(), worst);
  }
}

TEST(TpBuffers, AnUnknownPolicyIsRefusedNamingTheChoices) {
  run_ranks(2, [&](RankContext& ctx) {
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), 1, 2);
    GPTConfig c = small_config(2);
    c.tp_mesh = mesh;
    GPT m(c);
    DedicateOptions o;
    o.tp_buffer_reuse = "both";
    const std::string e = error_of([&] { dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o); });
    expect(e.find("tp_buffer_reuse is 'both'") != std::string::npos && e.find("\"scatter\"") != std::string::npos &&
               e.find("rank " + std::to_string(ctx.rank)) != std::string::npos,
           "error: " + e);
  });
}

TEST(TpErrors, SplitDimensionNotDivisible) {
  run_ranks(2, [](RankContext& ctx) {
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), 1, 2);
    const std::string e = error_of([&] { ColumnParallelLinear(ParallelLinearOptions(4, 5), mesh); });
    expect(e.find("out_features (5) is not divisible by the mesh's tp_size 2") != std::string::npos, e);
    const std::string e2 = error_of([&] { RowParallelLinear(ParallelLinearOptions(7, 4), mesh); });
    expect(e2.find("in_features (7)") != std::string::npos, e2);
    GPTConfig c = small_config(1);
    c.n_heads = 1;
    c.tp_mesh = mesh;
    const std::string e3 = error_of([&] { GPT g(c); });
    expect(e3.find("n_heads 1 is not divisible by the mesh's tp_size 2") != std::string::npos, e3);
  });
}

TEST(TpErrors, TpSizeNotDividingTheWorld) {
  run_ranks(4, [](RankContext& ctx) {
    const std::string e = error_of([&] { make_mesh(ctx, std::chrono::seconds(10), 1, 3); });
    expect(e.find("tp_size 3 does not divide the world size 4") != std::string::npos, e);
  });
}

// Mesh::from_groups with the TP and DP groups swapped (a (shard, tp) mesh read in the wrong order): the
// first mismatching group is named with the layout it needs; a tp group without its dp group is refused.
TEST(TpErrors, FromGroupsWithSwappedTpAndDpAxes) {
  run_ranks(4, [](RankContext& ctx) {
    auto made = make_mesh(ctx, std::chrono::seconds(60), 1, 2);
    auto group = [](Communicator& c) { return MeshGroup{c.process_group(), c.global_ranks()}; };
    MeshGroups g{group(made->world()), group(made->shard()), std::nullopt, group(made->dp()), group(*made->tp())};
    std::string e = error_of([&] { Mesh::from_groups(g, {}); });
    expect(e.find("rank " + std::to_string(ctx.rank)) != std::string::npos && e.find("1 x 2 x 2 mesh") != std::string::npos &&
               e.find("(replicate_rank x 2 + shard_rank) x 2 + tp_rank") != std::string::npos, e);
    g.dp.reset();
    e = error_of([&] { Mesh::from_groups(g, {}); });
    expect(e.find("needs both its tp group and its dp group") != std::string::npos, e);
  });
}

TEST(TpErrors, ModuleOfAnotherMeshAndReplicateOfASlice) {
  run_ranks(2, [](RankContext& ctx) {
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), 1, 2);
    auto other = make_mesh(ctx, std::chrono::seconds(60), 1, 2);
    {
      GPTConfig c = small_config(1);
      c.tp_mesh = other;
      GPT m(c);
      const std::string e = error_of([&] { dedicate_params(m.ptr(), mesh, models::is_muon_matrix); });
      expect(e.find("tensor-parallel module 'layers.0.q_proj' was built on another mesh") != std::string::npos, e);
    }
    {
      auto net = std::make_shared<torch::nn::Module>();
      net->register_module("layers", torch::nn::ModuleList(ColumnParallelLinear(
                                         ParallelLinearOptions(4, 4).with_bias(true), mesh)));
      dedicate_params(net, mesh, [](const std::string& n, const at::Tensor&) { return n.find("weight") != n.npos; });
      const std::string e = error_of([&] { replicate(net, mesh); });
      expect(e.find("parameter 'layers.0.bias'") != std::string::npos && e.find("replicate_tp") != std::string::npos, e);
      replicate_tp(net, mesh);
      const auto g = get_replicated_group(*net);
      expect(g && g->tp && g->names.size() == 1 && g->tp_split_dims[0] == 0 && g->group_size == 1,
             "get_replicated_group after replicate_tp");
    }
  });
}

TEST(TpErrors, TpModuleRunOutsideItsBoundary) {
  run_ranks(4, [](RankContext& ctx) {
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), 1, 2);
    GPTConfig c = small_config(1);
    c.tp_mesh = mesh;
    GPT m(c);
    DedicateOptions o;
    o.plan.pack_small_params = false;
    dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o);
    replicate_tp(m.ptr(), mesh);
    for (const auto& d : get_dedicated_params(*m)) {
      if (d.is_owner || d.name != "layers.0.q_proj.weight") continue;
      const std::string e = error_of([&] { m->blocks[0]->q_proj(at::zeros({1, 2, 32})); });
      expect(e.find("0-element placeholder") != std::string::npos && e.find("dmuon::forward") != std::string::npos, e);
    }
  });
}

namespace {
// One TP or non-TP rank of the checkpoint test: a GPT on a mesh with `tp` TP ranks, dedicated and
// replicated, trained on the batches [from, to) (each DP rank its slice).
struct CkptRank {
  std::shared_ptr<Mesh> mesh;
  GPT model{nullptr};
  std::unique_ptr<Muon> opt;
  CkptRank(RankContext& ctx, int tp, const StateDict& init, const TrainConfig& tc) {
    mesh = make_mesh(ctx, std::chrono::seconds(60), 1, tp);
    GPTConfig c = small_config(2);
    if (tp > 1) c.tp_mesh = mesh;
    model = GPT(c);
    load_state(model, init);
    DedicateOptions o;
    o.plan.pack_small_params = false;
    dedicate_params(model.ptr(), mesh, models::is_muon_matrix, o);
    TORCH_CHECK(replicate_tp(model.ptr(), mesh).get() == model.ptr().get(), "replicate_tp returns the model");
    opt = std::make_unique<Muon>(model.ptr(), muon_options(tc));
  }
  void train(const std::vector<at::Tensor>& batches, size_t from, size_t to) {
    const int dp = mesh->data_parallel_size(), dp_rank = mesh->shard_rank();
    for (size_t i = from; i < to; ++i) {
      opt->zero_grad();
      const int64_t per = batches[i].size(0) / dp;
      model->loss(batches[i].narrow(0, dp_rank * per, per)).backward();
      opt->step();
    }
  }
  // every owned slice (and its momentum) against the full reference
  void check(const RefResult& ref, double bound) {
    wait_all_post_step_broadcasts(*model);  // the last step's TP scatters land
    const int T = mesh->tp_size(), t = mesh->tp_rank();
    for (const auto& d : get_dedicated_params(*model)) {
      if (!d.is_owner) continue;
      auto want = [&](const at::Tensor& full) { return d.tp_split_dim >= 0 ? tp_slice(full, d.tp_split_dim, t, T) : full; };
      const double e = max_rel(d.param, want(ref.params.at(d.name)));
      expect(e <= bound, d.name + " after resume: " + std::to_string(e));
      const double em = max_rel(opt->state_of(d.param)->momentum_buffer(), want(ref.momentum.at(d.name)));
      expect(em <= bound, d.name + " momentum after resume: " + std::to_string(em));
    }
    for (const auto& [name, p] : get_base_params(*model))
      expect(max_rel(p, ref.params.at(name)) <= bound, name + " after resume");
  }
};
}  // namespace

TEST(TpCheckpoint, FullTensorsThatResumeWithAndWithoutTp) {
  const GPTConfig cfg = small_config(2);
  TrainConfig tc;
  tc.steps = 6;
  const StateDict init = init_state(cfg, 11, at::kDouble);
  const auto batches = make_batches(6, 4, 12, cfg.vocab_size, 5);
  const RefResult ref3 = reference_train(cfg, init, {batches.begin(), batches.begin() + 3}, tc);
  const RefResult ref6 = reference_train(cfg, init, batches, tc);
  const double bound = equivalence_bound(at::kDouble);
  const std::string dir = fresh_temp_dir("dmuon-tp-ckpt");
  // {saving layout, resuming layout}: TP 2 x DP 2 -> DP 2, and DP 2 -> TP 2 x DP 2
  for (const auto& [save_tp, load_tp] : {std::pair{2, 1}, std::pair{1, 2}}) {
    const std::string path = dir + "/ckpt_tp" + std::to_string(save_tp) + ".pt";
    run_ranks(2 * save_tp, [&](RankContext& ctx) {
      CkptRank r(ctx, save_tp, init, tc);
      StateDictOptions all_ranks;
      all_ranks.rank0_only = false;  // every rank checks its full copy
      {  // before the first step: a template of fresh state in full shapes (TP: not the slices), loadable
        const OptimizerStateDict t = get_optimizer_state_dict(*r.model, *r.opt, all_ranks);
        expect(t.muon.size() == 2 * ref3.momentum.size(), "the template lists every matrix");
        for (const auto& [k, v] : ref3.momentum) {
          const at::Tensor& m = t.muon.at(k + ".momentum_buffer");
          expect(m.sizes() == v.sizes() && m.count_nonzero().item<int64_t>() == 0, "the template's momentum of " + k);
        }
        set_optimizer_state_dict(*r.model, *r.opt, t);  // fresh state: the steps below match the reference
      }
      r.train(batches, 0, 3);
      const TensorDict msd = get_model_state_dict(*r.model, all_ranks);
      const OptimizerStateDict osd = get_optimizer_state_dict(*r.model, *r.opt, all_ranks);
      for (const auto& [k, v] : ref3.params) {  // full tensors, equal to the reference after 3 steps
        expect(msd.count(k) && msd.at(k).sizes() == v.sizes(), "state dict entry " + k + " is not full");
        expect(max_rel(msd.at(k), v) <= bound, "state dict " + k);
      }
      for (const auto& [k, v] : ref3.momentum)
        expect(max_rel(osd.muon.at(k + ".momentum_buffer"), v) <= bound, "momentum in the state dict: " + k);
      if (ctx.rank == 0) save_checkpoint(path, msd, &osd);
    });
    run_ranks(2 * load_tp, [&](RankContext& ctx) {
      CkptRank r(ctx, load_tp, init_state(cfg, 99, at::kDouble), tc);  // other values: the load must replace them
      const Checkpoint ck = load_checkpoint(path);
      set_model_state_dict(*r.model, ck.model);
      set_optimizer_state_dict(*r.model, *r.opt, *ck.optim);
      expect(r.opt->steps_taken() == 3, "steps taken after resume");
      r.train(batches, 3, 6);
      r.check(ref6, bound);
    });
  }
}
