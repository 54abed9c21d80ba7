#!/usr/bin/env bash
# Runs one libFuzzer target for $FUZZ_SECONDS (default 60) on a copy of its seed
# corpus. Fails (non-zero) on any finding: crash, sanitizer report, leak,
# uncaught exception, an input taking > 10 s or a process over 2 GB.
# Usage: run_fuzzer.sh FUZZER SEED_DIR WORK_DIR
#
# libFuzzer's progress lines go to WORK_DIR/fuzzer.log, not to the test's output:
# a finding is then reported in a few lines (the report, the input in hex, a
# replay) that a CI log shows whole, instead of drowning in thousands of lines.
#
# libFuzzer's timeout is wall-clock time: a machine that stalls (a loaded or
# paused VM) can time out an input that runs in milliseconds. A timeout whose
# input, replayed, finishes within the limit is reported as a stall and the
# fuzzing goes on for the time left (twice at most); one that times out again
# is a finding.
set -euo pipefail
fuzzer=$1 seeds=$2 work=$3
seconds=${FUZZ_SECONDS:-60}
timeout_s=10
log=$work/fuzzer.log

rm -rf "$work"
mkdir -p "$work/corpus" "$work/artifacts" "$work/stalls"
: >"$log"
cp "$seeds"/* "$work/corpus/"
echo "fuzzing $(basename "$fuzzer") for ${seconds}s; corpus $work/corpus; log $log"
deadline=$((SECONDS + seconds))
stalls=0
while :; do
  left=$((deadline - SECONDS))
  [ "$left" -ge 1 ] || left=1
  start=$(( $(wc -l <"$log") + 1 ))  # this run's first line in the log
  status=0
  "$fuzzer" -max_total_time="$left" -timeout="$timeout_s" -rss_limit_mb=2048 -dict="$(dirname "$0")/torch.dict" \
    -artifact_prefix="$work/artifacts/" -print_final_stats=1 "$work/corpus" >>"$log" 2>&1 || status=$?
  found=$(ls -A "$work/artifacts")
  if [ "$status" = 0 ] && [ -z "$found" ]; then
    grep -E '^(Done|stat::(number_of_executed_units|new_units_added|peak_rss_mb))' "$log" || true
    [ "$stalls" = 0 ] || echo "ok, after $stalls stall(s) (inputs in $work/stalls)"
    exit 0
  fi
  # Only timeouts, each of which runs within the limit when replayed: a stall.
  stalled=0
  [ -z "$found" ] || stalled=1
  for f in $found; do
    case $f in
      timeout-*) "$fuzzer" -timeout="$timeout_s" "$work/artifacts/$f" >"$work/stalls/$f.replay" 2>&1 || stalled=0 ;;
      *) stalled=0 ;;
    esac
  done
  if [ "$stalled" = 1 ] && [ "$stalls" -lt 2 ]; then
    stalls=$((stalls + 1))
    echo "stall: $found timed out but ran within ${timeout_s}s when replayed; fuzzing on for $((deadline - SECONDS))s"
    mv "$work/artifacts/"* "$work/stalls/"
    [ $((deadline - SECONDS)) -ge 1 ] && continue
    echo "ok, after $stalls stall(s) (inputs in $work/stalls)"
    exit 0
  fi
  break
done

echo "FINDING (exit $status): ${found:-no input saved}"
grep -m1 -E '^INFO: Seed:' "$log" || true
# The report: from the last run's first line that names a problem to its end.
first=$(tail -n +"$start" "$log" | grep -n -m1 -E \
  'ERROR|ALARM|WARNING: |round trip changed|terminate called|Assertion|runtime error|deadly signal' | cut -d: -f1 || true)
echo "--- report (the last run's log from its line ${first:-<none>}; its last 80 lines otherwise) ---"
if [ -n "$first" ]; then tail -n +"$start" "$log" | tail -n +"$first" | grep -v -E '^#[0-9]+' | head -n 80
else tail -n 80 "$log"; fi
for f in $found; do
  echo "--- input $f ($(stat -c %s "$work/artifacts/$f") bytes, first 512 in hex) ---"
  od -A d -t x1 -N 512 "$work/artifacts/$f"
  echo "--- replay of $f ---"
  "$fuzzer" -timeout="$timeout_s" "$work/artifacts/$f" 2>&1 | grep -v -E '^(INFO|Running|Executed|\*\*\*)' | head -n 40 || true
done
echo "reproduce: $fuzzer $work/artifacts/<file>; then add the input to $seeds once fixed"
exit 1
