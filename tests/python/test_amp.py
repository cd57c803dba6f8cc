"""Loss scaling (fp16 training's GradScaler) with dmuon.GradScaler on real Gloo groups (2 and 4 spawned ranks,
float64, powers-of-two scales: exact): a run with a scaled loss, its scale backed off by an overflow and grown
twice, trains like the unscaled pure-PyTorch reference of test_dedicate.py to 1e-10, unscaled by the step
itself or by unscale_ before clipping, with the AdamW parameters replicated, on FSDP2, or on dmuon's HSDP
with sharded_adamw. The overflow is an inf
in one dedicated matrix's gradient on one rank, which after the reduce only the matrix's owner (another rank)
holds: every rank skips that step (parameters, momentum and step counts untouched, gradients kept as torch keeps
them) and backs its scale off alike. torch.amp.GradScaler itself is refused at step() with the remedy, on every rank."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon_testing import run_ranks
from test_dedicate import BATCH, CLIP, STEPS, batch, dedicated_net, layout_net, make_net, make_optimizer, reference_train

INIT = 2.0 ** 10


def _loss(model, step, rank, world):
    x, y = batch(step)
    lo = rank * (BATCH // world)
    hi = lo + BATCH // world
    return ((model(x[lo:hi]) - y[lo:hi]) ** 2).mean()


def _full(model):
    return {n: t.clone() for n, t in dmuon.get_model_state_dict(model, rank0_only=False).items()}


def _model(world, layout):
    if layout != "hsdp-sharded":
        return dedicated_net(init_device_mesh("cpu", (world,)), layout == "fsdp2")
    # dmuon's HSDP (2 replicas of a 2-rank shard axis), the biases on sharded_adamw, the scale replicated
    model = make_net()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    dmuon.dedicate_params(model, mesh, lambda n, p: p.dim() == 2,
                          param_policy={"overrides": [{"match": "proj bias", "route": "sharded_adamw"}]})
    dmuon.replicate(model)
    return model


def _scaled_training(rank, world, layout, clip, out_path):
    model = _model(world, layout)
    opt, sched = make_optimizer(model)
    scaler = dmuon.GradScaler("cpu", init_scale=INIT, growth_interval=2)

    # an overflow: another rank's gradient of a matrix its owner holds is inf; after the reduce only the owner
    # holds it
    target = dmuon.get_dedicated_params(model)[0]
    before = _full(model)
    poisoned = (target.global_rank + 1) % world
    hook = target.param.register_hook(lambda g: g * float("inf")) if rank == poisoned else None
    scaler.scale(_loss(model, 0, rank, world)).backward()
    if hook is not None:
        hook.remove()
    if clip:
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == INIT / 2, (rank, scaler.get_scale())  # backed off on every rank
    assert opt.steps_taken == 0 and len(opt.state) == 0  # no momentum or AdamW moment was created
    after = _full(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing stepped
    # the skipped step's gradients stay, as torch's scaler leaves them (a replicated parameter's in .grad), for
    # the loop's zero_grad (then zero_grad(set_to_none=False) steps them as zeros next time, as in torch)
    assert any(p.grad is not None for p in model.parameters())

    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(_loss(model, step, rank, world)).backward()
        if clip:
            scaler.unscale_(opt)
            stats = opt.clip_grad_norm_(CLIP, scope="all")  # the unscaled norm: it clips, as the reference does
            assert stats.clipped and not stats.found_inf and stats.total_norm < 10, stats
        scaler.step(opt)
        scaler.update()
        sched.step()
        scales.append(scaler.get_scale())
    # growth_interval 2: the scale doubles after every second clean step
    assert scales == [INIT / 2, INIT, INIT, 2 * INIT], scales
    assert opt.steps_taken == STEPS
    sd = dmuon.get_model_state_dict(model)
    if rank == 0:
        torch.save(sd, out_path)
    # zero_grad between unscale_ and step drops the backward: the step has nothing to apply (as torch's)
    before = _full(model)
    scaler.scale(_loss(model, 0, rank, world)).backward()
    scaler.unscale_(opt)
    opt.zero_grad()
    scaler.step(opt)
    scaler.update()
    after = _full(model)
    assert all(torch.equal(before[n], after[n]) for n in before) and scaler.get_scale() == 2 * INIT


@pytest.mark.parametrize("layout,clip,world", [("replicate", False, 2), ("fsdp2", True, 2), ("hsdp-sharded", True, 4)])
def test_scaled_loss_trains_like_the_unscaled_reference_and_overflows_skip_on_every_rank(tmp_path, layout, clip, world):
    path = tmp_path / "scaled.pt"
    run_ranks(tmp_path, world, _scaled_training, layout, clip, str(path))
    got = torch.load(path)
    ref = reference_train(clip=CLIP if clip else None)
    for name, value in ref.items():
        err = float((got[name] - value).abs().max() / value.abs().max())
        assert err < 1e-10, f"{layout}: {name} differs from the reference by {err}"


def _torch_scaler_refused(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = dedicated_net(mesh, False)
    opt, _ = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT)
    before = _full(model)
    scaler.scale(_loss(model, 0, rank, world)).backward()
    with pytest.raises(RuntimeError, match=rf"rank {rank}: .*dmuon.GradScaler"):
        scaler.step(opt)
    after = _full(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # the refused step left no scale
    # the same optimizer under dmuon.GradScaler then steps exactly as an unscaled twin does
    opt.zero_grad()
    ours = dmuon.GradScaler("cpu", init_scale=INIT)
    ours.scale(_loss(model, 0, rank, world)).backward()
    ours.step(opt)
    ours.update()
    assert opt.steps_taken == 1 and ours.get_scale() == INIT
    twin = dedicated_net(mesh, False)
    twin_opt, _ = make_optimizer(twin)
    _loss(twin, 0, rank, world).backward()
    twin_opt.step()
    got, want = _full(model), _full(twin)
    assert all(float((got[n] - want[n]).abs().max()) <= 1e-12 * float(want[n].abs().max()) for n in want)


class _Local(torch.nn.Module):  # a rank-local model with its own torch optimizer under the same scaler
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))


def _second_optimizer(rank, world):
    # a torch optimizer sharing dmuon.GradScaler with Muon: an inf in its gradient on one rank alone backs the
    # scale off on every rank (dmuon's reduces add the ranks' scaled gradients: the scale must stay the same)
    model = dedicated_net(init_device_mesh("cpu", (world,)), False)
    opt, _ = make_optimizer(model)
    local = _Local()
    sgd = torch.optim.SGD(local.parameters(), lr=0.1)
    scaler = dmuon.GradScaler("cpu", init_scale=INIT)
    for step, poisoned in enumerate((1, None)):
        opt.zero_grad()
        sgd.zero_grad()
        extra = (local.w * (float("inf") if rank == poisoned else 1.0)).sum()
        scaler.scale(_loss(model, step, rank, world) + extra).backward()
        scaler.step(opt)
        scaler.step(sgd)
        scaler.update()
        assert scaler.get_scale() == INIT / 2, (rank, step, scaler.get_scale())  # backed off alike, then held
    assert opt.steps_taken == 2  # Muon's own gradients were finite on every rank: it stepped both times


def test_a_second_optimizer_under_the_same_scaler_keeps_the_scale_equal_on_every_rank(tmp_path):
    run_ranks(tmp_path, 2, _second_optimizer)


def test_torch_grad_scaler_is_refused_with_the_remedy(tmp_path):
    run_ranks(tmp_path, 2, _torch_scaler_refused)


def _micro_batches_in_one_autocast_region(rank, world, layout, micro):
    """`micro` micro-batches (all but the last under no_sync) inside ONE torch.autocast region: autocast keeps the
    bfloat16 cast of each parameter for the whole region, and the later forwards reused the first one's cast
    node, which autograd ran after the boundary's reduce went out: dmuon dropped what it brought (50-100% off,
    with a warning blaming a use outside the boundary). The gradients dmuon hands the step are plain torch's
    under the same autocast region, averaged over the ranks."""
    plain = make_net().float()
    model = layout_net(init_device_mesh("cpu", (world,)), layout, make_net().float())
    per = BATCH // world
    size = per // micro
    x, y = (t.float() for t in batch(0))

    def accumulate(net, ranks, scale):
        for r in ranks:
            for k in range(micro):
                lo = r * per + k * size
                loss = ((net(x[lo:lo + size]) - y[lo:lo + size]) ** 2).float().mean() * scale
                if net is model and k < micro - 1:
                    with dmuon.no_sync(model):
                        loss.backward()
                else:
                    loss.backward()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        accumulate(model, [rank], 1.0 / micro)
    dmuon.prepare_muon_grads(model)
    mine = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None and p.numel()}
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    got = {n: g for d in every for n, g in d.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        accumulate(plain, range(world), 1.0 / micro / world)
    assert all(name in got for name, p in plain.named_parameters() if p.dim() == 2), sorted(got)
    for name, p in plain.named_parameters():
        if name not in got:  # (a sharded_adamw gradient is each rank's slice, outside .grad)
            continue
        err = float((got[name] - p.grad).abs().max() / p.grad.abs().max())
        # the same bfloat16 products; float32 sums in another order: measured <= 2e-7
        assert err < 1e-5, f"{layout}: {name}'s gradient is {err:.3g} off torch's under the same autocast region"


@pytest.mark.parametrize("layout", ["z3", "ddp", "sharded"])
def test_micro_batches_in_one_autocast_region_give_torchs_gradients(tmp_path, layout):
    run_ranks(tmp_path, 2, _micro_batches_in_one_autocast_region, layout, 2)


def _torch_optimizer_under_the_scaler(rank, world):
    """dmuon.GradScaler driving a torch optimizer over a dedicated model (after prepare_muon_grads, as dmuon's
    warning suggests): an inf that after the reduce only the matrix's owner holds. Every rank skips the step and
    backs off alike, as DDP with torch.amp.GradScaler does (the owner alone skipped and halved its scale: the
    replicas drifted apart, and later reduces added gradients scaled differently)."""
    model = layout_net(init_device_mesh("cpu", (world,)), "z3", make_net())
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scaler = dmuon.GradScaler("cpu", init_scale=INIT)
    target = dmuon.get_dedicated_params(model)[0]
    hook = target.param.register_hook(lambda g: g * float("inf")) if rank != target.global_rank else None
    before = model.scale.detach().clone()
    scaler.scale(_loss(model, 0, rank, world)).backward()
    if hook is not None:
        hook.remove()
    dmuon.prepare_muon_grads(model)
    scaler.step(sgd)
    scaler.update()
    assert scaler.get_scale() == INIT / 2, f"rank {rank}: scale {scaler.get_scale()}"
    assert torch.equal(model.scale.detach(), before), f"rank {rank} stepped a replicated parameter"
    # a clean step then steps on every rank
    sgd.zero_grad()
    scaler.scale(_loss(model, 1, rank, world)).backward()
    dmuon.prepare_muon_grads(model)
    scaler.step(sgd)
    scaler.update()
    assert scaler.get_scale() == INIT / 2 and not torch.equal(model.scale.detach(), before), rank


def test_a_torch_optimizer_over_a_dedicated_model_skips_overflows_on_every_rank(tmp_path):
    run_ranks(tmp_path, 2, _torch_optimizer_under_the_scaler)


class _HalfMatrix(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(4, 6).half())  # float16: Muon's, on its owner after the reduce
        self.scale = torch.nn.Parameter(torch.ones(3))  # float32, replicated

    def forward(self, x):
        return (self.weight.float().sum() + self.scale.sum()) * x


def _torch_optimizer_refusing_fp16(rank, world):
    """torch's GradScaler refuses to unscale float16 gradients; after prepare_muon_grads a float16 matrix's
    gradient is on its owner alone, so only the owner refused and the other ranks waited in the inf agreement until
    the timeout. The refusal now raises on every rank at once, before any rank unscaled a gradient (as torch's
    refusal leaves them: the caller who catches it finds the gradients still scaled)."""
    model = _HalfMatrix()
    dmuon.dedicate_params(model, torch.distributed.group.WORLD, lambda n, p: p.dim() == 2)
    dmuon.replicate(model)
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scaler = dmuon.GradScaler("cpu", init_scale=INIT)
    scaler.scale(model(torch.ones(1)).sum()).backward()
    dmuon.prepare_muon_grads(model)
    scaled = model.scale.grad.clone()
    assert float(scaled.abs().max()) == INIT  # (INIT times the gradient, 1)
    with pytest.raises(ValueError, match=rf"rank {rank}: GradScaler.unscale_: Attempting to unscale FP16 gradients"):
        scaler.step(sgd)
    assert torch.equal(model.scale.grad, scaled), rank


def test_a_torch_optimizers_fp16_refusal_raises_on_every_rank(tmp_path):
    run_ranks(tmp_path, 2, _torch_optimizer_refusing_fp16)
