// Peak live bytes (the counting allocator), deferred initialisation and owner-local loading.
//
// Ranks run as threads of one process; each rank thread charges its allocations to its own tag
// (rank + 1), so every figure below is one rank's.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dmuon/checkpoint.h"
#include "dmuon/dedicate.h"
#include "dmuon/deferred_init.h"
#include "dmuon/memory.h"
#include "dmuon/muon.h"
#include "dmuon/safetensors.h"
#include "model/dedicated_gpt.h"
#include "model/gpt.h"
#include "model/language_model.h"
#include "runtime/runtime.h"  // white-box: release the runtimes of destroyed models
#include "support/multirank.h"
#include "support/training.h"

namespace dmuon {
namespace {

using models::GPT;
using models::GPTConfig;
using testing::StateDict;
using testing::TrainConfig;
namespace mem = dmuon::memory;

// 16 blocks of 4·64² + 3·64·176 weights (≈ 200 KB each in float32), small embedding and head: the
// Muon matrices are 98% of the model, so what a layout holds of them dominates every peak.
GPTConfig memory_config() {
  GPTConfig c;
  c.vocab_size = 64;
  c.d_model = 64;
  c.n_layers = 16;
  c.n_heads = 4;
  c.max_seq_len = 16;
  return c;
}

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

int64_t muon_bytes(const torch::nn::Module& m) {  // P_M of an undedicated model
  int64_t n = 0;
  for (const auto& p : m.named_parameters(true))
    if (models::is_muon_matrix(p.key(), p.value())) n += bytes_of(p.value());
  return n;
}

TEST(CountingAllocator, ChargesLiveBytesToTheAllocatingTagAndPhase) {
  mem::install_counting_allocator();
  ASSERT_TRUE(mem::counting_allocator_installed());
  mem::MemoryTag tag(40);
  mem::reset_peaks();
  const int64_t base = mem::stats().current;
  at::Tensor kept;
  {
    mem::PhaseScope p(mem::Phase::Forward);
    at::Tensor a = at::empty({1000}, at::kFloat);  // 4000 bytes
    EXPECT_EQ(mem::stats().current - base, 4000);
    kept = at::empty({250}, at::kDouble);  // 2000 more
    EXPECT_EQ(mem::stats().current - base, 6000);
  }  // a freed
  EXPECT_EQ(mem::stats().current - base, 2000);
  mem::Stats s = mem::stats();
  EXPECT_EQ(s.peak - base, 6000);
  EXPECT_EQ(s.peak_by_phase[static_cast<size_t>(mem::Phase::Forward)] - base, 6000);
  {
    mem::PhaseScope p(mem::Phase::Step);  // what is live on entry counts for the phase
    EXPECT_EQ(mem::stats().peak_by_phase[static_cast<size_t>(mem::Phase::Step)] - base, 2000);
  }
  // freed on another thread: still credited to the tag that allocated it
  std::thread([&] {
    mem::MemoryTag other(41);
    kept = at::Tensor();
  }).join();
  EXPECT_EQ(mem::stats().current - base, 0);
  EXPECT_EQ(mem::stats(41).current, 0);
  // a storage resized to 0 bytes and back (how dmuon frees and regathers a matrix)
  at::Tensor t = at::empty({512}, at::kFloat);
  c10::StorageImpl* si = t.storage().unsafeGetStorageImpl();
  at::native::resize_bytes_cpu(si, 0);
  EXPECT_EQ(mem::stats().current - base, 0);
  at::native::resize_bytes_cpu(si, 2048);
  EXPECT_EQ(mem::stats().current - base, 2048);
  mem::reset_peaks();
  EXPECT_EQ(mem::stats().peak - base, 2048);
  EXPECT_NE(testing::error_of([] { mem::MemoryTag bad(mem::kMaxTags); }).find("out of range"), std::string::npos);
}

// LibTorch's raw interface (oneDNN's scratch buffers on CPUs with avx512_bf16 allocate through it):
// the pointer is its own context, raw_deleter frees it, and both are counted; every allocation
// keeps LibTorch's 64-byte alignment.
TEST(CountingAllocator, RawAllocateAndAlignmentWorkThroughIt) {
  mem::install_counting_allocator();
  mem::MemoryTag tag(42);
  const int64_t base = mem::stats().current;
  c10::Allocator* a = c10::GetCPUAllocator();
  void* p = a->raw_allocate(3000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  std::memset(p, 7, 3000);
  EXPECT_EQ(mem::stats().current - base, 3000);
  ASSERT_NE(a->raw_deleter(), nullptr);
  a->raw_deallocate(p);
  EXPECT_EQ(mem::stats().current - base, 0);
  for (int64_t n : {1, 63, 64, 65, 4097}) {
    at::Tensor t = at::empty({n}, at::kByte);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64, 0u) << n;
    EXPECT_EQ(mem::stats().current - base, n);
  }
  EXPECT_EQ(mem::stats().current - base, 0);
  at::Tensor empty = at::empty({0}, at::kFloat);  // no bytes, nothing charged
  EXPECT_EQ(mem::stats().current - base, 0);
}

// ---- peaks of a training step per layout ---------------------------------------------------------
struct Layout {
  std::string label;
  bool muon = true;
  bool z3 = true;
  bool shard_base = false;
};

struct RankPeaks {
  int64_t setup = 0;   // constructing and dedicating the model (live bytes above what was live before)
  int64_t train = 0;   // steps 2..n: forward, backward and step
  std::array<int64_t, mem::kNumPhases> by_phase{};
  int64_t holds = 0;   // bytes of the Muon matrices this rank holds between steps
};

// The model (deferred or eager, float32), dedicated on `world` ranks in `layout` and trained 3 steps;
// each rank's peaks.
std::vector<RankPeaks> measure(int world, const Layout& layout, bool deferred) {
  mem::install_counting_allocator();
  // The models of an earlier measure() are gone; their runtimes go at the next registry lookup. Let
  // that happen here, before any rank reads its baseline: otherwise one rank's lookup could free
  // them (the ranks are threads of one process) while another rank is still building its model.
  (void)detail::state_of_model(nullptr);
  const GPTConfig cfg = memory_config();
  // one sequence of 8 tokens per rank: activations (~50 KB per block) stay small next to the matrices
  const auto batches = testing::make_batches(3, world, 8, cfg.vocab_size, 5);
  std::vector<RankPeaks> out(static_cast<size_t>(world));
  testing::run_ranks(world, [&](testing::RankContext& ctx) {
    mem::MemoryTag tag(ctx.rank + 1);
    auto mesh = testing::make_mesh(ctx);
    RankPeaks& r = out[static_cast<size_t>(ctx.rank)];
    const int64_t before = mem::stats().current;
    mem::reset_peaks();
    GPT m{nullptr};
    {
      mem::PhaseScope setup(mem::Phase::Setup);
      GPTConfig c = cfg;
      c.deferred.enabled = deferred;
      m = GPT(c);
      models::DedicatedModelSetup s;
      s.muon = layout.muon;
      s.z3 = layout.z3;
      s.shard_base = layout.shard_base;
      s.param_source = models::init_source(*m, 11);
      models::dedicate_model(*m, mesh, s, false);
    }
    r.setup = mem::stats().peak - before;
    for (const auto& d : get_dedicated_params(*m))
      if (d.is_owner) r.holds += d.param.numel() * static_cast<int64_t>(d.param.element_size());
    Muon opt(m.ptr(), testing::muon_options(TrainConfig{}));
    const int64_t per = batches[0].size(0) / ctx.world;
    for (size_t i = 0; i < batches.size(); ++i) {
      if (i == 1) mem::reset_peaks();  // the first step creates the optimizer state
      at::Tensor loss;
      {
        mem::PhaseScope p(mem::Phase::Forward);
        loss = m->loss(batches[i].narrow(0, ctx.rank * per, per));
      }
      {
        mem::PhaseScope p(mem::Phase::Backward);
        loss.backward();
      }
      mem::PhaseScope p(mem::Phase::Step);
      opt.step();
      opt.zero_grad();
    }
    // what this run added over its baseline: bytes still live from an earlier measurement (the ranks
    // are threads of one process; a previous run's last buffers may be released a moment later) are
    // not this layout's
    const mem::Stats s = mem::stats();
    r.train = s.peak - before;
    for (size_t i = 0; i < r.by_phase.size(); ++i) r.by_phase[i] = s.peak_by_phase[i] - before;
  });
  return out;
}

// Z3 frees a matrix after forward where Z2 keeps it until backward: at the peak (the end of
// forward) a Z2 rank holds every boundary's matrices, a Z3 rank its own and the prefetched ones.
// The bar: a Z3 non-owner's peak is below Z2's by at least half of (N-1)/N * P_M.
TEST(PeakMemory, Z3RanksPeakBelowZ2ByTheMatricesTheyDoNotOwn) {
  const int N = 4;
  GPT probe(memory_config());
  const double pm = static_cast<double>(muon_bytes(*probe));
  const auto z2 = measure(N, {"z2", true, false}, false), z3 = measure(N, {"z3", true, true}, false);
  for (int r = 0; r < N; ++r) {
    std::cout << "  rank " << r << ": P_M " << pm << " B, holds " << z3[r].holds << " B; peak Z2 " << z2[r].train
              << " B, Z3 " << z3[r].train << " B; forward / backward / step: Z2 " << z2[r].by_phase[2] << " / "
              << z2[r].by_phase[3] << " / " << z2[r].by_phase[4] << ", Z3 " << z3[r].by_phase[2] << " / "
              << z3[r].by_phase[3] << " / " << z3[r].by_phase[4] << "\n";
    const double saved = static_cast<double>(z2[r].train - z3[r].train);
    EXPECT_GE(saved, 0.5 * (N - 1) / N * pm)
        << "rank " << r << ": Z2 peak " << z2[r].train << " B, Z3 peak " << z3[r].train << " B, P_M " << pm << " B";
    // and the Z3 peak itself scales with the owned share: four owned-size tensors (the matrices,
    // momentum, reduced gradient, averaged gradient), plus what is in flight: two gathered boundaries
    // and two boundaries' gradient payloads (4/16 of P_M here), the activations and the replicated
    // parameters. Measured 3.75-3.82 MB for holds 0.80 MB and P_M 3.21 MB; bound 4.82 MB.
    EXPECT_LT(static_cast<double>(z3[r].train), 4.0 * z3[r].holds + 0.5 * pm)
        << "rank " << r << ": Z3 peak " << z3[r].train << " B holding " << z3[r].holds << " B";
  }
}

// Deferred construction: building and dedicating holds one block at a time, then only what the
// rank keeps (its matrices and the replicated parameters).
TEST(DeferredInit, SetupPeakScalesWithTheOwnedShare) {
  const int N = 4;
  GPT probe(memory_config());
  int64_t full = 0, block = 0;
  for (const auto& p : probe->named_parameters(true)) full += bytes_of(p.value());
  for (const auto& p : probe->blocks[0]->named_parameters(true)) block += bytes_of(p.value());
  const int64_t base = full - muon_bytes(*probe);
  const auto deferred = measure(N, {"z3", true, true}, true), eager = measure(N, {"z3", true, true}, false);
  for (int r = 0; r < N; ++r) {
    EXPECT_GE(eager[r].setup, full) << "rank " << r;  // eager: the whole model first
    // owned share + replicated parameters + one block under construction + one packed buffer
    EXPECT_LE(deferred[r].setup, deferred[r].holds + base + 2 * block + (64 << 10))
        << "rank " << r << ": setup peak " << deferred[r].setup << " B, holds " << deferred[r].holds << " B, model "
        << full << " B";
    EXPECT_LT(deferred[r].setup, full / 2) << "rank " << r;
  }
}

// ---- deferred initialisation: the same weights on any layout, training equals one process ----------
struct DeferredLayout {
  std::string label;
  int world = 4;
  int replicate = 1;
  int tp = 1;
  bool z3 = true;
  bool sharded = false;
};

TEST(DeferredInit, SameWeightsOnAnyLayoutAndTrainsLikeOneProcess) {
  GPTConfig cfg = testing::small_config(3);
  // the single-process reference: an eager model filled from the same source
  GPT eager(cfg);
  eager->to(at::kDouble);
  initialize_parameters(*eager, *models::init_source(*eager, 7));
  StateDict init;
  for (const auto& p : eager->named_parameters(true)) init[p.key()] = p.value().detach().clone();
  // seeded by name: a parameter's value does not depend on the others or on the order
  at::Tensor q0 = at::empty(init.at("layers.0.q_proj.weight").sizes(), at::kDouble);
  models::init_source(*eager, 7)->fill("layers.0.q_proj.weight", TensorRegion::whole(q0.sizes()), q0);
  EXPECT_TRUE(at::equal(q0, init.at("layers.0.q_proj.weight")));
  EXPECT_FALSE(at::equal(init.at("layers.0.q_proj.weight"), init.at("layers.1.q_proj.weight")));
  TrainConfig tc;
  tc.steps = 4;
  const int64_t global_batch = 8;
  const auto batches = testing::make_batches(tc.steps, global_batch, 12, cfg.vocab_size, 3);
  const testing::RefResult ref = testing::reference_train(cfg, init, batches, tc);
  for (const DeferredLayout& l : {DeferredLayout{"Z3 x4"}, DeferredLayout{"Z2 + sharded base x4", 4, 1, 1, false, true},
                                  DeferredLayout{"HSDP 2x2", 4, 2}, DeferredLayout{"TP 2 x DP 2", 4, 1, 2},
                                  DeferredLayout{"one rank", 1}}) {
    SCOPED_TRACE(l.label);
    std::mutex mu;
    double worst = 0;
    testing::run_ranks(l.world, [&](testing::RankContext& ctx) {
      auto mesh = testing::make_mesh(ctx, std::chrono::seconds(60), l.replicate, l.tp);
      GPTConfig c = cfg;
      c.deferred = models::DeferredInit{true, at::kDouble, at::kCPU};
      if (l.tp > 1) c.tp_mesh = mesh;
      GPT m(c);
      testing::expect(deferred_parameters(*m).size() == m->named_parameters(true).size(), "every parameter deferred");
      DedicateOptions o;
      o.param_source = models::init_source(*m, 7);
      o.reshard_after_forward = l.z3;
      if (l.sharded)
        o.route_hint_fn = [](const std::string& n, const at::Tensor& p) -> std::string {
          return models::is_muon_matrix(n, p) ? "" : "sharded_adamw";
        };
      dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o);
      if (l.tp > 1)
        replicate_tp(m.ptr(), mesh);
      else
        replicate(m.ptr(), mesh);
      testing::expect(deferred_parameters(*m).empty(), "nothing deferred after dedicate_params");
      const StateDict sd0 = get_model_state_dict(*m);
      if (ctx.rank == 0)
        for (const auto& [k, v] : init) testing::expect(at::equal(sd0.at(k), v), "initial '" + k + "' differs");
      Muon opt(m.ptr(), testing::muon_options(tc));
      const int dp_rank = mesh->replicate_rank() * mesh->shard_size() + mesh->shard_rank();
      testing::train_slices(m, opt, batches, dp_rank, global_batch / mesh->data_parallel_size());
      const StateDict sd = get_model_state_dict(*m);
      if (ctx.rank != 0) return;
      for (const auto& [k, v] : ref.params) {
        const double e = testing::max_rel(sd.at(k), v);
        {
          std::lock_guard<std::mutex> g(mu);
          worst = std::max(worst, e);
        }
        testing::expect(e <= testing::kFloat64Bound, "'" + k + "' after training: " + std::to_string(e));
      }
    });
    std::cout << "  " << l.label << ": worst relative difference " << worst << " (bound " << testing::kFloat64Bound
              << ")\n";
  }
}

TEST(DeferredInit, ATiedParameterGetsItsFirstNamesValueInTheReferenceAsInTheDedicatedModel) {
  // one tensor registered under two names (tied embeddings): dedicate_params asks the source for it under its
  // first name; initialize_parameters (the single-process reference) asked under every name, the last won
  struct TiedNet : torch::nn::Module {
    at::Tensor w;
    TiedNet() {
      auto a = register_module("a", std::make_shared<torch::nn::Module>());
      auto b = register_module("b", std::make_shared<torch::nn::Module>());
      w = a->register_parameter("weight", at::zeros({3, 4}, at::kDouble));
      b->register_parameter("weight", w);
    }
  };
  std::vector<std::string> asked;
  const auto source = [&asked] {
    return seeded_init(7, [&asked](const std::string& name, at::Tensor& full, at::Generator& g) {
      asked.push_back(name);
      full.normal_(0.0, 1.0, g);
    });
  };
  at::Tensor first = at::empty({3, 4}, at::kDouble), second = at::empty({3, 4}, at::kDouble);
  source()->fill("a.weight", TensorRegion::whole(first.sizes()), first);
  source()->fill("b.weight", TensorRegion::whole(second.sizes()), second);
  ASSERT_FALSE(at::equal(first, second));  // (seeded by name)
  asked.clear();
  auto eager = std::make_shared<TiedNet>();
  initialize_parameters(*eager, *source());
  EXPECT_TRUE(at::equal(eager->w, first));
  EXPECT_EQ(asked, std::vector<std::string>{"a.weight"});
  at::Tensor dedicated;
  testing::run_ranks(1, [&](testing::RankContext& ctx) {
    auto net = std::make_shared<TiedNet>();
    defer_parameters(*net, at::kDouble, at::kCPU);
    DedicateOptions o;
    o.param_source = source();
    dedicate_params(net, testing::make_mesh(ctx), [](const std::string&, const at::Tensor&) { return false; }, o);
    dedicated = net->w.detach().clone();
  });
  EXPECT_TRUE(at::equal(dedicated, first));
}


// ---- owner-local loading -----------------------------------------------------------------------
// A checkpoint in safetensors form loads through checkpoint_model_source: each rank reads only the
// tensors (and of sharded_adamw parameters the rows) it keeps, so the load's transient memory is
// about one tensor, not the model; every tensor read is verified against its CRC32C.
TEST(OwnerLocalLoading, ACheckpointLoadsOnlyWhatEachRankKeeps) {
  mem::install_counting_allocator();
  const std::string dir = testing::fresh_temp_dir("dmuon-owner-local");
  const std::string path = dir + "/ck.safetensors";
  GPTConfig cfg = memory_config();
  GPT src(cfg);
  initialize_parameters(*src, *models::init_source(*src, 21));
  StateDict saved;
  int64_t full = 0, largest = 0;
  for (const auto& p : src->named_parameters(true)) {
    saved[p.key()] = p.value().detach().clone();
    full += bytes_of(p.value());
    largest = std::max(largest, bytes_of(p.value()));
  }
  save_checkpoint(path, saved);
  for (const bool shard_base : {false, true}) {
    SCOPED_TRACE(shard_base ? "sharded base" : "replicated base");
    std::vector<int64_t> transient(4);
    testing::run_ranks(4, [&](testing::RankContext& ctx) {
      mem::MemoryTag tag(ctx.rank + 1);
      auto mesh = testing::make_mesh(ctx);
      GPTConfig c = cfg;
      c.deferred.enabled = true;
      GPT m(c);
      models::DedicatedModelSetup s;
      s.shard_base = shard_base;
      s.param_source = models::init_source(*m, 5);  // other values: the load must replace them all
      models::dedicate_model(*m, mesh, s, false);
      const int64_t before = mem::stats().current;
      mem::reset_peaks();
      {
        mem::PhaseScope p(mem::Phase::Checkpoint);
        set_model_state_dict(*m, *checkpoint_model_source(path));
      }
      transient[static_cast<size_t>(ctx.rank)] = mem::stats().peak - before;
      const StateDict got = get_model_state_dict(*m);
      if (ctx.rank == 0)
        for (const auto& [k, v] : saved) testing::expect(at::equal(got.at(k), v), "'" + k + "' differs after the load");
    });
    for (int r = 0; r < 4; ++r) {
      // one tensor read at a time (the largest is a 64 x 176 matrix, 45 KB), never the model (3.3 MB)
      EXPECT_LE(transient[static_cast<size_t>(r)], 2 * largest + (16 << 10)) << "rank " << r << ", model " << full << " B";
    }
  }
  // a damaged tensor is named by the rank that reads it
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    unsigned char len[8];
    f.read(reinterpret_cast<char*>(len), 8);
    uint64_t header = 0;
    for (int i = 7; i >= 0; --i) header = header << 8 | len[i];
    const SafetensorsEntry e = SafetensorsFile(path).entry("model/final_norm.weight");
    f.seekp(static_cast<std::streamoff>(8 + header + e.begin + 4));
    const char junk = 0x55;
    f.write(&junk, 1);
  }
  testing::run_ranks(1, [&](testing::RankContext& ctx) {
    GPTConfig c = cfg;
    c.deferred.enabled = true;
    GPT m(c);
    models::DedicatedModelSetup s;
    s.param_source = models::init_source(*m, 5);
    models::dedicate_model(*m, testing::make_mesh(ctx), s, false);
    const std::string err = testing::error_of([&] { set_model_state_dict(*m, *checkpoint_model_source(path)); });
    testing::expect(err.find("corrupt") != std::string::npos && err.find("'model/final_norm.weight'") != std::string::npos,
                    "the error names the damaged tensor: " + err);
  });
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dmuon
