// Hook boundaries: forward/backward broadcasts, Z2/Z3 lifetimes, ordered gradient reduces.
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <sstream>

#include "dmuon/env.h"
#include "runtime/state.h"

namespace dmuon {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

DedicatedState* state_from(AutogradContext* ctx) {
  return reinterpret_cast<DedicatedState*>(ctx->saved_data["s"].toInt());
}

// Identity on a boundary's output: its backward runs before the boundary's own backward.
struct PreBackwardFn : torch::autograd::Function<PreBackwardFn> {
  static variable_list forward(AutogradContext* ctx, at::Tensor x, int64_t state, int64_t b) {
    ctx->saved_data["s"] = state;
    ctx->saved_data["b"] = b;
    return {x.view_as(x)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    state_from(ctx)->pre_backward(static_cast<int>(ctx->saved_data["b"].toInt()));
    return {g[0], at::Tensor(), at::Tensor()};
  }
};

// Identity on a boundary's input: its backward runs after the boundary's own backward.
struct PostBackwardFn : torch::autograd::Function<PostBackwardFn> {
  static variable_list forward(AutogradContext* ctx, at::Tensor x, int64_t state, int64_t b) {
    ctx->saved_data["s"] = state;
    ctx->saved_data["b"] = b;
    return {x.view_as(x)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    state_from(ctx)->post_backward(static_cast<int>(ctx->saved_data["b"].toInt()));
    return {g[0], at::Tensor(), at::Tensor()};
  }
};

std::string boundary_what(const char* phase, const Boundary& B, const PackedBuffer& buf) {
  std::ostringstream o;
  o << phase << " of '" << B.name << "' from rank " << buf.root_global << " (" << buf.params.size() << " params, "
    << buf.bytes() << " bytes)";
  return o.str();
}

}  // namespace

// ---- broadcasts ------------------------------------------------------------------------------------
void DedicatedState::issue_broadcasts(int b, const char* phase) {
  Boundary& B = boundaries[b];
  Communicator& comm = mesh->shard();
  for (auto& buf : B.buffers) {
    if (buf.state != PackedBuffer::State::Released && buf.ready_pass == pass) continue;  // already published
    if (buf.state == PackedBuffer::State::Pending) buf.bcast.wait();  // an unused one from an earlier pass
    if (buf.is_root) wait_publish(buf);  // HSDP: the holder's copy must be the new value first
    if (!buf.is_root && buf.state == PackedBuffer::State::Released)
      detail::resize_storage_bytes(buf.flat, static_cast<size_t>(buf.flat.numel() * buf.flat.element_size()));
    if (buf.gather_mode) {  // rebuild the full matrix from every rank's shard
      buf.scatter.wait();  // the shards of the last update must have arrived
      buf.scatter = Pending();
      buf.bcast = comm.allgather_flat(buf.flat, buf.shard, boundary_what(phase, B, buf) + " [all-gather mode]");
      buf.state = PackedBuffer::State::Pending;
      buf.ready_pass = pass;
      continue;
    }
    at::Tensor payload = buf.flat;
    if (opts.compute_dtype &&
        static_cast<int64_t>(c10::elementSize(*opts.compute_dtype)) < buf.flat.element_size()) {  // narrows only
      buf.bcast_payload = buf.is_root ? buf.flat.to(*opts.compute_dtype)
                                      : at::empty({buf.numel}, buf.flat.options().dtype(*opts.compute_dtype));
      payload = buf.bcast_payload;
    }
    buf.bcast = comm.broadcast(payload, buf.root, boundary_what(phase, B, buf));
    buf.state = PackedBuffer::State::Pending;
    buf.ready_pass = pass;
  }
  for (int i : B.sharded) {  // sharded_adamw: all-gather the full tensor from the shards
    ShardedEntry& e = sharded[i];
    if (e.state != PackedBuffer::State::Released && e.ready_pass == pass) continue;
    if (e.state == PackedBuffer::State::Pending) e.gather.wait();  // an unused one from an earlier pass
    if (e.state == PackedBuffer::State::Released)
      detail::resize_storage_bytes(e.full, static_cast<size_t>(e.full.numel() * e.full.element_size()));
    // the shard is the master (master dtype): the all-gather carries its param-dtype rounding
    e.gather_src = e.shard.scalar_type() == e.full.scalar_type() ? e.shard : e.shard.to(e.full.scalar_type());
    e.gather = comm.allgather_flat(e.full, e.gather_src, std::string(phase) + " all-gather of '" + e.name + "'");
    e.state = PackedBuffer::State::Pending;
    e.ready_pass = pass;
  }
}

void DedicatedState::wait_broadcasts(int b) {
  Boundary& B = boundaries[b];
  at::NoGradGuard ng;
  for (auto& buf : B.buffers) {
    if (buf.state != PackedBuffer::State::Pending) continue;
    buf.bcast.wait();
    buf.bcast = Pending();
    if (buf.bcast_payload.defined()) {
      if (!buf.is_root) buf.flat.copy_(buf.bcast_payload);
      buf.bcast_payload = at::Tensor();
    }
    if (!buf.is_root)
      for (size_t k = 0; k < buf.params.size(); ++k) params[buf.params[k]].param.set_data(buf.views[k]);
    buf.state = PackedBuffer::State::Ready;
  }
  for (int i : B.sharded) {
    ShardedEntry& e = sharded[i];
    if (e.state != PackedBuffer::State::Pending) continue;
    e.gather.wait();
    e.gather = Pending();
    e.gather_src = at::Tensor();
    e.param.set_data(e.view);
    e.state = PackedBuffer::State::Ready;
  }
}

void DedicatedState::release(int b) {
  Boundary& B = boundaries[b];
  at::NoGradGuard ng;
  for (auto& buf : B.buffers) {
    if (buf.state == PackedBuffer::State::Pending) buf.bcast.wait();  // never free a buffer in flight
    buf.bcast = Pending();
    buf.bcast_payload = at::Tensor();
    if (ddp) {
      buf.state = PackedBuffer::State::Ready;  // the DDP path keeps full parameters everywhere
      continue;
    }
    if (buf.is_root) {
      buf.state = PackedBuffer::State::Released;  // logical: the root's data stay
      continue;
    }
    if (buf.state == PackedBuffer::State::Released) continue;
    // CUDA: the broadcast into `flat` was waited above (NCCL's wait makes the current stream wait
    // for the NCCL stream, and NCCL recorded its stream on the tensor), and every kernel that read
    // `flat` was issued on the current stream, so the caching allocator hands the freed block out
    // again only to work ordered after all of them.
    for (int p : buf.params) params[p].param.set_data(params[p].placeholder);
    detail::resize_storage_bytes(buf.flat, 0);
    buf.state = PackedBuffer::State::Released;
  }
  for (int i : B.sharded) {
    ShardedEntry& e = sharded[i];
    if (e.state == PackedBuffer::State::Pending) e.gather.wait();
    e.gather = Pending();
    e.gather_src = at::Tensor();
    if (e.state == PackedBuffer::State::Released) continue;
    e.param.set_data(e.placeholder);
    detail::resize_storage_bytes(e.full, 0);
    e.state = PackedBuffer::State::Released;
  }
}

void DedicatedState::prefetch_after(int b, bool backward) {
  const int depth = backward ? 1 : opts.forward_prefetch_depth;
  if (depth <= 0) return;
  std::vector<int> order;
  if (backward) {
    order.assign(current_order.rbegin(), current_order.rend());
  } else if (!recorded_order.empty()) {
    order = recorded_order;
  } else {
    for (const auto& B : boundaries) order.push_back(B.index);  // first pass: model order
  }
  auto it = std::find(order.begin(), order.end(), b);
  if (it == order.end()) return;
  for (int k = 1; k <= depth && it + k < order.end(); ++k) {
    const int nb = *(it + k);
    if (!backward && boundaries[nb].ran_forward) continue;
    issue_broadcasts(nb, backward ? "backward prefetch broadcast" : "forward prefetch broadcast");
  }
}

// ---- forward ---------------------------------------------------------------------------------------
void DedicatedState::begin_forward_pass() {
  if (!current_order.empty()) recorded_order = current_order;
  current_order.clear();
  ++pass;
  for (auto& B : boundaries) B.ran_forward = false;
  backward_since_forward = false;
}

void DedicatedState::begin_root_forward() {
  std::lock_guard<std::recursive_mutex> g(mu);
  begin_forward_pass();
}

void DedicatedState::pre_forward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu);
  Boundary& B = boundaries[b];
  if (backward_since_forward || B.ran_forward) begin_forward_pass();
  B.ran_forward = true;
  B.ran_since_backward = true;
  B.in_forward = true;
  boundaries_seen = true;
  current_order.push_back(b);
  if (ddp) {
    wait_broadcasts(b);  // this boundary's post-step publish, if still in flight
    return;
  }
  issue_broadcasts(b, "forward broadcast");
  prefetch_after(b, /*backward=*/false);
  wait_broadcasts(b);
}

void DedicatedState::post_forward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu);
  boundaries[b].in_forward = false;
  if (z3()) release(b);  // Z3: free after forward, re-broadcast in backward; Z2: keep until after backward
}

// ---- backward --------------------------------------------------------------------------------------
void DedicatedState::ensure_backward_callback() {
  if (callback_queued) return;
  callback_queued = true;
  if (!reduce_order_fixed) {
    // reverse forward order; then every other boundary entered since the last backward (a block
    // run twice, or forward passes before this backward), in model order — the same on every rank
    reduce_order.clear();
    for (auto it = current_order.rbegin(); it != current_order.rend(); ++it)
      if (std::find(reduce_order.begin(), reduce_order.end(), *it) == reduce_order.end()) reduce_order.push_back(*it);
    for (const auto& B : boundaries)
      if (B.ran_since_backward && std::find(reduce_order.begin(), reduce_order.end(), B.index) == reduce_order.end())
        reduce_order.push_back(B.index);
    next_reduce = 0;
    reduce_order_fixed = true;
  }
  torch::autograd::Engine::get_default_engine().queue_callback([this] { end_of_backward(); });
}

void DedicatedState::pre_backward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu);
  ensure_backward_callback();
  if (ddp) return;
  if (z3()) {
    issue_broadcasts(b, "backward broadcast");
    prefetch_after(b, /*backward=*/true);
  }
  wait_broadcasts(b);
}

void DedicatedState::note_post_hook(int b) {
  std::lock_guard<std::recursive_mutex> g(mu);
  ++boundaries[b].post_expected;
}

void DedicatedState::post_backward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu);
  ensure_backward_callback();
  Boundary& B = boundaries[b];
  // A block used several times in one graph is done only after the backward of every use.
  if (++B.post_fired >= B.post_expected) B.grads_ready = true;
  try_issue_reduces();
}

void DedicatedState::on_param_accumulated(int p) {
  std::lock_guard<std::recursive_mutex> g(mu);
  note_accumulated(params[p].accumulated, params[p].boundary);
}

void DedicatedState::on_sharded_accumulated(int i) {
  std::lock_guard<std::recursive_mutex> g(mu);
  note_accumulated(sharded[i].accumulated, sharded[i].boundary);
}

void DedicatedState::note_accumulated(bool& accumulated, int b) {
  ensure_backward_callback();
  if (accumulated) return;
  accumulated = true;
  Boundary& B = boundaries[b];
  if (++B.accumulated == static_cast<int>(B.params.size() + B.sharded.size())) B.grads_ready = true;
  try_issue_reduces();
}

ShardedEntry* DedicatedState::sharded_of(const at::Tensor& p) {
  for (auto& e : sharded)
    if (e.param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return &e;
  return nullptr;
}

void DedicatedState::finish_sharded(ShardedEntry& e) {
  if (!e.rs_issued) return;
  e.rs.wait();
  e.rs = Pending();
  e.rs_issued = false;
  if (Communicator* rep = mesh->replicate())  // HSDP: replicated over the replicate axis
    rep->allreduce(e.rs_out, Reduction::Sum, "replicate all-reduce of the shard of '" + e.name + "'").wait();
  at::NoGradGuard ng;
  const at::Tensor avg =
      e.rs_out.narrow(0, 0, e.shard_len).to(e.shard.scalar_type()).div(static_cast<double>(mesh->world_size()));
  const at::Tensor flag = e.rs_out.narrow(0, e.shard_len, 1).to(e.shard.scalar_type());
  if (!e.grad_sum.defined()) {
    e.grad_sum = avg;
    e.grad_flag = flag;
  } else {
    e.grad_sum.add_(avg);
    e.grad_flag.add_(flag);
  }
  e.rs_in = at::Tensor();
  e.rs_out = at::Tensor();
}

void DedicatedState::try_issue_reduces() {
  // Reduces go out in the reverse forward order on every rank; a boundary that is ready early waits
  // for the ones before it, so all ranks issue the same collectives in the same order.
  if (no_sync) return;  // gradient accumulation: reduce once, after the last micro-batch
  while (next_reduce < reduce_order.size() && boundaries[reduce_order[next_reduce]].grads_ready) {
    issue_reduce(reduce_order[next_reduce]);
    ++next_reduce;
  }
}

void DedicatedState::issue_reduce(int b) {
  Boundary& B = boundaries[b];
  if (B.reduced) return;
  B.reduced = true;
  Communicator& comm = mesh->shard();
  at::NoGradGuard ng;
  for (auto& buf : B.buffers) {
    if (buf.reduce_issued || buf.stage2_issued) finish_reduce(buf);  // an earlier pass (accumulation)
    // payload = [grads of the buffer's params..., one has-grad flag per param], summed on the root
    const auto dtype = buf.prec.reduce;
    const int64_t np = static_cast<int64_t>(buf.params.size());
    buf.grad_payload = at::zeros({buf.numel + np}, buf.flat.options().dtype(dtype));
    for (int64_t k = 0; k < np; ++k) {
      auto& e = params[buf.params[k]];
      const at::Tensor& gr = e.param.grad();
      if (gr.defined()) {
        buf.grad_payload.narrow(0, buf.offsets[k], e.param.numel()).copy_(gr.reshape(-1));
        buf.grad_payload[buf.numel + k] = 1;
      }
      // Every rank hands its local gradient to the reduce; the owner gets the average back in
      // prepare_grads, non-owners keep nothing.
      e.param.mutable_grad() = at::Tensor();
    }
    buf.reduce = comm.reduce(buf.grad_payload, buf.root, Reduction::Sum, boundary_what("gradient reduce", B, buf));
    buf.reduce_issued = true;
  }
  for (int i : B.sharded) {  // sharded_adamw: reduce-scatter G chunks of [L grads, has-grad flag]
    ShardedEntry& e = sharded[i];
    if (e.rs_issued) finish_sharded(e);  // an earlier backward pass (gradient accumulation)
    const int64_t G = comm.size(), L = e.shard_len;
    e.rs_in = at::zeros({G, L + 1}, e.param.options().requires_grad(false).dtype(e.prec.reduce));
    const at::Tensor& gr = e.param.grad();
    if (gr.defined()) {
      at::Tensor flat = at::zeros({G * L}, e.rs_in.options());
      flat.narrow(0, 0, e.numel).copy_(gr.reshape(-1));
      e.rs_in.narrow(1, 0, L).copy_(flat.view({G, L}));
      e.rs_in.select(1, L).fill_(1);
    }
    e.param.mutable_grad() = at::Tensor();
    e.rs_out = at::empty({L + 1}, e.rs_in.options());
    e.rs = comm.reduce_scatter_flat(e.rs_out, e.rs_in.view(-1), Reduction::Sum,
                                    "gradient reduce-scatter of '" + e.name + "'");
    e.rs_issued = true;
  }
  release(b);  // the parameters are not needed again before the next forward
}

void DedicatedState::finish_stage1(PackedBuffer& buf) {
  if (!buf.reduce_issued) return;
  buf.reduce.wait();
  buf.reduce = Pending();
  buf.reduce_issued = false;
  Communicator* rep = mesh->replicate();
  if (!buf.is_root) {
    buf.grad_payload = at::Tensor();
    return;
  }
  if (!rep) {
    fold_into_sum(buf, mesh->shard_size());
    return;
  }
  // stage 2: the holders of this unit (one per replicate group) reduce to the global owner
  std::ostringstream what;
  what << "stage-2 gradient reduce of a unit owned by (" << buf.owner.shard << ", " << buf.owner.replicate << ")";
  buf.stage2 = rep->reduce(buf.grad_payload, buf.owner.replicate, Reduction::Sum, what.str());
  buf.stage2_issued = true;
}

void DedicatedState::finish_stage2(PackedBuffer& buf) {
  if (!buf.stage2_issued) return;
  buf.stage2.wait();
  buf.stage2 = Pending();
  buf.stage2_issued = false;
  if (buf.is_owner) fold_into_sum(buf, static_cast<double>(mesh->world_size()));
  buf.grad_payload = at::Tensor();
}

void DedicatedState::finish_reduce(PackedBuffer& buf) {
  finish_stage1(buf);
  finish_stage2(buf);
}

void DedicatedState::fold_into_sum(PackedBuffer& buf, double divisor) {
  at::NoGradGuard ng;
  // averaged and accumulated in the master dtype (the optimizer's input)
  const at::Tensor avg = buf.grad_payload.narrow(0, 0, buf.numel).to(buf.prec.master).div(divisor);
  const at::Tensor flags =
      buf.grad_payload.narrow(0, buf.numel, static_cast<int64_t>(buf.params.size())).to(buf.prec.master);
  if (!buf.reduced_sum.defined()) {
    buf.reduced_sum = avg;
    buf.reduced_flags = flags;
  } else {
    buf.reduced_sum.add_(avg);
    buf.reduced_flags.add_(flags);
  }
  buf.grad_payload = at::Tensor();
}

void DedicatedState::wait_publish(PackedBuffer& buf) {
  for (auto& p : buf.publish) p.wait();
  buf.publish.clear();
}

void DedicatedState::end_of_backward() {
  std::lock_guard<std::recursive_mutex> g(mu);
  // Fire every boundary whose backward hooks did not run (no input needed grad, unused outputs...).
  if (!no_sync)
    for (; next_reduce < reduce_order.size(); ++next_reduce) issue_reduce(reduce_order[next_reduce]);
  for (auto& B : boundaries) {
    release(B.index);
    if (!no_sync) B.ran_since_backward = false;
    B.post_expected = 0;
    B.post_fired = 0;
    B.grads_ready = false;
    B.accumulated = 0;
    B.reduced = false;
  }
  for (auto& e : params) e.accumulated = false;
  for (auto& e : sharded) e.accumulated = false;
  if (!no_sync && mesh->replicate() && !opts.delay_stage2_to_optimizer)
    for (auto& B : boundaries)
      for (auto& buf : B.buffers) finish_stage1(buf);  // waits stage 1, issues stage 2 now
  if (!no_sync) flush_replicated();
  if (no_sync) upcast_local_grads();
  callback_queued = false;
  reduce_order_fixed = false;
  reduce_order.clear();
  next_reduce = 0;
  backward_since_forward = true;
}

void DedicatedState::upcast_local_grads() {
  // Inside NoSync gradients stay local for several backward passes; autograd accumulates into
  // p.grad() in place, so a master-dtype gradient makes the accumulation master-precision.
  at::NoGradGuard ng;
  auto up = [&](const at::Tensor& p) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) return;
    auto it = precision.find(p.unsafeGetTensorImpl());
    if (it == precision.end() || !it->second.has_master() || g.scalar_type() == it->second.master) return;
    p.mutable_grad() = g.to(it->second.master);
  };
  for (auto& e : params) up(e.param);
  for (auto& e : sharded) up(e.param);
  if (replicated)
    for (auto& p : replicated->params) up(p);
}

// ---- optimizer interface -------------------------------------------------------------------------
void DedicatedState::prepare_grads() {
  std::lock_guard<std::recursive_mutex> g(mu);
  at::NoGradGuard ng;
  // stage 1 everywhere first (HSDP holders issue stage 2 as they go), then stage 2
  for (auto& B : boundaries)
    for (auto& buf : B.buffers) finish_stage1(buf);
  for (auto& B : boundaries)
    for (auto& buf : B.buffers) finish_stage2(buf);
  for (auto& e : sharded) finish_sharded(e);
  fold_replicated();
  // Which parameters got a gradient on some rank: every has-gradient flag of this rank's sums in
  // one device-to-host read per step (not one per parameter), in a fixed order.
  std::vector<at::Tensor> parts;
  for (auto& B : boundaries)
    for (auto& buf : B.buffers)
      if (buf.is_owner && buf.reduced_sum.defined()) parts.push_back(buf.reduced_flags.to(at::kFloat));
  for (auto& e : sharded)
    if (e.grad_flag.defined()) parts.push_back(e.grad_flag.to(at::kFloat));  // not yet read
  if (replicated)
    for (auto& f : replicated->flags)
      if (f.defined()) parts.push_back(f.to(at::kFloat));
  if (parts.empty()) return;
  const at::Tensor host = detail::read_to_host(at::cat(parts));
  const float* flag = host.data_ptr<float>();
  for (auto& B : boundaries)
    for (auto& buf : B.buffers) {
      if (!buf.is_owner || !buf.reduced_sum.defined()) continue;
      for (size_t k = 0; k < buf.params.size(); ++k) {
        auto& e = params[buf.params[k]];
        if (*flag++ > 0)
          e.param.mutable_grad() = buf.reduced_sum.narrow(0, buf.offsets[k], e.param.numel()).view(e.param.sizes());
        else
          e.param.mutable_grad() = at::Tensor();  // no rank produced a gradient
      }
      buf.reduced_sum = at::Tensor();
      buf.reduced_flags = at::Tensor();
    }
  for (auto& e : sharded) {
    if (!e.grad_flag.defined()) continue;  // read by an earlier prepare_grads (or no gradient)
    e.has_grad = *flag++ > 0;
    e.grad_flag = at::Tensor();
  }
  install_replicated(flag);
}

void DedicatedState::discard_grads() {
  std::lock_guard<std::recursive_mutex> g(mu);
  for (auto& B : boundaries)
    for (auto& buf : B.buffers) {
      for (auto [issued, pending] : {std::pair{&buf.reduce_issued, &buf.reduce}, {&buf.stage2_issued, &buf.stage2}})
        if (*issued) {
          pending->wait();
          *pending = Pending();
          *issued = false;
        }
      buf.grad_payload = at::Tensor();
      buf.reduced_sum = at::Tensor();
      buf.reduced_flags = at::Tensor();
    }
  for (auto& e : sharded) {
    if (e.rs_issued) e.rs.wait();
    e.rs = Pending();
    e.rs_issued = false;
    e.rs_in = e.rs_out = at::Tensor();
    e.grad_sum = at::Tensor();
    e.grad_flag = at::Tensor();
    e.has_grad = false;
  }
  discard_replicated();
}

void DedicatedState::drain_all() {
  std::lock_guard<std::recursive_mutex> g(mu);
  for (auto& B : boundaries)
    for (auto& buf : B.buffers)
      if (buf.state == PackedBuffer::State::Pending) wait_broadcasts(B.index);
  prepare_grads();
}


void broadcast_all_updates(torch::nn::Module& model) { detail::require_state(model, "broadcast_all_updates")->publish(false); }
void broadcast_all_updates_async(torch::nn::Module& model) {
  detail::require_state(model, "broadcast_all_updates_async")->publish(true);
}
void wait_all_post_step_broadcasts(torch::nn::Module& model) {
  detail::require_state(model, "wait_all_post_step_broadcasts")->wait_publishes();
}

NoSync::NoSync(torch::nn::Module& model) : state_(detail::state_of_model(&model)) {
  TORCH_CHECK(state_, "no_sync: this model was not dedicated; call dmuon::dedicate_params (and dmuon::replicate) "
              "first. Without dmuon nothing is reduced, so there is nothing to suspend.");
  std::lock_guard<std::recursive_mutex> g(state_->mu);
  TORCH_CHECK(!state_->no_sync, "rank ", state_->mesh->global_rank(), ": no_sync is already active on this model. "
              "Nested no_sync scopes are a mistake: keep one scope around every micro-batch but the last.");
  state_->no_sync = true;
}

NoSync::~NoSync() {
  std::lock_guard<std::recursive_mutex> g(state_->mu);
  state_->no_sync = false;
}

void DedicatedState::wait_publishes() {
  std::lock_guard<std::recursive_mutex> g(mu);
  for (auto& B : boundaries) {
    wait_broadcasts(B.index);
    for (auto& buf : B.buffers) {
      wait_publish(buf);
      buf.scatter.wait();
    }
  }
}

void DedicatedState::publish(bool async) {
  std::lock_guard<std::recursive_mutex> g(mu);
  if (Communicator* rep = mesh->replicate(); rep && !ddp) {
    // HSDP: the global owner's update goes to the holders of the other replicate groups, in the
    // recorded forward order, chunked by replicate_broadcast_bucket_mb.
    std::vector<int> order = recorded_order.empty() ? current_order : recorded_order;
    for (const auto& B : boundaries)
      if (std::find(order.begin(), order.end(), B.index) == order.end()) order.push_back(B.index);
    const int64_t chunk_bytes = static_cast<int64_t>(opts.replicate_broadcast_bucket_mb * 1024 * 1024);
    for (int b : order)
      for (auto& buf : boundaries[b].buffers) {
        if (!buf.is_root) continue;
        wait_publish(buf);
        const int64_t esz = buf.flat.element_size();
        const int64_t chunk = chunk_bytes > 0 ? std::max<int64_t>(1, chunk_bytes / esz) : buf.numel;
        for (int64_t off = 0; off < buf.numel; off += chunk) {
          const int64_t len = std::min(chunk, buf.numel - off);
          buf.publish.push_back(rep->broadcast(buf.flat.narrow(0, off, len), buf.owner.replicate,
                                               "post-step publish of '" + boundaries[b].name + "'"));
        }
      }
    if (!async || !boundaries_seen) wait_publishes();
    if (env::isolated_pg_barrier()) {
      // strict post-step fence on dmuon's own groups (diagnosis of process-group ordering issues)
      wait_publishes();
      mesh->shard().barrier("DMUON_ISOLATED_PG_BARRIER post-step fence (shard)");
      rep->barrier("DMUON_ISOLATED_PG_BARRIER post-step fence (replicate)");
    }
    return;
  }
  if (!ddp) {
    // all_gather mode: the owner scatters its update into every rank's shard (waited before the
    // next all-gather of the same buffer); broadcast mode: the next forward broadcasts
    for (auto& B : boundaries)
      for (auto& buf : B.buffers)
        if (buf.gather_mode) {
          buf.scatter.wait();
          at::Tensor src = buf.is_root ? buf.flat : at::empty({0}, buf.flat.options());
          buf.scatter = mesh->shard().scatter_flat(buf.shard, src, buf.root, boundary_what("post-step scatter", B, buf));
          if (!async) buf.scatter.wait();
        }
    if (env::isolated_pg_barrier()) mesh->shard().barrier("DMUON_ISOLATED_PG_BARRIER post-step fence");
    return;
  }
  Communicator& comm = mesh->shard();
  // In the recorded forward order (model order before the first pass), so the next forward finds
  // its first boundary's publish issued first.
  std::vector<int> order = recorded_order.empty() ? current_order : recorded_order;
  for (const auto& B : boundaries)
    if (std::find(order.begin(), order.end(), B.index) == order.end()) order.push_back(B.index);
  for (int b : order) {
    Boundary& B = boundaries[b];
    for (auto& buf : B.buffers) {
      if (buf.state == PackedBuffer::State::Pending) buf.bcast.wait();
      buf.bcast = comm.broadcast(buf.flat, buf.root, boundary_what("post-step publish", B, buf));
      buf.state = PackedBuffer::State::Pending;
    }
  }
  // Without boundaries nothing would wait before the parameters are read again: drain now.
  if (!async || !boundaries_seen)
    for (const auto& B : boundaries) wait_broadcasts(B.index);
}

std::string DedicatedState::bypass_hint() const {
  std::lock_guard<std::recursive_mutex> g(mu);
  for (const auto& B : boundaries) {
    if (B.ran_forward && !backward_since_forward) continue;
    for (const auto& buf : B.buffers) {
      if (buf.is_root || buf.state != PackedBuffer::State::Released) continue;
      const auto& e = params[buf.params.front()];
      std::ostringstream o;
      o << "dmuon: hook boundary '" << B.name << "' was not run through dmuon::forward in this forward pass, and its "
        << "dedicated parameters are 0-element placeholders on rank " << mesh->global_rank() << " (e.g. '" << e.name
        << "', shape " << at::IntArrayRef(e.shape) << ", owned by rank " << e.owner_rank << "). Call "
        << "`x = dmuon::forward(module, x)` for '" << B.name << "' instead of calling its forward directly.";
      return o.str();
    }
  }
  return "";
}

// ---- BoundaryScope ---------------------------------------------------------------------------------
namespace detail {

struct BoundaryScope::Impl {
  std::shared_ptr<DedicatedState> state;  // set when the module is a boundary
  int boundary = -1;
  std::shared_ptr<DedicatedState> root;   // set when the module is a dedicated model
  bool entered = false;
  bool exited = false;
};

BoundaryScope::BoundaryScope(const torch::nn::Module* module) : impl_(std::make_unique<Impl>()) {
  auto [st, b] = boundary_of_module(module);
  impl_->state = st;
  impl_->boundary = b;
  impl_->root = state_of_model(module);
}

BoundaryScope::~BoundaryScope() = default;

void BoundaryScope::enter() {
  if (impl_->root) impl_->root->begin_root_forward();  // the model's own forward: a new pass
  if (impl_->state) impl_->state->pre_forward(impl_->boundary);
  impl_->entered = true;
}

at::Tensor BoundaryScope::cast_input(const at::Tensor& t) const {
  if (!impl_->state || !t.defined() || !t.is_floating_point()) return t;
  const auto& d = impl_->state->boundaries[static_cast<size_t>(impl_->boundary)].input_dtype;
  return d && t.scalar_type() != *d ? t.to(*d) : t;
}

at::Tensor BoundaryScope::enter(const at::Tensor& input) {
  enter();
  const at::Tensor x = cast_input(input);
  if (!impl_->state || !at::GradMode::is_enabled() || !x.defined() || !x.requires_grad()) return x;
  impl_->state->note_post_hook(impl_->boundary);
  return PostBackwardFn::apply(x, reinterpret_cast<int64_t>(impl_->state.get()),
                               static_cast<int64_t>(impl_->boundary))[0];
}

void BoundaryScope::exit() {
  if (impl_->state && impl_->entered && !impl_->exited) impl_->state->post_forward(impl_->boundary);
  impl_->exited = true;
}

at::Tensor BoundaryScope::exit(const at::Tensor& output) {
  exit();
  at::Tensor y = output;
  if (impl_->state && y.defined() && y.is_floating_point())
    if (const auto& d = impl_->state->boundaries[static_cast<size_t>(impl_->boundary)].output_dtype;
        d && y.scalar_type() != *d)
      y = y.to(*d);
  if (!impl_->state || !at::GradMode::is_enabled() || !y.defined() || !y.requires_grad()) return y;
  return PreBackwardFn::apply(y, reinterpret_cast<int64_t>(impl_->state.get()),
                              static_cast<int64_t>(impl_->boundary))[0];
}

void BoundaryScope::rethrow(const std::exception& e) {
  if (impl_->state && impl_->entered && !impl_->exited) {
    impl_->exited = true;
    try {
      impl_->state->post_forward(impl_->boundary);
    } catch (...) {
    }
  }
  const std::string what = e.what();
  std::shared_ptr<DedicatedState> st = impl_->root ? impl_->root : impl_->state;
  if (st && what.find("dmuon: hook boundary") == std::string::npos) {
    const std::string hint = st->bypass_hint();
    if (!hint.empty()) TORCH_CHECK(false, what, "\n", hint);
  }
  throw;
}

}  // namespace detail

}  // namespace dmuon
