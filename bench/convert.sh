#!/bin/bash
# Benchmark of `uckpt convert` (issue 3): writes a synthetic ZeRO-2 checkpoint
# (default 300 M parameters, fp32 master + Adam moments, world size 4) with
# bench/convert_gen and converts it, printing
#   - convert wall time / `cp -r` wall time of the same folder (page cache warm
#     for both; target <= 1.2x),
#   - convert time with -j 1, -j 2 and the default (one thread per core),
#   - peak RSS (target <= 2 x the largest parameter's state + 256 MiB),
#   - bytes read and written.
# Each time is the best of --runs runs. Outputs are written with --no-sync,
# as cp does not sync either.
# Usage: bench/convert.sh [--params 3e8] [--dp 4] [--runs 3] [--build build]
#                         [--uckpt PATH] [--gen PATH] [--dir /tmp/uckpt-bench-convert] [--keep]
set -euo pipefail
PARAMS=3e8 DIR=${TMPDIR:-/tmp}/uckpt-bench-convert
USAGE=$(sed -n '/^# Usage:/,/^[^#]/p' "$0" | grep '^#' | cut -c3-)
source "$(dirname "$0")/synthetic-ckpt.sh"
sync

now() { date +%s.%N; }
calc() { awk "BEGIN { printf \"%.2f\", $1 }"; }
min() { sort -g | head -1; }

# cp -r of the same folder.
cp_times=()
for ((i = 0; i < RUNS; i++)); do
  rm -rf "$DIR/copy"; sync
  t0=$(now); cp -r "$IN" "$DIR/copy"; t1=$(now)
  cp_times+=("$(calc "$t1 - $t0")")
done
rm -rf "$DIR/copy"; sync
T_CP=$(printf "%s\n" "${cp_times[@]}" | min)

# Best wall time of RUNS conversions with the given flags; each run's peak
# RSS (from uckpt's summary line) goes to $DIR/rss.
convert() {
  local times=()
  for ((i = 0; i < RUNS; i++)); do
    rm -rf "$DIR/out"; sync
    t0=$(now)
    "$UCKPT" convert "$IN" "$DIR/out" --no-sync "$@" 2>"$DIR/convert.err" >/dev/null
    t1=$(now)
    times+=("$(calc "$t1 - $t0")")
    grep "^convert: wrote" "$DIR/convert.err" | sed 's/.*peak RSS //' >> "$DIR/rss"
  done
  printf "%s\n" "${times[@]}" | min
}
rm -f "$DIR/rss"
T_DEF=$(convert)
T_J1=$(convert -j 1)
T_J2=$(convert -j 2)
"$UCKPT" convert "$IN" "$DIR/out" --no-sync --force 2>"$DIR/convert.err"
SUMMARY=$(grep "^convert: wrote" "$DIR/convert.err")
rm -rf "$DIR/out"
IN_BYTES=$(du -sb "$IN" | cut -f1)
READ=$(echo "$SUMMARY" | sed 's/.*read [^(]*(\([0-9]*\) bytes).*/\1/')
WRITTEN=$(echo "$SUMMARY" | sed 's/.*wrote [^(]*(\([0-9]*\) bytes).*/\1/')
NPARAMS=$(awk "BEGIN { printf \"%d\", $PARAMS }")
BIG=$((50257 * 1024 < NPARAMS ? 50257 * 1024 : NPARAMS))  # wte.weight: convert_gen's largest parameter

echo "== uckpt convert benchmark: $PARAMS parameters, ZeRO-2, world size $DP, $(nproc) cores, best of $RUNS"
echo "input folder           $(calc "$IN_BYTES / 1e9") GB"
echo "cp -r                  $T_CP s"
echo "convert (default -j)   $T_DEF s = $(calc "$T_DEF / $T_CP")x cp -r (target <= 1.2x)"
echo "convert -j 1           $T_J1 s"
echo "convert -j 2           $T_J2 s  (-j 1 / -j 2 = $(calc "$T_J1 / $T_J2"))"
echo "peak RSS               $(sort -h "$DIR/rss" | tail -1) (target <= $(calc "(2 * $BIG * 12 + 268435456) / 1048576") MiB = 2 x largest param state + 256 MiB)"
echo "bytes read / written   $READ / $WRITTEN ($(calc "$READ / $NPARAMS") / $(calc "$WRITTEN / $NPARAMS") per parameter; ds_to_universal: ~28 / ~26 + temporary files)"
