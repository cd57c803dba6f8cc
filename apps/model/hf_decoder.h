// hf_decoder.h -- the Hugging Face decoder-only families dmuon trains from a config.json: llama,
// mistral, qwen2 and qwen3, with transformers' parameter names so their safetensors weights load
// as they are:
//   model.embed_tokens.weight
//   model.layers.N.input_layernorm.weight
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight   (+ .bias: qwen2's q/k/v, attention_bias)
//   model.layers.N.self_attn.{q,k}_norm.weight       (qwen3: RMSNorm over head_dim before RoPE)
//   model.layers.N.post_attention_layernorm.weight
//   model.layers.N.mlp.{gate,up,down}_proj.weight    (+ .bias with llama's mlp_bias)
//   model.norm.weight
//   lm_head.weight                                    (absent with tie_word_embeddings)
// The math is transformers' eager path: RMSNorm (x * rsqrt(mean(x^2) + eps) in float32, times the
// weight), rotary embeddings on the rotate-half layout (rope_theta; rope_scaling "linear" and
// "llama3"), grouped-query attention (num_key_value_heads; each KV head serves num_attention_heads /
// num_key_value_heads consecutive query heads), softmax in float32, a causal mask (plus the
// sliding window where the config enables one), and the SwiGLU MLP down(silu(gate(x)) * up(x)).
// Each `model.layers.N` runs through dmuon::forward: the hook boundaries of a dedicated model.
//
// Tensor parallelism (tp_mesh with tp_size T > 1): q/k/v column-parallel by heads (T must divide
// both head counts), o row-parallel, gate/up column-parallel, down row-parallel.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/gpt.h"
#include "model/language_model.h"

namespace dmuon::models {

struct HFDecoderConfig {
  std::string model_type;  // llama | mistral | qwen2 | qwen3
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0, initializer_range = 0.02;
  bool tie_word_embeddings = false;
  bool qkv_bias = false, o_bias = false, mlp_bias = false;  // from the family and attention_bias/mlp_bias
  bool qk_norm = false;                                     // qwen3
  std::optional<int64_t> sliding_window;                    // mistral; qwen2/3 with use_sliding_window
  std::string rope_type = "default";                        // default | linear | llama3
  double rope_factor = 1.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position = 8192;
  DeferredInit deferred;          // not in the file: build deferred (see gpt.h's GPTConfig)
  std::shared_ptr<Mesh> tp_mesh;  // not in the file: tensor parallelism of this run (null: none)

  // Parses transformers' config.json text; errors name `source` and the field. Unsupported
  // families, activations and rope types are errors that say what dmuon supports.
  static HFDecoderConfig parse(const std::string& json_text, const std::string& source);
  static HFDecoderConfig load(const std::string& path);
  int tp_size() const { return tp_mesh ? tp_mesh->tp_size() : 1; }
};

class HFAttentionImpl : public torch::nn::Module {
 public:
  explicit HFAttentionImpl(const HFDecoderConfig& cfg);
  at::Tensor forward(const at::Tensor& x);
  Projection q_proj, k_proj, v_proj, o_proj;
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // qwen3

 private:
  int64_t heads_, kv_heads_, head_dim_;  // on this TP rank
  std::optional<int64_t> window_;
  at::Tensor inv_freq_;                  // [head_dim / 2] float32, not a parameter or buffer
};
TORCH_MODULE(HFAttention);

class HFMLPImpl : public torch::nn::Module {
 public:
  explicit HFMLPImpl(const HFDecoderConfig& cfg);
  at::Tensor forward(const at::Tensor& x);
  Projection gate_proj, up_proj, down_proj;
};
TORCH_MODULE(HFMLP);

class HFDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit HFDecoderLayerImpl(const HFDecoderConfig& cfg);
  at::Tensor forward(const at::Tensor& x);
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  HFAttention self_attn{nullptr};
  HFMLP mlp{nullptr};
};
TORCH_MODULE(HFDecoderLayer);

// transformers' `<Family>Model`: the part under the "model." prefix.
class HFDecoderBodyImpl : public torch::nn::Module {
 public:
  explicit HFDecoderBodyImpl(const HFDecoderConfig& cfg);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers_list{nullptr};
  std::vector<HFDecoderLayer> layers;
  RMSNorm norm{nullptr};
};
TORCH_MODULE(HFDecoderBody);

// transformers' `<Family>ForCausalLM`.
class HFCausalLMImpl : public LanguageModel {
 public:
  explicit HFCausalLMImpl(const HFDecoderConfig& cfg);
  at::Tensor forward(const at::Tensor& tokens) override;
  bool is_muon_matrix(const std::string& name, const at::Tensor& p) const override;
  bool ties_embeddings() const override { return cfg_.tie_word_embeddings; }
  std::string describe() const override;
  double init_std() const override { return cfg_.initializer_range; }
  const HFDecoderConfig& config() const { return cfg_; }
  HFDecoderBody model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null with tie_word_embeddings

 private:
  HFDecoderConfig cfg_;
};
TORCH_MODULE(HFCausalLM);

}  // namespace dmuon::models
