// Internal: dedicate_params' setup decisions as pure functions (no collectives, no ranks): which
// route trains each parameter, in which precision, and which hook boundary runs its hooks.
// Runtime::build applies them; tests call them directly.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "dmuon/dedicate.h"
#include "dmuon/model_view.h"
#include "dmuon/owner_plan.h"
#include "runtime/dedicated_route.h"
#include "runtime/precision.h"
#include "runtime/route.h"

namespace dmuon {

class RouteContext;

// A route a parameter can be sent to (param_policy.route, route_hint_fn, the predicate). A new
// route is one route file and one row in route_table() (setup.cpp; docs/ARCHITECTURE.md).
struct RouteRow {
  RouteKind kind;
  std::vector<std::string> names;  // the strings that select it; names.front() is route_name(kind)
  const char* what;                // one phrase for error messages
  bool on_boundary = false;        // its parameters are unsharded and reduced at their hook boundary
  // refuses a parameter this route cannot train (an error naming the rank and the parameter);
  // null: accepts any trainable parameter
  void (*check)(const std::string& name, const at::Tensor& p, const RoutingContext& ctx) = nullptr;
  // builds the route over its parameters (model order; collective: every rank, route order). Null
  // for the routes the Runtime builds itself: the dedicated one (owners come from the plan) and
  // "adamw" (the replicated route of dmuon::replicate, else local).
  std::unique_ptr<Route> (*make)(RouteContext& ctx, std::vector<BoundParam> params) = nullptr;
};
const std::vector<RouteRow>& route_table();
const RouteRow& route_row(RouteKind k);

// "muon" / "adamw" / "sharded_adamw" (route_table) and "broadcast" / "all_gather" (the API's
// strings; the one place they are parsed); nullopt for anything else.
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
// `layers.N` / `blocks.N` module, else the direct parent; never a container (ModuleList...: its
// forward hooks never run), whose place its lowest ancestor running a forward takes (a resolver
// returning one is an error). hook_boundary_predicate needs the LibTorch modules (ModelView::Module::libtorch).
// The modules of a ModelView by name (one lookup per ancestor of every parameter: a linear search
// would make setup quadratic in the model's size).
class ModuleIndex {
 public:
  explicit ModuleIndex(const ModelView& model);
  const ModelView::Module* find(const std::string& name) const;  // null when absent
 private:
  std::unordered_map<std::string, const ModelView::Module*> by_name_;
};
std::string resolve_boundary(const DedicateOptions& opts, const ModuleIndex& modules, const std::string& name,
                             const at::Tensor& p, int rank);
// ... and for a tied parameter (aliases), the lowest module that also contains every other module holding it
std::string resolve_boundary(const DedicateOptions& opts, const ModuleIndex& modules, const ModelView::Tensor& param,
                             int rank);
inline std::string resolve_boundary(const DedicateOptions& opts, const ModelView& model, const std::string& name,
                                    const at::Tensor& p, int rank) {
  return resolve_boundary(opts, ModuleIndex(model), name, p, rank);
}

struct RoutedParam {
  std::string name;
  at::Tensor param;
  RouteKind route = RouteKind::Replicated;
  Precision prec;
  std::string boundary;            // routes on_boundary only
  UnshardMode unshard = UnshardMode::Broadcast;  // dedicated only
};

// Every trainable parameter's route, precision and boundary, and what the boundaries cast.
struct Routing {
  std::vector<RoutedParam> dedicated;                  // model order
  // the parameters of every route route_table() builds (not dedicated, not "adamw"), per route
  std::map<RouteKind, std::vector<RoutedParam>> routed;
  std::vector<RoutedParam> base;                       // "adamw": replicated or local
  std::vector<std::pair<at::Tensor, Precision>> to_cast;  // every parameter whose dtype changes (frozen too)
  std::vector<std::string> boundary_order;             // first appearance, model order
  std::map<std::string, at::ScalarType> input_cast;    // per boundary
  std::map<std::string, at::ScalarType> output_cast;
  std::vector<ParamSpec> specs;                        // planner input, per dedicated parameter
  uint64_t base_digest = 0;  // precision of the non-dedicated parameters and the casts (fingerprint)
};

Routing route_params(const ModelView& model, const ParamPredicate& predicate, const DedicateOptions& opts,
                     const RoutingContext& ctx);

}  // namespace dmuon
