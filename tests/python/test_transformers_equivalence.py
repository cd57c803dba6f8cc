"""A transformers LlamaForCausalLM with grouped-query attention (4 query heads, 2 key/value heads), float64,
trained 8 steps by dmuon (real Gloo groups, spawned processes) in four layouts -- FSDP2 + Z3 on 2 ranks,
replicate + Z2 on 2, the DDP path on 2, FSDP2 HSDP 2x2 on 4 -- equals the same model trained in one process by a pure-PyTorch Muon +
AdamW written here from the documented update rule (not by dmuon), within 1e-10, under an lr schedule.

Precision note: transformers' LlamaRMSNorm normalises in float32 whatever the model's dtype, so the
activations and the gradients flowing back through each norm carry float32 roundings. Both runs make the
same ones (identical inputs row by row) only when the per-rank loss scale 1/(tokens per rank) differs from
the one-process 1/(tokens) by a power of two (exact in floating point): hence 2 and 4 ranks. On 3 ranks the
two runs differ by float32 rounding (measured 1.5e-7 on the embedding), not by anything dmuon does; the
plain-PyTorch Net of test_dedicate.py covers 3 ranks at 1e-10."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon_testing import reference_ns, run_ranks

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB = 8, 12, 12, 32
LR, ADAMW_LR, WD, ADAMW_WD, MOMENTUM = 0.03, 0.01, 0.01, 0.02, 0.9


def make_llama():
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).to(torch.float64)


def is_muon(name, p):
    return p.dim() == 2 and "embed" not in name and "lm_head" not in name


def schedule(step):
    return 1.0 / (1 + 0.5 * step)


def tokens(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def reference_train():
    """One process: Nesterov Muon (buf = mu*buf + g, u = g + mu*buf, W *= 1 - lr*wd, W -= lr * 0.2 *
    sqrt(max(rows, cols)) * NS(u), float64 direct NS with Polar Express) on the hidden matrices, AdamW
    (0.9 / 0.999, eps 1e-8, decoupled weight decay, bias-corrected) on embeddings, norms and the head."""
    model = make_llama()
    buf, m1, m2 = {}, {}, {}
    for step in range(STEPS):
        model.zero_grad()
        loss_of(model, tokens(step)).backward()
        f = schedule(step)
        with torch.no_grad():
            for name, p in model.named_parameters():
                g = p.grad
                if is_muon(name, p):
                    lr = LR * f
                    buf[name] = buf.get(name, torch.zeros_like(g)) * MOMENTUM + g
                    u = g + MOMENTUM * buf[name]
                    p.mul_(1 - lr * WD)
                    p.sub_(reference_ns(u, dmuon.POLAR_EXPRESS_COEFFICIENTS) * (lr * 0.2 * max(p.shape) ** 0.5))
                else:
                    lr = ADAMW_LR * f
                    m1[name] = m1.get(name, torch.zeros_like(g)) * 0.9 + 0.1 * g
                    m2[name] = m2.get(name, torch.zeros_like(g)) * 0.999 + 0.001 * g * g
                    p.mul_(1 - lr * ADAMW_WD)
                    bc1, bc2 = 1 - 0.9 ** (step + 1), 1 - 0.999 ** (step + 1)
                    p.sub_(lr / bc1 * m1[name] / ((m2[name] / bc2).sqrt() + 1e-8))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank, world, layout, out_path):
    model = make_llama()
    hsdp = layout == "fsdp2-hsdp"
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else \
        init_device_mesh("cpu", (world,))
    if layout == "ddp":
        owners = dmuon.dedicate_params_ddp(model, mesh, is_muon)
    else:
        owners = dmuon.dedicate_params(model, mesh, is_muon, reshard_after_forward=layout != "z2")
    assert len(owners) == 7 * 2  # q, k, v, o, gate, up, down per layer
    assert tuple(model.model.layers[0].self_attn.k_proj.weight.shape) in ((8, 16), (0,))  # GQA: 2 heads of 4
    if layout.startswith("fsdp2"):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        dmuon.replicate(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=LR, adamw_lr=ADAMW_LR, weight_decay=WD, adamw_weight_decay=ADAMW_WD,
                     momentum=MOMENTUM, first_step_progress_log=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    per = BATCH // world
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, tokens(step)[rank * per:(rank + 1) * per]).backward()
        opt.step()
        sched.step()
    sd = dmuon.get_model_state_dict(model)
    if rank == 0:
        torch.save(sd, out_path)


@pytest.mark.parametrize("layout,world", [("fsdp2-z3", 2), ("z2", 2), ("ddp", 2), ("fsdp2-hsdp", 4)])
def test_llama_gqa_trains_like_one_process(tmp_path, layout, world):
    path = tmp_path / "llama.pt"
    run_ranks(tmp_path, world, _train, layout, str(path))
    got = torch.load(path)
    ref = reference_train()
    init = dict(make_llama().named_parameters())
    assert set(got) == set(ref)
    for name, value in ref.items():
        err = float((got[name] - value).abs().max() / value.abs().max())
        assert err < 1e-10, f"{layout}: {name} differs from the one-process reference by {err}"
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert float((ref[name] - init[name].detach()).abs().max()) > 1e-4, name  # every kind of parameter moved
