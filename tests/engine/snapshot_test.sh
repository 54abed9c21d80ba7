#!/bin/bash
# Snapshots in host memory (issue 43, "little lost work"; docs/reliability.md):
# `uckpt train --snapshot-every N` keeps the state in shared memory, and a
# restart of the job loads it when it is newer than the durable checkpoint.
# The tiny GPT-2 on CPU ranks, global batch 24 = micro 2 x GA 3/4 x 4/3 ranks.
# Snapshots go under a private root (UCKPT_SNAPSHOT_ROOT, in /dev/shm).
#
# usage: snapshot_test.sh UCKPT WORK_DIR CASE
#   restart  4 ranks, a snapshot every step and no durable save before the
#            end; rank 2 SIGKILLed after step 5: `uckpt launch --max_restarts 1`
#            goes on at 3 ranks from the snapshot with at most 2 steps lost,
#            its files and state fingerprint checked; every step's loss is the
#            uninterrupted run's (the first after the restart within 1e-6
#            relative, the others 1e-3 absolute); a clean end removes the folder.
#   half     rank 1 SIGKILLed at its first write point of a snapshot (the
#            crash hook): that snapshot is left half-written (its temporary
#            folder), `latest` names the one before, which a 3-rank resume
#            of the same job loads; its losses are those the killed run logged.
#   stale    a snapshot folder of another job under this job's name (its
#            `owner` names the other job) and one of a job whose launcher
#            is gone: neither is read; the resume loads the durable
#            checkpoint; the first snapshot replaces the foreign folder. A
#            snapshot of this job with a damaged file: its hash check fails
#            and the resume falls back to the durable checkpoint.
#   config   bad values and places are refused, naming the key or variable.
set -euo pipefail
source "$(dirname "$(realpath "$0")")/tiny_gpt2.sh"
CASE=$3

ROOT=$(mktemp -d /dev/shm/uckpt-snapshot-test.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
export UCKPT_SNAPSHOT_ROOT=$ROOT
unset UCKPT_JOB_ID TORCHELASTIC_RUN_ID

# The losses of run $2 against run $1's (an uninterrupted run), on the steps
# both logged: the first after the resume at step $3 within 1e-6 relative.
compare_losses() {
  python3 - "logs/$1/metrics.csv" "logs/$2/metrics.csv" "$3" <<'PY' || fail "the losses of $2"
import csv, sys
def rows(p):
    return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(open(p))}
ref, run = rows(sys.argv[1]), rows(sys.argv[2])
first = int(sys.argv[3]) + 1
assert first in run and first in ref, f"step {first} not in both: {sorted(run)} vs {sorted(ref)}"
assert sorted(s for s in run if s >= first) == list(range(first, max(run) + 1)), f"steps {sorted(run)}"
worst = 0.0
both = sorted(s for s in run if s in ref)
for s in both:
    d = abs(run[s] - ref[s])
    ok = d <= 1e-6 * abs(ref[s]) if s == first else d <= 1e-3
    assert ok, f"step {s}: loss {run[s]!r} vs {ref[s]!r}"
    worst = max(worst, d)
print(f"  {len(both)} steps match the uninterrupted run (max |dloss| {worst:.3g}; first after the resume: {first})")
PY
}
# The step the run's log says it resumed at, and from what.
resumed_step() { grep -m1 -o "loaded \S* (step [0-9]*)" "$1" | sed 's/.*(step \([0-9]*\))/\1/'; }

tiny_gpt2 24 --timeout 120 --heartbeat_interval 0.25 --heartbeat_timeout 3
sed -i 's/"train_batch_size": 24,/"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2,/' ds.json
STEPS=12
RUN="$U train $F --steps $STEPS --checkpoint_interval 100 --resume"
reference() {
  "$U" launch -n 4 --master_port 0 -- $RUN --checkpoint_dir ref --run_name ref > ref.log 2>&1 ||
    { cat ref.log; fail "the uninterrupted 4-rank run"; }
}

case "$CASE" in
restart)
  reference
  "$U" launch -n 4 --max_restarts 1 --master_port 0 -- $RUN --snapshot-every 1 --checkpoint_dir ck --run_name r \
    > r.log 2>&1 &
  LPID=$!
  wait_rows r 4 120 || { kill "$LPID" 2> /dev/null || true; cat r.log; fail "no progress"; }
  ls "$ROOT"/uckpt-snapshots-launch-* > /dev/null 2>&1 || { kill "$LPID" 2> /dev/null || true; cat r.log; fail "no snapshot folder in $ROOT"; }
  kill -9 "$(rank_pid "$LPID" 2)"
  KILLED_AT=$(last_step r)
  CODE=0
  wait "$LPID" || CODE=$?
  [ "$CODE" = 0 ] || { cat r.log; fail "the launcher exited $CODE"; }
  grep -q "restart 1 of 1: device 2 (rank 2) left out" r.log || { cat r.log; fail "no restart"; }
  grep -q "loaded $ROOT/uckpt-snapshots-launch-[0-9-]*/global_step[0-9]* (step [0-9]*) from the snapshot in host memory" r.log ||
    { cat r.log; fail "the restart did not load the snapshot"; }
  grep -q "state fingerprint checked" r.log || { cat r.log; fail "the snapshot's state fingerprint was not checked"; }
  RESUMED=$(resumed_step r.log)
  LOST=$((KILLED_AT - RESUMED))
  echo "  rank 2 killed after step $KILLED_AT; resumed at 3 ranks from the snapshot of step $RESUMED ($LOST step(s) lost)"
  [ "$LOST" -le 2 ] || { cat r.log; fail "$LOST steps lost (at most 2 with a snapshot every step)"; }
  compare_losses ref r "$RESUMED"
  grep "uckpt train: snapshots every" r.log | tail -1
  grep -q "snapshots every 1 step(s): [0-9]* taken" r.log || { cat r.log; fail "no snapshot summary"; }
  [ -z "$(ls -A "$ROOT")" ] || { ls -la "$ROOT"; fail "the snapshot folder outlived the job"; }
  ;;
half)
  export UCKPT_JOB_ID=half-job
  SNAP=$ROOT/uckpt-snapshots-half-job
  # Rank 1's write points per snapshot (its optimizer-states file): counted on a run of 2 snapshots and 1.
  count() {
    UCKPT_COUNT_WRITES=1 "$U" launch -n 4 --master_port 0 -- "$U" train $F --steps "$1" --checkpoint_interval 100 \
      --snapshot-every 1 --checkpoint_dir "cnt$1" --run_name "cnt$1" 2>&1 |
      grep -oE 'write points: [0-9]+ rank 1([^0-9]|$)' | grep -oE '[0-9]+' | head -1
  }
  C1=$(count 1 || true) C2=$(count 2 || true)
  [[ "$C1" =~ ^[0-9]+$ && "$C2" =~ ^[0-9]+$ ]] || fail "rank 1's write points were not counted ('$C1', '$C2')"
  PER=$((C2 - C1))
  [ "$PER" -gt 0 ] || fail "rank 1 counts no write point per snapshot"
  K=$((4 * PER + 1))  # its first write point of the 5th snapshot it writes
  CODE=0
  UCKPT_CRASH_AFTER_WRITES=$K UCKPT_CRASH_RANK=1 "$U" launch -n 4 --master_port 0 -- $RUN --snapshot-every 1 \
    --checkpoint_dir ck --run_name h > h.log 2>&1 || CODE=$?
  [ "$CODE" != 0 ] || { cat h.log; fail "rank 1 was not killed at write point $K"; }
  HALF=$(ls -a "$SNAP" | sed -n 's/^\.global_step\([0-9]*\)\.uckpt-tmp$/\1/p')
  [ -n "$HALF" ] || { ls -la "$SNAP"; cat h.log; fail "no half-written snapshot in $SNAP"; }
  LATEST=$(sed -n 's/^global_step//p' "$SNAP/latest")
  echo "  rank 1 killed at its write point $K ($PER per snapshot): snapshot $HALF half-written, latest names step $LATEST"
  [ "$LATEST" -lt "$HALF" ] || fail "latest names step $LATEST, not one before the half-written $HALF"
  RUN3="$U train $F --steps $STEPS --checkpoint_interval 100 --resume --snapshot-every 1"
  "$U" launch -n 3 --master_port 0 -- $RUN3 --checkpoint_dir ck --run_name h2 > h2.log 2>&1 ||
    { cat h2.log; fail "the 3-rank resume"; }
  grep -q "loaded $SNAP/global_step$LATEST (step $LATEST) from the snapshot in host memory" h2.log ||
    { cat h2.log; fail "the resume did not load the snapshot of step $LATEST"; }
  grep -q "state fingerprint checked" h2.log || { cat h2.log; fail "no fingerprint check"; }
  compare_losses h h2 "$LATEST"  # h: the killed run, steps 1 to the kill
  [ ! -e "$SNAP" ] || fail "the clean end left $SNAP"
  ;;
stale)
  # A durable checkpoint at step 4, and another job's snapshot of step 8 (owner: job-a).
  UCKPT_JOB_ID=job-a "$U" launch -n 4 --master_port 0 -- "$U" train $F --steps 8 --checkpoint_interval 4 \
    --snapshot-every 1 --checkpoint_dir a --run_name a > a.log 2>&1 || { cat a.log; fail "job a"; }
  # (Its clean end removed its folder: make one as a killed job leaves it, from its step-8 checkpoint.)
  mkdir -p "$ROOT/uckpt-snapshots-job-b"
  cp -a a/global_step8 "$ROOT/uckpt-snapshots-job-b/"
  echo global_step8 > "$ROOT/uckpt-snapshots-job-b/latest"
  printf 'job job-a\ncheckpoint_dir %s\n' "$PWD/a" > "$ROOT/uckpt-snapshots-job-b/owner"
  mkdir -p b && cp -a a/global_step4 b/ && echo global_step4 > b/latest
  # And a folder of a launcher that no longer runs (pid 1 never started at tick 1).
  cp -a "$ROOT/uckpt-snapshots-job-b" "$ROOT/uckpt-snapshots-launch-1-1"
  UCKPT_JOB_ID=job-b "$U" launch -n 4 --master_port 0 -- "$U" train $F --steps 6 --checkpoint_interval 100 \
    --resume --snapshot-every 1 --checkpoint_dir b --run_name b > b.log 2>&1 ||
    { cat b.log; fail "job b"; }
  grep -q "snapshot $ROOT/uckpt-snapshots-job-b not used: it was made by another job" b.log ||
    { cat b.log; fail "the foreign snapshot was not named as ignored"; }
  [ "$(resumed_step b.log)" = 4 ] && grep -q "loaded b (step 4)" b.log ||
    { cat b.log; fail "job b did not resume from its durable checkpoint (step 4)"; }
  grep -q "replacing $ROOT/uckpt-snapshots-job-b, which holds another job's snapshots" b.log ||
    { cat b.log; fail "job b's first snapshot did not replace the foreign folder"; }
  compare_losses a b 4
  echo "  job b ignored job a's snapshot of step 8, resumed from its durable step 4, replaced the folder"
  grep -q "removed $ROOT/uckpt-snapshots-launch-1-1, left by a launcher that no longer runs" b.log &&
    fail "a launcher given UCKPT_JOB_ID removed folders"  # only launchers that make ids clean up
  "$U" launch -n 2 --master_port 0 -- "$U" train $F --steps 6 --checkpoint_interval 100 --resume \
    --snapshot-every 1 --checkpoint_dir b --run_name b2 > b2.log 2>&1 || { cat b2.log; fail "job b2"; }
  grep -q "removed $ROOT/uckpt-snapshots-launch-1-1, left by a launcher that no longer runs" b2.log ||
    { cat b2.log; fail "the dead launcher's folder was not removed"; }
  [ "$(resumed_step b2.log)" = 6 ] || { cat b2.log; fail "job b2 did not resume from b's step 6"; }
  echo "  a launcher's folder left by a killed launcher removed by the next launch"
  # A snapshot of this job whose file was damaged (same size): its hash check fails on every
  # rank and the resume falls back to the durable checkpoint (b's step 6).
  C=$ROOT/uckpt-snapshots-job-c
  mkdir -p "$C" && cp -a a/global_step8 "$C/" && echo global_step8 > "$C/latest"
  printf 'job job-c\ncheckpoint_dir %s\n' "$PWD/b" > "$C/owner"
  printf 'X' | dd of="$C/global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt" bs=1 seek=2000 conv=notrunc status=none
  UCKPT_JOB_ID=job-c "$U" launch -n 2 --master_port 0 -- "$U" train $F --steps 8 --checkpoint_interval 100 --resume \
    --snapshot-every 1 --checkpoint_dir b --run_name c > c.log 2>&1 || { cat c.log; fail "job c"; }
  grep -q "the snapshot $C/global_step8 could not be loaded" c.log && grep -q "content differs from the manifest" c.log &&
    grep -q "); loading the durable checkpoint" c.log ||
    { cat c.log; fail "the damaged snapshot was not refused"; }
  [ "$(resumed_step c.log)" = 6 ] && grep -q "loaded b (step 6)" c.log || { cat c.log; fail "job c did not resume from b"; }
  compare_losses a c 6
  echo "  a damaged snapshot refused by its hashes; the resume fell back to the durable checkpoint"
  ;;
config)
  expect_refused() {  # NEEDLE COMMAND...
    local needle=$1 code=0
    shift
    "$@" > out.log 2>&1 || code=$?
    [ "$code" != 0 ] && grep -qF -- "$needle" out.log || { cat out.log; fail "not refused with '$needle' (exit $code)"; }
    echo "  refused (exit $code): $(grep -m1 -F -- "$needle" out.log | cut -c1-160)"
  }
  expect_refused "--snapshot-every" "$U" train $F --steps 1 --checkpoint_dir c --snapshot-every -1
  sed 's/"async_save": false/"async_save": false, "snapshot_interval": -2/' ds.json > neg.json
  expect_refused "checkpoint.snapshot_interval must be a number of steps >= 0" "$U" train ${F/--config ds.json/--config neg.json} --steps 1
  sed 's/"async_save": false/"async_save": false, "snapshot_interval": "often"/' ds.json > str.json
  expect_refused "checkpoint.snapshot_interval" "$U" train ${F/--config ds.json/--config str.json} --steps 1
  expect_refused "needs --checkpoint_dir" env UCKPT_JOB_ID=x "$U" train $F --steps 1 --snapshot-every 1
  expect_refused "set UCKPT_JOB_ID" "$U" train $F --steps 1 --checkpoint_dir c --snapshot-every 1
  ;;
*) fail "unknown case $CASE" ;;
esac
echo "snapshot case $CASE passed"
