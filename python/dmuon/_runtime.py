"""Dedicated ownership of an ordinary PyTorch model: the model is handed to the C++ runtime as data
(its parameters, buffers and module tree), forward boundaries are module hooks that enter and leave
dmuon's C++ boundary scopes, and everything in backward stays in C++ (AccumulateGrad node hooks,
identity autograd functions, the engine's end-of-backward callback)."""

import contextlib
import os
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import _C

_DEFAULT_TIMEOUT_S = 300.0  # dmuon's collective timeout (a lost peer is an error after it)


class _State:
    """What dmuon keeps on a dedicated model (``model._dmuon``)."""

    def __init__(self, runtime, mesh, hooks):
        self.runtime = runtime
        self.mesh = mesh
        self.hooks = hooks
        self.replicated = False


def _state_of(model: nn.Module, fn: str) -> _State:
    state = getattr(model, "_dmuon", None)
    if state is None:
        raise ValueError(
            f"{fn}: this model was not dedicated. Call dmuon.dedicate_params(model, mesh, predicate) first, on every rank."
        )
    return state


def _group_and_device(mesh) -> tuple:
    """The 1-D process group of `mesh` (a DeviceMesh or a ProcessGroup) and the device its tensors live on."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "dedicate_params: torch.distributed is not initialised. Call dist.init_process_group (torchrun sets "
            "the environment) or init_device_mesh before dedicating a model."
        )
    if isinstance(mesh, dist.ProcessGroup):
        group = mesh
        backend = dist.get_backend(group)
        device = "cuda:%d" % torch.cuda.current_device() if backend == "nccl" else "cpu"
        return group, device
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without DeviceMesh
        DeviceMesh = ()
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise NotImplementedError(
                f"dedicate_params: a {mesh.ndim}-D DeviceMesh is not supported by this build of dmuon's Python API "
                "yet: pass a 1-D mesh (HSDP through replicate_mesh and TP come with the next versions)."
            )
        device = mesh.device_type if mesh.device_type == "cpu" else "%s:%d" % (mesh.device_type, torch.cuda.current_device())
        return mesh.get_group(), device
    raise TypeError(
        f"dedicate_params: mesh must be a torch.distributed DeviceMesh or ProcessGroup, got {type(mesh).__name__}. "
        "Build one with torch.distributed.device_mesh.init_device_mesh('cpu' or 'cuda', (world_size,))."
    )


def _make_mesh(mesh, process_group_policy: Optional[str]):
    group, device = _group_and_device(mesh)
    policy = process_group_policy or os.environ.get("DMUON_PROCESS_GROUP_POLICY", "") or "isolated"
    if policy not in ("isolated", "shared"):
        raise ValueError(f"process_group_policy must be 'isolated' or 'shared', got {policy!r}")
    if policy == "isolated":
        # dmuon's own group over the same ranks: the trainer's collectives on its groups never interleave
        # with dmuon's asynchronous ones. new_group is collective over the world, in this order on every rank.
        group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend=dist.get_backend(group))
    return _C._mesh_1d(group, device, _DEFAULT_TIMEOUT_S)


def _model_view(model: nn.Module):
    params = [(n, p) for n, p in model.named_parameters()]  # tied parameters once (their first name)
    buffers = [(n, b) for n, b in model.named_buffers()]
    modules, index = [], {}
    for name, _ in model.named_modules():
        parent = -1 if name == "" else index[name.rpartition(".")[0]]
        index[name] = len(modules)
        modules.append((name, parent))
    return params, buffers, modules


def _boundary_resolver(model: nn.Module, predicate: Callable[[nn.Module], bool], strict: bool):
    """hook_boundary_predicate on Python modules, as the C++ runtime's name -> boundary resolver."""
    modules = dict(model.named_modules())

    def resolve(name: str, _param) -> str:
        parts = name.split(".")[:-1]
        for i in range(len(parts), -1, -1):  # the lowest ancestor first
            candidate = ".".join(parts[:i])
            if predicate(modules[candidate]):
                return candidate
        if strict:
            raise ValueError(
                f"dedicate_params: no ancestor module of '{name}' matches hook_boundary_predicate (strict mode). "
                "Widen the predicate so it selects the block that contains this parameter, or pass "
                "hook_boundary_strict=False to fall back to its direct parent module."
            )
        return ".".join(parts)

    return resolve


def _split_first_tensor(args):
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i
    return -1


def _install_hooks(model: nn.Module, runtime) -> list:
    modules = dict(model.named_modules())
    handles = []
    for name in [""] + [b for b in runtime.boundaries() if b != ""]:
        module = modules[name]
        scopes = []  # a module may run more than once in one forward (a stack of open scopes)

        def pre(mod, args, kwargs, name=name, scopes=scopes):
            scope = _C._BoundaryScope(runtime, name)
            scopes.append(scope)
            i = _split_first_tensor(args)
            if i < 0 or name == "":
                scope.enter()
                return None
            new_args = list(args)
            new_args[i] = scope.enter(args[i])
            for j in range(i + 1, len(new_args)):
                if isinstance(new_args[j], torch.Tensor):
                    new_args[j] = scope.cast_input(new_args[j])
            kwargs = {k: scope.cast_input(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            return tuple(new_args), kwargs

        def post(mod, args, kwargs, output, name=name, scopes=scopes):
            scope = scopes.pop()
            if name != "" and isinstance(output, torch.Tensor):
                return scope.exit(output)
            if name != "" and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
                first = scope.exit(output[0])
                return type(output)((first,) + tuple(output[1:])) if isinstance(output, tuple) else [first] + list(output[1:])
            scope.exit()
            return None

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handles


def _dedicate(model, mesh, predicate, options, hook_boundary_predicate, hook_boundary_strict, process_group_policy,
              ddp, fn):
    if getattr(model, "_dmuon", None) is not None:
        raise ValueError(f"{fn}: this model is dedicated already; call it once per model.")
    for n, p in model.named_parameters():
        if type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
            raise ValueError(
                f"{fn}: parameter '{n}' is already a DTensor: fully_shard (or parallelize_module) ran "
                f"before {fn}. Call dmuon.{fn}(model, mesh, ...) first, then fully_shard."
            )
    if hook_boundary_predicate is not None and options.get("hook_boundary_resolver") is None:
        options["hook_boundary_resolver"] = _boundary_resolver(model, hook_boundary_predicate, hook_boundary_strict)
    native_mesh = _make_mesh(mesh, process_group_policy)
    params, buffers, modules = _model_view(model)
    runtime = _C._dedicate(params, buffers, modules, native_mesh, predicate, options, ddp)
    model._dmuon = _State(runtime, native_mesh, _install_hooks(model, runtime))
    owners = {}
    for d in runtime.dedicated():
        d["param"]._dedicated_owner_rank = d["owner_rank"]
        owners[d["param"]] = d["owner_rank"]
    return owners


def dedicate_params(
    model: nn.Module,
    mesh,
    predicate: Callable[[str, nn.Parameter], bool],
    compute_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
    replicate_mesh=None,
    hook_boundary_predicate: Optional[Callable[[nn.Module], bool]] = None,
    hook_boundary_strict: bool = True,
    hook_boundary_resolver: Optional[Callable[[str, nn.Parameter], str]] = None,
    assignment_group_key_fn: Optional[Callable[[str, nn.Parameter], str]] = None,
    route_hint_fn: Optional[Callable[[str, nn.Parameter], str]] = None,
    max_owners_per_group: Optional[int] = None,
    owner_strategy: Optional[str] = None,
    owner_cost_model: Optional[str] = None,
    hsdp_column_balance: Optional[bool] = None,
    pack_small_params: Optional[bool] = None,
    muon_forward_unshard: str = "broadcast",
    process_group_policy: Optional[str] = None,
) -> Dict[nn.Parameter, int]:
    """Gives each Muon matrix (``predicate(name, param)`` true) one owner rank that holds it whole and runs
    Newton-Schulz on it; the other ranks keep 0-byte placeholders (the Parameter objects stay the same)
    between their hook boundaries' forward and backward (``reshard_after_forward``: True = Z3, False = Z2).
    Boundaries: ``hook_boundary_resolver``, else the lowest ancestor matching ``hook_boundary_predicate``,
    else the ``layers.N`` / ``blocks.N`` module, else the direct parent. Returns parameter -> owner rank.
    Collective: every rank of ``mesh`` (a 1-D DeviceMesh or ProcessGroup), in the same order."""
    if replicate_mesh is not None:
        raise NotImplementedError(
            "dedicate_params: replicate_mesh (HSDP) is not supported by this build of dmuon's Python API yet."
        )
    options = {
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
    }
    return _dedicate(model, mesh, predicate, options, hook_boundary_predicate, hook_boundary_strict,
                     process_group_policy, False, "dedicate_params")


def dedicate_params_ddp(
    model: nn.Module,
    mesh,
    predicate: Callable[[str, nn.Parameter], bool],
    compute_dtype: Optional[torch.dtype] = None,
    hook_boundary_predicate: Optional[Callable[[nn.Module], bool]] = None,
    hook_boundary_strict: bool = True,
    hook_boundary_resolver: Optional[Callable[[str, nn.Parameter], str]] = None,
    assignment_group_key_fn: Optional[Callable[[str, nn.Parameter], str]] = None,
    max_owners_per_group: Optional[int] = None,
    owner_strategy: Optional[str] = None,
    owner_cost_model: Optional[str] = None,
    pack_small_params: Optional[bool] = None,
    process_group_policy: Optional[str] = None,
) -> Dict[nn.Parameter, int]:
    """The DDP path: every rank keeps every matrix whole; ownership decides who runs Newton-Schulz, where
    its gradient is reduced and who publishes the update after ``step()``. Pair it with
    :func:`replicate` for the other parameters. 1-D meshes. Returns parameter -> owner rank. Collective."""
    options = {
        "compute_dtype": compute_dtype,
        "hook_boundary_strict": hook_boundary_strict,
        "hook_boundary_resolver": hook_boundary_resolver,
        "assignment_group_key_fn": assignment_group_key_fn,
        "max_owners_per_group": max_owners_per_group,
        "owner_strategy": owner_strategy,
        "owner_cost_model": owner_cost_model,
        "pack_small_params": pack_small_params,
    }
    return _dedicate(model, mesh, predicate, options, hook_boundary_predicate, hook_boundary_strict,
                     process_group_policy, True, "dedicate_params_ddp")


def replicate(model: nn.Module, mesh=None) -> nn.Module:
    """Replicated (DDP-style) training of every trainable parameter that is not dedicated: whole on every
    rank, gradients averaged at the end of backward in bucketed all-reduces (rank 0's values first).
    Call after dedicate_params, with its mesh. Collective. Returns the model."""
    state = _state_of(model, "replicate")
    if state.replicated:
        raise ValueError("replicate: already called on this model.")
    state.runtime.replicate(25.0)
    state.replicated = True
    return model


def get_dedicated_params(model: nn.Module) -> list:
    """The dedicated matrices as this rank sees them: name, param, full shape, owner, boundary, is_owner."""
    return _state_of(model, "get_dedicated_params").runtime.dedicated()


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Gradient accumulation: no gradient reduce inside; the next backward outside reduces the sum."""
    state = _state_of(model, "no_sync")
    state.runtime.set_no_sync(True)
    try:
        yield
    finally:
        state.runtime.set_no_sync(False)


def _full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every trainable parameter's full value, in its master precision (collective)."""
    return {n: t.detach() for n, t in _state_of(model, "full params").runtime.full_params()}


def _first_names(model: nn.Module) -> Dict[int, str]:
    """id(parameter) -> its first name in named_parameters(): the name the runtime knows a tied parameter by."""
    first = {}
    for name, p in model.named_parameters():
        first.setdefault(id(p), name)
    return first


def get_model_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """What ``model.state_dict()`` of the same model trained in one process returns: the same names (tied
    parameters under each of their names), order, shapes and dtypes, every parameter whole on every rank
    (from its owner or shards) and the buffers. Loadable by ``load_state_dict`` of a plain model and by
    ``torch.load``. Collective: every rank of the model's mesh."""
    full = _full_params(model)
    first_name = _first_names(model)
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = first_name.get(id(value))
        if name is not None and name in full:
            out[key] = full[name].to(value.dtype).clone()
        else:  # a buffer, or a parameter no route trains (frozen): the model's own tensor
            out[key] = value.detach().clone()
    return out


def set_model_state_dict(model: nn.Module, state_dict: Dict[str, torch.Tensor]) -> None:
    """Loads a full state dict (what :func:`get_model_state_dict` or the one-process model's ``state_dict()``
    gives) into a dedicated model: each rank keeps its part of every parameter, buffers are copied.
    Every rank passes the whole dict. Collective: every rank of the model's mesh."""
    state = _state_of(model, "set_model_state_dict")
    expected = model.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise ValueError(
            f"set_model_state_dict: the state dict does not match the model (missing: {missing[:5]}, unexpected: "
            f"{unexpected[:5]}). Pass a full state dict of this architecture, with keys as in model.state_dict()."
        )
    first_name, params = _first_names(model), {}
    for key, value in expected.items():
        name = first_name.get(id(value))
        if name is not None and name == key:
            params[name] = state_dict[key]
    state.runtime.assign_params(params)
    with torch.no_grad():
        for key, value in expected.items():
            if first_name.get(id(value)) is None:  # a buffer
                value.copy_(state_dict[key])


class Muon(torch.optim.Optimizer):
    """Muon on a dedicated model: momentum, Newton-Schulz and the update of each Muon matrix on its owner,
    AdamW on every other trainable parameter (on its route). Two parameter groups (Muon, AdamW) whose
    ``lr``, ``weight_decay`` and ``momentum`` torch.optim.lr_scheduler and the caller may change between
    steps. ``step()`` is collective: every rank of the model's mesh."""

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
        ns_backend="gram",
        nesterov: bool = True,
        replicate_async: bool = True,
        record_step_profile: bool = False,
        group_prepare_ahead: bool = True,
        first_step_progress_log: bool = False,
        first_step_progress_log_limit: int = 8,
    ):
        state = _state_of(model, "Muon")
        options = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps, adamw_lr=adamw_lr,
            adamw_betas=tuple(adamw_betas), adamw_weight_decay=adamw_weight_decay, adamw_eps=adamw_eps,
            ns_backend=ns_backend, nesterov=nesterov, replicate_async=replicate_async,
            record_step_profile=record_step_profile, group_prepare_ahead=group_prepare_ahead,
            first_step_progress_log=first_step_progress_log,
            first_step_progress_log_limit=first_step_progress_log_limit,
        )
        self._native = _C._Muon(state.runtime, options)
        self._model_state = state
        groups = []
        for i in range(self._native.group_count()):
            group = dict(self._native.group_options(i))
            group["params"] = list(self._native.group_params(i))
            groups.append(group)
        super().__init__(groups, defaults={})

    _MUTABLE = ("lr", "weight_decay", "momentum")  # what may change between steps (schedulers, the caller)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if len(self.param_groups) != self._native.group_count():
            raise ValueError("Muon: parameter groups were added or removed; dmuon's groups are fixed by the model's routes.")
        for i, g in enumerate(self.param_groups):
            native = self._native.group_options(i)
            for key, value in native.items():
                if key not in self._MUTABLE and g.get(key) != value:
                    raise ValueError(
                        f"Muon: parameter group {i} has {key}={g.get(key)!r}, but this build of dmuon's Python API "
                        f"takes only {', '.join(self._MUTABLE)} from the groups between steps ({key} is "
                        f"{value!r}). Pass it to Muon(...) instead."
                    )
            self._native.set_group_options(i, float(g["lr"]), float(g["weight_decay"]), float(g["momentum"]))
        self._native.step()
        return loss

    def state_dict(self):
        raise NotImplementedError(
            "dmuon.Muon.state_dict: optimizer state dicts (momentum on the owners, AdamW moments) are not available "
            "from Python in this build yet; torch.optim's own state_dict would silently leave them out."
        )

    def load_state_dict(self, state_dict):
        raise NotImplementedError(
            "dmuon.Muon.load_state_dict: optimizer state dicts are not available from Python in this build yet."
        )

    def zero_grad(self, set_to_none: bool = True):
        self._native.zero_grad(set_to_none)

    @property
    def steps_taken(self) -> int:
        return self._native.steps_taken
