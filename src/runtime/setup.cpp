// dedicate_params' setup decisions (see setup.h): pure functions, no collectives.
#include "runtime/setup.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <sstream>

#include "dmuon/digest.h"
#include "runtime/sharded_route.h"

namespace dmuon {

namespace {

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

std::string route_list() {
  std::string out = "Routes: ";
  const auto& table = route_table();
  for (size_t i = 0; i < table.size(); ++i) {
    const RouteRow& row = table[i];
    out += (i == 0 ? "" : i + 1 == table.size() ? " and " : ", ");
    out += "\"" + row.names.front() + "\" (" + row.what;
    for (size_t k = 1; k < row.names.size(); ++k) out += "; also spelled \"" + row.names[k] + "\"";
    out += ")";
  }
  return out + ".";
}

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

// 1: half/bfloat16, 2: float, 3: double.
int float_rank(at::ScalarType t) { return t == at::kDouble ? 3 : t == at::kFloat ? 2 : 1; }
bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// The floating dtype a boundary's forward casts to (input or output): every parameter of the
// boundary that asks for one must ask for the same.
void merge_boundary_dtype(std::map<std::string, std::pair<at::ScalarType, std::string>>& by_boundary,
                          const std::string& boundary, at::ScalarType t, const std::string& param, const char* what,
                          int rank) {
  auto [it, fresh] = by_boundary.emplace(boundary, std::make_pair(t, param));
  TORCH_CHECK_VALUE(fresh || it->second.first == t, "rank ", rank, ": dedicate_params: parameters '", it->second.second,
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

// The route table: one row per route a parameter can be sent to. The routes built from it (`make`)
// are built and called in row order, after the dedicated route and before the replicated and local
// ones.
const std::vector<RouteRow>& route_table() {
  static const std::vector<RouteRow> table = {
      {RouteKind::Dedicated, {"muon"}, "dedicated ownership + Newton-Schulz", true},
      {RouteKind::Replicated, {"adamw", "replicated"}, "replicated, AdamW"},
      {RouteKind::Sharded, {"sharded_adamw"}, "1/N per rank, AdamW on the shard", true, &ShardedRoute::check,
       &ShardedRoute::make},
  };
  return table;
}

const RouteRow& route_row(RouteKind k) {
  for (const RouteRow& row : route_table())
    if (row.kind == k) return row;
  TORCH_INTERNAL_ASSERT(false, "route kind ", static_cast<int>(k), " has no row in route_table()");
}

void add_planned(std::vector<PlannedTraffic>& out, const char* route, const Communicator& comm, CommOp op,
                 int64_t bytes, int64_t calls, bool root) {
  if (comm.local_only() || calls == 0) return;  // a group of one issues nothing
  const auto [counted_op, per_call] = comm.counted(op, bytes, root);
  for (PlannedTraffic& t : out)
    if (t.route == route && t.group == comm.name() && t.op == counted_op) {
      t.bytes += per_call * calls;
      t.calls += calls;
      return;
    }
  out.push_back(PlannedTraffic{route, comm.name(), counted_op, per_call * calls, calls});
}

const char* route_name(RouteKind k) {
  if (k == RouteKind::Local) return "local";  // no data-parallel route: frozen, or not replicated
  if (k == RouteKind::Replicated) return "replicated";
  return route_row(k).names.front().c_str();
}

std::optional<RouteKind> parse_route(const std::string& s) {
  for (const RouteRow& row : route_table())
    if (std::find(row.names.begin(), row.names.end(), s) != row.names.end()) return row.kind;
  return std::nullopt;
}

std::optional<UnshardMode> parse_unshard(const std::string& s) {
  if (s == "broadcast") return UnshardMode::Broadcast;
  if (s == "all_gather") return UnshardMode::AllGather;
  return std::nullopt;
}

ParamPolicy policy_for(const DedicateOptions& opts, const std::string& name, const at::Tensor& p, int rank) {
  TORCH_CHECK_VALUE(opts.param_policy.empty() || !opts.param_policy_fn, "rank ", rank,
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
    TORCH_CHECK_VALUE(parse_route(*pol.route), "rank ", rank, ": dedicate_params: parameter '", name, "' has route '",
                *pol.route, "', which does not exist. ", route_list());
  return pol;
}

Precision resolve_precision(const ParamPolicy& pol, const DedicateOptions& opts, const std::string& name,
                            const at::Tensor& p, bool muon, bool frozen, int rank) {
  auto check = [&](const std::optional<at::ScalarType>& t, const char* field) {
    TORCH_CHECK_VALUE(!t || is_float(*t), "rank ", rank, ": dedicate_params: param_policy of '", name, "' sets ", field,
                " = ", *t, ", which cannot hold parameters, gradients or optimizer state; use a floating type "
                "(bfloat16, float16, float32 or float64).");
  };
  check(pol.param_dtype, "param_dtype");
  check(pol.grad_dtype, "grad_dtype");
  check(pol.master_dtype, "master_dtype");
  check(pol.optim_dtype, "optim_dtype");
  check(pol.output_dtype, "output_dtype");
  const at::ScalarType own = p.scalar_type();
  TORCH_CHECK_VALUE(!(pol.param_dtype || pol.master_dtype || pol.grad_dtype || pol.optim_dtype) || is_float(own), "rank ",
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
  // the optimizer state of a float16 master in float32 (unless set): float16's range (65504) is overrun by a
  // Muon momentum (up to ~20x the gradient, its Nesterov input ~2x) or an Adam second moment (g^2: |g| > 256)
  // of ordinary gradients, and the NaN that follows reached the weights silently
  pr.optim = pol.optim_dtype.value_or(pr.master == at::kHalf ? at::kFloat : pr.master);
  TORCH_CHECK_VALUE(pr.master == pr.param || float_rank(pr.master) > float_rank(pr.param), "rank ", rank,
              ": dedicate_params: param_policy of '", name, "' has master_dtype ", pr.master, " and param_dtype ",
              pr.param, ": the master copy must be at least as precise as the parameter (every update would be "
              "rounded away). Use master_dtype float32 (the usual choice) or leave it unset.");
  return pr;
}

ModuleIndex::ModuleIndex(const ModelView& model) {
  for (const ModelView::Module& m : model.modules) by_name_.emplace(m.name, &m);
}

const ModelView::Module* ModuleIndex::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

namespace {
// The lowest module containing both ("a.b" and "a.c.d": "a"; "a" and "b": the root "").
std::string common_ancestor(const std::string& a, const std::string& b) {
  if (a == b) return a;
  size_t i = 0, last_dot = std::string::npos;
  while (i < a.size() && i < b.size() && a[i] == b[i]) {
    if (a[i] == '.') last_dot = i;
    ++i;
  }
  // a whole component in common: one name is the other's ancestor, or both continue with a dot
  if ((i == a.size() && (i == b.size() || b[i] == '.')) || (i == b.size() && a[i] == '.')) return a.substr(0, i);
  return last_dot == std::string::npos ? std::string() : a.substr(0, last_dot);
}

// `name`, or its lowest ancestor that runs a forward when it is a container (ModuleList...): a
// container's forward hooks never run, its parent's forward uses what it holds.
std::string running_forward(const ModuleIndex& model, std::string name) {
  for (const ModelView::Module* m = model.find(name); m && m->container && !name.empty(); m = model.find(name)) {
    const size_t dot = name.rfind('.');
    name = dot == std::string::npos ? std::string() : name.substr(0, dot);
  }
  return name;
}
}  // namespace

std::string resolve_boundary(const DedicateOptions& opts, const ModuleIndex& model, const ModelView::Tensor& param,
                             int rank) {
  std::string boundary = resolve_boundary(opts, model, param.name, param.tensor, rank);
  if (opts.hook_boundary_resolver) return boundary;  // a resolver's choice stands, tied or not
  // a tied parameter: every module holding it runs inside its boundary
  for (const std::string& alias : param.aliases) boundary = common_ancestor(boundary, ancestors_of(alias).front());
  return running_forward(model, boundary);
}

std::string resolve_boundary(const DedicateOptions& opts, const ModuleIndex& model, const std::string& name,
                             const at::Tensor& p, int rank) {
  if (opts.hook_boundary_resolver) {
    std::string boundary = opts.hook_boundary_resolver(name, p);
    const ModelView::Module* m = model.find(boundary);
    TORCH_CHECK_VALUE(m, "rank ", rank, ": dedicate_params: hook_boundary_resolver returned '",
                boundary, "' for parameter '", name, "', which is not a module of the model (named_modules()).");
    TORCH_CHECK_VALUE(!m->container || boundary.empty(), "rank ", rank, ": dedicate_params: hook_boundary_resolver returned '",
                boundary, "' for parameter '", name, "', a container (ModuleList, ModuleDict, ParameterList or "
                "ParameterDict, or a MultiheadAttention's out_proj, whose weight the attention reads without calling "
                "it) that runs no forward of its own, so its forward hooks never run and the parameter would never "
                "be unsharded. Return the module whose forward uses it (for a container, its parent).");
    return boundary;
  }
  if (opts.hook_boundary_predicate) {
    for (const auto& a : ancestors_of(name)) {
      const ModelView::Module* m = model.find(a);
      if (!m || m->container) continue;  // a container runs no forward: never a boundary
      const std::shared_ptr<torch::nn::Module> module = m->libtorch.lock();
      TORCH_CHECK_VALUE(module, "rank ", rank, ": dedicate_params: hook_boundary_predicate is called with LibTorch "
                  "modules, but module '", a, "' of this model is not one. Use hook_boundary_resolver (name -> "
                  "boundary module name) for models that are not LibTorch modules.");
      if (opts.hook_boundary_predicate(a, *module)) return a;
    }
    TORCH_CHECK_VALUE(!opts.hook_boundary_strict, "rank ", rank, ": dedicate_params: no ancestor module of '", name,
                "' matches hook_boundary_predicate (strict mode). Widen the predicate so it selects the block that "
                "contains this parameter, or set hook_boundary_strict=false to fall back to its direct parent module.");
  } else {
    const std::string key = layer_key_of(name);
    if (!key.empty() && model.find(key)) return running_forward(model, key);
  }
  return running_forward(model, ancestors_of(name).front());  // the direct parent (or the lowest running one)
}

Routing route_params(const ModelView& model, const ParamPredicate& predicate, const DedicateOptions& opts,
                     const RoutingContext& ctx) {
  const int rank = ctx.rank;
  TORCH_CHECK_VALUE(static_cast<bool>(predicate), "rank ", rank, ": dedicate_params: the predicate is empty. Pass a "
              "function (name, param) -> bool that selects the Muon matrices, e.g. 2-D weights of layers.");
  Routing out;
  const ModuleIndex modules(model);
  auto boundary_of = [&](const ModelView::Tensor& item) {
    std::string boundary = resolve_boundary(opts, modules, item, rank);
    if (std::find(out.boundary_order.begin(), out.boundary_order.end(), boundary) == out.boundary_order.end())
      out.boundary_order.push_back(boundary);
    return boundary;
  };
  std::map<std::string, std::pair<at::ScalarType, std::string>> input_cast, output_cast;
  for (const ModelView::Tensor& item : model.params) {
    const std::string& name = item.name;
    const at::Tensor& p = item.tensor;
    const ParamPolicy pol = policy_for(opts, name, p, rank);
    if (!p.requires_grad()) {  // frozen: only the forward dtype applies
      if (pol.param_dtype && *pol.param_dtype != p.scalar_type())
        out.to_cast.emplace_back(p, resolve_precision(pol, opts, name, p, false, /*frozen=*/true, rank));
      continue;
    }
    TORCH_CHECK_VALUE(!at::isComplexType(p.scalar_type()), "rank ", rank, ": dedicate_params: parameter '", name,
                      "' is complex (", p.scalar_type(), "); dmuon trains real parameters only (its reduces and updates "
                      "would drop the imaginary part). Hold it as a real parameter with a last dimension of 2 "
                      "(torch.view_as_complex of it in forward), or freeze it (requires_grad false) before "
                      "dedicate_params.");
    RouteKind route;
    const char* route_from = "param_policy";
    std::string hint;
    if (pol.route) {
      route = *parse_route(*pol.route);  // validated by policy_for
    } else if (opts.route_hint_fn && !(hint = opts.route_hint_fn(name, p)).empty()) {
      route_from = "route_hint_fn";
      const auto parsed = parse_route(hint);
      TORCH_CHECK_VALUE(parsed, "rank ", rank, ": dedicate_params: route_hint_fn returned '", hint, "' for parameter '", name,
                  "', which is not a route. ", route_list(), " Return \"\" for no hint.");
      route = *parsed;
    } else {
      route = predicate(name, p) ? RouteKind::Dedicated : RouteKind::Replicated;
      route_from = "the predicate";
    }
    RoutedParam r;
    r.name = name;
    r.param = p;
    r.route = route;
    r.prec = resolve_precision(pol, opts, name, p, route == RouteKind::Dedicated, /*frozen=*/false, rank);
    if (r.prec.param != p.scalar_type()) out.to_cast.emplace_back(p, r.prec);
    auto note_boundary_casts = [&](const std::string& boundary) {
      if (pol.cast_forward_inputs.value_or(pol.param_dtype && *pol.param_dtype != p.scalar_type()))
        merge_boundary_dtype(input_cast, boundary, r.prec.param, name, "forward input casts", rank);
      if (pol.output_dtype) merge_boundary_dtype(output_cast, boundary, *pol.output_dtype, name, "output dtypes", rank);
    };
    if (route == RouteKind::Replicated) {
      out.base_digest = Fnv1a(out.base_digest).u64(precision_digest(r.prec)).value();
      out.base.push_back(std::move(r));
      continue;
    }
    if (route != RouteKind::Dedicated) {  // a route of the table
      const RouteRow& row = route_row(route);
      if (row.check) row.check(name, p, ctx);
      if (row.on_boundary) {
        r.boundary = boundary_of(item);
        note_boundary_casts(r.boundary);
      }
      out.base_digest =
          Fnv1a(out.base_digest).u64(precision_digest(r.prec)).i64(static_cast<int64_t>(route)).value();
      out.routed[route].push_back(std::move(r));
      continue;
    }
    TORCH_CHECK_VALUE(p.dim() == 2, "rank ", rank, ": dedicate_params: ", route_from, " routed '", name,
                "' to Muon, but it has shape ", shape_str(p.sizes()), " (", p.dim(), "-D). Dedicated ownership runs "
                "Newton-Schulz, which needs a 2-D matrix; make ", route_from, " route it elsewhere (\"adamw\": "
                "replicated AdamW), or reshape it into a 2-D parameter in the model.");
    TORCH_CHECK_VALUE(p.numel() > 0, "rank ", rank, ": dedicate_params: parameter '", name, "' has no elements (shape ",
                shape_str(p.sizes()), "), so it has no Newton-Schulz to run; leave it out of ", route_from,
                " (e.g. p.numel() > 0) or route it to \"adamw\".");
    TORCH_CHECK_VALUE(p.is_contiguous(), "rank ", rank, ": dedicate_params: parameter '", name,
                "' is not contiguous (strides ", shape_str(p.strides()), "); dedicated parameters must be plain dense "
                "tensors. Make it contiguous in the model before dedicate_params (e.g. replace it by a parameter of "
                "p.detach().contiguous()), or route it to \"adamw\".");
    r.boundary = boundary_of(item);
    note_boundary_casts(r.boundary);
    const std::string unshard = !pol.muon_forward_unshard.empty() ? pol.muon_forward_unshard : opts.muon_forward_unshard;
    const auto mode = parse_unshard(unshard);
    TORCH_CHECK_VALUE(mode, "rank ", rank, ": dedicate_params: parameter '", name, "' has muon_forward_unshard '", unshard,
                "'; use \"broadcast\" or \"all_gather\".");
    r.unshard = *mode;
    TORCH_CHECK_VALUE(r.unshard == UnshardMode::Broadcast || !ctx.tp, "rank ", rank,
                ": dedicate_params: muon_forward_unshard=\"all_gather\" (parameter '", name, "') is not supported "
                "with tensor parallelism (the TP update already arrives as per-rank slices); use \"broadcast\" on a "
                "mesh with tp_size > 1.");
    ParamSpec s;
    s.name = name;
    s.shape = p.sizes().vec();
    // broadcast payload: compute_dtype when it narrows the parameter
    s.elem_bytes = static_cast<int64_t>(std::min(c10::elementSize(r.prec.param),
                                                 c10::elementSize(opts.compute_dtype.value_or(r.prec.param))));
    s.group_key = opts.assignment_group_key_fn ? opts.assignment_group_key_fn(name, p) : r.boundary;
    s.route = "muon";
    out.specs.push_back(s);
    out.dedicated.push_back(std::move(r));
  }
  // the boundaries' forward casts are part of the fingerprint: ranks that differ there would compute
  // different numbers
  for (const auto* casts : {&input_cast, &output_cast})
    for (const auto& [bname, cast] : *casts)
      out.base_digest =
          Fnv1a(out.base_digest).u64(casts == &input_cast ? 1 : 2).str(bname).i64(static_cast<int64_t>(cast.first)).value();
  for (const auto& [b, c] : input_cast) out.input_cast[b] = c.first;
  for (const auto& [b, c] : output_cast) out.output_cast[b] = c.first;
  return out;
}

}  // namespace dmuon
