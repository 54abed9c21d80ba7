#!/bin/bash
# kill -9 at every write point (docs/reliability.md), through the `uckpt`
# command's crash hook (UCKPT_CRASH_AFTER_WRITES, UCKPT_CRASH_RANK): a 2-rank
# engine save is killed right after its k-th write point for every k (rank 0,
# rank 1, both), and each time the previous checkpoint must be intact,
# `latest` must name a complete checkpoint, and a resume from `latest` must
# log the losses of the uninterrupted run. An export is killed at every write
# point, a conversion at the points of its publishing phase (every point of a
# conversion: tests/ckpt/kill_test.cc, in-process, much cheaper).
#
# usage: kill_test.sh UCKPT WORK_DIR
set -euo pipefail
source "$(dirname "$(realpath "$0")")/tiny_gpt2.sh"

tiny_gpt2 4
train() { "$U" launch -n 2 --master_port 0 -- "$U" train $F "$@"; }
loss_at() { awk -F, -v s="$2" '$1 == s { print $2 }' "logs/$1/metrics.csv" | tail -1; }

# Files of a folder with their checksums (relative paths, sorted).
sums() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }

# The uninterrupted run (4 steps), and A: a run of 2 steps that saves at its end.
train --steps 4 --run_name ref > ref.log 2>&1 || { cat ref.log; fail "reference run"; }
train --steps 2 --checkpoint_dir base --run_name a > a.log 2>&1 || { cat a.log; fail "run A"; }
[ "$(cat base/latest)" = global_step2 ] || fail "run A did not save global_step2"
sums base/global_step2 > A.sums
[ -s A.sums ] || fail "no files in A"
# A complete save B (global_step3), to know what a finished B looks like and
# how many write points each rank's save has.
cp -a base count
UCKPT_COUNT_WRITES=1 train --steps 3 --checkpoint_dir count --resume --run_name count > count.log 2>&1 ||
  { cat count.log; fail "counting run"; }
K0=$(sed -n 's/^uckpt: write points: \([0-9]*\) rank 0$/\1/p' count.log)
K1=$(sed -n 's/^uckpt: write points: \([0-9]*\) rank 1$/\1/p' count.log)
[ -n "$K0" ] && [ -n "$K1" ] && [ "$K0" -gt 5 ] && [ "$K1" -ge 3 ] || { cat count.log; fail "no write point counts"; }
sums count/global_step3 > B.sums
for s in 3 4; do [ -n "$(loss_at ref $s)" ] || fail "reference has no loss at step $s"; done

# A checkpoint folder is complete: the files (and bytes) of one finished save.
is_a() { [ "$(sums "$1")" = "$(cat A.sums)" ]; }
is_b() {
  # B's bytes differ between runs only where nothing makes them (none today):
  # compare the file list and sizes, and the manifest's own check.
  [ "$(cd "$1" && find . -type f | sort)" = "$(cd count/global_step3 && find . -type f | sort)" ] &&
    [ "$(sums "$1")" = "$(cat B.sums)" ]
}

kills=0
resumes=0
check_save_kill() {  # $1: the run's folder, $2: description
  local run=$1 what=$2
  is_a "$run/global_step2" || fail "$what: A (global_step2) changed"
  local latest
  latest=$(cat "$run/latest")
  case $latest in
    global_step2) ;;
    global_step3) is_b "$run/global_step3" || fail "$what: latest names an incomplete global_step3" ;;
    *) fail "$what: latest holds '$latest'" ;;
  esac
  if [ -e "$run/global_step3" ]; then is_b "$run/global_step3" || fail "$what: an incomplete global_step3 under its final name"; fi
  [ -z "${KILL_TEST_VERBOSE:-}" ] || echo "$what: latest $latest; $(ls -A "$run" | tr '\n' ' ')"
  # Resume from `latest` and compare the next step's loss with the reference.
  # A resume reads only the folder `latest` names: once one from the same
  # bytes (and the same leftovers beside it, pids aside) matched, another
  # would compute the same numbers, so it is not run again.
  local next=$(( ${latest#global_step} + 1 ))
  local key
  key=$( (echo "$latest"; sums "$run/$latest"; ls -A "$run" | sed 's/[0-9]*$//') | sha256sum | cut -c1-16)
  if grep -qx "$key" resumed.keys 2> /dev/null; then return; fi
  rm -rf logs/resume
  train --steps "$next" --checkpoint_dir "$run" --resume --run_name resume > resume.log 2>&1 ||
    { cat resume.log; fail "$what: resume from $latest failed"; }
  [ "$(loss_at resume "$next")" = "$(loss_at ref "$next")" ] ||
    fail "$what: step $next loss $(loss_at resume "$next") after resuming, $(loss_at ref "$next") uninterrupted"
  resumes=$((resumes + 1))
  echo "$key" >> resumed.keys
}

# 1. The engine save: kill rank 0 at each of its write points, then rank 1 at
#    each of its, then both at once. The killed runs go KILL_TEST_JOBS (3) at
#    a time, each in a copy of A (a launch mostly waits on the rendezvous).
kill_save() {  # $1: rank or "both", $2: k
  local run=kill_$1_$2
  rm -rf "$run" "logs/$run"
  cp -a base "$run"
  (
    export UCKPT_CRASH_AFTER_WRITES=$2
    [ "$1" = both ] || export UCKPT_CRASH_RANK=$1
    train --steps 3 --checkpoint_dir "$run" --resume --run_name "$run"
  ) > "$run.log" 2>&1
  echo $? > "$run.rc"
}
runs=()
for spec in "0 $K0" "1 $K1" "both $K1"; do
  set -- $spec
  for k in $(seq 1 "$2"); do
    while [ "$(jobs -rp | wc -l)" -ge "${KILL_TEST_JOBS:-3}" ]; do wait -n || true; done
    kill_save "$1" "$k" &
    runs+=("$1 $k")
  done
done
wait
for r in "${runs[@]}"; do
  set -- $r
  run=kill_$1_$2
  what="save, rank $1 killed after write point $2"
  [ "$(cat "$run.rc")" != 0 ] || { cat "$run.log"; fail "$what: the launch succeeded"; }
  grep -q "killed by signal 9" "$run.log" || { cat "$run.log"; fail "$what: no rank was killed"; }
  kills=$((kills + 1))
  check_save_kill "$run" "$what"
  rm -rf "$run"
done
echo "engine save: $kills kill points (rank 0: $K0, rank 1: $K1, both: $K1); $resumes resumes from the distinct states left match the uninterrupted losses"

# 2. convert: the old universal output and latest_universal stay, a new
#    output appears whole or not at all; both into a new folder and --force
#    over the old one.
"$U" convert -q --threads 1 base/global_step2 conv/u
"$U" convert -q --threads 1 count/global_step3 newconv/v
sums conv/u > U.sums
sums newconv/v > V.sums
[ "$(cat U.sums)" != "$(cat V.sums)" ] || fail "the two conversions are identical (test would prove nothing)"
# Write points of each: into a new folder, and --force over the old one
# (one more: the old folder's removal).
count_convert() {
  rm -rf convcount
  cp -a conv convcount
  UCKPT_COUNT_WRITES=1 "$U" convert -q --threads 1 --force count/global_step3 "convcount/$1" 2> cc.log ||
    { cat cc.log; fail "convert"; }
  sed -n 's/^uckpt: write points: \([0-9]*\)$/\1/p' cc.log
}
KCN=$(count_convert v)
KCF=$(count_convert u)
[ -n "$KCN" ] && [ "$KCN" -gt 20 ] && [ "$KCF" = $((KCN + 1)) ] || fail "convert write points: $KCN new, $KCF --force"
ckills=0
# Every point of the conversion is killed in tests/ckpt/kill_test.cc; here,
# through the command, the first two and the last 12: the manifest, syncfs,
# the rename (or exchange and removal), the folder fsync and latest_universal's five.
for mode in new force; do
  if [ $mode = new ]; then n=$KCN; else n=$KCF; fi
  for k in 1 2 $(seq $((n - 11)) "$n"); do
    rm -rf cv
    cp -a conv cv
    if [ $mode = new ]; then out=cv/v; else out=cv/u; fi
    rc=0
    (UCKPT_CRASH_AFTER_WRITES=$k "$U" convert -q --threads 1 --force count/global_step3 $out; exit $?) 2> /dev/null || rc=$?
    [ $rc = 137 ] || fail "convert ($mode) after write point $k: exit status $rc, not killed"
    ckills=$((ckills + 1))
    what="convert ($mode) killed after write point $k"
    lu=$(cat cv/latest_universal)
    if [ $mode = new ]; then
      [ "$(sums cv/u)" = "$(cat U.sums)" ] || fail "$what: the old output changed"
      if [ -e cv/v ]; then [ "$(sums cv/v)" = "$(cat V.sums)" ] || fail "$what: a partial cv/v"; fi
      case $lu in u) ;; v) [ -e cv/v ] || fail "$what: latest_universal names a missing folder" ;; *) fail "$what: latest_universal '$lu'" ;; esac
    else
      s=$(sums cv/u)
      [ "$s" = "$(cat U.sums)" ] || [ "$s" = "$(cat V.sums)" ] || fail "$what: cv/u is neither the old nor the new output"
      [ "$lu" = u ] || fail "$what: latest_universal '$lu'"
    fi
  done
done
echo "convert: $ckills kill points (into a new folder: 14 of $KCN write points; --force over the old one: 14 of $KCF)"

# 3. export: the old file stays, or the new one is complete.
"$U" export -q base/global_step2 old.safetensors
"$U" export -q count/global_step3 new.safetensors
cmp -s old.safetensors new.safetensors && fail "the two exports are identical"
UCKPT_COUNT_WRITES=1 "$U" export -q count/global_step3 ex.safetensors 2> ec.log
KE=$(sed -n 's/^uckpt: write points: \([0-9]*\)$/\1/p' ec.log)
[ -n "$KE" ] && [ "$KE" -ge 5 ] || { cat ec.log; fail "no write point count for export"; }
for k in $(seq 1 "$KE"); do
  cp old.safetensors ex.safetensors
  rc=0
  (UCKPT_CRASH_AFTER_WRITES=$k "$U" export -q count/global_step3 ex.safetensors; exit $?) 2> /dev/null || rc=$?
  [ $rc = 137 ] || fail "export after write point $k: exit status $rc, not killed"
  cmp -s ex.safetensors old.safetensors || cmp -s ex.safetensors new.safetensors ||
    fail "export killed after write point $k: the file is neither the old nor the new one"
done
echo "export: $KE kill points"
echo "kill points tested: $((kills + ckills + KE)) (save $kills, convert $ckills, export $KE); all previous outputs intact"
