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

#include "comm/error_text.h"
#include "dmuon/digest.h"
#include "dmuon/tensor_parallel.h"
#include "io/load_agreement.h"
#include "runtime/runtime_face.h"

namespace dmuon {

namespace {


std::shared_ptr<RuntimeFace> drained_state(torch::nn::Module& model, const char* fn) {
  auto st = detail::require_face(model, fn);
  st->drain(fn);  // post-step publishes, all_gather-mode scatters, prefetches, pending reduces
  return st;
}

// The optimizer state's fields as state dict keys ("<param>.<field>"): a Muon matrix's and an
// AdamW-trained parameter's.
const std::vector<std::string>& state_fields(bool muon) {
  static const std::vector<std::string> m{"momentum_buffer"}, a{"exp_avg", "exp_avg_sq"};
  return muon ? m : a;
}

// Tensor parallelism: state dicts hold full tensors, the routes of each TP rank hold slices. A key's
// split is its parameter's ("<param>", "<param>.momentum_buffer", "<param>.exp_avg", ...).
struct TpView {
  Mesh& mesh;
  const std::map<std::string, int>& split;  // parameter name -> split dimension (empty without a TP axis)
  explicit TpView(const RuntimeFace& rt) : mesh(rt.mesh()), split(rt.tp_split()) {}
  int dim_of(const std::string& key) const {
    if (split.empty()) return -1;
    if (auto it = split.find(key); it != split.end()) return it->second;
    for (bool muon : {true, false})
      for (const std::string& field : state_fields(muon)) {
        const std::string suffix = "." + field;
        if (key.size() > suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0)
          if (auto it = split.find(key.substr(0, key.size() - suffix.size())); it != split.end()) return it->second;
      }
    return -1;
  }
  // collective over the TP group for a split key (every rank puts the same keys in the same order)
  at::Tensor full(const std::string& key, const at::Tensor& local) const {
    const int d = dim_of(key);
    return d < 0 ? local : tp_gather(local, d, mesh);
  }
  // this TP rank's slices of a full state dict
  TensorDict local(const TensorDict& sd) const {
    if (split.empty()) return sd;
    TensorDict out = sd;
    for (auto& [k, v] : out) {
      const int d = dim_of(k);
      if (d < 0) continue;
      TORCH_CHECK_VALUE(v.dim() > d && v.size(d) % mesh.tp_size() == 0, "rank ", mesh.global_rank(), ": '", k, "' has shape ",
                  v.sizes(), " in the state dict, which cannot be split along dimension ", d, " into tp_size ",
                  mesh.tp_size(), " slices.");
      v = tp_slice(v, d, mesh.tp_rank(), mesh.tp_size());
    }
    return out;
  }
};

// Collects what the caller keeps: everything (rank0_only=false) or rank 0's copy only; TP slices
// are gathered into full tensors first.
struct Sink {
  TensorDict& out;
  bool keep;
  bool cpu;
  const TpView& tp;
  void put(const std::string& key, const at::Tensor& v) const {
    const at::Tensor whole = tp.full(key, v);
    if (!keep) return;
    at::Tensor t = whole.detach();
    out[key] = cpu ? t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true) : t.clone();
  }
};

at::Tensor step_tensor(int64_t step) { return at::scalar_tensor(step, at::TensorOptions().dtype(at::kLong)); }

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

// A tied parameter is one tensor under several names: the runtime knows it by its first name; model
// state dicts keep every name named_parameters() lists (alias -> first name).
std::vector<std::pair<std::string, std::string>> tied_aliases(const torch::nn::Module& model) {
  std::map<const c10::TensorImpl*, std::string> first;
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& item : model.named_parameters(true))
    if (auto [it, fresh] = first.emplace(item.value().unsafeGetTensorImpl(), item.key()); !fresh)
      out.emplace_back(item.key(), it->second);
  return out;
}

// The optimizer's per-parameter state as the runtime's routes see it.
class MuonStateReader final : public OptimizerStateReader {
 public:
  explicit MuonStateReader(const Muon& opt) : opt_(opt) {}
  const std::vector<std::string>& fields(bool muon) const override { return state_fields(muon); }
  ParamState get(const at::Tensor& param) const override { return read(opt_.state_of(param)); }

  static ParamState read(const MuonParamState* ps) {
    ParamState s;
    if (!ps) return s;
    s.step = ps->step();
    if (ps->momentum_buffer().defined()) s.tensors = {ps->momentum_buffer()};
    else if (ps->exp_avg().defined()) s.tensors = {ps->exp_avg(), ps->exp_avg_sq()};
    return s;
  }

 private:
  const Muon& opt_;
};

class MuonStateAccess final : public OptimizerStateAccess {
 public:
  explicit MuonStateAccess(Muon& opt) : opt_(opt) {}
  const std::vector<std::string>& fields(bool muon) const override { return state_fields(muon); }
  ParamState get(const at::Tensor& param) const override { return MuonStateReader::read(opt_.state_of(param)); }
  void set(const at::Tensor& param, ParamState s) override {
    MuonParamState& ps = detail::MuonInternals::param_state(opt_, param);
    const bool muon = s.tensors.size() == 1;
    ps.step(s.defined() ? s.step : 0);
    if (!s.defined()) {
      ps.momentum_buffer(at::Tensor()).exp_avg(at::Tensor()).exp_avg_sq(at::Tensor());
    } else if (muon) {
      ps.momentum_buffer(s.tensors[0]);
    } else {
      ps.exp_avg(s.tensors[0]).exp_avg_sq(s.tensors[1]);
    }
  }

 private:
  Muon& opt_;
};

}  // namespace

// ---- model ---------------------------------------------------------------------------------------
TensorDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options) {
  auto st = drained_state(model, "get_model_state_dict");
  at::NoGradGuard ng;
  Mesh& mesh = st->mesh();
  TensorDict out;
  const TpView tp(*st);
  const Sink sink{out, !options.rank0_only || mesh.global_rank() == 0, options.cpu_offload, tp};
  // Muon matrices from their (global) owner, sharded_adamw slices gathered: in full precision
  // Muon matrices from their (global) owner, sharded_adamw slices gathered, the rest whole (the
  // master where mixed precision keeps one): in full precision
  st->gather_params([&](const std::string& name, const at::Tensor& t) { sink.put(name, t); });
  for (const auto& [alias, name] : tied_aliases(model))
    if (auto it = out.find(name); it != out.end()) out[alias] = it->second;
  for (const auto& item : model.named_buffers(true)) sink.put(item.key(), item.value());
  return out;
}

namespace {
// Every parameter and buffer of a dedicated model with its full (single-process) shape, model order.
std::vector<std::pair<std::string, std::vector<int64_t>>> full_shapes_of(torch::nn::Module& model, const RuntimeFace& st) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out = st.param_shapes();
  const std::map<std::string, std::vector<int64_t>> by_name(out.begin(), out.end());
  for (const auto& [alias, name] : tied_aliases(model)) out.emplace_back(alias, by_name.at(name));
  for (const auto& item : model.named_buffers(true)) out.emplace_back(item.key(), item.value().sizes().vec());
  return out;
}

// Every rank takes what it keeps from `source` (checked already).
void assign_model(torch::nn::Module& model, RuntimeFace& st, ParamSource& source) {
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  for (const auto& item : model.named_buffers(true)) buffers.emplace_back(item.key(), item.value());
  st.assign_params(source, buffers, "set_model_state_dict");
}
}  // namespace

void set_model_state_dict(torch::nn::Module& model, const TensorDict& sd) {
  auto st = drained_state(model, "set_model_state_dict");
  at::NoGradGuard ng;
  const int rank = st->mesh().global_rank();
  auto check = [&] {
    std::map<std::string, std::vector<int64_t>> expected;
    for (const auto& [k, shape] : full_shapes_of(model, *st)) expected[k] = shape;
    std::map<std::string, bool> floating;
    for (const auto& item : model.named_parameters(true)) floating[item.key()] = item.value().is_floating_point();
    for (const auto& item : model.named_buffers(true)) floating[item.key()] = item.value().is_floating_point();
    for (const auto& [k, v] : sd) {
      TORCH_CHECK_VALUE(expected.count(k), "rank ", rank, ": set_model_state_dict: unexpected key '", k,
                  "': the model has no parameter or buffer of that name. Load a state dict of this model "
                  "architecture (keys as in named_parameters()/named_buffers()).");
      TORCH_CHECK_VALUE(v.defined() && v.sizes().vec() == expected[k], "rank ", rank, ": set_model_state_dict: '", k,
                  "' has shape ", v.defined() ? shape_str(v.sizes()) : std::string("(undefined)"),
                  " in the state dict but ", shape_str(expected[k]), " in the model.");
      TORCH_CHECK_VALUE(v.is_floating_point() == floating[k], "rank ", rank, ": set_model_state_dict: '", k, "' is ",
                  v.scalar_type(), " in the state dict but ", floating[k] ? "floating-point" : "not floating-point",
                  " in the model.");
    }
    for (const auto& [k, shape] : expected)
      TORCH_CHECK_VALUE(sd.count(k), "rank ", rank, ": set_model_state_dict: the state dict has no '", k, "' (shape ",
                  shape_str(shape), "). Every rank must pass the full state dict, e.g. as read by load_checkpoint.");
  };
  io::agree_load(st->mesh(), "set_model_state_dict", check, [&] {
    std::vector<io::LoadEntry> out;
    for (const auto& [k, v] : sd) out.emplace_back("'" + k + "'", io::tensor_digest(v));
    return out;
  });
  auto source = tensor_dict_source(sd);
  assign_model(model, *st, *source);
}

void set_model_state_dict(torch::nn::Module& model, ParamSource& source) {
  auto st = drained_state(model, "set_model_state_dict");
  at::NoGradGuard ng;
  // (each rank reads its own share later: the source's identity and a refusal are agreed here, the fills agree
  // their reads)
  io::agree_load(st->mesh(), "set_model_state_dict", [&] {
    try {
      source.check(full_shapes_of(model, *st));
    } catch (const std::exception& e) {
      TORCH_CHECK_VALUE(false, "rank ", st->mesh().global_rank(), ": set_model_state_dict: ", detail::error_text(e));
    }
  }, [&] {  // what the source is, known without reading it: a stale copy of a file on one rank is refused
    return std::vector<io::LoadEntry>{{"the source's tensors (names, dtypes, shapes, recorded checksums)", source.digest()}};
  });
  assign_model(model, *st, source);
}

// ---- optimizer -----------------------------------------------------------------------------------
void check_optimizer_state_dict(const OptimizerStateDict& sd, const std::string& where) {
  for (size_t i = 0; i < sd.param_groups.size(); ++i) {
    const OptimizerGroupState& g = sd.param_groups[i];
    MuonGroupOptions o(g.lr);
    o.is_muon(g.is_muon).weight_decay(g.weight_decay).momentum(g.momentum).ns_steps(g.ns_steps).beta1(g.beta1)
        .beta2(g.beta2).eps(g.eps);
    check_group_options(o, where + ": param_groups[" + std::to_string(i) + "] ('" + g.name + "', " +
                               (g.is_muon ? "Muon" : "AdamW") + ")");
  }
  TORCH_CHECK_VALUE(sd.steps_taken >= 0, where, ": steps_taken is ", sd.steps_taken, "; a step count must be >= 0.");
  for (const TensorDict* d : {&sd.muon, &sd.adamw})
    for (const auto& [k, v] : *d) {
      const bool is_step = k.size() > 5 && k.compare(k.size() - 5, 5, ".step") == 0;
      if (is_step) {
        TORCH_CHECK_VALUE(v.defined() && v.numel() == 1 && !v.is_floating_point() && !v.is_complex(), where, ": '", k,
                    "' is not a step count (one integer).");
        const int64_t step = v.item<int64_t>();
        TORCH_CHECK_VALUE(step >= 0, where, ": '", k, "' is ", step, "; a step count must be >= 0.");
        continue;
      }
      TORCH_CHECK_VALUE(v.defined() && v.is_floating_point(), where, ": optimizer state '", k, "' is not a floating-point tensor.");
      const at::Tensor bad = at::logical_not(at::isfinite(v.detach()));
      if (const int64_t n = bad.sum().item<int64_t>(); n > 0)
        TORCH_CHECK_VALUE(false, where, ": optimizer state '", k, "' holds ", n, " non-finite value(s) (NaN or inf) of ",
                    v.numel(), "; the run that wrote it had diverged. Resume from an earlier checkpoint.");
      const bool second_moment = k.size() > 11 && k.compare(k.size() - 11, 11, ".exp_avg_sq") == 0;
      TORCH_CHECK_VALUE(!second_moment || v.numel() == 0 || v.min().item<double>() >= 0, where, ": optimizer state '", k,
                  "' has negative values (", v.min().item<double>(), "); a second moment is >= 0.");
    }
}

namespace {
// What the ranks compare before an optimizer state dict loads: every group's hyperparameters, the
// step count and every state tensor.
std::vector<io::LoadEntry> optimizer_summary(const OptimizerStateDict& sd) {
  std::vector<io::LoadEntry> out;
  for (size_t i = 0; i < sd.param_groups.size(); ++i) {
    const OptimizerGroupState& g = sd.param_groups[i];
    Fnv1a h;
    h.str(g.name);
    for (double v : {g.lr, g.momentum, g.weight_decay, g.beta1, g.beta2, g.eps}) h.f64(v);
    for (int64_t v : {int64_t{g.is_muon}, int64_t{g.nesterov}, g.ns_steps}) h.i64(v);
    out.emplace_back("param_groups[" + std::to_string(i) + "] ('" + g.name + "', " + (g.is_muon ? "Muon" : "AdamW") + ")", h.value());
  }
  out.emplace_back("steps_taken", static_cast<uint64_t>(sd.steps_taken));
  Fnv1a stateless;
  for (const std::string& n : sd.without_state) stateless.str(n);
  out.emplace_back("without_state", stateless.value());
  for (const auto& [k, v] : sd.muon) out.emplace_back("Muon state '" + k + "'", io::tensor_digest(v));
  for (const auto& [k, v] : sd.adamw) out.emplace_back("AdamW state '" + k + "'", io::tensor_digest(v));
  return out;
}
}  // namespace

OptimizerStateDict get_optimizer_state_dict(torch::nn::Module& model, const Muon& optimizer,
                                            const StateDictOptions& options) {
  return get_optimizer_state_dict(detail::require_face(model, "get_optimizer_state_dict"), optimizer, options);
}

OptimizerStateDict get_optimizer_state_dict(const std::shared_ptr<RuntimeFace>& runtime, const Muon& optimizer,
                                            const StateDictOptions& options) {
  TORCH_CHECK_VALUE(runtime, "get_optimizer_state_dict: the runtime is null (dedicate_model_view returns it).");
  const std::shared_ptr<RuntimeFace>& st = runtime;
  st->drain("get_optimizer_state_dict");  // post-step publishes, all_gather-mode scatters, prefetches, pending reduces
  at::NoGradGuard ng;
  Mesh& mesh = st->mesh();
  OptimizerStateDict out;
  const bool keep = !options.rank0_only || mesh.global_rank() == 0;
  const TpView tp(*st);
  const Sink muon{out.muon, keep, options.cpu_offload, tp}, adamw{out.adamw, keep, options.cpu_offload, tp};
  for (const auto& group : optimizer.param_groups()) {
    const auto& o = static_cast<const MuonGroupOptions&>(group.options());
    if (keep)
      out.param_groups.push_back({o.group_name(), o.is_muon(), o.lr(), o.momentum(), o.weight_decay(), o.beta1(),
                                  o.beta2(), o.eps(), o.nesterov(), o.ns_steps()});
  }
  out.steps_taken = optimizer.steps_taken();
  // Muon momentum from each matrix's owner, AdamW moments whole or gathered from the slices
  const MuonStateReader access(optimizer);
  std::set<std::string> with_state;
  st->gather_state(access, [&](const std::string& name, bool is_muon, const ParamState& full) {
    const Sink& sink = is_muon ? muon : adamw;
    const std::vector<std::string>& fields = access.fields(is_muon);
    for (size_t k = 0; k < fields.size(); ++k) sink.put(name + "." + fields[k], full.tensors[k]);
    sink.put(name + ".step", step_tensor(full.step));
    with_state.insert(name);
  });
  // A parameter the optimizer keeps that has no state yet (no step so far, frozen, no gradient yet) is in its
  // section too, as its first step would start it (zeros, step 0), beside its without_state entry: the dict holds
  // every key whatever the training did, so a loader that fills only the keys of its template
  // (torch.distributed.checkpoint, into a new optimizer whose dict is all such entries) finds each of them;
  // set_optimizer_state_dict takes such an entry as fresh state.
  if (keep) {
    std::map<std::string, std::vector<int64_t>> shapes;  // full (TP: not this rank's slice)
    for (auto& [name, shape] : st->param_shapes()) shapes.emplace(name, std::move(shape));
    for (const StateSlot& slot : st->state_slots()) {
      if (with_state.count(slot.name)) continue;
      const at::TensorOptions o =
          at::TensorOptions().dtype(slot.dtype).device(options.cpu_offload ? at::Device(at::kCPU) : slot.device);
      TensorDict& d = slot.muon ? out.muon : out.adamw;
      for (const std::string& f : access.fields(slot.muon)) d[slot.name + "." + f] = at::zeros(shapes.at(slot.name), o);
      d[slot.name + ".step"] = step_tensor(0);
    }
  }
  if (keep)  // (frozen ones too: a parameter frozen now may be trained when this resumes)
    for (const auto& [name, shape] : st->param_shapes())
      if (!with_state.count(name)) out.without_state.push_back(name);
  if (!keep) out.steps_taken = 0;
  return out;
}

namespace {
// A parameter's entry that is fresh state: step 0 and every field zero (what get_optimizer_state_dict lists
// for an optimizer that has not stepped). Read from the full tensors, so every TP rank decides alike.
bool fresh_entry(const TensorDict& d, const std::string& name, bool muon) {
  if (d.at(name + ".step").item<int64_t>() != 0) return false;
  for (const std::string& f : state_fields(muon))
    if (d.at(name + "." + f).count_nonzero().item<int64_t>() != 0) return false;
  return true;
}
}  // namespace

void set_optimizer_state_dict(torch::nn::Module& model, Muon& optimizer, const OptimizerStateDict& full_sd) {
  set_optimizer_state_dict(detail::require_face(model, "set_optimizer_state_dict"), optimizer, full_sd);
}

void set_optimizer_state_dict(const std::shared_ptr<RuntimeFace>& runtime, Muon& optimizer,
                              const OptimizerStateDict& full_sd) {
  TORCH_CHECK_VALUE(runtime, "set_optimizer_state_dict: the runtime is null (dedicate_model_view returns it).");
  const std::shared_ptr<RuntimeFace>& st = runtime;
  st->drain("set_optimizer_state_dict");
  at::NoGradGuard ng;
  const int rank = st->mesh().global_rank();
  auto& groups = optimizer.param_groups();
  OptimizerStateDict sd;
  MuonStateAccess access(optimizer);
  std::vector<StateSlot> slots;
  std::vector<bool> has;  // per slot: the state dict holds its state
  // 1. check everything, on every rank, before changing anything; the ranks agree on the outcome and on the dict
  auto check = [&] {
    check_optimizer_state_dict(full_sd, "rank " + std::to_string(st->mesh().global_rank()) + ": set_optimizer_state_dict");
    sd = full_sd;  // TP: this rank's slices
    {
      const TpView tp(*st);
      sd.muon = tp.local(full_sd.muon);
      sd.adamw = tp.local(full_sd.adamw);
    }
    const char* fix = " Build the model and the optimizer as in the run that saved it (same predicate, routes and "
                      "param_groups); the number of ranks and the mesh may differ.";
    TORCH_CHECK_VALUE(sd.param_groups.size() == groups.size(), "rank ", rank, ": set_optimizer_state_dict: the state dict has ",
                sd.param_groups.size(), " parameter groups, the optimizer ", groups.size(),
                " (each user group lowers into a Muon and an AdamW group).", fix);
    for (size_t i = 0; i < groups.size(); ++i) {
      const auto& o = static_cast<const MuonGroupOptions&>(groups[i].options());
      const OptimizerGroupState& s = sd.param_groups[i];
      TORCH_CHECK_VALUE(s.name == o.group_name() && s.is_muon == o.is_muon(), "rank ", rank,
                  ": set_optimizer_state_dict: group #", i, " is '", s.name, "' (", s.is_muon ? "Muon" : "AdamW",
                  ") in the state dict but '", o.group_name(), "' (", o.is_muon() ? "Muon" : "AdamW",
                  ") in the optimizer.", fix);
    }
    std::set<std::string> used_muon, used_adamw;
    // a parameter's entries: all of `fields` and ".step", or none; shapes as the parameter's
    auto check_entries = [&](const TensorDict& d, std::set<std::string>& used, const std::string& name,
                             bool muon, at::IntArrayRef shape) {
      const char* section = muon ? "Muon" : "AdamW";
      int found = 0;
      for (const std::string& f : state_fields(muon)) {
        auto it = d.find(name + "." + f);
        if (it == d.end()) continue;
        ++found;
        used.insert(it->first);
        TORCH_CHECK_VALUE(it->second.sizes() == shape && it->second.is_floating_point(), "rank ", rank,
                    ": set_optimizer_state_dict: '", it->first, "' has shape ", shape_str(it->second.sizes()), " (",
                    it->second.scalar_type(), ") but the parameter has shape ", shape_str(shape), ".", fix);
      }
      const bool has_step = d.count(name + ".step") > 0;
      if (found == 0 && !has_step) return false;
      std::string missing;
      for (const std::string& f : state_fields(muon))
        if (!d.count(name + "." + f)) missing += (missing.empty() ? "'" : ", '") + name + "." + f + "'";
      if (!has_step) missing += (missing.empty() ? "'" : ", '") + name + ".step'";
      TORCH_CHECK_VALUE(missing.empty(), "rank ", rank, ": set_optimizer_state_dict: the ", section, " state of '", name,
                  "' is incomplete: ", missing, " missing.");
      used.insert(name + ".step");
      return true;
    };
    slots = st->state_slots();
    std::set<std::string> stateless(sd.without_state.begin(), sd.without_state.end());
    std::set<std::string> names;
    for (const auto& [name, shape] : st->param_shapes()) names.insert(name);
    for (const StateSlot& slot : slots) {
      has.push_back(slot.muon ? check_entries(sd.muon, used_muon, slot.name, true, slot.shape)
                              : check_entries(sd.adamw, used_adamw, slot.name, false, slot.shape));
      TORCH_CHECK_VALUE(!(has.back() && stateless.count(slot.name)) || fresh_entry(slot.muon ? full_sd.muon : full_sd.adamw,
                                                                                    slot.name, slot.muon),
                        "rank ", rank, ": set_optimizer_state_dict: '", slot.name, "' is listed as without state "
                        "(without_state) but the ", slot.muon ? "Muon" : "AdamW", " section holds its state; the state "
                        "dict contradicts itself (damaged or edited).");
    }
    // zeros at step 0: the state a first step starts from (the entry of a parameter without state, beside its
    // without_state entry; every entry of a new optimizer's dict). After a step, one that without_state does not
    // name was never filled in: the dict says the parameter had state.
    for (size_t i = 0; i < slots.size(); ++i) {
      if (!has[i] || !fresh_entry(slots[i].muon ? full_sd.muon : full_sd.adamw, slots[i].name, slots[i].muon)) continue;
      has[i] = false;
      TORCH_CHECK_VALUE(sd.steps_taken == 0 || !slots[i].required || stateless.count(slots[i].name), "rank ", rank,
                        ": set_optimizer_state_dict: '", slots[i].name, "' holds zeros at step 0 (no state) in a state "
                        "dict at step ", sd.steps_taken, ", and without_state does not name it: the dict says it had "
                        "state, and its entry was never filled in -- a loader that fills only its template's keys "
                        "(torch.distributed.checkpoint with allow_partial_load=True) given a checkpoint of another "
                        "layout (FSDP2's fully_shard on one side, dmuon's replicate or sharded_adamw on the other) or "
                        "of another model. Read such a checkpoint whole (torch.distributed.checkpoint.format_utils."
                        "dcp_to_torch_save, then torch.load) and load its optimizer dict.");
      stateless.insert(slots[i].name);
    }
    for (const std::string& n : stateless)
      TORCH_CHECK_VALUE(names.count(n), "rank ", rank, ": set_optimizer_state_dict: without_state names '", n,
                        "', which is no parameter of this model (another model).", fix);
    for (const auto& [k, v] : sd.muon)
      TORCH_CHECK_VALUE(used_muon.count(k), "rank ", rank, ": set_optimizer_state_dict: Muon state '", k,
                  "' belongs to no Muon matrix of this model (a parameter now routed elsewhere, or another model).", fix);
    for (const auto& [k, v] : sd.adamw)
      TORCH_CHECK_VALUE(used_adamw.count(k), "rank ", rank, ": set_optimizer_state_dict: AdamW state '", k,
                  "' belongs to no AdamW-trained parameter of this model (a parameter now routed to Muon, or "
                  "another model).", fix);

    // after a step every trained parameter has its state: a missing one would restart from nothing, silently
    if (sd.steps_taken > 0) {
      std::vector<std::string> missing;
      for (size_t i = 0; i < slots.size(); ++i)
        if (!has[i] && slots[i].required && !stateless.count(slots[i].name)) {
          std::string fields;
          for (const std::string& f : state_fields(slots[i].muon)) fields += (fields.empty() ? "" : ", ") + f;
          missing.push_back(slots[i].name + (slots[i].muon ? " (Muon " : " (AdamW ") + fields + ")");
        }
      if (!missing.empty()) {
        std::string list;
        for (size_t i = 0; i < missing.size() && i < 5; ++i) list += (i ? ", '" : "'") + missing[i] + "'";
        if (missing.size() > 5) list += " and " + std::to_string(missing.size() - 5) + " more";
        TORCH_CHECK_VALUE(false, "rank ", rank, ": set_optimizer_state_dict: the state dict is at step ", sd.steps_taken,
                    " but holds no optimizer state for ", missing.size(), " trained parameter(s): ", list,
                    ", nor lists them as without state (without_state: frozen or without a gradient when it was "
                    "taken). Loading it would restart them from fresh state; the state dict is incomplete (damaged "
                    "or written by another tool).");
      }
    }
  };
  io::agree_load(st->mesh(), "set_optimizer_state_dict", check, [&] { return optimizer_summary(full_sd); });

  // 2. apply
  for (size_t i = 0; i < groups.size(); ++i) {
    auto& o = static_cast<MuonGroupOptions&>(groups[i].options());
    const OptimizerGroupState& s = sd.param_groups[i];
    o.lr(s.lr).momentum(s.momentum).weight_decay(s.weight_decay).beta1(s.beta1).beta2(s.beta2).eps(s.eps)
        .nesterov(s.nesterov).ns_steps(s.ns_steps);
  }
  // each rank that updates a parameter takes its state (its slice for sharded_adamw); the others none
  std::map<std::string, size_t> slot_of;
  for (size_t i = 0; i < slots.size(); ++i) slot_of[slots[i].name] = i;
  st->assign_state(access, [&](const std::string& name, bool is_muon) -> std::optional<ParamState> {
    if (!has[slot_of.at(name)]) return std::nullopt;
    const TensorDict& d = is_muon ? sd.muon : sd.adamw;
    ParamState s;
    for (const std::string& f : access.fields(is_muon)) s.tensors.push_back(d.at(name + "." + f));
    s.step = d.at(name + ".step").item<int64_t>();
    return s;
  });
  detail::MuonInternals::set_steps_taken(optimizer, sd.steps_taken);
}

}  // namespace dmuon
