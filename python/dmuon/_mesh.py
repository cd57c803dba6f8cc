"""dmuon's mesh from what a PyTorch user has: a DeviceMesh (1-D, or 2-D (replicate, shard)), a 1-D mesh
plus ``replicate_mesh``, or ProcessGroups. The groups stay torch.distributed's (Gloo on CPU, NCCL on
CUDA); C++ drives their backends through dmuon's Communicator (timeouts, byte counters, errors that
name the rank)."""

import os
import weakref
from datetime import timedelta
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C


def _device_mesh_type():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without DeviceMesh
        return ()
    return DeviceMesh


def _require_initialized(fn: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{fn}: torch.distributed is not initialised. Call dist.init_process_group (torchrun sets the "
            "environment) or init_device_mesh before dedicating a model."
        )


def _axes(mesh, replicate_mesh, fn: str) -> Tuple[dist.ProcessGroup, Optional[dist.ProcessGroup], str]:
    """This rank's shard group, its replicate group (None on a 1-D mesh) and the device of the mesh."""
    DeviceMesh = _device_mesh_type()
    shard = replicate = None
    device_type = None
    outside = "; dmuon's collective calls on the model are made by the mesh's ranks alone: on this rank build " \
              "no dedicated model of that mesh (a model of its own on a group it is in, or none)"
    for given, what in ((mesh, "mesh"), (replicate_mesh, "replicate_mesh")):
        if given is dist.GroupMember.NON_GROUP_MEMBER or (isinstance(given, int) and given == -100):
            raise ValueError(f"rank {dist.get_rank()}: {fn}: this rank is not a member of the group passed as {what} "
                             "(torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER to the ranks "
                             f"outside it){outside}.")
        if isinstance(given, DeviceMesh) and given.get_coordinate() is None:
            raise ValueError(f"rank {dist.get_rank()}: {fn}: this rank is not in the DeviceMesh passed as {what} "
                             f"(its ranks: {given.mesh.flatten().tolist()}){outside}.")
    if isinstance(mesh, dist.ProcessGroup):
        shard = mesh
    elif isinstance(mesh, DeviceMesh):
        device_type = mesh.device_type
        if mesh.ndim == 1:
            shard = mesh.get_group()
        elif mesh.ndim == 2:
            if replicate_mesh is not None:
                raise ValueError(
                    f"{fn}: mesh is 2-D and replicate_mesh is given too. Pass either a 2-D (replicate, shard) mesh, "
                    "or its 1-D 'shard' sub-mesh as mesh and its 'replicate' sub-mesh as replicate_mesh."
                )
            names = mesh.mesh_dim_names or ()
            if "shard" in names and "replicate" in names:
                shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
            else:  # (replicate, shard): the FSDP2 HSDP convention
                shard, replicate = mesh.get_group(1), mesh.get_group(0)
        else:
            raise ValueError(
                f"{fn}: a {mesh.ndim}-D DeviceMesh was passed as mesh. Pass the 1-D 'shard' axis (and the "
                "'replicate' axis as replicate_mesh, or a 2-D (replicate, shard) mesh); with tensor parallelism "
                "pass the data-parallel sub-meshes (mesh=mesh3d['shard'], replicate_mesh=mesh3d['replicate']): the "
                "TP axis is the DTensor parameters' other mesh dimension."
            )
    else:
        raise TypeError(
            f"{fn}: mesh must be a torch.distributed DeviceMesh or ProcessGroup, got {type(mesh).__name__}. "
            "Build one with torch.distributed.device_mesh.init_device_mesh('cpu' or 'cuda', (world_size,))."
        )
    if replicate_mesh is not None:
        if isinstance(replicate_mesh, dist.ProcessGroup):
            replicate = replicate_mesh
        elif isinstance(replicate_mesh, DeviceMesh) and replicate_mesh.ndim == 1:
            replicate = replicate_mesh.get_group()
        else:
            raise TypeError(
                f"{fn}: replicate_mesh must be a 1-D DeviceMesh (the 'replicate' axis) or a ProcessGroup, got "
                f"{type(replicate_mesh).__name__}" + (f" with {replicate_mesh.ndim} dims" if isinstance(replicate_mesh, DeviceMesh) else "")
            )
    backend = dist.get_backend(shard)
    if device_type is None:
        device_type = "cuda" if backend == "nccl" else "cpu"
    device = "cpu" if device_type == "cpu" else "%s:%d" % (device_type, torch.cuda.current_device())
    if replicate is not None and dist.get_world_size(replicate) == 1:
        replicate = None  # one replica: a 1-D mesh
    return shard, replicate, device


def _ordered_ranks(group: dist.ProcessGroup) -> List[int]:
    """The global ranks of `group`'s members in group-rank order."""
    ranks = dist.get_process_group_ranks(group)
    return sorted(ranks, key=lambda g: dist.get_group_rank(group, g))


class _Setup(NamedTuple):
    """What each rank tells the others before a mesh is built (make_mesh's one gather)."""
    refusal: Optional[str]  # this rank's error, or None
    policy: Optional[str]
    timeout_s: float
    shard: List[int]        # the shard group's global ranks, in its order
    replicate: List[int]    # the replicate group's (empty on a 1-D mesh)
    tp: List[int]           # the tensor-parallel group's (empty without TP)


def _partition(gathered: List[_Setup]) -> Tuple[list, list, list, float]:
    """From every rank's setup: the partitions of each axis and of the meshes' worlds, in one
    deterministic order on every rank, and the clones' timeout."""
    everyone = [(g.shard, g.replicate) for g in gathered]
    shards = sorted({tuple(s) for s, _ in everyone}, key=lambda g: (min(g), g))
    replicas = sorted({tuple(r) for _, r in everyone if r}, key=lambda g: (min(g), g))
    shard_of = {rank: s for s in shards for rank in s}
    worlds = set()
    for s, r in everyone:
        members = set()
        for rank in (r or s[:1]):
            members |= set(shard_of[rank])
        members |= set(s)
        worlds.add(tuple(sorted(members)))
    return sorted(worlds), shards, replicas, _agreed_timeout(g.timeout_s for g in gathered)


# dmuon's clones ("isolated"), kept for the default group they were made under and reused by a later
# dedicate_params with the same key once no live model uses them: a sweep dedicating model after model in one
# process makes its groups (threads, sockets, NCCL communicators) once, while two models alive at once keep
# groups of their own (their collectives need no common order). Whether a model still lives depends on each
# rank's garbage collection, so the ranks vote: a clone is reused when it is free on every rank of the vote
# (one small gather over the group new_group is collective over), else every rank makes a new one.
_clones = {"default": None, "groups": {}}  # key -> [[this rank's group or None, WeakSet of _Hold], ...]


class _Hold:
    """Kept by a dedicated model's MeshGroups: the clones it uses are busy while it lives."""

    __slots__ = ("__weakref__",)


def _clone_cache() -> dict:
    default = dist.distributed_c10d._get_default_group()
    if _clones["default"] is not default:  # a new default group (destroy_process_group, init again): none reused
        _clones["default"], _clones["groups"] = default, {}
    return _clones["groups"]


def _registered(group) -> bool:
    """Whether `group` is still one of torch.distributed's (destroy_process_group(group) removes it)."""
    try:
        dist.get_process_group_ranks(group)
        return True
    except (KeyError, RuntimeError, ValueError):
        return False


def _free_everywhere(entries, vote_group=None) -> Optional[int]:
    """The first cached entry that no live model holds on any rank of `vote_group` (None: the default
    group), or None. The entries were made in one order everywhere, so their indices agree."""
    free = [i for i, (g, holders) in enumerate(entries) if not len(holders) and (g is None or _registered(g))]
    votes = [None] * dist.get_world_size(vote_group)
    dist.all_gather_object(votes, free, group=vote_group)
    common = set(free)
    for v in votes:
        common &= set(v)
    return min(common) if common else None


def _new_groups(partition, backend, timeout_s, role, hold, high_priority=False):
    """Every group of `partition` (lists of global ranks), created by every rank in one order (new_group is
    collective over the default group); returns this rank's own (None when it is in none). ``role`` names
    what the groups are for (two roles over one partition get two sets of groups); a partition made for the
    same role, backend and timeout before, under the same default group, and that no live model holds on any
    rank, is reused; ``hold`` holds it from now on. ``high_priority``: on NCCL, the groups' collectives run on
    high-priority CUDA streams (the shard axis: the broadcasts and reduces the next forward and the optimizer
    wait for, ahead of compute and of the replicate axis)."""
    entries = _clone_cache().setdefault(
        (role, backend, tuple(tuple(r) for r in partition), float(timeout_s), bool(high_priority)), [])
    i = _free_everywhere(entries)
    if i is None:
        me, out = dist.get_rank(), None
        options = None
        if high_priority and backend == "nccl":
            options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        for ranks in partition:
            g = dist.new_group(ranks=list(ranks), backend=backend, timeout=timedelta(seconds=timeout_s),
                               pg_options=options)
            if me in ranks:
                out = g
        entries.append([out, weakref.WeakSet()])
        i = len(entries) - 1
    entries[i][1].add(hold)
    return entries[i][0]


def _agreed_timeout(timeouts) -> float:
    """The timeout dmuon's clones are made with: the longest any rank asked for (every rank computes the same
    value, so the clones' cache keys agree; each rank's own waits keep its own timeout)."""
    return max(float(t) for t in timeouts)


def _tp_mesh(shard, replicate, tp, policy, backend, timeout_s, device, gathered: List[_Setup], hold):
    """The mesh with a tensor-parallel axis: this rank's shard, replicate (or None) and TP groups as given,
    the data-parallel group (the ranks at this rank's TP position) and the world built from the partitions
    of every rank's setup; "isolated" clones every axis."""
    me = dist.get_rank()
    shard_ranks, tp_ranks = _ordered_ranks(shard), _ordered_ranks(tp)
    replicate_ranks = _ordered_ranks(replicate) if replicate is not None else []
    everyone = [(g.shard, g.replicate, g.tp) for g in gathered]
    clone_timeout = _agreed_timeout(g.timeout_s for g in gathered)
    shard_of = {r: tuple(s) for s, _, _ in everyone for r in s}
    tp_of = {r: tuple(t) for _, _, t in everyone for r in t}

    def dp_of(s, r):  # the ranks at one TP position: the shard groups of the replicas
        return tuple(sorted({x for rank in (r or s[:1]) for x in shard_of[rank]}))

    dps = {dp_of(s, r) for s, r, _ in everyone}
    worlds = sorted({tuple(sorted({x for rank in dp for x in tp_of[rank]})) for dp in dps}, key=lambda g: (min(g), g))
    order = lambda groups: sorted(groups, key=lambda g: (min(g), g))  # noqa: E731
    new = lambda partition, role: _new_groups(partition, backend, clone_timeout, role, hold)  # noqa: E731

    world = new(worlds, "tp-world")
    isolated = policy == "isolated"
    shard_group = _new_groups(order({tuple(s) for s, _, _ in everyone}), backend, clone_timeout, "shard", hold,
                              high_priority=True) if isolated else shard
    replicate_group = publish_group = None
    if replicate is not None:
        replicas = order({tuple(r) for _, r, _ in everyone if r})
        replicate_group = new(replicas, "replicate") if isolated else replicate
        if isolated:  # the post-step publish apart from the replicate-axis reduces
            publish_group = new(replicas, "publish")
    tp_group = new(order({tuple(t) for _, _, t in everyone}), "tp") if isolated else tp
    dp_group = new(order(dps), "dp")
    world_ranks = next(list(w) for w in worlds if me in w)
    dp_ranks = list(dp_of(shard_ranks, replicate_ranks))
    index = {g: i for i, g in enumerate(world_ranks)}
    groups = [(world, list(range(len(world_ranks)))), (shard_group, [index[g] for g in shard_ranks])]
    if replicate is not None:
        groups.append((replicate_group, [index[g] for g in replicate_ranks]))
    native = _C._mesh(groups, device, policy, timeout_s, tp=(tp_group, [index[g] for g in tp_ranks]),
                      dp=(dp_group, [index[g] for g in dp_ranks]))
    if publish_group is not None:
        native.set_replicate_publish_group(publish_group, [index[g] for g in replicate_ranks])
    return native, world, dp_ranks, MeshGroups(world, shard_group, replicate_group, tp_group, dp_group,
                                               isolated and backend == "nccl", torch.device(device), shard_ranks,
                                               [index[g] for g in shard_ranks], publish_group, clone_timeout, hold,
                                               world_ranks)


class MeshGroups(NamedTuple):
    """The torch.distributed groups of a dedicated model's mesh (what get_comm_ctx shows)."""
    world: dist.ProcessGroup                # every rank of the mesh
    shard: dist.ProcessGroup                # the shard axis: dedicated broadcasts and reduces, sharded_adamw
    replicate: Optional[dist.ProcessGroup]  # HSDP's replicate axis (None on a 1-D mesh)
    tp: Optional[dist.ProcessGroup]         # tensor parallelism's axis (None without TP)
    dp: dist.ProcessGroup                   # the data-parallel ranks at this rank's TP position (the world without TP)
    shard_high_priority: bool               # the shard groups run on high-priority NCCL streams (dmuon built them)
    device: torch.device                    # where the collectives' tensors live
    shard_ranks: List[int]                  # the shard group's global ranks, in its order
    shard_in_world: List[int]               # the same as ranks of the world group (what the C++ mesh takes)
    replicate_publish: Optional[dist.ProcessGroup] = None  # HSDP, "isolated": the post-step publish's own group
    clone_timeout_s: float = 0.0            # the timeout dmuon's clones of this mesh were made with (agreed by all ranks)
    hold: Optional[_Hold] = None            # keeps the clones this mesh uses from being given to another model
    world_ranks: Optional[List[int]] = None  # the global rank of each rank of the C++ mesh's world (its ranks are these indices)


def _check_setup(gathered: List[_Setup], ranks: List[int], mine: _Setup, fn: str) -> None:
    """Raises on every rank of the gather when any refused its setup or they disagree on the policy or on
    tensor parallelism (a rank raising alone would leave the others in the next collective until the timeout)."""
    me = dist.get_rank()
    refused = [g.refusal for g in gathered if g.refusal is not None]
    if refused:
        if mine.refusal is not None:
            raise ValueError(mine.refusal)
        raise ValueError(f"rank {me}: {fn}: another rank refused the mesh's setup, so no rank builds it: {refused[0]}")
    policies = {r: g.policy for r, g in zip(ranks, gathered)}
    if len(set(policies.values())) > 1:
        raise ValueError(
            f"rank {me}: {fn}: the ranks disagree on the process-group policy (rank: policy {policies}); "
            "process_group_policy (or DMUON_PROCESS_GROUP_POLICY where it is not given) must be the same on every rank."
        )
    if len({bool(g.tp) for g in gathered}) > 1:
        with_tp = [r for r, g in zip(ranks, gathered) if g.tp]
        raise ValueError(
            f"rank {me}: {fn}: ranks {with_tp} have tensor-parallel (DTensor) parameters and the others have none; "
            "every rank must dedicate the same model, with the same tensor-parallel plan."
        )


def _gather_setup(mine: _Setup, shard, fn: str) -> List[_Setup]:
    """Every rank's setup, checked (_check_setup). A shard group over part of the ranks first agrees within
    itself (every member calls): a "shared" 1-D mesh needs nothing more (the other ranks may not dedicate at
    all). Then one all_gather_object over the default group, where the mesh's setup calls new_group (which is
    collective over it) anyway. (Ranks whose shard groups settle on different policies: those that go on to
    the default group wait there until the timeout.)"""
    world = dist.get_world_size()
    if dist.get_world_size(shard) < world:
        local = [None] * dist.get_world_size(shard)
        dist.all_gather_object(local, mine, group=shard)
        local = [_Setup(*g) for g in local]
        _check_setup(local, _ordered_ranks(shard), mine, fn)
        if mine.policy == "shared" and not mine.replicate and not mine.tp:
            return local
    gathered = [None] * world
    try:
        dist.all_gather_object(gathered, mine)
    except RuntimeError as e:  # (Gloo: a timeout, or a peer gone; NCCL: its own)
        if dist.get_world_size(shard) == world:
            raise
        raise RuntimeError(
            f"rank {dist.get_rank()}: {fn}: the mesh's group has {dist.get_world_size(shard)} of the {world} ranks, "
            f"and with process_group_policy='{mine.policy}' dedicate_params is collective over every rank (it makes "
            "dmuon's own groups with torch.distributed.new_group, which every rank of the default group calls): "
            "the ranks outside the group did not call it in time. Call dedicate_params on every rank (those outside "
            "this group on their own group's model), or pass process_group_policy='shared' to use the group as "
            f"it is. ({e})"
        ) from e
    gathered = [_Setup(*g) for g in gathered]
    _check_setup(gathered, list(range(world)), mine, fn)
    return gathered


def make_mesh(mesh, replicate_mesh, process_group_policy: Optional[str], fn: str, tp=None):
    """dmuon's C++ mesh over torch.distributed groups, and the torch group of the mesh's world (for
    collectives written in Python over the same ranks, e.g. clipping strategies). "isolated" (the default, or DMUON_PROCESS_GROUP_POLICY)
    clones every group with dist.new_group, the whole partition in one order on every rank (collective over
    the default group); "shared" uses the caller's groups (and one new group for a 2-D mesh's world). Every
    collective dmuon issues on the mesh fails after DMUON_COLLECTIVE_TIMEOUT seconds, else after the timeout
    given to init_process_group (or the group's own, when shorter). ``tp``: this rank's tensor-parallel
    group (the TP axis of the model's DTensor parameters): the mesh gets TP and data-parallel axes and
    ``dp_ranks`` (the global ranks at this rank's TP position) is returned as a third value; the fourth is
    the mesh's torch groups (MeshGroups)."""
    _require_initialized(fn)
    shard, replicate, device = _axes(mesh, replicate_mesh, fn)  # (the same on every rank: types and dims)
    backend = dist.get_backend(shard)
    shard_ranks = _ordered_ranks(shard)
    replicate_ranks = _ordered_ranks(replicate) if replicate is not None else []
    tp_ranks = _ordered_ranks(tp) if tp is not None and dist.get_world_size(tp) > 1 else []
    me = dist.get_rank()
    policy = timeout_s = None
    try:  # what each rank's environment decides: refused on every rank or none (the others would wait for it)
        policy = process_group_policy or os.environ.get("DMUON_PROCESS_GROUP_POLICY", "") or "isolated"
        if policy not in ("isolated", "shared"):
            given = "process_group_policy" if process_group_policy else "DMUON_PROCESS_GROUP_POLICY"
            raise ValueError(f"rank {me}: {fn}: {given} must be 'isolated' or 'shared', got {policy!r}")
        # a lost peer is an error after this: DMUON_COLLECTIVE_TIMEOUT, else the timeout init_process_group was
        # given (or the group's own, when shorter); dmuon's clones get it too (new_group's default is 30 min)
        timeout_s = _C._collective_timeout(shard, device)
        mine = _Setup(None, policy, timeout_s, shard_ranks, replicate_ranks, tp_ranks)
    except ValueError as e:
        text = str(e) if str(e).startswith(f"rank {me}:") else f"rank {me}: {fn}: {e}"
        mine = _Setup(text, policy, 0.0, shard_ranks, replicate_ranks, tp_ranks)
    gathered = _gather_setup(mine, shard, fn)
    hold = _Hold()
    if tp_ranks:
        return _tp_mesh(shard, replicate, tp, policy, backend, timeout_s, device, gathered, hold)
    publish_group, clone_timeout = None, timeout_s
    if policy == "shared" and replicate is None:
        world_ranks, world, shard_group, replicate_group = shard_ranks, shard, shard, None
    else:
        worlds, shards, replicas, clone_timeout = _partition(gathered)
        new = lambda partition, role: _new_groups(partition, backend, clone_timeout, role, hold)  # noqa: E731

        world_ranks = next(list(w) for w in worlds if me in w)
        if replicate is None:  # 1-D isolated: one clone serves as world and shard group
            world = shard_group = _new_groups(shards, backend, clone_timeout, "shard", hold, high_priority=True)
            replicate_group = None
        else:
            world = new(worlds, "world")
            shard_group = _new_groups(shards, backend, clone_timeout, "shard", hold, high_priority=True) \
                if policy == "isolated" else shard
            replicate_group = new(replicas, "replicate") if policy == "isolated" else replicate
            # isolated: the post-step publish on its own group, apart from the replicate-axis reduces
            publish_group = new(replicas, "publish") if policy == "isolated" else None
    index = {g: i for i, g in enumerate(world_ranks)}  # global rank -> rank in the mesh's world group
    groups = [(world, list(range(len(world_ranks)))), (shard_group, [index[g] for g in shard_ranks])]
    if replicate is not None:
        groups.append((replicate_group, [index[g] for g in replicate_ranks]))
    native = _C._mesh(groups, device, policy, timeout_s)
    if publish_group is not None:
        native.set_replicate_publish_group(publish_group, [index[g] for g in replicate_ranks])
    return native, world, None, MeshGroups(
        world, shard_group, replicate_group, None, world, policy == "isolated" and backend == "nccl", torch.device(device),
        shard_ranks, [index[g] for g in shard_ranks], publish_group, clone_timeout, hold, list(world_ranks))


def add_sharded_unshard_group(native_mesh, groups: MeshGroups) -> None:
    """A second group over this rank's shard group's ranks for the sharded_adamw all-gathers
    (Muon(sharded_adamw_unshard_separate_stream=True)): on NCCL its own stream (default priority, behind none of
    the shard group's high-priority broadcasts), on Gloo its own connections. Collective over the shard group's
    ranks only (new_group with local synchronization); once per mesh, and reused by later meshes over the same
    ranks (as the clones of _new_groups)."""
    if native_mesh.has_sharded_unshard_group:
        return
    backend = dist.get_backend(groups.shard)
    # keyed by its ranks alone (a timeout need not agree under "shared"); voted over the shard group's ranks,
    # the ones new_group with local synchronization is collective over
    entries = _clone_cache().setdefault(("sharded-unshard", backend, tuple(groups.shard_ranks)), [])
    i = _free_everywhere(entries, vote_group=groups.shard)
    if i is None:
        timeout_s = groups.clone_timeout_s or native_mesh.timeout_s
        group = dist.new_group(ranks=list(groups.shard_ranks), backend=backend, timeout=timedelta(seconds=timeout_s),
                               use_local_synchronization=True)
        entries.append([group, weakref.WeakSet()])
        i = len(entries) - 1
    if groups.hold is not None:
        entries[i][1].add(groups.hold)
    native_mesh.set_sharded_unshard_group(entries[i][0], list(groups.shard_in_world))
