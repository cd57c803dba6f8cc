#!/usr/bin/env bash
# `torchrun --no-python --nproc-per-node 2 dmuon train ...`: torchrun's elastic agent serves the
# TCPStore (TORCHELASTIC_USE_AGENT_STORE=True), every dmuon rank connects to it as a client, and the
# run trains and reports like `dmuon train --ranks 2`. torchrun comes from the same torch wheel as the
# LibTorch dmuon is built on (the store's wire protocol is the version's).
#   torchrun_test.sh <dmuon binary> <torchrun>
set -euo pipefail
DMUON="$1"
TORCHRUN="$2"
PY="$(dirname "$TORCHRUN")/python"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
if ! timeout -k 10 300 "$TORCHRUN" --no-python --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" \
     "$DMUON" train --steps 6 --batch 4 --seq-len 32 --d-model 32 --layers 2 --heads 2 --eval-every 3 \
     --out "$work/run" --timeout 60 >"$work/log" 2>&1; then
  cat "$work/log"
  echo "FAIL: torchrun did not complete the run" >&2
  exit 1
fi
"$PY" - "$work/run" <<'PYEOF'
import csv, json, sys
d = sys.argv[1]
s = json.load(open(f"{d}/summary.json"))
rows = list(csv.DictReader(open(f"{d}/metrics.csv")))
assert s["world_size"] == 2, s["world_size"]
assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6], [r["step"] for r in rows]
vals = [r["val_loss"] for r in rows if r["val_loss"]]
assert len(vals) == 2, vals
assert float(rows[-1]["loss"]) < float(rows[0]["loss"]), (rows[0]["loss"], rows[-1]["loss"])
print(f"torchrun: 2 ranks, loss {float(rows[0]['loss']):.3f} -> {float(rows[-1]['loss']):.3f}, val {vals}")
PYEOF
