// dmuon's store backend: the c10d collectives dmuon uses, carried through a c10d::Store, for CPU
// tensors in LibTorch builds without Gloo (PyPI's torch wheels ship no gloo headers). Correct and
// deterministic, not fast: every collective is an all-to-all exchange of the ranks' payloads through
// the store, executed in issue order on one worker thread per group (like Gloo's), so collectives
// of different groups proceed independently. Reductions add the ranks' contributions in rank order,
// so every rank gets bit-identical results. A peer that never arrives is an error after the timeout.
// Waiting polls the store (check) with a backoff of 20 us to 2 ms.
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/reduce_ops.h"
#include "dmuon/bootstrap.h"

namespace dmuon {

namespace {

class StoreWork : public c10d::Work {
 public:
  StoreWork() = default;
  void done(std::exception_ptr e) { finish(std::move(e)); }
};

// A collective whose group was destroyed while it waited for its peers (see ~StoreBackend).
struct Abandoned : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class StoreBackend : public CommBase {
 public:
  StoreBackend(StorePtr store, int rank, int size, std::chrono::milliseconds timeout)
      : CommBase(rank, size), store_(std::move(store)), timeout_(timeout), worker_([this] { loop(); }) {}

  // Queued collectives still run (each posts its payload, so peers that wait for it get it), but none
  // waits for its peers any more: this group's results are no longer wanted, and waiting could block
  // the destroying thread until the timeout (ranks as threads of one process: one rank thread may
  // release another's destroyed model, whose last collective that rank never issued).
  ~StoreBackend() override {
    stopping_ = true;
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  const std::string getBackendName() const override { return "dmuon-store"; }

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    check_one(tensors, "broadcast");
    at::Tensor t = tensors[0];
    const int root = static_cast<int>(opts.rootRank);
    return enqueue([this, t, root]() mutable {
      const auto all = exchange(getRank() == root ? bytes_of(t) : Bytes{});
      if (getRank() != root) assign(t, all[static_cast<size_t>(root)]);
    });
  }

  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    check_one(tensors, "allreduce");
    at::Tensor t = tensors[0];
    const auto op = opts.reduceOp;
    return enqueue([this, t, op]() mutable { reduce_into(t, exchange(bytes_of(t)), op); });
  }

  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    check_one(tensors, "reduce");
    at::Tensor t = tensors[0];
    const auto op = opts.reduceOp;
    const int root = static_cast<int>(opts.rootRank);
    return enqueue([this, t, op, root]() mutable {
      const auto all = exchange(bytes_of(t));
      if (getRank() == root) reduce_into(t, all, op);
    });
  }

  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions&) override {
    check_one(inputs, "allgather");
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                "dmuon-store allgather: expected one list of ", getSize(), " output tensors");
    at::Tensor in = inputs[0];
    std::vector<at::Tensor> outs = outputs[0];
    return enqueue([this, in, outs]() mutable {
      const auto all = exchange(bytes_of(in));
      for (size_t r = 0; r < outs.size(); ++r) assign(outs[r], all[r]);
    });
  }

  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) override {
    TORCH_CHECK(output.numel() == input.numel() * getSize(), "dmuon-store _allgather_base: output size");
    at::Tensor out = output, in = input;
    return enqueue([this, out, in]() mutable {
      const auto all = exchange(bytes_of(in));
      at::Tensor flat = out.view(-1);
      for (size_t r = 0; r < all.size(); ++r)
        assign(flat.narrow(0, static_cast<int64_t>(r) * in.numel(), in.numel()), all[r]);
    });
  }

  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(input.numel() == output.numel() * getSize(), "dmuon-store _reduce_scatter_base: input size");
    at::Tensor out = output, in = input;
    const auto op = opts.reduceOp;
    return enqueue([this, out, in, op]() mutable {
      // each rank sends only the chunk each peer needs: rank r's message is its r-th... all chunks;
      // the store carries whole payloads, so take the chunk of this rank from every peer's input
      const auto all = exchange(bytes_of(in));
      const int64_t n = out.numel();
      const size_t chunk = static_cast<size_t>(n) * out.element_size(), off = chunk * static_cast<size_t>(getRank());
      std::vector<Bytes> mine;
      for (const auto& b : all) mine.emplace_back(b.begin() + static_cast<std::ptrdiff_t>(off),
                                                  b.begin() + static_cast<std::ptrdiff_t>(off + chunk));
      reduce_into(out, mine, op);
    });
  }

  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override {
    check_one(outputs, "scatter");
    at::Tensor out = outputs[0];
    const int root = static_cast<int>(opts.rootRank);
    Bytes payload;
    if (getRank() == root) {
      TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                  "dmuon-store scatter: the root needs one list of ", getSize(), " input tensors");
      for (const auto& t : inputs[0]) {
        const Bytes b = bytes_of(t);
        payload.insert(payload.end(), b.begin(), b.end());
      }
    }
    return enqueue([this, out, root, payload]() mutable {
      const auto all = exchange(payload);
      const size_t chunk = static_cast<size_t>(out.nbytes()), off = chunk * static_cast<size_t>(getRank());
      const Bytes& from = all[static_cast<size_t>(root)];
      assign(out, Bytes(from.begin() + static_cast<std::ptrdiff_t>(off),
                        from.begin() + static_cast<std::ptrdiff_t>(off + chunk)));
    });
  }

  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override {
    check_one(inputs, "gather");
    const int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> outs;
    if (getRank() == root) {
      TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                  "dmuon-store gather: the root needs one list of ", getSize(), " output tensors");
      outs = outputs[0];
    }
    at::Tensor in = inputs[0];
    return enqueue([this, outs, in, root]() mutable {
      const auto all = exchange(getRank() == root ? Bytes() : bytes_of(in));
      if (getRank() != root) return;
      for (int r = 0; r < getSize(); ++r)
        if (r == root) outs[static_cast<size_t>(r)].copy_(in.reshape(outs[static_cast<size_t>(r)].sizes()));
        else assign(outs[static_cast<size_t>(r)], all[static_cast<size_t>(r)]);
    });
  }

  WorkPtr barrier(const c10d::BarrierOptions&) override {
    return enqueue([this] { (void)exchange({}); });
  }

 private:
  using Bytes = std::vector<uint8_t>;

  static void check_one(const std::vector<at::Tensor>& ts, const char* op) {
    TORCH_CHECK(ts.size() == 1, "dmuon-store ", op, ": exactly one tensor per call (got ", ts.size(), ")");
    TORCH_CHECK(ts[0].device().is_cpu(), "dmuon-store ", op, ": CPU tensors only (use NCCL for CUDA tensors)");
  }

  static Bytes bytes_of(const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    const auto* p = static_cast<const uint8_t*>(c.data_ptr());
    return Bytes(p, p + c.nbytes());
  }

  static void assign(const at::Tensor& t, const Bytes& b) {
    TORCH_CHECK(b.size() == t.nbytes(), "dmuon-store: a peer sent ", b.size(), " bytes for a tensor of ", t.nbytes(),
                " bytes: the ranks issued different collectives (all ranks must run the same code in the same order)");
    if (t.is_contiguous()) {
      std::memcpy(t.data_ptr(), b.data(), b.size());
    } else {
      at::Tensor c = at::empty_like(t, at::MemoryFormat::Contiguous);
      std::memcpy(c.data_ptr(), b.data(), b.size());
      t.copy_(c);
    }
  }

  // t = op over the ranks' payloads, added in rank order (the same bits on every rank)
  static void reduce_into(at::Tensor& t, const std::vector<Bytes>& all, const c10d::ReduceOp& op) {
    at::Tensor acc;
    for (const auto& b : all) {
      at::Tensor x = at::empty_like(t, at::MemoryFormat::Contiguous);
      TORCH_CHECK(b.size() == x.nbytes(), "dmuon-store: a peer's payload has ", b.size(), " bytes, expected ",
                  x.nbytes(), ": the ranks issued different collectives");
      std::memcpy(x.data_ptr(), b.data(), b.size());
      if (!acc.defined()) {
        acc = x;
        continue;
      }
      detail::combine(acc, x, op, "dmuon-store");
    }
    detail::finish(acc, op, static_cast<int64_t>(all.size()));
    t.copy_(acc);
  }

  // Every rank posts its payload for this collective and reads every rank's. After collective k a
  // rank deletes its own key of k - 1: every peer has posted k, so it has finished reading k - 1.
  std::vector<Bytes> exchange(const Bytes& mine) {
    const int64_t k = seq_++;
    auto key = [](int64_t s, int r) {
      std::string k = std::to_string(s);  // built by appends: GCC 12 warns falsely on "c" + ... here
      k += '/';
      k += std::to_string(r);
      return k;
    };
    store_->set(key(k, getRank()), mine);
    std::vector<std::string> keys;
    for (int r = 0; r < getSize(); ++r) keys.push_back(key(k, r));
    wait_for(keys, k);
    std::vector<Bytes> all;
    for (const auto& kk : keys) all.push_back(store_->get(kk));
    if (k > 0) store_->deleteKey(key(k - 1, getRank()));
    return all;
  }

  // Polls instead of Store::wait: a TCPStore client holds its connection's lock for the whole of a
  // blocking wait, and the groups of one mesh share that client (PrefixStores over one TCPStore), so
  // one group's wait would stall another group's set and the ranks would deadlock.
  void wait_for(const std::vector<std::string>& keys, int64_t k) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    auto pause = std::chrono::microseconds(20);
    while (!store_->check(keys)) {
      if (stopping_)
        throw Abandoned("dmuon-store: collective #" + std::to_string(k) + " of this group was abandoned: the group was "
                        "destroyed while it waited for its peers");
      if (std::chrono::steady_clock::now() > deadline) {
        std::string missing;
        for (int r = 0; r < getSize(); ++r)
          if (!store_->check({keys[static_cast<size_t>(r)]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        TORCH_CHECK(false, "dmuon-store: collective #", k, " of this group timed out after ", timeout_.count(),
                    " ms waiting for group rank(s) ", missing, " (a peer died, hangs, or issued fewer collectives)");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(2000));
    }
  }

  WorkPtr enqueue(std::function<void()> fn) {
    auto work = c10::make_intrusive<StoreWork>();
    {
      std::lock_guard<std::mutex> g(mu_);
      queue_.push_back([this, work, fn = std::move(fn)] {
        // after a failed collective the group's sequence is lost (a peer died or diverged): every
        // later one fails at once instead of waiting out its own timeout
        if (!broken_.empty()) {
          work->done(std::make_exception_ptr(std::runtime_error(
              "dmuon-store: an earlier collective of this group failed, so this one cannot run: " + broken_)));
          return;
        }
        try {
          fn();
          work->done(nullptr);
        } catch (const Abandoned&) {
          work->done(std::current_exception());  // not a broken sequence: later queued ones still post
        } catch (const std::exception& e) {
          broken_ = e.what();
          broken_ = broken_.substr(0, broken_.find('\n'));
          work->done(std::current_exception());
        } catch (...) {
          broken_ = "unknown error";
          work->done(std::current_exception());
        }
      });
    }
    cv_.notify_one();
    return work;
  }

  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }

  StorePtr store_;
  std::chrono::milliseconds timeout_;
  int64_t seq_ = 0;     // worker thread only
  std::string broken_;  // worker thread only: the first failure's message
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::atomic<bool> stopping_{false};  // set first by the destructor, read by wait_for
  std::thread worker_;  // last: starts after everything it uses exists
};

}  // namespace

CommPtr make_store_process_group(const StorePtr& store, int rank, int size, std::chrono::milliseconds timeout) {
  TORCH_CHECK(store, "make_store_process_group: the store is null");
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "make_store_process_group: rank ", rank, " outside [0, ", size, ")");
  return c10::make_intrusive<StoreBackend>(store, rank, size, timeout);
}

}  // namespace dmuon
