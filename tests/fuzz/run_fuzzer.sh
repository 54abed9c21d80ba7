#!/usr/bin/env bash
# Runs one libFuzzer target for $FUZZ_SECONDS (default 60) on a copy of its seed
# corpus. Fails (non-zero) on any finding: crash, sanitizer report, leak,
# uncaught exception, an input taking > 10 s or a process over 2 GB.
# Usage: run_fuzzer.sh FUZZER SEED_DIR WORK_DIR
set -euo pipefail
fuzzer=$1 seeds=$2 work=$3
seconds=${FUZZ_SECONDS:-60}

rm -rf "$work"
mkdir -p "$work/corpus" "$work/artifacts"
cp "$seeds"/* "$work/corpus/"
echo "fuzzing $(basename "$fuzzer") for ${seconds}s; corpus $work/corpus"
status=0
"$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -dict="$(dirname "$0")/torch.dict" \
  -artifact_prefix="$work/artifacts/" -print_final_stats=1 "$work/corpus" || status=$?
found=$(ls -A "$work/artifacts")
if [ "$status" != 0 ] || [ -n "$found" ]; then
  echo "FINDING (exit $status): $found"
  echo "reproduce: $fuzzer $work/artifacts/<file>; then add the input to $seeds once fixed"
  exit 1
fi
