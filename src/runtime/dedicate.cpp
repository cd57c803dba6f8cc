// dedicate_params: plan owners, install placeholders, register boundaries and hooks.
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <sstream>

#include "runtime/state.h"

#if DMUON_WITH_CUDA
#include <ATen/native/cuda/Resize.h>
#endif

namespace dmuon {

// ---- registry --------------------------------------------------------------------------------------
namespace detail {
namespace {
struct ModelEntry {
  std::weak_ptr<torch::nn::Module> model;
  std::shared_ptr<DedicatedState> state;
};
struct BoundaryEntry {
  std::weak_ptr<torch::nn::Module> module;
  std::weak_ptr<DedicatedState> state;
  int boundary = 0;
};
std::mutex g_registry_mu;
std::map<const torch::nn::Module*, ModelEntry>& models() {
  static std::map<const torch::nn::Module*, ModelEntry> m;
  return m;
}
std::map<const torch::nn::Module*, BoundaryEntry>& boundary_map() {
  static std::map<const torch::nn::Module*, BoundaryEntry> m;
  return m;
}
void prune_locked() {
  for (auto it = models().begin(); it != models().end();) it = it->second.model.expired() ? models().erase(it) : ++it;
  for (auto it = boundary_map().begin(); it != boundary_map().end();)
    it = (it->second.module.expired() || it->second.state.expired()) ? boundary_map().erase(it) : ++it;
}
}  // namespace

std::shared_ptr<DedicatedState> state_of_model(const torch::nn::Module* model) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto it = models().find(model);
  if (it == models().end()) return nullptr;
  auto live = it->second.model.lock();
  if (!live || live.get() != model) return nullptr;
  return it->second.state;
}

std::pair<std::shared_ptr<DedicatedState>, int> boundary_of_module(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  auto it = boundary_map().find(module);
  if (it == boundary_map().end()) return {nullptr, -1};
  auto live = it->second.module.lock();
  auto st = it->second.state.lock();
  if (!live || !st || live.get() != module) return {nullptr, -1};
  return {st, it->second.boundary};
}

void register_state(const std::shared_ptr<torch::nn::Module>& model, const std::shared_ptr<DedicatedState>& state) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  prune_locked();
  models()[model.get()] = ModelEntry{model, state};
}

void register_boundary(const std::shared_ptr<torch::nn::Module>& module, const std::shared_ptr<DedicatedState>& s,
                       int b) {
  std::lock_guard<std::mutex> g(g_registry_mu);
  boundary_map()[module.get()] = BoundaryEntry{module, s, b};
}

std::shared_ptr<torch::autograd::Node> on_grad_accumulated(const at::Tensor& param, const std::string& name, int rank,
                                                           std::function<void()> fn) {
  auto acc = torch::autograd::impl::grad_accumulator(param);
  TORCH_CHECK(acc, "rank ", rank, ": could not get the gradient accumulator of '", name,
              "' (is it a leaf that requires grad?).");
  acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [fn = std::move(fn)](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
        fn();
        return outputs;
      }));
  return acc;
}

std::shared_ptr<DedicatedState> require_state(const torch::nn::Module& model, const char* fn) {
  auto s = state_of_model(&model);
  TORCH_CHECK(s, fn, ": this model was not dedicated; call dmuon::dedicate_params (or dedicate_params_ddp) "
              "first.");
  return s;
}

void resize_storage_bytes(const at::Tensor& t, size_t bytes) {
  c10::StorageImpl* si = t.storage().unsafeGetStorageImpl();
  if (si->nbytes() == bytes) return;
#if DMUON_WITH_CUDA
  if (t.is_cuda()) {
    at::native::resize_bytes_cuda(si, bytes);
    return;
  }
#endif
  at::native::resize_bytes_cpu(si, bytes);
}
}  // namespace detail

// ---- state ---------------------------------------------------------------------------------------
DedicatedState::DedicatedState(std::shared_ptr<torch::nn::Module> m, std::shared_ptr<Mesh> me, DedicateOptions o)
    : model(m), mesh(std::move(me)), opts(std::move(o)) {}

namespace {

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

const char* route_list() {
  return "Routes: \"muon\" (dedicated ownership + Newton-Schulz), \"adamw\" (replicated, AdamW) and "
         "\"sharded_adamw\" (1/N per rank, AdamW on the shard).";
}
bool valid_route(const std::string& r) { return r == "muon" || r == "adamw" || r == "sharded_adamw"; }

// Sets in `into` every field `o` has.
void merge_policy(ParamPolicy& into, const ParamPolicy& o) {
  if (o.route) into.route = o.route;
  if (!o.muon_forward_unshard.empty()) into.muon_forward_unshard = o.muon_forward_unshard;
  if (o.param_dtype) into.param_dtype = o.param_dtype;
  if (o.grad_dtype) into.grad_dtype = o.grad_dtype;
  if (o.master_dtype) into.master_dtype = o.master_dtype;
  if (o.optim_dtype) into.optim_dtype = o.optim_dtype;
  if (o.cast_forward_inputs) into.cast_forward_inputs = o.cast_forward_inputs;
  if (o.output_dtype) into.output_dtype = o.output_dtype;
}

// The policy of `name`: param_policy_fn's answer, or every matching override merged in order
// (empty when nothing matched).
ParamPolicy policy_for(const DedicateOptions& opts, const std::string& name, const at::Tensor& p, int rank) {
  TORCH_CHECK(opts.param_policy.empty() || !opts.param_policy_fn, "rank ", rank,
              ": dedicate_params: param_policy and param_policy_fn are mutually exclusive; pass one of them.");
  ParamPolicy pol;
  if (opts.param_policy_fn)
    if (auto r = opts.param_policy_fn(name, p)) pol = *r;
  for (const auto& ov : opts.param_policy) {
    std::istringstream tokens(ov.match);
    std::string tok;
    bool all = true;
    while (tokens >> tok) all = all && name.find(tok) != std::string::npos;
    if (all) merge_policy(pol, ov.policy);
  }
  if (pol.route)
    TORCH_CHECK(valid_route(*pol.route), "rank ", rank, ": dedicate_params: parameter '", name, "' has route '",
                *pol.route, "', which does not exist. ", route_list());
  return pol;
}

// 1: half/bfloat16, 2: float, 3: double.
int float_rank(at::ScalarType t) { return t == at::kDouble ? 3 : t == at::kFloat ? 2 : 1; }
bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Applies the defaults to the policy's dtype fields and checks they can work. `muon`: the parameter
// is a dedicated matrix (compute_dtype is its default reduce dtype). `frozen`: no gradient, no
// optimizer: only param_dtype applies.
Precision resolve_precision(const ParamPolicy& pol, const DedicateOptions& opts, const std::string& name,
                            const at::Tensor& p, bool muon, bool frozen, int rank) {
  auto check = [&](const std::optional<at::ScalarType>& t, const char* field) {
    TORCH_CHECK(!t || is_float(*t), "rank ", rank, ": dedicate_params: param_policy of '", name, "' sets ", field,
                " = ", *t, ", which cannot hold parameters, gradients or optimizer state; use a floating type "
                "(bfloat16, float16, float32 or float64).");
  };
  check(pol.param_dtype, "param_dtype");
  check(pol.grad_dtype, "grad_dtype");
  check(pol.master_dtype, "master_dtype");
  check(pol.optim_dtype, "optim_dtype");
  check(pol.output_dtype, "output_dtype");
  const at::ScalarType own = p.scalar_type();
  TORCH_CHECK(!(pol.param_dtype || pol.master_dtype || pol.grad_dtype || pol.optim_dtype) || is_float(own), "rank ",
              rank, ": dedicate_params: param_policy sets dtypes for '", name, "', whose dtype is ", own,
              "; mixed precision applies to floating-point parameters only.");
  Precision pr;
  pr.param = pol.param_dtype.value_or(own);
  if (frozen) {
    pr.master = pr.reduce = pr.optim = pr.param;
    return pr;
  }
  // default master: the more precise of the parameter's own dtype and param_dtype (float32 when
  // they are the two 16-bit types)
  at::ScalarType def_master = own;
  if (pr.param != own)
    def_master = float_rank(own) > float_rank(pr.param)   ? own
                 : float_rank(pr.param) > float_rank(own) ? pr.param
                                                          : at::kFloat;
  pr.master = pol.master_dtype.value_or(def_master);
  pr.reduce = pol.grad_dtype ? *pol.grad_dtype : (muon && opts.compute_dtype) ? *opts.compute_dtype : pr.param;
  pr.optim = pol.optim_dtype.value_or(pr.master);
  TORCH_CHECK(pr.master == pr.param || float_rank(pr.master) > float_rank(pr.param), "rank ", rank,
              ": dedicate_params: param_policy of '", name, "' has master_dtype ", pr.master, " and param_dtype ",
              pr.param, ": the master copy must be at least as precise as the parameter (every update would be "
              "rounded away). Use master_dtype float32 (the usual choice) or leave it unset.");
  return pr;
}

// Digest of a precision (part of the cross-rank plan check).
uint64_t precision_digest(const Precision& pr) {
  uint64_t h = 1469598103934665603ull;
  for (int v : {static_cast<int>(pr.param), static_cast<int>(pr.reduce), static_cast<int>(pr.master),
                static_cast<int>(pr.optim)}) {
    h ^= static_cast<uint64_t>(v) + 1;
    h *= 1099511628211ull;
  }
  return h;
}

// The floating dtype a boundary's forward casts to (input or output): every parameter of the
// boundary that asks for one must ask for the same.
void merge_boundary_dtype(std::map<std::string, std::pair<at::ScalarType, std::string>>& by_boundary,
                          const std::string& boundary, at::ScalarType t, const std::string& param, const char* what,
                          int rank) {
  auto [it, fresh] = by_boundary.emplace(boundary, std::make_pair(t, param));
  TORCH_CHECK(fresh || it->second.first == t, "rank ", rank, ": dedicate_params: parameters '", it->second.second,
              "' and '", param, "' share hook boundary '", boundary, "' but their param_policy asks for different ",
              what, " (", it->second.first, " vs ", t, "). A boundary casts its forward once; give its parameters "
              "the same policy, or set cast_forward_inputs=false / output_dtype on one of them only.");
}

// Ancestors of "a.b.c.weight", lowest first: "a.b.c", "a.b", "a", "".
std::vector<std::string> ancestors_of(const std::string& param_name) {
  std::vector<std::string> out;
  std::string s = param_name;
  for (;;) {
    const auto dot = s.rfind('.');
    if (dot == std::string::npos) {
      out.push_back("");
      return out;
    }
    s = s.substr(0, dot);
    out.push_back(s);
  }
}

}  // namespace

void DedicatedState::build(const ParamPredicate& predicate) {
  auto m = model.lock();
  const int rank = mesh->global_rank();
  TORCH_CHECK(static_cast<bool>(predicate), "rank ", rank, ": dedicate_params: the predicate is empty. Pass a "
              "function (name, param) -> bool that selects the Muon matrices, e.g. 2-D weights of layers.");
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& item : m->named_modules("", /*include_self=*/true)) modules[item.key()] = item.value();

  // 1. select and route; resolve every routed parameter's hook boundary
  std::vector<ParamSpec> specs;
  std::vector<std::string> boundary_names;
  std::vector<std::pair<std::string, std::string>> sharded_sel;  // (param name, boundary)
  std::set<std::string> gather_names;                             // Muon params in all_gather mode
  std::vector<std::string> boundary_order;                        // first appearance, model order
  auto resolve_boundary = [&](const std::string& name, const at::Tensor& p) {
    std::string boundary;
    bool found = false;
    if (opts.hook_boundary_resolver) {
      boundary = opts.hook_boundary_resolver(name, p);
      TORCH_CHECK(modules.count(boundary), "rank ", rank, ": dedicate_params: hook_boundary_resolver returned '",
                  boundary, "' for parameter '", name, "', which is not a module of the model (named_modules()).");
      found = true;
    } else if (opts.hook_boundary_predicate) {
      for (const auto& a : ancestors_of(name)) {
        auto it = modules.find(a);
        if (it != modules.end() && opts.hook_boundary_predicate(a, *it->second)) {
          boundary = a;
          found = true;
          break;
        }
      }
      TORCH_CHECK(found || !opts.hook_boundary_strict, "rank ", rank, ": dedicate_params: no ancestor module of '",
                  name, "' matches hook_boundary_predicate (strict mode). Widen the predicate so it selects the "
                  "block that contains this parameter, or set hook_boundary_strict=false to fall back to its "
                  "direct parent module.");
    } else {
      const std::string key = layer_key_of(name);
      if (!key.empty() && modules.count(key)) {
        boundary = key;
        found = true;
      }
    }
    if (!found) boundary = ancestors_of(name).front();  // the direct parent
    if (std::find(boundary_order.begin(), boundary_order.end(), boundary) == boundary_order.end())
      boundary_order.push_back(boundary);
    return boundary;
  };
  std::vector<std::pair<at::Tensor, Precision>> to_cast;  // every parameter whose dtype changes
  std::vector<std::pair<at::Tensor, Precision>> base_masters;  // replicated parameters with a master copy
  std::map<std::string, std::pair<at::ScalarType, std::string>> input_cast, output_cast;  // per boundary
  uint64_t base_digest = 0;  // precision of the non-dedicated parameters (cross-rank check)
  for (const auto& item : m->named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    const at::Tensor& p = item.value();
    const ParamPolicy pol = policy_for(opts, name, p, rank);
    if (!p.requires_grad()) {  // frozen: only the forward dtype applies
      if (pol.param_dtype && *pol.param_dtype != p.scalar_type()) {
        to_cast.emplace_back(p, resolve_precision(pol, opts, name, p, false, /*frozen=*/true, rank));
      }
      continue;
    }
    std::string route;
    const char* route_from = "param_policy";
    if (pol.route) {
      route = *pol.route;
    } else if (opts.route_hint_fn && !(route = opts.route_hint_fn(name, p)).empty()) {
      route_from = "route_hint_fn";
      TORCH_CHECK(valid_route(route), "rank ", rank, ": dedicate_params: route_hint_fn returned '", route,
                  "' for parameter '", name, "', which is not a route. ", route_list(), " Return \"\" for no hint.");
    } else {
      route = predicate(name, p) ? "muon" : "adamw";
      route_from = "the predicate";
    }
    const Precision prec = resolve_precision(pol, opts, name, p, route == "muon", /*frozen=*/false, rank);
    if (prec.param != p.scalar_type()) to_cast.emplace_back(p, prec);
    auto note_boundary_casts = [&](const std::string& boundary) {
      if (pol.cast_forward_inputs.value_or(pol.param_dtype && *pol.param_dtype != p.scalar_type()))
        merge_boundary_dtype(input_cast, boundary, prec.param, name, "forward input casts", rank);
      if (pol.output_dtype) merge_boundary_dtype(output_cast, boundary, *pol.output_dtype, name, "output dtypes", rank);
    };
    if (route == "adamw") {
      precision[p.unsafeGetTensorImpl()] = prec;
      if (prec.has_master()) base_masters.emplace_back(p, prec);
      base_digest = base_digest * 31 + precision_digest(prec);
      continue;
    }
    if (route == "sharded_adamw") {
      TORCH_CHECK(!ddp, "rank ", rank, ": dedicate_params_ddp: parameter '", name, "' is routed to sharded_adamw, "
                  "but the DDP path keeps every parameter whole on every rank. Use dedicate_params for sharding, or "
                  "route it to \"adamw\".");
      TORCH_CHECK(p.numel() > 0 && p.is_contiguous(), "rank ", rank, ": dedicate_params: sharded_adamw parameter '",
                  name, "' must be a non-empty contiguous tensor.");
      const std::string boundary = resolve_boundary(name, p);
      sharded_sel.emplace_back(name, boundary);
      precision[p.unsafeGetTensorImpl()] = prec;
      base_digest = base_digest * 31 + precision_digest(prec) + 7;
      note_boundary_casts(boundary);
      continue;
    }
    TORCH_CHECK(p.dim() == 2, "rank ", rank, ": dedicate_params: ", route_from, " routed '", name,
                "' to Muon, but it has shape ", shape_str(p.sizes()), " (", p.dim(), "-D). Dedicated ownership runs "
                "Newton-Schulz, which needs a 2-D matrix; make ", route_from, " route it elsewhere (\"adamw\": "
                "replicated AdamW), or reshape it into a 2-D parameter in the model.");
    TORCH_CHECK(p.numel() > 0, "rank ", rank, ": dedicate_params: parameter '", name, "' has no elements (shape ",
                shape_str(p.sizes()), ").");
    TORCH_CHECK(p.is_contiguous(), "rank ", rank, ": dedicate_params: parameter '", name,
                "' is not contiguous; dedicated parameters must be plain dense tensors.");
    const std::string boundary = resolve_boundary(name, p);
    note_boundary_casts(boundary);
    std::string unshard = !pol.muon_forward_unshard.empty() ? pol.muon_forward_unshard : opts.muon_forward_unshard;
    TORCH_CHECK(unshard == "broadcast" || unshard == "all_gather", "rank ", rank, ": dedicate_params: parameter '",
                name, "' has muon_forward_unshard '", unshard, "'; use \"broadcast\" or \"all_gather\".");
    TORCH_CHECK(unshard == "broadcast" || (!mesh->is_2d() && !ddp), "rank ", rank, ": dedicate_params: "
                "muon_forward_unshard=\"all_gather\" (parameter '", name, "') is supported on a 1-D mesh with "
                "dedicate_params only; use \"broadcast\" for HSDP and the DDP path.");
    gather_names.insert(unshard == "all_gather" ? name : std::string());

    ParamSpec s;
    s.name = name;
    s.shape = p.sizes().vec();
    // broadcast payload: compute_dtype when it narrows the parameter
    s.elem_bytes = static_cast<int64_t>(std::min(c10::elementSize(prec.param),
                                                 c10::elementSize(opts.compute_dtype.value_or(prec.param))));
    s.group_key = opts.assignment_group_key_fn ? opts.assignment_group_key_fn(name, p) : boundary;
    s.route = "muon";
    specs.push_back(s);
    boundary_names.push_back(boundary);

    ParamEntry e;
    e.name = name;
    e.param = p;
    e.shape = s.shape;
    e.prec = prec;
    precision[p.unsafeGetTensorImpl()] = prec;
    params.push_back(std::move(e));
  }

  this->specs = specs;
  this->boundary_of_param = boundary_names;
  // 3. plan (every rank, no communication), then check that all ranks agree
  PlanOptions po;
  po.owner_strategy = opts.owner_strategy;
  po.owner_cost_model = opts.owner_cost_model;
  po.hsdp_column_balance = opts.hsdp_column_balance;
  po.pack_small_params = opts.pack_small_params;
  po.max_owners_per_group = opts.max_owners_per_group;
  try {
    plan = plan_owners(specs, mesh->shard_size(), mesh->replicate_size(), po);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", rank, ": dedicate_params: owner planning failed: ", e.what());
  }
  {
    // [fingerprint, count] from every rank; a mismatch names the first differing parameter.
    auto opt = at::TensorOptions().dtype(at::kLong);
    // the boundaries' forward casts too: ranks that differ there would compute different numbers
    for (const auto* casts : {&input_cast, &output_cast})
      for (const auto& [bname, cast] : *casts)
        base_digest = base_digest * 1099511628211ull ^ (std::hash<std::string>{}(bname) + static_cast<uint64_t>(cast.first) +
                                                        (casts == &input_cast ? 1 : 2));
    uint64_t fp = plan.fingerprint ^ base_digest;
    for (const auto& e : params) fp = fp * 1099511628211ull ^ precision_digest(e.prec);
    at::Tensor mine = at::tensor({static_cast<int64_t>(fp), static_cast<int64_t>(specs.size())}, opt);
    const int n = mesh->world_size();
    at::Tensor all = at::empty({2 * n}, opt);
    mesh->world().allgather_flat(all, mine, "plan fingerprint check").wait();
    bool same = true;
    for (int r = 0; r < n; ++r) same = same && all[2 * r].item<int64_t>() == all[0].item<int64_t>();
    if (!same) {
      int64_t max_count = 0, min_count = INT64_MAX;
      for (int r = 0; r < n; ++r) {
        max_count = std::max(max_count, all[2 * r + 1].item<int64_t>());
        min_count = std::min(min_count, all[2 * r + 1].item<int64_t>());
      }
      std::string detail;
      if (max_count != min_count) {
        std::ostringstream o;
        o << "ranks select different numbers of dedicated parameters (this rank " << specs.size() << ", others between "
          << min_count << " and " << max_count << ")";
        detail = o.str();
      } else {
        // per-parameter digests: find the first parameter whose spec differs from rank 0's
        at::Tensor d = at::empty({static_cast<int64_t>(specs.size())}, opt);
        for (size_t i = 0; i < specs.size(); ++i) {
          OwnerPlan one = plan_owners({specs[i]}, 1, 1, po);
          d[static_cast<int64_t>(i)] = static_cast<int64_t>(one.fingerprint ^ precision_digest(params[i].prec));
        }
        at::Tensor alld = at::empty({static_cast<int64_t>(specs.size()) * n}, opt);
        mesh->world().allgather_flat(alld, d, "plan fingerprint diagnosis").wait();
        for (size_t i = 0; i < specs.size() && detail.empty(); ++i)
          for (int r = 1; r < n; ++r)
            if (alld[r * static_cast<int64_t>(specs.size()) + i].item<int64_t>() !=
                alld[static_cast<int64_t>(i)].item<int64_t>()) {
              detail = "parameter #" + std::to_string(i) + " ('" + specs[i].name + "' on this rank, shape " +
                       shape_str(specs[i].shape) + ") differs between rank 0 and rank " + std::to_string(r) +
                       " (its shape, name, boundary or mixed-precision policy)";
              break;
            }
        if (detail.empty())
          detail = "the planner options, the environment (DMUON_OWNER_*) or the mixed-precision policy (dtypes of "
                   "the non-dedicated parameters, the boundaries' cast_forward_inputs/output_dtype) differ between ranks";
      }
      TORCH_CHECK(false, "rank ", rank, ": dedicate_params: the owner plan differs between ranks: ", detail,
                  ". Every rank must build the same model and pass the same options before dedicate_params.");
    }
  }

  // 4. boundaries and packed buffers, in model order of first appearance
  std::map<std::string, int> bindex;
  for (const auto& name : boundary_order) {
    Boundary b;
    b.name = name;
    b.module = modules.at(name);
    b.index = static_cast<int>(boundaries.size());
    bindex.emplace(name, b.index);
    boundaries.push_back(std::move(b));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    auto& e = params[i];
    e.owner = plan.owners[i];
    e.owner_rank = mesh->global_rank_of(e.owner.shard, e.owner.replicate);
    e.is_owner = (e.owner.shard == mesh->shard_rank() && e.owner.replicate == mesh->replicate_rank());
    param_index[e.name] = static_cast<int>(i);
    auto it = bindex.find(boundary_names[i]);
    if (it == bindex.end()) {
      Boundary b;
      b.name = boundary_names[i];
      b.module = modules.at(boundary_names[i]);
      b.index = static_cast<int>(boundaries.size());
      it = bindex.emplace(b.name, b.index).first;
      boundaries.push_back(std::move(b));
    }
    e.boundary = it->second;
    boundaries[it->second].params.push_back(static_cast<int>(i));
  }
  for (auto& [bname, cast] : input_cast) boundaries[bindex.at(bname)].input_dtype = cast.first;
  for (auto& [bname, cast] : output_cast) boundaries[bindex.at(bname)].output_dtype = cast.first;
  for (auto& b : boundaries) {
    // one buffer per distinct owner slot (and precision), ordered by slot index (same on every rank)
    std::map<std::pair<int, Precision>, std::vector<int>> by_slot;
    for (int p : b.params)
      by_slot[{OwnerPlan::slot_index(params[p].owner, plan.shard_size), params[p].prec}].push_back(p);
    for (auto& [key, ps] : by_slot) {
      PackedBuffer buf;
      buf.owner = params[ps.front()].owner;
      buf.root = buf.owner.shard;
      buf.root_global = mesh->global_rank_of(buf.owner.shard, buf.owner.replicate);
      buf.params = ps;
      buf.prec = key.second;
      buf.is_owner = params[ps.front()].is_owner;
      buf.is_root = buf.owner.shard == mesh->shard_rank();  // the holder in this replicate group
      buf.gather_mode = gather_names.count(params[ps.front()].name) > 0;
      for (int p : ps)
        TORCH_CHECK((gather_names.count(params[p].name) > 0) == buf.gather_mode, "rank ", rank,
                    ": dedicate_params: parameters '", params[p].name, "' and '", params[ps.front()].name,
                    "' share an owner in boundary '", b.name, "' but differ in muon_forward_unshard; use one mode "
                    "per boundary, or set pack_small_params=false / separate assignment groups.");
      const at::Tensor& first = params[ps.front()].param;
      for (int p : ps) {
        TORCH_CHECK(params[p].param.device() == first.device(), "rank ", rank, ": dedicate_params: parameters '",
                    params[p].name, "' and '", params[ps.front()].name, "' share an owner in boundary '", b.name,
                    "' but live on different devices; move the model to one device first.");
        buf.offsets.push_back(buf.numel);
        buf.numel += params[p].param.numel();
      }
      if (buf.gather_mode) buf.shard_len = (buf.numel + mesh->shard_size() - 1) / mesh->shard_size();
      // all_gather mode pads the buffer to G equal shards
      const auto opts_flat = first.options().requires_grad(false);
      buf.flat = at::zeros({buf.gather_mode ? buf.shard_len * mesh->shard_size() : buf.numel},
                           opts_flat.dtype(buf.prec.param));
      // the global owner keeps the master copy, from the parameters' values before any cast
      if (buf.is_owner && buf.prec.has_master()) buf.master = at::zeros({buf.flat.numel()}, opts_flat.dtype(buf.prec.master));
      for (size_t k = 0; k < ps.size(); ++k) {
        auto& e = params[ps[k]];
        e.buffer = static_cast<int>(b.buffers.size());
        e.slot_in_buffer = static_cast<int>(k);
        buf.views.push_back(buf.flat.narrow(0, buf.offsets[k], e.param.numel()).view(e.param.sizes()));
        if (buf.master.defined()) {
          at::Tensor mv = buf.master.narrow(0, buf.offsets[k], e.param.numel()).view(e.param.sizes());
          at::NoGradGuard ng;
          mv.copy_(e.param.detach());
          masters[e.param.unsafeGetTensorImpl()] = mv;
        }
      }
      b.buffers.push_back(std::move(buf));
    }
  }

  // 4b. sharded_adamw parameters: slice of rank 0's value (global rank 0 broadcasts over the world)
  {
    at::NoGradGuard ng;
    const int G = mesh->shard_size();
    std::map<std::string, at::Tensor> by_name;
    for (const auto& item : m->named_parameters(true)) by_name[item.key()] = item.value();
    for (const auto& [name, bname] : sharded_sel) {
      ShardedEntry e;
      e.name = name;
      e.param = by_name.at(name);
      e.shape = e.param.sizes().vec();
      e.numel = e.param.numel();
      e.shard_len = (e.numel + G - 1) / G;
      e.boundary = bindex.at(bname);
      e.prec = precision.at(e.param.unsafeGetTensorImpl());
      const auto o = e.param.options().requires_grad(false);
      at::Tensor full = at::zeros({e.shard_len * G}, o);  // the value before any cast
      full.narrow(0, 0, e.numel).copy_(e.param.detach().reshape(-1));
      mesh->world().broadcast(full, 0, "initial value of sharded parameter '" + name + "' from rank 0").wait();
      e.shard = full.narrow(0, static_cast<int64_t>(mesh->shard_rank()) * e.shard_len, e.shard_len)
                    .to(e.prec.master, /*non_blocking=*/false, /*copy=*/true);
      e.full = at::empty({e.shard_len * G}, o.dtype(e.prec.param));
      e.view = e.full.narrow(0, 0, e.numel).view(e.param.sizes());
      e.placeholder = at::empty({0}, o.dtype(e.prec.param));
      sharded_index[name] = static_cast<int>(sharded.size());
      boundaries[e.boundary].sharded.push_back(static_cast<int>(sharded.size()));
      sharded.push_back(std::move(e));
    }
  }

  // 4c. mixed precision: replicated parameters with a master keep it (replicate() syncs it from rank
  // 0); then every parameter takes its forward dtype. Before any hook: autograd's accumulator caches
  // the dtype, and set_data with a new dtype detaches the parameter from an existing one.
  {
    at::NoGradGuard ng;
    for (auto& [p, prec] : base_masters)
      masters[p.unsafeGetTensorImpl()] = p.detach().to(prec.master, /*non_blocking=*/false, /*copy=*/true);
    for (auto& [p, prec] : to_cast) {
      p.set_data(p.detach().to(prec.param));
      p.mutable_grad() = at::Tensor();  // a gradient from before would keep the old dtype
    }
    for (auto& e : params) e.placeholder = at::empty({0}, e.param.options().requires_grad(false));
  }

  // 5. hooks (while every parameter is still full-size: the accumulator caches the shape)
  for (size_t i = 0; i < sharded.size(); ++i) {
    auto& e = sharded[i];
    const int idx = static_cast<int>(i);
    e.grad_acc = detail::on_grad_accumulated(e.param, e.name, rank, [this, idx] { on_sharded_accumulated(idx); });
    at::NoGradGuard ng;
    e.param.set_data(e.placeholder);
    detail::resize_storage_bytes(e.full, 0);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const int idx = static_cast<int>(i);
    params[i].grad_acc =
        detail::on_grad_accumulated(params[i].param, params[i].name, rank, [this, idx] { on_param_accumulated(idx); });
  }

  // 6. data: owners keep their value in the packed buffer; the others release theirs.
  {
    at::NoGradGuard ng;
    for (auto& b : boundaries)
      for (auto& buf : b.buffers) {
        for (size_t k = 0; k < buf.params.size(); ++k) {
          auto& e = params[buf.params[k]];
          if (buf.is_root || ddp) {
            buf.views[k].copy_(e.param.detach());  // (HSDP: replaced by the global owner's value below)
            e.param.set_data(buf.views[k]);
          } else {
            e.param.set_data(e.placeholder);
          }
        }
        if (buf.is_root || ddp) {
          buf.state = PackedBuffer::State::Ready;
        } else {
          detail::resize_storage_bytes(buf.flat, 0);
          buf.state = PackedBuffer::State::Released;
        }
      }
    // all_gather mode: every rank starts with its shard of the owner's value
    for (auto& b : boundaries)
      for (auto& buf : b.buffers)
        if (buf.gather_mode) {
          buf.shard = at::empty({buf.shard_len}, buf.flat.options());
          at::Tensor src = buf.is_root ? buf.flat : at::empty({0}, buf.flat.options());
          mesh->shard().scatter_flat(buf.shard, src, buf.root, "initial shards of '" + b.name + "'").wait();
        }
    // DDP path: every rank starts from the owner's value (ranks may have initialised differently)
    if (ddp)
      for (auto& b : boundaries)
        for (auto& buf : b.buffers)
          mesh->shard().broadcast(buf.flat, buf.root, "initial value of '" + b.name + "' from its owner").wait();
    // HSDP: every holder starts from the global owner's value (one broadcast per packed unit over
    // the replicate group of the owner's column; same order on every member).
    if (Communicator* rep = mesh->replicate()) {
      for (auto& b : boundaries)
        for (auto& buf : b.buffers)
          if (buf.is_root)
            rep->broadcast(buf.flat, buf.owner.replicate, "initial value of '" + b.name + "' from replicate " +
                                                              std::to_string(buf.owner.replicate))
                .wait();
    }
  }
}

Precision DedicatedState::precision_of(const at::Tensor& p) const {
  auto it = precision.find(p.unsafeGetTensorImpl());
  if (it != precision.end()) return it->second;
  Precision pr;
  pr.param = pr.reduce = pr.master = pr.optim = p.scalar_type();
  return pr;
}

// ---- public API ------------------------------------------------------------------------------------
namespace {
std::map<std::string, OwnerCoord> dedicate_impl(const std::shared_ptr<torch::nn::Module>& model,
                                                const std::shared_ptr<Mesh>& mesh, const ParamPredicate& predicate,
                                                const DedicateOptions& options, bool ddp);
}  // namespace

std::map<std::string, OwnerCoord> dedicate_params(const std::shared_ptr<torch::nn::Module>& model,
                                                  const std::shared_ptr<Mesh>& mesh, const ParamPredicate& predicate,
                                                  const DedicateOptions& options) {
  return dedicate_impl(model, mesh, predicate, options, /*ddp=*/false);
}

std::map<std::string, OwnerCoord> dedicate_params_ddp(const std::shared_ptr<torch::nn::Module>& model,
                                                      const std::shared_ptr<Mesh>& mesh,
                                                      const ParamPredicate& predicate,
                                                      const DedicateOptions& options) {
  TORCH_CHECK(mesh, "dedicate_params_ddp: the mesh is null; create one with dmuon::Mesh::create.");
  TORCH_CHECK(!mesh->is_2d(), "rank ", mesh->global_rank(), ": dedicate_params_ddp accepts a 1-D mesh only, got a ",
              mesh->replicate_size(), " x ", mesh->shard_size(), " (replicate x shard) mesh. For HSDP use "
              "dedicate_params with a 2-D mesh.");
  return dedicate_impl(model, mesh, predicate, options, /*ddp=*/true);
}

namespace {
std::map<std::string, OwnerCoord> dedicate_impl(const std::shared_ptr<torch::nn::Module>& model,
                                                const std::shared_ptr<Mesh>& mesh, const ParamPredicate& predicate,
                                                const DedicateOptions& options, bool ddp) {
  TORCH_CHECK(model, "dedicate_params: the model is null.");
  TORCH_CHECK(mesh, "dedicate_params: the mesh is null; create one with dmuon::Mesh::create.");
  TORCH_CHECK(!detail::state_of_model(model.get()), "rank ", mesh->global_rank(),
              ": dedicate_params was already called on this model. Dedicate a model once; to change options, "
              "build a fresh model.");
  for (const auto& item : model->named_modules("", true))
    TORCH_CHECK(!detail::boundary_of_module(item.value().get()).first, "rank ", mesh->global_rank(),
                ": dedicate_params: submodule '", item.key(), "' already belongs to a dedicated model.");
  if (options.compute_dtype) {
    const auto t = *options.compute_dtype;
    TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16, "rank ",
                mesh->global_rank(), ": dedicate_params: compute_dtype ", t, " cannot carry parameters and "
                "gradients; use a floating type (bfloat16, float16, float32 or float64).");
  }
  TORCH_CHECK(options.replicate_broadcast_bucket_mb >= 0, "rank ", mesh->global_rank(),
              ": dedicate_params: replicate_broadcast_bucket_mb must be >= 0 (0 = one publish per unit), got ",
              options.replicate_broadcast_bucket_mb);
  TORCH_CHECK(options.forward_prefetch_depth >= 0, "rank ", mesh->global_rank(),
              ": dedicate_params: forward_prefetch_depth must be >= 0, got ", options.forward_prefetch_depth);
  auto state = std::make_shared<DedicatedState>(model, mesh, options);
  state->ddp = ddp;
  state->build(predicate);
  detail::register_state(model, state);
  for (auto& b : state->boundaries)
    if (auto mod = b.module.lock()) detail::register_boundary(mod, state, b.index);
  std::map<std::string, OwnerCoord> out;
  for (const auto& e : state->params) out[e.name] = e.owner;
  return out;
}
}  // namespace

namespace {
DedicatedParam to_public(const ParamEntry& e, const DedicatedState& s) {
  DedicatedParam d;
  d.name = e.name;
  d.param = e.param;
  d.shape = e.shape;
  d.owner = e.owner;
  d.owner_rank = e.owner_rank;
  d.boundary = s.boundaries[e.boundary].name;
  d.is_owner = e.is_owner;
  if (auto it = s.masters.find(e.param.unsafeGetTensorImpl()); it != s.masters.end()) d.master = it->second;
  return d;
}
}  // namespace

void prepare_muon_grads(torch::nn::Module& model) { detail::require_state(model, "prepare_muon_grads")->prepare_grads(); }

std::vector<DedicatedParam> get_dedicated_params(const torch::nn::Module& model) {
  auto s = detail::state_of_model(&model);
  std::vector<DedicatedParam> out;
  if (!s) return out;
  for (const auto& e : s->params) out.push_back(to_public(e, *s));
  return out;
}

std::vector<DedicatedParam> get_owned_params(const torch::nn::Module& model, int shard) {
  std::vector<DedicatedParam> out;
  for (auto& d : get_dedicated_params(model))
    if (d.owner.shard == shard) out.push_back(d);
  return out;
}

std::vector<DedicatedParam> get_owned_params(const torch::nn::Module& model, OwnerCoord owner) {
  std::vector<DedicatedParam> out;
  for (auto& d : get_dedicated_params(model))
    if (d.owner == owner) out.push_back(d);
  return out;
}

std::shared_ptr<DedicatedState> get_comm_ctx(const torch::nn::Module& model) {
  return detail::state_of_model(&model);
}

const OwnerPlan* get_owner_plan(const torch::nn::Module& model) {
  auto s = detail::state_of_model(&model);
  return s ? &s->plan : nullptr;
}

std::shared_ptr<Mesh> get_mesh(const torch::nn::Module& model) {
  auto s = detail::state_of_model(&model);
  return s ? s->mesh : nullptr;
}

std::vector<std::pair<std::string, at::Tensor>> get_base_params(const torch::nn::Module& model) {
  auto s = detail::state_of_model(&model);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model.named_parameters(true)) {
    if (!item.value().requires_grad()) continue;
    if (s && (s->param_index.count(item.key()) || s->sharded_index.count(item.key()))) continue;
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

}  // namespace dmuon
