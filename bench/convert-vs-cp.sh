#!/bin/bash
# `uckpt convert` against copying the same input folder, with and without
# making the copy durable (issue "Checkpoints at the speed of the disk",
# part 2). For each world size it writes a synthetic ZeRO-2 checkpoint with
# bench/convert_gen (fp32 master + Adam moments, --params elements split over
# the ranks) and times, in alternating rounds:
#   cp -r IN COPY                      (the copy stays in the page cache)
#   cp -r IN COPY && sync -f COPY      (the copy is on disk: syncfs)
#   uckpt convert IN OUT               (default: ends durable, with manifest)
# Before every timed command the previous output is deleted, all dirty
# pages are written back (`sync`) and the input is read once more so that it
# is in the page cache, none of it timed: no command pays for another's
# writeback, and every command starts with a warm input. Nothing is dropped
# from the cache.
# Prints one table: best and median wall time of --runs rounds, median CPU
# time, and ratios of the best wall times. Exit status 0 when every convert / (cp -r + sync) ratio is <= 1.0.
# Usage: bench/convert-vs-cp.sh [--params 1.7e8] [--dp "1 4"] [--runs 5]
#                               [--build build] [--uckpt PATH] [--gen PATH]
#                               [--dir /tmp/uckpt-bench-cvcp] [--keep] [--old-uckpt PATH]
# --old-uckpt: also time this (older) uckpt's convert in the same rounds, for
# a before/after comparison under the same load.
set -euo pipefail
PARAMS=1.7e8 DPS="1 4" RUNS=5 BUILD=build KEEP=0 UCKPT= GEN= OLD=
DIR=${TMPDIR:-/tmp}/uckpt-bench-cvcp
USAGE=$(sed -n '/^# Usage:/,/^[^#]/p' "$0" | grep '^#' | cut -c3-)
while [ $# -gt 0 ]; do
  case $1 in
    --params) PARAMS=$2; shift 2 ;;
    --dp) DPS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --build) BUILD=$2; shift 2 ;;
    --uckpt) UCKPT=$2; shift 2 ;;
    --gen) GEN=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --old-uckpt) OLD=$2; shift 2 ;;
    -h|--help) echo "$USAGE"; exit 0 ;;
    *) echo "unknown argument $1" >&2; echo "$USAGE" >&2; exit 2 ;;
  esac
done
UCKPT=${UCKPT:-$BUILD/src/cli/uckpt} GEN=${GEN:-$BUILD/bench/convert_gen}
for b in "$UCKPT" "$GEN"; do [ -x "$b" ] || { echo "missing $b (build first: cmake --build $BUILD)" >&2; exit 2; }; done
mkdir -p "$DIR"
[ $KEEP = 1 ] || trap 'rm -rf "$DIR"' EXIT

now() { date +%s.%N; }
calc() { awk "BEGIN { printf \"%.${2:-3}f\", $1 }"; }
best() { printf "%s\n" "$@" | sort -g | head -1; }
median() { printf "%s\n" "$@" | sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
# Time one command, after deleting its output and writing back every dirty
# page (neither timed). Prints "WALL CPU" (CPU: user + system seconds of the
# command and its children; writeback done by the kernel's threads is not in it).
timed() {  # timed OUTPUT COMMAND...
  rm -rf "$1" "$DIR/latest_universal"; sync
  cat "$IN"/* > /dev/null  # (again: the kernel may have reclaimed some of it)
  /usr/bin/time -f "%e %U %S" -o "$DIR/time" "${@:2}"
  awk '{ printf "%.3f %.2f\n", $1, $2 + $3 }' "$DIR/time"
}
fs=$(stat -f -c %T "$DIR")
CP=(cp -r)
case $fs in btrfs|xfs|bcachefs|zfs) CP=(cp -r --reflink=never) ;; esac
[ -x /usr/bin/time ] || { echo "needs /usr/bin/time (Debian package time)" >&2; exit 2; }

CP_SYNC=(bash -c '"${@:3}" "$1" "$2" && sync -f "$2"' _)

rows=() status=0
for DP in $DPS; do
  IN=$DIR/dp$DP/global_step1
  if [ ! -e "$IN/../.params-$PARAMS" ]; then
    rm -rf "$DIR/dp$DP"; mkdir -p "$DIR/dp$DP"
    "$GEN" --params "$PARAMS" --dp "$DP" "$IN" >/dev/null
    touch "$IN/../.params-$PARAMS"
  fi
  cat "$IN"/* > /dev/null  # the input is in the page cache for every command
  BYTES=$(du -sb "$IN" | cut -f1)
  cp_t=() cps_t=() cv_t=() cp_c=() cps_c=() cv_c=() old_t=() old_c=()
  for ((i = 0; i < RUNS; i++)); do
    read -r w c < <(timed "$DIR/copy" "${CP[@]}" "$IN" "$DIR/copy"); cp_t+=("$w"); cp_c+=("$c")
    read -r w c < <(timed "$DIR/copy" "${CP_SYNC[@]}" "$IN" "$DIR/copy" "${CP[@]}"); cps_t+=("$w"); cps_c+=("$c")
    read -r w c < <(timed "$DIR/out" "$UCKPT" convert -q "$IN" "$DIR/out"); cv_t+=("$w"); cv_c+=("$c")
    if [ -n "$OLD" ]; then
      read -r w c < <(timed "$DIR/out" "$OLD" convert -q "$IN" "$DIR/out"); old_t+=("$w"); old_c+=("$c")
    fi
  done
  rm -rf "$DIR/copy" "$DIR/out" "$DIR/latest_universal"
  b_cp=$(best "${cp_t[@]}") b_cps=$(best "${cps_t[@]}") b_cv=$(best "${cv_t[@]}")
  r_cps=$(calc "$b_cv / $b_cps" 2)
  awk "BEGIN { exit !($r_cps > 1.0) }" && status=1
  cell() { printf "%.2f/%.2f (%.2f)" "$1" "$2" "$3"; }
  rows+=("$(printf "%-3s %6.2f  %-19s %-19s %-19s %6s %8s" "$DP" "$(calc "$BYTES / 1e9")" \
    "$(cell "$b_cp" "$(median "${cp_t[@]}")" "$(median "${cp_c[@]}")")" \
    "$(cell "$b_cps" "$(median "${cps_t[@]}")" "$(median "${cps_c[@]}")")" \
    "$(cell "$b_cv" "$(median "${cv_t[@]}")" "$(median "${cv_c[@]}")")" \
    "$(calc "$b_cv / $b_cp" 2)" "$r_cps")")
  if [ -n "$OLD" ]; then
    b_old=$(best "${old_t[@]}")
    rows+=("$(printf "%-3s %6s  %-19s %-19s %-19s %6s %8s" "" "" "" "old uckpt convert:" \
      "$(cell "$b_old" "$(median "${old_t[@]}")" "$(median "${old_c[@]}")")" \
      "$(calc "$b_old / $b_cp" 2)" "$(calc "$b_old / $b_cps" 2)")")
  fi
done

echo "== uckpt convert vs cp -r: ZeRO-2, $PARAMS parameters, fp32 + Adam, $(nproc) cores, $fs, $RUNS rounds, input in page cache"
echo "times: best/median wall seconds (median CPU seconds, user + system); ratios of the best wall times"
echo "convert ends durable (early writeback, syncfs, rename) and writes the manifest; cp -r does not sync; +sync = sync -f COPY"
printf "%-3s %6s  %-19s %-19s %-19s %6s %8s\n" "ws" "GB" "cp -r" "cp -r + sync" "uckpt convert" "/cp" "/cp+sync"
for r in "${rows[@]}"; do echo "$r"; done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
exit $status
