// model_presets.cpp -- the named model presets of `dmuon plan --model` (as Hugging Face configs).
#include <stdexcept>
#include <string>
#include <vector>

#include "dmuon/tools/model_specs.h"
#include "model_builders.h"

namespace dmuon {
namespace {

using nlohmann::json;

// ---- presets --------------------------------------------------------------------------------

json llama_cfg(int64_t d, int64_t L, int64_t H, int64_t KV, int64_t ffn, int64_t V) {
  return json{{"model_type", "llama"},      {"hidden_size", d},         {"num_hidden_layers", L},
              {"num_attention_heads", H},   {"num_key_value_heads", KV}, {"intermediate_size", ffn},
              {"vocab_size", V},            {"tie_word_embeddings", false}};
}

struct Preset {
  std::string name;
  std::string description;
  json config;  // HF config, or null for the ViT
};

const std::vector<Preset>& presets() {
  static const std::vector<Preset> kPresets = [] {
    std::vector<Preset> v;
    v.push_back({"gpt2-small", "GPT-2 124M: 12 x h.N, d 768",
                 json{{"model_type", "gpt2"}, {"n_embd", 768}, {"n_layer", 12}, {"n_head", 12},
                      {"vocab_size", 50257}, {"n_positions", 1024}}});
    v.push_back({"gpt2-xl", "GPT-2 1.5B: 48 x h.N, d 1600",
                 json{{"model_type", "gpt2"}, {"n_embd", 1600}, {"n_layer", 48}, {"n_head", 25},
                      {"vocab_size", 50257}, {"n_positions", 1024}}});
    v.push_back({"llama3-8b", "Llama-3 8B: 32 layers, d 4096, ffn 14336, 8 kv heads",
                 llama_cfg(4096, 32, 32, 8, 14336, 128256)});
    v.push_back({"llama3-70b", "Llama-3 70B: 80 layers, d 8192, ffn 28672, 8 kv heads",
                 llama_cfg(8192, 80, 64, 8, 28672, 128256)});
    v.push_back({"llama3-405b", "Llama-3.1 405B: 126 layers, d 16384, ffn 53248, 8 kv heads",
                 llama_cfg(16384, 126, 128, 8, 53248, 128256)});
    json qwen = llama_cfg(3584, 28, 28, 4, 18944, 152064);
    qwen["model_type"] = "qwen2";
    v.push_back({"qwen2.5-7b", "Qwen2.5 7B: 28 layers, d 3584, ffn 18944, 4 kv heads, qkv bias",
                 qwen});
    json mix = llama_cfg(4096, 32, 32, 8, 14336, 32000);
    mix["model_type"] = "mixtral";
    mix["num_local_experts"] = 8;
    mix["num_experts_per_tok"] = 2;
    v.push_back({"mixtral-8x7b", "Mixtral 8x7B: 32 layers, 8 experts x (w1, w2, w3), d 4096",
                 mix});
    // The MoE presets are the size fields of the published config.json files.
    v.push_back({"deepseek-v2-lite",
                 "DeepSeek-V2-Lite 15.7B: 27 layers (1 dense), MLA, 64 routed experts [1408, "
                 "2048] + 2 shared, d 2048",
                 json::parse(R"({"model_type": "deepseek_v2", "hidden_size": 2048,
                   "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                   "intermediate_size": 10944, "moe_intermediate_size": 1408,
                   "n_routed_experts": 64, "n_shared_experts": 2, "first_k_dense_replace": 1, "num_experts_per_tok": 6,
                   "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": null,
                   "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                   "vocab_size": 102400, "tie_word_embeddings": false})")});
    v.push_back({"deepseek-v3",
                 "DeepSeek-V3 671B: 61 layers (3 dense), MLA, 256 routed experts [2048, 7168] + "
                 "1 shared, d 7168",
                 json::parse(R"({"model_type": "deepseek_v3", "hidden_size": 7168,
                   "num_hidden_layers": 61, "num_attention_heads": 128,
                   "num_key_value_heads": 128, "intermediate_size": 18432,
                   "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                   "first_k_dense_replace": 3, "moe_layer_freq": 1, "kv_lora_rank": 512,
                   "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                   "v_head_dim": 128, "topk_method": "noaux_tc", "vocab_size": 129280,
                   "tie_word_embeddings": false})")});
    v.push_back({"qwen1.5-moe-a2.7b",
                 "Qwen1.5-MoE-A2.7B 14.3B (qwen2_moe): 24 layers, 60 experts [1408, 2048] + "
                 "shared expert 5632, d 2048",
                 json::parse(R"({"model_type": "qwen2_moe", "hidden_size": 2048,
                   "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                   "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_experts": 60, "num_experts_per_tok": 4,
                   "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": false})")});
    v.push_back({"qwen3-30b-a3b",
                 "Qwen3-30B-A3B 30.5B (qwen3_moe): 48 layers, 128 experts [768, 2048], d 2048, "
                 "4 kv heads",
                 json::parse(R"({"model_type": "qwen3_moe", "hidden_size": 2048,
                   "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                   "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                   "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                   "vocab_size": 151936, "tie_word_embeddings": false})")});
    v.push_back({"vit-l16", "ViT-L/16 (timm): 24 x blocks.N, d 1024, mlp 4096", json()});
    return v;
  }();
  return kPresets;
}

std::string normalize_preset(const std::string& s) {
  std::string out;
  for (char c : detail::lower_name(s))
    if (c != '-' && c != '_' && c != '/' && c != ' ') out += c;
  return out;
}

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.push_back(p.name);
  return names;
}

std::vector<ModelPresetInfo> model_preset_infos() {
  std::vector<ModelPresetInfo> out;
  for (const auto& p : presets()) out.push_back({p.name, p.description});
  return out;
}

ModelSpec model_preset(const std::string& name, const std::string& dtype) {
  std::string key = normalize_preset(name);
  if (key == "gpt2") key = normalize_preset("gpt2-small");
  if (key == "vitl") key = normalize_preset("vit-l16");
  for (const auto& p : presets()) {
    if (normalize_preset(p.name) != key) continue;
    const int64_t eb = dtype_bytes(dtype.empty() ? "bf16" : dtype);
    if (p.config.is_null()) return detail::preset_vit(p.name, eb, 24, 1024, 4096, 16, 224, 1000);
    return detail::preset_from_config(p.config, "preset " + p.name, p.name, dtype.empty() ? "bf16" : dtype);
  }
  throw std::invalid_argument("unknown preset '" + name + "' (known: " +
                              detail::join_names(model_preset_names()) + ")");
}

}  // namespace dmuon
