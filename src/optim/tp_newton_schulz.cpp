// Newton-Schulz of TP-split matrices (see tp_newton_schulz.h).
#include "optim/tp_newton_schulz.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>

#include "dmuon/communicator.h"

namespace dmuon {

bool tp_distributed_gram_applies(const std::vector<int64_t>& full, int tp_dim) {
  if (full.size() != 2 || tp_dim < 0) return false;
  const bool transposed = full[0] > full[1];  // NS works on the wide orientation
  return transposed ? tp_dim == 0 : tp_dim == 1;
}

double tp_factor_to_scatter_ratio(const std::vector<int64_t>& full, const NsOptions& opts, int steps) {
  const int n = opts.coefficients ? static_cast<int>(opts.coefficients->size()) : steps;
  const std::vector<int> restarts = opts.restart_iterations.value_or(std::vector<int>{2});
  const int windows = 1 + static_cast<int>(std::count_if(restarts.begin(), restarts.end(),
                                                         [n](int r) { return r > 0 && r < n; }));
  const double m = static_cast<double>(std::min(full[0], full[1]));
  return windows * m * m / (static_cast<double>(full[0]) * static_cast<double>(full[1]));
}

void TpScratch::set_policy(const std::string& policy) {
  const bool gather = policy == "gather" || policy == "all", scatter = policy == "scatter" || policy == "all";
  reuse_[static_cast<int>(Slot::Gathered)] = reuse_[static_cast<int>(Slot::Full)] = gather;
  reuse_[static_cast<int>(Slot::Send)] = reuse_[static_cast<int>(Slot::Receive)] = scatter;
  for (auto it = kept_.begin(); it != kept_.end();) it = reuse_[it->first.second] ? std::next(it) : kept_.erase(it);
}

at::Tensor TpScratch::get(const std::string& name, Slot slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!reuse_[static_cast<int>(slot)]) return at::empty(sizes, options);
  at::Tensor& kept = kept_[{name, static_cast<int>(slot)}];
  if (!kept.defined() || kept.sizes() != sizes || kept.scalar_type() != options.dtype().toScalarType() ||
      kept.device() != options.device())
    kept = at::empty(sizes, options);
  return kept;
}

int64_t TpScratch::kept_bytes() const {
  int64_t n = 0;
  for (const auto& [key, t] : kept_) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

namespace {
std::string tp_what(const ReadyGrad& r) {
  return "TP Newton-Schulz of '" + r.name + "' (TP owner " + std::to_string(r.tp_owner) + ")";
}
}  // namespace

at::Tensor tp_orthogonalize(const at::Tensor& u_local, const ReadyGrad& r, int steps, const NewtonSchulz& ns,
                            bool distributed_gram, Mesh& mesh, TpScratch& scratch) {
  Communicator* tp = mesh.tp();
  TORCH_CHECK(tp, "rank ", mesh.global_rank(), ": Muon: '", r.name, "' has a TP owner but the mesh has no TP axis.");
  const std::string what = tp_what(r);
  const at::Tensor u = u_local.contiguous();
  if (r.tp_dim < 0) {  // whole on every TP rank: one NS, broadcast
    at::Tensor out = tp->rank() == r.tp_owner ? ns.local(u, steps).contiguous()
                                              : scratch.get(r.name, TpScratch::Slot::Receive, u.sizes(), u.options());
    tp->broadcast(out, r.tp_owner, what + ": update").wait();
    return out;
  }
  if (distributed_gram) {
    NsOptions opts = ns.options();
    opts.steps = steps;
    return gram_newton_schulz_distributed_local(u, allreduce_sum_fn(*tp, what + ": Gram all-reduce"),
                                                r.full_shape[0] > r.full_shape[1], opts);
  }
  TpGather g = tp_issue_gather(u, r, mesh, scratch);
  TpScatter s = tp_scatter_update(g, r, steps, ns, mesh, scratch);
  s.pending.wait();
  return s.slice;
}

TpGather tp_issue_gather(const at::Tensor& u_local, const ReadyGrad& r, Mesh& mesh, TpScratch& scratch) {
  Communicator& tp = *mesh.tp();
  TpGather g;
  g.u = u_local.contiguous();
  const int64_t n = g.u.numel();
  g.gathered = tp.rank() == r.tp_owner ? scratch.get(r.name, TpScratch::Slot::Gathered, {n * tp.size()}, g.u.options())
                                       : at::empty({0}, g.u.options());
  g.pending = tp.gather_flat(g.gathered, g.u.view(-1), r.tp_owner, tp_what(r) + ": input gather");
  return g;
}

TpScatter tp_scatter_update(TpGather& g, const ReadyGrad& r, int steps, const NewtonSchulz& ns, Mesh& mesh,
                            TpScratch& scratch) {
  Communicator& tp = *mesh.tp();
  const int T = tp.size();
  const int64_t n = g.u.numel();
  at::Tensor slices = at::empty({0}, g.u.options());
  if (tp.rank() == r.tp_owner) {
    g.pending.wait();
    std::vector<at::Tensor> parts;
    for (int t = 0; t < T; ++t) parts.push_back(g.gathered.narrow(0, t * n, n).view(g.u.sizes()));
    std::vector<int64_t> full_sizes = g.u.sizes().vec();
    full_sizes[static_cast<size_t>(r.tp_dim)] *= T;
    at::Tensor full = scratch.get(r.name, TpScratch::Slot::Full, full_sizes, g.u.options());
    at::cat_out(full, parts, r.tp_dim);
    const at::Tensor update = ns.local(full, steps);
    // the slices of the update, each contiguous, one after the other: what the scatter sends
    slices = scratch.get(r.name, TpScratch::Slot::Send, {n * T}, update.options());
    const auto chunks = update.chunk(T, r.tp_dim);
    for (int t = 0; t < T; ++t) slices.narrow(0, t * n, n).view(g.u.sizes()).copy_(chunks[static_cast<size_t>(t)]);
  }
  TpScatter s;
  s.slice = scratch.get(r.name, TpScratch::Slot::Receive, g.u.sizes(), g.u.options());
  s.pending = tp.scatter_flat(s.slice.view(-1), slices, r.tp_owner, tp_what(r) + ": update scatter");
  // a non-owner's gather completes with the owner's receipt; waited here so nothing is left in flight
  if (tp.rank() != r.tp_owner) g.pending.wait();
  return s;
}

}  // namespace dmuon
