"""dedicate_params + replicate + Muon on an ordinary PyTorch model from Python: 2 and 3 ranks (real Gloo
groups, spawned processes) train exactly like one process, in float64 (bound 1e-10), Z3 and Z2, with
gradient accumulation under no_sync, and with an lr scheduler changing both groups' learning rates
every step."""

import pytest
import torch
from torch import nn

import dmuon
from dmuon_testing import run_ranks

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


def batch(step):
    x = (torch.arange(BATCH * DIM, dtype=torch.float64).reshape(BATCH, DIM) * 0.11 + step).cos()
    return x, x.sin()


def _train(rank, world, z3, accumulate, out_path):
    model = make_net()
    ids = {n: id(p) for n, p in model.named_parameters()}
    owners = dmuon.dedicate_params(model, torch.distributed.group.WORLD, lambda n, p: p.dim() == 2,
                                   reshard_after_forward=z3)
    assert len(owners) == 2 * BLOCKS and all(0 <= r < world for r in owners.values())
    assert {n: id(p) for n, p in model.named_parameters()} == ids  # the Parameter objects stay the same
    for p, r in owners.items():
        assert p._dedicated_owner_rank == r
        if world > 1 and r != rank:
            assert p.numel() == 0  # a placeholder between steps (Z3 and Z2)
    assert dmuon.replicate(model) is model
    opt = dmuon.Muon(model, lr=0.05, adamw_lr=0.01, weight_decay=0.01)
    assert [g["is_muon"] for g in opt.param_groups] == [True, False]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
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


@pytest.mark.parametrize("z3,accumulate", [(True, False), (False, False), (True, True)],
                         ids=["Z3", "Z2", "Z3-no_sync"])
def test_ranks_train_like_one_process(tmp_path, z3, accumulate):
    runs = {}
    for world in (1, 2, 3):
        path = tmp_path / f"w{world}.pt"
        run_ranks(tmp_path, world, _train, z3, accumulate and world > 1, str(path))
        runs[world] = torch.load(path)
    init = dict(make_net().named_parameters())
    # (with accumulation, the one-process run takes its batch whole: the reference for both)
    for world in (2, 3):
        for name, value in runs[1].items():
            err = float((runs[world][name] - value).abs().max() / value.abs().max())
            assert err < 1e-10, f"{world} ranks: {name} differs from one process by {err}"
    # training moved every kind of parameter (Muon matrices, AdamW biases and scale)
    for name in ("layers.1.proj.weight", "layers.2.gate.weight", "layers.0.proj.bias", "scale"):
        assert (runs[1][name] - init[name].detach()).abs().max() > 1e-4, name


def _misuse(rank, world):
    model = make_net()
    with pytest.raises(ValueError, match="was not dedicated"):
        dmuon.Muon(model)
    with pytest.raises(TypeError, match="DeviceMesh or ProcessGroup"):
        dmuon.dedicate_params(model, "cpu", lambda n, p: p.dim() == 2)
    dmuon.dedicate_params(model, torch.distributed.group.WORLD, lambda n, p: p.dim() == 2)
    with pytest.raises(ValueError, match="dedicated already"):
        dmuon.dedicate_params(model, torch.distributed.group.WORLD, lambda n, p: p.dim() == 2)
    with pytest.raises(ValueError, match="hook_boundary_predicate"):
        dmuon.dedicate_params(make_net(), torch.distributed.group.WORLD, lambda n, p: p.dim() == 2,
                              hook_boundary_predicate=lambda m: False)


def test_caller_mistakes(tmp_path):
    run_ranks(tmp_path, 2, _misuse)
