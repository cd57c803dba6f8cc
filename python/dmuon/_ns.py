"""Newton-Schulz entry points that need Python-side arguments (process groups, aliases)."""

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import _C


def _group_or_default(group: Optional["dist.ProcessGroup"]) -> Optional["dist.ProcessGroup"]:
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_group()
    return group  # None without an initialised default group: a group of one (no communication)


def gram_newton_schulz_distributed_local(
    G_local: torch.Tensor,
    group: Optional["dist.ProcessGroup"],
    *,
    transposed: bool,
    steps: int = 5,
    eps: float = 1e-7,
    coefficients: Optional[Sequence[Sequence[float]]] = None,
    restart_iterations: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Gram-space Newton-Schulz of a column shard of the oriented full matrix.

    ``transposed`` says whether the *full* matrix has more rows than columns (then ``G_local.T`` is the
    local column shard). Only |X|_F^2 and the small Gram matrix are all-reduced over ``group`` (None:
    the default group); returns this rank's shard of the full NS output. ``steps`` is ignored, as by
    :func:`gram_newton_schulz`: len(coefficients) iterations. Collective over ``group``.
    """
    return _C._gram_newton_schulz_distributed_local(
        G_local, _group_or_default(group), transposed, steps, eps, coefficients, restart_iterations, False
    )


def gram_newton_schulz_distributed_local_batched(
    G_local: torch.Tensor,
    group: Optional["dist.ProcessGroup"],
    *,
    transposed: bool,
    steps: int = 5,
    eps: float = 1e-7,
    coefficients: Optional[Sequence[Sequence[float]]] = None,
    restart_iterations: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """:func:`gram_newton_schulz_distributed_local` for a batch ``[batch, rows, cols]`` of shards with one
    logical orientation: one all-reduce per stage carries the whole batch. Collective over ``group``."""
    return _C._gram_newton_schulz_distributed_local(
        G_local, _group_or_default(group), transposed, steps, eps, coefficients, restart_iterations, True
    )


def gram_newton_schulz_q(*args, **kwargs):
    """The former name of :func:`gram_newton_schulz_factors` (same arguments, same result)."""
    return _C.gram_newton_schulz_factors(*args, **kwargs)
