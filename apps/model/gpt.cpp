#include "model/gpt.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <map>

#include "dmuon/dedicate.h"

namespace dmuon::models {

int64_t GPTConfig::ffn_dim() const {
  if (d_ff > 0) return d_ff;
  const int64_t f = static_cast<int64_t>(std::llround(8.0 * d_model / 3.0));
  return (f + 7) / 8 * 8;
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  // as transformers' LlamaRMSNorm: 16-bit inputs are normalised in float32
  const at::Tensor h = x.element_size() < 4 ? x.to(at::kFloat) : x;
  const at::Tensor w = tp_partial_grad ? tp_copy_to_parallel(weight, tp_partial_grad) : weight;
  return w * (h * at::rsqrt(h.pow(2).mean({-1}, /*keepdim=*/true) + eps_)).to(x.scalar_type());
}

namespace {
torch::nn::Linear linear(int64_t in, int64_t out, bool bias = false) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}
}  // namespace

Projection register_projection(torch::nn::Module& owner, const std::string& name, int64_t in, int64_t out,
                               bool column, bool bias, const std::shared_ptr<Mesh>& tp_mesh) {
  Projection p;
  if (!tp_mesh || tp_mesh->tp_size() == 1)
    p.plain = owner.register_module(name, linear(in, out, bias));
  else if (column)
    p.column = owner.register_module(name, ColumnParallelLinear(ParallelLinearOptions(in, out).with_bias(bias), tp_mesh));
  else
    p.row = owner.register_module(name, RowParallelLinear(ParallelLinearOptions(in, out).with_bias(bias), tp_mesh));
  return p;
}

at::Tensor Projection::operator()(const at::Tensor& x) {
  if (!plain.is_empty()) return plain(x);
  return !column.is_empty() ? column(x) : row(x);
}

BlockImpl::BlockImpl(const GPTConfig& cfg)
    : n_heads_(cfg.n_heads / cfg.tp_size()), head_dim_(cfg.d_model / cfg.n_heads) {
  TORCH_CHECK(cfg.d_model % cfg.n_heads == 0, "GPT: d_model ", cfg.d_model, " is not divisible by n_heads ",
              cfg.n_heads);
  TORCH_CHECK(cfg.n_heads % cfg.tp_size() == 0, "GPT: n_heads ", cfg.n_heads, " is not divisible by the mesh's tp_size ", cfg.tp_size(),
              "; q/k/v are split over the TP ranks by heads. Pick a tp_size that divides ", cfg.n_heads, ".");
  const int64_t d = cfg.d_model, f = cfg.ffn_dim();
  // registered in the single-process order, so a TP model draws the same random numbers
  auto proj = [&](const char* name, int64_t in, int64_t out, bool column) {
    return register_projection(*this, name, in, out, column, false, cfg.tp_mesh);
  };
  attn_norm = register_module("attn_norm", RMSNorm(d, cfg.norm_eps));
  q_proj = proj("q_proj", d, d, true);
  k_proj = proj("k_proj", d, d, true);
  v_proj = proj("v_proj", d, d, true);
  o_proj = proj("o_proj", d, d, false);
  mlp_norm = register_module("mlp_norm", RMSNorm(d, cfg.norm_eps));
  gate_proj = proj("gate_proj", d, f, true);
  up_proj = proj("up_proj", d, f, true);
  down_proj = proj("down_proj", f, d, false);
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  // TP: this rank's heads (H of n_heads), a D / tp slice of the attention output
  const int64_t B = x.size(0), T = x.size(1), H = n_heads_, Dh = head_dim_;
  const int64_t D = H * Dh;
  at::Tensor h = attn_norm(x);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, H, Dh}).transpose(1, 2); };
  at::Tensor q = heads(q_proj(h)), k = heads(k_proj(h)), v = heads(v_proj(h));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(Dh));
  at::Tensor mask = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  at::Tensor attn = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({B, T, D});
  at::Tensor y = x + o_proj(attn);
  at::Tensor m = mlp_norm(y);
  return y + down_proj(at::silu(gate_proj(m)) * up_proj(m));
}

GPTImpl::GPTImpl(const GPTConfig& cfg) : cfg_(cfg) {
  tok_emb = register_module("tok_emb", torch::nn::Embedding(cfg.vocab_size, cfg.d_model));
  cfg.deferred.apply(*tok_emb);
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layers; ++i) {
    blocks.push_back(Block(cfg));
    cfg.deferred.apply(*blocks.back());
    layers->push_back(blocks.back());
  }
  final_norm = register_module("final_norm", RMSNorm(cfg.d_model, cfg.norm_eps));
  head = register_module("head", linear(cfg.d_model, cfg.vocab_size));
  cfg.deferred.apply(*this);
  // GPT-2 style init: small normal weights (TP slices: the slice of the full draw); deferred: the
  // source given to dedicate_params initialises (init_source)
  if (!cfg.deferred.enabled) init_weights_like_single_process(*this, 0.02, cfg.tp_mesh);
  frozen_blocks.assign(static_cast<size_t>(cfg.n_layers), false);
}

at::Tensor GPTImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "GPT: expected tokens [batch, seq], got shape ", tokens.sizes());
  // every module with parameters runs through dmuon::forward: a plain call unless dmuon made it a
  // hook boundary (e.g. the embedding and head on the sharded_adamw route)
  at::Tensor x;
  if (frozen_embedding) {
    at::NoGradGuard ng;
    x = dmuon::forward(tok_emb, tokens);
  } else {
    x = dmuon::forward(tok_emb, tokens);
  }
  std::vector<int> order = block_order;
  if (order.empty())
    for (size_t i = 0; i < blocks.size(); ++i) order.push_back(static_cast<int>(i));
  for (int idx : order) {
    TORCH_CHECK(idx >= 0 && idx < static_cast<int>(blocks.size()), "GPT: block_order names block ", idx, " of ",
                blocks.size());
    const size_t i = static_cast<size_t>(idx);
    if (i < frozen_blocks.size() && frozen_blocks[i]) {
      at::NoGradGuard ng;
      x = dmuon::forward(blocks[i], x);
    } else {
      x = dmuon::forward(blocks[i], x);
    }
  }
  x = dmuon::forward(final_norm, x);
  return dmuon::forward(head, x);
}

bool GPTImpl::is_muon_matrix(const std::string& name, const at::Tensor& p) const {
  return models::is_muon_matrix(name, p);
}

std::string GPTImpl::describe() const {
  return "GPT d=" + std::to_string(cfg_.d_model) + " layers=" + std::to_string(cfg_.n_layers) +
         " heads=" + std::to_string(cfg_.n_heads);
}

bool is_muon_matrix(const std::string& name, const at::Tensor& p) {
  return p.dim() == 2 && name.rfind("layers.", 0) == 0;
}

}  // namespace dmuon::models
