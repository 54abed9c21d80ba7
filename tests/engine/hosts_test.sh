#!/bin/bash
# Two "hosts" on one machine (issue 43): two `uckpt launch -n 2 --nnodes 2`
# with --node_rank 0 and 1 make one world of 4 CPU ranks.
#   1. They train 6 steps, saving; ranks 0-3 each log their own global rank.
#   2. Host 1 is lost (its launcher killed with SIGKILL, its ranks with it):
#      host 0's launcher ends non-zero within 60 s, naming a failed rank, and
#      no process is left; host 0 then resumes `latest` alone on 2 ranks.
#   3. Wrong host options are refused by name: --node_rank >= --nnodes,
#      --master_port 0 and --max_restarts across hosts.
#
# usage: hosts_test.sh UCKPT WORK_DIR
set -euo pipefail
source "$(dirname "$(realpath "$0")")/tiny_gpt2.sh"
source "$(dirname "$(realpath "$0")")/ports.sh"

tiny_gpt2 8 --timeout 120 --heartbeat_interval 0.25 --heartbeat_timeout 3
# Host k of 2: `uckpt launch` for 2 local ranks, started in the background; sets HOST_PID.
host() {
  local k=$1 p=$2 run=$3
  shift 3
  "$U" launch -n 2 --nnodes 2 --node_rank "$k" --master_port "$p" -- "$U" train $F --checkpoint_dir ck \
    --checkpoint_interval 2 --resume --run_name "$run" "$@" > "$run.host$k.log" 2>&1 &
  HOST_PID=$!
}

echo "1. two hosts of 2 ranks: one world of 4"
reserve_port P
host 0 "$P" two --steps 6; H0=$HOST_PID
host 1 "$P" two --steps 6; H1=$HOST_PID
wait "$H0" || { cat two.host*.log; fail "host 0 exited non-zero"; }
wait "$H1" || { cat two.host*.log; fail "host 1 exited non-zero"; }
grep -q "world size 4 (gloo)" two.host0.log || { cat two.host0.log; fail "not one world of 4"; }
[ "$(cat ck/latest)" = global_step6 ] || fail "latest is $(cat ck/latest)"
echo "  6 steps in one world of 4 ranks, latest global_step6"

echo "2. host 1 lost mid-training"
reserve_port P
host 0 "$P" lost --steps 100000; H0=$HOST_PID
host 1 "$P" lost --steps 100000; H1=$HOST_PID
for i in $(seq 600); do [ "$(steps_done lost)" -ge 4 ] && break; sleep 0.1; done
[ "$(steps_done lost)" -ge 4 ] || { kill -9 "$H0" "$H1"; cat lost.host*.log; fail "no progress"; }
kill -9 "$H1"
T0=$(date +%s)
CODE=0
for i in $(seq 600); do kill -0 "$H0" 2> /dev/null || break; sleep 0.1; done
kill -0 "$H0" 2> /dev/null && { kill -9 "$H0"; cat lost.host0.log; fail "host 0 still running 60 s after host 1 was lost"; }
wait "$H0" || CODE=$?
[ "$CODE" != 0 ] || { cat lost.host0.log; fail "host 0 exited 0"; }
grep -q "uckpt launch: rank [01] exited with code" lost.host0.log || { cat lost.host0.log; fail "host 0 names no rank"; }
sleep 1
left=$(pgrep -f "run_name lost" || true)
[ -z "$left" ] || { ps -fp $left; kill -9 $left; fail "processes left: $left"; }
echo "  host 0 ended (code $CODE) $(($(date +%s) - T0)) s after host 1 was lost: $(grep -m1 'uckpt launch: rank' lost.host0.log)"
tag=$(cat ck/latest)
next=$(( ${tag#global_step} + 2 ))
"$U" launch -n 2 --master_port 0 -- "$U" train $F --checkpoint_dir ck --resume --steps $next --run_name alone \
  > alone.log 2>&1 || { cat alone.log; fail "host 0 alone could not resume $tag"; }
grep -q "world size 2 (gloo)" alone.log && [ "$(cat ck/latest)" = "global_step$next" ] ||
  { cat alone.log; fail "the 2-rank resume did not reach step $next"; }
echo "  host 0 alone resumed $tag on 2 ranks to global_step$next"

echo "3. wrong host options"
refused() {  # refused NEEDLE ARGS...
  local needle=$1 code=0
  shift
  "$U" launch "$@" -- "$U" train $F --steps 1 > refused.log 2>&1 || code=$?
  [ "$code" != 0 ] && grep -qF -- "$needle" refused.log || { cat refused.log; fail "not refused naming '$needle'"; }
  echo "  refused: $(grep -m1 -F -- "$needle" refused.log | cut -c1-140)"
}
refused "--node_rank 2 is not below --nnodes 2" -n 1 --nnodes 2 --node_rank 2 --master_port 29999
refused "--master_port 0 picks a port on one host only" -n 1 --nnodes 2 --master_port 0
refused "across hosts (--nnodes > 1) it is not supported yet" -n 1 --nnodes 2 --master_port 29999 --max_restarts 1
echo "all host cases passed"
