// comm_plan.cpp -- the per-boundary communication plan implied by an OwnerPlan.
//
// Byte convention (the one comm/ measures): a broadcast or reduce of S bytes costs S for every
// participating rank except the root. Per step, for a parameter of B bytes owned at (s0, r0):
//   shard axis, in every replicate group r: forward broadcast from (s0, r) [Z2, Z3], backward
//     re-broadcast [Z3 only], backward reduce to (s0, r) [Z2, Z3] -> each rank (s != s0, r) pays
//     2B (Z2) or 3B (Z3); summed over ranks 2(G-1)R*B / 3(G-1)R*B, i.e. a mean of 2(G-1)/G*B and
//     3(G-1)/G*B per rank -- the formulas, whatever the plan.
//   replicate axis (R > 1), over the ranks (s0, r) of column s0: stage-2 reduce to (s0, r0) and the
//     post-step publish from it -> each (s0, r != r0) pays 2B.
#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "dmuon/owner_plan.h"
#include "dmuon/plan_json.h"

namespace dmuon {
namespace {

double mean_of(const std::vector<int64_t>& v) {
  if (v.empty()) return 0.0;
  long double s = 0;
  for (int64_t x : v) s += static_cast<long double>(x);
  return static_cast<double>(s / static_cast<long double>(v.size()));
}

int64_t max_of(const std::vector<int64_t>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

}  // namespace

double CommPlan::mean_z2() const { return mean_of(per_rank_bytes_z2); }
double CommPlan::mean_z3() const { return mean_of(per_rank_bytes_z3); }
double CommPlan::mean_replicate() const { return mean_of(per_rank_replicate_bytes); }
int64_t CommPlan::max_z2() const { return max_of(per_rank_bytes_z2); }
int64_t CommPlan::max_z3() const { return max_of(per_rank_bytes_z3); }
int64_t CommPlan::max_replicate() const { return max_of(per_rank_replicate_bytes); }

CommPlan plan_comm(const std::vector<ParamSpec>& params, const OwnerPlan& plan,
                   const std::vector<std::string>& boundary_of_param) {
  const size_t P = params.size();
  if (plan.owners.size() != P)
    throw std::invalid_argument("plan_comm: the plan has " + std::to_string(plan.owners.size()) +
                                " owners but " + std::to_string(P) +
                                " parameters were given; pass the list the plan was made from.");
  if (!boundary_of_param.empty() && boundary_of_param.size() != P)
    throw std::invalid_argument("plan_comm: boundary_of_param has " +
                                std::to_string(boundary_of_param.size()) + " entries for " +
                                std::to_string(P) + " parameters; give one per parameter or none.");
  const int G = plan.shard_size, R = plan.replicate_size;
  if (G < 1 || R < 1)
    throw std::invalid_argument("plan_comm: the plan's grid " + std::to_string(G) + "x" +
                                std::to_string(R) + " is invalid; every size must be >= 1.");

  CommPlan out;
  out.shard_size = G;
  out.replicate_size = R;
  const size_t S = static_cast<size_t>(G) * static_cast<size_t>(R);
  out.per_rank_bytes_z2.assign(S, 0);
  out.per_rank_bytes_z3.assign(S, 0);
  out.per_rank_replicate_bytes.assign(S, 0);

  std::map<std::string, size_t> boundary_index;  // lookups only; order = first appearance
  std::vector<int64_t> column_bytes(G, 0);       // bytes owned per shard column
  std::vector<int64_t> owned_bytes(S, 0);        // bytes owned per slot
  for (size_t i = 0; i < P; ++i) {
    const ParamSpec& p = params[i];
    const OwnerCoord o = plan.owners[i];
    if (o.shard < 0 || o.shard >= G || o.replicate < 0 || o.replicate >= R)
      throw std::invalid_argument("plan_comm: parameter '" + p.name + "' has owner (" +
                                  std::to_string(o.shard) + "," + std::to_string(o.replicate) +
                                  ") outside the " + std::to_string(G) + "x" + std::to_string(R) +
                                  " grid.");
    const int64_t bytes = p.bytes();
    out.muon_bytes += bytes;
    column_bytes[o.shard] += bytes;
    owned_bytes[OwnerPlan::slot_index(o, G)] += bytes;

    std::string b = boundary_of_param.empty() ? std::string() : boundary_of_param[i];
    if (b.empty()) b = default_boundary_of(p.name);
    auto [it, fresh] = boundary_index.emplace(b, out.boundaries.size());
    if (fresh) {
      out.boundaries.emplace_back();
      out.boundaries.back().boundary = b;
    }
    BoundaryComm& bc = out.boundaries[it->second];
    auto root = std::find_if(bc.roots.begin(), bc.roots.end(),
                             [&](const RootPayload& r) { return r.root == o; });
    if (root == bc.roots.end()) {
      bc.roots.emplace_back();
      bc.roots.back().root = o;
      root = bc.roots.end() - 1;
    }
    root->bytes += bytes;
    root->params.push_back(static_cast<int>(i));
    bc.payload_bytes += bytes;
  }
  for (BoundaryComm& bc : out.boundaries) {
    bc.fwd_broadcast_bytes = static_cast<int64_t>(G - 1) * bc.payload_bytes;
    bc.bwd_broadcast_bytes_z3 = static_cast<int64_t>(G - 1) * bc.payload_bytes;
    bc.bwd_reduce_bytes = static_cast<int64_t>(G - 1) * bc.payload_bytes;
  }
  for (int r = 0; r < R; ++r) {
    for (int s = 0; s < G; ++s) {
      const size_t slot = static_cast<size_t>(r) * G + s;
      const int64_t not_mine = out.muon_bytes - column_bytes[s];
      out.per_rank_bytes_z2[slot] = 2 * not_mine;
      out.per_rank_bytes_z3[slot] = 3 * not_mine;
      out.per_rank_replicate_bytes[slot] = R > 1 ? 2 * (column_bytes[s] - owned_bytes[slot]) : 0;
    }
  }
  const double PM = static_cast<double>(out.muon_bytes);
  out.formula_z2 = 2.0 * (G - 1) / G * PM;
  out.formula_z3 = 3.0 * (G - 1) / G * PM;
  out.formula_replicate = R > 1 ? 2.0 * (R - 1) / (static_cast<double>(G) * R) * PM : 0.0;
  return out;
}

nlohmann::json comm_plan_json(const CommPlan& comm, int max_boundaries, int max_params_per_root) {
  using nlohmann::json;
  json jc;
  jc["muon_bytes"] = comm.muon_bytes;
  jc["per_rank"] = json{
      {"z2", {{"mean", comm.mean_z2()}, {"max", comm.max_z2()}, {"formula", comm.formula_z2},
              {"bytes", comm.per_rank_bytes_z2}}},
      {"z3", {{"mean", comm.mean_z3()}, {"max", comm.max_z3()}, {"formula", comm.formula_z3},
              {"bytes", comm.per_rank_bytes_z3}}},
      {"replicate",
       {{"mean", comm.mean_replicate()}, {"max", comm.max_replicate()},
        {"formula", comm.formula_replicate}, {"bytes", comm.per_rank_replicate_bytes}}}};
  jc["fsdp_equivalent"] = json{{"z2", comm.formula_z2}, {"z3", comm.formula_z3}, {"replicate", comm.formula_replicate}};
  json jb = json::array();
  for (const BoundaryComm& b : comm.boundaries) {
    if (max_boundaries >= 0 && static_cast<int>(jb.size()) >= max_boundaries) break;
    json roots = json::array();
    for (const RootPayload& r : b.roots) {
      std::vector<int> params = r.params;
      if (max_params_per_root >= 0 && static_cast<int>(params.size()) > max_params_per_root)
        params.resize(static_cast<size_t>(max_params_per_root));
      roots.push_back(json{{"owner", json::array({r.root.shard, r.root.replicate})}, {"bytes", r.bytes}, {"params", params}});
    }
    jb.push_back(json{{"boundary", b.boundary},
                      {"payload_bytes", b.payload_bytes},
                      {"fwd_broadcast_bytes", b.fwd_broadcast_bytes},
                      {"bwd_broadcast_bytes_z3", b.bwd_broadcast_bytes_z3},
                      {"bwd_reduce_bytes", b.bwd_reduce_bytes},
                      {"roots", std::move(roots)}});
  }
  jc["boundaries"] = std::move(jb);
  return jc;
}

}  // namespace dmuon
