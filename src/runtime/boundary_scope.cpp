// dmuon::forward's boundary scope and the identity autograd function around each boundary.
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>

#include "runtime/runtime.h"
#include "comm/error_text.h"

namespace dmuon {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

enum class HookSide : int64_t { PreBackward = 0, PostBackward = 1 };

// Identity whose backward runs a boundary hook: on a boundary's output its backward runs before the
// boundary's own backward (pre-backward), on its input after it (post-backward). It saves the
// Runtime's id, not a pointer: a graph that outlives its model finds no Runtime and does nothing.
struct BoundaryHookFn : torch::autograd::Function<BoundaryHookFn> {
  static variable_list forward(AutogradContext* ctx, at::Tensor x, int64_t runtime_id, int64_t b, int64_t side) {
    ctx->saved_data["id"] = runtime_id;
    ctx->saved_data["b"] = b;
    ctx->saved_data["side"] = side;
    // a gradient that never came (an output the loss does not use) passes on as none, not as zeros:
    // upstream parameters reached only through it keep no gradient, as in torch
    ctx->set_materialize_grads(false);
    return {x.view_as(x)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    if (auto rt = detail::runtime_by_id(static_cast<uint64_t>(ctx->saved_data["id"].toInt()))) {
      const int b = static_cast<int>(ctx->saved_data["b"].toInt());
      if (ctx->saved_data["side"].toInt() == static_cast<int64_t>(HookSide::PreBackward))
        rt->pre_backward(b);
      else
        rt->post_backward(b);
    }
    return {g[0], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor wrap(const at::Tensor& x, const Runtime& rt, int b, HookSide side) {
  return BoundaryHookFn::apply(x, static_cast<int64_t>(rt.id()), static_cast<int64_t>(b), static_cast<int64_t>(side))[0];
}

// The pre-backward hook on a boundary's output `y`: a hook on the tensor itself, which runs before the
// backward of the op that produced it (so before the block's backward takes that gradient, whichever
// output the loss reaches it through), as FSDP2's. The output passes on as the very tensor the block
// returned, so the caller may modify it in place as in torch (a custom Function's view could not be).
// Each output's hook runs the (idempotent) pre-backward work. A leaf (a parameter returned as it is)
// is wrapped instead: a hook on a long-lived tensor would be registered again at every forward.
void hook_pre_backward(at::Tensor& y, const Runtime& rt, int b) {
  if (y.is_leaf()) {
    y = wrap(y, rt, b, HookSide::PreBackward);
    return;
  }
  const uint64_t id = rt.id();
  y.register_hook([id, b](const at::Tensor&) {
    if (auto live = detail::runtime_by_id(id)) live->pre_backward(b);
  });
}

}  // namespace

namespace detail {

struct BoundaryScope::Impl {
  BoundarySite site;
  bool entered = false;
  bool exited = false;
  const Boundary& B() const { return site.state->boundaries()[static_cast<size_t>(site.boundary)]; }
};

BoundarySite boundary_site(const std::shared_ptr<Runtime>& runtime, const std::string& module) {
  TORCH_CHECK_VALUE(runtime, "BoundaryScope: the runtime is null.");
  TORCH_CHECK_VALUE(runtime->view().module(module), "rank ", runtime->mesh().global_rank(), ": BoundaryScope: '", module,
              "' is not a module of the dedicated model view.");
  BoundarySite site;
  for (const Boundary& B : runtime->boundaries())
    if (B.name == module) {
      site.state = runtime;
      site.boundary = B.index;
    }
  if (module.empty()) site.root = runtime;
  return site;
}

BoundaryScope::BoundaryScope(const torch::nn::Module* module) : impl_(std::make_unique<Impl>()) {
  auto [st, b] = boundary_of_module(module);
  impl_->site = {st, b, state_of_model(module)};
}

BoundaryScope::BoundaryScope(const std::shared_ptr<Runtime>& runtime, const std::string& module)
    : BoundaryScope(boundary_site(runtime, module)) {}

BoundaryScope::BoundaryScope(const BoundarySite& site) : impl_(std::make_unique<Impl>()) { impl_->site = site; }

BoundaryScope::~BoundaryScope() = default;

void BoundaryScope::enter() {
  if (impl_->site.root) impl_->site.root->begin_root_forward();  // the model's own forward: a new pass
  if (impl_->site.state) {
    impl_->site.state->pre_forward(impl_->site.boundary);
    // every use that can give the parameters a gradient counts, with or without a post-backward hook
    impl_->site.state->note_use(impl_->site.boundary, at::GradMode::is_enabled());
  }
  impl_->entered = true;
}

at::Tensor BoundaryScope::cast_input(const at::Tensor& t) const {
  if (!impl_->site.state || !t.defined() || !t.is_floating_point()) return t;
  const auto& d = impl_->B().input_dtype;
  return d && t.scalar_type() != *d ? t.to(*d) : t;
}

at::Tensor BoundaryScope::enter(const at::Tensor& input) {
  enter();
  const at::Tensor x = cast_input(input);
  if (!impl_->site.state || !at::GradMode::is_enabled() || !x.defined() || !x.requires_grad()) return x;
  return wrap(x, *impl_->site.state, impl_->site.boundary, HookSide::PostBackward);
}

void BoundaryScope::exit() {
  if (impl_->site.state && impl_->entered && !impl_->exited) impl_->site.state->post_forward(impl_->site.boundary);
  impl_->exited = true;
}

at::Tensor BoundaryScope::exit(const at::Tensor& output) { return exit(std::vector<at::Tensor>{output}).front(); }

std::vector<at::Tensor> BoundaryScope::exit(const std::vector<at::Tensor>& outputs) {
  exit();
  std::vector<at::Tensor> out = outputs;
  if (!impl_->site.state) return out;
  const auto& d = impl_->B().output_dtype;
  const bool grad = at::GradMode::is_enabled();
  for (at::Tensor& y : out) {
    if (y.defined() && y.is_floating_point() && d && y.scalar_type() != *d) y = y.to(*d);
    if (grad && y.defined() && y.requires_grad()) hook_pre_backward(y, *impl_->site.state, impl_->site.boundary);
  }
  return out;
}

void BoundaryScope::rethrow(const std::exception& e) {
  if (impl_->site.state && impl_->entered && !impl_->exited) {
    impl_->exited = true;
    try {
      impl_->site.state->post_forward(impl_->site.boundary);
    } catch (...) {
    }
  }
  const std::string what = detail::error_text(e);
  std::shared_ptr<Runtime> st = impl_->site.root ? impl_->site.root : impl_->site.state;
  if (st && what.find("dmuon: hook boundary") == std::string::npos) {
    const std::string hint = st->bypass_hint();
    if (!hint.empty()) {
      // the hint added, the kind kept: a caller mistake stays one (ValueError in Python)
      if (dynamic_cast<const c10::ValueError*>(&e) || dynamic_cast<const std::invalid_argument*>(&e))
        TORCH_CHECK_VALUE(false, what, "\n", hint);
      TORCH_CHECK(false, what, "\n", hint);
    }
  }
  throw;
}

}  // namespace detail

}  // namespace dmuon
