"""Python's side of dmuon's interop tests (tests/interop_test.cpp runs it): transformers and
safetensors from PyPI read what dmuon wrote and write what dmuon reads.

  interop.py check-logits DIR     transformers' model of DIR/config.json with dmuon's weights
                                  (DIR/weights.safetensors) gives dmuon's logits (DIR/logits.safetensors)
  interop.py write-reference DIR  transformers' own random init, its logits: DIR/py_weights.safetensors,
                                  DIR/py_logits.safetensors (tokens from DIR/logits.safetensors)
  interop.py checkpoint DIR       reads dmuon's DIR/ck.safetensors (values in closed form), writes
                                  DIR/py_ck.safetensors in dmuon's checkpoint layout
Exits non-zero with a message when a value differs.
"""
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


# transformers' eager path computes RMSNorm, softmax and the rotary tables in float32 even for a
# float64 model, so the two agree to float32 rounding: measured worst 1.03e-7 relative (llama,
# mistral, qwen2, qwen3; 2026-12-01, transformers 5.24); bound 2e-6, 19x above it. A wrong formula
# (rotation layout, GQA mapping, bias, norm placement, mask) differs by 1e-2 or more.
BOUND = 2e-6


def model_of(d):
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(d)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return m.to(torch.float64).eval(), cfg


def logits_of(m, tokens):
    with torch.no_grad():
        return m(input_ids=tokens).logits


def check_logits(d):
    m, cfg = model_of(d)
    sd = load_file(f"{d}/weights.safetensors")
    missing, unexpected = m.load_state_dict(sd, strict=False)
    allowed = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        sys.exit(f"names differ from transformers': missing {missing}, unexpected {unexpected}")
    ref = load_file(f"{d}/logits.safetensors")
    got = logits_of(m, ref["tokens"])
    err = ((got - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    print(f"{cfg.model_type}: max |transformers - dmuon| / max |logits| = {err:.3e}")
    if not err < BOUND:
        sys.exit(f"{cfg.model_type}: logits differ by {err}")


def write_reference(d):
    torch.manual_seed(11)
    m, cfg = model_of(d)
    tokens = load_file(f"{d}/logits.safetensors")["tokens"]
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, f"{d}/py_weights.safetensors", metadata={"format": "pt"})
    save_file({"tokens": tokens, "logits": logits_of(m, tokens)}, f"{d}/py_logits.safetensors")


def checkpoint(d):
    path = f"{d}/ck.safetensors"
    t = load_file(path)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    if meta.get("format") != "dmuon-checkpoint-safetensors-v1":
        sys.exit(f"format tag: {meta.get('format')}")
    w = t["model/layers.0.w"]
    if w.dtype != torch.float32 or not torch.equal(w, torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8):
        sys.exit(f"model/layers.0.w: {w}")
    if not torch.equal(t["optim_muon/layers.0.w.momentum_buffer"], torch.full((3, 4), 0.25)):
        sys.exit("momentum buffer")
    if t["optim_muon/layers.0.w.step"].item() != 9 or t["optim_muon/layers.0.w.step"].dtype != torch.int64:
        sys.exit("step")
    opt = json.loads(meta["optimizer"])
    if opt["steps_taken"] != 9 or opt["param_groups"][0]["lr"] != 0.02 or opt["param_groups"][1]["eps"] != 1e-8:
        sys.exit(f"optimizer metadata: {opt}")
    # Python's own checkpoint in the same layout (no crc32c: dmuon checks the structure)
    out = {
        "model/layers.0.w": torch.arange(12, dtype=torch.float64).reshape(3, 4) * 3,
        "model/norm.weight": torch.full((4,), -1.5, dtype=torch.float32),
        "optim_muon/layers.0.w.momentum_buffer": torch.ones(3, 4, dtype=torch.float64),
        "optim_muon/layers.0.w.step": torch.tensor(4, dtype=torch.int64),
        "optim_adamw/norm.weight.exp_avg": torch.zeros(4),
        "optim_adamw/norm.weight.exp_avg_sq": torch.full((4,), 2.0),
        "optim_adamw/norm.weight.step": torch.tensor(4, dtype=torch.int64),
    }
    opt["steps_taken"] = 4
    save_file(out, f"{d}/py_ck.safetensors",
              metadata={"format": "dmuon-checkpoint-safetensors-v1", "optimizer": json.dumps(opt)})
    print("checkpoint: Python read dmuon's values and wrote its own")


if __name__ == "__main__":
    {"check-logits": check_logits, "write-reference": write_reference, "checkpoint": checkpoint}[sys.argv[1]](sys.argv[2])
