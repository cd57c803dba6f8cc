#!/usr/bin/env bash
# dmuon train across hosts: three network namespaces with their own addresses (10.77.N.1-3 on a
# veth bridge), one rank per host over TCP (Gloo bound by GLOO_SOCKET_IFNAME; the TCPStore at rank
# 0's address). The run trains and checkpoints; then one host's rank is killed mid-run (SIGKILL): the
# other two must exit non-zero with a clear error within the collective timeout, never hang; then
# --resume on two hosts continues from the last checkpoint to the end.
#   multihost_test.sh <dmuon binary>
# Needs root (ip netns, veth, bridge); exits 77 (skipped) where network namespaces cannot be made.
set -euo pipefail
DMUON="$1"
id=$$
net="10.77.$((id % 200 + 20))"
sw="dmsw$id"
work="$(mktemp -d)"
hosts=()
cleanup() {
  for h in "${hosts[@]}"; do ip netns pids "$h" 2>/dev/null | xargs -r kill -9 2>/dev/null || true; done
  for h in "${hosts[@]}" "$sw"; do ip netns del "$h" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
if ! ip netns add "$sw" 2>/dev/null; then
  echo "SKIP: cannot create network namespaces here (needs root and iproute2)"
  exit 77
fi
ip -n "$sw" link add br0 type bridge
ip -n "$sw" link set br0 up
for i in 0 1 2; do
  h="dmh${i}_$id"
  hosts+=("$h")
  ip netns add "$h"
  ip link add "v${i}_$id" type veth peer name eth0 netns "$h"
  ip link set "v${i}_$id" netns "$sw"
  ip -n "$sw" link set "v${i}_$id" master br0 up
  ip -n "$h" addr add "$net.$((i + 1))/24" dev eth0
  ip -n "$h" link set eth0 up
  ip -n "$h" link set lo up
done

common=(train --batch 6 --seq-len 32 --d-model 32 --layers 2 --heads 2 --log-every 1 --eval-every 0
        --timeout 15 --checkpoint-every 2)
# start one rank per host; $1 = world size, $2 = steps, $3 = output dir, rest: extra arguments
start() {
  local world="$1" steps="$2" out="$3"
  shift 3
  pids=()
  for ((i = 0; i < world; ++i)); do
    ip netns exec "${hosts[$i]}" env RANK=$i WORLD_SIZE="$world" LOCAL_RANK=0 MASTER_ADDR="$net.1" MASTER_PORT=29555 \
      GLOO_SOCKET_IFNAME=eth0 "$DMUON" "${common[@]}" --steps "$steps" --out "$out" "$@" >"$work/rank$i.log" 2>&1 &
    pids+=($!)
  done
}

rows() { if [ -f "$1" ]; then wc -l < "$1"; else echo 0; fi; }

# 1) three hosts; kill host 2's rank once step 5 is logged
start 3 400 "$work/run" --checkpoint "$work/ck.pt"
for _ in $(seq 600); do
  [ "$(rows "$work/run/metrics.csv")" -ge 6 ] && break
  sleep 0.1
done
[ "$(rows "$work/run/metrics.csv")" -ge 6 ] || {
  cat "$work"/rank*.log; echo "FAIL: the three-host run did not reach step 5"; exit 1; }
kill -9 "${pids[2]}"
t0=$(date +%s)
if [ -n "${DMUON_MULTIHOST_TRACE:-}" ]; then
  for _ in $(seq 120); do
    echo "t+$(( $(date +%s) - t0 ))s: $(grep -c "^error" "$work/rank0.log") $(grep -c "^error" "$work/rank1.log") $(ps -o pid= -p "${pids[0]}" "${pids[1]}" | wc -l) alive"
    [ "$(ps -o pid= -p "${pids[0]}" "${pids[1]}" | wc -l)" -eq 0 ] && break
    sleep 1
  done
fi
rc0=0; rc1=0
wait "${pids[0]}" || rc0=$?
wait "${pids[1]}" || rc1=$?
dt=$(( $(date +%s) - t0 ))
echo "killed host 2's rank: hosts 0 and 1 exited with $rc0 and $rc1 after ${dt} s"
[ "$rc0" -ne 0 ] && [ "$rc1" -ne 0 ] || { cat "$work"/rank*.log; echo "FAIL: a survivor exited 0"; exit 1; }
[ "$dt" -le 60 ] || { cat "$work"/rank*.log; echo "FAIL: the survivors took ${dt} s (timeout 15 s)"; exit 1; }
for i in 0 1; do
  grep -q "^error (rank $i)" "$work/rank$i.log" || { cat "$work/rank$i.log"; echo "FAIL: rank $i printed no error line"; exit 1; }
done
grep -h "^error" "$work/rank0.log" "$work/rank1.log" | head -2
[ -f "$work/ck.pt" ] || { echo "FAIL: no checkpoint was written before the kill"; exit 1; }

# 2) resume on two hosts to step 12
start 2 12 "$work/resumed" --resume "$work/ck.pt" --checkpoint "$work/ck_resumed.pt"  # never over its input
for i in 0 1; do
  wait "${pids[$i]}" || { cat "$work"/rank*.log; echo "FAIL: the resumed rank $i failed"; exit 1; }
done
grep -q "resumed from" "$work/rank0.log" || { cat "$work/rank0.log"; echo "FAIL: no resume line"; exit 1; }
python3 - "$work/resumed/summary.json" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["world_size"] == 2 and s["steps"] == 12 and s["first_step"] > 2, s
print(f"resumed on 2 hosts at step {s['first_step']}, trained to 12: loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}")
PYEOF
echo "multihost: OK"
