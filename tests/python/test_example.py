"""examples/train_llama.py as a user runs it: torchrun on 4 CPU ranks, FSDP2 + dmuon Z3 on a transformers
Llama and Qwen2; the loss falls and the saved safetensors load with transformers' from_pretrained."""

import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = "/usr/share/games/fortunes/fortunes"


@pytest.mark.skipif(not os.path.exists(TEXT), reason="Debian's fortunes-min is not installed")
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_example_trains_and_saves_for_from_pretrained(tmp_path, model):
    import transformers

    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(ROOT, "examples", "train_llama.py"), "--model", model, "--steps", "12", "--log-every", "4",
           "--out", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"step +11 +loss", run.stdout), run.stdout  # the progress line
    first, last = map(float, re.search(r"loss ([0-9.]+) -> ([0-9.]+)", run.stdout).groups())
    assert last < first - 0.5, run.stdout  # byte-level text from ~ln(256) = 5.5: the loss falls
    saved = load_file(out / "model.safetensors")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    plain = loaded.state_dict()
    assert set(saved) == set(plain)  # the single-process model's names
    for name, value in saved.items():
        assert torch.equal(plain[name], value), name
