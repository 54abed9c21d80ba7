#!/usr/bin/env bash
# Torch-file benchmark: uckpt's writer against `cp`, its reader against `cat`,
# on a ~1.2 GiB state dict of 340 fp32/bf16 tensors (see bench/README.md).
# Usage: bash bench/torch_file.sh BUILD_DIR [RUNS]
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

now() { date +%s.%N; }
calc() { awk "BEGIN { print $1 }"; }
# best_of N CMD...: the shortest wall time of N runs, each after removing
# $copy and writing back dirty pages (neither timed), as the writer runs do.
best_of() {
  local n=$1 best="" t0 t1 dt
  shift
  for ((i = 0; i < n; i++)); do
    rm -f "$copy"
    sync
    t0=$(now)
    "$@"
    t1=$(now)
    dt=$(calc "$t1 - $t0")
    if [ -z "$best" ] || [ "$(calc "$dt < $best")" = 1 ]; then best=$dt; fi
  done
  echo "$best"
}
field() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p" <<<"$2"; }

cat_file() { cat "$file" >/dev/null; }
cp_file() { cp --reflink=never "$file" "$copy"; }
cp_sync_file() { cp --reflink=never "$file" "$copy" && sync "$copy"; }

echo "torch-file benchmark: $(nproc) cores, $(uname -r), scratch $work, best of $runs runs"

# Writes (the file stays in the page cache for what follows).
w=$("$bench" write "$file" --runs "$runs")
write_s=$(field best_s "$w")
wd=$("$bench" write "$file" --durable --runs "$runs")
write_durable_s=$(field best_s "$wd")
file_bytes=$(field file_bytes "$w")
tensor_bytes=$(field bytes "$w")
tensors=$(field tensors "$w")
cp_s=$(best_of "$runs" cp_file)
cp_sync_s=$(best_of "$runs" cp_sync_file)
rm -f "$copy"

# Reads, page cache warm.
cat_file
r=$("$bench" read "$file" --runs "$runs")
read_s=$(field best_s "$r")
cat_s=$(best_of "$runs" cat_file)

if [ "$(field checksum "$w")" != "$(field checksum "$r")" ]; then
  echo "torch_file.sh: the reader saw different tensor bytes than the writer wrote" >&2
  exit 1
fi

ratio() { calc "$1 / $2"; }
verdict() { [ "$(calc "$1 <= $2")" = 1 ] && echo PASS || echo FAIL; }
read_ratio=$(ratio "$read_s" "$cat_s")
write_ratio=$(ratio "$write_s" "$cp_s")
durable_ratio=$(ratio "$write_durable_s" "$cp_sync_s")
gib=$(calc "$file_bytes / 1073741824")
mibps() { calc "int($file_bytes / 1048576 / $1)"; }

echo "file: $gib GiB ($file_bytes bytes), $tensors tensors, $tensor_bytes tensor bytes"
printf '%-44s %9s %9s %7s %7s %s\n' "measurement" "seconds" "MiB/s" "ratio" "target" "result"
printf '%-44s %9.4f %9d\n' "cat FILE > /dev/null (warm)" "$cat_s" "$(mibps "$cat_s")"
printf '%-44s %9.4f %9d %7.3f %7s %s\n' "uckpt load + read every tensor byte (warm)" "$read_s" "$(mibps "$read_s")" \
  "$read_ratio" "1.20" "$(verdict "$read_ratio" 1.2)"
printf '%-44s %9.4f %9d\n' "cp FILE COPY" "$cp_s" "$(mibps "$cp_s")"
printf '%-44s %9.4f %9d %7.3f %7s %s\n' "uckpt save (not durable)" "$write_s" "$(mibps "$write_s")" \
  "$write_ratio" "1.30" "$(verdict "$write_ratio" 1.3)"
printf '%-44s %9.4f %9d\n' "cp FILE COPY && sync COPY" "$cp_sync_s" "$(mibps "$cp_sync_s")"
printf '%-44s %9.4f %9d %7.3f %7s %s\n' "uckpt save (durable: fsync file and folder)" "$write_durable_s" \
  "$(mibps "$write_durable_s")" "$durable_ratio" "-" "(info)"

[ "$(verdict "$read_ratio" 1.2)" = PASS ] && [ "$(verdict "$write_ratio" 1.3)" = PASS ]
