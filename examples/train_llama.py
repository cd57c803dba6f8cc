"""Train a small transformers Llama (or Qwen2) with FSDP2 + dmuon's Muon (Z3), the API reference's order:
dedicate_params, then fully_shard per decoder layer and the root. On CPU ranks (Gloo) or one GPU per rank
(NCCL). Byte-level tokens of a text file (Debian's fortunes by default).

    torchrun --nproc-per-node 4 examples/train_llama.py --steps 200 --out /tmp/llama-dmuon

The end: dmuon.get_model_state_dict (the single-process model's names and shapes) saved as
<out>/model.safetensors next to config.json, which transformers' from_pretrained loads.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon

TEXT = "/usr/share/games/fortunes/fortunes"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("llama", "qwen2"), default="llama")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02, help="Muon's learning rate (matrices)")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW's (embeddings, norms, head)")
    p.add_argument("--text", default=TEXT, help="training text (bytes are the tokens)")
    p.add_argument("--out", default=None, help="directory for config.json + model.safetensors")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--optimizer", choices=("dmuon", "adamw"), default="dmuon",
                   help="dmuon: dedicate_params + FSDP2 + dmuon.Muon; adamw: the same model on FSDP2 with "
                        "torch.optim.AdamW at --adamw-lr (the usual baseline)")
    return p.parse_args()


def config(args):
    common = dict(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=args.seq, tie_word_embeddings=False)
    if args.model == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same initial model on every rank
    cfg = config(args)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device)
    owners = {}
    if args.optimizer == "dmuon":
        # Muon for the hidden matrices; embeddings, norms and the head train with AdamW on FSDP2's shards
        owners = dmuon.dedicate_params(
            model, mesh, predicate=lambda name, p: p.dim() == 2 and "embed" not in name and "lm_head" not in name)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.optimizer == "dmuon":
        opt = dmuon.Muon(model, lr=args.lr, adamw_lr=args.adamw_lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))  # 10 warm-up steps

    with open(args.text, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    if rank == 0:
        print(f"{args.model}: {sum(p.numel() for p in model.parameters())} parameters, {len(owners)} Muon matrices "
              f"on {world} ranks ({device.type}), {len(data)} bytes of text", flush=True)

    losses, step_s, t0 = [], [], time.time()
    for step in range(args.steps):
        ts = time.perf_counter()
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.seq] for s in starts]).to(device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - ts)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            tokens = (step + 1) * args.batch * args.seq * world
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {tokens / (time.time() - t0):,.0f} tokens/s", flush=True)

    if args.optimizer == "dmuon":
        state = dmuon.get_model_state_dict(model)  # collective: full tensors on rank 0
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        k = max(1, len(losses) // 5)
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"loss {first:.4f} -> {last:.4f} (mean of the first and last {k} steps)", flush=True)
        warm = step_s[min(3, len(step_s) - 1):]  # the first steps pay one-time work (allocations, first NS)
        print(f"step time {sorted(warm)[len(warm) // 2] * 1e3:.1f} ms (median of {len(warm)} steps, rank 0)", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            cfg.save_pretrained(args.out)
            save_file({n: t.contiguous() for n, t in state.items()}, os.path.join(args.out, "model.safetensors"),
                      metadata={"format": "pt"})
            print(f"saved {args.out}/model.safetensors ({len(state)} tensors)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if device.type == "cpu":
        # On CPU, end without the interpreter's shutdown. FSDP2's module state is not freed before it (its
        # hooks hold the model), so torch's Gloo worker threads are still alive then, and one that releases
        # a finished collective's Python-owned tensors after the interpreter began finalising aborts the
        # process (std::terminate, SIGABRT) after a complete run. Seen about once in 15 runs on 2 cores.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
