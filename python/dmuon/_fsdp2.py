"""FSDP2 composition: keep ``fully_shard`` off dmuon's dedicated parameters, and find what FSDP2 took.

``import dmuon`` installs a patch of FSDP2's ``_get_managed_states`` (the function that lists the
parameters a ``fully_shard`` call manages) so that every parameter marked ``_dedicated_owner_rank`` by
:func:`dmuon.dedicate_params` is skipped, exactly as if it had been passed in ``ignored_params``, and a
tensor-parallel parameter dmuon holds as its local slice but does not train goes to FSDP2 as its DTensor.
:func:`ignored_params` gives the same set for the public ``fully_shard(ignored_params=...)`` argument.
"""

import inspect
import sys
import warnings
import weakref
from typing import List, Optional, Set

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

_ORIGINAL = None  # FSDP2's own _get_managed_states while the patch is installed
# id(param) -> (weak reference to it, weak reference to its model's dmuon state, its name): parameters dmuon
# does not dedicate that param_policy's param_dtype cast at dedicate_params (dmuon keeps their full-precision
# masters), until fully_shard takes one. Weak both ways: the runtime holds the parameter, so an entry holding
# the runtime kept a dropped model's parameters and runtime alive for good.
_CAST = {}


def register_cast(state, params) -> None:
    """Records `params` ((name, parameter) pairs dmuon does not dedicate, cast by param_policy and kept with a
    master by `state` (the model's _State: its runtime, and its guard, the check of its parameters' dtypes)):
    fully_shard may take them back in their master precision (restore_masters)."""
    for name, p in params:
        key = id(p)
        _CAST[key] = (weakref.ref(p, lambda _, key=key: _CAST.pop(key, None)), weakref.ref(state), name)


# Every parameter of a dedicated model -> the sorted global ranks dmuon averages its gradients over (the
# data-parallel ranks: shard x replicate, at this rank's TP position). fully_shard's mesh must span the same.
_DP_RANKS = WeakIdKeyDictionary()


def register_dp_ranks(params, ranks) -> None:
    """Records the data-parallel ranks of a dedicated model's parameters (dedicate_params)."""
    ranks = tuple(sorted(int(r) for r in ranks))
    for p in params:
        _DP_RANKS[p] = ranks


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel of the first caller outside torch and dmuon (the user's fully_shard call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and any(part in frame.f_code.co_filename for part in ("/torch/", "/dmuon/")):
        frame, level = frame.f_back, level + 1
    return level


def _fully_shard_local(name: str, attr: str):
    """The local `name` (an object with `attr`) of the fully_shard call running now -- its mp_policy or mesh
    argument, read from its frame (_get_managed_states is called by it) -- or None where it cannot be found."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return None
        value = frame.f_locals.get(name)
        if value is not None and hasattr(value, attr):
            return value
    return None


def _fully_shard_mp_policy():
    return _fully_shard_local("mp_policy", "param_dtype")


def _named_params(modules):
    """(name under the fully_shard call's module, module, parameter) of each parameter `modules` hold directly."""
    children = {id(c) for m in modules for c in m.children()}
    prefix = {}
    for root in (m for m in modules if id(m) not in children):  # the modules fully_shard was given
        prefix.update((id(m), n) for n, m in root.named_modules())
    for module in modules:
        at = prefix.get(id(module), "")
        for name, p in module.named_parameters(recurse=False):
            yield (f"{at}.{name}" if at else name), module, p


def _check_mesh(modules) -> None:
    """fully_shard's mesh spans the ranks dmuon averages the model's gradients over: FSDP2 on the 2-D (replicate,
    shard) mesh while dedicate_params was given its shard axis alone (no replicate_mesh), or the reverse, averaged
    the FSDP2 parameters over other ranks than the Muon matrices, and the replicas drifted apart without a word."""
    mesh = _fully_shard_local("mesh", "mesh_dim_names")
    if mesh is None:
        return
    for name, _, p in _named_params(modules):
        dp = _DP_RANKS.get(p)
        if dp is None:
            continue
        spans = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
        if spans == dp:
            return
        from ._runtime import _rank

        raise ValueError(
            f"rank {_rank()}: fully_shard: its mesh spans global ranks {list(spans)}, but dmuon averages the "
            f"gradients of this model ('{name}', ...) over {list(dp)} (dedicate_params' mesh, with replicate_mesh on "
            "HSDP), so the parameters FSDP2 trains and the Muon matrices would be averaged over different ranks and "
            "the replicas would drift apart. HSDP: dedicate_params(model, mesh['shard'], predicate, "
            "replicate_mesh=mesh['replicate']) and fully_shard(..., mesh=mesh) on the 2-D mesh; 1-D: one mesh for both.")


def _warn_compute_dtypes(modules, policy) -> None:
    """fully_shard computes its parameters in mp_policy's param_dtype; dmuon's dedicated matrices in these modules
    keep theirs (param_policy's param_dtype; compute_dtype is the communication dtype only). Their first forward
    then failed with torch's bare "must have the same dtype" error: warned here, naming the fix (once per call)."""
    if policy is None or policy.param_dtype is None:
        return
    for name, _, p in _named_params(modules):
        if hasattr(p, "_dedicated_owner_rank") and p.dtype != policy.param_dtype:
            warnings.warn(
                f"dmuon: fully_shard computes its parameters in {policy.param_dtype} "
                f"(mp_policy=MixedPrecisionPolicy(param_dtype=...)), but dmuon's dedicated matrix '{name}' stays "
                f"{p.dtype}: a forward mixing them fails with torch's dtype error (unless it runs under autocast). "
                f"Give dedicate_params param_policy={{'defaults': {{'param_dtype': {policy.param_dtype}}}}} (dmuon "
                f"then keeps the {p.dtype} masters).",
                stacklevel=_user_stacklevel())
            return


def restore_masters(modules, ignored=()) -> None:
    """Before fully_shard lists the parameters of ``modules`` (but ``ignored``, left to dmuon), for each one
    param_policy cast at dedicate_params (dmuon keeps its full-precision master; FSDP2 keeps none of its own, so
    its shards, AdamW state and checkpoints would hold the cast precision and small updates would vanish): where
    fully_shard is given a compute dtype (mp_policy=MixedPrecisionPolicy(param_dtype=...)), the parameter takes
    its master's value and dtype again, so FSDP2 shards the master and computes in its policy's dtype; without
    one it stays in the cast dtype (the model computes as dedicate_params left it), with a warning (once per
    model) saying how to keep the master. Local."""
    policy = _fully_shard_mp_policy()
    give_masters = policy is not None and policy.param_dtype is not None
    ignored = {id(p) for p in ignored}
    warn = None
    for module in modules:
        for p in module._parameters.values():
            if p is None or id(p) in ignored:
                continue
            entry = _CAST.pop(id(p), None)
            state = entry[1]() if entry is not None and entry[0]() is p else None
            if state is None:
                continue
            runtime, guard, name = state.runtime, state.guard, entry[2]
            master = runtime.master_of(name)
            if master is None:
                continue
            if give_masters:
                guard.forget({name})  # FSDP2's to convert from here (the guard would see a dtype change)
                p.data = master.detach().clone()
            elif warn is None and not getattr(guard, "cast_warned", False):  # once per model
                guard.cast_warned = True
                warn = (name, p.dtype, master.dtype)
    if warn is not None:
        name, cast, kept = warn
        warnings.warn(
            f"dmuon: fully_shard takes parameters param_policy cast to {cast} at dedicate_params ('{name}', ...), "
            f"and FSDP2 keeps no {kept} master of its own: their shards, AdamW state and checkpoints hold {cast}, "
            f"and updates smaller than its precision are lost. Give fully_shard mp_policy=MixedPrecisionPolicy("
            f"param_dtype={cast}): dmuon then hands FSDP2 the {kept} masters and FSDP2 computes in {cast}.",
            stacklevel=_user_stacklevel())


def _fsdp_init():
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_init
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return None
    return _fsdp_init if hasattr(_fsdp_init, "_get_managed_states") else None


def _dedicated_in(modules) -> Set[nn.Parameter]:
    out = set()
    for module in modules:
        for _, p in module.named_parameters(recurse=False):
            if hasattr(p, "_dedicated_owner_rank"):
                out.add(p)
    return out


def _call_get_managed_states(original, modules, ignored_params):
    """FSDP2's _get_managed_states with dmuon's parameters ignored: torch >= 2.7 takes the ignored set,
    torch 2.6 takes modules only (the dedicated parameters are then filtered from its result)."""
    from ._tp import hand_to_fsdp2

    _check_mesh(modules)  # (before anything changes)
    hand_to_fsdp2(modules)  # TP slices dmuon does not train: FSDP2 gets their DTensors, not the slices
    _warn_compute_dtypes(modules, _fully_shard_mp_policy())
    restore_masters(modules, ignored_params or ())  # parameters param_policy cast: FSDP2 gets their masters
    dedicated = _dedicated_in(modules)
    if len(inspect.signature(original).parameters) >= 2:
        params, buffers = original(modules, set(ignored_params or ()) | dedicated)
    else:
        params, buffers = original(modules)
        params = [p for p in params if p not in dedicated]
    _refuse_replicated(modules, params)
    return params, buffers


def _refuse_replicated(modules, params) -> None:
    """fully_shard after dmuon.replicate took the same parameters (the API reference's RuntimeError): both would
    average their gradients and step them."""
    taken = {id(p) for p in params if getattr(p, "_dmuon_replicated", False)}
    if not taken:
        return
    named = {}  # each parameter by its longest name: under the highest module holding it (fully_shard's)
    for m in modules:
        for n, p in m.named_parameters():
            if id(p) in taken and len(n) > len(named.get(id(p), "")):
                named[id(p)] = n
    names = sorted(named.values())
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise RuntimeError(
        f"fully_shard: {shown} {'is' if len(names) == 1 else 'are'} already replicated by dmuon.replicate, which "
        f"averages {'its gradient' if len(names) == 1 else 'their gradients'} for Muon to step. Train the non-dedicated parameters with one of the two: "
        "fully_shard before Muon (no dmuon.replicate), or dmuon.replicate without fully_shard.")


def install_patch() -> None:
    """Installs the FSDP2 patch that makes ``fully_shard`` skip the parameters dedicated by
    :func:`dmuon.dedicate_params` (marked ``_dedicated_owner_rank``), leaving them to dmuon. ``import dmuon``
    calls it; calling it again does nothing. Patched: ``torch.distributed.fsdp._fully_shard._fsdp_init.
    _get_managed_states``. The reverse is :func:`uninstall_patch`."""
    global _ORIGINAL
    module = _fsdp_init()
    if module is None or _ORIGINAL is not None:
        return
    original = module._get_managed_states

    def _get_managed_states(modules, ignored_params=None):
        return _call_get_managed_states(original, modules, ignored_params)

    _get_managed_states.__wrapped__ = original
    _ORIGINAL = original
    module._get_managed_states = _get_managed_states


def uninstall_patch() -> None:
    """Restores FSDP2's own ``_get_managed_states`` (undoes :func:`install_patch`); idempotent."""
    global _ORIGINAL
    module = _fsdp_init()
    if module is None or _ORIGINAL is None:
        return
    module._get_managed_states = _ORIGINAL
    _ORIGINAL = None


def ignored_params(model: nn.Module) -> Set[nn.Parameter]:
    """The parameters of ``model`` that dmuon owns (dedicated by :func:`dmuon.dedicate_params`), for
    ``fully_shard(module, ..., ignored_params=dmuon.ignored_params(model))`` (torch >= 2.7): FSDP2 then
    neither shards them nor reduces their gradients. Not needed while the patch is installed."""
    return {p for p in model.parameters() if hasattr(p, "_dedicated_owner_rank")}


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor")


def shard_of(g: torch.Tensor):
    """A gradient as (local tensor, counted, counts_param) for a norm summed over every rank: a DTensor's
    local shard is counted on the ranks at coordinate 0 of every mesh dimension it is replicated over (HSDP's
    replicate axis), so each element once; its parameter once, on the ranks at coordinate 0 everywhere. A
    plain tensor: itself, counted."""
    if not is_dtensor(g):
        return g, True, True
    from torch.distributed.tensor import Replicate

    coords = g.device_mesh.get_coordinate() or []
    counted = all(c == 0 for c, pl in zip(coords, g.placements) if isinstance(pl, Replicate))
    return g.to_local(), counted, counted and all(c == 0 for c in coords)


def fsdp_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (FSDPModule instances)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's full value on every rank (collective over its mesh); a plain tensor as is."""
    return p.full_tensor() if is_dtensor(p) else p


def assign_full(p: torch.Tensor, value: torch.Tensor, name: Optional[str] = None) -> None:
    """Writes the full `value` into parameter `p` (a DTensor: this rank's shard of it; a plain tensor: all of
    it). Every rank passes the same full value."""
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(
            f"'{name}' has shape {tuple(value.shape)} in the state dict but "
            f"{tuple(p.shape)} in the model. Pass a state dict of this architecture."
        )
    with torch.no_grad():
        if is_dtensor(p):
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(value.to(device=p.to_local().device, dtype=p.dtype), p.device_mesh,
                                      p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())
        else:
            p.copy_(value.to(p.dtype))
