"""dmuon from Python on one device with a group of one rank: the CPU (Gloo) here and in CI, one GPU (NCCL,
world size 1) where CUDA is present (scripts/gpu_check.sh runs this file on a lent GPU). The transformers
Llama of test_transformers_equivalence trains 8 steps in float64 like the one-process pure-PyTorch reference
at 1e-10 with FSDP2 (Z3, Z2) and the DDP path. With DMUON_FORCE_COLLECTIVES=1 the group of one issues its
collectives for real (NCCL's kernels on the GPU, Gloo's on the CPU) and the result is the same."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon_testing import reference_ns, rel
from test_transformers_equivalence import (ADAMW_LR, ADAMW_WD, LR, MOMENTUM, STEPS, WD, is_muon, loss_of, make_llama,
                                           reference_train, schedule, tokens)

NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (scripts/gpu_check.sh runs it)")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_GPU)]
# every layout on the GPU; on the CPU the forced group of one (the multi-rank tests cover the rest there)
RUNS = [("cpu", "z3", True), ("cpu", "ddp", True)] + [
    pytest.param("cuda", layout, forced, marks=NO_GPU)
    for layout, forced in (("z3", False), ("z3", True), ("z2", True), ("ddp", True))]


def _one_rank(rank, device, store, layout, forced, out_path):
    del rank
    if forced:
        os.environ["DMUON_FORCE_COLLECTIVES"] = "1"
    kwargs = {}
    if device == "cuda":
        torch.cuda.set_device(0)
        kwargs["device_id"] = torch.device("cuda", 0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1, **kwargs)
    model = make_llama().to(device)
    mesh = init_device_mesh(device, (1,))
    if layout == "ddp":
        dmuon.dedicate_params_ddp(model, mesh, is_muon)
        dmuon.replicate(model, mesh=mesh)
    else:
        dmuon.dedicate_params(model, mesh, is_muon, reshard_after_forward=layout != "z2")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR, weight_decay=WD, adamw_weight_decay=ADAMW_WD,
                     momentum=MOMENTUM, first_step_progress_log=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, tokens(step).to(device)).backward()
        opt.step()
        sched.step()
    sd = dmuon.get_model_state_dict(model)
    # forced: the owner's reduces and publishes went through the group (counted: nothing, a group of one
    # moves no bytes); not forced: nothing was issued
    assert sum(dmuon.comm_bytes(model).values()) == 0
    torch.save({n: t.cpu() for n, t in sd.items()}, out_path)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past torch's Gloo exit race (dmuon_testing._entry)


@pytest.mark.parametrize("device,layout,forced", RUNS)
def test_one_rank_trains_like_one_process(tmp_path, device, layout, forced):
    path = tmp_path / "llama.pt"
    mp.spawn(_one_rank, args=(device, str(tmp_path / "store"), layout, forced, str(path)), nprocs=1, join=True)
    got = torch.load(path)
    ref = reference_train()
    assert set(got) == set(ref)
    for name, value in ref.items():
        err = float((got[name] - value).abs().max() / value.abs().max())
        assert err < 1e-10, f"{device} {layout} (forced {forced}): {name} differs from the reference by {err}"


@pytest.mark.parametrize("device", DEVICES)
def test_newton_schulz_on_the_device(device):
    """dmuon's NS functions on the device's tensors, float64 against the float64 reference (1e-10)."""
    torch.manual_seed(0)
    g = torch.randn(96, 160, dtype=torch.float64)
    want = reference_ns(g, dmuon.POLAR_EXPRESS_COEFFICIENTS)
    for fn in (dmuon.newton_schulz, dmuon.gram_newton_schulz, dmuon.direct_newton_schulz):
        got = fn(g.to(device))  # Polar Express by default
        assert got.device.type == device and rel(got.cpu(), want) < 1e-10, fn.__name__
