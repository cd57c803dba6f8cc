// Communicator, Mesh and bootstrap: closed-form results of every collective on 1..6 Gloo ranks
// (threads of this process, Gloo on 127.0.0.1, a fresh FileStore per test), the byte/call counters
// against the convention in communicator.h, timeouts of a collective a peer never joins, mesh
// layouts and policies, and the launch-environment parser.
#include <gtest/gtest.h>
#include <unistd.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dmuon/bootstrap.h"
#include "dmuon/env.h"
#include "dmuon/communicator.h"
#include "dmuon/mesh.h"
#include "support/env_guard.h"
#include "support/multirank.h"

namespace dmuon {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---- helpers ----------------------------------------------------------------------------------------

std::vector<int> iota_vec(int n, int start = 0, int stride = 1) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = start + i * stride;
  return v;
}

std::unique_ptr<Communicator> make_comm(testing::RankContext& ctx, std::shared_ptr<CommCounters> counters = nullptr,
                                        std::chrono::milliseconds timeout = 60s, const std::string& name = "test") {
  return std::make_unique<Communicator>(ctx.pg, name, iota_vec(ctx.world), timeout, std::move(counters));
}

std::shared_ptr<Mesh> make_isolated_mesh(testing::RankContext& ctx, int replicate_size = 1,
                                         std::chrono::milliseconds timeout = 60s) {
  MeshOptions mo;
  mo.process_group_policy = "isolated";
  mo.store = ctx.store;
  mo.factory = process_group_factory(c10::DeviceType::CPU);
  mo.replicate_size = replicate_size;
  mo.timeout = timeout;
  return Mesh::create(ctx.pg, mo);
}

// Exact equality of two float tensors, with both printed on failure.
void expect_tensor_eq(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  EXPECT_TRUE(actual.sizes() == expected.sizes()) << what << ": shape " << actual.sizes() << " vs " << expected.sizes();
  EXPECT_TRUE(at::equal(actual, expected.to(actual.scalar_type()))) << what << ":\n actual   " << actual
                                                                    << "\n expected " << expected;
}

// The caller's world group (ctx.pg) still runs an all-reduce over every rank.
void expect_callers_group_works(testing::RankContext& ctx, const std::string& when) {
  auto caller = make_comm(ctx);
  at::Tensor c = at::full({2}, 1.0f);
  caller->allreduce(c, Reduction::Sum, "caller " + when).wait();
  expect_tensor_eq(c, at::full({2}, static_cast<float>(ctx.world)), "the caller's world group " + when);
}

using testing::error_of;

int64_t allreduce_bytes(int n, int64_t s) { return n > 1 ? 2 * (n - 1) * s / n : 0; }
int64_t gather_bytes(int n, int64_t s) { return n > 1 ? (n - 1) * s / n : 0; }

using testing::EnvGuard;

// CPU groups are Gloo unless this LibTorch has none (PyPI wheels) or DMUON_CPU_BACKEND=store: then
// dmuon's store backend, which reduces natively (AVG, reduce-scatter, bf16).
bool gloo_in_use() { return gloo_available() && env::cpu_backend() != "store"; }

// ============================== Communicator ==========================================================

TEST(CommunicatorTest, BroadcastFromEveryRoot) {
  for (int n = 1; n <= 4; ++n) {
    SCOPED_TRACE("world " + std::to_string(n));
    testing::run_ranks(n, [&](testing::RankContext& ctx) {
      auto comm = make_comm(ctx);
      EXPECT_EQ(comm->rank(), ctx.rank);
      EXPECT_EQ(comm->size(), n);
      EXPECT_EQ(comm->global_rank(), ctx.rank);
      EXPECT_EQ(comm->native_avg(), !gloo_in_use() || DMUON_TORCH_AT_LEAST(2, 8));  // Gloo: since 2.8
      for (int root = 0; root < n; ++root) {
        const at::Tensor expected = at::arange(6, at::kFloat) + 10.0 * root;
        at::Tensor t = ctx.rank == root ? expected.clone() : at::full({6}, -1.0f);
        comm->broadcast(t, root, "bcast from " + std::to_string(root)).wait();
        expect_tensor_eq(t, expected, "rank " + std::to_string(ctx.rank) + " root " + std::to_string(root));
      }
      // 24 bytes per broadcast on every non-root: each rank was root exactly once.
      EXPECT_EQ(comm->counters().bytes(CommOp::Broadcast), 24 * (n - 1));
      EXPECT_EQ(comm->counters().calls(CommOp::Broadcast), n > 1 ? n : 0);
      EXPECT_EQ(comm->counters().total_bytes(), 24 * (n - 1));
    });
  }
}

TEST(CommunicatorTest, BroadcastByteCountIsZeroOnRootOnly) {
  testing::run_ranks(3, [&](testing::RankContext& ctx) {
    auto comm = make_comm(ctx);
    at::Tensor t = at::full({10}, static_cast<double>(ctx.rank), at::kDouble);  // 80 bytes
    comm->broadcast(t, 2, "root 2").wait();
    expect_tensor_eq(t, at::full({10}, 2.0, at::kDouble), "broadcast from 2");
    EXPECT_EQ(comm->counters().bytes(CommOp::Broadcast), ctx.rank == 2 ? 0 : 80);
    EXPECT_EQ(comm->counters().calls(CommOp::Broadcast), 1);
  });
}

TEST(CommunicatorTest, ReduceSumAndAvgToEveryRoot) {
  for (int n = 1; n <= 4; ++n) {
    SCOPED_TRACE("world " + std::to_string(n));
    testing::run_ranks(n, [&](testing::RankContext& ctx) {
      auto comm = make_comm(ctx);
      const at::Tensor base = at::arange(4, at::kFloat);
      for (int root = 0; root < n; ++root) {
        // rank r contributes base + 100 r
        at::Tensor s = base + 100.0 * ctx.rank;
        comm->reduce(s, root, Reduction::Sum, "reduce sum").wait();
        at::Tensor a = base + 100.0 * ctx.rank;
        comm->reduce(a, root, Reduction::Avg, "reduce avg").wait();
        if (ctx.rank == root) {
          // sum: n*base + 100 * n(n-1)/2 ; avg: base + 50 (n-1)
          expect_tensor_eq(s, base * n + 100.0 * n * (n - 1) / 2, "sum on root " + std::to_string(root));
          expect_tensor_eq(a, base + 50.0 * (n - 1), "avg on root " + std::to_string(root));
        }
      }
      // 2 reduces per root, 16 bytes each on non-roots.
      EXPECT_EQ(comm->counters().bytes(CommOp::Reduce), 2 * 16 * (n - 1));
      EXPECT_EQ(comm->counters().calls(CommOp::Reduce), n > 1 ? 2 * n : 0);
    });
  }
}

TEST(CommunicatorTest, ReduceAvgOfSumOfRankIndices) {
  // The root's value is the exact mean of the rank indices (0+1+2+3)/4 = 1.5.
  testing::run_ranks(4, [&](testing::RankContext& ctx) {
    auto comm = make_comm(ctx);
    at::Tensor t = at::full({3}, static_cast<float>(ctx.rank));
    comm->reduce(t, 3, Reduction::Avg, "avg of ranks").wait();
    if (ctx.rank == 3) expect_tensor_eq(t, at::full({3}, 1.5f), "avg on root 3");
    at::Tensor s = at::full({3}, static_cast<float>(ctx.rank));
    comm->reduce(s, 1, Reduction::Sum, "sum of ranks").wait();
    if (ctx.rank == 1) expect_tensor_eq(s, at::full({3}, 6.0f), "sum on root 1");
  });
}

TEST(CommunicatorTest, AllReduceSumAndAvg) {
  for (int n = 1; n <= 4; ++n) {
    SCOPED_TRACE("world " + std::to_string(n));
    testing::run_ranks(n, [&](testing::RankContext& ctx) {
      auto comm = make_comm(ctx);
      const at::Tensor base = at::arange(6, at::kFloat);
      at::Tensor s = base + 10.0 * ctx.rank;  // 24 bytes
      comm->allreduce(s, Reduction::Sum, "allreduce sum").wait();
      expect_tensor_eq(s, base * n + 10.0 * n * (n - 1) / 2, "allreduce sum");
      at::Tensor a = (base + 10.0 * ctx.rank).to(at::kDouble);  // 48 bytes
      comm->allreduce(a, Reduction::Avg, "allreduce avg").wait();
      expect_tensor_eq(a, (base + 5.0 * (n - 1)).to(at::kDouble), "allreduce avg");
      EXPECT_EQ(comm->counters().bytes(CommOp::AllReduce), allreduce_bytes(n, 24) + allreduce_bytes(n, 48));
      EXPECT_EQ(comm->counters().calls(CommOp::AllReduce), n > 1 ? 2 : 0);
    });
  }
  // spot-check the formula's values: 2(N-1)/N * S
  EXPECT_EQ(allreduce_bytes(2, 24), 24);
  EXPECT_EQ(allreduce_bytes(3, 24), 32);
  EXPECT_EQ(allreduce_bytes(4, 48), 72);
}

TEST(CommunicatorTest, AllGatherFlatPlacesEachRanksContentAtItsOffset) {
  for (int n = 1; n <= 4; ++n) {
    SCOPED_TRACE("world " + std::to_string(n));
    testing::run_ranks(n, [&](testing::RankContext& ctx) {
      auto comm = make_comm(ctx);
      // rank r contributes a 2x3 block r*r, r*r+1, ..., (distinct contents per rank)
      at::Tensor in = (at::arange(6, at::kFloat) * (ctx.rank + 1) + ctx.rank * ctx.rank).view({2, 3});
      at::Tensor out = at::full({6 * n}, -7.0f);
      comm->allgather_flat(out, in, "allgather").wait();
      std::vector<at::Tensor> parts;
      for (int r = 0; r < n; ++r) parts.push_back(at::arange(6, at::kFloat) * (r + 1) + r * r);
      expect_tensor_eq(out, at::cat(parts), "allgather on rank " + std::to_string(ctx.rank));
      // total S = 24 n bytes; (N-1)/N * S = 24 (N-1)
      EXPECT_EQ(comm->counters().bytes(CommOp::AllGather), 24 * (n - 1));
      EXPECT_EQ(comm->counters().calls(CommOp::AllGather), n > 1 ? 1 : 0);
      // a wrong output size is an error (before anything is issued)
      at::Tensor bad = at::empty({6 * n + 1});
      const std::string err = error_of([&] { comm->allgather_flat(bad, in, "bad gather"); });
      EXPECT_NE(err.find("allgather_flat (bad gather): output has " + std::to_string(6 * n + 1) +
                         " elements, expected " + std::to_string(6 * n)),
                std::string::npos)
          << err;
      EXPECT_EQ(comm->counters().calls(CommOp::AllGather), n > 1 ? 1 : 0);
    });
  }
}

TEST(CommunicatorTest, ReduceScatterFlatSumAndAvgViaAllReduceFallback) {
  for (int n = 1; n <= 4; ++n) {
    SCOPED_TRACE("world " + std::to_string(n));
    testing::run_ranks(n, [&](testing::RankContext& ctx) {
      auto comm = make_comm(ctx);
      const int64_t chunk = 3;
      const int r = ctx.rank;
      const at::Tensor in = at::arange(n * chunk, at::kFloat) + 1000.0 * r;  // S = 12 n bytes
      const at::Tensor in_copy = in.clone();
      at::Tensor out_s = at::full({chunk}, -1.0f), out_a = at::full({chunk}, -1.0f);
      comm->reduce_scatter_flat(out_s, in, Reduction::Sum, "rs sum").wait();
      comm->reduce_scatter_flat(out_a, in, Reduction::Avg, "rs avg").wait();
      // out[j] on rank r: sum over ranks q of (r*chunk + j + 1000 q)
      const at::Tensor mine = at::arange(r * chunk, (r + 1) * chunk, at::kFloat);
      if (n == 1) {
        expect_tensor_eq(out_s, mine, "rs sum, world 1");
        expect_tensor_eq(out_a, mine, "rs avg, world 1");
      } else {
        expect_tensor_eq(out_s, mine * n + 1000.0 * n * (n - 1) / 2, "rs sum");
        expect_tensor_eq(out_a, mine + 500.0 * (n - 1), "rs avg");
      }
      expect_tensor_eq(in, in_copy, "reduce_scatter input must be left alone");
      if (gloo_in_use()) {
        // counted as two all-reduces of S = 12 n bytes (the Gloo fallback), never as reduce-scatter
        EXPECT_EQ(comm->counters().bytes(CommOp::ReduceScatter), 0);
        EXPECT_EQ(comm->counters().calls(CommOp::ReduceScatter), 0);
        EXPECT_EQ(comm->counters().bytes(CommOp::AllReduce), 2 * allreduce_bytes(n, 12 * n));
        EXPECT_EQ(comm->counters().calls(CommOp::AllReduce), n > 1 ? 2 : 0);
        if (n == 4) {
          EXPECT_EQ(comm->counters().bytes(CommOp::AllReduce), 2 * 72);
        }
      } else {  // a native reduce-scatter: (N-1)/N of the input
        EXPECT_EQ(comm->counters().bytes(CommOp::ReduceScatter), 2 * gather_bytes(n, 12 * n));
        EXPECT_EQ(comm->counters().calls(CommOp::ReduceScatter), n > 1 ? 2 : 0);
        EXPECT_EQ(comm->counters().bytes(CommOp::AllReduce), 0);
      }
    });
  }
}

TEST(CommunicatorTest, BarrierSynchronisesAllRanks) {
  for (int n = 2; n <= 4; ++n) {
    SCOPED_TRACE("world " + std::to_string(n));
    std::atomic<int> arrived{0};
    testing::run_ranks(n, [&](testing::RankContext& ctx) {
      auto comm = make_comm(ctx);
      if (ctx.rank == 0) std::this_thread::sleep_for(200ms);  // rank 0 arrives last
      arrived.fetch_add(1);
      comm->barrier("test barrier");
      EXPECT_EQ(arrived.load(), n) << "rank " << ctx.rank << " left the barrier before everyone arrived";
      EXPECT_EQ(comm->counters().calls(CommOp::Barrier), 1);
      EXPECT_EQ(comm->counters().bytes(CommOp::Barrier), 0);
      EXPECT_EQ(comm->counters().total_bytes(), 0);
    });
  }
}

TEST(CommunicatorTest, CountersAccumulateAcrossOpsAndReset) {
  testing::run_ranks(4, [&](testing::RankContext& ctx) {
    auto counters = std::make_shared<CommCounters>();
    auto comm = make_comm(ctx, counters);
    auto comm2 = make_comm(ctx, counters, 60s, "second");  // shares the counters
    at::Tensor t = at::ones({8});                          // 32 bytes
    comm->broadcast(t, 1, "b").wait();                     // 32 on non-root, 0 on rank 1
    comm2->reduce(t, 0, Reduction::Sum, "r").wait();       // 32 on non-root, 0 on rank 0
    comm->allreduce(t, Reduction::Sum, "a").wait();        // 2*3/4*32 = 48
    at::Tensor out = at::empty({32});
    comm2->allgather_flat(out, t, "g").wait();             // 3/4*128 = 96
    at::Tensor rs = at::empty({2});
    // Gloo: an all-reduce of 32 bytes (48); natively a reduce-scatter: 3/4 * 32 = 24
    comm->reduce_scatter_flat(rs, t, Reduction::Sum, "rs").wait();
    comm->barrier("x");
    const auto snap = counters->snapshot();
    const int64_t bcast = ctx.rank == 1 ? 0 : 32, red = ctx.rank == 0 ? 0 : 32;
    const bool gloo = gloo_in_use();
    const int64_t rs_bytes = gloo ? 0 : 24, rs_as_allreduce = gloo ? 48 : 0;
    EXPECT_EQ(snap.bytes[static_cast<int>(CommOp::Broadcast)], bcast);
    EXPECT_EQ(snap.bytes[static_cast<int>(CommOp::Reduce)], red);
    EXPECT_EQ(snap.bytes[static_cast<int>(CommOp::AllReduce)], 48 + rs_as_allreduce);
    EXPECT_EQ(snap.bytes[static_cast<int>(CommOp::AllGather)], 96);
    EXPECT_EQ(snap.bytes[static_cast<int>(CommOp::ReduceScatter)], rs_bytes);
    EXPECT_EQ(snap.calls[static_cast<int>(CommOp::Broadcast)], 1);
    EXPECT_EQ(snap.calls[static_cast<int>(CommOp::Reduce)], 1);
    EXPECT_EQ(snap.calls[static_cast<int>(CommOp::AllReduce)], gloo ? 2 : 1);
    EXPECT_EQ(snap.calls[static_cast<int>(CommOp::AllGather)], 1);
    EXPECT_EQ(snap.calls[static_cast<int>(CommOp::Barrier)], 1);
    EXPECT_EQ(snap.total_bytes(), bcast + red + 48 + rs_as_allreduce + 96 + rs_bytes);
    EXPECT_EQ(counters->total_bytes(), snap.total_bytes());
    EXPECT_EQ(&comm->counters(), &comm2->counters());
    counters->reset();
    EXPECT_EQ(counters->total_bytes(), 0);
    for (int op = 0; op < static_cast<int>(CommOp::kCount); ++op) {
      EXPECT_EQ(counters->bytes(static_cast<CommOp>(op)), 0);
      EXPECT_EQ(counters->calls(static_cast<CommOp>(op)), 0);
    }
    // counting continues after a reset
    comm->allreduce(t, Reduction::Avg, "after reset").wait();
    EXPECT_EQ(counters->bytes(CommOp::AllReduce), 48);
    EXPECT_EQ(counters->calls(CommOp::AllReduce), 1);
  });
}

TEST(CommunicatorTest, CountersOnTheirOwn) {
  CommCounters c;
  c.add(CommOp::Broadcast, 10);
  c.add(CommOp::Broadcast, 5);
  c.add(CommOp::Barrier, 0);
  EXPECT_EQ(c.bytes(CommOp::Broadcast), 15);
  EXPECT_EQ(c.calls(CommOp::Broadcast), 2);
  EXPECT_EQ(c.calls(CommOp::Barrier), 1);
  EXPECT_EQ(c.total_bytes(), 15);
  c.reset();
  EXPECT_EQ(c.calls(CommOp::Broadcast), 0);
  EXPECT_EQ(c.snapshot().total_bytes(), 0);
  EXPECT_STREQ(comm_op_name(CommOp::Broadcast), "broadcast");
  EXPECT_STREQ(comm_op_name(CommOp::Reduce), "reduce");
  EXPECT_STREQ(comm_op_name(CommOp::AllReduce), "all_reduce");
  EXPECT_STREQ(comm_op_name(CommOp::AllGather), "all_gather");
  EXPECT_STREQ(comm_op_name(CommOp::ReduceScatter), "reduce_scatter");
  EXPECT_STREQ(comm_op_name(CommOp::Barrier), "barrier");
}

TEST(CommunicatorTest, WorldSizeOneIssuesNothingAndCountsNothing) {
  testing::run_ranks(1, [&](testing::RankContext& ctx) {
    auto comm = make_comm(ctx);
    at::Tensor t = at::arange(5, at::kFloat) + 3;
    const at::Tensor orig = t.clone();
    Pending p = comm->broadcast(t, 0, "b");
    EXPECT_FALSE(p.defined());
    EXPECT_TRUE(p.completed());
    p.wait();
    Pending r = comm->reduce(t, 0, Reduction::Avg, "r");
    EXPECT_FALSE(r.defined());
    r.wait();
    Pending a = comm->allreduce(t, Reduction::Avg, "a");
    EXPECT_FALSE(a.defined());
    a.wait();
    expect_tensor_eq(t, orig, "world 1 leaves the tensor unchanged");
    at::Tensor out = at::zeros({5});
    Pending g = comm->allgather_flat(out, t, "g");
    EXPECT_FALSE(g.defined());
    expect_tensor_eq(out, orig, "world-1 all-gather copies");
    at::Tensor rs = at::zeros({5});
    Pending s = comm->reduce_scatter_flat(rs, t, Reduction::Avg, "rs");
    EXPECT_FALSE(s.defined());
    expect_tensor_eq(rs, orig, "world-1 reduce-scatter copies");
    comm->barrier("b");
    EXPECT_EQ(comm->counters().total_bytes(), 0);
    for (int op = 0; op < static_cast<int>(CommOp::kCount); ++op)
      EXPECT_EQ(comm->counters().calls(static_cast<CommOp>(op)), 0) << comm_op_name(static_cast<CommOp>(op));
  });
  Pending none;
  EXPECT_FALSE(none.defined());
  EXPECT_TRUE(none.completed());
  none.wait();
}

TEST(CommunicatorTest, GlobalRanksMustMatchGroupSize) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    const std::string err = error_of([&] { Communicator c(ctx.pg, "mismatch", {0, 1, 2}, 60s, nullptr); });
    EXPECT_NE(err.find("Communicator 'mismatch': 3 global ranks given for a group of 2"), std::string::npos) << err;
    const std::string null_err = error_of([&] { Communicator c(CommPtr(), "nullpg", {0}, 60s, nullptr); });
    EXPECT_NE(null_err.find("Communicator 'nullpg': the process group is null"), std::string::npos) << null_err;
  });
}

TEST(CommunicatorTest, GlobalRankMapping) {
  // A communicator over a 2-rank group whose members are global ranks 5 and 9.
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    Communicator c(ctx.pg, "mapped", {5, 9}, 60s, nullptr);
    EXPECT_EQ(c.global_rank(), ctx.rank == 0 ? 5 : 9);
    EXPECT_EQ(c.global_ranks(), (std::vector<int>{5, 9}));
    EXPECT_EQ(c.name(), "mapped");
    EXPECT_EQ(c.timeout(), std::chrono::milliseconds(60000));
    EXPECT_EQ(c.process_group().get(), ctx.pg.get());
  });
}

// Rank 0 all-reduces, rank 1 never joins. Rank 0 must fail within the timeout, naming the group, the
// op, the payload and its rank; rank 1 waits until rank 0 is done, so no thread is left hanging.
TEST(CommunicatorTest, CollectiveAPeerNeverJoinsFailsWithinTimeout) {
  std::atomic<bool> rank0_done{false};
  std::string err;
  double elapsed_s = -1;
  bool completed_after_error = false;
  const auto t_test = Clock::now();
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    auto comm = make_comm(ctx, nullptr, 2000ms, "probe");
    if (ctx.rank == 0) {
      at::Tensor t = at::ones({4});
      const auto t0 = Clock::now();
      Pending p = comm->allreduce(t, Reduction::Sum, "lonely sum");
      try {
        p.wait();
      } catch (const c10::Error& e) {
        err = e.what();
      }
      elapsed_s = std::chrono::duration<double>(Clock::now() - t0).count();
      completed_after_error = p.completed();
      rank0_done = true;
    } else {
      // skip the collective; stay alive until rank 0 has its error (bounded)
      const auto t0 = Clock::now();
      while (!rank0_done && Clock::now() - t0 < 60s) std::this_thread::sleep_for(10ms);
    }
  }, /*timeout=*/2000ms);
  EXPECT_TRUE(rank0_done.load());
  EXPECT_NE(err.find("rank 0: collective failed on dmuon group 'probe' (2 ranks): all_reduce (lonely sum)"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("the wait limit is 2000 ms"), std::string::npos) << err;
  EXPECT_GE(elapsed_s, 1.5) << "failed before the timeout: " << err;
  EXPECT_LT(elapsed_s, 15.0) << "took far longer than the 2 s timeout";
  EXPECT_TRUE(completed_after_error);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t_test).count(), 60.0);
}

// ============================== Mesh ==================================================================

TEST(MeshTest, OneDIsolatedIsTheDefault) {
  EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::nullopt);
  testing::run_ranks(3, [&](testing::RankContext& ctx) {
    MeshOptions mo;  // policy "" -> env (unset) -> isolated
    mo.store = ctx.store;
    mo.factory = process_group_factory(c10::DeviceType::CPU);
    auto mesh = Mesh::create(ctx.pg, mo);
    EXPECT_EQ(mesh->policy(), "isolated");
    EXPECT_EQ(mesh->global_rank(), ctx.rank);
    EXPECT_EQ(mesh->world_size(), 3);
    EXPECT_EQ(mesh->shard_rank(), ctx.rank);
    EXPECT_EQ(mesh->shard_size(), 3);
    EXPECT_EQ(mesh->replicate_rank(), 0);
    EXPECT_EQ(mesh->replicate_size(), 1);
    EXPECT_FALSE(mesh->is_hsdp());
    EXPECT_EQ(mesh->replicate(), nullptr);
    EXPECT_EQ(mesh->timeout(), kDefaultCollectiveTimeout);
    EXPECT_EQ(mesh->shard().name(), "dmuon/shard");
    EXPECT_EQ(mesh->world().name(), "dmuon/world");
    EXPECT_EQ(mesh->shard().global_ranks(), (std::vector<int>{0, 1, 2}));
    // dmuon's own group: not the caller's
    EXPECT_NE(mesh->shard().process_group().get(), ctx.pg.get());
    EXPECT_NE(mesh->world().process_group().get(), ctx.pg.get());
    EXPECT_EQ(mesh->global_rank_of(2, 0), 2);
    EXPECT_EQ(mesh->counters().total_bytes(), 0);

    at::Tensor t = at::full({3}, static_cast<float>(ctx.rank));  // 12 bytes
    mesh->shard().allreduce(t, Reduction::Sum, "sum of ranks").wait();
    expect_tensor_eq(t, at::full({3}, 3.0f), "shard sum of ranks");
    at::Tensor w = at::full({3}, static_cast<float>(ctx.rank + 1));
    mesh->world().allreduce(w, Reduction::Avg, "avg").wait();
    expect_tensor_eq(w, at::full({3}, 2.0f), "world avg of rank+1");
    // the mesh's counters see both communicators: 2 * (2*2/3*12) = 32
    EXPECT_EQ(mesh->counters().bytes(CommOp::AllReduce), 32);
    EXPECT_EQ(mesh->counters().calls(CommOp::AllReduce), 2);
    EXPECT_EQ(&mesh->shard().counters(), &mesh->counters());
    EXPECT_EQ(&mesh->world().counters(), &mesh->counters());
    expect_callers_group_works(ctx, "next to dmuon's groups");
  });
}

TEST(MeshTest, SharedPolicyUsesTheCallersGroup) {
  EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::nullopt);
  testing::run_ranks(4, [&](testing::RankContext& ctx) {
    MeshOptions mo;
    mo.process_group_policy = "shared";  // no store, no factory needed
    mo.timeout = 30s;
    mo.tag = "mytag";
    auto mesh = Mesh::create(ctx.pg, mo);
    EXPECT_EQ(mesh->policy(), "shared");
    EXPECT_EQ(mesh->shard().process_group().get(), ctx.pg.get());
    EXPECT_EQ(mesh->world().process_group().get(), ctx.pg.get());
    EXPECT_EQ(mesh->shard().name(), "mytag/shard");
    EXPECT_EQ(mesh->shard().timeout(), std::chrono::milliseconds(30000));
    EXPECT_EQ(mesh->timeout(), std::chrono::milliseconds(30000));
    EXPECT_EQ(mesh->shard_size(), 4);
    EXPECT_EQ(mesh->shard_rank(), ctx.rank);
    at::Tensor t = at::full({2}, static_cast<float>(ctx.rank));
    mesh->shard().allreduce(t, Reduction::Sum, "sum").wait();
    expect_tensor_eq(t, at::full({2}, 6.0f), "shared shard sum 0+1+2+3");
    at::Tensor b = at::full({2}, static_cast<float>(ctx.rank));
    mesh->shard().broadcast(b, 3, "from 3").wait();
    expect_tensor_eq(b, at::full({2}, 3.0f), "shared broadcast from 3");
  });
}

// issue 37: "shared" is honoured on a 2-D and a TP mesh too: the world collectives run on the
// caller's group (never shut down by dmuon), the axes' groups the caller did not give are dmuon's.
TEST(MeshTest, SharedPolicyOnA2DOrTpMeshRunsTheWorldOnTheCallersGroup) {
  EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::nullopt);
  for (const auto& [R, T] : {std::pair{2, 1}, std::pair{1, 2}}) {
    SCOPED_TRACE("R " + std::to_string(R) + " T " + std::to_string(T));
    for (const std::string policy : {"shared", "isolated"}) {
      testing::run_ranks(4, [&](testing::RankContext& ctx) {
        MeshOptions mo;
        mo.process_group_policy = policy;
        mo.store = ctx.store;
        mo.factory = process_group_factory(c10::DeviceType::CPU);
        mo.replicate_size = R;
        mo.tp_size = T;
        auto mesh = Mesh::create(ctx.pg, mo);
        EXPECT_EQ(mesh->policy(), policy);
        EXPECT_EQ(mesh->world().process_group().get() == ctx.pg.get(), policy == "shared");
        EXPECT_NE(mesh->shard().process_group().get(), ctx.pg.get());  // an axis: always built
        Communicator& axis = R > 1 ? *mesh->replicate() : *mesh->tp();
        EXPECT_NE(axis.process_group().get(), ctx.pg.get());
        at::Tensor w = at::full({2}, static_cast<float>(ctx.rank));
        mesh->world().allreduce(w, Reduction::Sum, "world sum").wait();
        expect_tensor_eq(w, at::full({2}, 6.0f), "world sum 0+1+2+3");
        at::Tensor a = at::full({1}, 1.0f);
        axis.allreduce(a, Reduction::Sum, "axis sum").wait();
        expect_tensor_eq(a, at::full({1}, 2.0f), "the axis' two ranks");
        mesh->shutdown();
        expect_callers_group_works(ctx, "after the mesh's shutdown (dmuon shut down only what it built)");
      });
    }
  }
}

// issue 37: on HSDP the post-step publish has its own group over the replicate ranks (Mesh::create
// builds it), apart from the replicate-axis reduces; a caller's one is checked like any axis twin.
TEST(MeshTest, HsdpPublishesOnItsOwnReplicateGroup) {
  EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::nullopt);
  testing::run_ranks(4, [&](testing::RankContext& ctx) {
    auto mesh = make_isolated_mesh(ctx, /*replicate_size=*/2);
    ASSERT_TRUE(mesh->has_replicate_publish_group());
    Communicator& pub = *mesh->replicate_publish();
    EXPECT_NE(pub.process_group().get(), mesh->replicate()->process_group().get());
    EXPECT_EQ(pub.global_ranks(), mesh->replicate()->global_ranks());
    EXPECT_EQ(pub.name(), mesh->replicate()->name() + "/publish");
    at::Tensor t = at::full({3}, static_cast<float>(ctx.rank));
    pub.broadcast(t, 1, "publish from replicate rank 1").wait();
    expect_tensor_eq(t, at::full({3}, static_cast<float>(mesh->global_rank_of(mesh->shard_rank(), 1))), "publish");
    EXPECT_EQ(pub.own_counters().calls(CommOp::Broadcast), 1);
    EXPECT_EQ(mesh->replicate()->own_counters().calls(CommOp::Broadcast), 0);
    // over the caller's groups: none until set_replicate_publish_group, which checks the ranks
    auto group = [](Communicator& c) { return MeshGroup{c.process_group(), c.global_ranks()}; };
    MeshGroups g{group(mesh->world()), group(mesh->shard()), group(*mesh->replicate()), std::nullopt, std::nullopt};
    auto theirs = Mesh::from_groups(g);
    EXPECT_FALSE(theirs->has_replicate_publish_group());
    EXPECT_EQ(theirs->replicate_publish(), theirs->replicate());
    std::string err = error_of([&] { theirs->set_replicate_publish_group(group(mesh->shard())); });
    EXPECT_NE(err.find("set_replicate_publish_group: the group must hold the"), std::string::npos) << err;
    theirs->set_replicate_publish_group(group(pub));
    EXPECT_EQ(theirs->replicate_publish()->process_group().get(), pub.process_group().get());
    err = error_of([&] { theirs->set_replicate_publish_group(group(pub)); });
    EXPECT_NE(err.find("has one already"), std::string::npos) << err;
    auto one_d = make_isolated_mesh(ctx);
    err = error_of([&] { one_d->set_replicate_publish_group(group(pub)); });
    EXPECT_NE(err.find("rank " + std::to_string(ctx.rank) + ": set_replicate_publish_group: this mesh has no "
                       "replicate axis"), std::string::npos) << err;
    mesh->shutdown();
  });
}

TEST(MeshTest, PolicyFromEnvironment) {
  {
    EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::string("shared"));
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      auto mesh = Mesh::create(ctx.pg);  // no store: only "shared" can work
      EXPECT_EQ(mesh->policy(), "shared");
      EXPECT_EQ(mesh->shard().process_group().get(), ctx.pg.get());
      at::Tensor t = at::full({1}, static_cast<float>(ctx.rank + 1));
      mesh->shard().allreduce(t, Reduction::Sum, "sum").wait();
      expect_tensor_eq(t, at::full({1}, 3.0f), "env-shared sum");
    });
  }
  {
    EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::string("isolated"));
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      MeshOptions mo;
      mo.store = ctx.store;
      mo.factory = process_group_factory(c10::DeviceType::CPU);
      auto mesh = Mesh::create(ctx.pg, mo);
      EXPECT_EQ(mesh->policy(), "isolated");
      EXPECT_NE(mesh->shard().process_group().get(), ctx.pg.get());
      // explicit option beats the environment
      MeshOptions shared;
      shared.process_group_policy = "shared";
      auto mesh2 = Mesh::create(ctx.pg, shared);
      EXPECT_EQ(mesh2->policy(), "shared");
    });
  }
  {
    // isolated from the environment without a store is the clear store/factory error
    EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::string("isolated"));
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      const std::string err = error_of([&] { Mesh::create(ctx.pg); });
      EXPECT_NE(err.find("process_group_policy=\"isolated\" builds dmuon's own process groups and needs "
                         "MeshOptions::store and MeshOptions::factory"),
                std::string::npos)
          << err;
    });
  }
  EXPECT_EQ(std::getenv("DMUON_PROCESS_GROUP_POLICY"), nullptr);
}

TEST(MeshTest, UnknownPolicyIsAnError) {
  {
    EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::nullopt);
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      MeshOptions mo;
      mo.process_group_policy = "bogus";
      mo.store = ctx.store;
      mo.factory = process_group_factory(c10::DeviceType::CPU);
      const std::string err = error_of([&] { Mesh::create(ctx.pg, mo); });
      EXPECT_NE(err.find("rank " + std::to_string(ctx.rank) + ": unknown process_group_policy 'bogus' (from "
                                                               "MeshOptions)"),
                std::string::npos)
          << err;
      EXPECT_NE(err.find("\"isolated\""), std::string::npos) << err;
    });
  }
  {
    EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::string("Shared "));
    testing::run_ranks(2, [&](testing::RankContext& ctx) {
      const std::string err = error_of([&] { Mesh::create(ctx.pg); });
      EXPECT_NE(err.find("unknown process_group_policy 'Shared ' (from DMUON_PROCESS_GROUP_POLICY)"),
                std::string::npos)
          << err;
    });
  }
}

// What one rank alone refuses, or settings that differ between ranks (a node's own DMUON_PROCESS_GROUP_POLICY),
// are an error on every rank at once: the others were left connecting groups that rank never built until the
// timeout.
TEST(MeshTest, OptionsOneRankRefusesOrTheRanksDisagreeOnAreAnErrorOnEveryRank) {
  EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::nullopt);
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    MeshOptions mo;
    mo.store = ctx.store;
    mo.factory = process_group_factory(c10::DeviceType::CPU);
    mo.timeout = std::chrono::seconds(60);
    mo.process_group_policy = ctx.rank == 1 ? "bogus" : "shared";
    std::string err = error_of([&] { Mesh::create(ctx.pg, mo); });
    const std::string me = "rank " + std::to_string(ctx.rank) + ": ";
    testing::expect(err.find(ctx.rank == 1 ? me + "unknown process_group_policy 'bogus' (from MeshOptions)"
                                           : me + "Mesh::create: rank(s) 1 refused the mesh's options") !=
                        std::string::npos,
                    me + err);
    mo.process_group_policy = ctx.rank == 1 ? "isolated" : "shared";
    err = error_of([&] { Mesh::create(ctx.pg, mo); });
    testing::expect(err.find(me + "Mesh::create: the ranks' meshes differ in process_group_policy (this rank's: " +
                             (ctx.rank == 1 ? "\"isolated\"" : "\"shared\"") + "): rank(s) 1 differ from rank 0") !=
                        std::string::npos,
                    me + err);
    mo.process_group_policy = "shared";
    mo.replicate_size = ctx.rank == 1 ? 2 : 1;
    err = error_of([&] { Mesh::create(ctx.pg, mo); });
    testing::expect(err.find("differ in replicate_size (this rank's: " + std::to_string(mo.replicate_size) +
                             "): rank(s) 1 differ from rank 0") != std::string::npos,
                    me + err);
    mo.replicate_size = 1;
    EXPECT_EQ(Mesh::create(ctx.pg, mo)->world_size(), 2);  // and the next one is built as usual
  });
}

TEST(MeshTest, NullWorldIsAnError) {
  const std::string err = error_of([] { Mesh::create(CommPtr()); });
  EXPECT_NE(err.find("Mesh::create: the world process group is null"), std::string::npos) << err;
}

TEST(MeshTest, IsolatedWithoutStoreOrFactoryIsAnError) {
  EnvGuard env("DMUON_PROCESS_GROUP_POLICY", std::nullopt);
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    const std::string want = "needs MeshOptions::store and MeshOptions::factory";
    MeshOptions no_store;
    no_store.process_group_policy = "isolated";
    no_store.factory = process_group_factory(c10::DeviceType::CPU);
    std::string err = error_of([&] { Mesh::create(ctx.pg, no_store); });
    EXPECT_NE(err.find(want), std::string::npos) << err;
    EXPECT_NE(err.find("rank " + std::to_string(ctx.rank)), std::string::npos) << err;
    MeshOptions no_factory;
    no_factory.store = ctx.store;  // default policy: isolated
    err = error_of([&] { Mesh::create(ctx.pg, no_factory); });
    EXPECT_NE(err.find(want), std::string::npos) << err;
    // a 2-D mesh needs its own groups even with the shared policy
    MeshOptions two_d;
    two_d.process_group_policy = "shared";
    two_d.replicate_size = 2;
    err = error_of([&] { Mesh::create(ctx.pg, two_d); });
    EXPECT_NE(err.find("a 2-D (replicate x shard) mesh builds dmuon's own process groups"), std::string::npos) << err;
  });
}

TEST(MeshTest, ReplicateSizeMustDivideWorld) {
  testing::run_ranks(3, [&](testing::RankContext& ctx) {
    for (int R : {2, 0, -1, 6}) {
      MeshOptions mo;
      mo.store = ctx.store;
      mo.factory = process_group_factory(c10::DeviceType::CPU);
      mo.replicate_size = R;
      const std::string err = error_of([&] { Mesh::create(ctx.pg, mo); });
      EXPECT_NE(err.find("rank " + std::to_string(ctx.rank) + ": replicate size " + std::to_string(R) +
                         " does not divide the world size 3"),
                std::string::npos)
          << "R=" << R << ": " << err;
    }
  });
}

// world = R x G; global = replicate * G + shard.
void check_2d_mesh(int R, int G) {
  const int n = R * G;
  SCOPED_TRACE("R=" + std::to_string(R) + " G=" + std::to_string(G));
  testing::run_ranks(n, [&](testing::RankContext& ctx) {
    auto mesh = make_isolated_mesh(ctx, R);
    const int g = ctx.rank, r = g / G, s = g % G;
    EXPECT_EQ(mesh->world_size(), n);
    EXPECT_EQ(mesh->global_rank(), g);
    EXPECT_EQ(mesh->shard_size(), G);
    EXPECT_EQ(mesh->replicate_size(), R);
    EXPECT_EQ(mesh->is_hsdp(), R > 1);
    EXPECT_EQ(mesh->shard_rank(), s) << "global " << g;
    EXPECT_EQ(mesh->replicate_rank(), r) << "global " << g;
    EXPECT_EQ(mesh->global_rank_of(s, r), g);
    for (int rr = 0; rr < R; ++rr)
      for (int ss = 0; ss < G; ++ss) EXPECT_EQ(mesh->global_rank_of(ss, rr), rr * G + ss);
    ASSERT_NE(mesh->replicate(), nullptr);
    Communicator& shard = mesh->shard();
    Communicator& rep = *mesh->replicate();
    EXPECT_EQ(shard.global_ranks(), iota_vec(G, r * G, 1));
    EXPECT_EQ(rep.global_ranks(), iota_vec(R, s, G));
    EXPECT_EQ(shard.global_rank(), g);
    EXPECT_EQ(rep.global_rank(), g);
    EXPECT_EQ(shard.name(), "dmuon/shard" + std::to_string(r));
    EXPECT_EQ(rep.name(), "dmuon/replicate" + std::to_string(s));
    EXPECT_EQ(mesh->world().size(), n);
    EXPECT_EQ(mesh->counters().total_bytes(), 0);

    const float gf = static_cast<float>(g);
    // shard group r = {r*G + s'}: sum = G*r*G + G(G-1)/2
    at::Tensor ts = at::full({6}, gf);  // 24 bytes
    mesh->shard().allreduce(ts, Reduction::Sum, "shard sum").wait();
    expect_tensor_eq(ts, at::full({6}, static_cast<float>(G * r * G + G * (G - 1) / 2)), "shard sum");
    // replicate group s = {r'*G + s}: sum = G R(R-1)/2 + R s
    at::Tensor tr = at::full({6}, gf);
    rep.allreduce(tr, Reduction::Sum, "replicate sum").wait();
    expect_tensor_eq(tr, at::full({6}, static_cast<float>(G * R * (R - 1) / 2 + R * s)), "replicate sum");
    // world: n(n-1)/2
    at::Tensor tw = at::full({6}, gf);
    mesh->world().allreduce(tw, Reduction::Sum, "world sum").wait();
    expect_tensor_eq(tw, at::full({6}, static_cast<float>(n * (n - 1) / 2)), "world sum");
    // broadcast on the replicate group from group rank R-1 (global (R-1)*G + s)
    at::Tensor tb = at::full({6}, gf);
    rep.broadcast(tb, R - 1, "replicate bcast").wait();
    expect_tensor_eq(tb, at::full({6}, static_cast<float>((R - 1) * G + s)), "replicate broadcast");
    // reduce (avg) on the shard group to group rank G-1: mean of r*G + s' = r*G + (G-1)/2
    at::Tensor tv = at::full({6}, gf);
    shard.reduce(tv, G - 1, Reduction::Avg, "shard reduce").wait();
    if (s == G - 1) expect_tensor_eq(tv, at::full({6}, static_cast<float>(r * G + (G - 1) / 2.0)), "shard avg");

    // counters: one mesh-wide set
    EXPECT_EQ(mesh->counters().bytes(CommOp::AllReduce),
              allreduce_bytes(G, 24) + allreduce_bytes(R, 24) + allreduce_bytes(n, 24));
    EXPECT_EQ(mesh->counters().calls(CommOp::AllReduce), (G > 1) + (R > 1) + (n > 1));
    EXPECT_EQ(mesh->counters().bytes(CommOp::Broadcast), (R > 1 && r != R - 1) ? 24 : 0);
    EXPECT_EQ(mesh->counters().calls(CommOp::Broadcast), R > 1 ? 1 : 0);
    EXPECT_EQ(mesh->counters().bytes(CommOp::Reduce), (G > 1 && s != G - 1) ? 24 : 0);
    EXPECT_EQ(mesh->counters().calls(CommOp::Reduce), G > 1 ? 1 : 0);
  });
}

TEST(MeshTest, TwoDMesh2x2) { check_2d_mesh(2, 2); }
TEST(MeshTest, TwoDMesh3x2) { check_2d_mesh(3, 2); }
TEST(MeshTest, TwoDMesh2x3) { check_2d_mesh(2, 3); }
TEST(MeshTest, TwoDMesh4x1) { check_2d_mesh(4, 1); }

// world = R x G x T, TP innermost: global = (replicate * G + shard) * T + tp.
void check_3d_mesh(int R, int G, int T) {
  const int n = R * G * T;
  SCOPED_TRACE("R=" + std::to_string(R) + " G=" + std::to_string(G) + " T=" + std::to_string(T));
  testing::run_ranks(n, [&](testing::RankContext& ctx) {
    MeshOptions mo;
    mo.store = ctx.store;
    mo.factory = process_group_factory(c10::DeviceType::CPU);
    mo.replicate_size = R;
    mo.tp_size = T;
    mo.timeout = 60s;
    auto mesh = Mesh::create(ctx.pg, mo);
    const int g = ctx.rank, t = g % T, r = g / T / G, s = (g / T) % G;
    EXPECT_EQ(mesh->world_size(), n);
    EXPECT_EQ(mesh->shard_size(), G);
    EXPECT_EQ(mesh->replicate_size(), R);
    EXPECT_EQ(mesh->tp_size(), T);
    EXPECT_EQ(mesh->has_tp(), T > 1);
    EXPECT_EQ(mesh->data_parallel_size(), R * G);
    EXPECT_EQ(mesh->shard_rank(), s);
    EXPECT_EQ(mesh->replicate_rank(), r);
    EXPECT_EQ(mesh->tp_rank(), t);
    EXPECT_EQ(mesh->global_rank_of(s, r), g);
    for (int rr = 0; rr < R; ++rr)
      for (int ss = 0; ss < G; ++ss) EXPECT_EQ(mesh->global_rank_of(ss, rr), (rr * G + ss) * T + t);
    EXPECT_EQ(mesh->shard().global_ranks(), iota_vec(G, r * G * T + t, T));
    ASSERT_EQ(mesh->tp() != nullptr, T > 1);
    ASSERT_EQ(mesh->replicate() != nullptr, R > 1);
    const float gf = static_cast<float>(g);
    // every group's sum of global ranks, from the closed form of its members
    auto sum_of = [](const std::vector<int>& v) { return static_cast<float>(std::accumulate(v.begin(), v.end(), 0)); };
    at::Tensor ts = at::full({4}, gf);
    mesh->shard().allreduce(ts, Reduction::Sum, "shard sum").wait();
    expect_tensor_eq(ts, at::full({4}, sum_of(iota_vec(G, r * G * T + t, T))), "shard sum");
    if (R > 1) {
      EXPECT_EQ(mesh->replicate()->global_ranks(), iota_vec(R, s * T + t, G * T));
      at::Tensor tr = at::full({4}, gf);
      mesh->replicate()->allreduce(tr, Reduction::Sum, "replicate sum").wait();
      expect_tensor_eq(tr, at::full({4}, sum_of(iota_vec(R, s * T + t, G * T))), "replicate sum");
    }
    if (T > 1) {
      const int base = (r * G + s) * T;
      EXPECT_EQ(mesh->tp()->global_ranks(), iota_vec(T, base, 1));
      EXPECT_EQ(mesh->tp()->name(), "dmuon/tp" + std::to_string(r * G + s));
      at::Tensor tt = at::full({4}, gf);
      mesh->tp()->allreduce(tt, Reduction::Sum, "tp sum").wait();
      expect_tensor_eq(tt, at::full({4}, sum_of(iota_vec(T, base, 1))), "tp sum");
      // a broadcast over TP from its last rank reaches exactly the TP group
      at::Tensor tb = at::full({4}, gf);
      mesh->tp()->broadcast(tb, T - 1, "tp bcast").wait();
      expect_tensor_eq(tb, at::full({4}, static_cast<float>(base + T - 1)), "tp broadcast");
    }
    at::Tensor tw = at::full({4}, gf);
    mesh->world().allreduce(tw, Reduction::Sum, "world sum").wait();
    expect_tensor_eq(tw, at::full({4}, static_cast<float>(n * (n - 1) / 2)), "world sum");
  });
}

TEST(MeshTest, ThreeDMesh1x2x2) { check_3d_mesh(1, 2, 2); }
TEST(MeshTest, ThreeDMesh2x2x2) { check_3d_mesh(2, 2, 2); }
TEST(MeshTest, ThreeDMesh1x3x2) { check_3d_mesh(1, 3, 2); }
TEST(MeshTest, ThreeDMesh2x1x3) { check_3d_mesh(2, 1, 3); }

TEST(MeshTest, TpSizeMustDivideWorld) {
  testing::run_ranks(4, [&](testing::RankContext& ctx) {
    for (int T : {3, 0, 8}) {
      MeshOptions mo;
      mo.store = ctx.store;
      mo.factory = process_group_factory(c10::DeviceType::CPU);
      mo.tp_size = T;
      const std::string err = error_of([&] { Mesh::create(ctx.pg, mo); });
      EXPECT_NE(err.find("rank " + std::to_string(ctx.rank) + ": tp_size " + std::to_string(T) +
                         " does not divide the world size 4"),
                std::string::npos)
          << "T=" << T << ": " << err;
    }
    MeshOptions mo;
    mo.store = ctx.store;
    mo.factory = process_group_factory(c10::DeviceType::CPU);
    mo.tp_size = 2;
    mo.replicate_size = 4;  // 4 x 2 > 4 ranks
    const std::string err = error_of([&] { Mesh::create(ctx.pg, mo); });
    EXPECT_NE(err.find("replicate size 4 does not divide the world size 4 over the tp_size"), std::string::npos)
        << err;
  });
}

TEST(MeshTest, TwoDMeshClosedFormCounters3x2) {
  // Spot values of the per-rank bytes in check_2d_mesh for R=3, G=2 (n=6), S=24 bytes:
  // shard all-reduce 2*1/2*24 = 24, replicate 2*2/3*24 = 32, world 2*5/6*24 = 40.
  EXPECT_EQ(allreduce_bytes(2, 24), 24);
  EXPECT_EQ(allreduce_bytes(3, 24), 32);
  EXPECT_EQ(allreduce_bytes(6, 24), 40);
  EXPECT_EQ(gather_bytes(4, 128), 96);
}

TEST(MeshTest, TwoMeshesOverOneStore) {
  testing::run_ranks(4, [&](testing::RankContext& ctx) {
    auto a = make_isolated_mesh(ctx, 1);
    auto b = make_isolated_mesh(ctx, 2);
    // every rank counted two generations for the default tag
    EXPECT_EQ(ctx.store->add("dmuon/mesh_generation/rank" + std::to_string(ctx.rank), 0), 2);
    EXPECT_NE(a->shard().process_group().get(), b->shard().process_group().get());
    EXPECT_NE(a->world().process_group().get(), b->world().process_group().get());
    EXPECT_NE(&a->counters(), &b->counters());
    // both in flight at once, waited in the opposite order
    at::Tensor ta = at::full({4}, static_cast<float>(ctx.rank));
    at::Tensor tb = at::full({4}, static_cast<float>(10 * ctx.rank));
    Pending pa = a->shard().allreduce(ta, Reduction::Sum, "mesh a");
    Pending pb = b->shard().allreduce(tb, Reduction::Sum, "mesh b");
    pb.wait();
    pa.wait();
    expect_tensor_eq(ta, at::full({4}, 6.0f), "mesh a (1-D) sum of 0..3");
    // mesh b shard group r = {2r, 2r+1}: 10 * (4r + 1)
    const int r = ctx.rank / 2;
    expect_tensor_eq(tb, at::full({4}, static_cast<float>(10 * (4 * r + 1))), "mesh b (2x2) shard sum");
    EXPECT_EQ(a->counters().calls(CommOp::AllReduce), 1);
    EXPECT_EQ(b->counters().calls(CommOp::AllReduce), 1);
    EXPECT_EQ(a->counters().bytes(CommOp::AllReduce), 24);  // 2*3/4*16
    EXPECT_EQ(b->counters().bytes(CommOp::AllReduce), 16);  // 2*1/2*16
  });
}

// Ranks 0 and 1 all-reduce on the mesh's shard group, rank 2 never joins: both fail within the
// 2 s mesh timeout with their own rank in the message.
TEST(MeshTest, CollectiveAPeerNeverJoinsFailsWithinMeshTimeout) {
  std::mutex mu;
  std::map<int, std::string> errors;
  std::map<int, double> elapsed;
  std::atomic<int> done{0};
  testing::run_ranks(3, [&](testing::RankContext& ctx) {
    auto mesh = make_isolated_mesh(ctx, 1, 2000ms);
    if (ctx.rank == 2) {
      const auto t0 = Clock::now();
      while (done.load() < 2 && Clock::now() - t0 < 60s) std::this_thread::sleep_for(10ms);
      return;
    }
    at::Tensor t = at::ones({16});
    const auto t0 = Clock::now();
    std::string err = error_of([&] { mesh->shard().allreduce(t, Reduction::Avg, "grads of layers.0").wait(); });
    std::lock_guard<std::mutex> g(mu);
    errors[ctx.rank] = err;
    elapsed[ctx.rank] = std::chrono::duration<double>(Clock::now() - t0).count();
    done.fetch_add(1);
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& [rank, err] : errors) {
    EXPECT_NE(err.find("rank " + std::to_string(rank) +
                       ": collective failed on dmuon group 'dmuon/shard' (3 ranks): all_reduce (grads of layers.0)"),
              std::string::npos)
        << err;
    EXPECT_NE(err.find("the wait limit is 2000 ms"), std::string::npos) << err;
    EXPECT_LT(elapsed[rank], 15.0) << "rank " << rank;
  }
}

// ============================== Bootstrap =============================================================

class BootstrapTest : public ::testing::Test {
 protected:
  // Every launch variable unset for the test; the previous values come back afterwards.
  EnvGuard rank_{"RANK", std::nullopt};
  EnvGuard world_{"WORLD_SIZE", std::nullopt};
  EnvGuard local_{"LOCAL_RANK", std::nullopt};
  EnvGuard addr_{"MASTER_ADDR", std::nullopt};
  EnvGuard port_{"MASTER_PORT", std::nullopt};
  EnvGuard agent_{"TORCHELASTIC_USE_AGENT_STORE", std::nullopt};
  EnvGuard restarts_{"TORCHELASTIC_RESTART_COUNT", std::nullopt};

  std::string invalid_argument_of() {
    try {
      LaunchEnv::from_environment();
    } catch (const std::invalid_argument& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("wrong exception type: ") + e.what();
    }
    return "no exception";
  }
};

TEST_F(BootstrapTest, UnsetEnvironmentIsNullopt) { EXPECT_FALSE(LaunchEnv::from_environment().has_value()); }

TEST_F(BootstrapTest, ValidEnvironment) {
  rank_.set("2");
  world_.set("4");
  auto e = LaunchEnv::from_environment();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->rank, 2);
  EXPECT_EQ(e->world_size, 4);
  EXPECT_EQ(e->local_rank, 2);  // defaults to RANK
  EXPECT_EQ(e->master_addr, "127.0.0.1");
  EXPECT_EQ(e->master_port, 29500);
  local_.set("1");
  addr_.set("10.1.2.3");
  port_.set("1234");
  e = LaunchEnv::from_environment();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->master_addr, "10.1.2.3");
  EXPECT_EQ(e->master_port, 1234);
  port_.set("65535");
  EXPECT_EQ(LaunchEnv::from_environment()->master_port, 65535);
  port_.set("1");
  EXPECT_EQ(LaunchEnv::from_environment()->master_port, 1);
}

// torchrun's agent serves the store: every rank (rank 0 too) connects as a client and works under
// "/worker/attempt_<restart count>", so keys written there by torch.distributed-style code are shared.
TEST_F(BootstrapTest, TorchrunAgentStoreIsUsedUnderTheAttemptPrefix) {
  const int port = [] {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    socklen_t len = sizeof(a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ::close(fd);
    return static_cast<int>(ntohs(a.sin_port));
  }();
  // the "agent": a TCPStore server of its own
  StorePtr agent = make_tcp_store("127.0.0.1", port, 0, 1, std::chrono::seconds(10));
  rank_.set("0");
  world_.set("2");
  port_.set(std::to_string(port));
  agent_.set("True");
  restarts_.set("3");
  const auto env = LaunchEnv::from_environment();
  ASSERT_TRUE(env.has_value());
  EXPECT_TRUE(env->agent_store);
  EXPECT_EQ(env->restart_count, 3);
  StorePtr mine = make_launch_store(*env, std::chrono::seconds(10));  // rank 0 does not serve: port is taken
  mine->set("k", std::vector<uint8_t>{7});
  EXPECT_EQ(agent->get("/worker/attempt_3/k"), std::vector<uint8_t>{7});
  restarts_.set("x");
  EXPECT_NE(invalid_argument_of().find("TORCHELASTIC_RESTART_COUNT='x' is not an integer"), std::string::npos);
}

TEST_F(BootstrapTest, RankWithoutWorldSize) {
  rank_.set("0");
  std::string err = invalid_argument_of();
  EXPECT_NE(err.find("RANK and WORLD_SIZE must be set together"), std::string::npos) << err;
  EXPECT_NE(err.find("WORLD_SIZE=''"), std::string::npos) << err;
  rank_.set(std::nullopt);
  world_.set("2");
  err = invalid_argument_of();
  EXPECT_NE(err.find("RANK and WORLD_SIZE must be set together"), std::string::npos) << err;
  EXPECT_NE(err.find("RANK=''"), std::string::npos) << err;
}

TEST_F(BootstrapTest, NonNumericValues) {
  world_.set("2");
  rank_.set("abc");
  std::string err = invalid_argument_of();
  EXPECT_NE(err.find("RANK='abc' is not an integer"), std::string::npos) << err;
  rank_.set("1x");
  err = invalid_argument_of();
  EXPECT_NE(err.find("RANK='1x' is not an integer"), std::string::npos) << err;
  rank_.set("0");
  world_.set("2.5");
  err = invalid_argument_of();
  EXPECT_NE(err.find("WORLD_SIZE='2.5' is not an integer"), std::string::npos) << err;
  world_.set("99999999999999999999");
  err = invalid_argument_of();
  EXPECT_NE(err.find("WORLD_SIZE='99999999999999999999' is not an integer"), std::string::npos) << err;
  world_.set("2");
  local_.set("zero");
  err = invalid_argument_of();
  EXPECT_NE(err.find("LOCAL_RANK='zero' is not an integer"), std::string::npos) << err;
}

TEST_F(BootstrapTest, RankOutOfRange) {
  world_.set("2");
  rank_.set("2");
  std::string err = invalid_argument_of();
  EXPECT_NE(err.find("RANK=2 is outside [0, WORLD_SIZE=2)"), std::string::npos) << err;
  rank_.set("-1");
  err = invalid_argument_of();
  EXPECT_NE(err.find("RANK=-1 is outside [0, WORLD_SIZE=2)"), std::string::npos) << err;
  rank_.set("0");
  world_.set("0");
  err = invalid_argument_of();
  EXPECT_NE(err.find("WORLD_SIZE=0 must be >= 1"), std::string::npos) << err;
}

TEST_F(BootstrapTest, BadPort) {
  rank_.set("0");
  world_.set("1");
  for (const std::string& p : std::vector<std::string>{"0", "65536", "-5"}) {
    port_.set(p);
    const std::string err = invalid_argument_of();
    EXPECT_NE(err.find("MASTER_PORT=" + p + " is outside [1, 65535]"), std::string::npos) << err;
  }
  port_.set("http");
  const std::string err = invalid_argument_of();
  EXPECT_NE(err.find("MASTER_PORT='http' is not an integer"), std::string::npos) << err;
}

// A malformed DMUON_CPU_BACKEND is this rank's own mistake, said before any connection: not a setup failure
// after the --timeout wait for peers that are not there (here rank 0 of 2 with no rank 1 and a 60 s budget).
TEST_F(BootstrapTest, AMalformedCpuBackendIsRefusedBeforeConnecting) {
  EnvGuard backend("DMUON_CPU_BACKEND", "bogus");
  rank_.set("0");
  world_.set("2");
  addr_.set("127.0.0.1");
  port_.set("1");  // never reached
  std::string err;
  try {
    bootstrap_from_environment(c10::DeviceType::CPU, 60s);
  } catch (const c10::ValueError& e) {
    err = e.what_without_backtrace();
  } catch (const std::exception& e) {
    err = std::string("wrong exception type: ") + e.what();
  }
  EXPECT_EQ(err.rfind("rank 0: DMUON_CPU_BACKEND='bogus' is not a CPU backend; use \"gloo\" or \"store\"", 0), 0u)
      << err;
  world_.set(std::nullopt);  // a single-process world: the same
  rank_.set(std::nullopt);
  err.clear();
  try {
    bootstrap_from_environment(c10::DeviceType::CPU, 60s);
  } catch (const c10::ValueError& e) {
    err = e.what_without_backtrace();
  }
  EXPECT_NE(err.find("DMUON_CPU_BACKEND='bogus' is not a CPU backend"), std::string::npos) << err;
}

TEST_F(BootstrapTest, SingleProcessWorldWhenEnvironmentIsUnset) {
  // A single-process world keeps its store in memory: nothing is left under the temp dir (a run used
  // to leave a FileStore directory there, one per run).
  const std::string tmp = testing::fresh_temp_dir("dmuon-boot");
  {
    EnvGuard tmpdir("TMPDIR", tmp);
    Bootstrap b = bootstrap_from_environment(c10::DeviceType::CPU, 30s);
    EXPECT_EQ(b.rank, 0);
    EXPECT_EQ(b.world_size, 1);
    EXPECT_EQ(b.local_rank, 0);
    ASSERT_TRUE(b.store);
    ASSERT_TRUE(b.world);
    EXPECT_EQ(b.world->getSize(), 1);
    EXPECT_EQ(b.world->getRank(), 0);
    MeshOptions mo;
    mo.store = b.store;
    mo.factory = process_group_factory(c10::DeviceType::CPU);
    auto mesh = Mesh::create(b.world, mo);
    EXPECT_EQ(mesh->shard_size(), 1);
    at::Tensor t = at::full({2}, 5.0f);
    mesh->shard().allreduce(t, Reduction::Avg, "single").wait();
    expect_tensor_eq(t, at::full({2}, 5.0f), "world-1 all-reduce");
    EXPECT_EQ(mesh->counters().total_bytes(), 0);
    EXPECT_TRUE(std::filesystem::is_empty(tmp));
  }
  std::error_code ec;
  std::filesystem::remove_all(tmp, ec);
}

// dmuon's store backend (CPU groups where LibTorch has no Gloo): rank-order sums give every rank the
// same bits; broadcast, reduce, all-gather, reduce-scatter, scatter and barrier move the right data;
// a peer that never arrives is an error after the timeout, not a hang.
// Every collective dmuon uses, on 3 ranks (threads), exact; then rank 2 leaves and the next
// collective fails on the others within the backend's 5 s timeout. `make(store, rank, size)`
// creates the backend under test.
void check_backend_collectives(const std::string& name,
                               const std::function<CommPtr(const StorePtr&, int, int)>& make) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  constexpr int n = 3;
  std::vector<at::Tensor> sums(n);
  std::vector<std::string> errors(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        CommPtr pg = make(store, r, n);
        EXPECT_EQ(pg->getBackendName(), name);
        at::Tensor x = at::randn({1000}, at::TensorOptions().dtype(at::kFloat)).mul_(1e3 * (r + 1));
        std::vector<at::Tensor> v{x};
        pg->allreduce(v)->wait();
        sums[r] = x;
        at::Tensor b = at::full({4}, static_cast<double>(r));
        std::vector<at::Tensor> bv{b};
        c10d::BroadcastOptions bo;
        bo.rootRank = 2;
        pg->broadcast(bv, bo)->wait();
        EXPECT_TRUE(b.equal(at::full({4}, 2.0))) << "broadcast on rank " << r;
        at::Tensor red = at::full({2}, static_cast<double>(r + 1));
        std::vector<at::Tensor> rv{red};
        c10d::ReduceOptions ro;
        ro.rootRank = 1;
        pg->reduce(rv, ro)->wait();
        if (r == 1) {
          EXPECT_TRUE(red.equal(at::full({2}, 6.0)));
        }
        at::Tensor in = at::arange(3 * 2, at::kFloat) + 10.0 * r, out = at::empty({2});
        c10d::ReduceScatterOptions rso;
        rso.reduceOp = c10d::ReduceOp::AVG;
        pg->_reduce_scatter_base(out, in, rso)->wait();
        EXPECT_TRUE(out.allclose(at::arange(2 * r, 2 * r + 2, at::kFloat) + 10.0)) << "reduce-scatter on rank " << r;
        at::Tensor mine = at::full({2}, static_cast<double>(r)), all = at::empty({2 * n});
        pg->_allgather_base(all, mine)->wait();
        EXPECT_TRUE(all.equal(at::tensor({0., 0., 1., 1., 2., 2.}, at::kFloat))) << "all-gather on rank " << r;
        std::vector<at::Tensor> so{at::empty({2})};
        std::vector<std::vector<at::Tensor>> si;
        if (r == 0) si = {{at::full({2}, 5.0), at::full({2}, 6.0), at::full({2}, 7.0)}};
        pg->scatter(so, si)->wait();
        EXPECT_TRUE(so[0].equal(at::full({2}, 5.0 + r))) << "scatter on rank " << r;
        std::vector<at::Tensor> gi{at::full({2}, 1.0 + r)};
        std::vector<std::vector<at::Tensor>> go;
        if (r == 1) go = {{at::zeros({2}), at::zeros({2}), at::zeros({2})}};
        c10d::GatherOptions gopt;
        gopt.rootRank = 1;
        pg->gather(go, gi, gopt)->wait();
        if (r == 1) {
          for (int i = 0; i < n; ++i) {
            EXPECT_TRUE(go[0][static_cast<size_t>(i)].equal(at::full({2}, 1.0 + i))) << "gather " << i;
          }
        }
        pg->barrier()->wait();
        if (r == 2) return;  // rank 2 leaves: the next collective cannot complete
        std::vector<at::Tensor> w{at::ones({1})};
        pg->allreduce(w)->wait();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 1; r < n; ++r) EXPECT_TRUE(sums[r].equal(sums[0])) << "rank " << r << " summed other bits";
  EXPECT_TRUE(errors[2].empty()) << errors[2];
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(errors[r].empty()) << "rank " << r << " did not time out";
  for (int r = 0; r < 2; ++r) EXPECT_NE(errors[r].find("2"), std::string::npos) << "names the lost rank: " << errors[r];
}

TEST(StoreBackendTest, CollectivesAreExactAndALostPeerTimesOut) {
  check_backend_collectives("dmuon-store", [](const StorePtr& store, int r, int n) {
    return make_store_process_group(store, r, n, std::chrono::seconds(5));
  });
}

TEST(LoopbackBackendTest, CollectivesAreExactAndALostPeerTimesOut) {
  check_backend_collectives("dmuon-loopback", [](const StorePtr& store, int r, int n) {
    return make_loopback_process_group(store, r, n, LoopbackOptions{}, std::chrono::seconds(5));
  });
}

// The loopback backend on the CPU refuses tensors of another device, and ranks that issue different
// collectives get an error naming both, not a hang or a silent copy.
TEST(LoopbackBackendTest, RefusesOtherDevicesAndMismatchedCollectives) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    std::vector<at::Tensor> meta{at::empty({4}, at::TensorOptions().device(at::kMeta))};
    const std::string dev = error_of([&] { ctx.pg->allreduce(meta); });
    testing::expect(dev.find("CPU tensors only") != std::string::npos, "device refusal: " + dev);
    std::vector<at::Tensor> t{at::ones({ctx.rank == 0 ? 4 : 5})};
    const std::string mis = error_of([&] { ctx.pg->allreduce(t)->wait(); });
    testing::expect(mis.find("rank 0 sends 4 elements, rank 1 sends 5") != std::string::npos, "mismatch: " + mis);
  }, 60s, LoopbackOptions{});
}

// Every collective checks its tensors against the group's device before anything else, on a group
// of one too (so one GPU, or a CPU test, catches what would crash a multi-GPU NCCL run).
TEST(CommunicatorTest, WrongDeviceTensorIsAnErrorEvenOnAGroupOfOne) {
  for (int n : {1, 2}) {
    testing::run_ranks(n, [&](testing::RankContext& ctx) {
      auto comm = make_comm(ctx);
      testing::expect(comm->device() == at::Device(at::kCPU), "a CPU group carries CPU tensors");
      const at::Tensor meta = at::empty({4}, at::TensorOptions().device(at::kMeta));
      const at::Tensor cpu = at::zeros({4 * ctx.world});
      for (const std::string& err : {error_of([&] { comm->broadcast(meta, 0, "the flags"); }),
                                     error_of([&] { comm->reduce(meta, 0, Reduction::Sum, "the flags"); }),
                                     error_of([&] { comm->allreduce(meta, Reduction::Sum, "the flags"); }),
                                     error_of([&] { comm->allgather_flat(cpu, meta, "the flags"); })}) {
        testing::expect(err.find("rank " + std::to_string(ctx.rank)) != std::string::npos &&
                            err.find("(the flags) on dmuon group 'test'") != std::string::npos &&
                            err.find("is on meta but this group carries cpu tensors") != std::string::npos,
                        "wrong-device message: " + err);
      }
      testing::expect(comm->counters().total_bytes() == 0, "nothing was counted");
    });
  }
}

// DMUON_FORCE_COLLECTIVES=1: a group of one issues real collectives (what lets one GPU run NCCL's
// multi-rank code), with the results a group of one has, and still counts no bytes.
TEST(CommunicatorTest, ForcedCollectivesOnAGroupOfOneAreIssued) {
  EnvGuard force("DMUON_FORCE_COLLECTIVES", "1");
  testing::run_ranks(1, [&](testing::RankContext& ctx) {
    auto comm = make_comm(ctx);
    testing::expect(!comm->local_only(), "a forced group of one is not local-only");
    at::Tensor t = at::arange(5, at::kFloat) + 3;
    const at::Tensor orig = t.clone();
    Pending p = comm->broadcast(t, 0, "b");
    testing::expect(p.defined(), "broadcast issued");
    p.wait_host();
    comm->allreduce(t, Reduction::Avg, "a").wait();
    comm->reduce(t, 0, Reduction::Avg, "r").wait();
    at::Tensor out = at::zeros({5});
    comm->allgather_flat(out, t, "g").wait();
    comm->barrier("b");
    testing::expect(at::equal(t, orig) && at::equal(out, orig), "a group of one keeps its values");
    testing::expect(comm->counters().calls(CommOp::Broadcast) == 1 && comm->counters().calls(CommOp::AllGather) == 1 &&
                        comm->counters().calls(CommOp::Barrier) == 1,
                    "the collectives were counted as calls");
    testing::expect(comm->counters().total_bytes() == 0, "a group of one moves no bytes");
  });
}

TEST(MeshTest, ZeroTimeoutIsRefusedNotNoTimeout) {
  testing::run_ranks(1, [&](testing::RankContext& ctx) {
    MeshOptions mo;
    mo.process_group_policy = "shared";
    mo.timeout = std::chrono::milliseconds(0);
    const std::string err = error_of([&] { Mesh::create(ctx.pg, mo); });
    testing::expect(err.find("MeshOptions::timeout is 0 ms; it must be > 0") != std::string::npos, err);
    const std::string c = error_of([&] { make_comm(ctx, nullptr, std::chrono::milliseconds(0)); });
    testing::expect(c.find("the collective timeout is 0 ms; it must be > 0") != std::string::npos, c);
  });
}

// A mesh carries its world's device (CPU here) and hands out options on it; shutdown is a barrier
// and then the groups' teardown, once.
TEST(MeshTest, DeviceAndShutdown) {
  testing::run_ranks(2, [&](testing::RankContext& ctx) {
    auto mesh = make_isolated_mesh(ctx);
    testing::expect(mesh->device() == at::Device(at::kCPU) && mesh->options(at::kLong).device().is_cpu(),
                    "the mesh's device");
    mesh->counters().reset();
    mesh->shutdown();
    mesh->shutdown();  // idempotent
    testing::expect(mesh->counters().calls(CommOp::Barrier) == 1, "one barrier at shutdown");
  });
}

TEST_F(BootstrapTest, BackendAvailability) {
  EXPECT_TRUE(process_group_available(c10::DeviceType::CPU));
  EXPECT_FALSE(process_group_available(c10::DeviceType::Meta));
  const std::string dir = testing::fresh_temp_dir("dmuon-boot");
  auto store = make_file_store(dir + "/store", 1);
  const std::string err = error_of([&] { make_process_group(store, 0, 1, c10::DeviceType::Meta); });
  EXPECT_NE(err.find("rank 0: no process group for device type"), std::string::npos) << err;
  if (!process_group_available(c10::DeviceType::CUDA)) {
    const std::string cuda_err = error_of([&] { make_process_group(store, 0, 1, c10::DeviceType::CUDA); });
    EXPECT_NE(cuda_err.find("this dmuon build has no NCCL"), std::string::npos) << cuda_err;
  }
  // a factory-built group of one works
  CommPtr pg = process_group_factory(c10::DeviceType::CPU)(store, 0, 1, 30s);
  ASSERT_TRUE(pg);
  EXPECT_EQ(pg->getSize(), 1);
  EXPECT_EQ(pg->getBackendName(), gloo_in_use() ? "gloo" : "dmuon-store");
  pg.reset();
  store.reset();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace dmuon
