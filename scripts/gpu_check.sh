#!/usr/bin/env bash
# The GPU machine's check (one H200, PyTorch 2.11 + CUDA 13 + NCCL, 16 cores, no network), in order
# of value, under one global deadline (DMUON_GPU_BUDGET_S, default 470 s: the device tool's 600 s
# call with room to spare); a phase that would start past the deadline is skipped and named so.
#   1. configure + build of what the GPU runs (cuda_test, runtime_test, tp_test, checkpoint_test, ns_bench,
#      optim_step_bench, dmuon), timed
#   2. cuda_test: NS precisions vs float64, one-GPU training vs CPU, forced collectives on NCCL
#      (world size 1) under CUDA's sync debug mode, every group bound to the GPU, the host-blocking
#      probe (NCCL and the CUDA loopback backend)
#   3. runtime_test's loopback equivalence suites on CUDA tensors (Z3, Z2, HSDP 2x2, DDP path,
#      all_gather mode, sharded_adamw, no_sync accumulation; default and side streams; the forward-unshard
#      profile's CUDA-event stream stall), tp_test's
#      (DP 2 x TP 2, distributed Gram) and checkpoint_test's (save on HSDP 2x2, resume on 3), float64
#   4. with >= 2 GPUs only: torchrun 2 ranks (and 4 with >= 4 GPUs), and a rank killed mid-run
#   5. dmuon train --device cuda (one GPU) on the shipped fortunes text, forced collectives too
#   6. the Python package (import dmuon): pip install --no-build-isolation from this build tree (or,
#      where pip cannot, the build tree's package copied out), then tests/python/test_device.py and the
#      NS tests on the GPU (NCCL, world size 1; float64 equivalence at 1e-10, forced collectives too) and
#      examples/train_llama.py under torchrun on one GPU
#   7. ns_bench: CUDA graphs vs eager (host us per call), Llama-3-8B shapes in bf16/fp16 (float64
#      references on the GPU), batched vs per-matrix, the fp16 symmetric Gram product (block triangle)
#      vs plain GEMMs per shape and what "auto" keeps
#   8. the step benchmark: Muon vs AdamW on a GPT-2-small-sized model; optim_step_bench on the GPU: the
#      fused AdamW / foreach momentum (the CUDA default) vs the per-parameter ops
# No CPU unit tests here: CI runs them. Writes OUT/gpu_report.md (the GPU's name, build durations,
# every phase's exit code and time) and the logs beside it.
#
#   usage: scripts/gpu_check.sh OUT_DIR
#   device tool: run(command='bash scripts/gpu_check.sh "$OUT"', carry=[".gpu-deps"], timeout_s=540)
#   everything does not fit one call's budget: first DMUON_GPU_PHASES=2,3,5,6, then (machine still warm,
#   the build kept) DMUON_GPU_PHASES=4,7,8 in a second call
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

PHASE=1
section() {
  PHASE="${1%%.*}"
  echo "[gpu_check] $1 (t=$(($(date +%s) - T0)) s)"
  printf '\n## %s\n\n' "$1" >>"$REPORT"
}
# run LIMIT_S LOGNAME CMD...: CMD with a time limit (cut to the global deadline; skipped when under
# 10 s remain), its whole output in OUT/LOGNAME.log and the last lines in the report. With
# DMUON_GPU_PHASES (e.g. "2,3,6"), only those phases' commands run (the build, phase 1, always does:
# split the check over two device calls on a warm machine, the build tree kept between them).
run() {
  local limit=$1 log=$2
  shift 2
  if [ -n "${DMUON_GPU_PHASES:-}" ] && [ "$PHASE" != 1 ] && [[ ",$DMUON_GPU_PHASES," != *",$PHASE,"* ]]; then
    echo "SKIPPED (DMUON_GPU_PHASES=$DMUON_GPU_PHASES): $*" >>"$REPORT"
    return 125
  fi
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
run 230 build cmake --build "$BUILD" -j "$(nproc)" --target cuda_test runtime_test tp_test checkpoint_test ns_bench optim_step_bench dmuon_cli ||
  { echo "build failed" >>"$REPORT"; exit 1; }

section "2. cuda_test: NS precisions, one-GPU training, forced NCCL collectives under sync debug, host-blocking probe"
run 90 cuda_test "$BUILD/tests/cuda_test" --gtest_color=no

section "3. loopback equivalence on CUDA tensors (float64, every layout, default and side streams)"
run 90 loopback "$BUILD/tests/runtime_test" --gtest_color=no --gtest_brief=1 \
  --gtest_filter='Layouts/LoopbackEquivalenceTest.*Cuda*:RuntimeTest.ForcedCollectives*:RuntimeTest.*OnCuda'
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

section "6. Python: import dmuon on one GPU (NCCL, world size 1)"
# the package: pip install from this build tree (scikit-build-core is on that machine's image; the same
# generator and options, so only the extension is compiled), else the extension built here and copied out
PYSITE=/tmp/dmuon-site
rm -rf "$PYSITE"
PYOPTS=(-DDMUON_BUILD_PYTHON=ON -DDMUON_PYTHON="$(command -v python3)")
if python3 -c "import scikit_build_core" 2>/dev/null &&
   run 200 pip_install env CMAKE_GENERATOR="$(sed -n 's/^CMAKE_GENERATOR:INTERNAL=//p' "$BUILD/CMakeCache.txt")" \
     python3 -m pip install --no-build-isolation --no-deps --no-index --target "$PYSITE" -C build-dir="$BUILD" \
     -C cmake.define.CMAKE_PREFIX_PATH="$PREFIXES" -C cmake.define.TORCH_CUDA_ARCH_LIST=9.0 \
     -C cmake.define.DMUON_INSTALL=OFF -C cmake.define.DMUON_BUILD_TESTS=ON -C cmake.define.DMUON_BUILD_BENCHMARKS=ON \
     -C cmake.define.DMUON_BUILD_CLI=ON .; then
  echo "package: pip install into $PYSITE" >>"$REPORT"
else
  run 30 configure_python cmake -S . -B "$BUILD" "${PYOPTS[@]}" &&
    run 200 build_python cmake --build "$BUILD" -j "$(nproc)" --target dmuon_python &&
    mkdir -p "$PYSITE" && cp -r "$BUILD/python/dmuon" "$PYSITE/" &&
    echo "package: the build tree's dmuon copied to $PYSITE (pip install did not run)" >>"$REPORT"
fi
if [ -f "$PYSITE/dmuon/__init__.py" ]; then
  (cd /tmp && PYTHONPATH="$PYSITE" python3 -c 'import dmuon; print("dmuon", dmuon.__version__, dmuon.__file__); print(dmuon.get_ns_backend())') >>"$REPORT" 2>&1
  run 150 python_device env PYTHONPATH="$PYSITE:$(pwd)/tests/python" OMP_NUM_THREADS=4 python3 -m pytest -q \
    -p no:cacheprovider tests/python/test_device.py -k cuda
  [ -f "$DATA" ] && run 90 python_example env PYTHONPATH="$PYSITE" "$(dirname "$(command -v python3)")/torchrun" \
    --standalone --nproc-per-node 1 examples/train_llama.py --text "$DATA" --steps 40 --hidden 256 --layers 4 \
    --batch 16 --seq 128 --log-every 10
else
  echo "SKIPPED: no dmuon package was built (see pip_install / build_python above)" >>"$REPORT"
fi

section "7. ns_bench on the GPU: CUDA graphs vs eager, Llama-3-8B shapes, batched"
# Llama-3-8B: q/o 4096², k/v 1024x4096, gate/up 14336x4096, down 4096x14336
LLAMA_SHAPES=4096x4096,4096x14336,14336x4096,1024x4096
run 30 ns_bench_graphs "$BUILD/bench/ns_bench" --graphs --device cuda --reps 50
run 45 ns_bench_bf16 "$BUILD/bench/ns_bench" --device cuda --dtype bf16 --reps 20 --shapes "$LLAMA_SHAPES"
run 45 ns_bench_fp16 "$BUILD/bench/ns_bench" --device cuda --dtype f16 --reps 20 --shapes "$LLAMA_SHAPES"
run 30 ns_bench_batched "$BUILD/bench/ns_bench" --batched --device cuda --reps 5
run 45 ns_bench_kernels "$BUILD/bench/ns_bench" --kernels --device cuda --dtype f16 --reps 10 \
  --shapes "$LLAMA_SHAPES,768x3072,1024x1024,2048x8192"

section "8. step benchmarks: Muon vs AdamW, GPT-2-small-sized (d 768, 12 layers, 12 heads, seq 1024, batch 8); multi-tensor kernels"
# fused AdamW + foreach momentum (-mt, the CUDA default) against the per-parameter ops (-pp)
run 30 optim_step_cuda_small "$BUILD/bench/optim_step_bench" --device cuda --reps 100 --blocks 32 --dim 32 \
  --variants adamw,dmuon-adamw-mt,dmuon-adamw-pp,muon-mt,muon-pp
run 30 optim_step_cuda_256 "$BUILD/bench/optim_step_bench" --device cuda --reps 50 --blocks 32 --dim 256 --batch 64 \
  --variants adamw,dmuon-adamw-mt,dmuon-adamw-pp,muon-mt,muon-pp
if [ -f "$DATA" ]; then
  GPT2=(--device cuda --ranks 1 --data "$DATA" --steps 20 --batch 8 --seq-len 1024 --d-model 768 --layers 12
        --heads 12 --log-every 10)
  run 60 step_muon "$BUILD/apps/dmuon" train "${GPT2[@]}" --optimizer dmuon --out "$OUT/step_muon"
  run 50 step_adamw "$BUILD/apps/dmuon" train "${GPT2[@]}" --optimizer adamw --out "$OUT/step_adamw"
  run 60 step_muon_pp "$BUILD/apps/dmuon" train "${GPT2[@]}" --optimizer dmuon --per-param-optim --out "$OUT/step_muon_pp"
  python3 - "$OUT" >>"$REPORT" 2>&1 <<'PY'
import json, sys, os
out = sys.argv[1]
rows = {}
for v in ("muon", "adamw", "muon_pp"):
    p = os.path.join(out, f"step_{v}", "summary.json")
    if os.path.exists(p):
        rows[v] = json.load(open(p))
for v, s in rows.items():
    peak = s.get("peak_memory_bytes") or [0]
    print(f"- {v}: step {s.get('step_ms', {})}, tokens/s {s.get('tokens_per_s')}, "
          f"peak CUDA memory {max(peak) / 2**30:.2f} GiB (caching allocator, allocated bytes)")
def mean_step(s):
    st = s.get("step_ms")
    return st.get("mean") if isinstance(st, dict) else st
for num, den, what in (("muon", "adamw", "Muon step / AdamW step"),
                       ("muon_pp", "muon", "per-parameter optimizer ops / fused+foreach (step time)")):
    if num in rows and den in rows:
        a, b = mean_step(rows[num]), mean_step(rows[den])
        if a and b:
            print(f"- {what}: {a / b:.3f}")
PY
fi

section "done"
echo "total $(($(date +%s) - T0)) s (budget ${DMUON_GPU_BUDGET_S:-470} s)" >>"$REPORT"
echo "[gpu_check] report: $REPORT"
