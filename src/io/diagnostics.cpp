// JSON summaries (no collectives).
#include "dmuon/diagnostics.h"

#include <c10/util/Exception.h>

#include "dmuon/plan_json.h"

#include "runtime/runtime_face.h"

namespace dmuon {

namespace {
std::shared_ptr<RuntimeFace> dedicated_face(const torch::nn::Module& model, const char* fn) {
  auto state = detail::face_of(model);
  TORCH_CHECK(state, fn, ": the model was not dedicated (call dmuon::dedicate_params first).");
  return state;
}
}  // namespace

nlohmann::json summarize_param_groups(const torch::nn::Module& model, const Muon& optimizer, int max_rows) {
  return summarize_param_groups(dedicated_face(model, "summarize_param_groups"), optimizer, max_rows);
}

nlohmann::json summarize_param_groups(const std::shared_ptr<RuntimeFace>& state, const Muon& optimizer, int max_rows) {
  TORCH_CHECK(state, "summarize_param_groups: the runtime is null (dedicate_model_view returns it).");
  nlohmann::json out;
  out["rank"] = state->mesh().global_rank();
  out["world_size"] = state->mesh().world_size();
  out["mode"] = state->z3() ? "z3" : "z2";
  out["ns_backend"] = optimizer.ns().describe();
  std::map<const c10::TensorImpl*, ParamView> views;
  for (auto& v : state->describe()) views[v.param.unsafeGetTensorImpl()] = v;
  nlohmann::json groups = nlohmann::json::array();
  int64_t muon_params = 0, adamw_params = 0, owned = 0, owned_numel = 0, adamw_numel = 0;
  int64_t n_sharded = 0, sharded_here = 0;  // sharded_adamw parameters, this rank's slice elements
  for (const auto& g : optimizer.param_groups()) {
    const auto& o = static_cast<const MuonGroupOptions&>(g.options());
    nlohmann::json j;
    j["name"] = o.group_name();
    j["route"] = o.is_muon() ? "muon" : "adamw";
    j["lr"] = o.lr();
    j["weight_decay"] = o.weight_decay();
    if (o.is_muon()) {
      j["momentum"] = o.momentum();
      j["nesterov"] = o.nesterov();
      j["ns_steps"] = o.ns_steps();
    } else {
      j["betas"] = {o.beta1(), o.beta2()};
      j["eps"] = o.eps();
    }
    int64_t n_owned = 0;
    int64_t numel = 0;
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& p : g.params()) {
      auto vit = views.find(p.unsafeGetTensorImpl());
      if (vit == views.end()) continue;  // not trainable any more
      const ParamView& v = vit->second;
      auto dtypes = [&](nlohmann::json row) {
        row["dtype"] = std::string(c10::toString(p.scalar_type()));
        row["reduce_dtype"] = std::string(c10::toString(v.prec.reduce));
        row["master_dtype"] = std::string(c10::toString(v.prec.master));
        row["optim_dtype"] = std::string(c10::toString(v.prec.optim));
        return row;
      };
      int64_t n = 1;
      for (int64_t d : v.shape) n *= d;
      numel += n;
      if (v.sharded()) ++n_sharded, sharded_here += v.shard_numel;
      if (v.muon()) {
        n_owned += v.updated_here ? 1 : 0;
        if (v.updated_here) owned_numel += n;
        if (static_cast<int>(rows.size()) < max_rows)
          rows.push_back(dtypes({{"name", v.name},
                                 {"shape", v.shape},
                                 {"owner", nlohmann::json::array({v.owner_shard, v.owner_replicate})},
                                 {"owner_rank", v.owner_rank},
                                 {"boundary", v.boundary},
                                 {"owned", v.updated_here}}));
      } else if (static_cast<int>(rows.size()) < max_rows) {
        // the full shape (a sharded_adamw placeholder holds none), the route, and for sharded_adamw
        // the boundary and this rank's slice of the flat (padded) parameter
        nlohmann::json row = dtypes({{"name", v.name},
                                     {"shape", v.shape},
                                     {"route", route_name(v.route)},
                                     {"grad_dtype", p.grad().defined() ? std::string(c10::toString(p.grad().scalar_type()))
                                                                       : std::string("none")}});
        if (v.sharded()) {
          row["boundary"] = v.boundary;
          row["shard_numel"] = v.shard_numel;
          row["shard_offset"] = v.shard_offset;
          row["padded_numel"] = v.padded_numel;
        }
        rows.push_back(row);
      }
    }
    j["num_params"] = g.params().size();
    j["numel_all"] = numel;
    if (o.is_muon()) {
      j["owned_here"] = n_owned;
      muon_params += static_cast<int64_t>(g.params().size());
      owned += n_owned;
    } else {
      adamw_params += static_cast<int64_t>(g.params().size());
      adamw_numel += numel;
    }
    j["params"] = rows;
    groups.push_back(j);
  }
  out["groups"] = groups;
  out["totals"] = {{"muon_params_all", muon_params},
                   {"muon_params_owned_here", owned},
                   {"muon_numel_owned_here", owned_numel},
                   {"adamw_params", adamw_params},
                   {"adamw_numel", adamw_numel},
                   {"sharded_adamw_params", n_sharded},
                   {"sharded_adamw_numel_here", sharded_here},
                   {"replicated", state->has_replicated_route()}};
  return out;
}

int64_t ModelCommPlan::shard_bytes() const {
  const auto& v = z3 ? comm.per_rank_bytes_z3 : comm.per_rank_bytes_z2;
  return v.empty() ? 0 : v[static_cast<size_t>(slot)];
}

int64_t ModelCommPlan::replicate_bytes() const {
  return comm.per_rank_replicate_bytes.empty() ? 0 : comm.per_rank_replicate_bytes[static_cast<size_t>(slot)];
}

int64_t ModelCommPlan::step_traffic_bytes() const {
  int64_t n = 0;
  for (const PlannedTraffic& t : step_traffic) n += t.bytes;
  return n;
}

int64_t ModelCommPlan::tp_bytes() const { return tp_exchange.empty() ? 0 : tp_exchange[static_cast<size_t>(rank)]; }

double ModelCommPlan::formula() const { return (z3 ? comm.formula_z3 : comm.formula_z2) + comm.formula_replicate; }

ModelCommPlan get_comm_plan(const torch::nn::Module& model) {
  return get_comm_plan(dedicated_face(model, "get_comm_plan"));
}

ModelCommPlan get_comm_plan(const std::shared_ptr<RuntimeFace>& state) {
  TORCH_CHECK(state, "get_comm_plan: the runtime is null (dedicate_model_view returns it).");
  const Mesh& mesh = state->mesh();
  ModelCommPlan out;
  out.rank = mesh.global_rank();
  out.slot = mesh.replicate_rank() * mesh.shard_size() + mesh.shard_rank();
  out.shard_size = mesh.shard_size();
  out.replicate_size = mesh.replicate_size();
  out.tp_size = mesh.tp_size();
  out.world_size = mesh.world_size();
  out.policy = mesh.policy();
  out.z3 = state->z3();
  out.plan = state->plan();
  out.comm = plan_comm(state->specs(), state->plan(), state->boundary_of_param());
  for (const auto& s : state->specs()) out.params.push_back(s.name);
  out.step_traffic = state->planned_step_traffic();
  if (mesh.has_tp()) {
    out.tp_exchange = plan_tp_exchange(state->specs(), state->plan(), state->optim_element_sizes());
  }
  return out;
}

nlohmann::json summarize_comm_plan(const torch::nn::Module& model, int max_groups, int max_params_per_group) {
  return summarize_comm_plan(dedicated_face(model, "summarize_comm_plan"), max_groups, max_params_per_group);
}

nlohmann::json summarize_comm_plan(const std::shared_ptr<RuntimeFace>& state, int max_groups, int max_params_per_group) {
  const ModelCommPlan cp = get_comm_plan(state);
  nlohmann::json out;
  out["mesh"] = {{"shard", cp.shard_size}, {"replicate", cp.replicate_size}, {"world", cp.world_size}, {"policy", cp.policy}};
  out["mode"] = cp.z3 ? "z3" : "z2";
  out["fingerprint"] = format_fingerprint(cp.plan.fingerprint);
  out["owner_strategy"] = owner_strategy_name(cp.plan.options.owner_strategy);
  out["owner_cost_model"] = cp.plan.options.cost_model->name();
  out["makespan"] = cp.plan.makespan;
  out["lower_bound"] = cp.plan.lower_bound;
  out["imbalance"] = cp.plan.imbalance();
  out["violations"] = cp.plan.violations;
  out["params"] = cp.params;
  const auto at = [&](const std::vector<int64_t>& v) { return v.empty() ? int64_t{0} : v[static_cast<size_t>(cp.slot)]; };
  out["this_rank"] = {{"rank", cp.rank},
                      {"z2", at(cp.comm.per_rank_bytes_z2)},
                      {"z3", at(cp.comm.per_rank_bytes_z3)},
                      {"replicate", at(cp.comm.per_rank_replicate_bytes)},
                      {"tp", cp.tp_bytes()},
                      {"step_traffic", cp.step_traffic_bytes()}};
  nlohmann::json traffic = nlohmann::json::array();
  for (const PlannedTraffic& t : cp.step_traffic)
    traffic.push_back({{"route", t.route}, {"group", t.group}, {"op", comm_op_name(t.op)}, {"bytes", t.bytes},
                       {"calls", t.calls}});
  out["step_traffic"] = traffic;
  if (cp.tp_size > 1)
    out["tp"] = {{"tp_size", cp.tp_size}, {"imbalance", cp.plan.tp_imbalance()}, {"exchange", cp.tp_exchange}};
  out["comm"] = comm_plan_json(cp.comm, max_groups, max_params_per_group);
  return out;
}

nlohmann::json to_json(const StepProfile& p) {
  return {{"valid", p.valid},
          {"step", p.step},
          {"clock", p.clock},
          {"prepare_ms", p.prepare_ms},
          {"muon_ms", p.muon_ms},
          {"ns_ms", p.ns_ms},
          {"adamw_ms", p.adamw_ms},
          {"publish_ms", p.publish_ms},
          {"total_ms", p.total_ms},
          {"host_total_ms", p.host_total_ms},
          {"owned_updates", p.owned_updates},
          {"tp_gathered", p.tp_gathered},
          {"tp_distributed", p.tp_distributed},
          {"ns_flops", p.ns_flops},
          {"adamw_fused", p.adamw_fused},
          {"momentum_foreach", p.momentum_foreach},
          {"update_foreach", p.update_foreach}};
}

nlohmann::json to_json(const ForwardUnshardProfile& p) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& b : p.boundaries)
    rows.push_back({{"boundary", b.boundary},
                    {"forward_unshards", b.forward_unshards},
                    {"forward_prefetched", b.forward_prefetched},
                    {"backward_unshards", b.backward_unshards},
                    {"forward_bytes", b.forward_bytes},
                    {"backward_bytes", b.backward_bytes},
                    {"forward_waits", b.forward_waits},
                    {"backward_waits", b.backward_waits},
                    {"forward_wait_ms", b.forward_wait_ms},
                    {"backward_wait_ms", b.backward_wait_ms},
                    {"forward_device_wait_ms", b.forward_device_wait_ms},
                    {"backward_device_wait_ms", b.backward_device_wait_ms}});
  return {{"enabled", p.enabled},
          {"device_timed", p.device_timed},
          {"rank", p.rank},
          {"forward_passes", p.forward_passes},
          {"total_bytes", p.total_bytes()},
          {"total_wait_ms", p.total_wait_ms()},
          {"total_device_wait_ms", p.total_device_wait_ms()},
          {"boundaries", rows}};
}

}  // namespace dmuon
