#!/bin/bash
# Benchmark of checkpoint manifests (issue 6): converts a synthetic ZeRO-2
# checkpoint (bench/convert_gen; default 100 M parameters, world size 4) into a
# universal folder and prints
#   - `uckpt verify OUT` (every byte hashed with XXH64) against
#     `cat FILES > /dev/null` of the same files: the ratio says how close
#     verifying is to merely reading the files (page cache warm for both);
#   - the same with -j 1 (one hashing thread) and --sizes-only;
#   - `uckpt convert` with and without writing the manifest (hidden flag
#     --no-manifest): what the manifest adds to a conversion.
# Each time is the best of --runs runs; outputs are written with --no-sync
# (as in bench/convert.sh), so the disk's write speed does not hide the cost.
# Usage: bench/manifest.sh [--params 1e8] [--dp 4] [--runs 3] [--build build]
#                          [--uckpt PATH] [--gen PATH] [--dir /tmp/uckpt-bench-manifest] [--keep]
set -euo pipefail
PARAMS=1e8 DIR=${TMPDIR:-/tmp}/uckpt-bench-manifest
USAGE=$(sed -n '/^# Usage:/,/^[^#]/p' "$0" | grep '^#' | cut -c3-)
source "$(dirname "$0")/synthetic-ckpt.sh"
OUT=$DIR/global_step1_universal

calc() { awk "BEGIN { printf \"%.2f\", $1 }"; }
min() { sort -g | head -1; }
# uckpt's own timings (its summary lines), so that process start-up (loading
# libtorch: about a second) is not counted; `cat` is timed by the shell.
verify_time() { "$UCKPT" verify "$@" | tail -1 | sed 's/.*, \([0-9.]*\)s$/\1/'; }
convert_time() {
  rm -rf "$OUT"
  "$UCKPT" convert "$IN" "$OUT" --no-sync "$@" 2>&1 | grep "^convert: wrote" | sed 's/.* in \([0-9.]*\)s,.*/\1/'
}
best() { local t=(); for ((i = 0; i < RUNS; i++)); do t+=("$("$@")"); done; printf "%s\n" "${t[@]}" | min; }
cat_time() {
  local t0 t1
  t0=$(date +%s.%N); cat "${FILES[@]}" > /dev/null; t1=$(date +%s.%N)
  calc "$t1 - $t0"
}

# Conversions, alternating so that both see the same machine state.
with=() without=()
for ((r = 0; r < RUNS; r++)); do
  without+=("$(convert_time --no-manifest)")
  with+=("$(convert_time)")
done
T_WITHOUT=$(printf "%s\n" "${without[@]}" | min)
T_WITH=$(printf "%s\n" "${with[@]}" | min)
[ -f "$OUT/uckpt-manifest.json" ] || { echo "convert wrote no manifest" >&2; exit 1; }
"$UCKPT" verify "$OUT" | tail -1 | grep -q ": OK:" || { echo "verify of the fresh output failed" >&2; exit 1; }

mapfile -t FILES < <(find "$OUT" -type f ! -name uckpt-manifest.json)
OUT_BYTES=$(du -sb "$OUT" | cut -f1)
cat "${FILES[@]}" > /dev/null  # warm
T_CAT=$(best cat_time)
T_VERIFY=$(best verify_time "$OUT")
T_VERIFY_J1=$(best verify_time -j 1 "$OUT")
T_SIZES=$(best verify_time --sizes-only "$OUT")
T_VERIFY_IN=$(best verify_time "$IN")
LOAD=$(cut -d' ' -f1 /proc/loadavg)

echo "== checkpoint manifest benchmark: $PARAMS parameters, ZeRO-2, world size $DP, $(nproc) cores (load $LOAD), best of $RUNS"
echo "universal folder                  $(calc "$OUT_BYTES / 1e9") GB in ${#FILES[@]} files"
echo "cat FILES > /dev/null             $T_CAT s ($(calc "$OUT_BYTES / 1e9 / $T_CAT") GB/s)"
echo "uckpt verify (XXH64, default -j)  $T_VERIFY s = $(calc "$T_VERIFY / $T_CAT")x cat ($(calc "$OUT_BYTES / 1e9 / $T_VERIFY") GB/s)"
echo "uckpt verify -j 1                 $T_VERIFY_J1 s = $(calc "$T_VERIFY_J1 / $T_CAT")x cat"
echo "uckpt verify --sizes-only         $T_SIZES s"
echo "uckpt verify of the ZeRO input    $T_VERIFY_IN s (no manifest: parse + CRC-32 of every record, $(calc "$(du -sb "$IN" | cut -f1) / 1e9") GB)"
echo "convert without manifest          $T_WITHOUT s"
echo "convert with manifest             $T_WITH s = $(calc "$T_WITH / $T_WITHOUT")x (+$(calc "($T_WITH - $T_WITHOUT) / $T_WITHOUT * 100")%)"
