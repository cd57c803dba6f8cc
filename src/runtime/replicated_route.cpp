// The replicated route (see replicated_route.h) and dmuon::replicate.
#include "runtime/replicated_route.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <map>

#include "dmuon/host_sync.h"
#include "dmuon/tensor_parallel.h"
#include "runtime/route_context.h"

namespace dmuon {

ReplicatedRoute::ReplicatedRoute(RouteContext& ctx, std::vector<WholeParam> params, double bucket_mb, bool tp)
    : WholeParamsRoute(ctx, RouteKind::Replicated), ctx_(ctx), tp_(tp) {
  Mesh& mesh = ctx.mesh();
  const std::map<std::string, int>& split = ctx.tp_split();
  for (auto& w : params) {
    auto it = split.find(w.name);
    TORCH_CHECK(tp || it == split.end(), "rank ", mesh.global_rank(), ": replicate: parameter '", w.name, "' (shape ",
                w.param.sizes(), ") is this TP rank's slice (split along dimension ", it == split.end() ? -1 : it->second,
                " over tp_size ", mesh.tp_size(), "); replicate keeps whole parameters only. Call dmuon::replicate_tp, "
                "which averages each TP rank's slice over its data-parallel ranks.");
    tp_dims_.push_back(it == split.end() ? -1 : it->second);
  }
  whole_.set_params(std::move(params));
  std::vector<at::Tensor> params_;  // (setup only)
  for (const auto& w : whole_.params()) params_.push_back(w.param);
  // Gradient buckets: consecutive parameters with one reduce dtype, master dtype and device.
  const int64_t cap = static_cast<int64_t>(bucket_mb * 1024 * 1024);
  int64_t cur = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const Precision prec = ctx.precision_of(p);
    const int64_t bytes = p.numel() * static_cast<int64_t>(c10::elementSize(prec.reduce));
    const bool new_bucket = buckets_.empty() || cur + bytes > cap || !(buckets_.back().prec == prec) ||
                            params_[static_cast<size_t>(buckets_.back().params.front())].device() != p.device();
    if (new_bucket) {
      buckets_.emplace_back();
      buckets_.back().prec = prec;
      cur = 0;
    }
    Bucket& b = buckets_.back();
    b.params.push_back(static_cast<int>(i));
    b.offsets.push_back(b.numel);
    b.numel += p.numel();
    cur += bytes;
  }
  // Replicas start identical: rank 0's values (its master copies where there are some), coalesced
  // per dtype and device.
  Communicator& comm = mesh.dp();  // the world without a TP axis; else this TP rank's R x G ranks
  {
    at::NoGradGuard ng;
    std::vector<at::Tensor> src;
    for (const auto& p : params_) {
      const at::Tensor master = ctx.master_of(p);
      src.push_back(master.defined() ? master : p.detach());
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
      if (ctx.master_of(params_[i]).defined()) params_[i].detach().copy_(src[i]);
  }
  // The end-of-backward callback must run even in models without dedicated boundaries; each backward
  // notes which parameters it gave a gradient here.
  got_grad_.assign(params_.size(), false);
  slot_.resize(params_.size());
  for (size_t bi = 0; bi < buckets_.size(); ++bi)
    for (size_t k = 0; k < buckets_[bi].params.size(); ++k) slot_[static_cast<size_t>(buckets_[bi].params[k])] = {bi, k};
  for (size_t i = 0; i < params_.size(); ++i) {
    const Bucket& b = buckets_[slot_[i].first];
    const bool bases = keeps_bases(b);
    grad_accs_.push_back(ctx.on_grad_accumulated(
        params_[i], whole_.params()[i].name,
        [this, i, bases](GradEvents& ev) {
          got_grad_[i] = true;
          if (bases) {
            auto [bi, k] = slot_[i];
            Bucket& bk = buckets_[bi];
            if (!bk.last.empty() && bk.last[k].defined()) bk.last[k] = param(static_cast<int>(i)).grad();
          }
          ev.backward_ran();
        },
        bases ? GradArrival([this, i](GradEvents&) {
          keep_base(static_cast<int>(i));
          return true;
        })
              : GradArrival()));
  }
}

bool ReplicatedRoute::keeps_bases(const Bucket& b) {
  return c10::elementSize(b.prec.reduce) < c10::elementSize(b.prec.master);
}

bool ReplicatedRoute::still_installed(Bucket& b, size_t k, const at::Tensor& g) {
  if (g.defined() && g.is_same(b.last[k])) return true;  // the installed average, or what autograd made of it
  // the caller's gradient now (or none): nothing of the average to keep out, from now to the step
  b.base[k] = at::Tensor();
  b.last[k] = at::Tensor();
  return false;
}

void ReplicatedRoute::keep_base(int i) {
  auto [bi, k] = slot_[static_cast<size_t>(i)];
  Bucket& b = buckets_[bi];
  if (b.installed.empty()) return;  // no average installed since the step
  const at::Tensor& g = param(i).grad();
  if (still_installed(b, k, g) && !b.base[k].defined()) {
    // the average as this backward finds it (the caller may have scaled it in place: those values are the base)
    at::NoGradGuard ng;
    b.base[k] = g.clone();  // (autograd adds to it in place next)
  }
}

void ReplicatedRoute::take_out_bases(Bucket& b) {
  if (b.installed.empty() || !keeps_bases(b)) return;
  at::NoGradGuard ng;
  for (size_t k = 0; k < b.params.size(); ++k) {
    at::Tensor p = param(b.params[k]);
    const at::Tensor& g = p.grad();
    if (!still_installed(b, k, g)) continue;  // none, or one the caller put there: reduced as it is
    if (b.base[k].defined()) {
      p.mutable_grad() = g.sub(b.base[k]);  // the gradients the backward passes since the install added
    } else {
      b.base[k] = g;  // untouched since the install: adds nothing (a zero, counted as a gradient as before)
      p.mutable_grad() = at::zeros_like(g);
    }
  }
}

void ReplicatedRoute::end_of_backward() {
  Communicator& comm = ctx_.mesh().dp();
  // An earlier backward's zeros for a parameter no rank had a gradient for are dropped first where
  // they are still installed and this backward gave it none, so they are not reduced as a gradient (a
  // host read of the flags: only with several backward passes before a step outside NoSync). One this
  // backward added to in place (autograd accumulates into p.grad) is its gradient now: it stays.
  std::vector<at::Tensor> parts;
  collect_flags(parts);
  if (!parts.empty()) {  // one host read for every bucket
    const at::Tensor host = detail::read_to_host(at::cat(parts));
    const float* flag = host.data_ptr<float>();
    for (auto& b : buckets_)
      if (b.flags.defined()) drop_unused(b, flag, /*this_pass=*/true);
  }
  std::fill(got_grad_.begin(), got_grad_.end(), false);
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    take_out_bases(b);
    std::vector<at::Tensor> ps;
    for (int i : b.params) ps.push_back(param(i));
    if (comm.local_only()) {  // one data-parallel rank: nothing to sum, the gradients are the average
      b.acc.fold_grads(ps, b.offsets, b.numel, b.prec.reduce, b.prec.master, ps.front().options());
      continue;
    }
    const int64_t np = static_cast<int64_t>(ps.size());
    b.payload = pack_grads(ps, b.offsets, b.numel + np, b.numel,
                           ps.front().options().requires_grad(false).dtype(b.prec.reduce));
    predivide(b.payload.narrow(0, 0, b.numel), static_cast<double>(ctx_.mesh().data_parallel_size()));
    b.pending = comm.allreduce(b.payload, Reduction::Sum,
                               "replicated gradient bucket " + std::to_string(bi) + " (" + std::to_string(np) + " params)");
  }
  // Waited here (every bucket issued first): the averages are p.grad when the backward returns. The
  // step waited them before any update anyway; on a device the wait is a stream dependency.
  for (auto& b : buckets_) {
    average(b);
    install(b);
  }
}

void ReplicatedRoute::average(Bucket& b) {
  if (!b.payload.defined()) return;  // folded at once (one rank)
  b.pending.wait();
  b.pending = Pending();
  b.acc.fold(b.payload, b.numel, static_cast<int64_t>(b.params.size()), b.prec.master, ctx_.mesh().data_parallel_size());
  b.payload = at::Tensor();
}

void ReplicatedRoute::install(Bucket& b) {
  if (!b.acc.has_value()) return;
  at::NoGradGuard ng;
  b.flags = b.acc.flags_for_read();
  const at::Tensor sum = b.acc.take_sum();
  b.installed.clear();
  for (size_t k = 0; k < b.params.size(); ++k) {
    at::Tensor p = param(b.params[k]);
    p.mutable_grad() = sum.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
    if (!b.base.empty() && b.base[k].defined()) p.mutable_grad().add_(b.base[k]);  // the earlier average, kept
    b.installed.push_back(p.grad());
  }
  b.base.assign(b.params.size(), at::Tensor());
  b.last = b.installed;
}

void ReplicatedRoute::drop_unused(Bucket& b, const float*& flag, bool this_pass) {
  for (size_t k = 0; k < b.params.size(); ++k) {
    at::Tensor p = param(b.params[k]);
    const bool unused = *flag++ <= 0 && !(this_pass && got_grad_[static_cast<size_t>(b.params[k])]);
    // (what the caller put there since, or a gradient it kept across steps, stays)
    if (unused && p.grad().defined() && p.grad().is_same(b.installed[k])) p.mutable_grad() = at::Tensor();
  }
  b.flags = at::Tensor();
  // (within a backward the installed averages stay: their bases are taken out next; at the step they go)
  if (this_pass) return;
  b.installed.clear();
  b.base.clear();
  b.last.clear();
}

void ReplicatedRoute::collect_flags(std::vector<at::Tensor>& out) {
  for (auto& b : buckets_)
    if (b.flags.defined()) out.push_back(b.flags);
}

void ReplicatedRoute::install_grads(const float*& flag) {
  for (auto& b : buckets_)
    if (b.flags.defined()) drop_unused(b, flag, /*this_pass=*/false);
}

void ReplicatedRoute::ready_grads(std::vector<ReadyGrad>& out) {
  // counted in a global norm once per data-parallel group: on its first rank
  const Mesh& mesh = ctx_.mesh();
  whole_.ready_grads(out, mesh.shard_rank() == 0 && mesh.replicate_rank() == 0);
}

void ReplicatedRoute::plan_step_traffic(std::vector<PlannedTraffic>& out) const {
  for (const Bucket& b : buckets_)  // one all-reduce of [grads, has-grad flags] per bucket
    add_planned(out, "replicated", ctx_.mesh().dp(), CommOp::AllReduce,
                (b.numel + static_cast<int64_t>(b.params.size())) * static_cast<int64_t>(c10::elementSize(b.prec.reduce)));
}

bool ReplicatedRoute::in_flight() {
  bool busy = false;
  for (auto& b : buckets_) busy = busy || !b.pending.poll();
  return busy;
}

void ReplicatedRoute::discard_grads() {
  // (the gradients are in p.grad: the optimizer's zero_grad drops them)
  for (auto& b : buckets_) {
    if (b.payload.defined()) b.pending.wait();  // (a backward that raised in the end-of-backward wait)
    b.pending = Pending();
    b.payload = at::Tensor();
    b.acc.clear();
    b.flags = at::Tensor();
    b.installed.clear();
    b.base.clear();
    b.last.clear();
  }
  std::fill(got_grad_.begin(), got_grad_.end(), false);
}

void ReplicatedRoute::upcast_local_grads() {
  for (const auto& w : whole_.params()) upcast_local_grad(w.param, ctx_.precision_of(w.param));
}

std::vector<std::string> ReplicatedRoute::names() const {
  std::vector<std::string> out;
  for (const auto& w : whole_.params()) out.push_back(w.name);
  return out;
}

}  // namespace dmuon
