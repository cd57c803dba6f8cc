// gpt.h -- a small GPT written with LibTorch's C++ modules: token embedding, `layers.N` blocks
// (RMSNorm, causal attention with q/k/v/o projections, gated MLP with gate/up/down), final RMSNorm
// and an LM head. Each block runs through dmuon::forward, so it is a dmuon hook boundary once the
// model is dedicated (and a plain call otherwise).
//
// Tensor parallelism (GPTConfig::tp_mesh with tp_size T > 1): q/k/v (by heads) and gate/up are
// column-parallel, o and down row-parallel (Megatron); the embedding, norms and head stay whole.
// Parameter names are the same as without TP; the split ones hold this TP rank's slice, and their
// initial values are the slices of the single-process initialisation.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/tensor_parallel.h"
#include "model/language_model.h"

namespace dmuon::models {

struct GPTConfig {
  int64_t vocab_size = 256;
  int64_t d_model = 64;
  int64_t n_layers = 3;
  int64_t n_heads = 4;
  int64_t d_ff = 0;  // 0: round(8/3 * d_model) up to a multiple of 8
  int64_t max_seq_len = 128;
  double norm_eps = 1e-6;
  std::shared_ptr<Mesh> tp_mesh;  // tensor-parallel projections over its TP axis (null: none)
  DeferredInit deferred;          // enabled: no initialisation, parameters deferred block by block
  int64_t ffn_dim() const;
  int tp_size() const { return tp_mesh ? tp_mesh->tp_size() : 1; }
};

// A block's projection: a plain Linear, or (on a TP mesh) its column- or row-parallel form, under the
// same parameter name.
struct Projection {
  torch::nn::Linear plain{nullptr};
  ColumnParallelLinear column{nullptr};
  RowParallelLinear row{nullptr};
  at::Tensor operator()(const at::Tensor& x);
};
// Registers `name` on `owner`: a plain Linear (tp_mesh null or tp_size 1), else column-parallel
// (`column`) or row-parallel over the mesh's TP axis.
Projection register_projection(torch::nn::Module& owner, const std::string& name, int64_t in, int64_t out,
                               bool column, bool bias, const std::shared_ptr<Mesh>& tp_mesh);

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  // Set when each TP rank normalises only its own slice of the input (qwen3's per-head q/k norms on
  // this rank's heads): the weight's gradient is then partial and is summed over the TP group.
  std::shared_ptr<Mesh> tp_partial_grad;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GPTConfig& cfg);
  at::Tensor forward(const at::Tensor& x);
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  Projection q_proj, k_proj, v_proj, o_proj;
  Projection gate_proj, up_proj, down_proj;

 private:
  int64_t n_heads_;  // on this TP rank
  int64_t head_dim_;
};
TORCH_MODULE(Block);

class GPTImpl : public LanguageModel {
 public:
  explicit GPTImpl(const GPTConfig& cfg);
  // tokens [B, T] (int64) -> logits [B, T, vocab]
  at::Tensor forward(const at::Tensor& tokens) override;
  bool is_muon_matrix(const std::string& name, const at::Tensor& p) const override;
  std::string describe() const override;
  double init_std() const override { return 0.02; }
  // Blocks whose forward runs without gradient (for tests of "a block whose parameters get no
  // gradient in a step").
  std::vector<bool> frozen_blocks;
  // Blocks to run, in order (default: each once, 0..n-1). Repeating an index shares that block's
  // weights between positions (ALBERT-style), which exercises re-entrant hook boundaries.
  std::vector<int> block_order;
  // The embedding runs without gradient: the first block's input then needs none (a frozen
  // embedding, or tokens fed straight in), so that boundary installs no post-backward hook.
  bool frozen_embedding = false;

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
