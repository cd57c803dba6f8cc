// The sharded_adamw route (see sharded_route.h).
#include "runtime/sharded_route.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <functional>
#include <limits>

#include "runtime/packing.h"
#include "runtime/route_context.h"
#include "runtime/storage.h"


namespace dmuon {

const ShardedEntry* ShardedRoute::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[static_cast<size_t>(it->second)];
}

template <typename DtypeOf>
std::vector<std::vector<int>> ShardedRoute::packs(const std::vector<int>& ids, DtypeOf dtype) const {
  std::vector<std::vector<int>> out;  // one per dtype, uncapped
  detail::for_each_pack(
      std::vector<size_t>(ids.begin(), ids.end()), [&](size_t i) { return dtype(entries_[i]); },
      [](size_t) { return int64_t{0}; }, std::numeric_limits<int64_t>::max(),
      [&](const std::vector<size_t>& p) { out.emplace_back(p.begin(), p.end()); });
  return out;
}

std::string ShardedRoute::pack_name(const std::vector<int>& pack) const {
  const ShardedEntry& first = entries_[static_cast<size_t>(pack.front())];
  if (pack.size() == 1) return "'" + first.name + "'";
  return std::to_string(pack.size()) + " parameters of boundary '" + ctx_.boundary_name(first.boundary) + "' ('" +
         first.name + "', ...)";
}

namespace {
at::ScalarType param_dtype(const ShardedEntry& e) { return e.full.scalar_type(); }
at::ScalarType reduce_dtype(const ShardedEntry& e) { return e.prec.reduce; }
}  // namespace

void ShardedRoute::check(const std::string& name, const at::Tensor& p, const RoutingContext& ctx) {
  TORCH_CHECK_VALUE(!ctx.ddp, "rank ", ctx.rank, ": dedicate_params_ddp: parameter '", name, "' is routed to sharded_adamw, "
              "but dedicate_params_ddp keeps every parameter whole on every rank. Use dedicate_params for sharding, "
              "or route it to \"adamw\".");
  TORCH_CHECK_VALUE(p.numel() > 0 && p.is_contiguous(), "rank ", ctx.rank, ": dedicate_params: sharded_adamw parameter '",
              name, "' must be a non-empty contiguous tensor.");
}

std::unique_ptr<Route> ShardedRoute::make(RouteContext& ctx, std::vector<BoundParam> params) {
  auto route = std::make_unique<ShardedRoute>(ctx);
  for (const BoundParam& p : params) route->add(p);
  route->take_initial_slices();
  return route;
}

// Every rank's slices of rank 0's initial values (deferred parameters were filled by add): one broadcast
// per dtype and pack of at most kCheckpointPackBytes -- one per parameter took ~1 s for 1400 norms and
// biases at dedicate_params.
void ShardedRoute::take_initial_slices() {
  Mesh& mesh = ctx_.mesh();
  at::NoGradGuard ng;
  std::vector<size_t> items;
  for (size_t i = 0; i < entries_.size(); ++i)
    if (!is_deferred(entries_[i].param)) items.push_back(i);
  auto send = [&](const std::vector<size_t>& pack) {
    int64_t total = 0;
    for (size_t i : pack) total += entries_[i].numel;
    const ShardedEntry& first = entries_[pack.front()];
    at::Tensor flat = at::empty({total}, first.param.options().requires_grad(false));
    int64_t off = 0;
    for (size_t i : pack) {
      flat.narrow(0, off, entries_[i].numel).copy_(entries_[i].param.detach().reshape(-1));
      off += entries_[i].numel;
    }
    std::string what = "initial value of sharded parameter '" + first.name + "'";
    if (pack.size() > 1) what += " and " + std::to_string(pack.size() - 1) + " more";
    mesh.dp().broadcast(flat, 0, what + " from rank 0").wait();
    off = 0;
    for (size_t i : pack) {
      ShardedEntry& e = entries_[i];
      const int64_t begin = static_cast<int64_t>(mesh.shard_rank()) * e.shard_len;
      const int64_t len = std::max<int64_t>(0, std::min(e.numel - begin, e.shard_len));
      if (len > 0) e.shard.narrow(0, 0, len).copy_(flat.narrow(0, off + begin, len));
      off += e.numel;
    }
  };
  detail::for_each_pack(
      items, [&](size_t i) { return entries_[i].param.scalar_type(); },
      [&](size_t i) { return entries_[i].numel * static_cast<int64_t>(entries_[i].param.element_size()); },
      detail::kCheckpointPackBytes, send);
}

void ShardedRoute::add(const BoundParam& bp) {
  const std::string& name = bp.name;
  const at::Tensor& param = bp.param;
  const int boundary = bp.boundary;
  const Precision& prec = bp.prec;
  Mesh& mesh = ctx_.mesh();
  at::NoGradGuard ng;
  const int G = mesh.shard_size();
  ShardedEntry e;
  e.name = name;
  e.param = param;
  e.shape = param.sizes().vec();
  e.numel = param.numel();
  e.shard_len = (e.numel + G - 1) / G;
  e.boundary = boundary;
  e.prec = prec;
  const auto o = param.options().requires_grad(false);
  if (is_deferred(param)) {  // this rank reads its slice alone (every rank's source gives the same values)
    e.shard = at::empty({e.shard_len}, o.dtype(prec.master));
    fill_shard(e, *ctx_.deferred_source());
  } else {  // rank 0's value: take_initial_slices
    e.shard = at::zeros({e.shard_len}, o.dtype(prec.master));
  }
  e.full = at::empty({e.shard_len * G}, o.dtype(prec.param));
  e.view = e.full.narrow(0, 0, e.numel).view(param.sizes());
  detail::resize_storage_bytes(e.full, 0);  // gathered only in forward/backward (before it, all would be live at once)
  e.placeholder = at::empty({0}, o.dtype(prec.param));
  if (by_boundary_.size() <= static_cast<size_t>(boundary)) by_boundary_.resize(static_cast<size_t>(boundary) + 1);
  by_boundary_[static_cast<size_t>(boundary)].push_back(static_cast<int>(entries_.size()));
  index_[name] = static_cast<int>(entries_.size());
  entries_.push_back(std::move(e));
}

void ShardedRoute::install() {
  for (size_t i = 0; i < entries_.size(); ++i) {
    auto& e = entries_[i];
    e.grad_acc = ctx_.on_grad_accumulated(
        e.param, e.name,
        [this, i](GradEvents& ev) {
          auto& en = entries_[i];
          ev.accumulated(en.accumulated, en.boundary);
        },
        // after the boundary's reduce-scatter: not in it, and the parameter is released (dropped, warned)
        [this, i](GradEvents& ev) { return !ev.after_reduce(entries_[i].boundary); });
    at::NoGradGuard ng;
    e.param.set_data(e.placeholder);
    detail::resize_storage_bytes(e.full, 0);
  }
}

void ShardedRoute::issue_unshard(int b, const char* phase) {
  if (static_cast<size_t>(b) >= by_boundary_.size()) return;
  Communicator& comm = ctx_.sharded_unshard_group();  // the shard group, or its twin apart from the broadcasts
  std::vector<int> todo;
  for (int i : by_boundary_[static_cast<size_t>(b)]) {  // all-gather the full tensors from the shards
    ShardedEntry& e = entries_[i];
    if (e.state != ShardedEntry::State::Released && e.ready_pass == ctx_.pass()) continue;
    if (e.state == ShardedEntry::State::Pending) e.gather.wait();  // an unused one from an earlier pass
    e.gather_pack.reset();
    if (e.state == ShardedEntry::State::Released) detail::restore_storage(e.full);
    todo.push_back(i);
  }
  // the shard is the master (master dtype): the all-gather carries its param-dtype rounding
  for (const std::vector<int>& pack : packs(todo, param_dtype)) {
    const std::string what = std::string(phase) + " all-gather of " + pack_name(pack);
    if (pack.size() == 1) {  // straight into the parameter's buffer (no copy out)
      ShardedEntry& e = entries_[static_cast<size_t>(pack.front())];
      e.gather_src = e.shard.scalar_type() == e.full.scalar_type() ? e.shard : e.shard.to(e.full.scalar_type());
      e.gather = comm.allgather_flat(e.full, e.gather_src, what);
    } else {  // [shard of each] on every rank -> [G, S]: copied out into each full tensor by wait_unshard
      auto p = std::make_shared<ShardedPack>();
      for (int i : pack) p->width += entries_[static_cast<size_t>(i)].shard_len;
      const ShardedEntry& first = entries_[static_cast<size_t>(pack.front())];
      p->src = at::empty({p->width}, first.full.options());
      int64_t at = 0;
      for (int i : pack) {
        ShardedEntry& e = entries_[static_cast<size_t>(i)];
        p->src.narrow(0, at, e.shard_len).copy_(e.shard);
        e.gather_at = at;
        at += e.shard_len;
      }
      p->buf = at::empty({p->width * comm.size()}, p->src.options());
      const Pending g = comm.allgather_flat(p->buf, p->src, what);
      for (int i : pack) {
        entries_[static_cast<size_t>(i)].gather = g;
        entries_[static_cast<size_t>(i)].gather_pack = p;
      }
    }
    for (int i : pack) {
      entries_[static_cast<size_t>(i)].state = ShardedEntry::State::Pending;
      entries_[static_cast<size_t>(i)].ready_pass = ctx_.pass();
    }
  }
}

void ShardedRoute::check_params(int b, const std::string& during) const {
  if (static_cast<size_t>(b) >= by_boundary_.size()) return;
  for (int i : by_boundary_[static_cast<size_t>(b)]) {
    const ShardedEntry& e = entries_[static_cast<size_t>(i)];
    ctx_.require_given_storage(b, e.name, e.param, {&e.full, &e.placeholder}, during);
  }
}

void ShardedRoute::wait_unshard(int b) {
  if (static_cast<size_t>(b) >= by_boundary_.size()) return;
  at::NoGradGuard ng;
  for (int i : by_boundary_[static_cast<size_t>(b)]) {
    ShardedEntry& e = entries_[i];
    if (e.state != ShardedEntry::State::Pending) continue;
    e.gather.wait();
    if (e.gather_pack) {  // this entry's columns of the packed [G, S]
      const ShardedPack& p = *e.gather_pack;
      const int64_t G = p.buf.numel() / p.width;
      e.full.view({G, e.shard_len}).copy_(p.buf.view({G, p.width}).narrow(1, e.gather_at, e.shard_len));
      e.gather_pack.reset();
    }
    e.gather = Pending();
    e.gather_src = at::Tensor();
    e.param.set_data(e.view);
    e.state = ShardedEntry::State::Ready;
  }
}

void ShardedRoute::release(int b) {
  if (static_cast<size_t>(b) >= by_boundary_.size()) return;
  at::NoGradGuard ng;
  for (int i : by_boundary_[static_cast<size_t>(b)]) {
    ShardedEntry& e = entries_[i];
    if (e.state == ShardedEntry::State::Pending) e.gather.wait();
    e.gather = Pending();
    e.gather_src = at::Tensor();
    e.gather_pack.reset();
    if (e.state == ShardedEntry::State::Released) continue;
    e.param.set_data(e.placeholder);
    detail::resize_storage_bytes(e.full, 0);
    e.state = ShardedEntry::State::Released;
  }
}

void ShardedRoute::issue_reduce(int b) {
  if (static_cast<size_t>(b) >= by_boundary_.size()) return;
  Communicator& comm = ctx_.mesh().shard();
  at::NoGradGuard ng;
  const std::vector<int>& ids = by_boundary_[static_cast<size_t>(b)];
  for (int i : ids)
    if (entries_[static_cast<size_t>(i)].rs_issued) finish(entries_[static_cast<size_t>(i)]);  // an earlier pass
  // one reduce-scatter per reduce dtype: row r of the [G, W] payload is what rank r receives, each entry's
  // [L grads (its chunk r), has-grad flag] back to back
  const int64_t G = comm.size();
  for (const std::vector<int>& pack : packs(ids, reduce_dtype)) {
    auto p = std::make_shared<ShardedPack>();
    for (int i : pack) p->width += entries_[static_cast<size_t>(i)].shard_len + 1;
    const ShardedEntry& first = entries_[static_cast<size_t>(pack.front())];
    p->src = at::zeros({G, p->width}, first.param.options().requires_grad(false).dtype(first.prec.reduce));
    p->buf = at::empty({p->width}, p->src.options());
    p->name = pack_name(pack);
    int64_t at = 0;
    for (int i : pack) {
      ShardedEntry& e = entries_[static_cast<size_t>(i)];
      const int64_t L = e.shard_len;
      const at::Tensor& gr = e.param.grad();
      if (gr.defined()) {
        at::Tensor flat = at::zeros({G * L}, p->src.options());
        flat.narrow(0, 0, e.numel).copy_(gr.reshape(-1));
        const at::Tensor grads = p->src.narrow(1, at, L);
        grads.copy_(flat.view({G, L}));
        p->src.select(1, at + L).fill_(1);
        predivide(grads, static_cast<double>(ctx_.mesh().data_parallel_size()));
      }
      e.param.mutable_grad() = at::Tensor();
      e.rs_out = p->buf.narrow(0, at, L + 1);
      e.rs_pack = p;
      at += L + 1;
    }
    const Pending rs = comm.reduce_scatter_flat(p->buf, p->src.view(-1), Reduction::Sum,
                                                "gradient reduce-scatter of " + p->name);
    for (int i : pack) {
      entries_[static_cast<size_t>(i)].rs = rs;
      entries_[static_cast<size_t>(i)].rs_issued = true;
    }
  }
}

void ShardedRoute::finish(ShardedEntry& e) {
  if (!e.rs_issued) return;
  e.rs.wait();
  e.rs = Pending();
  e.rs_issued = false;
  Mesh& mesh = ctx_.mesh();
  ShardedPack& p = *e.rs_pack;
  p.src = at::Tensor();  // (the payload: every entry of the pack waited the same reduce-scatter)
  if (Communicator* rep = mesh.replicate(); rep && !p.replicated) {  // HSDP: replicated over the replicate axis
    // (once per pack, at the first of its entries to finish: every rank finishes them in the same order)
    rep->allreduce(p.buf, Reduction::Sum, "replicate all-reduce of the gradient shards of " + p.name).wait();
    p.replicated = true;
  }
  e.acc.fold(e.rs_out, e.shard_len, 1, e.shard.scalar_type(), static_cast<double>(mesh.data_parallel_size()));
  e.rs_out = at::Tensor();
  e.rs_pack.reset();
}

void ShardedRoute::reset_pass() {
  for (auto& e : entries_) e.accumulated = false;
}

void ShardedRoute::finish_reduces() {
  for (auto& e : entries_) finish(e);
}

void ShardedRoute::collect_flags(std::vector<at::Tensor>& out) {
  for (auto& e : entries_)
    if (e.acc.has_value()) out.push_back(e.acc.flags_for_read());
}

void ShardedRoute::install_grads(const float*& flag) {
  for (auto& e : entries_) {
    if (!e.acc.has_value()) continue;  // installed by an earlier prepare_grads (or no gradient)
    const bool has = *flag++ > 0;
    const at::Tensor sum = e.acc.take_sum();
    // a gradient installed by an earlier prepare_grads and not yet stepped on keeps accumulating
    if (has) e.grad = e.grad.defined() ? e.grad.add(sum) : sum;
    e.had_grad = e.had_grad || has;
  }
}

void ShardedRoute::ready_grads(std::vector<ReadyGrad>& out) {
  for (auto& e : entries_) {
    if (!e.grad.defined()) continue;
    // every shard rank updates its slice; counted in a norm by the first replicate group, the
    // parameter itself by its shard rank 0
    const Mesh& mesh = ctx_.mesh();
    ReadyGrad r = ctx_.ready_grad(e.name, e.param, e.prec, /*muon=*/false, mesh.replicate_rank() == 0,
                                  mesh.shard_rank() == 0);
    r.target = e.shard;  // the slice is the master
    r.write_back = false;
    r.grad = e.grad;  // (clipping scales it in place: a later backward adds to the clipped one, as in torch)
    r.in_param_grad = false;
    out.push_back(std::move(r));
  }
}

void ShardedRoute::stepped() {
  // the gradient of a sharded_adamw parameter is never in p.grad, so the step drops it (a backward after
  // the step starts it anew); a backward between clipping and the step added to it
  for (auto& e : entries_) e.grad = at::Tensor();
}

void ShardedRoute::plan_step_traffic(std::vector<PlannedTraffic>& out) const {
  Mesh& mesh = ctx_.mesh();
  const int64_t G = mesh.shard_size();
  // per boundary, as issue_unshard / issue_reduce pack them: the forward all-gather (Z3: again in backward)
  // per param dtype, the reduce-scatter of [L grads, flag] per entry per reduce dtype, and on HSDP the
  // all-reduce of this rank's part of it over the replicate group
  for (const std::vector<int>& ids : by_boundary_) {
    for (const std::vector<int>& pack : packs(ids, param_dtype)) {
      int64_t S = 0;
      for (int i : pack) S += entries_[static_cast<size_t>(i)].shard_len;
      const auto bytes = static_cast<int64_t>(c10::elementSize(param_dtype(entries_[static_cast<size_t>(pack[0])])));
      add_planned(out, "sharded_adamw", ctx_.sharded_unshard_group(), CommOp::AllGather, G * S * bytes,
                  ctx_.z3() ? 2 : 1);
    }
    for (const std::vector<int>& pack : packs(ids, reduce_dtype)) {
      int64_t W = 0;
      for (int i : pack) W += entries_[static_cast<size_t>(i)].shard_len + 1;
      const auto bytes = static_cast<int64_t>(c10::elementSize(reduce_dtype(entries_[static_cast<size_t>(pack[0])])));
      add_planned(out, "sharded_adamw", mesh.shard(), CommOp::ReduceScatter, G * W * bytes);
      if (Communicator* rep = mesh.replicate()) add_planned(out, "sharded_adamw", *rep, CommOp::AllReduce, W * bytes);
    }
  }
}

bool ShardedRoute::in_flight() {
  bool busy = false;
  for (auto& e : entries_) busy = busy || !e.gather.poll() || !e.rs.poll();
  return busy;
}

void ShardedRoute::discard_grads() {
  for (auto& e : entries_) {
    if (e.rs_issued) e.rs.wait();
    e.rs = Pending();
    e.rs_issued = false;
    e.rs_out = at::Tensor();
    e.rs_pack.reset();
    e.acc.clear();
    e.grad = at::Tensor();
  }
}

void ShardedRoute::after_zero_grad(bool set_to_none) {
  for (auto& e : entries_) {
    if (set_to_none)
      e.had_grad = false;
    else if (e.had_grad)
      e.grad = at::zeros_like(e.shard);
  }
}

void ShardedRoute::upcast_local_grads() {
  for (auto& e : entries_) upcast_local_grad(e.param, e.prec);
}

// Full tensors from their slices for a checkpoint: one all-gather per dtype and pack of at most
// kCheckpointPackBytes (one per tensor made a model's hundreds of norms and biases cost as many blocking
// collectives). Item i is entries_[entry] with this rank's slice `slices[i]`; `got(i, full)` receives it
// viewed as the parameter (a copy of the pack: kept as long as the caller keeps it).
void ShardedRoute::gather_packed(const std::vector<std::pair<size_t, at::Tensor>>& items, const std::string& what,
                                 const std::function<void(size_t, const at::Tensor&)>& got) const {
  Communicator& comm = ctx_.mesh().shard();
  const int64_t G = comm.size();
  std::vector<size_t> all(items.size());
  for (size_t i = 0; i < items.size(); ++i) all[i] = i;
  auto len = [&](size_t i) { return entries_[items[i].first].shard_len; };
  auto gather_pack = [&](const std::vector<size_t>& pack) {
    int64_t width = 0;
    for (size_t i : pack) width += len(i);
    const at::TensorOptions o = items[pack.front()].second.options();
    at::Tensor src = pack.size() == 1 ? items[pack.front()].second.contiguous() : at::empty({width}, o);
    if (pack.size() > 1) {
      int64_t off = 0;
      for (size_t i : pack) {
        src.narrow(0, off, len(i)).copy_(items[i].second);
        off += len(i);
      }
    }
    const ShardedEntry& first = entries_[items[pack.front()].first];
    std::string text = what + "'" + first.name + "'";
    if (pack.size() > 1) text += " and " + std::to_string(pack.size() - 1) + " more";
    at::Tensor out = at::empty({G * width}, o);
    comm.allgather_flat(out, src, text).wait();
    const at::Tensor rows = out.view({G, width});
    int64_t off = 0;
    for (size_t i : pack) {
      const ShardedEntry& e = entries_[items[i].first];
      at::Tensor full = pack.size() == 1 ? out : rows.narrow(1, off, len(i)).reshape(-1);
      got(i, full.narrow(0, 0, e.numel).view(e.shape));
      off += len(i);
    }
  };
  detail::for_each_pack(
      all, [&](size_t i) { return items[i].second.scalar_type(); },
      [&](size_t i) { return G * len(i) * static_cast<int64_t>(items[i].second.element_size()); },
      detail::kCheckpointPackBytes, gather_pack);
}

at::Tensor ShardedRoute::slice_of(const ShardedEntry& e, const at::Tensor& full, const at::TensorOptions& o) const {
  const Mesh& mesh = ctx_.mesh();
  at::Tensor padded = at::zeros({e.shard_len * mesh.shard_size()}, o);
  padded.narrow(0, 0, full.numel()).copy_(full.reshape(-1));
  return padded.narrow(0, static_cast<int64_t>(mesh.shard_rank()) * e.shard_len, e.shard_len).clone();
}

void ShardedRoute::gather_full(const TensorSink& put) {
  std::vector<std::pair<size_t, at::Tensor>> items;
  for (size_t i = 0; i < entries_.size(); ++i) items.emplace_back(i, entries_[i].shard);
  gather_packed(items, kCheckpointWhat + "slices of ",
                [&](size_t i, const at::Tensor& full) { put(entries_[items[i].first].name, full); });
}

void ShardedRoute::fill_shard(ShardedEntry& e, ParamSource& source) const {
  const int64_t begin = static_cast<int64_t>(ctx_.mesh().shard_rank()) * e.shard_len;
  const int64_t len = std::max<int64_t>(0, std::min(e.numel - begin, e.shard_len));
  if (len == 0) {
    ctx_.after_fills([&e] { e.shard.zero_(); });
    return;
  }
  const auto [rows, skip] = detail::rows_covering(ctx_.region_of(e.name, e.shape), begin, len);
  at::Tensor part = at::empty(rows.size, e.shard.options());
  ctx_.fill_from(source, e.name, rows, part);
  ctx_.after_fills([&e, part, skip = skip, len] {
    e.shard.zero_();
    e.shard.narrow(0, 0, len).copy_(part.reshape(-1).narrow(0, skip, len));
  });
}

void ShardedRoute::assign_from(ParamSource& source) {
  for (auto& e : entries_) {
    fill_shard(e, source);
    ctx_.after_fills([&e] {
      e.ready_pass = -1;  // the gathered copy is refreshed by the next forward
      e.acc.clear();      // gradients from before the load are dropped
      e.grad = at::Tensor();
      e.had_grad = false;
    });
  }
}

void ShardedRoute::full_shapes(std::map<std::string, std::vector<int64_t>>& out) const {
  for (const auto& e : entries_) out[e.name] = e.shape;
}

bool ShardedRoute::describe(const std::string& name, ParamView& v) const {
  const ShardedEntry* e = find(name);
  if (!e) return false;
  const Mesh& mesh = ctx_.mesh();
  v.route = RouteKind::Sharded;
  v.shape = e->shape;
  v.boundary = ctx_.boundary_name(e->boundary);
  v.shard_numel = e->shard_len;
  v.shard_offset = e->shard_len * mesh.shard_rank();
  v.padded_numel = e->shard_len * mesh.shard_size();
  return true;
}

void ShardedRoute::state_slots(std::vector<StateSlot>& out) const {
  for (const auto& e : entries_) out.push_back({e.name, e.shape, false, e.param.requires_grad(), e.prec.optim, e.param.device()});
}

void ShardedRoute::gather_state(const OptimizerStateReader& opt, const StateSink& put) {
  std::vector<ParamState> states(entries_.size());
  std::vector<std::pair<size_t, at::Tensor>> items;
  std::vector<size_t> field_of;
  for (size_t i = 0; i < entries_.size(); ++i) {
    states[i] = opt.get(entries_[i].param);  // defined on every rank or none: all step together
    if (!states[i].defined()) continue;
    if (states[i].tensors.empty()) put(entries_[i].name, false, states[i]);
    for (size_t k = 0; k < states[i].tensors.size(); ++k) {
      items.emplace_back(i, states[i].tensors[k]);
      field_of.push_back(k);
    }
  }
  std::vector<size_t> arrived(entries_.size(), 0);  // (packs are per dtype: an entry's fields may come apart)
  gather_packed(items, kCheckpointWhat + "optimizer state slices of ", [&](size_t it, const at::Tensor& full) {
    const size_t i = items[it].first, k = field_of[it];
    states[i].tensors[k] = full;
    if (++arrived[i] < states[i].tensors.size()) return;
    put(entries_[i].name, false, states[i]);
    states[i] = ParamState{};
  });
}

void ShardedRoute::assign_state(OptimizerStateAccess& opt, const StateSource& get) {
  for (const auto& e : entries_) {
    std::optional<ParamState> s = get(e.name, false);
    if (!s) {
      opt.set(e.param, ParamState{});
      continue;
    }
    const auto o = e.shard.options().dtype(ctx_.precision_of(e.param).optim);
    for (at::Tensor& t : s->tensors) t = slice_of(e, t, o);  // this rank's slices
    opt.set(e.param, std::move(*s));
  }
}

}  // namespace dmuon
