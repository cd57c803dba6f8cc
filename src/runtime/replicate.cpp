// DDP-style replication of the non-dedicated (AdamW) parameters.
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <string>

#include "runtime/state.h"

namespace dmuon {

void DedicatedState::setup_replicate(double bucket_mb) {
  TORCH_CHECK(!replicated, "rank ", mesh->global_rank(), ": replicate was already called on this model.");
  TORCH_CHECK(bucket_mb > 0, "rank ", mesh->global_rank(), ": replicate: invalid bucket_mb: ", bucket_mb,
              ". Must be > 0 (MiB per coalesced all-reduce).");
  auto m = model.lock();
  auto rep = std::make_unique<ReplicatedParams>();
  for (const auto& [name, p] : get_base_params(*m)) {
    rep->names.push_back(name);
    rep->params.push_back(p);
  }
  // Gradient buckets: consecutive parameters with one reduce dtype, master dtype and device.
  const int64_t cap = static_cast<int64_t>(bucket_mb * 1024 * 1024);
  int64_t cur = 0;
  for (size_t i = 0; i < rep->params.size(); ++i) {
    const at::Tensor& p = rep->params[i];
    const Precision prec = precision_of(p);
    const int64_t bytes = p.numel() * static_cast<int64_t>(c10::elementSize(prec.reduce));
    const bool new_bucket = rep->buckets.empty() || cur + bytes > cap || !(rep->bucket_prec.back() == prec) ||
                            rep->params[rep->buckets.back().front()].device() != p.device();
    if (new_bucket) {
      rep->buckets.emplace_back();
      rep->bucket_prec.push_back(prec);
      cur = 0;
    }
    rep->buckets.back().push_back(static_cast<int>(i));
    cur += bytes;
  }
  // Replicas start identical: rank 0's values (its master copies where there are some), coalesced
  // per dtype and device.
  Communicator& comm = mesh->world();
  {
    at::NoGradGuard ng;
    std::vector<at::Tensor> src;
    for (const auto& p : rep->params) {
      auto it = masters.find(p.unsafeGetTensorImpl());
      src.push_back(it != masters.end() ? it->second : p.detach());
    }
    // keyed by device type, not index: ranks use different devices (cuda:0, cuda:1) in the same order
    std::map<std::pair<at::ScalarType, c10::DeviceType>, std::vector<size_t>> groups;
    for (size_t i = 0; i < src.size(); ++i) groups[{src[i].scalar_type(), src[i].device().type()}].push_back(i);
    for (const auto& [key, idx] : groups) {
      for (size_t lo = 0; lo < idx.size();) {  // chunks of at most bucket_mb
        size_t hi = lo;
        int64_t bytes = 0;
        std::vector<at::Tensor> flat;
        while (hi < idx.size() && (hi == lo || bytes + src[idx[hi]].nbytes() <= static_cast<size_t>(cap))) {
          bytes += static_cast<int64_t>(src[idx[hi]].nbytes());
          flat.push_back(src[idx[hi++]].reshape(-1));
        }
        at::Tensor buf = at::cat(flat);
        comm.broadcast(buf, 0, "replicate: initial values from rank 0").wait();
        int64_t off = 0;
        for (size_t k = lo; k < hi; ++k) {
          at::Tensor& t = src[idx[k]];
          t.copy_(buf.narrow(0, off, t.numel()).view(t.sizes()));
          off += t.numel();
        }
        lo = hi;
      }
    }
    for (size_t i = 0; i < src.size(); ++i)
      if (masters.count(rep->params[i].unsafeGetTensorImpl())) rep->params[i].detach().copy_(src[i]);
  }
  // The end-of-backward callback must run even in models without dedicated boundaries.
  for (size_t i = 0; i < rep->params.size(); ++i)
    rep->grad_accs.push_back(detail::on_grad_accumulated(rep->params[i], rep->names[i], mesh->global_rank(), [this] {
      std::lock_guard<std::recursive_mutex> g(mu);
      ensure_backward_callback();
    }));
  replicated = std::move(rep);
}

void DedicatedState::flush_replicated() {
  if (!replicated) return;
  auto& rep = *replicated;
  if (rep.issued) fold_replicated();  // an earlier backward pass (gradient accumulation)
  Communicator& comm = mesh->world();
  at::NoGradGuard ng;
  rep.payloads.clear();
  rep.pending.clear();
  for (size_t bi = 0; bi < rep.buckets.size(); ++bi) {
    const auto& bucket = rep.buckets[bi];
    int64_t n = 0;
    for (int i : bucket) n += rep.params[i].numel();
    at::Tensor payload = at::zeros({n + static_cast<int64_t>(bucket.size())},
                                   rep.params[bucket.front()].options().requires_grad(false).dtype(
                                       rep.bucket_prec[bi].reduce));
    int64_t off = 0;
    for (size_t k = 0; k < bucket.size(); ++k) {
      auto& p = rep.params[bucket[k]];
      if (p.grad().defined()) {
        payload.narrow(0, off, p.numel()).copy_(p.grad().reshape(-1));
        payload[n + static_cast<int64_t>(k)] = 1;
      }
      p.mutable_grad() = at::Tensor();  // the average comes back in prepare_grads
      off += p.numel();
    }
    rep.pending.push_back(comm.allreduce(payload, Reduction::Sum,
                                         "replicated gradient bucket " + std::to_string(bi) + " (" +
                                             std::to_string(bucket.size()) + " params)"));
    rep.payloads.push_back(payload);
  }
  rep.issued = true;
}

void DedicatedState::fold_replicated() {
  if (!replicated || !replicated->issued) return;
  auto& rep = *replicated;
  at::NoGradGuard ng;
  const double world = mesh->world_size();
  if (rep.sums.empty()) {
    rep.sums.resize(rep.buckets.size());
    rep.flags.resize(rep.buckets.size());
  }
  for (size_t bi = 0; bi < rep.buckets.size(); ++bi) {
    rep.pending[bi].wait();
    const int64_t np = static_cast<int64_t>(rep.buckets[bi].size());
    const at::Tensor& payload = rep.payloads[bi];
    const int64_t n = payload.numel() - np;
    const at::Tensor avg = payload.narrow(0, 0, n).to(rep.bucket_prec[bi].master).div(world);
    const at::Tensor flags = payload.narrow(0, n, np).to(rep.bucket_prec[bi].master);
    if (!rep.sums[bi].defined()) {
      rep.sums[bi] = avg;
      rep.flags[bi] = flags;
    } else {
      rep.sums[bi].add_(avg);
      rep.flags[bi].add_(flags);
    }
  }
  rep.payloads.clear();
  rep.pending.clear();
  rep.issued = false;
}

void DedicatedState::install_replicated(const float*& flag) {
  if (!replicated) return;
  auto& rep = *replicated;
  if (rep.sums.empty()) return;
  for (size_t bi = 0; bi < rep.buckets.size(); ++bi) {
    if (!rep.sums[bi].defined()) continue;
    int64_t off = 0;
    for (size_t k = 0; k < rep.buckets[bi].size(); ++k) {
      auto& p = rep.params[rep.buckets[bi][k]];
      if (*flag++ > 0)
        p.mutable_grad() = rep.sums[bi].narrow(0, off, p.numel()).view(p.sizes());
      else
        p.mutable_grad() = at::Tensor();
      off += p.numel();
    }
  }
  rep.sums.clear();
  rep.flags.clear();
}

void DedicatedState::discard_replicated() {
  if (!replicated) return;
  auto& rep = *replicated;
  for (auto& w : rep.pending) w.wait();
  rep.pending.clear();
  rep.payloads.clear();
  rep.issued = false;
  rep.sums.clear();
  rep.flags.clear();
}

void replicate(const std::shared_ptr<torch::nn::Module>& model, const std::shared_ptr<Mesh>& mesh, double bucket_mb) {
  TORCH_CHECK(model && mesh, "replicate: model and mesh must not be null.");
  auto s = detail::state_of_model(model.get());
  if (!s) {
    // A model with no dedicated parameters: an empty dedicated state carries the hooks.
    dedicate_params(model, mesh, [](const std::string&, const at::Tensor&) { return false; });
    s = detail::state_of_model(model.get());
  }
  TORCH_CHECK(s->mesh.get() == mesh.get(), "rank ", mesh->global_rank(),
              ": replicate: the model was dedicated on another mesh; pass the same mesh to both.");
  s->setup_replicate(bucket_mb);
}

}  // namespace dmuon
