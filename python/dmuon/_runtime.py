"""Dedicated ownership of an ordinary PyTorch model: the model is handed to the C++ runtime as data
(its parameters, buffers and module tree), forward boundaries are module hooks that enter and leave
dmuon's C++ boundary scopes, and everything in backward stays in C++ (AccumulateGrad node hooks,
identity autograd functions, the engine's end-of-backward callback)."""

import contextlib
import json
import math
import numbers
import operator
import sys
import warnings
import weakref
import zlib
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from . import _C
from ._clip import MuonGradClipStats, python_strategy, registered_strategies, run_python_strategy
from ._fsdp2 import assign_full, fsdp_modules, full_tensor, is_dtensor, register_cast, register_dp_ranks, shard_of
from ._mesh import _registered, add_sharded_unshard_group, make_mesh
from ._tp import (find_tp_params, install_dtensor_hooks, is_tp_slice, register_undedicated, release_dtensors,
                  restore_dtensors, show_dtensors, swap_in_local_slices)


class _State:
    """What dmuon keeps on a dedicated model (``model._dmuon``)."""

    def __init__(self, runtime, mesh, world_group, hooks, params, guard):
        self.runtime = runtime
        self.world_group = world_group  # the torch group of the mesh's ranks (dmuon's clone under "isolated")
        self.rank = _rank()   # this process's global rank (for messages after its group is gone)
        self.guard = guard    # raises when a parameter changed dtype or device after dedicate_params
        self.mesh = mesh
        self.hooks = hooks
        self.replicated = False  # replicate or replicate_tp ran
        self.replicated_tp = False  # replicate_tp ran
        self.params = params  # name -> the Parameter object dedicate_params saw
        self.external = {}    # name -> the DTensor parameter FSDP2 put in its place (trained by Muon's AdamW)
        self.tp_split = {}    # TP-split parameters (their local slices are the module's parameters) -> split dim
        self.tp_params = []    # every TP DTensor parameter dedicate_params swapped for its local slice (_tp.TpParam)
        self.dp_ranks = None  # with TP: the global ranks at this rank's TP position (replicate_tp's mesh)
        self.groups = None    # _mesh.MeshGroups: the mesh's torch groups
        self.comm_options = {}  # tp_buffer_reuse, replicate_broadcast_bucket_mb as dedicate_params lowered them


# The API reference's names for the callables dedicate_params takes (each called with a parameter's fully
# qualified name and the parameter).
HookBoundaryResolver = Callable[[str, nn.Parameter], Union[nn.Module, str]]  # its boundary module (or its name)
AssignmentGroupKeyFn = Callable[[str, nn.Parameter], str]  # the owner assignment's group key
RouteHintFn = Callable[[str, nn.Parameter], str]  # "muon", "adamw", "sharded_adamw" ("" or None: the default)
ParamPolicyFn = Callable[[str, nn.Parameter], Optional[Mapping[str, object]]]  # param_policy's fields for it


def _sync_external(model: nn.Module, state: _State) -> Dict[str, nn.Parameter]:
    """Finds the parameters FSDP2 (fully_shard) replaced with its DTensor shards since dedicate_params and
    hands them over: the runtime forgets them, Muon trains them with AdamW on the shards, the state dicts
    read and write them through DTensor. Local; idempotent."""
    fresh = []
    unsharded = [n for n, p in model.named_parameters()
                 if state.params.get(n) is not None and state.params[n] is not p and not is_dtensor(p)]
    if unsharded:  # FSDP2 keeps the root's parameters unsharded after a forward: its shards are registered again
        for module in fsdp_modules(model):
            module.reshard()
    for name, p in model.named_parameters():
        seen = state.params.get(name)
        if seen is None or seen is p or name in state.external:
            continue
        if not is_dtensor(p):
            raise ValueError(
                f"dmuon: parameter '{name}' was replaced after dedicate_params by a plain tensor (not an FSDP2 "
                "DTensor shard), so dmuon's hooks and routes no longer see it. Replace parameters (or call "
                "model.to(...)) before dedicate_params, never after."
            )
        if is_tp_slice(state.tp_params, name):
            raise ValueError(
                f"dmuon: parameter '{name}' is a tensor-parallel DTensor parameter that is not dedicated, and "
                "fully_shard took its local slice, which FSDP2 shards as if it were the whole parameter: dmuon's "
                "FSDP2 patch, which hands FSDP2 the DTensor instead, was not installed (dmuon.uninstall_patch() ran, "
                "or fully_shard was called through another path). Call dmuon.install_patch() before fully_shard, "
                "or dedicate the parameter (predicate), or leave it to dmuon (dmuon.replicate_tp) and keep it out of "
                "fully_shard (fully_shard(..., ignored_params={...}))."
            )
        fresh.append((name, p))
    if fresh:
        # FSDP2 holds them now: the runtime forgets them, frozen ones too (the state dicts read and write their
        # shards; nothing trains a frozen one)
        state.runtime.release_params([n for n, _ in fresh])
        state.guard.forget({n for n, _ in fresh})
        state.external.update(fresh)
    return state.external


def _trained_external(state: _State) -> Dict[str, nn.Parameter]:
    """The FSDP2 parameters Muon's AdamW trains: those not frozen at dedicate_params."""
    return {n: p for n, p in state.external.items() if state.params[n].requires_grad}


def _compiled_autograd_on() -> bool:
    """Whether torch's compiled autograd is switched on (config flag or its context), without importing
    Dynamo when nothing did."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(dynamo.config.compiled_autograd) or bool(ca is not None and ca.compiled_autograd_enabled)


def _param_guard(params, world_group=None):
    """A check, run at every forward and step, that no parameter dmuon holds changed dtype or device after
    dedicate_params: model.to / .half() / .cuda() replace its data and its gradient accumulator, so
    dmuon's gradient hooks would be gone and it would silently stop training. Also refuses compiled
    autograd, which would run backward without those hooks. And a parameter frozen at dedicate_params (no
    route, no optimizer state) that requires a gradient now: nothing would ever update it. And the model's
    process group destroyed (destroy_process_group) since: dmuon would go on over a group torch has let go."""
    kept = [(n, p, p.dtype, p.device) for n, p in params]
    frozen = [(n, p) for n, p in params if not p.requires_grad]
    me = _rank()

    def check():
        _require_live_group(world_group, me)
        if _compiled_autograd_on():
            raise RuntimeError(
                "dmuon: torch's compiled autograd is on (torch._dynamo.config.compiled_autograd or its context), "
                "but dmuon's gradient hooks are C++ autograd node hooks that compiled autograd does not run: the "
                "dedicated matrices would silently stop training. Turn it off (torch._dynamo.config."
                "compiled_autograd = False); torch.compile on the blocks (layer.compile()) works as it is."
            )
        for name, p, dtype, device in kept:
            if p.dtype != dtype or p.device != device:
                raise ValueError(
                    f"dmuon: parameter '{name}' changed from {dtype} on {device} to {p.dtype} on {p.device} after "
                    "dedicate_params (model.to / .half() / .cuda()?). That replaces its gradient accumulator, so "
                    "dmuon's gradient hooks are gone and it would stop training silently. Convert the model before "
                    "dedicate_params; for bf16 compute with fp32 masters pass param_policy={'defaults': "
                    "{'param_dtype': torch.bfloat16}}."
                )
        for name, p in frozen:
            if p.requires_grad:
                raise ValueError(
                    f"dmuon: parameter '{name}' was frozen (requires_grad=False) when dedicate_params ran, so it has "
                    "no route and no optimizer state, but it requires a gradient now: dmuon would never update it "
                    "and its .grad would only grow. Unfreeze it before dedicate_params (a group with lr=0 keeps it "
                    "still until it should train), or keep it frozen."
                )

    def forget(names):  # parameters another wrapper took (FSDP2): theirs to convert
        kept[:] = [k for k in kept if k[0] not in names]
        frozen[:] = [f for f in frozen if f[0] not in names]

    check.forget = forget
    return check


# Every parameter of a dedicated model -> its model's world group (weak keys: an entry goes with its parameter).
# dmuon.GradScaler agrees a torch optimizer's inf check over it: after its reduce, a dedicated matrix's gradient
# lives on its owner alone, and a sharded_adamw gradient is each rank's own slice.
_WORLD_OF_PARAM = WeakIdKeyDictionary()


def _world_groups_of(params) -> list:
    """The world groups of the dedicated models (of more than one rank) some of `params` belong to."""
    out = []
    for p in params:
        g = _WORLD_OF_PARAM.get(p) if isinstance(p, torch.Tensor) else None
        if g is not None and all(g is not o for o in out):
            out.append(g)
    return out


def _state_of(model: nn.Module, fn: str, local: bool = False) -> _State:
    """The model's dmuon state; ``local``: for a call that needs no process group (inspection), which goes on
    after the group was destroyed."""
    state = getattr(model, "_dmuon", None)
    if state is None:
        raise ValueError(
            f"{fn}: this model was not dedicated. Call dmuon.dedicate_params(model, mesh, predicate) first, on every rank."
        )
    if not local:
        _require_live_group(state.world_group, state.rank)
    return state


def _require_live_group(world_group, rank: int) -> None:
    """Raises where the model's process group was destroyed since dedicate_params (``rank``: this rank's, then)."""
    if world_group is not None and not _registered(world_group):
        raise RuntimeError(
            f"rank {rank}: dmuon: this model's process group was destroyed (torch.distributed."
            "destroy_process_group) after dedicate_params, and a dedicated model lives on its mesh's groups: "
            "build the model again (or load it from a checkpoint) and dedicate it on the new process group."
        )


def _tied_names(model: nn.Module) -> Dict[str, List[str]]:
    """A tied parameter's other names (held by several modules), under its first name."""
    first, aliases = {}, {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.setdefault(first[id(p)], []).append(n)
        else:
            first[id(p)] = n
    return aliases


def _model_view(model: nn.Module):
    params = [(n, p) for n, p in model.named_parameters()]  # tied parameters once (their first name)
    buffers = [(n, b) for n, b in model.named_buffers()]
    modules, index = [], {}
    by_name = dict(model.named_modules())
    for name, m in by_name.items():
        parent = -1 if name == "" else index[name.rpartition(".")[0]]
        index[name] = len(modules)
        modules.append((name, parent, _is_container(m, by_name.get(name.rpartition(".")[0]) if name else None)))
    return params, buffers, modules


def _is_container(module: nn.Module, parent: Optional[nn.Module] = None) -> bool:
    """A module whose forward never runs: one without a forward of its own (ModuleList, ModuleDict, ParameterList,
    ParameterDict), or one whose parent reads its parameters instead of calling it (nn.MultiheadAttention's
    out_proj: F.multi_head_attention_forward takes out_proj.weight). Its forward hooks never run, so it cannot be
    a hook boundary: its parameters' boundary is the lowest ancestor that runs (the attention module)."""
    return type(module).forward is nn.Module.forward or isinstance(parent, nn.MultiheadAttention)


def _boundary_resolver(model: nn.Module, predicate: Callable[[nn.Module], bool], strict: bool):
    """hook_boundary_predicate on Python modules, as the C++ runtime's name -> boundary resolver: the lowest
    ancestor matching it that runs a forward (a container such as ModuleList never does) and holds every module
    using the parameter (a tied one has several); without a match, that lowest ancestor itself (an error in
    strict mode, but for a tied parameter, whose boundary has no other choice)."""
    modules = dict(model.named_modules())
    tied = _tied_names(model)

    def resolve(name: str, _param) -> str:
        holders = [n.split(".")[:-1] for n in [name] + tied.get(name, [])]
        parts = holders[0]
        for other in holders[1:]:  # the lowest module holding every user
            common = 0
            while common < min(len(parts), len(other)) and parts[common] == other[common]:
                common += 1
            parts = parts[:common]
        lowest = None
        for i in range(len(parts), -1, -1):  # the lowest ancestor first
            candidate = ".".join(parts[:i])
            module = modules.get(candidate)
            if module is None or (_is_container(module, modules.get(".".join(parts[:i - 1]))) and i > 0):
                continue
            lowest = candidate if lowest is None else lowest
            if predicate(module):
                return candidate
        if strict and len(holders) == 1:  # (a tied parameter's boundary must hold every user: no choice)
            raise ValueError(
                f"dedicate_params: no ancestor module of '{name}' matches hook_boundary_predicate (strict mode). "
                "Widen the predicate so it selects the block that contains this parameter, or pass "
                "hook_boundary_strict=False to fall back to its direct parent module."
            )
        return lowest

    return resolve


def _module_name_resolver(model: nn.Module, resolver, fn: str):
    """hook_boundary_resolver as the core takes it (param name -> boundary module name): the API reference's
    resolver returns the boundary module itself; its qualified name is accepted as well."""
    if not callable(resolver):
        raise TypeError(f"{fn}: hook_boundary_resolver must be a callable (name, param) -> module, got "
                        f"{type(resolver).__name__}.")
    names = {id(m): n for n, m in model.named_modules()}

    def resolve(name, param):
        out = resolver(name, param)
        if isinstance(out, str):
            return out
        if isinstance(out, nn.Module):
            if id(out) not in names:
                raise ValueError(f"{fn}: hook_boundary_resolver returned a {type(out).__name__} for '{name}' that is "
                                 "not a module of the model; return the module (of this model) whose forward runs it.")
            return names[id(out)]
        raise ValueError(f"{fn}: hook_boundary_resolver must return the boundary module (or its name) for '{name}', "
                         f"got {out!r}.")

    return resolve


def _install_zero_grad(model: nn.Module, runtime) -> None:
    """``model.zero_grad()`` drops the gradients dmuon holds outside ``p.grad`` too (a matrix owner's reduced
    sum before step(), sharded_adamw slices), as ``Muon.zero_grad`` does: skipping a batch with the model's
    zero_grad between backward and step drops that batch, as in torch. An attribute of this model object;
    the module's own zero_grad (its class's, looked up at the call: FSDP2 changes the class) does the rest."""

    owner = weakref.ref(model)  # (no reference cycle through the model's own attribute)

    def zero_grad(set_to_none: bool = True) -> None:
        runtime.discard_grads(bool(set_to_none))
        m = owner()
        type(m).zero_grad(m, set_to_none)

    zero_grad.__doc__ = nn.Module.zero_grad.__doc__
    object.__setattr__(model, "zero_grad", zero_grad)


def _install_hooks(model: nn.Module, runtime, guard) -> list:
    """The root's and every boundary's forward hooks: C++ objects (dmuon._C._ForwardHooks) that enter and
    leave the module's boundary scope, registered after any hooks already there (FSDP2's) and always
    called, so a forward that raises still closes its scope. The root also opens every forward pass and
    runs ``guard`` once per forward."""
    modules = dict(model.named_modules())
    handles = []
    boundaries = runtime.boundaries()
    for name in [""] + [b for b in boundaries if b != ""]:
        hooks = _C._ForwardHooks(runtime, name, guard if name == "" else None)
        handles.append(modules[name].register_forward_pre_hook(hooks.pre, with_kwargs=True))
        handles.append(modules[name].register_forward_hook(hooks.post, with_kwargs=True, always_call=True))
    return handles


_POLICY_DTYPES = ("param_dtype", "grad_dtype", "master_dtype", "optim_dtype", "output_dtype")
_POLICY_KEYS = _POLICY_DTYPES + ("route", "cast_forward_inputs", "muon_forward_unshard")
_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16, "fp32": torch.float32,
                "float": torch.float32, "fp64": torch.float64, "double": torch.float64}


def _policy(fields, where: str) -> dict:
    """One policy's fields, checked, with dtypes as torch.dtype (names such as "bfloat16" or "bf16" too)."""
    if not isinstance(fields, Mapping):
        raise TypeError(f"{where}: a policy is a mapping of fields ({', '.join(_POLICY_KEYS)}), got {type(fields).__name__}")
    out = {}
    for key, value in fields.items():
        if key not in _POLICY_KEYS:
            raise ValueError(f"{where}: unknown policy field '{key}'. Known fields: {', '.join(_POLICY_KEYS)}.")
        if key in _POLICY_DTYPES and value is not None and not isinstance(value, torch.dtype):
            dtype = _DTYPE_NAMES.get(str(value)) or getattr(torch, str(value), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{where}: {key}={value!r} is not a dtype (use e.g. torch.bfloat16 or \"bfloat16\").")
            value = dtype
        out[key] = value
    return out


def _policy_options(param_policy, param_policy_fn, fn: str) -> dict:
    """param_policy ({"defaults": {...}, "overrides": [{"match": "tokens", ...}, ...]}) as the ordered
    (match, fields) list the core applies (the defaults first, matching every name), or param_policy_fn
    wrapped to return checked fields."""
    if param_policy is not None and param_policy_fn is not None:
        raise ValueError(f"{fn}: param_policy and param_policy_fn are mutually exclusive; pass one.")
    out = {}
    if param_policy is not None:
        if not isinstance(param_policy, Mapping) or set(param_policy) - {"defaults", "overrides"}:
            raise ValueError(
                f"{fn}: param_policy must be a mapping with 'defaults' (fields for every parameter) and/or "
                "'overrides' (a list of {'match': 'name tokens', field: value, ...}, later ones win)."
            )
        rules = [("", _policy(param_policy.get("defaults") or {}, f"{fn}: param_policy['defaults']"))]
        for i, o in enumerate(param_policy.get("overrides") or ()):
            o = dict(o)
            if not isinstance(o.get("match"), str):
                raise ValueError(f"{fn}: param_policy['overrides'][{i}] needs a 'match' string (space-separated name tokens).")
            match = o.pop("match")
            rules.append((match, _policy(o, f"{fn}: param_policy['overrides'][{i}]")))
        out["param_policy"] = rules
    if param_policy_fn is not None:
        def policy_fn(name, param):
            r = param_policy_fn(name, param)
            return None if r is None else _policy(r, f"{fn}: param_policy_fn('{name}')")
        out["param_policy_fn"] = policy_fn
    return out


def _options_or_failure(build):
    """``build()``'s options, or ({}, the exception it raised): a refusal on one rank is agreed with the others
    inside the core's setup (:func:`_dedicate`), not raised before they wait in a collective."""
    try:
        return build(), None
    except Exception as e:  # noqa: BLE001  (re-raised on this rank after the agreement)
        return {}, e


def _check_dedicate_arguments(model, predicate, options, hook_boundary_predicate, hook_boundary_strict, tp_params,
                              fn):
    """The checks of _dedicate's arguments that need no collective (raised through the core's agreement)."""
    if getattr(model, "_dmuon", None) is not None:
        raise ValueError(f"{fn}: this model is dedicated already; call it once per model.")
    for name, m in model.named_modules():
        if isinstance(m, nn.parallel.DistributedDataParallel):
            raise ValueError(
                f"rank {_rank()}: {fn}: {'the model' if not name else repr(name)} is a torch DistributedDataParallel; its gradient "
                "all-reduces would run beside dmuon's (a dedicated matrix is whole on its owner only). Pass the "
                f"module it wraps ({'model' if not name else name}.module): dmuon.replicate / dedicate_params_ddp do "
                "DDP's part for the parameters Muon does not train.")
        if name and getattr(m, "_dmuon", None) is not None:
            raise ValueError(f"rank {_rank()}: {fn}: submodule '{name}' was dedicated already (its matrices live on their owners); "
                             "dedicate the whole model once instead, with one predicate for all its matrices.")
    for name, p in model.named_parameters():
        if hasattr(p, "_dedicated_owner_rank"):
            raise ValueError(f"rank {_rank()}: {fn}: parameter '{name}' is dedicated already, by an earlier {fn} of a module that "
                             "holds it; dedicate the whole model once instead, with one predicate for all its "
                             "matrices.")
    for name, m in model.named_modules():
        if not (isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse):
            continue  # (`weight` is read of these only: on a parametrized module reading it runs the parametrization,
            # and spectral_norm's power iteration updates its buffers in training mode)
        weight = getattr(m, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.requires_grad:
            where = f"'{name}'" if name else "the model"
            raise ValueError(f"rank {_rank()}: {fn}: {where} is an {type(m).__name__} with sparse=True, so '{name + '.' if name else ''}weight' gets "
                             "sparse gradients; dmuon reduces and updates dense ones (as torch's AdamW refuses "
                             "sparse gradients). Build it with sparse=False.")
    if not callable(predicate):
        raise TypeError(f"{fn}: predicate must be a callable (name, param) -> bool selecting the Muon matrices, "
                        f"got {type(predicate).__name__}.")
    lazy = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise ValueError(
            f"rank {_rank()}: {fn}: {len(lazy)} parameter(s) or buffer(s) of lazy modules (nn.LazyLinear, ...) are not "
            f"initialised yet, e.g. '{lazy[0]}' (its shape comes from the first forward); dmuon plans each parameter "
            "by its shape. Run one forward of the model (a dummy batch) before calling it, as torch's DDP and FSDP "
            "require."
        )
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"{fn}: {len(meta)} parameter(s) are on the meta device (no storage), e.g. '{meta[0]}'; dmuon plans and "
            "publishes real values. Materialise the model first (model.to_empty(device=...) and initialise the "
            "weights, or load a checkpoint), then call it."
        )
    if tp_params and fn == "dedicate_params_ddp":
        raise ValueError(f"dedicate_params_ddp: parameter '{tp_params[0].name}' is a tensor-parallel DTensor; the DDP "
                         "path with tensor parallelism is dedicate_params_ddp_tp (then replicate_tp).")
    if not tp_params and fn == "dedicate_params_ddp_tp":
        raise ValueError("dedicate_params_ddp_tp: the model has no tensor-parallel DTensor parameter (apply "
                         "parallelize_module first); without TP use dedicate_params_ddp.")
    if options.get("hook_boundary_resolver") is not None:
        options["hook_boundary_resolver"] = _module_name_resolver(model, options["hook_boundary_resolver"], fn)
    elif hook_boundary_predicate is not None:
        options["hook_boundary_resolver"] = _boundary_resolver(model, hook_boundary_predicate, hook_boundary_strict)


def _dedicate(model, mesh, replicate_mesh, predicate, options, hook_boundary_predicate, hook_boundary_strict,
              process_group_policy, ddp, fn, failure=None):
    # (`failure`: the caller's options were refused on this rank; raised here after every rank learnt of it)
    tp_group, tp_params = find_tp_params(model, mesh, replicate_mesh, fn)
    if failure is None:
        try:
            _check_dedicate_arguments(model, predicate, options, hook_boundary_predicate, hook_boundary_strict,
                                      tp_params, fn)
        except Exception as e:  # noqa: BLE001
            failure = e
    native_mesh, world_group, dp_ranks, groups = make_mesh(mesh, replicate_mesh, process_group_policy, fn, tp=tp_group)
    if failure is not None:  # the core's setup agreement, with this rank's refusal: every rank raises
        def refuse():
            raise failure
        try:
            _C._dedicate([], [], [], native_mesh, lambda name, param: False, {}, ddp, precheck=refuse)
        except Exception:  # noqa: BLE001
            pass
        raise failure
    user_predicate = predicate
    predicate = lambda name, param: bool(user_predicate(name, param))  # noqa: E731  truthiness, as filter() takes it
    swap_in_local_slices(tp_params)
    # the user's callables see the TP parameters as they wrote the model: DTensors of the full shape
    predicate = show_dtensors(tp_params, predicate)
    for key in ("hook_boundary_resolver", "assignment_group_key_fn", "route_hint_fn", "param_policy_fn"):
        if options.get(key) is not None:
            options[key] = show_dtensors(tp_params, options[key])
    tp_split = {tp.name: tp.split_dim for tp in tp_params if tp.split_dim >= 0} if native_mesh.tp_size > 1 else {}
    params, buffers, modules = _model_view(model)
    dtypes = {n: p.dtype for n, p in params}  # before param_policy's param_dtype (the masters keep these)
    try:
        runtime = _C._dedicate(params, buffers, modules, native_mesh, predicate, options, ddp, tp_split,
                               _tied_names(model))
    except BaseException:
        restore_dtensors(tp_params)  # the model is the caller's again, DTensors and all
        raise
    release_dtensors(tp_params)
    guard = _param_guard(params, world_group)
    hooks = _install_hooks(model, runtime, guard) + install_dtensor_hooks(tp_params)
    if sys.modules.get("torch._dynamo") is not None:
        # Code Dynamo compiled from this model before now (torch.compile(model) run before dedicate_params) has
        # neither dmuon's hooks nor its placeholders, and torch does not guard on module hooks
        # (skip_nnmodule_hook_guards): it would run on (gradients dropped, or inductor's shape assertions on a
        # placeholder). Dropped, so the next compiled forward traces the dedicated model (other compiled code
        # recompiles once too).
        torch.compiler.reset()
    model._dmuon = _State(runtime, native_mesh, world_group, hooks, dict(params), guard)
    if world_group is not None and dist.get_world_size(world_group) > 1:
        for _, p in params:
            _WORLD_OF_PARAM[p] = world_group
    model._dmuon.tp_split = tp_split
    model._dmuon.tp_params = tp_params
    model._dmuon.dp_ranks = dp_ranks  # with TP: the global ranks at this rank's TP position
    if world_group is not None:  # fully_shard's mesh must span them (the FSDP2 patch checks)
        register_dp_ranks([p for _, p in params], dp_ranks if dp_ranks is not None else
                          dist.get_process_group_ranks(world_group))
    model._dmuon.groups = groups  # the mesh's torch groups (get_comm_ctx)
    model._dmuon.comm_options = {k: options.get(k) for k in ("tp_buffer_reuse", "replicate_broadcast_bucket_mb")}
    owners = {}
    for d, coord in _owner_coords(model._dmuon):
        d["param"]._dedicated_owner_rank = coord
        owners[d["param"]] = coord
    register_undedicated(tp_params)  # what fully_shard may take later: as DTensors (hand_to_fsdp2)
    # what fully_shard may take later after param_policy cast it: in its master precision (restore_masters)
    register_cast(model._dmuon, [(n, p) for n, p in params if p.dtype != dtypes[n] and p not in owners])
    model._dmuon.hooks += _install_state_dict_guards(model, model._dmuon, dtypes)
    _install_zero_grad(model, runtime)
    # (after the core's setup agreement: a rank refused there never reaches this collective)
    _sync_buffers(model, world_group, groups.device, fn)
    return owners


def _broadcast_from_first(tensors: List[torch.Tensor], group, device: torch.device, fn: str) -> List[torch.Tensor]:
    """Copies of `tensors` holding the values of the group's first rank (collective over `group`, every rank).
    Sent as their bytes (any dtype; one broadcast, staged on `device`, where the mesh's collectives run), after one small all-gather that checks every rank holds the same shapes and dtypes (else a
    ValueError on every rank, not mismatched broadcasts). A DTensor (a tensor-parallel buffer) and a meta
    tensor keep their own."""
    out = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    if group is None or dist.get_world_size(group) == 1:
        return out
    sent = [i for i, t in enumerate(out) if not is_dtensor(t) and not t.is_meta and t.numel() > 0]
    layout = zlib.crc32(repr([(tuple(out[i].shape), str(out[i].dtype)) for i in sent]).encode())
    wire = device
    mine = torch.tensor([layout, len(sent)], dtype=torch.int64, device=wire)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    differ = [dist.get_global_rank(group, r) for r, t in enumerate(every) if not torch.equal(t, every[0])]
    if differ:
        raise ValueError(f"rank {_rank()}: {fn}: the model's buffers differ in shape or dtype between ranks (rank(s) "
                         f"{differ} differ from rank {dist.get_global_rank(group, 0)}); every rank must build the "
                         "same model, its buffers included.")
    if not sent:
        return out
    flat = torch.cat([out[i].reshape(-1).view(torch.uint8).to(wire) for i in sent])
    dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
    at = 0
    for i in sent:
        n = out[i].numel() * out[i].element_size()
        out[i].reshape(-1).view(torch.uint8).copy_(flat[at:at + n])
        at += n
    return out


def _sync_buffers(model: nn.Module, group, device: torch.device, fn: str) -> None:
    """Every buffer of the model takes the first rank's values (collective over `group`), as DDP's construction
    does: with the parameters (replicated ones from the first rank, each matrix from its owner) one model on
    every rank, whatever each rank's initialisation was. Afterwards each rank's buffers (BatchNorm's running
    statistics) evolve with its own batches, as under FSDP2 or DDP(broadcast_buffers=False)."""
    buffers = [b for _, b in model.named_buffers()]
    with torch.no_grad():
        for b, first in zip(buffers, _broadcast_from_first(buffers, group, device, fn)):
            if not is_dtensor(b) and not b.is_meta:
                b.copy_(first)


def _rank() -> int:
    """This process's global rank for error messages (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


class _InertHook:
    """What a copy of a module (copy.deepcopy, torch.save then torch.load) keeps of dmuon's state-dict hooks: its
    parameters are plain tensors dmuon does not train, so nothing to check."""

    def __call__(self, *args, **kwargs):
        return None


class _StateDictGuard:
    """One of dmuon's state-dict hooks (a local function: pickle refused it, so torch.save of a module holding
    only replicated parameters failed with "Can't pickle local object"). Copied or pickled, it becomes inert."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        return (_InertHook, ())


def _install_state_dict_guards(model: nn.Module, state: _State, dtypes: Dict[str, torch.dtype]) -> list:
    """model.state_dict() and load_state_dict() where they would silently save or load the wrong thing, on every
    module holding a parameter dmuon trains and their ancestors. state_dict() (keep_vars=False) raises where it
    would return a parameter whose tensor on this rank is not its whole, current, full-precision value: on a mesh
    of several ranks a dedicated matrix (a 0-element placeholder on the ranks that do not own it, or the last
    value they received) or a sharded_adamw parameter, a tensor-parallel slice, and a parameter param_policy
    narrowed (its master holds the value). load_state_dict() raises for any parameter dmuon trains (the value
    would bypass its owner, its master copy and the publish). The module a call starts at checks its whole
    subtree first (nothing is saved or loaded), every other hooked module its own parameters. keep_vars=True
    (the live Parameters as they are on this rank) is left alone."""
    # whole and current on every rank: these routes' parameters, and a dedicated matrix on a one-rank mesh (its
    # owner); a sharded_adamw parameter is a placeholder between steps even there
    whole = ("local", "replicated") if state.mesh.world_size > 1 else ("local", "replicated", "muon")
    name_of = {id(p): n for n, p in state.params.items()}
    trained = set()  # fixed here: a parameter frozen later is still held by dmuon (a placeholder, a master)
    partial = set()  # not whole, current and full precision on this rank
    for name, route in state.runtime.routes():
        p = state.params.get(name)
        if p is None or not p.requires_grad:
            continue
        trained.add(name)
        if route not in whole or name in state.tp_split or p.dtype != dtypes.get(name, p.dtype):
            partial.add(name)  # (a dtype param_policy changed: the master holds the value)

    def keys(module, prefix, names):
        if prefix:  # a submodule of the call: its own parameters (the call's start checked the rest)
            found = [(prefix + n, p) for n, p in module._parameters.items() if p is not None]
        else:
            found = list(module.named_parameters(remove_duplicate=False))
        # FSDP2's DTensors (fully_shard took the parameter: its own state dict) are not dmuon's
        return [k for k, p in found if name_of.get(id(p)) in names]

    def saving(module, prefix, keep_vars):
        bad = [] if keep_vars else keys(module, prefix, partial)
        if bad:
            raise RuntimeError(
                f"rank {_rank()}: {type(module).__name__}.state_dict() on a dedicated model: {len(bad)} parameter(s), "
                f"e.g. '{bad[0]}', do not hold their whole, current, full-precision value on this rank (a Muon matrix "
                "lives on its owner rank: the others hold a 0-element placeholder or the last value they received; "
                "sharded_adamw and tensor-parallel parameters are slices; a parameter param_policy narrowed keeps its "
                "value in a master copy), so the dict would silently save them wrong. Use "
                "dmuon.get_model_state_dict(model) (collective: every rank; full tensors on rank 0, keyed as "
                "model.state_dict() of the one-process model), and dmuon.get_optimizer_state_dict(model, opt) for "
                "the optimizer. (model.state_dict(keep_vars=True) gives the live Parameters as they are on this "
                "rank: not a checkpoint.)"
            )

    def loading(module, state_dict, prefix, *_):
        bad = [k for k in keys(module, prefix, trained) if k in state_dict]
        if bad:
            raise RuntimeError(
                f"rank {_rank()}: {type(module).__name__}.load_state_dict() on a dedicated model: {len(bad)} "
                f"parameter(s) in the dict, e.g. '{bad[0]}', are trained by dmuon, which keeps their values itself "
                "(each Muon matrix whole on its owner, master copies, the publish), so loading into the module's "
                "tensors would be lost or load only some ranks. Use dmuon.set_model_state_dict(model, "
                "full_state_dict) (collective: every rank passes the whole dict)."
            )

    hooked, guarded = set(), set()
    for name, m in model.named_modules(remove_duplicate=False):
        own = [name_of.get(id(p)) for p in m._parameters.values() if p is not None]
        parts = name.split(".") if name else []
        if any(n in trained for n in own):
            hooked.update(".".join(parts[:i]) for i in range(len(parts) + 1))  # it and its ancestors
        if any(n in partial for n in own):
            guarded.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    handles = []
    for name, m in model.named_modules():
        if name in hooked:
            handles.append(m.register_state_dict_pre_hook(_StateDictGuard(saving)))
            handles.append(m.register_load_state_dict_pre_hook(_StateDictGuard(loading)))
        # copy.deepcopy / torch.save of a module holding such a parameter, or of a block above one (a layer, for
        # an EMA or an export), gave the placeholder (a (0,) weight, no error) on the ranks that do not own it:
        # refused, as the model's copies are
        if name in guarded:
            # first in the module's __dict__: pickling reaches it (and refuses) before anything else
            attrs = {"_dmuon_uncopyable": _C._Uncopyable(), **m.__dict__}
            m.__dict__.clear()
            m.__dict__.update(attrs)
    return handles


def _owner_coords(state: "_State") -> list:
    """Each dedicated matrix (the runtime's record) with its owner's coordinate: the owner's rank, or
    (shard, replicate) on an HSDP mesh."""
    hsdp = state.mesh.replicate_size > 1
    out = []
    for d in state.runtime.dedicated():
        d["owner_rank"] = _global_rank(state, d["owner_rank"])  # (the core's: a rank of the mesh's world)
        out.append((d, (d["owner_shard"], d["owner_replicate"]) if hsdp else d["owner_rank"]))
    return out


def _global_rank(state: "_State", mesh_rank: int) -> int:
    """The global rank of a rank of the model's mesh (the core numbers the mesh's ranks 0..n-1: on a group of
    part of the ranks, or in another order, they are not the global ranks)."""
    ranks = getattr(getattr(state, "groups", None), "world_ranks", None)
    return ranks[mesh_rank] if ranks else mesh_rank


def _first_of_mesh(state: "_State") -> bool:
    """This rank is the model's mesh's first rank: the one a rank0_only state dict is returned on (global rank 0
    where the mesh spans every rank in order; on a subgroup its first member)."""
    return state.mesh.global_rank == 0


def dedicate_params(
    model: nn.Module,
    mesh,
    predicate: Callable[[str, nn.Parameter], bool],
    compute_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
    replicate_mesh=None,
    hook_boundary_predicate: Optional[Callable[[nn.Module], bool]] = None,
    hook_boundary_strict: bool = True,
    hook_boundary_resolver: Optional[HookBoundaryResolver] = None,
    assignment_group_key_fn: Optional[AssignmentGroupKeyFn] = None,
    route_hint_fn: Optional[RouteHintFn] = None,
    max_owners_per_group: Optional[int] = None,
    owner_strategy: Optional[str] = None,
    owner_cost_model: Optional[str] = None,
    hsdp_column_balance: Optional[bool] = None,
    pack_small_params: Optional[bool] = None,
    tp_buffer_reuse: Union[bool, str] = False,
    replicate_broadcast_bucket_mb: float = 0.0,
    muon_forward_unshard: str = "broadcast",
    delay_stage2_to_optimizer: bool = True,
    param_policy: Optional[Mapping[str, object]] = None,
    param_policy_fn: Optional[ParamPolicyFn] = None,
    process_group_policy: Optional[str] = None,
) -> Dict[nn.Parameter, int]:
    """Gives each Muon matrix (``predicate(name, param)`` true) one owner rank that holds it whole and runs
    Newton-Schulz on it; the other ranks keep 0-byte placeholders (the Parameter objects stay the same)
    between their hook boundaries' forward and backward (``reshard_after_forward``: True = Z3, False = Z2).
    Boundaries: ``hook_boundary_resolver`` ((name, param) -> the boundary module, or its name), else the
    lowest ancestor matching ``hook_boundary_predicate``, else the ``layers.N`` / ``blocks.N`` module, else
    the direct parent. ``mesh``: a 1-D DeviceMesh or
    ProcessGroup (the shard axis; ``replicate_mesh`` adds the HSDP replicate axis), or a 2-D (replicate,
    shard) DeviceMesh. ``param_policy`` ({"defaults": {...}, "overrides": [{"match": "name tokens", ...}]})
    or ``param_policy_fn`` ((name, param) -> fields or None) choose per parameter its route ("muon",
    "adamw", "sharded_adamw") and mixed precision (param_dtype, grad_dtype, master_dtype, optim_dtype,
    output_dtype, cast_forward_inputs, muon_forward_unshard). Tensor parallelism: DTensor parameters
    (parallelize_module) on a mesh dimension that neither ``mesh`` nor ``replicate_mesh`` names (pass the
    named data-parallel sub-meshes of a (replicate, shard, tp) mesh) become plain Parameters holding their
    local slices, rebuilt as DTensors in each forward; Newton-Schulz runs on the full matrix at a TP owner
    (or in the distributed Gram form), and :func:`replicate_tp` or FSDP2 takes the rest. Returns parameter ->
    owner rank (HSDP: its (shard, replicate) coordinate).
    Collective: every rank of the default group, in the same order."""
    options, failure = _options_or_failure(lambda: {
        "compute_dtype": compute_dtype,
        "reshard_after_forward": reshard_after_forward,
        "hook_boundary_strict": hook_boundary_strict,
        "hook_boundary_resolver": hook_boundary_resolver,
        "assignment_group_key_fn": assignment_group_key_fn,
        "route_hint_fn": route_hint_fn,
        "max_owners_per_group": max_owners_per_group,
        "owner_strategy": owner_strategy,
        "owner_cost_model": owner_cost_model,
        "hsdp_column_balance": hsdp_column_balance,
        "pack_small_params": pack_small_params,
        "muon_forward_unshard": muon_forward_unshard,
        "replicate_broadcast_bucket_mb": replicate_broadcast_bucket_mb,
        "delay_stage2_to_optimizer": delay_stage2_to_optimizer,
        "tp_buffer_reuse": _tp_buffer_reuse(tp_buffer_reuse, "dedicate_params"),
        **_policy_options(param_policy, param_policy_fn, "dedicate_params"),
    })
    return _dedicate(model, mesh, replicate_mesh, predicate, options, hook_boundary_predicate, hook_boundary_strict,
                     process_group_policy, False, "dedicate_params", failure)


def dedicate_params_ddp(
    model: nn.Module,
    mesh,
    predicate: Callable[[str, nn.Parameter], bool],
    compute_dtype: Optional[torch.dtype] = None,
    hook_boundary_predicate: Optional[Callable[[nn.Module], bool]] = None,
    hook_boundary_strict: bool = True,
    hook_boundary_resolver: Optional[HookBoundaryResolver] = None,
    assignment_group_key_fn: Optional[AssignmentGroupKeyFn] = None,
    max_owners_per_group: Optional[int] = None,
    owner_strategy: Optional[str] = None,
    owner_cost_model: Optional[str] = None,
    pack_small_params: Optional[bool] = None,
    param_policy: Optional[Mapping[str, object]] = None,
    param_policy_fn: Optional[ParamPolicyFn] = None,
    process_group_policy: Optional[str] = None,
) -> Dict[nn.Parameter, int]:
    """The DDP path: every rank keeps every matrix whole; ownership decides who runs Newton-Schulz, where
    its gradient is reduced and who publishes the update after ``step()``. Pair it with
    :func:`replicate` for the other parameters. 1-D meshes. Returns parameter -> owner rank. Collective."""
    given = dict(locals())
    if getattr(mesh, "ndim", 1) != 1:  # (a DeviceMesh; a (1, N) mesh too, whose replicate axis is trivial)
        raise ValueError(
            f"dedicate_params_ddp: mesh is a {mesh.ndim}-D DeviceMesh {tuple(mesh.shape)}; the DDP path takes a 1-D "
            "mesh over the data-parallel world. For a (replicate, shard) layout use dedicate_params with the 2-D "
            "mesh; with tensor parallelism, dedicate_params_ddp_tp(model, mesh['dp'], ...).")
    options, failure = _options_or_failure(lambda: _ddp_options(given, "dedicate_params_ddp"))
    return _dedicate(model, mesh, None, predicate, options, hook_boundary_predicate, hook_boundary_strict,
                     process_group_policy, True, "dedicate_params_ddp", failure)


def dedicate_params_ddp_tp(
    model: nn.Module,
    mesh,
    predicate: Callable[[str, nn.Parameter], bool],
    compute_dtype: Optional[torch.dtype] = None,
    hook_boundary_predicate: Optional[Callable[[nn.Module], bool]] = None,
    hook_boundary_strict: bool = True,
    hook_boundary_resolver: Optional[HookBoundaryResolver] = None,
    assignment_group_key_fn: Optional[AssignmentGroupKeyFn] = None,
    max_owners_per_group: Optional[int] = None,
    owner_strategy: Optional[str] = None,
    owner_cost_model: Optional[str] = None,
    pack_small_params: Optional[bool] = None,
    tp_buffer_reuse: Union[bool, str] = False,
    param_policy: Optional[Mapping[str, object]] = None,
    param_policy_fn: Optional[ParamPolicyFn] = None,
    process_group_policy: Optional[str] = None,
) -> Dict[nn.Parameter, int]:
    """The DDP path with tensor parallelism, kept apart so that dedicate_params_ddp keeps rejecting DTensor
    parameters: apply TP first (parallelize_module on the TP axis), then this with the 1-D data-parallel
    mesh (e.g. ``mesh2d["dp"]``), then :func:`replicate_tp`. The TP ranks of the owner's data-parallel
    position gather their slices to a TP owner for Newton-Schulz, scatter the update back, and the updated
    slices are published over the data-parallel mesh. Returns parameter -> owner rank. Collective."""
    given = dict(locals())
    options, failure = _options_or_failure(lambda: {
        **_ddp_options(given, "dedicate_params_ddp_tp"),
        "tp_buffer_reuse": _tp_buffer_reuse(tp_buffer_reuse, "dedicate_params_ddp_tp")})
    return _dedicate(model, mesh, None, predicate, options, hook_boundary_predicate, hook_boundary_strict,
                     process_group_policy, True, "dedicate_params_ddp_tp", failure)


def _tp_buffer_reuse(value, fn: str) -> str:
    """The core's policy of ``tp_buffer_reuse``: which scratch of the TP exchange each matrix keeps across
    steps. False/None: none; True or "all": every slot; "gather": the TP owner's gather buffer and full
    matrix; "scatter": the scatter's send and receive buffers."""
    if value is None or value is False:
        return "off"
    if value is True:
        return "all"
    if isinstance(value, str) and value in ("gather", "scatter", "all"):
        return value
    raise ValueError(f"{fn}: tp_buffer_reuse={value!r}; use False, True, \"gather\", \"scatter\" or \"all\".")


def _reported_tp_buffer_reuse(policy: Optional[str]) -> Union[bool, str]:
    """The core's tp_buffer_reuse policy as the API reference's argument spells it (False, True, "gather", ...)."""
    return {"off": False, "all": True}.get(policy or "off", policy)


def _ddp_options(args: dict, fn: str) -> dict:
    """The core's options of the DDP path's keyword arguments (``args``: the caller's locals)."""
    keys = ("compute_dtype", "hook_boundary_strict", "hook_boundary_resolver", "assignment_group_key_fn",
            "max_owners_per_group", "owner_strategy", "owner_cost_model", "pack_small_params")
    return {**{k: args[k] for k in keys}, **_policy_options(args["param_policy"], args["param_policy_fn"], fn)}


def replicate(model: nn.Module, mesh=None) -> nn.Module:
    """Replicated (DDP-style) training of every trainable parameter that is not dedicated: whole on every
    rank, gradients averaged in bucketed all-reduces issued during backward (rank 0's values first). The
    averages are in ``.grad`` when backward returns, as after torch's DDP: ``torch.nn.utils.clip_grad_norm_``
    on these parameters clips them (the API reference's split: ``Muon.clip_grad_norm_`` for the matrices), or
    ``Muon.clip_grad_norm_(scope="all")`` clips everything by one norm. Not torch's clip after
    :func:`dmuon.prepare_muon_grads`: a matrix's gradient is then in its owner's ``.grad`` alone, so each
    rank's norm would differ and the replicas drift apart.
    Call after dedicate_params, with its mesh (``mesh``: checked to span the dedicated model's ranks).
    Collective. Returns the model."""
    state = _state_of(model, "replicate")
    if state.replicated:
        raise RuntimeError("replicate: already called on this model; call it once, after dedicate_params.")
    _refuse_fsdp2_managed(model, state, "replicate")
    if state.mesh.tp_size > 1:
        raise ValueError("replicate: the model has tensor-parallel DTensor parameters (parallelize_module), whose "
                         "gradients are slices; replicate keeps rejecting them. Call dmuon.replicate_tp(model, mesh) "
                         "with the data-parallel mesh instead.")
    if mesh is not None:
        _check_replicate_mesh(mesh, state, state.world_group, "replicate")
    state.runtime.replicate(25.0)
    state.replicated = True
    _mark_replicated(model, state)
    return model


def replicate_tp(model: nn.Module, mesh=None) -> nn.Module:
    """:func:`replicate` for a tensor-parallel model: every trainable parameter on no other route,
    TP slices included, is replicated over the data-parallel ranks (``mesh``: the 1-D data-parallel mesh,
    the ranks at this rank's TP position), its local gradient all-reduced over them. Call after
    dedicate_params (or dedicate_params_ddp_tp). Collective. Returns the model."""
    state = _state_of(model, "replicate_tp")
    if state.replicated:
        raise RuntimeError("replicate_tp: already called on this model; call it once, after dedicate_params.")
    _refuse_fsdp2_managed(model, state, "replicate_tp")
    if state.mesh.tp_size == 1:
        raise ValueError("replicate_tp: the model has no tensor-parallel DTensor parameter; use dmuon.replicate.")
    if mesh is not None:
        _check_replicate_mesh(mesh, state, state.dp_ranks, "replicate_tp")
    state.runtime.replicate(25.0, tp=True)
    state.replicated = state.replicated_tp = True
    _mark_replicated(model, state)
    return model


def _mark_replicated(model: nn.Module, state: _State) -> None:
    """Marks the parameters replicate took (``_dmuon_replicated``): the FSDP2 patch refuses them to fully_shard."""
    replicated = {n for n, route in state.runtime.routes() if route == "replicated"}
    for name, p in model.named_parameters():
        if name in replicated:
            p._dmuon_replicated = True


def _refuse_fsdp2_managed(model: nn.Module, state: _State, fn: str) -> None:
    """replicate's refusal (the API reference's RuntimeError) when fully_shard already took trainable parameters
    it would replicate: FSDP2 averages and steps those itself, and the two cannot share a parameter."""
    taken = sorted(_trained_external(state) if _sync_external(model, state) else {})
    if taken:
        shown = ", ".join(f"'{n}'" for n in taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
        raise RuntimeError(
            f"rank {_rank()}: {fn}: {shown} {'is' if len(taken) == 1 else 'are'} already under FSDP2 (fully_shard ran "
            f"on {'its module' if len(taken) == 1 else 'their modules'}), which averages their gradients and shards "
            "them itself. Train the non-dedicated parameters with one of the two: fully_shard (then Muon trains "
            f"them on FSDP2's shards, no {fn}), or {fn} without fully_shard.")


def _check_replicate_mesh(mesh, state: _State, expected, fn: str) -> None:
    """replicate's (replicate_tp's) mesh: a 1-D DeviceMesh or a ProcessGroup over the dedicated model's
    data-parallel ranks (``expected``: a group, or its global ranks)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(f"{fn}: mesh must be the 1-D data-parallel mesh, got a {mesh.ndim}-D DeviceMesh "
                             f"{tuple(mesh.mesh_dim_names or ())}. Pass the mesh given to dedicate_params_ddp.")
        group = mesh.get_group()
    elif isinstance(mesh, dist.ProcessGroup):
        group = mesh
    else:
        raise ValueError(f"{fn}: mesh must be a 1-D DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    ranks = sorted(dist.get_process_group_ranks(group))
    mine = sorted(expected if isinstance(expected, list) else dist.get_process_group_ranks(expected))
    if ranks != mine:
        raise ValueError(f"{fn}: mesh spans global ranks {ranks}, but the model was dedicated over {mine}. "
                         "Pass the mesh given to dedicate_params (replicated gradients are averaged over those ranks).")


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Gradient accumulation: no gradient reduce inside (dmuon's, and FSDP2's on the modules fully_shard
    wrapped); the next backward outside reduces the accumulated sum. Unlike torch's DDP, the forward and
    backward inside still gather the dedicated matrices from their owners (dedicate_params; the DDP path
    keeps them whole and does not): there every rank runs the same number of micro-batches and the same
    blocks, else the ranks wait for each other until the collective timeout, an error naming the boundary."""
    state = _state_of(model, "no_sync")
    wrapped = fsdp_modules(model)
    outer = state.runtime.set_no_sync(True)  # nested in another no_sync: leaving this one stays in that one
    if not outer:
        for m in wrapped:
            m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        state.runtime.set_no_sync(outer)
        if not outer:
            for m in wrapped:
                m.set_requires_gradient_sync(True, recurse=False)


def _full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every trainable parameter's full value, in its master precision (collective): dmuon's routes', then
    FSDP2's DTensor shards gathered (model order on every rank)."""
    state = _state_of(model, "full params")
    external = _sync_external(model, state)
    full = {n: t.detach() for n, t in state.runtime.full_params()}
    for name, p in external.items():
        full[name] = full_tensor(p.detach())
    return full


def _first_names(model: nn.Module) -> Dict[int, str]:
    """id(parameter) -> the name the runtime knows it by: its (first) name at dedicate_params, which a module
    wrapped since renames in named_parameters() (torch.compile(layer) adds "_orig_mod."), else its first
    name in named_parameters() (a tied parameter's)."""
    first = {}
    state = getattr(model, "_dmuon", None)
    for name, p in list(state.params.items() if state else []) + list(model.named_parameters()):
        first.setdefault(id(p), name)
    return first


def get_model_state_dict(model: nn.Module, *, cpu_offload: bool = True, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
    """What ``model.state_dict()`` of the same model trained in one process returns: the same names (tied
    parameters under each of their names), order, shapes and dtypes, every parameter whole (from its
    owner, or gathered from shards) and the buffers. Loadable by ``load_state_dict`` of a plain model,
    ``torch.save`` / ``torch.load`` and transformers' ``from_pretrained`` (through safetensors).
    ``cpu_offload``: tensors on the CPU; ``rank0_only``: only rank 0 gets the dict, the others ``{}`` (on a mesh over part of the ranks, or
    in another order: its first rank).
    Collective: every rank of the model's mesh."""
    # first: FSDP2's state-dict pre-hook puts a module a no-grad forward left unsharded back on its DTensor
    # shards, and named_parameters() (_first_names) must list the same objects as this dict
    local = model.state_dict(keep_vars=True)
    full = _full_params(model)
    first_name = _first_names(model)
    kept = {key: value for key, value in local.items()
            if first_name.get(id(value)) is None or first_name[id(value)] not in full}
    if not rank0_only:  # every rank returns rank 0's dict: its buffers too (each rank's running stats differ)
        names = {n for n, _ in model.named_buffers()}  # (not a module's _extra_state: any object)
        buffers = {key: value for key, value in kept.items() if key in names and isinstance(value, torch.Tensor)}
        state = model._dmuon  # (_full_params checked it is dedicated)
        kept.update(zip(buffers, _broadcast_from_first(list(buffers.values()), state.world_group, state.groups.device,
                                                       "get_model_state_dict")))
    elif not _first_of_mesh(model._dmuon):
        return {}
    out = {}
    for key, value in local.items():
        name = first_name.get(id(value))
        if name is not None and name in full:
            t = full[name]  # the master where param_policy keeps one (the dtype the model had at dedicate time)
        elif isinstance(kept[key], torch.Tensor):  # a buffer (rank 0's), a parameter no route trains (frozen)
            t = kept[key].detach()
        else:  # a module's _extra_state (get_extra_state): as the module gave it
            out[key] = kept[key]
            continue
        out[key] = (t.cpu() if cpu_offload else t).clone()
    return out


_CHECKSUM_CHUNK = 1 << 26  # bytes hashed at a time (a device tensor: copied to the host chunk by chunk)


def _checksum(t: torch.Tensor):
    """An exact checksum of a tensor's bytes (CRC-32 over them in order, chunk by chunk: no float rounding,
    so the same bytes give the same value on every machine), or None where the bytes are not plain (a
    DTensor, sparse or quantized tensor)."""
    if is_dtensor(t) or t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    if not flat.is_contiguous():
        flat = flat.contiguous()
    data = flat.view(torch.uint8)
    crc = 0
    for lo in range(0, data.numel(), _CHECKSUM_CHUNK):
        chunk = data[lo:lo + _CHECKSUM_CHUNK]
        crc = zlib.crc32(memoryview(chunk.cpu().numpy()), crc)
    return crc


def _summary(value, path: str, out: dict) -> None:
    """What :func:`_load_agreed` compares across ranks, by path: each tensor's shape, dtype and checksum,
    the value of every number, string and None, and the type of anything else."""
    if isinstance(value, torch.Tensor):
        out[path] = ("tensor", tuple(value.shape), str(value.dtype), _checksum(value))
    elif isinstance(value, Mapping):
        for k in value:
            _summary(value[k], f"{path}[{k!r}]" if path else repr(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _summary(v, f"{path}[{i}]", out)
    elif value is None or isinstance(value, (bool, int, float, str)):
        out[path] = repr(value)  # (repr: NaN equals NaN)
    else:
        out[path] = type(value).__name__


def _gathered_with_refusals(group, fn: str, given: str, outcome: str, failure, payload, device=None) -> list:
    """The core's agreement over ``group`` (dmuon::agree_call) of this rank's refusal (``failure``, or None), then
    one all_gather_object of ``payload``; every rank learns of every refusal before any raises (none leaves the
    others in the gather), and of ranks in another of dmuon's collective calls. A refusal anywhere
    raises on every rank: this rank's own ``failure`` here, elsewhere "rank(s) R refused <given> they were
    given, so <outcome>" with the first refusing rank's reason (a ValueError where every refusal was a caller
    mistake, ValueError or TypeError, else a RuntimeError). Returns every rank's payload, in group order."""
    from ._clip import _group_args

    # (text any rank can take: a lone surrogate, say from a file name, would fail here alone, the others waiting)
    mine = None if failure is None else (isinstance(failure, (ValueError, TypeError)),
                                         f"{type(failure).__name__}: {failure}".encode(
                                             "utf-8", "backslashreplace").decode("utf-8"))
    group_arg, ranks, guessed = _group_args(group, fn)
    # first the core's agreement, as every collective call of dmuon opens: ranks in another call (one skipped or
    # added a call, dmuon's own in C++ too) raise on every rank naming their calls, where an object gather of
    # one call paired with another's collectives aborted the process (Gloo: "data size doesn't match"), and a
    # lost peer is an error naming the call after the group's timeout
    try:  # (on the model's device: a group of both backends has NCCL beside the Gloo a CPU model uses)
        _C._agree_call(group_arg, ranks, str(device) if device is not None else guessed, fn, given, outcome, mine)
    except Exception as e:
        if failure is not None and str(e) == mine[1]:  # this rank's own refusal: as it was raised
            raise failure from None
        raise
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, payload, group=group)
    return everyone


def _load_agreed(group, fn: str, check: Callable[[], None], given, device=None) -> None:
    """The agreement before a load writes anything (collective over the model's ranks, reached on every
    rank whatever `check` raises): `check` (this rank's validation of `given`) raising on any rank raises on
    every rank, naming it, and dicts that differ between ranks are an error too (each rank would load its
    own, and the replicas would drift apart): every rank compares every rank's summary with rank 0's."""
    error, summary = None, {}
    try:
        check()
        _summary(given, "", summary)
    except Exception as e:  # (reported to the other ranks first: none may leave before the gather)
        error = e
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    everyone = _gathered_with_refusals(group, fn, "the state dict", "no rank loads anything", error, summary, device)
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    first = everyone[0]
    for r, theirs in zip(ranks[1:], everyone[1:]):
        if theirs == first:
            continue
        path = next((k for k in sorted(set(first) | set(theirs)) if first.get(k) != theirs.get(k)))
        raise ValueError(
            f"rank {me}: {fn}: the ranks were given different state dicts ({path} differs between rank {ranks[0]} and "
            f"rank {r}), so each would load its own and the replicas would drift apart; nothing was loaded. Pass the "
            "same full state dict on every rank (torch.load the same file on each, or broadcast rank 0's with "
            "torch.distributed.broadcast_object_list).")


def set_model_state_dict(model: nn.Module, state_dict: Dict[str, torch.Tensor]) -> None:
    """Loads a full state dict (what :func:`get_model_state_dict` or the one-process model's ``state_dict()``
    gives) into a dedicated model: each rank keeps its part of every parameter, buffers are copied.
    Every rank passes the whole dict, the same one: the ranks agree on it (and on any refusal) before
    anything is written. A tied parameter takes its last key's value, as ``load_state_dict`` does.
    Collective: every rank of the model's mesh."""
    fn = "set_model_state_dict"
    state = _state_of(model, fn)
    expected = model.state_dict(keep_vars=True)
    external = _sync_external(model, state)
    first_name = _first_names(model)
    # modules with their own extra state (get_extra_state): any object, given back to set_extra_state
    extra = {(f"{name}." if name else "") + "_extra_state": m for name, m in model.named_modules()
             if type(m).get_extra_state is not nn.Module.get_extra_state}

    def check():  # every check before anything is written: a failed load leaves the model as it was
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{fn}: the state dict is a {type(state_dict).__name__}, not a dict of tensors.")
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if missing or unexpected:
            empty = (" This rank got an empty dict: get_model_state_dict returns the state on rank 0 only by default "
                     "(rank0_only=True); pass rank0_only=False, or send rank 0's to every rank.") if not state_dict else ""
            raise ValueError(
                f"{fn}: the state dict does not match the model (missing: {missing[:5]}, unexpected: "
                f"{unexpected[:5]}). Pass a full state dict of this architecture, with keys as in model.state_dict()."
                + empty)
        first_key = {}
        for key, value in expected.items():
            given = state_dict[key]
            if key in extra:
                continue  # (its module's set_extra_state checks it)
            if not isinstance(given, torch.Tensor):
                raise TypeError(f"{fn}: '{key}' is a {type(given).__name__} in the state dict, not a "
                                "tensor. Pass a state dict of tensors, as model.state_dict() gives.")
            name = first_name.get(id(value))
            if given.is_meta or given.layout != torch.strided or (given.is_complex() and not value.is_complex()):
                raise ValueError(f"{fn}: '{key}' is a {'meta' if given.is_meta else str(given.layout)} {given.dtype} "
                                 "tensor in the state dict, which holds no values to load. Pass dense real "
                                 "tensors with values, as model.state_dict() gives.")
            if (name is None or name in external) and tuple(given.shape) != tuple(value.shape):  # buffers, FSDP2's
                raise ValueError(f"{fn}: '{key}' has shape {tuple(given.shape)} in the state dict but "
                                 f"{tuple(value.shape)} in the model. Pass a state dict of this architecture.")
            if name is not None and value.is_floating_point() and not given.is_floating_point():
                raise ValueError(f"{fn}: '{key}' is {given.dtype} in the state dict but a floating-point parameter "
                                 "in the model (weights must be floating point). Pass the model's state dict.")
            first = first_key.setdefault(id(value), key)
            if first != key and (tuple(given.shape) != tuple(state_dict[first].shape)
                                 or given.is_floating_point() != state_dict[first].is_floating_point()):
                raise ValueError(  # a tied parameter's other key: the same parameter (the core checks the first)
                    f"{fn}: '{key}' is the same parameter as '{first}' (tied), but the state dict holds a "
                    f"{tuple(given.shape)} {given.dtype} tensor under it and a {tuple(state_dict[first].shape)} "
                    f"{state_dict[first].dtype} one under '{first}'. Pass a state dict of this architecture.")

    _load_agreed(state.world_group, fn, check, state_dict, getattr(state.groups, "device", None))
    # the modules' extra states first (their set_extra_state may still refuse a value: agreed, so a refusal on any
    # rank raises on every rank before any parameter or buffer is written)
    before = {key: module.get_extra_state() for key, module in extra.items()}
    written = []

    def set_extra_states():
        for key, module in extra.items():
            module.set_extra_state(state_dict[key])
            written.append(key)

    def restore_extra_states():  # this rank's modules as they were (a refusal here or on another rank)
        for key in written:
            extra[key].set_extra_state(before[key])

    try:
        _load_agreed(state.world_group, fn, set_extra_states, {}, getattr(state.groups, "device", None))
    except BaseException:
        restore_extra_states()
        raise
    params, fsdp2 = {}, {}
    for key, value in expected.items():  # a tied parameter: its last key's value, as load_state_dict leaves it
        name = first_name.get(id(value))
        if name is not None:
            (fsdp2 if name in external else params)[name] = state_dict[key]
    try:
        state.runtime.assign_params(params)  # (agreed first: a refusal raises on every rank before any write)
    except BaseException:
        restore_extra_states()
        raise
    for name, p in external.items():
        assign_full(p, fsdp2[name], name)
    with torch.no_grad():
        for key, value in expected.items():
            if key not in extra and first_name.get(id(value)) is None:  # a buffer
                value.copy_(state_dict[key])


def clip_grad_norm_(optimizer, max_norm: Optional[float], *, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None, strategy="global_norm") -> MuonGradClipStats:
    """Clips the dedicated Muon matrices' gradients of ``optimizer`` (a :class:`dmuon.Muon`) by their global
    norm over the mesh: :meth:`Muon.clip_grad_norm_` with ``scope="muon"``. AdamW parameters are left to
    ``torch.nn.utils.clip_grad_norm_``. ``strategy``: "global_norm", a name given to
    :func:`dmuon.register_muon_grad_clip_strategy`, or a strategy callable. Collective."""
    if not isinstance(optimizer, Muon):
        raise ValueError(f"clip_grad_norm_: optimizer must be a dmuon.Muon, got {type(optimizer).__name__}")
    return optimizer.clip_grad_norm_(max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                                     foreach=foreach, strategy=strategy)


def _clip_number(key: str, value) -> float:
    """clip_grad_norm_'s max_norm or norm_type as a float, as torch's clip_grad_norm_ converts them (float(): a
    number, a one-element tensor, a string such as "inf"); a ValueError naming the argument otherwise."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{key} must be a number, got {value!r}") from None


_GROUP_KEYS = ("params", "name", "lr", "momentum", "weight_decay", "nesterov", "ns_steps", "adamw_lr", "adamw_betas",
               "adamw_weight_decay", "adamw_eps")


def _real_number(value) -> Optional[float]:
    """A real number as torch.optim takes one in a group (a Python or numpy number, or a one-element real
    tensor, as a tensor lr), as a float; None for anything else (a bool, a string, a complex number)."""
    if isinstance(value, (bool, str, bytes)) or getattr(value, "dtype", None) == torch.bool:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(value)
    if isinstance(value, numbers.Real):  # int, float, numpy's numbers
        return float(value)
    return None


def _group_value(key: str, value, where: str):
    """A group's override as the core takes it: bool, int, (float, float) or float."""
    try:
        if key == "nesterov":
            if not isinstance(value, bool):
                raise TypeError
            return value
        if key == "ns_steps":
            if isinstance(value, bool) or int(value) != value:
                raise TypeError
            return int(value)
        if key == "adamw_betas":
            b1, b2 = value
            pair = (_real_number(b1), _real_number(b2))
            if None in pair:
                raise TypeError
            return pair
        number = _real_number(value)  # (not a string or a bool, which float() would take)
        if number is None:
            raise TypeError
        return number
    except (TypeError, ValueError):
        want = {"nesterov": "a bool", "ns_steps": "an int", "adamw_betas": "a pair of floats"}.get(key, "a float")
        raise ValueError(f"Muon: {where} has {key}={value!r}; it must be {want}.") from None


def _user_groups(param_groups, state: _State) -> List[dict]:
    """The API reference's semantic groups, checked: [{"params": [...], "name", "lr", "momentum",
    "weight_decay", "nesterov", "ns_steps", "adamw_lr", "adamw_betas", "adamw_weight_decay", "adamw_eps"}];
    each parameter of the model in at most one group, named by the model's parameter name. Returns
    [{"name", "params": [names], overrides...}]."""
    if param_groups is None:
        return []
    if isinstance(param_groups, Mapping) or not isinstance(param_groups, Sequence):
        raise ValueError("Muon: param_groups must be a list of dicts, each {'params': [...], 'lr': ..., ...}.")
    names = {}
    for n, p in state.params.items():
        names.setdefault(id(p), n)
    for n, p in state.external.items():
        names.setdefault(id(p), n)
    seen, out = {}, []
    for i, g in enumerate(param_groups):
        if not isinstance(g, Mapping) or "params" not in g:
            raise ValueError(f"Muon: param_groups[{i}] must be a dict with a 'params' list.")
        unknown = [k for k in g if k not in _GROUP_KEYS]
        if unknown:
            raise ValueError(
                f"Muon: param_groups[{i}] has key(s) {unknown}; a group may set {', '.join(_GROUP_KEYS[1:])}. "
                "Other options (the NS backend, the TP and overlap settings) are per optimizer: pass them to Muon(...)."
            )
        params = g["params"]
        if isinstance(params, (set, frozenset)):  # (torch.optim's refusal: a set's order is its ids' hashes)
            raise TypeError(f"Muon: param_groups[{i}]['params'] is a {type(params).__name__}; parameters must be in an "
                            "ordered collection (a set's order changes between runs and between ranks, which then "
                            "disagree on the groups). Use a list, e.g. [p for n, p in model.named_parameters() if ...].")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # torch.optim's named groups: (name, parameter) pairs, e.g. from model.named_parameters()
        params = [p[1] if isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], torch.Tensor) else p for p in params]
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"Muon: param_groups[{i}]['params'] holds a {type(p).__name__}; it must hold the "
                                 "model's parameters (or (name, parameter) pairs).")
        group = {"name": str(g.get("name", f"group{i}")), "params": []}
        for p in params:
            name = names.get(id(p))
            if name is None:
                raise ValueError(
                    f"Muon: param_groups[{i}] ('{group['name']}') holds a tensor of shape {tuple(p.shape)} that is "
                    "not a parameter of the dedicated model. Build the groups from model.named_parameters()."
                )
            if name in seen:
                where = (f"twice in param_groups[{i}]" if seen[name] == i else
                         f"in param_groups[{seen[name]}] and param_groups[{i}]")
                raise ValueError(f"Muon: parameter '{name}' is {where}; each parameter may be in at most one group "
                                 "(once).")
            seen[name] = i
            group["params"].append(name)
        for key in _GROUP_KEYS[2:]:
            if g.get(key) is not None:
                group[key] = _group_value(key, g[key], f"param_groups[{i}] ('{group['name']}')")
        out.append(group)
    return out


def _warn_unused_group_values(user: list, lowered: list) -> None:
    """A user group's values for a kind of parameter it holds none of apply to nothing (in torch, a group's lr
    is every parameter's; here lr is the Muon matrices' and adamw_lr the others'): a warning naming them."""
    for i, g in enumerate(user):
        for keys, sub, held, other in ((_GROUP_KEYS[2:7], 2 * i, "dedicated Muon matrix", "adamw_lr, adamw_betas, "
                                        "adamw_weight_decay, adamw_eps set its AdamW parameters"),
                                       (_GROUP_KEYS[7:], 2 * i + 1, "AdamW parameter", "lr, momentum, "
                                        "weight_decay, nesterov, ns_steps set its Muon matrices")):
            given = [k for k in keys if k in g]
            if given and sub < len(lowered) and not lowered[sub]["params"]:
                warnings.warn(f"dmuon.Muon: param_groups[{i}] ('{g['name']}') sets {', '.join(given)}, but holds no "
                              f"{held}, so they apply to no parameter ({other}).", stacklevel=3)


def _refuse_torch_only_flags(i: int, g: dict) -> None:
    """torch.optim flags a group may carry that dmuon's update does not implement: refused when set, not ignored."""
    for key in ("maximize", "amsgrad", "capturable", "differentiable", "dampening"):
        if g.get(key):
            raise ValueError(f"Muon: param group #{i} ('{g.get('group_name')}') has {key}={g[key]!r}; dmuon's Muon and "
                             f"AdamW have no {key}. Remove it from the group.")


def _external_clip_grads(state: _State) -> list:
    """The local gradient shards of the parameters FSDP2 trains, as (name, grad, counted, counts_param) for
    a clip over every parameter: a shard is counted on the ranks at coordinate 0 of every mesh dimension
    it is replicated over (HSDP's replicate axis), the parameter once, on the ranks at coordinate 0
    everywhere. Under tensor parallelism FSDP2 shards a parameter whole on every TP rank (one that is not a TP
    DTensor) over the data-parallel mesh alone: its TP ranks hold copies, counted on TP rank 0 only."""
    world = dist.get_world_size(state.world_group) if state.world_group is not None else 1
    out = []
    for name, p in state.external.items():
        if p.grad is None:
            continue
        local, counted, counts_param = shard_of(p.grad)
        if is_dtensor(p.grad) and p.grad.device_mesh.size() < world and state.mesh.tp_rank != 0:
            counted = counts_param = False  # (a copy of TP rank 0's shard)
        out.append((name, local, counted, counts_param))
    return out


def _canonical(value) -> str:
    """An option as the core takes it, for comparing ranks: numbers (and one-element tensors, on any device or
    dtype) by their exact float value, so 1 and 1.0 agree and 0.05 and 0.050001 do not; a NewtonSchulz by
    everything it computes with."""
    if isinstance(value, _C.NewtonSchulz):
        return _canonical(("NewtonSchulz", value.backend, value.kernel, value.coefficients, value.restart_iterations))
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return float(value).hex()
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_canonical(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_canonical(v) for v in value) + "]"
    return repr(value)


def _agree_across_ranks(group, options: dict, failure: Optional[BaseException] = None, device=None) -> None:
    """Every rank constructs Muon with the same options (collective over the model's mesh, once): a
    ValueError on every rank naming the first option that differs and each rank's value. ``failure``: this
    rank refused its arguments; every rank raises, this one ``failure``, the others naming it (a ValueError
    where every refusal was a caller mistake, ValueError or TypeError, else a RuntimeError)."""
    if group is None or dist.get_world_size(group) == 1:
        if failure is not None:
            raise failure
        return
    mine = {key: (_canonical(value), repr(value)) for key, value in options.items()} if failure is None else {}
    everyone = _gathered_with_refusals(group, "Muon", "the options", "no rank builds Muon", failure, mine, device)
    ranks = dist.get_process_group_ranks(group)
    for key in options:
        values = [theirs.get(key, ("", "unset")) for theirs in everyone]
        if len({v[0] for v in values}) > 1:
            seen = ", ".join(f"rank {r}: {v[1]}" for r, v in zip(ranks, values))
            raise ValueError(
                f"rank {dist.get_rank()}: Muon: the ranks were given different {key} ({seen}). Each rank would train "
                "with its own (the replicas drift apart) or issue other collectives (a hang); pass the same "
                "options to Muon(...) on every rank."
            )


def _group_number(g: dict, key: str, i: int, value=None) -> float:
    """A live group's value as the core takes it (what a scheduler or the caller wrote since the last step):
    a real number (a tensor lr too); a string or a bool is refused, not converted."""
    value = g.get(key) if value is None else value
    number = _real_number(value)
    if number is None:
        raise ValueError(f"rank {_rank()}: Muon: param group #{i} ('{g.get('group_name')}') has {key}={value!r}; "
                         "it must be a number (a float, or a one-element real tensor).")
    return number


def _check_adamw_group(g: dict, k: int) -> None:
    """The values of an AdamW group only torch's AdamW (on FSDP2's shards) reads, with the core's ranges."""
    b1, b2 = g["betas"]
    _C._check_adamw_group(_group_number(g, "lr", k), _group_number(g, "weight_decay", k),
                          _group_number(g, "betas[0]", k, b1), _group_number(g, "betas[1]", k, b2),
                          _group_number(g, "eps", k),
                          f"rank {_rank()}: Muon.step: param group #{k} "
                          f"('{g.get('group_name')}', AdamW), as set since construction,")


_STATE_WRITE = (
    "dmuon.Muon.state is a read-only view: dmuon keeps each parameter's state in its native core, where the "
    "parameter is updated (a dedicated matrix's momentum on its owner), so a write here would be lost. Change the "
    "moments or the momentum in place (opt.state[p]['exp_avg'].zero_(); 'step' is a copy), load a state dict (opt.load_state_dict / "
    "dmuon.set_optimizer_state_dict), or build a new Muon to start from fresh state."
)


class _StateEntry(dict):
    """One parameter's state in ``Muon.state`` (a dict of live tensors, but ``step``: a copy); writing keys is
    refused (it would be lost), changing the moments or the momentum in place reaches the optimizer. Copies are
    plain dicts."""

    def _refuse(self, *_args, **_kwargs):
        raise TypeError(f"rank {_rank()}: {_STATE_WRITE}")

    def __setitem__(self, key, value):
        if key != "step" and key in self and dict.__getitem__(self, key) is value:
            return  # `st["exp_avg"] *= 0.5`: the live tensor changed in place, then is set back as itself
        self._refuse()

    __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):
        return (dict, (dict(self),))


class _OptimizerState(Mapping):
    """``Muon.state``: a read-only view of the per-parameter state this rank holds, as torch.optim's
    (``opt.state[p]``: ``momentum_buffer`` for a Muon matrix, ``step`` / ``exp_avg`` / ``exp_avg_sq`` for AdamW;
    live tensors). dmuon keeps it where each parameter is updated: a dedicated matrix's momentum on its owner
    only, a sharded_adamw parameter's moments as this rank's slice, FSDP2's shards' in torch's AdamW. A
    parameter of this optimizer without state here gives ``{}`` (as torch's defaultdict); iteration and ``len``
    cover the parameters with state here. Its truth value is an error: it differs across ranks."""

    def __init__(self, optimizer: "Muon"):
        self._opt = optimizer
        self._params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        external = optimizer._external
        self._external = {id(p) for g in external.param_groups for p in g["params"]} if external is not None else set()

    def _lookup(self, p):
        opt = self._opt
        if id(p) in self._external:
            return opt._external.state.get(p) or None
        found = opt._native.param_state(p) if isinstance(p, torch.Tensor) else None
        if found is None or (int(found["step"]) == 0 and len(found) == 1):  # (a step-0 state loaded: none, as torch)
            return None
        if "exp_avg" in found:  # AdamW's as torch keeps it: the step as a float tensor
            found["step"] = torch.tensor(float(found["step"]))
        else:
            del found["step"]
        return _StateEntry(found)

    def __getitem__(self, p):
        found = self._lookup(p)
        if found is not None:
            return found
        if id(p) in self._params:
            return _StateEntry()
        raise KeyError(f"Muon.state: {type(p).__name__} is not a parameter of this optimizer")

    def __contains__(self, p):
        return self._lookup(p) is not None

    def __setitem__(self, p, value):
        raise TypeError(f"rank {_rank()}: {_STATE_WRITE}")

    def __delitem__(self, p):
        raise TypeError(f"rank {_rank()}: {_STATE_WRITE}")

    def get(self, p, default=None):
        """As torch's defaultdict: ``default`` (not ``{}``) for a parameter without state on this rank."""
        found = self._lookup(p)
        return default if found is None else found

    def __iter__(self):
        return iter([p for g in self._opt.param_groups for p in g["params"] if self._lookup(p) is not None])

    def __len__(self):
        return sum(1 for _ in self)

    def __bool__(self):
        raise RuntimeError(
            f"rank {_rank()}: the truth value of dmuon.Muon.state is "
            "ambiguous: each rank holds the state of the parameters it updates (a dedicated matrix's on its owner), "
            "so it would differ across ranks; use len(opt.state) for this rank's count. torch.distributed.checkpoint"
            ".state_dict's get/set_optimizer_state_dict test it, then would run a zero-gradient step and read "
            "torch.optim's per-rank format, which cannot hold state that lives on other ranks: checkpoint dmuon.Muon "
            "with dmuon.get_optimizer_state_dict(model, opt) / dmuon.set_optimizer_state_dict (or opt.state_dict() "
            "/ opt.load_state_dict()), and the model with dmuon.get_model_state_dict / set_model_state_dict."
        )

    def __repr__(self):
        return f"Muon.state({len(self)} parameter(s) with state on this rank)"


class Muon(torch.optim.Optimizer):
    """Muon on a dedicated model: momentum, Newton-Schulz and the update of each Muon matrix on its owner,
    AdamW on every other trainable parameter: on its dmuon route, or, for the DTensor shards of FSDP2
    (``fully_shard`` after ``dedicate_params``), by torch's AdamW on each rank's shard.

    Parameter groups: without ``param_groups``, two (Muon, AdamW). With ``param_groups`` (PyTorch-style
    semantic groups: ``[{"params": [...], "lr": ..., "momentum": ..., "weight_decay": ..., "nesterov": ...,
    "ns_steps": ..., "adamw_lr": ..., "adamw_betas": ..., "adamw_weight_decay": ..., "adamw_eps": ...,
    "name": ...}]``, every key but ``params`` optional: unset, the optimizer's argument), each user group is
    lowered into a Muon subgroup (its dedicated matrices) and an AdamW subgroup (its other parameters), in
    order, then a "default" pair for the parameters in no group. ``torch.optim.lr_scheduler`` and the caller may change each group's
    ``lr``, ``weight_decay`` and ``momentum`` between steps, and an AdamW group's ``betas`` and ``eps``. An AdamW
    group's ``momentum`` is its beta1 (``betas[0]``), as with torch's Adam: OneCycleLR and CyclicLR
    (``cycle_momentum=True``) cycle Muon's momentum in the Muon groups and beta1 in the AdamW groups, as they
    would for a torch SGD-momentum and a torch AdamW side by side.

    ``fused`` / ``foreach``, as torch.optim's: AdamW by LibTorch's fused kernel (None: wherever torch has it,
    the CPU included), Muon's momentum, finiteness check and weight update by ``torch._foreach_*`` ops (None: on
    CUDA), one call per list of parameters; same results up to rounding. torch's AdamW on FSDP2 shards gets
    them as given.

    Construction and ``step()`` are collective: every rank of the model's mesh (construction checks once that
    every rank passed the same options)."""

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        adamw_lr: float = 0.001,
        adamw_betas=(0.9, 0.999),
        adamw_weight_decay: float = 0.01,
        adamw_eps: float = 1e-08,
        param_groups: Optional[List[dict]] = None,
        ns_backend="gram",
        nesterov: bool = True,
        replicate_async: bool = True,
        record_step_profile: bool = False,
        group_prepare_ahead: bool = True,
        tp_distributed_gram: bool = False,
        tp_distributed_gram_policy: str = "beneficial",
        tp_distributed_gram_max_factor_to_scatter_ratio: float = 0.5,
        post_step_prefetch_groups: int = 0,
        post_step_prefetch_sharded_adamw: bool = False,
        sharded_adamw_unshard_separate_stream: bool = False,
        forward_prefetch_depth: int = 1,
        first_step_progress_log: bool = True,
        first_step_progress_log_limit: int = 8,
        fused: Optional[bool] = None,
        foreach: Optional[bool] = None,
    ):
        state = _state_of(model, "Muon")
        # this rank's checks; a refusal is agreed with the other ranks below (each raises), never raised alone
        # while they wait in the agreement's collective
        failure, user, external = None, [], {}
        try:
            given = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps, adamw_lr=adamw_lr,
                         adamw_betas=adamw_betas, adamw_weight_decay=adamw_weight_decay, adamw_eps=adamw_eps,
                         ns_backend=ns_backend, nesterov=nesterov, replicate_async=replicate_async,
                         group_prepare_ahead=group_prepare_ahead)
            unset = [k for k, v in given.items() if v is None]
            if unset:  # as torch.optim: None is no value (only fused / foreach take None, meaning "decide")
                raise TypeError(f"Muon: {unset[0]}=None; pass a value (or leave the argument out for its default).")
            if isinstance(post_step_prefetch_groups, bool) or not isinstance(post_step_prefetch_groups, int) \
                    or post_step_prefetch_groups < 0:
                raise ValueError(f"Muon: post_step_prefetch_groups must be an int >= 0, got {post_step_prefetch_groups!r}")
            if isinstance(forward_prefetch_depth, bool) or not isinstance(forward_prefetch_depth, int) or forward_prefetch_depth < 0:
                raise ValueError(f"Muon: forward_prefetch_depth must be an int >= 0, got {forward_prefetch_depth!r}")
            if isinstance(first_step_progress_log_limit, bool) or not isinstance(first_step_progress_log_limit, int) \
                    or first_step_progress_log_limit < 0:
                raise ValueError("Muon: first_step_progress_log_limit must be an int >= 0, got "
                                 f"{first_step_progress_log_limit!r}")

            # FSDP2's DTensor shards (fully_shard after dedicate_params) leave dmuon's routes before the native
            # optimizer checks that every trainable parameter is on a distributed route
            external = _sync_external(model, state)
            local = [n for n, route in state.runtime.routes() if route == "local"]
            if local and state.mesh.world_size > 1:
                raise ValueError(
                    f"Muon: {len(local)} trainable parameter(s) have no data-parallel route on this "
                    f"{state.mesh.world_size}-rank mesh: {local[:8]}. Each rank would update them with its own "
                    "gradient and the replicas would drift apart. Before constructing Muon, call dmuon.replicate(model), "
                    "or fully_shard the modules that hold them, or freeze them (requires_grad_(False))."
                )
            known = {id(p) for p in state.params.values()} | {id(p) for p in external.values()}
            added = [n for n, p in model.named_parameters()
                     if p.requires_grad and n not in state.params and id(p) not in known]
            if added:
                raise ValueError(
                    f"Muon: trainable parameter(s) {added[:8]} were added to the model after dedicate_params, so no "
                    "dmuon route averages their gradients and no step would update them. Add every parameter before "
                    "dedicate_params (or freeze these: requires_grad_(False))."
                )
            user = _user_groups(param_groups, state)
        except Exception as e:  # noqa: BLE001  (raised on this rank by the agreement)
            failure = e
        # what decides the math or the collectives must be the same on every rank: else the replicas drift
        # apart silently (an lr per rank) or the ranks issue different collectives (a hang until the timeout)
        _agree_across_ranks(state.world_group, {} if failure is not None else dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps, adamw_lr=adamw_lr,
            adamw_betas=tuple(adamw_betas), adamw_weight_decay=adamw_weight_decay, adamw_eps=adamw_eps,
            param_groups=user, ns_backend=ns_backend, nesterov=nesterov, replicate_async=replicate_async,
            group_prepare_ahead=group_prepare_ahead, tp_distributed_gram=tp_distributed_gram,
            tp_distributed_gram_policy=tp_distributed_gram_policy,
            tp_distributed_gram_max_factor_to_scatter_ratio=tp_distributed_gram_max_factor_to_scatter_ratio,
            post_step_prefetch_groups=post_step_prefetch_groups,
            post_step_prefetch_sharded_adamw=post_step_prefetch_sharded_adamw,
            sharded_adamw_unshard_separate_stream=sharded_adamw_unshard_separate_stream,
            forward_prefetch_depth=forward_prefetch_depth), failure=failure, device=getattr(state.groups, "device", None))
        native_user = [dict(g, params=[state.params[n] for n in g["params"] if n not in external]) for g in user]
        options = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps, adamw_lr=adamw_lr,
            adamw_betas=tuple(adamw_betas), adamw_weight_decay=adamw_weight_decay, adamw_eps=adamw_eps,
            param_groups=native_user, ns_backend=ns_backend, nesterov=nesterov, replicate_async=replicate_async,
            record_step_profile=bool(record_step_profile), group_prepare_ahead=group_prepare_ahead,
            tp_distributed_gram=tp_distributed_gram, tp_distributed_gram_policy=tp_distributed_gram_policy,
            tp_distributed_gram_max_factor_to_scatter_ratio=tp_distributed_gram_max_factor_to_scatter_ratio,
            first_step_progress_log=bool(first_step_progress_log),  # (local settings: not agreed, never refused)
            first_step_progress_log_limit=first_step_progress_log_limit,
            post_step_prefetch_groups=post_step_prefetch_groups,
            post_step_prefetch_sharded_adamw=bool(post_step_prefetch_sharded_adamw),
            fused=None if fused is None else bool(fused), foreach=None if foreach is None else bool(foreach),
        )
        if sharded_adamw_unshard_separate_stream:  # the all-gathers' own group: built once per mesh (collective)
            add_sharded_unshard_group(state.mesh, state.groups)
        options["sharded_adamw_unshard_separate_stream"] = bool(sharded_adamw_unshard_separate_stream)
        self._native = _C._Muon(state.runtime, options)
        state.runtime.set_forward_prefetch_depth(forward_prefetch_depth)
        self._model_state = state
        self._model = model
        groups = []
        for i in range(self._native.group_count()):
            group = dict(self._native.group_options(i))
            group["params"] = list(self._native.group_params(i))
            groups.append(group)
            if not group["is_muon"]:
                group["momentum"] = group["betas"][0]  # an AdamW group's momentum is its beta1
        self._native_groups = len(groups)
        # AdamW on FSDP2's shards, by torch's own AdamW, in the AdamW subgroup of the user group that holds
        # them (lowered groups 2i, 2i+1), else of the "default" group
        by_group = {}
        for name, p in _trained_external(state).items():
            i = next((j for j, g in enumerate(user) if name in g["params"]), None)
            by_group.setdefault(i, []).append(p)
        self._external = None
        self._external_groups = []  # (index in param_groups, index in the torch AdamW's groups)
        if by_group:
            torch_groups = []
            for i, ps in by_group.items():
                if i is not None:
                    k = 2 * i + 1
                else:
                    k = 2 * len(user) + 1 if len(groups) > 2 * len(user) else None
                if k is None:  # every dmuon parameter is in a user group: a "default" AdamW group for the rest
                    k = len(groups)
                    groups.append(dict(lr=adamw_lr, is_muon=False, momentum=float(adamw_betas[0]), nesterov=False,
                                       weight_decay=adamw_weight_decay, ns_steps=0, betas=tuple(adamw_betas),
                                       eps=adamw_eps, group_name="default", params=[]))
                groups[k]["params"] = groups[k]["params"] + ps
                self._external_groups.append((k, len(torch_groups)))
                g = groups[k]
                torch_groups.append(dict(params=ps, lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                         weight_decay=g["weight_decay"]))
            kernels = {} if fused is None else {"fused": bool(fused)}
            if foreach is not None and not fused:
                kernels["foreach"] = bool(foreach)
            self._external = torch.optim.AdamW(torch_groups, **kernels)
        _warn_unused_group_values(user, groups)
        self._group_count = len(groups)
        self._group_params = [list(g["params"]) for g in groups]
        self._constructed = False
        # what torch.optim's schedulers read from defaults: momentum in it lets OneCycleLR and CyclicLR cycle
        # it (cycle_momentum=True) in every group (an AdamW group's momentum is its beta1)
        super().__init__(groups, defaults=dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                               nesterov=nesterov, ns_steps=ns_steps))
        self._beta1 = {i: g["betas"][0] for i, g in enumerate(self.param_groups) if not g["is_muon"]}
        self.state = _OptimizerState(self)  # torch.optim's per-parameter dict, read from the native core
        self._constructed = True

    # what may change between steps (schedulers, the caller), in a Muon group and in an AdamW group
    _MUTABLE = ("lr", "weight_decay", "momentum")
    _MUTABLE_ADAMW = _MUTABLE + ("betas", "eps")

    def _sync_beta1(self, i: int, g: dict) -> None:
        """An AdamW group's momentum is its beta1: whichever of group["momentum"] and group["betas"][0]
        changed since the last step (a scheduler writes one of them) sets both."""
        betas = g.get("betas")
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(_real_number(b) is not None for b in betas)):
            raise ValueError(f"Muon: param group #{i} ('{g.get('group_name')}', AdamW) has betas={betas!r}; betas "
                             "is a pair of numbers (beta1, beta2).")
        last, m = self._beta1[i], g.get("momentum")
        if m != last and betas[0] != last and m != betas[0]:
            raise ValueError(
                f"Muon: param group #{i} ('{g.get('group_name')}', AdamW) has momentum={m!r} and betas[0]="
                f"{betas[0]!r}, both changed since the last step ({last!r}); an AdamW group's momentum is its beta1. "
                "Set one of them.")
        beta1 = m if m != last else betas[0]
        g["betas"], g["momentum"] = (beta1, betas[1]), beta1
        self._beta1[i] = beta1

    def add_param_group(self, param_group: dict) -> None:
        """Refused after construction: dmuon's groups are the model's routes, fixed by dedicate_params (each
        parameter's owner, route and state). Pass every group to Muon(param_groups=...) instead."""
        if getattr(self, "_constructed", True):
            raise ValueError(
                "Muon.add_param_group: dmuon's parameter groups are fixed at construction (each parameter's route, "
                "owner and optimizer state were planned by dedicate_params), and every trainable parameter of the "
                "model is in one already. Pass the groups to Muon(model, param_groups=[...]); to start training a "
                "frozen parameter later, unfreeze it before dedicate_params and keep its group's lr at 0 until then."
            )
        super().add_param_group(param_group)

    # torch.amp.GradScaler.step hands this optimizer the scale and the agreed infs (grad_scale / found_inf
    # attributes) instead of skipping step() on its own local view: dmuon.GradScaler agrees them over the mesh
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (collective: every rank of the model's mesh): waits the gradient reduces,
        momentum + Newton-Schulz + update on the matrices this rank owns, AdamW on the rest (dmuon's routes,
        then FSDP2's shards), and the post-step publish. Returns ``closure()``'s loss when given.

        Under :class:`dmuon.GradScaler` (``scaler.step(optimizer)``): the gradients are unscaled first, and a
        step whose gradients hold an inf or NaN on any rank is skipped on every rank (the gradients stay, as
        torch's scaler leaves them, until the loop's ``zero_grad``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._model_state.guard()
            self._push_groups()
            if hasattr(self, "found_inf") and self._amp_skips():
                return loss
            try:
                self._native.step()
            except _C.NonFiniteGradientError:
                # the verdict on a non-finite Muon gradient, raised on every rank once dmuon's updates are done:
                # FSDP2's shards take their step too ("the step's other updates were applied"), then it is raised
                if self._external is not None:
                    self._external.step()
                raise
            if self._external is not None:
                self._external.step()
        except BaseException:
            # a GradScaler's step deletes the grad_scale / found_inf it set only when step() returns: left here,
            # the next scaler.step would multiply its scale into the stale one (unscaling twice)
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            self._amp_found_inf = None
            raise
        return loss

    def _amp_grads(self) -> List[torch.Tensor]:
        """Every gradient the next step() uses, in place (collective: waits the reduces): the reduced sums
        dmuon holds for its routes (the dedicated matrices' on their owners) and FSDP2's local shards."""
        native = [g for _, g, _, _ in _C._muon_clip_grads(self._native, True)]
        return native + [g for _, g, _, _ in _external_clip_grads(self._model_state)]

    def _unscale_grads(self, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool) -> torch.Tensor:
        """dmuon.GradScaler's unscale / inf check of this optimizer's gradients (collective: every rank of the
        model's mesh): multiplies them by inv_scale, and sets found_inf (1.0) on every rank when any rank's
        gradients hold an inf or NaN (a dedicated matrix's reduced gradient lives on its owner alone)."""
        fp16 = self._unscale_local(inv_scale, found_inf, allow_fp16)
        group = self._model_state.world_group
        if group is not None and dist.get_world_size(group) > 1:
            # the infs and torch's FP16 refusal together: a reduced gradient lives on its owner alone, so
            # either seen on one rank is acted on by every rank (an error on some would leave the rest waiting)
            both = torch.stack([found_inf.float(), torch.tensor(float(fp16), device=found_inf.device)])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            found_inf.copy_(both[0])
            fp16 = bool(both[1] > 0)
        if fp16:
            raise ValueError("Attempting to unscale FP16 gradients.")  # torch.amp.GradScaler's own error
        self._amp_found_inf = found_inf
        return found_inf

    def _unscale_local(self, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool) -> bool:
        """Unscales this rank's gradients and sets found_inf for theirs; True (nothing unscaled) where one is
        float16 and allow_fp16 is False (torch.amp.GradScaler refuses to unscale fp16 parameters' gradients)."""
        by_key: Dict[tuple, List[torch.Tensor]] = {}
        for g in self._amp_grads():
            if g.dtype == torch.float16 and not allow_fp16:
                return True
            by_key.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), grads in by_key.items():
            here = found_inf if device == found_inf.device else torch.zeros_like(found_inf, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, here, inv_scale.to(device))
            if here is not found_inf:
                found_inf.copy_(torch.maximum(found_inf, here.to(found_inf.device)))
        return False

    def _amp_skips(self) -> bool:
        """Under a GradScaler's step (found_inf / grad_scale set on the optimizer): True when the step is to be
        skipped (an inf or NaN on some rank; its gradients are left as torch leaves them, for the loop's
        zero_grad), else unscales what is still scaled."""
        agreed, self._amp_found_inf = getattr(self, "_amp_found_inf", None), None
        if agreed is None:
            raise RuntimeError(
                f"rank {_rank()}: Muon.step: called by a gradient scaler "
                "(torch.amp.GradScaler?) that did not check dmuon's gradients. dmuon holds the dedicated matrices' "
                "reduced gradients outside .grad, on their owner alone, so torch.amp.GradScaler neither unscales "
                "them nor sees their infs, and each rank would decide on its own whether to skip the step. Use "
                "dmuon.GradScaler (torch.amp.GradScaler's API and arguments: dmuon.GradScaler('cuda'), then scale, "
                "unscale_, step, update as usual) for this optimizer."
            )
        if float(self.found_inf) > 0:  # agreed over the mesh by _unscale_grads: every rank skips
            return True
        scale = getattr(self, "grad_scale", None)  # None: unscale_ ran already
        if scale is not None:  # scaler.step without unscale_: the infs were checked, the gradients are still scaled
            self._unscale_local(scale.double().reciprocal().float(), torch.zeros_like(agreed), True)
        return False

    def _push_groups(self) -> None:
        """The groups' lr / weight_decay / momentum (what schedulers and the caller change) to the native
        optimizer and torch's AdamW on the FSDP2 shards; any other changed key is refused, not ignored."""
        if len(self.param_groups) != self._group_count:
            raise ValueError("Muon: parameter groups were added or removed; dmuon's groups are fixed by the model's routes.")
        for i, (g, params) in enumerate(zip(self.param_groups, self._group_params)):
            now = g.get("params")
            if not isinstance(now, (list, tuple)) or len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
                raise ValueError(
                    f"Muon: param_groups[{i}]['params'] ('{g.get('group_name')}') changed since construction; dmuon "
                    "trains the parameters its groups were built with (their routes and owners are planned), so the "
                    "change would be ignored. To stop training some parameters set their group's lr to 0 (or build "
                    "the groups with Muon(param_groups=...)); to freeze them for good, requires_grad_(False) before "
                    "dedicate_params."
                )
        for i, g in enumerate(self.param_groups):
            _refuse_torch_only_flags(i, g)
            if not g["is_muon"]:
                self._sync_beta1(i, g)
        for i, g in enumerate(self.param_groups[:self._native_groups]):
            native = self._native.group_options(i)
            mutable = self._MUTABLE if g["is_muon"] else self._MUTABLE_ADAMW
            for key, value in native.items():
                if key not in mutable and g.get(key) != value:
                    raise ValueError(
                        f"Muon: parameter group {i} has {key}={g.get(key)!r}, but dmuon takes only "
                        f"{', '.join(mutable)} from a{'' if g['is_muon'] else 'n AdamW'} group between steps ({key} is "
                        f"{value!r}). Pass it to Muon(...) instead."
                    )
            betas = g["betas"] if not g["is_muon"] else native["betas"]
            eps = g["eps"] if not g["is_muon"] else native["eps"]
            self._native.set_group_options(i, _group_number(g, "lr", i), _group_number(g, "weight_decay", i),
                                           _group_number(g, "momentum", i), _group_number(g, "betas[0]", i, betas[0]),
                                           _group_number(g, "betas[1]", i, betas[1]), _group_number(g, "eps", i, eps))
        for k, j in self._external_groups:
            g, inner = self.param_groups[k], self._external.param_groups[j]
            if k >= self._native_groups:  # only torch's AdamW reads this group: checked here, as the core checks its own
                _check_adamw_group(g, k)
            for key in ("lr", "weight_decay", "betas", "eps"):
                inner[key] = g[key]

    def clip_grad_norm_(self, max_norm: Optional[float], *, norm_type: Optional[float] = None,
                        error_if_nonfinite: Optional[bool] = None, foreach: Optional[bool] = None, strategy=None,
                        scope: str = "muon") -> MuonGradClipStats:
        """Clips the gradients between backward and step (it waits the reduces itself) and returns a
        :class:`dmuon.MuonGradClipStats`. ``scope="muon"`` (the API reference's): the dedicated matrices only
        (one global norm over their owners); AdamW parameters are left to ``torch.nn.utils.clip_grad_norm_``.
        ``"all"``: every trainable parameter, on dmuon's routes and FSDP2's shards alike, the norm
        ``torch.nn.utils.clip_grad_norm_`` gives over the whole model in one process (each element counted
        once). ``max_norm=None`` only
        measures. ``norm_type`` (default 2; ``inf``: the max norm), ``error_if_nonfinite`` (default False),
        ``foreach`` (fused kernels; None: on CUDA float32/float64), ``strategy`` ("global_norm", a registered
        name, or a callable; see :func:`dmuon.register_muon_grad_clip_strategy`). Collective: every rank of
        the model's mesh."""
        # this rank's own checks: a refusal is agreed (it raises on every rank, not here alone while the others
        # wait in the clip's collectives until the timeout)
        refusal = None
        try:
            if scope not in ("muon", "all"):
                raise ValueError(f"scope must be 'muon' or 'all', got {scope!r}")
            norm_type = 2.0 if norm_type is None else _clip_number("norm_type", norm_type)
            max_norm = None if max_norm is None else _clip_number("max_norm", max_norm)
            strategy = "global_norm" if strategy is None else strategy
            custom = python_strategy(strategy)
            if custom is None and not isinstance(strategy, str):
                raise ValueError(f"strategy must be a name or a callable, got {type(strategy).__name__}")
            if foreach is not None and not isinstance(foreach, bool):
                raise ValueError(f"foreach must be None or a bool, got {foreach!r}")
        except (TypeError, ValueError) as e:
            refusal = e
        if refusal is not None:
            try:
                self._native.agree_clip(None, 2.0, False, "", False,
                                        f"rank {_rank()}: clip_grad_norm_: {refusal}")
            except ValueError:
                pass
            raise ValueError(f"rank {_rank()}: clip_grad_norm_: {refusal}") from None
        error_if_nonfinite = bool(error_if_nonfinite)
        extra = _external_clip_grads(self._model_state) if scope == "all" else []
        if custom is not None:
            name = strategy if isinstance(strategy, str) else getattr(strategy, "__name__", "custom")
            # agreed as the core's strategies are (a Python strategy's own collectives follow), marked as Python's:
            # a name registered on some ranks only differs from the others' (the core's, unknown there)
            self._native.agree_clip(max_norm, norm_type, error_if_nonfinite, f"{name} (Python)", scope == "all", "")
            stats = run_python_strategy(self._native, custom, name, max_norm, norm_type, error_if_nonfinite, foreach,
                                        scope == "all", self._model_state.world_group, extra)
        else:
            try:
                stats = MuonGradClipStats(**self._native.clip(max_norm, norm_type, error_if_nonfinite, foreach,
                                                               strategy, scope == "all", extra))
            except ValueError as e:  # the core knows its own strategies only: add the ones registered from Python
                if "unknown strategy" not in str(e) or not registered_strategies():
                    raise
                raise ValueError(f"{e} From Python: {', '.join(registered_strategies())}.") from None
        self._last_clip = stats
        return stats

    @property
    def last_muon_grad_clip_stats(self) -> Optional[MuonGradClipStats]:
        """The :class:`dmuon.MuonGradClipStats` of the last clip (:meth:`clip_grad_norm_`, or the "muon" bucket of
        :func:`dmuon.try_clip_optimizer_grad_norm_buckets_`); None before one."""
        return getattr(self, "_last_clip", None)

    def consume_last_step_profile(self) -> Dict[str, object]:
        """The last step's split (milliseconds) when ``record_step_profile=True``: prepare (waiting the
        gradient reduces), muon (of which ns), adamw, publish, total, with the clock ("host" on the CPU,
        "cuda_events" on the GPU, read here with one synchronize), the matrices this rank updated and the
        step it belongs to; ``valid`` is False without a recorded step. Resets it. Local."""
        return json.loads(self._native.consume_profile())

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "dmuon.Muon cannot be pickled or copied (torch.save(opt), copy.deepcopy): its state lives in dmuon's "
            "native core, spread over the ranks (each matrix's momentum on its owner). Save opt.state_dict() or "
            "dmuon.get_optimizer_state_dict(model, opt) (collective: every rank) and load it with "
            "opt.load_state_dict() / dmuon.set_optimizer_state_dict into a Muon built on the dedicated model."
        )

    def __deepcopy__(self, memo):
        self.__reduce_ex__(2)

    def state_dict(self):
        """:func:`dmuon.get_optimizer_state_dict` with every rank holding the full result (collective: every
        rank of the model's mesh). torch.optim's own format cannot hold state that lives on other ranks.
        Hooks registered by ``register_state_dict_pre_hook`` / ``_post_hook`` run as in torch.optim."""
        for pre_hook in getattr(self, "_optimizer_state_dict_pre_hooks", {}).values():
            pre_hook(self)
        state_dict = get_optimizer_state_dict(self._model, self, cpu_offload=False, rank0_only=False)
        for post_hook in getattr(self, "_optimizer_state_dict_post_hooks", {}).values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict):
        """:func:`dmuon.set_optimizer_state_dict` (collective; every rank passes the full dict). Hooks registered
        by ``register_load_state_dict_pre_hook`` (which may return the dict to load) / ``_post_hook`` run as in
        torch.optim."""
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)  # a shallow copy, as torch.optim's (a pre-hook may edit it)
        for pre_hook in getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        set_optimizer_state_dict(self._model, self, state_dict)
        for post_hook in getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values():
            post_hook(self)

    def zero_grad(self, set_to_none: bool = True):
        """Clears every gradient this optimizer trains (set_to_none=True: None, as PyTorch 2.x does), including
        the dedicated matrices' gradients that dmuon holds between backward and step (their reduced sums are
        not in ``.grad``): so call this, not ``model.zero_grad()``, to drop a backward without stepping. Local."""
        self._native.zero_grad(set_to_none)
        if self._external is not None:
            self._external.zero_grad(set_to_none)

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken (restored by :func:`dmuon.set_optimizer_state_dict`)."""
        return self._native.steps_taken


_SECTIONS = ("dedicated", "dedicated_adamw", "fsdp")


def _nest(flat: Dict[str, torch.Tensor], fields) -> Dict[str, Dict[str, torch.Tensor]]:
    """{"<param>.<field>": t} -> {"<param>": {"<field>": t}} for the optimizer's known fields."""
    out = {}
    for key, value in flat.items():
        for f in fields:
            if key.endswith("." + f):
                out.setdefault(key[: -len(f) - 1], {})[f] = value
                break
        else:
            raise ValueError(f"optimizer state: unexpected key '{key}'")
    return out


def _step_count(value) -> Optional[int]:
    """A step (an int, a float holding one, or a one-element real tensor of one) as a count; else None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_meta or value.is_complex() or value.dtype == torch.bool:
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return int(value) if math.isfinite(value) and value == int(value) and 0 <= value < 2 ** 63 else None


def _fresh_entry(entry) -> bool:
    """An 'fsdp' entry that is fresh state: step 0 and zero moments (get_optimizer_state_dict's template entry of
    an optimizer that has not stepped; torch's AdamW starts a parameter from the same)."""
    if not isinstance(entry, Mapping) or _step_count(entry.get("step")) != 0:
        return False
    moments = [entry.get(k) for k in ("exp_avg", "exp_avg_sq")]
    return all(isinstance(v, torch.Tensor) and not v.is_meta and int(torch.count_nonzero(v)) == 0 for v in moments)


def _flat(nested: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """{"<param>": {"<field>": t}} -> {"<param>.<field>": t}; a step given as a number becomes a tensor."""
    return {f"{name}.{field}": value if isinstance(value, torch.Tensor) else torch.tensor(_step_count(value))
            for name, fields in nested.items() for field, value in fields.items()}


def _check_optimizer(model: nn.Module, optimizer, fn: str) -> _State:
    state = _state_of(model, fn)
    def unwrapped(m):  # torch.compile(model) wraps it (OptimizedModule): the same model
        return getattr(m, "_orig_mod", m)

    if not isinstance(optimizer, Muon) or unwrapped(optimizer._model) is not unwrapped(model):
        raise ValueError(f"{fn}: optimizer must be the dmuon.Muon built on this model (dmuon.Muon(model, ...)).")
    return state


def get_optimizer_state_dict(model: nn.Module, optimizer, *, cpu_offload: bool = True, rank0_only: bool = True) -> dict:
    """The optimizer state of a dedicated model in full tensors, in four sections: ``"dedicated"`` (each
    Muon matrix's ``momentum_buffer`` and ``step``, from its owner), ``"dedicated_adamw"`` (AdamW
    ``exp_avg``, ``exp_avg_sq``, ``step`` of the parameters on dmuon's routes), ``"fsdp"`` (the same for
    FSDP2's shards, gathered) and ``"param_groups"`` (every group's hyperparameters), plus
    ``"steps_taken"`` and ``"without_state"`` (the parameters the optimizer holds no state for: frozen, or no
    gradient yet; a resume leaves them so, trained or not). Those it keeps are in their section too, as their
    first step starts them (zeros at step 0, loaded as fresh state): the dict holds the same keys whatever the
    training did, and that of an optimizer that has not stepped is a template holding every key
    (``dcp.load({"optim": opt}, ...)`` into a new optimizer fills it). ``cpu_offload``: tensors on the
    CPU; ``rank0_only``: only rank 0 (the mesh's first rank) gets a populated dict, the others
    ``{"fsdp": {}, "dedicated": {}, "param_groups": []}``. Collective: every rank of the model's mesh."""
    state = _check_optimizer(model, optimizer, "get_optimizer_state_dict")
    optimizer._push_groups()  # a scheduler may have changed lr since the last step
    native = optimizer._native.state(state.runtime, cpu_offload, rank0_only)
    keep = not rank0_only or _first_of_mesh(state)
    fsdp, without_state = {}, list(native["without_state"])
    if optimizer._external is not None:
        inner = optimizer._external
        trained = _trained_external(state)
        for name, p in state.external.items():  # model order on every rank: the gathers line up
            st = inner.state.get(p, {})
            if not st:  # no state yet: named, and as its first step starts it (every key in the dict, as the core's)
                without_state.append(name)
                if keep and name in trained:  # (not one frozen at dedicate_params: the optimizer does not keep it)
                    device = "cpu" if cpu_offload else p.device
                    fsdp[name] = {"exp_avg": torch.zeros(p.shape, dtype=p.dtype, device=device),
                                  "exp_avg_sq": torch.zeros(p.shape, dtype=p.dtype, device=device),
                                  "step": torch.tensor(0.0)}
                continue
            entry = {k: full_tensor(st[k].detach()) for k in ("exp_avg", "exp_avg_sq")}
            entry["step"] = st["step"].detach().clone()
            if keep:
                fsdp[name] = {k: (v.cpu() if cpu_offload else v).clone() for k, v in entry.items()}
    if not keep:  # the API reference's empty form
        return {"fsdp": {}, "dedicated": {}, "param_groups": []}
    groups = []
    for g in optimizer.param_groups:
        groups.append({k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"})
    return {
        "fsdp": fsdp,
        "dedicated": _nest(native["muon"], ("momentum_buffer", "step")),
        "dedicated_adamw": _nest(native["adamw"], ("exp_avg_sq", "exp_avg", "step")),
        "param_groups": groups,
        "steps_taken": native["steps_taken"],
        "without_state": without_state,
    }


def _with_every_section(state_dict):
    """A dict of the API reference's four sections (no ``steps_taken``, which dmuon adds) or without
    ``dedicated_adamw`` (its owner-managed AdamW state, absent where there is none): loadable. The missing
    section is empty; the step count is the largest per-parameter ``step`` (the step the state was saved
    after). A dict holding neither a section nor a group is left for the checks to refuse."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(groups, (list, tuple)) or not groups:
        return state_dict
    out = dict(state_dict)
    out.setdefault("dedicated_adamw", {})
    if "steps_taken" not in out:
        # (a value that is not a step count is left for the checks: it counts nothing here)
        steps = [_step_count(entry.get("step")) if isinstance(entry, Mapping) else None
                 for key in _SECTIONS if isinstance(out.get(key), Mapping) for entry in out[key].values()]
        out["steps_taken"] = max([0] + [n for n in steps if n is not None])
    return out


def _in_this_layouts_sections(state_dict, external: Dict[str, nn.Parameter]):
    """A dict saved by a run of another layout (FSDP2's fully_shard there, dmuon's replicate here, or the other
    way): a parameter's AdamW state under 'fsdp' that dmuon trains here moves to 'dedicated_adamw', one under
    'dedicated_adamw' that FSDP2 trains here (``external``) moves to 'fsdp', each step count as that section
    keeps it (torch's AdamW: a float tensor; dmuon: an integer). Anything else is left for the checks."""
    if not isinstance(state_dict, Mapping) or not all(isinstance(state_dict.get(k), Mapping)
                                                      for k in ("fsdp", "dedicated_adamw")):
        return state_dict
    fsdp, own = dict(state_dict["fsdp"]), dict(state_dict["dedicated_adamw"])

    def moved(entry, dtype):
        step = entry.get("step") if isinstance(entry, Mapping) else None
        if not isinstance(step, torch.Tensor) or step.numel() != 1 or not math.isfinite(float(step)):
            return entry
        return dict(entry, step=torch.tensor(float(step) if dtype.is_floating_point else int(float(step)), dtype=dtype))

    for name in [n for n in fsdp if n not in external and n not in own]:
        own[name] = moved(fsdp.pop(name), torch.int64)
    for name in [n for n in own if n in external and n not in fsdp]:
        fsdp[name] = moved(own.pop(name), torch.float32)
    if len(fsdp) == len(state_dict["fsdp"]):
        return state_dict
    return dict(state_dict, fsdp=fsdp, dedicated_adamw=own)


def _check_fsdp_state(name: str, saved, shape: tuple) -> None:
    """The "fsdp" section's entry of one parameter (full shape `shape`), checked as the core checks its own
    sections (torch's AdamW keeps the step as a float tensor)."""
    where = "set_optimizer_state_dict: the 'fsdp' section's"
    if not isinstance(saved, Mapping) or set(saved) != {"step", "exp_avg", "exp_avg_sq"}:
        raise ValueError(f"{where} '{name}' must be a dict of 'step', 'exp_avg' and 'exp_avg_sq', got "
                         f"{sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__}.")
    step = saved["step"]
    if (not isinstance(step, torch.Tensor) or step.numel() != 1 or step.is_complex()
            or not math.isfinite(float(step)) or float(step) != int(float(step))):
        raise ValueError(f"{where} '{name}.step' is not a step count (one integer).")
    if float(step) < 0:
        raise ValueError(f"{where} '{name}.step' is {int(float(step))}; a step count must be >= 0.")
    for key in ("exp_avg", "exp_avg_sq"):
        v = saved[key]
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            raise ValueError(f"{where} '{name}.{key}' is not a floating-point tensor.")
        if tuple(v.shape) != shape:
            raise ValueError(f"{where} '{name}.{key}' has shape {tuple(v.shape)}, the parameter {shape}. Build the "
                             "model as in the run that saved it.")
        bad = int((~torch.isfinite(v)).sum())
        if bad:
            raise ValueError(f"{where} '{name}.{key}' holds {bad} non-finite value(s) (NaN or inf) of {v.numel()}; "
                             "the run that wrote it had diverged. Resume from an earlier checkpoint.")
        if key == "exp_avg_sq" and v.numel() and float(v.min()) < 0:
            raise ValueError(f"{where} '{name}.exp_avg_sq' has negative values ({float(v.min())}); a second moment "
                             "is >= 0.")


def set_optimizer_state_dict(model: nn.Module, optimizer, state_dict: dict) -> None:
    """Loads what :func:`get_optimizer_state_dict` returned (every rank passes the full dict): momentum on
    the matrices' owners, AdamW moments on the ranks that update them (FSDP2 shards sliced), step counts
    and every group's hyperparameters. Collective: every rank of the model's mesh."""
    fn = "set_optimizer_state_dict"
    state = _check_optimizer(model, optimizer, fn)
    external = _trained_external(state)
    state_dict = _in_this_layouts_sections(_with_every_section(state_dict), external)
    groups, steps, without = [], 0, []

    def check():  # every check before anything is loaded, agreed across the ranks
        nonlocal groups, steps, without
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{fn}: the state dict is a {type(state_dict).__name__}, not a dict.")
        missing = [k for k in _SECTIONS + ("param_groups", "steps_taken") if k not in state_dict]
        empty = (" This rank got an empty dict: get_optimizer_state_dict returns the state on rank 0 only by "
                 "default (rank0_only=True); pass rank0_only=False, or send rank 0's to every rank.")
        blank = not any(state_dict.get(k) for k in _SECTIONS + ("param_groups",))
        if missing:
            raise ValueError(
                f"set_optimizer_state_dict: the state dict has no {missing} section(s); pass what "
                "dmuon.get_optimizer_state_dict(model, optimizer, rank0_only=False) returned (or rank 0's, sent to "
                "every rank)." + (empty if blank else "")
            )
        for key in _SECTIONS:
            if not isinstance(state_dict[key], Mapping):
                raise TypeError(f"set_optimizer_state_dict: the '{key}' section is a {type(state_dict[key]).__name__}, "
                                "not a dict; pass what dmuon.get_optimizer_state_dict returned.")
        if not isinstance(state_dict["param_groups"], (list, tuple)):
            raise TypeError(f"set_optimizer_state_dict: param_groups is a {type(state_dict['param_groups']).__name__}, "
                            "not a list; pass what dmuon.get_optimizer_state_dict returned.")
        groups = list(state_dict["param_groups"])
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(
                f"set_optimizer_state_dict: the state dict has {len(groups)} parameter groups, the optimizer "
                f"{len(optimizer.param_groups)}. Build the model and optimizer as in the run that saved it."
                + (empty if not groups else "")
            )
        for i, saved in enumerate(groups):
            absent = [k for k in ("group_name", "is_muon", "lr", "momentum", "weight_decay", "betas", "eps", "nesterov",
                                  "ns_steps") if k not in saved] if isinstance(
                saved, Mapping) else ["(not a dict)"]
            if absent:
                raise ValueError(f"set_optimizer_state_dict: param_groups[{i}] has no {absent}; pass the param_groups "
                                 "get_optimizer_state_dict returned.")
            values = [saved[k] for k in ("lr", "momentum", "weight_decay", "eps")] + list(
                saved["betas"] if isinstance(saved["betas"], (tuple, list)) else [saved["betas"]] * 3)
            if len(values) != 6 or not all(_real_number(v) is not None for v in values):
                raise ValueError(f"set_optimizer_state_dict: param_groups[{i}] holds a value that is not a number in "
                                 f"lr, momentum, weight_decay, eps or betas (a pair): {dict((k, saved[k]) for k in ('lr', 'momentum', 'weight_decay', 'eps', 'betas'))}.")
            if not isinstance(saved["nesterov"], bool):
                raise ValueError(f"set_optimizer_state_dict: param_groups[{i}] has nesterov={saved['nesterov']!r}; it "
                                 "must be a bool.")
            if isinstance(saved["ns_steps"], bool) or not isinstance(saved["ns_steps"], numbers.Integral) \
                    or (saved["ns_steps"] < 1 and saved.get("is_muon")):  # (an AdamW group keeps 0)
                raise ValueError(f"set_optimizer_state_dict: param_groups[{i}] has ns_steps={saved['ns_steps']!r}; it "
                                 "must be an int >= 1.")
            _refuse_torch_only_flags(i, saved)  # (copied into the live groups below: step() would refuse them)
            mine = optimizer.param_groups[i]
            if bool(saved.get("is_muon")) != mine["is_muon"] or saved.get("group_name") != mine["group_name"]:
                raise ValueError(
                    f"set_optimizer_state_dict: param_groups[{i}] is '{saved.get('group_name')}' "
                    f"({'Muon' if saved.get('is_muon') else 'AdamW'}) in the state dict but '{mine['group_name']}' "
                    f"({'Muon' if mine['is_muon'] else 'AdamW'}) here. Build the optimizer as in the run that saved it.")
        steps = state_dict["steps_taken"]
        try:  # an int, a numpy integer or a one-element integer tensor
            steps = None if isinstance(steps, bool) else operator.index(steps)
        except TypeError:
            steps = None
        if steps is None or steps < 0 or steps >= 2 ** 63:
            raise ValueError(f"set_optimizer_state_dict: steps_taken is {state_dict['steps_taken']!r}; a step count is "
                             "an integer in [0, 2**63).")
        held = [k for k in ("fsdp", "dedicated", "dedicated_adamw") if state_dict[k]]
        listed = state_dict.get("without_state", [])
        if steps > 0 and not held and isinstance(listed, (list, tuple)) and any(
                p.requires_grad and n not in listed for n, p in state.params.items()):
            raise ValueError(
                f"set_optimizer_state_dict: the state dict says {steps} step(s) were taken but holds no parameter's "
                "state (every section is empty) and does not list them as without state: loading it would restart "
                "every parameter from fresh state. A loader that fills only the keys of its template "
                "(torch.distributed.checkpoint) gives this when its template listed no state: take the template from "
                "the new optimizer's opt.state_dict() before its first step (it lists every parameter's state), or "
                "read the checkpoint whole -- "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save(dir, path), then torch.load(path).")
        for key in ("dedicated", "dedicated_adamw"):  # what the core takes: tensors (a step may be a number)
            for name, entry in state_dict[key].items():
                fields = entry.items() if isinstance(entry, Mapping) else [("", entry)]
                for field, value in fields:
                    if not isinstance(value, torch.Tensor) and not (field == "step" and _step_count(value) is not None):
                        raise TypeError(
                            f"set_optimizer_state_dict: '{key}'['{name}']" + (f"['{field}']" if field else "") +
                            f" is a {type(value).__name__}, not a " + ("tensor" if field else "dict of tensors") +
                            "; pass what dmuon.get_optimizer_state_dict returned.")
        without = state_dict.get("without_state", [])
        if isinstance(without, (str, bytes)) or not isinstance(without, (list, tuple)) or not all(
                isinstance(n, str) for n in without):
            raise TypeError(f"set_optimizer_state_dict: without_state is {type(without).__name__} "
                            f"{str(without)[:80]!r}, not a list of parameter names; pass what "
                            "dmuon.get_optimizer_state_dict returned.")
        both = [n for n in without if n in state_dict["fsdp"] and not _fresh_entry(state_dict["fsdp"][n])]
        if both:
            raise ValueError(f"set_optimizer_state_dict: {both[:5]} are listed as without state (without_state) but "
                             "the 'fsdp' section holds their state; the state dict contradicts itself (damaged or "
                             "edited).")
        unfilled = [n for n, e in state_dict["fsdp"].items() if steps > 0 and n in external and
                    external[n].requires_grad and n not in without and _fresh_entry(e)]
        if unfilled:
            raise ValueError(
                f"set_optimizer_state_dict: {unfilled[:5]} hold zeros at step 0 (no state) in a state dict at step "
                f"{steps}, and without_state does not name them: the dict says they had state, and their entries were "
                "never filled in -- a loader that fills only its template's keys (torch.distributed.checkpoint with "
                "allow_partial_load=True) given a checkpoint of another layout (FSDP2's fully_shard on one side, "
                "dmuon's replicate or sharded_adamw on the other) or of another model. Read such a checkpoint whole "
                "(torch.distributed.checkpoint.format_utils.dcp_to_torch_save, then torch.load) and load its "
                "optimizer dict.")
        unknown = [n for n in state_dict["fsdp"] if n not in external]
        # (one frozen now may have been frozen before its first step: no state, in torch's optimizer either; one
        # the dict lists as without state had none when it was taken)
        absent = [n for n, p in external.items() if n not in state_dict["fsdp"] and p.requires_grad
                  and n not in without] if steps > 0 else []
        if unknown or absent:
            raise ValueError(
                f"set_optimizer_state_dict: the 'fsdp' section does not match the FSDP2 parameters of this model "
                f"(unknown: {unknown[:5]}, missing: {absent[:5]}). Build the model as in the run that saved it."
            )
        for name, saved in state_dict["fsdp"].items():  # the core's checks of its own sections, before anything loads
            _check_fsdp_state(name, saved, tuple(external[name].shape))

    _load_agreed(state.world_group, fn, check, state_dict, getattr(state.groups, "device", None))
    n = optimizer._native_groups
    # (a tensor or numpy lr, as torch allows, reaches the core as a float; the groups keep what was saved)
    native_groups = [{k: (tuple(_real_number(b) for b in v) if k == "betas" else
                          _real_number(v) if k in ("lr", "momentum", "weight_decay", "eps") else v)
                      for k, v in g.items()} for g in groups[:n]]
    optimizer._native.load_state(state.runtime, _flat(state_dict["dedicated"]), _flat(state_dict["dedicated_adamw"]),
                                 native_groups, steps, [n for n in without if n not in state.external])
    for i, (g, saved) in enumerate(zip(optimizer.param_groups, groups)):
        for k, v in saved.items():
            if k != "params":  # (a torch-style dict's parameter indices: the groups are matched by position)
                g[k] = tuple(_real_number(b) for b in v) if k == "betas" else v
        if not g["is_muon"]:  # the saved betas are the AdamW group's (its momentum is beta1)
            g["momentum"] = optimizer._beta1[i] = g["betas"][0]
    if optimizer._external is not None:
        inner = optimizer._external
        for name, p in external.items():
            saved = state_dict["fsdp"].get(name)
            if saved is None or _fresh_entry(saved):  # (zeros at step 0: a template's entry, fresh state)
                inner.state.pop(p, None)
                continue
            entry = {"step": saved["step"].detach().clone().to(torch.float32)}
            for k in ("exp_avg", "exp_avg_sq"):
                entry[k] = torch.zeros_like(p)
                assign_full(entry[k], saved[k], f"{name}.{k}")
            inner.state[p] = entry
        optimizer._push_groups()
