// The Hugging Face decoder families (see hf_decoder.h).
#include "model/hf_decoder.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "dmuon/dedicate.h"
#include "dmuon/tools/model_specs.h"

namespace dmuon::models {

namespace {

using json = nlohmann::json;

const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}
int64_t int_field(const json& j, const char* key, const std::string& src, std::optional<int64_t> fallback = {}) {
  const json* f = field(j, key);
  if (!f) {
    TORCH_CHECK(fallback, src, ": the config has no \"", key, "\"; a ", j.value("model_type", std::string("decoder")),
                " config.json from Hugging Face always has one.");
    return *fallback;
  }
  TORCH_CHECK(f->is_number_integer() && f->get<int64_t>() > 0, src, ": \"", key, "\" must be a positive integer, got ",
              f->dump());
  // bounds of real models, well above the largest published (as `dmuon plan` keeps): products of the sizes
  // (heads x head_dim, the memory estimate) stay far from int64's range
  const std::string k(key);
  const bool layers = k == "num_hidden_layers" || k == "max_window_layers";
  const bool positions = k.find("position") != std::string::npos || k == "sliding_window";
  const int64_t limit = layers ? 10'000 : positions ? int64_t{1} << 31 : int64_t{1} << 20;
  TORCH_CHECK(!f->is_number_unsigned() || f->get<uint64_t>() <= static_cast<uint64_t>(limit), src, ": \"", key,
              "\" is ", f->dump(), ", above the limit of ", limit, ": no real model is that large; check the value.");
  return f->get<int64_t>();
}
double num_field(const json& j, const char* key, const std::string& src, double fallback) {
  const json* f = field(j, key);
  if (!f) return fallback;
  TORCH_CHECK(f->is_number(), src, ": \"", key, "\" must be a number, got ", f->dump());
  return f->get<double>();
}
bool bool_field(const json& j, const char* key, const std::string& src, bool fallback) {
  const json* f = field(j, key);
  if (!f) return fallback;
  TORCH_CHECK(f->is_boolean(), src, ": \"", key, "\" must be true or false, got ", f->dump());
  return f->get<bool>();
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

}  // namespace

HFDecoderConfig HFDecoderConfig::parse(const std::string& text, const std::string& src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, src, " is not JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), src, " is not a config.json object.");
  HFDecoderConfig c;
  const json* mt = field(j, "model_type");
  TORCH_CHECK(mt && mt->is_string(), src, ": no \"model_type\"; dmuon train builds llama, mistral, qwen2 and qwen3 "
              "from transformers' config.json.");
  c.model_type = mt->get<std::string>();
  const std::set<std::string> families{"llama", "mistral", "qwen2", "qwen3"};
  TORCH_CHECK(families.count(c.model_type), src, ": model_type \"", c.model_type, "\" is not a family dmuon train "
              "builds (llama, mistral, qwen2, qwen3). `dmuon plan --hf-config` plans more (MoE families included).");
  c.vocab_size = int_field(j, "vocab_size", src);
  TORCH_CHECK(c.vocab_size >= 256, src, ": vocab_size ", c.vocab_size, " is below 256; dmuon train feeds the text "
              "as bytes (token ids 0..255), so the embedding needs at least 256 rows. Raise vocab_size to 256 or more.");
  c.hidden_size = int_field(j, "hidden_size", src);
  c.intermediate_size = int_field(j, "intermediate_size", src);
  c.num_hidden_layers = int_field(j, "num_hidden_layers", src);
  c.num_attention_heads = int_field(j, "num_attention_heads", src);
  c.num_key_value_heads = int_field(j, "num_key_value_heads", src, c.num_attention_heads);
  try {  // the check `dmuon plan` makes
    check_attention_heads(c.num_attention_heads, c.num_key_value_heads, c.hidden_size, field(j, "head_dim") != nullptr,
                          src);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
  c.head_dim = int_field(j, "head_dim", src, c.hidden_size / c.num_attention_heads);
  TORCH_CHECK(c.head_dim % 2 == 0, src, ": head_dim ", c.head_dim, " is odd; rotary embeddings rotate pairs.");
  c.max_position_embeddings = int_field(j, "max_position_embeddings", src, 4096);
  c.rms_norm_eps = num_field(j, "rms_norm_eps", src, 1e-6);
  c.rope_theta = num_field(j, "rope_theta", src, 10000.0);
  c.initializer_range = num_field(j, "initializer_range", src, 0.02);
  // values that would make every loss NaN (or train a degenerate model) without another word
  TORCH_CHECK(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0 && c.rms_norm_eps < 1, src, ": rms_norm_eps ",
              c.rms_norm_eps, " must be in (0, 1) (a small positive number such as 1e-6; the norm divides by "
              "sqrt(mean(x^2) + eps)).");
  TORCH_CHECK(std::isfinite(c.rope_theta) && c.rope_theta > 1, src, ": rope_theta ", c.rope_theta, " must be a finite "
              "number > 1 (the base of the rotary frequencies, 10000 or more in published configs).");
  TORCH_CHECK(std::isfinite(c.initializer_range) && c.initializer_range >= 0, src, ": initializer_range ",
              c.initializer_range, " must be a finite number >= 0.");
  c.tie_word_embeddings = bool_field(j, "tie_word_embeddings", src, false);
  if (const json* act = field(j, "hidden_act"))
    TORCH_CHECK(act->is_string() && act->get<std::string>() == "silu", src, ": hidden_act ", act->dump(),
                " is not supported; these families use \"silu\" (SwiGLU).");
  const bool attn_bias = bool_field(j, "attention_bias", src, false);
  const bool llama_like = c.model_type == "llama" || c.model_type == "qwen3";
  c.qkv_bias = c.model_type == "qwen2" || (llama_like && attn_bias);
  c.o_bias = llama_like && attn_bias;
  c.mlp_bias = c.model_type == "llama" && bool_field(j, "mlp_bias", src, false);
  c.qk_norm = c.model_type == "qwen3";
  if (c.model_type == "mistral") {
    if (field(j, "sliding_window")) c.sliding_window = int_field(j, "sliding_window", src);
  } else if (c.model_type != "llama" && bool_field(j, "use_sliding_window", src, false)) {
    // qwen2/3: the window applies from layer max_window_layers on; dmuon applies it to every layer
    // only when that is every layer
    const int64_t from = int_field(j, "max_window_layers", src, 0);
    TORCH_CHECK(from == 0, src, ": use_sliding_window with max_window_layers ", from, " (a window on some layers "
                "only) is not supported; set use_sliding_window false or max_window_layers 0.");
    c.sliding_window = int_field(j, "sliding_window", src);
  }
  if (const json* rs = field(j, "rope_scaling")) {
    TORCH_CHECK(rs->is_object(), src, ": rope_scaling must be an object, got ", rs->dump());
    const json* named = field(*rs, "rope_type") ? field(*rs, "rope_type") : field(*rs, "type");
    TORCH_CHECK(!named || named->is_string(), src, ": rope_scaling's rope_type must be a string, got a ",
                named->type_name());
    std::string type = named ? named->get<std::string>() : std::string("default");
    TORCH_CHECK(type == "default" || type == "linear" || type == "llama3", src, ": rope_scaling type \"", type,
                "\" is not supported (dmuon has default, linear and llama3).");
    c.rope_type = type;
    if (type != "default") c.rope_factor = num_field(*rs, "factor", src, 1.0);
    if (type == "llama3") {
      c.rope_low_freq_factor = num_field(*rs, "low_freq_factor", src, 1.0);
      c.rope_high_freq_factor = num_field(*rs, "high_freq_factor", src, 4.0);
      c.rope_original_max_position = int_field(*rs, "original_max_position_embeddings", src, 8192);
    }
    TORCH_CHECK(std::isfinite(c.rope_factor) && c.rope_factor > 0, src, ": rope_scaling factor must be a finite "
                "number > 0, got ", c.rope_factor, ".");
    TORCH_CHECK(std::isfinite(c.rope_low_freq_factor) && std::isfinite(c.rope_high_freq_factor) &&
                    c.rope_high_freq_factor > c.rope_low_freq_factor && c.rope_low_freq_factor > 0,
                src, ": rope_scaling needs 0 < low_freq_factor < high_freq_factor (got ", c.rope_low_freq_factor,
                " and ", c.rope_high_freq_factor, ").");
  }
  return c;
}

HFDecoderConfig HFDecoderConfig::load(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, "--hf-config ", path, ": cannot read the file (", std::strerror(errno), ").");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

HFAttentionImpl::HFAttentionImpl(const HFDecoderConfig& c)
    : heads_(c.num_attention_heads / c.tp_size()), kv_heads_(c.num_key_value_heads / c.tp_size()),
      head_dim_(c.head_dim), window_(c.sliding_window) {
  const int tp = c.tp_size();
  TORCH_CHECK(c.num_attention_heads % tp == 0 && c.num_key_value_heads % tp == 0, c.model_type, ": tensor parallelism ",
              tp, " must divide num_attention_heads ", c.num_attention_heads, " and num_key_value_heads ",
              c.num_key_value_heads, " (q/k/v are split by heads).");
  const int64_t d = c.hidden_size, q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  q_proj = register_projection(*this, "q_proj", d, q, true, c.qkv_bias, c.tp_mesh);
  k_proj = register_projection(*this, "k_proj", d, kv, true, c.qkv_bias, c.tp_mesh);
  v_proj = register_projection(*this, "v_proj", d, kv, true, c.qkv_bias, c.tp_mesh);
  o_proj = register_projection(*this, "o_proj", q, d, false, c.o_bias, c.tp_mesh);
  if (c.qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(c.head_dim, c.rms_norm_eps));
    k_norm = register_module("k_norm", RMSNorm(c.head_dim, c.rms_norm_eps));
    if (tp > 1) {  // each TP rank normalises its own heads: the weights' gradients are partial
      q_norm->tp_partial_grad = c.tp_mesh;
      k_norm->tp_partial_grad = c.tp_mesh;
    }
  }
  // transformers' rotary frequencies, computed as it does: in float32 whatever the model's dtype
  at::Tensor inv = 1.0 / at::pow(c.rope_theta, at::arange(0, c.head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) /
                                                   static_cast<double>(c.head_dim));
  if (c.rope_type == "linear") inv = inv / c.rope_factor;
  if (c.rope_type == "llama3") {
    const double old = static_cast<double>(c.rope_original_max_position);
    const double low_wl = old / c.rope_low_freq_factor, high_wl = old / c.rope_high_freq_factor;
    const at::Tensor wl = 2 * M_PI / inv;
    at::Tensor scaled = at::where(wl > low_wl, inv / c.rope_factor, inv);
    const at::Tensor smooth = (old / wl - c.rope_low_freq_factor) / (c.rope_high_freq_factor - c.rope_low_freq_factor);
    const at::Tensor smoothed = (1 - smooth) * scaled / c.rope_factor + smooth * scaled;
    const at::Tensor medium = at::logical_not(wl < high_wl).logical_and(at::logical_not(wl > low_wl));
    inv = at::where(medium, smoothed, scaled);
  }
  inv_freq_ = inv;
}

at::Tensor HFAttentionImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), H = heads_, KV = kv_heads_, Dh = head_dim_;
  auto heads = [&](const at::Tensor& t, int64_t n) { return t.view({B, T, n, Dh}).transpose(1, 2); };
  at::Tensor q = heads(q_proj(x), H), k = heads(k_proj(x), KV), v = heads(v_proj(x), KV);
  if (!q_norm.is_empty()) {
    q = q_norm(q);
    k = k_norm(k);
  }
  // rotary position embedding on positions 0..T-1, in float32 (as transformers), then cast
  const at::Tensor pos = at::arange(T, at::TensorOptions().dtype(at::kFloat).device(x.device()));
  const at::Tensor freqs = at::outer(pos, inv_freq_.to(x.device()));
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (KV != H) {  // each KV head serves H / KV consecutive query heads
    k = k.repeat_interleave(H / KV, 1);
    v = v.repeat_interleave(H / KV, 1);
  }
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(Dh));
  const auto idx = at::arange(T, at::TensorOptions().dtype(at::kLong).device(x.device()));
  const at::Tensor dist = idx.unsqueeze(1) - idx.unsqueeze(0);  // i - j
  at::Tensor mask = dist < 0;
  if (window_) mask = mask.logical_or(dist >= *window_);
  scores = scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
  const at::Tensor p = at::softmax(scores, -1, scores.element_size() < 4 ? at::kFloat : scores.scalar_type())
                           .to(q.scalar_type());
  return o_proj(at::matmul(p, v).transpose(1, 2).reshape({B, T, H * Dh}));
}

HFMLPImpl::HFMLPImpl(const HFDecoderConfig& c) {
  const int64_t d = c.hidden_size, f = c.intermediate_size;
  gate_proj = register_projection(*this, "gate_proj", d, f, true, c.mlp_bias, c.tp_mesh);
  up_proj = register_projection(*this, "up_proj", d, f, true, c.mlp_bias, c.tp_mesh);
  down_proj = register_projection(*this, "down_proj", f, d, false, c.mlp_bias, c.tp_mesh);
}

at::Tensor HFMLPImpl::forward(const at::Tensor& x) { return down_proj(at::silu(gate_proj(x)) * up_proj(x)); }

HFDecoderLayerImpl::HFDecoderLayerImpl(const HFDecoderConfig& c) {
  // transformers' registration order, so the parameter order (and the init draws) match its listing
  self_attn = register_module("self_attn", HFAttention(c));
  mlp = register_module("mlp", HFMLP(c));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

at::Tensor HFDecoderLayerImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x + self_attn(input_layernorm(x));
  return h + mlp(post_attention_layernorm(h));
}

HFDecoderBodyImpl::HFDecoderBodyImpl(const HFDecoderConfig& c) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.hidden_size));
  c.deferred.apply(*embed_tokens);
  layers_list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers.push_back(HFDecoderLayer(c));
    c.deferred.apply(*layers.back());
    layers_list->push_back(layers.back());
  }
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

HFCausalLMImpl::HFCausalLMImpl(const HFDecoderConfig& c) : cfg_(c) {
  model = register_module("model", HFDecoderBody(c));
  if (!c.tie_word_embeddings)
    lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, c.vocab_size).bias(false)));
  c.deferred.apply(*this);
  if (!c.deferred.enabled) init_weights_like_single_process(*this, c.initializer_range, c.tp_mesh);
}

at::Tensor HFCausalLMImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, cfg_.model_type, ": expected tokens [batch, seq], got shape ", tokens.sizes());
  TORCH_CHECK(tokens.size(1) <= cfg_.max_position_embeddings, cfg_.model_type, ": a sequence of ", tokens.size(1),
              " tokens is longer than max_position_embeddings ", cfg_.max_position_embeddings, "; use a shorter --seq-len.");
  at::Tensor x = dmuon::forward(model->embed_tokens, tokens);
  for (auto& layer : model->layers) x = dmuon::forward(layer, x);
  x = dmuon::forward(model->norm, x);
  if (cfg_.tie_word_embeddings) return at::linear(x, model->embed_tokens->weight);
  return dmuon::forward(lm_head, x);
}

bool HFCausalLMImpl::is_muon_matrix(const std::string& name, const at::Tensor& p) const {
  return p.dim() == 2 && name.rfind("model.layers.", 0) == 0;
}

std::string HFCausalLMImpl::describe() const {
  std::ostringstream o;
  o << cfg_.model_type << " (Hugging Face config) hidden=" << cfg_.hidden_size << " layers=" << cfg_.num_hidden_layers
    << " heads=" << cfg_.num_attention_heads << "/" << cfg_.num_key_value_heads << " kv, head_dim=" << cfg_.head_dim
    << ", ffn=" << cfg_.intermediate_size << ", vocab=" << cfg_.vocab_size
    << (cfg_.tie_word_embeddings ? ", tied embeddings" : "");
  return o.str();
}

}  // namespace dmuon::models
