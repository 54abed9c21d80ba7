#!/bin/bash
# `uckpt launch` given DeepSpeed's launcher's options (as DeepSpeedExamples' run scripts write them:
# `deepspeed --num_gpus 1 --bind_cores_to_rank train.py`) refuses each by its name, saying what to use instead,
# and starts nothing; before, CLI11 said "argument not expected" about the next word.
# usage: launch_deepspeed_options_test.sh UCKPT
set -uo pipefail
U=$1
fail=0
check() {  # check OPTION [VALUE]: refused, naming OPTION and DeepSpeed's launcher, and nothing ran
  local out rc
  out=$("$U" launch -n 1 "$@" -- /bin/sh -c 'echo RAN' 2>&1); rc=$?
  if [ $rc = 0 ] || grep -q RAN <<< "$out" || ! grep -q -- "launch: $1 is an option of DeepSpeed's launcher" <<< "$out"; then
    echo "FAIL: uckpt launch -n 1 $* -- ...: exit $rc: $out"; fail=$((fail + 1))
  else echo "ok: $1 -> $(tail -1 <<< "$out")"; fi
}
check --num_gpus 2
check --num_nodes 1
check --hostfile /dev/null
check --autotuning run
check --bind_cores_to_rank
check --include localhost:0
check --no_python
# uckpt launch's own options still work
out=$("$U" launch -n 1 --master_port 0 -- /bin/sh -c 'echo RAN' 2>&1) && grep -q RAN <<< "$out" ||
  { echo "FAIL: a plain launch: $out"; fail=$((fail + 1)); }
echo "$fail failed"
exit $fail
