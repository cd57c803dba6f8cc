// The Runtime's boundary schedule: forward passes, prefetch, Z2/Z3 lifetimes, the reduce order,
// the end of backward, and the optimizer interface -- each step delegated to the routes.
#include "runtime/runtime.h"

#if DMUON_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "comm/agreement.h"
#include "dmuon/env.h"
#include "dmuon/host_sync.h"
#include "dmuon/model_view.h"
#include "runtime/dedicated_route.h"
#include "runtime/local_route.h"
#include "runtime/replicated_route.h"

namespace dmuon {

namespace {
// this thread runs an autograd backward (a graph task): a forward now recomputes for it
bool in_autograd_backward() { return torch::autograd::get_current_graph_task_exec_info() != nullptr; }
// this thread's graph task computes the gradients of given inputs only (torch.autograd.grad, backward(inputs=))
bool partial_backward() {
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  return info != nullptr && !info->empty();
}
// the identity of this thread's graph task (its exec_info map lives as long as it does; LibTorch 1.13 has no id)
const void* current_graph_task() { return torch::autograd::get_current_graph_task_exec_info(); }
}  // namespace

bool Runtime::routed(const std::string& name) const {
  if (dedicated_->find(name) != nullptr) return true;
  ParamView v;
  for (const auto& r : table_routes_)
    if (r->describe(name, v)) return true;
  return false;
}

Route* Runtime::route(RouteKind k) const {
  for (Route* r : routes_)
    if (r->kind() == k) return r;
  return nullptr;
}

std::vector<ParamView> Runtime::describe() const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<ParamView> out;
  for (const ModelView::Tensor& item : view_.params) {
    const at::Tensor& p = item.tensor;
    ParamView v;
    v.name = item.name;
    v.param = p;
    v.shape = p.sizes().vec();
    v.prec = precision_of(p);
    bool routed = false;
    for (const Route* r : routes_)
      if (r->describe(v.name, v)) {
        routed = true;
        break;
      }
    // one a data-parallel route trains (or any, on one rank) stays trainable while frozen, as torch's optimizer
    // keeps model.parameters() whatever their requires_grad: an optimizer built while it is frozen trains it once
    // it is unfrozen (a frozen one on no data-parallel route stays out: each rank would step it alone)
    if (!p.requires_grad() && !(routed && (v.distributed() || mesh().world_size() == 1))) continue;
    out.push_back(std::move(v));
  }
  return out;
}

std::vector<int64_t> Runtime::optim_element_sizes() const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<int64_t> out;
  for (const auto& e : dedicated_->entries()) out.push_back(static_cast<int64_t>(c10::elementSize(e.prec.optim)));
  return out;
}

// ---- forward ---------------------------------------------------------------------------------------
void Runtime::prefetch_after(int b, bool backward) {
  const int depth = backward ? 1 : options().forward_prefetch_depth;
  const ScheduleState& sched = ctx_.schedule;
  if (depth <= 0) return;
  std::vector<int> order;
  if (backward) {
    order.assign(sched.current_order.rbegin(), sched.current_order.rend());
  } else if (!sched.recorded_order.empty()) {
    order = sched.recorded_order;
  } else {
    for (const auto& B : boundaries_) order.push_back(B.index);  // first pass: model order
  }
  auto it = std::find(order.begin(), order.end(), b);
  if (it == order.end()) return;
  for (int k = 1; k <= depth && it + k < order.end(); ++k) {
    const int nb = *(it + k);
    if (!backward && boundaries_[static_cast<size_t>(nb)].ran_forward) continue;
    issue_unshards(nb, backward ? "backward prefetch broadcast" : "forward prefetch broadcast", backward, true);
  }
}

void Runtime::issue_unshards(int b, const char* phase, bool backward, bool prefetch, const std::vector<Route*>* only) {
  const std::vector<Route*>& which = only ? *only : routes();
  if (unshard_stats_.empty()) {
    for (Route* r : which) r->issue_unshard(b, phase);
    return;
  }
  CommCounters& c = mesh().counters();
  auto received = [&] { return c.bytes(CommOp::Broadcast) + c.bytes(CommOp::AllGather); };
  const int64_t before = received();
  const int64_t calls = c.calls(CommOp::Broadcast) + c.calls(CommOp::AllGather);
  for (Route* r : which) r->issue_unshard(b, phase);
  if (c.calls(CommOp::Broadcast) + c.calls(CommOp::AllGather) == calls) return;  // already unsharded
  BoundaryUnshardStats& s = unshard_stats_[static_cast<size_t>(b)];
  (backward ? s.backward_unshards : s.forward_unshards) += 1;
  if (prefetch && !backward) ++s.forward_prefetched;
  (backward ? s.backward_bytes : s.forward_bytes) += received() - before;
}

void Runtime::wait_unshards(int b, bool backward) {
  if (unshard_stats_.empty()) {
    for (Route* r : routes()) r->wait_unshard(b);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int span = unshard_spans_->begin();  // CUDA: the waits are stream dependencies, timed on the stream
  for (Route* r : routes()) r->wait_unshard(b);
  unshard_spans_->end(span, 2 * b + (backward ? 1 : 0));
  BoundaryUnshardStats& s = unshard_stats_[static_cast<size_t>(b)];
  (backward ? s.backward_waits : s.forward_waits) += 1;
  (backward ? s.backward_wait_ms : s.forward_wait_ms) +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<BoundaryUnshardStats> Runtime::unshard_stats(bool clear) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (device_timed_unshards()) {
    for (const auto& [key, ms] : unshard_spans_->take_ms()) {  // waits for the recorded events
      BoundaryUnshardStats& s = unshard_stats_[static_cast<size_t>(key / 2)];
      (key % 2 ? s.backward_device_wait_ms : s.forward_device_wait_ms) += ms;
    }
  }
  std::vector<BoundaryUnshardStats> out = unshard_stats_;
  if (clear) {
    for (auto& s : unshard_stats_) s = BoundaryUnshardStats{s.boundary};
    profiled_passes_ = 0;
  }
  return out;
}

void Runtime::reset_post_forward_order() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  ctx_.schedule.recorded_order.clear();
  ctx_.schedule.current_order.clear();
}

bool Runtime::in_flight() {
  std::unique_lock<std::recursive_mutex> g(mu_, std::try_to_lock);
  if (!g.owns_lock()) return true;
  try {
    for (Route* r : routes())
      if (r->in_flight()) return true;
  } catch (const std::exception&) {  // finished, with an error (a lost peer): nothing left in flight to protect
  }
  return false;
}

std::vector<std::string> Runtime::post_forward_order() const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  const ScheduleState& sched = ctx_.schedule;
  std::vector<std::string> out;
  for (int b : sched.recorded_order.empty() ? sched.current_order : sched.recorded_order)
    out.push_back(boundaries_[static_cast<size_t>(b)].name);
  return out;
}

void Runtime::begin_forward_pass() {
  ScheduleState& sched = ctx_.schedule;
  if (!sched.current_order.empty()) sched.recorded_order = sched.current_order;
  sched.current_order.clear();
  ++sched.pass;
  ++profiled_passes_;
  for (auto& B : boundaries_) B.ran_forward = false;
  backward_since_forward_ = false;
}

bool Runtime::begin_root_forward() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  const bool outer = root_grad_mode_;
  // Autocast keeps each leaf parameter's low-precision cast for the whole autocast region: a second forward
  // in the region (micro-batches of gradient accumulation) would reuse the first's cast node, which autograd
  // runs last (its sequence number is the oldest), after the boundary's reduce went out, and dmuon would drop
  // what it brings. Each forward of the model casts afresh, as one autocast region per forward does.
  if (root_open_ == 0) at::autocast::clear_cache();
  ++root_open_;
  root_grad_mode_ = at::GradMode::is_enabled();
  if (pass_begun_by_step_) {  // step() began this pass and prefetched into it
    pass_begun_by_step_ = false;
    return outer;
  }
  begin_forward_pass();
  return outer;
}

void Runtime::end_root_forward(bool outer_grad_mode) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (root_open_ > 0) --root_open_;
  root_grad_mode_ = outer_grad_mode;  // (a root forward run inside another: the outer one's mode again)
}

void Runtime::drop_grads_if_cleared(bool in_backward) {
  // The model's gradients were cleared without the optimizer (LibTorch's Module::zero_grad(), which a GAN loop
  // calls on the discriminator after the generator's backward went through it): every gradient the last
  // backward left in p.grad is gone. What dmuon holds outside p.grad (the owners' reduced sums, sharded
  // slices) goes too, as the optimizer's zero_grad drops it; else the next step would add that earlier
  // backward's gradients. At a forward every one must be gone (None); at a backward's first hook, this pass
  // may have given some a new gradient already, so gone or new, and at least one gone (a caller who rewrote
  // every gradient out of place, p.grad = p.grad / n, cleared nothing). (Every rank's calls are the same, so
  // is this decision. zero_grad(false) zeroes the same tensors: not seen, the optimizer's zero_grad is needed.)
  if (left_grads_.empty()) return;
  bool gone = false;
  for (const LeftGrad& l : left_grads_) {
    const at::Tensor& g = l.param.grad();
    if (!g.defined()) {
      gone = true;
      continue;
    }
    if (!in_backward || l.grad.lock().get() == g.unsafeGetTensorImpl()) return;  // still there (or replaced)
  }
  if (!gone) return;
  discard_grads(/*set_to_none=*/true);  // (no warning: clearing p.grad by hand is a zero_grad, as in torch)
}

void Runtime::pre_forward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  Boundary& B = boundaries_[static_cast<size_t>(b)];
  const bool in_backward = in_autograd_backward();
  if (!in_backward && backward_abandoned()) drop_abandoned_backward("the next forward", /*param_grads=*/true);
  if (!in_backward) drop_grads_if_cleared(/*in_backward=*/false);
  if (in_backward && (backward_live() || (B.ran_forward && !backward_since_forward_))) {
    // A forward inside this model's backward (its hooks ran, or the block ran forward in this pass and
    // no backward ended since): activation checkpointing (torch.utils.checkpoint, reentrant or not)
    // recomputing the block for its backward. The parameters are this backward's (pre_backward
    // unsharded them; the reduce releases them): no new pass, nothing recorded, no release after it.
    // The end-of-backward callback goes on this (the outer) backward, before a reentrant checkpoint's
    // nested backward could take it.
    note_backward(/*engine_hook=*/false);  // (a recompute runs in grad mode whatever the backward's create_graph)
    B.recomputing = true;
    B.in_forward = true;
    if (!ddp()) {
      issue_unshards(b, "backward broadcast", true, false);  // (no collective where pre_backward issued it)
      wait_unshards(b, true);
    }
    return;
  }
  for (Route* r : routes()) r->check_params(b, "");  // (before anything of this forward: an error changes nothing)
  pass_begun_by_step_ = false;
  if (backward_since_forward_ || B.ran_forward) begin_forward_pass();
  B.ran_forward = true;
  B.ran_since_backward = true;
  B.in_forward = true;
  ctx_.schedule.boundaries_seen = true;
  ctx_.schedule.current_order.push_back(b);
  issue_unshards(b, "forward broadcast", false, false);
  prefetch_after(b, /*backward=*/false);
  wait_unshards(b, false);
}

void Runtime::post_forward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  Boundary& B = boundaries_[static_cast<size_t>(b)];
  B.in_forward = false;
  // Z3: free after forward, unshard again in backward; Z2: keep until after backward. A recompute inside
  // backward (activation checkpointing) keeps them for the backward that follows it.
  if (z3() && !B.recomputing) release(b);
  B.recomputing = false;
}

void Runtime::release(int b) {
  for (Route* r : routes()) r->release(b);
}

// ---- backward --------------------------------------------------------------------------------------
void Runtime::note_backward(bool engine_hook) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (backward_live()) {
    if (engine_hook && !pass_mode_checked_) refuse_graph_building_partial_backward();  // (a recompute opened it)
    return;
  }
  // (retain_graph: a backward again without a forward; what it accumulated so far stays)
  if (backward_abandoned()) drop_abandoned_backward("the next backward", /*param_grads=*/false);
  drop_grads_if_cleared(/*in_backward=*/true);  // (a zero_grad between the forward and this backward)
  pass_mode_checked_ = false;
  if (engine_hook) refuse_graph_building_partial_backward();
  backward_open_ = true;
  pass_task_ = current_graph_task();
  // a backward through a retained graph (no use counted since the last backward): the uses of that graph (a
  // boundary used by two forwards gets two gradients again; expecting fewer would reduce before the second)
  for (auto& B : boundaries_)
    if (B.post_expected == 0 && B.uncounted_uses == 0) B.post_expected = B.retained_uses;
  if (!reduce_order_fixed_ && ddp()) {
    // The DDP path: every boundary, the last in model order first, on every rank, whatever ran here.
    // Ranks may run different boundaries (a data-dependent branch, an expert that got no tokens): one
    // this rank did not run since the last backward (nor in this pass) gets no gradient here and is
    // ready at once (its has-gradient flags say so), so every rank issues the same reduces in the same
    // order, as torch's DDP with find_unused_parameters.
    reduce_order_.clear();
    for (int b = static_cast<int>(boundaries_.size()) - 1; b >= 0; --b) {
      Boundary& B = boundaries_[static_cast<size_t>(b)];
      reduce_order_.push_back(b);
      if (!B.ran_forward && !B.ran_since_backward) B.grads_ready = true;
    }
    next_reduce_ = 0;
    reduce_order_fixed_ = true;
  }
  if (!reduce_order_fixed_) {
    // reverse forward order; then every other boundary entered since the last backward (a block
    // run twice, or forward passes before this backward), in model order -- the same on every rank
    reduce_order_.clear();
    const std::vector<int>& current = ctx_.schedule.current_order;
    for (auto it = current.rbegin(); it != current.rend(); ++it)
      if (std::find(reduce_order_.begin(), reduce_order_.end(), *it) == reduce_order_.end()) reduce_order_.push_back(*it);
    for (const auto& B : boundaries_)
      if (B.ran_since_backward && std::find(reduce_order_.begin(), reduce_order_.end(), B.index) == reduce_order_.end())
        reduce_order_.push_back(B.index);
    next_reduce_ = 0;
    reduce_order_fixed_ = true;
  }
  auto token = std::make_shared<char>(0);
  backward_token_ = token;
  torch::autograd::Engine::get_default_engine().queue_callback([weak = weak_from_this(), token] {
    if (auto rt = weak.lock()) rt->end_of_backward();
  });
}

void Runtime::refuse_graph_building_partial_backward() {
  // (in the engine's hooks grad mode is the backward's create_graph; a checkpoint's recompute is not asked)
  pass_mode_checked_ = true;
  if (!at::GradMode::is_enabled() || !partial_backward() || ddp()) return;
  bool frees = mesh().shard_size() > 1;  // (one shard rank keeps every matrix; sharded_adamw frees at any size)
  for (const auto& r : table_routes_) frees = frees || r->kind() == RouteKind::Sharded;
  TORCH_CHECK_VALUE(!frees, "rank ", mesh().global_rank(), ": a backward pass with create_graph=True that computes "
                    "the gradients of some inputs only (torch.autograd.grad(..., create_graph=True), e.g. a gradient "
                    "penalty) ran through this dedicated model. dmuon ends each backward pass by reducing the "
                    "parameters' gradients and freeing the parameters this rank does not keep, so the graph that "
                    "pass builds (differentiated again by the loss's backward) would lose them. Dedicate a model "
                    "whose loss differentiates its gradients with dedicate_params_ddp (every rank keeps the full "
                    "parameters, and gradients are reduced once, in the loss's backward).");
}

void Runtime::pre_backward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  note_backward();
  if (ddp()) return;
  if (z3()) {
    issue_unshards(b, "backward broadcast", true, false);
    prefetch_after(b, /*backward=*/true);
  } else {
    // Z2 keeps them from the forward (no collective here), unless the backward of another graph released
    // them since: forwards first, then a backward each (the other graphs' saved views are filled again)
    issue_unshards(b, "backward broadcast", true, false);
  }
  wait_unshards(b, true);
}

void Runtime::pre_backward_once(int b, std::weak_ptr<void>& last) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  note_backward();  // (a new pass makes a new token)
  const std::shared_ptr<void> now = backward_token_.lock(), seen = last.lock();
  if (now && seen == now) return;
  pre_backward(b);
  last = now;
}

void Runtime::note_use(int b, bool grad_mode) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  Boundary& B = boundaries_[static_cast<size_t>(b)];
  if (B.recomputing) {
    // non-reentrant checkpointing: the first run counted this use (its graph's post-backward hook
    // fires); reentrant: the first run had no grad mode, and the recompute's graph is the one
    if (grad_mode && B.uncounted_uses > 0) {
      --B.uncounted_uses;
      ++B.post_expected;
    }
    return;
  }
  // A use under no_grad is counted only where a reentrant checkpoint could recompute it in backward: inside
  // a root forward that runs in grad mode. Not in an evaluation forward (the root under no_grad), nor outside
  // the root's forward (a block called alone under no_grad to sample or probe; a C++ model calling its blocks
  // through dmuon::forward has no root scope: LibTorch has no checkpointing that recomputes in backward, and
  // its evaluation forwards would hold the next backward's reduces to its end).
  if (!grad_mode && !(root_open_ > 0 && root_grad_mode_)) return;
  ++(grad_mode ? B.post_expected : B.uncounted_uses);
}

void Runtime::post_backward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  note_backward();
  Boundary& B = boundaries_[static_cast<size_t>(b)];
  // A block used several times in one graph is done only after the backward of every use. A use whose
  // input needed no gradient fires no post-backward hook: then the hooks never count up to the uses,
  // and the parameters' own accumulation (note_accumulated) or the end of backward decides. A use that
  // ran without grad mode may still be recomputed in this backward (reentrant activation checkpointing of
  // a block used twice: its uses are recomputed one at a time), so none may be left (done_with_uses).
  if (++B.post_fired >= B.post_expected && done_with_uses(B)) B.grads_ready = true;
  try_issue_reduces();
}

bool Runtime::after_reduce(int b) {
  note_backward();  // (a new pass: what an abandoned backward left is cleared first)
  Boundary& B = boundaries_[static_cast<size_t>(b)];
  // Autograd runs a block's nodes before its input's post-backward hook only while they are numbered after
  // it: the scope renumbers nodes the block made on a worker thread (LibTorch 2.x), but a use of the parameter
  // outside its boundary, or on 1.13 a worker's node, may still run after. Said and dropped, not waited for:
  // whether to wait would depend on each rank's own counts, and the ranks must issue their reduces and
  // unshards in one order.
  if (!B.reduced || no_sync_) return false;
  if (!B.warned_late) {
    B.warned_late = true;
    TORCH_WARN("rank ", mesh().global_rank(), ": a gradient of a parameter of boundary '", B.name,
               "' arrived after the boundary's reduce went out this backward and is dropped: a use of the parameter "
               "outside its boundary", detail::renumbers_worker_nodes() ? "" : ", or the block's ops run on another thread",
               ", or a reentrant activation checkpoint (use_reentrant=True, checkpoint_wrapper's REENTRANT) around a "
               "block that runs more than once per forward. Run every use of the parameter inside its boundary",
               detail::renumbers_worker_nodes() ? "" : ", on the thread that calls it (LibTorch 2.x renumbers a worker's ops)",
               "; checkpoint such a block non-reentrantly (use_reentrant=False).");
  }
  return true;
}

void Runtime::note_accumulated(bool& accumulated, int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  note_backward();
  // A reentrant activation checkpoint whose block is the boundary (checkpoint_wrapper applied before
  // dedicate_params) runs one nested backward per use it recomputes: a block used twice accumulates its
  // parameters once per use, the first before the other use's gradient exists. Readiness then comes from
  // the post-backward hooks (which count the uses) or the end of backward.
  if (accumulated || current_graph_task() != pass_task_) return;
  accumulated = true;
  Boundary& B = boundaries_[static_cast<size_t>(b)];
  if (++B.accumulated == B.num_params && done_with_uses(B)) B.grads_ready = true;
  try_issue_reduces();
}

void Runtime::try_issue_reduces() {
  // Reduces go out in the reverse forward order on every rank; a boundary that is ready early waits
  // for the ones before it, so all ranks issue the same collectives in the same order.
  if (no_sync_) return;  // gradient accumulation: reduce once, after the last micro-batch
  while (next_reduce_ < reduce_order_.size() && boundaries_[static_cast<size_t>(reduce_order_[next_reduce_])].grads_ready) {
    issue_reduce(reduce_order_[next_reduce_]);
    ++next_reduce_;
  }
}

void Runtime::issue_reduce(int b) {
  Boundary& B = boundaries_[static_cast<size_t>(b)];
  if (B.reduced) return;
  B.reduced = true;
  for (Route* r : routes()) r->issue_reduce(b);
  release(b);  // the parameters are not needed again before the next forward
}

void Runtime::end_of_backward() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (!no_sync_ && !warned_unrecomputed_)
    for (const Boundary& B : boundaries_)
      if (!done_with_uses(B) && !B.reduced) {
        warned_unrecomputed_ = true;
        TORCH_WARN("rank ", mesh().global_rank(), ": boundary '", B.name, "' ran under no_grad inside a training "
                   "forward and was not recomputed in this backward (as a reentrant activation checkpoint's use "
                   "would be), so its reduce and the ones after it waited to the end of backward (no overlap; on "
                   "Z3 their parameters stayed gathered). If the block's no-grad use is on purpose (a teacher or "
                   "target pass), run it outside the training forward, or the block without its hook. Said once.");
        break;
      }
  // Fire every boundary whose backward hooks did not run (no input needed grad, unused outputs...).
  if (!no_sync_)
    for (; next_reduce_ < reduce_order_.size(); ++next_reduce_) issue_reduce(reduce_order_[next_reduce_]);
  ++grads_epoch_;
  local_grads_only_ = no_sync_;
  if (!no_sync_ && !grads_taken_ && !specs().empty() && ++synced_backwards_ == 2)
    TORCH_WARN("rank ", mesh().global_rank(), ": a second backward through this dedicated model, and no dmuon "
               "optimizer was built on it: dmuon holds each Muon matrix's averaged gradient for dmuon.Muon (on its "
               "owner, outside p.grad), so another optimizer (torch.optim.AdamW(model.parameters()), ...) sees no "
               "gradient for the matrices and leaves them untrained. Build dmuon.Muon on the model (dmuon::Muon in "
               "C++), or call dmuon.prepare_muon_grads(model) before that optimizer's step (the owners' p.grad). "
               "Said once.");
  clear_pass_state(/*accumulating=*/no_sync_);
  if (no_sync_) {
    for (Route* r : routes()) r->upcast_local_grads();
  } else {
    for (Route* r : routes()) r->end_of_backward();  // HSDP: the last stage-2 reduces; replicated all-reduces
  }
  left_grads_.clear();
  for (const ModelView::Tensor& item : view_.params)
    if (item.tensor.grad().defined())
      left_grads_.push_back(LeftGrad{item.tensor, c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
                                                      item.tensor.grad().getIntrusivePtr())});
  backward_open_ = false;  // (last: a route that throws here leaves the backward abandoned, found as such)
}

void Runtime::clear_pass_state(bool accumulating) {
  for (auto& B : boundaries_) {
    release(B.index);
    if (!accumulating) B.ran_since_backward = false;
    if (B.post_expected > 0) B.retained_uses = B.post_expected;  // (its graph may be run backward again)
    B.post_expected = 0;
    B.uncounted_uses = 0;
    B.post_fired = 0;
    B.grads_ready = false;
    B.accumulated = 0;
    B.reduced = false;
  }
  for (Route* r : routes()) r->reset_pass();
  reduce_order_fixed_ = false;
  reduce_order_.clear();
  next_reduce_ = 0;
  backward_since_forward_ = true;
}

void Runtime::drop_abandoned_backward(const char* warn_where, bool param_grads) {
  if (warn_where)
    TORCH_WARN("rank ", mesh().global_rank(), ": the last backward through this dmuon model did not finish (an "
               "exception was raised in it), so its gradients are incomplete. dmuon dropped ",
               param_grads ? "every gradient of its parameters" : "the gradients it held outside p.grad",
               " (that backward's and any earlier micro-batch's) at ", warn_where, ", as zero_grad() would. Call "
               "optimizer.zero_grad() after catching such an exception (every rank the same way) to drop them "
               "yourself and silence this warning.");
  // What the abandoned backward issued is waited (every rank that ran it issued the same collectives; a
  // rank whose peers did not abandon theirs ends in the collective timeout, an error), then dropped.
  for (Route* r : routes()) r->discard_grads();
  for (auto& B : boundaries_) {
    B.in_forward = false;
    B.recomputing = false;
  }
  local_grads_only_ = false;
  clear_pass_state(/*accumulating=*/false);
  backward_open_ = false;
  ++grads_epoch_;
  // and what autograd accumulated into the parameters before the exception (dedicated matrices whose
  // boundary was not reduced yet, replicated and local parameters)
  if (param_grads)
    for (const ModelView::Tensor& item : view_.params)
      if (item.tensor.grad().defined()) at::Tensor(item.tensor).mutable_grad() = at::Tensor();
}

std::string Runtime::bypass_hint() const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  for (const auto& B : boundaries_) {
    if (B.ran_forward && !backward_since_forward_) continue;
    const std::string hint = dedicated_->bypass_hint(B.index);
    if (!hint.empty()) return hint;
  }
  return "";
}

// ---- optimizer interface ---------------------------------------------------------------------------
void Runtime::require_reduced_grads(const char* fn) const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  // (checked before any collective: every rank that accumulated the same way raises here)
  TORCH_CHECK(!local_grads_only_ || mesh().data_parallel_size() == 1, "rank ", mesh().global_rank(), ": ", fn,
              ": the last backward through this dmuon model ran inside no_sync, so the gradients are this rank's "
              "own, never reduced across the ", mesh().data_parallel_size(), " data-parallel ranks: updating with them "
              "would give each replica a different step and the ranks would drift apart. Run the last micro-batch's "
              "backward outside no_sync (it reduces what the earlier ones accumulated), or call "
              "optimizer.zero_grad() to drop them.");
}

void Runtime::prepare_grads(bool dedicated) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  grads_taken_ = true;
  TORCH_CHECK(!backward_abandoned(), "rank ", mesh().global_rank(), ": the last backward through this dmuon model did "
              "not finish (an exception was raised in it), so the gradients dmuon holds are incomplete and no step "
              "or gradient clipping can use them. Call optimizer.zero_grad() after catching the exception (every "
              "rank the same way), then run the batch again or go on with the next one.");
  at::NoGradGuard ng;
  std::vector<Route*> rs;
  for (Route* r : routes())
    if (dedicated || r != dedicated_.get()) rs.push_back(r);
  for (Route* r : rs) r->finish_reduces();
  // Which parameters got a gradient on some rank: every has-gradient flag of this rank's sums in
  // one device-to-host read per step (not one per parameter), in a fixed order.
  std::vector<at::Tensor> parts;
  for (Route* r : rs) r->collect_flags(parts);
  if (parts.empty()) return;
  const at::Tensor host = detail::read_to_host(at::cat(parts));
  const float* flag = host.data_ptr<float>();
  for (Route* r : rs) r->install_grads(flag);
}

namespace {
// The dedicated route's hook groups in `order` (publish order: the next forward's). Group i+1's
// stage-1 reduces are waited and its HSDP stage-2 reduce issued before group i's is waited, so it
// travels while group i is being updated. `done(b, group)` gets each group's ready gradients;
// `timing` (optional) sees the preparing as Phase::Prepare. Collective in the same order on every
// rank (the recorded forward order is the same everywhere; the DDP path publishes in model order).
void prepare_groups_ahead(DedicatedRoute& d, const std::vector<int>& order,
                          const std::function<void(int b, const std::vector<ReadyGrad>& group)>& done,
                          StepVisitor* timing) {
  if (!order.empty()) d.prepare_group(order[0]);
  for (size_t i = 0; i < order.size(); ++i) {
    if (timing) timing->begin(StepVisitor::Phase::Prepare);
    if (i + 1 < order.size()) d.prepare_group(order[i + 1]);
    const std::vector<ReadyGrad> group = d.finish_group(order[i]);
    if (timing) timing->end(StepVisitor::Phase::Prepare);
    done(order[i], group);
  }
}
}  // namespace

void Runtime::prepare_grads_per_group() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  prepare_grads(/*dedicated=*/false);
  prepare_groups_ahead(*dedicated_, publish_order(), [](int, const std::vector<ReadyGrad>&) {}, nullptr);
}

std::vector<ReadyGrad> Runtime::take_ready_grads(bool dedicated) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return take_ready_grads_locked(dedicated);
}

std::vector<ReadyGrad> Runtime::take_ready_grads_locked(bool dedicated) {
  std::vector<ReadyGrad> out;
  for (Route* r : routes())
    if (dedicated || r != dedicated_.get()) r->ready_grads(out);
  return out;
}

std::vector<ReadyGrad> Runtime::current_grads(std::vector<ReadyGrad> taken) {
  std::vector<ReadyGrad> out;
  for (ReadyGrad& r : taken) {
    if (r.in_param_grad) {
      const at::Tensor& now = r.param.grad();
      if (!now.defined()) continue;  // dropped since (p.grad = None): not updated, as in torch
      if (!now.is_same(r.grad)) r.grad = now;  // replaced since
    }
    out.push_back(std::move(r));
  }
  return out;
}

void Runtime::step(bool group_prepare_ahead, bool async, std::optional<std::vector<ReadyGrad>> taken,
                   StepVisitor& v) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  require_reduced_grads("step");
  at::NoGradGuard ng;
  // Z2 keeps what a forward without a backward since (an eval forward between backward and step) gathered: the
  // update makes it stale, and a read outside its boundary (a tied head, a logged norm) would see the old value
  if (!ddp())
    for (const Boundary& B : boundaries_) release(B.index);
  const Mesh& m = mesh();
  // group_prepare_ahead: the dedicated route group by group, each group's Newton-Schulz running
  // while later groups' reduces still arrive and, where step() publishes, each group's publish
  // leaving right after its update. It costs two host reads per group (has-gradient flags,
  // finiteness) instead of two per step. The rule (docs/PERF.md): per group where step() has
  // per-group traffic to overlap -- HSDP's stage-2 reduces, a post-step publish (HSDP, the DDP path,
  // all_gather mode) -- and on the CPU always (its reads are of host memory, free); a 1-D mesh in
  // broadcast mode on a GPU keeps the one-pass step: its only overlap is the last boundary's reduce
  // tail, while each per-group read synchronises the device and drains the launch queue. Never on
  // gradients taken before (clipping took every one) nor with TP (all gathers first).
  const bool traffic = m.is_hsdp() || dedicated_->publishes_in_step();
  const bool per_group = group_prepare_ahead && !taken && !m.has_tp() && (traffic || m.device().is_cpu());
  v.begin(StepVisitor::Phase::Prepare);
  prepare_grads(/*dedicated=*/!per_group);  // collective: the reduces are waited (HSDP: stage 2 too)
  const std::vector<ReadyGrad> ready = taken ? current_grads(std::move(*taken)) : take_ready_grads_locked(!per_group);
  v.end(StepVisitor::Phase::Prepare);
  // TP updates of the last step still arriving by scatter land before this step changes anything
  dedicated_->finish_deferred();
  if (per_group) {  // each group's Newton-Schulz overlaps the next group's reduce; async: published at once
    // the next forward's order where groups are published (the first needed goes first), else the
    // reduce order (the reverse: the last reduce of backward is waited last)
    std::vector<int> order = publish_order();
    if (!traffic) std::reverse(order.begin(), order.end());
    prepare_groups_ahead(
        *dedicated_, order,
        [&](int b, const std::vector<ReadyGrad>& group) {
          v.update(group);
          if (!async) return;
          v.begin(StepVisitor::Phase::Publish);
          dedicated_->publish_group(b, /*async=*/true);
          v.end(StepVisitor::Phase::Publish);
        },
        &v);
  }
  v.update(ready);
  for (Route* r : routes()) r->stepped();
  v.before_publish();
  // collective: HSDP publishes over the replicate group, the DDP path broadcasts from the owners,
  // all_gather unshard scatters; nothing on a 1-D mesh in broadcast mode (the next forward does it)
  v.begin(StepVisitor::Phase::Publish);
  publish(async);  // (the groups published above are skipped)
  v.end(StepVisitor::Phase::Publish);
}

void Runtime::prefetch_next_forward(int groups, bool sharded_adamw) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  at::NoGradGuard ng;
  const ScheduleState& sched = ctx_.schedule;
  // the order of the pass that just ran (not yet moved to recorded_order), else the one before
  const std::vector<int> order = !sched.current_order.empty() ? sched.current_order : sched.recorded_order;
  if (ddp() || order.empty() || no_sync_) return;
  std::vector<Route*> dedicated{dedicated_.get()}, sharded;
  for (Route* r : routes())
    if (r->kind() == RouteKind::Sharded) sharded.push_back(r);
  begin_forward_pass();  // the unshards issued now belong to the next forward
  pass_begun_by_step_ = true;
  std::vector<int> done;
  const size_t n_sharded = sharded_adamw ? static_cast<size_t>(std::max(groups, 1)) : 0;
  for (int b : order) {
    if (std::find(done.begin(), done.end(), b) != done.end()) continue;  // a block run twice: once
    if (done.size() >= std::max(static_cast<size_t>(groups), n_sharded)) break;
    if (done.size() < static_cast<size_t>(groups))
      issue_unshards(b, "post-step prefetch broadcast", false, true, &dedicated);
    if (done.size() < n_sharded && !sharded.empty())
      issue_unshards(b, "post-step prefetch all-gather", false, true, &sharded);
    done.push_back(b);
  }
}

static_assert(detail::kAgreementRowWords * sizeof(int64_t) == kStepVerdictRowBytes,
              "the planners count the step verdict's row (owner_plan.h)");

std::vector<PlannedTraffic> Runtime::planned_step_traffic() const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<PlannedTraffic> out;
  for (const Route* r : routes()) r->plan_step_traffic(out);
  if (step_verdict_) {  // (the optimizer's: comm/agreement.h's all-gather of [refused, count, digest, call])
    Communicator& world = mesh().world();
    add_planned(out, "muon", world, CommOp::AllGather, kStepVerdictRowBytes * world.size());
  }
  return out;
}

void Runtime::set_step_verdict(bool on) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  step_verdict_ = on;
}

uint64_t Runtime::attach_optimizer() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  grads_taken_ = true;
  return ++optimizers_;
}

uint64_t Runtime::take_gradients(uint64_t id) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (grads_taker_ != 0 && grads_taker_ != id && grads_taken_epoch_ == grads_epoch_) return grads_taker_;
  grads_taker_ = id;
  grads_taken_epoch_ = grads_epoch_;
  return 0;
}

void Runtime::release_gradients(uint64_t id) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (grads_taker_ == id) grads_taker_ = 0;
}

void Runtime::set_separate_sharded_unshard(bool on) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  TORCH_CHECK_VALUE(!on || mesh().has_sharded_unshard_group(), "rank ", mesh().global_rank(),
                    ": Muon: sharded_adamw_unshard_separate_stream=true needs a second group over the shard group's "
                    "ranks for the sharded_adamw all-gathers; give the mesh one with Mesh::set_sharded_unshard_group "
                    "(the Python Muon builds it itself).");
  ctx_.set_separate_sharded_unshard(on);
}

void Runtime::defer_update(const std::string& name, std::function<void()> apply) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  dedicated_->defer_update(name, std::move(apply));
}

bool Runtime::backward_abandoned() const {
  return backward_open_ && (backward_token_.expired() || !in_autograd_backward());
}

uint64_t Runtime::grads_epoch() const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  return grads_epoch_;
}

void Runtime::discard_grads(bool set_to_none) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  ++grads_epoch_;
  left_grads_.clear();
  local_grads_only_ = false;
  if (backward_abandoned())
    drop_abandoned_backward(nullptr, /*param_grads=*/false);  // (zero_grad's own work)
  else
    for (Route* r : routes()) r->discard_grads();
  for (Route* r : routes()) r->after_zero_grad(set_to_none);
}

void Runtime::drain_all() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (backward_abandoned()) drop_abandoned_backward("a checkpoint's drain", /*param_grads=*/true);
  for (const auto& B : boundaries_)
    for (Route* r : routes()) r->wait_unshard(B.index);
  prepare_grads();
}

void Runtime::publish(bool async) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  for (Route* r : routes()) r->publish(async);
  if (isolated_pg_barrier_) {
    // strict post-step fence on dmuon's own groups (diagnosis of process-group ordering issues)
    Mesh& m = mesh();
    const bool hsdp = m.replicate() != nullptr;
    if (hsdp) wait_publishes();
    m.shard().barrier(hsdp ? "DMUON_ISOLATED_PG_BARRIER post-step fence (shard)" : "DMUON_ISOLATED_PG_BARRIER post-step fence");
    if (hsdp) m.replicate()->barrier("DMUON_ISOLATED_PG_BARRIER post-step fence (replicate)");
  }
}

void Runtime::wait_publishes() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  const auto& rs = routes();
  for (const auto& B : boundaries_)
    for (Route* r : rs) r->wait_unshard(B.index);
  for (Route* r : rs) r->wait_publishes();
}

// ---- checkpoints ---------------------------------------------------------------------------------
void Runtime::drain(const std::string& fn) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  // Every dedicated and sharded_adamw parameter still holds dmuon's storage: one replaced since (model->to(dtype),
  // p.data = ..., model.float() in Python) would send its own bytes into the receivers' buffers of dmuon's dtype --
  // garbage on the other ranks, without an error. Agreed before any collective of the call: a refusal on one
  // rank raises on every rank.
  detail::AgreementText text;
  text.fn = fn;
  text.refused = [](const std::vector<int>& ranks, const std::string& reason) {
    return "a parameter was replaced since dedicate_params on rank(s) " + detail::rank_list(ranks) +
           ", so no rank takes part: " + reason;
  };
  detail::agree(
      mesh().world(), text,
      [&] {
        for (const auto& B : boundaries_)
          for (Route* r : routes()) r->check_params(B.index, fn);
      },
      [] { return std::vector<detail::AgreedEntry>{}; });
  wait_publishes();  // post-step publishes and all_gather-mode scatters
  drain_all();       // forward prefetches, pending reduces
}

void Runtime::gather_params(const TensorSink& put) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  at::NoGradGuard ng;
  for (Route* r : routes()) r->gather_full(put);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> Runtime::param_shapes() const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::map<std::string, std::vector<int64_t>> local;
  for (const Route* r : routes()) r->full_shapes(local);
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const ModelView::Tensor& item : view_.params)
    out.emplace_back(item.name, ctx_.region_of(item.name, local.at(item.name)).full_shape);
  return out;
}

void Runtime::assign_params(ParamSource& source, const std::vector<std::pair<std::string, at::Tensor>>& extra,
                            const std::string& what) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  at::NoGradGuard ng;
  auto fill_all = [&] {
    for (Route* r : routes()) r->assign_from(source);
    for (const auto& [name, t] : extra) {
      at::Tensor b = t.detach();
      ctx_.fill_from(source, name, TensorRegion::whole(b.sizes()), b);
    }
    ctx_.agree_fills(what);
  };
  // every rank reads (verifies) all it needs before any rank writes: a damaged tensor leaves every model as it was
  if (!source.fills_cannot_fail()) {
    ctx_.begin_dry_fills();
    fill_all();
  }
  fill_all();
  // nothing from before the load survives: gradients are dropped (the routes dropped theirs)
  for (const ModelView::Tensor& item : view_.params) at::Tensor(item.tensor).mutable_grad() = at::Tensor();
  local_grads_only_ = false;
}

std::vector<StateSlot> Runtime::state_slots() const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<StateSlot> out;
  for (const Route* r : routes()) r->state_slots(out);
  return out;
}

void Runtime::gather_state(const OptimizerStateReader& opt, const StateSink& put) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  at::NoGradGuard ng;
  for (Route* r : routes()) r->gather_state(opt, put);
}

void Runtime::assign_state(OptimizerStateAccess& opt, const StateSource& get) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  at::NoGradGuard ng;
  for (Route* r : routes()) r->assign_state(opt, get);
}

bool Runtime::set_no_sync(bool on) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  const bool before = no_sync_;
  no_sync_ = on;
  return before;
}

void Runtime::set_forward_prefetch_depth(int depth) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  TORCH_CHECK_VALUE(depth >= 0, "rank ", mesh().global_rank(), ": forward_prefetch_depth must be >= 0 (0: no "
                    "broadcast ahead of its boundary), got ", depth);
  ctx_.set_forward_prefetch_depth(depth);
}

// ---- public functions over the schedule ------------------------------------------------------------
void broadcast_all_updates(torch::nn::Module& model) { detail::require_state(model, "broadcast_all_updates")->publish(false); }
void broadcast_all_updates_async(torch::nn::Module& model) {
  detail::require_state(model, "broadcast_all_updates_async")->publish(true);
}
void wait_all_post_step_broadcasts(torch::nn::Module& model) {
  detail::require_state(model, "wait_all_post_step_broadcasts")->wait_publishes();
}
void prepare_muon_grads(torch::nn::Module& model) { detail::require_state(model, "prepare_muon_grads")->prepare_grads(); }

void prepare_muon_grads(torch::nn::Module& model, const PrepareGradsOptions& opts) {
  runtime_prepare_grads(detail::require_state(model, "prepare_muon_grads"), opts.coalesce_wait);
}

void runtime_prepare_grads(const std::shared_ptr<Runtime>& runtime, bool coalesce_wait) {
  TORCH_CHECK(runtime, "prepare_muon_grads: the runtime is null (dedicate_model_view returns it).");
  if (coalesce_wait) runtime->prepare_grads();
  else runtime->prepare_grads_per_group();
}

void runtime_publish(const std::shared_ptr<Runtime>& runtime, bool async) {
  TORCH_CHECK(runtime, "broadcast_all_updates: the runtime is null (dedicate_model_view returns it).");
  runtime->publish(async);
}

void runtime_wait_publishes(const std::shared_ptr<Runtime>& runtime) {
  TORCH_CHECK(runtime, "wait_all_post_step_broadcasts: the runtime is null (dedicate_model_view returns it).");
  runtime->wait_publishes();
}

// ---- unshard profile -------------------------------------------------------------------------------
int64_t ForwardUnshardProfile::total_bytes() const {
  int64_t n = 0;
  for (const auto& b : boundaries) n += b.forward_bytes + b.backward_bytes;
  return n;
}

double ForwardUnshardProfile::total_wait_ms() const {
  double ms = 0;
  for (const auto& b : boundaries) ms += b.forward_wait_ms + b.backward_wait_ms;
  return ms;
}

double ForwardUnshardProfile::total_device_wait_ms() const {
  double ms = 0;
  for (const auto& b : boundaries) ms += b.forward_device_wait_ms + b.backward_device_wait_ms;
  return ms;
}

ForwardUnshardProfile collect_forward_unshard_profile(torch::nn::Module& model, bool clear, bool synchronize) {
  return runtime_forward_unshard_profile(detail::require_state(model, "collect_forward_unshard_profile"), clear,
                                         synchronize);
}

ForwardUnshardProfile runtime_forward_unshard_profile(const std::shared_ptr<Runtime>& st, bool clear, bool synchronize) {
  TORCH_CHECK(st, "collect_forward_unshard_profile: the runtime is null (dedicate_model_view returns it).");
#if DMUON_WITH_CUDA
  if (synchronize && at::cuda::is_available()) c10::cuda::device_synchronize();
#else
  (void)synchronize;  // nothing runs asynchronously on the CPU once waited
#endif
  ForwardUnshardProfile out;
  out.rank = st->mesh().global_rank();
  out.enabled = st->recording_unshards();
  out.device_timed = st->device_timed_unshards();
  out.forward_passes = st->profiled_passes();
  out.boundaries = st->unshard_stats(clear);
  return out;
}

void reset_post_forward_order(torch::nn::Module& model) {
  runtime_reset_post_forward_order(detail::require_state(model, "reset_post_forward_order"));
}

std::vector<std::string> post_forward_order(const torch::nn::Module& model) {
  return runtime_post_forward_order(detail::require_state(model, "post_forward_order"));
}

void runtime_reset_post_forward_order(const std::shared_ptr<Runtime>& runtime) {
  TORCH_CHECK_VALUE(runtime, "reset_post_forward_order: the runtime is null (dedicate_model_view returns it).");
  runtime->reset_post_forward_order();
}

std::vector<std::string> runtime_post_forward_order(const std::shared_ptr<Runtime>& runtime) {
  TORCH_CHECK_VALUE(runtime, "post_forward_order: the runtime is null (dedicate_model_view returns it).");
  return runtime->post_forward_order();
}

NoSync::NoSync(torch::nn::Module& model) : state_(detail::state_of_model(&model)) {
  TORCH_CHECK(state_, "no_sync: this model was not dedicated; call dmuon::dedicate_params (and dmuon::replicate) "
              "first. Without dmuon nothing is reduced, so there is nothing to suspend.");
  outer_ = state_->set_no_sync(true);
}

NoSync::~NoSync() { state_->set_no_sync(outer_); }  // (nested in another: still inside that one)

}  // namespace dmuon
