#include "support/training.h"

#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>

#include "dmuon/bootstrap.h"
#include "dmuon/newton_schulz.h"

namespace dmuon::testing {

using models::GPT;
using models::GPTConfig;

models::GPTConfig small_config(int64_t layers) {
  GPTConfig c;
  c.vocab_size = 32;
  c.d_model = 32;
  c.n_layers = layers;
  c.n_heads = 4;
  c.d_ff = 48;
  return c;
}

StateDict init_state(const GPTConfig& cfg, uint64_t seed, at::ScalarType dtype) {
  at::manual_seed(seed);
  GPT m(cfg);
  StateDict sd;
  for (const auto& p : m->named_parameters(true)) sd[p.key()] = p.value().detach().clone();
  // norms at non-trivial values so their AdamW path is exercised
  for (auto& [k, v] : sd)
    if (k.find("norm") != std::string::npos) v.uniform_(0.5, 1.5);
  for (auto& [k, v] : sd) v = v.to(dtype);
  return sd;
}

void load_state(GPT& m, const StateDict& sd) {
  if (!sd.empty()) m->to(sd.begin()->second.scalar_type());
  at::NoGradGuard ng;
  const std::map<std::string, int> split = tp_split_dims(*m);
  const auto& mesh = m->config().tp_mesh;
  for (auto& p : m->named_parameters(true)) {
    const at::Tensor& full = sd.at(p.key());
    auto it = split.find(p.key());
    p.value().copy_(it == split.end() ? full : tp_slice(full, it->second, mesh->tp_rank(), mesh->tp_size()));
  }
}

GPT make_gpt(const GPTConfig& cfg, at::ScalarType dtype) {
  GPT m(cfg);
  m->to(dtype);
  return m;
}

std::vector<at::Tensor> make_batches(int steps, int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<at::Tensor> out;
  // learnable sequences: each row counts up from a random start with a random stride in {1, 2}
  for (int s = 0; s < steps; ++s) {
    at::Tensor start = at::randint(vocab, {batch, 1}, at::kLong);
    at::Tensor stride = at::randint(1, 3, {batch, 1}, at::kLong);
    out.push_back((start + stride * at::arange(seq, at::kLong).unsqueeze(0)).remainder(vocab));
  }
  return out;
}

RefResult reference_train(const GPTConfig& cfg, const StateDict& init, const std::vector<at::Tensor>& batches,
                          const TrainConfig& tc) {
  GPT m(cfg);
  load_state(m, init);
  m->frozen_blocks = tc.frozen.empty() ? std::vector<bool>(cfg.n_layers, false) : tc.frozen;
  m->block_order = tc.block_order;
  m->frozen_embedding = tc.frozen_embedding;
  // LR schedule from LibTorch's own StepLR on a throwaway optimizer
  at::Tensor dummy = at::zeros({1}, at::requires_grad());
  torch::optim::SGD sgd({dummy}, torch::optim::SGDOptions(1.0));
  torch::optim::StepLR sched(sgd, 3, 0.5);
  RefResult r;
  std::map<std::string, at::Tensor> buf, m1, m2;
  std::map<std::string, int64_t> t;
  for (size_t s = 0; s < batches.size(); ++s) {
    const at::Tensor& tokens = batches[s];
    if (tc.frozen_on_odd_steps >= 0) m->frozen_blocks[static_cast<size_t>(tc.frozen_on_odd_steps)] = s % 2 == 1;
    const double f = sgd.param_groups()[0].options().get_lr();
    if (!tc.keep_grads) {  // torch's zero_grad: None, or zeros where a gradient was
      for (auto& p : m->parameters()) {
        if (tc.zero_grad_to_none || !p.grad().defined())
          p.mutable_grad() = at::Tensor();
        else
          p.mutable_grad().zero_();
      }
    }
    at::Tensor loss = m->loss(tokens);
    loss.backward();
    r.losses.push_back(loss.item<double>());
    at::NoGradGuard ng;
    if (tc.clip > 0) {  // torch::nn::utils::clip_grad_norm_ over the whole model
      double sq = 0;
      for (auto& p : m->parameters())
        if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
      const double coef = std::min(1.0, tc.clip / (std::sqrt(sq) + 1e-6));
      if (coef < 1.0)
        for (auto& p : m->parameters())
          if (p.grad().defined()) p.mutable_grad().mul_(coef);
    }
    if (tc.edit_grads) {
      std::vector<std::pair<std::string, at::Tensor>> named;
      for (const auto& item : m->named_parameters(true)) named.emplace_back(item.key(), item.value());
      tc.edit_grads(s, named);
    }
    for (auto& item : m->named_parameters(true)) {
      at::Tensor p = item.value();
      const std::string& name = item.key();
      if (!p.grad().defined()) continue;
      const at::Tensor g = p.grad();
      if (models::is_muon_matrix(name, p)) {
        const double lr = tc.lr * (tc.scheduler ? f : 1.0);
        if (!buf.count(name)) buf[name] = at::zeros_like(g);
        buf[name].mul_(tc.momentum).add_(g);
        at::Tensor u = tc.nesterov ? g.add(buf[name], tc.momentum) : buf[name];
        at::Tensor o = newton_schulz(u);
        p.mul_(1 - lr * tc.wd);
        const double scale = 0.2 * std::sqrt(static_cast<double>(std::max(p.size(0), p.size(1))));
        p.add_(o, -lr * scale);
      } else {
        const double lr = tc.adamw_lr * (tc.scheduler ? f : 1.0);
        if (!m1.count(name)) {
          m1[name] = at::zeros_like(p);
          m2[name] = at::zeros_like(p);
          t[name] = 0;
        }
        const int64_t step = ++t[name];
        p.mul_(1 - lr * tc.adamw_wd);
        m1[name].mul_(0.9).add_(g, 1 - 0.9);
        m2[name].mul_(0.999).addcmul_(g, g, 1 - 0.999);
        const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.999, step);
        p.addcdiv_(m1[name], (m2[name].sqrt() / std::sqrt(bc2)).add_(1e-8), -lr / bc1);
      }
    }
    if (tc.scheduler) sched.step();
  }
  for (const auto& item : m->named_parameters(true)) r.params[item.key()] = item.value().detach().clone();
  r.momentum = buf;
  r.exp_avg = m1;
  return r;
}

MuonOptions muon_options(const TrainConfig& tc) {
  MuonOptions mo;
  mo.lr = tc.lr;
  mo.momentum = tc.momentum;
  mo.weight_decay = tc.wd;
  mo.adamw_lr = tc.adamw_lr;
  mo.adamw_weight_decay = tc.adamw_wd;
  mo.nesterov = tc.nesterov;
  mo.first_step_progress_log = false;
  return mo;
}

std::vector<double> train_slices(GPT& m, Muon& opt, const std::vector<at::Tensor>& batches, int rank, int64_t per) {
  std::vector<double> losses;
  const at::Device dev = m->parameters().front().device();  // the data goes where the model is
  for (const auto& tokens : batches) {
    opt.zero_grad();
    at::Tensor loss = m->loss(tokens.narrow(0, rank * per, per).to(dev));
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

void dedicate_gpt(GPT& m, const std::shared_ptr<Mesh>& mesh, const Layout& l, DedicateOptions o) {
  o.reshard_after_forward = l.z3;
  o.plan.pack_small_params = l.pack_small_params;
  o.muon_forward_unshard = l.unshard;
  if (l.sharded)
    o.route_hint_fn = [](const std::string& n, const at::Tensor& p) -> std::string {
      return models::is_muon_matrix(n, p) ? "" : "sharded_adamw";
    };
  if (l.ddp)
    dedicate_params_ddp(m.ptr(), mesh, models::is_muon_matrix, o);
  else
    dedicate_params(m.ptr(), mesh, models::is_muon_matrix, o);
  replicate(m.ptr(), mesh);
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor A = a.to(at::kDouble).cpu(), B = b.to(at::kDouble).cpu();  // either may be on a GPU
  const double scale = std::max(B.norm().item<double>(), 1e-12);
  return (A - B).norm().item<double>() / scale;
}

std::shared_ptr<Mesh> make_mesh(RankContext& ctx, std::chrono::milliseconds timeout, int replicate, int tp) {
  MeshOptions mo;
  mo.store = ctx.store;
  mo.factory = ctx.factory;
  mo.timeout = timeout;
  mo.replicate_size = replicate;
  mo.tp_size = tp;
  return Mesh::create(ctx.pg, mo);
}

}  // namespace dmuon::testing
