"""The API reference's code examples, run as written (CPU/Gloo, `init_device_mesh("cpu", ...)`, 2 spawned
ranks), on a small language model whose forward returns an object with `.loss` and whose blocks are
`model.layers` with `*_proj` matrices, as the examples assume: the Muon + fully_shard loop, the
dedicate_params_ddp + replicate example, the no_sync accumulation loop, NewtonSchulz configurations
passed as ns_backend, and the JSON dumps of summarize_param_groups / summarize_comm_plan /
collect_forward_unshard_profile."""

import io
import json
import os
from contextlib import nullcontext, redirect_stdout
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon_testing import run_ranks

VOCAB, DIM, SEQ = 32, 16, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM, dtype=torch.float64)
        self.q_proj = nn.Linear(DIM, DIM, bias=False, dtype=torch.float64)
        self.o_proj = nn.Linear(DIM, DIM, bias=False, dtype=torch.float64)
        self.up_proj = nn.Linear(DIM, 2 * DIM, bias=False, dtype=torch.float64)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False, dtype=torch.float64)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.o_proj(torch.tanh(self.q_proj(h)))
        return x + self.down_proj(torch.relu(self.up_proj(h)))


class TinyLM(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, dtype=torch.float64)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, dtype=torch.float64)

    def forward(self, batch):
        x = self.embed(batch[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return SimpleNamespace(loss=nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1)),
                               logits=logits)


def make_model():
    torch.manual_seed(11)
    return TinyLM()


def data(rank, n, batch=4, seed=5):
    g = torch.Generator().manual_seed(seed)
    pattern = torch.arange(SEQ + 1) % 5  # a learnable sequence plus noise tokens
    out = []
    for _ in range(n):
        b = torch.randint(0, VOCAB, (2 * batch, SEQ + 1), generator=g)
        b[:, ::2] = pattern[::2]
        out.append(b[rank * batch:(rank + 1) * batch])
    return out


def _muon_fully_shard(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    dataloader = data(rank, 12)
    # ---- the Muon docstring's example, as written ----
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    optimizer = dmuon.Muon(model, lr=0.02, momentum=0.95)

    losses = []
    for batch in dataloader:
        optimizer.zero_grad()
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    # ----
    assert len(dmuon.get_dedicated_params(model)) == 4 * 3 and all(map(lambda v: v == v, losses))
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.3, losses  # it trains
    # ---- summarize_param_groups / summarize_comm_plan, as written ----
    out = io.StringIO()
    with redirect_stdout(out):
        print(json.dumps(
            dmuon.summarize_param_groups(model, optimizer),
            indent=2,
            default=str,
        ))
        print(json.dumps(
            dmuon.summarize_comm_plan(model),
            indent=2,
            default=str,
        ))
    # ----
    text = out.getvalue()
    decoder = json.JSONDecoder()
    groups, end = decoder.raw_decode(text)
    plan, _ = decoder.raw_decode(text[end:].lstrip())
    assert groups["totals"]["muon_params_all"] == 12 and groups["fsdp2"]["params"] == 3 * 2 + 3
    assert plan["comm"]["muon_bytes"] == 3 * (DIM * DIM * 2 + 2 * DIM * 2 * DIM) * 8 and plan["mode"] == "z3"


def test_muon_fully_shard_example_and_json_dumps(tmp_path):
    run_ranks(tmp_path, 2, _muon_fully_shard)


def _ddp_no_sync_ns(rank, world, out_dir):
    os.environ["DMUON_RECORD_FORWARD_PROFILE"] = "1"  # as the reference says: before dedicate_params
    world_size = world
    # ---- the replicate docstring's example, as written (on the CPU) ----
    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model()
    dmuon.dedicate_params_ddp(model, mesh, predicate=lambda n, p: "proj" in n)
    dmuon.replicate(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=0.01)
    # ---- the no_sync docstring's accumulation loop, as written ----
    accum_steps = 2
    dataloader = data(rank, 4, batch=2)
    for i, batch in enumerate(dataloader):
        ctx = dmuon.no_sync(model) if (i + 1) % accum_steps != 0 else nullcontext()
        with ctx:
            loss = model(batch).loss / accum_steps
            loss.backward()
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    # ----
    # ---- collect_forward_unshard_profile, as written ----
    profile = dmuon.collect_forward_unshard_profile(
        model,
        synchronize=True,
    )
    # ----
    assert profile["enabled"] and json.dumps(profile)
    sd = dmuon.get_model_state_dict(model)
    # the same two steps on whole batches (the accumulated micro-batches' concatenation): the same model
    twin = make_model()
    dmuon.dedicate_params_ddp(twin, mesh, predicate=lambda n, p: "proj" in n)
    dmuon.replicate(twin, mesh=mesh)
    twin_opt = dmuon.Muon(twin, lr=0.02, adamw_lr=0.01)
    for k in range(2):
        twin_opt.zero_grad()
        twin(torch.cat(dataloader[2 * k:2 * k + 2])).loss.backward()
        twin_opt.step()
    twin_sd = dmuon.get_model_state_dict(twin)
    if rank == 0:
        for k, v in sd.items():
            assert float((v - twin_sd[k]).abs().max()) <= 1e-10 * float(twin_sd[k].abs().max()), k
    # ---- the NewtonSchulz example, as written (the SM90+ quack line aside) ----
    # Default (Gram-space, auto-selected kernel)
    ns = dmuon.NewtonSchulz()

    # Force cuBLAS (reproducible across runs)
    ns = dmuon.NewtonSchulz(kernel="cublas")
    ns = dmuon.NewtonSchulz(deterministic=True)  # equivalent

    optimizer = dmuon.Muon(model, lr=0.02, ns_backend=ns)
    # ---- and the ns_backend forms of Muon's docstring ----
    optimizer = dmuon.Muon(model, ns_backend="gram")
    ns = dmuon.NewtonSchulz("direct", coefficients=dmuon.YOU_COEFFICIENTS)
    optimizer = dmuon.Muon(model, ns_backend=ns)
    # ----
    # explicit coefficients set the iteration count: an ns_steps that differs is not used, and said so
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dmuon.Muon(model, ns_backend=ns, ns_steps=3)
    said = [str(w.message) for w in caught if "not used" in str(w.message)]
    assert len(said) == 1 and "ns_steps=3 not used" in said[0] and "5 iterations" in said[0], said
    assert dmuon.NewtonSchulz(kernel="cublas").resolved_kernel("cpu") == dmuon.NewtonSchulz(deterministic=True).resolved_kernel("cpu")
    batch = dataloader[0]
    optimizer.zero_grad()
    model(batch).loss.backward()
    optimizer.step()  # direct NS with You's coefficients
    assert all(torch.isfinite(p).all() for p in model.parameters())
    dist.barrier()


def test_ddp_replicate_no_sync_and_newton_schulz_examples(tmp_path):
    run_ranks(tmp_path, 2, _ddp_no_sync_ns, str(tmp_path))
