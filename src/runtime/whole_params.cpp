// Whole parameters' checkpoint and optimizer state (see whole_params.h).
#include "runtime/whole_params.h"

#include <ATen/core/grad_mode.h>

namespace dmuon {

at::Tensor to_state_tensor(const at::Tensor& v, const at::Device& device, at::ScalarType dtype) {
  return v.to(device, dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

void WholeParams::set_params(std::vector<WholeParam> params) {
  params_ = std::move(params);
  index_.clear();
  for (size_t i = 0; i < params_.size(); ++i) index_[params_[i].name] = i;
}

const WholeParam* WholeParams::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &params_[it->second];
}

bool WholeParams::describe(const std::string& name, ParamView& v) const {
  const WholeParam* w = find(name);
  if (!w || !w->trainable()) return false;
  v.route = kind_;
  v.shape = w->param.sizes().vec();
  return true;
}

void WholeParams::gather_full(const TensorSink& put) const {
  for (const auto& w : params_) {
    const at::Tensor m = ctx_.master_of(w.param);
    put(w.name, m.defined() ? m : w.param);
  }
}

void WholeParams::assign_from(ParamSource& source) const {
  at::NoGradGuard ng;
  for (const auto& w : params_) {
    at::Tensor p = w.param.detach();
    const TensorRegion region = ctx_.region_of(w.name, p.sizes());
    if (at::Tensor m = ctx_.master_of(w.param); m.defined()) {
      ctx_.fill_from(source, w.name, region, m);
      ctx_.after_fills([p, m]() mutable { p.copy_(m); });
    } else {
      ctx_.fill_from(source, w.name, region, p);
    }
  }
}

void WholeParams::full_shapes(std::map<std::string, std::vector<int64_t>>& out) const {
  for (const auto& w : params_) out[w.name] = w.param.sizes().vec();
}

void WholeParams::state_slots(std::vector<StateSlot>& out) const {
  for (const auto& w : params_)
    if (w.trainable())
      out.push_back({w.name, w.param.sizes().vec(), false, w.param.requires_grad(), ctx_.precision_of(w.param).optim,
                     w.param.device()});
}

void WholeParams::gather_state(const OptimizerStateReader& opt, const StateSink& put) const {
  for (const auto& w : params_) {
    if (!w.trainable()) continue;
    const ParamState s = opt.get(w.param);  // the same on every rank: all step together
    if (s.defined()) put(w.name, false, s);
  }
}

void WholeParams::assign_state(OptimizerStateAccess& opt, const StateSource& get) const {
  for (const auto& w : params_) {
    if (!w.trainable()) continue;
    std::optional<ParamState> s = get(w.name, false);
    if (!s) {
      opt.set(w.param, ParamState{});
      continue;
    }
    const at::ScalarType dt = ctx_.precision_of(w.param).optim;
    for (at::Tensor& t : s->tensors) t = to_state_tensor(t, w.param.device(), dt);
    opt.set(w.param, std::move(*s));
  }
}

void WholeParams::ready_grads(std::vector<ReadyGrad>& out, bool counted) const {
  for (const auto& w : params_)
    if (w.trainable() && w.param.grad().defined())
      out.push_back(ctx_.ready_grad(w.name, w.param, ctx_.precision_of(w.param), /*muon=*/false, counted, true));
}

}  // namespace dmuon
