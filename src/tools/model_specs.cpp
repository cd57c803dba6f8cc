// model_specs.cpp -- Hugging Face config and parameter-list loaders, the model builders, the Muon
// predicate (the presets: model_presets.cpp).
#include "dmuon/tools/model_specs.h"
#include "env/json_text.h"
#include "model_builders.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace dmuon {
namespace {

using nlohmann::json;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int e = errno;
    throw std::invalid_argument("cannot open " + what + " '" + path + "': " +
                                (e ? std::strerror(e) : "unreadable"));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json(const std::string& text, const std::string& source) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw std::invalid_argument("malformed JSON in " + source + ": " + e.what());
  }
}

// ---- size limits ----------------------------------------------------------------------------
// A config is read before anything is built, and every size is checked against a limit far above
// any published model, so a typo (num_hidden_layers 100000000) is a clear error in microseconds
// instead of a parameter list that fills the memory and a planner that never finishes.
constexpr int64_t kMaxLayers = 10'000;               // published models: <= ~130
constexpr int64_t kMaxWidth = int64_t{1} << 20;      // hidden/intermediate/vocab/heads/ranks
constexpr int64_t kMaxExperts = 65'536;              // published models: <= 384 routed experts
constexpr int64_t kMaxTensors = 2'000'000;           // parameter tensors in one model
constexpr int64_t kMaxElements = 1'000'000'000'000'000;  // 1e15: > 1000x the largest published

std::string limit_msg(const std::string& src, const std::string& key, int64_t v, int64_t limit,
                      const std::string& what) {
  return src + ": field '" + key + "' is " + std::to_string(v) + ", above the limit of " +
         std::to_string(limit) + (what.empty() ? "" : " " + what) + ": no real model is that large and its parameter "
         "list would not fit in memory or plan in reasonable time; check the value (a typo, or "
         "the wrong field?) or plan a smaller stand-in model";
}

// The limit of a size field by its meaning: layers, experts, or a width (everything else).
int64_t limit_of(const std::string& key, std::string* what) {
  if (key == "num_hidden_layers" || key == "n_layer") {
    *what = "layers";
    return kMaxLayers;
  }
  if (key == "num_local_experts" || key == "num_experts" || key == "n_routed_experts" ||
      key == "n_shared_experts") {
    *what = "experts";
    return kMaxExperts;
  }
  *what = "";  // a width: hidden, intermediate, vocab, heads, head dims, LoRA ranks
  return kMaxWidth;
}

// ---- model builders -----------------------------------------------------------------------

class Builder {
 public:
  Builder(std::string name, int64_t elem_bytes, std::string src)
      : elem_bytes_(elem_bytes), src_(std::move(src)) {
    spec_.name = std::move(name);
  }
  // Checked before the layer loop: `layers` x `per_layer` tensors must stay under kMaxTensors.
  void expect(int64_t layers, int64_t per_layer, const std::string& fix) {
    const int64_t room = kMaxTensors - static_cast<int64_t>(spec_.params.size());
    if (per_layer > 0 && layers > room / per_layer)
      throw std::invalid_argument(
          src_ + ": the model would have " + std::to_string(layers) + " layers x " +
          std::to_string(per_layer) + " parameter tensors, above the limit of " +
          std::to_string(kMaxTensors) + " tensors: the parameter list would not fit in memory "
          "or plan in reasonable time; " + fix);
    fix_ = fix;
  }
  void add(const std::string& name, std::vector<int64_t> shape) {
    ParamSpec p;
    p.name = name;
    p.shape = std::move(shape);
    p.elem_bytes = elem_bytes_;
    int64_t n = 1;
    bool overflow = false;
    for (int64_t d : p.shape) overflow = overflow || __builtin_mul_overflow(n, d, &n);
    overflow = overflow || __builtin_add_overflow(elements_, n, &elements_);
    if (overflow || elements_ > kMaxElements)
      throw std::invalid_argument(
          src_ + ": the model would have more than " + std::to_string(kMaxElements) +
          " elements (reached at parameter '" + name + "'), above any real model: " +
          (fix_.empty() ? "check its sizes" : fix_));
    if (static_cast<int64_t>(spec_.params.size()) >= kMaxTensors)
      throw std::invalid_argument(src_ + ": the model would have more than " +
                                  std::to_string(kMaxTensors) + " parameter tensors; " +
                                  (fix_.empty() ? "check its sizes" : fix_));
    spec_.params.push_back(std::move(p));
  }
  ModelSpec take() { return std::move(spec_); }

 private:
  ModelSpec spec_;
  int64_t elem_bytes_;
  std::string src_;
  std::string fix_;
  int64_t elements_ = 0;
};

const json* field(const json& cfg, const std::string& key) {
  auto it = cfg.find(key);
  return it == cfg.end() || it->is_null() ? nullptr : &*it;
}

// Reads an integer field of a config, at least `min_value` and at most the field's size limit;
// `fallback` < 0 means required (a missing or null field is then an error).
int64_t cfg_int(const json& cfg, const std::string& key, const std::string& source,
                int64_t fallback = -1, int64_t min_value = 1) {
  const json* f = field(cfg, key);
  const std::string kind = min_value > 0 ? "a positive integer" : "a non-negative integer";
  if (!f) {
    if (fallback >= 0) return fallback;
    throw std::invalid_argument(source + ": missing required field '" + key + "'");
  }
  if (!f->is_number_integer())
    throw std::invalid_argument(source + ": field '" + key + "' must be " + kind + ", got " +
                                detail::json_brief(*f));
  // Values beyond int64 parse as unsigned (or fail to fit): report them as too large.
  if (f->is_number_unsigned() && f->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    std::string what;
    const int64_t limit = limit_of(key, &what);
    throw std::invalid_argument(source + ": field '" + key + "' is " + detail::json_brief(*f) +
                                ", above the limit of " + std::to_string(limit) +
                                (what.empty() ? "" : " " + what) + "; check the value");
  }
  const int64_t v = f->get<int64_t>();
  if (v < min_value)
    throw std::invalid_argument(source + ": field '" + key + "' must be " + kind + ", got " +
                                std::to_string(v));
  std::string what;
  const int64_t limit = limit_of(key, &what);
  if (v > limit) throw std::invalid_argument(limit_msg(source, key, v, limit, what));
  return v;
}

bool cfg_bool(const json& cfg, const std::string& key, const std::string& source, bool fallback) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return fallback;
  if (!it->is_boolean())  // "true" / 1 would silently plan the other case
    throw std::invalid_argument(source + ": field '" + key + "' must be true or false, got " + detail::json_brief(*it));
  return it->get<bool>();
}

}  // namespace

void check_attention_heads(int64_t heads, int64_t kv_heads, int64_t hidden_size, bool has_head_dim,
                           const std::string& source) {
  if (heads % kv_heads != 0)
    throw std::invalid_argument(source + ": num_attention_heads " + std::to_string(heads) +
                                " is not a multiple of num_key_value_heads " + std::to_string(kv_heads) +
                                " (grouped-query attention: each key/value head serves a whole number of "
                                "query heads)");
  if (!has_head_dim && hidden_size % heads != 0)
    throw std::invalid_argument(source + ": hidden_size " + std::to_string(hidden_size) +
                                " is not divisible by num_attention_heads " + std::to_string(heads) +
                                "; set \"head_dim\" explicitly");
}

namespace {

// Decoder-only transformers in transformers' naming (model.layers.N.*): the llama family
// (llama, mistral, qwen2, qwen3), and the MoE families mixtral, qwen2_moe, qwen3_moe and
// deepseek_v2 / deepseek_v3 (multi-head latent attention, routed + shared experts).
ModelSpec build_decoder(const json& cfg, const std::string& type, const std::string& name,
                        int64_t eb, const std::string& src) {
  const bool deepseek = type == "deepseek_v2" || type == "deepseek_v3";
  const bool qwen_moe = type == "qwen2_moe" || type == "qwen3_moe";
  const bool qwen3 = type == "qwen3" || type == "qwen3_moe";
  const int64_t d = cfg_int(cfg, "hidden_size", src);
  const int64_t L = cfg_int(cfg, "num_hidden_layers", src);
  const int64_t H = cfg_int(cfg, "num_attention_heads", src);
  const int64_t KV = cfg_int(cfg, "num_key_value_heads", src, H);
  const int64_t V = cfg_int(cfg, "vocab_size", src);
  const bool tie = cfg_bool(cfg, "tie_word_embeddings", src, false);

  // ---- attention ----
  int64_t hd = 0, q_lora = 0, kv_lora = 0, nope = 0, rope = 0, vhd = 0;
  if (deepseek) {
    q_lora = cfg_int(cfg, "q_lora_rank", src, 0);  // null / absent: a plain q_proj
    kv_lora = cfg_int(cfg, "kv_lora_rank", src);
    nope = cfg_int(cfg, "qk_nope_head_dim", src);
    rope = cfg_int(cfg, "qk_rope_head_dim", src);
    vhd = cfg_int(cfg, "v_head_dim", src);
  } else {
    check_attention_heads(H, KV, d, field(cfg, "head_dim") != nullptr, src);
    hd = cfg_int(cfg, "head_dim", src, d / H);
  }
  const bool attn_bias = cfg_bool(cfg, "attention_bias", src, false);
  const bool qkv_bias = type == "qwen2" || type == "qwen2_moe" ||
                        ((type == "llama" || qwen3) && attn_bias);
  const bool o_bias = (type == "llama" || qwen3) && attn_bias;
  const bool mlp_bias = type == "llama" && cfg_bool(cfg, "mlp_bias", src, false);

  // ---- MLP / MoE: which layers are sparse, experts and their widths ----
  int64_t E = 0, moe_ffn = 0, shared_ffn = 0;
  std::vector<char> sparse(static_cast<size_t>(L), 0);
  if (type == "mixtral") {
    E = cfg_int(cfg, "num_local_experts", src);
    std::fill(sparse.begin(), sparse.end(), 1);
  } else if (qwen_moe) {
    E = cfg_int(cfg, "num_experts", src, 0, 0);  // 0: every layer dense
    const int64_t step = cfg_int(cfg, "decoder_sparse_step", src, 1);
    std::vector<int64_t> mlp_only;
    if (const json* f = field(cfg, "mlp_only_layers")) {
      if (!f->is_array())
        throw std::invalid_argument(src + ": field 'mlp_only_layers' must be an array of layer "
                                    "indices, got " + detail::json_brief(*f));
      for (const json& x : *f) {
        if (!x.is_number_integer())
          throw std::invalid_argument(src + ": field 'mlp_only_layers' must hold integers, got " +
                                      detail::json_brief(x));
        mlp_only.push_back(x.get<int64_t>());
      }
    }
    for (int64_t l = 0; l < L; ++l)
      sparse[l] = E > 0 && (l + 1) % step == 0 &&
                  std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end();
    if (type == "qwen2_moe" && E > 0)
      shared_ffn = cfg_int(cfg, "shared_expert_intermediate_size", src);
  } else if (deepseek) {
    E = cfg_int(cfg, "n_routed_experts", src, 0, 0);  // null: every layer dense
    const int64_t first_dense = cfg_int(cfg, "first_k_dense_replace", src, 0, 0);
    const int64_t freq = cfg_int(cfg, "moe_layer_freq", src, 1);
    for (int64_t l = 0; l < L; ++l) sparse[l] = E > 0 && l >= first_dense && l % freq == 0;
  }
  const bool any_sparse = std::find(sparse.begin(), sparse.end(), 1) != sparse.end();
  const bool any_dense = std::find(sparse.begin(), sparse.end(), 0) != sparse.end();
  const int64_t ffn = type == "mixtral" || any_dense ? cfg_int(cfg, "intermediate_size", src) : 0;
  if (any_sparse && type != "mixtral") moe_ffn = cfg_int(cfg, "moe_intermediate_size", src);
  if (any_sparse && deepseek) {
    const int64_t n_shared = cfg_int(cfg, "n_shared_experts", src, 0, 0);
    if (n_shared > 0) shared_ffn = moe_ffn * n_shared;
  }
  if (type == "mixtral") moe_ffn = ffn;
  const bool score_bias =
      type == "deepseek_v3" ||
      (field(cfg, "topk_method") && field(cfg, "topk_method")->is_string() &&
       field(cfg, "topk_method")->get<std::string>() == "noaux_tc");

  Builder b(name, eb, src);
  const int64_t per_layer = 16 + (any_sparse ? 3 * E + 4 : 0);
  b.expect(L, per_layer,
           "reduce 'num_hidden_layers' (" + std::to_string(L) + ")" +
               (E > 0 ? " or the expert count (" + std::to_string(E) + ")" : std::string()));
  b.add("model.embed_tokens.weight", {V, d});
  auto mlp = [&](const std::string& p, int64_t width, bool bias) {
    b.add(p + "gate_proj.weight", {width, d});
    if (bias) b.add(p + "gate_proj.bias", {width});
    b.add(p + "up_proj.weight", {width, d});
    if (bias) b.add(p + "up_proj.bias", {width});
    b.add(p + "down_proj.weight", {d, width});
    if (bias) b.add(p + "down_proj.bias", {d});
  };
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    if (deepseek) {
      const int64_t qhd = nope + rope;
      if (q_lora == 0) {
        b.add(p + "self_attn.q_proj.weight", {H * qhd, d});
        if (attn_bias) b.add(p + "self_attn.q_proj.bias", {H * qhd});
      } else {
        b.add(p + "self_attn.q_a_proj.weight", {q_lora, d});
        if (attn_bias) b.add(p + "self_attn.q_a_proj.bias", {q_lora});
        b.add(p + "self_attn.q_a_layernorm.weight", {q_lora});
        b.add(p + "self_attn.q_b_proj.weight", {H * qhd, q_lora});
      }
      b.add(p + "self_attn.kv_a_proj_with_mqa.weight", {kv_lora + rope, d});
      if (attn_bias) b.add(p + "self_attn.kv_a_proj_with_mqa.bias", {kv_lora + rope});
      b.add(p + "self_attn.kv_a_layernorm.weight", {kv_lora});
      b.add(p + "self_attn.kv_b_proj.weight", {H * (nope + vhd), kv_lora});
      b.add(p + "self_attn.o_proj.weight", {d, H * vhd});
      if (attn_bias) b.add(p + "self_attn.o_proj.bias", {d});
    } else {
      b.add(p + "self_attn.q_proj.weight", {H * hd, d});
      if (qkv_bias) b.add(p + "self_attn.q_proj.bias", {H * hd});
      b.add(p + "self_attn.k_proj.weight", {KV * hd, d});
      if (qkv_bias) b.add(p + "self_attn.k_proj.bias", {KV * hd});
      b.add(p + "self_attn.v_proj.weight", {KV * hd, d});
      if (qkv_bias) b.add(p + "self_attn.v_proj.bias", {KV * hd});
      b.add(p + "self_attn.o_proj.weight", {d, H * hd});
      if (o_bias) b.add(p + "self_attn.o_proj.bias", {d});
      if (qwen3) {
        b.add(p + "self_attn.q_norm.weight", {hd});
        b.add(p + "self_attn.k_norm.weight", {hd});
      }
    }
    if (!sparse[l]) {
      mlp(p + "mlp.", ffn, mlp_bias);
    } else if (type == "mixtral") {
      b.add(p + "block_sparse_moe.gate.weight", {E, d});
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
        b.add(x + "w1.weight", {moe_ffn, d});
        b.add(x + "w2.weight", {d, moe_ffn});
        b.add(x + "w3.weight", {moe_ffn, d});
      }
    } else if (qwen_moe) {  // Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock
      b.add(p + "mlp.gate.weight", {E, d});
      for (int64_t e = 0; e < E; ++e)
        mlp(p + "mlp.experts." + std::to_string(e) + ".", moe_ffn, false);
      if (shared_ffn > 0) {
        mlp(p + "mlp.shared_expert.", shared_ffn, false);
        b.add(p + "mlp.shared_expert_gate.weight", {1, d});
      }
    } else {  // DeepseekV2MoE / DeepseekV3MoE: experts, gate, shared_experts
      for (int64_t e = 0; e < E; ++e)
        mlp(p + "mlp.experts." + std::to_string(e) + ".", moe_ffn, false);
      b.add(p + "mlp.gate.weight", {E, d});
      if (score_bias) b.add(p + "mlp.gate.e_score_correction_bias", {E});
      if (shared_ffn > 0) mlp(p + "mlp.shared_experts.", shared_ffn, false);
    }
    b.add(p + "input_layernorm.weight", {d});
    b.add(p + "post_attention_layernorm.weight", {d});
  }
  b.add("model.norm.weight", {d});
  if (!tie) b.add("lm_head.weight", {V, d});
  ModelSpec spec = b.take();
  // a token passes through its top-k routed experts only (num_experts_per_tok; absent: all E)
  const int64_t n_sparse = std::count(sparse.begin(), sparse.end(), 1);
  if (E > 0 && n_sparse > 0) {
    const int64_t k = std::min(E, cfg_int(cfg, "num_experts_per_tok", src, E));
    int64_t total = 0;
    for (const ParamSpec& p : spec.params) total += p.numel();
    spec.active_params = total - n_sparse * (E - k) * 3 * moe_ffn * d;
  }
  return spec;
}

ModelSpec build_gpt2(const json& cfg, const std::string& name, int64_t eb, const std::string& src) {
  const int64_t d = cfg_int(cfg, "n_embd", src);
  const int64_t L = cfg_int(cfg, "n_layer", src);
  const int64_t H = cfg_int(cfg, "n_head", src);
  const int64_t V = cfg_int(cfg, "vocab_size", src);
  const int64_t ctx = cfg_int(cfg, "n_positions", src, cfg_int(cfg, "n_ctx", src, 1024));
  const int64_t inner = cfg_int(cfg, "n_inner", src, 4 * d);
  if (d % H != 0)
    throw std::invalid_argument(src + ": n_embd " + std::to_string(d) +
                                " is not divisible by n_head " + std::to_string(H));
  const bool tie = cfg_bool(cfg, "tie_word_embeddings", src, true);
  Builder b(name, eb, src);
  b.expect(L, 12, "reduce 'n_layer' (" + std::to_string(L) + ")");
  b.add("transformer.wte.weight", {V, d});
  b.add("transformer.wpe.weight", {ctx, d});
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "transformer.h." + std::to_string(l) + ".";
    b.add(p + "ln_1.weight", {d});
    b.add(p + "ln_1.bias", {d});
    // GPT-2's Conv1D stores weights as [in, out].
    b.add(p + "attn.c_attn.weight", {d, 3 * d});
    b.add(p + "attn.c_attn.bias", {3 * d});
    b.add(p + "attn.c_proj.weight", {d, d});
    b.add(p + "attn.c_proj.bias", {d});
    b.add(p + "ln_2.weight", {d});
    b.add(p + "ln_2.bias", {d});
    b.add(p + "mlp.c_fc.weight", {d, inner});
    b.add(p + "mlp.c_fc.bias", {inner});
    b.add(p + "mlp.c_proj.weight", {inner, d});
    b.add(p + "mlp.c_proj.bias", {d});
  }
  b.add("transformer.ln_f.weight", {d});
  b.add("transformer.ln_f.bias", {d});
  if (!tie) b.add("lm_head.weight", {V, d});
  return b.take();
}

// timm VisionTransformer naming (vit_large_patch16_224).
ModelSpec build_vit(const std::string& name, int64_t eb, int64_t L, int64_t d, int64_t mlp,
                    int64_t patch, int64_t image, int64_t classes) {
  const int64_t tokens = (image / patch) * (image / patch) + 1;
  Builder b(name, eb, "preset " + name);
  b.add("cls_token", {1, 1, d});
  b.add("pos_embed", {1, tokens, d});
  b.add("patch_embed.proj.weight", {d, 3, patch, patch});
  b.add("patch_embed.proj.bias", {d});
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    b.add(p + "norm1.weight", {d});
    b.add(p + "norm1.bias", {d});
    b.add(p + "attn.qkv.weight", {3 * d, d});
    b.add(p + "attn.qkv.bias", {3 * d});
    b.add(p + "attn.proj.weight", {d, d});
    b.add(p + "attn.proj.bias", {d});
    b.add(p + "norm2.weight", {d});
    b.add(p + "norm2.bias", {d});
    b.add(p + "mlp.fc1.weight", {mlp, d});
    b.add(p + "mlp.fc1.bias", {mlp});
    b.add(p + "mlp.fc2.weight", {d, mlp});
    b.add(p + "mlp.fc2.bias", {d});
  }
  b.add("norm.weight", {d});
  b.add("norm.bias", {d});
  b.add("head.weight", {classes, d});
  b.add("head.bias", {classes});
  return b.take();
}

const std::vector<std::string> kHfTypes = {"llama",     "mistral",   "qwen2",       "qwen3",
                                           "mixtral",   "qwen2_moe", "qwen3_moe",   "deepseek_v2",
                                           "deepseek_v3", "gpt2"};

std::string infer_model_type(const json& cfg, const std::string& src) {
  if (cfg.contains("model_type") && cfg["model_type"].is_string())
    return lower(cfg["model_type"].get<std::string>());
  // Architecture class prefixes, longest first ("Qwen2MoeForCausalLM" is qwen2_moe, not qwen2).
  static const std::vector<std::pair<std::string, std::string>> kArch = {
      {"deepseekv3", "deepseek_v3"}, {"deepseekv2", "deepseek_v2"}, {"qwen3moe", "qwen3_moe"},
      {"qwen2moe", "qwen2_moe"},     {"qwen3", "qwen3"},            {"qwen2", "qwen2"},
      {"mixtral", "mixtral"},        {"mistral", "mistral"},        {"llama", "llama"},
      {"gpt2", "gpt2"}};
  if (cfg.contains("architectures") && cfg["architectures"].is_array()) {
    for (const auto& a : cfg["architectures"]) {
      if (!a.is_string()) continue;
      const std::string arch = lower(a.get<std::string>());
      for (const auto& [prefix, type] : kArch)
        if (arch.rfind(prefix, 0) == 0) return type;
    }
  }
  throw std::invalid_argument(src + ": no 'model_type' (supported: " + join(kHfTypes) + ")");
}

ModelSpec build_from_config(const json& cfg, const std::string& src, const std::string& name,
                            const std::string& dtype) {
  if (!cfg.is_object())
    throw std::invalid_argument(src + ": a Hugging Face config must be a JSON object, got " +
                                std::string(cfg.type_name()));
  std::string dt = dtype;
  if (dt.empty()) {
    for (const char* key : {"torch_dtype", "dtype"})
      if (cfg.contains(key) && cfg[key].is_string()) {
        dt = cfg[key].get<std::string>();
        break;
      }
  }
  if (dt.empty()) dt = "bf16";
  const int64_t eb = dtype_bytes(dt);
  const std::string type = infer_model_type(cfg, src);
  if (type == "gpt2") return build_gpt2(cfg, name, eb, src);
  if (std::find(kHfTypes.begin(), kHfTypes.end(), type) != kHfTypes.end())
    return build_decoder(cfg, type, name, eb, src);
  throw std::invalid_argument(src + ": unsupported model_type '" + type +
                              "' (supported: " + join(kHfTypes) + ")");
}

// ---- glob --------------------------------------------------------------------------------
bool glob_match(const char* p, const char* s) {
  const char* star = nullptr;
  const char* resume = nullptr;
  while (*s) {
    if (*p == '?' || (*p && *p != '*' && *p == *s)) {
      ++p;
      ++s;
    } else if (*p == '*') {
      star = p++;
      resume = s;
    } else if (star) {
      p = star + 1;
      s = ++resume;
    } else {
      return false;
    }
  }
  while (*p == '*') ++p;
  return *p == 0;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

// for the presets (model_presets.cpp)
namespace detail {
ModelSpec preset_vit(const std::string& name, int64_t eb, int64_t L, int64_t d, int64_t mlp, int64_t patch,
                     int64_t image, int64_t classes) {
  return build_vit(name, eb, L, d, mlp, patch, image, classes);
}
ModelSpec preset_from_config(const nlohmann::json& cfg, const std::string& src, const std::string& name,
                             const std::string& dtype) {
  return build_from_config(cfg, src, name, dtype);
}
std::string join_names(const std::vector<std::string>& v) { return join(v); }
std::string lower_name(std::string s) { return lower(std::move(s)); }
}  // namespace detail

int64_t dtype_bytes(const std::string& dtype) {
  const std::string d = lower(dtype);
  if (d == "bf16" || d == "bfloat16" || d == "fp16" || d == "float16" || d == "half") return 2;
  if (d == "fp32" || d == "float32" || d == "float") return 4;
  if (d == "fp64" || d == "float64" || d == "double") return 8;
  if (d == "fp8" || d.rfind("float8", 0) == 0 || d == "int8" || d == "uint8") return 1;
  throw std::invalid_argument("unknown dtype '" + dtype +
                              "' (use bf16, fp16, fp32, fp64 or fp8)");
}

ModelSpec model_from_hf_config(const std::string& json_text, const std::string& source,
                               const std::string& dtype) {
  return build_from_config(parse_json(json_text, source), source, source, dtype);
}

ModelSpec load_hf_config(const std::string& path, const std::string& dtype) {
  return model_from_hf_config(read_file(path, "Hugging Face config"), path, dtype);
}

ModelSpec model_from_params_json(const std::string& json_text, const std::string& source,
                                 const std::string& default_dtype) {
  json j = parse_json(json_text, source);
  if (j.is_object() && j.contains("params")) j = j["params"];
  if (!j.is_array())
    throw std::invalid_argument(source + ": expected a JSON array of {\"name\", \"shape\", "
                                "\"dtype\"} objects (or {\"params\": [...]}), got " +
                                std::string(j.type_name()));
  if (static_cast<int64_t>(j.size()) > kMaxTensors)
    throw std::invalid_argument(source + ": " + std::to_string(j.size()) +
                                " parameters, above the limit of " + std::to_string(kMaxTensors) +
                                ": a list that long would not plan in reasonable time; give "
                                "only the parameters to plan, or use group keys and fewer entries");
  ModelSpec m;
  m.name = source;
  std::map<std::string, size_t> seen;
  int64_t elements = 0;
  for (size_t i = 0; i < j.size(); ++i) {
    const json& e = j[i];
    const std::string at = source + ": entry " + std::to_string(i);
    if (!e.is_object()) throw std::invalid_argument(at + " is not an object: " + detail::json_brief(e));
    if (!e.contains("name") || !e["name"].is_string() || e["name"].get<std::string>().empty())
      throw std::invalid_argument(at + " needs a non-empty string \"name\"");
    ParamSpec p;
    p.name = e["name"].get<std::string>();
    const std::string who = source + ": parameter '" + p.name + "'";
    if (!e.contains("shape") || !e["shape"].is_array())
      throw std::invalid_argument(who + " needs \"shape\": an array of integers");
    for (const json& d : e["shape"]) {
      if (!d.is_number_integer())
        throw std::invalid_argument(who + " has shape " + detail::json_brief(e["shape"]) +
                                    ": dimensions must be integers");
      p.shape.push_back(d.get<int64_t>());
    }
    for (int64_t d : p.shape)
      if (d < 1)
        throw std::invalid_argument(who + " has shape " + detail::json_brief(e["shape"]) + ": dimension " +
                                    std::to_string(d) + " is not >= 1");
    std::string dt = default_dtype;
    if (e.contains("dtype")) {
      if (!e["dtype"].is_string())
        throw std::invalid_argument(who + " has a non-string \"dtype\": " + detail::json_brief(e["dtype"]));
      dt = e["dtype"].get<std::string>();
    }
    try {
      p.elem_bytes = dtype_bytes(dt);
    } catch (const std::invalid_argument& ex) {
      throw std::invalid_argument(who + ": " + ex.what());
    }
    for (const char* key : {"group", "group_key"})
      if (e.contains(key)) {
        if (!e[key].is_string())
          throw std::invalid_argument(who + " has a non-string \"" + key + "\": " + detail::json_brief(e[key]));
        p.group_key = e[key].get<std::string>();
      }
    if (e.contains("route") && e["route"].is_string()) p.route = e["route"].get<std::string>();
    auto [it, fresh] = seen.emplace(p.name, i);
    if (!fresh)
      throw std::invalid_argument(who + " appears twice (entries " + std::to_string(it->second) +
                                  " and " + std::to_string(i) + "); names must be unique");
    if (__builtin_add_overflow(elements, p.numel(), &elements) || elements > kMaxElements)
      throw std::invalid_argument(who + ": the list reaches more than " +
                                  std::to_string(kMaxElements) + " elements in total, above "
                                  "any real model; check the shapes");
    m.params.push_back(std::move(p));
  }
  return m;
}

ModelSpec load_params_json(const std::string& path, const std::string& default_dtype) {
  return model_from_params_json(read_file(path, "parameter list"), path, default_dtype);
}

bool name_matches(const std::string& name, const std::string& pattern) {
  if (pattern.find_first_of("*?") != std::string::npos)
    return glob_match(pattern.c_str(), name.c_str());
  return name.find(pattern) != std::string::npos;
}

bool is_default_muon_target(const ParamSpec& p) {
  if (p.shape.size() != 2) return false;
  size_t start = 0;
  while (start <= p.name.size()) {
    const size_t dot = p.name.find('.', start);
    const std::string c = lower(p.name.substr(start, dot == std::string::npos ? std::string::npos
                                                                              : dot - start));
    if (c.find("embed") != std::string::npos || c.find("norm") != std::string::npos ||
        c.rfind("ln", 0) == 0 || c == "head" || c == "lm_head" || c == "wte" || c == "wpe" ||
        ends_with(c, "_head"))
      return false;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return true;
}

bool is_muon_target(const ParamSpec& p, const MuonTargetSelector& selector) {
  bool selected;
  if (selector.include.empty()) {
    selected = is_default_muon_target(p);
  } else {
    selected = p.shape.size() >= 2 &&
               std::any_of(selector.include.begin(), selector.include.end(),
                           [&](const std::string& pat) { return name_matches(p.name, pat); });
  }
  if (selected)
    for (const std::string& pat : selector.exclude)
      if (name_matches(p.name, pat)) return false;
  return selected;
}

std::vector<ParamSpec> select_muon_params(const ModelSpec& model,
                                          const MuonTargetSelector& selector) {
  std::vector<ParamSpec> out;
  for (const ParamSpec& p : model.params)
    if (is_muon_target(p, selector)) {
      out.push_back(p);
      out.back().route = "muon";
    }
  return out;
}

}  // namespace dmuon

namespace dmuon {

int megatron_tp_split_dim(const ParamSpec& p, int tp_size) {
  if (tp_size <= 1 || p.shape.size() != 2) return -1;
  const std::string suffix = ".weight";
  if (p.name.size() <= suffix.size() || p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return -1;
  const std::string module = p.name.substr(0, p.name.size() - suffix.size());
  const std::string leaf = module.substr(module.rfind('.') == std::string::npos ? 0 : module.rfind('.') + 1);
  static const std::vector<std::pair<std::vector<std::string>, int>> rules = {
      {{"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "qkv", "fc1", "q_b_proj", "kv_b_proj",
        "query", "key", "value"}, 0},
      {{"o_proj", "down_proj", "w2", "proj", "fc2", "out_proj", "dense"}, 1},
      {{"c_attn", "c_fc"}, 1},
      {{"c_proj"}, 0},
  };
  for (const auto& [names, dim] : rules)
    if (std::find(names.begin(), names.end(), leaf) != names.end())
      return p.shape[static_cast<size_t>(dim)] % tp_size == 0 ? dim : -1;
  return -1;
}

}  // namespace dmuon
