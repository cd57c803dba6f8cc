// Interoperability with Python's tools (PyPI's transformers, safetensors and torch, run as a
// subprocess; the CI's LibTorch 2.x build configures DMUON_PYTHON): transformers' model given dmuon's
// weights gives dmuon's logits for llama, mistral, qwen2 and qwen3, dmuon given transformers' weights
// gives transformers' logits, and safetensors checkpoints cross both ways.
//
// Both models run in float64, but transformers' eager path computes RMSNorm, softmax and the rotary
// tables in float32 even then, so the logits agree to float32 rounding: measured worst 1.03e-7
// relative (2026-12-01, transformers 5.24), bound 2e-6 (19x). A wrong formula (rotation layout, GQA
// head mapping, a bias, the norm's placement, the mask) differs by 1e-2 or more.
#include <gtest/gtest.h>

#include <ATen/core/grad_mode.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dmuon/checkpoint.h"
#include "dmuon/safetensors.h"
#include "model/hf_decoder.h"
#include "support/temp_dir.h"

#ifndef DMUON_PYTHON
#define DMUON_PYTHON ""
#endif

namespace {

using namespace dmuon;
using json = nlohmann::json;

std::string python() { return DMUON_PYTHON; }
constexpr double kBound = 2e-6;  // see the top of the file

std::string temp_dir() { return dmuon::testing::fresh_temp_dir("dmuon-interop"); }

// Runs tests/python/interop.py; returns its exit status (its output goes to the test log).
int py(const std::string& mode, const std::string& dir) {
  const std::string cmd = "HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 300 " + python() + " " +
                          DMUON_SOURCE_DIR + "/tests/python/interop.py " + mode + " " + dir + " 2>&1";
  return std::system(cmd.c_str());
}

std::vector<json> configs() {
  auto base = [](const std::string& type) {
    return json{{"model_type", type},       {"vocab_size", 300},          {"hidden_size", 32},
                {"intermediate_size", 40},  {"num_hidden_layers", 2},     {"num_attention_heads", 4},
                {"num_key_value_heads", 2}, {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-5},
                {"rope_theta", 500.0},      {"hidden_act", "silu"},       {"tie_word_embeddings", false}};
  };
  json llama = base("llama");
  llama["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                           {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8}};
  json mistral = base("mistral");
  mistral["sliding_window"] = 4;
  mistral["num_key_value_heads"] = 1;
  json qwen2 = base("qwen2");
  json qwen3 = base("qwen3");
  qwen3["head_dim"] = 16;
  qwen3["tie_word_embeddings"] = true;
  return {llama, mistral, qwen2, qwen3};
}

at::Tensor logits(models::HFCausalLMImpl& m, const at::Tensor& tokens) {
  at::NoGradGuard ng;
  return m.forward(tokens);
}

TEST(Interop, TransformersAndDmuonComputeTheSameLogitsFromEachOthersWeights) {
  if (python().empty()) GTEST_SKIP() << "DMUON_PYTHON is not configured (the LibTorch 2.x CI build sets it)";
  for (const json& cfg : configs()) {
    const std::string dir = temp_dir();
    std::ofstream(dir + "/config.json") << cfg.dump(2);
    at::manual_seed(7);
    models::HFCausalLMImpl m(models::HFDecoderConfig::parse(cfg.dump(), "config.json"));
    m.to(at::kDouble);
    {  // norms away from 1 so their weights matter
      at::NoGradGuard ng;
      for (auto& p : m.named_parameters(true))
        if (p.key().find("norm") != std::string::npos) p.value().uniform_(0.5, 1.5);
    }
    const at::Tensor tokens = at::randint(0, 256, {2, 12}, at::kLong);
    std::map<std::string, at::Tensor> w;
    for (const auto& p : m.named_parameters(true)) w[p.key()] = p.value().detach();
    save_safetensors(dir + "/weights.safetensors", w, {{"format", "pt"}});
    save_safetensors(dir + "/logits.safetensors", {{"tokens", tokens}, {"logits", logits(m, tokens)}});
    EXPECT_EQ(py("check-logits", dir), 0) << cfg["model_type"];
    // the other way: transformers' weights in dmuon
    ASSERT_EQ(py("write-reference", dir), 0) << cfg["model_type"];
    models::HFCausalLMImpl d(models::HFDecoderConfig::parse(cfg.dump(), "config.json"));
    d.to(at::kDouble);
    models::load_weights(dir + "/py_weights.safetensors", d, nullptr);
    const SafetensorsDict ref = load_safetensors(dir + "/py_logits.safetensors");
    const at::Tensor want = ref.at("logits");
    const double err = ((logits(d, ref.at("tokens")) - want).abs().max() / want.abs().max()).item<double>();
    EXPECT_LT(err, kBound) << cfg["model_type"] << ": dmuon on transformers' weights";
    std::filesystem::remove_all(dir);
  }
}

TEST(Interop, SafetensorsCheckpointsCrossBetweenDmuonAndPython) {
  if (python().empty()) GTEST_SKIP() << "DMUON_PYTHON is not configured (the LibTorch 2.x CI build sets it)";
  const std::string dir = temp_dir();
  TensorDict model{{"layers.0.w", at::arange(12, at::kFloat).reshape({3, 4}) / 8}, {"norm.weight", at::ones({4})}};
  OptimizerStateDict o;
  o.muon["layers.0.w.momentum_buffer"] = at::full({3, 4}, 0.25);
  o.muon["layers.0.w.step"] = at::tensor(int64_t{9}).reshape({});
  o.adamw["norm.weight.exp_avg"] = at::zeros({4});
  o.adamw["norm.weight.exp_avg_sq"] = at::zeros({4});
  o.adamw["norm.weight.step"] = at::tensor(int64_t{9}).reshape({});
  o.param_groups = {{"muon", true, 0.02, 0.95, 0.01, 0, 0, 0, true, 5},
                    {"adamw", false, 3e-3, 0, 0.1, 0.9, 0.95, 1e-8, false, 0}};
  o.steps_taken = 9;
  save_checkpoint(dir + "/ck.safetensors", model, &o);
  ASSERT_EQ(py("checkpoint", dir), 0);
  const Checkpoint ck = load_checkpoint(dir + "/py_ck.safetensors", /*include_model=*/true, /*allow_unverified=*/true);
  ASSERT_TRUE(ck.optim);
  EXPECT_TRUE(at::equal(ck.model.at("layers.0.w"), at::arange(12, at::kDouble).reshape({3, 4}) * 3));
  EXPECT_TRUE(at::equal(ck.model.at("norm.weight"), at::full({4}, -1.5)));
  EXPECT_TRUE(at::equal(ck.optim->adamw.at("norm.weight.exp_avg_sq"), at::full({4}, 2.0)));
  EXPECT_EQ(ck.optim->muon.at("layers.0.w.step").item<int64_t>(), 4);
  EXPECT_EQ(ck.optim->steps_taken, 4);
  ASSERT_EQ(ck.optim->param_groups.size(), 2u);
  EXPECT_EQ(ck.optim->param_groups[0].lr, 0.02);
  EXPECT_EQ(ck.optim->param_groups[1].eps, 1e-8);
  std::filesystem::remove_all(dir);
}

}  // namespace
