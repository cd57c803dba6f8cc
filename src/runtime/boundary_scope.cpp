// dmuon::forward's boundary scope and the identity autograd function around each boundary.
#include <ATen/SequenceNumber.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>
#include <stdexcept>
#include <unordered_set>

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

// A hook on `y` running the boundary's pre-backward work, at most once per backward pass among the
// hooks sharing `last`. A tensor hook runs before the backward of the op that produced the tensor, so
// before the block's backward takes that gradient, as FSDP2's; the tensor passes on as the very one the
// block returned, so the caller may modify it in place as in torch (a custom Function's view could not
// be). The lambda keeps the runtime's id, not the runtime.
void hook_tensor(const at::Tensor& y, uint64_t id, int b, const std::shared_ptr<std::weak_ptr<void>>& last) {
  y.register_hook([id, b, last](const at::Tensor&) {
    if (auto live = detail::runtime_by_id(id)) live->pre_backward_once(b, *last);
  });
}

// LibTorch 2.x can renumber a node (Node::set_sequence_nr); 1.13 cannot (its sequence number is const).
template <typename N>
constexpr bool can_renumber = requires(N& n) { n.set_sequence_nr(uint64_t{0}); };

}  // namespace

namespace detail {

struct BoundaryScope::Impl {
  BoundarySite site;
  // Where the gradients of the tensors the block was given go, as they were when it got them: a non-leaf's
  // node and output slot (held: a node is never freed and its address reused while the block runs), a
  // leaf's own tensor. An output whose origin is one of them is an argument passed through.
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uint32_t>> argument_nodes;
  std::vector<c10::intrusive_ptr<c10::TensorImpl>> argument_leaves;
  bool entered = false;
  bool exited = false;
  bool root_open = false;  // begin_root_forward ran and end_root_forward not yet
  bool outer_grad_mode = true;  // what begin_root_forward returned
  void end_root() {
    if (!root_open) return;
    root_open = false;
    site.root->end_root_forward(outer_grad_mode);
  }
  uint64_t entry_nr = 0;      // this thread's next autograd sequence number when the block was entered
  uint64_t entry_thread = 0;  // (RecordFunction's id of the thread that entered it)
  const Boundary& B() const { return site.state->boundaries()[static_cast<size_t>(site.boundary)]; }

  void note(const at::Tensor& t) {
    if (!t.defined() || !t.requires_grad()) return;
    if (t.is_leaf())
      argument_leaves.push_back(t.getIntrusivePtr());
    else
      argument_nodes.emplace_back(t.grad_fn(), t.output_nr());
  }
  bool passed_through(const at::Tensor& t) const {
    if (t.is_leaf()) {
      for (const auto& leaf : argument_leaves)
        if (leaf.get() == t.unsafeGetTensorImpl()) return true;
      return false;
    }
    for (const auto& [node, slot] : argument_nodes)
      if (node == t.grad_fn() && slot == t.output_nr()) return true;
    return false;
  }
  bool argument_node(const torch::autograd::Node* n) const {
    for (const auto& entry : argument_nodes)
      if (entry.first.get() == n) return true;
    return false;
  }

  // Autograd's ready queue runs the node with the higher sequence number first, and a thread numbers the
  // nodes it makes on its own counter. The block's nodes made on this thread are numbered after the input's
  // post-backward wrapper, so they all run before it, their parameters' gradients before the boundary's
  // reduce. Nodes the block made on another thread (its ops on a worker: threaded experts, parallel_apply)
  // carry that thread's numbers and may run after the wrapper: their gradients would miss the reduce. They
  // are renumbered as if made here now, so they run before the wrapper as the block's own nodes do; the
  // order between boundaries, hence every rank's order of collectives, is unchanged. The walk goes from the
  // outputs down to the tensors the block was given, the parameters' accumulators, the nodes this thread
  // made before the block and another thread's boundary wrappers (a boundary entered on a worker, whose own
  // exit ordered it). Not walked: a recompute inside backward (activation checkpointing), whose nodes are
  // made on the thread running backward. Numbers order nodes within one device's queue only: a worker's
  // nodes on another device (parallel_apply over GPUs) run concurrently with the wrapper and may still come
  // late (dropped, warned). (LibTorch 1.13 cannot renumber: a gradient arriving late is dropped, warned.)
  template <typename N = torch::autograd::Node>
  void renumber_foreign_nodes(const std::vector<at::Tensor>& outputs) const {
    if constexpr (can_renumber<N>) {
      const uint64_t here = at::sequence_number::peek();
      std::unordered_set<const N*> seen;
      std::vector<N*> todo;
      auto visit = [&](N* n) {
        if (!n || !seen.insert(n).second || argument_node(n)) return;
        if (n->sequence_nr() == std::numeric_limits<uint64_t>::max()) return;  // an accumulator: a leaf's
        if (n->thread_id() == entry_thread) {
          if (n->sequence_nr() < entry_nr) return;  // made before the block
        } else {
          if (dynamic_cast<const torch::autograd::CppNode<BoundaryHookFn>*>(n)) return;  // a worker's boundary
          n->set_sequence_nr(here);
        }
        todo.push_back(n);
      };
      for (const at::Tensor& y : outputs)
        if (y.defined() && y.requires_grad() && !y.is_leaf()) visit(y.grad_fn().get());
      while (!todo.empty()) {
        N* n = todo.back();
        todo.pop_back();
        for (const torch::autograd::Edge& e : n->next_edges()) visit(e.function.get());
      }
    }
  }
};

bool renumbers_worker_nodes() { return can_renumber<torch::autograd::Node>; }

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

BoundaryScope::~BoundaryScope() {
  try {
    if (impl_) impl_->end_root();  // (a scope left by neither exit nor rethrow)
  } catch (...) {
  }
}

void BoundaryScope::note_argument(const at::Tensor& t) const {
  if (!impl_->site.state || !t.defined() || !t.requires_grad()) return;
  impl_->note(t);
  if (t.is_view()) impl_->note(at::Tensor(t._base()));  // (a returned argument's gradient reaches its base's node first)
}

void BoundaryScope::enter() {
  impl_->entry_nr = at::sequence_number::peek();
  impl_->entry_thread = at::RecordFunction::currentThreadId();
  if (impl_->site.root) {
    impl_->outer_grad_mode = impl_->site.root->begin_root_forward();  // the model's own forward: a new pass
    impl_->root_open = true;
  }
  if (impl_->site.state) {
    impl_->site.state->pre_forward(impl_->site.boundary);
    // every use that can give the parameters a gradient counts, with or without a post-backward hook
    impl_->site.state->note_use(impl_->site.boundary, at::GradMode::is_enabled());
  }
  impl_->entered = true;
}

at::Tensor BoundaryScope::cast_input(const at::Tensor& t) const {
  note_argument(t);
  if (!impl_->site.state || !t.defined() || !t.is_floating_point()) return t;
  const auto& d = impl_->B().input_dtype;
  if (!d || t.scalar_type() == *d) return t;
  at::Tensor cast = t.to(*d);
  note_argument(cast);  // the block is given the cast
  return cast;
}

at::Tensor BoundaryScope::enter(const at::Tensor& input) {
  enter();
  const at::Tensor x = cast_input(input);
  if (!impl_->site.state || !at::GradMode::is_enabled() || !x.defined() || !x.requires_grad()) return x;
  at::Tensor wrapped = wrap(x, *impl_->site.state, impl_->site.boundary, HookSide::PostBackward);
  note_argument(wrapped);  // the block is given the wrapper: returned as it is, it passes through
  return wrapped;
}

void BoundaryScope::exit() {
  if (impl_->site.state && impl_->entered && !impl_->exited) impl_->site.state->post_forward(impl_->site.boundary);
  impl_->exited = true;
  impl_->end_root();
}

at::Tensor BoundaryScope::exit(const at::Tensor& output) { return exit(std::vector<at::Tensor>{output}).front(); }

std::vector<at::Tensor> BoundaryScope::exit(const std::vector<at::Tensor>& outputs) {
  const bool recompute = impl_->site.state && impl_->B().recomputing;  // (post_forward ends the recompute)
  exit();
  std::vector<at::Tensor> out = outputs;
  if (!impl_->site.state) return out;
  if (at::GradMode::is_enabled() && !recompute) impl_->renumber_foreign_nodes(outputs);
  const Runtime& rt = *impl_->site.state;
  const int b = impl_->site.boundary;
  const auto& d = impl_->B().output_dtype;
  const bool grad = at::GradMode::is_enabled();
  std::shared_ptr<std::weak_ptr<void>> last;  // shared by this use's hooks: one pre-backward per pass
  for (at::Tensor& y : out) {
    if (!y.defined()) continue;
    const at::Tensor made = y;  // as the block returned it
    if (y.is_floating_point() && d && y.scalar_type() != *d) y = y.to(*d);
    if (!grad || !y.requires_grad()) continue;
    // What autograd reaches first through `made`: the tensor itself, or for a view its base (an in-place
    // change of the view sends the gradient to the base's node, past the view's own).
    const at::Tensor origin = made.is_view() ? at::Tensor(made._base()) : made;
    // an argument returned as it was given (or a view of one) carries no gradient into the block's backward:
    // a hook on it would gather the block again after its backward. Anything else may (an op the block ran,
    // on this thread or a worker's, or a tensor it kept): hooked -- at worst one gather more, never none.
    if (impl_->passed_through(origin) || impl_->passed_through(made)) continue;
    if (origin.is_leaf()) {  // a parameter (or a view of one) returned: wrapped, as a hook on it would pile up
      y = wrap(y, rt, b, HookSide::PreBackward);
      continue;
    }
    if (!last) last = std::make_shared<std::weak_ptr<void>>();
    hook_tensor(y, rt.id(), b, last);
    if (made.is_view()) hook_tensor(origin, rt.id(), b, last);
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
  impl_->end_root();
  const std::string what = detail::error_text(e);
  std::shared_ptr<Runtime> st = impl_->site.root ? impl_->site.root : impl_->site.state;
  if (st && what.find("dmuon: hook boundary") == std::string::npos &&
      what.find(kReplacedParamText) == std::string::npos) {
    const std::string hint = st->bypass_hint();
    if (!hint.empty()) {
      // the hint added, the kind kept: a caller mistake stays one (ValueError in Python)
      if (detail::is_caller_mistake(e))
        TORCH_CHECK_VALUE(false, what, "\n", hint);
      TORCH_CHECK(false, what, "\n", hint);
    }
  }
  throw;
}

}  // namespace detail

}  // namespace dmuon
