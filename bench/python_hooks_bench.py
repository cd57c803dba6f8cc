"""What `import dmuon`'s forward hooks cost per boundary, measured in one run (CPU, one rank: no
collective runs, so what is left is bookkeeping):

  plain   the model without dmuon
  noop    the same module hooks dmuon registers (forward pre-hook with kwargs, forward hook with
          always_call), doing nothing: the price of Python module hooks alone
  dmuon   dedicate_params (Z3) + replicate: dmuon's hooks entering its C++ boundary scopes, the C++
          runtime's per-boundary work and its backward hooks

Prints the median forward+backward time of each (tiny blocks, so the hooks dominate) and the per-boundary
differences; with --cpp <build>/bench/boundary_bench, also the same model through dmuon's C++ path
(dmuon::forward on a LibTorch module), run in the same invocation, and what the Python front end adds
over it per boundary. Usage:
  PYTHONPATH=<build>/python python bench/python_hooks_bench.py [--blocks 32] [--iters 200] [--cpp PATH]
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Net(nn.Module):
    def __init__(self, blocks, dim):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def median_ms(model, x, iters):
    times = []
    for i in range(iters + 20):
        t = time.perf_counter()
        model(x).sum().backward()
        if i >= 20:  # warm-up
            times.append(time.perf_counter() - t)
        for p in model.parameters():
            p.grad = None
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--cpp", default=None, help="boundary_bench (bench/boundary_bench.cpp) of the same build")
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    import dmuon

    x = torch.randn(4, args.dim)
    torch.manual_seed(0)
    plain = Net(args.blocks, args.dim)
    noop = Net(args.blocks, args.dim)
    for m in [noop] + list(noop.layers):
        m.register_forward_pre_hook(lambda mod, a, k: None, with_kwargs=True)
        m.register_forward_hook(lambda mod, a, k, out: None, with_kwargs=True, always_call=True)
    ded = Net(args.blocks, args.dim)
    dmuon.dedicate_params(ded, dist.group.WORLD, lambda n, p: p.dim() == 2)
    dmuon.replicate(ded)

    t = {}
    for _ in range(3):  # interleaved rounds: the machine's noise hits every variant alike
        for name, model in (("plain", plain), ("noop", noop), ("dmuon", ded)):
            t.setdefault(name, []).append(median_ms(model, x, args.iters))
    ms = {k: min(v) for k, v in t.items()}
    per = lambda a, b: (ms[a] - ms[b]) * 1e3 / args.blocks  # noqa: E731  (microseconds per boundary)
    print(f"{args.blocks} boundaries, forward+backward median (best of 3 rounds), torch {torch.__version__}")
    for k in ("plain", "noop", "dmuon"):
        print(f"  {k:6s} {ms[k]:8.3f} ms   {ms[k] / ms['plain']:.2f}x plain")
    print(f"  Python module hooks alone (noop - plain): {per('noop', 'plain'):.1f} us per boundary")
    print(f"  dmuon in all (dmuon - plain):             {per('dmuon', 'plain'):.1f} us per boundary")
    print(f"  dmuon beyond the hooks (dmuon - noop):    {per('dmuon', 'noop'):.1f} us per boundary")
    if args.cpp:
        run = subprocess.run([args.cpp, "--blocks", str(args.blocks), "--dim", str(args.dim), "--iters", str(args.iters)],
                             capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        cpp = {k: float(v) for k, v in (line.split() for line in run.stdout.splitlines() if not line.startswith("#"))}
        print(f"  C++ path (dmuon::forward): plain {cpp['plain_ms']:.3f} ms, dmuon {cpp['dmuon_ms']:.3f} ms, "
              f"{cpp['per_boundary_us']:.1f} us per boundary")
        print(f"  the Python front end over the C++ path:   {per('dmuon', 'plain') - cpp['per_boundary_us']:.1f} us "
              "per boundary")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
