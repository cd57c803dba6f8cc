"""dmuon: distributed Muon with dedicated ownership, on a native C++ core.

Each Muon matrix has one owner rank that receives its averaged gradient, runs Newton-Schulz on the
whole matrix and publishes the update; everything else trains with AdamW. This package is the
Python API over dmuon's C++ core (``dmuon._C``), built against one torch minor version.
"""

import torch as _torch

from . import _build_info


def _check_torch_version() -> None:
    built = _build_info.TORCH_VERSION  # "major.minor" of the torch dmuon._C was compiled against
    running = ".".join(_torch.__version__.split("+")[0].split(".")[:2])
    if running != built:
        raise ImportError(
            f"dmuon was built against torch {built}, but torch {_torch.__version__} is imported. dmuon's "
            f"core uses torch's C++ internals (c10d, autograd), which change between minor versions: rebuild "
            f"dmuon against this torch (pip install --no-build-isolation . in dmuon's source tree) or install "
            f"torch {built}.x."
        )


_check_torch_version()

from ._C import (  # noqa: E402  (after the version check: a mismatched _C may not even load)
    POLAR_EXPRESS_COEFFICIENTS,
    YOU_COEFFICIENTS,
    NewtonSchulz,
    NonFiniteGradientError,
    __version__,
    direct_newton_schulz,
    get_backend_status,
    get_ns_backend,
    gram_newton_schulz,
    gram_newton_schulz_factors,
    newton_schulz,
)
from ._clip import (  # noqa: E402
    GradClipBucket,
    GradClipBucketStats,
    MuonClipGrad,
    MuonGradClipStats,
    MuonGradClipStrategy,
    SegmentedGradClipResult,
    clip_grad_norm_buckets_,
    register_muon_grad_clip_strategy,
    try_clip_optimizer_grad_norm_buckets_,
)
from ._runtime import (  # noqa: E402
    AssignmentGroupKeyFn,
    HookBoundaryResolver,
    Muon,
    ParamPolicyFn,
    RouteHintFn,
    clip_grad_norm_,
    dedicate_params,
    dedicate_params_ddp,
    dedicate_params_ddp_tp,
    get_model_state_dict,
    get_optimizer_state_dict,
    no_sync,
    replicate,
    replicate_tp,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from ._amp import GradScaler  # noqa: E402
from ._fsdp2 import ignored_params, install_patch, uninstall_patch  # noqa: E402
from ._inspect import (  # noqa: E402
    DedicatedCommContext,
    DedicatedParam,
    OwnerRankLike,
    ReplicatedGroup,
    broadcast_all_updates,
    broadcast_all_updates_async,
    collect_forward_unshard_profile,
    comm_bytes,
    comm_calls,
    consume_forward_unshard_profile,
    get_comm_ctx,
    get_dedicated_params,
    get_owned_params,
    get_replicated_group,
    install_counting_allocator,
    prepare_muon_grads,
    reset_tensor_memory_peaks,
    summarize_comm_plan,
    summarize_param_groups,
    tensor_memory_stats,
    wait_all_post_step_broadcasts,
    wait_all_reduces,
    wait_all_replicate_broadcasts,
)
from ._ns import (  # noqa: E402
    gram_newton_schulz_distributed_local,
    gram_newton_schulz_distributed_local_batched,
    gram_newton_schulz_q,
)

# The coefficients the Newton-Schulz functions use when given none (the API reference's DEFAULT_COEFFICIENTS):
# Polar Express, one (a, b, c) triple per iteration.
DEFAULT_COEFFICIENTS = POLAR_EXPRESS_COEFFICIENTS

__all__ = [
    "__version__",
    "AssignmentGroupKeyFn",
    "DEFAULT_COEFFICIENTS",
    "HookBoundaryResolver",
    "OwnerRankLike",
    "ParamPolicyFn",
    "RouteHintFn",
    "DedicatedCommContext",
    "DedicatedParam",
    "GradClipBucket",
    "GradClipBucketStats",
    "GradScaler",
    "Muon",
    "MuonClipGrad",
    "MuonGradClipStats",
    "MuonGradClipStrategy",
    "NewtonSchulz",
    "NonFiniteGradientError",
    "POLAR_EXPRESS_COEFFICIENTS",
    "ReplicatedGroup",
    "SegmentedGradClipResult",
    "YOU_COEFFICIENTS",
    "broadcast_all_updates",
    "broadcast_all_updates_async",
    "clip_grad_norm_",
    "clip_grad_norm_buckets_",
    "collect_forward_unshard_profile",
    "comm_bytes",
    "comm_calls",
    "consume_forward_unshard_profile",
    "dedicate_params",
    "dedicate_params_ddp",
    "dedicate_params_ddp_tp",
    "direct_newton_schulz",
    "get_backend_status",
    "get_comm_ctx",
    "get_dedicated_params",
    "get_model_state_dict",
    "get_ns_backend",
    "get_optimizer_state_dict",
    "get_owned_params",
    "get_replicated_group",
    "gram_newton_schulz",
    "gram_newton_schulz_distributed_local",
    "gram_newton_schulz_distributed_local_batched",
    "gram_newton_schulz_factors",
    "gram_newton_schulz_q",
    "ignored_params",
    "install_counting_allocator",
    "install_patch",
    "newton_schulz",
    "no_sync",
    "prepare_muon_grads",
    "register_muon_grad_clip_strategy",
    "replicate",
    "replicate_tp",
    "reset_tensor_memory_peaks",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "summarize_comm_plan",
    "summarize_param_groups",
    "tensor_memory_stats",
    "try_clip_optimizer_grad_norm_buckets_",
    "uninstall_patch",
    "wait_all_post_step_broadcasts",
    "wait_all_reduces",
    "wait_all_replicate_broadcasts",
]

install_patch()  # fully_shard after dedicate_params skips dmuon's parameters (the API reference's order)
