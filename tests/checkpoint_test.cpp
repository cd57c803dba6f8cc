// Checkpoints: full state dicts of a dedicated model and its optimizer, written atomically, resume
// on another world size / mesh exactly where uninterrupted training would be.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/optim/schedulers/step_lr.h>

#include <csignal>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dmuon/checkpoint.h"
#include "dmuon/dedicate.h"
#include "dmuon/files.h"
#include "dmuon/muon.h"
#include "dmuon/safetensors.h"
#include "io/file_io.h"  // white-box: a save interrupted by a signal
#include "model/gpt.h"
#include "runtime/inspect.h"  // white-box: which parameters are sharded
#include "support/multirank.h"
#include "support/training.h"

namespace dmuon {
namespace {

using models::GPT;
using models::GPTConfig;
using testing::error_of;
using testing::expect;
using testing::make_mesh;
using testing::max_rel;

using testing::Layout;

void dedicate(GPT& m, const std::shared_ptr<Mesh>& mesh, const Layout& l, DedicateOptions o = {}) {
  testing::dedicate_gpt(m, mesh, l, std::move(o));
}

// The rest of a run on this rank's slices; then the full state dicts, on every rank.
std::pair<TensorDict, OptimizerStateDict> train_rest(GPT& m, Muon& opt, const std::vector<at::Tensor>& batches,
                                                     int rank, int world, int64_t global_batch) {
  testing::train_slices(m, opt, batches, rank, global_batch / world);
  StateDictOptions all;
  all.rank0_only = false;
  return {get_model_state_dict(*m, all), get_optimizer_state_dict(*m, opt, all)};
}

// Trains `first` for half the steps, checkpoints to a file, resumes on `second` for the rest and
// compares every parameter, momentum buffer and AdamW moment with uninterrupted single-process
// training, in float64 (bound testing::kFloat64Bound: machine-independent).
// `loopback`: every group on dmuon's loopback backend, the models on its device.
void check_resume(const Layout& first, const Layout& second,
                  const std::optional<LoopbackOptions>& loopback = std::nullopt) {
  testing::TrainConfig tc;
  tc.steps = 6;
  const GPTConfig cfg = testing::small_config(2);
  const auto init = testing::init_state(cfg, 1234);  // float64
  const double bound = testing::kFloat64Bound;
  const int64_t global_batch = 12;
  const auto batches = testing::make_batches(tc.steps, global_batch, 12, cfg.vocab_size, 99);
  const auto ref = testing::reference_train(cfg, init, batches, tc);
  const std::vector<at::Tensor> part1(batches.begin(), batches.begin() + 3), part2(batches.begin() + 3, batches.end());
  const std::string dir = testing::fresh_temp_dir("dmuon-ckpt");
  const std::string path = dir + "/step3.pt";
  testing::run_ranks(first.world, [&](testing::RankContext& ctx) {
    GPT m(cfg);
    testing::load_state(m, init);
    if (!ctx.device.is_cpu()) m->to(ctx.device);
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), first.replicate);
    dedicate(m, mesh, first);
    Muon opt(m.ptr(), testing::muon_options(tc));
    testing::train_slices(m, opt, part1, ctx.rank, global_batch / ctx.world);
    const auto msd = get_model_state_dict(*m);
    const auto osd = get_optimizer_state_dict(*m, opt);
    if (ctx.rank == 0) {
      save_checkpoint(path, msd, &osd);
    } else {
      expect(msd.empty() && osd.muon.empty() && osd.adamw.empty(), "rank0_only: other ranks get empty dicts");
    }
  }, std::chrono::seconds(60), loopback);
  ASSERT_TRUE(std::filesystem::exists(path));
  for (const auto& f : std::filesystem::directory_iterator(dir))
    EXPECT_EQ(f.path().filename().string(), "step3.pt") << "a temporary file was left behind";
  std::mutex mu;
  TensorDict final_model;
  OptimizerStateDict final_optim;
  testing::run_ranks(second.world, [&](testing::RankContext& ctx) {
    GPT m = testing::make_gpt(cfg);  // a fresh random init: everything must come from the checkpoint
    if (!ctx.device.is_cpu()) m->to(ctx.device);
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), second.replicate);
    dedicate(m, mesh, second);
    Muon opt(m.ptr(), testing::muon_options(tc));
    const Checkpoint ck = load_checkpoint(path);
    expect(ck.optim.has_value(), "the optimizer state was saved");
    set_model_state_dict(*m, ck.model);
    set_optimizer_state_dict(*m, opt, *ck.optim);
    expect(opt.steps_taken() == 3, "steps taken restored");
    {  // what was loaded reads back unchanged on the new layout
      StateDictOptions all;
      all.rank0_only = false;
      const auto msd = get_model_state_dict(*m, all);
      for (const auto& [k, v] : ck.model) expect(msd.at(k).cpu().equal(v.cpu()), "model round trip of " + k);
      const auto osd = get_optimizer_state_dict(*m, opt, all);
      expect(osd.muon.size() == ck.optim->muon.size() && osd.adamw.size() == ck.optim->adamw.size(), "optim keys");
      for (const auto& [k, v] : ck.optim->muon) expect(osd.muon.at(k).cpu().equal(v.cpu()), "momentum round trip of " + k);
      for (const auto& [k, v] : ck.optim->adamw) expect(osd.adamw.at(k).cpu().equal(v.cpu()), "AdamW round trip of " + k);
    }
    const auto [msd, osd] = train_rest(m, opt, part2, ctx.rank, ctx.world, global_batch);
    std::lock_guard<std::mutex> g(mu);
    if (ctx.rank == 0) {
      final_model = msd;
      final_optim = osd;
    } else {  // every rank returns the same dict with rank0_only = false
      for (const auto& [k, v] : msd)
        expect(final_model.empty() || v.cpu().equal(final_model.at(k).cpu()), "rank copies of " + k);
    }
  }, std::chrono::seconds(60), loopback);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(final_model.size(), ref.params.size()) << first.label << " -> " << second.label;
  for (const auto& [k, v] : ref.params)
    EXPECT_LE(max_rel(final_model.at(k), v), bound) << k << " (" << first.label << " -> " << second.label << ")";
  ASSERT_EQ(final_optim.muon.size(), 2 * ref.momentum.size());
  ASSERT_EQ(final_optim.adamw.size(), 3 * ref.exp_avg.size());
  for (const auto& [k, v] : ref.momentum)
    EXPECT_LE(max_rel(final_optim.muon.at(k + ".momentum_buffer"), v), bound) << k << " momentum";
  for (const auto& [k, v] : ref.exp_avg) {
    EXPECT_LE(max_rel(final_optim.adamw.at(k + ".exp_avg"), v), bound) << k << " exp_avg";
    EXPECT_EQ(final_optim.adamw.at(k + ".step").item<int64_t>(), 6) << k;
  }
}

// A format-2 checkpoint written by an earlier dmuon (8716d32: a one-block GPT trained 3 steps on 2
// ranks, Z3) resumes on another world size and mesh exactly where uninterrupted float64 training
// goes (tests/data/checkpoint_v2_gpt_expected.safetensors: the reference's parameters, momentum
// buffers and AdamW moments after step 6, and the batches of steps 4-6; testing::kFloat64Bound).
TEST(CheckpointTest, AFormat2FileOfAnEarlierDmuonStillResumes) {
  const std::string old_file = std::string(DMUON_TEST_DATA_DIR) + "/checkpoint_v2_gpt_step3.dmuonckp";
  const SafetensorsFile expected(std::string(DMUON_TEST_DATA_DIR) + "/checkpoint_v2_gpt_expected.safetensors");
  testing::TrainConfig tc;  // as when the file was written
  tc.steps = 6;
  const GPTConfig cfg = testing::small_config(1);
  const int64_t global_batch = 12;
  std::vector<at::Tensor> part2;
  for (int s = 3; s < 6; ++s) part2.push_back(expected.load("batch/" + std::to_string(s)));
  for (const Layout& l : {Layout{"N3 Z3 sharded", 3, 1, true, false, true}, Layout{"HSDP 2x2 Z2", 4, 2, false}}) {
    SCOPED_TRACE(l.label);
    std::mutex mu;
    TensorDict final_model;
    OptimizerStateDict final_optim;
    testing::run_ranks(l.world, [&](testing::RankContext& ctx) {
      GPT m = testing::make_gpt(cfg);  // a fresh random init: everything comes from the file
      auto mesh = make_mesh(ctx, std::chrono::seconds(60), l.replicate);
      dedicate(m, mesh, l);
      Muon opt(m.ptr(), testing::muon_options(tc));
      const Checkpoint ck = load_checkpoint(old_file);
      expect(ck.optim && ck.optim->steps_taken == 3, "the file holds the optimizer state after step 3");
      expect(ck.metadata.at("written_by") == "dmuon 8716d32 (checkpoint format 2)", "the caller's metadata");
      set_model_state_dict(*m, *checkpoint_model_source(old_file));  // a format-2 file: read whole
      set_optimizer_state_dict(*m, opt, *ck.optim);
      const auto [msd, osd] = train_rest(m, opt, part2, ctx.rank, ctx.world, global_batch);
      std::lock_guard<std::mutex> g(mu);
      if (ctx.rank == 0) {
        final_model = msd;
        final_optim = osd;
      }
    });
    size_t params = 0, momenta = 0, moments = 0;
    for (const std::string& key : expected.keys()) {
      const auto slash = key.find('/');
      const std::string kind = key.substr(0, slash), name = key.substr(slash + 1);
      const at::Tensor want = expected.load(key);
      if (kind == "param") {
        ++params;
        EXPECT_LE(max_rel(final_model.at(name), want), testing::kFloat64Bound) << name;
      } else if (kind == "momentum") {
        ++momenta;
        EXPECT_LE(max_rel(final_optim.muon.at(name + ".momentum_buffer"), want), testing::kFloat64Bound) << name;
      } else if (kind == "exp_avg") {
        ++moments;
        EXPECT_LE(max_rel(final_optim.adamw.at(name + ".exp_avg"), want), testing::kFloat64Bound) << name;
        EXPECT_EQ(final_optim.adamw.at(name + ".step").item<int64_t>(), 6) << name;
      }
    }
    EXPECT_EQ(params, final_model.size());
    EXPECT_EQ(2 * momenta, final_optim.muon.size());
    EXPECT_EQ(3 * moments, final_optim.adamw.size());
    EXPECT_GT(momenta, 0u);
    EXPECT_GT(moments, 0u);
  }
}

// Save on HSDP 2x2, resume on 3 ranks with sharded_adamw, every group on dmuon's loopback backend:
// on the CPU here, on CUDA tensors where a GPU is present (its own stream per group, a sleep before
// every copy, so a checkpoint read without its wait reads stale values).
// A tied parameter (one tensor registered by two modules) is trained once and keeps both names in
// the model state dict, which loads back (the runtime knows it by its first name).
struct TiedNet : torch::nn::Module {
  std::shared_ptr<torch::nn::Module> a, b;
  at::Tensor w;
  TiedNet() {
    a = register_module("a", std::make_shared<torch::nn::Module>());
    b = register_module("b", std::make_shared<torch::nn::Module>());
    w = a->register_parameter("weight", at::arange(12, at::kDouble).reshape({3, 4}) * 0.1);
    b->register_parameter("weight", w);
  }
};

TEST(CheckpointTest, TiedParameterKeepsBothNamesInTheModelStateDict) {
  testing::run_ranks(1, [&](testing::RankContext& ctx) {
    auto net = std::make_shared<TiedNet>();
    dedicate_params(net, make_mesh(ctx), [](const std::string&, const at::Tensor&) { return false; });
    const TensorDict sd = get_model_state_dict(*net);
    expect(sd.size() == 2 && sd.count("a.weight") && sd.count("b.weight"), "both names of the tied parameter");
    expect(at::equal(sd.at("a.weight"), sd.at("b.weight")), "one value under both names");
    TensorDict changed = sd;
    changed["a.weight"] = sd.at("a.weight") + 1;
    changed["b.weight"] = changed["a.weight"];
    set_model_state_dict(*net, changed);
    expect(at::equal(net->w.detach(), changed.at("a.weight")), "the tied tensor took the loaded value");
    Muon opt(net, MuonOptions{});
    expect(opt.param_groups()[1].params().size() == 1, "the tied tensor is one AdamW parameter");
  });
}

TEST(CheckpointTest, ResumeThroughTheLoopbackBackendOnTheCpu) {
  check_resume({"HSDP 2x2", 4, 2, true, false, false}, {"N3 Z2 sharded", 3, 1, false, false, true}, LoopbackOptions{});
}

TEST(CheckpointTest, ResumeThroughTheLoopbackBackendOnCuda) {
  if (!DMUON_WITH_CUDA) GTEST_SKIP() << "this dmuon build has no CUDA (CPU LibTorch)";
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
  LoopbackOptions lo;
  lo.device = at::Device(at::kCUDA, 0);
  lo.sleep_cycles = 200000;
  check_resume({"HSDP 2x2", 4, 2, true, false, false}, {"N3 Z2 sharded", 3, 1, false, false, true}, lo);
}

TEST(CheckpointTest, ResumeOnMoreRanksWithShardedBaseParams) {
  check_resume({"N2 Z3 sharded", 2, 1, true, false, true}, {"N3 Z3 sharded", 3, 1, true, false, true});
}

TEST(CheckpointTest, ResumeFromHsdpOnA1DMeshAndFromReplicatedToSharded) {
  check_resume({"HSDP 2x2", 4, 2, true, false, false}, {"N3 Z2 sharded", 3, 1, false, false, true});
}

TEST(CheckpointTest, ResumeFromTheDdpPathOnOneProcess) {
  check_resume({"DDP N3", 3, 1, true, true, false}, {"N1", 1, 1, true, false, false});
}

TEST(CheckpointTest, ResumeInAllGatherUnshardMode) {
  check_resume({"N2 all_gather", 2, 1, true, false, false, "all_gather"},
               {"N3 all_gather", 3, 1, true, false, false, "all_gather"});
  check_resume({"HSDP 2x2 all_gather", 4, 2, true, false, false, "all_gather"},
               {"DDP N3 all_gather", 3, 1, true, true, false, "all_gather"});
}

TEST(CheckpointTest, MixedPrecisionStateDictsCarryTheMasters) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    const GPTConfig cfg = testing::small_config(2);
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    DedicateOptions o;
    ParamPolicy bf16;
    bf16.param_dtype = at::kBFloat16;
    o.param_policy.push_back({"", bf16});
    dedicate(m, mesh, {"bf16", 2, 1, true, false, true}, o);
    Muon opt(m.ptr(), testing::muon_options({}));
    testing::train_slices(m, opt, testing::make_batches(2, 8, 9, cfg.vocab_size, 4), ctx.rank, 4);
    StateDictOptions all;
    all.rank0_only = false;
    TensorDict sd = get_model_state_dict(*m, all);
    for (const auto& [k, v] : sd) expect(v.scalar_type() == at::kFloat, k + " is not saved in full precision");
    for (const auto& d : get_dedicated_params(*m))
      if (d.is_owner) expect(sd.at(d.name).equal(d.master), "the state dict holds the master of " + d.name);
    // load shifted values: masters take them exactly, parameters their bf16 rounding
    for (auto& [k, v] : sd) v = v + 0.25;
    set_model_state_dict(*m, sd);
    const TensorDict back = get_model_state_dict(*m, all);
    for (const auto& [k, v] : sd) expect(back.at(k).equal(v), k + " did not round-trip");
    for (const auto& d : get_dedicated_params(*m))
      if (d.is_owner) expect(d.param.equal(sd.at(d.name).to(at::kBFloat16)), "bf16 copy of " + d.name);
    for (const auto& [name, p] : get_base_params(*m))
      if (!inspect::is_sharded(*m, name)) expect(p.equal(sd.at(name).to(at::kBFloat16)), "bf16 copy of " + name);
  });
}

// A 2-layer GPT (testing::small_config(2)) dedicated on a 2-rank mesh with its Muon optimizer, on every rank.
void with_small_gpt_on_2_ranks(
    const std::function<void(testing::RankContext&, GPT&, const std::shared_ptr<Mesh>&, Muon&)>& body) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(testing::small_config(2));
    auto mesh = make_mesh(ctx);
    dedicate(m, mesh, {"N2", 2});
    Muon opt(m.ptr(), testing::muon_options({}));
    body(ctx, m, mesh, opt);
  });
}

// One training step of with_small_gpt_on_2_ranks's model (every parameter then has optimizer state).
void train_one_step(const testing::RankContext& ctx, GPT& m, Muon& opt) {
  testing::train_slices(m, opt, testing::make_batches(1, 8, 9, testing::small_config(2).vocab_size, 4), ctx.rank, 4);
}

// State dicts returned on every rank.
StateDictOptions on_every_rank() {
  StateDictOptions o;
  o.rank0_only = false;
  return o;
}

// Full state dicts send each owner's matrices (and their momentum) packed: one broadcast per owner
// (the optimizer's: one of [has, step] headers, one of the buffers) -- one per matrix made 1600
// small matrices cost 1.2 s on 2 ranks. Owners with more than a pack's cap (64 MiB) send several;
// every rank gets every value exactly.
TEST(CheckpointTest, FullStateDictsSendEachOwnersMatricesPacked) {
  auto broadcasts = [](const std::shared_ptr<Mesh>& mesh) { return mesh->counters().calls(CommOp::Broadcast); };
  testing::run_ranks(3, [&](testing::RankContext& ctx) {
    const GPTConfig cfg = testing::small_config(3);
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    dedicate(m, mesh, {"N3", 3});
    Muon opt(m.ptr(), testing::muon_options({}));
    testing::train_slices(m, opt, testing::make_batches(1, 6, 9, cfg.vocab_size, 4), ctx.rank, 2);
    std::set<int> owners;
    for (const auto& d : get_dedicated_params(*m)) owners.insert(d.owner_rank);
    expect(owners.size() == 3, "every rank owns matrices");
    int64_t before = broadcasts(mesh);
    const TensorDict sd = get_model_state_dict(*m, on_every_rank());
    EXPECT_EQ(broadcasts(mesh) - before, 3) << "one broadcast per owner";
    before = broadcasts(mesh);
    const OptimizerStateDict osd = get_optimizer_state_dict(*m, opt, on_every_rank());
    EXPECT_EQ(broadcasts(mesh) - before, 6) << "a header and a pack per owner";
    for (const auto& d : get_dedicated_params(*m)) {
      if (!d.is_owner) continue;
      expect(sd.at(d.name).equal(d.param), "the owner's value of " + d.name);
      const MuonParamState* s = opt.state_of(d.param);
      expect(s && osd.muon.at(d.name + ".momentum_buffer").equal(s->momentum_buffer()), "momentum of " + d.name);
      expect(osd.muon.at(d.name + ".step").item<int64_t>() == s->step(), "the owner's step of " + d.name);
    }
  });
  // sharded_adamw: the slices of every norm and bias (and their moments) in one all-gather
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    const GPTConfig cfg = testing::small_config(3);
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    dedicate(m, mesh, {"N2-sharded", 2, 1, true, false, true});
    Muon opt(m.ptr(), testing::muon_options({}));
    testing::train_slices(m, opt, testing::make_batches(1, 6, 9, cfg.vocab_size, 4), ctx.rank, 3);
    const size_t sharded = inspect::sharded_params(*m).size();
    expect(sharded >= 7, "the norms are sharded");
    // one all-gather of the slices, one of the call's agreement (values: the resume tests)
    auto gathers = [&] { return mesh->counters().calls(CommOp::AllGather); };
    int64_t before = gathers();
    (void)get_model_state_dict(*m, on_every_rank());
    EXPECT_EQ(gathers() - before, 2) << "the slices of " << sharded << " parameters";
    before = gathers();
    (void)get_optimizer_state_dict(*m, opt, on_every_rank());
    EXPECT_EQ(gathers() - before, 2) << "the moments' slices of " << sharded << " parameters";
  });
  // 2 layers of d_model 1024 in float64: ~128 MiB of matrices per owner, more than one pack's cap
  GPTConfig big = testing::small_config(2);
  big.d_model = 1024;
  big.d_ff = 4096;
  const auto init = testing::init_state(big, 7);
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    GPT m(big);
    testing::load_state(m, init);
    auto mesh = make_mesh(ctx);
    dedicate(m, mesh, {"N2", 2});
    const auto dedicated = get_dedicated_params(*m);
    const int64_t before = broadcasts(mesh);
    const TensorDict sd = get_model_state_dict(*m, on_every_rank());
    const int64_t calls = broadcasts(mesh) - before;
    EXPECT_GT(calls, 2) << "an owner's matrices beyond the cap go in further packs";
    EXPECT_LT(calls, static_cast<int64_t>(dedicated.size())) << "packed, not one per matrix";
    for (const auto& [k, v] : init) expect(sd.at(k).equal(v), "every rank's value of " + k);
  });
}

// An optimizer that has not stepped lists each trainable parameter's state as its first step starts it
// (zeros at step 0, in the state's dtype, full shapes) rather than as without state: its state dict is a
// template holding every key, which a loader that fills only the keys it is given
// (torch.distributed.checkpoint into a new optimizer) fills whole. Loading such entries gives fresh state:
// the run goes exactly as a never-loaded one (float64, bit for bit: the same ops on the same ranks).
TEST(CheckpointTest, AnOptimizerThatHasNotSteppedListsFreshStateAsATemplate) {
  const GPTConfig cfg = testing::small_config(2);
  const auto init = testing::init_state(cfg, 5);
  const auto batches = testing::make_batches(2, 8, 9, cfg.vocab_size, 4);
  for (const bool sharded : {false, true}) {
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      auto mesh = make_mesh(ctx);
      DedicateOptions o;
      ParamPolicy state32;  // the state in float32 beside float64 parameters: the template's dtype is the state's
      state32.optim_dtype = at::kFloat;
      o.param_policy.push_back({"", state32});
      const Layout layout{"N2", 2, 1, true, false, sharded};
      GPT loaded = testing::make_gpt(cfg), plain = testing::make_gpt(cfg);
      testing::load_state(loaded, init);
      testing::load_state(plain, init);
      dedicate(loaded, mesh, layout, o);
      dedicate(plain, mesh, layout, o);
      Muon opt(loaded.ptr(), testing::muon_options({})), plain_opt(plain.ptr(), testing::muon_options({}));
      const OptimizerStateDict t = get_optimizer_state_dict(*loaded, opt, on_every_rank());
      EXPECT_EQ(t.without_state.size(), loaded->named_parameters(true).size()) << "no parameter has state yet";
      EXPECT_EQ(t.steps_taken, 0);
      size_t matrices = 0, others = 0;
      for (const auto& item : loaded->named_parameters(true)) {
        const std::string& name = item.key();
        const bool muon = t.muon.count(name + ".momentum_buffer") > 0;
        (muon ? matrices : others) += 1;
        const std::vector<std::string> fields =
            muon ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{"exp_avg", "exp_avg_sq"};
        const TensorDict& d = muon ? t.muon : t.adamw;
        for (const std::string& f : fields) {
          const at::Tensor& v = d.at(name + "." + f);
          EXPECT_EQ(v.sizes(), init.at(name).sizes()) << name << "." << f << ": the full shape";
          EXPECT_EQ(v.scalar_type(), at::kFloat) << name << "." << f << ": the state's dtype";
          EXPECT_EQ(v.count_nonzero().item<int64_t>(), 0) << name << "." << f;
        }
        EXPECT_EQ(d.at(name + ".step").item<int64_t>(), 0) << name;
      }
      EXPECT_EQ(t.muon.size(), 2 * matrices);
      EXPECT_EQ(t.adamw.size(), 3 * others);
      EXPECT_EQ(matrices, get_dedicated_params(*loaded).size());
      set_optimizer_state_dict(*loaded, opt, t);
      for (const auto& item : loaded->named_parameters(true)) {
        const MuonParamState* s = opt.state_of(item.value());
        EXPECT_TRUE(!s || (!s->momentum_buffer().defined() && !s->exp_avg().defined() && s->step() == 0))
            << item.key() << ": a template's entry is fresh state";
      }
      // a parameter without a gradient in the steps below: no state, listed as fresh (not only in without_state,
      // which a template-filling loader could not match with its template's keys)
      for (GPT* g : {&loaded, &plain})
        for (auto& item : (*g)->named_parameters(true))
          if (item.key() == "final_norm.weight") item.value().set_requires_grad(false);
      testing::train_slices(loaded, opt, batches, ctx.rank, 4);
      testing::train_slices(plain, plain_opt, batches, ctx.rank, 4);
      const TensorDict a = get_model_state_dict(*loaded, on_every_rank()), b = get_model_state_dict(*plain, on_every_rank());
      for (const auto& [k, v] : b) {
        EXPECT_TRUE(a.at(k).equal(v)) << k << (sharded ? " (sharded_adamw)" : "");
      }
      // once stepped, the dict holds the real state (none at step 0 any more)
      const OptimizerStateDict after = get_optimizer_state_dict(*loaded, opt, on_every_rank());
      for (const auto& [k, v] : after.adamw) {
        if (k.ends_with(".step")) {
          EXPECT_EQ(v.item<int64_t>(), k == "final_norm.weight.step" ? 0 : 2) << k;
        }
      }
      EXPECT_EQ(after.without_state, std::vector<std::string>{"final_norm.weight"});
      EXPECT_EQ(after.adamw.at("final_norm.weight.exp_avg").count_nonzero().item<int64_t>(), 0);
      set_optimizer_state_dict(*loaded, opt, after);  // (at step 2: the fresh entry is complete state)
      expect(opt.steps_taken() == 2, "the step count");
      // after a step, zeros at step 0 for a parameter without_state does not name: never filled in (a partial load)
      OptimizerStateDict unfilled = after;
      const std::string victim = get_dedicated_params(*loaded)[0].name;
      unfilled.muon.at(victim + ".momentum_buffer") = at::zeros_like(unfilled.muon.at(victim + ".momentum_buffer"));
      unfilled.muon.at(victim + ".step") = at::zeros_like(unfilled.muon.at(victim + ".step"));
      const std::string err = error_of([&] { set_optimizer_state_dict(*loaded, opt, unfilled); });
      EXPECT_NE(err.find("'" + victim + "' holds zeros at step 0 (no state) in a state dict at step 2, and "
                         "without_state does not name it"), std::string::npos) << err;
      // a zero entry at step 0 is fresh even where without_state lists the parameter (a partial DCP load)
      OptimizerStateDict partial = t;
      partial.without_state.push_back(get_dedicated_params(*loaded)[0].name);
      set_optimizer_state_dict(*loaded, opt, partial);
      expect(opt.steps_taken() == 0, "the template's step count");
    });
  }
}

TEST(CheckpointTest, LearningRatesAndGroupsAreRestored) {
  with_small_gpt_on_2_ranks([&](testing::RankContext& ctx, GPT& m, const std::shared_ptr<Mesh>& mesh, Muon& opt) {
    const GPTConfig cfg = testing::small_config(2);
    torch::optim::StepLR sched(opt, 1, 0.5);
    testing::train_slices(m, opt, testing::make_batches(2, 8, 9, cfg.vocab_size, 4), ctx.rank, 4);
    sched.step();
    sched.step();
    const OptimizerStateDict sd = get_optimizer_state_dict(*m, opt, {true, false});
    GPT m2(cfg);
    dedicate(m2, mesh, {"N2", 2});
    Muon opt2(m2.ptr(), testing::muon_options({}));
    set_optimizer_state_dict(*m2, opt2, sd);
    for (size_t i = 0; i < opt.param_groups().size(); ++i)
      expect(opt2.param_groups()[i].options().get_lr() == opt.param_groups()[i].options().get_lr(),
             "group " + std::to_string(i) + " lr not restored");
    expect(opt2.param_groups()[0].options().get_lr() < 0.01, "the scheduled (decayed) lr, not the default");
  });
}

TEST(CheckpointTest, BadStateDictsAndFilesAreClearErrors) {
  const std::string dir = testing::fresh_temp_dir("dmuon-ckpt-bad");
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    const GPTConfig cfg = testing::small_config(2);
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    dedicate(m, mesh, {"N2", 2});
    StateDictOptions all;
    all.rank0_only = false;
    const TensorDict good = get_model_state_dict(*m, all);
    TensorDict missing = good;
    missing.erase("layers.1.down_proj.weight");
    std::string err = error_of([&] { set_model_state_dict(*m, missing); });
    expect(err.find("the state dict has no 'layers.1.down_proj.weight' (shape [32, 48])") != std::string::npos,
           "missing key: " + err);
    TensorDict extra = good;
    extra["layers.9.q_proj.weight"] = at::zeros({32, 32});
    err = error_of([&] { set_model_state_dict(*m, extra); });
    expect(err.find("unexpected key 'layers.9.q_proj.weight'") != std::string::npos, "extra key: " + err);
    TensorDict wrong = good;
    wrong["layers.0.q_proj.weight"] = at::zeros({32, 16});
    err = error_of([&] { set_model_state_dict(*m, wrong); });
    expect(err.find("'layers.0.q_proj.weight' has shape [32, 16] in the state dict but [32, 32] in the model") !=
               std::string::npos,
           "shape: " + err);
    OptimizerStateDict osd;
    Muon opt(m.ptr(), testing::muon_options({}));
    err = error_of([&] { set_optimizer_state_dict(*m, opt, osd); });
    expect(err.find("the state dict has 0 parameter groups, the optimizer 2") != std::string::npos, "groups: " + err);
    // optimizer state of a run that trained the matrices with AdamW: refused, not silently dropped
    GPT adam(cfg);
    dedicate_params(adam.ptr(), mesh, [](const std::string&, const at::Tensor&) { return false; });
    replicate(adam.ptr(), mesh);
    Muon adam_opt(adam.ptr(), testing::muon_options({}));
    testing::train_slices(adam, adam_opt, testing::make_batches(1, 4, 9, cfg.vocab_size, 2), ctx.rank, 2);
    const OptimizerStateDict other = get_optimizer_state_dict(*adam, adam_opt, all);
    const float lr_before = static_cast<float>(opt.param_groups()[0].options().get_lr());
    err = error_of([&] { set_optimizer_state_dict(*m, opt, other); });
    expect(err.find("AdamW state 'layers.0.") != std::string::npos &&
               err.find("belongs to no AdamW-trained parameter of this model") != std::string::npos,
           "rerouted state: " + err);
    expect(static_cast<float>(opt.param_groups()[0].options().get_lr()) == lr_before, "a refused load changed the lr");
    if (ctx.rank == 0) {
      err = error_of([&] { load_checkpoint(dir + "/none.pt"); });
      expect(err.find("'" + dir + "/none.pt' does not exist") != std::string::npos, "no file: " + err);
      std::ofstream(dir + "/junk.pt") << "not a checkpoint";
      err = error_of([&] { load_checkpoint(dir + "/junk.pt"); });
      expect(err.find("is not a readable checkpoint") != std::string::npos, "junk: " + err);
      err = error_of([&] { save_checkpoint(dir + "/no/such/dir/x.pt", good); });
      expect(err.find("does not exist; create it first") != std::string::npos, "no dir: " + err);
    }
  });
  std::filesystem::remove_all(dir);
}

// issue 34: a state dict is either complete and in range, or loading it is an error naming what is wrong
TEST(CheckpointTest, IncompleteOrOutOfRangeOptimizerStateIsRefusedNamingIt) {
  with_small_gpt_on_2_ranks([&](testing::RankContext& ctx, GPT& m, const std::shared_ptr<Mesh>&, Muon& opt) {
    train_one_step(ctx, m, opt);
    const StateDictOptions all = on_every_rank();
    const OptimizerStateDict good = get_optimizer_state_dict(*m, opt, all);
    auto refused = [&](const OptimizerStateDict& sd, const std::string& want) {
      const std::string err = error_of([&] { set_optimizer_state_dict(*m, opt, sd); });
      expect(err.find(want) != std::string::npos, "want '" + want + "', got: " + err);
    };
    OptimizerStateDict sd = good;  // every optimizer tensor removed, steps_taken kept
    sd.muon.clear();
    sd.adamw.clear();
    refused(sd, "the state dict is at step 1 but holds no optimizer state for");
    sd = good;  // one parameter's AdamW moments removed
    for (const char* f : {".exp_avg", ".exp_avg_sq", ".step"}) sd.adamw.erase(std::string("final_norm.weight") + f);
    refused(sd, "holds no optimizer state for 1 trained parameter(s): 'final_norm.weight (AdamW");
    // listed as without state (frozen or without a gradient when the dict was taken): it loads with none
    expect(good.without_state.empty(), "every parameter was stepped, yet some are without state");
    sd.without_state = {"final_norm.weight"};
    set_optimizer_state_dict(*m, opt, sd);
    expect(opt.state_of(m->named_parameters(true)["final_norm.weight"]) == nullptr ||
               !opt.state_of(m->named_parameters(true)["final_norm.weight"])->exp_avg().defined(),
           "a parameter without state in the dict has state after the load");
    const OptimizerStateDict listed = get_optimizer_state_dict(*m, opt, all);
    expect(listed.without_state == std::vector<std::string>{"final_norm.weight"},
           "the parameter without state is not listed as such");
    {  // a checkpoint file keeps the list
      const std::string dir = testing::fresh_temp_dir("dmuon-ckpt-without-state");
      save_checkpoint(dir + "/ck.safetensors", {}, &listed);
      expect(load_checkpoint(dir + "/ck.safetensors").optim->without_state == listed.without_state,
             "the checkpoint file lost without_state");
      std::filesystem::remove_all(dir);
    }
    sd = good;  // listed and present: the dict contradicts itself; a name of no parameter: another model's
    sd.without_state = {"final_norm.weight"};
    refused(sd, "'final_norm.weight' is listed as without state (without_state) but the AdamW section holds its state");
    sd.without_state = {"no.such.weight"};
    refused(sd, "without_state names 'no.such.weight', which is no parameter of this model");
    set_optimizer_state_dict(*m, opt, good);
    sd = good;  // one momentum buffer removed: its '.step' is left, the buffer is what is missing
    sd.muon.erase("layers.0.q_proj.weight.momentum_buffer");
    refused(sd, "the Muon state of 'layers.0.q_proj.weight' is incomplete: 'layers.0.q_proj.weight.momentum_buffer' missing");
    sd = good;
    sd.param_groups[0].lr = -1;
    refused(sd, "param_groups[0] ('default', Muon) has lr: -1. Must be >= 0.");
    sd = good;
    sd.param_groups[1].lr = std::numeric_limits<double>::infinity();
    refused(sd, "param_groups[1] ('default', AdamW) has lr: inf. Must be a finite number >= 0.");
    sd = good;
    sd.adamw.at("final_norm.weight.step") = at::scalar_tensor(-7, at::kLong);
    refused(sd, "'final_norm.weight.step' is -7; a step count must be >= 0.");
    sd = good;
    sd.steps_taken = -3;
    refused(sd, "steps_taken is -3; a step count must be >= 0.");
    sd = good;
    sd.adamw.at("final_norm.weight.exp_avg") = at::full_like(good.adamw.at("final_norm.weight.exp_avg"), NAN);
    refused(sd, "optimizer state 'final_norm.weight.exp_avg' holds 32 non-finite value(s)");
    set_optimizer_state_dict(*m, opt, good);  // the intact one still loads
    OptimizerStateDict fresh = good;  // and so does a fresh optimizer's empty state
    fresh.muon.clear();
    fresh.adamw.clear();
    fresh.steps_taken = 0;
    set_optimizer_state_dict(*m, opt, fresh);
  });
}

// Every rank passes its own copy of a state dict: one refused on one rank is refused on every rank
// (naming that rank's reason), and copies that differ between ranks are refused on every rank naming
// the first entry that differs (each rank would load its own replicated parameter, and the replicas
// would drift apart). Nothing changes either way.
TEST(CheckpointTest, StateDictsTheRanksDisagreeOnAreRefusedOnEveryRank) {
  with_small_gpt_on_2_ranks([&](testing::RankContext& ctx, GPT& m, const std::shared_ptr<Mesh>&, Muon& opt) {
    train_one_step(ctx, m, opt);
    const StateDictOptions all = on_every_rank();
    const TensorDict good = get_model_state_dict(*m, all);
    const OptimizerStateDict good_opt = get_optimizer_state_dict(*m, opt, all);
    auto unchanged = [&](const std::string& what) {
      const TensorDict now = get_model_state_dict(*m, all);
      for (const auto& [k, v] : good) expect(now.at(k).equal(v), what + ": '" + k + "' changed");
      const OptimizerStateDict o = get_optimizer_state_dict(*m, opt, all);
      for (size_t i = 0; i < o.param_groups.size(); ++i)
        expect(o.param_groups[i].lr == good_opt.param_groups[i].lr, what + ": a group's lr changed");
      for (const auto& [k, v] : good_opt.muon) expect(o.muon.at(k).equal(v), what + ": '" + k + "' changed");
    };
    // rank 1 refuses: both ranks raise, rank 0 with rank 1's reason
    TensorDict sd = good;
    if (ctx.rank == 1) sd.erase("layers.1.down_proj.weight");
    std::string err = error_of([&] { set_model_state_dict(*m, sd); });
    const std::string reason = "the state dict has no 'layers.1.down_proj.weight' (shape [32, 48])";
    expect(err.find(reason) != std::string::npos, "refusal: " + err);
    if (ctx.rank == 0)
      expect(err.find("rank 0: set_model_state_dict: rank(s) 1 refused the state dict they were given, so no rank "
                      "loads anything (rank 1: ") != std::string::npos,
             "the other rank's refusal: " + err);
    unchanged("a refused load");
    // the same keys, one value differs on rank 1 (a replicated parameter: each rank would keep its own)
    sd = good;
    if (ctx.rank == 1) sd["final_norm.weight"] = good.at("final_norm.weight") + 1e-3;
    err = error_of([&] { set_model_state_dict(*m, sd); });
    expect(err.find("rank " + std::to_string(ctx.rank) + ": set_model_state_dict: the ranks were given different "
                    "state dicts ('final_norm.weight' differs between rank 0 and rank 1), so each would load its own "
                    "and the replicas would drift apart; nothing was loaded.") != std::string::npos,
           "differing value: " + err);
    unchanged("a load of differing dicts");
    // a source that differs between ranks (another seed here; a stale copy of a file), known without reading it
    auto source = seeded_init(static_cast<uint64_t>(ctx.rank), [](const std::string&, at::Tensor& full, at::Generator& gen) {
      full.normal_(0, 0.02, gen);
    });
    err = error_of([&] { set_model_state_dict(*m, *source); });
    expect(err.find("the ranks were given different state dicts (the source's tensors (names, dtypes, shapes, "
                    "recorded checksums) differs between rank 0 and rank 1)") != std::string::npos,
           "differing source: " + err);
    unchanged("a load of differing sources");
    // a dtype differing in one rank's copy is a difference too (same shape, same values)
    sd = good;
    if (ctx.rank == 1) sd["layers.0.q_proj.weight"] = good.at("layers.0.q_proj.weight").to(at::kDouble);
    err = error_of([&] { set_model_state_dict(*m, sd); });
    expect(err.find("('layers.0.q_proj.weight' differs between rank 0 and rank 1)") != std::string::npos,
           "differing dtype: " + err);
    // the optimizer: a learning rate differing on one rank, and a refusal
    OptimizerStateDict osd = good_opt;
    if (ctx.rank == 1) osd.param_groups[0].lr *= 2;
    err = error_of([&] { set_optimizer_state_dict(*m, opt, osd); });
    expect(err.find("set_optimizer_state_dict: the ranks were given different state dicts (param_groups[0] "
                    "('default', Muon) differs between rank 0 and rank 1)") != std::string::npos,
           "differing lr: " + err);
    osd = good_opt;
    if (ctx.rank == 0) osd.muon["layers.0.q_proj.weight.momentum_buffer"] = osd.muon.at("layers.0.q_proj.weight.momentum_buffer") * 2;
    err = error_of([&] { set_optimizer_state_dict(*m, opt, osd); });
    expect(err.find("(Muon state 'layers.0.q_proj.weight.momentum_buffer' differs between rank 0 and rank 1)") !=
               std::string::npos,
           "differing momentum: " + err);
    osd = good_opt;
    if (ctx.rank == 0) osd.steps_taken = -1;
    err = error_of([&] { set_optimizer_state_dict(*m, opt, osd); });
    expect(err.find("steps_taken is -1; a step count must be >= 0.") != std::string::npos, "refusal: " + err);
    if (ctx.rank == 1) expect(err.find("rank(s) 0 refused the state dict they were given") != std::string::npos, err);
    unchanged("refused optimizer loads");
    // identical copies load (the model's values round-trip), NaN included
    sd = good;
    sd["final_norm.weight"] = at::full_like(good.at("final_norm.weight"), NAN);
    set_model_state_dict(*m, sd);
    expect(get_model_state_dict(*m, all).at("final_norm.weight").isnan().all().item<bool>(), "the NaN copy loaded");
    set_model_state_dict(*m, good);
    set_optimizer_state_dict(*m, opt, good_opt);
    unchanged("the agreed loads");
  });
}

// ---- checkpoint integrity ------------------------------------------------------------------------
std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::string s(std::filesystem::file_size(path), '\0');
  f.read(s.data(), static_cast<std::streamsize>(s.size()));
  return s;
}

void write_bytes(const std::string& path, const std::string& s) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(s.data(), static_cast<std::streamsize>(s.size()));
}

std::string bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

std::vector<size_t> find_all(const std::string& hay, const std::string& needle) {
  std::vector<size_t> out;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) out.push_back(p);
  return out;
}

// A model state dict and an optimizer state dict built directly (no training): Muon and AdamW
// entries, two groups with recognisable names and hyperparameters, distinct step counts.
struct SmallCheckpoint {
  TensorDict model;
  OptimizerStateDict optim;
};
SmallCheckpoint small_checkpoint() {
  at::manual_seed(11);
  SmallCheckpoint c;
  c.model["embed.weight"] = at::randn({64, 32});
  c.model["layers.0.q_proj.weight"] = at::randn({32, 32});
  c.model["layers.0.norm.weight"] = at::randn({32});
  c.optim.muon["layers.0.q_proj.weight.momentum_buffer"] = at::randn({32, 32});
  c.optim.muon["layers.0.q_proj.weight.step"] = at::scalar_tensor(1000003, at::kLong);
  for (const char* p : {"embed.weight", "layers.0.norm.weight"}) {
    const auto shape = c.model.at(p).sizes();
    c.optim.adamw[std::string(p) + ".exp_avg"] = at::randn(shape);
    c.optim.adamw[std::string(p) + ".exp_avg_sq"] = at::rand(shape);
    c.optim.adamw[std::string(p) + ".step"] = at::scalar_tensor(static_cast<int64_t>(c.optim.adamw.size()) + 2000003, at::kLong);
  }
  c.optim.param_groups.push_back({"hidden_matrices_muon", true, 0.0123456, 0.95, 0.01, 0.9, 0.95, 1e-8, true, 5});
  c.optim.param_groups.push_back({"embeddings_adamw", false, 0.0034567, 0.0, 0.02, 0.9, 0.95, 1e-8, false, 5});
  c.optim.steps_taken = 123456789;
  return c;
}

// The format-2 files earlier dmuon versions wrote (tests/data, written by small_checkpoint() at
// 8716d32): the reader still verifies every byte of them and names what is damaged.
const std::string kSmallFormat2 = std::string(DMUON_TEST_DATA_DIR) + "/checkpoint_v2_small.dmuonckp";

// The file holds small_checkpoint(): its integers, names and hyperparameters exactly, and its
// random tensors as this torch draws them up to the last bits of libm's log/cos (<= 1e-5 here:
// the draws agree to ~1e-7 across torch 1.13/2.11; any misread byte is far larger or NaN).
SmallCheckpoint small_format2_file() {
  const Checkpoint ck = load_checkpoint(kSmallFormat2);
  const SmallCheckpoint want = small_checkpoint();
  EXPECT_TRUE(ck.optim.has_value());
  EXPECT_EQ(ck.metadata.size(), 0u);
  auto same = [](const TensorDict& got, const TensorDict& w, const char* what) {
    ASSERT_EQ(got.size(), w.size()) << what;
    for (const auto& [k, v] : w) {
      ASSERT_TRUE(got.count(k)) << what << " " << k;
      const at::Tensor g = got.at(k);
      ASSERT_TRUE(g.sizes() == v.sizes() && g.scalar_type() == v.scalar_type()) << k;
      if (v.is_floating_point())
        EXPECT_TRUE(g.allclose(v, 1e-5, 1e-5)) << k << ": " << (g - v).abs().max().item<double>();
      else
        EXPECT_TRUE(g.equal(v)) << k;
    }
  };
  same(ck.model, want.model, "model");
  same(ck.optim->muon, want.optim.muon, "muon");
  same(ck.optim->adamw, want.optim.adamw, "adamw");
  return SmallCheckpoint{ck.model, *ck.optim};
}

TEST(CheckpointTest, CorruptedCheckpointsAreRefusedNamingTheTensorOrSection) {
  const std::string dir = testing::fresh_temp_dir("dmuon-ckpt-crc");
  const SmallCheckpoint sc = small_format2_file();
  const std::string bad = dir + "/bad.pt";
  const std::string good = read_bytes(kSmallFormat2);
  {  // the intact file loads exactly; saved again it is safetensors, and reads back the same
    const std::string resaved = dir + "/resaved.pt";
    save_checkpoint(resaved, sc.model, &sc.optim);
    EXPECT_EQ(SafetensorsFile(resaved).metadata().at("format"), "dmuon-checkpoint-safetensors-v1");
    const Checkpoint ck = load_checkpoint(resaved);
    ASSERT_TRUE(ck.optim.has_value());
    ASSERT_EQ(ck.model.size(), sc.model.size());
    for (const auto& [k, v] : sc.model) EXPECT_TRUE(ck.model.at(k).equal(v)) << k;
    for (const auto& [k, v] : sc.optim.muon) EXPECT_TRUE(ck.optim->muon.at(k).equal(v)) << k;
    for (const auto& [k, v] : sc.optim.adamw) EXPECT_TRUE(ck.optim->adamw.at(k).equal(v)) << k;
    ASSERT_EQ(ck.optim->param_groups.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      const auto &a = ck.optim->param_groups[i], &b = sc.optim.param_groups[i];
      EXPECT_TRUE(a.name == b.name && a.is_muon == b.is_muon && a.lr == b.lr && a.momentum == b.momentum &&
                  a.weight_decay == b.weight_decay && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
                  a.nesterov == b.nesterov && a.ns_steps == b.ns_steps)
          << "group " << i;
    }
    EXPECT_EQ(ck.optim->steps_taken, 123456789);
  }
  auto load_error = [&](const std::string& bytes) {
    write_bytes(bad, bytes);
    return error_of([&] { load_checkpoint(bad); });
  };
  auto says_corrupt = [&](const std::string& err) {  // names the file, says what to do
    return err.find("'" + bad + "' is corrupt") != std::string::npos &&
           err.find("another checkpoint") != std::string::npos;
  };
  std::vector<std::string> parts = {"optimizer metadata", "the archive's structure", "the checksum table",
                                    "its header", "its format tag"};
  for (const TensorDict* d : {&sc.model, &sc.optim.muon, &sc.optim.adamw})
    for (const auto& [k, v] : *d) parts.push_back("tensor '" + k + "'");
  // 4 bytes overwritten at 15, 40, 65 and 90% of the file
  for (const double frac : {0.15, 0.40, 0.65, 0.90}) {
    std::string b = good;
    const auto at = static_cast<size_t>(frac * static_cast<double>(b.size()));
    for (size_t i = at; i < at + 4; ++i) b[i] = static_cast<char>(b[i] ^ 0xFF);
    const std::string err = load_error(b);
    bool named = false;
    for (const auto& p : parts) named = named || err.find(p) != std::string::npos;
    EXPECT_TRUE(says_corrupt(err) && named) << "4 bytes at " << frac * 100 << "% (byte " << at << " of "
                                            << b.size() << "): " << err;
  }
  // one byte in the middle of a payload found by its unique bytes in the file
  auto flip_in = [&](const std::string& needle, const std::string& what, char mask) {
    const auto hits = find_all(good, needle);
    if (hits.size() != 1) {
      ADD_FAILURE() << what << ": its bytes occur " << hits.size() << " times in the file";
      return std::string();
    }
    std::string b = good;
    char& c = b[hits[0] + needle.size() / 2];
    c = static_cast<char>(c ^ mask);
    return load_error(b);
  };
  for (const TensorDict* d : {&sc.model, &sc.optim.muon, &sc.optim.adamw})
    for (const auto& [k, v] : *d) {
      const std::string err = flip_in(bytes_of(v), k, '\xFF');
      EXPECT_TRUE(says_corrupt(err) && err.find("tensor '" + k + "'") != std::string::npos) << k << ": " << err;
    }
  // metadata: a learning rate, steps_taken, a group name (the case of one letter)
  const double lr = 0.0123456;
  const int32_t steps = 123456789;
  const std::vector<std::pair<std::string, std::string>> meta = {
      {std::string(reinterpret_cast<const char*>(&lr), sizeof(lr)), "the first group's lr"},
      {std::string(reinterpret_cast<const char*>(&steps), sizeof(steps)), "steps_taken"},
      {"hidden_matrices_muon", "the first group's name"}};
  for (const auto& [needle, what] : meta) {
    const std::string err = flip_in(needle, what, what == "the first group's name" ? '\x20' : '\x01');
    EXPECT_TRUE(says_corrupt(err) && err.find("optimizer metadata") != std::string::npos) << what << ": " << err;
  }
  // every rank reads the file itself, and every rank refuses it
  {
    std::string b = good;
    b[b.size() / 2] = static_cast<char>(b[b.size() / 2] ^ 0xFF);
    write_bytes(bad, b);
  }
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    const std::string err = error_of([&] { load_checkpoint(bad); });
    expect(says_corrupt(err), "rank " + std::to_string(ctx.rank) + " loaded a corrupt file: " + err);
  });
  std::filesystem::remove_all(dir);
}

// A damaged tensor found while the ranks read a checkpoint (each reads only what it keeps) leaves every
// rank's model as it was: no rank writes anything before every rank has read all it needs.
TEST(CheckpointTest, ADamagedTensorFoundByOneRankLeavesEveryModelAsItWas) {
  const std::string dir = testing::fresh_temp_dir("dmuon-ckpt-staged");
  for (const Layout& l : {Layout{"N2", 2}, Layout{"N2 sharded all_gather", 2, 1, true, false, true, "all_gather"}}) {
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      const GPTConfig cfg = testing::small_config(2);
      GPT m(cfg);
      auto mesh = make_mesh(ctx);
      dedicate(m, mesh, l);
      Muon opt(m.ptr(), testing::muon_options({}));
      train_one_step(ctx, m, opt);
      const StateDictOptions all = on_every_rank();
      const TensorDict before = get_model_state_dict(*m, all);
      TensorDict next;  // every value differs from the model's
      for (const auto& [k, v] : before) next[k] = v + 1;
      // each rank its own copy of the file; rank 1's has every tensor's payload damaged (its recorded
      // checksums, so the source's identity, are intact: the ranks agree on what they were given)
      const std::string path = dir + "/" + l.label + "-rank" + std::to_string(ctx.rank) + ".pt";
      save_checkpoint(path, next);
      if (ctx.rank == 1) {
        std::string b = read_bytes(path);
        for (const auto& [k, v] : next)
          for (size_t at : find_all(b, bytes_of(v))) b[at + v.nbytes() / 2] = static_cast<char>(b[at + v.nbytes() / 2] ^ 0x40);
        write_bytes(path, b);
      }
      const std::string err = error_of([&] { set_model_state_dict(*m, *checkpoint_model_source(path)); });
      expect(err.find("reading the parameter values failed on rank(s) 1") != std::string::npos &&
                 err.find("Nothing was written: the model holds the values it had before.") != std::string::npos,
             l.label + ": rank " + std::to_string(ctx.rank) + ": " + err);
      if (ctx.rank == 1) expect(err.find("is corrupt") != std::string::npos, l.label + ": the damage named: " + err);
      const TensorDict after = get_model_state_dict(*m, all);
      for (const auto& [k, v] : before) expect(after.at(k).equal(v), l.label + ": '" + k + "' changed by a failed load");
      // the intact copy loads every value, and training goes on from it on every rank alike
      if (ctx.rank == 1) save_checkpoint(path, next);
      set_model_state_dict(*m, *checkpoint_model_source(path));
      const TensorDict loaded = get_model_state_dict(*m, all);
      for (const auto& [k, v] : next) expect(loaded.at(k).equal(v), l.label + ": '" + k + "' not loaded");
      train_one_step(ctx, m, opt);
    });
  }
  std::filesystem::remove_all(dir);
}

TEST(CheckpointTest, TruncatedEmptyForeignAndFormat1FilesAreClearErrors) {
  const std::string dir = testing::fresh_temp_dir("dmuon-ckpt-trunc");
  const SmallCheckpoint sc = small_format2_file();
  const std::string bad = dir + "/bad.pt";
  const std::string good = read_bytes(kSmallFormat2);
  auto load_error = [&](const std::string& bytes) {
    write_bytes(bad, bytes);
    return error_of([&] { load_checkpoint(bad); });
  };
  auto has = [](const std::string& err, const std::string& s) { return err.find(s) != std::string::npos; };
  std::string err = load_error(good.substr(0, good.size() * 6 / 10));
  EXPECT_TRUE(has(err, "'" + bad + "' is truncated: " + std::to_string(good.size() * 6 / 10) + " of its " +
                           std::to_string(good.size()) + " bytes"))
      << err;
  err = load_error(good.substr(0, 20));
  EXPECT_TRUE(has(err, "'" + bad + "' is truncated")) << err;
  err = load_error("");
  EXPECT_TRUE(has(err, "'" + bad + "' is not a readable checkpoint: it is empty")) << err;
  err = load_error(good + "trailing");
  EXPECT_TRUE(has(err, "'" + bad + "' is corrupt") && has(err, "8 bytes follow")) << err;
  err = load_error("step,loss\n1,2.5\n");
  EXPECT_TRUE(has(err, "'" + bad + "' is not a readable checkpoint")) << err;
  {  // a newer format version (header rewritten consistently, with its checksum)
    std::string b = good;
    b[8] = 3;
    const uint32_t crc = checkpoint_crc32c(b.data(), 28);
    for (int i = 0; i < 4; ++i) b[28 + i] = static_cast<char>(crc >> (8 * i));
    err = load_error(b);
    EXPECT_TRUE(has(err, "'" + bad + "' has checkpoint format version 3; this dmuon reads version 2")) << err;
  }
  {  // format 1 (a bare torch archive, before checksums) and other torch archives
    torch::serialize::OutputArchive ar;
    ar.write("format", c10::IValue(std::string("dmuon-checkpoint-v1")));
    c10::Dict<std::string, at::Tensor> model;
    for (const auto& [k, v] : sc.model) model.insert(k, v);
    ar.write("model", c10::IValue(model));
    ar.save_to(bad);
    err = error_of([&] { load_checkpoint(bad); });
    EXPECT_TRUE(has(err, "'" + bad + "' is a dmuon checkpoint of format version 1, which has no checksums")) << err;
    torch::serialize::OutputArchive other;
    other.write("weights", sc.model.at("embed.weight"));
    other.save_to(bad);
    err = error_of([&] { load_checkpoint(bad); });
    EXPECT_TRUE(has(err, "'" + bad + "' is a torch archive but not a dmuon checkpoint")) << err;
  }
  std::filesystem::remove_all(dir);
}

// issue 34: what a file says is checked as strictly as a state dict (every file), and the
// caller's metadata round-trips under the checksums
TEST(CheckpointTest, FilesWithOutOfRangeHyperparametersAreRefusedAndMetadataRoundTrips) {
  const std::string dir = testing::fresh_temp_dir("dmuon-ckpt-hp");
  SmallCheckpoint sc = small_checkpoint();
  const std::map<std::string, std::string> meta{{"run", "{\"seed\": 3}"}, {"by", "test"}};
  for (const std::string ext : {".pt", ".safetensors"}) {
    const std::string path = dir + "/ck" + ext;
    save_checkpoint(path, sc.model, &sc.optim, meta);
    // safetensors whatever the name ends in
    EXPECT_EQ(SafetensorsFile(path).metadata().at("format"), "dmuon-checkpoint-safetensors-v1") << ext;
    const Checkpoint ck = load_checkpoint(path);
    EXPECT_EQ(ck.metadata, meta) << ext;
    OptimizerStateDict bad = sc.optim;
    bad.param_groups[0].lr = -1;
    save_checkpoint(path, sc.model, &bad);
    const std::string err = error_of([&] { load_checkpoint(path); });
    EXPECT_NE(err.find("'" + path + "': param_groups[0] ('hidden_matrices_muon', Muon) has lr: -1. Must be >= 0."),
              std::string::npos) << err;
    bad = sc.optim;
    bad.param_groups[1].eps = 0;
    save_checkpoint(path, sc.model, &bad);
    EXPECT_NE(error_of([&] { load_checkpoint(path); }).find("('embeddings_adamw', AdamW) has eps: 0. Must be > 0."),
              std::string::npos) << ext;
  }
  std::filesystem::remove_all(dir);
}

// issue 34 item 10: a save removes the temporary files of earlier saves whose process died mid-write
// A log's later rows are appended to the file write_file_atomically made (not rewritten whole); a missing file
// or a link put at its name is an error naming the writer and the path, nothing written through the link.
TEST(CheckpointTest, AppendFileDurablyAddsToTheEndAndNeverFollowsALink) {
  namespace fs = std::filesystem;
  const std::string dir = testing::fresh_temp_dir("dmuon-append"), path = dir + "/metrics.csv";
  write_file_atomically(path, "step,loss\n1,2.5\n");
  append_file_durably(path, "2,2.25\n", "the log");
  append_file_durably(path, "", "the log");
  append_file_durably(path, "3,2\n", "the log");
  std::ifstream in(path);
  const std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "step,loss\n1,2.5\n2,2.25\n3,2\n");
  const std::string missing = error_of([&] { append_file_durably(dir + "/gone.csv", "x\n", "the log"); });
  EXPECT_NE(missing.find("the log: appending to '" + dir + "/gone.csv' failed: cannot open it"), std::string::npos)
      << missing;
  fs::create_symlink(path, dir + "/link.csv");
  const std::string linked = error_of([&] { append_file_durably(dir + "/link.csv", "x\n", "the log"); });
  EXPECT_NE(linked.find("cannot open it"), std::string::npos) << linked;
  EXPECT_EQ(fs::file_size(path), content.size()) << "nothing was written through the link";
  fs::remove_all(dir);
}

TEST(CheckpointTest, ASaveRemovesStaleTemporaryFilesOfDeadWriters) {
  const std::string dir = testing::fresh_temp_dir("dmuon-ckpt-tmp");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // its PID now names no process
  const std::string dead = dir + "/.ck.pt.tmp-" + std::to_string(child), live = dir + "/.ck.pt.tmp-1",
                    other = dir + "/.other.pt.tmp-" + std::to_string(child);
  for (const auto& f : {dead, live, other}) std::ofstream(f) << "partial";
  const SmallCheckpoint sc = small_checkpoint();
  save_checkpoint(dir + "/ck.pt", sc.model);
  EXPECT_FALSE(std::filesystem::exists(dead)) << "a dead writer's temporary file was left";
  EXPECT_TRUE(std::filesystem::exists(live)) << "a live process's temporary file was removed";
  EXPECT_TRUE(std::filesystem::exists(other)) << "another file's temporary was removed";
  EXPECT_TRUE(load_checkpoint(dir + "/ck.pt").model.count("embed.weight"));
  std::filesystem::remove_all(dir);
}

// SIGTERM (or SIGINT) in the middle of a save: the writer's temporary file is removed before the
// signal ends the process; the target is untouched.
TEST(CheckpointTest, ASignalDuringASaveRemovesItsTemporaryFile) {
  for (const int sig : {SIGTERM, SIGINT}) {
    const std::string dir = testing::fresh_temp_dir("dmuon-ckpt-sig");
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      io::write_atomically(dir + "/ck.pt", "test", [sig](int fd) {
        (void)io::write_all(fd, "partial", 7, 0);
        ::raise(sig);
      });
      ::_exit(0);  // not reached: the signal ends the process
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      ADD_FAILURE() << "left behind after signal " << sig << ": " << e.path();
    std::filesystem::remove_all(dir);
  }
}

TEST(CheckpointTest, ChecksumIsCrc32c) {
  EXPECT_EQ(checkpoint_crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xFF');
  EXPECT_EQ(checkpoint_crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(checkpoint_crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(checkpoint_crc32c(nullptr, 0), 0u);
  // any split, any alignment: the same CRC (byte by byte goes through the table, bulk through the fast path)
  std::string data(10007, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  for (const size_t start : {size_t{0}, size_t{3}}) {
    const char* p = data.data() + start;
    const size_t n = data.size() - start;
    const uint32_t bulk = checkpoint_crc32c(p, n);
    uint32_t bytewise = 0;
    for (size_t i = 0; i < n; ++i) bytewise = checkpoint_crc32c(p + i, 1, bytewise);
    EXPECT_EQ(bytewise, bulk) << "start " << start;
    EXPECT_EQ(checkpoint_crc32c(p + 1001, n - 1001, checkpoint_crc32c(p, 1001)), bulk) << "start " << start;
  }
}

}  // namespace
}  // namespace dmuon
