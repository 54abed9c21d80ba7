#!/bin/bash
# No orphaned or stuck ranks (docs/reliability.md, "When the launcher or a
# rank dies or stops"): 2 CPU ranks of a tiny GPT-2 under `uckpt launch`,
# heartbeat 0.25 s / 3 s, collective timeout 120 s, saving every step.
#   1. kill -9 of the launcher: its ranks end within the heartbeat timeout,
#      and a new launch on the same rendezvous port resumes from `latest`;
#   2. kill -9 of the launcher's whole process group (`kill -9 -- -PGID`);
#   3. SIGSTOP of rank 1: the job (launcher and both ranks) ends within the
#      heartbeat timeout (+ margin), not after the launcher's --grace;
#   4. SIGSTOP of every rank: the launcher ends the job after --stop_timeout;
#   5. SIGINT of the launcher still stops both ranks (exit 130), as Ctrl-C.
# After each: no process of the job is left, and (1) the port is free again.
#
# usage: launcher_test.sh UCKPT WORK_DIR   (CASES="3 4" runs only those)
set -euo pipefail
source "$(dirname "$(realpath "$0")")/tiny_gpt2.sh"

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
within() { awk -v s="$1" -v m="$2" 'BEGIN { exit !(s < m) }'; }
source "$(dirname "$(realpath "$0")")/ports.sh"
# A live process (not a zombie waiting for its parent).
alive() { [ -r "/proc/$1/stat" ] && ! sed 's/.*) //' "/proc/$1/stat" 2> /dev/null | grep -q '^Z'; }

HB_TIMEOUT=3
want() { [[ " ${CASES:-1 2 3 4 5} " == *" $1 "* ]]; }
# Whatever happens, leave nothing of ours running.
LPID= RANKS=
trap 'rc=$?; set +e; if [ -n "$LPID$RANKS" ]; then kill -CONT $LPID $RANKS; kill -9 $LPID $RANKS; fi 2> /dev/null; exit $rc' EXIT
tiny_gpt2 8 --timeout 120 --heartbeat_interval 0.25 --heartbeat_timeout $HB_TIMEOUT
reserve_port PORT

# start NAME [LAUNCH FLAGS...]: a 2-rank launch (in a session and process
# group of its own) saving every step; waits for 3 steps; sets LPID, RANKS.
start() {
  local name=$1 i
  shift
  setsid "$U" launch -n 2 --master_port "$PORT" "$@" -- "$U" train $F --steps 100000 --checkpoint_dir "ck_$name" \
    --checkpoint_interval 1 --resume --run_name "$name" > "$name.log" 2>&1 &
  LPID=$!
  sleep 0.2
  tr '\0' ' ' < "/proc/$LPID/cmdline" | grep -q " launch " || fail "$name: the launcher is not \$!"
  for i in $(seq 600); do [ "$(steps_done "$name")" -ge 3 ] && break; sleep 0.1; done
  RANKS=$(pgrep -P "$LPID" || true)
  [ "$(steps_done "$name")" -ge 3 ] && [ "$(echo $RANKS | wc -w)" = 2 ] ||
    { cat "$name.log"; kill -9 $LPID $RANKS 2> /dev/null; fail "$name: no progress"; }
}
rank_pid() {  # rank_pid R: the pid of rank R among RANKS
  local p
  for p in $RANKS; do tr '\0' '\n' < "/proc/$p/environ" | grep -qx "RANK=$1" && echo "$p"; done
}

# ended NAME LIMIT PIDS...: every pid ends within LIMIT s of T0 (each is
# SIGKILLed after 30 s so nothing outlives a failure); SECS = the last.
ended() {
  local name=$1 limit=$2 p i left
  shift 2
  for i in $(seq 300); do
    left=
    for p in "$@"; do alive "$p" && left="$left $p"; done
    [ -z "$left" ] && break
    sleep 0.1
  done
  SECS=$(elapsed "$T0" "$(now)")
  if [ -n "$left" ]; then
    ps -o pid,stat,etime,args -p "${left# }" || true
    kill -CONT $left 2> /dev/null || true
    kill -9 $left 2> /dev/null || true
    fail "$name: process(es)$left still running $SECS s later"
  fi
  within "$SECS" "$limit" || fail "$name: the job took $SECS s to end (limit $limit s)"
  echo "  $name: every process ended $SECS s after the fault"
}

if want 1; then
  echo "1. kill -9 of the launcher"
  start kill_launcher
  kill -9 "$LPID"
  T0=$(now)
  ended kill_launcher $HB_TIMEOUT $RANKS
  { wait "$LPID"; } 2> /dev/null || true
  tag=$(cat ck_kill_launcher/latest)
  next=$(( ${tag#global_step} + 1 ))
  "$U" launch -n 2 --master_port "$PORT" -- "$U" train $F --steps $next --checkpoint_dir ck_kill_launcher --resume \
    --run_name kill_launcher_resume > kill_launcher_resume.log 2>&1 ||
    { cat kill_launcher_resume.log; fail "a new launch on port $PORT after the kill"; }
  [ "$(cat ck_kill_launcher/latest)" = "global_step$next" ] || fail "the resumed run did not reach step $next"
  echo "  a new launch on port $PORT resumed from $tag to global_step$next"
fi

if want 2; then
  echo "2. kill -9 of the launcher's process group"
  start kill_group
  kill -9 -- "-$LPID"
  T0=$(now)
  ended kill_group $HB_TIMEOUT $RANKS
  { wait "$LPID"; } 2> /dev/null || true
fi

if want 3; then
  echo "3. SIGSTOP of rank 1"
  start stop_rank
  kill -STOP "$(rank_pid 1)"
  T0=$(now)
  ended stop_rank $((HB_TIMEOUT + 4)) $LPID $RANKS
  CODE=0
  wait "$LPID" || CODE=$?
  [ "$CODE" != 0 ] || fail "stop_rank: launch exited 0"
  grep -q "rank 1 stopped responding" stop_rank.log || { cat stop_rank.log; fail "stop_rank: no rank names rank 1"; }
fi

if want 4; then
  echo "4. SIGSTOP of every rank (launch --stop_timeout 2)"
  start stop_all --stop_timeout 2
  kill -STOP $RANKS
  T0=$(now)
  ended stop_all 6 $LPID $RANKS
  CODE=0
  wait "$LPID" || CODE=$?
  [ "$CODE" != 0 ] || fail "stop_all: launch exited 0"
  grep -q "uckpt launch: rank . has been stopped" stop_all.log || { cat stop_all.log; fail "stop_all: no message"; }
fi

if want 5; then
  echo "5. SIGINT of the launcher"
  start sigint
  kill -INT "$LPID"
  T0=$(now)
  ended sigint 5 $LPID $RANKS
  CODE=0
  wait "$LPID" || CODE=$?
  [ "$CODE" = 130 ] || { cat sigint.log; fail "sigint: launch exited $CODE, not 130"; }
fi

echo "all launcher cases passed"
