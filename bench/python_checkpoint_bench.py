"""What full state dicts and dedicate_params cost for a model of many small parameters, on 2 ranks against 1,
measured in one run (CPU, Gloo, ranks spawned here): N 16x16 Muon matrices and N/2 1-D scales on sharded_adamw
in 8 blocks, one training step taken. Prints, per world size, the best-of-3 time of
get_model_state_dict + get_optimizer_state_dict (every rank calls them; rank 0 keeps the dicts), the time of
dedicate_params, and the collectives the checkpoint issued (broadcasts and all-gathers, by
dmuon.comm_calls), then the ratios 2 ranks / 1 rank.

The checkpoint sends each owner's matrices (and their momentum) in one broadcast and the sharded slices in one
all-gather per dtype, in packs of at most 64 MiB; dedicate_params sends sharded_adamw's initial values packed
the same way (before: one collective per tensor, 1600 matrices took 1.2 s on 2 ranks). Usage:
  PYTHONPATH=<build>/python:tests/python OMP_NUM_THREADS=1 python bench/python_checkpoint_bench.py [N ...]
N: matrices in all (default 1600).
"""

import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import dmuon
from dmuon_testing import run_ranks

D = 16


class Block(nn.Module):
    def __init__(self, mats):
        super().__init__()
        self.mats = nn.ParameterList(nn.Parameter(torch.randn(D, D) * 0.25) for _ in range(mats))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(D)) for _ in range(max(1, mats // 2)))

    def forward(self, x):
        for w, s in zip(self.mats, list(self.scales) * 2):
            x = torch.tanh(x @ w) * s
        return x


def collectives(counts):
    return {k: v for k, v in counts.items() if k in ("broadcast", "all_gather") and v}


def worker(rank, world, sizes, out):
    torch.set_num_threads(1)
    x = torch.randn(8, D)
    for n in sizes:
        torch.manual_seed(0)
        model = nn.Sequential(*(Block(n // 8) for _ in range(8)))
        dist.barrier()
        t = time.perf_counter()
        dmuon.dedicate_params(model, dist.group.WORLD, lambda name, p: p.dim() == 2,
                              route_hint_fn=lambda name, p: "sharded_adamw" if p.dim() == 1 else "")
        dmuon.replicate(model)
        dist.barrier()
        setup = time.perf_counter() - t
        opt = dmuon.Muon(model, lr=0.01, adamw_lr=0.001, first_step_progress_log=False)
        model(x).square().mean().backward()
        opt.step()
        best, calls = float("inf"), None
        for _ in range(3):
            before = dmuon.comm_calls(model)
            dist.barrier()
            t = time.perf_counter()
            dmuon.get_model_state_dict(model)
            dmuon.get_optimizer_state_dict(model, opt)
            dist.barrier()
            best = min(best, time.perf_counter() - t)
            after = dmuon.comm_calls(model)
            calls = {k: after[k] - before.get(k, 0) for k in after}
        if rank == 0:
            out.put((world, n, best, setup, collectives(calls)))


def main():
    sizes = [int(a) for a in sys.argv[1:]] or [1600]
    ctx = torch.multiprocessing.get_context("spawn")
    rows = {}
    for world in (1, 2):
        q = ctx.Manager().Queue()
        run_ranks(tempfile.mkdtemp(), world, worker, sizes, q)
        while not q.empty():
            w, n, ck, setup, calls = q.get()
            rows[(w, n)] = (ck, setup)
            print(f"N={n} on {w} rank(s): checkpoint {ck * 1e3:.1f} ms (collectives {calls}), "
                  f"dedicate_params {setup * 1e3:.1f} ms", flush=True)
    for n in sizes:
        (c1, s1), (c2, s2) = rows[(1, n)], rows[(2, n)]
        print(f"N={n}: 2 ranks / 1 rank: checkpoint {c2 / c1:.2f}x, dedicate_params {s2 / s1:.2f}x")


if __name__ == "__main__":
    main()
