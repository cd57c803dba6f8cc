"""The Python example's step time against the same model on FSDP2 + torch.optim.AdamW, in one run:
examples/train_llama.py under torchrun (4 CPU ranks, Gloo by default), --optimizer adamw then dmuon,
same model, data and steps, each reporting rank 0's median step time (forward, backward, optimizer step,
zero_grad) after 3 warm-up steps. Prints both and the ratio. A measurement, not a test.

  PYTHONPATH=<build>/python python bench/python_example_bench.py [--ranks 4] [--steps 20] [--hidden 256]
"""

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(optimizer, args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           os.path.join(ROOT, "examples", "train_llama.py"), "--optimizer", optimizer, "--steps", str(args.steps),
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--batch", str(args.batch), "--seq",
           str(args.seq), "--log-every", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"{optimizer} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    ms = float(re.search(r"step time ([0-9.]+) ms", out.stdout).group(1))
    loss = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", out.stdout).groups()
    return ms, loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    args = ap.parse_args()
    adamw_ms, adamw_loss = run("adamw", args)
    dmuon_ms, dmuon_loss = run("dmuon", args)
    print(f"examples/train_llama.py, {args.ranks} ranks, hidden {args.hidden}, {args.layers} layers, batch {args.batch}"
          f" x seq {args.seq} per rank, {args.steps} steps (median after 3 warm-up steps, rank 0)")
    print(f"  FSDP2 + torch.optim.AdamW   {adamw_ms:8.1f} ms/step   1.00x   loss {adamw_loss[0]} -> {adamw_loss[1]}")
    print(f"  FSDP2 + dmuon Muon (Z3)     {dmuon_ms:8.1f} ms/step   {dmuon_ms / adamw_ms:.2f}x   loss {dmuon_loss[0]} -> "
          f"{dmuon_loss[1]}")


if __name__ == "__main__":
    main()
