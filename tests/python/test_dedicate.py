"""dedicate_params + replicate + Muon on an ordinary PyTorch model from Python: 1, 2 and 3 ranks (real
Gloo groups, spawned processes) train exactly like a pure-PyTorch Muon + AdamW written in this file, in
float64 (bound 1e-10), Z3 and Z2, with gradient accumulation under no_sync, and with an lr scheduler
changing both groups' learning rates every step."""

import pytest
import torch
from torch import nn

import dmuon
from dmuon_testing import reference_ns, run_ranks

DIM, BLOCKS, BATCH, STEPS = 8, 3, 12, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)
        self.gate = nn.Linear(DIM, DIM, bias=False, dtype=torch.float64)

    def forward(self, x):
        return torch.tanh(self.proj(x)) * torch.sigmoid(self.gate(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.scale = nn.Parameter(torch.full((DIM,), 1.3, dtype=torch.float64))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * self.scale


def make_net():
    torch.manual_seed(7)
    return Net()


LR, ADAMW_LR, WD, ADAMW_WD, MOMENTUM = 0.05, 0.01, 0.01, 0.01, 0.95


def schedule(step):
    return 1.0 / (1 + step)


def reference_train():
    """The same training in one process by a pure-PyTorch Muon + AdamW written from the documented update
    rule (docs: NEWTON_SCHULZ.md section 6), not by dmuon: Nesterov momentum buf = mu*buf + g, u = g + mu*buf;
    W *= 1 - lr*wd; W -= lr * 0.2 * sqrt(max(rows, cols)) * NS(u) with float64 direct NS (Polar Express);
    AdamW (betas 0.9/0.999, eps 1e-8, decoupled weight decay) for the rest; lr scaled by the schedule."""
    model = make_net()
    buf, m1, m2 = {}, {}, {}
    for step in range(STEPS):
        x, y = batch(step)
        model.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        f = schedule(step)
        with torch.no_grad():
            for name, p in model.named_parameters():
                g = p.grad
                if p.dim() == 2:
                    lr = LR * f
                    buf[name] = buf.get(name, torch.zeros_like(g)) * MOMENTUM + g
                    u = g + MOMENTUM * buf[name]
                    p.mul_(1 - lr * WD)
                    p.sub_(reference_ns(u, dmuon.POLAR_EXPRESS_COEFFICIENTS) * (lr * 0.2 * max(p.shape) ** 0.5))
                else:
                    lr = ADAMW_LR * f
                    m1[name] = m1.get(name, torch.zeros_like(g)) * 0.9 + 0.1 * g
                    m2[name] = m2.get(name, torch.zeros_like(g)) * 0.999 + 0.001 * g * g
                    p.mul_(1 - lr * ADAMW_WD)
                    bc1, bc2 = 1 - 0.9 ** (step + 1), 1 - 0.999 ** (step + 1)
                    p.sub_(lr / bc1 * m1[name] / ((m2[name] / bc2).sqrt() + 1e-8))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def batch(step):
    x = (torch.arange(BATCH * DIM, dtype=torch.float64).reshape(BATCH, DIM) * 0.11 + step).cos()
    return x, x.sin()


def _train(rank, world, layout, accumulate, out_path):
    model = make_net()
    ids = {n: id(p) for n, p in model.named_parameters()}
    if layout == "ddp":
        owners = dmuon.dedicate_params_ddp(model, torch.distributed.group.WORLD, lambda n, p: p.dim() == 2)
    else:
        owners = dmuon.dedicate_params(model, torch.distributed.group.WORLD, lambda n, p: p.dim() == 2,
                                       reshard_after_forward=layout == "z3")
    assert len(owners) == 2 * BLOCKS and all(0 <= r < world for r in owners.values())
    assert {n: id(p) for n, p in model.named_parameters()} == ids  # the Parameter objects stay the same
    for p, r in owners.items():
        assert p._dedicated_owner_rank == r
        if world > 1 and r != rank:  # a placeholder between steps (Z3 and Z2); the DDP path keeps it whole
            assert p.numel() == (p.shape.numel() if layout == "ddp" else 0)
    assert dmuon.replicate(model) is model
    opt = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR, weight_decay=WD, adamw_weight_decay=ADAMW_WD,
                     momentum=MOMENTUM)
    assert [g["is_muon"] for g in opt.param_groups] == [True, False]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    per = BATCH // world
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        lo = rank * per
        if accumulate:  # two micro-batches, the first without any reduce: the same gradient
            half = per // 2
            with dmuon.no_sync(model):
                ((model(x[lo:lo + half]) - y[lo:lo + half]) ** 2).mean().div(2).backward()
            ((model(x[lo + half:lo + per]) - y[lo + half:lo + per]) ** 2).mean().div(2).backward()
        else:
            ((model(x[lo:lo + per]) - y[lo:lo + per]) ** 2).mean().backward()
        opt.step()
        sched.step()
    assert opt.steps_taken == STEPS
    sd = dmuon.get_model_state_dict(model)
    plain = make_net().state_dict()
    assert list(sd) == list(plain)  # the single-process model's names, in its order
    for k, v in plain.items():
        assert sd[k].shape == v.shape and sd[k].dtype == v.dtype and not sd[k].requires_grad, k
    fresh = make_net()
    fresh.load_state_dict(sd)  # loadable by a plain model
    if rank == 0:
        torch.save(sd, out_path)


@pytest.mark.parametrize("layout,accumulate", [("z3", False), ("z2", False), ("z3", True), ("ddp", False)],
                         ids=["Z3", "Z2", "Z3-no_sync", "DDP-path"])
def test_ranks_train_like_one_process(tmp_path, layout, accumulate):
    runs = {}
    for world in (1, 2, 3):
        path = tmp_path / f"w{world}.pt"
        run_ranks(tmp_path, world, _train, layout, accumulate and world > 1, str(path))
        runs[world] = torch.load(path)
    init = dict(make_net().named_parameters())
    ref = reference_train()
    # every layout against the independent reference (with accumulation, the one-process run takes its
    # batch whole); float64: the same math in another order of reductions, and Gram NS against direct NS
    for world in (1, 2, 3):
        for name, value in ref.items():
            err = float((runs[world][name] - value).abs().max() / value.abs().max())
            assert err < 1e-10, f"{world} rank(s): {name} differs from the reference by {err}"
    # training moved every kind of parameter (Muon matrices, AdamW biases and scale)
    for name in ("layers.1.proj.weight", "layers.2.gate.weight", "layers.0.proj.bias", "scale"):
        assert (ref[name] - init[name].detach()).abs().max() > 1e-4, name


def _state_dict_roundtrip(rank, world):
    model = make_net()
    dmuon.dedicate_params(model, torch.distributed.group.WORLD, lambda n, p: p.dim() == 2)
    dmuon.replicate(model)
    torch.manual_seed(99)
    other = Net()  # different weights, loaded into the dedicated model
    sd = {k: v.clone() for k, v in other.state_dict().items()}
    dmuon.set_model_state_dict(model, sd)
    back = dmuon.get_model_state_dict(model)
    assert list(back) == list(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    x, _ = batch(0)
    # every rank now computes the loaded model's output (owners broadcast what they took)
    assert torch.allclose(model(x), other(x), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="missing"):
        dmuon.set_model_state_dict(model, {k: v for k, v in sd.items() if k != "scale"})


def test_state_dict_roundtrip(tmp_path):
    run_ranks(tmp_path, 2, _state_dict_roundtrip)


def _misuse(rank, world):
    model = make_net()
    with pytest.raises(ValueError, match="was not dedicated"):
        dmuon.Muon(model)
    with pytest.raises(TypeError, match="DeviceMesh or ProcessGroup"):
        dmuon.dedicate_params(model, "cpu", lambda n, p: p.dim() == 2)
    dmuon.dedicate_params(model, torch.distributed.group.WORLD, lambda n, p: p.dim() == 2)
    with pytest.raises(ValueError, match="dedicated already"):
        dmuon.dedicate_params(model, torch.distributed.group.WORLD, lambda n, p: p.dim() == 2)
    with pytest.raises(RuntimeError, match="no distributed route"):  # replicate() was not called
        dmuon.Muon(model)
    dmuon.replicate(model)
    opt = dmuon.Muon(model)
    with pytest.raises(NotImplementedError, match="would silently leave them out"):
        opt.state_dict()
    opt.param_groups[1]["betas"] = (0.8, 0.9)  # not taken from the groups yet: refused, not ignored
    with pytest.raises(ValueError, match="betas"):
        opt.step()
    with pytest.raises(ValueError, match="hook_boundary_predicate"):
        dmuon.dedicate_params(make_net(), torch.distributed.group.WORLD, lambda n, p: p.dim() == 2,
                              hook_boundary_predicate=lambda m: False)


def test_caller_mistakes(tmp_path):
    run_ranks(tmp_path, 2, _misuse)
