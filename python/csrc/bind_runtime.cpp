// dmuon._C: meshes over torch.distributed process groups, dedicated ownership of a Python model (as a
// ModelView), its boundary scopes, and Muon. The Python package (dmuon/_runtime.py) turns these into
// the API reference's functions; nothing here is meant to be called directly.
#include <pybind11/functional.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "dmuon/checkpoint.h"
#include "dmuon/dedicate.h"
#include "dmuon/diagnostics.h"
#include "dmuon/memory.h"
#include "dmuon/mesh.h"
#include "dmuon/model_view.h"
#include "dmuon/muon.h"

namespace dmuon::python {

namespace {

using namespace pybind11::literals;

// What an option of type T must be, in Python's words (for the TypeError of a wrong type).
template <typename T>
std::string python_kind() {
  if constexpr (std::is_same_v<T, bool>) return "a bool";
  else if constexpr (std::is_integral_v<T>) return "an int";
  else if constexpr (std::is_floating_point_v<T>) return "a float";
  else if constexpr (std::is_same_v<T, std::string>) return "a str";
  else if constexpr (std::is_same_v<T, at::ScalarType>) return "a torch.dtype";
  else if constexpr (std::is_same_v<T, std::pair<double, double>>) return "a pair of floats";
  else if constexpr (std::is_same_v<T, py::list>) return "a list";
  else if constexpr (std::is_same_v<T, NewtonSchulz>) return "a backend name ('gram', 'direct') or a dmuon.NewtonSchulz";
  else return "a callable";
}

// Option `key` of a keyword dict: unset or None -> nullopt; a value of the wrong type is a TypeError
// naming the option, what it must be and what was given (not pybind11's "Unable to cast ...").
template <typename T>
std::optional<T> get_opt(const py::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return std::nullopt;
  const py::object v = d[key];
  // a bool is an int to Python: ns_steps=True would be 1
  const bool bool_for_number = (std::is_integral_v<T> || std::is_floating_point_v<T>) && !std::is_same_v<T, bool> &&
                               py::isinstance<py::bool_>(v);
  // and a flag is True or False: pybind would take 0 or a list for one (their truth value)
  const std::string type_name = Py_TYPE(v.ptr())->tp_name;  // (numpy's bool: "numpy.bool_", "numpy.bool" in 2.x)
  const bool number_for_bool = std::is_same_v<T, bool> && !py::isinstance<py::bool_>(v) &&
                               type_name != "numpy.bool_" && type_name != "numpy.bool";
  if (!bool_for_number && !number_for_bool) {
    try {
      return v.cast<T>();
    } catch (const py::cast_error&) {
    }
  }
  // an int too large for the option's C++ integer: out of range, not of the wrong type
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
    TORCH_CHECK_VALUE(!(py::isinstance<py::int_>(v) && !py::isinstance<py::bool_>(v)), "dmuon: option '", key, "' is ",
                      py::repr(v).cast<std::string>(), ", beyond what a ", sizeof(T) * 8, "-bit integer holds.");
  // (c10::TypeError: a TypeError in Python, and a caller mistake to the ranks' agreements)
  TORCH_CHECK_TYPE(false, "dmuon: option '", key, "' must be ", python_kind<T>(), ", got ",
                   py::repr(v).cast<std::string>(), " (", Py_TYPE(v.ptr())->tp_name, ").");
}

// One policy as the Python side normalised it (dmuon/_runtime.py: dtypes as torch.dtype, known keys).
ParamPolicy param_policy(const py::dict& d) {
  ParamPolicy p;
  if (auto v = get_opt<std::string>(d, "route")) p.route = *v;
  if (auto v = get_opt<std::string>(d, "muon_forward_unshard")) p.muon_forward_unshard = *v;
  p.param_dtype = get_opt<at::ScalarType>(d, "param_dtype");
  p.grad_dtype = get_opt<at::ScalarType>(d, "grad_dtype");
  p.master_dtype = get_opt<at::ScalarType>(d, "master_dtype");
  p.optim_dtype = get_opt<at::ScalarType>(d, "optim_dtype");
  p.cast_forward_inputs = get_opt<bool>(d, "cast_forward_inputs");
  p.output_dtype = get_opt<at::ScalarType>(d, "output_dtype");
  return p;
}

// A user's (name, param) -> str callable (route_hint_fn, assignment_group_key_fn) whose result is checked: a
// wrong type is a TypeError naming the option and the parameter (pybind's cast said "Unable to cast ... '?'").
// `keyed`: any hashable is a key (a str as itself, others by type and repr: 3 and "3" stay apart); else None is "".
using NameParamFn = std::function<std::string(const std::string&, const at::Tensor&)>;
NameParamFn checked_str_callable(const py::dict& d, const char* key, bool keyed) {
  using Callable = std::function<py::object(const std::string&, const at::Tensor&)>;
  auto fn = get_opt<Callable>(d, key);
  if (!fn) return {};
  return caller_mistakes_kept(NameParamFn([fn = *fn, key, keyed](const std::string& name, const at::Tensor& p) {
    py::gil_scoped_acquire gil;
    const py::object r = fn(name, p);
    if (py::isinstance<py::str>(r)) return r.cast<std::string>();
    if (!keyed && r.is_none()) return std::string();
    if (keyed && py::hash(r) != -1)  // (py::hash raises TypeError for an unhashable value)
      return std::string(Py_TYPE(r.ptr())->tp_name) + ":" + py::repr(r).cast<std::string>();
    TORCH_CHECK_TYPE(false, "dmuon: option '", key, "' returned ", py::repr(r).cast<std::string>(), " (",
                     Py_TYPE(r.ptr())->tp_name, ") for parameter '", name, "'; it must return ",
                     keyed ? "a str (or another hashable key)" : "a route name: \"muon\", \"adamw\", "
                     "\"sharded_adamw\", or \"\" / None for no hint", ".");
    return std::string();
  }));
}

DedicateOptions dedicate_options(const py::dict& d) {
  static const char* const known[] = {"compute_dtype", "reshard_after_forward", "hook_boundary_strict",
                                      "hook_boundary_resolver", "assignment_group_key_fn", "route_hint_fn",
                                      "max_owners_per_group", "owner_strategy", "owner_cost_model",
                                      "hsdp_column_balance", "pack_small_params", "muon_forward_unshard",
                                      "forward_prefetch_depth", "replicate_async", "record_forward_profile",
                                      "param_policy", "param_policy_fn", "replicate_broadcast_bucket_mb",
                                      "delay_stage2_to_optimizer", "tp_buffer_reuse"};
  for (const auto& [k, v] : d) {
    const std::string key = k.cast<std::string>();
    bool ok = false;
    for (const char* n : known) ok = ok || key == n;
    TORCH_CHECK_VALUE(ok, "dedicate_params: unknown option '", key, "'");
  }
  DedicateOptions o;
  o.compute_dtype = get_opt<at::ScalarType>(d, "compute_dtype");
  if (auto v = get_opt<bool>(d, "reshard_after_forward")) o.reshard_after_forward = *v;
  if (auto v = get_opt<bool>(d, "hook_boundary_strict")) o.hook_boundary_strict = *v;
  // the user's callables: a ValueError / TypeError they raise is a caller mistake on every rank
  if (auto v = get_opt<HookBoundaryResolver>(d, "hook_boundary_resolver")) o.hook_boundary_resolver = caller_mistakes_kept(*v);
  o.assignment_group_key_fn = checked_str_callable(d, "assignment_group_key_fn", /*keyed=*/true);
  o.route_hint_fn = checked_str_callable(d, "route_hint_fn", /*keyed=*/false);
  o.plan.max_owners_per_group = get_opt<int>(d, "max_owners_per_group");
  o.plan.owner_strategy = get_opt<std::string>(d, "owner_strategy");
  o.plan.owner_cost_model = get_opt<std::string>(d, "owner_cost_model");
  o.plan.hsdp_column_balance = get_opt<bool>(d, "hsdp_column_balance");
  o.plan.pack_small_params = get_opt<bool>(d, "pack_small_params");
  if (auto v = get_opt<std::string>(d, "muon_forward_unshard")) o.muon_forward_unshard = *v;
  if (auto v = get_opt<int>(d, "forward_prefetch_depth")) o.forward_prefetch_depth = *v;
  if (auto v = get_opt<bool>(d, "replicate_async")) o.replicate_async = *v;
  o.record_forward_profile = get_opt<bool>(d, "record_forward_profile");
  if (auto v = get_opt<py::list>(d, "param_policy"))  // [(match, policy dict)], in order
    for (const auto& item : *v) {
      const auto pair = item.cast<std::pair<std::string, py::dict>>();
      o.param_policy.push_back({pair.first, param_policy(pair.second)});
    }
  // returns a normalised dict or None; pybind's std::function wrapper takes the GIL to call and to release it
  using PolicyCallable = std::function<py::object(const std::string&, const at::Tensor&)>;
  if (auto fn = get_opt<PolicyCallable>(d, "param_policy_fn"))
    o.param_policy_fn = [fn = caller_mistakes_kept(*fn)](const std::string& name, const at::Tensor& param) -> std::optional<ParamPolicy> {
      py::gil_scoped_acquire gil;
      py::object r = fn(name, param);
      if (r.is_none()) return std::nullopt;
      return param_policy(r.cast<py::dict>());
    };
  if (auto v = get_opt<double>(d, "replicate_broadcast_bucket_mb")) o.replicate_broadcast_bucket_mb = *v;
  if (auto v = get_opt<bool>(d, "delay_stage2_to_optimizer")) o.delay_stage2_to_optimizer = *v;
  if (auto v = get_opt<std::string>(d, "tp_buffer_reuse")) o.tp_buffer_reuse = *v;
  return o;
}

MuonOptions muon_options(const py::dict& d) {
  MuonOptions o;
  if (auto v = get_opt<double>(d, "lr")) o.lr = *v;
  if (auto v = get_opt<double>(d, "momentum")) o.momentum = *v;
  if (auto v = get_opt<double>(d, "weight_decay")) o.weight_decay = *v;
  if (auto v = get_opt<int>(d, "ns_steps")) o.ns_steps = *v;
  if (auto v = get_opt<double>(d, "adamw_lr")) o.adamw_lr = *v;
  if (auto v = get_opt<std::pair<double, double>>(d, "adamw_betas")) o.adamw_betas = *v;
  if (auto v = get_opt<double>(d, "adamw_weight_decay")) o.adamw_weight_decay = *v;
  if (auto v = get_opt<double>(d, "adamw_eps")) o.adamw_eps = *v;
  if (d.contains("ns_backend") && !d["ns_backend"].is_none()) {
    if (py::isinstance<py::str>(d["ns_backend"])) o.ns_backend = d["ns_backend"].cast<std::string>();
    else o.ns = *get_opt<NewtonSchulz>(d, "ns_backend");
  }
  if (auto v = get_opt<bool>(d, "nesterov")) o.nesterov = *v;
  o.replicate_async = get_opt<bool>(d, "replicate_async");
  if (auto v = get_opt<bool>(d, "record_step_profile")) o.record_step_profile = *v;
  if (auto v = get_opt<int>(d, "post_step_prefetch_groups")) o.post_step_prefetch_groups = *v;
  if (auto v = get_opt<bool>(d, "post_step_prefetch_sharded_adamw")) o.post_step_prefetch_sharded_adamw = *v;
  if (auto v = get_opt<bool>(d, "sharded_adamw_unshard_separate_stream")) o.sharded_adamw_unshard_separate_stream = *v;
  if (auto v = get_opt<bool>(d, "group_prepare_ahead")) o.group_prepare_ahead = *v;
  o.fused = get_opt<bool>(d, "fused");
  o.foreach = get_opt<bool>(d, "foreach");
  if (auto v = get_opt<bool>(d, "first_step_progress_log")) o.first_step_progress_log = *v;
  if (auto v = get_opt<int>(d, "first_step_progress_log_limit")) o.first_step_progress_log_limit = *v;
  if (auto v = get_opt<bool>(d, "tp_distributed_gram")) o.tp_distributed_gram = *v;
  if (auto v = get_opt<std::string>(d, "tp_distributed_gram_policy")) o.tp_distributed_gram_policy = *v;
  if (auto v = get_opt<double>(d, "tp_distributed_gram_max_factor_to_scatter_ratio"))
    o.tp_distributed_gram_max_factor_to_scatter_ratio = *v;
  if (auto v = get_opt<py::list>(d, "param_groups"))  // the user's groups as dmuon/_runtime.py normalised them
    for (const auto& item : *v) {
      const py::dict g = item.cast<py::dict>();
      MuonParamGroup pg;
      pg.name = g["name"].cast<std::string>();
      pg.params = g["params"].cast<std::vector<at::Tensor>>();
      pg.lr = get_opt<double>(g, "lr");
      pg.momentum = get_opt<double>(g, "momentum");
      pg.weight_decay = get_opt<double>(g, "weight_decay");
      pg.adamw_lr = get_opt<double>(g, "adamw_lr");
      pg.adamw_weight_decay = get_opt<double>(g, "adamw_weight_decay");
      pg.nesterov = get_opt<bool>(g, "nesterov");
      pg.ns_steps = get_opt<int>(g, "ns_steps");
      pg.adamw_betas = get_opt<std::pair<double, double>>(g, "adamw_betas");
      pg.adamw_eps = get_opt<double>(g, "adamw_eps");
      o.param_groups.push_back(std::move(pg));
    }
  return o;
}

MuonGroupOptions& group_options(Muon& opt, size_t i) {
  TORCH_CHECK_VALUE(i < opt.param_groups().size(), "Muon: no parameter group ", i);
  return static_cast<MuonGroupOptions&>(opt.param_groups()[i].options());
}

// Runs `fn` without the GIL; the core's TORCH_WARN inside it become Python UserWarnings (warnings.warn) when it
// returns (an exception wins over them).
template <typename F>
void with_py_warnings(F&& fn) {
  torch::PyWarningHandler warnings;
  try {
    py::gil_scoped_release nogil;
    fn();
  } catch (...) {
    warnings.set_in_exception();
    throw;
  }
}

// One counter of the mesh's collectives (bytes or calls) by operation name.
py::dict per_op(Mesh& mesh, int64_t (CommCounters::*read)(CommOp) const) {
  py::dict out;
  for (int op = 0; op < static_cast<int>(CommOp::kCount); ++op)
    out[comm_op_name(static_cast<CommOp>(op))] = (mesh.counters().*read)(static_cast<CommOp>(op));
  return out;
}

}  // namespace

void bind_runtime(py::module_& m) {
  const auto release = py::call_guard<py::gil_scoped_release>();
  // Mesh::set_*_group: a torch group (its backend for the mesh's device) and its members' world-group ranks
  auto set_twin = [](void (Mesh::*set)(const MeshGroup&), const char* what) {
    return [set, what](Mesh& mesh, const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::vector<int> ranks) {
      TORCH_CHECK_VALUE(group, what, ": the process group is None");
      (mesh.*set)(MeshGroup{group->getBackend(mesh.device().type()), std::move(ranks)});
    };
  };

  py::class_<Mesh, std::shared_ptr<Mesh>>(m, "_Mesh")
      .def_property_readonly("global_rank", &Mesh::global_rank)
      .def_property_readonly("world_size", &Mesh::world_size)
      .def_property_readonly("shard_rank", &Mesh::shard_rank)
      .def_property_readonly("shard_size", &Mesh::shard_size)
      .def_property_readonly("replicate_rank", &Mesh::replicate_rank)
      .def_property_readonly("replicate_size", &Mesh::replicate_size)
      .def_property_readonly("tp_rank", &Mesh::tp_rank)
      .def_property_readonly("tp_size", &Mesh::tp_size)
      .def_property_readonly("policy", &Mesh::policy)
      .def_property_readonly("timeout_s", [](const Mesh& mesh) { return static_cast<double>(mesh.timeout().count()) / 1000.0; })
      .def_property_readonly("has_sharded_unshard_group", &Mesh::has_sharded_unshard_group)
      .def("set_sharded_unshard_group", set_twin(&Mesh::set_sharded_unshard_group, "set_sharded_unshard_group"),
           "group"_a, "ranks"_a)
      .def_property_readonly("has_replicate_publish_group", &Mesh::has_replicate_publish_group)
      .def("set_replicate_publish_group", set_twin(&Mesh::set_replicate_publish_group, "set_replicate_publish_group"),
           "group"_a, "ranks"_a)
      .def("bytes", [](Mesh& mesh) { return per_op(mesh, &CommCounters::bytes); },
           "Bytes this rank's collectives moved so far, by operation (communicator.h's convention).")
      .def("calls", [](Mesh& mesh) { return per_op(mesh, &CommCounters::calls); },
           "Collectives this rank issued so far, by operation.");
  m.def("_install_counting_allocator", &memory::install_counting_allocator,
        "Wrap LibTorch's CPU allocator with dmuon's counter (idempotent): CPU tensor bytes allocated from now on "
        "are counted (live and peak, per phase).");
  m.def("_counting_allocator_installed", &memory::counting_allocator_installed);
  m.def(  // the core's ranges for an AdamW group that only torch's AdamW (on FSDP2's shards) reads
      "_check_adamw_group",
      [](double lr, double weight_decay, double beta1, double beta2, double eps, const std::string& where) {
        MuonGroupOptions g(lr);
        g.is_muon(false).weight_decay(weight_decay).beta1(beta1).beta2(beta2).eps(eps);
        check_group_options(g, where);
      },
      "lr"_a, "weight_decay"_a, "beta1"_a, "beta2"_a, "eps"_a, "where"_a);
  m.def(
      "_tensor_memory_stats",
      [](const std::string& device) {
        const memory::Stats s = memory::device_stats(at::Device(device));
        py::dict phases;
        for (int ph = 0; ph < memory::kNumPhases; ++ph)
          phases[memory::phase_name(static_cast<memory::Phase>(ph))] = s.peak_by_phase[static_cast<size_t>(ph)];
        return py::dict("current"_a = s.current, "peak"_a = s.peak, "allocations"_a = s.allocations,
                        "peak_by_phase"_a = phases);
      },
      "device"_a);
  m.def("_reset_tensor_memory_peaks", [](const std::string& device) { memory::reset_device_peaks(at::Device(device)); },
        "device"_a);
  m.def(
      "_collective_timeout",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::string& device) {
        return static_cast<double>(collective_timeout(group, at::Device(device)).count()) / 1000.0;
      },
      "The collective timeout dmuon applies over `group`, in seconds: DMUON_COLLECTIVE_TIMEOUT, else the shorter "
      "of the group's own timeout and the default group's.",
      "group"_a, "device"_a);
  m.def(
      "_mesh",
      [](const std::vector<std::pair<c10::intrusive_ptr<c10d::ProcessGroup>, std::vector<int>>>& groups,
         const std::string& device, const std::string& policy, double timeout_s,
         const std::optional<std::pair<c10::intrusive_ptr<c10d::ProcessGroup>, std::vector<int>>>& tp,
         const std::optional<std::pair<c10::intrusive_ptr<c10d::ProcessGroup>, std::vector<int>>>& dp) {
        // (world, shard[, replicate]) and, with tensor parallelism, tp and dp: this rank's group of each
        // axis with its members' world-group ranks
        TORCH_CHECK_VALUE(groups.size() == 2 || groups.size() == 3, "dmuon: a mesh takes 2 or 3 groups");
        MeshOptions o;
        o.process_group_policy = policy;  // the Python side cloned (isolated) or chose (shared) the groups
        o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
        o.device = at::Device(device);
        auto group = [&](const std::pair<c10::intrusive_ptr<c10d::ProcessGroup>, std::vector<int>>& pg) {
          TORCH_CHECK_VALUE(pg.first, "dmuon: a process group of the mesh is None");
          return MeshGroup{pg.first->getBackend(o.device->type()), pg.second};
        };
        MeshGroups g{group(groups[0]), group(groups[1]), std::nullopt, std::nullopt, std::nullopt};
        if (groups.size() == 3) g.replicate = group(groups[2]);
        if (tp) g.tp = group(*tp);
        if (dp) g.dp = group(*dp);
        return Mesh::from_groups(g, o);
      },
      "groups"_a, "device"_a, "policy"_a, "timeout_s"_a, "tp"_a = py::none(), "dp"_a = py::none(), release);

  py::class_<RuntimeHandle>(m, "_Runtime")
      .def("boundaries", [](const RuntimeHandle& h) { return runtime_boundaries(*h.runtime); })
      .def("dedicated", [](const RuntimeHandle& h) {
        py::list out;
        for (const DedicatedParam& d : runtime_dedicated_params(*h.runtime))
          out.append(py::dict("name"_a = d.name, "param"_a = d.param, "shape"_a = d.shape,
                              "owner_shard"_a = d.owner.shard, "owner_replicate"_a = d.owner.replicate,
                              "owner_rank"_a = d.owner_rank, "boundary"_a = d.boundary, "is_owner"_a = d.is_owner,
                              "tp_split_dim"_a = d.tp_split_dim, "tp_owner"_a = d.tp_owner,
                              "full_shape"_a = d.full_shape));
        return out;
      })
      .def("replicate",
           [](const RuntimeHandle& h, double bucket_mb, bool tp) { runtime_replicate(h.runtime, bucket_mb, tp); },
           "bucket_mb"_a, "tp"_a = false, release)
      .def("full_params", [](const RuntimeHandle& h) { return runtime_full_params(h.runtime); }, release)
      .def("assign_params",
           [](const RuntimeHandle& h, std::map<std::string, at::Tensor> values) {
             runtime_assign_params(h.runtime, std::move(values));
           },
           "values"_a, release)
      // (each takes the runtime's lock, which a collective's wait may hold: without the GIL, as every call that waits)
      .def("set_no_sync", [](const RuntimeHandle& h, bool on) { return runtime_set_no_sync(h.runtime, on); }, release)
      .def("discard_grads", [](const RuntimeHandle& h, bool set_to_none) { runtime_discard_grads(h.runtime, set_to_none); },
           "set_to_none"_a = true, release)
      .def("set_forward_prefetch_depth",
           [](const RuntimeHandle& h, int depth) { runtime_set_forward_prefetch_depth(h.runtime, depth); }, "depth"_a,
           release)
      .def("release_params",
           [](const RuntimeHandle& h, const std::vector<std::string>& names) { runtime_release_params(h.runtime, names); },
           "names"_a, release)
      .def("master_of",
           [](const RuntimeHandle& h, const std::string& name) -> std::optional<at::Tensor> {
             at::Tensor m = runtime_master_of(h.runtime, name);
             return m.defined() ? std::optional<at::Tensor>(m) : std::nullopt;
           },
           "name"_a, release)
      .def("routes", [](const RuntimeHandle& h) { return runtime_param_routes(*h.runtime); }, release)
      .def("post_forward_order", [](const RuntimeHandle& h) { return runtime_post_forward_order(h.runtime); }, release)
      .def("reset_post_forward_order", [](const RuntimeHandle& h) { runtime_reset_post_forward_order(h.runtime); },
           release)
      .def("prepare_grads",
           [](const RuntimeHandle& h, bool coalesce) { with_py_warnings([&] { runtime_prepare_grads(h.runtime, coalesce); }); },
           "coalesce_wait"_a = true)
      .def("publish", [](const RuntimeHandle& h, bool async) { runtime_publish(h.runtime, async); }, "async_"_a, release)
      .def("wait_publishes", [](const RuntimeHandle& h) { runtime_wait_publishes(h.runtime); }, release)
      .def("unshard_profile",
           [](const RuntimeHandle& h, bool clear) {
             return to_json(runtime_forward_unshard_profile(h.runtime, clear, /*synchronize=*/false)).dump();
           },
           "clear"_a = true, release)
      .def("comm_plan",
           [](const RuntimeHandle& h, int max_groups, int max_params) {
             return summarize_comm_plan(runtime_face(h.runtime), max_groups, max_params).dump();
           },
           "max_groups"_a, "max_params_per_group"_a, release);

  m.def(
      "_dedicate",
      [](const std::vector<std::pair<std::string, at::Tensor>>& params,
         const std::vector<std::pair<std::string, at::Tensor>>& buffers,
         const std::vector<std::tuple<std::string, int, bool>>& modules, const std::shared_ptr<Mesh>& mesh,
         const ParamPredicate& predicate, const py::dict& options, bool ddp,
         const std::map<std::string, int>& tp_split, const std::map<std::string, std::vector<std::string>>& aliases,
         const std::function<void()>& precheck) {
        ModelView v;
        // the Python front end's refusal and this binding's reading of the options: refused inside the setup's
        // agreement (every rank raises), not on this rank alone
        DedicateOptions o;
        std::exception_ptr unread;
        try {
          o = dedicate_options(options);
        } catch (...) {
          unread = std::current_exception();
        }
        v.precheck = [unread, given = caller_mistakes_kept(precheck)] {
          if (given) given();
          if (unread) std::rethrow_exception(unread);
        };
        for (const auto& [n, t] : params) {
          auto it = aliases.find(n);
          v.params.push_back({n, t, it == aliases.end() ? std::vector<std::string>{} : it->second});
        }
        v.tp_split = tp_split;  // DTensor parameters sharded on the TP axis: their local slices, split dim
        for (const auto& [n, t] : buffers) v.buffers.push_back({n, t});
        for (const auto& [n, parent, container] : modules) v.modules.push_back({n, parent, {}, container});
        const ParamPredicate select = caller_mistakes_kept(predicate);
        // setup runs collectives (the plan's agreement, initial values): without the GIL, as every other
        // collective; the Python callables it runs (predicate, resolver, policy) take the GIL themselves
        py::gil_scoped_release nogil;
        if (!ddp) return RuntimeHandle{dedicate_model_view(std::move(v), mesh, select, o)};
        return RuntimeHandle{mesh->has_tp() ? dedicate_model_view_ddp_tp(std::move(v), mesh, select, o)
                                            : dedicate_model_view_ddp(std::move(v), mesh, select, o)};
      },
      "params"_a, "buffers"_a, "modules"_a, "mesh"_a, "predicate"_a, "options"_a, "ddp"_a,
      "tp_split"_a = std::map<std::string, int>{}, "aliases"_a = std::map<std::string, std::vector<std::string>>{},
      "precheck"_a = std::function<void()>{});

  py::class_<Muon>(m, "_Muon")
      .def(py::init([](const RuntimeHandle& h, const py::dict& options) {
             MuonOptions o = muon_options(options);
             auto face = runtime_face(h.runtime);
             torch::PyWarningHandler warnings;  // the core's TORCH_WARN (an unused ns_steps) as a UserWarning
             try {
               // the options' agreement is a collective: run without the GIL, as every other collective
               // (the options are moved, never copied: a Python log callback changes no reference count)
               py::gil_scoped_release nogil;
               return std::make_unique<Muon>(face, std::move(o));
             } catch (...) {
               warnings.set_in_exception();  // the error wins: the handler must not throw a warning over it
               throw;
             }
           }),
           "runtime"_a, "options"_a)
      .def("step", [](Muon& opt) { with_py_warnings([&] { opt.step(); }); })
      .def("consume_profile", [](Muon& opt) { return to_json(opt.consume_last_step_profile()).dump(); }, release)
      .def("zero_grad", &Muon::zero_grad, "set_to_none"_a = true, release)
      .def_property_readonly("steps_taken", &Muon::steps_taken)
      .def("param_state",  // this rank's state of `p` (live tensors), None where it holds none
           [](const Muon& opt, const at::Tensor& p) -> py::object {
             const MuonParamState* s = opt.state_of(p);
             if (s == nullptr) return py::none();
             py::dict d("step"_a = s->step());
             if (s->momentum_buffer().defined()) d["momentum_buffer"] = s->momentum_buffer();
             if (s->exp_avg().defined()) d["exp_avg"] = s->exp_avg();
             if (s->exp_avg_sq().defined()) d["exp_avg_sq"] = s->exp_avg_sq();
             return d;
           })
      .def("group_count", [](Muon& opt) { return opt.param_groups().size(); })
      .def("group_params", [](Muon& opt, size_t i) {
        group_options(opt, i);  // checks i
        return opt.param_groups()[i].params();
      })
      .def("group_options", [](Muon& opt, size_t i) {
        const MuonGroupOptions& g = group_options(opt, i);
        return py::dict("lr"_a = g.lr(), "is_muon"_a = g.is_muon(), "momentum"_a = g.momentum(),
                        "nesterov"_a = g.nesterov(), "weight_decay"_a = g.weight_decay(), "ns_steps"_a = g.ns_steps(),
                        "betas"_a = py::make_tuple(g.beta1(), g.beta2()), "eps"_a = g.eps(),
                        "group_name"_a = g.group_name());
      })
      .def("state",
           [](const Muon& opt, const RuntimeHandle& h, bool cpu_offload, bool rank0_only) {
             OptimizerStateDict sd;
             {
               py::gil_scoped_release unlocked;
               sd = get_optimizer_state_dict(runtime_face(h.runtime), opt, StateDictOptions{cpu_offload, rank0_only});
             }
             py::list groups;
             for (const OptimizerGroupState& g : sd.param_groups)
               groups.append(py::dict("group_name"_a = g.name, "is_muon"_a = g.is_muon, "lr"_a = g.lr,
                                      "momentum"_a = g.momentum, "weight_decay"_a = g.weight_decay,
                                      "betas"_a = py::make_tuple(g.beta1, g.beta2), "eps"_a = g.eps,
                                      "nesterov"_a = g.nesterov, "ns_steps"_a = g.ns_steps));
             return py::dict("muon"_a = sd.muon, "adamw"_a = sd.adamw, "param_groups"_a = groups,
                             "steps_taken"_a = sd.steps_taken, "without_state"_a = sd.without_state);
           },
           "runtime"_a, "cpu_offload"_a, "rank0_only"_a,
           "The optimizer state in full tensors (collective): Muon momentum from the owners, AdamW moments.")
      .def("load_state",
           [](Muon& opt, const RuntimeHandle& h, TensorDict muon, TensorDict adamw, const py::list& groups,
              int64_t steps_taken, std::vector<std::string> without_state) {
             OptimizerStateDict sd;
             sd.muon = std::move(muon);
             sd.adamw = std::move(adamw);
             sd.steps_taken = steps_taken;
             sd.without_state = std::move(without_state);
             for (const auto& item : groups) {
               const py::dict g = item.cast<py::dict>();
               const auto betas = g["betas"].cast<std::pair<double, double>>();
               sd.param_groups.push_back({g["group_name"].cast<std::string>(), g["is_muon"].cast<bool>(),
                                          g["lr"].cast<double>(), g["momentum"].cast<double>(),
                                          g["weight_decay"].cast<double>(), betas.first, betas.second,
                                          g["eps"].cast<double>(), g["nesterov"].cast<bool>(),
                                          g["ns_steps"].cast<int64_t>()});
             }
             py::gil_scoped_release unlocked;
             set_optimizer_state_dict(runtime_face(h.runtime), opt, sd);
           },
           "runtime"_a, "muon"_a, "adamw"_a, "param_groups"_a, "steps_taken"_a, "without_state"_a,
           "Loads full-tensor optimizer state (collective): each rank keeps what it updates.")
      .def("clip",
           [](Muon& opt, std::optional<double> max_norm, double norm_type, bool error_if_nonfinite,
              std::optional<bool> foreach, const std::string& strategy, bool all_params,
              const std::vector<std::tuple<std::string, at::Tensor, bool, bool>>& extra) {
             GradClipOptions o;
             for (const auto& [name, grad, counted, counts_param] : extra) o.extra.push_back({name, grad, counted, counts_param});
             o.norm_type = norm_type;
             o.error_if_nonfinite = error_if_nonfinite;
             o.foreach = foreach;
             o.strategy = strategy;
             o.scope = all_params ? ClipScope::AllParams : ClipScope::Muon;
             MuonGradClipStats s;
             {
               py::gil_scoped_release unlocked;
               s = opt.clip_grad_norm_(max_norm, o);
             }
             return py::dict("total_norm"_a = s.total_norm, "max_norm"_a = s.max_norm, "norm_type"_a = s.norm_type,
                             "clip_coef"_a = s.clip_coef, "clipped"_a = s.clipped, "param_count"_a = s.param_count,
                             "found_inf"_a = s.found_inf, "strategy"_a = s.strategy);
           },
           "max_norm"_a, "norm_type"_a, "error_if_nonfinite"_a, "foreach"_a, "strategy"_a, "all_params"_a,
           "extra"_a = std::vector<std::tuple<std::string, at::Tensor, bool, bool>>{})
      .def("agree_clip",
           [](const Muon& opt, std::optional<double> max_norm, double norm_type, bool error_if_nonfinite,
              const std::string& strategy, bool all_params, const std::string& refusal) {
             GradClipOptions o;
             o.norm_type = norm_type;
             o.error_if_nonfinite = error_if_nonfinite;
             o.strategy = strategy;
             o.scope = all_params ? ClipScope::AllParams : ClipScope::Muon;
             py::gil_scoped_release unlocked;
             opt.agree_clip_arguments(max_norm, o, refusal);
           },
           "max_norm"_a, "norm_type"_a, "error_if_nonfinite"_a, "strategy"_a, "all_params"_a, "refusal"_a,
           "clip_grad_norm_'s argument agreement alone (collective): a Python strategy clips after it; a refusal "
           "of this rank's arguments raises on every rank.")
      .def("summary",
           [](const Muon& opt, const RuntimeHandle& h, int max_rows) {
             return summarize_param_groups(runtime_face(h.runtime), opt, max_rows).dump();
           },
           "runtime"_a, "max_rows"_a, release)
      .def("set_group_options", [](Muon& opt, size_t i, double lr, double weight_decay, double momentum, double beta1,
                                   double beta2, double eps) {
        MuonGroupOptions& g = group_options(opt, i);  // checked by Muon::step (check_group_options)
        g.lr(lr).weight_decay(weight_decay).momentum(momentum).beta1(beta1).beta2(beta2).eps(eps);
      }, "index"_a, "lr"_a, "weight_decay"_a, "momentum"_a, "beta1"_a, "beta2"_a, "eps"_a);
}

}  // namespace dmuon::python
