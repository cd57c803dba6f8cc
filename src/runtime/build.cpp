// Runtime setup: route the parameters (setup.cpp), plan owners, check the plan across ranks
// (fingerprint.cpp), then hand each route its parameters.
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <exception>
#include <set>

#include "dmuon/env.h"
#include "dmuon/tensor_parallel.h"
#include "runtime/dedicated_route.h"
#include "runtime/fingerprint.h"
#include "runtime/replicated_route.h"
#include "runtime/runtime.h"
#include "runtime/setup.h"
#include "runtime/sharded_route.h"

namespace dmuon {

Runtime::Runtime(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<Mesh> mesh, DedicateOptions opts, bool ddp)
    : model_(model),
      mesh_(std::move(mesh)),
      opts_(std::move(opts)),
      ddp_(ddp),
      id_(detail::next_runtime_id()),
      dedicated_(std::make_unique<DedicatedRoute>(*this, ddp)),
      sharded_(std::make_unique<ShardedRoute>(*this)),
      routes_{dedicated_.get(), sharded_.get()} {}

Runtime::~Runtime() = default;

void Runtime::build(const ParamPredicate& predicate) {
  auto m = model_.lock();
  const int rank = mesh_->global_rank();
  // 1.-2. the pure steps. A failure on some ranks only is shared at the plan check below: every
  // rank then fails, naming the ranks that failed, instead of the others waiting in the check's
  // collective until the timeout.
  Routing routing;
  std::vector<ParamSpec> full_specs;
  std::vector<Precision> precisions;
  std::exception_ptr setup_failure;
  const PlanOptions& po = opts_.plan;
  try {
    // 1. routes, precision, boundaries
    routing = route_params(*m, predicate, opts_, RoutingContext{rank, mesh_->is_2d(), ddp_, mesh_->has_tp()});
    for (const auto* group : {&routing.dedicated, &routing.sharded, &routing.base})
      for (const auto& r : *group) precision_[r.param.unsafeGetTensorImpl()] = r.prec;
    specs_ = routing.specs;
    for (const auto& r : routing.dedicated) boundary_of_param_.push_back(r.boundary);
    // tensor parallelism: which dedicated matrices are TP slices (specs_ keep the local shapes the
    // routes move; the planner sees the full ones)
    tp_split_ = check_tp_modules(*m);
    const int T = mesh_->tp_size();
    full_specs = specs_;
    for (size_t i = 0; i < specs_.size(); ++i)
      if (auto it = tp_split_.find(specs_[i].name); it != tp_split_.end()) {
        specs_[i].tp_split_dim = full_specs[i].tp_split_dim = it->second;
        full_specs[i].shape[static_cast<size_t>(it->second)] *= T;
      }
    // deferred parameters (deferred_init.h): the source is checked once; which parameters are
    // deferred is part of the fingerprint (the sharded route skips its initial broadcast for them)
    check_deferred(*m, routing.base_digest);
    // 2. plan (every rank, no communication)
    try {
      plan_ = plan_owners_tp(full_specs, mesh_->shard_size(), mesh_->replicate_size(), T, po);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rank ", rank, ": dedicate_params: owner planning failed: ", e.what());
    }
    for (const auto& r : routing.dedicated) precisions.push_back(r.prec);
  } catch (...) {
    setup_failure = std::current_exception();
  }
  // every rank agrees on the plan, or all throw
  check_plan_agreement(*mesh_, plan_, specs_, precisions, routing.base_digest, po, setup_failure);

  // 3. boundaries in model order of first appearance
  std::map<std::string, std::shared_ptr<torch::nn::Module>> modules;
  for (const auto& item : m->named_modules("", /*include_self=*/true)) modules[item.key()] = item.value();
  std::map<std::string, int> bindex;
  for (const auto& name : routing.boundary_order) {
    Boundary b;
    b.name = name;
    b.module = modules.at(name);
    b.index = static_cast<int>(boundaries_.size());
    if (auto it = routing.input_cast.find(name); it != routing.input_cast.end()) b.input_dtype = it->second;
    if (auto it = routing.output_cast.find(name); it != routing.output_cast.end()) b.output_dtype = it->second;
    bindex.emplace(name, b.index);
    boundaries_.push_back(std::move(b));
  }
  if (opts_.record_forward_profile.value_or(env::record_forward_profile()))
    for (const auto& B : boundaries_) unshard_stats_.push_back(BoundaryUnshardStats{B.name});

  // 4. the routes take their parameters: packed buffers (owners copy their masters before any
  // cast), then sharded slices of rank 0's value; deferred parameters are filled from the source,
  // each rank only what it keeps (replicated and frozen ones here, whole or as their TP slice)
  if (deferred_source_) {
    at::NoGradGuard ng;
    std::set<const c10::TensorImpl*> routed_here;
    for (const auto* group : {&routing.dedicated, &routing.sharded})
      for (const auto& r : *group) routed_here.insert(r.param.unsafeGetTensorImpl());
    for (auto& item : m->named_parameters(/*recurse=*/true)) {
      at::Tensor p = item.value();
      if (!is_deferred(p) || routed_here.count(p.unsafeGetTensorImpl())) continue;
      at::Tensor value = at::empty(p.sizes(), p.options().requires_grad(false));
      fill_from(*deferred_source_, item.key(), region_of(item.key(), p.sizes()), value);
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
    e.tp_owner = mesh_->has_tp() ? plan_.tp_owners[i] : -1;
    e.prec = r.prec;
    e.unshard = r.unshard;
    e.boundary = bindex.at(r.boundary);
    ++boundaries_[static_cast<size_t>(e.boundary)].num_params;
    entries.push_back(std::move(e));
  }
  dedicated_->build(std::move(entries), plan_, static_cast<int>(boundaries_.size()));
  for (const auto& r : routing.sharded) {
    const int b = bindex.at(r.boundary);
    ++boundaries_[static_cast<size_t>(b)].num_params;
    sharded_->add(r.name, r.param, b, r.prec);
  }

  // 5. mixed precision: replicated parameters with a master keep it (replicate() syncs it from
  // rank 0); then every parameter takes its forward dtype. Before any hook: autograd's accumulator
  // caches the dtype, and set_data with a new dtype detaches the parameter from an existing one.
  {
    at::NoGradGuard ng;
    for (const auto& r : routing.base)
      if (r.prec.has_master())
        set_master(r.param, r.param.detach().to(r.prec.master, /*non_blocking=*/false, /*copy=*/true));
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
  const bool deferred = deferred_source_ != nullptr;
  deferred_source_ = nullptr;  // setup only: the caller owns the source
  if (deferred) agree_fills("dedicate_params");
  sharded_->install();
  dedicated_->install();
}

void Runtime::check_deferred(const torch::nn::Module& model, uint64_t& digest) {
  const int rank = mesh_->global_rank();
  std::vector<std::pair<std::string, std::vector<int64_t>>> deferred;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const bool d = is_deferred(item.value());
    digest = digest * 1099511628211ull ^ (d ? 0x5bd1e995u : 0x27d4eb2fu);
    if (d) deferred.emplace_back(item.key(), region_of(item.key(), item.value().sizes()).full_shape);
  }
  if (deferred.empty()) return;
  TORCH_CHECK(opts_.param_source, "rank ", rank, ": dedicate_params: parameter '", deferred.front().first, "' (and ",
              deferred.size() - 1, " more) is deferred (dmuon::defer_parameters released its storage), but "
              "DedicateOptions::param_source is unset, so there is nothing to fill it from. Pass a source: "
              "dmuon::seeded_init(seed, rule) for a fresh model, dmuon::safetensors_source(path) for weights.");
  deferred_source_ = opts_.param_source.get();
  try {
    deferred_source_->check(deferred);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "rank ", rank, ": dedicate_params: the parameter source (", deferred_source_->describe(),
                ") cannot fill this model: ", e.what());
  }
}

TensorRegion Runtime::region_of(const std::string& name, at::IntArrayRef local_shape) const {
  auto it = tp_split_.find(name);
  return detail::tp_region(local_shape, it == tp_split_.end() ? -1 : it->second, mesh_->tp_rank(), mesh_->tp_size());
}

void Runtime::fill_from(ParamSource& source, const std::string& name, const TensorRegion& region, at::Tensor& out) {
  if (!fill_error_.empty()) return;  // the first failure is the one reported
  try {
    TORCH_CHECK(out.sizes().vec() == region.size, "'", name, "': the destination has shape ", out.sizes(),
                " but the region ", at::IntArrayRef(region.size));
    source.fill(name, region, out);
  } catch (const std::exception& e) {
    const auto* ce = dynamic_cast<const c10::Error*>(&e);
    fill_error_ = "reading '" + name + "' from " + source.describe() + ": " +
                  (ce ? ce->what_without_backtrace() : std::string(e.what()));
  }
}

void Runtime::agree_fills(const std::string& what) {
  const int n = mesh_->world_size();
  const at::Tensor mine = at::full({1}, fill_error_.empty() ? int64_t{0} : int64_t{1}, mesh_->options(at::kLong));
  at::Tensor all = at::empty({n}, mesh_->options(at::kLong));
  mesh_->world().allgather_flat(all, mine, what + ": parameter values read").wait_host();
  const at::Tensor host = all.cpu();
  std::string failed;
  for (int r = 0; r < n; ++r)
    if (host.data_ptr<int64_t>()[r] != 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  std::string mine_err = std::move(fill_error_);
  fill_error_.clear();
  TORCH_CHECK(failed.empty(), "rank ", mesh_->global_rank(), ": ", what, ": reading the parameter values failed on rank(s) ",
              failed, mine_err.empty() ? std::string(" (this rank read its share; see their errors)") : ": " + mine_err);
}

std::map<std::string, int> Runtime::check_tp_modules(const torch::nn::Module& model) const {
  const int rank = mesh_->global_rank();
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const auto* tp = dynamic_cast<const TensorParallel*>(item.value().get());
    if (!tp) continue;
    const Mesh* theirs = tp->tp_mesh().get();
    TORCH_CHECK(theirs == mesh_.get(), "rank ", rank, ": dedicate_params: tensor-parallel module '", item.key(),
                "' was built on another mesh (tp_size ", theirs ? theirs->tp_size() : 0, ") than the one passed to "
                "dedicate_params (tp_size ", mesh_->tp_size(), "), so its all-reduces would run over a different "
                "group than dmuon's Newton-Schulz exchange. Build every TP module with the mesh you dedicate on.");
  }
  return tp_split_dims(model);
}

void Runtime::add_replicated(double bucket_mb, bool tp) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  TORCH_CHECK(!replicated_, "rank ", mesh_->global_rank(), ": replicate was already called on this model.");
  TORCH_CHECK(bucket_mb > 0, "rank ", mesh_->global_rank(), ": replicate: invalid bucket_mb: ", bucket_mb,
              ". Must be > 0 (MiB per coalesced all-reduce).");
  auto route = std::make_unique<ReplicatedRoute>(*this, bucket_mb, tp);
  replicated_ = route.get();
  routes_.push_back(replicated_);
  local_params_.reset();  // the replicated parameters leave the local set
  extra_routes_.push_back(std::move(route));
}

}  // namespace dmuon
