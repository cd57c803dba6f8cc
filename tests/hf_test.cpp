// The Hugging Face decoder families (apps/model/hf_decoder.h): transformers' names and shapes (the
// same the planner derives from a config.json), config errors, the math's closed-form pieces,
// weights loaded by name, and dedicated training (Z3, Z2 with a sharded base, HSDP, tensor
// parallelism by heads with GQA and biases, TP x data parallel) equal to one process in float64,
// with validation forwards in between changing nothing.
#include <gtest/gtest.h>

#include <ATen/core/grad_mode.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "dmuon/checkpoint.h"
#include "dmuon/tools/model_specs.h"
#include "dmuon/safetensors.h"
#include "model/dedicated_gpt.h"
#include "model/hf_decoder.h"
#include "support/training.h"

namespace {

using namespace dmuon;
using namespace dmuon::testing;
using json = nlohmann::json;
using models::HFCausalLMImpl;
using models::HFDecoderConfig;

json base(const std::string& type) {
  return {{"model_type", type},       {"vocab_size", 260},          {"hidden_size", 32},
          {"intermediate_size", 48},  {"num_hidden_layers", 2},     {"num_attention_heads", 4},
          {"num_key_value_heads", 2}, {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6},
          {"rope_theta", 10000.0},    {"hidden_act", "silu"},       {"tie_word_embeddings", false}};
}

std::vector<json> families() {
  json llama = base("llama");
  llama["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                           {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 16}};
  llama["attention_bias"] = true;
  json mistral = base("mistral");
  mistral["sliding_window"] = 4;
  json qwen2 = base("qwen2");
  json qwen3 = base("qwen3");
  qwen3["head_dim"] = 16;  // not hidden / heads: q_proj is 32 -> 64
  qwen3["tie_word_embeddings"] = true;
  return {llama, mistral, qwen2, qwen3};
}

TEST(HFDecoder, NamesAndShapesAreTransformersAsThePlannerKnowsThem) {
  for (const json& j : families()) {
    HFCausalLMImpl m(HFDecoderConfig::parse(j.dump(), "test"));
    std::map<std::string, std::vector<int64_t>> got, want;
    for (const auto& p : m.named_parameters(true)) got[p.key()] = p.value().sizes().vec();
    for (const auto& p : model_from_hf_config(j.dump(), "test").params) want[p.name] = p.shape;
    EXPECT_EQ(got, want) << j["model_type"];
  }
  HFCausalLMImpl q3(HFDecoderConfig::parse(families()[3].dump(), "test"));
  const auto params = q3.named_parameters(true);
  EXPECT_TRUE(params.contains("model.layers.1.self_attn.q_norm.weight"));
  EXPECT_FALSE(params.contains("lm_head.weight"));  // tied
  HFCausalLMImpl q2(HFDecoderConfig::parse(families()[2].dump(), "test"));
  EXPECT_TRUE(q2.named_parameters(true).contains("model.layers.0.self_attn.k_proj.bias"));
  EXPECT_FALSE(q2.named_parameters(true).contains("model.layers.0.self_attn.o_proj.bias"));
  EXPECT_TRUE(q2.is_muon_matrix("model.layers.0.mlp.up_proj.weight", at::ones({2, 2})));
  EXPECT_FALSE(q2.is_muon_matrix("model.embed_tokens.weight", at::ones({2, 2})));
  EXPECT_FALSE(q2.is_muon_matrix("model.layers.0.self_attn.k_proj.bias", at::ones({2})));
}

TEST(HFDecoder, ConfigMistakesAreClearErrors) {
  json j = base("llama");
  j["vocab_size"] = 100;
  EXPECT_NE(error_of([&] { HFDecoderConfig::parse(j.dump(), "cfg.json"); }).find("vocab_size 100 is below 256"),
            std::string::npos);
  j = base("gpt2");
  EXPECT_NE(error_of([&] { HFDecoderConfig::parse(j.dump(), "cfg.json"); }).find("\"gpt2\" is not a family"),
            std::string::npos);
  j = base("llama");
  j["hidden_act"] = "gelu";
  EXPECT_NE(error_of([&] { HFDecoderConfig::parse(j.dump(), "cfg.json"); }).find("hidden_act"), std::string::npos);
  j = base("llama");
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  EXPECT_NE(error_of([&] { HFDecoderConfig::parse(j.dump(), "cfg.json"); }).find("\"yarn\" is not supported"),
            std::string::npos);
  j = base("llama");
  j.erase("hidden_size");
  EXPECT_NE(error_of([&] { HFDecoderConfig::parse(j.dump(), "cfg.json"); }).find("cfg.json: the config has no \"hidden_size\""),
            std::string::npos);
  j = base("llama");
  j["num_key_value_heads"] = 3;
  EXPECT_NE(error_of([&] { HFDecoderConfig::parse(j.dump(), "cfg.json"); }).find("not a multiple of num_key_value_heads"),
            std::string::npos);
  // sizes beyond any real model (heads x head_dim overflowed int64 and slipped past the memory estimate)
  j = base("llama");
  j["num_attention_heads"] = j["num_key_value_heads"] = j["head_dim"] = 4294967296;
  EXPECT_NE(error_of([&] { HFDecoderConfig::parse(j.dump(), "cfg.json"); })
                .find("cfg.json: \"num_attention_heads\" is 4294967296, above the limit of 1048576"),
            std::string::npos);
  j = base("llama");
  j["num_hidden_layers"] = 20000;
  EXPECT_NE(error_of([&] { HFDecoderConfig::parse(j.dump(), "cfg.json"); }).find("above the limit of 10000"),
            std::string::npos);
  // a rope_type that is not a string: said with the field, not a bare JSON type error
  j = base("llama");
  j["rope_scaling"] = {{"rope_type", 5}};
  EXPECT_NE(error_of([&] { HFDecoderConfig::parse(j.dump(), "cfg.json"); })
                .find("cfg.json: rope_scaling's rope_type must be a string, got a number"),
            std::string::npos);
}

// Closed forms: with zero attention and MLP projections every layer is the identity, so the logits
// are lm_head(norm(embedding)); with one position the attention output is o(v(x)) whatever the
// rotary and the mask do.
TEST(HFDecoder, ClosedFormsOfTheBlock) {
  json j = base("llama");
  HFCausalLMImpl m(HFDecoderConfig::parse(j.dump(), "test"));
  m.to(at::kDouble);
  at::NoGradGuard ng;
  for (auto& layer : m.model->layers) {
    for (auto& p : layer->mlp->named_parameters(true)) p.value().zero_();
    layer->self_attn->o_proj.plain->weight.zero_();
  }
  const at::Tensor tokens = at::randint(0, 260, {2, 7}, at::kLong);
  const at::Tensor e = m.model->embed_tokens->weight.index_select(0, tokens.reshape({-1})).reshape({2, 7, 32});
  const at::Tensor n = e * at::rsqrt(e.pow(2).mean({-1}, true) + 1e-6) * m.model->norm->weight;
  const at::Tensor want = at::matmul(n, m.lm_head->weight.t());
  EXPECT_LT((m.forward(tokens) - want).abs().max().item<double>(), 1e-12);
  // one position: softmax over one key is 1
  HFCausalLMImpl one(HFDecoderConfig::parse(j.dump(), "test"));
  one.to(at::kDouble);
  auto& attn = one.model->layers[0]->self_attn;
  const at::Tensor x = at::randn({1, 1, 32}, at::kDouble);
  const at::Tensor v = attn->v_proj.plain(x).view({1, 1, 2, 8});
  const at::Tensor rep = v.repeat_interleave(2, 2).reshape({1, 1, 32});  // each KV head serves 2 query heads
  EXPECT_LT((attn->forward(x) - attn->o_proj.plain(rep)).abs().max().item<double>(), 1e-12);
}

TEST(HFDecoder, WeightsLoadByNameAndMistakesNameTheTensor) {
  const std::string dir = std::filesystem::temp_directory_path() / "dmuon-hf-weights";
  std::filesystem::create_directories(dir);
  const json j = families()[2];
  HFCausalLMImpl a(HFDecoderConfig::parse(j.dump(), "test")), b(HFDecoderConfig::parse(j.dump(), "test"));
  std::map<std::string, at::Tensor> sd;
  for (const auto& p : a.named_parameters(true)) sd[p.key()] = p.value().detach().to(at::kBFloat16);
  save_safetensors(dir + "/w.safetensors", sd);
  models::load_weights(dir + "/w.safetensors", b, nullptr);
  for (const auto& p : b.named_parameters(true))
    EXPECT_TRUE(at::equal(p.value(), sd.at(p.key()).to(at::kFloat))) << p.key();
  auto broken = sd;
  broken.erase("model.norm.weight");
  save_safetensors(dir + "/missing.safetensors", broken);
  EXPECT_NE(error_of([&] { models::load_weights(dir + "/missing.safetensors", b, nullptr); })
                .find("parameter 'model.norm.weight' is not in the file"),
            std::string::npos);
  broken = sd;
  broken["model.layers.0.mlp.up_proj.weight"] = at::zeros({3, 3});
  save_safetensors(dir + "/shape.safetensors", broken);
  EXPECT_NE(error_of([&] { models::load_weights(dir + "/shape.safetensors", b, nullptr); })
                .find("'model.layers.0.mlp.up_proj.weight' has shape [3, 3]"),
            std::string::npos);
  broken = sd;
  broken["model.layers.0.self_attn.rotary_emb.inv_freq"] = at::ones({4});  // old exports: ignored
  broken["lm_head.extra"] = at::ones({4});
  save_safetensors(dir + "/extra.safetensors", broken);
  EXPECT_NE(error_of([&] { models::load_weights(dir + "/extra.safetensors", b, nullptr); }).find("'lm_head.extra'"),
            std::string::npos);
  std::filesystem::remove_all(dir);
}

// Dedicated training of an HF model: rank 0's full state after `steps` steps.
// tp > 1: tensor parallelism over groups of tp ranks (each split parameter takes its slice).
StateDict train_hf(const json& j, int world, bool z3, bool shard_base, bool evaluate, const StateDict& init,
                   const std::vector<at::Tensor>& batches, int tp = 1, int replicate = 1) {
  StateDict result;
  std::mutex mu;
  run_ranks(world, [&](RankContext& ctx) {
    auto mesh = make_mesh(ctx, std::chrono::seconds(60), replicate, tp);
    HFDecoderConfig cfg = HFDecoderConfig::parse(j.dump(), "test");
    if (tp > 1) cfg.tp_mesh = mesh;
    auto m = std::make_shared<HFCausalLMImpl>(cfg);
    m->to(at::kDouble);
    {
      at::NoGradGuard ng;
      const std::map<std::string, int> split = tp_split_dims(*m);
      for (auto& p : m->named_parameters(true)) {
        at::Tensor v = init.at(p.key());
        if (auto it = split.find(p.key()); it != split.end()) v = tp_slice(v, it->second, mesh->tp_rank(), tp);
        p.value().copy_(v);
      }
    }
    models::DedicatedModelSetup s;
    s.param_dtype = "fp64";
    s.z3 = z3;
    s.shard_base = shard_base;
    s.pack_small_params = false;
    models::dedicate_model(*m, mesh, s, tp > 1);
    TrainConfig tc;
    Muon opt(m, muon_options(tc));
    // the TP ranks of a group see the same rows
    const int dp = world / tp, dp_rank = mesh->replicate_rank() * mesh->shard_size() + mesh->shard_rank();
    const int64_t per = batches[0].size(0) / dp;
    for (const at::Tensor& b : batches) {
      opt.zero_grad();
      m->loss(b.narrow(0, dp_rank * per, per)).backward();
      opt.step();
      if (evaluate) {  // a validation forward between steps, as dmuon train does
        at::NoGradGuard ng;
        (void)m->loss(b.narrow(0, dp_rank * per, per).flip({1})).item<double>();
      }
    }
    TensorDict sd = get_model_state_dict(*m);
    if (ctx.rank == 0) {
      std::lock_guard<std::mutex> lk(mu);
      result = sd;
    }
  });
  return result;
}

TEST(HFDecoder, DedicatedAndTensorParallelTrainingIsOneProcessInFloat64) {
  const std::vector<at::Tensor> batches = make_batches(3, 4, 9, 260, 5);
  for (const json& j : {families()[0], families()[3]}) {  // llama (GQA, biases, llama3 rope), qwen3 (q/k norms, tied)
    at::manual_seed(3);
    HFCausalLMImpl init_model(HFDecoderConfig::parse(j.dump(), "test"));
    StateDict init;
    for (const auto& p : init_model.named_parameters(true)) init[p.key()] = p.value().detach().to(at::kDouble);
    const StateDict ref = train_hf(j, 1, true, false, false, init, batches);
    struct Case {
      const char* label;
      bool z3, shard, eval;
      int tp, world, replicate = 1;
    };
    const bool tied = j.value("tie_word_embeddings", false);
    for (const Case& c : {Case{"z3", true, false, false, 1, 2}, Case{"z3+eval", true, false, true, 1, 2},
                          Case{"z2+shard_base", false, !tied, false, 1, 2}, Case{"tp2", true, false, false, 2, 2},
                          Case{"z3 x tp2", true, false, false, 2, 4}, Case{"hsdp 2x2", true, false, false, 1, 4, 2}}) {
      const StateDict got = train_hf(j, c.world, c.z3, c.shard, false, init, batches, c.tp, c.replicate);
      double worst = 0;
      for (const auto& [k, v] : ref) worst = std::max(worst, max_rel(got.at(k), v));
      std::string at;
      for (const auto& [k, v] : ref)
        if (max_rel(got.at(k), v) == worst) at = k;
      EXPECT_LT(worst, kFloat64Bound) << j["model_type"] << " " << c.label << " worst at " << at;
      // the weights moved: the comparison is not of two untouched copies
      EXPECT_GT(max_rel(got.at("model.layers.0.mlp.up_proj.weight"), init.at("model.layers.0.mlp.up_proj.weight")),
                1e-3);
      if (c.eval) {
        const StateDict with_eval = train_hf(j, c.world, c.z3, c.shard, true, init, batches, c.tp, c.replicate);
        double d = 0;
        for (const auto& [k, v] : got) d = std::max(d, max_rel(with_eval.at(k), v));
        EXPECT_LT(d, kFloat64Bound) << "validation forwards changed the training (" << j["model_type"] << ")";
      }
    }
  }
}

}  // namespace
