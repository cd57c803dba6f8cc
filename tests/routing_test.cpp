// dedicate_params' setup decisions as pure functions: routes, precision and hook boundaries,
// decided without ranks or collectives (src/runtime/setup.h).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/parameterdict.h>
#include <torch/nn/modules/container/parameterlist.h>
#include <torch/nn/modules/linear.h>

#include "model/gpt.h"
#include "runtime/setup.h"
#include "support/training.h"

using namespace dmuon;

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

ParamPolicy bf16() {
  ParamPolicy p;
  p.param_dtype = at::kBFloat16;
  return p;
}

}  // namespace

TEST(RoutingTest, RouteAndUnshardStringsParseInOnePlace) {
  EXPECT_EQ(parse_route("muon"), RouteKind::Dedicated);
  EXPECT_EQ(parse_route("adamw"), RouteKind::Replicated);
  EXPECT_EQ(parse_route("sharded_adamw"), RouteKind::Sharded);
  EXPECT_FALSE(parse_route("zero_adam").has_value());
  EXPECT_FALSE(parse_route("Muon").has_value());
  EXPECT_EQ(parse_unshard("broadcast"), UnshardMode::Broadcast);
  EXPECT_EQ(parse_unshard("all_gather"), UnshardMode::AllGather);
  EXPECT_FALSE(parse_unshard("allgather").has_value());
  EXPECT_STREQ(route_name(RouteKind::Sharded), "sharded_adamw");
  // the route table is the one place: every spelling of a row parses to it, and every printed
  // name of a selectable route parses back
  for (const RouteRow& row : route_table()) {
    for (const std::string& n : row.names) EXPECT_EQ(parse_route(n), row.kind) << n;
    EXPECT_EQ(parse_route(route_name(row.kind)), row.kind) << route_name(row.kind);
  }
  EXPECT_STREQ(route_name(RouteKind::Replicated), "replicated");
  EXPECT_STREQ(route_name(RouteKind::Local), "local");
}

TEST(RoutingTest, PrecisionDefaults) {
  DedicateOptions o;
  const at::Tensor fp32 = at::zeros({4, 4});
  // no policy: the parameter's dtype everywhere
  Precision p = resolve_precision(ParamPolicy{}, o, "w", fp32, /*muon=*/true, /*frozen=*/false, 0);
  EXPECT_EQ(p, Precision::plain(at::kFloat));
  EXPECT_FALSE(p.has_master());
  // bf16 compute of an fp32 parameter: fp32 master and optimizer state, bf16 reduce
  p = resolve_precision(bf16(), o, "w", fp32, true, false, 0);
  EXPECT_EQ(p.param, at::kBFloat16);
  EXPECT_EQ(p.master, at::kFloat);
  EXPECT_EQ(p.optim, at::kFloat);
  EXPECT_EQ(p.reduce, at::kBFloat16);
  EXPECT_TRUE(p.has_master());
  // compute_dtype is the default reduce dtype of dedicated matrices only
  o.compute_dtype = at::kHalf;
  EXPECT_EQ(resolve_precision(ParamPolicy{}, o, "w", fp32, true, false, 0).reduce, at::kHalf);
  EXPECT_EQ(resolve_precision(ParamPolicy{}, o, "b", fp32, false, false, 0).reduce, at::kFloat);
  // grad_dtype wins over compute_dtype
  ParamPolicy g = bf16();
  g.grad_dtype = at::kFloat;
  EXPECT_EQ(resolve_precision(g, o, "w", fp32, true, false, 0).reduce, at::kFloat);
  // two 16-bit types: the master is float32
  const at::Tensor half = at::zeros({4, 4}, at::kHalf);
  EXPECT_EQ(resolve_precision(bf16(), DedicateOptions{}, "w", half, true, false, 0).master, at::kFloat);
  // frozen: only the forward dtype applies
  p = resolve_precision(bf16(), DedicateOptions{}, "w", fp32, false, /*frozen=*/true, 0);
  EXPECT_EQ(p, Precision::plain(at::kBFloat16));
}

TEST(RoutingTest, PrecisionMistakesAreClearErrors) {
  const at::Tensor fp32 = at::zeros({4, 4});
  ParamPolicy narrow = bf16();
  narrow.param_dtype = at::kFloat;
  narrow.master_dtype = at::kBFloat16;
  std::string err = error_of([&] { resolve_precision(narrow, DedicateOptions{}, "layers.0.w", fp32, true, false, 3); });
  EXPECT_NE(err.find("rank 3: dedicate_params: param_policy of 'layers.0.w' has master_dtype"), std::string::npos) << err;
  EXPECT_NE(err.find("at least as precise"), std::string::npos) << err;
  ParamPolicy integer;
  integer.param_dtype = at::kInt;
  err = error_of([&] { resolve_precision(integer, DedicateOptions{}, "w", fp32, true, false, 0); });
  EXPECT_NE(err.find("use a floating type"), std::string::npos) << err;
}

TEST(RoutingTest, BoundaryResolution) {
  models::GPT m(dmuon::testing::small_config(2));
  const ModelView mods = model_view(*m);
  const at::Tensor p = at::zeros({4, 4});
  DedicateOptions o;
  // default: the layers.N module
  EXPECT_EQ(resolve_boundary(o, mods, "layers.1.q_proj.weight", p, 0), "layers.1");
  // outside a layer: the direct parent ("" for the root's own parameters)
  EXPECT_EQ(resolve_boundary(o, mods, "head.weight", p, 0), "head");
  EXPECT_EQ(resolve_boundary(o, mods, "scale", p, 0), "");
  // the lowest ancestor the predicate selects (over the layers.N rule)
  o.hook_boundary_predicate = [](const std::string& name, const torch::nn::Module&) {
    return name.ends_with("q_proj") || name == "layers";  // (`layers`, a ModuleList, runs no forward: skipped)
  };
  EXPECT_EQ(resolve_boundary(o, mods, "layers.1.q_proj.weight", p, 0), "layers.1.q_proj");
  EXPECT_EQ(error_of([&] { resolve_boundary(o, mods, "layers.1.k_proj.weight", p, 0); }).empty(), false);
  // strict: no matching ancestor is an error naming the parameter; lax: the parent
  const std::string err = error_of([&] { resolve_boundary(o, mods, "head.weight", p, 2); });
  EXPECT_NE(err.find("rank 2: dedicate_params: no ancestor module of 'head.weight' matches hook_boundary_predicate"),
            std::string::npos)
      << err;
  o.hook_boundary_strict = false;
  EXPECT_EQ(resolve_boundary(o, mods, "head.weight", p, 0), "head");
  // the resolver wins, and must name a module
  o.hook_boundary_resolver = [](const std::string&, const at::Tensor&) { return std::string("layers.0"); };
  EXPECT_EQ(resolve_boundary(o, mods, "layers.1.q_proj.weight", p, 0), "layers.0");
  o.hook_boundary_resolver = [](const std::string&, const at::Tensor&) { return std::string("nowhere"); };
  EXPECT_NE(error_of([&] { resolve_boundary(o, mods, "head.weight", p, 0); }).find("returned 'nowhere'"),
            std::string::npos);
}

// A tied parameter (several modules hold it: an embedding used as the output projection) gets the lowest
// module containing every holder, so each use runs inside its boundary; model_view finds the other names.
TEST(RoutingTest, ATiedParametersBoundaryContainsEveryModuleHoldingIt) {
  models::GPT m(dmuon::testing::small_config(2));
  const ModuleIndex mods(model_view(*m));
  const at::Tensor p = at::zeros({4, 4});
  const DedicateOptions o;
  auto boundary = [&](const std::string& name, std::vector<std::string> aliases) {
    return resolve_boundary(o, mods, ModelView::Tensor{name, p, std::move(aliases)}, 0);
  };
  EXPECT_EQ(boundary("tok_emb.weight", {"head.weight"}), "");
  EXPECT_EQ(boundary("layers.1.q_proj.weight", {}), "layers.1");
  EXPECT_EQ(boundary("layers.1.q_proj.weight", {"layers.1.k_proj.weight"}), "layers.1");
  // two blocks share it: the lowest module holding both is `layers`, a ModuleList, which runs no forward (its
  // hooks would never run): the model, whose forward runs the blocks
  EXPECT_EQ(boundary("layers.1.q_proj.weight", {"layers.0.q_proj.weight"}), "");
  EXPECT_EQ(boundary("layers.1.q_proj.weight", {"layers.10.q_proj.weight"}), "");  // a component, not a prefix
  EXPECT_EQ(boundary("layers.1.q_proj.weight", {"layers.1.k_proj.weight", "layers.1.v_proj.weight"}), "layers.1");
  EXPECT_EQ(boundary("layers.1.q_proj.weight", {"head.weight", "layers.0.q_proj.weight"}), "");
  // a LibTorch model with a tied parameter: named once, with its other name as an alias
  struct Holder : torch::nn::Module {
    Holder(const at::Tensor& weight, const at::Tensor& bias) {
      register_parameter("weight", weight);
      register_parameter("bias", bias);
    }
  };
  struct Tied : torch::nn::Module {
    Tied() {
      const at::Tensor w = at::randn({4, 4});
      register_module("emb", std::make_shared<Holder>(w, at::zeros({4})));
      register_module("head", std::make_shared<Holder>(w, at::zeros({4})));
    }
  };
  const ModelView v = model_view(*std::make_shared<Tied>());
  ASSERT_EQ(v.params.size(), 3u);  // emb.weight, emb.bias, head.bias
  EXPECT_EQ(v.params[0].name, "emb.weight");
  EXPECT_EQ(v.params[0].aliases, std::vector<std::string>{"head.weight"});
  EXPECT_TRUE(v.params[1].aliases.empty() && v.params[2].aliases.empty());
}

TEST(RoutingTest, AContainerThatRunsNoForwardIsNeverABoundary) {
  // matrices in a ParameterList (the parent's forward multiplies by them) and in a ModuleDict of ParameterDicts
  struct Net : torch::nn::Module {
    Net() {
      auto list = register_module("mix", torch::nn::ParameterList());
      list->append(at::zeros({4, 4}));
      auto experts = register_module("experts", torch::nn::ModuleDict());
      auto dict = torch::nn::ParameterDict();
      dict->insert("up", at::zeros({4, 4}));
      experts->update({{"e0", dict.ptr()}});
      register_module("block", torch::nn::Linear(4, 4));
      // MultiheadAttention reads out_proj's weight without calling out_proj: its boundary is the attention
      register_module("attn", torch::nn::MultiheadAttention(4, 2));
    }
  };
  const auto net = std::make_shared<Net>();  // (the view holds its modules weakly)
  const ModelView v = model_view(*net);
  const ModuleIndex mods(v);
  ASSERT_TRUE(mods.find("mix") && mods.find("experts.e0") && mods.find("block"));
  EXPECT_TRUE(mods.find("mix")->container && mods.find("experts")->container && mods.find("experts.e0")->container);
  EXPECT_FALSE(mods.find("")->container || mods.find("block")->container);
  DedicateOptions o;
  auto boundary = [&](const std::string& name) {
    return resolve_boundary(o, mods, ModelView::Tensor{name, at::zeros({4, 4})}, 0);
  };
  EXPECT_EQ(boundary("mix.0"), "");
  EXPECT_EQ(boundary("experts.e0.up"), "");
  EXPECT_EQ(boundary("block.weight"), "block");
  EXPECT_TRUE(mods.find("attn.out_proj")->container);
  EXPECT_EQ(boundary("attn.out_proj.weight"), "attn");
  EXPECT_EQ(boundary("attn.in_proj_weight"), "attn");
  // a predicate is asked about modules that run a forward only
  std::vector<std::string> asked;
  o.hook_boundary_predicate = [&](const std::string& name, const torch::nn::Module&) {
    asked.push_back(name);
    return true;
  };
  EXPECT_EQ(boundary("experts.e0.up"), "");
  EXPECT_EQ(asked, std::vector<std::string>{""});
  o.hook_boundary_predicate = nullptr;
  // a resolver choosing a container: an error naming it, the parameter and the fix
  o.hook_boundary_resolver = [](const std::string&, const at::Tensor&) { return std::string("mix"); };
  try {
    boundary("mix.0");
    FAIL() << "a container boundary was accepted";
  } catch (const c10::ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0"), std::string::npos) << what;
    EXPECT_NE(what.find("'mix' for parameter 'mix.0', a container"), std::string::npos) << what;
    EXPECT_NE(what.find("its parent"), std::string::npos) << what;
  }
}

TEST(RoutingTest, RoutesOfAGptWithoutAnyRank) {
  models::GPT m(dmuon::testing::small_config(2));
  DedicateOptions o;
  o.route_hint_fn = [](const std::string& name, const at::Tensor&) {
    return name == "tok_emb.weight" ? std::string("sharded_adamw") : std::string();
  };
  ParamPolicy head = bf16();
  o.param_policy.push_back({"head", head});
  const Routing r = route_params(model_view(*m), models::is_muon_matrix, o, RoutingContext{});
  ASSERT_EQ(r.dedicated.size(), 14u);  // 7 matrices per block
  ASSERT_EQ(r.specs.size(), r.dedicated.size());
  for (size_t i = 0; i < r.dedicated.size(); ++i) {
    const RoutedParam& d = r.dedicated[i];
    EXPECT_EQ(d.route, RouteKind::Dedicated);
    EXPECT_EQ(d.boundary, d.name.substr(0, d.name.find('.', 7)));  // "layers.N"
    EXPECT_EQ(r.specs[i].name, d.name);
    EXPECT_EQ(r.specs[i].group_key, d.boundary);
    EXPECT_EQ(r.specs[i].elem_bytes, 4);
  }
  ASSERT_EQ(r.routed.size(), 1u);
  const std::vector<RoutedParam>& sharded = r.routed.at(RouteKind::Sharded);
  ASSERT_EQ(sharded.size(), 1u);
  EXPECT_EQ(sharded[0].name, "tok_emb.weight");
  EXPECT_EQ(sharded[0].boundary, "tok_emb");
  // norms and the head are replicated; the head computes in bf16 with an fp32 master
  EXPECT_EQ(r.base.size(), 2u * 2u + 2u);
  ASSERT_EQ(r.to_cast.size(), 1u);
  EXPECT_TRUE(r.to_cast[0].second.has_master());
  // boundaries in model order of first appearance; the head's bf16 policy casts its inputs
  EXPECT_EQ(r.boundary_order, (std::vector<std::string>{"tok_emb", "layers.0", "layers.1"}));
  EXPECT_TRUE(r.input_cast.empty());  // the head is not a boundary (replicated): nothing to cast at one
  // the digest moves with the base parameters' precision (part of the cross-rank fingerprint)
  const Routing plain = route_params(model_view(*m), models::is_muon_matrix, DedicateOptions{}, RoutingContext{});
  EXPECT_NE(plain.base_digest, r.base_digest);
  EXPECT_EQ(route_params(model_view(*m), models::is_muon_matrix, DedicateOptions{}, RoutingContext{}).base_digest,
            plain.base_digest);
}

TEST(RoutingTest, LayoutRestrictionsAreClearErrors) {
  models::GPT m(dmuon::testing::small_config(2));
  DedicateOptions sharded;
  sharded.route_hint_fn = [](const std::string& name, const at::Tensor&) {
    return name == "head.weight" ? std::string("sharded_adamw") : std::string();
  };
  std::string err = error_of([&] { route_params(model_view(*m), models::is_muon_matrix, sharded, RoutingContext{1, true}); });
  EXPECT_NE(err.find("rank 1: dedicate_params_ddp: parameter 'head.weight' is routed to sharded_adamw"),
            std::string::npos)
      << err;
  DedicateOptions gather;
  gather.muon_forward_unshard = "all_gather";
  EXPECT_EQ(route_params(model_view(*m), models::is_muon_matrix, gather, RoutingContext{}).dedicated[0].unshard,
            UnshardMode::AllGather);
  // HSDP and the DDP path take it; tensor parallelism does not (the seed's rule)
  for (const RoutingContext& ok : {RoutingContext{0, false}, RoutingContext{0, true}})
    EXPECT_EQ(route_params(model_view(*m), models::is_muon_matrix, gather, ok).dedicated[0].unshard, UnshardMode::AllGather);
  err = error_of([&] { route_params(model_view(*m), models::is_muon_matrix, gather, RoutingContext{2, false, true}); });
  EXPECT_NE(err.find("rank 2: dedicate_params: muon_forward_unshard=\"all_gather\" (parameter 'layers.0."),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("not supported with tensor parallelism"), std::string::npos) << err;
  DedicateOptions bad;
  bad.muon_forward_unshard = "scatter";
  err = error_of([&] { route_params(model_view(*m), models::is_muon_matrix, bad, RoutingContext{}); });
  EXPECT_NE(err.find("has muon_forward_unshard 'scatter'; use \"broadcast\" or \"all_gather\""), std::string::npos)
      << err;
  // a 1-D parameter routed to Muon names the route's source
  err = error_of([&] { route_params(model_view(*m), [](const std::string&, const at::Tensor&) { return true; }, DedicateOptions{},
                                    RoutingContext{}); });
  EXPECT_NE(err.find("the predicate routed 'layers.0.attn_norm.weight' to Muon"), std::string::npos) << err;
}
