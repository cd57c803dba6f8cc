// mesh.h -- the device mesh dmuon runs on: a shard axis of G ranks, optionally a replicate axis of
// R groups (HSDP) and a tensor-parallel axis of T ranks (innermost: adjacent ranks share a TP
// group), built from one world group. world = R x G x T.
//
//   global rank = (replicate_rank * G + shard_rank) * T + tp_rank
//   shard group (r, t)     = { (r*G + s)*T + t : s in [0, G) }  (broadcasts, reduces, sharded AdamW)
//   replicate group (s, t) = { (r*G + s)*T + t : r in [0, R) }  (HSDP stage-2 reduce, post-step publish)
//   tp group (r, s)        = { (r*G + s)*T + t : t in [0, T) }  (tensor parallelism)
//   dp group (t)           = { (r*G + s)*T + t : r, s }          (replicated parameters; the world when T = 1)
//
// With T = 1 (the default) this is the 2-D / 1-D mesh: global rank = replicate_rank * G + shard_rank.
//
// Process-group policy: "isolated" (default; env DMUON_PROCESS_GROUP_POLICY) builds dmuon's own
// groups over a PrefixStore so the trainer's own collectives on the world group can never interleave
// with dmuon's asynchronous ones; "shared" uses the caller's world group directly (1-D only, or
// for the world axis). Every rank must create its meshes in the same order.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/communicator.h"
#include "dmuon/process_group.h"

namespace dmuon {

// Creates a concrete group of `size` ranks over `store` (see bootstrap.h for Gloo/NCCL ones).
using ProcessGroupFactory =
    std::function<CommPtr(const StorePtr& store, int rank, int size, std::chrono::milliseconds timeout)>;

struct MeshOptions {
  // "isolated": every group is dmuon's own (a clone of the world and the axes' groups), so the
  // caller's collectives (logging, metrics, checkpoints) never interleave with dmuon's asynchronous
  // ones on one communicator. "shared": dmuon runs on the caller's `world` group; on a 1-D mesh that
  // is every group, on a 2-D or TP mesh the world collectives (fingerprints, agreements, barriers)
  // while the axes' groups, which the caller did not give, are built (pass them to
  // Mesh::from_groups to share those too). "" = DMUON_PROCESS_GROUP_POLICY, else "isolated".
  std::string process_group_policy;
  StorePtr store;                    // required for "isolated" and for R > 1 or T > 1
  ProcessGroupFactory factory;       // required for "isolated" and for R > 1 or T > 1
  // HSDP: the replicate groups' factory (unset: `factory`). The CLI gives them normal-priority NCCL
  // streams (the post-step publish overlaps the next forward), the world/shard groups high-priority
  // ones (broadcasts and reduces sit on the critical path).
  ProcessGroupFactory replicate_factory;
  int replicate_size = 1;            // R; world size must be a multiple of R x T
  int tp_size = 1;                   // T: tensor-parallel ranks per group (innermost axis)
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;  // > 0: there is no "no timeout"
  std::string tag = "dmuon";         // PrefixStore namespace of dmuon's groups
  // Where the mesh's tensors live (every collective's tensors, every small exchange dmuon makes).
  // Unset: the world group's (its bound device on LibTorch 2.x, the current CUDA device for NCCL,
  // else the CPU).
  std::optional<at::Device> device;
};

// A process group the caller made, with the world-group ranks of its members in group-rank order.
struct MeshGroup {
  CommPtr group;
  std::vector<int> ranks;
};
// The groups of a mesh the caller built (e.g. torch.distributed groups of a DeviceMesh): this rank's
// own group of each axis. Ranks are numbered as Mesh::create numbers them (replicate-major, TP
// innermost: world rank = (replicate_rank x G + shard_rank) x T + tp_rank, what
// init_device_mesh((R, G, T)) gives; T = 1 without tensor parallelism).
struct MeshGroups {
  MeshGroup world;                     // every rank of the mesh
  MeshGroup shard;                     // this rank's shard group (on a 1-D mesh: the world again)
  std::optional<MeshGroup> replicate;  // HSDP: this rank's replicate group
  std::optional<MeshGroup> tp;         // tensor parallelism: this rank's TP group (T contiguous ranks)
  std::optional<MeshGroup> dp;         // with tp: the R x G ranks at this rank's TP position (data parallel)
};

class Mesh {
 public:
  // collective: all ranks of `world`, same order (builds and connects dmuon's groups).
  static std::shared_ptr<Mesh> create(const CommPtr& world, const MeshOptions& opts = {});
  // A mesh over groups the caller built and keeps (it shuts them down, not Mesh::shutdown). Uses
  // opts.timeout, opts.device and opts.process_group_policy (reported by policy(); the caller chose
  // or cloned the groups accordingly). Checks the groups' sizes and rank layout, naming the first
  // mismatch. collective: every rank of `groups.world` (a barrier once every rank has its mesh).
  static std::shared_ptr<Mesh> from_groups(const MeshGroups& groups, const MeshOptions& opts = {});

  int global_rank() const { return global_rank_; }
  int world_size() const { return world_size_; }
  int shard_rank() const { return shard_->rank(); }
  int shard_size() const { return shard_->size(); }
  int replicate_rank() const { return replicate_ ? replicate_->rank() : 0; }
  int replicate_size() const { return replicate_ ? replicate_->size() : 1; }
  // HSDP: a replicate axis of more than one rank (says nothing about TP: has_tp())
  bool is_hsdp() const { return replicate_size() > 1; }
  int tp_rank() const { return tp_ ? tp_->rank() : 0; }
  int tp_size() const { return tp_ ? tp_->size() : 1; }
  bool has_tp() const { return tp_size() > 1; }
  int data_parallel_size() const { return replicate_size() * shard_size(); }  // R x G
  const std::string& policy() const { return policy_; }

  Communicator& shard() { return *shard_; }
  Communicator* replicate() { return replicate_.get(); }  // null on a 1-D mesh
  Communicator* tp() { return tp_.get(); }                // null without a tensor-parallel axis
  Communicator& world() { return *world_; }
  // The R x G data-parallel ranks of this rank's TP position (the world group when T = 1).
  Communicator& dp() { return dp_ ? *dp_ : *world_; }
  // A second group over this rank's shard group's ranks (same order), for the sharded_adamw all-gathers
  // apart from the dedicated broadcasts (MuonOptions::sharded_adamw_unshard_separate_stream): its own
  // connections (Gloo) or its own stream (NCCL). The caller built it and keeps it (Python: a new_group
  // of the shard group's ranks); `group.ranks` are ranks of the world group, as in MeshGroups. Checks
  // that they are the shard group's. Local; once.
  void set_sharded_unshard_group(const MeshGroup& group);
  bool has_sharded_unshard_group() const { return static_cast<bool>(sharded_unshard_); }
  Communicator& sharded_unshard() { return sharded_unshard_ ? *sharded_unshard_ : *shard_; }
  // HSDP: the post-step publish's own group over this rank's replicate group's ranks (same order), so
  // a large replicate-axis reduce (the stage-2 reduces, sharded_adamw's all-reduces) never sits in
  // front of a publish the next forward waits for: its own connections (Gloo) or stream (NCCL).
  // Mesh::create builds it; over the caller's groups (from_groups) set_replicate_publish_group adds
  // one (the caller builds and keeps it; Python's "isolated" policy does), else the publish shares the
  // replicate group. Checks the ranks like set_sharded_unshard_group. Local; once.
  void set_replicate_publish_group(const MeshGroup& group);
  bool has_replicate_publish_group() const { return static_cast<bool>(replicate_publish_); }
  // The group the HSDP publish runs on (null on a 1-D mesh).
  Communicator* replicate_publish() { return replicate_publish_ ? replicate_publish_.get() : replicate_.get(); }
  CommCounters& counters() { return *counters_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Where this mesh's tensors live; small exchanges (flags, digests, norms) allocate there.
  const at::Device& device() const { return world_->device(); }
  at::TensorOptions options(at::ScalarType dtype) const { return world_->options(dtype); }

  // End of a run, after the last collective: a barrier over the world (the host waits, at most the
  // timeout), then every group's shutdown (NCCL: communicators destroyed cleanly, no watchdog left).
  // collective: all ranks. Call it once every asynchronous publish has been waited
  // (dmuon::wait_all_post_step_broadcasts). Idempotent.
  void shutdown();
  // Error path: aborts every group dmuon built at once (NCCL: ncclCommAbort), so peers stuck in a collective
  // with this rank fail within their own timeout and no watchdog kills this process later. Local.
  void abort();

  // Global rank of slot (shard, replicate) on this rank's TP position.
  int global_rank_of(int shard, int replicate) const {
    return (replicate * shard_size() + shard) * tp_size() + tp_rank();
  }

 private:
  Mesh() = default;
  int global_rank_ = 0;
  int world_size_ = 1;
  std::string policy_;
  std::chrono::milliseconds timeout_{kDefaultCollectiveTimeout};
  std::shared_ptr<CommCounters> counters_;
  std::unique_ptr<Communicator> twin_of(const Communicator& axis, const MeshGroup& group, const char* setter,
                                        const std::string& suffix) const;
  std::unique_ptr<Communicator> world_, shard_, replicate_, tp_, dp_;
  std::unique_ptr<Communicator> sharded_unshard_;  // the caller's (set_sharded_unshard_group)
  std::unique_ptr<Communicator> replicate_publish_;  // HSDP: Mesh::create's, or the caller's
  // The groups Mesh::create built, each once (shutdown/abort end them): none on a 1-D "shared" mesh
  // or over the caller's groups (from_groups), every axis but the caller's world on a "shared" 2-D or
  // TP mesh.
  std::vector<Communicator*> built_;
  bool closed_ = false;
};

}  // namespace dmuon
