// Runtime setup: route the parameters (setup.cpp), plan owners, check the plan across ranks
// (fingerprint.cpp), then hand each route its parameters.
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <exception>
#include <set>

#include "dmuon/digest.h"
#include "dmuon/env.h"
#include "dmuon/tensor_parallel.h"
#include "runtime/dedicated_route.h"
#include "runtime/fingerprint.h"
#include "runtime/local_route.h"
#include "runtime/replicated_route.h"
#include "runtime/runtime.h"
#include "runtime/setup.h"
#include "comm/error_text.h"

namespace dmuon {

Runtime::Runtime(ModelView view, std::shared_ptr<torch::nn::Module> module, std::shared_ptr<Mesh> mesh,
                 DedicateOptions opts, bool ddp)
    : view_(std::move(view)),
      model_(module),
      ctx_(std::move(mesh), std::move(opts), ddp),
      id_(detail::next_runtime_id()),
      dedicated_(std::make_unique<DedicatedRoute>(ctx_, ddp)) {}

Runtime::~Runtime() {
  // Collectives still in flight (the last step's async publish, a post-step prefetch, the reduces of a
  // backward no step consumed) finish before the groups they run on go: a group destroyed under an
  // in-flight collective leaves its peers' side of it waiting out their whole timeout. (The registry
  // keeps a dropped model's runtime until Runtime::in_flight() is false -- that is what ended the stalls
  // of a lookup made right after a model was dropped; this is the backstop for a runtime destroyed
  // otherwise, e.g. at exit.) Issues nothing; a failed wait (a peer already gone) changes nothing now.
  try {
    wait_publishes();
    discard_grads(true);
  } catch (const std::exception&) {
  }
}

void Runtime::build(const ParamPredicate& predicate, const std::function<void()>& precheck) {
  Mesh& mesh = ctx_.mesh();
  const DedicateOptions& opts = ctx_.options();
  const int rank = mesh.global_rank();
  // route hooks run under the lock, and not at all once this runtime is gone
  ctx_.set_hook_factory([weak = weak_from_this(), rank](const at::Tensor& param, const std::string& name, GradHook hook,
                                                        GradArrival before) {
    std::function<bool()> pre;
    if (before)
      pre = [weak, before = std::move(before)] {
        auto live = weak.lock();
        if (!live) return true;
        std::lock_guard<std::recursive_mutex> g(live->mu_);
        return before(*live);
      };
    return detail::on_grad_accumulated(
        param, name, rank,
        [weak, hook = std::move(hook)] {
          auto live = weak.lock();
          if (!live) return;  // the model is gone: nothing to do
          std::lock_guard<std::recursive_mutex> g(live->mu_);
          hook(*live);
        },
        std::move(pre));
  });
  // 1.-2. the pure steps. A failure on some ranks only is shared at the plan check below: every
  // rank then fails, naming the ranks that failed, instead of the others waiting in the check's
  // collective until the timeout.
  Routing routing;
  std::vector<ParamSpec> full_specs;
  std::vector<Precision> precisions;
  std::vector<int> unshard;  // each dedicated parameter's muon_forward_unshard mode
  std::exception_ptr setup_failure;
  const PlanOptions& po = opts.plan;
  try {
    if (precheck) precheck();
    // 1. routes, precision, boundaries
    view_.check(rank);
    routing = route_params(view_, predicate, opts, RoutingContext{rank, ctx_.ddp(), mesh.has_tp()});
    for (const auto* group : {&routing.dedicated, &routing.base})
      for (const auto& r : *group) ctx_.set_precision(r.param, r.prec);
    for (const auto& [kind, group] : routing.routed)
      for (const auto& r : group) ctx_.set_precision(r.param, r.prec);
    specs_ = routing.specs;
    for (const auto& r : routing.dedicated) boundary_of_param_.push_back(r.boundary);
    // tensor parallelism: which dedicated matrices are TP slices (specs_ keep the local shapes the
    // routes move; the planner sees the full ones)
    check_tp_modules();
    ctx_.set_tp_split(view_.tp_split);
    const std::map<std::string, int>& tp_split = ctx_.tp_split();
    const int T = mesh.tp_size();
    full_specs = specs_;
    for (size_t i = 0; i < specs_.size(); ++i)
      if (auto it = tp_split.find(specs_[i].name); it != tp_split.end()) {
        specs_[i].tp_split_dim = full_specs[i].tp_split_dim = it->second;
        full_specs[i].shape[static_cast<size_t>(it->second)] *= T;
      }
    // deferred parameters (deferred_init.h): the source is checked once; which parameters are
    // deferred is part of the fingerprint (the sharded route skips its initial broadcast for them)
    check_deferred(routing.base_digest);
    // 2. plan (every rank, no communication)
    try {
      plan_ = plan_owners_tp(full_specs, mesh.shard_size(), mesh.replicate_size(), T, po);
    } catch (const std::exception& e) {
      TORCH_CHECK_VALUE(false, "rank ", rank, ": dedicate_params: owner planning failed: ", detail::error_text(e));
    }
    for (const auto& r : routing.dedicated) {
      precisions.push_back(r.prec);
      unshard.push_back(static_cast<int>(r.unshard));
    }
    // read once (a value that is not a boolean is this rank's setup failure, shared at the agreement)
    isolated_pg_barrier_ = env::isolated_pg_barrier();
  } catch (...) {
    setup_failure = std::current_exception();
  }
  // every rank agrees on the plan, or all throw
  check_plan_agreement(mesh, plan_, specs_, precisions, unshard, routing.base_digest, opts, isolated_pg_barrier_,
                       setup_failure);

  // 3. boundaries in model order of first appearance
  std::map<std::string, int> bindex;
  for (const auto& name : routing.boundary_order) {
    Boundary b;
    b.name = name;
    b.module = view_.module(name)->libtorch;
    b.index = static_cast<int>(boundaries_.size());
    if (auto it = routing.input_cast.find(name); it != routing.input_cast.end()) b.input_dtype = it->second;
    if (auto it = routing.output_cast.find(name); it != routing.output_cast.end()) b.output_dtype = it->second;
    bindex.emplace(name, b.index);
    ctx_.add_boundary(name);
    boundaries_.push_back(std::move(b));
  }
  if (opts.record_forward_profile.value_or(env::record_forward_profile())) {
    for (const auto& B : boundaries_) unshard_stats_.push_back(BoundaryUnshardStats{B.name});
    unshard_spans_ = std::make_unique<detail::DeviceSpans>(mesh.device());
  }

  // 4. the routes take their parameters: packed buffers (owners copy their masters before any
  // cast), then sharded slices of rank 0's value; deferred parameters are filled from the source,
  // each rank only what it keeps (replicated and frozen ones here, whole or as their TP slice)
  if (ParamSource* source = ctx_.deferred_source()) {
    at::NoGradGuard ng;
    std::set<const c10::TensorImpl*> routed_here;
    for (const auto& r : routing.dedicated) routed_here.insert(r.param.unsafeGetTensorImpl());
    for (const auto& [kind, group] : routing.routed)
      for (const auto& r : group) routed_here.insert(r.param.unsafeGetTensorImpl());
    for (const ModelView::Tensor& item : view_.params) {
      at::Tensor p = item.tensor;
      if (!is_deferred(p) || routed_here.count(p.unsafeGetTensorImpl())) continue;
      at::Tensor value = at::empty(p.sizes(), p.options().requires_grad(false));
      ctx_.fill_from(*source, item.name, ctx_.region_of(item.name, p.sizes()), value);
      p.set_data(value);
    }
  }
  std::vector<DedicatedEntry> entries;
  for (size_t i = 0; i < routing.dedicated.size(); ++i) {
    const RoutedParam& r = routing.dedicated[i];
    DedicatedEntry e;
    e.name = r.name;
    e.param = r.param;
    e.shape = r.param.sizes().vec();
    e.full_shape = full_specs[i].shape;
    e.tp_dim = specs_[i].tp_split_dim;
    e.tp_owner = mesh.has_tp() ? plan_.tp_owners[i] : -1;
    e.prec = r.prec;
    e.unshard = r.unshard;
    e.boundary = bindex.at(r.boundary);
    ++boundaries_[static_cast<size_t>(e.boundary)].num_params;
    entries.push_back(std::move(e));
  }
  dedicated_->build(std::move(entries), plan_, static_cast<int>(boundaries_.size()));
  for (const RouteRow& row : route_table()) {  // the table's routes, in row order
    auto it = routing.routed.find(row.kind);
    if (!row.make || it == routing.routed.end()) continue;
    std::vector<BoundParam> params;
    for (const RoutedParam& r : it->second) {
      const int b = row.on_boundary ? bindex.at(r.boundary) : -1;
      if (b >= 0) ++boundaries_[static_cast<size_t>(b)].num_params;
      params.push_back({r.name, r.param, r.prec, b});
    }
    table_routes_.push_back(row.make(ctx_, std::move(params)));
  }

  // 5. mixed precision: replicated parameters with a master keep it (replicate() syncs it from
  // rank 0); then every parameter takes its forward dtype. Before any hook: autograd's accumulator
  // caches the dtype, and set_data with a new dtype detaches the parameter from an existing one.
  {
    at::NoGradGuard ng;
    for (const auto& r : routing.base)
      if (r.prec.has_master())
        ctx_.set_master(r.param, r.param.detach().to(r.prec.master, /*non_blocking=*/false, /*copy=*/true));
    for (auto& [p, prec] : routing.to_cast) {
      // a deferred matrix or slice this rank does not hold keeps no bytes: only its dtype changes
      at::Tensor(p).set_data(is_deferred(p) ? detail::unallocated(p.sizes(), p.options().dtype(prec.param))
                                            : p.detach().to(prec.param));
      p.mutable_grad() = at::Tensor();  // a gradient from before would keep the old dtype
    }
  }

  // 6. hooks and initial data (while every parameter is still full-size: the accumulator caches
  // the shape)
  // before the installs' broadcasts: every rank has its values, or all throw (whether any parameter
  // is deferred is the same on every rank: it is part of the fingerprint)
  const bool deferred = ctx_.deferred_source() != nullptr;
  ctx_.set_deferred_source(nullptr);  // setup only: the caller owns the source
  if (deferred) ctx_.agree_fills("dedicate_params");
  for (const auto& r : table_routes_) r->install();
  dedicated_->install();
  // every other parameter (frozen ones, and trainable ones dmuon::replicate may take later)
  std::vector<WholeParam> rest;
  for (const ModelView::Tensor& item : view_.params)
    if (!routed(item.name)) rest.push_back({item.name, item.tensor, item.tensor.requires_grad()});
  local_ = std::make_unique<LocalRoute>(ctx_, std::move(rest));
  routes_ = {dedicated_.get()};
  for (const auto& r : table_routes_) routes_.push_back(r.get());
  routes_.push_back(local_.get());
  ctx_.drop_setup_callables();
}

void Runtime::check_deferred(uint64_t& digest) {
  const int rank = mesh().global_rank();
  const DedicateOptions& opts = ctx_.options();
  std::vector<std::pair<std::string, std::vector<int64_t>>> deferred;
  for (const ModelView::Tensor& item : view_.params) {
    const bool d = is_deferred(item.tensor);
    digest = Fnv1a(digest).u64(d ? 1 : 0).value();
    if (d) deferred.emplace_back(item.name, ctx_.region_of(item.name, item.tensor.sizes()).full_shape);
  }
  if (deferred.empty()) return;
  TORCH_CHECK_VALUE(opts.param_source, "rank ", rank, ": dedicate_params: parameter '", deferred.front().first, "' (and ",
              deferred.size() - 1, " more) is deferred (dmuon::defer_parameters released its storage), but "
              "DedicateOptions::param_source is unset, so there is nothing to fill it from. Pass a source: "
              "dmuon::seeded_init(seed, rule) for a fresh model, dmuon::safetensors_source(path) for weights.");
  ParamSource* source = opts.param_source.get();
  digest = Fnv1a(digest).u64(source->digest()).value();  // (ranks filling from different sources would drift)
  ctx_.set_deferred_source(source);
  try {
    source->check(deferred);
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, "rank ", rank, ": dedicate_params: the parameter source (", source->describe(),
                ") cannot fill this model: ", detail::error_text(e));
  }
}

void Runtime::check_tp_modules() const {
  const Mesh& mine = mesh();
  for (const auto& [name, theirs] : view_.tp_modules)
    TORCH_CHECK_VALUE(theirs == &mine, "rank ", mine.global_rank(), ": dedicate_params: tensor-parallel module '", name,
                "' was built on another mesh (tp_size ", theirs ? theirs->tp_size() : 0, ") than the one passed to "
                "dedicate_params (tp_size ", mine.tp_size(), "), so its all-reduces would run over a different "
                "group than dmuon's Newton-Schulz exchange. Build every TP module with the mesh you dedicate on.");
}

void Runtime::add_replicated(double bucket_mb, bool tp) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  const int rank = mesh().global_rank();
  TORCH_CHECK_VALUE(!replicated_, "rank ", rank, ": replicate was already called on this model.");
  TORCH_CHECK_VALUE(bucket_mb > 0, "rank ", rank, ": replicate: invalid bucket_mb: ", bucket_mb,
              ". Must be > 0 (MiB per coalesced all-reduce).");
  // the trainable parameters on no other route move from the local route to the replicated one
  replicated_owner_ = std::make_unique<ReplicatedRoute>(ctx_, local_->requiring_grad(), bucket_mb, tp);
  local_->drop_requiring_grad();
  replicated_ = replicated_owner_.get();
  routes_.insert(routes_.end() - 1, replicated_);  // before the local route
}

void Runtime::release_external(const std::vector<std::string>& names) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  const int rank = mesh().global_rank();
  std::set<std::string> gone;
  for (const std::string& name : names) {
    ParamView v;
    bool found = false;
    for (const Route* r : routes_)
      if ((found = r->describe(name, v))) break;
    if (!found && local_->holds_frozen(name)) {  // frozen: nothing trains it
      gone.insert(name);
      continue;
    }
    TORCH_CHECK_VALUE(found, "rank ", rank, ": no parameter '", name, "' in this dedicated model.");
    TORCH_CHECK_VALUE(v.route == RouteKind::Local, "rank ", rank, ": parameter '", name, "' was replaced after "
                      "dedicate_params, but dmuon trains it (route ", route_name(v.route), "): another wrapper (e.g. "
                      "FSDP2's fully_shard) took a parameter dmuon already owns. Keep FSDP2 off dmuon's parameters: "
                      "import dmuon before fully_shard (its patch skips them) or pass "
                      "ignored_params=dmuon.ignored_params(model) to fully_shard.");
    gone.insert(name);
  }
  local_->drop(gone);
  std::vector<ModelView::Tensor> kept;
  for (ModelView::Tensor& item : view_.params)
    if (!gone.count(item.name)) kept.push_back(std::move(item));
  view_.params = std::move(kept);
}

at::Tensor Runtime::master_of(const std::string& name) const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  for (const ModelView::Tensor& item : view_.params)
    if (item.name == name) return ctx_.master_of(item.tensor);
  return at::Tensor();
}

}  // namespace dmuon
