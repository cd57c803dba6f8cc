// Checkpoints: full state dicts of a dedicated model and its optimizer, written atomically, resume
// on another world size / mesh exactly where uninterrupted training would be.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/optim/schedulers/step_lr.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "dmuon/checkpoint.h"
#include "dmuon/dedicate.h"
#include "dmuon/muon.h"
#include "model/gpt.h"
#include "runtime/state.h"  // white-box: masters
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

// Trains `first` for half the steps, checkpoints to a file, resumes on `second` for the rest and
// compares every parameter, momentum buffer and AdamW moment with uninterrupted single-process fp32
// training.
void check_resume(const Layout& first, const Layout& second) {
  testing::TrainConfig tc;
  tc.steps = 6;
  const GPTConfig cfg = testing::small_config(2);
  const auto init = testing::init_state(cfg, 1234);
  const int64_t global_batch = 12;
  const auto batches = testing::make_batches(tc.steps, global_batch, 12, cfg.vocab_size, 99);
  const auto ref = testing::reference_train(cfg, init, batches, tc);
  const std::vector<at::Tensor> part1(batches.begin(), batches.begin() + 3), part2(batches.begin() + 3, batches.end());
  const std::string dir = testing::fresh_temp_dir("dmuon-ckpt");
  const std::string path = dir + "/step3.pt";
  testing::run_ranks(first.world, [&](testing::RankContext& ctx) {
    GPT m(cfg);
    testing::load_state(m, init);
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
  });
  ASSERT_TRUE(std::filesystem::exists(path));
  for (const auto& f : std::filesystem::directory_iterator(dir))
    EXPECT_EQ(f.path().filename().string(), "step3.pt") << "a temporary file was left behind";
  std::mutex mu;
  TensorDict final_model;
  OptimizerStateDict final_optim;
  testing::run_ranks(second.world, [&](testing::RankContext& ctx) {
    GPT m(cfg);  // a fresh random init: everything must come from the checkpoint
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
      for (const auto& [k, v] : ck.model) expect(msd.at(k).equal(v), "model round trip of " + k);
      const auto osd = get_optimizer_state_dict(*m, opt, all);
      expect(osd.muon.size() == ck.optim->muon.size() && osd.adamw.size() == ck.optim->adamw.size(), "optim keys");
      for (const auto& [k, v] : ck.optim->muon) expect(osd.muon.at(k).equal(v), "momentum round trip of " + k);
      for (const auto& [k, v] : ck.optim->adamw) expect(osd.adamw.at(k).equal(v), "AdamW round trip of " + k);
    }
    testing::train_slices(m, opt, part2, ctx.rank, global_batch / ctx.world);
    StateDictOptions all;
    all.rank0_only = false;
    const auto msd = get_model_state_dict(*m, all);
    const auto osd = get_optimizer_state_dict(*m, opt, all);
    std::lock_guard<std::mutex> g(mu);
    if (ctx.rank == 0) {
      final_model = msd;
      final_optim = osd;
    } else {  // every rank returns the same dict with rank0_only = false
      for (const auto& [k, v] : msd) expect(final_model.empty() || v.equal(final_model.at(k)), "rank copies of " + k);
    }
  });
  std::filesystem::remove_all(dir);
  ASSERT_EQ(final_model.size(), ref.params.size()) << first.label << " -> " << second.label;
  for (const auto& [k, v] : ref.params)
    EXPECT_LE(max_rel(final_model.at(k), v), 1e-5) << k << " (" << first.label << " -> " << second.label << ")";
  ASSERT_EQ(final_optim.muon.size(), 2 * ref.momentum.size());
  ASSERT_EQ(final_optim.adamw.size(), 3 * ref.exp_avg.size());
  for (const auto& [k, v] : ref.momentum)
    EXPECT_LE(max_rel(final_optim.muon.at(k + ".momentum_buffer"), v), 1e-5) << k << " momentum";
  for (const auto& [k, v] : ref.exp_avg) {
    EXPECT_LE(max_rel(final_optim.adamw.at(k + ".exp_avg"), v), 1e-4) << k << " exp_avg";
    EXPECT_EQ(final_optim.adamw.at(k + ".step").item<int64_t>(), 6) << k;
  }
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
    auto st = get_comm_ctx(*m);
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
      if (!st->sharded_index.count(name)) expect(p.equal(sd.at(name).to(at::kBFloat16)), "bf16 copy of " + name);
  });
}

TEST(CheckpointTest, LearningRatesAndGroupsAreRestored) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    const GPTConfig cfg = testing::small_config(2);
    GPT m(cfg);
    auto mesh = make_mesh(ctx);
    dedicate(m, mesh, {"N2", 2});
    Muon opt(m.ptr(), testing::muon_options({}));
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

}  // namespace
}  // namespace dmuon
