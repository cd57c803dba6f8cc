"""dmuon's forward hooks (C++ objects registered as module hooks) on the call conventions real models use:
a boundary whose tensor arrives only as a keyword, one that returns a (tensor, object) tuple, a named
tuple, a list, one block run twice in one forward, and a forward that raises inside a boundary (its scope
is closed and the next forward trains normally). 2 ranks, Z3, float64: the output and every gradient
(averaged over ranks that all see the same batch) equal the plain model's at 1e-12."""

import collections

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmuon
from dmuon_testing import run_ranks

DIM = 6
Pair = collections.namedtuple("Pair", "out aux")


class KeywordBlock(nn.Module):  # the tensor only as a keyword argument, with a non-tensor one
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, *, hidden, scale):
        return torch.tanh(self.proj(hidden)) * scale


class TupleBlock(nn.Module):  # (tensor, a Python object) out; a string argument in
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x, note):
        return torch.sin(self.proj(x)), note + "!"


class NamedBlock(nn.Module):  # a named tuple out: it stays one
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False, dtype=torch.float64)

    def forward(self, x):
        y = self.proj(x)
        return Pair(torch.tanh(y), y.detach().sum())


class ListBlock(nn.Module):  # a list out, the second tensor trained through too
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x, mask=None):
        y = self.proj(x)
        return [torch.tanh(y) * mask, y]


class FaultyBlock(nn.Module):  # raises inside its boundary when told to
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)
        self.fail = False

    def forward(self, x):
        y = self.proj(x)
        if self.fail:
            raise ArithmeticError("a failure inside the boundary's forward")
        return torch.tanh(y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([KeywordBlock(), TupleBlock(), NamedBlock(), ListBlock(), FaultyBlock()])
        self.shared = nn.ModuleList([TupleBlock()])  # one block, run twice per forward

    def forward(self, x):
        x = self.layers[0](hidden=x, scale=0.5)
        x, note = self.layers[1](x, "note")
        assert note == "note!"
        pair = self.layers[2](x)
        assert isinstance(pair, Pair), type(pair)
        out = self.layers[3](pair.out, mask=torch.ones_like(pair.out))
        assert isinstance(out, list) and len(out) == 2
        x = out[0] + 0.1 * out[1]
        x, _ = self.shared[0](x, "a")
        x, _ = self.shared[0](x, "b")
        return self.layers[4](x)


def make_net():
    torch.manual_seed(3)
    return Net()


def _hooks(rank, world):
    x = torch.randn(5, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(9))  # every rank alike
    plain, model = make_net(), make_net()
    blocks = (KeywordBlock, TupleBlock, NamedBlock, ListBlock, FaultyBlock)
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2,
                          hook_boundary_predicate=lambda m: isinstance(m, blocks))
    dmuon.replicate(model)
    assert sorted(model._dmuon.runtime.boundaries()) == [f"layers.{i}" for i in range(5)] + ["shared.0"]

    want = plain(x)
    want.square().sum().backward()
    for attempt in range(2):
        # a forward that raises inside a boundary: the error reaches the caller, the scopes close
        model.layers[4].fail = True
        with pytest.raises(ArithmeticError, match="inside the boundary"):
            model(x)
        model.layers[4].fail = False
        got = model(x)
        assert float((got - want).abs().max()) < 1e-12, f"attempt {attempt}: the output differs"
        got.square().sum().backward()
        dmuon.prepare_muon_grads(model)
        mine = {d.name: d for d in dmuon.get_dedicated_params(model)}
        checked = 0
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            if name in mine and not mine[name].is_owner:
                continue  # the owner holds the averaged gradient
            assert p.grad is not None, f"rank {rank}: no gradient for {name}"
            err = float((p.grad - q.grad).abs().max() / q.grad.abs().max())
            assert err < 1e-12, f"rank {rank}, attempt {attempt}: the gradient of {name} differs by {err}"
            checked += 1
        owned = torch.tensor([sum(d.is_owner for d in mine.values())])
        assert checked == 5 + int(owned)  # the 5 biases (replicated) and this rank's matrices
        dist.all_reduce(owned)
        assert int(owned) == len(mine) == 6  # each matrix checked on its one owner
        for p in model.parameters():
            p.grad = None


def test_call_conventions_and_a_forward_that_raises(tmp_path):
    run_ranks(tmp_path, 2, _hooks)
