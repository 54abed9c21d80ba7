#!/bin/bash
# Lose a rank, keep training (issue 43): `uckpt launch --max_restarts` starts
# the job again on the devices left, and `uckpt train --resume` continues from
# the newest checkpoint at the new world size with the gradient accumulation
# re-derived (global batch 24 = micro 2 x GA 3/4/6 x 4/3/2 ranks).
#   1. 4 CPU ranks; once step 5 is logged the process of rank 2 is killed
#      (SIGKILL), and once the 3-rank world logged a step past its resume,
#      its rank 1: the job ends at step 16 on 2 ranks, exit 0. The launcher
#      names what it left out; each resume checks the state fingerprint; the
#      losses (the last row of each step in the one metrics.csv) match an
#      uninterrupted 4-rank run: the first step after a restart within 1e-6
#      relative, the others 1e-3 absolute (the demo's tolerances).
#      (LOSS_TOL sets the latter.) RANKS=2: 2 ranks, rank 1 killed, the job
#      ends on 1 rank (for a machine of 2 GPUs; GA 6/12).
#   2. What stops a job for good: --min_nproc, a rank exiting with 2 (bad
#      usage), restarts used up, and `uckpt train` without --resume (refused
#      before starting).
#
# usage: restart_test.sh UCKPT WORK_DIR      (STAGE=N: the ZeRO stage, default 2; BATCH, MICRO,
#        STEPS, INTERVAL, KILL_AFTER, MODEL_FLAGS (tiny_gpt2.sh), TRAIN_FLAGS (more flags), DS_EXTRA
#        (JSON members added to ds.json), RANKS (4 or 2): bench/restart-gpu.sh sets them for GPUs)
set -euo pipefail
source "$(dirname "$(realpath "$0")")/tiny_gpt2.sh"

now() { date +%s.%N; }

LPID=$$
RANKS=${RANKS:-4}
# The ranks killed one after another, and the restart each should name.
case $RANKS in
  4) KILLS=(2 1)
     NAMED=("restart 1 of 2: device 2 (rank 2) left out; starting 3 rank(s) on device(s) 0,1,3"
            "restart 2 of 2: device 1 (rank 1) left out; starting 2 rank(s) on device(s) 0,3") ;;
  2) KILLS=(1)
     NAMED=("restart 1 of 1: device 1 (rank 1) left out; starting 1 rank(s) on device(s) 0") ;;
  *) fail "RANKS=$RANKS: 4 or 2" ;;
esac
# The tiny GPT-2 on CPU ranks by default; bench/restart-gpu.sh sets these for GPT-2 124M on 4 GPUs.
BATCH=${BATCH:-24} MICRO=${MICRO:-2} STEPS=${STEPS:-16} INTERVAL=${INTERVAL:-2} KILL_AFTER=${KILL_AFTER:-4}
tiny_gpt2 "$BATCH" --timeout 120 --heartbeat_interval 0.25 --heartbeat_timeout 3 ${TRAIN_FLAGS:-}
sed -i "s/\"train_batch_size\": $BATCH,/\"train_batch_size\": $BATCH, \"train_micro_batch_size_per_gpu\": $MICRO,/" ds.json
grep -q "\"train_micro_batch_size_per_gpu\": $MICRO" ds.json || fail "ds.json: micro batch not set"
[ -z "${DS_EXTRA:-}" ] || sed -i "s/^{/{$DS_EXTRA, /" ds.json
RUN="$U train $F --steps $STEPS --checkpoint_interval $INTERVAL --resume"

"$U" launch -n "$RANKS" --master_port 0 -- $RUN --checkpoint_dir ref --run_name ref > ref.log 2>&1 ||
  { cat ref.log; fail "the uninterrupted $RANKS-rank run"; }

echo "1. $RANKS ranks, ranks ${KILLS[*]} killed one after another"
"$U" launch -n "$RANKS" --max_restarts "${#KILLS[@]}" --master_port 0 -- $RUN --checkpoint_dir ck --run_name r > r.log 2>&1 &
LPID=$!
kill_rank() {  # kill_rank RANK AFTER_ROWS: kills RANK once more than AFTER_ROWS rows are logged
  wait_rows r "$2" 120 || { kill "$LPID"; cat r.log; fail "no progress past $2 rows"; }
  local victim
  victim=$(rank_pid "$LPID" "$1")
  [ -n "$victim" ] || { kill "$LPID"; cat r.log; fail "rank $1's process not found"; }
  kill -9 "$victim"
  T_KILL=$(now)
  ROWS_AT_KILL=$(steps_done r)
}
# Seconds from the kill to the first step logged by the next world.
time_to_step() {
  wait_rows r "$ROWS_AT_KILL" 120 || { kill "$LPID"; cat r.log; fail "no step after the restart"; }
  awk -v a="$T_KILL" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'
}
left=$RANKS after=$KILL_AFTER
for victim in "${KILLS[@]}"; do
  kill_rank "$victim" "$after"
  left=$((left - 1))
  echo "  rank $victim killed at step $(last_step r); first step on $left rank(s) $(time_to_step) s later" \
       "(step $(last_step r))"
  after=$(steps_done r)
done
CODE=0
wait "$LPID" || CODE=$?
[ "$CODE" = 0 ] || { cat r.log; fail "the launcher exited $CODE"; }
for line in "${NAMED[@]}"; do
  grep -qF "$line" r.log || { cat r.log; fail "the restart is not named: $line"; }
done
[ "$(cat ck/latest)" = "global_step$STEPS" ] || fail "latest is $(cat ck/latest), not global_step$STEPS"
checked=$(grep -c "state fingerprint checked" r.log || true)
[ "$checked" -ge "${#KILLS[@]}" ] || { cat r.log; fail "the resumes did not check the state fingerprint ($checked)"; }
echo "  exit 0, latest global_step$STEPS, $checked fingerprints checked"

# The last row of each step (steps after the last checkpoint run twice) against the reference.
python3 - logs/ref/metrics.csv logs/r/metrics.csv r.log "${LOSS_TOL:-1e-3}" "${#KILLS[@]}" <<'PY' || fail "the losses"
import csv, re, sys
def rows(p):
    return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(open(p))}
ref, run = rows(sys.argv[1]), rows(sys.argv[2])
resumed = {int(s) + 1 for s in re.findall(r"loaded \S+ \(step (\d+)\)", open(sys.argv[3]).read())}
assert len(resumed) >= int(sys.argv[5]), f"expected {sys.argv[5]} resumes in the log, found steps {sorted(resumed)}"
assert sorted(run) == sorted(ref), f"steps {sorted(run)} vs {sorted(ref)}"
worst = 0.0
for s in sorted(ref):
    d = abs(run[s] - ref[s])
    ok = d <= 1e-6 * abs(ref[s]) if s in resumed else d <= float(sys.argv[4])
    assert ok, f"step {s}: loss {run[s]!r} vs {ref[s]!r} (first after a restart: {s in resumed})"
    worst = max(worst, d)
print(f"  {len(ref)} steps match the uninterrupted run (max |dloss| {worst:.3g}; resumed at {sorted(resumed)})")
PY

echo "2. what stops a job for good"
expect_stop() {  # expect_stop NAME CODE NEEDLE LAUNCH_FLAGS... -- COMMAND...
  local name=$1 want=$2 needle=$3 code=0
  shift 3
  "$U" launch --master_port 0 "$@" > "$name.log" 2>&1 || code=$?
  [ "$code" = "$want" ] || { cat "$name.log"; fail "$name: exit $code, expected $want"; }
  grep -qF "$needle" "$name.log" || { cat "$name.log"; fail "$name: no '$needle'"; }
  grep -q "restart 1 of" "$name.log" && { cat "$name.log"; fail "$name: restarted"; }
  echo "  $name: exit $code, $(grep -m1 -F "$needle" "$name.log" | cut -c1-150)"
}
expect_stop no_resume 1 "needs its --resume" -n 2 --max_restarts 1 -- "$U" train $F --steps 4 --checkpoint_dir nr
expect_stop usage 2 "not restarting (rank" -n 2 --max_restarts 3 -- $RUN --checkpoint_dir us --no_such_flag
cp -a ref minproc
n=$((RANKS - 1 > 1 ? RANKS - 1 : RANKS))  # 3 of 4, 2 of 2: one death leaves fewer than n
"$U" launch -n $n --max_restarts 1 --min_nproc $n --master_port 0 -- "$U" train $F --steps 100000 \
  --checkpoint_dir minproc --resume --run_name minproc > minproc.log 2>&1 &
LPID=$!
wait_rows minproc 1 120 || { kill "$LPID"; cat minproc.log; fail "min_nproc: no progress"; }
kill -9 "$(rank_pid "$LPID" 0)"
CODE=0
wait "$LPID" || CODE=$?
[ "$CODE" = 137 ] || { cat minproc.log; fail "min_nproc: exit $CODE, expected 137"; }
grep -qF "not restarting ($((n - 1)) device(s) would be left, fewer than --min_nproc $n)" minproc.log ||
  { cat minproc.log; fail "min_nproc: the reason is not named"; }
echo "  min_nproc: exit 137, $(grep -m1 'not restarting' minproc.log)"
echo "all restart cases passed"
