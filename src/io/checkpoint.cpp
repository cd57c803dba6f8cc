// Full state dicts and checkpoint files (see include/dmuon/checkpoint.h).
#include "dmuon/checkpoint.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/serialize/archive.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <set>
#include <sstream>

#include "runtime/state.h"

namespace dmuon {

namespace {


std::shared_ptr<DedicatedState> drained_state(torch::nn::Module& model, const char* fn) {
  auto st = detail::require_state(model, fn);
  st->wait_publishes();  // post-step publishes and all_gather-mode scatters
  st->drain_all();       // forward prefetches, pending reduces
  return st;
}

// Collects what the caller keeps: everything (rank0_only=false) or rank 0's copy only.
struct Sink {
  TensorDict& out;
  bool keep;
  bool cpu;
  void put(const std::string& key, const at::Tensor& v) const {
    if (!keep) return;
    at::Tensor t = v.detach();
    out[key] = cpu ? t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true) : t.clone();
  }
};

at::Tensor step_tensor(int64_t step) { return at::scalar_tensor(step, at::TensorOptions().dtype(at::kLong)); }

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

// A full tensor of `numel` elements (padded to L*G) from this rank's slice: all-gather over the shard group.
at::Tensor gather_slices(Communicator& comm, const at::Tensor& slice, int64_t numel, at::IntArrayRef shape,
                         const std::string& what) {
  at::Tensor full = at::empty({slice.numel() * comm.size()}, slice.options());
  comm.allgather_flat(full, slice.contiguous(), what).wait();
  return full.narrow(0, 0, numel).view(shape);
}

// This rank's slice [rank*L, (rank+1)*L) of a full tensor, zero-padded.
at::Tensor slice_of(const at::Tensor& full, int64_t shard_len, int shard_rank, int shards, const at::TensorOptions& o) {
  at::Tensor padded = at::zeros({shard_len * shards}, o);
  padded.narrow(0, 0, full.numel()).copy_(full.reshape(-1));
  return padded.narrow(0, static_cast<int64_t>(shard_rank) * shard_len, shard_len).clone();
}

// AdamW-trained parameters: replicated and sharded_adamw (every trainable one that is not a Muon matrix).
std::vector<std::pair<std::string, at::Tensor>> adamw_params(const torch::nn::Module& model, const DedicatedState& st) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model.named_parameters(true))
    if (item.value().requires_grad() && !st.param_index.count(item.key())) out.emplace_back(item.key(), item.value());
  return out;
}

}  // namespace

// ---- model ---------------------------------------------------------------------------------------
TensorDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options) {
  auto st = drained_state(model, "get_model_state_dict");
  std::lock_guard<std::recursive_mutex> g(st->mu);
  at::NoGradGuard ng;
  Mesh& mesh = *st->mesh;
  TensorDict out;
  const Sink sink{out, !options.rank0_only || mesh.global_rank() == 0, options.cpu_offload};
  // Muon matrices: from their (global) owner, in full precision
  for (auto& e : st->params) {
    at::Tensor t;
    if (e.is_owner) {
      auto m = st->masters.find(e.param.unsafeGetTensorImpl());
      t = m != st->masters.end() ? m->second : e.param.detach();
    } else {
      t = at::empty(e.shape, e.param.options().dtype(e.prec.master));
    }
    mesh.world().broadcast(t, e.owner_rank, "checkpoint: '" + e.name + "' from its owner").wait();
    sink.put(e.name, t);
  }
  // sharded_adamw: every shard rank's slice of the master
  for (auto& e : st->sharded)
    sink.put(e.name, gather_slices(mesh.shard(), e.shard, e.numel, e.shape, "checkpoint: slices of '" + e.name + "'"));
  // the rest is whole on every rank (the master where mixed precision keeps one)
  for (const auto& item : model.named_parameters(true)) {
    if (st->param_index.count(item.key()) || st->sharded_index.count(item.key())) continue;
    auto m = st->masters.find(item.value().unsafeGetTensorImpl());
    sink.put(item.key(), m != st->masters.end() ? m->second : item.value());
  }
  for (const auto& item : model.named_buffers(true)) sink.put(item.key(), item.value());
  return out;
}

void set_model_state_dict(torch::nn::Module& model, const TensorDict& sd) {
  auto st = drained_state(model, "set_model_state_dict");
  std::lock_guard<std::recursive_mutex> g(st->mu);
  at::NoGradGuard ng;
  Mesh& mesh = *st->mesh;
  const int rank = mesh.global_rank();
  std::map<std::string, std::vector<int64_t>> expected;
  std::map<std::string, bool> floating;
  for (const auto& item : model.named_parameters(true)) {
    expected[item.key()] = item.value().sizes().vec();
    floating[item.key()] = item.value().is_floating_point();
  }
  for (const auto& item : model.named_buffers(true)) floating[item.key()] = item.value().is_floating_point();
  for (const auto& e : st->params) expected[e.name] = e.shape;  // placeholders hold no shape
  for (const auto& e : st->sharded) expected[e.name] = e.shape;
  for (const auto& item : model.named_buffers(true)) expected[item.key()] = item.value().sizes().vec();
  for (const auto& [k, v] : sd) {
    TORCH_CHECK(expected.count(k), "rank ", rank, ": set_model_state_dict: unexpected key '", k,
                "': the model has no parameter or buffer of that name. Load a state dict of this model "
                "architecture (keys as in named_parameters()/named_buffers()).");
    TORCH_CHECK(v.defined() && v.sizes().vec() == expected[k], "rank ", rank, ": set_model_state_dict: '", k,
                "' has shape ", v.defined() ? shape_str(v.sizes()) : std::string("(undefined)"),
                " in the state dict but ", shape_str(expected[k]), " in the model.");
    TORCH_CHECK(v.is_floating_point() == floating[k], "rank ", rank, ": set_model_state_dict: '", k, "' is ",
                v.scalar_type(), " in the state dict but ", floating[k] ? "floating-point" : "not floating-point",
                " in the model.");
  }
  for (const auto& [k, shape] : expected)
    TORCH_CHECK(sd.count(k), "rank ", rank, ": set_model_state_dict: the state dict has no '", k, "' (shape ",
                shape_str(shape), "). Every rank must pass the full state dict, e.g. as read by load_checkpoint.");

  for (auto& e : st->params) {
    const at::Tensor& v = sd.at(e.name);
    auto& buf = st->boundaries[static_cast<size_t>(e.boundary)].buffers[static_cast<size_t>(e.buffer)];
    if (auto m = st->masters.find(e.param.unsafeGetTensorImpl()); m != st->masters.end()) m->second.copy_(v);
    // the ranks that hold the matrix between steps: its owner / holders, every rank on the DDP path
    if (buf.is_root || st->ddp) buf.views[static_cast<size_t>(e.slot_in_buffer)].copy_(v);
  }
  for (auto& B : st->boundaries)  // all_gather mode: every rank's shard of the new value
    for (auto& buf : B.buffers)
      if (buf.gather_mode) {
        at::Tensor src = buf.is_root ? buf.flat : at::empty({0}, buf.flat.options());
        mesh.shard().scatter_flat(buf.shard, src, buf.root, "checkpoint: shards of '" + B.name + "'").wait();
      }
  for (auto& e : st->sharded)
    e.shard.copy_(slice_of(sd.at(e.name), e.shard_len, mesh.shard_rank(), mesh.shard_size(), e.shard.options()));
  for (const auto& item : model.named_parameters(true)) {
    if (st->param_index.count(item.key()) || st->sharded_index.count(item.key())) continue;
    const at::Tensor& v = sd.at(item.key());
    if (auto m = st->masters.find(item.value().unsafeGetTensorImpl()); m != st->masters.end()) m->second.copy_(v);
    item.value().detach().copy_(v);
  }
  for (const auto& item : model.named_buffers(true)) item.value().detach().copy_(sd.at(item.key()));
  // nothing from before the load survives: gathered copies are refreshed by the next forward,
  // gradients are dropped
  for (auto& B : st->boundaries)
    for (auto& buf : B.buffers) buf.ready_pass = -1;
  for (auto& e : st->sharded) {
    e.ready_pass = -1;
    e.grad_sum = at::Tensor();
    e.has_grad = false;
  }
  for (const auto& item : model.named_parameters(true)) item.value().mutable_grad() = at::Tensor();
}

// ---- optimizer -----------------------------------------------------------------------------------
OptimizerStateDict get_optimizer_state_dict(torch::nn::Module& model, const Muon& optimizer,
                                            const StateDictOptions& options) {
  auto st = drained_state(model, "get_optimizer_state_dict");
  std::lock_guard<std::recursive_mutex> g(st->mu);
  at::NoGradGuard ng;
  Mesh& mesh = *st->mesh;
  OptimizerStateDict out;
  const bool keep = !options.rank0_only || mesh.global_rank() == 0;
  const Sink muon{out.muon, keep, options.cpu_offload}, adamw{out.adamw, keep, options.cpu_offload};
  for (const auto& group : optimizer.param_groups()) {
    const auto& o = static_cast<const MuonGroupOptions&>(group.options());
    if (keep)
      out.param_groups.push_back({o.group_name(), o.is_muon(), o.lr(), o.momentum(), o.weight_decay(), o.beta1(),
                                  o.beta2(), o.eps(), o.nesterov(), o.ns_steps()});
  }
  out.steps_taken = optimizer.steps_taken();
  // momentum buffers: a [has, step] header, then the buffer, from each owner
  for (auto& e : st->params) {
    at::Tensor header = at::zeros({2}, e.param.options().dtype(at::kLong));
    const MuonParamState* ps = e.is_owner ? optimizer.state_of(e.param) : nullptr;
    if (ps && ps->momentum_buffer().defined()) header = at::tensor({int64_t{1}, ps->step()}, header.options());
    mesh.world().broadcast(header, e.owner_rank, "checkpoint: momentum header of '" + e.name + "'").wait();
    const at::Tensor h = header.cpu();
    if (h[0].item<int64_t>() == 0) continue;
    at::Tensor buf = ps ? ps->momentum_buffer() : at::empty(e.shape, e.param.options().dtype(e.prec.optim));
    mesh.world().broadcast(buf, e.owner_rank, "checkpoint: momentum of '" + e.name + "'").wait();
    muon.put(e.name + ".momentum_buffer", buf);
    muon.put(e.name + ".step", step_tensor(h[1].item<int64_t>()));
  }
  // AdamW moments: whole on every rank, or gathered from the sharded_adamw slices
  for (const auto& [name, p] : adamw_params(model, *st)) {
    auto sh = st->sharded_index.find(name);
    const MuonParamState* ps = optimizer.state_of(p);
    const bool has = ps && ps->exp_avg().defined();  // the same on every rank: all step together
    if (!has) continue;
    if (sh == st->sharded_index.end()) {
      adamw.put(name + ".exp_avg", ps->exp_avg());
      adamw.put(name + ".exp_avg_sq", ps->exp_avg_sq());
    } else {
      const ShardedEntry& e = st->sharded[static_cast<size_t>(sh->second)];
      adamw.put(name + ".exp_avg", gather_slices(mesh.shard(), ps->exp_avg(), e.numel, e.shape,
                                                 "checkpoint: exp_avg slices of '" + name + "'"));
      adamw.put(name + ".exp_avg_sq", gather_slices(mesh.shard(), ps->exp_avg_sq(), e.numel, e.shape,
                                                    "checkpoint: exp_avg_sq slices of '" + name + "'"));
    }
    adamw.put(name + ".step", step_tensor(ps->step()));
  }
  if (!keep) out.steps_taken = 0;
  return out;
}

void set_optimizer_state_dict(torch::nn::Module& model, Muon& optimizer, const OptimizerStateDict& sd) {
  auto st = drained_state(model, "set_optimizer_state_dict");
  std::lock_guard<std::recursive_mutex> g(st->mu);
  at::NoGradGuard ng;
  Mesh& mesh = *st->mesh;
  const int rank = mesh.global_rank();
  const char* fix = " Build the model and the optimizer as in the run that saved it (same predicate, routes and "
                    "param_groups); the number of ranks and the mesh may differ.";
  // 1. check everything, on every rank, before changing anything
  auto& groups = optimizer.param_groups();
  TORCH_CHECK(sd.param_groups.size() == groups.size(), "rank ", rank, ": set_optimizer_state_dict: the state dict has ",
              sd.param_groups.size(), " parameter groups, the optimizer ", groups.size(),
              " (each user group lowers into a Muon and an AdamW group).", fix);
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& o = static_cast<const MuonGroupOptions&>(groups[i].options());
    const OptimizerGroupState& s = sd.param_groups[i];
    TORCH_CHECK(s.name == o.group_name() && s.is_muon == o.is_muon(), "rank ", rank,
                ": set_optimizer_state_dict: group #", i, " is '", s.name, "' (", s.is_muon ? "Muon" : "AdamW",
                ") in the state dict but '", o.group_name(), "' (", o.is_muon() ? "Muon" : "AdamW",
                ") in the optimizer.", fix);
  }
  std::set<std::string> used_muon, used_adamw;
  // a parameter's entries: all of `fields` and ".step", or none; shapes as the parameter's
  auto check_entries = [&](const TensorDict& d, std::set<std::string>& used, const std::string& name,
                           std::initializer_list<const char*> fields, at::IntArrayRef shape, const char* section) {
    int found = 0;
    for (const char* f : fields) {
      auto it = d.find(name + f);
      if (it == d.end()) continue;
      ++found;
      used.insert(it->first);
      TORCH_CHECK(it->second.sizes() == shape && it->second.is_floating_point(), "rank ", rank,
                  ": set_optimizer_state_dict: '", it->first, "' has shape ", shape_str(it->second.sizes()), " (",
                  it->second.scalar_type(), ") but the parameter has shape ", shape_str(shape), ".", fix);
    }
    if (found == 0) return false;
    TORCH_CHECK(found == static_cast<int>(fields.size()) && d.count(name + ".step"), "rank ", rank,
                ": set_optimizer_state_dict: the ", section, " state of '", name,
                "' is incomplete (some of its entries or '.step' are missing).");
    used.insert(name + ".step");
    return true;
  };
  std::vector<bool> muon_has;
  for (const auto& e : st->params)
    muon_has.push_back(check_entries(sd.muon, used_muon, e.name, {".momentum_buffer"}, e.shape, "Muon"));
  const auto base = adamw_params(model, *st);
  std::vector<bool> adamw_has;
  for (const auto& [name, p] : base) {
    auto sh = st->sharded_index.find(name);
    const auto shape = sh == st->sharded_index.end() ? p.sizes().vec() : st->sharded[static_cast<size_t>(sh->second)].shape;
    adamw_has.push_back(check_entries(sd.adamw, used_adamw, name, {".exp_avg", ".exp_avg_sq"}, shape, "AdamW"));
  }
  for (const auto& [k, v] : sd.muon)
    TORCH_CHECK(used_muon.count(k), "rank ", rank, ": set_optimizer_state_dict: Muon state '", k,
                "' belongs to no Muon matrix of this model (a parameter now routed elsewhere, or another model).", fix);
  for (const auto& [k, v] : sd.adamw)
    TORCH_CHECK(used_adamw.count(k), "rank ", rank, ": set_optimizer_state_dict: AdamW state '", k,
                "' belongs to no AdamW-trained parameter of this model (a parameter now routed to Muon, or "
                "another model).", fix);

  // 2. apply
  for (size_t i = 0; i < groups.size(); ++i) {
    auto& o = static_cast<MuonGroupOptions&>(groups[i].options());
    const OptimizerGroupState& s = sd.param_groups[i];
    o.lr(s.lr).momentum(s.momentum).weight_decay(s.weight_decay).beta1(s.beta1).beta2(s.beta2).eps(s.eps)
        .nesterov(s.nesterov).ns_steps(s.ns_steps);
  }
  auto to_state = [](const at::Tensor& v, const at::Tensor& like, at::ScalarType dtype) {
    return v.to(like.device(), dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
  };
  for (size_t i = 0; i < st->params.size(); ++i) {
    auto& e = st->params[i];
    if (!e.is_owner) continue;  // the new owner takes the momentum; others keep none
    MuonParamState& ps = optimizer.param_state(e.param);
    if (!muon_has[i]) {
      ps.momentum_buffer(at::Tensor()).step(0);
      continue;
    }
    ps.momentum_buffer(to_state(sd.muon.at(e.name + ".momentum_buffer"), e.param, e.prec.optim))
        .step(sd.muon.at(e.name + ".step").item<int64_t>());
  }
  for (size_t i = 0; i < base.size(); ++i) {
    const auto& [name, p] = base[i];
    MuonParamState& ps = optimizer.param_state(p);
    if (!adamw_has[i]) {
      ps.exp_avg(at::Tensor()).exp_avg_sq(at::Tensor()).step(0);
      continue;
    }
    const at::ScalarType dt = st->precision_of(p).optim;
    const at::Tensor &m1 = sd.adamw.at(name + ".exp_avg"), &m2 = sd.adamw.at(name + ".exp_avg_sq");
    auto sh = st->sharded_index.find(name);
    if (sh == st->sharded_index.end()) {
      ps.exp_avg(to_state(m1, p, dt)).exp_avg_sq(to_state(m2, p, dt));
    } else {  // this rank's slices
      const ShardedEntry& e = st->sharded[static_cast<size_t>(sh->second)];
      const auto o = e.shard.options().dtype(dt);
      ps.exp_avg(slice_of(m1, e.shard_len, mesh.shard_rank(), mesh.shard_size(), o))
          .exp_avg_sq(slice_of(m2, e.shard_len, mesh.shard_rank(), mesh.shard_size(), o));
    }
    ps.step(sd.adamw.at(name + ".step").item<int64_t>());
  }
  optimizer.set_steps_taken(sd.steps_taken);
}

}  // namespace dmuon
