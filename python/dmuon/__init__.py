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
    __version__,
    direct_newton_schulz,
    get_backend_status,
    get_ns_backend,
    gram_newton_schulz,
    gram_newton_schulz_factors,
    newton_schulz,
)
from ._runtime import (  # noqa: E402
    Muon,
    dedicate_params,
    dedicate_params_ddp,
    get_dedicated_params,
    get_model_state_dict,
    no_sync,
    replicate,
    set_model_state_dict,
)
from ._ns import (  # noqa: E402
    gram_newton_schulz_distributed_local,
    gram_newton_schulz_distributed_local_batched,
    gram_newton_schulz_q,
)

__all__ = [
    "__version__",
    "Muon",
    "NewtonSchulz",
    "POLAR_EXPRESS_COEFFICIENTS",
    "YOU_COEFFICIENTS",
    "dedicate_params",
    "dedicate_params_ddp",
    "direct_newton_schulz",
    "get_backend_status",
    "get_dedicated_params",
    "get_model_state_dict",
    "get_ns_backend",
    "gram_newton_schulz",
    "gram_newton_schulz_distributed_local",
    "gram_newton_schulz_distributed_local_batched",
    "gram_newton_schulz_factors",
    "gram_newton_schulz_q",
    "newton_schulz",
    "no_sync",
    "replicate",
    "set_model_state_dict",
]
