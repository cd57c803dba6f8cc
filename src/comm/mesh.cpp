// Mesh construction: dmuon's own groups over a PrefixStore (isolated) or the caller's (shared).
#include "dmuon/mesh.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <numeric>

#include "comm/agreement.h"
#include "comm/error_text.h"
#include "dmuon/digest.h"
#include "dmuon/env.h"

namespace dmuon {

namespace {
std::vector<int> iota_ranks(int n, int start, int stride) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = start + i * stride;
  return v;
}
}  // namespace

std::shared_ptr<Mesh> Mesh::create(const CommPtr& world, const MeshOptions& opts) {
  TORCH_CHECK_VALUE(world,
                    "Mesh::create: the world process group is null. Create one with "
                    "dmuon::make_process_group or dmuon::bootstrap_from_environment first.");
  const int rank = world->getRank(), n = world->getSize();
  std::string policy = opts.process_group_policy;
  if (policy.empty()) policy = env::process_group_policy();
  if (policy.empty()) policy = "isolated";
  const int R = opts.replicate_size, T = opts.tp_size;
  const bool need_groups = policy == "isolated" || R > 1 || T > 1;
  // The checks and the settings that decide which groups each rank builds, agreed by every rank first: a
  // rank refusing alone (its environment's DMUON_PROCESS_GROUP_POLICY, its own options) would leave the
  // others connecting groups it never builds until the timeout.
  detail::AgreementText text;
  text.fn = "Mesh::create";
  text.given = "the mesh's options";
  text.outcome = "no rank builds the mesh";
  text.differs = [](const detail::Disagreement& d) {
    return "the ranks' meshes differ in " + (d.entry ? d.entry->key + " (this rank's: " + d.entry->shown + ")"
                                                       : std::string("their settings")) +
           ": rank(s) " + detail::rank_list(d.ranks) +
           " differ from rank 0. Every rank must create its mesh with the same MeshOptions (process_group_policy, "
           "replicate_size, tp_size; DMUON_PROCESS_GROUP_POLICY where process_group_policy is not set).";
  };
  const auto check = [&] {
    TORCH_CHECK_VALUE(policy == "isolated" || policy == "shared", "rank ", rank, ": unknown process_group_policy '",
                      policy, "' (from ",
                      opts.process_group_policy.empty() ? "DMUON_PROCESS_GROUP_POLICY" : "MeshOptions",
                      "). Use \"isolated\" (dmuon's own groups, the default) or \"shared\" (the caller's group).");
    TORCH_CHECK_VALUE(T >= 1 && n % T == 0, "rank ", rank, ": tp_size ", T, " does not divide the world size ", n,
                      ". A mesh with tensor parallelism needs world = R x G x T; pick T among the divisors of ", n,
                      ".");
    TORCH_CHECK_VALUE(R >= 1 && (n / T) % R == 0, "rank ", rank, ": replicate size ", R,
                      " does not divide the world size ", n, T > 1 ? " over the tp_size" : "",
                      ". An HSDP mesh needs world = R x G", T > 1 ? " x T" : "", "; pick R among the divisors of ",
                      n / T, ".");
    TORCH_CHECK_VALUE(opts.timeout.count() > 0, "rank ", rank, ": MeshOptions::timeout is ", opts.timeout.count(),
                      " ms; it must be > 0. Every collective waits at most this long, so a lost peer is an error "
                      "instead of a hang; there is no \"no timeout\" (the default is ",
                      kDefaultCollectiveTimeout.count(), " ms).");
    TORCH_CHECK_VALUE(!need_groups || (opts.store && opts.factory), "rank ", rank, ": ",
                      (T > 1   ? "a mesh with a tensor-parallel axis"
                       : R > 1 ? "a 2-D (replicate x shard) mesh"
                               : "process_group_policy=\"isolated\""),
                      " builds dmuon's own process groups and needs MeshOptions::store and MeshOptions::factory (see "
                      "dmuon::process_group_factory in bootstrap.h), or use process_group_policy=\"shared\" on a 1-D "
                      "mesh, or pass the caller's groups of every axis to Mesh::from_groups.");
  };
  {
    Communicator agreement(world, opts.tag + "/mesh-setup", iota_ranks(n, 0, 1),
                           opts.timeout.count() > 0 ? opts.timeout : kDefaultCollectiveTimeout, nullptr, opts.device);
    detail::agree(agreement, text, check, [&] {
      return std::vector<detail::AgreedEntry>{
          {"process_group_policy", fnv1a(policy), "\"" + policy + "\""},
          {"replicate_size", static_cast<uint64_t>(R), std::to_string(R)},
          {"tp_size", static_cast<uint64_t>(T), std::to_string(T)}};
    });
  }
  const int G = n / R / T;

  auto mesh = std::shared_ptr<Mesh>(new Mesh());
  mesh->global_rank_ = rank;
  mesh->world_size_ = n;
  mesh->policy_ = policy;
  mesh->timeout_ = opts.timeout;
  mesh->counters_ = std::make_shared<CommCounters>();

  if (!need_groups) {
    mesh->world_ = std::make_unique<Communicator>(world, opts.tag + "/world", iota_ranks(n, 0, 1), opts.timeout,
                                                  mesh->counters_, opts.device);
    mesh->shard_ = std::make_unique<Communicator>(world, opts.tag + "/shard", iota_ranks(n, 0, 1), opts.timeout,
                                                  mesh->counters_, mesh->world_->device());
    return mesh;
  }
  // A generation number per rank and tag keeps the PrefixStore keys of a second mesh (another
  // model) apart from the first; ranks create meshes in the same order, so they agree on it.
  const int64_t gen = opts.store->add(opts.tag + "/mesh_generation/rank" + std::to_string(rank), 1);
  const std::string base = opts.tag + "/g" + std::to_string(gen);
  // every group carries the world's device: the caller's, else the one the world group is bound to
  const std::optional<at::Device> device =
      opts.device ? opts.device
                  : std::optional<at::Device>(
                        Communicator(world, "world", iota_ranks(n, 0, 1), opts.timeout, nullptr).device());
  auto make = [&](const std::string& name, const std::vector<int>& ranks, const ProcessGroupFactory& factory) {
    const int sub = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
    auto store = c10::make_intrusive<c10d::PrefixStore>(base + "/" + name, opts.store);
    CommPtr pg = factory(store, sub, static_cast<int>(ranks.size()), opts.timeout);
#if DMUON_TORCH_AT_LEAST(2, 0)
    if (const auto bound = pg->getBoundDeviceId(); bound && device && *bound != *device)
      TORCH_CHECK_VALUE(false, "rank ", rank, ": the factory bound dmuon group '", name, "' to ", *bound,
                        " but the mesh's "
                        "device is ",
                        *device,
                        ". Make that device current (c10::cuda::set_device) before Mesh::create, or "
                        "leave MeshOptions::device unset.");
#endif
    auto c = std::make_unique<Communicator>(pg, opts.tag + "/" + name, ranks, opts.timeout, mesh->counters_, device);
    mesh->built_.push_back(c.get());
    return c;
  };
  // Same global order on every rank: world, then all shard groups, then all replicate groups (each
  // with its publish twin), then all TP groups, then all data-parallel groups (each rank builds only the groups it
  // belongs to; groups of one kind are disjoint, so no rank waits on a group its peers build later). "shared": the
  // world collectives run on the caller's group; the sub-groups, which the caller did not give (Mesh::from_groups takes
  // them), are built here
  const bool share_world = policy == "shared";
  mesh->world_ = share_world ? std::make_unique<Communicator>(world, opts.tag + "/world", iota_ranks(n, 0, 1),
                                                              opts.timeout, mesh->counters_, device)
                             : make("world", iota_ranks(n, 0, 1), opts.factory);
  const int t = rank % T, rs = rank / T, r = rs / G, s = rs % G;
  if (R == 1 && T == 1) {
    mesh->shard_ = std::make_unique<Communicator>(mesh->world_->process_group(), opts.tag + "/shard",
                                                  iota_ranks(n, 0, 1), opts.timeout, mesh->counters_, device);
  } else {
    const std::string at_t = T > 1 ? "t" + std::to_string(t) : std::string();
    mesh->shard_ = make("shard" + std::to_string(r) + at_t, iota_ranks(G, r * G * T + t, T), opts.factory);
    if (R > 1) {
      const auto& factory = opts.replicate_factory ? opts.replicate_factory : opts.factory;
      const std::string name = "replicate" + std::to_string(s) + at_t;
      const std::vector<int> ranks = iota_ranks(R, s * T + t, G * T);
      mesh->replicate_ = make(name, ranks, factory);
      // the post-step publish apart from the replicate-axis reduces (its own connections or stream)
      mesh->replicate_publish_ = make(name + "/publish", ranks, factory);
    }
    if (T > 1) {
      mesh->tp_ = make("tp" + std::to_string(rs), iota_ranks(T, rs * T, 1), opts.factory);
      mesh->dp_ = make("dp" + std::to_string(t), iota_ranks(R * G, t, T), opts.factory);
    }
  }
  // Every rank has built all of its groups before any rank goes on: a rank that finished first and
  // tore its groups down (an error, a short program) would otherwise close Gloo pairs a peer is
  // still connecting ("Connection closed by peer" on the peer).
  mesh->world_->barrier("mesh setup: every rank built its process groups");
  return mesh;
}

std::shared_ptr<Mesh> Mesh::from_groups(const MeshGroups& g, const MeshOptions& opts) {
  TORCH_CHECK_VALUE(g.world.group && g.shard.group, "Mesh::from_groups: the world and shard groups must be set.");
  const int rank = g.world.group->getRank(), n = g.world.group->getSize();
  TORCH_CHECK_VALUE(opts.timeout.count() > 0, "rank ", rank, ": MeshOptions::timeout is ", opts.timeout.count(),
                    " ms; it must be > 0 (a lost peer is an error after it, never a hang).");
  TORCH_CHECK_VALUE(g.tp.has_value() == g.dp.has_value(), "rank ", rank,
                    ": Mesh::from_groups: a TP mesh needs both "
                    "its tp group and its dp group (the ranks at this rank's TP position); got only the ",
                    g.tp ? "tp" : "dp", " group.");
  const int G = g.shard.group->getSize(), R = g.replicate ? g.replicate->group->getSize() : 1;
  const int T = g.tp ? g.tp->group->getSize() : 1;
  const int s = g.shard.group->getRank(), r = g.replicate ? g.replicate->group->getRank() : 0;
  const int t = g.tp ? g.tp->group->getRank() : 0;
  const std::string layout = T > 1 ? std::to_string(R) + " x " + std::to_string(G) + " x " + std::to_string(T)
                                   : std::to_string(R) + " x " + std::to_string(G);
  const std::string rule = T > 1 ? "(replicate_rank x " + std::to_string(G) + " + shard_rank) x " + std::to_string(T) +
                                       " + tp_rank, as init_device_mesh((R, G, T)) lays ranks out"
                                 : "replicate_rank x " + std::to_string(G) +
                                       " + shard_rank, as init_device_mesh((R, G)) "
                                       "lays ranks out";
  auto check_group = [&](const MeshGroup& m, const char* axis, const std::vector<int>& expected) {
    TORCH_CHECK_VALUE(static_cast<int>(m.ranks.size()) == m.group->getSize(), "rank ", rank, ": the ", axis,
                      " group has ", m.group->getSize(), " ranks but ", m.ranks.size(), " were listed for it.");
    TORCH_CHECK_VALUE(m.ranks == expected, "rank ", rank, ": the ", axis, " group's ranks [",
                      detail::rank_list(m.ranks), "] are not [", detail::rank_list(expected), "], which dmuon's ",
                      layout,
                      " mesh needs: dmuon numbers "
                      "ranks replicate-major (rank = ",
                      rule,
                      "). Build the mesh that way, or pass the groups of such "
                      "a mesh.");
  };
  TORCH_CHECK_VALUE(R * G * T == n, "rank ", rank, ": the shard group (", G, " ranks) times the replicate group (", R,
                    " ranks)", T > 1 ? " times the TP group (" + std::to_string(T) + " ranks)" : std::string(),
                    " is not the world of the mesh (", n, " ranks). Pass the groups of one ",
                    T > 1 ? "(replicate, shard, tp)" : "(replicate, shard)", " mesh.");
  TORCH_CHECK_VALUE(rank == (r * G + s) * T + t, "rank ", rank, ": this rank is shard rank ", s, " and replicate rank ",
                    r, T > 1 ? " and TP rank " + std::to_string(t) : std::string(), " of a ", layout,
                    " mesh, which dmuon's replicate-major layout (rank = ", rule, ") puts at rank ",
                    (r * G + s) * T + t, " of the mesh's world group, not ", rank,
                    ". Pass the axes of such a mesh, not swapped.");
  check_group(g.world, "world", iota_ranks(n, 0, 1));
  check_group(g.shard, "shard", iota_ranks(G, r * G * T + t, T));
  if (g.replicate) check_group(*g.replicate, "replicate", iota_ranks(R, s * T + t, G * T));
  if (g.tp) {
    check_group(*g.tp, "tp", iota_ranks(T, (r * G + s) * T, 1));
    check_group(*g.dp, "dp", iota_ranks(R * G, t, T));
  }

  auto mesh = std::shared_ptr<Mesh>(new Mesh());
  mesh->global_rank_ = rank;
  mesh->world_size_ = n;
  mesh->policy_ = opts.process_group_policy.empty() ? "shared" : opts.process_group_policy;
  mesh->timeout_ = opts.timeout;
  mesh->counters_ = std::make_shared<CommCounters>();
  auto make = [&](const MeshGroup& m, const std::string& name, const std::optional<at::Device>& device) {
    return std::make_unique<Communicator>(m.group, opts.tag + "/" + name, m.ranks, opts.timeout, mesh->counters_,
                                          device);
  };
  mesh->world_ = make(g.world, "world", opts.device);
  const std::optional<at::Device> device = mesh->world_->device();
  const std::string at_t = T > 1 ? "t" + std::to_string(t) : std::string();  // Mesh::create's names
  mesh->shard_ = make(g.shard, "shard" + std::to_string(r) + at_t, device);
  if (g.replicate) mesh->replicate_ = make(*g.replicate, "replicate" + std::to_string(s) + at_t, device);
  if (g.tp) {
    mesh->tp_ = make(*g.tp, "tp" + std::to_string(r * G + s), device);
    mesh->dp_ = make(*g.dp, "dp" + std::to_string(t), device);
  }
  mesh->world_->barrier("mesh setup: every rank has its groups");
  return mesh;
}

// A second group over the ranks of `axis` (same order), given with world-group ranks as in MeshGroups.
std::unique_ptr<Communicator> Mesh::twin_of(const Communicator& axis, const MeshGroup& g, const char* setter,
                                            const std::string& suffix) const {
  TORCH_CHECK_VALUE(g.group, "rank ", global_rank_, ": ", setter, ": the process group is null.");
  std::vector<int> globals;
  for (int r : g.ranks) {
    TORCH_CHECK_VALUE(r >= 0 && r < world_->size(), "rank ", global_rank_, ": ", setter, ": rank ", r,
                      " is not a rank of the mesh's world group (", world_->size(), " ranks).");
    globals.push_back(world_->global_ranks()[static_cast<size_t>(r)]);
  }
  TORCH_CHECK_VALUE(
      globals == axis.global_ranks() && g.group->getSize() == axis.size() && g.group->getRank() == axis.rank(), "rank ",
      global_rank_, ": ", setter, ": the group must hold the ", axis.name(),
      " group's ranks in "
      "its order (",
      axis.size(), " ranks, this one at ", axis.rank(), "); got ", g.group->getSize(), " ranks, this one at ",
      g.group->getRank(), ". Build it over that group's ranks.");
  return std::make_unique<Communicator>(g.group, axis.name() + suffix, globals, timeout_, counters_, world_->device());
}

void Mesh::set_sharded_unshard_group(const MeshGroup& g) {
  TORCH_CHECK_VALUE(!sharded_unshard_, "rank ", global_rank_,
                    ": set_sharded_unshard_group: this mesh has one already.");
  sharded_unshard_ = twin_of(*shard_, g, "set_sharded_unshard_group", "/sharded-unshard");
}

void Mesh::set_replicate_publish_group(const MeshGroup& g) {
  TORCH_CHECK_VALUE(replicate_, "rank ", global_rank_,
                    ": set_replicate_publish_group: this mesh has no replicate "
                    "axis (a 1-D mesh publishes nothing over one).");
  TORCH_CHECK_VALUE(!replicate_publish_, "rank ", global_rank_,
                    ": set_replicate_publish_group: this mesh has one already.");
  replicate_publish_ = twin_of(*replicate_, g, "set_replicate_publish_group", "/publish");
}

void Mesh::shutdown() {
  if (closed_) return;
  world_->barrier("mesh shutdown: every rank finished its collectives");
  closed_ = true;
  for (Communicator* c : built_) c->shutdown();
}

void Mesh::abort() {
  if (closed_) return;
  closed_ = true;
  for (Communicator* c : built_) c->abort();
}

}  // namespace dmuon
