#!/usr/bin/env bash
# Runs one libFuzzer target for $FUZZ_SECONDS (default 60) on a copy of its seed
# corpus. Fails (non-zero) on any finding: crash, sanitizer report, leak,
# uncaught exception, an input taking > 10 s or a process over 2 GB.
# Usage: run_fuzzer.sh FUZZER SEED_DIR WORK_DIR
#
# libFuzzer's progress lines go to WORK_DIR/fuzzer.log, not to the test's output:
# a finding is then reported in a few lines (the report, the input in hex, a
# replay) that a CI log shows whole, instead of drowning in thousands of lines.
set -euo pipefail
fuzzer=$1 seeds=$2 work=$3
seconds=${FUZZ_SECONDS:-60}
log=$work/fuzzer.log

rm -rf "$work"
mkdir -p "$work/corpus" "$work/artifacts"
cp "$seeds"/* "$work/corpus/"
echo "fuzzing $(basename "$fuzzer") for ${seconds}s; corpus $work/corpus; log $log"
status=0
"$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -dict="$(dirname "$0")/torch.dict" \
  -artifact_prefix="$work/artifacts/" -print_final_stats=1 "$work/corpus" >"$log" 2>&1 || status=$?
found=$(ls -A "$work/artifacts")
if [ "$status" = 0 ] && [ -z "$found" ]; then
  grep -E '^(Done|stat::(number_of_executed_units|new_units_added|peak_rss_mb))' "$log" || true
  exit 0
fi

echo "FINDING (exit $status): ${found:-no input saved}"
grep -m1 -E '^INFO: Seed:' "$log" || true
# The report: from the first line that names a problem to the end of the log.
first=$(grep -n -m1 -E 'ERROR|ALARM|WARNING: |round trip changed|terminate called|Assertion|runtime error|deadly signal' \
  "$log" | cut -d: -f1 || true)
echo "--- report (fuzzer.log from line ${first:-<none>}; last 80 lines otherwise) ---"
if [ -n "$first" ]; then sed -n "${first},\$p" "$log" | grep -v -E '^#[0-9]+' | head -n 80
else tail -n 80 "$log"; fi
for f in $found; do
  echo "--- input $f ($(stat -c %s "$work/artifacts/$f") bytes, first 512 in hex) ---"
  od -A d -t x1 -N 512 "$work/artifacts/$f"
  echo "--- replay of $f ---"
  "$fuzzer" "$work/artifacts/$f" 2>&1 | grep -v -E '^(INFO|Running|Executed|\*\*\*)' | head -n 40 || true
done
echo "reproduce: $fuzzer $work/artifacts/<file>; then add the input to $seeds once fixed"
exit 1
