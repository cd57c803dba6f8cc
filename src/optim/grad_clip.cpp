// Gradient-norm clipping over a dedicated model (see include/dmuon/grad_clip.h).
#include "dmuon/grad_clip.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <map>
#include <mutex>

#include "dmuon/host_sync.h"
#include "dmuon/muon.h"
#include "dmuon/tensor_parallel.h"
#include "runtime/runtime.h"

namespace dmuon {

namespace {
std::mutex& strategies_mu() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, MuonGradClipStrategy>& strategies() {
  static std::map<std::string, MuonGradClipStrategy> s;
  return s;
}
}  // namespace

void register_muon_grad_clip_strategy(const std::string& name, MuonGradClipStrategy strategy) {
  TORCH_CHECK(name != "global_norm" && !name.empty(), "register_muon_grad_clip_strategy: '", name,
              "' is built in (or empty); pick another name.");
  TORCH_CHECK(static_cast<bool>(strategy), "register_muon_grad_clip_strategy: the strategy '", name, "' is empty.");
  std::lock_guard<std::mutex> g(strategies_mu());
  strategies()[name] = std::move(strategy);
}

MuonGradClipStats Muon::clip_grad_norm_(std::optional<double> max_norm, const GradClipOptions& opts) {
  at::NoGradGuard ng;
  const double p = opts.norm_type;
  TORCH_CHECK(p > 0, "clip_grad_norm_: norm_type must be > 0 (or INFINITY), got ", p);
  TORCH_CHECK(!max_norm || *max_norm >= 0, "clip_grad_norm_: max_norm must be >= 0, got ", *max_norm);
  auto model = model_.lock();
  TORCH_CHECK(model, "clip_grad_norm_: the model was destroyed.");
  auto state = detail::state_of_model(model.get());
  TORCH_CHECK(state, "clip_grad_norm_: the model is no longer dedicated.");
  Mesh& mesh = state->mesh();
  state->prepare_grads();  // collective: the reduces land (idempotent; step() calls it again)
  if (!taken_) taken_ = std::make_shared<std::vector<ReadyGrad>>(state->take_ready_grads());
  std::vector<ReadyGrad>& ready = *taken_;
  const std::map<std::string, int> split = mesh.has_tp() ? tp_split_dims(*model) : std::map<std::string, int>{};
  const bool tp_lead = mesh.tp_rank() == 0, dp_lead = mesh.shard_rank() == 0 && mesh.replicate_rank() == 0;
  // each element once over the whole mesh (see grad_clip.h)
  auto counted = [&](const ReadyGrad& r) {
    const bool whole_over_tp = mesh.has_tp() && !split.count(r.name);
    if (whole_over_tp && !tp_lead) return false;
    switch (r.route) {
      case RouteKind::Dedicated: return true;                      // on its (global) owner only
      case RouteKind::Sharded: return mesh.replicate_rank() == 0;  // every shard rank its slice
      case RouteKind::Replicated: return dp_lead;
      case RouteKind::Local: return true;                          // a single rank
    }
    return false;
  };
  std::vector<ReadyGrad*> scope;
  for (auto& r : ready)
    if (opts.scope == ClipScope::AllParams || r.route == RouteKind::Dedicated) scope.push_back(&r);
  if (opts.strategy != "global_norm") {
    MuonGradClipStrategy custom;
    {
      std::lock_guard<std::mutex> g(strategies_mu());
      auto it = strategies().find(opts.strategy);
      if (it != strategies().end()) custom = it->second;
    }
    if (!custom) {
      std::string known = "global_norm";
      std::lock_guard<std::mutex> g(strategies_mu());
      for (const auto& [name, s] : strategies()) known += ", " + name;
      TORCH_CHECK(false, "rank ", mesh.global_rank(), ": clip_grad_norm_: unknown strategy '", opts.strategy,
                  "'. Registered: ", known, " (register_muon_grad_clip_strategy adds one).");
    }
    std::vector<ClipGrad> grads;
    for (ReadyGrad* r : scope) grads.push_back({r->name, r->grad, counted(*r)});
    MuonGradClipStats s = custom(grads, max_norm, opts, mesh);
    s.strategy = opts.strategy;
    last_clip_ = s;
    return s;
  }
  // this rank's partial: sum |g|^p (or max |g|), the parameters it counts, as float64 on the device
  const bool inf = std::isinf(p);
  at::Tensor part;
  int64_t count = 0;
  for (ReadyGrad* r : scope) {
    if (!counted(*r)) continue;
    const at::Tensor g = r->grad.detach().to(at::kDouble).abs();
    const at::Tensor v = inf ? g.max() : (p == 2 ? g.mul(g).sum() : g.pow(p).sum());
    part = !part.defined() ? v : inf ? at::maximum(part, v) : part + v;
    // each parameter once: a sharded one by shard rank 0 (every shard rank holds a slice), a TP-split
    // one by TP rank 0 (every TP rank holds a slice)
    if ((r->route != RouteKind::Sharded || mesh.shard_rank() == 0) && tp_lead) ++count;
  }
  const at::Tensor local = detail::read_to_host(part.defined() ? part.reshape({1}) : at::zeros({1}, at::kDouble));
  // one all-gather of [partial, count] per rank, combined in rank order (the same bits everywhere)
  const int n = mesh.world_size();
  // on the model's device (NCCL groups take CUDA tensors), whatever this rank owns
  const auto params = model->parameters();
  const at::Device dev = params.empty() ? at::Device(at::kCPU) : params.front().device();
  const at::Tensor mine = at::tensor({local.item<double>(), static_cast<double>(count)}, at::kDouble).to(dev);
  const at::Tensor all = at::empty({2 * n}, at::TensorOptions().dtype(at::kDouble).device(dev));
  mesh.world().allgather_flat(all, mine, "clip_grad_norm_: partial norms").wait();
  const at::Tensor host = all.cpu();
  const double* a = host.data_ptr<double>();
  double acc = 0;
  int64_t nparams = 0;
  for (int r = 0; r < n; ++r) {
    acc = inf ? std::max(acc, a[2 * r]) : acc + a[2 * r];
    nparams += static_cast<int64_t>(a[2 * r + 1]);
  }
  MuonGradClipStats s;
  s.total_norm = inf ? acc : std::pow(acc, 1.0 / p);
  s.max_norm = max_norm;
  s.norm_type = p;
  s.param_count = nparams;
  s.found_inf = !std::isfinite(s.total_norm);
  TORCH_CHECK(!(s.found_inf && opts.error_if_nonfinite), "rank ", mesh.global_rank(), ": clip_grad_norm_: the total ",
              "norm of order ", p, " of the gradients is ", s.total_norm, ", so clipping cannot scale them. The loss "
              "diverged or a gradient overflowed: lower the learning rate, use loss scaling in half precision, or "
              "pass error_if_nonfinite=false to skip the step yourself when stats.found_inf.");
  if (max_norm && !s.found_inf) {
    s.clip_coef = std::min(1.0, *max_norm / (s.total_norm + 1e-6));
    if (s.clip_coef < 1.0) {
      for (ReadyGrad* r : scope) r->grad.mul_(s.clip_coef);  // every copy, counted or not
      s.clipped = true;
    }
  }
  last_clip_ = s;
  return s;
}

MuonGradClipStats clip_grad_norm_(Muon& optimizer, std::optional<double> max_norm, const GradClipOptions& opts) {
  return optimizer.clip_grad_norm_(max_norm, opts);
}

}  // namespace dmuon
