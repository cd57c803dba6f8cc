"""torch.compile per block, the way FSDP2 users do it (``layer.compile()`` after dedicate_params and
fully_shard, or ``torch.compile(layer)`` in the layer's place): dmuon's hooks are C++ calls that Dynamo leaves out of the graphs (graph breaks around each
block's forward), the blocks' forward and backward run as inductor code, and training equals the
one-process pure-PyTorch reference at 1e-10 in float64 (Z3 with replicate, and with FSDP2). Compiled
autograd is refused with an error that says what to do: dmuon's gradient hooks are C++ autograd node
hooks, which it would not run."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon_testing import run_ranks
from test_dedicate import STEPS, dedicated_net, make_optimizer, reference_train, train_steps


def _train(rank, world, layout, out_path):
    model = dedicated_net(init_device_mesh("cpu", (world,)), layout == "fsdp2")
    for i, layer in enumerate(model.layers):
        if layout == "wrapped":  # torch.compile(layer) in the layer's place (an OptimizedModule around it)
            model.layers[i] = torch.compile(layer)
        else:
            layer.compile()  # inductor on the CPU
    opt, sched = make_optimizer(model)
    train_steps(model, opt, sched, rank, world, range(STEPS))
    from torch._dynamo.utils import counters
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # the blocks did run compiled
    assert counters["aot_autograd"]["total"] >= 1, dict(counters["aot_autograd"])  # with compiled backward
    sd = dmuon.get_model_state_dict(model, rank0_only=False)
    dmuon.set_model_state_dict(model, sd)  # the round trip, under the model's own keys (_orig_mod. when wrapped)
    if rank == 0:
        torch.save(sd, out_path)
    # compiled autograd would trace backward without dmuon's C++ gradient hooks: refused at the forward
    torch._dynamo.config.compiled_autograd = True
    try:
        with pytest.raises(RuntimeError, match="compiled autograd"):
            model(torch.zeros(2, 8, dtype=torch.float64))
    finally:
        torch._dynamo.config.compiled_autograd = False


@pytest.mark.parametrize("layout", ["replicate", "fsdp2", "wrapped"])
def test_compiled_blocks_train_like_one_process(tmp_path, layout):
    path = tmp_path / "compiled.pt"
    run_ranks(tmp_path, 2, _train, layout, str(path))
    # torch.compile(layer) puts an OptimizedModule in the layer's place: its names carry "_orig_mod."
    # (model.state_dict() too), which torch users strip
    _assert_like_reference({k.replace("._orig_mod", ""): v for k, v in torch.load(path).items()}, layout)


def _assert_like_reference(got, where):
    for name, value in reference_train().items():
        err = float((got[name] - value).abs().max() / value.abs().max())
        assert err < 1e-10, f"{where}: {name} differs from the one-process reference by {err}"


def _compiled_before_dedicate(rank, world, ddp, out_path):
    """torch.compile(model) and one training-mode forward before dedicate_params (a sanity loss before
    fine-tuning): Dynamo's code from that forward has neither dmuon's hooks nor its placeholders, and torch does
    not guard on module hooks. It ran on: the DDP path dropped every gradient after its boundary's reduce (1.4e-1
    off, warnings only); Z3 failed in inductor's shape assertion on a placeholder. dedicate_params drops it."""
    from test_dedicate import BATCH, batch, make_net

    model = make_net()
    compiled = torch.compile(model)
    per = BATCH // world
    x0, _ = batch(0)
    compiled(x0[:per]).sum()  # (thrown away)
    mesh = init_device_mesh("cpu", (world,))
    (dmuon.dedicate_params_ddp if ddp else dmuon.dedicate_params)(model, mesh, lambda n, p: p.dim() == 2)
    dmuon.replicate(model)
    opt, sched = make_optimizer(model, first_step_progress_log=False)
    train_steps(compiled, opt, sched, rank, world, range(STEPS))  # (through the code compiled before)
    sd = dmuon.get_model_state_dict(model)
    if rank == 0:
        torch.save(sd, out_path)


@pytest.mark.parametrize("ddp", [True, False])
def test_a_model_compiled_and_run_before_dedicate_params_trains_like_one_process(tmp_path, ddp):
    path = tmp_path / "compiled.pt"
    run_ranks(tmp_path, 2, _compiled_before_dedicate, ddp, str(path))
    _assert_like_reference(torch.load(path), f"ddp={ddp}")
