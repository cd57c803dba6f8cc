"""The rest of Muon's Python API on real Gloo groups (spawned ranks): user parameter groups and a clipping
strategy written in Python, both against the pure-PyTorch reference of test_dedicate.py in float64
(bound 1e-10); segmented clipping against closed forms; the step profile; the collective timeout; and
faults: a killed peer and a stopped peer are errors within the timeout, Ctrl-C interrupts a step that
waits for a stopped peer."""

import json
import math
import os
import re
import signal
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon_testing import run_faulty_ranks, run_ranks
from test_dedicate import ADAMW_LR, BLOCKS, LR, STEPS, batch, dedicated_net, make_net, reference_train, schedule

# the "early" group's hyperparameters, every one a group may override
EARLY = dict(lr=2 * LR, adamw_lr=3 * ADAMW_LR, wd=0.0, adamw_wd=0.0, nesterov=False, ns_steps=3, betas=(0.8, 0.95),
             eps=1e-6)
CLIP_M = 0.02  # per-matrix max norm of the strategy below: below most matrices' gradient norms here


def early_hparams(name):
    return EARLY if name.startswith("layers.0.") else {}


def per_matrix_clip_reference(grads):
    for g in grads.values():
        g.mul_(min(1.0, CLIP_M / (float(g.norm()) + 1e-6)))


def per_matrix(grads, max_norm, *, norm_type, error_if_nonfinite, foreach, group):
    """A strategy written in Python: every matrix clipped to max_norm on its own; the stats' norm is the
    global one (each element counted once over the mesh, by `counted`)."""
    partial = torch.zeros(2, dtype=torch.float64)
    clipped = False
    for g in grads:
        n = float(g.grad.double().norm())
        if g.counted:
            partial[0] += n * n
            partial[1] += int(g.counts_param)
        coef = min(1.0, max_norm / (n + 1e-6))
        if coef < 1.0:
            g.grad.mul_(coef)
            clipped = True
    dist.all_reduce(partial, group=group)
    return dmuon.MuonGradClipStats(math.sqrt(float(partial[0])), max_norm, norm_type, 1.0, clipped, int(partial[1]),
                                   False, "per_matrix")


def _groups_and_strategy(rank, world, layout, out_path):
    fsdp2 = layout == "fsdp2"
    model = dedicated_net(init_device_mesh("cpu", (world,)), fsdp2)
    early = [p for n, p in model.named_parameters() if n.startswith("layers.0.")]  # DTensors too, under FSDP2
    opt = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR, weight_decay=0.01, adamw_weight_decay=0.01, momentum=0.95,
                     param_groups=[{"params": early, "name": "early", "lr": EARLY["lr"], "adamw_lr": EARLY["adamw_lr"],
                                    "weight_decay": 0.0, "adamw_weight_decay": 0.0, "nesterov": EARLY["nesterov"],
                                    "ns_steps": EARLY["ns_steps"], "adamw_betas": EARLY["betas"],
                                    "adamw_eps": EARLY["eps"]}],
                     forward_prefetch_depth=0)  # each boundary's broadcast issued at its own forward
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    # the user group lowered into its Muon and AdamW subgroups, then the default pair
    assert [(g["group_name"], g["is_muon"]) for g in opt.param_groups] == [
        ("early", True), ("early", False), ("default", True), ("default", False)]
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1, 2 * BLOCKS - 2, BLOCKS]
    assert opt.param_groups[1]["lr"] == EARLY["adamw_lr"] and opt.param_groups[3]["weight_decay"] == 0.01
    assert opt.param_groups[0]["ns_steps"] == 3 and not opt.param_groups[0]["nesterov"] and opt.param_groups[2]["nesterov"]
    assert tuple(opt.param_groups[1]["betas"]) == (0.8, 0.95) and opt.param_groups[1]["eps"] == 1e-6
    assert tuple(opt.param_groups[3]["betas"]) == (0.9, 0.999)
    dmuon.register_muon_grad_clip_strategy("per_matrix", per_matrix)
    per = BATCH_PER(world)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        ((model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]) ** 2).mean().backward()
        measured = opt.clip_grad_norm_(None)  # stats only: the global norm of the Muon matrices
        stats = opt.clip_grad_norm_(CLIP_M, strategy="per_matrix" if step % 2 else per_matrix)
        assert stats.strategy == "per_matrix" and stats.param_count == 2 * BLOCKS and opt.last_muon_grad_clip_stats is stats
        assert abs(stats.total_norm - measured.total_norm) <= 1e-12 * measured.total_norm
        opt.step()
        sched.step()
    # a misspelt name: the core's strategies and the ones registered from Python are listed
    with pytest.raises(ValueError, match=r"unknown strategy 'per_matrx'\. Registered: global_norm .* From Python: per_matrix\."):
        opt.clip_grad_norm_(CLIP_M, strategy="per_matrx")
    sd = dmuon.get_model_state_dict(model)
    if rank == 0:
        torch.save(sd, out_path)


def BATCH_PER(world):
    return 12 // world


@pytest.mark.parametrize("layout", ["replicate", "fsdp2"])
def test_param_groups_and_python_clip_strategy(tmp_path, layout):
    path = tmp_path / "groups.pt"
    run_ranks(tmp_path, 2, _groups_and_strategy, layout, str(path))
    got = torch.load(path)
    ref = reference_train(hparams=early_hparams, muon_clip=per_matrix_clip_reference)
    for name, value in ref.items():
        err = float((got[name] - value).abs().max() / value.abs().max())
        assert err < 1e-10, f"{layout}: {name} differs from the reference by {err}"
    # the groups' hyperparameters and the clip mattered: the default run ends elsewhere
    plain = reference_train()
    assert float((plain["layers.0.proj.weight"] - ref["layers.0.proj.weight"]).abs().max()) > 1e-3
    assert float((plain["layers.2.gate.weight"] - ref["layers.2.gate.weight"]).abs().max()) > 1e-4


def _one_cycle(rank, world, layout, out_path):
    # OneCycleLR on Muon's groups: lr and momentum in every group; an AdamW group's momentum is its beta1. The
    # Muon groups' lr is 0 (the matrices stay as initialised), so the AdamW side is torch's AdamW + OneCycleLR.
    model = dedicated_net(init_device_mesh("cpu", (world,)), layout == "fsdp2")
    opt = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR, adamw_weight_decay=0.01, first_step_progress_log=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[0.0 if g["is_muon"] else ADAMW_LR for g in opt.param_groups], total_steps=STEPS)
    adamw = [i for i, g in enumerate(opt.param_groups) if not g["is_muon"]]
    adamw_groups = [opt.param_groups[i] for i in adamw]
    per, beta1s = BATCH_PER(world), []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        ((model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]) ** 2).mean().backward()
        opt.step()
        for i in adamw:  # what the step used: group["momentum"] is betas[0], in the core too
            g = opt.param_groups[i]
            assert g["momentum"] == g["betas"][0], g
            if i < opt._native_groups:
                assert opt._native.group_options(i)["betas"][0] == g["momentum"]
        beta1s.append(adamw_groups[0]["betas"][0])
        sched.step()
    # a scheduler that writes betas (as for torch's Adam) is taken too; both changed differently is an error
    opt.zero_grad()
    opt.step()  # (no gradient: nothing moves) takes the scheduler's last momentum
    adamw_groups[0]["betas"] = (0.7, 0.999)
    opt.step()
    assert adamw_groups[0]["momentum"] == 0.7
    adamw_groups[0]["betas"], adamw_groups[0]["momentum"] = (0.6, 0.999), 0.5
    with pytest.raises(ValueError, match=r"momentum=0.5 and betas\[0\]=0.6, both changed since the last step"):
        opt.step()
    adamw_groups[0]["momentum"] = 0.6
    adamw_groups[0]["maximize"] = True  # a torch.optim flag dmuon's AdamW does not implement: refused, not ignored
    with pytest.raises(ValueError, match=r"\('default'\) has maximize=True; dmuon's Muon and AdamW have no maximize"):
        opt.step()
    del adamw_groups[0]["maximize"]
    # a user group's Muon values on a group without Muon matrices apply to nothing: a warning names them
    other = dedicated_net(init_device_mesh("cpu", (world,)), False)
    with pytest.warns(UserWarning, match=r"param_groups\[0\] \('norms'\) sets lr, momentum, but holds no dedicated "
                                         r"Muon matrix, so they apply to no parameter \(adamw_lr"):
        dmuon.Muon(other, param_groups=[{"params": [other.scale], "lr": 0.5, "momentum": 0.9, "name": "norms"}],
                   first_step_progress_log=False)
    sd = dmuon.get_model_state_dict(model)
    if rank == 0:
        torch.save({"params": sd, "beta1": beta1s}, out_path)


@pytest.mark.parametrize("layout", ["replicate", "fsdp2"])
def test_one_cycle_cycles_muon_momentum_and_adamw_beta1_as_torch(tmp_path, layout):
    path = tmp_path / "one_cycle.pt"
    run_ranks(tmp_path, 2, _one_cycle, layout, str(path))
    got = torch.load(path)
    model = make_net()  # torch: AdamW + OneCycleLR (beta1 cycled) on the non-matrix parameters, matrices fixed
    opt = torch.optim.AdamW([p for p in model.parameters() if p.dim() != 2], lr=ADAMW_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=ADAMW_LR, total_steps=STEPS)
    beta1s = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        beta1s.append(opt.param_groups[0]["betas"][0])
        sched.step()
    assert got["beta1"] == beta1s and len(set(beta1s)) > 1, (got["beta1"], beta1s)  # cycled, as torch's
    for name, value in model.named_parameters():
        err = float((got["params"][name] - value.detach()).abs().max() / value.detach().abs().max())
        assert err < 1e-12, f"{layout}: {name} differs from torch's AdamW + OneCycleLR by {err}"


def _buckets_and_profile(rank, world):
    # segmented clipping against closed forms: "a" is reduced over the group (each rank holds its part),
    # "b" is the same on every rank
    a = torch.full((3,), float(rank + 1), dtype=torch.float64)
    b = torch.tensor([3.0, 4.0], dtype=torch.float64)
    r = dmuon.clip_grad_norm_buckets_([dmuon.GradClipBucket("a", [a, None]), dmuon.GradClipBucket("b", [b], reduce=False)],
                                      1.0)
    na, nb = math.sqrt(3 * 1 + 3 * 4), 5.0
    sa, sb = r.find("a"), r.find("b")
    assert isinstance(r, dmuon.SegmentedGradClipResult) and isinstance(sa, dmuon.GradClipBucketStats)
    assert abs(sa.total_norm - na) < 1e-12 and abs(sb.total_norm - nb) < 1e-12 and sa.param_count == 2 and sb.param_count == 1
    assert abs(float(r.total_norm) - math.sqrt(na * na + nb * nb)) < 1e-12 and r.find("c") is None
    assert sa.clipped and abs(sa.clip_coef - 1.0 / (na + 1e-6)) < 1e-15
    assert torch.allclose(a, torch.full((3,), (rank + 1) / (na + 1e-6), dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(b, torch.tensor([3.0, 4.0], dtype=torch.float64) / (5.0 + 1e-6), rtol=0, atol=1e-15)
    assert not r.fastpath and "reference math" in r.fallback_reason
    # ranks that disagree on the layout get an error naming both layouts, not a hang
    buckets = [dmuon.GradClipBucket("a", [a])] + ([dmuon.GradClipBucket("b", [b])] if rank == 0 else [])
    with pytest.raises(ValueError, match="passes 1 bucket|passes 2 bucket"):
        dmuon.clip_grad_norm_buckets_(buckets, 1.0)

    # try_clip_optimizer_grad_norm_buckets_ and the step profile on a replicated model
    model = make_net()
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2)
    dmuon.replicate(model)
    opt = dmuon.Muon(model, record_step_profile=True)
    assert opt.consume_last_step_profile()["valid"] is False  # no step yet
    x, y = batch(0)
    per = BATCH_PER(world)
    ((model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]) ** 2).mean().backward()
    muon_norm = opt.clip_grad_norm_(None).total_norm
    dmuon.prepare_muon_grads(model)  # the replicated gradients' all-reduces: their averages land in .grad
    group = dmuon.get_replicated_group(model)
    assert not group.tp and group.group_size == world
    names = set(group.names)
    regular = [p.grad for n, p in model.named_parameters() if n in names]
    assert len(regular) == BLOCKS + 1 and all(g is not None for g in regular)
    regular_norm = math.sqrt(sum(float(g.double().norm()) ** 2 for g in regular))
    r = dmuon.try_clip_optimizer_grad_norm_buckets_(opt, regular_grads=regular, adamw_grads=[], max_norm=1e9)
    assert abs(r.find("muon").total_norm - muon_norm) < 1e-12 * muon_norm
    assert abs(r.find("regular").total_norm - regular_norm) < 1e-12 * regular_norm and r.find("adamw").param_count == 0
    stats = opt.last_muon_grad_clip_stats
    assert stats.strategy == "segmented" and not stats.clipped and stats.param_count == 2 * BLOCKS
    opt.step()
    prof = opt.consume_last_step_profile()
    json.dumps(prof)
    owned = len(dmuon.get_owned_params(model, rank))
    assert prof["valid"] and prof["clock"] == "host" and prof["step"] == 1 and prof["owned_updates"] == owned, prof
    assert prof["total_ms"] >= prof["muon_ms"] >= prof["ns_ms"] >= 0 and prof["total_ms"] > 0
    assert opt.consume_last_step_profile()["valid"] is False  # consumed
    # the multi-tensor kernels on the CPU: by default AdamW by torch's fused kernel (torch >= 2.4), the
    # momentum by per-matrix host loops; fused=False / foreach=True swap both
    assert prof["adamw_fused"] == len(regular) and prof["momentum_foreach"] == 0, prof
    swapped = dmuon.Muon(model, record_step_profile=True, fused=False, foreach=True)
    swapped.zero_grad()
    ((model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]) ** 2).mean().backward()
    swapped.step()
    prof = swapped.consume_last_step_profile()
    assert prof["adamw_fused"] == 0 and prof["momentum_foreach"] == prof["update_foreach"] == owned, prof
    swapped.zero_grad()
    # mistakes
    with pytest.raises(ValueError, match="cannot be replaced"):
        dmuon.register_muon_grad_clip_strategy("global_norm", per_matrix)
    with pytest.raises(ValueError, match="forward_prefetch_depth must be an int >= 0"):
        dmuon.Muon(model, forward_prefetch_depth=-1)
    with pytest.raises(ValueError, match="post_step_prefetch_groups must be an int >= 0, got -1"):
        dmuon.Muon(model, post_step_prefetch_groups=-1)
    with pytest.raises(ValueError, match="first_step_progress_log_limit must be an int >= 0, got -5"):
        dmuon.Muon(model, first_step_progress_log_limit=-5)
    # numpy's bool is a flag (named numpy.bool in numpy 2, numpy.bool_ before); local settings take any truth value
    import numpy
    dmuon.Muon(model, nesterov=numpy.True_, record_step_profile=1, first_step_progress_log=0).zero_grad()
    with pytest.raises(ValueError, match="may set name, lr"):
        dmuon.Muon(model, param_groups=[{"params": list(model.parameters())[:1], "betas": (0.8, 0.9)}])
    with pytest.raises(ValueError, match=r"option 'ns_steps' is 2147483648, beyond what a 32-bit integer holds"):
        dmuon.Muon(model, ns_steps=2 ** 31)
    with pytest.raises(ValueError, match="ns_steps=2.5; it must be an int"):
        dmuon.Muon(model, param_groups=[{"params": list(model.parameters())[:1], "ns_steps": 2.5}])
    with pytest.raises(ValueError, match="invalid adamw_betas.second of param group 'g'"):
        dmuon.Muon(model, param_groups=[{"params": list(model.parameters())[:1], "name": "g", "adamw_betas": (0.9, 1.0)}])
    with pytest.raises(ValueError, match="not a parameter of the dedicated model"):
        dmuon.Muon(model, param_groups=[{"params": [torch.zeros(3)]}])
    # a set, as torch.optim: its order is the tensors' ids' hashes, another on each rank (they disagreed at random)
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\] is a set; parameters must be in an ordered"):
        dmuon.Muon(model, param_groups=[{"params": set(model.parameters())}])
    with pytest.raises(ValueError, match="'layers.0.proj.weight' is in param_groups\\[0\\] and param_groups\\[1\\]"):
        w = model.layers[0].proj.weight
        dmuon.Muon(model, param_groups=[{"params": [w]}, {"params": [w]}])


def test_segmented_clipping_and_step_profile(tmp_path):
    run_ranks(tmp_path, 2, _buckets_and_profile)


def _timeouts(rank, world):
    model = make_net()
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2)
    assert model._dmuon.mesh.timeout_s == 120  # run_ranks' init_process_group(timeout=120 s)
    os.environ["DMUON_COLLECTIVE_TIMEOUT"] = "7.5"
    try:
        model = make_net()
        dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2)
        assert model._dmuon.mesh.timeout_s == 7.5
        os.environ["DMUON_COLLECTIVE_TIMEOUT"] = "soon"
        with pytest.raises(ValueError, match="DMUON_COLLECTIVE_TIMEOUT='soon' is not a positive number of seconds"):
            dmuon.dedicate_params(make_net(), dist.group.WORLD, lambda n, p: p.dim() == 2)
    finally:
        del os.environ["DMUON_COLLECTIVE_TIMEOUT"]
    # a setting read from one rank's environment (a node's own env file) is refused on every rank at once, naming
    # the rank and the variable (rank 0 waited in the mesh's setup gather for the timeout, with a bare Gloo error)
    mine = r"rank 1: dedicate_params: " if rank == 1 else r"rank 0: dedicate_params: another rank refused the mesh's " \
        r"setup, so no rank builds it: rank 1: dedicate_params: "
    for var, value, text in (("DMUON_COLLECTIVE_TIMEOUT", "120s", "DMUON_COLLECTIVE_TIMEOUT='120s' is not a positive"),
                             ("DMUON_PROCESS_GROUP_POLICY", "Isolated",
                              "DMUON_PROCESS_GROUP_POLICY must be 'isolated' or 'shared', got 'Isolated'")):
        if rank == 1:
            os.environ[var] = value
        try:
            with pytest.raises(ValueError, match=mine + re.escape(text)):
                dmuon.dedicate_params(make_net(), dist.group.WORLD, lambda n, p: p.dim() == 2)
        finally:
            os.environ.pop(var, None)
    if rank == 1:  # valid, but not the other ranks'
        os.environ["DMUON_PROCESS_GROUP_POLICY"] = "shared"
    try:
        with pytest.raises(ValueError, match=rf"rank {rank}: dedicate_params: the ranks disagree on the process-group "
                                             r"policy \(rank: policy \{0: 'isolated', 1: 'shared'\}\)"):
            dmuon.dedicate_params(make_net(), dist.group.WORLD, lambda n, p: p.dim() == 2)
    finally:
        os.environ.pop("DMUON_PROCESS_GROUP_POLICY", None)
    # a per-step fence set in one rank's environment: rank 1 alone waited in a barrier after its first step (a
    # timeout blaming the barrier there, "Connection closed" in the next step's agreement here)
    if rank == 1:
        os.environ["DMUON_ISOLATED_PG_BARRIER"] = "1"
    try:
        with pytest.raises(ValueError, match=rf"rank {rank}: dedicate_params: the owner plan differs between ranks: "
                                             r"the environment variable DMUON_ISOLATED_PG_BARRIER differs between "
                                             rf"rank 0 and rank 1 \(this rank's: DMUON_ISOLATED_PG_BARRIER={rank};"):
            dmuon.dedicate_params(make_net(), dist.group.WORLD, lambda n, p: p.dim() == 2)
    finally:
        os.environ.pop("DMUON_ISOLATED_PG_BARRIER", None)
    if rank == 1:  # and a value that is no boolean, on one rank: refused on every rank (rank 0 waited to the timeout)
        os.environ["DMUON_ISOLATED_PG_BARRIER"] = "ture"
    try:
        with pytest.raises(ValueError, match=r"DMUON_ISOLATED_PG_BARRIER='ture' is not a boolean"):
            dmuon.dedicate_params(make_net(), dist.group.WORLD, lambda n, p: p.dim() == 2)
    finally:
        os.environ.pop("DMUON_ISOLATED_PG_BARRIER", None)
    model = make_net()  # and the next dedicate_params goes on as usual
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2)
    assert model._dmuon.mesh.timeout_s == 120


def test_collective_timeout_follows_the_group(tmp_path):
    run_ranks(tmp_path, 2, _timeouts)


def _rank_divergent_calls(rank, world):
    """A collective call made by some ranks only, or with arguments one rank refuses or that differ, raises on every
    rank, each naming its call. Before: a clip on one rank against the other's step paired their exchanges of
    different sizes (Gloo aborted the process, SIGABRT), and a state dict against a step gave an internal
    bad_function_call there and a wrong "different values" error here."""
    def trained():  # (each case on a model of its own: its own cloned groups)
        model = dedicated_net(dist.group.WORLD, False)
        opt = dmuon.Muon(model, lr=LR, first_step_progress_log=False)
        x, y = batch(0)
        ((model(x) - y) ** 2).mean().backward()
        return model, opt

    elsewhere = r"rank\(s\) {} made another collective call of dmuon at this point \(not {}\)"
    model, opt = trained()
    if rank == 0:
        with pytest.raises(ValueError, match=rf"rank 0: clip_grad_norm_: " + elsewhere.format(1, "clip_grad_norm_")):
            opt.clip_grad_norm_(1.0)
    else:
        with pytest.raises(ValueError, match=rf"rank 1: Muon::step: " + elsewhere.format(0, "Muon::step")):
            opt.step()
    model, opt = trained()
    if rank == 0:
        with pytest.raises(ValueError, match=rf"get_model_state_dict: " + elsewhere.format(1, "get_model_state_dict")):
            dmuon.get_model_state_dict(model)
    else:
        with pytest.raises(ValueError, match=rf"Muon::step: " + elsewhere.format(0, "Muon::step")):
            opt.step()
    # calls whose agreement is written in Python (Muon(), set_model_state_dict) against the core's or each other:
    # the same (before: Gloo aborted the process -- "data size doesn't match" -- or each rank blamed the other's
    # inputs: "different state dicts", "different lr")
    for mine in (("set_model_state_dict", "get_model_state_dict"), ("Muon", "clip_grad_norm_"),
                 ("set_model_state_dict", "Muon")):
        model, opt = trained()
        call = mine[rank]
        with pytest.raises(ValueError, match=rf"rank {rank}: {call}: " + elsewhere.format(1 - rank, call)):
            if call == "set_model_state_dict":
                dmuon.set_model_state_dict(model, make_net().state_dict())
            elif call == "get_model_state_dict":
                dmuon.get_model_state_dict(model)
            elif call == "Muon":
                dmuon.Muon(model, lr=LR)
            else:
                opt.clip_grad_norm_(1.0)
    # an argument one rank refuses, then arguments that differ: no rank clips, every rank says why
    model, opt = trained()
    with pytest.raises(ValueError, match=r"max_norm must be >= 0" if rank == 1 else
                       r"rank 0: clip_grad_norm_: rank\(s\) 1 refused the arguments they were given, so no rank "
                       r"clips \(rank 1: clip_grad_norm_: max_norm must be >= 0"):
        opt.clip_grad_norm_(float("nan") if rank == 1 else 1.0)
    with pytest.raises(ValueError, match=rf"rank {rank}: clip_grad_norm_: the ranks clip with different arguments: "
                                         r"max_norm is [12] here and differs on rank\(s\) 1"):
        opt.clip_grad_norm_(1.0 + rank)
    # ... refused by the Python front end's own checks on one rank (a scope, a strategy or a number it cannot
    # take): every rank raises at once (before: that rank alone; the other waited in the clip until the timeout)
    for bad, why in (({"scope": "mun"}, "scope must be 'muon' or 'all', got 'mun'"),
                     ({"strategy": 42}, "strategy must be a name or a callable, got int"),
                     ({"norm_type": "two"}, "norm_type must be a number, got 'two'"),
                     ({"foreach": "yes"}, "foreach must be None or a bool, got 'yes'")):
        with pytest.raises(ValueError, match=re.escape(f"rank 1: clip_grad_norm_: {why}") if rank == 1 else
                           r"rank 0: clip_grad_norm_: rank\(s\) 1 refused the arguments they were given, so no rank "
                           r"clips \(rank 1: clip_grad_norm_: " + re.escape(why)):
            opt.clip_grad_norm_(1.0, **(bad if rank == 1 else {}))
    # a Python strategy on one rank, the core's on the other: agreed as the core's strategies are
    dmuon.register_muon_grad_clip_strategy("py_global", lambda grads, max_norm, **kw: dmuon.MuonGradClipStats(
        0.0, max_norm, 2.0, 1.0, False, 0, False, "py_global"))
    with pytest.raises(ValueError, match=rf"rank {rank}: clip_grad_norm_: the ranks clip with different arguments: "
                                         r"strategy is '(py_global \(Python\)|global_norm)' here and differs on "
                                         r"rank\(s\) 1"):
        opt.clip_grad_norm_(1.0, strategy="py_global" if rank == 0 else None)
    before = dmuon.get_model_state_dict(model, rank0_only=False)
    stats = opt.clip_grad_norm_(1e-3)  # (and the same call on every rank goes on as usual)
    assert stats.clipped and stats.max_norm == 1e-3
    opt.step()
    after = dmuon.get_model_state_dict(model, rank0_only=False)
    assert all(not torch.equal(before[k], after[k]) for k in before if k.endswith("weight"))


def test_a_collective_call_on_some_ranks_only_raises_on_every_rank(tmp_path):
    run_ranks(tmp_path, 2, _rank_divergent_calls)


def _pair_meshes(rank, world):
    """Two pairs of ranks, each dedicating its own model on its own group with process_group_policy="shared"
    (the other pair may not dedicate at all): each pair agrees within itself only, and a pair whose ranks
    disagree on the policy is refused on both of its ranks at once while the other pair goes on."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    model = make_net()
    dmuon.dedicate_params(model, mine, lambda n, p: p.dim() == 2, process_group_policy="shared")
    dmuon.replicate(model)
    assert model._dmuon.mesh.world_size == 2
    policy = "isolated" if rank == 1 else "shared"
    if rank < 2:
        with pytest.raises(ValueError, match=rf"rank {rank}: dedicate_params: the ranks disagree on the process-group "
                                             r"policy \(rank: policy \{0: 'shared', 1: 'isolated'\}\)"):
            dmuon.dedicate_params(make_net(), mine, lambda n, p: p.dim() == 2, process_group_policy=policy)
    else:
        dmuon.dedicate_params(make_net(), mine, lambda n, p: p.dim() == 2, process_group_policy=policy)


def test_meshes_over_part_of_the_ranks_agree_within_their_group(tmp_path):
    run_ranks(tmp_path, 4, _pair_meshes)


def _subgroup_mesh(rank, world, store):
    """A model on ranks [1, 2] of 3 (process_group_policy="shared"; rank 0 takes no part): rank0_only dicts go to
    the mesh's first rank, global rank 1 (before: global rank 0 was looked for, and every rank got an empty dict,
    a checkpoint of nothing), and DedicatedParam.global_rank / owner_rank are global ranks (they were the mesh's
    0 and 1); rank 0 passing the group is told it is not a member. Then the process group is destroyed: the model
    is refused at its next forward and dmuon call (before: it went on over the destroyed groups, or a bare
    KeyError)."""
    import torch.nn as nn

    group = dist.new_group([1, 2])
    if rank == 0:  # not a member: said (before: "mesh must be a DeviceMesh or ProcessGroup, got int")
        with pytest.raises(ValueError, match=r"rank 0: dedicate_params: this rank is not a member of the group passed "
                                             r"as mesh \(torch.distributed.new_group returns "
                                             r"GroupMember.NON_GROUP_MEMBER"):
            dmuon.dedicate_params(make_net(), group, lambda n, p: p.dim() == 2, process_group_policy="shared")
    else:
        model = make_net()
        dmuon.dedicate_params(model, group, lambda n, p: p.dim() == 2, process_group_policy="shared")
        dmuon.replicate(model)
        opt = dmuon.Muon(model, lr=LR, first_step_progress_log=False)
        x, y = batch(0)
        per = len(x) // 2
        lo = (rank - 1) * per
        ((model(x[lo:lo + per]) - y[lo:lo + per]) ** 2).mean().backward()
        opt.step()
        params = dmuon.get_dedicated_params(model)
        assert {p.global_rank for p in params} == {1, 2}
        assert all(p.owner_rank == p.global_rank and p.is_owner == (p.global_rank == rank) for p in params)
        msd = dmuon.get_model_state_dict(model)
        osd = dmuon.get_optimizer_state_dict(model, opt)
        if rank == 1:
            assert msd.keys() == dict(model.named_parameters()).keys()
            assert len(osd["dedicated"]) == 2 * BLOCKS and osd["steps_taken"] == 1
        else:
            assert msd == {} and osd == {"fsdp": {}, "dedicated": {}, "param_groups": []}
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        gone = rf"rank {rank}: dmuon: this model's process group was destroyed \(torch.distributed.destroy_process_group\)"
        with pytest.raises(RuntimeError, match=gone):
            model(x)
        with pytest.raises(RuntimeError, match=gone):
            dmuon.get_model_state_dict(model)
        with pytest.raises(RuntimeError, match=gone):
            dmuon.Muon(model)
        assert isinstance(model, nn.Module)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def test_a_mesh_over_part_of_the_ranks_names_global_ranks_and_outlives_no_group(tmp_path):
    run_ranks(tmp_path, 3, _subgroup_mesh, str(tmp_path / "second-store"))


def _isolated_subgroup_alone(rank, world):
    """process_group_policy="isolated" (the default) on a group of ranks [1, 2] of 3 while rank 0 never calls
    dedicate_params: new_group is collective over every rank, so the members cannot go on; each says so and how
    to fix it within the timeout (before: a bare Gloo timeout naming nothing)."""
    if rank == 0:
        time.sleep(12)
        return
    group = dist.new_group([1, 2], use_local_synchronization=True)
    with pytest.raises(RuntimeError, match=rf"rank {rank}: dedicate_params: the mesh's group has 2 of the 3 ranks, "
                                           r"and with process_group_policy='isolated' dedicate_params is collective "
                                           r"over every rank.*process_group_policy='shared'"):
        dmuon.dedicate_params(make_net(), group, lambda n, p: p.dim() == 2)


def test_an_isolated_mesh_over_part_of_the_ranks_says_every_rank_must_call(tmp_path):
    assert run_faulty_ranks(tmp_path, 3, _isolated_subgroup_alone, timeout_s=4, deadline_s=60) == [0, 0, 0]


def _record(path, **fields):
    with open(path, "w") as f:
        json.dump(fields, f)


def _train_until_fault(rank, world, fault, out_dir):
    """Rank 1 trains one step, then dies (fault "kill") or stops (SIGSTOP, fault "stop"); rank 0 goes on and
    must get dmuon's error. Fault "interrupt": rank 1 stops after its second backward, rank 0 is sent SIGINT
    one second into its second step, which waits for rank 1 (the DDP path publishes synchronously)."""
    if fault == "stop":
        os.environ["DMUON_COLLECTIVE_TIMEOUT"] = "4"
    model = make_net()
    if fault == "interrupt":
        dmuon.dedicate_params_ddp(model, dist.group.WORLD, lambda n, p: p.dim() == 2)
        dmuon.replicate(model)
        opt = dmuon.Muon(model, replicate_async=False, first_step_progress_log=False)
    else:
        dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2)
        dmuon.replicate(model)
        opt = dmuon.Muon(model, first_step_progress_log=False)
    per = BATCH_PER(world)
    for step in range(2):
        x, y = batch(step)
        if rank == 1 and step == 1 and fault == "kill":
            os._exit(17)
        if rank == 1 and step == 1 and fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        opt.zero_grad()
        t0 = time.monotonic()
        try:
            ((model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]) ** 2).mean().backward()
            if rank == 1 and step == 1 and fault == "interrupt":
                time.sleep(0.5)  # its backward's reduces finish with rank 0's; rank 0's step then waits in the publish
                os.kill(os.getpid(), signal.SIGSTOP)
            if rank == 0 and step == 1 and fault == "interrupt":
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
                t0 = time.monotonic()
            opt.step()
        except BaseException as e:  # noqa: B902 - KeyboardInterrupt included
            _record(os.path.join(out_dir, f"rank{rank}.json"), type=type(e).__name__, message=str(e),
                    seconds=time.monotonic() - t0, step=step)
            os._exit(0)
    _record(os.path.join(out_dir, f"rank{rank}.json"), type=None, message="", seconds=0.0, step=2)


@pytest.mark.parametrize("fault", ["kill", "stop", "interrupt"])
def test_lost_peer_is_an_error_and_ctrl_c_interrupts(tmp_path, fault):
    codes = run_faulty_ranks(tmp_path, 2, _train_until_fault, fault, str(tmp_path), timeout_s=60, deadline_s=90)
    with open(tmp_path / "rank0.json") as f:
        r = json.load(f)
    assert codes[0] == 0, codes
    assert r["step"] == 1, r
    if fault == "kill":  # the dead peer's sockets close: Gloo fails at once, dmuon names the collective and rank
        assert codes[1] == 17 and r["type"] == "RuntimeError" and r["seconds"] < 30, r
        assert "rank 0" in r["message"], r
    elif fault == "stop":  # a stopped peer: dmuon's collective timeout (4 s) ends the wait
        assert r["type"] == "RuntimeError" and 3.0 < r["seconds"] < 4 + 20, r
        assert "rank 0" in r["message"] and "the wait limit is 4000 ms" in r["message"], r
    if fault != "interrupt":  # dmuon's message, without a C++ backtrace
        assert "A peer probably died" in r["message"] and "frame #" not in r["message"], r
    else:  # Ctrl-C one second into a step that waits for the stopped peer (timeout 60 s)
        assert r["type"] == "KeyboardInterrupt" and 0.9 < r["seconds"] < 10, r


def _hsdp_buckets(rank, world):
    """FSDP2 HSDP 2x2: DTensor gradient shards in a reduced bucket count every element once (the replicas'
    copies are scaled, not counted again): the bucket norm is the full gradients' norm."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = make_net()
    dmuon.dedicate_params(model, mesh, lambda n, p: p.dim() == 2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, first_step_progress_log=False)
    x, y = batch(0)
    per = BATCH_PER(world)
    ((model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]) ** 2).mean().backward()
    shards = [p.grad for p in model.parameters() if type(p).__name__ == "DTensor"]
    assert len(shards) == BLOCKS + 1
    full = math.sqrt(sum(float(g.full_tensor().double().norm()) ** 2 for g in shards))
    counted_shards = (BLOCKS + 1) * (world // 2)  # a bucket counts gradient tensors: each shard of replica 0 once
    r = dmuon.clip_grad_norm_buckets_([dmuon.GradClipBucket("fsdp", shards)], None)
    assert abs(r.find("fsdp").total_norm - full) < 1e-12 * full and r.find("fsdp").param_count == counted_shards
    muon_norm = opt.clip_grad_norm_(None).total_norm
    r = dmuon.try_clip_optimizer_grad_norm_buckets_(opt, regular_grads=[], adamw_grads=shards, max_norm=1e9)
    assert abs(r.find("adamw").total_norm - full) < 1e-12 * full and r.find("adamw").param_count == counted_shards
    assert abs(r.find("muon").total_norm - muon_norm) < 1e-12 * muon_norm
    stats = opt.clip_grad_norm_(None, scope="all")  # every parameter: Muon matrices and FSDP2's shards
    assert abs(stats.total_norm - math.sqrt(full ** 2 + muon_norm ** 2)) < 1e-12 * stats.total_norm
    assert stats.param_count == 3 * BLOCKS + 1


def test_hsdp_dtensor_shards_count_once_in_bucket_norms(tmp_path):
    run_ranks(tmp_path, 4, _hsdp_buckets)


def _fast_clip_setting(rank, world):
    model = dedicated_net(init_device_mesh("cpu", (world,)), False)
    opt = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR, first_step_progress_log=False)
    x, y = batch(0)
    ((model(x) - y) ** 2).mean().backward()
    os.environ["DMUON_FAST_CLIP"] = "0"  # off everywhere: None on every rank, the caller's own path
    assert dmuon.try_clip_optimizer_grad_norm_buckets_(opt, regular_grads=[], adamw_grads=[], max_norm=1.0) is None
    if rank == 1:  # off on one rank only: an error on both, not a hang
        os.environ.pop("DMUON_FAST_CLIP")
    with pytest.raises(ValueError, match=r"try_clip_optimizer_grad_norm_buckets_: DMUON_FAST_CLIP=0 on rank\(s\) 0 but not on the others"):
        dmuon.try_clip_optimizer_grad_norm_buckets_(opt, regular_grads=[], adamw_grads=[], max_norm=1.0)
    os.environ.pop("DMUON_FAST_CLIP", None)
    assert dmuon.try_clip_optimizer_grad_norm_buckets_(opt, regular_grads=[], adamw_grads=[], max_norm=1e9) is not None
    opt.step()


def test_fast_clip_setting_is_agreed_across_ranks(tmp_path):
    run_ranks(tmp_path, 2, _fast_clip_setting)


def _hostile_edits(rank, world):
    """What a caller writes into the optimizer after construction, and options of the wrong type: each is a
    Python exception naming what happened, before any weight changes; what schedulers write works."""
    model = make_net()
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2)
    dmuon.replicate(model)
    opt = dmuon.Muon(model, lr=LR, first_step_progress_log=False)
    x, y = batch(0)

    def backward():
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()

    def weights():
        return [p.detach().clone() for p in model.parameters()]

    # bad values written into the groups between steps: refused at step(), nothing updated
    muon_group, adamw_group = opt.param_groups[0], opt.param_groups[1]
    assert muon_group["is_muon"] and not adamw_group["is_muon"]
    for group, key, value, message in (
            (muon_group, "lr", float("nan"), r"param group #0 \('default', Muon\), as set since construction, has lr: nan"),
            (muon_group, "momentum", 1.5, r"has momentum: 1.5. Must be in \[0, 1\)"),
            (adamw_group, "weight_decay", -5.0, r"\('default', AdamW\), as set since construction, has weight_decay: -5"),
            (adamw_group, "lr", float("inf"), r"has lr: inf. Must be a finite number >= 0")):
        good = group[key]
        group[key] = value
        backward()
        before = weights()
        with pytest.raises(ValueError, match=message):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, weights())), f"{key}={value} changed a weight"
        group[key] = good
    # editing a group's parameters would be ignored: refused; so is add_param_group
    kept = muon_group["params"]
    muon_group["params"] = kept[:1]
    backward()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\] \('default'\) changed since construction"):
        opt.step()
    muon_group["params"] = kept
    with pytest.raises(ValueError, match="groups are fixed at construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    opt.step()  # the restored groups train

    # OneCycleLR cycles momentum (it reads "momentum" from defaults) and the lr; the core gets both
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=10)
    seen = []
    for _ in range(3):
        backward()
        opt.step()  # takes the groups' values as the scheduler left them
        for i, g in enumerate(opt.param_groups):
            native = opt._native.group_options(i)
            assert native["lr"] == g["lr"] and native["momentum"] == g["momentum"], (i, native["lr"], g["lr"])
        seen.append((muon_group["lr"], muon_group["momentum"]))
        sched.step()
    assert abs(seen[0][0] - LR / 25) < 1e-15 and seen[0][1] == 0.95 and seen[1][0] > seen[0][0] and seen[1][1] < seen[0][1], seen  # both cycle

    # a parameter frozen at dedicate_params and unfrozen later has no route: an error, not silently untrained
    frozen = make_net()
    frozen.layers[0].proj.weight.requires_grad_(False)
    dmuon.dedicate_params(frozen, dist.group.WORLD, lambda n, p: p.dim() == 2)
    dmuon.replicate(frozen)
    dmuon.Muon(frozen, first_step_progress_log=False)
    frozen(x)
    frozen.layers[0].proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="'layers.0.proj.weight' was frozen .* when dedicate_params ran"):
        frozen(x)

    # options of the wrong type: a TypeError naming the option, what it must be and what was given
    for kwargs, message in ((dict(lr="0.02"), r"option 'lr' must be a float, got '0.02' \(str\)"),
                            (dict(ns_steps=True), r"option 'ns_steps' must be an int, got True \(bool\)"),
                            (dict(ns_steps=2.5), r"option 'ns_steps' must be an int, got 2.5 \(float\)"),
                            (dict(adamw_betas=(0.9,)), r"option 'adamw_betas' must be a pair of floats"),
                            (dict(nesterov="no"), r"option 'nesterov' must be a bool, got 'no' \(str\)"),
                            (dict(nesterov=0), r"option 'nesterov' must be a bool, got 0 \(int\)"),
                            (dict(ns_backend=5), r"option 'ns_backend' must be .*, got 5 \(int\)")):
        with pytest.raises(TypeError, match=message):
            dmuon.Muon(model, **kwargs)
    with pytest.raises(TypeError, match=r"Muon: lr=None; pass a value"):
        dmuon.Muon(model, lr=None)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\] holds a str"):
        dmuon.Muon(model, param_groups=[{"params": ["layers.0.proj.weight"]}])
    with pytest.raises(ValueError, match="rank must be an int or a \\(shard, replicate\\) pair, got 'a'"):
        dmuon.get_owned_params(model, "a")
    # torch.optim's named groups: (name, parameter) pairs
    named = dmuon.Muon(model, param_groups=[{"params": list(model.named_parameters())[:2], "name": "first", "lr": 0.01}],
                       first_step_progress_log=False)
    first = [g for g in named.param_groups if g["group_name"] == "first"]
    assert sum(len(g["params"]) for g in first) == 2 and all(g["lr"] == 0.01 for g in first if g["is_muon"])
    with pytest.raises(TypeError, match=r"option 'reshard_after_forward' must be a bool, got 'yes' \(str\)"):
        dmuon.dedicate_params(make_net(), dist.group.WORLD, lambda n, p: p.dim() == 2, reshard_after_forward="yes")
    with torch.device("meta"):
        on_meta = make_net()
    with pytest.raises(ValueError, match=r"parameter\(s\) are on the meta device .* e.g. 'scale'"):
        dmuon.dedicate_params(on_meta, dist.group.WORLD, lambda n, p: p.dim() == 2)
    # a lazy module not yet run: its parameters have no shape (replicated, the first backward failed in autograd)
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4, dtype=torch.float64), torch.nn.Tanh())
    for fn in (dmuon.dedicate_params, dmuon.dedicate_params_ddp):
        with pytest.raises(ValueError, match=r"rank 0: dedicate_params(_ddp)?: 2 parameter\(s\) or buffer\(s\) of lazy "
                                             r"modules .* e.g. '0.weight' .* Run one forward"):
            fn(lazy, dist.group.WORLD, lambda n, p: n.endswith("weight"))
    lazy(torch.ones(2, 3, dtype=torch.float64))  # (initialised: dedicated as any model)
    dmuon.dedicate_params(lazy, dist.group.WORLD, lambda n, p: n.endswith("weight"))
    assert [d.name for d in dmuon.get_dedicated_params(lazy)] == ["0.weight"]
    # the setup callables' results are checked (pybind's cast said "Unable to cast ... to C++ type '?'")
    with pytest.raises(TypeError, match=r"option 'route_hint_fn' returned 5 \(int\) for parameter '[^']+'; it must "
                                        r"return a route name"):
        dmuon.dedicate_params(make_net(), dist.group.WORLD, lambda n, p: p.dim() == 2, route_hint_fn=lambda n, p: 5)
    with pytest.raises(TypeError, match="unhashable type: 'list'"):
        dmuon.dedicate_params(make_net(), dist.group.WORLD, lambda n, p: p.dim() == 2,
                              assignment_group_key_fn=lambda n, p: [n])
    keyed = make_net()  # any hashable key, None no hint
    dmuon.dedicate_params(keyed, dist.group.WORLD, lambda n, p: p.dim() == 2, route_hint_fn=lambda n, p: None,
                          assignment_group_key_fn=lambda n, p: (len(n), 3))
    assert len(dmuon.get_dedicated_params(keyed)) == BLOCKS * 2
    with pytest.raises(TypeError, match="predicate must be a callable"):
        dmuon.dedicate_params(make_net(), dist.group.WORLD, "proj")
    # a predicate's result counts by its truthiness, as filter() takes it (re.search gives a Match or None)
    searched = make_net()
    dmuon.dedicate_params(searched, dist.group.WORLD, lambda n, p: re.search(r"proj\.weight$", n))
    assert sorted(d.name for d in dmuon.get_dedicated_params(searched)) == [f"layers.{i}.proj.weight" for i in range(BLOCKS)]


def test_hostile_edits_between_steps_and_options_of_the_wrong_type(tmp_path):
    run_ranks(tmp_path, 1, _hostile_edits)


def _plateau_on_local_metrics(rank, world):
    """ReduceLROnPlateau stepped with each rank's own metric cuts the lr on one rank only: the next step is a
    ValueError on every rank naming the group (each rank's values agreed in the step's verdict), not replicas
    that drift apart in silence; the same values on every rank step as before."""
    model = make_net()
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2)
    dmuon.replicate(model)
    opt = dmuon.Muon(model, lr=LR, first_step_progress_log=False)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    x, y = batch(0)
    for metric in (1.0, 0.5 if rank == 0 else 1.0):  # rank 1's does not improve: its lr is cut
        opt.zero_grad()
        ((model(x[rank::world]) - y[rank::world]) ** 2).mean().backward()
        opt.step()
        sched.step(metric)
    assert (opt.param_groups[0]["lr"] == LR) == (rank == 0)
    opt.zero_grad()
    ((model(x[rank::world]) - y[rank::world]) ** 2).mean().backward()
    with pytest.raises(ValueError, match=rf"rank {rank}: Muon::step: the ranks stepped with different values of "
                                         r"param group #0 \('default', Muon\) \(this rank's: lr=.*rank\(s\) 1 differ"):
        opt.step()


def test_a_scheduler_stepped_on_local_metrics_is_an_error_at_the_next_step(tmp_path):
    run_ranks(tmp_path, 2, _plateau_on_local_metrics)


def _models_dmuon_cannot_train(rank, world):
    """Models dmuon cannot train are refused at dedicate_params, naming the parameter and the remedy, on every
    rank: a complex parameter (its imaginary part would be dropped), a sparse embedding, a module dedicated
    already (inside or around this one: a matrix would never train), a torch DDP wrapper."""
    predicate = lambda n, p: p.dim() == 2  # noqa: E731
    group = dist.group.WORLD
    complex_net = make_net()
    complex_net.phase = torch.nn.Parameter(torch.ones(3, dtype=torch.complex128))
    with pytest.raises(ValueError, match=rf"rank {rank}: dedicate_params: parameter 'phase' is complex .*view_as_complex"):
        dmuon.dedicate_params(complex_net, group, predicate)
    sparse_net = make_net()
    sparse_net.embed = torch.nn.Embedding(10, 8, sparse=True, dtype=torch.float64)
    with pytest.raises(ValueError, match="'embed' is an Embedding with sparse=True, so 'embed.weight' gets sparse"):
        dmuon.dedicate_params(sparse_net, group, predicate)
    inner_first = make_net()
    dmuon.dedicate_params(inner_first.layers[1], group, predicate)
    with pytest.raises(ValueError, match="submodule 'layers.1' was dedicated already"):
        dmuon.dedicate_params(inner_first, group, predicate)
    outer_first = make_net()
    dmuon.dedicate_params(outer_first, group, predicate)
    with pytest.raises(ValueError, match="parameter 'proj.weight' is dedicated already"):
        dmuon.dedicate_params(outer_first.layers[0], group, predicate)
    wrapped = torch.nn.parallel.DistributedDataParallel(make_net())
    with pytest.raises(ValueError, match=r"the model is a torch DistributedDataParallel.*\(model.module\)"):
        dmuon.dedicate_params(wrapped, group, predicate)
    dmuon.dedicate_params(wrapped.module, group, predicate)  # what it wraps is a model dmuon trains

    # a torch optimizer alone on a dedicated model would leave the matrices untrained: a warning, once
    dmuon.replicate(wrapped.module)
    adamw = torch.optim.AdamW(wrapped.module.parameters())
    x, y = batch(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            adamw.zero_grad()
            ((wrapped.module(x) - y) ** 2).mean().backward()
            adamw.step()
    said = [str(w.message) for w in seen if "no dmuon optimizer was built on it" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"rank {rank}: a second backward"), said


def test_models_dmuon_cannot_train_are_refused_at_dedicate_params(tmp_path):
    run_ranks(tmp_path, 2, _models_dmuon_cannot_train)


def _torch_optimizer_protocol(rank, world):
    """What torch.optim.Optimizer's users rely on beyond step(): state-dict hooks fire as in torch (a post-hook's
    key is in the dict, a load pre-hook's returned dict is what loads), a tensor or numpy lr (torch allows them)
    round-trips through state_dict, a group value that is not a number is refused, a duplicate is named."""
    import numpy as np

    model = make_net()
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2)
    dmuon.replicate(model)
    opt = dmuon.Muon(model, lr=LR, first_step_progress_log=False)
    x, y = batch(0)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()

    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))

    def sd_post(o, sd):
        calls.append("sd_post")
        sd["mine"] = 1
        return sd

    opt.register_state_dict_post_hook(sd_post)
    sd = opt.state_dict()
    assert sd["mine"] == 1 and calls == ["sd_pre", "sd_post"]
    lrs = [g["lr"] for g in sd["param_groups"]]

    def lsd_pre(o, d):
        calls.append("lsd_pre")
        assert d.pop("mine") == 1
        d = dict(d)
        d["param_groups"] = [dict(g, lr=g["lr"] / 2) for g in d["param_groups"]]
        return d

    handles = [opt.register_load_state_dict_pre_hook(lsd_pre),
               opt.register_load_state_dict_post_hook(lambda o: calls.append("lsd_post"))]
    opt.load_state_dict(sd)
    for handle in handles:
        handle.remove()
    assert calls == ["sd_pre", "sd_post", "lsd_pre", "lsd_post"]
    assert [g["lr"] for g in opt.param_groups] == [lr / 2 for lr in lrs]  # the pre-hook's dict loaded
    assert "mine" in sd  # (the caller's dict: a shallow copy was edited, as torch's)

    # a tensor lr (torch allows it) and a numpy lr (a LambdaLR returning numpy) round-trip, and train as floats
    opt.param_groups[0]["lr"] = torch.tensor(0.01, dtype=torch.float64)
    opt.param_groups[1]["lr"] = np.float32(0.005)
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and float(opt.param_groups[0]["lr"]) == 0.01
    assert opt._native.group_options(0)["lr"] == 0.01 and opt._native.group_options(1)["lr"] == float(np.float32(0.005))
    opt.step()
    # saved betas as tensors load (as numbers) and step; a string written between steps is refused at the step
    tensors = dict(saved, param_groups=[dict(g, betas=tuple(torch.tensor(b) for b in g["betas"]))
                                        for g in saved["param_groups"]])
    opt.load_state_dict(tensors)
    opt.step()
    opt.param_groups[1]["lr"] = "0.01"
    with pytest.raises(ValueError, match=r"param group #1 \('default'\) has lr='0.01'; it must be a number"):
        opt.step()
    opt.param_groups[1]["lr"] = 0.01
    opt.step()
    for bad in ("0.01", True, [0.01]):
        wrong = dict(saved, param_groups=[dict(g) for g in saved["param_groups"]])
        wrong["param_groups"][0]["lr"] = bad
        with pytest.raises(ValueError, match="holds a value that is not a number in lr"):
            opt.load_state_dict(wrong)
    # other values the constructor refuses are refused on load too, naming the key; malformed sections likewise
    before = opt._native.group_options(0)
    for key, bad, says in (("nesterov", None, "nesterov=None; it must be a bool"),
                           ("nesterov", 2, "nesterov=2; it must be a bool"),
                           ("ns_steps", True, "ns_steps=True; it must be an int >= 1"),
                           ("ns_steps", 2.5, "ns_steps=2.5; it must be an int >= 1"),
                           ("ns_steps", "5", "ns_steps='5'; it must be an int >= 1")):
        wrong = dict(saved, param_groups=[dict(g) for g in saved["param_groups"]])
        wrong["param_groups"][0][key] = bad
        with pytest.raises(ValueError, match=re.escape(f"param_groups[0] has {says}")):
            opt.load_state_dict(wrong)
    with pytest.raises(ValueError, match=re.escape("steps_taken is 1180591620717411303424; a step count is an integer")):
        opt.load_state_dict(dict(saved, steps_taken=2 ** 70))
    with pytest.raises(TypeError, match="the 'dedicated' section is a list, not a dict"):
        opt.load_state_dict(dict(saved, dedicated=[]))
    with pytest.raises(TypeError, match="param_groups is a NoneType, not a list"):
        opt.load_state_dict(dict(saved, param_groups=None))
    assert opt._native.group_options(0) == before and opt.param_groups[0]["nesterov"] is True
    opt.step()
    # torch.compile(model) (an OptimizedModule around it, compiled lazily) is the same model to the state dicts
    compiled = torch.compile(model)
    osd = dmuon.get_optimizer_state_dict(compiled, opt, rank0_only=False)
    assert osd["steps_taken"] == opt.steps_taken and set(osd) >= {"dedicated", "dedicated_adamw", "fsdp"}
    dmuon.set_optimizer_state_dict(compiled, opt, osd)

    # group values: a string or a bool is not a number (float() would take both)
    for value in ("0.5", True):
        with pytest.raises(ValueError, match=rf"has lr={value!r}; it must be a float"):
            dmuon.Muon(model, param_groups=[{"params": [model.scale], "lr": value}], first_step_progress_log=False)
    with pytest.raises(ValueError, match=r"has adamw_betas=\('0.9', 0.99\); it must be a pair of floats"):
        dmuon.Muon(model, param_groups=[{"params": [model.scale], "adamw_betas": ("0.9", 0.99)}],
                   first_step_progress_log=False)
    with pytest.raises(ValueError, match=r"parameter 'scale' is twice in param_groups\[0\]"):
        dmuon.Muon(model, param_groups=[{"params": [model.scale, model.scale]}], first_step_progress_log=False)


def test_state_dict_hooks_tensor_lrs_and_group_value_types_as_torch_optim(tmp_path):
    run_ranks(tmp_path, 1, _torch_optimizer_protocol)


def _fsdp2_only_adamw_group(rank, world):
    # every dedicated matrix in a user group: FSDP2's shards get a "default" AdamW group that only torch's AdamW
    # reads; values written into it are checked with the core's ranges at step(), before anything is updated
    model = dedicated_net(init_device_mesh("cpu", (world,)), True)
    matrices = [d.param for d in dmuon.get_dedicated_params(model)]
    opt = dmuon.Muon(model, lr=LR, param_groups=[{"params": matrices, "name": "matrices"}],
                     first_step_progress_log=False)
    group = opt.param_groups[-1]
    assert group["group_name"] == "default" and not group["is_muon"] and len(group["params"]) == BLOCKS + 1
    x, y = batch(0)
    for key, value, message in (("eps", 0.0, r"has eps: 0. Must be > 0"),
                                ("betas", (0.9, 1.0), r"has beta2: 1. Must be in \[0, 1\)"),
                                ("lr", float("nan"), r"has lr: nan. Must be a finite number >= 0")):
        good = group[key]
        group[key] = value
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        before = dmuon.get_model_state_dict(model, rank0_only=False)
        with pytest.raises(ValueError, match=rf"rank {rank}: Muon.step: param group #{len(opt.param_groups) - 1} "
                                             rf"\('default', AdamW\), as set since construction, {message}"):
            opt.step()
        after = dmuon.get_model_state_dict(model, rank0_only=False)
        assert all(torch.equal(before[k], after[k]) for k in before)
        group[key] = good
    opt.step()
    assert opt.steps_taken == 1
    # its state dict (the group's ns_steps is 0: AdamW runs no Newton-Schulz) loads back
    saved = opt.state_dict()
    assert saved["param_groups"][-1]["ns_steps"] == 0
    opt.load_state_dict(saved)
    opt.step()


def test_values_written_into_the_fsdp2_only_adamw_group_are_checked(tmp_path):
    run_ranks(tmp_path, 2, _fsdp2_only_adamw_group)


def _disagreeing_ranks(rank, world):
    model = make_net()
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2)
    dmuon.replicate(model)
    # an lr per rank would let the replicated parameters drift apart: every rank gets the same error
    with pytest.raises(ValueError, match=rf"rank {rank}: Muon: the ranks were given different lr \(rank 0: 0.05, "
                                         r"rank 1: 0.1\)"):
        dmuon.Muon(model, lr=LR * (1 + rank))
    with pytest.raises(ValueError, match=r"different group_prepare_ahead \(rank 0: True, rank 1: False\)"):
        dmuon.Muon(model, group_prepare_ahead=rank == 0)
    ns = dmuon.NewtonSchulz("gram", coefficients=dmuon.YOU_COEFFICIENTS if rank else dmuon.POLAR_EXPRESS_COEFFICIENTS)
    with pytest.raises(ValueError, match="different ns_backend"):  # coefficients differ, backend and kernel do not
        dmuon.Muon(model, ns_backend=ns)
    # values compare as the core takes them: an int and a float, or a tensor, of the same value agree
    dmuon.Muon(model, lr=1 if rank else 1.0, adamw_lr=torch.tensor(0.25, dtype=torch.float64), first_step_progress_log=False)
    opt = dmuon.Muon(model, lr=LR, first_step_progress_log=False)  # the same options: it trains
    x, y = batch(0)
    per = BATCH_PER(world)
    ((model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]) ** 2).mean().backward()
    opt.step()


def test_ranks_that_construct_muon_with_different_options_get_an_error(tmp_path):
    run_ranks(tmp_path, 2, _disagreeing_ranks)


def _two_muons(rank, world, layout, out_path):
    """One Muon steps the whole model (parameters in no group form the default group), so two Muons splitting a
    model by param_groups would each step everything: the second to step or clip the same gradients raises on
    every rank before anything changes (FSDP2's shards included), naming both; the first trains as one Muon alone.
    Replacing the optimizer works: a Muon built later steps after the next backward."""
    from test_dedicate import make_optimizer

    model = dedicated_net(init_device_mesh("cpu", (world,)), layout == "fsdp2")
    early = [p for n, p in model.named_parameters() if n.startswith("layers.0.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("layers.0.")]
    first, sched = make_optimizer(model, param_groups=[{"params": early}], first_step_progress_log=False)
    second, _ = make_optimizer(model, param_groups=[{"params": rest}], first_step_progress_log=False)
    per = 12 // world
    for step in range(STEPS):
        x, y = batch(step)
        first.zero_grad()
        ((model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]) ** 2).mean().backward()
        first.step()
        sched.step()
        if step == 0:
            for call in (second.step, lambda: second.clip_grad_norm_(1.0)):
                with pytest.raises(ValueError, match=rf"rank {rank}: .*another Muon on this model \(the #1 built on "
                                                     r"it; this is #2\) took these gradients already"):
                    call()
    sd = dmuon.get_model_state_dict(model)
    if rank == 0:
        torch.save(sd, out_path)
    replaced, _ = make_optimizer(model, first_step_progress_log=False)
    replaced.zero_grad()
    x, y = batch(0)
    ((model(x[rank * per:(rank + 1) * per]) - y[rank * per:(rank + 1) * per]) ** 2).mean().backward()
    replaced.step()
    with pytest.raises(ValueError, match=r"\(the #3 built on it; this is #1\)"):
        first.step()


@pytest.mark.parametrize("layout", ["replicate", "fsdp2"])
def test_a_second_muon_stepping_the_same_gradients_is_refused(tmp_path, layout):
    path = tmp_path / "two.pt"
    run_ranks(tmp_path, 2, _two_muons, layout, str(path))
    got = torch.load(path)
    for name, value in reference_train().items():
        err = float((got[name] - value).abs().max() / value.abs().max())
        assert err < 1e-10, f"{layout}: {name} differs from the reference by {err}"
