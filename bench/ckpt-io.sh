#!/bin/bash
# uckpt's checkpoint I/O against copying the same bytes, in one run: the
# engine's synchronous save, the time an async save blocks training, a resume
# at the same and at another world size (straight from the rank files), and
# `uckpt convert` of the saved folder — each against `cp -r` and
# `cp -r` + `sync -f` of that folder on the same disk.
#
# A GPT-2 (--layers x --embd, fp32 + AdamW, ZeRO-2) is trained one step by
# `uckpt train`, which prints the save and load times it measures itself
# ("saved ... in", "snapshot ... in", "loaded ... in"; process start, model
# set-up and the step are not in them). Before every timed command all dirty
# pages are written back (`sync`, not timed) and the inputs are read once so
# they are in the page cache; nothing is dropped from the cache.
# Prints best/median wall seconds of --runs rounds and ratios of the best
# times. Exit status 0 when the sync save and convert are <= 1.0x cp -r + sync.
# Usage: bench/ckpt-io.sh [--layers 6] [--embd 768] [--runs 3] [--build build]
#                         [--uckpt PATH] [--dir /tmp/uckpt-bench-io] [--keep]
set -euo pipefail
LAYERS=6 EMBD=768 RUNS=3 BUILD=build KEEP=0 UCKPT=
DIR=${TMPDIR:-/tmp}/uckpt-bench-io
USAGE=$(sed -n '/^# Usage:/,/^[^#]/p' "$0" | grep '^#' | cut -c3-)
while [ $# -gt 0 ]; do
  case $1 in
    --layers) LAYERS=$2; shift 2 ;;
    --embd) EMBD=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --build) BUILD=$2; shift 2 ;;
    --uckpt) UCKPT=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) echo "$USAGE"; exit 0 ;;
    *) echo "unknown argument $1" >&2; echo "$USAGE" >&2; exit 2 ;;
  esac
done
UCKPT=$(realpath "${UCKPT:-$BUILD/src/cli/uckpt}")
[ -x "$UCKPT" ] || { echo "missing $UCKPT (build first: cmake --build $BUILD --target uckpt)" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "needs /usr/bin/time (Debian package time)" >&2; exit 2; }
rm -rf "$DIR"; mkdir -p "$DIR"; cd "$DIR"
[ $KEEP = 1 ] || trap 'rm -rf "$DIR"' EXIT

calc() { awk "BEGIN { printf \"%.${2:-3}f\", $1 }"; }
best() { printf "%s\n" "$@" | sort -g | head -1; }
median() { printf "%s\n" "$@" | sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
warm() { find "$@" -type f -exec cat {} + > /dev/null; }
wall() { /usr/bin/time -f "%e" -o time "$@" > /dev/null 2>&1; cat time; }
fs=$(stat -f -c %T "$DIR")
CP=(cp -r)
case $fs in btrfs|xfs|bcachefs|zfs) CP=(cp -r --reflink=never) ;; esac

config() {  # config ASYNC WORLD
  cat > ds$1$2.json <<JSON
{"train_batch_size": $((2 * $2)), "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
 "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "checkpoint": {"async_save": $1}}
JSON
}
config false 1; config true 1; config false 2
MODEL="--n_layer $LAYERS --n_head 12 --n_embd $EMBD --vocab_size 512 --n_positions 64 --seq_len 64 --no_progress --log_dir logs"
train() {  # train CONFIG ARGS...: prints uckpt train's stderr
  "$UCKPT" train --config "$1" $MODEL "${@:2}" 2>&1 >/dev/null
}
field() { sed -n "s/^uckpt train: $1.* in \([0-9.]*\) s.*/\1/p" | tail -1; }

save_t=() async_t=() async_total=() load_t=() reshard_t=() cp_t=() cps_t=() cv_t=()
for ((i = 0; i < RUNS; i++)); do
  # Sync save: a fresh run of one step that saves at its end.
  rm -rf s; sync
  out=$(train dsfalse1.json --steps 1 --checkpoint_dir s --run_name s$i)
  # returned ("saved ... in"), then durable (a new tag is synced after the save returns)
  durable=$(echo "$out" | sed -n 's/^uckpt train: last save durable after \([0-9.]*\) s.*/\1/p')
  save_t+=("$(calc "$(echo "$out" | field saved) + ${durable:-0}")")
  # Async save: the time the step blocked, and until it was published.
  rm -rf a; sync
  out=$(train dstrue1.json --steps 1 --checkpoint_dir a --run_name a$i)
  blocked=$(echo "$out" | field "snapshot")
  more=$(echo "$out" | sed -n 's/^uckpt train: background save published after \([0-9.]*\) s.*/\1/p')
  async_t+=("$blocked"); async_total+=("$(calc "$blocked + $more")")
  # Resume at the same size, and at 2 ranks from the 1-rank files.
  sync; warm s
  load_t+=("$(train dsfalse1.json --steps 1 --checkpoint_dir s --resume --run_name l$i | field loaded)")
  sync; warm s
  out=$("$UCKPT" launch -n 2 --master_port 0 -- "$UCKPT" train --config dsfalse2.json $MODEL --threads 1 --steps 1 \
        --checkpoint_dir s --resume --run_name r$i 2>&1 >/dev/null)
  reshard_t+=("$(echo "$out" | field loaded)")
  # The same bytes copied, and converted.
  rm -rf copy; sync; warm s/global_step1
  cp_t+=("$(wall "${CP[@]}" s/global_step1 copy)")
  rm -rf copy; sync; warm s/global_step1
  cps_t+=("$(wall bash -c '"${@:3}" "$1" "$2" && sync -f "$2"' _ s/global_step1 copy "${CP[@]}")")
  rm -rf copy u latest_universal; sync; warm s/global_step1
  cv_t+=("$(wall "$UCKPT" convert -q s/global_step1 u)")
  rm -rf copy u latest_universal
done
BYTES=$(du -sb s/global_step1 | cut -f1)
b_cp=$(best "${cp_t[@]}") b_cps=$(best "${cps_t[@]}")
row() {  # row NAME TIMES...
  local b
  b=$(best "${@:2}")
  printf "%-40s %7.3f %7.3f %8s %10s\n" "$1" "$b" "$(median "${@:2}")" "$(calc "$b / $b_cp" 2)" "$(calc "$b / $b_cps" 2)"
}
echo "== uckpt checkpoint I/O vs cp: GPT-2 ${LAYERS}x${EMBD}, fp32 + AdamW, ZeRO-2, one rank; tag folder $(calc "$BYTES / 1e9") GB"
echo "   $(nproc) cores, $fs, $RUNS rounds, inputs in page cache; best/median wall seconds; ratios of the best times"
printf "%-40s %7s %7s %8s %10s\n" "" "best" "median" "/cp -r" "/cp+sync"
row "cp -r" "${cp_t[@]}"
row "cp -r + sync" "${cps_t[@]}"
row "uckpt save (sync, until durable, manifest)" "${save_t[@]}"
row "uckpt async save: training blocked" "${async_t[@]}"
row "uckpt async save: until published" "${async_total[@]}"
row "uckpt load, same world size" "${load_t[@]}"
row "uckpt load, 1 -> 2 ranks (no convert)" "${reshard_t[@]}"
row "uckpt convert (durable, manifest)" "${cv_t[@]}"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
for t in "$(best "${save_t[@]}")" "$(best "${cv_t[@]}")"; do awk "BEGIN { exit !($t > $b_cps) }" && status=1; done
exit $status
