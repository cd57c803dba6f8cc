// model_specs.h -- parameter lists of whole models, without building them (pure C++, no LibTorch).
//
// What `dmuon plan` and bench/plan_bench feed the owner planner: built-in presets with the real
// parameter names and shapes of well-known models, loaders for Hugging Face config.json files and
// for a plain parameter-list JSON, and the Muon-target predicate (which of those parameters get a
// dedicated owner). Every function either returns a complete ModelSpec or throws
// std::invalid_argument with a one-line message naming the source, the offending value and the fix.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dmuon/owner_plan.h"

namespace dmuon {

// Every parameter of a model in model order (embeddings, norms, biases and head included), as
// named by the framework's state dict; ParamSpec::elem_bytes from the chosen dtype.
struct ModelSpec {
  std::string name;              // preset name, or the file it was loaded from
  std::vector<ParamSpec> params;
  // Parameters one token's forward passes through: an MoE counts only its num_experts_per_tok routed
  // experts per sparse layer (the step simulator's compute). 0: every parameter (dense models).
  int64_t active_params = 0;
};

// Bytes per element of a dtype name: bf16/bfloat16, fp16/float16/half = 2; fp32/float32/float = 4;
// fp64/float64/double = 8; fp8/float8*/int8/uint8 = 1 (case-insensitive). Throws for others.
int64_t dtype_bytes(const std::string& dtype);

// ---- presets --------------------------------------------------------------------------------
// Canonical names: gpt2-small, gpt2-xl, llama3-8b, llama3-70b, llama3-405b, qwen2.5-7b,
// mixtral-8x7b (per-expert w1/w2/w3 matrices), deepseek-v2-lite, deepseek-v3, qwen1.5-moe-a2.7b,
// qwen3-30b-a3b (MoE: the size fields of the published config.json files, per-expert
// gate/up/down matrices), vit-l16 (timm naming, `blocks.N`).
std::vector<std::string> model_preset_names();
struct ModelPresetInfo {
  std::string name;
  std::string description;  // one line: size, layer naming, the dimensions used
};
std::vector<ModelPresetInfo> model_preset_infos();
// Lookup ignores case and the characters '-', '_', '/', ' ' (so "Llama-3-8B", "llama3_8b" and
// "ViT-L/16" work; "gpt2" means gpt2-small). Throws naming the value and the known presets.
ModelSpec model_preset(const std::string& name, const std::string& dtype = "bf16");

// ---- Hugging Face config.json ---------------------------------------------------------------
// model_type llama / mistral / qwen2 / qwen3 / mixtral / qwen2_moe / qwen3_moe / deepseek_v2 /
// deepseek_v3 / gpt2 -> the parameter names and shapes that transformers' implementation creates
// (tied embeddings drop lm_head.weight). MoE: each expert's matrices (model.layers.N.mlp.experts.E.
// {gate,up,down}_proj.weight; Mixtral block_sparse_moe.experts.E.w1/w2/w3), the router, shared
// experts, and the dense layers the config names (first_k_dense_replace, moe_layer_freq,
// decoder_sparse_step, mlp_only_layers); DeepSeek's multi-head latent attention (q/kv LoRA).
// Sizes are checked against sane limits before anything is built (layers <= 10,000, experts <=
// 65,536, other sizes <= 2^20, <= 2,000,000 tensors and 1e15 elements): the error names the field.
// `dtype` empty means the config's torch_dtype, else bf16. `source` names the input in errors.
// The attention heads of a decoder config.json, checked the same way by `dmuon plan` and `dmuon
// train`: num_key_value_heads divides num_attention_heads (grouped-query attention), and without a
// "head_dim" the hidden size divides into the heads. Throws std::invalid_argument naming `source`.
void check_attention_heads(int64_t heads, int64_t kv_heads, int64_t hidden_size, bool has_head_dim,
                           const std::string& source);

ModelSpec model_from_hf_config(const std::string& json_text, const std::string& source,
                               const std::string& dtype = "");
ModelSpec load_hf_config(const std::string& path, const std::string& dtype = "");

// ---- parameter-list JSON --------------------------------------------------------------------
// [{"name": "...", "shape": [m, n], "dtype": "bf16", "group": "optional key"}, ...] or
// {"params": [...]}; "dtype" defaults to default_dtype, "group" (or "group_key") to none.
// Shapes may be [] (a scalar); every dimension must be >= 1; names must be unique.
ModelSpec model_from_params_json(const std::string& json_text, const std::string& source,
                                 const std::string& default_dtype = "bf16");
ModelSpec load_params_json(const std::string& path, const std::string& default_dtype = "bf16");

// ---- Muon-target predicate ------------------------------------------------------------------
// Default: a parameter with exactly 2 dimensions that is not an embedding, head or norm. By name
// component (the name split at '.'): a component that contains "embed" or "norm", starts with
// "ln", is "head" / "lm_head" / "wte" / "wpe", or ends in "_head" excludes it.
// `include` patterns replace the default rule: a parameter with >= 2 dimensions is selected iff
// its name matches one of them. `exclude` patterns then remove parameters. A pattern with '*' or
// '?' is a glob over the whole name ('*' also crosses dots); otherwise it matches as a substring.
struct MuonTargetSelector {
  std::vector<std::string> include;
  std::vector<std::string> exclude;
};
bool name_matches(const std::string& name, const std::string& pattern);
bool is_default_muon_target(const ParamSpec& p);
bool is_muon_target(const ParamSpec& p, const MuonTargetSelector& selector = {});
// The selected parameters in model order, with route = "muon".
std::vector<ParamSpec> select_muon_params(const ModelSpec& model,
                                          const MuonTargetSelector& selector = {});

// ---- tensor parallelism (Megatron layout) ---------------------------------------------------
// The dimension a Megatron-style TP layout splits over tp_size ranks, from the module name (the
// name component before ".weight"): column-parallel q/k/v_proj, gate/up_proj, w1/w3, qkv, fc1,
// q_b_proj, kv_b_proj, query/key/value -> 0 (output features of [out, in]); row-parallel o_proj,
// down_proj, w2, proj, fc2, out_proj, dense -> 1; GPT-2's Conv1D ([in, out]) c_attn, c_fc -> 1 and
// c_proj -> 0. -1 (whole on every TP rank) for anything else, a non-2-D parameter, tp_size 1, or a
// split dimension not divisible by tp_size.
int megatron_tp_split_dim(const ParamSpec& p, int tp_size);

}  // namespace dmuon
