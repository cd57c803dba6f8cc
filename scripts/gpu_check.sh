#!/usr/bin/env bash
# The GPU machine's check (one H200, PyTorch 2.11 + CUDA 13 + NCCL, 16 cores, no network): builds
# dmuon against that machine's torch, runs the CUDA tests and the CPU unit tests, ns_bench on the
# Llama-3-8B shapes (bf16 direct / fp16 Gram) and on one layer's 7 matrices, NS CUDA graphs vs eager
# (host us per call) and batched vs per-matrix NS, a one-GPU `dmuon train`,
# and a one-GPU step benchmark (Muon vs AdamW step time on a GPT-2-small-sized model). Writes one
# report, OUT/gpu_report.md (and the logs beside it). Each phase has its own time limit, so the
# whole script ends within 8 minutes whatever fails.
#
#   usage: scripts/gpu_check.sh OUT_DIR
#   device tool: run(command='bash scripts/gpu_check.sh "$OUT"', carry=[".gpu-deps"], timeout_s=540)
#                after `bash scripts/gpu_deps.sh` here (GoogleTest, CLI11, nlohmann-json headers,
#                which that machine's image lacks).
set -uo pipefail
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
REPORT="$OUT/gpu_report.md"
T0=$(date +%s)
BUILD="${DMUON_GPU_BUILD_DIR:-build-gpu}"

section() {
  echo "[gpu_check] $1 (t=$(($(date +%s) - T0)) s)"
  printf '\n## %s\n\n' "$1" >>"$REPORT"
}
# run LIMIT_S LOGNAME CMD...: runs CMD with a time limit, its whole output in OUT/LOGNAME.log and
# the last lines in the report.
run() {
  local limit=$1 log=$2
  shift 2
  local t=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$OUT/$log.log" 2>&1
  local rc=$?
  {
    echo '```'
    echo "\$ $*"
    tail -n 40 "$OUT/$log.log"
    echo "exit $rc after $(($(date +%s) - t)) s"
    echo '```'
  } >>"$REPORT"
  return $rc
}

{
  echo "# dmuon GPU check"
  echo
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  python3 -c 'import torch;print("torch:", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null
  echo "cores: $(nproc)"
} >"$REPORT"

section "configure and build"
TORCH_PREFIX="$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')"
PREFIXES="$TORCH_PREFIX"
[ -d .gpu-deps ] && PREFIXES="$TORCH_PREFIX;$(pwd)/.gpu-deps"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
run 120 configure cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIXES" \
  -DTORCH_CUDA_ARCH_LIST=9.0 -DDMUON_INSTALL=OFF || { echo "configure failed" >>"$REPORT"; exit 1; }
run 240 build cmake --build "$BUILD" -j "$(nproc)" --target cuda_test ns_test optim_test plan_test ns_bench dmuon_cli ||
  { echo "build failed" >>"$REPORT"; exit 1; }

section "CUDA tests (NS precisions vs float64, auto kernel, one-GPU training vs CPU, host reads)"
run 120 cuda_test "$BUILD/tests/cuda_test" --gtest_color=no
section "CPU unit tests against this LibTorch"
run 60 ns_test "$BUILD/tests/ns_test" --gtest_color=no --gtest_brief=1
run 60 optim_test "$BUILD/tests/optim_test" --gtest_color=no --gtest_brief=1
run 60 plan_test "$BUILD/tests/plan_test" --gtest_color=no --gtest_brief=1

# Llama-3-8B: q/o 4096², k/v 1024x4096, gate/up 14336x4096, down 4096x14336
LLAMA_SHAPES=4096x4096,4096x14336,14336x4096,1024x4096
LAYER=4096x4096,1024x4096,1024x4096,4096x4096,14336x4096,14336x4096,4096x14336
section "ns_bench --device cuda, Llama-3-8B shapes"
run 60 ns_bench_bf16 "$BUILD/bench/ns_bench" --device cuda --dtype bf16 --reps 20 --shapes "$LLAMA_SHAPES"
run 60 ns_bench_fp16 "$BUILD/bench/ns_bench" --device cuda --dtype f16 --reps 20 --shapes "$LLAMA_SHAPES"
section "ns_bench --device cuda, one Llama-3-8B layer (7 matrices; the total row)"
run 60 ns_bench_layer "$BUILD/bench/ns_bench" --device cuda --dtype bf16 --reps 10 --shapes "$LAYER"

section "ns_bench --graphs: host us per NS call, CUDA graph vs eager (issue 19)"
run 60 ns_bench_graphs "$BUILD/bench/ns_bench" --graphs --device cuda --reps 50
section "ns_bench --batched --device cuda: one stacked NS call per shape vs one per matrix"
run 60 ns_bench_batched "$BUILD/bench/ns_bench" --batched --device cuda --reps 5

section "dmuon train --device cuda (one GPU)"
run 90 train "$BUILD/apps/dmuon" train --device cuda --ranks 1 --steps 60 --batch 16 --seq-len 128 --d-model 256 \
  --layers 4 --heads 4 --log-every 20 --out "$OUT/train"
[ -f "$OUT/train/summary.json" ] && cp "$OUT/train/summary.json" "$OUT/train_summary.json"

section "step benchmark: Muon vs AdamW, GPT-2-small-sized (d 768, 12 layers, 12 heads, seq 1024, batch 8)"
GPT2=(--device cuda --ranks 1 --steps 20 --batch 8 --seq-len 1024 --d-model 768 --layers 12 --heads 12 --log-every 10)
run 120 step_muon "$BUILD/apps/dmuon" train "${GPT2[@]}" --optimizer dmuon --out "$OUT/step_muon"
run 90 step_adamw "$BUILD/apps/dmuon" train "${GPT2[@]}" --optimizer adamw --out "$OUT/step_adamw"
python3 - "$OUT" >>"$REPORT" 2>&1 <<'PY'
import json, sys, os
out = sys.argv[1]
rows = {}
for v in ("muon", "adamw"):
    p = os.path.join(out, f"step_{v}", "summary.json")
    if os.path.exists(p):
        rows[v] = json.load(open(p))
for v, s in rows.items():
    peak = s.get("peak_memory_bytes") or [0]
    print(f"- {v}: step {s.get('step_ms', {})}, tokens/s {s.get('tokens_per_s')}, "
          f"peak CUDA memory {max(peak) / 2**30:.2f} GiB (caching allocator, allocated bytes)")
if len(rows) == 2:
    def mean_step(s):
        st = s.get("step_ms")
        return st.get("mean") if isinstance(st, dict) else st
    a, b = mean_step(rows["muon"]), mean_step(rows["adamw"])
    if a and b:
        print(f"- Muon step / AdamW step: {a / b:.3f}")
PY

section "done"
echo "total $(($(date +%s) - T0)) s" >>"$REPORT"
echo "[gpu_check] report: $REPORT"
