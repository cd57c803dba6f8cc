"""dmuon's forward hooks (C++ objects registered as module hooks) on the call conventions real models use:
a boundary whose tensor arrives only as a keyword, one that returns a (tensor, object) tuple, a named
tuple, a list, a dict holding a tuple, a tuple whose first tensor the loss does not use, one block run twice in one forward, a recurrent cell run twice on the raw input (whose first
use needs no input gradient, so it installs no post-backward hook), a forward that raises inside a boundary (its scope
is closed and the next forward trains normally), outputs changed in place by the caller and a dict the block keeps,
outputs made on a worker thread or with a renumbered autograd node, arguments and a parameter passed through. 1 and 2 ranks, Z3, float64: the output and every gradient
(averaged over ranks that all see the same batch) equal the plain model's at 1e-12."""

import collections
import dataclasses
import concurrent.futures
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmuon
from dmuon_testing import assert_grads_like, run_ranks

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


class DictBlock(nn.Module):  # a dict out (as a transformers ModelOutput), its tensor inside a tuple
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x):
        return {"hidden": (torch.tanh(self.proj(x)),), "residual": x}


class LateBlock(nn.Module):  # a tuple whose first item is not the output the loss goes through
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x):
        return x * 1.0, torch.sin(self.proj(x))


class CellBlock(nn.Module):  # a recurrent cell: applied twice, first to the raw input
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False, dtype=torch.float64)

    def forward(self, x):
        return torch.tanh(self.proj(x))


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
        self.layers = nn.ModuleList([KeywordBlock(), TupleBlock(), NamedBlock(), ListBlock(), FaultyBlock(), DictBlock(),
                                     LateBlock()])
        self.shared = nn.ModuleList([TupleBlock()])  # one block, run twice per forward
        self.cell = nn.ModuleList([CellBlock()])  # run twice, first on the input (no gradient wanted)

    def forward(self, x):
        x = self.cell[0](self.cell[0](x))
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
        x = self.layers[4](x)
        out = self.layers[5](x)
        x = out["hidden"][0] + 0.1 * out["residual"]
        return self.layers[6](x)[1]


def make_net():
    torch.manual_seed(3)
    return Net()


def _hooks(rank, world, select):
    x = torch.randn(5, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(9))  # every rank alike
    plain, model = make_net(), make_net()
    blocks = (KeywordBlock, TupleBlock, NamedBlock, ListBlock, FaultyBlock, DictBlock, LateBlock, CellBlock)
    if select == "predicate":
        how = dict(hook_boundary_predicate=lambda m: isinstance(m, blocks))
    else:  # the API reference's resolver returns the boundary module; its name works too
        def resolver(name, _param):
            block = model.get_submodule(name.rsplit(".", 2)[0])  # "<list>.<i>" of "<list>.<i>.proj.<w|b>"
            assert isinstance(block, blocks), name
            return block if select == "resolver" else name.rsplit(".", 2)[0]
        how = dict(hook_boundary_resolver=resolver)
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2, **how)
    dmuon.replicate(model)
    opt = dmuon.Muon(model, first_step_progress_log=False)
    assert sorted(model._dmuon.runtime.boundaries()) == ["cell.0"] + [f"layers.{i}" for i in range(7)] + ["shared.0"]

    want = plain(x)
    want.square().sum().backward()
    for attempt in range(3):
        if attempt > 0:  # a forward that raises inside a boundary: the error reaches the caller, the scopes close
            model.layers[4].fail = True
            with pytest.raises(ArithmeticError, match="inside the boundary"):
                model(x)
            model.layers[4].fail = False
        got = model(x)
        assert float((got - want).abs().max()) < 1e-12, f"attempt {attempt}: the output differs"
        got.square().sum().backward()
        # the norm of the Muon gradients the optimizer would step with: every use of every block in it
        muon_norm = opt.clip_grad_norm_(None).total_norm
        want_norm = float(torch.stack([q.grad.norm() for q in plain.parameters() if q.dim() == 2]).norm())
        assert abs(muon_norm - want_norm) < 1e-12 * want_norm, f"rank {rank}: Muon gradient norm {muon_norm} != {want_norm}"
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
        assert checked == 7 + int(owned)  # the 7 biases (replicated) and this rank's matrices
        dist.all_reduce(owned)
        assert int(owned) == len(mine) == 9  # each matrix checked on its one owner
        opt.zero_grad()


@pytest.mark.parametrize("world,select", [(1, "predicate"), (2, "predicate"), (2, "resolver"), (2, "resolver_name")])
def test_call_conventions_and_a_forward_that_raises(tmp_path, world, select):
    run_ranks(tmp_path, world, _hooks, select)


def _resolver_mistakes(rank, world):
    for result, message in ((None, r"hook_boundary_resolver must return the boundary module \(or its name\) for "
                                   r"'layers.0.proj.weight', got None"),
                            (nn.Linear(2, 2), r"returned a Linear for 'layers.0.proj.weight' that is not a module of "
                                              r"the model")):
        with pytest.raises(ValueError, match=message):
            dmuon.dedicate_params(make_net(), dist.group.WORLD, lambda n, p: p.dim() == 2,
                                  hook_boundary_resolver=lambda n, p, r=result: r)


def test_resolver_results_that_name_no_module_are_errors(tmp_path):
    run_ranks(tmp_path, 1, _resolver_mistakes)


class SineBlock(nn.Module):  # a tensor out, which the caller scales in place
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x):
        return torch.sin(self.proj(x))


class KeptDictBlock(nn.Module):  # returns a dict it keeps: dmuon must not change it or replace it
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)
        self.kept = {}

    def forward(self, x):
        self.kept["hidden"] = torch.sin(self.proj(x))
        self.kept["note"] = "kept"
        return self.kept


class ViewBlock(nn.Module):  # returns a view of what it computed, which the caller changes in place
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x):
        return (self.proj(x) * 1.0)[:, :DIM]


class PassBlock(nn.Module):  # returns its second tensor argument as it is (as T5's layers their position bias)
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x, bias):
        return torch.sin(self.proj(x)) + bias, bias


class ThreadBlock(nn.Module):  # its output made on a worker thread (threaded experts, parallel_apply): hooked
    # (Its nodes are numbered on the worker's counter: the boundary's exit renumbers them, so the weight's gradient
    # is in the reduce, which here waits to the end of backward anyway, as layers.6/7 run none.)
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(lambda: torch.sin(self.proj(x))).result()


class RenumberedBlock(SineBlock):  # its output's autograd node renumbered (as overlap helpers do)
    def forward(self, x):
        y = super().forward(x)
        y.grad_fn._set_sequence_nr(0)
        return y


class InPlaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([SineBlock(), LateBlock(), KeptDictBlock(), ViewBlock(), PassBlock(), SineBlock(),
                                     PassBlock(), PassBlock(), ThreadBlock(), RenumberedBlock()])
        self.offset = nn.Parameter(torch.linspace(-0.5, 0.5, DIM, dtype=torch.float64))  # a leaf passed through

    def forward(self, x):
        y = self.layers[0](x)
        y.mul_(2)  # in place on a boundary's output, as on a plain module's
        z, h = self.layers[1](y)
        z.add_(0.5)  # and on a tuple's item
        out = self.layers[2](h + 0.1 * z)
        assert out is self.layers[2].kept and set(out) == {"hidden", "note"}, "the block's own dict was replaced"
        v = self.layers[3](out["hidden"])
        v.mul_(3)  # in place on a view: its gradient goes to the view's base, which the block made
        bias = v * 0.5
        w, same = self.layers[4](v + bias, bias)  # (the bias's gradient is complete only after layers.4's backward)
        assert same is bias, "an argument passed through came back as another object"
        out = self.layers[9](self.layers[8](self.layers[5](w)))
        _, again = self.layers[6](out, same)  # only the argument it passes through reaches the loss: no backward
        _, offset = self.layers[7](out, self.offset)  # a parameter passed through: it gathers no block either
        assert offset is self.offset, "a leaf passed through came back as another object"
        return out + again + offset  # (the last blocks run: the first in backward, which no prefetch gathers)


def _in_place(rank, world, reshard):
    torch.manual_seed(5)
    plain = InPlaceNet()
    torch.manual_seed(5)
    model = InPlaceNet()
    x = torch.randn(4, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))  # every rank alike
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2, reshard_after_forward=reshard,
                          hook_boundary_predicate=lambda m: isinstance(m, (SineBlock, LateBlock, KeptDictBlock,
                                                                           ViewBlock, PassBlock, ThreadBlock)))
    dmuon.replicate(model)
    opt = dmuon.Muon(model, first_step_progress_log=False)
    want = plain(x)
    want.square().sum().backward()
    mine = {d.name: d for d in dmuon.get_dedicated_params(model)}
    # each matrix this rank does not own arrives once for the forward and (Z3) once again for its backward:
    # never a third time (a pass-through's late gradient must not gather a block whose backward is done)
    def not_owned(block=None):
        return sum(8 * d.full_shape[0] * d.full_shape[1] for d in mine.values()
                   if not d.is_owner and block in (None, d.boundary))
    for attempt in range(2):
        start = dmuon.comm_bytes(model).get("broadcast", 0)
        got = model(x)
        assert float((got - want).abs().max()) < 1e-12, f"attempt {attempt}: the output differs"
        got.square().sum().backward()
        dmuon.prepare_muon_grads(model)
        moved = dmuon.comm_bytes(model).get("broadcast", 0) - start
        # layers.6 and 7 run no backward: their matrices are gathered for their forwards only
        want_moved = (2 * not_owned() - not_owned("layers.6") - not_owned("layers.7")) if reshard else not_owned()
        assert moved == want_moved, f"rank {rank}: {moved} bytes broadcast, not {want_moved}"
        checked = 0
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            if name in mine and not mine[name].is_owner:
                continue
            if q.grad is None:  # layers.6's and 7's
                assert p.grad is None, f"rank {rank}: {name} has a gradient; the plain model's has none"
                continue
            err = float((p.grad - q.grad).abs().max() / q.grad.abs().max())
            assert err < 1e-12, f"rank {rank}, attempt {attempt}: the gradient of {name} differs by {err}"
            checked += 1
        # the biases of the blocks that train and the offset, and this rank's matrices of those blocks
        assert checked == 9 + sum(d.is_owner for d in mine.values() if d.boundary not in ("layers.6", "layers.7"))
        opt.zero_grad()


@pytest.mark.parametrize("world,reshard", [(1, True), (2, True), (2, False)])
def test_outputs_change_in_place_and_a_kept_dict_stays_the_blocks(tmp_path, world, reshard):
    """A boundary's outputs are the block's own tensors (the pre-backward hook is a hook on each, as FSDP2's),
    so the caller may change them in place as on a plain module, a view included; a dict the block keeps and
    an argument or a parameter it passes through come back as the very objects; an output made on a worker
    thread or whose node was renumbered is the block's own (hooked: its backward finds the matrix gathered).
    Gradients equal the plain model's at 1e-12 (float64), Z3 and Z2, and each matrix is broadcast once per
    forward and (Z3) once per backward it takes part in: a passed-through argument's gradient gathers no block."""
    run_ranks(tmp_path, world, _in_place, reshard)


class ThreadedNet(nn.Module):  # blocks whose ops run on a worker thread, every one of them in backward
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([ThreadBlock(), SineBlock(), ThreadBlock()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _threaded(rank, world, reshard):
    torch.manual_seed(7)
    plain = ThreadedNet()
    torch.manual_seed(7)
    model = ThreadedNet()
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2, reshard_after_forward=reshard,
                          hook_boundary_predicate=lambda m: isinstance(m, (SineBlock, ThreadBlock)))
    dmuon.replicate(model)
    mine = {d.name: d for d in dmuon.get_dedicated_params(model)}
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(world, 4, DIM, dtype=torch.float64, generator=gen) for _ in range(2)]
    for step, xs in enumerate(batches):
        checked = _backward_like_plain(model, plain, xs, rank, world, f"rank {rank}, step {step}",
                                       "arrived after the boundary's reduce")
        assert checked == 3 + sum(d.is_owner for d in mine.values())


def _backward_like_plain(model, plain, xs, rank, world, where, unwanted):
    """One backward of rank `rank`'s batch xs[rank] through dedicated `model`, with no warning containing
    `unwanted`; its gradients equal the plain model's gradient of every rank's loss, averaged (1e-12).
    Returns how many gradients were compared; drops them after."""
    plain.zero_grad()
    for r in range(world):
        (plain(xs[r]).square().sum() / world).backward()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(xs[rank]).square().sum().backward()
    said = [str(w.message) for w in seen if unwanted in str(w.message)]
    assert not said, f"{where}: {said}"
    dmuon.prepare_muon_grads(model)
    checked = assert_grads_like(model, plain, where)
    for p in model.parameters():
        p.grad = None
    return checked


@pytest.mark.parametrize("world,reshard", [(2, True), (2, False)])
def test_a_blocks_ops_on_a_worker_thread_give_their_gradients_to_the_reduce(tmp_path, world, reshard):
    """A block whose ops run on a worker thread (threaded experts, parallel_apply): autograd numbers those nodes
    on the worker's own counter, so the weight's gradient node would run after the input's post-backward hook,
    after the boundary's reduce. The boundary's exit renumbers them into the caller's numbering, so every
    gradient is in the reduce: each equals the plain model's at 1e-12 (float64, averaged over 2 ranks, Z3 and
    Z2), with no late-gradient warning."""
    run_ranks(tmp_path, world, _threaded, reshard)


class AttentionBlock(nn.Module):  # CLIP-style: torch's MultiheadAttention, not under layers.N / blocks.N
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, 2, dtype=torch.float64)
        self.mlp = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + torch.tanh(self.mlp(x))


class AttentionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.resblocks = nn.Sequential(AttentionBlock(), AttentionBlock())

    def forward(self, x):
        return self.resblocks(x)


def _attention(rank, world, reshard, ddp):
    torch.manual_seed(7)
    plain = AttentionNet()
    torch.manual_seed(7)
    model = AttentionNet()
    dedicate = dmuon.dedicate_params_ddp if ddp else dmuon.dedicate_params
    extra = {} if ddp else {"reshard_after_forward": reshard}
    dedicate(model, dist.group.WORLD, lambda n, p: p.dim() == 2, **extra)
    dmuon.replicate(model)
    boundary = {d.name: d.boundary for d in dmuon.get_dedicated_params(model)}
    # MultiheadAttention reads out_proj.weight itself (out_proj's forward never runs): its boundary is the
    # attention module, whose forward does
    assert boundary["resblocks.0.attn.out_proj.weight"] == "resblocks.0.attn", boundary
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        xs = torch.randn(world, 3, 2, DIM, dtype=torch.float64, generator=gen)
        checked = _backward_like_plain(model, plain, xs, rank, world, f"rank {rank}, step {step}", "dropped")
        assert checked == len(list(model.parameters())) - sum(not d.is_owner for d in dmuon.get_dedicated_params(model))


@pytest.mark.parametrize("reshard,ddp", [(True, False), (False, False), (False, True)])
def test_multihead_attentions_out_proj_trains_under_any_module_names(tmp_path, reshard, ddp):
    """nn.MultiheadAttention under names that are not layers.N / blocks.N (CLIP's resblocks.N.attn): its
    out_proj's boundary was out_proj itself, whose forward MultiheadAttention never calls, so its gradient was
    dropped (the DDP path) or a non-owner read a released placeholder (Z3). Every gradient equals the plain
    model's at 1e-12 (float64, 2 ranks), Z3, Z2 and the DDP path."""
    run_ranks(tmp_path, 2, _attention, reshard, ddp)


@dataclasses.dataclass(frozen=True)
class _Out:  # a block's output as a dataclass (frozen: dmuon's copy sets its fields all the same)
    hidden: torch.Tensor
    skip: torch.Tensor
    note: str = "kept"
    unset: torch.Tensor = dataclasses.field(init=False, repr=False)  # never set: skipped, as dataclasses.fields lists it


class DataclassBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x):
        return _Out(torch.tanh(self.proj(x)), x)


class DataclassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(DataclassBlock() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            out = layer(x)
            assert isinstance(out, _Out) and out.note == "kept"
            x = out.hidden + 0.5 * out.skip
        return x


def _dataclass_outputs(rank, world, reshard):
    torch.manual_seed(11)
    plain = DataclassNet()
    torch.manual_seed(11)
    model = DataclassNet()
    dmuon.dedicate_params(model, dist.group.WORLD, lambda n, p: p.dim() == 2, reshard_after_forward=reshard)
    dmuon.replicate(model)
    opt = dmuon.Muon(model, first_step_progress_log=False)
    x = torch.randn(5, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    plain(x).square().sum().backward()
    for _ in range(2):  # the second forward runs on the released matrices (Z3): the pre-backward gathers them
        model(x).square().sum().backward()
        norm = opt.clip_grad_norm_(None).total_norm
        want = float(torch.stack([q.grad.norm() for q in plain.parameters() if q.dim() == 2]).norm())
        assert abs(norm - want) < 1e-12 * want, (rank, norm, want)
        opt.zero_grad()


@pytest.mark.parametrize("reshard", [True, False], ids=["z3", "z2"])
def test_a_block_returning_a_dataclass_trains_as_in_torch(tmp_path, reshard):
    """A block returning a dataclass (frozen here) has its tensors found as in a tuple or dict: the gradients of
    every matrix equal torch's (1e-12), also on Z3, where the backward needs the matrices gathered again."""
    run_ranks(tmp_path, 2, _dataclass_outputs, reshard)
