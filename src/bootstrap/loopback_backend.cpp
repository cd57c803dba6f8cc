// dmuon's loopback backend: the c10d collectives dmuon uses, for ranks that are threads of one
// process, on one device (see bootstrap.h). Every rank's call posts its tensors to the group's slot
// for that collective (the k-th collective of every rank meets in slot k); the last rank to arrive
// executes it: reductions add the ranks' tensors in rank order into one temporary (bit-identical
// results on every rank), copies go straight from the ranks' tensors to the ranks' tensors.
//
// On CUDA it behaves as NCCL does where it matters to dmuon: the collective runs on the group's own
// stream, which first waits for every rank's issuing stream (an event recorded at issue); an optional
// at::cuda::sleep before each copy makes the collective finish late, so a rank that reads a result
// without waiting reads a wrong value; the tensors are held by the work until wait();
// Work::wait() makes the caller's current stream wait for the collective (the host does not block on
// the device), Work::wait(timeout) also blocks the host until the device finished. Unlike NCCL the
// host of a waiting rank does block until every rank has *issued* the collective (the copies can be
// queued only then); a rank that never issues it is an error after the timeout, naming the rank.
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/reduce_ops.h"
#include "dmuon/bootstrap.h"

#if DMUON_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

namespace dmuon {

namespace {

enum class Kind { Broadcast, AllReduce, Reduce, AllGather, ReduceScatter, Scatter, Gather, Barrier };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Broadcast: return "broadcast";
    case Kind::AllReduce: return "allreduce";
    case Kind::Reduce: return "reduce";
    case Kind::AllGather: return "allgather";
    case Kind::ReduceScatter: return "reduce_scatter";
    case Kind::Scatter: return "scatter";
    case Kind::Gather: return "gather";
    case Kind::Barrier: return "barrier";
  }
  return "?";
}

// One rank's part of a collective.
struct Part {
  bool posted = false;
  Kind kind = Kind::Barrier;
  int root = 0;
  c10d::ReduceOp op = c10d::ReduceOp::SUM;
  at::Tensor in, out;              // broadcast/allreduce/reduce: `in` is read and written
  std::vector<at::Tensor> chunks;  // scatter: the root's inputs; gather: the root's outputs
  std::optional<c10::Event> ready; // device: recorded on the issuing stream
};

// The k-th collective of a group: every rank's part, then the result.
struct Slot {
  explicit Slot(int n) : parts(static_cast<size_t>(n)) {}
  std::vector<Part> parts;
  int arrived = 0;
  bool executed = false;
  std::string error;                // set when the ranks' parts do not match, or a copy failed
  std::optional<c10::Event> done;   // device: recorded on the group's stream after the copies
};

// The state one group's ranks share.
struct Hub {
  Hub(int n, at::Device d, int64_t sleep) : size(n), device(d), sleep_cycles(sleep) {}
  const int size;
  const at::Device device;
  const int64_t sleep_cycles;
  std::mutex mu;
  std::condition_variable cv;
  std::map<int64_t, std::shared_ptr<Slot>> slots;  // removed once every rank took its result
  std::map<int64_t, int> taken;
  std::optional<c10::Stream> stream;  // device: the group's own stream

  std::shared_ptr<Slot> slot(int64_t k) {  // under mu
    auto& s = slots[k];
    if (!s) s = std::make_shared<Slot>(size);
    return s;
  }
};

// Hubs by the token rank 0 publishes in the group's store.
std::mutex g_hubs_mu;
std::map<std::string, std::weak_ptr<Hub>> g_hubs;
std::atomic<int64_t> g_next_token{0};

std::shared_ptr<Hub> hub_for(const std::string& token, int size, const at::Device& device, int64_t sleep) {
  std::lock_guard<std::mutex> g(g_hubs_mu);
  for (auto it = g_hubs.begin(); it != g_hubs.end();) it = it->second.expired() ? g_hubs.erase(it) : std::next(it);
  auto& w = g_hubs[token];
  auto h = w.lock();
  if (!h) {
    h = std::make_shared<Hub>(size, device, sleep);
    w = h;
  }
  TORCH_CHECK(h->size == size && h->device == device, "dmuon-loopback: the ranks of one group disagree on its size or "
              "device (", h->size, " ranks on ", h->device, " vs ", size, " on ", device, ")");
  return h;
}

void sleep_before_copy(const Hub& h) {
#if DMUON_WITH_CUDA
  if (h.device.is_cuda() && h.sleep_cycles > 0) at::cuda::sleep(h.sleep_cycles);
#else
  (void)h;
#endif
}

// Checks that the ranks issued the same collective; "" when they did.
std::string mismatch(const Slot& s) {
  const Part& p0 = s.parts[0];
  for (size_t r = 1; r < s.parts.size(); ++r) {
    const Part& p = s.parts[r];
    if (p.kind != p0.kind || p.root != p0.root || p.op != p0.op)
      return "rank 0 issued " + std::string(kind_name(p0.kind)) + " (root " + std::to_string(p0.root) + ", op " +
             std::to_string(static_cast<int>(p0.op)) + ") but rank " + std::to_string(r) + " issued " +
             kind_name(p.kind) + " (root " + std::to_string(p.root) + ", op " + std::to_string(static_cast<int>(p.op)) + ")";
    if (p.in.defined() != p0.in.defined() ||
        (p.in.defined() && (p.in.numel() != p0.in.numel() || p.in.scalar_type() != p0.in.scalar_type())))
      return std::string(kind_name(p0.kind)) + ": rank 0 sends " +
             (p0.in.defined() ? std::to_string(p0.in.numel()) : std::string("no")) + " elements, rank " +
             std::to_string(r) + " sends " + (p.in.defined() ? std::to_string(p.in.numel()) : std::string("no"));
  }
  return "";
}

// The copies and sums of one collective, on the current stream (the group's, on a device).
void execute(const Hub& h, Slot& s) {
  auto& P = s.parts;
  const int n = h.size;
  const Part& p0 = P[0];
  auto sum = [&](auto&& piece) {  // rank-order sum of piece(r)
    at::Tensor acc = piece(0).clone();
    for (int r = 1; r < n; ++r) detail::combine(acc, piece(r), p0.op, "dmuon-loopback");
    detail::finish(acc, p0.op, n);
    return acc;
  };
  auto copy = [&](at::Tensor dst, const at::Tensor& src) {
    sleep_before_copy(h);
    dst.copy_(src);
  };
  switch (p0.kind) {
    case Kind::Barrier: break;
    case Kind::Broadcast:
      for (int r = 0; r < n; ++r)
        if (r != p0.root) copy(P[r].in, P[p0.root].in);
      break;
    case Kind::AllReduce: {
      const at::Tensor acc = sum([&](int r) { return P[r].in; });
      for (int r = 0; r < n; ++r) copy(P[r].in, acc);
      break;
    }
    case Kind::Reduce: copy(P[p0.root].in, sum([&](int r) { return P[r].in; })); break;
    case Kind::AllGather:
      for (int r = 0; r < n; ++r)
        for (int i = 0; i < n; ++i) copy(P[r].out.view(-1).narrow(0, i * P[i].in.numel(), P[i].in.numel()), P[i].in.reshape(-1));
      break;
    case Kind::ReduceScatter:
      for (int r = 0; r < n; ++r) {
        const int64_t m = P[r].out.numel();
        copy(P[r].out.view(-1), sum([&](int i) { return P[i].in.reshape(-1).narrow(0, r * m, m); }));
      }
      break;
    case Kind::Scatter:
      for (int r = 0; r < n; ++r) copy(P[r].out, P[p0.root].chunks[static_cast<size_t>(r)]);
      break;
    case Kind::Gather:
      for (int r = 0; r < n; ++r) copy(P[p0.root].chunks[static_cast<size_t>(r)], P[r].in);
      break;
  }
}

class LoopbackWork : public c10d::Work {
 public:
  LoopbackWork(std::shared_ptr<Hub> hub, std::shared_ptr<Slot> slot, int64_t k, int rank,
               std::chrono::milliseconds timeout)
      : hub_(std::move(hub)), slot_(std::move(slot)), k_(k), rank_(rank), timeout_(timeout) {}

  ~LoopbackWork() override { release(); }

  bool isCompleted() override {
    std::lock_guard<std::mutex> g(hub_->mu);
    return slot_->executed && (!slot_->done || slot_->done->query());
  }

  // kNoTimeout: the device waits (the caller's current stream); a timeout: the host waits too.
  bool wait(std::chrono::milliseconds timeout) override {
    const bool host = timeout != ::kNoTimeout;
    const auto limit = host ? timeout : timeout_;
    arrived(limit);
    if (slot_->done) {
      const c10::impl::VirtualGuardImpl impl(hub_->device.type());
      slot_->done->block(impl.getStream(hub_->device));
      if (host) {
        const auto deadline = std::chrono::steady_clock::now() + limit;
        while (!slot_->done->query()) {
          TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "dmuon-loopback: collective #", k_,
                      " did not finish on the device within ", limit.count(), " ms");
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      }
    }
    release(/*waited=*/true);  // the caller's stream is ordered after the copies: its tensors may go
    return true;
  }

  void synchronize() override { (void)wait(::kNoTimeout); }

 private:
  // blocks the host until every rank has issued this collective and it was executed (queued, on a
  // device), at most `limit`
  void arrived(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> l(hub_->mu);
    if (!hub_->cv.wait_for(l, limit, [&] { return slot_->executed; })) {
      std::string missing;
      for (int r = 0; r < hub_->size; ++r)
        if (!slot_->parts[static_cast<size_t>(r)].posted) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      TORCH_CHECK(false, "dmuon-loopback: collective #", k_, " (", kind_name(slot_->parts[static_cast<size_t>(rank_)].kind),
                  ") timed out after ", limit.count(), " ms waiting for group rank(s) ", missing,
                  " (a peer died, hangs, or issued fewer collectives)");
    }
    TORCH_CHECK(slot_->error.empty(), "dmuon-loopback: collective #", k_, " failed: ", slot_->error);
  }

  // drops this rank's tensors (once executed) and, with the last rank, the slot. Not waited (a work
  // dropped on an error path): the group's stream may still use them, so the caching allocator is
  // told to keep their memory until that stream's work is done.
  void release(bool waited = false) {
    std::lock_guard<std::mutex> g(hub_->mu);
    if (released_ || !slot_->executed) return;
    released_ = true;
    Part& mine = slot_->parts[static_cast<size_t>(rank_)];
    if (!waited && hub_->stream) {
      const c10::impl::VirtualGuardImpl impl(hub_->device.type());
      auto keep = [&](const at::Tensor& t) {
        if (t.defined() && t.has_storage()) impl.recordDataPtrOnStream(t.storage().data_ptr(), *hub_->stream);
      };
      keep(mine.in);
      keep(mine.out);
      for (const auto& c : mine.chunks) keep(c);
    }
    mine.in = at::Tensor();
    mine.out = at::Tensor();
    mine.chunks.clear();
    if (++hub_->taken[k_] == hub_->size) {
      hub_->slots.erase(k_);
      hub_->taken.erase(k_);
    }
  }

  std::shared_ptr<Hub> hub_;
  std::shared_ptr<Slot> slot_;
  const int64_t k_;
  const int rank_;
  const std::chrono::milliseconds timeout_;
  bool released_ = false;
};

class LoopbackBackend : public CommBase {
 public:
  LoopbackBackend(std::shared_ptr<Hub> hub, int rank, int size, std::chrono::milliseconds timeout)
      : CommBase(rank, size), hub_(std::move(hub)), timeout_(timeout) {
#if DMUON_TORCH_AT_LEAST(2, 0)
    if (hub_->device.type() != c10::DeviceType::CPU) setBoundDeviceId(hub_->device);
#endif
  }

  const std::string getBackendName() const override { return "dmuon-loopback"; }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    Part p = one(tensors, Kind::Broadcast);
    p.root = static_cast<int>(opts.rootRank);
    return post(std::move(p));
  }
  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    Part p = one(tensors, Kind::AllReduce);
    p.op = opts.reduceOp;
    return post(std::move(p));
  }
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    Part p = one(tensors, Kind::Reduce);
    p.op = opts.reduceOp;
    p.root = static_cast<int>(opts.rootRank);
    return post(std::move(p));
  }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions&) override {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                "dmuon-loopback allgather: one output list of ", getSize(), " tensors");
    Part p = one(inputs, Kind::AllGather);
    for (const auto& o : outputs[0]) check_device(o, "allgather");
    // the views of one flat output (what dmuon passes) or separate tensors: gather into a flat one
    p.out = at::empty({p.in.numel() * getSize()}, p.in.options());
    p.chunks = outputs[0];
    return post(std::move(p), /*unflatten=*/true);
  }
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) override {
    std::vector<at::Tensor> in{input};
    Part p = one(in, Kind::AllGather);
    check_device(output, "_allgather_base");
    TORCH_CHECK(output.numel() == input.numel() * getSize(), "dmuon-loopback _allgather_base: output of ",
                output.numel(), " elements for ", getSize(), " x ", input.numel());
    p.out = output;
    return post(std::move(p));
  }
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    std::vector<at::Tensor> in{input};
    Part p = one(in, Kind::ReduceScatter);
    check_device(output, "_reduce_scatter_base");
    TORCH_CHECK(input.numel() == output.numel() * getSize(), "dmuon-loopback _reduce_scatter_base: input of ",
                input.numel(), " elements for ", getSize(), " x ", output.numel());
    p.out = output;
    p.op = opts.reduceOp;
    return post(std::move(p));
  }
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override {
    Part p;
    p.kind = Kind::Scatter;
    p.root = static_cast<int>(opts.rootRank);
    TORCH_CHECK(outputs.size() == 1, "dmuon-loopback scatter: one output tensor");
    p.out = outputs[0];
    check_device(p.out, "scatter");
    if (getRank() == p.root) {
      TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                  "dmuon-loopback scatter: the root passes one list of ", getSize(), " tensors");
      for (const auto& t : inputs[0]) check_device(t, "scatter");
      p.chunks = inputs[0];
    }
    return post(std::move(p));
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override {
    Part p = one(inputs, Kind::Gather);
    p.root = static_cast<int>(opts.rootRank);
    if (getRank() == p.root) {
      TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                  "dmuon-loopback gather: the root passes one list of ", getSize(), " tensors");
      for (const auto& t : outputs[0]) check_device(t, "gather");
      p.chunks = outputs[0];
    }
    return post(std::move(p));
  }
  WorkPtr barrier(const c10d::BarrierOptions&) override {
    Part p;
    p.kind = Kind::Barrier;
    return post(std::move(p));
  }

 private:
  void check_device(const at::Tensor& t, const char* op) const {
    TORCH_CHECK(t.device() == hub_->device || (hub_->device.is_cpu() && t.device().is_cpu()), "dmuon-loopback ", op,
                ": a ", t.device(), " tensor on a group of ", hub_->device, " tensors (",
                hub_->device.is_cpu() ? "CPU tensors only" : "this device's tensors only; CPU tensors are refused", ")");
  }
  Part one(std::vector<at::Tensor>& ts, Kind kind) const {
    TORCH_CHECK(ts.size() == 1, "dmuon-loopback ", kind_name(kind), ": exactly one tensor per call (got ", ts.size(), ")");
    check_device(ts[0], kind_name(kind));
    Part p;
    p.kind = kind;
    p.in = ts[0];
    return p;
  }

  // Posts this rank's part of its next collective; the last rank to arrive executes it.
  WorkPtr post(Part part, bool unflatten = false) {
    const int64_t k = seq_++;
    const at::Device dev = hub_->device;
    const bool on_device = !dev.is_cpu();
    if (on_device) {  // the group's stream will wait for what the issuing stream queued so far
      const c10::impl::VirtualGuardImpl impl(dev.type());
      part.ready.emplace(dev.type());
      part.ready->record(impl.getStream(dev));
    }
    part.posted = true;
    std::vector<at::Tensor> list_out = unflatten ? part.chunks : std::vector<at::Tensor>{};
    at::Tensor flat_out = unflatten ? part.out : at::Tensor();
    if (unflatten) part.chunks.clear();
    std::shared_ptr<Slot> slot;
    {
      std::lock_guard<std::mutex> g(hub_->mu);
      slot = hub_->slot(k);
      slot->parts[static_cast<size_t>(getRank())] = std::move(part);
      if (++slot->arrived == hub_->size) run(*slot);
    }
    hub_->cv.notify_all();
    auto work = c10::make_intrusive<LoopbackWork>(hub_, slot, k, getRank(), timeout_);
    if (!unflatten) return work;
    // allgather into a list: gather into the flat temporary, then copy out on wait
    work->wait(::kNoTimeout);
    const int64_t n = flat_out.numel() / getSize();
    for (int r = 0; r < getSize(); ++r) list_out[static_cast<size_t>(r)].copy_(flat_out.narrow(0, r * n, n).view_as(list_out[static_cast<size_t>(r)]));
    return work;
  }

  // under hub_->mu, by the last rank to arrive
  void run(Slot& s) {
    s.executed = true;
    s.error = mismatch(s);
    if (!s.error.empty()) return;
    try {
      const at::Device dev = hub_->device;
      if (dev.is_cpu()) {
        execute(*hub_, s);
        return;
      }
      const c10::impl::VirtualGuardImpl impl(dev.type());
      const c10::DeviceGuard dg(dev);
      if (!hub_->stream) hub_->stream = impl.getStreamFromGlobalPool(dev, /*isHighPriority=*/true);
      const c10::StreamGuard sg(*hub_->stream);
      for (const Part& p : s.parts) p.ready->block(*hub_->stream);
      execute(*hub_, s);
      s.done.emplace(dev.type());
      s.done->record(*hub_->stream);
    } catch (const std::exception& e) {
      s.error = e.what();
      s.error = s.error.substr(0, s.error.find('\n'));
    }
  }

  std::shared_ptr<Hub> hub_;
  std::chrono::milliseconds timeout_;
  int64_t seq_ = 0;  // this rank's collectives so far
};

}  // namespace

CommPtr make_loopback_process_group(const StorePtr& store, int rank, int size, const LoopbackOptions& opts,
                                    std::chrono::milliseconds timeout) {
  TORCH_CHECK(store, "make_loopback_process_group: the store is null");
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "make_loopback_process_group: rank ", rank, " outside [0, ", size, ")");
  TORCH_CHECK(opts.device.is_cpu() || opts.device.has_index(), "make_loopback_process_group: name the device's index "
              "(e.g. cuda:0), got ", opts.device);
  TORCH_CHECK(opts.device.is_cpu() || DMUON_WITH_CUDA, "make_loopback_process_group: this dmuon build has no CUDA, so "
              "the loopback backend runs on the CPU only (got ", opts.device, ")");
  // rank 0 names the group; its peers (threads of this process) find the same hub through the store
  const std::string key = "dmuon-loopback/token";
  if (rank == 0) {
    const std::string t = std::to_string(g_next_token++) + "@" + std::to_string(reinterpret_cast<uintptr_t>(&g_hubs));
    store->set(key, std::vector<uint8_t>(t.begin(), t.end()));
  }
  store->wait({key}, timeout);
  const auto tok = store->get(key);
  return c10::make_intrusive<LoopbackBackend>(hub_for(std::string(tok.begin(), tok.end()), size, opts.device,
                                                      opts.sleep_cycles),
                                              rank, size, timeout);
}

ProcessGroupFactory loopback_process_group_factory(const LoopbackOptions& opts) {
  return [opts](const StorePtr& store, int rank, int size, std::chrono::milliseconds timeout) {
    return make_loopback_process_group(store, rank, size, opts, timeout);
  };
}

}  // namespace dmuon
