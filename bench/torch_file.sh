#!/usr/bin/env bash
# Torch-file benchmark: uckpt's writer against `cp`, its reader against `cat`,
# on a ~1.2 GiB state dict of 340 fp32/bf16 tensors (see bench/README.md).
# Usage: bash bench/torch_file.sh BUILD_DIR [RUNS]     (RUNS: best of, default 5)
# Exit status 0 when both targets pass, 1 when one fails, 2 on errors.
set -euo pipefail

build=${1:?usage: bench/torch_file.sh BUILD_DIR [RUNS]}
runs=${2:-5}
bench="$build/bench/torch_file_bench"
[ -x "$bench" ] || { echo "torch_file.sh: $bench not built (cmake --build $build --target torch_file_bench)" >&2; exit 2; }

# Scratch files on the build tree's filesystem; removed however we exit.
work=$(mktemp -d "$(cd "$build" && pwd)/torch-file-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
file="$work/state_dict.pt"
copy="$work/copy.pt"

# Plain cp copies in the kernel (copy_file_range); on filesystems that can
# share blocks it would clone instead, which copies nothing.
fs=$(stat -f -c %T "$work")
case "$fs" in
  btrfs | xfs | bcachefs | zfs) cp_flags=(--reflink=never) ;;
  *) cp_flags=() ;;
esac

calc() { awk "BEGIN { print $1 }"; }
field() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p" <<<"$2"; }

# timed CMD...: "<wall> <cpu>" seconds of one run (cpu: user + system).
timed() {
  local t wall user sys
  t=$({ TIMEFORMAT='%3R %3U %3S'; time "$@" >/dev/null; } 2>&1)
  read -r wall user sys <<<"$t"
  echo "$wall $(calc "$user + $sys")"
}
# keep_best VAR "<wall> <cpu> [rest]": VAR holds the line with the smallest wall.
keep_best() {
  local -n best=$1
  if [ -z "$best" ] || [ "$(calc "${2%% *} < ${best%% *}")" = 1 ]; then best=$2; fi
}
# One run of our writer or reader, as "<wall> <cpu> <its output line>".
ours() {
  local out
  out=$("$bench" "$@" --runs 1)
  echo "$(field best_s "$out") $(field cpu_s "$out") $out"
}
fresh_copy() { rm -f "$copy" && sync; }  # as the writer does before each run

cat_file() { cat "$file"; }
cp_file() { cp "${cp_flags[@]}" "$file" "$copy"; }
cp_sync_file() { cp "${cp_flags[@]}" "$file" "$copy" && sync "$copy"; }

echo "torch-file benchmark: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $fs, best of $runs runs"

# Rounds alternate ours and the baseline, so that load from other processes
# falls on both alike. The file written last stays in the page cache.
w="" cp_best="" wd="" cp_sync_best=""
for ((i = 0; i < runs; i++)); do
  keep_best w "$(ours write "$file")"
  fresh_copy
  keep_best cp_best "$(timed cp_file)"
  keep_best wd "$(ours write "$file" --durable)"
  fresh_copy
  keep_best cp_sync_best "$(timed cp_sync_file)"
done
rm -f "$copy"

# An independent check of what we wrote: Python's zipfile verifies every CRC-32.
if [ -x /usr/bin/python3 ]; then
  /usr/bin/python3 -c 'import sys, zipfile; bad = zipfile.ZipFile(sys.argv[1]).testzip(); sys.exit(bad and "CRC mismatch in " + bad)' "$file"
fi

# Reads, page cache warm.
cat "$file" >/dev/null
r="" cat_best=""
for ((i = 0; i < runs; i++)); do
  keep_best r "$(ours read "$file")"
  keep_best cat_best "$(timed cat_file)"
done
read -r cat_s cat_cpu <<<"$cat_best"
read -r cp_s cp_cpu <<<"$cp_best"
read -r cp_sync_s cp_sync_cpu <<<"$cp_sync_best"

if [ "$(field checksum "$w")" != "$(field checksum "$r")" ]; then
  echo "torch_file.sh: the reader saw different tensor bytes than the writer wrote" >&2
  exit 2
fi

file_bytes=$(field file_bytes "$w")
read_ratio=$(calc "$(field best_s "$r") / $cat_s")
write_ratio=$(calc "$(field best_s "$w") / $cp_s")
durable_ratio=$(calc "$(field best_s "$wd") / $cp_sync_s")
verdict() { [ "$(calc "$1 <= $2")" = 1 ] && echo PASS || echo FAIL; }

echo "file: $(calc "$file_bytes / 1073741824") GiB ($file_bytes bytes), $(field tensors "$w") tensors"
row() {  # name wall cpu [ratio target verdict]
  printf '%-46s %8.3f %8.3f %8.0f' "$1" "$2" "$3" "$(calc "$file_bytes / 1048576 / $2")"
  [ $# -gt 3 ] && printf ' %7.3f %7s  %s' "$4" "$5" "$6"
  printf '\n'
}
printf '%-46s %8s %8s %8s %7s %7s  %s\n' "measurement (best of $runs)" "wall s" "cpu s" "MiB/s" "ratio" "target" "result"
row "cat FILE > /dev/null (page cache warm)" "$cat_s" "$cat_cpu"
row "uckpt load + read every tensor byte (warm)" "$(field best_s "$r")" "$(field cpu_s "$r")" \
  "$read_ratio" "<= 1.2" "$(verdict "$read_ratio" 1.2)"
row "cp FILE COPY" "$cp_s" "$cp_cpu"
row "uckpt save, not durable" "$(field best_s "$w")" "$(field cpu_s "$w")" \
  "$write_ratio" "<= 1.3" "$(verdict "$write_ratio" 1.3)"
row "cp FILE COPY && sync COPY" "$cp_sync_s" "$cp_sync_cpu"
row "uckpt save, durable (fsync file and folder)" "$(field best_s "$wd")" "$(field cpu_s "$wd")" \
  "$durable_ratio" "-" "(info)"

[ "$(verdict "$read_ratio" 1.2)" = PASS ] && [ "$(verdict "$write_ratio" 1.3)" = PASS ]
