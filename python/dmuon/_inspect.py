"""The schedule's entry points between backward and the next forward, the dedicated parameters as
dataclasses, and the JSON-friendly diagnostics (local: no collective) of a dedicated model."""

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from ._fsdp2 import is_dtensor
from . import _C
from ._runtime import (Muon, _owner_coords, _reported_tp_buffer_reuse, _state_of, _sync_external, _tp_buffer_reuse,
                       _trained_external)

OwnerRankLike = Union[int, Tuple[int, int]]


@dataclass
class DedicatedParam:
    """One dedicated (Muon) matrix as this rank sees it. ``owner_rank`` is the owner's coordinate: its
    global rank on a 1-D mesh, ``(owner_shard, owner_replicate)`` on an HSDP mesh; ``global_rank`` is
    always the owner's global rank. ``param`` is the module's Parameter (0 elements between steps on
    ranks that do not hold it)."""

    name: str
    param: nn.Parameter
    shape: Tuple[int, ...]
    owner_rank: OwnerRankLike
    owner_shard: int
    owner_replicate: int
    global_rank: int
    boundary: str
    is_owner: bool
    tp_split_dim: int = -1               # tensor parallelism: the split dimension of this TP rank's slice (-1: whole)
    tp_owner: int = -1                   # the TP rank that runs Newton-Schulz on the full matrix (-1: no TP)
    full_shape: Tuple[int, ...] = ()     # the full matrix's shape (``shape`` is the local slice's)
    is_tp_owner: bool = False            # this rank is the TP owner


@dataclass
class ReplicatedGroup:
    """What :func:`dmuon.replicate` (or :func:`dmuon.replicate_tp`) attached: the replicated parameters (model
    order), the number of ranks each gradient is averaged over (the data-parallel ranks; with TP, those at
    this rank's TP position) and whether it was ``replicate_tp`` (TP slices among them: each rank's local
    slice gradient is averaged over the data-parallel mesh)."""

    names: List[str]
    group_size: int
    tp: bool = False


def get_dedicated_params(model: nn.Module) -> List[DedicatedParam]:
    """Every dedicated matrix of ``model`` (model order), as this rank sees it. Local."""
    state = _state_of(model, "get_dedicated_params", local=True)
    out = []
    for d, coord in _owner_coords(state):
        out.append(DedicatedParam(d["name"], d["param"], tuple(d["shape"]), coord, d["owner_shard"],
                                  d["owner_replicate"], d["owner_rank"], d["boundary"], d["is_owner"],
                                  d["tp_split_dim"], d["tp_owner"], tuple(d["full_shape"]),
                                  d["tp_owner"] >= 0 and d["tp_owner"] == state.mesh.tp_rank))
    return out


def get_owned_params(model: nn.Module, rank: OwnerRankLike) -> List[DedicatedParam]:
    """The dedicated matrices owned by ``rank``: an int is matched against the owner's shard index (its rank
    in the shard group: on a 1-D mesh over every rank in order, its global rank), a ``(shard, replicate)``
    tuple against the full HSDP coordinate. Local."""
    params = get_dedicated_params(model)
    if isinstance(rank, (tuple, list)):
        if len(rank) != 2:
            raise ValueError(f"get_owned_params: rank must be an int or a (shard, replicate) pair, got {rank!r}")
        return [p for p in params if (p.owner_shard, p.owner_replicate) == tuple(rank)]
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"get_owned_params: rank must be an int or a (shard, replicate) pair, got {rank!r}")
    return [p for p in params if p.owner_shard == rank]


def get_replicated_group(model: nn.Module) -> Optional[ReplicatedGroup]:
    """What :func:`dmuon.replicate` or :func:`dmuon.replicate_tp` attached to ``model``, or None when neither was
    called (or the model was never dedicated). Local."""
    state = getattr(model, "_dmuon", None)
    if state is None or not state.replicated:
        return None
    names = [n for n, route in state.runtime.routes() if route == "replicated"]
    return ReplicatedGroup(names, state.mesh.shard_size * state.mesh.replicate_size, tp=state.replicated_tp)


def prepare_muon_grads(model: nn.Module, *, use_reduce_stream: bool = False, coalesce_wait: bool = False) -> None:
    """Waits for every gradient reduce issued in backward, so each owner holds its matrices' averaged
    gradients (``Muon.step`` does it itself; call it to read them between backward and step).
    ``coalesce_wait``: one wait for every group instead of group by group. ``use_reduce_stream`` is
    accepted for compatibility (dmuon's reduces already share their group's stream). Collective."""
    del use_reduce_stream
    _state_of(model, "prepare_muon_grads").runtime.prepare_grads(coalesce_wait)


def wait_all_reduces(model: nn.Module) -> None:
    """The former name of :func:`prepare_muon_grads`. Collective."""
    prepare_muon_grads(model)


def broadcast_all_updates(model: nn.Module) -> None:
    """Publishes every owner's updated matrices to the ranks that hold them between steps (HSDP: across
    the replicate axis; the DDP path: every rank) and waits. ``Muon.step`` does it (asynchronously).
    Collective."""
    _state_of(model, "broadcast_all_updates").runtime.publish(False)


def broadcast_all_updates_async(model: nn.Module) -> None:
    """:func:`broadcast_all_updates` without the wait: the next forward waits per boundary. Collective."""
    _state_of(model, "broadcast_all_updates_async").runtime.publish(True)


def wait_all_post_step_broadcasts(model: nn.Module) -> None:
    """Waits for every asynchronous post-step publish, for code that reads the matrices outside the
    forward (evaluation, custom checkpoints). Local."""
    _state_of(model, "wait_all_post_step_broadcasts").runtime.wait_publishes()


def wait_all_replicate_broadcasts(model: nn.Module) -> None:
    """The HSDP name of :func:`wait_all_post_step_broadcasts`. Local."""
    wait_all_post_step_broadcasts(model)


def summarize_param_groups(model: nn.Module, optimizer: Any, *, max_rows: int = 128) -> Dict[str, Any]:
    """How :class:`dmuon.Muon` routed this rank's trainable parameters: per group its kind, hyperparameters,
    parameter count and elements; per dedicated matrix its owner and boundary (up to ``max_rows`` rows);
    totals; and ``"fsdp2"``, the parameters trained as FSDP2 shards. Local."""
    state = _state_of(model, "summarize_param_groups", local=True)
    if not isinstance(optimizer, Muon) or optimizer._model is not model:
        raise ValueError("summarize_param_groups: optimizer must be the dmuon.Muon built on this model.")
    out = json.loads(optimizer._native.summary(state.runtime, max_rows))
    _sync_external(model, state)
    external = _trained_external(state)
    out["fsdp2"] = {
        "params": len(external),
        "numel": sum(p.numel() for p in external.values()),
        "local_numel": sum((p.to_local() if is_dtensor(p) else p).numel() for p in external.values()),
    }
    return out


def summarize_comm_plan(model: nn.Module, *, max_groups: int = 64, max_params_per_group: int = 128) -> Dict[str, Any]:
    """dmuon's planned communication for ``model``: mesh, owners, per-boundary roots and payloads, the
    per-rank bytes of each axis and the closed-form totals (planned sizes, not measurements). Local."""
    state = _state_of(model, "summarize_comm_plan", local=True)
    return json.loads(state.runtime.comm_plan(max_groups, max_params_per_group))


def collect_forward_unshard_profile(model: nn.Module, *, clear: bool = True, synchronize: bool = False) -> Dict[str, object]:
    """The forward-unshard counters per boundary (bytes, collectives, waits), recorded when
    ``DMUON_RECORD_FORWARD_PROFILE=1`` was set before :func:`dmuon.dedicate_params`. ``clear`` resets
    them; ``synchronize`` waits for the GPU first (diagnostic boundaries only). Local."""
    state = _state_of(model, "collect_forward_unshard_profile", local=True)
    if synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()
    return json.loads(state.runtime.unshard_profile(clear))


def consume_forward_unshard_profile(model: nn.Module, *, clear: bool = True) -> Dict[str, object]:
    """:func:`collect_forward_unshard_profile` under its former name. Local."""
    return collect_forward_unshard_profile(model, clear=clear)


def comm_bytes(model: nn.Module) -> Dict[str, int]:
    """Bytes this rank's dmuon collectives moved since :func:`dmuon.dedicate_params`, by operation
    (``"broadcast"``, ``"reduce"``, ``"all_reduce"``, ...): counted by dmuon's communication layer as the
    payload each collective sends or receives on this rank, not planned. FSDP2's own collectives (the
    parameters dmuon does not own) are not in it. Local; take differences between two calls for a window."""
    return dict(_state_of(model, "comm_bytes", local=True).mesh.bytes())


def comm_calls(model: nn.Module) -> Dict[str, int]:
    """Collectives this rank's dmuon issued since :func:`dmuon.dedicate_params`, by operation (the keys of
    :func:`comm_bytes`), as its communication layer counted them. Local; take differences for a window."""
    return dict(_state_of(model, "comm_calls", local=True).mesh.calls())


def install_counting_allocator() -> None:
    """Count CPU tensor memory from now on: wraps LibTorch's CPU allocator with dmuon's counter (the one
    ``dmuon train`` reports). Idempotent. Tensors allocated before the call are not counted, nor are their
    frees; allocations outside LibTorch's allocator (BLAS scratch, Gloo's buffers) never are. Call it before
    building the model whose memory you want to measure."""
    _C._install_counting_allocator()


def tensor_memory_stats(device: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    """Live tensor bytes: ``{"current", "peak", "allocations", "peak_by_phase"}``. On the CPU, what the
    counting allocator (:func:`install_counting_allocator`) saw in this process (``ValueError`` before it is
    installed: there is nothing to read); on CUDA, the caching allocator's allocated bytes of ``device``.
    ``peak`` is the most live at once since the last :func:`reset_tensor_memory_peaks`."""
    device = torch.device(device)
    if device.type == "cpu" and not _C._counting_allocator_installed():
        raise ValueError(
            "tensor_memory_stats('cpu'): the counting allocator is not installed, so no CPU tensor bytes were "
            "counted. Call dmuon.install_counting_allocator() before building the model."
        )
    return _C._tensor_memory_stats(str(device))


def reset_tensor_memory_peaks(device: Union[str, torch.device] = "cpu") -> None:
    """Restart the peaks of :func:`tensor_memory_stats` from the bytes live now."""
    _C._reset_tensor_memory_peaks(str(torch.device(device)))


class DedicatedCommContext:
    """How a dedicated model communicates, read-only (:func:`get_comm_ctx`; the API reference's
    DedicatedCommContext, built by :func:`dedicate_params`). The API reference's constructor,
    ``DedicatedCommContext(device, replicate_group=None, *, tp_buffer_reuse=False,
    replicate_broadcast_bucket_mb=0.0)``, makes a context attached to no model: those settings, no shard/TP
    groups, an empty forward order (dedicate_params builds the context it uses itself; most users need not
    construct one).

    Process groups (torch.distributed groups; dmuon's clones under process_group_policy="isolated", the
    caller's under "shared"): ``shard_group`` (the shard axis: dedicated broadcasts and reduces, sharded_adamw
    all-gathers and reduce-scatters), ``replicate_group`` (HSDP's replicate axis: stage-2 reduces, sharded_adamw
    all-reduces; None on a 1-D mesh), ``replicate_publish_group`` (HSDP: the post-step publishes, on a group
    of their own under "isolated" so no replicate-axis reduce sits in front of a publish the next forward
    waits for; the replicate group itself under "shared"), ``tp_group`` (None without tensor parallelism),
    ``data_parallel_group`` (the data-parallel ranks at this rank's TP position) and ``world_group``.

    Streams: dmuon issues no kernels of its own for communication; each collective runs on its process
    group's stream (NCCL's internal one), and dmuon's waits become stream dependencies. The shard axis's
    groups dmuon builds on NCCL run on high-priority streams (``shard_high_priority``), the replicate and TP
    axes on default-priority ones, so a large replicate all-reduce never sits in front of a broadcast the next
    forward waits for; on Gloo there are no streams.

    Prefetch state: ``post_forward_order`` (the boundaries, by module name, in the forward order prefetching
    follows), :meth:`reset_post_forward_order`, and :meth:`consume_forward_unshard_profile`."""

    def __init__(self, device, replicate_group=None, *, tp_buffer_reuse: Union[bool, str] = False,
                 replicate_broadcast_bucket_mb: float = 0.0):
        if isinstance(device, nn.Module):  # get_comm_ctx: the context dedicate_params built for this model
            self._attach(device)
            return
        reuse = _reported_tp_buffer_reuse(_tp_buffer_reuse(tp_buffer_reuse, "DedicatedCommContext"))
        bucket = float(replicate_broadcast_bucket_mb)
        if not bucket >= 0 or bucket == float("inf"):
            raise ValueError(f"DedicatedCommContext: replicate_broadcast_bucket_mb must be a finite number >= 0, got "
                             f"{replicate_broadcast_bucket_mb!r}.")
        self._model = self._state = None
        self.device = torch.device(device)
        self.process_group_policy = "shared"  # the caller's groups, as given
        self.world_group = self.shard_group = self.tp_group = self.data_parallel_group = None
        self.replicate_group = self.replicate_publish_group = replicate_group
        self.shard_high_priority = False
        self.tp_buffer_reuse = reuse  # as get_comm_ctx reports it
        self.replicate_broadcast_bucket_mb = bucket
        self._order: List[str] = []

    def _attach(self, model: nn.Module) -> None:
        self._model = model
        state = model._dmuon
        self._state = state
        groups = state.groups
        self.device: torch.device = groups.device
        self.process_group_policy: str = state.mesh.policy
        self.world_group = groups.world
        self.shard_group = groups.shard
        self.replicate_group = groups.replicate
        self.replicate_publish_group = groups.replicate_publish if groups.replicate_publish is not None \
            else groups.replicate
        self.tp_group = groups.tp
        self.data_parallel_group = groups.dp
        self.shard_high_priority: bool = groups.shard_high_priority
        self.tp_buffer_reuse: Union[bool, str] = _reported_tp_buffer_reuse(state.comm_options.get("tp_buffer_reuse"))
        self.replicate_broadcast_bucket_mb: float = float(state.comm_options.get("replicate_broadcast_bucket_mb") or 0.0)

    @property
    def post_forward_order(self) -> List[str]:
        """The hook boundaries (module names; "" is the root) in the recorded forward order: the last complete
        forward pass's, or the running one's before any completed. Local."""
        if self._state is None:
            return list(self._order)
        return list(self._state.runtime.post_forward_order())

    def reset_post_forward_order(self) -> None:
        """Forget the recorded forward order: the next forward records it afresh and prefetches in model order
        meanwhile (call when the boundaries' order changes, e.g. another branch runs from now on). Every rank
        at the same point."""
        if self._state is None:
            self._order.clear()
            return
        self._state.runtime.reset_post_forward_order()

    def consume_forward_unshard_profile(self, *, clear: bool = True) -> Dict[str, object]:
        """:func:`collect_forward_unshard_profile` of this model. Local."""
        if self._model is None:
            raise ValueError("DedicatedCommContext.consume_forward_unshard_profile: this context is attached to no "
                             "model (built by its constructor); use dmuon.get_comm_ctx(model) of a dedicated model.")
        return collect_forward_unshard_profile(self._model, clear=clear)

    def __repr__(self) -> str:
        sizes = {name: (g.size() if g is not None else None) for name, g in (
            ("shard", self.shard_group), ("replicate", self.replicate_group), ("tp", self.tp_group))}
        return (f"DedicatedCommContext(device={self.device}, policy={self.process_group_policy!r}, group sizes={sizes}, "
                f"post_forward_order={self.post_forward_order})")


def get_comm_ctx(model: nn.Module) -> Optional[DedicatedCommContext]:
    """The communication context of a model :func:`dedicate_params` (or a DDP variant) dedicated, else None.
    Local."""
    state = getattr(model, "_dmuon", None)
    if state is None or state.groups is None:
        return None
    return DedicatedCommContext(model)
