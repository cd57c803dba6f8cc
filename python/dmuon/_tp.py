"""Tensor parallelism through DTensor. Parameters that ``parallelize_module`` (ColwiseParallel,
RowwiseParallel, ...) turned into DTensors on a mesh dimension that is none of ``dedicate_params``'
data-parallel dimensions (the TP axis, found by name-set difference) go to dmuon's C++ TP path as their
local slices: the module's parameter becomes a plain Parameter holding the slice (same name, so hooks,
placeholders and gradients work as for any parameter), the split dimension comes from the placement
(``Shard(d)``: split on d; ``Replicate()``: whole on every TP rank), and each forward of the module sees
the DTensor again, rebuilt from the slice (``DTensor.from_local``, differentiable: the gradient reaches
the slice, partial sums reduced over TP as the placement says)."""

import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn


def _dtensor_types():
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Replicate, Shard


def is_dtensor(p) -> bool:
    DTensor, _, _ = _dtensor_types()
    return isinstance(p, DTensor)


@dataclass
class TpParam:
    """One TP DTensor parameter and what rebuilds it from its local slice."""

    name: str
    owners: List[Tuple[nn.Module, str]]  # (module, attribute): a tied parameter lives in several modules
    dtensor: Optional[nn.Parameter]      # the original, until dedicate_params succeeded (restore_dtensors)
    split_dim: int                       # -1: whole (Replicate on the TP axis)
    local: Optional[nn.Parameter] = None
    layout: Optional[tuple] = None       # (device_mesh, placements, shape, stride): what rebuilds the DTensor
    handed: bool = False                 # not dedicated, and given back to FSDP2 as a DTensor (hand_to_fsdp2)


# The local slices of TP parameters that dedicate_params did not dedicate, until fully_shard takes one
# (hand_to_fsdp2): id(slice Parameter) -> (a weak reference to it, a weak reference to its record, which the
# model's dmuon state holds); an entry whose slice was freed goes with it (tensors compare element-wise, so
# they cannot be the keys of a WeakKeyDictionary). Weak both ways: the record holds the modules that hold the
# slice, so holding it here kept a dropped model's slices alive for good.
_UNDEDICATED: Dict[int, Tuple["weakref.ref", "weakref.ref"]] = {}


def _take_undedicated(p) -> Optional[TpParam]:
    entry = _UNDEDICATED.pop(id(p), None)
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def _dp_names(mesh, replicate_mesh) -> set:
    from torch.distributed.device_mesh import DeviceMesh

    names = set()
    for m in (mesh, replicate_mesh):
        if isinstance(m, DeviceMesh):
            names |= set(m.mesh_dim_names or ())
    return names


def find_tp_params(model: nn.Module, mesh, replicate_mesh, fn: str) -> Tuple[Optional[dist.ProcessGroup], List[TpParam]]:
    """The TP axis's group (None without TP DTensors) and the TP DTensor parameters, in model order.
    Refuses DTensors that are sharded on a data-parallel dimension (fully_shard ran first), Partial
    placements, uneven slices, unnamed meshes and more than one TP group."""
    DTensor, Replicate, Shard = _dtensor_types()
    dp_names = _dp_names(mesh, replicate_mesh)
    found: Dict[int, TpParam] = {}
    groups = {}
    for module_name, module in model.named_modules():
        for attr, p in module._parameters.items():
            if p is None or not isinstance(p, DTensor):
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            if id(p) in found:  # tied: the same DTensor in another module
                found[id(p)].owners.append((module, attr))
                continue
            dmesh = p.device_mesh
            names = dmesh.mesh_dim_names or ()
            sharded = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
            if any(names and names[i] in dp_names for i in sharded):
                raise ValueError(
                    f"{fn}: parameter '{name}' is already a DTensor sharded on the data-parallel mesh dimension(s) "
                    f"{[names[i] for i in sharded if names[i] in dp_names]}: fully_shard ran before {fn}. Call "
                    f"dmuon.{fn}(model, mesh, ...) first, then fully_shard."
                )
            if not names or not dp_names or all(n in dp_names for n in names):
                raise ValueError(
                    f"{fn}: parameter '{name}' is already a DTensor: fully_shard (or parallelize_module) ran before "
                    f"{fn}. Call dmuon.{fn}(model, mesh, ...) first, then fully_shard. With tensor parallelism, name "
                    "the meshes (init_device_mesh(..., mesh_dim_names=('replicate', 'shard', 'tp'))) and pass the "
                    "named data-parallel sub-meshes as mesh (and replicate_mesh): the TP axis is the DTensor "
                    "parameters' other mesh dimension."
                )
            tp_dims = [i for i, n in enumerate(names) if n not in dp_names]
            if len(tp_dims) != 1:
                raise ValueError(
                    f"{fn}: parameter '{name}' lives on mesh dimensions {list(names)}, of which {len(tp_dims)} are not "
                    f"data-parallel ({sorted(dp_names)}); dmuon takes exactly one tensor-parallel dimension."
                )
            i = tp_dims[0]
            for j, pl in enumerate(p.placements):
                if j != i and not isinstance(pl, Replicate):
                    raise ValueError(f"{fn}: parameter '{name}' has placement {pl} on mesh dimension '{names[j]}'; "
                                     "dmuon takes DTensors that are sharded on the TP dimension only.")
            placement = p.placements[i]
            T = dmesh.size(i)
            if isinstance(placement, Shard):
                d = placement.dim % p.dim()
                if p.shape[d] % T:
                    raise ValueError(f"{fn}: parameter '{name}' (shape {tuple(p.shape)}) is split on dim {d} over "
                                     f"{T} TP ranks unevenly; dmuon's TP path needs equal slices.")
            elif isinstance(placement, Replicate):
                d = -1
            else:
                raise ValueError(f"{fn}: parameter '{name}' has placement {placement} on the TP dimension; dmuon "
                                 "takes Shard(d) or Replicate() there.")
            group = dmesh.get_group(i)
            groups[tuple(sorted(dist.get_process_group_ranks(group)))] = group
            found[id(p)] = TpParam(name, [(module, attr)], p, d)
    if len(groups) > 1:
        raise ValueError(f"{fn}: the model's DTensor parameters use {len(groups)} different TP groups "
                         f"({sorted(groups)}); dmuon takes one tensor-parallel axis.")
    return (next(iter(groups.values())) if groups else None), list(found.values())


def _copy_user_attributes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """What the user attached to a parameter (flags, tags), from one Parameter object to its replacement."""
    for key, value in src.__dict__.items():
        if key != "_is_param":
            setattr(dst, key, value)


def swap_in_local_slices(params: List[TpParam]) -> None:
    """Each TP DTensor parameter becomes a plain Parameter holding its local slice, in every module that
    holds it, with the attributes the user set on the DTensor (the DTensor is kept until dedicate_params
    succeeded, its layout to rebuild it in forward)."""
    for tp in params:
        d = tp.dtensor
        tp.layout = (d.device_mesh, d.placements, d.shape, d.stride())
        tp.local = nn.Parameter(d.to_local().detach(), requires_grad=d.requires_grad)
        _copy_user_attributes(d, tp.local)
        for module, attr in tp.owners:
            module._parameters[attr] = tp.local


def restore_dtensors(params: List[TpParam]) -> None:
    """Undoes swap_in_local_slices (dedicate_params failed: the model is the caller's again)."""
    for tp in params:
        for module, attr in tp.owners:
            module._parameters[attr] = tp.dtensor


def release_dtensors(params: List[TpParam]) -> None:
    """Drops the original DTensors once dedicate_params succeeded: their storage is the slices' first
    storage, which dmuon's routes replace (packed buffers, Z3 placeholders) and must be free to release."""
    for tp in params:
        tp.dtensor = None


def register_undedicated(params: List[TpParam]) -> None:
    """After dedicate_params marked its owners: the slices it did not dedicate, for hand_to_fsdp2."""
    for tp in params:
        if not hasattr(tp.local, "_dedicated_owner_rank"):
            key = id(tp.local)
            _UNDEDICATED[key] = (weakref.ref(tp.local, lambda _, key=key: _UNDEDICATED.pop(key, None)), weakref.ref(tp))


def hand_to_fsdp2(modules) -> None:
    """Before fully_shard lists the parameters of ``modules``: each TP slice dmuon did not dedicate becomes
    the DTensor again (over the same storage, with the user's attributes), in every module that holds it,
    so FSDP2 shards the DTensor on its data-parallel mesh the way FSDP2 + TP does without dmuon, instead of
    taking the slice for the whole parameter. dmuon's forward hooks leave it alone from then on, and the
    runtime forgets it (the next _sync_external). Local."""
    for module in modules:
        for attr, p in list(module._parameters.items()):
            tp = _take_undedicated(p) if p is not None else None
            if tp is None or tp.handed:
                continue
            dtensor = nn.Parameter(_as_dtensor(tp, p.detach()), requires_grad=p.requires_grad)
            _copy_user_attributes(p, dtensor)
            for owner, name in tp.owners:
                owner._parameters[name] = dtensor
            tp.handed = True


def is_tp_slice(params: List[TpParam], name: str) -> bool:
    """Whether ``name`` is a TP parameter that dmuon holds as its local slice (not handed to FSDP2)."""
    return any(tp.name == name and not tp.handed for tp in params)


def show_dtensors(params: List[TpParam], fn):
    """``fn(name, param)`` (a user's predicate, policy or resolver) seeing each TP parameter as the DTensor
    it was given (full shape, placements) rather than the local slice dmuon swapped in; None stays None."""
    if fn is None or not params:
        return fn
    originals = {tp.name: tp.dtensor for tp in params}

    def call(name, param):
        return fn(name, originals.get(name, param))

    return call


def _as_dtensor(tp: TpParam, local: torch.Tensor):
    DTensor, _, _ = _dtensor_types()
    mesh, placements, shape, stride = tp.layout
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def install_dtensor_hooks(params: List[TpParam]) -> list:
    """Forward hooks that show each module its TP parameters as DTensors over the current local slices,
    and take them away again after the forward. Registered after dmuon's boundary hooks, so on a module
    that is itself a boundary they run after its slices were unsharded."""
    by_module: Dict[int, Tuple[nn.Module, List[Tuple[str, TpParam]]]] = {}
    for tp in params:
        for module, attr in tp.owners:
            by_module.setdefault(id(module), (module, []))[1].append((attr, tp))
    handles = []
    missing = object()
    for module, items in by_module.values():
        saved: list = []  # what each (possibly nested) call of the module found in its __dict__

        def pre(mod, args, items=items, saved=saved):
            active = [(attr, tp) for attr, tp in items if not tp.handed]  # FSDP2 shows the handed ones itself
            saved.append((active, [mod.__dict__.get(attr, missing) for attr, _ in active]))
            for attr, tp in active:
                mod.__dict__[attr] = _as_dtensor(tp, tp.local)

        def post(mod, args, output, saved=saved):
            if not saved:
                return
            active, before = saved.pop()
            for (attr, _), value in zip(active, before):
                if value is missing:
                    mod.__dict__.pop(attr, None)
                else:
                    mod.__dict__[attr] = value

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    return handles
