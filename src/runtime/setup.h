// Internal: dedicate_params' setup decisions as pure functions (no collectives, no ranks): which
// route trains each parameter, in which precision, and which hook boundary runs its hooks.
// Runtime::build applies them; tests call them directly.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/dedicate.h"
#include "dmuon/model_view.h"
#include "dmuon/owner_plan.h"
#include "runtime/dedicated_route.h"
#include "runtime/precision.h"
#include "runtime/route.h"

namespace dmuon {

// "muon" / "adamw" / "sharded_adamw" and "broadcast" / "all_gather" (the seed's strings; the one
// place they are parsed); nullopt for anything else.
std::optional<RouteKind> parse_route(const std::string& s);
std::optional<UnshardMode> parse_unshard(const std::string& s);

// A parameter's policy: param_policy_fn's answer, or every matching override merged in order.
ParamPolicy policy_for(const DedicateOptions& opts, const std::string& name, const at::Tensor& p, int rank);

// The policy's dtype fields with defaults applied, checked. `muon`: a dedicated matrix
// (compute_dtype is its default reduce dtype). `frozen`: no gradient, only param_dtype applies.
Precision resolve_precision(const ParamPolicy& pol, const DedicateOptions& opts, const std::string& name,
                            const at::Tensor& p, bool muon, bool frozen, int rank);

// The hook boundary of a parameter (a module name as in named_modules(); "" = the root):
// hook_boundary_resolver, else the lowest ancestor matching hook_boundary_predicate, else the
// `layers.N` / `blocks.N` module, else the direct parent.
// hook_boundary_predicate needs the LibTorch modules (ModelView::Module::libtorch).
std::string resolve_boundary(const DedicateOptions& opts, const ModelView& model, const std::string& name,
                             const at::Tensor& p, int rank);

struct RoutedParam {
  std::string name;
  at::Tensor param;
  RouteKind route = RouteKind::Replicated;
  Precision prec;
  std::string boundary;            // dedicated and sharded only
  UnshardMode unshard = UnshardMode::Broadcast;  // dedicated only
};

// Every trainable parameter's route, precision and boundary, and what the boundaries cast.
struct Routing {
  std::vector<RoutedParam> dedicated;                  // model order
  std::vector<RoutedParam> sharded;
  std::vector<RoutedParam> base;                       // "adamw": replicated or local
  std::vector<std::pair<at::Tensor, Precision>> to_cast;  // every parameter whose dtype changes (frozen too)
  std::vector<std::string> boundary_order;             // first appearance, model order
  std::map<std::string, at::ScalarType> input_cast;    // per boundary
  std::map<std::string, at::ScalarType> output_cast;
  std::vector<ParamSpec> specs;                        // planner input, per dedicated parameter
  uint64_t base_digest = 0;  // precision of the non-dedicated parameters and the casts (fingerprint)
};

struct RoutingContext {
  int rank = 0;
  bool ddp = false;
  bool tp = false;  // the mesh has a tensor-parallel axis
};
Routing route_params(const ModelView& model, const ParamPredicate& predicate, const DedicateOptions& opts,
                     const RoutingContext& ctx);

}  // namespace dmuon
