#!/usr/bin/env bash
# UCKPT_TRACE on `uckpt train`: a build with torch's profiler writes each rank's
# Chrome trace of the steps asked for; a build without it refuses the variable,
# naming it; a malformed UCKPT_TRACE_STEPS is refused, naming it, in either.
# usage: trace_test.sh UCKPT WORK_DIR
set -uo pipefail
uckpt=${1:?usage: trace_test.sh UCKPT WORK_DIR}
work=${2:?usage: trace_test.sh UCKPT WORK_DIR}
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
train() {
  "$uckpt" train --steps 3 --n_layer 1 --n_head 2 --n_embd 16 --vocab_size 64 --n_positions 16 --seq_len 16 \
    --train_batch_size 2 --train_micro_batch_size_per_gpu 2 --no_progress --log_dir logs "$@"
}
UCKPT_TRACE=$work/t UCKPT_TRACE_STEPS=5-2 train > bad.log 2>&1 && fail "UCKPT_TRACE_STEPS=5-2 was accepted"
grep -q "UCKPT_TRACE_STEPS" bad.log || fail "UCKPT_TRACE_STEPS=5-2 refused without naming it: $(tail -2 bad.log)"
echo "ok   UCKPT_TRACE_STEPS=5-2 refused: $(grep -m1 UCKPT_TRACE_STEPS bad.log)"
if UCKPT_TRACE=$work/t UCKPT_TRACE_STEPS=2-3 train > run.log 2>&1; then
  [ -s "$work/t.rank0.json" ] || fail "the run passed but wrote no $work/t.rank0.json"
  grep -q '"traceEvents"' "$work/t.rank0.json" || fail "t.rank0.json is not a Chrome trace"
  grep -q "trace of steps 2-3" run.log || fail "the run did not say where the trace went"
  echo "ok   trace of steps 2-3 in t.rank0.json ($(wc -c < "$work/t.rank0.json") bytes)"
else
  grep -q "UCKPT_TRACE is set" run.log || fail "UCKPT_TRACE failed without naming it: $(tail -3 run.log)"
  grep -q "^frame #" run.log && fail "the refusal printed a stack trace"
  ls "$work"/t.* > /dev/null 2>&1 && fail "a refused run left a file: $(ls "$work"/t.*)"
  echo "ok   this build has no torch profiler: $(grep -m1 'UCKPT_TRACE is set' run.log)"
fi
train > plain.log 2>&1 || fail "a run without UCKPT_TRACE failed: $(tail -3 plain.log)"
echo "PASS"
