// The one place dmuon issues collectives (see include/dmuon/communicator.h).
#include "dmuon/communicator.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>

#include "dmuon/digest.h"
#include "dmuon/env.h"
#include "comm/agreement.h"
#include "comm/error_text.h"

namespace dmuon {

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::Broadcast: return "broadcast";
    case CommOp::Reduce: return "reduce";
    case CommOp::AllReduce: return "all_reduce";
    case CommOp::AllGather: return "all_gather";
    case CommOp::ReduceScatter: return "reduce_scatter";
    case CommOp::Scatter: return "scatter";
    case CommOp::Barrier: return "barrier";
    case CommOp::Gather: return "gather";
    default: return "?";
  }
}

// ---- counters ------------------------------------------------------------------------------------
void CommCounters::add(CommOp op, int64_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  s_.bytes[static_cast<int>(op)] += bytes;
  s_.calls[static_cast<int>(op)] += 1;
}
int64_t CommCounters::bytes(CommOp op) const {
  std::lock_guard<std::mutex> g(mu_);
  return s_.bytes[static_cast<int>(op)];
}
int64_t CommCounters::calls(CommOp op) const {
  std::lock_guard<std::mutex> g(mu_);
  return s_.calls[static_cast<int>(op)];
}
void CommCounters::add_wait_ns(int64_t ns) {
  std::lock_guard<std::mutex> g(mu_);
  s_.wait_ns += ns;
}
void CommCounters::add_stall(c10::Event before, c10::Event after) {
  std::lock_guard<std::mutex> g(mu_);
  stalls_.emplace_back(std::move(before), std::move(after));
  // settle what has finished now and then, so a long run holds a bounded number of events
  if (stalls_.size() >= 256) settle_locked(/*wait=*/false);
}
void CommCounters::settle_locked(bool wait) const {
  std::vector<std::pair<c10::Event, c10::Event>> open;
  for (auto& st : stalls_) {
#if DMUON_TORCH_AT_LEAST(2, 0)
    if (wait) st.second.synchronize();
    if (!st.second.query()) {
      open.push_back(std::move(st));
      continue;
    }
    s_.wait_ns += static_cast<int64_t>(st.first.elapsedTime(st.second) * 1e6);
#else
    (void)st;  // no device events on LibTorch 1.13 (a CPU-only build here)
    (void)wait;
#endif
  }
  stalls_ = std::move(open);
}
double CommCounters::wait_ms() const {
  std::lock_guard<std::mutex> g(mu_);
  settle_locked(/*wait=*/true);  // the stalls recorded so far, all of them: a host wait on the device
  return static_cast<double>(s_.wait_ns) / 1e6;
}
int64_t CommCounters::Snapshot::total_bytes() const {
  int64_t t = 0;
  for (auto b : bytes) t += b;
  return t;
}
int64_t CommCounters::total_bytes() const { return snapshot().total_bytes(); }
void CommCounters::reset() {
  std::lock_guard<std::mutex> g(mu_);
  stalls_.clear();  // stalls recorded before the reset belong to the period it ends
  s_ = Snapshot{};
}
CommCounters::Snapshot CommCounters::snapshot() const {
  std::lock_guard<std::mutex> g(mu_);
  settle_locked(/*wait=*/false);  // no host wait on the device: stalls still in flight count later
  return s_;
}

// ---- pending -------------------------------------------------------------------------------------
struct Pending::State {
  WorkPtr work;
  std::function<void()> on_complete;
  std::function<void(const std::exception&)> on_error;
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<CommCounters> counters;
  at::Device device{at::kCPU};
  std::optional<c10::Stream> issue_stream;  // a device group: the stream current at issue
  bool done = false;
  bool host_done = false;  // wait_host() returned
  std::mutex mu;
};

namespace {
std::mutex& interrupt_mu() {
  static std::mutex mu;
  return mu;
}
std::shared_ptr<const WaitInterrupt>& interrupt_slot() {
  static std::shared_ptr<const WaitInterrupt> check;
  return check;
}
std::shared_ptr<const WaitInterrupt> interrupt_check() {
  std::lock_guard<std::mutex> g(interrupt_mu());
  return interrupt_slot();
}

constexpr std::chrono::milliseconds kInterruptPoll{100};

// The host wait of a CPU collective, at most `timeout`. With an interrupt check installed, in slices
// of kInterruptPoll with the check between them: a slice that runs out throws without completing the
// work (c10d::Work::wait), an error of the collective completes it. Returns the check's exception
// when it interrupted the wait; the collective's own errors are thrown.
std::exception_ptr wait_cpu(const WorkPtr& work, std::chrono::milliseconds timeout) {
  const auto check = interrupt_check();
  if (!check) {
    work->wait(timeout);
    return nullptr;
  }
  const uint64_t since = check->epoch();  // interrupts from before this wait do not count
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left <= kInterruptPoll) {
      work->wait(std::max(left, std::chrono::milliseconds(1)));
      return nullptr;
    }
    try {
      work->wait(kInterruptPoll);
      return nullptr;
    } catch (const std::exception&) {
      if (work->isCompleted()) {  // failed, or finished just after the slice ran out: its own outcome
        work->wait(kInterruptPoll);
        return nullptr;
      }
    }
    try {
      check->check(since);
    } catch (...) {
      return std::current_exception();
    }
  }
}

// The device side of Pending::wait: the current stream waits for the collective (NCCL's
// Work::wait() without a timeout; `work` null: already waited), and so does the issuing stream where it differs (buffers were
// allocated there: a free on that stream must not overtake the collective). The stall is timed by
// events on the current stream.
void wait_on_streams(const WorkPtr& work, const at::Device& dev, const std::optional<c10::Stream>& issue_stream,
                     CommCounters* counters) {
  const c10::impl::VirtualGuardImpl impl(dev.type());
  const c10::DeviceGuard guard(dev);
  const c10::Stream cur = impl.getStream(dev);
  std::optional<c10::Event> before;
  if (counters) {
    before.emplace(dev.type(), c10::EventFlag::BACKEND_DEFAULT);
    before->record(cur);
  }
  if (work) work->wait();  // kNoTimeout: a stream dependency, the host does not block
  if (issue_stream && *issue_stream != cur) {
    c10::Event e(dev.type());
    e.record(cur);
    e.block(*issue_stream);
  }
  if (counters) {
    c10::Event after(dev.type(), c10::EventFlag::BACKEND_DEFAULT);
    after.record(cur);
    counters->add_stall(std::move(*before), std::move(after));
  }
}
}  // namespace

void set_wait_interrupt_check(WaitInterrupt interrupt) {
  auto next = interrupt.epoch && interrupt.check ? std::make_shared<const WaitInterrupt>(std::move(interrupt)) : nullptr;
  std::lock_guard<std::mutex> g(interrupt_mu());
  interrupt_slot() = std::move(next);
}

void Pending::wait() {
  if (!state_) return;
  std::lock_guard<std::mutex> g(state_->mu);
  finish_locked(/*host=*/false);
}

void Pending::wait_host() {
  if (!state_) return;
  std::lock_guard<std::mutex> g(state_->mu);
  finish_locked(/*host=*/true);
}

void Pending::finish_locked(bool host) {
  State& st = *state_;
  const bool device = !st.device.is_cpu();
  if (st.done && (!host || !device || st.host_done)) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::exception_ptr interrupted;
  try {
    if (st.work && !device) {
      interrupted = wait_cpu(st.work, st.timeout);
      if (st.counters && !interrupted)
        st.counters->add_wait_ns(
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    } else if (st.work && host) {
      // with a timeout, Work::wait makes the current stream wait and blocks the host until the
      // collective finished, or throws: bounded (a plain wait() first could block without a bound,
      // e.g. NCCL's barrier synchronises the stream)
      st.work->wait(st.timeout);
      if (!st.done) wait_on_streams(WorkPtr(), st.device, st.issue_stream, nullptr);
    } else if (st.work) {
      wait_on_streams(st.work, st.device, st.issue_stream, st.counters.get());
    }
  } catch (const std::exception& e) {
    st.done = st.host_done = true;  // a failed collective is not retried; the error says what happened
    st.on_error(e);
  }
  if (interrupted) std::rethrow_exception(interrupted);  // abandoned: not done, the collective is in flight
  st.host_done = st.host_done || host;
  if (st.done) return;
  st.done = true;
  if (st.on_complete) {
    const c10::DeviceGuard guard(st.device);
    st.on_complete();
  }
}

bool Pending::poll() {
  if (!state_) return true;
  {
    std::lock_guard<std::mutex> g(state_->mu);
    if (state_->done) return true;
    if (state_->work && !state_->work->isCompleted()) return false;
  }
  wait();
  return true;
}

bool Pending::completed() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> g(state_->mu);
  return state_->done;
}

// ---- communicator --------------------------------------------------------------------------------
namespace {
at::Device infer_device(const CommPtr& pg, const std::string& backend) {
#if DMUON_TORCH_AT_LEAST(2, 0)
  if (const auto bound = pg->getBoundDeviceId()) return *bound;
#else
  (void)pg;
#endif
  if (backend == "nccl") {
    const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    return impl.getDevice();
  }
  return at::Device(at::kCPU);
}
}  // namespace

Communicator::Communicator(CommPtr pg, std::string name, std::vector<int> global_ranks,
                           std::chrono::milliseconds timeout, std::shared_ptr<CommCounters> counters,
                           std::optional<at::Device> device)
    : pg_(std::move(pg)),
      name_(std::move(name)),
      global_ranks_(std::move(global_ranks)),
      timeout_(timeout),
      counters_(counters ? std::move(counters) : std::make_shared<CommCounters>()) {
  TORCH_CHECK(pg_, "Communicator '", name_, "': the process group is null");
  rank_ = pg_->getRank();
  size_ = pg_->getSize();
  TORCH_CHECK(static_cast<int>(global_ranks_.size()) == size_, "Communicator '", name_, "': ", global_ranks_.size(),
              " global ranks given for a group of ", size_);
  TORCH_CHECK(timeout_.count() > 0, "rank ", global_ranks_[static_cast<size_t>(rank_)], ": dmuon group '", name_,
              "': the collective timeout is ", timeout_.count(), " ms; it must be > 0 (there is no \"no timeout\": "
              "a lost peer must end in an error). Pass a positive MeshOptions::timeout / --timeout.");
  const std::string backend = pg_->getBackendName();
  is_gloo_ = backend == "gloo";
  native_avg_ = !is_gloo_ || DMUON_TORCH_AT_LEAST(2, 8);
  force_ = env::force_collectives();
  device_ = device ? *device : infer_device(pg_, backend);
  if (device_.is_cuda() && !device_.has_index()) {
    const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    device_ = impl.getDevice();
  }
}

void Communicator::check_device(const at::Tensor& t, const char* op, const char* role, const std::string& what) const {
  if (!t.defined()) return;
  if (t.device() == device_ || (device_.is_cpu() && t.device().is_cpu())) return;
  TORCH_CHECK(false, "rank ", global_rank(), ": ", op, " (", what, ") on dmuon group '", name_, "' (backend ",
              pg_->getBackendName(), ", ", size_, " rank", size_ == 1 ? "" : "s", "): the ", role, " tensor is on ",
              t.device(), " but this group carries ", device_, " tensors. Allocate every tensor a collective carries "
              "on the group's device (Mesh::device(), Communicator::options()); ",
              device_.is_cuda() ? "NCCL takes CUDA tensors only." : "Gloo and dmuon's store backend take CPU tensors only.");
}

void Communicator::shutdown() {
  if (closed_) return;
  closed_ = true;
#if DMUON_TORCH_AT_LEAST(2, 0)
  pg_->shutdown();
#endif
}

void Communicator::abort() {
  if (closed_) return;
  closed_ = true;
#if DMUON_TORCH_AT_LEAST(2, 0)
  try {
    pg_->abort();  // NCCL: may throw when the abort itself times out; the caller's error is the one to report
  } catch (const std::exception&) {
  }
#endif
}

std::pair<CommOp, int64_t> Communicator::counted(CommOp op, int64_t bytes, bool root) const {
  const int64_t n = size_;
  if (n == 1) return {op, 0};
  switch (op) {
    case CommOp::Broadcast:
    case CommOp::Reduce:
    case CommOp::Scatter:
    case CommOp::Gather:
      return {op, root ? 0 : bytes};
    case CommOp::AllReduce:
      return {op, 2 * (n - 1) * bytes / n};
    case CommOp::AllGather:
      return {op, (n - 1) * bytes / n};
    case CommOp::ReduceScatter:
      return is_gloo_ ? std::pair{CommOp::AllReduce, 2 * (n - 1) * bytes / n} : std::pair{op, (n - 1) * bytes / n};
    default:
      return {op, 0};
  }
}

void Communicator::count(CommOp op, int64_t bytes) {
  counters_->add(op, bytes);
  own_->add(op, bytes);
}

namespace {
// The error of a failed collective: the group, the op and its payload, the backend's message (without
// its C++ backtrace) and what usually causes it.
[[noreturn]] void throw_collective_failure(const std::string& name, int grank, int size, const std::string& op_what,
                                           std::chrono::milliseconds timeout, const std::exception& e) {
  TORCH_CHECK(false, "rank ", grank, ": collective failed on dmuon group '", name, "' (", size, " ranks): ", op_what,
              ": ", detail::error_text(e),
              ". A peer probably died, hung or issued a different collective (all ranks must run the same "
              "model code in the same order; a block that only some ranks run -- a data-dependent branch, an "
              "expert that got no tokens -- needs the DDP path, dedicate_params_ddp); the wait limit is ",
              timeout.count(), " ms.");
}
}  // namespace

void Communicator::rethrow(const std::string& op_what, const std::exception& e) const {
  throw_collective_failure(name_, global_rank(), size_, op_what, timeout_, e);
}

Pending Communicator::issue(CommOp op, const std::string& what, const std::function<WorkPtr()>& launch,
                            std::function<void()> on_complete) {
  Pending p;
  p.state_ = std::make_shared<Pending::State>();
  p.state_->timeout = timeout_;
  p.state_->counters = counters_;
  p.state_->device = device_;
  if (!device_.is_cpu()) {
    const c10::impl::VirtualGuardImpl impl(device_.type());
    p.state_->issue_stream = impl.getStream(device_);
  }
  p.state_->on_complete = std::move(on_complete);
  const std::string op_what = std::string(comm_op_name(op)) + " (" + what + ")";
  // Copy what the error path needs: the Pending may outlive the communicator's caller.
  const std::string name = name_;
  const int grank = global_rank(), size = size_;
  const auto timeout = timeout_;
  p.state_->on_error = [name, grank, size, timeout, op_what](const std::exception& e) {
    throw_collective_failure(name, grank, size, op_what, timeout, e);
  };
  try {
    p.state_->work = launch();
  } catch (const std::exception& e) {
    rethrow(op_what, e);
  }
  return p;
}

namespace {
// Gloo (1.13) has no bfloat16: data-moving collectives carry the same 16-bit patterns typed as fp16
// (copied, never computed on); reductions run
// in float32 (cast up, reduce, cast back) so the sum is still correct.
bool gloo_bf16(bool is_gloo, const at::Tensor& t) { return is_gloo && t.scalar_type() == at::kBFloat16; }
at::Tensor wire(bool is_gloo, const at::Tensor& t) { return gloo_bf16(is_gloo, t) ? t.view(at::kHalf) : t; }
}  // namespace

Pending Communicator::broadcast(at::Tensor tensor_in, int root, std::string what) {
  check_device(tensor_in, "broadcast", "payload", what);
  if (local_only()) return Pending();
  at::Tensor tensor = wire(is_gloo_, tensor_in);
  const int64_t bytes = static_cast<int64_t>(tensor.numel()) * tensor.element_size();
  count(CommOp::Broadcast, counted(CommOp::Broadcast, bytes, rank_ == root).second);
  return issue(CommOp::Broadcast, what, [&] {
    std::vector<at::Tensor> v{tensor};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.rootTensor = 0;
    o.timeout = timeout_;
    return pg_->broadcast(v, o);
  }, nullptr);
}

Pending Communicator::reduce(at::Tensor tensor_in, int root, Reduction op, std::string what) {
  check_device(tensor_in, "reduce", "payload", what);
  if (local_only()) return Pending();
  if (gloo_bf16(is_gloo_, tensor_in)) {  // reduce in float32, then write the result back on the root
    at::Tensor up = tensor_in.to(at::kFloat);
    Pending p = reduce(up, root, op, what + " [bf16 reduced in fp32 on Gloo]");
    const bool mine = rank_ == root;
    p.state_->on_complete = [prev = p.state_->on_complete, up, tensor_in, mine]() mutable {
      if (prev) prev();
      if (mine) tensor_in.copy_(up);
    };
    return p;
  }
  at::Tensor tensor = tensor_in;
  const int64_t bytes = static_cast<int64_t>(tensor.numel()) * tensor.element_size();
  count(CommOp::Reduce, counted(CommOp::Reduce, bytes, rank_ == root).second);
  const bool emulate_avg = op == Reduction::Avg && (is_gloo_ || !native_avg_);
  std::function<void()> done;
  if (emulate_avg && rank_ == root) {
    const double n = size_;
    done = [tensor, n]() mutable { tensor.div_(n); };
  }
  return issue(CommOp::Reduce, what, [&] {
    std::vector<at::Tensor> v{tensor};
    c10d::ReduceOptions o;
    o.rootRank = root;
    o.rootTensor = 0;
    // NCCL's reduce supports AVG; Gloo's does not (any version): SUM then divide on the root.
    o.reduceOp = (op == Reduction::Avg && !emulate_avg) ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    o.timeout = timeout_;
    return pg_->reduce(v, o);
  }, std::move(done));
}

Pending Communicator::allreduce(at::Tensor tensor_in, Reduction op, std::string what) {
  check_device(tensor_in, "all_reduce", "payload", what);
  if (local_only()) return Pending();
  if (gloo_bf16(is_gloo_, tensor_in)) {
    at::Tensor up = tensor_in.to(at::kFloat);
    Pending p = allreduce(up, op, what + " [bf16 reduced in fp32 on Gloo]");
    p.state_->on_complete = [prev = p.state_->on_complete, up, tensor_in]() mutable {
      if (prev) prev();
      tensor_in.copy_(up);
    };
    return p;
  }
  at::Tensor tensor = tensor_in;
  const int64_t bytes = static_cast<int64_t>(tensor.numel()) * tensor.element_size();
  count(CommOp::AllReduce, counted(CommOp::AllReduce, bytes).second);
  const bool emulate_avg = op == Reduction::Avg && !native_avg_;
  std::function<void()> done;
  if (emulate_avg) {
    const double n = size_;
    done = [tensor, n]() mutable { tensor.div_(n); };
  }
  return issue(CommOp::AllReduce, what, [&] {
    std::vector<at::Tensor> v{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = (op == Reduction::Avg && !emulate_avg) ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    o.timeout = timeout_;
    return pg_->allreduce(v, o);
  }, std::move(done));
}

Pending Communicator::allgather_flat(at::Tensor out_in, at::Tensor in_in, std::string what) {
  check_device(out_in, "all_gather", "output", what);
  check_device(in_in, "all_gather", "input", what);
  at::Tensor out = wire(is_gloo_, out_in), in = wire(is_gloo_, in_in);
  TORCH_CHECK(out.numel() == in.numel() * size_, "allgather_flat (", what, "): output has ", out.numel(),
              " elements, expected ", in.numel() * size_, " = ", size_, " ranks x ", in.numel());
  if (local_only()) {
    out.view(-1).copy_(in.reshape(-1));
    return Pending();
  }
  const int64_t total = static_cast<int64_t>(out.numel()) * out.element_size();
  count(CommOp::AllGather, counted(CommOp::AllGather, total).second);
  return issue(CommOp::AllGather, what, [&] {
    if (!is_gloo_) {
      // straight into the flat output: a list of views would make NCCL allocate a flat temporary of
      // the whole output and copy it back (twice the unshard memory)
      at::Tensor o_flat = out.view(-1), i_flat = in.reshape(-1);
      c10d::AllgatherOptions opts;
      opts.timeout = timeout_;
      return pg_->_allgather_base(o_flat, i_flat, opts);
    }
    // Gloo (1.13 has no _allgather_base): into views of one buffer
    std::vector<at::Tensor> outs;
    const int64_t n = in.numel();
    for (int r = 0; r < size_; ++r) outs.push_back(out.view(-1).narrow(0, r * n, n));
    std::vector<std::vector<at::Tensor>> o{outs};
    std::vector<at::Tensor> i{in.reshape(-1)};
    c10d::AllgatherOptions opts;
    opts.timeout = timeout_;
    return pg_->allgather(o, i, opts);
  }, nullptr);
}

Pending Communicator::reduce_scatter_flat(at::Tensor out, at::Tensor in, Reduction op, std::string what) {
  check_device(out, "reduce_scatter", "output", what);
  check_device(in, "reduce_scatter", "input", what);
  TORCH_CHECK(in.numel() == out.numel() * size_, "reduce_scatter_flat (", what, "): input has ", in.numel(),
              " elements, expected ", out.numel() * size_, " = ", size_, " ranks x ", out.numel());
  if (local_only()) {
    out.view(-1).copy_(in.reshape(-1));
    return Pending();
  }
  const int64_t total = static_cast<int64_t>(in.numel()) * in.element_size();
  const int64_t n = out.numel();
  const int r = rank_;
  const double div = size_;
  const bool avg = op == Reduction::Avg;
  if (is_gloo_) {
    // Gloo 1.13 has no reduce-scatter: all-reduce a copy and keep this rank's chunk (bf16, which
    // Gloo cannot reduce, in an fp32 copy).
    at::Tensor tmp = gloo_bf16(true, in) ? in.reshape(-1).to(at::kFloat) : in.reshape(-1).clone();
    count(CommOp::AllReduce, counted(CommOp::AllReduce, tmp.numel() * static_cast<int64_t>(tmp.element_size())).second);
    return issue(CommOp::AllReduce, what + (gloo_bf16(true, in) ? " [reduce-scatter fallback, bf16 reduced in fp32]"
                                                                  : " [reduce-scatter fallback]"), [&] {
      std::vector<at::Tensor> v{tmp};
      c10d::AllreduceOptions o;
      o.reduceOp = c10d::ReduceOp::SUM;
      o.timeout = timeout_;
      return pg_->allreduce(v, o);
    }, [out, tmp, n, r, div, avg]() mutable {
      out.view(-1).copy_(tmp.narrow(0, r * n, n));
      if (avg) out.div_(div);
    });
  }
  count(CommOp::ReduceScatter, counted(CommOp::ReduceScatter, total).second);
  return issue(CommOp::ReduceScatter, what, [&] {
    at::Tensor o_flat = out.view(-1), i_flat = in.reshape(-1);
    c10d::ReduceScatterOptions o;
    o.reduceOp = avg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    o.timeout = timeout_;
    return pg_->_reduce_scatter_base(o_flat, i_flat, o);
  }, nullptr);
}

Pending Communicator::scatter_flat(at::Tensor out_in, at::Tensor in_in, int root, std::string what) {
  check_device(out_in, "scatter", "output", what);
  if (rank_ == root) check_device(in_in, "scatter", "input", what);
  at::Tensor out = wire(is_gloo_, out_in), in = in_in.numel() > 0 ? wire(is_gloo_, in_in) : in_in;
  if (rank_ == root)
    TORCH_CHECK(in.numel() == out.numel() * size_, "scatter_flat (", what, "): input has ", in.numel(),
                " elements, expected ", out.numel() * size_, " = ", size_, " ranks x ", out.numel());
  if (local_only()) {
    out.view(-1).copy_(in.reshape(-1));
    return Pending();
  }
  count(CommOp::Scatter, counted(CommOp::Scatter, static_cast<int64_t>(out.numel()) * out.element_size(), rank_ == root).second);
  return issue(CommOp::Scatter, what, [&] {
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> ins;
    if (rank_ == root) {
      std::vector<at::Tensor> chunks;
      const int64_t n = out.numel();
      for (int r = 0; r < size_; ++r) chunks.push_back(in.view(-1).narrow(0, r * n, n));
      ins.push_back(chunks);
    }
    c10d::ScatterOptions o;
    o.rootRank = root;
    o.timeout = timeout_;
    return pg_->scatter(outs, ins, o);
  }, nullptr);
}

Pending Communicator::gather_flat(at::Tensor out_in, at::Tensor in_in, int root, std::string what) {
  check_device(in_in, "gather", "input", what);
  if (rank_ == root) check_device(out_in, "gather", "output", what);
  at::Tensor in = wire(is_gloo_, in_in), out = out_in.numel() > 0 ? wire(is_gloo_, out_in) : out_in;
  if (rank_ == root)
    TORCH_CHECK(out.numel() == in.numel() * size_, "gather_flat (", what, "): output has ", out.numel(),
                " elements, expected ", in.numel() * size_, " = ", size_, " ranks x ", in.numel());
  if (local_only()) {
    out.view(-1).copy_(in.reshape(-1));
    return Pending();
  }
  count(CommOp::Gather, counted(CommOp::Gather, static_cast<int64_t>(in.numel()) * in.element_size(), rank_ == root).second);
  return issue(CommOp::Gather, what, [&] {
    std::vector<at::Tensor> ins{in.reshape(-1)};
    std::vector<std::vector<at::Tensor>> outs;
    if (rank_ == root) {
      std::vector<at::Tensor> chunks;
      const int64_t n = in.numel();
      for (int r = 0; r < size_; ++r) chunks.push_back(out.view(-1).narrow(0, r * n, n));
      outs.push_back(chunks);
    }
    c10d::GatherOptions o;
    o.rootRank = root;
    o.timeout = timeout_;
    return pg_->gather(outs, ins, o);
  }, nullptr);
}

void Communicator::barrier(const std::string& what) {
  if (local_only()) return;
  count(CommOp::Barrier, 0);
  issue(CommOp::Barrier, what, [&] {
    c10d::BarrierOptions o;
    o.timeout = timeout_;
    // NCCL's barrier is an all-reduce on a device: name ours instead of letting it guess from the rank
    if (device_.is_cuda()) o.device_ids = {device_.index()};
    return pg_->barrier(o);
  }, nullptr).wait_host();
}

// ---- the column-sharded Gram NS over a group ----------------------------------------------------
AllReduceSumFn allreduce_sum_fn(Communicator& comm, std::string what) {
  return [&comm, what = std::move(what)](at::Tensor& t) {
    if (comm.local_only()) return;
    comm.allreduce(t, Reduction::Sum, what).wait();
  };
}

namespace {
// A Communicator over a caller's process group (group ranks as global ranks in messages).
std::shared_ptr<Communicator> adopt(const CommPtr& group, std::chrono::milliseconds timeout) {
  if (!group) return nullptr;
  std::vector<int> ranks(static_cast<size_t>(group->getSize()));
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = static_cast<int>(i);
  return std::make_shared<Communicator>(group, "gram-ns", ranks, timeout, std::make_shared<CommCounters>());
}

// The entries every rank's shard and options must agree on (the caller checked G_local's dimensions).
std::vector<detail::AgreedEntry> gram_shard_entries(const at::Tensor& G_local, bool transposed, const NsOptions& opts,
                                                    bool batched) {
  const Coefficients coeffs = resolve_coefficients(opts);
  const int64_t rows = transposed ? G_local.size(-1) : G_local.size(-2);
  const int64_t batch = batched ? G_local.size(0) : 1;
  Fnv1a iteration;
  for (const auto& c : coeffs) iteration.f64(std::get<0>(c)).f64(std::get<1>(c)).f64(std::get<2>(c));
  for (int i : opts.restart_iterations.value_or(std::vector<int>{})) iteration.u64(static_cast<uint64_t>(i));
  const std::string dtype(c10::toString(G_local.scalar_type()));
  const std::string compute = opts.compute_dtype ? c10::toString(*opts.compute_dtype) : "default";
  return {{"rows of the oriented shard", static_cast<uint64_t>(rows), std::to_string(rows)},
          {"batch", static_cast<uint64_t>(batch), std::to_string(batch)},
          {"dtype", fnv1a(dtype), dtype},
          {"transposed", transposed ? 1u : 0u, transposed ? "true" : "false"},
          {"compute dtype", fnv1a(compute), compute},
          // (with it, an overflowing sum of squares is summed again in float64: one more all-reduce)
          {"check_finite", opts.check_finite ? 1u : 0u, opts.check_finite ? "true" : "false"},
          {"coefficients and restarts", iteration.value(), std::to_string(coeffs.size()) + " steps"}};
}

// Before the first all-reduce, every rank's shard and options agree where the all-reduces need them to: the
// oriented row count (the m x m Gram matrix every rank sums), the batch, the dtype, the orientation and the
// iteration (its number of all-reduces). A shard of another shape was a size mismatch inside Gloo (an abort on
// one rank) or a hang on NCCL; here it is an error on every rank naming the ranks and what differs. Agreed on
// every call (one small all-gather and a host read): a cache of what agreed before, kept by each rank, would
// let a rank whose call matches an earlier one skip the all-gather while a rank whose call differs makes it --
// the mismatch this is here to catch.
void agree_gram_shards(Communicator& comm, const at::Tensor& G_local, bool transposed, const NsOptions& opts,
                       bool batched, const char* fn) {
  if (comm.size() <= 1) return;
  detail::AgreementText text;
  text.fn = fn;
  text.given = "the shard";
  text.outcome = "no rank runs Newton-Schulz";
  text.differs = [](const detail::Disagreement& d) {
    return "the ranks' shards differ in " +
           (d.entry ? d.entry->key + " (this rank's: " + d.entry->shown + ")" : std::string("their description")) +
           ": rank(s) " + detail::rank_list(d.ranks) +
           " differ from the group's rank 0. Each rank passes its column block of one matrix (of the oriented "
           "matrix: rows = the full matrix's smaller side), with the same dtype, `transposed` and options; the "
           "shards' other sides may differ.";
  };
  detail::agree(
      comm, text,
      [&] {
        TORCH_CHECK_VALUE(G_local.dim() == (batched ? 3 : 2), "rank ", comm.rank(), ": ", fn, ": expected a ",
                          batched ? "3-D tensor [batch, rows, cols]" : "2-D tensor [rows, cols]", ", got shape ",
                          G_local.sizes(), ".");
        (void)resolve_coefficients(opts);
      },
      [&] { return gram_shard_entries(G_local, transposed, opts, batched); });
}
}  // namespace

at::Tensor gram_newton_schulz_distributed_local(const at::Tensor& G_local, const CommPtr& group, bool transposed,
                                                const NsOptions& opts, std::chrono::milliseconds timeout) {
  auto comm = adopt(group, timeout);
  if (comm)
    agree_gram_shards(*comm, G_local, transposed, opts, false, "gram_newton_schulz_distributed_local");
  const AllReduceSumFn sum = comm ? allreduce_sum_fn(*comm, "column-sharded Gram NS all-reduce") : AllReduceSumFn(
                                                                                                 [](at::Tensor&) {});
  return gram_newton_schulz_distributed_local(G_local, sum, transposed, opts);
}

at::Tensor gram_newton_schulz_distributed_local_batched(const at::Tensor& G_local, const CommPtr& group,
                                                        bool transposed, const NsOptions& opts,
                                                        std::chrono::milliseconds timeout) {
  auto comm = adopt(group, timeout);
  if (comm)
    agree_gram_shards(*comm, G_local, transposed, opts, true, "gram_newton_schulz_distributed_local_batched");
  const AllReduceSumFn sum = comm ? allreduce_sum_fn(*comm, "column-sharded Gram NS all-reduce (batched)")
                                  : AllReduceSumFn([](at::Tensor&) {});
  return gram_newton_schulz_distributed_local_batched(G_local, sum, transposed, opts);
}

}  // namespace dmuon
