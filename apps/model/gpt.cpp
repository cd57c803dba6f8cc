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
  return x * at::rsqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps_) * weight;
}

namespace {
torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}
}  // namespace

at::Tensor Projection::operator()(const at::Tensor& x) {
  if (!plain.is_empty()) return plain(x);
  return !column.is_empty() ? column(x) : row(x);
}

BlockImpl::BlockImpl(const GPTConfig& cfg)
    : n_heads_(cfg.n_heads / cfg.tp_size()), head_dim_(cfg.d_model / cfg.n_heads) {
  TORCH_CHECK(cfg.d_model % cfg.n_heads == 0, "GPT: d_model ", cfg.d_model, " is not divisible by n_heads ",
              cfg.n_heads);
  const int tp = cfg.tp_size();
  TORCH_CHECK(cfg.n_heads % tp == 0, "GPT: n_heads ", cfg.n_heads, " is not divisible by the mesh's tp_size ", tp,
              "; q/k/v are split over the TP ranks by heads. Pick a tp_size that divides ", cfg.n_heads, ".");
  const int64_t d = cfg.d_model, f = cfg.ffn_dim();
  // registered in the single-process order, so a TP model draws the same random numbers
  auto proj = [&](const char* name, int64_t in, int64_t out, bool column) {
    Projection p;
    if (tp == 1)
      p.plain = register_module(name, linear(in, out));
    else if (column)
      p.column = register_module(name, ColumnParallelLinear(ParallelLinearOptions(in, out), cfg.tp_mesh));
    else
      p.row = register_module(name, RowParallelLinear(ParallelLinearOptions(in, out), cfg.tp_mesh));
    return p;
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
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layers; ++i) {
    blocks.push_back(Block(cfg));
    layers->push_back(blocks.back());
  }
  final_norm = register_module("final_norm", RMSNorm(cfg.d_model, cfg.norm_eps));
  head = register_module("head", linear(cfg.d_model, cfg.vocab_size));
  // GPT-2 style init: small normal weights (TP slices: the slice of the full draw).
  at::NoGradGuard ng;
  const std::map<std::string, int> split = tp_split_dims(*this);
  for (auto& p : named_parameters(true)) {
    if (p.key().find("norm") != std::string::npos) continue;
    auto it = split.find(p.key());
    if (it == split.end()) {
      p.value().normal_(0.0, 0.02);
      continue;
    }
    std::vector<int64_t> full = p.value().sizes().vec();
    full[static_cast<size_t>(it->second)] *= cfg.tp_size();
    p.value().copy_(tp_slice(at::empty(full, p.value().options()).normal_(0.0, 0.02), it->second,
                             cfg.tp_mesh->tp_rank(), cfg.tp_size()));
  }
  frozen_blocks.assign(static_cast<size_t>(cfg.n_layers), false);
}

at::Tensor GPTImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "GPT: expected tokens [batch, seq], got shape ", tokens.sizes());
  // every module with parameters runs through dmuon::forward: a plain call unless dmuon made it a
  // hook boundary (e.g. the embedding and head on the sharded_adamw route)
  at::Tensor x = dmuon::forward(tok_emb, tokens);
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

at::Tensor GPTImpl::loss(const at::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  at::Tensor input = tokens.narrow(1, 0, T - 1), target = tokens.narrow(1, 1, T - 1);
  at::Tensor logits = forward(input);
  if (logits.element_size() < 4) logits = logits.to(at::kFloat);  // mixed precision: the loss in fp32
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
}

bool is_muon_matrix(const std::string& name, const at::Tensor& p) {
  return p.dim() == 2 && name.rfind("layers.", 0) == 0;
}

}  // namespace dmuon::models
