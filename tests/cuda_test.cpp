// The CUDA path: Newton-Schulz in the seed's GPU precisions against the float64 reference, the
// "auto" kernel, one-GPU training (NCCL, world size 1) against single-process CPU training, and the
// host reads per step. Built in every configuration; on a machine without a CUDA device (or a
// CPU-only LibTorch) every test skips, saying why. scripts/gpu_check.sh runs it on the GPU machine.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#if DMUON_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <chrono>
#include <cstdlib>
#include <optional>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "dmuon/bootstrap.h"
#include "dmuon/communicator.h"
#include "dmuon/mesh.h"
#include "dmuon/dedicate.h"
#include "dmuon/host_sync.h"
#include "dmuon/muon.h"
#include "dmuon/newton_schulz.h"
#include "dmuon/ns_graphs.h"
#include "model/gpt.h"
#include "ns/kernels.h"  // internal: what "auto" resolves to per shape
#include "support/env_guard.h"
#include "support/multirank.h"
#include "support/training.h"

namespace dmuon {
namespace {

#define DMUON_REQUIRE_CUDA()                                                                          \
  do {                                                                                                \
    if (!DMUON_WITH_CUDA) GTEST_SKIP() << "this dmuon build has no CUDA (CPU LibTorch)";             \
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";                             \
  } while (0)

const at::Device kGpu(at::kCUDA, 0);

// U f(S) V^T of the float64 SVD: what NS with these coefficients converges to (NEWTON_SCHULZ.md §8).
at::Tensor reference_ns(const at::Tensor& G, const Coefficients& coeffs) {
  const at::Tensor g = G.to(at::kDouble).cpu();
  auto [U, S, Vh] = at::linalg_svd(g, /*full_matrices=*/false);
  at::Tensor x = S / (g.norm().item<double>() + kDefaultNsEps);
  for (const auto& [a, b, c] : coeffs) {
    const at::Tensor x2 = x * x;
    x = x * (a + b * x2 + c * x2 * x2);
  }
  return at::matmul(U * x.unsqueeze(-2), Vh);
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor A = a.to(at::kDouble).cpu(), B = b.to(at::kDouble).cpu();
  return (A - B).norm().item<double>() / B.norm().item<double>();
}

// 1 - <G, W> / |G|_*: how far W is from the polar factor in the nuclear-norm sense.
double nuclear_gap(const at::Tensor& G, const at::Tensor& W) {
  const at::Tensor g = G.to(at::kDouble).cpu();
  return 1.0 - (g * W.to(at::kDouble).cpu()).sum().item<double>() / at::linalg_svdvals(g).sum().item<double>();
}

struct Shape {
  int64_t m, n;
};
const std::vector<Shape> kShapes = {{1024, 4096}, {4096, 1024}, {2048, 2048}};

// A captured graph replays the eager kernels on new data: bit-for-bit the eager result, one capture
// per (shape, dtype, steps), a replay per later call; a check_finite backend stays eager.
TEST(CudaTest, NsGraphReplayEqualsEagerBitForBit) {
  DMUON_REQUIRE_CUDA();
  at::manual_seed(9);
  NewtonSchulz ns("gram");
  ns.set_check_finite(false);
  NsGraphs graphs(ns);
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{8, 64, 256}, {512, 128}, {64, 64}}) {
    for (int call = 0; call < 3; ++call) {
      const at::Tensor G = at::randn(shape, at::TensorOptions().device(kGpu));
      const at::Tensor eager = ns.local(G, 5), replayed = graphs.run(G, 5);
      ASSERT_EQ(replayed.sizes(), eager.sizes());
      EXPECT_TRUE(at::equal(replayed, eager)) << "call " << call << " max diff "
                                               << (replayed - eager).abs().max().item<double>();
    }
  }
  EXPECT_EQ(graphs.stats().captures, 3);
  EXPECT_EQ(graphs.stats().replays, 9);
  EXPECT_EQ(graphs.stats().eager, 0);
  NsGraphs checked(NewtonSchulz("gram"));  // check_finite on: reads the host, so never captured
  (void)checked.run(at::randn({64, 128}, at::TensorOptions().device(kGpu)), 5);
  EXPECT_EQ(checked.stats().captures, 0);
  EXPECT_EQ(checked.stats().eager, 1);
}

TEST(CudaTest, DirectNsInBf16WithinTheHalfPrecisionBound) {
  DMUON_REQUIRE_CUDA();
  at::manual_seed(1);
  for (const auto& s : kShapes) {
    const at::Tensor G = at::randn({s.m, s.n}, at::TensorOptions().device(kGpu));
    const at::Tensor W = direct_newton_schulz(G.to(at::kBFloat16));  // default on CUDA: bf16 compute
    ASSERT_TRUE(W.is_cuda());
    EXPECT_EQ(W.scalar_type(), at::kBFloat16);
    const at::Tensor ref = reference_ns(G, POLAR_EXPRESS_COEFFICIENTS);
    EXPECT_TRUE(at::isfinite(W).all().item<bool>());
    EXPECT_LE(rel(W, ref), 5e-2) << s.m << "x" << s.n;  // §8: bf16 direct <= 5e-2 Gaussian
    EXPECT_LE(std::abs(nuclear_gap(G, W) - nuclear_gap(G, ref)), 5e-3) << s.m << "x" << s.n;
  }
}

TEST(CudaTest, GramNsInFp16WithRestartsWithinTheHalfPrecisionBound) {
  DMUON_REQUIRE_CUDA();
  at::manual_seed(2);
  for (const auto& s : kShapes) {
    const at::Tensor G = at::randn({s.m, s.n}, at::TensorOptions().device(kGpu));
    NsOptions o;
    o.force_gram = true;  // square shapes would dispatch to the direct form
    const at::Tensor W = gram_newton_schulz(G, o);  // default on CUDA: fp16 Gram, restarts {2}
    ASSERT_TRUE(W.is_cuda());
    const at::Tensor ref = reference_ns(G, POLAR_EXPRESS_COEFFICIENTS);
    EXPECT_TRUE(at::isfinite(W).all().item<bool>());
    EXPECT_LE(rel(W, ref), 1e-2) << s.m << "x" << s.n;  // §8: fp16 Gram[2] <= 1e-2 Gaussian
    EXPECT_LE(std::abs(nuclear_gap(G, W) - nuclear_gap(G, ref)), 5e-3) << s.m << "x" << s.n;
  }
}

TEST(CudaTest, Float64NsOnTheGpuEqualsTheReference) {
  DMUON_REQUIRE_CUDA();
  at::manual_seed(3);
  const at::Tensor G = at::randn({512, 2048}, at::TensorOptions().device(kGpu).dtype(at::kDouble));
  const at::Tensor ref = reference_ns(G, POLAR_EXPRESS_COEFFICIENTS);
  EXPECT_LE(rel(direct_newton_schulz(G), ref), 1e-10);
  EXPECT_LE(rel(gram_newton_schulz(G), ref), 1e-10);
}

// "auto" measures GEMM against SYRK per shape where SYRK can run (fp32 Gram products) and keeps one;
// either way the result is the same NS.
TEST(CudaTest, AutoKernelPicksAKernelPerShapeAndKeepsTheResult) {
  DMUON_REQUIRE_CUDA();
  at::manual_seed(4);
  NsOptions fp32;
  fp32.compute_dtype = at::kFloat;
  fp32.force_gram = true;
  for (const auto& s : kShapes) {
    const at::Tensor G = at::randn({s.m, s.n}, at::TensorOptions().device(kGpu));
    NsOptions a = fp32, gemm = fp32;
    gemm.kernel = "cublas";
    EXPECT_LE(rel(gram_newton_schulz(G, a), gram_newton_schulz(G, gemm)), 1e-4) << s.m << "x" << s.n;
  }
  const NewtonSchulz ns("gram");
  EXPECT_EQ(ns.describe(c10::DeviceType::CUDA).find("cpu"), std::string::npos) << ns.describe(c10::DeviceType::CUDA);
}

// issue 37: the default half-precision Gram NS gets a symmetric product (the block triangle, as no
// cuBLAS SYRK takes fp16/bf16): "syrk" stays within the fp16 Gram bound of NEWTON_SCHULZ.md §8 and
// close to the plain GEMMs; "auto" measures the two per shape and keeps one, with the same bound.
TEST(CudaTest, HalfPrecisionSyrkStaysWithinTheFp16GramBound) {
  DMUON_REQUIRE_CUDA();
  at::manual_seed(5);
  for (const auto& s : kShapes) {
    const at::Tensor G = at::randn({s.m, s.n}, at::TensorOptions().device(kGpu));
    NsOptions syrk, plain, automatic;
    syrk.force_gram = plain.force_gram = automatic.force_gram = true;
    syrk.kernel = "syrk";
    plain.kernel = "cublas";
    const at::Tensor ref = reference_ns(G, POLAR_EXPRESS_COEFFICIENTS);
    const at::Tensor W = gram_newton_schulz(G, syrk), P = gram_newton_schulz(G, plain);
    EXPECT_LE(rel(W, ref), 1e-2) << s.m << "x" << s.n;
    EXPECT_LE(rel(W, P), 1e-2) << s.m << "x" << s.n;
    EXPECT_LE(rel(gram_newton_schulz(G, automatic), ref), 1e-2) << s.m << "x" << s.n;
    const at::Tensor X = at::randn({std::min(s.m, s.n), std::max(s.m, s.n)}, at::TensorOptions().device(kGpu)).to(at::kHalf);
    const std::string k = detail::kernels::resolve_kernel("auto", X);
    EXPECT_TRUE(k == "syrk" || k == "cublas") << k;
    std::printf("[auto] fp16 %lldx%lld Gram product: %s\n", static_cast<long long>(X.size(0)),
                static_cast<long long>(X.size(1)), k.c_str());
  }
}

// CUDA's sync debug mode: L_ERROR makes every synchronising call throw.
void set_sync_debug(bool on) {
#if DMUON_WITH_CUDA
  c10::cuda::warning_state().set_sync_debug_mode(on ? c10::cuda::SyncDebugMode::L_ERROR
                                                    : c10::cuda::SyncDebugMode::L_DISABLED);
#else
  (void)on;
#endif
}
// Queues `cycles` of spinning on the current CUDA stream.
void queue_sleep(int64_t cycles) {
#if DMUON_WITH_CUDA
  at::cuda::sleep(cycles);
#else
  (void)cycles;
#endif
}

using testing::EnvGuard;

struct OneGpuRun {
  int64_t most_reads = 0;
  CommCounters::Snapshot comm;
  StepProfile profile;
  std::vector<std::string> unbound_groups;  // process groups without a bound device
  double worst = 0;                         // vs the CPU reference
  size_t params = 0;                        // dmuon's parameters: dedicated matrices and the rest
};

// One GPU, NCCL with world size 1: `steps` of float64 training on the GPU, compared with float64
// training on the CPU (the independent single-process reference). `sync_debug`: CUDA's sync debug
// mode at L_ERROR around backward and step(), so any synchronisation outside dmuon's counted host
// reads throws.
OneGpuRun train_on_one_gpu(int steps, bool sync_debug) {
  testing::TrainConfig tc;
  tc.steps = steps;
  const models::GPTConfig cfg = testing::small_config(2);
  const auto init = testing::init_state(cfg, 1234);  // float64
  const auto batches = testing::make_batches(tc.steps, 8, 12, cfg.vocab_size, 99);
  const auto ref = testing::reference_train(cfg, init, batches, tc);
  const std::string dir = testing::fresh_temp_dir("dmuon-cuda");
  auto store = make_file_store(dir + "/store", 1);
  auto pg = make_process_group(store, 0, 1, c10::DeviceType::CUDA, std::chrono::seconds(60));
  MeshOptions mo;
  mo.store = store;
  mo.factory = process_group_factory(c10::DeviceType::CUDA);
  auto mesh = Mesh::create(pg, mo);
  OneGpuRun out;
  EXPECT_EQ(mesh->device(), kGpu);
#if DMUON_TORCH_AT_LEAST(2, 0)
  for (auto* c : {&mesh->world(), &mesh->shard(), &mesh->dp()})
    if (c->process_group()->getBoundDeviceId() != std::optional<at::Device>(kGpu)) out.unbound_groups.push_back(c->name());
  if (pg->getBoundDeviceId() != std::optional<at::Device>(kGpu)) out.unbound_groups.push_back("world (bootstrap)");
#endif
  models::GPT m(cfg);
  testing::load_state(m, init);
  m->to(kGpu);
  testing::Layout l;
  l.world = 1;
  testing::dedicate_gpt(m, mesh, l);
  MuonOptions muon_opts = testing::muon_options(tc);
  muon_opts.record_step_profile = true;  // CUDA events: read at consume time, no host read in step()
  Muon opt(m.ptr(), muon_opts);
  mesh->counters().reset();
  for (const auto& tokens : batches) {
    const at::Tensor x = tokens.to(kGpu);
    const int64_t before = host_sync_count();
    opt.zero_grad();
    if (sync_debug) set_sync_debug(true);
    try {
      m->loss(x).backward();
      opt.step();
    } catch (...) {
      set_sync_debug(false);
      throw;
    }
    set_sync_debug(false);
    out.most_reads = std::max(out.most_reads, host_sync_count() - before);
  }
  out.comm = mesh->counters().snapshot();
  out.params = get_dedicated_params(*m).size() + get_base_params(*m).size();
  out.profile = opt.consume_last_step_profile();
  for (const auto& item : m->named_parameters(true)) {
    EXPECT_TRUE(item.value().is_cuda()) << item.key();
    out.worst = std::max(out.worst, testing::max_rel(item.value(), ref.params.at(item.key())));
  }
  mesh->shutdown();
  return out;
}

TEST(CudaTest, OneGpuTrainingMatchesTheCpuReferenceWithFewHostReads) {
  DMUON_REQUIRE_CUDA();
  ASSERT_TRUE(process_group_available(c10::DeviceType::CUDA)) << "CUDA build without NCCL";
  const OneGpuRun r = train_on_one_gpu(4, /*sync_debug=*/false);
  EXPECT_LE(r.most_reads, 2) << "host reads per step";
  EXPECT_LE(r.worst, testing::kFloat64Bound);
  EXPECT_TRUE(r.unbound_groups.empty()) << "groups without a bound device: " << r.unbound_groups.front();
  // the last step's profile in device time: NS inside the Muon phase inside the step
  const StepProfile& p = r.profile;
  EXPECT_EQ(p.clock, "cuda_events");
  EXPECT_TRUE(p.valid);
  EXPECT_GT(p.ns_ms, 0.0);
  EXPECT_LE(p.ns_ms, p.muon_ms + 1e-3);
  EXPECT_LE(p.muon_ms + p.adamw_ms, p.total_ms + 1e-3);
  EXPECT_GT(p.host_total_ms, 0.0);
  // the CUDA defaults: AdamW by the fused kernel, the momentum by _foreach_ ops (issue 37)
  EXPECT_GT(p.adamw_fused, 0);
  EXPECT_GT(p.momentum_foreach, 0);
  EXPECT_EQ(p.update_foreach, p.momentum_foreach);  // every matrix whole here: each NS batch's update
  EXPECT_EQ(p.adamw_fused + p.momentum_foreach, static_cast<int>(r.params));
}

// DMUON_FORCE_COLLECTIVES=1: the same training through NCCL's real collectives on a group of one
// (forward broadcasts, gradient reduces, the plan check), under CUDA's sync debug mode at L_ERROR:
// the same result, no synchronisation outside the counted host reads, every group bound to the GPU.
TEST(CudaTest, ForcedCollectivesOnOneGpuRunTheMultiRankPathWithoutHiddenSyncs) {
  DMUON_REQUIRE_CUDA();
  ASSERT_TRUE(process_group_available(c10::DeviceType::CUDA)) << "CUDA build without NCCL";
  EnvGuard force("DMUON_FORCE_COLLECTIVES", "1");
  const OneGpuRun r = train_on_one_gpu(3, /*sync_debug=*/true);
  EXPECT_LE(r.worst, testing::kFloat64Bound);
  EXPECT_GT(r.comm.calls[static_cast<int>(CommOp::Broadcast)], 0) << "forward broadcasts were issued";
  EXPECT_GT(r.comm.calls[static_cast<int>(CommOp::Reduce)], 0) << "gradient reduces were issued";
  EXPECT_EQ(r.comm.total_bytes(), 0) << "a group of one moves no bytes";
  EXPECT_TRUE(r.unbound_groups.empty()) << "groups without a bound device: " << r.unbound_groups.front();
}

// A collective waited through the Communicator on a CUDA group is a stream dependency: with about a
// second of work queued before it, the host returns from wait() at once, and the next host read sees
// the reduced value. Over NCCL (world size 1, forced) and over the loopback backend (2 ranks).
TEST(CudaTest, StreamOrderedWaitDoesNotBlockTheHost) {
  DMUON_REQUIRE_CUDA();
  constexpr int64_t kSleepCycles = 1'500'000'000;  // ~0.75 s at the H200's 1.98 GHz
  auto probe = [&](Communicator& comm, int world, int rank) {
    at::Tensor t = at::full({1024}, static_cast<double>(rank + 1), at::TensorOptions().device(kGpu).dtype(at::kDouble));
    comm.barrier("probe: the ranks start together");
    const auto t0 = std::chrono::steady_clock::now();
    queue_sleep(kSleepCycles);
    t.mul_(2);  // queued behind the sleep
    Pending p = comm.allreduce(t, Reduction::Sum, "host-blocking probe");
    const auto t1 = std::chrono::steady_clock::now();
    p.wait();  // timed alone: the host must not wait for the queued second
    const double wait_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
    const double got = t.sum().item<double>() / 1024;  // the host read waits for the device
    const double read_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    double want = 0;
    for (int r = 0; r < world; ++r) want += 2.0 * (r + 1);
    testing::expect(wait_ms < 5.0, "wait() blocked the host " + std::to_string(wait_ms) + " ms");
    testing::expect(read_ms > 100.0, "the queued sleep was not ahead of the read (" + std::to_string(read_ms) + " ms)");
    testing::expect(got == want, "read " + std::to_string(got) + ", expected " + std::to_string(want));
  };
  {
    EnvGuard force("DMUON_FORCE_COLLECTIVES", "1");
    const std::string dir = testing::fresh_temp_dir("dmuon-cuda");
    auto store = make_file_store(dir + "/store", 1);
    auto pg = make_process_group(store, 0, 1, c10::DeviceType::CUDA, std::chrono::seconds(60));
    Communicator comm(pg, "nccl-probe", {0}, std::chrono::seconds(60), nullptr);
    comm.allreduce(at::zeros({1}, at::TensorOptions().device(kGpu)), Reduction::Sum, "warm-up").wait_host();
    probe(comm, 1, 0);
    comm.shutdown();
  }
  LoopbackOptions lo;
  lo.device = kGpu;
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    Communicator comm(ctx.pg, "loopback-probe", {0, 1}, std::chrono::seconds(60), nullptr);
    probe(comm, 2, ctx.rank);
  }, std::chrono::seconds(60), lo);
}

}  // namespace
}  // namespace dmuon
