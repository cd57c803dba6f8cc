"""The numbers Python users compare: one transformers Llama, the same data and steps on N ranks (Gloo on CPU,
one process per rank), trained by what people run today and by dmuon, in one run of this program:

  1. FSDP2 + torch.optim.AdamW                      (the baseline every ratio is against)
  2. FSDP2 + dmuon.Muon, Z3 and Z2                  (dedicated ownership; dmuon's own NS, Gram form)
  3. DDP + torch.optim.Muon (+ AdamW for the rest)  (every rank runs Newton-Schulz on every matrix)
  4. FSDP2 + a gather-then-NS Muon                  (each rank all-gathers every matrix's momentum, runs NS on
                                                     its share, scatters the updates back to the shards); once
                                                     with torch.optim.Muon's NS, once with dmuon's (the design
                                                     alone against rows 2, the kernel the same)
  5. dmuon's C++ `dmuon train --hf-config` on the same config, Z3 and Z2 (the cost of Python itself)

Rows 3 and 4 use torch.optim.Muon's Newton-Schulz (bf16, 5 steps of (3.4445, -4.775, 2.0315)); rows 2 and 5
dmuon's default (Gram NS, Polar Express, in the parameters' dtype). Every Muon row applies lr * 0.2 *
sqrt(max(rows, cols)) (torch's adjust_lr_fn="match_rms_adamw").

Per row: the step time (forward, backward, optimizer step, zero_grad; each step's slowest rank; median of the
measured steps after the warm-up), the bytes per step and rank on the loopback interface (the wire: Gloo's
payloads plus TCP/IP headers, every process on this machine included, so run it on a quiet box), dmuon's
own counted payload bytes where dmuon runs, and the peak live tensor bytes per rank (dmuon's counting CPU
allocator, installed in every row before the model is built, the instrument `dmuon train` reports; BLAS
scratch and Gloo buffers are not tensors and are not counted). Then a one-step cross-check: dmuon.Muon
configured like torch.optim.Muon (direct NS with its coefficients, its "match_rms_adamw" lr adjustment) against
torch.optim.Muon on one matrix, within the bf16 error torch.optim.Muon itself has (its NS in bf16 against the
same iteration in float32).

A measurement, not a test. It takes minutes: every row builds the model on every rank.

  PYTHONPATH=<build>/python python bench/python_compare_bench.py --cpp <build>/apps/dmuon [--ranks 4]
      [--hidden 512 --layers 8 --batch 4 --seq 128 --warmup 2 --steps 10] [--json out.json]
"""

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TEXT = "/usr/share/games/fortunes/fortunes"
LO = "/sys/class/net/lo/statistics/tx_bytes"
# torch.optim.Muon's defaults (torch/optim/_muon.py): Keller Jordan's quintic, 5 steps, eps 1e-7
KELLER = (3.4445, -4.7750, 2.0315)
MUON_LR, ADAMW_LR, MOMENTUM, ADAMW_WD = 0.02, 3e-3, 0.95, 0.01

ROWS = [
    ("fsdp2_adamw", "FSDP2 + torch.optim.AdamW"),
    ("dmuon_z3", "FSDP2 + dmuon.Muon Z3"),
    ("dmuon_z2", "FSDP2 + dmuon.Muon Z2"),
    ("ddp_torch_muon", "DDP + torch.optim.Muon"),
    ("fsdp2_gather_ns", "FSDP2 + gather-then-NS Muon"),
    ("fsdp2_gather_dmuon_ns", "  the same, dmuon's NS kernel"),
]


def llama_config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.ffn or 2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, tie_word_embeddings=False)


def is_matrix(name, p):
    """The Muon matrices: every 2-D weight but the embedding and the head (as in the C++ train)."""
    return p.dim() == 2 and "embed" not in name and "lm_head" not in name


def lo_bytes():
    try:
        with open(LO) as f:
            return int(f.read())
    except OSError:
        return None


class GatherNSMuon:
    """Muon on FSDP2's row shards the way dedicated ownership replaces: every rank keeps its shard of the
    momentum, all-gathers each matrix's Nesterov input, runs Newton-Schulz on matrix i when i % world == rank,
    and scatters the update's row blocks back to the shards. torch.optim.Muon's NS and update rule."""

    def __init__(self, params, lr, momentum=MOMENTUM, dmuon_ns=False):
        from torch.optim._muon import _zeropower_via_newtonschulz

        import dmuon

        self.params, self.lr, self.momentum = list(params), lr, momentum
        if dmuon_ns:  # dmuon's default: Gram NS, Polar Express, in the momentum's dtype (float32 here)
            self.ns = lambda u: dmuon.newton_schulz(u)
        else:  # torch.optim.Muon's: direct NS in bf16, Keller Jordan's coefficients
            self.ns = lambda u: _zeropower_via_newtonschulz(u, KELLER, 5, 1e-7)
        self.buf = [torch.zeros_like(p.to_local()) for p in self.params]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        for p in self.params:
            if p.shape[0] % self.world:
                raise ValueError(f"gather-then-NS: {tuple(p.shape)} rows are not divisible by {self.world} ranks")

    @torch.no_grad()
    def step(self):
        full, works = [], []
        for p, buf in zip(self.params, self.buf):
            g = p.grad.to_local()
            buf.lerp_(g, 1 - self.momentum)
            u = g.lerp(buf, self.momentum)
            out = torch.empty(p.shape, dtype=u.dtype)
            works.append(dist.all_gather_into_tensor(out, u.contiguous(), async_op=True))
            full.append(out)
        scatters, updates = [], []
        for i, (p, out, work) in enumerate(zip(self.params, full, works)):
            work.wait()
            owner = i % self.world
            mine = torch.empty_like(p.to_local())
            chunks = None
            if owner == self.rank:
                chunks = list(self.ns(out).to(out.dtype).chunk(self.world))
            scatters.append(dist.scatter(mine, chunks, src=owner, async_op=True))
            updates.append(mine)
        for p, mine, work in zip(self.params, updates, scatters):
            work.wait()
            p.to_local().add_(mine, alpha=-self.lr * 0.2 * math.sqrt(max(p.shape)))

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def build(row, model, mesh):
    """The row's wrapped model and its optimizers (each is stepped and zeroed every step)."""
    from torch.distributed.fsdp import fully_shard

    import dmuon

    if row.startswith("dmuon"):
        z2 = row == "dmuon_z2"
        dmuon.dedicate_params(model, mesh, predicate=is_matrix, reshard_after_forward=not z2)
    if row == "ddp_torch_muon":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        named = list(model.named_parameters())
        muon = torch.optim.Muon([p for n, p in named if is_matrix(n, p)], lr=MUON_LR, momentum=MOMENTUM,
                                weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW([p for n, p in named if not is_matrix(n, p)], lr=ADAMW_LR, weight_decay=ADAMW_WD)
        return wrapped, [muon, adamw]
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=row != "dmuon_z2")
    fully_shard(model, mesh=mesh, reshard_after_forward=row != "dmuon_z2")
    if row.startswith("dmuon"):
        return model, [dmuon.Muon(model, lr=MUON_LR, momentum=MOMENTUM, adamw_lr=ADAMW_LR,
                                  adamw_weight_decay=ADAMW_WD, first_step_progress_log=False)]
    if row == "fsdp2_adamw":
        return model, [torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, weight_decay=ADAMW_WD)]
    named = list(model.named_parameters())
    return model, [GatherNSMuon([p for n, p in named if is_matrix(n, p)], lr=MUON_LR,
                                dmuon_ns=row == "fsdp2_gather_dmuon_ns"),
                   torch.optim.AdamW([p for n, p in named if not is_matrix(n, p)], lr=ADAMW_LR,
                                     weight_decay=ADAMW_WD)]


def batches(args, rank, n):
    with open(args.text, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches, the same in every row
    out = []
    for _ in range(n):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        out.append(torch.stack([data[s:s + args.seq] for s in starts]))
    return out


def worker(rank, world, port, row, args, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    dmuon.install_counting_allocator()  # before the model: every row's tensors are counted the same way
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(llama_config(args))
    n_params = sum(p.numel() for p in model.parameters())
    wrapped, opts = build(row, model, mesh)
    data = batches(args, rank, args.warmup + args.steps)
    times, losses, lo0, counted0 = [], [], None, None
    for step, x in enumerate(data):
        if step == args.warmup:  # the measured window starts with every rank here
            dist.barrier()
            dmuon.reset_tensor_memory_peaks()
            lo0 = lo_bytes()
            counted0 = dmuon.comm_bytes(model) if row.startswith("dmuon") else None
        t = time.perf_counter()
        loss = wrapped(input_ids=x, labels=x).loss
        loss.backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    peak = dmuon.tensor_memory_stats()["peak"]
    dist.barrier()
    lo1 = lo_bytes()
    counted = None
    if counted0 is not None:
        after = dmuon.comm_bytes(model)
        counted = sum(after[k] - counted0[k] for k in after) / args.steps
    # each step's slowest rank; the peak, the counted bytes and the losses of every rank
    step_s = torch.tensor(times[args.warmup:], dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    per_rank = torch.tensor([[peak, counted or 0.0, losses[0], losses[-1]]], dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    if rank == 0:
        g = torch.cat(gathered)
        wire = (lo1 - lo0) / args.steps / world if lo0 is not None and lo1 is not None else None
        with open(result_path, "w") as f:
            json.dump({"params": n_params, "step_ms": statistics.median(step_s.tolist()) * 1e3, "peak_bytes": g[:, 0].max().item(),
                       "counted_bytes": g[:, 1].mean().item() if counted is not None else None,
                       "wire_bytes": wire, "loss_first": g[:, 2].mean().item(), "loss_last": g[:, 3].mean().item()}, f)
    if row == ROWS[0][0] and args.crosscheck:
        crosscheck(rank, mesh, result_path + ".crosscheck")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past torch's Gloo exit race (see tests/python/dmuon_testing.py)


def crosscheck(rank, mesh, path, rows=256, cols=128, steps=3):
    """dmuon.Muon with torch.optim.Muon's settings against torch.optim.Muon, `steps` steps on one matrix (the
    same gradient on every rank, so the averaged gradient is that gradient)."""
    from torch import nn

    import dmuon

    lr, wd = 0.02, 0.1
    torch.manual_seed(5)
    w0 = torch.randn(rows, cols) / math.sqrt(cols)
    grads = [torch.randn(rows, cols) for _ in range(steps)]

    ours = nn.Sequential(nn.Linear(cols, rows, bias=False))
    with torch.no_grad():
        ours[0].weight.copy_(w0)
    dmuon.dedicate_params(ours, mesh, predicate=lambda n, p: True)
    ns = dmuon.NewtonSchulz("direct", coefficients=[list(KELLER)] * 5)
    opt = dmuon.Muon(ours, lr=lr, momentum=MOMENTUM, weight_decay=wd, ns_backend=ns, nesterov=True,
                     first_step_progress_log=False)

    ref = nn.Parameter(w0.clone())
    topt = torch.optim.Muon([ref], lr=lr, momentum=MOMENTUM, weight_decay=wd, nesterov=True,
                            ns_coefficients=KELLER, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    fp32 = w0.clone()  # torch.optim.Muon's update rule with its NS iteration in float32
    buf = torch.zeros_like(w0)
    for g in grads:
        x = torch.eye(cols)  # d(sum(W x * G^T x... )): a loss whose gradient w.r.t. W is exactly g
        loss = (ours(x) * g.T).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.grad = g.clone()
        topt.step()
        buf.lerp_(g, 1 - MOMENTUM)
        u = g.lerp(buf, MOMENTUM).T  # rows > cols: torch orthogonalises the transpose
        u = u / u.norm().clamp(min=1e-7)
        for _ in range(5):
            gram = u @ u.T
            u = KELLER[0] * u + (KELLER[1] * gram + KELLER[2] * gram @ gram) @ u
        fp32.mul_(1 - lr * wd).add_(u.T, alpha=-lr * 0.2 * math.sqrt(max(rows, cols)))
    full = dmuon.get_model_state_dict(ours, rank0_only=False)["0.weight"]
    if rank != 0:
        return
    step_size = (fp32 - w0).norm().item()
    result = {"shape": [rows, cols], "steps": steps,
              "dmuon_vs_torch": (full - ref.detach()).norm().item() / step_size,
              "torch_bf16_vs_fp32": (ref.detach() - fp32).norm().item() / step_size,
              "dmuon_vs_fp32": (full - fp32).norm().item() / step_size}
    with open(path, "w") as f:
        json.dump(result, f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python_row(row, args, tmp):
    path = os.path.join(tmp, f"{row}.json")
    mp.spawn(worker, args=(args.ranks, free_port(), row, args, path), nprocs=args.ranks, join=True)
    with open(path) as f:
        return json.load(f)


def run_cpp(mode, steps, args, tmp):
    """`dmuon train` for `steps` steps; its output directory and the loopback bytes of the whole run."""
    cfg_dir = os.path.join(tmp, "hf")
    if not os.path.exists(cfg_dir):
        llama_config(args).save_pretrained(cfg_dir)
    out = os.path.join(tmp, f"cpp_{mode}_{steps}")
    cmd = [args.cpp, "train", "--hf-config", os.path.join(cfg_dir, "config.json"), "--ranks", str(args.ranks),
           "--steps", str(steps), "--batch", str(args.batch * args.ranks), "--seq-len", str(args.seq), "--mode", mode,
           "--optimizer", "dmuon", "--lr", str(MUON_LR), "--adamw-lr", str(ADAMW_LR), "--data", args.text,
           "--log-every", "1", "--eval-every", "0", "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    lo0 = lo_bytes()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lo1 = lo_bytes()
    if proc.returncode != 0:
        sys.exit(f"dmuon train ({mode}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return out, (lo1 - lo0 if lo0 is not None and lo1 is not None else None)


def run_cpp_row(mode, args, tmp):
    """Row 5: the C++ CLI on the same config, batch and steps. Its wire bytes per step are the difference
    between this run and one of only the warm-up steps (the same setup traffic), over the measured steps."""
    out, wire_all = run_cpp(mode, args.warmup + args.steps, args, tmp)
    _, wire_setup = run_cpp(mode, args.warmup, args, tmp)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "metrics.csv")) as f:
        head, *lines = [line.strip().split(",") for line in f if line.strip()]
    col = {k: i for i, k in enumerate(head)}
    step_ms = [float(r[col["step_ms"]]) for r in lines][args.warmup:]
    loss = [float(r[col["loss"]]) for r in lines]
    wire = None
    if wire_all is not None and wire_setup is not None:
        wire = (wire_all - wire_setup) / args.steps / args.ranks
    return {"step_ms": statistics.median(step_ms), "peak_bytes": max(summary["peak_memory_bytes"]),
            "counted_bytes": summary["bytes_per_step"]["measured_mean_per_rank"], "wire_bytes": wire,
            "loss_first": loss[0], "loss_last": loss[-1]}


def mb(x):
    return "-" if x is None else f"{x / 1e6:8.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=0, help="MLP width (default 2 x hidden)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="measured steps (the median is reported)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--text", default=TEXT, help="training text (bytes are the tokens)")
    ap.add_argument("--cpp", default=None, help="the C++ CLI (build/apps/dmuon) for row 5; left out without it")
    ap.add_argument("--rows", default=",".join(r for r, _ in ROWS), help="a subset of the Python rows")
    ap.add_argument("--no-crosscheck", dest="crosscheck", action="store_false")
    ap.add_argument("--json", default=None, help="also write every row's numbers here")
    args = ap.parse_args()

    rows = [r for r in ROWS if r[0] in args.rows.split(",")]
    if not rows or rows[0][0] != "fsdp2_adamw":
        sys.exit("--rows must start with fsdp2_adamw (every ratio is against it)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row, label in rows:
            t = time.time()
            results[row] = run_python_row(row, args, tmp)
            print(f"[{label}: {time.time() - t:.0f} s]", file=sys.stderr, flush=True)
        cross_path = os.path.join(tmp, "fsdp2_adamw.json.crosscheck")
        cross = json.load(open(cross_path)) if os.path.exists(cross_path) else None
        if args.cpp:
            for mode in ("z3", "z2"):
                t = time.time()
                results[f"cpp_{mode}"] = run_cpp_row(mode, args, tmp)
                rows.append((f"cpp_{mode}", f"C++ dmuon train {mode.upper()}"))
                print(f"[C++ {mode}: {time.time() - t:.0f} s]", file=sys.stderr, flush=True)

    cfg = llama_config(args)
    n_params = results["fsdp2_adamw"]["params"]
    print(f"transformers Llama: hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, vocab 256, {n_params / 1e6:.1f} M "
          f"parameters, float32; {args.ranks} ranks (Gloo, {args.threads} thread(s) each, {os.cpu_count()} cores); "
          f"{args.batch} x {args.seq} tokens per rank and step; median of {args.steps} steps after {args.warmup} "
          f"warm-up")
    base = results["fsdp2_adamw"]
    print(f"{'':32} {'ms/step':>9} {'ratio':>6} {'wire MB/step/rank':>18} {'ratio':>6} {'dmuon-counted MB':>17} "
          f"{'peak MB/rank':>13} {'ratio':>6}   loss first -> last")
    for row, label in rows:
        r = results[row]
        wire_ratio = (f"{r['wire_bytes'] / base['wire_bytes']:6.2f}"
                      if r["wire_bytes"] is not None and base["wire_bytes"] else "     -")
        print(f"{label:32} {r['step_ms']:9.1f} {r['step_ms'] / base['step_ms']:6.2f} {mb(r['wire_bytes']):>18} "
              f"{wire_ratio} {mb(r['counted_bytes']):>17} {mb(r['peak_bytes']):>13} "
              f"{r['peak_bytes'] / base['peak_bytes']:6.2f}   {r['loss_first']:.3f} -> {r['loss_last']:.3f}"
              )
    if cross:
        ok = cross["dmuon_vs_torch"] <= 1.5 * cross["torch_bf16_vs_fp32"] and cross["dmuon_vs_fp32"] < 1e-4
        print(f"cross-check, {cross['steps']} steps on one {cross['shape'][0]}x{cross['shape'][1]} matrix, "
              f"dmuon.Muon(direct NS, Keller coefficients) vs torch.optim.Muon(adjust_lr_fn='match_rms_adamw'), "
              f"|W difference| / |W update|: dmuon vs torch {cross['dmuon_vs_torch']:.2e}; torch's own bf16 error "
              f"(vs its iteration in float32) {cross['torch_bf16_vs_fp32']:.2e}; dmuon vs that float32 iteration "
              f"{cross['dmuon_vs_fp32']:.2e}: {'agree' if ok else 'DISAGREE'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "crosscheck": cross}, f, indent=1)


if __name__ == "__main__":
    main()
