// gpt.h -- a small GPT written with LibTorch's C++ modules: token embedding, `layers.N` blocks
// (RMSNorm, causal attention with q/k/v/o projections, gated MLP with gate/up/down), final RMSNorm
// and an LM head. Each block runs through dmuon::forward, so it is a dmuon hook boundary once the
// model is dedicated (and a plain call otherwise).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dmuon::models {

struct GPTConfig {
  int64_t vocab_size = 256;
  int64_t d_model = 64;
  int64_t n_layers = 3;
  int64_t n_heads = 4;
  int64_t d_ff = 0;  // 0: round(8/3 * d_model) up to a multiple of 8
  int64_t max_seq_len = 128;
  double norm_eps = 1e-6;
  int64_t ffn_dim() const;
};

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GPTConfig& cfg);
  at::Tensor forward(const at::Tensor& x);
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  int64_t n_heads_;
};
TORCH_MODULE(Block);

class GPTImpl : public torch::nn::Module {
 public:
  explicit GPTImpl(const GPTConfig& cfg);
  // tokens [B, T] (int64) -> logits [B, T, vocab]
  at::Tensor forward(const at::Tensor& tokens);
  // Mean cross-entropy of next-token prediction: logits of tokens[:, :-1] against tokens[:, 1:].
  at::Tensor loss(const at::Tensor& tokens);
  // Blocks whose forward runs without gradient (for tests of "a block whose parameters get no
  // gradient in a step").
  std::vector<bool> frozen_blocks;
  // Blocks to run, in order (default: each once, 0..n-1). Repeating an index shares that block's
  // weights between positions (ALBERT-style), which exercises re-entrant hook boundaries.
  std::vector<int> block_order;

  const GPTConfig& config() const { return cfg_; }
  torch::nn::Embedding tok_emb{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<Block> blocks;
  RMSNorm final_norm{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  GPTConfig cfg_;
};
TORCH_MODULE(GPT);

// Default Muon predicate for this model: the 2-D weights inside `layers.N` blocks.
bool is_muon_matrix(const std::string& name, const at::Tensor& p);

}  // namespace dmuon::models
