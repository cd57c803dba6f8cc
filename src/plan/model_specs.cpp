// model_specs.cpp -- presets, Hugging Face config and parameter-list loaders, the Muon predicate.
#include "dmuon/model_specs.h"

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

// ---- model builders -----------------------------------------------------------------------

class Builder {
 public:
  Builder(std::string name, int64_t elem_bytes) : elem_bytes_(elem_bytes) { spec_.name = std::move(name); }
  void add(const std::string& name, std::vector<int64_t> shape) {
    ParamSpec p;
    p.name = name;
    p.shape = std::move(shape);
    p.elem_bytes = elem_bytes_;
    spec_.params.push_back(std::move(p));
  }
  ModelSpec take() { return std::move(spec_); }

 private:
  ModelSpec spec_;
  int64_t elem_bytes_;
};

// Reads a positive integer field of a config; `fallback` < 0 means required.
int64_t cfg_int(const json& cfg, const std::string& key, const std::string& source,
                int64_t fallback = -1) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) {
    if (fallback >= 0) return fallback;
    throw std::invalid_argument(source + ": missing required field '" + key + "'");
  }
  if (!it->is_number_integer())
    throw std::invalid_argument(source + ": field '" + key + "' must be a positive integer, got " +
                                it->dump());
  const int64_t v = it->get<int64_t>();
  if (v < 1)
    throw std::invalid_argument(source + ": field '" + key + "' must be a positive integer, got " +
                                std::to_string(v));
  return v;
}

bool cfg_bool(const json& cfg, const std::string& key, bool fallback) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return fallback;
  return it->get<bool>();
}

ModelSpec build_llama_family(const json& cfg, const std::string& type, const std::string& name,
                             int64_t eb, const std::string& src) {
  const int64_t d = cfg_int(cfg, "hidden_size", src);
  const int64_t L = cfg_int(cfg, "num_hidden_layers", src);
  const int64_t H = cfg_int(cfg, "num_attention_heads", src);
  const int64_t KV = cfg_int(cfg, "num_key_value_heads", src, H);
  const int64_t ffn = cfg_int(cfg, "intermediate_size", src);
  const int64_t V = cfg_int(cfg, "vocab_size", src);
  if (!cfg.contains("head_dim") || cfg["head_dim"].is_null()) {
    if (d % H != 0)
      throw std::invalid_argument(src + ": hidden_size " + std::to_string(d) +
                                  " is not divisible by num_attention_heads " + std::to_string(H) +
                                  "; set head_dim explicitly");
  }
  const int64_t hd = cfg_int(cfg, "head_dim", src, d / H);
  const bool tie = cfg_bool(cfg, "tie_word_embeddings", false);
  const bool qkv_bias = type == "qwen2" || cfg_bool(cfg, "attention_bias", false);
  const bool o_bias = type == "llama" && cfg_bool(cfg, "attention_bias", false);
  const bool mlp_bias = type == "llama" && cfg_bool(cfg, "mlp_bias", false);
  const bool moe = type == "mixtral";
  const int64_t E = moe ? cfg_int(cfg, "num_local_experts", src) : 0;

  Builder b(name, eb);
  b.add("model.embed_tokens.weight", {V, d});
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    b.add(p + "self_attn.q_proj.weight", {H * hd, d});
    if (qkv_bias) b.add(p + "self_attn.q_proj.bias", {H * hd});
    b.add(p + "self_attn.k_proj.weight", {KV * hd, d});
    if (qkv_bias) b.add(p + "self_attn.k_proj.bias", {KV * hd});
    b.add(p + "self_attn.v_proj.weight", {KV * hd, d});
    if (qkv_bias) b.add(p + "self_attn.v_proj.bias", {KV * hd});
    b.add(p + "self_attn.o_proj.weight", {d, H * hd});
    if (o_bias) b.add(p + "self_attn.o_proj.bias", {d});
    if (moe) {
      b.add(p + "block_sparse_moe.gate.weight", {E, d});
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
        b.add(x + "w1.weight", {ffn, d});
        b.add(x + "w2.weight", {d, ffn});
        b.add(x + "w3.weight", {ffn, d});
      }
    } else {
      b.add(p + "mlp.gate_proj.weight", {ffn, d});
      if (mlp_bias) b.add(p + "mlp.gate_proj.bias", {ffn});
      b.add(p + "mlp.up_proj.weight", {ffn, d});
      if (mlp_bias) b.add(p + "mlp.up_proj.bias", {ffn});
      b.add(p + "mlp.down_proj.weight", {d, ffn});
      if (mlp_bias) b.add(p + "mlp.down_proj.bias", {d});
    }
    b.add(p + "input_layernorm.weight", {d});
    b.add(p + "post_attention_layernorm.weight", {d});
  }
  b.add("model.norm.weight", {d});
  if (!tie) b.add("lm_head.weight", {V, d});
  return b.take();
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
  const bool tie = cfg_bool(cfg, "tie_word_embeddings", true);
  Builder b(name, eb);
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
  Builder b(name, eb);
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

const std::vector<std::string> kHfTypes = {"llama", "mistral", "qwen2", "mixtral", "gpt2"};

std::string infer_model_type(const json& cfg, const std::string& src) {
  if (cfg.contains("model_type") && cfg["model_type"].is_string())
    return lower(cfg["model_type"].get<std::string>());
  if (cfg.contains("architectures") && cfg["architectures"].is_array()) {
    for (const auto& a : cfg["architectures"]) {
      if (!a.is_string()) continue;
      const std::string arch = lower(a.get<std::string>());
      for (const std::string& t : {std::string("mixtral"), std::string("mistral"),
                                   std::string("qwen2"), std::string("llama"), std::string("gpt2")})
        if (arch.rfind(t, 0) == 0) return t;
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
  if (type == "llama" || type == "mistral" || type == "qwen2" || type == "mixtral")
    return build_llama_family(cfg, type, name, eb, src);
  throw std::invalid_argument(src + ": unsupported model_type '" + type +
                              "' (supported: " + join(kHfTypes) + ")");
}

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
    v.push_back({"mixtral-8x7b", "Mixtral 8x7B: 32 layers, 8 experts x (w1, w2, w3), d 4096",
                 mix});
    v.push_back({"vit-l16", "ViT-L/16 (timm): 24 x blocks.N, d 1024, mlp 4096", json()});
    return v;
  }();
  return kPresets;
}

std::string normalize_preset(const std::string& s) {
  std::string out;
  for (char c : lower(s))
    if (c != '-' && c != '_' && c != '/' && c != ' ') out += c;
  return out;
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

int64_t dtype_bytes(const std::string& dtype) {
  const std::string d = lower(dtype);
  if (d == "bf16" || d == "bfloat16" || d == "fp16" || d == "float16" || d == "half") return 2;
  if (d == "fp32" || d == "float32" || d == "float") return 4;
  if (d == "fp64" || d == "float64" || d == "double") return 8;
  if (d == "fp8" || d.rfind("float8", 0) == 0 || d == "int8" || d == "uint8") return 1;
  throw std::invalid_argument("unknown dtype '" + dtype +
                              "' (use bf16, fp16, fp32, fp64 or fp8)");
}

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
    if (p.config.is_null()) return build_vit(p.name, eb, 24, 1024, 4096, 16, 224, 1000);
    return build_from_config(p.config, "preset " + p.name, p.name, dtype.empty() ? "bf16" : dtype);
  }
  throw std::invalid_argument("unknown preset '" + name + "' (known: " +
                              join(model_preset_names()) + ")");
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
  ModelSpec m;
  m.name = source;
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < j.size(); ++i) {
    const json& e = j[i];
    const std::string at = source + ": entry " + std::to_string(i);
    if (!e.is_object()) throw std::invalid_argument(at + " is not an object: " + e.dump());
    if (!e.contains("name") || !e["name"].is_string() || e["name"].get<std::string>().empty())
      throw std::invalid_argument(at + " needs a non-empty string \"name\"");
    ParamSpec p;
    p.name = e["name"].get<std::string>();
    const std::string who = source + ": parameter '" + p.name + "'";
    if (!e.contains("shape") || !e["shape"].is_array())
      throw std::invalid_argument(who + " needs \"shape\": an array of integers");
    for (const json& d : e["shape"]) {
      if (!d.is_number_integer())
        throw std::invalid_argument(who + " has shape " + e["shape"].dump() +
                                    ": dimensions must be integers");
      p.shape.push_back(d.get<int64_t>());
    }
    for (int64_t d : p.shape)
      if (d < 1)
        throw std::invalid_argument(who + " has shape " + e["shape"].dump() + ": dimension " +
                                    std::to_string(d) + " is not >= 1");
    std::string dt = default_dtype;
    if (e.contains("dtype")) {
      if (!e["dtype"].is_string())
        throw std::invalid_argument(who + " has a non-string \"dtype\": " + e["dtype"].dump());
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
          throw std::invalid_argument(who + " has a non-string \"" + key + "\": " + e[key].dump());
        p.group_key = e[key].get<std::string>();
      }
    if (e.contains("route") && e["route"].is_string()) p.route = e["route"].get<std::string>();
    auto [it, fresh] = seen.emplace(p.name, i);
    if (!fresh)
      throw std::invalid_argument(who + " appears twice (entries " + std::to_string(it->second) +
                                  " and " + std::to_string(i) + "); names must be unique");
    (void)p.numel();  // overflow check
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
