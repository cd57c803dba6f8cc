// The Runtime's boundary schedule: forward passes, prefetch, Z2/Z3 lifetimes, the reduce order,
// the end of backward, and the optimizer interface -- each step delegated to the routes.
#include "runtime/runtime.h"

#if DMUON_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "dmuon/host_sync.h"
#include "runtime/dedicated_route.h"
#include "runtime/replicated_route.h"
#include "runtime/sharded_route.h"

namespace dmuon {

const char* route_name(RouteKind k) {
  switch (k) {
    case RouteKind::Dedicated: return "muon";
    case RouteKind::Sharded: return "sharded_adamw";
    case RouteKind::Replicated: return "adamw";
    case RouteKind::Local: return "local";
  }
  return "?";
}

Precision Runtime::precision_of(const at::Tensor& p) const {
  auto it = precision_.find(p.unsafeGetTensorImpl());
  return it != precision_.end() ? it->second : Precision::plain(p.scalar_type());
}

at::Tensor Runtime::master_of(const at::Tensor& p) const {
  auto it = masters_.find(p.unsafeGetTensorImpl());
  return it != masters_.end() ? it->second : at::Tensor();
}

ReadyGrad Runtime::ready_grad(RouteKind route, const std::string& name, const at::Tensor& p,
                              const Precision& prec) const {
  ReadyGrad r;
  r.route = route;
  r.name = name;
  r.param = p;
  r.grad = p.grad();
  r.prec = prec;
  const at::Tensor master = master_of(p);
  r.target = master.defined() ? master : p;
  r.write_back = master.defined();
  return r;
}

bool Runtime::routed(const std::string& name) const {
  return dedicated_->find(name) != nullptr || sharded_->find(name) != nullptr;
}

std::vector<ParamView> Runtime::describe() const {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<ParamView> out;
  auto m = model_.lock();
  if (!m) return out;
  std::set<const c10::TensorImpl*> replicated;
  if (replicated_)
    for (const auto& p : replicated_->params()) replicated.insert(p.unsafeGetTensorImpl());
  for (const auto& item : m->named_parameters(true)) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    ParamView v;
    v.name = item.key();
    v.param = p;
    v.shape = p.sizes().vec();
    v.prec = precision_of(p);
    if (const DedicatedEntry* e = dedicated_->find(v.name)) {
      v.route = RouteKind::Dedicated;
      v.shape = e->shape;
      v.boundary = boundaries_[static_cast<size_t>(e->boundary)].name;
      v.owner_shard = e->owner.shard;
      v.owner_replicate = e->owner.replicate;
      v.owner_rank = e->owner_rank;
      v.tp_dim = e->tp_dim;
      v.tp_owner = e->tp_owner;
      v.updated_here = e->is_owner;
    } else if (const ShardedEntry* s = sharded_->find(v.name)) {
      v.route = RouteKind::Sharded;
      v.shape = s->shape;
      v.boundary = boundaries_[static_cast<size_t>(s->boundary)].name;
    } else {
      v.route = replicated.count(p.unsafeGetTensorImpl()) ? RouteKind::Replicated : RouteKind::Local;
    }
    out.push_back(std::move(v));
  }
  return out;
}

std::vector<int> Runtime::publish_order() const {
  std::vector<int> order = recorded_order_.empty() ? current_order_ : recorded_order_;
  for (const auto& B : boundaries_)
    if (std::find(order.begin(), order.end(), B.index) == order.end()) order.push_back(B.index);
  return order;
}

// ---- forward ---------------------------------------------------------------------------------------
void Runtime::prefetch_after(int b, bool backward) {
  const int depth = backward ? 1 : opts_.forward_prefetch_depth;
  if (depth <= 0) return;
  std::vector<int> order;
  if (backward) {
    order.assign(current_order_.rbegin(), current_order_.rend());
  } else if (!recorded_order_.empty()) {
    order = recorded_order_;
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

void Runtime::issue_unshards(int b, const char* phase, bool backward, bool prefetch) {
  if (unshard_stats_.empty()) {
    for (Route* r : routes()) r->issue_unshard(b, phase);
    return;
  }
  CommCounters& c = mesh_->counters();
  auto received = [&] { return c.bytes(CommOp::Broadcast) + c.bytes(CommOp::AllGather); };
  const int64_t before = received();
  const int64_t calls = c.calls(CommOp::Broadcast) + c.calls(CommOp::AllGather);
  for (Route* r : routes()) r->issue_unshard(b, phase);
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
  for (Route* r : routes()) r->wait_unshard(b);
  BoundaryUnshardStats& s = unshard_stats_[static_cast<size_t>(b)];
  (backward ? s.backward_waits : s.forward_waits) += 1;
  (backward ? s.backward_wait_ms : s.forward_wait_ms) +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<BoundaryUnshardStats> Runtime::unshard_stats(bool clear) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<BoundaryUnshardStats> out = unshard_stats_;
  if (clear) {
    for (auto& s : unshard_stats_) s = BoundaryUnshardStats{s.boundary};
    profiled_passes_ = 0;
  }
  return out;
}

void Runtime::reset_post_forward_order() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  recorded_order_.clear();
  current_order_.clear();
}

void Runtime::begin_forward_pass() {
  if (!current_order_.empty()) recorded_order_ = current_order_;
  current_order_.clear();
  ++pass_;
  ++profiled_passes_;
  for (auto& B : boundaries_) B.ran_forward = false;
  backward_since_forward_ = false;
}

void Runtime::begin_root_forward() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  begin_forward_pass();
}

void Runtime::pre_forward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  Boundary& B = boundaries_[static_cast<size_t>(b)];
  if (backward_since_forward_ || B.ran_forward) begin_forward_pass();
  B.ran_forward = true;
  B.ran_since_backward = true;
  B.in_forward = true;
  boundaries_seen_ = true;
  current_order_.push_back(b);
  issue_unshards(b, "forward broadcast", false, false);
  prefetch_after(b, /*backward=*/false);
  wait_unshards(b, false);
}

void Runtime::post_forward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  boundaries_[static_cast<size_t>(b)].in_forward = false;
  if (z3()) release(b);  // Z3: free after forward, unshard again in backward; Z2: keep until after backward
}

void Runtime::release(int b) {
  for (Route* r : routes()) r->release(b);
}

// ---- backward --------------------------------------------------------------------------------------
void Runtime::note_backward() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  if (callback_queued_) return;
  callback_queued_ = true;
  if (!reduce_order_fixed_) {
    // reverse forward order; then every other boundary entered since the last backward (a block
    // run twice, or forward passes before this backward), in model order -- the same on every rank
    reduce_order_.clear();
    for (auto it = current_order_.rbegin(); it != current_order_.rend(); ++it)
      if (std::find(reduce_order_.begin(), reduce_order_.end(), *it) == reduce_order_.end()) reduce_order_.push_back(*it);
    for (const auto& B : boundaries_)
      if (B.ran_since_backward && std::find(reduce_order_.begin(), reduce_order_.end(), B.index) == reduce_order_.end())
        reduce_order_.push_back(B.index);
    next_reduce_ = 0;
    reduce_order_fixed_ = true;
  }
  torch::autograd::Engine::get_default_engine().queue_callback([weak = weak_from_this()] {
    if (auto rt = weak.lock()) rt->end_of_backward();
  });
}

void Runtime::pre_backward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  note_backward();
  if (ddp_) return;
  if (z3()) {
    issue_unshards(b, "backward broadcast", true, false);
    prefetch_after(b, /*backward=*/true);
  }
  wait_unshards(b, true);
}

void Runtime::note_post_hook(int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  ++boundaries_[static_cast<size_t>(b)].post_expected;
}

void Runtime::post_backward(int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  note_backward();
  Boundary& B = boundaries_[static_cast<size_t>(b)];
  // A block used several times in one graph is done only after the backward of every use.
  if (++B.post_fired >= B.post_expected) B.grads_ready = true;
  try_issue_reduces();
}

void Runtime::note_accumulated(bool& accumulated, int b) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  note_backward();
  if (accumulated) return;
  accumulated = true;
  Boundary& B = boundaries_[static_cast<size_t>(b)];
  if (++B.accumulated == B.num_params) B.grads_ready = true;
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
  // Fire every boundary whose backward hooks did not run (no input needed grad, unused outputs...).
  if (!no_sync_)
    for (; next_reduce_ < reduce_order_.size(); ++next_reduce_) issue_reduce(reduce_order_[next_reduce_]);
  for (auto& B : boundaries_) {
    release(B.index);
    if (!no_sync_) B.ran_since_backward = false;
    B.post_expected = 0;
    B.post_fired = 0;
    B.grads_ready = false;
    B.accumulated = 0;
    B.reduced = false;
  }
  for (Route* r : routes()) r->reset_pass();
  if (no_sync_) {
    for (Route* r : routes()) r->upcast_local_grads();
  } else {
    for (Route* r : routes()) r->end_of_backward();  // HSDP stage 2 (unless delayed), replicated all-reduces
  }
  callback_queued_ = false;
  reduce_order_fixed_ = false;
  reduce_order_.clear();
  next_reduce_ = 0;
  backward_since_forward_ = true;
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
void Runtime::prepare_grads(bool dedicated) {
  std::lock_guard<std::recursive_mutex> g(mu_);
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

void Runtime::prepare_grads_per_group() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  prepare_grads(/*dedicated=*/false);
  const std::vector<int> order = publish_order();
  if (!order.empty()) dedicated_->prepare_group(order[0]);
  for (size_t i = 0; i < order.size(); ++i) {
    if (i + 1 < order.size()) dedicated_->prepare_group(order[i + 1]);
    dedicated_->finish_group(order[i]);
  }
}

std::vector<ReadyGrad> Runtime::take_ready_grads(bool dedicated) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  std::vector<ReadyGrad> out;
  for (Route* r : routes())
    if (dedicated || r != dedicated_.get()) r->ready_grads(out);
  // parameters on no distributed route (a single rank without dmuon::replicate): their local gradient
  if (!local_params_) {
    local_params_.emplace();
    for (const auto& v : describe())
      if (v.route == RouteKind::Local) local_params_->emplace_back(v.name, v.param);
  }
  for (const auto& [name, p] : *local_params_)
    if (p.grad().defined()) out.push_back(ready_grad(RouteKind::Local, name, p, precision_of(p)));
  return out;
}

void Runtime::discard_grads() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  for (Route* r : routes()) r->discard_grads();
}

void Runtime::drain_all() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  for (const auto& B : boundaries_)
    for (Route* r : routes()) r->wait_unshard(B.index);
  prepare_grads();
}

void Runtime::publish(bool async) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  for (Route* r : routes()) r->publish(async);
}

void Runtime::wait_publishes() {
  std::lock_guard<std::recursive_mutex> g(mu_);
  const auto& rs = routes();
  for (const auto& B : boundaries_)
    for (Route* r : rs) r->wait_unshard(B.index);
  for (Route* r : rs) r->wait_publishes();
}

void Runtime::set_no_sync(bool on) {
  std::lock_guard<std::recursive_mutex> g(mu_);
  TORCH_CHECK(!on || !no_sync_, "rank ", mesh_->global_rank(), ": no_sync is already active on this model. "
              "Nested no_sync scopes are a mistake: keep one scope around every micro-batch but the last.");
  no_sync_ = on;
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
  auto st = detail::require_state(model, "prepare_muon_grads");
  if (opts.coalesce_wait) st->prepare_grads();
  else st->prepare_grads_per_group();
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

ForwardUnshardProfile collect_forward_unshard_profile(torch::nn::Module& model, bool clear, bool synchronize) {
  auto st = detail::require_state(model, "collect_forward_unshard_profile");
#if DMUON_WITH_CUDA
  if (synchronize && at::cuda::is_available()) c10::cuda::device_synchronize();
#else
  (void)synchronize;  // nothing runs asynchronously on the CPU once waited
#endif
  ForwardUnshardProfile out;
  out.rank = st->mesh().global_rank();
  out.enabled = st->recording_unshards();
  out.forward_passes = st->profiled_passes();
  out.boundaries = st->unshard_stats(clear);
  return out;
}

void reset_post_forward_order(torch::nn::Module& model) {
  detail::require_state(model, "reset_post_forward_order")->reset_post_forward_order();
}

NoSync::NoSync(torch::nn::Module& model) : state_(detail::state_of_model(&model)) {
  TORCH_CHECK(state_, "no_sync: this model was not dedicated; call dmuon::dedicate_params (and dmuon::replicate) "
              "first. Without dmuon nothing is reduced, so there is nothing to suspend.");
  state_->set_no_sync(true);
}

NoSync::~NoSync() { state_->set_no_sync(false); }

}  // namespace dmuon
