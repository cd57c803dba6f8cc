"""What a model's many small parameters cost on dmuon's sharded_adamw route against the replicated route,
measured in one run (CPU, Gloo, 2 ranks spawned here): a model of 8 blocks (hook boundaries), each with a few
4x4 Muon matrices and many 1-D scales (a transformer's norms and biases, in miniature), so each collective's
fixed cost dominates. For each route it prints the best-of-3 training step (forward, backward, step) and the
collectives one step issues on that route (summarize_comm_plan's step_traffic: calls per operation), and the
ratio sharded / replicated.

sharded_adamw packs a boundary's slices into one all-gather and one reduce-scatter per dtype (before: one
per parameter, so the step grew by ~1 ms per scale on this machine). Usage:
  PYTHONPATH=<build>/python:tests/python OMP_NUM_THREADS=1 python bench/python_sharded_bench.py [N ...]
N: 1-D parameters and matrices in all (default 352 1400).
"""

import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import dmuon
from dmuon_testing import run_ranks

D = 4


class Block(nn.Module):
    def __init__(self, scales, mats):
        super().__init__()
        self.mats = nn.ParameterList(nn.Parameter(torch.randn(D, D) * 0.3) for _ in range(mats))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(D)) for _ in range(scales))

    def forward(self, x):
        for w in self.mats:
            x = torch.tanh(x @ w)
        return x * torch.stack(list(self.scales)).sum(0) / len(self.scales)


class Net(nn.Module):
    def __init__(self, n, blocks=8):
        super().__init__()
        per = n // blocks
        mats = max(1, per // 4)
        self.layers = nn.ModuleList(Block(per - mats, mats) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def best_of(fn, reps):
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - t)
    return best


def worker(rank, world, sizes):
    torch.set_num_threads(1)
    x = torch.randn(8, D)
    for n in sizes:
        rows = {}
        for route in ("replicated", "sharded_adamw"):
            torch.manual_seed(0)
            model = Net(n)
            hint = (lambda name, p: "sharded_adamw" if p.dim() == 1 else "") if route == "sharded_adamw" else None
            dmuon.dedicate_params(model, dist.group.WORLD, lambda name, p: p.dim() == 2, route_hint_fn=hint)
            dmuon.replicate(model)
            opt = dmuon.Muon(model, lr=0.01, adamw_lr=0.001, first_step_progress_log=False)

            def step():
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()

            step()  # (the first step records the forward order)
            seconds = best_of(step, 3)
            calls = {}  # this route's collectives per step, by operation
            for t in dmuon.summarize_comm_plan(model)["step_traffic"]:
                if t["route"] == route:
                    calls[t["op"]] = calls.get(t["op"], 0) + t["calls"]
            rows[route] = (seconds, calls)
        if rank == 0:
            scales = sum(1 for p in model.parameters() if p.dim() == 1)
            rep, sh = rows["replicated"][0], rows["sharded_adamw"][0]
            print(f"N={n} ({scales} 1-D parameters in 8 boundaries): step replicated {rep * 1e3:.1f} ms "
                  f"(collectives {rows['replicated'][1]}), sharded_adamw {sh * 1e3:.1f} ms (collectives "
                  f"{rows['sharded_adamw'][1]}), ratio {sh / rep:.2f}", flush=True)


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]] or [352, 1400]
    run_ranks(tempfile.mkdtemp(), 2, worker, sizes)
