// Gradient-norm clipping (include/dmuon/grad_clip.h): the norms every layout computes against the
// single-process norm of the whole model (float64), the scopes, and non-finite gradients; and dynamic
// loss scaling (include/dmuon/grad_scaler.h), which unscales and checks the same gradients.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dmuon/checkpoint.h"
#include "dmuon/dedicate.h"
#include "dmuon/grad_clip.h"
#include "dmuon/grad_scaler.h"
#include "dmuon/muon.h"
#include "dmuon/tensor_parallel.h"
#include "support/training.h"

using namespace dmuon;
using namespace dmuon::testing;
using models::GPT;
using models::GPTConfig;

namespace {

struct RefNorms {
  double all2 = 0, muon2 = 0, all_inf = 0;
  int64_t all_count = 0, muon_count = 0;
};

RefNorms reference_norms(const GPTConfig& cfg, const StateDict& init, const at::Tensor& tokens) {
  GPT m(cfg);
  load_state(m, init);
  m->loss(tokens).backward();
  RefNorms r;
  for (const auto& item : m->named_parameters(true)) {
    const at::Tensor g = item.value().grad();
    if (!g.defined()) continue;
    const double sq = g.pow(2).sum().item<double>();
    r.all2 += sq;
    r.all_inf = std::max(r.all_inf, g.abs().max().item<double>());
    ++r.all_count;
    if (models::is_muon_matrix(item.key(), item.value())) {
      r.muon2 += sq;
      ++r.muon_count;
    }
  }
  r.all2 = std::sqrt(r.all2);
  r.muon2 = std::sqrt(r.muon2);
  return r;
}

struct ClipLayout {
  std::string label;
  int world = 2, replicate = 1, tp = 1;
  bool sharded = false;
};

void check_norms(const ClipLayout& l) {
  SCOPED_TRACE(l.label);
  const GPTConfig cfg = small_config(2);
  const StateDict init = init_state(cfg, 5, at::kDouble);
  const at::Tensor tokens = make_batches(1, 24, 12, cfg.vocab_size, 3)[0];  // splits over 1, 2, 3, 4 and 8
  const RefNorms ref = reference_norms(cfg, init, tokens);
  run_ranks(l.world, [&](RankContext& ctx) {
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), l.replicate, l.tp);
    GPTConfig c = cfg;
    if (l.tp > 1) c.tp_mesh = mesh;
    GPT m(c);
    load_state(m, init);
    DedicateOptions o;
    o.plan.pack_small_params = false;
    if (l.sharded)
      o.route_hint_fn = [](const std::string& n, const at::Tensor& p) -> std::string {
        return models::is_muon_matrix(n, p) ? "" : "sharded_adamw";
      };
    dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o);
    replicate_tp(m.ptr(), mesh);
    Muon opt(m.ptr(), muon_options(TrainConfig{}));
    const int dp = mesh->data_parallel_size(), dp_rank = mesh->replicate_rank() * mesh->shard_size() + mesh->shard_rank();
    const int64_t per = tokens.size(0) / dp;
    m->loss(tokens.narrow(0, dp_rank * per, per)).backward();
    auto rel = [](double a, double b) { return std::abs(a - b) / b; };
    GradClipOptions all;
    all.scope = ClipScope::AllParams;
    const MuonGradClipStats s = opt.clip_grad_norm_(std::nullopt, all);  // stats only
    expect(rel(s.total_norm, ref.all2) < 1e-10, l.label + ": global norm " + std::to_string(s.total_norm) + " vs " +
                                                    std::to_string(ref.all2));
    expect(s.param_count == ref.all_count, "param_count " + std::to_string(s.param_count) + " vs " +
                                               std::to_string(ref.all_count));
    expect(!s.clipped && s.clip_coef == 1.0 && !s.found_inf, "stats only");
    GradClipOptions muon;
    const MuonGradClipStats sm = opt.clip_grad_norm_(std::nullopt, muon);
    expect(rel(sm.total_norm, ref.muon2) < 1e-10, "Muon-only norm");
    expect(sm.param_count == ref.muon_count, "Muon-only param_count");
    GradClipOptions inf = all;
    inf.norm_type = std::numeric_limits<double>::infinity();
    expect(rel(opt.clip_grad_norm_(std::nullopt, inf).total_norm, ref.all_inf) < 1e-10, "max norm");
    // clipping to half the norm: afterwards the norm is half (within the +1e-6 of PyTorch's formula:
    // coef = (n / 2) / (n + 1e-6), a relative 1e-6 / n off 0.5)
    const MuonGradClipStats c1 = opt.clip_grad_norm_(ref.all2 / 2, all);
    expect(c1.clipped && std::abs(c1.clip_coef - 0.5) < 1e-5, "clip coefficient");
    expect(opt.last_muon_grad_clip_stats() && opt.last_muon_grad_clip_stats()->clipped, "last stats");
    const MuonGradClipStats after = opt.clip_grad_norm_(std::nullopt, all);
    expect(rel(after.total_norm, ref.all2 / 2) < 1e-5, "norm after clipping");
    opt.step();  // the clipped gradients are the ones the step uses (and then they are gone)
  });
}

// A small GPT on a 1-D mesh, dedicated and replicated, with its optimizer.
struct TwoRanks {
  GPT model{nullptr};
  std::unique_ptr<Muon> opt;
  TwoRanks(RankContext& ctx, const GPTConfig& cfg, const StateDict& init) {
    auto mesh = make_mesh(ctx);
    model = GPT(cfg);
    load_state(model, init);
    dedicate_params(model.ptr(), mesh, models::is_muon_matrix);
    replicate(model.ptr(), mesh);
    opt = std::make_unique<Muon>(model.ptr(), muon_options(TrainConfig{}));
  }
};

}  // namespace

TEST(ClipTest, NormsEqualTheSingleProcessNormOnEveryLayout) {
  for (const ClipLayout& l : {ClipLayout{"N1", 1}, ClipLayout{"N2", 2}, ClipLayout{"N3", 3},
                              ClipLayout{"HSDP 2x2", 4, 2}, ClipLayout{"N2 sharded", 2, 1, 1, true},
                              ClipLayout{"HSDP 2x2 sharded", 4, 2, 1, true}, ClipLayout{"DP2 x TP2", 4, 1, 2},
                              ClipLayout{"TP2 sharded", 2, 1, 2, true}, ClipLayout{"N8 (idle ranks)", 8}})
    check_norms(l);
}

TEST(ClipTest, NonFiniteGradientsAreReportedOrRaisedOnEveryRank) {
  const GPTConfig cfg = small_config(1);
  const StateDict init = init_state(cfg, 5, at::kDouble);
  const at::Tensor tokens = make_batches(1, 4, 12, cfg.vocab_size, 3)[0];
  std::mutex mu;
  int raised = 0;
  run_ranks(2, [&](RankContext& ctx) {
    TwoRanks run(ctx, cfg, init);
    GPT& m = run.model;
    Muon& opt = *run.opt;
    // rank 1's loss is NaN, so every averaged gradient is
    const double f = ctx.rank == 1 ? std::numeric_limits<double>::quiet_NaN() : 1.0;
    (m->loss(tokens.narrow(0, 2 * ctx.rank, 2)) * f).backward();
    GradClipOptions o;
    o.scope = ClipScope::AllParams;
    const MuonGradClipStats s = opt.clip_grad_norm_(1.0, o);
    expect(s.found_inf && !s.clipped, "found_inf without scaling");
    o.error_if_nonfinite = true;
    const std::string e = error_of([&] { opt.clip_grad_norm_(1.0, o); });
    expect(e.find("clip_grad_norm_: the total norm of order 2 of the gradients is nan") != std::string::npos, e);
    std::lock_guard<std::mutex> g(mu);
    ++raised;
    opt.zero_grad();
  });
  EXPECT_EQ(raised, 2);
}

TEST(ClipTest, CustomStrategiesAreRegisteredAndUnknownOnesAreClearErrors) {
  // a strategy that halves every Muon gradient and reports the local count of counted gradients
  register_muon_grad_clip_strategy("halve", [](std::vector<ClipGrad>& grads, std::optional<double>,
                                               const GradClipOptions&, Mesh&) {
    MuonGradClipStats s;
    for (auto& g : grads) {
      g.grad.mul_(0.5);
      s.param_count += g.counted ? 1 : 0;
    }
    s.clip_coef = 0.5;
    s.clipped = true;
    return s;
  });
  const GPTConfig cfg = small_config(1);
  const StateDict init = init_state(cfg, 5, at::kDouble);
  const at::Tensor tokens = make_batches(1, 4, 12, cfg.vocab_size, 3)[0];
  run_ranks(2, [&](RankContext& ctx) {
    TwoRanks run(ctx, cfg, init);
    GPT& m = run.model;
    Muon& opt = *run.opt;
    m->loss(tokens.narrow(0, 2 * ctx.rank, 2)).backward();
    const double before = opt.clip_grad_norm_(std::nullopt).total_norm;
    GradClipOptions o;
    o.strategy = "halve";
    const MuonGradClipStats s = opt.clip_grad_norm_(1.0, o);
    expect(s.strategy == "halve" && s.clipped, "the custom strategy ran");
    const double after = opt.clip_grad_norm_(std::nullopt).total_norm;
    expect(std::abs(after - before / 2) < 1e-12 * before, "Muon gradients halved");
    o.strategy = "no_such";
    const std::string e = error_of([&] { opt.clip_grad_norm_(1.0, o); });
    expect(e.find("unknown strategy 'no_such'") != std::string::npos && e.find("halve") != std::string::npos, e);
    opt.zero_grad();
  });
  EXPECT_THROW(register_muon_grad_clip_strategy("global_norm", {}), c10::Error);
}

namespace {

// Two ranks of TwoRanks after one backward of a one-layer GPT; `fn` gets the optimizer and the
// single-process norms.
void after_backward_on_two_ranks(const std::function<void(Muon&, const RefNorms&)>& fn) {
  const GPTConfig cfg = small_config(1);
  const StateDict init = init_state(cfg, 5, at::kDouble);
  const at::Tensor tokens = make_batches(1, 4, 12, cfg.vocab_size, 3)[0];
  const RefNorms ref = reference_norms(cfg, init, tokens);
  run_ranks(2, [&](RankContext& ctx) {
    TwoRanks run(ctx, cfg, init);
    run.model->loss(tokens.narrow(0, 2 * ctx.rank, 2)).backward();
    fn(*run.opt, ref);
  });
}

}  // namespace

TEST(ClipTest, ForeachKernelsGiveTheReferenceNormAndScaling) {
  after_backward_on_two_ranks([](Muon& opt, const RefNorms& ref) {
    for (double p : {2.0, 1.0, 3.0, std::numeric_limits<double>::infinity()}) {
      GradClipOptions ref_o, fused_o;
      ref_o.scope = fused_o.scope = ClipScope::AllParams;
      ref_o.norm_type = fused_o.norm_type = p;
      ref_o.foreach = false;
      fused_o.foreach = true;
      const double a = opt.clip_grad_norm_(std::nullopt, ref_o).total_norm;
      const double b = opt.clip_grad_norm_(std::nullopt, fused_o).total_norm;
      // float64 gradients: per-tensor norms rounded once before they are combined
      expect(std::abs(a - b) <= 1e-12 * a, "foreach norm of order " + std::to_string(p) + ": " + std::to_string(b) +
                                               " vs " + std::to_string(a));
    }
    GradClipOptions fused;
    fused.scope = ClipScope::AllParams;
    fused.foreach = true;
    const MuonGradClipStats c = opt.clip_grad_norm_(ref.all2 / 4, fused);
    expect(c.clipped && std::abs(c.clip_coef - 0.25) < 1e-5, "foreach clip coefficient");
    fused.foreach = false;
    const double after = opt.clip_grad_norm_(std::nullopt, fused).total_norm;
    expect(std::abs(after - c.clip_coef * ref.all2) < 1e-10 * ref.all2, "foreach scaling");
    opt.zero_grad();
  });
}

TEST(ClipTest, BucketsAreClippedEachOnItsOwnNormOverTheGroup) {
  // rank r holds sharded pieces r+1 and 2r+1 (reduce) and a replicated copy of [3, 4] (local); rank 2
  // holds no sharded gradient at all
  run_ranks(3, [&](RankContext& ctx) {
    auto mesh = make_mesh(ctx);
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    const int r = ctx.rank;
    std::vector<at::Tensor> sharded;
    if (r < 2) sharded = {at::full({2, 3}, r + 1.0, f64), at::full({4}, 2.0 * r + 1, f64)};
    const at::Tensor rep = at::tensor({3.0, 4.0}, f64);
    const at::Tensor rep_copy = rep.clone();
    const std::vector<GradClipBucket> buckets = {
        {"sharded", sharded, true, {}}, {"replicated", {rep}, false, {rep_copy}}, {"empty", {}, true, {}}};
    // sum of squares: rank 0: 6*1 + 4*1 = 10; rank 1: 6*4 + 4*9 = 60 -> norm sqrt(70)
    const double sharded_norm = std::sqrt(70.0);
    const SegmentedGradClipResult res = clip_grad_norm_buckets_(buckets, 2.0, &mesh->world());
    expect(res.bucket_stats.size() == 3, "three buckets");
    const GradClipBucketStats& s = res.bucket_stats[0];
    expect(std::abs(s.total_norm - sharded_norm) < 1e-12, "sharded norm " + std::to_string(s.total_norm));
    expect(s.param_count == 4 && s.clipped && std::abs(s.clip_coef - 2.0 / (sharded_norm + 1e-6)) < 1e-15,
           "sharded stats");
    const GradClipBucketStats* rs = res.find("replicated");
    expect(rs && std::abs(rs->total_norm - 5.0) < 1e-15 && rs->param_count == 1, "replicated norm (local)");
    const double rc = 2.0 / (5.0 + 1e-6);
    expect(std::abs(rep[0].item<double>() - 3 * rc) < 1e-15 && std::abs(rep_copy[1].item<double>() - 4 * rc) < 1e-15,
           "replicated copies scaled by their own coefficient");
    if (r < 2) expect(std::abs(sharded[0][0][0].item<double>() - (r + 1.0) * s.clip_coef) < 1e-15, "sharded scaled");
    const GradClipBucketStats* es = res.find("empty");
    expect(es && es->total_norm == 0 && !es->clipped && es->clip_coef == 1.0 && es->param_count == 0, "empty bucket");
    expect(std::abs(res.total_norm.item<double>() - std::sqrt(70.0 + 25.0)) < 1e-12, "combined norm");
    expect(!res.fastpath && res.fallback_reason.has_value(), "CPU tensors take the reference math");
    // the fused kernels, asked for, give the same numbers
    const at::Tensor a = at::full({5}, 1.0 + r, f64), b = a.clone();
    BucketClipOptions fused;
    fused.foreach = true;
    fused.chunk_size = 3;  // one call per tensor
    const auto rf = clip_grad_norm_buckets_({{"x", {a}, true, {}}}, std::nullopt, &mesh->world(), fused);
    const auto rr = clip_grad_norm_buckets_({{"x", {b}, true, {}}}, std::nullopt, &mesh->world());
    expect(rf.fastpath && rf.bucket_stats[0].fastpath, "foreach=true takes the fused path");
    expect(std::abs(rf.bucket_stats[0].total_norm - rr.bucket_stats[0].total_norm) < 1e-12, "fused = reference");
    expect(std::abs(rr.bucket_stats[0].total_norm - std::sqrt(5.0 * (1 + 4 + 9))) < 1e-12, "closed form");
    // non-finite: reported, gradients left alone
    const at::Tensor nan_g = at::full({2}, r == 1 ? std::nan("") : 1.0, f64);
    const auto rn = clip_grad_norm_buckets_({{"nan", {nan_g}, true, {}}}, 1.0, &mesh->world());
    expect(rn.bucket_stats[0].found_inf && !rn.bucket_stats[0].clipped, "found_inf");
    if (r == 0) expect(nan_g[0].item<double>() == 1.0, "unscaled");
    // ranks that pass different buckets get an error, not a hang
    std::vector<GradClipBucket> odd = {{"a", {a}, true, {}}};
    if (r == 2) odd.push_back({"b", {}, false, {}});
    const std::string e = error_of([&] { clip_grad_norm_buckets_(odd, 1.0, &mesh->world()); });
    expect(e.find("clip_grad_norm_buckets_") != std::string::npos && e.find("same buckets") != std::string::npos, e);
    expect(error_of([&] { clip_grad_norm_buckets_({}, 1.0, nullptr, BucketClipOptions{int64_t{0}, {}}); })
                   .find("chunk_size must be > 0") != std::string::npos,
           "chunk_size checked");
  });
}

TEST(ClipTest, OptimizerBucketsGiveTheRegularMuonAndAdamwNorms) {
  after_backward_on_two_ranks([](Muon& opt, const RefNorms& ref) {
    // the replicated gradients, averaged and identical on both ranks: the "regular" bucket
    std::vector<at::Tensor> regular;
    for (const ClipGrad& c : opt.clip_grads(ClipScope::AllParams))
      if (!models::is_muon_matrix(c.name, c.grad)) regular.push_back(c.grad);
    const auto res = try_clip_optimizer_grad_norm_buckets_(opt, regular, {}, 1e9);
    expect(res.has_value(), "a result");
    const double regular_ref = std::sqrt(ref.all2 * ref.all2 - ref.muon2 * ref.muon2);
    expect(std::abs(res->find("muon")->total_norm - ref.muon2) < 1e-10 * ref.muon2, "muon bucket");
    expect(res->find("muon")->param_count == ref.muon_count, "muon count");
    expect(std::abs(res->find("regular")->total_norm - regular_ref) < 1e-10 * regular_ref, "regular bucket");
    expect(res->find("adamw")->param_count == 0, "no sharded gradients");
    expect(std::abs(res->total_norm.item<double>() - ref.all2) < 1e-10 * ref.all2, "combined = global norm");
    const auto& last = opt.last_muon_grad_clip_stats();
    expect(last && last->strategy == "segmented" && !last->clipped, "last stats");
    opt.step();
  });
}

// ---- dynamic loss scaling (grad_scaler.h) ----------------------------------------------------------
namespace {

// float64 and power-of-two scales: a scaled run's gradients are the unscaled ones exactly, so training
// with a GradScaler (its scale backed off by an overflow, then grown) equals the unscaled single-process
// reference to the float64 bound. The overflow is an inf in one Muon matrix's gradient on the last rank,
// which after the reduce only the matrix's owner holds: every rank skips it and backs off alike.
void check_scaled_training(const Layout& l) {
  SCOPED_TRACE(l.label);
  const GPTConfig cfg = small_config(2);
  TrainConfig tc;
  tc.steps = 4;
  const StateDict init = init_state(cfg, 1234, tc.dtype);
  const auto batches = make_batches(tc.steps, 12, 12, cfg.vocab_size, 99);
  const RefResult ref = reference_train(cfg, init, batches, tc);
  constexpr double kInit = 1024;
  run_ranks(l.world, [&](RankContext& ctx) {
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), l.replicate);
    GPT m(cfg);
    load_state(m, init);
    dedicate_gpt(m, mesh, l);
    Muon opt(m.ptr(), muon_options(tc));
    GradScalerOptions so;
    so.init_scale = kInit;
    so.growth_interval = 2;
    GradScaler scaler(so);
    const int dp = mesh->data_parallel_size(), dp_rank = mesh->replicate_rank() * mesh->shard_size() + mesh->shard_rank();
    const int64_t per = 12 / dp;
    auto local = [&] {
      StateDict v;
      for (const auto& p : m->named_parameters(true)) v[p.key()] = p.value().detach().clone();
      return v;
    };
    // the overflow
    at::Tensor target;
    for (const auto& p : m->named_parameters(true))
      if (!target.defined() && models::is_muon_matrix(p.key(), p.value())) target = p.value();
    const StateDict before = local();
    const bool poison = ctx.rank == l.world - 1;
    const unsigned hook = poison ? target.register_hook([](const at::Tensor& g) {
      return g * std::numeric_limits<double>::infinity();
    }) : 0;
    scaler.scale(m->loss(batches[0].narrow(0, dp_rank * per, per))).backward();
    if (poison) target.remove_hook(hook);
    expect(!scaler.step(opt), "the overflowed step is skipped");
    scaler.update();
    expect(scaler.get_scale() == kInit / 2, "backed off on every rank: " + std::to_string(scaler.get_scale()));
    expect(opt.steps_taken() == 0, "no step taken");
    for (const auto& [name, t] : local()) expect(at::equal(t, before.at(name)), name + " changed by a skipped step");
    // the gradients stay, unscaled (torch.amp.GradScaler's skip leaves them too), until zero_grad
    if (!l.sharded) {  // (a sharded_adamw parameter's gradient is its slice, outside .grad)
      const at::Tensor norm_grad = m->named_parameters(true)["final_norm.weight"].grad();
      expect(norm_grad.defined() && norm_grad.isfinite().all().item<bool>() && norm_grad.abs().sum().item<double>() > 0,
             "a skipped step keeps the gradients");
    }
    // training, unscaled by step() itself or by unscale_ first
    std::vector<double> scales;
    for (size_t s = 0; s < batches.size(); ++s) {
      opt.zero_grad();
      scaler.scale(m->loss(batches[s].narrow(0, dp_rank * per, per))).backward();
      if (s % 2) expect(!scaler.unscale_(opt), "finite gradients");
      expect(scaler.step(opt), "a finite step is taken");
      scaler.update();
      scales.push_back(scaler.get_scale());
    }
    expect(scales == std::vector<double>{kInit / 2, kInit, kInit, 2 * kInit}, "the scale grows every 2 clean steps");
    StateDictOptions full;
    full.rank0_only = false;
    const TensorDict got = get_model_state_dict(*m.ptr(), full);
    for (const auto& [name, want] : ref.params) {
      const double e = max_rel(got.at(name), want);
      expect(e <= kFloat64Bound, l.label + ": " + name + " differs from the reference by " + std::to_string(e));
    }
  });
}

}  // namespace

TEST(GradScalerTest, ScaledTrainingEqualsTheUnscaledReferenceAndOverflowsSkipOnEveryRank) {
  Layout n2;
  n2.label = "N2";
  Layout hsdp;
  hsdp.label = "HSDP 2x2 sharded_adamw";
  hsdp.world = 4;
  hsdp.replicate = 2;
  hsdp.sharded = true;
  for (const Layout& l : {n2, hsdp}) check_scaled_training(l);
}

TEST(GradScalerTest, MistakesAreClearErrorsAndDisabledPassesThrough) {
  for (const auto& [make, want] : std::vector<std::pair<std::function<void()>, std::string>>{
           {[] { GradScaler s(GradScalerOptions{0.0}); }, "init_scale must be a finite number > 0, got 0"},
           {[] { GradScaler s(GradScalerOptions{1024, 1.0}); }, "growth_factor must be a finite number > 1, got 1"},
           {[] { GradScaler s(GradScalerOptions{1024, 2.0, 1.0}); }, "backoff_factor must be in (0, 1), got 1"},
           {[] { GradScaler s(GradScalerOptions{1024, 2.0, 0.5, 0}); }, "growth_interval must be >= 1, got 0"},
           {[] { GradScaler s; s.update(); }, "update: no step() since the last update()"},
           {[] { GradScaler s; s.load(INFINITY, 0); }, "load: scale must be a finite number > 0, got inf"},
           {[] { GradScaler s; s.load(8, 2000); }, "growth_tracker must be in [0, growth_interval = 2000), got 2000"}}) {
    const std::string e = error_of(make);
    EXPECT_NE(e.find(want), std::string::npos) << e;
  }
  const GPTConfig cfg = small_config(1);
  const StateDict init = init_state(cfg, 5, at::kDouble);
  const at::Tensor tokens = make_batches(1, 4, 12, cfg.vocab_size, 3)[0];
  run_ranks(2, [&](RankContext& ctx) {
    TwoRanks run(ctx, cfg, init);
    GradScaler scaler;
    scaler.scale(run.model->loss(tokens.narrow(0, 2 * ctx.rank, 2))).backward();
    scaler.unscale_(*run.opt);
    const std::string twice = error_of([&] { scaler.unscale_(*run.opt); });
    expect(twice.find("rank " + std::to_string(ctx.rank) + ": GradScaler::unscale_: already called") != std::string::npos,
           twice);
    expect(scaler.step(*run.opt), "step");
    const std::string again = error_of([&] { scaler.step(*run.opt); });
    expect(again.find("GradScaler::step: already called since the last update()") != std::string::npos, again);
    scaler.update();
    // a backward that raised (a hook's error, an OOM) makes unscale_ refuse; the caller's retry after zero_grad
    // unscales (the refusal marked the scaler unscaled, and the retry then stepped with scaled gradients)
    at::Tensor norm_w = run.model->named_parameters(true)["final_norm.weight"];
    run.opt->zero_grad();
    run.model->loss(tokens.narrow(0, 2 * ctx.rank, 2)).backward();
    const at::Tensor unscaled = norm_w.grad().clone();
    run.opt->zero_grad();
    const unsigned hook = norm_w.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("boom"); });
    expect(!error_of([&] { scaler.scale(run.model->loss(tokens.narrow(0, 2 * ctx.rank, 2))).backward(); }).empty(),
           "the hook's error");
    norm_w.remove_hook(hook);
    const std::string refused = error_of([&] { scaler.unscale_(*run.opt); });
    expect(!refused.empty(), "unscale_ after a backward that raised");
    run.opt->zero_grad();
    scaler.scale(run.model->loss(tokens.narrow(0, 2 * ctx.rank, 2))).backward();
    expect(!scaler.unscale_(*run.opt), "the retry unscales");
    expect(norm_w.grad().equal(unscaled), "the retry's gradients are unscaled (the scale is a power of two)");
    expect(scaler.step(*run.opt), "the retry steps");
    scaler.update();
    GradScaler off(GradScalerOptions{1024, 2.0, 0.5, 2000, false});
    const at::Tensor loss = run.model->loss(tokens.narrow(0, 2 * ctx.rank, 2));
    expect(off.scale(loss).equal(loss), "disabled: the loss as it is");
    loss.backward();
    expect(!off.unscale_(*run.opt) && !off.unscale_(*run.opt), "disabled: unscale_ does nothing, twice too");
    expect(off.step(*run.opt), "disabled: steps");
    off.update();
    expect(off.get_scale() == 1024 && run.opt->steps_taken() == 3, "disabled: nothing else");
  });
}
