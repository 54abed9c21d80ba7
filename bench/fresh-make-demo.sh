#!/usr/bin/env bash
# `make demo` as a new user runs it, timed: a fresh clone, no ccache, no pip cache (PyTorch and
# its CUDA libraries come from PyPI). Every output line gets a time stamp; the demo's first
# training step is when the baseline run's metrics.csv gets its first row.
#   bash bench/fresh-make-demo.sh REPO BRANCH DIR [MAKE ARGS...]
#   e.g. bash bench/fresh-make-demo.sh /work/main main /tmp/fresh-demo
#        bash bench/fresh-make-demo.sh /work/main main /tmp/fresh-demo UCKPT_PYTHON=/path/to/python
# Writes DIR.log (stamped output, `uptime` at start and end) and DIR.times (wall, user and sys
# seconds of `make demo` and every process it started); prints a summary. DIR is removed first
# and left in place (it holds a 5 GB .venv: remove it when done).
set -uo pipefail
repo=${1:?usage: fresh-make-demo.sh REPO BRANCH DIR [MAKE ARGS...]} branch=${2:?} dir=${3:?}
shift 3
log=$dir.log times=$dir.times
export CCACHE_DISABLE=1 PIP_NO_CACHE_DIR=1
PIP_CACHE_DIR=$(mktemp -d) && export PIP_CACHE_DIR
stamp() { while IFS= read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done; }
rm -rf "$dir" && git clone -q -b "$branch" "$repo" "$dir" || exit 1
metrics=$dir/demo-out/logs/baseline_4ranks/metrics.csv
( until [ -f "$metrics" ] && [ "$(wc -l < "$metrics")" -ge 2 ]; do sleep 0.5; done
  echo "$EPOCHREALTIME FIRST-STEP $(sed -n 2p "$metrics")" >> "$log" ) &
watcher=$!
start=$EPOCHREALTIME
echo "$start START make demo $* | $(uptime)" > "$log"
(cd "$dir" && /usr/bin/time -f "wall %e user %U sys %S" -o "$times" make demo "$@" 2>&1) | stamp >> "$log"
rc=${PIPESTATUS[0]}
echo "$EPOCHREALTIME END rc $rc | $(uptime)" >> "$log"
kill $watcher 2> /dev/null
rm -rf "$PIP_CACHE_DIR"
first=$(grep -m1 FIRST-STEP "$log" | cut -d' ' -f1)
[ -n "$first" ] && first="$(echo "$first - $start" | bc) s after start" || first="not reached"
echo "make demo: rc $rc, $(cat "$times"); first training step $first"
exit "$rc"
