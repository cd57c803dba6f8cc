"""Gradient clipping of a dedicated model: the stats dataclasses, strategies written in Python, and
segmented (bucket) clipping over a torch.distributed group, on dmuon's C++ clipping core."""

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C
from ._fsdp2 import shard_of


@dataclass
class MuonGradClipStats:
    """What a gradient clip measured and did: the total norm before clipping, the max norm (None: only
    measured), the norm type, the scale applied (min(1, max_norm / (total_norm + 1e-6))), whether the
    gradients were scaled, how many parameters the norm covered (all ranks), whether the norm was not
    finite (then nothing is scaled), and the strategy."""

    total_norm: float
    max_norm: Optional[float]
    norm_type: float
    clip_coef: float
    clipped: bool
    param_count: int
    found_inf: bool
    strategy: str = "global_norm"


@dataclass
class MuonClipGrad:
    """One live gradient a clip strategy receives: scale it in place (``grad.mul_(coef)``) or read it.
    ``counted``: this rank adds it to a norm (False: a copy that another rank counts, so every element is
    counted once over the mesh); ``counts_param``: this copy counts its parameter once in ``param_count``."""

    name: str
    grad: torch.Tensor
    counted: bool
    counts_param: bool


class MuonGradClipStrategy(Protocol):
    """A custom clip strategy: called as ``strategy(grads, max_norm, norm_type=..., error_if_nonfinite=...,
    foreach=..., group=...)`` with this rank's live gradients in scope (a list of :class:`MuonClipGrad`: scale
    them in place or read them), the max norm (None: measure only) and the torch.distributed group of the
    model's mesh; returns a :class:`MuonGradClipStats`. It must issue the same collectives on every rank of
    ``group``, whatever each rank holds."""

    def __call__(self, grads: List[MuonClipGrad], max_norm: Optional[float], *, norm_type: float,
                 error_if_nonfinite: bool, foreach: Optional[bool], group) -> MuonGradClipStats: ...

_STRATEGIES: Dict[str, MuonGradClipStrategy] = {}


def register_muon_grad_clip_strategy(name: str, strategy: MuonGradClipStrategy) -> None:
    """Registers (or replaces) a clip strategy under ``name`` for ``clip_grad_norm_(..., strategy=name)``.
    The strategy is called as ``strategy(grads, max_norm, norm_type=..., error_if_nonfinite=...,
    foreach=..., group=...)`` with this rank's live gradients in scope (a list of :class:`MuonClipGrad`,
    to scale or inspect in place) and the torch.distributed group of the model's mesh, and returns a
    :class:`MuonGradClipStats`. It must issue the same collectives on every rank. "global_norm" is
    built in and cannot be replaced."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_muon_grad_clip_strategy: name must be a non-empty string, got {name!r}")
    if name == "global_norm":
        raise ValueError("register_muon_grad_clip_strategy: 'global_norm' is built in and cannot be replaced; "
                         "register the strategy under another name.")
    if not callable(strategy):
        raise ValueError(f"register_muon_grad_clip_strategy: strategy '{name}' must be callable, got "
                         f"{type(strategy).__name__}")
    _STRATEGIES[name] = strategy


def registered_strategies() -> List[str]:
    """The names register_muon_grad_clip_strategy registered (Python strategies), sorted."""
    return sorted(_STRATEGIES)


def python_strategy(strategy) -> Optional[MuonGradClipStrategy]:
    """The Python strategy `strategy` names (or is), else None (a C++ strategy: "global_norm")."""
    if callable(strategy):
        return strategy
    return _STRATEGIES.get(strategy)


def run_python_strategy(optimizer, strategy, name: str, max_norm, norm_type, error_if_nonfinite, foreach,
                        all_params: bool, group, extra=()) -> MuonGradClipStats:
    grads = [MuonClipGrad(*g) for g in list(_C._muon_clip_grads(optimizer, all_params)) + list(extra)]
    stats = strategy(grads, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach,
                     group=group)
    if not isinstance(stats, MuonGradClipStats):
        raise TypeError(f"clip_grad_norm_: strategy '{name}' returned {type(stats).__name__}; a strategy returns a "
                        "dmuon.MuonGradClipStats.")
    return stats


@dataclass
class GradClipBucket:
    """One independently clipped gradient segment: its gradients (None entries skipped) and whether its
    squared norm is summed over the process group (``reduce=True``: gradients spread over the ranks, e.g.
    owned Muon matrices or DTensor shards; False: gradients identical on every rank, e.g. replicated)."""

    name: str
    grads: Sequence[Optional[torch.Tensor]]
    reduce: bool = True


@dataclass
class GradClipBucketStats:
    """Pre-clip norm and coefficient of one gradient segment; ``param_count``: the gradient tensors counted
    (summed over the group for a reduced bucket; each counted shard of a sharded gradient once);
    ``fastpath``: this rank used the fused kernels for some tensor of the bucket."""

    name: str
    total_norm: float
    max_norm: Optional[float]
    clip_coef: float
    clipped: bool
    param_count: int
    found_inf: bool
    fastpath: bool


@dataclass
class SegmentedGradClipResult:
    """The result of a multi-segment clip: sqrt of the sum of the buckets' squared norms (a float64
    scalar tensor, before clipping), every bucket's stats in bucket order, whether some tensor took the
    fused path on this rank and, when none did, why."""

    total_norm: torch.Tensor
    bucket_stats: Tuple[GradClipBucketStats, ...]
    fastpath: bool
    fallback_reason: Optional[str] = None

    def find(self, name: str) -> Optional[GradClipBucketStats]:
        """The stats of the bucket called ``name`` (None when absent)."""
        return next((s for s in self.bucket_stats if s.name == name), None)


def _split(grads):
    """A bucket's gradients as (counted, scale_only): DTensors by their local shards, each element counted
    once over the ranks (copies on the other replicas of an HSDP mesh only scaled); None entries dropped."""
    counted, scale_only = [], []
    for g in grads:
        if g is None:
            continue
        local, is_counted, _ = shard_of(g)
        (counted if is_counted else scale_only).append(local)
    return counted, scale_only


def _result(d) -> SegmentedGradClipResult:
    return SegmentedGradClipResult(d["total_norm"], tuple(GradClipBucketStats(**s) for s in d["bucket_stats"]),
                                   d["fastpath"], d["fallback_reason"])


def _group_args(process_group, fn: str):
    """(group, its members' global ranks, device) for the C++ communicator; group None without
    torch.distributed (a single process). The device is the group's (CUDA for NCCL), the same on every
    rank whatever each holds."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, [], "cpu"
        process_group = dist.distributed_c10d._get_default_group()
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{fn}: process_group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(process_group).__name__}")
    ranks = dist.get_process_group_ranks(process_group)
    ranks = sorted(ranks, key=lambda g: dist.get_group_rank(process_group, g))
    cuda = "nccl" in str(dist.get_backend(process_group)) and torch.cuda.is_available()
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    return process_group, ranks, device


def _clip_buckets(buckets, max_norm, process_group, fn: str, chunk_size=None) -> SegmentedGradClipResult:
    group, ranks, device = _group_args(process_group, fn)
    return _result(_C._clip_grad_norm_buckets(buckets, None if max_norm is None else float(max_norm), group, ranks,
                                              device, chunk_size, None))


def clip_grad_norm_buckets_(buckets: Sequence[GradClipBucket], max_norm: Optional[float], *, process_group=None,
                            chunk_size: Optional[int] = None) -> SegmentedGradClipResult:
    """Clips each bucket on its own L2 norm: ``coef = min(1, max_norm / (norm + 1e-6))`` (``max_norm=None``
    only measures). A ``reduce`` bucket sums its squared partial over ``process_group`` (None: the default
    group; without torch.distributed, this process alone). Distributed-safe: two all-gathers on every rank
    whatever it holds (the bucket layout, checked so that ranks that disagree get an error naming both, then
    every bucket's partial), combined in rank order in float64, so every rank gets the same bits; the fused
    (foreach) or reference math per tensor is a local choice. Gradients live on the group's device (CUDA for
    an NCCL group). DTensor gradients count their local shard once over the mesh (HSDP: the replicas'
    copies are scaled, not counted again). A non-finite bucket norm leaves that bucket unscaled
    (``found_inf``). Collective over the group."""
    normalised = []
    for i, b in enumerate(buckets):
        if not isinstance(b, GradClipBucket):
            raise TypeError(f"clip_grad_norm_buckets_: buckets[{i}] is a {type(b).__name__}; pass dmuon.GradClipBucket(name, grads, reduce)")
        counted, scale_only = _split(b.grads)
        normalised.append((b.name, counted, bool(b.reduce), scale_only))
    return _clip_buckets(normalised, max_norm, process_group, "clip_grad_norm_buckets_", chunk_size)


def _fast_clip_agreed(process_group, fn: str) -> bool:
    """Whether the fused clip path is on (DMUON_FAST_CLIP), agreed over ``process_group`` by the C++
    fast_clip_agreed: a mixed setting would send some ranks into the clip's collectives and leave the others
    on their own path (a hang), so it is a ValueError on every rank. Collective over the group."""
    group, ranks, device = _group_args(process_group, fn)
    return _C._fast_clip_agreed(group, ranks, device, fn)


def try_clip_optimizer_grad_norm_buckets_(optimizer, *, regular_grads: Sequence[Optional[torch.Tensor]],
                                          adamw_grads: Sequence[Optional[torch.Tensor]], max_norm: float,
                                          process_group=None) -> Optional[SegmentedGradClipResult]:
    """Three buckets in one call, each clipped to ``max_norm`` on its own: "regular" (the caller's replicated
    gradients, not reduced), "muon" (``optimizer``'s dedicated gradients, waited here, reduced) and
    "adamw" (the caller's sharded AdamW gradients, e.g. FSDP2's DTensor shards, reduced; each element once
    over the mesh). The "muon" bucket's stats become ``optimizer.last_muon_grad_clip_stats`` (strategy
    "segmented"). Returns None only when the fused path is switched off (``DMUON_FAST_CLIP=0`` on every rank;
    set on some ranks only, it is a ``ValueError`` on all), so the caller runs its own path. ``process_group``: None is the model's mesh.
    Collective."""
    if not hasattr(optimizer, "_native"):
        raise ValueError(f"try_clip_optimizer_grad_norm_buckets_: optimizer must be a dmuon.Muon, got {type(optimizer).__name__}")
    group = optimizer._model_state.world_group if process_group is None else process_group
    if not _fast_clip_agreed(group, "try_clip_optimizer_grad_norm_buckets_"):
        return None
    muon = _C._muon_clip_grads(optimizer._native, False)  # collective: waits the reduces
    regular, regular_copies = _split(regular_grads)
    adamw, adamw_copies = _split(adamw_grads)
    buckets = [("regular", regular + regular_copies, False, []),
               ("muon", [g for _, g, counted, _ in muon if counted], True, [g for _, g, counted, _ in muon if not counted]),
               ("adamw", adamw, True, adamw_copies)]
    r = _clip_buckets(buckets, max_norm, group, "try_clip_optimizer_grad_norm_buckets_")
    s = r.find("muon")
    optimizer._last_clip = MuonGradClipStats(s.total_norm, s.max_norm, 2.0, s.clip_coef, s.clipped, s.param_count,
                                             s.found_inf, "segmented")
    return r


__all__ = [
    "GradClipBucket", "GradClipBucketStats", "MuonClipGrad", "MuonGradClipStats", "MuonGradClipStrategy",
    "SegmentedGradClipResult", "clip_grad_norm_buckets_", "register_muon_grad_clip_strategy",
    "try_clip_optimizer_grad_norm_buckets_",
]
