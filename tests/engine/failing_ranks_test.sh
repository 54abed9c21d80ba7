#!/bin/bash
# Failing ranks end the job (docs/training.md, "When a rank fails"): 3 CPU
# ranks train a tiny GPT-2; one is killed with SIGKILL and every other rank
# must exit within 60 s, non-zero, with a message naming the dead rank; then
# the run resumes from `latest`.
#   1. ranks started one by one with torchrun's variables (no launcher to
#      stop the others): rank 1 killed mid-training;
#   2. the same, rank 0 killed (it serves the rendezvous store);
#   3. rank 1 killed inside a save by the write-point crash hook
#      (UCKPT_CRASH_AFTER_WRITES / UCKPT_CRASH_RANK), started one by one too;
#   4. under `uckpt launch`: it exits non-zero and names rank 1 first.
# Short heartbeats (0.25 s, timeout 3 s) keep it fast; the collective timeout
# is 120 s, so only the heartbeat monitor can end the runs in time.
#
# usage: failing_ranks_test.sh UCKPT WORK_DIR
#        RANKS=N (default 3), DEVICE=cuda for one GPU per rank (NCCL),
#        STAGE=N the ZeRO stage (default 2), ASYNC_SAVE=1 background saves
set -euo pipefail
source "$(dirname "$(realpath "$0")")/tiny_gpt2.sh"
N=${RANKS:-3}
DEVICE=${DEVICE:-cpu}
RANK_IDS=$(seq 0 $((N - 1)))

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

tiny_gpt2 12 --timeout 120 --heartbeat_interval 0.25 --heartbeat_timeout 3 --device "$DEVICE"
source "$(dirname "$(realpath "$0")")/ports.sh"

# A complete checkpoint to start from: 5 steps on N ranks.
"$U" launch -n $N --master_port 0 -- "$U" train $F --steps 5 --checkpoint_dir base --run_name base > base.log 2>&1 ||
  { cat base.log; fail "the base run"; }
[ "$(cat base/latest)" = global_step5 ] || fail "the base run did not save global_step5"

# Waits for `pid` to end (at most 90 s); sets CODE and SECS (since T0).
wait_exit() {
  local pid=$1 i
  for i in $(seq 900); do kill -0 "$pid" 2> /dev/null || break; sleep 0.1; done
  SECS=$(elapsed "$T0" "$(now)")
  kill -0 "$pid" 2> /dev/null && { kill -9 "$pid"; SECS=timeout; }
  CODE=0
  wait "$pid" || CODE=$?
}

# Resumes `dir` from `latest` on N ranks for 2 more steps.
resume_works() {
  local dir=$1 what=$2 tag next
  tag=$(cat "$dir/latest")
  "$U" verify -q "$dir/$tag" > "verify_$dir.log" 2>&1 || { cat "verify_$dir.log"; fail "$what: $dir/$tag does not verify"; }
  next=$(( ${tag#global_step} + 2 ))
  "$U" launch -n $N --master_port 0 -- "$U" train $F --steps $next --checkpoint_dir "$dir" --resume \
    --run_name "resume_$dir" > "resume_$dir.log" 2>&1 || { cat "resume_$dir.log"; fail "$what: resume from $tag"; }
  [ "$(cat "$dir/latest")" = "global_step$next" ] || fail "$what: the resumed run did not reach step $next"
  echo "  resumed from $tag to global_step$next"
}

# Starts ranks 0..N-1 of `dir` one by one (as torchrun would), kills `victim`
# once `min_steps` steps are logged (0: the crash hook kills it), and checks
# the survivors.
independent() {
  local dir=$1 victim=$2 min_steps=$3 what=$4
  shift 4
  cp -a base "$dir"
  local port r pids=() i
  reserve_port port
  for r in $RANK_IDS; do
    env "$@" RANK=$r LOCAL_RANK=$r WORLD_SIZE=$N LOCAL_WORLD_SIZE=$N MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$U" train $F --steps 100000 --checkpoint_dir "$dir" --checkpoint_interval 5 --resume --run_name "$dir" \
      > "$dir.r$r.log" 2>&1 &
    pids+=($!)
  done
  if [ "$min_steps" -gt 0 ]; then
    for i in $(seq 600); do [ "$(steps_done "$dir")" -ge "$min_steps" ] && break; sleep 0.1; done
    [ "$(steps_done "$dir")" -ge "$min_steps" ] || { cat "$dir".r*.log; kill -9 "${pids[@]}"; fail "$what: no progress"; }
    kill -9 "${pids[$victim]}"
    T0=$(now)
  else
    # The crash hook kills the victim; time the others from its death.
    for i in $(seq 600); do kill -0 "${pids[$victim]}" 2> /dev/null || break; sleep 0.05; done
    T0=$(now)
    kill -0 "${pids[$victim]}" 2> /dev/null && { kill -9 "${pids[@]}"; fail "$what: the crash hook did not fire"; }
  fi
  local worst=0
  for r in $RANK_IDS; do
    [ "$r" = "$victim" ] && continue
    wait_exit "${pids[$r]}"
    [ "$SECS" != timeout ] || { cat "$dir.r$r.log"; fail "$what: rank $r still running after 90 s"; }
    [ "$CODE" != 0 ] || { cat "$dir.r$r.log"; fail "$what: rank $r exited 0"; }
    awk -v s="$SECS" 'BEGIN { exit !(s < 60) }' || fail "$what: rank $r took $SECS s"
    grep -q "uckpt train: rank $r of $N: rank $victim " "$dir.r$r.log" ||
      { cat "$dir.r$r.log"; fail "$what: rank $r's message does not name rank $victim"; }
    echo "  rank $r exited (code $CODE) $SECS s after rank $victim died: $(grep -m1 "uckpt train: rank $r of $N" "$dir.r$r.log")"
    awk -v s="$SECS" -v w="$worst" 'BEGIN { exit !(s > w) }' && worst=$SECS
  done
  wait "${pids[$victim]}" 2> /dev/null || true
  echo "$what: survivors out within $worst s"
  [ -z "${EXPECT_LATEST:-}" ] || [ "$(cat "$dir/latest")" = "$EXPECT_LATEST" ] ||
    fail "$what: latest moved to $(cat "$dir/latest")"
  resume_works "$dir" "$what"
}

echo "1. rank 1 killed mid-training, ranks started one by one"
independent kill1 1 12 "rank 1 killed"
echo "2. rank 0 (the store host) killed mid-training"
independent kill0 0 12 "rank 0 killed"
echo "3. rank 1 killed mid-save by the crash hook (its 2nd write point of global_step10)"
EXPECT_LATEST=global_step5 independent save1 1 0 "rank 1 killed mid-save" UCKPT_CRASH_AFTER_WRITES=2 UCKPT_CRASH_RANK=1

echo "4. under uckpt launch: rank 1 killed"
cp -a base launched
T0=$(now)
"$U" launch -n $N --master_port 0 -- "$U" train $F --steps 100000 --checkpoint_dir launched --checkpoint_interval 5 \
  --resume --run_name launched > launched.log 2>&1 &
LPID=$!
for i in $(seq 600); do [ "$(steps_done launched)" -ge 12 ] && break; sleep 0.1; done
victim=
for p in $(pgrep -P "$LPID"); do
  tr '\0' '\n' < "/proc/$p/environ" | grep -qx RANK=1 && victim=$p
done
[ -n "$victim" ] || { kill "$LPID"; fail "launch: rank 1's process not found"; }
kill -9 "$victim"
T0=$(now)
wait_exit "$LPID"
[ "$SECS" != timeout ] || fail "launch still running after 90 s"
[ "$CODE" != 0 ] || { cat launched.log; fail "launch exited 0"; }
grep -m1 "uckpt launch:" launched.log | grep -q "rank 1 " || { cat launched.log; fail "launch does not name rank 1 first"; }
echo "  launch exited (code $CODE) $SECS s after rank 1 died: $(grep -m1 'uckpt launch:' launched.log)"
resume_works launched "launch"
echo "all failing-rank cases passed"
