// The route of dedicated Muon matrices (see dedicated_route.h).
#include "runtime/dedicated_route.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <functional>
#include <map>
#include <sstream>

#include "dmuon/host_sync.h"
#include "runtime/packing.h"
#include "runtime/route_context.h"
#include "runtime/storage.h"
#include "runtime/whole_params.h"

namespace dmuon {

std::string DedicatedRoute::what(const char* phase, int b, const PackedBuffer& buf) const {
  std::ostringstream o;
  o << phase << " of '" << ctx_.boundary_name(b) << "' from rank " << buf.root_global << " ("
    << buf.params.size() << " params, " << buf.bytes() << " bytes)";
  return o.str();
}

const DedicatedEntry* DedicatedRoute::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[static_cast<size_t>(it->second)];
}

// ---- setup -----------------------------------------------------------------------------------------
void DedicatedRoute::build(std::vector<DedicatedEntry> entries, const OwnerPlan& plan, int num_boundaries) {
  Mesh& mesh = ctx_.mesh();
  const int rank = mesh.global_rank();
  entries_ = std::move(entries);
  for (size_t i = 0; i < entries_.size(); ++i) index_[entries_[i].name] = static_cast<int>(i);
  buffers_.assign(static_cast<size_t>(num_boundaries), {});
  std::vector<std::vector<int>> by_boundary(static_cast<size_t>(num_boundaries));
  for (size_t i = 0; i < entries_.size(); ++i) {
    auto& e = entries_[i];
    e.owner = plan.owners[i];
    e.owner_rank = mesh.global_rank_of(e.owner.shard, e.owner.replicate);
    e.is_owner = e.owner.shard == mesh.shard_rank() && e.owner.replicate == mesh.replicate_rank();
    by_boundary[static_cast<size_t>(e.boundary)].push_back(static_cast<int>(i));
  }
  at::NoGradGuard ng;
  for (int b = 0; b < num_boundaries; ++b) {
    const std::string& bname = ctx_.boundary_name(b);
    // one buffer per distinct owner slot (and precision), ordered by slot index (same on every rank)
    std::map<std::pair<int, Precision>, std::vector<int>> by_slot;
    for (int p : by_boundary[static_cast<size_t>(b)])
      by_slot[{OwnerPlan::slot_index(entries_[p].owner, plan.shard_size), entries_[p].prec}].push_back(p);
    for (auto& [key, ps] : by_slot) {
      const DedicatedEntry& first = entries_[ps.front()];
      PackedBuffer buf;
      buf.owner = first.owner;
      buf.root = buf.owner.shard;
      buf.root_global = mesh.global_rank_of(buf.owner.shard, buf.owner.replicate);
      buf.params = ps;
      buf.prec = key.second;
      buf.is_owner = first.is_owner;
      buf.holder = buf.owner.shard == mesh.shard_rank();  // the holder in this replicate group
      buf.unshard = first.unshard;
      for (int p : ps) {
        TORCH_CHECK(entries_[p].unshard == buf.unshard, "rank ", rank, ": dedicate_params: parameters '",
                    entries_[p].name, "' and '", first.name, "' share an owner in boundary '", bname,
                    "' but differ in muon_forward_unshard; use one mode per boundary, or set pack_small_params=false "
                    "/ separate assignment groups.");
        TORCH_CHECK(entries_[p].param.device() == first.param.device(), "rank ", rank, ": dedicate_params: parameters '",
                    entries_[p].name, "' and '", first.name, "' share an owner in boundary '", bname,
                    "' but live on different devices; move the model to one device first.");
        buf.offsets.push_back(buf.numel);
        buf.numel += entries_[p].param.numel();
      }
      // all_gather mode pads the buffer to G equal shards
      if (buf.gather_mode()) buf.shard_len = (buf.numel + mesh.shard_size() - 1) / mesh.shard_size();
      const auto o = first.param.options().requires_grad(false);
      buf.keeps = buf.holder || ddp_;  // decided once: holds the matrices between steps
      const bool keeps = buf.keeps;
      const int64_t flat_numel = buf.gather_mode() ? buf.shard_len * mesh.shard_size() : buf.numel;
      buf.flat = keeps ? at::zeros({flat_numel}, o.dtype(buf.prec.param)) : at::empty({flat_numel}, o.dtype(buf.prec.param));
      // the global owner keeps the master copy, from the parameters' values before any cast
      if (buf.is_owner && buf.prec.has_master()) buf.master = at::zeros({buf.flat.numel()}, o.dtype(buf.prec.master));
      for (size_t k = 0; k < ps.size(); ++k) {
        auto& e = entries_[ps[k]];
        e.buffer = static_cast<int>(buffers_[static_cast<size_t>(b)].size());
        e.slot_in_buffer = static_cast<int>(k);
        buf.views.push_back(buf.flat.narrow(0, buf.offsets[k], e.param.numel()).view(e.param.sizes()));
        at::Tensor mv;
        if (buf.master.defined()) {
          mv = buf.master.narrow(0, buf.offsets[k], e.param.numel()).view(e.param.sizes());
          ctx_.set_master(e.param, mv);
        }
        if (is_deferred(e.param)) {  // only holders materialise it, straight into their buffer
          if (!keeps) continue;
          at::Tensor target = mv.defined() ? mv : buf.views[k];
          ctx_.fill_from(*ctx_.deferred_source(), e.name, detail::tp_region(e.shape, e.tp_dim, mesh.tp_rank(),
                                                                               mesh.tp_size()), target);
          if (mv.defined()) buf.views[k].copy_(mv);
          e.preset = true;
        } else if (mv.defined()) {
          mv.copy_(e.param.detach());
        }
      }
      // a rank that does not hold the matrices gives the buffer's bytes back at once (install()
      // would anyway; before it, every boundary's buffer would be live together)
      if (!keeps) detail::resize_storage_bytes(buf.flat, 0);
      buffers_[static_cast<size_t>(b)].push_back(std::move(buf));
    }
  }
}

void DedicatedRoute::install() {
  Mesh& mesh = ctx_.mesh();
  at::NoGradGuard ng;
  for (auto& e : entries_) e.placeholder = at::empty({0}, e.param.options().requires_grad(false));
  // hooks, while every parameter still has its full shape (the accumulator caches it)
  for (size_t i = 0; i < entries_.size(); ++i)
    entries_[i].grad_acc = ctx_.on_grad_accumulated(
        entries_[i].param, entries_[i].name,
        [this, i](GradEvents& ev) {
          auto& e = entries_[i];
          ev.accumulated(e.accumulated, e.boundary);
        },
        [this, i](GradEvents& ev) {
          // after the boundary's reduce: not in it, and a non-owner's parameter is released (dropped, warned)
          if (ev.after_reduce(entries_[i].boundary)) return false;
          carry_installed_grad(entries_[i]);
          return true;
        });
  // data: holders keep their value in the packed buffer; the others release theirs
  for_each_buffer([&](int, PackedBuffer& buf) {
    const bool keeps = buf.keeps;
    for (size_t k = 0; k < buf.params.size(); ++k) {
      auto& e = entries_[buf.params[k]];
      if (keeps) {
        if (!e.preset) buf.views[k].copy_(e.param.detach());  // (HSDP: replaced by the global owner's value below)
        e.param.set_data(buf.views[k]);
      } else {
        e.param.set_data(e.placeholder);
      }
    }
    if (keeps) {
      buf.state = PackedBuffer::State::Ready;
    } else {
      detail::resize_storage_bytes(buf.flat, 0);
      buf.state = PackedBuffer::State::Released;
    }
  });
  // DDP path: every rank starts from the owner's value (ranks may have initialised differently)
  if (ddp_)
    for_each_buffer([&](int b, PackedBuffer& buf) {
      mesh.shard()
          .broadcast(buf.flat, buf.root, "initial value of '" + ctx_.boundary_name(b) +
                                             "' from its owner")
          .wait();
    });
  // HSDP: every holder starts from the global owner's value (one broadcast per packed unit over the
  // replicate group of the owner's column; same order on every member)
  if (Communicator* rep = mesh.replicate())
    for_each_buffer([&](int b, PackedBuffer& buf) {
      if (!buf.holder) return;
      rep->broadcast(buf.flat, buf.owner.replicate,
                     "initial value of '" + ctx_.boundary_name(b) + "' from replicate " +
                         std::to_string(buf.owner.replicate))
          .wait();
    });
  // all_gather mode: every rank starts with its shard of the owner's value (after the DDP / HSDP
  // initial broadcasts, so every holder scatters the same value)
  for_each_buffer([&](int b, PackedBuffer& buf) {
    if (!buf.gather_mode()) return;
    buf.shard = at::empty({buf.shard_len}, buf.flat.options());
    scatter_shards(buf, "initial shards of '" + ctx_.boundary_name(b) + "'").wait();
  });
}

Pending DedicatedRoute::scatter_shards(PackedBuffer& buf, const std::string& w) {
  at::Tensor src = buf.holder ? buf.flat : at::empty({0}, buf.flat.options());
  return ctx_.mesh().shard().scatter_flat(buf.shard, src, buf.root, w);
}

// ---- unshard / release -------------------------------------------------------------------------------
void DedicatedRoute::issue_unshard(int b, const char* phase) {
  if (ddp_) return;  // full parameters everywhere; the post-step publish is the only broadcast
  Communicator& comm = ctx_.mesh().shard();
  const auto& compute = ctx_.options().compute_dtype;
  for (auto& buf : buffers_[static_cast<size_t>(b)]) {
    if (buf.state != PackedBuffer::State::Released && buf.ready_pass == ctx_.pass()) continue;  // already published
    if (buf.state == PackedBuffer::State::Pending) buf.bcast.wait();  // an unused one from an earlier pass
    if (buf.holder) wait_publish(buf);  // HSDP: the holder's copy must be the new value first
    if (!buf.holder && buf.state == PackedBuffer::State::Released) detail::restore_storage(buf.flat);
    if (buf.gather_mode()) {  // rebuild the full matrix from every rank's shard
      buf.scatter.wait();  // the shards of the last update must have arrived
      buf.scatter = Pending();
      buf.bcast = comm.allgather_flat(buf.flat, buf.shard, what(phase, b, buf) + " [all-gather mode]");
    } else {
      at::Tensor payload = buf.flat;
      if (compute && static_cast<int64_t>(c10::elementSize(*compute)) < buf.flat.element_size()) {  // narrows only
        buf.bcast_payload = buf.holder ? buf.flat.to(*compute) : at::empty({buf.numel}, buf.flat.options().dtype(*compute));
        payload = buf.bcast_payload;
      }
      // (a one-rank shard group sends nothing: no description to build every forward)
      buf.bcast = comm.broadcast(payload, buf.root, comm.local_only() ? std::string() : what(phase, b, buf));
    }
    buf.state = PackedBuffer::State::Pending;
    buf.ready_pass = ctx_.pass();
  }
}

void DedicatedRoute::check_params(int b, const std::string& during) const {
  for (const auto& buf : buffers_[static_cast<size_t>(b)])
    for (int p : buf.params) {
      const DedicatedEntry& e = entries_[static_cast<size_t>(p)];
      ctx_.require_given_storage(b, e.name, e.param, {&buf.flat, &e.placeholder}, during);
    }
}

void DedicatedRoute::wait_unshard(int b) {
  at::NoGradGuard ng;
  for (auto& buf : buffers_[static_cast<size_t>(b)]) {
    if (buf.state != PackedBuffer::State::Pending) continue;
    buf.bcast.wait();
    buf.bcast = Pending();
    if (buf.bcast_payload.defined()) {
      if (!buf.holder) buf.flat.copy_(buf.bcast_payload);
      buf.bcast_payload = at::Tensor();
    }
    if (!buf.holder)
      for (size_t k = 0; k < buf.params.size(); ++k) entries_[buf.params[k]].param.set_data(buf.views[k]);
    buf.state = PackedBuffer::State::Ready;
  }
}

void DedicatedRoute::release(int b) {
  at::NoGradGuard ng;
  for (auto& buf : buffers_[static_cast<size_t>(b)]) {
    if (buf.state == PackedBuffer::State::Pending) buf.bcast.wait();  // never free a buffer in flight
    buf.bcast = Pending();
    buf.bcast_payload = at::Tensor();
    if (ddp_) {
      buf.state = PackedBuffer::State::Ready;  // the DDP path keeps full parameters everywhere
      continue;
    }
    if (buf.holder) {
      buf.state = PackedBuffer::State::Released;  // logical: the holder's data stay
      continue;
    }
    if (buf.state == PackedBuffer::State::Released) continue;
    // CUDA: the broadcast into `flat` was waited above (NCCL's wait makes the current stream wait
    // for the NCCL stream, and NCCL recorded its stream on the tensor), and every kernel that read
    // `flat` was issued on the current stream, so the caching allocator hands the freed block out
    // again only to work ordered after all of them.
    for (int p : buf.params) entries_[p].param.set_data(entries_[p].placeholder);
    detail::resize_storage_bytes(buf.flat, 0);
    buf.state = PackedBuffer::State::Released;
  }
}

std::string DedicatedRoute::bypass_hint(int b) const {
  for (const auto& buf : buffers_[static_cast<size_t>(b)]) {
    if (buf.holder || buf.state != PackedBuffer::State::Released) continue;
    const auto& e = entries_[buf.params.front()];
    const std::string& bname = ctx_.boundary_name(b);
    std::ostringstream o;
    // (said as a possibility: the error may come from a block before it, or from the model's own code)
    o << "dmuon: hook boundary '" << bname << "' has not run through dmuon::forward in this forward pass, so its "
      << "dedicated parameters are 0-element placeholders on rank " << ctx_.mesh().global_rank() << " (e.g. '" << e.name
      << "', shape " << at::IntArrayRef(e.shape) << ", owned by rank " << e.owner_rank << "). If the error above "
      << "comes from one of them (a shape error with a 0-element or 1-D tensor), its module was called directly: call "
      << "`x = dmuon::forward(module, x)` for '" << bname << "' instead of calling its forward.";
    return o.str();
  }
  return "";
}

// ---- gradients ------------------------------------------------------------------------------------
void DedicatedRoute::issue_reduce(int b) {
  Mesh& mesh = ctx_.mesh();
  Communicator& comm = mesh.shard();
  at::NoGradGuard ng;
  std::vector<at::Tensor> ps;
  auto params_of = [&](const PackedBuffer& buf) -> const std::vector<at::Tensor>& {
    ps.clear();
    for (int p : buf.params) ps.push_back(entries_[p].param);
    return ps;
  };
  // the owner's gradient from the last step, where no new one arrived for it (its pre-hook did not run):
  // aside too, so it is not reduced as a local gradient
  for (auto& buf : buffers_[static_cast<size_t>(b)])
    for (int p : buf.params) carry_installed_grad(entries_[p]);
  if (mesh.data_parallel_size() == 1 && comm.local_only()) {
    // one data-parallel rank: it owns every matrix and there is nothing to sum, so the gradients go
    // straight into the accumulator (no payload, no collective, nothing to wait; with
    // DMUON_FORCE_COLLECTIVES the reduce path below runs instead, with real collectives)
    for (auto& buf : buffers_[static_cast<size_t>(b)]) {
      TORCH_INTERNAL_ASSERT(buf.is_owner && !buf.reduce_issued && !buf.stage2_issued, "rank ", mesh.global_rank(),
                            ": the only data-parallel rank does not own, or has a reduce in flight for, '",
                            entries_[buf.params.front()].name, "' of boundary '",
                            ctx_.boundary_name(b), "'");
      buf.acc.fold_grads(params_of(buf), buf.offsets, buf.numel, buf.prec.reduce, buf.prec.master, buf.flat.options());
    }
    return;
  }
  for (auto& buf : buffers_[static_cast<size_t>(b)]) {
    if (buf.reduce_issued || buf.stage2_issued) {  // an earlier pass (accumulation)
      finish_stage1(buf);
      finish_stage2(buf);
    }
    // Every rank hands its local gradient to the reduce; the owner gets the average back in
    // prepare_grads, non-owners keep nothing.
    const int64_t np = static_cast<int64_t>(buf.params.size());
    buf.grad_payload = pack_grads(params_of(buf), buf.offsets, buf.numel + np, buf.numel,
                                  buf.flat.options().dtype(buf.prec.reduce));
    predivide(buf.grad_payload.narrow(0, 0, buf.numel), static_cast<double>(mesh.data_parallel_size()));
    buf.reduce = comm.reduce(buf.grad_payload, buf.root, Reduction::Sum,
                             comm.local_only() ? std::string() : what("gradient reduce", b, buf));
    buf.reduce_issued = true;
  }
  sent_reduces_.push_back(b);
  release_sent_reduces();
  if (mesh.replicate()) {
    stage2_due_.push_back(b);
    issue_due_stage2(kStage2Lag);
  }
}

void DedicatedRoute::issue_due_stage2(size_t keep) {
  while (stage2_due_.size() > keep) {
    for (auto& buf : buffers_[static_cast<size_t>(stage2_due_.front())])
      if (buf.holder) finish_stage1(buf);  // waits stage 1, issues stage 2
    stage2_due_.pop_front();
  }
}

void DedicatedRoute::release_sent_reduces() {
  // non-roots keep nothing of a reduce once it is done: free the payloads of every finished one,
  // and wait the oldest while more than kMaxReducesInFlight boundaries are pending (issued earlier on
  // every rank, so waiting it cannot block a peer)
  auto finished = [&](int b, bool wait) {
    bool done = true;
    for (auto& buf : buffers_[static_cast<size_t>(b)]) {
      if (!buf.reduce_issued || buf.holder) continue;
      if (wait || buf.reduce.poll())
        finish_stage1(buf);
      else
        done = false;
    }
    return done;
  };
  for (auto it = sent_reduces_.begin(); it != sent_reduces_.end();)
    it = finished(*it, false) ? sent_reduces_.erase(it) : ++it;
  while (sent_reduces_.size() > kMaxReducesInFlight) {
    finished(sent_reduces_.front(), true);
    sent_reduces_.pop_front();
  }
}

void DedicatedRoute::finish_stage1(PackedBuffer& buf) {
  if (!buf.reduce_issued) return;
  buf.reduce.wait();
  buf.reduce = Pending();
  buf.reduce_issued = false;
  Mesh& mesh = ctx_.mesh();
  Communicator* rep = mesh.replicate();
  if (!buf.holder) {
    buf.grad_payload = at::Tensor();
    return;
  }
  const int64_t np = static_cast<int64_t>(buf.params.size());
  if (!rep) {
    buf.acc.fold(buf.grad_payload, buf.numel, np, buf.prec.master, mesh.shard_size());
    buf.grad_payload = at::Tensor();
    return;
  }
  // stage 2: the holders of this unit (one per replicate group) reduce to the global owner
  std::ostringstream w;
  w << "stage-2 gradient reduce of a unit owned by (" << buf.owner.shard << ", " << buf.owner.replicate << ")";
  buf.stage2 = rep->reduce(buf.grad_payload, buf.owner.replicate, Reduction::Sum, w.str());
  buf.stage2_issued = true;
}

void DedicatedRoute::finish_stage2(PackedBuffer& buf) {
  if (!buf.stage2_issued) return;
  buf.stage2.wait();
  buf.stage2 = Pending();
  buf.stage2_issued = false;
  if (buf.is_owner)
    buf.acc.fold(buf.grad_payload, buf.numel, static_cast<int64_t>(buf.params.size()), buf.prec.master,
                 static_cast<double>(ctx_.mesh().data_parallel_size()));
  buf.grad_payload = at::Tensor();
}

void DedicatedRoute::end_of_backward() {
  if (!ctx_.mesh().replicate()) return;
  issue_due_stage2(0);  // the last boundaries' stage 2 (every earlier one is issued already)
  // delay_stage2_to_optimizer (the default): step() waits stage 2, group by group; else backward does
  if (!ctx_.options().delay_stage2_to_optimizer) for_each_buffer([&](int, PackedBuffer& buf) { finish_stage2(buf); });
}

void DedicatedRoute::reset_pass() {
  for (auto& e : entries_) e.accumulated = false;
}

void DedicatedRoute::finish_reduces() {
  sent_reduces_.clear();  // waited below with the rest
  stage2_due_.clear();
  // stage 1 everywhere first (HSDP holders issue stage 2 as they go), then stage 2
  for_each_buffer([&](int, PackedBuffer& buf) { finish_stage1(buf); });
  for_each_buffer([&](int, PackedBuffer& buf) { finish_stage2(buf); });
}

void DedicatedRoute::collect_flags(std::vector<at::Tensor>& out) {
  for_each_buffer([&](int, PackedBuffer& buf) {
    if (buf.is_owner && buf.acc.has_value()) out.push_back(buf.acc.flags_for_read());
  });
}

void DedicatedRoute::carry_installed_grad(DedicatedEntry& e) {
  if (!e.grad_installed) return;
  e.grad_installed = false;  // the first gradient after a step only (later passes add local gradients)
  if (!e.param.grad().defined()) return;  // dropped since (zero_grad, model.zero_grad())
  e.carried_grad = e.param.grad();
  e.param.mutable_grad() = at::Tensor();
}

void DedicatedRoute::install_buffer(PackedBuffer& buf, const float*& flag) {
  if (!buf.is_owner || !buf.acc.has_value()) return;
  at::NoGradGuard ng;
  const at::Tensor sum = buf.acc.take_sum();
  for (size_t k = 0; k < buf.params.size(); ++k) {
    auto& e = entries_[buf.params[k]];
    at::Tensor& g = e.param.mutable_grad();
    const bool has_sum = *flag++ > 0;
    if (g.defined() && !e.grad_installed) {
      // the caller set p.grad after the reduce took the gradients (torch.autograd.grad then p.grad = g, a
      // replaced gradient): the owner steps with it, as torch's optimizers step with what p.grad holds
      if (!warned_user_grad_) {
        warned_user_grad_ = true;
        TORCH_WARN("rank ", ctx_.mesh().global_rank(), ": the gradient of the dedicated matrix '", e.name,
                   "' was set by the caller after its reduce (p.grad = ... after backward): its owner steps with that "
                   "tensor, not with the average over the ranks of their backward's gradients. To edit the averaged "
                   "gradients, call dmuon.prepare_muon_grads(model) (prepare_grads in C++) first: the owners' p.grad "
                   "then holds them.");
      }
      e.carried_grad = at::Tensor();
      e.grad_installed = true;
      continue;
    }
    if (has_sum) {
      g = sum.narrow(0, buf.offsets[k], e.param.numel()).view(e.param.sizes());
      if (e.carried_grad.defined()) g.add_(e.carried_grad.to(g.dtype()));
    } else {
      g = e.carried_grad;  // no rank produced a gradient: the carried one, or none
    }
    e.carried_grad = at::Tensor();
    e.grad_installed = g.defined();
  }
}

void DedicatedRoute::install_grads(const float*& flag) {
  for_each_buffer([&](int, PackedBuffer& buf) { install_buffer(buf, flag); });
}

void DedicatedRoute::ready_grad_of(const DedicatedEntry& e, std::vector<ReadyGrad>& out) const {
  if (!e.is_owner || !e.param.grad().defined()) return;  // not ours: the owner updates it
  // counted in a norm by its (global) owner only
  ReadyGrad r = ctx_.ready_grad(e.name, e.param, e.prec, /*muon=*/true, /*counted=*/true, /*counts_param=*/true);
  r.tp_owner = e.tp_owner;
  r.tp_dim = e.tp_dim;
  r.full_shape = e.full_shape;
  out.push_back(std::move(r));
}

void DedicatedRoute::ready_grads(std::vector<ReadyGrad>& out) {
  for (const auto& e : entries_) ready_grad_of(e, out);
}

// ---- per group (Muon::step with group_prepare_ahead, prepare_muon_grads without coalesce_wait) ----
void DedicatedRoute::prepare_group(int b) {
  // (stage 2 is normally issued in backward already: then this only drops the boundary from the due list)
  stage2_due_.erase(std::remove(stage2_due_.begin(), stage2_due_.end(), b), stage2_due_.end());
  for (auto& buf : buffers_[static_cast<size_t>(b)]) finish_stage1(buf);
}

std::vector<ReadyGrad> DedicatedRoute::finish_group(int b) {
  at::NoGradGuard ng;
  auto& bufs = buffers_[static_cast<size_t>(b)];
  prepare_group(b);  // (normally done already)
  for (auto& buf : bufs) finish_stage2(buf);
  std::vector<at::Tensor> parts;
  for (auto& buf : bufs)
    if (buf.is_owner && buf.acc.has_value()) parts.push_back(buf.acc.flags_for_read());
  std::vector<ReadyGrad> out;
  if (!parts.empty()) {  // the group's has-gradient flags: one host read per group
    const at::Tensor host = detail::read_to_host(at::cat(parts));
    const float* flag = host.data_ptr<float>();
    for (auto& buf : bufs) install_buffer(buf, flag);
  }
  for (const auto& buf : bufs)
    for (int p : buf.params) ready_grad_of(entries_[static_cast<size_t>(p)], out);
  return out;
}

void DedicatedRoute::discard_grads() {
  sent_reduces_.clear();
  stage2_due_.clear();
  for_each_buffer([&](int, PackedBuffer& buf) {
    for (auto [issued, pending] : {std::pair{&buf.reduce_issued, &buf.reduce}, {&buf.stage2_issued, &buf.stage2}})
      if (*issued) {
        pending->wait();
        *pending = Pending();
        *issued = false;
      }
    buf.grad_payload = at::Tensor();
    buf.acc.clear();
  });
  for (auto& e : entries_) {
    e.carried_grad = at::Tensor();
    e.grad_installed = false;
  }
}

// zero_grad(set_to_none=False) leaves the owners' installed gradients as zeros: still dmuon's (carried into the
// next average, or dropped when no gradient comes), not a gradient the caller set (install_buffer)
void DedicatedRoute::after_zero_grad(bool set_to_none) {
  if (set_to_none) return;
  for (auto& e : entries_)
    if (e.param.grad().defined()) e.grad_installed = true;
}

void DedicatedRoute::upcast_local_grads() {
  for (auto& e : entries_) upcast_local_grad(e.param, e.prec);
}

// ---- publish ---------------------------------------------------------------------------------------
void DedicatedRoute::defer_update(const std::string& name, std::function<void()> apply) {
  const DedicatedEntry* e = find(name);
  TORCH_CHECK(e, "defer_update: '", name, "' is not a dedicated parameter");
  buffers_[static_cast<size_t>(e->boundary)][static_cast<size_t>(e->buffer)].deferred.push_back(std::move(apply));
}

void DedicatedRoute::finish_deferred(PackedBuffer& buf) {
  if (buf.deferred.empty()) return;
  at::NoGradGuard ng;
  auto work = std::move(buf.deferred);
  buf.deferred.clear();
  for (auto& f : work) f();
}

void DedicatedRoute::finish_deferred() {
  for_each_buffer([&](int, PackedBuffer& buf) { finish_deferred(buf); });
}

void DedicatedRoute::wait_publish(PackedBuffer& buf) {
  finish_deferred(buf);
  for (auto& p : buf.publish) p.wait();
  buf.publish.clear();
}

void DedicatedRoute::plan_step_traffic(std::vector<PlannedTraffic>& out) const {
  Mesh& mesh = ctx_.mesh();
  Communicator& shard = mesh.shard();
  Communicator* rep = mesh.replicate();
  const int64_t G = mesh.shard_size();
  for (const auto& bufs : buffers_)
    for (const PackedBuffer& buf : bufs) {
      if (!buf.gather_mode()) continue;  // broadcast mode: get_comm_plan's per-rank tables
      const int64_t es = buf.flat.element_size();
      const int64_t payload = (buf.numel + static_cast<int64_t>(buf.params.size())) *
                              static_cast<int64_t>(c10::elementSize(buf.prec.reduce));
      const bool holder_row = mesh.shard_rank() == buf.owner.shard;
      // backward: the gradient reduce to the holder, then (HSDP) the holders' reduce to the global owner
      add_planned(out, "muon", shard, CommOp::Reduce, payload, 1, holder_row);
      if (rep && holder_row)
        add_planned(out, "muon", *rep, CommOp::Reduce, payload, 1, mesh.replicate_rank() == buf.owner.replicate);
      if (ddp_) {  // after step: scatter the update into the shards, every rank all-gathers it
        add_planned(out, "muon", shard, CommOp::Scatter, buf.shard_len * es, 1, holder_row);
        add_planned(out, "muon", shard, CommOp::AllGather, G * buf.shard_len * es);
        continue;
      }
      // forward all-gather (Z3: again in backward); after step the owner's group scatters the update
      // into its shards and (HSDP) each shard crosses the replicate axis from there
      add_planned(out, "muon", shard, CommOp::AllGather, G * buf.shard_len * es, ctx_.z3() ? 2 : 1);
      if (!rep || mesh.replicate_rank() == buf.owner.replicate)
        add_planned(out, "muon", shard, CommOp::Scatter, buf.shard_len * es, 1, holder_row);
      if (rep)
        add_planned(out, "muon", *mesh.replicate_publish(), CommOp::Broadcast, buf.shard_len * es, 1,
                    mesh.replicate_rank() == buf.owner.replicate);
    }
}

bool DedicatedRoute::in_flight() {
  bool busy = false;
  for_each_buffer([&](int, PackedBuffer& buf) {
    for (Pending* p : {&buf.bcast, &buf.reduce, &buf.stage2, &buf.scatter}) busy = busy || !p->poll();
    for (Pending& p : buf.publish) busy = busy || !p.poll();
  });
  return busy;
}

void DedicatedRoute::wait_publishes() {
  for_each_buffer([&](int, PackedBuffer& buf) {
    wait_publish(buf);
    buf.scatter.wait();
  });
}

bool DedicatedRoute::publishes_in_step() const {
  if (ddp_ || ctx_.mesh().replicate()) return !entries_.empty();
  for (const auto& bufs : buffers_)
    for (const auto& buf : bufs)
      if (buf.gather_mode()) return true;
  return false;
}

void DedicatedRoute::publish_group(int b, bool async) {
  if (published_.size() != buffers_.size()) published_.assign(buffers_.size(), false);
  if (published_[static_cast<size_t>(b)]) return;
  published_[static_cast<size_t>(b)] = true;
  Mesh& mesh = ctx_.mesh();
  auto& bufs = buffers_[static_cast<size_t>(b)];
  if (Communicator* rep = mesh.replicate_publish(); rep && !ddp_) {
    // HSDP: the global owner's update goes to the holders of the other replicate groups, chunked by
    // replicate_broadcast_bucket_mb; all_gather mode: its shards cross instead (on the publish's own
    // group: no replicate-axis reduce in front of it)
    const int64_t chunk_bytes = static_cast<int64_t>(ctx_.options().replicate_broadcast_bucket_mb * 1024 * 1024);
    for (auto& buf : bufs) {
      if (!buf.holder || buf.gather_mode()) continue;
      wait_publish(buf);
      const int64_t esz = buf.flat.element_size();
      const int64_t chunk = chunk_bytes > 0 ? std::max<int64_t>(1, chunk_bytes / esz) : buf.numel;
      for (int64_t off = 0; off < buf.numel; off += chunk) {
        const int64_t len = std::min(chunk, buf.numel - off);
        buf.publish.push_back(rep->broadcast(buf.flat.narrow(0, off, len), buf.owner.replicate,
                                             "post-step publish of '" + ctx_.boundary_name(b) +
                                                 "'"));
      }
    }
    publish_gather_hsdp(b, async);
    return;
  }
  if (!ddp_) {
    // all_gather mode: the owner scatters its update into every rank's shard (waited before the
    // next all-gather of the same buffer); broadcast mode: the next forward broadcasts
    for (auto& buf : bufs) {
      if (!buf.gather_mode()) continue;
      finish_deferred(buf);
      buf.scatter.wait();
      buf.scatter = scatter_shards(buf, what("post-step scatter", b, buf));
      if (!async) buf.scatter.wait();
    }
    return;
  }
  // DDP path. all_gather mode: the owner scatters its update into every rank's shard, then every
  // rank all-gathers the full value (each rank sends and receives (G-1)/G of it instead of the
  // owner sending it whole to everyone)
  Communicator& comm = mesh.shard();
  for (auto& buf : bufs) {
    if (buf.state == PackedBuffer::State::Pending) buf.bcast.wait();
    finish_deferred(buf);
    if (buf.gather_mode()) {
      scatter_shards(buf, what("post-step scatter", b, buf)).wait();
      buf.bcast = comm.allgather_flat(buf.flat, buf.shard, what("post-step publish", b, buf) + " [all-gather mode]");
    } else {
      buf.bcast = comm.broadcast(buf.flat, buf.root, what("post-step publish", b, buf));
    }
    buf.state = PackedBuffer::State::Pending;
  }
}

void DedicatedRoute::publish(bool async) {
  Mesh& mesh = ctx_.mesh();
  // TP updates arriving by scatter: synchronous publish (or nothing that would wait later) applies
  // them now; otherwise each holder applies its own before the buffer is read or sent again
  if (!async || !ctx_.boundaries_seen()) finish_deferred();
  // in the recorded forward order (model order before the first pass), so the next forward finds its
  // first boundary's publish issued first; groups Muon::step published already are skipped
  for (int b : ctx_.publish_order()) publish_group(b, async);
  published_.assign(buffers_.size(), false);
  if (!async || !ctx_.boundaries_seen()) {
    if (mesh.replicate() && !ddp_) wait_publishes();
    // the DDP path without boundaries: nothing would wait before the parameters are read again
    if (ddp_)
      for (size_t b = 0; b < buffers_.size(); ++b) wait_unshard(static_cast<int>(b));
  }
}

// HSDP in all_gather mode, boundary b: the global owner's replicate group scatters the update into
// its shard ranks, then each shard crosses the replicate axis from the owner's group -- every rank
// moves L = S/G over the replicate link instead of each holder receiving the whole unit S. The
// other groups' holders get the new value from the next forward's all-gather, like everyone else.
void DedicatedRoute::publish_gather_hsdp(int b, bool async) {
  Mesh& mesh = ctx_.mesh();
  Communicator& rep = *mesh.replicate_publish();
  auto& bufs = buffers_[static_cast<size_t>(b)];
  // 1. scatters inside the owner's replicate group (shard-group collectives, in buffer order)
  for (auto& buf : bufs) {
    if (!buf.gather_mode()) continue;
    buf.scatter.wait();  // an earlier step's shard must have landed before it is overwritten
    buf.scatter = Pending();
    if (mesh.replicate_rank() != buf.owner.replicate) continue;
    finish_deferred(buf);
    buf.scatter = scatter_shards(buf, what("post-step scatter", b, buf));
  }
  // 2. each shard from the owner's group to the others (replicate-group collectives, same order)
  for (auto& buf : bufs) {
    if (!buf.gather_mode()) continue;
    buf.scatter.wait();
    buf.scatter = rep.broadcast(buf.shard, buf.owner.replicate,
                                what("post-step shard publish", b, buf) + " from replicate " +
                                    std::to_string(buf.owner.replicate));
    if (!async) buf.scatter.wait();
  }
}

// ---- checkpoints -----------------------------------------------------------------------------------
namespace {

// One tensor of a full state dict that a matrix's owner holds: every rank knows its root (the owner's
// slot in the data-parallel group), shape and dtype; the root also its value.
struct OwnedTensor {
  int root = 0;
  const std::string* name = nullptr;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  at::Tensor value;  // the root's only
};

// Sends each item from its root to every rank of `comm` (the data-parallel ranks of this TP position):
// one broadcast per root, dtype and pack of at most kCheckpointPackBytes, roots in order (one broadcast per
// matrix made 1600 small matrices cost 1.2 s on 2 ranks). `items` is the same list on every rank. `got(i, t)`
// receives item i (the root's own value on the root, elsewhere a view into the pack: copy what is kept).
void broadcast_from_owners(Communicator& comm, const std::vector<OwnedTensor>& items, const at::TensorOptions& base,
                           const std::string& what, const std::function<void(size_t, const at::Tensor&)>& got) {
  std::vector<std::vector<size_t>> by_root(static_cast<size_t>(comm.size()));
  for (size_t i = 0; i < items.size(); ++i) by_root[static_cast<size_t>(items[i].root)].push_back(i);
  for (int r = 0; r < comm.size(); ++r) {
    const std::vector<size_t>& mine = by_root[static_cast<size_t>(r)];
    const bool root = comm.rank() == r;
    auto send = [&](const std::vector<size_t>& pack) {
      const OwnedTensor& first = items[pack.front()];
      const at::TensorOptions o = base.dtype(first.dtype);
      std::ostringstream text;
      text << what << "'" << *first.name << "'";
      if (pack.size() > 1) text << " and " << pack.size() - 1 << " more";
      text << " from their owner (rank " << comm.global_ranks()[static_cast<size_t>(r)] << ")";
      if (pack.size() == 1) {  // alone: no copy
        at::Tensor t = root ? first.value.to(o.device(), first.dtype).contiguous() : at::empty(first.shape, o);
        comm.broadcast(t, r, text.str()).wait_host();
        got(pack.front(), root ? first.value : t);
      } else {
        int64_t total = 0;
        for (size_t i : pack) total += c10::multiply_integers(items[i].shape);
        at::Tensor flat = at::empty({total}, o);
        if (root) {
          int64_t off = 0;
          for (size_t i : pack) {
            const at::Tensor& v = items[i].value;
            flat.narrow(0, off, v.numel()).view(v.sizes()).copy_(v);
            off += v.numel();
          }
        }
        comm.broadcast(flat, r, text.str()).wait_host();
        int64_t off = 0;
        for (size_t i : pack) {
          const int64_t n = c10::multiply_integers(items[i].shape);
          got(i, root ? items[i].value : flat.narrow(0, off, n).view(items[i].shape));
          off += n;
        }
      }
    };
    detail::for_each_pack(
        mine, [&](size_t i) { return items[i].dtype; },
        [&](size_t i) { return c10::multiply_integers(items[i].shape) * static_cast<int64_t>(c10::elementSize(items[i].dtype)); },
        detail::kCheckpointPackBytes, send);
  }
}

}  // namespace

void DedicatedRoute::gather_full(const TensorSink& put) {
  Mesh& mesh = ctx_.mesh();
  std::vector<OwnedTensor> items;  // from the (global) owner, in full precision
  items.reserve(entries_.size());
  for (auto& e : entries_) {
    OwnedTensor it{OwnerPlan::slot_index(e.owner, mesh.shard_size()), &e.name, e.shape, e.prec.master, {}};
    if (e.is_owner) {
      const at::Tensor m = ctx_.master_of(e.param);
      it.value = m.defined() ? m : e.param.detach();
    }
    items.push_back(std::move(it));
  }
  if (items.empty()) return;
  broadcast_from_owners(mesh.dp(), items, entries_.front().param.options(), kCheckpointWhat,
                        [&](size_t i, const at::Tensor& t) { put(entries_[i].name, t); });
}

void DedicatedRoute::assign_from(ParamSource& source) {
  Mesh& mesh = ctx_.mesh();
  for (auto& e : entries_) {
    auto& buf = buffers_[static_cast<size_t>(e.boundary)][static_cast<size_t>(e.buffer)];
    const TensorRegion region = detail::tp_region(e.shape, e.tp_dim, mesh.tp_rank(), mesh.tp_size());
    at::Tensor view = buf.views[static_cast<size_t>(e.slot_in_buffer)];
    // the ranks that hold the matrix between steps: its owner / holders, every rank on the DDP path;
    // the owner's master (when it keeps one) takes the full-precision value
    if (at::Tensor m = ctx_.master_of(e.param); m.defined()) {
      ctx_.fill_from(source, e.name, region, m);
      if (buf.keeps) ctx_.after_fills([view, m]() mutable { view.copy_(m); });
    } else if (buf.keeps) {
      ctx_.fill_from(source, e.name, region, view);
    }
  }
  for_each_buffer([&](int b, PackedBuffer& buf) {  // all_gather mode: every rank's shard of the new value
    if (buf.gather_mode())
      ctx_.after_fills([this, &buf, b] {
        scatter_shards(buf, kCheckpointWhat + "shards of '" + ctx_.boundary_name(b) + "'").wait();
      });
  });
  // gathered copies are refreshed by the next forward
  for_each_buffer([&](int, PackedBuffer& buf) { buf.ready_pass = -1; });
}

void DedicatedRoute::full_shapes(std::map<std::string, std::vector<int64_t>>& out) const {
  for (const auto& e : entries_) out[e.name] = e.shape;  // placeholders hold no shape
}

bool DedicatedRoute::describe(const std::string& name, ParamView& v) const {
  const DedicatedEntry* e = find(name);
  if (!e) return false;
  v.route = RouteKind::Dedicated;
  v.shape = e->shape;
  v.boundary = ctx_.boundary_name(e->boundary);
  v.owner_shard = e->owner.shard;
  v.owner_replicate = e->owner.replicate;
  v.owner_rank = e->owner_rank;
  v.tp_dim = e->tp_dim;
  v.tp_owner = e->tp_owner;
  v.updated_here = e->is_owner;
  return true;
}

void DedicatedRoute::state_slots(std::vector<StateSlot>& out) const {
  for (const auto& e : entries_) out.push_back({e.name, e.shape, true, e.param.requires_grad(), e.prec.optim, e.param.device()});
}

// Each matrix's state from its owner: per owner, one header of [has, step] pairs for its matrices, then
// the state tensors packed (broadcast_from_owners), over the data-parallel ranks of this TP position.
void DedicatedRoute::gather_state(const OptimizerStateReader& opt, const StateSink& put) {
  if (entries_.empty()) return;
  Mesh& mesh = ctx_.mesh();
  Communicator& dp = mesh.dp();
  const std::vector<std::string>& fields = opt.fields(true);
  std::vector<ParamState> states(entries_.size());
  std::vector<std::vector<size_t>> by_root(static_cast<size_t>(dp.size()));
  for (size_t i = 0; i < entries_.size(); ++i) {
    const DedicatedEntry& e = entries_[i];
    if (e.is_owner) states[i] = opt.get(e.param);
    by_root[static_cast<size_t>(OwnerPlan::slot_index(e.owner, mesh.shard_size()))].push_back(i);
  }
  const at::TensorOptions base = entries_.front().param.options();
  std::vector<bool> has(entries_.size(), false);
  for (int r = 0; r < dp.size(); ++r) {
    const std::vector<size_t>& mine = by_root[static_cast<size_t>(r)];
    if (mine.empty()) continue;
    std::vector<int64_t> h(2 * mine.size(), 0);
    if (dp.rank() == r)
      for (size_t j = 0; j < mine.size(); ++j)
        if (states[mine[j]].defined()) {
          h[2 * j] = 1;
          h[2 * j + 1] = states[mine[j]].step;
        }
    at::Tensor header = at::tensor(h, at::TensorOptions().dtype(at::kLong)).to(base.device());
    dp.broadcast(header, r,
                 kCheckpointWhat + "optimizer state headers of '" + entries_[mine.front()].name + "' and " +
                     std::to_string(mine.size() - 1) + " more from their owner (rank " +
                     std::to_string(dp.global_ranks()[static_cast<size_t>(r)]) + ")")
        .wait_host();
    const at::Tensor hc = header.cpu();
    const int64_t* hp = hc.data_ptr<int64_t>();
    for (size_t j = 0; j < mine.size(); ++j) {
      if (hp[2 * j] == 0) continue;
      has[mine[j]] = true;
      states[mine[j]].step = hp[2 * j + 1];
    }
  }
  std::vector<OwnedTensor> items;
  std::vector<std::pair<size_t, size_t>> slot;  // item -> (entry, field)
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (!has[i]) continue;
    const DedicatedEntry& e = entries_[i];
    states[i].tensors.resize(fields.size());
    if (fields.empty()) put(e.name, true, states[i]);
    for (size_t k = 0; k < fields.size(); ++k) {
      items.push_back({OwnerPlan::slot_index(e.owner, mesh.shard_size()), &e.name, e.shape, e.prec.optim,
                       e.is_owner ? states[i].tensors[k] : at::Tensor()});
      slot.emplace_back(i, k);
    }
  }
  std::vector<size_t> arrived(entries_.size(), 0);
  broadcast_from_owners(dp, items, base, kCheckpointWhat + "optimizer state of ", [&](size_t it, const at::Tensor& t) {
    const auto [i, k] = slot[it];
    states[i].tensors[k] = t;
    if (++arrived[i] < fields.size()) return;
    put(entries_[i].name, true, states[i]);
    states[i] = ParamState{};  // (a view keeps its pack alive)
  });
}

void DedicatedRoute::assign_state(OptimizerStateAccess& opt, const StateSource& get) {
  for (const auto& e : entries_) {
    if (!e.is_owner) continue;  // the owner takes the state; the others keep none
    std::optional<ParamState> s = get(e.name, true);
    if (!s) {
      opt.set(e.param, ParamState{});
      continue;
    }
    for (at::Tensor& t : s->tensors) t = to_state_tensor(t, e.param.device(), e.prec.optim);
    opt.set(e.param, std::move(*s));
  }
}

}  // namespace dmuon
