// dedicate_params and the public queries over a dedicated model.
#include <c10/util/Exception.h>

#include <map>

#include "dmuon/tensor_parallel.h"
#include "runtime/dedicated_route.h"
#include "runtime/replicated_route.h"
#include "runtime/runtime.h"
#include "runtime/sharded_route.h"
#include "comm/error_text.h"

namespace dmuon {

namespace {
void check_dedicate_options(const Mesh& mesh, const DedicateOptions& options) {
  if (options.compute_dtype) {
    const auto t = *options.compute_dtype;
    TORCH_CHECK_VALUE(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16, "rank ",
                mesh.global_rank(), ": dedicate_params: compute_dtype ", t, " cannot carry parameters and "
                "gradients; use a floating type (bfloat16, float16, float32 or float64).");
  }
  TORCH_CHECK_VALUE(options.replicate_broadcast_bucket_mb >= 0, "rank ", mesh.global_rank(),
              ": dedicate_params: replicate_broadcast_bucket_mb must be >= 0 (0 = one publish per unit), got ",
              options.replicate_broadcast_bucket_mb);
  TORCH_CHECK_VALUE(options.forward_prefetch_depth >= 0, "rank ", mesh.global_rank(),
              ": dedicate_params: forward_prefetch_depth must be >= 0, got ", options.forward_prefetch_depth);
  const std::string& reuse = options.tp_buffer_reuse;
  TORCH_CHECK_VALUE(reuse == "off" || reuse == "gather" || reuse == "scatter" || reuse == "all", "rank ",
              mesh.global_rank(), ": dedicate_params: tp_buffer_reuse is '", reuse, "'; use \"off\", \"gather\" "
              "(keep the TP owner's gather scratch), \"scatter\" (keep the scatter's send and receive buffers) or "
              "\"all\".");
}

std::map<std::string, OwnerCoord> dedicate_impl(const std::shared_ptr<torch::nn::Module>& model,
                                                const std::shared_ptr<Mesh>& mesh, const ParamPredicate& predicate,
                                                const DedicateOptions& options, bool ddp) {
  TORCH_CHECK_VALUE(model, "dedicate_params: the model is null.");
  TORCH_CHECK_VALUE(mesh, "dedicate_params: the mesh is null; create one with dmuon::Mesh::create.");
  auto state = std::make_shared<Runtime>(model_view(*model), model, mesh, options, ddp);
  state->build(predicate, [&] {  // (inside the plan agreement: a refusal on one rank fails every rank)
    TORCH_CHECK_VALUE(!detail::state_of_model(model.get()), "rank ", mesh->global_rank(),
                      ": dedicate_params was already called on this model. Dedicate a model once; to change "
                      "options, build a fresh model.");
    for (const auto& item : model->named_modules("", true))
      TORCH_CHECK_VALUE(!detail::boundary_of_module(item.value().get()).first, "rank ", mesh->global_rank(),
                        ": dedicate_params: submodule '", item.key(), "' already belongs to a dedicated model.");
    check_dedicate_options(*mesh, options);
  });
  detail::register_state(model, state);
  for (const auto& b : state->boundaries())
    if (auto mod = b.module.lock()) detail::register_boundary(mod, state, b.index);
  std::map<std::string, OwnerCoord> out;
  for (const auto& e : state->dedicated().entries()) out[e.name] = e.owner;
  return out;
}

DedicatedParam to_public(const DedicatedEntry& e, const Runtime& s) {
  DedicatedParam d;
  d.name = e.name;
  d.param = e.param;
  d.shape = e.shape;
  d.owner = e.owner;
  d.owner_rank = e.owner_rank;
  d.boundary = s.boundaries()[static_cast<size_t>(e.boundary)].name;
  d.is_owner = e.is_owner;
  d.master = s.master_of(e.param);
  d.tp_split_dim = e.tp_dim;
  d.tp_owner = e.tp_owner;
  d.full_shape = e.full_shape;
  return d;
}
}  // namespace

std::map<std::string, OwnerCoord> dedicate_params(const std::shared_ptr<torch::nn::Module>& model,
                                                  const std::shared_ptr<Mesh>& mesh, const ParamPredicate& predicate,
                                                  const DedicateOptions& options) {
  return dedicate_impl(model, mesh, predicate, options, /*ddp=*/false);
}

namespace {
// The DDP path's mesh: 1-D, no TP axis (dedicate_params_ddp_tp has its own).
void check_ddp_mesh(const Mesh& mesh, const char* fn) {
  TORCH_CHECK_VALUE(!mesh.is_hsdp(), "rank ", mesh.global_rank(), ": ", fn, " accepts a 1-D mesh only, got a ",
                    mesh.replicate_size(), " x ", mesh.shard_size(), " (replicate x shard) mesh. For HSDP use "
                    "dedicate_params with a 2-D mesh.");
  TORCH_CHECK_VALUE(!mesh.has_tp(), "rank ", mesh.global_rank(), ": ", fn, ": the mesh has a tensor-parallel axis "
                    "(tp_size ", mesh.tp_size(), "); the DDP path with tensor parallelism is dedicate_params_ddp_tp "
                    "(and replicate_tp for the other parameters).");
}
}  // namespace

std::map<std::string, OwnerCoord> dedicate_params_ddp(const std::shared_ptr<torch::nn::Module>& model,
                                                      const std::shared_ptr<Mesh>& mesh,
                                                      const ParamPredicate& predicate,
                                                      const DedicateOptions& options) {
  TORCH_CHECK_VALUE(mesh, "dedicate_params_ddp: the mesh is null; create one with dmuon::Mesh::create.");
  check_ddp_mesh(*mesh, "dedicate_params_ddp");
  return dedicate_impl(model, mesh, predicate, options, /*ddp=*/true);
}

std::map<std::string, OwnerCoord> dedicate_params_ddp_tp(const std::shared_ptr<torch::nn::Module>& model,
                                                         const std::shared_ptr<Mesh>& mesh,
                                                         const ParamPredicate& predicate,
                                                         const DedicateOptions& options) {
  TORCH_CHECK_VALUE(mesh, "dedicate_params_ddp_tp: the mesh is null; create one with dmuon::Mesh::create.");
  TORCH_CHECK_VALUE(!mesh->is_hsdp(), "rank ", mesh->global_rank(), ": dedicate_params_ddp_tp accepts a data-parallel x "
              "tensor-parallel mesh without a replicate axis, got replicate_size ", mesh->replicate_size(),
              ". For HSDP with TP use dedicate_params.");
  return dedicate_impl(model, mesh, predicate, options, /*ddp=*/true);
}

std::vector<DedicatedParam> get_dedicated_params(const torch::nn::Module& model) {
  auto s = detail::state_of_model(&model);
  std::vector<DedicatedParam> out;
  if (!s) return out;
  for (const auto& e : s->dedicated().entries()) out.push_back(to_public(e, *s));
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


const OwnerPlan* get_owner_plan(const torch::nn::Module& model) {
  auto s = detail::state_of_model(&model);
  return s ? &s->plan() : nullptr;
}

std::shared_ptr<Mesh> get_mesh(const torch::nn::Module& model) {
  auto s = detail::state_of_model(&model);
  return s ? s->mesh_ptr() : nullptr;
}

std::vector<std::pair<std::string, at::Tensor>> get_base_params(const torch::nn::Module& model) {
  auto s = detail::state_of_model(&model);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model.named_parameters(true)) {
    if (!item.value().requires_grad()) continue;
    if (s && s->routed(item.key())) continue;
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

namespace {
std::shared_ptr<Runtime> dedicate_view_impl(ModelView view, const std::shared_ptr<Mesh>& mesh,
                                            const ParamPredicate& predicate, const DedicateOptions& options, bool ddp) {
  TORCH_CHECK_VALUE(mesh, "dedicate_model_view: the mesh is null; create one with dmuon::Mesh::create.");
  auto state = std::make_shared<Runtime>(std::move(view), nullptr, mesh, options, ddp);
  state->build(predicate, [&] { check_dedicate_options(*mesh, options); });
  detail::register_runtime(state);
  return state;
}
}  // namespace

std::shared_ptr<Runtime> dedicate_model_view(ModelView view, const std::shared_ptr<Mesh>& mesh,
                                             const ParamPredicate& predicate, const DedicateOptions& options) {
  return dedicate_view_impl(std::move(view), mesh, predicate, options, /*ddp=*/false);
}

std::shared_ptr<Runtime> dedicate_model_view_ddp(ModelView view, const std::shared_ptr<Mesh>& mesh,
                                                 const ParamPredicate& predicate, const DedicateOptions& options) {
  TORCH_CHECK_VALUE(mesh, "dedicate_params_ddp: the mesh is null.");
  check_ddp_mesh(*mesh, "dedicate_params_ddp");
  return dedicate_view_impl(std::move(view), mesh, predicate, options, /*ddp=*/true);
}

std::shared_ptr<Runtime> dedicate_model_view_ddp_tp(ModelView view, const std::shared_ptr<Mesh>& mesh,
                                                    const ParamPredicate& predicate, const DedicateOptions& options) {
  TORCH_CHECK_VALUE(mesh, "dedicate_params_ddp_tp: the mesh is null.");
  TORCH_CHECK_VALUE(!mesh->is_hsdp(), "rank ", mesh->global_rank(), ": dedicate_params_ddp_tp accepts a data-parallel x "
              "tensor-parallel mesh without a replicate axis, got replicate_size ", mesh->replicate_size(),
              ". For HSDP with TP use dedicate_params.");
  return dedicate_view_impl(std::move(view), mesh, predicate, options, /*ddp=*/true);
}

std::shared_ptr<RuntimeFace> runtime_face(const std::shared_ptr<Runtime>& runtime) {
  TORCH_CHECK_VALUE(runtime, "runtime_face: the runtime is null (dedicate_model_view returns it).");
  return runtime;
}

std::vector<std::string> runtime_boundaries(const Runtime& runtime) {
  std::vector<std::string> out;
  for (const Boundary& b : runtime.boundaries()) out.push_back(b.name);
  return out;
}

std::vector<DedicatedParam> runtime_dedicated_params(const Runtime& runtime) {
  std::vector<DedicatedParam> out;
  for (const auto& e : runtime.dedicated().entries()) out.push_back(to_public(e, runtime));
  return out;
}

void runtime_replicate(const std::shared_ptr<Runtime>& runtime, double bucket_mb, bool tp) {
  TORCH_CHECK_VALUE(runtime, tp ? "replicate_tp" : "replicate", ": the runtime is null (dedicate_model_view returns it).");
  runtime->add_replicated(bucket_mb, tp);
}

std::vector<std::pair<std::string, at::Tensor>> runtime_full_params(const std::shared_ptr<Runtime>& runtime) {
  TORCH_CHECK_VALUE(runtime, "full params: the runtime is null (dedicate_model_view returns it).");
  runtime->drain("get_model_state_dict");  // in-flight publishes land first
  std::map<std::string, at::Tensor> full;
  runtime->gather_params([&](const std::string& name, const at::Tensor& t) { full[name] = t; });
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto& split = runtime->tp_split();
  for (const ModelView::Tensor& item : runtime->view().params)  // model order: the TP gathers match on every rank
    if (auto it = full.find(item.name); it != full.end()) {
      const auto d = split.find(item.name);  // a TP slice: every TP rank's, concatenated
      out.emplace_back(item.name, d == split.end() ? it->second : tp_gather(it->second, d->second, runtime->mesh()));
    }
  return out;
}

void runtime_assign_params(const std::shared_ptr<Runtime>& runtime, std::map<std::string, at::Tensor> values) {
  TORCH_CHECK_VALUE(runtime, "set_model_state_dict: the runtime is null (dedicate_model_view returns it).");
  runtime->drain("set_model_state_dict");
  auto source = tensor_dict_source(std::move(values));
  try {
    source->check(runtime->param_shapes());
  } catch (const std::exception& e) {
    TORCH_CHECK_VALUE(false, "rank ", runtime->mesh().global_rank(), ": set_model_state_dict: ", detail::error_text(e));
  }
  runtime->assign_params(*source, {}, "set_model_state_dict");
}

bool runtime_set_no_sync(const std::shared_ptr<Runtime>& runtime, bool on) {
  TORCH_CHECK_VALUE(runtime, "no_sync: the runtime is null (dedicate_model_view returns it).");
  return runtime->set_no_sync(on);
}

void runtime_discard_grads(const std::shared_ptr<Runtime>& runtime, bool set_to_none) {
  TORCH_CHECK_VALUE(runtime, "zero_grad: the runtime is null (dedicate_model_view returns it).");
  runtime->discard_grads(set_to_none);
}

void runtime_set_forward_prefetch_depth(const std::shared_ptr<Runtime>& runtime, int depth) {
  TORCH_CHECK_VALUE(runtime, "forward_prefetch_depth: the runtime is null (dedicate_model_view returns it).");
  runtime->set_forward_prefetch_depth(depth);
}

void runtime_release_params(const std::shared_ptr<Runtime>& runtime, const std::vector<std::string>& names) {
  TORCH_CHECK_VALUE(runtime, "release params: the runtime is null (dedicate_model_view returns it).");
  runtime->release_external(names);
}

at::Tensor runtime_master_of(const std::shared_ptr<Runtime>& runtime, const std::string& name) {
  TORCH_CHECK_VALUE(runtime, "master_of: the runtime is null (dedicate_model_view returns it).");
  return runtime->master_of(name);
}

std::vector<std::pair<std::string, std::string>> runtime_param_routes(const Runtime& runtime) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const ParamView& v : runtime.describe()) out.emplace_back(v.name, route_name(v.route));
  return out;
}

namespace {
void replicate_impl(const std::shared_ptr<torch::nn::Module>& model, const std::shared_ptr<Mesh>& mesh, double bucket_mb,
                    bool tp) {
  TORCH_CHECK_VALUE(model && mesh, "replicate: model and mesh must not be null.");
  auto s = detail::state_of_model(model.get());
  if (!s) {
    // A model with no dedicated parameters: an empty runtime carries the hooks.
    dedicate_params(model, mesh, [](const std::string&, const at::Tensor&) { return false; });
    s = detail::state_of_model(model.get());
  }
  TORCH_CHECK_VALUE(s->mesh_ptr().get() == mesh.get(), "rank ", mesh->global_rank(),
              ": replicate: the model was dedicated on another mesh; pass the same mesh to both.");
  s->add_replicated(bucket_mb, tp);
}
}  // namespace

std::shared_ptr<torch::nn::Module> replicate(const std::shared_ptr<torch::nn::Module>& model,
                                             const std::shared_ptr<Mesh>& mesh, double bucket_mb) {
  replicate_impl(model, mesh, bucket_mb, /*tp=*/false);
  return model;
}

std::shared_ptr<torch::nn::Module> replicate_tp(const std::shared_ptr<torch::nn::Module>& model,
                                                const std::shared_ptr<Mesh>& mesh, double bucket_mb) {
  replicate_impl(model, mesh, bucket_mb, /*tp=*/true);
  return model;
}

std::optional<ReplicatedGroup> get_replicated_group(const torch::nn::Module& model) {
  auto s = detail::state_of_model(&model);
  if (!s || !s->replicated()) return std::nullopt;
  const ReplicatedRoute& r = *s->replicated();
  ReplicatedGroup g;
  g.names = r.names();
  g.tp_split_dims = r.tp_split_dims();
  g.num_buckets = r.num_buckets();
  g.group_size = s->mesh().data_parallel_size();
  g.tp = r.tp();
  return g;
}

}  // namespace dmuon
