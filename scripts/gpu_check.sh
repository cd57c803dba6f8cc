#!/usr/bin/env bash
# The GPU machine's check (one H200, PyTorch 2.11 + CUDA 13 + NCCL, 16 cores, no network), in order
# of value, under one global deadline (DMUON_GPU_BUDGET_S, default 470 s: the device tool's 600 s
# call with room to spare); a phase that would start past the deadline is skipped and named so.
#   1. configure + build of what the GPU runs (cuda_test, runtime_test, tp_test, checkpoint_test, ns_bench, dmuon), timed
#   2. cuda_test: NS precisions vs float64, one-GPU training vs CPU, forced collectives on NCCL
#      (world size 1) under CUDA's sync debug mode, every group bound to the GPU, the host-blocking
#      probe (NCCL and the CUDA loopback backend)
#   3. runtime_test's loopback equivalence suites on CUDA tensors (Z3, Z2, HSDP 2x2, DDP path,
#      all_gather mode, sharded_adamw, no_sync accumulation; default and side streams), tp_test's
#      (DP 2 x TP 2, distributed Gram) and checkpoint_test's (save on HSDP 2x2, resume on 3), float64
#   4. with >= 2 GPUs only: torchrun 2 ranks (and 4 with >= 4 GPUs), and a rank killed mid-run
#   5. dmuon train --device cuda (one GPU) on the shipped fortunes text, forced collectives too
#   6. ns_bench: CUDA graphs vs eager (host us per call), Llama-3-8B shapes in bf16/fp16 (float64
#      references on the GPU), batched vs per-matrix
#   7. the step benchmark: Muon vs AdamW on a GPT-2-small-sized model
# No CPU unit tests here: CI runs them. Writes OUT/gpu_report.md (the GPU's name, build durations,
# every phase's exit code and time) and the logs beside it.
#
#   usage: scripts/gpu_check.sh OUT_DIR
#   device tool: run(command='bash scripts/gpu_check.sh "$OUT"', carry=[".gpu-deps"], timeout_s=540)
#                after `bash scripts/gpu_deps.sh` here (GoogleTest, CLI11, nlohmann-json headers and
#                the fortunes text, which that machine's image lacks).
set -uo pipefail
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
REPORT="$OUT/gpu_report.md"
T0=$(date +%s)
DEADLINE=$((T0 + ${DMUON_GPU_BUDGET_S:-470}))
BUILD="${DMUON_GPU_BUILD_DIR:-build-gpu}"
DATA="$(pwd)/.gpu-deps/share/fortunes.txt"
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)

section() {
  echo "[gpu_check] $1 (t=$(($(date +%s) - T0)) s)"
  printf '\n## %s\n\n' "$1" >>"$REPORT"
}
# run LIMIT_S LOGNAME CMD...: CMD with a time limit (cut to the global deadline; skipped when under
# 10 s remain), its whole output in OUT/LOGNAME.log and the last lines in the report.
run() {
  local limit=$1 log=$2
  shift 2
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 10 ]; then
    echo "SKIPPED (global deadline): $*" >>"$REPORT"
    echo "[gpu_check] skipped $log: deadline"
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$OUT/$log.log" 2>&1
  local rc=$?
  {
    echo '```'
    echo "\$ $*"
    tail -n 40 "$OUT/$log.log"
    echo "exit $rc after $(($(date +%s) - t)) s (limit $limit s)"
    echo '```'
  } >>"$REPORT"
  return $rc
}

{
  echo "# dmuon GPU check"
  echo
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  echo "gpus: $GPUS"
  python3 -c 'import torch;print("torch:", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())' 2>/dev/null
  echo "cores: $(nproc)"
  [ -f "$DATA" ] || echo "WARNING: $DATA is missing (run scripts/gpu_deps.sh here and carry .gpu-deps): train runs skip"
} >"$REPORT"

section "1. configure and build"
TORCH_PREFIX="$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')"
PREFIXES="$TORCH_PREFIX"
[ -d .gpu-deps ] && PREFIXES="$TORCH_PREFIX;$(pwd)/.gpu-deps"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
run 60 configure cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIXES" \
  -DTORCH_CUDA_ARCH_LIST=9.0 -DDMUON_INSTALL=OFF || { echo "configure failed" >>"$REPORT"; exit 1; }
run 230 build cmake --build "$BUILD" -j "$(nproc)" --target cuda_test runtime_test tp_test checkpoint_test ns_bench dmuon_cli ||
  { echo "build failed" >>"$REPORT"; exit 1; }

section "2. cuda_test: NS precisions, one-GPU training, forced NCCL collectives under sync debug, host-blocking probe"
run 90 cuda_test "$BUILD/tests/cuda_test" --gtest_color=no

section "3. loopback equivalence on CUDA tensors (float64, every layout, default and side streams)"
run 90 loopback "$BUILD/tests/runtime_test" --gtest_color=no --gtest_brief=1 \
  --gtest_filter='Layouts/LoopbackEquivalenceTest.*Cuda*:RuntimeTest.ForcedCollectives*'
run 45 loopback_tp "$BUILD/tests/tp_test" --gtest_color=no --gtest_brief=1 --gtest_filter='TpEquivalence.LoopbackCuda*'
run 45 loopback_resume "$BUILD/tests/checkpoint_test" --gtest_color=no --gtest_brief=1 \
  --gtest_filter='CheckpointTest.ResumeThroughTheLoopbackBackendOnCuda'

if [ "$GPUS" -ge 2 ]; then
  section "4. several GPUs: torchrun, and a rank killed mid-run"
  TORCHRUN="$(dirname "$(command -v python3)")/torchrun"
  for n in 2 4; do
    [ "$GPUS" -ge "$n" ] || continue
    run 60 "torchrun_$n" "$TORCHRUN" --nproc-per-node "$n" --no-python "$BUILD/apps/dmuon" train --device cuda \
      --data "$DATA" --steps 20 --batch 8 --seq-len 64 --d-model 128 --layers 4 --heads 4 --param-dtype fp64 \
      --out "$OUT/torchrun_$n" --timeout 60
  done
  # rank 1 killed at step 5: the survivors must exit non-zero with dmuon's message within the timeout
  run 90 kill_mid_run bash -c "'$BUILD/apps/dmuon' train --device cuda --ranks 2 --data '$DATA' --steps 400 \
    --batch 8 --seq-len 64 --d-model 128 --layers 4 --heads 4 --timeout 20 --out '$OUT/kill' & P=\$!; sleep 25; \
    pkill -9 -n -f 'apps/dmuon train'; wait \$P; echo \"launcher exit \$? (expected non-zero, naming the killed rank)\""
else
  section "4. several GPUs: SKIPPED (this machine has $GPUS GPU; torchrun and kill tests need >= 2)"
fi

section "5. dmuon train --device cuda (one GPU), then with forced collectives"
if [ -f "$DATA" ]; then
  run 45 train "$BUILD/apps/dmuon" train --device cuda --ranks 1 --data "$DATA" --steps 60 --batch 16 \
    --seq-len 128 --d-model 256 --layers 4 --heads 4 --log-every 20 --out "$OUT/train"
  [ -f "$OUT/train/summary.json" ] && cp "$OUT/train/summary.json" "$OUT/train_summary.json"
  run 45 train_forced env DMUON_FORCE_COLLECTIVES=1 "$BUILD/apps/dmuon" train --device cuda --ranks 1 --data "$DATA" \
    --steps 30 --batch 16 --seq-len 128 --d-model 256 --layers 4 --heads 4 --log-every 10 --out "$OUT/train_forced"
else
  echo "SKIPPED: no training text ($DATA)" >>"$REPORT"
fi

section "6. ns_bench on the GPU: CUDA graphs vs eager, Llama-3-8B shapes, batched"
# Llama-3-8B: q/o 4096², k/v 1024x4096, gate/up 14336x4096, down 4096x14336
LLAMA_SHAPES=4096x4096,4096x14336,14336x4096,1024x4096
run 30 ns_bench_graphs "$BUILD/bench/ns_bench" --graphs --device cuda --reps 50
run 45 ns_bench_bf16 "$BUILD/bench/ns_bench" --device cuda --dtype bf16 --reps 20 --shapes "$LLAMA_SHAPES"
run 45 ns_bench_fp16 "$BUILD/bench/ns_bench" --device cuda --dtype f16 --reps 20 --shapes "$LLAMA_SHAPES"
run 30 ns_bench_batched "$BUILD/bench/ns_bench" --batched --device cuda --reps 5

section "7. step benchmark: Muon vs AdamW, GPT-2-small-sized (d 768, 12 layers, 12 heads, seq 1024, batch 8)"
if [ -f "$DATA" ]; then
  GPT2=(--device cuda --ranks 1 --data "$DATA" --steps 20 --batch 8 --seq-len 1024 --d-model 768 --layers 12
        --heads 12 --log-every 10)
  run 60 step_muon "$BUILD/apps/dmuon" train "${GPT2[@]}" --optimizer dmuon --out "$OUT/step_muon"
  run 50 step_adamw "$BUILD/apps/dmuon" train "${GPT2[@]}" --optimizer adamw --out "$OUT/step_adamw"
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
fi

section "done"
echo "total $(($(date +%s) - T0)) s (budget ${DMUON_GPU_BUDGET_S:-470} s)" >>"$REPORT"
echo "[gpu_check] report: $REPORT"
