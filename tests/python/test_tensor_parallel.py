"""Tensor parallelism through DTensor: a transformers Llama with grouped-query attention, made tensor
parallel by parallelize_module with a Megatron-style plan (q/k/v, gate/up ColwiseParallel; o, down
RowwiseParallel) on the named TP axis of a (shard, tp) mesh, then dedicate_params on the data-parallel
sub-mesh (the TP axis found by name-set difference) and replicate_tp or FSDP2's fully_shard on the
data-parallel axis for the rest (with FSDP2 the lm_head is ColwiseParallel too, and FSDP2 shards its DTensor
on (dp, tp)), or the DDP + TP path.
8 steps in float64 under an lr scheduler equal the one-process pure-PyTorch Muon + AdamW of
test_transformers_equivalence at 1e-10; the state dict holds full tensors under the one-process names."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from dmuon_testing import run_ranks
from test_transformers_equivalence import (ADAMW_LR, ADAMW_WD, BATCH, LR, MOMENTUM, STEPS, WD, is_muon, loss_of,
                                           make_llama, reference_train, schedule, tokens)


def tp_plan(model):
    plan = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    return plan


def _train(rank, world, layout, dp, out_path):
    tp = world // dp
    if layout == "hsdp-fsdp2":  # the API reference's 3-D order: (replicate, shard, tp)
        mesh = init_device_mesh("cpu", (2, dp // 2, tp), mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("shard", "tp"))
        dp_mesh = mesh["shard"]
    model = make_llama()
    plan = tp_plan(model)
    if layout in ("fsdp2", "hsdp-fsdp2"):  # a TP parameter dmuon does not train: FSDP2 gets its DTensor
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh["tp"], plan)
    # the TP exchange's scratch kept across steps (tp_buffer_reuse) trains the same: DP2 x TP2 Z3 keeps every
    # slot, the DDP path the scatter's
    reuse = {"ddp-tp": "scatter"}.get(layout, world == 4 and layout == "z3")
    if layout == "ddp-tp":
        owners = dmuon.dedicate_params_ddp_tp(model, mesh["shard"], is_muon, tp_buffer_reuse=reuse)
    elif layout == "hsdp-fsdp2":
        owners = dmuon.dedicate_params(model, mesh=mesh["shard"], predicate=is_muon, replicate_mesh=mesh["replicate"])
    else:
        owners = dmuon.dedicate_params(model, mesh["shard"], is_muon, reshard_after_forward=layout != "z2",
                                       tp_buffer_reuse=reuse)
    assert len(owners) == 7 * 2
    ctx = dmuon.get_comm_ctx(model)
    assert ctx.tp_group.size() == tp and ctx.data_parallel_group.size() == dp and ctx.world_group.size() == world
    assert ctx.tp_buffer_reuse == (reuse if layout != "hsdp-fsdp2" else False), ctx.tp_buffer_reuse
    k = model.model.layers[0].self_attn.k_proj.weight  # 2 KV heads of 4 over 2 TP ranks: 4 rows here
    assert type(k) is torch.nn.Parameter and tuple(k.shape) in ((4, 16), (0,))
    ded = {d.name: d for d in dmuon.get_dedicated_params(model)}
    d = ded["model.layers.0.self_attn.k_proj.weight"]
    assert d.tp_split_dim == 0 and d.full_shape == (8, 16) and 0 <= d.tp_owner < tp
    assert ded["model.layers.0.mlp.down_proj.weight"].tp_split_dim == 1
    with pytest.raises(ValueError, match="replicate_tp"):
        dmuon.replicate(model)
    if layout in ("fsdp2", "hsdp-fsdp2"):  # the reference's order: TP, dmuon, then FSDP2 on the data-parallel axes
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    else:
        dmuon.replicate_tp(model, mesh["shard"])
        group = dmuon.get_replicated_group(model)  # embeddings, norms, head: averaged over the dp ranks
        assert group.tp and group.group_size == dp and "model.embed_tokens.weight" in group.names
    # Z2: the distributed Gram form wherever it applies (split along the long side), gathers elsewhere
    opt = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR, weight_decay=WD, adamw_weight_decay=ADAMW_WD,
                     momentum=MOMENTUM, first_step_progress_log=False, record_step_profile=True,
                     tp_distributed_gram=layout == "z2", tp_distributed_gram_policy="always")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    per, dp_rank = BATCH // dp, rank // tp  # the TP ranks of one data-parallel position see the same rows
    gathered = distributed = 0
    tp_bytes = None
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, tokens(step)[dp_rank * per:(dp_rank + 1) * per]).backward()
        dmuon.prepare_muon_grads(model)  # what step() does first: the reduces are not counted below
        if step == 0 and layout in ("fsdp2", "hsdp-fsdp2"):
            # scope="all" counts every gradient once over dp x tp: FSDP2's shards of the parameters whole on
            # every TP rank (embeddings, norms) on TP rank 0 alone; torch's norm of the one-process model
            stats = opt.clip_grad_norm_(None, scope="all")
            one = make_llama()
            loss_of(one, tokens(0)).backward()
            want = float(torch.stack([p.grad.norm() for p in one.parameters()]).norm())
            assert abs(stats.total_norm - want) <= 1e-12 * want, (stats.total_norm, want)
            assert stats.param_count == len(list(one.parameters())), stats.param_count
        before = dmuon.comm_bytes(model)
        opt.step()
        dmuon.wait_all_post_step_broadcasts(model)
        after = dmuon.comm_bytes(model)
        tp_bytes = sum(after[op] - before[op] for op in ("gather", "scatter"))
        profile = opt.consume_last_step_profile()
        gathered += profile["tp_gathered"]
        distributed += profile["tp_distributed"]
        sched.step()
    assert gathered > 0  # the TP path ran: slices gathered to their TP owner for Newton-Schulz
    assert (distributed > 0) == (layout == "z2"), distributed
    if layout != "z2":  # one step's TP gathers and scatters on this rank are what plan_tp_exchange planned
        assert tp_bytes == dmuon.summarize_comm_plan(model)["this_rank"]["tp"] > 0, (tp_bytes, rank)
    if layout in ("fsdp2", "hsdp-fsdp2"):  # the lm_head FSDP2 shards on its data-parallel axes and TP: a DTensor
        head = model.lm_head.weight
        assert type(head).__name__ == "DTensor" and head.device_mesh.ndim == mesh.ndim, head.placements
    sd = dmuon.get_model_state_dict(model, rank0_only=False)
    if layout in ("fsdp2", "hsdp-fsdp2"):  # and back: every part of every parameter where it belongs
        changed = {n: t + 0.5 for n, t in sd.items()}
        dmuon.set_model_state_dict(model, changed)
        again = dmuon.get_model_state_dict(model, rank0_only=False)
        for name, value in changed.items():
            assert torch.equal(again[name], value), name
    if rank == 0:
        torch.save(sd, out_path)


@pytest.mark.parametrize("layout,world,dp", [("z3", 2, 1), ("z3", 4, 2), ("z2", 4, 2), ("ddp-tp", 4, 2), ("fsdp2", 4, 2),
                                                ("hsdp-fsdp2", 8, 4)])
def test_llama_tp_trains_like_one_process(tmp_path, layout, world, dp):
    path = tmp_path / "llama-tp.pt"
    run_ranks(tmp_path, world, _train, layout, dp, str(path))
    got = torch.load(path)
    ref = reference_train()
    assert set(got) == set(ref)
    for name, value in ref.items():
        assert got[name].shape == value.shape, name
        err = float((got[name] - value).abs().max() / value.abs().max())
        assert err < 1e-10, f"{layout} on {world} ranks (dp {dp}): {name} differs from the one-process reference by {err}"


def _mistakes(rank, world):
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("shard", "tp"))
    model = make_llama()
    parallelize_module(model, mesh["tp"], tp_plan(model))
    with pytest.raises(ValueError, match="dedicate_params_ddp_tp"):
        dmuon.dedicate_params_ddp(model, mesh["shard"], is_muon)
    with pytest.raises(ValueError, match="tp_buffer_reuse='both'; use False, True"):
        dmuon.dedicate_params(model, mesh["shard"], is_muon, tp_buffer_reuse="both")
    with pytest.raises(ValueError, match="mesh_dim_names"):  # an unnamed data-parallel mesh: no TP axis to infer
        dmuon.dedicate_params(model, dist.group.WORLD, is_muon)
    # a dedicate_params that fails after the TP parameters were swapped for their slices gives them back
    with pytest.raises(ValueError, match="no-such-strategy"):
        dmuon.dedicate_params(model, mesh["shard"], is_muon, owner_strategy="no-such-strategy")
    k = model.model.layers[0].self_attn.k_proj.weight
    assert type(k).__name__ == "DTensor" and tuple(k.shape) == (8, 16) and getattr(model, "_dmuon", None) is None
    plain = make_llama()
    with pytest.raises(ValueError, match="no tensor-parallel DTensor"):
        dmuon.dedicate_params_ddp_tp(plain, mesh["shard"], is_muon)
    # a TP slice left to FSDP2 (not dedicated) without dmuon's FSDP2 patch: FSDP2 takes the slice for the whole
    # parameter, which Muon() refuses (with the patch, FSDP2 gets the DTensor: _train's lm_head)
    dmuon.dedicate_params(model, mesh["shard"], lambda n, p: is_muon(n, p) and "k_proj" not in n)
    dmuon.uninstall_patch()
    try:
        ignored = dmuon.ignored_params(model)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["shard"], ignored_params=ignored)
        fully_shard(model, mesh=mesh["shard"], ignored_params=ignored)
    finally:
        dmuon.install_patch()
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.k_proj.weight' is a tensor-parallel DTensor.*"
                                         "install_patch"):
        dmuon.Muon(model)


def test_tp_mistakes(tmp_path):
    run_ranks(tmp_path, 2, _mistakes)


def _build(rank, world, tp):
    """A Llama dedicated on 2 ranks: TP 2 (mesh (1, 2): dmuon's TP path) or data parallel 2 (no TP)."""
    model = make_llama()
    if tp:
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("shard", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan(model))
        dmuon.dedicate_params(model, mesh["shard"], is_muon)
        dmuon.replicate_tp(model, mesh["shard"])
    else:
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, is_muon)
        dmuon.replicate(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR, weight_decay=WD, adamw_weight_decay=ADAMW_WD,
                     momentum=MOMENTUM, first_step_progress_log=False)
    dp, dp_rank = (1, 0) if tp else (world, rank)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule), dp, dp_rank


def _resume_across_tp(rank, world, out_path):
    """Steps 0-3 with TP, 4-5 without (resumed from the TP run's state dicts), 6-7 with TP again: the state
    dicts are full tensors under the one-process names, so the run is the uninterrupted one."""
    full = dict(make_llama().named_parameters())
    state = None
    for tp, steps in ((True, range(0, 4)), (False, range(4, 6)), (True, range(6, STEPS))):
        model, opt, sched, dp, dp_rank = _build(rank, world, tp)
        if state is not None:
            dmuon.set_model_state_dict(model, state[0])
            opt.load_state_dict(state[1])
            sched.load_state_dict(state[2])
        per = BATCH // dp
        for step in steps:
            opt.zero_grad()
            loss_of(model, tokens(step)[dp_rank * per:(dp_rank + 1) * per]).backward()
            opt.step()
            sched.step()
        model_sd = dmuon.get_model_state_dict(model, rank0_only=False)
        optim_sd = opt.state_dict()
        assert {n: tuple(t.shape) for n, t in model_sd.items()} == {n: tuple(p.shape) for n, p in full.items()}
        for name, entry in optim_sd["dedicated"].items():  # full momentum buffers, also from the TP run
            assert tuple(entry["momentum_buffer"].shape) == tuple(full[name].shape), name
        state = (model_sd, optim_sd, sched.state_dict())
    if rank == 0:
        torch.save(state[0], out_path)


def test_resume_without_tp_and_back(tmp_path):
    path = tmp_path / "resumed.pt"
    run_ranks(tmp_path, 2, _resume_across_tp, str(path))
    got = torch.load(path)
    for name, value in reference_train().items():
        err = float((got[name] - value).abs().max() / value.abs().max())
        assert err < 1e-10, f"{name} differs from the uninterrupted one-process run by {err}"


def _frozen_tp(rank, world):
    """Frozen TP-split weights (colwise and rowwise; no optimizer route): the state dict has them whole, and
    set_model_state_dict gives each TP rank its slice of a new value, which the next forward uses. Also: the
    user's predicate sees TP parameters as DTensors of the full shape, and attributes the user set on a TP
    parameter survive dedicate_params."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("shard", "tp"))
    model = make_llama()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.o_proj.weight",
              "model.layers.0.input_layernorm.weight")  # colwise (dim 0), rowwise (dim 1), not TP
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    parallelize_module(model, mesh["tp"], tp_plan(model))
    model.get_parameter("model.layers.1.mlp.up_proj.weight").my_tag = "no-decay"  # a user's attribute
    seen = {}

    def predicate(name, p):  # the user's predicate sees the DTensor the model holds, at its full shape
        seen[name] = (type(p).__name__, tuple(p.shape))
        return is_muon(name, p) and p.requires_grad

    dmuon.dedicate_params(model, mesh["shard"], predicate)
    assert seen["model.layers.0.self_attn.k_proj.weight"] == ("DTensor", (8, 16)), seen
    assert seen["model.layers.1.mlp.down_proj.weight"] == ("DTensor", (16, 24)), seen
    assert model.get_parameter("model.layers.1.mlp.up_proj.weight").my_tag == "no-decay"
    dmuon.replicate_tp(model, mesh["shard"])
    opt = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR, first_step_progress_log=False)
    loss_of(model, tokens(0)).backward()
    opt.step()
    sd = dmuon.get_model_state_dict(model, rank0_only=False)
    for name in frozen:
        assert sd[name].shape == initial[name].shape and torch.equal(sd[name], initial[name]), name
    changed = dict(sd)
    for name in frozen:
        changed[name] = sd[name] + torch.arange(sd[name].numel(), dtype=sd[name].dtype).reshape(sd[name].shape)
    dmuon.set_model_state_dict(model, changed)
    again = dmuon.get_model_state_dict(model, rank0_only=False)
    for name, value in changed.items():
        assert torch.equal(again[name], value), name
    # and the forward uses the loaded slices: the loss equals the one-process model's with these weights
    plain = make_llama()
    plain.load_state_dict(changed)
    x = tokens(1)
    assert abs(loss_of(model, x).item() - loss_of(plain, x).item()) < 1e-12


def test_frozen_tp_weights_predicates_and_attributes(tmp_path):
    run_ranks(tmp_path, 2, _frozen_tp)


def _tp_models_freed(rank, world):
    """TP models dropped one after another in one process (a sweep) are freed with their slices: the record of
    the TP parameters dmuon does not dedicate (the biases, which a later fully_shard may take as DTensors) held
    their modules, so each dropped model's slices stayed alive for good."""
    import gc
    import weakref

    from torch import nn

    from dmuon import _tp

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("shard", "tp"))
    gone = []
    for ddp in (True, False, True):
        model = nn.Sequential(nn.Sequential(nn.Linear(8, 16, dtype=torch.float64), nn.Tanh(),
                                            nn.Linear(16, 8, dtype=torch.float64)))
        parallelize_module(model, mesh["tp"], {"0.0": ColwiseParallel(), "0.2": RowwiseParallel()})
        dedicate = dmuon.dedicate_params_ddp_tp if ddp else dmuon.dedicate_params
        dedicate(model, mesh["shard"], lambda n, p: p.dim() == 2, hook_boundary_resolver=lambda n, p: "0")
        assert _tp._UNDEDICATED  # (the column-split bias)
        dmuon.replicate_tp(model)
        opt = dmuon.Muon(model, lr=LR, first_step_progress_log=False)
        model(torch.ones(2, 8, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()
        gone += [weakref.ref(model)] + [weakref.ref(p) for p in model.parameters()]
        del model, opt
        gc.collect()
    assert all(r() is None for r in gone), f"{sum(r() is not None for r in gone)} models or parameters still alive"
    assert not _tp._UNDEDICATED


def test_tp_models_dropped_in_a_sweep_are_freed(tmp_path):
    run_ranks(tmp_path, 2, _tp_models_freed)
