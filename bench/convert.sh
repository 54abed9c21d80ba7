#!/bin/bash
# Benchmark of `uckpt convert` (issue 3): writes a synthetic ZeRO-2 checkpoint
# (default 300 M parameters, fp32 master + Adam moments, world size 4) and
# converts it, printing
#   - convert wall time / `cp -r` wall time of the same folder (page cache warm
#     for both; target <= 1.2x),
#   - convert time with -j 1, -j 2 and the default (one thread per core),
#   - peak RSS (target <= 2 x the largest parameter's state + 256 MiB),
#   - bytes read and written.
# Usage: bench/convert.sh [--params 3e8] [--dp 4] [--build build] [--dir /tmp/uckpt-bench-convert] [--keep]
set -euo pipefail
PARAMS=3e8 DP=4 BUILD=build DIR=${TMPDIR:-/tmp}/uckpt-bench-convert KEEP=0
while [ $# -gt 0 ]; do
  case $1 in
    --params) PARAMS=$2; shift 2 ;;
    --dp) DP=$2; shift 2 ;;
    --build) BUILD=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
UCKPT=$BUILD/src/cli/uckpt GEN=$BUILD/bench/convert_gen
for b in "$UCKPT" "$GEN"; do [ -x "$b" ] || { echo "missing $b (build first: cmake --build $BUILD)" >&2; exit 2; }; done
[ -x /usr/bin/time ] || { echo "needs /usr/bin/time (Debian package 'time')" >&2; exit 2; }
mkdir -p "$DIR"
[ $KEEP = 1 ] || trap 'rm -rf "$DIR"' EXIT
IN=$DIR/global_step1

if [ ! -e "$IN/.params-$PARAMS-dp$DP" ]; then
  rm -rf "$IN"
  "$GEN" --params "$PARAMS" --dp "$DP" "$IN"
  touch "$IN/.params-$PARAMS-dp$DP"
fi
IN_BYTES=$(du -sb "$IN" | cut -f1)
cat "$IN"/*.pt > /dev/null  # warm the page cache
sync

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc; }

# cp -r of the same folder (best of 2), then drop the copy.
cp_times=
for i in 1 2; do
  rm -rf "$DIR/copy"; sync
  t0=$(now); cp -r "$IN" "$DIR/copy"; t1=$(now)
  cp_times="$cp_times$(secs "$t0" "$t1")
"
done
best_cp=$(echo -n "$cp_times" | sort -n | head -1)
rm -rf "$DIR/copy"; sync

# One conversion under /usr/bin/time: prints "seconds rss_kib".
convert() {
  rm -rf "$DIR/out"; sync
  local log=$DIR/time.log
  /usr/bin/time -f "%e %M" -o "$log" "$UCKPT" convert "$IN" "$DIR/out" --no-sync "$@" 2>"$DIR/convert.err" >/dev/null
  SUMMARY=$(grep "^convert: wrote" "$DIR/convert.err" || true)
  cat "$log"
}
best() {  # best of 2 runs: "seconds rss"
  local a b
  a=$(convert "$@"); b=$(convert "$@")
  echo "$a
$b" | sort -n | head -1
}
read -r t_default rss_default < <(best)
read -r t_j1 rss_j1 < <(best -j 1)
read -r t_j2 rss_j2 < <(best -j 2)
convert >/dev/null
OUT_BYTES=$(du -sb "$DIR/out" | cut -f1)
rm -rf "$DIR/out"

BIG_ELEMS=$(( 50257 * 1024 ))  # wte.weight, the largest parameter of convert_gen's model
LIMIT_KIB=$(( (2 * BIG_ELEMS * 12 + 256 * 1024 * 1024) / 1024 ))
RSS=$(printf "%s\n%s\n%s\n" "$rss_default" "$rss_j1" "$rss_j2" | sort -n | tail -1)

echo "== uckpt convert benchmark: $PARAMS parameters, ZeRO-2, world size $DP, $(nproc) cores"
printf "input folder           %s (%.2f GB)\n" "$IN" "$(echo "$IN_BYTES / 1000000000" | bc -l)"
printf "cp -r                  %.2f s\n" "$best_cp"
printf "convert (default -j)   %.2f s   = %.2fx cp -r (target <= 1.2x)\n" "$t_default" "$(echo "$t_default / $best_cp" | bc -l)"
printf "convert -j 1           %.2f s\n" "$t_j1"
printf "convert -j 2           %.2f s   (-j1/-j2 = %.2f)\n" "$t_j2" "$(echo "$t_j1 / $t_j2" | bc -l)"
printf "peak RSS               %.0f MiB (target <= %.0f MiB = 2 x largest param state + 256 MiB)\n" \
  "$(echo "$RSS / 1024" | bc -l)" "$(echo "$LIMIT_KIB / 1024" | bc -l)"
echo "bytes                  $SUMMARY"
printf "output folder          %.2f GB\n" "$(echo "$OUT_BYTES / 1000000000" | bc -l)"
