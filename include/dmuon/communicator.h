// communicator.h -- the one place dmuon issues collectives.
//
// A Communicator wraps one c10d group. Every collective goes through it, so it can
//   * count payload bytes per op kind (the numbers bench programs compare with the formulas),
//   * emulate ReduceOp AVG where the backend lacks it (Gloo in LibTorch 1.13: SUM, then divide),
//   * fall back to portable forms of all-gather / reduce-scatter on Gloo 1.13,
//   * give every collective a timeout and turn a failure into an error that names the group, the
//     op, what it carried and the rank (a lost peer is an error, never a hang),
//   * hand out async handles (Pending) that the runtime waits on later,
//   * check that every tensor lives on the group's device (NCCL: CUDA; Gloo, the store backend: CPU)
//     before anything else, on groups of one too, so a wrong-device tensor fails on a CPU box and on
//     one GPU exactly as it would on a multi-GPU run.
//
// Waiting (Pending): on a CPU group wait() blocks the host, at most the timeout. On a CUDA group
// wait() is a stream dependency: the calling thread's current stream (and the stream the collective
// was issued on, where buffers are allocated) waits for the collective, the host does not block, and
// a dead peer is caught by the process group's own timeout (ProcessGroupNCCL's watchdog; see
// docs/GPU.md). wait_host() is the bounded host wait, for the places where the host must block
// anyway: before a host read of the result, barriers, checkpoint I/O. Time blocked (CPU: host
// time in wait(); CUDA: the device time the current stream stalled at the wait, by CUDA events) is
// counted in CommCounters::wait_ms().
//
// Reductions of bf16 payloads sum in bf16 where the backend can (NCCL, the store and loopback
// backends) and in fp32 on Gloo, which cannot (cast up, reduce, round once); see docs/GPU.md.
//
// DMUON_FORCE_COLLECTIVES=1 makes groups of one issue real collectives (and the dedicated route take
// its reduce path at world size 1), so one GPU with NCCL's world size 1 runs the multi-rank code.
//
// Byte convention (per rank, what crosses this rank's link): broadcast and reduce of S bytes cost S
// on every rank except the root; all-reduce 2(N-1)/N*S; all-gather and reduce-scatter of a total S
// (N-1)/N*S; scatter of a total S from the root S/N on every other rank, gather of a total S to the
// root the same. A group of one costs nothing
// and issues nothing (unless DMUON_FORCE_COLLECTIVES=1: then it issues and still counts nothing).
#pragma once

#include <ATen/ATen.h>

#include <c10/core/Event.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dmuon/newton_schulz.h"
#include "dmuon/process_group.h"

namespace dmuon {

enum class CommOp : int { Broadcast = 0, Reduce, AllReduce, AllGather, ReduceScatter, Scatter, Barrier, Gather, kCount };
const char* comm_op_name(CommOp op);

enum class Reduction { Sum, Avg };

// Byte and call counters. Thread-safe. Shared by all communicators of one mesh.
class CommCounters {
 public:
  void add(CommOp op, int64_t bytes);
  int64_t bytes(CommOp op) const;
  int64_t calls(CommOp op) const;
  int64_t total_bytes() const;
  void reset();
  // Time callers spent blocked in Pending::wait (communication not hidden behind compute).
  void add_wait_ns(int64_t ns);
  // A stream stall on a device: the events recorded on the waiting stream just before and after its
  // wait; their elapsed time is added once the second has completed.
  void add_stall(c10::Event before, c10::Event after);
  // Includes every stall recorded so far: a host wait for the device events still pending (reports,
  // not the hot path). snapshot() counts only the stalls that already finished.
  double wait_ms() const;
  struct Snapshot {
    std::array<int64_t, static_cast<int>(CommOp::kCount)> bytes{};
    std::array<int64_t, static_cast<int>(CommOp::kCount)> calls{};
    int64_t wait_ns = 0;
    int64_t total_bytes() const;
  };
  Snapshot snapshot() const;  // wait_ns: the device stalls that already finished (no host wait)

 private:
  // adds the elapsed time of the recorded stalls that finished (`wait`: of all, waiting on the device)
  void settle_locked(bool wait) const;
  mutable std::mutex mu_;
  mutable Snapshot s_;
  mutable std::vector<std::pair<c10::Event, c10::Event>> stalls_;
};

// One planned collective of a training step on this rank, as the counters will count it: the route
// that issues it ("muon", "sharded_adamw", "replicated"), the group's name, the operation, the bytes
// and how many calls (diagnostics.h's get_comm_plan).
struct PlannedTraffic {
  std::string route;
  std::string group;
  CommOp op = CommOp::Broadcast;
  int64_t bytes = 0;
  int64_t calls = 0;
};

// An in-flight collective. wait() blocks at most the communicator's timeout, then runs the
// completion step (e.g. the AVG division on the root) once. Destroying an unwaited Pending does
// not wait: call wait() (or drain the runtime) before reading its tensors.
class Pending {
 public:
  Pending() = default;
  // CPU group: blocks the host at most the timeout. CUDA group: the current stream (and the issuing
  // stream) wait for the collective; the host does not block. Then the completion step runs, on the
  // current stream. Idempotent.
  void wait();
  // wait(), then blocks the host until the collective itself has finished, at most the timeout:
  // before a host read of the result (which then waits for the current stream), a barrier,
  // checkpoint I/O. The same as wait() on a CPU group.
  void wait_host();
  bool defined() const { return static_cast<bool>(state_); }
  bool completed() const;  // wait() already returned (or nothing was issued)
  // Non-blocking: when the collective has finished, completes it as wait() would and returns true.
  bool poll();

 private:
  friend class Communicator;
  void finish_locked(bool host);
  struct State;
  std::shared_ptr<State> state_;
};

// While the host waits for a CPU collective (Pending::wait, barriers), `check(epoch at the start of the
// wait)` runs on the waiting thread every ~100 ms; when it throws, the wait is abandoned and that
// exception propagates unchanged (the collective stays in flight: the group is unusable afterwards, as
// after any failure). Both functions run with dmuon's locks held: they must not block (no GIL). The
// Python front end counts SIGINTs in a C signal handler and throws once one arrived during the wait,
// so a rank stuck waiting for a stopped peer can still be interrupted by Ctrl-C. Unset (the default):
// a wait blocks until the collective finished or the timeout. Process-wide, thread-safe; empty
// functions remove it.
struct WaitInterrupt {
  std::function<uint64_t()> epoch;
  std::function<void(uint64_t since)> check;
};
void set_wait_interrupt_check(WaitInterrupt interrupt);

class Communicator {
 public:
  // `global_ranks[i]` is the global rank of group rank i (for messages and root mapping). `device`:
  // where this group's tensors live; unset, the process group's bound device (LibTorch 2.x), else the
  // current CUDA device for NCCL and the CPU for every other backend. timeout must be > 0.
  Communicator(CommPtr pg, std::string name, std::vector<int> global_ranks, std::chrono::milliseconds timeout,
               std::shared_ptr<CommCounters> counters, std::optional<at::Device> device = std::nullopt);

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  int global_rank() const { return global_ranks_[rank_]; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const CommPtr& process_group() const { return pg_; }
  CommCounters& counters() { return *counters_; }  // shared by every group of the mesh
  CommCounters& own_counters() { return *own_; }   // this group alone (e.g. one mesh axis)
  // Whether the backend supports ReduceOp::AVG natively (NCCL; Gloo from LibTorch 2.8).
  bool native_avg() const { return native_avg_; }
  // Where this group's tensors live; every collective checks its tensors against it first.
  const at::Device& device() const { return device_; }
  // A group of one that issues nothing (DMUON_FORCE_COLLECTIVES unset): callers may skip the
  // collective's bookkeeping entirely.
  bool local_only() const { return size_ == 1 && !force_; }
  // What one collective adds to this rank's counters (the byte convention above) and under which
  // operation: `bytes` is the payload the method takes (the tensor of a broadcast, reduce or
  // all-reduce; the whole flat buffer of an all-gather or reduce-scatter; this rank's chunk of a
  // scatter or gather; `root`: this rank is the root). Gloo runs a reduce-scatter as an all-reduce of
  // the whole buffer; a group of one counts nothing. Plans use it; the counters confirm them.
  std::pair<CommOp, int64_t> counted(CommOp op, int64_t bytes, bool root = false) const;
  // A tensor of this group's device for a small exchange (flags, digests, norms).
  at::TensorOptions options(at::ScalarType dtype) const { return at::TensorOptions().dtype(dtype).device(device_); }

  // collective: all ranks of this group, same order. Each returns at once; `what` names the
  // payload in error messages (e.g. "forward broadcast of model.layers.3 from rank 2").
  Pending broadcast(at::Tensor tensor, int root, std::string what);
  // Only `root` holds a valid result (the average for Avg); other ranks' tensors are scratch.
  Pending reduce(at::Tensor tensor, int root, Reduction op, std::string what);
  Pending allreduce(at::Tensor tensor, Reduction op, std::string what);
  // out: a flat tensor of size() * in.numel() elements; rank i's `in` lands at offset i*in.numel().
  Pending allgather_flat(at::Tensor out, at::Tensor in, std::string what);
  // in: size() * out.numel() elements; out <- reduction over ranks of chunk rank() of `in`.
  // Gloo 1.13 has no reduce-scatter: all-reduce of a copy + narrow (counted as an all-reduce).
  Pending reduce_scatter_flat(at::Tensor out, at::Tensor in, Reduction op, std::string what);
  // out: in.numel() / size() elements; rank i receives the root's chunk i of `in` (only the root's
  // `in` is read). Costs out bytes on every non-root rank.
  Pending scatter_flat(at::Tensor out, at::Tensor in, int root, std::string what);
  // The inverse of scatter_flat: on `root`, out (size() * in.numel() elements) receives rank i's `in`
  // at offset i*in.numel(); other ranks' `out` is not touched (pass an empty tensor). Costs in bytes on
  // every non-root rank.
  Pending gather_flat(at::Tensor out, at::Tensor in, int root, std::string what);
  // collective: blocking barrier with this group's timeout (the host waits).
  void barrier(const std::string& what);

  // The process group's teardown (LibTorch 2.x backends; nothing on 1.13): shutdown() after every
  // collective finished, abort() on an error path so no watchdog fires later (never throws).
  // Idempotent.
  void shutdown();
  void abort();

 private:
  // every tensor of a collective must live on device(): `role` names it in the error
  void check_device(const at::Tensor& t, const char* op, const char* role, const std::string& what) const;
  Pending issue(CommOp op, const std::string& what, const std::function<WorkPtr()>& launch,
                std::function<void()> on_complete);
  [[noreturn]] void rethrow(const std::string& op_what, const std::exception& e) const;
  void count(CommOp op, int64_t bytes);

  CommPtr pg_;
  std::string name_;
  std::vector<int> global_ranks_;
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<CommCounters> counters_;
  std::shared_ptr<CommCounters> own_ = std::make_shared<CommCounters>();
  bool native_avg_ = false;
  bool is_gloo_ = true;
  bool force_ = false;
  bool closed_ = false;
  at::Device device_{at::kCPU};
};

// ---- an outcome every rank learns ----
// collective over `comm`, every rank: `work` runs on the ranks where `here` holds (a file rank 0 writes, a
// file each rank reads), then one small all-gather tells every rank whether it failed anywhere: a failure
// raises on every rank at once -- where it failed "rank R: <what> failed: <its error>", elsewhere
// "rank R: <what>: failed on rank(s) F: <the first failing rank's error>" -- instead of leaving the others in
// their next collective until the timeout. A caller mistake (std::invalid_argument, c10::ValueError) stays
// one on every rank where every failure was one.
void agree_outcome(Communicator& comm, const std::string& what, bool here, const std::function<void()>& work);

// ---- a refusal every rank learns, for a call whose checks run outside the core ----
// collective over `comm`, every rank: the agreement each of dmuon's collective calls opens with, tagged `what`,
// for one whose checks run elsewhere (the Python side's). `refusal`: this rank refused its input ({whether it
// was a caller mistake, why}). Where any rank refused, raises on every rank: here `refusal`'s reason (an
// std::invalid_argument for a caller mistake, else an std::runtime_error), elsewhere "rank R: <what>: rank(s) F
// refused <given> they were given, so <outcome> (rank F: <reason>)". Ranks in another dmuon call's agreement
// (one skipped or added a collective call) raise on every rank, each naming its own call; a lost peer is an
// error after the group's timeout, naming `what`.
void agree_call(Communicator& comm, const std::string& what, const std::string& given, const std::string& outcome,
                const std::optional<std::pair<bool, std::string>>& refusal);

// ---- the column-sharded Gram NS over a group (newton_schulz.h takes an all-reduce function) ----
// An in-place sum over `comm`, waited with its timeout and counted like every dmuon collective.
AllReduceSumFn allreduce_sum_fn(Communicator& comm, std::string what);
// gram_newton_schulz_distributed_local over a c10d group (nullptr = a group of one); every all-reduce
// waits at most `timeout`. collective: all ranks of `group`, same order. Each call first agrees the ranks'
// shards (rows, batch, dtype, `transposed`, options) in one small all-gather: a mismatch is an error on every
// rank, not a size mismatch inside the backend.
at::Tensor gram_newton_schulz_distributed_local(const at::Tensor& G_local, const CommPtr& group, bool transposed,
                                                const NsOptions& opts = {},
                                                std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);
at::Tensor gram_newton_schulz_distributed_local_batched(const at::Tensor& G_local, const CommPtr& group,
                                                        bool transposed, const NsOptions& opts = {},
                                                        std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);

}  // namespace dmuon
